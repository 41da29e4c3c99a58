// The decode step's linear layers in fp32 on FMA vectors (every x86 ISA: AVX2 and AVX-512 builds
// alike, the build's vector width from vec.h): y = x W^T for a few rows of x, W repacked once into
// blocks of two vectors of output columns, each block one contiguous run along k. A group of R
// rows keeps R x 2 vectors of sums in registers and reads each k step's two weight vectors once
// for all R rows; the block stays in L1/L2 while the next row groups read it, so W comes from
// memory once a product. oneDNN's AVX2 kernels reach about half the FMA peak at a decode batch of
// 32; these reach (see `bench step`) the rate of the FMA units.
#include <omp.h>

#include <algorithm>
#include <cstring>

#include "../linear.h"
#include "output_lines.h"
#include "prefetch.h"
#include "row_spread.h"
#include "vec.h"

namespace chunkgen {
namespace {

using decode::load;
using decode::splat;
using decode::store;
using decode::vf;
using decode::W;

constexpr int kCols = 2 * W;  // output columns of a block
// Rows of a register group: R x 2 accumulators, two weight vectors and one broadcast must fit the
// register file (16 vector registers below AVX-512, 32 with it).
constexpr int kGroup = W == 16 ? 14 : 6;

using Prefetch = NextBlockPrefetch<float>;  // a step of k (kCols floats) a turn

template <int R>
inline void fma_rows(const float* x, int64_t ldx, const float* wb, int64_t k, float* y, int64_t ldy, int cols,
                     Prefetch pf, bool stream) {
  vf acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = vf{};
  for (int64_t i = 0, turn = pf.phase; i < k; ++i) {
    if (pf.due(turn)) {
      for (int line = 0; line < kCols; line += 16) __builtin_prefetch(pf.next + i * kCols + line, 0, 3);
    }
    const vf b0 = load(wb + i * kCols), b1 = load(wb + i * kCols + W);
    for (int r = 0; r < R; ++r) {
      const vf a = splat(x[r * ldx + i]);
      acc0[r] = decode::vfma(a, b0, acc0[r]);  // explicit: the same rounding in every R's instance
      acc1[r] = decode::vfma(a, b1, acc1[r]);
    }
  }
  if (cols == kCols && stream) {  // whole lines (output_lines.h)
    for (int r = 0; r < R; ++r) {
      decode::stream(y + r * ldy, acc0[r]);
      decode::stream(y + r * ldy + W, acc1[r]);
    }
    return;
  }
  if (cols == kCols) {
    for (int r = 0; r < R; ++r) {
      store(y + r * ldy, acc0[r]);
      store(y + r * ldy + W, acc1[r]);
    }
    return;
  }
  alignas(64) float c[kCols];
  for (int r = 0; r < R; ++r) {  // the last block's columns past n are not written
    store(c, acc0[r]);
    store(c + W, acc1[r]);
    std::memcpy(y + r * ldy, c, sizeof(float) * cols);
  }
}

template <int R>
inline void fma_rows_tail(int rows, const float* x, int64_t ldx, const float* wb, int64_t k, float* y, int64_t ldy,
                          int cols, Prefetch pf, bool stream) {
  if constexpr (R > 0) {
    if (rows == R) return fma_rows<R>(x, ldx, wb, k, y, ldy, cols, pf, stream);
    fma_rows_tail<R - 1>(rows, x, ldx, wb, k, y, ldy, cols, pf, stream);
  }
}

}  // namespace

torch::Tensor pack_linear_fp32(const torch::Tensor& w) {
  const auto wc = w.contiguous();
  const int64_t n = wc.size(0), k = wc.size(1), blocks = (n + kCols - 1) / kCols;
  auto packed = torch::zeros({blocks, k, kCols}, wc.options());
  const float* src = wc.data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t c = 0; c < kCols && b * kCols + c < n; ++c) {
        const float* row = src + (b * kCols + c) * k;
        float* out = dst + b * k * kCols + c;
        for (int64_t i = 0; i < k; ++i) out[i * kCols] = row[i];
      }
  });
  return packed;
}

int64_t packed_linear_fp32_cols() { return kCols; }

void packed_linear_fp32(const float* x, int64_t ldx, int64_t rows, const float* w, int64_t k, int64_t n, float* y) {
  const int64_t blocks = (n + kCols - 1) / kCols;
  const bool stream = stream_output(y, rows, n * 4);
  // One parallel region for every panel: threads write disjoint columns, so no panel waits for
  // another (on a busy machine each region's barrier waits for a descheduled thread).
#pragma omp parallel
  {
    // Contiguous block ranges: each thread streams one run of memory.
    const int nt = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t b_first = blocks * t / nt, b_end = blocks * (t + 1) / nt;
    // Panels of rows that keep x in L2 while the blocks pass; a row's sums are the same in any panel.
    for (int64_t p0 = 0; p0 < rows; p0 += kPackedLinearFp32MaxRows) {
      const int panel = static_cast<int>(std::min(kPackedLinearFp32MaxRows, rows - p0));
      int64_t ldp = ldx;  // the panel's rows, spread over L1's sets where they would crowd one
      const float* xp = panel > 1 && rows_crowd_a_set(ldx * 4, std::min(panel, kGroup))
                            ? spread_rows(x + p0 * ldx, ldx, panel, k, ldp)
                            : x + p0 * ldx;
      const int groups = (panel + kGroup - 1) / kGroup;
      for (int64_t b = b_first; b < b_end; ++b) {
        const float* wb = w + b * k * kCols;
        const int cols = static_cast<int>(std::min<int64_t>(kCols, n - b * kCols));
        const float* next = b + 1 < b_end ? wb + k * kCols : nullptr;
        float* yb = y + p0 * n + b * kCols;
        int r = 0, g = 0;
        for (; r + kGroup <= panel; r += kGroup, ++g)
          fma_rows<kGroup>(xp + r * ldp, ldp, wb, k, yb + r * n, n, cols, {next, g, groups}, stream);
        if (r < panel)
          fma_rows_tail<kGroup - 1>(panel - r, xp + r * ldp, ldp, wb, k, yb + r * n, n, cols, {next, g, groups},
                                    stream);
      }
    }
    if (stream) stream_fence();  // the streamed lines before the other threads read y
  }
}

}  // namespace chunkgen
