#include "metadata/catalog.h"

#include <sys/statvfs.h>

#include <algorithm>
#include <iterator>
#include <limits>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/bytes.h"
#include "base/ids.h"
#include "base/status.h"
#include "nlohmann/json.hpp"
#include "rocksdb/db.h"
#include "rocksdb/write_batch.h"
#include "wire/http_status.h"

namespace ferry::metadata {
namespace {

constexpr char kSchemaKey[] = "schema_version";
constexpr char kSchemaVersion[] = "2";
// Schema 1 differs only in its records (JSON), which are read as they are.
constexpr char kOlderSchemaVersion[] = "1";
constexpr char kNodeIdKey[] = "node_id";
constexpr char kNextRegionKey[] = "next_region";

// RocksDB errors become Status here and nowhere else.
absl::Status FromRocksDb(const rocksdb::Status& s, std::string_view what) {
  if (s.ok()) return absl::OkStatus();
  std::string msg = absl::StrCat(std::string(what), ": ", s.ToString());
  if (s.IsNotFound()) return absl::NotFoundError(msg);
  if (s.IsCorruption()) return absl::DataLossError(msg);
  if (s.IsIOError() && s.ToString().find("lock") != std::string::npos) {
    return absl::UnavailableError(msg);
  }
  if (s.IsBusy() || s.IsTryAgain()) return absl::UnavailableError(msg);
  return absl::InternalError(msg);
}

std::string EncodeU64(uint64_t v) {
  std::string out(8, '\0');
  for (int i = 7; i >= 0; --i) {
    out[static_cast<size_t>(i)] = static_cast<char>(v & 0xff);
    v >>= 8;
  }
  return out;
}

uint64_t DecodeU64(std::string_view s) {
  uint64_t v = 0;
  for (char c : s.substr(0, 8)) v = (v << 8) | static_cast<uint8_t>(c);
  return v;
}

// Object keys: "L" name -> latest version; "V" name NUL version(8, big-endian) -> record.
// Names have no NUL, so "V" name NUL is a prefix of exactly one name's versions, and "L"
// keys list names in order.
std::string LatestKey(const std::string& name) { return "L" + name; }
std::string VersionPrefix(const std::string& name) { return "V" + name + std::string(1, '\0'); }
std::string VersionKey(const std::string& name, uint64_t v) {
  return VersionPrefix(name) + EncodeU64(v);
}

// The regions a layout has extents in, each once: a version counts once per region it uses.
std::set<uint64_t> RegionsOf(const std::vector<Extent>& extents) {
  std::set<uint64_t> out;
  for (const Extent& e : extents) out.insert(e.region);
  return out;
}

// Records are binary (schema 2): u8 format (2) | name | u64 version | u64 size |
// u64 created_ms | u32 n | n x (u64 region, u64 offset, u64 length)
// [| bytes meta [| bytes content_type [| u32 crc32c]]], little-endian: a record ends after the
// last of these it has (a record without any, after its extents). Stores of schema 1 hold JSON
// records, read as they are.
constexpr uint8_t kRecordFormat = 2;

}  // namespace

std::string EncodeRecord(const ObjectRecord& r) {
  std::string out;
  out.reserve(64 + r.name.size() + 24 * r.extents.size());
  ByteWriter w(&out);
  w.U8(kRecordFormat);
  w.Bytes(r.name);
  w.U64(r.version);
  w.U64(r.size);
  w.U64(static_cast<uint64_t>(r.created_ms));
  w.U32(static_cast<uint32_t>(r.extents.size()));
  for (const Extent& e : r.extents) {
    w.U64(e.region);
    w.U64(e.offset);
    w.U64(e.length);
  }
  const bool crc = r.crc32c.has_value(), type = crc || !r.content_type.empty();
  if (type || !r.meta.empty()) w.Bytes(r.meta);
  if (type) w.Bytes(r.content_type);
  if (crc) w.U32(*r.crc32c);
  return out;
}

namespace {

absl::StatusOr<ObjectRecord> DecodeJsonRecord(std::string_view value) {
  auto parsed = ParseJson(value);  // depth-limited: a damaged record must not take the stack
  if (!parsed.ok() || !parsed->is_object()) return absl::DataLossError("catalog: bad record");
  const nlohmann::json& j = *parsed;
  // Numbers of the wrong kind (a float too big for an integer) are refused, not converted.
  auto extent = [](const nlohmann::json& e) {
    return e.is_array() && e.size() == 3 && e[0].is_number_unsigned() &&
           e[1].is_number_unsigned() && e[2].is_number_unsigned();
  };
  const auto name = j.find("name"), version = j.find("version"), size = j.find("size"),
             created = j.find("created_ms"), extents = j.find("extents");
  if (name == j.end() || !name->is_string() || version == j.end() ||
      !version->is_number_unsigned() || size == j.end() || !size->is_number_unsigned() ||
      created == j.end() || !created->is_number_integer() || extents == j.end() ||
      !extents->is_array() || !std::all_of(extents->begin(), extents->end(), extent)) {
    return absl::DataLossError("catalog: bad record");
  }
  ObjectRecord r;
  r.name = name->get<std::string>();
  r.version = version->get<uint64_t>();
  r.size = size->get<uint64_t>();
  r.created_ms = created->get<int64_t>();
  for (const auto& e : *extents) {
    r.extents.push_back({e[0].get<uint64_t>(), e[1].get<uint64_t>(), e[2].get<uint64_t>()});
  }
  return r;
}

}  // namespace

absl::StatusOr<ObjectRecord> DecodeRecord(std::string_view value) {
  if (!value.empty() && value[0] == '{') return DecodeJsonRecord(value);
  ByteReader in(value);
  ObjectRecord r;
  uint8_t format = 0;
  uint64_t created = 0;
  uint32_t n = 0;
  if (!in.U8(&format) || format != kRecordFormat || !in.Bytes(&r.name) || !in.U64(&r.version) ||
      !in.U64(&r.size) || !in.U64(&created) || !in.U32(&n) || n > in.left() / 24) {
    return absl::DataLossError("catalog: bad record");
  }
  r.created_ms = static_cast<int64_t>(created);
  r.extents.resize(n);
  for (Extent& e : r.extents) {
    in.U64(&e.region);
    in.U64(&e.offset);
    in.U64(&e.length);
  }
  bool ok = in.left() == 0 || in.Bytes(&r.meta);
  if (ok && in.left() > 0) ok = in.Bytes(&r.content_type);
  if (ok && in.left() > 0) {
    uint32_t crc = 0;
    ok = in.U32(&crc);
    r.crc32c = crc;
  }
  if (!ok || in.left() != 0) return absl::DataLossError("catalog: bad record");
  return r;
}

namespace {

// Adds to `batch` the deletion of `name`'s versions up to `last` (inclusive) and their records
// to `removed`.
absl::Status DropVersions(rocksdb::DB& db, rocksdb::ColumnFamilyHandle* objects,
                          const std::string& name, uint64_t last, rocksdb::WriteBatch& batch,
                          std::vector<ObjectRecord>& removed) {
  const std::string end = VersionKey(name, last);
  std::unique_ptr<rocksdb::Iterator> it(db.NewIterator({}, objects));
  for (it->Seek(VersionPrefix(name)); it->Valid() && it->key().compare(end) <= 0; it->Next()) {
    ASSIGN_OR_RETURN(ObjectRecord r, DecodeRecord(it->value().ToString()));
    removed.push_back(std::move(r));
    batch.Delete(objects, it->key());
  }
  return FromRocksDb(it->status(), "scan versions");
}

}  // namespace

absl::Status CheckFreeSpace(const std::string& dir, uint64_t min_free) {
  struct statvfs v {};
  if (min_free == 0 || statvfs(dir.c_str(), &v) != 0) return absl::OkStatus();
  const uint64_t free = static_cast<uint64_t>(v.f_bavail) * v.f_frsize;
  if (free >= min_free) return absl::OkStatus();
  return InsufficientStorage(absl::StrCat("the data disk has ", free >> 20, " MiB free, below the ",
                                          min_free >> 20, " MiB ferryd keeps free (", dir, ")"));
}

absl::Status CheckLatest(const std::string& name, uint64_t latest, uint64_t want) {
  if (latest == want) return absl::OkStatus();
  return PreconditionFailed(
      want == 0 ? absl::StrCat("object '", name, "' exists (version ", latest, ")")
                : absl::StrCat("object '", name, "' is at version ", latest, ", not ", want));
}

absl::Status ValidateObjectName(const std::string& name) {
  if (name.empty() || name.size() > 256) {
    return absl::InvalidArgumentError("object name must be 1 to 256 characters");
  }
  for (char c : name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '_' || c == '-' || c == '/';
    if (!ok) {
      return absl::InvalidArgumentError(
          "object name may hold only letters, digits and the characters . _ - /");
    }
  }
  size_t start = 0;
  while (start <= name.size()) {
    size_t end = name.find('/', start);
    if (end == std::string::npos) end = name.size();
    std::string_view seg(name.data() + start, end - start);
    if (seg.empty() || seg == "." || seg == "..") {
      return absl::InvalidArgumentError("object name has an empty, \".\" or \"..\" segment");
    }
    start = end + 1;
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Catalog>> Catalog::Open(const std::string& dir,
                                                       const CatalogOptions& options) {
  std::unique_ptr<Catalog> c(new Catalog());
  c->options_ = options;
  c->dir_ = dir;
  // RocksDB (Debian's build, with its assertions) aborts on a write that finds the disk full,
  // and opening writes (a new log, the regions cleared): no write, opening included, goes to
  // the store without the room kept free.
  RETURN_IF_ERROR(CheckFreeSpace(dir, options.min_free_bytes));
  rocksdb::Options opts;
  opts.create_if_missing = true;
  opts.create_missing_column_families = true;
  std::vector<rocksdb::ColumnFamilyDescriptor> cfs = {
      {rocksdb::kDefaultColumnFamilyName, {}}, {"nodes", {}}, {"regions", {}}, {"objects", {}}};
  rocksdb::DB* db = nullptr;
  RETURN_IF_ERROR(FromRocksDb(rocksdb::DB::Open(opts, dir, cfs, &c->handles_, &db),
                              absl::StrCat("open catalog ", dir)));
  c->db_.reset(db);
  c->meta_ = c->handles_[0];
  c->nodes_ = c->handles_[1];
  c->regions_ = c->handles_[2];
  c->objects_ = c->handles_[3];

  rocksdb::WriteOptions wo;
  wo.sync = options.sync;
  std::string value;
  rocksdb::Status s = db->Get({}, c->meta_, kSchemaKey, &value);
  if (s.ok() && value == kOlderSchemaVersion) {
    RETURN_IF_ERROR(
        FromRocksDb(db->Put(wo, c->meta_, kSchemaKey, kSchemaVersion), "upgrade schema"));
    value = kSchemaVersion;
  }
  if (s.ok() && value != kSchemaVersion) {
    return absl::DataLossError(absl::StrCat("catalog ", dir, " has schema version ", value,
                                            ", this ferry reads ", kSchemaVersion));
  }
  if (!s.ok() && !s.IsNotFound()) return FromRocksDb(s, "read schema version");
  s = db->Get({}, c->meta_, kNodeIdKey, &c->node_id_);
  if (s.IsNotFound()) {
    c->node_id_ = RandomId();
    rocksdb::WriteBatch batch;
    batch.Put(c->meta_, kSchemaKey, kSchemaVersion);
    batch.Put(c->meta_, kNodeIdKey, c->node_id_);
    batch.Put(c->meta_, kNextRegionKey, EncodeU64(1));
    batch.Put(c->nodes_, c->node_id_,
              nlohmann::json{{"id", c->node_id_}, {"created_ms", absl::ToUnixMillis(absl::Now())}}
                  .dump());
    RETURN_IF_ERROR(FromRocksDb(db->Write(wo, &batch), "initialise catalog"));
  } else {
    RETURN_IF_ERROR(FromRocksDb(s, "read node id"));
  }
  // Regions are memory of the process that registered them: none survives a restart, so
  // objects come back detached until their regions are registered again.
  rocksdb::WriteBatch clear;
  std::unique_ptr<rocksdb::Iterator> it(db->NewIterator({}, c->regions_));
  for (it->SeekToFirst(); it->Valid(); it->Next()) clear.Delete(c->regions_, it->key());
  RETURN_IF_ERROR(FromRocksDb(it->status(), "scan regions"));
  RETURN_IF_ERROR(FromRocksDb(db->Write(wo, &clear), "clear regions"));
  RETURN_IF_ERROR(c->LoadRegionUsers());
  return c;
}

Catalog::~Catalog() {
  if (db_) {
    for (rocksdb::ColumnFamilyHandle* h : handles_)
      IgnoreError(FromRocksDb(db_->DestroyColumnFamilyHandle(h), "close"));
    IgnoreError(FromRocksDb(db_->Close(), "close catalog"));
  }
}

absl::Status Catalog::LoadRegionUsers() {
  absl::MutexLock lock(&mu_);
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator({}, objects_));
  for (it->Seek("V"); it->Valid() && it->key().starts_with("V"); it->Next()) {
    ASSIGN_OR_RETURN(ObjectRecord r, DecodeRecord(it->value().ToString()));
    for (uint64_t region : RegionsOf(r.extents)) ++region_users_[region];
  }
  return FromRocksDb(it->status(), "scan objects");
}

absl::StatusOr<uint64_t> Catalog::NextRegionId() {
  absl::MutexLock lock(&mu_);
  std::string value;
  RETURN_IF_ERROR(FromRocksDb(db_->Get({}, meta_, kNextRegionKey, &value), "read region id"));
  const uint64_t id = DecodeU64(value);
  rocksdb::WriteBatch batch;
  batch.Put(meta_, kNextRegionKey, EncodeU64(id + 1));
  RETURN_IF_ERROR(WriteLocked(batch, "write region id"));
  return id;
}

absl::StatusOr<ObjectRecord> Catalog::Publish(const std::string& name,
                                              const std::vector<Extent>& extents, bool replace,
                                              std::set<uint64_t>* released, bool durable,
                                              const PublishExtras& extras) {
  RETURN_IF_ERROR(ValidateObjectName(name));
  ObjectRecord r;
  r.name = name;
  r.extents = extents;
  r.durable = durable;
  r.meta = extras.meta;
  r.content_type = extras.content_type;
  r.crc32c = extras.crc32c;
  for (const Extent& e : extents) {
    if (r.size + e.length < r.size) return absl::InvalidArgumentError("object size overflows");
    r.size += e.length;
  }
  r.created_ms = absl::ToUnixMillis(absl::Now());
  absl::MutexLock lock(&mu_);
  std::string latest;
  rocksdb::Status s = db_->Get({}, objects_, LatestKey(name), &latest);
  if (!s.ok() && !s.IsNotFound()) return FromRocksDb(s, "read object");
  const bool in_memory = ephemeral_.contains(name);
  const uint64_t now = s.ok()      ? DecodeU64(latest)
                       : in_memory ? ephemeral_[name].rbegin()->first
                                   : 0;
  if (extras.if_latest) RETURN_IF_ERROR(CheckLatest(name, now, *extras.if_latest));
  if (extras.version && *extras.version <= now) {
    return PreconditionFailed(absl::StrCat("version ", *extras.version, " of object '", name,
                                           "' is not above its latest, ", now));
  }
  if ((s.ok() || in_memory) && !replace) {
    return absl::AlreadyExistsError(absl::StrCat(
        "object '", name, "' exists; publish with replace=true to make a new version"));
  }
  if ((s.ok() && !durable) || (in_memory && durable)) {
    return absl::FailedPreconditionError(absl::StrCat("object '", name, "' is ",
                                                      s.ok() ? "durable" : "ephemeral",
                                                      "; a new version of it must be too"));
  }
  r.version = extras.version.value_or(now + 1);
  if (!durable) return PublishEphemeralLocked(std::move(r), r.version, released);
  rocksdb::WriteBatch batch;
  batch.Put(objects_, LatestKey(name), EncodeU64(r.version));
  batch.Put(objects_, VersionKey(name, r.version), EncodeRecord(r));
  std::vector<ObjectRecord> removed;
  if (options_.keep_versions > 0 && r.version > options_.keep_versions) {
    RETURN_IF_ERROR(
        DropVersions(*db_, objects_, name, r.version - options_.keep_versions, batch, removed));
  }
  RETURN_IF_ERROR(WriteLocked(batch, "publish"));
  NoteLatest(name, r.version);
  for (uint64_t region : RegionsOf(extents)) ++region_users_[region];
  ForgetLocked(removed, released);
  Cache(VersionKey(name, r.version),
        std::make_shared<const ObjectRecord>(r));  // a pull often follows
  return r;
}

absl::StatusOr<ObjectRecord> Catalog::PublishEphemeralLocked(ObjectRecord r, uint64_t version,
                                                             std::set<uint64_t>* released) {
  Versions& versions = ephemeral_[r.name];
  r.version = version;
  for (uint64_t region : RegionsOf(r.extents)) ++region_users_[region];
  versions.emplace(r.version, std::make_shared<const ObjectRecord>(r));
  std::vector<ObjectRecord> removed;
  while (options_.keep_versions > 0 && versions.size() > options_.keep_versions) {
    removed.push_back(*versions.begin()->second);
    versions.erase(versions.begin());
  }
  ForgetLocked(removed, released);
  return r;
}

void Catalog::Cache(const std::string& key, std::shared_ptr<const ObjectRecord> r) const {
  absl::MutexLock lock(&cache_mu_);
  if (cached_extents_ + r->extents.size() > kCachedExtents) {
    cache_.clear();
    cached_extents_ = 0;
  }
  const size_t n = r->extents.size();
  if (cache_.emplace(key, std::move(r)).second) cached_extents_ += n;
}

void Catalog::NoteLatest(const std::string& name, std::optional<uint64_t> version) const {
  absl::MutexLock lock(&cache_mu_);
  ++latest_gen_;
  if (!version) {
    latest_.erase(name);
    return;
  }
  if (latest_.size() >= kLatestKept) latest_.clear();
  latest_[name] = *version;
}

std::shared_ptr<const ObjectRecord> Catalog::Peek(const std::string& name,
                                                  std::optional<uint64_t> version) const {
  // mu_ is held across a durable publish's write (and its fsync): not waited for.
  if (!mu_.TryLock()) return nullptr;
  auto e = ephemeral_.find(name);
  const bool ephemeral = e != ephemeral_.end();
  std::shared_ptr<const ObjectRecord> found;
  if (ephemeral) {
    auto it = version ? e->second.find(*version) : std::prev(e->second.end());
    if (it != e->second.end()) found = it->second;
  }
  mu_.Unlock();
  if (ephemeral) return found;
  absl::MutexLock lock(&cache_mu_);
  if (!version) {
    auto it = latest_.find(name);
    if (it == latest_.end()) return nullptr;
    version = it->second;
  }
  auto it = cache_.find(VersionKey(name, *version));
  return it == cache_.end() ? nullptr : it->second;
}

absl::StatusOr<std::shared_ptr<const ObjectRecord>> Catalog::Get(
    const std::string& name, std::optional<uint64_t> version) const {
  RETURN_IF_ERROR(ValidateObjectName(name));
  {
    absl::MutexLock lock(&mu_);
    auto e = ephemeral_.find(name);
    if (e != ephemeral_.end()) {
      auto it = version ? e->second.find(*version) : std::prev(e->second.end());
      if (it == e->second.end()) {
        return absl::NotFoundError(
            absl::StrCat("no version ", *version, " of object '", name, "'"));
      }
      return it->second;
    }
  }
  std::optional<uint64_t> v = version;
  uint64_t gen = 0;
  {
    absl::MutexLock lock(&cache_mu_);
    if (!v) {
      if (auto it = latest_.find(name); it != latest_.end()) v = it->second;
    }
    if (v) {
      if (auto it = cache_.find(VersionKey(name, *v)); it != cache_.end()) return it->second;
    }
    gen = latest_gen_;
  }
  if (!v) {
    std::string latest;
    rocksdb::Status s = db_->Get({}, objects_, LatestKey(name), &latest);
    if (s.IsNotFound()) return absl::NotFoundError(absl::StrCat("no object '", name, "'"));
    RETURN_IF_ERROR(FromRocksDb(s, "read object"));
    v = DecodeU64(latest);
    absl::MutexLock lock(&cache_mu_);
    // A publish or delete since the read may have made it stale: then it is not noted.
    if (gen == latest_gen_) {
      if (latest_.size() >= kLatestKept) latest_.clear();
      latest_[name] = *v;
    }
  }
  const std::string key = VersionKey(name, *v);
  std::string value;
  rocksdb::Status s = db_->Get({}, objects_, key, &value);
  if (s.IsNotFound()) {
    return absl::NotFoundError(absl::StrCat("no version ", *v, " of object '", name, "'"));
  }
  RETURN_IF_ERROR(FromRocksDb(s, "read object"));
  ASSIGN_OR_RETURN(ObjectRecord r, DecodeRecord(value));
  auto shared = std::make_shared<const ObjectRecord>(std::move(r));
  Cache(key, shared);
  return shared;
}

absl::StatusOr<std::vector<ObjectRecord>> Catalog::List(const std::string& prefix,
                                                        const std::string& after,
                                                        size_t limit) const {
  // Durable names from the store, ephemeral ones from memory, merged in name order.
  std::vector<ObjectRecord> durable;
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator({}, objects_));
  const std::string lprefix = LatestKey(prefix);
  it->Seek(std::max(lprefix, LatestKey(after)));
  for (; it->Valid() && durable.size() < limit && it->key().starts_with(lprefix); it->Next()) {
    std::string name = it->key().ToString().substr(1);
    if (!after.empty() && name == after) continue;
    std::string value;
    RETURN_IF_ERROR(FromRocksDb(
        db_->Get({}, objects_, VersionKey(name, DecodeU64(it->value().ToString())), &value),
        "read object"));
    ASSIGN_OR_RETURN(ObjectRecord r, DecodeRecord(value));
    durable.push_back(std::move(r));
  }
  RETURN_IF_ERROR(FromRocksDb(it->status(), "list objects"));
  std::vector<ObjectRecord> ephemeral;
  {
    absl::MutexLock lock(&mu_);
    for (auto e = ephemeral_.lower_bound(std::max(prefix, after));
         e != ephemeral_.end() && ephemeral.size() < limit && e->first.starts_with(prefix); ++e) {
      if (!after.empty() && e->first == after) continue;
      ephemeral.push_back(*e->second.rbegin()->second);
    }
  }
  std::vector<ObjectRecord> out;
  std::merge(std::make_move_iterator(durable.begin()), std::make_move_iterator(durable.end()),
             std::make_move_iterator(ephemeral.begin()), std::make_move_iterator(ephemeral.end()),
             std::back_inserter(out),
             [](const ObjectRecord& a, const ObjectRecord& b) { return a.name < b.name; });
  if (out.size() > limit) out.resize(limit);
  return out;
}

absl::Status Catalog::Delete(const std::string& name, std::set<uint64_t>* released,
                             std::optional<uint64_t> if_latest) {
  RETURN_IF_ERROR(ValidateObjectName(name));
  absl::MutexLock lock(&mu_);
  if (auto e = ephemeral_.find(name); e != ephemeral_.end()) {
    if (if_latest) RETURN_IF_ERROR(CheckLatest(name, e->second.rbegin()->first, *if_latest));
    std::vector<ObjectRecord> removed;
    for (const auto& [v, r] : e->second) removed.push_back(*r);
    ephemeral_.erase(e);
    ForgetLocked(removed, released);
    return absl::OkStatus();
  }
  std::string latest;
  rocksdb::Status s = db_->Get({}, objects_, LatestKey(name), &latest);
  if (s.IsNotFound()) return absl::NotFoundError(absl::StrCat("no object '", name, "'"));
  RETURN_IF_ERROR(FromRocksDb(s, "read object"));
  if (if_latest) RETURN_IF_ERROR(CheckLatest(name, DecodeU64(latest), *if_latest));
  rocksdb::WriteBatch batch;
  batch.Delete(objects_, LatestKey(name));
  std::vector<ObjectRecord> removed;
  RETURN_IF_ERROR(
      DropVersions(*db_, objects_, name, std::numeric_limits<uint64_t>::max(), batch, removed));
  RETURN_IF_ERROR(WriteLocked(batch, "delete object"));
  NoteLatest(name, std::nullopt);
  ForgetLocked(removed, released);
  return absl::OkStatus();
}

absl::Status Catalog::WriteLocked(rocksdb::WriteBatch& batch, std::string_view what) {
  RETURN_IF_ERROR(CheckFreeSpace(dir_, options_.min_free_bytes));
  rocksdb::WriteOptions wo;
  wo.sync = options_.sync;
  return FromRocksDb(db_->Write(wo, &batch), what);
}

void Catalog::ForgetLocked(const std::vector<ObjectRecord>& removed, std::set<uint64_t>* released) {
  {
    absl::MutexLock cache_lock(&cache_mu_);
    for (const ObjectRecord& r : removed) {
      auto c = cache_.find(VersionKey(r.name, r.version));
      if (c == cache_.end()) continue;
      cached_extents_ -= c->second->extents.size();
      cache_.erase(c);
    }
  }
  for (const ObjectRecord& r : removed) {
    for (uint64_t region : RegionsOf(r.extents)) {
      if (--region_users_[region] > 0) continue;
      region_users_.erase(region);
      if (released != nullptr) released->insert(region);
    }
  }
}

size_t Catalog::RegionUsers(uint64_t region) const {
  absl::MutexLock lock(&mu_);
  auto it = region_users_.find(region);
  return it == region_users_.end() ? 0 : it->second;
}

}  // namespace ferry::metadata
