#include "engine/rail.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "base/ids.h"
#include "base/status.h"
#include "engine/cuda.h"
#include "engine/types.h"

namespace ferry::engine {
namespace {

// Deleter order matters: the member order in Rail is the open order.
absl::Status Check(int rc, std::string_view call) {
  return rc == 0 ? absl::OkStatus() : FiError(rc, call);
}

// The attributes of a registration of `iov` on `device` (RegisterDmabuf replaces the iov).
fi_mr_attr MrAttr(const iovec* iov, uint64_t access, uint64_t requested_key, Device device) {
  fi_mr_attr attr = {};
  attr.mr_iov = iov;
  attr.iov_count = 1;
  attr.access = access;
  attr.requested_key = requested_key;
  attr.iface = FI_HMEM_SYSTEM;
  if (device.kind == Device::Kind::kCuda) {
    attr.iface = FI_HMEM_CUDA;
    attr.device.cuda = device.index;
  }
  return attr;
}

}  // namespace

int RemoveShmLeftovers(pid_t pid) {
  const std::string prefix = absl::StrCat(kShmNamePrefix, pid, "-");
  std::error_code ec;
  int removed = 0;
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm", ec)) {
    if (entry.path().filename().string().starts_with(prefix) &&
        std::filesystem::remove(entry.path(), ec)) {
      ++removed;
    }
  }
  return removed;
}

uint64_t RandomMrKey() { return RandomU64(); }

absl::StatusOr<std::unique_ptr<Rail>> Rail::Open(const fi_info& info, size_t tx_depth, bool wait_fd,
                                                 bool dmabuf) {
  std::unique_ptr<Rail> rail(new Rail());
  rail->info_.reset(fi_dupinfo(&info));
  if (!rail->info_) return absl::ResourceExhaustedError("fi_dupinfo failed");
  fi_info* fi = rail->info_.get();
  if (fi->domain_attr->mr_mode & FI_MR_RAW) {
    return absl::UnimplementedError(
        absl::StrCat(fi->fabric_attr->prov_name, " wants FI_MR_RAW keys, which ferry lacks"));
  }

  fid_fabric* fabric = nullptr;
  RETURN_IF_ERROR(Check(fi_fabric(fi->fabric_attr, &fabric, nullptr), "fi_fabric"));
  rail->fabric_.reset(fabric);

  fid_domain* domain = nullptr;
  RETURN_IF_ERROR(Check(fi_domain(fabric, fi, &domain, nullptr), "fi_domain"));
  rail->domain_.reset(domain);

  fi_av_attr av_attr = {};
  av_attr.type = fi->domain_attr->av_type;
  fid_av* av = nullptr;
  RETURN_IF_ERROR(Check(fi_av_open(domain, &av_attr, &av, nullptr), "fi_av_open"));
  rail->av_.reset(av);

  // The CQ holds a completion for every WRITE and SEND in flight and every posted receive.
  fi_cq_attr cq_attr = {};
  cq_attr.format = FI_CQ_FORMAT_DATA;
  cq_attr.size = std::max<size_t>(fi->tx_attr->size + fi->rx_attr->size, 1024);
  cq_attr.wait_obj = wait_fd ? FI_WAIT_FD : FI_WAIT_NONE;
  fid_cq* cq = nullptr;
  int rc = fi_cq_open(domain, &cq_attr, &cq, nullptr);
  if (wait_fd && (rc == -FI_ENOSYS || rc == -FI_EINVAL || rc == -FI_EOPNOTSUPP)) {
    // No fd to block on (shm here): the progress thread falls back to timed polls.
    cq_attr.wait_obj = FI_WAIT_NONE;
    rc = fi_cq_open(domain, &cq_attr, &cq, nullptr);
  }
  RETURN_IF_ERROR(Check(rc, "fi_cq_open"));
  rail->cq_.reset(cq);
  if (cq_attr.wait_obj == FI_WAIT_FD) {
    RETURN_IF_ERROR(
        Check(fi_control(&cq->fid, FI_GETWAIT, &rail->wait_fd_), "fi_control(GETWAIT)"));
  }

  fid_ep* ep = nullptr;
  RETURN_IF_ERROR(Check(fi_endpoint(domain, fi, &ep, nullptr), "fi_endpoint"));
  rail->ep_.reset(ep);
  RETURN_IF_ERROR(Check(fi_ep_bind(ep, &av->fid, 0), "fi_ep_bind(av)"));
  RETURN_IF_ERROR(Check(fi_ep_bind(ep, &cq->fid, FI_TRANSMIT | FI_RECV), "fi_ep_bind(cq)"));
  if (std::strcmp(fi->fabric_attr->prov_name, "shm") == 0) {
    // shm names its region "pid:uid:index" by default. A process killed earlier leaves its
    // region behind, and when its pid comes round again fi_enable fails with EBUSY. A random
    // part makes the name unique; the pid stays in it so that whoever killed the process
    // can find what it left (RemoveShmLeftovers).
    const std::string shm_name = absl::StrCat(kShmNamePrefix, getpid(), "-", RandomId());
    RETURN_IF_ERROR(
        Check(fi_setname(&ep->fid, const_cast<char*>(shm_name.c_str()), shm_name.size() + 1),
              "fi_setname"));
  }
  RETURN_IF_ERROR(Check(fi_enable(ep), "fi_enable"));

  char name[256];
  size_t name_len = sizeof(name);
  RETURN_IF_ERROR(Check(fi_getname(&ep->fid, name, &name_len), "fi_getname"));

  RailInfo& ri = rail->rail_info_;
  ri.provider = fi->fabric_attr->prov_name;
  ri.fabric = fi->fabric_attr->name ? fi->fabric_attr->name : "";
  ri.domain = fi->domain_attr->name ? fi->domain_attr->name : "";
  ri.address.assign(name, name_len);
  ri.max_msg_size = fi->ep_attr->max_msg_size;
  ri.tx_depth = tx_depth == 0 ? fi->tx_attr->size : std::min(tx_depth, fi->tx_attr->size);
  ri.inject_size = fi->tx_attr->inject_size;
  ri.iov_limit = std::max<size_t>(1, std::min(fi->tx_attr->iov_limit, fi->tx_attr->rma_iov_limit));
  ri.mr_mode = static_cast<uint64_t>(fi->domain_attr->mr_mode);
  ri.cq_data_size = fi->domain_attr->cq_data_size;
  ri.delivery_complete = (fi->tx_attr->op_flags & FI_DELIVERY_COMPLETE) != 0;
  ri.ordered_writes = (fi->tx_attr->msg_order & FI_ORDER_RMA_WAW) != 0;
  ri.max_order_waw_size = fi->ep_attr->max_order_waw_size;
  rail->ProbeCuda(dmabuf);
  return rail;
}

