#include "wire/api_json.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "wire/extents.h"
#include "wire/http_status.h"

namespace ferry {
namespace {

absl::StatusOr<const nlohmann::json*> Field(const nlohmann::json& j, const char* name) {
  auto it = j.find(name);
  if (it == j.end()) return absl::InvalidArgumentError(absl::StrCat("\"", name, "\" is missing"));
  return &*it;
}

absl::StatusOr<std::vector<Device>> DevicesFromJson(const nlohmann::json& j) {
  std::vector<Device> out;
  if (!j.is_array()) return absl::InvalidArgumentError("\"devices\" must be an array");
  for (const auto& d : j) {
    if (!d.is_string()) return absl::InvalidArgumentError("a device must be a string");
    ASSIGN_OR_RETURN(Device device, Device::Parse(d.get<std::string>()));
    out.push_back(device);
  }
  return out;
}

absl::StatusOr<std::vector<uint32_t>> Indices(const nlohmann::json& j, const char* what,
                                              uint64_t max) {
  if (!j.is_array())
    return absl::InvalidArgumentError(absl::StrCat("\"", what, "\" must be an array"));
  if (j.size() > max) return TooLarge(absl::StrCat("\"", what, "\" holds more than ", max));
  std::vector<uint32_t> out;
  out.reserve(j.size());
  for (const auto& i : j) {
    if (!i.is_number_unsigned() || i.get<uint64_t>() > UINT32_MAX) {
      return absl::InvalidArgumentError(
          absl::StrCat("\"", what, "\" holds unsigned 32-bit integers"));
    }
    out.push_back(i.get<uint32_t>());
  }
  return out;
}

}  // namespace

nlohmann::json ToJson(const ObjectInfo& o, bool with_extents) {
  nlohmann::json devices = nlohmann::json::array();
  for (const Device& d : o.devices) devices.push_back(d.ToString());
  nlohmann::json j = {{"name", o.name},       {"version", o.version},
                      {"size", o.size},       {"created_ms", o.created_ms},
                      {"durable", o.durable}, {"detached", o.detached},
                      {"devices", devices},   {"on_rails", o.on_rails}};
  // Valid JSON: the node checked it at publish.
  if (!o.meta.empty()) j["meta"] = nlohmann::json::parse(o.meta, nullptr, false);
  if (!o.content_type.empty()) j["content_type"] = o.content_type;
  if (o.crc32c) j["crc32c"] = Crc32cHex(*o.crc32c);
  if (with_extents) {
    nlohmann::json extents = nlohmann::json::array();
    for (const Extent& e : o.extents) {
      extents.push_back({{"region", e.region}, {"offset", e.offset}, {"length", e.length}});
    }
    j["extents"] = std::move(extents);
  }
  return j;
}

absl::StatusOr<ObjectInfo> ObjectInfoFromJson(const nlohmann::json& j) {
  if (!j.is_object()) return absl::InvalidArgumentError("an object description must be an object");
  ObjectInfo o;
  ASSIGN_OR_RETURN(const nlohmann::json* name, Field(j, "name"));
  if (!name->is_string()) return absl::InvalidArgumentError("\"name\" must be a string");
  o.name = name->get<std::string>();
  ASSIGN_OR_RETURN(o.version, UnsignedField(j, "version"));
  ASSIGN_OR_RETURN(o.size, UnsignedField(j, "size"));
  o.created_ms = j.value("created_ms", int64_t{0});
  o.durable = j.value("durable", true);
  o.detached = j.value("detached", false);
  o.on_rails = j.value("on_rails", true);
  if (j.contains("devices")) {
    ASSIGN_OR_RETURN(o.devices, DevicesFromJson(j["devices"]));
  }
  if (j.contains("extents")) {
    ASSIGN_OR_RETURN(o.extents, ExtentsFromJson(j["extents"]));
  }
  if (j.contains("meta")) o.meta = j["meta"].dump();
  if (j.contains("content_type") && j["content_type"].is_string()) {
    o.content_type = j["content_type"].get<std::string>();
  }
  if (j.contains("crc32c") && j["crc32c"].is_string()) {
    uint32_t crc = 0;
    if (absl::SimpleHexAtoi(j["crc32c"].get<std::string>(), &crc)) o.crc32c = crc;
  }
  return o;
}

nlohmann::json ToJson(const PullStats& s) {
  nlohmann::json j = {
      {"object", s.object},
      {"version", s.version},
      {"bytes", s.bytes},
      {"seconds", s.seconds},
      {"path", s.path},
      {"via", s.via},
      {"bytes_per_rail", s.bytes_per_rail},
      {"rerouted_writes", s.rerouted_writes},
      {"failed_rails", s.failed_rails},
      {"rail_seconds", s.rail_seconds},
      {"gbps", s.seconds > 0 ? static_cast<double>(s.bytes) * 8 / s.seconds / 1e9 : 0.0}};
  if (s.region) j["region"] = *s.region;
  if (!s.fallback.empty()) j["fallback"] = s.fallback;
  // A pull by name says which holder delivered and which failed before it.
  if (!s.source.empty()) {
    j["source"] = s.source;
    j["tried"] = s.tried;
  }
  return j;
}

absl::StatusOr<PullStats> PullStatsFromJson(const nlohmann::json& j) {
  if (!j.is_object()) return absl::InvalidArgumentError("pull stats must be an object");
  PullStats s;
  try {
    s.object = j.value("object", std::string());
    s.version = j.value("version", uint64_t{0});
    s.bytes = j.value("bytes", uint64_t{0});
    s.seconds = j.value("seconds", 0.0);
    s.path = j.value("path", std::string());
    s.via = j.value("via", std::string());
    s.fallback = j.value("fallback", std::string());
    if (j.contains("bytes_per_rail")) {
      s.bytes_per_rail = j["bytes_per_rail"].get<std::vector<uint64_t>>();
    }
    s.rerouted_writes = j.value("rerouted_writes", uint64_t{0});
    if (j.contains("failed_rails")) s.failed_rails = j["failed_rails"].get<std::vector<size_t>>();
    if (j.contains("rail_seconds")) s.rail_seconds = j["rail_seconds"].get<std::vector<double>>();
    if (j.contains("region")) s.region = j["region"].get<uint64_t>();
    s.source = j.value("source", std::string());
    if (j.contains("tried")) s.tried = j["tried"].get<std::vector<std::string>>();
  } catch (const nlohmann::json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("pull stats: ", e.what()));
  }
  return s;
}

