// server::Node on its own: two nodes in this process whose messages go through a fake peer
// transport (both the "fabric" and the "http" one), so a test sees every message and can drop,
// refuse, change or repeat one; the bytes still move as real WRITEs over tcp rails. The fake
// stands in for faults the real transports cannot produce on demand (a message lost on its
// way, an answer that never comes).
#include "server/node.h"

#include <gmock/gmock.h>
#include <unistd.h>

#include <filesystem>
#include <numeric>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/notification.h"
#include "base/status.h"
#include "engine/fabric.h"
#include "server/http_api.h"
#include "server/http_server.h"
#include "server/work_queue.h"
#include "tests/testing/status_matchers.h"
#include "wire/auth.h"
#include "wire/messages.h"

namespace ferry::server {

// Reaches into a node for what only a test does.
class NodeTestPeer {
 public:
  // `hook` runs before each rdma transfer the node serves is submitted to its peer.
  static void BeforeSubmit(Node& node,
                           std::function<void(const PeerAddress&, engine::PeerId)> hook) {
    node.before_submit_for_testing_ = std::move(hook);
  }
  // `hook` runs after a distribution has taken its chunks' checksums.
  static void AfterChecksums(Node& node, std::function<void()> hook) {
    node.after_checksums_for_testing_ = std::move(hook);
  }
  // Runs `f` holding the node's lock on its regions (as deleting a region does).
  static void HoldLock(Node& node, const std::function<void()>& f) {
    absl::MutexLock lock(&node.mu_);
    f();
  }
  // What another pull of the node does when its transfer to `peer` found every rail down:
  // forgets the peer, and makes a fresh one for `from`.
  static absl::StatusOr<engine::PeerId> Replace(Node& node, const PeerAddress& from,
                                                engine::PeerId peer) {
    node.ForgetPeer(from.node, peer);
    return node.PeerFor(from, absl::Now() + absl::Seconds(10));
  }
};

namespace {

using ::ferry::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

// What crossed the fake network: a request (the sender's envelope) or an answer to one.
struct Crossing {
  std::string transport;  // "fabric" or "http"
  bool answer = false;
  wire::MessageType type = wire::MessageType::kError;
  uint64_t id = 0;
  std::string body;
};

// What the network does with one message.
enum class Fate {
  kDeliver,
  kDrop,    // taken and lost (the fabric said it went; no answer ever comes)
  kRefuse,  // the transport says the peer cannot be reached (kUnavailable)
  kTwice,   // delivered, then delivered again
  kSpoil,   // delivered with its last byte changed
};

// Nodes by URL, and the messages between them. Delivery is by the target's HandleMessage on a
// thread of the network's, as HTTP delivers; the answer comes back through `sent`. Thread-safe.
class FakeNetwork {
 public:
  using Rule = std::function<Fate(const Crossing&)>;

  FakeNetwork() : queue_(4) {}
  ~FakeNetwork() { queue_.Stop(); }

  // `node` answers at `url` (null: nobody does any more).
  void Attach(const std::string& url, Node* node) {
    absl::MutexLock lock(&mu_);
    nodes_[url] = node;
  }
  void SetRule(Rule rule) {
    absl::MutexLock lock(&mu_);
    rule_ = std::move(rule);
  }
  std::vector<Crossing> log() {
    absl::MutexLock lock(&mu_);
    return log_;
  }
  void ClearLog() {
    absl::MutexLock lock(&mu_);
    log_.clear();
  }
  // The types of the requests (not answers) that crossed, in order.
  std::vector<wire::MessageType> Requests() {
    std::vector<wire::MessageType> out;
    for (const Crossing& c : log()) {
      if (!c.answer) out.push_back(c.type);
    }
    return out;
  }
  void Stop() { queue_.Stop(); }

  std::unique_ptr<PeerTransport> Transport(std::string name, std::string sender);

  void Send(const std::string& transport, const std::string& sender, const PeerRef& peer,
            std::string sealed, std::function<void(absl::StatusOr<std::string>)> sent) {
    Node* target = nullptr;
    Fate fate = Fate::kDeliver;
    {
      absl::MutexLock lock(&mu_);
      auto it = nodes_.find(peer.url);
      if (it != nodes_.end()) target = it->second;
      if (target != nullptr) fate = Judge(transport, /*answer=*/false, sealed);
    }
    if (target == nullptr || fate == Fate::kRefuse) {
      return sent(absl::UnavailableError(absl::StrCat("fake: nobody at ", peer.url)));
    }
    if (fate == Fate::kDrop) return sent(std::string());
    if (fate == Fate::kSpoil) sealed.back() = static_cast<char>(sealed.back() ^ 1);
    const int copies = fate == Fate::kTwice ? 2 : 1;
    for (int i = 0; i < copies; ++i) {
      const bool queued = queue_.Run([this, target, transport, sender, sealed, sent] {
        target->HandleMessage(sender, sealed, [this, transport, sent](std::string answer) {
          Fate back;
          {
            absl::MutexLock lock(&mu_);
            back = answer.empty() ? Fate::kDeliver : Judge(transport, /*answer=*/true, answer);
          }
          if (back == Fate::kDrop) return;
          sent(std::move(answer));
        });
      });
      if (!queued && i == 0) return sent(absl::UnavailableError("fake: the network stopped"));
    }
  }

