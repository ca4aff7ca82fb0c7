// Pulls, the destination's side: sessions with other nodes, requests and their answers, the
// windows a pull writes through, and the staged path's receiving end.
#include <algorithm>
#include <thread>

#include "absl/cleanup/cleanup.h"
#include "absl/random/random.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status.h"
#include "server/node.h"
#include "server/node_internal.h"
#include "spdlog/spdlog.h"
#include "wire/http_status.h"

namespace ferry::server {

// A pull as the destination runs it. Shared by the handle and the transport's answer.
struct PullHandle::State {
  Node* node = nullptr;
  PullSpec spec;
  wire::ObjectPart part;  // of the spec
  std::shared_ptr<Node::Session> session;
  absl::Time start;
  absl::Time deadline;
  PullPath path = PullPath::kRdma;
  bool optimistic = false;  // rdma chosen without asking the source (it may refuse)
  bool forced = false;      // the path was asked for by name
  std::string fallback;     // why the pull left the path it tried first
  std::unique_ptr<Node::PullInFlight> in_flight;
  uint64_t log_id = 0;  // in the node's PullLog
  // Where the bytes go, over this node's regions, one by one; the new buffer of a pull into
  // one. A pull into a layout on the rdma path needs only the layout (spec.into): empty then.
  std::vector<Extent> local;
  uint64_t size = 0;
  std::optional<uint64_t> new_region;
  std::shared_ptr<Node::Prepared> prepared;
  Node::Windows windows;  // opened for this pull; closed at its end
  wire::PullRequest request;
  uint64_t id = 0;  // of the request in flight
  int attempts = 0;
  // The staged path: the ring here, its window, and the thread that copies chunks out of it.
  std::shared_ptr<StagingRing> ring;
  uint64_t ring_window = 0;
  std::thread receiver;
  std::atomic<bool> stop{false};
  absl::Status received;

