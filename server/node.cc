#include "server/node.h"

#include <httplib.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "engine/fabric.h"
#include "engine/status.h"
#include "server/http_status.h"

namespace ferry::server {
namespace {

constexpr char kHttpStatusPayload[] = "ferry/http-status";
constexpr uint64_t kMaxRegionSize = uint64_t{1} << 40;
constexpr size_t kMaxPeerRails = 64;

absl::Status WithHttpStatus(absl::Status s, int http) {
  s.SetPayload(kHttpStatusPayload, absl::Cord(std::to_string(http)));
  return s;
}

void FreeOwned(char* p) { std::free(p); }

absl::StatusOr<uint64_t> UnsignedField(const nlohmann::json& j, const char* name) {
  auto it = j.find(name);
  if (it == j.end() || !it->is_number_unsigned()) {
    return absl::InvalidArgumentError(absl::StrCat("\"", name, "\" must be an unsigned integer"));
  }
  return it->get<uint64_t>();
}

}  // namespace

absl::StatusOr<std::vector<metadata::ObjectExtent>> ExtentsFromJson(const nlohmann::json& j) {
  if (!j.is_array()) return absl::InvalidArgumentError("\"extents\" must be an array");
  std::vector<metadata::ObjectExtent> out;
  for (const auto& e : j) {
    if (!e.is_object()) return absl::InvalidArgumentError("an extent must be an object");
    ASSIGN_OR_RETURN(uint64_t region, UnsignedField(e, "region"));
    ASSIGN_OR_RETURN(uint64_t offset, UnsignedField(e, "offset"));
    ASSIGN_OR_RETURN(uint64_t length, UnsignedField(e, "length"));
    out.push_back({region, offset, length});
  }
  return out;
}

absl::Status Conflict(absl::string_view message) {
  return WithHttpStatus(absl::FailedPreconditionError(std::string(message)), 409);
}

absl::Status TooLarge(absl::string_view message) {
  return WithHttpStatus(absl::ResourceExhaustedError(std::string(message)), 413);
}

std::optional<int> HttpStatusOverride(const absl::Status& s) {
  auto p = s.GetPayload(kHttpStatusPayload);
  if (!p) return std::nullopt;
  return std::atoi(std::string(*p).c_str());
}

nlohmann::json ToJson(const RegionInfo& r) {
  return {{"id", r.id}, {"device", r.device.ToString()}, {"size", r.size}, {"owned", r.owned}};
}

nlohmann::json ToJson(const ObjectView& o) {
  nlohmann::json extents = nlohmann::json::array();
  for (const auto& e : o.record.extents) {
    extents.push_back({{"region", e.region}, {"offset", e.offset}, {"length", e.length}});
  }
  return {{"name", o.record.name},       {"version", o.record.version},
          {"size", o.record.size},       {"created_ms", o.record.created_ms},
          {"detached", o.detached},      {"extents", extents}};
}

nlohmann::json ToJson(const PullStats& s) {
  nlohmann::json j = {{"object", s.object},   {"version", s.version},
                      {"bytes", s.bytes},     {"seconds", s.seconds},
                      {"path", s.path},       {"bytes_per_rail", s.bytes_per_rail},
                      {"gbps", s.seconds > 0 ? static_cast<double>(s.bytes) * 8 / s.seconds / 1e9
                                             : 0.0}};
  if (s.region) j["region"] = *s.region;
  return j;
}

absl::StatusOr<std::unique_ptr<Node>> Node::Open(const NodeOptions& options) {
  std::unique_ptr<Node> node(new Node(options));
  std::error_code ec;
  std::filesystem::create_directories(options.data_dir, ec);
  if (ec) {
    return absl::PermissionDeniedError(
        absl::StrCat("cannot create data dir ", options.data_dir, ": ", ec.message()));
  }
  ASSIGN_OR_RETURN(node->catalog_,
                   metadata::Catalog::Open(options.data_dir, {.sync = options.sync}));
  engine::EngineOptions eo = options.engine;
  eo.node_id = node->catalog_->node_id();
  ASSIGN_OR_RETURN(node->engine_, engine::Engine::Create(eo));
  return node;
}

Node::~Node() {
  {
    absl::MutexLock lock(&mu_);
    auto drained = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return pulls_in_flight_ == 0; };
    mu_.AwaitWithTimeout(absl::Condition(&drained), options_.pull_timeout);
  }
  engine_.reset();  // closes MRs before the buffers they cover go
  absl::MutexLock lock(&mu_);
  regions_.clear();
}

