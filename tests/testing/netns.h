// A two-host test bed on one machine: network namespaces A and B joined by N veth pairs (the
// rails), each with its own subnet, a jumbo MTU and a tbf rate in both directions, plus an
// unshaped control link A<->B and one from this process's namespace to each of them (HTTP).
// Everything is created by Create and removed by the destructor; beds left behind by a killed
// process are removed by the next Create. Needs root.
#ifndef FERRY_TESTS_TESTING_NETNS_H_
#define FERRY_TESTS_TESTING_NETNS_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace ferry::testing {

struct TestBedOptions {
  size_t rails = 1;          // veth pairs; at most 64
  uint64_t rate_mbit = 500;  // tbf rate per rail and direction; 0: unshaped
  int mtu = 9000;
};

class TestBed {
 public:
  enum Side { kA = 0, kB = 1 };

  // kFailedPrecondition when this process may not create namespaces (not root).
  static absl::StatusOr<std::unique_ptr<TestBed>> Create(const TestBedOptions& options);
  ~TestBed();
  TestBed(const TestBed&) = delete;
  TestBed& operator=(const TestBed&) = delete;

  const TestBedOptions& options() const { return options_; }
  // The namespace's name, for `ip netns exec`.
  const std::string& ns(Side side) const { return ns_[side]; }
  // argv prefix that runs a command inside the side's namespace.
  std::vector<std::string> Exec(Side side) const { return {"ip", "netns", "exec", ns_[side]}; }
  // Rail i's interface (its libfabric tcp domain) and IPv4 address on `side`.
  std::string RailInterface(Side side, size_t i) const;
  std::string RailAddress(Side side, size_t i) const;
  // The side's address on the A<->B control link, and the address this process reaches it at.
  std::string PeerAddress(Side side) const;
  std::string HostAddress(Side side) const;
  // Takes rail i down (both ends) or brings it back up (returning once both ends report up).
  absl::Status SetRail(size_t i, bool up);
  // The same at one end only: the other end's link stays up (and loses its carrier).
  absl::Status SetRailEnd(Side side, size_t i, bool up);
  // Bytes sent so far on rail i at `side` (the kernel's counter for its interface).
  absl::StatusOr<uint64_t> TxBytes(Side side, size_t i);
  // Shapes rail i to `mbit` in both directions from now on.
  absl::Status SetRate(size_t i, uint64_t mbit);

 private:
  explicit TestBed(const TestBedOptions& options);
  absl::Status Build();
  absl::Status Ip(Side side, const std::string& args);
  // Puts (or replaces) rail i's tbf at `mbit`, both ends.
  absl::Status Shape(size_t i, uint64_t mbit);
  absl::Status WaitUntilUp(const std::vector<size_t>& rails);
  std::string HostSubnet(Side side) const;     // "10.213.N."
  std::string HostInterface(Side side) const;  // this process's veth into the side

  TestBedOptions options_;
  std::string tag_;  // unique per process: names the namespaces and host-side veths
  std::string ns_[2];
};

}  // namespace ferry::testing

#endif  // FERRY_TESTS_TESTING_NETNS_H_
