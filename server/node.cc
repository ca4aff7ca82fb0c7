#include "server/node.h"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <thread>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "base/crc32c.h"
#include "base/hex.h"
#include "base/ids.h"
#include "base/status.h"
#include "base/version.h"
#include "engine/fabric.h"
#include "server/api_json.h"
#include "server/node_internal.h"
#include "server/transports.h"
#include "wire/disjoint.h"
#include "wire/http_status.h"

namespace ferry::server {
namespace {

constexpr uint64_t kMaxRegionSize = uint64_t{1} << 40;
// Receives (distributions) that run at once; more wait for a thread.
constexpr size_t kReceiveThreads = 8;

void FreeCuda(char* p) { engine::CudaFree(p); }

absl::Status ValidateMeta(const std::string& meta) {
  if (meta.empty()) return absl::OkStatus();
  if (meta.size() > kMaxMeta) {
    return absl::InvalidArgumentError(
        absl::StrCat("meta of ", meta.size(), " bytes; the limit is ", kMaxMeta));
  }
  absl::Status json = ParseJson(meta).status();
  if (!json.ok()) return absl::InvalidArgumentError(absl::StrCat("meta: ", json.message()));
  return absl::OkStatus();
}

// A media type as HTTP writes it (type/subtype, parameters allowed), or empty.
absl::Status ValidateContentType(const std::string& type) {
  const bool printable =
      std::all_of(type.begin(), type.end(), [](char c) { return c >= 0x20 && c < 0x7f; });
  if (type.empty() || (type.size() <= 127 && printable && type.find('/') != std::string::npos)) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(
      "content_type must be a media type (type/subtype) of at most "
      "127 printable characters");
}

size_t ServeThreads(size_t wanted) {
  if (wanted > 0) return wanted;
  return std::max<size_t>(4, std::thread::hardware_concurrency() / 4);
}

}  // namespace

PeerAddress NodeInfo::address() const {
  PeerAddress a{id, {}, bell};
  for (const engine::RailInfo& r : rails) a.rails.push_back(r.address);
  return a;
}

Node::PullInFlight::PullInFlight(Node* node) : node_(node) {
  absl::MutexLock lock(&node_->flight_mu_);
  ++node_->pulls_in_flight_;
}

Node::PullInFlight::~PullInFlight() {
  {
    absl::MutexLock lock(&node_->flight_mu_);
    --node_->pulls_in_flight_;
  }
  // What a transfer of this pull kept. Freeing a region waits for the progress threads: not on
  // one of them, which hands it to a serving thread.
  if (!node_->has_unused_.load()) return;
  if (!engine::OnProgressThread()) {
    absl::MutexLock lock(&node_->mu_);
    node_->FreeUnusedLocked(kUnpinGrace);
    return;
  }
  Node* node = node_;
  node->serve_queue_->Run([node] {
    absl::MutexLock lock(&node->mu_);
    node->FreeUnusedLocked(kUnpinGrace);
  });
}

Node::Node(const NodeOptions& options) : options_(options), auth_(options.cluster_key) {}

absl::StatusOr<std::unique_ptr<Node>> Node::Open(const NodeOptions& options) {
  if (options.staging_slots == 0 || options.staging_slots > 256 ||
      options.staging_slot_bytes < 4096) {
    return absl::InvalidArgumentError("staging: 1 to 256 slots of at least 4096 bytes");
  }
  if (options.peer_transport != "auto" && options.peer_transport != "fabric" &&
      options.peer_transport != "http") {
    return absl::InvalidArgumentError("peer transport must be auto, fabric or http");
  }
  std::unique_ptr<cluster::Directory> directory;
  if (!options.directory.empty()) {
    if (options.directory_ttl < absl::Seconds(1)) {
      return absl::InvalidArgumentError("the directory's TTL is at least 1 s");
    }
    ASSIGN_OR_RETURN(directory, cluster::Directory::Connect(options.directory,
                                                            {.token = options.directory_token}));
  }
  std::unique_ptr<Node> node(new Node(options));
  node->memory_limit_ = options.memory_limit != 0
                            ? options.memory_limit
                            : static_cast<uint64_t>(sysconf(_SC_PHYS_PAGES)) / 4 * 3 *
                                  static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  std::error_code ec;
  std::filesystem::create_directories(options.data_dir, ec);
  if (ec) {
    return absl::PermissionDeniedError(
        absl::StrCat("cannot create data dir ", options.data_dir, ": ", ec.message()));
  }
  ASSIGN_OR_RETURN(
      node->catalog_,
      metadata::Catalog::Open(options.data_dir, {.sync = options.sync,
                                                 .keep_versions = options.keep_versions,
                                                 .min_free_bytes = options.min_free_disk}));
  engine::EngineOptions eo = options.engine;
  eo.node_id = node->catalog_->node_id();
  eo.counters = options.metrics;
  if (!options.metrics) node->metrics_.Disable();
  Node* raw = node.get();  // the engine goes before the node
  eo.on_control = [raw, user = options.engine.on_control](std::string_view sender,
                                                          std::string_view payload) {
    raw->OnControl(sender, payload);
    if (user) user(sender, payload);
  };
  ASSIGN_OR_RETURN(node->engine_, engine::Engine::Create(eo));
  node->self_ = node->engine_->address();
  node->staging_ = std::make_unique<StagingPool>(*node->engine_, options.staging_slots,
                                                 options.staging_slot_bytes);
  node->fabric_ = MakeFabricTransport(*node->engine_);
  node->http_ = MakeHttpTransport();
  node->serve_queue_ = std::make_unique<WorkQueue>(ServeThreads(options.serve_threads));
  node->receive_queue_ = std::make_unique<WorkQueue>(kReceiveThreads);
  if (directory) {
    node->membership_ = std::make_unique<cluster::Membership>(std::move(directory), node->id(),
                                                              options.directory_ttl);
  }
  return node;
}

Node::~Node() {
  if (membership_) membership_->Leave();
  {
    absl::MutexLock lock(&flight_mu_);
    auto drained = [this]()
                       ABSL_EXCLUSIVE_LOCKS_REQUIRED(flight_mu_) { return pulls_in_flight_ == 0; };
    flight_mu_.AwaitWithTimeout(absl::Condition(&drained), options_.pull_timeout);
  }
  stopping_ = true;
  // Receives still running end (they check between chunks), then no request is served from
  // here on (the engine may still hand some over).
  {
    absl::MutexLock lock(&served_mu_);
    for (auto& [key, served] : served_) {
      absl::MutexLock l(&served->mu);
      served->cancelled = true;
    }
  }
  if (receive_queue_) receive_queue_->Stop();
  if (serve_queue_) serve_queue_->Stop();
  {
    absl::MutexLock lock(&mu_);
    prepared_.clear();
  }
  staging_.reset();
  engine_.reset();  // closes MRs before the buffers they cover go
  // The engine's callbacks use the transports until it is gone.
  fabric_.reset();
  http_.reset();
  absl::MutexLock lock(&mu_);
  regions_.clear();
}

absl::Status Node::Accepting() const {
  if (!draining_) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat("node ", id(), " is draining"));
}

