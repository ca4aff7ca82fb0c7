// ferry-bench gpu: pulls of a GPU object between two ferryd processes (GPU A -> GPU B) with
// the same-host path and the forced staged path, next to cudaMemcpyPeer and the device-to-host
// copy rate measured in the same run.
#include "tests/bench/gpu_bench.h"

#include <cuda_runtime_api.h>
#include <httplib.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <numeric>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "engine/cuda.h"
#include "nlohmann/json.hpp"
#include "tests/bench/stats.h"
#include "tests/testing/ferryd_process.h"

namespace ferry::bench {
namespace {

using json = nlohmann::json;

// Seconds of `iters` runs of `fn` after one untimed run, median.
template <typename Fn>
double TimeIt(int iters, Fn fn) {
  fn();
  std::vector<double> t;
  for (int i = 0; i < iters; ++i) {
    const absl::Time start = absl::Now();
    fn();
    t.push_back(absl::ToDoubleSeconds(absl::Now() - start));
  }
  return Median(t);
}

bool CudaOk(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return true;
  std::cerr << what << ": " << cudaGetErrorName(e) << "\n";
  return false;
}

// cudaMemcpyPeer of `size` bytes from GPU `src` to GPU `dst` (or within one GPU), the
// device-to-pinned-host copy rate of GPU `src`, and for each piece count: ferry's batched
// copy alone (no node, no HTTP: CudaCopyPieces on GPU `dst` as a pull does it, the kernel
// reading over NVLink, and relayed through the copy engines between two GPUs) and what a
// program without ferry would do, a cudaMemcpyPeerAsync per piece on one stream: seconds,
// median.
struct Baselines {
  double peer = 0, d2h = 0;
  std::vector<double> pieces, relayed, peer_per_piece;  // per f.pieces
};
std::optional<Baselines> MeasureBaselines(int src, int dst, uint64_t size, int iters,
                                          const std::vector<uint64_t>& piece_counts) {
  void *a = nullptr, *b = nullptr, *h = nullptr;
  if (!CudaOk(cudaSetDevice(dst), "cudaSetDevice") || !CudaOk(cudaMalloc(&b, size), "cudaMalloc") ||
      !CudaOk(cudaSetDevice(src), "cudaSetDevice") || !CudaOk(cudaMalloc(&a, size), "cudaMalloc") ||
      !CudaOk(cudaMallocHost(&h, size), "cudaMallocHost")) {
    return std::nullopt;
  }
  if (src != dst) cudaDeviceEnablePeerAccess(dst, 0);
  cudaGetLastError();
  Baselines out;
  out.peer = TimeIt(iters, [&] {
    cudaMemcpyPeer(b, dst, a, src, size);
    cudaDeviceSynchronize();
  });
  out.d2h = TimeIt(iters, [&] { cudaMemcpy(h, a, size, cudaMemcpyDeviceToHost); });
  if (!engine::CudaEnablePeerAccess(dst, src).ok() ||
      !engine::CudaEnablePeerAccess(src, dst).ok()) {
    return std::nullopt;
  }
  for (uint64_t count : piece_counts) {
    std::vector<uint64_t> order(count);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), std::mt19937_64(3));
    const uint64_t piece = size / count;
    std::vector<engine::CopyPiece> copies;
    for (uint64_t i = 0; i < count; ++i) {
      copies.push_back({reinterpret_cast<uint64_t>(b) + order[i] * piece,
                        reinterpret_cast<uint64_t>(a) + i * piece, piece});
    }
    absl::Status copied;
    auto copy_from = [&](int src_device) {
      return TimeIt(iters, [&] {
        absl::Status s = engine::CudaCopyPieces(dst, copies, src_device);
        if (copied.ok()) copied = s;
      });
    };
    out.pieces.push_back(copy_from(-1));
    out.relayed.push_back(copy_from(src));
    cudaSetDevice(src);
    out.peer_per_piece.push_back(TimeIt(iters, [&] {
      for (const engine::CopyPiece& c : copies) {
        cudaMemcpyPeerAsync(reinterpret_cast<void*>(c.dst), dst,
                            reinterpret_cast<const void*>(c.src), src, c.length);
      }
      const cudaError_t e = cudaDeviceSynchronize();
      if (e != cudaSuccess && copied.ok()) {
        copied = absl::InternalError(absl::StrCat("cudaMemcpyPeerAsync: ", cudaGetErrorName(e)));
      }
    }));
    if (!copied.ok()) {
      std::cerr << "batched copy: " << copied << "\n";
      return std::nullopt;
    }
  }
  cudaFree(a);
  cudaFreeHost(h);
  cudaSetDevice(dst);
  cudaFree(b);
  return out;
}

