// The data plane: multi-rail one-sided RDMA WRITEs over libfabric.
#ifndef FERRY_ENGINE_ENGINE_H_
#define FERRY_ENGINE_ENGINE_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "engine/control.h"
#include "engine/planner.h"
#include "engine/topology.h"
#include "engine/types.h"

namespace ferry::engine {

class ProgressGroup;
struct TransferState;
struct RegionEntry;
struct Part;
struct ControlSend;

struct EngineOptions {
  // "auto", "efa", "verbs", "tcp" (tcp;ofi_rxm) or "shm". Default: "tcp".
  std::string provider = "tcp";
  // libfabric domains to open rails on, e.g. {"lo"} or {"rdmap16s27", ...}; rails cycle over
  // them, so N rails on one domain is allowed (tests). Default: empty (every domain listed).
  std::vector<std::string> domains;
  // Number of rails; 0 opens one per domain. Default: 1.
  size_t rails = 1;
  // Progress threads; rails are dealt to them round robin (a rail group per thread). 0: one
  // per rail, up to half the CPUs this process may run on (AutoProgressThreads). On tcp the
  // thread that posts a WRITE also copies it into the kernel, so rails add bandwidth only with
  // threads of their own (docs/benchmarks.md). Default: 0.
  size_t progress_threads = 0;
  // With rails = 0: place the rails by the machine's topology (hwloc) instead: one group per
  // GPU with the NICs under its PCIe switch, then a host-memory group with the other NICs;
  // each group's progress thread is pinned to the cores of its GPU's NUMA node before it opens
  // its rails (progress_threads is then not used). Default: false.
  bool topology = false;
  // This engine's node id, carried in region descriptors and control messages. Default: empty
  // (a random id is chosen).
  std::string node_id;
  // Longest single WRITE; capped by the provider's max_msg_size. On tcp loopback 512 KiB
  // WRITEs beat 1 MiB ones (`ferry-bench engine --max-write`, docs/benchmarks.md).
  // Default: 512 KiB.
  uint64_t max_write = uint64_t{512} << 10;
  // Pieces one WRITE may gather (consecutive pieces of a rail between the same two regions);
  // capped by the providers' iov_limit and rma_iov_limit and by 4. On tcp a WRITE costs a
  // header, a completion and a receive on the target's CPU whatever its size, so scattered
  // small pieces go several to a WRITE. Default: 4.
  size_t max_iov = 4;
  // While the engine expects WRITEs (KeepAwake, a ring) its progress threads keep polling: on
  // tcp and shm WRITEs land only while the target calls into the provider. false: they poll
  // without pausing while passes move data and nap between bursts, each nap sized by what the
  // last let pile up (between 10 and 500 us), so the CPU they spend follows the bytes received.
  // true: they never nap (the cost: a core per pull for as long as it lasts). Default: false.
  bool spin_while_awake = false;
  // GPU memory is registered as a dma-buf where this libfabric and the driver take one
  // (FI_MR_DMABUF); false: always by address. Default: true.
  bool hmem_dmabuf = true;
  // true: each rail's CQ has a wait fd, so that an idle progress thread blocks in the kernel
  // until the provider has something for it. false: the rails' CQs have no wait objects and
  // the engine sleeps on its bell instead: one more endpoint (on the first rail's domain, no
  // data) whose CQ has a wait fd. A peer rings it before every control message and every
  // kBellRingEvery while it has WRITEs for it; so rung, an engine polls its rails (as with
  // KeepAwake) until the peer's last transfer to it ends, or kBellLinger after the last ring;
  // an engine idle that long and not rung sleeps on the bell and polls its rails every
  // asleep_poll. On tcp;ofi_rxm a waitable CQ costs work on every operation at both ends
  // (docs/engine.md, docs/benchmarks.md). A provider without wait fds (shm) has no bell: its
  // idle engine polls every millisecond. Default: false.
  bool wait_fds = false;
  // How long an idle progress thread sleeps on its fds (the rails' or the bell's) before it
  // polls its rails anyway: what a lost ring, or one from a peer without a bell, waits at
  // most. Within 1 ms..1 h. Default: 1 s.
  absl::Duration asleep_poll = absl::Seconds(1);
  // The rails count what they do (Counters()). false: they do not (RailCounters stay 0), to
  // measure what counting costs. Default: true.
  bool counters = true;
  // WRITEs in flight per rail; capped by the provider's tx size. Default: 0 (the tx size).
  size_t tx_depth = 0;
  // Bytes in flight per rail (a WRITE is always allowed when none is): enough to cover the
  // rail's bandwidth-delay product; more only queues inside the provider and the kernel.
  // Default: 4 MiB.
  uint64_t max_inflight_bytes = uint64_t{4} << 20;
  // A transfer is striped over as many rails as give each at least this many bytes (one rail
  // at least); 0: every transfer over every rail. Default: 64 KiB.
  uint64_t min_rail_share = uint64_t{64} << 10;
  // A rail whose queue runs dry takes queued WRITEs from the rail of its group with the most
  // queued, so faster rails carry more and the rails finish together; bytes_per_rail then
  // says where the bytes went. false: each rail carries exactly its planned share.
  // Default: true.
  bool work_stealing = true;
  // Pre-posted control receive buffers per rail. Default: 64.
  size_t recv_pool = 64;
  // Largest control frame payload; longer messages go in several frames and are put together
  // again at the receiver. Default: 8192.
  size_t max_control = 8192;
  // Longest control message (PostControl). Default: 16 MiB.
  size_t max_message = size_t{16} << 20;
  // A rail with WRITEs to a peer in flight and none completing for this long is taken as down
  // for that peer (a link that drops everything reports no error on tcp); a WRITE that fails
  // on a rail takes it down at once. Its WRITEs go again on the group's other rails, and the
  // rail rests for rail_backoff before new WRITEs to that peer try it again; each failure in
  // a row doubles the rest, up to rail_backoff_max. Defaults: 2 s, 1 s, 30 s.
  absl::Duration rail_stall_timeout = absl::Seconds(2);
  absl::Duration rail_backoff = absl::Seconds(1);
  absl::Duration rail_backoff_max = absl::Seconds(30);
  // Tests only: called on a progress thread before each WRITE is posted, with the engine rail
  // and whether the WRITE reads GPU memory; a negative libfabric error code fails the post
  // with it (a NIC that refuses posts, a provider that claims FI_HMEM and cannot move GPU
  // memory), which the real providers cannot be made to do on demand. Default: none.
  std::function<int(size_t rail, bool from_gpu)> post_fault;
  // Tests only: whether a destination's pass over its rails moved data, in place of timing
  // the pass (see spin_while_awake): what a machine too slow or too busy to tell the passes
  // apart would judge. Default: none.
  std::function<bool()> pass_moved;
  // Called on a progress thread for every control message a peer sends (put together from its
  // frames): the sender's node id and the payload. Must not block. Default: none (messages
  // are dropped).
  std::function<void(std::string_view sender, std::string_view payload)> on_control;
};

// The domains (NICs) a provider offers on this machine, with their PCI addresses where it
// reports them. kInvalidArgument: unknown provider. kNotFound: it offers none.
absl::StatusOr<std::vector<NicRef>> ProviderNics(std::string_view provider);

// The progress threads an engine of `rails` rails starts when EngineOptions::progress_threads
// is 0: min(rails, half the CPUs in the calling thread's affinity mask), and at least 1.
size_t AutoProgressThreads(size_t rails);

// One rail as a peer sees it.
struct RailInfo {
  std::string provider;  // libfabric provider name, e.g. "tcp;ofi_rxm"
  std::string fabric;    // fabric name
  std::string domain;    // domain name (one NIC)
  std::string address;   // raw endpoint name from fi_getname
  uint64_t max_msg_size = 0;
  size_t tx_depth = 0;  // WRITEs in flight this engine allows on the rail
  size_t inject_size = 0;
  uint64_t mr_mode = 0;  // the mr_mode bits the provider granted
  size_t cq_data_size = 0;
  bool delivery_complete = false;  // FI_DELIVERY_COMPLETE granted
  // FI_ORDER_RMA_WAW granted: WRITEs up to max_order_waw_size bytes land in posting order.
  bool ordered_writes = false;
  uint64_t max_order_waw_size = 0;
  // Pieces one WRITE can carry: the lower of the tx iov_limit and rma_iov_limit.
  size_t iov_limit = 1;
  // The provider registers CUDA memory (FI_HMEM_CUDA), probed at start-up on GPU 0; else why
  // not (for example "fi_mr_regattr: Function not implemented").
  bool hmem_cuda = false;
  std::string hmem_cuda_error;
  // ... and takes it as dma-bufs (FI_MR_DMABUF, libfabric 1.20 and later; what EFA uses on
  // current kernels), else by address.
  bool hmem_dmabuf = false;
  // Where the topology put it ("gpu0, numa 0, cores 0,1,2"); empty when it was not placed.
  std::string placement;
};

struct TransferStats {
  uint64_t bytes = 0;
  uint64_t writes = 0;
  double seconds = 0;                    // from submission to the last completion
  std::vector<uint64_t> bytes_per_rail;  // where the bytes went, re-sent ones included
  // WRITEs sent again on another rail after theirs failed or stalled, and the rails (engine
  // indices) that failed during the transfer.
  uint64_t rerouted_writes = 0;
  std::vector<size_t> failed_rails;
  // Per rail: seconds from submission to the last delivery completion of its WRITEs, which
  // on a rail that orders WRITEs vouches for all of them (0: none).
  std::vector<double> rail_seconds;

