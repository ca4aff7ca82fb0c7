// The C ABI (ferry/ferry.h) over ferry::Client and ferry::EmbeddedNode.
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <new>
#include <sstream>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/status.h"
#include "base/version.h"
#include "client/input_file.h"
#include "ferry/client.h"
#include "ferry/ferry.h"
#include "ferry/node.h"
#include "ferry/tensors.h"
#include "nlohmann/json.hpp"
#include "wire/api_json.h"
#include "wire/http_status.h"

struct ferry_client {
  std::unique_ptr<ferry::Client> client;
};
struct ferry_node {
  std::unique_ptr<ferry::EmbeddedNode> node;
  std::string url;
};
struct ferry_pull {
  std::unique_ptr<ferry::PullFuture> future;
};

namespace ferry {
namespace {

thread_local std::string last_error;

// The code of `s`, keeping its message for ferry_last_error.
int Code(const absl::Status& s) {
  if (!s.ok()) last_error = std::string(s.message());
  return static_cast<int>(s.code());
}

// Runs `f` (returning absl::Status) with C++ exceptions (allocation) turned into codes.
template <typename F>
int Call(F&& f) {
  try {
    return Code(f());
  } catch (const std::bad_alloc&) {
    return Code(absl::ResourceExhaustedError("out of memory"));
  } catch (const std::exception& e) {
    return Code(absl::InternalError(e.what()));
  }
}

absl::Status Required(const void* p, const char* what) {
  return p != nullptr ? absl::OkStatus()
                      : absl::InvalidArgumentError(absl::StrCat(what, " is NULL"));
}

std::string Str(const char* s) { return s != nullptr ? std::string(s) : std::string(); }

// A copy the caller frees with ferry_free.
char* Dup(std::string_view s) {
  char* out = static_cast<char*>(std::malloc(s.size() + 1));
  if (out == nullptr) throw std::bad_alloc();
  std::memcpy(out, s.data(), s.size());
  out[s.size()] = '\0';
  return out;
}

void Give(const ObjectInfo& info, char** out) {
  if (out != nullptr) *out = Dup(ToJson(info, /*with_extents=*/true).dump());
}

std::optional<uint64_t> Version(uint64_t v) {
  return v == 0 ? std::nullopt : std::optional<uint64_t>(v);
}

absl::StatusOr<Layout> LayoutOf(const ferry_layout* l) {
  RETURN_IF_ERROR(Required(l, "layout"));
  if (l->n_runs > 0) RETURN_IF_ERROR(Required(l->runs, "layout.runs"));
  if (l->n_page_ids > 0) RETURN_IF_ERROR(Required(l->page_ids, "layout.page_ids"));
  Layout out;
  size_t pages = 0;
  for (size_t i = 0; i < l->n_runs; ++i) {
    const ferry_run& r = l->runs[i];
    switch (r.kind) {
      case FERRY_RUN_EXTENT:
        out.Add({r.region, r.offset, r.piece});
        break;
      case FERRY_RUN_STRIDED:
        out.AddStrided(r.region, r.offset, r.piece, r.stride, r.count);
        break;
      case FERRY_RUN_PAGES:
        if (r.count > l->n_page_ids - pages) {
          return absl::InvalidArgumentError(absl::StrCat(
              "run ", i, " takes ", r.count, " page ids; ", l->n_page_ids - pages, " are left"));
        }
        out.AddPages(r.region, r.offset, r.piece,
                     std::vector<uint32_t>(l->page_ids + pages, l->page_ids + pages + r.count));
        pages += r.count;
        break;
      default:
        return absl::InvalidArgumentError(absl::StrCat("run ", i, " has unknown kind ", r.kind));
    }
  }
  return out;
}

absl::StatusOr<PullSpec> SpecOf(const ferry_pull_spec* s) {
  RETURN_IF_ERROR(Required(s, "spec"));
  RETURN_IF_ERROR(Required(s->object, "spec.object"));
  PullSpec spec;
  if (s->from != nullptr) spec.from = s->from;
  spec.object = s->object;
  spec.version = Version(s->version);
  spec.range_offset = s->range_offset;
  spec.range_length = s->range_length;
  if (s->n_source_extents > 0) {
    RETURN_IF_ERROR(Required(s->source_extents, "spec.source_extents"));
    spec.source_extents.assign(s->source_extents, s->source_extents + s->n_source_extents);
  }
  if (s->new_buffer_device != nullptr) {
    ASSIGN_OR_RETURN(spec.new_buffer, Device::Parse(s->new_buffer_device));
  }
  spec.as = Str(s->as);
  spec.replace = s->replace != 0;
  spec.durable = s->durable != 0;
  if (s->into.n_runs > 0) {
    ASSIGN_OR_RETURN(spec.into, LayoutOf(&s->into));
  }
  spec.prepared = s->prepared;
  if (s->n_indices > 0) {
    RETURN_IF_ERROR(Required(s->indices, "spec.indices"));
    spec.indices.assign(s->indices, s->indices + s->n_indices);
  }
  if (s->path != nullptr) spec.path = s->path;
  spec.timeout_ms = s->timeout_ms;
  return spec;
}

void Fill(const PullStats& in, ferry_pull_stats* out) {
  if (out == nullptr) return;
  *out = {};
  out->version = in.version;
  out->bytes = in.bytes;
  out->seconds = in.seconds;
  out->rerouted_writes = in.rerouted_writes;
  out->region = in.region.value_or(0);
  std::strncpy(out->path, in.path.c_str(), sizeof(out->path) - 1);
  std::strncpy(out->via, in.via.c_str(), sizeof(out->via) - 1);
  std::strncpy(out->source, in.source.c_str(), sizeof(out->source) - 1);
  if (!in.tried.empty()) out->tried = Dup(nlohmann::json(in.tried).dump());
}

absl::Status Filled(const absl::StatusOr<PullStats>& r, ferry_pull_stats* out) {
  if (r.ok()) Fill(*r, out);
  return r.status();
}

absl::Status Given(const absl::StatusOr<ObjectInfo>& r, char** out) {
  if (r.ok()) Give(*r, out);
  return r.status();
}

absl::StatusOr<EmbeddedNodeOptions> NodeOptionsOf(const char* text) {
  EmbeddedNodeOptions o;
  if (text == nullptr || *text == '\0') return o;
  auto j = ParseJson(text);
  if (!j.ok() || !j->is_object())
    return absl::InvalidArgumentError("node options must be a JSON object");
  for (const auto& [key, v] : j->items()) {
    const auto want = [&option = key](const char* type) {
      return absl::InvalidArgumentError(
          absl::StrCat("node option \"", option, "\" must be ", type));
    };
    if (key == "data_dir" || key == "provider" || key == "listen" || key == "token" ||
        key == "peer_transport") {
      if (!v.is_string()) return want("a string");
      std::string& field = key == "data_dir"   ? o.data_dir
                           : key == "provider" ? o.provider
                           : key == "listen"   ? o.listen
                           : key == "token"    ? o.token
                                               : o.peer_transport;
      field = v.get<std::string>();
    } else if (key == "rails") {
      if (!v.is_number_unsigned()) return want("a count");
      o.rails = v.get<size_t>();
    } else if (key == "sync") {
      if (!v.is_boolean()) return want("true or false");
      o.sync = v.get<bool>();
    } else if (key == "domains") {
      if (!v.is_array()) return want("a list of strings");
      for (const auto& d : v) {
        if (!d.is_string()) return want("a list of strings");
        o.domains.push_back(d.get<std::string>());
      }
    } else {
      return absl::InvalidArgumentError(absl::StrCat("unknown node option \"", key, "\""));
    }
  }
  return o;
}

}  // namespace
}  // namespace ferry

