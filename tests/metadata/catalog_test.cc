#include "metadata/catalog.h"

#include <gmock/gmock.h>
#include <unistd.h>

#include <filesystem>
#include <set>

#include "tests/testing/status_matchers.h"
#include "wire/http_status.h"

namespace ferry::metadata {
namespace {

using ::ferry::testing::StatusIs;

class CatalogTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("ferry-catalog-" + std::to_string(getpid()) + "-" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);
    ASSERT_OK_AND_ASSIGN(catalog_, Catalog::Open(dir_.string(), {.sync = false}));
  }
  void TearDown() override {
    catalog_.reset();
    std::filesystem::remove_all(dir_);
  }
  void Reopen() {
    catalog_.reset();
    ASSERT_OK_AND_ASSIGN(catalog_, Catalog::Open(dir_.string(), {.sync = false}));
  }
  std::filesystem::path dir_;
  std::unique_ptr<Catalog> catalog_;
};

TEST_F(CatalogTest, PublishedObjectsComeBackAfterReopenWithNamesVersionsAndLayouts) {
  std::vector<Extent> layout = {{1, 0, 100}, {2, 4096, 28}};
  ASSERT_OK_AND_ASSIGN(ObjectRecord r, catalog_->Publish("models/llama/w0", layout, false));
  EXPECT_EQ(r.version, 1u);
  EXPECT_EQ(r.size, 128u);
  ASSERT_OK_AND_ASSIGN(ObjectRecord r2, catalog_->Publish("models/llama/w0", {{3, 0, 5}}, true));
  EXPECT_EQ(r2.version, 2u);
  const std::string id = catalog_->node_id();
  ASSERT_NO_FATAL_FAILURE(Reopen());
  EXPECT_EQ(catalog_->node_id(), id);
  ASSERT_OK_AND_ASSIGN(auto latest_ptr, catalog_->Get("models/llama/w0"));
  const ObjectRecord& latest = *latest_ptr;
  EXPECT_EQ(latest.version, 2u);
  EXPECT_EQ(latest.extents, (std::vector<Extent>{{3, 0, 5}}));
  ASSERT_OK_AND_ASSIGN(auto v1_ptr, catalog_->Get("models/llama/w0", 1));
  const ObjectRecord& v1 = *v1_ptr;
  EXPECT_EQ(v1.extents, layout);
  EXPECT_EQ(catalog_->RegionUsers(1), 1u);
  EXPECT_EQ(catalog_->RegionUsers(3), 1u);
}

TEST_F(CatalogTest, MetaTypeAndChecksumComeBackAfterReopenAndVersionsWithoutThemHaveNone) {
  const std::string meta = R"({"tensors":[{"name":"w","dtype":"F32","shape":[2],"offset":0}]})";
  ASSERT_OK(catalog_->Publish("m", {{1, 0, 8}}, false, nullptr, true, {.meta = meta}).status());
  ASSERT_OK(catalog_->Publish("m", {{1, 0, 8}}, true).status());
  ASSERT_OK(catalog_
                ->Publish("m", {{1, 0, 8}}, true, nullptr, true,
                          {.content_type = "image/png", .crc32c = 0xdeadbeef})
                .status());
  ASSERT_OK(catalog_->Publish("m", {{1, 0, 8}}, true, nullptr, true, {.crc32c = 7}).status());
  ASSERT_OK(catalog_->Publish("kv", {{1, 0, 8}}, false, nullptr, false, {.meta = "[1]"}).status());
  ASSERT_OK_AND_ASSIGN(auto kv, catalog_->Get("kv"));
  EXPECT_EQ(kv->meta, "[1]");
  ASSERT_NO_FATAL_FAILURE(Reopen());
  ASSERT_OK_AND_ASSIGN(auto v1, catalog_->Get("m", 1));
  EXPECT_EQ(v1->meta, meta);
  EXPECT_EQ(v1->extents, (std::vector<Extent>{{1, 0, 8}}));
  EXPECT_EQ(v1->crc32c, std::nullopt);
  ASSERT_OK_AND_ASSIGN(auto v2, catalog_->Get("m", 2));
  EXPECT_EQ(v2->meta, "");
  EXPECT_EQ(v2->content_type, "");
  ASSERT_OK_AND_ASSIGN(auto v3, catalog_->Get("m", 3));
  EXPECT_EQ(v3->content_type, "image/png");
  EXPECT_EQ(v3->crc32c, 0xdeadbeefu);
  ASSERT_OK_AND_ASSIGN(auto v4, catalog_->Get("m", 4));
  EXPECT_EQ(v4->crc32c, 7u);
  EXPECT_EQ(v4->content_type, "");
}