nlohmann::json Node::Info() const {
  nlohmann::json rails = nlohmann::json::array();
  for (const engine::RailInfo& r : engine_->rails()) {
    rails.push_back({{"provider", r.provider},
                     {"fabric", r.fabric},
                     {"domain", r.domain},
                     {"address", engine::HexEncode(r.address)},
                     {"tx_depth", r.tx_depth},
                     {"max_msg_size", r.max_msg_size}});
  }
  return {{"id", id()}, {"version", "0.1.0"}, {"rails", rails}, {"devices", {"host"}}};
}

absl::StatusOr<RegionInfo> Node::AllocateRegion(engine::Device device, uint64_t size) {
  if (size == 0 || size > kMaxRegionSize) {
    return absl::InvalidArgumentError(absl::StrCat("region size must be 1 to ", kMaxRegionSize));
  }
  if (device.kind != engine::Device::Kind::kHost) {
    return absl::UnimplementedError(
        absl::StrCat("device ", device.ToString(), " is not supported by this build"));
  }
  char* mem = static_cast<char*>(std::aligned_alloc(4096, (size + 4095) / 4096 * 4096));
  if (mem == nullptr) return absl::ResourceExhaustedError("out of memory for the region");
  memset(mem, 0, size);  // no stale bytes, and the pages are there before the first WRITE
  return AddRegion(mem, size, device, {mem, &FreeOwned});
}

absl::StatusOr<RegionInfo> Node::RegisterRegion(void* addr, uint64_t size,
                                                engine::Device device) {
  return AddRegion(static_cast<char*>(addr), size, device, {nullptr, &FreeOwned});
}

absl::StatusOr<RegionInfo> Node::AddRegion(char* addr, uint64_t size, engine::Device device,
                                           std::unique_ptr<char, void (*)(char*)> owned) {
  ASSIGN_OR_RETURN(engine::RegionId eid, engine_->RegisterMemory(addr, size, device));
  auto id = catalog_->NextRegionId();
  if (!id.ok()) {
    IgnoreError(engine_->DeregisterMemory(eid));
    return id.status();
  }
  Region r;
  r.info = {*id, device, size, owned != nullptr};
  r.addr = addr;
  r.engine_id = eid;
  r.owned = std::move(owned);
  RegionInfo info = r.info;
  absl::MutexLock lock(&mu_);
  regions_.emplace(*id, std::move(r));
  return info;
}

absl::Status Node::DeleteRegion(uint64_t id) {
  absl::MutexLock lock(&mu_);
  auto it = regions_.find(id);
  if (it == regions_.end()) return absl::NotFoundError(absl::StrCat("no region ", id));
  if (size_t users = catalog_->RegionUsers(id); users > 0) {
    return Conflict(absl::StrCat("region ", id, " is used by ", users, " object version(s)"));
  }
  absl::Status s = engine_->DeregisterMemory(it->second.engine_id);
  if (s.code() == absl::StatusCode::kFailedPrecondition) return Conflict(s.message());
  RETURN_IF_ERROR(s);
  regions_.erase(it);
  return absl::OkStatus();
}

std::vector<RegionInfo> Node::Regions() const {
  absl::ReaderMutexLock lock(&mu_);
  std::vector<RegionInfo> out;
  for (const auto& [id, r] : regions_) out.push_back(r.info);
  return out;
}

bool Node::Attached(const metadata::ObjectRecord& r) const {
  return std::all_of(r.extents.begin(), r.extents.end(),
                     [this](const metadata::ObjectExtent& e) { return regions_.contains(e.region); });
}

absl::StatusOr<ObjectView> Node::Publish(const std::string& name,
                                         const std::vector<metadata::ObjectExtent>& extents,
                                         bool replace) {
  RETURN_IF_ERROR(metadata::ValidateObjectName(name));
  if (extents.empty()) return absl::InvalidArgumentError("an object needs at least one extent");
  if (extents.size() > options_.max_extents) {
    return TooLarge(absl::StrCat(extents.size(), " extents; the limit is ", options_.max_extents));
  }
  absl::MutexLock lock(&mu_);
  for (const metadata::ObjectExtent& e : extents) {
    auto it = regions_.find(e.region);
    if (it == regions_.end()) return absl::NotFoundError(absl::StrCat("no region ", e.region));
    if (e.length == 0) return absl::InvalidArgumentError("an extent has length 0");
    if (!engine::InBounds(e.offset, e.length, it->second.info.size)) {
      return absl::InvalidArgumentError(absl::StrCat("extent [", e.offset, ", +", e.length,
                                                     ") is outside region ", e.region, " of ",
                                                     it->second.info.size, " bytes"));
    }
  }
  ASSIGN_OR_RETURN(metadata::ObjectRecord r, catalog_->Publish(name, extents, replace));
  return ObjectView{std::move(r), false};
}

