// Rails on the netns test bed: two ferryd in network namespaces joined by shaped veth pairs,
// one rail each (tcp provider); rails taken down during a pull, brought back, and nodes with
// different rail counts. Needs root (CI runs as root); skipped otherwise.
#include <gmock/gmock.h>
#include <httplib.h>
#include <unistd.h>

#include <filesystem>
#include <functional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "tests/testing/ferryd_process.h"
#include "tests/testing/netns.h"
#include "tests/testing/pattern.h"

namespace ferry {
namespace {

using json = nlohmann::json;
using ::testing::Contains;
using ::testing::Each;
using ::testing::Gt;
using testing::TestBed;

constexpr char kOctet[] = "application/octet-stream";

class RailsTest : public ::testing::Test {
 protected:
  // A bed of `rails` veth pairs at `mbit`; ferryd on A with `a_rails` of them and on B with
  // `b_rails`, failing a rail over after `stall_ms` without completions (and resting a rail
  // that has not answered first contact by then).
  void Start(size_t rails, uint64_t mbit, size_t a_rails, size_t b_rails, int stall_ms = 300,
             std::vector<std::string> a_extra = {}) {
    if (geteuid() != 0) GTEST_SKIP() << "the netns test bed needs root";
    auto bed = TestBed::Create({.rails = rails, .rate_mbit = mbit});
    ASSERT_TRUE(bed.ok()) << bed.status();
    bed_ = std::move(*bed);
    dir_ = std::filesystem::temp_directory_path() / ("rails-test-" + std::to_string(getpid()));
    std::filesystem::remove_all(dir_);
    for (TestBed::Side side : {TestBed::kA, TestBed::kB}) {
      std::vector<std::string> args = {
          "--provider",        "tcp",
          "--rails",           "0",
          "--rail-stall-ms",   std::to_string(stall_ms),
          "--rail-backoff-ms", "1000",
          "--data-dir",        (dir_ / (side == TestBed::kA ? "a" : "b")).string()};
      for (size_t i = 0; i < (side == TestBed::kA ? a_rails : b_rails); ++i) {
        args.push_back("--domain");
        args.push_back(bed_->RailInterface(side, i));
      }
      if (side == TestBed::kA) args.insert(args.end(), a_extra.begin(), a_extra.end());
      auto p = testing::StartFerrydIn(bed_->Exec(side), bed_->HostAddress(side), FERRYD_PATH, args);
      ASSERT_TRUE(p.ok()) << p.status();
      node_[side] = std::move(*p);
    }
  }
  void TearDown() override {
    for (auto& n : node_) {
      if (n.proc) {
        EXPECT_EQ(n.Stop(), 0);
      }
    }
    bed_.reset();
    if (!dir_.empty()) std::filesystem::remove_all(dir_);
  }

  httplib::Client Client(TestBed::Side side) const {
    httplib::Client c(node_[side].url);
    c.set_read_timeout(120);
    return c;
  }
  // The side's URL as the other side reaches it (the control link).
  std::string PeerUrl(TestBed::Side side) const {
    const std::string& url = node_[side].url;
    return "http://" + bed_->PeerAddress(side) + url.substr(url.rfind(':'));
  }
  // Uploads `size` pattern bytes as `name` on `side`.
  std::string Put(TestBed::Side side, const std::string& name, size_t size) {
    std::string data(size, '\0');
    testing::FillPattern(size, 0, reinterpret_cast<uint8_t*>(data.data()), size);
    auto r = Client(side).Put(("/v1/objects/" + name + "/data").c_str(), data, kOctet);
    EXPECT_TRUE(r && r->status == 201) << (r ? r->body : "no response");
    return data;
  }
  // `to` pulls `name` from the other side into a new buffer, published as `as`.
  json Pull(TestBed::Side to, const std::string& name, const std::string& as,
            bool replace = false) {
    const TestBed::Side from = to == TestBed::kA ? TestBed::kB : TestBed::kA;
    const json body = {{"from", PeerUrl(from)},
                       {"object", name},
                       {"as", as},
                       {"into", {{"device", "host"}}},
                       {"replace", replace}};
    auto r = Client(to).Post("/v1/pulls", body.dump(), "application/json");
    EXPECT_TRUE(r && r->status == 200) << (r ? r->body : "no response");
    return r && r->status == 200 ? json::parse(r->body) : json();
  }
  std::string Get(TestBed::Side side, const std::string& name) {
    auto r = Client(side).Get(("/v1/objects/" + name + "/data").c_str());
    return r && r->status == 200 ? r->body : std::string();
  }
  // Reads `name` back from `side` and compares it with `want`, naming the first differing
  // byte and how many 64 KiB blocks differ (gtest's diff of two big strings takes minutes).
  void ExpectObject(TestBed::Side side, const std::string& name, const std::string& want) {
    const std::string got = Get(side, name);
    ASSERT_EQ(got.size(), want.size()) << name;
    size_t first = got.size(), blocks = 0, zero_blocks = 0;
    for (size_t b = 0; b < got.size(); b += 65536) {
      const size_t n = std::min<size_t>(65536, got.size() - b);
      if (memcmp(got.data() + b, want.data() + b, n) == 0) continue;
      ++blocks;
      zero_blocks += got.find_first_not_of('\0', b) >= b + n;
      for (size_t i = b; i < b + n && first == got.size(); ++i) {
        if (got[i] != want[i]) first = i;
      }
    }
    EXPECT_EQ(blocks, 0u) << name << ": first difference at byte " << first << "; " << zero_blocks
                          << " of the differing 64 KiB blocks are all zero";
  }

