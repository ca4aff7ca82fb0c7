// The node's private types, shared by node.cc, node_pull.cc and node_serve.cc.
#ifndef FERRY_SERVER_NODE_INTERNAL_H_
#define FERRY_SERVER_NODE_INTERNAL_H_

#include <atomic>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/node.h"
#include "wire/messages.h"

namespace ferry::server {

// How a source says that the destination's prepared destination is unknown to it at that
// epoch (kAborted): the destination sends it again, defined.
inline constexpr char kStalePrepared[] = "prepared destination unknown at this epoch";
// A source's answer to a layout named by a number it does not know (kAborted).
inline constexpr char kStaleLayout[] = "layout unknown";
// Layouts named by number between two nodes (wire::PullRequest::layout_ref): those of at least
// kNamedLayoutWeight runs and page ids (a smaller one costs less to send than to look up). A
// destination keeps the kNamedLayouts it used last with each source, a source twice as many
// of each destination's.
inline constexpr size_t kNamedLayoutWeight = 256;
inline constexpr size_t kNamedLayouts = 8;

// Destination side: what this node knows of another node, from first contact on. A peer that
// restarts has a new id: a failed call drops the session and the next contact makes a new one.
struct Node::Session {
  std::string url;
  wire::NodeSummary info;
  engine::PeerId peer = 0;  // in the engine; 0: not reached over the fabric
  PeerTransport* transport = nullptr;
  absl::Mutex mu;
  std::map<uint64_t, uint64_t> shown ABSL_GUARDED_BY(mu);  // prepared handle -> epoch it knows
  // Puts `layout` (over this pull's windows) into `req`: a large one by its number once the
  // source knows it, with it until then.
  void PutLayout(Layout layout, wire::PullRequest& req);
  // The source has answered a pull that defined layout `ref` (true), or does not know it.
  void LayoutKnown(uint64_t ref, bool known);
  // Layouts named by number with it, the one used last first; `known`: see LayoutKnown.
  struct Named {
    uint64_t ref = 0;
    Layout layout;
    bool known = false;
  };
  std::list<Named> layouts ABSL_GUARDED_BY(mu);
  uint64_t next_layout ABSL_GUARDED_BY(mu) = 1;
};

// Windows a destination opened: one per region it writes into, over the span its pieces
// cover, and the pieces as the source addresses them (region: index into `descriptors`;
// offset: into the window), in the layout's own form. Memory off the rails gets its
// descriptor without keys and no window (the same-host and staged paths reach it).
struct Node::Windows {
  std::vector<uint64_t> ids;
  std::vector<RegionDescriptor> descriptors;
  Layout layout;
};

// A prepared destination: its pieces (in layout order, over this node's regions) and its
// standing windows; a new epoch when they are replaced.
struct Node::Prepared {
  uint64_t handle = 0;
  std::atomic<uint64_t> epoch{1};
  Layout layout;               // as given
  std::vector<Extent> pieces;  // the layout's, one by one
  uint64_t size = 0;
  std::vector<uint64_t> regions;
  Windows windows;  // guarded by Node::mu_ once prepared
  std::atomic<int> running{0};
};

// A pull (or a receive) being served, by "sender/id": its transfer (rdma), to cancel it.
struct Node::ServedPull {
  absl::Mutex mu;
  std::optional<engine::Transfer> transfer ABSL_GUARDED_BY(mu);
  bool cancelled ABSL_GUARDED_BY(mu) = false;
};

// An object version this node is receiving in a distribution, chunk by chunk, into a buffer
// of its own: pulls of its bytes that have landed are served while the rest comes.
// Thread-safe.
struct Node::Incoming {
  std::string object;
  uint64_t version = 0;
  uint64_t size = 0;
  // The buffer, published as the version at the end; 0 until the receive has allocated it
  // (before any byte lands).
  std::atomic<uint64_t> region{0};
  Device device;
  // Called once: with true when bytes [0, end) have landed, false when they never will (the
  // receive failed, or `deadline` passed first).
  using Then = std::function<void(bool landed)>;
  // Runs `then` at once when [0, end) has landed (or the receive failed), else when it does.
  void WhenLanded(uint64_t end, absl::Time deadline, Then then);
  // Bytes [0, end) are in: waiters they cover go. Returns at once.
  void Landed(uint64_t end);
  // The receive is over (failed, or published: the catalog has it then): every waiter goes.
  void End(bool published);
  // Waiters whose deadline passed get false.
  void Expire(absl::Time now);
  uint64_t landed() {
    absl::MutexLock lock(&mu);
    return landed_;
  }

 private:
  struct Wait {
    uint64_t end;
    absl::Time deadline;
    Then then;
  };
  // The waits `due` picks, out of waits_: their callbacks, to call once mu is released.
  std::vector<Then> TakeLocked(const std::function<bool(const Wait&)>& due)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);

  absl::Mutex mu;
  uint64_t landed_ ABSL_GUARDED_BY(mu) = 0;
  std::optional<bool> ended_ ABSL_GUARDED_BY(mu);  // published or not
  std::vector<Wait> waits_ ABSL_GUARDED_BY(mu);
};

// One answer another thread waits for.
class Waiter {
 public:
  void Set(absl::StatusOr<wire::Envelope> answer) {
    absl::MutexLock lock(&mu_);
    if (done_) return;
    done_ = true;
    answer_ = std::move(answer);
  }
  // True once the answer is in; false when `until` passes first (it may come later).
  bool WaitUntil(absl::Time until) {
    absl::MutexLock lock(&mu_);
    auto done = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return done_; };
    return mu_.AwaitWithDeadline(absl::Condition(&done), until);
  }
  // The answer, or kDeadlineExceeded once `deadline` passes (then `on_timeout` runs first).
  absl::StatusOr<wire::Envelope> Wait(absl::Time deadline,
                                      const std::function<void()>& on_timeout) {
    absl::MutexLock lock(&mu_);
    auto done = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return done_; };
    if (!mu_.AwaitWithDeadline(absl::Condition(&done), deadline)) {
      mu_.Unlock();
      on_timeout();
      mu_.Lock();
      if (!done_) return absl::DeadlineExceededError("no answer before the deadline");
    }
    return answer_;
  }

 private:
  absl::Mutex mu_;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  absl::StatusOr<wire::Envelope> answer_ ABSL_GUARDED_BY(mu_) = absl::UnknownError("");
};

}  // namespace ferry::server

#endif  // FERRY_SERVER_NODE_INTERNAL_H_
