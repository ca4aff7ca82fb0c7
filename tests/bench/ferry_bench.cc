// ferry-bench: benchmarks that print a table for people and, with --json, one JSON object
// per row. Each run measures a baseline on the same bytes and reports the ratio.
//
//   ferry-bench engine [--provider tcp] [--rails 1,2,4,8] [--piece 4096,...] [--total BYTES]
//                      [--layout contiguous,scattered] [--iters N] [--json] [--verify]
#include <signal.h>
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
#include "absl/functional/function_ref.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/hex.h"
#include "base/status.h"
#include "engine/engine.h"
#include "engine/fabric.h"
#include "nlohmann/json.hpp"
#include "spdlog/spdlog.h"
#include "tests/bench/cluster_bench.h"
#include "tests/bench/gpu_bench.h"
#include "tests/bench/node_bench.h"
#include "tests/bench/rails_bench.h"
#include "tests/bench/raw_fabric.h"
#include "tests/bench/rma_bw.h"
#include "tests/bench/stats.h"
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
  int iters = 15;
  size_t threads = 0;  // 0: the engine's default (AutoProgressThreads)
  size_t window = 64;
  size_t depth = 0;
  uint64_t inflight = 0;
  uint64_t max_write = 0;
  size_t max_iov = 0;
  bool wait_fds = engine::EngineOptions().wait_fds;
  bool spin_while_awake = engine::EngineOptions().spin_while_awake;  // the destination's
  bool json = false;
  bool verify = false;
  bool counters = true;        // the engine's rail counters (EngineOptions::counters)
  bool counters_cost = false;  // also measure the engine with them against without
  std::string peer_bin;        // fabtests' fi_rma_bw: a second baseline, run in turns too
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
  std::vector<Extent> dst = layout == "scattered"
                                ? testing::ScatteredLayout(rng, count, piece, 2 * piece)
                                : std::vector<Extent>{};
  for (uint64_t i = 0; i < count; ++i) {
    writes.push_back({0, i * piece, 0, layout == "scattered" ? dst[i].offset : i * piece, piece});
  }
  return writes;
}

struct Spread {
  double p25 = 0, median = 0, p75 = 0;
};

absl::StatusOr<nlohmann::json> SpawnHello(std::unique_ptr<testing::Subprocess>* child,
                                          const std::vector<std::string>& argv) {
  ASSIGN_OR_RETURN(*child, testing::Subprocess::Spawn(argv));
  ASSIGN_OR_RETURN(std::string line, (*child)->ReadLine(absl::Seconds(30)));
  auto j = nlohmann::json::parse(line, nullptr, false);
  if (j.is_discarded() || j.contains("error")) return absl::InternalError("peer: " + line);
  return j;
}

// The raw baseline's two ends: a target process and a local endpoint.
class RawSession {
 public:
  static absl::StatusOr<std::unique_ptr<RawSession>> Start(const EngineFlags& f,
                                                           const std::string& self,
                                                           uint64_t dst_size, char* src) {
    std::unique_ptr<RawSession> s(new RawSession());
    ASSIGN_OR_RETURN(nlohmann::json hello,
                     SpawnHello(&s->peer_, {self, "raw-peer", "--provider", f.provider, "--domain",
                                            f.domain, "--size", std::to_string(dst_size)}));
    // The raw target, spawned above, runs libfabric's own provider parameters. This process
    // hosts the engine's source end too, and libfabric reads them once: set ferry's now.
    engine::SetProviderDefaults();
    ASSIGN_OR_RETURN(s->ep_, RawEndpoint::Open(f.provider, f.domain));
    RETURN_IF_ERROR(s->ep_->Register(src, f.total));
    ASSIGN_OR_RETURN(std::string addr, HexDecode(hello["address"].get<std::string>()));
    ASSIGN_OR_RETURN(s->fi_addr_, s->ep_->Insert(addr));
    s->base_ = hello["base"].get<uint64_t>();
    s->key_ = hello["key"].get<uint64_t>();
    s->window_ = f.window;
    return s;
  }
  ~RawSession() {
    IgnoreError(peer_->WriteLine("exit"));
    peer_->Wait();
  }
  // Seconds for one pass over `writes`; the target spins only during it.
  absl::StatusOr<double> Run(const std::vector<engine::PlannedWrite>& writes) {
    RETURN_IF_ERROR(Say("run"));
    const absl::Time start = absl::Now();
    absl::Status s = ep_->WriteAll(fi_addr_, base_, key_, writes, window_);
    const double secs = absl::ToDoubleSeconds(absl::Now() - start);
    RETURN_IF_ERROR(Say("pause"));
    RETURN_IF_ERROR(s);
    return secs;
  }

