// ferry::Client: a node's HTTP API from a program (docs/http_api.md). Links neither RocksDB nor
// libfabric. Thread-compatible: one Client per thread (each keeps its connection alive).
#ifndef FERRY_CLIENT_H_
#define FERRY_CLIENT_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "ferry/layout.h"
#include "ferry/pull.h"
#include "ferry/types.h"

namespace ferry {

// A node as the cluster's directory shows it (GET /v1/cluster).
struct ClusterNode {
  std::string id;
  std::string url;
  std::string host;
  std::string state;  // "ready", ...
  std::map<std::string, std::string> labels;
  struct Held {
    std::string name;
    uint64_t version = 0;
    uint64_t size = 0;
  };
  std::vector<Held> objects;
};

// Called now and then during long transfers with bytes done and bytes in all (0 if unknown).
using Progress = std::function<void(uint64_t done, uint64_t total)>;

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
  // Drains the node (POST /v1/drain): it refuses new pulls and uploads, finishes the running
  // pulls, then stops (ferryd exits).
  absl::Status Drain();
  // Uploads into a new buffer on `device` ("host" or "cuda:N"), with `meta` (JSON text, at
  // most kMaxMeta bytes; empty: none) attached to the version.
  absl::StatusOr<ObjectInfo> Put(const std::string& name, std::string_view data,
                                 bool replace = false, const Progress& progress = nullptr,
                                 const std::string& device = "host", const std::string& meta = "");
  // Where the bytes of a Put come from when they are not in memory (a file): fills `out` with
  // the `n` bytes at `offset`, or says why it cannot.
  using Source = std::function<absl::Status(uint64_t offset, char* out, size_t n)>;
  // Uploads `size` bytes read from `source` in order, a few MiB at a time. An error of
  // `source` ends the upload: the node publishes nothing, and Put returns that error.
  absl::StatusOr<ObjectInfo> Put(const std::string& name, uint64_t size, const Source& source,
                                 bool replace = false, const Progress& progress = nullptr,
                                 const std::string& device = "host", const std::string& meta = "");
  // The object's bytes into `out`. kDataLoss: they do not match the CRC32C the node has for them
  // (an uploaded object), or `out` failed.
  absl::Status Get(const std::string& name, std::ostream& out,
                   std::optional<uint64_t> version = std::nullopt,
                   const Progress& progress = nullptr);
  // `with_extents` false: without the layout (a shorter answer for a big one).
  absl::StatusOr<ObjectInfo> Stat(const std::string& name,
                                  std::optional<uint64_t> version = std::nullopt,
                                  bool with_extents = true);
  absl::StatusOr<std::vector<ObjectInfo>> List(const std::string& prefix = "", size_t limit = 1000);
  // Every version of `name`, and the buffers the node allocated for it (Put, Pull into a
  // device) that no other object uses.
  absl::Status Remove(const std::string& name);
  // Publishes a layout over the node's regions (region ids as the node gave them).
  absl::StatusOr<ObjectInfo> Publish(const std::string& name, const Layout& layout,
                                     bool replace = false, bool durable = true,
                                     const std::string& meta = "");
  // Asks this client's node to pull: as Node::Pull (node.h), over POST /v1/pulls.
  absl::StatusOr<PullStats> Pull(const PullSpec& spec);
  // Pulls `name` from the node at `from` into a new buffer on `device`, published as `as`
  // (default: the same name). `path`: auto, rdma, cuda_ipc or staged.
  absl::StatusOr<PullStats> Pull(const std::string& name, const std::string& from,
                                 const std::string& as = "", bool replace = false,
                                 const std::string& device = "host",
                                 const std::string& path = "auto");
  // Several pulls in one request: each item's result, in order.
  absl::StatusOr<std::vector<absl::StatusOr<PullStats>>> PullBatch(
      const std::vector<PullSpec>& specs);
  // The nodes of the node's directory and what they hold. kFailedPrecondition: the node has
  // no directory; kUnavailable: the directory cannot be reached.
  absl::StatusOr<std::vector<ClusterNode>> Cluster();
  // Asks this client's node to deliver an object version it holds to many nodes at once: as
  // Node::Distribute (node.h), over POST /v1/distribute. Each receiver's outcome is in the
  // result; the call itself fails only when the distribution could not start.
  absl::StatusOr<DistributeResult> Distribute(const DistributeSpec& spec);

 private:
  struct Impl;
  explicit Client(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace ferry

#endif  // FERRY_CLIENT_H_
