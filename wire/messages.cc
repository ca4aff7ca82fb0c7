#include "wire/messages.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <limits>

#include "absl/base/casts.h"
#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "wire/http_status.h"

namespace ferry::wire {
namespace {

constexpr uint8_t kVersion = 1;

absl::Status Malformed(std::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(std::string(what), ": short or malformed"));
}

absl::Status Done(const ByteReader& in, std::string_view what) {
  if (!in.done())
    return absl::InvalidArgumentError(absl::StrCat(std::string(what), ": trailing bytes"));
  return absl::OkStatus();
}

// A u32 count, then the values; on a little-endian host they are the array's own bytes.
void EncodeU32s(const std::vector<uint32_t>& v, ByteWriter& out) {
  out.U32(static_cast<uint32_t>(v.size()));
  if constexpr (std::endian::native == std::endian::little) {
    if (!v.empty()) out.Raw({reinterpret_cast<const char*>(v.data()), v.size() * sizeof(v[0])});
  } else {
    for (uint32_t x : v) out.U32(x);
  }
}

bool DecodeU32s(ByteReader& in, std::vector<uint32_t>* v, uint64_t max) {
  uint32_t n = 0;
  if (!in.U32(&n) || n > max || n > in.left() / 4) return false;
  v->resize(n);
  if constexpr (std::endian::native == std::endian::little) {
    std::string_view raw;
    in.Raw(size_t{n} * sizeof(uint32_t), &raw);
    if (n > 0) std::memcpy(v->data(), raw.data(), raw.size());
  } else {
    for (uint32_t& x : *v) in.U32(&x);
  }
  return true;
}

// a * b + c without wrapping, or false.
bool MulAdd(uint64_t a, uint64_t b, uint64_t c, uint64_t* out) {
  if (b != 0 && a > (std::numeric_limits<uint64_t>::max() - c) / b) return false;
  *out = a * b + c;
  return true;
}

}  // namespace

std::string EncodeEnvelope(const Envelope& e) {
  std::string out;
  ByteWriter w(&out);
  w.U8(kVersion);
  w.U8(static_cast<uint8_t>(e.type));
  w.U64(e.id);
  Encode(e.from, w);
  w.Bytes(e.body);
  return out;
}

absl::StatusOr<Envelope> DecodeEnvelope(std::string_view bytes) {
  ByteReader in(bytes);
  Envelope e;
  uint8_t version = 0, type = 0;
  if (!in.U8(&version) || !in.U8(&type) || !in.U64(&e.id)) return Malformed("message");
  if (version != kVersion) {
    return absl::InvalidArgumentError(
        absl::StrCat("message of version ", version, "; this ferry speaks ", kVersion));
  }
  if (type < static_cast<uint8_t>(MessageType::kStat) ||
      type > static_cast<uint8_t>(MessageType::kReceiveDone)) {
    return absl::InvalidArgumentError(absl::StrCat("message of unknown type ", type));
  }
  e.type = static_cast<MessageType>(type);
  RETURN_IF_ERROR(Decode(in, &e.from));
  if (!in.Bytes(&e.body)) return Malformed("message");
  RETURN_IF_ERROR(Done(in, "message"));
  return e;
}

void Encode(const ObjectPart& p, ByteWriter& w) {
  w.U8(p.has_range ? 1 : 0);
  w.U64(p.offset);
  w.U64(p.length);
  EncodeU32s(p.extents, w);
}

bool Decode(ByteReader& in, ObjectPart* p, uint64_t max_pieces) {
  uint8_t has_range = 0;
  if (!in.U8(&has_range) || has_range > 1 || !in.U64(&p->offset) || !in.U64(&p->length) ||
      !DecodeU32s(in, &p->extents, max_pieces)) {
    return false;
  }
  p->has_range = has_range != 0;
  return true;
}

std::string Encode(const StatRequest& r) {
  std::string out;
  ByteWriter w(&out);
  w.Bytes(r.object);
  w.U64(r.version);
  Encode(r.part, w);
  return out;
}

absl::Status Decode(std::string_view b, StatRequest* r) {
  ByteReader in(b);
  if (!in.Bytes(&r->object) || !in.U64(&r->version) ||
      !Decode(in, &r->part, std::numeric_limits<uint32_t>::max())) {
    return Malformed("stat request");
  }
  return Done(in, "stat request");
}

