// engine/cuda.h with the CUDA runtime (builds that found the toolkit).
#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstring>
#include <list>
#include <mutex>
#include <string_view>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "engine/cuda.h"
#include "engine/cuda_copy.h"
#include "engine/fabric.h"
#include "engine/status.h"

namespace ferry::engine {
namespace {

absl::Status CudaError(cudaError_t e, std::string_view what) {
  cudaGetLastError();  // clears a sticky-free error so that the next call starts clean
  const std::string message =
      absl::StrCat(std::string(what), ": ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ")");
  switch (e) {
    case cudaErrorMemoryAllocation:
      return absl::ResourceExhaustedError(message);
    case cudaErrorInvalidDevice:
    case cudaErrorNoDevice:
      return absl::NotFoundError(message);
    case cudaErrorInvalidValue:
      return absl::InvalidArgumentError(message);
    default:
      return absl::InternalError(message);
  }
}

#define FERRY_CUDA_RETURN_IF_ERROR(call, what)        \
  do {                                                \
    if (cudaError_t e_ = (call); e_ != cudaSuccess) { \
      return CudaError(e_, what);                     \
    }                                                 \
  } while (false)

int SmCount(int device) {
  static absl::Mutex mu;
  static auto* counts = new absl::flat_hash_map<int, int>();
  absl::MutexLock lock(&mu);
  auto [it, added] = counts->try_emplace(device, 0);
  if (added) cudaDeviceGetAttribute(&it->second, cudaDevAttrMultiProcessorCount, device);
  return it->second;
}

using GetAddressRange = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);

GetAddressRange AddressRangeFn() {
  static GetAddressRange fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &p, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      return GetAddressRange{nullptr};
    }
    return reinterpret_cast<GetAddressRange>(p);
  }();
  return fn;
}

}  // namespace

bool CudaBuilt() { return true; }

int CudaDeviceCount() {
  // Asked once: without a driver every call would look for libcuda again.
  static const int count = [] {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
      cudaGetLastError();
      return 0;
    }
    return n;
  }();
  return count;
}

absl::Status CheckCudaDevice(int index) {
  const int n = CudaDeviceCount();
  if (index < 0 || index >= n) {
    return absl::NotFoundError(absl::StrCat("no GPU cuda:", index, ": this host has ", n,
                                            n == 1 ? " GPU" : " GPUs"));
  }
  return absl::OkStatus();
}

absl::StatusOr<void*> CudaAlloc(int device, size_t bytes) {
  RETURN_IF_ERROR(CheckCudaDevice(device));
  FERRY_CUDA_RETURN_IF_ERROR(cudaSetDevice(device), "cudaSetDevice");
  void* p = nullptr;
  FERRY_CUDA_RETURN_IF_ERROR(cudaMalloc(&p, bytes), absl::StrCat("cudaMalloc(", bytes, ")"));
  cudaError_t e = cudaMemset(p, 0, bytes);
  if (e == cudaSuccess) e = cudaDeviceSynchronize();
  if (e != cudaSuccess) {
    cudaFree(p);
    return CudaError(e, "cudaMemset");
  }
  return p;
}

void CudaFree(void* p) {
  if (p != nullptr) cudaFree(p);
}

absl::StatusOr<void*> CudaHostAlloc(size_t bytes) {
  if (CudaDeviceCount() == 0) return absl::NotFoundError("pinned memory needs a GPU; none here");
  void* p = nullptr;
  FERRY_CUDA_RETURN_IF_ERROR(cudaHostAlloc(&p, bytes, cudaHostAllocPortable | cudaHostAllocMapped),
                             absl::StrCat("cudaHostAlloc(", bytes, ")"));
  std::memset(p, 0, bytes);
  return p;
}

void CudaHostFree(void* p) {
  if (p != nullptr) cudaFreeHost(p);
}

absl::Status CudaCopy(void* dst, const void* src, size_t bytes) {
  FERRY_CUDA_RETURN_IF_ERROR(cudaMemcpy(dst, src, bytes, cudaMemcpyDefault), "cudaMemcpy");
  return absl::OkStatus();
}

