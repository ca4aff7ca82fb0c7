// fabtests' fi_rma_bw as a baseline for ferry-bench engine: libfabric's own RMA bandwidth
// test, a measuring instrument brought along (like iperf3), never built or shipped with ferry.
#ifndef FERRY_TESTS_BENCH_RMA_BW_H_
#define FERRY_TESTS_BENCH_RMA_BW_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace ferry::bench {

// Runs `pairs` fi_rma_bw server/client pairs on loopback at once, each sending `total / pairs`
// bytes as one-way WRITEs with remote CQ data (`-o writedata`) of `piece` bytes, fi_rma_bw's
// window (64) in flight, over `provider` ("tcp" runs as "tcp;ofi_rxm", what the engine gets
// for tcp). Returns `total` divided by the pairs' summed rates: the seconds the pairs would
// take together, each timed by fi_rma_bw itself (its setup not counted).
absl::StatusOr<double> RunRmaBw(const std::string& bin, const std::string& provider, uint64_t piece,
                                uint64_t total, size_t pairs);

}  // namespace ferry::bench

#endif  // FERRY_TESTS_BENCH_RMA_BW_H_
