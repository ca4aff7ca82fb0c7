// ferry::cluster::Member: one node in the directory. It holds a lease that it keeps alive, its
// node record and the object versions it holds (holder records) under that lease, so that a
// node that dies vanishes from the directory within the TTL by itself. When the lease is lost
// (the directory restarted empty, or the node was cut off longer than the TTL) it takes a new
// one and puts every record again. Writes go from a thread of its own, in order: a publish
// never waits for the directory, and a directory that is down delays records, nothing else.
// Reads (Holders, Nodes) ask the directory at once. Thread-safe.
//
// Keys: ferry/nodes/<node id> -> the node record (JSON);
//       ferry/objects/<name>@<version, 20 digits>/<node id> -> Holder (JSON).
// '@' cannot occur in an object name, so one name's versions are one key range.
#ifndef FERRY_CLUSTER_MEMBER_H_
#define FERRY_CLUSTER_MEMBER_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "cluster/directory.h"
#include "nlohmann/json.hpp"

namespace ferry::cluster {

// A node that holds a version of an object.
struct Holder {
  std::string name;
  std::string node;
  std::string url;
  std::string host;  // host id: the same host as the puller's allows the IPC path
  uint64_t version = 0;
  uint64_t size = 0;
};

// A node the directory knows: its record as it put it (id, url, host, rails, devices,
// labels, state), and the object versions it holds.
struct NodeEntry {
  nlohmann::json record;
  std::vector<Holder> holds;
};

class Membership {
 public:
  // Nothing is written until Join.
  Membership(std::unique_ptr<Directory> directory, std::string node_id, absl::Duration ttl);
  // Stops writing; the records stay until the lease expires (Leave removes them at once).
  ~Membership();
  Membership(const Membership&) = delete;
  Membership& operator=(const Membership&) = delete;

  Directory& directory() { return *directory_; }
  // Starts keeping `record` (this node's, JSON, with its "url" and "host") and the holder
  // records in the directory.
  void Join(nlohmann::json record);
  // Replaces the node record (a state change, say).
  void Update(nlohmann::json record);
  // This node holds `version` of `name` (`size` bytes).
  void Hold(const std::string& name, uint64_t version, uint64_t size);
  // This node no longer holds the versions of `name` up to `up_to` (all of them: nullopt).
  void Release(const std::string& name, std::optional<uint64_t> up_to = std::nullopt);
  // Revokes the lease (every record of this node goes at once) and stops writing; waits for
  // the directory at most its own timeout. Later Holds are kept nowhere.
  void Leave();
  // "joined", "not joined", "left", or why the directory cannot be reached.
  std::string state();

  // Holders of `name` (of `version`, or of its highest version that any node holds), in no
  // particular order. kUnavailable: the directory cannot be reached.
  absl::StatusOr<std::vector<Holder>> Holders(const std::string& name,
                                              std::optional<uint64_t> version);
  // Every node the directory knows, with what it holds.
  absl::StatusOr<std::vector<NodeEntry>> Nodes();

  static std::string NodeKey(const std::string& node);
  static std::string HolderKey(const std::string& name, uint64_t version, const std::string& node);

 private:
  void Run();
  // Writes what changed since the last round under `lease`; kNotFound when the lease is gone.
  absl::Status Flush(int64_t lease);
  std::string HolderValue(uint64_t size) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::unique_ptr<Directory> directory_;
  const std::string node_id_;
  const absl::Duration ttl_;
  absl::Mutex mu_;
  bool joined_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool left_ ABSL_GUARDED_BY(mu_) = false;
  bool kick_ ABSL_GUARDED_BY(mu_) = false;  // something to write
  nlohmann::json record_ ABSL_GUARDED_BY(mu_);
  std::string error_ ABSL_GUARDED_BY(mu_);
  int64_t lease_ ABSL_GUARDED_BY(mu_) = 0;
  // What the directory should hold for this node (key -> value), and the keys written since
  // or to delete (value nullopt).
  std::map<std::string, std::string> desired_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::optional<std::string>> pending_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

}  // namespace ferry::cluster

#endif  // FERRY_CLUSTER_MEMBER_H_
