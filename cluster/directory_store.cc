#include "cluster/directory_store.h"

#include <httplib.h>
#include <rocksdb/db.h>
#include <rocksdb/write_batch.h>

#include <filesystem>
#include <random>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "metadata/catalog.h"
#include "nlohmann/json.hpp"
#include "wire/http_status.h"

namespace ferry::cluster {
namespace {

using nlohmann::json;

// Keys: "k" + key -> lease (8 bytes, big-endian) + value; "l" + lease (8 bytes) -> TTL in
// seconds (8 bytes).
constexpr char kKey = 'k';
constexpr char kLease = 'l';
constexpr absl::Duration kMaxTtl = absl::Hours(24);

std::string U64(uint64_t v) {
  std::string s(8, '\0');
  for (size_t i = 8; i-- > 0; v >>= 8) s[i] = static_cast<char>(v & 0xff);
  return s;
}

uint64_t ReadU64(std::string_view s) {
  uint64_t v = 0;
  for (size_t i = 0; i < 8 && i < s.size(); ++i) v = (v << 8) | static_cast<unsigned char>(s[i]);
  return v;
}

absl::Status FromRocks(const rocksdb::Status& s, const char* what) {
  if (s.ok()) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("directory store: ", what, ": ", s.ToString()));
}

rocksdb::WriteOptions Soft() {
  // The records are soft state: nodes put them again when their lease is gone.
  rocksdb::WriteOptions wo;
  wo.sync = false;
  return wo;
}

}  // namespace

absl::StatusOr<std::unique_ptr<DirectoryStore>> DirectoryStore::Open(const std::string& dir,
                                                                     uint64_t min_free_bytes) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    return absl::InternalError(
        absl::StrCat("directory store: cannot create ", dir, ": ", ec.message()));
  }
  RETURN_IF_ERROR(metadata::CheckFreeSpace(dir, min_free_bytes));
  rocksdb::Options options;
  options.create_if_missing = true;
  rocksdb::DB* db = nullptr;
  RETURN_IF_ERROR(FromRocks(rocksdb::DB::Open(options, dir, &db), "open"));
  std::unique_ptr<DirectoryStore> store(
      new DirectoryStore(std::unique_ptr<rocksdb::DB>(db), dir, min_free_bytes));
  RETURN_IF_ERROR(store->Load());
  store->expirer_ = std::thread([s = store.get()] { s->ExpireLoop(); });
  return store;
}

DirectoryStore::DirectoryStore(std::unique_ptr<rocksdb::DB> db, std::string dir,
                               uint64_t min_free_bytes)
    : db_(std::move(db)), dir_(std::move(dir)), min_free_bytes_(min_free_bytes) {
  std::random_device rd;
  // Lease ids differ between runs, as etcd's do: a node holding an id from before a restart
  // does not renew somebody else's lease.
  next_lease_ = static_cast<int64_t>((uint64_t{rd()} << 31 | rd()) & 0x3fffffffffffULL) + 1;
}

DirectoryStore::~DirectoryStore() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (expirer_.joinable()) expirer_.join();
}

absl::Status DirectoryStore::Load() {
  absl::MutexLock lock(&mu_);
  const absl::Time now = absl::Now();
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator({}));
  for (it->Seek(std::string(1, kLease)); it->Valid() && it->key()[0] == kLease; it->Next()) {
    const int64_t id = static_cast<int64_t>(ReadU64(it->key().ToStringView().substr(1)));
    const absl::Duration ttl =
        absl::Seconds(static_cast<int64_t>(ReadU64(it->value().ToStringView())));
    // As etcd does: a lease's clock starts again when the store comes back.
    leases_[id] = Lease{ttl, now + ttl, {}};
    next_lease_ = std::max(next_lease_, id + 1);
  }
  for (it->Seek(std::string(1, kKey)); it->Valid() && it->key()[0] == kKey; it->Next()) {
    const int64_t lease = static_cast<int64_t>(ReadU64(it->value().ToStringView()));
    if (lease == 0) continue;
    std::string key(it->key().ToStringView().substr(1));
    auto l = leases_.find(lease);
    if (l == leases_.end()) continue;  // ended while its keys were being written: dropped below
    l->second.keys.insert(key);
    key_lease_[key] = lease;
  }
  return FromRocks(it->status(), "load");
}

absl::StatusOr<int64_t> DirectoryStore::Grant(absl::Duration ttl) {
  if (ttl < absl::Seconds(1) || ttl > kMaxTtl) {
    return absl::InvalidArgumentError("a lease's TTL is 1 s to a day");
  }
  ttl = absl::Seconds(absl::ToInt64Seconds(ttl));
  RETURN_IF_ERROR(Writable());
  absl::MutexLock lock(&mu_);
  const int64_t id = next_lease_++;
  RETURN_IF_ERROR(FromRocks(db_->Put(Soft(), kLease + U64(static_cast<uint64_t>(id)),
                                     U64(static_cast<uint64_t>(absl::ToInt64Seconds(ttl)))),
                            "grant"));
  leases_[id] = Lease{ttl, absl::Now() + ttl, {}};
  return id;
}

