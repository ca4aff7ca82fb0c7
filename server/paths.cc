#include "server/paths.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status.h"

namespace ferry::server {

std::string_view PathName(PullPath path) {
  switch (path) {
    case PullPath::kRdma:
      return "rdma";
    case PullPath::kCudaIpc:
      return "cuda_ipc";
    case PullPath::kStaged:
      return "staged";
  }
  return "?";
}

absl::StatusOr<std::optional<PullPath>> ParsePath(std::string_view name) {
  if (name == "auto") return std::optional<PullPath>();
  for (PullPath p : {PullPath::kRdma, PullPath::kCudaIpc, PullPath::kStaged}) {
    if (name == PathName(p)) return std::optional<PullPath>(p);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown path '", std::string(name), "': want auto, rdma, cuda_ipc or staged"));
}

PullPath ChoosePath(const PathFacts& f) {
  if (f.same_host && f.cuda_here && f.src_all_gpu && f.dst_all_ipc) return PullPath::kCudaIpc;
  if (f.src_on_rails && f.dst_on_rails) return PullPath::kRdma;
  return PullPath::kStaged;
}

std::vector<Span> Slice(const std::vector<Span>& spans, uint64_t offset, uint64_t length) {
  std::vector<Span> out;
  uint64_t pos = 0;
  for (const Span& s : spans) {
    if (length == 0) break;
    if (offset >= pos + s.length) {
      pos += s.length;
      continue;
    }
    const uint64_t skip = offset - pos;
    const uint64_t n = std::min(s.length - skip, length);
    out.push_back({s.ptr + skip, n, s.device});
    offset += n;
    length -= n;
    pos += s.length;
  }
  return out;
}

std::vector<Piece> PairSpans(const std::vector<Span>& dst, const std::vector<Span>& src) {
  std::vector<Piece> out;
  out.reserve(std::max(dst.size(), src.size()));
  WalkPairs(dst, src, [&out](const Span& d, char* dp, const Span& s, char* sp, uint64_t n) {
    const Device device = s.device.kind == Device::Kind::kCuda ? s.device : d.device;
    out.push_back({device, {reinterpret_cast<uint64_t>(dp), reinterpret_cast<uint64_t>(sp), n}});
  });
  return out;
}

absl::Status CopyBytes(void* dst, const void* src, uint64_t n, Device device) {
  if (device.kind == Device::Kind::kCuda) return engine::CudaCopy(dst, src, n);
  std::memcpy(dst, src, n);
  return absl::OkStatus();
}

absl::Status RunPieces(const std::vector<Piece>& pieces) {
  std::map<int, std::vector<engine::CopyPiece>> by_gpu;
  if (!pieces.empty() && pieces.front().device.kind == Device::Kind::kCuda) {
    by_gpu[pieces.front().device.index].reserve(pieces.size());
  }
  for (const Piece& p : pieces) {
    if (p.device.kind == Device::Kind::kCuda) {
      by_gpu[p.device.index].push_back(p.copy);
    } else {
      std::memcpy(reinterpret_cast<void*>(p.copy.dst), reinterpret_cast<const void*>(p.copy.src),
                  p.copy.length);
    }
  }
  for (const auto& [gpu, copies] : by_gpu) {
    RETURN_IF_ERROR(engine::CudaCopyPieces(gpu, copies));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<StagingRing>> StagingRing::Create(engine::Engine& engine,
                                                                 size_t slots,
                                                                 uint64_t slot_bytes) {
  std::unique_ptr<StagingRing> ring(new StagingRing());
  ring->engine_ = &engine;
  ring->slots_ = slots;
  ring->slot_bytes_ = slot_bytes;
  const uint64_t bytes = slots * slot_bytes;
  if (engine::CudaDeviceCount() > 0) {
    ASSIGN_OR_RETURN(void* p, engine::CudaHostAlloc(bytes));
    ring->mem_ = static_cast<char*>(p);
    ring->pinned_ = true;
  } else {
    ring->mem_ = static_cast<char*>(engine::AllocateHostMemory(bytes));
    if (ring->mem_ == nullptr) return absl::ResourceExhaustedError("out of memory for staging");
  }
  ASSIGN_OR_RETURN(ring->region_, engine.RegisterMemory(ring->mem_, bytes, Device::Host()));
  return ring;
}

StagingRing::~StagingRing() {
  if (region_ != 0 && !engine_->DeregisterMemory(region_).ok()) {
    return;  // a local transfer still reads it: leaving the memory is the safe choice
  }
  if (pinned_) {
    engine::CudaHostFree(mem_);
  } else {
    engine::FreeHostMemory(mem_, slots_ * slot_bytes_);
  }
}

absl::StatusOr<std::shared_ptr<StagingRing>> StagingPool::Acquire() {
  std::unique_ptr<StagingRing> ring;
  {
    absl::MutexLock lock(&mu_);
    if (!free_.empty()) {
      ring = std::move(free_.back());
      free_.pop_back();
    }
  }
  if (!ring) {
    ASSIGN_OR_RETURN(ring, StagingRing::Create(engine_, slots_, slot_bytes_));
  }
  return std::shared_ptr<StagingRing>(ring.release(), [this](StagingRing* r) {
    if (r->poisoned()) {
      delete r;
      return;
    }
    absl::MutexLock lock(&mu_);
    free_.emplace_back(r);
  });
}

PinnedStages::~PinnedStages() {
  for (char* p : free_) engine::CudaHostFree(p);
}

absl::StatusOr<PinnedStages::Buffer> PinnedStages::Take() {
  char* p = nullptr;
  {
    absl::MutexLock lock(&mu_);
    if (!free_.empty()) {
      p = free_.back();
      free_.pop_back();
    }
  }
  if (p == nullptr) {
    ASSIGN_OR_RETURN(void* mem, engine::CudaHostAlloc(kBytes));
    p = static_cast<char*>(mem);
  }
  return Buffer(p, [this](char* b) {
    absl::MutexLock lock(&mu_);
    if (free_.size() < kKeep) {
      free_.push_back(b);
    } else {
      engine::CudaHostFree(b);
    }
  });
}

}  // namespace ferry::server