  absl::Mutex mu;
  // Liveness: while no answer comes, the source is asked about the request now and then
  // (kQuery), so that a source that died, or an answer that was lost, is not waited for until
  // the deadline.
  absl::Time next_probe ABSL_GUARDED_BY(mu) = absl::InfiniteFuture();
  int unknown ABSL_GUARDED_BY(mu) = 0;      // probes in a row that the source did not know it
  bool resent ABSL_GUARDED_BY(mu) = false;  // over HTTP, after the fabric lost it
  // Keeps the rails polled while WRITEs may land (from the request to the answer).
  engine::AwakeToken awake ABSL_GUARDED_BY(mu);
  bool answered ABSL_GUARDED_BY(mu) = false;
  absl::StatusOr<wire::Envelope> answer ABSL_GUARDED_BY(mu) = absl::UnknownError("no answer");
  bool finished ABSL_GUARDED_BY(mu) = false;  // FinishPull has run
  absl::StatusOr<PullStats> result ABSL_GUARDED_BY(mu) = absl::UnknownError("not finished");
  // Serialises FinishPull and Cancel: one thread ends the pull.
  absl::Mutex end_mu;
};

namespace {

bool IsCuda(const Device& d) { return d.is_cuda(); }

// A pull with no answer yet asks its source about it after kFirstProbe, then kProbeEvery after
// each answer; a source that leaves a probe unanswered for kProbeAnswer (over the fabric, then
// HTTP), or does not know the request kUnknownProbes times in a row, fails the pull as
// unavailable.
constexpr absl::Duration kFirstProbe = absl::Milliseconds(250);
constexpr absl::Duration kProbeEvery = absl::Milliseconds(500);
constexpr absl::Duration kProbeAnswer = absl::Seconds(5);
constexpr int kUnknownProbes = 3;

// The error a source answered, or the answer's stats.
absl::StatusOr<PullStats> StatsOf(const absl::StatusOr<wire::Envelope>& answer) {
  if (!answer.ok()) return answer.status();
  if (answer->type == wire::MessageType::kError) {
    absl::Status s;
    RETURN_IF_ERROR(wire::DecodeStatus(answer->body, &s));
    return s;
  }
  if (answer->type != wire::MessageType::kPullDone) {
    return absl::UnavailableError("the source answered a pull with something else");
  }
  PullStats stats;
  RETURN_IF_ERROR(wire::Decode(answer->body, &stats));
  return stats;
}

// A request's type as a metric label. The answers of pulls come when their bytes have landed.
std::string_view RequestName(wire::MessageType type) {
  switch (type) {
    case wire::MessageType::kStat:
      return "stat";
    case wire::MessageType::kPull:
      return "pull";
    case wire::MessageType::kPullBatch:
      return "pull_batch";
    case wire::MessageType::kCancel:
      return "cancel";
    case wire::MessageType::kHello:
      return "hello";
    case wire::MessageType::kQuery:
      return "query";
    default:
      return "other";
  }
}

}  // namespace

void Node::Session::PutLayout(Layout layout, wire::PullRequest& req) {
  if (layout.runs().size() + layout.page_ids().size() < kNamedLayoutWeight) {
    req.layout = std::move(layout);
    return;
  }
  absl::MutexLock lock(&mu);
  auto it = std::find_if(layouts.begin(), layouts.end(),
                         [&](const Named& n) { return n.layout == layout; });
  if (it != layouts.end()) {
    layouts.splice(layouts.begin(), layouts, it);
  } else {
    if (layouts.size() >= kNamedLayouts) layouts.pop_back();
    layouts.push_front({next_layout++, layout, false});
  }
  req.layout_ref = layouts.front().ref;
  req.defines_layout = !layouts.front().known;
  if (req.defines_layout) req.layout = std::move(layout);
}

void Node::Session::LayoutKnown(uint64_t ref, bool known) {
  absl::MutexLock lock(&mu);
  for (Named& n : layouts) {
    if (n.ref == ref) n.known = known;
  }
}

// --- Sessions and calls. ---

absl::StatusOr<std::shared_ptr<Node::Session>> Node::SessionFor(const std::string& url,
                                                                absl::Time deadline) {
  if (!IsHttpUrl(url)) {
    return absl::InvalidArgumentError("\"from\" must be an http://host:port (or https://) URL");
  }
  {
    absl::MutexLock lock(&sessions_mu_);
    auto it = sessions_.find(url);
    if (it != sessions_.end()) return it->second;
  }
  // First contact: who is there, over HTTP; then its rails into the engine.
  auto session = std::make_shared<Session>();
  session->url = url;
  const uint64_t id = next_request_.fetch_add(1);
  auto done = std::make_shared<Waiter>();
  {
    absl::MutexLock lock(&calls_mu_);
    calls_[id] = [done](absl::StatusOr<wire::Envelope> a) { done->Set(std::move(a)); };
  }
  http_->Send(
      PeerRef{url, 0}, auth_.Seal(wire::EncodeEnvelope({wire::MessageType::kHello, id, self_, ""})),
      deadline, [this, id](absl::StatusOr<std::string> sent) { OnSent(id, std::move(sent)); });
  ASSIGN_OR_RETURN(wire::Envelope answer, done->Wait(deadline, [this, id] { Forget(id); }));
  if (answer.type == wire::MessageType::kError) {
    absl::Status s;
    RETURN_IF_ERROR(wire::DecodeStatus(answer.body, &s));
    return absl::Status(s.code(), absl::StrCat("source ", url, ": ", s.message()));
  }
  if (answer.type != wire::MessageType::kHelloAnswer) {
    return absl::UnavailableError(
        absl::StrCat("source ", url, " answered hello with something else"));
  }
  RETURN_IF_ERROR(wire::Decode(answer.body, &session->info));
  session->transport = http_.get();
  if (options_.peer_transport != "http" && !session->info.address.rails.empty()) {
    auto peer = engine_->AddPeer(session->info.address,
                                 std::min(deadline, absl::Now() + absl::Seconds(10)));
    if (peer.ok()) {
      session->peer = *peer;
      session->transport = fabric_.get();
    } else if (options_.peer_transport == "fabric") {
      return absl::UnavailableError(
          absl::StrCat("source ", url, " unreachable over the rails: ", peer.status().message()));
    } else {
      spdlog::warn("source {} ({}) unreachable over the rails, asking it over HTTP: {}", url,
                   session->info.id, peer.status().ToString());
    }
  }
  absl::MutexLock lock(&sessions_mu_);
  auto [it, added] = sessions_.emplace(url, session);
  return it->second;
}

void Node::DropSession(const std::shared_ptr<Session>& session) {
  absl::MutexLock lock(&sessions_mu_);
  auto it = sessions_.find(session->url);
  if (it != sessions_.end() && it->second == session) sessions_.erase(it);
}

void Node::Call(const std::shared_ptr<Session>& session, wire::MessageType type, uint64_t id,
                std::string body, absl::Time deadline,
                std::function<void(absl::StatusOr<wire::Envelope>)> done) {
  {
    absl::MutexLock lock(&calls_mu_);
    calls_[id] = [this, done = std::move(done), node = session->info.id, type,
                  via = session->transport->name(),
                  start = absl::Now()](absl::StatusOr<wire::Envelope> a) {
      if (a.ok() && a->from.node != node) {
        a = absl::UnavailableError(
            absl::StrCat("an answer came from ", a->from.node, " where node ", node, " was asked"));
      }
      if (a.ok()) {
        metrics_.round_trips.Observe({std::string(RequestName(type)), std::string(via)},
                                     absl::ToDoubleSeconds(absl::Now() - start));
      }
      done(std::move(a));
    };
  }
  Transmit(session, auth_.Seal(wire::EncodeEnvelope({type, id, self_, std::move(body)})), deadline,
           [this, id](absl::StatusOr<std::string> sent) { OnSent(id, std::move(sent)); });
}

void Node::Transmit(const std::shared_ptr<Session>& session, std::string sealed,
                    absl::Time deadline, std::function<void(absl::StatusOr<std::string>)> sent) {
  if (session->transport != fabric_.get() || options_.peer_transport != "auto") {
    return session->transport->Send(PeerRef{session->url, session->peer}, std::move(sealed),
                                    deadline, std::move(sent));
  }
  // Over the fabric first; when no rail carries it, over HTTP (the answer then comes in the
  // HTTP response, or over the fabric when the source can reach this node there).
  auto copy = std::make_shared<const std::string>(sealed);
  fabric_->Send(PeerRef{session->url, session->peer}, std::move(sealed), deadline,
                [this, url = session->url, copy, deadline,
                 sent = std::move(sent)](absl::StatusOr<std::string> r) mutable {
                  if (r.ok() || !absl::IsUnavailable(r.status())) return sent(std::move(r));
                  if (stopping_) return sent(absl::UnavailableError("this node is stopping"));
                  http_->Send(PeerRef{url, 0}, *copy, deadline, std::move(sent));
                });
}

void Node::OnSent(uint64_t id, absl::StatusOr<std::string> sent) {
  if (!sent.ok()) return Complete(id, sent.status());
  if (sent->empty()) return;  // the answer comes as a message of its own
  auto answer = OpenAnswer(*sent);
  Complete(id, std::move(answer));
}

absl::StatusOr<wire::Envelope> Node::OpenAnswer(std::string_view sealed) {
  ASSIGN_OR_RETURN(std::string_view opened, auth_.Open(sealed, ""));
  return wire::DecodeEnvelope(opened);
}

void Node::Complete(uint64_t id, absl::StatusOr<wire::Envelope> answer) {
  std::function<void(absl::StatusOr<wire::Envelope>)> done;
  {
    absl::MutexLock lock(&calls_mu_);
    auto it = calls_.find(id);
    if (it == calls_.end()) return;  // late: its caller gave up
    done = std::move(it->second);
    calls_.erase(it);
  }
  done(std::move(answer));
}

void Node::Forget(uint64_t id) {
  absl::MutexLock lock(&calls_mu_);
  calls_.erase(id);
}

absl::StatusOr<wire::Envelope> Node::CallAndWait(const std::shared_ptr<Session>& session,
                                                 wire::MessageType type, std::string body,
                                                 absl::Time deadline) {
  const uint64_t id = next_request_.fetch_add(1);
  auto done = std::make_shared<Waiter>();
  Call(session, type, id, body, deadline,
       [done](absl::StatusOr<wire::Envelope> a) { done->Set(std::move(a)); });
  if (session->transport == fabric_.get() && options_.peer_transport == "auto" &&
      !done->WaitUntil(std::min(deadline, absl::Now() + FabricAnswerTime()))) {
    // No answer over the fabric (the question, or its answer, may have gone into a link that
    // is down): the same question again over HTTP, whose answer comes in its response, and the
    // next messages to the peer over another rail. Only questions (not pulls) go twice; the
    // first answer counts.
    engine_->MoveControlRail(session->peer, FabricAnswerTime());
    http_->Send(PeerRef{session->url, 0},
                auth_.Seal(wire::EncodeEnvelope({type, id, self_, std::move(body)})), deadline,
                [this, id](absl::StatusOr<std::string> sent) { OnSent(id, std::move(sent)); });
  }
  return done->Wait(deadline, [this, id] { Forget(id); });
}

absl::Duration Node::FabricAnswerTime() const {
  return std::max(absl::Seconds(1), 2 * options_.engine.rail_stall_timeout);
}

absl::StatusOr<ObjectInfo> Node::StatAt(const std::shared_ptr<Session>& session,
                                        const std::string& name, std::optional<uint64_t> version,
                                        const wire::ObjectPart& part, absl::Time deadline) {
  auto answer =
      CallAndWait(session, wire::MessageType::kStat,
                  wire::Encode(wire::StatRequest{name, version.value_or(0), part}), deadline);
  if (!answer.ok()) {
    if (absl::IsUnavailable(answer.status())) DropSession(session);
    return absl::Status(answer.status().code(),
                        absl::StrCat("source ", session->url, ": ", answer.status().message()));
  }
  if (answer->type == wire::MessageType::kError) {
    absl::Status s;
    RETURN_IF_ERROR(wire::DecodeStatus(answer->body, &s));
    return WithContext(s, absl::StrCat("source ", session->url));
  }
  ObjectInfo info;
  RETURN_IF_ERROR(wire::Decode(answer->body, &info));
  return info;
}

// --- Windows. ---

absl::StatusOr<Node::Windows> Node::OpenWindows(const Layout& local) {
  // One window per region written into, over the span its pieces cover.
  struct Span {
    uint64_t start = UINT64_MAX, end = 0;
    engine::RegionId engine_id = 0;
    size_t index = 0;
    RegionDescriptor descriptor;  // for memory off the rails
  };
  std::map<uint64_t, Span> spans;
  std::vector<std::pair<uint64_t, uint64_t>> covers;  // each run's (checked before)
  covers.reserve(local.runs().size());
  {
    absl::ReaderMutexLock lock(&mu_);
    for (const Layout::Run& r : local.runs()) {
      auto& [start, end] = covers.emplace_back();
      local.Cover(r, &start, &end);
      Span& s = spans[r.region];
      s.start = std::min(s.start, start);
      s.end = std::max(s.end, end);
    }
    for (auto& [region, s] : spans) {
      auto it = regions_.find(region);
      if (it == regions_.end()) return absl::NotFoundError(absl::StrCat("no region ", region));
      s.engine_id = it->second.engine_id;
      if (s.engine_id == 0) s.descriptor = DescriptorOf(it->second);
    }
  }
  // Every window at once (each progress thread registers them all on its rails).
  std::vector<engine::Engine::WindowSpan> open;
  for (auto& [region, s] : spans) {
    if (s.engine_id != 0) open.push_back({s.engine_id, s.start, s.end - s.start});
  }
  std::vector<engine::Window> opened;
  if (!open.empty()) {
    ASSIGN_OR_RETURN(opened, engine_->OpenWindows(open));
  }
  Windows w;
  size_t next = 0;
  for (auto& [region, s] : spans) {
    s.index = w.descriptors.size();
    if (s.engine_id == 0) {
      // GPU memory the provider cannot register: the same-host path maps it by its IPC handle,
      // the staged path goes through a ring; no window.
      s.start = 0;
      w.descriptors.push_back(std::move(s.descriptor));
      continue;
    }
    w.ids.push_back(opened[next].id);
    w.descriptors.push_back(std::move(opened[next].descriptor));
    ++next;
  }
  // The same runs, in window coordinates: compact forms stay compact.
  const std::vector<uint32_t>& ids = local.page_ids();
  for (size_t i = 0; i < local.runs().size(); ++i) {
    const Layout::Run& r = local.runs()[i];
    const Span& s = spans[r.region];
    switch (r.kind) {
      case Layout::Run::Kind::kExtent:
        w.layout.Add({s.index, r.offset - s.start, r.piece});
        break;
      case Layout::Run::Kind::kStrided:
        w.layout.AddStrided(s.index, r.offset - s.start, r.piece, r.stride, r.count);
        break;
      case Layout::Run::Kind::kPages: {
        // The pool may start before the window: its ids then count from the lowest page.
        const uint64_t low = r.offset >= s.start ? 0 : (covers[i].first - r.offset) / r.piece;
        std::vector<uint32_t> pages(ids.begin() + static_cast<ptrdiff_t>(r.first_page),
                                    ids.begin() + static_cast<ptrdiff_t>(r.first_page + r.count));
        if (low > 0) {
          for (uint32_t& id : pages) id -= static_cast<uint32_t>(low);
        }
        w.layout.AddPages(s.index, r.offset + low * r.piece - s.start, r.piece, pages);
        break;
      }
    }
  }
  return w;
}

void Node::CloseWindows(const std::vector<uint64_t>& ids, bool wait) {
  for (uint64_t id : ids) IgnoreError(engine_->CloseWindow(id, wait));
}

// --- Pulls. ---

absl::StatusOr<PullStats> Node::Pull(const PullSpec& spec) {
  if (spec.from.empty()) return PullByName(spec);
  ASSIGN_OR_RETURN(std::unique_ptr<PullHandle> handle, PullAsync(spec));
  return handle->Wait();
}

absl::StatusOr<std::vector<cluster::Holder>> Node::RankedHolders(const PullSpec& spec) {
  if (!membership_) {
    return absl::InvalidArgumentError(
        "a pull names its source (\"from\") unless the node has a directory (--directory)");
  }
  RETURN_IF_ERROR(metadata::ValidateObjectName(spec.object));
  absl::StatusOr<std::vector<cluster::Holder>> holders =
      membership_->Holders(spec.object, spec.version);
  if (!holders.ok()) {
    return WithContext(holders.status(), absl::StrCat("looking up holders of '", spec.object, "'"));
  }
  std::erase_if(*holders, [this](const cluster::Holder& h) { return h.node == id(); });
  if (holders->empty()) {
    return absl::NotFoundError(
        absl::StrCat("no other node in the directory holds '", spec.object, "'",
                     spec.version ? absl::StrCat(" version ", *spec.version) : ""));
  }
  std::map<std::string, int> busy;  // this node's pulls running, by source
  {
    absl::MutexLock lock(&running_mu_);
    for (const auto& [key, state] : running_) {
      if (auto st = state.lock()) ++busy[st->spec.from];
    }
  }
  const std::string host = HostId();
  absl::BitGen random;
  std::vector<std::tuple<bool, int, uint64_t, size_t>> order;
  for (size_t i = 0; i < holders->size(); ++i) {
    const cluster::Holder& h = (*holders)[i];
    order.emplace_back(h.host != host, busy[h.url], absl::Uniform<uint64_t>(random), i);
  }
  std::sort(order.begin(), order.end());
  std::vector<cluster::Holder> out;
  for (const auto& o : order) out.push_back(std::move((*holders)[std::get<3>(o)]));
  return out;
}

absl::StatusOr<PullSpec> Node::FromBestHolder(const PullSpec& spec) {
  ASSIGN_OR_RETURN(std::vector<cluster::Holder> holders, RankedHolders(spec));
  PullSpec named = spec;
  named.from = holders.front().url;
  named.version = holders.front().version;
  return named;
}

absl::Duration Node::TimeoutOf(const PullSpec& spec) const {
  if (spec.timeout_ms == 0) return options_.pull_timeout;
  return std::min(absl::Milliseconds(
                      static_cast<int64_t>(std::min<uint64_t>(spec.timeout_ms, uint64_t{1} << 40))),
                  options_.max_pull_timeout);
}

absl::StatusOr<PullStats> Node::PullByName(const PullSpec& spec) {
  const absl::Time deadline = absl::Now() + TimeoutOf(spec);
  ASSIGN_OR_RETURN(std::vector<cluster::Holder> holders, RankedHolders(spec));
  std::vector<std::string> tried;
  absl::Status last;
  for (const cluster::Holder& h : holders) {
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      last = absl::DeadlineExceededError("the pull's deadline passed");
      break;
    }
    PullSpec one = spec;
    one.from = h.url;
    one.version = h.version;  // every try takes the same version
    one.timeout_ms = static_cast<uint64_t>(std::max<int64_t>(1, absl::ToInt64Milliseconds(left)));
    absl::StatusOr<PullStats> r = Pull(one);
    if (r.ok()) {
      r->source = h.url;
      r->tried = std::move(tried);
      return r;
    }
    last = r.status();
    // The holder's failures send the pull to the next one; the request's own do not.
    switch (last.code()) {
      case absl::StatusCode::kInvalidArgument:
      case absl::StatusCode::kAlreadyExists:
      case absl::StatusCode::kResourceExhausted:
      case absl::StatusCode::kCancelled:
      case absl::StatusCode::kUnimplemented:
        return last;
      default:
        break;
    }
    tried.push_back(absl::StrCat(h.node, " at ", h.url, ": ", last.message()));
  }
  return absl::Status(
      absl::IsDeadlineExceeded(last) ? last.code() : absl::StatusCode::kUnavailable,
      absl::StrCat("pull of '", spec.object, "' by name: ", tried.size(), " of ", holders.size(),
                   " holder(s) failed: ", absl::StrJoin(tried, "; ")));
}

