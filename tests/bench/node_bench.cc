// ferry-bench node: the control plane's cost.
#include "tests/bench/node_bench.h"

#include <httplib.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <iostream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
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

bool Start(testing::FerrydProcess& d, const NodeFlags& f, const std::string& dir) {
  auto p = testing::StartFerryd(f.ferryd, {"--data-dir", dir, "--domain", "lo", "--rails",
                                           std::to_string(f.rails)});
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

// Creates a zero-filled region of `size` on `node` and returns its id.
// Times `iters` pulls (after `warmup` untimed ones) of a `size`-byte object that node A (ca)
// holds in a region of its own into a region of node B (cb): wall seconds of each
// POST /v1/pulls and the source engine's seconds for its WRITEs. The object and both regions
// are deleted afterwards.
struct PullTimes {
  std::vector<double> wall, engine;
};
absl::StatusOr<PullTimes> TimePulls(httplib::Client& ca, httplib::Client& cb,
                                    const std::string& a_url, uint64_t size, int warmup,
                                    int iters) {
  auto src_region = NewRegion(ca, size);
  auto dst_region = NewRegion(cb, size);
  if (!src_region.ok()) return src_region.status();
  if (!dst_region.ok()) return dst_region.status();
  const uint64_t src = *src_region, dst = *dst_region;
  const std::string name = "bench" + std::to_string(size);
  auto extent = [size](uint64_t region) {
    return json::array({{{"region", region}, {"offset", 0}, {"length", size}}});
  };
  ca.Put(("/v1/objects/" + name).c_str(), json{{"extents", extent(src)}}.dump(), "application/json");
  const std::string body =
      json{{"from", a_url}, {"object", name}, {"into", {{"extents", extent(dst)}}}}.dump();
  PullTimes out;
  for (int i = 0; i < warmup + iters; ++i) {
    const absl::Time t = absl::Now();
    auto r = cb.Post("/v1/pulls", body, "application/json");
    const double wall = absl::ToDoubleSeconds(absl::Now() - t);
    if (!r || r->status != 200) {
      return absl::UnavailableError("pull failed: " + (r ? r->body : std::string("no response")));
    }
    if (i < warmup) continue;
    out.wall.push_back(wall);
    out.engine.push_back(json::parse(r->body)["seconds"].get<double>());
  }
  ca.Delete(("/v1/objects/" + name).c_str());
  ca.Delete(("/v1/regions/" + std::to_string(src)).c_str());
  cb.Delete(("/v1/regions/" + std::to_string(dst)).c_str());
  return out;
}

}  // namespace

