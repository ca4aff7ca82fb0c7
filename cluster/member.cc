#include "cluster/member.h"

#include <cstdio>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "spdlog/spdlog.h"

namespace ferry::cluster {
namespace {

using nlohmann::json;

constexpr char kNodes[] = "ferry/nodes/";
constexpr char kObjects[] = "ferry/objects/";

std::string HolderPrefix(const std::string& name) { return absl::StrCat(kObjects, name, "@"); }

std::string VersionText(uint64_t version) {
  char buf[24];
  std::snprintf(buf, sizeof buf, "%020llu", static_cast<unsigned long long>(version));
  return buf;
}

// A holder record's key and value back as a Holder; false for a key of another shape.
bool ParseHolder(const KeyValue& kv, Holder& h) {
  const size_t at = kv.key.rfind('@');
  if (at == std::string::npos || kv.key.size() < at + 22 || kv.key[at + 21] != '/') return false;
  if (!absl::SimpleAtoi(kv.key.substr(at + 1, 20), &h.version)) return false;
  h.node = kv.key.substr(at + 22);
  if (kv.key.rfind(kObjects, 0) != 0) return false;
  h.name = kv.key.substr(sizeof(kObjects) - 1, at - (sizeof(kObjects) - 1));
  json v = json::parse(kv.value, nullptr, false);
  if (!v.is_object()) return false;
  h.url = v.value("url", "");
  h.host = v.value("host", "");
  h.size = v.value("size", uint64_t{0});
  return true;
}

}  // namespace

std::string Membership::NodeKey(const std::string& node) { return absl::StrCat(kNodes, node); }

std::string Membership::HolderKey(const std::string& name, uint64_t version,
                                  const std::string& node) {
  return absl::StrCat(HolderPrefix(name), VersionText(version), "/", node);
}

Membership::Membership(std::unique_ptr<Directory> directory, std::string node_id,
                       absl::Duration ttl)
    : directory_(std::move(directory)), node_id_(std::move(node_id)), ttl_(ttl) {}

Membership::~Membership() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

void Membership::Join(json record) {
  absl::MutexLock lock(&mu_);
  if (joined_ || left_) return;
  joined_ = true;
  record_ = std::move(record);
  desired_[NodeKey(node_id_)] = record_.dump();
  thread_ = std::thread([this] { Run(); });
}

void Membership::Update(json record) {
  absl::MutexLock lock(&mu_);
  record_ = std::move(record);
  const std::string key = NodeKey(node_id_);
  desired_[key] = record_.dump();
  pending_[key] = desired_[key];
  kick_ = true;
}

std::string Membership::HolderValue(uint64_t size) const {
  return json{
      {"url", record_.value("url", "")}, {"host", record_.value("host", "")}, {"size", size}}
      .dump();
}

void Membership::Hold(const std::string& name, uint64_t version, uint64_t size) {
  absl::MutexLock lock(&mu_);
  const std::string key = HolderKey(name, version, node_id_);
  desired_[key] = HolderValue(size);
  pending_[key] = desired_[key];
  kick_ = true;
}

void Membership::Release(const std::string& name, std::optional<uint64_t> up_to) {
  absl::MutexLock lock(&mu_);
  const std::string prefix = HolderPrefix(name);
  const std::string last = up_to ? HolderKey(name, *up_to, node_id_) : Directory::PrefixEnd(prefix);
  for (auto it = desired_.lower_bound(prefix); it != desired_.end() && it->first <= last;) {
    Holder h;
    if (!ParseHolder({it->first, it->second}, h) || h.node != node_id_ ||
        (up_to && h.version > *up_to)) {
      ++it;
      continue;
    }
    pending_[it->first] = std::nullopt;
    it = desired_.erase(it);
  }
  kick_ = true;
}

void Membership::Leave() {
  int64_t lease = 0;
  {
    absl::MutexLock lock(&mu_);
    if (left_) return;
    left_ = true;
    stop_ = true;
    lease = lease_;
    lease_ = 0;
  }
  if (thread_.joinable()) thread_.join();
  if (lease == 0) return;
  if (absl::Status s = directory_->Revoke(lease); !s.ok()) {
    spdlog::warn("directory: leaving: {}", s.ToString());
  }
}

std::string Membership::state() {
  absl::MutexLock lock(&mu_);
  if (left_) return "left";
  if (!joined_) return "not joined";
  if (!error_.empty()) return error_;
  return lease_ != 0 ? "joined" : "joining";
}

absl::Status Membership::Flush(int64_t lease) {
  std::map<std::string, std::optional<std::string>> batch;
  {
    absl::MutexLock lock(&mu_);
    batch.swap(pending_);
    kick_ = false;
  }
  absl::Status failed;
  auto it = batch.begin();
  for (; it != batch.end(); ++it) {
    absl::Status s = it->second ? directory_->Put(it->first, *it->second, lease)
                                : directory_->Delete(it->first).status();
    if (!s.ok()) {
      failed = s;
      break;
    }
  }
  if (failed.ok()) return failed;
  absl::MutexLock lock(&mu_);
  // What did not go goes next time, unless something newer of the same key waits already.
  for (; it != batch.end(); ++it) pending_.emplace(it->first, std::move(it->second));
  return failed;
}

void Membership::Run() {
  // Renewed at a third of the TTL, as etcd's own clients do: two renewals may fail before the
  // lease expires.
  const absl::Duration renew_every = ttl_ / 3;
  const absl::Duration retry = std::min(renew_every, absl::Seconds(1));
  absl::Time next_renew = absl::InfinitePast();
  absl::Time backoff_until = absl::InfinitePast();
  for (;;) {
    int64_t lease = 0;
    {
      absl::MutexLock lock(&mu_);
      const absl::Time now = absl::Now();
      if (now < backoff_until) {
        mu_.AwaitWithDeadline(absl::Condition(&stop_), std::min(next_renew, backoff_until));
      } else {
        auto wake = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || kick_; };
        mu_.AwaitWithDeadline(absl::Condition(&wake), next_renew);
      }
      if (stop_) return;
      lease = lease_;
    }
    const absl::Time now = absl::Now();
    if (now < backoff_until && now < next_renew) continue;
    absl::Status s;
    if (lease == 0) {
      absl::StatusOr<int64_t> granted = directory_->Grant(ttl_);
      s = granted.status();
      if (s.ok()) {
        absl::MutexLock lock(&mu_);
        lease = lease_ = *granted;
        // A new lease: every record goes again under it.
        for (const auto& [key, value] : desired_) pending_[key] = value;
        next_renew = now + renew_every;
        spdlog::info("directory {}: joined with lease {:x}", directory_->url(), lease);
      }
    } else if (now >= next_renew) {
      s = directory_->KeepAlive(lease).status();
      if (s.ok()) next_renew = now + renew_every;
    }
    if (s.ok()) s = Flush(lease);
    absl::MutexLock lock(&mu_);
    if (s.ok()) {
      error_.clear();
      backoff_until = absl::InfinitePast();
      continue;
    }
    if (error_.empty()) spdlog::warn("directory {}: {}", directory_->url(), s.ToString());
    error_ = std::string(s.message());
    if (absl::IsNotFound(s) && lease != 0 && lease_ == lease) {
      lease_ = 0;  // expired or revoked: a new one, and every record again
      spdlog::warn("directory {}: lease {:x} lost; joining again", directory_->url(), lease);
      next_renew = absl::InfinitePast();
      continue;
    }
    backoff_until = absl::Now() + retry;
    next_renew = std::max(next_renew, backoff_until);
  }
}

