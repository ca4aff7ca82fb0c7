// The HTTP API v1 on a cpp-httplib server, over a Node. Routes, bodies and codes: docs/http_api.md.
#ifndef FERRY_SERVER_HTTP_API_H_
#define FERRY_SERVER_HTTP_API_H_

#include <functional>
#include <string>

#include "cluster/directory_store.h"
#include "server/http_server.h"
#include "server/node.h"

namespace httplib {
class Server;
}

namespace ferry::server {

struct HttpOptions {
  // Bearer token every route but /v1/health requires. Default: empty (no auth).
  std::string token;
  // GET /metrics answers without the token. Default: false.
  bool metrics_public = false;
  // Called by POST /v1/drain once the node drains (ferryd: to stop once the pulls are done).
  // Default: none.
  std::function<void()> on_drain;
  // Largest request body. Default: 1 GiB.
  size_t max_body = size_t{1} << 30;
  // A directory this server answers for other nodes (ferryd --serve-directory), on etcd's
  // JSON gateway routes (POST /v3/...), behind the token. Default: none.
  cluster::DirectoryStore* directory = nullptr;
};

// Installs every route on `server`, and counts its slow connections in the node's metrics;
// `node` must outlive it. Binding after it sets the server's sockets up too
// (SetSocketOptions).
void InstallRoutes(HttpServer& server, Node& node, const HttpOptions& options);

// The options of the sockets `server` binds from now on: SO_REUSEADDR, and TCP_NODELAY, which
// accepted connections inherit (httplib 0.11's set_tcp_nodelay sets it on no server socket:
// without it the body of an answer on a kept connection can wait for the client's delayed
// ACK).
void SetSocketOptions(httplib::Server& server);

// The status page GET / serves: one HTML page that reads the JSON API.
const char* StatusPage();

// Stops `server`, whose listen_after_bind() has been or is being called on another thread.
// httplib's stop() does nothing before that loop runs, so this first waits (bounded: the
// thread only enters its loop) until it does.
void StopOnceRunning(httplib::Server& server);

}  // namespace ferry::server

#endif  // FERRY_SERVER_HTTP_API_H_