int RunNodeBench(const NodeFlags& f) {
  const auto dir = std::filesystem::temp_directory_path() / ("ferry-bench-node-" + std::to_string(getpid()));
  std::filesystem::remove_all(dir);
  testing::FerrydProcess a, b;  // stopped (SIGTERM) when they go
  if (!Start(a, f, (dir / "a").string()) || !Start(b, f, (dir / "b").string())) {
    std::cerr << "cannot start ferryd (" << f.ferryd << ")\n";
    return 1;
  }
  httplib::Client ca(a.url), cb(b.url);
  ca.set_read_timeout(300);
  cb.set_read_timeout(300);
  if (!f.json) {
    std::printf("# ferry-bench node: two ferryd on loopback, tcp provider, %zu rails each\n", f.rails);
  }

  // 1. Latency of a 4 KiB pull through HTTP: POST /v1/pulls on B into B's own extent.
  {
    auto times = TimePulls(ca, cb, a.url, 4096, 10, f.latency_iters);
    if (!times.ok()) {
      std::cerr << times.status() << "\n";
      return 1;
    }
    const double p50 = Percentile(times->wall, 0.5) * 1e6, p99 = Percentile(times->wall, 0.99) * 1e6;
    const double engine_p50 = Percentile(times->engine, 0.5) * 1e6;
    Row(f,
        {{"bench", "node_pull_latency"}, {"bytes", 4096}, {"iters", f.latency_iters},
         {"p50_us", p50}, {"p99_us", p99}, {"engine_p50_us", engine_p50}},
        absl::StrCat("pull 4 KiB through HTTP, ", f.latency_iters, " pulls: p50 ",
                     static_cast<int>(p50), " us, p99 ", static_cast<int>(p99),
                     " us (engine alone p50 ", static_cast<int>(engine_p50), " us)"));
  }

  // 2. Throughput through HTTP next to the engine's own time for the same WRITEs; the first
  // pull into fresh buffers is cold and not timed.
  if (!f.json) {
    std::printf("%12s %6s %12s %12s %12s %12s %7s\n", "bytes", "iters", "http s", "http MB/s",
                "engine s", "engine MB/s", "ratio");
  }
  for (uint64_t size : f.sizes) {
    auto times = TimePulls(ca, cb, a.url, size, 1, f.iters);
    if (!times.ok()) {
      std::cerr << times.status() << "\n";
      return 1;
    }
    const double hs = Percentile(times->wall, 0.5), es = Percentile(times->engine, 0.5);
    const double mb = static_cast<double>(size) / 1e6;
    char line[256];
    std::snprintf(line, sizeof(line), "%12llu %6d %12.5f %12.1f %12.5f %12.1f %7.2f",
                  static_cast<unsigned long long>(size), f.iters, hs, mb / hs, es, mb / es, es / hs);
    Row(f, {{"bench", "node_pull_throughput"}, {"bytes", size}, {"iters", f.iters},
            {"http_seconds", hs}, {"engine_seconds", es}, {"ratio", es / hs}},
        line);
  }

  // 3. Catalog: publish rate with `objects` objects, then lookup latency over HTTP with all of
  // them in the catalog.
  {
    const std::string cat_dir = (dir / "catalog").string();
    auto cat = metadata::Catalog::Open(cat_dir, {.sync = false});
    if (!cat.ok()) {
      std::cerr << cat.status() << "\n";
      return 1;
    }
    const absl::Time t = absl::Now();
    for (uint64_t i = 0; i < f.objects; ++i) {
      auto r = (*cat)->Publish(absl::StrCat("bulk/", i), {{1, i % 4096, 4096}}, false);
      if (!r.ok()) {
        std::cerr << r.status() << "\n";
        return 1;
      }
    }
    const double secs = absl::ToDoubleSeconds(absl::Now() - t);
    cat->reset();
    Row(f, {{"bench", "catalog_publish"}, {"objects", f.objects}, {"seconds", secs},
            {"per_sec", static_cast<double>(f.objects) / secs}},
        absl::StrCat("catalog publish (in process, no fsync): ", f.objects, " objects in ",
                     absl::StrFormat("%.1f", secs), " s = ",
                     static_cast<int64_t>(static_cast<double>(f.objects) / secs), " /s"));
    testing::FerrydProcess c;
    if (!Start(c, f, cat_dir)) return 1;
    httplib::Client cc(c.url);
    std::vector<double> us;
    for (int i = 0; i < f.latency_iters; ++i) {
      const uint64_t k = (static_cast<uint64_t>(i) * 7919) % f.objects;
      const absl::Time s = absl::Now();
      auto r = cc.Get(("/v1/objects/bulk%2F" + std::to_string(k)).c_str());
      us.push_back(absl::ToDoubleMicroseconds(absl::Now() - s));
      if (!r || r->status != 200) {
        std::cerr << "lookup failed\n";
        return 1;
      }
    }
    const int n_http = 2000;
    const absl::Time p = absl::Now();
    for (int i = 0; i < n_http; ++i) {
      cc.Put(("/v1/objects/http%2F" + std::to_string(i)).c_str(),
             R"({"extents":[{"region":1,"offset":0,"length":1}]})", "application/json");
    }
    const double http_secs = absl::ToDoubleSeconds(absl::Now() - p);
    Row(f,
        {{"bench", "catalog_lookup"}, {"objects", f.objects}, {"iters", f.latency_iters},
         {"p50_us", Percentile(us, 0.5)}, {"p99_us", Percentile(us, 0.99)},
         {"http_publish_per_sec", n_http / http_secs}},
        absl::StrCat("lookup over HTTP with ", f.objects, " objects: p50 ",
                     static_cast<int>(Percentile(us, 0.5)), " us, p99 ",
                     static_cast<int>(Percentile(us, 0.99)), " us; publish over HTTP (fsync each): ",
                     static_cast<int>(n_http / http_secs), " /s"));
  }
  a.Stop();
  b.Stop();
  a.proc.reset();
  b.proc.reset();
  std::filesystem::remove_all(dir);
  return 0;
}

}  // namespace ferry::bench