absl::StatusOr<std::vector<Holder>> Membership::Holders(const std::string& name,
                                                        std::optional<uint64_t> version) {
  const std::string prefix =
      version ? absl::StrCat(HolderPrefix(name), VersionText(*version), "/") : HolderPrefix(name);
  ASSIGN_OR_RETURN(std::vector<KeyValue> kvs, directory_->Range(prefix));
  std::vector<Holder> out;
  for (const KeyValue& kv : kvs) {
    Holder h;
    if (ParseHolder(kv, h)) out.push_back(std::move(h));
  }
  if (!version && !out.empty()) {
    // Keys sort by version: the highest version's holders are the last ones.
    const uint64_t top = out.back().version;
    std::erase_if(out, [top](const Holder& h) { return h.version != top; });
  }
  return out;
}

absl::StatusOr<std::vector<NodeEntry>> Membership::Nodes() {
  ASSIGN_OR_RETURN(std::vector<KeyValue> nodes, directory_->Range(kNodes));
  ASSIGN_OR_RETURN(std::vector<KeyValue> objects, directory_->Range(kObjects));
  std::vector<NodeEntry> out;
  std::map<std::string, size_t> index;
  for (const KeyValue& kv : nodes) {
    json record = json::parse(kv.value, nullptr, false);
    if (!record.is_object()) continue;
    index[kv.key.substr(sizeof(kNodes) - 1)] = out.size();
    out.push_back({std::move(record), {}});
  }
  for (const KeyValue& kv : objects) {
    Holder h;
    if (!ParseHolder(kv, h)) continue;
    auto it = index.find(h.node);
    if (it == index.end()) continue;
    out[it->second].holds.push_back(std::move(h));
  }
  return out;
}

}  // namespace ferry::cluster
