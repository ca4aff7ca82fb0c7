// Writes seed inputs for the fuzz targets (typical messages, descriptors and records, encoded
// as ferry encodes them) under FOLDER/<target>/: a start for the corpus in tests/fuzz/corpus.
//   make_seeds FOLDER
#include <filesystem>
#include <fstream>
#include <string>

#include "base/bytes.h"
#include "engine/control.h"
#include "metadata/catalog.h"
#include "wire/extents.h"
#include "wire/messages.h"

namespace {

namespace fs = std::filesystem;
using namespace ferry;        // NOLINT
using namespace ferry::wire;  // NOLINT

void Put(const fs::path& dir, const std::string& target, const std::string& name,
         const std::string& bytes) {
  fs::create_directories(dir / target);
  std::ofstream(dir / target / name, std::ios::binary) << bytes;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  const fs::path dir = argv[1];
  RegionDescriptor region{.node = "n1", .addr = 4096, .length = 1 << 20, .keys = {7, 9}};
  PeerAddress from{
      .node = "n1", .rails = {std::string(16, 'r'), std::string(16, 's')}, .bell = "b"};
  std::string out;
  ByteWriter w(&out);
  Encode(region, w);
  Put(dir, "region", "descriptor", out);
  out.clear();
  Encode(from, w);
  Put(dir, "region", "address", out);

  PullRequest pull{.object = "w",
                   .version = 2,
                   .timeout_ms = 1000,
                   .regions = {region},
                   .layout = Layout({{0, 0, 4096}, {0, 8192, 4096}})};
  pull.part.extents = {0, 1};
  const std::pair<MessageType, std::string> bodies[] = {
      {MessageType::kStat, Encode(StatRequest{.object = "w"})},
      {MessageType::kPull, Encode(pull)},
      {MessageType::kPullDone, Encode(PullStats{.bytes = 8192})},
      {MessageType::kError, Encode(absl::NotFoundError("no object"))},
      {MessageType::kCancel, EncodeId(5)},
      {MessageType::kCredit, Encode(Credit{.tag = 3, .chunk = 4})},
      {MessageType::kHelloAnswer, Encode(NodeSummary{.id = "n1", .address = from})},
      {MessageType::kPullBatch, Encode(PullBatch{.requests = {{1, Encode(pull)}}})},
      {MessageType::kReceive, Encode(Receive{.id = 3,
                                             .object = "w",
                                             .version = 2,
                                             .size = 3 << 20,
                                             .chunk_bytes = 1 << 20,
                                             .upstream = {"http://b:1", "http://a:1"},
                                             .crc32c = {1, 2, 3},
                                             .device = "host"})},
      {MessageType::kReceiveDone,
       Encode(ReceiveStats{.bytes = 8192, .seconds = 0.5, .chunks = 2, .skipped = {"x: gone"}})},
  };
  for (const auto& [type, body] : bodies) {
    const std::string name = std::to_string(static_cast<int>(type));
    Put(dir, "message", "envelope-" + name, EncodeEnvelope({type, 1, from, body}));
    Put(dir, "message", "body-" + name, body);
  }
  Put(dir, "message", "frame",
      engine::EncodeControl(engine::ControlType::kUser, "n1", EncodeEnvelope({})));
  Put(dir, "extents", "raw", RawExtents({{1, 0, 4096}, {2, 64, 128}}));
  Put(dir, "extents", "b64", PackExtents({{1, 0, 4096}}));
  Put(dir, "record", "record",
      metadata::EncodeRecord({.name = "w",
                              .version = 1,
                              .size = 8,
                              .extents = {{1, 0, 8}},
                              .meta = "{}",
                              .content_type = "t",
                              .crc32c = 1}));
  return 0;
}