std::vector<absl::StatusOr<PullStats>> Node::PullBatch(const std::vector<PullSpec>& specs) {
  std::vector<absl::StatusOr<PullStats>> out(specs.size(), absl::UnknownError("not run"));
  std::vector<std::shared_ptr<PullHandle::State>> states(specs.size());
  // Prepared one by one; then one message per source carries its requests.
  std::map<Session*, std::vector<size_t>> by_source;
  for (size_t i = 0; i < specs.size(); ++i) {
    // By name: the best holder of each, as PullAsync takes it.
    absl::StatusOr<PullSpec> named =
        specs[i].from.empty() ? FromBestHolder(specs[i]) : absl::StatusOr<PullSpec>(specs[i]);
    auto state = named.ok() ? PreparePull(*named) : named.status();
    if (!state.ok()) {
      out[i] = state.status();
      continue;
    }
    states[i] = *std::move(state);
    by_source[states[i]->session.get()].push_back(i);
  }
  for (auto& [session, items] : by_source) {
    const std::shared_ptr<Session>& s = states[items.front()]->session;
    if (items.size() == 1 || s->transport != fabric_.get()) {
      // Over HTTP each pull is a request of its own (an HTTP answer carries one answer).
      for (size_t i : items) SendPull(states[i]);
      continue;
    }
    wire::PullBatch batch;
    absl::Time deadline = absl::InfinitePast();
    std::vector<uint64_t> ids;
    for (size_t i : items) {
      states[i]->id = next_request_.fetch_add(1);
      ++states[i]->attempts;
      ids.push_back(states[i]->id);
      batch.requests.emplace_back(states[i]->id, wire::Encode(states[i]->request));
      deadline = std::max(deadline, states[i]->deadline);
      ArmAnswer(states[i]);
    }
    for (size_t i : items) {
      absl::MutexLock lock(&states[i]->mu);
      states[i]->next_probe = absl::Now() + kFirstProbe;
    }
    // The batch has no answer of its own: when it cannot go, each of its pulls fails.
    Transmit(s,
             auth_.Seal(wire::EncodeEnvelope(
                 {wire::MessageType::kPullBatch, 0, self_, wire::Encode(batch)})),
             deadline, [this, ids](absl::StatusOr<std::string> sent) {
               if (sent.ok()) return;
               for (uint64_t id : ids) Complete(id, sent.status());
             });
  }
  for (size_t i = 0; i < specs.size(); ++i) {
    if (!states[i]) continue;
    PullHandle handle(states[i]->id, states[i]);
    out[i] = handle.Wait();
  }
  return out;
}

