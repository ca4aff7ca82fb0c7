// GPU objects end to end through two ferryd processes: every path, every byte verified.
// Needs a GPU (tests/gpu/run.sh runs it on the H200 machines); skips without one. With one
// GPU both nodes use GPU 0.
#include <gmock/gmock.h>
#include <httplib.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <numeric>
#include <random>
#include <vector>

#include "engine/cuda.h"
#include "nlohmann/json.hpp"
#include "tests/testing/ferryd_process.h"

namespace ferry {
namespace {

using json = nlohmann::json;
constexpr char kOctet[] = "application/octet-stream";
constexpr char kJson[] = "application/json";

std::string Ferryd() {
  const char* env = std::getenv("FERRYD");
  return env != nullptr ? env : FERRYD_PATH;
}

class GpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const int gpus = engine::CudaDeviceCount();
    if (gpus == 0) GTEST_SKIP() << "no GPU here";
    src_ = "cuda:0";
    dst_ = gpus > 1 ? "cuda:1" : "cuda:0";
    dir_ = std::filesystem::temp_directory_path() / ("ferry-gpu-test-" + std::to_string(getpid()));
    std::filesystem::remove_all(dir_);
    ASSERT_NO_FATAL_FAILURE(Start(a_, "a"));
    ASSERT_NO_FATAL_FAILURE(Start(b_, "b"));
  }
  // Starts `node` on tcp over lo, or on `provider` ("shm").
  void Start(testing::FerrydProcess& node, const std::string& name,
             const std::vector<std::string>& more = {}, const std::string& provider = "tcp") {
    // Small rings (4 x 256 KiB) so that the staged path wraps them many times.
    std::vector<std::string> args = {"--data-dir",
                                     (dir_ / name).string(),
                                     "--provider",
                                     provider,
                                     "--rails",
                                     "2",
                                     "--staging-slots",
                                     "4",
                                     "--staging-slot-kib",
                                     "256"};
    if (provider == "tcp") args.insert(args.end(), {"--domain", "lo"});
    args.insert(args.end(), more.begin(), more.end());
    auto p = testing::StartFerryd(Ferryd(), args);
    ASSERT_TRUE(p.ok()) << p.status();
    node = std::move(*p);
  }
  void TearDown() override {
    if (a_.proc) a_.Stop();
    if (b_.proc) b_.Stop();
    std::filesystem::remove_all(dir_);
  }
  httplib::Client Client(const testing::FerrydProcess& n) {
    httplib::Client c(n.url);
    c.set_read_timeout(300);
    return c;
  }
  // Uploads random bytes to `device` on `node` and publishes `name` as random pieces (1 B to
  // 64 KiB, shuffled, unaligned; or with `align` 16, 16 B to 256 KiB at multiples of 16, all
  // in the copy kernel's 16-byte words) of them; returns the object's bytes in order.
  std::string MakeObject(const testing::FerrydProcess& node, const std::string& device,
                         const std::string& name, uint64_t seed, uint64_t align = 1) {
    std::mt19937_64 rng(seed);
    std::string base(6 << 20, '\0');
    for (char& c : base) c = static_cast<char>(rng());
    auto c = Client(node);
    auto up = c.Put(("/v1/objects/" + name + "-base/data?device=" + device).c_str(), base, kOctet);
    EXPECT_TRUE(up && up->status == 201) << (up ? up->body : "no answer");
    if (!up || up->status != 201) return "";
    const uint64_t region = json::parse(up->body)["extents"][0]["region"];
    json extents = json::array();
    std::string expect;
    while (expect.size() < (3 << 20)) {
      const uint64_t len = align == 1 ? 1 + rng() % 65536 : align * (1 + rng() % (262144 / align));
      const uint64_t off = rng() % ((base.size() - len) / align) * align;
      extents.push_back({{"region", region}, {"offset", off}, {"length", len}});
      expect += base.substr(off, len);
    }
    auto pub = c.Put(("/v1/objects/" + name).c_str(), json{{"extents", extents}}.dump(), kJson);
    EXPECT_TRUE(pub && pub->status == 201) << (pub ? pub->body : "no answer");
    return expect;
  }
  // B pulls `name` from A into `into`, as `as`; returns the path the pull took.
  std::string Pull(const std::string& name, const json& into, const std::string& as,
                   const std::string& path = "auto") {
    auto r = Client(b_).Post("/v1/pulls",
                             json{{"from", a_.url},
                                  {"object", name},
                                  {"into", into},
                                  {"as", as},
                                  {"path", path},
                                  {"replace", true}}
                                 .dump(),
                             kJson);
    EXPECT_TRUE(r && r->status == 200) << (r ? r->body : "no answer");
    return r && r->status == 200 ? json::parse(r->body)["path"].get<std::string>() : "";
  }
  // Whether B's rails say they register GPU memory (FI_HMEM with CUDA in this libfabric).
  bool HmemOnRails() {
    auto node = json::parse(Client(b_).Get("/v1/node")->body);
    return !node["rails"].empty() && node["rails"][0]["hmem_cuda"].get<bool>();
  }
  // Where the rails cannot register GPU memory, a pull between GPU and host memory is staged;
  // where they say they can, it goes rdma, or staged after rdma failed (the stats say why).
  void ExpectStagedOrHmem(const std::string& path) {
    if (HmemOnRails()) {
      EXPECT_THAT(path, ::testing::AnyOf("rdma", "staged"));
    } else {
      EXPECT_EQ(path, "staged");
    }
  }
  std::string Read(const std::string& name) {
    return Client(b_).Get(("/v1/objects/" + name + "/data").c_str())->body;
  }
  // A region of `size` on `device` at B, cut into 1000-byte extents two apart.
  json Scattered(const std::string& device, uint64_t size) {
    auto r =
        Client(b_).Post("/v1/regions", json{{"device", device}, {"size", 2 * size}}.dump(), kJson);
    EXPECT_EQ(r->status, 201) << r->body;
    const uint64_t region = json::parse(r->body)["id"];
    json extents = json::array();
    for (uint64_t pos = 0; pos < size; pos += 1000) {
      extents.push_back({{"region", region},
                         {"offset", 2 * pos},
                         {"length", std::min<uint64_t>(1000, size - pos)}});
    }
    return extents;
  }

