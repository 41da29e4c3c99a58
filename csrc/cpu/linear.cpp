// The decode step's linear layers on AMX tiles, or AVX512_BF16 dot products where a CPU has no
// AMX (csrc/linear.h). At a decode batch the product is bound by reading the weights, once, from
// memory: each 32-column block of W is one contiguous run that the hardware prefetcher streams,
// and the two threads read disjoint runs. The dot-product path also fetches the next block from
// every row group (Prefetch): on a Zen 5 at 32 rows, the default model's 121 products with their
// weights from memory took 12-14 ms against 16-29 without it, the Llama-3.2-1B shape's 42-46
// against 57-75. Measured on the Xeon's AMX at 32 rows against oneDNN's
// packed matmul: the default model's 120 layer products 9.5 ms against 13.3 when their weights
// come from memory, a lone product right after a cache flush 70 us against 150; equal results
// (the same fp32 sums in the same order, rounded once to bf16).
#include "../linear.h"

#include <omp.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "aligned.h"
#include "bf16_gemm.h"
#include "isa.h"
#include "output_lines.h"
#include "prefetch.h"
#include "row_spread.h"

namespace chunkgen {

torch::Tensor pack_linear_op(const torch::Tensor& w) {
  TORCH_CHECK_VALUE(w.dim() == 2 && w.device().is_cpu(), "pack_linear: w must be a 2-d CPU tensor, got ", w.sizes(),
                    " on ", w.device());
  if (w.scalar_type() == torch::kFloat) return pack_linear_fp32(w);
  TORCH_CHECK_TYPE(w.scalar_type() == torch::kBFloat16, "pack_linear: w must be bfloat16 or float32, got ",
                   w.scalar_type());
  const auto wc = w.contiguous();
  const int64_t n = wc.size(0), k = wc.size(1), blocks = (n + 31) / 32, kp = (k + 31) / 32 * 32;
  auto packed = torch::zeros({blocks, kp / 2, 32, 2}, wc.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(wc.data_ptr());
  uint16_t* dst = reinterpret_cast<uint16_t*>(packed.data_ptr());
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t c = 0; c < 32 && b * 32 + c < n; ++c) {
        const uint16_t* row = src + (b * 32 + c) * k;
        uint16_t* out = dst + b * kp * 32 + 2 * c;
        for (int64_t i = 0; i < k; ++i) out[(i / 2) * 64 + (i % 2)] = row[i];
      }
  });
  return packed;
}

#if defined(CHUNKGEN_HAVE_AVX512_BF16)
namespace {

// Rows [0, rows) of a block's fp32 sums c (32 a row) rounded to bf16 into y (row stride n) at
// column n0; streamed (output_lines.h) where the block is whole.
inline void store_block(const float* c, int rows, uint16_t* y, int64_t n, int64_t n0, bool stream) {
  const int64_t cols = std::min<int64_t>(32, n - n0);
  const __mmask32 m = cols >= 32 ? ~__mmask32(0) : (__mmask32(1) << cols) - 1;
  for (int r = 0; r < rows; ++r) {
    const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_load_ps(c + r * 32 + 16), _mm512_load_ps(c + r * 32));
    if (stream && cols == 32)
      _mm512_stream_si512(reinterpret_cast<__m512i*>(y + r * n + n0), (__m512i)v);
    else
      _mm512_mask_storeu_epi16(y + r * n + n0, m, (__m512i)v);
  }
}

}  // namespace
#endif

