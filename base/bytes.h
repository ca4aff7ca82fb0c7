// Little-endian fixed-width integers and length-prefixed byte strings: the binary codecs of
// the wire and the catalog are written with ByteWriter and read with ByteReader, which checks
// every read against the end of its input. Plain data; thread-compatible.
#ifndef FERRY_BASE_BYTES_H_
#define FERRY_BASE_BYTES_H_

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace ferry {

class ByteWriter {
 public:
  explicit ByteWriter(std::string* out) : out_(out) {}
  void U8(uint8_t v) { out_->push_back(static_cast<char>(v)); }
  void U16(uint16_t v) { Fixed(v, 2); }
  void U32(uint32_t v) { Fixed(v, 4); }
  void U64(uint64_t v) { Fixed(v, 8); }
  // u32 length, then the bytes.
  void Bytes(std::string_view b) {
    U32(static_cast<uint32_t>(b.size()));
    out_->append(b);
  }
  void Raw(std::string_view b) { out_->append(b); }

 private:
  void Fixed(uint64_t v, int n) {
    char b[8];
    for (int i = 0; i < n; ++i) b[i] = static_cast<char>(v >> (8 * i));
    out_->append(b, static_cast<size_t>(n));
  }
  std::string* out_;
};

// Every read returns false, and reads nothing, past the end of the input.
class ByteReader {
 public:
  explicit ByteReader(std::string_view in) : in_(in) {}
  bool U8(uint8_t* v) { return Fixed(v, 1); }
  bool U16(uint16_t* v) { return Fixed(v, 2); }
  bool U32(uint32_t* v) { return Fixed(v, 4); }
  bool U64(uint64_t* v) { return Fixed(v, 8); }
  bool Bytes(std::string_view* b) {
    uint32_t n;
    return U32(&n) && Raw(n, b);
  }
  bool Bytes(std::string* b) {
    std::string_view v;
    if (!Bytes(&v)) return false;
    b->assign(v);
    return true;
  }
  bool Raw(size_t n, std::string_view* b) {
    if (n > in_.size()) return false;
    *b = in_.substr(0, n);
    in_.remove_prefix(n);
    return true;
  }
  size_t left() const { return in_.size(); }
  bool done() const { return in_.empty(); }

 private:
  template <typename T>
  bool Fixed(T* v, size_t n) {
    if (in_.size() < n) return false;
    uint64_t x = 0;
    for (size_t i = 0; i < n; ++i) x |= uint64_t{static_cast<uint8_t>(in_[i])} << (8 * i);
    *v = static_cast<T>(x);
    in_.remove_prefix(n);
    return true;
  }
  std::string_view in_;
};

}  // namespace ferry

#endif  // FERRY_BASE_BYTES_H_
