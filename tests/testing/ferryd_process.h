// A ferryd child process on an ephemeral loopback port, for tests, benchmarks and the demo.
#ifndef FERRY_TESTS_TESTING_FERRYD_PROCESS_H_
#define FERRY_TESTS_TESTING_FERRYD_PROCESS_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "tests/testing/subprocess.h"

namespace ferry::testing {

// Destroying it stops ferryd the same way (SIGTERM, then SIGKILL after 10 s).
struct FerrydProcess {
  std::unique_ptr<Subprocess> proc;
  std::string url;  // http://127.0.0.1:PORT
  std::string id;   // the node id
  // SIGTERM, then waits; returns the wait status (0 after a clean stop).
  int Stop();
};

// Starts `ferryd --listen 127.0.0.1:0 ARGS...` and reads the line it prints once listening.
absl::StatusOr<FerrydProcess> StartFerryd(const std::string& ferryd,
                                          const std::vector<std::string>& args);

// Starts ferryd through `prefix` (`ip netns exec NS`) listening on every address of its
// namespace (no token: the namespace is the test's own); `url` names it by `host`.
absl::StatusOr<FerrydProcess> StartFerrydIn(const std::vector<std::string>& prefix,
                                            const std::string& host, const std::string& ferryd,
                                            const std::vector<std::string>& args);

// Starts ferryd through `prefix` listening on `address` (an address of its namespace: its
// URL, the one other nodes reach it at, is http://ADDRESS:PORT), without a token.
absl::StatusOr<FerrydProcess> StartFerrydAt(const std::vector<std::string>& prefix,
                                            const std::string& address, const std::string& ferryd,
                                            const std::vector<std::string>& args);

}  // namespace ferry::testing

#endif  // FERRY_TESTS_TESTING_FERRYD_PROCESS_H_
