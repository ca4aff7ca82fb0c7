// Prometheus metrics of a node: counter, gauge and histogram families with labels, written in
// Prometheus' text exposition format (version 0.0.4). Names and units follow Prometheus'
// conventions: ferry_..._total for counters, base units (_bytes, _seconds).
#ifndef FERRY_SERVER_METRICS_H_
#define FERRY_SERVER_METRICS_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"

namespace ferry::server {

// Writes families one after the other: each family's # HELP and # TYPE lines, then its
// samples. Label values are escaped as the format wants.
class MetricsText {
 public:
  using Labels = std::vector<std::pair<std::string_view, std::string>>;
  // `type`: "counter", "gauge" or "histogram".
  void Family(std::string_view name, std::string_view type, std::string_view help);
  void Sample(std::string_view name, const Labels& labels, double value);
  const std::string& text() const { return text_; }

 private:
  std::string text_;
};

// A family whose samples the node adds to as things happen (per pull, per request; never per
// WRITE). Thread-safe.
class MetricFamily {
 public:
  // A counter, or with `bounds` (upper bounds, ascending) a histogram.
  MetricFamily(std::string name, std::string help, std::vector<std::string> label_names,
               std::vector<double> bounds = {});
  // `values`: one per label name, in order.
  void Add(const std::vector<std::string>& values, double amount = 1);
  void Observe(const std::vector<std::string>& values, double value);
  void Write(MetricsText& out) const;
  // From now on Add and Observe do nothing (to measure what counting costs).
  void Disable() { enabled_ = false; }

 private:
  struct Series {
    double value = 0;               // a counter's value; a histogram's sum
    uint64_t count = 0;             // a histogram's observations
    std::vector<uint64_t> buckets;  // a histogram's, per bound (not cumulative)
  };
  const std::string name_;
  const std::string help_;
  const std::vector<std::string> label_names_;
  const std::vector<double> bounds_;
  std::atomic<bool> enabled_{true};
  mutable absl::Mutex mu_;
  std::map<std::vector<std::string>, Series> series_ ABSL_GUARDED_BY(mu_);
};

// The pulls running on a node and the last ones that ended (what the status page shows).
// Thread-safe.
class PullLog {
 public:
  struct Entry {
    uint64_t id = 0;
    std::string role;  // "destination" or "source"
    std::string object;
    std::string peer;  // the source's URL, or the destination's node id
    std::string path;
    uint64_t bytes = 0;      // running: the bytes asked for (0 when not known yet)
    int64_t started_ms = 0;  // Unix milliseconds
    double seconds = 0;      // running: so far
    std::string outcome;     // empty while running; then as OutcomeName
    std::string error;       // a failure's message
  };
  static constexpr size_t kRecent = 50;

  uint64_t Begin(std::string role, std::string object, std::string peer, std::string path,
                 uint64_t bytes);
  // Moves pull `id` to the recent ones (the oldest of which goes past kRecent).
  void End(uint64_t id, std::string_view path, const absl::Status& outcome, uint64_t bytes);
  std::vector<Entry> Running() const;
  std::vector<Entry> Recent() const;  // newest first

 private:
  mutable absl::Mutex mu_;
  uint64_t next_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<uint64_t, Entry> running_ ABSL_GUARDED_BY(mu_);
  std::deque<Entry> recent_ ABSL_GUARDED_BY(mu_);
};

// What a node counts of its own activity (the engine counts its rails; the catalog and the
// regions are read when scraped).
struct NodeMetrics {
  NodeMetrics();
  // Pull `log_id` of `log` ended on this node as "destination" or "source".
  void PullEnded(uint64_t log_id, std::string_view role, std::string_view path,
                 const absl::Status& outcome, uint64_t bytes, double seconds);

  MetricFamily pulls;             // {role, path, outcome}
  MetricFamily pull_bytes;        // {role, path}: bytes of the pulls that succeeded
  MetricFamily pull_seconds;      // histogram {role}
  MetricFamily pull_size;         // histogram {role}: bytes of each pull that succeeded
  MetricFamily round_trips;       // histogram {type, via}: a control message and its answer
  MetricFamily http_requests;     // {route, code}
  MetricFamily http_slow_closed;  // {why}: connections closed for being slow (HttpServer)
  MetricFamily upload_bytes;      // {how}: "streamed" into their buffer, or "buffered" whole first
  PullLog log;                    // kept when the counting is disabled
  void Write(MetricsText& out) const;
  void Disable();
};

// The lower-case name of a status code ("ok", "unavailable", "deadline_exceeded").
std::string OutcomeName(absl::StatusCode code);

}  // namespace ferry::server

#endif  // FERRY_SERVER_METRICS_H_
