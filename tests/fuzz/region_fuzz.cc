// Region descriptors and peer addresses, in their binary form (inside control messages) and as
// JSON (GET /v1/regions, node-to-node pulls over HTTP). What decodes encodes to bytes that
// decode to the same.
#include <string>

#include "base/bytes.h"
#include "tests/fuzz/fuzz.h"
#include "wire/http_status.h"
#include "wire/region.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text = ferry::fuzz::Text(data, size);
  {
    ferry::ByteReader in(text);
    ferry::RegionDescriptor d;
    if (ferry::Decode(in, &d).ok()) {
      std::string out;
      ferry::ByteWriter w(&out);
      ferry::Encode(d, w);
      ferry::ByteReader back(out);
      ferry::RegionDescriptor again;
      FUZZ_CHECK(ferry::Decode(back, &again).ok() && again == d && back.left() == 0);
    }
  }
  {
    ferry::ByteReader in(text);
    ferry::PeerAddress a;
    if (ferry::Decode(in, &a).ok()) {
      FUZZ_CHECK(a.rails.size() <= 64);
      std::string out;
      ferry::ByteWriter w(&out);
      ferry::Encode(a, w);
      ferry::ByteReader back(out);
      ferry::PeerAddress again;
      FUZZ_CHECK(ferry::Decode(back, &again).ok() && again == a && back.left() == 0);
    }
  }
  if (auto j = ferry::ParseJson(text); j.ok()) {
    if (auto d = ferry::RegionDescriptorFromJson(*j); d.ok()) {
      auto again = ferry::RegionDescriptorFromJson(ferry::ToJson(*d));
      FUZZ_CHECK(again.ok() && *again == *d);
    }
  }
  return 0;
}
