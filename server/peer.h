// How a node reaches another node: a transport delivers a sealed message (wire/messages.h,
// wire/auth.h) and brings the answer back, or lets it come as a message of its own. In
// production the fabric (control messages over the rails the nodes share) carries them, HTTP
// (POST /v1/peer) when the fabric cannot reach the peer; unit tests put a fake in between, as
// leveldb's EnvWrapper stands in for the OS. Implementations are thread-safe.
#ifndef FERRY_SERVER_PEER_H_
#define FERRY_SERVER_PEER_H_

#include <functional>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "engine/types.h"

namespace ferry::server {

// Where a message goes: the node's URL (HTTP) and its peer in this node's engine (0: none).
struct PeerRef {
  std::string url;
  engine::PeerId fabric_peer = 0;
};

class PeerTransport {
 public:
  virtual ~PeerTransport() = default;
  // "fabric", "http", ...: what PullStats::via reports.
  virtual std::string_view name() const = 0;
  // Delivers `sealed` to `peer`; `sent` is called once, possibly before Send returns, with
  // the peer's sealed answer when this transport carries answers back (HTTP), an empty string
  // when the answer comes as a message to this node (the fabric), or why it could not send
  // (kUnavailable: the peer cannot be reached; kDeadlineExceeded: `deadline` passed). Never
  // blocks for the network; `sent` must not block.
  virtual void Send(const PeerRef& peer, std::string sealed, absl::Time deadline,
                    std::function<void(absl::StatusOr<std::string>)> sent) = 0;
};

}  // namespace ferry::server

#endif  // FERRY_SERVER_PEER_H_
