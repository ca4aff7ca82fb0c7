#include "wire/http_status.h"

#include <httplib.h>

#include <cstdio>
#include <cstdlib>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"

namespace ferry {

namespace {
constexpr char kHttpStatusPayload[] = "ferry/http-status";

absl::Status WithHttpStatus(absl::Status s, int http) {
  s.SetPayload(kHttpStatusPayload, absl::Cord(std::to_string(http)));
  return s;
}
}  // namespace

absl::Status Conflict(absl::string_view message) {
  return WithHttpStatus(absl::FailedPreconditionError(std::string(message)), 409);
}

absl::Status PreconditionFailed(absl::string_view message) {
  return WithHttpStatus(absl::FailedPreconditionError(std::string(message)), 412);
}

std::string Crc32cHex(uint32_t crc) {
  char out[9];
  std::snprintf(out, sizeof(out), "%08x", crc);
  return out;
}

absl::Status TooLarge(absl::string_view message) {
  return WithHttpStatus(absl::ResourceExhaustedError(std::string(message)), 413);
}

absl::Status InsufficientStorage(absl::string_view message) {
  return WithHttpStatus(absl::ResourceExhaustedError(std::string(message)), 507);
}

std::optional<int> HttpStatusOverride(const absl::Status& s) {
  auto p = s.GetPayload(kHttpStatusPayload);
  if (!p) return std::nullopt;
  return std::atoi(std::string(*p).c_str());
}

int HttpStatusFor(const absl::Status& s) {
  if (auto forced = HttpStatusOverride(s)) return *forced;
  switch (s.code()) {
    case absl::StatusCode::kOk:
      return 200;
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kOutOfRange:
      return 400;
    case absl::StatusCode::kUnauthenticated:
      return 401;
    case absl::StatusCode::kPermissionDenied:
      return 403;
    case absl::StatusCode::kNotFound:
      return 404;
    case absl::StatusCode::kAlreadyExists:
    case absl::StatusCode::kAborted:
      return 409;
    case absl::StatusCode::kResourceExhausted:
      return 429;
    case absl::StatusCode::kUnimplemented:
      return 501;
    // Cancelled: the node stopped the work (it drains), not the caller's fault.
    case absl::StatusCode::kCancelled:
    case absl::StatusCode::kUnavailable:
      return 503;
    case absl::StatusCode::kDeadlineExceeded:
      return 504;
    default:
      return 500;
  }
}

nlohmann::json ErrorBody(const absl::Status& s) {
  return {{"error",
           {{"code", absl::StatusCodeToString(s.code())}, {"message", std::string(s.message())}}}};
}

void WriteError(httplib::Response& res, const absl::Status& s) {
  res.status = HttpStatusFor(s);
  res.set_content(ErrorBody(s).dump(), kJsonContentType);
}

namespace {
absl::StatusCode CodeFromName(const std::string& name) {
  for (int c = 0; c <= 16; ++c) {
    auto code = static_cast<absl::StatusCode>(c);
    if (absl::StatusCodeToString(code) == name) return code;
  }
  return absl::StatusCode::kUnknown;
}
}  // namespace

absl::Status StatusFromResult(const httplib::Result& result, const std::string& context) {
  if (!result) {
    const httplib::Error e = result.error();
    // A connection that broke (the node died) and one that timed out look the same here:
    // both are worth a retry. A caller with a deadline of its own says which it was.
    return absl::UnavailableError(
        absl::StrCat(context, ": no response (", httplib::to_string(e), ")"));
  }
  if (result->status >= 200 && result->status < 300) return absl::OkStatus();
  auto j = ParseJson(result->body);
  if (j.ok() && j->is_object() && j->contains("error") && (*j)["error"].is_object()) {
    absl::Status s = StatusFromJson(*j, context);
    if (result->status == 409 && s.code() == absl::StatusCode::kFailedPrecondition) {
      return Conflict(s.message());
    }
    if (result->status == 413) return TooLarge(s.message());
    if (result->status == 507) return InsufficientStorage(s.message());
    if (result->status == 412) return PreconditionFailed(s.message());
    return s;
  }
  return absl::UnknownError(absl::StrCat(context, ": HTTP ", result->status));
}

absl::Status StatusFromJson(const nlohmann::json& body, const std::string& context) {
  if (!body.is_object() || !body.contains("error") || !body["error"].is_object()) {
    return absl::UnknownError(absl::StrCat(context, ": an error without its shape"));
  }
  const auto& e = body["error"];
  absl::StatusCode code = absl::StatusCode::kUnknown;
  std::string message;
  if (e.contains("code") && e["code"].is_string())
    code = CodeFromName(e["code"].get<std::string>());
  if (e.contains("message") && e["message"].is_string()) message = e["message"].get<std::string>();
  if (code == absl::StatusCode::kOk) code = absl::StatusCode::kUnknown;
  return absl::Status(code, absl::StrCat(context, ": ", message));
}

absl::StatusOr<nlohmann::json> ParseJson(std::string_view text, size_t max_depth) {
  // One pass over the text, outside strings, before any recursion can start.
  size_t depth = 0;
  bool in_string = false, escaped = false;
  for (char c : text) {
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > max_depth) {
        return absl::InvalidArgumentError(
            absl::StrCat("JSON nested deeper than ", max_depth, " levels"));
      }
    } else if ((c == ']' || c == '}') && depth > 0) {
      --depth;
    }
  }
  auto j = nlohmann::json::parse(text, nullptr, false);
  if (j.is_discarded()) return absl::InvalidArgumentError("not valid JSON");
  return j;
}

std::string EncodeName(const std::string& name) {
  std::string out;
  for (char c : name) {
    if (c == '/') {
      out += "%2F";
    } else {
      out += c;
    }
  }
  return out;
}

bool IsHttpUrl(std::string_view url) {
  for (std::string_view scheme : {"http://", "https://"}) {
    if (url.substr(0, scheme.size()) == scheme) return url.size() > scheme.size();
  }
  return false;
}

}  // namespace ferry
