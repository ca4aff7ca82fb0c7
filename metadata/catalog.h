// The node's catalog: a RocksDB store under the node's data dir with column families for
// nodes, regions and objects, and ephemeral objects in memory beside it. Objects are named,
// versioned and immutable; every multi-key change is one WriteBatch. Records and their keys:
// docs/catalog_format.md. Thread-safe.
#ifndef FERRY_METADATA_CATALOG_H_
#define FERRY_METADATA_CATALOG_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "ferry/types.h"

namespace rocksdb {
class DB;
class ColumnFamilyHandle;
class WriteBatch;
}  // namespace rocksdb

namespace ferry::metadata {

struct ObjectRecord {
  std::string name;
  uint64_t version = 0;            // 1, 2, ... per name
  uint64_t size = 0;               // sum of the extents' lengths
  bool durable = true;             // in the store on disk; false: in memory, gone at restart
  std::vector<Extent> extents;     // regions are node-wide region ids, never reused
  int64_t created_ms = 0;          // Unix time
  std::string meta;                // the publisher's metadata (JSON text), empty when none
  std::string content_type;        // the bytes' media type, empty when not given
  std::optional<uint32_t> crc32c;  // of the bytes, when the node saw them all (an upload)
};

// A record as the store keeps it, and back (kDataLoss for bytes that are not one; records of
// older stores, JSON, are read too).
std::string EncodeRecord(const ObjectRecord& r);
absl::StatusOr<ObjectRecord> DecodeRecord(std::string_view value);

// InsufficientStorage (HTTP 507) unless the disk under `dir` has `min_free` bytes free (0: no
// check). Also for the directory's store.
absl::Status CheckFreeSpace(const std::string& dir, uint64_t min_free);

// What a publish may carry besides its layout, and its condition.
struct PublishExtras {
  std::string meta;
  std::string content_type;
  std::optional<uint32_t> crc32c;
  // Publish only if the name's latest version is this one (0: only if the name has none);
  // kFailedPrecondition (PreconditionFailed, HTTP 412) otherwise. Default: no condition.
  std::optional<uint64_t> if_latest;
  // Publish as this version number, not the next one (a copy of another node's version keeps
  // its number): kFailedPrecondition (HTTP 412) unless it is above the latest. Default: next.
  std::optional<uint64_t> version;
};

struct CatalogOptions {
  // Sync the write-ahead log on every change, so an acknowledged publish survives a machine
  // crash, not only a process crash. Default: true.
  bool sync = true;
  // Versions kept per name: publishing version N removes those up to N - keep_versions, in the
  // same write. 0: every version. Default: 0.
  size_t keep_versions = 0;
  // Bytes the data disk keeps free: below them the store is neither opened nor written
  // (InsufficientStorage, HTTP 507), and writes go on once there is room again. RocksDB
  // aborts the process on a write that finds the disk full: this margin is what keeps it
  // from one, unless something else fills the disk faster. Default: 64 MiB.
  uint64_t min_free_bytes = uint64_t{64} << 20;
};

// kInvalidArgument unless `name` is 1 to 256 characters of letters, digits and "._-/", with
// no empty, "." or ".." segment.
absl::Status ValidateObjectName(const std::string& name);

// PreconditionFailed (kFailedPrecondition, HTTP 412) unless the latest version of `name` (0:
// none) is `want`.
absl::Status CheckLatest(const std::string& name, uint64_t latest, uint64_t want);

class Catalog {
 public:
  // Opens (creating if needed) the store under `dir`. kDataLoss: a store of another schema
  // version. kUnavailable: the store is locked by another process. kResourceExhausted (507):
  // the disk has less than min_free_bytes free.
  //
  // Every durable change below is refused with kResourceExhausted (507), and changes nothing,
  // while the disk has less than min_free_bytes free; reads go on.
  static absl::StatusOr<std::unique_ptr<Catalog>> Open(const std::string& dir,
                                                       const CatalogOptions& options = {});
  ~Catalog();
  Catalog(const Catalog&) = delete;
  Catalog& operator=(const Catalog&) = delete;

  // This node's id: made on the first open, the same ever after.
  const std::string& node_id() const { return node_id_; }

  // A region id never handed out before by this store.
  absl::StatusOr<uint64_t> NextRegionId();

