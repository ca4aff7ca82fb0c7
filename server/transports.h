// The production peer transports (peer.h): control messages over the fabric, and HTTP.
#ifndef FERRY_SERVER_TRANSPORTS_H_
#define FERRY_SERVER_TRANSPORTS_H_

#include <memory>

#include "engine/engine.h"
#include "server/peer.h"

namespace ferry::server {

// Messages as the engine's control messages (fragmented past one frame, each tried rail after
// rail); answers come back the same way, as messages to this node. `engine` must outlive it.
std::unique_ptr<PeerTransport> MakeFabricTransport(engine::Engine& engine);

// Messages as POST {url}/v1/peer bodies (wire::kMessageContentType), the answer in the
// response; kept-alive connections, and a few threads that wait on them.
std::unique_ptr<PeerTransport> MakeHttpTransport();

}  // namespace ferry::server

#endif  // FERRY_SERVER_TRANSPORTS_H_
