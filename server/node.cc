#include "base/hex.h"
#include "base/ids.h"
#include "server/node.h"

#include <httplib.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "engine/fabric.h"
#include "base/status.h"
#include "wire/http_status.h"

namespace ferry::server {
namespace {

constexpr uint64_t kMaxRegionSize = uint64_t{1} << 40;

void FreeOwned(char* p) { std::free(p); }

void FreeCuda(char* p) { engine::CudaFree(p); }

}  // namespace

nlohmann::json ToJson(const RegionInfo& r) {
  return {{"id", r.id},
          {"device", r.device.ToString()},
          {"size", r.size},
          {"owned", r.owned},
          {"for_object", r.for_object}};
}

nlohmann::json ToJson(const ObjectView& o, bool with_extents) {
  nlohmann::json devices = nlohmann::json::array();
  for (const Device& d : o.devices) devices.push_back(d.ToString());
  nlohmann::json j = {{"name", o.record.name},   {"version", o.record.version},
                      {"size", o.record.size},   {"created_ms", o.record.created_ms},
                      {"detached", o.detached},  {"devices", devices},
                      {"on_rails", o.on_rails}};
  if (with_extents) {
    nlohmann::json extents = nlohmann::json::array();
    for (const auto& e : o.record.extents) {
      extents.push_back({{"region", e.region}, {"offset", e.offset}, {"length", e.length}});
    }
    j["extents"] = std::move(extents);
  }
  return j;
}

nlohmann::json ToJson(const PullStats& s) {
  nlohmann::json j = {{"object", s.object},   {"version", s.version},
                      {"bytes", s.bytes},     {"seconds", s.seconds},
                      {"path", s.path},       {"bytes_per_rail", s.bytes_per_rail},
                      {"rerouted_writes", s.rerouted_writes}, {"failed_rails", s.failed_rails},
                      {"rail_seconds", s.rail_seconds},
                      {"gbps", s.seconds > 0 ? static_cast<double>(s.bytes) * 8 / s.seconds / 1e9
                                             : 0.0}};
  if (s.region) j["region"] = *s.region;
  return j;
}

absl::StatusOr<std::unique_ptr<Node>> Node::Open(const NodeOptions& options) {
  if (options.staging_slots == 0 || options.staging_slots > 256 ||
      options.staging_slot_bytes < 4096) {
    return absl::InvalidArgumentError("staging: 1 to 256 slots of at least 4096 bytes");
  }
  std::unique_ptr<Node> node(new Node(options));
  std::error_code ec;
  std::filesystem::create_directories(options.data_dir, ec);
  if (ec) {
    return absl::PermissionDeniedError(
        absl::StrCat("cannot create data dir ", options.data_dir, ": ", ec.message()));
  }
  ASSIGN_OR_RETURN(node->catalog_,
                   metadata::Catalog::Open(options.data_dir, {.sync = options.sync,
                                                               .keep_versions = options.keep_versions}));
  engine::EngineOptions eo = options.engine;
  eo.node_id = node->catalog_->node_id();
  Node* raw = node.get();  // the engine goes before the node
  eo.on_control = [raw, user = options.engine.on_control](std::string_view sender,
                                                           std::string_view payload) {
    raw->OnControl(sender, payload);
    if (user) user(sender, payload);
  };
  ASSIGN_OR_RETURN(node->engine_, engine::Engine::Create(eo));
  node->staging_ = std::make_unique<StagingPool>(*node->engine_, options.staging_slots,
                                                 options.staging_slot_bytes);
  return node;
}

Node::~Node() {
  {
    absl::MutexLock lock(&mu_);
    auto drained = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return pulls_in_flight_ == 0; };
    mu_.AwaitWithTimeout(absl::Condition(&drained), options_.pull_timeout);
  }
  staging_.reset();
  engine_.reset();  // closes MRs before the buffers they cover go
  absl::MutexLock lock(&mu_);
  regions_.clear();
}

nlohmann::json Node::Info() const {
  nlohmann::json rails = nlohmann::json::array();
  for (const engine::RailInfo& r : engine_->rails()) {
    nlohmann::json rail = {{"provider", r.provider},
                           {"fabric", r.fabric},
                           {"domain", r.domain},
                           {"address", HexEncode(r.address)},
                           {"tx_depth", r.tx_depth},
                           {"max_msg_size", r.max_msg_size},
                           {"iov_limit", r.iov_limit},
                           {"hmem_cuda", r.hmem_cuda}};
    if (!r.hmem_cuda) rail["hmem_cuda_error"] = r.hmem_cuda_error;
    if (!r.placement.empty()) rail["placement"] = r.placement;
    rails.push_back(std::move(rail));
  }
  nlohmann::json devices = {"host"};
  for (int i = 0; i < engine::CudaDeviceCount(); ++i) {
    devices.push_back(Device::Cuda(i).ToString());
  }
  uint64_t spare = 0;
  {
    absl::ReaderMutexLock lock(&mu_);
    spare = spare_total_;
  }
  return {{"id", id()},
          {"version", "0.1.0"},
          {"host", HostId()},
          {"rails", rails},
          {"progress_threads", engine_->progress_threads()},
          {"devices", devices},
          {"cuda_built", engine::CudaBuilt()},
          {"spare_bytes", spare},
          {"bell", HexEncode(engine_->bell_address())}};
}

