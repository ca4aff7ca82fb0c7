// ferry::Node: engine + catalog + regions; what ferryd and embedding programs run. The HTTP
// routes (http_api.h) call these methods. Thread-safe.
#ifndef FERRY_SERVER_NODE_H_
#define FERRY_SERVER_NODE_H_

#include <cstdint>
#include <atomic>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "engine/cuda.h"
#include "engine/engine.h"
#include "metadata/catalog.h"
#include "nlohmann/json.hpp"
#include "server/paths.h"

namespace ferry::server {

struct NodeOptions {
  engine::EngineOptions engine;
  // Where the catalog lives. Default: ./ferry-data.
  std::string data_dir = "./ferry-data";
  // Sync the catalog's log on every change. Default: true.
  bool sync = true;
  // Most extents one request may carry. Default: 65536.
  size_t max_extents = 65536;
  // Versions kept per object name (metadata::CatalogOptions::keep_versions); the buffers the
  // node allocated for the ones it drops are freed. 0: every version. Default: 0.
  size_t keep_versions = 0;
  // Bytes of freed buffers kept for reuse: a buffer the node allocated for an object version
  // that went is kept (off the rails) for the next upload or pull of the same size into the
  // same device, which then takes it instead of new memory (the first touch of which costs
  // most of a pull into a new buffer on a machine whose memory is cold). Oldest go first when
  // full. 0: none. Default: 0.
  uint64_t spare_bytes = 0;
  // Deadline of a pull that names none. Default: 60 s.
  absl::Duration pull_timeout = absl::Seconds(60);
  // Bearer token sent with requests this node makes to other nodes. Default: none.
  std::string peer_token;
  // The staged path's rings: slots per ring and bytes per slot. Default: 8 x 4 MiB.
  size_t staging_slots = 8;
  uint64_t staging_slot_bytes = uint64_t{4} << 20;
};

struct RegionInfo {
  uint64_t id = 0;
  Device device;
  uint64_t size = 0;
  bool owned = false;  // allocated by the node (ferryd), not the caller's memory
  // Allocated for an object's bytes (an upload, a pull into a new buffer): freed with the last
  // object version that uses it.
  bool for_object = false;
};

struct ObjectView {
  metadata::ObjectRecord record;
  bool detached = false;  // a region of its layout is not registered (since a restart)
  std::vector<Device> devices;  // where its extents live, each once
  bool on_rails = true;  // every region of its layout is registered on the rails
};

struct PullStats {
  std::string object;
  uint64_t version = 0;
  uint64_t bytes = 0;
  double seconds = 0;
  std::vector<uint64_t> bytes_per_rail;
  uint64_t rerouted_writes = 0;     // sent again on another rail after theirs failed
  std::vector<size_t> failed_rails;  // the source's rails that failed during the pull
  std::string path = "rdma";
  std::optional<uint64_t> region;  // the new buffer, for pulls into one
  std::vector<double> rail_seconds;  // per source rail: its last delivery completion
};

nlohmann::json ToJson(const RegionInfo& r);
// Without extents: what a pulling node needs (size, devices, on_rails), cheap for big layouts.
nlohmann::json ToJson(const ObjectView& o, bool with_extents = true);
nlohmann::json ToJson(const PullStats& s);

class Node {
 public:
  // Opens the catalog, then the engine with the catalog's node id.
  static absl::StatusOr<std::unique_ptr<Node>> Open(const NodeOptions& options);
  // Drains in-flight pulls (they finish or fail), then closes the engine and the catalog.
  ~Node();

  const std::string& id() const { return catalog_->node_id(); }
  nlohmann::json Info() const;
  engine::Engine& engine() { return *engine_; }

  // A buffer the node allocates and registers, zeroed; `for_object` (an upload or a pull into
  // a new buffer, which writes every byte before it publishes) may take a spare instead, not
  // zeroed. kInvalidArgument: size 0 or over the limit of 1 TiB. kUnimplemented: a device
  // this build cannot allocate.
  absl::StatusOr<RegionInfo> AllocateRegion(Device device, uint64_t size,
                                            bool for_object = false);
  // The caller's memory, registered until DeleteRegion; the caller keeps it valid till then.
  absl::StatusOr<RegionInfo> RegisterRegion(void* addr, uint64_t size, Device device);
  // kNotFound: unknown region. kFailedPrecondition (409): an object uses it.
  absl::Status DeleteRegion(uint64_t id);
  // Frees first what `unused_` holds (see FreeUnusedLocked).
  std::vector<RegionInfo> Regions();