TEST_F(CatalogTest, ConditionalPublishAndDeleteHappenOnlyAtTheVersionNamed) {
  ASSERT_OK(catalog_->Publish("c", {{1, 0, 8}}, false, nullptr, true, {.if_latest = 0}).status());
  EXPECT_THAT(catalog_->Publish("c", {{1, 0, 8}}, true, nullptr, true, {.if_latest = 0}).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(catalog_->Publish("c", {{1, 0, 8}}, true, nullptr, true, {.if_latest = 2}).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  ASSERT_OK_AND_ASSIGN(auto v2,
                       catalog_->Publish("c", {{1, 0, 8}}, true, nullptr, true, {.if_latest = 1}));
  EXPECT_EQ(v2.version, 2u);
  EXPECT_THAT(catalog_->Delete("c", nullptr, 1), StatusIs(absl::StatusCode::kFailedPrecondition));
  ASSERT_OK_AND_ASSIGN(auto still, catalog_->Get("c"));
  EXPECT_EQ(still->version, 2u);
  ASSERT_OK(catalog_->Delete("c", nullptr, 2));
  EXPECT_THAT(catalog_->Get("c").status(), StatusIs(absl::StatusCode::kNotFound));
  // The same for an ephemeral name.
  ASSERT_OK(catalog_->Publish("e", {{1, 0, 8}}, false, nullptr, false).status());
  EXPECT_THAT(catalog_->Publish("e", {{1, 0, 8}}, true, nullptr, false, {.if_latest = 0}).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(catalog_->Delete("e", nullptr, 5), StatusIs(absl::StatusCode::kFailedPrecondition));
  ASSERT_OK(catalog_->Delete("e", nullptr, 1));
}

TEST_F(CatalogTest, PublishingAnExistingNameWithoutReplaceIsAlreadyExistsAndChangesNothing) {
  ASSERT_OK(catalog_->Publish("a", {{1, 0, 10}}, false).status());
  EXPECT_THAT(catalog_->Publish("a", {{9, 0, 99}}, false),
              StatusIs(absl::StatusCode::kAlreadyExists));
  ASSERT_OK_AND_ASSIGN(auto r_ptr, catalog_->Get("a"));
  const ObjectRecord& r = *r_ptr;
  EXPECT_EQ(r.version, 1u);
  EXPECT_EQ(r.size, 10u);
  EXPECT_EQ(catalog_->RegionUsers(9), 0u);
}

TEST_F(CatalogTest, UnknownNamesAndVersionsAreNotFound) {
  EXPECT_THAT(catalog_->Get("nope"), StatusIs(absl::StatusCode::kNotFound));
  ASSERT_OK(catalog_->Publish("a", {{1, 0, 10}}, false).status());
  EXPECT_THAT(catalog_->Get("a", 2), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(catalog_->Delete("nope"), StatusIs(absl::StatusCode::kNotFound));
}

TEST_F(CatalogTest, ListsByPrefixInNameOrderWithPaging) {
  for (const char* n : {"b/2", "a/1", "b/1", "b/3", "c"}) {
    ASSERT_OK(catalog_->Publish(n, {{1, 0, 1}}, false).status());
  }
  ASSERT_OK_AND_ASSIGN(auto page1, catalog_->List("b/", "", 2));
  ASSERT_EQ(page1.size(), 2u);
  EXPECT_EQ(page1[0].name, "b/1");
  EXPECT_EQ(page1[1].name, "b/2");
  ASSERT_OK_AND_ASSIGN(auto page2, catalog_->List("b/", "b/2", 2));
  ASSERT_EQ(page2.size(), 1u);
  EXPECT_EQ(page2[0].name, "b/3");
  ASSERT_OK_AND_ASSIGN(auto all, catalog_->List("", "", 100));
  EXPECT_EQ(all.size(), 5u);
}

TEST_F(CatalogTest, DeleteRemovesEveryVersionAndReleasesRegions) {
  ASSERT_OK(catalog_->Publish("a", {{1, 0, 10}}, false).status());
  ASSERT_OK(catalog_->Publish("a", {{2, 0, 10}}, true).status());
  ASSERT_OK(catalog_->Delete("a"));
  EXPECT_THAT(catalog_->Get("a", 1), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_EQ(catalog_->RegionUsers(1), 0u);
  EXPECT_EQ(catalog_->RegionUsers(2), 0u);
  ASSERT_OK_AND_ASSIGN(ObjectRecord again, catalog_->Publish("a", {{1, 0, 1}}, false));
  EXPECT_EQ(again.version, 1u);
}

TEST_F(CatalogTest, PeekAnswersFromMemoryOnlyAndFollowsEveryChangeOfTheLatestVersion) {
  ASSERT_OK(catalog_->Publish("d", {{1, 0, 10}}, false).status());
  ASSERT_NO_FATAL_FAILURE(Reopen());
  // A durable name after a restart: only the store knows its latest version.
  EXPECT_EQ(catalog_->Peek("d"), nullptr);
  ASSERT_OK(catalog_->Get("d").status());
  ASSERT_NE(catalog_->Peek("d"), nullptr);
  EXPECT_EQ(catalog_->Peek("d")->version, 1u);
  ASSERT_OK(catalog_->Publish("d", {{2, 0, 10}}, true).status());
  EXPECT_EQ(catalog_->Peek("d")->version, 2u);
  ASSERT_OK_AND_ASSIGN(auto latest, catalog_->Get("d"));
  EXPECT_EQ(latest->version, 2u);
  ASSERT_NE(catalog_->Peek("d", 1), nullptr);  // decoded by the Get above
  EXPECT_EQ(catalog_->Peek("d", 1)->version, 1u);
  ASSERT_OK(catalog_->Delete("d"));
  EXPECT_EQ(catalog_->Peek("d"), nullptr);
  EXPECT_THAT(catalog_->Get("d"), StatusIs(absl::StatusCode::kNotFound));
  ASSERT_OK(catalog_->Publish("d", {{3, 0, 10}}, false).status());
  EXPECT_EQ(catalog_->Peek("d")->version, 1u);
  // Ephemeral objects are all in memory.
  ASSERT_OK(catalog_->Publish("e", {{4, 0, 10}}, false, nullptr, /*durable=*/false).status());
  ASSERT_NE(catalog_->Peek("e"), nullptr);
  EXPECT_EQ(catalog_->Peek("e", 7), nullptr);
}

TEST_F(CatalogTest, KeepVersionsDropsTheOldestOnPublishAndReleasesTheirRegions) {
  catalog_.reset();
  ASSERT_OK_AND_ASSIGN(catalog_, Catalog::Open(dir_.string(), {.sync = false, .keep_versions = 2}));
  std::set<uint64_t> released;
  ASSERT_OK(catalog_->Publish("a", {{1, 0, 10}, {9, 0, 1}}, false, &released).status());
  ASSERT_OK(catalog_->Publish("a", {{2, 0, 10}}, true, &released).status());
  ASSERT_OK(catalog_->Publish("ab", {{7, 0, 10}}, false, &released).status());  // a name after "a"
  EXPECT_THAT(released, ::testing::IsEmpty());
  ASSERT_OK(catalog_->Get("a", 1).status());  // warm the record cache with version 1
  // Version 3 drops version 1: region 1 had no other user, region 9 has version 3.
  ASSERT_OK(catalog_->Publish("a", {{3, 0, 10}, {9, 0, 1}}, true, &released).status());
  EXPECT_THAT(released, ::testing::ElementsAre(1u));
  EXPECT_THAT(catalog_->Get("a", 1), StatusIs(absl::StatusCode::kNotFound));
  ASSERT_OK_AND_ASSIGN(auto v2_ptr, catalog_->Get("a", 2));
  const ObjectRecord& v2 = *v2_ptr;
  EXPECT_EQ(v2.extents[0].region, 2u);
  EXPECT_EQ(catalog_->RegionUsers(9), 1u);
  released.clear();
  ASSERT_OK(catalog_->Publish("a", {{4, 0, 10}}, true, &released).status());
  EXPECT_THAT(released, ::testing::ElementsAre(2u));
  ASSERT_OK_AND_ASSIGN(auto latest_ptr, catalog_->Get("a"));
  const ObjectRecord& latest = *latest_ptr;
  EXPECT_EQ(latest.version, 4u);
  ASSERT_OK(catalog_->Get("ab", 1).status());  // other names keep theirs
  // What was dropped stays dropped, and the counts agree, after a restart.
  catalog_.reset();
  ASSERT_OK_AND_ASSIGN(catalog_, Catalog::Open(dir_.string(), {.sync = false}));
  EXPECT_THAT(catalog_->Get("a", 2), StatusIs(absl::StatusCode::kNotFound));
  ASSERT_OK(catalog_->Get("a", 3).status());
  EXPECT_EQ(catalog_->RegionUsers(1), 0u);
  EXPECT_EQ(catalog_->RegionUsers(2), 0u);
  EXPECT_EQ(catalog_->RegionUsers(9), 1u);
}

TEST_F(CatalogTest, RegionUsersCountsVersionsNotExtents) {
  ASSERT_OK(
      catalog_->Publish("a", {{1, 0, 10}, {1, 20, 10}, {2, 0, 5}, {1, 40, 1}}, false).status());
  EXPECT_EQ(catalog_->RegionUsers(1), 1u);
  EXPECT_EQ(catalog_->RegionUsers(2), 1u);
  ASSERT_OK(catalog_->Publish("a", {{1, 0, 10}, {1, 50, 10}}, true).status());
  EXPECT_EQ(catalog_->RegionUsers(1), 2u);
  EXPECT_EQ(catalog_->RegionUsers(2), 1u);
  ASSERT_NO_FATAL_FAILURE(Reopen());
  EXPECT_EQ(catalog_->RegionUsers(1), 2u);
  ASSERT_OK(catalog_->Delete("a"));
  EXPECT_EQ(catalog_->RegionUsers(1), 0u);
  EXPECT_EQ(catalog_->RegionUsers(2), 0u);
}

TEST_F(CatalogTest, RegionIdsAreNeverReusedAcrossRestarts) {
  ASSERT_OK_AND_ASSIGN(uint64_t a, catalog_->NextRegionId());
  ASSERT_OK_AND_ASSIGN(uint64_t b, catalog_->NextRegionId());
  EXPECT_NE(a, b);
  ASSERT_NO_FATAL_FAILURE(Reopen());
  ASSERT_OK_AND_ASSIGN(uint64_t c, catalog_->NextRegionId());
  EXPECT_GT(c, b);
}

TEST_F(CatalogTest, BadNamesAreRefused) {
  for (const std::string& bad :
       {std::string(""), std::string(257, 'a'), std::string("a//b"), std::string("/a"),
        std::string("a/"), std::string("a/./b"), std::string("../a"), std::string("a b"),
        std::string("a%2Fb"), std::string("a\0b", 3)}) {
    EXPECT_THAT(catalog_->Publish(bad, {{1, 0, 1}}, false),
                StatusIs(absl::StatusCode::kInvalidArgument))
        << bad;
  }
  EXPECT_OK(ValidateObjectName(std::string(256, 'a')));
  EXPECT_OK(ValidateObjectName("A.b_c-d/e.f/..g"));
}

TEST_F(CatalogTest, AStoreOnADiskShortOfTheRoomKeptFreeIsNotOpenedAnd507) {
  catalog_.reset();
  const absl::StatusOr<std::unique_ptr<Catalog>> c =
      Catalog::Open(dir_.string(), {.sync = false, .min_free_bytes = uint64_t{1} << 62});
  EXPECT_THAT(c, StatusIs(absl::StatusCode::kResourceExhausted));
  EXPECT_EQ(HttpStatusFor(c.status()), 507);
  Reopen();  // nothing changed: the store opens with the default room
}

TEST_F(CatalogTest, SecondOpenOfALockedStoreIsUnavailable) {
  EXPECT_THAT(Catalog::Open(dir_.string()), StatusIs(absl::StatusCode::kUnavailable));
}

TEST(RecordTest, RecordsComeBackAsTheyWereAndDamagedOnesAreDataLoss) {
  ObjectRecord r{.name = "w",
                 .version = 3,
                 .size = 30,
                 .extents = {{1, 0, 10}, {2, 5, 20}},
                 .created_ms = 1234,
                 .meta = "{}",
                 .content_type = "x/y",
                 .crc32c = 7};
  const std::string stored = EncodeRecord(r);
  ASSERT_OK_AND_ASSIGN(ObjectRecord back, DecodeRecord(stored));
  EXPECT_EQ(EncodeRecord(back), stored);
  EXPECT_EQ(back.extents[1].length, 20u);
  for (size_t cut : {size_t{1}, size_t{20}, stored.size() - 1}) {
    EXPECT_THAT(DecodeRecord(stored.substr(0, cut)), StatusIs(absl::StatusCode::kDataLoss));
  }
  EXPECT_THAT(DecodeRecord(stored + "x"), StatusIs(absl::StatusCode::kDataLoss));
  // A schema 1 (JSON) record, and one nested past the parser's limit: refused, the stack kept.
  ASSERT_OK_AND_ASSIGN(
      back,
      DecodeRecord(R"({"name":"v","version":1,"size":4,"created_ms":5,"extents":[[1,0,4]]})"));
  EXPECT_EQ(back.name, "v");
  EXPECT_THAT(DecodeRecord("{\"name\":" + std::string(200000, '[')),
              StatusIs(absl::StatusCode::kDataLoss));
  // Found by the fuzz target record: a float past int64 was converted (undefined behaviour).
  EXPECT_THAT(DecodeRecord(R"({"name":"v","version":1,"size":4,"created_ms":5.6e21,"extents":[]})"),
              StatusIs(absl::StatusCode::kDataLoss));
  EXPECT_THAT(DecodeRecord(R"({"name":"v","version":-1,"size":4,"created_ms":5,"extents":[]})"),
              StatusIs(absl::StatusCode::kDataLoss));
}

}  // namespace
}  // namespace ferry::metadata
