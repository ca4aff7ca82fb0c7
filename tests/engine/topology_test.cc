// Placement of rails on machines described as hwloc XML written here: a p5.48xlarge-like
// machine, fewer NICs than GPUs, NICs on no switch, no GPUs; and binding on this machine.
#include "engine/topology.h"

#include <gmock/gmock.h>
#include <sched.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace ferry::engine {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

// What sits under one PCIe switch (or, with switched = false, straight under a host bridge).
struct Switch {
  int gpus = 0;
  int nics = 0;
  int nvme = 0;
  bool switched = true;
};

struct Machine {
  int cores_per_package = 4;
  std::vector<std::vector<Switch>> packages;  // the switches of each package
};

// hwloc's bitmap string ("0x0000ff00,0xffffffff": 32-bit words, most significant first).
std::string Bits(int first, int count) {
  const int words = (first + count + 31) / 32;
  std::string out;
  for (int w = words - 1; w >= 0; --w) {
    uint32_t v = 0;
    for (int b = 0; b < 32; ++b) {
      const int bit = w * 32 + b;
      if (bit >= first && bit < first + count) v |= uint32_t{1} << b;
    }
    absl::StrAppend(&out, out.empty() ? "" : ",", absl::StrFormat("0x%08x", v));
  }
  return out;
}

// Devices get buses 0x10 apart per switch: GPUs first, then NICs (named rdmapBUSs0), then
// NVMe drives.
std::string Xml(const Machine& m) {
  int gp = 1, bus_base = 0;
  const int npk = static_cast<int>(m.packages.size()), cpp = m.cores_per_package;
  auto sets = [](const std::string& cpus, const std::string& nodes) {
    return absl::StrCat(" cpuset=\"", cpus, "\" complete_cpuset=\"", cpus, "\" nodeset=\"", nodes,
                        "\" complete_nodeset=\"", nodes, "\"");
  };
  std::string x = R"(<?xml version="1.0" encoding="UTF-8"?>
<!DOCTYPE topology SYSTEM "hwloc2.dtd">
<topology version="2.0">
)";
  absl::StrAppend(&x, "<object type=\"Machine\" os_index=\"0\"",
                  sets(Bits(0, npk * cpp), Bits(0, npk)), " allowed_cpuset=\"", Bits(0, npk * cpp),
                  "\" allowed_nodeset=\"", Bits(0, npk), "\" gp_index=\"", gp++, "\">\n");
  for (int p = 0; p < npk; ++p) {
    const std::string pk = sets(Bits(p * cpp, cpp), Bits(p, 1));
    absl::StrAppend(&x, "<object type=\"Package\" os_index=\"", p, "\"", pk, " gp_index=\"", gp++,
                    "\">\n");
    absl::StrAppend(&x, "<object type=\"NUMANode\" os_index=\"", p, "\"", pk, " gp_index=\"", gp++,
                    "\" local_memory=\"1073741824\"/>\n");
    for (int c = p * cpp; c < (p + 1) * cpp; ++c) {
      const std::string cs = sets(Bits(c, 1), Bits(p, 1));
      const int core_gp = gp++, pu_gp = gp++;
      absl::StrAppend(&x, "<object type=\"Core\" os_index=\"", c, "\"", cs, " gp_index=\"", core_gp,
                      "\"><object type=\"PU\" os_index=\"", c, "\"", cs, " gp_index=\"", pu_gp,
                      "\"/></object>\n");
    }
    for (const Switch& s : m.packages[static_cast<size_t>(p)]) {
      bus_base += 0x10;
      const int devices = s.gpus + s.nics + s.nvme;
      absl::StrAppend(&x, "<object type=\"Bridge\" gp_index=\"", gp++,
                      "\" bridge_type=\"0-1\" depth=\"0\" bridge_pci=\"",
                      absl::StrFormat("0000:[%02x-%02x]", bus_base, bus_base + devices), "\">\n");
      if (s.switched) {
        absl::StrAppend(&x, "<object type=\"Bridge\" gp_index=\"", gp++, "\" pci_busid=\"",
                        absl::StrFormat("0000:%02x:00.0", bus_base),
                        "\" pci_type=\"0604 [1000:c010] [0000:0000] 00\" pci_link_speed=\"0\" "
                        "bridge_type=\"1-1\" depth=\"1\" bridge_pci=\"",
                        absl::StrFormat("0000:[%02x-%02x]", bus_base + 1, bus_base + devices),
                        "\">\n");
      }
      int bus = bus_base + 1;
      auto device = [&](const std::string& type, const std::string& osdev) {
        absl::StrAppend(&x, "<object type=\"PCIDev\" gp_index=\"", gp++, "\" pci_busid=\"",
                        absl::StrFormat("0000:%02x:00.0", bus), "\" pci_type=\"", type,
                        "\" pci_link_speed=\"0\"", osdev.empty() ? "/>\n" : ">\n");
        if (!osdev.empty()) {
          absl::StrAppend(&x, "<object type=\"OSDev\" gp_index=\"", gp++, "\" name=\"", osdev,
                          "\" osdev_type=\"3\"/></object>\n");
        }
        ++bus;
      };
      for (int i = 0; i < s.gpus; ++i) device("0302 [10de:2330] [10de:16c1] a1", "");
      for (int i = 0; i < s.nics; ++i)
        device("0200 [1d0f:efa1] [0000:0000] 00", absl::StrCat("rdmap", bus, "s0"));
      for (int i = 0; i < s.nvme; ++i) device("0108 [1d0f:cd01] [0000:0000] 00", "");
      absl::StrAppend(&x, s.switched ? "</object>\n</object>\n" : "</object>\n");
    }
    absl::StrAppend(&x, "</object>\n");
  }
  absl::StrAppend(&x, "</object>\n</topology>\n");
  return x;
}

