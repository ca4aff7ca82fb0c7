// ferry-demo: the engine's main job on one machine. This process is the destination: it
// registers a buffer and asks a second process (the source, this program started again with
// --role source) to pull a non-contiguous object into a non-contiguous layout of its buffer.
// The source WRITEs the bytes over libfabric (tcp provider on loopback by default), the
// destination checks every byte and prints what happened and how fast.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <random>
#include <string>

#include "CLI/CLI.hpp"
#include "absl/time/clock.h"
#include "base/status.h"
#include "engine/engine.h"
#include "nlohmann/json.hpp"
#include "spdlog/sinks/stdout_color_sinks.h"
#include "spdlog/spdlog.h"
#include "tests/testing/engine_peer.h"
#include "tests/testing/pattern.h"
#include "tests/testing/subprocess.h"

namespace {

using ferry::Extent;
constexpr uint64_t kSeed = 0xde770;

struct Flags {
  std::string role = "destination";
  std::string provider = "tcp";
  std::string domain = "lo";
  size_t rails = 4;
  uint64_t size = 256 << 20;
  uint64_t min_piece = 4096;
  uint64_t max_piece = 1 << 20;
  int repeat = 3;
};

std::unique_ptr<ferry::engine::Engine> MakeEngine(const Flags& f) {
  ferry::engine::EngineOptions o;
  o.provider = f.provider;
  if (!f.domain.empty()) o.domains = {f.domain};
  o.rails = f.rails;
  auto e = ferry::engine::Engine::Create(o);
  if (!e.ok()) {
    std::cerr << "engine: " << e.status() << "\n";
    std::exit(1);
  }
  return std::move(*e);
}

// The source: publishes nothing by itself; it reads one pull request (destination address,
// region descriptor, both layouts) from stdin, WRITEs, and answers with the stats.
int RunSource(const Flags& f) {
  auto engine = MakeEngine(f);
  std::string line;
  if (!std::getline(std::cin, line)) return 1;
  auto req = nlohmann::json::parse(line);
  const uint64_t src_size = req["src_size"].get<uint64_t>();
  auto* buf = static_cast<uint8_t*>(std::aligned_alloc(4096, (src_size + 4095) / 4096 * 4096));
  ferry::testing::FillPattern(kSeed, 0, buf, src_size);
  auto region = engine->RegisterMemory(buf, src_size, ferry::Device::Host());
  auto address = ferry::testing::AddressFromJson(req["address"]);
  auto dst = ferry::RegionDescriptorFromJson(req["region"]);
  nlohmann::json reply;
  absl::StatusOr<ferry::engine::TransferStats> stats = absl::UnknownError("not run");
  if (region.ok() && address.ok() && dst.ok()) {
    auto peer = engine->AddPeer(*address, absl::Now() + absl::Seconds(30));
    if (peer.ok()) {
      ferry::engine::TransferRequest t;
      t.peer = *peer;
      t.dst_regions = {*dst};
      for (const auto& e : req["src"]) {
        t.src.push_back({*region, e[0].get<uint64_t>(), e[1].get<uint64_t>()});
      }
      for (const auto& e : req["dst"]) t.dst.push_back({0, e[0], e[1]});
      const int repeat = req["repeat"].get<int>();
      nlohmann::json runs = nlohmann::json::array();
      for (int i = 0; i < repeat; ++i) {
        ferry::engine::TransferRequest one = t;
        one.deadline = absl::Now() + absl::Seconds(120);
        stats = engine->Write(std::move(one));
        if (!stats.ok()) break;
        runs.push_back(stats->seconds);
      }
      reply["runs"] = runs;
    } else {
      stats = peer.status();
    }
  }
  if (stats.ok()) {
    reply.update({{"ok", true},
                  {"bytes", stats->bytes},
                  {"writes", stats->writes},
                  {"seconds", stats->seconds},
                  {"bytes_per_rail", stats->bytes_per_rail}});
  } else {
    reply = {{"ok", false}, {"error", stats.status().ToString()}};
  }
  std::cout << reply.dump() << std::endl;
  engine.reset();
  std::free(buf);
  return stats.ok() ? 0 : 1;
}

int RunDestination(const Flags& f, const std::string& self) {
  std::mt19937_64 rng(static_cast<uint64_t>(absl::ToUnixNanos(absl::Now())));
  auto pieces = ferry::testing::RandomPieces(rng, f.size, f.min_piece, f.max_piece);
  uint64_t dst_size = 0;
  auto dst = ferry::testing::RandomDestinationLayout(rng, pieces, 4096, &dst_size);
  const uint64_t src_size = f.size + f.size / 8;
  auto src = ferry::testing::RandomSourceLayout(rng, pieces, src_size);

  auto engine = MakeEngine(f);
  auto* buf = static_cast<uint8_t*>(std::aligned_alloc(4096, (dst_size + 4095) / 4096 * 4096));
  memset(buf, 0xa5, dst_size);
  auto region = engine->RegisterMemory(buf, dst_size, ferry::Device::Host());
  if (!region.ok()) {
    std::cerr << "register: " << region.status() << "\n";
    return 1;
  }
  // The source may WRITE into the buffer while the window is open.
  auto window = engine->OpenWindow(*region, 0, dst_size);
  if (!window.ok()) {
    std::cerr << "window: " << window.status() << "\n";
    return 1;
  }
  std::printf("destination %s: %zu rails (%s, domain %s), buffer of %lu bytes registered\n",
              engine->node_id().c_str(), engine->rails().size(),
              engine->rails()[0].provider.c_str(), engine->rails()[0].domain.c_str(),
              static_cast<unsigned long>(dst_size));
  auto source =
      ferry::testing::Subprocess::Spawn({self, "--role", "source", "--provider", f.provider,
                                         "--domain", f.domain, "--rails", std::to_string(f.rails)});
  if (!source.ok()) {
    std::cerr << source.status() << "\n";
    return 1;
  }
  std::printf(
      "source process %d started; asking it to pull %lu bytes in %zu pieces "
      "(%lu B to %lu B) into %zu scattered extents\n",
      (*source)->pid(), static_cast<unsigned long>(f.size), pieces.size(),
      static_cast<unsigned long>(f.min_piece), static_cast<unsigned long>(f.max_piece), dst.size());
  const absl::Time start = absl::Now();
  // WRITEs are coming until the source answers: keep polling the rails meanwhile.
  ferry::engine::AwakeToken awake = engine->KeepAwake();
  auto reply = (*source)->Call({{"address", ferry::testing::AddressToJson(engine->address())},
                                {"region", ferry::ToJson(window->descriptor)},
                                {"src_size", src_size},
                                {"src", ferry::testing::ExtentsToJson(src)},
                                {"dst", ferry::testing::ExtentsToJson(dst)},
                                {"repeat", f.repeat}},
                               absl::Seconds(300));
  const double wall = absl::ToDoubleSeconds(absl::Now() - start);
  awake = ferry::engine::AwakeToken();
  if (!reply.ok() || !(*reply)["ok"].get<bool>()) {
    std::cerr << "pull failed: "
              << (reply.ok() ? (*reply)["error"].dump() : reply.status().ToString()) << "\n";
    return 1;
  }
  int i = 0;
  for (const auto& run : (*reply)["runs"]) {
    const double secs = run.get<double>();
    std::printf(
        "pull %d: %lu bytes in %lu WRITEs over %zu rails in %.3f s: %.2f GB/s "
        "(%.2f Gbit/s)\n",
        ++i, static_cast<unsigned long>(f.size),
        static_cast<unsigned long>((*reply)["writes"].get<uint64_t>()), f.rails, secs,
        static_cast<double>(f.size) / secs / 1e9, static_cast<double>(f.size) * 8 / secs / 1e9);
  }
  std::printf("%.3f s from the request to the answer, source start-up included\n", wall);
  std::printf("bytes per rail: %s\n", (*reply)["bytes_per_rail"].dump().c_str());
  std::string err = ferry::testing::VerifyTransfer(kSeed, src, dst, buf, dst_size, 0xa5);
  if (!err.empty()) {
    std::printf("VERIFY FAILED: %s\n", err.c_str());
    return 1;
  }
  std::printf(
      "verified: every one of the %lu bytes is the right source byte, and no byte "
      "outside the extents changed\n",
      static_cast<unsigned long>(f.size));
  (*source)->Wait();
  engine.reset();
  std::free(buf);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  spdlog::set_default_logger(spdlog::stderr_color_mt("ferry"));
  spdlog::set_level(spdlog::level::warn);
  Flags f;
  CLI::App app{"ferry engine demo: one process pulls a non-contiguous buffer from another"};
  app.add_option("--role", f.role, "destination (default) or source (started by the demo)")
      ->check(CLI::IsMember({"destination", "source"}));
  app.add_option("--provider", f.provider, "tcp or shm");
  app.add_option("--domain", f.domain, "libfabric domain (lo for tcp, shm for shm)");
  app.add_option("--rails", f.rails, "rails per engine");
  app.add_option("--size", f.size, "bytes to move");
  app.add_option("--min-piece", f.min_piece, "smallest piece");
  app.add_option("--max-piece", f.max_piece, "largest piece");
  app.add_option("--repeat", f.repeat, "pulls of the same object (the first is cold)");
  CLI11_PARSE(app, argc, argv);
  if (f.role == "source") return RunSource(f);
  if (f.size == 0 || f.min_piece == 0 || f.max_piece < f.min_piece || f.repeat < 1) {
    std::cerr << "--size, --min-piece, --max-piece and --repeat must be positive, min <= max\n";
    return 2;
  }
  char self[4096];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n <= 0) return 1;
  return RunDestination(f, std::string(self, static_cast<size_t>(n)));
}