absl::StatusOr<std::unique_ptr<PullHandle>> Node::PullAsync(const PullSpec& spec) {
  if (spec.from.empty()) {
    // Asynchronous pulls by name take the best holder and stay with it (Pull tries the next).
    ASSIGN_OR_RETURN(PullSpec named, FromBestHolder(spec));
    return PullAsync(named);
  }
  ASSIGN_OR_RETURN(std::shared_ptr<PullHandle::State> state, PreparePull(spec));
  SendPull(state);
  return std::unique_ptr<PullHandle>(new PullHandle(state->id, state));
}

absl::StatusOr<std::shared_ptr<PullHandle::State>> Node::PreparePull(const PullSpec& spec) {
  const absl::Status accepting = Accepting();
  absl::StatusOr<std::shared_ptr<PullHandle::State>> st =
      accepting.ok() ? PreparePullUncounted(spec) : accepting;
  if (!st.ok()) {
    metrics_.PullEnded(metrics_.log.Begin("destination", spec.object, spec.from, "none", 0),
                       "destination", "none", st.status(), 0, 0);
    return st;
  }
  (*st)->log_id = metrics_.log.Begin("destination", spec.object, spec.from,
                                     std::string(PathName((*st)->path)), (*st)->size);
  absl::MutexLock lock(&running_mu_);
  running_[st->get()] = *st;
  return st;
}