absl::StatusOr<Layout> LayoutFromJson(const nlohmann::json& j, uint64_t max_pieces) {
  if (!j.is_array()) return absl::InvalidArgumentError("a layout must be an array");
  Layout layout;
  for (const auto& item : j) {
    if (layout.pieces() > max_pieces) break;
    if (item.is_object() && item.contains("strided")) {
      const nlohmann::json& s = item["strided"];
      if (!s.is_object()) return absl::InvalidArgumentError("\"strided\" must be an object");
      ASSIGN_OR_RETURN(uint64_t region, UnsignedField(s, "region"));
      ASSIGN_OR_RETURN(uint64_t offset, UnsignedField(s, "offset"));
      ASSIGN_OR_RETURN(uint64_t piece, UnsignedField(s, "piece"));
      ASSIGN_OR_RETURN(uint64_t stride, UnsignedField(s, "stride"));
      ASSIGN_OR_RETURN(uint64_t count, UnsignedField(s, "count"));
      if (count > max_pieces) break;
      layout.AddStrided(region, offset, piece, stride, count);
    } else if (item.is_object() && item.contains("pages")) {
      const nlohmann::json& p = item["pages"];
      if (!p.is_object()) return absl::InvalidArgumentError("\"pages\" must be an object");
      ASSIGN_OR_RETURN(uint64_t region, UnsignedField(p, "region"));
      ASSIGN_OR_RETURN(uint64_t offset, UnsignedField(p, "offset"));
      ASSIGN_OR_RETURN(uint64_t page_size, UnsignedField(p, "page_size"));
      auto ids = p.find("ids");
      if (ids == p.end() || !ids->is_array()) {
        return absl::InvalidArgumentError("\"pages\" wants \"ids\", an array of page ids");
      }
      if (ids->size() > max_pieces) break;
      std::vector<uint32_t> pages;
      pages.reserve(ids->size());
      for (const auto& id : *ids) {
        if (!id.is_number_unsigned() || id.get<uint64_t>() > UINT32_MAX) {
          return absl::InvalidArgumentError("a page id must be an unsigned 32-bit integer");
        }
        pages.push_back(id.get<uint32_t>());
      }
      layout.AddPages(region, offset, page_size, pages);
    } else {
      ASSIGN_OR_RETURN(std::vector<Extent> one, ExtentsFromJson(nlohmann::json::array({item})));
      layout.Add(one[0]);
    }
  }
  if (layout.pieces() > max_pieces) {
    return TooLarge(absl::StrCat("a layout of more than ", max_pieces, " pieces"));
  }
  return layout;
}

