// Conditional requests on object versions (RFC 9110, section 13): validators (a strong ETag, the
// publish time as Last-Modified) and the preconditions GET, HEAD, PUT and DELETE obey.
// Plain functions; thread-safe.
#ifndef FERRY_SERVER_HTTP_CONDITIONS_H_
#define FERRY_SERVER_HTTP_CONDITIONS_H_

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "ferry/types.h"

namespace httplib {
struct Request;
struct Response;
}  // namespace httplib

namespace ferry::server {

class Node;

// The strong ETag of one object version, from what makes its bytes unique: the node, the name
// and the version ("<node id>:<name>:<version>", quoted; names need no escaping there).
std::string ETagOf(const std::string& node_id, const ObjectInfo& o);
// An IMF-fixdate ("Sun, 06 Nov 1994 08:49:37 GMT") of a Unix time in milliseconds.
std::string HttpDate(int64_t unix_ms);
// Unix seconds of an IMF-fixdate; nullopt for anything else (the header is then ignored).
std::optional<int64_t> ParseHttpDate(const std::string& text);
// Whether `header` (entity tags separated by commas, or "*") holds `etag`: strong comparison
// (If-Match, If-Range) or weak (If-None-Match).
bool ETagListHas(std::string_view header, std::string_view etag, bool weak);

// GET or HEAD of one version: sets ETag and Last-Modified, then answers 412 (If-Match that does
// not hold) or 304 (If-None-Match that holds, else If-Modified-Since not passed). True when it
// answered.
bool AnsweredByConditions(const httplib::Request& req, httplib::Response& res,
                          const std::string& etag, int64_t created_ms);
// Whether a request's Range is to be served as a range: no If-Range, or one that names this
// version (its ETag, or exactly its Last-Modified).
bool RangeApplies(const httplib::Request& req, const std::string& etag, int64_t created_ms);
// The version a PUT or DELETE of `name` must find as the latest: If-Match (an ETag of this node
// and name, or "*": whatever version exists), If-None-Match "*" (0: none may exist). nullopt
// without those headers. PreconditionFailed (412) when the headers rule the request out before
// the catalog is asked.
absl::StatusOr<std::optional<uint64_t>> WriteCondition(const Node& node, const std::string& name,
                                                       const httplib::Request& req);

}  // namespace ferry::server

#endif  // FERRY_SERVER_HTTP_CONDITIONS_H_
