// Value types every part of ferry and its users share: where memory lives (Device) and a
// piece of a registered region (Extent). Plain data; thread-compatible.
#ifndef FERRY_TYPES_H_
#define FERRY_TYPES_H_

#include <charconv>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

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

// One version of a named object as a node describes it.
struct ObjectInfo {
  std::string name;
  uint64_t version = 0;         // 1, 2, ... per name
  uint64_t size = 0;            // bytes
  int64_t created_ms = 0;       // publish time, Unix milliseconds
  bool durable = true;          // in the catalog on disk (false: in memory, gone at restart)
  bool detached = false;        // a region of its layout is not registered (since a restart)
  bool on_rails = true;         // every region of its layout is registered on the rails
  std::vector<Device> devices;  // where its extents live, each once
  std::vector<Extent> extents;  // its layout (empty when asked for without)
  std::string meta;  // what its publisher attached: JSON text, at most kMaxMeta bytes; or empty
  std::string content_type;        // the bytes' media type, as its publisher gave it; or empty
  std::optional<uint32_t> crc32c;  // of the bytes, when the node had them all (an upload)
};

// The most bytes of metadata an object version carries.
inline constexpr size_t kMaxMeta = size_t{1} << 20;

// What a pull did. Bytes, per-rail figures and seconds come from the source; `seconds` runs
// from the first WRITE to the last completion (staged: to the last byte copied in).
struct PullStats {
  std::string object;
  uint64_t version = 0;
  uint64_t bytes = 0;
  double seconds = 0;
  std::string path;  // "rdma", "cuda_ipc" or "staged"
  std::vector<uint64_t> bytes_per_rail;
  uint64_t rerouted_writes = 0;      // sent again on another rail after theirs failed
  std::vector<size_t> failed_rails;  // the source's rails that failed during the pull
  std::vector<double> rail_seconds;  // per source rail: its last delivery completion
  std::optional<uint64_t> region;    // the new buffer, for a pull into one
  std::string via;                   // how the nodes talked: "fabric", "http" or "local"
  // Why the pull ended on `path` after another failed (empty: the first path carried it).
  std::string fallback;
  // A pull by name (no "from"): the holder the bytes came from, and those tried before it,
  // each as "node at url: why it failed".
  std::string source;
  std::vector<std::string> tried;
};

// True when [offset, offset + length) lies inside [0, region_length), without overflow.
inline bool InBounds(uint64_t offset, uint64_t length, uint64_t region_length) {
  return offset <= region_length && length <= region_length - offset;
}

}  // namespace ferry

#endif  // FERRY_TYPES_H_
