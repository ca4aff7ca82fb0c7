// The transfer planner: turns a source and a destination extent list of the same total size
// into per-rail lists of WRITEs. Pure functions; thread-compatible.
#ifndef FERRY_ENGINE_PLANNER_H_
#define FERRY_ENGINE_PLANNER_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/types.h"

namespace ferry::engine {

// One piece of a WRITE: `length` bytes from source extent space (src.region, src.offset) to
// destination (dst.region, dst.offset). Regions are whatever the caller's extents named.
struct PlannedWrite {
  uint64_t src_region = 0;
  uint64_t src_offset = 0;
  uint64_t dst_region = 0;
  uint64_t dst_offset = 0;
  uint64_t length = 0;
  // Goes in the same WRITE as the piece before it on its rail (a gathered WRITE: same
  // regions as that piece, one source and one destination iov each).
  bool gathered = false;
};

struct PlanOptions {
  // Number of rails to spread the bytes over. Default: 1.
  size_t rails = 1;
  // Longest single WRITE; longer pieces are split (fi_getinfo's max_msg_size caps it).
  // Default: 1 MiB.
  uint64_t max_write = uint64_t{1} << 20;
  // Pieces one WRITE may carry: consecutive pieces of a rail that share their source and
  // their destination region go in one WRITE of at most max_iov pieces and max_write bytes
  // (fi_getinfo's iov_limit and rma_iov_limit cap it). Default: 1 (a WRITE per piece).
  size_t max_iov = 1;
};

struct Plan {
  std::vector<std::vector<PlannedWrite>> rails;  // rails[r]: the pieces of rail r's WRITEs
  uint64_t bytes = 0;
  size_t writes = 0;  // WRITEs (a gathered WRITE counts once)
};

// Intersects `src` and `dst` (byte i of the transfer is byte i of each list's concatenation),
// merges pieces adjacent on both sides within the same regions, and cuts the byte stream into
// `rails` consecutive shares of equal size (to the byte), each split into pieces of at most
// `max_write`, then gathers consecutive short pieces into WRITEs of up to `max_iov` pieces.
// Zero-length extents are skipped.
// kInvalidArgument: totals differ, total overflows, rails, max_write or max_iov is 0.
absl::StatusOr<Plan> MakePlan(const std::vector<Extent>& src, const std::vector<Extent>& dst,
                              const PlanOptions& options);

}  // namespace ferry::engine

#endif  // FERRY_ENGINE_PLANNER_H_
