// ferry::server::Node: engine + catalog + regions, as a typed C++ API with no HTTP and no JSON
// inside; what ferryd and embedding programs run. Other nodes are reached through peer
// transports (peer.h): control messages over the rails in production, HTTP when the fabric
// cannot reach a peer. Thread-safe.
#ifndef FERRY_SERVER_NODE_H_
#define FERRY_SERVER_NODE_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "cluster/member.h"
#include "engine/cuda.h"
#include "engine/engine.h"
#include "ferry/layout.h"
#include "ferry/pull.h"
#include "ferry/types.h"
#include "metadata/catalog.h"
#include "server/metrics.h"
#include "server/paths.h"
#include "server/peer.h"
#include "server/work_queue.h"
#include "wire/auth.h"
#include "wire/messages.h"

namespace ferry::server {

struct NodeOptions {
  engine::EngineOptions engine;
  // Where the catalog lives. Default: ./ferry-data.
  std::string data_dir = "./ferry-data";
  // Sync the catalog's log on every change. Default: true.
  bool sync = true;
  // Bytes the data disk keeps free (metadata::CatalogOptions::min_free_bytes): below them the
  // catalog takes no change (507). Default: 64 MiB.
  uint64_t min_free_disk = uint64_t{64} << 20;
  // Most pieces one request, layout or object may carry. Default: 65536.
  size_t max_extents = 65536;
  // Versions kept per object name (metadata::CatalogOptions::keep_versions); the buffers the
  // node allocated for the ones it drops are freed. 0: every version. Default: 0.
  size_t keep_versions = 0;
  // Bytes of freed buffers kept for reuse: a buffer the node allocated for an object version
  // that went is kept (off the rails) for the next upload or pull of the same size into the
  // same device, which then takes it instead of new memory. Oldest go first when full. 0:
  // none. Default: 0.
  uint64_t spare_bytes = 0;
  // Most bytes of host memory the node allocates (its regions and new buffers, spares
  // included); past it an allocation is refused with kResourceExhausted (HTTP 429), spares
  // going first. 0: three quarters of the machine's memory. Default: 0.
  uint64_t memory_limit = 0;
  // Deadline of a pull that names none, and the longest one may name. Defaults: 60 s, 1 h.
  absl::Duration pull_timeout = absl::Seconds(60);
  absl::Duration max_pull_timeout = absl::Hours(1);
  // The key node-to-node messages are sealed and checked with (wire::MessageAuth); nodes
  // configured with a bearer token use one derived from it. Empty: messages go unsealed.
  // Default: empty.
  std::string cluster_key;
  // How this node asks other nodes: "auto" (over the fabric, HTTP when the fabric cannot
  // reach the peer), "fabric" or "http". Default: "auto".
  std::string peer_transport = "auto";
  // Threads that serve other nodes' requests (source side). 0: a quarter of the CPUs, at
  // least 4. Default: 0.
  size_t serve_threads = 0;
  // The staged path's rings: slots per ring and bytes per slot. Default: 8 x 4 MiB.
  size_t staging_slots = 8;
  uint64_t staging_slot_bytes = uint64_t{4} << 20;
  // Count what the node does for /metrics (its rails too: EngineOptions::counters). false:
  // nothing is counted, to measure what counting costs. Default: true.
  bool metrics = true;
  // The cluster's directory: etcd://host:port[,...] (etcd) or http://host:port (a ferryd with
  // --serve-directory). With one the node can Join it, and pulls that name no source ask
  // it for holders. Empty: none; pulls name their source. Default: empty.
  std::string directory;
  // The bearer token for a ferryd directory. Default: none.
  std::string directory_token;
  // The lease the node's records live under: a node that dies leaves the directory within
  // it. Default: 5 s.
  absl::Duration directory_ttl = absl::Seconds(5);
  // Labels of this node in the directory (a distribution may pick nodes by them).
  std::map<std::string, std::string> labels;
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

// What GET /v1/node says of a node, and what first contact learns of a peer.
struct NodeInfo {
  std::string id;
  std::string version;
  std::string host;  // HostId()
  std::vector<engine::RailInfo> rails;
  size_t progress_threads = 0;
  std::vector<Device> devices;
  bool cuda_built = false;
  uint64_t spare_bytes = 0;
  std::string bell;     // raw endpoint name; empty when the engine has none
  bool sealed = false;  // node-to-node messages carry a MAC under a cluster key
  PeerAddress address() const;
};

struct PublishOptions {
  // Make a new version when the name exists (else kAlreadyExists). Default: false.
  bool replace = false;
  // Written to the catalog on disk and kept across restarts. false: kept in memory only (no
  // fsync; KV pages), listed and pulled like any other, gone at restart. Default: true.
  bool durable = true;
  // The publisher's metadata: a JSON document of at most kMaxMeta bytes, kept with the
  // version and given back by Describe (a tensor table, say). Default: none.
  std::string meta;
  // The bytes' media type, given back with them. Default: none.
  std::string content_type;
  // Publish only if the name's latest version is this one (0: only if it has none); else
  // kFailedPrecondition (HTTP 412) and nothing changes. Default: no condition.
  std::optional<uint64_t> if_latest;
  // Publish as this version number (a replica of another node's version): kFailedPrecondition
  // (HTTP 412) unless above the latest here. Default: the next one.
  std::optional<uint64_t> version;
  // With a directory: list this node there as a holder of the version. Default: true.
  bool announce = true;
};

// A pull under way. Thread-safe.
class PullHandle {
 public:
  ~PullHandle();
  // Waits until the pull ends or `deadline` passes (kDeadlineExceeded; the pull goes on).
  // The pull's own failures: as Node::Pull.
  absl::StatusOr<PullStats> Wait(absl::Time deadline = absl::InfiniteFuture());
  // True once Wait would return at once.
  bool Done();
  // Stops the pull: returns once no WRITE of it can land in this node's memory any more (the
  // source confirmed it, or the windows it wrote through are closed), with the pull's
  // end (kCancelled when the cancel came first).
  absl::StatusOr<PullStats> Cancel();
  uint64_t id() const { return id_; }

