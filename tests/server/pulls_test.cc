// Pulls between nodes in this process (ferry::EmbeddedNode, real engines on tcp): the
// control messages over the fabric, layouts in every form, prepared destinations, partial,
// async and batched pulls, cancel, and ephemeral objects.
#include <gmock/gmock.h>
#include <unistd.h>

#include <filesystem>
#include <numeric>
#include <random>

#include "absl/strings/str_cat.h"
#include "engine/fabric.h"
#include "ferry/node.h"
#include "tests/testing/status_matchers.h"

namespace ferry {
namespace {

using ::ferry::testing::StatusIs;

// A host buffer of `size` bytes, its byte i the low byte of i * 7 + seed (zeroed with
// `fill` false).
struct Buffer {
  Buffer(size_t size, uint8_t seed, bool fill = true) : bytes(size) {
    if (fill) {
      for (size_t i = 0; i < size; ++i) bytes[i] = static_cast<char>(i * 7 + seed);
    }
  }
  char* data() { return bytes.data(); }
  std::vector<char> bytes;
};

class PullsTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (!engine::ProviderAvailable(GetParam())) GTEST_SKIP() << "no " << GetParam() << " provider";
    dir_ = std::filesystem::temp_directory_path() / absl::StrCat("pulls-test-", getpid());
    std::filesystem::remove_all(dir_);
    ASSERT_OK_AND_ASSIGN(a_, Start("a"));
    ASSERT_OK_AND_ASSIGN(b_, Start("b"));
  }
  void TearDown() override {
    b_.reset();
    a_.reset();
    std::filesystem::remove_all(dir_);
  }
  absl::StatusOr<std::unique_ptr<EmbeddedNode>> Start(const std::string& name,
                                                      const std::string& listen = "127.0.0.1:0",
                                                      const std::string& transport = "auto") {
    EmbeddedNodeOptions o;
    o.listen = listen;
    o.peer_transport = transport;
    o.data_dir = (dir_ / name).string();
    o.provider = GetParam();
    o.domains = {GetParam() == "tcp" ? "lo" : "shm"};
    o.rails = 2;
    o.sync = false;
    return EmbeddedNode::Start(o);
  }
  // Pulls `object` from A into `into` (B's memory).
  absl::StatusOr<PullStats> PullInto(const std::string& object, const Layout& into) {
    return b_->PullInto(a_->url(), object, into);
  }

  std::filesystem::path dir_;
  std::unique_ptr<EmbeddedNode> a_, b_;
};

// The bytes `layout` (over `buf`, region `region`) takes, in order.
std::string Gather(const Layout& layout, const char* buf) {
  std::string out;
  layout.ForEach([&](const Extent& e) { out.append(buf + e.offset, e.length); });
  return out;
}