absl::StatusOr<ObjectView> Node::Describe(const std::string& name,
                                          std::optional<uint64_t> version) const {
  ASSIGN_OR_RETURN(metadata::ObjectRecord r, catalog_->Get(name, version));
  absl::ReaderMutexLock lock(&mu_);
  const bool detached = !Attached(r);
  return ObjectView{std::move(r), detached};
}

absl::StatusOr<std::vector<ObjectView>> Node::List(const std::string& prefix,
                                                   const std::string& after, size_t limit) const {
  ASSIGN_OR_RETURN(auto records, catalog_->List(prefix, after, limit));
  absl::ReaderMutexLock lock(&mu_);
  std::vector<ObjectView> out;
  for (auto& r : records) {
    const bool detached = !Attached(r);
    out.push_back({std::move(r), detached});
  }
  return out;
}

absl::Status Node::Delete(const std::string& name) { return catalog_->Delete(name); }

absl::StatusOr<ObjectView> Node::PutData(const std::string& name, std::string_view bytes,
                                         bool replace) {
  RETURN_IF_ERROR(metadata::ValidateObjectName(name));
  if (bytes.empty()) return absl::InvalidArgumentError("an object needs at least one byte");
  if (!replace && catalog_->Get(name).ok()) {
    return absl::AlreadyExistsError(absl::StrCat("object '", name, "' exists"));
  }
  ASSIGN_OR_RETURN(RegionInfo region, AllocateRegion(engine::Device::Host(), bytes.size()));
  {
    absl::ReaderMutexLock lock(&mu_);
    memcpy(regions_.at(region.id).addr, bytes.data(), bytes.size());
  }
  auto published = Publish(name, {{region.id, 0, bytes.size()}}, replace);
  if (!published.ok()) IgnoreError(DeleteRegion(region.id));
  return published;
}

