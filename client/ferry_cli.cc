// ferry: the command-line client. See --help.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <string>
#include <string_view>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "client/input_file.h"
#include "engine/engine.h"
#include "engine/topology.h"
#include "ferry/client.h"
#include "ferry/tensors.h"

namespace {

// A progress line on stderr when it is a terminal; nothing otherwise.
ferry::Progress ProgressLine(const std::string& what) {
  if (!isatty(2)) return nullptr;
  auto last = std::make_shared<absl::Time>(absl::InfinitePast());
  return [what, last](uint64_t done, uint64_t total) {
    const absl::Time now = absl::Now();
    if (now - *last < absl::Milliseconds(200) && done != total) return;
    *last = now;
    if (total > 0) {
      std::fprintf(stderr, "\r%s %llu / %llu MiB (%.0f%%)", what.c_str(),
                   static_cast<unsigned long long>(done >> 20),
                   static_cast<unsigned long long>(total >> 20),
                   100.0 * static_cast<double>(done) / static_cast<double>(total));
    } else {
      std::fprintf(stderr, "\r%s %llu MiB", what.c_str(),
                   static_cast<unsigned long long>(done >> 20));
    }
    std::fflush(stderr);
  };
}

void Rate(const char* verb, uint64_t bytes, double seconds) {
  if (isatty(2)) std::fprintf(stderr, "\r\033[K");
  std::fprintf(stderr, "%s %llu bytes in %.3f s (%.2f MB/s)\n", verb,
               static_cast<unsigned long long>(bytes), seconds,
               seconds > 0 ? static_cast<double>(bytes) / seconds / 1e6 : 0.0);
}

int Fail(const absl::Status& s) {
  if (isatty(2)) std::fprintf(stderr, "\r\033[K");
  std::fprintf(stderr, "ferry: %s\n", s.ToString().c_str());
  switch (s.code()) {
    case absl::StatusCode::kNotFound:
      return 3;
    case absl::StatusCode::kAlreadyExists:
    case absl::StatusCode::kFailedPrecondition:
      return 4;
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kDeadlineExceeded:
      return 5;
    case absl::StatusCode::kUnauthenticated:
      return 6;
    default:
      return 1;
  }
}

// `ferry topo`: the placement ferryd makes with --rails 0 (needs no node).
int Topo(const std::string& xml, const std::string& provider) {
  auto t =
      xml.empty() ? ferry::engine::Topology::Discover() : ferry::engine::Topology::FromXml(xml);
  if (!t.ok()) return Fail(t.status());
  std::vector<ferry::engine::NicRef> nics = (*t)->Nics();
  if (!provider.empty()) {
    auto listed = ferry::engine::ProviderNics(provider);
    if (!listed.ok()) return Fail(listed.status());
    nics = *listed;
  }
  std::printf("%zu GPU(s), %zu NIC(s)\n%s", (*t)->Gpus().size(), nics.size(),
              ferry::engine::DescribePlacement((*t)->Place(nics)).c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"ferry: move named buffers between ferry nodes"};
  app.require_subcommand(1);
  std::string node = "http://127.0.0.1:7070";
  app.add_option("--node", node, "the node to talk to")->capture_default_str();
  std::string name, file, out, prefix, from, to, as, device = "host", path = "auto";
  bool replace = false, safetensors = false;
  auto* put = app.add_subcommand("put", "upload FILE as object NAME");
  put->add_option("NAME", name)->required();
  put->add_option("FILE", file)->required();
  put->add_flag("--replace", replace, "make a new version if NAME exists");
  put->add_flag("--safetensors", safetensors,
                "FILE is a safetensors checkpoint: publish its tensors' bytes with their table");
  put->add_option("--device", device, "where the node keeps it: host or cuda:N")
      ->capture_default_str();
  auto* get = app.add_subcommand("get", "download object NAME");
  get->add_option("NAME", name)->required();
  get->add_option("-o,--output", out, "file to write (default: stdout)");
  auto* ls = app.add_subcommand("ls", "list objects");
  ls->add_option("PREFIX", prefix);
  auto* stat = app.add_subcommand("stat", "describe object NAME");
  stat->add_option("NAME", name)->required();
  auto* rm = app.add_subcommand("rm", "delete object NAME");
  rm->add_option("NAME", name)->required();
  auto* pull = app.add_subcommand(
      "pull",
      "make node --to (default --node) pull NAME from --from, or from a holder its "
      "directory names");
  pull->add_option("NAME", name)->required();
  pull->add_option("--from", from, "source node URL (default: a holder, by the directory)");
  pull->add_option("--to", to, "destination node URL (default: --node)");
  pull->add_option("--as", as, "name to publish the copy as (default: NAME)");
  pull->add_flag("--replace", replace, "make a new version if the name exists there");
  pull->add_option("--device", device, "where the copy goes: host or cuda:N")
      ->capture_default_str();
  pull->add_option("--path", path, "auto, rdma, cuda_ipc or staged")->capture_default_str();
  auto* cluster =
      app.add_subcommand("cluster", "the nodes of the node's directory, and what they hold");
  std::vector<std::string> receivers, labels;
  bool all = false, no_checksum = false;
  uint64_t chunk = 0;
  auto* distribute = app.add_subcommand(
      "distribute",
      "make node --node deliver NAME to many nodes at once, in a chain (POST /v1/distribute)");
  distribute->add_option("NAME", name)->required();
  distribute->add_option("--to", receivers, "receivers' URLs, in chain order")->delimiter(',');
  distribute->add_option("--label", labels,
                         "KEY=VALUE: the directory's nodes with this label (repeatable)");
  distribute->add_flag("--all", all, "every other node of the directory");
  distribute->add_option("--chunk", chunk, "bytes per chunk (default: a 64th, 1-64 MiB)");
  distribute->add_flag("--no-checksum", no_checksum, "no CRC32C per chunk");
  distribute->add_option("--device", device, "where receivers put it: host or cuda:N")
      ->capture_default_str();
  auto* health = app.add_subcommand("health", "exit 0 when the node answers and is not draining");
  auto* drain = app.add_subcommand(
      "drain", "make the node refuse new work, finish its pulls and stop (POST /v1/drain)");
  std::string xml, provider;
  auto* topo = app.add_subcommand(
      "topo", "print where rails go on this machine: GPU -> NICs -> NUMA node -> cores");
  topo->add_option("--xml", xml, "an hwloc XML topology (and its NICs) instead of this machine");
  topo->add_option("--provider", provider,
                   "take the NICs from this libfabric provider's domains (default: hwloc's)");
  CLI11_PARSE(app, argc, argv);
  if (*topo) return Topo(xml, provider);

  const char* token = std::getenv("FERRY_TOKEN");
  auto client = ferry::Client::Connect(*pull && !to.empty() ? to : node, token ? token : "");
  if (!client.ok()) return Fail(client.status());
  ferry::Client& c = **client;
  const absl::Time start = absl::Now();
  if (*put) {
    const ferry::InputFile in(file);
    if (!in.ok()) return Fail(absl::NotFoundError("cannot read " + file));
    // A safetensors file: its header goes as the tensor table, its data as the object.
    ferry::SafetensorsLayout st{.data_offset = 0, .data_size = in.size()};
    std::string meta;
    if (safetensors) {
      auto parsed = ferry::ReadSafetensors(
          [&in](uint64_t offset, char* out, size_t n) { return in.Read(offset, out, n); },
          in.size());
      if (!parsed.ok()) return Fail(parsed.status());
      st = *std::move(parsed);
      meta = ferry::TensorTableMeta(st.tensors);
    }
    auto r = c.Put(
        name, st.data_size,
        [&in, skip = st.data_offset](uint64_t offset, char* out, size_t n) {
          return in.Read(skip + offset, out, n);
        },
        replace, ProgressLine("put"), device, meta);
    if (!r.ok()) return Fail(r.status());
    Rate("put", in.size(), absl::ToDoubleSeconds(absl::Now() - start));
    std::printf("%s version %llu, %llu bytes\n", r->name.c_str(),
                static_cast<unsigned long long>(r->version),
                static_cast<unsigned long long>(r->size));
  } else if (*get) {
    std::ofstream file_out;
    if (!out.empty()) {
      file_out.open(out, std::ios::binary | std::ios::trunc);
      if (!file_out) return Fail(absl::PermissionDeniedError("cannot write " + out));
    }
    std::ostream& sink = out.empty() ? std::cout : file_out;
    uint64_t bytes = 0;
    auto progress = ProgressLine("get");
    absl::Status s = c.Get(name, sink, std::nullopt, [&](uint64_t done, uint64_t total) {
      bytes = done;
      if (progress) progress(done, total);
    });
    if (!s.ok()) return Fail(s);
    sink.flush();
    Rate("got", bytes, absl::ToDoubleSeconds(absl::Now() - start));
  } else if (*ls) {
    auto r = c.List(prefix);
    if (!r.ok()) return Fail(r.status());
    for (const auto& o : *r) {
      std::printf("%-40s v%-4llu %14llu%s\n", o.name.c_str(),
                  static_cast<unsigned long long>(o.version),
                  static_cast<unsigned long long>(o.size), o.detached ? "  detached" : "");
    }
  } else if (*stat) {
    auto r = c.Stat(name);
    if (!r.ok()) return Fail(r.status());
    std::printf("name %s\nversion %llu\nsize %llu\ndetached %s\n", r->name.c_str(),
                static_cast<unsigned long long>(r->version),
                static_cast<unsigned long long>(r->size), r->detached ? "yes" : "no");
  } else if (*rm) {
    absl::Status s = c.Remove(name);
    if (!s.ok()) return Fail(s);
  } else if (*health || *drain) {
    absl::Status s = *health ? c.Health() : c.Drain();
    if (!s.ok()) return Fail(s);
    std::printf("%s\n", *health ? "ok" : "draining");
  } else if (*pull) {
    auto r = c.Pull(name, from, as, replace, device, path);
    if (!r.ok()) return Fail(r.status());
    std::printf("pulled %s: %llu bytes over %zu rail(s) (%s) in %.3f s on the wire: %.2f Gbit/s\n",
                name.c_str(), static_cast<unsigned long long>(r->bytes), r->bytes_per_rail.size(),
                r->path.c_str(), r->seconds,
                r->seconds > 0 ? static_cast<double>(r->bytes) * 8 / r->seconds / 1e9 : 0.0);
    if (!r->source.empty()) std::printf("from %s\n", r->source.c_str());
    for (const std::string& t : r->tried) std::printf("tried first: %s\n", t.c_str());
  } else if (*distribute) {
    ferry::DistributeSpec spec;
    spec.object = name;
    spec.to = receivers;
    spec.all = all;
    spec.chunk_bytes = chunk;
    spec.checksum = !no_checksum;
    spec.device = device;
    for (const std::string& l : labels) {
      const size_t eq = l.find('=');
      if (eq == std::string::npos) return Fail(absl::InvalidArgumentError("--label KEY=VALUE"));
      spec.labels[l.substr(0, eq)] = l.substr(eq + 1);
    }
    auto r = c.Distribute(spec);
    if (!r.ok()) return Fail(r.status());
    std::printf("%s version %llu, %llu bytes in %llu chunks, to %zu node(s) in %.3f s\n",
                r->object.c_str(), static_cast<unsigned long long>(r->version),
                static_cast<unsigned long long>(r->size),
                static_cast<unsigned long long>(r->chunks), r->receivers.size(), r->seconds);
    int failed = 0;
    for (const ferry::ReceiverResult& rr : r->receivers) {
      failed += !rr.status.ok();
      std::printf(
          "  %-28s %s %.3f s%s\n", rr.url.c_str(),
          rr.status.ok() ? (rr.held_already ? "held it already" : "ok")
                         : rr.status.ToString().c_str(),
          rr.seconds,
          rr.skipped.empty()
              ? ""
              : absl::StrCat(", upstreams skipped: ", absl::StrJoin(rr.skipped, "; ")).c_str());
    }
    if (failed > 0) return 1;
  } else if (*cluster) {
    auto r = c.Cluster();
    if (!r.ok()) return Fail(r.status());
    for (const ferry::ClusterNode& n : *r) {
      std::printf("%-18s %-28s %-8s %zu object(s)\n", n.id.c_str(), n.url.c_str(), n.state.c_str(),
                  n.objects.size());
      for (const auto& o : n.objects) {
        std::printf("    %-40s v%-4llu %14llu\n", o.name.c_str(),
                    static_cast<unsigned long long>(o.version),
                    static_cast<unsigned long long>(o.size));
      }
    }
  }
  return 0;
}
