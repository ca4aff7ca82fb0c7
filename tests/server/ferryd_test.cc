// ferryd end to end: real ferryd processes on loopback, real HTTP, real RocksDB, real
// libfabric (tcp provider) between them.
#include <arpa/inet.h>
#include <gmock/gmock.h>
#include <httplib.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "base/hex.h"
#include "engine/cuda.h"
#include "engine/engine.h"
#include "ferry/layout.h"
#include "nlohmann/json.hpp"
#include "server/node.h"
#include "tests/testing/ferryd_process.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/subprocess.h"
#include "wire/extents.h"
#include "wire/messages.h"

namespace ferry {
namespace {

using ::ferry::testing::Subprocess;
using json = nlohmann::json;
constexpr char kOctet[] = "application/octet-stream";

std::filesystem::path TempDir(const std::string& tag) {
  auto dir = std::filesystem::temp_directory_path() /
             ("ferryd-test-" + std::to_string(getpid()) + "-" + tag);
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

// A ferryd process on an ephemeral loopback port.
class Ferryd {
 public:
  explicit Ferryd(std::filesystem::path data_dir, std::vector<std::string> extra = {})
      : data_dir_(std::move(data_dir)), extra_(std::move(extra)) {}
  void Start() {
    std::vector<std::string> args = {"--data-dir", data_dir_.string(), "--domain",
                                     "lo",         "--rails",          "2"};
    // A thread per rail, as ferryd's default gives on 4 CPUs or more: transfers then cross
    // threads here too (this machine's default would be one).
    if (std::find(extra_.begin(), extra_.end(), "--progress-threads") == extra_.end()) {
      args.insert(args.end(), {"--progress-threads", "2"});
    }
    args.insert(args.end(), extra_.begin(), extra_.end());
    auto f = testing::StartFerryd(FERRYD_PATH, args);
    ASSERT_TRUE(f.ok()) << f.status();
    f_ = std::move(*f);
  }
  void Kill9() {
    f_.proc->Kill(SIGKILL);
    f_.proc->Wait();
  }
  int Stop() { return f_.Stop(); }
  httplib::Client Client(const std::string& token = "") const {
    httplib::Client c(f_.url);
    c.set_read_timeout(120);
    if (!token.empty()) c.set_bearer_token_auth(token.c_str());
    return c;
  }
  const std::string& url() const { return f_.url; }
  const std::string& id() const { return f_.id; }
  pid_t pid() const { return f_.proc->pid(); }

 private:
  std::filesystem::path data_dir_;
  std::vector<std::string> extra_;
  testing::FerrydProcess f_;
};

// A plain TCP connection to a ferryd's HTTP port (for requests httplib's client cannot send),
// or -1.
int ConnectTo(const std::string& url) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  sockaddr_in addr = {};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(std::stoi(url.substr(url.rfind(':') + 1))));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

std::string ErrorCode(const httplib::Result& r) {
  if (!r) return "NO RESPONSE";
  auto j = json::parse(r->body, nullptr, false);
  if (j.is_discarded() || !j.contains("error")) return "NO ERROR BODY: " + r->body;
  return j["error"]["code"].get<std::string>();
}

// Asserts status code and error code of a response.
#define EXPECT_HTTP_ERROR(result, http_status, error_code) \
  do {                                                     \
    auto&& r_ = (result);                                  \
    ASSERT_TRUE(r_) << "no response";                      \
    EXPECT_EQ(r_->status, http_status) << r_->body;        \
    EXPECT_EQ(ErrorCode(r_), error_code) << r_->body;      \
  } while (0)

// A node-to-node message to `node` over POST /v1/peer, from a node at `from`; its answer.
absl::StatusOr<wire::Envelope> PeerCall(const Ferryd& node, wire::MessageType type,
                                        std::string body, const PeerAddress& from) {
  static uint64_t next_id = 1;
  auto r =
      node.Client().Post("/v1/peer", wire::EncodeEnvelope({type, next_id++, from, std::move(body)}),
                         wire::kMessageContentType);
  if (!r) return absl::UnavailableError("no answer");
  if (r->status != 200) return absl::UnknownError("HTTP " + std::to_string(r->status) + r->body);
  return wire::DecodeEnvelope(r->body);
}

// The answer is an error of this code.
#define EXPECT_PEER_ERROR(answer, want)                                      \
  do {                                                                       \
    auto peer_answer_ = (answer);                                            \
    ASSERT_TRUE(peer_answer_.ok()) << peer_answer_.status();                 \
    ASSERT_EQ(peer_answer_->type, wire::MessageType::kError);                \
    absl::Status peer_status_;                                               \
    ASSERT_TRUE(wire::DecodeStatus(peer_answer_->body, &peer_status_).ok()); \
    EXPECT_EQ(peer_status_.code(), want) << peer_status_;                    \
  } while (0)

std::string RandomBytes(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::string s(n, '\0');
  for (size_t i = 0; i < n; i += 8) {
    uint64_t v = rng();
    memcpy(s.data() + i, &v, std::min<size_t>(8, n - i));
  }
  return s;
}

class FerrydTest : public ::testing::Test {
 protected:
  void SetUp() override {
    a_ = std::make_unique<Ferryd>(TempDir("a"));
    ASSERT_NO_FATAL_FAILURE(a_->Start());
  }
  void TearDown() override {
    a_.reset();
    b_.reset();
    std::filesystem::remove_all(TempDir("a"));
    std::filesystem::remove_all(TempDir("b"));
  }
  void StartB() {
    b_ = std::make_unique<Ferryd>(TempDir("b"));
    ASSERT_NO_FATAL_FAILURE(b_->Start());
  }
  // Uploads `bytes` as `name` on `node` and returns its region id.
  uint64_t Upload(Ferryd& node, const std::string& name, const std::string& bytes) {
    auto r = node.Client().Put(("/v1/objects/" + name + "/data").c_str(), bytes, kOctet);
    EXPECT_TRUE(r && r->status == 201) << (r ? r->body : "no response");
    return r ? json::parse(r->body)["extents"][0]["region"].get<uint64_t>() : 0;
  }
  json ObjectList(Ferryd& node) {
    auto r = node.Client().Get("/v1/objects?limit=1000");
    return r ? json::parse(r->body) : json();
  }
  std::unique_ptr<Ferryd> a_, b_;
};

TEST_F(FerrydTest, HealthAndNodeDescribeTheNode) {
  auto c = a_->Client();
  auto h = c.Get("/v1/health");
  ASSERT_TRUE(h);
  EXPECT_EQ(h->status, 200);
  auto n = c.Get("/v1/node");
  ASSERT_TRUE(n);
  auto j = json::parse(n->body);
  EXPECT_EQ(j["id"], a_->id());
  ASSERT_EQ(j["rails"].size(), 2u);
  EXPECT_EQ(j["rails"][0]["provider"], "tcp;ofi_rxm");
  EXPECT_FALSE(j["rails"][0]["address"].get<std::string>().empty());
  EXPECT_EQ(j["progress_threads"], 2);
  json devices = {"host"};  // and every GPU there is
  for (int i = 0; i < engine::CudaDeviceCount(); ++i) {
    devices.push_back("cuda:" + std::to_string(i));
  }
  EXPECT_EQ(j["devices"], devices);
  EXPECT_HTTP_ERROR(c.Get("/v1/nothing"), 404, "NOT_FOUND");
}

TEST_F(FerrydTest, JsonAnswersAreNotCompressedForClientsThatAcceptIt) {
  auto c = a_->Client();
  for (int i = 0; i < 200; ++i) {  // an answer big enough to be worth compressing
    ASSERT_EQ(c.Post("/v1/regions", R"({"device":"host","size":4096})", "application/json")->status,
              201);
  }
  for (const char* accept : {"br", "gzip, deflate", "br, gzip, deflate"}) {
    auto r = c.Get("/v1/regions", {{"Accept-Encoding", accept}});
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 200);
    EXPECT_FALSE(r->has_header("Content-Encoding")) << accept;
    EXPECT_EQ(r->get_header_value("Content-Type"), "application/json; charset=utf-8");
    EXPECT_EQ(json::parse(r->body)["regions"].size(), 200u) << accept;
  }
}

TEST_F(FerrydTest, ProgressThreadsDefaultToOnePerRailUpToHalfTheCpus) {
  b_ = std::make_unique<Ferryd>(TempDir("b"), std::vector<std::string>{"--progress-threads", "0"});
  ASSERT_NO_FATAL_FAILURE(b_->Start());
  auto j = json::parse(b_->Client().Get("/v1/node")->body);
  EXPECT_EQ(j["rails"].size(), 2u);
  EXPECT_EQ(j["progress_threads"], engine::AutoProgressThreads(2));
}

TEST_F(FerrydTest, RegionsAreAllocatedListedAndDeletedAndBadInputIsRefused) {
  auto c = a_->Client();
  auto r = c.Post("/v1/regions", R"({"device":"host","size":4096})", "application/json");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 201) << r->body;
  const uint64_t id = json::parse(r->body)["id"];
  auto list = json::parse(c.Get("/v1/regions")->body);
  ASSERT_EQ(list["regions"].size(), 1u);
  EXPECT_EQ(list["regions"][0]["size"], 4096);
  EXPECT_HTTP_ERROR(c.Post("/v1/regions", R"({"device":"host","size":0})", "application/json"), 400,
                    "INVALID_ARGUMENT");
  EXPECT_HTTP_ERROR(c.Post("/v1/regions", R"({"device":"gpu","size":10})", "application/json"), 400,
                    "INVALID_ARGUMENT");
  EXPECT_HTTP_ERROR(c.Post("/v1/regions", R"({"device":"host","size":-1})", "application/json"),
                    400, "INVALID_ARGUMENT");
  EXPECT_HTTP_ERROR(c.Post("/v1/regions", R"({"device":"host"})", "application/json"), 400,
                    "INVALID_ARGUMENT");
  EXPECT_HTTP_ERROR(c.Post("/v1/regions", R"({"device":"host","size":)", "application/json"), 400,
                    "INVALID_ARGUMENT");
  // A GPU that is not there: 404 with CUDA in the build, 501 without.
  if (engine::CudaBuilt()) {
    EXPECT_HTTP_ERROR(
        c.Post("/v1/regions", R"({"device":"cuda:99","size":10})", "application/json"), 404,
        "NOT_FOUND");
  } else {
    EXPECT_HTTP_ERROR(c.Post("/v1/regions", R"({"device":"cuda:0","size":10})", "application/json"),
                      501, "UNIMPLEMENTED");
  }
  EXPECT_HTTP_ERROR(c.Delete("/v1/regions/999"), 404, "NOT_FOUND");
  // In use by an object: 409, and it stays.
  auto pub = c.Put("/v1/objects/uses",
                   json{{"extents", {{{"region", id}, {"offset", 0}, {"length", 10}}}}}.dump(),
                   "application/json");
  ASSERT_EQ(pub->status, 201) << pub->body;
  EXPECT_HTTP_ERROR(c.Delete(("/v1/regions/" + std::to_string(id)).c_str()), 409,
                    "FAILED_PRECONDITION");
  ASSERT_EQ(c.Delete("/v1/objects/uses")->status, 200);
  EXPECT_EQ(c.Delete(("/v1/regions/" + std::to_string(id)).c_str())->status, 200);
  EXPECT_EQ(json::parse(c.Get("/v1/regions")->body)["regions"].size(), 0u);
}

