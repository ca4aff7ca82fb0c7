// ferry-bench node: pull latency and throughput through POST /v1/pulls, ferry::Client and an
// embedded node, next to the engine's own time for the same WRITEs; the control cost per
// piece of a many-piece pull, warm and cold; catalog publish rates and lookup latency.
#ifndef FERRY_TESTS_BENCH_NODE_BENCH_H_
#define FERRY_TESTS_BENCH_NODE_BENCH_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace httplib {
class Client;
}

namespace ferry::bench {

// POST /v1/regions on the node: a new host region of `size` bytes; its id.
absl::StatusOr<uint64_t> NewRegion(httplib::Client& c, uint64_t size);

struct NodeFlags {
  std::string ferryd;
  size_t rails = 4;
  std::vector<uint64_t> sizes = {1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20, 1 << 30};
  int iters = 5;
  int latency_iters = 1000;
  uint32_t max_extents = 16384;  // pieces of 64 KiB in the largest many-piece pull
  uint64_t objects = 1000000;
  bool json = false;
  // Instead of the tables: pulls between two nodes that count for /metrics and two that do
  // not (ferryd --metrics false), alternated.
  bool metrics_cost = false;
  std::vector<std::string> ferryd_args;  // more flags for every ferryd
};

int RunNodeBench(const NodeFlags& flags);

}  // namespace ferry::bench

#endif  // FERRY_TESTS_BENCH_NODE_BENCH_H_