  // kInvalidArgument: bad name, no extents, an empty or out-of-bounds extent. kNotFound: an
  // unknown region. kAlreadyExists: the name is taken and `replace` is false.
  // kResourceExhausted (413): too many extents.
  absl::StatusOr<ObjectView> Publish(const std::string& name,
                                     const std::vector<Extent>& extents,
                                     bool replace);
  absl::StatusOr<ObjectView> Describe(const std::string& name,
                                      std::optional<uint64_t> version = std::nullopt) const;
  absl::StatusOr<std::vector<ObjectView>> List(const std::string& prefix,
                                               const std::string& after, size_t limit) const;
  // Every version of `name`; the regions allocated for it that no version uses any more go
  // too (at once, or when the transfers that still read them end).
  absl::Status Delete(const std::string& name);
  // The bytes of one object upload (PUT /v1/objects/{name}/data), copied in order as they
  // arrive into the buffer the node allocated for them, and published by Finish. An upload
  // dropped unfinished frees its buffer and publishes nothing.
  class Upload {
   public:
    ~Upload();
    Upload(const Upload&) = delete;
    Upload& operator=(const Upload&) = delete;
    // kOutOfRange: more bytes than announced. kNotFound: the buffer was deleted meanwhile.
    absl::Status Append(const char* data, size_t n);
    // kInvalidArgument: fewer bytes than announced; then as Publish.
    absl::StatusOr<ObjectView> Finish();

   private:
    friend class Node;
    Upload(Node* node, std::string name, RegionInfo region, bool replace)
        : node_(node), name_(std::move(name)), region_(std::move(region)), replace_(replace) {}
    // GPU memory: the bytes staged in pinned memory since the last copy go to the device.
    absl::Status Flush();

    Node* node_;
    std::string name_;
    RegionInfo region_;
    bool replace_;
    uint64_t written_ = 0;  // bytes appended, staged ones included
    PinnedStages::Buffer stage_;  // GPU memory: taken at the first Append
    size_t staged_ = 0;           // bytes in stage_ not yet copied to the device
    bool published_ = false;
  };
  // Allocates `size` bytes on `device` for an upload of `name`. kInvalidArgument: a bad name,
  // size 0 (or as AllocateRegion). kAlreadyExists: the name is taken and `replace` is false.
  absl::StatusOr<std::unique_ptr<Upload>> BeginUpload(const std::string& name, uint64_t size,
                                                      bool replace, Device device);
  // BeginUpload, Append, Finish with `bytes`.
  absl::StatusOr<ObjectView> PutData(const std::string& name, std::string_view bytes,
                                     bool replace, Device device = Device::Host());
  // Copies bytes [offset, offset + length) of the object to `out`.
  // kFailedPrecondition (409): detached. kOutOfRange: past the end.
  absl::Status ReadData(const metadata::ObjectRecord& object, uint64_t offset, uint64_t length,
                        char* out) const;
  // A buffer of PinnedStages::kBytes to read `object` through with ReadData: pinned when any
  // of it is on a GPU.
  absl::StatusOr<PinnedStages::Buffer> ReadBuffer(const ObjectView& object);

  // Source side of a pull: `request` is the body of POST /v1/objects/{name}/pull (see
  // README, "HTTP API"). kInvalidArgument: anything malformed, sizes that differ, overlapping
  // destination extents. kNotFound: no such object. kFailedPrecondition (409): detached.
  // kUnavailable: the destination cannot be reached. kDeadlineExceeded: the deadline passed.
  absl::StatusOr<PullStats> ServePull(const std::string& name, const nlohmann::json& request);

  // Destination side: asks the node at `from` (http://host:port) to pull `name` into this
  // node, either into a new buffer (`into` = {"device": "host"}; the result is then
  // published here as `as`, default `name`) or into its own extents
  // (`into` = {"extents": [{"region":R,"offset":O,"length":L}, ...]}). The path is chosen
  // (ChoosePath) unless `path` forces one; the source refuses a path that cannot work.
  absl::StatusOr<PullStats> Pull(const std::string& from, const std::string& name,
                                 std::optional<uint64_t> version, const nlohmann::json& into,
                                 const std::string& as, bool replace,
                                 std::optional<PullPath> path = std::nullopt);

 private:
  // Memory the node allocated, with the function that frees it (null: the caller's memory).
  using OwnedMemory = std::unique_ptr<char, void (*)(char*)>;
  struct Region {
    RegionInfo info;
    char* addr = nullptr;
    engine::RegionId engine_id = 0;  // 0: not on the rails (GPU memory the provider lacks)
    engine::CudaIpcExport ipc;       // GPU memory: how processes on this host map it
    OwnedMemory owned{nullptr, nullptr};
  };
  // Credits of one staged pull this node serves: per destination slot, the last chunk the
  // destination has copied out of it.
  struct Credits {
    absl::Mutex mu;
    std::vector<int64_t> freed ABSL_GUARDED_BY(mu);
  };
  // Destination extents of a pull as the source checked them.
  struct PullTarget {
    std::vector<RegionDescriptor> regions;
    std::vector<Extent> extents;  // region = index into `regions`
  };
  // Counts a pull (either side) while it runs; ~Node waits for none.
  class PullInFlight {
   public:
    explicit PullInFlight(Node* node) : node_(node) {
      absl::MutexLock lock(&node_->mu_);
      ++node_->pulls_in_flight_;
    }
    ~PullInFlight() {
      absl::MutexLock lock(&node_->mu_);
      --node_->pulls_in_flight_;
      node_->FreeUnusedLocked(kUnpinGrace);  // what a transfer of this pull kept
    }
    PullInFlight(const PullInFlight&) = delete;
    PullInFlight& operator=(const PullInFlight&) = delete;

