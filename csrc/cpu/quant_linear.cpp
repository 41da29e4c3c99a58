// Linear layers on quantized weights as GGUF files ship them (chunkgen/model/quant.py repacks each
// type once at load into one of the layouts below; nothing is expanded to floats): y = x W^T with
// x quantized per row into int8 blocks of 32 (one fp32 scale each, as llama.cpp's Q8_0), the
// products of a block in int8 and its scales applied once per block.
//
// A weight row is K / 32 blocks of 32 values, each block
//   kind 0 (U4):  16 bytes, value j in the low nibble of byte j, value j + 16 in its high nibble,
//                 unsigned 0..15; w = scale * q + min (Q4_0, Q4_1, Q4_K)
//   kind 1 (S8):  32 signed bytes; w = scale * q (+ min where mins are given: Q5_K; Q8_0, int8)
//   kind 2 (S8H): 32 signed bytes, one scale per half of 16; w = scale[half] * q (Q6_K)
// with scales [n, K / 32] (kind 2: [n, K / 16]) and mins [n, K / 32] in fp32. A block's sum is
//   scale_w * scale_x * sum(q_w q_x) + min_w * scale_x * sum(q_x),
// so a min costs one scalar product per block with the activation block's sum.
//
// Paths: AVX2 (vpmaddubsw unsigned x signed bytes to pairs of int16, vpmaddwd to int32), and a
// portable scalar one, the reference (CHUNKGEN_QUANT_ISA=scalar selects it at run time). Both
// quantize x identically (round to nearest even); they differ only in the order of fp32 sums.
// No AVX512_VNNI / AVX-VNNI path yet.
#include <omp.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>

#if defined(__AVX2__)
#include "intrinsics.h"
#endif

namespace chunkgen {
namespace {

constexpr int kBlock = 32;
enum Kind : int64_t { kU4 = 0, kS8 = 1, kS8Half = 2 };

bool use_avx2() {
#if defined(__AVX2__)
  const char* env = std::getenv("CHUNKGEN_QUANT_ISA");
  return env == nullptr || std::string(env) != "scalar";
#else
  return false;
#endif
}

// One row of x (k floats) -> k int8 and k / 32 scales, and each block's scale * sum(q).
void quantize_row_scalar(const float* x, int64_t k, int8_t* q, float* scale, float* qsum) {
  for (int64_t b = 0; b < k / kBlock; ++b) {
    const float* xb = x + b * kBlock;
    float amax = 0.f;
    for (int j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
    int sum = 0;
    for (int j = 0; j < kBlock; ++j) {
      const int v = static_cast<int>(std::nearbyint(xb[j] * inv));
      q[b * kBlock + j] = static_cast<int8_t>(v);
      sum += v;
    }
    scale[b] = d;
    qsum[b] = d * static_cast<float>(sum);
  }
}

#if defined(__AVX2__)
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline int hsum_i32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

void quantize_row_avx2(const float* x, int64_t k, int8_t* q, float* scale, float* qsum) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int64_t b = 0; b < k / kBlock; ++b) {
    const float* xb = x + b * kBlock;
    __m256 v[4];
    __m256 m = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(xb + 8 * i);
      m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    const float amax = _mm_cvtss_f32(h);
    const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
    const __m256 vinv = _mm256_set1_ps(inv);
    // round to nearest even (the MXCSR default), as std::nearbyint in the scalar path
    __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v[0], vinv));
    __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v[1], vinv));
    __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v[2], vinv));
    __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v[3], vinv));
    const __m256i s = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
    // packs interleave the 128-bit lanes; the permute puts the 32 values back in order
    i0 = _mm256_packs_epi32(i0, i1);
    i2 = _mm256_packs_epi32(i2, i3);
    i0 = _mm256_packs_epi16(i0, i2);
    i0 = _mm256_permutevar8x32_epi32(i0, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * kBlock), i0);
    scale[b] = d;
    qsum[b] = d * static_cast<float>(hsum_i32(s));
  }
}

// 32 weight values of a block as bytes for vpmaddubsw, and x's block signed to match: U4 gives
// unsigned nibbles and x as it is; S8 gives |w| and x with w's sign (llama.cpp's trick).
template <int kind>
inline __m256i block_products(const uint8_t* wb, __m256i xq) {
  if constexpr (kind == kU4) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wb));
    const __m256i w = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0f));
    return _mm256_maddubs_epi16(w, xq);
  } else {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb));
    return _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xq, w));
  }
}

// Rows of W a tile computes against each row of x: x's block is loaded once for all of them.
constexpr int kTile = 4;