std::unique_ptr<Topology> Load(const Machine& m) {
  const auto path =
      std::filesystem::temp_directory_path() / absl::StrCat("ferry-topo-", getpid(), ".xml");
  std::ofstream(path) << Xml(m);
  auto t = Topology::FromXml(path.string());
  std::filesystem::remove(path);
  EXPECT_TRUE(t.ok()) << t.status();
  return t.ok() ? std::move(*t) : nullptr;
}

std::vector<std::string> Names(const RailGroup& g) {
  std::vector<std::string> out;
  for (const NicRef& n : g.nics) out.push_back(n.name);
  return out;
}

std::vector<unsigned> Range(unsigned first, unsigned count) {
  std::vector<unsigned> out;
  for (unsigned i = 0; i < count; ++i) out.push_back(first + i);
  return out;
}

TEST(TopologyTest, P5LikeMachineGivesEachGpuTheFourNicsOfItsSwitchAndItsPackagesCores) {
  const Switch sw{.gpus = 1, .nics = 4, .nvme = 1};
  auto topo = Load({.cores_per_package = 48, .packages = {{sw, sw, sw, sw}, {sw, sw, sw, sw}}});
  ASSERT_NE(topo, nullptr);
  EXPECT_EQ(topo->Gpus().size(), 8u);
  ASSERT_EQ(topo->Nics().size(), 32u);
  const std::vector<RailGroup> groups = topo->Place(topo->Nics());
  ASSERT_EQ(groups.size(), 8u);  // no NIC is left for a host group
  for (int g = 0; g < 8; ++g) {
    const RailGroup& group = groups[static_cast<size_t>(g)];
    const int bus = 0x10 * (g + 1);
    EXPECT_EQ(group.gpu, g);
    EXPECT_EQ(group.gpu_pci, absl::StrFormat("0000:%02x:00.0", bus + 1));
    EXPECT_THAT(
        Names(group),
        ElementsAre(absl::StrCat("rdmap", bus + 2, "s0"), absl::StrCat("rdmap", bus + 3, "s0"),
                    absl::StrCat("rdmap", bus + 4, "s0"), absl::StrCat("rdmap", bus + 5, "s0")));
    const unsigned package = g < 4 ? 0 : 1;
    EXPECT_THAT(group.numa_nodes, ElementsAre(package));
    EXPECT_EQ(group.cores, Range(package * 48, 48));
  }
}

TEST(TopologyTest, NicsFoundByNameWhenTheProviderGivesNoPciAddress) {
  const Switch sw{.gpus = 1, .nics = 2};
  auto topo = Load({.packages = {{sw, sw}}});
  ASSERT_NE(topo, nullptr);
  const std::vector<RailGroup> groups = topo->Place({{"rdmap34s0", ""}, {"rdmap19s0", ""}});
  ASSERT_EQ(groups.size(), 2u);
  EXPECT_THAT(Names(groups[0]), ElementsAre("rdmap19s0"));
  EXPECT_THAT(Names(groups[1]), ElementsAre("rdmap34s0"));
}

TEST(TopologyTest, FewerNicsThanGpusAreSharedByTheGpusOfTheirSwitch) {
  const Switch sw{.gpus = 2, .nics = 1};
  auto topo = Load({.packages = {{sw, sw}}});
  ASSERT_NE(topo, nullptr);
  const std::vector<RailGroup> groups = topo->Place(topo->Nics());
  ASSERT_EQ(groups.size(), 4u);
  EXPECT_THAT(Names(groups[0]), ElementsAre("rdmap19s0"));
  EXPECT_THAT(Names(groups[1]), ElementsAre("rdmap19s0"));
  EXPECT_THAT(Names(groups[2]), ElementsAre("rdmap35s0"));
  EXPECT_THAT(Names(groups[3]), ElementsAre("rdmap35s0"));
}

