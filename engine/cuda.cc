// engine/cuda.h with the CUDA runtime (builds that found the toolkit).
#include "engine/cuda.h"

#include <cuda.h>
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <initializer_list>
#include <list>
#include <mutex>
#include <string_view>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "base/hex.h"
#include "base/status.h"
#include "engine/cuda_copy.h"
#include "engine/fabric.h"

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

// A driver API function by name (the runtime links no libcuda), or nullptr.
void* DriverFn(const char* name) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult found{};
  if (cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &found) != cudaSuccess ||
      found != cudaDriverEntryPointSuccess) {
    return nullptr;
  }
  return p;
}

GetAddressRange AddressRangeFn() {
  static GetAddressRange fn = reinterpret_cast<GetAddressRange>(DriverFn("cuMemGetAddressRange"));
  return fn;
}

using GetHandleForAddressRange = CUresult (*)(void*, CUdeviceptr, size_t, CUmemRangeHandleType,
                                              unsigned long long);  // NOLINT(runtime/int)

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
    return absl::NotFoundError(
        absl::StrCat("no GPU cuda:", index, ": this host has ", n, n == 1 ? " GPU" : " GPUs"));
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
  // The driver call below works in the calling thread's current context: make it the
  // pointer's GPU's, whatever the thread did before (a spare buffer reused by an HTTP thread
  // that never called cudaSetDevice was "not a CUDA device allocation").
  cudaPointerAttributes attr{};
  FERRY_CUDA_RETURN_IF_ERROR(cudaPointerGetAttributes(&attr, ptr), "cudaPointerGetAttributes");
  if (attr.type != cudaMemoryTypeDevice) {
    return absl::InvalidArgumentError("not a CUDA device allocation");
  }
  FERRY_CUDA_RETURN_IF_ERROR(cudaSetDevice(attr.device), "cudaSetDevice");
  CUdeviceptr base = 0;
  size_t size = 0;
  if (range(&base, &size, reinterpret_cast<CUdeviceptr>(ptr)) != CUDA_SUCCESS) {
    return absl::InvalidArgumentError("not a CUDA device allocation");
  }
  cudaIpcMemHandle_t h;
  FERRY_CUDA_RETURN_IF_ERROR(cudaIpcGetMemHandle(&h, reinterpret_cast<void*>(base)),
                             "cudaIpcGetMemHandle");
  cudaDeviceProp prop{};
  FERRY_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, attr.device),
                             "cudaGetDeviceProperties");
  return CudaIpcExport{HexEncode(std::string_view(h.reserved, sizeof(h.reserved))),
                       reinterpret_cast<uint64_t>(ptr) - base,
                       HexEncode(std::string_view(prop.uuid.bytes, sizeof(prop.uuid.bytes)))};
}

