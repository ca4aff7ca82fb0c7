// A pull as a destination asks for it: from which node, which object (or part of it), and
// where its bytes go. Plain data; thread-compatible.
#ifndef FERRY_PULL_H_
#define FERRY_PULL_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "ferry/layout.h"
#include "ferry/types.h"

namespace ferry {

struct PullSpec {
  // The source node, http://host:port. Empty: a holder of the object that the node's
  // directory names (same host first, then the least busy; the next one if it fails).
  std::string from;
  std::string object;
  std::optional<uint64_t> version;  // Default: the latest
  // Only part of the object: bytes [range_offset, + range_length) when range_length > 0, or
  // its extents `source_extents` (indices into its layout, in the order to take them).
  // Default: all of it.
  uint64_t range_offset = 0;
  uint64_t range_length = 0;
  std::vector<uint32_t> source_extents;
  // Where the bytes go, exactly one of:
  // - a new buffer on this device, published here as `as` (default: the object's name);
  std::optional<Device> new_buffer;
  std::string as;
  bool replace = false;
  bool durable = true;
  // With a directory: the new buffer is listed there as this node's (so later pulls may come
  // from it), and under the object's own name it keeps the source's version number (a
  // replica of that version) unless this node has that version or a later one. false: not
  // listed. Default: true.
  bool announce = true;
  // - a layout over this node's regions;
  Layout into;
  // - a prepared destination of this node: all its pieces, or those `indices` name.
  uint64_t prepared = 0;
  std::vector<uint32_t> indices;
  // "auto" (the best path the two nodes allow), "rdma", "cuda_ipc" or "staged".
  std::string path = "auto";
  // 0: the node's default.
  uint64_t timeout_ms = 0;
};

}  // namespace ferry

#endif  // FERRY_PULL_H_
