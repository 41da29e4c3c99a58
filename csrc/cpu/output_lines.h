// A linear product writes y a block of columns at a time: one 64-byte line in each of the panel's
// rows, the rows a row of y apart, and no line is read back by the product. Through the cache each
// such store first reads its line (read for ownership), and where the row stride is a multiple of
// many lines (3,072 bf16 columns: 96 lines, so a block's lines fall in two of L1's sets; the
// 49,152-column output layer: all in one) the lines evict each other before the next block fills
// their neighbours. Streaming stores write whole lines without reading them. Measured on the Xeon's
// AMX in a 256-row decode step of the default model (ms a step, the four product shapes):
// 14.0 / 7.4 / 19.2 / 12.9 with plain stores, 12.4 / 5.6 / 14.3 / 7.7 streaming. The ops that read
// the outputs then find them in memory and take back a part (about 4 ms); the step's wall time
// went from 133-141 to 128-129 ms. At 32 rows, where reading the weights bounds every product,
// streaming made no difference.
#pragma once

#include <cstdint>

#include "intrinsics.h"

namespace chunkgen {

// Outputs this large go out as streaming stores: at 96 rows the 3,072- and 49,152-column products
// gained 1.9 and 1.5 ms a step, the 576- and 960-column ones (110 and 184 KiB) 0.2-0.3. Streaming
// only outputs past 4 MiB (the output layer's) left the 256-row step at 131-135 ms.
constexpr int64_t kStreamOutputBytes = 256 << 10;

// Whether a product's output y, rows x row_bytes, goes out as streaming stores: only whole lines
// (y and its row stride on 64-byte boundaries), and only large outputs.
inline bool stream_output(const void* y, int64_t rows, int64_t row_bytes) {
  return reinterpret_cast<uintptr_t>(y) % 64 == 0 && row_bytes % 64 == 0 && rows * row_bytes >= kStreamOutputBytes;
}

// Orders a thread's streaming stores before what it does next (the threads joining to read y).
inline void stream_fence() {
#if defined(__SSE__)
  _mm_sfence();
#endif
}

#if defined(__AVX512F__)
// rows x 64 bytes from src (packed) to dst (rows ld elements of T apart), by streaming stores.
template <typename T>
inline void stream_lines(const T* src, int64_t rows, T* dst, int64_t ld) {
  constexpr int64_t per_line = 64 / sizeof(T);
  for (int64_t r = 0; r < rows; ++r)
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + r * ld), _mm512_load_si512(src + r * per_line));
}
#endif

}  // namespace chunkgen
