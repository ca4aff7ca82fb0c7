#include "engine/engine.h"

#include <sched.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "base/bytes.h"
#include "base/ids.h"
#include "base/status.h"
#include "engine/control.h"
#include "engine/cuda.h"
#include "engine/planner.h"
#include "engine/progress_group.h"
#include "engine/rail.h"
#include "spdlog/spdlog.h"

namespace ferry::engine {

// A registered region as the engine's callers see it. Guarded by Engine::mu_.
struct RegionEntry {
  char* addr = nullptr;
  uint64_t length = 0;
  Device device;
  std::vector<uint64_t> keys;     // per engine rail
  std::vector<void*> descs;       // per engine rail
  size_t pins = 0;                // transfers whose WRITEs may still read it
  std::vector<uint64_t> windows;  // open on it (OpenWindow)
};

// A message on its way out (PostControl): its frames, sent whole on one rail after another
// until a rail carries every frame.
struct ControlSend {
  std::vector<std::string> frames;
  std::vector<uint64_t> fi_addrs;  // the peer's, per engine rail
  PeerId peer = 0;
  size_t first_rail = 0;
  size_t tries = 0;     // rails tried so far
  size_t pending = 0;   // frames of this try not yet completed
  absl::Status failed;  // of this try
  std::string errors;   // of the tries before
  std::function<void(const absl::Status&)> done;
  absl::Mutex mu;
};

namespace {

// Unfinished fragmented messages are dropped after this long, and kept to this many bytes
// in all.
constexpr absl::Duration kPartialMessageLife = absl::Seconds(30);
constexpr size_t kPartialMessageBytes = size_t{256} << 20;
// Message ids remembered per sender, to drop copies; senders remembered.
constexpr size_t kSeenAboveKept = 4096;
constexpr size_t kSendersKept = 4096;

// Transfers without a deadline of their own get this one.
constexpr absl::Duration kDefaultTransferDeadline = absl::Seconds(60);

// FI_EP_RDM with SEND/RECV for control and one-sided WRITEs for data. We accept every
// mr_mode bit we handle and FI_CONTEXT(2) / FI_RX_CQ_DATA; FI_THREAD_DOMAIN because only the
// progress thread touches a domain.
InfoPtr MakeHints(const std::string& prov_filter, bool hmem, bool delivery_complete, bool ordered) {
  InfoPtr hints(fi_allocinfo());
  hints->ep_attr->type = FI_EP_RDM;
  hints->caps = FI_MSG | FI_RMA | FI_SEND | FI_RECV | FI_WRITE | FI_REMOTE_WRITE;
  if (hmem) hints->caps |= FI_HMEM;
  hints->mode = FI_CONTEXT | FI_CONTEXT2 | FI_RX_CQ_DATA;
  hints->domain_attr->mr_mode =
      FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY | FI_MR_ENDPOINT;
  // With FI_HMEM: device memory is registered with its iface and device (fi_mr_regattr), and
  // every operation on it carries its descriptor, which is what FI_MR_HMEM asks (fi_mr(3));
  // shm offers FI_HMEM only to applications that accept it.
  if (hmem) hints->domain_attr->mr_mode |= FI_MR_HMEM;
  hints->domain_attr->threading = FI_THREAD_DOMAIN;
  hints->domain_attr->control_progress = FI_PROGRESS_UNSPEC;
  hints->domain_attr->data_progress = FI_PROGRESS_UNSPEC;
  if (delivery_complete) hints->tx_attr->op_flags = FI_DELIVERY_COMPLETE;
  if (ordered) hints->tx_attr->msg_order = FI_ORDER_RMA_WAW;
  if (!prov_filter.empty()) hints->fabric_attr->prov_name = strdup(prov_filter.c_str());
  return hints;
}

// The NIC's PCI address as hwloc writes it, when the provider reports one.
std::string PciAddress(const fi_info& info) {
  if (info.nic == nullptr || info.nic->bus_attr == nullptr ||
      info.nic->bus_attr->bus_type != FI_BUS_PCI) {
    return "";
  }
  const auto& p = info.nic->bus_attr->attr.pci;
  return absl::StrFormat("%04x:%02x:%02x.%x", p.domain_id, p.bus_id, p.device_id, p.function_id);
}

}  // namespace

size_t AutoProgressThreads(size_t rails) {
  cpu_set_t set;
  CPU_ZERO(&set);
  const size_t cpus =
      sched_getaffinity(0, sizeof(set), &set) == 0 ? static_cast<size_t>(CPU_COUNT(&set)) : 1;
  return std::max<size_t>(1, std::min(rails, cpus / 2));
}

absl::StatusOr<std::vector<NicRef>> ProviderNics(std::string_view provider) {
  ASSIGN_OR_RETURN(std::string filter, ProviderFilter(provider));
  InfoPtr hints = MakeHints(filter, false, false, false);
  fi_info* list = nullptr;
  const int rc = GetInfo(hints.get(), &list);
  InfoPtr owned(list);
  if (rc != 0 || list == nullptr) {
    return absl::NotFoundError(
        absl::StrCat("provider '", std::string(provider), "' offers no domain"));
  }
  std::vector<NicRef> out;
  for (const fi_info* i = list; i != nullptr; i = i->next) {
    if (std::string_view(i->fabric_attr->prov_name) != list->fabric_attr->prov_name) continue;
    if (std::none_of(out.begin(), out.end(),
                     [&](const NicRef& n) { return n.name == i->domain_attr->name; })) {
      out.push_back({i->domain_attr->name, PciAddress(*i)});
    }
  }
  return out;
}

void TransferStats::NoteFailedRail(size_t rail) {
  if (std::find(failed_rails.begin(), failed_rails.end(), rail) == failed_rails.end()) {
    failed_rails.push_back(rail);
  }
}

void TransferStats::Add(const TransferStats& other) {
  bytes += other.bytes;
  writes += other.writes;
  bytes_per_rail.resize(std::max(bytes_per_rail.size(), other.bytes_per_rail.size()));
  for (size_t r = 0; r < other.bytes_per_rail.size(); ++r)
    bytes_per_rail[r] += other.bytes_per_rail[r];
  rerouted_writes += other.rerouted_writes;
  for (size_t r : other.failed_rails) NoteFailedRail(r);
  rail_seconds.resize(std::max(rail_seconds.size(), other.rail_seconds.size()));
  for (size_t r = 0; r < other.rail_seconds.size(); ++r) {
    rail_seconds[r] = std::max(rail_seconds[r], other.rail_seconds[r]);
  }
}

absl::StatusOr<TransferStats> Transfer::Wait(absl::Time deadline) const {
  TransferState& s = *state_;
  absl::MutexLock lock(&s.mu);
  auto done = [&s]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu) { return s.done; };
  if (!s.mu.AwaitWithDeadline(absl::Condition(&done), deadline)) {
    return absl::DeadlineExceededError(
        absl::StrCat("transfer ", s.id, " still running when the wait passed its deadline"));
  }
  if (!s.status.ok()) return s.status;
  return s.stats;
}

bool Transfer::Done() const { return state_->finished.load(std::memory_order_acquire); }

absl::Status Transfer::WaitRetired(absl::Time deadline) const {
  TransferState& s = *state_;
  absl::MutexLock lock(&s.mu);
  auto retired = [&s]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu) { return s.retired; };
  if (!s.mu.AwaitWithDeadline(absl::Condition(&retired), deadline)) {
    return absl::DeadlineExceededError(
        absl::StrCat("transfer ", s.id, " still has WRITEs in flight at the deadline"));
  }
  return absl::OkStatus();
}

