#include "tests/testing/subprocess.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "engine/rail.h"

extern char** environ;

namespace ferry::testing {

absl::StatusOr<std::unique_ptr<Subprocess>> Subprocess::Spawn(const std::vector<std::string>& argv,
                                                              int stop_signal) {
  int in[2], out[2];
  if (pipe2(in, O_CLOEXEC) != 0 || pipe2(out, O_CLOEXEC) != 0) {
    return absl::InternalError(absl::StrCat("pipe2: ", strerror(errno)));
  }
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, in[0], 0);
  posix_spawn_file_actions_adddup2(&actions, out[1], 1);
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  std::unique_ptr<Subprocess> p(new Subprocess());
  int rc = posix_spawnp(&p->pid_, args[0], &actions, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  close(in[0]);
  close(out[1]);
  p->stop_signal_ = stop_signal;
  p->in_fd_ = in[1];
  p->out_fd_ = out[0];
  if (rc != 0) {
    p->reaped_ = true;
    return absl::InternalError(absl::StrCat("posix_spawn ", argv[0], ": ", strerror(rc)));
  }
  return p;
}

Subprocess::~Subprocess() {
  // A child that does not finish within the grace period is killed, and Reaped removes what
  // it left in /dev/shm.
  if (in_fd_ >= 0) close(in_fd_);
  if (!reaped_ && pid_ > 0) {
    if (stop_signal_ != 0) kill(pid_, stop_signal_);
    const absl::Time give_up = absl::Now() + absl::Seconds(10);
    int status = 0;
    pid_t r = 0;
    while ((r = waitpid(pid_, &status, WNOHANG)) == 0 && absl::Now() < give_up) {
      absl::SleepFor(absl::Milliseconds(10));
    }
    if (r == pid_) {
      Reaped(status);
    } else {
      kill(pid_, SIGKILL);
      Wait();
    }
  }
  if (out_fd_ >= 0) close(out_fd_);
}

absl::Status Subprocess::WriteLine(const std::string& line) {
  std::string data = line + "\n";
  size_t done = 0;
  while (done < data.size()) {
    ssize_t n = write(in_fd_, data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return absl::UnavailableError(absl::StrCat("write to child: ", strerror(errno)));
    done += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> Subprocess::ReadLine(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    size_t nl = buffer_.find('\n');
    if (nl != std::string::npos) {
      std::string line = buffer_.substr(0, nl);
      buffer_.erase(0, nl + 1);
      return line;
    }
    const int64_t left = absl::ToInt64Milliseconds(deadline - absl::Now());
    if (left <= 0) return absl::DeadlineExceededError("child sent no line in time");
    pollfd pfd = {out_fd_, POLLIN, 0};
    int rc = poll(&pfd, 1, static_cast<int>(std::min<int64_t>(left, 1000)));
    if (rc < 0 && errno != EINTR) return absl::InternalError(strerror(errno));
    if (rc <= 0) continue;
    char buf[65536];
    ssize_t n = read(out_fd_, buf, sizeof(buf));
    if (n == 0) return absl::UnavailableError("child closed its stdout");
    if (n < 0 && errno != EINTR) return absl::InternalError(strerror(errno));
    if (n > 0) buffer_.append(buf, static_cast<size_t>(n));
  }
}

absl::StatusOr<nlohmann::json> Subprocess::Call(const nlohmann::json& request,
                                                absl::Duration timeout) {
  absl::Status s = WriteLine(request.dump());
  if (!s.ok()) return s;
  auto line = ReadLine(timeout);
  if (!line.ok()) return line.status();
  auto j = nlohmann::json::parse(*line, nullptr, false);
  if (j.is_discarded()) return absl::InternalError(absl::StrCat("child sent bad JSON: ", *line));
  return j;
}

void Subprocess::Reaped(int status) {
  reaped_ = true;
  if (WIFSIGNALED(status)) engine::RemoveShmLeftovers(pid_);
}

void Subprocess::Kill(int signal) {
  if (!reaped_) kill(pid_, signal);
}

int Subprocess::Wait() {
  if (reaped_) return 0;
  int status = 0;
  while (waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
  }
  Reaped(status);
  return status;
}

absl::StatusOr<std::string> RunCommand(const std::vector<std::string>& argv,
                                       absl::Duration timeout) {
  auto p = Subprocess::Spawn(argv, SIGKILL);
  if (!p.ok()) return p.status();
  const absl::Time deadline = absl::Now() + timeout;
  std::string out;
  while (true) {
    auto line = (*p)->ReadLine(std::max(deadline - absl::Now(), absl::ZeroDuration()));
    if (!line.ok()) {
      if (line.status().code() != absl::StatusCode::kUnavailable) return line.status();
      break;
    }
    absl::StrAppend(&out, *line, "\n");
  }
  const int status = (*p)->Wait();
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    return absl::InternalError(
        absl::StrCat("`", absl::StrJoin(argv, " "), "` failed (status ", status, "): ", out));
  }
  return out;
}

double CpuSeconds(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t close = stat.rfind(')');
  if (close == std::string::npos) return 0;
  std::istringstream rest(stat.substr(close + 2));
  std::string field;
  double ticks = 0;
  for (int i = 3; i <= 15 && rest >> field; ++i) {
    if (i == 14 || i == 15) ticks += std::stod(field);  // utime, stime
  }
  return ticks / static_cast<double>(sysconf(_SC_CLK_TCK));
}

}  // namespace ferry::testing