TEST_P(PullsTest, RandomLayoutsInEveryFormArriveByteForByteOverTheFabric) {
  std::mt19937_64 rng(11);
  Buffer src(4 << 20, 3);
  ASSERT_OK_AND_ASSIGN(uint64_t sr, a_->Register(src.data(), src.bytes.size()));
  for (int round = 0; round < 8; ++round) {
    SCOPED_TRACE(absl::StrCat("round ", round));
    // The object: random extents, a strided run and pages of 4 KiB, mixed.
    Layout object;
    uint64_t bytes = 0;
    for (int i = 0; i < 5; ++i) {
      const uint64_t len = 1 + rng() % 20000;
      object.Add({sr, rng() % (src.bytes.size() - len), len});
      bytes += len;
    }
    object.AddStrided(sr, 1 << 20, 1000 + rng() % 1000, 4096, 64);
    std::vector<uint32_t> pages(32);
    std::iota(pages.begin(), pages.end(), 0);
    std::shuffle(pages.begin(), pages.end(), rng);
    object.AddPages(sr, 2 << 20, 4096, pages);
    bytes = object.bytes();
    const std::string name = absl::StrCat("o", round);
    ASSERT_OK(a_->Publish(name, object).status());
    // The destination: pages of 512 bytes of a pool, shuffled (from page 8 on: the window
    // starts after the pool does), four strided pieces, then the rest as one extent.
    Buffer dst(8 << 20, 0, /*fill=*/false);
    ASSERT_OK_AND_ASSIGN(uint64_t dr, b_->Register(dst.data(), dst.bytes.size()));
    std::vector<uint32_t> slots(bytes / 512 - 4);
    std::iota(slots.begin(), slots.end(), 8);
    std::shuffle(slots.begin(), slots.end(), rng);
    Layout into;
    into.AddPages(dr, 0, 512, slots);
    into.AddStrided(dr, 7 << 20, 512, 1024, 4);
    into.Add({dr, 6 << 20, bytes - into.bytes()});
    ASSERT_OK_AND_ASSIGN(PullStats stats, PullInto(name, into));
    EXPECT_EQ(stats.bytes, bytes);
    EXPECT_EQ(stats.via, "fabric");
    EXPECT_EQ(stats.path, "rdma");
    EXPECT_TRUE(Gather(into, dst.data()) == Gather(object, src.data()));
    // Another object of as many bytes into the same layout: the layout goes by its number.
    const Layout whole({{sr, 3 << 20, bytes}});
    ASSERT_OK(a_->Publish(name + "w", whole).status());
    ASSERT_OK_AND_ASSIGN(stats, PullInto(name + "w", into));
    EXPECT_EQ(stats.bytes, bytes);
    EXPECT_TRUE(Gather(into, dst.data()) == Gather(whole, src.data()));
    ASSERT_OK(b_->Unregister(dr));
  }
}

TEST_P(PullsTest, CompactDestinationsOutOfBoundsOrOverlappingAreRefusedBeforeAnyByteMoves) {
  Buffer src(64 << 10, 4);
  ASSERT_OK_AND_ASSIGN(uint64_t sr, a_->Register(src.data(), src.bytes.size()));
  ASSERT_OK(a_->Publish("p", Layout({{sr, 0, 16384}})).status());
  Buffer dst(16384, 0, /*fill=*/false);
  ASSERT_OK_AND_ASSIGN(uint64_t dr, b_->Register(dst.data(), dst.bytes.size()));
  using ::testing::HasSubstr;
  const auto kBad = absl::StatusCode::kInvalidArgument;
  // Page 4 of 4 KiB is past the region's 16 KiB: named.
  EXPECT_THAT(PullInto("p", Layout().AddPages(dr, 0, 4096, {0, 4, 1, 2})),
              StatusIs(kBad, HasSubstr("[16384, +4096) is empty or outside region")));
  EXPECT_THAT(PullInto("p", Layout().AddPages(dr, 0, 4096, {0, 1, 1, 2})),
              StatusIs(kBad, HasSubstr("overlap")));
  EXPECT_THAT(PullInto("p", Layout().AddStrided(dr, 0, 8192, 4096, 2)),
              StatusIs(kBad, HasSubstr("overlap")));
  // An end past 2^64.
  EXPECT_THAT(PullInto("p", Layout().AddStrided(dr, 0, 4096, uint64_t{1} << 63, 4)),
              StatusIs(kBad, HasSubstr("outside region")));
  EXPECT_TRUE(std::all_of(dst.bytes.begin(), dst.bytes.end(), [](char c) { return c == 0; }));
  // Two page tables over one pool, apart: the bytes arrive.
  const Layout apart = Layout().AddPages(dr, 0, 4096, {3, 1}).AddPages(dr, 0, 4096, {0, 2});
  ASSERT_OK(PullInto("p", apart).status());
  EXPECT_TRUE(Gather(apart, dst.data()) == std::string(src.data(), 16384));
}

