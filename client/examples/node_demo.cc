// ferry-demo: the main job on one machine. Starts five ferryd (own data dirs, embedded
// RocksDB) on loopback, D keeping the cluster's directory and the others joining it; uploads
// bytes to node A and publishes a non-contiguous object over them, makes node B pull it from A
// over RDMA WRITEs (libfabric tcp provider), then A distribute it to every other node of the
// directory at once, in a chain; kills A and has E, which deleted its copy, pull it by name
// from a replica; reads every copy back over REST, checks every byte, prints what happened and
// how fast, and stops the nodes.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <ostream>
#include <random>
#include <streambuf>
#include <string>
#include <string_view>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/status/statusor.h"
#include "absl/time/clock.h"
#include "ferry/client.h"
#include "nlohmann/json.hpp"

namespace {

// A ferryd child process; destroying it stops ferryd (SIGTERM, SIGKILL after 10 s).
class Ferryd {
 public:
  Ferryd() = default;
  Ferryd(const Ferryd&) = delete;
  Ferryd& operator=(const Ferryd&) = delete;
  ~Ferryd() {
    if (pid_ > 0) Stop();
  }
  // Starts `ferryd --listen 127.0.0.1:0 ...` on loopback with its own data folder and reads the
  // line it prints once it listens: {"listen":"127.0.0.1:PORT","node":"ID",...}.
  static absl::StatusOr<std::unique_ptr<Ferryd>> Start(const std::string& ferryd,
                                                       const std::string& dir, size_t rails,
                                                       const std::vector<std::string>& extra) {
    std::vector<std::string> args = {
        ferryd,     "--listen", "127.0.0.1:0", "--data-dir",         dir, "--provider", "tcp",
        "--domain", "lo",       "--rails",     std::to_string(rails)};
    args.insert(args.end(), extra.begin(), extra.end());
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    int out[2];
    if (pipe2(out, O_CLOEXEC) != 0) return absl::InternalError("pipe2 failed");
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, out[1], 1);
    auto f = std::make_unique<Ferryd>();
    const int rc = posix_spawn(&f->pid_, argv[0], &actions, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&actions);
    close(out[1]);
    if (rc != 0) {
      close(out[0]);
      f->pid_ = 0;
      return absl::InternalError(ferryd + ": " + std::strerror(rc));
    }
    // The first line, or nothing within 30 s (ferryd failed to start: it said why on stderr).
    std::string line;
    pollfd p = {out[0], POLLIN, 0};
    char c = 0;
    while (line.size() < 4096 && poll(&p, 1, 30000) == 1 && read(out[0], &c, 1) == 1 && c != '\n') {
      line.push_back(c);
    }
    close(out[0]);  // ferryd writes nothing more on stdout (its log goes to stderr)
    auto j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_discarded() || !j.contains("listen") || !j.contains("node")) {
      return absl::InternalError("ferryd did not start; it said: " + line);
    }
    f->url = "http://" + j["listen"].get<std::string>();
    f->id = j["node"].get<std::string>();
    return f;
  }
  // SIGTERM (or `signal`), then waits; the wait status (0 after a clean stop).
  int Stop(int signal = SIGTERM) {
    if (pid_ <= 0) return 0;
    kill(pid_, signal);
    int status = 0;
    for (int i = 0; i < 1000 && waitpid(pid_, &status, WNOHANG) == 0; ++i) usleep(10000);
    if (waitpid(pid_, &status, WNOHANG) == 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, &status, 0);
    }
    pid_ = 0;
    return status;
  }

  std::string url;  // http://127.0.0.1:PORT
  std::string id;   // the node id

 private:
  pid_t pid_ = 0;
};

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

double Gbps(uint64_t bytes, double s) {
  return s > 0 ? static_cast<double>(bytes) * 8 / s / 1e9 : 0;
}

