// A cluster test bed on one machine: N network namespaces (the nodes) joined through a bridge
// in a namespace of its own (the switch), each node on one veth whose both directions are
// shaped with tbf to the same rate, as if each had one NIC of that speed; this process reaches
// every node over an unshaped veth into the bridge. Everything is made by Create and removed
// by the destructor (and, for a bed whose process was killed, by the next Create). Needs root.
#ifndef FERRY_TESTS_TESTING_CLUSTER_BED_H_
#define FERRY_TESTS_TESTING_CLUSTER_BED_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace ferry::testing {

struct ClusterBedOptions {
  size_t nodes = 2;          // at most 64
  uint64_t rate_mbit = 500;  // tbf rate of each node's link, each way; 0: unshaped
  int mtu = 9000;
};

class ClusterBed {
 public:
  // kFailedPrecondition when this process may not create namespaces (not root).
  static absl::StatusOr<std::unique_ptr<ClusterBed>> Create(const ClusterBedOptions& options);
  ~ClusterBed();
  ClusterBed(const ClusterBed&) = delete;
  ClusterBed& operator=(const ClusterBed&) = delete;

  const ClusterBedOptions& options() const { return options_; }
  // argv prefix that runs a command in node i's namespace.
  std::vector<std::string> Exec(size_t i) const;
  // Node i's interface (its libfabric tcp domain) and address, which this process reaches.
  std::string Interface() const { return "eth0"; }
  std::string Address(size_t i) const;

 private:
  explicit ClusterBed(const ClusterBedOptions& options);
  absl::Status Build();
  std::string Ns(size_t i) const;  // node i's namespace
  std::string SwitchNs() const;
  std::string HostInterface() const;

  ClusterBedOptions options_;
  std::string tag_;  // the process id: names the namespaces and the host-side veth
  size_t made_ = 0;  // node namespaces created so far
  bool switch_made_ = false;
};

}  // namespace ferry::testing

#endif  // FERRY_TESTS_TESTING_CLUSTER_BED_H_
