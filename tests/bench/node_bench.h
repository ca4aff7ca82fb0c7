// ferry-bench node: pull latency and throughput through the HTTP path next to the engine's
// own time for the same WRITEs; catalog publish rate and lookup latency.
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
  uint64_t objects = 1000000;
  bool json = false;
};

int RunNodeBench(const NodeFlags& flags);

}  // namespace ferry::bench

#endif  // FERRY_TESTS_BENCH_NODE_BENCH_H_