 private:
  Fate Judge(const std::string& transport, bool answer, std::string_view sealed)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    Crossing c{transport, answer};
    // Unsealed messages are their envelope; sealed ones carry a trailer the decoder refuses,
    // and the test then sees them as kError with no id.
    if (auto e = wire::DecodeEnvelope(sealed); e.ok()) {
      c.type = e->type;
      c.id = e->id;
      c.body = e->body;
    }
    log_.push_back(c);
    return rule_ ? rule_(c) : Fate::kDeliver;
  }

  absl::Mutex mu_;
  std::map<std::string, Node*> nodes_ ABSL_GUARDED_BY(mu_);
  Rule rule_ ABSL_GUARDED_BY(mu_);
  std::vector<Crossing> log_ ABSL_GUARDED_BY(mu_);
  WorkQueue queue_;
};

class FakeTransport : public PeerTransport {
 public:
  FakeTransport(FakeNetwork* net, std::string name, std::string sender)
      : net_(net), name_(std::move(name)), sender_(std::move(sender)) {}
  std::string_view name() const override { return name_; }
  void Send(const PeerRef& peer, std::string sealed, absl::Time,
            std::function<void(absl::StatusOr<std::string>)> sent) override {
    net_->Send(name_, sender_, peer, std::move(sealed), std::move(sent));
  }

 private:
  FakeNetwork* net_;
  const std::string name_;
  const std::string sender_;
};

std::unique_ptr<PeerTransport> FakeNetwork::Transport(std::string name, std::string sender) {
  return std::make_unique<FakeTransport>(this, std::move(name), std::move(sender));
}

// A node's options for these tests: its catalog under `dir`, two tcp rails on loopback.
NodeOptions LoopbackOptions(const std::filesystem::path& dir) {
  NodeOptions o;
  o.data_dir = dir.string();
  o.sync = false;
  o.engine.provider = "tcp";
  o.engine.domains = {"lo"};
  o.engine.rails = 2;
  return o;
}

constexpr char kUrlA[] = "http://a.fake:1";
constexpr char kUrlB[] = "http://b.fake:2";

// A host buffer whose byte i is the low byte of i * 7 + seed (zero with `fill` false).
std::vector<char> Pattern(size_t size, uint8_t seed, bool fill = true) {
  std::vector<char> v(size);
  if (fill) {
    for (size_t i = 0; i < size; ++i) v[i] = static_cast<char>(i * 7 + seed);
  }
  return v;
}

// The pulls `node` served with `outcome` ("ok", ...), as its metrics count them.
double SourcePulls(Node& node, const std::string& outcome) {
  double sum = 0;
  for (absl::string_view line : absl::StrSplit(node.Metrics(), '\n')) {
    if (!absl::StartsWith(line, "ferry_pulls_total{") ||
        !absl::StrContains(line, "role=\"source\"") ||
        !absl::StrContains(line, absl::StrCat("outcome=\"", outcome, "\""))) {
      continue;
    }
    double v = 0;
    if (absl::SimpleAtod(line.substr(line.rfind(' ') + 1), &v)) sum += v;
  }
  return sum;
}

class NodeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!engine::ProviderAvailable("tcp")) GTEST_SKIP() << "no libfabric tcp provider";
    dir_ = std::filesystem::temp_directory_path() / absl::StrCat("node-test-", getpid());
    std::filesystem::remove_all(dir_);
    net_ = std::make_unique<FakeNetwork>();
    ASSERT_OK_AND_ASSIGN(a_, Open("a", kUrlA));
    ASSERT_OK_AND_ASSIGN(b_, Open("b", kUrlB));
    src_ = Pattern(1 << 20, 3);
    ASSERT_OK_AND_ASSIGN(RegionInfo r,
                         a_->RegisterRegion(src_.data(), src_.size(), Device::Host()));
    src_region_ = r.id;
    dst_ = Pattern(1 << 20, 0, /*fill=*/false);
    ASSERT_OK_AND_ASSIGN(RegionInfo d,
                         b_->RegisterRegion(dst_.data(), dst_.size(), Device::Host()));
    dst_region_ = d.id;
  }
  void TearDown() override {
    if (net_) net_->Stop();  // no delivery into a node that goes
    b_.reset();
    a_.reset();
    net_.reset();
    std::filesystem::remove_all(dir_);
  }

  absl::StatusOr<std::unique_ptr<Node>> Open(const std::string& name, const std::string& url) {
    NodeOptions o = LoopbackOptions(dir_ / name);
    o.cluster_key = key_;
    o.pull_timeout = absl::Seconds(30);
    ASSIGN_OR_RETURN(std::unique_ptr<Node> node, Node::Open(o));
    node->SetTransportsForTesting(net_->Transport("fabric", name), net_->Transport("http", name));
    net_->Attach(url, node.get());
    return node;
  }

  // Publishes `name` on A: `pieces` extents of `piece` bytes of A's buffer, in reverse order.
  absl::Status PublishOnA(const std::string& name, size_t pieces, uint64_t piece) {
    Layout layout;
    for (size_t i = pieces; i-- > 0;) layout.Add({src_region_, i * piece, piece});
    return a_->Publish(name, layout, {.durable = false}).status();
  }
  PullSpec Into(const std::string& name, const Layout& into) {
    PullSpec spec;
    spec.from = kUrlA;
    spec.object = name;
    spec.into = into;
    return spec;
  }
  // Whether B's bytes [at, + n) are A's pieces of `piece` bytes in reverse order.
  bool Landed(uint64_t at, size_t pieces, uint64_t piece) {
    for (size_t k = 0; k < pieces; ++k) {
      const size_t i = pieces - 1 - k;
      if (!std::equal(src_.begin() + static_cast<long>(i * piece),
                      src_.begin() + static_cast<long>((i + 1) * piece),
                      dst_.begin() + static_cast<long>(at + k * piece))) {
        return false;
      }
    }
    return true;
  }

  std::string key_;  // the nodes' cluster key (none: unsealed)
  std::filesystem::path dir_;
  std::unique_ptr<FakeNetwork> net_;
  std::unique_ptr<Node> a_, b_;
  std::vector<char> src_, dst_;
  uint64_t src_region_ = 0, dst_region_ = 0;
};

