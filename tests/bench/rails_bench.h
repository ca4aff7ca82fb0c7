// ferry-bench rails: striping efficiency over N shaped rails between two network namespaces,
// against iperf3 over the same rails.
#ifndef FERRY_TESTS_BENCH_RAILS_BENCH_H_
#define FERRY_TESTS_BENCH_RAILS_BENCH_H_

#include <cstdint>
#include <string>
#include <vector>

namespace ferry::bench {

struct RailsFlags {
  std::string ferryd;
  // "NxMBIT": N rails at MBIT Mbit/s each.
  std::vector<std::string> configs = {"1x500", "2x500", "4x500", "8x500", "16x250", "32x125"};
  uint64_t size = uint64_t{1} << 30;
  std::vector<uint64_t> pieces = {65536, 1 << 20};
  int iperf_seconds = 5;
  // Timed pulls per configuration and piece size: a row gives the median and the worst.
  int repeat = 3;
  // More flags for both ferryd (e.g. --spin-while-awake=true).
  std::vector<std::string> ferryd_args;
  // After each row, the same pull again with the source's rail 0 taken down halfway through it
  // (and brought back after): a "failover" row with both times.
  bool cut_source_rail = false;
  bool json = false;
};

int RunRailsBench(const RailsFlags& flags);

}  // namespace ferry::bench

#endif  // FERRY_TESTS_BENCH_RAILS_BENCH_H_