void Node::Drain() {
  draining_ = true;
  // Pulls by name go elsewhere from now on; those running here finish.
  if (membership_) membership_->Leave();
}

nlohmann::json Node::DirectoryRecord(const std::string& url, const std::string& state) const {
  nlohmann::json record = ToJson(Info());
  record["url"] = url;
  record["labels"] = options_.labels;
  record["state"] = state;
  record["started_ms"] = absl::ToUnixMillis(absl::Now());
  return record;
}

absl::Status Node::Join(const std::string& url) {
  if (!membership_) return absl::FailedPreconditionError("the node has no directory");
  membership_->Join(DirectoryRecord(url, "ready"));
  // What the node holds already: the latest version of each object.
  std::string after;
  for (;;) {
    ASSIGN_OR_RETURN(std::vector<metadata::ObjectRecord> page, catalog_->List("", after, 1000));
    for (const metadata::ObjectRecord& r : page) membership_->Hold(r.name, r.version, r.size);
    if (page.size() < 1000) return absl::OkStatus();
    after = page.back().name;
  }
}

absl::StatusOr<std::vector<cluster::NodeEntry>> Node::Cluster() {
  if (!membership_) return absl::FailedPreconditionError("the node has no directory");
  return membership_->Nodes();
}

std::string Node::directory_url() const {
  return membership_ ? membership_->directory().url() : std::string();
}

