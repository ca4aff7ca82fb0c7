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

namespace {

// Streams and chunk-list buffers for one batched copy at a time on one GPU; the buffers grow
// and stay (no allocation per copy).
struct Scratch {
  int device = 0;
  // Batches alternate between two kernel streams, so that one batch's last blocks overlap
  // the next batch's first instead of leaving SMs idle at every kernel boundary.
  cudaStream_t kernel[2] = {nullptr, nullptr};
  cudaStream_t engine = nullptr;
  CopyChunk* host = nullptr;           // pinned
  CopyChunk* device_chunks = nullptr;  // on the GPU
  uint64_t capacity = 0;               // chunks
};

// Idle scratches by GPU, shared by every thread: a copy takes one and gives it back, so that
// concurrent copies do not wait on each other and a request thread never pays for streams
// and pinned buffers of its own. Scratches live as long as the process.
ABSL_CONST_INIT absl::Mutex scratch_mu(absl::kConstInit);
absl::flat_hash_map<int, std::vector<Scratch*>>& IdleScratch() ABSL_EXCLUSIVE_LOCKS_REQUIRED(scratch_mu) {
  static auto* idle = new absl::flat_hash_map<int, std::vector<Scratch*>>();
  return *idle;
}

void ReleaseScratch(Scratch* sc) {
  absl::MutexLock lock(&scratch_mu);
  IdleScratch()[sc->device].push_back(sc);
}

// An idle scratch for `device` (the current CUDA device) with room for `chunks`.
absl::StatusOr<Scratch*> TakeScratch(int device, uint64_t chunks) {
  Scratch* sc = nullptr;
  {
    absl::MutexLock lock(&scratch_mu);
    auto& idle = IdleScratch()[device];
    if (!idle.empty()) {
      sc = idle.back();
      idle.pop_back();
    }
  }
  if (sc == nullptr) {
    sc = new Scratch();
    sc->device = device;
    cudaError_t e = cudaSuccess;
    for (cudaStream_t* st : {&sc->kernel[0], &sc->kernel[1], &sc->engine}) {
      if (e == cudaSuccess) e = cudaStreamCreateWithFlags(st, cudaStreamNonBlocking);
    }
    if (e != cudaSuccess) {
      for (cudaStream_t st : {sc->kernel[0], sc->kernel[1], sc->engine}) {
        if (st != nullptr) cudaStreamDestroy(st);
      }
      delete sc;
      return CudaError(e, "cudaStreamCreate");
    }
  }
  if (chunks > sc->capacity) {
    cudaFreeHost(sc->host);
    cudaFree(sc->device_chunks);
    sc->host = nullptr;
    sc->device_chunks = nullptr;
    sc->capacity = 0;
    const uint64_t want = std::max<uint64_t>(chunks, 4096);
    void *host = nullptr, *dev = nullptr;
    cudaError_t e = cudaMallocHost(&host, want * sizeof(CopyChunk));
    if (e == cudaSuccess) e = cudaMalloc(&dev, want * sizeof(CopyChunk));
    if (e != cudaSuccess) {
      cudaFreeHost(host);
      ReleaseScratch(sc);
      return CudaError(e, "cudaMallocHost/cudaMalloc");
    }
    sc->host = static_cast<CopyChunk*>(host);
    sc->device_chunks = static_cast<CopyChunk*>(dev);
    sc->capacity = want;
  }
  return sc;
}

// The first batch is small so that the GPU starts at once; each next one doubles.
constexpr uint64_t kFirstBatch = 512;

}  // namespace

struct CudaCopyBatch::State {
  int device = 0;
  int sms = 0;
  Scratch* sc = nullptr;
  uint64_t max_chunks = 0;
  uint64_t added = 0;     // chunks written to sc->host
  uint64_t launched = 0;  // chunks handed to the GPU
  uint64_t batches = 0;
  uint64_t next_launch = kFirstBatch;
  bool pending = false;   // work was handed over since the last wait
  cudaError_t error = cudaSuccess;

