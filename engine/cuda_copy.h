// The batched copy kernel's launcher, compiled by nvcc (engine/cuda_copy.cu). Internal to the
// engine: callers use CudaCopyPieces (engine/cuda.h).
#ifndef FERRY_ENGINE_CUDA_COPY_H_
#define FERRY_ENGINE_CUDA_COPY_H_

#include <cuda_runtime_api.h>

#include <cstdint>

namespace ferry::engine {

// A piece of at most kCopyChunkBytes; the kernel's unit of work.
struct CopyChunk {
  uint64_t dst;
  uint64_t src;
  uint64_t length;
};
inline constexpr uint64_t kCopyChunkBytes = 256 << 10;

// Launches one kernel that copies `count` chunks (`chunks` in device memory) on `stream`.
cudaError_t LaunchCopyChunks(const CopyChunk* chunks, uint64_t count, int sm_count,
                             cudaStream_t stream);

}  // namespace ferry::engine

#endif  // FERRY_ENGINE_CUDA_COPY_H_
