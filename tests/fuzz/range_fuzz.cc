// Range headers of GET /v1/objects/{name}/data, parsed by cpp-httplib as a request's are, then
// resolved against an object's size (the input's first two bytes): what is served lies within
// the object and adds up to no more than it.
#include <string>

#include "httplib.h"
#include "tests/fuzz/fuzz.h"
#include "wire/ranges.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  const uint64_t object = uint64_t{data[0]} | uint64_t{data[1]} << 8;
  const std::string header(ferry::fuzz::Text(data + 2, size - 2));
  httplib::Ranges ranges;
  if (!httplib::detail::parse_range_header(header, ranges)) return 0;
  constexpr size_t kMax = 16;
  switch (ferry::ResolveRanges(ranges, object, kMax)) {
    case ferry::RangeAnswer::kWhole:
      FUZZ_CHECK(ranges.empty());
      break;
    case ferry::RangeAnswer::kParts: {
      FUZZ_CHECK(!ranges.empty() && ranges.size() <= kMax);
      uint64_t served = 0;
      for (const auto& [first, last] : ranges) {
        FUZZ_CHECK(first >= 0 && first <= last && static_cast<uint64_t>(last) < object);
        served += static_cast<uint64_t>(last - first) + 1;
      }
      FUZZ_CHECK(served <= object);
      break;
    }
    case ferry::RangeAnswer::kUnsatisfiable:
      break;
  }
  return 0;
}