absl::StatusOr<CudaIpcExport> CudaExportIpc(const void* ptr) {
  GetAddressRange range = AddressRangeFn();
  if (range == nullptr) return absl::UnimplementedError("cuMemGetAddressRange is not available");
  CUdeviceptr base = 0;
  size_t size = 0;
  if (range(&base, &size, reinterpret_cast<CUdeviceptr>(ptr)) != CUDA_SUCCESS) {
    return absl::InvalidArgumentError("not a CUDA device allocation");
  }
  cudaIpcMemHandle_t h;
  FERRY_CUDA_RETURN_IF_ERROR(cudaIpcGetMemHandle(&h, reinterpret_cast<void*>(base)),
                             "cudaIpcGetMemHandle");
  cudaPointerAttributes attr{};
  FERRY_CUDA_RETURN_IF_ERROR(cudaPointerGetAttributes(&attr, ptr), "cudaPointerGetAttributes");
  cudaDeviceProp prop{};
  FERRY_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, attr.device), "cudaGetDeviceProperties");
  return CudaIpcExport{HexEncode(std::string_view(h.reserved, sizeof(h.reserved))),
                       reinterpret_cast<uint64_t>(ptr) - base,
                       HexEncode(std::string_view(prop.uuid.bytes, sizeof(prop.uuid.bytes)))};
}

absl::StatusOr<int> CudaDeviceByUuid(const std::string& uuid) {
  // cudaGetDeviceProperties takes milliseconds: read every GPU's UUID once.
  static const auto* by_uuid = [] {
    auto* m = new absl::flat_hash_map<std::string, int>();
    for (int d = 0; d < CudaDeviceCount(); ++d) {
      cudaDeviceProp prop{};
      if (cudaGetDeviceProperties(&prop, d) == cudaSuccess) {
        (*m)[HexEncode(std::string_view(prop.uuid.bytes, sizeof(prop.uuid.bytes)))] = d;
      }
    }
    return m;
  }();
  if (auto it = by_uuid->find(uuid); it != by_uuid->end()) return it->second;
  return absl::NotFoundError(absl::StrCat("no GPU with UUID ", uuid, " in this process"));
}

absl::Status CudaEnablePeerAccess(int from, int to) {
  if (from == to) return absl::OkStatus();
  static absl::Mutex mu;
  static auto* enabled = new absl::flat_hash_map<std::pair<int, int>, bool>();
  absl::MutexLock lock(&mu);
  if (enabled->contains({from, to})) return absl::OkStatus();
  FERRY_CUDA_RETURN_IF_ERROR(cudaSetDevice(from), "cudaSetDevice");
  cudaError_t e = cudaDeviceEnablePeerAccess(to, 0);
  if (e != cudaSuccess && e != cudaErrorPeerAccessAlreadyEnabled) {
    return CudaError(e, absl::StrCat("cudaDeviceEnablePeerAccess(", from, " -> ", to, ")"));
  }
  cudaGetLastError();
  (*enabled)[{from, to}] = true;
  return absl::OkStatus();
}

struct CudaIpcCache::Impl {
  struct Entry {
    CudaMapping mapping;
    std::list<std::string>::iterator lru;
  };
  size_t capacity;
  absl::Mutex mu;
  absl::flat_hash_map<std::string, Entry> open ABSL_GUARDED_BY(mu);
  std::list<std::string> lru ABSL_GUARDED_BY(mu);  // most recent first
};

CudaIpcCache::CudaIpcCache(size_t capacity) : impl_(new Impl) {
  impl_->capacity = capacity == 0 ? 1 : capacity;
}

CudaIpcCache::~CudaIpcCache() = default;

absl::StatusOr<CudaMapping> CudaIpcCache::Open(const std::string& handle, int device) {
  auto raw = HexDecode(handle);
  if (!raw.ok() || raw->size() != sizeof(cudaIpcMemHandle_t)) {
    return absl::InvalidArgumentError("not a CUDA IPC handle");
  }
  const std::string key = absl::StrCat(device, ":", handle);
  absl::MutexLock lock(&impl_->mu);
  if (auto it = impl_->open.find(key); it != impl_->open.end()) {
    impl_->lru.splice(impl_->lru.begin(), impl_->lru, it->second.lru);
    return it->second.mapping;
  }
  while (impl_->open.size() >= impl_->capacity) {
    impl_->open.erase(impl_->lru.back());  // closes once its last user lets go
    impl_->lru.pop_back();
  }
  RETURN_IF_ERROR(CheckCudaDevice(device));
  FERRY_CUDA_RETURN_IF_ERROR(cudaSetDevice(device), "cudaSetDevice");
  cudaIpcMemHandle_t h;
  std::memcpy(h.reserved, raw->data(), sizeof(h.reserved));
  void* p = nullptr;
  if (cudaError_t e = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
      e != cudaSuccess) {
    return absl::UnavailableError(CudaError(e, "cudaIpcOpenMemHandle").message());
  }
  CudaMapping m;
  m.base.reset(static_cast<char*>(p), [](char* b) { cudaIpcCloseMemHandle(b); });
  GetAddressRange range = AddressRangeFn();
  CUdeviceptr start = 0;
  size_t size = 0;
  if (range == nullptr || range(&start, &size, reinterpret_cast<CUdeviceptr>(p)) != CUDA_SUCCESS) {
    return absl::UnavailableError("cuMemGetAddressRange failed on a mapped IPC handle");
  }
  m.size = size;
  impl_->lru.push_front(key);
  impl_->open[key] = {m, impl_->lru.begin()};
  return m;
}