TEST_F(FerrydTest, ObjectsArePublishedReplacedVersionedListedAndDeleted) {
  auto c = a_->Client();
  const uint64_t region = Upload(*a_, "base", RandomBytes(1 << 16, 1));
  auto layout = [&](uint64_t off, uint64_t len) {
    return json{{"extents", {{{"region", region}, {"offset", off}, {"length", len}}}}}.dump();
  };
  auto v1 = c.Put("/v1/objects/m%2Fa", layout(0, 100), "application/json");
  ASSERT_EQ(v1->status, 201) << v1->body;
  EXPECT_EQ(json::parse(v1->body)["version"], 1);
  EXPECT_HTTP_ERROR(c.Put("/v1/objects/m%2Fa", layout(0, 5), "application/json"), 409,
                    "ALREADY_EXISTS");
  auto v2 = c.Put("/v1/objects/m%2Fa?replace=true", layout(100, 50), "application/json");
  ASSERT_EQ(v2->status, 201);
  EXPECT_EQ(json::parse(v2->body)["version"], 2);
  auto latest = json::parse(c.Get("/v1/objects/m%2Fa")->body);
  EXPECT_EQ(latest["version"], 2);
  EXPECT_EQ(latest["size"], 50);
  auto old = json::parse(c.Get("/v1/objects/m%2Fa?version=1")->body);
  EXPECT_EQ(old["size"], 100);
  EXPECT_HTTP_ERROR(c.Get("/v1/objects/m%2Fa?version=7"), 404, "NOT_FOUND");
  EXPECT_HTTP_ERROR(c.Get("/v1/objects/m%2Fa?version=x"), 400, "INVALID_ARGUMENT");
  for (const char* n : {"m%2Fb", "m%2Fc", "n%2Fa"}) {
    ASSERT_EQ(
        c.Put((std::string("/v1/objects/") + n).c_str(), layout(0, 1), "application/json")->status,
        201);
  }
  auto page = json::parse(c.Get("/v1/objects?prefix=m/&limit=2")->body)["objects"];
  ASSERT_EQ(page.size(), 2u);
  EXPECT_EQ(page[0]["name"], "m/a");
  EXPECT_EQ(page[1]["name"], "m/b");
  auto next = json::parse(c.Get("/v1/objects?prefix=m/&limit=2&after=m/b")->body)["objects"];
  ASSERT_EQ(next.size(), 1u);
  EXPECT_EQ(next[0]["name"], "m/c");
  EXPECT_HTTP_ERROR(c.Get("/v1/objects?limit=0"), 400, "INVALID_ARGUMENT");
  ASSERT_EQ(c.Delete("/v1/objects/m%2Fa")->status, 200);
  EXPECT_HTTP_ERROR(c.Get("/v1/objects/m%2Fa"), 404, "NOT_FOUND");
  EXPECT_HTTP_ERROR(c.Delete("/v1/objects/m%2Fa"), 404, "NOT_FOUND");
}

