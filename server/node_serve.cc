// Pulls, the source's side: messages from other nodes, and the three paths a pull's bytes take
// (rdma, cuda_ipc, staged).
#include <algorithm>
#include <cinttypes>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/ids.h"
#include "base/status.h"
#include "base/version.h"
#include "server/node.h"
#include "server/node_internal.h"
#include "spdlog/spdlog.h"
#include "wire/disjoint.h"
#include "wire/http_status.h"

namespace ferry::server {

// A pull's destination as the source resolved it: descriptors, and extents over them
// (region = index into `regions`).
struct Node::PullTarget {
  std::shared_ptr<const std::vector<RegionDescriptor>> regions;
  std::vector<Extent> extents;
};

// What the source keeps of a node that pulls from it: its engine peer and address, and the
// prepared destinations it defined (by handle), with their epoch.
struct Node::Peer {
  engine::PeerId id = 0;
  PeerAddress address;
  bool stale = false;  // it failed: the next PeerFor makes a fresh one (guarded by served_mu_)
  struct Defined {
    uint64_t epoch = 0;
    std::shared_ptr<const std::vector<RegionDescriptor>> regions;
    std::vector<Extent> pieces;  // over `regions`, disjoint, in the destination's order
  };
  // A layout it names by number (wire::PullRequest::layout_ref): its pieces over the windows
  // of each pull, and how far into each window they reach.
  struct Named {
    std::vector<Extent> pieces;
    std::vector<uint64_t> reach;  // per window, the end of its furthest piece
    uint64_t bytes = 0;
    uint64_t used = 0;  // when last named (a tick of `uses`)
  };
  absl::Mutex mu;
  std::map<uint64_t, Defined> prepared ABSL_GUARDED_BY(mu);
  std::map<uint64_t, Named> layouts ABSL_GUARDED_BY(mu);  // the most recently named kept
  uint64_t uses ABSL_GUARDED_BY(mu) = 0;
};

// An rdma pull being served: what its transfer is made from (again, after a failure).
struct Node::RdmaPull {
  uint64_t id = 0;
  PeerAddress from;
  wire::PullRequest request;
  std::shared_ptr<const metadata::ObjectRecord> object;
  std::shared_ptr<const std::vector<Extent>> source;  // its pieces the pull writes
  uint64_t size = 0;
  absl::Time deadline;
  int attempts = 0;
  int replaced = 0;  // times its peer was found replaced at submission (kPeerReplacedTries)
  bool gpu = false;  // GPU memory at either end
  std::shared_ptr<ServedPull> served;
  std::function<void(absl::StatusOr<PullStats>)> finish;
};

// A pull being served, as ServePullNow takes it up (again, after a wait for its bytes).
struct Node::ServedCall {
  PeerAddress from;
  uint64_t id = 0;
  wire::PullRequest req;
  std::shared_ptr<ServedPull> served;
  std::function<void(absl::StatusOr<PullStats>)> finish;
  absl::Time deadline;
  std::optional<Resolved> resolved;
};

namespace {

bool IsCuda(const Device& d) { return d.is_cuda(); }

// A transfer whose peer was replaced between its lookup and its submission goes to the new one;
// this many times at most (each replacement is another pull's failure to reach the node).
constexpr int kPeerReplacedTries = 3;

// A small rdma pull is served on the progress thread that received it (Node::ServeHere) when
// its request is at most this long and its layouts at most this many pieces: planning more
// would hold up the thread's rails longer than a serving thread's hand-off takes.
constexpr size_t kServeHereBytes = 16 << 10;
constexpr uint64_t kServeHerePieces = 256;

absl::Status Detached(const std::string& object) {
  return Conflict(absl::StrCat("object '", object,
                               "' is detached: its regions are not registered since the node "
                               "restarted"));
}

uint64_t Chunks(uint64_t size, uint64_t chunk) { return (size + chunk - 1) / chunk; }

// The extents (over this node's regions) of `part` of `object`: its own list, not a copy,
// when the part is the whole.
absl::StatusOr<std::shared_ptr<const std::vector<Extent>>> PartOf(
    const std::shared_ptr<const metadata::ObjectRecord>& object, const wire::ObjectPart& part) {
  if (part.whole()) return std::shared_ptr<const std::vector<Extent>>(object, &object->extents);
  const std::vector<Extent>& extents = object->extents;
  const uint64_t size = object->size;
  auto out = std::make_shared<std::vector<Extent>>();
  if (part.has_range) {
    if (part.length == 0 || !InBounds(part.offset, part.length, size)) {
      return absl::OutOfRangeError(absl::StrCat("bytes [", part.offset, ", +", part.length,
                                                ") are not within the object's ", size));
    }
    uint64_t pos = 0, offset = part.offset, length = part.length;
    for (const Extent& e : extents) {
      if (length == 0) break;
      if (offset >= pos + e.length) {
        pos += e.length;
        continue;
      }
      const uint64_t skip = offset - pos;
      const uint64_t n = std::min(e.length - skip, length);
      out->push_back({e.region, e.offset + skip, n});
      offset += n;
      length -= n;
      pos += e.length;
    }
    return out;
  }
  out->reserve(part.extents.size());
  for (uint32_t i : part.extents) {
    if (i >= extents.size()) {
      return absl::OutOfRangeError(
          absl::StrCat("extent ", i, " of an object of ", extents.size(), " extents"));
    }
    out->push_back(extents[i]);
  }
  return out;
}

uint64_t Bytes(const std::vector<Extent>& extents) {
  uint64_t n = 0;
  for (const Extent& e : extents) n += e.length;
  return n;
}

}  // namespace

// --- Messages. ---

void Node::OnControl(std::string_view sender, std::string_view payload) {
  // On a progress thread: answers are handed over at once, requests go to the serving threads.
  auto reply = [this](const PeerAddress& from, bool ring) -> Reply {
    return [this, from, ring](std::string sealed) {
      if (sealed.empty()) return;  // nothing to say (a copy of a request)
      if (auto peer = CachedPeer(from); peer.ok()) {
        return engine_->PostControl(*peer, std::move(sealed), nullptr, ring);
      }
      // Adding a peer waits for it: not on a progress thread, which may be this one.
      serve_queue_->Run([this, from, sealed = std::move(sealed)]() mutable {
        auto peer = PeerFor(from, absl::Now() + FabricAnswerTime());
        if (!peer.ok()) {
          spdlog::warn("cannot answer node {}: {}", from.node, peer.status().ToString());
          return;
        }
        engine_->PostControl(*peer, std::move(sealed));
      });
    };
  };
  auto opened = auth_.Open(payload, sender);
  if (!opened.ok()) {
    spdlog::warn("dropped a message from {}: {}", std::string(sender), opened.status().ToString());
    return;
  }
  auto envelope = wire::DecodeEnvelope(*opened);
  if (!envelope.ok()) {
    spdlog::warn("dropped a message from {}: {}", std::string(sender),
                 envelope.status().ToString());
    return;
  }
  switch (envelope->type) {
    case wire::MessageType::kStatAnswer:
    case wire::MessageType::kPullDone:
    case wire::MessageType::kError:
    case wire::MessageType::kCancelDone:
    case wire::MessageType::kHelloAnswer:
    case wire::MessageType::kRunning:
    case wire::MessageType::kUnknownRequest:
    case wire::MessageType::kReceiveDone:
      return Complete(envelope->id, *std::move(envelope));
    case wire::MessageType::kCredit:  // cheap, and the source waits for it
      return Serve(*std::move(envelope), nullptr);
    default:
      break;
  }
  // The destination of an rdma or staged pull polls its rails until the answer comes: no
  // need to ring its bell for it.
  bool ring = true;
  if (envelope->type == wire::MessageType::kPull) {
    const std::optional<uint8_t> path = wire::PeekPullPath(envelope->body);
    ring = !path || *path == static_cast<uint8_t>(PullPath::kCudaIpc);
  }
  Reply r = reply(envelope->from, ring);
  if (ServeHere(*envelope, r)) return;
  serve_queue_->Run([this, e = *std::move(envelope), r = std::move(r)]() mutable {
    Serve(std::move(e), std::move(r));
  });
}

void Node::HandleMessage(std::string_view sender, std::string sealed, Reply reply) {
  auto opened = auth_.Open(sealed, sender);
  if (!opened.ok()) {
    // A copy of a message that came already (over the fabric first) needs no answer.
    if (absl::StrContains(opened.status().message(), "replayed")) return reply(std::string());
    // An answer it can read needs no seal: the sender learns why, not more.
    return reply(
        wire::EncodeEnvelope({wire::MessageType::kError, 0, self_, wire::Encode(opened.status())}));
  }
  auto envelope = wire::DecodeEnvelope(*opened);
  if (!envelope.ok()) {
    return reply(auth_.Seal(wire::EncodeEnvelope(
        {wire::MessageType::kError, 0, self_, wire::Encode(envelope.status())})));
  }
  Serve(*std::move(envelope), std::move(reply));
}

void Node::Serve(wire::Envelope request, Reply reply) {
  const uint64_t id = request.id;
  auto answer = [this, id, reply](wire::MessageType type, std::string body) {
    if (reply) reply(auth_.Seal(wire::EncodeEnvelope({type, id, self_, std::move(body)})));
  };
  auto fail = [&answer](const absl::Status& s) {
    answer(wire::MessageType::kError, wire::Encode(s));
  };
  switch (request.type) {
    case wire::MessageType::kHello: {
      wire::NodeSummary me{this->id(), kVersion, HostId(), self_, auth_.enabled()};
      return answer(wire::MessageType::kHelloAnswer, wire::Encode(me));
    }
    case wire::MessageType::kStat: {
      wire::StatRequest stat;
      absl::Status s = wire::Decode(request.body, &stat);
      if (!s.ok()) return fail(s);
      auto info = ServeStat(stat);
      if (!info.ok()) return fail(info.status());
      return answer(wire::MessageType::kStatAnswer, wire::Encode(*info));
    }
    case wire::MessageType::kPull: {
      wire::PullRequest pull;
      absl::Status s = wire::Decode(request.body, &pull, options_.max_extents);
      if (!s.ok()) return fail(s);
      return ServePullRequest(request.from, id, std::move(pull), std::move(reply), nullptr);
    }
    case wire::MessageType::kPullBatch: {
      wire::PullBatch batch;
      absl::Status s = wire::Decode(request.body, &batch, options_.max_extents);
      if (!s.ok()) return fail(s);
      for (auto& [item_id, body] : batch.requests) {
        wire::PullRequest pull;
        s = wire::Decode(body, &pull, options_.max_extents);
        if (!s.ok()) {
          if (reply) {
            reply(auth_.Seal(wire::EncodeEnvelope(
                {wire::MessageType::kError, item_id, self_, wire::Encode(s)})));
          }
          continue;
        }
        ServePullRequest(request.from, item_id, std::move(pull), reply, nullptr);
      }
      return;
    }
    case wire::MessageType::kReceive: {
      wire::Receive r;
      absl::Status s = wire::Decode(request.body, &r, options_.max_extents);
      if (!s.ok()) return fail(s);
      return ServeReceive(request.from, id, std::move(r), std::move(reply));
    }
    case wire::MessageType::kCancel: {
      uint64_t target = 0;
      absl::Status s = wire::DecodeId(request.body, &target);
      if (!s.ok()) return fail(s);
      OnCancel(request.from.node, target);
      return answer(wire::MessageType::kCancelDone, wire::EncodeId(target));
    }
    case wire::MessageType::kQuery: {
      uint64_t target = 0;
      absl::Status s = wire::DecodeId(request.body, &target);
      if (!s.ok()) return fail(s);
      const std::string key = absl::StrCat(request.from.node, "/", target);
      std::pair<wire::MessageType, std::string> state = {wire::MessageType::kUnknownRequest, ""};
      {
        absl::MutexLock lock(&served_mu_);
        if (served_.contains(key)) {
          state.first = wire::MessageType::kRunning;
        } else if (auto ended = ended_.find(key); ended != ended_.end()) {
          state = ended->second;
        }
      }
      return answer(state.first, std::move(state.second));
    }
    case wire::MessageType::kCredit: {
      wire::Credit credit;
      if (wire::Decode(request.body, &credit).ok()) OnCredit(request.from.node, credit);
      if (reply) reply(std::string());  // over HTTP: an empty answer
      return;
    }
    default:
      return fail(absl::InvalidArgumentError("not a request"));
  }
}

void Node::ServePullRequest(const PeerAddress& from, uint64_t id, wire::PullRequest pull,
                            Reply reply, const Resolved* resolved) {
  if (Serving(from.node, id)) {
    // A copy (it went over HTTP when the fabric seemed not to carry it): the first answers.
    if (reply) reply(std::string());
    return;
  }
  ServePull(
      from, id, std::move(pull),
      [this, id, reply = std::move(reply),
       key = absl::StrCat(from.node, "/", id)](absl::StatusOr<PullStats> r) {
        auto [type, body] = r.ok() ? std::pair(wire::MessageType::kPullDone, wire::Encode(*r))
                                   : std::pair(wire::MessageType::kError, wire::Encode(r.status()));
        Ended(key, type, body);
        if (reply) reply(auth_.Seal(wire::EncodeEnvelope({type, id, self_, std::move(body)})));
      },
      resolved);
}

bool Node::ServeHere(const wire::Envelope& request, const Reply& reply) {
  // Only what needs no wait: a small rdma pull of an object the catalog has in memory, from a
  // node that is a peer already. The rest goes to the serving threads, which decode it again.
  if (request.type != wire::MessageType::kPull || request.body.size() > kServeHereBytes ||
      stopping_) {
    return false;
  }
  wire::PullRequest pull;
  if (!wire::Decode(request.body, &pull, kServeHerePieces).ok()) return false;
  if (pull.path != static_cast<uint8_t>(PullPath::kRdma) || pull.staged) return false;
  Resolved resolved;
  resolved.object =
      catalog_->Peek(pull.object, pull.version == 0 ? std::nullopt : std::optional(pull.version));
  if (resolved.object == nullptr || resolved.object->extents.size() > kServeHerePieces) {
    return false;
  }
  absl::StatusOr<engine::PeerId> peer = CachedPeer(request.from);
  if (!peer.ok()) return false;
  resolved.peer = *peer;
  ServePullRequest(request.from, request.id, std::move(pull), reply, &resolved);
  return true;
}

void Node::Ended(const std::string& key, wire::MessageType type, const std::string& body) {
  absl::MutexLock lock(&served_mu_);
  if (!ended_.emplace(key, std::pair(type, body)).second) return;
  ended_order_.push_back(key);
  if (ended_order_.size() > kEndedKept) {
    ended_.erase(ended_order_.front());
    ended_order_.pop_front();
  }
}

bool Node::Serving(const std::string& sender, uint64_t id) {
  absl::MutexLock lock(&served_mu_);
  auto it = served_.find(absl::StrCat(sender, "/", id));
  if (it == served_.end()) return false;
  absl::MutexLock l(&it->second->mu);
  return !it->second->cancelled;
}

absl::StatusOr<engine::PeerId> Node::CachedPeer(const PeerAddress& from) {
  absl::MutexLock lock(&served_mu_);
  auto it = peers_.find(from.node);
  if (it == peers_.end() || it->second->stale || !(it->second->address == from)) {
    return absl::NotFoundError("not a peer yet");
  }
  return it->second->id;
}

absl::StatusOr<engine::PeerId> Node::PeerFor(const PeerAddress& from, absl::Time deadline) {
  if (auto cached = CachedPeer(from); cached.ok()) return cached;
  // One node added at a time: two adds of the same node would race with the removal of the
  // stale one.
  absl::MutexLock adding(&peer_add_mu_);
  engine::PeerId old = 0;
  {
    absl::MutexLock lock(&served_mu_);
    auto it = peers_.find(from.node);
    if (it != peers_.end()) {
      if (!it->second->stale && it->second->address == from) return it->second->id;
      // A failed peer, or the node's new incarnation (new rail addresses): a fresh one.
      old = it->second->id;
      peers_.erase(it);
    }
  }
  if (old != 0) IgnoreError(engine_->RemovePeer(old));
  auto id = engine_->AddPeer(from, deadline);
  if (!id.ok()) {
    if (absl::IsInvalidArgument(id.status())) return id.status();
    return absl::UnavailableError(
        absl::StrCat("node ", from.node, " unreachable over the rails: ", id.status().message()));
  }
  auto peer = std::make_shared<Peer>();
  peer->id = *id;
  peer->address = from;
  absl::MutexLock lock(&served_mu_);
  peers_[from.node] = peer;
  return *id;
}

absl::StatusOr<ObjectInfo> Node::ServeStat(const wire::StatRequest& request) {
  auto record = catalog_->Get(request.object,
                              request.version == 0 ? std::nullopt : std::optional(request.version));
  if (absl::IsNotFound(record.status()) && request.version != 0) {
    if (auto in = FindIncoming(request.object, request.version)) record = IncomingRecord(*in);
  }
  RETURN_IF_ERROR(record.status());
  ASSIGN_OR_RETURN(auto part, PartOf(*record, request.part));
  absl::ReaderMutexLock lock(&mu_);
  ObjectInfo info = View(**record, /*with_extents=*/false);
  info.size = Bytes(*part);
  return info;
}

void Node::OnCancel(const std::string& sender, uint64_t id) {
  std::shared_ptr<ServedPull> served;
  {
    absl::MutexLock lock(&served_mu_);
    const std::string key = absl::StrCat(sender, "/", id);
    auto it = served_.find(key);
    if (it == served_.end()) {
      // Not started yet (or over): it must not start after this.
      served = std::make_shared<ServedPull>();
      absl::MutexLock l(&served->mu);
      served->cancelled = true;
      served_.emplace(key, served);
      return;
    }
    served = it->second;
  }
  std::optional<engine::Transfer> transfer;
  {
    absl::MutexLock lock(&served->mu);
    served->cancelled = true;
    transfer = served->transfer;
  }
  if (transfer) {
    transfer->Cancel();
    // Every WRITE it posted has completed before this returns.
    IgnoreError(transfer->WaitRetired(absl::Now() + options_.pull_timeout));
  }
}

void Node::ServePull(const PeerAddress& from, uint64_t id, wire::PullRequest req,
                     std::function<void(absl::StatusOr<PullStats>)> done,
                     const Resolved* resolved) {
  if (absl::Status s = Accepting(); !s.ok()) return done(s);
  const std::string key = absl::StrCat(from.node, "/", id);
  auto served = std::make_shared<ServedPull>();
  bool added = false;
  {
    absl::MutexLock lock(&served_mu_);
    auto it = served_.emplace(key, served);
    added = it.second;
    // A cancel that came first, or the same request twice: either way it does not run.
    if (!added) served_.erase(it.first);
  }
  if (!added) return done(absl::CancelledError(absl::StrCat("pull ", id, " was cancelled")));
  // Counted until its answer goes: buffers of versions dropped meanwhile are freed by then
  // (on a serving thread: the answer may come from a progress thread, which must not wait).
  auto in_flight =
      std::make_shared<std::unique_ptr<PullInFlight>>(std::make_unique<PullInFlight>(this));
  const std::string_view path = req.path <= static_cast<uint8_t>(PullPath::kStaged)
                                    ? PathName(static_cast<PullPath>(req.path))
                                    : "unknown";
  const uint64_t log_id = metrics_.log.Begin("source", req.object, from.node, std::string(path), 0);
  auto finish = [this, key, done = std::move(done), in_flight, path, log_id,
                 start = absl::Now()](absl::StatusOr<PullStats> r) {
    metrics_.PullEnded(log_id, "source", path, r.status(), r.ok() ? r->bytes : 0,
                       absl::ToDoubleSeconds(absl::Now() - start));
    {
      absl::MutexLock lock(&served_mu_);
      served_.erase(key);
    }
    if (!has_unused_.load()) {
      in_flight->reset();
      return done(std::move(r));
    }
    serve_queue_->Run([in_flight, done, r = std::move(r)]() mutable {
      in_flight->reset();
      done(std::move(r));
    });
  };
  const absl::Duration timeout =
      req.timeout_ms == 0 ? options_.pull_timeout
                          : std::min(absl::Milliseconds(static_cast<int64_t>(
                                         std::min<uint64_t>(req.timeout_ms, uint64_t{1} << 40))),
                                     options_.max_pull_timeout);
  auto call = std::make_shared<ServedCall>();
  call->from = from;
  call->id = id;
  call->req = std::move(req);
  call->served = std::move(served);
  call->finish = std::move(finish);
  call->deadline = absl::Now() + timeout;
  if (resolved != nullptr) call->resolved = *resolved;
  absl::Status s = ServePullNow(call);
  if (!s.ok()) call->finish(s);
}

absl::Status Node::ServePullNow(const std::shared_ptr<ServedCall>& call) {
  const PeerAddress& from = call->from;
  wire::PullRequest& req = call->req;
  const std::optional<Resolved>& resolved = call->resolved;
  const auto& finish = call->finish;
  if (req.path > static_cast<uint8_t>(PullPath::kStaged)) {
    return absl::InvalidArgumentError(absl::StrCat("unknown path ", req.path));
  }
  const auto path = static_cast<PullPath>(req.path);
  std::shared_ptr<const metadata::ObjectRecord> object;
  if (resolved) {
    object = resolved->object;
  } else {
    auto got =
        catalog_->Get(req.object, req.version == 0 ? std::nullopt : std::optional(req.version));
    std::shared_ptr<Incoming> in = absl::IsNotFound(got.status()) && req.version != 0
                                       ? FindIncoming(req.object, req.version)
                                       : nullptr;
    if (in != nullptr) {
      // Being received here (a distribution): served once its bytes have landed.
      const uint64_t end = req.part.has_range ? req.part.offset + req.part.length : in->size;
      if (in->landed() < end) {
        in->WhenLanded(end, call->deadline, [this, call](bool landed) {
          const bool queued = serve_queue_->Run([this, call, landed] {
            absl::Status s =
                landed ? ServePullNow(call)
                       : absl::UnavailableError(absl::StrCat("the bytes of '", call->req.object,
                                                             "' did not arrive here in time"));
            if (!s.ok()) call->finish(s);
          });
          if (!queued) call->finish(absl::UnavailableError("this node is stopping"));
        });
        return absl::OkStatus();
      }
      got = IncomingRecord(*in);
    }
    ASSIGN_OR_RETURN(object, got);
  }
  ASSIGN_OR_RETURN(std::shared_ptr<const std::vector<Extent>> source, PartOf(object, req.part));
  const uint64_t size = Bytes(*source);
  if (!resolved) {  // else SubmitRdma checks it (without waiting for mu_)
    absl::ReaderMutexLock lock(&mu_);
    if (!Attached(*object)) return Detached(req.object);
  }
  auto stats_of = [object](PullStats s) {
    s.object = object->name;
    s.version = object->version;
    return s;
  };
  if (path == PullPath::kCudaIpc) {
    ASSIGN_OR_RETURN(PullTarget target, ResolveTarget(from.node, req, size));
    ASSIGN_OR_RETURN(PullStats s, ServeIpc(*object, *source, target));
    finish(stats_of(std::move(s)));
    return absl::OkStatus();
  }
  engine::PeerId peer = 0;
  if (resolved) {
    peer = resolved->peer;
  } else {
    ASSIGN_OR_RETURN(peer, PeerFor(from, call->deadline));
  }
  if (path == PullPath::kStaged) {
    if (!req.staged) return absl::InvalidArgumentError("the staged path needs a staging ring");
    auto s = ServeStaged(*object, *source, peer, req.staging, call->deadline);
    if (absl::IsUnavailable(s.status())) ForgetPeer(from.node, peer);
    RETURN_IF_ERROR(s.status());
    finish(stats_of(*std::move(s)));
    return absl::OkStatus();
  }
  auto rdma = std::make_shared<RdmaPull>();
  rdma->id = call->id;
  rdma->from = from;
  rdma->object = object;
  rdma->source = std::move(source);
  rdma->size = size;
  rdma->deadline = call->deadline;
  rdma->served = call->served;
  rdma->finish = [finish, stats_of](absl::StatusOr<PullStats> r) {
    finish(r.ok() ? absl::StatusOr<PullStats>(stats_of(*std::move(r))) : r.status());
  };
  rdma->request = std::move(req);
  return SubmitRdma(rdma, peer);
}

absl::Status Node::SourceOfLocked(RdmaPull& rdma, engine::TransferRequest& t) {
  if (!Attached(*rdma.object)) {
    return rdma.attempts > 1 ? Conflict("the object's regions went during the pull")
                             : Detached(rdma.object->name);
  }
  t.src.reserve(rdma.source->size());
  rdma.gpu = std::any_of(t.dst_regions.begin(), t.dst_regions.end(),
                         [](const RegionDescriptor& d) { return d.device.is_cuda(); });
  const Region* r = nullptr;  // the region of the extent before
  uint64_t region = 0;
  for (const Extent& e : *rdma.source) {
    if (r == nullptr || region != e.region) {
      r = &regions_.at(e.region);
      region = e.region;
      rdma.gpu = rdma.gpu || r->info.device.is_cuda();
      if (r->engine_id == 0) {
        return Conflict(absl::StrCat("rdma: region ", e.region, " (", r->info.device.ToString(),
                                     ") ", kNotOnRails, "; use the staged path"));
      }
    }
    t.src.push_back({r->engine_id, e.offset, e.length});
  }
  return absl::OkStatus();
}

absl::Status Node::SubmitRdma(const std::shared_ptr<RdmaPull>& rdma, engine::PeerId peer) {
  if (before_submit_for_testing_) before_submit_for_testing_(rdma->from, peer);
  ++rdma->attempts;
  ASSIGN_OR_RETURN(PullTarget target, ResolveTarget(rdma->from.node, rdma->request, rdma->size));
  engine::TransferRequest t;
  t.peer = peer;
  t.deadline = rdma->deadline;
  t.peer_awake = true;  // the destination holds a KeepAwake until the pull's answer
  t.dst_regions = *target.regions;
  t.dst = std::move(target.extents);
  t.on_done = [this, rdma, peer](const absl::StatusOr<engine::TransferStats>& r) {
    if (!r.ok()) {
      if (rdma->gpu && !absl::IsCancelled(r.status()) && !absl::IsDeadlineExceeded(r.status())) {
        return rdma->finish(absl::FailedPreconditionError(
            absl::StrCat("the rdma path ", kDeviceMemoryFailed, " (", r.status().message(),
                         "); use the staged path")));
      }
      if (!absl::IsUnavailable(r.status())) return rdma->finish(r.status());
      ForgetPeer(rdma->from.node, peer);
      // Every rail failed: connections the provider had shut down while a link was away
      // fail the first WRITEs after it is back. Once more, on a fresh peer, unless time is up.
      if (rdma->attempts > 1 || absl::Now() + absl::Seconds(1) > rdma->deadline) {
        return rdma->finish(r.status());
      }
      serve_queue_->Run([this, rdma, first = r.status()] {
        absl::Status again = [&]() -> absl::Status {
          // A fresh peer answers its hellos at once when the links are back; not waited for
          // longer than a question over the fabric is.
          ASSIGN_OR_RETURN(
              engine::PeerId fresh,
              PeerFor(rdma->from, std::min(rdma->deadline, absl::Now() + FabricAnswerTime())));
          return SubmitRdma(rdma, fresh);
        }();
        if (!again.ok()) rdma->finish(first);
      });
      return;
    }
    PullStats s;
    s.bytes = r->bytes;
    s.seconds = r->seconds;
    s.path = std::string(PathName(PullPath::kRdma));
    s.bytes_per_rail = r->bytes_per_rail;
    s.rerouted_writes = r->rerouted_writes;
    s.failed_rails = r->failed_rails;
    s.rail_seconds = r->rail_seconds;
    rdma->finish(std::move(s));
  };
  // On a progress thread (ServeHere) mu_ is not waited for, nor a peer looked up: when either
  // would wait, the submission goes to a serving thread.
  const bool here = engine::OnProgressThread();
  auto elsewhere = [this, rdma, peer]() -> absl::Status {
    const bool queued = serve_queue_->Run([this, rdma, peer] {
      absl::Status s = SubmitRdma(rdma, peer);
      if (!s.ok()) rdma->finish(s);
    });
    if (!queued) return absl::UnavailableError("this node is stopping");
    --rdma->attempts;  // the serving thread's try counts instead
    return absl::OkStatus();
  };
  absl::Status source;
  if (here) {
    if (!mu_.ReaderTryLock()) return elsewhere();
    source = SourceOfLocked(*rdma, t);
    mu_.ReaderUnlock();
  } else {
    absl::ReaderMutexLock lock(&mu_);
    source = SourceOfLocked(*rdma, t);
  }
  RETURN_IF_ERROR(source);
  absl::StatusOr<engine::Transfer> transfer = absl::UnknownError("not submitted");
  {
    absl::MutexLock lock(&rdma->served->mu);
    if (rdma->served->cancelled) {
      return absl::CancelledError(absl::StrCat("pull ", rdma->id, " was cancelled"));
    }
    transfer = engine_->Submit(std::move(t));
    if (transfer.ok()) {
      rdma->served->transfer = *std::move(transfer);
      return absl::OkStatus();
    }
  }
  if (!absl::IsNotFound(transfer.status())) return transfer.status();
  // Another pull of this node found `peer` failed and replaced it since it was looked up: the
  // transfer goes to the peer that replaced it (no new attempt: nothing went to the old one).
  if (++rdma->replaced > kPeerReplacedTries) {
    return absl::UnavailableError(absl::StrCat("node ", rdma->from.node, ": its peer ", peer,
                                               " was replaced: ", transfer.status().message()));
  }
  if (here) {
    --rdma->replaced;  // counted again there
    return elsewhere();
  }
  ASSIGN_OR_RETURN(engine::PeerId fresh, PeerFor(rdma->from, rdma->deadline));
  --rdma->attempts;
  return SubmitRdma(rdma, fresh);
}

void Node::ForgetPeer(const std::string& node, engine::PeerId failed) {
  // The next PeerFor replaces it (its engine peer too) with a fresh one, warmed anew. A failure
  // of a peer already replaced says nothing about its successor, which other pulls may be using.
  absl::MutexLock lock(&served_mu_);
  auto it = peers_.find(node);
  if (it != peers_.end() && it->second->id == failed) it->second->stale = true;
}

absl::StatusOr<Node::PullTarget> Node::ResolveTarget(const std::string& sender,
                                                     const wire::PullRequest& req, uint64_t size) {
  PullTarget t;
  std::shared_ptr<Peer> peer;
  if (req.prepared != 0 || req.layout_ref != 0) {
    absl::MutexLock lock(&served_mu_);
    auto it = peers_.find(sender);
    if (it != peers_.end()) peer = it->second;
  }
  // `extents`: the pieces of `layout`, one by one, walked to name the wrong one.
  auto check = [&](const std::vector<RegionDescriptor>& regions, const std::vector<Extent>& extents,
                   const Layout& layout) -> absl::StatusOr<uint64_t> {
    if (extents.empty()) return absl::InvalidArgumentError("the destination has no pieces");
    const std::optional<uint64_t> total =
        WithinRegions(layout, [&](uint64_t r) -> std::optional<uint64_t> {
          if (r >= regions.size()) return std::nullopt;
          return regions[r].length;
        });
    if (!total) {
      for (const Extent& e : extents) {
        if (e.region >= regions.size()) {
          return absl::InvalidArgumentError(
              absl::StrCat("extent names region ", e.region, " of ", regions.size()));
        }
        if (e.length == 0 || !InBounds(e.offset, e.length, regions[e.region].length)) {
          return absl::InvalidArgumentError(absl::StrCat(
              "destination extent [", e.offset, ", +", e.length,
              ") is empty or outside its region of ", regions[e.region].length, " bytes"));
        }
      }
      return absl::InvalidArgumentError("extents overflow 2^64 bytes");
    }
    if (!Disjoint(layout)) return absl::InvalidArgumentError("destination extents overlap");
    return *total;
  };
  uint64_t total = 0;
  if (req.prepared != 0) {
    if (peer == nullptr) {
      return absl::AbortedError(absl::StrCat(kStalePrepared, " (no session)"));
    }
    absl::MutexLock lock(&peer->mu);
    if (req.defines_prepared) {
      Peer::Defined d;
      d.epoch = req.prepared_epoch;
      d.regions = std::make_shared<const std::vector<RegionDescriptor>>(req.regions);
      d.pieces.reserve(req.layout.pieces());
      req.layout.ForEach([&](const Extent& e) { d.pieces.push_back(e); });
      RETURN_IF_ERROR(check(*d.regions, d.pieces, req.layout).status());
      peer->prepared[req.prepared] = std::move(d);
    }
    auto it = peer->prepared.find(req.prepared);
    if (it == peer->prepared.end() || it->second.epoch != req.prepared_epoch) {
      return absl::AbortedError(kStalePrepared);
    }
    const Peer::Defined& d = it->second;
    t.regions = d.regions;
    if (req.indices.empty()) {
      t.extents = d.pieces;
      for (const Extent& e : d.pieces) total += e.length;
    } else {
      // Pieces of a disjoint list, each at most once: disjoint too.
      std::vector<bool> taken(d.pieces.size());
      t.extents.reserve(req.indices.size());
      for (uint32_t i : req.indices) {
        if (i >= d.pieces.size() || taken[i]) {
          return absl::InvalidArgumentError(absl::StrCat(
              "piece ", i, " of a prepared destination of ", d.pieces.size(), ", or named twice"));
        }
        taken[i] = true;
        t.extents.push_back(d.pieces[i]);
        total += d.pieces[i].length;
      }
    }
  } else if (req.layout_ref != 0 && !req.defines_layout) {
    if (peer == nullptr) return absl::AbortedError(absl::StrCat(kStaleLayout, " (no session)"));
    absl::MutexLock lock(&peer->mu);
    auto it = peer->layouts.find(req.layout_ref);
    if (it == peer->layouts.end()) return absl::AbortedError(kStaleLayout);
    const Peer::Named& named = it->second;
    bool covered = req.regions.size() == named.reach.size();
    for (size_t i = 0; covered && i < named.reach.size(); ++i) {
      covered = named.reach[i] <= req.regions[i].length;
    }
    if (!covered) {
      return absl::InvalidArgumentError(
          absl::StrCat("the windows do not hold layout ", req.layout_ref));
    }
    it->second.used = ++peer->uses;
    t.regions = std::make_shared<const std::vector<RegionDescriptor>>(req.regions);
    t.extents = named.pieces;
    total = named.bytes;
  } else {
    t.regions = std::make_shared<const std::vector<RegionDescriptor>>(req.regions);
    if (req.layout.pieces() > options_.max_extents) {
      return TooLarge(
          absl::StrCat(req.layout.pieces(), " extents; the limit is ", options_.max_extents));
    }
    t.extents.reserve(req.layout.pieces());
    req.layout.ForEach([&](const Extent& e) { t.extents.push_back(e); });
    ASSIGN_OR_RETURN(total, check(*t.regions, t.extents, req.layout));
    if (req.defines_layout && peer != nullptr) {
      Peer::Named named;
      named.pieces = t.extents;
      named.bytes = total;
      named.reach.resize(t.regions->size());
      for (const Layout::Run& r : req.layout.runs()) {
        uint64_t start = 0, end = 0;
        req.layout.Cover(r, &start, &end);  // checked above: no overflow
        named.reach[r.region] = std::max(named.reach[r.region], end);
      }
      absl::MutexLock lock(&peer->mu);
      if (peer->layouts.size() >= 2 * kNamedLayouts && !peer->layouts.contains(req.layout_ref)) {
        peer->layouts.erase(std::min_element(
            peer->layouts.begin(), peer->layouts.end(),
            [](const auto& a, const auto& b) { return a.second.used < b.second.used; }));
      }
      named.used = ++peer->uses;
      peer->layouts[req.layout_ref] = std::move(named);
    }
  }
  if (total != size) {
    return absl::InvalidArgumentError(
        absl::StrCat("destination extents hold ", total, " bytes, the object has ", size));
  }
  return t;
}

absl::StatusOr<PullStats> Node::ServeIpc(const metadata::ObjectRecord& object,
                                         const std::vector<Extent>& source,
                                         const PullTarget& target) {
  const std::vector<RegionDescriptor>& regions = *target.regions;
  for (size_t i = 0; i < regions.size(); ++i) {
    const RegionDescriptor& d = regions[i];
    if (!IsCuda(d.device) || d.ipc_handle.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("cuda_ipc: destination region ", i,
                                                     " is not GPU memory with an IPC handle"));
    }
    if (d.host != HostId()) {
      return absl::InvalidArgumentError("cuda_ipc: the destination is on another host");
    }
  }
  // The reader lock keeps the source regions while the kernel runs.
  absl::ReaderMutexLock lock(&mu_);
  if (!Attached(object)) return Conflict("the object's regions went during the pull");
  ASSIGN_OR_RETURN(std::vector<Span> src, SpansOf(source));
  const Device gpu = src.front().device;
  for (const Span& s : src) {
    if (!(s.device == gpu) || !IsCuda(gpu)) {
      return absl::InvalidArgumentError("cuda_ipc: the object must live on one GPU");
    }
  }
  // The kernel runs on the destination's GPU, writing locally and reading the source over
  // NVLink (pulling is faster than pushing there); big pieces go to the copy engines.
  const std::string& dst_uuid = regions.front().ipc_gpu;
  for (const RegionDescriptor& d : regions) {
    if (d.ipc_gpu != dst_uuid) {
      return absl::InvalidArgumentError("cuda_ipc: the destination must be on one GPU");
    }
  }
  ASSIGN_OR_RETURN(const int dst_gpu, engine::CudaDeviceByUuid(dst_uuid));
  RETURN_IF_ERROR(engine::CudaEnablePeerAccess(dst_gpu, gpu.index));
  const absl::Time start = absl::Now();
  std::vector<engine::CudaMapping> maps;
  for (const RegionDescriptor& d : regions) {
    ASSIGN_OR_RETURN(engine::CudaMapping m, ipc_cache_.Open(d.ipc_handle, dst_gpu));
    if (!InBounds(d.ipc_offset, d.length, m.size)) {
      return absl::InvalidArgumentError(absl::StrCat("cuda_ipc: region [", d.ipc_offset, ", +",
                                                     d.length, ") is outside its allocation of ",
                                                     m.size, " bytes"));
    }
    maps.push_back(std::move(m));
  }
  // Pieces go to the GPU in batches as they are paired: the pairing overlaps the copying, and
  // the destination's spans are made as the walk reaches them.
  auto dst_at = [&](size_t i) {
    const Extent& e = target.extents[i];
    const RegionDescriptor& d = regions[e.region];
    return Span{maps[e.region].base.get() + d.ipc_offset + e.offset, e.length, d.device};
  };
  const uint64_t size = Bytes(source);
  ASSIGN_OR_RETURN(engine::CudaCopyBatch batch,
                   engine::CudaCopyBatch::Begin(
                       dst_gpu, engine::CopyChunksBound(target.extents.size() + src.size(), size)));
  absl::Status added;
  WalkPairs(target.extents.size(), dst_at, src,
            [&](const Span&, char* dp, const Span&, char* sp, uint64_t n) {
              if (!added.ok()) return;
              added = batch.Add(reinterpret_cast<uint64_t>(dp), reinterpret_cast<uint64_t>(sp), n);
            });
  RETURN_IF_ERROR(added);
  RETURN_IF_ERROR(batch.Finish());
  PullStats stats;
  stats.bytes = size;
  stats.seconds = absl::ToDoubleSeconds(absl::Now() - start);
  stats.path = std::string(PathName(PullPath::kCudaIpc));
  return stats;
}