std::string Node::directory_state() { return membership_ ? membership_->state() : std::string(); }

bool Node::AwaitPulls(absl::Time deadline) {
  absl::MutexLock lock(&flight_mu_);
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(flight_mu_) { return pulls_in_flight_ == 0; };
  return flight_mu_.AwaitWithDeadline(absl::Condition(&idle), deadline);
}

void Node::SetTransportsForTesting(std::unique_ptr<PeerTransport> fabric,
                                   std::unique_ptr<PeerTransport> http) {
  fabric_ = std::move(fabric);
  http_ = std::move(http);
}

NodeInfo Node::Info() const {
  NodeInfo info;
  info.id = id();
  info.version = kVersion;
  info.host = HostId();
  info.rails = engine_->rails();
  info.progress_threads = engine_->progress_threads();
  info.devices.push_back(Device::Host());
  for (int i = 0; i < engine::CudaDeviceCount(); ++i) info.devices.push_back(Device::Cuda(i));
  info.cuda_built = engine::CudaBuilt();
  {
    absl::ReaderMutexLock lock(&mu_);
    info.spare_bytes = spare_total_;
  }
  info.bell = engine_->bell_address();
  info.sealed = auth_.enabled();
  return info;
}

absl::StatusOr<RegionInfo> Node::AllocateRegion(Device device, uint64_t size, bool for_object) {
  if (size == 0 || size > kMaxRegionSize) {
    return absl::InvalidArgumentError(absl::StrCat("region size must be 1 to ", kMaxRegionSize));
  }
  if (for_object) {
    if (auto spare = TakeSpare(device, size); spare != nullptr) {
      char* mem = spare.get();
      return AddRegion(mem, size, device, std::move(spare), true);
    }
  }
  if (device.kind == Device::Kind::kCuda) {
    ASSIGN_OR_RETURN(void* mem, engine::CudaAlloc(device.index, size));
    return AddRegion(static_cast<char*>(mem), size, device, {static_cast<char*>(mem), &FreeCuda},
                     for_object);
  }
  RETURN_IF_ERROR(ReserveHost(size));
  absl::Cleanup unreserve = [this, size] { UnreserveHost(size); };
  char* mem = static_cast<char*>(engine::AllocateHostMemory(size));
  if (mem == nullptr) return absl::ResourceExhaustedError("out of memory for the region");
  return AddRegion(mem, size, device, {mem, [size](char* p) { engine::FreeHostMemory(p, size); }},
                   for_object);
}

absl::Status Node::ReserveHost(uint64_t size) {
  absl::MutexLock lock(&mu_);
  FreeUnusedLocked();
  uint64_t used = reserved_host_;
  for (const auto& [id, r] : regions_) {
    if (r.owned != nullptr && !r.info.device.is_cuda()) used += r.info.size;
  }
  for (const Spare& spare : spares_) {
    if (!spare.device.is_cuda()) used += spare.size;
  }
  for (auto it = spares_.begin(); used + size > memory_limit_ && it != spares_.end();) {
    if (it->device.is_cuda()) {
      ++it;
      continue;
    }
    used -= it->size;
    spare_total_ -= it->size;
    it = spares_.erase(it);
  }
  if (used + size > memory_limit_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("host memory limit: ", size, " more bytes do not fit (", used, " of ",
                     memory_limit_, " allocated; ferryd --memory-limit-mb)"));
  }
  reserved_host_ += size;
  return absl::OkStatus();
}

