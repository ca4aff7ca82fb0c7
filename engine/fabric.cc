#include "engine/fabric.h"

#include <cerrno>
#include <cstdlib>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"

namespace ferry::engine {

void CloseFid(fid_t fid, const char* what) {
  int rc = fi_close(fid);
  if (rc != 0) spdlog::warn("fi_close({}) failed: {}", what, fi_strerror(-rc));
}

absl::Status FiError(ssize_t rc, std::string_view call) {
  const int err = static_cast<int>(rc < 0 ? -rc : rc);
  std::string msg = absl::StrCat(std::string(call), ": ", fi_strerror(err), " (", err, ")");
  switch (err) {
    case FI_EAGAIN:
    case FI_ECONNREFUSED:
    case FI_ECONNRESET:
    case FI_ECONNABORTED:
    case FI_EHOSTUNREACH:
    case FI_EHOSTDOWN:
    case FI_ENETUNREACH:
    case FI_ENETDOWN:
    case EPIPE:
    case FI_ENOTCONN:
    case FI_ESHUTDOWN:
      return absl::UnavailableError(msg);
    case FI_ENOMEM:
    case FI_ENOSPC:
      return absl::ResourceExhaustedError(msg);
    case FI_ENOSYS:
    case FI_EOPNOTSUPP:
      return absl::UnimplementedError(msg);
    case FI_ENODATA:
    case FI_ENOENT:
      return absl::NotFoundError(msg);
    case FI_EINVAL:
    case FI_EMSGSIZE:
      return absl::InvalidArgumentError(msg);
    case FI_ETIMEDOUT:
      return absl::DeadlineExceededError(msg);
    case FI_ECANCELED:
      return absl::CancelledError(msg);
    default:
      return absl::InternalError(msg);
  }
}

absl::StatusOr<std::string> ProviderFilter(std::string_view provider) {
  if (provider == "tcp") return std::string("tcp;ofi_rxm");
  if (provider == "verbs") return std::string("verbs;ofi_rxm");
  if (provider == "efa" || provider == "shm") return std::string(provider);
  if (provider == "auto") return std::string();
  return absl::InvalidArgumentError(absl::StrCat("unknown provider '", std::string(provider),
                                                 "': want auto, efa, verbs, tcp or shm"));
}

std::string LibfabricVersion() {
  const uint32_t v = fi_version();
  return absl::StrCat(FI_MAJOR(v), ".", FI_MINOR(v));
}

void SetProviderDefaults() {
  // rxm (the RDM layer over tcp) sizes its receive pools for messaging: 1024 buffers per
  // endpoint and as many per connection, about 70 MB per rail, touched when a rail opens and
  // at first contact (2.2 GB, and seconds, for 32 rails on the 2-vCPU test machine). A rail
  // receives only control messages and immediates: 128 are plenty.
  // tcp reads each message header with a recv of up to 9000 bytes into a prefetch buffer; a
  // WRITE into several destination pieces that finds part of its data there goes back to the
  // progress loop before reading the rest (libfabric 1.17, ofi_bsock_recvv): one more pass over
  // every rail per gathered WRITE. Without the buffer every read goes to the socket.
  // libfabric reads its parameters once, at the first fi_getinfo; a value in the environment
  // wins.
  static std::once_flag once;
  std::call_once(once, [] {
    setenv("FI_OFI_RXM_RX_SIZE", "128", 0);
    setenv("FI_OFI_RXM_MSG_RX_SIZE", "128", 0);
    setenv("FI_TCP_PREFETCH_RBUF_SIZE", "0", 0);
  });
}

int GetInfo(const fi_info* hints, fi_info** out) {
  SetProviderDefaults();
  return fi_getinfo(kFiVersion, nullptr, nullptr, 0, hints, out);
}

bool ProviderAvailable(std::string_view provider) {
  auto filter = ProviderFilter(provider);
  if (!filter.ok()) return false;
  InfoPtr hints(fi_allocinfo());
  hints->ep_attr->type = FI_EP_RDM;
  hints->caps = FI_MSG | FI_RMA;
  if (!filter->empty()) hints->fabric_attr->prov_name = strdup(filter->c_str());
  fi_info* info = nullptr;
  int rc = GetInfo(hints.get(), &info);
  InfoPtr owned(info);
  return rc == 0 && info != nullptr;
}

}  // namespace ferry::engine
