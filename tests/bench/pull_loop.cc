// ferry-pull-loop: the C++ side of tests/bench/python_bench.py. An embedded node pulls one
// object from --from into its own host memory --iters times, all of it or as pages, and prints
// one JSON line: the per-call time of ferry::EmbeddedNode::Pull, the baseline the Python
// package's per-call time is compared with.
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/time/clock.h"
#include "ferry/node.h"
#include "nlohmann/json.hpp"
#include "tests/bench/stats.h"

int main(int argc, char** argv) {
  CLI::App app{"ferry-pull-loop: time EmbeddedNode::Pull of one object"};
  std::string from, object, data_dir = "./ferry-pull-loop-data";
  uint64_t bytes = 4096, page = 0;
  int iters = 1000, warmup = 50;
  app.add_option("--from", from, "the source node")->required();
  app.add_option("--object", object, "the object to pull")->required();
  app.add_option("--bytes", bytes, "its size");
  app.add_option("--page", page, "pull into pages of this size, ids 0, 1, ... (0: one extent)");
  app.add_option("--iters", iters, "timed pulls");
  app.add_option("--warmup", warmup, "pulls before the timed ones");
  app.add_option("--data-dir", data_dir, "the node's catalog");
  CLI11_PARSE(app, argc, argv);

  auto node = ferry::EmbeddedNode::Start({.data_dir = data_dir, .sync = false});
  if (!node.ok()) {
    std::fprintf(stderr, "%s\n", node.status().ToString().c_str());
    return 1;
  }
  std::vector<char> dest(bytes);
  auto region = (*node)->Register(dest.data(), dest.size());
  if (!region.ok()) {
    std::fprintf(stderr, "%s\n", region.status().ToString().c_str());
    return 1;
  }
  ferry::PullSpec spec;
  spec.from = from;
  spec.object = object;
  if (page == 0) {
    spec.into.Add({*region, 0, bytes});
  } else {
    std::vector<uint32_t> ids(bytes / page);
    std::iota(ids.begin(), ids.end(), 0u);
    spec.into.AddPages(*region, 0, page, ids);
  }
  std::vector<double> us;
  for (int i = 0; i < warmup + iters; ++i) {
    const absl::Time start = absl::Now();
    auto r = (*node)->Pull(spec);
    if (!r.ok()) {
      std::fprintf(stderr, "%s\n", r.status().ToString().c_str());
      return 1;
    }
    if (i >= warmup) us.push_back(absl::ToDoubleMicroseconds(absl::Now() - start));
  }
  std::printf("%s\n", nlohmann::json{{"p50_us", ferry::bench::Median(us)},
                                     {"mean_us", std::accumulate(us.begin(), us.end(), 0.0) /
                                                     static_cast<double>(us.size())}}
                          .dump()
                          .c_str());
  return 0;
}
