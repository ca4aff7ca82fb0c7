// The Prometheus text format as MetricsText and MetricFamily write it.
#include "server/metrics.h"

#include <gtest/gtest.h>

namespace ferry::server {
namespace {

TEST(MetricsTest, CountersSumPerLabelSetAndEscapeTheirValues) {
  MetricFamily f("ferry_things_total", "Things.", {"kind"});
  f.Add({"a"});
  f.Add({"a"}, 2);
  f.Add({"quote\"back\\slash\nline"}, 5000000000.0);
  MetricsText out;
  f.Write(out);
  EXPECT_EQ(out.text(),
            "# HELP ferry_things_total Things.\n"
            "# TYPE ferry_things_total counter\n"
            "ferry_things_total{kind=\"a\"} 3\n"
            "ferry_things_total{kind=\"quote\\\"back\\\\slash\\nline\"} 5000000000\n");
}

TEST(MetricsTest, HistogramBucketsAreCumulativeWithInfSumAndCount) {
  MetricFamily f("ferry_wait_seconds", "Waits.", {"role"}, {0.5, 1, 2});
  for (double v : {0.25, 0.5, 1.5, 7.0}) f.Observe({"x"}, v);
  MetricsText out;
  f.Write(out);
  EXPECT_EQ(out.text(),
            "# HELP ferry_wait_seconds Waits.\n"
            "# TYPE ferry_wait_seconds histogram\n"
            "ferry_wait_seconds_bucket{role=\"x\",le=\"0.5\"} 2\n"
            "ferry_wait_seconds_bucket{role=\"x\",le=\"1\"} 2\n"
            "ferry_wait_seconds_bucket{role=\"x\",le=\"2\"} 3\n"
            "ferry_wait_seconds_bucket{role=\"x\",le=\"+Inf\"} 4\n"
            "ferry_wait_seconds_sum{role=\"x\"} 9.25\n"
            "ferry_wait_seconds_count{role=\"x\"} 4\n");
}

TEST(MetricsTest, APullCountsItsOutcomeAndOnlySuccessesCountBytes) {
  NodeMetrics m;
  m.PullEnded(m.log.Begin("destination", "w", "http://a", "rdma", 4096), "destination", "rdma",
              absl::OkStatus(), 4096, 0.001);
  const uint64_t failing = m.log.Begin("destination", "w", "http://a", "rdma", 4096);
  ASSERT_EQ(m.log.Running().size(), 1u);
  EXPECT_EQ(m.log.Running()[0].object, "w");
  m.PullEnded(failing, "destination", "rdma", absl::UnavailableError("gone"), 4096, 0.001);
  MetricsText out;
  m.pulls.Write(out);
  m.pull_bytes.Write(out);
  const std::string& t = out.text();
  EXPECT_NE(t.find("ferry_pulls_total{role=\"destination\",path=\"rdma\",outcome=\"ok\"} 1\n"),
            std::string::npos);
  EXPECT_NE(t.find("outcome=\"unavailable\"} 1\n"), std::string::npos);
  EXPECT_NE(t.find("ferry_pull_bytes_total{role=\"destination\",path=\"rdma\"} 4096\n"),
            std::string::npos);
  // The log: nothing running, the failure newest first with its reason.
  EXPECT_TRUE(m.log.Running().empty());
  const std::vector<PullLog::Entry> recent = m.log.Recent();
  ASSERT_EQ(recent.size(), 2u);
  EXPECT_EQ(recent[0].outcome, "unavailable");
  EXPECT_EQ(recent[0].error, "gone");
  EXPECT_EQ(recent[1].outcome, "ok");
  EXPECT_EQ(recent[1].bytes, 4096u);
}

TEST(MetricsTest, TheLogKeepsTheLastPullsOnly) {
  PullLog log;
  for (size_t i = 0; i < PullLog::kRecent + 5; ++i) {
    log.End(log.Begin("source", "o" + std::to_string(i), "n", "rdma", 1), "rdma", absl::OkStatus(),
            1);
  }
  const auto recent = log.Recent();
  ASSERT_EQ(recent.size(), PullLog::kRecent);
  EXPECT_EQ(recent.front().object, "o" + std::to_string(PullLog::kRecent + 4));
  EXPECT_EQ(recent.back().object, "o5");
}

}  // namespace
}  // namespace ferry::server
