// A progress thread and the rails it owns (a rail group). Internal to the engine.
#ifndef FERRY_ENGINE_PROGRESS_GROUP_H_
#define FERRY_ENGINE_PROGRESS_GROUP_H_

#include <sys/uio.h>

#include <array>
#include <atomic>
#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/functional/any_invocable.h"
#include "absl/functional/function_ref.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "engine/control.h"
#include "engine/engine.h"
#include "engine/rail.h"

namespace ferry::engine {

// A one-shot result another thread waits for. Thread-safe.
class Completion {
 public:
  // Only the first call has an effect.
  void Set(absl::Status status);
  // The status Set() gave, or kDeadlineExceeded once `deadline` passes.
  absl::Status Wait(absl::Time deadline) const;

 private:
  mutable absl::Mutex mu_;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
};

enum class OpKind : uint8_t { kWrite, kSend, kRecv };

// Every libfabric context starts with fi_context2 (FI_CONTEXT / FI_CONTEXT2 mode: the provider
// may use it), then the kind, so a completion's op_context tells what finished.
struct OpBase {
  fi_context2 ctx;
  OpKind kind;
};

// A ring of the bell (see ProgressGroup) keeps this engine polling its rails for kBellLinger,
// a kBusy ring keeps it awake (Engine::KeepAwake) until the sender's kDone or for as long; a
// peer with WRITEs for it rings kBusy again every kBellRingEvery while they last. A group with
// no work of its own for kBellLinger and no ring for as long sleeps on the bell.
constexpr absl::Duration kBellLinger = absl::Milliseconds(300);
constexpr absl::Duration kBellRingEvery = absl::Milliseconds(100);

// Pieces one WRITE carries at most (a gathered WRITE; the rails' iov limits cap it further).
constexpr size_t kMaxIov = 4;

// WriteOp::rail of a WRITE not placed on a rail of its group (yet).
constexpr size_t kNoRail = ~size_t{0};

struct Part;
struct WriteOp : OpBase {
  Part* part = nullptr;
  size_t rail = 0;  // index within the group, or kNoRail
  // Its pieces: local[i] (in the source region) lands at remote[i] (in the destination
  // region), local[i].iov_len bytes each.
  std::array<iovec, kMaxIov> local = {};
  std::array<uint64_t, kMaxIov> remote = {};
  uint8_t pieces = 0;
  void* desc = nullptr;  // the source region's, on `rail`
  uint64_t length = 0;   // its pieces' bytes together
  uint64_t key = 0;      // the destination region's, on `rail`
  fi_addr_t dest = FI_ADDR_UNSPEC;
  bool immediate = false;
  bool held = false;    // the tail, held back until every other WRITE has completed
  bool deliver = true;  // ask for FI_DELIVERY_COMPLETE (where the provider has it)
  uint64_t data = 0;
  RegionId src_region = 0;  // what a move to another rail looks up in its Part
  size_t dst_region = 0;
  uint64_t seq = 0;        // its rail's post count when it was posted
  bool posted = false;     // handed to the provider (its completion is still to come)
  bool done = false;       // its completion came
  bool failed = false;     // ... with an error
  bool abandoned = false;  // stalled and sent again elsewhere: its completion changes nothing
};

// Told once how a control frame's SEND ended.
using SendCallback = std::function<void(const absl::Status&)>;

struct SendOp : OpBase {
  size_t slot = 0;
  size_t length = 0;
  fi_addr_t dest = FI_ADDR_UNSPEC;
  bool posted = false;               // handed to the provider (its completion is still to come)
  std::shared_ptr<Completion> done;  // shared with the sender, who waits on it
  SendCallback callback;             // or called
  absl::Time since;                  // queued
  // A control frame with no completion for rail_stall_timeout: its sender was told it failed
  // (and goes on another rail); the slot waits for the provider to let go of it.
  bool abandoned = false;
};

struct RecvOp : OpBase {
  char* buffer = nullptr;
};

// Shared by the caller's Transfer handle and every group that runs part of it.
struct TransferState {
  uint64_t id = 0;
  PeerId peer = 0;
  absl::Time start;
  absl::Time deadline;
  Engine* engine = nullptr;
  bool counted = false;          // in the engine's count of the peer's live transfers
  bool from_gpu = false;         // a source region is GPU memory
  std::vector<RegionId> pinned;  // released once every part has retired
  // What a part on any group needs to address its WRITEs (Engine::FillPart): the peer's
  // address per engine rail, each source region's descriptor per engine rail, the
  // destination regions (their keys per rail of the peer). Set before any part runs.
  std::vector<uint64_t> fi_addrs;
  absl::flat_hash_map<RegionId, std::vector<void*>> src_descs;
  std::vector<RegionDescriptor> dst_regions;
  size_t remote_rails = 1;