absl::Status Node::ReadData(const metadata::ObjectRecord& object, uint64_t offset,
                            uint64_t length, std::string* out) const {
  if (!engine::InBounds(offset, length, object.size)) {
    return absl::OutOfRangeError(absl::StrCat("bytes [", offset, ", +", length,
                                              ") are past the end of ", object.size));
  }
  absl::ReaderMutexLock lock(&mu_);
  if (!Attached(object)) {
    return Conflict(absl::StrCat("object '", object.name,
                                 "' is detached: its regions are not registered"));
  }
  uint64_t pos = 0;
  for (const metadata::ObjectExtent& e : object.extents) {
    if (length == 0) break;
    if (offset >= pos + e.length) {
      pos += e.length;
      continue;
    }
    const uint64_t skip = offset > pos ? offset - pos : 0;
    const uint64_t n = std::min(e.length - skip, length);
    out->append(regions_.at(e.region).addr + e.offset + skip, n);
    offset += n;
    length -= n;
    pos += e.length;
  }
  return absl::OkStatus();
}

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
  engine::PeerAddress address{node->get<std::string>(), {}};
  for (const auto& r : *rails) {
    if (!r.is_string()) return absl::InvalidArgumentError("a rail address must be a hex string");
    ASSIGN_OR_RETURN(std::string raw, engine::HexDecode(r.get<std::string>()));
    address.rails.push_back(std::move(raw));
  }
  auto peer = engine_->AddPeer(address, deadline);
  if (!peer.ok() && peer.status().code() != absl::StatusCode::kInvalidArgument) {
    return absl::UnavailableError(absl::StrCat("destination ", address.node,
                                               " unreachable: ", peer.status().message()));
  }
  return peer;
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
  auto regions = req.find("regions");
  auto extents = req.find("extents");
  if (regions == req.end() || !regions->is_array() || regions->empty()) {
    return absl::InvalidArgumentError("\"regions\" must be a non-empty array of descriptors");
  }
  if (extents == req.end() || !extents->is_array() || extents->empty()) {
    return absl::InvalidArgumentError("\"extents\" must be a non-empty array");
  }
  if (extents->size() > options_.max_extents || regions->size() > options_.max_extents) {
    return TooLarge(absl::StrCat(extents->size(), " extents; the limit is ", options_.max_extents));
  }
  engine::TransferRequest t;
  for (const auto& d : *regions) {
    ASSIGN_OR_RETURN(engine::RegionDescriptor desc, engine::RegionDescriptorFromJson(d));
    t.dst_regions.push_back(std::move(desc));
  }
  struct Abs {
    uint64_t start, end;
  };
  std::vector<Abs> spans;
  uint64_t total = 0;
  // Here an extent's "region" is an index into "regions".
  ASSIGN_OR_RETURN(std::vector<metadata::ObjectExtent> parsed, ExtentsFromJson(*extents));
  for (const auto& [region, offset, length] : parsed) {
    if (region >= t.dst_regions.size()) {
      return absl::InvalidArgumentError(absl::StrCat("extent names region ", region, " of ",
                                                     t.dst_regions.size()));
    }
    if (length == 0) return absl::InvalidArgumentError("an extent has length 0");
    const engine::RegionDescriptor& d = t.dst_regions[region];
    if (!engine::InBounds(offset, length, d.length)) {
      return absl::InvalidArgumentError(absl::StrCat("destination extent [", offset, ", +",
                                                     length, ") is outside its region of ",
                                                     d.length, " bytes"));
    }
    if (total + length < total) return absl::InvalidArgumentError("extents overflow 2^64 bytes");
    total += length;
    spans.push_back({d.addr + offset, d.addr + offset + length});
    t.dst.push_back({region, offset, length});
  }
  std::sort(spans.begin(), spans.end(), [](const Abs& a, const Abs& b) { return a.start < b.start; });
  for (size_t i = 1; i < spans.size(); ++i) {
    if (spans[i].start < spans[i - 1].end) {
      return absl::InvalidArgumentError("destination extents overlap");
    }
  }
  ASSIGN_OR_RETURN(metadata::ObjectRecord object, catalog_->Get(name, version));
  if (total != object.size) {
    return absl::InvalidArgumentError(absl::StrCat("destination extents hold ", total,
                                                   " bytes, object '", name, "' has ",
                                                   object.size));
  }
  ASSIGN_OR_RETURN(engine::PeerId peer, PeerFor(req, deadline));
  t.peer = peer;
  t.deadline = deadline;
  absl::StatusOr<engine::Transfer> transfer = absl::UnknownError("");
  {
    absl::MutexLock lock(&mu_);
    if (!Attached(object)) {
      return Conflict(absl::StrCat("object '", name, "' is detached: its regions are not "
                                   "registered since the node restarted"));
    }
    for (const metadata::ObjectExtent& e : object.extents) {
      t.src.push_back({regions_.at(e.region).engine_id, e.offset, e.length});
    }
    transfer = engine_->Submit(std::move(t));
    if (transfer.ok()) ++pulls_in_flight_;
  }
  RETURN_IF_ERROR(transfer.status());
  auto stats = transfer->Wait();
  {
    absl::MutexLock lock(&mu_);
    --pulls_in_flight_;
  }
  if (!stats.ok()) {
    if (stats.status().code() == absl::StatusCode::kUnavailable) {
      IgnoreError(engine_->RemovePeer(peer));  // the next pull warms a fresh connection
    }
    return stats.status();
  }
  return PullStats{name, object.version, stats->bytes, stats->seconds, stats->bytes_per_rail,
                   "rdma", std::nullopt};
}

