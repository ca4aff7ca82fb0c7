// Messages between nodes: what a destination asks of a source (describe an object, pull it,
// cancel a pull, free a staging slot) and the answers, with their binary codec. They travel as
// control messages over the rails the nodes share, or as the body of POST /v1/peer when the
// fabric cannot reach the peer. Format: docs/wire_format.md. Plain data; thread-compatible.
#ifndef FERRY_WIRE_MESSAGES_H_
#define FERRY_WIRE_MESSAGES_H_

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/bytes.h"
#include "ferry/layout.h"
#include "ferry/types.h"
#include "wire/region.h"

namespace ferry::wire {

enum class MessageType : uint8_t {
  kStat = 1,          // destination -> source: StatRequest
  kStatAnswer = 2,    // ObjectInfo (no extents)
  kPull = 3,          // PullRequest
  kPullDone = 4,      // PullStats
  kError = 5,         // the request failed: its Status
  kCancel = 6,        // stop request `id`
  kCancelDone = 7,    // no WRITE of request `id` can land any more
  kCredit = 8,        // staged path: a slot the destination has emptied (Credit); no answer
  kHello = 9,         // first contact: who are you (no body)
  kHelloAnswer = 10,  // NodeSummary
  kPullBatch = 11,    // several PullRequests, each answered on its own (PullBatch)
  kQuery = 12,        // destination -> source: what of request `id` (body)? Answered with the
                      // request's own answer when it has ended, kRunning while it runs, and
                      // kUnknownRequest when the source never had it
  kRunning = 13,
  kUnknownRequest = 14,
  kReceive = 15,      // a distribution's coordinator -> a receiver: Receive; answered kRunning
                      // (taken) or kError at once, its end then asked with kQuery
  kReceiveDone = 16,  // ReceiveStats: the receive's end, as kQuery's answer
};

// The content type of POST /v1/peer bodies and answers.
inline constexpr char kMessageContentType[] = "application/vnd.ferry.message";

// Every message: who sends it, how to reach the sender over the fabric (so a source can write
// back to a destination it has not met), which request it is or answers, and its body.
struct Envelope {
  MessageType type = MessageType::kError;
  uint64_t id = 0;  // the destination's request id; answers carry the request's
  PeerAddress from;
  std::string body;
};

// Bytes a pull takes from the object: all of it, a byte range, or some of its extents.
struct ObjectPart {
  bool has_range = false;
  uint64_t offset = 0;
  uint64_t length = 0;
  std::vector<uint32_t> extents;  // indices into the object's extents, in the order to take
  bool whole() const { return !has_range && extents.empty(); }
};

// The answer's size is the part's.
struct StatRequest {
  std::string object;
  uint64_t version = 0;  // 0: the latest
  ObjectPart part;
};

struct StagingRing {
  RegionDescriptor region;  // the destination's ring, as a window
  uint32_t slots = 0;
  uint64_t slot_bytes = 0;
  uint32_t tag = 0;  // immediates tag + slot mark each slot's chunk
};

struct PullRequest {
  std::string object;
  uint64_t version = 0;  // 0: the latest
  uint8_t path = 0;      // 0 rdma, 1 cuda_ipc, 2 staged (server::PullPath)
  uint64_t timeout_ms = 0;
  ObjectPart part;
  // Where the bytes go: `layout`, whose regions are indices into `regions` (windows the
  // destination opened for this pull, or for a prepared destination).
  std::vector<RegionDescriptor> regions;
  Layout layout;
  // A prepared destination of the destination node instead: its handle, its epoch, its pieces
  // to fill (all, in order, when `indices` is empty), and whether regions + layout above define
  // it (sent again only when the source does not know this epoch of it).
  uint64_t prepared = 0;
  uint64_t prepared_epoch = 0;
  bool defines_prepared = false;
  std::vector<uint32_t> indices;
  // A layout this destination has shown this source before, named by its number in their
  // session (0: none): `layout` is then empty, unless `defines_layout` (the source does not
  // know the number yet, or forgot it). `regions` are this pull's windows either way.
  uint64_t layout_ref = 0;
  bool defines_layout = false;
  bool staged = false;
  StagingRing staging;
  uint32_t immediate = 0;  // rdma: the tag of the WRITE that lands last (0: none)
};

// What first contact learns of a node.
struct NodeSummary {
  std::string id;
  std::string version;
  std::string host;  // HostId()
  PeerAddress address;
  bool sealed = false;  // it seals and checks node-to-node messages
};

// Pulls that go to one source in one message: each with the request id its answer carries.
struct PullBatch {
  std::vector<std::pair<uint64_t, std::string>> requests;  // id, encoded PullRequest
};

// A receiver's part in a distribution: take `object` version `version` (`size` bytes) in
// chunks of `chunk_bytes` from the first node of `upstream` that has them (nodes before this
// one in the chain, nearest first; the last is the source), serving the chunks it has while it
// receives, and hold it as that version.
struct Receive {
  uint64_t id = 0;  // the coordinator's, for its kQuery and kCancel
  std::string object;
  uint64_t version = 0;
  uint64_t size = 0;
  uint64_t chunk_bytes = 0;
  std::vector<std::string> upstream;  // URLs
  std::vector<uint32_t> crc32c;       // per chunk; empty: not checked
  std::string device;                 // Device::ToString() of where it goes
  uint64_t timeout_ms = 0;
  bool durable = true;
};

// How a receive went.
struct ReceiveStats {
  uint64_t bytes = 0;
  double seconds = 0;
  uint64_t chunks = 0;
  uint64_t refetched = 0;            // chunks pulled again (an upstream failed, a bad checksum)
  std::vector<std::string> skipped;  // upstreams it gave up on, each with why
  bool held_already = false;         // it had the version before
};

struct Credit {
  uint32_t tag = 0;
  uint64_t chunk = 0;
};

// Envelope codec. DecodeEnvelope: kInvalidArgument on short or malformed input.
std::string EncodeEnvelope(const Envelope& e);
absl::StatusOr<Envelope> DecodeEnvelope(std::string_view bytes);

std::string Encode(const StatRequest& r);
std::string Encode(const PullRequest& r);
std::string Encode(const ObjectInfo& o);  // without extents
std::string Encode(const PullStats& s);
std::string Encode(const absl::Status& s);  // code, message and an HTTP status override
std::string Encode(const Credit& c);
std::string Encode(const NodeSummary& n);
std::string Encode(const PullBatch& b);
std::string Encode(const Receive& r);
std::string Encode(const ReceiveStats& r);
std::string EncodeId(uint64_t id);  // kCancel, kCancelDone: the request id

// Decoders: kInvalidArgument on short, malformed or trailing input. Layouts, extent and index
// lists of more than `max_pieces` pieces are refused (kInvalidArgument) before any is stored.
absl::Status Decode(std::string_view b, StatRequest* r);
absl::Status Decode(std::string_view b, PullRequest* r, uint64_t max_pieces);
absl::Status Decode(std::string_view b, ObjectInfo* o);
absl::Status Decode(std::string_view b, PullStats* s);
// The decoded status, or kInvalidArgument when the body is malformed.
absl::Status DecodeStatus(std::string_view b, absl::Status* s);
absl::Status Decode(std::string_view b, Credit* c);
absl::Status Decode(std::string_view b, NodeSummary* n);
// kInvalidArgument past `max_requests` requests.
absl::Status Decode(std::string_view b, PullBatch* batch, size_t max_requests);
absl::Status DecodeId(std::string_view b, uint64_t* id);
// kInvalidArgument past `max_chunks` chunks, or upstreams.
absl::Status Decode(std::string_view b, Receive* r, uint64_t max_chunks);
absl::Status Decode(std::string_view b, ReceiveStats* r);
// The path of an encoded PullRequest, read without decoding the rest; nullopt when `b` is too
// short to say.
std::optional<uint8_t> PeekPullPath(std::string_view b);

// Layout codec (also used by the catalog's records).
void Encode(const Layout& l, ByteWriter& out);
absl::Status Decode(ByteReader& in, Layout* l, uint64_t max_pieces);

}  // namespace ferry::wire

#endif  // FERRY_WIRE_MESSAGES_H_
