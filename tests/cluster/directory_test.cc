// The directory: ferryd's own store (leases, keys, expiry, reopen), and the one client that
// speaks etcd's JSON gateway to it over real HTTP. The same client against a real etcd is in
// tests/python/test_cluster.py.
#include "cluster/directory.h"

#include <gmock/gmock.h>
#include <httplib.h>
#include <unistd.h>

#include <filesystem>
#include <thread>

#include "cluster/directory_store.h"
#include "tests/testing/status_matchers.h"

namespace ferry::cluster {
namespace {

using ::ferry::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::Field;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

auto KeyIs(const std::string& key) { return Field(&KeyValue::key, key); }

class DirectoryStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("ferry-directory-" + std::to_string(getpid()) + "-" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);
    ASSERT_OK_AND_ASSIGN(store_, DirectoryStore::Open(dir_.string()));
  }
  void TearDown() override {
    store_.reset();
    std::filesystem::remove_all(dir_);
  }
  std::filesystem::path dir_;
  std::unique_ptr<DirectoryStore> store_;
};

TEST_F(DirectoryStoreTest, RangesArePrefixesInKeyOrderAndRevokeTakesALeasesKeysOnly) {
  ASSERT_OK_AND_ASSIGN(int64_t lease, store_->Grant(absl::Seconds(60)));
  ASSERT_OK(store_->Put("ferry/nodes/b", "B", lease));
  ASSERT_OK(store_->Put("ferry/nodes/a", "A", lease));
  ASSERT_OK(store_->Put("ferry/nodes/c", "C", 0));
  ASSERT_OK(store_->Put("ferry/nodesX", "X", 0));
  ASSERT_OK_AND_ASSIGN(auto kvs,
                       store_->Range("ferry/nodes/", Directory::PrefixEnd("ferry/nodes/")));
  EXPECT_THAT(kvs,
              ElementsAre(KeyIs("ferry/nodes/a"), KeyIs("ferry/nodes/b"), KeyIs("ferry/nodes/c")));
  EXPECT_EQ(kvs[0].value, "A");
  EXPECT_EQ(kvs[0].lease, lease);
  EXPECT_EQ(kvs[2].lease, 0);
  ASSERT_OK_AND_ASSIGN(kvs, store_->Range("ferry/nodes/c", ""));
  EXPECT_THAT(kvs, ElementsAre(KeyIs("ferry/nodes/c")));

  ASSERT_OK(store_->Revoke(lease));
  ASSERT_OK_AND_ASSIGN(kvs, store_->Range("ferry/", Directory::PrefixEnd("ferry/")));
  EXPECT_THAT(kvs, ElementsAre(KeyIs("ferry/nodes/c"), KeyIs("ferry/nodesX")));
  EXPECT_THAT(store_->Revoke(lease), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(store_->KeepAlive(lease).status(), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(store_->Put("k", "v", lease), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(store_->Put("", "v", 0), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(store_->Grant(absl::ZeroDuration()).status(),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST_F(DirectoryStoreTest, AKeyPutAgainWithoutTheLeaseOutlivesIt) {
  ASSERT_OK_AND_ASSIGN(int64_t lease, store_->Grant(absl::Seconds(60)));
  ASSERT_OK(store_->Put("k", "1", lease));
  ASSERT_OK(store_->Put("k", "2", 0));
  ASSERT_OK(store_->Revoke(lease));
  ASSERT_OK_AND_ASSIGN(auto kvs, store_->Range("k", ""));
  ASSERT_THAT(kvs, ElementsAre(KeyIs("k")));
  EXPECT_EQ(kvs[0].value, "2");
  ASSERT_OK_AND_ASSIGN(int64_t deleted, store_->DeleteRange("k", ""));
  EXPECT_EQ(deleted, 1);
  ASSERT_OK_AND_ASSIGN(kvs, store_->Range("k", ""));
  EXPECT_THAT(kvs, IsEmpty());
}

TEST_F(DirectoryStoreTest, ALeaseNotRenewedWithinItsTtlGoesWithItsKeysAndARenewedOneStays) {
  ASSERT_OK_AND_ASSIGN(int64_t dying, store_->Grant(absl::Seconds(1)));
  ASSERT_OK_AND_ASSIGN(int64_t kept, store_->Grant(absl::Seconds(1)));
  ASSERT_OK(store_->Put("dying", "x", dying));
  ASSERT_OK(store_->Put("kept", "x", kept));
  // Past the first lease's TTL (the expiry thread runs every 100 ms; ExpireNow makes it
  // certain), renewing only the second one on the way.
  const absl::Time due = absl::Now() + absl::Milliseconds(1200);
  while (absl::Now() < due) {
    ASSERT_OK(store_->KeepAlive(kept).status());
    absl::SleepFor(absl::Milliseconds(200));
  }
  store_->ExpireNow();
  EXPECT_THAT(store_->KeepAlive(dying).status(), StatusIs(absl::StatusCode::kNotFound));
  ASSERT_OK_AND_ASSIGN(absl::Duration ttl, store_->KeepAlive(kept));
  EXPECT_EQ(ttl, absl::Seconds(1));
  ASSERT_OK_AND_ASSIGN(auto kvs, store_->Range("", std::string(1, '\0')));
  EXPECT_THAT(kvs, ElementsAre(KeyIs("kept")));
}

TEST_F(DirectoryStoreTest, LeasesAndTheirKeysSurviveAReopenWithTheirTtlStartedAgain) {
  ASSERT_OK_AND_ASSIGN(int64_t lease, store_->Grant(absl::Seconds(30)));
  ASSERT_OK(store_->Put("node", "n", lease));
  store_.reset();
  ASSERT_OK_AND_ASSIGN(store_, DirectoryStore::Open(dir_.string()));
  ASSERT_OK_AND_ASSIGN(absl::Duration ttl, store_->KeepAlive(lease));
  EXPECT_EQ(ttl, absl::Seconds(30));
  // A new lease does not reuse the old one's id.
  ASSERT_OK_AND_ASSIGN(int64_t second, store_->Grant(absl::Seconds(30)));
  EXPECT_NE(second, lease);
  ASSERT_OK(store_->Revoke(lease));
  ASSERT_OK_AND_ASSIGN(auto kvs, store_->Range("node", ""));
  EXPECT_THAT(kvs, IsEmpty());
}

// The client over HTTP against the store's routes, as ferryd --serve-directory installs them.
class DirectoryClientTest : public DirectoryStoreTest {
 protected:
  void SetUp() override {
    DirectoryStoreTest::SetUp();
    InstallDirectoryRoutes(
        server_, *store_, [](const httplib::Request& req, httplib::Response& res) {
          if (req.get_header_value("Authorization") == "Bearer s3cret") {
            return true;
          }
          // As ferryd's own guard answers.
          res.status = 401;
          res.set_content(R"({"error":{"code":"UNAUTHENTICATED","message":"bad token"}})",
                          "application/json");
          return false;
        });
    port_ = server_.bind_to_any_port("127.0.0.1");
    ASSERT_GT(port_, 0);
    thread_ = std::thread([this] { server_.listen_after_bind(); });
  }
  void TearDown() override {
    server_.stop();
    thread_.join();
    DirectoryStoreTest::TearDown();
  }
  std::string url() const { return "http://127.0.0.1:" + std::to_string(port_); }
  httplib::Server server_;
  int port_ = 0;
  std::thread thread_;
};

TEST_F(DirectoryClientTest, LeasesKeysAndRangesGoThroughTheGateway) {
  ASSERT_OK_AND_ASSIGN(auto d, Directory::Connect(url(), {.token = "s3cret"}));
  ASSERT_OK_AND_ASSIGN(int64_t lease, d->Grant(absl::Seconds(10)));
  ASSERT_OK(d->Put("ferry/objects/m@1/n1", "{\"size\":4}", lease));
  ASSERT_OK(d->Put("ferry/objects/m@2/n1", std::string("\0\xff", 2), lease));
  ASSERT_OK(d->Put("ferry/objects/mm@1/n1", "other", lease));
  ASSERT_OK_AND_ASSIGN(auto kvs, d->Range("ferry/objects/m@"));
  ASSERT_THAT(kvs, ElementsAre(KeyIs("ferry/objects/m@1/n1"), KeyIs("ferry/objects/m@2/n1")));
  EXPECT_EQ(kvs[1].value, std::string("\0\xff", 2));
  EXPECT_EQ(kvs[1].lease, lease);
  ASSERT_OK_AND_ASSIGN(absl::Duration ttl, d->KeepAlive(lease));
  EXPECT_EQ(ttl, absl::Seconds(10));
  ASSERT_OK_AND_ASSIGN(int64_t deleted, d->Delete("ferry/objects/mm@1/n1"));
  EXPECT_EQ(deleted, 1);
  ASSERT_OK(d->Revoke(lease));
  ASSERT_OK_AND_ASSIGN(kvs, d->Range("ferry/"));
  EXPECT_THAT(kvs, IsEmpty());
  // A lease that is gone, as etcd says it.
  EXPECT_THAT(d->KeepAlive(lease).status(), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(d->Put("k", "v", lease), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(d->Revoke(lease), StatusIs(absl::StatusCode::kNotFound));
}

TEST_F(DirectoryClientTest, AWrongTokenIsRefusedAndChangesNothing) {
  ASSERT_OK_AND_ASSIGN(auto d, Directory::Connect(url(), {.token = "wrong"}));
  EXPECT_THAT(d->Put("k", "v"),
              StatusIs(absl::StatusCode::kUnauthenticated, HasSubstr("bad token")));
  ASSERT_OK_AND_ASSIGN(auto kvs, store_->Range("k", ""));
  EXPECT_THAT(kvs, IsEmpty());
}

// A directory whose keep-alive answers only when the test lets it: a Range asked meanwhile
// from another thread is answered at once, on a connection of its own.
TEST(DirectoryConcurrencyTest, ACallWaitingForItsAnswerHoldsNoOtherBack) {
  absl::Mutex mu;
  bool entered = false, released = false;
  httplib::Server server;
  server.Post("/v3/lease/keepalive", [&](const httplib::Request&, httplib::Response& res) {
    absl::MutexLock lock(&mu);
    entered = true;
    mu.Await(absl::Condition(&released));
    res.set_content(R"({"result":{"ID":"7","TTL":"5"}})", "application/json");
  });
  server.Post("/v3/kv/range", [](const httplib::Request&, httplib::Response& res) {
    res.set_content(R"({"kvs":[{"key":"aw==","value":"dg==","lease":"7"}]})", "application/json");
  });
  const int port = server.bind_to_any_port("127.0.0.1");
  ASSERT_GT(port, 0);
  std::thread serving([&] { server.listen_after_bind(); });
  ASSERT_OK_AND_ASSIGN(auto d, Directory::Connect("etcd://127.0.0.1:" + std::to_string(port),
                                                  {.timeout = absl::Seconds(5)}));
  absl::StatusOr<absl::Duration> kept = absl::UnknownError("not yet");
  std::thread keeping([&] { kept = d->KeepAlive(7); });
  {
    absl::MutexLock lock(&mu);
    mu.Await(absl::Condition(&entered));
  }
  // The keep-alive is inside its handler, and stays there until this Range has its answer.
  auto kvs = d->Range("k");
  {
    absl::MutexLock lock(&mu);
    released = true;
  }
  keeping.join();
  ASSERT_OK(kvs.status());
  ASSERT_THAT(*kvs, ElementsAre(KeyIs("k")));
  EXPECT_EQ((*kvs)[0].value, "v");
  ASSERT_OK(kept.status());  // a call serialized behind the Range would have timed out
  EXPECT_EQ(*kept, absl::Seconds(5));
  server.stop();
  serving.join();
}

TEST(DirectoryConnectTest, BadUrlsAreRefusedAndAnUnreachableOneIsUnavailable) {
  for (const char* bad : {"", "etcd://", "http://", "ftp://h:1", "h:2379"}) {
    EXPECT_THAT(Directory::Connect(bad).status(), StatusIs(absl::StatusCode::kInvalidArgument))
        << bad;
  }
  // A port nothing listens on: bound, then closed.
  httplib::Server probe;
  const int port = probe.bind_to_any_port("127.0.0.1");
  probe.stop();
  ASSERT_OK_AND_ASSIGN(auto d, Directory::Connect("etcd://127.0.0.1:" + std::to_string(port),
                                                  {.timeout = absl::Milliseconds(500)}));
  EXPECT_THAT(d->Range("ferry/").status(),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("unreachable")));
}

}  // namespace
}  // namespace ferry::cluster