void Node::CancelPulls() {
  std::vector<std::shared_ptr<PullHandle::State>> mine;
  {
    absl::MutexLock lock(&running_mu_);
    for (const auto& [key, state] : running_) {
      if (auto st = state.lock()) mine.push_back(std::move(st));
    }
  }
  std::vector<std::string> served;
  {
    absl::MutexLock lock(&served_mu_);
    for (const auto& [key, pull] : served_) served.push_back(key);
  }
  for (const std::string& key : served) {
    const size_t slash = key.rfind('/');
    uint64_t id = 0;
    if (absl::SimpleAtoi(key.substr(slash + 1), &id)) OnCancel(key.substr(0, slash), id);
  }
  for (auto& st : mine) IgnoreError(PullHandle(st->id, st).Cancel().status());
}

absl::StatusOr<std::shared_ptr<PullHandle::State>> Node::PreparePullUncounted(
    const PullSpec& spec) {
  auto st = std::make_shared<PullHandle::State>();
  st->node = this;
  st->spec = spec;
  RETURN_IF_ERROR(metadata::ValidateObjectName(spec.object));
  const int forms =
      (spec.new_buffer ? 1 : 0) + (spec.into.empty() ? 0 : 1) + (spec.prepared != 0 ? 1 : 0);
  if (forms != 1) {
    return absl::InvalidArgumentError(
        "a pull goes into a new buffer, a layout or a prepared destination: name one");
  }
  if (spec.range_length > 0 && !spec.source_extents.empty()) {
    return absl::InvalidArgumentError("a part is a byte range or a list of extents, not both");
  }
  if (spec.source_extents.size() > options_.max_extents) {
    return TooLarge(
        absl::StrCat(spec.source_extents.size(), " extents; the limit is ", options_.max_extents));
  }
  st->part.has_range = spec.range_length > 0;
  st->part.offset = spec.range_offset;
  st->part.length = spec.range_length;
  st->part.extents = spec.source_extents;
  ASSIGN_OR_RETURN(const std::optional<PullPath> forced, ParsePath(spec.path));
  st->forced = forced.has_value();
  st->start = absl::Now();
  st->deadline = st->start + TimeoutOf(spec);
  st->in_flight = std::make_unique<PullInFlight>(this);
  ASSIGN_OR_RETURN(st->session, SessionFor(spec.from, st->deadline));
  std::optional<ObjectInfo> described;
  auto describe = [&]() -> absl::Status {
    if (described) return absl::OkStatus();
    ASSIGN_OR_RETURN(described,
                     StatAt(st->session, spec.object, spec.version, st->part, st->deadline));
    return absl::OkStatus();
  };
  // What a failure from here on leaves behind goes.
  absl::Cleanup undo = [&] { Abandon(*st); };
  if (spec.new_buffer) {
    const std::string target = spec.as.empty() ? spec.object : spec.as;
    RETURN_IF_ERROR(metadata::ValidateObjectName(target));
    if (!spec.replace && catalog_->Get(target).ok()) {
      return absl::AlreadyExistsError(absl::StrCat("object '", target, "' exists here"));
    }
    RETURN_IF_ERROR(describe());
    ASSIGN_OR_RETURN(RegionInfo region, AllocateRegion(*spec.new_buffer, described->size, true));
    st->new_region = region.id;
    st->local = {{region.id, 0, region.size}};
    st->size = region.size;
  } else if (spec.prepared != 0) {
    absl::ReaderMutexLock lock(&mu_);
    auto it = prepared_.find(spec.prepared);
    if (it == prepared_.end()) {
      return absl::NotFoundError(absl::StrCat("no prepared destination ", spec.prepared));
    }
    st->prepared = it->second;
    const std::vector<Extent>& pieces = st->prepared->pieces;
    if (spec.indices.empty()) {
      st->local = pieces;
      st->size = st->prepared->size;
    } else {
      if (spec.indices.size() > options_.max_extents) {
        return TooLarge(
            absl::StrCat(spec.indices.size(), " pieces; the limit is ", options_.max_extents));
      }
      std::vector<bool> taken(pieces.size());
      st->local.reserve(spec.indices.size());
      for (uint32_t i : spec.indices) {
        if (i >= pieces.size()) {
          return absl::InvalidArgumentError(
              absl::StrCat("piece ", i, " of a prepared destination of ", pieces.size()));
        }
        if (taken[i]) return absl::InvalidArgumentError(absl::StrCat("piece ", i, " named twice"));
        taken[i] = true;
        st->local.push_back(pieces[i]);
        st->size += pieces[i].length;
      }
    }
    ++st->prepared->running;
  } else {
    for (const Layout::Run& r : spec.into.runs()) {
      if (r.piece == 0) return absl::InvalidArgumentError("an extent has length 0");
    }
    if (spec.into.pieces() > options_.max_extents) {
      return TooLarge(
          absl::StrCat(spec.into.pieces(), " extents; the limit is ", options_.max_extents));
    }
    absl::ReaderMutexLock lock(&mu_);
    ASSIGN_OR_RETURN(st->size, CheckDestination(spec.into));
  }
  // Into host memory on the rails with no path named (KV-cache pages, say), the pull goes
  // straight to the rdma path without asking first; a source whose object is off the rails
  // refuses (kNotOnRails) and the pull goes again on the staged path.
  bool local_on_rails = true, local_ipc = true, local_host = true;
  {
    std::vector<uint64_t> regions;  // each once
    std::set<uint64_t> seen;
    auto add = [&](uint64_t region) {
      if ((regions.empty() || regions.back() != region) && seen.insert(region).second) {
        regions.push_back(region);
      }
    };
    if (st->local.empty()) {
      for (const Layout::Run& r : spec.into.runs()) add(r.region);
    } else {
      for (const Extent& e : st->local) add(e.region);
    }
    absl::ReaderMutexLock lock(&mu_);
    for (uint64_t region : regions) {
      auto it = regions_.find(region);
      if (it == regions_.end()) return absl::NotFoundError(absl::StrCat("no region ", region));
      const Region& r = it->second;
      local_on_rails = local_on_rails && r.engine_id != 0;
      local_host = local_host && !IsCuda(r.info.device);
      local_ipc = local_ipc && IsCuda(r.info.device) && !r.ipc.handle.empty();
    }
  }
  if (forced) {
    st->path = *forced;
  } else if (!spec.new_buffer && local_on_rails && local_host) {
    st->path = PullPath::kRdma;
    st->optimistic = true;
  } else {
    RETURN_IF_ERROR(describe());
    PathFacts facts;
    facts.same_host = st->session->info.host == HostId();
    facts.cuda_here = engine::CudaDeviceCount() > 0;
    facts.src_on_rails = described->on_rails;
    facts.src_all_gpu = !described->devices.empty() &&
                        std::all_of(described->devices.begin(), described->devices.end(), IsCuda);
    facts.dst_all_ipc = local_ipc;
    facts.dst_on_rails = local_on_rails;
    st->path = ChoosePath(facts);
  }
  RETURN_IF_ERROR(BuildRequest(*st));
  std::move(undo).Cancel();
  return st;
}

