// Pulls: the source side (ServePull and the three paths) and the destination side (Pull).
#include <httplib.h>

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <thread>

#include "wire/extents.h"
#include "base/hex.h"
#include "base/ids.h"
#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "engine/fabric.h"
#include "base/status.h"
#include "wire/http_status.h"
#include "server/node.h"

namespace ferry::server {
namespace {

constexpr size_t kMaxPeerRails = 64;
constexpr char kCreditPrefix[] = "ferry.credit ";

bool IsCuda(const Device& d) { return d.kind == Device::Kind::kCuda; }

uint64_t Chunks(uint64_t size, uint64_t chunk) { return (size + chunk - 1) / chunk; }

// A request's extents: "extents_raw" (from a kExtentsContentType body), "extents_b64" or
// "extents" (JSON); empty when it has none.
absl::StatusOr<std::vector<Extent>> RequestExtents(const nlohmann::json& req) {
  if (auto raw = req.find("extents_raw"); raw != req.end()) {
    if (!raw->is_string()) return absl::InvalidArgumentError("\"extents_raw\" must be a string");
    return UnpackRawExtents(raw->get_ref<const std::string&>());
  }
  if (auto b64 = req.find("extents_b64"); b64 != req.end()) {
    if (!b64->is_string()) return absl::InvalidArgumentError("\"extents_b64\" must be a string");
    return UnpackExtents(b64->get<std::string>());
  }
  if (auto extents = req.find("extents"); extents != req.end()) return ExtentsFromJson(*extents);
  return std::vector<Extent>{};
}

}  // namespace

absl::StatusOr<engine::PeerId> Node::PeerFor(const nlohmann::json& request,
                                             absl::Time deadline) {
  auto node = request.find("node");
  auto rails = request.find("rails");
  if (node == request.end() || !node->is_string() || node->get<std::string>().empty() ||
      node->get<std::string>().size() > 256) {
    return absl::InvalidArgumentError("\"node\" must be a node id (1 to 256 characters)");
  }
  if (rails == request.end() || !rails->is_array() || rails->empty() ||
      rails->size() > kMaxPeerRails) {
    return absl::InvalidArgumentError("\"rails\" must be an array of 1 to 64 addresses");
  }
  engine::PeerAddress address{node->get<std::string>(), {}, {}};
  for (const auto& r : *rails) {
    if (!r.is_string()) return absl::InvalidArgumentError("a rail address must be a hex string");
    ASSIGN_OR_RETURN(std::string raw, HexDecode(r.get<std::string>()));
    address.rails.push_back(std::move(raw));
  }
  if (auto bell = request.find("bell"); bell != request.end()) {
    if (!bell->is_string()) return absl::InvalidArgumentError("\"bell\" must be a hex string");
    ASSIGN_OR_RETURN(address.bell, HexDecode(bell->get<std::string>()));
  }
  auto peer = engine_->AddPeer(address, deadline);
  if (!peer.ok() && peer.status().code() != absl::StatusCode::kInvalidArgument) {
    return absl::UnavailableError(absl::StrCat("node ", address.node,
                                               " unreachable: ", peer.status().message()));
  }
  return peer;
}

absl::StatusOr<Node::PullTarget> Node::ParsePullTarget(const nlohmann::json& req,
                                                       uint64_t size) const {
  auto regions = req.find("regions");
  if (regions == req.end() || !regions->is_array() || regions->empty()) {
    return absl::InvalidArgumentError("\"regions\" must be a non-empty array of descriptors");
  }
  ASSIGN_OR_RETURN(std::vector<Extent> parsed, RequestExtents(req));
  if (parsed.empty()) {
    return absl::InvalidArgumentError("\"extents\" (or \"extents_b64\") must be non-empty");
  }
  if (parsed.size() > options_.max_extents || regions->size() > options_.max_extents) {
    return TooLarge(absl::StrCat(parsed.size(), " extents; the limit is ", options_.max_extents));
  }
  PullTarget t;
  for (const auto& d : *regions) {
    ASSIGN_OR_RETURN(RegionDescriptor desc, RegionDescriptorFromJson(d));
    t.regions.push_back(std::move(desc));
  }
  struct Abs {
    uint64_t start, end;
  };
  std::vector<Abs> spans;
  uint64_t total = 0;
  // Here an extent's "region" is an index into "regions".
  for (const auto& [region, offset, length] : parsed) {
    if (region >= t.regions.size()) {
      return absl::InvalidArgumentError(absl::StrCat("extent names region ", region, " of ",
                                                     t.regions.size()));
    }
    if (length == 0) return absl::InvalidArgumentError("an extent has length 0");
    const RegionDescriptor& d = t.regions[region];
    if (!InBounds(offset, length, d.length)) {
      return absl::InvalidArgumentError(absl::StrCat("destination extent [", offset, ", +",
                                                     length, ") is outside its region of ",
                                                     d.length, " bytes"));
    }
    if (total + length < total) return absl::InvalidArgumentError("extents overflow 2^64 bytes");
    total += length;
    spans.push_back({d.addr + offset, d.addr + offset + length});
    t.extents.push_back({region, offset, length});
  }
  std::sort(spans.begin(), spans.end(), [](const Abs& a, const Abs& b) { return a.start < b.start; });
  for (size_t i = 1; i < spans.size(); ++i) {
    if (spans[i].start < spans[i - 1].end) {
      return absl::InvalidArgumentError("destination extents overlap");
    }
  }
  if (total != size) {
    return absl::InvalidArgumentError(
        absl::StrCat("destination extents hold ", total, " bytes, the object has ", size));
  }
  return t;
}

absl::StatusOr<PullStats> Node::ServePull(const std::string& name, const nlohmann::json& req) {
  if (!req.is_object()) return absl::InvalidArgumentError("pull request must be an object");
  std::optional<uint64_t> version;
  if (req.contains("version")) {
    ASSIGN_OR_RETURN(version, UnsignedField(req, "version"));
  }
  absl::Duration timeout = options_.pull_timeout;
  if (req.contains("timeout_ms")) {
    ASSIGN_OR_RETURN(uint64_t ms, UnsignedField(req, "timeout_ms"));
    timeout = absl::Milliseconds(static_cast<int64_t>(std::min<uint64_t>(ms, 86400000)));
  }
  const absl::Time deadline = absl::Now() + timeout;
  PullPath path = PullPath::kRdma;
  if (req.contains("path")) {
    if (!req["path"].is_string()) return absl::InvalidArgumentError("\"path\" must be a string");
    ASSIGN_OR_RETURN(std::optional<PullPath> named, ParsePath(req["path"].get<std::string>()));
    if (!named) return absl::InvalidArgumentError("the destination names the path, not auto");
    path = *named;
  }
  ASSIGN_OR_RETURN(metadata::ObjectRecord object, catalog_->Get(name, version));
  ASSIGN_OR_RETURN(PullTarget target, ParsePullTarget(req, object.size));
  {
    absl::ReaderMutexLock lock(&mu_);
    if (!Attached(object)) {
      return Conflict(absl::StrCat("object '", name, "' is detached: its regions are not "
                                   "registered since the node restarted"));
    }
  }
  PullInFlight in_flight(this);
  if (path == PullPath::kCudaIpc) return ServeIpc(object, target);
  if (path == PullPath::kStaged && !req.contains("staging")) {
    return absl::InvalidArgumentError("the staged path needs a \"staging\" ring");
  }
  ASSIGN_OR_RETURN(engine::PeerId peer, PeerFor(req, deadline));
  absl::StatusOr<PullStats> stats =
      path == PullPath::kRdma ? ServeRdma(object, std::move(target), peer, deadline)
                              : ServeStaged(object, target, peer, req["staging"], deadline);
  if (stats.status().code() == absl::StatusCode::kUnavailable) {
    IgnoreError(engine_->RemovePeer(peer));  // the next pull warms a fresh connection
  }
  return stats;
}

absl::StatusOr<PullStats> Node::ServeRdma(const metadata::ObjectRecord& object, PullTarget target,
                                          engine::PeerId peer, absl::Time deadline) {
  engine::TransferRequest t;
  t.peer = peer;
  t.deadline = deadline;
  t.dst_regions = std::move(target.regions);
  t.dst = std::move(target.extents);
  absl::StatusOr<engine::Transfer> transfer = absl::UnknownError("");
  {
    absl::MutexLock lock(&mu_);
    if (!Attached(object)) return Conflict("the object's regions went during the pull");
    for (const Extent& e : object.extents) {
      const Region& r = regions_.at(e.region);
      if (r.engine_id == 0) {
        return Conflict(absl::StrCat("rdma: region ", e.region, " (", r.info.device.ToString(),
                                     ") ", kNotOnRails, "; use the staged path"));
      }
      t.src.push_back({r.engine_id, e.offset, e.length});
    }
    transfer = engine_->Submit(std::move(t));
  }
  RETURN_IF_ERROR(transfer.status());
  ASSIGN_OR_RETURN(engine::TransferStats stats, transfer->Wait());
  return PullStats{object.name,          object.version,        stats.bytes,
                   stats.seconds,        stats.bytes_per_rail,  stats.rerouted_writes,
                   stats.failed_rails,   std::string(PathName(PullPath::kRdma)),
                   std::nullopt,         stats.rail_seconds};
}

absl::StatusOr<PullStats> Node::ServeIpc(const metadata::ObjectRecord& object,
                                         const PullTarget& target) {
  for (size_t i = 0; i < target.regions.size(); ++i) {
    const RegionDescriptor& d = target.regions[i];
    if (!IsCuda(d.device) || d.ipc_handle.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("cuda_ipc: destination region ", i, " is not GPU memory with an IPC handle"));
    }
    if (d.host != HostId()) {
      return absl::InvalidArgumentError("cuda_ipc: the destination is on another host");
    }
  }
  // The reader lock keeps the source regions while the kernel runs.
  absl::ReaderMutexLock lock(&mu_);
  if (!Attached(object)) return Conflict("the object's regions went during the pull");
  ASSIGN_OR_RETURN(std::vector<Span> src, SpansOf(object.extents));
  const Device gpu = src.front().device;
  for (const Span& s : src) {
    if (!(s.device == gpu) || !IsCuda(gpu)) {
      return absl::InvalidArgumentError("cuda_ipc: the object must live on one GPU");
    }
  }
  // The kernel runs on the destination's GPU, writing locally and reading the source over
  // NVLink (pulling is faster than pushing there); big pieces go to the copy engines. The
  // relay through the copy engines (CudaCopyBatch::Begin's src_device) waits until it has
  // been measured on two GPUs (ferry-bench gpu's batched_copy_relayed row).
  const std::string& dst_uuid = target.regions.front().ipc_gpu;
  for (const RegionDescriptor& d : target.regions) {
    if (d.ipc_gpu != dst_uuid) {
      return absl::InvalidArgumentError("cuda_ipc: the destination must be on one GPU");
    }
  }
  ASSIGN_OR_RETURN(const int dst_gpu, engine::CudaDeviceByUuid(dst_uuid));
  RETURN_IF_ERROR(engine::CudaEnablePeerAccess(dst_gpu, gpu.index));
  const absl::Time start = absl::Now();
  std::vector<engine::CudaMapping> maps;
  for (const RegionDescriptor& d : target.regions) {
    ASSIGN_OR_RETURN(engine::CudaMapping m, ipc_cache_.Open(d.ipc_handle, dst_gpu));
    if (!InBounds(d.ipc_offset, d.length, m.size)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "cuda_ipc: region [", d.ipc_offset, ", +", d.length, ") is outside its allocation of ",
          m.size, " bytes"));
    }
    maps.push_back(std::move(m));
  }
  // Pieces go to the GPU in batches as they are paired: the pairing overlaps the copying, and
  // the destination's spans are made as the walk reaches them (a list of 16384 built first
  // kept the GPU waiting 60-90 us).
  auto dst_at = [&](size_t i) {
    const Extent& e = target.extents[i];
    const RegionDescriptor& d = target.regions[e.region];
    return Span{maps[e.region].base.get() + d.ipc_offset + e.offset, e.length, d.device};
  };
  ASSIGN_OR_RETURN(engine::CudaCopyBatch batch,
                   engine::CudaCopyBatch::Begin(
                       dst_gpu, engine::CopyChunksBound(target.extents.size() + src.size(),
                                                        object.size)));
  absl::Status added;
  WalkPairs(target.extents.size(), dst_at, src,
            [&](const Span&, char* dp, const Span&, char* sp, uint64_t n) {
              if (!added.ok()) return;
              added = batch.Add(reinterpret_cast<uint64_t>(dp), reinterpret_cast<uint64_t>(sp), n);
            });
  RETURN_IF_ERROR(added);
  RETURN_IF_ERROR(batch.Finish());
  return PullStats{object.name, object.version, object.size,
                   absl::ToDoubleSeconds(absl::Now() - start), {}, 0, {},
                   std::string(PathName(PullPath::kCudaIpc)), std::nullopt};
}