void Node::UnreserveHost(uint64_t size) {
  absl::MutexLock lock(&mu_);
  reserved_host_ -= size;
}

absl::StatusOr<RegionInfo> Node::RegisterRegion(void* addr, uint64_t size, Device device) {
  return AddRegion(static_cast<char*>(addr), size, device, {}, false);
}

absl::StatusOr<RegionInfo> Node::AddRegion(char* addr, uint64_t size, Device device,
                                           OwnedMemory owned, bool for_object) {
  engine::CudaIpcExport ipc;
  if (device.kind == Device::Kind::kCuda) {
    RETURN_IF_ERROR(engine::CheckCudaDevice(device.index));
    ASSIGN_OR_RETURN(ipc, engine::CudaExportIpc(addr));
  }
  // GPU memory the provider cannot register stays off the rails: the same-host and staged
  // paths reach it.
  engine::RegionId eid = 0;
  auto registered = engine_->RegisterMemory(addr, size, device);
  if (registered.ok()) {
    eid = *registered;
  } else if (device.kind == Device::Kind::kHost ||
             registered.status().code() != absl::StatusCode::kUnimplemented) {
    return registered.status();
  }
  auto id = catalog_->NextRegionId();
  if (!id.ok()) {
    if (eid != 0) IgnoreError(engine_->DeregisterMemory(eid));
    return id.status();
  }
  Region r;
  r.info = {*id, device, size, owned != nullptr, for_object};
  r.addr = addr;
  r.engine_id = eid;
  r.ipc = std::move(ipc);
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
  if (it->second.prepared > 0) {
    return Conflict(
        absl::StrCat("region ", id, " is under ", it->second.prepared, " prepared destination(s)"));
  }
  return FreeRegionLocked(it, absl::Now() + kUnpinGrace);
}

absl::Status Node::FreeRegionLocked(std::map<uint64_t, Region>::iterator it, absl::Time deadline) {
  if (it->second.engine_id != 0) {
    absl::Status s = engine_->DeregisterMemory(it->second.engine_id, deadline);
    if (s.code() == absl::StatusCode::kFailedPrecondition) return Conflict(s.message());
    RETURN_IF_ERROR(s);
  }
  KeepSpareLocked(it->second);
  regions_.erase(it);
  return absl::OkStatus();
}

void Node::KeepSpareLocked(Region& r) {
  const uint64_t size = r.info.size;
  if (!r.info.for_object || r.owned == nullptr || size > options_.spare_bytes) return;
  while (spare_total_ + size > options_.spare_bytes) {
    spare_total_ -= spares_.front().size;
    spares_.pop_front();
  }
  spare_total_ += size;
  spares_.push_back({r.info.device, size, std::move(r.owned)});
}

Node::OwnedMemory Node::TakeSpare(Device device, uint64_t size) {
  absl::MutexLock lock(&mu_);
  for (auto it = spares_.begin(); it != spares_.end(); ++it) {
    if (it->size != size || !(it->device == device)) continue;
    auto memory = std::move(it->memory);
    spare_total_ -= size;
    spares_.erase(it);
    return memory;
  }
  return {};
}

std::vector<RegionInfo> Node::Regions() {
  absl::MutexLock lock(&mu_);
  FreeUnusedLocked();
  std::vector<RegionInfo> out;
  for (const auto& [id, r] : regions_) out.push_back(r.info);
  return out;
}

bool Node::Attached(const metadata::ObjectRecord& r) const { return AllRegistered(r.extents); }