std::string Encode(const NodeSummary& n) {
  std::string out;
  ByteWriter w(&out);
  w.Bytes(n.id);
  w.Bytes(n.version);
  w.Bytes(n.host);
  Encode(n.address, w);
  w.U8(n.sealed ? 1 : 0);
  return out;
}

absl::Status Decode(std::string_view b, NodeSummary* n) {
  ByteReader in(b);
  uint8_t sealed = 0;
  if (!in.Bytes(&n->id) || !in.Bytes(&n->version) || !in.Bytes(&n->host)) {
    return Malformed("node summary");
  }
  RETURN_IF_ERROR(Decode(in, &n->address));
  if (!in.U8(&sealed) || sealed > 1) return Malformed("node summary");
  n->sealed = sealed != 0;
  return Done(in, "node summary");
}

std::string Encode(const Receive& r) {
  std::string out;
  ByteWriter w(&out);
  w.U64(r.id);
  w.Bytes(r.object);
  w.U64(r.version);
  w.U64(r.size);
  w.U64(r.chunk_bytes);
  w.U32(static_cast<uint32_t>(r.upstream.size()));
  for (const std::string& u : r.upstream) w.Bytes(u);
  EncodeU32s(r.crc32c, w);
  w.Bytes(r.device);
  w.U64(r.timeout_ms);
  w.U8(r.durable ? 1 : 0);
  return out;
}

absl::Status Decode(std::string_view b, Receive* r, uint64_t max_chunks) {
  ByteReader in(b);
  uint32_t n = 0;
  if (!in.U64(&r->id) || !in.Bytes(&r->object) || !in.U64(&r->version) || !in.U64(&r->size) ||
      !in.U64(&r->chunk_bytes) || !in.U32(&n) || n > max_chunks || n > in.left() / 4) {
    return Malformed("receive");
  }
  r->upstream.resize(n);
  for (std::string& u : r->upstream) {
    if (!in.Bytes(&u)) return Malformed("receive");
  }
  uint8_t durable = 0;
  if (!DecodeU32s(in, &r->crc32c, max_chunks) || !in.Bytes(&r->device) || !in.U64(&r->timeout_ms) ||
      !in.U8(&durable) || durable > 1) {
    return Malformed("receive");
  }
  r->durable = durable != 0;
  return Done(in, "receive");
}

std::string Encode(const ReceiveStats& r) {
  std::string out;
  ByteWriter w(&out);
  w.U64(r.bytes);
  w.U64(absl::bit_cast<uint64_t>(r.seconds));
  w.U64(r.chunks);
  w.U64(r.refetched);
  w.U32(static_cast<uint32_t>(r.skipped.size()));
  for (const std::string& s : r.skipped) w.Bytes(s);
  w.U8(r.held_already ? 1 : 0);
  return out;
}

absl::Status Decode(std::string_view b, ReceiveStats* r) {
  ByteReader in(b);
  uint64_t seconds = 0;
  uint32_t n = 0;
  if (!in.U64(&r->bytes) || !in.U64(&seconds) || !in.U64(&r->chunks) || !in.U64(&r->refetched) ||
      !in.U32(&n) || n > in.left() / 4) {
    return Malformed("receive stats");
  }
  r->seconds = absl::bit_cast<double>(seconds);
  r->skipped.resize(n);
  for (std::string& s : r->skipped) {
    if (!in.Bytes(&s)) return Malformed("receive stats");
  }
  uint8_t held = 0;
  if (!in.U8(&held) || held > 1) return Malformed("receive stats");
  r->held_already = held != 0;
  return Done(in, "receive stats");
}

std::string Encode(const PullBatch& b) {
  std::string out;
  ByteWriter w(&out);
  w.U32(static_cast<uint32_t>(b.requests.size()));
  for (const auto& [id, request] : b.requests) {
    w.U64(id);
    w.Bytes(request);
  }
  return out;
}

absl::Status Decode(std::string_view b, PullBatch* batch, size_t max_requests) {
  ByteReader in(b);
  uint32_t n = 0;
  if (!in.U32(&n) || n > max_requests || n > in.left() / 12) return Malformed("pull batch");
  batch->requests.resize(n);
  for (auto& [id, request] : batch->requests) {
    if (!in.U64(&id) || !in.Bytes(&request)) return Malformed("pull batch");
  }
  return Done(in, "pull batch");
}