absl::StatusOr<absl::Duration> DirectoryStore::KeepAlive(int64_t lease) {
  absl::MutexLock lock(&mu_);
  auto it = leases_.find(lease);
  if (it == leases_.end() || it->second.deadline <= absl::Now()) {
    return absl::NotFoundError("requested lease not found");
  }
  it->second.deadline = absl::Now() + it->second.ttl;
  return it->second.ttl;
}

absl::Status DirectoryStore::Revoke(int64_t lease) {
  absl::MutexLock lock(&mu_);
  if (!leases_.contains(lease)) return absl::NotFoundError("requested lease not found");
  return EndLocked(lease);
}

absl::Status DirectoryStore::EndLocked(int64_t id) {
  RETURN_IF_ERROR(Writable());
  auto it = leases_.find(id);
  rocksdb::WriteBatch batch;
  for (const std::string& key : it->second.keys) {
    batch.Delete(kKey + key);
    key_lease_.erase(key);
  }
  batch.Delete(kLease + U64(static_cast<uint64_t>(id)));
  leases_.erase(it);
  return FromRocks(db_->Write(Soft(), &batch), "end lease");
}

void DirectoryStore::Unlease(const std::string& key) {
  auto it = key_lease_.find(key);
  if (it == key_lease_.end()) return;
  auto l = leases_.find(it->second);
  if (l != leases_.end()) l->second.keys.erase(key);
  key_lease_.erase(it);
}

absl::Status DirectoryStore::Put(const std::string& key, const std::string& value, int64_t lease) {
  if (key.empty()) return absl::InvalidArgumentError("key is not provided");
  absl::MutexLock lock(&mu_);
  auto l = leases_.find(lease);
  if (lease != 0 && l == leases_.end()) return absl::NotFoundError("requested lease not found");
  RETURN_IF_ERROR(Writable());
  RETURN_IF_ERROR(
      FromRocks(db_->Put(Soft(), kKey + key, U64(static_cast<uint64_t>(lease)) + value), "put"));
  Unlease(key);
  if (lease != 0) {
    l->second.keys.insert(key);
    key_lease_[key] = lease;
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<KeyValue>> DirectoryStore::Range(const std::string& key,
                                                            const std::string& range_end) {
  std::vector<KeyValue> out;
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator({}));
  const std::string end = range_end.empty() ? std::string() : kKey + range_end;
  const bool to_last = range_end == std::string(1, '\0');
  for (it->Seek(kKey + key); it->Valid() && it->key()[0] == kKey; it->Next()) {
    const std::string_view k = it->key().ToStringView();
    if (range_end.empty() ? k.substr(1) != key : (!to_last && k >= end)) break;
    const std::string_view v = it->value().ToStringView();
    out.push_back(
        {std::string(k.substr(1)), std::string(v.substr(8)), static_cast<int64_t>(ReadU64(v))});
  }
  RETURN_IF_ERROR(FromRocks(it->status(), "range"));
  return out;
}

absl::StatusOr<int64_t> DirectoryStore::DeleteRange(const std::string& key,
                                                    const std::string& range_end) {
  RETURN_IF_ERROR(Writable());
  absl::MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(std::vector<KeyValue> found, Range(key, range_end));
  rocksdb::WriteBatch batch;
  for (const KeyValue& kv : found) {
    batch.Delete(kKey + kv.key);
    Unlease(kv.key);
  }
  RETURN_IF_ERROR(FromRocks(db_->Write(Soft(), &batch), "delete"));
  return static_cast<int64_t>(found.size());
}

absl::Status DirectoryStore::Writable() const {
  return metadata::CheckFreeSpace(dir_, min_free_bytes_);
}

void DirectoryStore::ExpireNow() {
  absl::MutexLock lock(&mu_);
  const absl::Time now = absl::Now();
  std::vector<int64_t> due;
  for (const auto& [id, lease] : leases_) {
    if (lease.deadline <= now) due.push_back(id);
  }
  for (int64_t id : due) IgnoreError(EndLocked(id));
}

void DirectoryStore::ExpireLoop() {
  const absl::Duration tick = absl::Milliseconds(100);
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      if (mu_.AwaitWithTimeout(absl::Condition(&stop_), tick)) return;
    }
    ExpireNow();
  }
}

