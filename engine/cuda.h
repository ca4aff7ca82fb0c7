// CUDA support: GPU buffers, pinned host buffers, copies, IPC handles and a batched copy
// kernel. Present when the build found the CUDA toolkit (CudaBuilt()); without it every call
// answers kUnimplemented and the rest of ferry works on host memory. CUDA errors come back as
// statuses that carry the error's name (cudaErrorInvalidValue, ...). Thread-safe.
#ifndef FERRY_ENGINE_CUDA_H_
#define FERRY_ENGINE_CUDA_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace ferry::engine {

// True when this build has CUDA.
bool CudaBuilt();
// GPUs this process can use; 0 without a driver or a device (never an error). Read once.
int CudaDeviceCount();
// kOk when cuda:`index` exists. kUnimplemented: built without CUDA. kNotFound otherwise,
// naming how many GPUs there are.
absl::Status CheckCudaDevice(int index);

// Device memory on GPU `device`, zeroed.
absl::StatusOr<void*> CudaAlloc(int device, size_t bytes);
void CudaFree(void* p);
// Pinned host memory that GPUs can read and write directly (mapped, portable).
absl::StatusOr<void*> CudaHostAlloc(size_t bytes);
void CudaHostFree(void* p);
// A synchronous copy between any two of host, pinned and device memory (unified addressing).
absl::Status CudaCopy(void* dst, const void* src, size_t bytes);

// How another process on this host opens a GPU buffer: the IPC handle of the allocation that
// holds it (hex), the buffer's offset in that allocation, and the GPU's UUID (hex; device
// numbers differ between processes, UUIDs do not).
struct CudaIpcExport {
  std::string handle;
  uint64_t offset = 0;
  std::string gpu;
};
absl::StatusOr<CudaIpcExport> CudaExportIpc(const void* ptr);
// A dma-buf of the device memory around [ptr, ptr + length) (what a NIC driver imports to
// register GPU memory): `fd`, which the caller closes, covers [base, base + size), the range
// widened to host pages as the driver asks; ptr lies at ptr - base in it. kUnimplemented:
// built without CUDA, or a driver without the call; kUnavailable: the driver refused (no
// dma-buf support, or a range across allocations).
struct CudaDmabuf {
  int fd = -1;
  void* base = nullptr;
  uint64_t size = 0;
};
absl::StatusOr<CudaDmabuf> CudaExportDmabuf(const void* ptr, size_t length);
// This process's number for the GPU with `uuid` (hex). kNotFound when it has none.
absl::StatusOr<int> CudaDeviceByUuid(const std::string& uuid);
// Lets kernels on GPU `from` read and write GPU `to` (no-op when they are the same).
absl::Status CudaEnablePeerAccess(int from, int to);

// Another process's GPU allocation mapped into this one: valid while `base` is held.
struct CudaMapping {
  std::shared_ptr<char> base;
  uint64_t size = 0;  // bytes of the allocation
};

// Opened IPC handles of other processes, kept open for reuse (opening one costs far more than
// a copy of a few MiB). Over `capacity` the least recently used is dropped; a mapping closes
// when the cache and every caller holding it have let it go. An open mapping keeps the
// owner's memory alive after the owner frees it, so the capacity bounds what can linger. The
// default holds a model's tensors published one region each: a cache smaller than the regions
// one pull reads from opens every handle again on every pull.
class CudaIpcCache {
 public:
  explicit CudaIpcCache(size_t capacity = 1024);
  ~CudaIpcCache();
  CudaIpcCache(const CudaIpcCache&) = delete;
  CudaIpcCache& operator=(const CudaIpcCache&) = delete;
  // The allocation behind `handle` (hex), mapped for GPU `device`. kInvalidArgument: not a
  // handle. kUnavailable: CUDA refused it (another host, or a buffer that is gone).
  absl::StatusOr<CudaMapping> Open(const std::string& handle, int device);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// One piece of a batched copy: `length` bytes from `src` to `dst`, each device or mapped
// pinned memory as GPU `device` sees it.
struct CopyPiece {
  uint64_t dst = 0;
  uint64_t src = 0;
  uint64_t length = 0;
};
// Copies every piece on GPU `device` and waits: pieces of kCopyEngineBytes and more with the
// copy engines (cudaMemcpyAsync), the others with one kernel, both at once. When every source
// is on another GPU, `src_device`, the smaller pieces are relayed instead: gathered in windows
// of 16 MiB on that GPU, moved by the copy engines, scattered on `device`, so that few large
// copy-engine calls replace SM reads over NVLink, which the copy engines outrun. Costs 2 x 64 MiB
// of staging, kept for later copies between the two GPUs. Pieces must not overlap each other's
// destinations.
inline constexpr uint64_t kCopyEngineBytes = uint64_t{64} << 20;
absl::Status CudaCopyPieces(int device, const std::vector<CopyPiece>& pieces, int src_device = -1);

// The most kernel chunks `pieces` pieces of `bytes` bytes in all can take.
uint64_t CopyChunksBound(uint64_t pieces, uint64_t bytes);

// The same copy built piece by piece: the kernel's work goes to the GPU in growing batches as
// pieces are added, so that building a long list overlaps the copying. Uses the calling
// thread's streams and buffers: one batch per thread at a time, begun and finished on it.
class CudaCopyBatch {
 public:
  // At most `max_chunks` kernel chunks will be added (a piece under kCopyEngineBytes of n
  // bytes takes ceil(n / 256 KiB)). `src_device`: as for CudaCopyPieces (-1: sources
  // anywhere). kNotFound / kUnimplemented: no such GPU / no CUDA.
  static absl::StatusOr<CudaCopyBatch> Begin(int device, uint64_t max_chunks, int src_device = -1);
  CudaCopyBatch(CudaCopyBatch&& other) noexcept;
  CudaCopyBatch& operator=(CudaCopyBatch&&) = delete;
  // Waits for what was handed to the GPU when Finish was not called.
  ~CudaCopyBatch();
  // kInvalidArgument past max_chunks; a CUDA error of an earlier batch.
  absl::Status Add(uint64_t dst, uint64_t src, uint64_t length);
  // Hands the rest to the GPU and waits for every copy.
  absl::Status Finish();

 private:
  struct State;
  explicit CudaCopyBatch(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace ferry::engine

#endif  // FERRY_ENGINE_CUDA_H_
