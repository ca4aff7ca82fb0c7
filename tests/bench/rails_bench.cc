// ferry-bench rails: two ferryd in network namespaces joined by N tbf-shaped veth rails; a
// scattered object pulled from A into B, timed from the pull request to its answer, next to
// iperf3 over the same rails in the same run.
#include "tests/bench/rails_bench.h"

#include <httplib.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <numeric>
#include <random>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "nlohmann/json.hpp"
#include "server/node.h"
#include "tests/bench/node_bench.h"
#include "tests/testing/ferryd_process.h"
#include "tests/testing/netns.h"
#include "tests/testing/subprocess.h"
#include "wire/extents.h"

namespace ferry::bench {
namespace {

using json = nlohmann::json;
using testing::CpuSeconds;
using testing::TestBed;

// `size` bytes of `region` as pieces of `piece` bytes in a shuffled order.
std::vector<Extent> Scattered(uint64_t region, uint64_t size, uint64_t piece, uint32_t seed) {
  std::vector<uint64_t> order(size / piece);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), std::mt19937(seed));
  std::vector<Extent> extents;
  for (uint64_t i : order) extents.push_back({region, i * piece, piece});
  return extents;
}

// Sum of what N concurrent iperf3 streams (A -> B, one per rail) delivered, bits/s.
absl::StatusOr<double> Iperf(const TestBed& bed, int seconds) {
  const size_t n = bed.options().rails;
  std::vector<std::unique_ptr<testing::Subprocess>> servers;
  for (size_t i = 0; i < n; ++i) {
    std::vector<std::string> argv = bed.Exec(TestBed::kB);
    for (std::string a :
         {std::string("iperf3"), std::string("-s"), std::string("-1"), std::string("-B"),
          bed.RailAddress(TestBed::kB, i), std::string("-p"), std::to_string(5201 + i)}) {
      argv.push_back(a);
    }
    auto s = testing::Subprocess::Spawn(argv, SIGTERM);
    if (!s.ok()) return s.status();
    servers.push_back(std::move(*s));
  }
  absl::SleepFor(absl::Milliseconds(500));  // the servers listen
  std::vector<absl::StatusOr<std::string>> out(n, absl::UnknownError("not run"));
  std::vector<std::thread> clients;
  for (size_t i = 0; i < n; ++i) {
    clients.emplace_back([&, i] {
      std::vector<std::string> argv = bed.Exec(TestBed::kA);
      for (std::string a : {std::string("iperf3"), std::string("-J"), std::string("-c"),
                            bed.RailAddress(TestBed::kB, i), std::string("-B"),
                            bed.RailAddress(TestBed::kA, i), std::string("-p"),
                            std::to_string(5201 + i), std::string("-t"), std::to_string(seconds)}) {
        argv.push_back(a);
      }
      out[i] = testing::RunCommand(argv, absl::Seconds(seconds + 30));
    });
  }
  for (std::thread& t : clients) t.join();
  double bps = 0;
  for (auto& o : out) {
    if (!o.ok()) return o.status();
    auto j = json::parse(*o, nullptr, false);
    if (j.is_discarded() || !j.contains("end")) return absl::InternalError("iperf3 said: " + *o);
    bps += j["end"]["sum_received"]["bits_per_second"].get<double>();
  }
  return bps;
}

struct Config {
  size_t rails = 0;
  uint64_t mbit = 0;
};

absl::StatusOr<Config> ParseConfig(const std::string& s) {
  Config c;
  const size_t x = s.find('x');
  if (x == std::string::npos || !absl::SimpleAtoi(s.substr(0, x), &c.rails) ||
      !absl::SimpleAtoi(s.substr(x + 1), &c.mbit) || c.rails == 0 || c.mbit == 0) {
    return absl::InvalidArgumentError("--configs: want NxMBIT, e.g. 8x500, not '" + s + "'");
  }
  return c;
}

