#include "client/input_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

namespace ferry {

InputFile::InputFile(std::string path) : path_(std::move(path)) {
  fd_ = open(path_.c_str(), O_RDONLY | O_CLOEXEC);
  struct stat st = {};
  if (fd_ < 0 || fstat(fd_, &st) != 0 || S_ISDIR(st.st_mode)) return;
  if (S_ISREG(st.st_mode)) {
    size_ = static_cast<uint64_t>(st.st_size);
    ok_ = true;
    posix_fadvise(fd_, 0, 0, POSIX_FADV_SEQUENTIAL);
    return;
  }
  char buf[1 << 16];
  ssize_t n;
  while ((n = read(fd_, buf, sizeof(buf))) > 0) whole_.append(buf, static_cast<size_t>(n));
  ok_ = n == 0;
  size_ = whole_.size();
}

InputFile::~InputFile() {
  if (fd_ >= 0) close(fd_);
}

absl::Status InputFile::Read(uint64_t offset, char* out, size_t n) const {
  if (offset + n <= whole_.size()) {
    std::memcpy(out, whole_.data() + offset, n);
    return absl::OkStatus();
  }
  while (n > 0) {
    const ssize_t got = pread(fd_, out, n, static_cast<off_t>(offset));
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) return absl::ErrnoToStatus(errno, "reading " + path_);
    if (got == 0) return absl::DataLossError(path_ + " got shorter while it was read");
    out += got;
    offset += static_cast<uint64_t>(got);
    n -= static_cast<size_t>(got);
  }
  return absl::OkStatus();
}

}  // namespace ferry
