#include "engine/topology.h"

#include <hwloc.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace ferry::engine {
namespace {

constexpr unsigned kNvidia = 0x10de;

std::string PciString(hwloc_obj_t obj) {
  const auto& p = obj->attr->pcidev;
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%04x:%02x:%02x.%01x", p.domain, p.bus, p.dev, p.func);
  return buf;
}

bool IsGpu(hwloc_obj_t obj) {
  return (obj->attr->pcidev.class_id >> 8) == 0x03 && obj->attr->pcidev.vendor_id == kNvidia;
}

bool IsNic(hwloc_obj_t obj) { return (obj->attr->pcidev.class_id >> 8) == 0x02; }

// A PCI-to-PCI bridge: a PCIe switch port, below the host bridge.
bool IsSwitch(hwloc_obj_t obj) {
  return obj != nullptr && obj->type == HWLOC_OBJ_BRIDGE &&
         obj->attr->bridge.upstream_type == HWLOC_OBJ_BRIDGE_PCI;
}

// hwloc_get_common_ancestor_obj does not walk I/O objects (their depths are virtual): the
// first ancestor of `b` that is also one of `a`, and how many levels it is below the root.
std::pair<hwloc_obj_t, int> CommonAncestor(hwloc_obj_t a, hwloc_obj_t b) {
  for (hwloc_obj_t y = b; y != nullptr; y = y->parent) {
    for (hwloc_obj_t x = a; x != nullptr; x = x->parent) {
      if (x != y) continue;
      int level = 0;
      for (hwloc_obj_t up = y->parent; up != nullptr; up = up->parent) ++level;
      return {y, level};
    }
  }
  return {nullptr, -1};
}

std::string OsDevName(hwloc_obj_t pci, hwloc_obj_osdev_type_t type) {
  for (hwloc_obj_t c = pci->io_first_child; c != nullptr; c = c->next_sibling) {
    if (c->type == HWLOC_OBJ_OS_DEVICE && c->attr->osdev.type == type && c->name != nullptr) {
      return c->name;
    }
  }
  return "";
}

bool HasOsDev(hwloc_obj_t pci, const std::string& name) {
  for (hwloc_obj_t c = pci->io_first_child; c != nullptr; c = c->next_sibling) {
    if (c->type == HWLOC_OBJ_OS_DEVICE && c->name != nullptr && name == c->name) return true;
  }
  return false;
}

std::string BitmapString(hwloc_const_bitmap_t b) {
  char* s = nullptr;
  hwloc_bitmap_asprintf(&s, b);
  std::string out = s != nullptr ? s : "";
  std::free(s);
  return out;
}

}  // namespace

struct Topology::Impl {
  hwloc_topology_t topo = nullptr;
  ~Impl() {
    if (topo != nullptr) hwloc_topology_destroy(topo);
  }
  std::vector<hwloc_obj_t> Pci(bool (*pred)(hwloc_obj_t)) const {
    std::vector<hwloc_obj_t> out;
    for (hwloc_obj_t o = nullptr; (o = hwloc_get_next_pcidev(topo, o)) != nullptr;) {
      if (pred(o)) out.push_back(o);
    }
    std::sort(out.begin(), out.end(),
              [](hwloc_obj_t a, hwloc_obj_t b) { return PciString(a) < PciString(b); });
    return out;
  }
  hwloc_obj_t Find(const NicRef& nic) const {
    if (!nic.pci.empty()) return hwloc_get_pcidev_by_busidstring(topo, nic.pci.c_str());
    for (hwloc_obj_t o = nullptr; (o = hwloc_get_next_pcidev(topo, o)) != nullptr;) {
      if (IsNic(o) && HasOsDev(o, nic.name)) return o;
    }
    return nullptr;
  }
  // Fills the group's cores and NUMA nodes from the CPU-side objects local to `objs` (the
  // whole machine when there is none).
  void Locate(const std::vector<hwloc_obj_t>& objs, RailGroup* g) const {
    hwloc_bitmap_t cpus = hwloc_bitmap_alloc(), nodes = hwloc_bitmap_alloc();
    for (hwloc_obj_t o : objs) {
      hwloc_obj_t local = hwloc_get_non_io_ancestor_obj(topo, o);
      hwloc_bitmap_or(cpus, cpus, local->cpuset);
      hwloc_bitmap_or(nodes, nodes, local->nodeset);
    }
    if (hwloc_bitmap_iszero(cpus)) {
      hwloc_bitmap_copy(cpus, hwloc_topology_get_topology_cpuset(topo));
      hwloc_bitmap_copy(nodes, hwloc_topology_get_topology_nodeset(topo));
    }
    const int ncores = hwloc_get_nbobjs_inside_cpuset_by_type(topo, cpus, HWLOC_OBJ_CORE);
    for (int i = 0; i < ncores; ++i) {
      g->cores.push_back(
          hwloc_get_obj_inside_cpuset_by_type(topo, cpus, HWLOC_OBJ_CORE, static_cast<unsigned>(i))
              ->os_index);
    }
    for (int n = hwloc_bitmap_first(nodes); n >= 0; n = hwloc_bitmap_next(nodes, n)) {
      g->numa_nodes.push_back(static_cast<unsigned>(n));
    }
    g->cpuset = BitmapString(cpus);
    g->nodeset = BitmapString(nodes);
    hwloc_bitmap_free(cpus);
    hwloc_bitmap_free(nodes);
  }
};