absl::Status RunConfig(const RailsFlags& f, const Config& c, const std::filesystem::path& dir) {
  auto bed = TestBed::Create({.rails = c.rails, .rate_mbit = c.mbit});
  if (!bed.ok()) return bed.status();
  auto iperf = Iperf(**bed, f.iperf_seconds);
  if (!iperf.ok()) return iperf.status();
  const double line_bps = static_cast<double>(c.rails) * static_cast<double>(c.mbit) * 1e6;

  std::vector<std::string> args = {"--provider", "tcp", "--rails", "0"};
  args.insert(args.end(), f.ferryd_args.begin(), f.ferryd_args.end());
  testing::FerrydProcess nodes[2];
  for (TestBed::Side side : {TestBed::kA, TestBed::kB}) {
    std::vector<std::string> a = args;
    a.push_back("--data-dir");
    a.push_back((dir / (side == TestBed::kA ? "a" : "b")).string());
    for (size_t i = 0; i < c.rails; ++i) {
      a.push_back("--domain");
      a.push_back((*bed)->RailInterface(side, i));
    }
    auto p = testing::StartFerrydIn((*bed)->Exec(side), (*bed)->HostAddress(side), f.ferryd, a);
    if (!p.ok()) return p.status();
    nodes[side] = std::move(*p);
  }
  httplib::Client ca(nodes[0].url), cb(nodes[1].url);
  ca.set_read_timeout(600);
  cb.set_read_timeout(600);
  const std::string a_peer_url = absl::StrCat("http://", (*bed)->PeerAddress(TestBed::kA),
                                              nodes[0].url.substr(nodes[0].url.rfind(':')));
  auto src = NewRegion(ca, f.size);
  auto dst = NewRegion(cb, f.size);
  if (!src.ok()) return src.status();
  if (!dst.ok()) return dst.status();

  // Big layouts go as raw extents after the JSON, as a client with KV-cache pages sends them.
  // The body is built before the clock starts: timed is the request, not composing it.
  auto pull_body = [&](const std::string& name, const std::vector<Extent>& into) {
    const json head = {{"from", a_peer_url}, {"object", name}, {"into", json::object()}};
    return head.dump() + "\n" + RawExtents(into);
  };
  auto pull = [&](const std::string& body) -> absl::StatusOr<json> {
    auto r = cb.Post("/v1/pulls", body, kExtentsContentType);
    if (!r || r->status != 200) {
      return absl::UnavailableError("pull: " + (r ? r->body : std::string("no answer")));
    }
    return json::parse(r->body);
  };
  // Not measured: first contact (peer insertion, every rail pair warmed) and the first pull
  // of a big layout (both nodes' allocators growing to hold its plan): one pull of as many
  // 4 KiB pieces as the largest layout below has.
  {
    const uint64_t most = f.size / *std::min_element(f.pieces.begin(), f.pieces.end());
    json warm = json::array();
    for (const auto& e : Scattered(*src, most * 4096, 4096, 3)) {
      warm.push_back(json::array({e.region, e.offset, e.length}));
    }
    ca.Put("/v1/objects/warm", json{{"extents", warm}}.dump(), "application/json");
    if (auto w = pull(pull_body("warm", Scattered(*dst, most * 4096, 4096, 4))); !w.ok()) {
      return w.status();
    }
  }

  for (uint64_t piece : f.pieces) {
    const std::string name = absl::StrCat("scattered-", piece);
    json layout = json::array();
    for (const auto& e : Scattered(*src, f.size, piece, 1)) {
      layout.push_back(json::array({e.region, e.offset, e.length}));
    }
    auto put = ca.Put(("/v1/objects/" + name).c_str(), json{{"extents", layout}}.dump(),
                      "application/json");
    if (!put || put->status / 100 != 2) return absl::UnavailableError("publish failed");
    const std::string body = pull_body(name, Scattered(*dst, f.size, piece, 2));
    // `repeat` timed pulls of the same layout; the row gives the median run (and its stats)
    // and the worst.
    struct Run {
      double secs, cpu_src, cpu_dst;
      json stats;
    };
    std::vector<Run> runs;
    const double gb = static_cast<double>(f.size) / 1e9;
    for (int r = 0; r < f.repeat; ++r) {
      const double cpu_a = CpuSeconds(nodes[0].proc->pid());
      const double cpu_b = CpuSeconds(nodes[1].proc->pid());
      const absl::Time t = absl::Now();
      auto stats = pull(body);
      const double secs = absl::ToDoubleSeconds(absl::Now() - t);
      if (!stats.ok()) return stats.status();
      runs.push_back({secs, (CpuSeconds(nodes[0].proc->pid()) - cpu_a) / gb,
                      (CpuSeconds(nodes[1].proc->pid()) - cpu_b) / gb, *std::move(stats)});
    }
    std::sort(runs.begin(), runs.end(), [](const Run& x, const Run& y) { return x.secs < y.secs; });
    const Run& median = runs[runs.size() / 2];
    const Run& worst = runs.back();
    const double secs = median.secs;
    auto cpu_median = [&](double Run::*field) {
      std::vector<double> v;
      for (const Run& r : runs) v.push_back(r.*field);
      std::sort(v.begin(), v.end());
      return v[v.size() / 2];
    };
    const double cpu_src = cpu_median(&Run::cpu_src), cpu_dst = cpu_median(&Run::cpu_dst);
    const json& stats = median.stats;
    const auto per_rail = stats["bytes_per_rail"].get<std::vector<uint64_t>>();
    const auto [lo, hi] = std::minmax_element(per_rail.begin(), per_rail.end());
    // When the first and the last rail finished, seconds after the source began.
    const auto rail_secs = stats["rail_seconds"].get<std::vector<double>>();
    const auto [first, last] = std::minmax_element(rail_secs.begin(), rail_secs.end());
    const double eff = static_cast<double>(f.size) * 8 / secs / line_bps;
    const double worst_eff = static_cast<double>(f.size) * 8 / worst.secs / line_bps;
    const double ceiling = *iperf / line_bps;
    if (f.json) {
      std::cout << json{{"bench", "rails"},
                        {"rails", c.rails},
                        {"mbit_per_rail", c.mbit},
                        {"piece", piece},
                        {"bytes", f.size},
                        {"repeat", f.repeat},
                        {"seconds", secs},
                        {"seconds_worst", worst.secs},
                        {"source_seconds", stats["seconds"]},
                        {"goodput_mbit", static_cast<double>(f.size) * 8 / secs / 1e6},
                        {"efficiency", eff},
                        {"efficiency_worst", worst_eff},
                        {"iperf3_efficiency", ceiling},
                        {"ratio_to_iperf3", eff / ceiling},
                        {"bytes_per_rail", per_rail},
                        {"rail_seconds", rail_secs},
                        {"cpu_s_per_gb_source", cpu_src},
                        {"cpu_s_per_gb_destination", cpu_dst},
                        {"cpu_s_per_gb_destination_worst", worst.cpu_dst}}
                       .dump()
                << std::endl;
    } else {
      std::printf(
          "%5zu %6llu %8llu %8.3f %9.1f %7.2f%% %7.2f%% %7.2f%% %6.3f %11.4f %6.3f-%-6.3f %9.2f "
          "%9.2f\n",
          c.rails, static_cast<unsigned long long>(c.mbit), static_cast<unsigned long long>(piece),
          secs, static_cast<double>(f.size) * 8 / secs / 1e6, 100 * eff, 100 * worst_eff,
          100 * ceiling, eff / ceiling, static_cast<double>(*lo) / static_cast<double>(*hi),
          rail_secs.empty() ? 0.0 : *first, rail_secs.empty() ? 0.0 : *last, cpu_src, cpu_dst);
      std::fflush(stdout);
    }
    if (f.cut_source_rail && c.rails > 1) {
      absl::StatusOr<json> cut = absl::UnknownError("not run");
      uint64_t base = 0;
      for (size_t i = 0; i < c.rails; ++i) base += (*bed)->TxBytes(TestBed::kA, i).value_or(0);
      const absl::Time start = absl::Now();
      std::thread puller([&] { cut = pull(body); });
      // Down once the source's rails have sent half the object; a bounded wait.
      for (const absl::Time give_up = absl::Now() + absl::Seconds(120); absl::Now() < give_up;) {
        uint64_t sent = 0;
        for (size_t i = 0; i < c.rails; ++i) sent += (*bed)->TxBytes(TestBed::kA, i).value_or(0);
        if (sent >= base + f.size / 2) break;
        absl::SleepFor(absl::Milliseconds(2));
      }
      absl::Status down = (*bed)->SetRailEnd(TestBed::kA, 0, false);
      puller.join();
      const double cut_secs = absl::ToDoubleSeconds(absl::Now() - start);
      absl::Status up = (*bed)->SetRailEnd(TestBed::kA, 0, true);
      if (!down.ok() || !up.ok()) return down.ok() ? up : down;
      if (!cut.ok()) return cut.status();
      const json row = {{"bench", "rails_failover"},
                        {"rails", c.rails},
                        {"mbit_per_rail", c.mbit},
                        {"piece", piece},
                        {"bytes", f.size},
                        {"seconds", secs},
                        {"seconds_rail_cut", cut_secs},
                        {"ratio", secs / cut_secs},
                        {"failed_rails", (*cut)["failed_rails"]},
                        {"rerouted_writes", (*cut)["rerouted_writes"]}};
      if (f.json) {
        std::cout << row.dump() << std::endl;
      } else {
        std::printf(
            "  failover: source rail 0 down at half: %.3f s against %.3f s (%.2fx); "
            "failed_rails %s, %s WRITEs rerouted\n",
            cut_secs, secs, secs / cut_secs, (*cut)["failed_rails"].dump().c_str(),
            (*cut)["rerouted_writes"].dump().c_str());
        std::fflush(stdout);
      }
    }
    ca.Delete(("/v1/objects/" + name).c_str());
  }
  return absl::OkStatus();
}

}  // namespace