  // After `rail` came back up: B pulls "weights" (`data`) into new copies, every one checked,
  // every 500 ms for up to 60 s until one carries bytes on every rail and fails none (tcp
  // retransmits on a backed-off timer, so the first WRITEs may stall the rail once more).
  void ExpectRailUsedAgain(size_t rail, const std::string& prefix, const std::string& data) {
    json later;
    const absl::Time give_up = absl::Now() + absl::Seconds(60);
    for (int i = 0; absl::Now() < give_up; ++i) {
      later = Pull(TestBed::kB, "weights", prefix + std::to_string(i));
      ASSERT_TRUE(later.is_object());
      ASSERT_NO_FATAL_FAILURE(ExpectObject(TestBed::kB, prefix + std::to_string(i), data));
      if (later["bytes_per_rail"][rail].get<uint64_t>() > 0 && later["failed_rails"].empty()) break;
      absl::SleepFor(absl::Milliseconds(500));
    }
    EXPECT_THAT(later["bytes_per_rail"].get<std::vector<uint64_t>>(), Each(Gt(0u)));
    EXPECT_TRUE(later["failed_rails"].empty()) << later;
    EXPECT_EQ(later["rerouted_writes"], 0u);
  }

  // Bytes `side` has sent on its rails so far (the kernel's counters).
  uint64_t Sent(TestBed::Side side) {
    uint64_t total = 0;
    for (size_t i = 0; i < bed_->options().rails; ++i) {
      auto n = bed_->TxBytes(side, i);
      EXPECT_TRUE(n.ok()) << n.status();
      total += n.ok() ? *n : 0;
    }
    return total;
  }
  // Returns once `side` has sent `bytes` on its rails since it had sent `base` (polling its
  // counters), or after 60 s with a failure.
  void WaitSent(TestBed::Side side, uint64_t base, uint64_t bytes) {
    const absl::Time give_up = absl::Now() + absl::Seconds(60);
    while (Sent(side) < base + bytes) {
      ASSERT_LT(absl::Now(), give_up) << "the pull did not reach " << bytes << " bytes";
      absl::SleepFor(absl::Milliseconds(2));
    }
  }
  // B pulls the 1 MiB object "probe" from A until `rail` carries some of it again (its rest
  // is over and its connection recovered), every 200 ms for up to 60 s.
  void ExpectRailCarriesAgain(size_t rail) {
    json later;
    const absl::Time give_up = absl::Now() + absl::Seconds(60);
    for (int i = 0; absl::Now() < give_up; ++i) {
      later = Pull(TestBed::kB, "probe", "probe-copy", /*replace=*/true);
      ASSERT_TRUE(later.is_object());
      if (later["bytes_per_rail"][rail].get<uint64_t>() > 0 && later["failed_rails"].empty()) break;
      absl::SleepFor(absl::Milliseconds(200));
    }
    EXPECT_GT(later["bytes_per_rail"][rail].get<uint64_t>(), 0u) << later;
    EXPECT_TRUE(later["failed_rails"].empty()) << later;
  }
  // B pulls "weights" from A as `as` while `during` runs (it watches the pull's progress);
  // returns the pull's stats after checking every byte against `data`.
  json PullWhile(const std::string& as, const std::string& data,
                 const std::function<void(uint64_t base)>& during) {
    const uint64_t base = Sent(TestBed::kA);
    json stats;
    std::thread pull([&] { stats = Pull(TestBed::kB, "weights", as); });
    during(base);
    pull.join();
    EXPECT_TRUE(stats.is_object());
    if (!stats.is_object()) return stats;
    EXPECT_EQ(stats["bytes"], data.size());
    ExpectObject(TestBed::kB, as, data);
    return stats;
  }

