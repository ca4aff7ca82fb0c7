#include "engine/progress_group.h"

#include <poll.h>
#include <sched.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "engine/control.h"
#include "spdlog/spdlog.h"

namespace ferry::engine {
namespace {

thread_local const ProgressGroup* current_group = nullptr;

}  // namespace

bool OnProgressThread() { return current_group != nullptr; }

const ProgressGroup* CurrentGroup() { return current_group; }

namespace {

// Completions read per fi_cq_read call, and WRITEs posted per burst (FI_MORE on all but the
// last): the batch sizes of the published 32-NIC EFA program.
constexpr size_t kCqBatch = 64;
constexpr size_t kPostBurst = 16;
// Without work a group blocks; with transfers still open elsewhere it wakes this often to
// check deadlines. Providers without a wait fd (shm here) are polled at this period when idle.
constexpr absl::Duration kScanPeriod = absl::Milliseconds(1);
// After its last progress an idle loop spins this long before it blocks: on tcp a stream of
// incoming WRITEs needs the target to keep calling into the provider (manual progress).
constexpr absl::Duration kSpinAfterWake = absl::Microseconds(200);
// With WRITEs in flight or expected, a loop that has seen no progress for this long blocks on
// the providers' wait fds (for at most kScanPeriod) instead of spinning: on a software
// provider the kernel's network stack needs the cores a spinning thread would take.
constexpr absl::Duration kSpinWhileBusy = absl::Microseconds(50);
// A destination that expects WRITEs (see ProgressGroup::Nap) naps between bursts: at least
// kNapMin, at most kNapMax (what one tcp socket's receive buffer absorbs at a few Gbit/s), sized
// so that the data waiting after a nap takes about kNapBatch to drain: its CPU then grows with
// the bytes it receives, not with the time the pull takes.
constexpr absl::Duration kNapMin = absl::Microseconds(10);
constexpr absl::Duration kNapMax = absl::Microseconds(500);
constexpr absl::Duration kNapBatch = absl::Microseconds(20);
// A pass over the rails that took this much longer than an empty one moved data.
constexpr absl::Duration kMovedMargin = absl::Microseconds(1);
// On tcp a call into the provider takes at most one message off each socket; a destination
// that expects WRITEs polls each rail this many times a pass, so that a pass after a nap drains
// that many of the WRITEs that came meanwhile, and a backlog shows in the pass's time.
constexpr size_t kPollsWhileAwake = 8;
// Send slots per rail for control messages, and how many of them a hello may not take: a
// hello to a peer that never answers keeps its slot.
constexpr size_t kSendSlots = 64;
constexpr size_t kReservedSendSlots = 16;
// How often a group looks for control frames that went without a completion too long.
constexpr absl::Duration kSendCheckPeriod = absl::Milliseconds(10);
// Receives posted on the bell: rings are small and consumed at once.
constexpr size_t kBellReceives = 8;

// A provider that cancels or fails an operation (rxm flushes a dead connection's WRITEs with
// FI_ECANCELED; tcp refuses a post with -ENETUNREACH) means the path went away: the rail failed,
// and the caller should retry later. The user's own Transfer::Cancel never reaches the CQ.
absl::Status AsRailFailure(absl::Status s) {
  if (s.code() == absl::StatusCode::kInternal || s.code() == absl::StatusCode::kUnknown ||
      s.code() == absl::StatusCode::kCancelled) {
    return absl::UnavailableError(s.message());
  }
  return s;
}

bool IsRailFailure(const absl::Status& s) { return s.code() == absl::StatusCode::kUnavailable; }

}  // namespace

void Completion::Set(absl::Status status) {
  absl::MutexLock lock(&mu_);
  if (done_) return;
  done_ = true;
  status_ = std::move(status);
}

absl::Status Completion::Wait(absl::Time deadline) const {
  absl::MutexLock lock(&mu_);
  auto is_done = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return done_; };
  if (!mu_.AwaitWithDeadline(absl::Condition(&is_done), deadline)) {
    return absl::DeadlineExceededError("wait passed its deadline");
  }
  return status_;
}

bool TransferState::Finish(absl::Status s) {
  absl::StatusOr<TransferStats> result;
  {
    absl::MutexLock lock(&mu);
    if (done) return false;
    done = true;
    status = std::move(s);
    stats.seconds = absl::ToDoubleSeconds(absl::Now() - start);
    finished.store(true, std::memory_order_release);
    if (on_done) result = status.ok() ? absl::StatusOr<TransferStats>(stats) : status;
  }
  if (counted) engine->TransferEnded(peer);
  if (on_done) std::exchange(on_done, nullptr)(result);
  return true;
}

ProgressGroup::ProgressGroup(Engine* engine, size_t index, const EngineOptions& options)
    : engine_(engine), index_(index), options_(options) {}

absl::StatusOr<std::unique_ptr<ProgressGroup>> ProgressGroup::Start(Engine* engine, size_t index,
                                                                    std::vector<InfoPtr> infos,
                                                                    const EngineOptions& options,
                                                                    Binder bind) {
  std::unique_ptr<ProgressGroup> group(new ProgressGroup(engine, index, options));
  group->event_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  group->epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
  if (group->event_fd_ < 0 || group->epoll_fd_ < 0) {
    return absl::InternalError(absl::StrCat("eventfd/epoll_create1: ", strerror(errno)));
  }
  epoll_event ev = {};
  ev.events = EPOLLIN;
  ev.data.fd = group->event_fd_;
  epoll_ctl(group->epoll_fd_, EPOLL_CTL_ADD, group->event_fd_, &ev);
  Completion opened;
  group->thread_ =
      std::thread(&ProgressGroup::Main, group.get(), std::move(infos), std::move(bind), &opened);
  absl::Status s = opened.Wait(absl::InfiniteFuture());
  if (!s.ok()) return s;  // the destructor joins the thread, which has already returned
  return group;
}

ProgressGroup::~ProgressGroup() {
  stop_.store(true);
  if (event_fd_ >= 0) Wake();
  if (thread_.joinable()) thread_.join();
  if (epoll_fd_ >= 0) close(epoll_fd_);
  if (event_fd_ >= 0) close(event_fd_);
}

void ProgressGroup::Run(Command command) {
  {
    absl::MutexLock lock(&inbox_mu_);
    inbox_.push_back(std::move(command));
    inbox_pending_.store(true, std::memory_order_release);
  }
  Wake();
}

void ProgressGroup::Wake() {
  const uint64_t one = 1;
  // The only failure is a full counter (EAGAIN), which wakes the thread just the same.
  [[maybe_unused]] const ssize_t n = write(event_fd_, &one, sizeof(one));
}

absl::Status ProgressGroup::RunAndWait(absl::AnyInvocable<absl::Status(ProgressGroup&)> fn) {
  // shared with the progress thread, which may outlive this frame only until it sets it
  auto done = std::make_shared<Completion>();
  Run([fn = std::move(fn), done](ProgressGroup& g) mutable { done->Set(fn(g)); });
  return done->Wait(absl::InfiniteFuture());
}

