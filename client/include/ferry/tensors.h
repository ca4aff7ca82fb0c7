// Tensors as objects: a tensor table (name, dtype, shape, where its bytes are in the object)
// kept as the object's meta, and safetensors files read into that form. The table's JSON and
// the dtype names: docs/tensors.md. Plain functions; thread-safe.
#ifndef FERRY_TENSORS_H_
#define FERRY_TENSORS_H_

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace ferry {

struct TensorEntry {
  std::string name;
  std::string dtype;  // safetensors' names: F32, BF16, I64, U8, BOOL, ...
  std::vector<uint64_t> shape;
  uint64_t offset = 0;  // bytes into the object
  uint64_t length = 0;  // bytes: the shape's elements times the dtype's size
};

// Bytes per element of `dtype`; 0 for a name ferry does not know.
size_t DtypeSize(std::string_view dtype);

// The object meta that carries `tensors`: {"tensors": [{"name", "dtype", "shape", "offset"}]}.
std::string TensorTableMeta(const std::vector<TensorEntry>& tensors);

// A safetensors file's layout: its header's tensors (offsets from the start of the data), and
// where the data starts in the file.
struct SafetensorsLayout {
  std::vector<TensorEntry> tensors;
  uint64_t data_offset = 0;  // 8 + the header's length
  uint64_t data_size = 0;    // the file's bytes after the header
};

// Reads `header` (the file's bytes from its start: at least 8 + the header's length) given the
// file's size. kInvalidArgument, naming what is wrong: not a safetensors header, a tensor whose
// dtype is unknown, whose bytes disagree with its shape or lie outside the data.
absl::StatusOr<SafetensorsLayout> ParseSafetensors(std::string_view header, uint64_t file_size);
// The same from a file of `file_size` bytes read through `read` (the n bytes at offset).
using ReadAt = std::function<absl::Status(uint64_t offset, char* out, size_t n)>;
absl::StatusOr<SafetensorsLayout> ReadSafetensors(const ReadAt& read, uint64_t file_size);

}  // namespace ferry

#endif  // FERRY_TENSORS_H_
