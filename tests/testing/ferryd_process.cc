#include "tests/testing/ferryd_process.h"

#include <signal.h>

#include "nlohmann/json.hpp"

namespace ferry::testing {

int FerrydProcess::Stop() {
  proc->Kill(SIGTERM);
  return proc->Wait();
}

namespace {

absl::StatusOr<FerrydProcess> Launch(const std::vector<std::string>& argv,
                                     const std::string& host) {
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
  const std::string listen = j["listen"].get<std::string>();
  f.url = "http://" + (host.empty() ? listen : host + listen.substr(listen.rfind(':')));
  f.id = j["node"].get<std::string>();
  return f;
}

}  // namespace

absl::StatusOr<FerrydProcess> StartFerryd(const std::string& ferryd,
                                          const std::vector<std::string>& args) {
  std::vector<std::string> argv = {ferryd, "--listen", "127.0.0.1:0"};
  argv.insert(argv.end(), args.begin(), args.end());
  return Launch(argv, "");
}

absl::StatusOr<FerrydProcess> StartFerrydIn(const std::vector<std::string>& prefix,
                                            const std::string& host, const std::string& ferryd,
                                            const std::vector<std::string>& args) {
  std::vector<std::string> argv = prefix;
  for (const char* a : {ferryd.c_str(), "--listen", "0.0.0.0:0", "--insecure"}) argv.push_back(a);
  argv.insert(argv.end(), args.begin(), args.end());
  return Launch(argv, host);
}

absl::StatusOr<FerrydProcess> StartFerrydAt(const std::vector<std::string>& prefix,
                                            const std::string& address, const std::string& ferryd,
                                            const std::vector<std::string>& args) {
  std::vector<std::string> argv = prefix;
  argv.insert(argv.end(), {ferryd, "--listen", address + ":0", "--insecure"});
  argv.insert(argv.end(), args.begin(), args.end());
  return Launch(argv, address);
}

}  // namespace ferry::testing