using ferry::Call;
using ferry::Required;
using ferry::Str;

extern "C" {

const char* ferry_last_error(void) { return ferry::last_error.c_str(); }
void ferry_free(void* p) { std::free(p); }
const char* ferry_version(void) { return ferry::kVersion; }

int ferry_client_open(const char* url, const char* token, ferry_client** out) {
  return Call([&]() -> absl::Status {
    RETURN_IF_ERROR(Required(url, "url"));
    RETURN_IF_ERROR(Required(out, "out"));
    ASSIGN_OR_RETURN(auto client, ferry::Client::Connect(url, Str(token)));
    *out = new ferry_client{std::move(client)};
    return absl::OkStatus();
  });
}

void ferry_client_close(ferry_client* c) { delete c; }

int ferry_client_health(ferry_client* c) {
  return Call([&] { return c == nullptr ? Required(c, "client") : c->client->Health(); });
}

int ferry_client_put(ferry_client* c, const char* name, const void* data, size_t size,
                     const char* device, int replace, const char* meta, char** info) {
  return Call([&]() -> absl::Status {
    RETURN_IF_ERROR(Required(c, "client"));
    RETURN_IF_ERROR(Required(name, "name"));
    if (size > 0) RETURN_IF_ERROR(Required(data, "data"));
    return ferry::Given(
        c->client->Put(name, std::string_view(static_cast<const char*>(data), size), replace != 0,
                       nullptr, device != nullptr ? device : "host", Str(meta)),
        info);
  });
}

int ferry_client_put_file(ferry_client* c, const char* name, const char* path, const char* device,
                          int replace, int safetensors, char** info) {
  return Call([&]() -> absl::Status {
    RETURN_IF_ERROR(Required(c, "client"));
    RETURN_IF_ERROR(Required(name, "name"));
    RETURN_IF_ERROR(Required(path, "path"));
    const ferry::InputFile file(path);
    if (!file.ok()) return absl::NotFoundError(absl::StrCat("cannot read ", path));
    const uint64_t size = file.size();
    auto read = [&file](uint64_t offset, char* out, size_t n) { return file.Read(offset, out, n); };
    ferry::SafetensorsLayout layout{.data_offset = 0, .data_size = size};
    std::string meta;
    if (safetensors != 0) {
      ASSIGN_OR_RETURN(layout, ferry::ReadSafetensors(read, size));
      meta = ferry::TensorTableMeta(layout.tensors);
    }
    return ferry::Given(c->client->Put(
                            name, layout.data_size,
                            [&](uint64_t offset, char* out, size_t n) {
                              return read(layout.data_offset + offset, out, n);
                            },
                            replace != 0, nullptr, device != nullptr ? device : "host", meta),
                        info);
  });
}

int ferry_client_get(ferry_client* c, const char* name, uint64_t version, char** data,
                     size_t* size) {
  return Call([&]() -> absl::Status {
    RETURN_IF_ERROR(Required(c, "client"));
    RETURN_IF_ERROR(Required(name, "name"));
    RETURN_IF_ERROR(Required(data, "data"));
    RETURN_IF_ERROR(Required(size, "size"));
    std::ostringstream out;
    RETURN_IF_ERROR(c->client->Get(name, out, ferry::Version(version)));
    const std::string bytes = std::move(out).str();
    *data = ferry::Dup(bytes);
    *size = bytes.size();
    return absl::OkStatus();
  });
}

int ferry_client_get_file(ferry_client* c, const char* name, uint64_t version, const char* path) {
  return Call([&]() -> absl::Status {
    RETURN_IF_ERROR(Required(c, "client"));
    RETURN_IF_ERROR(Required(name, "name"));
    RETURN_IF_ERROR(Required(path, "path"));
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    if (!out) return absl::PermissionDeniedError(absl::StrCat("cannot write ", path));
    return c->client->Get(name, out, ferry::Version(version));
  });
}

int ferry_client_stat(ferry_client* c, const char* name, uint64_t version, int with_extents,
                      char** info) {
  return Call([&]() -> absl::Status {
    RETURN_IF_ERROR(Required(c, "client"));
    RETURN_IF_ERROR(Required(name, "name"));
    return ferry::Given(c->client->Stat(name, ferry::Version(version), with_extents != 0), info);
  });
}

int ferry_client_list(ferry_client* c, const char* prefix, size_t limit, char** list) {
  return Call([&]() -> absl::Status {
    RETURN_IF_ERROR(Required(c, "client"));
    RETURN_IF_ERROR(Required(list, "list"));
    ASSIGN_OR_RETURN(auto objects, c->client->List(Str(prefix), limit));
    nlohmann::json out = nlohmann::json::array();
    for (const ferry::ObjectInfo& o : objects) out.push_back(ferry::ToJson(o, false));
    *list = ferry::Dup(out.dump());
    return absl::OkStatus();
  });
}

int ferry_client_distribute(ferry_client* c, const char* spec, char** result) {
  return Call([&]() -> absl::Status {
    RETURN_IF_ERROR(Required(c, "client"));
    RETURN_IF_ERROR(Required(spec, "spec"));
    RETURN_IF_ERROR(Required(result, "result"));
    ASSIGN_OR_RETURN(nlohmann::json j, ferry::ParseRequestBody(spec, /*with_extents=*/false));
    ASSIGN_OR_RETURN(ferry::DistributeSpec s, ferry::DistributeSpecFromJson(j));
    ASSIGN_OR_RETURN(ferry::DistributeResult r, c->client->Distribute(s));
    *result = ferry::Dup(ferry::ToJson(r).dump());
    return absl::OkStatus();
  });
}

int ferry_client_remove(ferry_client* c, const char* name) {
  return Call([&]() -> absl::Status {
    RETURN_IF_ERROR(Required(c, "client"));
    RETURN_IF_ERROR(Required(name, "name"));
    return c->client->Remove(name);
  });
}

int ferry_client_publish(ferry_client* c, const char* name, const ferry_layout* layout, int replace,
                         int durable, const char* meta, char** info) {
  return Call([&]() -> absl::Status {
    RETURN_IF_ERROR(Required(c, "client"));
    RETURN_IF_ERROR(Required(name, "name"));
    ASSIGN_OR_RETURN(ferry::Layout l, ferry::LayoutOf(layout));
    return ferry::Given(c->client->Publish(name, l, replace != 0, durable != 0, Str(meta)), info);
  });
}

int ferry_client_pull(ferry_client* c, const ferry_pull_spec* spec, ferry_pull_stats* stats) {
  return Call([&]() -> absl::Status {
    RETURN_IF_ERROR(Required(c, "client"));
    ASSIGN_OR_RETURN(ferry::PullSpec s, ferry::SpecOf(spec));
    return ferry::Filled(c->client->Pull(s), stats);
  });
}

int ferry_node_start(const char* options, ferry_node** out) {
  return Call([&]() -> absl::Status {
    RETURN_IF_ERROR(Required(out, "out"));
    ASSIGN_OR_RETURN(ferry::EmbeddedNodeOptions o, ferry::NodeOptionsOf(options));
    ASSIGN_OR_RETURN(auto node, ferry::EmbeddedNode::Start(o));
    std::string url = node->url();
    *out = new ferry_node{std::move(node), std::move(url)};
    return absl::OkStatus();
  });
}

void ferry_node_stop(ferry_node* n) { delete n; }
const char* ferry_node_url(const ferry_node* n) { return n != nullptr ? n->url.c_str() : ""; }
const char* ferry_node_id(const ferry_node* n) { return n != nullptr ? n->node->id().c_str() : ""; }

int ferry_node_register(ferry_node* n, void* addr, uint64_t size, const char* device,
                        uint64_t* region) {
  return Call([&]() -> absl::Status {
    RETURN_IF_ERROR(Required(n, "node"));
    RETURN_IF_ERROR(Required(region, "region"));
    ASSIGN_OR_RETURN(ferry::Device d, ferry::Device::Parse(device != nullptr ? device : "host"));
    ASSIGN_OR_RETURN(*region, n->node->Register(addr, size, d));
    return absl::OkStatus();
  });
}

int ferry_node_unregister(ferry_node* n, uint64_t region) {
  return Call([&] { return n == nullptr ? Required(n, "node") : n->node->Unregister(region); });
}

int ferry_node_publish(ferry_node* n, const char* name, const ferry_layout* layout, int replace,
                       int durable, const char* meta, char** info) {
  return Call([&]() -> absl::Status {
    RETURN_IF_ERROR(Required(n, "node"));
    RETURN_IF_ERROR(Required(name, "name"));
    ASSIGN_OR_RETURN(ferry::Layout l, ferry::LayoutOf(layout));
    return ferry::Given(n->node->Publish(name, l, replace != 0, durable != 0, Str(meta)), info);
  });
}

int ferry_node_describe(ferry_node* n, const char* name, char** info) {
  return Call([&]() -> absl::Status {
    RETURN_IF_ERROR(Required(n, "node"));
    RETURN_IF_ERROR(Required(name, "name"));
    return ferry::Given(n->node->Describe(name), info);
  });
}

int ferry_node_remove(ferry_node* n, const char* name) {
  return Call([&]() -> absl::Status {
    RETURN_IF_ERROR(Required(n, "node"));
    RETURN_IF_ERROR(Required(name, "name"));
    return n->node->Remove(name);
  });
}

int ferry_node_prepare(ferry_node* n, const ferry_layout* layout, uint64_t* handle) {
  return Call([&]() -> absl::Status {
    RETURN_IF_ERROR(Required(n, "node"));
    RETURN_IF_ERROR(Required(handle, "handle"));
    ASSIGN_OR_RETURN(ferry::Layout l, ferry::LayoutOf(layout));
    ASSIGN_OR_RETURN(*handle, n->node->PrepareDestination(l));
    return absl::OkStatus();
  });
}

int ferry_node_release(ferry_node* n, uint64_t handle) {
  return Call(
      [&] { return n == nullptr ? Required(n, "node") : n->node->ReleaseDestination(handle); });
}

int ferry_node_pull(ferry_node* n, const ferry_pull_spec* spec, ferry_pull_stats* stats) {
  return Call([&]() -> absl::Status {
    RETURN_IF_ERROR(Required(n, "node"));
    ASSIGN_OR_RETURN(ferry::PullSpec s, ferry::SpecOf(spec));
    return ferry::Filled(n->node->Pull(s), stats);
  });
}

int ferry_node_pull_async(ferry_node* n, const ferry_pull_spec* spec, ferry_pull** out) {
  return Call([&]() -> absl::Status {
    RETURN_IF_ERROR(Required(n, "node"));
    RETURN_IF_ERROR(Required(out, "out"));
    ASSIGN_OR_RETURN(ferry::PullSpec s, ferry::SpecOf(spec));
    ASSIGN_OR_RETURN(auto future, n->node->PullAsync(s));
    *out = new ferry_pull{std::move(future)};
    return absl::OkStatus();
  });
}

int ferry_pull_wait(ferry_pull* p, int64_t timeout_ms, ferry_pull_stats* stats) {
  return Call([&]() -> absl::Status {
    RETURN_IF_ERROR(Required(p, "pull"));
    const absl::Time deadline =
        timeout_ms < 0 ? absl::InfiniteFuture() : absl::Now() + absl::Milliseconds(timeout_ms);
    return ferry::Filled(p->future->Wait(deadline), stats);
  });
}

int ferry_pull_done(ferry_pull* p) { return p != nullptr && p->future->Done() ? 1 : 0; }

int ferry_pull_cancel(ferry_pull* p, ferry_pull_stats* stats) {
  return Call([&]() -> absl::Status {
    RETURN_IF_ERROR(Required(p, "pull"));
    return ferry::Filled(p->future->Cancel(), stats);
  });
}

void ferry_pull_free(ferry_pull* p) {
  if (p == nullptr) return;
  if (!p->future->Done()) (void)p->future->Cancel();
  delete p;
}

}  // extern "C"
