#include "engine/planner.h"

#include <gmock/gmock.h>

#include <algorithm>
#include <random>

#include "tests/testing/status_matchers.h"

namespace ferry::engine {
namespace {

using ::ferry::testing::StatusIs;

// Random extents over `regions` regions of `region_size` bytes each, `total` bytes in all,
// pieces from 1 byte to max_piece, at random offsets (pieces may repeat source bytes; a
// destination list is built from disjoint pieces).
std::vector<Extent> RandomExtents(std::mt19937_64& rng, uint64_t total, uint64_t max_piece,
                                  bool disjoint, uint64_t* region_size) {
  std::vector<uint64_t> lengths;
  for (uint64_t left = total; left > 0;) {
    uint64_t n = std::uniform_int_distribution<uint64_t>(1, std::min(left, max_piece))(rng);
    if (rng() % 4 == 0) n = std::min<uint64_t>(left, 1 + rng() % 3);  // many tiny pieces
    lengths.push_back(n);
    left -= n;
  }
  std::vector<Extent> out;
  if (disjoint) {
    // Lay pieces out with random gaps, in a shuffled order, over two regions.
    std::vector<size_t> order(lengths.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::shuffle(order.begin(), order.end(), rng);
    std::vector<Extent> placed(lengths.size());
    uint64_t pos[2] = {0, 0};
    for (size_t i : order) {
      const uint64_t region = rng() % 2;
      pos[region] += rng() % 3 == 0 ? 0 : rng() % 64;
      placed[i] = {region, pos[region], lengths[i]};
      pos[region] += lengths[i];
    }
    *region_size = std::max(pos[0], pos[1]);
    out = placed;
  } else {
    *region_size = total + max_piece;
    for (uint64_t n : lengths) out.push_back({rng() % 2, rng() % (*region_size - n + 1), n});
  }
  if (rng() % 3 == 0)
    out.insert(out.begin() + static_cast<long>(rng() % (out.size() + 1)), Extent{0, 0, 0});
  return out;
}

// Byte k of a list's concatenation, as (region, offset).
std::pair<uint64_t, uint64_t> Locate(const std::vector<Extent>& list, uint64_t k) {
  for (const Extent& e : list) {
    if (k < e.length) return {e.region, e.offset + k};
    k -= e.length;
  }
  return {~0ull, ~0ull};
}

TEST(PlannerTest, RandomLayoutsWriteEveryDestinationByteOnceFromTheRightSource) {
  std::mt19937_64 rng(20261129);
  for (int iter = 0; iter < 3000; ++iter) {
    const uint64_t total = 1 + rng() % (iter % 10 == 0 ? 200000 : 4000);
    const uint64_t max_piece = 1 + rng() % 5000;
    uint64_t src_size = 0, dst_size = 0;
    auto src = RandomExtents(rng, total, max_piece, false, &src_size);
    auto dst = RandomExtents(rng, total, max_piece, true, &dst_size);
    PlanOptions opts;
    opts.rails = 1 + rng() % 8;
    opts.max_write = 1 + rng() % 9000;
    opts.max_iov = 1 + rng() % 4;
    ASSERT_OK_AND_ASSIGN(Plan plan, MakePlan(src, dst, opts));
    ASSERT_EQ(plan.bytes, total);
    ASSERT_EQ(plan.rails.size(), opts.rails);

    // Mark every destination byte with the source byte it came from.
    std::vector<int64_t> written[2] = {std::vector<int64_t>(dst_size, -1),
                                       std::vector<int64_t>(dst_size, -1)};
    std::vector<uint64_t> rail_bytes;
    size_t writes = 0;
    for (const auto& rail : plan.rails) {
      uint64_t bytes = 0;
      size_t iovs = 0;           // pieces of the current WRITE
      uint64_t write_bytes = 0;  // ... and their bytes
      for (size_t i = 0; i < rail.size(); ++i) {
        const PlannedWrite& w = rail[i];
        ASSERT_GT(w.length, 0u);
        if (w.gathered) {
          ASSERT_GT(i, 0u) << "a rail's first piece starts a WRITE";
          ASSERT_EQ(w.src_region, rail[i - 1].src_region);
          ASSERT_EQ(w.dst_region, rail[i - 1].dst_region);
          ++iovs;
          write_bytes += w.length;
        } else {
          iovs = 1;
          write_bytes = w.length;
          ++writes;
        }
        ASSERT_LE(iovs, opts.max_iov);
        ASSERT_LE(write_bytes, opts.max_write);
        for (uint64_t b = 0; b < w.length; ++b) {
          int64_t& slot = written[w.dst_region][w.dst_offset + b];
          ASSERT_EQ(slot, -1) << "destination byte written twice";
          slot = static_cast<int64_t>((w.src_region << 40) | (w.src_offset + b));
        }
        bytes += w.length;
      }
      rail_bytes.push_back(bytes);
    }
    ASSERT_EQ(writes, plan.writes);
    for (uint64_t k = 0; k < total; ++k) {
      auto [dr, doff] = Locate(dst, k);
      auto [sr, soff] = Locate(src, k);
      ASSERT_EQ(written[dr][doff], static_cast<int64_t>((sr << 40) | soff)) << "byte " << k;
    }
    uint64_t written_count = 0;
    for (auto& region : written) {
      written_count += static_cast<uint64_t>(
          std::count_if(region.begin(), region.end(), [](int64_t v) { return v >= 0; }));
    }
    ASSERT_EQ(written_count, total) << "bytes outside the destination extents were written";
    // Balanced to within one piece (here: to the byte).
    auto [lo, hi] = std::minmax_element(rail_bytes.begin(), rail_bytes.end());
    ASSERT_LE(*hi - *lo, 1u);
  }
}

TEST(PlannerTest, MergesPiecesAdjacentOnBothSides) {
  std::vector<Extent> src = {{0, 0, 100}, {0, 100, 100}, {0, 200, 50}};
  std::vector<Extent> dst = {{3, 1000, 150}, {3, 1150, 100}};
  ASSERT_OK_AND_ASSIGN(Plan plan, MakePlan(src, dst, {1, 1 << 20}));
  ASSERT_EQ(plan.rails[0].size(), 1u);
  EXPECT_EQ(plan.rails[0][0].length, 250u);
  EXPECT_EQ(plan.rails[0][0].dst_offset, 1000u);
}

TEST(PlannerTest, DoesNotMergeAcrossRegions) {
  std::vector<Extent> src = {{0, 0, 100}, {1, 100, 100}};
  std::vector<Extent> dst = {{0, 0, 200}};
  ASSERT_OK_AND_ASSIGN(Plan plan, MakePlan(src, dst, {1, 1 << 20}));
  EXPECT_EQ(plan.rails[0].size(), 2u);
}

// Pieces of 100 bytes, each destination piece 100 bytes after the last: nothing merges.
std::vector<Extent> Scattered(uint64_t region, size_t n) {
  std::vector<Extent> out;
  for (uint64_t i = 0; i < n; ++i) out.push_back({region, 200 * i, 100});
  return out;
}

std::vector<size_t> PiecesPerWrite(const std::vector<PlannedWrite>& rail) {
  std::vector<size_t> out;
  for (const PlannedWrite& w : rail) {
    if (w.gathered) {
      ++out.back();
    } else {
      out.push_back(1);
    }
  }
  return out;
}

TEST(PlannerTest, GathersScatteredPiecesUpToMaxIovAndMaxWrite) {
  const std::vector<Extent> src = {{0, 0, 1000}};
  ASSERT_OK_AND_ASSIGN(Plan plan, MakePlan(src, Scattered(0, 10), {1, 1 << 20, 4}));
  EXPECT_EQ(PiecesPerWrite(plan.rails[0]), (std::vector<size_t>{4, 4, 2}));
  EXPECT_EQ(plan.writes, 3u);
  ASSERT_OK_AND_ASSIGN(plan, MakePlan(src, Scattered(0, 10), {1, 250, 4}));
  EXPECT_EQ(PiecesPerWrite(plan.rails[0]), (std::vector<size_t>{2, 2, 2, 2, 2}));
  EXPECT_EQ(plan.writes, 5u);
  ASSERT_OK_AND_ASSIGN(plan, MakePlan(src, Scattered(0, 10), {1, 1 << 20, 1}));
  EXPECT_EQ(plan.writes, 10u);
  EXPECT_EQ(plan.rails[0].size(), 10u);
}

TEST(PlannerTest, GathersNeitherAcrossRegionsNorAcrossRails) {
  // Destination region changes after three pieces; two rails of 500 bytes each.
  std::vector<Extent> dst = Scattered(0, 3);
  for (const Extent& e : Scattered(1, 7)) dst.push_back(e);
  ASSERT_OK_AND_ASSIGN(Plan plan, MakePlan({{0, 0, 1000}}, dst, {2, 1 << 20, 4}));
  EXPECT_EQ(PiecesPerWrite(plan.rails[0]), (std::vector<size_t>{3, 2}));
  EXPECT_EQ(PiecesPerWrite(plan.rails[1]), (std::vector<size_t>{4, 1}));
  EXPECT_EQ(plan.writes, 4u);
}

TEST(PlannerTest, SplitsLongPiecesSoEveryRailGetsWork) {
  std::vector<Extent> one = {{0, 0, 8 << 20}};
  ASSERT_OK_AND_ASSIGN(Plan plan, MakePlan(one, one, {4, 1 << 20}));
  for (const auto& rail : plan.rails) {
    ASSERT_EQ(rail.size(), 2u);
    EXPECT_EQ(rail[0].length + rail[1].length, 2u << 20);
  }
}

TEST(PlannerTest, BalancesBytesNotOperationCounts) {
  // One big piece and many small ones: each rail gets half the bytes.
  std::vector<Extent> src = {{0, 0, 1000}};
  for (uint64_t i = 0; i < 100; ++i) src.push_back({1, i * 20, 10});
  std::vector<Extent> dst = {{0, 0, 2000}};
  ASSERT_OK_AND_ASSIGN(Plan plan, MakePlan(src, dst, {2, 1 << 20}));
  uint64_t b0 = 0, b1 = 0;
  for (auto& w : plan.rails[0]) b0 += w.length;
  for (auto& w : plan.rails[1]) b1 += w.length;
  EXPECT_EQ(b0, 1000u);
  EXPECT_EQ(b1, 1000u);
  EXPECT_EQ(plan.rails[0].size(), 1u);
  EXPECT_EQ(plan.rails[1].size(), 100u);
}

TEST(PlannerTest, RejectsMismatchedTotals) {
  EXPECT_THAT(MakePlan({{0, 0, 10}}, {{0, 0, 11}}, {1, 100}),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(PlannerTest, RejectsOverflowingTotals) {
  std::vector<Extent> huge = {{0, 0, ~0ull}, {0, 0, 2}};
  EXPECT_THAT(MakePlan(huge, huge, {1, 100}), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(PlannerTest, RejectsZeroRailsZeroMaxWriteAndZeroMaxIov) {
  EXPECT_THAT(MakePlan({{0, 0, 1}}, {{0, 0, 1}}, {0, 100}),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(MakePlan({{0, 0, 1}}, {{0, 0, 1}}, {1, 0}),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(MakePlan({{0, 0, 1}}, {{0, 0, 1}}, {1, 100, 0}),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(PlannerTest, EmptyTransferHasNoWrites) {
  ASSERT_OK_AND_ASSIGN(Plan plan, MakePlan({}, {{0, 5, 0}}, {3, 100}));
  EXPECT_EQ(plan.writes, 0u);
  EXPECT_EQ(plan.bytes, 0u);
}

}  // namespace
}  // namespace ferry::engine
