// ferry::cluster::DirectoryStore: the directory a ferryd serves with --serve-directory, for one
// machine or a lab without etcd. It keeps keys and leases in a RocksDB of its own with etcd's
// semantics (a key put under a lease goes when the lease expires or is revoked; a lease's TTL
// starts again when the store reopens) and answers the same JSON gateway routes as etcd
// (/v3/lease/grant, keepalive, revoke; /v3/kv/put, range, deleterange), so one client
// (Directory) speaks to both. No consensus: one store, one process. Thread-safe.
#ifndef FERRY_CLUSTER_DIRECTORY_STORE_H_
#define FERRY_CLUSTER_DIRECTORY_STORE_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "cluster/directory.h"

namespace httplib {
class Server;
struct Request;
struct Response;
}  // namespace httplib

namespace rocksdb {
class DB;
}

namespace ferry::cluster {

class DirectoryStore {
 public:
  // Opens (creates) the store in `dir`. While the disk under it has less than `min_free_bytes`
  // free, it does not open, and writes (grants, revokes, puts, deletes, expiries) are refused
  // with InsufficientStorage (507) and change nothing: RocksDB aborts on a write that finds the
  // disk full. Keep-alives and reads go on.
  static absl::StatusOr<std::unique_ptr<DirectoryStore>> Open(const std::string& dir,
                                                              uint64_t min_free_bytes = 0);
  ~DirectoryStore();
  DirectoryStore(const DirectoryStore&) = delete;
  DirectoryStore& operator=(const DirectoryStore&) = delete;

  // kInvalidArgument: ttl below 1 s or over a day.
  absl::StatusOr<int64_t> Grant(absl::Duration ttl);
  // The lease's TTL, its clock started again. kNotFound: expired or revoked.
  absl::StatusOr<absl::Duration> KeepAlive(int64_t lease);
  // kNotFound: no such lease.
  absl::Status Revoke(int64_t lease);
  // kNotFound: `lease` (non-zero) does not exist. kInvalidArgument: an empty key.
  absl::Status Put(const std::string& key, const std::string& value, int64_t lease);
  // Keys in [key, range_end); range_end empty: `key` alone; "\0": every key from `key` on.
  absl::StatusOr<std::vector<KeyValue>> Range(const std::string& key, const std::string& range_end);
  // How many keys in the same range went.
  absl::StatusOr<int64_t> DeleteRange(const std::string& key, const std::string& range_end);

  // Ends the leases whose time is up, with their keys (a thread of the store does this).
  void ExpireNow();

 private:
  struct Lease {
    absl::Duration ttl;
    absl::Time deadline;
    std::set<std::string> keys;
  };
  DirectoryStore(std::unique_ptr<rocksdb::DB> db, std::string dir, uint64_t min_free_bytes);
  absl::Status Load();
  // Deletes the lease and its keys; the caller holds mu_.
  absl::Status EndLocked(int64_t id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops `key` from the lease it was under (it is overwritten or deleted).
  void Unlease(const std::string& key) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ExpireLoop();

  std::unique_ptr<rocksdb::DB> db_;
  const std::string dir_;
  const uint64_t min_free_bytes_;
  // OK while the disk has min_free_bytes_ free (checked before every write).
  absl::Status Writable() const;
  absl::Mutex mu_;
  std::map<int64_t, Lease> leases_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, int64_t> key_lease_ ABSL_GUARDED_BY(mu_);  // keys under a lease
  int64_t next_lease_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread expirer_;
};

// Installs the store's routes (POST /v3/...) on `server`, each behind `guard` (which answers
// and returns false when the request may not go on, a missing token say).
using DirectoryGuard = std::function<bool(const httplib::Request&, httplib::Response&)>;
void InstallDirectoryRoutes(httplib::Server& server, DirectoryStore& store, DirectoryGuard guard);

}  // namespace ferry::cluster

#endif  // FERRY_CLUSTER_DIRECTORY_STORE_H_
