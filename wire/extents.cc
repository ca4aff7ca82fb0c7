#include "wire/extents.h"

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "nlohmann/json.hpp"

namespace ferry {

absl::StatusOr<uint64_t> UnsignedField(const nlohmann::json& j, const char* name) {
  auto it = j.find(name);
  if (it == j.end() || !it->is_number_unsigned()) {
    return absl::InvalidArgumentError(absl::StrCat("\"", name, "\" must be an unsigned integer"));
  }
  return it->get<uint64_t>();
}

absl::StatusOr<std::vector<Extent>> ExtentsFromJson(const nlohmann::json& j) {
  if (!j.is_array()) return absl::InvalidArgumentError("\"extents\" must be an array");
  std::vector<Extent> out;
  out.reserve(j.size());
  for (const auto& e : j) {
    if (e.is_array()) {
      if (e.size() != 3 || !e[0].is_number_unsigned() || !e[1].is_number_unsigned() ||
          !e[2].is_number_unsigned()) {
        return absl::InvalidArgumentError("a compact extent is [region, offset, length], unsigned");
      }
      out.push_back({e[0].get<uint64_t>(), e[1].get<uint64_t>(), e[2].get<uint64_t>()});
      continue;
    }
    if (!e.is_object()) return absl::InvalidArgumentError("an extent must be an object");
    ASSIGN_OR_RETURN(uint64_t region, UnsignedField(e, "region"));
    ASSIGN_OR_RETURN(uint64_t offset, UnsignedField(e, "offset"));
    ASSIGN_OR_RETURN(uint64_t length, UnsignedField(e, "length"));
    out.push_back({region, offset, length});
  }
  return out;
}

std::string RawExtents(const std::vector<Extent>& extents) {
  std::string raw(extents.size() * 24, '\0');
  char* p = raw.data();
  for (const Extent& e : extents) {
    for (uint64_t v : {e.region, e.offset, e.length}) {
      for (int b = 0; b < 8; ++b) *p++ = static_cast<char>(v >> (8 * b));
    }
  }
  return raw;
}

absl::StatusOr<std::vector<Extent>> UnpackRawExtents(std::string_view raw) {
  if (raw.size() % 24 != 0) {
    return absl::InvalidArgumentError("raw extents are not (region, offset, length) triplets");
  }
  std::vector<Extent> out(raw.size() / 24);
  const auto* p = reinterpret_cast<const unsigned char*>(raw.data());
  for (Extent& e : out) {
    for (uint64_t* v : {&e.region, &e.offset, &e.length}) {
      *v = 0;
      for (int b = 0; b < 8; ++b) *v |= uint64_t{*p++} << (8 * b);
    }
  }
  return out;
}

std::string PackExtents(const std::vector<Extent>& extents) {
  return absl::Base64Escape(RawExtents(extents));
}

absl::StatusOr<std::vector<Extent>> UnpackExtents(const std::string& b64) {
  std::string raw;
  if (!absl::Base64Unescape(b64, &raw))
    return absl::InvalidArgumentError("\"extents_b64\" is not base64");
  return UnpackRawExtents(raw);
}

}  // namespace ferry