absl::Status CudaCopyPieces(int device, const std::vector<CopyPiece>& pieces) {
  std::vector<CopyChunk> chunks;
  std::vector<CopyPiece> large;
  chunks.reserve(pieces.size());
  for (const CopyPiece& p : pieces) {
    if (p.length >= kCopyEngineBytes) {
      large.push_back(p);
      continue;
    }
    for (uint64_t done = 0; done < p.length; done += kCopyChunkBytes) {
      chunks.push_back({p.dst + done, p.src + done, std::min(kCopyChunkBytes, p.length - done)});
    }
  }
  if (chunks.empty() && large.empty()) return absl::OkStatus();
  RETURN_IF_ERROR(CheckCudaDevice(device));
  FERRY_CUDA_RETURN_IF_ERROR(cudaSetDevice(device), "cudaSetDevice");
  // Streams and chunk-list buffers of this thread's own, so that concurrent callers do not
  // wait on each other; the buffers grow and stay (no allocation per copy).
  struct Scratch {
    cudaStream_t kernel = nullptr, engine = nullptr;
    CopyChunk* host = nullptr;    // pinned
    CopyChunk* device = nullptr;  // on the GPU
    size_t capacity = 0;          // chunks
  };
  thread_local absl::flat_hash_map<int, Scratch> scratch;
  auto [it, added] = scratch.try_emplace(device);
  Scratch& sc = it->second;
  if (added) {
    FERRY_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&sc.kernel, cudaStreamNonBlocking),
                               "cudaStreamCreate");
    FERRY_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&sc.engine, cudaStreamNonBlocking),
                               "cudaStreamCreate");
  }
  if (chunks.size() > sc.capacity) {
    cudaFreeHost(sc.host);
    cudaFree(sc.device);
    sc.host = nullptr;
    sc.device = nullptr;
    sc.capacity = 0;
    const size_t want = std::max<size_t>(chunks.size(), 4096);
    void *host = nullptr, *dev = nullptr;
    FERRY_CUDA_RETURN_IF_ERROR(cudaMallocHost(&host, want * sizeof(CopyChunk)), "cudaMallocHost");
    sc.host = static_cast<CopyChunk*>(host);
    FERRY_CUDA_RETURN_IF_ERROR(cudaMalloc(&dev, want * sizeof(CopyChunk)), "cudaMalloc");
    sc.device = static_cast<CopyChunk*>(dev);
    sc.capacity = want;
  }
  const cudaStream_t kernel_stream = sc.kernel, engine_stream = sc.engine;
  cudaError_t e = cudaSuccess;
  for (const CopyPiece& p : large) {
    if (e == cudaSuccess) {
      e = cudaMemcpyAsync(reinterpret_cast<void*>(p.dst), reinterpret_cast<const void*>(p.src),
                          p.length, cudaMemcpyDefault, engine_stream);
    }
  }
  if (e == cudaSuccess && !chunks.empty()) {
    const size_t bytes = chunks.size() * sizeof(CopyChunk);
    std::memcpy(sc.host, chunks.data(), bytes);
    e = cudaMemcpyAsync(sc.device, sc.host, bytes, cudaMemcpyHostToDevice, kernel_stream);
    if (e == cudaSuccess) e = LaunchCopyChunks(sc.device, chunks.size(), SmCount(device), kernel_stream);
  }
  const cudaError_t k = cudaStreamSynchronize(kernel_stream);
  const cudaError_t c = cudaStreamSynchronize(engine_stream);
  if (e == cudaSuccess) e = k != cudaSuccess ? k : c;
  if (e != cudaSuccess) return CudaError(e, "batched copy");
  return absl::OkStatus();
}

}  // namespace ferry::engine
