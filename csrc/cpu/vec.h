// SIMD primitives of the CPU decode kernel, one source for every x86 width: GCC vector extensions
// of W floats, W chosen by the build target (-march): 16 with AVX-512, 8 with AVX/AVX2, 4 below.
// Broadcasts, reductions and the exponential use the widest intrinsics the target has.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "intrinsics.h"

namespace chunkgen {
namespace decode {

#if defined(__AVX512F__)
constexpr int W = 16;
#elif defined(__AVX__)
constexpr int W = 8;
#else
constexpr int W = 4;
#endif

typedef float vf __attribute__((vector_size(W * 4)));
typedef int32_t vi __attribute__((vector_size(W * 4)));
typedef uint16_t vh __attribute__((vector_size(W * 2)));
typedef uint32_t vu __attribute__((vector_size(W * 4)));

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Query rows per register block: RB rows x 2 vectors of accumulators must fit the register file
// (16 vector registers below AVX-512, 32 with it).
constexpr int kRB = W == 16 ? 8 : 6;
constexpr int kRowBlock = 32;  // rows of a chunk-first matrix kept hot together

// A plain broadcast: `vf{} + x` would add 0.0f first (not a no-op under IEEE signed zeros) and
// put a scalar add on the inner loops' critical path; a lane loop becomes a chain of inserts.
#if defined(__AVX512F__)
inline vf splat(float x) { return (vf)_mm512_set1_ps(x); }
#elif defined(__AVX__)
inline vf splat(float x) { return (vf)_mm256_set1_ps(x); }
#elif defined(__SSE__)
inline vf splat(float x) { return (vf)_mm_set1_ps(x); }
#else
inline vf splat(float x) { return vf{} + x; }
#endif
inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline vf load(const uint16_t* p) {  // bf16 -> fp32 is a 16-bit shift
  vh h;
  std::memcpy(&h, p, sizeof h);
  vu u = __builtin_convertvector(h, vu) << 16;
  return (vf)u;
}
inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
// v at p (aligned to W floats) by a streaming store, past the cache (output_lines.h).
inline void stream(float* p, vf v) {
#if defined(__AVX512F__)
  _mm512_stream_ps(p, (__m512)v);
#elif defined(__AVX__)
  _mm256_stream_ps(p, (__m256)v);
#elif defined(__SSE__)
  _mm_stream_ps(p, (__m128)v);
#else
  store(p, v);
#endif
}
// fp32 -> bf16 rounded to nearest even, NaN kept a quiet NaN: torch's rounding, in integer lanes
// (U: uint32 lanes as many as V's floats; the quantized products use it at 8 and 16 lanes too).
template <typename U, typename V>
inline U bf16_bits_of(V v) {
  const U u = (U)v;
  const U rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return (u & 0x7FFFFFFFu) > 0x7F800000u ? U{} + 0x7FC0u : rounded;
}
inline vu bf16_bits(vf v) { return bf16_bits_of<vu>(v); }
inline void store(uint16_t* p, vf v) {
  const vh h = __builtin_convertvector(bf16_bits(v), vh);
  std::memcpy(p, &h, sizeof h);
}
// The fp32 value of v stored as bf16 and loaded back, without the trip through memory.
inline vf round_bf16(vf v) { return (vf)(bf16_bits(v) << 16); }
// a * b + c rounded once, where a bitwise match with a scalar std::fma is owed (the compiler's
// contraction of a * b + c is allowed, not promised).
inline vf vfma(vf a, vf b, vf c) {
#if defined(__AVX512F__)
  return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
  return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  vf r;
  for (int i = 0; i < W; ++i) r[i] = std::fma(a[i], b[i], c[i]);
  return r;
#endif
}
inline vf vmax(vf a, vf b) { return a > b ? a : b; }
inline vf vmin(vf a, vf b) { return a < b ? a : b; }
#if defined(__AVX512F__)
inline float hsum(vf v) { return _mm512_reduce_add_ps((__m512)v); }
inline float hmax(vf v) { return _mm512_reduce_max_ps((__m512)v); }
#elif defined(__AVX__)
// Halves folded in registers: a lane-by-lane loop becomes a serial chain of extracts.
inline float hsum(vf v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}
inline float hmax(vf v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}
#else
inline float hsum(vf v) {
  float s = 0.f;
  for (int i = 0; i < W; ++i) s += v[i];
  return s;
}
inline float hmax(vf v) {
  float m = v[0];
  for (int i = 1; i < W; ++i) m = std::max(m, v[i]);
  return m;
}
#endif
// Lanes [0, left) of a vector: token masks for a chunk's last, partly filled vector (no scalar
// stores into a buffer that is then read as a vector: that stalls store forwarding).
inline vi lanes_below(int left) {
  vi iota;
  for (int i = 0; i < W; ++i) iota[i] = i;
  return iota < (vi{} + left);
}

// exp on a vector (Cephes polynomial, ~1 ulp in the range softmax uses); scalar expf per score
// would cost as much as the matrix products themselves.
__attribute__((always_inline)) inline vf vexp(vf x) {
  x = vmax(vmin(x, splat(88.3762626647949f)), splat(-87.3365447504f));
  vf fx = x * 1.44269504088896341f + 0.5f;
  vi ti = __builtin_convertvector(fx, vi);
  vf tf = __builtin_convertvector(ti, vf);
  tf = tf + __builtin_convertvector((vi)(tf > fx), vf);  // floor: subtract 1 where trunc rounded up
  x = x - tf * 0.693359375f + tf * 2.12194440e-4f;
  vf z = x * x;
  vf y = splat(1.9875691500E-4f);
  y = y * x + 1.3981999507E-3f;
  y = y * x + 8.3334519073E-3f;
  y = y * x + 4.1665795894E-2f;
  y = y * x + 1.6666665459E-1f;
  y = y * x + 5.0000001201E-1f;
  y = y * z + x + 1.0f;
  vi n = (__builtin_convertvector(tf, vi) + 127) << 23;
  return y * (vf)n;
}

// 2^t for t <= 0: softmax's exponent once the row's maximum is taken out (0 below -127, and for
// -inf). Adding 1.5 * 2^23 rounds t to an integer n held in the low mantissa bits, so 2^n is an
// integer add and a shift away; 2^(t - n) is a degree-5 fit on [-0.5, 0.5] (relative error under
// 2e-7). About half the instructions of vexp, which softmax pays once per score.
__attribute__((always_inline)) inline vf vexp2_nonpos(vf t) {
  const vf magic = splat(12582912.f);
  t = vmax(t, splat(-127.f));
  const vf r = t + magic;
  const vf f = t - (r - magic);
  vf p = splat(1.326472731307149e-3f);
  p = p * f + 9.671512991189957e-3f;
  p = p * f + 5.550733581185341e-2f;
  p = p * f + 2.4022242426872253e-1f;
  p = p * f + 6.931470036506653e-1f;
  p = p * f + 1.f;
  const vi n = (vi)r - (vi)magic;
  return p * (vf)((n + 127) << 23);
}

// cap * tanh(x / cap) (Gemma 2's logit soft-capping), tanh(y) = 1 - 2 / (e^2y + 1): its absolute
// error (~1e-7, times cap) is far below the scores' own rounding.
inline vf soft_cap(vf x, float cap) {
  const vf e = vexp(x * (2.f / cap));
  return (1.f - 2.f / (e + 1.f)) * cap;
}

}  // namespace decode
}  // namespace chunkgen
