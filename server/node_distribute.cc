// Distribution: one object version to many nodes in about one pull's time. The node that holds
// it (the coordinator) orders the receivers in a chain and tells each one where it stands; a
// receiver pulls the object chunk by chunk from the node before it, which serves each chunk as
// soon as it has it (Incoming), so every link carries the object once and the chunks flow down
// the chain together. A receiver whose upstream fails or sends a bad chunk takes the rest from
// the node before that one, up to the coordinator.
#include <algorithm>
#include <deque>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/crc32c.h"
#include "base/status.h"
#include "server/node.h"
#include "server/node_internal.h"
#include "spdlog/spdlog.h"
#include "wire/http_status.h"

namespace ferry::server {
namespace {

// Chunks a receiver pulls at once from its upstream: while one lands, the next is on its way.
constexpr size_t kChunksInFlight = 4;
// How often a receiver looks at the deadlines of the pulls waiting for its chunks, and a
// coordinator at its receivers.
constexpr absl::Duration kReceiveTick = absl::Milliseconds(100);
constexpr absl::Duration kCoordinatorTick = absl::Milliseconds(50);
// A receiver that does not answer the coordinator's question within this is taken for dead.
constexpr absl::Duration kReceiverAnswer = absl::Seconds(5);
constexpr uint64_t kMinChunk = uint64_t{1} << 20, kMaxChunk = uint64_t{64} << 20;

uint64_t ChunkBytes(uint64_t size, uint64_t asked) {
  if (asked != 0) return asked;
  return std::clamp<uint64_t>((size / 64 + 4095) / 4096 * 4096, kMinChunk, kMaxChunk);
}

std::string Key(const std::string& object, uint64_t version) {
  return absl::StrCat(object, "@", version);
}

// A string field of a record another node wrote, or empty.
std::string Text(const nlohmann::json& record, const char* key) {
  const auto it = record.find(key);
  return it != record.end() && it->is_string() ? it->get<std::string>() : std::string();
}

// Failures that say the upstream cannot deliver (it is gone, behind for good, or sent bad
// bytes), so that the next one nearer the source may; the rest are this receiver's own.
bool UpstreamFailed(const absl::Status& s) {
  switch (s.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kResourceExhausted:
    case absl::StatusCode::kCancelled:
    case absl::StatusCode::kUnimplemented:
      return false;
    default:
      return true;
  }
}

}  // namespace

// --- Incoming. ---

void Node::Incoming::WhenLanded(uint64_t end, absl::Time deadline, Then then) {
  bool now;
  {
    absl::MutexLock lock(&mu);
    if (!ended_ && landed_ < end) {
      waits_.push_back({end, deadline, std::move(then)});
      return;
    }
    now = landed_ >= end || *ended_;
  }
  then(now);
}

void Node::Incoming::Landed(uint64_t end) {
  std::vector<Then> go;
  {
    absl::MutexLock lock(&mu);
    landed_ = std::max(landed_, end);
    const uint64_t in = landed_;
    go = TakeLocked([in](const Wait& w) { return w.end <= in; });
  }
  for (Then& t : go) t(true);
}

void Node::Incoming::End(bool published) {
  std::vector<Then> go;
  {
    absl::MutexLock lock(&mu);
    ended_ = published;
    go = TakeLocked([](const Wait&) { return true; });
  }
  for (Then& t : go) t(published);
}

void Node::Incoming::Expire(absl::Time now) {
  std::vector<Then> go;
  {
    absl::MutexLock lock(&mu);
    go = TakeLocked([now](const Wait& w) { return w.deadline <= now; });
  }
  for (Then& t : go) t(false);
}

std::vector<Node::Incoming::Then> Node::Incoming::TakeLocked(
    const std::function<bool(const Wait&)>& due) {
  std::vector<Then> out;
  for (auto it = waits_.begin(); it != waits_.end();) {
    if (!due(*it)) {
      ++it;
      continue;
    }
    out.push_back(std::move(it->then));
    it = waits_.erase(it);
  }
  return out;
}

std::shared_ptr<Node::Incoming> Node::FindIncoming(const std::string& object, uint64_t version) {
  absl::MutexLock lock(&incoming_mu_);
  auto it = incoming_.find(Key(object, version));
  return it == incoming_.end() ? nullptr : it->second;
}

std::shared_ptr<const metadata::ObjectRecord> Node::IncomingRecord(const Incoming& in) const {
  auto r = std::make_shared<metadata::ObjectRecord>();
  r->name = in.object;
  r->version = in.version;
  r->size = in.size;
  r->extents = {{in.region, 0, in.size}};
  r->durable = false;
  return r;
}

// --- The coordinator. ---

absl::StatusOr<DistributeResult> Node::Distribute(const DistributeSpec& spec) {
  RETURN_IF_ERROR(Accepting());
  RETURN_IF_ERROR(metadata::ValidateObjectName(spec.object));
  const int forms = (spec.to.empty() ? 0 : 1) + (spec.labels.empty() ? 0 : 1) + (spec.all ? 1 : 0);
  if (forms != 1) {
    return absl::InvalidArgumentError(
        "a distribution goes to listed nodes (\"to\"), to the nodes with some labels, or to all: "
        "name one");
  }
  ASSIGN_OR_RETURN(Device device, Device::Parse(spec.device));
  if (url_.empty()) {
    return absl::FailedPreconditionError("this node does not know the URL other nodes reach it at");
  }
  ASSIGN_OR_RETURN(std::shared_ptr<const metadata::ObjectRecord> object,
                   catalog_->Get(spec.object, spec.version));
  ObjectInfo info;
  {
    absl::ReaderMutexLock lock(&mu_);
    if (!Attached(*object)) {
      return Conflict(absl::StrCat("object '", spec.object, "' is detached"));
    }
    info = View(*object, /*with_extents=*/true);
  }
  std::vector<std::string> to = spec.to;
  if (to.empty()) {
    ASSIGN_OR_RETURN(std::vector<cluster::NodeEntry> nodes, Cluster());
    struct Candidate {
      std::string host, url;
    };
    std::vector<Candidate> found;
    for (const cluster::NodeEntry& n : nodes) {
      const nlohmann::json& r = n.record;
      if (!r.is_object()) continue;
      const std::string node_id = Text(r, "id"), node_url = Text(r, "url");
      if (node_id == id() || node_url.empty()) continue;
      const auto labels = r.find("labels");
      const bool labelled = labels != r.end() && labels->is_object();
      bool match = true;
      for (const auto& [k, v] : spec.labels) {
        match = match && labelled && Text(*labels, k.c_str()) == v;
      }
      if (match) found.push_back({Text(r, "host"), node_url});
    }
    // Nodes of one host next to each other: the link between them is the host's own.
    std::sort(found.begin(), found.end(), [](const Candidate& a, const Candidate& b) {
      return std::tie(a.host, a.url) < std::tie(b.host, b.url);
    });
    for (Candidate& c : found) to.push_back(std::move(c.url));
  }
  for (const std::string& u : to) {
    if (!IsHttpUrl(u)) return absl::InvalidArgumentError(absl::StrCat("not a node's URL: ", u));
    if (u == url_) return absl::InvalidArgumentError("a distribution does not go to its source");
  }
  std::vector<std::string> sorted = to;
  std::sort(sorted.begin(), sorted.end());
  if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end()) {
    return absl::InvalidArgumentError("a receiver is named twice");
  }
  if (to.empty()) return absl::NotFoundError("no node to distribute to");

