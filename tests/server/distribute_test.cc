// Distribution between real ferryd processes on a shaped cluster bed (1 + 8 network
// namespaces on a bridge): every receiver gets the object byte for byte, and one killed with
// SIGKILL mid-way is routed around by the others. Needs root (skips otherwise).
#include <gmock/gmock.h>
#include <httplib.h>
#include <signal.h>
#include <unistd.h>

#include <filesystem>
#include <random>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "nlohmann/json.hpp"
#include "tests/testing/cluster_bed.h"
#include "tests/testing/ferryd_process.h"
#include "tests/testing/status_matchers.h"

namespace ferry {
namespace {

using json = nlohmann::json;

constexpr size_t kReceivers = 8;
constexpr uint64_t kSize = 48 << 20;
constexpr uint64_t kChunk = 1 << 20;

class DistributeBedTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto bed = testing::ClusterBed::Create({.nodes = kReceivers + 1, .rate_mbit = 400});
    if (absl::IsFailedPrecondition(bed.status())) GTEST_SKIP() << bed.status();
    ASSERT_OK(bed.status());
    bed_ = *std::move(bed);
    dir_ = std::filesystem::temp_directory_path() / absl::StrCat("distribute-test-", getpid());
    std::filesystem::remove_all(dir_);
    for (size_t i = 0; i <= kReceivers; ++i) {
      ASSERT_OK_AND_ASSIGN(
          auto p,
          testing::StartFerrydAt(bed_->Exec(i), bed_->Address(i), FERRYD_PATH,
                                 {"--provider", "tcp", "--domain", bed_->Interface(), "--rails",
                                  "1", "--data-dir", (dir_ / absl::StrCat("n", i)).string()}));
      nodes_.push_back(std::move(p));
    }
    bytes_.resize(kSize);
    std::mt19937_64 rng(5);
    for (size_t i = 0; i < kSize; i += 8) {
      const uint64_t v = rng();
      std::memcpy(bytes_.data() + i, &v, 8);
    }
    auto put = Client(0).Put("/v1/objects/weights/data", bytes_, "application/octet-stream");
    ASSERT_TRUE(put && put->status / 100 == 2) << (put ? put->body : "no answer");
  }
  void TearDown() override {
    nodes_.clear();
    bed_.reset();
    std::filesystem::remove_all(dir_);
  }
  httplib::Client Client(size_t i) {
    httplib::Client c(nodes_[i].url);
    c.set_read_timeout(120);
    c.set_write_timeout(120);
    return c;
  }
  std::vector<std::string> Urls() {
    std::vector<std::string> out;
    for (size_t i = 1; i <= kReceivers; ++i) out.push_back(nodes_[i].url);
    return out;
  }
  // The chunks node i has pulled so far (its destination pulls that succeeded).
  int PullsDone(size_t i) {
    auto m = Client(i).Get("/metrics");
    if (!m || m->status != 200) return -1;
    double sum = 0;
    for (absl::string_view line : absl::StrSplit(m->body, '\n')) {
      if (!absl::StartsWith(line, "ferry_pulls_total{") ||
          !absl::StrContains(line, "role=\"destination\"") ||
          !absl::StrContains(line, "outcome=\"ok\"")) {
        continue;
      }
      double v = 0;
      if (absl::SimpleAtod(line.substr(line.rfind(' ') + 1), &v)) sum += v;
    }
    return static_cast<int>(sum);
  }
  // Whether node i holds the object, byte for byte.
  bool Holds(size_t i) {
    auto got = Client(i).Get("/v1/objects/weights/data");
    return got && got->status == 200 && got->body == bytes_;
  }

  std::unique_ptr<testing::ClusterBed> bed_;
  std::filesystem::path dir_;
  std::vector<testing::FerrydProcess> nodes_;
  std::string bytes_;
};

TEST_F(DistributeBedTest, EightReceiversGetItByteForByteAndAKilledOneIsRoutedAround) {
  const json spec = {{"object", "weights"}, {"to", Urls()}, {"chunk_bytes", kChunk}};
  // Receiver 4 (node 4) is killed once it has a few chunks: the ones after it take the rest
  // from node 3.
  constexpr size_t kVictim = 4;
  std::thread killer([&] {
    const absl::Time give_up = absl::Now() + absl::Seconds(60);
    while (PullsDone(kVictim) < 4 && absl::Now() < give_up) absl::SleepFor(absl::Milliseconds(5));
    kill(nodes_[kVictim].proc->pid(), SIGKILL);
  });
  auto r = Client(0).Post("/v1/distribute", spec.dump(), "application/json");
  killer.join();
  ASSERT_TRUE(r && r->status == 200) << (r ? r->body : "no answer");
  const json result = json::parse(r->body);
  ASSERT_EQ(result["receivers"].size(), kReceivers);
  EXPECT_EQ(result["chunks"], kSize / kChunk);
  for (size_t i = 1; i <= kReceivers; ++i) {
    const json& rr = result["receivers"][i - 1];
    SCOPED_TRACE(rr.dump());
    if (i == kVictim) {
      EXPECT_FALSE(rr["ok"].get<bool>());
      EXPECT_EQ(rr["error"]["code"], "UNAVAILABLE");
      continue;
    }
    EXPECT_TRUE(rr["ok"].get<bool>());
    EXPECT_TRUE(Holds(i)) << "receiver " << i;
  }
  // The one after the victim gave it up as an upstream.
  const json& next = result["receivers"][kVictim];
  ASSERT_FALSE(next["skipped"].empty()) << next.dump();
  EXPECT_THAT(next["skipped"][0].get<std::string>(), ::testing::HasSubstr(nodes_[kVictim].url));
  nodes_[kVictim].proc.reset();  // reaped
}

}  // namespace
}  // namespace ferry