  std::atomic<bool> finished{false};  // a result is set: queued work is dropped
  // Parts whose non-tail WRITEs are not all done, plus one, when there is a tail, that the
  // tail group drops once it holds the tail's part (AddPart): the tail is queued by whoever
  // takes this to 0, exactly once, and never before its part is in its group.
  std::atomic<int> parts_data_pending{0};
  std::atomic<int> parts_alive{0};  // parts whose ops are not all resolved
  // The WRITE that carries the immediate, held back until every other WRITE has completed.
  // It lives in `tail_part`, owned by `tail_group`: other groups compare these pointers but
  // never dereference them (the part may already be freed there).
  // Atomic: a group that re-sends it on another rail moves it while others compare it.
  std::atomic<WriteOp*> tail{nullptr};
  // The group holding the tail part: it changes only while the tail part is handed from a
  // group without a usable rail to another, before any group may queue the tail.
  Part* tail_part = nullptr;
  std::atomic<ProgressGroup*> tail_group{nullptr};

  // TransferRequest::on_done; called by the one Finish that sets the result.
  std::function<void(const absl::StatusOr<TransferStats>&)> on_done;

  absl::Mutex mu;
  bool done ABSL_GUARDED_BY(mu) = false;
  bool retired ABSL_GUARDED_BY(mu) = false;  // every part has retired (parts_alive is 0)
  absl::Status status ABSL_GUARDED_BY(mu);
  TransferStats stats ABSL_GUARDED_BY(mu);

  // Sets the result once; returns false if one was set already.
  bool Finish(absl::Status s);
};

// The share of a transfer on one group. Touched only by that group's thread.
struct Part {
  std::shared_ptr<TransferState> transfer;  // shared across the transfer's parts
  std::vector<WriteOp> ops;                 // never resized once queued: ops are libfabric contexts
  std::deque<WriteOp> resent;  // WRITEs sent again on another rail (a deque: stable addresses)
  // Per rail of the group: the peer's address, each source region's descriptor, each
  // destination region's key (what a WRITE needs to move to that rail).
  std::vector<fi_addr_t> dest;
  absl::flat_hash_map<RegionId, std::vector<void*>> src_descs;
  std::vector<std::vector<uint64_t>> dst_keys;
  // Per rail of the group: the post count of the last delivery-complete WRITE of this part
  // that completed there. On a rail that keeps WRITEs in order it vouches for every earlier
  // one; a WRITE posted after it that completed at transmit may still sit in the rail's queues.
  std::vector<uint64_t> delivered;
  size_t unresolved = 0;  // ops not yet completed, failed or dropped (tail included)
  size_t data_unresolved = 0;
  // A part of WRITEs that a group with no usable rail to the peer handed on (Handover): the
  // groups offered it so far, and why their rails could not carry it.
  std::vector<bool> offered;
  std::string why;
  bool dead = false;
  bool tail_posted = false;
  bool retiring = false;
};

// Owns its rails, their queues and the MRs registered on them; runs the progress loop.
// Group 0 also owns the engine's bell: one more endpoint, on the first rail's domain, that
// carries no data and whose CQ has a wait fd (where the provider gives one). A rail's CQ with
// a wait fd costs work on every operation on tcp;ofi_rxm, so without EngineOptions::wait_fds
// the rails' CQs have none and an idle engine has nothing to block on but the bell: a peer
// rings it (a small SEND) before it contacts this engine and then every kBellRingEvery while
// it has work for it.
class ProgressGroup {
 public:
  using Command = absl::AnyInvocable<void(ProgressGroup&)>;

