// ferry-bench cluster: one object distributed from one node to N others over a bed of 1 + N
// network namespaces on a bridge, each node's link shaped to the same rate, against one pull of
// the same object between two of them in the same run.
#ifndef FERRY_TESTS_BENCH_CLUSTER_BENCH_H_
#define FERRY_TESTS_BENCH_CLUSTER_BENCH_H_

#include <cstdint>
#include <string>
#include <vector>

namespace ferry::bench {

struct ClusterFlags {
  std::string ferryd;
  std::vector<size_t> receivers = {1, 2, 4, 8};
  uint64_t size = uint64_t{1} << 30;
  uint64_t rate_mbit = 1000;  // each node's link, each way
  uint64_t chunk = 0;         // 0: the node's default
  bool checksum = true;
  bool json = false;
};

int RunClusterBench(const ClusterFlags& flags);

}  // namespace ferry::bench

#endif  // FERRY_TESTS_BENCH_CLUSTER_BENCH_H_
