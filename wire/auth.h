// Node-to-node messages under a cluster key: each sealed message carries the sender's random
// session nonce, a counter and an HMAC-SHA256 over the message, nonce and counter, so a node
// that holds the key can tell a peer's request from a forgery or a replay without either node
// handing the other a secret. Without a key, messages go as they are. Thread-safe.
#ifndef FERRY_WIRE_AUTH_H_
#define FERRY_WIRE_AUTH_H_

#include <cstdint>
#include <deque>
#include <map>
#include <string>
#include <string_view>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace ferry::wire {

// The cluster key nodes that share a bearer token derive from it (SHA-256 of a label and the
// token): a MAC under it proves the token's knowledge without showing it.
std::string ClusterKeyFromToken(std::string_view token);

class MessageAuth {
 public:
  // `key`: the cluster key (any length; empty: messages are neither sealed nor checked).
  explicit MessageAuth(std::string key);
  bool enabled() const { return !key_.empty(); }
  // `message` with the seal appended (unchanged without a key).
  std::string Seal(std::string message);
  // The message inside `sealed`, checked. kUnauthenticated: no seal, a wrong MAC, or a
  // counter this receiver has seen from that sender's session (a replay) or that is too old to
  // tell. `sender` names the sender's sessions apart (its node id).
  absl::StatusOr<std::string_view> Open(std::string_view sealed, std::string_view sender);

 private:
  // The last counters seen from one sender session: the highest and a window below it.
  struct Seen {
    uint64_t highest = 0;
    uint64_t window = 0;  // bit i: highest - i seen
  };
  static constexpr size_t kTrailer = 8 + 8 + 32;
  static constexpr size_t kSessionsKept = 4096;

  const std::string key_;
  const uint64_t nonce_;
  absl::Mutex mu_;
  uint64_t counter_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<std::string, Seen> seen_ ABSL_GUARDED_BY(mu_);    // by sender and nonce
  std::deque<std::string> seen_order_ ABSL_GUARDED_BY(mu_);  // oldest first, to bound seen_
};

}  // namespace ferry::wire

#endif  // FERRY_WIRE_AUTH_H_