  // Run on the thread before it opens anything (pinning it); an error fails Start.
  using Binder = absl::AnyInvocable<absl::Status()>;
  // Starts the thread, which binds itself, then opens `infos` as rails (tx_depth 0: the
  // provider's). kOk once every rail is open and its receive pool is posted.
  static absl::StatusOr<std::unique_ptr<ProgressGroup>> Start(Engine* engine, size_t index,
                                                              std::vector<InfoPtr> infos,
                                                              const EngineOptions& options,
                                                              Binder bind = nullptr);
  // Stops the loop; the thread fails what is left, closes MRs, then rails.
  ~ProgressGroup();

  // Queues `command` for the progress thread and wakes it. Thread-safe.
  void Run(Command command);
  // Runs `fn` on the progress thread and waits for its status. Thread-safe; never call it
  // from the progress thread.
  absl::Status RunAndWait(absl::AnyInvocable<absl::Status(ProgressGroup&)> fn);

  // Makes the thread's epoll_wait return. Thread-safe.
  void Wake();

  size_t rail_count() const { return rails_.size(); }
  // Its place among its engine's groups.
  size_t index() const { return index_; }
  // The bell's endpoint name; empty when this group has none.
  std::string bell_address() const;
  const RailInfo& rail_info(size_t i) const { return rails_[i]->rail->rail_info(); }
  // Rail i's counters. Thread-safe.
  RailCounters counters(size_t i) const;
  ProgressCounters progress() const {
    return {passes_.load(std::memory_order_relaxed), waits_.load(std::memory_order_relaxed)};
  }

  // --- Progress thread only. ---
  Rail& rail(size_t i) { return *rails_[i]->rail; }
  // Registers [addr, addr + length) on every rail of the group under `id` with `access`
  // (Rail::Register).
  absl::Status RegisterRegion(RegionId id, void* addr, size_t length, Device device,
                              uint64_t access, std::vector<RailMr*>* out);
  void DeregisterRegion(RegionId id);
  void AddPart(std::unique_ptr<Part> part);
  // Takes a part another group handed on (see Handover): its WRITEs go on this group's usable
  // rails to the peer, or on to the next group not yet offered it; when every group was, the
  // transfer fails with kUnavailable naming the rails and why they went down.
  void AddHandedOver(std::unique_ptr<Part> part);
  void QueueTail(const std::shared_ptr<TransferState>& transfer);
  void FailPeer(PeerId peer, const absl::Status& status);
  // First contact on rail `rail`: the address's AV entry (shared by every peer that names it)
  // and the completion of a hello sent to it, which is the one still unanswered when there is
  // one. kResourceExhausted: too many first contacts unanswered on this rail.
  struct Contact {
    fi_addr_t addr = FI_ADDR_NOTAVAIL;
    std::shared_ptr<Completion> hello;
  };
  absl::StatusOr<Contact> ContactAddress(size_t rail, const std::string& address,
                                         const std::string& hello);
  // A hello to `addr` (in rail `rail`'s AV): the one still unanswered when there is one, else
  // a new one. kResourceExhausted: too many first contacts unanswered on this rail.
  absl::StatusOr<std::shared_ptr<Completion>> Hello(size_t rail, fi_addr_t addr,
                                                    const std::string& hello);
  // Lets go of addrs[i] on rail i (FI_ADDR_NOTAVAIL entries are skipped): see ReleaseAddress.
  void ReleaseAddresses(const std::vector<fi_addr_t>& addrs);
  // Posts a control frame on rail `rail`; `done` is told how its SEND ended. Frames wait in
  // the rail's backlog while its send slots are all taken.
  void QueueSend(size_t rail, fi_addr_t dest, std::string frame, SendCallback done);
  // The rail failed for the peer: it rests, its queued WRITEs to the peer move elsewhere.
  void RailDown(size_t rail, PeerId peer, const absl::Status& why);
  // The bell (group 0): a peer's bell into the bell's AV, removed, rung.
  absl::StatusOr<fi_addr_t> AddBell(const std::string& address);
  void RemoveBell(fi_addr_t bell);
  void Ring(fi_addr_t bell, RingKind kind);