TEST_F(NodeTest, APeerIsMetOnceAndEachPullIsOneRequestAndItsAnswer) {
  ASSERT_OK(PublishOnA("o", 4, 4096));
  for (int i = 0; i < 3; ++i) {
    ASSERT_OK_AND_ASSIGN(PullStats s, b_->Pull(Into("o", Layout({{dst_region_, 0, 16384}}))));
    EXPECT_EQ(s.bytes, 16384u);
    EXPECT_EQ(s.path, "rdma");
    EXPECT_EQ(s.via, "fabric");
  }
  EXPECT_TRUE(Landed(0, 4, 4096));
  // Into host memory on the rails, the pull asks nothing first; first contact only once.
  EXPECT_THAT(net_->Requests(), ElementsAre(wire::MessageType::kHello, wire::MessageType::kPull,
                                            wire::MessageType::kPull, wire::MessageType::kPull));
  EXPECT_EQ(SourcePulls(*a_, "ok"), 3);
}

TEST_F(NodeTest, AFabricThatCannotReachThePeerSendsThePullOverHttp) {
  ASSERT_OK(PublishOnA("o", 2, 4096));
  net_->SetRule([](const Crossing& c) {
    return c.transport == "fabric" && !c.answer ? Fate::kRefuse : Fate::kDeliver;
  });
  ASSERT_OK_AND_ASSIGN(PullStats s, b_->Pull(Into("o", Layout({{dst_region_, 0, 8192}}))));
  EXPECT_EQ(s.bytes, 8192u);
  EXPECT_TRUE(Landed(0, 2, 4096));
  std::vector<std::string> pulls;
  for (const Crossing& c : net_->log()) {
    if (c.type == wire::MessageType::kPull) pulls.push_back(c.transport);
  }
  EXPECT_THAT(pulls, ElementsAre("fabric", "http"));
}

TEST_F(NodeTest, ALostRequestIsAskedAboutThenSentAgainOverHttpAndServedOnce) {
  ASSERT_OK(PublishOnA("o", 2, 4096));
  ASSERT_OK(b_->Pull(Into("o", Layout({{dst_region_, 0, 8192}}))).status());  // met
  net_->ClearLog();
  auto dropped = std::make_shared<bool>(false);
  net_->SetRule([dropped](const Crossing& c) {
    if (c.type != wire::MessageType::kPull || *dropped) return Fate::kDeliver;
    *dropped = true;
    return Fate::kDrop;
  });
  ASSERT_OK_AND_ASSIGN(PullStats s, b_->Pull(Into("o", Layout({{dst_region_, 8192, 8192}}))));
  EXPECT_EQ(s.bytes, 8192u);
  EXPECT_TRUE(Landed(8192, 2, 4096));
  // The source did not know it, three times; then it went over HTTP.
  EXPECT_THAT(net_->Requests(), ElementsAre(wire::MessageType::kPull, wire::MessageType::kQuery,
                                            wire::MessageType::kQuery, wire::MessageType::kQuery,
                                            wire::MessageType::kPull));
  EXPECT_EQ(net_->log().back().transport, "http");
  EXPECT_EQ(SourcePulls(*a_, "ok"), 2);
}

