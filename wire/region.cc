#include "wire/region.h"

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace ferry {

nlohmann::json ToJson(const RegionDescriptor& d) {
  nlohmann::json j = {{"node", d.node},
                      {"addr", d.addr},
                      {"length", d.length},
                      {"device", d.device.ToString()},
                      {"offset_addressing", d.offset_addressing},
                      {"keys", d.keys}};
  if (!d.host.empty()) j["host"] = d.host;
  if (!d.ipc_handle.empty()) {
    j["ipc"] = {{"handle", d.ipc_handle}, {"offset", d.ipc_offset}, {"gpu", d.ipc_gpu}};
  }
  return j;
}

absl::StatusOr<RegionDescriptor> RegionDescriptorFromJson(const nlohmann::json& j) {
  if (!j.is_object()) return absl::InvalidArgumentError("region descriptor: not an object");
  auto field = [&](const char* name) -> const nlohmann::json* {
    auto it = j.find(name);
    return it == j.end() ? nullptr : &*it;
  };
  const nlohmann::json* node = field("node");
  const nlohmann::json* addr = field("addr");
  const nlohmann::json* length = field("length");
  const nlohmann::json* device = field("device");
  const nlohmann::json* offset_addressing = field("offset_addressing");
  const nlohmann::json* keys = field("keys");
  if (!node || !node->is_string() || !addr || !addr->is_number_unsigned() || !length ||
      !length->is_number_unsigned() || !device || !device->is_string() || !offset_addressing ||
      !offset_addressing->is_boolean() || !keys || !keys->is_array()) {
    return absl::InvalidArgumentError(
        "region descriptor: want node (string), addr and length (unsigned), device (string), "
        "offset_addressing (bool), keys (array)");
  }
  RegionDescriptor d;
  d.node = node->get<std::string>();
  d.addr = addr->get<uint64_t>();
  d.length = length->get<uint64_t>();
  auto dev = Device::Parse(device->get<std::string>());
  if (!dev.ok()) return dev.status();
  d.device = *dev;
  d.offset_addressing = offset_addressing->get<bool>();
  for (const auto& k : *keys) {
    if (!k.is_number_unsigned()) return absl::InvalidArgumentError("region descriptor: bad key");
    d.keys.push_back(k.get<uint64_t>());
  }
  if (const nlohmann::json* host = field("host")) {
    if (!host->is_string()) return absl::InvalidArgumentError("region descriptor: bad host");
    d.host = host->get<std::string>();
  }
  if (const nlohmann::json* ipc = field("ipc")) {
    if (!ipc->is_object() || !ipc->contains("handle") || !(*ipc)["handle"].is_string() ||
        !ipc->contains("offset") || !(*ipc)["offset"].is_number_unsigned() ||
        !ipc->contains("gpu") || !(*ipc)["gpu"].is_string() ||
        (*ipc)["handle"].get<std::string>().empty()) {
      return absl::InvalidArgumentError(
          "region descriptor: ipc wants handle and gpu (hex strings) and offset (unsigned)");
    }
    if (d.device.kind != Device::Kind::kCuda) {
      return absl::InvalidArgumentError("region descriptor: ipc on host memory");
    }
    d.ipc_handle = (*ipc)["handle"].get<std::string>();
    d.ipc_offset = (*ipc)["offset"].get<uint64_t>();
    d.ipc_gpu = (*ipc)["gpu"].get<std::string>();
  }
  // GPU memory the provider cannot register has no keys: only the same-host and staged paths
  // reach it.
  if (d.keys.empty() && d.device.kind == Device::Kind::kHost) {
    return absl::InvalidArgumentError("region descriptor: no keys");
  }
  if (!d.offset_addressing && d.addr + d.length < d.addr) {
    return absl::InvalidArgumentError("region descriptor: addr + length overflows");
  }
  return d;
}

void Encode(const RegionDescriptor& d, ByteWriter& out) {
  out.Bytes(d.node);
  out.U64(d.addr);
  out.U64(d.length);
  out.U8(d.device.kind == Device::Kind::kCuda ? 1 : 0);
  out.U32(static_cast<uint32_t>(d.device.index));
  out.U8(d.offset_addressing ? 1 : 0);
  out.U32(static_cast<uint32_t>(d.keys.size()));
  for (uint64_t k : d.keys) out.U64(k);
  out.Bytes(d.host);
  out.Bytes(d.ipc_handle);
  out.U64(d.ipc_offset);
  out.Bytes(d.ipc_gpu);
}

absl::Status Decode(ByteReader& in, RegionDescriptor* d) {
  uint8_t cuda = 0, offset_addressing = 0;
  uint32_t index = 0, keys = 0;
  if (!in.Bytes(&d->node) || !in.U64(&d->addr) || !in.U64(&d->length) || !in.U8(&cuda) ||
      !in.U32(&index) || !in.U8(&offset_addressing) || !in.U32(&keys) || cuda > 1 ||
      offset_addressing > 1 || index > 9999 || keys > in.left() / 8) {
    return absl::InvalidArgumentError("region descriptor: short or malformed");
  }
  d->device = cuda ? Device::Cuda(static_cast<int>(index)) : Device::Host();
  d->offset_addressing = offset_addressing != 0;
  d->keys.resize(keys);
  for (uint64_t& k : d->keys) in.U64(&k);
  if (!in.Bytes(&d->host) || !in.Bytes(&d->ipc_handle) || !in.U64(&d->ipc_offset) ||
      !in.Bytes(&d->ipc_gpu)) {
    return absl::InvalidArgumentError("region descriptor: short or malformed");
  }
  if (d->node.empty() || d->node.size() > 256) {
    return absl::InvalidArgumentError("region descriptor: bad node id");
  }
  if (d->keys.empty() && !d->device.is_cuda()) {
    return absl::InvalidArgumentError("region descriptor: no keys");
  }
  if (!d->offset_addressing && d->addr + d->length < d->addr) {
    return absl::InvalidArgumentError("region descriptor: addr + length overflows");
  }
  return absl::OkStatus();
}

void Encode(const PeerAddress& a, ByteWriter& out) {
  out.Bytes(a.node);
  out.U32(static_cast<uint32_t>(a.rails.size()));
  for (const std::string& r : a.rails) out.Bytes(r);
  out.Bytes(a.bell);
}

absl::Status Decode(ByteReader& in, PeerAddress* a) {
  uint32_t rails = 0;
  if (!in.Bytes(&a->node) || !in.U32(&rails) || rails > 64) {
    return absl::InvalidArgumentError("peer address: short or malformed");
  }
  a->rails.resize(rails);
  for (std::string& r : a->rails) {
    if (!in.Bytes(&r) || r.empty() || r.size() > 256) {
      return absl::InvalidArgumentError("peer address: bad rail address");
    }
  }
  if (!in.Bytes(&a->bell) || a->bell.size() > 256 || a->node.empty() || a->node.size() > 256) {
    return absl::InvalidArgumentError("peer address: bad node id or bell");
  }
  return absl::OkStatus();
}

}  // namespace ferry
