// Order statistics of timed passes, shared by the ferry-bench subcommands.
#ifndef FERRY_TESTS_BENCH_STATS_H_
#define FERRY_TESTS_BENCH_STATS_H_

#include <algorithm>
#include <utility>
#include <vector>

namespace ferry::bench {

// The sample at fraction `p` (0 to 1) of `v` sorted: the value at index p * size, the last one
// for p = 1.
inline double Percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * static_cast<double>(v.size())))];
}

inline double Median(std::vector<double> v) { return Percentile(std::move(v), 0.5); }

}  // namespace ferry::bench

#endif  // FERRY_TESTS_BENCH_STATS_H_