absl::StatusOr<fi_addr_t> Rail::Insert(const std::string& address) {
  // fi_av_insert reads the provider's address length (fixed for tcp, a NUL-terminated string
  // for shm): it gets a zero-padded copy, so a short address cannot over-read.
  char addr[2 * kMaxAddress] = {};
  memcpy(addr, address.data(), std::min(address.size(), kMaxAddress));
  fi_addr_t fa = FI_ADDR_NOTAVAIL;
  const int n = fi_av_insert(av_.get(), addr, 1, &fa, 0, nullptr);
  if (n != 1) return FiError(n < 0 ? n : -FI_EINVAL, "fi_av_insert");
  return fa;
}

absl::StatusOr<RailMr> Rail::Register(void* addr, size_t length, uint64_t requested_key,
                                      uint64_t access, Device device) {
  const int mr_mode = info_->domain_attr->mr_mode;
  const iovec iov = {addr, length};
  fi_mr_attr attr = MrAttr(&iov, access, requested_key, device);
  fid_mr* mr = nullptr;
  int rc = -FI_ENOSYS;
  if (device.kind == Device::Kind::kCuda && rail_info_.hmem_dmabuf) {
    rc = RegisterDmabuf(attr, addr, length, &mr);
  }
  if (rc != 0) rc = fi_mr_regattr(domain_.get(), &attr, 0, &mr);
  if (rc != 0) {
    absl::Status s = FiError(rc, "fi_mr_regattr");
    if (s.code() == absl::StatusCode::kInternal) return absl::ResourceExhaustedError(s.message());
    return s;
  }
  RailMr out;
  out.mr.reset(mr);
  if (mr_mode & FI_MR_ENDPOINT) {
    RETURN_IF_ERROR(Check(fi_mr_bind(mr, &ep_->fid, 0), "fi_mr_bind"));
    RETURN_IF_ERROR(Check(fi_mr_enable(mr), "fi_mr_enable"));
  }
  out.key = fi_mr_key(mr);
  if (out.key == FI_KEY_NOTAVAIL) {
    // libfabric 2.x gives no key to a registration for local access only: none is needed.
    if ((access & (FI_REMOTE_READ | FI_REMOTE_WRITE)) == 0) {
      out.key = 0;
    } else {
      return absl::UnimplementedError("fi_mr_key: key not available");
    }
  }
  out.desc = fi_mr_desc(mr);
  return out;
}

