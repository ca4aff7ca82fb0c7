#include "tests/testing/pattern.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace ferry::testing {
namespace {

uint64_t Mix(uint64_t x) {  // splitmix64
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

}  // namespace

uint8_t PatternByte(uint64_t seed, uint64_t offset) {
  return static_cast<uint8_t>(Mix(seed ^ (offset >> 3)) >> (8 * (offset & 7)));
}

void FillPattern(uint64_t seed, uint64_t offset, uint8_t* buf, uint64_t n) {
  uint64_t i = 0;
  for (; i < n && ((offset + i) & 7) != 0; ++i) buf[i] = PatternByte(seed, offset + i);
  for (; i + 8 <= n; i += 8) {
    const uint64_t word = Mix(seed ^ ((offset + i) >> 3));
    memcpy(buf + i, &word, 8);  // little-endian: byte k of the word is offset k
  }
  for (; i < n; ++i) buf[i] = PatternByte(seed, offset + i);
}

uint64_t FirstPatternMismatch(uint64_t seed, uint64_t offset, const uint8_t* buf, uint64_t n) {
  uint8_t chunk[4096];
  for (uint64_t done = 0; done < n;) {
    const uint64_t len = std::min<uint64_t>(sizeof(chunk), n - done);
    FillPattern(seed, offset + done, chunk, len);
    if (memcmp(chunk, buf + done, len) != 0) {
      for (uint64_t k = 0; k < len; ++k) {
        if (chunk[k] != buf[done + k]) return done + k;
      }
    }
    done += len;
  }
  return n;
}

std::vector<uint64_t> RandomPieces(std::mt19937_64& rng, uint64_t total, uint64_t min_piece,
                                   uint64_t max_piece) {
  std::uniform_real_distribution<double> u(std::log(static_cast<double>(min_piece)),
                                           std::log(static_cast<double>(max_piece) + 1));
  std::vector<uint64_t> pieces;
  for (uint64_t left = total; left > 0;) {
    uint64_t n = static_cast<uint64_t>(std::exp(u(rng)));
    n = std::clamp<uint64_t>(n, min_piece, max_piece);
    n = std::min(n, left);
    pieces.push_back(n);
    left -= n;
  }
  return pieces;
}

std::vector<Extent> RandomSourceLayout(std::mt19937_64& rng, const std::vector<uint64_t>& pieces,
                                       uint64_t region_size) {
  std::vector<Extent> out;
  for (uint64_t n : pieces) {
    out.push_back({0, std::uniform_int_distribution<uint64_t>(0, region_size - n)(rng), n});
  }
  return out;
}

std::vector<Extent> RandomDestinationLayout(std::mt19937_64& rng,
                                            const std::vector<uint64_t>& pieces, uint64_t max_gap,
                                            uint64_t* region_size) {
  std::vector<size_t> order(pieces.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::shuffle(order.begin(), order.end(), rng);
  std::vector<Extent> out(pieces.size());
  uint64_t pos = 0;
  for (size_t i : order) {
    pos += std::uniform_int_distribution<uint64_t>(0, max_gap)(rng);
    out[i] = {0, pos, pieces[i]};
    pos += pieces[i];
  }
  *region_size = pos + std::uniform_int_distribution<uint64_t>(1, max_gap + 1)(rng);
  return out;
}

std::vector<Extent> ScatteredLayout(std::mt19937_64& rng, uint64_t count, uint64_t piece,
                                    uint64_t stride) {
  std::vector<uint64_t> slots(count);
  for (uint64_t i = 0; i < count; ++i) slots[i] = i;
  std::shuffle(slots.begin(), slots.end(), rng);
  std::vector<Extent> out;
  out.reserve(count);
  for (uint64_t s : slots) out.push_back({0, s * stride, piece});
  return out;
}

std::string VerifyTransfer(uint64_t seed, const std::vector<Extent>& src,
                           const std::vector<Extent>& dst, const uint8_t* dst_buf,
                           uint64_t dst_size, uint8_t canary) {
  // Walk both lists together: each run maps a destination range onto a source range.
  size_t si = 0, di = 0;
  uint64_t s_used = 0, d_used = 0, k = 0;
  while (si < src.size() && di < dst.size()) {
    if (src[si].length == s_used) {
      ++si;
      s_used = 0;
      continue;
    }
    if (dst[di].length == d_used) {
      ++di;
      d_used = 0;
      continue;
    }
    const uint64_t n = std::min(src[si].length - s_used, dst[di].length - d_used);
    const uint64_t d_off = dst[di].offset + d_used, s_off = src[si].offset + s_used;
    if (d_off + n > dst_size) return absl::StrCat("destination extent past the region");
    const uint64_t bad = FirstPatternMismatch(seed, s_off, dst_buf + d_off, n);
    if (bad != n) {
      return absl::StrCat("transfer byte ", k + bad, " (destination offset ", d_off + bad, ") is ",
                          dst_buf[d_off + bad], ", want source byte at ", s_off + bad);
    }
    s_used += n;
    d_used += n;
    k += n;
  }
  std::vector<Extent> sorted = dst;
  std::sort(sorted.begin(), sorted.end(),
            [](const Extent& a, const Extent& b) { return a.offset < b.offset; });
  uint64_t pos = 0;
  auto check_gap = [&](uint64_t end) -> std::string {
    for (uint64_t i = pos; i < end; ++i) {
      if (dst_buf[i] != canary) return absl::StrCat("byte ", i, " outside the extents changed");
    }
    return "";
  };
  for (const Extent& e : sorted) {
    if (std::string err = check_gap(e.offset); !err.empty()) return err;
    pos = std::max(pos, e.offset + e.length);
  }
  return check_gap(dst_size);
}

}  // namespace ferry::testing
