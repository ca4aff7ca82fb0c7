#include "engine/types.h"

#include <sys/mman.h>

#include <charconv>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace ferry::engine {

void* AllocateHostMemory(uint64_t size) {
  // A pull walks a scattered layout across the whole region, and the kernel's socket copies
  // (tcp) or the NIC's translations (efa, verbs) miss far less often on 2 MiB pages.
  constexpr uint64_t kHugePage = uint64_t{2} << 20;
  const uint64_t align = size >= kHugePage ? kHugePage : 4096;
  const uint64_t rounded = (size + align - 1) / align * align;
  void* mem = std::aligned_alloc(align, rounded);
  if (mem == nullptr) return nullptr;
  if (align == kHugePage) madvise(mem, rounded, MADV_HUGEPAGE);
  // The pages in one call (Linux 5.14 on; an older kernel refuses it and the memset faults
  // them in one at a time): on the paravirtualised test machine 0.013-0.05 s for 256 MiB the
  // guest had just freed, against 0.8-1 s for a memset in 4 KiB pages. Memory the guest has
  // not used lately costs about 2 ms per MiB either way.
  madvise(mem, rounded, MADV_POPULATE_WRITE);
  std::memset(mem, 0, rounded);  // the allocator may hand back bytes it had before
  return mem;
}

absl::StatusOr<Device> Device::Parse(std::string_view text) {
  if (text == "host") return Host();
  constexpr std::string_view kCuda = "cuda:";
  if (text.substr(0, kCuda.size()) == kCuda && text.size() > kCuda.size() &&
      text.size() <= kCuda.size() + 4) {
    int index = 0;
    const char* begin = text.data() + kCuda.size();
    const char* end = text.data() + text.size();
    auto [ptr, ec] = std::from_chars(begin, end, index);
    if (ec == std::errc() && ptr == end && index >= 0) return Cuda(index);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown device '", std::string(text), "': want \"host\" or \"cuda:N\""));
}

std::string RandomId() {
  std::random_device rd;
  std::mt19937_64 gen((uint64_t{rd()} << 32) ^ rd());
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string id(16, '0');
  uint64_t v = gen();
  for (char& c : id) {
    c = kDigits[v & 0xf];
    v >>= 4;
  }
  return id;
}

std::string Device::ToString() const {
  return kind == Kind::kHost ? std::string("host") : absl::StrCat("cuda:", index);
}

std::string HostId() {
  static const std::string id = [] {
    std::ifstream in("/proc/sys/kernel/random/boot_id");
    std::string line;
    std::getline(in, line);
    return line;
  }();
  return id;
}

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

}  // namespace ferry::engine