  const uint64_t chunk = ChunkBytes(object->size, spec.chunk_bytes);
  const uint64_t chunks = (object->size + chunk - 1) / chunk;
  if (chunks > options_.max_extents) {
    return TooLarge(absl::StrCat(chunks, " chunks; the limit is ", options_.max_extents));
  }
  const absl::Time start = absl::Now();
  const absl::Time deadline = start + TimeoutOf(PullSpec{.timeout_ms = spec.timeout_ms});
  std::vector<uint32_t> crcs;
  if (spec.checksum) {
    // Once, here: every receiver checks each chunk against it before it serves or keeps it.
    ASSIGN_OR_RETURN(PinnedStages::Buffer buf, ReadBuffer(info));
    crcs.reserve(chunks);
    for (uint64_t k = 0; k < chunks; ++k) {
      const uint64_t begin = k * chunk, end = std::min(object->size, begin + chunk);
      uint32_t crc = 0;
      for (uint64_t at = begin; at < end; at += PinnedStages::kBytes) {
        const uint64_t n = std::min<uint64_t>(PinnedStages::kBytes, end - at);
        RETURN_IF_ERROR(ReadData(info, at, n, buf.get()));
        crc = Crc32c(crc, buf.get(), n);
      }
      crcs.push_back(crc);
    }
  }
  if (after_checksums_for_testing_) after_checksums_for_testing_();

