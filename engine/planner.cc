#include "engine/planner.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace ferry::engine {
namespace {

absl::StatusOr<uint64_t> Total(const std::vector<Extent>& extents, const char* side) {
  uint64_t total = 0;
  for (const Extent& e : extents) {
    if (total + e.length < total) {
      return absl::InvalidArgumentError(absl::StrCat(side, " extents overflow 2^64 bytes"));
    }
    total += e.length;
  }
  return total;
}

// Intersection of the two lists, with pieces that continue each other on both sides merged.
std::vector<PlannedWrite> Intersect(const std::vector<Extent>& src,
                                    const std::vector<Extent>& dst) {
  std::vector<PlannedWrite> pieces;
  pieces.reserve(std::max(src.size(), dst.size()));
  size_t si = 0, di = 0;
  uint64_t s_used = 0, d_used = 0;  // bytes consumed of src[si] / dst[di]
  while (si < src.size() && di < dst.size()) {
    if (src[si].length == s_used) {
      ++si;
      s_used = 0;
      continue;
    }
    if (dst[di].length == d_used) {
      ++di;
      d_used = 0;
      continue;
    }
    const uint64_t n = std::min(src[si].length - s_used, dst[di].length - d_used);
    PlannedWrite w{src[si].region, src[si].offset + s_used, dst[di].region, dst[di].offset + d_used,
                   n};
    if (!pieces.empty()) {
      PlannedWrite& last = pieces.back();
      if (last.src_region == w.src_region && last.dst_region == w.dst_region &&
          last.src_offset + last.length == w.src_offset &&
          last.dst_offset + last.length == w.dst_offset) {
        last.length += n;
        w.length = 0;
      }
    }
    if (w.length != 0) pieces.push_back(w);
    s_used += n;
    d_used += n;
  }
  return pieces;
}

}  // namespace

absl::StatusOr<Plan> MakePlan(const std::vector<Extent>& src, const std::vector<Extent>& dst,
                              const PlanOptions& options) {
  if (options.rails == 0) return absl::InvalidArgumentError("plan: zero rails");
  if (options.max_write == 0) return absl::InvalidArgumentError("plan: zero max_write");
  if (options.max_iov == 0) return absl::InvalidArgumentError("plan: zero max_iov");
  auto src_total = Total(src, "source");
  if (!src_total.ok()) return src_total.status();
  auto dst_total = Total(dst, "destination");
  if (!dst_total.ok()) return dst_total.status();
  if (*src_total != *dst_total) {
    return absl::InvalidArgumentError(
        absl::StrCat("source has ", *src_total, " bytes, destination ", *dst_total));
  }
  Plan plan;
  plan.bytes = *src_total;
  plan.rails.resize(options.rails);
  const std::vector<PlannedWrite> pieces = Intersect(src, dst);

  // Rail r carries bytes [bound(r), bound(r+1)) of the stream: equal shares to the byte, each
  // rail's pieces consecutive in the layout.
  const uint64_t rails = options.rails;
  const uint64_t share = plan.bytes / rails, extra = plan.bytes % rails;
  for (auto& out : plan.rails) out.reserve(pieces.size() / rails + 1);
  auto bound = [&](uint64_t r) { return r * share + std::min(r, extra); };
  uint64_t pos = 0;  // stream offset of the start of the current piece remainder
  size_t rail = 0;
  size_t iovs = 0;     // pieces in the rail's last WRITE
  uint64_t bytes = 0;  // ... and their bytes
  for (PlannedWrite piece : pieces) {
    while (piece.length > 0) {
      while (pos >= bound(rail + 1)) {
        ++rail;
        iovs = 0;
      }
      const uint64_t n = std::min({piece.length, bound(rail + 1) - pos, options.max_write});
      std::vector<PlannedWrite>& out = plan.rails[rail];
      const bool gathered = iovs > 0 && iovs < options.max_iov && bytes + n <= options.max_write &&
                            out.back().src_region == piece.src_region &&
                            out.back().dst_region == piece.dst_region;
      out.push_back(
          {piece.src_region, piece.src_offset, piece.dst_region, piece.dst_offset, n, gathered});
      if (gathered) {
        ++iovs;
        bytes += n;
      } else {
        iovs = 1;
        bytes = n;
        ++plan.writes;
      }
      piece.src_offset += n;
      piece.dst_offset += n;
      piece.length -= n;
      pos += n;
    }
  }
  return plan;
}

}  // namespace ferry::engine