TEST_F(NodeTest, ALostAnswerIsFetchedByTheProbeWithoutServingThePullAgain) {
  ASSERT_OK(PublishOnA("o", 2, 4096));
  // The answer to the query is the pull's own (kPullDone) too: only the first one is lost.
  auto lost = std::make_shared<bool>(false);
  net_->SetRule([lost](const Crossing& c) {
    if (!c.answer || c.type != wire::MessageType::kPullDone || *lost) return Fate::kDeliver;
    *lost = true;
    return Fate::kDrop;
  });
  ASSERT_OK_AND_ASSIGN(PullStats s, b_->Pull(Into("o", Layout({{dst_region_, 0, 8192}}))));
  EXPECT_EQ(s.bytes, 8192u);
  EXPECT_TRUE(Landed(0, 2, 4096));
  EXPECT_THAT(net_->Requests(), ElementsAre(wire::MessageType::kHello, wire::MessageType::kPull,
                                            wire::MessageType::kQuery));
  EXPECT_EQ(SourcePulls(*a_, "ok"), 1);
}

TEST_F(NodeTest, ASourceThatGoesSilentFailsThePullAsUnavailableLongBeforeItsDeadline) {
  ASSERT_OK(PublishOnA("o", 2, 4096));
  ASSERT_OK(b_->Pull(Into("o", Layout({{dst_region_, 0, 8192}}))).status());  // met
  net_->SetRule([](const Crossing& c) { return c.answer ? Fate::kDrop : Fate::kDeliver; });
  PullSpec spec = Into("o", Layout({{dst_region_, 0, 8192}}));
  spec.timeout_ms = 60000;
  const absl::Time start = absl::Now();
  EXPECT_THAT(b_->Pull(spec),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("stopped answering")));
  // The first probe after 250 ms, unanswered for 5 s (the fabric's second, then HTTP).
  EXPECT_LT(absl::Now() - start, absl::Seconds(15));
  // The session went with it: the next pull meets the peer again.
  net_->SetRule(nullptr);
  net_->ClearLog();
  ASSERT_OK(b_->Pull(Into("o", Layout({{dst_region_, 0, 8192}}))).status());
  EXPECT_EQ(net_->Requests().front(), wire::MessageType::kHello);
}

TEST_F(NodeTest, APreparedDestinationIsDefinedOnceAndAgainWhenTheSourceForgotIt) {
  ASSERT_OK(PublishOnA("kv", 8, 4096));
  std::vector<uint32_t> slots(8);
  std::iota(slots.begin(), slots.end(), 0);
  Layout pool;
  pool.AddPages(dst_region_, 0, 4096, slots);
  ASSERT_OK_AND_ASSIGN(uint64_t handle, b_->PrepareDestination(pool));
  auto pull_pages = [&](std::vector<uint32_t> source, std::vector<uint32_t> into) {
    PullSpec spec;
    spec.from = kUrlA;
    spec.object = "kv";
    spec.source_extents = std::move(source);
    spec.prepared = handle;
    spec.indices = std::move(into);
    return b_->Pull(spec);
  };
  // Which pull requests defined it (carried its descriptors).
  auto defined = [&] {
    std::vector<bool> out;
    for (const Crossing& c : net_->log()) {
      if (c.answer || c.type != wire::MessageType::kPull) continue;
      wire::PullRequest r;
      EXPECT_OK(wire::Decode(c.body, &r, 65536));
      out.push_back(r.defines_prepared);
    }
    return out;
  };
  ASSERT_OK(pull_pages({0, 1}, {6, 7}).status());
  ASSERT_OK(pull_pages({2, 3}, {4, 5}).status());
  EXPECT_THAT(defined(), ElementsAre(true, false));
  // Object extent i is A's piece 7 - i; slot j is B's bytes [4096 j, + 4096).
  EXPECT_TRUE(
      std::equal(src_.begin() + 7 * 4096, src_.begin() + 8 * 4096, dst_.begin() + 6 * 4096));
  EXPECT_TRUE(
      std::equal(src_.begin() + 4 * 4096, src_.begin() + 5 * 4096, dst_.begin() + 5 * 4096));
  // A restarts (same data dir, so the same node id; ephemeral objects gone, its caches empty):
  // the first request, without the descriptors, is refused and sent once more with them.
  net_->Attach(kUrlA, nullptr);
  a_.reset();
  ASSERT_OK_AND_ASSIGN(a_, Open("a", kUrlA));
  net_->ClearLog();
  ASSERT_OK_AND_ASSIGN(RegionInfo r, a_->RegisterRegion(src_.data(), src_.size(), Device::Host()));
  src_region_ = r.id;
  ASSERT_OK(PublishOnA("kv", 8, 4096));
  std::fill(dst_.begin(), dst_.end(), 0);
  ASSERT_OK(pull_pages({4}, {0}).status());
  EXPECT_THAT(defined(), ElementsAre(false, true));
  std::vector<wire::MessageType> answers;
  for (const Crossing& c : net_->log()) {
    if (c.answer) answers.push_back(c.type);
  }
  EXPECT_THAT(answers, ElementsAre(wire::MessageType::kError, wire::MessageType::kPullDone));
  EXPECT_TRUE(std::equal(src_.begin() + 3 * 4096, src_.begin() + 4 * 4096, dst_.begin()));
  ASSERT_OK(b_->ReleaseDestination(handle));
}

