// The HTTP API's JSON bodies (what the fuzz target request_body found, kept) and node URLs.
#include "wire/api_json.h"

#include <gmock/gmock.h>

#include "tests/testing/status_matchers.h"
#include "wire/http_status.h"

namespace ferry {
namespace {

using ::ferry::testing::StatusIs;

absl::StatusOr<PullSpec> Spec(std::string_view body) {
  auto j = ParseRequestBody(body, false);
  if (!j.ok()) return j.status();
  return PullSpecFromJson(*j, 4096);
}

TEST(ApiJsonTest, APullIntoPreparedDestinationZeroIsRefused) {
  // 0 names no prepared destination: the pull had nowhere to go.
  EXPECT_THAT(Spec(R"({"object":"y","into":{"prepared":0,"indices":[0,1]}})"),
              StatusIs(absl::StatusCode::kInvalidArgument));
  ASSERT_OK_AND_ASSIGN(PullSpec s, Spec(R"({"object":"y","into":{"prepared":3}})"));
  EXPECT_EQ(s.prepared, 3u);
}

TEST(ApiJsonTest, APartThatIsBothARangeAndExtentsIsRefused) {
  // Both were taken, and the range silently won.
  EXPECT_THAT(Spec(R"({"object":"y","part":{"offset":0,"length":4,"extents":[1]}})"),
              StatusIs(absl::StatusCode::kInvalidArgument));
  ASSERT_OK_AND_ASSIGN(PullSpec s, Spec(R"({"object":"y","part":{"extents":[1]}})"));
  EXPECT_THAT(s.source_extents, ::testing::ElementsAre(1u));
}

TEST(ApiJsonTest, BodiesWithExtentsCarryThemRawAndOthersMustBeObjects) {
  ASSERT_OK_AND_ASSIGN(auto j, ParseRequestBody("{\"a\":1}\nxyz", true));
  EXPECT_EQ(j["extents_raw"], "xyz");
  EXPECT_THAT(ParseRequestBody("{\"a\":1}", true), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ParseRequestBody("[1]", false), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ParseRequestBody(std::string(100, '[') + std::string(100, ']'), false),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(ApiJsonTest, NodeUrlsAreHttpOrHttps) {
  for (const char* good : {"http://a:1", "https://a:1", "https://[::1]:7070"}) {
    EXPECT_TRUE(IsHttpUrl(good)) << good;
  }
  for (const char* bad : {"http://", "https://", "ftp://a:1", "a:1", "", "etcd://a:1"}) {
    EXPECT_FALSE(IsHttpUrl(bad)) << bad;
  }
}

}  // namespace
}  // namespace ferry