  std::string src_, dst_;
  std::filesystem::path dir_;
  testing::FerrydProcess a_, b_;
};

TEST_F(GpuTest, GpuToGpuOnOneHostTakesTheIpcPathIntoNewAndScatteredBuffers) {
  const std::string expect = MakeObject(a_, src_, "g", 1);
  ASSERT_FALSE(expect.empty());
  EXPECT_EQ(Pull("g", {{"device", dst_}}, "g1"), "cuda_ipc");
  EXPECT_TRUE(Read("g1") == expect);
  const json mine = Scattered(dst_, expect.size());
  EXPECT_EQ(Pull("g", {{"extents", mine}}, "unused"), "cuda_ipc");
  ASSERT_EQ(Client(b_).Put("/v1/objects/g2", json{{"extents", mine}}.dump(), kJson)->status, 201);
  EXPECT_TRUE(Read("g2") == expect);
  // The GPU buffer B allocated for g1 goes with it; the one B's client made stays.
  auto c = Client(b_);
  const uint64_t g1_region = json::parse(c.Get("/v1/objects/g1")->body)["extents"][0]["region"];
  ASSERT_EQ(c.Delete("/v1/objects/g1")->status, 200);
  EXPECT_EQ(c.Delete(("/v1/regions/" + std::to_string(g1_region)).c_str())->status, 404);
  ASSERT_EQ(c.Delete("/v1/objects/g2")->status, 200);
  const uint64_t made = mine[0]["region"];
  EXPECT_EQ(c.Delete(("/v1/regions/" + std::to_string(made)).c_str())->status, 200);
}

