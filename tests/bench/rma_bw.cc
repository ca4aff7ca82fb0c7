#include "tests/bench/rma_bw.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <fstream>
#include <memory>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "base/status.h"
#include "tests/testing/subprocess.h"

namespace ferry::bench {
namespace {

// A loopback port nothing listens on now (the kernel's pick, given back at once).
absl::StatusOr<int> FreePort() {
  const int s = socket(AF_INET, SOCK_STREAM, 0);
  if (s < 0) return absl::InternalError("socket");
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  const bool ok = bind(s, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
                  getsockname(s, reinterpret_cast<sockaddr*>(&a), &len) == 0;
  close(s);
  if (!ok) return absl::InternalError("no free loopback port");
  return ntohs(a.sin_port);
}

// Whether something listens on IPv4 `port` (/proc/net/tcp: state 0A).
bool Listening(int port) {
  std::ifstream in("/proc/net/tcp");
  const std::string suffix = absl::StrCat(":", absl::Hex(port, absl::kZeroPad4));
  std::string line;
  std::getline(in, line);  // the header
  while (std::getline(in, line)) {
    std::vector<std::string> f = absl::StrSplit(line, ' ', absl::SkipEmpty());
    if (f.size() > 3 && f[3] == "0A" && absl::EndsWithIgnoreCase(f[1], suffix)) return true;
  }
  return false;
}

// Bytes a second from fi_rma_bw's result line: "bytes iters total time MB/sec usec/xfer
// Mxfers/sec", the time with an "s".
absl::StatusOr<double> Rate(const std::string& out) {
  for (absl::string_view line : absl::StrSplit(out, '\n')) {
    std::vector<absl::string_view> f = absl::StrSplit(line, ' ', absl::SkipEmpty());
    double mbps = 0;
    if (f.size() == 7 && absl::EndsWith(f[3], "s") && absl::SimpleAtod(f[4], &mbps)) {
      return mbps * 1e6;
    }
  }
  return absl::InternalError(absl::StrCat("fi_rma_bw printed no result: ", out));
}

}  // namespace

absl::StatusOr<double> RunRmaBw(const std::string& bin, const std::string& provider, uint64_t piece,
                                uint64_t total, size_t pairs) {
  const std::string prov = provider == "tcp" ? "tcp;ofi_rxm" : provider;
  if (prov != "tcp;ofi_rxm") return absl::InvalidArgumentError("fi_rma_bw baseline: tcp only");
  const uint64_t iters = std::max<uint64_t>(2, total / pairs / piece);
  const std::vector<std::string> common = {bin,
                                           "-p",
                                           prov,
                                           "-e",
                                           "rdm",
                                           "-o",
                                           "writedata",
                                           "-S",
                                           std::to_string(piece),
                                           "-I",
                                           std::to_string(iters)};
  std::vector<std::unique_ptr<testing::Subprocess>> servers;
  std::vector<int> ports;
  for (size_t i = 0; i < pairs; ++i) {
    ASSIGN_OR_RETURN(int port, FreePort());
    std::vector<std::string> argv = common;
    argv.insert(argv.end(), {"-s", "127.0.0.1", "-B", std::to_string(port)});
    ASSIGN_OR_RETURN(auto server, testing::Subprocess::Spawn(argv, SIGKILL));
    servers.push_back(std::move(server));
    ports.push_back(port);
  }
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  for (int port : ports) {
    while (!Listening(port)) {
      if (absl::Now() > deadline) return absl::DeadlineExceededError("fi_rma_bw did not listen");
      absl::SleepFor(absl::Milliseconds(5));
    }
  }
  std::vector<absl::StatusOr<std::string>> outs(pairs, absl::UnknownError("not run"));
  std::vector<std::thread> clients;
  for (size_t i = 0; i < pairs; ++i) {
    clients.emplace_back([&, i] {
      std::vector<std::string> argv = common;
      argv.insert(argv.end(), {"-s", "127.0.0.1", "-P", std::to_string(ports[i]), "127.0.0.1"});
      outs[i] = testing::RunCommand(argv, absl::Seconds(120));
    });
  }
  for (auto& t : clients) t.join();
  double rate = 0;
  for (const auto& out : outs) {
    if (!out.ok()) return out.status();
    ASSIGN_OR_RETURN(double r, Rate(*out));
    rate += r;
  }
  return static_cast<double>(total) / rate;
}

}  // namespace ferry::bench