nlohmann::json ToJson(const Layout& layout) {
  nlohmann::json out = nlohmann::json::array();
  for (const Layout::Run& r : layout.runs()) {
    switch (r.kind) {
      case Layout::Run::Kind::kExtent:
        out.push_back({r.region, r.offset, r.piece});
        break;
      case Layout::Run::Kind::kStrided:
        out.push_back({{"strided",
                        {{"region", r.region},
                         {"offset", r.offset},
                         {"piece", r.piece},
                         {"stride", r.stride},
                         {"count", r.count}}}});
        break;
      case Layout::Run::Kind::kPages: {
        std::vector<uint32_t> ids(
            layout.page_ids().begin() + static_cast<ptrdiff_t>(r.first_page),
            layout.page_ids().begin() + static_cast<ptrdiff_t>(r.first_page + r.count));
        out.push_back(
            {{"pages",
              {{"region", r.region}, {"offset", r.offset}, {"page_size", r.piece}, {"ids", ids}}}});
        break;
      }
    }
  }
  return out;
}

absl::StatusOr<PullSpec> PullSpecFromJson(const nlohmann::json& j, uint64_t max_pieces) {
  if (!j.is_object()) return absl::InvalidArgumentError("a pull must be an object");
  PullSpec spec;
  auto from = j.find("from");
  auto object = j.find("object");
  if ((from != j.end() && !from->is_string()) || object == j.end() || !object->is_string()) {
    return absl::InvalidArgumentError("\"object\" (and \"from\", when given) must be strings");
  }
  if (from != j.end()) spec.from = from->get<std::string>();
  spec.object = object->get<std::string>();
  if (j.contains("version")) {
    ASSIGN_OR_RETURN(uint64_t v, UnsignedField(j, "version"));
    if (v == 0) return absl::InvalidArgumentError("\"version\" must be positive");
    spec.version = v;
  }
  if (j.contains("as")) {
    if (!j["as"].is_string()) return absl::InvalidArgumentError("\"as\" must be a string");
    spec.as = j["as"].get<std::string>();
  }
  for (const char* flag : {"replace", "durable", "announce"}) {
    if (j.contains(flag) && !j[flag].is_boolean()) {
      return absl::InvalidArgumentError(absl::StrCat("\"", flag, "\" must be true or false"));
    }
  }
  spec.replace = j.value("replace", false);
  spec.durable = j.value("durable", true);
  spec.announce = j.value("announce", true);
  if (j.contains("path")) {
    if (!j["path"].is_string()) return absl::InvalidArgumentError("\"path\" must be a string");
    spec.path = j["path"].get<std::string>();
  }
  if (j.contains("timeout_ms")) {
    ASSIGN_OR_RETURN(spec.timeout_ms, UnsignedField(j, "timeout_ms"));
  }
  if (j.contains("part")) {
    const nlohmann::json& p = j["part"];
    if (!p.is_object()) return absl::InvalidArgumentError("\"part\" must be an object");
    if (p.contains("extents")) {
      ASSIGN_OR_RETURN(spec.source_extents, Indices(p["extents"], "part.extents", max_pieces));
    }
    if (p.contains("offset") || p.contains("length")) {
      if (p.contains("extents")) {
        return absl::InvalidArgumentError("\"part\" is a byte range or extents, not both");
      }
      ASSIGN_OR_RETURN(spec.range_offset, UnsignedField(p, "offset"));
      ASSIGN_OR_RETURN(spec.range_length, UnsignedField(p, "length"));
      if (spec.range_length == 0) return absl::InvalidArgumentError("a part of 0 bytes");
    }
  }
  const nlohmann::json into = j.value("into", nlohmann::json{{"device", "host"}});
  if (!into.is_object()) return absl::InvalidArgumentError("\"into\" must be an object");
  if (into.contains("device")) {
    if (!into["device"].is_string())
      return absl::InvalidArgumentError("\"device\" must be a string");
    ASSIGN_OR_RETURN(Device d, Device::Parse(into["device"].get<std::string>()));
    spec.new_buffer = d;
  } else if (into.contains("prepared")) {
    ASSIGN_OR_RETURN(spec.prepared, UnsignedField(into, "prepared"));
    if (spec.prepared == 0) return absl::InvalidArgumentError("\"prepared\" 0 names none");
    if (into.contains("indices")) {
      ASSIGN_OR_RETURN(spec.indices, Indices(into["indices"], "indices", max_pieces));
    }
  } else if (into.contains("extents_raw")) {
    if (!into["extents_raw"].is_string()) {
      return absl::InvalidArgumentError("\"extents_raw\" must be a string");
    }
    ASSIGN_OR_RETURN(std::vector<Extent> extents,
                     UnpackRawExtents(into["extents_raw"].get_ref<const std::string&>()));
    if (extents.size() > max_pieces) {
      return TooLarge(absl::StrCat(extents.size(), " extents; the limit is ", max_pieces));
    }
    spec.into = Layout(extents);
  } else if (into.contains("extents_b64")) {
    if (!into["extents_b64"].is_string()) {
      return absl::InvalidArgumentError("\"extents_b64\" must be a string");
    }
    ASSIGN_OR_RETURN(std::vector<Extent> extents,
                     UnpackExtents(into["extents_b64"].get<std::string>()));
    if (extents.size() > max_pieces) {
      return TooLarge(absl::StrCat(extents.size(), " extents; the limit is ", max_pieces));
    }
    spec.into = Layout(extents);
  } else if (into.contains("extents")) {
    ASSIGN_OR_RETURN(spec.into, LayoutFromJson(into["extents"], max_pieces));
    if (spec.into.empty()) return absl::InvalidArgumentError("\"extents\" is empty");
  } else {
    return absl::InvalidArgumentError(
        "\"into\" needs \"device\", \"extents\" (or \"extents_raw\") or \"prepared\"");
  }
  return spec;
}