  // Adds the rail to failed_rails unless it is there.
  void NoteFailedRail(size_t rail);
  // Sums another transfer's stats into these (seconds aside).
  void Add(const TransferStats& other);
};

// What one rail has done since the engine opened, for monitoring. Counted by the rail's
// progress thread with relaxed atomic adds; read at any time (the fields are not one snapshot).
struct RailCounters {
  uint64_t writes = 0;           // WRITEs completed
  uint64_t bytes = 0;            // their bytes
  uint64_t write_errors = 0;     // WRITEs that failed, at post or at completion
  uint64_t failovers = 0;        // WRITEs moved off this rail after it failed
  uint64_t backoffs = 0;         // times the rail was rested for a peer
  uint64_t in_flight_bytes = 0;  // bytes of WRITEs posted and not completed
  uint64_t full = 0;             // times posting stopped with WRITEs still queued: the rail's
                                 // tx depth or bytes in flight reached, or -FI_EAGAIN
  uint64_t peak_in_flight = 0;   // the most WRITEs it had in flight at once
  uint64_t immediates = 0;       // immediates that landed here (a WRITE's closing signal)
  uint64_t messages_sent = 0;    // control messages
  uint64_t messages_received = 0;
};

// What an engine's progress threads did, summed over them: how they spend an idle second, and
// whether an awake one spins or blocks, without timing them.
struct ProgressCounters {
  uint64_t passes = 0;  // passes of their loops over the rails
  uint64_t waits = 0;   // times they waited on their fds with a timeout (not a poll)
};

// What to move: local source extents (region = RegionId) into remote destination extents
// (region = index into dst_regions).
struct TransferRequest {
  PeerId peer = 0;
  std::vector<Extent> src;
  std::vector<RegionDescriptor> dst_regions;
  std::vector<Extent> dst;
  // The transfer fails with kDeadlineExceeded if it has not completed by then.
  // Default: 60 s from submission.
  absl::Time deadline = absl::InfiniteFuture();
  // When set, exactly one WRITE with this immediate data lands at the destination, after
  // every other byte of the transfer has landed (ImmediateCounter counts them). Must fit the
  // provider's cq_data_size.
  std::optional<uint64_t> immediate;
  // Called once with the transfer's result, on the thread that ends it (a progress thread,
  // or the one that cancels it), after Wait would return it. Must not block.
  std::function<void(const absl::StatusOr<TransferStats>&)> on_done;
  // The destination polls its rails for as long as the transfer may run (it holds a
  // KeepAwake for it): its bell is not rung at the start and end. Default: false.
  bool peer_awake = false;
};

// A window of a registered region that peers may WRITE into, under keys they cannot guess:
// random ones where the provider lets ferry choose (without FI_MR_PROV_KEY), the provider's
// own elsewhere. `descriptor` is what a peer needs (RemoteAddress(0) is the window's start).
struct Window {
  uint64_t id = 0;
  RegionDescriptor descriptor;
};

// A submitted transfer. Thread-safe.
class Transfer {
 public:
  explicit Transfer(std::shared_ptr<TransferState> state) : state_(std::move(state)) {}
  // Waits until the transfer completes, fails, is cancelled, or `deadline` passes (then
  // kDeadlineExceeded; the transfer goes on). Failures: kDeadlineExceeded (its own deadline),
  // kCancelled, kUnavailable (peer unreachable or removed), kInternal / others from the CQ.
  absl::StatusOr<TransferStats> Wait(absl::Time deadline = absl::InfiniteFuture()) const;
  bool Done() const;
  // Fails the transfer with kCancelled unless it has already finished. WRITEs already posted
  // may still land.
  void Cancel();
  // Waits until every WRITE the transfer posted has completed (after its end, the progress
  // threads still let go of what it posted). kDeadlineExceeded when `deadline` passes first.
  absl::Status WaitRetired(absl::Time deadline) const;