absl::StatusOr<PullStats> Node::ServeStaged(const metadata::ObjectRecord& object,
                                            const PullTarget& target, engine::PeerId peer,
                                            const nlohmann::json& staging, absl::Time deadline) {
  if (!staging.is_object() || !staging.contains("region")) {
    return absl::InvalidArgumentError("\"staging\" wants region, slots, slot_bytes and tag");
  }
  ASSIGN_OR_RETURN(RegionDescriptor ring_desc,
                   RegionDescriptorFromJson(staging["region"]));
  ASSIGN_OR_RETURN(uint64_t slots, UnsignedField(staging, "slots"));
  ASSIGN_OR_RETURN(uint64_t slot_bytes, UnsignedField(staging, "slot_bytes"));
  ASSIGN_OR_RETURN(uint64_t tag, UnsignedField(staging, "tag"));
  if (slots == 0 || slots > 256 || slot_bytes < 4096 ||
      slot_bytes > options_.staging_slot_bytes || tag + slots > (uint64_t{1} << 32) ||
      ring_desc.length / slots < slot_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "staging: want 1 to 256 slots of 4096 to ", options_.staging_slot_bytes,
        " bytes inside the ring region, and tag + slots below 2^32"));
  }
  ASSIGN_OR_RETURN(std::shared_ptr<StagingRing> ring, staging_->Acquire());
  const std::string key = absl::StrCat(target.regions.front().node, "/", tag);
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
    ASSIGN_OR_RETURN(src, SpansOf(object.extents));
  }
  const absl::Time start = absl::Now();
  const uint64_t chunks = Chunks(object.size, slot_bytes);
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
    const uint64_t length = std::min(slot_bytes, object.size - offset);
    {
      absl::ReaderMutexLock lock(&mu_);
      if (!Attached(object)) {
        status = Conflict("the object's regions went during the pull");
        break;
      }
      status = RunPieces(PairSpans({{ring->slot(mine), length, Device::Host()}},
                                   Slice(src, offset, length)));
      if (!status.ok()) break;
    }
    engine::TransferRequest t;
    t.peer = peer;
    t.deadline = deadline;
    t.src = {{ring->region(), mine * ring->slot_bytes(), length}};
    t.dst_regions = {ring_desc};
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
  return PullStats{object.name,         object.version,
                   moved.bytes,         absl::ToDoubleSeconds(absl::Now() - start),
                   moved.bytes_per_rail, moved.rerouted_writes,
                   moved.failed_rails,  std::string(PathName(PullPath::kStaged)),
                   std::nullopt};
}

