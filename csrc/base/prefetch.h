// Software prefetching for the passes over many donors that no code has
// touched for a while (lazy_reads.h PrefetchLazy, py_types.h
// PrefetchEntries, live_tensors.cpp's walk): a hint to the CPU, never a
// read, so an address past an object's end costs nothing but the hint.
#pragma once

#include <cstddef>
#include <cstdint>

namespace torch_xla_donate {

// Asks for every cache line of [p, p + bytes), wherever p is aligned.
inline void PrefetchBytes(const void* p, size_t bytes) {
  constexpr uintptr_t kLine = 64;
  const uintptr_t start = reinterpret_cast<uintptr_t>(p);
  for (uintptr_t line = start & ~(kLine - 1); line < start + bytes; line += kLine)
    __builtin_prefetch(reinterpret_cast<const void*>(line));
}

}  // namespace torch_xla_donate
