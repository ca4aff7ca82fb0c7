// gmock matchers and macros for absl::Status: Debian's abseil 20220623 ships none.
#ifndef FERRY_TESTS_TESTING_STATUS_MATCHERS_H_
#define FERRY_TESTS_TESTING_STATUS_MATCHERS_H_

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace ferry::testing {

inline const absl::Status& GetStatus(const absl::Status& s) { return s; }
template <typename T>
const absl::Status& GetStatus(const absl::StatusOr<T>& s) {
  return s.status();
}

MATCHER_P(StatusIs, code, "has status code " + ::testing::PrintToString(code)) {
  const absl::Status& s = ::ferry::testing::GetStatus(arg);
  *result_listener << "status is " << s.ToString();
  return s.code() == code;
}

// The code, and the message matching `message` (a gmock string matcher).
MATCHER_P2(StatusIs, code, message, "has status code " + ::testing::PrintToString(code)) {
  const absl::Status& s = ::ferry::testing::GetStatus(arg);
  *result_listener << "status is " << s.ToString();
  return s.code() == code && ::testing::Matches(message)(std::string(s.message()));
}

MATCHER(IsOk, "is OK") {
  const absl::Status& s = ::ferry::testing::GetStatus(arg);
  *result_listener << "status is " << s.ToString();
  return s.ok();
}

}  // namespace ferry::testing

#define FERRY_TEST_CONCAT_INNER_(a, b) a##b
#define FERRY_TEST_CONCAT_(a, b) FERRY_TEST_CONCAT_INNER_(a, b)

#define ASSERT_OK(expr) ASSERT_THAT((expr), ::ferry::testing::IsOk())
#define EXPECT_OK(expr) EXPECT_THAT((expr), ::ferry::testing::IsOk())

#define FERRY_ASSERT_OK_AND_ASSIGN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                     \
  ASSERT_TRUE(tmp.ok()) << tmp.status().ToString();      \
  lhs = std::move(tmp).value()
#define ASSERT_OK_AND_ASSIGN(lhs, expr) \
  FERRY_ASSERT_OK_AND_ASSIGN_IMPL_(FERRY_TEST_CONCAT_(ferry_or_, __LINE__), lhs, expr)

#endif  // FERRY_TESTS_TESTING_STATUS_MATCHERS_H_
