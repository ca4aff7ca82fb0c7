// ferry-bench node: the control plane's cost.
#include "tests/bench/node_bench.h"

#include <httplib.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <iostream>
#include <numeric>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "ferry/client.h"
#include "ferry/node.h"
#include "metadata/catalog.h"
#include "nlohmann/json.hpp"
#include "tests/bench/stats.h"
#include "tests/testing/ferryd_process.h"

namespace ferry::bench {

absl::StatusOr<uint64_t> NewRegion(httplib::Client& c, uint64_t size) {
  auto r = c.Post("/v1/regions", nlohmann::json{{"size", size}}.dump(), "application/json");
  if (!r || r->status != 201) {
    return absl::UnavailableError("POST /v1/regions: " + (r ? r->body : std::string("no answer")));
  }
  return nlohmann::json::parse(r->body)["id"].get<uint64_t>();
}

namespace {

using json = nlohmann::json;

bool Start(testing::FerrydProcess& d, const NodeFlags& f, const std::string& dir,
           bool metrics = true) {
  std::vector<std::string> args = {"--data-dir", dir,
                                   "--domain",   "lo",
                                   "--rails",    std::to_string(f.rails),
                                   "--metrics",  metrics ? "true" : "false"};
  args.insert(args.end(), f.ferryd_args.begin(), f.ferryd_args.end());
  auto p = testing::StartFerryd(f.ferryd, args);
  if (!p.ok()) {
    std::cerr << p.status() << "\n";
    return false;
  }
  d = std::move(*p);
  return true;
}

void Row(const NodeFlags& f, const json& j, const std::string& text) {
  if (f.json) {
    std::cout << j.dump() << std::endl;
  } else {
    std::printf("%s\n", text.c_str());
    std::fflush(stdout);
  }
}

// Whole-call and engine seconds of `iters` pulls after `warmup` untimed ones.
struct PullTimes {
  std::vector<double> wall, engine;
};
using PullOnce = std::function<absl::StatusOr<PullStats>()>;
absl::StatusOr<PullTimes> TimePulls(const PullOnce& pull, int warmup, int iters,
                                    const std::function<void()>& before = nullptr) {
  PullTimes out;
  for (int i = 0; i < warmup + iters; ++i) {
    if (before) before();
    const absl::Time t = absl::Now();
    absl::StatusOr<PullStats> r = pull();
    const double wall = absl::ToDoubleSeconds(absl::Now() - t);
    if (!r.ok()) return r.status();
    if (i < warmup) continue;
    out.wall.push_back(wall);
    out.engine.push_back(r->seconds);
  }
  return out;
}

// The three ways a program asks node B (or itself) to pull from node A.
struct Ways {
  httplib::Client* http;   // POST /v1/pulls to ferryd B, a kept connection
  Client* client;          // ferry::Client on ferryd B
  EmbeddedNode* embedded;  // pulls into its own memory
};
constexpr const char* kVias[] = {"http", "client", "embedded"};

// A pull of `object` from `from` into [0, size) of B's region `b_region` (http, client) or of
// the embedded node's `e_region`, the way `via` names.
PullOnce PullVia(const Ways& w, const std::string& via, const std::string& from,
                 const std::string& object, uint64_t size, uint64_t b_region, uint64_t e_region) {
  PullSpec spec;
  spec.from = from;
  spec.object = object;
  if (via == "http") {
    const std::string body =
        json{{"from", from},
             {"object", object},
             {"into", {{"extents", {{{"region", b_region}, {"offset", 0}, {"length", size}}}}}}}
            .dump();
    return [&w, body]() -> absl::StatusOr<PullStats> {
      auto r = w.http->Post("/v1/pulls", body, "application/json");
      if (!r || r->status != 200) {
        return absl::UnavailableError("pull failed: " + (r ? r->body : std::string("no answer")));
      }
      PullStats stats;
      stats.seconds = json::parse(r->body)["seconds"].get<double>();
      return stats;
    };
  }
  if (via == "client") {
    spec.into = Layout({{b_region, 0, size}});
    return [&w, spec] { return w.client->Pull(spec); };
  }
  spec.into = Layout({{e_region, 0, size}});
  return [&w, spec] { return w.embedded->Pull(spec); };
}

// A random order of the pages 0..n-1.
std::vector<uint32_t> Shuffled(uint32_t n, uint32_t seed) {
  std::vector<uint32_t> v(n);
  std::iota(v.begin(), v.end(), 0);
  std::shuffle(v.begin(), v.end(), std::mt19937(seed));
  return v;
}

int Fail(const absl::Status& s) {
  std::cerr << s << "\n";
  return 1;
}

// What counting for /metrics costs a pull: ferryd pairs with and without (--metrics), their
// 4 KiB pulls (POST /v1/pulls, a kept connection) in alternated rounds, and 64 MiB pulls
// alternated (each pair first in every other round); p50 and median times, and their ratio
// (counting / not counting).
int MetricsCost(const NodeFlags& f, const std::filesystem::path& dir) {
  struct Pair {
    testing::FerrydProcess a, b;
    std::unique_ptr<httplib::Client> ha, hb;
    uint64_t b_region = 0;
    std::vector<double> small, large;
  };
  Pair pairs[2];  // [0] counts, [1] does not
  constexpr uint64_t kLarge = 64 << 20;
  for (int i = 0; i < 2; ++i) {
    Pair& p = pairs[i];
    const std::string name = i == 0 ? "on" : "off";
    if (!Start(p.a, f, (dir / (name + "a")).string(), i == 0) ||
        !Start(p.b, f, (dir / (name + "b")).string(), i == 0)) {
      return Fail(absl::UnavailableError("cannot start ferryd"));
    }
    p.ha = std::make_unique<httplib::Client>(p.a.url);
    p.hb = std::make_unique<httplib::Client>(p.b.url);
    p.hb->set_keep_alive(true);
    p.hb->set_tcp_nodelay(true);
    p.hb->set_read_timeout(300);
    auto a_region = NewRegion(*p.ha, kLarge);
    auto b_region = NewRegion(*p.hb, kLarge);
    if (!a_region.ok() || !b_region.ok()) {
      return Fail(a_region.ok() ? b_region.status() : a_region.status());
    }
    p.b_region = *b_region;
    for (auto [object, size] :
         {std::pair<const char*, uint64_t>{"small", 4096}, {"large", kLarge}}) {
      auto r = p.ha->Put(
          absl::StrCat("/v1/objects/", object).c_str(),
          json{{"extents", {{{"region", *a_region}, {"offset", 0}, {"length", size}}}}}.dump(),
          "application/json");
      if (!r || r->status != 201) return Fail(absl::UnavailableError("publish failed"));
    }
  }
  auto pull = [&](Pair& p, const char* object, uint64_t size) -> absl::StatusOr<double> {
    const std::string body =
        json{{"from", p.a.url},
             {"object", object},
             {"into", {{"extents", {{{"region", p.b_region}, {"offset", 0}, {"length", size}}}}}}}
            .dump();
    const absl::Time t = absl::Now();
    auto r = p.hb->Post("/v1/pulls", body, "application/json");
    if (!r || r->status != 200) return absl::UnavailableError("pull failed");
    return absl::ToDoubleSeconds(absl::Now() - t);
  };
  constexpr int kRounds = 10;
  const int per_round = std::max(1, f.latency_iters / kRounds);
  for (int round = -1; round < kRounds; ++round) {  // round -1: warm-up, not kept
    for (int k = 0; k < 2; ++k) {
      Pair& p = pairs[(k + round + 2) % 2];  // each pair goes first in every other round
      for (int i = 0; i < per_round; ++i) {
        auto s = pull(p, "small", 4096);
        if (!s.ok()) return Fail(s.status());
        if (round >= 0) p.small.push_back(*s);
      }
    }
  }
  for (int i = -1; i < f.iters; ++i) {
    for (int k = 0; k < 2; ++k) {
      Pair& p = pairs[(k + i + 2) % 2];
      auto s = pull(p, "large", kLarge);
      if (!s.ok()) return Fail(s.status());
      if (i >= 0) p.large.push_back(*s);
    }
  }
  const double on4 = Percentile(pairs[0].small, 0.5) * 1e6,
               off4 = Percentile(pairs[1].small, 0.5) * 1e6;
  const double on64 = Median(pairs[0].large), off64 = Median(pairs[1].large);
  Row(f,
      {{"bench", "node_metrics_cost"},
       {"bytes", 4096},
       {"iters", per_round * kRounds},
       {"p50_us_on", on4},
       {"p50_us_off", off4},
       {"ratio", on4 / off4}},
      absl::StrFormat("4 KiB pulls, %d each, alternated in %d rounds: p50 %.1f us counting, "
                      "%.1f us not; ratio %.3f",
                      per_round * kRounds, kRounds, on4, off4, on4 / off4));
  Row(f,
      {{"bench", "node_metrics_cost"},
       {"bytes", kLarge},
       {"iters", f.iters},
       {"seconds_on", on64},
       {"seconds_off", off64},
       {"ratio", on64 / off64}},
      absl::StrFormat("64 MiB pulls, %d each, alternated: median %.1f MB/s counting, %.1f MB/s "
                      "not; time ratio %.3f",
                      f.iters, kLarge / on64 / 1e6, kLarge / off64 / 1e6, on64 / off64));
  return 0;
}

}  // namespace

int RunNodeBench(const NodeFlags& f) {
  const auto dir =
      std::filesystem::temp_directory_path() / ("ferry-bench-node-" + std::to_string(getpid()));
  std::filesystem::remove_all(dir);
  if (f.metrics_cost) {
    const int rc = MetricsCost(f, dir);
    std::filesystem::remove_all(dir);
    return rc;
  }
  testing::FerrydProcess a, b;  // stopped (SIGTERM) when they go
  if (!Start(a, f, (dir / "a").string()) || !Start(b, f, (dir / "b").string())) {
    std::cerr << "cannot start ferryd (" << f.ferryd << ")\n";
    return 1;
  }
  httplib::Client ha(a.url), hb(b.url);
  ha.set_read_timeout(300);
  hb.set_read_timeout(300);
  hb.set_keep_alive(true);
  hb.set_tcp_nodelay(true);
  auto ca = Client::Connect(a.url);
  auto cb = Client::Connect(b.url);
  if (!ca.ok() || !cb.ok()) return Fail(ca.ok() ? cb.status() : ca.status());
  EmbeddedNodeOptions eo;
  eo.data_dir = (dir / "e").string();
  eo.domains = {"lo"};
  eo.rails = f.rails;
  eo.sync = false;
  auto e = EmbeddedNode::Start(eo);
  if (!e.ok()) return Fail(e.status());
  const Ways ways{&hb, cb->get(), e->get()};
  if (!f.json) {
    std::printf(
        "# ferry-bench node: ferryd A serves; ferryd B and a node embedded here pull; "
        "loopback, tcp, %zu rails each\n",
        f.rails);
  }

  // Regions for the largest pull: A's source, B's and the embedded node's destinations.
  uint64_t largest = 4096;
  for (uint64_t size : f.sizes) largest = std::max(largest, size);
  largest = std::max<uint64_t>(largest, uint64_t{f.max_extents} << 16);
  auto a_region = NewRegion(ha, largest);
  auto b_region = NewRegion(hb, largest);
  if (!a_region.ok() || !b_region.ok())
    return Fail(a_region.ok() ? b_region.status() : a_region.status());
  std::vector<char> e_memory(largest);
  auto e_region = (*e)->Register(e_memory.data(), e_memory.size());
  if (!e_region.ok()) return Fail(e_region.status());
  auto publish = [&](const std::string& name, const Layout& layout) {
    return (*ca)->Publish(name, layout, /*replace=*/true).status();
  };

  // 1. A 4 KiB pull, each way.
  if (absl::Status s = publish("lat", Layout({{*a_region, 0, 4096}})); !s.ok()) return Fail(s);
  for (const char* via : kVias) {
    auto times = TimePulls(PullVia(ways, via, a.url, "lat", 4096, *b_region, *e_region), 20,
                           f.latency_iters);
    if (!times.ok()) return Fail(times.status());
    const double p50 = Percentile(times->wall, 0.5) * 1e6,
                 p99 = Percentile(times->wall, 0.99) * 1e6;
    const double engine_p50 = Percentile(times->engine, 0.5) * 1e6;
    Row(f,
        {{"bench", "node_pull_latency"},
         {"via", via},
         {"bytes", 4096},
         {"iters", f.latency_iters},
         {"p50_us", p50},
         {"p99_us", p99},
         {"engine_p50_us", engine_p50}},
        absl::StrFormat(
            "pull 4 KiB via %-8s %d pulls: p50 %.0f us, p99 %.0f us (engine p50 %.0f us)", via,
            f.latency_iters, p50, p99, engine_p50));
  }

  // 2. Throughput: the whole call next to the engine's own time for the same WRITEs.
  if (!f.json) {
    std::printf("%-9s %12s %6s %10s %12s %10s %12s %7s\n", "via", "bytes", "iters", "call s",
                "call MB/s", "engine s", "engine MB/s", "ratio");
  }
  for (uint64_t size : f.sizes) {
    const std::string name = "tp" + std::to_string(size);
    if (absl::Status s = publish(name, Layout({{*a_region, 0, size}})); !s.ok()) return Fail(s);
    for (const char* via : kVias) {
      auto times =
          TimePulls(PullVia(ways, via, a.url, name, size, *b_region, *e_region), 1, f.iters);
      if (!times.ok()) return Fail(times.status());
      const double cs = Median(times->wall), es = Median(times->engine);
      const double mb = static_cast<double>(size) / 1e6;
      Row(f,
          {{"bench", "node_pull_throughput"},
           {"via", via},
           {"bytes", size},
           {"iters", f.iters},
           {"call_seconds", cs},
           {"engine_seconds", es},
           {"ratio", es / cs}},
          absl::StrFormat("%-9s %12d %6d %10.5f %12.1f %10.5f %12.1f %7.2f", via, size, f.iters, cs,
                          mb / cs, es, mb / es, es / cs));
    }
  }

  // 3. Many pieces: N pages of 64 KiB of A's pool, shuffled, into shuffled page slots of the
  // embedded node's memory. Warm: the same version into the same layout again. Cold: a new
  // version (a new page order) and new destination slots before every pull.
  std::vector<uint32_t> piece_counts = {std::min(1024u, f.max_extents)};
  if (f.max_extents > 1024) piece_counts.push_back(f.max_extents);
  for (uint32_t n : piece_counts) {
    constexpr uint64_t kPage = 64 << 10;
    for (bool warm : {true, false}) {
      uint32_t round = 0;
      PullSpec spec;
      spec.from = a.url;
      spec.object = "pages";
      auto next = [&] {
        ++round;
        if (warm && round > 1) return;
        (void)publish("pages", Layout().AddPages(*a_region, 0, kPage, Shuffled(n, round)));
        spec.into = Layout().AddPages(*e_region, 0, kPage, Shuffled(n, round + 1000));
      };
      auto times = TimePulls([&] { return (*e)->Pull(spec); }, 2, f.iters * 2, next);
      if (!times.ok()) return Fail(times.status());
      std::vector<double> control;
      for (size_t i = 0; i < times->wall.size(); ++i) {
        control.push_back(times->wall[i] - times->engine[i]);
      }
      const double control_us = Median(control) * 1e6;
      Row(f,
          {{"bench", "node_pull_extents"},
           {"extents", n},
           {"piece", kPage},
           {"warm", warm},
           {"iters", f.iters * 2},
           {"call_us", Median(times->wall) * 1e6},
           {"engine_us", Median(times->engine) * 1e6},
           {"control_us", control_us},
           {"control_ns_per_extent", control_us * 1e3 / n}},
          absl::StrFormat("%5d pieces of 64 KiB, %s: call %.0f us, engine %.0f us, control %.0f us "
                          "= %.0f ns per piece",
                          n, warm ? "warm" : "cold", Median(times->wall) * 1e6,
                          Median(times->engine) * 1e6, control_us, control_us * 1e3 / n));
    }
  }

  // 4. Ephemeral publishes: in process (the embedded node) and over HTTP (a kept connection).
  {
    const int n = static_cast<int>(std::min<uint64_t>(f.objects, 100000));
    absl::Time t = absl::Now();
    for (int i = 0; i < n; ++i) {
      auto r = (*e)->Publish(absl::StrCat("kv/", i),
                             Layout({{*e_region, uint64_t(i) % 4096, 4096}}), true, false);
      if (!r.ok()) return Fail(r.status());
    }
    double secs = absl::ToDoubleSeconds(absl::Now() - t);
    Row(f,
        {{"bench", "catalog_publish"},
         {"durable", false},
         {"via", "embedded"},
         {"objects", n},
         {"per_sec", n / secs}},
        absl::StrFormat("publish ephemeral, in process: %d in %.2f s = %.0f /s", n, secs,
                        n / secs));
    const int n_http = std::min(n, 20000);
    const std::string body =
        json{{"extents", {{{"region", *a_region}, {"offset", 0}, {"length", 4096}}}}}.dump();
    ha.set_keep_alive(true);
    ha.set_tcp_nodelay(true);
    t = absl::Now();
    for (int i = 0; i < n_http; ++i) {
      auto r = ha.Put(absl::StrCat("/v1/objects/kv%2F", i, "?durable=false").c_str(), body,
                      "application/json");
      if (!r || r->status != 201)
        return Fail(absl::UnavailableError("PUT: " + (r ? r->body : "no answer")));
    }
    secs = absl::ToDoubleSeconds(absl::Now() - t);
    Row(f,
        {{"bench", "catalog_publish"},
         {"durable", false},
         {"via", "http"},
         {"objects", n_http},
         {"per_sec", n_http / secs}},
        absl::StrFormat("publish ephemeral, over HTTP: %d in %.2f s = %.0f /s", n_http, secs,
                        n_http / secs));
  }

  // 5. The catalog on disk: publish rate with `objects` objects, then lookups over HTTP with all
  // of them in it, and durable publishes over HTTP (fsync each).
  {
    const std::string cat_dir = (dir / "catalog").string();
    auto cat = metadata::Catalog::Open(cat_dir, {.sync = false});
    if (!cat.ok()) return Fail(cat.status());
    const absl::Time t = absl::Now();
    for (uint64_t i = 0; i < f.objects; ++i) {
      auto r = (*cat)->Publish(absl::StrCat("bulk/", i), {{1, i % 4096, 4096}}, false);
      if (!r.ok()) return Fail(r.status());
    }
    const double secs = absl::ToDoubleSeconds(absl::Now() - t);
    cat->reset();
    Row(f,
        {{"bench", "catalog_publish"},
         {"durable", true},
         {"via", "catalog"},
         {"objects", f.objects},
         {"seconds", secs},
         {"per_sec", static_cast<double>(f.objects) / secs}},
        absl::StrFormat("publish durable, in process (no fsync): %d in %.1f s = %.0f /s", f.objects,
                        secs, static_cast<double>(f.objects) / secs));
    testing::FerrydProcess c;
    if (!Start(c, f, cat_dir)) return 1;
    httplib::Client cc(c.url);
    cc.set_keep_alive(true);
    cc.set_tcp_nodelay(true);
    std::vector<double> us;
    for (int i = 0; i < f.latency_iters; ++i) {
      const uint64_t k = (static_cast<uint64_t>(i) * 7919) % f.objects;
      const absl::Time s = absl::Now();
      auto r = cc.Get(("/v1/objects/bulk%2F" + std::to_string(k)).c_str());
      us.push_back(absl::ToDoubleMicroseconds(absl::Now() - s));
      if (!r || r->status != 200) return Fail(absl::UnavailableError("lookup failed"));
    }
    const int n_http = 2000;
    const absl::Time p = absl::Now();
    for (int i = 0; i < n_http; ++i) {
      cc.Put(("/v1/objects/http%2F" + std::to_string(i)).c_str(),
             R"({"extents":[{"region":1,"offset":0,"length":1}]})", "application/json");
    }
    const double http_secs = absl::ToDoubleSeconds(absl::Now() - p);
    Row(f,
        {{"bench", "catalog_lookup"},
         {"objects", f.objects},
         {"iters", f.latency_iters},
         {"p50_us", Percentile(us, 0.5)},
         {"p99_us", Percentile(us, 0.99)},
         {"http_publish_per_sec", n_http / http_secs}},
        absl::StrFormat("lookup over HTTP (kept connection) with %d objects: p50 %.0f us, p99 "
                        "%.0f us; publish durable over HTTP (fsync each): %.0f /s",
                        f.objects, Percentile(us, 0.5), Percentile(us, 0.99), n_http / http_secs));
  }
  e->reset();
  a.Stop();
  b.Stop();
  a.proc.reset();
  b.proc.reset();
  std::filesystem::remove_all(dir);
  return 0;
}

}  // namespace ferry::bench
