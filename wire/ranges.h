// The byte ranges a GET of an object's data asks for (RFC 9110 section 14), resolved against
// the object's size before cpp-httplib serves them.
#ifndef FERRY_WIRE_RANGES_H_
#define FERRY_WIRE_RANGES_H_

#include <sys/types.h>

#include <cstdint>
#include <utility>
#include <vector>

namespace ferry {

// As cpp-httplib parses a Range header: (first, last), -1 where the header leaves one out
// ("N-": (N, -1); "-N", the last N bytes: (-1, N)).
using ByteRanges = std::vector<std::pair<ssize_t, ssize_t>>;

enum class RangeAnswer {
  kWhole,          // the whole object (200): `ranges` is cleared
  kParts,          // the ranges (206): each is rewritten as (first, last), within the object
  kUnsatisfiable,  // 416: a range starts past the end, ends before it starts, or is "-0"
};

// What `ranges` get of an object of `size` bytes. A last byte past the end is the end; a
// suffix longer than the object is all of it. More than `max_ranges` ranges, or ranges that
// add up to more than the object (they overlap), get the whole object instead (RFC 9110 lets a
// server ignore Range), so that no request gets more bytes than the object has.
RangeAnswer ResolveRanges(ByteRanges& ranges, uint64_t size, size_t max_ranges);

}  // namespace ferry

#endif  // FERRY_WIRE_RANGES_H_
