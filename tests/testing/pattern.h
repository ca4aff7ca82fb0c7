// Deterministic byte patterns and random layouts for tests and benchmarks that move bytes
// between processes and check every one of them.
#ifndef FERRY_TESTS_TESTING_PATTERN_H_
#define FERRY_TESTS_TESTING_PATTERN_H_

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "engine/types.h"

namespace ferry::testing {

// Byte `offset` of the pattern for `seed`.
uint8_t PatternByte(uint64_t seed, uint64_t offset);
// Fills buf[0, n) with the pattern bytes at offsets [offset, offset + n).
void FillPattern(uint64_t seed, uint64_t offset, uint8_t* buf, uint64_t n);
// Index of the first byte of buf[0, n) that differs from the pattern, or n.
uint64_t FirstPatternMismatch(uint64_t seed, uint64_t offset, const uint8_t* buf, uint64_t n);

// Piece lengths summing to `total`, log-uniform between min_piece and max_piece.
std::vector<uint64_t> RandomPieces(std::mt19937_64& rng, uint64_t total, uint64_t min_piece,
                                   uint64_t max_piece);
// Source layout: the pieces at random offsets of a region of `region_size` bytes (they may
// overlap: a source byte can be read twice).
std::vector<Extent> RandomSourceLayout(std::mt19937_64& rng, const std::vector<uint64_t>& pieces,
                                       uint64_t region_size);
// Destination layout: the pieces disjoint, in shuffled order, with random gaps. Returns the
// region size it needs in *region_size.
std::vector<Extent> RandomDestinationLayout(std::mt19937_64& rng,
                                            const std::vector<uint64_t>& pieces, uint64_t max_gap,
                                            uint64_t* region_size);
// `count` pieces of `piece` bytes, each at a distinct slot of a region of count*stride bytes,
// in shuffled order (the "scattered" benchmark layout).
std::vector<Extent> ScatteredLayout(std::mt19937_64& rng, uint64_t count, uint64_t piece,
                                    uint64_t stride);

// Checks a destination buffer after a transfer: every byte inside `dst` equals the source
// pattern byte it came from (through `src`), every byte outside equals `canary`. Returns ""
// or a description of the first wrong byte.
std::string VerifyTransfer(uint64_t seed, const std::vector<Extent>& src,
                           const std::vector<Extent>& dst, const uint8_t* dst_buf,
                           uint64_t dst_size, uint8_t canary);

}  // namespace ferry::testing

#endif  // FERRY_TESTS_TESTING_PATTERN_H_
