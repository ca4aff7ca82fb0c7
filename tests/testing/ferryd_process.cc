#include "tests/testing/ferryd_process.h"

#include <signal.h>

#include "nlohmann/json.hpp"

namespace ferry::testing {

int FerrydProcess::Stop() {
  proc->Kill(SIGTERM);
  return proc->Wait();
}

absl::StatusOr<FerrydProcess> StartFerryd(const std::string& ferryd,
                                          const std::vector<std::string>& args) {
  std::vector<std::string> argv = {ferryd, "--listen", "127.0.0.1:0"};
  argv.insert(argv.end(), args.begin(), args.end());
  FerrydProcess f;
  auto p = Subprocess::Spawn(argv, SIGTERM);
  if (!p.ok()) return p.status();
  f.proc = std::move(*p);
  auto line = f.proc->ReadLine(absl::Seconds(30));
  if (!line.ok()) return line.status();
  auto j = nlohmann::json::parse(*line, nullptr, false);
  if (j.is_discarded() || !j.contains("listen") || !j.contains("node")) {
    return absl::InternalError("ferryd said: " + *line);
  }
  f.url = "http://" + j["listen"].get<std::string>();
  f.id = j["node"].get<std::string>();
  return f;
}

}  // namespace ferry::testing