 private:
  RawSession() = default;
  absl::Status Say(const std::string& word) {
    RETURN_IF_ERROR(peer_->WriteLine(word));
    return peer_->ReadLine(absl::Seconds(30)).status();
  }
  std::unique_ptr<testing::Subprocess> peer_;
  std::unique_ptr<RawEndpoint> ep_;
  uint64_t fi_addr_ = 0, base_ = 0, key_ = 0;
  size_t window_ = 64;
};

// A local engine with `rails` rails and the transfer of `writes` to the engine peer.
class EngineSession {
 public:
  static absl::StatusOr<std::unique_ptr<EngineSession>> Start(
      const EngineFlags& f, const nlohmann::json& hello, size_t rails,
      const std::vector<std::vector<engine::PlannedWrite>>& transfers, char* src) {
    std::unique_ptr<EngineSession> s(new EngineSession());
    engine::EngineOptions o;
    o.provider = f.provider;
    if (!f.domain.empty()) o.domains = {f.domain};
    o.rails = rails;
    o.progress_threads = f.threads;
    // The engine cuts pieces into WRITEs of at most max_write (its default unless the flag
    // names one), as it does for every user; the raw loop posts one WRITE per piece.
    if (f.max_write != 0) o.max_write = f.max_write;
    o.tx_depth = f.depth;
    if (f.inflight != 0) o.max_inflight_bytes = f.inflight;
    if (f.max_iov != 0) o.max_iov = f.max_iov;
    o.wait_fds = f.wait_fds;
    o.counters = f.counters;
    ASSIGN_OR_RETURN(s->engine_, engine::Engine::Create(o));
    ASSIGN_OR_RETURN(s->region_, s->engine_->RegisterMemory(src, f.total, Device::Host()));
    ASSIGN_OR_RETURN(PeerAddress address, testing::AddressFromJson(hello["address"]));
    ASSIGN_OR_RETURN(engine::PeerId peer,
                     s->engine_->AddPeer(address, absl::Now() + absl::Seconds(30)));
    ASSIGN_OR_RETURN(RegionDescriptor dst, RegionDescriptorFromJson(hello["region"]));
    for (const auto& writes : transfers) {
      engine::TransferRequest& req = s->reqs_.emplace_back();
      req.peer = peer;
      req.dst_regions = {dst};
      for (const engine::PlannedWrite& w : writes) {
        req.src.push_back({s->region_, w.src_offset, w.length});
        req.dst.push_back({0, w.dst_offset, w.length});
      }
    }
    return s;
  }
  ~EngineSession() { IgnoreError(engine_->DeregisterMemory(region_)); }
  // Seconds from submission to completion of transfer `which`. The peer is told WRITEs are
  // coming (Engine::KeepAwake), as a pulling destination knows; the raw target is told too.
  absl::StatusOr<double> Run(testing::Subprocess& peer, size_t which = 0) {
    RETURN_IF_ERROR(peer.Call({{"cmd", "awake"}}).status());
    engine::TransferRequest r = reqs_[which];
    r.deadline = absl::Now() + absl::Seconds(300);
    const absl::Time start = absl::Now();
    auto stats = engine_->Write(std::move(r));
    const double secs = absl::ToDoubleSeconds(absl::Now() - start);
    RETURN_IF_ERROR(peer.Call({{"cmd", "sleep"}}).status());
    RETURN_IF_ERROR(stats.status());
    bytes_per_rail_ = stats->bytes_per_rail;
    writes_ = stats->writes;
    return secs;
  }
  const engine::TransferRequest& request() const { return reqs_[0]; }
  const std::vector<uint64_t>& bytes_per_rail() const { return bytes_per_rail_; }
  uint64_t writes() const { return writes_; }  // WRITEs of the last transfer
  size_t threads() const { return engine_->progress_threads(); }

