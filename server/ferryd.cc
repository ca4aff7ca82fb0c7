// ferryd: a ferry node as a daemon. See --help.
#include <httplib.h>
#include <malloc.h>
#include <rdma/fi_errno.h>
#include <signal.h>

#include <fstream>
#include <iostream>
#include <thread>

#include "CLI/CLI.hpp"
#include "absl/strings/numbers.h"
#include "base/status.h"
#include "cluster/directory_store.h"
#include "nlohmann/json.hpp"
#include "server/http_api.h"
#include "server/node.h"
#include "spdlog/sinks/stdout_color_sinks.h"
#include "spdlog/spdlog.h"
#include "wire/auth.h"

namespace {

bool IsLoopback(const std::string& host) {
  return host == "127.0.0.1" || host == "localhost" || host == "::1" || host.rfind("127.", 0) == 0;
}

}  // namespace

int main(int argc, char** argv) {
  // A pull of tens of thousands of extents allocates a few MiB of plans and WRITE contexts:
  // from the heap, kept there for the next pull, instead of fresh mmaps whose first-touch
  // page faults cost more than the work. One arena: the HTTP pool hands a request to any of
  // its threads, and with two arenas a pull often met only memory the one before had not
  // used. Regions are mapped apart from the heap (AllocateHostMemory) and go back to the
  // system when freed.
  mallopt(M_MMAP_THRESHOLD, 64 << 20);
  mallopt(M_TRIM_THRESHOLD, 128 << 20);
  mallopt(M_ARENA_MAX, 1);
  spdlog::set_default_logger(spdlog::stderr_color_mt("ferryd"));
  CLI::App app{"ferryd: a ferry node (engine, RocksDB catalog, HTTP API)"};
  std::string listen = "127.0.0.1:7070", token_file;
  int64_t drain_grace_s = 30;
  bool insecure = false;
  ferry::server::NodeOptions options;
  ferry::server::HttpOptions http;
  size_t max_body_mb = 1024;
  app.add_option("--listen", listen, "HOST:PORT to serve HTTP on (port 0: any free port)")
      ->capture_default_str();
  app.add_option("--data-dir", options.data_dir, "catalog directory")->capture_default_str();
  app.add_option("--provider", options.engine.provider, "auto, tcp, shm, efa or verbs")
      ->capture_default_str();
  app.add_option("--domain", options.engine.domains, "libfabric domain(s) to open rails on");
  app.add_option("--rails", options.engine.rails, "number of rails (0: one per domain)")
      ->capture_default_str();
  app.add_option("--progress-threads", options.engine.progress_threads,
                 "progress threads the rails are dealt to (0: one per rail, up to half the CPUs)")
      ->capture_default_str();
  options.engine.topology = true;
  app.add_option("--topology", options.engine.topology,
                 "with --rails 0: one progress thread per GPU with the NICs under its PCIe "
                 "switch (hwloc), pinned to its cores (see `ferry topo`)")
      ->capture_default_str();
  int64_t stall_ms = absl::ToInt64Milliseconds(options.engine.rail_stall_timeout);
  app.add_option("--rail-stall-ms", stall_ms,
                 "a rail whose WRITEs see no completion for this long fails over")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{10}, int64_t{600000}));
  int64_t backoff_ms = absl::ToInt64Milliseconds(options.engine.rail_backoff);
  app.add_option("--rail-backoff-ms", backoff_ms, "first rest of a failed rail (doubles)")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{600000}));
  app.add_option("--spin-while-awake", options.engine.spin_while_awake,
                 "during a pull into this node, poll the rails without pausing (false: nap "
                 "between bursts of data, for as long as the last burst suggests)")
      ->capture_default_str();
  app.add_option("--hmem-dmabuf", options.engine.hmem_dmabuf,
                 "register GPU memory on the rails as dma-bufs where libfabric and the driver "
                 "take them (false: by address)")
      ->capture_default_str();
  bool fail_gpu_writes = false;
  app.add_flag("--test-fail-gpu-writes", fail_gpu_writes,
               "tests only: every WRITE from GPU memory fails (FI_EIO), as with a provider that "
               "claims FI_HMEM and cannot move GPU memory")
      ->group("");
  app.add_option("--max-write", options.engine.max_write, "longest WRITE, bytes")
      ->capture_default_str()
      ->check(CLI::Range(uint64_t{4096}, uint64_t{1} << 30));
  app.add_option("--min-rail-share", options.engine.min_rail_share,
                 "a pull is striped over as many rails as give each this many bytes (0: over "
                 "every rail)")
      ->capture_default_str();
  app.add_option("--wait-fds", options.engine.wait_fds,
                 "rails' CQs with wait fds: idle progress threads block on them (false: on the "
                 "engine's bell, which peers ring; less work per WRITE on tcp)")
      ->capture_default_str();
  app.add_option("--token-file", token_file, "file with the bearer token clients must send");
  std::string cluster_key_file;
  app.add_option("--cluster-key-file", cluster_key_file,
                 "file with the key node-to-node messages are sealed with (default: one derived "
                 "from the token, none without one)");
  app.add_option("--peer-transport", options.peer_transport,
                 "how this node asks other nodes: auto (the fabric, HTTP when it cannot reach "
                 "them), fabric or http")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "fabric", "http"}));
  app.add_flag("--insecure", insecure, "allow a non-loopback --listen without a token");
  std::string tls_cert, tls_key;
  auto* cert_opt = app.add_option("--tls-cert", tls_cert,
                                  "PEM file with the certificate chain: the HTTP port speaks "
                                  "HTTPS (TLS 1.2 or later); with --tls-key");
  app.add_option("--tls-key", tls_key, "PEM file with the private key of --tls-cert")
      ->needs(cert_opt);
  cert_opt->needs(app.get_option("--tls-key"));
  uint64_t min_free_disk_mb = options.min_free_disk >> 20;
  app.add_option("--min-free-disk-mb", min_free_disk_mb,
                 "MiB the data dir's disk keeps free: below them publishes, uploads and new "
                 "regions get 507 (reads and pulls go on), and ferryd does not start")
      ->capture_default_str()
      ->check(CLI::Range(uint64_t{1}, uint64_t{1} << 30));
  ferry::server::ConnectionLimits limits;
  int64_t head_timeout_ms = absl::ToInt64Milliseconds(limits.head_timeout);
  app.add_option("--http-head-timeout-ms", head_timeout_ms,
                 "a request's head must arrive whole this long after its first byte; a body "
                 "or an answer gets it as grace before --http-min-rate-kib applies")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{100}, int64_t{600000}));
  size_t min_rate_kib = limits.min_rate >> 10;
  app.add_option("--http-min-rate-kib", min_rate_kib,
                 "KiB per second a request body or an answer must keep up")
      ->capture_default_str()
      ->check(CLI::Range(size_t{1}, size_t{1} << 30));
  app.add_option("--http-max-slow", limits.max_slow,
                 "HTTP requests that may be slow at once (their head past 1 s, or behind the "
                 "minimum rate); one more is closed with 408")
      ->capture_default_str()
      ->check(CLI::Range(size_t{1}, size_t{100000}));
  app.add_option("--http-max-workers", limits.max_workers,
                 "threads serving HTTP connections, one each (more connections wait)")
      ->capture_default_str()
      ->check(CLI::Range(size_t{2}, size_t{100000}));
  app.add_option("--drain-grace-s", drain_grace_s,
                 "on SIGTERM or POST /v1/drain, how long running pulls may take to finish")
      ->capture_default_str();
  app.add_option("--metrics", options.metrics,
                 "count for GET /metrics (false: to measure what counting costs)")
      ->capture_default_str();
  app.add_flag("--metrics-public", http.metrics_public,
               "GET /metrics answers without the token (for a scraper that has none)");
  app.add_option("--max-body-mb", max_body_mb, "largest request body, MiB")->capture_default_str();
  bool serve_directory = false;
  int64_t directory_ttl_s = absl::ToInt64Seconds(options.directory_ttl);
  std::string advertise;
  std::vector<std::string> labels;
  app.add_option("--directory", options.directory,
                 "the cluster's directory: etcd://HOST:PORT[,HOST:PORT...] or http://HOST:PORT "
                 "(a ferryd with --serve-directory); the node joins it, and pulls may name no "
                 "source");
  app.add_flag("--serve-directory", serve_directory,
               "keep a directory for other nodes (in DATA_DIR/directory) and join it, unless "
               "--directory names another");
  app.add_option("--directory-ttl-s", directory_ttl_s,
                 "lease of this node's directory records: a node that dies leaves it within this")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{3600}));
  app.add_option("--advertise-url", advertise,
                 "how other nodes reach this one over HTTP (default: http://LISTEN)");
  app.add_option("--label", labels, "KEY=VALUE: a label of this node in the directory");
  app.add_option("--max-extents", options.max_extents, "most extents per request")
      ->capture_default_str();
  app.add_option("--keep-versions", options.keep_versions,
                 "versions kept per object name; older ones, and the buffers ferryd allocated "
                 "for them, go when a new one is published (0: all)")
      ->capture_default_str();
  uint64_t spare_mb = 0, memory_limit_mb = 0;
  app.add_option("--memory-limit-mb", memory_limit_mb,
                 "host memory the node allocates at most, MiB (0: three quarters of the "
                 "machine's)")
      ->capture_default_str();
  app.add_option("--spare-mb", spare_mb,
                 "MiB of freed object buffers kept for the next object of the same size and "
                 "device (0: none)")
      ->capture_default_str();
  app.add_option("--staging-slots", options.staging_slots,
                 "slots per staging ring (the staged GPU path)")
      ->capture_default_str();
  uint64_t slot_kib = options.staging_slot_bytes >> 10;
  app.add_option("--staging-slot-kib", slot_kib, "bytes per staging slot, KiB")
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  options.staging_slot_bytes = slot_kib << 10;
  options.spare_bytes = spare_mb << 20;
  options.memory_limit = memory_limit_mb << 20;
  options.engine.rail_stall_timeout = absl::Milliseconds(stall_ms);
  options.engine.rail_backoff = absl::Milliseconds(backoff_ms);
  if (fail_gpu_writes) {
    options.engine.post_fault = [](size_t, bool from_gpu) { return from_gpu ? -FI_EIO : 0; };
  }

  const size_t colon = listen.rfind(':');
  int port = 0;
  if (colon == std::string::npos || !absl::SimpleAtoi(listen.substr(colon + 1), &port) ||
      port < 0 || port > 65535) {
    std::cerr << "ferryd: --listen must be HOST:PORT\n";
    return 2;
  }
  std::string host = listen.substr(0, colon);
  if (host.size() > 2 && host.front() == '[') host = host.substr(1, host.size() - 2);
  if (!token_file.empty()) {
    std::ifstream in(token_file);
    if (!in || !std::getline(in, http.token) || http.token.empty()) {
      std::cerr << "ferryd: cannot read a token from " << token_file << "\n";
      return 2;
    }
  }
  if (http.token.empty() && !IsLoopback(host) && !insecure) {
    std::cerr << "ferryd: refusing to listen on " << host
              << " without --token-file (or --insecure)\n";
    return 2;
  }
  if (!cluster_key_file.empty()) {
    std::ifstream in(cluster_key_file);
    if (!in || !std::getline(in, options.cluster_key) || options.cluster_key.empty()) {
      std::cerr << "ferryd: cannot read a cluster key from " << cluster_key_file << "\n";
      return 2;
    }
  } else {
    // Nodes that share a token seal their messages to each other under a key derived from it:
    // a node never hands its token to a peer.
    options.cluster_key = ferry::wire::ClusterKeyFromToken(http.token);
  }
  http.max_body = max_body_mb << 20;
  options.min_free_disk = min_free_disk_mb << 20;
  limits.head_timeout = absl::Milliseconds(head_timeout_ms);
  limits.min_rate = min_rate_kib << 10;
  options.directory_ttl = absl::Seconds(directory_ttl_s);
  options.directory_token = http.token;
  for (const std::string& l : labels) {
    const size_t eq = l.find('=');
    if (eq == std::string::npos || eq == 0) {
      std::cerr << "ferryd: --label must be KEY=VALUE, not " << l << "\n";
      return 2;
    }
    options.labels[l.substr(0, eq)] = l.substr(eq + 1);
  }

  // Signals are taken by a thread of their own (sigwait), so they never interrupt libfabric.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  signal(SIGPIPE, SIG_IGN);

  // Bound first: the node's URL (and its own directory's) has the port in it.
  ferry::server::HttpServer server(limits);
  ferry::server::SetSocketOptions(server);
  if (!tls_cert.empty()) {
    if (absl::Status s = server.UseTls(tls_cert, tls_key); !s.ok()) {
      std::cerr << "ferryd: " << s.message() << "\n";
      return 2;
    }
  }
  const int bound = server.Bind(host, port);
  if (bound < 0) {
    std::cerr << "ferryd: cannot listen on " << listen << "\n";
    return 1;
  }
  const bool any_address = host == "0.0.0.0" || host == "::" || host.empty();
  if (advertise.empty() && any_address && (serve_directory || !options.directory.empty())) {
    std::cerr << "ferryd: listening on " << listen << ", other nodes cannot know this node's "
              << "address: give --advertise-url with --directory or --serve-directory\n";
    return 2;
  }
  const std::string scheme = server.tls() ? "https://" : "http://";
  const std::string url = !advertise.empty() ? advertise
                          : host.find(':') != std::string::npos
                              ? scheme + "[" + host + "]:" + std::to_string(bound)
                              : scheme + host + ":" + std::to_string(bound);
  std::unique_ptr<ferry::cluster::DirectoryStore> directory;
  if (serve_directory) {
    auto store = ferry::cluster::DirectoryStore::Open(options.data_dir + "/directory",
                                                      options.min_free_disk);
    if (!store.ok()) {
      std::cerr << "ferryd: " << store.status() << "\n";
      return 1;
    }
    directory = *std::move(store);
    http.directory = directory.get();
    if (options.directory.empty()) options.directory = url;
  }
  auto node = ferry::server::Node::Open(options);
  if (!node.ok()) {
    std::cerr << "ferryd: " << node.status() << "\n";
    return 1;
  }
  (*node)->SetUrl(url);
  http.on_drain = [] { kill(getpid(), SIGTERM); };
  ferry::server::InstallRoutes(server, **node, http);
  // One line on stdout for whoever started us: where we listen and who we are.
  std::cout << nlohmann::json{{"listen", host + ":" + std::to_string(bound)},
                              {"node", (*node)->id()},
                              {"url", url}}
                   .dump()
            << std::endl;
  if (!options.directory.empty()) {
    ferry::IgnoreError((*node)->Join(url));  // fails only without a directory
    spdlog::info("joining directory {} as {}", options.directory, url);
  }
  spdlog::info("node {} listening on {}:{} with {} rail(s) of {} on {} progress thread(s)",
               (*node)->id(), host, bound, (*node)->engine().rails().size(),
               (*node)->engine().rails()[0].provider, (*node)->engine().progress_threads());
  // SIGTERM, SIGINT or POST /v1/drain: the node drains (new pulls and uploads get 503), the
  // pulls running finish, then it stops; a second signal or the grace period's end cancels
  // what is left first.
  std::thread waiter([&server, &node, signals, drain_grace_s] {
    int sig = 0;
    sigwait(&signals, &sig);
    ferry::server::Node& n = **node;
    n.Drain();
    spdlog::info("signal {}: draining, {} s for the pulls running", sig, drain_grace_s);
    const absl::Time end = absl::Now() + absl::Seconds(drain_grace_s);
    const timespec tick = {0, 50'000'000};
    while (!n.AwaitPulls(absl::Now())) {
      const bool again = sigtimedwait(&signals, nullptr, &tick) > 0;
      if (again || absl::Now() >= end) {
        spdlog::warn("{}: cancelling the pulls still running",
                     again ? "second signal" : "grace over");
        n.CancelPulls();
        break;
      }
    }
    spdlog::info("drained: stopping");
    ferry::server::StopOnceRunning(server);
  });
  server.listen_after_bind();
  // listen_after_bind returns after stop(): in-flight requests have been answered.
  if (waiter.joinable()) {
    pthread_kill(waiter.native_handle(), SIGTERM);  // in case we stopped for another reason
    waiter.join();
  }
  node->reset();  // drains pulls, closes the engine, flushes and closes the catalog
  directory.reset();
  spdlog::info("stopped");
  return 0;
}