 private:
  std::shared_ptr<TransferState> state_;  // shared with the progress threads that run it
};

// Counts immediates with one value landing on this engine; fires once the count is reached.
// Thread-safe.
class ImmediateCounter {
 public:
  // kOk once `count` immediates have landed and `on_fire` has returned; kDeadlineExceeded if
  // `deadline` passes first.
  absl::Status Wait(absl::Time deadline) const;
  uint64_t arrived() const;

 private:
  friend class Engine;
  ImmediateCounter(uint64_t count, std::function<void()> on_fire)
      : count_(count), on_fire_(std::move(on_fire)) {}
  // Adds up to n arrivals; returns how many it did not need and sets *fired when this call
  // reached the count (the caller then calls Fire, outside its locks).
  uint64_t Add(uint64_t n, bool* fired);
  // Runs on_fire, then lets Wait return.
  void Fire();

  const uint64_t count_;
  std::function<void()> on_fire_;
  mutable absl::Mutex mu_;
  uint64_t arrived_ ABSL_GUARDED_BY(mu_) = 0;
  bool fired_ ABSL_GUARDED_BY(mu_) = false;
};

// While alive, the engine's progress threads poll their rails instead of blocking when idle.
// Thread-safe; movable.
class AwakeToken {
 public:
  AwakeToken() = default;
  AwakeToken(AwakeToken&& other) noexcept : count_(std::exchange(other.count_, nullptr)) {}
  AwakeToken& operator=(AwakeToken&& other) noexcept;
  ~AwakeToken();