// Reads `name` back from the node over REST, checking every byte against `want` as it comes;
// the seconds it took. kDataLoss: a byte differs.
absl::StatusOr<double> ReadBack(ferry::Client& c, const std::string& name, std::string_view want) {
  CompareBuf compare(want);
  std::ostream back(&compare);
  const absl::Time t = absl::Now();
  const absl::Status got = c.Get(name, back);
  if (!got.ok() && !compare.diverged()) return got;
  if (compare.diverged() || compare.matched() != want.size()) {
    return absl::DataLossError("the copy differs from A's object from byte " +
                               std::to_string(compare.matched()) + " on");
  }
  return absl::ToDoubleSeconds(absl::Now() - t);
}

// Waits (at most `limit`) until the directory, as `c`'s node sees it, says `holds(nodes)`.
bool AwaitCluster(ferry::Client& c, absl::Duration limit,
                  const std::function<bool(const std::vector<ferry::ClusterNode>&)>& holds) {
  const absl::Time deadline = absl::Now() + limit;
  while (absl::Now() < deadline) {
    auto nodes = c.Cluster();
    if (nodes.ok() && holds(*nodes)) return true;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return false;
}

bool Holds(const std::vector<ferry::ClusterNode>& nodes, const std::string& id,
           const std::string& name) {
  for (const ferry::ClusterNode& n : nodes) {
    if (n.id != id) continue;
    for (const auto& o : n.objects) {
      if (o.name == name) return true;
    }
  }
  return false;
}

bool Listed(const std::vector<ferry::ClusterNode>& nodes, const std::string& id) {
  return std::any_of(nodes.begin(), nodes.end(),
                     [&id](const ferry::ClusterNode& n) { return n.id == id; });
}

void PrintPull(const char* who, const char* how, const ferry::PullStats& p, double wall) {
  std::printf(
      "%s: %s over %s, %zu rails: %llu bytes in %.3f s on the wire = %.2f Gbit/s; %.3f s for the "
      "whole HTTP request (%.2f Gbit/s)\n",
      who, how, p.path.c_str(), p.bytes_per_rail.size(), static_cast<unsigned long long>(p.bytes),
      p.seconds, Gbps(p.bytes, p.seconds), wall, Gbps(p.bytes, wall));
}

}  // namespace

