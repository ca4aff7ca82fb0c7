// ferry::cluster::Directory: the cluster's directory as a client sees it, the part of etcd's v3
// API that ferry uses (keys with leases, ranges, lease keep-alive) spoken through its JSON
// gateway. Two servers answer it: etcd itself (`etcd://h1:2379,h2:2379`), and a ferryd run with
// --serve-directory (`http://host:port`, DirectoryStore), which keeps the same records with the
// same lease semantics for one machine or a lab. Thread-safe.
#ifndef FERRY_CLUSTER_DIRECTORY_H_
#define FERRY_CLUSTER_DIRECTORY_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "nlohmann/json.hpp"

namespace httplib {
class Client;
}

namespace ferry::cluster {

// An integer field of a gateway's JSON: etcd writes 64-bit integers as strings, a number is
// taken too; 0 when absent or not an integer.
int64_t GatewayInt(const nlohmann::json& j, const char* key);

struct KeyValue {
  std::string key;
  std::string value;
  int64_t lease = 0;  // 0: none
};

struct DirectoryOptions {
  // Bearer token sent to a ferryd directory (never to etcd, which would read it as a token of
  // its own auth). Default: none.
  std::string token;
  // Longest wait for one answer before the next endpoint is tried. Default: 2 s.
  absl::Duration timeout = absl::Seconds(2);
};

class Directory {
 public:
  // `url`: etcd://host:port[,host:port...] or http://host:port. kInvalidArgument otherwise.
  static absl::StatusOr<std::unique_ptr<Directory>> Connect(const std::string& url,
                                                            const DirectoryOptions& options = {});
  ~Directory();
  Directory(const Directory&) = delete;
  Directory& operator=(const Directory&) = delete;

  const std::string& url() const { return url_; }

  // A lease of `ttl` (whole seconds, at least 1): keys put under it go when it expires.
  absl::StatusOr<int64_t> Grant(absl::Duration ttl);
  // Renews `lease`; its TTL. kNotFound: the lease expired or was revoked (its keys are gone).
  absl::StatusOr<absl::Duration> KeepAlive(int64_t lease);
  // Ends `lease` and deletes its keys. kNotFound: no such lease.
  absl::Status Revoke(int64_t lease);
  // kNotFound: `lease` (non-zero) does not exist.
  absl::Status Put(const std::string& key, const std::string& value, int64_t lease = 0);
  // Keys starting with `prefix`, in key order.
  absl::StatusOr<std::vector<KeyValue>> Range(const std::string& prefix);
  // Deletes `key`; how many keys went (0 or 1).
  absl::StatusOr<int64_t> Delete(const std::string& key);

  // The key just past every key that starts with `prefix` (etcd's range_end for a prefix).
  static std::string PrefixEnd(const std::string& prefix);

 private:
  Directory(std::string url, std::vector<std::string> endpoints, const DirectoryOptions& options);
  // POSTs `body` (JSON) to `path` on the endpoint that answered last, then the others; the
  // answer's JSON text. Errors: the server's code (etcd's gRPC code), or kUnavailable when no
  // endpoint answers. Calls from several threads go at once, each on a connection of its own.
  absl::StatusOr<std::string> Call(const std::string& path, const std::string& body);
  // A kept-alive connection to endpoint `i` nobody uses, or a new one; handed back with Give
  // (kept while fewer than kIdlePerEndpoint wait).
  std::unique_ptr<httplib::Client> Take(size_t i) ABSL_LOCKS_EXCLUDED(mu_);
  void Give(size_t i, std::unique_ptr<httplib::Client> client) ABSL_LOCKS_EXCLUDED(mu_);

  static constexpr size_t kIdlePerEndpoint = 8;

  const std::string url_;
  const std::vector<std::string> endpoints_;  // http://host:port
  const DirectoryOptions options_;
  const bool etcd_;
  absl::Mutex mu_;
  size_t current_ ABSL_GUARDED_BY(mu_) = 0;
  // Per endpoint, its idle connections.
  std::vector<std::vector<std::unique_ptr<httplib::Client>>> idle_ ABSL_GUARDED_BY(mu_);
};

}  // namespace ferry::cluster

#endif  // FERRY_CLUSTER_DIRECTORY_H_