absl::StatusOr<PullStats> Node::Pull(const std::string& from, const std::string& name,
                                     std::optional<uint64_t> version, const nlohmann::json& into,
                                     const std::string& as, bool replace) {
  RETURN_IF_ERROR(metadata::ValidateObjectName(name));
  if (from.rfind("http://", 0) != 0) {
    return absl::InvalidArgumentError("\"from\" must be an http://host:port URL");
  }
  if (!into.is_object()) return absl::InvalidArgumentError("\"into\" must be an object");
  httplib::Client client(from);
  client.set_connection_timeout(5);
  client.set_read_timeout(static_cast<time_t>(absl::ToInt64Seconds(options_.pull_timeout)) + 10);
  httplib::Headers headers;
  if (!options_.peer_token.empty()) {
    headers.emplace("Authorization", "Bearer " + options_.peer_token);
  }
  const std::string path = "/v1/objects/" + EncodeName(name);
  const std::string version_query = version ? absl::StrCat("?version=", *version) : "";

  std::vector<metadata::ObjectExtent> local;
  std::optional<uint64_t> new_region;
  const std::string target = as.empty() ? name : as;
  if (into.contains("device")) {
    if (!into["device"].is_string()) return absl::InvalidArgumentError("\"device\" must be a string");
    ASSIGN_OR_RETURN(engine::Device device, engine::Device::Parse(into["device"].get<std::string>()));
    RETURN_IF_ERROR(metadata::ValidateObjectName(target));
    if (!replace && catalog_->Get(target).ok()) {
      return absl::AlreadyExistsError(absl::StrCat("object '", target, "' exists here"));
    }
    auto described = client.Get((path + version_query).c_str(), headers);
    RETURN_IF_ERROR(StatusFromResult(described, "source " + from));
    auto j = nlohmann::json::parse(described->body, nullptr, false);
    if (j.is_discarded() || !j.contains("size") || !j["size"].is_number_unsigned()) {
      return absl::UnavailableError("source answered without an object size");
    }
    ASSIGN_OR_RETURN(RegionInfo region, AllocateRegion(device, j["size"].get<uint64_t>()));
    new_region = region.id;
    local.push_back({region.id, 0, region.size});
  } else if (into.contains("extents")) {
    ASSIGN_OR_RETURN(local, ExtentsFromJson(into["extents"]));
    if (local.size() > options_.max_extents) {
      return TooLarge(absl::StrCat(local.size(), " extents; the limit is ", options_.max_extents));
    }
    if (local.empty()) return absl::InvalidArgumentError("\"extents\" is empty");
  } else {
    return absl::InvalidArgumentError("\"into\" needs \"device\" or \"extents\"");
  }
  auto fail = [&](absl::Status s) {
    if (new_region) IgnoreError(DeleteRegion(*new_region));
    return s;
  };

  nlohmann::json request = {{"node", id()},
                            {"timeout_ms", absl::ToInt64Milliseconds(options_.pull_timeout)}};
  if (version) request["version"] = *version;
  nlohmann::json rails = nlohmann::json::array();
  for (const engine::RailInfo& r : engine_->rails()) rails.push_back(engine::HexEncode(r.address));
  request["rails"] = rails;
  {
    absl::ReaderMutexLock lock(&mu_);
    std::map<uint64_t, size_t> index;
    nlohmann::json regions = nlohmann::json::array(), extents = nlohmann::json::array();
    for (const metadata::ObjectExtent& e : local) {
      auto it = regions_.find(e.region);
      if (it == regions_.end()) return fail(absl::NotFoundError(absl::StrCat("no region ", e.region)));
      if (e.length == 0 || !engine::InBounds(e.offset, e.length, it->second.info.size)) {
        return fail(absl::InvalidArgumentError(
            absl::StrCat("extent [", e.offset, ", +", e.length, ") is empty or outside region ",
                         e.region, " of ", it->second.info.size, " bytes")));
      }
      auto [slot, added] = index.try_emplace(e.region, index.size());
      if (added) {
        auto desc = engine_->Describe(it->second.engine_id);
        if (!desc.ok()) return fail(desc.status());
        regions.push_back(engine::ToJson(*desc));
      }
      extents.push_back({{"region", slot->second}, {"offset", e.offset}, {"length", e.length}});
    }
    request["regions"] = regions;
    request["extents"] = extents;
  }
  // WRITEs land here until the source answers: keep polling the rails (manual progress).
  engine::AwakeToken awake = engine_->KeepAwake();
  auto answer = client.Post((path + "/pull").c_str(), headers, request.dump(), "application/json");
  awake = engine::AwakeToken();
  absl::Status s = StatusFromResult(answer, "source " + from);
  if (!s.ok()) return fail(s);
  auto j = nlohmann::json::parse(answer->body, nullptr, false);
  if (j.is_discarded() || !j.is_object()) return fail(absl::UnavailableError("bad pull answer"));
  PullStats stats;
  stats.object = name;
  stats.version = j.value("version", uint64_t{0});
  stats.bytes = j.value("bytes", uint64_t{0});
  stats.seconds = j.value("seconds", 0.0);
  stats.path = j.value("path", std::string("rdma"));
  if (j.contains("bytes_per_rail")) stats.bytes_per_rail = j["bytes_per_rail"].get<std::vector<uint64_t>>();
  if (new_region) {
    auto published = Publish(target, local, replace);
    if (!published.ok()) return fail(published.status());
    stats.region = new_region;
  }
  return stats;
}

}  // namespace ferry::server