 private:
  EngineSession() = default;
  std::unique_ptr<engine::Engine> engine_;
  engine::RegionId region_ = 0;
  std::vector<engine::TransferRequest> reqs_;
  std::vector<uint64_t> bytes_per_rail_;
  uint64_t writes_ = 0;
};

struct Row {
  std::string layout;
  uint64_t piece = 0;
  size_t rails = 0;
  size_t writes = 0;           // pieces: the raw loop's WRITEs
  uint64_t engine_writes = 0;  // the engine's (merged, cut and gathered)
  size_t threads = 0;          // the engine's progress threads
  double seconds = 0, raw_seconds = 0;
  Spread ratio;  // over passes of raw time / engine time (paired: same moment)
  std::vector<uint64_t> bytes_per_rail;
  double peer_seconds = 0;  // fi_rma_bw (EngineFlags::peer_bin), as many pairs as rails
  Spread peer_ratio;        // fi_rma_bw time / engine time, paired as `ratio`
};

// The quartiles over passes of num[i] / den[i]. The machine is shared: half the paired
// ratios lie between p25 and p75, and a median whose spread straddles 1 is no finding.
Spread PairedRatios(const std::vector<double>& num, const std::vector<double>& den) {
  std::vector<double> r;
  for (size_t i = 0; i < num.size(); ++i) r.push_back(num[i] / den[i]);
  std::sort(r.begin(), r.end());
  const size_t q = r.size() / 4;
  return {r[q], r[r.size() / 2], r[r.size() - 1 - q]};
}

// An untimed pass of each run, then `iters` passes of all of them in turns, so that every
// run sees the same machine: the seconds of each run's passes.
absl::StatusOr<std::vector<std::vector<double>>> Alternate(
    int iters, const std::vector<absl::FunctionRef<absl::StatusOr<double>()>>& runs) {
  for (const auto& run : runs) RETURN_IF_ERROR(run().status());
  std::vector<std::vector<double>> out(runs.size());
  for (int i = 0; i < iters; ++i) {
    for (size_t r = 0; r < runs.size(); ++r) {
      ASSIGN_OR_RETURN(double t, runs[r]());
      out[r].push_back(t);
    }
  }
  return out;
}

// One configuration: raw (a), engine (b) and, given its path, fi_rma_bw passes in turns;
// medians.
absl::StatusOr<Row> Measure(const EngineFlags& f, RawSession* raw, testing::Subprocess& peer,
                            const nlohmann::json& hello, size_t rails, const std::string& layout,
                            uint64_t piece, char* src) {
  const auto writes = Layout(layout, piece, f.total);
  ASSIGN_OR_RETURN(auto eng, EngineSession::Start(f, hello, rails, {writes}, src));
  std::vector<absl::FunctionRef<absl::StatusOr<double>()>> runs = {[&] { return raw->Run(writes); },
                                                                   [&] { return eng->Run(peer); }};
  const auto rma_bw = [&] { return RunRmaBw(f.peer_bin, f.provider, piece, f.total, rails); };
  if (!f.peer_bin.empty()) runs.push_back(rma_bw);
  ASSIGN_OR_RETURN(auto times, Alternate(f.iters, runs));
  if (f.verify) {
    ASSIGN_OR_RETURN(auto reply, peer.Call({{"cmd", "verify"},
                                            {"seed", kSeed},
                                            {"src", testing::ExtentsToJson(eng->request().src)},
                                            {"dst", testing::ExtentsToJson(eng->request().dst)}}));
    if (!reply["ok"].get<bool>()) {
      return absl::DataLossError("verify: " + reply["error"].get<std::string>());
    }
  }
  Row row{layout,
          piece,
          rails,
          writes.size(),
          eng->writes(),
          eng->threads(),
          Median(times[1]),
          Median(times[0]),
          PairedRatios(times[0], times[1]),
          eng->bytes_per_rail()};
  if (!f.peer_bin.empty()) {
    row.peer_seconds = Median(times[2]);
    row.peer_ratio = PairedRatios(times[2], times[1]);
  }
  return row;
}