void Node::OnControl(std::string_view sender, std::string_view payload) {
  if (!payload.starts_with(kCreditPrefix)) return;
  const std::string rest(payload.substr(sizeof(kCreditPrefix) - 1));
  uint64_t tag = 0, chunk = 0;
  char extra = 0;
  if (std::sscanf(rest.c_str(), "%" SCNu64 " %" SCNu64 "%c", &tag, &chunk, &extra) != 2) return;
  std::shared_ptr<Credits> credits;
  {
    absl::MutexLock lock(&credits_mu_);
    auto it = credits_.find(absl::StrCat(std::string(sender), "/", tag));
    if (it == credits_.end()) return;
    credits = it->second;
  }
  absl::MutexLock lock(&credits->mu);
  int64_t& freed = credits->freed[chunk % credits->freed.size()];
  freed = std::max(freed, static_cast<int64_t>(chunk));
}

absl::Status Node::ReceiveStaged(const std::vector<Extent>& local, uint64_t size,
                                 StagingRing& ring, uint32_t tag, engine::PeerId source,
                                 absl::Time deadline, const std::atomic<bool>* stop) {
  std::vector<Span> dst;
  {
    absl::ReaderMutexLock lock(&mu_);
    ASSIGN_OR_RETURN(dst, SpansOf(local));
  }
  const uint64_t slot_bytes = ring.slot_bytes();
  const uint64_t chunks = Chunks(size, slot_bytes);
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
      RETURN_IF_ERROR(RunPieces(PairSpans(Slice(dst, offset, length),
                                          {{ring.slot(slot), length, Device::Host()}})));
    }
    RETURN_IF_ERROR(engine_->SendControl(source, absl::StrCat(kCreditPrefix, tag, " ", k),
                                         deadline));
  }
  return absl::OkStatus();
}

