// Extent lists as bodies carry them: raw little-endian triplets (kExtentsContentType) and their
// base64 ("extents_b64"). What decodes encodes back to the same bytes.
#include <string>

#include "tests/fuzz/fuzz.h"
#include "wire/extents.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text = ferry::fuzz::Text(data, size);
  auto raw = ferry::UnpackRawExtents(text);
  FUZZ_CHECK(raw.ok() == (size % 24 == 0));
  if (raw.ok()) FUZZ_CHECK(ferry::RawExtents(*raw) == text);
  auto b64 = ferry::UnpackExtents(std::string(text));
  if (b64.ok()) {
    auto again = ferry::UnpackExtents(ferry::PackExtents(*b64));
    FUZZ_CHECK(again.ok() && ferry::RawExtents(*again) == ferry::RawExtents(*b64));
  }
  return 0;
}
