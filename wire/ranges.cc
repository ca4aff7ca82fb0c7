#include "wire/ranges.h"

#include <algorithm>

namespace ferry {

RangeAnswer ResolveRanges(ByteRanges& ranges, uint64_t size, size_t max_ranges) {
  uint64_t asked = 0;
  for (auto& [first, last] : ranges) {
    if (first < 0) {  // the last `last` bytes
      if (last <= 0) return RangeAnswer::kUnsatisfiable;
      if (size == 0) {  // no bytes to take the last of
        ranges.clear();
        return RangeAnswer::kWhole;
      }
      first = static_cast<ssize_t>(size - std::min(static_cast<uint64_t>(last), size));
      last = static_cast<ssize_t>(size - 1);
    } else {
      if (static_cast<uint64_t>(first) >= size || (last >= 0 && last < first)) {
        return RangeAnswer::kUnsatisfiable;
      }
      if (last < 0 || static_cast<uint64_t>(last) >= size) last = static_cast<ssize_t>(size - 1);
    }
    asked += static_cast<uint64_t>(last - first) + 1;
  }
  if (ranges.empty() || ranges.size() > max_ranges || asked > size) {
    ranges.clear();
    return RangeAnswer::kWhole;
  }
  return RangeAnswer::kParts;
}

}  // namespace ferry