 private:
  friend class Node;
  struct State;
  PullHandle(uint64_t id, std::shared_ptr<State> state) : id_(id), state_(std::move(state)) {}
  const uint64_t id_;
  std::shared_ptr<State> state_;  // shared with the transport's answer callback
};

class Node {
 public:
  // Opens the catalog, then the engine with the catalog's node id.
  static absl::StatusOr<std::unique_ptr<Node>> Open(const NodeOptions& options);
  // Drains in-flight pulls (they finish or fail), then closes the engine and the catalog.
  ~Node();
  Node(const Node&) = delete;
  Node& operator=(const Node&) = delete;

  const std::string& id() const { return catalog_->node_id(); }
  NodeInfo Info() const;
  engine::Engine& engine() { return *engine_; }
  const NodeOptions& options() const { return options_; }

  // --- Regions. ---
  // A buffer the node allocates and registers, zeroed; `for_object` (an upload or a pull into
  // a new buffer, which writes every byte before it publishes) may take a spare instead, not
  // zeroed. kInvalidArgument: size 0 or over 1 TiB. kUnimplemented: a device this build
  // cannot allocate. kResourceExhausted: host memory past NodeOptions::memory_limit.
  absl::StatusOr<RegionInfo> AllocateRegion(Device device, uint64_t size, bool for_object = false);
  // The caller's memory, registered until DeleteRegion; the caller keeps it valid till then.
  absl::StatusOr<RegionInfo> RegisterRegion(void* addr, uint64_t size, Device device);
  // kNotFound: unknown region. kFailedPrecondition (409): an object or a prepared destination
  // uses it.
  absl::Status DeleteRegion(uint64_t id);
  // Frees first what `unused_` holds (see FreeUnusedLocked).
  std::vector<RegionInfo> Regions();