absl::StatusOr<PullStats> Node::ServeStaged(const metadata::ObjectRecord& object,
                                            const std::vector<Extent>& source, engine::PeerId peer,
                                            const wire::StagingRing& staging, absl::Time deadline) {
  const uint64_t slots = staging.slots, slot_bytes = staging.slot_bytes, tag = staging.tag;
  if (slots == 0 || slots > 256 || slot_bytes < 4096 || slot_bytes > options_.staging_slot_bytes ||
      tag + slots > (uint64_t{1} << 32) || staging.region.length / slots < slot_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("staging: want 1 to 256 slots of 4096 to ", options_.staging_slot_bytes,
                     " bytes inside the ring region, and tag + slots below 2^32"));
  }
  ASSIGN_OR_RETURN(std::shared_ptr<StagingRing> ring, staging_->Acquire());
  const std::string key = absl::StrCat(staging.region.node, "/", tag);
  auto credits = std::make_shared<Credits>();
  {
    absl::MutexLock lock(&credits->mu);
    credits->freed.assign(slots, -1);
  }
  {
    absl::MutexLock lock(&credits_mu_);
    if (!credits_.emplace(key, credits).second) {
      return absl::InvalidArgumentError(absl::StrCat("staging tag ", tag, " is in use"));
    }
  }
  absl::Cleanup forget = [&] {
    absl::MutexLock lock(&credits_mu_);
    credits_.erase(key);
  };
  std::vector<Span> src;
  {
    absl::ReaderMutexLock lock(&mu_);
    ASSIGN_OR_RETURN(src, SpansOf(source));
  }
  const uint64_t size = Bytes(source);
  const absl::Time start = absl::Now();
  const uint64_t chunks = Chunks(size, slot_bytes);
  std::vector<std::optional<engine::Transfer>> in_flight(ring->slots());
  engine::TransferStats moved;
  auto retire = [&](std::optional<engine::Transfer>& t) -> absl::Status {
    if (!t) return absl::OkStatus();
    ASSIGN_OR_RETURN(engine::TransferStats s, t->Wait());
    t.reset();
    moved.Add(s);
    return absl::OkStatus();
  };
  absl::Status status;
  for (uint64_t k = 0; k < chunks && status.ok(); ++k) {
    const size_t mine = k % ring->slots();
    const uint64_t theirs = k % slots;
    status = retire(in_flight[mine]);
    if (!status.ok()) break;
    if (k >= slots) {
      const int64_t need = static_cast<int64_t>(k - slots);
      absl::MutexLock lock(&credits->mu);
      auto freed = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(credits->mu) {
        return credits->freed[theirs] >= need;
      };
      if (!credits->mu.AwaitWithDeadline(absl::Condition(&freed), deadline)) {
        status = absl::DeadlineExceededError("staged: the destination did not free a slot in time");
        break;
      }
    }
    const uint64_t offset = k * slot_bytes;
    const uint64_t length = std::min(slot_bytes, size - offset);
    {
      absl::ReaderMutexLock lock(&mu_);
      if (!Attached(object)) {
        status = Conflict("the object's regions went during the pull");
        break;
      }
      status = RunPieces(
          PairSpans({{ring->slot(mine), length, Device::Host()}}, Slice(src, offset, length)));
      if (!status.ok()) break;
    }
    engine::TransferRequest t;
    t.peer = peer;
    t.deadline = deadline;
    t.src = {{ring->region(), mine * ring->slot_bytes(), length}};
    t.dst_regions = {staging.region};
    t.dst = {{0, theirs * slot_bytes, length}};
    t.immediate = tag + theirs;
    auto submitted = engine_->Submit(std::move(t));
    if (!submitted.ok()) {
      status = submitted.status();
      break;
    }
    in_flight[mine] = std::move(*submitted);
  }
  for (auto& t : in_flight) {
    absl::Status s = retire(t);
    if (status.ok()) status = s;
  }
  if (!status.ok()) {
    ring->Poison();
    return status;
  }
  PullStats stats;
  stats.bytes = moved.bytes;
  stats.seconds = absl::ToDoubleSeconds(absl::Now() - start);
  stats.path = std::string(PathName(PullPath::kStaged));
  stats.bytes_per_rail = moved.bytes_per_rail;
  stats.rerouted_writes = moved.rerouted_writes;
  stats.failed_rails = moved.failed_rails;
  return stats;
}

void Node::OnCredit(std::string_view sender, const wire::Credit& credit) {
  std::shared_ptr<Credits> credits;
  {
    absl::MutexLock lock(&credits_mu_);
    auto it = credits_.find(absl::StrCat(std::string(sender), "/", credit.tag));
    if (it == credits_.end()) return;
    credits = it->second;
  }
  absl::MutexLock lock(&credits->mu);
  int64_t& freed = credits->freed[credit.chunk % credits->freed.size()];
  freed = std::max(freed, static_cast<int64_t>(credit.chunk));
}

}  // namespace ferry::server
