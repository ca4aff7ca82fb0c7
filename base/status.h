// Status helpers shared by every ferry module. Debian's abseil (20220623) ships no
// RETURN_IF_ERROR / ASSIGN_OR_RETURN, so these are ours.
#ifndef FERRY_BASE_STATUS_H_
#define FERRY_BASE_STATUS_H_

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"

namespace ferry {

// Drops a Status on purpose; grep for IgnoreError to find every such place.
inline void IgnoreError(const absl::Status& /*status*/) {}

// `s` with `context` before its message ("context: message"), its code and payloads kept.
inline absl::Status WithContext(const absl::Status& s, absl::string_view context) {
  if (s.ok()) return s;
  absl::Status out(s.code(), absl::StrCat(context, ": ", s.message()));
  s.ForEachPayload(
      [&out](absl::string_view url, const absl::Cord& payload) { out.SetPayload(url, payload); });
  return out;
}

namespace internal {
inline absl::Status AsStatus(absl::Status s) { return s; }
template <typename T>
absl::Status AsStatus(const absl::StatusOr<T>& s) {
  return s.status();
}
}  // namespace internal

}  // namespace ferry

#define FERRY_CONCAT_INNER_(a, b) a##b
#define FERRY_CONCAT_(a, b) FERRY_CONCAT_INNER_(a, b)

#define RETURN_IF_ERROR(expr)                                       \
  do {                                                              \
    absl::Status ferry_status_ = ::ferry::internal::AsStatus(expr); \
    if (!ferry_status_.ok()) return ferry_status_;                  \
  } while (0)

#define FERRY_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                 \
  if (!tmp.ok()) return tmp.status();                \
  lhs = std::move(tmp).value()

#define ASSIGN_OR_RETURN(lhs, expr) \
  FERRY_ASSIGN_OR_RETURN_IMPL_(FERRY_CONCAT_(ferry_statusor_, __LINE__), lhs, expr)

#endif  // FERRY_BASE_STATUS_H_