absl::StatusOr<ObjectInfo> Node::Publish(const std::string& name, const Layout& layout,
                                         const PublishOptions& options,
                                         std::optional<uint32_t> crc32c) {
  RETURN_IF_ERROR(metadata::ValidateObjectName(name));
  RETURN_IF_ERROR(ValidateContentType(options.content_type));
  if (layout.empty()) return absl::InvalidArgumentError("an object needs at least one extent");
  if (layout.pieces() > options_.max_extents) {
    return TooLarge(absl::StrCat(layout.pieces(), " extents; the limit is ", options_.max_extents));
  }
  for (const Layout::Run& r : layout.runs()) {
    if (r.piece == 0) return absl::InvalidArgumentError("an extent has length 0");
  }
  RETURN_IF_ERROR(ValidateMeta(options.meta));
  const std::vector<Extent> extents = layout.Expand();
  absl::MutexLock lock(&mu_);
  for (const Extent& e : extents) {
    auto it = regions_.find(e.region);
    if (it == regions_.end()) return absl::NotFoundError(absl::StrCat("no region ", e.region));
    if (!InBounds(e.offset, e.length, it->second.info.size)) {
      return absl::InvalidArgumentError(absl::StrCat("extent [", e.offset, ", +", e.length,
                                                     ") is outside region ", e.region, " of ",
                                                     it->second.info.size, " bytes"));
    }
  }
  std::set<uint64_t> released;
  ASSIGN_OR_RETURN(metadata::ObjectRecord r,
                   catalog_->Publish(name, extents, options.replace, &released, options.durable,
                                     {.meta = options.meta,
                                      .content_type = options.content_type,
                                      .crc32c = crc32c,
                                      .if_latest = options.if_latest,
                                      .version = options.version}));
  ReleaseLocked(released);
  if (membership_) {
    if (options.announce) membership_->Hold(r.name, r.version, r.size);
    // The versions the catalog dropped are held no more, announced or not.
    if (options_.keep_versions > 0 && r.version > options_.keep_versions) {
      membership_->Release(r.name, r.version - options_.keep_versions);
    }
  }
  return View(r, /*with_extents=*/true);
}

ObjectInfo Node::View(const metadata::ObjectRecord& r, bool with_extents) const {
  ObjectInfo v;
  v.detached = !Attached(r);
  for (const Extent& e : r.extents) {
    auto it = regions_.find(e.region);
    if (it == regions_.end()) continue;
    if (std::find(v.devices.begin(), v.devices.end(), it->second.info.device) == v.devices.end()) {
      v.devices.push_back(it->second.info.device);
    }
    if (it->second.engine_id == 0) v.on_rails = false;
  }
  v.name = r.name;
  v.version = r.version;
  v.size = r.size;
  v.created_ms = r.created_ms;
  v.durable = r.durable;
  v.meta = r.meta;
  v.content_type = r.content_type;
  v.crc32c = r.crc32c;
  if (with_extents) v.extents = r.extents;
  return v;
}

absl::StatusOr<ObjectInfo> Node::Describe(const std::string& name, std::optional<uint64_t> version,
                                          bool with_extents) const {
  ASSIGN_OR_RETURN(std::shared_ptr<const metadata::ObjectRecord> r, catalog_->Get(name, version));
  absl::ReaderMutexLock lock(&mu_);
  return View(*r, with_extents);
}

absl::StatusOr<std::vector<ObjectInfo>> Node::List(const std::string& prefix,
                                                   const std::string& after, size_t limit) const {
  ASSIGN_OR_RETURN(auto records, catalog_->List(prefix, after, limit));
  absl::ReaderMutexLock lock(&mu_);
  std::vector<ObjectInfo> out;
  for (const auto& r : records) out.push_back(View(r, /*with_extents=*/true));
  return out;
}

absl::Status Node::Delete(const std::string& name, std::optional<uint64_t> if_latest) {
  std::set<uint64_t> released;
  RETURN_IF_ERROR(catalog_->Delete(name, &released, if_latest));
  if (membership_) membership_->Release(name);
  absl::MutexLock lock(&mu_);
  ReleaseLocked(released);
  return absl::OkStatus();
}

void Node::ReleaseLocked(const std::set<uint64_t>& released) {
  for (uint64_t id : released) {
    auto it = regions_.find(id);
    if (it != regions_.end() && it->second.info.for_object) unused_.insert(id);
  }
  has_unused_ = !unused_.empty();
  FreeUnusedLocked();
}

