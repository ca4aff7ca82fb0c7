#include "engine/types.h"

#include <fcntl.h>
#include <gmock/gmock.h>
#include <malloc.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "base/crc32c.h"
#include "base/hex.h"
#include "base/ids.h"
#include "engine/control.h"
#include "engine/fabric.h"
#include "nlohmann/json.hpp"
#include "tests/testing/status_matchers.h"

namespace ferry::engine {
namespace {

using ::ferry::testing::StatusIs;

TEST(Crc32cTest, MatchesTheKnownValuesAndExtendsPieceByPiece) {
  EXPECT_EQ(Crc32c(0, "123456789", 9), 0xe3069283u);  // RFC 3720's check value
  EXPECT_EQ(Crc32c(0, "", 0), 0u);
  std::string bytes(100003, '\0');
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<char>(i * 131 + 7);
  const uint32_t whole = Crc32c(0, bytes.data(), bytes.size());
  uint32_t pieces = 0;
  for (size_t at = 0; at < bytes.size(); at += 4093) {
    pieces = Crc32c(pieces, bytes.data() + at, std::min<size_t>(4093, bytes.size() - at));
  }
  EXPECT_EQ(pieces, whole);
  bytes[5000] ^= 1;
  EXPECT_NE(Crc32c(0, bytes.data(), bytes.size()), whole);
}

TEST(DeviceTest, ParsesHostAndCuda) {
  ASSERT_OK_AND_ASSIGN(Device host, Device::Parse("host"));
  EXPECT_EQ(host, Device::Host());
  ASSERT_OK_AND_ASSIGN(Device gpu, Device::Parse("cuda:3"));
  EXPECT_EQ(gpu, Device::Cuda(3));
  EXPECT_EQ(gpu.ToString(), "cuda:3");
}

TEST(DeviceTest, RejectsUnknownDevices) {
  for (const char* bad : {"", "gpu", "cuda:", "cuda:-1", "cuda:1x", "cuda:99999", "HOST"}) {
    EXPECT_THAT(Device::Parse(bad), StatusIs(absl::StatusCode::kInvalidArgument)) << bad;
  }
}

TEST(RegionDescriptorTest, RoundTripsThroughJson) {
  RegionDescriptor d{"node-a", 0x7f0000001000, 1 << 20, Device::Cuda(1), true, {7, 8, 9}};
  ASSERT_OK_AND_ASSIGN(RegionDescriptor back, RegionDescriptorFromJson(ToJson(d)));
  EXPECT_EQ(back, d);
  EXPECT_EQ(d.RemoteAddress(10), 10u);
  d.offset_addressing = false;
  EXPECT_EQ(d.RemoteAddress(10), 0x7f000000100au);
}

TEST(RegionDescriptorTest, GpuMemoryCarriesHostAndIpcHandleAndMayHaveNoKeys) {
  RegionDescriptor d{"node-b", 0x7f0000002000, 4096, Device::Cuda(0), false, {}};
  d.host = HostId();
  d.ipc_handle = "00ff10";
  d.ipc_offset = 512;
  d.ipc_gpu = "a1b2";
  const nlohmann::json j = ToJson(d);
  EXPECT_EQ(j["ipc"]["handle"], "00ff10");
  EXPECT_EQ(j["ipc"]["offset"], 512);
  ASSERT_OK_AND_ASSIGN(RegionDescriptor back, RegionDescriptorFromJson(j));
  EXPECT_EQ(back, d);
  // The host identity is this machine's boot id: 36 characters, stable within the process.
  EXPECT_EQ(HostId().size(), 36u);
  EXPECT_EQ(HostId(), HostId());
  // Host memory needs keys, and never carries an IPC handle.
  nlohmann::json host = j;
  host["device"] = "host";
  EXPECT_THAT(RegionDescriptorFromJson(host), StatusIs(absl::StatusCode::kInvalidArgument));
  host["keys"] = nlohmann::json::array({1u});
  EXPECT_THAT(RegionDescriptorFromJson(host), StatusIs(absl::StatusCode::kInvalidArgument));
  host.erase("ipc");
  EXPECT_OK(RegionDescriptorFromJson(host).status());
  for (nlohmann::json ipc : {nlohmann::json("x"), nlohmann::json{{"handle", "ab"}},
                             nlohmann::json{{"handle", ""}, {"offset", 0}},
                             nlohmann::json{{"handle", "ab"}, {"offset", -1}, {"gpu", "a1"}},
                             nlohmann::json{{"handle", "ab"}, {"offset", 0}}}) {
    nlohmann::json bad = j;
    bad["ipc"] = ipc;
    EXPECT_THAT(RegionDescriptorFromJson(bad), StatusIs(absl::StatusCode::kInvalidArgument)) << ipc;
  }
}

TEST(RegionDescriptorTest, RejectsMissingAndMistypedFields) {
  nlohmann::json good = ToJson(RegionDescriptor{"n", 4096, 64, Device::Host(), false, {1}});
  for (const char* field : {"node", "addr", "length", "device", "offset_addressing", "keys"}) {
    nlohmann::json j = good;
    j.erase(field);
    EXPECT_THAT(RegionDescriptorFromJson(j), StatusIs(absl::StatusCode::kInvalidArgument)) << field;
    j = good;
    j[field] = "wrong";
    if (std::string(field) != "node" && std::string(field) != "device") {
      EXPECT_THAT(RegionDescriptorFromJson(j), StatusIs(absl::StatusCode::kInvalidArgument))
          << field;
    }
  }
  nlohmann::json j = good;
  j["addr"] = -5;
  EXPECT_THAT(RegionDescriptorFromJson(j), StatusIs(absl::StatusCode::kInvalidArgument));
  j = good;
  j["keys"] = nlohmann::json::array();
  EXPECT_THAT(RegionDescriptorFromJson(j), StatusIs(absl::StatusCode::kInvalidArgument));
  j = good;
  j["addr"] = ~0ull;
  EXPECT_THAT(RegionDescriptorFromJson(j), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(RegionDescriptorFromJson(nlohmann::json::array()),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(HostMemoryTest, IsZeroedAndAlignedEvenWhereTheHeapHadBytesBefore) {
  // Dirty heap blocks, freed (the guard keeps the heap from shrinking): small allocations then
  // come from them, with their bytes (glibc: every one of them, checked when the test was made).
  std::vector<void*> dirty;
  for (int i = 0; i < 64; ++i) {
    dirty.push_back(std::malloc(64 << 10));
    memset(dirty.back(), 0xa5, 64 << 10);
  }
  void* guard = std::malloc(16);
  for (void* p : dirty) std::free(p);
  std::vector<std::pair<unsigned char*, uint64_t>> got;
  for (int i = 0; i < 64; ++i) {
    for (uint64_t size : {uint64_t{100}, uint64_t{4096}}) {
      got.emplace_back(static_cast<unsigned char*>(AllocateHostMemory(size)), size);
    }
  }
  got.emplace_back(static_cast<unsigned char*>(AllocateHostMemory(uint64_t{3} << 20)), 3 << 20);
  for (const auto& [p, size] : got) {
    ASSERT_NE(p, nullptr);
    const uintptr_t align = size >= (uint64_t{2} << 20) ? uintptr_t{2} << 20 : 4096;
    EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % align, 0u) << size;
    uint64_t nonzero = 0;
    for (uint64_t i = 0; i < size; ++i) nonzero += p[i] != 0;
    EXPECT_EQ(nonzero, 0u) << size << " bytes at " << static_cast<void*>(p);
    FreeHostMemory(p, size);
  }
  std::free(guard);
}

// Resident bytes of this process (/proc/self/statm), read into a buffer on the stack: the
// measuring allocates nothing that would show in it (an instrumented heap would).
uint64_t ResidentBytes() {
  char text[128] = {};
  const int fd = open("/proc/self/statm", O_RDONLY);
  const ssize_t n = fd < 0 ? -1 : read(fd, text, sizeof(text) - 1);
  if (fd >= 0) close(fd);
  unsigned long long pages = 0, resident = 0;
  EXPECT_TRUE(n > 0 && sscanf(text, "%llu %llu", &pages, &resident) == 2) << "statm: " << text;
  return resident * static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
}

TEST(HostMemoryTest, FreedMemoryGoesBackToTheSystemWhateverItsSize) {
  // The heap as ferryd tunes it (server/ferryd.cc): blocks under 64 MiB come from it and stay
  // in it when freed, up to 128 MiB at its top.
  mallopt(M_MMAP_THRESHOLD, 64 << 20);
  mallopt(M_TRIM_THRESHOLD, 128 << 20);
  void* guard = std::malloc(16);  // above what is freed: no trim from the top either
  for (uint64_t size : {uint64_t{48} << 20, uint64_t{3} << 20, uint64_t{100} << 10}) {
    SCOPED_TRACE(size);
    for (int round = 0; round < 4; ++round) {
      void* p = AllocateHostMemory(size);
      ASSERT_NE(p, nullptr);
      const uint64_t held = ResidentBytes();  // its pages are present from the start
      FreeHostMemory(p, size);
      // All of it, but for a page or two the measuring itself may take.
      EXPECT_LE(ResidentBytes() + size * 7 / 8, held) << "round " << round;
    }
  }
  std::free(guard);
}

TEST(BoundsTest, RejectsOverflowAndOutOfRange) {
  EXPECT_TRUE(InBounds(0, 10, 10));
  EXPECT_TRUE(InBounds(10, 0, 10));
  EXPECT_FALSE(InBounds(11, 0, 10));
  EXPECT_FALSE(InBounds(5, 6, 10));
  EXPECT_FALSE(InBounds(~0ull, 2, 10));
  EXPECT_FALSE(InBounds(2, ~0ull, 10));
}

TEST(ControlTest, FramesRoundTripAndBadFramesAreRejected) {
  std::string frame = EncodeControl(ControlType::kUser, "node-1", "payload");
  ASSERT_OK_AND_ASSIGN(ControlMessage m, DecodeControl(frame));
  EXPECT_EQ(m.type, ControlType::kUser);
  EXPECT_EQ(m.sender, "node-1");
  EXPECT_EQ(m.payload, "payload");
  EXPECT_THAT(DecodeControl("FRY"), StatusIs(absl::StatusCode::kInvalidArgument));
  std::string bad = frame;
  bad[0] = 'X';
  EXPECT_THAT(DecodeControl(bad), StatusIs(absl::StatusCode::kInvalidArgument));
  bad = frame;
  bad[4] = 9;
  EXPECT_THAT(DecodeControl(bad), StatusIs(absl::StatusCode::kInvalidArgument));
  bad = frame;
  bad[6] = 100;  // sender longer than the frame
  EXPECT_THAT(DecodeControl(bad), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(FabricTest, ProviderNamesMapOntoLibfabricsAndHexRoundTrips) {
  EXPECT_EQ(*ProviderFilter("tcp"), "tcp;ofi_rxm");
  EXPECT_EQ(*ProviderFilter("auto"), "");
  EXPECT_THAT(ProviderFilter("carrier-pigeon"), StatusIs(absl::StatusCode::kInvalidArgument));
  std::string raw("\x00\x01\xfe\xff", 4);
  EXPECT_EQ(HexEncode(raw), "0001feff");
  EXPECT_EQ(*HexDecode("0001FEff"), raw);
  EXPECT_THAT(HexDecode("abc"), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(HexDecode("zz"), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(FiError(-FI_EAGAIN, "x"), StatusIs(absl::StatusCode::kUnavailable));
  EXPECT_THAT(FiError(-FI_ENOSYS, "x"), StatusIs(absl::StatusCode::kUnimplemented));
}

}  // namespace
}  // namespace ferry::engine