 private:
  // How a rail is doing with one peer.
  struct PeerHealth {
    size_t in_flight = 0;      // WRITEs posted, completion not seen
    absl::Time last_progress;  // last completion, or the post that found none in flight
    absl::Time resting_until = absl::InfinitePast();  // down: no new WRITEs before then
    absl::Duration backoff;  // the last rest; zero once a WRITE completes again
    std::string why;         // what took it down last
  };
  // A peer address in a rail's AV. It stays there while a peer names it or the provider holds
  // an operation for it: tcp;ofi_rxm (1.17) crashes on the next post after an address was
  // removed under a queued operation (a hello to a peer that never answers stays queued).
  struct AvEntry {
    std::string name;
    size_t users = 0;                   // peers (or bells) that hold it
    size_t ops = 0;                     // operations posted to it whose completion has not come
    std::shared_ptr<Completion> hello;  // an unanswered first contact
  };
  struct RailState {
    std::unique_ptr<Rail> rail;
    absl::flat_hash_map<fi_addr_t, AvEntry> av;
    absl::flat_hash_map<std::string, fi_addr_t> av_by_name;
    std::deque<WriteOp*> queue;  // the application-level queue: WRITEs not yet posted
    uint64_t queued_bytes = 0;
    size_t in_flight = 0;
    uint64_t in_flight_bytes = 0;
    absl::flat_hash_map<PeerId, PeerHealth> health;
    size_t depth = 0;
    uint64_t posts = 0;  // WRITEs ever posted (their seq)
    // Control: one registered arena of receive buffers then send slots.
    std::vector<char> arena;
    RailMr arena_mr;
    std::vector<RecvOp> recvs;
    std::vector<SendOp> sends;
    std::vector<size_t> free_sends;
    std::deque<SendOp*> pending_sends;
    // Frames waiting for a send slot.
    struct Backlogged {
      fi_addr_t dest;
      std::string frame;
      SendCallback done;
    };
    std::deque<Backlogged> backlog;
    bool sends_young = false;  // a send queued less than rail_stall_timeout ago (CheckSends)
    // RailCounters, as this thread counts them (posted_bytes - done_bytes: in flight).
    struct Counts {
      std::atomic<uint64_t> writes{0}, bytes{0}, write_errors{0}, failovers{0}, backoffs{0},
          posted_bytes{0}, done_bytes{0}, immediates{0}, messages_sent{0}, messages_received{0},
          full{0}, peak_in_flight{0};
    } counts;
  };