// The second target, on the same moments as for the raw ratio: 64 KiB scattered and 4 MiB
// contiguous, engine against engine, passes interleaved; the quartiles of the paired time
// ratios (4 MiB contiguous time / 64 KiB scattered time). Interleaved with them, the same
// ratio for the raw loop sending contiguous WRITEs of the two sizes the engine's WRITEs
// have (64 KiB pieces gathered, 4 MiB pieces cut): what the provider gives for that change
// of WRITE size alone.
struct Share {
  Spread engine, raw;
  uint64_t scattered_write = 0, contiguous_write = 0;  // bytes per engine WRITE
};
absl::StatusOr<Share> ScatteredAgainstContiguous(const EngineFlags& f, RawSession* raw,
                                                 testing::Subprocess& peer,
                                                 const nlohmann::json& hello, size_t rails,
                                                 char* src) {
  // One engine runs both, as one node would.
  ASSIGN_OR_RETURN(auto eng, EngineSession::Start(f, hello, rails,
                                                  {Layout("scattered", 64 << 10, f.total),
                                                   Layout("contiguous", 4 << 20, f.total)},
                                                  src));
  Share out;
  RETURN_IF_ERROR(eng->Run(peer, 0).status());
  out.scattered_write = f.total / eng->writes();
  RETURN_IF_ERROR(eng->Run(peer, 1).status());
  out.contiguous_write = f.total / eng->writes();
  const auto raw_small = Layout("contiguous", out.scattered_write, f.total);
  const auto raw_large = Layout("contiguous", out.contiguous_write, f.total);
  ASSIGN_OR_RETURN(auto times, Alternate(f.iters, {[&] { return eng->Run(peer, 0); },
                                                   [&] { return eng->Run(peer, 1); },
                                                   [&] { return raw->Run(raw_small); },
                                                   [&] { return raw->Run(raw_large); }}));
  out.engine = PairedRatios(times[1], times[0]);
  out.raw = PairedRatios(times[3], times[2]);
  return out;
}

// What the rails' counters cost (what /metrics shows): the same scattered transfer from an
// engine that counts and from one that does not, passes interleaved; the quartiles of the
// paired time ratios (counting / not counting).
absl::StatusOr<Spread> CountersCost(const EngineFlags& f, testing::Subprocess& peer,
                                    const nlohmann::json& hello, size_t rails, uint64_t piece,
                                    char* src) {
  const auto writes = Layout("scattered", piece, f.total);
  EngineFlags off = f;
  off.counters = false;
  ASSIGN_OR_RETURN(auto counting, EngineSession::Start(f, hello, rails, {writes}, src));
  ASSIGN_OR_RETURN(auto silent, EngineSession::Start(off, hello, rails, {writes}, src));
  ASSIGN_OR_RETURN(auto times, Alternate(f.iters, {[&] { return counting->Run(peer); },
                                                   [&] { return silent->Run(peer); }}));
  return PairedRatios(times[0], times[1]);
}