uint64_t NewRegion(httplib::Client& c, const std::string& device, uint64_t size) {
  auto r =
      c.Post("/v1/regions", json{{"device", device}, {"size", size}}.dump(), "application/json");
  if (!r || r->status != 201) {
    std::cerr << "region on " << device << ": " << (r ? r->body : "no answer") << "\n";
    return 0;
  }
  return json::parse(r->body)["id"].get<uint64_t>();
}

// `count` pieces of size/count bytes at shuffled positions of a region of `size` bytes, in
// the compact extent form ([region, offset, length]).
json Scattered(uint64_t region, uint64_t size, uint64_t count, uint64_t seed) {
  std::vector<uint64_t> order(count);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), std::mt19937_64(seed));
  const uint64_t piece = size / count;
  json extents = json::array();
  for (uint64_t i : order) {
    extents.push_back(json::array({region, i * piece, piece}));
  }
  return extents;
}

}  // namespace

int RunGpuBench(const GpuFlags& f) {
  const int gpus = engine::CudaDeviceCount();
  if (gpus == 0) {
    std::cerr << "no GPU here\n";
    return 1;
  }
  const int src = 0, dst = gpus > 1 ? 1 : 0;
  const std::string src_dev = absl::StrCat("cuda:", src), dst_dev = absl::StrCat("cuda:", dst);
  auto base = MeasureBaselines(src, dst, f.size, f.iters, f.pieces);
  if (!base) return 1;

  const auto dir =
      std::filesystem::temp_directory_path() / ("ferry-bench-gpu-" + std::to_string(getpid()));
  std::filesystem::remove_all(dir);
  testing::FerrydProcess a, b;  // stopped (SIGTERM) when they go
  for (auto [d, name] : {std::pair<testing::FerrydProcess*, const char*>{&a, "a"}, {&b, "b"}}) {
    std::vector<std::string> args = {"--data-dir", (dir / name).string(),  "--provider", f.provider,
                                     "--rails",    std::to_string(f.rails)};
    if (f.provider == "tcp") args.insert(args.end(), {"--domain", "lo"});
    args.insert(args.end(), f.ferryd_args.begin(), f.ferryd_args.end());
    auto p = testing::StartFerryd(f.ferryd, args);
    if (!p.ok()) {
      std::cerr << p.status() << "\n";
      return 1;
    }
    *d = std::move(*p);
  }
  httplib::Client ca(a.url), cb(b.url);
  ca.set_read_timeout(600);
  cb.set_read_timeout(600);
  const double gb = static_cast<double>(f.size) / 1e9;
  auto row = [&](const json& j, const std::string& text) {
    if (f.json) {
      std::cout << j.dump() << std::endl;
    } else {
      std::printf("%s\n", text.c_str());
      std::fflush(stdout);
    }
  };
  row({{"bench", "gpu_baseline"},
       {"what", "cudaMemcpyPeer"},
       {"src", src_dev},
       {"dst", dst_dev},
       {"bytes", f.size},
       {"gb_per_sec", gb / base->peer}},
      absl::StrCat("cudaMemcpyPeer ", src_dev, " -> ", dst_dev, ": ", gb / base->peer, " GB/s"));
  row({{"bench", "gpu_baseline"},
       {"what", "d2h_pinned"},
       {"src", src_dev},
       {"bytes", f.size},
       {"gb_per_sec", gb / base->d2h}},
      absl::StrCat("cudaMemcpy ", src_dev, " -> pinned host: ", gb / base->d2h, " GB/s"));

  for (size_t i = 0; i < f.pieces.size(); ++i) {
    const uint64_t n = f.pieces[i];
    row({{"bench", "gpu_baseline"},
         {"what", "batched_copy"},
         {"pieces", n},
         {"piece_bytes", f.size / n},
         {"bytes", f.size},
         {"gb_per_sec", gb / base->pieces[i]}},
        absl::StrCat("CudaCopyPieces alone, ", n, " x ", f.size / n, " B shuffled, ", src_dev,
                     " -> ", dst_dev, ": ", gb / base->pieces[i], " GB/s"));
    row({{"bench", "gpu_baseline"},
         {"what", "batched_copy_relayed"},
         {"pieces", n},
         {"piece_bytes", f.size / n},
         {"bytes", f.size},
         {"gb_per_sec", gb / base->relayed[i]}},
        absl::StrCat("CudaCopyPieces alone, relayed through the copy engines, ", n, " x ",
                     f.size / n, " B shuffled, ", src_dev, " -> ", dst_dev, ": ",
                     gb / base->relayed[i], " GB/s"));
    row({{"bench", "gpu_baseline"},
         {"what", "memcpy_peer_per_piece"},
         {"pieces", n},
         {"piece_bytes", f.size / n},
         {"bytes", f.size},
         {"gb_per_sec", gb / base->peer_per_piece[i]}},
        absl::StrCat("cudaMemcpyPeerAsync per piece, ", n, " x ", f.size / n, " B shuffled, ",
                     src_dev, " -> ", dst_dev, ": ", gb / base->peer_per_piece[i], " GB/s"));
  }
  // The source region holds random bytes (an upload), so that every layout's pull can be
  // checked byte for byte.
  uint64_t src_region = 0;
  {
    std::string bytes(f.size, '\0');
    std::mt19937_64 rng(3);
    for (size_t i = 0; i + 8 <= bytes.size(); i += 8) {
      const uint64_t v = rng();
      std::memcpy(&bytes[i], &v, 8);
    }
    auto up = ca.Put(("/v1/objects/gpu-bytes/data?device=" + src_dev).c_str(), bytes,
                     "application/octet-stream");
    if (!up || up->status != 201) {
      std::cerr << "upload: " << (up ? up->body : "no answer") << "\n";
      return 1;
    }
    src_region = json::parse(up->body)["extents"][0]["region"].get<uint64_t>();
  }
  const uint64_t dst_region = NewRegion(cb, dst_dev, f.size);
  if (dst_region == 0) return 1;
  struct Layout {
    std::string name;
    uint64_t pieces;
    std::string path;
    bool prepared = false;  // into a destination prepared once (POST /v1/destinations)
  };
  // Where the rails carry GPU memory (FI_HMEM), the rdma path gets rows of its own.
  auto node = cb.Get("/v1/node");
  const bool hmem =
      node && node->status == 200 && json::parse(node->body)["rails"][0].value("hmem_cuda", false);
  std::vector<Layout> layouts;
  for (const char* path : {"auto", "rdma", "staged"}) {
    if (std::string(path) == "staged" && !f.staged) continue;
    if (std::string(path) == "rdma" && !hmem) continue;
    for (uint64_t pieces : f.pieces) {
      layouts.push_back({pieces == 1 ? "contiguous" : "scattered", pieces, path});
      // What a KV-cache migration does: the page layout travels once, each pull names it.
      if (pieces > 1 && std::string(path) == "auto") {
        layouts.push_back({"scattered", pieces, path, /*prepared=*/true});
      }
    }
  }
  bool mismatches = false;
  for (const Layout& l : layouts) {
    const std::string name = absl::StrCat("gpu-", l.pieces);
    auto put = ca.Put(("/v1/objects/" + name + "?replace=true").c_str(),
                      json{{"extents", Scattered(src_region, f.size, l.pieces, 1)}}.dump(),
                      "application/json");
    if (!put || put->status != 201) {
      std::cerr << "publish: " << (put ? put->body : "no answer") << "\n";
      return 1;
    }
    const json dst_extents = Scattered(dst_region, f.size, l.pieces, 2);
    json into = {{"extents", dst_extents}};
    uint64_t handle = 0;
    if (l.prepared) {
      auto d = cb.Post("/v1/destinations", into.dump(), "application/json");
      if (!d || d->status != 201) {
        std::cerr << "prepare: " << (d ? d->body : "no answer") << "\n";
        return 1;
      }
      handle = json::parse(d->body)["handle"].get<uint64_t>();
      into = {{"prepared", handle}};
    }
    const std::string body =
        json{{"from", a.url}, {"object", name}, {"path", l.path}, {"into", into}}.dump();
    std::vector<double> wall, copy;
    std::string path;
    const int iters = l.path == "auto" ? f.iters : std::max(1, f.iters / 2);
    for (int i = 0; i <= iters; ++i) {
      const absl::Time start = absl::Now();
      auto r = cb.Post("/v1/pulls", body, "application/json");
      const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
      if (!r || r->status != 200) {
        std::cerr << "pull: " << (r ? r->body : "no answer") << "\n";
        return 1;
      }
      auto stats = json::parse(r->body);
      path = stats["path"];
      if (i == 0) continue;  // the first pull opens the IPC mapping / warms the rails
      wall.push_back(seconds);
      copy.push_back(stats["seconds"].get<double>());
    }
    // What landed, read back through an object over B's extents, against the source object.
    auto landed = cb.Put("/v1/objects/gpu-landed?replace=true",
                         json{{"extents", dst_extents}}.dump(), "application/json");
    auto got = cb.Get("/v1/objects/gpu-landed/data");
    auto want = ca.Get(("/v1/objects/" + name + "/data").c_str());
    const bool read = landed && landed->status == 201 && got && want && got->status == 200 &&
                      want->status == 200 && got->body.size() == want->body.size();
    const bool match = read && got->body == want->body;
    cb.Delete("/v1/objects/gpu-landed");  // the next pull writes into these extents again
    if (handle != 0) cb.Delete(("/v1/destinations/" + std::to_string(handle)).c_str());
    if (!match) {
      mismatches = true;
      std::cerr << l.name << " " << l.pieces << " via " << path << ": ";
      if (!read) {
        std::cerr << "could not read the bytes back\n";
      } else {
        uint64_t first = 0, pages = 0;  // the first byte and the 4 KiB pages that differ
        for (uint64_t off = 0; off < got->body.size(); off += 4096) {
          const uint64_t n = std::min<uint64_t>(4096, got->body.size() - off);
          if (std::memcmp(got->body.data() + off, want->body.data() + off, n) == 0) continue;
          if (pages++ == 0) {
            first = off;
            while (got->body[first] == want->body[first]) ++first;
          }
        }
        std::cerr << pages << " of " << got->body.size() / 4096 << " 4 KiB pages differ, the "
                  << "first byte at " << first << "\n";
      }
    }
    const double w = gb / Median(wall), c = gb / Median(copy);
    const double vs_peer = base->peer / Median(wall);
    row({{"bench", "gpu_pull"},
         {"layout", l.name},
         {"pieces", l.pieces},
         {"piece_bytes", f.size / l.pieces},
         {"path", path},
         {"into", l.prepared ? "prepared" : "extents"},
         {"src", src_dev},
         {"dst", dst_dev},
         {"bytes", f.size},
         {"iters", iters},
         {"gb_per_sec", w},
         {"copy_gb_per_sec", c},
         {"vs_memcpy_peer", vs_peer},
         {"vs_d2h", base->d2h / Median(wall)},
         {"bytes_match", match}},
        absl::StrCat(l.name, " ", l.pieces, " x ", f.size / l.pieces, " B via ", path,
                     l.prepared ? " into a prepared destination" : "", ": ", w,
                     " GB/s end to end (", c, " GB/s copy), ", vs_peer, "x cudaMemcpyPeer, bytes ",
                     match ? "match" : "DIFFER"));
  }
  std::filesystem::remove_all(dir);
  return mismatches ? 1 : 0;
}

}  // namespace ferry::bench
