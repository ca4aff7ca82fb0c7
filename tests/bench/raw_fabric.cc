#include "tests/bench/raw_fabric.h"

#include <poll.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <iostream>

#include "absl/strings/str_cat.h"
#include "base/hex.h"
#include "base/status.h"
#include "engine/types.h"
#include "nlohmann/json.hpp"

namespace ferry::bench {

using engine::FiError;

absl::StatusOr<std::unique_ptr<RawEndpoint>> RawEndpoint::Open(const std::string& provider,
                                                               const std::string& domain) {
  ASSIGN_OR_RETURN(std::string filter, engine::ProviderFilter(provider));
  engine::InfoPtr hints(fi_allocinfo());
  hints->ep_attr->type = FI_EP_RDM;
  hints->caps = FI_RMA | FI_WRITE | FI_REMOTE_WRITE;
  hints->mode = FI_CONTEXT | FI_CONTEXT2;
  // Asked for so that one delivery completion can vouch for every earlier WRITE (WriteAll).
  hints->tx_attr->msg_order = FI_ORDER_RMA_WAW;
  hints->domain_attr->mr_mode =
      FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY | FI_MR_ENDPOINT;
  hints->domain_attr->threading = FI_THREAD_DOMAIN;
  hints->fabric_attr->prov_name = strdup(filter.c_str());
  hints->domain_attr->name = strdup(domain.c_str());
  fi_info* info = nullptr;
  // Not engine::GetInfo: the raw loop's target runs libfabric's own provider parameters.
  int rc = fi_getinfo(engine::kFiVersion, nullptr, nullptr, 0, hints.get(), &info);
  if (rc != 0) return FiError(rc, "fi_getinfo");
  std::unique_ptr<RawEndpoint> ep(new RawEndpoint());
  ep->info_.reset(info);
  fid_fabric* fabric;
  if ((rc = fi_fabric(info->fabric_attr, &fabric, nullptr))) return FiError(rc, "fi_fabric");
  ep->fabric_.reset(fabric);
  fid_domain* dom;
  if ((rc = fi_domain(fabric, info, &dom, nullptr))) return FiError(rc, "fi_domain");
  ep->domain_.reset(dom);
  fi_av_attr av_attr = {};
  fid_av* av;
  if ((rc = fi_av_open(dom, &av_attr, &av, nullptr))) return FiError(rc, "fi_av_open");
  ep->av_.reset(av);
  fi_cq_attr cq_attr = {};
  cq_attr.format = FI_CQ_FORMAT_CONTEXT;
  cq_attr.size = info->tx_attr->size;
  fid_cq* cq;
  if ((rc = fi_cq_open(dom, &cq_attr, &cq, nullptr))) return FiError(rc, "fi_cq_open");
  ep->cq_.reset(cq);
  fid_ep* e;
  if ((rc = fi_endpoint(dom, info, &e, nullptr))) return FiError(rc, "fi_endpoint");
  ep->ep_.reset(e);
  if ((rc = fi_ep_bind(e, &av->fid, 0))) return FiError(rc, "fi_ep_bind");
  if ((rc = fi_ep_bind(e, &cq->fid, FI_TRANSMIT | FI_RECV))) return FiError(rc, "fi_ep_bind");
  if ((rc = fi_enable(e))) return FiError(rc, "fi_enable");
  char name[256];
  size_t len = sizeof(name);
  if ((rc = fi_getname(&e->fid, name, &len))) return FiError(rc, "fi_getname");
  ep->address_.assign(name, len);
  return ep;
}

RawEndpoint::~RawEndpoint() { mr_.reset(); }  // MRs close before the endpoint

absl::Status RawEndpoint::Register(void* addr, size_t length) {
  fid_mr* mr;
  int rc = fi_mr_reg(domain_.get(), addr, length,
                     FI_WRITE | FI_REMOTE_WRITE | FI_READ | FI_REMOTE_READ, 0, 1, 0, &mr, nullptr);
  if (rc) return FiError(rc, "fi_mr_reg");
  mr_.reset(mr);
  if (info_->domain_attr->mr_mode & FI_MR_ENDPOINT) {
    if ((rc = fi_mr_bind(mr, &ep_->fid, 0))) return FiError(rc, "fi_mr_bind");
    if ((rc = fi_mr_enable(mr))) return FiError(rc, "fi_mr_enable");
  }
  region_ = static_cast<char*>(addr);
  return absl::OkStatus();
}

uint64_t RawEndpoint::key() const { return fi_mr_key(mr_.get()); }

uint64_t RawEndpoint::base() const {
  return (info_->domain_attr->mr_mode & FI_MR_VIRT_ADDR) ? reinterpret_cast<uintptr_t>(region_) : 0;
}

absl::StatusOr<uint64_t> RawEndpoint::Insert(const std::string& address) {
  char buf[512] = {};
  memcpy(buf, address.data(), std::min(address.size(), sizeof(buf) - 1));
  fi_addr_t fa;
  int n = fi_av_insert(av_.get(), buf, 1, &fa, 0, nullptr);
  if (n != 1) return FiError(n < 0 ? n : -FI_EINVAL, "fi_av_insert");
  return fa;
}

void RawEndpoint::Progress() {
  fi_cq_entry entries[64];
  if (fi_cq_read(cq_.get(), entries, 64) == -FI_EAVAIL) {
    fi_cq_err_entry err = {};
    fi_cq_readerr(cq_.get(), &err, 0);
  }
}

absl::Status RawEndpoint::WriteAll(uint64_t peer, uint64_t remote_base, uint64_t remote_key,
                                   const std::vector<engine::PlannedWrite>& writes, size_t window) {
  window = std::min(window, info_->tx_attr->size);
  void* desc = fi_mr_desc(mr_.get());
  size_t next = 0, done = 0, in_flight = 0;
  fi_cq_entry entries[64];
  // The clock must stop when the bytes have landed, as the engine's does: a WRITE's plain
  // completion only says its source buffer is free (on tcp: the bytes are in the socket).
  // On a rail that keeps WRITEs in order the last one asks for delivery completion and
  // vouches for the rest; elsewhere every WRITE does.
  const bool ordered = (info_->tx_attr->msg_order & FI_ORDER_RMA_WAW) != 0;
  const uint64_t order_max = info_->ep_attr->max_order_waw_size;
  while (done < writes.size()) {
    while (next < writes.size() && in_flight < window) {
      const engine::PlannedWrite& w = writes[next];
      ssize_t rc;
      if (next + 1 == writes.size() || !ordered || w.length > order_max) {
        iovec iov = {region_ + w.src_offset, w.length};
        fi_rma_iov rma = {remote_base + w.dst_offset, w.length, remote_key};
        fi_msg_rma msg = {};
        msg.msg_iov = &iov;
        msg.desc = &desc;
        msg.iov_count = 1;
        msg.addr = peer;
        msg.rma_iov = &rma;
        msg.rma_iov_count = 1;
        rc = fi_writemsg(ep_.get(), &msg, FI_COMPLETION | FI_DELIVERY_COMPLETE);
      } else {
        rc = fi_write(ep_.get(), region_ + w.src_offset, w.length, desc, peer,
                      remote_base + w.dst_offset, remote_key, nullptr);
      }
      if (rc == -FI_EAGAIN) break;
      if (rc) return FiError(rc, "fi_write");
      ++next;
      ++in_flight;
    }
    ssize_t n = fi_cq_read(cq_.get(), entries, 64);
    if (n > 0) {
      done += static_cast<size_t>(n);
      in_flight -= static_cast<size_t>(n);
    } else if (n == -FI_EAVAIL) {
      fi_cq_err_entry err = {};
      fi_cq_readerr(cq_.get(), &err, 0);
      return FiError(err.err, "raw write completion");
    }
  }
  return absl::OkStatus();
}

int RunRawPeer(const std::string& provider, const std::string& domain, uint64_t size) {
  auto ep = RawEndpoint::Open(provider, domain);
  if (!ep.ok()) {
    std::cout << nlohmann::json{{"error", ep.status().ToString()}}.dump() << std::endl;
    return 1;
  }
  void* buf = engine::AllocateHostMemory(size);
  absl::Status s = (*ep)->Register(buf, size);
  if (!s.ok()) {
    std::cout << nlohmann::json{{"error", s.ToString()}}.dump() << std::endl;
    return 1;
  }
  std::cout << nlohmann::json{{"address", HexEncode((*ep)->address())},
                              {"key", (*ep)->key()},
                              {"base", (*ep)->base()}}
                   .dump()
            << std::endl;
  // Between runs, block on stdin. On "run", spin on the CQ (manual progress: WRITEs land
  // only while the target calls in) until the next line, then answer; "exit" ends.
  std::string line;
  while (std::getline(std::cin, line) && (line == "run" || line == "pause")) {
    std::cout << "{}" << std::endl;
    for (uint64_t i = 0; line == "run"; ++i) {
      (*ep)->Progress();
      if (i % 1024 == 0) {
        pollfd pfd = {0, POLLIN, 0};
        if (poll(&pfd, 1, 0) > 0) break;
      }
    }
  }
  ep->reset();
  engine::FreeHostMemory(buf, size);
  return 0;
}

}  // namespace ferry::bench