void Encode(const Layout& l, ByteWriter& out) {
  out.U32(static_cast<uint32_t>(l.runs().size()));
  for (const Layout::Run& r : l.runs()) {
    out.U8(static_cast<uint8_t>(r.kind));
    out.U64(r.region);
    out.U64(r.offset);
    out.U64(r.piece);
    if (r.kind == Layout::Run::Kind::kStrided) {
      out.U64(r.stride);
      out.U64(r.count);
    }
  }
  const std::vector<uint32_t>& pages = l.page_ids();
  EncodeU32s(pages, out);
  // Which page ids each page run takes is implied: runs take them in order, `count` each.
  for (const Layout::Run& r : l.runs()) {
    if (r.kind == Layout::Run::Kind::kPages) out.U64(r.count);
  }
}

absl::Status Decode(ByteReader& in, Layout* l, uint64_t max_pieces) {
  uint32_t nruns = 0;
  // Every run takes at least 25 bytes.
  if (!in.U32(&nruns) || nruns > max_pieces || nruns > in.left() / 25) return Malformed("layout");
  std::vector<Layout::Run> runs(nruns);
  for (Layout::Run& r : runs) {
    uint8_t kind = 0;
    if (!in.U8(&kind) || kind > 2 || !in.U64(&r.region) || !in.U64(&r.offset) ||
        !in.U64(&r.piece)) {
      return Malformed("layout");
    }
    r.kind = static_cast<Layout::Run::Kind>(kind);
    if (r.kind == Layout::Run::Kind::kStrided && (!in.U64(&r.stride) || !in.U64(&r.count))) {
      return Malformed("layout");
    }
  }
  std::vector<uint32_t> pages;
  if (!DecodeU32s(in, &pages, max_pieces)) return Malformed("layout");
  uint64_t pieces = 0, bytes = 0, page = 0;
  Layout out;
  for (Layout::Run& r : runs) {
    uint64_t count = 1;
    if (r.kind == Layout::Run::Kind::kStrided) count = r.count;
    if (r.kind == Layout::Run::Kind::kPages && !in.U64(&count)) return Malformed("layout");
    if (r.piece == 0 || count == 0) {
      return absl::InvalidArgumentError("layout: a piece of 0 bytes, or a run of none");
    }
    if (count > max_pieces - pieces) {
      return absl::InvalidArgumentError(
          absl::StrCat("layout of more than ", max_pieces, " pieces"));
    }
    pieces += count;
    uint64_t run_bytes = 0;
    if (!MulAdd(r.piece, count, 0, &run_bytes) || !MulAdd(1, bytes, run_bytes, &bytes)) {
      return absl::InvalidArgumentError("layout: its size overflows 2^64 bytes");
    }
    switch (r.kind) {
      case Layout::Run::Kind::kExtent:
        out.Add({r.region, r.offset, r.piece});
        break;
      case Layout::Run::Kind::kStrided: {
        uint64_t last = 0;
        if (!MulAdd(r.stride, count - 1, r.offset, &last) || last + r.piece < last) {
          return absl::InvalidArgumentError("layout: a strided run overflows 2^64");
        }
        out.AddStrided(r.region, r.offset, r.piece, r.stride, count);
        break;
      }
      case Layout::Run::Kind::kPages: {
        if (count > pages.size() - page) return Malformed("layout");
        std::vector<uint32_t> ids(pages.begin() + static_cast<ptrdiff_t>(page),
                                  pages.begin() + static_cast<ptrdiff_t>(page + count));
        page += count;
        // The highest page ends last.
        uint64_t end = 0;
        if (!MulAdd(*std::max_element(ids.begin(), ids.end()), r.piece, r.offset, &end) ||
            end + r.piece < end) {
          return absl::InvalidArgumentError("layout: a page overflows 2^64");
        }
        out.AddPages(r.region, r.offset, r.piece, ids);
        break;
      }
    }
  }
  if (page != pages.size()) return Malformed("layout");
  *l = std::move(out);
  return absl::OkStatus();
}

std::optional<uint8_t> PeekPullPath(std::string_view b) {
  ByteReader in(b);
  std::string_view object;
  uint64_t version;
  uint8_t path;
  if (!in.Bytes(&object) || !in.U64(&version) || !in.U8(&path)) return std::nullopt;
  return path;
}

