// CRC32C (Castagnoli), the checksum of uploaded objects (X-Ferry-CRC32C). Thread-safe.
#ifndef FERRY_BASE_CRC32C_H_
#define FERRY_BASE_CRC32C_H_

#include <cstddef>
#include <cstdint>

namespace ferry {

// The CRC32C of `n` bytes at `data` following `crc` (0 to start): Crc32c(Crc32c(0, a), b) is
// the CRC32C of a then b. SSE4.2's instruction where the CPU has it.
uint32_t Crc32c(uint32_t crc, const void* data, size_t n);

}  // namespace ferry

#endif  // FERRY_BASE_CRC32C_H_