nlohmann::json ToJson(const PullSpec& spec) {
  nlohmann::json j = {{"object", spec.object},
                      {"path", spec.path},
                      {"replace", spec.replace},
                      {"durable", spec.durable}};
  if (!spec.from.empty()) j["from"] = spec.from;
  if (!spec.announce) j["announce"] = false;
  if (spec.version) j["version"] = *spec.version;
  if (!spec.as.empty()) j["as"] = spec.as;
  if (spec.timeout_ms > 0) j["timeout_ms"] = spec.timeout_ms;
  if (spec.range_length > 0) {
    j["part"] = {{"offset", spec.range_offset}, {"length", spec.range_length}};
  } else if (!spec.source_extents.empty()) {
    j["part"] = {{"extents", spec.source_extents}};
  }
  if (spec.new_buffer) {
    j["into"] = {{"device", spec.new_buffer->ToString()}};
  } else if (spec.prepared != 0) {
    j["into"] = {{"prepared", spec.prepared}, {"indices", spec.indices}};
  } else {
    j["into"] = {{"extents", ToJson(spec.into)}};
  }
  return j;
}

absl::StatusOr<DistributeSpec> DistributeSpecFromJson(const nlohmann::json& j) {
  if (!j.is_object()) return absl::InvalidArgumentError("a distribution must be an object");
  DistributeSpec spec;
  ASSIGN_OR_RETURN(const nlohmann::json* object, Field(j, "object"));
  if (!object->is_string()) return absl::InvalidArgumentError("\"object\" must be a string");
  spec.object = object->get<std::string>();
  if (j.contains("version")) {
    ASSIGN_OR_RETURN(uint64_t v, UnsignedField(j, "version"));
    if (v == 0) return absl::InvalidArgumentError("\"version\" must be positive");
    spec.version = v;
  }
  if (j.contains("to")) {
    const nlohmann::json& to = j["to"];
    if (!to.is_array()) return absl::InvalidArgumentError("\"to\" must be an array of URLs");
    for (const auto& u : to) {
      if (!u.is_string()) return absl::InvalidArgumentError("\"to\" must be an array of URLs");
      spec.to.push_back(u.get<std::string>());
    }
  }
  if (j.contains("labels")) {
    const nlohmann::json& labels = j["labels"];
    if (!labels.is_object()) return absl::InvalidArgumentError("\"labels\" must be an object");
    for (const auto& [k, v] : labels.items()) {
      if (!v.is_string()) return absl::InvalidArgumentError("a label's value must be a string");
      spec.labels[k] = v.get<std::string>();
    }
  }
  for (const char* flag : {"all", "checksum", "durable"}) {
    if (j.contains(flag) && !j[flag].is_boolean()) {
      return absl::InvalidArgumentError(absl::StrCat("\"", flag, "\" must be true or false"));
    }
  }
  spec.all = j.value("all", false);
  spec.checksum = j.value("checksum", true);
  spec.durable = j.value("durable", true);
  if (j.contains("device")) {
    if (!j["device"].is_string()) return absl::InvalidArgumentError("\"device\" must be a string");
    spec.device = j["device"].get<std::string>();
  }
  if (j.contains("chunk_bytes")) {
    ASSIGN_OR_RETURN(spec.chunk_bytes, UnsignedField(j, "chunk_bytes"));
    if (spec.chunk_bytes == 0)
      return absl::InvalidArgumentError("\"chunk_bytes\" must be positive");
  }
  if (j.contains("timeout_ms")) {
    ASSIGN_OR_RETURN(spec.timeout_ms, UnsignedField(j, "timeout_ms"));
  }
  return spec;
}

