// Layouts: the pieces of registered regions an object's bytes are taken from, or a pull's
// bytes go to, in order. Three forms, mixed freely: single extents, strided runs (count pieces
// of `piece` bytes, `stride` apart: a tensor's rows, a layer's blocks) and page tables (pages of
// `page_size` bytes picked by id from a pool: KV caches). A compact form stays compact on the
// wire (docs/wire_format.md). Plain data; thread-compatible.
#ifndef FERRY_LAYOUT_H_
#define FERRY_LAYOUT_H_

#include <cstdint>
#include <utility>
#include <vector>

#include "ferry/types.h"

namespace ferry {

class Layout {
 public:
  // One run of pieces, all in `region`.
  struct Run {
    enum class Kind : uint8_t { kExtent = 0, kStrided = 1, kPages = 2 };
    Kind kind = Kind::kExtent;
    uint64_t region = 0;
    uint64_t offset = 0;  // kExtent, kStrided: the first piece's; kPages: the pool's start
    uint64_t piece = 0;   // bytes per piece (kPages: the page size)
    uint64_t stride = 0;  // kStrided: from one piece's start to the next's
    uint64_t count = 1;   // pieces (kPages: page ids, in `page_ids` from `first_page`)
    uint64_t first_page = 0;
    bool operator==(const Run&) const = default;
  };

  Layout() = default;
  // A layout of these extents, in order.
  Layout(const std::vector<Extent>& extents) {  // NOLINT: a list of extents is a layout
    for (const Extent& e : extents) Add(e);
  }

  Layout& Add(const Extent& e) {
    runs_.push_back({Run::Kind::kExtent, e.region, e.offset, e.length, 0, 1, 0});
    bytes_ += e.length;
    pieces_ += 1;
    return *this;
  }
  // `count` pieces of `piece` bytes at offset, offset + stride, ... of `region`.
  Layout& AddStrided(uint64_t region, uint64_t offset, uint64_t piece, uint64_t stride,
                     uint64_t count) {
    runs_.push_back({Run::Kind::kStrided, region, offset, piece, stride, count, 0});
    bytes_ += piece * count;
    pieces_ += count;
    return *this;
  }
  // Pages `pages` (ids) of `page_size` bytes of the pool that starts at `offset` of `region`:
  // page i is [offset + i * page_size, + page_size).
  Layout& AddPages(uint64_t region, uint64_t offset, uint64_t page_size,
                   const std::vector<uint32_t>& pages) {
    runs_.push_back(
        {Run::Kind::kPages, region, offset, page_size, 0, pages.size(), page_ids_.size()});
    page_ids_.insert(page_ids_.end(), pages.begin(), pages.end());
    bytes_ += page_size * pages.size();
    pieces_ += pages.size();
    return *this;
  }

  // Sum of the pieces' lengths (wraps on overflow: Validate says so). Pieces, counted singly.
  uint64_t bytes() const { return bytes_; }
  uint64_t pieces() const { return pieces_; }
  bool empty() const { return pieces_ == 0; }
  const std::vector<Run>& runs() const { return runs_; }
  const std::vector<uint32_t>& page_ids() const { return page_ids_; }

  // The bytes of its region run `r` (of this layout) reaches over: [*start, *end) from its
  // lowest piece's first byte to past its highest piece's last ({offset, offset} for a run of
  // no pieces). False when that end is past 2^64.
  bool Cover(const Run& r, uint64_t* start, uint64_t* end) const {
    *start = *end = r.offset;
    if (r.count == 0) return true;
    uint64_t low = 0, high = 0;  // the lowest piece's index, the highest's
    switch (r.kind) {
      case Run::Kind::kExtent:
        break;
      case Run::Kind::kStrided:
        high = r.count - 1;
        break;
      case Run::Kind::kPages:
        low = UINT32_MAX;
        for (uint64_t i = r.first_page; i < r.first_page + r.count; ++i) {
          low = page_ids_[i] < low ? page_ids_[i] : low;
          high = page_ids_[i] > high ? page_ids_[i] : high;
        }
        break;
    }
    const uint64_t step = r.kind == Run::Kind::kStrided ? r.stride : r.piece;
    uint64_t first = 0, last = 0;
    return !__builtin_mul_overflow(low, step, &first) &&
           !__builtin_mul_overflow(high, step, &last) &&
           !__builtin_add_overflow(r.offset, first, start) &&
           !__builtin_add_overflow(r.offset, last, end) &&
           !__builtin_add_overflow(*end, r.piece, end);
  }

  // Calls f(Extent) for every piece, in order.
  template <typename F>
  void ForEach(F&& f) const {
    for (const Run& r : runs_) {
      switch (r.kind) {
        case Run::Kind::kExtent:
          f(Extent{r.region, r.offset, r.piece});
          break;
        case Run::Kind::kStrided:
          for (uint64_t i = 0; i < r.count; ++i)
            f(Extent{r.region, r.offset + i * r.stride, r.piece});
          break;
        case Run::Kind::kPages:
          for (uint64_t i = 0; i < r.count; ++i) {
            f(Extent{r.region, r.offset + uint64_t{page_ids_[r.first_page + i]} * r.piece,
                     r.piece});
          }
          break;
      }
    }
  }
  // The same runs in the same order, with the same page ids.
  friend bool operator==(const Layout& a, const Layout& b) {
    return a.pieces_ == b.pieces_ && a.bytes_ == b.bytes_ && a.runs_ == b.runs_ &&
           a.page_ids_ == b.page_ids_;
  }

  // Every piece as an extent, pieces adjacent in one region merged.
  std::vector<Extent> Expand() const {
    std::vector<Extent> out;
    out.reserve(pieces_ < (uint64_t{1} << 20) ? pieces_ : 0);
    ForEach([&out](const Extent& e) {
      if (e.length == 0) return;
      if (!out.empty() && out.back().region == e.region &&
          out.back().offset + out.back().length == e.offset) {
        out.back().length += e.length;
      } else {
        out.push_back(e);
      }
    });
    return out;
  }

 private:
  std::vector<Run> runs_;
  std::vector<uint32_t> page_ids_;
  uint64_t bytes_ = 0;
  uint64_t pieces_ = 0;
};

}  // namespace ferry

#endif  // FERRY_LAYOUT_H_
