// Embedding ferry: a trainer-like process publishes a layout over its own memory, and an
// inference-like process (here: a second embedded node in the same program) pulls it
// straight into its own memory over RDMA WRITEs (tcp provider on loopback).
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <vector>

#include "ferry/node.h"

int main() {
  auto dir = std::filesystem::temp_directory_path() / "ferry-embed-example";
  std::filesystem::remove_all(dir);
  ferry::EmbeddedNodeOptions a_opts{
      .data_dir = (dir / "a").string(), .domains = {"lo"}, .rails = 2};
  ferry::EmbeddedNodeOptions b_opts{
      .data_dir = (dir / "b").string(), .domains = {"lo"}, .rails = 2};
  auto trainer = ferry::EmbeddedNode::Start(a_opts);
  auto replica = ferry::EmbeddedNode::Start(b_opts);
  if (!trainer.ok() || !replica.ok()) {
    std::fprintf(stderr, "start: %s %s\n", trainer.status().ToString().c_str(),
                 replica.status().ToString().c_str());
    return 1;
  }
  // "Weights": 4 tensors of 1 MiB in one arena, published in a scattered order.
  std::vector<char> weights(4 << 20);
  for (size_t i = 0; i < weights.size(); ++i) weights[i] = static_cast<char>(i * 31 + 7);
  auto region = (*trainer)->Register(weights.data(), weights.size());
  const uint64_t mib = 1 << 20;
  auto published = (*trainer)->Publish("model/step-100", ferry::Layout({{*region, 3 * mib, mib},
                                                                        {*region, 0, mib},
                                                                        {*region, 2 * mib, mib},
                                                                        {*region, mib, mib}}));
  if (!published.ok()) {
    std::fprintf(stderr, "publish: %s\n", published.status().ToString().c_str());
    return 1;
  }
  // The replica pulls it into two buffers of its own.
  std::vector<char> first(2 * mib), second(2 * mib);
  auto r1 = (*replica)->Register(first.data(), first.size());
  auto r2 = (*replica)->Register(second.data(), second.size());
  auto pulled = (*replica)->PullInto((*trainer)->url(), "model/step-100",
                                     ferry::Layout({{*r1, 0, 2 * mib}, {*r2, 0, 2 * mib}}));
  if (!pulled.ok()) {
    std::fprintf(stderr, "pull: %s\n", pulled.status().ToString().c_str());
    return 1;
  }
  const bool ok = memcmp(first.data(), weights.data() + 3 * mib, mib) == 0 &&
                  memcmp(first.data() + mib, weights.data(), mib) == 0 &&
                  memcmp(second.data(), weights.data() + 2 * mib, mib) == 0 &&
                  memcmp(second.data() + mib, weights.data() + mib, mib) == 0;
  std::printf("pulled %llu bytes in %.4f s over %zu rails: %s\n",
              static_cast<unsigned long long>(pulled->bytes), pulled->seconds,
              pulled->bytes_per_rail.size(), ok ? "verified" : "WRONG BYTES");
  replica->reset();
  trainer->reset();
  std::filesystem::remove_all(dir);
  return ok ? 0 : 1;
}
