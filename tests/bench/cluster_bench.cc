// ferry-bench cluster: a 1 + N namespace bed (tests/testing/cluster_bed.h), one ferryd in each
// on its one shaped link; the source's object pulled once by one node (the baseline: what one
// pull takes over one link), then distributed to N = 1, 2, 4, 8 receivers (POST /v1/distribute),
// each receiver's copy dropped between rows.
#include "tests/bench/cluster_bench.h"

#include <httplib.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "nlohmann/json.hpp"
#include "tests/testing/cluster_bed.h"
#include "tests/testing/ferryd_process.h"

namespace ferry::bench {
namespace {

using json = nlohmann::json;

int Fail(const absl::Status& s) {
  std::cerr << "ferry-bench cluster: " << s << "\n";
  return 1;
}

absl::StatusOr<json> Post(httplib::Client& c, const std::string& path, const json& body) {
  auto r = c.Post(path, body.dump(), "application/json");
  if (!r) return absl::UnavailableError(absl::StrCat(path, ": no answer"));
  if (r->status != 200) return absl::UnavailableError(absl::StrCat(path, ": ", r->body));
  return json::parse(r->body, nullptr, false);
}

}  // namespace

int RunClusterBench(const ClusterFlags& f) {
  const size_t most = *std::max_element(f.receivers.begin(), f.receivers.end());
  auto bed = testing::ClusterBed::Create({.nodes = most + 1, .rate_mbit = f.rate_mbit});
  if (!bed.ok()) return Fail(bed.status());
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / absl::StrCat("ferry-bench-cluster-", getpid());
  std::filesystem::remove_all(dir);
  std::vector<testing::FerrydProcess> nodes;
  for (size_t i = 0; i <= most; ++i) {
    auto p =
        testing::StartFerrydAt((*bed)->Exec(i), (*bed)->Address(i), f.ferryd,
                               {"--provider", "tcp", "--domain", (*bed)->Interface(), "--rails",
                                "1", "--data-dir", (dir / absl::StrCat("n", i)).string()});
    if (!p.ok()) return Fail(p.status());
    nodes.push_back(std::move(*p));
  }
  auto client = [&](size_t i) {
    auto c = std::make_unique<httplib::Client>(nodes[i].url);
    c->set_read_timeout(900);
    c->set_write_timeout(900);
    c->set_keep_alive(true);
    return c;
  };
  // The object: random bytes, uploaded to node 0 (over this process's unshaped link).
  {
    std::string bytes(f.size, '\0');
    std::mt19937_64 rng(7);
    for (size_t i = 0; i + 8 <= bytes.size(); i += 8) {
      const uint64_t v = rng();
      std::memcpy(bytes.data() + i, &v, 8);
    }
    auto put = client(0)->Put("/v1/objects/weights/data", bytes, "application/octet-stream");
    if (!put || put->status / 100 != 2) {
      return Fail(absl::UnavailableError(
          absl::StrCat("upload: ", put ? put->body : std::string("no answer"))));
    }
  }
  auto drop = [&](size_t i) { client(i)->Delete("/v1/objects/weights"); };
  // Not timed: first contact between every node and the next (each pulls a small object from
  // the one before it), as between nodes of a running cluster.
  if (auto put = client(0)->Put("/v1/objects/hello/data", std::string(4096, 'h'),
                                "application/octet-stream");
      !put || put->status / 100 != 2) {
    return Fail(absl::UnavailableError("upload of the first-contact object failed"));
  }
  for (size_t i = 1; i <= most; ++i) {
    auto r = Post(*client(i), "/v1/pulls", {{"from", nodes[i - 1].url}, {"object", "hello"}});
    if (!r.ok()) return Fail(r.status());
  }
  // The baseline: node 1 pulls it from node 0 into a new buffer, the whole request timed.
  double one = 0;
  {
    const absl::Time t = absl::Now();
    auto r = Post(*client(1), "/v1/pulls", {{"from", nodes[0].url}, {"object", "weights"}});
    one = absl::ToDoubleSeconds(absl::Now() - t);
    if (!r.ok()) return Fail(r.status());
    drop(1);
  }
  if (!f.json) {
    std::printf(
        "# ferry-bench cluster: %llu bytes from node 0 to N receivers in a chain (POST "
        "/v1/distribute), 1 + %zu namespaces on a bridge, each link tbf %llu Mbit/s each way, one "
        "tcp rail per node; one pull = node 1 pulling it from node 0, %.3f s\n",
        static_cast<unsigned long long>(f.size), most, static_cast<unsigned long long>(f.rate_mbit),
        one);
    std::printf("%9s %12s %10s %10s %8s %7s %10s\n", "receivers", "bytes", "seconds", "one pull",
                "ratio", "chunks", "refetched");
  }
  for (size_t n : f.receivers) {
    json spec = {{"object", "weights"}, {"checksum", f.checksum}};
    json to = json::array();
    for (size_t i = 1; i <= n; ++i) to.push_back(nodes[i].url);
    spec["to"] = to;
    if (f.chunk != 0) spec["chunk_bytes"] = f.chunk;
    const absl::Time t = absl::Now();
    auto r = Post(*client(0), "/v1/distribute", spec);
    const double secs = absl::ToDoubleSeconds(absl::Now() - t);
    if (!r.ok() || r->is_discarded())
      return Fail(r.ok() ? absl::InternalError("bad answer") : r.status());
    uint64_t refetched = 0;
    std::vector<double> ends;          // when each receiver had every chunk, in chain order
    std::vector<std::string> skipped;  // upstreams given up on, and why
    for (const auto& rr : (*r)["receivers"]) {
      if (!rr.value("ok", false)) {
        return Fail(absl::InternalError(absl::StrCat("receiver ", rr.dump())));
      }
      refetched += rr.value("refetched_chunks", uint64_t{0});
      ends.push_back(rr.value("seconds", 0.0));
      for (const auto& s : rr.value("skipped", json::array())) skipped.push_back(s.dump());
    }
    const uint64_t chunks = (*r)["chunks"].get<uint64_t>();
    if (f.json) {
      std::cout << json{{"bench", "distribute"},    {"receivers", n},
                        {"bytes", f.size},          {"seconds", secs},
                        {"one_pull_seconds", one},  {"ratio", secs / one},
                        {"chunks", chunks},         {"refetched_chunks", refetched},
                        {"receiver_seconds", ends}, {"skipped", skipped},
                        {"rate_mbit", f.rate_mbit}}
                       .dump()
                << std::endl;
    } else {
      std::printf("%9zu %12llu %10.3f %10.3f %8.3f %7llu %10llu\n", n,
                  static_cast<unsigned long long>(f.size), secs, one, secs / one,
                  static_cast<unsigned long long>(chunks),
                  static_cast<unsigned long long>(refetched));
      std::printf("#   receivers done at (s):");
      for (double e : ends) std::printf(" %.2f", e);
      std::printf("\n");
      for (const std::string& why : skipped)
        std::printf("#   skipped an upstream: %s\n", why.c_str());
      std::fflush(stdout);
    }
    for (size_t i = 1; i <= n; ++i) drop(i);
  }
  nodes.clear();
  std::filesystem::remove_all(dir);
  return 0;
}

}  // namespace ferry::bench
