// Thin RAII and error helpers around libfabric objects. Used only by progress threads and by
// the code that opens rails on them.
#ifndef FERRY_ENGINE_FABRIC_H_
#define FERRY_ENGINE_FABRIC_H_

#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace ferry::engine {

// The libfabric API version ferry asks for: 1.17 (Debian 12's), or 1.20 where the headers
// have dma-buf registration (FI_MR_DMABUF), which providers honour only from 1.20.
#ifdef FI_MR_DMABUF
inline constexpr uint32_t kFiVersion = FI_VERSION(1, 20);
#else
inline constexpr uint32_t kFiVersion = FI_VERSION(1, 17);
#endif

// Sets ferry's defaults for the provider parameters the user has not set in the environment
// (FI_OFI_RXM_RX_SIZE, FI_OFI_RXM_MSG_RX_SIZE: 128; FI_TCP_PREFETCH_RBUF_SIZE: 0). They take
// effect only before the process's first fi_getinfo. Idempotent.
void SetProviderDefaults();

// The version of the libfabric this process runs with ("1.17"), which may be newer than the
// one it was built against.
std::string LibfabricVersion();

// fi_getinfo at kFiVersion, after SetProviderDefaults. Every fi_getinfo of ferry goes through it.
int GetInfo(const fi_info* hints, fi_info** out);

// Closes any fid-based object; logs a non-zero rc (a close has no caller that could act on it).
void CloseFid(fid_t fid, const char* what);

template <typename T>
struct FidCloser {
  void operator()(T* p) const { CloseFid(&p->fid, __PRETTY_FUNCTION__); }
};
template <typename T>
using FidPtr = std::unique_ptr<T, FidCloser<T>>;

struct InfoDeleter {
  void operator()(fi_info* p) const { fi_freeinfo(p); }
};
using InfoPtr = std::unique_ptr<fi_info, InfoDeleter>;

// Converts a negative libfabric return code into a Status, with the call's name as context.
// -FI_EAGAIN -> kUnavailable, -FI_ENOMEM -> kResourceExhausted, -FI_ENOSYS / -FI_EOPNOTSUPP ->
// kUnimplemented, -FI_ENODATA -> kNotFound, -FI_EINVAL -> kInvalidArgument, -FI_ETIMEDOUT ->
// kDeadlineExceeded, -FI_ECONNREFUSED, -FI_ENETUNREACH and the like -> kUnavailable, else
// kInternal.
absl::Status FiError(ssize_t rc, std::string_view call);

// Maps the user-facing provider names onto libfabric's: "tcp" -> "tcp;ofi_rxm",
// "verbs" -> "verbs;ofi_rxm", "efa" and "shm" as they are, "auto" -> "" (any). Unknown names
// give kInvalidArgument.
absl::StatusOr<std::string> ProviderFilter(std::string_view provider);

// True when libfabric lists an FI_EP_RDM endpoint with RMA for `provider` (a user-facing name).
bool ProviderAvailable(std::string_view provider);

}  // namespace ferry::engine

#endif  // FERRY_ENGINE_FABRIC_H_