// --- The JSON gateway's routes. ---
namespace {

// A base64 field; false when it is there but not base64.
bool JsonBytes(const json& j, const char* key, std::string& out) {
  auto it = j.find(key);
  if (it == j.end()) return true;
  return it->is_string() && absl::Base64Unescape(it->get<std::string>(), &out);
}

int HttpStatusOf(const absl::Status& s) {
  if (auto status = HttpStatusOverride(s)) return *status;  // 507 for a disk short of room
  switch (s.code()) {
    case absl::StatusCode::kInvalidArgument:
      return 400;
    case absl::StatusCode::kNotFound:
      return 404;
    default:
      return 500;
  }
}

// The answer in the gateway's shape: the result with a header, or {"error", "message", "code"}.
void Answer(httplib::Response& res, const absl::StatusOr<json>& result) {
  if (!result.ok()) {
    const std::string m(result.status().message());
    res.status = HttpStatusOf(result.status());
    res.set_content(
        json{{"error", m}, {"message", m}, {"code", static_cast<int>(result.status().code())}}
            .dump(),
        "application/json");
    return;
  }
  json body = *result;
  body["header"] = json::object();
  res.set_content(body.dump(), "application/json");
}

constexpr size_t kMaxBody = size_t{4} << 20;

using Route = std::function<absl::StatusOr<json>(DirectoryStore&, const json&)>;

}  // namespace

void InstallDirectoryRoutes(httplib::Server& server, DirectoryStore& store, DirectoryGuard guard) {
  auto route = [&server, &store, guard](const char* path, Route r) {
    // With a content reader, as every POST route of ferryd's (httplib tries those first).
    server.Post(path, [&store, guard, r](const httplib::Request& req, httplib::Response& res,
                                         const httplib::ContentReader& reader) {
      if (!guard(req, res)) return;
      std::string body;
      const bool whole = reader([&body](const char* data, size_t n) {
        body.append(data, n);
        return body.size() <= kMaxBody;
      });
      if (!whole) {
        return Answer(res, absl::InvalidArgumentError("the body is over 4 MiB"));
      }
      json j = json::parse(body, nullptr, false);
      if (!j.is_object()) {
        return Answer(res, absl::InvalidArgumentError("the body is not a JSON object"));
      }
      Answer(res, r(store, j));
    });
  };
  route("/v3/lease/grant", [](DirectoryStore& s, const json& j) -> absl::StatusOr<json> {
    ASSIGN_OR_RETURN(int64_t id, s.Grant(absl::Seconds(GatewayInt(j, "TTL"))));
    return json{{"ID", std::to_string(id)}, {"TTL", std::to_string(GatewayInt(j, "TTL"))}};
  });
  route("/v3/lease/keepalive", [](DirectoryStore& s, const json& j) -> absl::StatusOr<json> {
    const int64_t id = GatewayInt(j, "ID");
    json result = {{"ID", std::to_string(id)}};
    // As etcd: a lease that is gone is an answer without a TTL, not an error.
    absl::StatusOr<absl::Duration> ttl = s.KeepAlive(id);
    if (ttl.ok()) result["TTL"] = std::to_string(absl::ToInt64Seconds(*ttl));
    return json{{"result", result}};
  });
  route("/v3/lease/revoke", [](DirectoryStore& s, const json& j) -> absl::StatusOr<json> {
    RETURN_IF_ERROR(s.Revoke(GatewayInt(j, "ID")));
    return json::object();
  });
  route("/v3/kv/put", [](DirectoryStore& s, const json& j) -> absl::StatusOr<json> {
    std::string key, value;
    if (!JsonBytes(j, "key", key) || !JsonBytes(j, "value", value)) {
      return absl::InvalidArgumentError("key and value are base64");
    }
    RETURN_IF_ERROR(s.Put(key, value, GatewayInt(j, "lease")));
    return json::object();
  });
  route("/v3/kv/range", [](DirectoryStore& s, const json& j) -> absl::StatusOr<json> {
    std::string key, end;
    if (!JsonBytes(j, "key", key) || !JsonBytes(j, "range_end", end)) {
      return absl::InvalidArgumentError("key and range_end are base64");
    }
    ASSIGN_OR_RETURN(std::vector<KeyValue> kvs, s.Range(key, end));
    json out = json::array();
    for (const KeyValue& kv : kvs) {
      json e = {{"key", absl::Base64Escape(kv.key)}, {"value", absl::Base64Escape(kv.value)}};
      if (kv.lease != 0) e["lease"] = std::to_string(kv.lease);
      out.push_back(std::move(e));
    }
    const size_t n = out.size();
    return json{{"kvs", std::move(out)}, {"count", std::to_string(n)}};
  });
  route("/v3/kv/deleterange", [](DirectoryStore& s, const json& j) -> absl::StatusOr<json> {
    std::string key, end;
    if (!JsonBytes(j, "key", key) || !JsonBytes(j, "range_end", end)) {
      return absl::InvalidArgumentError("key and range_end are base64");
    }
    ASSIGN_OR_RETURN(int64_t n, s.DeleteRange(key, end));
    return json{{"deleted", std::to_string(n)}};
  });
}

}  // namespace ferry::cluster
