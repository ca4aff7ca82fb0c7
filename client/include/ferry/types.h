// Value types every part of ferry and its users share: where memory lives (Device) and a
// piece of a registered region (Extent). Plain data; thread-compatible.
#ifndef FERRY_TYPES_H_
#define FERRY_TYPES_H_

#include <charconv>
#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace ferry {

// Where memory lives: host memory, or GPU N ("cuda:N").
struct Device {
  enum class Kind { kHost, kCuda };
  Kind kind = Kind::kHost;
  int index = 0;

  static Device Host() { return {}; }
  static Device Cuda(int index) { return {Kind::kCuda, index}; }
  bool is_cuda() const { return kind == Kind::kCuda; }
  // "host" or "cuda:N". kInvalidArgument for anything else.
  static absl::StatusOr<Device> Parse(std::string_view text) {
    if (text == "host") return Host();
    constexpr std::string_view kCuda = "cuda:";
    if (text.substr(0, kCuda.size()) == kCuda && text.size() > kCuda.size() &&
        text.size() <= kCuda.size() + 4) {
      int index = 0;
      const char* end = text.data() + text.size();
      auto [ptr, ec] = std::from_chars(text.data() + kCuda.size(), end, index);
      if (ec == std::errc() && ptr == end && index >= 0) return Cuda(index);
    }
    return absl::InvalidArgumentError(
        absl::StrCat("unknown device '", std::string(text), "': want \"host\" or \"cuda:N\""));
  }
  std::string ToString() const {
    return kind == Kind::kHost ? std::string("host") : absl::StrCat("cuda:", index);
  }
  bool operator==(const Device&) const = default;
};

// `length` bytes at `offset` of a region. `region` names a region the way its context does: a
// node's region id in a published layout or a pull's destination, an index into a transfer's
// destination regions inside the engine.
struct Extent {
  uint64_t region = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
  bool operator==(const Extent&) const = default;
};

// True when [offset, offset + length) lies inside [0, region_length), without overflow.
inline bool InBounds(uint64_t offset, uint64_t length, uint64_t region_length) {
  return offset <= region_length && length <= region_length - offset;
}

}  // namespace ferry

#endif  // FERRY_TYPES_H_
