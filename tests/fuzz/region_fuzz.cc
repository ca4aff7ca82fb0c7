// Region descriptors and peer addresses, in their binary form (inside control messages) and as
// JSON (GET /v1/regions, node-to-node pulls over HTTP). What decodes encodes to bytes that
// decode to the same.
#include <optional>
#include <string>

#include "base/bytes.h"
#include "tests/fuzz/fuzz.h"
#include "wire/http_status.h"
#include "wire/region.h"

namespace {

// Decodes a T from the front of `text` and checks that it encodes to bytes that decode to the
// same, whole. The decoded value, when there is one.
template <typename T>
std::optional<T> RoundTrip(std::string_view text) {
  ferry::ByteReader in(text);
  T v;
  if (!ferry::Decode(in, &v).ok()) return std::nullopt;
  std::string out;
  ferry::ByteWriter w(&out);
  ferry::Encode(v, w);
  ferry::ByteReader back(out);
  T again;
  FUZZ_CHECK(ferry::Decode(back, &again).ok() && again == v && back.left() == 0);
  return v;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text = ferry::fuzz::Text(data, size);
  RoundTrip<ferry::RegionDescriptor>(text);
  if (auto a = RoundTrip<ferry::PeerAddress>(text)) FUZZ_CHECK(a->rails.size() <= 64);
  if (auto j = ferry::ParseJson(text); j.ok()) {
    if (auto d = ferry::RegionDescriptorFromJson(*j); d.ok()) {
      auto again = ferry::RegionDescriptorFromJson(ferry::ToJson(*d));
      FUZZ_CHECK(again.ok() && *again == *d);
    }
  }
  return 0;
}
