#include "ferry/client.h"

#include <httplib.h>

#include <algorithm>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "base/crc32c.h"
#include "base/status.h"
#include "nlohmann/json.hpp"
#include "wire/api_json.h"
#include "wire/extents.h"
#include "wire/http_status.h"

namespace ferry {
namespace {

absl::StatusOr<nlohmann::json> JsonBody(const httplib::Result& r, const std::string& what) {
  RETURN_IF_ERROR(StatusFromResult(r, what));
  auto j = ParseJson(r->body);
  if (!j.ok()) return absl::UnknownError(what + ": node sent bad JSON");
  return j;
}

}  // namespace

struct Client::Impl {
  std::string url;
  httplib::Client http;
  explicit Impl(const std::string& u, const std::string& token) : url(u), http(u) {
    http.set_keep_alive(true);
    http.set_tcp_nodelay(true);  // a request's headers and body go in separate writes
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
  if (!IsHttpUrl(url)) {
    return absl::InvalidArgumentError("node URL must look like http://host:port (or https://)");
  }
  return std::unique_ptr<Client>(new Client(std::make_unique<Impl>(url, token)));
}

absl::Status Client::Health() {
  return StatusFromResult(impl_->http.Get("/v1/health"), impl_->url);
}

absl::Status Client::Drain() {
  return StatusFromResult(impl_->http.Post("/v1/drain", "{}", "application/json"), impl_->url);
}

absl::StatusOr<ObjectInfo> Client::Put(const std::string& name, std::string_view data, bool replace,
                                       const Progress& progress, const std::string& device,
                                       const std::string& meta) {
  return Put(
      name, data.size(),
      [data](uint64_t offset, char* out, size_t n) {
        std::memcpy(out, data.data() + offset, n);
        return absl::OkStatus();
      },
      replace, progress, device, meta);
}

absl::StatusOr<ObjectInfo> Client::Put(const std::string& name, uint64_t size, const Source& source,
                                       bool replace, const Progress& progress,
                                       const std::string& device, const std::string& meta) {
  const std::string path = "/v1/objects/" + EncodeName(name) + "/data?device=" + device +
                           (replace ? "&replace=true" : "") +
                           (meta.empty() ? "" : "&meta_length=" + std::to_string(meta.size()));
  std::string piece;
  absl::Status read = absl::OkStatus();
  auto r = impl_->http.Put(
      path.c_str(), meta.size() + size,
      [&](size_t offset, size_t length, httplib::DataSink& sink) {
        if (offset < meta.size()) return sink.write(meta.data() + offset, meta.size() - offset);
        offset -= meta.size();
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
  return ObjectInfoFromJson(j);
}

absl::Status Client::Get(const std::string& name, std::ostream& out,
                         std::optional<uint64_t> version, const Progress& progress) {
  std::string path = "/v1/objects/" + EncodeName(name) + "/data";
  if (version) path += "?version=" + std::to_string(*version);
  uint64_t total = 0, done = 0;
  std::string error_body, want_crc;
  uint32_t crc = 0;
  int status = 0;
  auto r = impl_->http.Get(
      path.c_str(),
      [&](const httplib::Response& res) {
        status = res.status;
        if (res.has_header("Content-Length")) {
          total = std::stoull(res.get_header_value("Content-Length"));
        }
        want_crc = res.get_header_value("X-Ferry-CRC32C");
        return true;
      },
      [&](const char* data, size_t n) {
        if (status >= 300) {
          error_body.append(data, n);
          return true;
        }
        out.write(data, static_cast<std::streamsize>(n));
        crc = Crc32c(crc, data, n);
        done += n;
        if (progress) progress(done, total);
        return static_cast<bool>(out);
      });
  if (r && status >= 300) r->body = error_body;
  RETURN_IF_ERROR(StatusFromResult(r, impl_->url));
  if (!out) return absl::DataLossError("could not write the output");
  if (!want_crc.empty() && Crc32cHex(crc) != want_crc) {
    return absl::DataLossError(absl::StrCat(impl_->url, ": the bytes of '", name,
                                            "' came with CRC32C ", Crc32cHex(crc), ", not the ",
                                            want_crc, " the node has for them"));
  }
  return absl::OkStatus();
}

absl::StatusOr<ObjectInfo> Client::Stat(const std::string& name, std::optional<uint64_t> version,
                                        bool with_extents) {
  std::string path = "/v1/objects/" + EncodeName(name) + (with_extents ? "?" : "?extents=false&");
  if (version) path += "version=" + std::to_string(*version);
  ASSIGN_OR_RETURN(auto j, JsonBody(impl_->http.Get(path.c_str()), impl_->url));
  return ObjectInfoFromJson(j);
}

absl::StatusOr<std::vector<ObjectInfo>> Client::List(const std::string& prefix, size_t limit) {
  httplib::Params params = {{"prefix", prefix}, {"limit", std::to_string(limit)}};
  ASSIGN_OR_RETURN(auto j, JsonBody(impl_->http.Get("/v1/objects", params, {}), impl_->url));
  std::vector<ObjectInfo> out;
  if (!j.contains("objects") || !j["objects"].is_array()) {
    return absl::UnknownError(impl_->url + ": a list without \"objects\"");
  }
  for (const auto& o : j["objects"]) {
    ASSIGN_OR_RETURN(ObjectInfo info, ObjectInfoFromJson(o));
    out.push_back(std::move(info));
  }
  return out;
}

absl::Status Client::Remove(const std::string& name) {
  return StatusFromResult(impl_->http.Delete(("/v1/objects/" + EncodeName(name)).c_str()),
                          impl_->url);
}

absl::StatusOr<ObjectInfo> Client::Publish(const std::string& name, const Layout& layout,
                                           bool replace, bool durable, const std::string& meta) {
  const std::string path = "/v1/objects/" + EncodeName(name) + (replace ? "?replace=true" : "");
  nlohmann::json body = {{"extents", ToJson(layout)}, {"durable", durable}};
  if (!meta.empty()) {
    auto parsed = ParseJson(meta);
    if (!parsed.ok())
      return absl::InvalidArgumentError(absl::StrCat("meta: ", parsed.status().message()));
    body["meta"] = *std::move(parsed);
  }
  ASSIGN_OR_RETURN(
      auto j, JsonBody(impl_->http.Put(path.c_str(), body.dump(), "application/json"), impl_->url));
  return ObjectInfoFromJson(j);
}

absl::StatusOr<PullStats> Client::Pull(const PullSpec& spec) {
  ASSIGN_OR_RETURN(
      auto j,
      JsonBody(impl_->http.Post("/v1/pulls", ToJson(spec).dump(), "application/json"), impl_->url));
  return PullStatsFromJson(j);
}

absl::StatusOr<PullStats> Client::Pull(const std::string& name, const std::string& from,
                                       const std::string& as, bool replace,
                                       const std::string& device, const std::string& path) {
  PullSpec spec;
  spec.from = from;
  spec.object = name;
  spec.as = as;
  spec.replace = replace;
  ASSIGN_OR_RETURN(spec.new_buffer, Device::Parse(device));
  spec.path = path;
  return Pull(spec);
}

absl::StatusOr<DistributeResult> Client::Distribute(const DistributeSpec& spec) {
  ASSIGN_OR_RETURN(
      auto j, JsonBody(impl_->http.Post("/v1/distribute", ToJson(spec).dump(), "application/json"),
                       impl_->url));
  return DistributeResultFromJson(j);
}

absl::StatusOr<std::vector<ClusterNode>> Client::Cluster() {
  ASSIGN_OR_RETURN(auto j, JsonBody(impl_->http.Get("/v1/cluster"), impl_->url));
  std::vector<ClusterNode> out;
  try {
    for (const auto& n : j.at("nodes")) {
      ClusterNode c{.id = n.value("id", ""),
                    .url = n.value("url", ""),
                    .host = n.value("host", ""),
                    .state = n.value("state", "")};
      if (n.contains("labels")) c.labels = n["labels"].get<std::map<std::string, std::string>>();
      for (const auto& o : n.value("objects", nlohmann::json::array())) {
        c.objects.push_back(
            {o.value("name", ""), o.value("version", uint64_t{0}), o.value("size", uint64_t{0})});
      }
      out.push_back(std::move(c));
    }
  } catch (const nlohmann::json::exception& e) {
    return absl::UnknownError(
        absl::StrCat(impl_->url, ": a cluster answer of another shape: ", e.what()));
  }
  return out;
}

absl::StatusOr<std::vector<absl::StatusOr<PullStats>>> Client::PullBatch(
    const std::vector<PullSpec>& specs) {
  nlohmann::json list = nlohmann::json::array();
  for (const PullSpec& spec : specs) list.push_back(ToJson(spec));
  ASSIGN_OR_RETURN(auto j,
                   JsonBody(impl_->http.Post("/v1/pulls", nlohmann::json{{"pulls", list}}.dump(),
                                             "application/json"),
                            impl_->url));
  if (!j.contains("results") || !j["results"].is_array() || j["results"].size() != specs.size()) {
    return absl::UnknownError(impl_->url + ": a batch answer without one result per pull");
  }
  std::vector<absl::StatusOr<PullStats>> out;
  for (const auto& r : j["results"]) {
    if (r.contains("error")) {
      out.push_back(StatusFromJson(r, impl_->url));
    } else {
      out.push_back(PullStatsFromJson(r));
    }
  }
  return out;
}

}  // namespace ferry
