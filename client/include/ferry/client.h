// The ferry client library: talk to a ferry node over HTTP, or embed a node in a program.
#ifndef FERRY_CLIENT_H_
#define FERRY_CLIENT_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "ferry/types.h"

namespace ferry {

struct ObjectInfo {
  std::string name;
  uint64_t version = 0;
  uint64_t size = 0;
  bool detached = false;
  std::vector<Extent> extents;
};

struct PullResult {
  uint64_t bytes = 0;
  double seconds = 0;     // on the wire, as the source measured it
  std::string path;       // "rdma"
  std::vector<uint64_t> bytes_per_rail;
};

// Called now and then during long transfers with bytes done and bytes in all (0 if unknown).
using Progress = std::function<void(uint64_t done, uint64_t total)>;

// A connection to one node's HTTP API. Thread-compatible: one Client per thread.
class Client {
 public:
  // `url` is http://host:port; `token` the bearer token (empty: none). Connects lazily.
  // kInvalidArgument: not an http:// URL.
  static absl::StatusOr<std::unique_ptr<Client>> Connect(const std::string& url,
                                                         const std::string& token = "");
  ~Client();

  // Errors carry the node's code (kNotFound, kAlreadyExists, ...); no answer at all is
  // kUnavailable, or kDeadlineExceeded on a timeout.
  absl::Status Health();
  // Uploads into a new buffer on `device` ("host" or "cuda:N").
  absl::StatusOr<ObjectInfo> Put(const std::string& name, std::string_view data,
                                 bool replace = false, const Progress& progress = nullptr,
                                 const std::string& device = "host");
  // Where the bytes of a Put come from when they are not in memory (a file): fills `out` with
  // the `n` bytes at `offset`, or says why it cannot.
  using Source = std::function<absl::Status(uint64_t offset, char* out, size_t n)>;
  // Uploads `size` bytes read from `source` in order, a few MiB at a time. An error of
  // `source` ends the upload: the node publishes nothing, and Put returns that error.
  absl::StatusOr<ObjectInfo> Put(const std::string& name, uint64_t size, const Source& source,
                                 bool replace = false, const Progress& progress = nullptr,
                                 const std::string& device = "host");
  absl::Status Get(const std::string& name, std::ostream& out,
                   std::optional<uint64_t> version = std::nullopt,
                   const Progress& progress = nullptr);
  absl::StatusOr<ObjectInfo> Stat(const std::string& name,
                                  std::optional<uint64_t> version = std::nullopt);
  absl::StatusOr<std::vector<ObjectInfo>> List(const std::string& prefix = "",
                                               size_t limit = 1000);
  // Every version of `name`, and the buffers the node allocated for it (Put, Pull into a
  // device) that no other object uses.
  absl::Status Remove(const std::string& name);
  // Publishes a layout over the node's regions (region ids as the node gave them).
  absl::StatusOr<ObjectInfo> Publish(const std::string& name, const std::vector<Extent>& layout,
                                     bool replace = false);
  // Asks this client's node to pull `name` from the node at `from` into a new buffer on
  // `device` and to publish it as `as` (default: the same name). `path`: auto, rdma,
  // cuda_ipc or staged.
  absl::StatusOr<PullResult> Pull(const std::string& name, const std::string& from,
                                  const std::string& as = "", bool replace = false,
                                  const std::string& device = "host",
                                  const std::string& path = "auto");

 private:
  struct Impl;
  explicit Client(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

struct EmbeddedNodeOptions {
  std::string data_dir = "./ferry-data";  // the node's catalog. Default: ./ferry-data
  std::string provider = "tcp";           // auto, efa, verbs, tcp, shm. Default: tcp
  std::vector<std::string> domains;       // libfabric domains. Default: all
  size_t rails = 1;                       // Default: 1
  std::string listen = "127.0.0.1:0";     // HTTP, so others can pull. Default: any port
  std::string token;                      // bearer token. Default: none
};

// A ferry node inside this process: register your own memory, publish layouts over it, pull
// objects from other nodes straight into it. Serves the HTTP API on `listen` so other nodes
// can pull from it. Thread-safe.
class EmbeddedNode {
 public:
  static absl::StatusOr<std::unique_ptr<EmbeddedNode>> Start(const EmbeddedNodeOptions& options);
  // Stops serving, waits for running pulls, closes the engine and the catalog.
  ~EmbeddedNode();

  std::string url() const;  // http://host:port it serves on
  const std::string& id() const;
  // The memory must stay valid until Unregister (or the node's end). Returns a region id.
  absl::StatusOr<uint64_t> Register(void* addr, uint64_t size);
  absl::Status Unregister(uint64_t region);
  absl::StatusOr<ObjectInfo> Publish(const std::string& name, const std::vector<Extent>& layout,
                                     bool replace = false);
  // Pulls `name` from the node at `from` into `into` (this node's registered memory).
  absl::StatusOr<PullResult> PullInto(const std::string& from, const std::string& name,
                                      const std::vector<Extent>& into);

 private:
  struct Impl;
  explicit EmbeddedNode(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace ferry

#endif  // FERRY_CLIENT_H_
