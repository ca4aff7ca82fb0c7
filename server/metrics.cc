#include "server/metrics.h"

#include <array>
#include <cmath>
#include <cstdio>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace ferry::server {
namespace {

// Integers exactly (byte counters pass 2^32), anything else with every digit a double has.
std::string Number(double v) {
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  if (v == std::floor(v) && std::fabs(v) < 9007199254740992.0) {
    return absl::StrCat(static_cast<int64_t>(v));
  }
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.17g", v);
  return buf;
}

void AppendEscaped(std::string& out, std::string_view value) {
  for (char c : value) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '"') {
      out += "\\\"";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
}

std::vector<double> Powers(double first, double factor, int n) {
  std::vector<double> out;
  for (double b = first; n-- > 0; b *= factor) out.push_back(b);
  return out;
}

}  // namespace

void MetricsText::Family(std::string_view name, std::string_view type, std::string_view help) {
  for (std::string_view part :
       {std::string_view("# HELP "), name, std::string_view(" "), help,
        std::string_view("\n# TYPE "), name, std::string_view(" "), type, std::string_view("\n")}) {
    text_ += part;
  }
}

void MetricsText::Sample(std::string_view name, const Labels& labels, double value) {
  text_ += name;
  if (!labels.empty()) {
    text_ += '{';
    for (size_t i = 0; i < labels.size(); ++i) {
      if (i > 0) text_ += ',';
      text_ += labels[i].first;
      text_ += "=\"";
      AppendEscaped(text_, labels[i].second);
      text_ += '"';
    }
    text_ += '}';
  }
  text_ += ' ';
  text_ += Number(value);
  text_ += '\n';
}

MetricFamily::MetricFamily(std::string name, std::string help, std::vector<std::string> label_names,
                           std::vector<double> bounds)
    : name_(std::move(name)),
      help_(std::move(help)),
      label_names_(std::move(label_names)),
      bounds_(std::move(bounds)) {}

void MetricFamily::Add(const std::vector<std::string>& values, double amount) {
  if (!enabled_.load(std::memory_order_relaxed)) return;
  absl::MutexLock lock(&mu_);
  series_[values].value += amount;
}

void MetricFamily::Observe(const std::vector<std::string>& values, double value) {
  if (!enabled_.load(std::memory_order_relaxed)) return;
  absl::MutexLock lock(&mu_);
  Series& s = series_[values];
  s.buckets.resize(bounds_.size());
  for (size_t i = 0; i < bounds_.size(); ++i) {
    if (value <= bounds_[i]) {
      ++s.buckets[i];
      break;
    }
  }
  s.value += value;
  ++s.count;
}

void MetricFamily::Write(MetricsText& out) const {
  out.Family(name_, bounds_.empty() ? "counter" : "histogram", help_);
  absl::MutexLock lock(&mu_);
  for (const auto& [values, s] : series_) {
    MetricsText::Labels labels;
    for (size_t i = 0; i < label_names_.size(); ++i)
      labels.emplace_back(label_names_[i], values[i]);
    if (bounds_.empty()) {
      out.Sample(name_, labels, s.value);
      continue;
    }
    const std::string bucket = name_ + "_bucket";
    uint64_t cumulative = 0;
    labels.emplace_back("le", "");
    for (size_t i = 0; i <= bounds_.size(); ++i) {
      cumulative += i < bounds_.size() ? s.buckets[i] : 0;
      labels.back().second = i < bounds_.size() ? Number(bounds_[i]) : "+Inf";
      out.Sample(bucket, labels, static_cast<double>(i < bounds_.size() ? cumulative : s.count));
    }
    labels.pop_back();
    out.Sample(name_ + "_sum", labels, s.value);
    out.Sample(name_ + "_count", labels, static_cast<double>(s.count));
  }
}