void Node::FreeUnusedLocked(absl::Duration grace) {
  const absl::Time deadline = absl::Now() + grace;
  for (auto id = unused_.begin(); id != unused_.end();) {
    auto it = regions_.find(*id);
    // Gone already (DELETE /v1/regions), or published again since: not this list's to free.
    if (it == regions_.end() || catalog_->RegionUsers(*id) > 0) {
      id = unused_.erase(id);
      continue;
    }
    if (FreeRegionLocked(it, deadline).ok()) {
      id = unused_.erase(id);
    } else {
      ++id;
    }
  }
  has_unused_ = !unused_.empty();
}

absl::StatusOr<std::unique_ptr<Node::Upload>> Node::BeginUpload(const std::string& name,
                                                                uint64_t size, Device device,
                                                                const PublishOptions& options) {
  RETURN_IF_ERROR(Accepting());
  RETURN_IF_ERROR(metadata::ValidateObjectName(name));
  if (size == 0) return absl::InvalidArgumentError("an object needs at least one byte");
  RETURN_IF_ERROR(ValidateMeta(options.meta));
  RETURN_IF_ERROR(ValidateContentType(options.content_type));
  // Refused before any byte comes (the catalog checks again when it publishes).
  auto latest = catalog_->Get(name);
  if (options.if_latest) {
    RETURN_IF_ERROR(
        metadata::CheckLatest(name, latest.ok() ? (*latest)->version : 0, *options.if_latest));
  }
  if (!options.replace && latest.ok()) {
    return absl::AlreadyExistsError(absl::StrCat("object '", name, "' exists"));
  }
  ASSIGN_OR_RETURN(RegionInfo region, AllocateRegion(device, size, true));
  return std::unique_ptr<Upload>(new Upload(this, name, std::move(region), options));
}

Node::Upload::~Upload() {
  if (!published_) IgnoreError(node_->DeleteRegion(region_.id));
}

absl::Status Node::Upload::Append(const char* data, size_t n) {
  if (n > region_.size - written_) {
    return absl::OutOfRangeError(absl::StrCat("more than the ", region_.size, " bytes announced"));
  }
  crc32c_ = Crc32c(crc32c_, data, n);
  // Host memory takes the bytes at once; GPU memory in copies of a whole pinned stage
  // (cpp-httplib hands a body over in pieces of 4 KiB).
  if (region_.device.kind != Device::Kind::kCuda) {
    RETURN_IF_ERROR(node_->CopyIntoRegion(region_.id, written_, data, n));
    written_ += n;
    return absl::OkStatus();
  }
  if (!stage_) {
    ASSIGN_OR_RETURN(stage_, node_->stages_.Take());
  }
  while (n > 0) {
    const size_t take = std::min(n, PinnedStages::kBytes - staged_);
    std::memcpy(stage_.get() + staged_, data, take);
    staged_ += take;
    written_ += take;
    data += take;
    n -= take;
    if (staged_ == PinnedStages::kBytes) RETURN_IF_ERROR(Flush());
  }
  return absl::OkStatus();
}

absl::Status Node::Upload::Flush() {
  if (staged_ == 0) return absl::OkStatus();
  RETURN_IF_ERROR(node_->CopyIntoRegion(region_.id, written_ - staged_, stage_.get(), staged_));
  staged_ = 0;
  return absl::OkStatus();
}

absl::StatusOr<ObjectInfo> Node::Upload::Finish() {
  if (written_ != region_.size) {
    return absl::InvalidArgumentError(absl::StrCat("the body ended after ", written_, " of the ",
                                                   region_.size, " bytes announced"));
  }
  RETURN_IF_ERROR(Flush());
  ASSIGN_OR_RETURN(ObjectInfo view, node_->Publish(name_, Layout({{region_.id, 0, region_.size}}),
                                                   options_, crc32c_));
  published_ = true;
  return view;
}