void Transfer::Cancel() {
  state_->Finish(absl::CancelledError(absl::StrCat("transfer ", state_->id, " cancelled")));
}

absl::Status ImmediateCounter::Wait(absl::Time deadline) const {
  absl::MutexLock lock(&mu_);
  auto fired = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return fired_; };
  if (!mu_.AwaitWithDeadline(absl::Condition(&fired), deadline)) {
    return absl::DeadlineExceededError(
        absl::StrCat(arrived_, " of ", count_, " immediates landed before the deadline"));
  }
  return absl::OkStatus();
}

uint64_t ImmediateCounter::arrived() const {
  absl::MutexLock lock(&mu_);
  return arrived_;
}

void ImmediateCounter::Fire() {
  if (on_fire_) on_fire_();
  absl::MutexLock lock(&mu_);
  fired_ = true;
}

uint64_t ImmediateCounter::Add(uint64_t n, bool* fired) {
  absl::MutexLock lock(&mu_);
  const uint64_t take = std::min(n, count_ - arrived_);
  arrived_ += take;
  *fired = take > 0 && arrived_ == count_;
  return n - take;
}

AwakeToken& AwakeToken::operator=(AwakeToken&& other) noexcept {
  if (this != &other) {
    if (count_ != nullptr) count_->fetch_sub(1);
    count_ = std::exchange(other.count_, nullptr);
  }
  return *this;
}

AwakeToken::~AwakeToken() {
  if (count_ != nullptr) count_->fetch_sub(1);
}

AwakeToken Engine::KeepAwake() {
  // A group asleep on its fds (for up to a second when idle) starts polling now.
  if (awake_.fetch_add(1) == 0) {
    for (auto& g : groups_) g->Wake();
  }
  return AwakeToken(&awake_);
}

Engine::Engine(const EngineOptions& options)
    : options_(options), incarnation_(static_cast<uint32_t>(RandomU64())) {}

Engine::~Engine() {
  closing_.store(true);
  groups_.clear();
}

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(const EngineOptions& options) {
  if (options.max_write == 0) return absl::InvalidArgumentError("max_write must be positive");
  if (options.max_control == 0 || options.max_control > 65536) {
    return absl::InvalidArgumentError("max_control must be within 1..65536");
  }
  if (options.asleep_poll < absl::Milliseconds(1) || options.asleep_poll > absl::Hours(1)) {
    return absl::InvalidArgumentError("asleep_poll must be within 1 ms..1 h");
  }
  if (options.node_id.size() > kMaxSenderId) {
    return absl::InvalidArgumentError("node_id longer than 256 bytes");
  }
  ASSIGN_OR_RETURN(std::string prov_filter, ProviderFilter(options.provider));

  // Ask for device memory (when there are GPUs), delivery-complete WRITEs and write-after-write
  // ordering; drop what the provider lacks (EFA's SRD is unordered; some providers have no
  // FI_DELIVERY_COMPLETE; Debian's libfabric has no CUDA).
  fi_info* list = nullptr;
  int rc = -FI_ENODATA;
  const bool want_hmem = CudaDeviceCount() > 0;
  for (int attempt = want_hmem ? 0 : 4; attempt < 8 && rc == -FI_ENODATA; ++attempt) {
    InfoPtr hints = MakeHints(prov_filter, attempt < 4, attempt % 4 < 2, attempt % 2 == 0);
    rc = GetInfo(hints.get(), &list);
  }
  InfoPtr owned_list(list);
  if (rc != 0) {
    return absl::NotFoundError(
        absl::StrCat("no libfabric provider matches '", options.provider, "': ", fi_strerror(-rc)));
  }
  // One info per domain (the first, libfabric's preferred one), all from the first provider.
  const std::string prov = list->fabric_attr->prov_name;
  std::vector<const fi_info*> domains;
  auto find_domain = [&](std::string_view name) -> const fi_info* {
    for (const fi_info* i = list; i != nullptr; i = i->next) {
      if (prov == i->fabric_attr->prov_name && i->domain_attr->name == name) return i;
    }
    return nullptr;
  };
  if (options.domains.empty()) {
    for (const fi_info* i = list; i != nullptr; i = i->next) {
      if (prov != i->fabric_attr->prov_name) continue;
      if (std::none_of(domains.begin(), domains.end(), [&](const fi_info* d) {
            return std::string_view(d->domain_attr->name) == i->domain_attr->name;
          })) {
        domains.push_back(i);
      }
    }
  } else {
    for (const std::string& name : options.domains) {
      const fi_info* i = find_domain(name);
      if (i == nullptr) {
        return absl::NotFoundError(absl::StrCat("provider ", prov, " has no domain '", name, "'"));
      }
      domains.push_back(i);
    }
  }
  std::unique_ptr<Engine> engine(new Engine(options));
  engine->node_id_ = options.node_id.empty() ? RandomId() : options.node_id;
  // Rails by group: placed by the machine's topology (one group per GPU with NICs, then the
  // host group), or dealt round robin to progress_threads groups.
  std::vector<std::vector<const fi_info*>> per_group;
  std::vector<RailGroup> placement;
  std::unique_ptr<Topology> topology;
  if (options.topology && options.rails == 0) {
    auto discovered = Topology::Discover();
    if (discovered.ok()) {
      topology = std::move(*discovered);
      std::vector<NicRef> nics;
      for (const fi_info* d : domains) nics.push_back({d->domain_attr->name, PciAddress(*d)});
      for (RailGroup& g : topology->Place(nics)) {
        if (g.nics.empty()) continue;
        auto& infos = per_group.emplace_back();
        for (const NicRef& n : g.nics) {
          infos.push_back(*std::find_if(domains.begin(), domains.end(), [&](const fi_info* d) {
            return n.name == d->domain_attr->name;
          }));
        }
        placement.push_back(std::move(g));
      }
    } else {
      spdlog::warn("no topology ({}): rails are not placed", discovered.status().ToString());
    }
  }
  if (per_group.empty()) {
    const size_t nrails = options.rails == 0 ? domains.size() : options.rails;
    const size_t threads =
        options.progress_threads == 0 ? AutoProgressThreads(nrails) : options.progress_threads;
    per_group.resize(std::min(threads, nrails));
    for (size_t r = 0; r < nrails; ++r) {
      per_group[r % per_group.size()].push_back(domains[r % domains.size()]);
    }
  }
  // Engine rails interleave the groups (the first rail of each group, then the second...),
  // so that every group appears among the first rails.
  const size_t nthreads = per_group.size();
  size_t nrails = 0;
  for (const auto& g : per_group) nrails += g.size();
  for (size_t k = 0; engine->rail_refs_.size() < nrails; ++k) {
    for (size_t g = 0; g < nthreads; ++g) {
      if (k < per_group[g].size()) engine->rail_refs_.push_back({g, k});
    }
  }
  for (size_t g = 0; g < nthreads; ++g) {
    std::vector<InfoPtr> infos;
    for (const fi_info* i : per_group[g]) infos.emplace_back(fi_dupinfo(i));
    ProgressGroup::Binder bind;
    if (g < placement.size()) {
      bind = [t = topology.get(), &group = placement[g]] { return t->Bind(group); };
    }
    ASSIGN_OR_RETURN(auto group, ProgressGroup::Start(engine.get(), g, std::move(infos),
                                                      engine->options_, std::move(bind)));
    engine->groups_.push_back(std::move(group));
  }
  engine->bell_address_ = engine->groups_[0]->bell_address();
  engine->has_bell_.store(!engine->bell_address_.empty());
  engine->max_write_ = options.max_write;
  engine->max_iov_ = std::clamp<size_t>(options.max_iov, 1, kMaxIov);
  engine->cq_data_size_ = 8;
  for (const RailRef& ref : engine->rail_refs_) {
    RailInfo ri = engine->groups_[ref.group]->rail_info(ref.index_in_group);
    if (ref.group < placement.size()) {
      const RailGroup& g = placement[ref.group];
      ri.placement =
          absl::StrCat(g.gpu < 0 ? std::string("host") : absl::StrCat("gpu", g.gpu), ", numa ",
                       absl::StrJoin(g.numa_nodes, ","), ", cores ", absl::StrJoin(g.cores, ","));
    }
    engine->rails_.push_back(ri);
    engine->max_write_ = std::min(engine->max_write_, ri.max_msg_size);
    engine->max_iov_ = std::min(engine->max_iov_, ri.iov_limit);
    engine->cq_data_size_ = std::min(engine->cq_data_size_, ri.cq_data_size);
  }
  spdlog::debug("engine {}: {} rails on {} ({} progress threads)", engine->node_id_, nrails, prov,
                nthreads);
  return engine;
}