TEST_F(NodeTest, ALargeLayoutGoesOnceThenByItsNumberAndAgainWhenTheSourceForgotIt) {
  // 512 pages of 1 KiB (A's pieces in reverse order) into B's page slots k * 37 % 512.
  constexpr size_t kPages = 512;
  constexpr uint64_t kPage = 1024;
  ASSERT_OK(PublishOnA("kv", kPages, kPage));
  std::vector<uint32_t> slots(kPages);
  for (size_t k = 0; k < kPages; ++k) slots[k] = static_cast<uint32_t>(k * 37 % kPages);
  auto into = [&](uint64_t region) { return Layout().AddPages(region, 0, kPage, slots); };
  // Each pull request: its layout's number, whether it defined it, its layout's pieces.
  auto sent = [&] {
    std::vector<std::tuple<uint64_t, bool, uint64_t>> out;
    for (const Crossing& c : net_->log()) {
      if (c.answer || c.type != wire::MessageType::kPull) continue;
      wire::PullRequest r;
      EXPECT_OK(wire::Decode(c.body, &r, 65536));
      out.emplace_back(r.layout_ref, r.defines_layout, r.layout.pieces());
    }
    return out;
  };
  auto landed = [&](const std::vector<char>& dst) {
    for (size_t k = 0; k < kPages; ++k) {
      const auto from = src_.begin() + static_cast<long>((kPages - 1 - k) * kPage);
      if (!std::equal(from, from + kPage, dst.begin() + static_cast<long>(slots[k] * kPage))) {
        return false;
      }
    }
    return true;
  };
  using T = std::tuple<uint64_t, bool, uint64_t>;
  // A small layout has no number.
  ASSERT_OK(b_->Pull(Into("kv", Layout({{dst_region_, 0, kPages * kPage}}))).status());
  ASSERT_OK(b_->Pull(Into("kv", into(dst_region_))).status());
  EXPECT_TRUE(landed(dst_));
  std::fill(dst_.begin(), dst_.end(), 0);
  ASSERT_OK(b_->Pull(Into("kv", into(dst_region_))).status());
  EXPECT_TRUE(landed(dst_));
  // The same page table over another region is the same layout over that pull's windows.
  std::vector<char> other = Pattern(1 << 20, 0, /*fill=*/false);
  ASSERT_OK_AND_ASSIGN(RegionInfo o,
                       b_->RegisterRegion(other.data(), other.size(), Device::Host()));
  ASSERT_OK(b_->Pull(Into("kv", into(o.id))).status());
  EXPECT_TRUE(landed(other));
  EXPECT_THAT(sent(),
              ElementsAre(T{0, false, 1}, T{1, true, kPages}, T{1, false, 0}, T{1, false, 0}));
  // A restarts (same node id, its caches empty): the number alone is refused, and the
  // layout goes again with it, once.
  net_->Attach(kUrlA, nullptr);
  a_.reset();
  ASSERT_OK_AND_ASSIGN(a_, Open("a", kUrlA));
  ASSERT_OK_AND_ASSIGN(RegionInfo r, a_->RegisterRegion(src_.data(), src_.size(), Device::Host()));
  src_region_ = r.id;
  ASSERT_OK(PublishOnA("kv", kPages, kPage));
  net_->ClearLog();
  std::fill(dst_.begin(), dst_.end(), 0);
  ASSERT_OK(b_->Pull(Into("kv", into(dst_region_))).status());
  EXPECT_TRUE(landed(dst_));
  EXPECT_THAT(sent(), ElementsAre(T{1, false, 0}, T{1, true, kPages}));
  ASSERT_OK(b_->Pull(Into("kv", into(dst_region_))).status());
  EXPECT_THAT(sent().back(), T(1, false, 0));
}

