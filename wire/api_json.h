// JSON of the HTTP API's shared types (docs/http_api.md): objects, pull results, layouts.
// Used by the node's routes and by the HTTP client.
#ifndef FERRY_WIRE_API_JSON_H_
#define FERRY_WIRE_API_JSON_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "ferry/layout.h"
#include "ferry/pull.h"
#include "ferry/types.h"
#include "nlohmann/json.hpp"

namespace ferry {

nlohmann::json ToJson(const ObjectInfo& o, bool with_extents = true);
// kInvalidArgument: fields missing or of the wrong type.
absl::StatusOr<ObjectInfo> ObjectInfoFromJson(const nlohmann::json& j);
nlohmann::json ToJson(const PullStats& s);
absl::StatusOr<PullStats> PullStatsFromJson(const nlohmann::json& j);

// A layout: an array whose items are extents ({"region","offset","length"} or [R, O, L]),
// strided runs ({"strided": {"region","offset","piece","stride","count"}}) and page tables
// ({"pages": {"region","offset","page_size","ids": [...]}}). kInvalidArgument otherwise, or
// past `max_pieces` pieces.
absl::StatusOr<Layout> LayoutFromJson(const nlohmann::json& j, uint64_t max_pieces);
nlohmann::json ToJson(const Layout& layout);

// A pull as POST /v1/pulls describes it (one item of a list). kInvalidArgument: a field of
// the wrong type; 413 past `max_pieces` pieces.
absl::StatusOr<PullSpec> PullSpecFromJson(const nlohmann::json& j, uint64_t max_pieces);
nlohmann::json ToJson(const PullSpec& spec);

// A distribution as POST /v1/distribute describes it, and its answer. kInvalidArgument: a
// field missing or of the wrong type.
absl::StatusOr<DistributeSpec> DistributeSpecFromJson(const nlohmann::json& j);
nlohmann::json ToJson(const DistributeSpec& spec);
nlohmann::json ToJson(const DistributeResult& r);
absl::StatusOr<DistributeResult> DistributeResultFromJson(const nlohmann::json& j);

// A request body: a JSON object, or with `with_extents` (a body of kExtentsContentType) a JSON
// object, a newline and raw extents, which become its string "extents_raw". kInvalidArgument
// otherwise, or nested deeper than kMaxJsonDepth.
absl::StatusOr<nlohmann::json> ParseRequestBody(std::string_view body, bool with_extents);

}  // namespace ferry

#endif  // FERRY_WIRE_API_JSON_H_
