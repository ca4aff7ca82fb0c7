#include "wire/disjoint.h"

#include <algorithm>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace ferry {
namespace {

// The plain answer: every byte of every piece, counted.
bool Overlap(const Layout& l) {
  std::vector<std::pair<uint64_t, uint64_t>> bytes;
  l.ForEach([&](const Extent& e) {
    for (uint64_t b = e.offset; b < e.offset + e.length; ++b) bytes.push_back({e.region, b});
  });
  std::sort(bytes.begin(), bytes.end());
  return std::adjacent_find(bytes.begin(), bytes.end()) != bytes.end();
}

TEST(DisjointTest, ExtentsApartInAnyOrderAndTouching) {
  EXPECT_TRUE(Disjoint(Layout({{1, 0, 10}, {1, 10, 10}, {2, 0, 20}})));
  EXPECT_TRUE(Disjoint(Layout({{2, 0, 20}, {1, 10, 10}, {1, 0, 10}})));
  EXPECT_FALSE(Disjoint(Layout({{1, 10, 10}, {1, 0, 11}})));
  EXPECT_TRUE(Disjoint(Layout({{1, 0, 10}, {2, 0, 10}})));  // other regions
}

TEST(DisjointTest, StridedRuns) {
  EXPECT_TRUE(Disjoint(Layout().AddStrided(1, 0, 64, 64, 100)));
  EXPECT_FALSE(Disjoint(Layout().AddStrided(1, 0, 64, 63, 2)));
  EXPECT_TRUE(Disjoint(Layout().AddStrided(1, 0, 64, 0, 1)));  // one piece: its stride is moot
  // Two runs over alternate rows: their spans interleave, their pieces do not.
  EXPECT_TRUE(Disjoint(Layout().AddStrided(1, 0, 32, 64, 100).AddStrided(1, 32, 32, 64, 100)));
  EXPECT_FALSE(Disjoint(Layout().AddStrided(1, 0, 32, 64, 100).AddStrided(1, 31, 32, 64, 100)));
}

TEST(DisjointTest, PageTables) {
  EXPECT_TRUE(Disjoint(Layout().AddPages(1, 0, 4096, {5, 3, 9, 0})));
  EXPECT_FALSE(Disjoint(Layout().AddPages(1, 0, 4096, {5, 3, 5})));
  // Ids far apart (no bitmap): the sorted copy finds the repeat too.
  EXPECT_TRUE(Disjoint(Layout().AddPages(1, 0, 1, {0, 4000000000u, 7})));
  EXPECT_FALSE(Disjoint(Layout().AddPages(1, 0, 1, {0, 4000000000u, 0})));
  // Two tables over one pool, apart and not.
  EXPECT_TRUE(Disjoint(Layout().AddPages(1, 0, 16, {1, 3}).AddPages(1, 0, 16, {0, 2})));
  EXPECT_FALSE(Disjoint(Layout().AddPages(1, 0, 16, {1, 3}).AddPages(1, 0, 16, {3})));
  // A page table and an extent inside one of its pages.
  EXPECT_FALSE(Disjoint(Layout().AddPages(1, 0, 16, {4}).Add({1, 70, 1})));
  EXPECT_TRUE(Disjoint(Layout().AddPages(1, 0, 16, {4}).Add({1, 80, 1})));
}

TEST(DisjointTest, AgreesWithEveryByteCountedOnRandomLayouts) {
  std::mt19937_64 rng(7);
  auto pick = [&](uint64_t n) { return rng() % n; };
  for (int round = 0; round < 3000; ++round) {
    Layout l;
    const int runs = 1 + static_cast<int>(pick(4));
    for (int i = 0; i < runs; ++i) {
      const uint64_t region = pick(2);
      switch (pick(3)) {
        case 0:
          l.Add({region, pick(200), 1 + pick(20)});
          break;
        case 1:
          l.AddStrided(region, pick(100), 1 + pick(8), pick(16), 1 + pick(6));
          break;
        default: {
          std::vector<uint32_t> ids(1 + pick(6));
          for (uint32_t& id : ids) id = static_cast<uint32_t>(pick(20));
          l.AddPages(region, pick(50), 1 + pick(8), ids);
        }
      }
    }
    ASSERT_EQ(Disjoint(l), !Overlap(l)) << "round " << round;
  }
}

// Regions 1 (4096 bytes) and 2 (100); no other.
std::optional<uint64_t> Length(uint64_t region) {
  if (region == 1) return 4096;
  if (region == 2) return 100;
  return std::nullopt;
}

TEST(WithinRegionsTest, SumsTheBytesOfRunsInsideTheirRegions) {
  EXPECT_EQ(WithinRegions(Layout({{1, 0, 4096}, {2, 99, 1}}), Length), 4097u);
  EXPECT_EQ(WithinRegions(Layout().AddStrided(1, 64, 64, 128, 31), Length), 64u * 31);
  EXPECT_EQ(WithinRegions(Layout().AddPages(1, 1024, 1024, {2, 0, 1}), Length), 3072u);
}

TEST(WithinRegionsTest, AnyRunOutsideItsRegionOrEmptyOrOverflowingIsRefused) {
  EXPECT_EQ(WithinRegions(Layout({{1, 0, 10}, {3, 0, 1}}), Length), std::nullopt);  // no region 3
  EXPECT_EQ(WithinRegions(Layout({{2, 1, 100}}), Length), std::nullopt);            // one past
  EXPECT_EQ(WithinRegions(Layout({{1, 0, 0}}), Length), std::nullopt);              // empty
  // The last row of the stride ends one byte past the region; a page id one past the pool.
  EXPECT_EQ(WithinRegions(Layout().AddStrided(1, 65, 64, 128, 32), Length), std::nullopt);
  EXPECT_EQ(WithinRegions(Layout().AddPages(1, 1024, 1024, {3}), Length), std::nullopt);
  // A cover past 2^64.
  const auto huge = [](uint64_t) -> std::optional<uint64_t> { return UINT64_MAX; };
  EXPECT_EQ(WithinRegions(Layout().AddStrided(1, 0, 1, uint64_t{1} << 63, 3), huge), std::nullopt);
  // Pieces that each fit but whose sum does not.
  EXPECT_EQ(WithinRegions(Layout({{1, 0, uint64_t{1} << 63}, {2, 0, uint64_t{1} << 63}}), huge),
            std::nullopt);
}

}  // namespace
}  // namespace ferry