PeerAddress Engine::address() const {
  PeerAddress a{node_id_, {}, bell_address_};
  for (const RailInfo& r : rails_) a.rails.push_back(r.address);
  return a;
}

absl::StatusOr<RegionId> Engine::RegisterMemory(void* addr, size_t length, Device device) {
  if (addr == nullptr || length == 0) {
    return absl::InvalidArgumentError("register: null address or empty range");
  }
  if (reinterpret_cast<uintptr_t>(addr) + length < reinterpret_cast<uintptr_t>(addr)) {
    return absl::InvalidArgumentError("register: range wraps past the end of memory");
  }
  if (device.kind == Device::Kind::kCuda) {
    RETURN_IF_ERROR(CheckCudaDevice(device.index));
    for (const RailInfo& r : rails_) {
      if (!r.hmem_cuda) {
        return absl::UnimplementedError(
            absl::StrCat("register: provider ", r.provider, " on ", r.domain, " cannot reach ",
                         device.ToString(), " memory (no FI_HMEM with CUDA in this libfabric)"));
      }
    }
  }
  RegionId id;
  {
    absl::MutexLock lock(&mu_);
    id = next_region_++;
  }
  auto entry = std::make_unique<RegionEntry>();
  entry->addr = static_cast<char*>(addr);
  entry->length = length;
  entry->device = device;
  RETURN_IF_ERROR(RegisterOnRails({{id, entry.get()}}, FI_WRITE));
  absl::MutexLock lock(&mu_);
  regions_.emplace(id, std::move(entry));
  return id;
}

absl::Status Engine::RegisterOnRails(const std::vector<std::pair<uint64_t, RegionEntry*>>& entries,
                                     uint64_t access) {
  for (const auto& [id, entry] : entries) {
    entry->keys.resize(rails_.size());
    entry->descs.resize(rails_.size());
  }
  // One command per group, all in flight at once; each fills the keys of its own rails. They
  // use `entries` and this frame: every one is waited for, whatever happens.
  std::vector<std::shared_ptr<Completion>> done(groups_.size());
  for (size_t g = 0; g < groups_.size(); ++g) {
    done[g] = std::make_shared<Completion>();
    groups_[g]->Run([this, g, &entries, access, done = done[g]](ProgressGroup& pg) {
      for (size_t i = 0; i < entries.size(); ++i) {
        const auto& [id, entry] = entries[i];
        std::vector<RailMr*> mrs;
        absl::Status s =
            pg.RegisterRegion(id, entry->addr, entry->length, entry->device, access, &mrs);
        if (!s.ok()) {
          for (size_t j = 0; j < i; ++j) pg.DeregisterRegion(entries[j].first);
          return done->Set(s);
        }
        for (size_t r = 0; r < rails_.size(); ++r) {
          if (rail_refs_[r].group != g) continue;
          entry->keys[r] = mrs[rail_refs_[r].index_in_group]->key;
          entry->descs[r] = mrs[rail_refs_[r].index_in_group]->desc;
        }
      }
      done->Set(absl::OkStatus());
    });
  }
  absl::Status status;
  std::vector<bool> registered(groups_.size());
  for (size_t g = 0; g < groups_.size(); ++g) {
    absl::Status s = done[g]->Wait(absl::InfiniteFuture());
    registered[g] = s.ok();
    if (status.ok()) status = s;
  }
  if (!status.ok()) {
    for (size_t g = 0; g < groups_.size(); ++g) {
      if (!registered[g]) continue;
      for (const auto& [id, entry] : entries) DeregisterOnRails(g, id);
    }
  }
  return status;
}

void Engine::DeregisterOnRails(size_t group, uint64_t id) {
  IgnoreError(groups_[group]->RunAndWait([id](ProgressGroup& pg) {
    pg.DeregisterRegion(id);
    return absl::OkStatus();
  }));
}

absl::StatusOr<Window> Engine::OpenWindow(RegionId id, uint64_t offset, uint64_t length) {
  ASSIGN_OR_RETURN(std::vector<Window> windows, OpenWindows({{id, offset, length}}));
  return std::move(windows.front());
}

absl::StatusOr<std::vector<Window>> Engine::OpenWindows(const std::vector<WindowSpan>& spans) {
  std::vector<RegionEntry> windows(spans.size());
  std::vector<std::pair<uint64_t, RegionEntry*>> entries;
  entries.reserve(spans.size());
  {
    absl::MutexLock lock(&mu_);
    for (size_t i = 0; i < spans.size(); ++i) {
      const WindowSpan& w = spans[i];
      auto it = regions_.find(w.region);
      if (it == regions_.end()) return absl::NotFoundError(absl::StrCat("no region ", w.region));
      if (w.length == 0 || !InBounds(w.offset, w.length, it->second->length)) {
        return absl::InvalidArgumentError(absl::StrCat("window [", w.offset, ", +", w.length,
                                                       ") is empty or outside region ", w.region));
      }
      windows[i].addr = it->second->addr + w.offset;
      windows[i].length = w.length;
      windows[i].device = it->second->device;
      entries.emplace_back(next_region_++, &windows[i]);
    }
  }
  RETURN_IF_ERROR(RegisterOnRails(entries, FI_REMOTE_WRITE));
  std::vector<Window> out;
  out.reserve(spans.size());
  absl::MutexLock lock(&mu_);
  for (size_t i = 0; i < spans.size(); ++i) {
    if (!regions_.contains(spans[i].region)) {
      // Deregistered meanwhile: its windows go with it, and so do the others.
      for (size_t g = 0; g < groups_.size(); ++g) {
        groups_[g]->Run([entries](ProgressGroup& pg) {
          for (const auto& [id, entry] : entries) pg.DeregisterRegion(id);
        });
      }
      for (const Window& w : out) windows_.erase(w.id);
      for (size_t j = 0; j < out.size(); ++j) {
        if (auto r = regions_.find(spans[j].region); r != regions_.end()) {
          std::erase(r->second->windows, out[j].id);
        }
      }
      return absl::NotFoundError(absl::StrCat("no region ", spans[i].region));
    }
    const uint64_t window_id = entries[i].first;
    RegionDescriptor d;
    d.node = node_id_;
    d.addr = reinterpret_cast<uintptr_t>(windows[i].addr);
    d.length = windows[i].length;
    d.device = windows[i].device;
    d.offset_addressing = (rails_[0].mr_mode & FI_MR_VIRT_ADDR) == 0;
    d.keys = std::move(windows[i].keys);
    regions_.at(spans[i].region)->windows.push_back(window_id);
    windows_.emplace(window_id, spans[i].region);
    out.push_back(Window{window_id, std::move(d)});
  }
  return out;
}