TEST_F(FerrydTest, BadPublishRequestsGetTheirCodeAndChangeNothing) {
  a_ = std::make_unique<Ferryd>(TempDir("a"), std::vector<std::string>{"--max-extents", "4"});
  ASSERT_NO_FATAL_FAILURE(a_->Start());
  auto c = a_->Client();
  const uint64_t region = Upload(*a_, "base", RandomBytes(4096, 2));
  const json before = ObjectList(*a_);
  auto ext = [&](json e) { return json{{"extents", e}}.dump(); };
  auto put = [&](const std::string& name, const std::string& body) {
    return c.Put(("/v1/objects/" + name).c_str(), body, "application/json");
  };
  EXPECT_HTTP_ERROR(put("x", "{not json"), 400, "INVALID_ARGUMENT");
  EXPECT_HTTP_ERROR(put("x", "[1,2]"), 400, "INVALID_ARGUMENT");
  EXPECT_HTTP_ERROR(put("x", R"({"extents":"no"})"), 400, "INVALID_ARGUMENT");
  EXPECT_HTTP_ERROR(put("x", ext({{{"region", "1"}, {"offset", 0}, {"length", 1}}})), 400,
                    "INVALID_ARGUMENT");
  EXPECT_HTTP_ERROR(put("x", ext({{{"region", region}, {"offset", -1}, {"length", 1}}})), 400,
                    "INVALID_ARGUMENT");
  EXPECT_HTTP_ERROR(put("x", ext(json::array())), 400, "INVALID_ARGUMENT");
  EXPECT_HTTP_ERROR(put("x", ext({{{"region", 999}, {"offset", 0}, {"length", 1}}})), 404,
                    "NOT_FOUND");
  EXPECT_HTTP_ERROR(put("x", ext({{{"region", region}, {"offset", 4000}, {"length", 100}}})), 400,
                    "INVALID_ARGUMENT");
  EXPECT_HTTP_ERROR(
      put("x", ext({{{"region", region}, {"offset", 18446744073709551615ull}, {"length", 2}}})),
      400, "INVALID_ARGUMENT");
  EXPECT_HTTP_ERROR(put("x", ext({{{"region", region}, {"offset", 0}, {"length", 0}}})), 400,
                    "INVALID_ARGUMENT");
  json five = json::array();
  for (int i = 0; i < 5; ++i) five.push_back({{"region", region}, {"offset", i}, {"length", 1}});
  EXPECT_HTTP_ERROR(put("x", ext(five)), 413, "RESOURCE_EXHAUSTED");
  const std::string good = ext({{{"region", region}, {"offset", 0}, {"length", 1}}});
  for (const std::string& bad :
       {std::string("a%2F%2Fb"), std::string(".."), std::string("a%2F.%2Fb"), std::string("a%20b"),
        std::string("%2Fa"), std::string(257, 'a')}) {
    SCOPED_TRACE(bad);
    EXPECT_HTTP_ERROR(put(bad, good), 400, "INVALID_ARGUMENT");
  }
  EXPECT_HTTP_ERROR(c.Put("/v1/objects/x?replace=maybe", good, "application/json"), 400,
                    "INVALID_ARGUMENT");
  EXPECT_EQ(ObjectList(*a_), before);
  EXPECT_EQ(c.Get("/v1/health")->status, 200);
}

TEST_F(FerrydTest, DataIsUploadedAndReadBackWithRanges) {
  auto c = a_->Client();
  const std::string bytes = RandomBytes(3 << 20, 3);
  Upload(*a_, "blob", bytes);
  auto full = c.Get("/v1/objects/blob/data");
  ASSERT_EQ(full->status, 200);
  EXPECT_TRUE(full->body == bytes);
  auto part = c.Get("/v1/objects/blob/data", {{"Range", "bytes=1000-1999"}});
  ASSERT_EQ(part->status, 206);
  EXPECT_TRUE(part->body == bytes.substr(1000, 1000));
  EXPECT_EQ(part->get_header_value("Content-Range"), "bytes 1000-1999/3145728");
  auto tail = c.Get("/v1/objects/blob/data", {{"Range", "bytes=-10"}});
  ASSERT_EQ(tail->status, 206);
  EXPECT_TRUE(tail->body == bytes.substr(bytes.size() - 10));
  EXPECT_EQ(c.Get("/v1/objects/blob/data", {{"Range", "bytes=99999999-"}})->status, 416);
  // A last byte past the end is the end (it was served as asked, and the connection cut).
  auto over = c.Get("/v1/objects/blob/data", {{"Range", "bytes=3145000-99999999"}});
  ASSERT_EQ(over->status, 206);
  EXPECT_EQ(over->get_header_value("Content-Range"), "bytes 3145000-3145727/3145728");
  EXPECT_TRUE(over->body == bytes.substr(3145000));
  EXPECT_HTTP_ERROR(c.Put("/v1/objects/blob/data", bytes, kOctet), 409, "ALREADY_EXISTS");
  EXPECT_EQ(c.Put("/v1/objects/blob/data?replace=true", "new", kOctet)->status, 201);
  EXPECT_EQ(c.Get("/v1/objects/blob/data")->body, "new");
  EXPECT_TRUE(c.Get("/v1/objects/blob/data?version=1")->body == bytes);
  EXPECT_HTTP_ERROR(c.Put("/v1/objects/empty/data", "", kOctet), 400, "INVALID_ARGUMENT");
  EXPECT_HTTP_ERROR(c.Get("/v1/objects/nope/data"), 404, "NOT_FOUND");
}

// The value of one series (`name{labels}`) in the node's /metrics; 0 when it has none yet.
double MetricValue(const Ferryd& node, const std::string& series) {
  auto r = node.Client().Get("/metrics");
  if (!r || r->status != 200) return -1;
  for (absl::string_view line : absl::StrSplit(r->body, '\n')) {
    if (absl::ConsumePrefix(&line, series + " ")) return std::stod(std::string(line));
  }
  return 0;
}

TEST_F(FerrydTest, UploadsGoIntoTheirBufferAsTheyArriveWithoutASecondCopy) {
  const std::string streamed = "ferry_upload_bytes_total{how=\"streamed\"}";
  const std::string buffered = "ferry_upload_bytes_total{how=\"buffered\"}";
  const std::string bytes = RandomBytes(64 << 20, 11);
  Upload(*a_, "big", bytes);
  // Into the new buffer as they came (the node counts how it stored them), never read whole
  // first: a body read whole took the node's peak memory up by twice the object.
  EXPECT_EQ(MetricValue(*a_, streamed), 64 << 20);
  EXPECT_EQ(MetricValue(*a_, buffered), 0);
  EXPECT_TRUE(a_->Client().Get("/v1/objects/big/data")->body == bytes);
  // A body without a Content-Length (chunked) is read whole, then stored the same way.
  auto c = a_->Client();
  const std::string chunked = RandomBytes(300000, 12);
  auto r = c.Put(
      "/v1/objects/chunked/data",
      [&](size_t offset, httplib::DataSink& sink) {
        const size_t n = std::min<size_t>(65536, chunked.size() - offset);
        sink.write(chunked.data() + offset, n);
        if (offset + n == chunked.size()) sink.done();
        return true;
      },
      kOctet);
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 201) << r->body;
  EXPECT_TRUE(c.Get("/v1/objects/chunked/data")->body == chunked);
  EXPECT_EQ(MetricValue(*a_, buffered), 300000);
  EXPECT_EQ(MetricValue(*a_, streamed), 64 << 20);
}

