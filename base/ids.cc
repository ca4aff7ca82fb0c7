#include "base/ids.h"

#include <sys/random.h>

#include <fstream>
#include <random>

namespace ferry {

uint64_t RandomU64() {
  uint64_t v = 0;
  if (getrandom(&v, sizeof(v), 0) == static_cast<ssize_t>(sizeof(v))) return v;
  std::random_device rd;  // getrandom is there on every kernel ferry runs on; this is a backstop
  return (uint64_t{rd()} << 32) ^ rd();
}

std::string RandomId() {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string id(16, '0');
  uint64_t v = RandomU64();
  for (char& c : id) {
    c = kDigits[v & 0xf];
    v >>= 4;
  }
  return id;
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

}  // namespace ferry