absl::Status ProgressGroup::OpenRails(std::vector<InfoPtr> infos) {
  control_slot_ = ControlFrameCapacity(options_.max_control);
  for (InfoPtr& info : infos) {
    ASSIGN_OR_RETURN(auto rs,
                     OpenRail(*info, options_.wait_fds, std::max<size_t>(options_.recv_pool, 1)));
    if (rs->rail->wait_fd() < 0) all_fd_ = false;
    rails_.push_back(std::move(rs));
  }
  if (index_ == 0 && !infos.empty()) {
    auto bell = OpenRail(*infos[0], /*wait_fd=*/true, kBellReceives);
    if (!bell.ok()) {
      spdlog::warn("no bell: {}", bell.status().ToString());
    } else if ((*bell)->rail->wait_fd() >= 0) {  // else nothing to sleep on: no bell
      bell_ = std::move(*bell);
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<ProgressGroup::RailState>> ProgressGroup::OpenRail(
    const fi_info& info, bool wait_fd, size_t nrecv) {
  auto rs = std::make_unique<RailState>();
  ASSIGN_OR_RETURN(rs->rail, Rail::Open(info, options_.tx_depth, wait_fd, options_.hmem_dmabuf));
  rs->depth = rs->rail->rail_info().tx_depth;
  rs->arena.resize((nrecv + kSendSlots) * control_slot_);
  ASSIGN_OR_RETURN(rs->arena_mr, rs->rail->Register(rs->arena.data(), rs->arena.size(),
                                                    RandomMrKey(), FI_SEND | FI_RECV));
  rs->recvs.resize(nrecv);
  for (size_t i = 0; i < nrecv; ++i) {
    rs->recvs[i].kind = OpKind::kRecv;
    rs->recvs[i].buffer = rs->arena.data() + i * control_slot_;
  }
  rs->sends.resize(kSendSlots);
  for (size_t i = 0; i < kSendSlots; ++i) {
    rs->sends[i].kind = OpKind::kSend;
    rs->sends[i].slot = i;
    rs->free_sends.push_back(i);
  }
  for (RecvOp& op : rs->recvs) PostRecv(*rs, op);
  if (rs->rail->wait_fd() >= 0) {
    epoll_event ev = {};
    ev.events = EPOLLIN;
    ev.data.fd = rs->rail->wait_fd();
    if (epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, rs->rail->wait_fd(), &ev) != 0) {
      return absl::InternalError(absl::StrCat("epoll_ctl: ", strerror(errno)));
    }
  }
  return rs;
}

void ProgressGroup::Main(std::vector<InfoPtr> infos, Binder bind, Completion* opened) {
  current_group = this;
  // Pinned first, so that the CQs, queues and buffers the rails allocate are NUMA-local.
  absl::Status s = bind ? bind() : absl::OkStatus();
  if (s.ok()) s = OpenRails(std::move(infos));
  if (!s.ok()) {
    Shutdown();
    opened->Set(s);
    return;
  }
  opened->Set(absl::OkStatus());
  absl::Time idle_since = absl::InfinitePast();  // the first pass without progress
  absl::Time last_worked = absl::InfinitePast();
  nap_ = kNapMin;
  while (!stop_.load(std::memory_order_relaxed)) {
    passes_.store(passes_.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
    bool worked = DrainInbox();
    bool busy = false;
    const absl::Time pass_start = absl::Now();
    const bool check_sends = pass_start >= next_send_check_;
    if (check_sends) next_send_check_ = pass_start + kSendCheckPeriod;
    // Right after a completion (a small pull's answer is due) a pass polls each rail once, so
    // that a message on any rail waits for one call per rail, not kPollsWhileAwake.
    const size_t polls =
        options_.spin_while_awake || !Awake(pass_start) || pass_start - last_worked < kSpinAfterWake
            ? 1
            : kPollsWhileAwake;
    for (size_t k = 0; k < rails_.size(); ++k) {
      RailState& rs = *rails_[k];
      for (size_t i = 0; i < polls; ++i) {
        worked |= PollCq(rs) > 0;
        // Work handed over meanwhile (a message to send, a transfer) does not wait for the
        // rest of the pass.
        if (inbox_pending_.load(std::memory_order_acquire)) worked |= DrainInbox();
      }
      worked |= PostWrites(k);
      worked |= PostSends(rs);
      if (check_sends) CheckSends(rs, absl::Now());
      // Control messages count until they complete, or for as long as they may: a first one
      // waits for the provider to connect, which a loop blocked on the CQ's fd may not hear of.
      busy |= rs.in_flight > 0 || !rs.queue.empty() || rs.sends_young;
    }
    if (bell_ != nullptr) {
      // Its CQ is read when its fd said so, while a ring goes out, and once a kScanPeriod
      // below: a waitable CQ costs a system call per read.
      const bool ringing = bell_->free_sends.size() < bell_->sends.size();
      if (ringing || bell_ready_) worked |= ServiceBell();
      busy |= ringing;
    }
    if (!parts_.empty()) {
      absl::Time now = absl::Now();
      if (now >= next_scan_) {
        ScanParts();
        next_scan_ = now + kScanPeriod;
      }
    }
    if (!retiring_.empty()) ReapParts();
    const absl::Time now = absl::Now();
    if (worked) {
      idle_since = absl::InfinitePast();
      last_worked = now;
      nap_ = kNapMin;
      napped_ = false;
      continue;
    }
    if (bell_ != nullptr && now >= next_bell_poll_) {
      next_bell_poll_ = now + kScanPeriod;
      if (ServiceBell()) {
        idle_since = absl::InfinitePast();
        continue;
      }
    }
    // A WRITE that lands gives its target no completion, yet on tcp and shm it lands only while
    // the target calls into the provider. A destination that expects WRITEs (Engine::KeepAwake,
    // or a ring) therefore keeps polling: without pausing for kSpinAfterWake after a completion
    // (a small pull's answer comes within it), and after that without pausing while passes
    // move data, napping between bursts (Nap). spin_while_awake: never a nap.
    const bool awake = Awake(now);
    if (awake) {
      // Only a pass of kPollsWhileAwake polls a rail is judged (a shorter one would lower the
      // measure of an empty pass): after a shorter one, a full pass comes first.
      if (options_.spin_while_awake || now - last_worked < kSpinAfterWake ||
          polls < kPollsWhileAwake) {
        idle_since = now;
        sched_yield();  // spinning: a thread that has work (a woken caller) goes first
        continue;
      }
      if (PassMovedData(now - pass_start)) {
        idle_since = now;
        continue;
      }
      Nap();
      idle_since = absl::InfinitePast();
      continue;
    }
    napped_ = false;
    if (idle_since == absl::InfinitePast()) idle_since = now;
    // WRITEs in flight or expected (a destination waiting for a source's pull).
    const bool expecting = busy || awake;
    if (now - idle_since < (expecting ? kSpinWhileBusy : kSpinAfterWake)) {
      sched_yield();
      continue;
    }
    Block(expecting || !parts_.empty(), now - idle_since);
  }
  Shutdown();
}

void ProgressGroup::Block(bool soon, absl::Duration idle) {
  const int scan_ms = static_cast<int>(absl::ToInt64Milliseconds(kScanPeriod));
  int timeout_ms =
      soon ? scan_ms : static_cast<int>(absl::ToInt64Milliseconds(options_.asleep_poll));
  if (all_fd_) {
    for (auto& rs : rails_) {
      if (!TryWait(*rs)) return;
    }
  } else if (soon || !engine_->has_bell_ || idle < kBellLinger || engine_->Woken(absl::Now())) {
    // Rails without wait fds: polled every kScanPeriod while anything may come on them.
    timeout_ms = scan_ms;
  }
  // Else asleep until the bell rings, the inbox has work or asleep_poll has passed. The bell's fd
  // stays readable after its CQ got a completion until fi_trywait resets it, so it is asked
  // before any wait: else every wait would return at once.
  if (bell_ != nullptr && !TryWait(*bell_)) {
    bell_ready_ = true;
    return;
  }
  if (WaitFds(timeout_ms) > 0) bell_ready_ = bell_ != nullptr;
}

bool ProgressGroup::PassMovedData(absl::Duration pass) {
  if (options_.pass_moved) return options_.pass_moved();
  // The first pass sets the measure of an empty one; a shorter one lowers it at once, and
  // passes judged empty move it slowly (a machine's pace changes).
  if (quiet_pass_ == absl::ZeroDuration() || pass < quiet_pass_) quiet_pass_ = pass;
  if (pass > quiet_pass_ + kMovedMargin) {
    if (napped_) drained_ += pass - quiet_pass_;
    return true;
  }
  quiet_pass_ += (pass - quiet_pass_) / 16;
  return false;
}

bool ProgressGroup::Awake(absl::Time now) const {
  return engine_->awake_.load(std::memory_order_relaxed) > 0 || engine_->Rung(now);
}

void ProgressGroup::Nap() {
  if (napped_) {
    // The data that waited after the last nap is drained: nothing came (a pause) -> nap twice
    // as long; more than kNapBatch to drain (the sockets' buffers fill) -> half as long; less
    // than half of it -> a quarter longer.
    if (drained_ == absl::ZeroDuration()) {
      nap_ = std::min(2 * nap_, kNapMax);
    } else if (drained_ > kNapBatch) {
      nap_ = std::max(nap_ / 2, kNapMin);
    } else if (drained_ < kNapBatch / 2) {
      nap_ = std::min(nap_ * 5 / 4, kNapMax);
    }
  }
  napped_ = true;
  drained_ = absl::ZeroDuration();
  // Only new work ends a nap early. The bell is left out: a ring changes nothing for a group
  // that is awake, it is read within kScanPeriod anyway, and its fd, readable until fi_trywait
  // resets it (see Block), would cost a fi_trywait before every nap.
  waits_.store(waits_.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
  pollfd fd = {event_fd_, POLLIN, 0};
  const timespec timeout = absl::ToTimespec(nap_);
  if (ppoll(&fd, 1, &timeout, nullptr) > 0) {
    uint64_t count;
    [[maybe_unused]] const ssize_t r = read(event_fd_, &count, sizeof(count));  // reset it
  }
}

bool ProgressGroup::TryWait(const RailState& rs) {
  fid* f = &rs.rail->cq()->fid;
  return fi_trywait(rs.rail->fabric(), &f, 1) == FI_SUCCESS;
}

bool ProgressGroup::ServiceBell() {
  bell_ready_ = false;
  const bool read = PollCq(*bell_) > 0;
  return PostSends(*bell_) || read;
}

std::string ProgressGroup::bell_address() const {
  return bell_ ? bell_->rail->rail_info().address : std::string();
}

absl::StatusOr<fi_addr_t> ProgressGroup::AddBell(const std::string& address) {
  if (bell_ == nullptr) return absl::FailedPreconditionError("this engine has no bell");
  ASSIGN_OR_RETURN(fi_addr_t fa, AcquireAddress(*bell_, address));
  ++bells_[fa];
  return fa;
}

void ProgressGroup::RemoveBell(fi_addr_t bell) {
  auto it = bells_.find(bell);
  if (it == bells_.end()) return;
  if (--it->second == 0) bells_.erase(it);
  ReleaseAddress(*bell_, bell);
}

absl::StatusOr<fi_addr_t> ProgressGroup::AcquireAddress(RailState& rs, const std::string& address) {
  auto known = rs.av_by_name.find(address);
  if (known != rs.av_by_name.end()) {
    ++rs.av[known->second].users;
    return known->second;
  }
  ASSIGN_OR_RETURN(fi_addr_t fa, rs.rail->Insert(address));
  rs.av_by_name.emplace(address, fa);
  AvEntry& e = rs.av[fa];
  e.name = address;
  e.users = 1;
  return fa;
}

void ProgressGroup::ReleaseAddress(RailState& rs, fi_addr_t addr) {
  auto it = rs.av.find(addr);
  if (it == rs.av.end() || it->second.users == 0) return;
  if (--it->second.users > 0) return;
  // Nothing more goes to it: control messages not yet posted are cancelled.
  std::vector<SendOp*> cancelled;
  std::erase_if(rs.pending_sends, [&](SendOp* op) {
    if (op->dest != addr) return false;
    cancelled.push_back(op);
    return true;
  });
  std::vector<SendCallback> dropped;
  std::erase_if(rs.backlog, [&](RailState::Backlogged& b) {
    if (b.dest != addr) return false;
    dropped.push_back(std::move(b.done));
    return true;
  });
  for (SendOp* op : cancelled) FinishSend(rs, op, absl::CancelledError("peer removed"));
  for (SendCallback& done : dropped) {
    if (done) done(absl::CancelledError("peer removed"));
  }
  MaybeForget(rs, addr);
}

void ProgressGroup::OpPosted(RailState& rs, fi_addr_t addr) {
  auto it = rs.av.find(addr);
  if (it != rs.av.end()) ++it->second.ops;
}

void ProgressGroup::OpCompleted(RailState& rs, fi_addr_t addr) {
  auto it = rs.av.find(addr);
  if (it == rs.av.end() || it->second.ops == 0) return;
  --it->second.ops;
  MaybeForget(rs, addr);
}

void ProgressGroup::MaybeForget(RailState& rs, fi_addr_t addr) {
  auto it = rs.av.find(addr);
  if (it == rs.av.end() || it->second.users > 0 || it->second.ops > 0) return;
  fi_av_remove(rs.rail->av(), &addr, 1, 0);
  rs.av_by_name.erase(it->second.name);
  rs.av.erase(it);
}

absl::StatusOr<ProgressGroup::Contact> ProgressGroup::ContactAddress(size_t rail,
                                                                     const std::string& address,
                                                                     const std::string& hello) {
  RailState& rs = *rails_[rail];
  ASSIGN_OR_RETURN(fi_addr_t fa, AcquireAddress(rs, address));
  auto answered = Hello(rail, fa, hello);
  if (!answered.ok()) {
    ReleaseAddress(rs, fa);
    return answered.status();
  }
  return Contact{fa, *std::move(answered)};
}

absl::StatusOr<std::shared_ptr<Completion>> ProgressGroup::Hello(size_t rail, fi_addr_t addr,
                                                                 const std::string& hello) {
  RailState& rs = *rails_[rail];
  auto it = rs.av.find(addr);
  if (it == rs.av.end()) return absl::NotFoundError("no such address on the rail");
  AvEntry& e = it->second;
  if (e.hello == nullptr) {
    auto done = std::make_shared<Completion>();
    QueueSendOn(rs, addr, hello, done, /*first_contact=*/true);
    if (done->Wait(absl::InfinitePast()).code() == absl::StatusCode::kResourceExhausted) {
      return absl::ResourceExhaustedError(absl::StrCat("rail ", engine_->EngineRail(index_, rail),
                                                       ": too many first contacts unanswered"));
    }
    e.hello = std::move(done);
  }
  return e.hello;
}

void ProgressGroup::Ring(fi_addr_t bell, RingKind kind) {
  // Rings queued for a peer removed since are dropped here.
  if (!bells_.contains(bell) || bell_->free_sends.size() <= kReservedSendSlots) return;
  // Nobody waits for a ring: a lost one is made up for by the next, or by the sleeper's
  // once-a-second poll.
  QueueSendOn(
      *bell_, bell,
      EncodeControl(ControlType::kBell, engine_->node_id_, std::string(1, static_cast<char>(kind))),
      std::make_shared<Completion>());
}

int ProgressGroup::WaitFds(int timeout_ms) {
  if (timeout_ms > 0)
    waits_.store(waits_.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
  epoll_event events[8];
  const int n = epoll_wait(epoll_fd_, events, 8, timeout_ms);
  int ready = 0;
  for (int i = 0; i < n; ++i) {
    if (events[i].data.fd == event_fd_) {
      uint64_t count;
      [[maybe_unused]] const ssize_t r = read(event_fd_, &count, sizeof(count));  // reset it
    } else {
      ++ready;
    }
  }
  return ready;
}

bool ProgressGroup::DrainInbox() {
  std::deque<Command> batch;
  {
    absl::MutexLock lock(&inbox_mu_);
    inbox_pending_.store(false, std::memory_order_relaxed);
    if (inbox_.empty()) return false;
    batch.swap(inbox_);
  }
  for (Command& c : batch) c(*this);
  return true;
}

void ProgressGroup::PostRecv(RailState& rs, RecvOp& op) {
  ssize_t rc;
  do {
    rc =
        fi_recv(rs.rail->ep(), op.buffer, control_slot_, rs.arena_mr.desc, FI_ADDR_UNSPEC, &op.ctx);
    if (rc == -FI_EAGAIN) fi_cq_read(rs.rail->cq(), nullptr, 0);  // progress, then retry
  } while (rc == -FI_EAGAIN && !stop_.load(std::memory_order_relaxed));
  if (rc != 0 && rc != -FI_EAGAIN) spdlog::error("{}", FiError(rc, "fi_recv").ToString());
}

void ProgressGroup::Count(std::atomic<uint64_t>& counter, uint64_t n) const {
  if (options_.counters) counter.fetch_add(n, std::memory_order_relaxed);
}

RailCounters ProgressGroup::counters(size_t i) const {
  const RailState::Counts& c = rails_[i]->counts;
  auto get = [](const std::atomic<uint64_t>& a) { return a.load(std::memory_order_relaxed); };
  const uint64_t done = get(c.done_bytes);  // before posted: in flight never goes negative
  return {.writes = get(c.writes),
          .bytes = get(c.bytes),
          .write_errors = get(c.write_errors),
          .failovers = get(c.failovers),
          .backoffs = get(c.backoffs),
          .in_flight_bytes = get(c.posted_bytes) - done,
          .full = get(c.full),
          .peak_in_flight = get(c.peak_in_flight),
          .immediates = get(c.immediates),
          .messages_sent = get(c.messages_sent),
          .messages_received = get(c.messages_received)};
}

size_t ProgressGroup::PollCq(RailState& rs) {
  fi_cq_data_entry entries[kCqBatch];
  ssize_t n = fi_cq_read(rs.rail->cq(), entries, kCqBatch);
  if (n == -FI_EAGAIN) return 0;
  if (n == -FI_EAVAIL) {
    fi_cq_err_entry err = {};
    if (fi_cq_readerr(rs.rail->cq(), &err, 0) != 1) return 0;
    auto* op = static_cast<OpBase*>(err.op_context);
    char buf[256];
    const char* detail =
        fi_cq_strerror(rs.rail->cq(), err.prov_errno, err.err_data, buf, sizeof(buf));
    const absl::Status s =
        AsRailFailure(FiError(err.err, absl::StrCat("completion error (prov_errno ", err.prov_errno,
                                                    ": ", detail ? detail : "?", ")")));
    if (op == nullptr) return 1;
    switch (op->kind) {
      case OpKind::kWrite:
        OnWriteDone(static_cast<WriteOp*>(op), s);
        break;
      case OpKind::kSend:
        FinishSend(rs, static_cast<SendOp*>(op), s);
        break;
      case OpKind::kRecv:
        if (err.err != FI_ECANCELED) PostRecv(rs, *static_cast<RecvOp*>(op));
        break;
    }
    return 1;
  }
  if (n < 0) {
    spdlog::error("{}", FiError(n, "fi_cq_read").ToString());
    return 0;
  }
  for (ssize_t i = 0; i < n; ++i) {
    const fi_cq_data_entry& e = entries[i];
    auto* op = static_cast<OpBase*>(e.op_context);
    if (e.flags & FI_REMOTE_CQ_DATA) {
      engine_->OnImmediate(e.data);
      Count(rs.counts.immediates);  // after its counter saw it: a count read means handled
      // With FI_RX_CQ_DATA the immediate consumed a posted receive: put it back.
      if (op != nullptr && op->kind == OpKind::kRecv) PostRecv(rs, *static_cast<RecvOp*>(op));
      continue;
    }
    if (op == nullptr) continue;
    switch (op->kind) {
      case OpKind::kWrite:
        OnWriteDone(static_cast<WriteOp*>(op), absl::OkStatus());
        break;
      case OpKind::kSend:
        FinishSend(rs, static_cast<SendOp*>(op), absl::OkStatus());
        break;
      case OpKind::kRecv: {
        auto* recv = static_cast<RecvOp*>(op);
        Count(rs.counts.messages_received);
        size_t k = 0;
        while (k + 1 < rails_.size() && rails_[k].get() != &rs) ++k;
        engine_->OnControl(std::string_view(recv->buffer, e.len), index_, k);
        PostRecv(rs, *recv);
        break;
      }
    }
  }
  return static_cast<size_t>(n);
}

WriteOp* ProgressGroup::QueueFront(RailState& rs) {
  // KillPart purges a dead part's queued WRITEs, so whatever is queued is to be posted.
  return rs.queue.empty() ? nullptr : rs.queue.front();
}

bool ProgressGroup::HasRoom(const RailState& rs, size_t ops, uint64_t bytes,
                            uint64_t length) const {
  const size_t n = rs.in_flight + ops;
  return n < rs.depth &&
         (n == 0 || rs.in_flight_bytes + bytes + length <= options_.max_inflight_bytes);
}

bool ProgressGroup::Steal(size_t thief) {
  // From the front of the longest queue (what it would post next), as much as the thief has
  // room for. A WRITE that asks for delivery completion on a rail that orders WRITEs stays:
  // it vouches for the ones its rail sent before it at transmit.
  RailState& rs = *rails_[thief];
  RailState* victim = nullptr;
  for (size_t k = 0; k < rails_.size(); ++k) {
    if (k != thief && rails_[k]->queued_bytes > (victim ? victim->queued_bytes : 0)) {
      victim = rails_[k].get();
    }
  }
  if (victim == nullptr) return false;
  const bool ordered = victim->rail->rail_info().ordered_writes;
  const absl::Time now = absl::Now();
  size_t taken = 0;
  uint64_t bytes = 0;
  while (!victim->queue.empty()) {
    WriteOp* op = victim->queue.front();
    if ((ordered && op->deliver) || !HasRoom(rs, taken, bytes, op->length) ||
        !Usable(thief, op->part->transfer->peer, now)) {
      break;
    }
    victim->queue.pop_front();
    victim->queued_bytes -= op->length;
    Retarget(op, thief, /*failover=*/false);
    Enqueue(thief, op);
    ++taken;
    bytes += op->length;
  }
  return taken > 0;
}

bool ProgressGroup::PostWrites(size_t index) {
  // Lazy posting: after every CQ poll, post queued WRITEs until the tx depth is reached or
  // the provider answers -FI_EAGAIN. The op stays queued on -FI_EAGAIN, so nothing is lost.
  RailState& rs = *rails_[index];
  if (rs.queue.empty() && options_.work_stealing && HasRoom(rs, 0, 0, 0)) Steal(index);
  bool posted = false;
  size_t burst = 0;
  WriteOp* op = QueueFront(rs);
  auto room = [&](const WriteOp* w) { return HasRoom(rs, 0, 0, w->length); };
  while (op != nullptr && room(op)) {
    rs.queue.pop_front();
    rs.queued_bytes -= op->length;
    WriteOp* next = QueueFront(rs);
    if (!rs.av.contains(op->dest)) {
      // Its peer was removed while it waited (the AV entry went with its last user): the
      // provider must not see an address it no longer holds. The transfer fails; its part
      // retires through ScanParts.
      --op->part->unresolved;
      op->part->transfer->Finish(absl::UnavailableError("the peer was removed"));
      op = next;
      continue;
    }
    ++burst;
    ++rs.in_flight;  // counted before the post: `more` must know whether `next` fits
    if (options_.counters &&
        rs.in_flight > rs.counts.peak_in_flight.load(std::memory_order_relaxed)) {
      rs.counts.peak_in_flight.store(rs.in_flight, std::memory_order_relaxed);  // one writer
    }
    op->seq = ++rs.posts;
    rs.in_flight_bytes += op->length;
    const bool more = next != nullptr && burst < kPostBurst && room(next);
    fi_rma_iov rma[kMaxIov];
    void* descs[kMaxIov];
    for (size_t i = 0; i < op->pieces; ++i) {
      rma[i] = {op->remote[i], op->local[i].iov_len, op->key};
      descs[i] = op->desc;
    }
    fi_msg_rma msg = {};
    msg.msg_iov = op->local.data();
    msg.desc = descs;
    msg.iov_count = op->pieces;
    msg.addr = op->dest;
    msg.rma_iov = rma;
    msg.rma_iov_count = op->pieces;
    msg.context = &op->ctx;
    msg.data = op->data;
    // Flags replace the endpoint's op_flags (fi_rma(3)). A WRITE that needs no delivery
    // completion gets no completion level: its completion then only says the source buffer
    // may be reused, which is all we need of it (FI_TRANSMIT_COMPLETE would cost an ack too on
    // a reliable endpoint).
    uint64_t flags = FI_COMPLETION;
    if (op->deliver && rs.rail->rail_info().delivery_complete) flags |= FI_DELIVERY_COMPLETE;
    if (more) flags |= FI_MORE;
    if (op->immediate) flags |= FI_REMOTE_CQ_DATA;
    ssize_t rc = options_.post_fault ? options_.post_fault(engine_->EngineRail(index_, index),
                                                           op->part->transfer->from_gpu)
                                     : 0;
    if (rc == 0) rc = fi_writemsg(rs.rail->ep(), &msg, flags);
    if (rc == -FI_EAGAIN) {
      --rs.in_flight;
      rs.in_flight_bytes -= op->length;
      Enqueue(op->rail, op, /*front=*/true);
      break;
    }
    if (burst == kPostBurst) burst = 0;
    if (rc != 0 && op->part->transfer->from_gpu) {
      // As a failed completion (OnWriteDone): the transfer fails, the rail stays up.
      op->posted = true;
      Count(rs.counts.posted_bytes, op->length);
      OpPosted(rs, op->dest);
      OnWriteDone(op, FiError(rc, "fi_writemsg"));
      next = QueueFront(rs);
    } else if (rc != 0) {
      // Refused at post time: the rail failed for the peer (tcp answers -ENETUNREACH when the
      // link is gone), as a failed completion says. The WRITE and the rail's other queued
      // WRITEs to the peer go elsewhere.
      --rs.in_flight;
      rs.in_flight_bytes -= op->length;
      Count(rs.counts.write_errors);
      const PeerId peer = op->part->transfer->peer;
      RailDown(index, peer, AsRailFailure(FiError(rc, "fi_writemsg")));
      Route(op, peer, absl::Now());
      next = QueueFront(rs);  // the failure may have moved the queue
    } else {
      op->posted = true;
      Count(rs.counts.posted_bytes, op->length);
      OpPosted(rs, op->dest);
      PeerHealth& h = rs.health[op->part->transfer->peer];
      if (h.in_flight++ == 0) h.last_progress = absl::Now();
      posted = true;
    }
    op = next;
  }
  if (op != nullptr) Count(rs.counts.full);  // no room under the caps, or -FI_EAGAIN
  return posted;
}

bool ProgressGroup::PostSends(RailState& rs) {
  bool posted = false;
  while (!rs.pending_sends.empty()) {
    SendOp* op = rs.pending_sends.front();
    if (!rs.av.contains(op->dest)) {
      // Queued for a peer removed meanwhile (as PostWrites).
      rs.pending_sends.pop_front();
      FinishSend(rs, op, absl::CancelledError("peer removed"));
      continue;
    }
    char* buf = rs.arena.data() + (rs.recvs.size() + op->slot) * control_slot_;
    ssize_t rc;
    if (op->callback && rs.rail->rail_info().delivery_complete) {
      // A control frame completes once the peer has it (a transmit completion only says the
      // bytes left, maybe into a socket whose link is gone): a frame that does not is failed
      // over to another rail (CheckSends).
      iovec iov = {buf, op->length};
      void* desc = rs.arena_mr.desc;
      fi_msg msg = {};
      msg.msg_iov = &iov;
      msg.desc = &desc;
      msg.iov_count = 1;
      msg.addr = op->dest;
      msg.context = &op->ctx;
      rc = fi_sendmsg(rs.rail->ep(), &msg, FI_COMPLETION | FI_DELIVERY_COMPLETE);
    } else {
      rc = fi_send(rs.rail->ep(), buf, op->length, rs.arena_mr.desc, op->dest, &op->ctx);
    }
    if (rc == -FI_EAGAIN) break;
    rs.pending_sends.pop_front();
    if (rc != 0) {
      FinishSend(rs, op, FiError(rc, "fi_send"));
      continue;
    }
    op->posted = true;
    OpPosted(rs, op->dest);
    posted = true;
  }
  return posted;
}

void ProgressGroup::CheckSends(RailState& rs, absl::Time now) {
  rs.sends_young = false;
  if (rs.free_sends.size() == rs.sends.size()) return;
  std::vector<SendOp*> stalled;
  for (SendOp& op : rs.sends) {
    if (op.abandoned || (!op.done && !op.callback)) continue;
    if (now - op.since <= options_.rail_stall_timeout) {
      rs.sends_young = true;
    } else if (op.callback) {
      stalled.push_back(&op);
    }
  }
  for (SendOp* op : stalled) {
    const absl::Status why = absl::UnavailableError(
        absl::StrCat("no completion for ", absl::FormatDuration(options_.rail_stall_timeout)));
    auto queued = std::find(rs.pending_sends.begin(), rs.pending_sends.end(), op);
    if (queued != rs.pending_sends.end()) {  // never posted: its slot is free again
      rs.pending_sends.erase(queued);
      FinishSend(rs, op, why);
      continue;
    }
    op->abandoned = true;
    std::exchange(op->callback, nullptr)(why);
  }
}

void ProgressGroup::FinishSend(RailState& rs, SendOp* op, const absl::Status& status) {
  // An abandoned frame's sender knows already: only its slot comes back.
  if (op->done && !op->abandoned) op->done->Set(status);
  if (status.ok()) Count(rs.counts.messages_sent);
  rs.free_sends.push_back(op->slot);
  if (op->posted) {
    op->posted = false;
    auto it = rs.av.find(op->dest);
    if (it != rs.av.end() && op->done && it->second.hello == op->done) it->second.hello.reset();
    OpCompleted(rs, op->dest);
  }
  op->done.reset();
  op->abandoned = false;
  SendCallback callback = std::exchange(op->callback, nullptr);
  // A freed slot takes the next backlogged frame.
  if (!rs.backlog.empty() && rs.free_sends.size() > kReservedSendSlots) {
    RailState::Backlogged next = std::move(rs.backlog.front());
    rs.backlog.pop_front();
    QueueSendOn(rs, next.dest, std::move(next.frame), nullptr, false, std::move(next.done));
  }
  if (callback) callback(status);
}

void ProgressGroup::QueueSend(size_t rail, fi_addr_t dest, std::string frame, SendCallback done) {
  RailState& rs = *rails_[rail];
  if (!rs.backlog.empty() || rs.free_sends.size() <= kReservedSendSlots) {
    rs.backlog.push_back({dest, std::move(frame), std::move(done)});
    return;
  }
  QueueSendOn(rs, dest, std::move(frame), nullptr, false, std::move(done));
}

void ProgressGroup::QueueSendOn(RailState& rs, fi_addr_t dest, std::string message,
                                std::shared_ptr<Completion> done, bool first_contact,
                                SendCallback callback) {
  auto refuse = [&](absl::Status s) {
    if (done) done->Set(s);
    if (callback) callback(s);
  };
  if (message.size() > control_slot_)
    return refuse(absl::InvalidArgumentError("control message too large"));
  if (rs.free_sends.size() <= (first_contact ? kReservedSendSlots : 0)) {
    return refuse(absl::ResourceExhaustedError("all control send slots are in use"));
  }
  SendOp& op = rs.sends[rs.free_sends.back()];
  rs.free_sends.pop_back();
  op.length = message.size();
  op.dest = dest;
  op.done = std::move(done);
  op.callback = std::move(callback);
  op.since = absl::Now();
  op.abandoned = false;
  memcpy(rs.arena.data() + (rs.recvs.size() + op.slot) * control_slot_, message.data(),
         message.size());
  rs.pending_sends.push_back(&op);
  PostSends(rs);
}

void ProgressGroup::AddPart(std::unique_ptr<Part> part) {
  Part* p = part.get();
  TransferState& t = *p->transfer;
  const absl::Time now = absl::Now();
  // None of this group's rails reaches the peer now: the whole part goes to another group.
  if (PickRail(t.peer, kNoRail, now) < 0) return OfferOn(std::move(part));
  parts_.emplace(p, std::move(part));
  engine_->FillPart(*p, index_);
  for (WriteOp& op : p->ops) {
    if (!op.held) Route(&op, t.peer, now);
  }
  // Every other WRITE may have completed already (on other groups, or there is none).
  if (t.tail_part == p && t.parts_data_pending.fetch_sub(1) == 1) QueueTail(p->transfer);
  for (size_t k = 0; k < rails_.size(); ++k) PostWrites(k);
}

void ProgressGroup::QueueTail(const std::shared_ptr<TransferState>& transfer) {
  // A finished transfer's tail part is killed (and may be freed) by this group's ScanParts:
  // look at nothing of it here. Unfinished, the part is alive: its tail is unresolved.
  if (transfer->finished.load(std::memory_order_acquire)) return;
  WriteOp* tail = transfer->tail;
  tail->part->tail_posted = true;
  tail->held = false;
  Route(tail, transfer->peer, absl::Now());
}

void ProgressGroup::Route(WriteOp* op, PeerId peer, absl::Time now) {
  if (op->rail == kNoRail || !Usable(op->rail, peer, now)) {
    const int k = PickRail(peer, op->rail, now);
    if (k < 0) return HandoverQueued({op});
    if (op->rail == kNoRail) {
      Place(op, static_cast<size_t>(k));
    } else {
      Retarget(op, static_cast<size_t>(k), /*failover=*/true);
    }
  }
  Enqueue(op->rail, op);
}

void ProgressGroup::Enqueue(size_t rail, WriteOp* op, bool front) {
  RailState& rs = *rails_[rail];
  if (front) {
    rs.queue.push_front(op);
  } else {
    rs.queue.push_back(op);
  }
  rs.queued_bytes += op->length;
}

void ProgressGroup::OnWriteDone(WriteOp* op, const absl::Status& status) {
  RailState& rs = *rails_[op->rail];
  --rs.in_flight;
  rs.in_flight_bytes -= op->length;
  if (status.ok()) {
    Count(rs.counts.writes);
    Count(rs.counts.bytes, op->length);
  } else {
    Count(rs.counts.write_errors);
  }
  Count(rs.counts.done_bytes, op->length);
  Part* part = op->part;
  std::shared_ptr<TransferState> t = part->transfer;  // keeps t alive past ResolveOp
  OpCompleted(rs, op->dest);
  auto h = rs.health.find(t->peer);
  if (h != rs.health.end() && h->second.in_flight > 0) {
    const absl::Time now = absl::Now();
    --h->second.in_flight;
    h->second.last_progress = now;
    if (status.ok() && now >= h->second.resting_until) h->second.backoff = absl::ZeroDuration();
  }
  op->done = true;
  op->failed = !status.ok();
  if (status.ok() && op->deliver) {
    part->delivered.resize(rails_.size());
    part->delivered[op->rail] = std::max(part->delivered[op->rail], op->seq);
    // The rail's bytes so far have landed: the transfer's lock once per rail on an ordered
    // rail (its closing WRITE), not once per WRITE.
    absl::MutexLock lock(&t->mu);
    double& s = t->stats.rail_seconds[engine_->EngineRail(index_, op->rail)];
    s = std::max(s, absl::ToDoubleSeconds(absl::Now() - t->start));
  }
  if (op->abandoned) {  // its bytes went again on another rail
    --part->unresolved;
    if (!part->dead && t->finished.load(std::memory_order_acquire)) {
      KillPart(part);
    } else {
      MaybeRetire(part);
    }
    return;
  }
  // A rail that loses a WRITE (the path, not the request, failed) goes down, and the WRITE
  // goes again on another rail. Not a WRITE of GPU memory: a provider that claims FI_HMEM and
  // cannot move it fails on every rail alike, and rails taken down for it would stall the
  // staged pull the destination retries with; such a transfer fails at once.
  if (IsRailFailure(status) && !t->from_gpu && !t->finished.load(std::memory_order_acquire)) {
    RailDown(op->rail, t->peer, status);
    Resend(part, {op});
    --part->unresolved;
    if (!part->dead && t->finished.load(std::memory_order_acquire)) {
      KillPart(part);
    } else {
      MaybeRetire(part);
    }
    return;
  }
  if (!status.ok()) t->Finish(status);
  const bool is_tail = t->tail == op;
  if (is_tail && status.ok()) t->Finish(absl::OkStatus());
  ResolveOp(part, is_tail);
}

void ProgressGroup::DataResolved(Part* part) {
  if (--part->data_unresolved != 0 || part->dead) return;
  const std::shared_ptr<TransferState>& t = part->transfer;
  if (t->parts_data_pending.fetch_sub(1) != 1) return;
  if (t->tail == nullptr) {
    t->Finish(absl::OkStatus());
    return;
  }
  ProgressGroup* tail_group = t->tail_group.load(std::memory_order_acquire);
  if (tail_group == this) {
    QueueTail(t);
  } else {
    tail_group->Run([t](ProgressGroup& g) { g.QueueTail(t); });
  }
}

void ProgressGroup::ResolveOp(Part* part, bool is_tail) {
  if (!is_tail) DataResolved(part);
  --part->unresolved;
  if (!part->dead && part->transfer->finished.load(std::memory_order_acquire)) {
    KillPart(part);
  } else {
    MaybeRetire(part);
  }
}

void ProgressGroup::KillPart(Part* part) {
  // The transfer has its result: drop this part's queued WRITEs and a held-back tail; what is
  // in flight still completes (or fails) through the CQ before the part retires.
  part->dead = true;
  TransferState& t = *part->transfer;
  if (t.tail_part == part && !part->tail_posted) {
    part->tail_posted = true;
    --part->unresolved;
  }
  for (auto& rs : rails_) {
    std::erase_if(rs->queue, [part, &rs](WriteOp* op) {
      if (op->part != part) return false;
      rs->queued_bytes -= op->length;
      --part->unresolved;
      return true;
    });
  }
  MaybeRetire(part);
}

void ProgressGroup::MaybeRetire(Part* part) {
  if (part->unresolved != 0 || part->retiring) return;
  part->retiring = true;
  retiring_.push_back(part);
}

void ProgressGroup::ReapParts() {
  // Parts are freed only here, between handlers, so no handler holds a freed one.
  for (Part* p : retiring_) {
    std::shared_ptr<TransferState> t = p->transfer;
    parts_.erase(p);
    if (t->parts_alive.fetch_sub(1) == 1) {
      t->engine->ReleaseRegions(t->pinned);
      absl::MutexLock lock(&t->mu);
      t->retired = true;
    }
  }
  retiring_.clear();
}

void ProgressGroup::ScanParts() {
  const absl::Time now = absl::Now();
  CheckStalls(now);
  std::vector<Part*> to_kill;
  for (auto& [p, owned] : parts_) {
    if (p->dead) continue;
    TransferState& t = *p->transfer;
    // The peer stays awake while our WRITEs go (an ended transfer has rung kDone).
    if (!t.finished.load(std::memory_order_acquire)) engine_->Ring(t.peer, now, RingKind::kBusy);
    if (!t.finished.load(std::memory_order_acquire) && now >= t.deadline) {
      t.Finish(
          absl::DeadlineExceededError(absl::StrCat("transfer ", t.id, " passed its deadline")));
    }
    if (t.finished.load(std::memory_order_acquire)) to_kill.push_back(p);
  }
  for (Part* p : to_kill) KillPart(p);
}

bool ProgressGroup::Usable(size_t rail, PeerId peer, absl::Time now) {
  const auto& health = rails_[rail]->health;
  auto it = health.find(peer);
  return it == health.end() || now >= it->second.resting_until;
}

int ProgressGroup::PickRail(PeerId peer, size_t except, absl::Time now) {
  int best = -1;
  uint64_t best_load = 0;
  for (size_t k = 0; k < rails_.size(); ++k) {
    if (k == except || !Usable(k, peer, now)) continue;
    const uint64_t load = rails_[k]->queued_bytes + rails_[k]->in_flight_bytes;
    if (best < 0 || load < best_load) {
      best = static_cast<int>(k);
      best_load = load;
    }
  }
  return best;
}

void ProgressGroup::Place(WriteOp* op, size_t rail) {
  Part& part = *op->part;
  op->rail = rail;
  op->dest = part.dest[rail];
  op->desc = part.src_descs[op->src_region][rail];
  op->key = part.dst_keys[op->dst_region][rail];
  // Its old rail's closing delivery completion no longer covers it.
  op->deliver = true;
  TransferState& t = *part.transfer;
  absl::MutexLock lock(&t.mu);
  t.stats.bytes_per_rail[engine_->EngineRail(index_, rail)] += op->length;
}

void ProgressGroup::Unplace(WriteOp* op, bool failover) {
  TransferState& t = *op->part->transfer;
  const size_t local = op->rail;
  const size_t from = engine_->EngineRail(index_, local);
  op->rail = kNoRail;
  absl::MutexLock lock(&t.mu);
  t.stats.bytes_per_rail[from] -= op->length;
  if (!failover) return;
  Count(rails_[local]->counts.failovers);
  ++t.stats.rerouted_writes;
  t.stats.NoteFailedRail(from);
}

void ProgressGroup::Retarget(WriteOp* op, size_t rail, bool failover) {
  Unplace(op, failover);
  Place(op, rail);
}

void ProgressGroup::RailDown(size_t rail, PeerId peer, const absl::Status& why) {
  RailState& rs = *rails_[rail];
  const absl::Time now = absl::Now();
  PeerHealth& h = rs.health[peer];
  if (now < h.resting_until) return;  // down already
  Count(rs.counts.backoffs);
  h.backoff = h.backoff == absl::ZeroDuration()
                  ? options_.rail_backoff
                  : std::min(2 * h.backoff, options_.rail_backoff_max);
  h.resting_until = now + h.backoff;
  h.why = std::string(why.message());
  spdlog::warn("rail {} ({}) to peer {} rests for {}: {}", engine_->EngineRail(index_, rail),
               rs.rail->rail_info().domain, peer, absl::FormatDuration(h.backoff), h.why);
  // WRITEs that completed at transmit with no delivery completion behind them on this rail:
  // their bytes may still sit in the dead rail's queues. Sent again first, so that the data
  // they reopen is counted before the queued WRITEs moved below can resolve the part's last.
  ResendFrom(rail, peer, [rail](const Part& p, const WriteOp& op) {
    return op.done && !op.failed && op.seq > (rail < p.delivered.size() ? p.delivered[rail] : 0);
  });
  // Its queued WRITEs to the peer go to the other rails, or to another group.
  std::vector<WriteOp*> moving;
  std::erase_if(rs.queue, [&](WriteOp* op) {
    if (op->part->transfer->peer != peer) return false;
    rs.queued_bytes -= op->length;
    moving.push_back(op);
    return true;
  });
  if (PickRail(peer, rail, now) < 0) {
    HandoverQueued(moving);
  } else {
    for (WriteOp* op : moving) Route(op, peer, now);
  }
}

void ProgressGroup::ResendFrom(size_t rail, PeerId peer,
                               absl::FunctionRef<bool(const Part&, const WriteOp&)> pick) {
  std::vector<std::pair<Part*, std::vector<WriteOp*>>> lost;
  for (auto& [p, owned] : parts_) {
    TransferState& t = *p->transfer;
    if (p->dead || t.peer != peer || t.finished.load(std::memory_order_acquire)) continue;
    std::vector<WriteOp*> ops;
    auto take = [&, part = p](WriteOp& op) {
      if (op.rail == rail && op.posted && !op.abandoned && pick(*part, op)) ops.push_back(&op);
    };
    for (WriteOp& op : p->ops) take(op);
    for (size_t i = 0, n = p->resent.size(); i < n; ++i) take(p->resent[i]);
    if (!ops.empty()) lost.emplace_back(p, std::move(ops));
  }
  for (auto& [p, ops] : lost) Resend(p, ops);
}

void ProgressGroup::Resend(Part* part, const std::vector<WriteOp*>& ops) {
  TransferState& t = *part->transfer;
  const absl::Time now = absl::Now();
  std::vector<WriteOp> copies;
  std::vector<bool> data_open;  // the op's data had not resolved: its copy resolves it
  for (WriteOp* op : ops) {
    const bool was_tail = t.tail == op;
    // A posted WRITE that has completed had resolved its data; a stalled or failed one not.
    const bool open = !was_tail && !(op->done && !op->failed);
    op->abandoned = true;
    const int k = PickRail(t.peer, op->rail, now);
    if (k < 0) {
      copies.push_back(*op);
      data_open.push_back(open);
      continue;
    }
    WriteOp& copy = part->resent.emplace_back(*op);
    copy.ctx = {};
    copy.posted = copy.done = copy.failed = copy.abandoned = false;
    Retarget(&copy, static_cast<size_t>(k), /*failover=*/true);
    ++part->unresolved;
    if (!was_tail && !open) ++part->data_unresolved;  // resolved before, its copy must again
    if (was_tail) t.tail = &copy;
    Enqueue(copy.rail, &copy);
  }
  if (copies.empty()) return;
  Handover(part, std::move(copies));
  for (bool open : data_open) {
    if (open) DataResolved(part);  // its copy resolves it elsewhere
  }
}

void ProgressGroup::HandoverQueued(const std::vector<WriteOp*>& ops) {
  // By part: each part's WRITEs go over in one new part; the originals are resolved here.
  absl::flat_hash_map<Part*, std::vector<WriteOp*>> by_part;
  for (WriteOp* op : ops) by_part[op->part].push_back(op);
  for (auto& [part, list] : by_part) {
    std::vector<WriteOp> copies;
    std::vector<bool> tails;
    for (WriteOp* op : list) {
      tails.push_back(part->transfer->tail == op);
      copies.push_back(*op);
    }
    Handover(part, std::move(copies));
    for (bool is_tail : tails) ResolveOp(part, is_tail);
  }
}

void ProgressGroup::Handover(Part* from, std::vector<WriteOp> ops) {
  auto part = std::make_unique<Part>();
  part->transfer = from->transfer;
  TransferState& t = *part->transfer;
  part->ops = std::move(ops);
  for (WriteOp& op : part->ops) {
    op.ctx = {};
    op.part = part.get();
    op.posted = op.done = op.failed = op.abandoned = op.held = false;
    if (op.rail != kNoRail) Unplace(&op, /*failover=*/true);
    if (op.immediate) {
      t.tail = &op;
    } else {
      ++part->data_unresolved;
    }
  }
  part->unresolved = part->ops.size();
  // Counted before `from` resolves what it hands over: the transfer's counts never pass
  // through zero on the way.
  t.parts_alive.fetch_add(1);
  if (part->data_unresolved > 0) t.parts_data_pending.fetch_add(1);
  OfferOn(std::move(part));
}

void ProgressGroup::OfferOn(std::unique_ptr<Part> part) {
  TransferState& t = *part->transfer;
  const auto& groups = engine_->groups_;
  if (part->offered.empty()) part->offered.assign(groups.size(), false);
  part->offered[index_] = true;
  const absl::Time now = absl::Now();
  for (size_t k = 0; k < rails_.size(); ++k) {
    auto h = rails_[k]->health.find(t.peer);
    absl::StrAppend(
        &part->why, part->why.empty() ? "" : "; ", "rail ", engine_->EngineRail(index_, k), " (",
        rails_[k]->rail->rail_info().domain, "): ",
        h != rails_[k]->health.end() && now < h->second.resting_until ? h->second.why : "unusable");
  }
  for (WriteOp& op : part->ops) {
    if (op.rail != kNoRail) Unplace(&op, /*failover=*/true);
  }
  for (size_t k = 1; k < groups.size(); ++k) {
    const size_t g = (index_ + k) % groups.size();
    if (part->offered[g]) continue;
    // A tail part not yet placed is waited on where it goes (QueueTail runs there).
    if (t.tail_part == part.get()) {
      t.tail_group.store(groups[g].get(), std::memory_order_release);
    }
    groups[g]->Run([p = std::move(part)](ProgressGroup& pg) mutable { pg.AddPart(std::move(p)); });
    return;
  }
  // No group has a usable rail to the peer: the transfer fails, and the part retires here.
  t.Finish(absl::UnavailableError(
      absl::StrCat("every rail to peer ", t.peer, " is down (", part->why, ")")));
  Part* p = part.get();
  parts_.emplace(p, std::move(part));
  p->dead = true;
  p->tail_posted = true;
  p->unresolved = 0;
  MaybeRetire(p);
}

void ProgressGroup::CheckStalls(absl::Time now) {
  std::vector<std::pair<size_t, PeerId>> stalled;
  for (size_t k = 0; k < rails_.size(); ++k) {
    for (const auto& [peer, h] : rails_[k]->health) {
      if (h.in_flight > 0 && now >= h.resting_until &&
          now - h.last_progress > options_.rail_stall_timeout) {
        stalled.emplace_back(k, peer);
      }
    }
  }
  for (const auto& [k, peer] : stalled) {
    const absl::Status why = absl::UnavailableError(
        absl::StrCat("no completion for ", absl::FormatDuration(options_.rail_stall_timeout)));
    RailDown(k, peer, why);
    // Its posted WRITEs go again elsewhere; when they complete here after all, nothing changes.
    ResendFrom(k, peer, [](const Part&, const WriteOp& op) { return !op.done; });
  }
  // A rail whose posted WRITEs have all stalled holds the ones queued behind them too: their
  // peers, with nothing posted there that could stall, go down on it as well (RailDown moves
  // their queued WRITEs to the other rails).
  for (size_t k = 0; k < rails_.size(); ++k) {
    RailState& rs = *rails_[k];
    if (rs.queue.empty() || rs.in_flight == 0) continue;
    bool stuck = true;
    for (const auto& [peer, h] : rs.health) {
      if (h.in_flight > 0 && now - h.last_progress <= options_.rail_stall_timeout) stuck = false;
    }
    if (!stuck) continue;
    std::vector<PeerId> behind;
    for (const WriteOp* op : rs.queue) {
      const PeerId peer = op->part->transfer->peer;
      auto h = rs.health.find(peer);
      if ((h == rs.health.end() || h->second.in_flight == 0) &&
          std::find(behind.begin(), behind.end(), peer) == behind.end()) {
        behind.push_back(peer);
      }
    }
    for (PeerId peer : behind) {
      RailDown(k, peer, absl::UnavailableError("queued behind WRITEs to other peers that stalled"));
    }
  }
}

void ProgressGroup::ReleaseAddresses(const std::vector<fi_addr_t>& addrs) {
  for (size_t i = 0; i < rails_.size() && i < addrs.size(); ++i) {
    if (addrs[i] != FI_ADDR_NOTAVAIL) ReleaseAddress(*rails_[i], addrs[i]);
  }
}

void ProgressGroup::FailPeer(PeerId peer, const absl::Status& status) {
  for (auto& rs : rails_) rs->health.erase(peer);
  for (auto& [p, owned] : parts_) {
    if (p->transfer->peer == peer) p->transfer->Finish(status);
  }
  ScanParts();
}

absl::Status ProgressGroup::RegisterRegion(RegionId id, void* addr, size_t length, Device device,
                                           uint64_t access, std::vector<RailMr*>* out) {
  std::vector<RailMr> mrs;
  for (auto& rs : rails_) {
    ASSIGN_OR_RETURN(RailMr mr, rs->rail->Register(addr, length, RandomMrKey(), access, device));
    mrs.push_back(std::move(mr));
  }
  auto& slot = mrs_[id];
  slot = std::move(mrs);
  for (RailMr& mr : slot) out->push_back(&mr);
  return absl::OkStatus();
}

void ProgressGroup::DeregisterRegion(RegionId id) { mrs_.erase(id); }

void ProgressGroup::Shutdown() {
  // Fail what is left; the endpoint's close cancels what is in flight (fi_endpoint(3)).
  for (auto& [p, owned] : parts_) {
    p->transfer->Finish(absl::CancelledError("engine shut down"));
  }
  const absl::Status down = absl::CancelledError("engine shut down");
  for (auto& rs : rails_) {
    for (SendOp& op : rs->sends) {
      if (op.done) op.done->Set(down);
      if (op.callback) std::exchange(op.callback, nullptr)(down);
    }
    for (auto& b : rs->backlog) {
      if (b.done) b.done(down);
    }
    rs->backlog.clear();
  }
  DrainInbox();  // commands that wait on a Completion must not hang
  // MRs close before the endpoints they may be bound to (FI_MR_ENDPOINT; fabtests'
  // ft_close_fids), then each rail closes its endpoint, CQ, AV, domain and fabric.
  mrs_.clear();
  for (auto& rs : rails_) rs->arena_mr.mr.reset();
  rails_.clear();
  if (bell_ != nullptr) bell_->arena_mr.mr.reset();
  bell_.reset();
  parts_.clear();
}

}  // namespace ferry::engine
