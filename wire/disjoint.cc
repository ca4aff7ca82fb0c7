#include "wire/disjoint.h"

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

namespace ferry {
namespace {

struct Span {
  uint64_t region, start, end;
};

bool Before(const Span& a, const Span& b) {
  return a.region != b.region ? a.region < b.region : a.start < b.start;
}

// Whether sorted spans lie apart.
bool Apart(const std::vector<Span>& sorted) {
  for (size_t i = 1; i < sorted.size(); ++i) {
    if (sorted[i].region == sorted[i - 1].region && sorted[i].start < sorted[i - 1].end) {
      return false;
    }
  }
  return true;
}

bool SortedApart(std::vector<Span>& spans) {
  if (!std::is_sorted(spans.begin(), spans.end(), Before)) {
    std::sort(spans.begin(), spans.end(), Before);
  }
  return Apart(spans);
}

// Whether ids[first, first + count) are distinct: a bitmap over their range when it is not
// much wider than their number, else a sorted copy.
bool DistinctIds(const std::vector<uint32_t>& ids, uint64_t first, uint64_t count) {
  const uint32_t* begin = ids.data() + first;
  const uint32_t* end = begin + count;
  const auto [lowest, highest] = std::minmax_element(begin, end);
  const uint32_t low = *lowest;
  const uint64_t width = uint64_t{*highest} - low + 1;
  if (width <= 64 * count) {
    std::vector<uint64_t> seen((width + 63) / 64);
    for (const uint32_t* it = begin; it != end; ++it) {
      const uint64_t bit = *it - low;
      uint64_t& word = seen[bit / 64];
      const uint64_t mask = uint64_t{1} << (bit % 64);
      if (word & mask) return false;
      word |= mask;
    }
    return true;
  }
  auto sorted = std::make_unique<uint32_t[]>(count);
  std::copy(begin, end, sorted.get());
  std::sort(sorted.get(), sorted.get() + count);
  return std::adjacent_find(sorted.get(), sorted.get() + count) == sorted.get() + count;
}

}  // namespace

bool Disjoint(const Layout& layout) {
  using Kind = Layout::Run::Kind;
  const std::vector<uint32_t>& ids = layout.page_ids();
  // First each run as the span it covers, when its own pieces lie apart.
  std::vector<Span> runs;
  runs.reserve(layout.runs().size());
  for (const Layout::Run& r : layout.runs()) {
    if (r.count == 0 || r.piece == 0) continue;  // no bytes
    if (r.kind == Kind::kStrided && r.count > 1 && r.stride < r.piece) return false;
    if (r.kind == Kind::kPages && !DistinctIds(ids, r.first_page, r.count)) return false;
    uint64_t start = 0, end = 0;
    layout.Cover(r, &start, &end);
    runs.push_back({r.region, start, end});
  }
  if (SortedApart(runs)) return true;
  // Runs whose spans interleave (two strided runs over alternate rows, say): piece by piece.
  std::vector<Span> pieces;
  pieces.reserve(layout.pieces());
  layout.ForEach([&pieces](const Extent& e) {
    if (e.length > 0) pieces.push_back({e.region, e.offset, e.offset + e.length});
  });
  return SortedApart(pieces);
}

std::optional<uint64_t> WithinRegions(
    const Layout& layout, absl::FunctionRef<std::optional<uint64_t>(uint64_t region)> length) {
  uint64_t total = 0;
  for (const Layout::Run& r : layout.runs()) {
    const std::optional<uint64_t> size = length(r.region);
    uint64_t start = 0, end = 0, bytes = 0;
    if (!size || r.piece == 0 || !layout.Cover(r, &start, &end) ||
        !InBounds(start, end - start, *size) || __builtin_mul_overflow(r.piece, r.count, &bytes) ||
        __builtin_add_overflow(total, bytes, &total)) {
      return std::nullopt;
    }
  }
  return total;
}

}  // namespace ferry
