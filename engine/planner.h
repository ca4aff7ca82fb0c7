// The transfer planner: turns a source and a destination extent list of the same total size
// into per-rail lists of WRITEs. Pure functions; thread-compatible.
#ifndef FERRY_ENGINE_PLANNER_H_
#define FERRY_ENGINE_PLANNER_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/types.h"

namespace ferry::engine {

// One WRITE: `length` bytes from source extent space (src.region, src.offset) to destination
// (dst.region, dst.offset). Regions are whatever the caller's extents named.
struct PlannedWrite {
  uint64_t src_region = 0;
  uint64_t src_offset = 0;
  uint64_t dst_region = 0;
  uint64_t dst_offset = 0;
  uint64_t length = 0;
};

struct PlanOptions {
  // Number of rails to spread the bytes over. Default: 1.
  size_t rails = 1;
  // Longest single WRITE; longer pieces are split (fi_getinfo's max_msg_size caps it).
  // Default: 1 MiB.
  uint64_t max_write = uint64_t{1} << 20;
};

struct Plan {
  std::vector<std::vector<PlannedWrite>> rails;  // rails[r]: WRITEs for rail r
  uint64_t bytes = 0;
  size_t writes = 0;
};

// Intersects `src` and `dst` (byte i of the transfer is byte i of each list's concatenation),
// merges pieces adjacent on both sides within the same regions, and cuts the byte stream into
// `rails` consecutive shares of equal size (to the byte), each split into WRITEs of at most
// `max_write`. Zero-length extents are skipped.
// kInvalidArgument: totals differ, total overflows, rails or max_write is 0.
absl::StatusOr<Plan> MakePlan(const std::vector<Extent>& src, const std::vector<Extent>& dst,
                              const PlanOptions& options);

}  // namespace ferry::engine

#endif  // FERRY_ENGINE_PLANNER_H_