  DistributeResult result;
  result.object = object->name;
  result.version = object->version;
  result.size = object->size;
  result.chunk_bytes = chunk;
  result.chunks = chunks;
  struct Leg {
    std::shared_ptr<Session> session;
    uint64_t id = 0;
    bool running = false;
  };
  std::vector<Leg> legs(to.size());
  for (size_t i = 0; i < to.size(); ++i) {
    ReceiverResult& rr = result.receivers.emplace_back();
    rr.url = to[i];
    wire::Receive r;
    r.id = next_request_.fetch_add(1);
    r.object = object->name;
    r.version = object->version;
    r.size = object->size;
    r.chunk_bytes = chunk;
    // Upstream: the receivers before this one, nearest first, then this node.
    for (size_t j = i; j-- > 0;) r.upstream.push_back(to[j]);
    r.upstream.push_back(url_);
    r.crc32c = crcs;
    r.device = device.ToString();
    r.timeout_ms = static_cast<uint64_t>(
        std::max<int64_t>(1, absl::ToInt64Milliseconds(deadline - absl::Now())));
    r.durable = spec.durable;
    auto session = SessionFor(to[i], std::min(deadline, absl::Now() + kReceiverAnswer));
    if (!session.ok()) {
      rr.status = session.status();
      continue;
    }
    rr.node = (*session)->info.id;
    auto answer = CallAndWait(*session, wire::MessageType::kReceive, wire::Encode(r),
                              std::min(deadline, absl::Now() + kReceiverAnswer));
    if (!answer.ok()) {
      rr.status = answer.status();
      if (absl::IsUnavailable(answer.status())) DropSession(*session);
      continue;
    }
    if (answer->type == wire::MessageType::kError) {
      absl::Status s;
      RETURN_IF_ERROR(wire::DecodeStatus(answer->body, &s));
      rr.status = s;
      continue;
    }
    legs[i] = {*session, r.id, true};
  }
  // Each receiver says when it is done; one that stops answering is taken for dead (the
  // others route around it by themselves).
  for (;;) {
    bool any = false;
    for (size_t i = 0; i < legs.size(); ++i) {
      Leg& leg = legs[i];
      if (!leg.running) continue;
      ReceiverResult& rr = result.receivers[i];
      auto a = CallAndWait(leg.session, wire::MessageType::kQuery, wire::EncodeId(leg.id),
                           std::min(deadline, absl::Now() + kReceiverAnswer));
      if (a.ok() && a->type == wire::MessageType::kRunning) {
        any = true;
        continue;
      }
      leg.running = false;
      rr.seconds = absl::ToDoubleSeconds(absl::Now() - start);
      if (!a.ok()) {
        rr.status = absl::UnavailableError(
            absl::StrCat("receiver ", rr.url, " stopped answering: ", a.status().message()));
        DropSession(leg.session);
      } else if (a->type == wire::MessageType::kReceiveDone) {
        wire::ReceiveStats stats;
        rr.status = wire::Decode(a->body, &stats);
        rr.bytes = stats.bytes;
        rr.refetched_chunks = stats.refetched;
        rr.skipped = std::move(stats.skipped);
        rr.held_already = stats.held_already;
      } else if (a->type == wire::MessageType::kError) {
        absl::Status s;
        rr.status = wire::DecodeStatus(a->body, &s);
        if (rr.status.ok()) rr.status = s;
      } else {
        rr.status = absl::UnavailableError(
            absl::StrCat("receiver ", rr.url, " lost the receive (it restarted?)"));
      }
    }
    if (!any) break;
    if (absl::Now() >= deadline) {
      for (size_t i = 0; i < legs.size(); ++i) {
        if (!legs[i].running) continue;
        IgnoreError(CallAndWait(legs[i].session, wire::MessageType::kCancel,
                                wire::EncodeId(legs[i].id), absl::Now() + kReceiverAnswer)
                        .status());
        result.receivers[i].status =
            absl::DeadlineExceededError("the distribution passed its deadline");
        result.receivers[i].seconds = absl::ToDoubleSeconds(absl::Now() - start);
      }
      break;
    }
    absl::SleepFor(kCoordinatorTick);
  }
  result.seconds = absl::ToDoubleSeconds(absl::Now() - start);
  return result;
}

