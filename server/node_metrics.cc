// Node::Metrics: what /metrics shows.
#include <map>
#include <string>

#include "absl/strings/str_cat.h"
#include "base/version.h"
#include "engine/cuda.h"
#include "engine/fabric.h"
#include "server/node.h"

#ifndef FERRY_COMMIT
#define FERRY_COMMIT "unknown"
#endif

namespace ferry::server {
namespace {

// Objects and bytes of one kind of memory.
struct Usage {
  uint64_t count = 0;
  uint64_t bytes = 0;
};

void WriteUsage(MetricsText& out, std::string_view count_name, std::string_view count_help,
                std::string_view bytes_name, std::string_view bytes_help,
                const std::map<std::string, Usage>& by_device) {
  out.Family(count_name, "gauge", count_help);
  for (const auto& [device, u] : by_device) {
    out.Sample(count_name, {{"device", device}}, static_cast<double>(u.count));
  }
  out.Family(bytes_name, "gauge", bytes_help);
  for (const auto& [device, u] : by_device) {
    out.Sample(bytes_name, {{"device", device}}, static_cast<double>(u.bytes));
  }
}

}  // namespace

std::string Node::Metrics() const {
  MetricsText out;
  const std::vector<engine::RailInfo>& rails = engine_->rails();
  out.Family("ferry_build_info", "gauge", "The build and the fabric of this node (value 1).");
  out.Sample("ferry_build_info",
             {{"version", kVersion},
              {"commit", FERRY_COMMIT},
              {"cuda", engine::CudaBuilt() ? "true" : "false"},
              {"libfabric", engine::LibfabricVersion()},
              {"provider", rails.empty() ? "" : rails[0].provider}},
             1);

  const std::vector<engine::RailCounters> counters = engine_->Counters();
  struct RailFamily {
    const char* name;
    const char* type;
    const char* help;
    uint64_t engine::RailCounters::*field;
  };
  static constexpr RailFamily kRail[] = {
      {"ferry_rail_writes_total", "counter", "RDMA WRITEs this node sent that completed.",
       &engine::RailCounters::writes},
      {"ferry_rail_sent_bytes_total", "counter", "Bytes of the WRITEs that completed.",
       &engine::RailCounters::bytes},
      {"ferry_rail_write_errors_total", "counter", "WRITEs that failed, at post or completion.",
       &engine::RailCounters::write_errors},
      {"ferry_rail_failovers_total", "counter",
       "WRITEs moved to another rail after this one failed.", &engine::RailCounters::failovers},
      {"ferry_rail_backoffs_total", "counter", "Times the rail was rested for a peer.",
       &engine::RailCounters::backoffs},
      {"ferry_rail_in_flight_bytes", "gauge", "Bytes of WRITEs posted and not completed.",
       &engine::RailCounters::in_flight_bytes},
      {"ferry_rail_full_total", "counter",
       "Times posting stopped with WRITEs queued: tx depth or bytes in flight reached, or the "
       "provider's queue full.",
       &engine::RailCounters::full},
      {"ferry_rail_received_writes_total", "counter",
       "WRITEs with immediate data (each transfer's closing ones) that landed here.",
       &engine::RailCounters::immediates},
      {"ferry_rail_messages_sent_total", "counter", "Control messages sent.",
       &engine::RailCounters::messages_sent},
      {"ferry_rail_messages_received_total", "counter", "Control messages received.",
       &engine::RailCounters::messages_received},
  };
  for (const RailFamily& f : kRail) {
    out.Family(f.name, f.type, f.help);
    for (size_t i = 0; i < counters.size(); ++i) {
      out.Sample(f.name, {{"rail", absl::StrCat(i)}, {"domain", rails[i].domain}},
                 static_cast<double>(counters[i].*f.field));
    }
  }

  const engine::ProgressCounters progress = engine_->Progress();
  out.Family("ferry_progress_passes_total", "counter",
             "Passes of the progress threads' loops, each polling every rail once.");
  out.Sample("ferry_progress_passes_total", {}, static_cast<double>(progress.passes));
  out.Family("ferry_progress_waits_total", "counter",
             "Times the progress threads slept: blocked on their fds, or napped between bursts of "
             "incoming WRITEs.");
  out.Sample("ferry_progress_waits_total", {}, static_cast<double>(progress.waits));

  metrics_.Write(out);

  std::map<std::string, Usage> objects;
  for (std::string after;;) {
    auto page = List("", after, 1000);
    if (!page.ok() || page->empty()) break;
    for (const ObjectInfo& o : *page) {
      Usage& u = objects[o.devices.empty()       ? "detached"
                         : o.devices.size() == 1 ? o.devices[0].ToString()
                                                 : "mixed"];
      ++u.count;
      u.bytes += o.size;
    }
    after = page->back().name;
  }
  WriteUsage(out, "ferry_catalog_objects", "Objects in the catalog (latest versions), by device.",
             "ferry_catalog_bytes", "Bytes of those objects.", objects);

  std::map<std::string, Usage> regions;
  int pulls = 0;
  {
    absl::ReaderMutexLock lock(&mu_);
    for (const auto& [id, r] : regions_) {
      Usage& u = regions[r.info.device.ToString()];
      ++u.count;
      u.bytes += r.info.size;
    }
  }
  {
    absl::MutexLock lock(&flight_mu_);
    pulls = pulls_in_flight_;
  }
  WriteUsage(out, "ferry_regions", "Memory regions this node has registered, by device.",
             "ferry_region_bytes", "Bytes of those regions.", regions);
  out.Family("ferry_pulls_in_flight", "gauge", "Pulls running on this node, either side.");
  out.Sample("ferry_pulls_in_flight", {}, pulls);
  return out.text();
}

}  // namespace ferry::server
