// bf16 building blocks of the CPU decode kernel's chunk-first phase: the pool's K and V tiles
// repacked into the pair-interleaved ("VNNI") layout the bf16 dot-product instructions read, and
// one small product `out[R, N] = A[R, K] . B[K, N]` (bf16 in, fp32 out) on AMX tiles or on
// AVX512_BF16 vectors. Compiled only where the compiler targets those ISAs; the caller checks at
// run time that the CPU (and, for AMX, the OS) grants them.
#pragma once
#include <cstddef>
#include <cstdint>

#include "intrinsics.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define CHUNKGEN_HAVE_AVX512_BF16 1
#endif
#if defined(CHUNKGEN_HAVE_AVX512_BF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define CHUNKGEN_HAVE_AMX 1
#endif

namespace chunkgen {
namespace bf16 {

inline int round_up(int x, int m) { return (x + m - 1) / m * m; }

// Round-to-nearest-even fp32 -> bf16 (the pool's and the model's rounding).
inline uint16_t from_float(float x) {
  uint32_t u;
  __builtin_memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline float to_float(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float x;
  __builtin_memcpy(&x, &u, 4);
  return x;
}

#if defined(CHUNKGEN_HAVE_AVX512_BF16)

// dst[k/2][n][k%2] = src row k, column n, for rows k < rows_valid and columns n < cols_valid
// (zero elsewhere, up to k_pad rows and n_cols columns). Zeroing matters: tokens past a chunk's
// length hold whatever the pool slot held before (possibly NaN), and 0 * NaN is NaN. dst_cols:
// the width of dst's rows when it is wider than n_cols (several sources side by side).
inline void pack_pairs(const uint16_t* src, int src_stride, int rows_valid, int k_pad, int n_cols, int cols_valid,
                       uint16_t* dst, int dst_cols = 0) {
  const int ld = dst_cols > 0 ? dst_cols : n_cols;
  // Word i of the low/high result: element i/2 (+16 for high) of row a (even i) or row b (odd i).
  alignas(64) static const uint16_t lo_idx[32] = {0, 32, 1, 33, 2,  34, 3,  35, 4,  36, 5,  37, 6,  38, 7,  39,
                                                  8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static const uint16_t hi_idx[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                  24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i lo = _mm512_load_si512(lo_idx), hi = _mm512_load_si512(hi_idx);
  for (int k = 0; k < k_pad; k += 2) {
    const uint16_t* ra = src + static_cast<size_t>(k) * src_stride;
    const uint16_t* rb = ra + src_stride;
    uint16_t* out = dst + static_cast<size_t>(k) * ld;
    for (int n = 0; n < n_cols; n += 32) {
      const int left = cols_valid - n;
      const __mmask32 m = left >= 32 ? ~__mmask32(0) : left <= 0 ? 0 : (__mmask32(1) << left) - 1;
      const __m512i a = k < rows_valid ? _mm512_maskz_loadu_epi16(m, ra + n) : _mm512_setzero_si512();
      const __m512i b = k + 1 < rows_valid ? _mm512_maskz_loadu_epi16(m, rb + n) : _mm512_setzero_si512();
      const int w = n_cols - n;  // columns of this block inside the output row
      if (w >= 32) {
        _mm512_storeu_si512(out + 2 * n, _mm512_permutex2var_epi16(a, lo, b));
        _mm512_storeu_si512(out + 2 * n + 32, _mm512_permutex2var_epi16(a, hi, b));
      } else {  // n_cols is a multiple of 16: one half block
        _mm512_storeu_si512(out + 2 * n, _mm512_permutex2var_epi16(a, lo, b));
      }
    }
  }
}

// out[r, n] (+)= sum_k A[r, k] B[k, n] for r < R (a multiple of RB), K a multiple of 32, N of 16;
// A bf16 row-major (stride lda elements), B packed by pack_pairs (N columns), out fp32 (stride
// ldo); `accumulate` adds to out instead of overwriting it. Each output is its own chain of dot
// products over k, the same whatever RB and R.
template <int RB = 8>  // rows per register block: RB x 2 accumulators + 2 B vectors
inline void gemm_dpbf16(const uint16_t* A, int lda, const uint16_t* B, int K, int N, float* out, int ldo, int R,
                        bool accumulate) {
  for (int n = 0; n < N; n += 32) {
    const bool two = n + 16 < N;
    for (int r0 = 0; r0 < R; r0 += RB) {
      __m512 acc0[RB], acc1[RB];
      for (int r = 0; r < RB; ++r) {
        const float* o = out + static_cast<size_t>(r0 + r) * ldo + n;
        acc0[r] = accumulate ? _mm512_loadu_ps(o) : _mm512_setzero_ps();
        acc1[r] = accumulate && two ? _mm512_loadu_ps(o + 16) : _mm512_setzero_ps();
      }
      const uint16_t* bp = B + 2 * n;
      for (int kp = 0; kp < K / 2; ++kp, bp += 2 * N) {
        const __m512bh b0 = (__m512bh)_mm512_loadu_si512(bp);
        const __m512bh b1 = two ? (__m512bh)_mm512_loadu_si512(bp + 32) : b0;
        for (int r = 0; r < RB; ++r) {
          int32_t pair;
          __builtin_memcpy(&pair, A + static_cast<size_t>(r0 + r) * lda + 2 * kp, 4);
          const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
          acc0[r] = _mm512_dpbf16_ps(acc0[r], a, b0);
          acc1[r] = _mm512_dpbf16_ps(acc1[r], a, b1);
        }
      }
      for (int r = 0; r < RB; ++r) {
        float* o = out + static_cast<size_t>(r0 + r) * ldo + n;
        _mm512_storeu_ps(o, acc0[r]);
        if (two) _mm512_storeu_ps(o + 16, acc1[r]);
      }
    }
  }
}

// Columns [n, n + 16 NB) of gemm_dpbf16's product for RB rows: RB x NB accumulators, one chain over
// k each, as gemm_dpbf16 sums them.
template <int RB, int NB>
inline void dpbf16_tile(const uint16_t* A, int lda, const uint16_t* B, int K, int N, int n, float* out, int ldo,
                        bool accumulate) {
  __m512 acc[RB][NB];
  for (int r = 0; r < RB; ++r)
    for (int j = 0; j < NB; ++j)
      acc[r][j] = accumulate ? _mm512_loadu_ps(out + static_cast<size_t>(r) * ldo + n + 16 * j) : _mm512_setzero_ps();
  const uint16_t* bp = B + 2 * n;
  for (int kp = 0; kp < K / 2; ++kp, bp += 2 * N) {
    __m512bh b[NB];
    for (int j = 0; j < NB; ++j) b[j] = (__m512bh)_mm512_loadu_si512(bp + 32 * j);
    for (int r = 0; r < RB; ++r) {
      int32_t pair;
      __builtin_memcpy(&pair, A + static_cast<size_t>(r) * lda + 2 * kp, 4);
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], a, b[j]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int j = 0; j < NB; ++j) _mm512_storeu_ps(out + static_cast<size_t>(r) * ldo + n + 16 * j, acc[r][j]);
}

// gemm_dpbf16's product for exactly R = RB rows, 1 to 3 (a sequence's query heads in a GQA group
// of up to 3): no padding rows, and columns wide enough that the chains of dot products keep the
// units busy. Each output is the same chain as gemm_dpbf16's, so the bits are its bits.
template <int RB>
inline void gemm_dpbf16_rows(const uint16_t* A, int lda, const uint16_t* B, int K, int N, float* out, int ldo, int R,
                             bool accumulate) {
  static_assert(RB >= 1 && RB <= 3, "one to three rows");
  (void)R;
  constexpr int NB = RB == 3 ? 4 : 8;  // RB NB accumulators, NB vectors of B
  int n = 0;
  for (; n + 16 * NB <= N; n += 16 * NB) dpbf16_tile<RB, NB>(A, lda, B, K, N, n, out, ldo, accumulate);
  for (; n + 64 <= N; n += 64) dpbf16_tile<RB, 4>(A, lda, B, K, N, n, out, ldo, accumulate);
  for (; n + 32 <= N; n += 32) dpbf16_tile<RB, 2>(A, lda, B, K, N, n, out, ldo, accumulate);
  for (; n < N; n += 16) dpbf16_tile<RB, 1>(A, lda, B, K, N, n, out, ldo, accumulate);
}

// exp for softmax in fp32: 2^(x log2 e) as 2^n * p(f), p a degree-5 polynomial on [0, 1)
// (relative error ~1e-7, far below bf16's rounding of P); inputs are <= 0 here.
inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-100.f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.8762336e-3f);  // least-squares fit of 2^f, relative weights
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(8.9925891e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5823594e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4015453e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9315296e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.9999994e-1f));
  return _mm512_scalef_ps(p, n);
}

// 2^t for softmax probabilities that are rounded to bf16 next: 2^n * p(f) with n = round(t),
// f in [-1/2, 1/2] and p a degree-3 fit (relative error < 1e-4, a twentieth of bf16's rounding),
// three FMAs fewer than exp512. t must not be NaN or -inf (-1e30 gives 0).
inline __m512 exp2_bf16(__m512 t) {
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(5.5170398e-2f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4260826e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9326097e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.9992836e-1f));
  return _mm512_scalef_ps(p, n);
}

// Mask of the lanes of the 16-lane vector at j that lie below n.
inline __mmask16 valid_lanes(int j, int n) {
  return j >= n ? 0 : n - j >= 16 ? 0xffff : static_cast<__mmask16>((1u << (n - j)) - 1);
}

#endif  // CHUNKGEN_HAVE_AVX512_BF16

#if defined(CHUNKGEN_HAVE_AMX)

// Every tile 16 rows x 64 bytes: A is 16 x 32 bf16, B 16 pair-rows x 16 columns, C 16 x 16 fp32.
struct alignas(64) TileConfig {
  uint8_t palette_id = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  TileConfig() {
    for (int t = 0; t < 8; ++t) colsb[t] = 64, rows[t] = 16;
  }
};

// NB accumulators (tiles 0..NB-1), A in tile 4, B in tiles 5..7 in turn: columns [n, n + 16 NB).
template <int NB>
inline void amx_block(const uint16_t* A, int lda, const uint16_t* B, int K, int N, int n, float* out, int ldo,
                      bool accumulate) {
  if (accumulate) {
    _tile_loadd(0, out + n, ldo * 4);
    if constexpr (NB > 1) _tile_loadd(1, out + n + 16, ldo * 4);
    if constexpr (NB > 2) _tile_loadd(2, out + n + 32, ldo * 4);
    if constexpr (NB > 3) _tile_loadd(3, out + n + 48, ldo * 4);
  } else {
    _tile_zero(0);
    if constexpr (NB > 1) _tile_zero(1);
    if constexpr (NB > 2) _tile_zero(2);
    if constexpr (NB > 3) _tile_zero(3);
  }
  const int bstride = 4 * N;  // bytes per pair-row of B
  for (int k = 0; k < K; k += 32) {
    _tile_loadd(4, A + k, lda * 2);
    const uint16_t* bk = B + static_cast<size_t>(k / 2) * 2 * N + 2 * n;
    _tile_loadd(5, bk, bstride);
    _tile_dpbf16ps(0, 4, 5);
    if constexpr (NB > 1) {
      _tile_loadd(6, bk + 32, bstride);
      _tile_dpbf16ps(1, 4, 6);
    }
    if constexpr (NB > 2) {
      _tile_loadd(7, bk + 64, bstride);
      _tile_dpbf16ps(2, 4, 7);
    }
    if constexpr (NB > 3) {
      _tile_loadd(5, bk + 96, bstride);
      _tile_dpbf16ps(3, 4, 5);
    }
  }
  _tile_stored(0, out + n, ldo * 4);
  if constexpr (NB > 1) _tile_stored(1, out + n + 16, ldo * 4);
  if constexpr (NB > 2) _tile_stored(2, out + n + 32, ldo * 4);
  if constexpr (NB > 3) _tile_stored(3, out + n + 48, ldo * 4);
}

// Same contract as gemm_dpbf16; the calling thread must have loaded TileConfig.
inline void gemm_amx(const uint16_t* A, int lda, const uint16_t* B, int K, int N, float* out, int ldo, int R,
                     bool accumulate) {
  for (int r = 0; r < R; r += 16) {
    const uint16_t* a = A + static_cast<size_t>(r) * lda;
    float* o = out + static_cast<size_t>(r) * ldo;
    int n = 0;
    for (; n + 64 <= N; n += 64) amx_block<4>(a, lda, B, K, N, n, o, ldo, accumulate);
    switch ((N - n) / 16) {
      case 3:
        amx_block<3>(a, lda, B, K, N, n, o, ldo, accumulate);
        break;
      case 2:
        amx_block<2>(a, lda, B, K, N, n, o, ldo, accumulate);
        break;
      case 1:
        amx_block<1>(a, lda, B, K, N, n, o, ldo, accumulate);
        break;
      default:
        break;
    }
  }
}

#endif  // CHUNKGEN_HAVE_AMX

#if defined(CHUNKGEN_HAVE_AVX512_BF16)

// A product of gemm_dpbf16's contract.
using Gemm = void (*)(const uint16_t*, int, const uint16_t*, int, int, float*, int, int, bool);

// AMX's tiles where the path is AMX (and the build has them), else AVX512_BF16's dot products.
inline Gemm gemm_for(bool amx) {
#if defined(CHUNKGEN_HAVE_AMX)
  if (amx) return gemm_amx;
#endif
  (void)amx;
  return gemm_dpbf16<>;
}

#endif  // CHUNKGEN_HAVE_AVX512_BF16

}  // namespace bf16
}  // namespace chunkgen
