// A child process with its stdin and stdout on pipes, spoken to in lines (JSON in practice).
// Not thread-safe.
#ifndef FERRY_TESTS_TESTING_SUBPROCESS_H_
#define FERRY_TESTS_TESTING_SUBPROCESS_H_

#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "nlohmann/json.hpp"

namespace ferry::testing {

class Subprocess {
 public:
  // Starts argv[0] (a path, or a name looked up in PATH) with argv (posix_spawnp: no fork of a
  // process that may hold CUDA or libfabric state). stderr is inherited. `stop_signal` is how the
  // destructor asks the child to finish: 0 for a child that ends when its stdin closes, else a
  // signal (SIGTERM).
  static absl::StatusOr<std::unique_ptr<Subprocess>> Spawn(const std::vector<std::string>& argv,
                                                           int stop_signal = 0);
  // Closes the child's stdin, sends the stop signal and reaps it; one still running 10 s later
  // is killed (SIGKILL).
  ~Subprocess();

  absl::Status WriteLine(const std::string& line);
  // kDeadlineExceeded after `timeout`; kUnavailable when the child closed its stdout.
  absl::StatusOr<std::string> ReadLine(absl::Duration timeout);
  // Sends a JSON request line and reads one JSON reply line.
  absl::StatusOr<nlohmann::json> Call(const nlohmann::json& request,
                                      absl::Duration timeout = absl::Seconds(120));
  void Kill(int signal);
  // Waits for the child to exit; returns its wait status. Removes the shm files of a child that
  // died of a signal.
  int Wait();
  pid_t pid() const { return pid_; }

 private:
  Subprocess() = default;
  void Reaped(int status);
  pid_t pid_ = -1;
  int stop_signal_ = 0;
  int in_fd_ = -1;   // child's stdin
  int out_fd_ = -1;  // child's stdout
  std::string buffer_;
  bool reaped_ = false;
};

// Runs argv to its end (killed after `timeout`) and returns what it wrote on stdout.
// kInternal, with the command and its output, when it exits other than with status 0.
absl::StatusOr<std::string> RunCommand(const std::vector<std::string>& argv,
                                       absl::Duration timeout = absl::Seconds(30));

// CPU seconds (user + system, every thread) process `pid` has used so far, from
// /proc/PID/stat (clock-tick resolution); 0 when it cannot be read.
double CpuSeconds(pid_t pid);

}  // namespace ferry::testing

#endif  // FERRY_TESTS_TESTING_SUBPROCESS_H_
