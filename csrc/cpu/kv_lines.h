// Loads that put a chunk's cache misses in flight before the kernel's strided passes read it:
// the pool's slots lie anywhere in memory, so the hardware prefetchers cannot see them coming.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "../attention.h"
#include "decode_plan.h"

namespace chunkgen {
namespace decode {

// One word of every cache line of x[0, n), in address order, into four independent chains.
template <typename T>
inline void load_lines(const T* x, size_t n, uint32_t (&a)[4]) {
  constexpr size_t kLine = 64 / sizeof(T);
  const auto word = [](const T* y) {
    uint32_t w;
    std::memcpy(&w, y, sizeof w);
    return w;
  };
  size_t e = 0;
  for (; e + 4 * kLine <= n; e += 4 * kLine) {
    a[0] |= word(x + e);
    a[1] |= word(x + e + kLine);
    a[2] |= word(x + e + 2 * kLine);
    a[3] |= word(x + e + 3 * kLine);
  }
  for (; e < n; e += kLine) a[0] |= word(x + e);
}

// Every line of head h's K^T and V in pool slot `slot`, its first n tokens.
template <typename T>
inline void load_slot(const DecodeProblem& p, const PoolView& pool, int64_t slot, int h, int n, uint32_t (&a)[4]) {
  const int C = p.chunk, d = p.head_dim;
  const size_t off = pool.at(slot, h);
  const T* k = static_cast<const T*>(p.k) + off;
  const T* v = static_cast<const T*>(p.v) + off;
  // K^T's rows are C apart: a full chunk is one run of d * C, a partial one n of each row.
  const size_t run = n == C ? static_cast<size_t>(d) * C : static_cast<size_t>(n);
  for (int t = 0; t < (n == C ? 1 : d); ++t) load_lines(k + static_cast<size_t>(t) * C, run, a);
  load_lines(v, static_cast<size_t>(n) * d, a);
}

// Every cache line of own chunks [lo, hi) (head h, each chunk's first n tokens), loaded in address
// order just before the products read them. The products read K^T and V in strided passes (a line
// every 256 bytes in fp32, the next pass a line over), which keep few misses in flight; these
// independent loads put all of the chunks' misses in flight at once, beside what the prefetch of
// the row before already brought. Their values only feed an empty asm: nothing is computed.
// (AVX2 build, 256 rows 58 tokens into their answers on 2,048 shared: the phase 102-109 ms a
// step without, 85-92 with; level in bf16 on AVX-512, where the phase is closer to its arithmetic.)
template <typename T>
inline void load_chunks(const DecodeProblem& p, const Workspace& ws, const PoolView& pool, int lo, int hi, int h) {
  uint32_t a[4] = {};
  for (int i = lo; i < hi; ++i)
    if (ws.chunk_len[i] > 0) load_slot<T>(p, pool, ws.chunk_slot[i], h, ws.chunk_len[i], a);
  asm volatile("" ::"r"(a[0] | a[1] | a[2] | a[3]));
}
// Own chunks loaded at once: a long tail is loaded a few chunks at a time, so that what is loaded
// still sits in L2 when the products reach it (4 fp32 chunks of one head: 128 KiB).
constexpr int kLoadChunks = 4;

}  // namespace decode
}  // namespace chunkgen
