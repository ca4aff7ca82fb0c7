/* ferry's C ABI (libferry.so): the client and the embedded node of ferry/client.h and
 * ferry/node.h for C and for bindings (Python's ctypes, Rust, Go).
 *
 * Every call that can fail returns a status code, abseil's numbers (FERRY_OK is 0); after a
 * failure, ferry_last_error() gives the message, for the calling thread. No C++ type or
 * exception crosses this header. Strings and buffers the library allocates (char** outputs)
 * are the caller's, freed with ferry_free(). Handles are opaque; each is closed by its one
 * *_close, *_stop or *_free call. A client is thread-compatible (one per thread), a node and a
 * pull are thread-safe. Descriptions of objects come as JSON, as GET /v1/objects/{name} gives
 * them (docs/http_api.md). Before 1.0 a minor release may change this ABI (the structs'
 * layouts too): build against the header of the libferry.so you load (ferry_version). */
#ifndef FERRY_FERRY_H_
#define FERRY_FERRY_H_

#include <stddef.h>
#include <stdint.h>

#if defined(__GNUC__)
#define FERRY_API __attribute__((visibility("default")))
#else
#define FERRY_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

enum ferry_code {
  FERRY_OK = 0,
  FERRY_CANCELLED = 1,
  FERRY_UNKNOWN = 2,
  FERRY_INVALID_ARGUMENT = 3,
  FERRY_DEADLINE_EXCEEDED = 4,
  FERRY_NOT_FOUND = 5,
  FERRY_ALREADY_EXISTS = 6,
  FERRY_PERMISSION_DENIED = 7,
  FERRY_RESOURCE_EXHAUSTED = 8,
  FERRY_FAILED_PRECONDITION = 9,
  FERRY_ABORTED = 10,
  FERRY_OUT_OF_RANGE = 11,
  FERRY_UNIMPLEMENTED = 12,
  FERRY_INTERNAL = 13,
  FERRY_UNAVAILABLE = 14,
  FERRY_DATA_LOSS = 15,
  FERRY_UNAUTHENTICATED = 16
};

/* The message of this thread's last failed call ("" before any). Valid until this thread's
 * next call into the library. */
FERRY_API const char* ferry_last_error(void);
/* Frees what the library allocated for the caller (NULL: nothing). */
FERRY_API void ferry_free(void* p);
/* The release, "MAJOR.MINOR.PATCH". */
FERRY_API const char* ferry_version(void);

/* A layout (ferry/layout.h): runs of pieces of registered regions, in order. */
enum ferry_run_kind { FERRY_RUN_EXTENT = 0, FERRY_RUN_STRIDED = 1, FERRY_RUN_PAGES = 2 };
typedef struct ferry_run {
  uint32_t kind;   /* enum ferry_run_kind */
  uint32_t unused; /* 0 */
  uint64_t region;
  uint64_t offset; /* EXTENT, STRIDED: the first piece's; PAGES: the pool's start */
  uint64_t piece;  /* bytes per piece (PAGES: the page size) */
  uint64_t stride; /* STRIDED: from one piece's start to the next's */
  uint64_t count;  /* STRIDED: pieces; PAGES: page ids taken in turn from page_ids */
} ferry_run;
typedef struct ferry_layout {
  const ferry_run* runs;
  size_t n_runs;
  const uint32_t* page_ids; /* the PAGES runs' page ids, one run after the other */
  size_t n_page_ids;
} ferry_layout;

/* A pull (ferry/pull.h). Zero it, then set what it needs. Where the bytes go, exactly one
 * of: new_buffer_device, `into` (runs), `prepared`. */
typedef struct ferry_pull_spec {
  const char*
      from; /* the source node, http://host:port; NULL or "": a holder the directory names */
  const char* object;
  uint64_t version;                    /* 0: the latest */
  uint64_t range_offset, range_length; /* part of the object when range_length > 0 */
  const uint32_t* source_extents;      /* or these extents of it, in this order */
  size_t n_source_extents;
  const char* new_buffer_device; /* "host" or "cuda:N": a new buffer, published as `as` */
  const char* as;                /* NULL: the object's name */
  int replace;
  int durable; /* 0: ephemeral (the new buffer's object) */
  ferry_layout into;
  uint64_t prepared;       /* a handle of ferry_node_prepare */
  const uint32_t* indices; /* its pieces to fill (NULL: all) */
  size_t n_indices;
  const char* path;    /* NULL or "auto", "rdma", "cuda_ipc", "staged" */
  uint64_t timeout_ms; /* 0: the node's default */
} ferry_pull_spec;

/* What a pull did (ferry::PullStats). */
typedef struct ferry_pull_stats {
  uint64_t version;
  uint64_t bytes;
  double seconds;
  uint64_t rerouted_writes;
  uint64_t region; /* the new buffer's region id, for a pull into one; else 0 */
  char path[16];   /* "rdma", "cuda_ipc", "staged" */
  char via[16];    /* "fabric", "http", "local" */
  /* A pull by name (no `from`): the URL of the holder the bytes came from (cut at 255 bytes);
   * "" otherwise. */
  char source[256];
  /* A pull by name that went past holders that failed: a JSON array of "node at url: why",
   * the caller's (ferry_free); NULL otherwise. */
  char* tried;
} ferry_pull_stats;