  // --- Objects. ---
  // kInvalidArgument: bad name, an empty layout, an empty or out-of-bounds piece.
  // kNotFound: an unknown region. kAlreadyExists: the name is taken and not `replace`.
  // kResourceExhausted (413): too many pieces.
  // kUnavailable: the node is draining.
  absl::StatusOr<ObjectInfo> Publish(const std::string& name, const Layout& layout,
                                     const PublishOptions& options = {}) {
    if (absl::Status s = Accepting(); !s.ok()) return s;
    return Publish(name, layout, options, std::nullopt);
  }
  // kNotFound: no such name or version.
  absl::StatusOr<ObjectInfo> Describe(const std::string& name,
                                      std::optional<uint64_t> version = std::nullopt,
                                      bool with_extents = true) const;
  absl::StatusOr<std::vector<ObjectInfo>> List(const std::string& prefix, const std::string& after,
                                               size_t limit) const;
  // Every version of `name`; the regions allocated for it that no version uses any more go
  // too (at once, or when the transfers that still read them end). kNotFound: no such name.
  // `if_latest`: only if the latest version is that one (kFailedPrecondition otherwise).
  absl::Status Delete(const std::string& name, std::optional<uint64_t> if_latest = std::nullopt);
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
    absl::StatusOr<ObjectInfo> Finish();

   private:
    friend class Node;
    Upload(Node* node, std::string name, RegionInfo region, PublishOptions options)
        : node_(node), name_(std::move(name)), region_(std::move(region)), options_(options) {}
    // GPU memory: the bytes staged in pinned memory since the last copy go to the device.
    absl::Status Flush();

    Node* node_;
    std::string name_;
    RegionInfo region_;
    PublishOptions options_;
    uint64_t written_ = 0;        // bytes appended, staged ones included
    uint32_t crc32c_ = 0;         // of the bytes appended
    PinnedStages::Buffer stage_;  // GPU memory: taken at the first Append
    size_t staged_ = 0;           // bytes in stage_ not yet copied to the device
    bool published_ = false;
  };
  // Allocates `size` bytes on `device` for an upload of `name`. kInvalidArgument: a bad name,
  // size 0 (or as AllocateRegion). kAlreadyExists: the name is taken and not `replace`.
  absl::StatusOr<std::unique_ptr<Upload>> BeginUpload(const std::string& name, uint64_t size,
                                                      Device device,
                                                      const PublishOptions& options = {});
  // BeginUpload, Append, Finish with `bytes`.
  absl::StatusOr<ObjectInfo> PutData(const std::string& name, std::string_view bytes,
                                     Device device = Device::Host(),
                                     const PublishOptions& options = {});
  // Copies bytes [offset, offset + length) of object version `object` to `out`.
  // kFailedPrecondition (409): detached. kOutOfRange: past the end. kNotFound: gone.
  absl::Status ReadData(const ObjectInfo& object, uint64_t offset, uint64_t length,
                        char* out) const;
  // A buffer of PinnedStages::kBytes to read `object` through with ReadData: pinned when any
  // of it is on a GPU.
  absl::StatusOr<PinnedStages::Buffer> ReadBuffer(const ObjectInfo& object);

  // --- Prepared destinations. ---
  // Registers `layout` (over this node's regions, pieces disjoint) as a destination that pulls
  // name by handle, filling all its pieces or those they list by index: its windows stay open
  // and sources keep its descriptors until ReleaseDestination. kInvalidArgument / kNotFound /
  // kResourceExhausted: as a pull's layout.
  absl::StatusOr<uint64_t> PrepareDestination(const Layout& layout);
  // kNotFound: no such handle. kFailedPrecondition (409): a pull into it runs.
  absl::Status ReleaseDestination(uint64_t handle);

  // --- Pulls, destination side. ---
  // Pulls `spec.object` from the node at `spec.from`. kInvalidArgument: a bad spec, sizes
  // that differ, destination pieces that overlap or lie in an object's buffer (published
  // versions are immutable). kNotFound: no such object there, or an unknown region here.
  // kFailedPrecondition (409): the object is detached there. kAlreadyExists: `as` is taken.
  // kUnavailable: the source cannot be reached, or every rail between the nodes failed.
  // kDeadlineExceeded: the pull's deadline passed.
  absl::StatusOr<PullStats> Pull(const PullSpec& spec);
  // The same, returning once the request is on its way (first contact with a node, and the
  // object's size for a pull into a new buffer, are asked for before it returns).
  absl::StatusOr<std::unique_ptr<PullHandle>> PullAsync(const PullSpec& spec);
  // Pulls in one call: each item's result, in order (a failed item does not stop the others).
  std::vector<absl::StatusOr<PullStats>> PullBatch(const std::vector<PullSpec>& specs);

