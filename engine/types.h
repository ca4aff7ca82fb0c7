// The engine's handles, and the host memory it registers best. The value types it shares with
// everything above it (Device, Extent, RegionDescriptor) are in ferry/types.h and wire/region.h.
#ifndef FERRY_ENGINE_TYPES_H_
#define FERRY_ENGINE_TYPES_H_

#include <cstdint>

#include "ferry/types.h"
#include "wire/region.h"

namespace ferry::engine {

// Engine-local handle of a registered region.
using RegionId = uint64_t;
// Engine-local handle of a peer.
using PeerId = uint64_t;

// Host memory for a region of `size` bytes (> 0): from 2 MiB on, 2 MiB-aligned, rounded up and
// in transparent huge pages where the kernel has them; zeroed, its pages present before the
// first WRITE; mapped, never from the heap. Release with FreeHostMemory(p, size), which returns
// it to the system; nullptr when out of memory.
void* AllocateHostMemory(uint64_t size);
// Releases what AllocateHostMemory(size) returned (nullptr: nothing).
void FreeHostMemory(void* p, uint64_t size);

}  // namespace ferry::engine

#endif  // FERRY_ENGINE_TYPES_H_