// --- A receiver. ---

void Node::ServeReceive(const PeerAddress& from, uint64_t request, wire::Receive r, Reply reply) {
  auto answer = [this, request, &reply](wire::MessageType type, std::string body) {
    if (reply) reply(auth_.Seal(wire::EncodeEnvelope({type, request, self_, std::move(body)})));
  };
  const std::string key = absl::StrCat(from.node, "/", r.id);
  auto refuse = [&](const absl::Status& s) {
    Ended(key, wire::MessageType::kError, wire::Encode(s));
    answer(wire::MessageType::kError, wire::Encode(s));
  };
  absl::Status valid = Accepting();
  if (valid.ok()) valid = metadata::ValidateObjectName(r.object);
  if (valid.ok() && (r.version == 0 || r.size == 0 || r.chunk_bytes == 0 || r.upstream.empty())) {
    valid = absl::InvalidArgumentError("a receive names a version, a size, chunks and upstreams");
  }
  const uint64_t chunks = r.chunk_bytes == 0 ? 0 : (r.size + r.chunk_bytes - 1) / r.chunk_bytes;
  if (valid.ok() &&
      (chunks > options_.max_extents || (!r.crc32c.empty() && r.crc32c.size() != chunks))) {
    valid = absl::InvalidArgumentError(
        absl::StrCat("a receive of ", chunks, " chunks with ", r.crc32c.size(), " checksums"));
  }
  absl::StatusOr<Device> device = valid.ok() ? Device::Parse(r.device) : valid;
  if (!device.ok()) return refuse(device.status());
  {
    // The same receive again (it went over HTTP too when the fabric seemed not to carry it):
    // the first answers.
    absl::MutexLock lock(&served_mu_);
    if (served_.contains(key) || ended_.contains(key)) {
      if (reply) reply(std::string());
      return;
    }
  }
  // Held already (a replica, or this node published it): done.
  if (auto mine = catalog_->Get(r.object); mine.ok() && (*mine)->version >= r.version) {
    wire::ReceiveStats stats;
    stats.held_already = true;
    const std::string body = wire::Encode(stats);
    Ended(key, wire::MessageType::kReceiveDone, body);
    return answer(wire::MessageType::kRunning, "");
  }
  auto in = std::make_shared<Incoming>();
  in->object = r.object;
  in->version = r.version;
  in->size = r.size;
  in->device = *device;
  {
    absl::MutexLock lock(&incoming_mu_);
    if (!incoming_.emplace(Key(r.object, r.version), in).second) {
      return refuse(absl::AlreadyExistsError(
          absl::StrCat("'", r.object, "' version ", r.version, " is being received here")));
    }
  }
  auto served = std::make_shared<ServedPull>();
  {
    absl::MutexLock lock(&served_mu_);
    served_[key] = served;
  }
  auto in_flight = std::make_shared<PullInFlight>(this);
  // Answered at once: the buffer (which may take a while to allocate) comes on the job's thread.
  const bool queued = receive_queue_->Run([this, r = std::move(r), in, served, key, in_flight] {
    const absl::Time start = absl::Now();
    const absl::Time deadline = start + TimeoutOf(PullSpec{.timeout_ms = r.timeout_ms});
    absl::StatusOr<wire::ReceiveStats> stats = absl::UnknownError("not run");
    absl::StatusOr<RegionInfo> region = AllocateRegion(in->device, r.size, /*for_object=*/true);
    if (region.ok()) {
      in->region = region->id;
      stats = RunReceive(r, *in, *served, deadline);
    } else {
      stats = region.status();
    }
    if (stats.ok()) {
      stats->seconds = absl::ToDoubleSeconds(absl::Now() - start);
      // A replica of the version: the directory lists this node as a holder of it.
      auto published =
          Publish(r.object, Layout({{in->region, 0, r.size}}),
                  {.replace = true, .durable = r.durable, .version = r.version}, std::nullopt);
      if (!published.ok()) stats = published.status();
    }
    {
      absl::MutexLock lock(&incoming_mu_);
      incoming_.erase(Key(r.object, r.version));
    }
    in->End(stats.ok());
    if (!stats.ok() && region.ok()) {
      // Freed once the pulls of its chunks that downstream nodes still run let go of it.
      absl::MutexLock lock(&mu_);
      ReleaseLocked({in->region});
    }
    const auto [type, body] =
        stats.ok() ? std::pair(wire::MessageType::kReceiveDone, wire::Encode(*stats))
                   : std::pair(wire::MessageType::kError, wire::Encode(stats.status()));
    Ended(key, type, body);
    {
      absl::MutexLock lock(&served_mu_);
      served_.erase(key);
    }
    if (!stats.ok()) {
      spdlog::warn("receive of {} version {}: {}", r.object, r.version, stats.status().ToString());
    }
  });
  if (!queued) {
    {
      absl::MutexLock lock(&served_mu_);
      served_.erase(key);
    }
    {
      absl::MutexLock lock(&incoming_mu_);
      incoming_.erase(Key(in->object, in->version));
    }
    in->End(false);
    return refuse(absl::UnavailableError("this node is stopping"));
  }
  answer(wire::MessageType::kRunning, "");
}

