// Rails on the netns test bed: two ferryd in network namespaces joined by shaped veth pairs,
// one rail each (tcp provider); rails taken down during a pull, brought back, and nodes with
// different rail counts. Needs root (CI runs as root); skipped otherwise.
#include <gmock/gmock.h>
#include <httplib.h>
#include <unistd.h>

#include <filesystem>
#include <thread>

#include "nlohmann/json.hpp"
#include "tests/testing/ferryd_process.h"
#include "tests/testing/netns.h"
#include "tests/testing/pattern.h"

namespace ferry {
namespace {

using json = nlohmann::json;
using testing::TestBed;
using ::testing::Contains;
using ::testing::Each;
using ::testing::Gt;

constexpr char kOctet[] = "application/octet-stream";

class RailsTest : public ::testing::Test {
 protected:
  // A bed of `rails` veth pairs at `mbit`; ferryd on A with `a_rails` of them and on B with
  // `b_rails`, failing a rail over after `stall_ms` without completions (and resting a rail
  // that has not answered first contact by then).
  void Start(size_t rails, uint64_t mbit, size_t a_rails, size_t b_rails, int stall_ms = 300) {
    if (geteuid() != 0) GTEST_SKIP() << "the netns test bed needs root";
    auto bed = TestBed::Create({.rails = rails, .rate_mbit = mbit});
    ASSERT_TRUE(bed.ok()) << bed.status();
    bed_ = std::move(*bed);
    dir_ = std::filesystem::temp_directory_path() / ("rails-test-" + std::to_string(getpid()));
    std::filesystem::remove_all(dir_);
    for (TestBed::Side side : {TestBed::kA, TestBed::kB}) {
      std::vector<std::string> args = {"--provider",       "tcp", "--rails", "0",
                                       "--rail-stall-ms",  std::to_string(stall_ms),
                                       "--rail-backoff-ms", "1000",
                                       "--data-dir", (dir_ / (side == TestBed::kA ? "a" : "b")).string()};
      for (size_t i = 0; i < (side == TestBed::kA ? a_rails : b_rails); ++i) {
        args.push_back("--domain");
        args.push_back(bed_->RailInterface(side, i));
      }
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
  json Pull(TestBed::Side to, const std::string& name, const std::string& as) {
    const TestBed::Side from = to == TestBed::kA ? TestBed::kB : TestBed::kA;
    const json body = {{"from", PeerUrl(from)}, {"object", name}, {"as", as},
                       {"into", {{"device", "host"}}}};
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
  const std::string data = Put(TestBed::kA, "weights", 64 << 20);
  json first;
  std::thread pull([&] { first = Pull(TestBed::kB, "weights", "copy1"); });
  absl::SleepFor(absl::Milliseconds(250));
  ASSERT_TRUE(bed_->SetRail(1, false).ok());
  pull.join();
  ASSERT_TRUE(first.is_object());
  EXPECT_EQ(first["bytes"], data.size());
  EXPECT_THAT(first["failed_rails"].get<std::vector<size_t>>(), Contains(1u));
  EXPECT_GT(first["rerouted_writes"].get<uint64_t>(), 0u);
  ExpectObject(TestBed::kB, "copy1", data);

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

}  // namespace
}  // namespace ferry