  ProgressGroup(Engine* engine, size_t index, const EngineOptions& options);
  void Main(std::vector<InfoPtr> infos, Binder bind, Completion* opened);
  absl::Status OpenRails(std::vector<InfoPtr> infos);
  // A rail with `nrecv` control receives posted and its send slots; its wait fd (if any) in the
  // epoll set.
  absl::StatusOr<std::unique_ptr<RailState>> OpenRail(const fi_info& info, bool wait_fd,
                                                      size_t nrecv);
  // Polls the bell's CQ and posts its rings; true if anything happened.
  bool ServiceBell();
  bool DrainInbox();
  size_t PollCq(RailState& rs);
  bool PostWrites(size_t index);
  // Whether rail `rs` may post a WRITE of `length` after `ops` WRITEs of `bytes` promised to it.
  bool HasRoom(const RailState& rs, size_t ops, uint64_t bytes, uint64_t length) const;
  // Rail `thief` ran dry: it takes queued WRITEs from the group's most loaded rail.
  bool Steal(size_t thief);
  bool PostSends(RailState& rs);
  // Adds `n` to one of a rail's counters (unless EngineOptions::counters is off).
  void Count(std::atomic<uint64_t>& counter, uint64_t n = 1) const;
  // `first_contact`: a hello, which must leave kReservedSendSlots free (a hello to a peer that
  // never answers keeps its slot).
  void QueueSendOn(RailState& rs, fi_addr_t dest, std::string message,
                   std::shared_ptr<Completion> done, bool first_contact = false,
                   SendCallback callback = nullptr);
  // The AV entry of `address` on `rs`, inserted at first use; one more user.
  absl::StatusOr<fi_addr_t> AcquireAddress(RailState& rs, const std::string& address);
  // One user fewer; with none left, sends not yet posted to it are cancelled, and the entry
  // leaves the AV once the provider holds no operation for it.
  void ReleaseAddress(RailState& rs, fi_addr_t addr);
  // An operation to `addr` was posted / completed.
  void OpPosted(RailState& rs, fi_addr_t addr);
  void OpCompleted(RailState& rs, fi_addr_t addr);
  void MaybeForget(RailState& rs, fi_addr_t addr);
  void PostRecv(RailState& rs, RecvOp& op);
  void OnWriteDone(WriteOp* op, const absl::Status& status);
  void ResolveOp(Part* part, bool is_tail);
  void KillPart(Part* part);
  void MaybeRetire(Part* part);
  void ReapParts();
  void ScanParts();
  // Waits on the wait fds (the rails', the bell's) and the inbox; at most kScanPeriod when
  // `soon` or when it must poll rails without wait fds, else 1 s. `idle`: how long the loop
  // has made no progress.
  void Block(bool soon, absl::Duration idle);
  // Whether a pass over the rails that gave no completion, and took `pass`, moved data: a
  // WRITE landing gives its target none, but on tcp and shm the target's pass copies it.
  bool PassMovedData(absl::Duration pass);
  // Sleeps nap_ (adapted to what the last one let pile up) or until the inbox has work: a
  // destination's pause between bursts of WRITEs, short enough that the sockets' buffers do not
  // fill.
  void Nap();
  // The engine expects WRITEs (Engine::KeepAwake, a kBusy ring).
  bool Awake(absl::Time now) const;
  // fi_trywait(3): whether the provider has nothing pending inside, so that its fd may be waited
  // on.
  static bool TryWait(const RailState& rs);
  // Waits up to `timeout_ms` on the rails' wait fds and the inbox's eventfd (which it resets);
  // returns how many rail fds are ready.
  int WaitFds(int timeout_ms);
  void Shutdown();
  WriteOp* QueueFront(RailState& rs);
  void Enqueue(size_t rail, WriteOp* op, bool front = false);
  // Queues `op` (not posted, of a part of this group) on its rail, or on the least loaded
  // usable one while its own rests for the peer, or hands it to another group when none of
  // this group's rails is usable.
  void Route(WriteOp* op, PeerId peer, absl::Time now);
  // --- Rail failover. ---
  bool Usable(size_t rail, PeerId peer, absl::Time now);
  // The usable rail other than `except` with the fewest queued bytes; -1 when none.
  int PickRail(PeerId peer, size_t except, absl::Time now);
  // Points `op` (not posted, not placed) at `rail` of this group; counts its bytes there.
  void Place(WriteOp* op, size_t rail);
  // Takes `op` (not posted) off its rail and its bytes off the rail's count; `failover`: its
  // rail failed (counted in stats).
  void Unplace(WriteOp* op, bool failover);
  // Unplace, then Place.
  void Retarget(WriteOp* op, size_t rail, bool failover);
  // Sends `ops` of `part` (posted: failed, stalled, or completed at transmit on a rail that
  // went down) again on other usable rails of this group, or hands copies of them to another
  // group. The originals are abandoned: their completions, if they come, change nothing.
  void Resend(Part* part, const std::vector<WriteOp*>& ops);
  // A part's non-tail WRITE resolved: the last one of the part's data lets the transfer's tail
  // go once every part's data has (TransferState::parts_data_pending).
  void DataResolved(Part* part);
  // Moves `ops` (copies, not posted) of `from` to a new part offered to the other groups; a
  // tail among them stays the transfer's tail. The caller then resolves what they copied.
  void Handover(Part* from, std::vector<WriteOp> ops);
  // Queued WRITEs (taken off their queues) that no rail of this group can carry: copies of
  // them are handed over, by part, and the originals resolved.
  void HandoverQueued(const std::vector<WriteOp*>& ops);
  // Offers `part` to the next group after this one that has not been offered it, or fails
  // its transfer when none is left.
  void OfferOn(std::unique_ptr<Part> part);
  // In the running transfers to `peer`: sends again elsewhere each posted WRITE on `rail`
  // (original or copy, not yet abandoned) that `pick` selects.
  void ResendFrom(size_t rail, PeerId peer,
                  absl::FunctionRef<bool(const Part&, const WriteOp&)> pick);
  // Rails with WRITEs in flight and no completion for rail_stall_timeout go down; their
  // posted WRITEs are abandoned and sent again.
  void CheckStalls(absl::Time now);
  void FinishSend(RailState& rs, SendOp* op, const absl::Status& status);
  // Control frames (not hellos or rings) with no completion for rail_stall_timeout fail for
  // their senders, which try another rail; notes whether the rail has sends younger than that.
  void CheckSends(RailState& rs, absl::Time now);