#if defined(CHUNKGEN_HAVE_AMX)
namespace {

// One block of the product for RT row tiles (16 rows each) at xr: the block's two 16-column tiles
// over all of k (accumulators in tiles 0..3, x's row tiles in 4..5, the block's column tiles in
// 6..7), its first `rows` rows rounded to bf16 into y (row stride n) at column n0. A row's sums are
// its own tile row's, whatever RT and the rows beside it.
template <int RT>
inline void amx_block_rows(const uint16_t* xr, int64_t ldr, int rows, const uint16_t* wb, int64_t kp, int64_t n,
                           int64_t n0, uint16_t* y, float* c, bool stream) {
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (RT == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t k = 0; k < kp; k += 32) {
    const uint16_t* wk = wb + k * 32;  // 16 pair-rows of 32 columns
    _tile_loadd(6, wk, 128);
    _tile_loadd(7, wk + 32, 128);
    _tile_loadd(4, xr + k, ldr * 2);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (RT == 2) {
      _tile_loadd(5, xr + 16 * ldr + k, ldr * 2);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, 128);
  _tile_stored(1, c + 16, 128);
  if constexpr (RT == 2) {
    _tile_stored(2, c + 16 * 32, 128);
    _tile_stored(3, c + 16 * 32 + 16, 128);
  }
  store_block(c, rows, y, n, n0, stream);
}

// Rows of x a thread passes over each of its blocks at once (prefill waves, large decode batches):
// the panel's x stays in L2 while each block's weights are read once for all its rows (a call per
// 32 rows read every weight of the layer again for each 32).
constexpr int kAmxPanelRows = 256;

// y = x W^T for any rows: each thread a contiguous run of blocks (at a decode batch each streams one
// run of memory), panels of rows over each block. A panel is read in place where its rows are whole
// tiles of 16 and do not crowd an L1 set, else from this thread's copy (spread, zero-padded rows).
void packed_linear_amx(const uint16_t* x, int64_t ldx, int rows, const uint16_t* w, int64_t kp, int64_t n,
                       uint16_t* y) {
  const int64_t blocks = (n + 31) / 32, block_elems = kp * 32;
  const bool crowd = rows_crowd_a_set(ldx * 2, 16), stream = stream_output(y, rows, n * 2);
#pragma omp parallel
  {
    static const bf16::TileConfig tile_config;
    _tile_loadconfig(&tile_config);
    alignas(64) float c[32 * 32];
    const int nt = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t b0 = blocks * t / nt, b1 = blocks * (t + 1) / nt;
    for (int p0 = 0; p0 < rows && b0 < b1; p0 += kAmxPanelRows) {
      const int pr = std::min(kAmxPanelRows, rows - p0), tile_rows = bf16::round_up(pr, 16);
      const uint16_t* xr = x + p0 * ldx;
      int64_t ldr = ldx;
      // x and ldx are shared by the threads: each reads its own copy through xr and ldr.
      if (crowd || tile_rows != pr) xr = spread_rows(xr, ldx, pr, kp, ldr, tile_rows);
      for (int64_t b = b0; b < b1; ++b)
        for (int r = 0; r < pr; r += 32) {
          const int left = std::min(32, pr - r);
          if (left > 16)
            amx_block_rows<2>(xr + r * ldr, ldr, left, w + b * block_elems, kp, n, b * 32, y + (p0 + r) * n, c, stream);
          else
            amx_block_rows<1>(xr + r * ldr, ldr, left, w + b * block_elems, kp, n, b * 32, y + (p0 + r) * n, c, stream);
        }
    }
    if (stream) stream_fence();  // the streamed lines before the other threads read y
    _tile_release();
  }
}

}  // namespace
#endif

#if defined(CHUNKGEN_HAVE_AVX512_BF16)
namespace {

using Prefetch = NextBlockPrefetch<uint16_t>;  // a pair-row of k (two lines) a turn

// The same product on AVX512_BF16 dot products (CPUs without AMX): R rows x 32 columns of fp32
// sums in registers, each pair-row of the block (32 columns x 2 k, two vectors) read once per
// row group.
template <int R>
inline void dpbf16_rows(const uint16_t* x, int64_t ldx, const uint16_t* wb, int64_t kp, float* c, Prefetch pf) {
  __m512 acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm512_setzero_ps();
  for (int64_t k = 0, turn = pf.phase; k < kp; k += 2) {
    if (pf.due(turn)) {
      __builtin_prefetch(pf.next + k * 32, 0, 3);
      __builtin_prefetch(pf.next + k * 32 + 32, 0, 3);
    }
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(wb + k * 32);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(wb + k * 32 + 32);
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * ldx + k, 4);
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
      acc0[r] = _mm512_dpbf16_ps(acc0[r], a, b0);
      acc1[r] = _mm512_dpbf16_ps(acc1[r], a, b1);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_store_ps(c + r * 32, acc0[r]);
    _mm512_store_ps(c + r * 32 + 16, acc1[r]);
  }
}

// Any number of rows: each thread walks its weight blocks, and every row group passes over a block
// while it is in cache (the weights are read once a call, whatever the rows). Rows that must be
// read from a spread copy (row_spread.h) go in panels whose copy stays within kSpreadBytes a
// thread, each panel one pass over the weights (a prefill wave of 8,192 rows of 4,096 would
// otherwise hold two more copies of its 64 MiB). A row's sums are the same whichever group or
// panel it is in (its own chain of dot products over k), so the result for a row does not depend
// on how many rows the call has.
void packed_linear_dpbf16(const uint16_t* x, int64_t ldx, int rows, const uint16_t* w, int64_t kp, int64_t n,
                          uint16_t* y) {
  constexpr int kGroup = 14;  // 28 accumulators, two weight vectors, one broadcast: 31 registers
  constexpr int64_t kSpreadBytes = 8 << 20;
  const int64_t blocks = (n + 31) / 32, block_elems = kp * 32;
  const bool spread = rows > 1 && rows_crowd_a_set(ldx * 2, std::min(rows, kGroup));
  const int panel_rows = spread ? static_cast<int>(std::max<int64_t>(256, kSpreadBytes / (2 * kp))) : rows;
  const bool stream = stream_output(y, rows, n * 2);
#pragma omp parallel
  {
    alignas(64) float c[kGroup * 32];
    const int nt = omp_get_num_threads(), t = omp_get_thread_num();
    for (int p0 = 0; p0 < rows; p0 += panel_rows) {
      const int panel = std::min(panel_rows, rows - p0);
      // x and ldx are shared by the threads: each reads its own spread copy through xr and ldr.
      int64_t ldr = ldx;
      const uint16_t* xr = spread ? spread_rows(x + p0 * ldx, ldx, panel, kp, ldr) : x + p0 * ldx;
      uint16_t* yp = y + static_cast<int64_t>(p0) * n;
      const int groups = (panel + kGroup - 1) / kGroup;
      for (int64_t b = blocks * t / nt, end = blocks * (t + 1) / nt; b < end; ++b) {
        const uint16_t* wb = w + b * block_elems;
        const uint16_t* next = b + 1 < end ? wb + block_elems : nullptr;
        const int64_t n0 = b * 32;
        for (int r = 0; r < panel; r += kGroup) {
          const int g = std::min(kGroup, panel - r);
          const Prefetch pf{next, r / kGroup, groups};
          // clang-format off
          switch (g) {
#define CHUNKGEN_ROWS(m) \
  case m: dpbf16_rows<m>(xr + r * ldr, ldr, wb, kp, c, pf); break;
            CHUNKGEN_ROWS(1) CHUNKGEN_ROWS(2) CHUNKGEN_ROWS(3) CHUNKGEN_ROWS(4) CHUNKGEN_ROWS(5)
            CHUNKGEN_ROWS(6) CHUNKGEN_ROWS(7) CHUNKGEN_ROWS(8) CHUNKGEN_ROWS(9) CHUNKGEN_ROWS(10)
            CHUNKGEN_ROWS(11) CHUNKGEN_ROWS(12) CHUNKGEN_ROWS(13) CHUNKGEN_ROWS(14)
#undef CHUNKGEN_ROWS
            default: break;
          }
          // clang-format on
          store_block(c, g, yp + r * n, n, n0, stream);
        }
      }
    }
    if (stream) stream_fence();  // the streamed lines before the other threads read y
  }
}

}  // namespace
#endif