absl::StatusOr<ObjectInfo> Node::PutData(const std::string& name, std::string_view bytes,
                                         Device device, const PublishOptions& options) {
  ASSIGN_OR_RETURN(std::unique_ptr<Upload> upload,
                   BeginUpload(name, bytes.size(), device, options));
  RETURN_IF_ERROR(upload->Append(bytes.data(), bytes.size()));
  return upload->Finish();
}

absl::Status Node::CopyIntoRegion(uint64_t id, uint64_t offset, const char* src, uint64_t n) {
  absl::ReaderMutexLock lock(&mu_);
  auto it = regions_.find(id);
  if (it == regions_.end()) return absl::NotFoundError(absl::StrCat("region ", id, " is gone"));
  if (!InBounds(offset, n, it->second.info.size)) {
    return absl::OutOfRangeError(
        absl::StrCat("bytes [", offset, ", +", n, ") are outside region ", id));
  }
  return CopyBytes(it->second.addr + offset, src, n, it->second.info.device);
}

absl::Status Node::ReadData(const ObjectInfo& object, uint64_t offset, uint64_t length,
                            char* out) const {
  if (!InBounds(offset, length, object.size)) {
    return absl::OutOfRangeError(
        absl::StrCat("bytes [", offset, ", +", length, ") are past the end of ", object.size));
  }
  absl::ReaderMutexLock lock(&mu_);
  if (!AllRegistered(object.extents)) {
    return Conflict(
        absl::StrCat("object '", object.name, "' is detached: its regions are not registered"));
  }
  ASSIGN_OR_RETURN(std::vector<Span> spans, SpansOf(object.extents));
  for (const Span& s : Slice(spans, offset, length)) {
    RETURN_IF_ERROR(CopyBytes(out, s.ptr, s.length, s.device));
    out += s.length;
  }
  return absl::OkStatus();
}

absl::StatusOr<PinnedStages::Buffer> Node::ReadBuffer(const ObjectInfo& object) {
  if (std::any_of(object.devices.begin(), object.devices.end(),
                  [](const Device& d) { return d.kind == Device::Kind::kCuda; })) {
    return stages_.Take();
  }
  char* p = static_cast<char*>(std::malloc(PinnedStages::kBytes));
  if (p == nullptr) return absl::ResourceExhaustedError("out of memory for a read buffer");
  return PinnedStages::Buffer(p, [](char* b) { std::free(b); });
}

absl::StatusOr<std::vector<Span>> Node::SpansOf(const std::vector<Extent>& extents) const {
  std::vector<Span> spans;
  spans.reserve(extents.size());
  for (const Extent& e : extents) {
    auto it = regions_.find(e.region);
    if (it == regions_.end()) return absl::NotFoundError(absl::StrCat("no region ", e.region));
    spans.push_back({it->second.addr + e.offset, e.length, it->second.info.device});
  }
  return spans;
}

bool Node::AllRegistered(const std::vector<Extent>& extents) const {
  // A loop, not std::all_of: the thread-safety analysis does not see mu_ held in a lambda.
  const Extent* last = nullptr;  // pieces of one region follow each other: looked up once
  for (const Extent& e : extents) {
    if (last != nullptr && last->region == e.region) continue;
    if (!regions_.contains(e.region)) return false;
    last = &e;
  }
  return true;
}

RegionDescriptor Node::DescriptorOf(const Region& r) const {
  RegionDescriptor d;
  d.node = id();
  d.addr = reinterpret_cast<uint64_t>(r.addr);
  d.length = r.info.size;
  d.device = r.info.device;
  if (r.info.device.is_cuda()) {
    d.host = HostId();
    d.ipc_handle = r.ipc.handle;
    d.ipc_offset = r.ipc.offset;
    d.ipc_gpu = r.ipc.gpu;
  }
  return d;
}

