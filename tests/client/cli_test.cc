// The ferry CLI against real ferryd processes: every command, its output and exit codes.
#include <gmock/gmock.h>
#include <httplib.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <thread>

#include "engine/cuda.h"
#include "ferry/client.h"
#include "nlohmann/json.hpp"
#include "tests/testing/ferryd_process.h"
#include "tests/testing/subprocess.h"

namespace ferry {
namespace {

using ::ferry::testing::Subprocess;

testing::FerrydProcess StartFerryd(const std::filesystem::path& dir) {
  auto f = testing::StartFerryd(FERRYD_PATH, {"--data-dir", dir.string(), "--domain", "lo"});
  EXPECT_TRUE(f.ok()) << f.status();
  return f.ok() ? std::move(*f) : testing::FerrydProcess{};
}

// Runs the CLI; returns its exit code and stdout.
std::pair<int, std::string> Ferry(std::vector<std::string> args) {
  args.insert(args.begin(), FERRY_CLI_PATH);
  auto p = Subprocess::Spawn(args);
  EXPECT_TRUE(p.ok());
  std::string out;
  while (true) {
    auto line = (*p)->ReadLine(absl::Seconds(60));
    if (!line.ok()) break;
    out += *line + "\n";
  }
  const int status = (*p)->Wait();
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

TEST(CliTest, PutGetLsStatPullRmWithExitCodes) {
  const auto dir =
      std::filesystem::temp_directory_path() / ("ferry-cli-" + std::to_string(getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  testing::FerrydProcess a = StartFerryd(dir / "a"), b = StartFerryd(dir / "b");
  ASSERT_TRUE(a.proc && b.proc);
  std::string data(3 << 20, '\0');
  std::mt19937_64 rng(9);
  for (char& c : data) c = static_cast<char>(rng());
  std::ofstream(dir / "in.bin", std::ios::binary) << data;

  auto [put_rc, put_out] = Ferry({"--node", a.url, "put", "cli/obj", (dir / "in.bin").string()});
  EXPECT_EQ(put_rc, 0);
  EXPECT_THAT(put_out, ::testing::HasSubstr("cli/obj version 1, 3145728 bytes"));
  EXPECT_EQ(Ferry({"--node", a.url, "put", "cli/obj", (dir / "in.bin").string()}).first, 4);
  EXPECT_EQ(Ferry({"--node", a.url, "put", "cli/obj", (dir / "missing.bin").string()}).first, 3);
  EXPECT_EQ(Ferry({"--node", a.url, "put", "cli/dir", dir.string()}).first, 3);
  // A regular file is read as the upload goes; a pipe is read to its end first.
  ASSERT_EQ(mkfifo((dir / "pipe").c_str(), 0600), 0);
  const std::string piped = data.substr(5, 1 << 20);
  std::thread writer([&] { std::ofstream(dir / "pipe", std::ios::binary) << piped; });
  auto [pipe_rc, pipe_out] = Ferry({"--node", a.url, "put", "cli/piped", (dir / "pipe").string()});
  writer.join();
  EXPECT_EQ(pipe_rc, 0);
  EXPECT_THAT(pipe_out, ::testing::HasSubstr("cli/piped version 1, 1048576 bytes"));
  EXPECT_EQ(Ferry({"--node", a.url, "get", "cli/piped", "-o", (dir / "piped.bin").string()}).first,
            0);
  std::ifstream piped_in(dir / "piped.bin", std::ios::binary);
  EXPECT_TRUE(std::string(std::istreambuf_iterator<char>(piped_in), {}) == piped);
  auto [pull_rc, pull_out] = Ferry({"--node", b.url, "pull", "cli/obj", "--from", a.url});
  EXPECT_EQ(pull_rc, 0);
  EXPECT_THAT(pull_out, ::testing::HasSubstr("pulled cli/obj: 3145728 bytes"));
  auto [staged_rc, staged_out] = Ferry({"--node", b.url, "pull", "cli/obj", "--from", a.url, "--as",
                                        "cli/staged", "--path", "staged"});
  EXPECT_EQ(staged_rc, 0);
  EXPECT_THAT(staged_out, ::testing::HasSubstr("(staged)"));
  // A GPU that is not here: 3 (not found) with CUDA in the build, 1 (unimplemented) without.
  EXPECT_EQ(
      Ferry({"--node", a.url, "put", "cli/gpu", (dir / "in.bin").string(), "--device", "cuda:99"})
          .first,
      engine::CudaBuilt() ? 3 : 1);
  EXPECT_EQ(Ferry({"--node", b.url, "pull", "cli/obj", "--from", a.url, "--path", "warp"}).first,
            1);
  EXPECT_EQ(Ferry({"--node", b.url, "get", "cli/staged", "-o", (dir / "out.bin").string()}).first,
            0);
  std::ifstream in(dir / "out.bin", std::ios::binary);
  std::string back((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_TRUE(back == data);
  auto [ls_rc, ls_out] = Ferry({"--node", b.url, "ls", "cli/"});
  EXPECT_EQ(ls_rc, 0);
  EXPECT_THAT(ls_out, ::testing::HasSubstr("cli/obj"));
  auto [stat_rc, stat_out] = Ferry({"--node", b.url, "stat", "cli/obj"});
  EXPECT_EQ(stat_rc, 0);
  EXPECT_THAT(stat_out, ::testing::HasSubstr("size 3145728"));
  EXPECT_EQ(Ferry({"--node", b.url, "rm", "cli/obj"}).first, 0);
  EXPECT_EQ(Ferry({"--node", b.url, "stat", "cli/obj"}).first, 3);
  EXPECT_EQ(Ferry({"--node", b.url, "get", "nope"}).first, 3);
  EXPECT_EQ(Ferry({"--node", "http://127.0.0.1:1", "ls"}).first, 5);
  EXPECT_EQ(Ferry({"--node", "not-a-url", "ls"}).first, 1);
  EXPECT_EQ(a.Stop(), 0);
  EXPECT_EQ(b.Stop(), 0);
  std::filesystem::remove_all(dir);
}

// A Put whose source fails part way (a file that got shorter): the node publishes nothing and
// frees the buffer it had taken, Put returns the source's error, and the client goes on.
TEST(ClientTest, PutFromASourceThatFailsPublishesNothing) {
  const auto dir =
      std::filesystem::temp_directory_path() / ("ferry-client-" + std::to_string(getpid()));
  std::filesystem::remove_all(dir);
  testing::FerrydProcess a = StartFerryd(dir);
  ASSERT_TRUE(a.proc);
  auto c = Client::Connect(a.url);
  ASSERT_TRUE(c.ok()) << c.status();
  const uint64_t size = 16 << 20;
  uint64_t asked = 0;
  auto failing = [&](uint64_t offset, char* out, size_t n) {
    if (offset >= 6 << 20) return absl::DataLossError("w.bin got shorter while it was read");
    std::memset(out, 7, n);
    asked = offset + n;
    return absl::OkStatus();
  };
  auto r = (*c)->Put("w", size, failing);
  EXPECT_EQ(r.status(), absl::DataLossError("w.bin got shorter while it was read"));
  EXPECT_GE(asked, uint64_t{6} << 20);
  auto regions = [&] {
    auto got = httplib::Client(a.url).Get("/v1/regions");
    return got ? nlohmann::json::parse(got->body)["regions"].size() : size_t{999};
  };
  for (int i = 0; i < 100 && regions() != 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_EQ(regions(), 0u);
  EXPECT_EQ((*c)->Stat("w").status().code(), absl::StatusCode::kNotFound);
  auto whole = (*c)->Put("w", size, [](uint64_t offset, char* out, size_t n) {
    for (size_t i = 0; i < n; ++i) out[i] = static_cast<char>((offset + i) % 251);
    return absl::OkStatus();
  });
  ASSERT_TRUE(whole.ok()) << whole.status();
  std::ostringstream back;
  ASSERT_TRUE((*c)->Get("w", back).ok());
  const std::string got = back.str();
  ASSERT_EQ(got.size(), size);
  for (uint64_t i = 0; i < size; i += 4099) ASSERT_EQ(got[i], static_cast<char>(i % 251)) << i;
  EXPECT_EQ(a.Stop(), 0);
  std::filesystem::remove_all(dir);
}

TEST(CliTest, TopoPrintsThisMachinesPlacementAndRejectsABadXml) {
  auto [code, out] = Ferry({"topo", "--provider", "tcp"});
  EXPECT_EQ(code, 0) << out;
  // The loopback domain has no PCI device: it is a host-memory rail on any core.
  EXPECT_THAT(out, ::testing::MatchesRegex("[0-9]+ GPU\\(s\\), [0-9]+ NIC\\(s\\)\n(.*\n)*host "
                                           "memory -> .*lo.* -> numa .* -> cores .*\n"));
  auto [bad, bad_out] = Ferry({"topo", "--xml", "/nonexistent.xml"});
  EXPECT_EQ(bad, 1);
  auto [prov, prov_out] = Ferry({"topo", "--provider", "nonsense"});
  EXPECT_EQ(prov, 1);
}

}  // namespace
}  // namespace ferry