// Both nodes seal their messages under one cluster key.
TEST_F(NodeTest, APeerReplacedBetweenItsLookupAndTheSubmissionTakesTheTransferInstead) {
  ASSERT_OK(PublishOnA("o", 2, 4096));
  ASSERT_OK(b_->Pull(Into("o", Layout({{dst_region_, 0, 8192}}))).status());
  auto fresh = std::make_shared<absl::StatusOr<engine::PeerId>>(absl::UnknownError("not yet"));
  NodeTestPeer::BeforeSubmit(*a_, [this, fresh](const PeerAddress& from, engine::PeerId peer) {
    if (fresh->ok()) return;  // once
    *fresh = NodeTestPeer::Replace(*a_, from, peer);
  });
  ASSERT_OK_AND_ASSIGN(PullStats s, b_->Pull(Into("o", Layout({{dst_region_, 8192, 8192}}))));
  NodeTestPeer::BeforeSubmit(*a_, nullptr);
  ASSERT_OK(fresh->status());
  EXPECT_EQ(s.bytes, 8192u);
  EXPECT_TRUE(Landed(8192, 2, 4096));
}

// Nodes on their real transports (the fabric, and HTTP for first contact), each with its own
// HTTP server as ferryd has: what runs on their progress threads is production's.
class WiredNodeTest : public ::testing::Test {
 protected:
  struct Wired {
    std::unique_ptr<Node> node;
    HttpServer http{ConnectionLimits{}};
    std::thread serving;
    std::string url;
    ~Wired() {
      StopOnceRunning(http);
      if (serving.joinable()) serving.join();
    }
  };
  void SetUp() override {
    if (!engine::ProviderAvailable("tcp")) GTEST_SKIP() << "no libfabric tcp provider";
    dir_ = std::filesystem::temp_directory_path() / absl::StrCat("wired-node-test-", getpid());
    std::filesystem::remove_all(dir_);
    ASSERT_OK_AND_ASSIGN(a_, Open("a"));
    ASSERT_OK_AND_ASSIGN(b_, Open("b"));
  }
  void TearDown() override {
    b_.reset();
    a_.reset();
    std::filesystem::remove_all(dir_);
  }
  absl::StatusOr<std::unique_ptr<Wired>> Open(const std::string& name) {
    auto w = std::make_unique<Wired>();
    ASSIGN_OR_RETURN(w->node, Node::Open(LoopbackOptions(dir_ / name)));
    InstallRoutes(w->http, *w->node, {});
    const int port = w->http.Bind("127.0.0.1", 0);
    if (port < 0) return absl::UnavailableError("cannot listen");
    w->url = absl::StrCat("http://127.0.0.1:", port);
    w->node->SetUrl(w->url);
    w->serving = std::thread([h = &w->http] { h->listen_after_bind(); });
    return w;
  }
  std::filesystem::path dir_;
  std::unique_ptr<Wired> a_, b_;
};

TEST_F(WiredNodeTest, AProgressThreadServingAPullNeverWaitsForTheNodesLock) {
  Node& a = *a_->node;
  Node& b = *b_->node;
  std::vector<char> src = Pattern(8192, 9), dst(8192, 0);
  ASSERT_OK_AND_ASSIGN(RegionInfo sr, a.RegisterRegion(src.data(), src.size(), Device::Host()));
  ASSERT_OK_AND_ASSIGN(RegionInfo dr, b.RegisterRegion(dst.data(), dst.size(), Device::Host()));
  ASSERT_OK(a.Publish("o", Layout({{sr.id, 0, 8192}}), {.durable = false}).status());
  PullSpec spec;
  spec.from = a_->url;
  spec.object = "o";
  spec.into = Layout({{dr.id, 0, 8192}});
  // Met: the next pull is small, of an object in memory, from a peer; A serves it on the
  // progress thread that receives it.
  ASSERT_OK(b.Pull(spec).status());
  std::fill(dst.begin(), dst.end(), 0);
  std::thread holder;
  absl::Notification holding;
  bool here = false;
  NodeTestPeer::BeforeSubmit(a, [&](const PeerAddress&, engine::PeerId) {
    if (!engine::OnProgressThread() || here) return;
    here = true;
    // Another thread takes A's lock and, holding it, waits for A's progress threads (memory
    // registered and deregistered), as deleting a region does: a progress thread that waited
    // for the lock would never let it finish.
    holder = std::thread([&] {
      NodeTestPeer::HoldLock(a, [&] {
        holding.Notify();
        std::vector<char> buf(4096);
        auto r = a.engine().RegisterMemory(buf.data(), buf.size(), Device::Host());
        if (r.ok()) IgnoreError(a.engine().DeregisterMemory(*r));
      });
    });
    holding.WaitForNotification();
  });
  absl::StatusOr<PullStats> s = b.Pull(spec);
  if (holder.joinable()) holder.join();
  NodeTestPeer::BeforeSubmit(a, nullptr);
  ASSERT_OK(s.status());
  EXPECT_TRUE(here);
  EXPECT_EQ(s->bytes, 8192u);
  EXPECT_EQ(dst, src);
}

