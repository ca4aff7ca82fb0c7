// ResolveRanges: what a Range header gets of an object, as cpp-httplib parsed it.
#include "wire/ranges.h"

#include <gmock/gmock.h>

namespace ferry {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;
using ::testing::Pair;

TEST(RangesTest, RangesAreWrittenOutWithinTheObject) {
  ByteRanges r = {{10, 19}, {-1, 5}, {990, -1}};
  EXPECT_EQ(ResolveRanges(r, 1000, 16), RangeAnswer::kParts);
  EXPECT_THAT(r, ElementsAre(Pair(10, 19), Pair(995, 999), Pair(990, 999)));
}

TEST(RangesTest, ALastBytePastTheEndIsTheEndAndALongSuffixIsTheWholeObject) {
  ByteRanges r = {{100, 5000}};
  EXPECT_EQ(ResolveRanges(r, 1000, 16), RangeAnswer::kParts);
  EXPECT_THAT(r, ElementsAre(Pair(100, 999)));
  r = {{-1, 5000}};
  EXPECT_EQ(ResolveRanges(r, 1000, 16), RangeAnswer::kParts);
  EXPECT_THAT(r, ElementsAre(Pair(0, 999)));
}

TEST(RangesTest, RangesPastTheEndBackwardsOrOfNothingAreUnsatisfiable) {
  for (ByteRanges r : {ByteRanges{{1000, -1}}, ByteRanges{{1000, 1005}}, ByteRanges{{20, 10}},
                       ByteRanges{{-1, 0}}, ByteRanges{{-1, -1}}, ByteRanges{{0, 9}, {2000, -1}}}) {
    EXPECT_EQ(ResolveRanges(r, 1000, 16), RangeAnswer::kUnsatisfiable) << r[0].first;
  }
  ByteRanges r = {{0, -1}};
  EXPECT_EQ(ResolveRanges(r, 0, 16), RangeAnswer::kUnsatisfiable);  // an empty object
}

TEST(RangesTest, TooManyOverlappingOrNoRangesGetTheWholeObject) {
  ByteRanges many(17, {0, 9});
  ByteRanges overlapping = {{0, 599}, {400, 999}};
  ByteRanges suffix_of_nothing = {{-1, 10}};
  ByteRanges none;
  for (auto [r, size] : {std::pair(&many, 1000), std::pair(&overlapping, 1000),
                         std::pair(&suffix_of_nothing, 0), std::pair(&none, 1000)}) {
    EXPECT_EQ(ResolveRanges(*r, static_cast<uint64_t>(size), 16), RangeAnswer::kWhole);
    EXPECT_THAT(*r, IsEmpty());
  }
  ByteRanges sixteen(16, {0, 9});
  EXPECT_EQ(ResolveRanges(sixteen, 1000, 16), RangeAnswer::kParts);
}

}  // namespace
}  // namespace ferry
