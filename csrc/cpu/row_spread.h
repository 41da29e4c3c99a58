// A register group of a linear product reads its rows of x side by side at every k step. Rows whose
// starts lie a multiple of 4 KiB apart (k = 2,048 in bf16, 1,024 in fp32, and most large models'
// widths) all fall in one of L1's 64 sets (4 KiB a way), so a group of 14 evicts itself along k:
// 256 rows of 2,048 bf16 ran at 344 GFLOP/s, the same rows 32 bytes further apart at 448 (Zen 4;
// fp32 at k = 1,024 168 against 223). 1 or 2 KiB apart (two or four sets) ran at full rate. Such
// an x is read from a copy with an odd number of cache lines a row, which spreads its rows over
// every set; each thread makes its own, since each reads every row.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <vector>
#include "aligned.h"

namespace chunkgen {

// Whether `group` rows row_bytes apart put more lines in one L1 set than its 8 ways hold beside
// the weights' lines.
inline bool rows_crowd_a_set(int64_t row_bytes, int group) {
  if (row_bytes % 64 != 0) return false;
  const int64_t sets_apart = std::gcd<int64_t>(row_bytes / 64, 64);  // sets visited: 64 / this
  const int64_t per_set = (group + 64 / sets_apart - 1) / (64 / sets_apart);
  return per_set > 7;
}

// Rows [0, rows) of x (elems each, row stride ldx) in this thread's own buffer, ld elements a row,
// ld an odd number of cache lines; rows [rows, padded_rows) zero (AMX's tiles read whole tiles of
// 16 rows).
template <typename T>
const T* spread_rows(const T* x, int64_t ldx, int64_t rows, int64_t elems, int64_t& ld, int64_t padded_rows = 0) {
  thread_local AlignedVector<T> buf;
  constexpr int64_t per_line = 64 / sizeof(T);
  ld = (((elems + per_line - 1) / per_line) | 1) * per_line;
  buf.resize(static_cast<size_t>(std::max(rows, padded_rows) * ld));
  for (int64_t r = 0; r < rows; ++r) std::memcpy(buf.data() + r * ld, x + r * ldx, sizeof(T) * elems);
  if (padded_rows > rows) std::memset(buf.data() + rows * ld, 0, sizeof(T) * (padded_rows - rows) * ld);
  return buf.data();
}

}  // namespace chunkgen
