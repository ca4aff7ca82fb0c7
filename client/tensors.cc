#include "ferry/tensors.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "nlohmann/json.hpp"
#include "wire/http_status.h"

namespace ferry {
namespace {

// The most bytes a safetensors header may take (the format's own limit).
constexpr uint64_t kMaxHeader = uint64_t{100} << 20;

absl::Status Bad(const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat("not a usable safetensors file: ", what));
}

// The header's length from the file's first 8 bytes (little-endian).
absl::StatusOr<uint64_t> SafetensorsHeaderLength(std::string_view first8, uint64_t file_size) {
  if (first8.size() < 8 || file_size < 8) return Bad("shorter than 8 bytes");
  uint64_t n = 0;
  for (size_t i = 8; i-- > 0;) n = (n << 8) | static_cast<unsigned char>(first8[i]);
  if (n > kMaxHeader || n > file_size - 8) {
    return Bad(absl::StrCat("a header of ", n, " bytes in a file of ", file_size));
  }
  return n;
}

}  // namespace

size_t DtypeSize(std::string_view dtype) {
  static constexpr std::pair<std::string_view, size_t> kSizes[] = {
      {"F64", 8},     {"F32", 4}, {"F16", 2}, {"BF16", 2}, {"F8_E4M3", 1},
      {"F8_E5M2", 1}, {"I64", 8}, {"I32", 4}, {"I16", 2},  {"I8", 1},
      {"U64", 8},     {"U32", 4}, {"U16", 2}, {"U8", 1},   {"BOOL", 1}};
  for (const auto& [name, size] : kSizes) {
    if (name == dtype) return size;
  }
  return 0;
}

std::string TensorTableMeta(const std::vector<TensorEntry>& tensors) {
  nlohmann::json list = nlohmann::json::array();
  for (const TensorEntry& t : tensors) {
    list.push_back(
        {{"name", t.name}, {"dtype", t.dtype}, {"shape", t.shape}, {"offset", t.offset}});
  }
  return nlohmann::json{{"tensors", std::move(list)}}.dump();
}

absl::StatusOr<SafetensorsLayout> ParseSafetensors(std::string_view header, uint64_t file_size) {
  ASSIGN_OR_RETURN(const uint64_t n, SafetensorsHeaderLength(header, file_size));
  if (header.size() < 8 + n) return Bad("the header is cut short");
  auto j = ParseJson(header.substr(8, n));
  if (!j.ok() || !j->is_object()) return Bad("the header is not a JSON object");
  SafetensorsLayout out;
  out.data_offset = 8 + n;
  out.data_size = file_size - out.data_offset;
  for (const auto& [name, t] : j->items()) {
    if (name == "__metadata__") continue;
    const auto where = [&tensor = name](const std::string& what) {
      return Bad(absl::StrCat("tensor '", tensor, "': ", what));
    };
    if (!t.is_object() || !t.contains("dtype") || !t["dtype"].is_string() || !t.contains("shape") ||
        !t["shape"].is_array() || !t.contains("data_offsets") || !t["data_offsets"].is_array() ||
        t["data_offsets"].size() != 2) {
      return where("wants dtype, shape and data_offsets [begin, end]");
    }
    TensorEntry e;
    e.name = name;
    e.dtype = t["dtype"].get<std::string>();
    const size_t element = DtypeSize(e.dtype);
    if (element == 0) return where(absl::StrCat("unknown dtype ", e.dtype));
    uint64_t elements = 1;
    for (const auto& d : t["shape"]) {
      if (!d.is_number_unsigned()) return where("a dimension is not a count");
      const uint64_t dim = d.get<uint64_t>();
      if (dim != 0 && elements > UINT64_MAX / dim) return where("its shape overflows");
      elements *= dim;
      e.shape.push_back(dim);
    }
    const auto& offsets = t["data_offsets"];
    if (!offsets[0].is_number_unsigned() || !offsets[1].is_number_unsigned()) {
      return where("data_offsets must be byte counts");
    }
    const uint64_t begin = offsets[0].get<uint64_t>(), end = offsets[1].get<uint64_t>();
    if (begin > end || end > out.data_size) {
      return where(absl::StrCat("bytes [", begin, ", ", end, ") outside the ", out.data_size,
                                " bytes of data"));
    }
    if (elements > UINT64_MAX / element || end - begin != elements * element) {
      return where(absl::StrCat(end - begin, " bytes for its shape of ", elements, " x ", element));
    }
    e.offset = begin;
    e.length = end - begin;
    out.tensors.push_back(std::move(e));
  }
  return out;
}

absl::StatusOr<SafetensorsLayout> ReadSafetensors(const ReadAt& read, uint64_t file_size) {
  std::string header(std::min<uint64_t>(file_size, 8), '\0');
  RETURN_IF_ERROR(read(0, header.data(), header.size()));
  ASSIGN_OR_RETURN(const uint64_t n, SafetensorsHeaderLength(header, file_size));
  header.resize(8 + n);
  RETURN_IF_ERROR(read(0, header.data(), header.size()));
  return ParseSafetensors(header, file_size);
}

}  // namespace ferry
