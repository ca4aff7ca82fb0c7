// A pull as a destination asks for it: from which node, which object (or part of it), and
// where its bytes go. Plain data; thread-compatible.
#ifndef FERRY_PULL_H_
#define FERRY_PULL_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
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

// One object version delivered to many nodes at once (Node::Distribute, POST /v1/distribute):
// the receivers form a chain from the node that holds it, each pulling the object chunk by
// chunk from the node before it while it serves the chunks it has to the node after it, so
// that every link carries the object once and all receivers finish in about one pull's time.
struct DistributeSpec {
  std::string object;
  std::optional<uint64_t> version;  // Default: the latest
  // The receivers, exactly one of: their URLs (http://host:port), in chain order;
  std::vector<std::string> to;
  // or, with a directory, the nodes whose labels include all of these;
  std::map<std::string, std::string> labels;
  // or every other node of the directory.
  bool all = false;
  // Bytes per chunk. 0: a 64th of the object, within 1 MiB and 64 MiB.
  uint64_t chunk_bytes = 0;
  // Each chunk's CRC32C, computed once here, is checked by every receiver before it serves or
  // keeps the chunk. Default: true.
  bool checksum = true;
  // Where receivers put the object ("host", "cuda:0", ...). Default: host memory.
  std::string device = "host";
  bool durable = true;
  // 0: the node's pull timeout.
  uint64_t timeout_ms = 0;
};

// What one receiver of a distribution did.
struct ReceiverResult {
  std::string node;  // its id, once known
  std::string url;
  absl::Status status;  // OK: it holds the version
  double seconds = 0;   // from the start of the distribution to its last chunk
  uint64_t bytes = 0;
  uint64_t refetched_chunks = 0;     // pulled again: an upstream failed or sent a bad chunk
  std::vector<std::string> skipped;  // upstreams it gave up on, each with why
  bool held_already = false;         // it had the version before
};

struct DistributeResult {
  std::string object;
  uint64_t version = 0;
  uint64_t size = 0;
  uint64_t chunk_bytes = 0;
  uint64_t chunks = 0;
  double seconds = 0;                     // until the last receiver ended
  std::vector<ReceiverResult> receivers;  // in chain order
};

}  // namespace ferry

#endif  // FERRY_PULL_H_