std::string Encode(const PullRequest& r) {
  std::string out;
  ByteWriter w(&out);
  w.Bytes(r.object);
  w.U64(r.version);
  w.U8(r.path);
  w.U64(r.timeout_ms);
  Encode(r.part, w);
  w.U32(static_cast<uint32_t>(r.regions.size()));
  for (const RegionDescriptor& d : r.regions) Encode(d, w);
  Encode(r.layout, w);
  w.U64(r.prepared);
  w.U64(r.prepared_epoch);
  w.U8(r.defines_prepared ? 1 : 0);
  EncodeU32s(r.indices, w);
  w.U64(r.layout_ref);
  w.U8(r.defines_layout ? 1 : 0);
  w.U8(r.staged ? 1 : 0);
  if (r.staged) {
    Encode(r.staging.region, w);
    w.U32(r.staging.slots);
    w.U64(r.staging.slot_bytes);
    w.U32(r.staging.tag);
  }
  w.U32(r.immediate);
  return out;
}

absl::Status Decode(std::string_view b, PullRequest* r, uint64_t max_pieces) {
  ByteReader in(b);
  uint8_t defines = 0, defines_layout = 0, staged = 0;
  uint32_t nregions = 0;
  if (!in.Bytes(&r->object) || !in.U64(&r->version) || !in.U8(&r->path) ||
      !in.U64(&r->timeout_ms) || !Decode(in, &r->part, max_pieces) || !in.U32(&nregions) ||
      nregions > max_pieces || nregions > in.left() / 16) {
    return Malformed("pull request");
  }
  r->regions.resize(nregions);
  for (RegionDescriptor& d : r->regions) RETURN_IF_ERROR(Decode(in, &d));
  RETURN_IF_ERROR(Decode(in, &r->layout, max_pieces));
  if (!in.U64(&r->prepared) || !in.U64(&r->prepared_epoch) || !in.U8(&defines) || defines > 1 ||
      !DecodeU32s(in, &r->indices, max_pieces) || !in.U64(&r->layout_ref) ||
      !in.U8(&defines_layout) || defines_layout > 1 || !in.U8(&staged) || staged > 1) {
    return Malformed("pull request");
  }
  r->defines_prepared = defines != 0;
  r->defines_layout = defines_layout != 0;
  if ((r->defines_layout && r->layout_ref == 0) || (r->layout_ref != 0 && r->prepared != 0)) {
    return Malformed("pull request");
  }
  r->staged = staged != 0;
  if (r->staged) {
    RETURN_IF_ERROR(Decode(in, &r->staging.region));
    if (!in.U32(&r->staging.slots) || !in.U64(&r->staging.slot_bytes) || !in.U32(&r->staging.tag)) {
      return Malformed("pull request");
    }
  }
  if (!in.U32(&r->immediate)) return Malformed("pull request");
  return Done(in, "pull request");
}

std::string Encode(const ObjectInfo& o) {
  std::string out;
  ByteWriter w(&out);
  w.Bytes(o.name);
  w.U64(o.version);
  w.U64(o.size);
  w.U64(static_cast<uint64_t>(o.created_ms));
  w.U8(static_cast<uint8_t>((o.durable ? 1 : 0) | (o.detached ? 2 : 0) | (o.on_rails ? 4 : 0)));
  w.U32(static_cast<uint32_t>(o.devices.size()));
  for (const Device& d : o.devices) w.Bytes(d.ToString());
  return out;
}

absl::Status Decode(std::string_view b, ObjectInfo* o) {
  ByteReader in(b);
  uint64_t created = 0;
  uint8_t flags = 0;
  uint32_t ndevices = 0;
  if (!in.Bytes(&o->name) || !in.U64(&o->version) || !in.U64(&o->size) || !in.U64(&created) ||
      !in.U8(&flags) || !in.U32(&ndevices) || ndevices > 1024) {
    return Malformed("object");
  }
  o->created_ms = static_cast<int64_t>(created);
  o->durable = flags & 1;
  o->detached = flags & 2;
  o->on_rails = flags & 4;
  o->devices.clear();
  for (uint32_t i = 0; i < ndevices; ++i) {
    std::string_view name;
    if (!in.Bytes(&name)) return Malformed("object");
    ASSIGN_OR_RETURN(Device d, Device::Parse(name));
    o->devices.push_back(d);
  }
  return Done(in, "object");
}