absl::Status Engine::CloseWindow(uint64_t window, bool wait) {
  {
    absl::MutexLock lock(&mu_);
    auto it = windows_.find(window);
    if (it == windows_.end()) return absl::NotFoundError(absl::StrCat("no window ", window));
    if (auto region = regions_.find(it->second); region != regions_.end()) {
      std::erase(region->second->windows, window);
    }
    windows_.erase(it);
  }
  for (size_t g = 0; g < groups_.size(); ++g) {
    if (wait) {
      DeregisterOnRails(g, window);
    } else {
      groups_[g]->Run([window](ProgressGroup& pg) { pg.DeregisterRegion(window); });
    }
  }
  return absl::OkStatus();
}

absl::Status Engine::DeregisterMemory(RegionId id, absl::Time deadline) {
  std::vector<uint64_t> windows;
  {
    absl::MutexLock lock(&mu_);
    auto unpinned = [this, id]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      auto it = regions_.find(id);
      return it == regions_.end() || it->second->pins == 0;
    };
    mu_.AwaitWithDeadline(absl::Condition(&unpinned), deadline);
    auto it = regions_.find(id);
    if (it == regions_.end()) return absl::NotFoundError(absl::StrCat("no region ", id));
    if (it->second->pins > 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("region ", id, " is in use by ", it->second->pins, " transfer(s)"));
    }
    windows = std::move(it->second->windows);
    for (uint64_t w : windows) windows_.erase(w);
    regions_.erase(it);
  }
  for (size_t g = 0; g < groups_.size(); ++g) {
    for (uint64_t w : windows) DeregisterOnRails(g, w);
    DeregisterOnRails(g, id);
  }
  return absl::OkStatus();
}

absl::StatusOr<RegionDescriptor> Engine::Describe(RegionId id) const {
  absl::MutexLock lock(&mu_);
  auto it = regions_.find(id);
  if (it == regions_.end()) return absl::NotFoundError(absl::StrCat("no region ", id));
  const RegionEntry& e = *it->second;
  RegionDescriptor d;
  d.node = node_id_;
  d.addr = reinterpret_cast<uintptr_t>(e.addr);
  d.length = e.length;
  d.device = e.device;
  d.offset_addressing = (rails_[0].mr_mode & FI_MR_VIRT_ADDR) == 0;
  return d;
}

void Engine::ReleaseRegions(const std::vector<RegionId>& regions) {
  absl::MutexLock lock(&mu_);
  for (RegionId id : regions) {
    auto it = regions_.find(id);
    if (it != regions_.end()) --it->second->pins;
  }
}

absl::StatusOr<PeerId> Engine::AddPeer(const PeerAddress& peer, absl::Time deadline) {
  if (peer.rails.empty()) return absl::InvalidArgumentError("peer has no rails");
  for (const std::string& a : peer.rails) {
    if (a.empty() || a.size() > kMaxAddress) {
      return absl::InvalidArgumentError(
          absl::StrCat("peer rail address has ", a.size(), " bytes; want 1 to ", kMaxAddress));
    }
  }
  if (peer.bell.size() > kMaxAddress) {
    return absl::InvalidArgumentError(absl::StrCat("peer bell address has ", peer.bell.size(),
                                                   " bytes; want at most ", kMaxAddress));
  }
  PeerId id;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [pid, p] : peers_) {
      if (p.address.node == peer.node && p.address.rails == peer.rails) return pid;
    }
    id = next_peer_++;
  }
  // The peer may be asleep: its bell rings before the first hello goes.
  auto bell = std::make_shared<uint64_t>(FI_ADDR_NOTAVAIL);
  if (has_bell_ && !peer.bell.empty()) {
    RETURN_IF_ERROR(groups_[0]->RunAndWait([bell, &peer](ProgressGroup& pg) -> absl::Status {
      ASSIGN_OR_RETURN(*bell, pg.AddBell(peer.bell));
      pg.Ring(*bell, RingKind::kWake);
      return absl::OkStatus();
    }));
  }
  const absl::Time woken = absl::Now();
  // Filled at distinct indices by the groups, read after their completions: each rail's AV
  // entry and the hello that answers for it.
  auto fi_addrs = std::make_shared<std::vector<uint64_t>>(rails_.size(), FI_ADDR_NOTAVAIL);
  auto answers_of = std::make_shared<std::vector<std::shared_ptr<Completion>>>(rails_.size());
  std::vector<std::shared_ptr<Completion>> inserted;
  const std::string hello = EncodeControl(ControlType::kHello, node_id_, "");
  for (size_t g = 0; g < groups_.size(); ++g) {
    auto done = std::make_shared<Completion>();
    groups_[g]->Run(
        [this, g, fi_addrs, answers_of, done, hello, remote = peer.rails](ProgressGroup& pg) {
          absl::Status status;
          for (size_t r = 0; r < rails_.size(); ++r) {
            if (rail_refs_[r].group != g) continue;
            // First contact: one small message per rail pair sets the connection up now, so the
            // first transfer does not pay for it. A hello still unanswered from an earlier try is
            // waited for instead of sent again.
            auto contact =
                pg.ContactAddress(rail_refs_[r].index_in_group, remote[r % remote.size()], hello);
            if (!contact.ok()) {
              if (status.ok()) status = contact.status();
              (*answers_of)[r] = std::make_shared<Completion>();
              (*answers_of)[r]->Set(contact.status());
              continue;
            }
            (*fi_addrs)[r] = contact->addr;
            (*answers_of)[r] = contact->hello;
          }
          done->Set(status);
        });
    inserted.push_back(done);
  }
  absl::Status status;
  for (auto& c : inserted) {
    absl::Status s = c->Wait(absl::InfiniteFuture());
    if (status.ok()) status = s;
  }
  std::vector<std::pair<size_t, std::shared_ptr<Completion>>> hellos;  // engine rail, its hello
  for (size_t r = 0; r < rails_.size(); ++r) hellos.emplace_back(r, (*answers_of)[r]);
  const bool inserted_all = status.ok();
  // Each rail gets rail_stall_timeout to answer. Once one has, the peer is reachable: a rail
  // that failed or has not answered by then starts resting for this peer, as it would after
  // failing mid-transfer. When none has, all get until the deadline. A hello refused outright
  // (a connection the provider shut down while a link was away) is sent again, at growing
  // intervals, for up to a second after its first refusal: the provider connects afresh for a
  // new send.
  const absl::Time grace = std::min(deadline, absl::Now() + options_.rail_stall_timeout);
  const size_t n = hellos.size();
  std::vector<absl::Status> answers(n, absl::DeadlineExceededError("no answer yet"));
  std::vector<bool> answered(n, !inserted_all);
  std::vector<absl::Time> refused_first(n, absl::InfiniteFuture());
  std::vector<absl::Time> resend_at(n, absl::InfinitePast());
  std::vector<absl::Duration> pause(n, absl::Milliseconds(10));
  bool reached = false;
  while (inserted_all) {
    const absl::Time now = absl::Now();
    bool all_answered = true;
    Completion* pending = nullptr;  // one still unanswered, to wait on below
    for (size_t i = 0; i < n; ++i) {
      if (answered[i]) continue;
      if (resend_at[i] != absl::InfinitePast()) {
        if (now < resend_at[i]) {
          all_answered = false;
          continue;
        }
        const RailRef& ref = rail_refs_[hellos[i].first];
        absl::StatusOr<std::shared_ptr<Completion>> resent;
        IgnoreError(groups_[ref.group]->RunAndWait(
            [&, fa = (*fi_addrs)[hellos[i].first]](ProgressGroup& pg) {
              resent = pg.Hello(ref.index_in_group, fa, hello);
              return absl::OkStatus();
            }));
        resend_at[i] = absl::InfinitePast();
        if (!resent.ok()) {
          answers[i] = resent.status();
          answered[i] = true;
          continue;
        }
        hellos[i].second = *std::move(resent);
      }
      absl::Status s = hellos[i].second->Wait(absl::InfinitePast());
      if (absl::IsDeadlineExceeded(s)) {
        all_answered = false;
        pending = hellos[i].second.get();
        continue;
      }
      answers[i] = s;
      if (!s.ok()) {
        refused_first[i] = std::min(refused_first[i], now);
        if (now + pause[i] < std::min(deadline, refused_first[i] + absl::Seconds(1))) {
          resend_at[i] = now + pause[i];
          pause[i] *= 2;
          all_answered = false;
          continue;
        }
      }
      answered[i] = true;
      reached = reached || s.ok();
    }
    if (all_answered || now >= deadline || (reached && now >= grace)) break;
    const absl::Time tick = std::min(deadline, now + absl::Milliseconds(1));
    if (pending != nullptr) {
      IgnoreError(pending->Wait(tick));
    } else {
      absl::SleepFor(tick - now);
    }
  }
  for (size_t i = 0; i < hellos.size() && status.ok(); ++i) {
    if (!answers[i].ok()) {
      status = absl::Status(answers[i].code(), absl::StrCat("warming up peer ", peer.node, ": ",
                                                            answers[i].message()));
    }
  }
  if (!inserted_all || !reached) {
    for (size_t g = 0; g < groups_.size(); ++g) {
      IgnoreError(groups_[g]->RunAndWait([addrs = GroupAddresses(g, *fi_addrs)](ProgressGroup& pg) {
        pg.ReleaseAddresses(addrs);
        return absl::OkStatus();
      }));
    }
    RemoveBell(*bell);
    return status;
  }
  for (size_t i = 0; i < hellos.size(); ++i) {
    if (answers[i].ok()) continue;
    const RailRef& ref = rail_refs_[hellos[i].first];
    groups_[ref.group]->Run([ref, id, why = answers[i]](ProgressGroup& pg) {
      pg.RailDown(ref.index_in_group, id, why);
    });
  }
  absl::MutexLock lock(&mu_);
  peers_.emplace(id, Peer{peer, *fi_addrs, *bell, woken});
  return id;
}