 private:
  friend class Engine;
  explicit AwakeToken(std::atomic<int>* count) : count_(count) {}
  std::atomic<int>* count_ = nullptr;
};

// Whether the calling thread is a progress thread of an engine: work that waits for a progress
// thread (or may block on a lock held by one that does) must not run there.
bool OnProgressThread();

// Moves bytes between registered local memory and remote peers over one or more rails (one
// libfabric domain, endpoint, CQ and AV each). Thread-safe: calls queue work for the progress
// threads, which alone touch libfabric objects (FI_THREAD_DOMAIN).
class Engine {
 public:
  // Opens the rails, starts the progress threads and pre-posts the control receive pools.
  // kInvalidArgument: bad options. kNotFound: no provider/domain matches. kUnimplemented: the
  // provider needs something ferry does not support (FI_MR_RAW).
  static absl::StatusOr<std::unique_ptr<Engine>> Create(const EngineOptions& options);
  // Fails transfers still running with kCancelled, stops and joins the progress threads, which
  // close every MR and rail they own.
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  const std::string& node_id() const { return node_id_; }
  const std::vector<RailInfo>& rails() const { return rails_; }
  // Progress threads (rail groups) this engine runs.
  size_t progress_threads() const { return groups_.size(); }
  // Per rail, in the order of rails().
  std::vector<RailCounters> Counters() const;
  // Counted whether or not EngineOptions::counters is set.
  ProgressCounters Progress() const;
  PeerAddress address() const;
  // This engine's bell (empty when it has none), as PeerAddress::bell.
  const std::string& bell_address() const { return bell_address_; }