  // Publishes `extents` as `name`. kAlreadyExists: the name exists and `replace` is false.
  // With `replace`, the new version is the latest plus one, written atomically together with
  // the removal of the versions past `keep_versions`. `durable` false keeps the version in
  // memory only (no write to the store; gone at restart). kFailedPrecondition: a durable name
  // replaced by an ephemeral version or the other way round. `released` (if given) gets the
  // regions that no object version uses any more. `extras` are stored with the version as they
  // are; its condition is checked in the same critical section as the write.
  absl::StatusOr<ObjectRecord> Publish(const std::string& name, const std::vector<Extent>& extents,
                                       bool replace, std::set<uint64_t>* released = nullptr,
                                       bool durable = true, const PublishExtras& extras = {});
  // The latest version, or `version`. kNotFound: no such name or version. Shared: records
  // never change, and a big layout is not copied for every pull.
  absl::StatusOr<std::shared_ptr<const ObjectRecord>> Get(
      const std::string& name, std::optional<uint64_t> version = std::nullopt) const;
  // Get's answer when the catalog has it in memory (an ephemeral object, or a version it
  // decoded before, the latest one included): never reads the store or waits for a change
  // being written, so it does not wait for the disk. Null when Get would have to.
  std::shared_ptr<const ObjectRecord> Peek(const std::string& name,
                                           std::optional<uint64_t> version = std::nullopt) const;
  // Latest versions of names starting with `prefix`, after `after` (exclusive), in name order.
  absl::StatusOr<std::vector<ObjectRecord>> List(const std::string& prefix,
                                                 const std::string& after, size_t limit) const;
  // Removes every version of `name`. kNotFound: no such name. `released` (if given) gets the
  // regions that no object version uses any more. `if_latest`: only if the latest version is
  // that one (kFailedPrecondition otherwise).
  absl::Status Delete(const std::string& name, std::set<uint64_t>* released = nullptr,
                      std::optional<uint64_t> if_latest = std::nullopt);
  // Number of object versions (latest or not) that have an extent in `region`.
  size_t RegionUsers(uint64_t region) const;

 private:
  Catalog() = default;
  absl::Status LoadRegionUsers();
  // Forgets the versions `removed` (deleted from the store by the caller): their cache
  // entries and their regions' users; adds the regions left without users to `released`.
  void ForgetLocked(const std::vector<ObjectRecord>& removed, std::set<uint64_t>* released)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Writes `batch` unless the disk is short of min_free_bytes.
  absl::Status WriteLocked(rocksdb::WriteBatch& batch, std::string_view what)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  CatalogOptions options_;
  std::string dir_;
  std::string node_id_;
  std::unique_ptr<rocksdb::DB> db_;
  std::vector<rocksdb::ColumnFamilyHandle*> handles_;  // owned by db_ until closed
  rocksdb::ColumnFamilyHandle* meta_ = nullptr;
  rocksdb::ColumnFamilyHandle* nodes_ = nullptr;
  rocksdb::ColumnFamilyHandle* regions_ = nullptr;
  rocksdb::ColumnFamilyHandle* objects_ = nullptr;

  mutable absl::Mutex mu_;  // serialises read-check-write changes; guards ephemeral_
  std::map<uint64_t, size_t> region_users_ ABSL_GUARDED_BY(mu_);
  // Decoded records by version key: versions never change, so a hit saves decoding a layout
  // of many extents on every pull. Emptied when it holds more than kCachedExtents extents.
  static constexpr size_t kCachedExtents = size_t{1} << 20;
  // Keeps a decoded record (emptying the cache first when it would grow past kCachedExtents).
  void Cache(const std::string& key, std::shared_ptr<const ObjectRecord> r) const;
  // Ephemeral objects: versions by name (each name's latest last).
  using Versions = std::map<uint64_t, std::shared_ptr<const ObjectRecord>>;
  absl::StatusOr<ObjectRecord> PublishEphemeralLocked(ObjectRecord r, uint64_t version,
                                                      std::set<uint64_t>* released)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::map<std::string, Versions> ephemeral_ ABSL_GUARDED_BY(mu_);
  mutable absl::Mutex cache_mu_;
  mutable std::map<std::string, std::shared_ptr<const ObjectRecord>> cache_
      ABSL_GUARDED_BY(cache_mu_);
  mutable size_t cached_extents_ ABSL_GUARDED_BY(cache_mu_) = 0;
  // The latest version of durable names, as the store says: set by Publish, dropped by
  // Delete, and learnt by Get when no change came between its read and its note (latest_gen_
  // counts changes). Emptied past kLatestKept names.
  static constexpr size_t kLatestKept = size_t{1} << 16;
  mutable std::map<std::string, uint64_t> latest_ ABSL_GUARDED_BY(cache_mu_);
  mutable uint64_t latest_gen_ ABSL_GUARDED_BY(cache_mu_) = 0;
  // Notes `version` as `name`'s latest (none: it has none).
  void NoteLatest(const std::string& name, std::optional<uint64_t> version) const;
};

}  // namespace ferry::metadata

#endif  // FERRY_METADATA_CATALOG_H_
