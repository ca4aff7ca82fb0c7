#include "server/transports.h"

#include <httplib.h>

#include <map>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/work_queue.h"
#include "wire/http_status.h"
#include "wire/messages.h"

namespace ferry::server {
namespace {

class FabricTransport : public PeerTransport {
 public:
  explicit FabricTransport(engine::Engine& engine) : engine_(engine) {}
  std::string_view name() const override { return "fabric"; }
  void Send(const PeerRef& peer, std::string sealed, absl::Time /*deadline*/,
            std::function<void(absl::StatusOr<std::string>)> sent) override {
    if (peer.fabric_peer == 0) {
      return sent(absl::UnavailableError(absl::StrCat(peer.url, " is not reached over the rails")));
    }
    engine_.PostControl(peer.fabric_peer, std::move(sealed),
                        [sent = std::move(sent)](const absl::Status& s) {
                          if (s.ok()) return sent(std::string());
                          sent(absl::UnavailableError(s.message()));
                        });
  }

 private:
  engine::Engine& engine_;
};

class HttpTransport : public PeerTransport {
 public:
  // Threads waiting on answers: a pull over HTTP holds its thread until the source answers.
  static constexpr size_t kThreads = 16;
  static constexpr size_t kIdleKept = 4;  // kept-alive connections per node

  HttpTransport() : queue_(kThreads) {}
  std::string_view name() const override { return "http"; }
  void Send(const PeerRef& peer, std::string sealed, absl::Time deadline,
            std::function<void(absl::StatusOr<std::string>)> sent) override {
    queue_.Run([this, url = peer.url, sealed = std::move(sealed), deadline,
                sent = std::move(sent)]() mutable {
      std::unique_ptr<httplib::Client> client = Take(url);
      const absl::Duration left = std::max(deadline - absl::Now(), absl::Seconds(1));
      client->set_read_timeout(static_cast<time_t>(absl::ToInt64Seconds(left)) + 1);
      auto r = client->Post("/v1/peer", sealed, wire::kMessageContentType);
      absl::Status s = StatusFromResult(r, "node " + url);
      if (!s.ok()) return sent(s);
      Give(url, std::move(client));
      sent(std::move(r->body));
    });
  }

 private:
  std::unique_ptr<httplib::Client> Take(const std::string& url) {
    {
      absl::MutexLock lock(&mu_);
      auto& idle = idle_[url];
      if (!idle.empty()) {
        auto c = std::move(idle.back());
        idle.pop_back();
        return c;
      }
    }
    auto c = std::make_unique<httplib::Client>(url);
    c->set_keep_alive(true);
    c->set_tcp_nodelay(true);
    c->set_connection_timeout(5);
    c->set_write_timeout(60);
    return c;
  }
  void Give(const std::string& url, std::unique_ptr<httplib::Client> c) {
    absl::MutexLock lock(&mu_);
    auto& idle = idle_[url];
    if (idle.size() < kIdleKept) idle.push_back(std::move(c));
  }

  absl::Mutex mu_;
  std::map<std::string, std::vector<std::unique_ptr<httplib::Client>>> idle_ ABSL_GUARDED_BY(mu_);
  WorkQueue queue_;  // last: its threads stop before the clients go
};

}  // namespace

std::unique_ptr<PeerTransport> MakeFabricTransport(engine::Engine& engine) {
  return std::make_unique<FabricTransport>(engine);
}

std::unique_ptr<PeerTransport> MakeHttpTransport() { return std::make_unique<HttpTransport>(); }

}  // namespace ferry::server
