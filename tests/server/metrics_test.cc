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
  m.PullEnded("destination", "rdma", absl::OkStatus(), 4096, 0.001);
  m.PullEnded("destination", "rdma", absl::UnavailableError("gone"), 4096, 0.001);
  MetricsText out;
  m.pulls.Write(out);
  m.pull_bytes.Write(out);
  const std::string& t = out.text();
  EXPECT_NE(t.find("ferry_pulls_total{role=\"destination\",path=\"rdma\",outcome=\"ok\"} 1\n"),
            std::string::npos);
  EXPECT_NE(t.find("outcome=\"unavailable\"} 1\n"), std::string::npos);
  EXPECT_NE(t.find("ferry_pull_bytes_total{role=\"destination\",path=\"rdma\"} 4096\n"),
            std::string::npos);
}

}  // namespace
}  // namespace ferry::server
