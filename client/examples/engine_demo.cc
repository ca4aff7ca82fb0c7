// ferry-engine-demo: the engine alone, two processes on one machine. This process is the
// destination: it registers a buffer, opens it to WRITEs, and asks a second process (forked
// before either has an engine) to move a non-contiguous object into a scattered layout of that
// buffer. The source WRITEs the bytes over libfabric (tcp on loopback by default); the
// destination checks every byte, and that none outside the layout changed, and prints what
// happened and how fast. The two talk over a pair of pipes, in the engine's own binary forms of
// a peer address and a region descriptor (wire/region.h).
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/time/clock.h"
#include "base/bytes.h"
#include "engine/engine.h"
#include "nlohmann/json.hpp"
#include "spdlog/sinks/stdout_color_sinks.h"
#include "spdlog/spdlog.h"
#include "wire/region.h"

namespace {

constexpr uint8_t kCanary = 0xa5;  // what the destination buffer holds outside the layout

struct Flags {
  std::string provider = "tcp";
  std::string domain = "lo";
  size_t rails = 4;
  uint64_t size = 256 << 20;
  uint64_t min_piece = 4096;
  uint64_t max_piece = 1 << 20;
  int repeat = 3;
};

// One piece of the object: where it is in the source's buffer and where it goes.
struct Piece {
  uint64_t src = 0, dst = 0, length = 0;
};

// The source's byte at offset `o` of its buffer.
uint8_t SourceByte(uint64_t o) { return static_cast<uint8_t>((o ^ (o >> 8) ^ (o >> 19)) * 131); }

// `size` bytes in pieces of min..max bytes, in order with gaps of up to 4 KiB in the source's
// buffer; shuffled, each at a 4 KiB boundary with a gap of at most 4 KiB before it, in the
// destination's. Sets the sizes of both buffers.
std::vector<Piece> MakeLayout(const Flags& f, std::mt19937_64& rng, uint64_t* src_size,
                              uint64_t* dst_size) {
  std::vector<Piece> pieces;
  std::uniform_int_distribution<uint64_t> length(f.min_piece, f.max_piece), gap(0, 4096);
  uint64_t at = 0;
  for (uint64_t left = f.size; left > 0;) {
    const uint64_t n = std::min(left, length(rng));
    pieces.push_back({at, 0, n});
    at += n + gap(rng);
    left -= n;
  }
  *src_size = at;
  std::vector<size_t> order(pieces.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::shuffle(order.begin(), order.end(), rng);
  at = 0;
  for (size_t i : order) {
    at = (at + gap(rng) + 4095) / 4096 * 4096;
    pieces[i].dst = at;
    at += pieces[i].length;
  }
  *dst_size = at;
  return pieces;
}

// Empty when `buf` holds every piece where it should and the canary everywhere else.
std::string Verify(const std::vector<Piece>& pieces, const uint8_t* buf, uint64_t size) {
  std::vector<Piece> by_dst = pieces;
  std::sort(by_dst.begin(), by_dst.end(),
            [](const Piece& a, const Piece& b) { return a.dst < b.dst; });
  uint64_t at = 0;
  auto canary_up_to = [&](uint64_t end) -> std::string {
    for (; at < end; ++at) {
      if (buf[at] != kCanary) return "byte " + std::to_string(at) + " outside the layout changed";
    }
    return "";
  };
  for (const Piece& p : by_dst) {
    if (std::string err = canary_up_to(p.dst); !err.empty()) return err;
    for (uint64_t i = 0; i < p.length; ++i) {
      if (buf[p.dst + i] != SourceByte(p.src + i)) {
        return "byte " + std::to_string(p.dst + i) + " is not source byte " +
               std::to_string(p.src + i);
      }
    }
    at = p.dst + p.length;
  }
  return canary_up_to(size);
}

// A frame on a pipe: its length (8 bytes, host order), then its bytes.
bool WriteFrame(int fd, const std::string& data) {
  std::string frame(8, '\0');
  const uint64_t n = data.size();
  memcpy(frame.data(), &n, 8);
  frame += data;
  for (size_t done = 0; done < frame.size();) {
    const ssize_t w = write(fd, frame.data() + done, frame.size() - done);
    if (w <= 0) return false;
    done += static_cast<size_t>(w);
  }
  return true;
}
bool ReadExactly(int fd, char* out, size_t n) {
  for (size_t done = 0; done < n;) {
    const ssize_t r = read(fd, out + done, n - done);
    if (r <= 0) return false;
    done += static_cast<size_t>(r);
  }
  return true;
}
bool ReadFrame(int fd, std::string* data) {
  uint64_t n = 0;
  if (!ReadExactly(fd, reinterpret_cast<char*>(&n), 8) || n > (1u << 30)) return false;
  data->resize(n);
  return ReadExactly(fd, data->data(), n);
}

std::unique_ptr<ferry::engine::Engine> MakeEngine(const Flags& f) {
  ferry::engine::EngineOptions o;
  o.provider = f.provider;
  if (!f.domain.empty()) o.domains = {f.domain};
  o.rails = f.rails;
  auto e = ferry::engine::Engine::Create(o);
  if (!e.ok()) {
    std::fprintf(stderr, "engine: %s\n", e.status().ToString().c_str());
    std::exit(1);
  }
  return *std::move(e);
}

// The source: reads the request (the destination's address and region, the layout and how
// many times), fills its buffer, WRITEs, and answers with the stats as JSON.
int RunSource(const Flags& f, int in, int out) {
  std::string request;
  if (!ReadFrame(in, &request)) return 1;
  ferry::ByteReader r(request);
  ferry::PeerAddress address;
  ferry::RegionDescriptor region;
  uint64_t src_size = 0, count = 0, repeat = 0;
  if (!ferry::Decode(r, &address).ok() || !ferry::Decode(r, &region).ok() || !r.U64(&src_size) ||
      !r.U64(&repeat) || !r.U64(&count)) {
    return 1;
  }
  auto engine = MakeEngine(f);
  std::vector<uint8_t> buf(src_size);
  for (uint64_t o = 0; o < src_size; ++o) buf[o] = SourceByte(o);
  nlohmann::json reply = {{"ok", false}};
  auto mine = engine->RegisterMemory(buf.data(), buf.size(), ferry::Device::Host());
  auto peer = engine->AddPeer(address, absl::Now() + absl::Seconds(30));
  if (!mine.ok() || !peer.ok()) {
    reply["error"] = (mine.ok() ? peer.status() : mine.status()).ToString();
    WriteFrame(out, reply.dump());
    return 1;
  }
  ferry::engine::TransferRequest t;
  t.peer = *peer;
  t.dst_regions = {region};
  for (uint64_t i = 0; i < count; ++i) {
    Piece p;
    if (!r.U64(&p.src) || !r.U64(&p.dst) || !r.U64(&p.length)) return 1;
    t.src.push_back({*mine, p.src, p.length});
    t.dst.push_back({0, p.dst, p.length});
  }
  nlohmann::json runs = nlohmann::json::array();
  for (uint64_t i = 0; i < repeat; ++i) {
    ferry::engine::TransferRequest one = t;
    one.deadline = absl::Now() + absl::Seconds(120);
    auto stats = engine->Write(std::move(one));
    if (!stats.ok()) {
      reply["error"] = stats.status().ToString();
      WriteFrame(out, reply.dump());
      return 1;
    }
    runs.push_back(stats->seconds);
    reply.update({{"ok", true},
                  {"writes", stats->writes},
                  {"bytes_per_rail", stats->bytes_per_rail},
                  {"runs", runs}});
  }
  return WriteFrame(out, reply.dump()) ? 0 : 1;
}

int RunDestination(const Flags& f, pid_t source, int to_source, int from_source) {
  std::mt19937_64 rng(static_cast<uint64_t>(absl::ToUnixNanos(absl::Now())));
  uint64_t src_size = 0, dst_size = 0;
  const std::vector<Piece> pieces = MakeLayout(f, rng, &src_size, &dst_size);
  auto engine = MakeEngine(f);
  std::vector<uint8_t> buf(dst_size, kCanary);
  auto region = engine->RegisterMemory(buf.data(), buf.size(), ferry::Device::Host());
  // The source may WRITE into the buffer while the window is open.
  auto window = region.ok() ? engine->OpenWindow(*region, 0, dst_size)
                            : absl::StatusOr<ferry::engine::Window>(region.status());
  if (!window.ok()) {
    std::fprintf(stderr, "register: %s\n", window.status().ToString().c_str());
    return 1;
  }
  std::printf("destination %s: %zu rails (%s, domain %s), buffer of %llu bytes registered\n",
              engine->node_id().c_str(), engine->rails().size(),
              engine->rails()[0].provider.c_str(), engine->rails()[0].domain.c_str(),
              static_cast<unsigned long long>(dst_size));
  std::printf(
      "source process %d: asked to move %llu bytes in %zu pieces (%llu B to %llu B) into as "
      "many scattered extents, %d times\n",
      static_cast<int>(source), static_cast<unsigned long long>(f.size), pieces.size(),
      static_cast<unsigned long long>(f.min_piece), static_cast<unsigned long long>(f.max_piece),
      f.repeat);
  std::string request;
  ferry::ByteWriter w(&request);
  ferry::Encode(engine->address(), w);
  ferry::Encode(window->descriptor, w);
  w.U64(src_size);
  w.U64(static_cast<uint64_t>(f.repeat));
  w.U64(pieces.size());
  for (const Piece& p : pieces) {
    w.U64(p.src);
    w.U64(p.dst);
    w.U64(p.length);
  }
  const absl::Time start = absl::Now();
  // WRITEs are coming until the source answers: the rails are polled meanwhile.
  ferry::engine::AwakeToken awake = engine->KeepAwake();
  std::string answer;
  const bool answered = WriteFrame(to_source, request) && ReadFrame(from_source, &answer);
  const double wall = absl::ToDoubleSeconds(absl::Now() - start);
  awake = ferry::engine::AwakeToken();
  const auto reply = nlohmann::json::parse(answered ? answer : "{}", nullptr, false);
  if (!reply.is_object() || !reply.value("ok", false)) {
    std::fprintf(stderr, "pull failed: %s\n",
                 answered ? reply.value("error", answer).c_str() : "the source did not answer");
    return 1;
  }
  int i = 0;
  for (const auto& run : reply["runs"]) {
    const double secs = run.get<double>();
    std::printf(
        "pull %d: %llu bytes in %llu WRITEs over %zu rails in %.3f s: %.2f GB/s (%.2f "
        "Gbit/s)\n",
        ++i, static_cast<unsigned long long>(f.size),
        static_cast<unsigned long long>(reply["writes"].get<uint64_t>()), f.rails, secs,
        static_cast<double>(f.size) / secs / 1e9, static_cast<double>(f.size) * 8 / secs / 1e9);
  }
  std::printf("%.3f s from the request to the answer, the source's start-up included\n", wall);
  std::printf("bytes per rail: %s\n", reply["bytes_per_rail"].dump().c_str());
  const std::string err = Verify(pieces, buf.data(), dst_size);
  if (!err.empty()) {
    std::printf("VERIFY FAILED: %s\n", err.c_str());
    return 1;
  }
  std::printf(
      "verified: every one of the %llu bytes is the right source byte, and no byte "
      "outside the extents changed\n",
      static_cast<unsigned long long>(f.size));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  spdlog::set_default_logger(spdlog::stderr_color_mt("ferry"));
  spdlog::set_level(spdlog::level::warn);
  Flags f;
  CLI::App app{"ferry engine demo: one process pulls a non-contiguous buffer from another"};
  app.add_option("--provider", f.provider, "tcp or shm");
  app.add_option("--domain", f.domain, "libfabric domain (lo for tcp, shm for shm)");
  app.add_option("--rails", f.rails, "rails per engine");
  app.add_option("--size", f.size, "bytes to move");
  app.add_option("--min-piece", f.min_piece, "smallest piece");
  app.add_option("--max-piece", f.max_piece, "largest piece");
  app.add_option("--repeat", f.repeat, "pulls of the same object (the first is cold)");
  CLI11_PARSE(app, argc, argv);
  if (f.size == 0 || f.min_piece == 0 || f.max_piece < f.min_piece || f.repeat < 1 ||
      f.rails == 0) {
    std::fprintf(stderr,
                 "--size, --min-piece, --max-piece, --repeat and --rails must be "
                 "positive, min <= max\n");
    return 2;
  }
  int down[2], up[2];  // destination -> source, source -> destination
  if (pipe(down) != 0 || pipe(up) != 0) return 1;
  const pid_t source = fork();
  if (source < 0) return 1;
  if (source == 0) {
    close(down[1]);
    close(up[0]);
    _exit(RunSource(f, down[0], up[1]));
  }
  close(down[0]);
  close(up[1]);
  const int rc = RunDestination(f, source, down[1], up[0]);
  close(down[1]);  // a source still waiting for a request reads the end and exits
  int status = 0;
  waitpid(source, &status, 0);
  return rc != 0 ? rc : (WIFEXITED(status) ? WEXITSTATUS(status) : 1);
}
