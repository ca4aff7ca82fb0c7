// The checks on the pieces a pull writes, wherever they run (the destination before it asks,
// the source before it writes): each within its region, and no two sharing bytes (the bytes of
// two would race).
#ifndef FERRY_WIRE_DISJOINT_H_
#define FERRY_WIRE_DISJOINT_H_

#include <cstdint>
#include <optional>

#include "absl/functional/function_ref.h"
#include "ferry/layout.h"

namespace ferry {

// True when no two pieces of `layout` in the same region share a byte. Every piece's end must
// fit in 64 bits (as the bounds checks before it make sure). Linear in the pieces for runs
// that lie apart (each strided run's stride at least its piece, each page table's ids
// distinct) and for pieces given in order; sorts the pieces otherwise.
bool Disjoint(const Layout& layout);

// The bytes of `layout` when every run's pieces lie within its region (`length(region)` bytes
// long; nullopt: no such region), none is empty and their sum fits in 64 bits; nullopt
// otherwise. Checked run by run (a run's cover), not piece by piece: a caller that gets nullopt
// walks the pieces to name the wrong one.
std::optional<uint64_t> WithinRegions(
    const Layout& layout, absl::FunctionRef<std::optional<uint64_t>(uint64_t region)> length);

}  // namespace ferry

#endif  // FERRY_WIRE_DISJOINT_H_
