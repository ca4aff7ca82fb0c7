// Chaos, bounded: three ferryd on the netns test bed under concurrent publishes and pulls. The
// source S runs in namespace A on a small data disk of its own; the destination D and a third
// node T run in namespace B; two rails. T pulls from S and D pulls from both. While that runs:
// rounds of kill -9 (S, D and T in turn) each followed by a restart on the same data dir; a
// rail taken down at S's end mid-pull; S's data disk filled during publishes and freed again.
//
// Every request's outcome is checked as it comes: a publish is acknowledged (201) or, only
// while the disk is full, refused with 507; a pull completes (200), its bytes are read back and
// compared at once, or, only when one of its two nodes was killed meanwhile, fails with no
// answer (its destination died) or 503 (its source died). Each restart is followed by a check
// that every publish and every delete the killed node acknowledged is still there (or still
// gone), and the round ends only once every pair of nodes has completed a pull again. At the
// end every kept copy and every publish of a node that still runs is read back whole.
//
// FERRY_CHAOS_ROUNDS sets the kill rounds (default 6: each node twice). The test prints one
// JSON line of counts, the figures of docs/security.md's report. Needs root (namespaces and a
// tmpfs mount); skipped otherwise.
#include <gmock/gmock.h>
#include <httplib.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <random>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "nlohmann/json.hpp"
#include "tests/testing/ferryd_process.h"
#include "tests/testing/netns.h"
#include "tests/testing/pattern.h"

