// The node's HTTP server: httplib's routing and handlers over connections that ferry serves
// itself, so that a slow or silent client cannot take the server from everyone else:
//   - a request's head must arrive whole within `head_timeout` of its first byte (the first
//     request on a connection: of the connection's start);
//   - a body and an answer must keep up `min_rate` bytes a second once `head_timeout` has
//     passed (a body of N bytes has head_timeout + N / min_rate);
//   - a request that has taken more than `slow_after` over its head, or has fallen behind
//     `min_rate` after `slow_after`, is slow: at most `max_slow` requests are slow at once,
//     and one more is closed at once;
//   - a connection that breaks one of these gets 408 (where nothing of an answer went out) and
//     is closed;
//   - connections get a thread each as they come, up to `max_workers` (then they queue), so a
//     request that waits (a pull) does not keep others from a thread;
//   - requests pipelined on one connection are answered in order (httplib 0.11 dropped the
//     bytes it had read past the first);
//   - the listening socket's backlog is the system's (httplib's is 5);
//   - with UseTls, connections speak TLS (1.2 or later), the handshake held to the deadline of
//     the first request's head.
#ifndef FERRY_SERVER_HTTP_SERVER_H_
#define FERRY_SERVER_HTTP_SERVER_H_

#include <httplib.h>

#include <atomic>
#include <cstddef>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"

struct ssl_ctx_st;

namespace ferry::server {

struct ConnectionLimits {
  absl::Duration head_timeout = absl::Seconds(10);
  absl::Duration slow_after = absl::Seconds(1);  // at most half head_timeout
  size_t min_rate = size_t{1} << 20;             // bytes per second
  size_t max_slow = 16;
  size_t max_workers = 256;
};

class HttpServer : public httplib::Server {
 public:
  explicit HttpServer(const ConnectionLimits& limits);

  // Binds to `host`:`port` (0: any free port) and listens; the port, or -1 where it cannot.
  int Bind(const std::string& host, int port);

  // Serves HTTPS with the certificate chain and private key in these PEM files. Before
  // listening. kInvalidArgument: a file cannot be read, or the key does not match.
  absl::Status UseTls(const std::string& cert_file, const std::string& key_file);
  bool tls() const { return tls_ != nullptr; }

  // Told of each connection closed for being slow, and why: "head" (its head came too late),
  // "rate" (a body or an answer fell behind min_rate), "slots" (max_slow were slow already).
  // Set before listening.
  std::function<void(const char* why)> on_slow_close;

 private:
  class Connection;
  bool process_and_close_socket(socket_t sock) override;

  const ConnectionLimits limits_;
  std::atomic<size_t> slow_{0};
  struct TlsContextFree {
    void operator()(ssl_ctx_st* ctx) const;
  };
  std::unique_ptr<ssl_ctx_st, TlsContextFree> tls_;
};

}  // namespace ferry::server

#endif  // FERRY_SERVER_HTTP_SERVER_H_