nlohmann::json ToJson(const DistributeSpec& spec) {
  nlohmann::json j = {{"object", spec.object},
                      {"checksum", spec.checksum},
                      {"device", spec.device},
                      {"durable", spec.durable}};
  if (spec.version) j["version"] = *spec.version;
  if (!spec.to.empty()) j["to"] = spec.to;
  if (!spec.labels.empty()) j["labels"] = spec.labels;
  if (spec.all) j["all"] = true;
  if (spec.chunk_bytes != 0) j["chunk_bytes"] = spec.chunk_bytes;
  if (spec.timeout_ms != 0) j["timeout_ms"] = spec.timeout_ms;
  return j;
}

nlohmann::json ToJson(const DistributeResult& r) {
  nlohmann::json receivers = nlohmann::json::array();
  for (const ReceiverResult& rr : r.receivers) {
    nlohmann::json one = {{"node", rr.node},       {"url", rr.url},
                          {"ok", rr.status.ok()},  {"seconds", rr.seconds},
                          {"bytes", rr.bytes},     {"refetched_chunks", rr.refetched_chunks},
                          {"skipped", rr.skipped}, {"held_already", rr.held_already}};
    if (!rr.status.ok()) one.update(ErrorBody(rr.status));
    receivers.push_back(std::move(one));
  }
  return {{"object", r.object},    {"version", r.version},         {"size", r.size},
          {"chunks", r.chunks},    {"chunk_bytes", r.chunk_bytes}, {"seconds", r.seconds},
          {"receivers", receivers}};
}

absl::StatusOr<DistributeResult> DistributeResultFromJson(const nlohmann::json& j) {
  DistributeResult r;
  try {
    r.object = j.at("object").get<std::string>();
    r.version = j.at("version").get<uint64_t>();
    r.size = j.at("size").get<uint64_t>();
    r.chunks = j.at("chunks").get<uint64_t>();
    r.chunk_bytes = j.at("chunk_bytes").get<uint64_t>();
    r.seconds = j.at("seconds").get<double>();
    for (const auto& one : j.at("receivers")) {
      ReceiverResult& rr = r.receivers.emplace_back();
      rr.node = one.value("node", "");
      rr.url = one.at("url").get<std::string>();
      rr.seconds = one.value("seconds", 0.0);
      rr.bytes = one.value("bytes", uint64_t{0});
      rr.refetched_chunks = one.value("refetched_chunks", uint64_t{0});
      rr.skipped = one.value("skipped", std::vector<std::string>());
      rr.held_already = one.value("held_already", false);
      if (!one.value("ok", false)) rr.status = StatusFromJson(one, rr.url);
    }
  } catch (const nlohmann::json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("a distribution's answer: ", e.what()));
  }
  return r;
}

absl::StatusOr<nlohmann::json> ParseRequestBody(std::string_view body, bool with_extents) {
  std::string_view json = body, raw;
  if (with_extents) {
    const size_t nl = json.find('\n');
    if (nl == std::string_view::npos) {
      return absl::InvalidArgumentError("an extents body is JSON, a newline, then the extents");
    }
    raw = json.substr(nl + 1);
    json = json.substr(0, nl);
  }
  auto parsed = ParseJson(json);
  if (!parsed.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("request body: ", parsed.status().message()));
  }
  nlohmann::json& j = *parsed;
  if (!j.is_object()) return absl::InvalidArgumentError("request body must be a JSON object");
  if (with_extents) j["extents_raw"] = std::string(raw);
  return std::move(j);
}

}  // namespace ferry