void Engine::RemoveBell(uint64_t bell) {
  if (bell == FI_ADDR_NOTAVAIL) return;
  IgnoreError(groups_[0]->RunAndWait([bell](ProgressGroup& pg) {
    pg.RemoveBell(bell);
    return absl::OkStatus();
  }));
}

uint64_t Engine::TakeRing(Peer& peer, absl::Time now, RingKind kind, bool throttled) {
  if (peer.bell == FI_ADDR_NOTAVAIL) return FI_ADDR_NOTAVAIL;
  if (kind != RingKind::kDone) {
    if (!throttled) {
      peer.woken = now;
      return peer.bell;
    }
    absl::Time& last = kind == RingKind::kBusy ? peer.busied : peer.woken;
    if (now - last < kBellRingEvery) return FI_ADDR_NOTAVAIL;
    last = now;
  }
  return peer.bell;
}

void Engine::RingBell(uint64_t bell, RingKind kind) {
  if (bell == FI_ADDR_NOTAVAIL || closing_.load()) return;
  groups_[0]->Run([bell, kind](ProgressGroup& pg) { pg.Ring(bell, kind); });
}

void Engine::Ring(PeerId id, absl::Time now, RingKind kind, bool throttled) {
  uint64_t bell = FI_ADDR_NOTAVAIL;
  {
    absl::MutexLock lock(&mu_);
    auto it = peers_.find(id);
    if (it != peers_.end()) bell = TakeRing(it->second, now, kind, throttled);
  }
  RingBell(bell, kind);
}

void Engine::TransferEnded(PeerId id) {
  uint64_t bell = FI_ADDR_NOTAVAIL;
  {
    absl::MutexLock lock(&mu_);
    auto it = peers_.find(id);
    if (it == peers_.end() || --it->second.live > 0) return;
    it->second.busied = absl::InfinitePast();  // the next transfer rings kBusy at once
    bell = TakeRing(it->second, absl::Now(), RingKind::kDone);
  }
  RingBell(bell, RingKind::kDone);
}

void Engine::OnRung(std::string_view sender, std::string_view payload) {
  const absl::Time now = absl::Now();
  const auto kind = payload.empty() ? RingKind::kWake : static_cast<RingKind>(payload[0]);
  woken_until_.store(absl::ToUnixNanos(now + kBellLinger), std::memory_order_relaxed);
  {
    absl::MutexLock lock(&bell_mu_);
    if (kind == RingKind::kBusy) busy_senders_[std::string(sender)] = now + kBellLinger;
    if (kind == RingKind::kDone) busy_senders_.erase(std::string(sender));
    absl::Time until = absl::InfinitePast();
    for (auto it = busy_senders_.begin(); it != busy_senders_.end();) {
      if (it->second <= now) {
        busy_senders_.erase(it++);
        continue;
      }
      until = std::max(until, it->second);
      ++it;
    }
    busy_until_.store(until == absl::InfinitePast() ? 0 : absl::ToUnixNanos(until),
                      std::memory_order_relaxed);
  }
  for (auto& g : groups_) g->Wake();
}

void Engine::FillPart(Part& part, size_t group) const {
  const TransferState& t = *part.transfer;
  const size_t n = groups_[group]->rail_count();
  part.dest = GroupAddresses(group, t.fi_addrs);
  part.src_descs.clear();
  for (const auto& [id, descs] : t.src_descs) {
    auto& mine = part.src_descs[id];
    for (size_t k = 0; k < n; ++k) mine.push_back(descs[EngineRail(group, k)]);
  }
  part.dst_keys.clear();
  for (const RegionDescriptor& d : t.dst_regions) {
    auto& keys = part.dst_keys.emplace_back();
    for (size_t k = 0; k < n; ++k) keys.push_back(d.keys[EngineRail(group, k) % t.remote_rails]);
  }
}

std::vector<RailCounters> Engine::Counters() const {
  std::vector<RailCounters> out;
  out.reserve(rail_refs_.size());
  for (const RailRef& r : rail_refs_) out.push_back(groups_[r.group]->counters(r.index_in_group));
  return out;
}

ProgressCounters Engine::Progress() const {
  ProgressCounters out;
  for (const auto& g : groups_) {
    const ProgressCounters c = g->progress();
    out.passes += c.passes;
    out.waits += c.waits;
  }
  return out;
}