absl::StatusOr<RegionInfo> Node::AllocateRegion(Device device, uint64_t size,
                                                bool for_object) {
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
  char* mem = static_cast<char*>(engine::AllocateHostMemory(size));
  if (mem == nullptr) return absl::ResourceExhaustedError("out of memory for the region");
  return AddRegion(mem, size, device, {mem, &FreeOwned}, for_object);
}

absl::StatusOr<RegionInfo> Node::RegisterRegion(void* addr, uint64_t size,
                                                Device device) {
  return AddRegion(static_cast<char*>(addr), size, device, {nullptr, &FreeOwned}, false);
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
  return {nullptr, &FreeOwned};
}

std::vector<RegionInfo> Node::Regions() {
  absl::MutexLock lock(&mu_);
  FreeUnusedLocked();
  std::vector<RegionInfo> out;
  for (const auto& [id, r] : regions_) out.push_back(r.info);
  return out;
}

bool Node::Attached(const metadata::ObjectRecord& r) const { return AllRegistered(r.extents); }

absl::StatusOr<ObjectView> Node::Publish(const std::string& name,
                                         const std::vector<Extent>& extents,
                                         bool replace) {
  RETURN_IF_ERROR(metadata::ValidateObjectName(name));
  if (extents.empty()) return absl::InvalidArgumentError("an object needs at least one extent");
  if (extents.size() > options_.max_extents) {
    return TooLarge(absl::StrCat(extents.size(), " extents; the limit is ", options_.max_extents));
  }
  absl::MutexLock lock(&mu_);
  for (const Extent& e : extents) {
    auto it = regions_.find(e.region);
    if (it == regions_.end()) return absl::NotFoundError(absl::StrCat("no region ", e.region));
    if (e.length == 0) return absl::InvalidArgumentError("an extent has length 0");
    if (!InBounds(e.offset, e.length, it->second.info.size)) {
      return absl::InvalidArgumentError(absl::StrCat("extent [", e.offset, ", +", e.length,
                                                     ") is outside region ", e.region, " of ",
                                                     it->second.info.size, " bytes"));
    }
  }
  std::set<uint64_t> released;
  ASSIGN_OR_RETURN(metadata::ObjectRecord r, catalog_->Publish(name, extents, replace, &released));
  ReleaseLocked(released);
  return View(std::move(r));
}

ObjectView Node::View(metadata::ObjectRecord r) const {
  ObjectView v;
  v.detached = !Attached(r);
  for (const Extent& e : r.extents) {
    auto it = regions_.find(e.region);
    if (it == regions_.end()) continue;
    if (std::find(v.devices.begin(), v.devices.end(), it->second.info.device) == v.devices.end()) {
      v.devices.push_back(it->second.info.device);
    }
    if (it->second.engine_id == 0) v.on_rails = false;
  }
  v.record = std::move(r);
  return v;
}

absl::StatusOr<ObjectView> Node::Describe(const std::string& name,
                                          std::optional<uint64_t> version) const {
  ASSIGN_OR_RETURN(metadata::ObjectRecord r, catalog_->Get(name, version));
  absl::ReaderMutexLock lock(&mu_);
  return View(std::move(r));
}

absl::StatusOr<std::vector<ObjectView>> Node::List(const std::string& prefix,
                                                   const std::string& after, size_t limit) const {
  ASSIGN_OR_RETURN(auto records, catalog_->List(prefix, after, limit));
  absl::ReaderMutexLock lock(&mu_);
  std::vector<ObjectView> out;
  for (auto& r : records) out.push_back(View(std::move(r)));
  return out;
}

absl::Status Node::Delete(const std::string& name) {
  std::set<uint64_t> released;
  RETURN_IF_ERROR(catalog_->Delete(name, &released));
  absl::MutexLock lock(&mu_);
  ReleaseLocked(released);
  return absl::OkStatus();
}

void Node::ReleaseLocked(const std::set<uint64_t>& released) {
  for (uint64_t id : released) {
    auto it = regions_.find(id);
    if (it != regions_.end() && it->second.info.for_object) unused_.insert(id);
  }
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
}

