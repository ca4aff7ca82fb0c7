// One rail: fabric, domain, AV, CQ and FI_EP_RDM endpoint opened from one fi_info. Owned and
// used by exactly one progress thread (FI_THREAD_DOMAIN); not thread-safe.
#ifndef FERRY_ENGINE_RAIL_H_
#define FERRY_ENGINE_RAIL_H_

#include <sys/types.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "engine/engine.h"
#include "engine/fabric.h"

namespace ferry::engine {

// A registered memory region on one rail.
struct RailMr {
  FidPtr<fid_mr> mr;
  uint64_t key = 0;
  void* desc = nullptr;  // fi_mr_desc; what FI_MR_LOCAL providers need for local buffers
};

// shm endpoints are named kShmNamePrefix + pid + "-" + random hex, one file each in /dev/shm.
inline constexpr char kShmNamePrefix[] = "ferry-shm-";

// Removes the shm files a process left behind when it was killed (a clean exit removes its
// own). Call it only once `pid` has been reaped. Returns how many were removed.
int RemoveShmLeftovers(pid_t pid);

// The longest endpoint name ferry accepts from a peer (fi_getname's for every provider here is
// far shorter).
inline constexpr size_t kMaxAddress = 256;

// A key to request for an MR (providers without FI_MR_PROV_KEY use it): random, so unique in
// the domain (but by a 2^-64 chance) and not guessed by a peer.
uint64_t RandomMrKey();

class Rail {
 public:
  // Opens every object in dependency order; what was opened closes itself on failure.
  // `tx_depth` 0 means the provider's tx size.
  // `dmabuf`: GPU memory may be registered as dma-bufs (EngineOptions::hmem_dmabuf).
  static absl::StatusOr<std::unique_ptr<Rail>> Open(const fi_info& info, size_t tx_depth,
                                                    bool wait_fd, bool dmabuf = true);
  // The endpoint closes first, then CQ, AV, domain and fabric (fi_endpoint(3), fi_domain(3)).
  ~Rail() = default;
  Rail(const Rail&) = delete;
  Rail& operator=(const Rail&) = delete;

  // Registers [addr, addr + length) with `access` (fi_mr(3): FI_WRITE | FI_SEND | FI_RECV
  // for local WRITE sources and messages, FI_REMOTE_WRITE for what peers WRITE into; nothing
  // is ever remotely readable). Without FI_MR_PROV_KEY the requested key must be unique in the
  // domain (fi_mr(3)): the caller passes a random one. Device memory goes with FI_HMEM_CUDA,
  // which only a CUDA-enabled libfabric accepts: as a dma-buf where the probe found that
  // works (rail_info().hmem_dmabuf), else by address.
  absl::StatusOr<RailMr> Register(void* addr, size_t length, uint64_t requested_key,
                                  uint64_t access, Device device = Device::Host());

  // Puts a peer's endpoint name (at most kMaxAddress bytes) in the AV.
  absl::StatusOr<fi_addr_t> Insert(const std::string& address);

  fid_fabric* fabric() const { return fabric_.get(); }
  fid_ep* ep() const { return ep_.get(); }
  fid_cq* cq() const { return cq_.get(); }
  fid_av* av() const { return av_.get(); }
  const fi_info& info() const { return *info_; }
  const RailInfo& rail_info() const { return rail_info_; }
  // The CQ's wait fd for epoll, or -1 when the provider has no FI_WAIT_FD (shm here).
  int wait_fd() const { return wait_fd_; }

 private:
  Rail() = default;
  // Sets rail_info_.hmem_cuda and hmem_dmabuf by registering a small GPU buffer (when there
  // is a GPU).
  void ProbeCuda(bool dmabuf);
  // fi_mr_regattr of GPU memory as a dma-buf: a libfabric error code, or -FI_ENOSYS where
  // this libfabric or the driver has none.
  int RegisterDmabuf(fi_mr_attr attr, void* addr, size_t length, fid_mr** mr);

  InfoPtr info_;
  FidPtr<fid_fabric> fabric_;
  FidPtr<fid_domain> domain_;
  FidPtr<fid_av> av_;
  FidPtr<fid_cq> cq_;
  FidPtr<fid_ep> ep_;
  RailInfo rail_info_;
  int wait_fd_ = -1;
};

}  // namespace ferry::engine

#endif  // FERRY_ENGINE_RAIL_H_
