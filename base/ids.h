// Identities: random node ids and keys, and this host's id.
#ifndef FERRY_BASE_IDS_H_
#define FERRY_BASE_IDS_H_

#include <cstdint>
#include <string>

namespace ferry {

// 16 random lowercase hex digits: node ids.
std::string RandomId();
// 64 bits from the system's random source (getrandom): keys a peer must not guess.
uint64_t RandomU64();
// This host's identity for the same-host GPU path: the kernel's boot id, which differs
// between machines and between boots of one (never the host name, which anyone can share).
std::string HostId();

}  // namespace ferry

#endif  // FERRY_BASE_IDS_H_