size_t Engine::EngineRail(size_t group, size_t index) const {
  for (size_t r = 0; r < rail_refs_.size(); ++r) {
    if (rail_refs_[r].group == group && rail_refs_[r].index_in_group == index) return r;
  }
  return 0;  // unreachable for a rail the group has
}

std::vector<uint64_t> Engine::GroupAddresses(size_t group,
                                             const std::vector<uint64_t>& fi_addrs) const {
  std::vector<uint64_t> out(groups_[group]->rail_count(), FI_ADDR_NOTAVAIL);
  for (size_t r = 0; r < rails_.size(); ++r) {
    if (rail_refs_[r].group == group) out[rail_refs_[r].index_in_group] = fi_addrs[r];
  }
  return out;
}

absl::Status Engine::RemovePeer(PeerId id) {
  Peer peer;
  {
    absl::MutexLock lock(&mu_);
    auto it = peers_.find(id);
    if (it == peers_.end()) return absl::NotFoundError(absl::StrCat("no peer ", id));
    peer = std::move(it->second);
    peers_.erase(it);
  }
  const absl::Status gone =
      absl::UnavailableError(absl::StrCat("peer ", peer.address.node, " was removed"));
  for (size_t g = 0; g < groups_.size(); ++g) {
    IgnoreError(
        groups_[g]->RunAndWait([&, addrs = GroupAddresses(g, peer.fi_addrs)](ProgressGroup& pg) {
          pg.FailPeer(id, gone);
          pg.ReleaseAddresses(addrs);
          return absl::OkStatus();
        }));
  }
  RemoveBell(peer.bell);
  return absl::OkStatus();
}

absl::StatusOr<Transfer> Engine::Submit(TransferRequest req) {
  const absl::Time now = absl::Now();
  if (req.immediate && cq_data_size_ < 8 && (*req.immediate >> (8 * cq_data_size_)) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("immediate ", *req.immediate, " exceeds the ",
                                                   cq_data_size_, "-byte CQ data of ",
                                                   rails_[0].provider));
  }
  if (req.immediate && cq_data_size_ == 0) {
    return absl::UnimplementedError(rails_[0].provider + " carries no immediate data");
  }
  for (const Extent& e : req.dst) {
    if (e.region >= req.dst_regions.size()) {
      return absl::InvalidArgumentError(absl::StrCat("destination extent names region ", e.region,
                                                     " of ", req.dst_regions.size()));
    }
    if (!InBounds(e.offset, e.length, req.dst_regions[e.region].length)) {
      return absl::InvalidArgumentError(absl::StrCat("destination extent [", e.offset, ", +",
                                                     e.length, ") is outside its region of ",
                                                     req.dst_regions[e.region].length, " bytes"));
    }
  }

  struct LocalRegion {
    char* addr;
    std::vector<void*> descs;
  };
  absl::flat_hash_map<RegionId, LocalRegion> local;
  std::vector<uint64_t> fi_addrs;
  size_t remote_rails;
  auto state = std::make_shared<TransferState>();
  bool nothing_to_write = false;
  {
    absl::MutexLock lock(&mu_);
    auto peer = peers_.find(req.peer);
    if (peer == peers_.end()) return absl::NotFoundError(absl::StrCat("no peer ", req.peer));
    fi_addrs = peer->second.fi_addrs;
    remote_rails = peer->second.address.rails.size();
    for (const RegionDescriptor& d : req.dst_regions) {
      if (d.keys.size() < remote_rails) {
        return absl::InvalidArgumentError(absl::StrCat("destination region has ", d.keys.size(),
                                                       " keys for ", remote_rails, " rails"));
      }
    }
    const RegionEntry* last = nullptr;  // the region of the extent before
    RegionId last_id = 0;
    for (const Extent& e : req.src) {
      if (last == nullptr || e.region != last_id) {
        auto it = regions_.find(e.region);
        if (it == regions_.end()) return absl::NotFoundError(absl::StrCat("no region ", e.region));
        last = it->second.get();
        last_id = e.region;
        local.try_emplace(e.region, LocalRegion{last->addr, last->descs});
        if (last->device.kind == Device::Kind::kCuda) state->from_gpu = true;
      }
      if (!InBounds(e.offset, e.length, last->length)) {
        return absl::InvalidArgumentError(absl::StrCat("source extent [", e.offset, ", +", e.length,
                                                       ") is outside region ", e.region, " of ",
                                                       last->length, " bytes"));
      }
    }
    ASSIGN_OR_RETURN(Plan plan, PlanOnRails(req));
    if (plan.writes == 0 && req.immediate) {
      return absl::InvalidArgumentError("an immediate needs at least one byte to carry it");
    }
    for (auto& [id, region] : local) {
      ++regions_[id]->pins;
      state->pinned.push_back(id);
    }
    state->id = next_transfer_++;

    // Built under the lock only because it follows the plan; no libfabric call here.
    state->peer = req.peer;
    state->start = now;
    state->deadline =
        req.deadline == absl::InfiniteFuture() ? now + kDefaultTransferDeadline : req.deadline;
    state->engine = this;
    state->on_done = std::move(req.on_done);
    // What a part on any group needs to move a WRITE to another rail (FillPart).
    state->fi_addrs = fi_addrs;
    for (auto& [id, region] : local) state->src_descs[id] = region.descs;
    state->dst_regions = req.dst_regions;
    state->remote_rails = remote_rails;
    {
      absl::MutexLock slock(&state->mu);
      state->stats.bytes = plan.bytes;
      state->stats.writes = plan.writes;
      state->stats.bytes_per_rail.resize(rails_.size());
      state->stats.rail_seconds.resize(rails_.size());
      for (size_t r = 0; r < rails_.size(); ++r) {
        for (const PlannedWrite& w : plan.rails[r]) state->stats.bytes_per_rail[r] += w.length;
      }
    }
    if (plan.writes == 0) {
      for (auto& [id, region] : local) --regions_[id]->pins;
      nothing_to_write = true;
    } else {
      // A part for each group with WRITEs to post; the others are not woken.
      std::vector<std::unique_ptr<Part>> parts(groups_.size());
      for (size_t r = 0; r < rails_.size(); ++r) {
        if (plan.rails[r].empty()) continue;
        const size_t g = rail_refs_[r].group;
        auto& part = parts[g];
        if (!part) {
          part = std::make_unique<Part>();
          part->transfer = state;
        }
        for (const PlannedWrite& w : plan.rails[r]) part->unresolved += w.gathered ? 0 : 1;
      }
      for (auto& part : parts) {
        if (part) part->ops.reserve(part->unresolved);
      }
      size_t last_rail = 0;
      for (size_t r = 0; r < rails_.size(); ++r) {
        if (plan.rails[r].empty()) continue;
        Part& part = *parts[rail_refs_[r].group];
        const LocalRegion* src = nullptr;  // of the piece before
        RegionId src_id = 0;
        for (const PlannedWrite& w : plan.rails[r]) {
          const RegionDescriptor& dst = req.dst_regions[w.dst_region];
          if (src == nullptr || src_id != w.src_region) {
            src = &local[w.src_region];
            src_id = w.src_region;
          }
          if (!w.gathered) {
            WriteOp& op = part.ops.emplace_back();
            op.kind = OpKind::kWrite;
            op.part = &part;
            op.rail = rail_refs_[r].index_in_group;
            op.desc = src->descs[r];
            op.key = dst.keys[r % remote_rails];
            op.dest = fi_addrs[r];
            op.src_region = w.src_region;
            op.dst_region = w.dst_region;
          }
          WriteOp& op = part.ops.back();
          op.local[op.pieces] = {src->addr + w.src_offset, w.length};
          op.remote[op.pieces] = dst.RemoteAddress(w.dst_offset);
          ++op.pieces;
          op.length += w.length;
          op.deliver = !rails_[r].ordered_writes || op.length > rails_[r].max_order_waw_size;
          last_rail = r;
        }
        // On a rail that applies WRITEs in order, delivery-complete on its last WRITE of this
        // transfer covers every earlier one (fi_endpoint(3), msg_order FI_ORDER_RMA_WAW); the
        // others complete at transmit, which saves the provider an ack each.
        part.ops.back().deliver = true;
      }
      if (req.immediate) {
        Part& part = *parts[rail_refs_[last_rail].group];
        WriteOp& tail = part.ops.back();
        tail.immediate = true;
        tail.deliver = true;
        // The WRITE before the tail on its rail ends that rail's data: it needs its own
        // delivery completion before the tail may go.
        if (part.ops.size() > 1 && part.ops[part.ops.size() - 2].rail == tail.rail) {
          part.ops[part.ops.size() - 2].deliver = true;
        }
        tail.data = *req.immediate;
        tail.held = true;
        state->tail = &tail;
        state->tail_part = &part;
        state->tail_group = groups_[rail_refs_[last_rail].group].get();
      }
      int alive = 0, data_pending = 0;
      for (auto& part : parts) {
        if (!part) continue;
        part->data_unresolved = part->unresolved;
        if (state->tail_part == part.get()) --part->data_unresolved;
        ++alive;
        if (part->data_unresolved > 0) ++data_pending;
      }
      state->parts_alive.store(alive);
      state->parts_data_pending.store(data_pending + (state->tail != nullptr ? 1 : 0));
      // Counted before any part runs (it may end before Submit returns); the peer is told,
      // unless it polls anyway.
      if (!req.peer_awake) {
        ++peer->second.live;
        state->counted = true;
        RingBell(TakeRing(peer->second, now, RingKind::kBusy), RingKind::kBusy);
      }
      for (size_t g = 0; g < groups_.size(); ++g) {
        if (!parts[g]) continue;
        groups_[g]->Run(
            [p = std::move(parts[g])](ProgressGroup& pg) mutable { pg.AddPart(std::move(p)); });
      }
    }
  }
  // Outside the lock: on_done may call back into the engine.
  if (nothing_to_write) {
    {
      absl::MutexLock slock(&state->mu);
      state->retired = true;
    }
    state->Finish(absl::OkStatus());
  }
  return Transfer(state);
}