int Rail::RegisterDmabuf(fi_mr_attr attr, void* addr, size_t length, fid_mr** mr) {
#ifdef FI_MR_DMABUF
  auto buf = CudaExportDmabuf(addr, length);
  if (!buf.ok()) return -FI_ENOSYS;
  fi_mr_dmabuf dmabuf = {};
  dmabuf.fd = buf->fd;
  dmabuf.offset = static_cast<uint64_t>(static_cast<char*>(addr) - static_cast<char*>(buf->base));
  dmabuf.len = length;
  dmabuf.base_addr = buf->base;
  attr.dmabuf = &dmabuf;
  const int rc = fi_mr_regattr(domain_.get(), &attr, FI_MR_DMABUF, mr);
  close(buf->fd);  // a provider that imports the dma-buf holds its own reference
  return rc;
#else
  (void)attr, (void)addr, (void)length, (void)mr;
  return -FI_ENOSYS;
#endif
}

void Rail::ProbeCuda(bool dmabuf) {
  RailInfo& ri = rail_info_;
  if (CudaDeviceCount() == 0) {
    ri.hmem_cuda_error = CudaBuilt() ? "no GPU" : "built without CUDA";
    return;
  }
  // A provider may register GPU memory on an endpoint opened without FI_HMEM and then move it
  // as host memory (libfabric 2.6's shm: process_vm_writev, EFAULT): without the capability
  // the rail does not carry GPU memory, whatever the registration says.
  if ((info_->caps & FI_HMEM) == 0) {
    ri.hmem_cuda_error = "the provider gave this endpoint no FI_HMEM capability";
    return;
  }
  constexpr size_t kProbeBytes = 64 << 10;
  auto buf = CudaAlloc(0, kProbeBytes);
  if (!buf.ok()) {
    ri.hmem_cuda_error = std::string(buf.status().message());
    return;
  }
  fid_mr* probe = nullptr;
  const iovec iov = {*buf, kProbeBytes};
  const fi_mr_attr attr = MrAttr(&iov, FI_WRITE | FI_REMOTE_WRITE, RandomMrKey(), Device::Cuda(0));
  // Only where the provider addresses registered memory by virtual address: libfabric 2.6's
  // util MR map (shm, tcp) keeps a wrong offset for a dma-buf otherwise, and WRITEs into it
  // land elsewhere (docs/benchmarks.md). Those providers turn a dma-buf back into its address
  // anyway; what needs one is a NIC that imports it (EFA).
  ri.hmem_dmabuf = dmabuf && (info_->domain_attr->mr_mode & FI_MR_VIRT_ADDR) != 0 &&
                   RegisterDmabuf(attr, *buf, kProbeBytes, &probe) == 0;
  if (probe != nullptr) CloseFid(&probe->fid, "fi_close(mr)");
  auto mr = Register(*buf, kProbeBytes, RandomMrKey(), FI_WRITE | FI_REMOTE_WRITE, Device::Cuda(0));
  ri.hmem_cuda = mr.ok();
  if (!ri.hmem_cuda) ri.hmem_dmabuf = false;
  if (!mr.ok()) ri.hmem_cuda_error = std::string(mr.status().message());
  if (mr.ok()) mr->mr.reset();
  CudaFree(*buf);
}

}  // namespace ferry::engine