absl::StatusOr<std::unique_ptr<Node::Upload>> Node::BeginUpload(const std::string& name,
                                                                uint64_t size, bool replace,
                                                                Device device) {
  RETURN_IF_ERROR(metadata::ValidateObjectName(name));
  if (size == 0) return absl::InvalidArgumentError("an object needs at least one byte");
  if (!replace && catalog_->Get(name).ok()) {
    return absl::AlreadyExistsError(absl::StrCat("object '", name, "' exists"));
  }
  ASSIGN_OR_RETURN(RegionInfo region, AllocateRegion(device, size, true));
  return std::unique_ptr<Upload>(new Upload(this, name, std::move(region), replace));
}

Node::Upload::~Upload() {
  if (!published_) IgnoreError(node_->DeleteRegion(region_.id));
}

absl::Status Node::Upload::Append(const char* data, size_t n) {
  if (n > region_.size - written_) {
    return absl::OutOfRangeError(
        absl::StrCat("more than the ", region_.size, " bytes announced"));
  }
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

absl::StatusOr<ObjectView> Node::Upload::Finish() {
  if (written_ != region_.size) {
    return absl::InvalidArgumentError(absl::StrCat("the body ended after ", written_, " of the ",
                                                   region_.size, " bytes announced"));
  }
  RETURN_IF_ERROR(Flush());
  ASSIGN_OR_RETURN(ObjectView view, node_->Publish(name_, {{region_.id, 0, region_.size}}, replace_));
  published_ = true;
  return view;
}

absl::StatusOr<ObjectView> Node::PutData(const std::string& name, std::string_view bytes,
                                         bool replace, Device device) {
  ASSIGN_OR_RETURN(std::unique_ptr<Upload> upload, BeginUpload(name, bytes.size(), replace, device));
  RETURN_IF_ERROR(upload->Append(bytes.data(), bytes.size()));
  return upload->Finish();
}

absl::Status Node::CopyIntoRegion(uint64_t id, uint64_t offset, const char* src, uint64_t n) {
  absl::ReaderMutexLock lock(&mu_);
  auto it = regions_.find(id);
  if (it == regions_.end()) return absl::NotFoundError(absl::StrCat("region ", id, " is gone"));
  if (!InBounds(offset, n, it->second.info.size)) {
    return absl::OutOfRangeError(absl::StrCat("bytes [", offset, ", +", n,
                                              ") are outside region ", id));
  }
  return CopyBytes(it->second.addr + offset, src, n, it->second.info.device);
}

absl::Status Node::ReadData(const metadata::ObjectRecord& object, uint64_t offset,
                            uint64_t length, char* out) const {
  if (!InBounds(offset, length, object.size)) {
    return absl::OutOfRangeError(absl::StrCat("bytes [", offset, ", +", length,
                                              ") are past the end of ", object.size));
  }
  absl::ReaderMutexLock lock(&mu_);
  if (!Attached(object)) {
    return Conflict(absl::StrCat("object '", object.name,
                                 "' is detached: its regions are not registered"));
  }
  ASSIGN_OR_RETURN(std::vector<Span> spans, SpansOf(object.extents));
  for (const Span& s : Slice(spans, offset, length)) {
    RETURN_IF_ERROR(CopyBytes(out, s.ptr, s.length, s.device));
    out += s.length;
  }
  return absl::OkStatus();
}

absl::StatusOr<PinnedStages::Buffer> Node::ReadBuffer(const ObjectView& object) {
  if (std::any_of(object.devices.begin(), object.devices.end(), [](const Device& d) {
        return d.kind == Device::Kind::kCuda;
      })) {
    return stages_.Take();
  }
  char* p = static_cast<char*>(std::malloc(PinnedStages::kBytes));
  if (p == nullptr) return absl::ResourceExhaustedError("out of memory for a read buffer");
  return PinnedStages::Buffer(p, [](char* b) { std::free(b); });
}

absl::StatusOr<std::vector<Span>> Node::SpansOf(
    const std::vector<Extent>& extents) const {
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
  return std::all_of(extents.begin(), extents.end(), [this](const Extent& e) {
    return regions_.contains(e.region);
  });
}

RegionDescriptor Node::DescriptorOf(const Region& r) const {
  RegionDescriptor d;
  if (r.engine_id != 0) {
    d = engine_->Describe(r.engine_id).value();
  } else {
    d.node = id();
    d.addr = reinterpret_cast<uint64_t>(r.addr);
    d.length = r.info.size;
    d.device = r.info.device;
  }
  if (r.info.device.kind == Device::Kind::kCuda) {
    d.host = HostId();
    d.ipc_handle = r.ipc.handle;
    d.ipc_offset = r.ipc.offset;
    d.ipc_gpu = r.ipc.gpu;
  }
  return d;
}

}  // namespace ferry::server