// A's object distributed to receivers B, C, D, E in a chain.
class DistributeTest : public WiredNodeTest {
 protected:
  void SetUp() override {
    WiredNodeTest::SetUp();
    if (IsSkipped() || HasFatalFailure()) return;
    for (const char* name : {"c", "d", "e"}) {
      ASSERT_OK_AND_ASSIGN(auto w, Open(name));
      more_.push_back(std::move(w));
    }
    src_ = Pattern(kSize, 21);
    ASSERT_OK_AND_ASSIGN(RegionInfo r,
                         a_->node->RegisterRegion(src_.data(), src_.size(), Device::Host()));
    // The object's pieces in another order than its buffer's.
    Layout layout;
    for (uint64_t off = kSize; off > 0; off -= kSize / 4)
      layout.Add({r.id, off - kSize / 4, kSize / 4});
    ASSERT_OK(a_->node->Publish("w", layout).status());
  }
  void TearDown() override {
    more_.clear();
    WiredNodeTest::TearDown();
  }
  std::vector<std::string> Receivers() {
    std::vector<std::string> out = {b_->url};
    for (const auto& w : more_) out.push_back(w->url);
    return out;
  }
  std::vector<Node*> ReceiverNodes() {
    std::vector<Node*> out = {b_->node.get()};
    for (const auto& w : more_) out.push_back(w->node.get());
    return out;
  }
  // The object's bytes as A has them.
  std::string Expected() {
    std::string out;
    for (uint64_t off = kSize; off > 0; off -= kSize / 4) {
      out.append(src_.data() + off - kSize / 4, kSize / 4);
    }
    return out;
  }
  // What `node` holds as "w": its bytes, or why not.
  absl::StatusOr<std::string> Held(Node& node) {
    ASSIGN_OR_RETURN(ObjectInfo info, node.Describe("w"));
    std::string out(info.size, '\0');
    RETURN_IF_ERROR(node.ReadData(info, 0, info.size, out.data()));
    return out;
  }
  static constexpr uint64_t kSize = 8 << 20;
  std::vector<std::unique_ptr<Wired>> more_;
  std::vector<char> src_;
};

TEST_F(DistributeTest, EveryReceiverGetsTheVersionByteForByteThroughTheChain) {
  DistributeSpec spec;
  spec.object = "w";
  spec.to = Receivers();
  spec.chunk_bytes = 512 << 10;
  ASSERT_OK_AND_ASSIGN(DistributeResult r, a_->node->Distribute(spec));
  EXPECT_EQ(r.version, 1u);
  EXPECT_EQ(r.size, kSize);
  EXPECT_EQ(r.chunks, 16u);
  ASSERT_EQ(r.receivers.size(), 4u);
  const std::string expected = Expected();
  for (size_t i = 0; i < r.receivers.size(); ++i) {
    SCOPED_TRACE(r.receivers[i].url);
    EXPECT_OK(r.receivers[i].status);
    EXPECT_EQ(r.receivers[i].bytes, kSize);
    EXPECT_THAT(r.receivers[i].skipped, ::testing::IsEmpty());
    Node& n = *ReceiverNodes()[i];
    ASSERT_OK_AND_ASSIGN(std::string held, Held(n));
    EXPECT_TRUE(held == expected);
    ASSERT_OK_AND_ASSIGN(ObjectInfo info, n.Describe("w"));
    EXPECT_EQ(info.version, 1u);  // the source's version, a replica of it
  }
  // Again: every receiver holds it already.
  ASSERT_OK_AND_ASSIGN(DistributeResult again, a_->node->Distribute(spec));
  for (const ReceiverResult& rr : again.receivers) {
    EXPECT_OK(rr.status);
    EXPECT_TRUE(rr.held_already);
  }
}

TEST_F(DistributeTest, AReceiverThatCannotBeReachedIsRoutedAround) {
  DistributeSpec spec;
  spec.object = "w";
  // Nothing listens at port 1: C's place in the chain is empty.
  spec.to = {b_->url, "http://127.0.0.1:1", more_[0]->url, more_[1]->url};
  spec.chunk_bytes = 1 << 20;
  ASSERT_OK_AND_ASSIGN(DistributeResult r, a_->node->Distribute(spec));
  ASSERT_EQ(r.receivers.size(), 4u);
  EXPECT_THAT(r.receivers[1].status, StatusIs(absl::StatusCode::kUnavailable));
  const std::string expected = Expected();
  for (size_t i : {size_t{0}, size_t{2}, size_t{3}}) {
    SCOPED_TRACE(r.receivers[i].url);
    EXPECT_OK(r.receivers[i].status);
  }
  // The receiver after the gap took its chunks from the one before it.
  ASSERT_EQ(r.receivers[2].skipped.size(), 1u);
  EXPECT_THAT(r.receivers[2].skipped[0], HasSubstr("127.0.0.1:1"));
  EXPECT_THAT(r.receivers[3].skipped, ::testing::IsEmpty());
  for (Node* n : {b_->node.get(), more_[0]->node.get(), more_[1]->node.get()}) {
    ASSERT_OK_AND_ASSIGN(std::string held, Held(*n));
    EXPECT_TRUE(held == expected);
  }
}