Topology::Topology(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Topology::~Topology() = default;

absl::StatusOr<std::unique_ptr<Topology>> Topology::Discover() {
  auto impl = std::make_unique<Impl>();
  if (hwloc_topology_init(&impl->topo) != 0) {
    return absl::InternalError(absl::StrCat("hwloc_topology_init: ", strerror(errno)));
  }
  // PCI devices come from Linux's sysfs (the linux component): the libpciaccess-based "pci"
  // plugin (libhwloc-plugins) finds the same devices and leaks at exit (LeakSanitizer fails
  // every process). Without the plugin installed there is nothing to leave out (EINVAL).
  (void)hwloc_topology_set_components(impl->topo, HWLOC_TOPOLOGY_COMPONENTS_FLAG_BLACKLIST, "pci");
  if (hwloc_topology_set_io_types_filter(impl->topo, HWLOC_TYPE_FILTER_KEEP_IMPORTANT) != 0 ||
      hwloc_topology_load(impl->topo) != 0) {
    return absl::InternalError(absl::StrCat("hwloc cannot read this machine: ", strerror(errno)));
  }
  return std::unique_ptr<Topology>(new Topology(std::move(impl)));
}

absl::StatusOr<std::unique_ptr<Topology>> Topology::FromXml(const std::string& path) {
  auto impl = std::make_unique<Impl>();
  if (hwloc_topology_init(&impl->topo) != 0 ||
      hwloc_topology_set_io_types_filter(impl->topo, HWLOC_TYPE_FILTER_KEEP_IMPORTANT) != 0 ||
      hwloc_topology_set_xml(impl->topo, path.c_str()) != 0 ||
      hwloc_topology_load(impl->topo) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("cannot load hwloc XML ", path));
  }
  return std::unique_ptr<Topology>(new Topology(std::move(impl)));
}

std::vector<std::string> Topology::Gpus() const {
  std::vector<std::string> out;
  for (hwloc_obj_t o : impl_->Pci(IsGpu)) out.push_back(PciString(o));
  return out;
}

std::vector<NicRef> Topology::Nics() const {
  std::vector<NicRef> out;
  for (hwloc_obj_t o : impl_->Pci(IsNic)) {
    std::string name = OsDevName(o, HWLOC_OBJ_OSDEV_OPENFABRICS);
    if (name.empty()) name = OsDevName(o, HWLOC_OBJ_OSDEV_NETWORK);
    if (name.empty()) name = PciString(o);
    out.push_back({name, PciString(o)});
  }
  return out;
}