  // Registers [addr, addr + length) on every rail as a source of WRITEs; no peer can write
  // into it or read it until a window opens on it. The memory must stay valid until
  // DeregisterMemory. kInvalidArgument: null, empty or wrapping range. kUnimplemented: device
  // memory the build or provider cannot register. kResourceExhausted: the provider refused an
  // MR.
  absl::StatusOr<RegionId> RegisterMemory(void* addr, size_t length, Device device);
  // Closes the region's windows, then deregisters it. kNotFound: unknown id.
  // kFailedPrecondition: a running transfer still uses the region at `deadline` (the default:
  // at once). A transfer's Wait may return a moment before its progress thread lets go of it.
  absl::Status DeregisterMemory(RegionId id, absl::Time deadline = absl::InfinitePast());
  // Where the region is, as a peer names it (no keys: see OpenWindow). kNotFound: unknown id.
  absl::StatusOr<RegionDescriptor> Describe(RegionId id) const;
  // Lets peers WRITE into [offset, offset + length) of region `id` until CloseWindow (or the
  // region's deregistration): registered anew for remote writes on every rail, under fresh
  // keys. kNotFound: unknown region. kInvalidArgument: empty or out of the region's bounds.
  // kResourceExhausted: the provider refused an MR.
  absl::StatusOr<Window> OpenWindow(RegionId id, uint64_t offset, uint64_t length);
  // OpenWindow for each span, all at once: the windows in the order of `spans`, or none.
  struct WindowSpan {
    RegionId region = 0;
    uint64_t offset = 0;
    uint64_t length = 0;
  };
  absl::StatusOr<std::vector<Window>> OpenWindows(const std::vector<WindowSpan>& spans);
  // The provider refuses WRITEs under the window's keys from the time this returns (`wait`),
  // or from a moment later (the progress threads close it when they get to it).
  // kNotFound: no such window.
  absl::Status CloseWindow(uint64_t window, bool wait = true);

  // Inserts the peer into every rail's AV (local rail i talks to the peer's rail i mod its
  // rail count) and warms every rail pair with one small message. Once one rail has answered,
  // a rail that failed or gave no answer within rail_stall_timeout rests for this peer (as a
  // rail failing mid-transfer does). Adding the same address again returns the same id.
  // kInvalidArgument: no rails or a bad address. kUnavailable / kDeadlineExceeded: no rail
  // answered by the deadline.
  absl::StatusOr<PeerId> AddPeer(const PeerAddress& peer,
                                 absl::Time deadline = absl::InfiniteFuture());
  // Fails running transfers to the peer with kUnavailable and removes it from the AVs.
  // kNotFound: unknown id.
  absl::Status RemovePeer(PeerId peer);

  // Checks, plans and queues a transfer. kInvalidArgument: sizes differ, extent out of its
  // region's bounds or naming no destination region, immediate too wide or on an empty
  // transfer, a descriptor with fewer keys than the peer has rails.
  // kNotFound: unknown peer or local region.
  absl::StatusOr<Transfer> Submit(TransferRequest request);
  // Submit, then Wait.
  absl::StatusOr<TransferStats> Write(TransferRequest request);

  // Sends a control message to the peer (two-sided SENDs, in frames of at most max_control
  // bytes, which the peer's engine puts together again before on_control sees the message)
  // and calls `done` once its frames have completed locally, or with why they could not: a
  // rail that fails a frame is tried no more for the message, which goes again whole on the
  // next rail; kUnavailable once every rail failed. Never blocks; `done` (may be null) runs on
  // a progress thread or this one and must not block. kInvalidArgument (through `done`):
  // payload over max_message. kNotFound: unknown peer.
  // `ring` false: the peer polls its rails now (it waits for this message, holding a
  // KeepAwake), so its bell is not rung.
  void PostControl(PeerId peer, std::string payload,
                   std::function<void(const absl::Status&)> done = nullptr, bool ring = true);
  // PostControl, then waits for `done` until `deadline`.
  absl::Status SendControl(PeerId peer, std::string_view payload,
                           absl::Time deadline = absl::InfiniteFuture());
  // A question to `peer` went unanswered: its rail may be down in a way the provider does not
  // report (on tcp a frame completes once the socket took it, though the link beyond is gone),
  // so the peer's next control messages start on the next rail; unless they moved less than
  // `settle` ago (questions that went unanswered together move them once). Unknown peer: no-op.
  void MoveControlRail(PeerId peer, absl::Duration settle);

