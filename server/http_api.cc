#include "server/http_api.h"

#include <httplib.h>
#include <netinet/tcp.h>
#include <unistd.h>

#include <algorithm>
#include <optional>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "server/api_json.h"
#include "server/http_conditions.h"
#include "wire/api_json.h"
#include "wire/extents.h"
#include "wire/http_status.h"
#include "wire/messages.h"
#include "wire/ranges.h"

namespace ferry::server {
namespace {

void WriteJson(httplib::Response& res, const nlohmann::json& body, int status = 200) {
  res.status = status;
  res.set_content(body.dump(), kJsonContentType);
}

template <typename T>
void WriteResponse(httplib::Response& res, const absl::StatusOr<T>& result, int status = 200) {
  if (!result.ok()) return WriteError(res, result.status());
  WriteJson(res, ToJson(*result), status);
}

absl::StatusOr<nlohmann::json> ParseBody(const httplib::Request& req) {
  return ParseRequestBody(req.body, req.get_header_value("Content-Type") == kExtentsContentType);
}

absl::StatusOr<std::optional<uint64_t>> VersionParam(const httplib::Request& req) {
  if (!req.has_param("version")) return std::optional<uint64_t>();
  uint64_t v;
  if (!absl::SimpleAtoi(req.get_param_value("version"), &v) || v == 0) {
    return absl::InvalidArgumentError("version must be a positive integer");
  }
  return std::optional<uint64_t>(v);
}

absl::StatusOr<bool> BoolParam(const httplib::Request& req, const char* name, bool absent = false) {
  if (!req.has_param(name)) return absent;
  const std::string v = req.get_param_value(name);
  if (v == "true" || v == "1") return true;
  if (v == "false" || v == "0") return false;
  return absl::InvalidArgumentError(absl::StrCat(name, " must be true or false"));
}

// Object routes name the object in one path segment of the raw target ("/" written %2F),
// optionally followed by "/data" or "/pull".
struct ObjectTarget {
  std::string name;
  std::string action;  // "" or "data"
};

absl::StatusOr<ObjectTarget> ParseObjectTarget(const httplib::Request& req) {
  std::string raw = req.target.substr(0, req.target.find('?'));
  constexpr std::string_view kPrefix = "/v1/objects/";
  if (raw.rfind(kPrefix, 0) != 0) return absl::NotFoundError("no such route");
  raw = raw.substr(kPrefix.size());
  ObjectTarget t;
  const size_t slash = raw.find('/');
  if (slash != std::string::npos) {
    t.action = raw.substr(slash + 1);
    raw = raw.substr(0, slash);
    if (t.action != "data") return absl::NotFoundError("no such route");
  }
  t.name = httplib::detail::decode_url(raw, false);
  return t;
}

// GET /v1/objects/{name}/data. cpp-httplib applies Range headers itself (206, 416) and asks
// the provider only for the bytes it sends; they go through one buffer per request (pinned
// for a GPU object), a piece at a time.
// The short labels of an object's meta as headers: X-Ferry-Meta-KEY for each top-level entry
// of a meta object that is a string, number or bool (KEY of letters, digits, '-' and '_'; the
// value printable, up to kMaxMetaHeaderValue). A tensor table (a list) is left out.
void SetMetaHeaders(const std::string& meta, httplib::Response& res) {
  constexpr size_t kMaxMetaHeaders = 16, kMaxMetaHeaderValue = 256;
  if (meta.empty() || meta[0] != '{') return;
  auto j = ParseJson(meta);
  if (!j.ok() || !j->is_object()) return;
  size_t n = 0;
  for (const auto& [key, v] : j->items()) {
    if (n == kMaxMetaHeaders) break;
    const auto key_char = [](char c) {
      return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_';
    };
    if (!(v.is_string() || v.is_number() || v.is_boolean()) || key.empty() || key.size() > 64 ||
        !std::all_of(key.begin(), key.end(), key_char)) {
      continue;
    }
    const std::string value = v.is_string() ? v.get<std::string>() : v.dump();
    if (value.size() > kMaxMetaHeaderValue ||
        !std::all_of(value.begin(), value.end(), [](char c) { return c >= 0x20 && c < 0x7f; })) {
      continue;
    }
    res.set_header("X-Ferry-Meta-" + key, value);
    ++n;
  }
}

// Most ranges one GET of data may ask for.
constexpr size_t kMaxRanges = 16;

void GetData(Node& node, const std::string& name, const httplib::Request& req,
             httplib::Response& res) {
  auto version = VersionParam(req);
  if (!version.ok()) return WriteError(res, version.status());
  auto obj = node.Describe(name, *version);
  if (!obj.ok()) return WriteError(res, obj.status());
  if (obj->detached) {
    return WriteError(res, Conflict("object '" + name +
                                    "' is detached: its regions are not "
                                    "registered since the node restarted"));
  }
  const std::string etag = ETagOf(node.id(), *obj);
  if (AnsweredByConditions(req, res, etag, obj->created_ms)) return;
  res.set_header("X-Ferry-Version", std::to_string(obj->version));
  if (obj->crc32c) res.set_header("X-Ferry-CRC32C", Crc32cHex(*obj->crc32c));
  SetMetaHeaders(obj->meta, res);
  const std::string type =
      obj->content_type.empty() ? "application/octet-stream" : obj->content_type;
  // httplib reads the ranges from the request it handed over (its own, not const where it
  // lives): cleared, the whole object goes.
  auto& ranges = const_cast<httplib::Request&>(req).ranges;
  // A Range with an If-Range that names another version gets the whole of this one.
  if (!ranges.empty() && !RangeApplies(req, etag, obj->created_ms)) ranges.clear();
  // httplib 0.11.4 answers 206 even for a range past the end, and serves a last byte past it
  // as asked: resolved here, it serves only what the object has.
  if (ResolveRanges(ranges, obj->size, kMaxRanges) == RangeAnswer::kUnsatisfiable) {
    ranges.clear();  // else httplib adds a Content-Range of its own
    res.set_header("Content-Range", "bytes */" + std::to_string(obj->size));
    WriteError(res, absl::OutOfRangeError("range not satisfiable"));
    res.status = 416;
    return;
  }
  if (req.method == "HEAD") {  // the headers a GET would have; no buffer, no read
    res.set_header("Content-Length", std::to_string(obj->size));
    res.set_header("Content-Type", type);
    return;
  }
  auto buffer = node.ReadBuffer(*obj);
  if (!buffer.ok()) return WriteError(res, buffer.status());
  res.set_content_provider(
      obj->size, type,
      [&node, record = *obj,
       piece = std::shared_ptr<char>(buffer->release(), buffer->get_deleter())](
          size_t offset, size_t length, httplib::DataSink& sink) {
        const uint64_t n = std::min<uint64_t>(length, PinnedStages::kBytes);
        if (!node.ReadData(record, offset, n, piece.get()).ok()) return false;
        return sink.write(piece.get(), n);
      });
}

// Where PUT /v1/objects/{name}/data puts the bytes: ?device= (default host), ?replace=.
struct UploadTarget {
  PublishOptions publish;
  Device device;
  uint64_t meta_length = 0;  // the body's first bytes are the object's meta
};

absl::StatusOr<UploadTarget> UploadTargetOf(const httplib::Request& req) {
  UploadTarget to;
  ASSIGN_OR_RETURN(to.publish.replace, BoolParam(req, "replace"));
  ASSIGN_OR_RETURN(to.publish.durable, BoolParam(req, "durable", true));
  ASSIGN_OR_RETURN(to.device,
                   Device::Parse(req.has_param("device") ? req.get_param_value("device") : "host"));
  // The bytes' type: ?content_type=, else the request's own unless it only says "bytes".
  const std::string sent = req.get_header_value("Content-Type");
  if (req.has_param("content_type")) {
    to.publish.content_type = req.get_param_value("content_type");
  } else if (!sent.empty() && sent != "application/octet-stream" &&
             sent.rfind("application/x-www-form-urlencoded", 0) != 0) {
    to.publish.content_type = sent;
  }
  if (req.has_param("meta_length") &&
      (!absl::SimpleAtoi(req.get_param_value("meta_length"), &to.meta_length) ||
       to.meta_length > kMaxMeta)) {
    return absl::InvalidArgumentError(
        absl::StrCat("meta_length must be a number of bytes up to ", kMaxMeta));
  }
  return to;
}

// A PUT's or DELETE's If-Match / If-None-Match as the condition the catalog checks; If-Match
// makes a PUT a replace of the version it names.
absl::Status ApplyWriteCondition(const Node& node, const std::string& name,
                                 const httplib::Request& req, PublishOptions& publish) {
  ASSIGN_OR_RETURN(publish.if_latest, WriteCondition(node, name, req));
  if (publish.if_latest.value_or(0) > 0) publish.replace = true;
  return absl::OkStatus();
}

// Node-to-node messages (/v1/peer) carry no token: they are sealed under the cluster key
// the nodes derive from it (wire/auth.h) and checked by the node.
bool Authorized(const HttpOptions& options, const httplib::Request& req) {
  // The status page holds no data: it asks the API with the token its user types in.
  return options.token.empty() || req.path == "/" || req.path == "/v1/health" ||
         req.path == "/v1/peer" || (options.metrics_public && req.path == "/metrics") ||
         req.get_header_value("Authorization") == "Bearer " + options.token;
}

// The route a request took, as a metric label: the path with its names and ids left out.
std::string RouteOf(const std::string& path) {
  static constexpr std::string_view kFixed[] = {
      "/v1/health", "/v1/node",  "/v1/regions", "/v1/objects",    "/v1/pulls", "/v1/destinations",
      "/v1/peer",   "/v1/drain", "/v1/cluster", "/v1/distribute", "/metrics"};
  for (std::string_view r : kFixed) {
    if (path == r) return std::string(r);
  }
  for (const char* prefix : {"/v1/regions/", "/v1/destinations/"}) {
    if (absl::StartsWith(path, prefix)) return absl::StrCat(prefix, "{id}");
  }
  if (absl::StartsWith(path, "/v3/")) return "/v3/{directory}";
  if (absl::StartsWith(path, "/v1/objects/")) {
    for (const char* action : {"/data", "/pull"}) {
      if (absl::EndsWith(path, action)) return absl::StrCat("/v1/objects/{name}", action);
    }
    return "/v1/objects/{name}";
  }
  return "other";
}

absl::Status Unauthenticated() {
  return absl::UnauthenticatedError("missing or wrong bearer token");
}

// Whether a body follows the headers. Without Content-Length or chunked encoding a request
// has none (RFC 9112, 6.3), where httplib would read until the client closes.
bool HasBody(const httplib::Request& req) {
  return absl::EqualsIgnoreCase(req.get_header_value("Transfer-Encoding"), "chunked") ||
         req.has_header("Content-Length");
}

// Reads the rest of the body and drops it.
void DropBody(const httplib::Request& req, const httplib::ContentReader& read) {
  if (!HasBody(req)) return;
  if (req.is_multipart_form_data()) {
    read([](const httplib::MultipartFormData&) { return true; },
         [](const char*, size_t) { return true; });
  } else {
    read([](const char*, size_t) { return true; });
  }
}

// Every route of a method that may carry a body (POST, PUT, DELETE) is registered through
// this: httplib hands such a route the body unread, and a request without the token has it
// read to its end and dropped before the 401, so that the connection stays usable (httplib
// refusing it before routing would leave the body to be read as the next request).
httplib::Server::HandlerWithContentReader Guarded(const HttpOptions& options,
                                                  httplib::Server::HandlerWithContentReader h) {
  return [options, h = std::move(h)](const httplib::Request& req, httplib::Response& res,
                                     const httplib::ContentReader& read) {
    if (!Authorized(options, req)) {
      DropBody(req, read);
      return WriteError(res, Unauthenticated());
    }
    h(req, res, read);
  };
}

// A handler that takes its request with the body read whole, as httplib would have read it.
httplib::Server::HandlerWithContentReader Whole(httplib::Server::Handler h) {
  return [h = std::move(h)](const httplib::Request& req, httplib::Response& res,
                            const httplib::ContentReader& read) {
    if (req.is_multipart_form_data()) {
      DropBody(req, read);
      return WriteError(res,
                        absl::InvalidArgumentError(
                            "multipart/form-data is not taken here: send the bytes as they are"));
    }
    httplib::Request whole = req;
    if (HasBody(req) && !read([&whole](const char* data, size_t n) {
          whole.body.append(data, n);
          return true;
        })) {
      return WriteError(res, res.status == 413
                                 ? TooLarge("request body over the limit")
                                 : absl::InvalidArgumentError("the body ended early"));
    }
    h(whole, res);
  };
}

// PUT /v1/objects/{name}/data with a Content-Length: the bytes go into the object's new
// buffer as they arrive, never whole in memory besides. The body is read to its end even when
// the request is refused, so that the connection stays usable.
void PutDataAsItArrives(Node& node, const std::string& name, const httplib::Request& req,
                        httplib::Response& res, const httplib::ContentReader& read,
                        size_t max_body) {
  absl::StatusOr<UploadTarget> to = UploadTargetOf(req);
  absl::Status s = to.status();
  if (s.ok()) s = ApplyWriteCondition(node, name, req, to->publish);
  uint64_t length = 0;
  if (s.ok() && !absl::SimpleAtoi(req.get_header_value("Content-Length"), &length)) {
    s = absl::InvalidArgumentError("Content-Length must be a number of bytes");
  } else if (s.ok() && length > max_body) {
    s = TooLarge("request body over the limit");
  } else if (s.ok() && to->meta_length > length) {
    s = absl::InvalidArgumentError("meta_length is more than the body");
  }
  std::unique_ptr<Node::Upload> upload;
  auto begin = [&] {
    auto begun = node.BeginUpload(name, length - to->meta_length, to->device, to->publish);
    if (begun.ok()) upload = std::move(*begun);
    s = begun.status();
  };
  if (s.ok() && to->meta_length == 0) begin();
  const bool read_all = read([&](const char* data, size_t n) {
    if (!s.ok()) return true;  // after an error the rest is read and dropped
    std::string& meta = to->publish.meta;
    if (meta.size() < to->meta_length) {
      const size_t take = std::min<uint64_t>(n, to->meta_length - meta.size());
      meta.append(data, take);
      data += take;
      n -= take;
      if (meta.size() == to->meta_length) begin();
      if (!s.ok() || n == 0) return true;
    }
    s = upload->Append(data, n);
    return true;
  });
  if (s.ok() && !read_all) s = absl::InvalidArgumentError("the body ended early");
  if (!s.ok()) return WriteError(res, s);
  absl::StatusOr<ObjectInfo> put = upload->Finish();
  if (put.ok()) node.metrics().upload_bytes.Add({"streamed"}, static_cast<double>(put->size));
  WriteResponse(res, std::move(put), 201);
}

void ObjectRoute(Node& node, const httplib::Request& req, httplib::Response& res) {
  auto target = ParseObjectTarget(req);
  if (!target.ok()) return WriteError(res, target.status());
  const std::string& name = target->name;
  if (absl::Status s = metadata::ValidateObjectName(name); !s.ok()) return WriteError(res, s);
  const std::string& m = req.method;
  if (target->action.empty()) {
    if (m == "GET" || m == "HEAD") {
      auto version = VersionParam(req);
      if (!version.ok()) return WriteError(res, version.status());
      auto extents = BoolParam(req, "extents", true);
      if (!extents.ok()) return WriteError(res, extents.status());
      auto view = node.Describe(name, *version, *extents);
      if (!view.ok()) return WriteError(res, view.status());
      if (AnsweredByConditions(req, res, ETagOf(node.id(), *view), view->created_ms)) return;
      return WriteJson(res, ToJson(*view, *extents));
    }
    if (m == "DELETE") {
      auto if_latest = WriteCondition(node, name, req);
      absl::Status s = if_latest.ok() ? node.Delete(name, *if_latest) : if_latest.status();
      if (!s.ok()) return WriteError(res, s);
      return WriteJson(res, {{"deleted", name}});
    }
    if (m == "PUT") {
      auto body = ParseBody(req);
      if (!body.ok()) return WriteError(res, body.status());
      absl::StatusOr<Layout> layout = absl::UnknownError("");
      if (body->contains("extents_raw")) {
        auto raw = UnpackRawExtents((*body)["extents_raw"].get<std::string>());
        layout = raw.ok() ? absl::StatusOr<Layout>(Layout(*raw)) : raw.status();
      } else {
        layout =
            LayoutFromJson(body->value("extents", nlohmann::json()), node.options().max_extents);
      }
      if (!layout.ok()) return WriteError(res, layout.status());
      auto to = UploadTargetOf(req);
      if (!to.ok()) return WriteError(res, to.status());
      if (body->contains("durable")) {
        if (!(*body)["durable"].is_boolean()) {
          return WriteError(res, absl::InvalidArgumentError("\"durable\" must be true or false"));
        }
        to->publish.durable = (*body)["durable"].get<bool>();
      }
      if (body->contains("meta")) to->publish.meta = (*body)["meta"].dump();
      if (body->contains("content_type")) {
        if (!(*body)["content_type"].is_string()) {
          return WriteError(res, absl::InvalidArgumentError("\"content_type\" must be a string"));
        }
        to->publish.content_type = (*body)["content_type"].get<std::string>();
      }
      if (absl::Status s = ApplyWriteCondition(node, name, req, to->publish); !s.ok()) {
        return WriteError(res, s);
      }
      auto published = node.Publish(name, *layout, to->publish);
      if (!published.ok()) return WriteError(res, published.status());
      return WriteJson(res, ToJson(*published), 201);
    }
  } else if (target->action == "data") {
    if (m == "GET" || m == "HEAD") return GetData(node, name, req, res);
    if (m == "PUT") {
      auto to = UploadTargetOf(req);
      if (!to.ok()) return WriteError(res, to.status());
      if (absl::Status s = ApplyWriteCondition(node, name, req, to->publish); !s.ok()) {
        return WriteError(res, s);
      }
      if (to->meta_length > req.body.size()) {
        return WriteError(res, absl::InvalidArgumentError("meta_length is more than the body"));
      }
      to->publish.meta = req.body.substr(0, to->meta_length);
      auto put = node.PutData(name, std::string_view(req.body).substr(to->meta_length), to->device,
                              to->publish);
      if (!put.ok()) return WriteError(res, put.status());
      node.metrics().upload_bytes.Add({"buffered"}, static_cast<double>(put->size));
      return WriteJson(res, ToJson(*put), 201);
    }
  }
  WriteError(res, absl::UnimplementedError(absl::StrCat(m, " is not allowed here")));
  res.status = 405;
}

// POST /v1/pulls: one pull (an object) answers with its stats; a list of pulls ({"pulls": [..]}
// or an array) goes in one batch and answers {"results": [...]}, each a stats object or an
// {"error": ...} of its own.
void PullsRoute(Node& node, const httplib::Request& req, httplib::Response& res) {
  auto body = ParseBody(req);
  const size_t max = node.options().max_extents;
  if (!body.ok()) return WriteError(res, body.status());
  auto spec_of = [&](nlohmann::json item) {
    if (item.is_object() && body->contains("extents_raw") && item.contains("into") &&
        item["into"].is_object()) {
      item["into"]["extents_raw"] = (*body)["extents_raw"];
    }
    return PullSpecFromJson(item, max);
  };
  if (body->contains("pulls")) {
    const nlohmann::json& list = (*body)["pulls"];
    if (!list.is_array() || list.empty() || list.size() > 1024) {
      return WriteError(res, absl::InvalidArgumentError("\"pulls\" must hold 1 to 1024 pulls"));
    }
    std::vector<PullSpec> specs;
    std::vector<absl::Status> refused(list.size());
    std::vector<size_t> index;
    for (size_t i = 0; i < list.size(); ++i) {
      auto spec = PullSpecFromJson(list[i], max);
      if (!spec.ok()) {
        refused[i] = spec.status();
        continue;
      }
      index.push_back(i);
      specs.push_back(*std::move(spec));
    }
    auto results = node.PullBatch(specs);
    nlohmann::json out = nlohmann::json::array();
    for (size_t i = 0, k = 0; i < list.size(); ++i) {
      if (!refused[i].ok()) {
        out.push_back(ErrorBody(refused[i]));
      } else {
        const auto& r = results[k++];
        out.push_back(r.ok() ? ToJson(*r) : ErrorBody(r.status()));
      }
    }
    return WriteJson(res, {{"results", out}});
  }
  auto spec = spec_of(*body);
  if (!spec.ok()) return WriteError(res, spec.status());
  auto stats = node.Pull(*spec);
  if (!stats.ok()) return WriteError(res, stats.status());
  WriteJson(res, ToJson(*stats));
}

// Requests one kept connection may carry before the node closes it.
constexpr size_t kKeepAliveRequests = 100000;
// Retry-After of a draining node's 503s, seconds.
constexpr int kDrainRetryAfterSeconds = 5;

}  // namespace

void StopOnceRunning(httplib::Server& server) {
  for (int i = 0; i < 100000 && !server.is_running(); ++i) usleep(100);
  server.stop();
}

void SetSocketOptions(httplib::Server& server) {
  server.set_socket_options([](socket_t sock) {
    int on = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &on, sizeof on);
    setsockopt(sock, IPPROTO_TCP, TCP_NODELAY, &on, sizeof on);
  });
}