absl::StatusOr<CudaDmabuf> CudaExportDmabuf(const void* ptr, size_t length) {
  static auto fn =
      reinterpret_cast<GetHandleForAddressRange>(DriverFn("cuMemGetHandleForAddressRange"));
  if (fn == nullptr)
    return absl::UnimplementedError("cuMemGetHandleForAddressRange is not available");
  cudaPointerAttributes attr{};
  FERRY_CUDA_RETURN_IF_ERROR(cudaPointerGetAttributes(&attr, ptr), "cudaPointerGetAttributes");
  if (attr.type != cudaMemoryTypeDevice) return absl::InvalidArgumentError("not GPU memory");
  FERRY_CUDA_RETURN_IF_ERROR(cudaSetDevice(attr.device), "cudaSetDevice");
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const uint64_t start = reinterpret_cast<uint64_t>(ptr);
  const uint64_t base = start / page * page;
  const uint64_t end = (start + length + page - 1) / page * page;
  int fd = -1;
  const CUresult r = fn(&fd, base, end - base, CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0);
  if (r != CUDA_SUCCESS) {
    return absl::UnavailableError(absl::StrCat("cuMemGetHandleForAddressRange: CUresult ", r));
  }
  return CudaDmabuf{fd, reinterpret_cast<void*>(base), end - base};
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

// A list of kernel chunks built in pinned memory, copied to the GPU before each launch or read
// there by the kernel (pinned memory is mapped: unified addressing); grows and stays (no
// allocation per copy).
struct ChunkList {
  CopyChunk* host = nullptr;    // pinned
  CopyChunk* device = nullptr;  // on the GPU that runs the kernel, if asked for
  uint64_t capacity = 0;        // chunks

  // Room for `chunks`, with a copy on the current GPU when `on_device`.
  cudaError_t Reserve(uint64_t chunks, bool on_device) {
    if (chunks <= capacity) return cudaSuccess;
    cudaFreeHost(host);
    cudaFree(device);
    host = nullptr;
    device = nullptr;
    capacity = 0;
    const uint64_t want = std::max<uint64_t>(chunks, 4096);
    void *h = nullptr, *d = nullptr;
    // Portable and mapped: a relay's kernels on two GPUs read the same lists.
    cudaError_t e =
        cudaHostAlloc(&h, want * sizeof(CopyChunk), cudaHostAllocPortable | cudaHostAllocMapped);
    if (e == cudaSuccess && on_device) e = cudaMalloc(&d, want * sizeof(CopyChunk));
    if (e != cudaSuccess) {
      cudaFreeHost(h);
      return e;
    }
    host = static_cast<CopyChunk*>(h);
    device = static_cast<CopyChunk*>(d);
    capacity = want;
    return cudaSuccess;
  }
  // Hands chunks [from, to) to the GPU: their list, then one kernel, on `stream`.
  cudaError_t Launch(uint64_t from, uint64_t to, int sms, cudaStream_t stream) const {
    cudaError_t e = cudaMemcpyAsync(device + from, host + from, (to - from) * sizeof(CopyChunk),
                                    cudaMemcpyHostToDevice, stream);
    return e == cudaSuccess ? LaunchCopyChunks(device + from, to - from, sms, stream) : e;
  }
};

cudaError_t CreateStreams(std::initializer_list<cudaStream_t*> streams) {
  for (cudaStream_t* st : streams) {
    if (cudaError_t e = cudaStreamCreateWithFlags(st, cudaStreamNonBlocking); e != cudaSuccess) {
      return e;
    }
  }
  return cudaSuccess;
}

// Streams and chunk list for one batched copy at a time on one GPU.
struct Scratch {
  int device = 0;
  // Batches alternate between two kernel streams, so that one batch's last blocks overlap
  // the next batch's first instead of leaving SMs idle at every kernel boundary.
  cudaStream_t kernel[2] = {nullptr, nullptr};
  cudaStream_t engine = nullptr;
  ChunkList chunks;
};

// Idle scratches and relays, shared by every thread: a copy takes one and gives it back, so
// that concurrent copies do not wait on each other and a request thread never pays for
// streams and buffers of its own. What the pools hold lives as long as the process.
template <typename Key, typename T>
class IdlePool {
 public:
  T* Take(const Key& key) {
    absl::MutexLock lock(&mu_);
    std::vector<T*>& idle = idle_[key];
    if (idle.empty()) return nullptr;
    T* t = idle.back();
    idle.pop_back();
    return t;
  }
  void Give(const Key& key, T* t) {
    absl::MutexLock lock(&mu_);
    idle_[key].push_back(t);
  }

 private:
  absl::Mutex mu_;
  absl::flat_hash_map<Key, std::vector<T*>> idle_ ABSL_GUARDED_BY(mu_);
};

IdlePool<int, Scratch>& IdleScratches() {
  static auto* pool = new IdlePool<int, Scratch>();
  return *pool;
}

void ReleaseScratch(Scratch* sc) { IdleScratches().Give(sc->device, sc); }

// An idle scratch for `device` (the current CUDA device) with room for `chunks`.
absl::StatusOr<Scratch*> TakeScratch(int device, uint64_t chunks) {
  Scratch* sc = IdleScratches().Take(device);
  if (sc == nullptr) {
    sc = new Scratch();
    sc->device = device;
    if (cudaError_t e = CreateStreams({&sc->kernel[0], &sc->kernel[1], &sc->engine});
        e != cudaSuccess) {
      for (cudaStream_t st : {sc->kernel[0], sc->kernel[1], sc->engine}) {
        if (st != nullptr) cudaStreamDestroy(st);
      }
      delete sc;
      return CudaError(e, "cudaStreamCreate");
    }
  }
  if (cudaError_t e = sc->chunks.Reserve(chunks, true); e != cudaSuccess) {
    ReleaseScratch(sc);
    return CudaError(e, "cudaHostAlloc/cudaMalloc");
  }
  return sc;
}

// Pieces from one GPU to another: the copy engines outrun a kernel reading over NVLink but pay
// a fixed cost per call, which small pieces cannot carry (docs/benchmarks.md, GPU). A relay
// gives them few large calls: a kernel on the source GPU
// gathers a window of pieces into a staging slot there (at HBM speed, several times NVLink's),
// one cudaMemcpyPeerAsync moves the slot, a kernel on the destination scatters it; with
// kRelaySlots windows in flight the three steps of successive windows overlap.
constexpr uint64_t kRelayWindow = uint64_t{16} << 20;
constexpr uint64_t kRelaySlots = 4;

// Streams, events, staging and the gather list of one relayed copy at a time between two GPUs.
// Events of a slot: `gathered` (on src) lets the move start, `moved` frees the source's slot
// and lets the scatter start, `scattered` frees the destination's slot.
struct Relay {
  int src = 0, dst = 0;
  cudaStream_t gather = nullptr;  // on src
  cudaStream_t move = nullptr;    // on dst
  char* stage_src = nullptr;      // kRelaySlots windows on src
  char* stage_dst = nullptr;      // and on dst
  cudaEvent_t gathered[kRelaySlots] = {};
  cudaEvent_t moved[kRelaySlots] = {};
  cudaEvent_t scattered[kRelaySlots] = {};
  ChunkList chunks;  // the gather kernel's, read from the host

  cudaError_t Create() {
    cudaError_t e = cudaSetDevice(src);
    if (e == cudaSuccess) e = CreateStreams({&gather});
    if (e == cudaSuccess) {
      e = cudaMalloc(reinterpret_cast<void**>(&stage_src), kRelaySlots * kRelayWindow);
    }
    for (cudaEvent_t& ev : gathered) {
      if (e == cudaSuccess) e = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
    }
    if (e == cudaSuccess) e = cudaSetDevice(dst);
    if (e == cudaSuccess) e = CreateStreams({&move});
    if (e == cudaSuccess) {
      e = cudaMalloc(reinterpret_cast<void**>(&stage_dst), kRelaySlots * kRelayWindow);
    }
    for (uint64_t i = 0; i < kRelaySlots; ++i) {
      if (e == cudaSuccess) e = cudaEventCreateWithFlags(&moved[i], cudaEventDisableTiming);
      if (e == cudaSuccess) e = cudaEventCreateWithFlags(&scattered[i], cudaEventDisableTiming);
    }
    return e;
  }
  // Frees what Create made (after a failed Create: it is never used again).
  void Destroy() {
    for (uint64_t i = 0; i < kRelaySlots; ++i) {
      for (cudaEvent_t ev : {gathered[i], moved[i], scattered[i]}) {
        if (ev != nullptr) cudaEventDestroy(ev);
      }
    }
    for (cudaStream_t st : {gather, move}) {
      if (st != nullptr) cudaStreamDestroy(st);
    }
    cudaFree(stage_src);
    cudaFree(stage_dst);
    cudaFreeHost(chunks.host);
    cudaFree(chunks.device);
  }
};

IdlePool<std::pair<int, int>, Relay>& IdleRelays() {
  static auto* pool = new IdlePool<std::pair<int, int>, Relay>();
  return *pool;
}

void ReleaseRelay(Relay* r) { IdleRelays().Give({r->src, r->dst}, r); }

// An idle relay from `src` to `dst` with room for `chunks`, or nullptr when CUDA refused the
// streams, the staging or the list (then the copy goes without one). Leaves `dst` current.
Relay* TakeRelay(int src, int dst, uint64_t chunks) {
  Relay* r = IdleRelays().Take({src, dst});
  if (r == nullptr) {
    r = new Relay();
    r->src = src;
    r->dst = dst;
    if (r->Create() != cudaSuccess) {
      cudaGetLastError();
      r->Destroy();
      delete r;
      cudaSetDevice(dst);
      return nullptr;
    }
  }
  if (r->chunks.Reserve(chunks, false) != cudaSuccess) {
    cudaGetLastError();
    ReleaseRelay(r);
    return nullptr;
  }
  return r;
}

// The first batch is small so that the GPU starts at once; each next one doubles.
constexpr uint64_t kFirstBatch = 512;

}  // namespace

