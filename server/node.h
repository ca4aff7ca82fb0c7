// ferry::Node: engine + catalog + regions; what ferryd and embedding programs run. The HTTP
// routes (http_api.h) call these methods. Thread-safe.
#ifndef FERRY_SERVER_NODE_H_
#define FERRY_SERVER_NODE_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "engine/engine.h"
#include "metadata/catalog.h"
#include "nlohmann/json.hpp"

namespace ferry::server {

struct NodeOptions {
  engine::EngineOptions engine;
  // Where the catalog lives. Default: ./ferry-data.
  std::string data_dir = "./ferry-data";
  // Sync the catalog's log on every change. Default: true.
  bool sync = true;
  // Most extents one request may carry. Default: 65536.
  size_t max_extents = 65536;
  // Deadline of a pull that names none. Default: 60 s.
  absl::Duration pull_timeout = absl::Seconds(60);
  // Bearer token sent with requests this node makes to other nodes. Default: none.
  std::string peer_token;
};

struct RegionInfo {
  uint64_t id = 0;
  engine::Device device;
  uint64_t size = 0;
  bool owned = false;  // allocated by the node (ferryd), not the caller's memory
};

struct ObjectView {
  metadata::ObjectRecord record;
  bool detached = false;  // a region of its layout is not registered (since a restart)
};

struct PullStats {
  std::string object;
  uint64_t version = 0;
  uint64_t bytes = 0;
  double seconds = 0;
  std::vector<uint64_t> bytes_per_rail;
  std::string path = "rdma";
  std::optional<uint64_t> region;  // the new buffer, for pulls into one
};

// [{"region":R,"offset":O,"length":L}, ...] with unsigned fields. kInvalidArgument otherwise.
absl::StatusOr<std::vector<metadata::ObjectExtent>> ExtentsFromJson(const nlohmann::json& j);

nlohmann::json ToJson(const RegionInfo& r);
nlohmann::json ToJson(const ObjectView& o);
nlohmann::json ToJson(const PullStats& s);

// Statuses that the HTTP layer answers with a status code other than its default for the
// code: 409 for a precondition that is a conflict (region in use, object detached), 413 for
// a request over a limit.
absl::Status Conflict(absl::string_view message);
absl::Status TooLarge(absl::string_view message);
std::optional<int> HttpStatusOverride(const absl::Status& s);

class Node {
 public:
  // Opens the catalog, then the engine with the catalog's node id.
  static absl::StatusOr<std::unique_ptr<Node>> Open(const NodeOptions& options);
  // Drains in-flight pulls (they finish or fail), then closes the engine and the catalog.
  ~Node();

  const std::string& id() const { return catalog_->node_id(); }
  nlohmann::json Info() const;
  engine::Engine& engine() { return *engine_; }

  // A buffer the node allocates and registers. kInvalidArgument: size 0 or over the limit of
  // 1 TiB. kUnimplemented: a device this build cannot allocate.
  absl::StatusOr<RegionInfo> AllocateRegion(engine::Device device, uint64_t size);
  // The caller's memory, registered until DeleteRegion; the caller keeps it valid till then.
  absl::StatusOr<RegionInfo> RegisterRegion(void* addr, uint64_t size, engine::Device device);
  // kNotFound: unknown region. kFailedPrecondition (409): an object uses it.
  absl::Status DeleteRegion(uint64_t id);
  std::vector<RegionInfo> Regions() const;

  // kInvalidArgument: bad name, no extents, an empty or out-of-bounds extent. kNotFound: an
  // unknown region. kAlreadyExists: the name is taken and `replace` is false.
  // kResourceExhausted (413): too many extents.
  absl::StatusOr<ObjectView> Publish(const std::string& name,
                                     const std::vector<metadata::ObjectExtent>& extents,
                                     bool replace);
  absl::StatusOr<ObjectView> Describe(const std::string& name,
                                      std::optional<uint64_t> version = std::nullopt) const;
  absl::StatusOr<std::vector<ObjectView>> List(const std::string& prefix,
                                               const std::string& after, size_t limit) const;
  absl::Status Delete(const std::string& name);
  // Copies `bytes` into a new node-owned buffer and publishes it as `name`.
  absl::StatusOr<ObjectView> PutData(const std::string& name, std::string_view bytes,
                                     bool replace);
  // Copies bytes [offset, offset + length) of the object into `out` (appended).
  // kFailedPrecondition (409): detached. kOutOfRange: past the end.
  absl::Status ReadData(const metadata::ObjectRecord& object, uint64_t offset, uint64_t length,
                        std::string* out) const;

  // Source side of a pull: `request` is the body of POST /v1/objects/{name}/pull (see
  // README, "HTTP API"). kInvalidArgument: anything malformed, sizes that differ, overlapping
  // destination extents. kNotFound: no such object. kFailedPrecondition (409): detached.
  // kUnavailable: the destination cannot be reached. kDeadlineExceeded: the deadline passed.
  absl::StatusOr<PullStats> ServePull(const std::string& name, const nlohmann::json& request);

  // Destination side: asks the node at `from` (http://host:port) to pull `name` into this
  // node, either into a new buffer (`into` = {"device": "host"}; the result is then
  // published here as `as`, default `name`) or into its own extents
  // (`into` = {"extents": [{"region":R,"offset":O,"length":L}, ...]}).
  absl::StatusOr<PullStats> Pull(const std::string& from, const std::string& name,
                                 std::optional<uint64_t> version, const nlohmann::json& into,
                                 const std::string& as, bool replace);

 private:
  struct Region {
    RegionInfo info;
    char* addr = nullptr;
    engine::RegionId engine_id = 0;
    std::unique_ptr<char, void (*)(char*)> owned{nullptr, nullptr};
  };
  explicit Node(const NodeOptions& options) : options_(options) {}
  bool Attached(const metadata::ObjectRecord& r) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  absl::StatusOr<RegionInfo> AddRegion(char* addr, uint64_t size, engine::Device device,
                                       std::unique_ptr<char, void (*)(char*)> owned);
  absl::StatusOr<engine::PeerId> PeerFor(const nlohmann::json& request, absl::Time deadline);

  const NodeOptions options_;
  std::unique_ptr<metadata::Catalog> catalog_;
  std::unique_ptr<engine::Engine> engine_;
  mutable absl::Mutex mu_;
  std::map<uint64_t, Region> regions_ ABSL_GUARDED_BY(mu_);
  int pulls_in_flight_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace ferry::server

#endif  // FERRY_SERVER_NODE_H_
