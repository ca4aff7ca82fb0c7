#include "engine/types.h"

#include <sys/mman.h>

#include <cstdint>

namespace ferry::engine {

namespace {

// A pull walks a scattered layout across the whole region, and the kernel's socket copies
// (tcp) or the NIC's translations (efa, verbs) miss far less often on 2 MiB pages.
constexpr uint64_t kHugePage = uint64_t{2} << 20;
constexpr uint64_t kPage = 4096;

uint64_t AlignOf(uint64_t size) { return size >= kHugePage ? kHugePage : kPage; }
uint64_t Rounded(uint64_t size) {
  return (size + AlignOf(size) - 1) / AlignOf(size) * AlignOf(size);
}

}  // namespace

void* AllocateHostMemory(uint64_t size) {
  // Mapped, not from the heap: unmapped again when freed, whatever its size, so the memory of
  // freed regions goes back to the system at once.
  const uint64_t align = AlignOf(size), rounded = Rounded(size);
  const uint64_t span = rounded + (align > kPage ? align : 0);
  void* mapped = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (mapped == MAP_FAILED) return nullptr;
  const auto base = reinterpret_cast<uintptr_t>(mapped);
  const uintptr_t start = (base + align - 1) / align * align;
  if (start > base) munmap(mapped, start - base);
  if (base + span > start + rounded) {
    munmap(reinterpret_cast<void*>(start + rounded), base + span - (start + rounded));
  }
  auto* mem = reinterpret_cast<char*>(start);
  if (align == kHugePage) madvise(mem, rounded, MADV_HUGEPAGE);
  // Fresh anonymous pages are zero. Their pages present in one call (Linux 5.14 on); an older
  // kernel refuses it, and a write to each page faults them in.
  if (madvise(mem, rounded, MADV_POPULATE_WRITE) != 0) {
    for (uint64_t off = 0; off < rounded; off += kPage) mem[off] = 0;
  }
  return mem;
}

void FreeHostMemory(void* p, uint64_t size) {
  if (p != nullptr) munmap(p, Rounded(size));
}

}  // namespace ferry::engine