TEST_F(DistributeTest, AChunkThatDoesNotMatchItsChecksumIsNeitherServedNorKept) {
  // A's bytes change after the checksums were taken (its memory is the caller's): the first
  // receiver finds chunk 0 wrong, has nowhere else to take it from, and fails; so does every
  // receiver after it, which never gets the chunk.
  NodeTestPeer::AfterChecksums(*a_->node, [this] { src_[kSize - 1] ^= 1; });
  DistributeSpec spec;
  spec.object = "w";
  spec.to = {b_->url, more_[0]->url};
  spec.chunk_bytes = 1 << 20;
  ASSERT_OK_AND_ASSIGN(DistributeResult r, a_->node->Distribute(spec));
  NodeTestPeer::AfterChecksums(*a_->node, nullptr);
  ASSERT_EQ(r.receivers.size(), 2u);
  EXPECT_THAT(r.receivers[0].status, StatusIs(absl::StatusCode::kUnavailable, HasSubstr("CRC32C")));
  EXPECT_THAT(r.receivers[1].status, StatusIs(absl::StatusCode::kUnavailable));
  EXPECT_THAT(b_->node->Describe("w"), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(more_[0]->node->Describe("w"), StatusIs(absl::StatusCode::kNotFound));
}

TEST_F(DistributeTest, BadSpecsAreRefused) {
  DistributeSpec spec;
  spec.object = "w";
  EXPECT_THAT(a_->node->Distribute(spec), StatusIs(absl::StatusCode::kInvalidArgument));
  spec.to = {b_->url, b_->url};
  EXPECT_THAT(a_->node->Distribute(spec), StatusIs(absl::StatusCode::kInvalidArgument));
  spec.to = {a_->url};
  EXPECT_THAT(a_->node->Distribute(spec), StatusIs(absl::StatusCode::kInvalidArgument));
  spec.to = {"ftp://x"};
  EXPECT_THAT(a_->node->Distribute(spec), StatusIs(absl::StatusCode::kInvalidArgument));
  spec.to = {b_->url};
  spec.object = "nope";
  EXPECT_THAT(a_->node->Distribute(spec), StatusIs(absl::StatusCode::kNotFound));
  spec.object = "w";
  spec.labels = {{"zone", "a"}};
  EXPECT_THAT(a_->node->Distribute(spec), StatusIs(absl::StatusCode::kInvalidArgument));
  spec.to.clear();
  EXPECT_THAT(a_->node->Distribute(spec), StatusIs(absl::StatusCode::kFailedPrecondition));
}

class SealedNodeTest : public NodeTest {
 protected:
  SealedNodeTest() { key_ = "cluster key"; }
};

TEST_F(SealedNodeTest, ARequestChangedOnTheWayIsRefusedAndWritesNothing) {
  ASSERT_OK(PublishOnA("o", 2, 4096));
  ASSERT_OK(b_->Pull(Into("o", Layout({{dst_region_, 0, 8192}}))).status());
  EXPECT_TRUE(Landed(0, 2, 4096));
  // Sealed requests do not decode as envelopes: the pull is the only request after the first.
  auto requests = std::make_shared<int>(0);
  net_->SetRule([requests](const Crossing& c) {
    return !c.answer && ++*requests == 1 ? Fate::kSpoil : Fate::kDeliver;
  });
  EXPECT_THAT(b_->Pull(Into("o", Layout({{dst_region_, 65536, 8192}}))),
              StatusIs(absl::StatusCode::kUnauthenticated));
  EXPECT_TRUE(std::all_of(dst_.begin() + 65536, dst_.begin() + 65536 + 8192,
                          [](char c) { return c == 0; }));
  EXPECT_EQ(SourcePulls(*a_, "ok"), 1);
}

TEST_F(SealedNodeTest, ARequestDeliveredTwiceIsServedOnce) {
  ASSERT_OK(PublishOnA("o", 2, 4096));
  ASSERT_OK(b_->Pull(Into("o", Layout({{dst_region_, 0, 8192}}))).status());
  auto requests = std::make_shared<int>(0);
  net_->SetRule([requests](const Crossing& c) {
    return !c.answer && ++*requests == 1 ? Fate::kTwice : Fate::kDeliver;
  });
  ASSERT_OK_AND_ASSIGN(PullStats s, b_->Pull(Into("o", Layout({{dst_region_, 65536, 8192}}))));
  EXPECT_EQ(s.bytes, 8192u);
  EXPECT_TRUE(Landed(65536, 2, 4096));
  // The copy is a replay: refused without an answer, whichever of the two came first.
  EXPECT_EQ(SourcePulls(*a_, "ok"), 2);
}

}  // namespace
}  // namespace ferry::server
