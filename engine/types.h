// Value types shared by the engine and everything above it: devices, region descriptors and
// extents. Plain data; thread-compatible.
#ifndef FERRY_ENGINE_TYPES_H_
#define FERRY_ENGINE_TYPES_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "nlohmann/json_fwd.hpp"

namespace ferry::engine {

// Where a region's memory lives: host memory, or GPU N ("cuda:N").
struct Device {
  enum class Kind { kHost, kCuda };
  Kind kind = Kind::kHost;
  int index = 0;

  static Device Host() { return {}; }
  static Device Cuda(int index) { return {Kind::kCuda, index}; }
  // "host" or "cuda:N". kInvalidArgument for anything else.
  static absl::StatusOr<Device> Parse(std::string_view text);
  std::string ToString() const;
  bool operator==(const Device&) const = default;
};

// Engine-local handle of a registered region.
using RegionId = uint64_t;
// Engine-local handle of a peer.
using PeerId = uint64_t;

// What a peer needs to WRITE into a region: its owner, where it is, how long it is, and one
// remote key per rail of the owner. Wire format: docs in engine/README.md ("Region descriptor").
struct RegionDescriptor {
  std::string node;         // owner's node id
  uint64_t addr = 0;        // virtual address in the owner's process
  uint64_t length = 0;      // bytes
  Device device;            // where the memory lives
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

// 16 random lowercase hex digits: node ids.
std::string RandomId();
// This host's identity for the same-host GPU path: the kernel's boot id, which differs
// between machines and between boots of one (never the host name, which anyone can share).
std::string HostId();

nlohmann::json ToJson(const RegionDescriptor& d);
// kInvalidArgument when a field is missing, has the wrong type, or the device is unknown.
absl::StatusOr<RegionDescriptor> RegionDescriptorFromJson(const nlohmann::json& j);

// A piece of a region: `length` bytes at `offset`. `region` is a RegionId for local extents,
// or an index into the transfer's destination regions for remote ones.
struct Extent {
  uint64_t region = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
  bool operator==(const Extent&) const = default;
};

// Host memory for a region of `size` bytes (> 0): from 2 MiB on, 2 MiB-aligned, rounded up and
// in transparent huge pages where the kernel has them; zeroed, its pages present before the
// first WRITE. Release with std::free; nullptr when out of memory.
void* AllocateHostMemory(uint64_t size);

// True when [offset, offset + length) lies inside [0, region_length), without overflow.
inline bool InBounds(uint64_t offset, uint64_t length, uint64_t region_length) {
  return offset <= region_length && length <= region_length - offset;
}

}  // namespace ferry::engine

#endif  // FERRY_ENGINE_TYPES_H_