absl::StatusOr<Plan> Engine::PlanOnRails(const TransferRequest& req) {
  // As many rails as give each at least min_rail_share bytes, one at least: a small transfer
  // wakes one progress thread and completes without waiting for the others. Its rails start at
  // the calling progress thread's own (a small pull served where its request arrived stays on
  // that thread; group g's first rail is rail g), else at the next rail in turn.
  const size_t n = rails_.size();
  size_t used = n;
  if (options_.min_rail_share > 0) {
    uint64_t total = 0;
    for (const Extent& e : req.src) total += e.length;  // an overflow fails MakePlan
    used = static_cast<size_t>(std::clamp<uint64_t>(total / options_.min_rail_share, 1, n));
  }
  ASSIGN_OR_RETURN(Plan plan, MakePlan(req.src, req.dst, {used, max_write_, max_iov_}));
  if (used == n) return plan;
  const ProgressGroup* here = CurrentGroup();
  const size_t first =
      here != nullptr && here->index() < groups_.size() && groups_[here->index()].get() == here
          ? here->index()
          : next_first_rail_++ % n;
  std::vector<std::vector<PlannedWrite>> by_rail(n);
  for (size_t i = 0; i < used; ++i) by_rail[(first + i) % n] = std::move(plan.rails[i]);
  plan.rails = std::move(by_rail);
  return plan;
}

absl::StatusOr<TransferStats> Engine::Write(TransferRequest request) {
  ASSIGN_OR_RETURN(Transfer t, Submit(std::move(request)));
  return t.Wait();
}

void Engine::PostControl(PeerId peer, std::string payload,
                         std::function<void(const absl::Status&)> done, bool ring) {
  if (!done) done = [](const absl::Status&) {};
  if (payload.size() > options_.max_message) {
    return done(absl::InvalidArgumentError(absl::StrCat("control message of ", payload.size(),
                                                        " bytes exceeds ", options_.max_message)));
  }
  auto send = std::make_shared<ControlSend>();
  {
    absl::MutexLock lock(&mu_);
    auto it = peers_.find(peer);
    if (it == peers_.end()) return done(absl::NotFoundError(absl::StrCat("no peer ", peer)));
    send->fi_addrs = it->second.fi_addrs;
    send->first_rail = it->second.control_rail;
  }
  send->peer = peer;
  // Fragments of at most max_control bytes each (one for a short message), numbered so that the
  // receiver puts them together, and drops a message it has had already (a rail that stalled
  // may deliver it after all, once it went again on another).
  {
    const size_t chunk = options_.max_control - kFragmentHeader;
    const size_t count = std::max<size_t>(1, (payload.size() + chunk - 1) / chunk);
    const uint32_t id = next_message_.fetch_add(1, std::memory_order_relaxed);
    for (size_t i = 0; i < count; ++i) {
      std::string frame;
      ByteWriter w(&frame);
      w.U32(incarnation_);
      w.U32(id);
      w.U16(static_cast<uint16_t>(i));
      w.U16(static_cast<uint16_t>(count));
      w.Raw(std::string_view(payload).substr(i * chunk, chunk));
      send->frames.push_back(EncodeControl(ControlType::kFragment, node_id_, frame));
    }
  }
  send->done = std::move(done);
  // A message rings unless the peer waits for it: an idle peer polls its rails only every
  // kScanPeriod, and a request and its answer would each wait for that.
  if (ring) Ring(peer, absl::Now(), RingKind::kWake, /*throttled=*/false);
  SendFrames(std::move(send));
}

void Engine::SendFrames(std::shared_ptr<ControlSend> send) {
  const size_t rail = (send->first_rail + send->tries) % rails_.size();
  const RailRef ref = rail_refs_[rail];
  {
    absl::MutexLock lock(&send->mu);
    send->pending = send->frames.size();
    send->failed = absl::OkStatus();
  }
  groups_[ref.group]->Run([this, send, rail, ref](ProgressGroup& pg) {
    for (const std::string& frame : send->frames) {
      pg.QueueSend(ref.index_in_group, send->fi_addrs[rail], frame,
                   [this, send, rail](const absl::Status& s) {
                     bool last = false;
                     absl::Status failed;
                     {
                       absl::MutexLock lock(&send->mu);
                       if (!s.ok() && send->failed.ok()) send->failed = s;
                       last = --send->pending == 0;
                       failed = send->failed;
                     }
                     if (last) FramesSent(send, rail, failed);
                   });
    }
  });
}