std::string Encode(const PullStats& s) {
  std::string out;
  ByteWriter w(&out);
  w.Bytes(s.object);
  w.U64(s.version);
  w.U64(s.bytes);
  uint64_t seconds_bits = 0;
  static_assert(sizeof(double) == 8);
  std::memcpy(&seconds_bits, &s.seconds, 8);
  w.U64(seconds_bits);
  w.Bytes(s.path);
  w.U32(static_cast<uint32_t>(s.bytes_per_rail.size()));
  for (uint64_t v : s.bytes_per_rail) w.U64(v);
  w.U64(s.rerouted_writes);
  w.U32(static_cast<uint32_t>(s.failed_rails.size()));
  for (size_t r : s.failed_rails) w.U32(static_cast<uint32_t>(r));
  w.U32(static_cast<uint32_t>(s.rail_seconds.size()));
  for (double d : s.rail_seconds) {
    uint64_t bits = 0;
    std::memcpy(&bits, &d, 8);
    w.U64(bits);
  }
  return out;
}

absl::Status Decode(std::string_view b, PullStats* s) {
  ByteReader in(b);
  uint64_t seconds_bits = 0, rerouted = 0;
  uint32_t n = 0;
  if (!in.Bytes(&s->object) || !in.U64(&s->version) || !in.U64(&s->bytes) ||
      !in.U64(&seconds_bits) || !in.Bytes(&s->path) || !in.U32(&n) || n > 4096 ||
      n > in.left() / 8) {
    return Malformed("pull stats");
  }
  std::memcpy(&s->seconds, &seconds_bits, 8);
  s->bytes_per_rail.resize(n);
  for (uint64_t& v : s->bytes_per_rail) in.U64(&v);
  if (!in.U64(&rerouted) || !in.U32(&n) || n > 4096 || n > in.left() / 4) {
    return Malformed("pull stats");
  }
  s->rerouted_writes = rerouted;
  s->failed_rails.resize(n);
  for (size_t& r : s->failed_rails) {
    uint32_t v = 0;
    in.U32(&v);
    r = v;
  }
  if (!in.U32(&n) || n > 4096 || n > in.left() / 8) return Malformed("pull stats");
  s->rail_seconds.resize(n);
  for (double& d : s->rail_seconds) {
    uint64_t bits = 0;
    in.U64(&bits);
    std::memcpy(&d, &bits, 8);
  }
  return Done(in, "pull stats");
}

std::string Encode(const absl::Status& s) {
  std::string out;
  ByteWriter w(&out);
  w.U8(static_cast<uint8_t>(s.code()));
  w.U16(static_cast<uint16_t>(HttpStatusOverride(s).value_or(0)));
  w.Bytes(std::string_view(s.message().data(), s.message().size()));
  return out;
}

absl::Status DecodeStatus(std::string_view b, absl::Status* s) {
  ByteReader in(b);
  uint8_t code = 0;
  uint16_t http = 0;
  std::string_view message;
  if (!in.U8(&code) || code == 0 || code > 16 || !in.U16(&http) || !in.Bytes(&message)) {
    return Malformed("error answer");
  }
  RETURN_IF_ERROR(Done(in, "error answer"));
  const std::string text(message);
  if (http == 409 && code == static_cast<uint8_t>(absl::StatusCode::kFailedPrecondition)) {
    *s = Conflict(text);
  } else if (http == 413) {
    *s = TooLarge(text);
  } else {
    *s = absl::Status(static_cast<absl::StatusCode>(code), text);
  }
  return absl::OkStatus();
}

std::string Encode(const Credit& c) {
  std::string out;
  ByteWriter w(&out);
  w.U32(c.tag);
  w.U64(c.chunk);
  return out;
}

absl::Status Decode(std::string_view b, Credit* c) {
  ByteReader in(b);
  if (!in.U32(&c->tag) || !in.U64(&c->chunk)) return Malformed("credit");
  return Done(in, "credit");
}

std::string EncodeId(uint64_t id) {
  std::string out;
  ByteWriter(&out).U64(id);
  return out;
}

absl::Status DecodeId(std::string_view b, uint64_t* id) {
  ByteReader in(b);
  if (!in.U64(id)) return Malformed("request id");
  return Done(in, "request id");
}

}  // namespace ferry::wire
