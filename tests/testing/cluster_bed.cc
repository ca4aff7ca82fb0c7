#include "tests/testing/cluster_bed.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "base/status.h"
#include "tests/testing/subprocess.h"

namespace ferry::testing {
namespace {

constexpr char kNsPrefix[] = "ferry-cb-";
constexpr size_t kMaxNodes = 64;

absl::Status Sh(const std::string& command) { return RunCommand({"sh", "-c", command}).status(); }

// Namespaces (and their processes) and host-side veths of beds whose process is gone.
void RemoveLeftovers() {
  auto list = RunCommand({"ip", "netns", "list"});
  if (!list.ok()) return;
  for (absl::string_view line : absl::StrSplit(*list, '\n', absl::SkipEmpty())) {
    const std::string name(line.substr(0, line.find(' ')));
    if (name.rfind(kNsPrefix, 0) != 0) continue;
    const std::string rest = name.substr(sizeof(kNsPrefix) - 1);
    int pid = 0;
    if (!absl::SimpleAtoi(rest.substr(0, rest.find('-')), &pid) || pid <= 0 || kill(pid, 0) == 0 ||
        errno != ESRCH) {
      continue;
    }
    if (auto pids = RunCommand({"ip", "netns", "pids", name}); pids.ok()) {
      for (absl::string_view p : absl::StrSplit(*pids, '\n', absl::SkipEmpty())) {
        int q = 0;
        if (absl::SimpleAtoi(p, &q) && q > 0) kill(q, SIGKILL);
      }
    }
    IgnoreError(RunCommand({"ip", "netns", "del", name}).status());
    IgnoreError(RunCommand({"ip", "link", "del", absl::StrCat("cb", pid)}).status());
  }
}

}  // namespace

ClusterBed::ClusterBed(const ClusterBedOptions& options)
    : options_(options), tag_(std::to_string(getpid())) {}

ClusterBed::~ClusterBed() {
  IgnoreError(RunCommand({"ip", "link", "del", HostInterface()}).status());
  for (size_t i = 0; i < made_; ++i)
    IgnoreError(RunCommand({"ip", "netns", "del", Ns(i)}).status());
  if (switch_made_) IgnoreError(RunCommand({"ip", "netns", "del", SwitchNs()}).status());
}

absl::StatusOr<std::unique_ptr<ClusterBed>> ClusterBed::Create(const ClusterBedOptions& options) {
  if (geteuid() != 0) return absl::FailedPreconditionError("the cluster test bed needs root");
  if (options.nodes == 0 || options.nodes > kMaxNodes) {
    return absl::InvalidArgumentError(absl::StrCat("nodes must be within 1..", kMaxNodes));
  }
  RemoveLeftovers();
  std::unique_ptr<ClusterBed> bed(new ClusterBed(options));
  RETURN_IF_ERROR(bed->Build());  // the destructor removes what was made
  return bed;
}

std::string ClusterBed::Ns(size_t i) const { return absl::StrCat(kNsPrefix, tag_, "-n", i); }
std::string ClusterBed::SwitchNs() const { return absl::StrCat(kNsPrefix, tag_, "-sw"); }
std::string ClusterBed::HostInterface() const { return absl::StrCat("cb", tag_); }

std::vector<std::string> ClusterBed::Exec(size_t i) const { return {"ip", "netns", "exec", Ns(i)}; }

// One subnet per process (10.216.N.0/24), so that beds of two processes can coexist; this
// process is .254.
std::string ClusterBed::Address(size_t i) const {
  return absl::StrCat("10.216.", getpid() % 250, ".", i + 1);
}

absl::Status ClusterBed::Build() {
  const std::string subnet = absl::StrCat("10.216.", getpid() % 250, ".");
  const std::string sw = SwitchNs();
  RETURN_IF_ERROR(Sh(absl::StrCat("ip netns add ", sw)));
  switch_made_ = true;
  RETURN_IF_ERROR(
      Sh(absl::StrCat("ip -n ", sw, " link add br0 type bridge && ip -n ", sw, " link set br0 mtu ",
                      options_.mtu, " up && ip -n ", sw, " link set lo up")));
  // Burst: 2 ms at the rate, at least one 64 KiB GSO packet; the queue holds 50 ms.
  const uint64_t burst = std::max<uint64_t>(65536, options_.rate_mbit * 1000000 / 8 / 500);
  auto shape = [&](const std::string& ns, const std::string& dev) -> absl::Status {
    if (options_.rate_mbit == 0) return absl::OkStatus();
    return Sh(absl::StrCat("tc -n ", ns, " qdisc replace dev ", dev, " root tbf rate ",
                           options_.rate_mbit, "mbit burst ", burst, " latency 50ms"));
  };
  for (size_t i = 0; i < options_.nodes; ++i) {
    const std::string ns = Ns(i), port = absl::StrCat("p", i);
    RETURN_IF_ERROR(Sh(absl::StrCat("ip netns add ", ns)));
    made_ = i + 1;
    RETURN_IF_ERROR(Sh(
        absl::StrCat("ip link add eth0 netns ", ns, " type veth peer name ", port, " netns ", sw)));
    RETURN_IF_ERROR(Sh(
        absl::StrCat("ip -n ", sw, " link set ", port, " master br0 mtu ", options_.mtu, " up")));
    RETURN_IF_ERROR(Sh(absl::StrCat("ip -n ", ns, " addr add ", Address(i),
                                    "/24 dev eth0 && ip -n ", ns, " link set eth0 mtu ",
                                    options_.mtu, " up && ip -n ", ns, " link set lo up")));
    // As in the rails bed: at most 128 KiB unsent per socket, out of the engine's reach.
    RETURN_IF_ERROR(
        Sh(absl::StrCat("ip netns exec ", ns, " sysctl -q -w net.ipv4.tcp_notsent_lowat=131072")));
    RETURN_IF_ERROR(shape(ns, "eth0"));  // the node's sending side
    RETURN_IF_ERROR(shape(sw, port));    // its receiving side
  }
  RETURN_IF_ERROR(
      Sh(absl::StrCat("ip link add ", HostInterface(), " type veth peer name host netns ", sw,
                      " && ip -n ", sw, " link set host master br0 up && ip addr add ", subnet,
                      "254/24 dev ", HostInterface(), " && ip link set ", HostInterface(), " up")));
  // The kernel reports a veth up (IFF_RUNNING, which the tcp provider wants before it lists the
  // interface) up to a second after it is set up.
  const absl::Time give_up = absl::Now() + absl::Seconds(5);
  for (size_t i = 0; i < options_.nodes; ++i) {
    for (;;) {
      ASSIGN_OR_RETURN(std::string out,
                       RunCommand({"ip", "-n", Ns(i), "-o", "link", "show", "dev", "eth0"}));
      if (out.find(" state UP ") != std::string::npos) break;
      if (absl::Now() > give_up) {
        return absl::DeadlineExceededError(absl::StrCat("eth0 in ", Ns(i), " is not up"));
      }
      absl::SleepFor(absl::Milliseconds(20));
    }
  }
  return absl::OkStatus();
}

}  // namespace ferry::testing