  Engine* const engine_;
  const size_t index_;
  const EngineOptions& options_;
  std::vector<std::unique_ptr<RailState>> rails_;
  absl::flat_hash_map<RegionId, std::vector<RailMr>> mrs_;  // per region, per rail
  absl::flat_hash_map<Part*, std::unique_ptr<Part>> parts_;
  std::vector<Part*> retiring_;  // parts with every op resolved, freed by ReapParts
  absl::Time next_scan_ = absl::InfinitePast();
  absl::Time next_send_check_ = absl::InfinitePast();
  int epoll_fd_ = -1;
  int event_fd_ = -1;
  bool all_fd_ = true;                         // every rail's CQ has a wait fd
  std::unique_ptr<RailState> bell_;            // group 0's, where the provider gives it a wait fd
  absl::flat_hash_map<fi_addr_t, int> bells_;  // peers' bells in its AV, and how many peers each
  bool bell_ready_ = false;                    // its fd was readable
  absl::Time next_bell_poll_ = absl::InfinitePast();
  absl::Duration quiet_pass_;  // what a pass over the rails that moves nothing takes
  absl::Duration nap_;         // the next nap
  absl::Duration drained_;     // the time spent copying data that waited after the last nap
  bool napped_ = false;        // the loop has napped since it last made progress
  size_t control_slot_ = 0;

  absl::Mutex inbox_mu_;
  std::deque<Command> inbox_ ABSL_GUARDED_BY(inbox_mu_);
  // inbox_ has work: the thread runs it between the polls of a pass, not only at its start.
  std::atomic<bool> inbox_pending_{false};
  std::atomic<bool> stop_{false};
  // Written by the thread alone (a load and a store: no locked add in the loop), read by any.
  std::atomic<uint64_t> passes_{0}, waits_{0};
  std::thread thread_;
};

// The group whose progress thread calls; null on any other thread.
const ProgressGroup* CurrentGroup();

}  // namespace ferry::engine

#endif  // FERRY_ENGINE_PROGRESS_GROUP_H_