NodeMetrics::NodeMetrics()
    : pulls("ferry_pulls_total", "Pulls that ended on this node, by role, path and outcome.",
            {"role", "path", "outcome"}),
      pull_bytes("ferry_pull_bytes_total", "Bytes of the pulls that succeeded.", {"role", "path"}),
      pull_seconds("ferry_pull_duration_seconds", "How long the pulls that succeeded took.",
                   {"role"}, Powers(50e-6, 2, 21)),
      pull_size("ferry_pull_size_bytes", "Size of the pulls that succeeded.", {"role"},
                Powers(4096, 4, 12)),
      round_trips("ferry_control_round_trip_seconds",
                  "A control message to another node and its answer, by type and transport.",
                  {"type", "via"}, Powers(10e-6, 2, 20)),
      http_requests("ferry_http_requests_total", "HTTP requests answered, by route and code.",
                    {"route", "code"}),
      http_slow_closed("ferry_http_slow_closed_total",
                       "HTTP connections closed for being slow, by why: head (the request's head "
                       "came too late), rate (a body or an answer fell behind the minimum rate), "
                       "slots (too many requests were slow at once).",
                       {"why"}),
      upload_bytes("ferry_upload_bytes_total",
                   "Bytes of the uploads stored, by how: streamed into their buffer as they came, "
                   "or buffered whole first (a body without a Content-Length).",
                   {"how"}) {}

void NodeMetrics::PullEnded(uint64_t log_id, std::string_view role, std::string_view path,
                            const absl::Status& outcome, uint64_t bytes, double seconds) {
  log.End(log_id, path, outcome, bytes);
  const std::string r(role), p(path);
  pulls.Add({r, p, OutcomeName(outcome.code())});
  if (!outcome.ok()) return;
  pull_bytes.Add({r, p}, static_cast<double>(bytes));
  pull_seconds.Observe({r}, seconds);
  pull_size.Observe({r}, static_cast<double>(bytes));
}

namespace {

// Every family of `m` (const or not, as `m` is).
template <typename Metrics>
auto Families(Metrics& m) {
  return std::array{&m.pulls,       &m.pull_bytes,    &m.pull_seconds,     &m.pull_size,
                    &m.round_trips, &m.http_requests, &m.http_slow_closed, &m.upload_bytes};
}

}  // namespace

void NodeMetrics::Write(MetricsText& out) const {
  for (const MetricFamily* f : Families(*this)) f->Write(out);
}

void NodeMetrics::Disable() {
  for (MetricFamily* f : Families(*this)) f->Disable();
}

uint64_t PullLog::Begin(std::string role, std::string object, std::string peer, std::string path,
                        uint64_t bytes) {
  absl::MutexLock lock(&mu_);
  const uint64_t id = next_++;
  running_[id] = {.id = id,
                  .role = std::move(role),
                  .object = std::move(object),
                  .peer = std::move(peer),
                  .path = std::move(path),
                  .bytes = bytes,
                  .started_ms = absl::ToUnixMillis(absl::Now())};
  return id;
}

void PullLog::End(uint64_t id, std::string_view path, const absl::Status& outcome, uint64_t bytes) {
  absl::MutexLock lock(&mu_);
  auto it = running_.find(id);
  if (it == running_.end()) return;
  Entry e = std::move(it->second);
  running_.erase(it);
  e.path = std::string(path);
  if (outcome.ok()) e.bytes = bytes;
  e.seconds = static_cast<double>(absl::ToUnixMillis(absl::Now()) - e.started_ms) / 1e3;
  e.outcome = OutcomeName(outcome.code());
  e.error = std::string(outcome.message());
  recent_.push_front(std::move(e));
  if (recent_.size() > kRecent) recent_.pop_back();
}

std::vector<PullLog::Entry> PullLog::Running() const {
  const int64_t now = absl::ToUnixMillis(absl::Now());
  absl::MutexLock lock(&mu_);
  std::vector<Entry> out;
  for (const auto& [id, e] : running_) {
    out.push_back(e);
    out.back().seconds = static_cast<double>(now - e.started_ms) / 1e3;
  }
  return out;
}

std::vector<PullLog::Entry> PullLog::Recent() const {
  absl::MutexLock lock(&mu_);
  return {recent_.begin(), recent_.end()};
}

std::string OutcomeName(absl::StatusCode code) {
  return absl::AsciiStrToLower(absl::StatusCodeToString(code));
}

}  // namespace ferry::server