  // --- Serving other nodes. ---
  // A message from another node, as a transport received it (sealed when a cluster key is
  // set); `reply` is called once with the sealed answer, or not at all for messages that
  // want none. `transport` says how answers travel: over the fabric a reply to a sender this
  // node has not met adds it as a peer.
  using Reply = std::function<void(std::string)>;
  void HandleMessage(std::string_view sender, std::string sealed, Reply reply);

  // --- Distribution. ---
  // Delivers the object version of `spec` from this node to every receiver of `spec`, in a
  // chain: each receiver pulls it chunk by chunk from the one before it while serving what it
  // has to the next, checks each chunk's CRC32C, routes around receivers that fail, and ends
  // holding the version (a holder in the directory). Returns once every receiver has ended,
  // each with its own status. kNotFound: no such object here, or no receiver. kInvalidArgument:
  // a bad spec. kFailedPrecondition: this node has no URL (SetUrl), or, asked by label, no
  // directory. kUnavailable: draining.
  absl::StatusOr<DistributeResult> Distribute(const DistributeSpec& spec);
  // How other nodes reach this one over HTTP (a distribution's receivers pull from it there).
  // Set once, before the node serves.
  void SetUrl(std::string url) { url_ = std::move(url); }
  const std::string& url() const { return url_; }

  // --- Cluster. ---
  // Puts this node in the directory (NodeOptions::directory), reachable over HTTP at `url`,
  // with the latest version of each of its objects, and keeps it there until Drain or the
  // node's end. kFailedPrecondition: the node has no directory. The directory need not
  // answer yet: the node joins when it does.
  absl::Status Join(const std::string& url);
  // What the directory says of the cluster: its nodes and what they hold.
  // kFailedPrecondition: no directory. kUnavailable: it cannot be reached.
  absl::StatusOr<std::vector<cluster::NodeEntry>> Cluster();
  // The directory's URL and this node's standing in it ("joined", why not, ...); empty
  // without a directory.
  std::string directory_url() const;
  std::string directory_state();

  // --- Drain. ---
  // From now on new pulls (either side), uploads and publishes are refused with kUnavailable;
  // those running go on; the node leaves the directory. For good: a node drains to stop.
  void Drain();
  bool draining() const { return draining_.load(); }
  // Waits until no pull runs on this node (true) or `deadline` passes (false).
  bool AwaitPulls(absl::Time deadline);
  // Cancels every pull running here, as a destination (PullHandle::Cancel) and as a source (as
  // its destination's cancel would), and returns once each has ended.
  void CancelPulls();

  // --- Monitoring. ---
  NodeMetrics& metrics() { return metrics_; }
  // Every metric of this node in Prometheus' text format: its own (pulls, control round trips,
  // HTTP requests as its server counts them), its rails', its catalog's and its regions'.
  std::string Metrics() const;

  // For tests: replaces how this node reaches other nodes.
  void SetTransportsForTesting(std::unique_ptr<PeerTransport> fabric,
                               std::unique_ptr<PeerTransport> http);

 private:
  friend class PullHandle;
  friend class NodeTestPeer;
  // Publish, with the CRC32C of the bytes when the node saw them all (an upload).
  absl::StatusOr<ObjectInfo> Publish(const std::string& name, const Layout& layout,
                                     const PublishOptions& options, std::optional<uint32_t> crc32c);
  // kUnavailable while draining.
  absl::Status Accepting() const;
  // A pull that names no source: from the directory's holders in turn (RankedHolders) until
  // one delivers, within the pull's deadline.
  absl::StatusOr<PullStats> PullByName(const PullSpec& spec);
  // The holders of the spec's object (other nodes), best first: same host, then fewest pulls
  // of this node from them, then random. kNotFound: none; kUnavailable: no directory answer.
  absl::StatusOr<std::vector<cluster::Holder>> RankedHolders(const PullSpec& spec);
  // The spec with its best holder as the source (and that holder's version).
  absl::StatusOr<PullSpec> FromBestHolder(const PullSpec& spec);
  // The spec's deadline from now: its own, or the node's default, at most the node's longest.
  absl::Duration TimeoutOf(const PullSpec& spec) const;
  // The node's record in the directory.
  nlohmann::json DirectoryRecord(const std::string& url, const std::string& state) const;
  struct PullTarget;
  struct Session;
  struct ServedPull;
  struct ServedCall;
  struct Incoming;
  struct Prepared;
  struct Windows;
  struct RdmaPull;
  // Memory the node allocated, with the function that frees it (null: the caller's memory).
  using OwnedMemory = std::unique_ptr<char, std::function<void(char*)>>;
  struct Region {
    RegionInfo info;
    char* addr = nullptr;
    engine::RegionId engine_id = 0;  // 0: not on the rails (GPU memory the provider lacks)
    engine::CudaIpcExport ipc;       // GPU memory: how processes on this host map it
    OwnedMemory owned;
    int prepared = 0;  // prepared destinations over it
  };
  // Credits of one staged pull this node serves: per destination slot, the last chunk the
  // destination has copied out of it.
  struct Credits {
    absl::Mutex mu;
    std::vector<int64_t> freed ABSL_GUARDED_BY(mu);
  };
  // Counts a pull (either side) while it runs; ~Node waits for none.
  class PullInFlight {
   public:
    explicit PullInFlight(Node* node);
    ~PullInFlight();
    PullInFlight(const PullInFlight&) = delete;
    PullInFlight& operator=(const PullInFlight&) = delete;

