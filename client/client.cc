#include "wire/extents.h"
#include "ferry/client.h"

#include <httplib.h>

#include <algorithm>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "nlohmann/json.hpp"
#include "server/http_api.h"
#include "wire/http_status.h"
#include "server/node.h"

namespace ferry {
namespace {




ObjectInfo InfoFromJson(const nlohmann::json& j) {
  ObjectInfo o{j.value("name", ""), j.value("version", uint64_t{0}), j.value("size", uint64_t{0}),
               j.value("detached", false), {}};
  if (j.contains("extents")) {
    for (const auto& e : j["extents"]) {
      o.extents.push_back({e.value("region", uint64_t{0}), e.value("offset", uint64_t{0}),
                           e.value("length", uint64_t{0})});
    }
  }
  return o;
}

nlohmann::json ExtentsJson(const std::vector<Extent>& layout) {
  nlohmann::json extents = nlohmann::json::array();
  for (const Extent& e : layout) {
    extents.push_back({{"region", e.region}, {"offset", e.offset}, {"length", e.length}});
  }
  return extents;
}

absl::StatusOr<nlohmann::json> JsonBody(const httplib::Result& r, const std::string& what) {
  RETURN_IF_ERROR(StatusFromResult(r, what));
  auto j = ParseJson(r->body);
  if (!j.ok()) return absl::UnknownError(what + ": node sent bad JSON");
  return j;
}

PullResult PullFromJson(const nlohmann::json& j) {
  PullResult p;
  p.bytes = j.value("bytes", uint64_t{0});
  p.seconds = j.value("seconds", 0.0);
  p.path = j.value("path", std::string());
  if (j.contains("bytes_per_rail")) p.bytes_per_rail = j["bytes_per_rail"].get<std::vector<uint64_t>>();
  return p;
}

}  // namespace

struct Client::Impl {
  std::string url;
  httplib::Client http;
  explicit Impl(const std::string& u, const std::string& token) : url(u), http(u) {
    http.set_connection_timeout(5);
    http.set_read_timeout(3600);
    http.set_write_timeout(3600);
    if (!token.empty()) http.set_bearer_token_auth(token.c_str());
  }
};

Client::Client(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Client::~Client() = default;

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const std::string& url,
                                                        const std::string& token) {
  if (url.rfind("http://", 0) != 0 || url.size() <= 7) {
    return absl::InvalidArgumentError("node URL must look like http://host:port");
  }
  return std::unique_ptr<Client>(new Client(std::make_unique<Impl>(url, token)));
}

absl::Status Client::Health() {
  return StatusFromResult(impl_->http.Get("/v1/health"), impl_->url);
}

absl::StatusOr<ObjectInfo> Client::Put(const std::string& name, std::string_view data,
                                       bool replace, const Progress& progress,
                                       const std::string& device) {
  return Put(
      name, data.size(),
      [data](uint64_t offset, char* out, size_t n) {
        std::memcpy(out, data.data() + offset, n);
        return absl::OkStatus();
      },
      replace, progress, device);
}

absl::StatusOr<ObjectInfo> Client::Put(const std::string& name, uint64_t size,
                                       const Source& source, bool replace,
                                       const Progress& progress, const std::string& device) {
  const std::string path = "/v1/objects/" + EncodeName(name) + "/data?device=" + device +
                           (replace ? "&replace=true" : "");
  std::string piece;
  absl::Status read = absl::OkStatus();
  auto r = impl_->http.Put(
      path.c_str(), size,
      [&](size_t offset, size_t length, httplib::DataSink& sink) {
        const size_t n = std::min<size_t>(length, size_t{4} << 20);
        piece.resize(n);
        read = source(offset, piece.data(), n);
        if (!read.ok() || !sink.write(piece.data(), n)) return false;
        if (progress) progress(offset + n, size);
        return true;
      },
      "application/octet-stream");
  RETURN_IF_ERROR(read);
  ASSIGN_OR_RETURN(auto j, JsonBody(r, impl_->url));
  return InfoFromJson(j);
}

absl::Status Client::Get(const std::string& name, std::ostream& out,
                         std::optional<uint64_t> version, const Progress& progress) {
  std::string path = "/v1/objects/" + EncodeName(name) + "/data";
  if (version) path += "?version=" + std::to_string(*version);
  uint64_t total = 0, done = 0;
  std::string error_body;
  int status = 0;
  auto r = impl_->http.Get(
      path.c_str(),
      [&](const httplib::Response& res) {
        status = res.status;
        if (res.has_header("Content-Length")) {
          total = std::stoull(res.get_header_value("Content-Length"));
        }
        return true;
      },
      [&](const char* data, size_t n) {
        if (status >= 300) {
          error_body.append(data, n);
          return true;
        }
        out.write(data, static_cast<std::streamsize>(n));
        done += n;
        if (progress) progress(done, total);
        return static_cast<bool>(out);
      });
  if (r && status >= 300) r->body = error_body;
  RETURN_IF_ERROR(StatusFromResult(r, impl_->url));
  if (!out) return absl::DataLossError("could not write the output");
  return absl::OkStatus();
}

absl::StatusOr<ObjectInfo> Client::Stat(const std::string& name, std::optional<uint64_t> version) {
  std::string path = "/v1/objects/" + EncodeName(name);
  if (version) path += "?version=" + std::to_string(*version);
  ASSIGN_OR_RETURN(auto j, JsonBody(impl_->http.Get(path.c_str()), impl_->url));
  return InfoFromJson(j);
}

absl::StatusOr<std::vector<ObjectInfo>> Client::List(const std::string& prefix, size_t limit) {
  httplib::Params params = {{"prefix", prefix}, {"limit", std::to_string(limit)}};
  ASSIGN_OR_RETURN(auto j, JsonBody(impl_->http.Get("/v1/objects", params, {}), impl_->url));
  std::vector<ObjectInfo> out;
  for (const auto& o : j["objects"]) out.push_back(InfoFromJson(o));
  return out;
}

absl::Status Client::Remove(const std::string& name) {
  return StatusFromResult(impl_->http.Delete(("/v1/objects/" + EncodeName(name)).c_str()),
                          impl_->url);
}

absl::StatusOr<ObjectInfo> Client::Publish(const std::string& name,
                                           const std::vector<Extent>& layout, bool replace) {
  const std::string path = "/v1/objects/" + EncodeName(name) + (replace ? "?replace=true" : "");
  ASSIGN_OR_RETURN(auto j, JsonBody(impl_->http.Put(path.c_str(),
                                                    nlohmann::json{{"extents", ExtentsJson(layout)}}.dump(),
                                                    "application/json"),
                                    impl_->url));
  return InfoFromJson(j);
}

absl::StatusOr<PullResult> Client::Pull(const std::string& name, const std::string& from,
                                        const std::string& as, bool replace,
                                        const std::string& device, const std::string& path) {
  nlohmann::json body = {{"from", from}, {"object", name}, {"into", {{"device", device}}},
                         {"replace", replace}, {"path", path}};
  if (!as.empty()) body["as"] = as;
  ASSIGN_OR_RETURN(auto j, JsonBody(impl_->http.Post("/v1/pulls", body.dump(), "application/json"),
                                    impl_->url));
  return PullFromJson(j);
}

struct EmbeddedNode::Impl {
  std::unique_ptr<server::Node> node;
  httplib::Server http;
  std::thread serving;
  std::string url;
  ~Impl() {
    http.stop();
    if (serving.joinable()) serving.join();
  }
};

EmbeddedNode::EmbeddedNode(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
EmbeddedNode::~EmbeddedNode() = default;

absl::StatusOr<std::unique_ptr<EmbeddedNode>> EmbeddedNode::Start(
    const EmbeddedNodeOptions& options) {
  server::NodeOptions no;
  no.data_dir = options.data_dir;
  no.engine.provider = options.provider;
  no.engine.domains = options.domains;
  no.engine.rails = options.rails;
  no.peer_token = options.token;
  auto impl = std::make_unique<Impl>();
  ASSIGN_OR_RETURN(impl->node, server::Node::Open(no));
  server::InstallRoutes(impl->http, *impl->node, {.token = options.token});
  const size_t colon = options.listen.rfind(':');
  if (colon == std::string::npos) return absl::InvalidArgumentError("listen must be HOST:PORT");
  const std::string host = options.listen.substr(0, colon);
  const int want = std::atoi(options.listen.substr(colon + 1).c_str());
  const int port = want == 0 ? impl->http.bind_to_any_port(host.c_str())
                             : (impl->http.bind_to_port(host.c_str(), want) ? want : -1);
  if (port < 0) return absl::UnavailableError("cannot listen on " + options.listen);
  impl->url = absl::StrCat("http://", host, ":", port);
  impl->serving = std::thread([h = &impl->http] { h->listen_after_bind(); });
  return std::unique_ptr<EmbeddedNode>(new EmbeddedNode(std::move(impl)));
}

std::string EmbeddedNode::url() const { return impl_->url; }
const std::string& EmbeddedNode::id() const { return impl_->node->id(); }

absl::StatusOr<uint64_t> EmbeddedNode::Register(void* addr, uint64_t size) {
  if (addr == nullptr || size == 0) return absl::InvalidArgumentError("empty memory range");
  ASSIGN_OR_RETURN(server::RegionInfo r,
                   impl_->node->RegisterRegion(addr, size, Device::Host()));
  return r.id;
}

absl::Status EmbeddedNode::Unregister(uint64_t region) { return impl_->node->DeleteRegion(region); }

absl::StatusOr<ObjectInfo> EmbeddedNode::Publish(const std::string& name,
                                                 const std::vector<Extent>& layout,
                                                 bool replace) {
  std::vector<Extent> extents;
  for (const Extent& e : layout) extents.push_back({e.region, e.offset, e.length});
  ASSIGN_OR_RETURN(server::ObjectView v, impl_->node->Publish(name, extents, replace));
  return ObjectInfo{v.record.name, v.record.version, v.record.size, v.detached, layout};
}

absl::StatusOr<PullResult> EmbeddedNode::PullInto(const std::string& from, const std::string& name,
                                                  const std::vector<Extent>& into) {
  std::vector<Extent> extents;
  for (const Extent& e : into) extents.push_back({e.region, e.offset, e.length});
  ASSIGN_OR_RETURN(server::PullStats s,
                   impl_->node->Pull(from, name, std::nullopt,
                                     {{"extents_raw", RawExtents(extents)}}, "", false));
  return PullResult{s.bytes, s.seconds, s.path, s.bytes_per_rail};
}

}  // namespace ferry
