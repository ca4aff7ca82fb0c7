#include "tests/testing/engine_peer.h"

#include <cstdlib>
#include <cstring>
#include <iostream>
#include <map>
#include <memory>

#include "absl/synchronization/mutex.h"
#include "base/hex.h"
#include "base/status.h"
#include "engine/fabric.h"
#include "spdlog/sinks/stdout_color_sinks.h"
#include "spdlog/spdlog.h"
#include "tests/testing/pattern.h"
#include "wire/extents.h"

namespace ferry::testing {

nlohmann::json ExtentsToJson(const std::vector<Extent>& extents) {
  nlohmann::json out = nlohmann::json::array();
  for (const Extent& e : extents) out.push_back({e.offset, e.length});
  return out;
}

nlohmann::json AddressToJson(const PeerAddress& address) {
  nlohmann::json rails = nlohmann::json::array();
  for (const std::string& r : address.rails) rails.push_back(HexEncode(r));
  return {{"node", address.node}, {"rails", rails}, {"bell", HexEncode(address.bell)}};
}

absl::StatusOr<PeerAddress> AddressFromJson(const nlohmann::json& j) {
  PeerAddress a;
  a.node = j.at("node").get<std::string>();
  for (const auto& r : j.at("rails")) {
    auto raw = HexDecode(r.get<std::string>());
    if (!raw.ok()) return raw.status();
    a.rails.push_back(*raw);
  }
  auto bell = HexDecode(j.value("bell", std::string()));
  if (!bell.ok()) return bell.status();
  a.bell = *bell;
  return a;
}

namespace {

std::vector<Extent> ExtentsFromJson(const nlohmann::json& j) {
  std::vector<Extent> out;
  for (const auto& e : j) out.push_back({0, e[0].get<uint64_t>(), e[1].get<uint64_t>()});
  return out;
}

struct PeerState {
  absl::Mutex mu;
  std::map<uint64_t, int> fires;
  int controls = 0;
  std::string last_control;
};

}  // namespace

int RunEnginePeer(int argc, char** argv) {
  spdlog::set_default_logger(spdlog::stderr_color_mt("peer"));
  engine::EngineOptions options;
  uint64_t size = 1 << 20;
  uint8_t canary = 0xa5;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--provider")
      options.provider = value;
    else if (flag == "--rails")
      options.rails = std::stoul(value);
    else if (flag == "--domain")
      options.domains.push_back(value);
    else if (flag == "--size")
      size = std::stoull(value);
    else if (flag == "--canary")
      canary = static_cast<uint8_t>(std::stoul(value));
    else if (flag == "--progress-threads")
      options.progress_threads = std::stoul(value);
    else if (flag == "--wait-fds")
      options.wait_fds = value == "1";
    else if (flag == "--spin-while-awake")
      options.spin_while_awake = value == "1";
    else if (flag == "--passes-move-nothing" && value == "1")
      options.pass_moved = [] { return false; };
  }
  auto state = std::make_shared<PeerState>();
  options.on_control = [state](std::string_view, std::string_view payload) {
    absl::MutexLock lock(&state->mu);
    ++state->controls;
    state->last_control = std::string(payload);
  };
  auto engine = engine::Engine::Create(options);
  if (!engine.ok()) {
    std::cout << nlohmann::json{{"error", engine.status().ToString()}}.dump() << std::endl;
    return 1;
  }
  auto* buf = static_cast<uint8_t*>(engine::AllocateHostMemory(size));
  memset(buf, canary, size);
  auto region = (*engine)->RegisterMemory(buf, size, Device::Host());
  // The whole region open to the source for the peer's life.
  auto window = region.ok() ? (*engine)->OpenWindow(*region, 0, size)
                            : absl::StatusOr<engine::Window>(region.status());
  if (!window.ok()) {
    std::cout << nlohmann::json{{"error", window.status().ToString()}}.dump() << std::endl;
    return 1;
  }
  std::cout << nlohmann::json{{"address", AddressToJson((*engine)->address())},
                              {"region", ToJson(window->descriptor)}}
                   .dump()
            << std::endl;

  std::map<uint64_t, std::shared_ptr<engine::ImmediateCounter>> counters;
  engine::AwakeToken awake;
  std::string line;
  while (std::getline(std::cin, line)) {
    auto req = nlohmann::json::parse(line, nullptr, false);
    nlohmann::json reply;
    const std::string cmd = req.is_object() ? req.value("cmd", "") : "";
    if (cmd == "verify") {
      std::string err = VerifyTransfer(req["seed"].get<uint64_t>(), ExtentsFromJson(req["src"]),
                                       ExtentsFromJson(req["dst"]), buf, size, canary);
      memset(buf, canary, size);
      reply = {{"ok", err.empty()}, {"error", err}};
    } else if (cmd == "expect") {
      const uint64_t tag = req["tag"].get<uint64_t>();
      auto c = (*engine)->ExpectImmediates(tag, req["count"].get<uint64_t>(), [state, tag] {
        absl::MutexLock lock(&state->mu);
        ++state->fires[tag];
      });
      reply = {{"ok", c.ok()}, {"code", absl::StatusCodeToString(c.status().code())}};
      if (c.ok()) counters[tag] = *c;
    } else if (cmd == "wait") {
      const uint64_t tag = req["tag"].get<uint64_t>();
      absl::Status s =
          counters.count(tag) == 0
              ? absl::NotFoundError("no counter")
              : counters[tag]->Wait(absl::Now() + absl::Milliseconds(req["timeout_ms"].get<int>()));
      absl::MutexLock lock(&state->mu);
      reply = {{"ok", s.ok()}, {"fires", state->fires[tag]}};
    } else if (cmd == "fires") {
      const uint64_t tag = req["tag"].get<uint64_t>();
      uint64_t immediates = 0;  // of every tag, counted or not, as the rails saw them land
      for (const engine::RailCounters& c : (*engine)->Counters()) immediates += c.immediates;
      absl::MutexLock lock(&state->mu);
      reply = {{"fires", state->fires[tag]},
               {"arrived", counters.count(tag) == 0 ? 0 : counters[tag]->arrived()},
               {"immediates", immediates}};
    } else if (cmd == "progress") {
      const engine::ProgressCounters p = (*engine)->Progress();
      reply = {{"passes", p.passes}, {"waits", p.waits}};
    } else if (cmd == "awake") {
      awake = (*engine)->KeepAwake();
      reply = {{"ok", true}};
    } else if (cmd == "sleep") {
      awake = engine::AwakeToken();
      reply = {{"ok", true}};
    } else if (cmd == "controls") {
      absl::MutexLock lock(&state->mu);
      reply = {{"count", state->controls}, {"last", state->last_control}};
    } else if (cmd == "exit") {
      std::cout << nlohmann::json{{"ok", true}}.dump() << std::endl;
      break;
    } else {
      reply = {{"ok", false}, {"error", "unknown command"}};
    }
    std::cout << reply.dump() << std::endl;
  }
  counters.clear();
  awake = engine::AwakeToken();
  IgnoreError((*engine)->DeregisterMemory(*region));
  engine->reset();
  engine::FreeHostMemory(buf, size);
  return 0;
}

}  // namespace ferry::testing