template <int kind, bool has_min, int R>
void dot_tile_avx2(const uint8_t* w, int64_t w_row_bytes, const float* ws, int64_t ws_row, const float* wm, int64_t nb,
                   const int8_t* xq, const float* xs, const float* xsum, float* y) {
  constexpr int block_bytes = kind == kU4 ? 16 : 32;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  float macc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps(), macc[r] = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * kBlock));
    const float sx = xs[b];
    for (int r = 0; r < R; ++r) {
      const __m256i p = _mm256_madd_epi16(block_products<kind>(w + r * w_row_bytes + b * block_bytes, xv), ones);
      __m256 s;
      if constexpr (kind == kS8Half) {
        // lanes 0-3 hold values 0-15 of the block, lanes 4-7 values 16-31
        const float* sc = ws + r * ws_row + 2 * b;
        s = _mm256_set_m128(_mm_set1_ps(sc[1] * sx), _mm_set1_ps(sc[0] * sx));
      } else {
        s = _mm256_set1_ps(ws[r * ws_row + b] * sx);
      }
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), s, acc[r]);
      if constexpr (has_min) macc[r] += wm[r * nb + b] * xsum[b];
    }
  }
  for (int r = 0; r < R; ++r) y[r] = hsum(acc[r]) + macc[r];
}
#endif

template <int kind, bool has_min>
float dot_scalar(const uint8_t* w, const float* ws, const float* wm, int64_t nb, const int8_t* xq, const float* xs,
                 const float* xsum) {
  float sum = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    const int8_t* xb = xq + b * kBlock;
    if constexpr (kind == kU4) {
      const uint8_t* wb = w + b * 16;
      int s = 0;
      for (int j = 0; j < 16; ++j) s += (wb[j] & 0x0f) * xb[j] + (wb[j] >> 4) * xb[j + 16];
      sum += ws[b] * xs[b] * static_cast<float>(s);
    } else {
      const int8_t* wb = reinterpret_cast<const int8_t*>(w) + b * kBlock;
      int s0 = 0, s1 = 0;
      for (int j = 0; j < 16; ++j) s0 += wb[j] * xb[j], s1 += wb[j + 16] * xb[j + 16];
      if constexpr (kind == kS8Half)
        sum += (ws[2 * b] * static_cast<float>(s0) + ws[2 * b + 1] * static_cast<float>(s1)) * xs[b];
      else
        sum += ws[b] * xs[b] * static_cast<float>(s0 + s1);
    }
    if constexpr (has_min) sum += wm[b] * xsum[b];
  }
  return sum;
}

struct QuantArgs {
  const uint8_t* w;
  int64_t w_row_bytes;
  const float* ws;
  int64_t ws_row;
  const float* wm;  // nullptr: no mins
  int64_t n, nb;
  const int8_t* xq;
  const float *xs, *xsum;
  int64_t rows;
  float* y;
};

template <int kind, bool has_min>
void quant_product(const QuantArgs& a, bool avx2) {
  const int64_t tiles = (a.n + kTile - 1) / kTile;
  // Tiles of W rows split evenly: each thread streams its run of W once, for all rows of x.
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * kTile, nr = std::min<int64_t>(kTile, a.n - n0);
      const uint8_t* w = a.w + n0 * a.w_row_bytes;
      const float* ws = a.ws + n0 * a.ws_row;
      const float* wm = has_min ? a.wm + n0 * a.nb : nullptr;
      for (int64_t m = 0; m < a.rows; ++m) {
        const int8_t* xq = a.xq + m * a.nb * kBlock;
        const float* xs = a.xs + m * a.nb;
        const float* xsum = a.xsum + m * a.nb;
        float out[kTile];
#if defined(__AVX2__)
        if (avx2) {
          if (nr == kTile)
            dot_tile_avx2<kind, has_min, kTile>(w, a.w_row_bytes, ws, a.ws_row, wm, a.nb, xq, xs, xsum, out);
          else
            for (int64_t r = 0; r < nr; ++r)
              dot_tile_avx2<kind, has_min, 1>(w + r * a.w_row_bytes, a.w_row_bytes, ws + r * a.ws_row, a.ws_row,
                                              has_min ? wm + r * a.nb : nullptr, a.nb, xq, xs, xsum, out + r);
        } else
#endif
        {
          for (int64_t r = 0; r < nr; ++r)
            out[r] = dot_scalar<kind, has_min>(w + r * a.w_row_bytes, ws + r * a.ws_row,
                                               has_min ? wm + r * a.nb : nullptr, a.nb, xq, xs, xsum);
        }
        std::memcpy(a.y + m * a.n + n0, out, sizeof(float) * nr);
      }
    }
  });
}

void quantize_rows(const float* x, int64_t rows, int64_t k, int8_t* q, float* scale, float* qsum, bool avx2) {
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t nb = k / kBlock;
#if defined(__AVX2__)
      if (avx2) {
        quantize_row_avx2(x + r * k, k, q + r * k, scale + r * nb, qsum + r * nb);
        continue;
      }
#endif
      quantize_row_scalar(x + r * k, k, q + r * k, scale + r * nb, qsum + r * nb);
    }
  });
}

