// JSON of the node's own API types (docs/http_api.md): regions, the node, pull specs.
#ifndef FERRY_SERVER_API_JSON_H_
#define FERRY_SERVER_API_JSON_H_

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"
#include "server/node.h"

namespace ferry::server {

nlohmann::json ToJson(const RegionInfo& r);
nlohmann::json ToJson(const NodeInfo& n);

}  // namespace ferry::server

#endif  // FERRY_SERVER_API_JSON_H_