int RunEngineBench(const EngineFlags& flags_in, const std::string& self) {
  EngineFlags f = flags_in;
  if (f.domain.empty()) f.domain = DefaultDomain(f.provider);
  char* src = static_cast<char*>(engine::AllocateHostMemory(f.total));
  testing::FillPattern(kSeed, 0, reinterpret_cast<uint8_t*>(src), f.total);
  const uint64_t dst_size = 2 * f.total;  // scattered slots are two pieces apart

  std::vector<Row> rows;
  std::vector<std::pair<uint64_t, Share>> shares;  // rails, 64 KiB scattered / 4 MiB contiguous
  // One raw target for the whole run: its buffer is touched once, like the engine peer's.
  auto raw = RawSession::Start(f, self, dst_size, src);
  if (!raw.ok()) {
    std::cerr << "raw baseline: " << raw.status() << "\n";
    return 1;
  }
  if (!f.json) {
    std::printf(
        "# ferry-bench engine: provider %s, domain %s, %d iterations (median), "
        "raw baseline = one endpoint, fi_write loop, window %zu, run alternately with the "
        "engine; ratio = median of paired raw/engine times, p25-p75 their quartiles; "
        "engine CQs %s wait fds, destination %s; progress threads per engine: one per rail, "
        "at most %zu\n",
        f.provider.c_str(), f.domain.c_str(), f.iters, f.window, f.wait_fds ? "with" : "without",
        f.spin_while_awake ? "spinning" : "napping between bursts",
        f.threads == 0 ? engine::AutoProgressThreads(SIZE_MAX) : f.threads);
    if (!f.peer_bin.empty()) {
      std::printf(
          "# rma_bw = fabtests' fi_rma_bw -o writedata (window 64), one server/client pair per "
          "rail at once on loopback, run in turns with the other two; rma ratio = median of "
          "paired fi_rma_bw/engine times\n");
    }
    std::printf("%-10s %5s %9s %5s %11s %9s %9s %10s %10s %9s %6s %9s %7s%s\n", "layout", "rails",
                "bytes", "iters", "total", "time", "MB/sec", "usec/xfer", "Mxfers/sec", "raw MB/s",
                "ratio", "p25-p75", "WRITEs",
                f.peer_bin.empty() ? "" : "  rma_bw MB/s rma ratio   p25-p75");
  }
  for (uint64_t rails : f.rails) {
    auto peer = std::make_unique<std::unique_ptr<testing::Subprocess>>();
    auto hello = SpawnHello(
        peer.get(), {self, "engine-peer", "--provider", f.provider, "--domain", f.domain, "--rails",
                     std::to_string(rails), "--size", std::to_string(dst_size),
                     "--progress-threads", std::to_string(f.threads), "--wait-fds",
                     f.wait_fds ? "1" : "0", "--spin-while-awake", f.spin_while_awake ? "1" : "0"});
    if (!hello.ok()) {
      std::cerr << hello.status() << "\n";
      return 1;
    }
    for (const std::string& layout : f.layouts) {
      for (uint64_t piece : f.pieces) {
        if (piece > f.total) continue;
        auto measured = Measure(f, raw->get(), **peer, *hello, rails, layout, piece, src);
        if (!measured.ok()) {
          std::cerr << "engine " << layout << " " << piece << " x" << rails << ": "
                    << measured.status() << "\n";
          return 1;
        }
        const Row& row = *measured;
        const double xfers = static_cast<double>(row.writes);
        const double bytes = static_cast<double>(row.writes * piece);
        const double mbps = bytes / row.seconds / 1e6, raw_mbps = bytes / row.raw_seconds / 1e6;
        const double peer_mbps = bytes / row.peer_seconds / 1e6;
        if (f.json) {
          nlohmann::json out{{"bench", "engine"},
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
                             {"engine_writes", row.engine_writes},
                             {"threads", row.threads},
                             {"wait_fds", f.wait_fds},
                             {"spin_while_awake", f.spin_while_awake},
                             {"ratio", row.ratio.median},
                             {"ratio_p25", row.ratio.p25},
                             {"ratio_p75", row.ratio.p75},
                             {"bytes_per_rail", row.bytes_per_rail}};
          if (!f.peer_bin.empty()) {
            out["rma_bw_mb_per_sec"] = peer_mbps;
            out["rma_bw_ratio"] = row.peer_ratio.median;
            out["rma_bw_ratio_p25"] = row.peer_ratio.p25;
            out["rma_bw_ratio_p75"] = row.peer_ratio.p75;
          }
          std::cout << out.dump() << std::endl;
        } else {
          std::printf(
              "%-10s %5zu %9lu %5d %11.0f %9.4f %9.1f %10.2f %10.4f %9.1f %6.2f "
              "%4.2f-%4.2f %7lu",
              layout.c_str(), static_cast<size_t>(rails), static_cast<unsigned long>(piece),
              f.iters, bytes, row.seconds, mbps, row.seconds * 1e6 / xfers,
              xfers / row.seconds / 1e6, raw_mbps, row.ratio.median, row.ratio.p25, row.ratio.p75,
              static_cast<unsigned long>(row.engine_writes));
          if (!f.peer_bin.empty()) {
            std::printf("  %11.1f %9.2f %4.2f-%4.2f", peer_mbps, row.peer_ratio.median,
                        row.peer_ratio.p25, row.peer_ratio.p75);
          }
          std::printf("\n");
          std::fflush(stdout);
        }
        rows.push_back(row);
      }
    }
    // The targets: >= 1.0x raw for pieces of 64 KiB and up (the rows); 64 KiB scattered >= 90%
    // of 4 MiB contiguous (same rails), measured paired when the rows include both.
    auto has = [&](const char* layout, uint64_t piece) {
      return std::any_of(rows.begin(), rows.end(), [&](const Row& r) {
        return r.rails == rails && r.layout == layout && r.piece == piece;
      });
    };
    if (has("scattered", 64 << 10) && has("contiguous", 4 << 20)) {
      auto share = ScatteredAgainstContiguous(f, raw->get(), **peer, *hello, rails, src);
      if (!share.ok()) {
        std::cerr << "64 KiB scattered against 4 MiB contiguous x" << rails << ": "
                  << share.status() << "\n";
        return 1;
      }
      if (f.json) {
        std::cout << nlohmann::json{{"bench", "engine"},
                                    {"provider", f.provider},
                                    {"rails", rails},
                                    {"compare", "64 KiB scattered / 4 MiB contiguous"},
                                    {"wait_fds", f.wait_fds},
                                    {"spin_while_awake", f.spin_while_awake},
                                    {"iters", f.iters},
                                    {"ratio", share->engine.median},
                                    {"ratio_p25", share->engine.p25},
                                    {"ratio_p75", share->engine.p75},
                                    {"write_bytes",
                                     {share->scattered_write, share->contiguous_write}},
                                    {"raw_ratio", share->raw.median},
                                    {"raw_ratio_p25", share->raw.p25},
                                    {"raw_ratio_p75", share->raw.p75}}
                         .dump()
                  << std::endl;
      } else {
        shares.emplace_back(rails, *share);
      }
    }
    for (uint64_t piece : f.counters_cost ? f.pieces : std::vector<uint64_t>{}) {
      auto cost = CountersCost(f, **peer, *hello, rails, piece, src);
      if (!cost.ok()) {
        std::cerr << "counters on/off " << piece << " x" << rails << ": " << cost.status() << "\n";
        return 1;
      }
      if (f.json) {
        std::cout << nlohmann::json{{"bench", "engine"},
                                    {"provider", f.provider},
                                    {"rails", rails},
                                    {"bytes", piece},
                                    {"compare", "counters on / off, scattered"},
                                    {"iters", f.iters},
                                    {"ratio", cost->median},
                                    {"ratio_p25", cost->p25},
                                    {"ratio_p75", cost->p75}}
                         .dump()
                  << std::endl;
      } else {
        std::printf(
            "# rails %lu, %lu-byte scattered pieces: time with the rail counters / "
            "without = %.3f (median of %d paired passes; p25-p75 %.3f-%.3f)\n",
            static_cast<unsigned long>(rails), static_cast<unsigned long>(piece), cost->median,
            f.iters, cost->p25, cost->p75);
        std::fflush(stdout);
      }
    }
    IgnoreError((*peer)->WriteLine(R"({"cmd":"exit"})"));
    (*peer)->Wait();
  }
  for (const auto& [rails, share] : shares) {
    std::printf(
        "# rails %lu: 64 KiB scattered = %.1f%% of 4 MiB contiguous (median of %d paired "
        "passes; p25-p75 %.1f-%.1f%%); raw loop, %lu KiB WRITEs = %.1f%% of %lu KiB "
        "WRITEs (p25-p75 %.1f-%.1f%%)\n",
        static_cast<unsigned long>(rails), 100.0 * share.engine.median, f.iters,
        100.0 * share.engine.p25, 100.0 * share.engine.p75,
        static_cast<unsigned long>(share.scattered_write >> 10), 100.0 * share.raw.median,
        static_cast<unsigned long>(share.contiguous_write >> 10), 100.0 * share.raw.p25,
        100.0 * share.raw.p75);
  }
  engine::FreeHostMemory(src, f.total);
  return 0;
}

}  // namespace
}  // namespace ferry::bench