TEST_F(GpuTest, AlignedPiecesUpTo256KiBLandWhereTheyShould) {
  const std::string expect = MakeObject(a_, src_, "a", 5, 16);
  ASSERT_FALSE(expect.empty());
  EXPECT_EQ(Pull("a", {{"device", dst_}}, "a1"), "cuda_ipc");
  EXPECT_TRUE(Read("a1") == expect);
}

TEST_F(GpuTest, GpuAndHostMemoryMeetThroughTheStagedPath) {
  const std::string gpu = MakeObject(a_, src_, "g", 2);
  const std::string host = MakeObject(a_, "host", "h", 3);
  ASSERT_FALSE(gpu.empty());
  ASSERT_FALSE(host.empty());
  ExpectStagedOrHmem(Pull("g", {{"device", "host"}}, "g-host"));  // GPU -> host
  EXPECT_TRUE(Read("g-host") == gpu);
  ExpectStagedOrHmem(Pull("h", {{"device", dst_}}, "h-gpu"));  // host -> GPU
  EXPECT_TRUE(Read("h-gpu") == host);
  EXPECT_EQ(Pull("g", {{"extents", Scattered(dst_, gpu.size())}}, "x", "staged"), "staged");
  // Into host extents B registered: B first asks for rdma, A answers that its object is off
  // the rails, and B makes the pull again on the staged path.
  const json host_extents = Scattered("host", gpu.size());
  EXPECT_EQ(Pull("g", {{"extents", host_extents}}, "unused"), "staged");
  ASSERT_EQ(Client(b_)
                .Put("/v1/objects/g-into-host", json{{"extents", host_extents}}.dump(), kJson)
                ->status,
            201);
  EXPECT_TRUE(Read("g-into-host") == gpu);
  EXPECT_EQ(Pull("g", {{"device", dst_}}, "g-staged", "staged"), "staged");  // forced
  EXPECT_TRUE(Read("g-staged") == gpu);
}

TEST_F(GpuTest, NewVersionsPulledOverIpcTakeTheBufferOfTheVersionDropped) {
  const std::string expect = MakeObject(a_, src_, "g", 7);
  ASSERT_FALSE(expect.empty());
  b_.Stop();  // B again, keeping one version and the buffer of the one it drops
  auto p =
      testing::StartFerryd(Ferryd(), {"--data-dir", (dir_ / "b2").string(), "--domain", "lo",
                                      "--rails", "2", "--keep-versions", "1", "--spare-mb", "64"});
  ASSERT_TRUE(p.ok()) << p.status();
  b_ = std::move(*p);
  auto c = Client(b_);
  for (int i = 1; i <= 3; ++i) {
    SCOPED_TRACE(i);
    EXPECT_EQ(Pull("g", {{"device", dst_}}, "g"), "cuda_ipc");
    EXPECT_TRUE(Read("g") == expect);
    // After the second pull the first version's buffer is a spare; the third takes it.
    EXPECT_EQ(json::parse(c.Get("/v1/node")->body)["spare_bytes"], i == 1 ? 0u : expect.size());
  }
  EXPECT_EQ(json::parse(c.Get("/v1/regions")->body)["regions"].size(), 1u);
}

TEST_F(GpuTest, UploadsIntoGpuMemoryReadBackExactly) {
  std::mt19937_64 rng(6);
  std::string bytes((9 << 20) + 3, '\0');
  for (char& ch : bytes) ch = static_cast<char>(rng());
  auto c = Client(a_);
  // With a Content-Length the body is copied to the GPU as it arrives, 4 MiB at a time;
  // chunked, it is read whole and copied at once.
  auto sized = c.Put(("/v1/objects/up-sized/data?device=" + src_).c_str(), bytes, kOctet);
  ASSERT_EQ(sized->status, 201) << sized->body;
  auto chunked = c.Put(("/v1/objects/up-chunked/data?device=" + src_).c_str(),
                       [&](size_t offset, httplib::DataSink& sink) {
                         const size_t n = std::min<size_t>(1 << 20, bytes.size() - offset);
                         sink.write(bytes.data() + offset, n);
                         if (offset + n == bytes.size()) sink.done();
                         return true;
                       },
                       kOctet);
  ASSERT_EQ(chunked->status, 201) << chunked->body;
  for (const char* name : {"up-sized", "up-chunked"}) {
    SCOPED_TRACE(name);
    auto d = json::parse(c.Get(("/v1/objects/" + std::string(name)).c_str())->body);
    EXPECT_EQ(d["devices"], json::array({src_}));
    EXPECT_TRUE(c.Get(("/v1/objects/" + std::string(name) + "/data").c_str())->body == bytes);
  }
}

