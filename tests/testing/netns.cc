#include "tests/testing/netns.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <numeric>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "base/status.h"
#include "nlohmann/json.hpp"
#include "tests/testing/subprocess.h"

namespace ferry::testing {
namespace {

constexpr char kNsPrefix[] = "ferry-tb-";
constexpr size_t kMaxRails = 64;

std::vector<std::string> Words(const std::string& s) {
  std::vector<std::string> out;
  for (absl::string_view w : absl::StrSplit(s, ' ', absl::SkipEmpty())) out.emplace_back(w);
  return out;
}

absl::Status Run(const std::vector<std::string>& argv) { return RunCommand(argv).status(); }

bool Gone(absl::string_view pid_text) {
  int pid = 0;
  return absl::SimpleAtoi(pid_text, &pid) && pid > 0 && kill(pid, 0) != 0 && errno == ESRCH;
}

// Deletes the namespaces and host-side veths of beds whose process is gone (killed before its
// destructor ran).
void RemoveLeftovers() {
  if (auto list = RunCommand({"ip", "netns", "list"}); list.ok()) {
    for (absl::string_view line : absl::StrSplit(*list, '\n', absl::SkipEmpty())) {
      const std::string name(line.substr(0, line.find(' ')));
      if (name.rfind(kNsPrefix, 0) != 0) continue;
      const std::string rest = name.substr(sizeof(kNsPrefix) - 1);
      if (!Gone(rest.substr(0, rest.find('-')))) continue;
      // Its ferryd outlived the test (killed by a timeout): they go first.
      if (auto pids = RunCommand({"ip", "netns", "pids", name}); pids.ok()) {
        for (absl::string_view p : absl::StrSplit(*pids, '\n', absl::SkipEmpty())) {
          int pid = 0;
          if (absl::SimpleAtoi(p, &pid) && pid > 0) kill(pid, SIGKILL);
        }
      }
      (void)Run({"ip", "netns", "del", name});
    }
  }
  // "7: fh1234a@if6: <BROADCAST,..." per link.
  if (auto links = RunCommand({"ip", "-o", "link", "show"}); links.ok()) {
    for (absl::string_view line : absl::StrSplit(*links, '\n', absl::SkipEmpty())) {
      const size_t colon = line.find(": ");
      if (colon == absl::string_view::npos) continue;
      absl::string_view name = line.substr(colon + 2);
      name = name.substr(0, name.find_first_of("@:"));
      if (name.size() < 4 || name.substr(0, 2) != "fh" ||
          (name.back() != 'a' && name.back() != 'b')) {
        continue;
      }
      if (Gone(name.substr(2, name.size() - 3)))
        (void)Run({"ip", "link", "del", std::string(name)});
    }
  }
}

}  // namespace

TestBed::TestBed(const TestBedOptions& options)
    : options_(options), tag_(std::to_string(getpid())) {
  ns_[kA] = absl::StrCat(kNsPrefix, tag_, "-a");
  ns_[kB] = absl::StrCat(kNsPrefix, tag_, "-b");
}

TestBed::~TestBed() {
  // The host-side veths first: a namespace goes away asynchronously, and with it the veths
  // into it, some time after `ip netns del` returns.
  for (Side side : {kA, kB}) (void)Run({"ip", "link", "del", HostInterface(side)});
  for (const std::string& ns : ns_) (void)Run({"ip", "netns", "del", ns});
}

absl::StatusOr<std::unique_ptr<TestBed>> TestBed::Create(const TestBedOptions& options) {
  if (geteuid() != 0) return absl::FailedPreconditionError("the netns test bed needs root");
  if (options.rails == 0 || options.rails > kMaxRails) {
    return absl::InvalidArgumentError(absl::StrCat("rails must be within 1..", kMaxRails));
  }
  RemoveLeftovers();
  std::unique_ptr<TestBed> bed(new TestBed(options));
  absl::Status s = bed->Build();
  if (!s.ok()) return s;  // the destructor removes what was made
  return bed;
}

std::string TestBed::RailInterface(Side side, size_t i) const {
  return absl::StrCat(side == kA ? "fa" : "fb", i);
}

std::string TestBed::RailAddress(Side side, size_t i) const {
  return absl::StrCat("10.214.", i, ".", side == kA ? 1 : 2);
}

std::string TestBed::PeerAddress(Side side) const {
  return absl::StrCat("10.213.0.", side == kA ? 1 : 2);
}

// Each bed's host links have subnets of their own (10.213.1.0/24 to 10.213.200.0/24, after
// the process id), so beds of two processes can coexist.
std::string TestBed::HostSubnet(Side side) const {
  return absl::StrCat("10.213.", 1 + 2 * (getpid() % 100) + side, ".");
}

std::string TestBed::HostAddress(Side side) const { return HostSubnet(side) + "2"; }

std::string TestBed::HostInterface(Side side) const {
  return absl::StrCat("fh", tag_, side == kA ? "a" : "b");
}

absl::Status TestBed::Ip(Side side, const std::string& args) {
  std::vector<std::string> argv = {"ip", "-n", ns_[side]};
  for (std::string& w : Words(args)) argv.push_back(std::move(w));
  return Run(argv);
}

absl::Status TestBed::WaitUntilUp(const std::vector<size_t>& rails) {
  // The kernel reports a veth's operational state (IFF_RUNNING, which the tcp provider wants
  // before it lists the interface as a domain) up to a second after the link is set up.
  const absl::Time give_up = absl::Now() + absl::Seconds(5);
  for (Side side : {kA, kB}) {
    for (size_t i : rails) {
      const std::string name = RailInterface(side, i);
      for (;;) {
        auto out = RunCommand({"ip", "-n", ns_[side], "-o", "link", "show", "dev", name});
        if (!out.ok()) return out.status();
        if (absl::StrContains(*out, " state UP ")) break;
        if (absl::Now() > give_up) {
          return absl::DeadlineExceededError(absl::StrCat(name, " in ", ns_[side], " is not up"));
        }
        absl::SleepFor(absl::Milliseconds(20));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status TestBed::Build() {
  for (Side side : {kA, kB}) {
    if (absl::Status s = Run({"ip", "netns", "add", ns_[side]}); !s.ok()) return s;
    // Rails share no subnet, and a source with more rails than its peer reaches the peer's
    // rails through its own first ones: answers come back on another veth (no reverse-path
    // filter).
    if (absl::Status s =
            Run({"ip", "netns", "exec", ns_[side], "sh", "-c",
                 "for f in /proc/sys/net/ipv4/conf/*/rp_filter; do echo 0 > $f; done"});
        !s.ok()) {
      return s;
    }
    if (absl::Status s = Ip(side, "link set lo up"); !s.ok()) return s;
    // A NIC's send queue is bounded; a tcp socket's is not (autotuned up to tcp_wmem's 4 MiB,
    // differently per rail), and bytes in it are out of reach of the engine's scheduling. Each
    // side keeps at most 128 KiB unsent per socket, the same for iperf3.
    if (absl::Status s = Run({"ip", "netns", "exec", ns_[side], "sysctl", "-q", "-w",
                              "net.ipv4.tcp_notsent_lowat=131072"});
        !s.ok()) {
      return s;
    }
  }
  auto link = [this](const std::string& a_if, const std::string& b_if, const std::string& a_addr,
                     const std::string& b_addr, int mtu) -> absl::Status {
    if (absl::Status s =
            Run(Words(absl::StrCat("ip link add ", a_if, " netns ", ns_[kA],
                                   " type veth peer name ", b_if, " netns ", ns_[kB])));
        !s.ok()) {
      return s;
    }
    for (auto [side, ifname, addr] : {std::tuple{kA, a_if, a_addr}, std::tuple{kB, b_if, b_addr}}) {
      if (absl::Status s = Ip(side, absl::StrCat("addr add ", addr, "/24 dev ", ifname)); !s.ok()) {
        return s;
      }
      if (absl::Status s = Ip(side, absl::StrCat("link set ", ifname, " mtu ", mtu, " up"));
          !s.ok()) {
        return s;
      }
    }
    return absl::OkStatus();
  };
  if (absl::Status s = link("fc", "fc", PeerAddress(kA), PeerAddress(kB), 1500); !s.ok()) return s;
  for (size_t i = 0; i < options_.rails; ++i) {
    if (absl::Status s = link(RailInterface(kA, i), RailInterface(kB, i), RailAddress(kA, i),
                              RailAddress(kB, i), options_.mtu);
        !s.ok()) {
      return s;
    }
    if (options_.rate_mbit == 0) continue;
    if (absl::Status s = Shape(i, options_.rate_mbit); !s.ok()) return s;
  }
  // This process reaches each side over a veth of its own, named after the process.
  for (Side side : {kA, kB}) {
    const std::string host_if = HostInterface(side);
    const std::string host_addr = HostSubnet(side) + "1/24";
    if (absl::Status s = Run(Words(
            absl::StrCat("ip link add ", host_if, " type veth peer name fh netns ", ns_[side])));
        !s.ok()) {
      return s;
    }
    if (absl::Status s = Run(Words(absl::StrCat("ip addr add ", host_addr, " dev ", host_if)));
        !s.ok()) {
      return s;
    }
    if (absl::Status s = Run(Words(absl::StrCat("ip link set ", host_if, " up"))); !s.ok())
      return s;
    if (absl::Status s = Ip(side, absl::StrCat("addr add ", HostAddress(side), "/24 dev fh"));
        !s.ok()) {
      return s;
    }
    if (absl::Status s = Ip(side, "link set fh up"); !s.ok()) return s;
  }
  std::vector<size_t> all(options_.rails);
  std::iota(all.begin(), all.end(), 0);
  return WaitUntilUp(all);
}

absl::Status TestBed::Shape(size_t i, uint64_t mbit) {
  // Burst: 2 ms at the rate, and at least one 64 KiB GSO packet; the queue holds 50 ms.
  const uint64_t burst = std::max<uint64_t>(65536, mbit * 1000000 / 8 / 500);
  for (Side side : {kA, kB}) {
    const std::string tc =
        absl::StrCat("tc -n ", ns_[side], " qdisc replace dev ", RailInterface(side, i),
                     " root tbf rate ", mbit, "mbit burst ", burst, " latency 50ms");
    if (absl::Status s = Run(Words(tc)); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status TestBed::SetRate(size_t i, uint64_t mbit) {
  if (i >= options_.rails || mbit == 0) return absl::InvalidArgumentError("no such rail or rate");
  return Shape(i, mbit);
}

absl::Status TestBed::SetRail(size_t i, bool up) {
  if (i >= options_.rails) return absl::InvalidArgumentError("no such rail");
  for (Side side : {kA, kB}) {
    if (absl::Status s =
            Ip(side, absl::StrCat("link set ", RailInterface(side, i), up ? " up" : " down"));
        !s.ok()) {
      return s;
    }
  }
  return up ? WaitUntilUp({i}) : absl::OkStatus();
}

absl::Status TestBed::SetRailEnd(Side side, size_t i, bool up) {
  if (i >= options_.rails) return absl::InvalidArgumentError("no such rail");
  RETURN_IF_ERROR(
      Ip(side, absl::StrCat("link set ", RailInterface(side, i), up ? " up" : " down")));
  return up ? WaitUntilUp({i}) : absl::OkStatus();
}

absl::StatusOr<uint64_t> TestBed::TxBytes(Side side, size_t i) {
  if (i >= options_.rails) return absl::InvalidArgumentError("no such rail");
  ASSIGN_OR_RETURN(std::string out, RunCommand({"ip", "-n", ns_[side], "-s", "-j", "link", "show",
                                                "dev", RailInterface(side, i)}));
  auto j = nlohmann::json::parse(out, nullptr, false);
  if (j.is_discarded() || !j.is_array() || j.empty() || !j[0].contains("stats64")) {
    return absl::InternalError("ip -s -j link: unexpected output: " + out);
  }
  return j[0]["stats64"]["tx"]["bytes"].get<uint64_t>();
}

}  // namespace ferry::testing