TEST_P(PullsTest, PartsOfAnObjectAtTheEdgesAndBadPartsGetTheirCodes) {
  Buffer src(1 << 20, 5);
  ASSERT_OK_AND_ASSIGN(uint64_t sr, a_->Register(src.data(), src.bytes.size()));
  // Three extents: bytes [100, 1100), [5000, 5100), [0, 10).
  ASSERT_OK(a_->Publish("w", Layout({{sr, 100, 1000}, {sr, 5000, 100}, {sr, 0, 10}})).status());
  Buffer dst(4096, 0, false);
  ASSERT_OK_AND_ASSIGN(uint64_t dr, b_->Register(dst.data(), dst.bytes.size()));
  auto part = [&](uint64_t offset, uint64_t length) {
    PullSpec s;
    s.from = a_->url();
    s.object = "w";
    s.range_offset = offset;
    s.range_length = length;
    s.into = Layout({{dr, 0, length}});
    return b_->Pull(s);
  };
  ASSERT_OK(part(0, 1).status());
  EXPECT_EQ(dst.bytes[0], src.bytes[100]);
  ASSERT_OK(part(1109, 1).status());  // the object's last byte
  EXPECT_EQ(dst.bytes[0], src.bytes[9]);
  ASSERT_OK(part(999, 2).status());  // across two extents
  EXPECT_EQ(dst.bytes[0], src.bytes[1099]);
  EXPECT_EQ(dst.bytes[1], src.bytes[5000]);
  ASSERT_OK(part(0, 1110).status());  // all of it
  EXPECT_THAT(part(1110, 1), StatusIs(absl::StatusCode::kOutOfRange));
  EXPECT_THAT(part(1100, 11), StatusIs(absl::StatusCode::kOutOfRange));
  // Extents by index, in the order asked for.
  PullSpec s;
  s.from = a_->url();
  s.object = "w";
  s.source_extents = {2, 1};
  s.into = Layout({{dr, 0, 110}});
  ASSERT_OK(b_->Pull(s).status());
  EXPECT_TRUE(std::equal(dst.bytes.begin(), dst.bytes.begin() + 10, src.bytes.begin()));
  EXPECT_TRUE(
      std::equal(dst.bytes.begin() + 10, dst.bytes.begin() + 110, src.bytes.begin() + 5000));
  s.source_extents = {3};
  EXPECT_THAT(b_->Pull(s), StatusIs(absl::StatusCode::kOutOfRange));
  s.source_extents = {0};  // 1000 bytes into 110
  EXPECT_THAT(b_->Pull(s), StatusIs(absl::StatusCode::kInvalidArgument));
  s.source_extents = {0};
  s.range_length = 5;
  EXPECT_THAT(b_->Pull(s), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST_P(PullsTest, PreparedDestinationsTakePiecesByIndexAndAreReleased) {
  // A KV-cache-like pool on B: 64 page slots of 16 KiB; A publishes request R's 8 pages.
  Buffer src(1 << 20, 9);
  ASSERT_OK_AND_ASSIGN(uint64_t sr, a_->Register(src.data(), src.bytes.size()));
  Layout pages;
  pages.AddPages(sr, 0, 16384, {7, 3, 60, 12, 0, 33, 21, 50});
  ASSERT_OK(a_->Publish("kv/r", pages, /*replace=*/false, /*durable=*/false).status());
  Buffer pool(64 * 16384, 0, false);
  ASSERT_OK_AND_ASSIGN(uint64_t pr, b_->Register(pool.data(), pool.bytes.size()));
  Layout slots;
  slots.AddStrided(pr, 0, 16384, 16384, 64);
  ASSERT_OK_AND_ASSIGN(uint64_t handle, b_->PrepareDestination(slots));
  for (int round = 0; round < 3; ++round) {
    // Into free slots, chosen anew each round: the source keeps the pool's descriptors.
    const std::vector<uint32_t> free = {static_cast<uint32_t>(40 + round), 2, 9, 63, 17, 5, 31,
                                        static_cast<uint32_t>(20 + round)};
    PullSpec s;
    s.from = a_->url();
    s.object = "kv/r";
    s.prepared = handle;
    s.indices = free;
    ASSERT_OK_AND_ASSIGN(PullStats stats, b_->Pull(s));
    EXPECT_EQ(stats.bytes, 8u * 16384);
    Layout got;
    got.AddPages(pr, 0, 16384, free);
    EXPECT_TRUE(Gather(got, pool.data()) == Gather(pages, src.data())) << "round " << round;
  }
  // Bad indices: past the pool, twice the same; sizes that differ.
  PullSpec bad;
  bad.from = a_->url();
  bad.object = "kv/r";
  bad.prepared = handle;
  bad.indices = {0, 1, 2, 3, 4, 5, 6, 64};
  EXPECT_THAT(b_->Pull(bad), StatusIs(absl::StatusCode::kInvalidArgument));
  bad.indices = {0, 1, 2, 3, 4, 5, 6, 6};
  EXPECT_THAT(b_->Pull(bad), StatusIs(absl::StatusCode::kInvalidArgument));
  bad.indices = {0, 1, 2};
  EXPECT_THAT(b_->Pull(bad), StatusIs(absl::StatusCode::kInvalidArgument));
  // The pool's region stays while the destination does; then it goes.
  EXPECT_THAT(b_->Unregister(pr), StatusIs(absl::StatusCode::kFailedPrecondition));
  ASSERT_OK(b_->ReleaseDestination(handle));
  EXPECT_THAT(b_->ReleaseDestination(handle), StatusIs(absl::StatusCode::kNotFound));
  bad.indices = {0};
  EXPECT_THAT(b_->Pull(bad), StatusIs(absl::StatusCode::kNotFound));
  ASSERT_OK(b_->Unregister(pr));
}

TEST_P(PullsTest, PullsIntoAPublishedVersionsBufferAreRefused) {
  Buffer src(8192, 1), mine(8192, 2);
  ASSERT_OK_AND_ASSIGN(uint64_t sr, a_->Register(src.data(), src.bytes.size()));
  ASSERT_OK(a_->Publish("x", Layout({{sr, 0, 4096}})).status());
  ASSERT_OK_AND_ASSIGN(uint64_t mr, b_->Register(mine.data(), mine.bytes.size()));
  ASSERT_OK(b_->Publish("held", Layout({{mr, 0, 4096}})).status());
  const std::vector<char> before = mine.bytes;
  EXPECT_THAT(PullInto("x", Layout({{mr, 4096, 4096}})),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_EQ(mine.bytes, before);
  // Overlapping pieces of one destination are refused too.
  Buffer other(8192, 0, false);
  ASSERT_OK_AND_ASSIGN(uint64_t orr, b_->Register(other.data(), other.bytes.size()));
  EXPECT_THAT(PullInto("x", Layout({{orr, 0, 2048}, {orr, 1024, 2048}})),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST_P(PullsTest, BatchesAnswerEachPullAndMixGoodWithBad) {
  Buffer src(1 << 20, 4);
  ASSERT_OK_AND_ASSIGN(uint64_t sr, a_->Register(src.data(), src.bytes.size()));
  for (int i = 0; i < 4; ++i) {
    ASSERT_OK(a_->Publish(absl::StrCat("b", i), Layout({{sr, uint64_t(i) * 1000, 1000}})).status());
  }
  Buffer dst(8192, 0, false);
  ASSERT_OK_AND_ASSIGN(uint64_t dr, b_->Register(dst.data(), dst.bytes.size()));
  std::vector<PullSpec> specs(6);
  for (size_t i = 0; i < 6; ++i) {
    specs[i].from = a_->url();
    specs[i].object = absl::StrCat("b", i % 4);
    specs[i].into = Layout({{dr, i * 1000, 1000}});
  }
  specs[4].object = "nothing";                 // no such object
  specs[5].into = Layout({{dr, 7800, 1000}});  // outside the region
  auto results = b_->PullBatch(specs);
  ASSERT_EQ(results.size(), 6u);
  for (size_t i = 0; i < 4; ++i) {
    ASSERT_OK(results[i].status()) << i;
    const auto at = static_cast<ptrdiff_t>(i * 1000);
    EXPECT_TRUE(
        std::equal(dst.bytes.begin() + at, dst.bytes.begin() + at + 1000, src.bytes.begin() + at));
  }
  EXPECT_THAT(results[4], StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(results[5], StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST_P(PullsTest, ACancelledPullWritesNothingAfterCancelReturns) {
  constexpr size_t kSize = size_t{256} << 20;
  Buffer src(kSize, 6);
  ASSERT_OK_AND_ASSIGN(uint64_t sr, a_->Register(src.data(), kSize));
  ASSERT_OK(a_->Publish("big", Layout({{sr, 0, kSize}})).status());
  ASSERT_OK(a_->Publish("small", Layout({{sr, 0, 4096}})).status());
  Buffer dst(kSize, 0, false), fence(4096, 0, false);
  ASSERT_OK_AND_ASSIGN(uint64_t dr, b_->Register(dst.data(), kSize));
  ASSERT_OK_AND_ASSIGN(uint64_t fr, b_->Register(fence.data(), fence.bytes.size()));
  PullSpec s;
  s.from = a_->url();
  s.object = "big";
  s.into = Layout({{dr, 0, kSize}});
  ASSERT_OK_AND_ASSIGN(auto pull, b_->PullAsync(s));
  auto ended = pull->Cancel();
  // Cancelled, or done already: either way nothing of it may land from now on.
  EXPECT_TRUE(ended.ok() || absl::IsCancelled(ended.status())) << ended.status();
  std::fill(dst.bytes.begin(), dst.bytes.end(), static_cast<char>(0x5a));
  // A later pull from the same source over the same rails lands after whatever of the
  // cancelled one was still on its way.
  ASSERT_OK(PullInto("small", Layout({{fr, 0, 4096}})).status());
  EXPECT_EQ(std::count(dst.bytes.begin(), dst.bytes.end(), static_cast<char>(0x5a)),
            static_cast<ptrdiff_t>(kSize));
  EXPECT_TRUE(pull->Done());
}

TEST_P(PullsTest, AsyncPullsRunTogetherAndEachEndsOnce) {
  Buffer src(4 << 20, 8);
  ASSERT_OK_AND_ASSIGN(uint64_t sr, a_->Register(src.data(), src.bytes.size()));
  ASSERT_OK(a_->Publish("m", Layout({{sr, 0, 1 << 20}})).status());
  Buffer dst(8 << 20, 0, false);
  ASSERT_OK_AND_ASSIGN(uint64_t dr, b_->Register(dst.data(), dst.bytes.size()));
  std::vector<std::unique_ptr<PullFuture>> pulls;
  for (int i = 0; i < 8; ++i) {
    PullSpec s;
    s.from = a_->url();
    s.object = "m";
    s.into = Layout({{dr, uint64_t(i) << 20, 1 << 20}});
    ASSERT_OK_AND_ASSIGN(auto p, b_->PullAsync(s));
    pulls.push_back(std::move(p));
  }
  for (auto& p : pulls) {
    ASSERT_OK_AND_ASSIGN(PullStats stats, p->Wait(absl::Now() + absl::Seconds(60)));
    EXPECT_EQ(stats.bytes, 1u << 20);
    EXPECT_TRUE(p->Done());
    ASSERT_OK(p->Wait().status());  // the same answer again
  }
  for (int i = 0; i < 8; ++i) {
    EXPECT_TRUE(std::equal(dst.bytes.begin() + (i << 20), dst.bytes.begin() + ((i + 1) << 20),
                           src.bytes.begin()));
  }
}

TEST_P(PullsTest, EphemeralObjectsAreGoneAfterARestartAndDurableOnesStay) {
  Buffer src(8192, 2);
  ASSERT_OK_AND_ASSIGN(uint64_t sr, a_->Register(src.data(), src.bytes.size()));
  ASSERT_OK_AND_ASSIGN(ObjectInfo kv, a_->Publish("kv", Layout({{sr, 0, 4096}}), false, false));
  EXPECT_FALSE(kv.durable);
  ASSERT_OK(a_->Publish("w", Layout({{sr, 4096, 4096}})).status());
  // A name is durable or ephemeral, not both.
  EXPECT_THAT(a_->Publish("kv", Layout({{sr, 0, 10}}), true, true),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  ASSERT_OK_AND_ASSIGN(ObjectInfo v2, a_->Publish("kv", Layout({{sr, 0, 10}}), true, false));
  EXPECT_EQ(v2.version, 2u);
  Buffer dst(4096, 0, false);
  ASSERT_OK_AND_ASSIGN(uint64_t dr, b_->Register(dst.data(), dst.bytes.size()));
  ASSERT_OK(PullInto("kv", Layout({{dr, 0, 10}})).status());
  a_.reset();
  ASSERT_OK_AND_ASSIGN(a_, Start("a"));
  EXPECT_THAT(a_->Describe("kv"), StatusIs(absl::StatusCode::kNotFound));
  ASSERT_OK_AND_ASSIGN(ObjectInfo w, a_->Describe("w"));
  EXPECT_TRUE(w.durable);
  EXPECT_TRUE(w.detached);  // its memory was the old process's
}

TEST_P(PullsTest, ASourceRestartedAtItsAddressBetweenTwoPullsIsReachedAgain) {
  Buffer dst(4096, 0, false);
  ASSERT_OK_AND_ASSIGN(uint64_t dr, b_->Register(dst.data(), dst.bytes.size()));
  auto publish = [&](Buffer& src) -> absl::Status {
    auto sr = a_->Register(src.data(), src.bytes.size());
    if (!sr.ok()) return sr.status();
    return a_->Publish("w", Layout({{*sr, 0, 4096}}), /*replace=*/true).status();
  };
  Buffer first(4096, 1);
  ASSERT_OK(publish(first));
  ASSERT_OK_AND_ASSIGN(PullStats one, PullInto("w", Layout({{dr, 0, 4096}})));
  EXPECT_EQ(one.via, "fabric");
  EXPECT_EQ(dst.bytes, first.bytes);
  // A goes and comes back on the same address, with new rails: B's session to it is stale.
  const std::string url = a_->url();
  a_.reset();
  ASSERT_OK_AND_ASSIGN(a_, Start("a", url.substr(std::string("http://").size())));
  ASSERT_EQ(a_->url(), url);
  Buffer second(4096, 2);
  ASSERT_OK(publish(second));
  ASSERT_OK_AND_ASSIGN(PullStats two, PullInto("w", Layout({{dr, 0, 4096}})));
  EXPECT_EQ(dst.bytes, second.bytes);
  ASSERT_OK_AND_ASSIGN(PullStats three, PullInto("w", Layout({{dr, 0, 4096}})));
  EXPECT_EQ(three.via, "fabric");  // a new session, over the rails again
}

TEST_P(PullsTest, OverHttpAloneEveryKindOfPullStillWorks) {
  ASSERT_OK_AND_ASSIGN(auto c, Start("c", "127.0.0.1:0", "http"));
  Buffer src(1 << 20, 3);
  ASSERT_OK_AND_ASSIGN(uint64_t sr, a_->Register(src.data(), src.bytes.size()));
  ASSERT_OK(a_->Publish("m", Layout().AddStrided(sr, 0, 4096, 8192, 64)).status());
  Buffer dst(1 << 20, 0, false);
  ASSERT_OK_AND_ASSIGN(uint64_t dr, c->Register(dst.data(), dst.bytes.size()));
  ASSERT_OK_AND_ASSIGN(PullStats s, c->PullInto(a_->url(), "m", Layout({{dr, 0, 64 * 4096}})));
  EXPECT_EQ(s.via, "http");
  EXPECT_EQ(s.path, "rdma");  // the bytes still go over the rails
  for (size_t i = 0; i < 64; ++i) {
    ASSERT_TRUE(std::equal(dst.bytes.begin() + static_cast<ptrdiff_t>(i * 4096),
                           dst.bytes.begin() + static_cast<ptrdiff_t>((i + 1) * 4096),
                           src.bytes.begin() + static_cast<ptrdiff_t>(i * 8192)))
        << i;
  }
  std::vector<PullSpec> specs(2);
  for (size_t i = 0; i < 2; ++i) {
    specs[i].from = a_->url();
    specs[i].object = i == 0 ? "m" : "nothing";
    specs[i].into = Layout({{dr, 0, 64 * 4096}});
  }
  auto results = c->PullBatch(specs);
  ASSERT_EQ(results.size(), 2u);
  EXPECT_OK(results[0].status());
  EXPECT_THAT(results[1], StatusIs(absl::StatusCode::kNotFound));
}

// shm is left out: with two nodes in one process libfabric's shm now and then crashes in
// fi_cq_read (seen under ctest -j2 in CI, and in about 1 of 4 runs of this binary as a whole).
// Between processes (ferryd_test, engine_test) shm is tested.
INSTANTIATE_TEST_SUITE_P(Providers, PullsTest, ::testing::Values("tcp"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace ferry