absl::StatusOr<PullStats> Node::Pull(const std::string& from, const std::string& name,
                                     std::optional<uint64_t> version, const nlohmann::json& into,
                                     const std::string& as, bool replace,
                                     std::optional<PullPath> path) {
  RETURN_IF_ERROR(metadata::ValidateObjectName(name));
  if (from.rfind("http://", 0) != 0) {
    return absl::InvalidArgumentError("\"from\" must be an http://host:port URL");
  }
  if (!into.is_object()) return absl::InvalidArgumentError("\"into\" must be an object");
  PullInFlight in_flight(this);
  const absl::Time deadline = absl::Now() + options_.pull_timeout;
  httplib::Client client(from);
  client.set_connection_timeout(5);
  client.set_read_timeout(static_cast<time_t>(absl::ToInt64Seconds(options_.pull_timeout)) + 10);
  httplib::Headers headers;
  if (!options_.peer_token.empty()) {
    headers.emplace("Authorization", "Bearer " + options_.peer_token);
  }
  auto get_json = [&](const std::string& target) -> absl::StatusOr<nlohmann::json> {
    auto got = client.Get(target.c_str(), headers);
    RETURN_IF_ERROR(StatusFromResult(got, "source " + from));
    auto parsed = ParseJson(got->body);
    nlohmann::json j = parsed.ok() ? std::move(*parsed) : nlohmann::json();
    if (!j.is_object()) {
      return absl::UnavailableError(absl::StrCat("source ", from, " answered ", target,
                                                 " with something that is not a JSON object"));
    }
    return j;
  };
  const std::string object_path = "/v1/objects/" + EncodeName(name);
  // What the source is (host, rails) and what the object is (size, devices, on the rails).
  nlohmann::json source = nlohmann::json::object(), described = nlohmann::json::object();
  uint64_t size = 0;
  auto ask_source = [&]() -> absl::Status {
    ASSIGN_OR_RETURN(source, get_json("/v1/node"));
    ASSIGN_OR_RETURN(described, get_json(object_path + "?extents=false" +
                                         (version ? absl::StrCat("&version=", *version) : "")));
    if (!described.contains("size") || !described["size"].is_number_unsigned()) {
      return absl::UnavailableError("source answered without an object size");
    }
    size = described["size"].get<uint64_t>();
    return absl::OkStatus();
  };
  std::vector<Extent> local;
  std::optional<uint64_t> new_region;
  const std::string target = as.empty() ? name : as;
  if (into.contains("device")) {
    if (!into["device"].is_string()) return absl::InvalidArgumentError("\"device\" must be a string");
    ASSIGN_OR_RETURN(Device device, Device::Parse(into["device"].get<std::string>()));
    RETURN_IF_ERROR(metadata::ValidateObjectName(target));
    if (!replace && catalog_->Get(target).ok()) {
      return absl::AlreadyExistsError(absl::StrCat("object '", target, "' exists here"));
    }
    RETURN_IF_ERROR(ask_source());
    ASSIGN_OR_RETURN(RegionInfo region, AllocateRegion(device, size, true));
    new_region = region.id;
    local.push_back({region.id, 0, region.size});
  } else if (into.contains("extents") || into.contains("extents_b64") ||
             into.contains("extents_raw")) {
    ASSIGN_OR_RETURN(local, RequestExtents(into));
    if (local.size() > options_.max_extents) {
      return TooLarge(absl::StrCat(local.size(), " extents; the limit is ", options_.max_extents));
    }
    if (local.empty()) return absl::InvalidArgumentError("\"extents\" is empty");
  } else {
    return absl::InvalidArgumentError("\"into\" needs \"device\", \"extents\" or \"extents_b64\"");
  }
  // Into host extents on the rails with no path named (KV-cache pages, say), the pull goes
  // straight to the rdma path: one request instead of three. A source whose object is off the
  // rails refuses (kNotOnRails) and the pull is made again on the staged path.
  bool optimistic = false;
  if (!new_region && !path) {
    absl::ReaderMutexLock lock(&mu_);
    optimistic = std::all_of(local.begin(), local.end(), [this](const Extent& e) {
      auto it = regions_.find(e.region);
      return it != regions_.end() && it->second.engine_id != 0 && !IsCuda(it->second.info.device);
    });
  }
  if (!new_region && !optimistic) RETURN_IF_ERROR(ask_source());
  auto fail = [&](absl::Status s) {
    if (new_region) IgnoreError(DeleteRegion(*new_region));
    return s;
  };

  nlohmann::json request = {{"node", id()},
                            {"timeout_ms", absl::ToInt64Milliseconds(options_.pull_timeout)}};
  if (version) request["version"] = *version;
  nlohmann::json rails = nlohmann::json::array();
  for (const engine::RailInfo& r : engine_->rails()) rails.push_back(HexEncode(r.address));
  request["rails"] = rails;
  request["bell"] = HexEncode(engine_->bell_address());
  PathFacts facts;
  facts.same_host = source.value("host", std::string()) == HostId();
  facts.cuda_here = engine::CudaDeviceCount() > 0;
  facts.src_on_rails = described.value("on_rails", true);
  facts.src_all_gpu = described.contains("devices") && described["devices"].is_array() &&
                      !described["devices"].empty();
  if (facts.src_all_gpu) {
    for (const auto& d : described["devices"]) {
      if (!d.is_string()) {
        facts.src_all_gpu = false;
        continue;
      }
      auto device = Device::Parse(d.get<std::string>());
      if (!device.ok() || !IsCuda(*device)) facts.src_all_gpu = false;
    }
  }
  facts.dst_all_ipc = true;
  std::string raw_extents;  // sent after the request's JSON (kExtentsContentType)
  {
    absl::ReaderMutexLock lock(&mu_);
    std::map<uint64_t, size_t> index;
    nlohmann::json regions = nlohmann::json::array();
    std::vector<Extent> extents;
    extents.reserve(local.size());
    for (const Extent& e : local) {
      auto it = regions_.find(e.region);
      if (it == regions_.end()) return fail(absl::NotFoundError(absl::StrCat("no region ", e.region)));
      if (e.length == 0 || !InBounds(e.offset, e.length, it->second.info.size)) {
        return fail(absl::InvalidArgumentError(
            absl::StrCat("extent [", e.offset, ", +", e.length, ") is empty or outside region ",
                         e.region, " of ", it->second.info.size, " bytes")));
      }
      auto [slot, added] = index.try_emplace(e.region, index.size());
      if (added) {
        const Region& r = it->second;
        if (r.engine_id == 0) facts.dst_on_rails = false;
        if (!IsCuda(r.info.device) || r.ipc.handle.empty()) facts.dst_all_ipc = false;
        RegionDescriptor d = DescriptorOf(r);
        if (!facts.same_host) {  // IPC handles go only to a source on this host
          d.ipc_handle.clear();
          d.ipc_gpu.clear();
        }
        regions.push_back(ToJson(d));
      }
      extents.push_back({slot->second, e.offset, e.length});
    }
    request["regions"] = regions;
    raw_extents = RawExtents(extents);
  }
  const PullPath chosen = path ? *path : ChoosePath(facts);
  request["path"] = PathName(chosen);

  // The staged path: a ring here that the source WRITEs chunks into, and a thread that copies
  // them out and gives the slots back.
  std::shared_ptr<StagingRing> ring;
  std::thread receiver;
  std::atomic<bool> stop{false};
  absl::Status received;
  const absl::Time start = absl::Now();
  if (chosen == PullPath::kStaged) {
    auto acquired = staging_->Acquire();
    if (!acquired.ok()) return fail(acquired.status());
    ring = std::move(*acquired);
    engine::PeerAddress source_address{source.value("id", std::string()), {}, {}};
    if (source.contains("rails") && source["rails"].is_array()) {
      for (const auto& r : source["rails"]) {
        auto raw = HexDecode(r.value("address", std::string()));
        if (!raw.ok()) return fail(absl::UnavailableError("source sent a bad rail address"));
        source_address.rails.push_back(std::move(*raw));
      }
    }
    if (source.contains("bell") && source["bell"].is_string()) {
      auto bell = HexDecode(source["bell"].get<std::string>());
      if (!bell.ok()) return fail(absl::UnavailableError("source sent a bad bell address"));
      source_address.bell = std::move(*bell);
    }
    auto source_peer = engine_->AddPeer(source_address, deadline);
    if (!source_peer.ok()) {
      return fail(absl::UnavailableError(
          absl::StrCat("source ", from, " unreachable over the rails: ",
                       source_peer.status().message())));
    }
    const uint32_t tag = (next_tag_.fetch_add(1) & 0xffffff) << 8;
    request["staging"] = {{"region", ToJson(*engine_->Describe(ring->region()))},
                          {"slots", ring->slots()},
                          {"slot_bytes", ring->slot_bytes()},
                          {"tag", tag}};
    receiver = std::thread([&, tag, peer = *source_peer] {
      received = ReceiveStaged(local, size, *ring, tag, peer, deadline, &stop);
    });
  }
  // WRITEs land here until the source answers: keep polling the rails (manual progress).
  engine::AwakeToken awake = engine_->KeepAwake();
  auto answer = client.Post((object_path + "/pull").c_str(), headers,
                            request.dump() + "\n" + raw_extents, kExtentsContentType);
  absl::Status s = StatusFromResult(answer, "source " + from);
  if (receiver.joinable()) {
    if (!s.ok()) stop = true;
    receiver.join();
    if (s.ok()) s = received;
    if (!s.ok()) ring->Poison();
  }
  awake = engine::AwakeToken();
  if (optimistic && s.code() == absl::StatusCode::kFailedPrecondition &&
      absl::StrContains(s.message(), kNotOnRails)) {
    return Pull(from, name, version, into, as, replace, PullPath::kStaged);
  }
  if (!s.ok()) return fail(s);
  auto parsed = ParseJson(answer->body);
  if (!parsed.ok() || !parsed->is_object()) return fail(absl::UnavailableError("bad pull answer"));
  const nlohmann::json& j = *parsed;
  PullStats stats;
  stats.object = name;
  stats.version = j.value("version", uint64_t{0});
  stats.bytes = j.value("bytes", uint64_t{0});
  stats.seconds = j.value("seconds", 0.0);
  stats.path = j.value("path", std::string(PathName(chosen)));
  if (j.contains("bytes_per_rail")) stats.bytes_per_rail = j["bytes_per_rail"].get<std::vector<uint64_t>>();
  stats.rerouted_writes = j.value("rerouted_writes", uint64_t{0});
  if (j.contains("failed_rails")) stats.failed_rails = j["failed_rails"].get<std::vector<size_t>>();
  if (j.contains("rail_seconds")) stats.rail_seconds = j["rail_seconds"].get<std::vector<double>>();
  // Staged bytes are in place only once this side has copied the last chunk in.
  if (chosen == PullPath::kStaged) stats.seconds = absl::ToDoubleSeconds(absl::Now() - start);
  if (new_region) {
    auto published = Publish(target, local, replace);
    if (!published.ok()) return fail(published.status());
    stats.region = new_region;
  }
  return stats;
}

}  // namespace ferry::server