absl::Status Node::BuildRequest(PullHandle::State& st) {
  if (st.path != PullPath::kRdma && st.local.empty()) st.local = st.spec.into.Expand();
  wire::PullRequest& req = st.request;
  req = wire::PullRequest();
  req.object = st.spec.object;
  req.version = st.spec.version.value_or(0);
  req.path = static_cast<uint8_t>(st.path);
  req.timeout_ms = static_cast<uint64_t>(
      std::max<int64_t>(1, absl::ToInt64Milliseconds(st.deadline - absl::Now())));
  req.part = st.part;
  switch (st.path) {
    case PullPath::kRdma:
      if (st.prepared && st.spec.indices.size() != st.prepared->pieces.size()) {
        // A prepared destination: the source keeps its windows' descriptors and its pieces.
        const Prepared& p = *st.prepared;
        req.prepared = p.handle;
        req.prepared_epoch = p.epoch.load();
        req.indices = st.spec.indices;
        absl::MutexLock lock(&st.session->mu);
        auto shown = st.session->shown.find(p.handle);
        if (shown == st.session->shown.end() || shown->second != req.prepared_epoch) {
          req.defines_prepared = true;
          req.regions = p.windows.descriptors;
          req.layout = p.windows.layout;
        }
        return absl::OkStatus();
      }
      {
        // The pieces through windows of their own, open for this pull only.
        if (st.prepared) {
          req.regions = st.prepared->windows.descriptors;
          req.layout = st.prepared->windows.layout;
          return absl::OkStatus();
        }
        ASSIGN_OR_RETURN(st.windows,
                         OpenWindows(st.spec.into.empty() ? Layout(st.local) : st.spec.into));
        for (const RegionDescriptor& d : st.windows.descriptors) {
          if (d.keys.empty()) {
            return Conflict(
                "rdma: a destination region is not on the rails here; use the staged path");
          }
        }
        req.regions = st.windows.descriptors;
        st.session->PutLayout(std::move(st.windows.layout), req);
      }
      return absl::OkStatus();
    case PullPath::kCudaIpc: {
      if (st.session->info.host != HostId()) {
        return absl::InvalidArgumentError("cuda_ipc: the source is on another host");
      }
      absl::ReaderMutexLock lock(&mu_);
      std::map<uint64_t, size_t> index;
      std::vector<Extent> extents;
      extents.reserve(st.local.size());
      for (const Extent& e : st.local) {
        auto [slot, added] = index.try_emplace(e.region, index.size());
        if (added) req.regions.push_back(DescriptorOf(regions_.at(e.region)));
        extents.push_back({slot->second, e.offset, e.length});
      }
      req.layout = Layout(extents);
      return absl::OkStatus();
    }
    case PullPath::kStaged: {
      ASSIGN_OR_RETURN(st.ring, staging_->Acquire());
      ASSIGN_OR_RETURN(
          engine::Window w,
          engine_->OpenWindow(st.ring->region(), 0, st.ring->slots() * st.ring->slot_bytes()));
      st.ring_window = w.id;
      req.staged = true;
      req.staging.region = std::move(w.descriptor);
      req.staging.slots = static_cast<uint32_t>(st.ring->slots());
      req.staging.slot_bytes = st.ring->slot_bytes();
      req.staging.tag = (next_tag_.fetch_add(1) & 0xffffff) << 8;
      return absl::OkStatus();
    }
  }
  return absl::InternalError("unknown path");
}

void Node::ArmAnswer(const std::shared_ptr<PullHandle::State>& st) {
  // WRITEs land here until the source answers: keep polling the rails (manual progress).
  if (st->path != PullPath::kCudaIpc) {
    engine::AwakeToken awake = engine_->KeepAwake();
    absl::MutexLock lock(&st->mu);
    st->awake = std::move(awake);
  }
  if (st->path == PullPath::kStaged && !st->receiver.joinable()) {
    st->received = absl::OkStatus();
    st->stop = false;
    st->receiver = std::thread([this, st] {
      st->received = ReceiveStaged(st->local, st->size, *st->ring, st->request.staging.tag,
                                   st->session, st->deadline, &st->stop);
    });
  }
  absl::MutexLock lock(&calls_mu_);
  calls_[st->id] = [this, st, node = st->session->info.id](absl::StatusOr<wire::Envelope> a) {
    if (a.ok() && a->from.node != node) {
      a = absl::UnavailableError(
          absl::StrCat("an answer came from ", a->from.node, " where node ", node, " was asked"));
    }
    OnPullAnswer(st, std::move(a));
  };
}

void Node::SendPull(const std::shared_ptr<PullHandle::State>& st) {
  st->id = next_request_.fetch_add(1);
  ++st->attempts;
  ArmAnswer(st);
  {
    absl::MutexLock lock(&st->mu);
    st->next_probe = absl::Now() + kFirstProbe;
    st->unknown = 0;
    st->resent = false;
  }
  const uint64_t id = st->id;
  Transmit(
      st->session,
      auth_.Seal(
          wire::EncodeEnvelope({wire::MessageType::kPull, id, self_, wire::Encode(st->request)})),
      st->deadline, [this, id](absl::StatusOr<std::string> sent) { OnSent(id, std::move(sent)); });
}

void Node::OnPullAnswer(const std::shared_ptr<PullHandle::State>& st,
                        absl::StatusOr<wire::Envelope> answer) {
  absl::MutexLock lock(&st->mu);
  // The source answers an rdma pull once its WRITEs are delivered: the rails need not spin for
  // them any more, and a spinning progress thread would hold a core the waiting caller needs.
  if (st->path == PullPath::kRdma) st->awake = engine::AwakeToken();
  st->answered = true;
  st->answer = std::move(answer);
}