TEST_F(GpuTest, WhatCannotWorkIsRefusedWithItsReason) {
  ASSERT_FALSE(MakeObject(a_, src_, "g", 4).empty());
  auto c = Client(b_);
  const bool hmem = HmemOnRails();
  auto rdma =
      c.Post("/v1/pulls", json{{"from", a_.url}, {"object", "g"}, {"path", "rdma"}}.dump(), kJson);
  if (!hmem) {
    // A libfabric that cannot register GPU memory (Debian's): a forced rdma path is refused.
    EXPECT_EQ(rdma->status, 409) << rdma->body;
    EXPECT_THAT(rdma->body, ::testing::HasSubstr("not on the rails"));
    EXPECT_EQ(c.Get("/v1/objects/g")->status, 404);  // nothing published
  } else if (rdma->status != 200) {
    // One that says it can, and then fails the WRITEs: a forced path is not changed behind
    // the caller's back; the reason is given.
    EXPECT_EQ(rdma->status, 400) << rdma->body;
    EXPECT_THAT(rdma->body, ::testing::HasSubstr("failed with GPU memory on the rails"));
    EXPECT_EQ(c.Get("/v1/objects/g")->status, 404);
  }
  auto gone = c.Post("/v1/regions", R"({"device":"cuda:99","size":4096})", kJson);
  EXPECT_EQ(gone->status, 404);
  EXPECT_THAT(gone->body, ::testing::HasSubstr("no GPU cuda:99"));
  EXPECT_EQ(c.Put("/v1/objects/x/data?device=cuda:99", "abc", kOctet)->status, 404);
  // Every rail reports whether it reaches GPU memory, with the provider's reason if not.
  auto node = json::parse(c.Get("/v1/node")->body);
  ASSERT_FALSE(node["rails"].empty());
  EXPECT_EQ(node["rails"][0]["hmem_cuda"].get<bool>(), hmem) << node;
  if (!hmem) {
    EXPECT_FALSE(node["rails"][0]["hmem_cuda_error"].get<std::string>().empty()) << node;
  }
  EXPECT_THAT(node["devices"].dump(), ::testing::HasSubstr("cuda:0"));
}

// A provider that registers GPU memory and then fails to move it (the source's WRITEs from GPU
// memory refused, as libfabric 2.6's shm did on an endpoint without FI_HMEM): a pull that
// chose rdma by itself is made again on the staged path, completes byte for byte, and says
// why; one that asked for rdma by name gets the reason; pulls after it still work.
TEST_F(GpuTest, AProviderThatFailsGpuWritesEndsInAStagedPullThatCompletes) {
  std::string provider = "tcp";
  if (!HmemOnRails()) {  // shm may carry it where tcp does not
    provider = "shm";
    b_.Stop();
    ASSERT_NO_FATAL_FAILURE(Start(b_, "b", {}, provider));
    if (!HmemOnRails()) GTEST_SKIP() << "no rails here carry GPU memory (no FI_HMEM with CUDA)";
  }
  a_.Stop();
  ASSERT_NO_FATAL_FAILURE(Start(a_, "a", {"--test-fail-gpu-writes"}, provider));
  const std::string gpu = MakeObject(a_, src_, "g", 6);
  const std::string host = MakeObject(a_, "host", "h", 7);
  ASSERT_FALSE(gpu.empty());
  ASSERT_FALSE(host.empty());
  auto c = Client(b_);
  for (int i = 0; i < 2; ++i) {  // the second one meets whatever the first left behind
    const std::string as = "g-host-" + std::to_string(i);
    auto r = c.Post(
        "/v1/pulls",
        json{{"from", a_.url}, {"object", "g"}, {"as", as}, {"into", {{"device", "host"}}}}.dump(),
        kJson);
    ASSERT_TRUE(r && r->status == 200) << (r ? r->body : "no answer");
    const json stats = json::parse(r->body);
    EXPECT_EQ(stats["path"], "staged") << stats;
    EXPECT_THAT(stats.value("fallback", ""),
                ::testing::HasSubstr("failed with GPU memory on the rails"));
    EXPECT_TRUE(Read(as) == gpu);
  }
  auto forced = c.Post("/v1/pulls",
                       json{{"from", a_.url},
                            {"object", "g"},
                            {"as", "g-rdma"},
                            {"into", {{"device", "host"}}},
                            {"path", "rdma"}}
                           .dump(),
                       kJson);
  EXPECT_EQ(forced->status, 400) << forced->body;
  EXPECT_THAT(forced->body, ::testing::HasSubstr("failed with GPU memory on the rails"));
  EXPECT_EQ(c.Get("/v1/objects/g-rdma")->status, 404);
  // Host memory still goes rdma on the same rails: none was taken down for GPU memory.
  EXPECT_EQ(Pull("h", {{"device", "host"}}, "h-host"), "rdma");
  EXPECT_TRUE(Read("h-host") == host);
}