int main(int argc, char** argv) {
  uint64_t size = 256 << 20, piece = 64 << 10;
  size_t rails = 4;
  std::string ferryd;
  CLI::App app{
      "ferry demo: five ferryd on loopback with a directory; a non-contiguous object pulled from "
      "A, distributed to every node, then pulled by name"};
  app.add_option("--size", size, "object bytes")->capture_default_str();
  app.add_option("--piece", piece, "bytes per extent of the object's layout")
      ->capture_default_str();
  app.add_option("--rails", rails, "rails per node")->capture_default_str();
  app.add_option("--ferryd", ferryd, "path of ferryd (default: next to this program)");
  CLI11_PARSE(app, argc, argv);
  if (size == 0 || piece == 0 || size % piece != 0 || rails == 0) {
    std::fprintf(stderr, "--size must be a positive multiple of --piece; --rails positive\n");
    return 2;
  }
  if (ferryd.empty()) {
    ferryd = (std::filesystem::canonical("/proc/self/exe").parent_path().parent_path() / "server" /
              "ferryd")
                 .string();
  }
  const auto dir =
      std::filesystem::temp_directory_path() / ("ferry-demo-" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  // D keeps the directory; A, B and C join it with a 2 s lease, so that a node that dies leaves
  // it within 2 s.
  auto started_d = Ferryd::Start(ferryd, (dir / "d").string(), rails, {"--serve-directory"});
  if (!started_d.ok()) {
    std::fprintf(stderr, "cannot start ferryd: %s\n", started_d.status().ToString().c_str());
    return 1;
  }
  const std::unique_ptr<Ferryd> d = *std::move(started_d);
  const std::vector<std::string> join = {"--directory", d->url, "--directory-ttl-s", "2"};
  std::unique_ptr<Ferryd> started[4];
  const char* const joiners[] = {"a", "b", "c", "e"};
  for (int i = 0; i < 4; ++i) {
    auto n = Ferryd::Start(ferryd, (dir / joiners[i]).string(), rails, join);
    if (!n.ok()) {
      std::fprintf(stderr, "cannot start ferryd: %s\n", n.status().ToString().c_str());
      return 1;
    }
    started[i] = *std::move(n);
  }
  const std::unique_ptr<Ferryd>&a = started[0], &b = started[1], &c = started[2], &e = started[3];
  const std::map<std::string, std::string> names = {
      {a->url, "A"}, {b->url, "B"}, {c->url, "C"}, {d->url, "D"}, {e->url, "E"}};
  auto name_of = [&names](const std::string& url) {
    auto it = names.find(url);
    return it == names.end() ? url : it->second;
  };
  std::printf(
      "nodes A %s, B %s, C %s, E %s and D %s keeping the directory, on loopback (%zu tcp rails "
      "each, RocksDB catalogs in %s)\n",
      a->url.c_str(), b->url.c_str(), c->url.c_str(), e->url.c_str(), d->url.c_str(), rails,
      dir.c_str());
  auto ca = ferry::Client::Connect(a->url);
  auto cb = ferry::Client::Connect(b->url);
  auto cc = ferry::Client::Connect(c->url);
  auto cd = ferry::Client::Connect(d->url);
  auto ce = ferry::Client::Connect(e->url);
  int rc = 1;
  bool a_alive = true;
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
    if (!base.ok()) {
      std::fprintf(stderr, "put: %s\n", base.status().ToString().c_str());
      break;
    }
    const double put_s = absl::ToDoubleSeconds(absl::Now() - t);
    std::vector<ferry::Extent> layout;
    for (uint64_t off = 0; off < size; off += piece)
      layout.push_back({base->extents[0].region, off, piece});
    std::shuffle(layout.begin(), layout.end(), rng);
    auto obj = (*ca)->Publish("demo/kv-pages", layout);
    if (!obj.ok()) {
      std::fprintf(stderr, "publish: %s\n", obj.status().ToString().c_str());
      break;
    }
    std::printf(
        "A: uploaded %llu bytes over REST in %.2f s; published demo/kv-pages: %zu extents of %llu "
        "bytes in shuffled order\n",
        static_cast<unsigned long long>(size), put_s, layout.size(),
        static_cast<unsigned long long>(piece));
    std::string want;
    want.reserve(size);
    for (const ferry::Extent& x : layout) want.append(bytes, x.offset, x.length);
    // One pull: B from A, into a new buffer.
    t = absl::Now();
    auto pulled = (*cb)->Pull("demo/kv-pages", a->url);
    const double one_pull = absl::ToDoubleSeconds(absl::Now() - t);
    if (!pulled.ok()) {
      std::fprintf(stderr, "pull: %s\n", pulled.status().ToString().c_str());
      break;
    }
    PrintPull("B", "pull from A", *pulled, one_pull);
    auto read = ReadBack(**cb, "demo/kv-pages", want);
    if (!read.ok()) {
      std::printf("B: VERIFY FAILED: %s\n", read.status().ToString().c_str());
      break;
    }
    std::printf(
        "B: read back %zu bytes over REST in %.2f s; verified: every byte matches A's layout\n",
        want.size(), *read);

    // The cluster: A delivers it to every other node of the directory at once, in a chain (B
    // holds it already); each copy is checked.
    if (!AwaitCluster(**cd, absl::Seconds(10), [&](const auto& nodes) {
          return Listed(nodes, c->id) && Listed(nodes, d->id) && Listed(nodes, e->id);
        })) {
      std::fprintf(stderr, "the directory does not list every node\n");
      break;
    }
    ferry::DistributeSpec spread;
    spread.object = "demo/kv-pages";
    spread.all = true;
    auto dist = (*ca)->Distribute(spread);
    if (!dist.ok()) {
      std::fprintf(stderr, "distribute: %s\n", dist.status().ToString().c_str());
      break;
    }
    std::printf(
        "A: distributed demo/kv-pages (%llu chunks, CRC32C each) to every other node of the "
        "directory in %.3f s; one pull took %.3f s (%.2fx)\n",
        static_cast<unsigned long long>(dist->chunks), dist->seconds, one_pull,
        dist->seconds / one_pull);
    bool spread_ok = true;
    for (const ferry::ReceiverResult& rr : dist->receivers) {
      const std::string who = name_of(rr.url);
      if (!rr.status.ok()) {
        std::printf("%s: RECEIVE FAILED: %s\n", who.c_str(), rr.status.ToString().c_str());
        spread_ok = false;
        continue;
      }
      if (rr.held_already) {
        std::printf("%s: held it already\n", who.c_str());
        continue;
      }
      auto client = ferry::Client::Connect(rr.url);
      auto back = client.ok() ? ReadBack(**client, "demo/kv-pages", want)
                              : absl::StatusOr<double>(client.status());
      if (!back.ok()) {
        std::printf("%s: VERIFY FAILED: %s\n", who.c_str(), back.status().ToString().c_str());
        spread_ok = false;
        continue;
      }
      std::printf("%s: received it in %.3f s; verified every byte\n", who.c_str(), rr.seconds);
    }
    if (!spread_ok) break;

    // A dies; E, which lost its copy, pulls it by name from a replica.
    a->Stop(SIGKILL);
    a_alive = false;
    const absl::Time killed = absl::Now();
    std::printf("A: killed (SIGKILL)\n");
    if (absl::Status s = (*ce)->Remove("demo/kv-pages"); !s.ok()) {
      std::fprintf(stderr, "remove: %s\n", s.ToString().c_str());
      break;
    }
    std::printf("E: deleted its copy\n");
    t = absl::Now();
    auto by_name = (*ce)->Pull("demo/kv-pages", "", "", false);
    const double wall = absl::ToDoubleSeconds(absl::Now() - t);
    if (!by_name.ok()) {
      std::fprintf(stderr, "pull by name: %s\n", by_name.status().ToString().c_str());
      break;
    }
    PrintPull("E", ("pull by name, from replica " + name_of(by_name->source)).c_str(), *by_name,
              wall);
    for (const std::string& tried : by_name->tried)
      std::printf("E: tried first: %s\n", tried.c_str());
    read = ReadBack(**ce, "demo/kv-pages", want);
    if (!read.ok()) {
      std::printf("E: VERIFY FAILED: %s\n", read.status().ToString().c_str());
      break;
    }
    std::printf("E: verified every byte\n");
    if (!AwaitCluster(**cd, absl::Seconds(10), [&](const auto& nodes) {
          return !Listed(nodes, a->id) && Holds(nodes, b->id, "demo/kv-pages") &&
                 Holds(nodes, c->id, "demo/kv-pages") && Holds(nodes, d->id, "demo/kv-pages") &&
                 Holds(nodes, e->id, "demo/kv-pages");
        })) {
      std::fprintf(stderr,
                   "the directory does not show A gone and B, C, D, E holding 10 s after A "
                   "died\n");
      break;
    }
    std::printf(
        "directory: A gone %.1f s after it died (lease 2 s); B, C, D and E hold demo/kv-pages\n",
        absl::ToDoubleSeconds(absl::Now() - killed));
    rc = 0;
  } while (false);
  const int sa = a_alive ? a->Stop() : 0, sb = b->Stop(), sc = c->Stop(), se = e->Stop(),
            sd = d->Stop();
  std::printf("stopped the nodes (exit %d, %d, %d, %d, %d)\n", WEXITSTATUS(sa), WEXITSTATUS(sb),
              WEXITSTATUS(sc), WEXITSTATUS(se), WEXITSTATUS(sd));
  std::filesystem::remove_all(dir);
  return rc;
}