namespace {

torch::Tensor packed_linear_fp32_op(const torch::Tensor& x, const torch::Tensor& packed, int64_t n) {
  const int64_t rows = x.size(0), k = x.size(1), cols = packed_linear_fp32_cols();
  TORCH_CHECK_VALUE(packed.dim() == 3 && packed.is_contiguous() && packed.size(0) == (n + cols - 1) / cols &&
                        packed.size(1) == k && packed.size(2) == cols,
                    "packed_linear: packed must come from pack_linear of a [", n, ", ", k, "] float32 weight, got ",
                    packed.sizes());
  auto y = torch::empty({rows, n}, x.options());
  if (rows == 0 || n == 0) return y;
  const auto xc = x.stride(1) == 1 ? x : x.contiguous();
  packed_linear_fp32(xc.data_ptr<float>(), xc.stride(0), rows, packed.data_ptr<float>(), k, n, y.data_ptr<float>());
  return y;
}

}  // namespace

torch::Tensor packed_linear_op(const torch::Tensor& x, const torch::Tensor& packed, int64_t n) {
  TORCH_CHECK_VALUE(x.dim() == 2 && x.device().is_cpu(), "packed_linear: x must be a 2-d CPU tensor, got ", x.sizes(),
                    " on ", x.device());
  if (x.scalar_type() == torch::kFloat && packed.scalar_type() == torch::kFloat)
    return packed_linear_fp32_op(x, packed, n);
  TORCH_CHECK_TYPE(x.scalar_type() == torch::kBFloat16 && packed.scalar_type() == torch::kBFloat16,
                   "packed_linear: x and packed must be both bfloat16 or both float32, got ", x.scalar_type(), " and ",
                   packed.scalar_type());
  const int64_t rows = x.size(0), k = x.size(1), kp = (k + 31) / 32 * 32;
  TORCH_CHECK_VALUE(packed.dim() == 4 && packed.is_contiguous() && packed.size(0) == (n + 31) / 32 &&
                        packed.size(1) == kp / 2 && packed.size(2) == 32 && packed.size(3) == 2,
                    "packed_linear: packed must come from pack_linear of a [", n, ", ", k, "] weight, got ",
                    packed.sizes());
  auto y = torch::empty({rows, n}, x.options());
  if (rows == 0 || n == 0) return y;
#if defined(CHUNKGEN_HAVE_AVX512_BF16)
  const Isa isa = current_isa();
  TORCH_CHECK(isa != Isa::Fp32, "packed_linear needs AMX or AVX512_BF16; the CPU kernels' path is ", isa_name(isa));
  const uint16_t* xs = reinterpret_cast<const uint16_t*>(x.data_ptr());
  int64_t ldx = x.stride(0);
  // Both products read each row's k padded to 32 (the tiles' partial last tile of rows comes from
  // their own padded copy): x as it is when it has them, else a zero-padded copy (this thread's own,
  // so that calls from other threads do not share it).
  thread_local AlignedVector<uint16_t> padded;
  if (k != kp || x.stride(1) != 1) {
    padded.assign(static_cast<size_t>(rows) * kp, 0);
    const int64_t step = x.stride(1);
    for (int64_t r = 0; r < rows; ++r)
      if (step == 1)
        std::memcpy(padded.data() + r * kp, xs + r * ldx, sizeof(uint16_t) * k);
      else
        for (int64_t i = 0; i < k; ++i) padded[r * kp + i] = xs[r * ldx + i * step];
    xs = padded.data();
    ldx = kp;
  }
  const uint16_t* w = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  uint16_t* out = reinterpret_cast<uint16_t*>(y.data_ptr());
#if defined(CHUNKGEN_HAVE_AMX)
  if (isa == Isa::Amx) {
    packed_linear_amx(xs, ldx, static_cast<int>(rows), w, kp, n, out);
    return y;
  }
#endif
  packed_linear_dpbf16(xs, ldx, static_cast<int>(rows), w, kp, n, out);
  return y;
#else
  TORCH_CHECK(false, "packed_linear needs AMX or AVX512_BF16; this build has neither");
#endif
}

}  // namespace chunkgen
