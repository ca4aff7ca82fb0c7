// How a pull moves its bytes (DESIGN.md, "GPU memory takes the best path"), and the pieces
// the GPU paths are built from: choosing the path, slicing extent lists into copy pieces,
// copying pieces on the CPU or the GPU, and pinned staging rings.
#ifndef FERRY_SERVER_PATHS_H_
#define FERRY_SERVER_PATHS_H_

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "base/ids.h"
#include "engine/cuda.h"
#include "engine/engine.h"

namespace ferry::server {

enum class PullPath {
  kRdma,     // WRITEs straight between the two nodes' regions (host memory, or FI_HMEM GPUs)
  kCudaIpc,  // same host: the source maps the destination's GPU buffers and copies with a kernel
  kStaged,   // through pinned host rings at both ends, WRITE with immediate data per slot
};
std::string_view PathName(PullPath path);
// A path's name, or "auto" (nullopt: let ChoosePath decide). kInvalidArgument otherwise.
absl::StatusOr<std::optional<PullPath>> ParsePath(std::string_view name);

// How a source says that the object cannot go over the rdma path (409): the destination then
// takes the staged path.
inline constexpr char kNotOnRails[] = "is not on the rails here";
// In the answer of a source whose rdma transfer failed with GPU memory at either end (a
// provider that registers it, FI_HMEM, and then fails the WRITEs): the destination pulls again
// on the staged path, unless rdma was asked for by name.
inline constexpr char kDeviceMemoryFailed[] = "failed with GPU memory on the rails";

// What the destination knows when it chooses.
struct PathFacts {
  bool same_host = false;    // the source's HostId() equals this host's
  bool cuda_here = false;    // this node can run CUDA (built with it, a GPU present)
  bool src_all_gpu = false;  // every source extent is in GPU memory
  bool src_on_rails = true;  // every source region is registered on the rails
  bool dst_all_ipc = false;  // every destination region is GPU memory with an IPC handle
  bool dst_on_rails = true;  // every destination region has rail keys
};
// Same host and GPU on both sides: kCudaIpc. Both sides on the rails: kRdma. Else kStaged.
PullPath ChoosePath(const PathFacts& facts);

// A run of an object's bytes in local memory, in object order.
struct Span {
  char* ptr = nullptr;
  uint64_t length = 0;
  Device device;
};
// The spans that hold object bytes [offset, offset + length), cut to fit.
std::vector<Span> Slice(const std::vector<Span>& spans, uint64_t offset, uint64_t length);

// A copy from one span into another; `device` is the GPU that runs it (kernel), or host.
struct Piece {
  Device device;
  engine::CopyPiece copy;
};
// Walks two span lists of the same total length in step: f(dst, dst_ptr, src, src_ptr, n) for
// each run of n bytes where neither list changes span. The destination is `dst_count` spans
// that `dst_at(i)` makes when the walk reaches them (no list built before the first call).
template <class DstAt, class F>
void WalkPairs(size_t dst_count, DstAt&& dst_at, const std::vector<Span>& src, F&& f) {
  size_t i = 0, j = 0;
  uint64_t di = 0, sj = 0;  // bytes used of dst span i, src[j]
  Span d = dst_count > 0 ? dst_at(0) : Span{};
  while (i < dst_count && j < src.size()) {
    const uint64_t n = std::min(d.length - di, src[j].length - sj);
    f(d, d.ptr + di, src[j], src[j].ptr + sj, n);
    di += n;
    sj += n;
    if (di == d.length && ++i < dst_count) d = dst_at(i), di = 0;
    if (sj == src[j].length) ++j, sj = 0;
  }
}
template <class F>
void WalkPairs(const std::vector<Span>& dst, const std::vector<Span>& src, F&& f) {
  WalkPairs(
      dst.size(), [&dst](size_t i) { return dst[i]; }, src, std::forward<F>(f));
}
// Pairs two span lists of the same total length into pieces (source spans choose the device,
// or the destination's when the source is host memory).
std::vector<Piece> PairSpans(const std::vector<Span>& dst, const std::vector<Span>& src);
// memcpy, or cudaMemcpy when either side is on a GPU (`device`).
absl::Status CopyBytes(void* dst, const void* src, uint64_t n, Device device);
// Host pieces with memcpy, GPU pieces with one kernel per GPU.
absl::Status RunPieces(const std::vector<Piece>& pieces);

// A registered host buffer of `slots` slots of `slot_bytes`, pinned when CUDA can pin it
// (GPUs then read and write it directly), registered on every rail.
class StagingRing {
 public:
  static absl::StatusOr<std::unique_ptr<StagingRing>> Create(engine::Engine& engine, size_t slots,
                                                             uint64_t slot_bytes);
  ~StagingRing();
  char* slot(size_t i) const { return mem_ + i * slot_bytes_; }
  size_t slots() const { return slots_; }
  uint64_t slot_bytes() const { return slot_bytes_; }
  engine::RegionId region() const { return region_; }
  // After a failed pull WRITEs may still be on their way: the pool then frees the ring (its
  // MR goes first, so late WRITEs are refused) instead of handing it out again.
  void Poison() { poisoned_ = true; }
  bool poisoned() const { return poisoned_; }

 private:
  StagingRing() = default;
  bool poisoned_ = false;
  engine::Engine* engine_ = nullptr;
  char* mem_ = nullptr;
  bool pinned_ = false;
  size_t slots_ = 0;
  uint64_t slot_bytes_ = 0;
  engine::RegionId region_ = 0;
};

// Rings for concurrent staged pulls, kept for reuse (allocating and registering pinned memory
// costs milliseconds). Thread-safe.
class StagingPool {
 public:
  StagingPool(engine::Engine& engine, size_t slots, uint64_t slot_bytes)
      : engine_(engine), slots_(slots), slot_bytes_(slot_bytes) {}
  // A ring that goes back to the pool when the pointer goes.
  absl::StatusOr<std::shared_ptr<StagingRing>> Acquire();

 private:
  engine::Engine& engine_;
  const size_t slots_;
  const uint64_t slot_bytes_;
  absl::Mutex mu_;
  std::vector<std::unique_ptr<StagingRing>> free_ ABSL_GUARDED_BY(mu_);
};

// Pinned host buffers of kBytes through which the REST paths copy to and from GPU memory (the
// copy engines then read or write them directly, where pageable memory makes the driver stage
// it itself), kept for reuse: pinning costs milliseconds. Thread-safe.
class PinnedStages {
 public:
  static constexpr size_t kBytes = size_t{4} << 20;
  using Buffer = std::unique_ptr<char, std::function<void(char*)>>;
  ~PinnedStages();
  // A buffer of kBytes that comes back here when it goes. kUnimplemented without CUDA.
  absl::StatusOr<Buffer> Take();

 private:
  static constexpr size_t kKeep = 8;  // idle buffers kept
  absl::Mutex mu_;
  std::vector<char*> free_ ABSL_GUARDED_BY(mu_);
};

}  // namespace ferry::server

#endif  // FERRY_SERVER_PATHS_H_