/* ---- A node's HTTP API (ferry::Client) ---- */
typedef struct ferry_client ferry_client;

/* token: NULL or "" for none. */
FERRY_API int ferry_client_open(const char* url, const char* token, ferry_client** out);
FERRY_API void ferry_client_close(ferry_client* c);
FERRY_API int ferry_client_health(ferry_client* c);
/* Uploads `size` bytes into a new buffer on `device` (NULL: "host"); meta: NULL or JSON text.
 * *info (if info is not NULL): the new version's description. */
FERRY_API int ferry_client_put(ferry_client* c, const char* name, const void* data, size_t size,
                               const char* device, int replace, const char* meta, char** info);
/* Uploads the file at `path`; with `safetensors`, a safetensors checkpoint: its tensors' bytes,
 * with their table as the meta (docs/tensors.md). */
FERRY_API int ferry_client_put_file(ferry_client* c, const char* name, const char* path,
                                    const char* device, int replace, int safetensors, char** info);
/* The object's bytes (version 0: the latest) in *data (ferry_free it), *size of them. */
FERRY_API int ferry_client_get(ferry_client* c, const char* name, uint64_t version, char** data,
                               size_t* size);
FERRY_API int ferry_client_get_file(ferry_client* c, const char* name, uint64_t version,
                                    const char* path);
/* with_extents 0: the description without the layout (shorter for a big one). */
FERRY_API int ferry_client_stat(ferry_client* c, const char* name, uint64_t version,
                                int with_extents, char** info);
/* *list: a JSON array of descriptions. */
FERRY_API int ferry_client_list(ferry_client* c, const char* prefix, size_t limit, char** list);
FERRY_API int ferry_client_remove(ferry_client* c, const char* name);
/* Asks the client's node to deliver an object version to many nodes at once: `spec` is the
 * JSON body of POST /v1/distribute, *result its JSON answer (docs/http_api.md). */
FERRY_API int ferry_client_distribute(ferry_client* c, const char* spec, char** result);
FERRY_API int ferry_client_publish(ferry_client* c, const char* name, const ferry_layout* layout,
                                   int replace, int durable, const char* meta, char** info);
/* Asks the client's node to pull as `spec` says. */
FERRY_API int ferry_client_pull(ferry_client* c, const ferry_pull_spec* spec,
                                ferry_pull_stats* stats);

/* ---- A node in this process (ferry::EmbeddedNode) ---- */
typedef struct ferry_node ferry_node;
typedef struct ferry_pull ferry_pull;

/* options: NULL or a JSON object of ferry::EmbeddedNodeOptions' fields: data_dir, provider,
 * domains, rails, listen, token, peer_transport, sync. */
FERRY_API int ferry_node_start(const char* options, ferry_node** out);
/* Stops serving, waits for running pulls, closes the node. */
FERRY_API void ferry_node_stop(ferry_node* n);
/* Valid while the node runs. */
FERRY_API const char* ferry_node_url(const ferry_node* n);
FERRY_API const char* ferry_node_id(const ferry_node* n);
/* device: NULL or "host", "cuda:N". The memory must stay valid until unregistered. */
FERRY_API int ferry_node_register(ferry_node* n, void* addr, uint64_t size, const char* device,
                                  uint64_t* region);
FERRY_API int ferry_node_unregister(ferry_node* n, uint64_t region);
FERRY_API int ferry_node_publish(ferry_node* n, const char* name, const ferry_layout* layout,
                                 int replace, int durable, const char* meta, char** info);
FERRY_API int ferry_node_describe(ferry_node* n, const char* name, char** info);
FERRY_API int ferry_node_remove(ferry_node* n, const char* name);
FERRY_API int ferry_node_prepare(ferry_node* n, const ferry_layout* layout, uint64_t* handle);
FERRY_API int ferry_node_release(ferry_node* n, uint64_t handle);
FERRY_API int ferry_node_pull(ferry_node* n, const ferry_pull_spec* spec, ferry_pull_stats* stats);
/* Returns once the request is on its way; *out is freed with ferry_pull_free. */
FERRY_API int ferry_node_pull_async(ferry_node* n, const ferry_pull_spec* spec, ferry_pull** out);
/* timeout_ms < 0: until it ends. FERRY_DEADLINE_EXCEEDED when it has not (it goes on). */
FERRY_API int ferry_pull_wait(ferry_pull* p, int64_t timeout_ms, ferry_pull_stats* stats);
/* 1 when it has ended. */
FERRY_API int ferry_pull_done(ferry_pull* p);
/* Returns once no WRITE of the pull can land any more. */
FERRY_API int ferry_pull_cancel(ferry_pull* p, ferry_pull_stats* stats);
/* Frees the handle; a pull still running is cancelled first. */
FERRY_API void ferry_pull_free(ferry_pull* p);

#ifdef __cplusplus
}
#endif

#endif /* FERRY_FERRY_H_ */
