// Extent lists on the wire: JSON (the HTTP API), raw little-endian triplets (bodies of type
// kExtentsContentType, and control messages) and base64 of those.
#ifndef FERRY_WIRE_EXTENTS_H_
#define FERRY_WIRE_EXTENTS_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "ferry/types.h"
#include "nlohmann/json_fwd.hpp"

namespace ferry {

// [{"region":R,"offset":O,"length":L}, ...] with unsigned fields, or the compact form
// [[R, O, L], ...] (what nodes send each other). kInvalidArgument otherwise.
absl::StatusOr<std::vector<Extent>> ExtentsFromJson(const nlohmann::json& j);
// Extents as base64 of little-endian u64 triplets (region, offset, length), the "extents_b64"
// of pull requests: a KV-cache layout has tens of thousands, and JSON costs microseconds each
// at both ends.
std::string PackExtents(const std::vector<Extent>& extents);
absl::StatusOr<std::vector<Extent>> UnpackExtents(const std::string& b64);
// The same triplets unencoded: what a body of type kExtentsContentType carries after its JSON.
std::string RawExtents(const std::vector<Extent>& extents);
absl::StatusOr<std::vector<Extent>> UnpackRawExtents(std::string_view raw);

// A request body of this type is a JSON object, a newline, then extents as raw triplets (see
// RawExtents): the "into" extents of POST /v1/pulls, the destination extents of a node-to-node
// pull. Big layouts skip both JSON and base64 this way. In the parsed request the raw bytes
// are the string "extents_raw".
inline constexpr char kExtentsContentType[] = "application/vnd.ferry.extents";

// The unsigned integer field `name` of `j`. kInvalidArgument when missing or not one.
absl::StatusOr<uint64_t> UnsignedField(const nlohmann::json& j, const char* name);

}  // namespace ferry

#endif  // FERRY_WIRE_EXTENTS_H_
