#include "engine/cuda_copy.h"

namespace ferry::engine {
namespace {

constexpr unsigned kThreads = 512;

// One block per chunk (grid-stride over chunks). Source and destination with the same
// alignment mod 16 go as 16-byte words, four loads in flight per thread; others go bytewise.
__global__ void CopyChunksKernel(const CopyChunk* chunks, uint64_t count) {
  for (uint64_t c = blockIdx.x; c < count; c += gridDim.x) {
    const CopyChunk k = chunks[c];
    char* dst = reinterpret_cast<char*>(k.dst);
    const char* src = reinterpret_cast<const char*>(k.src);
    uint64_t len = k.length;
    if (((k.dst ^ k.src) & 15) == 0) {
      const uint64_t head = min(len, (16 - (k.dst & 15)) & 15);
      for (uint64_t i = threadIdx.x; i < head; i += blockDim.x) dst[i] = src[i];
      dst += head;
      src += head;
      len -= head;
      const uint64_t words = len / 16;
      const uint4* s4 = reinterpret_cast<const uint4*>(src);
      uint4* d4 = reinterpret_cast<uint4*>(dst);
      const uint64_t step = blockDim.x;
      uint64_t i = threadIdx.x;
      for (; i + 3 * step < words; i += 4 * step) {
        const uint4 a = s4[i], b = s4[i + step], e = s4[i + 2 * step], f = s4[i + 3 * step];
        d4[i] = a;
        d4[i + step] = b;
        d4[i + 2 * step] = e;
        d4[i + 3 * step] = f;
      }
      for (; i < words; i += step) d4[i] = s4[i];
      for (uint64_t j = words * 16 + threadIdx.x; j < len; j += step) dst[j] = src[j];
    } else {
      for (uint64_t i = threadIdx.x; i < len; i += blockDim.x) dst[i] = src[i];
    }
  }
}

}  // namespace

cudaError_t LaunchCopyChunks(const CopyChunk* chunks, uint64_t count, int sm_count,
                             cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  const uint64_t most = static_cast<uint64_t>(sm_count > 0 ? sm_count : 1) * 4;
  const unsigned blocks = static_cast<unsigned>(count < most ? count : most);
  CopyChunksKernel<<<blocks, kThreads, 0, stream>>>(chunks, count);
  return cudaGetLastError();
}

}  // namespace ferry::engine
