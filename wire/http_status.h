// The one mapping between absl::Status and HTTP (STYLE.md's table), used by the routes, by
// the node when it calls other nodes, and by the client library.
#ifndef FERRY_WIRE_HTTP_STATUS_H_
#define FERRY_WIRE_HTTP_STATUS_H_

#include <optional>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace httplib {
struct Response;
class Result;
}  // namespace httplib

namespace ferry {

// Statuses that the HTTP layer answers with a status code other than its default for the
// code: 409 for a precondition that is a conflict (region in use, object detached), 413 for
// a request over a limit, 507 for a full disk.
absl::Status Conflict(absl::string_view message);
absl::Status TooLarge(absl::string_view message);
// 507: kResourceExhausted for want of disk space.
absl::Status InsufficientStorage(absl::string_view message);
// 412: a conditional request whose condition is false (If-Match, If-None-Match).
absl::Status PreconditionFailed(absl::string_view message);
std::optional<int> HttpStatusOverride(const absl::Status& s);

// 400 INVALID_ARGUMENT / FAILED_PRECONDITION / OUT_OF_RANGE, 401 UNAUTHENTICATED,
// 403 PERMISSION_DENIED, 404 NOT_FOUND, 409 ALREADY_EXISTS / ABORTED, 413 and 507 (explicit
// overrides), 429 RESOURCE_EXHAUSTED, 501 UNIMPLEMENTED, 503 UNAVAILABLE, 504
// DEADLINE_EXCEEDED, 500 otherwise. A status may carry an override (Conflict, TooLarge).
int HttpStatusFor(const absl::Status& s);
// The type of every JSON answer. The parameter keeps cpp-httplib from compressing it (it
// compresses exactly "application/json" for a client that accepts br or gzip): brotli at its
// default quality takes far longer than the bytes it saves take on the networks ferry runs on.
inline constexpr char kJsonContentType[] = "application/json; charset=utf-8";

// {"error":{"code":"NOT_FOUND","message":"..."}}
nlohmann::json ErrorBody(const absl::Status& s);
// Writes `s` as the response: its HTTP status and error body.
void WriteError(httplib::Response& res, const absl::Status& s);
// Reads a client call's outcome back into a Status: no response is kUnavailable; an error body
// gives its code and message; `context` is prefixed.
absl::Status StatusFromResult(const httplib::Result& result, const std::string& context);
// The Status an error body ({"error":{"code","message"}}) carries, `context` prefixed.
absl::Status StatusFromJson(const nlohmann::json& body, const std::string& context);

// Whether `url` can be a node's (or a directory's) address: http://HOST[:PORT] or, where it
// serves TLS, https://HOST[:PORT]. Clients verify a server's certificate against the system's
// CAs, or those OpenSSL's SSL_CERT_FILE or SSL_CERT_DIR name.
bool IsHttpUrl(std::string_view url);

// Bodies nested deeper than this are refused before they are parsed (nlohmann's DOM copies
// and destroys recursively: a deep enough body overflows the stack).
inline constexpr size_t kMaxJsonDepth = 64;
// Parses `text` as JSON. kInvalidArgument: not JSON, or nested deeper than `max_depth`.
absl::StatusOr<nlohmann::json> ParseJson(std::string_view text, size_t max_depth = kMaxJsonDepth);

// A CRC32C as ferry writes it (X-Ferry-CRC32C, "crc32c" in descriptions): 8 lowercase hex
// digits.
std::string Crc32cHex(uint32_t crc);

// An object name as one URL path segment: "/" is written %2F.
std::string EncodeName(const std::string& name);

}  // namespace ferry

#endif  // FERRY_WIRE_HTTP_STATUS_H_
