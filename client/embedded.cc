#include <httplib.h>

#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "ferry/node.h"
#include "server/http_api.h"
#include "server/node.h"
#include "wire/auth.h"

namespace ferry {
namespace {

class Future : public PullFuture {
 public:
  explicit Future(std::unique_ptr<server::PullHandle> handle) : handle_(std::move(handle)) {}
  absl::StatusOr<PullStats> Wait(absl::Time deadline) override { return handle_->Wait(deadline); }
  bool Done() override { return handle_->Done(); }
  absl::StatusOr<PullStats> Cancel() override { return handle_->Cancel(); }

 private:
  std::unique_ptr<server::PullHandle> handle_;
};

}  // namespace

struct EmbeddedNode::Impl {
  std::unique_ptr<server::Node> node;
  server::HttpServer http{server::ConnectionLimits{}};
  std::thread serving;
  std::string url;
  ~Impl() {
    server::StopOnceRunning(http);
    if (serving.joinable()) serving.join();
  }
};

EmbeddedNode::EmbeddedNode(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
EmbeddedNode::~EmbeddedNode() = default;

absl::StatusOr<std::unique_ptr<EmbeddedNode>> EmbeddedNode::Start(
    const EmbeddedNodeOptions& options) {
  const size_t colon = options.listen.rfind(':');
  int want = 0;
  if (colon == std::string::npos || !absl::SimpleAtoi(options.listen.substr(colon + 1), &want) ||
      want < 0 || want > 65535) {
    return absl::InvalidArgumentError("listen must be HOST:PORT");
  }
  server::NodeOptions no;
  no.data_dir = options.data_dir;
  no.sync = options.sync;
  no.engine.provider = options.provider;
  no.engine.domains = options.domains;
  no.engine.rails = options.rails;
  no.peer_transport = options.peer_transport;
  no.cluster_key = wire::ClusterKeyFromToken(options.token);
  auto impl = std::make_unique<Impl>();
  ASSIGN_OR_RETURN(impl->node, server::Node::Open(no));
  server::InstallRoutes(impl->http, *impl->node, {.token = options.token});
  const std::string host = options.listen.substr(0, colon);
  const int port = impl->http.Bind(host, want);
  if (port < 0) return absl::UnavailableError("cannot listen on " + options.listen);
  impl->url = absl::StrCat("http://", host, ":", port);
  impl->node->SetUrl(impl->url);
  impl->serving = std::thread([h = &impl->http] { h->listen_after_bind(); });
  return std::unique_ptr<EmbeddedNode>(new EmbeddedNode(std::move(impl)));
}

std::string EmbeddedNode::url() const { return impl_->url; }
const std::string& EmbeddedNode::id() const { return impl_->node->id(); }

absl::StatusOr<uint64_t> EmbeddedNode::Register(void* addr, uint64_t size, Device device) {
  if (addr == nullptr || size == 0) return absl::InvalidArgumentError("empty memory range");
  ASSIGN_OR_RETURN(server::RegionInfo r, impl_->node->RegisterRegion(addr, size, device));
  return r.id;
}

absl::Status EmbeddedNode::Unregister(uint64_t region) { return impl_->node->DeleteRegion(region); }

absl::StatusOr<ObjectInfo> EmbeddedNode::Publish(const std::string& name, const Layout& layout,
                                                 bool replace, bool durable,
                                                 const std::string& meta) {
  return impl_->node->Publish(name, layout, {.replace = replace, .durable = durable, .meta = meta});
}

absl::StatusOr<ObjectInfo> EmbeddedNode::Describe(const std::string& name) {
  return impl_->node->Describe(name);
}

absl::Status EmbeddedNode::Remove(const std::string& name) { return impl_->node->Delete(name); }

absl::StatusOr<uint64_t> EmbeddedNode::PrepareDestination(const Layout& layout) {
  return impl_->node->PrepareDestination(layout);
}

absl::Status EmbeddedNode::ReleaseDestination(uint64_t handle) {
  return impl_->node->ReleaseDestination(handle);
}

absl::StatusOr<PullStats> EmbeddedNode::Pull(const PullSpec& spec) {
  return impl_->node->Pull(spec);
}

absl::StatusOr<PullStats> EmbeddedNode::PullInto(const std::string& from, const std::string& name,
                                                 const Layout& into) {
  PullSpec spec;
  spec.from = from;
  spec.object = name;
  spec.into = into;
  return impl_->node->Pull(spec);
}

absl::StatusOr<std::unique_ptr<PullFuture>> EmbeddedNode::PullAsync(const PullSpec& spec) {
  ASSIGN_OR_RETURN(std::unique_ptr<server::PullHandle> handle, impl_->node->PullAsync(spec));
  return std::unique_ptr<PullFuture>(new Future(std::move(handle)));
}

std::vector<absl::StatusOr<PullStats>> EmbeddedNode::PullBatch(const std::vector<PullSpec>& specs) {
  return impl_->node->PullBatch(specs);
}

}  // namespace ferry