  void Launch() {
    if (error != cudaSuccess || added == launched) return;
    const uint64_t n = added - launched;
    const cudaStream_t stream = sc->kernel[batches++ % 2];
    error = cudaMemcpyAsync(sc->device_chunks + launched, sc->host + launched,
                            n * sizeof(CopyChunk), cudaMemcpyHostToDevice, stream);
    if (error == cudaSuccess) error = LaunchCopyChunks(sc->device_chunks + launched, n, sms, stream);
    launched = added;
    pending = true;
    next_launch = added + std::max<uint64_t>(n * 2, kFirstBatch);
  }
  cudaError_t Wait() {
    if (!pending) return error;
    pending = false;
    for (cudaStream_t st : {sc->kernel[0], sc->kernel[1], sc->engine}) {
      const cudaError_t e = cudaStreamSynchronize(st);
      if (error == cudaSuccess) error = e;
    }
    return error;
  }
};

CudaCopyBatch::CudaCopyBatch(std::unique_ptr<State> state) : state_(std::move(state)) {}
CudaCopyBatch::CudaCopyBatch(CudaCopyBatch&& other) noexcept = default;
CudaCopyBatch::~CudaCopyBatch() {
  if (!state_) return;
  state_->Wait();
  ReleaseScratch(state_->sc);
}

absl::StatusOr<CudaCopyBatch> CudaCopyBatch::Begin(int device, uint64_t max_chunks) {
  RETURN_IF_ERROR(CheckCudaDevice(device));
  FERRY_CUDA_RETURN_IF_ERROR(cudaSetDevice(device), "cudaSetDevice");
  auto state = std::make_unique<State>();
  state->device = device;
  state->sms = SmCount(device);
  state->max_chunks = max_chunks;
  ASSIGN_OR_RETURN(state->sc, TakeScratch(device, max_chunks));
  return CudaCopyBatch(std::move(state));
}

absl::Status CudaCopyBatch::Add(uint64_t dst, uint64_t src, uint64_t length) {
  State& s = *state_;
  if (s.error != cudaSuccess) return CudaError(s.error, "batched copy");
  if (length >= kCopyEngineBytes) {
    s.error = cudaMemcpyAsync(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src),
                              length, cudaMemcpyDefault, s.sc->engine);
    s.pending = true;
    return s.error == cudaSuccess ? absl::OkStatus() : CudaError(s.error, "cudaMemcpyAsync");
  }
  for (uint64_t done = 0; done < length; done += kCopyChunkBytes) {
    if (s.added == s.max_chunks) {
      return absl::InvalidArgumentError("batched copy: more chunks than it was begun for");
    }
    s.sc->host[s.added++] = {dst + done, src + done, std::min(kCopyChunkBytes, length - done)};
  }
  if (s.added >= s.next_launch) s.Launch();
  return absl::OkStatus();
}

absl::Status CudaCopyBatch::Finish() {
  State& s = *state_;
  s.Launch();
  const cudaError_t e = s.Wait();
  return e == cudaSuccess ? absl::OkStatus() : CudaError(e, "batched copy");
}

uint64_t CopyChunksBound(uint64_t pieces, uint64_t bytes) {
  return pieces + bytes / kCopyChunkBytes;  // each piece: its whole chunks, plus one part
}

absl::Status CudaCopyPieces(int device, const std::vector<CopyPiece>& pieces) {
  uint64_t chunks = 0;
  for (const CopyPiece& p : pieces) {
    if (p.length < kCopyEngineBytes) chunks += (p.length + kCopyChunkBytes - 1) / kCopyChunkBytes;
  }
  if (pieces.empty()) return absl::OkStatus();
  ASSIGN_OR_RETURN(CudaCopyBatch batch, CudaCopyBatch::Begin(device, chunks));
  for (const CopyPiece& p : pieces) RETURN_IF_ERROR(batch.Add(p.dst, p.src, p.length));
  return batch.Finish();
}

}  // namespace ferry::engine
