// The JSON request bodies of the HTTP API (PUT /v1/objects/{name}, POST /v1/pulls, POST
// /v1/regions, ...), plain or of kExtentsContentType (JSON, a newline, raw extents): parsed as
// the routes parse them. What parses must come back the same through its JSON form, and no
// layout may hold more pieces than the limit.
#include "nlohmann/json.hpp"
#include "tests/fuzz/fuzz.h"
#include "wire/api_json.h"
#include "wire/extents.h"
#include "wire/region.h"

namespace {

constexpr uint64_t kMaxPieces = 4096;

void CheckLayout(const nlohmann::json& j) {
  auto layout = ferry::LayoutFromJson(j, kMaxPieces);
  if (!layout.ok()) return;
  FUZZ_CHECK(layout->pieces() <= kMaxPieces);
  auto again = ferry::LayoutFromJson(ferry::ToJson(*layout), kMaxPieces);
  FUZZ_CHECK(again.ok() && again->pieces() == layout->pieces() &&
             again->bytes() == layout->bytes());
}

void CheckPull(const nlohmann::json& j) {
  auto spec = ferry::PullSpecFromJson(j, kMaxPieces);
  if (!spec.ok()) return;
  const nlohmann::json once = ferry::ToJson(*spec);
  auto again = ferry::PullSpecFromJson(once, kMaxPieces);
  FUZZ_CHECK(again.ok() && ferry::ToJson(*again) == once);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const bool with_extents = data[0] & 1;
  auto body = ferry::ParseRequestBody(ferry::fuzz::Text(data + 1, size - 1), with_extents);
  if (!body.ok()) return 0;
  FUZZ_CHECK(body->is_object());
  FUZZ_CHECK(with_extents == body->contains("extents_raw"));
  if (with_extents) {
    auto raw = ferry::UnpackRawExtents((*body)["extents_raw"].get<std::string>());
    if (raw.ok()) FUZZ_CHECK(ferry::RawExtents(*raw) == (*body)["extents_raw"].get<std::string>());
  }
  if (body->contains("extents")) CheckLayout((*body)["extents"]);
  CheckPull(*body);
  if (auto pulls = body->find("pulls"); pulls != body->end() && pulls->is_array()) {
    for (const auto& item : *pulls) CheckPull(item);
  }
  if (auto o = ferry::ObjectInfoFromJson(*body); o.ok()) {
    auto again = ferry::ObjectInfoFromJson(ferry::ToJson(*o));
    FUZZ_CHECK(again.ok() && ferry::ToJson(*again) == ferry::ToJson(*o));
  }
  if (auto d = ferry::RegionDescriptorFromJson(*body); d.ok()) {
    auto again = ferry::RegionDescriptorFromJson(ferry::ToJson(*d));
    FUZZ_CHECK(again.ok() && *again == *d);
  }
  return 0;
}