  std::unique_ptr<TestBed> bed_;
  std::filesystem::path dir_;
  testing::FerrydProcess node_[2];
};

TEST_F(RailsTest, PullCompletesWhenARailGoesDownAndUsesItAgainOnceItIsBack) {
  ASSERT_NO_FATAL_FAILURE(Start(4, 200, 4, 4));
  // First contact (every rail pair says hello) before the rail goes down.
  Put(TestBed::kA, "small", 4096);
  ASSERT_TRUE(Pull(TestBed::kB, "small", "small").is_object());
  // 64 MiB at 4 x 200 Mbit/s: about 0.7 s on four rails.
  // The rail goes down once a quarter of the object has gone out (the kernel's counters).
  const std::string data = Put(TestBed::kA, "weights", 64 << 20);
  const json first = PullWhile("copy1", data, [&](uint64_t base) {
    WaitSent(TestBed::kA, base, data.size() / 4);
    ASSERT_TRUE(bed_->SetRail(1, false).ok());
  });
  ASSERT_TRUE(first.is_object());
  EXPECT_THAT(first["failed_rails"].get<std::vector<size_t>>(), Contains(1u));
  EXPECT_GT(first["rerouted_writes"].get<uint64_t>(), 0u);

  // While it rests nothing goes on it: no pull waits for it to stall again.
  const json second = Pull(TestBed::kB, "weights", "copy2");
  ASSERT_TRUE(second.is_object());
  EXPECT_EQ(second["bytes_per_rail"][1], 0u);
  EXPECT_LT(second["seconds"].get<double>(), 0.3 + first["seconds"].get<double>());
  ExpectObject(TestBed::kB, "copy2", data);

  // Back up: once its rest is over and its connection has recovered, pulls use it again.
  ASSERT_TRUE(bed_->SetRail(1, true).ok());
  ASSERT_NO_FATAL_FAILURE(ExpectRailUsedAgain(1, "copy3-", data));
}

TEST_F(RailsTest, ARailDownAtFirstContactRestsAndIsUsedOnceItIsBack) {
  ASSERT_NO_FATAL_FAILURE(Start(2, 1000, 2, 2));
  ASSERT_TRUE(bed_->SetRail(1, false).ok());
  const std::string data = Put(TestBed::kA, "weights", 8 << 20);
  const json first = Pull(TestBed::kB, "weights", "copy1");
  ASSERT_TRUE(first.is_object());
  EXPECT_EQ(first["bytes_per_rail"], json::array({data.size(), 0}));
  ExpectObject(TestBed::kB, "copy1", data);

  ASSERT_TRUE(bed_->SetRail(1, true).ok());
  ASSERT_NO_FATAL_FAILURE(ExpectRailUsedAgain(1, "copy2-", data));
}

TEST_F(RailsTest, AFasterRailTakesOverTheQueuedWritesOfASlowerOne) {
  // Both rails must be up for the pull (see NodesWithFourAndTwoRailsPullBothWays).
  ASSERT_NO_FATAL_FAILURE(Start(2, 500, 2, 2, /*stall_ms=*/5000));
  ASSERT_TRUE(bed_->SetRate(1, 50).ok());
  const std::string data = Put(TestBed::kA, "weights", 32 << 20);
  const json stats = Pull(TestBed::kB, "weights", "copy");
  ASSERT_TRUE(stats.is_object());
  // Planned half and half; rail 0 ran dry first and took what rail 1 had not posted yet.
  const auto per_rail = stats["bytes_per_rail"].get<std::vector<uint64_t>>();
  ASSERT_EQ(per_rail.size(), 2u);
  EXPECT_EQ(per_rail[0] + per_rail[1], data.size());
  EXPECT_GT(per_rail[0], 3 * per_rail[1]);
  EXPECT_GT(per_rail[1], 0u);
  EXPECT_EQ(stats["rerouted_writes"], 0);
  EXPECT_TRUE(stats["failed_rails"].empty());
  ExpectObject(TestBed::kB, "copy", data);
}

TEST_F(RailsTest, NodesWithFourAndTwoRailsPullBothWays) {
  // Every rail must be up for the first pull: under ASan on two vCPUs, first contact on the
  // later rails once took more than 300 ms after the first answered, and they rested.
  ASSERT_NO_FATAL_FAILURE(Start(4, 1000, 4, 2, /*stall_ms=*/5000));
  const std::string a_data = Put(TestBed::kA, "from-a", 8 << 20);
  const std::string b_data = Put(TestBed::kB, "from-b", 8 << 20);
  const json to_b = Pull(TestBed::kB, "from-a", "got-a");  // 4 rails write into 2
  const json to_a = Pull(TestBed::kA, "from-b", "got-b");  // 2 rails write into 4
  ASSERT_TRUE(to_b.is_object());
  ASSERT_TRUE(to_a.is_object());
  EXPECT_EQ(to_b["bytes_per_rail"].size(), 4u);
  EXPECT_EQ(to_a["bytes_per_rail"].size(), 2u);
  // Every rail carried bytes, so every rail has a finish time within the pull's own.
  for (const json* stats : {&to_b, &to_a}) {
    const auto finished = (*stats)["rail_seconds"].get<std::vector<double>>();
    EXPECT_EQ(finished.size(), (*stats)["bytes_per_rail"].size());
    EXPECT_THAT(finished, Each(Gt(0.0)));
    EXPECT_THAT(finished, Each(::testing::Le((*stats)["seconds"].get<double>())));
  }
  ExpectObject(TestBed::kB, "got-a", a_data);
  ExpectObject(TestBed::kA, "got-b", b_data);
}

// The destination of a pull on a slow rail naps between bursts of WRITEs (it used to poll
// without pausing, a core for the whole pull) and still gets every byte. Its progress threads
// count their sleeps and passes on /metrics.
TEST_F(RailsTest, ADestinationNapsBetweenTheBurstsOfASlowPull) {
  ASSERT_NO_FATAL_FAILURE(Start(1, 100, 1, 1));
  const std::string data = Put(TestBed::kA, "weights", 8 << 20);  // 0.7 s at 100 Mbit/s
  auto progress = [&](const char* family) {
    auto r = Client(TestBed::kB).Get("/metrics");
    EXPECT_TRUE(r && r->status == 200);
    const std::string prefix = std::string(family) + " ";
    const size_t at = r ? r->body.find("\n" + prefix) : std::string::npos;
    EXPECT_NE(at, std::string::npos) << family;
    return at == std::string::npos ? 0.0 : std::stod(r->body.substr(at + 1 + prefix.size()));
  };
  const double waits = progress("ferry_progress_waits_total");
  const double passes = progress("ferry_progress_passes_total");
  const json stats = Pull(TestBed::kB, "weights", "copy");
  ASSERT_TRUE(stats.is_object());
  ExpectObject(TestBed::kB, "copy", data);
  // Naps last 500 us at most: a pull this long takes hundreds; a spinning destination takes
  // none and passes millions of times.
  const double naps = progress("ferry_progress_waits_total") - waits;
  EXPECT_GT(naps, 100) << stats;
  EXPECT_LT(progress("ferry_progress_passes_total") - passes, 100 * naps) << stats;
}

// The source's end of a rail goes down before a pull and at 10%, 50% and 90% of one (watched
// on the kernel's byte counters): each pull completes over the other rails, names the rail,
// and every byte is right; the rail carries traffic again once it is back. The source runs a
// progress thread per rail, so the WRITEs of the lost rail move to other threads' rails.
TEST_F(RailsTest, ASourceLinkDownBeforeOrDuringAPullFailsOverToTheOtherRails) {
  ASSERT_NO_FATAL_FAILURE(
      Start(4, 100, 4, 4, 300, {"--progress-threads", "4", "--topology", "false"}));
  Put(TestBed::kA, "probe", 1 << 20);
  ASSERT_TRUE(Pull(TestBed::kB, "probe", "probe-copy").is_object());  // first contact
  const std::string data = Put(TestBed::kA, "weights", 48 << 20);
  for (double at : {0.0, 0.1, 0.5, 0.9}) {
    SCOPED_TRACE(absl::StrCat("link down at ", at));
    if (at == 0) {
      ASSERT_TRUE(bed_->SetRailEnd(TestBed::kA, 2, false).ok());
    }
    const json stats = PullWhile(absl::StrCat("copy-", at), data, [&](uint64_t base) {
      if (at == 0) return;
      WaitSent(TestBed::kA, base, static_cast<uint64_t>(at * static_cast<double>(data.size())));
      ASSERT_TRUE(bed_->SetRailEnd(TestBed::kA, 2, false).ok());
    });
    EXPECT_THAT(stats["failed_rails"].get<std::vector<size_t>>(), Contains(2u)) << stats;
    ASSERT_TRUE(bed_->SetRailEnd(TestBed::kA, 2, true).ok());
    ASSERT_NO_FATAL_FAILURE(ExpectRailCarriesAgain(2));
  }
}

TEST_F(RailsTest, ADestinationLinkDownBeforeOrDuringAPullFailsOverToTheOtherRails) {
  ASSERT_NO_FATAL_FAILURE(Start(4, 100, 4, 4));
  Put(TestBed::kA, "probe", 1 << 20);
  ASSERT_TRUE(Pull(TestBed::kB, "probe", "probe-copy").is_object());
  const std::string data = Put(TestBed::kA, "weights", 48 << 20);
  for (double at : {0.0, 0.1, 0.5, 0.9}) {
    SCOPED_TRACE(absl::StrCat("link down at ", at));
    if (at == 0) {
      ASSERT_TRUE(bed_->SetRailEnd(TestBed::kB, 1, false).ok());
    }
    const json stats = PullWhile(absl::StrCat("copy-", at), data, [&](uint64_t base) {
      if (at == 0) return;
      WaitSent(TestBed::kA, base, static_cast<uint64_t>(at * static_cast<double>(data.size())));
      ASSERT_TRUE(bed_->SetRailEnd(TestBed::kB, 1, false).ok());
    });
    EXPECT_THAT(stats["failed_rails"].get<std::vector<size_t>>(), Contains(1u)) << stats;
    ASSERT_TRUE(bed_->SetRailEnd(TestBed::kB, 1, true).ok());
    ASSERT_NO_FATAL_FAILURE(ExpectRailCarriesAgain(1));
  }
}

TEST_F(RailsTest, TwoOfFourSourceLinksDownMidPullAndOneFlappingThreeTimes) {
  ASSERT_NO_FATAL_FAILURE(
      Start(4, 100, 4, 4, 300, {"--progress-threads", "2", "--topology", "false"}));
  Put(TestBed::kA, "probe", 1 << 20);
  ASSERT_TRUE(Pull(TestBed::kB, "probe", "probe-copy").is_object());
  const std::string data = Put(TestBed::kA, "weights", 48 << 20);
  const uint64_t size = data.size();
  const json two = PullWhile("two-down", data, [&](uint64_t base) {
    WaitSent(TestBed::kA, base, size / 2);
    ASSERT_TRUE(bed_->SetRailEnd(TestBed::kA, 1, false).ok());
    ASSERT_TRUE(bed_->SetRailEnd(TestBed::kA, 3, false).ok());
  });
  EXPECT_THAT(two["failed_rails"].get<std::vector<size_t>>(), ::testing::IsSupersetOf({1u, 3u}))
      << two;
  for (size_t r : {size_t{1}, size_t{3}}) ASSERT_TRUE(bed_->SetRailEnd(TestBed::kA, r, true).ok());
  ASSERT_NO_FATAL_FAILURE(ExpectRailCarriesAgain(1));
  ASSERT_NO_FATAL_FAILURE(ExpectRailCarriesAgain(3));
  // Down at 20%, up at 35%, down at 50%, up at 65%, down at 80%, up at the end.
  const json flapping = PullWhile("flapping", data, [&](uint64_t base) {
    for (double at : {0.2, 0.5, 0.8}) {
      WaitSent(TestBed::kA, base, static_cast<uint64_t>(at * static_cast<double>(size)));
      ASSERT_TRUE(bed_->SetRailEnd(TestBed::kA, 0, false).ok());
      if (at == 0.8) break;
      WaitSent(TestBed::kA, base, static_cast<uint64_t>((at + 0.15) * static_cast<double>(size)));
      ASSERT_TRUE(bed_->SetRailEnd(TestBed::kA, 0, true).ok());
    }
  });
  EXPECT_THAT(flapping["failed_rails"].get<std::vector<size_t>>(), Contains(0u)) << flapping;
  ASSERT_TRUE(bed_->SetRailEnd(TestBed::kA, 0, true).ok());
  ASSERT_NO_FATAL_FAILURE(ExpectRailCarriesAgain(0));
}

// The rail that carries a peer's control messages goes down at the far end: a frame sent on
// it still completes (tcp takes it into the socket), so only the missing answers tell. New
// pulls must still be asked, served and answered, over the other rail or HTTP.
TEST_F(RailsTest, NewPullsGoOnWhileTheControlRailIsDownAtTheSource) {
  ASSERT_NO_FATAL_FAILURE(Start(2, 400, 2, 2));
  const std::string data = Put(TestBed::kA, "small", 64 << 10);
  ASSERT_TRUE(Pull(TestBed::kB, "small", "first").is_object());
  ASSERT_TRUE(bed_->SetRailEnd(TestBed::kA, 0, false).ok());
  for (int i = 0; i < 4; ++i) {
    const json stats = Pull(TestBed::kB, "small", "copy" + std::to_string(i));
    ASSERT_TRUE(stats.is_object()) << "pull " << i;
    EXPECT_EQ(stats["via"], "fabric");
    ExpectObject(TestBed::kB, "copy" + std::to_string(i), data);
  }
  ASSERT_TRUE(bed_->SetRailEnd(TestBed::kA, 0, true).ok());
}

TEST_F(RailsTest, WithEveryRailDownAPullFailsWith503InTimeAndTheNodesRecover) {
  ASSERT_NO_FATAL_FAILURE(
      Start(4, 200, 4, 4, 300, {"--progress-threads", "2", "--topology", "false"}));
  Put(TestBed::kA, "probe", 1 << 20);
  ASSERT_TRUE(Pull(TestBed::kB, "probe", "probe-copy").is_object());
  const std::string data = Put(TestBed::kA, "weights", 16 << 20);
  for (size_t r = 0; r < 4; ++r) ASSERT_TRUE(bed_->SetRailEnd(TestBed::kA, r, false).ok());
  const json body = {{"from", PeerUrl(TestBed::kA)},
                     {"object", "weights"},
                     {"as", "none"},
                     {"into", {{"device", "host"}}}};
  const absl::Time start = absl::Now();
  auto r = Client(TestBed::kB).Post("/v1/pulls", body.dump(), "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 503) << r->body;
  EXPECT_EQ(json::parse(r->body)["error"]["code"], "UNAVAILABLE");
  EXPECT_THAT(r->body, ::testing::HasSubstr("rail"));
  EXPECT_LT(absl::Now() - start, absl::Seconds(20));
  EXPECT_EQ(Client(TestBed::kB).Get("/v1/objects/none")->status, 404);
  for (size_t r = 0; r < 4; ++r) ASSERT_TRUE(bed_->SetRailEnd(TestBed::kA, r, true).ok());
  for (size_t r = 0; r < 4; ++r) ASSERT_NO_FATAL_FAILURE(ExpectRailCarriesAgain(r));
  const json after = Pull(TestBed::kB, "weights", "after");
  ASSERT_TRUE(after.is_object());
  ExpectObject(TestBed::kB, "after", data);
}

}  // namespace
}  // namespace ferry
