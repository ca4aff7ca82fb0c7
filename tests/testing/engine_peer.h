// The far end of two-process engine tests and benchmarks: an engine with one registered
// destination region, driven by JSON lines on stdin, answering on stdout.
//
// Flags: --provider P --rails N --domain D (repeatable) --size BYTES --canary BYTE
//        --progress-threads N --wait-fds 0|1 --spin-while-awake 0|1
//        --passes-move-nothing 1 (EngineOptions::pass_moved says no pass moved data)
// First line out: {"address":{"node":..,"rails":[hex..]},"region":<descriptor>}.
// Requests (one JSON object a line) and replies:
//   {"cmd":"verify","seed":S,"src":[[off,len],..],"dst":[[off,len],..]}
//       -> {"ok":true} or {"ok":false,"error":".."}; the region is reset to the canary after.
//   {"cmd":"expect","tag":T,"count":N}   -> {"ok":bool,"code":"..."} arms a counter
//   {"cmd":"wait","tag":T,"timeout_ms":M} -> {"ok":bool,"fires":F}
//   {"cmd":"fires","tag":T}              -> {"fires":F,"arrived":A,"immediates":I}: A of the
//                                            tag's counter, I every immediate that landed
//   {"cmd":"controls"}                   -> {"count":N,"last":".."}
//   {"cmd":"progress"}                   -> {"passes":P,"waits":W}: Engine::Progress()
//   {"cmd":"awake"} / {"cmd":"sleep"}    -> {"ok":true}: take / drop an Engine::KeepAwake token
//   {"cmd":"exit"}                       -> {"ok":true}, then the process exits
#ifndef FERRY_TESTS_TESTING_ENGINE_PEER_H_
#define FERRY_TESTS_TESTING_ENGINE_PEER_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/engine.h"
#include "nlohmann/json.hpp"

namespace ferry::testing {

int RunEnginePeer(int argc, char** argv);

// Helpers for the side that talks to a peer.
nlohmann::json ExtentsToJson(const std::vector<Extent>& extents);
nlohmann::json AddressToJson(const PeerAddress& address);
absl::StatusOr<PeerAddress> AddressFromJson(const nlohmann::json& j);

}  // namespace ferry::testing

#endif  // FERRY_TESTS_TESTING_ENGINE_PEER_H_