struct CudaCopyBatch::State {
  int device = 0;
  int sms = 0;
  Scratch* sc = nullptr;
  uint64_t max_chunks = 0;
  uint64_t added = 0;     // chunks written to sc->chunks
  uint64_t launched = 0;  // chunks handed to the GPU
  uint64_t batches = 0;
  uint64_t next_launch = kFirstBatch;
  bool pending = false;  // work was handed over since the last wait
  cudaError_t error = cudaSuccess;
  // With a relay, chunk i of sc->chunks scatters what chunk i of relay->chunks gathered.
  Relay* relay = nullptr;
  int src_sms = 0;
  uint64_t fill = 0;     // bytes in the open window
  uint64_t windows = 0;  // windows handed over

  void Launch() {
    if (error != cudaSuccess || added == launched) return;
    const uint64_t n = added - launched;
    error = sc->chunks.Launch(launched, added, sms, sc->kernel[batches++ % 2]);
    launched = added;
    pending = true;
    next_launch = added + std::max<uint64_t>(n * 2, kFirstBatch);
  }
  // Gathers the open window on the source GPU, moves it, scatters it here (see Relay). The
  // two kernels read their chunks from pinned memory: without copies of the lists to the GPUs,
  // a window costs the CPU less.
  void Relayed() {
    if (error != cudaSuccess || fill == 0) return;
    Relay& r = *relay;
    const uint64_t slot = windows++ % kRelaySlots;
    const uint64_t at = slot * kRelayWindow;
    const cudaStream_t scatter = sc->kernel[batches++ % 2];
    pending = true;
    error = cudaSetDevice(r.src);
    if (error == cudaSuccess) error = cudaStreamWaitEvent(r.gather, r.moved[slot]);
    if (error == cudaSuccess) {
      error = LaunchCopyChunks(r.chunks.host + launched, added - launched, src_sms, r.gather);
    }
    if (error == cudaSuccess) error = cudaEventRecord(r.gathered[slot], r.gather);
    if (const cudaError_t e = cudaSetDevice(device); error == cudaSuccess) error = e;
    if (error == cudaSuccess) error = cudaStreamWaitEvent(r.move, r.gathered[slot]);
    if (error == cudaSuccess) error = cudaStreamWaitEvent(r.move, r.scattered[slot]);
    if (error == cudaSuccess) {
      error = cudaMemcpyPeerAsync(r.stage_dst + at, device, r.stage_src + at, r.src, fill, r.move);
    }
    if (error == cudaSuccess) error = cudaEventRecord(r.moved[slot], r.move);
    if (error == cudaSuccess) error = cudaStreamWaitEvent(scatter, r.moved[slot]);
    if (error == cudaSuccess) {
      error = LaunchCopyChunks(sc->chunks.host + launched, added - launched, sms, scatter);
    }
    if (error == cudaSuccess) error = cudaEventRecord(r.scattered[slot], scatter);
    launched = added;
    fill = 0;
  }
  absl::Status AddRelayed(uint64_t dst, uint64_t src, uint64_t length) {
    const auto stage_src = reinterpret_cast<uint64_t>(relay->stage_src);
    const auto stage_dst = reinterpret_cast<uint64_t>(relay->stage_dst);
    for (uint64_t done = 0; done < length;) {
      if (added == max_chunks) {
        return absl::InvalidArgumentError("batched copy: more chunks than it was begun for");
      }
      const uint64_t at = (windows % kRelaySlots) * kRelayWindow + fill;
      const uint64_t n = std::min({kCopyChunkBytes, length - done, kRelayWindow - fill});
      relay->chunks.host[added] = {stage_src + at, src + done, n};
      sc->chunks.host[added++] = {dst + done, stage_dst + at, n};
      fill += n;
      done += n;
      if (fill == kRelayWindow) {
        Relayed();
        if (error != cudaSuccess) return CudaError(error, "relayed copy");
      }
    }
    return absl::OkStatus();
  }
  cudaError_t Wait() {
    if (!pending) return error;
    pending = false;
    for (cudaStream_t st : {sc->kernel[0], sc->kernel[1], sc->engine}) {
      const cudaError_t e = cudaStreamSynchronize(st);
      if (error == cudaSuccess) error = e;
    }
    if (relay != nullptr) {
      for (cudaStream_t st : {relay->gather, relay->move}) {
        const cudaError_t e = cudaStreamSynchronize(st);
        if (error == cudaSuccess) error = e;
      }
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
  if (state_->relay != nullptr) ReleaseRelay(state_->relay);
}

absl::StatusOr<CudaCopyBatch> CudaCopyBatch::Begin(int device, uint64_t max_chunks,
                                                   int src_device) {
  RETURN_IF_ERROR(CheckCudaDevice(device));
  const bool relayed = src_device >= 0 && src_device != device;
  if (relayed) RETURN_IF_ERROR(CheckCudaDevice(src_device));
  FERRY_CUDA_RETURN_IF_ERROR(cudaSetDevice(device), "cudaSetDevice");
  auto state = std::make_unique<State>();
  state->device = device;
  state->sms = SmCount(device);
  // A relay cuts a chunk at each window's end: at most one more chunk per window, and a
  // window holds at least one chunk.
  state->max_chunks = relayed ? 2 * max_chunks : max_chunks;
  ASSIGN_OR_RETURN(state->sc, TakeScratch(device, state->max_chunks));
  if (relayed) {
    state->relay = TakeRelay(src_device, device, state->max_chunks);
    state->src_sms = SmCount(src_device);
  }
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
  if (s.relay != nullptr) return s.AddRelayed(dst, src, length);
  for (uint64_t done = 0; done < length; done += kCopyChunkBytes) {
    if (s.added == s.max_chunks) {
      return absl::InvalidArgumentError("batched copy: more chunks than it was begun for");
    }
    s.sc->chunks.host[s.added++] = {dst + done, src + done,
                                    std::min(kCopyChunkBytes, length - done)};
  }
  if (s.added >= s.next_launch) s.Launch();
  return absl::OkStatus();
}

absl::Status CudaCopyBatch::Finish() {
  State& s = *state_;
  if (s.relay != nullptr) {
    s.Relayed();
  } else {
    s.Launch();
  }
  const cudaError_t e = s.Wait();
  return e == cudaSuccess ? absl::OkStatus() : CudaError(e, "batched copy");
}

uint64_t CopyChunksBound(uint64_t pieces, uint64_t bytes) {
  return pieces + bytes / kCopyChunkBytes;  // each piece: its whole chunks, plus one part
}

absl::Status CudaCopyPieces(int device, const std::vector<CopyPiece>& pieces, int src_device) {
  uint64_t chunks = 0;
  for (const CopyPiece& p : pieces) {
    if (p.length < kCopyEngineBytes) chunks += (p.length + kCopyChunkBytes - 1) / kCopyChunkBytes;
  }
  if (pieces.empty()) return absl::OkStatus();
  ASSIGN_OR_RETURN(CudaCopyBatch batch, CudaCopyBatch::Begin(device, chunks, src_device));
  for (const CopyPiece& p : pieces) RETURN_IF_ERROR(batch.Add(p.dst, p.src, p.length));
  return batch.Finish();
}

}  // namespace ferry::engine