  // Keeps the progress threads polling until the token goes (napping between bursts, see
  // EngineOptions::spin_while_awake). A destination takes
  // one while it expects WRITEs (between asking a source to pull and its answer): on
  // providers with manual progress (tcp, shm) WRITEs land only while the target calls into
  // libfabric, and waking from a long blocking wait for each burst costs throughput. The
  // token must not outlive the engine.
  AwakeToken KeepAwake();

  // A counter that fires (runs `on_fire` once, on the thread that sees the count reached: a
  // progress thread, or this one) when `count` immediates with value `tag` have landed. Immediates
  // that landed before the counter existed count. kAlreadyExists: a counter for `tag` is armed.
  // kInvalidArgument: count is 0.
  absl::StatusOr<std::shared_ptr<ImmediateCounter>> ExpectImmediates(
      uint64_t tag, uint64_t count, std::function<void()> on_fire = nullptr);

 private:
  friend class ProgressGroup;
  friend struct TransferState;
  explicit Engine(const EngineOptions& options);

  // Called by progress threads.
  void OnImmediate(uint64_t tag);
  // A control frame that came on rail `index` of progress group `group`.
  void OnControl(std::string_view frame, size_t group, size_t index);
  // A peer rang (see RingKind).
  void OnRung(std::string_view sender, std::string_view payload);
  // A kBusy ring holds: WRITEs are coming.
  bool Rung(absl::Time now) const {
    return absl::ToUnixNanos(now) < busy_until_.load(std::memory_order_relaxed);
  }
  // A ring came less than kBellLinger ago: the rails are polled.
  bool Woken(absl::Time now) const {
    return absl::ToUnixNanos(now) < woken_until_.load(std::memory_order_relaxed);
  }
  // Rings the peer's bell, unless it was rung so (kWake, kBusy) less than kBellRingEvery ago
  // and `throttled`. Thread-safe.
  void Ring(PeerId peer, absl::Time now, RingKind kind, bool throttled = true);
  // A transfer counted in its peer's live transfers ended; the last one rings kDone.
  void TransferEnded(PeerId peer);
  // Takes a peer's bell out of group 0's bell AV (FI_ADDR_NOTAVAIL: nothing to do).
  void RemoveBell(uint64_t bell);
  struct Peer;
  // The peer's bell if it is due for a ring of `kind` (it is then counted as rung), else
  // FI_ADDR_NOTAVAIL.
  uint64_t TakeRing(Peer& peer, absl::Time now, RingKind kind, bool throttled = true)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Has group 0 ring `bell` (FI_ADDR_NOTAVAIL: nothing to do). Thread-safe.
  void RingBell(uint64_t bell, RingKind kind);
  void ReleaseRegions(const std::vector<RegionId>& regions);
  // Registers each of `entries` ([addr, addr + length) of its device) under its id with
  // `access` on every rail (Rail::Register), filling its keys and descriptors: every progress
  // thread registers them on its rails at once. On failure, none stays registered.
  absl::Status RegisterOnRails(const std::vector<std::pair<uint64_t, RegionEntry*>>& entries,
                               uint64_t access);
  void DeregisterOnRails(size_t group, uint64_t id);
  // Control messages: a message's frames on one rail; then the next rail when one failed.
  void SendFrames(std::shared_ptr<ControlSend> send);
  void FramesSent(std::shared_ptr<ControlSend> send, size_t rail, absl::Status failed);
  void OnFragment(std::string_view sender, std::string_view frame, size_t rail);
  // A whole message from `sender` came on `rail`: the rail carries that peer's messages, so
  // ours to it (answers first) go there too; a rail that lost them silently is left behind.
  void ArrivedOn(std::string_view sender, size_t rail);
  // Whether message `id` of sender incarnation `from` was handed to on_control already.
  bool Delivered(const std::string& from, uint32_t id) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(fragments_mu_);
  void MarkDelivered(const std::string& from, uint32_t id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(fragments_mu_);
  // Submit's plan, over the rails that min_rail_share gives it (plan.rails has one list per rail).
  absl::StatusOr<Plan> PlanOnRails(const TransferRequest& req) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Per rail of `group`: the peer's address, the source regions' descriptors and the
  // destination regions' keys of the part's transfer (what a WRITE of the part needs to go on
  // any of the group's rails). Called on the group's progress thread.
  void FillPart(Part& part, size_t group) const;
  // The engine index of rail `index` of `group`.
  size_t EngineRail(size_t group, size_t index) const;
  // Of per-engine-rail addresses, those of `group`'s rails, indexed by rail within the group.
  std::vector<uint64_t> GroupAddresses(size_t group, const std::vector<uint64_t>& fi_addrs) const;

  struct Peer {
    PeerAddress address;
    std::vector<uint64_t> fi_addrs;            // per local rail
    uint64_t bell;                             // in group 0's bell AV; FI_ADDR_NOTAVAIL: none
    absl::Time woken = absl::InfinitePast();   // last kWake ring
    absl::Time busied = absl::InfinitePast();  // last kBusy ring
    int live = 0;                              // transfers to it not yet ended
    size_t control_rail = 0;                   // where its control messages go first
    absl::Time control_moved = absl::InfinitePast();  // last MoveControlRail that moved it
  };
  // A control message whose fragments are still coming.
  struct PartialMessage {
    std::vector<std::string> parts;
    size_t received = 0;
    size_t bytes = 0;
    absl::Time started;
  };
  struct RailRef {
    size_t group;
    size_t index_in_group;
  };

  const EngineOptions options_;
  std::string node_id_;
  std::vector<RailInfo> rails_;
  std::vector<RailRef> rail_refs_;
  uint64_t max_write_ = 0;
  size_t max_iov_ = 1;
  size_t cq_data_size_ = 0;  // bytes of immediate data every rail carries

  mutable absl::Mutex mu_;
  RegionId next_region_ ABSL_GUARDED_BY(mu_) = 1;
  absl::flat_hash_map<RegionId, std::unique_ptr<RegionEntry>> regions_ ABSL_GUARDED_BY(mu_);
  PeerId next_peer_ ABSL_GUARDED_BY(mu_) = 1;
  absl::flat_hash_map<PeerId, Peer> peers_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, RegionId> windows_ ABSL_GUARDED_BY(mu_);  // open, and their region
  uint64_t next_transfer_ ABSL_GUARDED_BY(mu_) = 1;
  size_t next_first_rail_ ABSL_GUARDED_BY(mu_) = 0;

  absl::Mutex imm_mu_;
  absl::flat_hash_map<uint64_t, uint64_t> imm_unclaimed_ ABSL_GUARDED_BY(imm_mu_);
  // shared with the caller, who waits on it
  absl::flat_hash_map<uint64_t, std::shared_ptr<ImmediateCounter>> imm_counters_
      ABSL_GUARDED_BY(imm_mu_);

  std::atomic<int> awake_{0};  // live AwakeTokens
  std::atomic<bool> has_bell_{false};
  std::string bell_address_;
  std::atomic<bool> closing_{false};  // the destructor runs: nothing rings any more
  // Bells: until when a ring keeps the rails polled, and until when some sender's kBusy holds
  // (unix ns); the senders' kBusy deadlines.
  std::atomic<int64_t> woken_until_{0};
  std::atomic<int64_t> busy_until_{0};
  absl::Mutex bell_mu_;
  absl::flat_hash_map<std::string, absl::Time> busy_senders_ ABSL_GUARDED_BY(bell_mu_);
  // Control messages: ids of this engine's fragmented messages, told apart from an earlier
  // process's by a random incarnation; the fragments of others' still coming in.
  const uint32_t incarnation_;
  std::atomic<uint32_t> next_message_{1};
  absl::Mutex fragments_mu_;
  std::map<std::string, PartialMessage> partial_ ABSL_GUARDED_BY(fragments_mu_);
  size_t partial_bytes_ ABSL_GUARDED_BY(fragments_mu_) = 0;
  // Messages handed over, per sender incarnation: every id up to `floor`, and those above it.
  struct Seen {
    uint32_t floor = 0;
    std::set<uint32_t> above;
  };
  std::map<std::string, Seen> delivered_ ABSL_GUARDED_BY(fragments_mu_);
  std::deque<std::string> delivered_order_ ABSL_GUARDED_BY(fragments_mu_);
  std::vector<std::unique_ptr<ProgressGroup>> groups_;
};

}  // namespace ferry::engine

#endif  // FERRY_ENGINE_ENGINE_H_
