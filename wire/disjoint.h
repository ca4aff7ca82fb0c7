// Whether the pieces of a layout share bytes: the pieces a pull writes must not (the bytes of
// two would race), wherever the check runs (the destination before it asks, the source before
// it writes).
#ifndef FERRY_WIRE_DISJOINT_H_
#define FERRY_WIRE_DISJOINT_H_

#include "ferry/layout.h"

namespace ferry {

// True when no two pieces of `layout` in the same region share a byte. Every piece's end must
// fit in 64 bits (as the bounds checks before it make sure). Linear in the pieces for runs
// that lie apart (each strided run's stride at least its piece, each page table's ids
// distinct) and for pieces given in order; sorts the pieces otherwise.
bool Disjoint(const Layout& layout);

}  // namespace ferry

#endif  // FERRY_WIRE_DISJOINT_H_