PullHandle::~PullHandle() { IgnoreError(Wait().status()); }

bool PullHandle::Done() {
  absl::MutexLock lock(&state_->mu);
  return state_->finished || state_->answered;
}

absl::StatusOr<PullStats> PullHandle::Wait(absl::Time deadline) {
  State& st = *state_;
  for (;;) {
    bool probe = false;
    {
      absl::MutexLock lock(&st.mu);
      if (st.finished) return st.result;
      auto ready = [&st]()
                       ABSL_EXCLUSIVE_LOCKS_REQUIRED(st.mu) { return st.answered || st.finished; };
      const absl::Time until = std::min({deadline, st.deadline, st.next_probe});
      if (!st.mu.AwaitWithDeadline(absl::Condition(&ready), until)) {
        const absl::Time now = absl::Now();
        if (now < st.deadline && now >= st.next_probe) {
          probe = true;
        } else if (now < st.deadline) {
          return absl::DeadlineExceededError("the wait passed its deadline; the pull goes on");
        }
      }
      if (st.finished) return st.result;
    }
    if (probe) {
      st.node->Probe(state_);
      continue;
    }
    // The answer came, or the pull's own deadline passed: this thread ends the pull, unless
    // a retry on another path (or with a prepared destination defined again) is due.
    absl::MutexLock end(&st.end_mu);
    {
      absl::MutexLock lock(&st.mu);
      if (st.finished) return st.result;
    }
    if (st.node->RetryPull(state_)) continue;
    return st.node->FinishPull(st, /*cancelled=*/false);
  }
}

absl::StatusOr<PullStats> PullHandle::Cancel() {
  State& st = *state_;
  absl::MutexLock end(&st.end_mu);
  {
    absl::MutexLock lock(&st.mu);
    if (st.finished) return st.result;
  }
  return st.node->FinishPull(st, /*cancelled=*/true);
}

void Node::Probe(const std::shared_ptr<PullHandle::State>& st) {
  uint64_t pull;
  {
    absl::MutexLock lock(&st->mu);
    if (st->answered) return;
    pull = st->id;
  }
  // Answered at once by a live source, over HTTP when the fabric does not carry it.
  auto a = CallAndWait(st->session, wire::MessageType::kQuery, wire::EncodeId(pull),
                       std::min(st->deadline, absl::Now() + kProbeAnswer));
  absl::MutexLock lock(&st->mu);
  st->next_probe = absl::Now() + kProbeEvery;
  if (st->answered || st->id != pull) return;
  if (!a.ok()) {
    st->answered = true;
    st->answer = absl::UnavailableError(
        absl::StrCat("the source stopped answering: ", a.status().message()));
    return;
  }
  switch (a->type) {
    case wire::MessageType::kRunning:
      st->unknown = 0;
      return;
    case wire::MessageType::kUnknownRequest:
      // The request may still be on its way: a few times in a row, it was lost. Over the
      // fabric it goes once more over HTTP (a copy that comes late after all is not served
      // twice), and its answer comes back there.
      if (++st->unknown < kUnknownProbes) return;
      if (!st->resent && st->session->transport == fabric_.get() &&
          options_.peer_transport == "auto") {
        st->resent = true;
        st->unknown = 0;
        http_->Send(PeerRef{st->session->url, 0},
                    auth_.Seal(wire::EncodeEnvelope(
                        {wire::MessageType::kPull, pull, self_, wire::Encode(st->request)})),
                    st->deadline, [this, pull](absl::StatusOr<std::string> sent) {
                      OnSent(pull, std::move(sent));
                    });
        return;
      }
      st->answered = true;
      st->answer = absl::UnavailableError("the source never got the pull request");
      return;
    default:  // the pull's own answer, which did not come (or not yet)
      st->answered = true;
      a->id = pull;
      st->answer = *std::move(a);
  }
}

bool Node::RetryPull(const std::shared_ptr<PullHandle::State>& st) {
  absl::StatusOr<PullStats> stats;
  {
    absl::MutexLock lock(&st->mu);
    if (!st->answered) return false;
    stats = StatsOf(st->answer);
  }
  if (stats.ok() || st->attempts >= 3 || absl::Now() >= st->deadline) return false;
  const absl::Status& s = stats.status();
  const bool aborted = s.code() == absl::StatusCode::kAborted;
  if (st->prepared && aborted && absl::StrContains(s.message(), kStalePrepared)) {
    // The source did not know this epoch of the prepared destination: defined again, once.
    {
      absl::MutexLock lock(&st->session->mu);
      st->session->shown.erase(st->prepared->handle);
    }
  } else if (st->request.layout_ref != 0 && !st->request.defines_layout && aborted &&
             absl::StrContains(s.message(), kStaleLayout)) {
    // The source forgot the layout's number (or never had it): the layout goes again.
    st->session->LayoutKnown(st->request.layout_ref, false);
    StopPull(*st, /*wait=*/true);
  } else if (st->optimistic && absl::StrContains(s.message(), kNotOnRails)) {
    st->optimistic = false;
    StopPull(*st, /*wait=*/true);
    st->path = PullPath::kStaged;
  } else if (st->path == PullPath::kRdma && !st->forced &&
             absl::StrContains(s.message(), kDeviceMemoryFailed)) {
    st->fallback = std::string(s.message());
    spdlog::warn("pull of {} from {}: {}; pulling again on the staged path", st->spec.object,
                 st->session->url, st->fallback);
    StopPull(*st, /*wait=*/true);
    st->path = PullPath::kStaged;
  } else {
    return false;
  }
  {
    absl::MutexLock lock(&st->mu);
    st->answered = false;
  }
  absl::Status built = BuildRequest(*st);
  if (!built.ok()) {
    absl::MutexLock lock(&st->mu);
    st->answered = true;
    st->answer = built;
    return true;
  }
  SendPull(st);
  return true;
}

void Node::StopPull(PullHandle::State& st, bool wait) {
  if (st.receiver.joinable()) {
    st.stop = true;
    st.receiver.join();
  }
  {
    absl::MutexLock lock(&st.mu);
    st.awake = engine::AwakeToken();
  }
  CloseWindows(st.windows.ids, wait);
  st.windows = Windows();
  if (st.ring_window != 0) IgnoreError(engine_->CloseWindow(st.ring_window, wait));
  st.ring_window = 0;
}

