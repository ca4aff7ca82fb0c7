// Catalog records as read back from the store (a damaged or foreign store included): what
// decodes encodes to a record that decodes to the same.
#include "metadata/catalog.h"
#include "tests/fuzz/fuzz.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto r = ferry::metadata::DecodeRecord(ferry::fuzz::Text(data, size));
  if (!r.ok()) {
    FUZZ_CHECK(absl::IsDataLoss(r.status()));
    return 0;
  }
  const std::string once = ferry::metadata::EncodeRecord(*r);
  auto again = ferry::metadata::DecodeRecord(once);
  FUZZ_CHECK(again.ok() && ferry::metadata::EncodeRecord(*again) == once);
  return 0;
}
