// ferry-demo: the main job on one machine. Starts two ferryd (own data dirs, embedded
// RocksDB) on loopback, uploads bytes to node A and publishes a non-contiguous object over
// them, makes node B pull it over RDMA WRITEs (libfabric tcp provider), reads it back from B
// over REST, checks every byte, prints what happened and how fast, and stops both nodes.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <ostream>
#include <random>
#include <streambuf>
#include <string>
#include <string_view>

#include "CLI/CLI.hpp"
#include "absl/time/clock.h"
#include "ferry/client.h"
#include "tests/testing/ferryd_process.h"

namespace {

absl::StatusOr<ferry::testing::FerrydProcess> StartFerryd(const std::string& ferryd,
                                                         const std::string& dir, size_t rails) {
  return ferry::testing::StartFerryd(ferryd, {"--data-dir", dir, "--provider", "tcp", "--domain",
                                              "lo", "--rails", std::to_string(rails)});
}

// An ostream sink that checks what is written against `want` as it arrives, instead of
// keeping a second copy: a 256 MiB ostringstream cost this machine 2.3-3.0 s of reallocations
// and first touches of memory, the GET itself 0.1-0.2 s.
class CompareBuf : public std::streambuf {
 public:
  explicit CompareBuf(std::string_view want) : want_(want) {}
  // Bytes that matched, up to the first that did not.
  size_t matched() const { return matched_; }
  // A written byte differed from `want` (or went past its end).
  bool diverged() const { return !ok_; }

 protected:
  std::streamsize xsputn(const char* s, std::streamsize n) override {
    if (!ok_) return 0;
    const size_t len = std::min(static_cast<size_t>(n), want_.size() - matched_);
    const char* want = want_.data() + matched_;
    const size_t same = static_cast<size_t>(std::mismatch(s, s + len, want).first - s);
    matched_ += same;
    if (same < static_cast<size_t>(n)) {
      ok_ = false;  // a byte differed, or one more than `want` has came
      return 0;     // the stream goes bad and the GET stops
    }
    return n;
  }
  int_type overflow(int_type c) override {
    if (traits_type::eq_int_type(c, traits_type::eof())) return traits_type::not_eof(c);
    const char ch = traits_type::to_char_type(c);
    return xsputn(&ch, 1) == 1 ? c : traits_type::eof();
  }

 private:
  std::string_view want_;
  size_t matched_ = 0;
  bool ok_ = true;
};

double Gbps(uint64_t bytes, double s) { return s > 0 ? static_cast<double>(bytes) * 8 / s / 1e9 : 0; }

}  // namespace