std::vector<RailGroup> Topology::Place(const std::vector<NicRef>& nics) const {
  const std::vector<hwloc_obj_t> gpus = impl_->Pci(IsGpu);
  std::vector<std::vector<size_t>> gpu_nics(gpus.size());
  std::vector<size_t> host_nics;
  std::vector<hwloc_obj_t> found(nics.size());
  // NICs by the GPUs under their switch (the deepest switch shared with any GPU).
  std::map<std::vector<size_t>, std::vector<size_t>> by_switch;
  for (size_t n = 0; n < nics.size(); ++n) {
    found[n] = impl_->Find(nics[n]);
    std::vector<size_t> best;
    int best_depth = -1;
    for (size_t g = 0; found[n] != nullptr && g < gpus.size(); ++g) {
      const auto [common, level] = CommonAncestor(found[n], gpus[g]);
      if (!IsSwitch(common)) continue;
      if (level > best_depth) {
        best = {g};
        best_depth = level;
      } else if (level == best_depth) {
        best.push_back(g);
      }
    }
    if (best.empty()) {
      host_nics.push_back(n);
    } else {
      by_switch[best].push_back(n);
    }
  }
  for (const auto& [g, n] : by_switch) {
    if (n.size() >= g.size()) {  // dealt evenly
      for (size_t j = 0; j < n.size(); ++j) gpu_nics[g[j % g.size()]].push_back(n[j]);
    } else {  // shared
      for (size_t i = 0; i < g.size(); ++i) gpu_nics[g[i]].push_back(n[i % n.size()]);
    }
  }
  std::vector<RailGroup> out;
  for (size_t g = 0; g < gpus.size(); ++g) {
    RailGroup group;
    group.gpu = static_cast<int>(g);
    group.gpu_pci = PciString(gpus[g]);
    for (size_t n : gpu_nics[g]) group.nics.push_back(nics[n]);
    impl_->Locate({gpus[g]}, &group);
    out.push_back(std::move(group));
  }
  if (!host_nics.empty()) {
    RailGroup host;
    std::vector<hwloc_obj_t> located;
    for (size_t n : host_nics) {
      host.nics.push_back(nics[n]);
      if (found[n] != nullptr) located.push_back(found[n]);
    }
    impl_->Locate(located, &host);
    out.push_back(std::move(host));
  }
  return out;
}

absl::Status Topology::Bind(const RailGroup& group) const {
  hwloc_bitmap_t cpus = hwloc_bitmap_alloc(), nodes = hwloc_bitmap_alloc();
  hwloc_bitmap_sscanf(cpus, group.cpuset.c_str());
  hwloc_bitmap_sscanf(nodes, group.nodeset.c_str());
  absl::Status s;
  if (hwloc_set_cpubind(impl_->topo, cpus, HWLOC_CPUBIND_THREAD) != 0) {
    s = absl::InternalError(absl::StrCat("binding to cores ", group.cpuset, ": ", strerror(errno)));
  } else {
    // Best effort: a kernel without NUMA policy support refuses, and first-touch placement by
    // the pinned thread does the same job there.
    (void)hwloc_set_membind(impl_->topo, nodes, HWLOC_MEMBIND_BIND,
                            HWLOC_MEMBIND_THREAD | HWLOC_MEMBIND_BYNODESET);
  }
  hwloc_bitmap_free(cpus);
  hwloc_bitmap_free(nodes);
  return s;
}

std::string DescribePlacement(const std::vector<RailGroup>& groups) {
  std::string out;
  for (const RailGroup& g : groups) {
    std::vector<std::string> nics;
    for (const NicRef& n : g.nics)
      nics.push_back(n.pci.empty() ? n.name : n.name + " (" + n.pci + ")");
    absl::StrAppend(
        &out,
        g.gpu < 0 ? std::string("host memory") : absl::StrCat("gpu", g.gpu, " (", g.gpu_pci, ")"),
        " -> ",
        nics.empty() ? "no NIC under its switch (uses the host group)" : absl::StrJoin(nics, ", "),
        " -> numa ", absl::StrJoin(g.numa_nodes, ","), " -> cores ", absl::StrJoin(g.cores, ","),
        "\n");
  }
  return out;
}

}  // namespace ferry::engine