namespace ferry {
namespace {

using json = nlohmann::json;
using testing::TestBed;

enum NodeIndex { kS = 0, kD = 1, kT = 2, kNodes = 3 };
constexpr const char* kNodeName[kNodes] = {"source", "destination", "third"};
constexpr size_t kRails = 2;
constexpr uint64_t kDiskMiB = 64;
constexpr uint64_t kMarginMiB = 16;

// A published object's name, the pattern seed of its bytes and their count.
struct Blob {
  std::string name;
  uint64_t seed = 0;
  uint64_t size = 0;
};

std::string PatternBytes(const Blob& b) {
  std::string data(b.size, '\0');
  testing::FillPattern(b.seed, 0, reinterpret_cast<uint8_t*>(data.data()), b.size);
  return data;
}

bool Matches(const Blob& b, const std::string& got) {
  return got.size() == b.size &&
         testing::FirstPatternMismatch(b.seed, 0, reinterpret_cast<const uint8_t*>(got.data()),
                                       got.size()) == got.size();
}

std::string ErrorCode(const httplib::Result& r) {
  if (!r) return "no answer";
  auto j = json::parse(r->body, nullptr, false);
  return j.is_object() && j.contains("error") ? j["error"].value("code", "") : r->body;
}

// What a node has acknowledged, by the incarnation (start) of the node that acknowledged it.
struct Record {
  Blob blob;
  int node = 0;
  int incarnation = 0;
  bool deleted = false;  // a pulled copy whose delete was acknowledged
  // A delete went and its answer was cut by a kill: it may or may not have happened.
  bool delete_unknown = false;
};

struct Counts {
  int kills[kNodes] = {};
  int publishes_acked = 0, publishes_refused_full = 0, publishes_cut = 0;
  int pulls_completed = 0, pulls_read_back = 0, pulls_cut = 0, pulls_unavailable = 0,
      pulls_over_rail_down = 0;
  int copies_deleted = 0, records_checked_after_restart = 0, bytes_checked_at_end = 0;
};

class ChaosTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (geteuid() != 0) GTEST_SKIP() << "the netns test bed and a tmpfs need root";
    auto bed = TestBed::Create({.rails = kRails, .rate_mbit = 400});
    ASSERT_TRUE(bed.ok()) << bed.status();
    bed_ = std::move(*bed);
    dir_ = std::filesystem::temp_directory_path() / ("chaos-test-" + std::to_string(getpid()));
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_ / "disk");
    ASSERT_EQ(mount("tmpfs", (dir_ / "disk").c_str(), "tmpfs", 0,
                    absl::StrCat("size=", kDiskMiB, "m").c_str()),
              0)
        << strerror(errno);
    mounted_ = true;
    const std::filesystem::path data[kNodes] = {dir_ / "disk" / "s", dir_ / "d", dir_ / "t"};
    for (int n = 0; n < kNodes; ++n) {
      side_[n] = n == kS ? TestBed::kA : TestBed::kB;
      args_[n] = {"--provider",      "tcp",           "--rails",           "0",
                  "--rail-stall-ms", "300",           "--rail-backoff-ms", "1000",
                  "--data-dir",      data[n].string()};
      for (size_t i = 0; i < kRails; ++i) {
        args_[n].push_back("--domain");
        args_[n].push_back(bed_->RailInterface(side_[n], i));
      }
      if (n == kS)
        args_[n].insert(args_[n].end(), {"--min-free-disk-mb", std::to_string(kMarginMiB)});
      ASSERT_NO_FATAL_FAILURE(Start(n));
    }
  }

  void TearDown() override {
    StopWorkload();
    for (auto& p : proc_) {
      if (p.proc) {
        EXPECT_EQ(p.Stop(), 0) << "a node did not stop cleanly after the chaos";
      }
    }
    bed_.reset();
    if (mounted_) umount2((dir_ / "disk").c_str(), MNT_DETACH);
    if (!dir_.empty()) std::filesystem::remove_all(dir_);
  }

  // A node as the workload sees it: its URLs and incarnation, and whether it runs.
  struct View {
    std::string url;       // from this process
    std::string peer_url;  // from the other nodes
    int incarnation = 0;
    bool up = false;
  };
  View Snapshot(int n) {
    absl::MutexLock lock(&mu_);
    return view_[n];
  }

  void Start(int n) {
    auto p = testing::StartFerrydIn(bed_->Exec(side_[n]), bed_->HostAddress(side_[n]), FERRYD_PATH,
                                    args_[n]);
    ASSERT_TRUE(p.ok()) << p.status();
    proc_[n] = std::move(*p);
    const std::string& url = proc_[n].url;
    absl::MutexLock lock(&mu_);
    view_[n].url = url;
    view_[n].peer_url = "http://" + bed_->PeerAddress(side_[n]) + url.substr(url.rfind(':'));
    view_[n].up = true;
  }

  void Kill9(int n) {
    {
      absl::MutexLock lock(&mu_);
      view_[n].up = false;
      ++view_[n].incarnation;
      ++counts_.kills[n];
    }
    proc_[n].proc->Kill(SIGKILL);
    proc_[n].proc->Wait();
    proc_[n].proc.reset();
  }

  static httplib::Client Client(const std::string& url) {
    httplib::Client c(url);
    c.set_read_timeout(60);
    c.set_connection_timeout(5);
    return c;
  }

  // True when `n` is still the incarnation `view` saw and runs.
  bool Same(int n, const View& view) {
    absl::MutexLock lock(&mu_);
    return view_[n].up && view_[n].incarnation == view.incarnation;
  }

  void Fail(const std::string& what) {
    absl::MutexLock lock(&mu_);
    FailLocked(what);
  }
  void FailLocked(const std::string& what) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    failures_.push_back(absl::StrCat(
        absl::FormatTime("%H:%M:%E3S ", absl::Now(), absl::UTCTimeZone()), phase_, ": ", what));
  }
  void Phase(const std::string& phase) {
    absl::MutexLock lock(&mu_);
    phase_ = phase;
  }

  // Publishes pattern objects on `n` until the workload stops, at most `limit`.
  void Publisher(int n, int limit) {
    for (int i = 0; i < limit && running_.load(); ++i) {
      const View v = Snapshot(n);
      if (!v.up) {
        absl::SleepFor(absl::Milliseconds(5));
        continue;
      }
      const Blob blob{absl::StrCat(kNodeName[n], "-", i),
                      100000 * static_cast<uint64_t>(n) + static_cast<uint64_t>(i),
                      (8u << 10) + static_cast<uint64_t>(i % 8) * (16u << 10)};
      auto r = Client(v.url).Put(("/v1/objects/" + blob.name + "/data").c_str(), PatternBytes(blob),
                                 "application/octet-stream");
      absl::MutexLock lock(&mu_);
      const bool same = view_[n].up && view_[n].incarnation == v.incarnation;
      if (r && r->status == 201) {
        records_.push_back(Record{blob, n, v.incarnation});
        ++counts_.publishes_acked;
      } else if (r && r->status == 507 && disk_full_ && ErrorCode(r) == "RESOURCE_EXHAUSTED") {
        ++counts_.publishes_refused_full;
      } else if (!r && !same) {
        ++counts_.publishes_cut;
      } else {
        FailLocked(absl::StrCat(
            "publish ", blob.name, " on ", kNodeName[n], ": ",
            r ? std::to_string(r->status) + " " + r->body : "no answer from a running node"));
      }
      absl::SleepFor(absl::Milliseconds(20));
    }
  }

  // An acknowledged publish of `n`'s running incarnation, chosen at random, if any.
  std::optional<Blob> Pick(int n, std::mt19937_64& rng) {
    absl::MutexLock lock(&mu_);
    std::vector<const Blob*> live;
    for (const Record& r : records_) {
      if (r.node == n && r.incarnation == view_[n].incarnation &&
          r.blob.name.rfind(kNodeName[n], 0) == 0) {  // a publish, not a copy
        live.push_back(&r.blob);
      }
    }
    if (live.empty()) return std::nullopt;
    return *live[rng() % live.size()];
  }

  // `dest` pulls objects of `source` into new buffers until the workload stops, at most
  // `limit`; reads every copy back at once and deletes three of four (the rest stay for the
  // check at the end).
  void Puller(int dest, int source, int limit) {
    std::mt19937_64 rng(static_cast<uint64_t>(dest * 10 + source));
    for (int i = 0; i < limit && running_.load(); ++i) {
      const View d = Snapshot(dest), s = Snapshot(source);
      std::optional<Blob> blob = Pick(source, rng);
      if (!d.up || !s.up || !blob) {
        absl::SleepFor(absl::Milliseconds(5));
        continue;
      }
      const std::string as = absl::StrCat("copy-", kNodeName[dest], "-", kNodeName[source], "-", i);
      const json body = {{"from", s.peer_url},
                         {"object", blob->name},
                         {"as", as},
                         {"into", {{"device", "host"}}},
                         {"timeout_ms", 20000}};
      auto r = Client(d.url).Post("/v1/pulls", body.dump(), "application/json");
      const bool dest_same = Same(dest, d), source_same = Same(source, s);
      if (!r && !dest_same) {
        Count(&Counts::pulls_cut);
        continue;
      }
      if (r && r->status == 503 && !source_same && ErrorCode(r) == "UNAVAILABLE") {
        Count(&Counts::pulls_unavailable);
        continue;
      }
      if (!r || r->status != 200) {
        Fail(absl::StrCat("pull of ", blob->name, " into ", kNodeName[dest], ": ",
                          r ? std::to_string(r->status) + " " + r->body : "no answer",
                          dest_same && source_same ? " (neither node was killed)" : ""));
        continue;
      }
      if (rail_down_.load()) Count(&Counts::pulls_over_rail_down);
      const Blob copy{as, blob->seed, blob->size};
      auto back = Client(d.url).Get(("/v1/objects/" + as + "/data").c_str());
      const bool read = back && back->status == 200;
      if (read && !Matches(copy, back->body)) {
        Fail(absl::StrCat("the bytes of ", as, " (", blob->name, ") differ"));
      } else if (!(back && back->status == 200) && Same(dest, d)) {
        Fail(absl::StrCat("completed copy ", as,
                          " unreadable: ", back ? std::to_string(back->status) : "no answer"));
      }
      bool deleted = false, delete_unknown = false;
      if (i % 4 != 0) {
        auto del = Client(d.url).Delete(("/v1/objects/" + as).c_str());
        deleted = del && del->status == 200;
        if (!deleted && Same(dest, d)) {
          Fail(absl::StrCat("delete of ", as, ": ", del ? del->body : "no answer"));
        }
        delete_unknown = !del && !deleted;
      }
      absl::MutexLock lock(&mu_);
      ++counts_.pulls_completed;
      counts_.pulls_read_back += read;
      ++completed_since_[dest][source];
      records_.push_back(Record{copy, dest, d.incarnation, deleted, delete_unknown});
      counts_.copies_deleted += deleted;
    }
  }

  void Count(int Counts::*field) {
    absl::MutexLock lock(&mu_);
    ++(counts_.*field);
  }

  void StartWorkload(int rounds) {
    running_ = true;
    const int limit = 2000 + 400 * rounds;
    threads_.emplace_back([this, limit] { Publisher(kS, limit); });
    threads_.emplace_back([this, limit] { Publisher(kT, limit); });
    threads_.emplace_back([this, limit] { Puller(kD, kS, limit); });
    threads_.emplace_back([this, limit] { Puller(kT, kS, limit); });
    threads_.emplace_back([this, limit] { Puller(kD, kT, limit); });
  }
  void StopWorkload() {
    running_ = false;
    for (auto& t : threads_) t.join();
    threads_.clear();
  }

  // Waits (polling, up to 60 s) until `done` holds; called and checked under mu_.
  bool WaitFor(const std::function<bool()>& done) {
    const absl::Time give_up = absl::Now() + absl::Seconds(60);
    for (;;) {
      {
        absl::MutexLock lock(&mu_);
        if (done()) return true;
      }
      if (absl::Now() > give_up) return false;
      absl::SleepFor(absl::Milliseconds(5));
    }
  }

  // Waits until every pair of nodes has completed `n` pulls counted from now.
  void WaitForPulls(int n, const std::string& when) {
    {
      absl::MutexLock lock(&mu_);
      for (auto& row : completed_since_) std::fill(std::begin(row), std::end(row), 0);
    }
    EXPECT_TRUE(WaitFor([&]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
      return completed_since_[kD][kS] >= n && completed_since_[kT][kS] >= n &&
             completed_since_[kD][kT] >= n;
    })) << "the pulls did not go on "
        << when;
  }

  // Every record of node `n`: a publish or kept copy is in its catalog with its size, a
  // deleted copy is not. With `bytes`, the records of its running incarnation are read whole.
  void CheckRecords(int n, bool bytes) {
    std::vector<Record> records;
    {
      absl::MutexLock lock(&mu_);
      for (const Record& r : records_) {
        if (r.node == n) records.push_back(r);
      }
    }
    const View v = Snapshot(n);
    auto c = Client(v.url);
    c.set_keep_alive(true);
    int checked = 0, read = 0;
    for (const Record& r : records) {
      if (r.delete_unknown) continue;  // there or not: nothing was acknowledged either way
      auto got = c.Get(("/v1/objects/" + r.blob.name).c_str());
      ASSERT_TRUE(got) << kNodeName[n] << " did not answer";
      if (r.deleted) {
        EXPECT_EQ(got->status, 404) << "acknowledged delete of " << r.blob.name << " undone";
      } else if (got->status != 200 || json::parse(got->body)["size"] != r.blob.size) {
        ADD_FAILURE() << "acknowledged " << r.blob.name << " on " << kNodeName[n]
                      << " lost: " << got->status << " " << got->body;
      }
      ++checked;
      if (!bytes || r.deleted || r.incarnation != v.incarnation) continue;
      auto data = c.Get(("/v1/objects/" + r.blob.name + "/data").c_str());
      EXPECT_TRUE(data && data->status == 200 && Matches(r.blob, data->body))
          << "the bytes of " << r.blob.name << " on " << kNodeName[n] << " changed";
      ++read;
    }
    absl::MutexLock lock(&mu_);
    if (bytes) {
      counts_.bytes_checked_at_end += read;
    } else {
      counts_.records_checked_after_restart += checked;
    }
  }

  void ExpectAlive(int n) {
    EXPECT_EQ(kill(proc_[n].proc->pid(), 0), 0) << kNodeName[n] << " died";
    auto h = Client(Snapshot(n).url).Get("/v1/health");
    EXPECT_TRUE(h && h->status == 200) << kNodeName[n] << " does not answer";
  }

  // Bytes S has sent on its rails so far.
  uint64_t SourceSent() {
    uint64_t total = 0;
    for (size_t i = 0; i < kRails; ++i) total += bed_->TxBytes(TestBed::kA, i).value_or(0);
    return total;
  }

  void FillDisk(uint64_t leave_mib) {
    struct statvfs st;
    ASSERT_EQ(statvfs((dir_ / "disk").c_str(), &st), 0);
    const uint64_t free_bytes = static_cast<uint64_t>(st.f_bavail) * st.f_frsize;
    ASSERT_GT(free_bytes, leave_mib << 20);
    std::ofstream f(dir_ / "disk" / "filler", std::ios::binary);
    const std::string mib(1 << 20, '\0');
    for (uint64_t left = free_bytes - (leave_mib << 20); left > 0;) {
      const uint64_t n = std::min<uint64_t>(left, mib.size());
      f.write(mib.data(), static_cast<std::streamsize>(n));
      left -= n;
    }
    ASSERT_TRUE(f.good());
  }

  std::unique_ptr<TestBed> bed_;
  std::filesystem::path dir_;
  bool mounted_ = false;
  TestBed::Side side_[kNodes] = {};
  std::vector<std::string> args_[kNodes];
  testing::FerrydProcess proc_[kNodes];
  std::vector<std::thread> threads_;
  std::atomic<bool> running_{false};
  std::atomic<bool> rail_down_{false};

  absl::Mutex mu_;
  View view_[kNodes] ABSL_GUARDED_BY(mu_);
  std::vector<Record> records_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> failures_ ABSL_GUARDED_BY(mu_);
  Counts counts_ ABSL_GUARDED_BY(mu_);
  int completed_since_[kNodes][kNodes] ABSL_GUARDED_BY(mu_) = {};
  bool disk_full_ ABSL_GUARDED_BY(mu_) = false;
  std::string phase_ ABSL_GUARDED_BY(mu_) = "start";  // for the failures' messages
};

