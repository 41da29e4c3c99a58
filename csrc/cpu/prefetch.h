// Software prefetches the compiler keeps. GCC takes __builtin_prefetch (and _mm_prefetch, built on
// it) for free of side effects: a function made of nothing but prefetches is found to be const and
// its calls are deleted. The decode kernel's prefetch of the next row's chunks in phase 2
// (prefetch_chunks, the fp32 path) was gone from the binary that way, and the bf16 path's lost
// theirs whenever the inliner left NextChunkLines::prefetch a call. A volatile asm is a side
// effect no pass removes. It also ties the compiler's hands: the fp32 linear product's prefetch
// (linear_fp32.cpp, in a loop of FMAs, where the builtin is kept) as this asm made the product 2x
// slower, so it stays a builtin.
#pragma once

#include <cstdint>

namespace chunkgen {

// The share of the next weight block that one row group of a blocked linear product fetches: one
// step of k in every `groups`, from its own `phase`. The first row group over a block would read it
// from memory at the rate of its dot products, faster than one core's share of the bandwidth, and
// the later groups would read none: spread over every group of the current block, the fetches keep
// ahead without a burst. The products keep __builtin_prefetch (see above).
template <typename T>
struct NextBlockPrefetch {
  const T* next;  // the next block (nullptr: none)
  int phase, groups;

  // Whether step k's share is due; turn starts at phase and counts down.
  bool due(int64_t& turn) const {
    if (next != nullptr && --turn < 0) {
      turn = groups - 1;
      return true;
    }
    return false;
  }
};

// The line holding p, toward L2 (prefetcht1).
inline void prefetch_l2(const void* p) {
#if defined(__x86_64__) || defined(__i386__)
  asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p)));
#else
  __builtin_prefetch(p, 0, 2);
  asm volatile("" : : "r"(p) : "memory");
#endif
}

}  // namespace chunkgen