torch::Tensor as_rows(const torch::Tensor& x) {
  TORCH_CHECK_VALUE(x.device().is_cpu() && x.dim() == 2, "x must be a 2-D CPU tensor, got ", x.sizes());
  TORCH_CHECK_VALUE(x.size(1) % kBlock == 0, "x's columns (", x.size(1), ") must be a multiple of 32");
  return x.to(torch::kFloat32).contiguous();
}

// (q int8 [rows, k], scale [rows, k / 32], scale * sum(q) [rows, k / 32]) of x [rows, k].
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> quantize_rows_op(const torch::Tensor& x_in) {
  const auto x = as_rows(x_in);
  const int64_t rows = x.size(0), k = x.size(1);
  auto q = torch::empty({rows, k}, x.options().dtype(torch::kInt8));
  auto scale = torch::empty({rows, k / kBlock}, x.options());
  auto qsum = torch::empty({rows, k / kBlock}, x.options());
  quantize_rows(x.data_ptr<float>(), rows, k, q.data_ptr<int8_t>(), scale.data_ptr<float>(), qsum.data_ptr<float>(),
                use_avx2());
  return {q, scale, qsum};
}

// x [rows, k] (float32 or bfloat16) times W^T, W [n, k] given as qs (bytes, [n, k / 2] for kind
// 0, [n, k] else), scales and optional mins (see the top of this file) -> [rows, n] in x's dtype.
torch::Tensor quant_linear_op(const torch::Tensor& x_in, const torch::Tensor& qs, const torch::Tensor& scales,
                              const std::optional<torch::Tensor>& mins, int64_t kind, int64_t n) {
  const auto x = as_rows(x_in);
  const int64_t rows = x.size(0), k = x.size(1), nb = k / kBlock;
  TORCH_CHECK_VALUE(kind == kU4 || kind == kS8 || kind == kS8Half, "unknown quantized layout ", kind);
  const int64_t row_bytes = kind == kU4 ? k / 2 : k, ws_row = kind == kS8Half ? 2 * nb : nb;
  TORCH_CHECK_VALUE(qs.is_contiguous() && qs.element_size() == 1 && qs.numel() == n * row_bytes, "qs must hold ", n,
                    " x ", row_bytes, " contiguous bytes");
  TORCH_CHECK_VALUE(scales.is_contiguous() && scales.scalar_type() == torch::kFloat32 && scales.numel() == n * ws_row,
                    "scales must be ", n, " x ", ws_row, " contiguous float32");
  const bool has_min = mins.has_value() && mins->defined();
  if (has_min)
    TORCH_CHECK_VALUE(mins->is_contiguous() && mins->scalar_type() == torch::kFloat32 && mins->numel() == n * nb,
                      "mins must be ", n, " x ", nb, " contiguous float32");
  TORCH_CHECK_VALUE(!(kind == kS8Half && has_min), "layout 2 has no mins");
  const bool avx2 = use_avx2();
  auto q = torch::empty({rows, k}, x.options().dtype(torch::kInt8));
  auto xs = torch::empty({rows, nb}, x.options());
  auto xsum = torch::empty({rows, nb}, x.options());
  quantize_rows(x.data_ptr<float>(), rows, k, q.data_ptr<int8_t>(), xs.data_ptr<float>(), xsum.data_ptr<float>(), avx2);
  auto y = torch::empty({rows, n}, x.options());
  const QuantArgs a{static_cast<const uint8_t*>(qs.data_ptr()),
                    row_bytes,
                    scales.data_ptr<float>(),
                    ws_row,
                    has_min ? mins->data_ptr<float>() : nullptr,
                    n,
                    nb,
                    q.data_ptr<int8_t>(),
                    xs.data_ptr<float>(),
                    xsum.data_ptr<float>(),
                    rows,
                    y.data_ptr<float>()};
  if (kind == kU4)
    quant_product<kU4, true>(a, avx2);
  else if (kind == kS8 && has_min)
    quant_product<kS8, true>(a, avx2);
  else if (kind == kS8)
    quant_product<kS8, false>(a, avx2);
  else
    quant_product<kS8Half, false>(a, avx2);
  return x_in.scalar_type() == torch::kFloat32 ? y : y.to(x_in.scalar_type());
}

std::string quant_isa_op() { return use_avx2() ? "avx2" : "scalar"; }

}  // namespace
}  // namespace chunkgen

TORCH_LIBRARY_FRAGMENT(chunkgen, m) {
  m.def("quantize_rows(Tensor x) -> (Tensor, Tensor, Tensor)");
  m.def("quant_linear(Tensor x, Tensor qs, Tensor scales, Tensor? mins, int kind, int n) -> Tensor");
  m.def("quant_isa() -> str", &chunkgen::quant_isa_op);
}

TORCH_LIBRARY_IMPL(chunkgen, CPU, m) {
  m.impl("quantize_rows", &chunkgen::quantize_rows_op);
  m.impl("quant_linear", &chunkgen::quant_linear_op);
}
