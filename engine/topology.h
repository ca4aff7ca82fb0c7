// Where rails live: GPUs, NICs, NUMA nodes and cores from hwloc, and which NICs (rails) each
// GPU's progress thread drives. Thread-compatible; Bind is thread-safe.
#ifndef FERRY_ENGINE_TOPOLOGY_H_
#define FERRY_ENGINE_TOPOLOGY_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace ferry::engine {

// A NIC as libfabric names it: its domain name, and its PCI address ("0000:10:1b.0") when
// the provider reports one (efa, verbs); tcp and shm domains often have none.
struct NicRef {
  std::string name;
  std::string pci;
};

// The rails one progress thread drives, and where that thread runs.
struct RailGroup {
  int gpu = -1;  // index in PCI bus order; -1: the host-memory group
  std::string gpu_pci;
  std::vector<NicRef> nics;
  std::vector<unsigned> numa_nodes;  // OS indexes
  std::vector<unsigned> cores;       // OS indexes of the cores the thread may run on
  std::string cpuset;                // the same as an hwloc bitmap string, for Bind
  std::string nodeset;
};

class Topology {
 public:
  // This machine, with its PCI devices. kInternal: hwloc failed.
  static absl::StatusOr<std::unique_ptr<Topology>> Discover();
  // A topology saved as hwloc XML (tests; `ferry topo --xml`). kInvalidArgument: unreadable.
  static absl::StatusOr<std::unique_ptr<Topology>> FromXml(const std::string& path);
  ~Topology();
  Topology(const Topology&) = delete;
  Topology& operator=(const Topology&) = delete;

  // NVIDIA GPUs (PCI display controllers), in PCI bus order: the PCI addresses.
  std::vector<std::string> Gpus() const;
  // Network PCI devices: named by their OpenFabrics device (rdmap16s27, mlx5_0), else their
  // network interface (eth0), else their PCI address.
  std::vector<NicRef> Nics() const;

  // One group per GPU with the NICs under its own PCIe switch (the deepest common ancestor of
  // the two is a PCI-to-PCI bridge): a switch's NICs are dealt evenly to its GPUs, or shared
  // when it has fewer NICs than GPUs. NICs with no GPU under their switch, or that hwloc cannot
  // find (by PCI address, else by name), form the host-memory group (gpu -1), last. Each group runs
  // on the cores of its GPU's (or its NICs') package or NUMA node. Every GPU has a group, with no
  // NICs when none is under its switch (its transfers then go through the host group).
  std::vector<RailGroup> Place(const std::vector<NicRef>& nics) const;

  // Binds the calling thread to the group's cores and its memory allocations to the group's
  // NUMA nodes (where the kernel allows it). kInternal: the CPU binding failed.
  absl::Status Bind(const RailGroup& group) const;

 private:
  struct Impl;
  explicit Topology(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// What `ferry topo` prints: GPU -> NICs -> NUMA nodes -> cores, one group per line.
std::string DescribePlacement(const std::vector<RailGroup>& groups);

}  // namespace ferry::engine

#endif  // FERRY_ENGINE_TOPOLOGY_H_