int main(int argc, char** argv) {
  uint64_t size = 256 << 20, piece = 64 << 10;
  size_t rails = 4;
  std::string ferryd;
  CLI::App app{"ferry demo: two ferryd on loopback; B pulls a non-contiguous object from A"};
  app.add_option("--size", size, "object bytes")->capture_default_str();
  app.add_option("--piece", piece, "bytes per extent of the object's layout")->capture_default_str();
  app.add_option("--rails", rails, "rails per node")->capture_default_str();
  app.add_option("--ferryd", ferryd, "path of ferryd (default: next to this program)");
  CLI11_PARSE(app, argc, argv);
  if (size == 0 || piece == 0 || size % piece != 0 || rails == 0) {
    std::fprintf(stderr, "--size must be a positive multiple of --piece; --rails positive\n");
    return 2;
  }
  if (ferryd.empty()) {
    ferryd = (std::filesystem::canonical("/proc/self/exe").parent_path().parent_path() / "server" /
              "ferryd").string();
  }
  const auto dir = std::filesystem::temp_directory_path() / ("ferry-demo-" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  auto a = StartFerryd(ferryd, (dir / "a").string(), rails);
  auto b = StartFerryd(ferryd, (dir / "b").string(), rails);
  if (!a.ok() || !b.ok()) {
    std::fprintf(stderr, "cannot start ferryd: %s %s\n", a.status().ToString().c_str(),
                 b.status().ToString().c_str());
    return 1;
  }
  std::printf("node A %s at %s, node B %s at %s (%zu tcp rails each, RocksDB catalogs in %s)\n",
              a->id.c_str(), a->url.c_str(), b->id.c_str(), b->url.c_str(), rails, dir.c_str());
  auto ca = ferry::Client::Connect(a->url);
  auto cb = ferry::Client::Connect(b->url);
  int rc = 1;
  do {
    // Bytes on A, and a layout over them: every piece of the buffer in a shuffled order.
    std::mt19937_64 rng(static_cast<uint64_t>(absl::ToUnixNanos(absl::Now())));
    std::string bytes(size, '\0');
    for (size_t i = 0; i < size; i += 8) {
      const uint64_t v = rng();
      memcpy(bytes.data() + i, &v, std::min<size_t>(8, size - i));
    }
    absl::Time t = absl::Now();
    auto base = (*ca)->Put("demo/base", bytes);
    if (!base.ok()) { std::fprintf(stderr, "put: %s\n", base.status().ToString().c_str()); break; }
    const double put_s = absl::ToDoubleSeconds(absl::Now() - t);
    std::vector<ferry::Extent> layout;
    for (uint64_t off = 0; off < size; off += piece) layout.push_back({base->extents[0].region, off, piece});
    std::shuffle(layout.begin(), layout.end(), rng);
    auto obj = (*ca)->Publish("demo/kv-pages", layout);
    if (!obj.ok()) { std::fprintf(stderr, "publish: %s\n", obj.status().ToString().c_str()); break; }
    std::printf("A: uploaded %llu bytes over REST in %.2f s; published demo/kv-pages: %zu extents of %llu bytes in shuffled order\n",
                static_cast<unsigned long long>(size), put_s, layout.size(),
                static_cast<unsigned long long>(piece));
    // B pulls it (twice: the first pull of a fresh buffer is the cold one).
    for (int i = 1; i <= 2; ++i) {
      t = absl::Now();
      auto pulled = (*cb)->Pull("demo/kv-pages", a->url, i == 1 ? "" : "demo/kv-pages", i > 1);
      const double wall = absl::ToDoubleSeconds(absl::Now() - t);
      if (!pulled.ok()) { std::fprintf(stderr, "pull: %s\n", pulled.status().ToString().c_str()); break; }
      std::printf("B: pull %d over %s, %zu rails: %llu bytes in %.3f s on the wire = %.2f Gbit/s; %.3f s for the whole HTTP request (%.2f Gbit/s)\n",
                  i, pulled->path.c_str(), pulled->bytes_per_rail.size(),
                  static_cast<unsigned long long>(pulled->bytes), pulled->seconds,
                  Gbps(pulled->bytes, pulled->seconds), wall, Gbps(pulled->bytes, wall));
    }
    // Read it back from B over REST and check every byte against the layout on A as it comes.
    std::string want;
    want.reserve(size);
    for (const ferry::Extent& e : layout) want.append(bytes, e.offset, e.length);
    CompareBuf compare(want);
    std::ostream back(&compare);
    t = absl::Now();
    const absl::Status got = (*cb)->Get("demo/kv-pages", back);
    const double get_s = absl::ToDoubleSeconds(absl::Now() - t);
    if (!got.ok() && !compare.diverged()) {
      std::fprintf(stderr, "get: %s\n", got.ToString().c_str());
      break;
    }
    if (compare.diverged() || compare.matched() != want.size()) {
      std::printf("VERIFY FAILED: B's copy differs from A's object from byte %zu on\n",
                  compare.matched());
      break;
    }
    std::printf("B: read back %zu bytes over REST in %.2f s; verified: every byte matches A's layout\n",
                compare.matched(), get_s);
    rc = 0;
  } while (false);
  const int sa = a->Stop(), sb = b->Stop();
  std::printf("stopped both nodes (exit %d, %d)\n", WEXITSTATUS(sa), WEXITSTATUS(sb));
  std::filesystem::remove_all(dir);
  return rc;
}