absl::StatusOr<uint64_t> Node::CheckDestination(const Layout& layout) const {
  if (layout.empty()) return absl::InvalidArgumentError("a pull needs somewhere to go");
  if (layout.pieces() > options_.max_extents) {
    return TooLarge(absl::StrCat(layout.pieces(), " extents; the limit is ", options_.max_extents));
  }
  // Held (mu_): the lambdas below read the map through it, where the analysis cannot see it.
  const std::map<uint64_t, Region>* regions = &regions_;
  const Region* last = nullptr;
  uint64_t last_id = 0;
  auto region = [&](uint64_t id) -> absl::Status {
    if (last != nullptr && last_id == id) return absl::OkStatus();
    auto it = regions->find(id);
    if (it == regions->end()) return absl::NotFoundError(absl::StrCat("no region ", id));
    if (catalog_->RegionUsers(id) > 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("region ", id, " holds a published object version: versions are immutable"));
    }
    last = &it->second;
    last_id = id;
    return absl::OkStatus();
  };
  const std::optional<uint64_t> total =
      WithinRegions(layout, [&](uint64_t id) -> std::optional<uint64_t> {
        if (!region(id).ok()) return std::nullopt;
        return last->info.size;
      });
  if (!total) {
    // Which piece does not: piece by piece.
    absl::Status bad;
    layout.ForEach([&](const Extent& e) {
      if (!bad.ok()) return;
      if (absl::Status s = region(e.region); !s.ok()) {
        bad = s;
      } else if (e.length == 0 || !InBounds(e.offset, e.length, last->info.size)) {
        bad = absl::InvalidArgumentError(absl::StrCat("extent [", e.offset, ", +", e.length,
                                                      ") is empty or outside region ", e.region,
                                                      " of ", last->info.size, " bytes"));
      }
    });
    return bad.ok() ? absl::InvalidArgumentError("extents overflow 2^64 bytes") : bad;
  }
  // Pieces of one destination must not overlap: the bytes of two would race.
  if (!Disjoint(layout)) return absl::InvalidArgumentError("destination extents overlap");
  return *total;
}

absl::StatusOr<uint64_t> Node::PrepareDestination(const Layout& layout) {
  if (layout.pieces() > options_.max_extents) {
    return TooLarge(absl::StrCat(layout.pieces(), " pieces; the limit is ", options_.max_extents));
  }
  auto p = std::make_shared<Prepared>();
  p->layout = layout;
  p->pieces.reserve(layout.pieces());
  layout.ForEach([&](const Extent& e) { p->pieces.push_back(e); });
  std::vector<uint64_t> regions;
  {
    absl::ReaderMutexLock lock(&mu_);
    ASSIGN_OR_RETURN(p->size, CheckDestination(layout));
    for (const Layout::Run& r : layout.runs()) {
      if (std::find(regions.begin(), regions.end(), r.region) == regions.end()) {
        regions.push_back(r.region);
      }
    }
  }
  ASSIGN_OR_RETURN(p->windows, OpenWindows(layout));
  absl::MutexLock lock(&mu_);
  for (uint64_t r : regions) {
    auto it = regions_.find(r);
    if (it == regions_.end()) {
      CloseWindows(p->windows.ids, /*wait=*/true);
      return absl::NotFoundError(absl::StrCat("region ", r, " went meanwhile"));
    }
    ++it->second.prepared;
  }
  p->regions = std::move(regions);
  p->handle = next_prepared_++;
  prepared_.emplace(p->handle, p);
  return p->handle;
}

absl::Status Node::ReleaseDestination(uint64_t handle) {
  std::shared_ptr<Prepared> p;
  {
    absl::MutexLock lock(&mu_);
    auto it = prepared_.find(handle);
    if (it == prepared_.end()) {
      return absl::NotFoundError(absl::StrCat("no prepared destination ", handle));
    }
    if (it->second->running.load() > 0) {
      return Conflict(absl::StrCat("prepared destination ", handle, " has a pull running"));
    }
    p = it->second;
    prepared_.erase(it);
    for (uint64_t r : p->regions) {
      auto region = regions_.find(r);
      if (region != regions_.end()) --region->second.prepared;
    }
  }
  CloseWindows(p->windows.ids, /*wait=*/true);
  return absl::OkStatus();
}

}  // namespace ferry::server
