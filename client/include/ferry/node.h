// ferry::EmbeddedNode: a ferry node inside this process. Register your own memory, publish
// layouts over it, pull objects from other nodes straight into it; its calls go to the node
// in process, not over HTTP. It also serves the HTTP API, so that other nodes and tools reach
// it. Thread-safe.
#ifndef FERRY_NODE_H_
#define FERRY_NODE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "ferry/layout.h"
#include "ferry/pull.h"
#include "ferry/types.h"

namespace ferry {

struct EmbeddedNodeOptions {
  std::string data_dir = "./ferry-data";  // the node's catalog. Default: ./ferry-data
  std::string provider = "tcp";           // auto, efa, verbs, tcp, shm. Default: tcp
  std::vector<std::string> domains;       // libfabric domains. Default: all
  size_t rails = 1;                       // Default: 1
  std::string listen = "127.0.0.1:0";     // HTTP, so others can pull. Default: any port
  // Bearer token of the HTTP API; node-to-node messages are sealed under a key derived from
  // it. Default: none.
  std::string token;
  // How it asks other nodes: auto, fabric or http. Default: auto.
  std::string peer_transport = "auto";
  // Write the catalog's log to disk at every change. Default: true.
  bool sync = true;
};

// A pull under way (EmbeddedNode::PullAsync). Thread-safe.
class PullFuture {
 public:
  virtual ~PullFuture() = default;
  // The pull's stats once it ends; kDeadlineExceeded when `deadline` passes first (the pull
  // goes on).
  virtual absl::StatusOr<PullStats> Wait(absl::Time deadline = absl::InfiniteFuture()) = 0;
  virtual bool Done() = 0;
  // Stops the pull: returns once no WRITE of it can land in this node's memory any more.
  virtual absl::StatusOr<PullStats> Cancel() = 0;
};

class EmbeddedNode {
 public:
  static absl::StatusOr<std::unique_ptr<EmbeddedNode>> Start(const EmbeddedNodeOptions& options);
  // Stops serving, waits for running pulls, closes the engine and the catalog.
  ~EmbeddedNode();

  std::string url() const;  // http://host:port it serves on
  const std::string& id() const;

  // The memory must stay valid until Unregister (or the node's end). Returns a region id.
  // kInvalidArgument: null or empty. kUnimplemented: GPU memory without CUDA in the build.
  absl::StatusOr<uint64_t> Register(void* addr, uint64_t size, Device device = Device::Host());
  // kNotFound: unknown region. kFailedPrecondition: an object or prepared destination uses it.
  absl::Status Unregister(uint64_t region);

  // `durable` false: kept in memory only (no fsync), gone at restart (KV pages). `meta`: JSON
  // text of at most kMaxMeta bytes kept with the version (a tensor table, say); empty: none.
  absl::StatusOr<ObjectInfo> Publish(const std::string& name, const Layout& layout,
                                     bool replace = false, bool durable = true,
                                     const std::string& meta = "");
  absl::StatusOr<ObjectInfo> Describe(const std::string& name);
  absl::Status Remove(const std::string& name);

  // A destination registered once (a pool of KV-cache page slots, say): later pulls name it
  // by handle and fill all its pieces, or those PullSpec::indices list. Release it to revoke
  // the sources' access to it.
  absl::StatusOr<uint64_t> PrepareDestination(const Layout& layout);
  absl::Status ReleaseDestination(uint64_t handle);

  // Pulls as `spec` says (ferry/pull.h). Codes: as ferry::Client::Pull.
  absl::StatusOr<PullStats> Pull(const PullSpec& spec);
  // Pulls `name` from the node at `from` into `into` (this node's registered memory).
  absl::StatusOr<PullStats> PullInto(const std::string& from, const std::string& name,
                                     const Layout& into);
  // Returns once the request is on its way (first contact with a node is made before).
  absl::StatusOr<std::unique_ptr<PullFuture>> PullAsync(const PullSpec& spec);
  // Pulls in one call, one message per source: each item's result, in order.
  std::vector<absl::StatusOr<PullStats>> PullBatch(const std::vector<PullSpec>& specs);

 private:
  struct Impl;
  explicit EmbeddedNode(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace ferry

#endif  // FERRY_NODE_H_