TEST_F(FerrydTest, RefusedAndCutShortUploadsChangeNothingAndTheConnectionStaysUsable) {
  a_ = std::make_unique<Ferryd>(TempDir("a"), std::vector<std::string>{"--max-body-mb", "1"});
  ASSERT_NO_FATAL_FAILURE(a_->Start());
  Upload(*a_, "taken", RandomBytes(4096, 1));
  const json objects = ObjectList(*a_);
  const std::string regions = a_->Client().Get("/v1/regions")->body;
  // One connection for all: a refused body is still read to its end, so the next request on
  // the connection is understood.
  auto c = a_->Client();
  c.set_keep_alive(true);
  const std::string body = RandomBytes(512 << 10, 2);
  EXPECT_HTTP_ERROR(c.Put("/v1/objects/taken/data", body, kOctet), 409, "ALREADY_EXISTS");
  EXPECT_EQ(c.Get("/v1/health")->status, 200);
  EXPECT_HTTP_ERROR(c.Put("/v1/objects/a%20b/data", body, kOctet), 400, "INVALID_ARGUMENT");
  EXPECT_HTTP_ERROR(c.Put("/v1/objects/x/data?device=tpu:0", body, kOctet), 400,
                    "INVALID_ARGUMENT");
  EXPECT_HTTP_ERROR(c.Put("/v1/objects/x/data?replace=maybe", body, kOctet), 400,
                    "INVALID_ARGUMENT");
  EXPECT_HTTP_ERROR(c.Put("/v1/objects/x/data", RandomBytes(2 << 20, 3), kOctet), 413,
                    "RESOURCE_EXHAUSTED");
  EXPECT_EQ(c.Get("/v1/health")->status, 200);
  httplib::MultipartFormDataItems form = {{"file", "abc", "f", kOctet}};
  EXPECT_HTTP_ERROR(c.Put("/v1/objects/x/data", form), 400, "INVALID_ARGUMENT");
  EXPECT_EQ(c.Get("/v1/health")->status, 200);

  // A body that ends before its Content-Length: the client goes after 1000 of 100000 bytes.
  // The node has allocated the buffer by then; it must free it and publish nothing.
  const int fd = ConnectTo(a_->url());
  ASSERT_GE(fd, 0) << strerror(errno);
  const std::string head =
      "PUT /v1/objects/short/data HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100000\r\n"
      "Content-Type: application/octet-stream\r\n\r\n" +
      std::string(1000, 'x');
  ASSERT_EQ(write(fd, head.data(), head.size()), static_cast<ssize_t>(head.size()));
  auto regions_now = [&] { return a_->Client().Get("/v1/regions")->body; };
  auto wait_for = [](auto done) {
    for (int i = 0; i < 200 && !done(); ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    return done();
  };
  EXPECT_TRUE(wait_for([&] { return regions_now() != regions; })) << "no buffer for the upload";
  close(fd);
  EXPECT_TRUE(wait_for([&] { return regions_now() == regions; })) << regions_now();
  EXPECT_EQ(ObjectList(*a_), objects);
}

TEST_F(FerrydTest, NonContiguousObjectIsPulledOverRdmaAndReadBackExactly) {
  ASSERT_NO_FATAL_FAILURE(StartB());
  auto ca = a_->Client();
  const std::string base = RandomBytes(4 << 20, 4);
  const uint64_t region = Upload(*a_, "base", base);
  // A non-contiguous object: 512 pieces of 1 to 8 KiB in shuffled order.
  std::mt19937_64 rng(5);
  json extents = json::array();
  std::string expect;
  for (int i = 0; i < 512; ++i) {
    uint64_t len = 1 + rng() % 8192, off = rng() % (base.size() - len);
    extents.push_back({{"region", region}, {"offset", off}, {"length", len}});
    expect += base.substr(off, len);
  }
  ASSERT_EQ(ca.Put("/v1/objects/kv%2Fpages", json{{"extents", extents}}.dump(), "application/json")
                ->status,
            201);
  auto cb = b_->Client();
  auto pull = cb.Post(
      "/v1/pulls",
      json{{"from", a_->url()}, {"object", "kv/pages"}, {"into", {{"device", "host"}}}}.dump(),
      "application/json");
  ASSERT_TRUE(pull);
  ASSERT_EQ(pull->status, 200) << pull->body;
  auto stats = json::parse(pull->body);
  EXPECT_EQ(stats["bytes"], expect.size());
  EXPECT_EQ(stats["path"], "rdma");
  EXPECT_EQ(stats["bytes_per_rail"].size(), 2u);
  EXPECT_TRUE(cb.Get("/v1/objects/kv%2Fpages/data")->body == expect);
  // Into B's own scattered extents, then read back through a layout published over them.
  auto reg = json::parse(
      cb.Post("/v1/regions", json{{"size", 2 * expect.size()}}.dump(), "application/json")->body);
  json mine = json::array();
  uint64_t left = expect.size(), pos = 0;
  while (left > 0) {
    uint64_t n = std::min<uint64_t>(left, 3000);
    mine.push_back({{"region", reg["id"]}, {"offset", 2 * pos}, {"length", n}});
    pos += n;
    left -= n;
  }
  auto into = cb.Post(
      "/v1/pulls",
      json{{"from", a_->url()}, {"object", "kv/pages"}, {"into", {{"extents", mine}}}}.dump(),
      "application/json");
  ASSERT_EQ(into->status, 200) << into->body;
  ASSERT_EQ(cb.Put("/v1/objects/check", json{{"extents", mine}}.dump(), "application/json")->status,
            201);
  EXPECT_TRUE(cb.Get("/v1/objects/check/data")->body == expect);

  // The same extents as raw triplets after the JSON (what clients send for big layouts), over
  // a fresh region; then bodies of that type that are not well formed.
  auto reg2 = json::parse(
      cb.Post("/v1/regions", json{{"size", 2 * expect.size()}}.dump(), "application/json")->body);
  std::vector<Extent> raw;
  json mine2 = json::array();
  for (const auto& e : mine) {
    raw.push_back(
        {reg2["id"].get<uint64_t>(), e["offset"].get<uint64_t>(), e["length"].get<uint64_t>()});
    mine2.push_back({{"region", reg2["id"]}, {"offset", e["offset"]}, {"length", e["length"]}});
  }
  const std::string head =
      json{{"from", a_->url()}, {"object", "kv/pages"}, {"into", json::object()}}.dump();
  auto by_raw = cb.Post("/v1/pulls", head + "\n" + RawExtents(raw), kExtentsContentType);
  ASSERT_EQ(by_raw->status, 200) << by_raw->body;
  ASSERT_EQ(
      cb.Put("/v1/objects/check2", json{{"extents", mine2}}.dump(), "application/json")->status,
      201);
  EXPECT_TRUE(cb.Get("/v1/objects/check2/data")->body == expect);
  EXPECT_HTTP_ERROR(
      cb.Post("/v1/pulls", head + "\n" + RawExtents(raw).substr(1), kExtentsContentType), 400,
      "INVALID_ARGUMENT");
  EXPECT_HTTP_ERROR(cb.Post("/v1/pulls", head, kExtentsContentType), 400, "INVALID_ARGUMENT");
}

// Buffers ferryd allocates for an object (an upload, a pull into a new buffer) go with the last
// version that uses them; regions a client made or registered stay until it deletes them.
TEST_F(FerrydTest, KeepVersionsFreesTheBuffersOfTheVersionsItDrops) {
  a_ = std::make_unique<Ferryd>(TempDir("a"), std::vector<std::string>{"--keep-versions", "2"});
  ASSERT_NO_FATAL_FAILURE(a_->Start());
  ASSERT_NO_FATAL_FAILURE(StartB());
  auto c = a_->Client();
  std::vector<uint64_t> regions;
  for (uint64_t v = 1; v <= 4; ++v) {
    auto r = c.Put("/v1/objects/w/data?replace=true", RandomBytes(4096 * v, v), kOctet);
    ASSERT_EQ(r->status, 201) << r->body;
    regions.push_back(json::parse(r->body)["extents"][0]["region"].get<uint64_t>());
  }
  EXPECT_HTTP_ERROR(c.Get("/v1/objects/w?version=2"), 404, "NOT_FOUND");
  EXPECT_TRUE(c.Get("/v1/objects/w/data?version=3")->body == RandomBytes(4096 * 3, 3));
  EXPECT_TRUE(c.Get("/v1/objects/w/data")->body == RandomBytes(4096 * 4, 4));
  std::vector<uint64_t> listed;
  const json all = json::parse(c.Get("/v1/regions")->body);
  for (const auto& r : all["regions"]) listed.push_back(r["id"]);
  EXPECT_THAT(listed, ::testing::UnorderedElementsAre(regions[2], regions[3]));
  EXPECT_EQ(json::parse(c.Get("/v1/node")->body)["spare_bytes"], 0);  // none kept by default
  // A node that keeps every version (the default) pulls them all into buffers of its own.
  auto cb = b_->Client();
  for (int i = 0; i < 3; ++i) {
    auto r =
        cb.Post("/v1/pulls", json{{"from", a_->url()}, {"object", "w"}, {"replace", true}}.dump(),
                "application/json");
    ASSERT_EQ(r->status, 200) << r->body;
  }
  EXPECT_EQ(json::parse(cb.Get("/v1/regions")->body)["regions"].size(), 3u);
  EXPECT_EQ(cb.Get("/v1/objects/w?version=1")->status, 200);
}

TEST_F(FerrydTest, SpareBuffersAreTakenByTheNextObjectOfTheirSizeAndDevice) {
  a_ = std::make_unique<Ferryd>(
      TempDir("a"), std::vector<std::string>{"--keep-versions", "1", "--spare-mb", "3"});
  ASSERT_NO_FATAL_FAILURE(a_->Start());
  auto c = a_->Client();
  auto spare = [&] { return json::parse(c.Get("/v1/node")->body)["spare_bytes"].get<uint64_t>(); };
  auto put = [&](const std::string& name, const std::string& bytes) {
    auto r = c.Put(("/v1/objects/" + name + "/data?replace=true").c_str(), bytes, kOctet);
    ASSERT_EQ(r->status, 201) << r->body;
  };
  constexpr size_t kMiB = size_t{1} << 20;
  ASSERT_NO_FATAL_FAILURE(put("w", RandomBytes(kMiB, 1)));
  EXPECT_EQ(spare(), 0u);
  ASSERT_NO_FATAL_FAILURE(put("w", RandomBytes(kMiB, 2)));  // drops version 1: a spare
  EXPECT_EQ(spare(), kMiB);
  // Version 3 takes version 1's buffer and drops version 2's: still one spare, not two.
  const std::string v3 = RandomBytes(kMiB, 3);
  ASSERT_NO_FATAL_FAILURE(put("w", v3));
  EXPECT_EQ(spare(), kMiB);
  EXPECT_TRUE(c.Get("/v1/objects/w/data")->body == v3);
  ASSERT_NO_FATAL_FAILURE(put("x", RandomBytes(2 * kMiB, 4)));  // no spare of its size
  EXPECT_EQ(spare(), kMiB);
  ASSERT_EQ(c.Delete("/v1/objects/x")->status, 200);
  EXPECT_EQ(spare(), 3 * kMiB);
  ASSERT_EQ(c.Delete("/v1/objects/w")->status, 200);  // full: the oldest spare goes
  EXPECT_EQ(spare(), 3 * kMiB);
  const std::string y = RandomBytes(2 * kMiB, 5);
  ASSERT_NO_FATAL_FAILURE(put("y", y));  // x's buffer
  EXPECT_EQ(spare(), kMiB);
  EXPECT_TRUE(c.Get("/v1/objects/y/data")->body == y);
  EXPECT_EQ(json::parse(c.Get("/v1/regions")->body)["regions"].size(), 1u);
  // A region asked for by a client is new memory, zeroed, never a spare.
  auto r =
      c.Post("/v1/regions", json{{"device", "host"}, {"size", kMiB}}.dump(), "application/json");
  ASSERT_EQ(r->status, 201) << r->body;
  EXPECT_EQ(spare(), kMiB);
}

TEST_F(FerrydTest, RegionsAllocatedForAnObjectGoWithItsLastVersion) {
  ASSERT_NO_FATAL_FAILURE(StartB());
  auto ca = a_->Client();
  auto cb = b_->Client();
  auto region_ids = [](Ferryd& node) {
    std::vector<uint64_t> ids;
    const json listed = json::parse(node.Client().Get("/v1/regions")->body);
    for (const auto& r : listed["regions"]) ids.push_back(r["id"].get<uint64_t>());
    return ids;
  };
  auto gone = [&](uint64_t id) {
    EXPECT_HTTP_ERROR(ca.Delete(("/v1/regions/" + std::to_string(id)).c_str()), 404, "NOT_FOUND");
  };
  // Two versions, two buffers: both go with the object.
  const uint64_t v1 = Upload(*a_, "w", RandomBytes(4096, 1));
  auto up2 = ca.Put("/v1/objects/w/data?replace=true", RandomBytes(8192, 2), kOctet);
  ASSERT_EQ(up2->status, 201) << up2->body;
  const uint64_t v2 = json::parse(up2->body)["extents"][0]["region"].get<uint64_t>();
  const json listed = json::parse(ca.Get("/v1/regions")->body)["regions"];
  ASSERT_EQ(listed.size(), 2u);
  EXPECT_EQ(listed[0]["for_object"], true);
  EXPECT_EQ(listed[0]["owned"], true);
  ASSERT_EQ(ca.Delete("/v1/objects/w")->status, 200);
  EXPECT_THAT(region_ids(*a_), ::testing::IsEmpty());
  gone(v1);
  gone(v2);

  // Another object over an uploaded buffer keeps it until that object goes too.
  const uint64_t base = Upload(*a_, "base", RandomBytes(1 << 20, 3));
  const json layout = {{"extents",
                        {{{"region", base}, {"offset", 100}, {"length", 1000}},
                         {{"region", base}, {"offset", 5000}, {"length", 10}}}}};
  ASSERT_EQ(ca.Put("/v1/objects/view", layout.dump(), "application/json")->status, 201);
  ASSERT_EQ(ca.Delete("/v1/objects/base")->status, 200);
  EXPECT_THAT(region_ids(*a_), ::testing::ElementsAre(base));
  EXPECT_EQ(ca.Get("/v1/objects/view/data")->body.size(), 1010u);

  // A pull into a new buffer on B: B's buffer goes with B's object.
  auto pulled =
      cb.Post("/v1/pulls",
              json{{"from", a_->url()}, {"object", "view"}, {"into", {{"device", "host"}}}}.dump(),
              "application/json");
  ASSERT_EQ(pulled->status, 200) << pulled->body;
  const uint64_t on_b = json::parse(pulled->body)["region"].get<uint64_t>();
  EXPECT_THAT(region_ids(*b_), ::testing::ElementsAre(on_b));
  ASSERT_EQ(cb.Delete("/v1/objects/view")->status, 200);
  EXPECT_THAT(region_ids(*b_), ::testing::IsEmpty());

  // A deletes an object while B pulls it: the pull either ends as it started (the buffer
  // stays until the WRITEs that read it end) or is refused, and the buffer is gone after.
  const std::string big = RandomBytes(64 << 20, 4);
  const uint64_t big_region = Upload(*a_, "big", big);
  auto into = json::parse(
      cb.Post("/v1/regions", json{{"size", big.size()}}.dump(), "application/json")->body);
  const json mine = {{{"region", into["id"]}, {"offset", 0}, {"length", big.size()}}};
  std::thread deleter([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    EXPECT_EQ(a_->Client().Delete("/v1/objects/big")->status, 200);
  });
  auto during =
      cb.Post("/v1/pulls",
              json{{"from", a_->url()}, {"object", "big"}, {"into", {{"extents", mine}}}}.dump(),
              "application/json");
  deleter.join();
  ASSERT_TRUE(during);
  if (during->status == 200) {
    ASSERT_EQ(cb.Put("/v1/objects/got", json{{"extents", mine}}.dump(), "application/json")->status,
              201);
    EXPECT_TRUE(cb.Get("/v1/objects/got/data")->body == big);
  } else {
    EXPECT_EQ(during->status, 404) << during->body;
  }
  gone(big_region);  // by the pull's end, not by a listing
  EXPECT_THAT(region_ids(*a_), ::testing::ElementsAre(base));
  ASSERT_EQ(ca.Delete("/v1/objects/view")->status, 200);
  EXPECT_THAT(region_ids(*a_), ::testing::IsEmpty());

  // A region the client made stays with no object on it, until the client deletes it.
  auto made = json::parse(
      ca.Post("/v1/regions", R"({"device":"host","size":4096})", "application/json")->body);
  EXPECT_EQ(made["for_object"], false);
  const json one = {{"extents", {{{"region", made["id"]}, {"offset", 0}, {"length", 10}}}}};
  ASSERT_EQ(ca.Put("/v1/objects/mine", one.dump(), "application/json")->status, 201);
  ASSERT_EQ(ca.Delete("/v1/objects/mine")->status, 200);
  EXPECT_THAT(region_ids(*a_), ::testing::ElementsAre(made["id"].get<uint64_t>()));
}

// The staged path (the one GPU memory takes between hosts without FI_HMEM) forced with host
// memory: chunks go through pinned-or-host rings of 4 slots x 64 KiB at both ends, so a 1 MiB
// object wraps each ring four times and every slot is given back by credit messages.
TEST_F(FerrydTest, StagedPathMovesNonContiguousObjectsThroughSmallRings) {
  const std::vector<std::string> rings = {"--staging-slots", "4", "--staging-slot-kib", "64"};
  a_ = std::make_unique<Ferryd>(TempDir("a"), rings);
  ASSERT_NO_FATAL_FAILURE(a_->Start());
  b_ = std::make_unique<Ferryd>(TempDir("b"), rings);
  ASSERT_NO_FATAL_FAILURE(b_->Start());
  auto ca = a_->Client();
  auto cb = b_->Client();
  const std::string base = RandomBytes(2 << 20, 11);
  const uint64_t region = Upload(*a_, "base", base);
  std::mt19937_64 rng(12);
  json extents = json::array();
  std::string expect;
  while (expect.size() < (1 << 20)) {
    uint64_t len = 1 + rng() % 20000, off = rng() % (base.size() - len);
    extents.push_back({{"region", region}, {"offset", off}, {"length", len}});
    expect += base.substr(off, len);
  }
  ASSERT_EQ(
      ca.Put("/v1/objects/staged", json{{"extents", extents}}.dump(), "application/json")->status,
      201);
  auto pull = [&](json into) {
    return cb.Post("/v1/pulls",
                   json{{"from", a_->url()},
                        {"object", "staged"},
                        {"into", into},
                        {"path", "staged"},
                        {"replace", true}}
                       .dump(),
                   "application/json");
  };
  for (int round = 0; round < 3; ++round) {  // rings come back to the pools and are reused
    auto r = pull({{"device", "host"}});
    ASSERT_TRUE(r);
    ASSERT_EQ(r->status, 200) << r->body;
    auto stats = json::parse(r->body);
    EXPECT_EQ(stats["path"], "staged");
    EXPECT_EQ(stats["bytes"], expect.size());
    EXPECT_TRUE(cb.Get("/v1/objects/staged/data")->body == expect) << "round " << round;
  }
  // Into B's own scattered extents.
  auto reg = json::parse(
      cb.Post("/v1/regions", json{{"size", 2 * expect.size()}}.dump(), "application/json")->body);
  json mine = json::array();
  for (uint64_t pos = 0; pos < expect.size(); pos += 777) {
    mine.push_back({{"region", reg["id"]},
                    {"offset", 2 * pos},
                    {"length", std::min<uint64_t>(777, expect.size() - pos)}});
  }
  auto into = pull({{"extents", mine}});
  ASSERT_EQ(into->status, 200) << into->body;
  ASSERT_EQ(cb.Put("/v1/objects/check", json{{"extents", mine}}.dump(), "application/json")->status,
            201);
  EXPECT_TRUE(cb.Get("/v1/objects/check/data")->body == expect);
  // Paths that cannot work are refused by the source, and nothing is published.
  EXPECT_HTTP_ERROR(
      cb.Post("/v1/pulls",
              json{{"from", a_->url()}, {"object", "staged"}, {"as", "ipc"}, {"path", "cuda_ipc"}}
                  .dump(),
              "application/json"),
      400, "INVALID_ARGUMENT");
  EXPECT_EQ(cb.Get("/v1/objects/ipc")->status, 404);
  EXPECT_HTTP_ERROR(
      cb.Post("/v1/pulls",
              json{{"from", a_->url()}, {"object", "staged"}, {"path", "teleport"}}.dump(),
              "application/json"),
      400, "INVALID_ARGUMENT");
}

TEST_F(FerrydTest, BadPullsGetTheirCodeAndTheNodesKeepServing) {
  ASSERT_NO_FATAL_FAILURE(StartB());
  auto ca = a_->Client();
  auto cb = b_->Client();
  Upload(*a_, "obj", RandomBytes(8192, 6));
  auto pull = [&](json body) { return cb.Post("/v1/pulls", body.dump(), "application/json"); };
  EXPECT_HTTP_ERROR(pull({{"from", a_->url()}, {"object", "nope"}}), 404, "NOT_FOUND");
  EXPECT_HTTP_ERROR(pull({{"from", "http://127.0.0.1:1"}, {"object", "obj"}}), 503, "UNAVAILABLE");
  EXPECT_HTTP_ERROR(pull({{"from", "ftp://x"}, {"object", "obj"}}), 400, "INVALID_ARGUMENT");
  EXPECT_HTTP_ERROR(pull({{"from", a_->url()}}), 400, "INVALID_ARGUMENT");
  EXPECT_HTTP_ERROR(
      pull({{"from", a_->url()},
            {"object", "obj"},
            {"into", {{"extents", {{{"region", 42}, {"offset", 0}, {"length", 8192}}}}}}}),
      404, "NOT_FOUND");
  auto reg = json::parse(cb.Post("/v1/regions", R"({"size":8192})", "application/json")->body);
  ASSERT_TRUE(reg.contains("id")) << reg;
  auto differ =
      pull({{"from", a_->url()},
            {"object", "obj"},
            {"into", {{"extents", {{{"region", reg["id"]}, {"offset", 0}, {"length", 100}}}}}}});
  EXPECT_HTTP_ERROR(differ, 400, "INVALID_ARGUMENT");
  EXPECT_THAT(differ->body, ::testing::HasSubstr("hold 100 bytes"));
  ASSERT_EQ(pull({{"from", a_->url()}, {"object", "obj"}})->status, 200);
  EXPECT_HTTP_ERROR(pull({{"from", a_->url()}, {"object", "obj"}}), 409, "ALREADY_EXISTS");
  // Node-to-node requests crafted by hand (POST /v1/peer, as the HTTP fallback carries them):
  // overlapping destination extents, extents outside their region or naming none, bad bytes.
  auto node_b = json::parse(cb.Get("/v1/node")->body);
  PeerAddress b_address{node_b["id"].get<std::string>(), {}, ""};
  for (auto& r : node_b["rails"]) {
    b_address.rails.push_back(HexDecode(r["address"].get<std::string>()).value());
  }
  RegionDescriptor desc{.node = b_address.node,
                        .addr = 1 << 20,
                        .length = 8192,
                        .offset_addressing = true,
                        .keys = {1, 2}};
  auto direct = [&](const Layout& layout) {
    wire::PullRequest request;
    request.object = "obj";
    request.regions = {desc};
    request.layout = layout;
    return PeerCall(*a_, wire::MessageType::kPull, wire::Encode(request), b_address);
  };
  // The error the source answered with.
  auto refusal = [](const absl::StatusOr<wire::Envelope>& answer) {
    if (!answer.ok()) return answer.status();
    if (answer->type != wire::MessageType::kError) return absl::UnknownError("not an error");
    absl::Status s;
    if (absl::Status d = wire::DecodeStatus(answer->body, &s); !d.ok()) return d;
    return s;
  };
  using ::testing::HasSubstr;
  const auto kBad = absl::StatusCode::kInvalidArgument;
  EXPECT_THAT(refusal(direct(Layout({{0, 0, 4096}, {0, 4000, 4096}}))),
              testing::StatusIs(kBad, HasSubstr("overlap")));
  EXPECT_THAT(
      refusal(direct(Layout({{0, 1, 8192}}))),
      testing::StatusIs(kBad, HasSubstr("[1, +8192) is empty or outside its region of 8192")));
  EXPECT_THAT(refusal(direct(Layout({{1, 0, 8192}}))),
              testing::StatusIs(kBad, HasSubstr("names region 1 of 1")));
  // The compact forms, checked as such: a page named twice, strided pieces that overlap, a
  // page past the window's end (the piece named).
  EXPECT_THAT(refusal(direct(Layout().AddPages(0, 0, 1024, {1, 5, 1}))),
              testing::StatusIs(kBad, HasSubstr("overlap")));
  EXPECT_THAT(refusal(direct(Layout().AddStrided(0, 0, 1024, 512, 4))),
              testing::StatusIs(kBad, HasSubstr("overlap")));
  EXPECT_THAT(
      refusal(direct(Layout().AddPages(0, 0, 4096, {0, 2}))),
      testing::StatusIs(kBad, HasSubstr("[8192, +4096) is empty or outside its region of 8192")));
  EXPECT_PEER_ERROR(PeerCall(*a_, wire::MessageType::kPull, "{", b_address),
                    absl::StatusCode::kInvalidArgument);
  auto garbage = ca.Post("/v1/peer", "not a message", wire::kMessageContentType);
  ASSERT_TRUE(garbage);
  EXPECT_EQ(garbage->status, 200);  // the answer is a message: an error
  EXPECT_EQ(wire::DecodeEnvelope(garbage->body)->type, wire::MessageType::kError);
  EXPECT_EQ(ca.Get("/v1/health")->status, 200);
  EXPECT_EQ(cb.Get("/v1/health")->status, 200);
}

TEST_F(FerrydTest, PullsFromANodeWhoseRailsNeverAnswerGet503AndTheSourceKeepsServing) {
  Upload(*a_, "obj", RandomBytes(8192, 7));
  // A destination at 127.0.0.1:1 (a raw tcp endpoint name, a sockaddr_in): nothing listens.
  sockaddr_in sin = {};
  sin.sin_family = AF_INET;
  sin.sin_port = htons(1);
  sin.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const PeerAddress nobody{
      "nobody", {std::string(reinterpret_cast<const char*>(&sin), sizeof(sin))}, ""};
  wire::PullRequest request;
  request.object = "obj";
  request.timeout_ms = 300;
  request.regions = {
      RegionDescriptor{.node = "nobody", .length = 8192, .offset_addressing = true, .keys = {1}}};
  request.layout = Layout({{0, 0, 8192}});
  const std::string body = wire::Encode(request);
  // Retried: the second try crashed the source (its first hello still queued in the provider
  // for an address that had left the AV).
  for (int i = 0; i < 3; ++i) {
    EXPECT_PEER_ERROR(PeerCall(*a_, wire::MessageType::kPull, body, nobody),
                      absl::StatusCode::kUnavailable);
  }
  std::vector<std::thread> many;
  std::atomic<int> refused{0};
  for (int i = 0; i < 12; ++i) {
    many.emplace_back([&] {
      auto a = PeerCall(*a_, wire::MessageType::kPull, body, nobody);
      absl::Status s;
      if (a.ok() && a->type == wire::MessageType::kError && wire::DecodeStatus(a->body, &s).ok() &&
          s.code() == absl::StatusCode::kUnavailable) {
        ++refused;
      }
    });
  }
  for (auto& t : many) t.join();
  EXPECT_EQ(refused, 12);
  // The source still serves real pulls.
  ASSERT_NO_FATAL_FAILURE(StartB());
  auto pulled = b_->Client().Post("/v1/pulls", json{{"from", a_->url()}, {"object", "obj"}}.dump(),
                                  "application/json");
  ASSERT_TRUE(pulled);
  EXPECT_EQ(pulled->status, 200) << pulled->body;
}

TEST_F(FerrydTest, DeeplyNestedJsonIsRefusedWithoutHarm) {
  ASSERT_NO_FATAL_FAILURE(StartB());
  auto c = a_->Client();
  const std::string deep = std::string(150000, '[') + std::string(150000, ']');
  EXPECT_HTTP_ERROR(c.Put("/v1/objects/x", R"({"extents":)" + deep + "}", "application/json"), 400,
                    "INVALID_ARGUMENT");
  const std::string deeper = std::string(200000, '[') + std::string(200000, ']');
  EXPECT_HTTP_ERROR(
      c.Post("/v1/pulls", R"({"from":")" + b_->url() + R"(","object":"x","into":)" + deeper + "}",
             "application/json"),
      400, "INVALID_ARGUMENT");
  // Brackets inside strings are only characters: refused for what the body says, not its depth.
  auto in_string =
      c.Put("/v1/objects/x", R"({"extents":[[1,0,1]],"note":")" + std::string(100, '[') + R"("})",
            "application/json");
  EXPECT_HTTP_ERROR(in_string, 404, "NOT_FOUND");  // no region 1
  EXPECT_THAT(in_string->body, ::testing::HasSubstr("no region 1"));
  EXPECT_EQ(c.Get("/v1/health")->status, 200);
}

TEST_F(FerrydTest, AfterARestartObjectsAreBackDetachedAndPullsOfThemAreRefused) {
  ASSERT_NO_FATAL_FAILURE(StartB());
  Upload(*a_, "w", RandomBytes(4096, 7));
  EXPECT_EQ(a_->Stop(), 0);  // SIGTERM: clean exit
  // Same data dir (TempDir("a") would wipe it): reuse the path directly.
  a_ = std::make_unique<Ferryd>(std::filesystem::temp_directory_path() /
                                ("ferryd-test-" + std::to_string(getpid()) + "-a"));
  ASSERT_NO_FATAL_FAILURE(a_->Start());
  auto obj = json::parse(a_->Client().Get("/v1/objects/w")->body);
  EXPECT_EQ(obj["detached"], true);
  EXPECT_EQ(obj["version"], 1);
  EXPECT_HTTP_ERROR(a_->Client().Get("/v1/objects/w/data"), 409, "FAILED_PRECONDITION");
  EXPECT_HTTP_ERROR(
      b_->Client().Post("/v1/pulls", json{{"from", a_->url()}, {"object", "w"}}.dump(),
                        "application/json"),
      409, "FAILED_PRECONDITION");
  EXPECT_TRUE(json::parse(b_->Client().Get("/v1/regions")->body)["regions"].empty())
      << "a failed pull must not leave its buffer behind";
}

TEST_F(FerrydTest, EveryAcknowledgedPublishSurvivesKillNine) {
  auto c = a_->Client();
  const uint64_t region = Upload(*a_, "base", RandomBytes(4096, 8));
  std::atomic<int> acked{0};
  std::atomic<bool> writing{true};
  std::thread writer([&] {
    auto w = a_->Client();
    for (int i = 0; i < 5000; ++i) {
      auto r = w.Put(
          ("/v1/objects/p" + std::to_string(i)).c_str(),
          json{{"extents", {{{"region", region}, {"offset", i % 4096}, {"length", 1}}}}}.dump(),
          "application/json");
      if (!r || r->status != 201) break;
      acked = i + 1;
    }
    writing = false;
  });
  // Killed once 50 are acknowledged and the writer goes on (or when it stopped, or after 60 s).
  const absl::Time give_up = absl::Now() + absl::Seconds(60);
  while (acked.load() < 50 && writing.load() && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  a_->Kill9();
  writer.join();
  const int n = acked.load();
  ASSERT_GE(n, 50) << "the publishes failed before the kill";
  a_ = std::make_unique<Ferryd>(std::filesystem::temp_directory_path() /
                                ("ferryd-test-" + std::to_string(getpid()) + "-a"));
  ASSERT_NO_FATAL_FAILURE(a_->Start());
  auto c2 = a_->Client();
  for (int i = 0; i < n; ++i) {
    auto r = c2.Get(("/v1/objects/p" + std::to_string(i)).c_str());
    ASSERT_TRUE(r && r->status == 200) << "acknowledged publish p" << i << " of " << n << " lost";
  }
}

TEST_F(FerrydTest, ThirtyTwoConcurrentPullsFromEightThreadsAllVerify) {
  ASSERT_NO_FATAL_FAILURE(StartB());
  std::vector<std::string> payloads;
  for (int i = 0; i < 32; ++i) {
    payloads.push_back(
        RandomBytes((256 << 10) + static_cast<size_t>(i) * 4099, 100 + static_cast<uint64_t>(i)));
    Upload(*a_, "o" + std::to_string(i), payloads.back());
  }
  std::atomic<int> ok{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      auto cb = b_->Client();
      for (int i = t; i < 32; i += 8) {
        auto r = cb.Post("/v1/pulls",
                         json{{"from", a_->url()}, {"object", "o" + std::to_string(i)}}.dump(),
                         "application/json");
        if (!r || r->status != 200) continue;
        auto back = cb.Get(("/v1/objects/o" + std::to_string(i) + "/data").c_str());
        if (back && back->body == payloads[static_cast<size_t>(i)]) ++ok;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(ok.load(), 32);
}

TEST(FerrydAuthTest, TokenIsRequiredOnEveryRouteButHealth) {
  auto dir = TempDir("auth");
  { std::ofstream(dir / "token") << "s3cret\n"; }
  Ferryd node(dir / "data", {"--token-file", (dir / "token").string()});
  ASSERT_NO_FATAL_FAILURE(node.Start());
  EXPECT_EQ(node.Client().Get("/v1/health")->status, 200);
  EXPECT_HTTP_ERROR(node.Client().Get("/v1/node"), 401, "UNAUTHENTICATED");
  EXPECT_HTTP_ERROR(node.Client("wrong").Get("/v1/objects"), 401, "UNAUTHENTICATED");
  EXPECT_HTTP_ERROR(node.Client().Put("/v1/objects/x/data", "abc", kOctet), 401, "UNAUTHENTICATED");
  EXPECT_EQ(node.Client("s3cret").Get("/v1/node")->status, 200);
  EXPECT_EQ(node.Client("s3cret").Put("/v1/objects/x/data", "abc", kOctet)->status, 201);

  // A refused request's body is read and dropped, so that one keep-alive connection can go on
  // with the token (httplib refusing before routing left the body to be read as the next
  // request: 400 or 414 for bodies past its 4 KiB buffer).
  auto c = node.Client();
  c.set_keep_alive(true);
  const std::string body(3 << 20, 'x');
  for (const char* path : {"/v1/objects/y/data", "/v1/objects/y", "/v1/pulls", "/v1/nothing"}) {
    SCOPED_TRACE(path);
    EXPECT_HTTP_ERROR(c.Put(path, body, kOctet), 401, "UNAUTHENTICATED");
    EXPECT_HTTP_ERROR(c.Post(path, body, kOctet), 401, "UNAUTHENTICATED");
  }
  EXPECT_HTTP_ERROR(c.Delete("/v1/objects/x", body, kOctet), 401, "UNAUTHENTICATED");
  c.set_bearer_token_auth("s3cret");
  EXPECT_EQ(c.Get("/v1/node")->status, 200);
  EXPECT_HTTP_ERROR(c.Post("/v1/nothing", body, kOctet), 404, "NOT_FOUND");
  EXPECT_EQ(c.Put("/v1/objects/y/data", body, kOctet)->status, 201);
  EXPECT_EQ(c.Get("/v1/objects/y/data")->body.size(), body.size());
  const json listed = json::parse(c.Get("/v1/objects")->body);
  std::vector<std::string> names;
  for (const auto& o : listed["objects"]) names.push_back(o["name"]);
  c.stop();  // its keep-alive connection would hold ferryd's stop for its 5 s timeout
  EXPECT_EQ(names, (std::vector<std::string>{"x", "y"}));

  // A POST with neither Content-Length nor chunked encoding has no body: answered at once
  // (httplib alone would wait for the client to close, 5 s here).
  for (const std::string auth : {"", "Authorization: Bearer s3cret\r\n"}) {
    const int fd = ConnectTo(node.url());
    ASSERT_GE(fd, 0) << strerror(errno);
    timeval tv = {2, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    const std::string req = "POST /v1/pulls HTTP/1.1\r\nHost: 127.0.0.1\r\n" + auth + "\r\n";
    ASSERT_EQ(write(fd, req.data(), req.size()), static_cast<ssize_t>(req.size()));
    char buf[512] = {};
    const ssize_t n = read(fd, buf, sizeof(buf) - 1);
    close(fd);
    ASSERT_GT(n, 0) << "no answer within 2 s";
    EXPECT_THAT(std::string(buf),
                ::testing::StartsWith(auth.empty() ? "HTTP/1.1 401" : "HTTP/1.1 400"));
  }
  node.Stop();
  std::filesystem::remove_all(dir);
}

TEST(FerrydFlagsTest, RefusesANonLoopbackAddressWithoutATokenAndBadListenValues) {
  for (const std::vector<std::string>& args : {std::vector<std::string>{"--listen", "0.0.0.0:0"},
                                               {"--listen", "nonsense"},
                                               {"--listen", "127.0.0.1:99999"},
                                               {"--token-file", "/nonexistent/token"}}) {
    std::vector<std::string> argv = {FERRYD_PATH, "--data-dir", TempDir("flags").string()};
    argv.insert(argv.end(), args.begin(), args.end());
    auto p = Subprocess::Spawn(argv);
    ASSERT_TRUE(p.ok());
    const int status = (*p)->Wait();
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 2) << args[0] << " " << args[1];
  }
  std::filesystem::remove_all(TempDir("flags"));
}

}  // namespace
}  // namespace ferry