TEST(TopologyTest, MoreNicsThanGpusOnASwitchAreDealtEvenly) {
  auto topo = Load({.packages = {{Switch{.gpus = 2, .nics = 4}}}});
  ASSERT_NE(topo, nullptr);
  const std::vector<RailGroup> groups = topo->Place(topo->Nics());
  ASSERT_EQ(groups.size(), 2u);
  EXPECT_THAT(Names(groups[0]), ElementsAre("rdmap19s0", "rdmap21s0"));
  EXPECT_THAT(Names(groups[1]), ElementsAre("rdmap20s0", "rdmap22s0"));
}

TEST(TopologyTest, NicsOnNoSwitchGoToTheHostGroupAndGpusWithoutNicsHaveNone) {
  const Switch gpu_only{.gpus = 1};
  const Switch bare_nics{.nics = 2, .switched = false};
  auto topo = Load({.packages = {{gpu_only, bare_nics}, {gpu_only}}});
  ASSERT_NE(topo, nullptr);
  const std::vector<RailGroup> groups = topo->Place(topo->Nics());
  ASSERT_EQ(groups.size(), 3u);
  EXPECT_THAT(Names(groups[0]), IsEmpty());
  EXPECT_THAT(Names(groups[1]), IsEmpty());
  EXPECT_EQ(groups[2].gpu, -1);
  EXPECT_THAT(Names(groups[2]), ElementsAre("rdmap33s0", "rdmap34s0"));
  EXPECT_THAT(groups[2].numa_nodes, ElementsAre(0u));  // the NICs' package, not the machine
  EXPECT_EQ(groups[2].cores, Range(0, 4));
  EXPECT_NE(DescribePlacement(groups).find("gpu1 (0000:31:00.0) -> no NIC"), std::string::npos)
      << DescribePlacement(groups);
}

TEST(TopologyTest, NoGpusPutsEveryNicInTheHostGroupOnTheirPackages) {
  const Switch nics{.nics = 2};
  auto topo = Load({.packages = {{nics, nics}, {nics, nics}}});
  ASSERT_NE(topo, nullptr);
  EXPECT_THAT(topo->Gpus(), IsEmpty());
  const std::vector<RailGroup> groups = topo->Place(topo->Nics());
  ASSERT_EQ(groups.size(), 1u);
  EXPECT_EQ(groups[0].gpu, -1);
  EXPECT_EQ(groups[0].nics.size(), 8u);
  EXPECT_THAT(groups[0].numa_nodes, ElementsAre(0u, 1u));
  EXPECT_EQ(groups[0].cores, Range(0, 8));
}

TEST(TopologyTest, UnknownNicsRunOnTheWholeMachine) {
  auto topo = Load({.packages = {{Switch{.gpus = 1, .nics = 1}}, {}}});
  ASSERT_NE(topo, nullptr);
  const std::vector<RailGroup> groups = topo->Place({{"veth0", ""}, {"lo", ""}});
  ASSERT_EQ(groups.size(), 2u);
  EXPECT_THAT(Names(groups[0]), IsEmpty());
  EXPECT_THAT(Names(groups[1]), ElementsAre("veth0", "lo"));
  EXPECT_EQ(groups[1].cores, Range(0, 8));
}

TEST(TopologyTest, BadXmlIsAClearError) {
  auto t = Topology::FromXml("/nonexistent/topology.xml");
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(TopologyTest, BindsThisThreadToItsGroupsCores) {
  auto topo = Topology::Discover();
  ASSERT_TRUE(topo.ok()) << topo.status();
  const std::vector<RailGroup> groups = (*topo)->Place({{"lo", ""}});
  ASSERT_FALSE(groups.empty());
  const RailGroup& host = groups.back();
  ASSERT_EQ(host.gpu, -1);
  ASSERT_FALSE(host.cores.empty());
  RailGroup one = host;
  // Narrow it to its first core, so that the binding is visible.
  one.cpuset = absl::StrFormat("0x%08x", 1u << host.cores[0]);
  std::thread t([&] {
    ASSERT_TRUE((*topo)->Bind(one).ok());
    cpu_set_t set;
    CPU_ZERO(&set);
    ASSERT_EQ(sched_getaffinity(0, sizeof(set), &set), 0);
    EXPECT_EQ(CPU_COUNT(&set), 1);
    EXPECT_TRUE(CPU_ISSET(host.cores[0], &set));
  });
  t.join();
}

}  // namespace
}  // namespace ferry::engine