int main(int argc, char** argv) {
  signal(SIGPIPE, SIG_IGN);  // a child that died shows up as an error, not as our death
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
  eng->add_option("--threads", ef.threads,
                  "progress threads per engine (0: one per rail, up to half the CPUs)");
  eng->add_option("--window", ef.window, "raw baseline: WRITEs in flight");
  eng->add_option("--depth", ef.depth, "engine: WRITEs in flight per rail (0: provider's tx size)");
  eng->add_option("--inflight", ef.inflight, "engine: bytes in flight per rail (0: default)");
  eng->add_option("--max-write", ef.max_write, "engine: longest WRITE (0: the engine's default)");
  eng->add_option("--max-iov", ef.max_iov,
                  "engine: pieces one WRITE may gather (0: the engine's default)");
  eng->add_option("--wait-fds", ef.wait_fds,
                  "engine: CQs with wait fds, idle progress threads block (false: they poll)")
      ->capture_default_str();
  eng->add_option("--spin-while-awake", ef.spin_while_awake,
                  "engine: the destination polls without pausing while it expects WRITEs "
                  "(false: naps between bursts)")
      ->capture_default_str();
  eng->add_option("--peer-bin", ef.peer_bin,
                  "fabtests' fi_rma_bw: also run it in turns (tcp; one pair per rail) and give "
                  "the ratio to it");
  eng->add_flag("--json", ef.json, "one JSON object per row");
  eng->add_flag("--verify", ef.verify, "check every byte after each configuration");
  eng->add_flag("--counters-cost", ef.counters_cost,
                "also time each piece size scattered with the rail counters on against off");
  std::string raw_provider = "tcp", raw_domain = "lo";
  uint64_t raw_size = 0;
  CLI::App* raw = app.add_subcommand("raw-peer", "(internal) target of the raw baseline");
  raw->add_option("--provider", raw_provider);
  raw->add_option("--domain", raw_domain);
  raw->add_option("--size", raw_size);
  ferry::bench::NodeFlags nf;
  nf.ferryd = FERRYD_PATH;
  CLI::App* node = app.add_subcommand(
      "node", "pulls over HTTP, the client and an embedded node vs the engine; catalog");
  node->add_option("--rails", nf.rails, "rails per node");
  node->add_option("--sizes", nf.sizes, "object sizes, comma-separated")->delimiter(',');
  node->add_option("--iters", nf.iters, "timed pulls per size (median)");
  node->add_option("--latency-iters", nf.latency_iters, "pulls and lookups for percentiles");
  node->add_option("--objects", nf.objects, "objects in the catalog");
  node->add_option("--max-extents", nf.max_extents,
                   "pieces of 64 KiB in the largest many-piece pull");
  node->add_option("--ferryd", nf.ferryd, "ferryd to start");
  node->add_option("--ferryd-arg", nf.ferryd_args,
                   "a flag for every ferryd, e.g. --ferryd-arg=--spin-while-awake=true "
                   "(repeatable)");
  node->add_flag("--json", nf.json, "one JSON object per row");
  node->add_flag("--metrics-cost", nf.metrics_cost,
                 "instead of the tables: pulls with /metrics counting on against off");
  ferry::bench::RailsFlags rf;
  rf.ferryd = FERRYD_PATH;
  CLI::App* rails = app.add_subcommand(
      "rails", "striping over N shaped veth rails between two namespaces vs iperf3 (needs root)");
  rails->add_option("--configs", rf.configs, "NxMBIT: N rails at MBIT Mbit/s, comma-separated")
      ->delimiter(',');
  rails->add_option("--size", rf.size, "object bytes");
  rails->add_option("--pieces", rf.pieces, "piece sizes in bytes, comma-separated")->delimiter(',');
  rails->add_option("--iperf-seconds", rf.iperf_seconds, "iperf3 run per configuration");
  rails->add_option("--ferryd", rf.ferryd, "ferryd to start");
  rails
      ->add_option("--repeat", rf.repeat,
                   "timed pulls per row: the row gives the median and the worst")
      ->check(CLI::Range(1, 100));
  rails->add_option("--ferryd-arg", rf.ferryd_args,
                    "a flag for both ferryd, e.g. --ferryd-arg=--spin-while-awake=false "
                    "(repeatable)");
  rails->add_flag("--json", rf.json, "one JSON object per row");
  rails->add_flag("--cut-source-rail", rf.cut_source_rail,
                  "after each row, the same pull with the source's rail 0 down halfway");
  ferry::bench::ClusterFlags cf;
  cf.ferryd = FERRYD_PATH;
  CLI::App* cluster = app.add_subcommand(
      "cluster",
      "one object distributed to N nodes over 1 + N shaped namespaces vs one pull (needs root)");
  cluster->add_option("--receivers", cf.receivers, "receiver counts, comma-separated")
      ->delimiter(',');
  cluster->add_option("--size", cf.size, "object bytes");
  cluster->add_option("--rate-mbit", cf.rate_mbit, "each node's link, each way")
      ->capture_default_str();
  cluster->add_option("--chunk", cf.chunk, "bytes per chunk (0: the node's default)");
  cluster->add_option("--checksum", cf.checksum, "CRC32C per chunk (true/false)")
      ->capture_default_str();
  cluster->add_option("--ferryd", cf.ferryd, "ferryd to start");
  cluster->add_flag("--json", cf.json, "one JSON object per row");
#ifdef FERRY_BENCH_GPU
  ferry::bench::GpuFlags gf;
  gf.ferryd = FERRYD_PATH;
  CLI::App* gpu =
      app.add_subcommand("gpu", "GPU object pulls between two ferryd vs cudaMemcpyPeer");
  gpu->add_option("--provider", gf.provider, "tcp (on lo) or shm, for the staged and rdma paths");
  gpu->add_option("--rails", gf.rails, "rails per node for the staged and rdma paths");
  gpu->add_option("--size", gf.size, "object bytes");
  gpu->add_option("--pieces", gf.pieces, "piece counts, comma-separated (1: contiguous)")
      ->delimiter(',');
  gpu->add_option("--iters", gf.iters, "timed pulls per layout (median)");
  gpu->add_option("--staged", gf.staged, "also force the staged path (true/false)");
  gpu->add_option("--ferryd", gf.ferryd, "ferryd to start");
  gpu->add_option("--ferryd-arg", gf.ferryd_args, "one more argument for both ferryd (repeatable)");
  gpu->add_flag("--json", gf.json, "one JSON object per row");
#endif
  CLI11_PARSE(app, argc, argv);
#ifdef FERRY_BENCH_GPU
  if (*gpu) {
    if (gf.iters < 1 || gf.size == 0 || gf.pieces.empty()) {
      std::cerr << "--iters, --size and --pieces must be positive\n";
      return 2;
    }
    for (uint64_t p : gf.pieces) {
      if (p == 0 || gf.size % p != 0) {
        std::cerr << "--pieces: each count must divide --size\n";
        return 2;
      }
    }
    return ferry::bench::RunGpuBench(gf);
  }
#endif
  if (*cluster) {
    if (cf.receivers.empty() || cf.size == 0 ||
        *std::min_element(cf.receivers.begin(), cf.receivers.end()) == 0) {
      std::cerr << "--receivers and --size must be positive\n";
      return 2;
    }
    return ferry::bench::RunClusterBench(cf);
  }
  if (*rails) {
    for (uint64_t p : rf.pieces) {
      if (p == 0 || rf.size % p != 0) {
        std::cerr << "--pieces: each size must divide --size\n";
        return 2;
      }
    }
    if (rf.iperf_seconds < 1) {
      std::cerr << "--iperf-seconds must be positive\n";
      return 2;
    }
    return ferry::bench::RunRailsBench(rf);
  }
  if (*raw) return ferry::bench::RunRawPeer(raw_provider, raw_domain, raw_size);
  if (*node) {
    if (nf.iters < 1 || nf.latency_iters < 1 || nf.objects == 0 || nf.rails == 0 ||
        nf.max_extents == 0) {
      std::cerr
          << "--iters, --latency-iters, --objects, --rails and --max-extents must be positive\n";
      return 2;
    }
    return ferry::bench::RunNodeBench(nf);
  }
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