int RunRailsBench(const RailsFlags& f) {
  std::vector<Config> configs;
  for (const std::string& s : f.configs) {
    auto c = ParseConfig(s);
    if (!c.ok()) {
      std::cerr << c.status().message() << "\n";
      return 2;
    }
    configs.push_back(*c);
  }
  if (!f.json) {
    std::printf(
        "# ferry-bench rails: %llu-byte scattered object pulled A -> B over N veth rails "
        "(MTU 9000, tbf each way), tcp provider; iperf3: N streams, %d s; each row the median "
        "of %d pulls (CPU too), worst = the slowest pull's efficiency\n",
        static_cast<unsigned long long>(f.size), f.iperf_seconds, f.repeat);
    std::printf("%5s %6s %8s %8s %9s %8s %8s %8s %6s %11s %13s %9s %9s\n", "rails", "Mbit", "piece",
                "seconds", "Mbit/s", "effic.", "worst", "iperf3", "ratio", "min/max rail",
                "rails done s", "cpu s/GB A", "cpu s/GB B");
  }
  const auto dir =
      std::filesystem::temp_directory_path() / ("ferry-bench-rails-" + std::to_string(getpid()));
  for (const Config& c : configs) {
    std::filesystem::remove_all(dir);
    absl::Status s = RunConfig(f, c, dir);
    std::filesystem::remove_all(dir);
    if (!s.ok()) {
      std::cerr << c.rails << " rails: " << s << "\n";
      return 1;
    }
  }
  return 0;
}

}  // namespace ferry::bench