absl::StatusOr<wire::ReceiveStats> Node::RunReceive(const wire::Receive& r, Incoming& in,
                                                    ServedPull& served, absl::Time deadline) {
  const uint64_t chunk = r.chunk_bytes;
  const uint64_t chunks = (r.size + chunk - 1) / chunk;
  wire::ReceiveStats stats;
  stats.chunks = chunks;
  std::vector<bool> done(chunks, false);
  uint64_t prefix = 0;  // chunks [0, prefix) are in
  size_t up = 0;        // the upstream pulled from now
  struct Flight {
    uint64_t chunk;
    std::unique_ptr<PullHandle> pull;
  };
  std::deque<Flight> flying;
  uint64_t next = 0;
  std::string copy;  // a chunk of device memory, for its checksum
  auto stop_flying = [&] {
    for (Flight& f : flying) IgnoreError(f.pull->Cancel().status());
    stats.refetched += flying.size();
    flying.clear();
  };
  while (prefix < chunks) {
    {
      absl::MutexLock lock(&served.mu);
      if (served.cancelled) {
        stop_flying();
        return absl::CancelledError("the distribution was cancelled");
      }
    }
    const absl::Time now = absl::Now();
    in.Expire(now);
    if (now >= deadline) {
      stop_flying();
      return absl::DeadlineExceededError(
          absl::StrCat("receive of '", r.object, "': ", prefix, " of ", chunks, " chunks in time"));
    }
    while (flying.size() < kChunksInFlight && next < chunks) {
      if (done[next]) {
        ++next;
        continue;
      }
      PullSpec spec;
      spec.from = r.upstream[up];
      spec.object = r.object;
      spec.version = r.version;
      spec.range_offset = next * chunk;
      spec.range_length = std::min(chunk, r.size - spec.range_offset);
      spec.into = Layout({{in.region, spec.range_offset, spec.range_length}});
      spec.timeout_ms = static_cast<uint64_t>(
          std::max<int64_t>(1, absl::ToInt64Milliseconds(deadline - absl::Now())));
      absl::StatusOr<std::unique_ptr<PullHandle>> pull = PullAsync(spec);
      if (!pull.ok()) {
        // Not sent: the upstream could not be reached (first contact), or the request is bad.
        if (!UpstreamFailed(pull.status())) return pull.status();
        stats.skipped.push_back(absl::StrCat(r.upstream[up], ": ", pull.status().message()));
        stop_flying();
        if (++up == r.upstream.size()) {
          return absl::UnavailableError(
              absl::StrCat("receive of '", r.object,
                           "': every upstream failed: ", absl::StrJoin(stats.skipped, "; ")));
        }
        next = prefix;
        continue;
      }
      flying.push_back({next, *std::move(pull)});
      ++next;
    }
    if (flying.empty()) continue;
    Flight& f = flying.front();
    absl::StatusOr<PullStats> got = f.pull->Wait(std::min(deadline, absl::Now() + kReceiveTick));
    if (!got.ok() && absl::IsDeadlineExceeded(got.status()) && !f.pull->Done()) continue;
    const uint64_t k = f.chunk;
    flying.pop_front();
    const uint64_t begin = k * chunk, length = std::min(chunk, r.size - begin);
    if (got.ok() && !r.crc32c.empty()) {
      uint32_t crc = 0;
      if (in.device.is_cuda()) {
        copy.resize(length);
        ObjectInfo view;
        {
          absl::ReaderMutexLock lock(&mu_);
          view = View(*IncomingRecord(in), /*with_extents=*/true);
        }
        absl::Status read = ReadData(view, begin, length, copy.data());
        if (!read.ok()) return read;
        crc = Crc32c(0, copy.data(), length);
      } else {
        absl::ReaderMutexLock lock(&mu_);
        auto it = regions_.find(in.region);
        if (it == regions_.end()) return Conflict("the receive's buffer went during it");
        crc = Crc32c(0, it->second.addr + begin, length);
      }
      if (crc != r.crc32c[k]) {
        got = absl::DataLossError(
            absl::StrCat("chunk ", k, " has CRC32C ", crc, ", not ", r.crc32c[k]));
      }
    }
    if (got.ok()) {
      done[k] = true;
      stats.bytes += length;
      while (prefix < chunks && done[prefix]) ++prefix;
      in.Landed(std::min(r.size, prefix * chunk));
      continue;
    }
    if (!UpstreamFailed(got.status())) {
      stop_flying();
      return got.status();
    }
    // This upstream failed: the rest comes from the next one, nearer the source.
    stats.skipped.push_back(absl::StrCat(r.upstream[up], ": ", got.status().message()));
    stop_flying();
    ++stats.refetched;
    if (++up == r.upstream.size()) {
      return absl::UnavailableError(
          absl::StrCat("receive of '", r.object,
                       "': every upstream failed: ", absl::StrJoin(stats.skipped, "; ")));
    }
    next = prefix;
  }
  return stats;
}

}  // namespace ferry::server
