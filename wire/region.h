// What a peer needs to WRITE into a region, and its codecs (JSON for the HTTP API, binary for
// control messages). Plain data; thread-compatible.
#ifndef FERRY_WIRE_REGION_H_
#define FERRY_WIRE_REGION_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "base/bytes.h"
#include "base/ids.h"
#include "ferry/types.h"
#include "nlohmann/json_fwd.hpp"

namespace ferry {

// What a peer needs to WRITE into a region: its owner, where it is, how long it is, and one
// remote key per rail of the owner. Formats: docs/wire_format.md.
struct RegionDescriptor {
  std::string node;     // owner's node id
  uint64_t addr = 0;    // virtual address in the owner's process
  uint64_t length = 0;  // bytes
  Device device;        // where the memory lives
  // True when the owner's provider did not grant FI_MR_VIRT_ADDR: a WRITE's remote address is
  // then an offset into the region rather than `addr + offset` (fi_mr(3)).
  bool offset_addressing = false;
  std::vector<uint64_t> keys;  // one remote key per rail of the owner; none for GPU memory
                               // the owner's provider cannot register
  // GPU memory only. The owner's HostId(), and how a process on that host maps the memory:
  // the CUDA IPC handle (hex) of the allocation, the region's offset in it and the GPU's UUID.
  std::string host;
  std::string ipc_handle;
  uint64_t ipc_offset = 0;
  std::string ipc_gpu;

  // The remote address a WRITE at `offset` into this region uses.
  uint64_t RemoteAddress(uint64_t offset) const {
    return offset_addressing ? offset : addr + offset;
  }
  bool operator==(const RegionDescriptor&) const = default;
};

// How to reach a node over the fabric: its node id, one raw endpoint name per rail (as
// fi_getname gives it) and its engine's bell's (empty when it has none).
struct PeerAddress {
  std::string node;
  std::vector<std::string> rails;
  std::string bell;
  bool operator==(const PeerAddress&) const = default;
};

nlohmann::json ToJson(const RegionDescriptor& d);
// kInvalidArgument when a field is missing, has the wrong type, or the device is unknown.
absl::StatusOr<RegionDescriptor> RegionDescriptorFromJson(const nlohmann::json& j);

// Binary form (docs/wire_format.md). Decode: kInvalidArgument on short or malformed input.
void Encode(const RegionDescriptor& d, ByteWriter& out);
absl::Status Decode(ByteReader& in, RegionDescriptor* d);
void Encode(const PeerAddress& a, ByteWriter& out);
// kInvalidArgument: malformed, or more than 64 rails or addresses over 256 bytes.
absl::Status Decode(ByteReader& in, PeerAddress* a);

}  // namespace ferry

#endif  // FERRY_WIRE_REGION_H_