// Between two GPUs the batched copy relays small pieces through staging on both GPUs, 16 MiB
// windows in a ring of four: 200 MiB of pieces from 1 B to 2 MiB, with one of 64 MiB that the
// copy engines take by itself, shuffled on the source, wrap the ring three times. Twice, so
// that the second copy reuses the first one's relay.
TEST(GpuCopyTest, PiecesRelayedBetweenTwoGpusLandWhereTheyShould) {
  if (engine::CudaDeviceCount() < 2) GTEST_SKIP() << "needs two GPUs";
  constexpr uint64_t kSize = uint64_t{200} << 20;
  std::mt19937_64 rng(7);
  std::string bytes(kSize, '\0');
  for (uint64_t i = 0; i < kSize; i += 8) {
    const uint64_t r = rng();
    std::memcpy(bytes.data() + i, &r, 8);
  }
  std::vector<uint64_t> lengths;
  for (uint64_t total = 0; total < kSize;) {
    const uint64_t len =
        std::min(kSize - total, lengths.size() == 10 ? uint64_t{64} << 20 : 1 + rng() % (2 << 20));
    lengths.push_back(len);
    total += len;
  }
  std::vector<uint64_t> order(lengths.size());
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  std::vector<uint64_t> src_at(lengths.size());
  for (uint64_t at = 0; uint64_t i : order) {
    src_at[i] = at;
    at += lengths[i];
  }
  auto src = engine::CudaAlloc(0, kSize);
  ASSERT_TRUE(src.ok()) << src.status();
  ASSERT_TRUE(engine::CudaCopy(*src, bytes.data(), kSize).ok());
  std::string expect;
  expect.reserve(kSize);
  for (size_t i = 0; i < lengths.size(); ++i) expect += bytes.substr(src_at[i], lengths[i]);
  for (int round = 0; round < 2; ++round) {
    auto dst = engine::CudaAlloc(1, kSize);
    ASSERT_TRUE(dst.ok()) << dst.status();
    std::vector<engine::CopyPiece> pieces;
    for (uint64_t at = 0, i = 0; i < lengths.size(); at += lengths[i++]) {
      pieces.push_back({reinterpret_cast<uint64_t>(*dst) + at,
                        reinterpret_cast<uint64_t>(*src) + src_at[i], lengths[i]});
    }
    ASSERT_TRUE(engine::CudaCopyPieces(1, pieces, 0).ok());
    std::string got(kSize, '\0');
    ASSERT_TRUE(engine::CudaCopy(got.data(), *dst, kSize).ok());
    EXPECT_TRUE(got == expect) << "round " << round;
    engine::CudaFree(*dst);
  }
  engine::CudaFree(*src);
}

}  // namespace
}  // namespace ferry
