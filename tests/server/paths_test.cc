// Path selection and the copy pieces the GPU paths are built from, on host memory.
#include "server/paths.h"

#include <gmock/gmock.h>

#include <cstring>
#include <numeric>
#include <random>
#include <string>

#include "engine/cuda.h"
#include "tests/testing/status_matchers.h"

namespace ferry::server {
namespace {

using ::ferry::testing::StatusIs;

TEST(PathTest, ChoosesIpcOnlyForGpuToGpuOnOneHostThenRdmaThenStaged) {
  PathFacts ipc{.same_host = true,
                .cuda_here = true,
                .src_all_gpu = true,
                .src_on_rails = false,
                .dst_all_ipc = true,
                .dst_on_rails = false};
  EXPECT_EQ(ChoosePath(ipc), PullPath::kCudaIpc);
  for (bool PathFacts::*fact : {&PathFacts::same_host, &PathFacts::cuda_here,
                                &PathFacts::src_all_gpu, &PathFacts::dst_all_ipc}) {
    PathFacts f = ipc;
    f.*fact = false;
    EXPECT_EQ(ChoosePath(f), PullPath::kStaged);  // neither side on the rails
    f.src_on_rails = f.dst_on_rails = true;
    EXPECT_EQ(ChoosePath(f), PullPath::kRdma);  // FI_HMEM, or host memory
  }
  EXPECT_EQ(ChoosePath({}), PullPath::kRdma);  // host to host
  EXPECT_EQ(ChoosePath({.src_on_rails = false}), PullPath::kStaged);
  EXPECT_EQ(ChoosePath({.dst_on_rails = false}), PullPath::kStaged);
}

TEST(PathTest, NamesParseBackAndUnknownNamesAreRefused) {
  for (PullPath p : {PullPath::kRdma, PullPath::kCudaIpc, PullPath::kStaged}) {
    auto parsed = ParsePath(PathName(p));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, p);
  }
  auto automatic = ParsePath("auto");
  ASSERT_TRUE(automatic.ok());
  EXPECT_FALSE(automatic->has_value());
  EXPECT_THAT(ParsePath("nvlink").status(), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ParsePath("").status(), StatusIs(absl::StatusCode::kInvalidArgument));
}

// Random span lists over two buffers: pairing them and running the pieces must copy byte i of
// the source layout to byte i of the destination layout, for any slice.
TEST(PiecesTest, SliceAndPairCopyEveryByteOnceFromTheRightPlace) {
  std::mt19937_64 rng(7);
  for (int round = 0; round < 300; ++round) {
    const uint64_t total = 1 + rng() % 50000;
    std::string src_buf(2 * total, '\0'), dst_buf(2 * total, '\x5a');
    for (char& c : src_buf) c = static_cast<char>(rng());
    auto cut = [&](std::string& buf) {
      std::vector<Span> spans;
      uint64_t left = total, at = 0;
      while (left > 0) {
        const uint64_t n = std::min<uint64_t>(left, 1 + rng() % 4000);
        at += rng() % 2 * (rng() % 64);  // gaps
        at = std::min(at, 2 * total - left);
        spans.push_back({buf.data() + at, n, Device::Host()});
        at += n;
        left -= n;
      }
      return spans;
    };
    const std::vector<Span> src = cut(src_buf), dst = cut(dst_buf);
    const uint64_t offset = rng() % total, length = 1 + rng() % (total - offset);
    const std::vector<Span> s = Slice(src, offset, length), d = Slice(dst, offset, length);
    auto sum = [](const std::vector<Span>& v) {
      return std::accumulate(v.begin(), v.end(), uint64_t{0},
                             [](uint64_t a, const Span& x) { return a + x.length; });
    };
    ASSERT_EQ(sum(s), length);
    ASSERT_EQ(sum(d), length);
    ASSERT_OK(RunPieces(PairSpans(d, s)));
    // Flatten both layouts and compare the slice; bytes outside it stay untouched.
    auto flat = [](const std::vector<Span>& v) {
      std::string out;
      for (const Span& x : v) out.append(x.ptr, x.length);
      return out;
    };
    const std::string want = flat(src).substr(offset, length);
    ASSERT_EQ(flat(dst).substr(offset, length), want) << "round " << round;
    const std::string before = flat(dst).substr(0, offset);
    ASSERT_EQ(before, std::string(offset, '\x5a')) << "round " << round;
  }
}

TEST(PiecesTest, GpuPiecesNeedCudaAndSayWhy) {
  if (engine::CudaDeviceCount() > 0) GTEST_SKIP() << "a GPU is here: tests/gpu/run.sh covers it";
  char a[8] = {}, b[8] = {};
  const auto status = RunPieces(
      {{Device::Cuda(0), {reinterpret_cast<uint64_t>(a), reinterpret_cast<uint64_t>(b), 8}}});
  EXPECT_THAT(status, StatusIs(engine::CudaBuilt() ? absl::StatusCode::kNotFound
                                                   : absl::StatusCode::kUnimplemented));
  EXPECT_THAT(engine::CudaAlloc(0, 64).status(),
              StatusIs(engine::CudaBuilt() ? absl::StatusCode::kNotFound
                                           : absl::StatusCode::kUnimplemented));
}

}  // namespace
}  // namespace ferry::server