   private:
    Node* node_;
  };
  // How long freeing a region waits for a transfer that has just ended to let go of it (its
  // progress thread does so a moment after the transfer's Wait returns).
  static constexpr absl::Duration kUnpinGrace = absl::Milliseconds(20);
  explicit Node(const NodeOptions& options);

  bool Attached(const metadata::ObjectRecord& r) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  ObjectInfo View(const metadata::ObjectRecord& r, bool with_extents) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  RegionDescriptor DescriptorOf(const Region& r) const;
  // The object bytes of `extents` (over this node's regions) as local spans. kNotFound: a
  // region that is not registered.
  absl::StatusOr<std::vector<Span>> SpansOf(const std::vector<Extent>& extents) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  bool AllRegistered(const std::vector<Extent>& extents) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Checks the pieces of `layout` against this node's regions as a destination: registered,
  // in bounds, not empty, disjoint, in no published object's buffer. Sum of their bytes.
  absl::StatusOr<uint64_t> CheckDestination(const Layout& layout) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  absl::StatusOr<RegionInfo> AddRegion(char* addr, uint64_t size, Device device, OwnedMemory owned,
                                       bool for_object);
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
  // Counts `size` bytes of host memory about to be allocated against the memory limit
  // (dropping spares to make room); kResourceExhausted when they do not fit. The caller
  // gives them back (UnreserveHost) once the region is in regions_, or failed.
  absl::Status ReserveHost(uint64_t size);
  void UnreserveHost(uint64_t size);
  // A spare of exactly `size` bytes on `device`, taken; null when there is none.
  OwnedMemory TakeSpare(Device device, uint64_t size);
  // The regions of dropped object versions that the catalog `released`: those the node
  // allocated for objects go to `unused_` and are freed.
  void ReleaseLocked(const std::set<uint64_t>& released) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Copies `n` bytes from `src` to `offset` of region `id`. kNotFound: no such region.
  absl::Status CopyIntoRegion(uint64_t id, uint64_t offset, const char* src, uint64_t n);

