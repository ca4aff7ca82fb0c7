#include "cluster/directory.h"

#include <httplib.h>

#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "nlohmann/json.hpp"
#include "wire/http_status.h"

namespace ferry::cluster {
namespace {

using nlohmann::json;

std::string B64(const std::string& s) { return absl::Base64Escape(s); }

std::string Unb64(const json& j, const char* key) {
  std::string out;
  auto it = j.find(key);
  if (it != j.end() && it->is_string()) absl::Base64Unescape(it->get<std::string>(), &out);
  return out;
}

}  // namespace

int64_t GatewayInt(const json& j, const char* key) {
  auto it = j.find(key);
  if (it == j.end()) return 0;
  if (it->is_number_integer()) return it->get<int64_t>();
  int64_t v = 0;
  if (it->is_string() && absl::SimpleAtoi(it->get<std::string>(), &v)) return v;
  return 0;
}

absl::StatusOr<std::unique_ptr<Directory>> Directory::Connect(const std::string& url,
                                                              const DirectoryOptions& options) {
  std::vector<std::string> endpoints;
  if (url.rfind("etcd://", 0) == 0) {
    for (absl::string_view hp : absl::StrSplit(url.substr(7), ',', absl::SkipEmpty())) {
      endpoints.push_back(absl::StrCat("http://", std::string(hp)));
    }
  } else if (IsHttpUrl(url)) {
    std::string u = url;
    while (u.back() == '/') u.pop_back();
    endpoints.push_back(u);
  }
  if (endpoints.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a directory is etcd://host:port[,host:port...] or http(s)://host:port, not '", url, "'"));
  }
  return std::unique_ptr<Directory>(new Directory(url, std::move(endpoints), options));
}

Directory::Directory(std::string url, std::vector<std::string> endpoints,
                     const DirectoryOptions& options)
    : url_(std::move(url)),
      endpoints_(std::move(endpoints)),
      options_(options),
      etcd_(url_.rfind("etcd://", 0) == 0),
      idle_(endpoints_.size()) {}

Directory::~Directory() = default;

std::string Directory::PrefixEnd(const std::string& prefix) {
  std::string end = prefix;
  while (!end.empty()) {
    if (static_cast<unsigned char>(end.back()) < 0xff) {
      end.back() = static_cast<char>(static_cast<unsigned char>(end.back()) + 1);
      return end;
    }
    end.pop_back();
  }
  return std::string(1, '\0');  // every key
}

std::unique_ptr<httplib::Client> Directory::Take(size_t i) {
  {
    absl::MutexLock lock(&mu_);
    if (!idle_[i].empty()) {
      std::unique_ptr<httplib::Client> c = std::move(idle_[i].back());
      idle_[i].pop_back();
      return c;
    }
  }
  auto c = std::make_unique<httplib::Client>(endpoints_[i]);
  const auto us = absl::ToInt64Microseconds(options_.timeout);
  c->set_connection_timeout(us / 1000000, us % 1000000);
  c->set_read_timeout(us / 1000000, us % 1000000);
  c->set_write_timeout(us / 1000000, us % 1000000);
  c->set_keep_alive(true);
  c->set_tcp_nodelay(true);  // a request's headers and body go in separate writes
  // etcd reads an Authorization header as a token of its own auth: the bearer token is for
  // a ferryd directory only.
  if (!options_.token.empty() && !etcd_) c->set_bearer_token_auth(options_.token);
  return c;
}

void Directory::Give(size_t i, std::unique_ptr<httplib::Client> client) {
  absl::MutexLock lock(&mu_);
  if (idle_[i].size() < kIdlePerEndpoint) idle_[i].push_back(std::move(client));
}

absl::StatusOr<std::string> Directory::Call(const std::string& path, const std::string& body) {
  size_t first;
  {
    absl::MutexLock lock(&mu_);
    first = current_;
  }
  std::string why;
  for (size_t n = 0; n < endpoints_.size(); ++n) {
    const size_t i = (first + n) % endpoints_.size();
    std::unique_ptr<httplib::Client> client = Take(i);
    httplib::Result r = client->Post(path, body, "application/json");
    if (!r) {
      absl::StrAppend(&why, why.empty() ? "" : "; ", endpoints_[i], ": ",
                      httplib::to_string(r.error()));
      continue;  // the connection goes with the client
    }
    Give(i, std::move(client));
    {
      absl::MutexLock lock(&mu_);
      current_ = i;
    }
    json j = json::parse(r->body, nullptr, false);
    if (r->status == 200 && j.is_object() && !j.contains("error")) return std::move(r->body);
    const std::string context = absl::StrCat("directory ", endpoints_[i], path);
    // A ferryd's own refusal (a bad token, say): {"error": {"code", "message"}}.
    if (j.is_object() && j.contains("error") && j["error"].is_object()) {
      return StatusFromJson(j, context);
    }
    // An error as the gateway writes it: {"error", "message", "code"} with gRPC's code, which
    // abseil's codes number the same way.
    const int64_t code = j.is_object() ? GatewayInt(j, "code") : 0;
    std::string message = j.is_object() && j.contains("message") && j["message"].is_string()
                              ? j["message"].get<std::string>()
                              : r->body.substr(0, 200);
    return absl::Status(code > 0 && code <= 16 ? static_cast<absl::StatusCode>(code)
                                               : absl::StatusCode::kUnavailable,
                        absl::StrCat(context, ": HTTP ", r->status, ": ", message));
  }
  return absl::UnavailableError(absl::StrCat("directory ", url_, " unreachable: ", why));
}

absl::StatusOr<int64_t> Directory::Grant(absl::Duration ttl) {
  const int64_t s = std::max<int64_t>(1, absl::ToInt64Seconds(ttl));
  absl::StatusOr<std::string> r = Call("/v3/lease/grant", json{{"TTL", std::to_string(s)}}.dump());
  if (!r.ok()) return r.status();
  const int64_t id = GatewayInt(json::parse(*r, nullptr, false), "ID");
  if (id == 0) return absl::UnavailableError("directory granted no lease");
  return id;
}

absl::StatusOr<absl::Duration> Directory::KeepAlive(int64_t lease) {
  absl::StatusOr<std::string> r =
      Call("/v3/lease/keepalive", json{{"ID", std::to_string(lease)}}.dump());
  if (!r.ok()) return r.status();
  // A stream's answer: {"result": {...}}; a lease that is gone has no TTL (or 0).
  json j = json::parse(*r, nullptr, false);
  const json& result = j.is_object() && j.contains("result") ? j["result"] : j;
  const int64_t ttl = result.is_object() ? GatewayInt(result, "TTL") : 0;
  if (ttl <= 0) return absl::NotFoundError(absl::StrCat("lease ", lease, " is gone"));
  return absl::Seconds(ttl);
}

absl::Status Directory::Revoke(int64_t lease) {
  return Call("/v3/lease/revoke", json{{"ID", std::to_string(lease)}}.dump()).status();
}

absl::Status Directory::Put(const std::string& key, const std::string& value, int64_t lease) {
  json body = {{"key", B64(key)}, {"value", B64(value)}};
  if (lease != 0) body["lease"] = std::to_string(lease);
  return Call("/v3/kv/put", body.dump()).status();
}

absl::StatusOr<std::vector<KeyValue>> Directory::Range(const std::string& prefix) {
  absl::StatusOr<std::string> r = Call(
      "/v3/kv/range", json{{"key", B64(prefix)}, {"range_end", B64(PrefixEnd(prefix))}}.dump());
  if (!r.ok()) return r.status();
  json j = json::parse(*r, nullptr, false);
  std::vector<KeyValue> out;
  if (!j.is_object() || !j.contains("kvs") || !j["kvs"].is_array()) return out;
  for (const json& kv : j["kvs"]) {
    out.push_back({Unb64(kv, "key"), Unb64(kv, "value"), GatewayInt(kv, "lease")});
  }
  return out;
}

absl::StatusOr<int64_t> Directory::Delete(const std::string& key) {
  absl::StatusOr<std::string> r = Call("/v3/kv/deleterange", json{{"key", B64(key)}}.dump());
  if (!r.ok()) return r.status();
  return GatewayInt(json::parse(*r, nullptr, false), "deleted");
}

}  // namespace ferry::cluster
