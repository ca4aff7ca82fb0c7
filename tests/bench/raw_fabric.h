// The raw libfabric baseline for ferry-bench: one FI_EP_RDM endpoint, one MR, and a plain
// fi_write loop with a fixed window. Nothing else: no queues, no planner, no threads.
#ifndef FERRY_TESTS_BENCH_RAW_FABRIC_H_
#define FERRY_TESTS_BENCH_RAW_FABRIC_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/fabric.h"
#include "engine/planner.h"

namespace ferry::bench {

class RawEndpoint {
 public:
  // provider: user-facing name ("tcp", "shm"); domain: e.g. "lo".
  static absl::StatusOr<std::unique_ptr<RawEndpoint>> Open(const std::string& provider,
                                                           const std::string& domain);
  ~RawEndpoint();
  absl::Status Register(void* addr, size_t length);
  std::string address() const { return address_; }
  uint64_t key() const;
  // Remote address of offset 0 of the registered region, as a peer must name it.
  uint64_t base() const;
  absl::StatusOr<uint64_t> Insert(const std::string& address);
  // Posts every write (src offset into the local region, dst offset into the remote one),
  // keeping `window` in flight, and waits until every byte has landed at the target (the
  // last WRITE asks for delivery completion; every WRITE does where WRITEs are unordered).
  absl::Status WriteAll(uint64_t peer, uint64_t remote_base, uint64_t remote_key,
                        const std::vector<engine::PlannedWrite>& writes, size_t window);
  // Reads the CQ once (drives manual progress on the target side).
  void Progress();

 private:
  RawEndpoint() = default;
  engine::InfoPtr info_;
  engine::FidPtr<fid_fabric> fabric_;
  engine::FidPtr<fid_domain> domain_;
  engine::FidPtr<fid_av> av_;
  engine::FidPtr<fid_cq> cq_;
  engine::FidPtr<fid_ep> ep_;
  engine::FidPtr<fid_mr> mr_;
  char* region_ = nullptr;
  std::string address_;
};

// The target process: opens an endpoint, registers `size` bytes, prints
// {"address":hex,"key":K,"base":B}; then answers "{}" to each "run" (and progresses until
// the next line) or "pause" (and blocks on stdin); any other line ends it.
int RunRawPeer(const std::string& provider, const std::string& domain, uint64_t size);

}  // namespace ferry::bench

#endif  // FERRY_TESTS_BENCH_RAW_FABRIC_H_