  // --- Destination side (node_pull.cc). ---
  // The session with the node at `url`: first contact over HTTP when there is none.
  absl::StatusOr<std::shared_ptr<Session>> SessionFor(const std::string& url, absl::Time deadline);
  void DropSession(const std::shared_ptr<Session>& session);
  // Sends `type` with `body` to the session's node as request `id`; `done` gets its answer.
  void Call(const std::shared_ptr<Session>& session, wire::MessageType type, uint64_t id,
            std::string body, absl::Time deadline,
            std::function<void(absl::StatusOr<wire::Envelope>)> done);
  // The same, waiting.
  absl::StatusOr<wire::Envelope> CallAndWait(const std::shared_ptr<Session>& session,
                                             wire::MessageType type, std::string body,
                                             absl::Time deadline);
  // Sends a sealed message to the session's node: over the fabric, or HTTP when no rail
  // carries it (peer_transport "auto"), or as the session says.
  void Transmit(const std::shared_ptr<Session>& session, std::string sealed, absl::Time deadline,
                std::function<void(absl::StatusOr<std::string>)> sent);
  // How long a question over the fabric waits for its answer before it goes over HTTP.
  absl::Duration FabricAnswerTime() const;
  // A transport's word on request `id`: its answer (HTTP), nothing yet (the fabric), or why
  // it could not go.
  void OnSent(uint64_t id, absl::StatusOr<std::string> sent);
  absl::StatusOr<wire::Envelope> OpenAnswer(std::string_view sealed);
  // Hands request `id` its answer (once; later ones are dropped).
  void Complete(uint64_t id, absl::StatusOr<wire::Envelope> answer);
  void Forget(uint64_t id);
  absl::StatusOr<ObjectInfo> StatAt(const std::shared_ptr<Session>& session,
                                    const std::string& name, std::optional<uint64_t> version,
                                    const wire::ObjectPart& part, absl::Time deadline);
  absl::StatusOr<Windows> OpenWindows(const Layout& local);
  void CloseWindows(const std::vector<uint64_t>& ids, bool wait);
  // Everything a pull needs before its request goes: the session, the destination checked (a
  // new buffer allocated), the path, windows, the request.
  absl::StatusOr<std::shared_ptr<PullHandle::State>> PreparePull(const PullSpec& spec);
  // The same, without counting a failure in the metrics (PreparePull does, as path "none").
  absl::StatusOr<std::shared_ptr<PullHandle::State>> PreparePullUncounted(const PullSpec& spec);
  absl::Status BuildRequest(PullHandle::State& state);
  // Waits for the answer to the state's request (id set), and for the staged path starts the
  // thread that receives the chunks.
  void ArmAnswer(const std::shared_ptr<PullHandle::State>& state);
  void SendPull(const std::shared_ptr<PullHandle::State>& state);
  void OnPullAnswer(const std::shared_ptr<PullHandle::State>& state,
                    absl::StatusOr<wire::Envelope> answer);
  // Asks the source about the state's request (kQuery; see kFirstProbe).
  void Probe(const std::shared_ptr<PullHandle::State>& state);
  // When the answer asks for it, the request goes again (a prepared destination defined, or
  // the staged path for an object off the rails): true when it went.
  bool RetryPull(const std::shared_ptr<PullHandle::State>& state);
  // Ends the pull's local parts: the receiver, the awake token, its windows (waiting for them
  // to close when `wait`).
  void StopPull(PullHandle::State& state, bool wait);
  // Ends a pull here once its answer came, its deadline passed or it is cancelled: then no
  // WRITE of it can land any more; publishes a new buffer, frees what a failed one allocated.
  absl::StatusOr<PullStats> FinishPull(PullHandle::State& state, bool cancelled);
  // Frees what a pull holds (its new buffer when it was not published).
  void Abandon(PullHandle::State& state);
  // A prepared destination's windows replaced by new ones (new keys, a new epoch).
  void RekeyPrepared(const std::shared_ptr<Prepared>& prepared);
  // Destination side of the staged path: copies each chunk out of `ring` into `local` as its
  // immediate lands, and gives the slot back to the source. Stops early when `*stop` is set.
  absl::Status ReceiveStaged(const std::vector<Extent>& local, uint64_t size, StagingRing& ring,
                             uint32_t tag, std::shared_ptr<Session> source, absl::Time deadline,
                             const std::atomic<bool>* stop);

