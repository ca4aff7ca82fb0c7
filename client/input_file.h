// A file's bytes for an upload (the CLI's `put`, the C ABI's put_file): a regular file is read
// as the upload goes (a model's weights may be most of the machine's memory), anything else (a
// pipe) is read whole first. Thread-compatible.
#ifndef FERRY_CLIENT_INPUT_FILE_H_
#define FERRY_CLIENT_INPUT_FILE_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"

namespace ferry {

class InputFile {
 public:
  explicit InputFile(std::string path);
  ~InputFile();
  InputFile(const InputFile&) = delete;
  InputFile& operator=(const InputFile&) = delete;
  // False when the file could not be opened or read (or is a directory).
  bool ok() const { return ok_; }
  uint64_t size() const { return size_; }
  // The n bytes at offset. kDataLoss: the file got shorter since it was opened.
  absl::Status Read(uint64_t offset, char* out, size_t n) const;

 private:
  std::string path_;
  int fd_ = -1;
  bool ok_ = false;
  uint64_t size_ = 0;
  std::string whole_;  // a pipe's bytes
};

}  // namespace ferry

#endif  // FERRY_CLIENT_INPUT_FILE_H_
