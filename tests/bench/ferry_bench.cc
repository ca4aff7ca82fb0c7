// ferry-bench: benchmarks that print a table for people and, with --json, one JSON object
// per row. Each run measures a baseline on the same bytes and reports the ratio.
//
//   ferry-bench engine [--provider tcp] [--rails 1,2,4,8] [--piece 4096,...] [--total BYTES]
//                      [--layout contiguous,scattered] [--iters N] [--json] [--verify]
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "engine/engine.h"
#include "engine/fabric.h"
#include "engine/status.h"
#include "nlohmann/json.hpp"
#include "spdlog/spdlog.h"
#include "tests/bench/raw_fabric.h"
#include "tests/testing/engine_peer.h"
#include "tests/testing/pattern.h"
#include "tests/testing/subprocess.h"

namespace ferry::bench {
namespace {

constexpr uint64_t kSeed = 0xbe7c;

struct EngineFlags {
  std::string provider = "tcp";
  std::string domain;
  std::vector<uint64_t> rails = {1, 2, 4, 8};
  std::vector<uint64_t> pieces = {4096, 65536, 1 << 20, 4 << 20, 64 << 20};
  uint64_t total = 256 << 20;
  std::vector<std::string> layouts = {"contiguous", "scattered"};
  int iters = 5;
  size_t threads = 1;
  size_t window = 64;
  bool json = false;
  bool verify = false;
};

std::string DefaultDomain(const std::string& provider) {
  return provider == "shm" ? "shm" : provider == "tcp" ? "lo" : "";
}

// The WRITEs of one configuration: `total` bytes in pieces of `piece`, the source contiguous,
// the destination contiguous or scattered (each piece in a random slot, slots 2 pieces apart
// so no two pieces merge).
std::vector<engine::PlannedWrite> Layout(const std::string& layout, uint64_t piece,
                                         uint64_t total) {
  std::vector<engine::PlannedWrite> writes;
  const uint64_t count = total / piece;
  std::mt19937_64 rng(piece);
  std::vector<engine::Extent> dst =
      layout == "scattered" ? testing::ScatteredLayout(rng, count, piece, 2 * piece)
                            : std::vector<engine::Extent>{};
  for (uint64_t i = 0; i < count; ++i) {
    writes.push_back({0, i * piece, 0, layout == "scattered" ? dst[i].offset : i * piece, piece});
  }
  return writes;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

absl::StatusOr<nlohmann::json> SpawnHello(std::unique_ptr<testing::Subprocess>* child,
                                          const std::vector<std::string>& argv) {
  ASSIGN_OR_RETURN(*child, testing::Subprocess::Spawn(argv));
  ASSIGN_OR_RETURN(std::string line, (*child)->ReadLine(absl::Seconds(30)));
  auto j = nlohmann::json::parse(line, nullptr, false);
  if (j.is_discarded() || j.contains("error")) return absl::InternalError("peer: " + line);
  return j;
}

// Seconds per iteration (median) of the raw fi_write loop.
absl::StatusOr<double> RunRaw(const EngineFlags& f, const std::string& self,
                              const std::vector<engine::PlannedWrite>& writes, uint64_t dst_size,
                              char* src) {
  std::unique_ptr<testing::Subprocess> peer;
  ASSIGN_OR_RETURN(nlohmann::json hello,
                   SpawnHello(&peer, {self, "raw-peer", "--provider", f.provider, "--domain",
                                      f.domain, "--size", std::to_string(dst_size)}));
  ASSIGN_OR_RETURN(auto ep, RawEndpoint::Open(f.provider, f.domain));
  RETURN_IF_ERROR(ep->Register(src, f.total));
  ASSIGN_OR_RETURN(std::string addr, engine::HexDecode(hello["address"].get<std::string>()));
  ASSIGN_OR_RETURN(uint64_t fa, ep->Insert(addr));
  const uint64_t base = hello["base"].get<uint64_t>(), key = hello["key"].get<uint64_t>();
  RETURN_IF_ERROR(ep->WriteAll(fa, base, key, writes, f.window));  // warm-up
  std::vector<double> times;
  for (int i = 0; i < f.iters; ++i) {
    const absl::Time start = absl::Now();
    RETURN_IF_ERROR(ep->WriteAll(fa, base, key, writes, f.window));
    times.push_back(absl::ToDoubleSeconds(absl::Now() - start));
  }
  IgnoreError(peer->WriteLine("exit"));
  peer->Wait();
  return Median(times);
}

struct EngineRun {
  double seconds = 0;
  std::vector<uint64_t> bytes_per_rail;
};

absl::StatusOr<EngineRun> RunEngine(const EngineFlags& f, testing::Subprocess& peer,
                                    const nlohmann::json& hello, size_t rails, uint64_t piece,
                                    const std::vector<engine::PlannedWrite>& writes, char* src) {
  engine::EngineOptions o;
  o.provider = f.provider;
  if (!f.domain.empty()) o.domains = {f.domain};
  o.rails = rails;
  o.progress_threads = f.threads;
  o.max_write = piece;
  ASSIGN_OR_RETURN(auto eng, engine::Engine::Create(o));
  ASSIGN_OR_RETURN(engine::RegionId region,
                   eng->RegisterMemory(src, f.total, engine::Device::Host()));
  ASSIGN_OR_RETURN(engine::PeerAddress address, testing::AddressFromJson(hello["address"]));
  ASSIGN_OR_RETURN(engine::PeerId peer_id, eng->AddPeer(address, absl::Now() + absl::Seconds(30)));
  ASSIGN_OR_RETURN(engine::RegionDescriptor dst, engine::RegionDescriptorFromJson(hello["region"]));
  engine::TransferRequest req;
  req.peer = peer_id;
  req.dst_regions = {dst};
  for (const engine::PlannedWrite& w : writes) {
    req.src.push_back({region, w.src_offset, w.length});
    req.dst.push_back({0, w.dst_offset, w.length});
  }
  auto run = [&]() -> absl::StatusOr<engine::TransferStats> {
    engine::TransferRequest r = req;
    r.deadline = absl::Now() + absl::Seconds(300);
    return eng->Write(std::move(r));
  };
  RETURN_IF_ERROR(run().status());  // warm-up
  EngineRun out;
  std::vector<double> times;
  for (int i = 0; i < f.iters; ++i) {
    const absl::Time start = absl::Now();
    ASSIGN_OR_RETURN(engine::TransferStats stats, run());
    times.push_back(absl::ToDoubleSeconds(absl::Now() - start));
    out.bytes_per_rail = stats.bytes_per_rail;
  }
  out.seconds = Median(times);
  if (f.verify) {
    ASSIGN_OR_RETURN(auto reply, peer.Call({{"cmd", "verify"},
                                            {"seed", kSeed},
                                            {"src", testing::ExtentsToJson(req.src)},
                                            {"dst", testing::ExtentsToJson(req.dst)}}));
    if (!reply["ok"].get<bool>()) {
      return absl::DataLossError("verify: " + reply["error"].get<std::string>());
    }
  }
  IgnoreError(eng->DeregisterMemory(region));
  return out;
}

int RunEngineBench(const EngineFlags& flags_in, const std::string& self) {
  EngineFlags f = flags_in;
  if (f.domain.empty()) f.domain = DefaultDomain(f.provider);
  char* src = static_cast<char*>(std::aligned_alloc(4096, f.total));
  testing::FillPattern(kSeed, 0, reinterpret_cast<uint8_t*>(src), f.total);
  const uint64_t dst_size = 2 * f.total;

  struct Row {
    std::string layout;
    uint64_t piece;
    size_t rails;
    double seconds, raw_seconds;
    std::vector<uint64_t> bytes_per_rail;
  };
  std::vector<Row> rows;
  // Raw baselines first, one per (layout, piece).
  std::map<std::pair<std::string, uint64_t>, double> raw;
  for (const std::string& layout : f.layouts) {
    for (uint64_t piece : f.pieces) {
      if (piece > f.total) continue;
      auto writes = Layout(layout, piece, f.total);
      auto t = RunRaw(f, self, writes, dst_size, src);
      if (!t.ok()) {
        std::cerr << "raw baseline: " << t.status() << "\n";
        return 1;
      }
      raw[{layout, piece}] = *t;
    }
  }
  if (!f.json) {
    std::printf("# ferry-bench engine: provider %s, domain %s, %d iterations (median), "
                "raw baseline = one endpoint, fi_write loop, window %zu\n",
                f.provider.c_str(), f.domain.c_str(), f.iters, f.window);
    std::printf("%-10s %5s %9s %5s %11s %9s %9s %10s %10s %9s %6s\n", "layout", "rails",
                "bytes", "iters", "total", "time", "MB/sec", "usec/xfer", "Mxfers/sec",
                "raw MB/s", "ratio");
  }
  for (uint64_t rails : f.rails) {
    std::unique_ptr<testing::Subprocess> peer;
    auto hello = SpawnHello(&peer, {self, "engine-peer", "--provider", f.provider, "--domain",
                                    f.domain, "--rails", std::to_string(rails), "--size",
                                    std::to_string(dst_size), "--progress-threads",
                                    std::to_string(f.threads)});
    if (!hello.ok()) {
      std::cerr << hello.status() << "\n";
      return 1;
    }
    for (const std::string& layout : f.layouts) {
      for (uint64_t piece : f.pieces) {
        if (piece > f.total) continue;
        auto writes = Layout(layout, piece, f.total);
        auto run = RunEngine(f, *peer, *hello, rails, piece, writes, src);
        if (!run.ok()) {
          std::cerr << "engine " << layout << " " << piece << " x" << rails << ": "
                    << run.status() << "\n";
          return 1;
        }
        Row row{layout, piece, rails, run->seconds, raw[{layout, piece}], run->bytes_per_rail};
        const double xfers = static_cast<double>(writes.size());
        const double bytes = static_cast<double>(writes.size() * piece);
        const double mbps = bytes / row.seconds / 1e6, raw_mbps = bytes / row.raw_seconds / 1e6;
        if (f.json) {
          std::cout << nlohmann::json{{"bench", "engine"},
                                      {"provider", f.provider},
                                      {"layout", layout},
                                      {"rails", rails},
                                      {"bytes", piece},
                                      {"iters", f.iters},
                                      {"total", bytes},
                                      {"seconds", row.seconds},
                                      {"mb_per_sec", mbps},
                                      {"usec_per_xfer", row.seconds * 1e6 / xfers},
                                      {"raw_mb_per_sec", raw_mbps},
                                      {"ratio", mbps / raw_mbps},
                                      {"bytes_per_rail", row.bytes_per_rail}}
                           .dump()
                    << std::endl;
        } else {
          std::printf("%-10s %5zu %9lu %5d %11.0f %9.4f %9.1f %10.2f %10.4f %9.1f %6.2f\n",
                      layout.c_str(), static_cast<size_t>(rails), static_cast<unsigned long>(piece),
                      f.iters, bytes, row.seconds, mbps, row.seconds * 1e6 / xfers,
                      xfers / row.seconds / 1e6, raw_mbps, mbps / raw_mbps);
          std::fflush(stdout);
        }
        rows.push_back(row);
      }
    }
    IgnoreError(peer->WriteLine(R"({"cmd":"exit"})"));
    peer->Wait();
  }
  // The targets: >= 1.0x raw for pieces of 64 KiB and up; 64 KiB scattered >= 90% of 4 MiB
  // contiguous (same rails).
  if (!f.json) {
    for (uint64_t rails : f.rails) {
      double s64 = 0, c4m = 0;
      for (const Row& r : rows) {
        if (r.rails != rails) continue;
        if (r.layout == "scattered" && r.piece == 65536) s64 = r.seconds;
        if (r.layout == "contiguous" && r.piece == (4 << 20)) c4m = r.seconds;
      }
      if (s64 > 0 && c4m > 0) {
        std::printf("# rails %lu: 64 KiB scattered = %.1f%% of 4 MiB contiguous\n",
                    static_cast<unsigned long>(rails), 100.0 * c4m / s64);
      }
    }
  }
  std::free(src);
  return 0;
}

}  // namespace
}  // namespace ferry::bench

int main(int argc, char** argv) {
  // Children of this program speak JSON lines on stdout; every log line goes to stderr.
  spdlog::set_level(spdlog::level::warn);
  if (argc > 1 && std::string(argv[1]) == "engine-peer") {
    return ferry::testing::RunEnginePeer(argc - 1, argv + 1);
  }
  CLI::App app{"ferry benchmarks"};
  app.require_subcommand(1);
  ferry::bench::EngineFlags ef;
  CLI::App* eng = app.add_subcommand("engine", "engine WRITEs vs a raw libfabric fi_write loop");
  eng->add_option("--provider", ef.provider, "tcp, shm, efa, verbs");
  eng->add_option("--domain", ef.domain, "libfabric domain (default: lo for tcp)");
  eng->add_option("--rails", ef.rails, "rail counts, comma-separated")->delimiter(',');
  eng->add_option("--piece", ef.pieces, "piece sizes in bytes, comma-separated")->delimiter(',');
  eng->add_option("--total", ef.total, "bytes per transfer");
  eng->add_option("--layout", ef.layouts, "contiguous and/or scattered")->delimiter(',');
  eng->add_option("--iters", ef.iters, "timed iterations (median reported)");
  eng->add_option("--threads", ef.threads, "progress threads per engine");
  eng->add_option("--window", ef.window, "raw baseline: WRITEs in flight");
  eng->add_flag("--json", ef.json, "one JSON object per row");
  eng->add_flag("--verify", ef.verify, "check every byte after each configuration");
  std::string raw_provider = "tcp", raw_domain = "lo";
  uint64_t raw_size = 0;
  CLI::App* raw = app.add_subcommand("raw-peer", "(internal) target of the raw baseline");
  raw->add_option("--provider", raw_provider);
  raw->add_option("--domain", raw_domain);
  raw->add_option("--size", raw_size);
  CLI11_PARSE(app, argc, argv);
  if (*raw) return ferry::bench::RunRawPeer(raw_provider, raw_domain, raw_size);
  if (ef.iters < 1 || ef.total == 0) {
    std::cerr << "--iters and --total must be positive\n";
    return 2;
  }
  for (const std::string& l : ef.layouts) {
    if (l != "contiguous" && l != "scattered") {
      std::cerr << "--layout: unknown layout '" << l << "'\n";
      return 2;
    }
  }
  char self[4096];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n <= 0) {
    std::cerr << "cannot find this program's path\n";
    return 1;
  }
  return ferry::bench::RunEngineBench(ef, std::string(self, static_cast<size_t>(n)));
}