  // --- Source side (node_serve.cc). ---
  // The answer to one request of `sender` (reached at `from`).
  void Serve(wire::Envelope request, Reply reply);
  absl::StatusOr<ObjectInfo> ServeStat(const wire::StatRequest& request);
  // What ServeHere looked up already, so that ServePull does not wait for it.
  struct Resolved {
    std::shared_ptr<const metadata::ObjectRecord> object;
    engine::PeerId peer = 0;
  };
  // Starts a pull; `done` gets its stats or error (possibly before ServePull returns).
  void ServePull(const PeerAddress& from, uint64_t id, wire::PullRequest request,
                 std::function<void(absl::StatusOr<PullStats>)> done,
                 const Resolved* resolved = nullptr);
  // What ServePull does once the pull is counted and known (kQuery): again, once the bytes of
  // an object this node is receiving have landed. OK when done or waiting.
  absl::Status ServePullNow(const std::shared_ptr<ServedCall>& call);
  // Distribution (node_distribute.cc): the receive of `object` version `version` running
  // here, if any, and the record its bytes are served from meanwhile.
  std::shared_ptr<Incoming> FindIncoming(const std::string& object, uint64_t version);
  std::shared_ptr<const metadata::ObjectRecord> IncomingRecord(const Incoming& in) const;
  // Takes a coordinator's receive (answering kRunning, or kError) and runs it on a thread of
  // receive_queue_; its end is kept for kQuery.
  void ServeReceive(const PeerAddress& from, uint64_t request, wire::Receive r, Reply reply);
  absl::StatusOr<wire::ReceiveStats> RunReceive(const wire::Receive& r, Incoming& in,
                                                ServedPull& served, absl::Time deadline);
  // ServePull for a request of `from`, answered through `reply` (none for a copy of a request
  // being served).
  void ServePullRequest(const PeerAddress& from, uint64_t id, wire::PullRequest pull, Reply reply,
                        const Resolved* resolved);
  // On the progress thread that received `request`: serves it there when that needs no wait
  // (true), else leaves it to the serving threads (false).
  bool ServeHere(const wire::Envelope& request, const Reply& reply);
  // The peer (engine) for a node that asked, added at its first request (blocks for its
  // hellos: never on a progress thread); CachedPeer only looks (kNotFound: none yet, or stale).
  absl::StatusOr<engine::PeerId> PeerFor(const PeerAddress& from, absl::Time deadline);
  absl::StatusOr<engine::PeerId> CachedPeer(const PeerAddress& from);
  // The destination of `request` as extents over its descriptors; `sender` has its prepared
  // destinations cached here.
  absl::StatusOr<PullTarget> ResolveTarget(const std::string& sender,
                                           const wire::PullRequest& request, uint64_t size);
  absl::StatusOr<PullStats> ServeIpc(const metadata::ObjectRecord& object,
                                     const std::vector<Extent>& source, const PullTarget& target);
  absl::StatusOr<PullStats> ServeStaged(const metadata::ObjectRecord& object,
                                        const std::vector<Extent>& source, engine::PeerId peer,
                                        const wire::StagingRing& staging, absl::Time deadline);
  void OnCredit(std::string_view sender, const wire::Credit& credit);
  // Stops `sender`'s pull `id` and returns once no WRITE of it can still be posted; one not
  // started yet never starts.
  void OnCancel(const std::string& sender, uint64_t id);
  // Keeps the answer of a pull that ended, for a destination that asks again (kQuery): its
  // answer may have been lost on the way.
  void Ended(const std::string& key, wire::MessageType type, const std::string& body);
  static constexpr size_t kEndedKept = 4096;
  // Whether `sender`'s pull `id` is being served (and not cancelled).
  bool Serving(const std::string& sender, uint64_t id);
  // Submits the transfer of an rdma pull to `peer` (to the peer that replaced it, when another
  // pull replaced it meanwhile); once more, on a fresh peer, when every rail failed on the
  // first try.
  absl::Status SubmitRdma(const std::shared_ptr<RdmaPull>& rdma, engine::PeerId peer);
  // The transfer's source pieces (engine regions) for `rdma`'s object, checked to be attached
  // and on the rails; notes whether GPU memory is at either end.
  absl::Status SourceOfLocked(RdmaPull& rdma, engine::TransferRequest& t)
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Drops what this node keeps of `node` when its peer `failed` is still the current one (its
  // engine peer goes too, at the next PeerFor).
  void ForgetPeer(const std::string& node, engine::PeerId failed);
  // Engine control messages: node messages over the fabric.
  void OnControl(std::string_view sender, std::string_view payload);

  const NodeOptions options_;
  std::unique_ptr<metadata::Catalog> catalog_;
  std::unique_ptr<engine::Engine> engine_;
  wire::MessageAuth auth_;
  PeerAddress self_;  // how other nodes reach this one over the fabric
  std::unique_ptr<PeerTransport> fabric_;
  std::unique_ptr<PeerTransport> http_;
  std::atomic<bool> stopping_{false};  // the destructor has begun
  std::atomic<bool> draining_{false};
  NodeMetrics metrics_;
  std::unique_ptr<cluster::Membership> membership_;  // with a directory
  mutable absl::Mutex mu_;
  std::map<uint64_t, Region> regions_ ABSL_GUARDED_BY(mu_);
  // Regions allocated for objects whose last version went.
  std::set<uint64_t> unused_ ABSL_GUARDED_BY(mu_);
  // Memory of freed object buffers kept for reuse, oldest first (NodeOptions::spare_bytes).
  struct Spare {
    Device device;
    uint64_t size = 0;
    OwnedMemory memory;
  };
  std::deque<Spare> spares_ ABSL_GUARDED_BY(mu_);
  uint64_t spare_total_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t memory_limit_ = 0;                        // NodeOptions::memory_limit, resolved
  uint64_t reserved_host_ ABSL_GUARDED_BY(mu_) = 0;  // being allocated
  // Pulls running here, either side (PullInFlight). A lock of its own, never held while
  // waiting for anything: progress threads count the pulls they serve.
  mutable absl::Mutex flight_mu_;
  int pulls_in_flight_ ABSL_GUARDED_BY(flight_mu_) = 0;
  // unused_ is not empty (read without mu_, which progress threads do not take).
  std::atomic<bool> has_unused_{false};
  std::map<uint64_t, std::shared_ptr<Prepared>> prepared_ ABSL_GUARDED_BY(mu_);
  uint64_t next_prepared_ ABSL_GUARDED_BY(mu_) = 1;
  std::unique_ptr<StagingPool> staging_;
  PinnedStages stages_;  // REST reads and writes of GPU objects
  engine::CudaIpcCache ipc_cache_;
  std::atomic<uint32_t> next_tag_{1};
  std::atomic<uint64_t> next_request_{1};

  // Destination side: sessions by URL; requests waiting for their answers, by id.
  absl::Mutex sessions_mu_;
  std::map<std::string, std::shared_ptr<Session>> sessions_ ABSL_GUARDED_BY(sessions_mu_);
  // Pulls running here as the destination, by their state's address (to cancel them).
  absl::Mutex running_mu_;
  std::map<const void*, std::weak_ptr<PullHandle::State>> running_ ABSL_GUARDED_BY(running_mu_);
  absl::Mutex calls_mu_;
  absl::flat_hash_map<uint64_t, std::function<void(absl::StatusOr<wire::Envelope>)>> calls_
      ABSL_GUARDED_BY(calls_mu_);

  // Source side: peers by node id, with the prepared destinations they showed; running pulls
  // by "sender/id" (to cancel them); staged pulls' credits by "sender/tag".
  absl::Mutex peer_add_mu_;  // held while a peer is added (PeerFor)
  absl::Mutex served_mu_;
  struct Peer;
  std::map<std::string, std::shared_ptr<Peer>> peers_ ABSL_GUARDED_BY(served_mu_);
  std::map<std::string, std::shared_ptr<ServedPull>> served_ ABSL_GUARDED_BY(served_mu_);
  std::map<std::string, std::pair<wire::MessageType, std::string>> ended_
      ABSL_GUARDED_BY(served_mu_);
  std::deque<std::string> ended_order_ ABSL_GUARDED_BY(served_mu_);
  absl::Mutex credits_mu_;
  std::map<std::string, std::shared_ptr<Credits>> credits_ ABSL_GUARDED_BY(credits_mu_);

  std::string url_;  // SetUrl
  // Objects being received (distributions), by "name@version".
  absl::Mutex incoming_mu_;
  std::map<std::string, std::shared_ptr<Incoming>> incoming_ ABSL_GUARDED_BY(incoming_mu_);

  // Tests: called once a distribution has its chunks' checksums (NodeTestPeer).
  std::function<void()> after_checksums_for_testing_;
  // Tests: called as an rdma pull's transfer to `peer` is being submitted (NodeTestPeer).
  std::function<void(const PeerAddress& from, engine::PeerId peer)> before_submit_for_testing_;

  // Last: their threads stop before what they use goes. Receives run a thread each.
  std::unique_ptr<WorkQueue> receive_queue_;
  std::unique_ptr<WorkQueue> serve_queue_;
};

}  // namespace ferry::server

#endif  // FERRY_SERVER_NODE_H_