absl::StatusOr<PullStats> Node::FinishPull(PullHandle::State& st, bool cancelled) {
  absl::StatusOr<PullStats> stats = absl::UnknownError("");
  bool answered;
  {
    absl::MutexLock lock(&st.mu);
    answered = st.answered;
    if (answered) stats = StatsOf(st.answer);
  }
  if (!answered) {
    // The pull's deadline passed, or it is cancelled: the source is asked to stop, and this
    // node then makes sure no WRITE of it can land (its windows close; a prepared destination
    // takes a new epoch, so its keys change).
    Forget(st.id);
    auto stopped =
        CallAndWait(st.session, wire::MessageType::kCancel, wire::EncodeId(st.id),
                    std::min(st.deadline + absl::Seconds(5), absl::Now() + absl::Seconds(5)));
    const bool confirmed = stopped.ok() && stopped->type == wire::MessageType::kCancelDone;
    if (!confirmed && st.prepared) st.node->RekeyPrepared(st.prepared);
    stats =
        cancelled
            ? absl::CancelledError(absl::StrCat("pull ", st.id, " cancelled"))
            : absl::DeadlineExceededError(absl::StrCat("pull of '", st.spec.object, "' from ",
                                                       st.session->url, " passed its deadline"));
  }
  const bool staged_failed = !stats.ok() && st.ring != nullptr;
  if (st.receiver.joinable()) {
    if (!stats.ok()) st.stop = true;
    st.receiver.join();
    if (stats.ok() && !st.received.ok()) stats = st.received;
  }
  StopPull(st, /*wait=*/!stats.ok());
  if (st.ring != nullptr) {
    if (staged_failed || !stats.ok()) st.ring->Poison();
    st.ring.reset();
  }
  if (stats.ok()) {
    // The source keeps what this request defined: later pulls name it alone.
    if (st.prepared && st.request.defines_prepared) {
      absl::MutexLock lock(&st.session->mu);
      st.session->shown[st.request.prepared] = st.request.prepared_epoch;
    }
    if (st.request.defines_layout) st.session->LayoutKnown(st.request.layout_ref, true);
    stats->via = std::string(st.session->transport->name());
    stats->fallback = st.fallback;
    // Staged bytes are in place only once this side has copied the last chunk in.
    if (st.path == PullPath::kStaged)
      stats->seconds = absl::ToDoubleSeconds(absl::Now() - st.start);
    if (st.new_region) {
      const std::string target = st.spec.as.empty() ? st.spec.object : st.spec.as;
      PublishOptions publish = {
          .replace = st.spec.replace, .durable = st.spec.durable, .announce = st.spec.announce};
      // A replica keeps the source's version number, so that the directory's holders of a
      // version hold the same bytes; not when this node has that version or a later one.
      if (membership_ && st.spec.announce && target == st.spec.object) {
        auto mine = catalog_->Get(target);
        if (!mine.ok() || (*mine)->version < stats->version) {
          publish.version = stats->version;
        } else {
          publish.announce = false;
        }
      }
      auto published = Publish(target, Layout(st.local), publish);
      if (!published.ok()) {
        stats = published.status();
      } else {
        stats->region = st.new_region;
        st.new_region.reset();
      }
    }
  } else {
    if (absl::IsUnavailable(stats.status())) DropSession(st.session);
    stats = WithContext(stats.status(), absl::StrCat("source ", st.session->url));
  }
  Abandon(st);
  {
    absl::MutexLock lock(&running_mu_);
    running_.erase(&st);
  }
  metrics_.PullEnded(st.log_id, "destination", PathName(st.path), stats.status(),
                     stats.ok() ? stats->bytes : 0, absl::ToDoubleSeconds(absl::Now() - st.start));
  absl::MutexLock lock(&st.mu);
  st.finished = true;
  st.result = stats;
  return stats;
}

void Node::Abandon(PullHandle::State& st) {
  if (st.new_region) IgnoreError(DeleteRegion(*st.new_region));
  st.new_region.reset();
  if (st.prepared) {
    --st.prepared->running;
    st.prepared.reset();
  }
  if (!st.windows.ids.empty() || st.ring_window != 0 || st.receiver.joinable()) {
    StopPull(st, /*wait=*/true);
  }
  st.in_flight.reset();
}

void Node::RekeyPrepared(const std::shared_ptr<Prepared>& p) {
  // New windows first, then the old ones close: pulls that start meanwhile send the new epoch.
  auto fresh = OpenWindows(p->layout);
  if (!fresh.ok()) {
    spdlog::error("prepared destination {}: new windows: {}", p->handle, fresh.status().ToString());
    return;
  }
  Windows old;
  {
    absl::MutexLock lock(&mu_);
    old = std::move(p->windows);
    p->windows = *std::move(fresh);
    ++p->epoch;
  }
  CloseWindows(old.ids, /*wait=*/true);
}

absl::Status Node::ReceiveStaged(const std::vector<Extent>& local, uint64_t size, StagingRing& ring,
                                 uint32_t tag, std::shared_ptr<Session> source, absl::Time deadline,
                                 const std::atomic<bool>* stop) {
  std::vector<Span> dst;
  {
    absl::ReaderMutexLock lock(&mu_);
    ASSIGN_OR_RETURN(dst, SpansOf(local));
  }
  const uint64_t slot_bytes = ring.slot_bytes();
  const uint64_t chunks = (size + slot_bytes - 1) / slot_bytes;
  for (uint64_t k = 0; k < chunks; ++k) {
    const size_t slot = k % ring.slots();
    ASSIGN_OR_RETURN(auto landed, engine_->ExpectImmediates(tag + slot, 1));
    while (!landed->Wait(std::min(deadline, absl::Now() + absl::Milliseconds(50))).ok()) {
      if (stop->load()) return absl::CancelledError("staged: the source gave up");
      if (absl::Now() >= deadline) {
        return absl::DeadlineExceededError("staged: a chunk did not arrive in time");
      }
    }
    const uint64_t offset = k * slot_bytes;
    const uint64_t length = std::min(slot_bytes, size - offset);
    {
      absl::ReaderMutexLock lock(&mu_);
      if (!AllRegistered(local)) return Conflict("a destination region went during the pull");
      RETURN_IF_ERROR(RunPieces(
          PairSpans(Slice(dst, offset, length), {{ring.slot(slot), length, Device::Host()}})));
    }
    // The slot is free again: one-way, no answer.
    Transmit(source,
             auth_.Seal(wire::EncodeEnvelope(
                 {wire::MessageType::kCredit, 0, self_, wire::Encode(wire::Credit{tag, k})})),
             deadline, [](absl::StatusOr<std::string>) {});
  }
  return absl::OkStatus();
}

}  // namespace ferry::server