   private:
    Node* node_;
  };
  // How long freeing a region waits for a transfer that has just ended to let go of it (its
  // progress thread does so a moment after the transfer's Wait returns).
  static constexpr absl::Duration kUnpinGrace = absl::Milliseconds(20);
  explicit Node(const NodeOptions& options) : options_(options) {}
  bool Attached(const metadata::ObjectRecord& r) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  ObjectView View(metadata::ObjectRecord r) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  RegionDescriptor DescriptorOf(const Region& r) const;
  // The object bytes of `extents` (over this node's regions) as local spans. kNotFound: a
  // region that is not registered.
  absl::StatusOr<std::vector<Span>> SpansOf(const std::vector<Extent>& extents)
      const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  bool AllRegistered(const std::vector<Extent>& extents) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  void OnControl(std::string_view sender, std::string_view payload);
  absl::StatusOr<PullTarget> ParsePullTarget(const nlohmann::json& req, uint64_t size) const;
  absl::StatusOr<PullStats> ServeRdma(const metadata::ObjectRecord& object, PullTarget target,
                                      engine::PeerId peer, absl::Time deadline);
  absl::StatusOr<PullStats> ServeIpc(const metadata::ObjectRecord& object,
                                     const PullTarget& target);
  absl::StatusOr<PullStats> ServeStaged(const metadata::ObjectRecord& object,
                                        const PullTarget& target, engine::PeerId peer,
                                        const nlohmann::json& staging, absl::Time deadline);
  // Destination side of the staged path: copies each chunk out of `ring` into `local` as its
  // immediate lands, and gives the slot back to the source. Stops early when `*stop` is set.
  absl::Status ReceiveStaged(const std::vector<Extent>& local, uint64_t size,
                             StagingRing& ring, uint32_t tag, engine::PeerId source,
                             absl::Time deadline, const std::atomic<bool>* stop);
  absl::StatusOr<RegionInfo> AddRegion(char* addr, uint64_t size, Device device,
                                       OwnedMemory owned, bool for_object);
  // Deregisters the region from the rails (waiting until `deadline` for a transfer to let go
  // of it; kFailedPrecondition as a 409 if none does) and frees it.
  absl::Status FreeRegionLocked(std::map<uint64_t, Region>::iterator it, absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Frees the regions of `unused_` that no object version uses; one that a transfer still
  // reads after `grace` stays there for the end of a later pull (or the next region listing).
  void FreeUnusedLocked(absl::Duration grace = absl::ZeroDuration())
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Keeps the memory of `r` (being freed) as a spare when it is the node's, was allocated for
  // an object, and fits in NodeOptions::spare_bytes.
  void KeepSpareLocked(Region& r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A spare of exactly `size` bytes on `device`, taken; null when there is none.
  OwnedMemory TakeSpare(Device device, uint64_t size);
  // The regions of dropped object versions that the catalog `released`: those the node
  // allocated for objects go to `unused_` and are freed.
  void ReleaseLocked(const std::set<uint64_t>& released) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Copies `n` bytes from `src` to `offset` of region `id`. kNotFound: no such region.
  absl::Status CopyIntoRegion(uint64_t id, uint64_t offset, const char* src, uint64_t n);
  absl::StatusOr<engine::PeerId> PeerFor(const nlohmann::json& request, absl::Time deadline);

  const NodeOptions options_;
  std::unique_ptr<metadata::Catalog> catalog_;
  std::unique_ptr<engine::Engine> engine_;
  mutable absl::Mutex mu_;
  std::map<uint64_t, Region> regions_ ABSL_GUARDED_BY(mu_);
  // Regions allocated for objects whose last version went.
  std::set<uint64_t> unused_ ABSL_GUARDED_BY(mu_);
  // Memory of freed object buffers kept for reuse, oldest first (NodeOptions::spare_bytes).
  struct Spare {
    Device device;
    uint64_t size = 0;
    OwnedMemory memory{nullptr, nullptr};
  };
  std::deque<Spare> spares_ ABSL_GUARDED_BY(mu_);
  uint64_t spare_total_ ABSL_GUARDED_BY(mu_) = 0;
  int pulls_in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  std::unique_ptr<StagingPool> staging_;
  PinnedStages stages_;  // REST reads and writes of GPU objects
  engine::CudaIpcCache ipc_cache_;
  std::atomic<uint32_t> next_tag_{1};
  absl::Mutex credits_mu_;
  // key: source-side "destination node id/tag"
  std::map<std::string, std::shared_ptr<Credits>> credits_ ABSL_GUARDED_BY(credits_mu_);
};

}  // namespace ferry::server

#endif  // FERRY_SERVER_NODE_H_