void Engine::FramesSent(std::shared_ptr<ControlSend> send, size_t rail, absl::Status failed) {
  if (failed.ok() || closing_.load()) return send->done(failed);
  absl::StrAppend(&send->errors, send->errors.empty() ? "" : "; ", "rail ", rail, ": ",
                  failed.message());
  {
    // The peer's next messages start on the next rail.
    absl::MutexLock lock(&mu_);
    auto it = peers_.find(send->peer);
    if (it != peers_.end() && it->second.control_rail == rail) {
      it->second.control_rail = (rail + 1) % rails_.size();
    }
  }
  if (++send->tries >= rails_.size()) {
    return send->done(absl::UnavailableError(
        absl::StrCat("control message to the peer lost on every rail (", send->errors, ")")));
  }
  SendFrames(std::move(send));  // the whole message again on the next rail
}

void Engine::MoveControlRail(PeerId peer, absl::Duration settle) {
  const absl::Time now = absl::Now();
  absl::MutexLock lock(&mu_);
  auto it = peers_.find(peer);
  if (it == peers_.end() || now - it->second.control_moved < settle) return;
  it->second.control_moved = now;
  it->second.control_rail = (it->second.control_rail + 1) % rails_.size();
}

absl::Status Engine::SendControl(PeerId peer, std::string_view payload, absl::Time deadline) {
  auto done = std::make_shared<Completion>();
  PostControl(peer, std::string(payload), [done](const absl::Status& s) { done->Set(s); });
  return done->Wait(deadline);
}

void Engine::OnControl(std::string_view frame, size_t group, size_t index) {
  size_t rail = 0;
  while (rail + 1 < rail_refs_.size() &&
         (rail_refs_[rail].group != group || rail_refs_[rail].index_in_group != index)) {
    ++rail;
  }
  auto msg = DecodeControl(frame);
  if (!msg.ok()) {
    spdlog::warn("dropped control message: {}", msg.status().ToString());
    return;
  }
  if (msg->type == ControlType::kBell) OnRung(msg->sender, msg->payload);
  if (msg->type == ControlType::kUser && options_.on_control) {
    ArrivedOn(msg->sender, rail);
    options_.on_control(msg->sender, msg->payload);
  }
  if (msg->type == ControlType::kFragment) OnFragment(msg->sender, msg->payload, rail);
}

void Engine::ArrivedOn(std::string_view sender, size_t rail) {
  absl::MutexLock lock(&mu_);
  for (auto& [id, peer] : peers_) {
    if (peer.address.node == sender) peer.control_rail = rail;
  }
}

void Engine::OnFragment(std::string_view sender, std::string_view frame, size_t rail) {
  ByteReader r(frame);
  uint32_t incarnation = 0, id = 0;
  uint16_t index = 0, count = 0;
  if (!r.U32(&incarnation) || !r.U32(&id) || !r.U16(&index) || !r.U16(&count) || count == 0 ||
      index >= count || size_t{count} * options_.max_control > 2 * options_.max_message) {
    spdlog::warn("dropped a malformed control fragment from {}", std::string(sender));
    return;
  }
  const std::string from = absl::StrCat(std::string(sender), "/", incarnation);
  std::string whole;
  {
    absl::MutexLock lock(&fragments_mu_);
    if (Delivered(from, id)) return;  // a copy of one that came already
    if (count == 1) {
      MarkDelivered(from, id);
      whole = std::string(frame.substr(kFragmentHeader));
    } else {
      const absl::Time now = absl::Now();
      // Messages a sender began and never finished (it died, or a rail failed under it) go.
      for (auto it = partial_.begin(); it != partial_.end();) {
        if (now - it->second.started > kPartialMessageLife) {
          partial_bytes_ -= it->second.bytes;
          partial_.erase(it++);
        } else {
          ++it;
        }
      }
      const std::string key = absl::StrCat(from, "/", id);
      PartialMessage& m = partial_[key];
      if (m.parts.empty()) {
        m.parts.resize(count);
        m.started = now;
      }
      if (m.parts.size() != count || partial_bytes_ + r.left() > kPartialMessageBytes) {
        spdlog::warn(
            "dropped a control fragment from {}: inconsistent, or over the bytes kept "
            "for unfinished messages",
            std::string(sender));
        return;
      }
      if (!m.parts[index].empty()) return;  // a copy of a fragment that came already
      m.parts[index] = std::string(frame.substr(kFragmentHeader));
      m.bytes += r.left();
      partial_bytes_ += r.left();
      if (++m.received < count) return;
      whole.reserve(m.bytes);
      for (const std::string& part : m.parts) whole += part;
      partial_bytes_ -= m.bytes;
      partial_.erase(key);
      MarkDelivered(from, id);
    }
  }
  ArrivedOn(sender, rail);
  if (options_.on_control) options_.on_control(sender, whole);
}

bool Engine::Delivered(const std::string& from, uint32_t id) const {
  auto it = delivered_.find(from);
  if (it == delivered_.end()) return false;
  return id <= it->second.floor || it->second.above.contains(id);
}

void Engine::MarkDelivered(const std::string& from, uint32_t id) {
  auto [it, added] = delivered_.try_emplace(from);
  if (added) {
    delivered_order_.push_back(from);  // its ids start at 1 (next_message_), floor 0
    if (delivered_order_.size() > kSendersKept) {
      delivered_.erase(delivered_order_.front());
      delivered_order_.pop_front();
    }
  }
  Seen& seen = it->second;
  seen.above.insert(id);
  while (!seen.above.empty() && *seen.above.begin() == seen.floor + 1) {
    seen.floor = *seen.above.begin();
    seen.above.erase(seen.above.begin());
  }
  // A sender numbers the messages of all its peers in one sequence: the ids another peer got
  // leave gaps here that never fill. Past kSeenAboveKept ids the floor moves up over them (a
  // message that comes that many ids late is taken for a copy).
  while (seen.above.size() > kSeenAboveKept) {
    seen.floor = *seen.above.begin();
    seen.above.erase(seen.above.begin());
  }
}

void Engine::OnImmediate(uint64_t tag) {
  std::shared_ptr<ImmediateCounter> fired_counter;
  {
    absl::MutexLock lock(&imm_mu_);
    auto it = imm_counters_.find(tag);
    if (it == imm_counters_.end()) {
      ++imm_unclaimed_[tag];
      return;
    }
    bool fired = false;
    if (it->second->Add(1, &fired) > 0) ++imm_unclaimed_[tag];
    if (fired) {
      fired_counter = std::move(it->second);
      imm_counters_.erase(it);
    }
  }
  if (fired_counter) fired_counter->Fire();
}

absl::StatusOr<std::shared_ptr<ImmediateCounter>> Engine::ExpectImmediates(
    uint64_t tag, uint64_t count, std::function<void()> on_fire) {
  if (count == 0) return absl::InvalidArgumentError("an immediate counter needs a count");
  std::shared_ptr<ImmediateCounter> counter(new ImmediateCounter(count, std::move(on_fire)));
  bool fired = false;
  {
    absl::MutexLock lock(&imm_mu_);
    if (imm_counters_.contains(tag)) {
      return absl::AlreadyExistsError(absl::StrCat("a counter for immediate ", tag, " is armed"));
    }
    auto unclaimed = imm_unclaimed_.find(tag);
    if (unclaimed != imm_unclaimed_.end()) {
      const uint64_t left = counter->Add(unclaimed->second, &fired);
      if (left == 0) {
        imm_unclaimed_.erase(unclaimed);
      } else {
        unclaimed->second = left;
      }
    }
    if (!fired) imm_counters_.emplace(tag, counter);
  }
  if (fired) counter->Fire();
  return counter;
}

}  // namespace ferry::engine
