// Control messages as a node receives them over the rails or in POST /v1/peer: the engine's
// frame, the sealed message inside, its envelope and every kind of body. What decodes encodes
// to bytes that decode to the same; a seal opens once, and garbage never opens.
#include <cstring>
#include <string>

#include "engine/control.h"
#include "tests/fuzz/fuzz.h"
#include "wire/auth.h"
#include "wire/messages.h"

namespace {

using namespace ferry::wire;  // NOLINT: the codec's overloads

constexpr uint64_t kMaxPieces = 4096;

// Decodes `b` as a T (with the decoder's limit when it takes one), and checks the round trip.
template <typename T, typename... Limit>
void RoundTrip(std::string_view b, Limit... limit) {
  T v;
  if (!Decode(b, &v, limit...).ok()) return;
  const std::string once = Encode(v);
  T again;
  FUZZ_CHECK(Decode(once, &again, limit...).ok() && Encode(again) == once);
}

void Bodies(std::string_view b) {
  RoundTrip<StatRequest>(b);
  RoundTrip<PullRequest>(b, kMaxPieces);
  RoundTrip<ferry::ObjectInfo>(b);
  RoundTrip<ferry::PullStats>(b);
  RoundTrip<Credit>(b);
  RoundTrip<NodeSummary>(b);
  RoundTrip<PullBatch>(b, size_t{1024});
  RoundTrip<Receive>(b, kMaxPieces);
  RoundTrip<ReceiveStats>(b);
  absl::Status s;
  if (DecodeStatus(b, &s).ok()) {
    absl::Status again;
    FUZZ_CHECK(DecodeStatus(Encode(s), &again).ok() && Encode(again) == Encode(s));
  }
  uint64_t id = 0;
  if (DecodeId(b, &id).ok()) FUZZ_CHECK(EncodeId(id) == b);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text = ferry::fuzz::Text(data, size);
  if (auto frame = ferry::engine::DecodeControl(text); frame.ok()) {
    std::string again = ferry::engine::EncodeControl(frame->type, frame->sender, frame->payload);
    again[5] = text[5];  // reserved: not read
    FUZZ_CHECK(again == text);
  }
  {
    MessageAuth opener("cluster key");
    FUZZ_CHECK(!opener.Open(text, "peer").ok());
    MessageAuth sealer("cluster key");
    const std::string sealed = sealer.Seal(std::string(text));
    auto opened = opener.Open(sealed, "peer");
    FUZZ_CHECK(opened.ok() && *opened == text);
    FUZZ_CHECK(!opener.Open(sealed, "peer").ok());  // a replay
  }
  if (auto e = DecodeEnvelope(text); e.ok()) {
    const std::string once = EncodeEnvelope(*e);
    auto again = DecodeEnvelope(once);
    FUZZ_CHECK(again.ok() && EncodeEnvelope(*again) == once);
    Bodies(e->body);
  }
  Bodies(text);
  return 0;
}
