#include "server/http_conditions.h"

#include <httplib.h>
#include <time.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "server/node.h"
#include "wire/http_status.h"

namespace ferry::server {
namespace {

// The tags of an If-Match or If-None-Match list, without spaces.
std::vector<std::string_view> Tags(std::string_view header) {
  std::vector<std::string_view> out;
  for (absl::string_view t : absl::StrSplit(absl::string_view(header.data(), header.size()), ',')) {
    t = absl::StripAsciiWhitespace(t);
    if (!t.empty()) out.emplace_back(t.data(), t.size());
  }
  return out;
}

}  // namespace

std::string ETagOf(const std::string& node_id, const ObjectInfo& o) {
  return absl::StrCat("\"", node_id, ":", o.name, ":", o.version, "\"");
}

std::string HttpDate(int64_t unix_ms) {
  const time_t t = static_cast<time_t>(unix_ms / 1000);
  struct tm tm = {};
  gmtime_r(&t, &tm);
  char out[64];
  const size_t n = strftime(out, sizeof(out), "%a, %d %b %Y %H:%M:%S GMT", &tm);
  return std::string(out, n);
}

std::optional<int64_t> ParseHttpDate(const std::string& text) {
  struct tm tm = {};
  const char* end = strptime(text.c_str(), "%a, %d %b %Y %H:%M:%S GMT", &tm);
  if (end == nullptr || *end != '\0') return std::nullopt;
  return static_cast<int64_t>(timegm(&tm));
}

bool ETagListHas(std::string_view header, std::string_view etag, bool weak) {
  for (std::string_view t : Tags(header)) {
    if (t == "*") return true;
    if (t.substr(0, 2) == "W/") {
      if (!weak) continue;  // a weak tag never matches strongly
      t.remove_prefix(2);
    }
    if (t == etag) return true;
  }
  return false;
}

bool AnsweredByConditions(const httplib::Request& req, httplib::Response& res,
                          const std::string& etag, int64_t created_ms) {
  res.set_header("ETag", etag);
  res.set_header("Last-Modified", HttpDate(created_ms));
  if (req.has_header("If-Match") && !ETagListHas(req.get_header_value("If-Match"), etag, false)) {
    WriteError(res, PreconditionFailed("If-Match: this is version " + etag));
    return true;
  }
  bool not_modified = false;
  if (req.has_header("If-None-Match")) {
    not_modified = ETagListHas(req.get_header_value("If-None-Match"), etag, true);
  } else if (req.has_header("If-Modified-Since")) {
    const auto since = ParseHttpDate(req.get_header_value("If-Modified-Since"));
    not_modified = since && created_ms / 1000 <= *since;
  }
  if (not_modified) res.status = 304;
  return not_modified;
}

bool RangeApplies(const httplib::Request& req, const std::string& etag, int64_t created_ms) {
  if (!req.has_header("If-Range")) return true;
  const std::string v = req.get_header_value("If-Range");
  if (!v.empty() && (v[0] == '"' || v.rfind("W/", 0) == 0)) return v == etag;
  const auto date = ParseHttpDate(v);
  return date && *date == created_ms / 1000;
}

absl::StatusOr<std::optional<uint64_t>> WriteCondition(const Node& node, const std::string& name,
                                                       const httplib::Request& req) {
  if (req.has_header("If-Match")) {
    const std::string header = req.get_header_value("If-Match");
    if (header == "*") {
      auto latest = node.Describe(name, std::nullopt, false);
      if (!latest.ok())
        return PreconditionFailed("If-Match: * and object '" + name + "' has no version");
      return std::optional<uint64_t>(latest->version);
    }
    const std::string prefix = absl::StrCat("\"", node.id(), ":", name, ":");
    for (std::string_view t : Tags(header)) {
      uint64_t v = 0;
      if (t.size() > prefix.size() + 1 && t.substr(0, prefix.size()) == prefix && t.back() == '"' &&
          absl::SimpleAtoi(
              absl::string_view(t.data() + prefix.size(), t.size() - prefix.size() - 1), &v)) {
        return std::optional<uint64_t>(v);
      }
    }
    return PreconditionFailed("If-Match names no version of object '" + name + "' on this node");
  }
  if (req.has_header("If-None-Match")) {
    const std::string header = req.get_header_value("If-None-Match");
    if (header == "*") return std::optional<uint64_t>(0);
    auto latest = node.Describe(name, std::nullopt, false);
    if (latest.ok() && ETagListHas(header, ETagOf(node.id(), *latest), true)) {
      return PreconditionFailed("If-None-Match: object '" + name + "' is at that version");
    }
  }
  return std::optional<uint64_t>();
}

}  // namespace ferry::server