void InstallRoutes(HttpServer& server, Node& node, const HttpOptions& options) {
  server.on_slow_close = [&node](const char* why) { node.metrics().http_slow_closed.Add({why}); };
  server.set_payload_max_length(options.max_body);
  // httplib's stop() waits for idle keep-alive connections to time out: a short idle timeout
  // bounds how long a node takes to stop while clients and peers hold connections to it.
  server.set_keep_alive_timeout(1);
  // httplib closes a kept connection after a few requests by default: each client and peer
  // would connect again every few requests.
  server.set_keep_alive_max_count(kKeepAliveRequests);
  SetSocketOptions(server);
  // Requests of the methods with bodies are checked by their routes (Guarded).
  server.set_pre_routing_handler([options](const httplib::Request& req, httplib::Response& res) {
    // Content-Length given twice with different values: where the body ends is unknown, so
    // the request is refused and the connection closed (RFC 9112, 6.3).
    const size_t lengths = req.get_header_value_count("Content-Length");
    for (size_t i = 1; i < lengths; ++i) {
      if (req.get_header_value("Content-Length", i) != req.get_header_value("Content-Length")) {
        WriteError(res, absl::InvalidArgumentError("Content-Length headers that differ"));
        res.set_header("Connection", "close");
        return httplib::Server::HandlerResponse::Handled;
      }
    }
    const std::string& m = req.method;
    if (Authorized(options, req) || m == "POST" || m == "PUT" || m == "DELETE") {
      return httplib::Server::HandlerResponse::Unhandled;
    }
    WriteError(res, Unauthenticated());
    return httplib::Server::HandlerResponse::Handled;
  });
  // Answers httplib produces itself (413 for a body over the limit, 404 for no route) get
  // the error shape too.
  server.set_error_handler([&node](const httplib::Request&, httplib::Response& res) {
    // A draining node's refusals say when to try again (elsewhere, or a replacement here).
    if (res.status == 503 && node.draining()) {
      res.set_header("Retry-After", absl::StrCat(kDrainRetryAfterSeconds));
    }
    if (!res.body.empty()) return;
    const absl::Status s = res.status == 413   ? TooLarge("request body over the limit")
                           : res.status == 404 ? absl::NotFoundError("no such route")
                                               : absl::Status(absl::StatusCode::kUnknown,
                                                              absl::StrCat("HTTP ", res.status));
    res.set_content(ErrorBody(s).dump(), kJsonContentType);
  });
  server.set_exception_handler(
      [](const httplib::Request&, httplib::Response& res, std::exception_ptr) {
        WriteError(res, absl::InternalError("unexpected exception"));
      });

  server.set_logger([&node](const httplib::Request& req, const httplib::Response& res) {
    node.metrics().http_requests.Add({RouteOf(req.path), absl::StrCat(res.status)});
  });
  server.Get("/metrics", [&node](const httplib::Request&, httplib::Response& res) {
    res.set_content(node.Metrics(), "text/plain; version=0.0.4; charset=utf-8");
  });
  server.Get("/v1/pulls", [&node](const httplib::Request&, httplib::Response& res) {
    auto list = [](const std::vector<PullLog::Entry>& entries) {
      nlohmann::json out = nlohmann::json::array();
      for (const PullLog::Entry& e : entries) {
        nlohmann::json j = {{"id", e.id},
                            {"role", e.role},
                            {"object", e.object},
                            {"peer", e.peer},
                            {"path", e.path},
                            {"bytes", e.bytes},
                            {"started_ms", e.started_ms},
                            {"seconds", e.seconds}};
        if (!e.outcome.empty()) j["outcome"] = e.outcome;
        if (!e.error.empty()) j["error"] = e.error;
        out.push_back(std::move(j));
      }
      return out;
    };
    WriteJson(res, {{"running", list(node.metrics().log.Running())},
                    {"recent", list(node.metrics().log.Recent())}});
  });
  server.Get("/", [](const httplib::Request&, httplib::Response& res) {
    res.set_content(StatusPage(), "text/html; charset=utf-8");
  });
  server.Get("/v1/health", [&node](const httplib::Request&, httplib::Response& res) {
    if (node.draining()) return WriteJson(res, {{"status", "draining"}}, 503);
    WriteJson(res, {{"status", "ok"}});
  });
  server.Post("/v1/drain", Guarded(options, [&node, on_drain = options.on_drain](
                                                const httplib::Request& req, httplib::Response& res,
                                                const httplib::ContentReader& read) {
                DropBody(req, read);
                node.Drain();
                if (on_drain) on_drain();
                WriteJson(res, {{"status", "draining"}}, 202);
              }));
  server.Get("/v1/node", [&node](const httplib::Request&, httplib::Response& res) {
    nlohmann::json info = ToJson(node.Info());
    if (!node.directory_url().empty()) {
      info["directory"] = {{"url", node.directory_url()}, {"state", node.directory_state()}};
    }
    WriteJson(res, info);
  });
  server.Get("/v1/cluster", [&node](const httplib::Request&, httplib::Response& res) {
    auto nodes = node.Cluster();
    if (!nodes.ok()) return WriteError(res, nodes.status());
    nlohmann::json list = nlohmann::json::array();
    for (cluster::NodeEntry& n : *nodes) {
      nlohmann::json objects = nlohmann::json::array();
      for (const cluster::Holder& h : n.holds) {
        objects.push_back({{"name", h.name}, {"version", h.version}, {"size", h.size}});
      }
      n.record["objects"] = std::move(objects);
      list.push_back(std::move(n.record));
    }
    WriteJson(res, {{"directory", node.directory_url()},
                    {"state", node.directory_state()},
                    {"nodes", std::move(list)}});
  });
  server.Post(
      "/v1/regions",
      Guarded(options, Whole([&node](const httplib::Request& req, httplib::Response& res) {
                auto body = ParseBody(req);
                if (!body.ok()) return WriteError(res, body.status());
                if (body->contains("device") && !(*body)["device"].is_string()) {
                  return WriteError(res, absl::InvalidArgumentError("\"device\" must be a string"));
                }
                const std::string device = body->value("device", std::string("host"));
                auto size = body->find("size");
                if (size == body->end() || !size->is_number_unsigned()) {
                  return WriteError(
                      res, absl::InvalidArgumentError("\"size\" must be an unsigned integer"));
                }
                auto dev = Device::Parse(device);
                if (!dev.ok()) return WriteError(res, dev.status());
                WriteResponse(res, node.AllocateRegion(*dev, size->get<uint64_t>()), 201);
              })));
  server.Get("/v1/regions", [&node](const httplib::Request&, httplib::Response& res) {
    nlohmann::json out = nlohmann::json::array();
    for (const RegionInfo& r : node.Regions()) out.push_back(ToJson(r));
    WriteJson(res, {{"regions", out}});
  });
  server.Delete(
      R"(/v1/regions/(\d+))",
      Guarded(options, Whole([&node](const httplib::Request& req, httplib::Response& res) {
                uint64_t id;
                if (!absl::SimpleAtoi(req.matches[1].str(), &id)) {
                  return WriteError(res, absl::InvalidArgumentError("bad region id"));
                }
                absl::Status s = node.DeleteRegion(id);
                if (!s.ok()) return WriteError(res, s);
                WriteJson(res, {{"deleted", id}});
              })));
  server.Get("/v1/objects", [&node](const httplib::Request& req, httplib::Response& res) {
    size_t limit = 100;
    if (req.has_param("limit") &&
        (!absl::SimpleAtoi(req.get_param_value("limit"), &limit) || limit == 0 || limit > 10000)) {
      return WriteError(res, absl::InvalidArgumentError("limit must be 1 to 10000"));
    }
    auto objects = node.List(req.get_param_value("prefix"), req.get_param_value("after"), limit);
    if (!objects.ok()) return WriteError(res, objects.status());
    nlohmann::json out = nlohmann::json::array();
    for (const ObjectInfo& o : *objects) out.push_back(ToJson(o));
    WriteJson(res, {{"objects", out}});
  });
  server.Post("/v1/pulls",
              Guarded(options, Whole([&node](const httplib::Request& req, httplib::Response& res) {
                        PullsRoute(node, req, res);
                      })));
  // One object version to many nodes in a chain (docs/cluster.md): the answer says how each
  // receiver did.
  server.Post("/v1/distribute",
              Guarded(options, Whole([&node](const httplib::Request& req, httplib::Response& res) {
                        auto body = ParseBody(req);
                        if (!body.ok()) return WriteError(res, body.status());
                        auto spec = DistributeSpecFromJson(*body);
                        if (!spec.ok()) return WriteError(res, spec.status());
                        auto result = node.Distribute(*spec);
                        if (!result.ok()) return WriteError(res, result.status());
                        WriteJson(res, ToJson(*result));
                      })));
  // Prepared destinations: POST {"extents": layout} -> {"handle": H}; DELETE /v1/destinations/H.
  server.Post("/v1/destinations",
              Guarded(options, Whole([&node](const httplib::Request& req, httplib::Response& res) {
                        auto body = ParseBody(req);
                        if (!body.ok()) return WriteError(res, body.status());
                        auto layout = LayoutFromJson(body->value("extents", nlohmann::json()),
                                                     node.options().max_extents);
                        if (!layout.ok()) return WriteError(res, layout.status());
                        auto handle = node.PrepareDestination(*layout);
                        if (!handle.ok()) return WriteError(res, handle.status());
                        WriteJson(res, {{"handle", *handle}}, 201);
                      })));
  server.Delete(
      R"(/v1/destinations/(\d+))",
      Guarded(options, Whole([&node](const httplib::Request& req, httplib::Response& res) {
                uint64_t handle;
                if (!absl::SimpleAtoi(req.matches[1].str(), &handle)) {
                  return WriteError(res, absl::InvalidArgumentError("bad handle"));
                }
                absl::Status s = node.ReleaseDestination(handle);
                if (!s.ok()) return WriteError(res, s);
                WriteJson(res, {{"released", handle}});
              })));
  // Node-to-node messages (wire/messages.h), when the fabric cannot carry them: the answer is
  // the response's body.
  server.Post("/v1/peer",
              Guarded(options, Whole([&node](const httplib::Request& req, httplib::Response& res) {
                        struct Answer {
                          absl::Mutex mu;
                          bool done ABSL_GUARDED_BY(mu) = false;
                          std::string body ABSL_GUARDED_BY(mu);
                        };
                        auto answer = std::make_shared<Answer>();
                        node.HandleMessage(req.remote_addr, req.body, [answer](std::string sealed) {
                          absl::MutexLock lock(&answer->mu);
                          if (answer->done) return;
                          answer->done = true;
                          answer->body = std::move(sealed);
                        });
                        absl::MutexLock lock(&answer->mu);
                        auto done = [&answer]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(answer->mu) {
                          return answer->done;
                        };
                        if (!answer->mu.AwaitWithTimeout(absl::Condition(&done),
                                                         node.options().max_pull_timeout)) {
                          return WriteError(res, absl::DeadlineExceededError("no answer in time"));
                        }
                        res.status = 200;
                        res.set_content(answer->body, wire::kMessageContentType);
                      })));
  auto objects = [&node](const httplib::Request& req, httplib::Response& res) {
    ObjectRoute(node, req, res);
  };
  server.Get("/v1/objects/(.+)", objects);
  // httplib hands every PUT here to this handler with the body still unread.
  server.Put("/v1/objects/(.+)",
             Guarded(options, [&node, max_body = options.max_body, whole = Whole(objects)](
                                  const httplib::Request& req, httplib::Response& res,
                                  const httplib::ContentReader& read) {
               auto target = ParseObjectTarget(req);
               if (target.ok() && target->action == "data" && !req.is_multipart_form_data() &&
                   req.has_header("Content-Length")) {
                 return PutDataAsItArrives(node, target->name, req, res, read, max_body);
               }
               whole(req, res, read);
             }));
  server.Delete("/v1/objects/(.+)", Guarded(options, Whole(objects)));
  server.Post("/v1/objects/(.+)", Guarded(options, Whole(objects)));
  if (options.directory != nullptr) {
    cluster::InstallDirectoryRoutes(server, *options.directory,
                                    [options](const httplib::Request& req, httplib::Response& res) {
                                      if (Authorized(options, req)) return true;
                                      WriteError(res, Unauthenticated());
                                      return false;
                                    });
  }
  // The rest of those methods' paths: the body dropped, then the error handler's 404 (or 401
  // without the token).
  const auto no_route = Guarded(options, [](const httplib::Request& req, httplib::Response& res,
                                            const httplib::ContentReader& read) {
    DropBody(req, read);
    res.status = 404;
  });
  server.Post(".*", no_route);
  server.Put(".*", no_route);
  server.Delete(".*", no_route);
}

}  // namespace ferry::server
