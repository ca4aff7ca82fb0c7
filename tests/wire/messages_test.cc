#include "wire/messages.h"

#include <cstdint>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace ferry::wire {
namespace {

std::vector<Extent> Pieces(const Layout& l) {
  std::vector<Extent> out;
  l.ForEach([&](const Extent& e) { out.push_back(e); });
  return out;
}

PullRequest WithLayout(Layout layout) {
  PullRequest r;
  r.object = "kv";
  r.layout = std::move(layout);
  return r;
}

TEST(MessagesTest, APullRequestInEveryLayoutFormComesBackAsItWent) {
  PullRequest r = WithLayout(Layout({{1, 8, 100}})
                                 .AddStrided(2, 0, 64, 128, 3)
                                 .AddPages(1, 4096, 512, {5, 3, 9})
                                 .AddPages(3, 0, 4096, {1}));
  r.version = 7;
  r.part.extents = {4, 0};
  r.indices = {2, 0, 1};
  PullRequest back;
  ASSERT_TRUE(Decode(Encode(r), &back, 1000).ok());
  EXPECT_EQ(back.object, "kv");
  EXPECT_EQ(back.version, 7u);
  EXPECT_EQ(back.part.extents, r.part.extents);
  EXPECT_EQ(back.indices, r.indices);
  EXPECT_EQ(back.layout.runs().size(), 4u);
  EXPECT_EQ(back.layout.page_ids(), r.layout.page_ids());
  EXPECT_EQ(Pieces(back.layout), Pieces(r.layout));
}

TEST(MessagesTest, PageIdsTravelAsTheirCountThenLittleEndianU32s) {
  const std::string b = Encode(WithLayout(Layout().AddPages(0, 0, 4096, {0x01020304, 5})));
  const std::string ids("\x02\x00\x00\x00\x04\x03\x02\x01\x05\x00\x00\x00", 12);
  EXPECT_NE(b.find(ids), std::string::npos);
}

TEST(MessagesTest, APageEndingPast2To64OrCutShortIdsAreRefused) {
  // Page 1 of a pool at 2^64 - 8192 ends at 2^64: refused wherever it stands among the ids.
  const uint64_t pool = UINT64_MAX - 8191;
  PullRequest back;
  for (const std::vector<uint32_t>& ids : {std::vector<uint32_t>{1, 0}, {0, 1}}) {
    absl::Status s = Decode(Encode(WithLayout(Layout().AddPages(0, pool, 4096, ids))), &back, 10);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(s.message(), "layout: a page overflows 2^64");
  }
  EXPECT_TRUE(Decode(Encode(WithLayout(Layout().AddPages(0, pool, 4096, {0}))), &back, 10).ok());
  // Ids cut short: the count says 3, two follow.
  std::string b = Encode(WithLayout(Layout().AddPages(0, 0, 4096, {7, 8, 9})));
  const std::string ids("\x03\x00\x00\x00\x07\x00\x00\x00\x08\x00\x00\x00\x09\x00\x00\x00", 16);
  const size_t at = b.find(ids);
  ASSERT_NE(at, std::string::npos);
  b.resize(at + 12);
  absl::Status s = Decode(b, &back, 10);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "layout: short or malformed");
  // More ids than the limit on pieces.
  s = Decode(Encode(WithLayout(Layout().AddPages(0, 0, 4096, {7, 8, 9}))), &back, 2);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
}

TEST(MessagesTest, ALayoutNumberTravelsWithOrWithoutItsLayoutAndNeverWithAPreparedOne) {
  PullRequest r = WithLayout(Layout().AddPages(0, 0, 4096, {3, 1}));
  r.layout_ref = 9;
  r.defines_layout = true;
  PullRequest back;
  ASSERT_TRUE(Decode(Encode(r), &back, 10).ok());
  EXPECT_EQ(back.layout_ref, 9u);
  EXPECT_TRUE(back.defines_layout);
  EXPECT_EQ(back.layout, r.layout);
  r.defines_layout = false;
  r.layout = Layout();
  ASSERT_TRUE(Decode(Encode(r), &back, 10).ok());
  EXPECT_EQ(back.layout_ref, 9u);
  EXPECT_FALSE(back.defines_layout);
  EXPECT_TRUE(back.layout.empty());
  // A layout defined under no number, or a number beside a prepared destination.
  PullRequest unnumbered = WithLayout(Layout({{0, 0, 8}}));
  unnumbered.defines_layout = true;
  PullRequest both = r;
  both.prepared = 2;
  for (const PullRequest& bad : {unnumbered, both}) {
    const absl::Status s = Decode(Encode(bad), &back, 10);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(s.message(), "pull request: short or malformed");
  }
}

}  // namespace
}  // namespace ferry::wire