TEST_F(ChaosTest, KillsARailDownAndAFullDiskLoseNothingAcknowledged) {
  const char* env = std::getenv("FERRY_CHAOS_ROUNDS");
  const int rounds = env != nullptr ? std::max(0, std::atoi(env)) : 6;
  StartWorkload(rounds);
  ASSERT_NO_FATAL_FAILURE(WaitForPulls(2, "at the start"));

  for (int round = 0; round < rounds; ++round) {
    const int victim = round % kNodes;
    const std::string phase = absl::StrCat("round ", round, ": kill -9 of the ", kNodeName[victim]);
    SCOPED_TRACE(phase);
    Phase(phase);
    ASSERT_NO_FATAL_FAILURE(WaitForPulls(2, "before the kill"));
    Kill9(victim);
    for (int n = 0; n < kNodes; ++n) {
      if (n != victim) ExpectAlive(n);
    }
    ASSERT_NO_FATAL_FAILURE(Start(victim));
    ASSERT_NO_FATAL_FAILURE(CheckRecords(victim, /*bytes=*/false));
    ASSERT_NO_FATAL_FAILURE(WaitForPulls(1, "after the restart"));
  }

  {
    SCOPED_TRACE("rail 0 down at the source's end during a 64 MiB pull and the workload");
    Phase("rail down");
    const Blob big{"big", 77, 64u << 20};
    auto put = Client(Snapshot(kS).url)
                   .Put("/v1/objects/big/data", PatternBytes(big), "application/octet-stream");
    ASSERT_TRUE(put && put->status == 201);
    const View s = Snapshot(kS);
    const uint64_t base = SourceSent();
    std::optional<httplib::Result> pulled;
    std::thread pull([&] {
      pulled = Client(Snapshot(kD).url)
                   .Post("/v1/pulls",
                         json{{"from", s.peer_url},
                              {"object", "big"},
                              {"as", "big-copy"},
                              {"into", {{"device", "host"}}}}
                             .dump(),
                         "application/json");
    });
    const absl::Time give_up = absl::Now() + absl::Seconds(60);
    while (SourceSent() < base + (8u << 20) && absl::Now() < give_up) {
      absl::SleepFor(absl::Milliseconds(2));
    }
    rail_down_ = true;
    ASSERT_TRUE(bed_->SetRailEnd(TestBed::kA, 0, false).ok());
    pull.join();
    ASSERT_TRUE(*pulled && (*pulled)->status == 200) << (*pulled ? (*pulled)->body : "no answer");
    EXPECT_THAT(json::parse((*pulled)->body)["failed_rails"].get<std::vector<size_t>>(),
                ::testing::Contains(0u));
    auto back = Client(Snapshot(kD).url).Get("/v1/objects/big-copy/data");
    EXPECT_TRUE(back && Matches(big, back->body));
    ASSERT_NO_FATAL_FAILURE(WaitForPulls(2, "with a rail down"));
    ASSERT_TRUE(bed_->SetRailEnd(TestBed::kA, 0, true).ok());
    rail_down_ = false;
    Phase("rail back up");
  }

  {
    SCOPED_TRACE("the source's data disk filled during publishes, then freed");
    Phase("disk full");
    {
      absl::MutexLock lock(&mu_);
      disk_full_ = true;
    }
    ASSERT_NO_FATAL_FAILURE(FillDisk(kMarginMiB / 2));
    EXPECT_TRUE(WaitFor([&]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
      return counts_.publishes_refused_full > 0;
    })) << "no publish was refused";
    ASSERT_NO_FATAL_FAILURE(WaitForPulls(2, "from a source with a full disk"));
    std::filesystem::remove(dir_ / "disk" / "filler");
    ASSERT_NO_FATAL_FAILURE(WaitForPulls(2, "after the disk was freed"));
    absl::MutexLock lock(&mu_);
    disk_full_ = false;
  }

  StopWorkload();
  for (int n = 0; n < kNodes; ++n) {
    ExpectAlive(n);
    ASSERT_NO_FATAL_FAILURE(CheckRecords(n, /*bytes=*/true));
  }
  absl::MutexLock lock(&mu_);
  for (const std::string& f : failures_) ADD_FAILURE() << f;
  const Counts& c = counts_;
  json summary = {
      {"kill_rounds", rounds},
      {"kills", {{"source", c.kills[kS]}, {"destination", c.kills[kD]}, {"third", c.kills[kT]}}},
      {"publishes_acked", c.publishes_acked},
      {"publishes_refused_disk_full", c.publishes_refused_full},
      {"publishes_cut_by_kill", c.publishes_cut},
      {"pulls_completed", c.pulls_completed},
      {"pulls_read_back", c.pulls_read_back},
      {"pulls_over_rail_down", c.pulls_over_rail_down},
      {"pulls_cut_by_kill", c.pulls_cut},
      {"pulls_503_by_kill", c.pulls_unavailable},
      {"copies_deleted", c.copies_deleted},
      {"records_checked_after_restarts", c.records_checked_after_restart},
      {"objects_read_back_at_end", c.bytes_checked_at_end},
      {"failures", failures_.size()}};
  std::printf("chaos: %s\n", summary.dump().c_str());
  EXPECT_GE(c.publishes_refused_full, 1);
}

}  // namespace
}  // namespace ferry
