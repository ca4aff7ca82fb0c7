#include "server/api_json.h"

#include "absl/strings/str_cat.h"
#include "base/hex.h"
#include "base/status.h"
#include "wire/api_json.h"
#include "wire/extents.h"
#include "wire/http_status.h"

namespace ferry::server {

nlohmann::json ToJson(const RegionInfo& r) {
  return {{"id", r.id},
          {"device", r.device.ToString()},
          {"size", r.size},
          {"owned", r.owned},
          {"for_object", r.for_object}};
}

nlohmann::json ToJson(const NodeInfo& n) {
  nlohmann::json rails = nlohmann::json::array();
  for (const engine::RailInfo& r : n.rails) {
    nlohmann::json rail = {{"provider", r.provider},      {"fabric", r.fabric},
                           {"domain", r.domain},          {"address", HexEncode(r.address)},
                           {"tx_depth", r.tx_depth},      {"max_msg_size", r.max_msg_size},
                           {"iov_limit", r.iov_limit},    {"hmem_cuda", r.hmem_cuda},
                           {"hmem_dmabuf", r.hmem_dmabuf}};
    if (!r.hmem_cuda) rail["hmem_cuda_error"] = r.hmem_cuda_error;
    if (!r.placement.empty()) rail["placement"] = r.placement;
    rails.push_back(std::move(rail));
  }
  nlohmann::json devices = nlohmann::json::array();
  for (const Device& d : n.devices) devices.push_back(d.ToString());
  return {{"id", n.id},
          {"version", n.version},
          {"host", n.host},
          {"rails", rails},
          {"progress_threads", n.progress_threads},
          {"devices", devices},
          {"cuda_built", n.cuda_built},
          {"spare_bytes", n.spare_bytes},
          {"bell", HexEncode(n.bell)},
          {"sealed", n.sealed}};
}

}  // namespace ferry::server
