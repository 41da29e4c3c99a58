// Linear layers on quantized weights as GGUF files ship them (chunkgen/model/quant.py repacks each
// type once at load into the interleaved layout below; nothing is expanded to floats): y = x W^T
// with x quantized per row into int8 blocks of 32 (one fp32 scale each, as llama.cpp's Q8_0), the
// products of a block pair summed in integers and its scales applied once per block pair.
//
// Packed layout (llama.cpp's repack.cpp idea: the lanes of a vector are output channels, so no
// horizontal sums and one weight load serves several rows of x). W's rows go in groups of 8
// (the last group padded with zero rows); a group's block b (32 values along k of its 8 rows) is
//   U4 (kind 0): 4 chunks of 32 bytes; byte 4 r + t of chunk c holds row r's value 4 c + t in its
//                low nibble and value 16 + 4 c + t in its high nibble, unsigned 0..15 (Q4_0, Q4_1,
//                Q4_K);  w = scale * q + min
//   U5 (kind 3): U4's 4 chunks of nibbles, then 32 bytes of fifth bits: bit v of byte 4 r + t is
//                the fifth bit of the value in byte 4 r + t of nibble vector v = 2 c + h (chunk
//                c's low nibbles for h = 0, high for h = 1); values 0..31 (Q5_K)
//   S8 (kind 1), S8H (kind 2): 8 steps of 32 signed bytes; byte 4 r + t of step s is row r's value
//                4 s + t. S8: any int8 (Q8_0, int8); S8H: -32..31 with one scale per half of 16
//                values (Q6_K)
// Each 32 bytes above is a unit. S8 and S8H put their groups in pairs (the last padded with a zero
// group) whose blocks interleave their units, g's then g + 1's; U4 and U5 keep each group's blocks
// whole (quant_layout.h: paired, unit_stride, block_stride).
// scales [groups, k / 32, halves, 8] and mins [groups, k / 32, 8] in fp32, the 8 rows' values
// side by side; for the K-types in the factored form instead (quant_layout.h: int8 sub-block
// values under an fp16 per super-block of 256, as the file has them). A block pair's sum is
//   scale_w * scale_x * sum(q_w q_x) + min_w * scale_x * sum(q_x),
// the min's term one FMA per block with the x block's scale * sum(q).
//
// AVX2: vpmaddubsw multiplies unsigned by signed bytes into pairs of int16 (a weight vector of 8
// rows x 4 values against 4 values of x broadcast), signed weights through llama.cpp's sign trick
// (|w| and x with w's sign). Where the weights are small the int16 pairs of a whole block (or half)
// are summed before the one vpmaddwd to int32 that turns them into the block's sum: |pair| <=
// 2 * 15 * 127 for U4 (8 summed <= 30480), 2 * 31 * 127 for U5 (4 summed <= 31496), 2 * 32 * 127
// for S8H (4 summed, a half); S8 (up to 2 * 128 * 127) converts each step. Each block's int32
// sums are converted once and FMAed with scale_w * scale_x. A tile is 8 output channels x up to 4
// rows of x, or for the signed kinds at 1-2 rows both groups of a pair (16 channels: each 64-byte
// line of their interleaved units read by one tile; Q8_0 and int8 1.2-1.4x, Q6_K 1.1x at one row
// on the AVX2 build). Threads split the groups in pairs, and each walks its pairs in panels that
// stay in cache while every tile of x rows passes over them.
//
// AVX512_VNNI (quant_tile_vnni.h): vpdpbusd on two groups at once (16 channels), the unsigned kinds
// on two such pairs (32 channels) x up to 6 (U5: 5) rows, the signed ones on one x up to 8 rows.
// AVX-VNNI (the same instruction on 256-bit vectors: Intel's client cores, which have no AVX-512;
// Zen 5 has both): the AVX2 tile with each step's vpmaddubsw + vpaddw (+ vpmaddwd) one vpdpbusd,
// summed in int32; signed weights keep the sign trick, so x stays as it is.
//
// The portable scalar path computes the same integer block sums from the same layout; the paths
// differ only in fp32 rounding (FMA vs multiply and add, and where the scales are applied).
// AMX int8 (quant_tile_amx.h): 16 rows x 16 channels a tile instruction, for the tiles of 16 rows
// of products with at least kAmxMinRows rows (16 or 64 by kind), the rest of the rows on the VNNI
// tile; both give a row the same bits. CHUNKGEN_QUANT_ISA=avx512_vnni|avx_vnni|avx2|scalar lowers the path at run time
// (a test runs every path the machine has); amx_emulated runs the AMX path's logic with its tile
// instructions done in C++, on any AVX512_VNNI CPU (tests).
#include <omp.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "aligned.h"
#if defined(__AVX2__)
#include "intrinsics.h"
#endif
#include "isa.h"
#include "output_lines.h"
#include "quant_layout.h"
#include "quant_out.h"
#include "quant_tile_amx.h"
#include "quant_tile_vnni.h"
#if defined(__AVXVNNI__)
#define CHUNKGEN_HAVE_AVX_VNNI 1
#endif

namespace chunkgen {
namespace {

constexpr int kBlock = 32;
using quant::BlockScales;
using quant::kGroup;
using quant::kSuper;
using quant::Out;
constexpr int kRows = 4;  // rows of x a tile computes against one group
using quant::group_block_bytes;
using quant::halves;
using quant::is_unsigned;
using quant::kS8;
using quant::kS8Half;
using quant::kU4;
using quant::kU5;

// The kernel's paths, lowest first; the build has those up to best_path(). AmxEmulated stands
// apart: asked for by name, on a build with the VNNI tile.
enum class Path { Scalar, Avx2, AvxVnni, Avx512Vnni, Amx, AmxEmulated };

Path best_path() {
#if defined(CHUNKGEN_HAVE_AMX_INT8)
  if (amx_int8_granted()) return Path::Amx;
#endif
#if defined(CHUNKGEN_HAVE_AVX512_VNNI)
  return Path::Avx512Vnni;
#elif defined(CHUNKGEN_HAVE_AVX_VNNI)
  return Path::AvxVnni;
#elif defined(__AVX2__)
  return Path::Avx2;
#else
  return Path::Scalar;
#endif
}

const char* path_name(Path p) {
  switch (p) {
    case Path::AmxEmulated:
      return "amx_emulated";
    case Path::Amx:
      return "amx";
    case Path::Avx512Vnni:
      return "avx512_vnni";
    case Path::AvxVnni:
      return "avx_vnni";
    case Path::Avx2:
      return "avx2";
    default:
      return "scalar";
  }
}

// best_path(), lowered by CHUNKGEN_QUANT_ISA (read on every call, so tests switch paths in one process).
Path current_path() {
  const Path best = best_path();
  const char* env = std::getenv("CHUNKGEN_QUANT_ISA");
  if (env == nullptr || *env == '\0') return best;
  const std::string want(env);
#if defined(CHUNKGEN_HAVE_AVX512_VNNI)
  if (want == path_name(Path::AmxEmulated)) return Path::AmxEmulated;
#endif
  for (Path p : {Path::Scalar, Path::Avx2, Path::AvxVnni, Path::Avx512Vnni, Path::Amx, Path::AmxEmulated})
    if (want == path_name(p)) {
#if !defined(CHUNKGEN_HAVE_AVX_VNNI)
      if (p == Path::AvxVnni) return std::min(Path::Avx2, best);  // this build has no AVX-VNNI tile
#endif
      return std::min(p, best);
    }
  throw std::invalid_argument("CHUNKGEN_QUANT_ISA=" + want +
                              " is not one of amx, avx512_vnni, avx_vnni, avx2, scalar, amx_emulated");
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

// The G groups of 8 channels a 256-bit tile computes, side by side in y. G = 2 takes both groups of
// a pair: each broadcast of x serves two weight vectors, and where the signed kinds interleave a
// pair's units (quant_layout.h), every 64-byte line of weights is read by one tile, not half by each
// of two.
template <int G>
struct Groups {
  const uint8_t* w[G];
  BlockScales ws[G], wm[G];
};

#if defined(__AVX2__)
inline int hsum_i32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

// 8 values of x as fp32, from x's own dtype (bf16 and fp16 widen exactly).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
}
inline __m256 load8(const at::Half* p) {
#if defined(__F16C__)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  alignas(32) float f[8];
  for (int i = 0; i < 8; ++i) f[i] = static_cast<float>(p[i]);
  return _mm256_load_ps(f);
#endif
}

// One row of x -> int8 blocks, as quantize_row_scalar (the same bits), read in x's dtype; offset:
// stored as x + 128 (quantize_rows).
template <typename T>
void quantize_row_avx2(const T* x, int64_t k, int8_t* q, float* scale, float* qsum, bool offset) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256i flip = _mm256_set1_epi8(offset ? static_cast<char>(0x80) : 0);
  for (int64_t b = 0; b < k / kBlock; ++b) {
    const T* xb = x + b * kBlock;
    __m256 v[4];
    __m256 m = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = load8(xb + 8 * i);
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
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * kBlock), _mm256_xor_si256(i0, flip));
    scale[b] = d;
    qsum[b] = d * static_cast<float>(hsum_i32(s));
  }
}

// 4 values of x (one int32) in every lane: each lane's 4 bytes meet one row's 4 weight values.
inline __m256i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// Makes v opaque to the compiler: the sums of a tile are associative integer adds, which GCC
// otherwise regroups into trees that keep every product live at once and spill the tile.
inline __m256i in_order(__m256i v) {
  __asm__("" : "+x"(v));
  return v;
}

// U5's fifth bits of nibble vector v: bit v of each byte of the plane moved to bit 4 (16-bit shifts
// carry bits across a byte boundary, but never onto bit 4 for a shift of at most 4, and the mask
// keeps bit 4 only).
inline __m256i fifth_bits(__m256i plane, int v) {
  const __m256i moved = v <= 4 ? _mm256_slli_epi16(plane, 4 - v) : _mm256_srli_epi16(plane, v - 4);
  return _mm256_and_si256(moved, _mm256_set1_epi8(16));
}

// Chunk c of an unsigned block (U4, U5): its low and high nibbles' values, 8 rows x 4 each.
template <int kind>
inline void unsigned_chunk(const uint8_t* wb, int c, __m256i& lo, __m256i& hi) {
  const __m256i mask = _mm256_set1_epi8(0x0f);
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + quant::unit_stride(kind) * c));
  lo = _mm256_and_si256(raw, mask);
  hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
  if constexpr (kind == kU5) {
    const __m256i plane = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + quant::unit_stride(kind) * 4));
    lo = _mm256_or_si256(lo, fifth_bits(plane, 2 * c));
    hi = _mm256_or_si256(hi, fifth_bits(plane, 2 * c + 1));
  }
}

// Step s of a signed block (S8, S8H) of each of G groups: its weight vector (8 rows x 4 values)
// and the vector's absolute values, the unsigned operand of the sign trick.
template <int kind, int G>
inline void signed_step(const uint8_t* const (&wb)[G], int s, __m256i (&wv)[G], __m256i (&wa)[G]) {
  for (int i = 0; i < G; ++i) {
    wv[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb[i] + quant::unit_stride(kind) * s));
    wa[i] = _mm256_sign_epi8(wv[i], wv[i]);
  }
}

// Pairs of int16 of the weight vector w (8 rows x 4 values) times x's 4 values: unsigned nibbles
// as they are, signed weights as |w| times x with w's sign.
template <int kind>
inline __m256i pair_products(__m256i w, __m256i w_abs, __m256i x) {
  if constexpr (kind == kU4)
    return _mm256_maddubs_epi16(w, x);
  else
    return _mm256_maddubs_epi16(w_abs, _mm256_sign_epi8(x, w));
}

// A tile's R rows x G groups of sums into y (rows ldy apart), the first `channels` of them.
template <int R, int G>
inline void store_rows(const __m256 (&acc)[G][R], const Out& y, int64_t ldy, int channels) {
  for (int i = 0; i < G; ++i) {
    const int c = std::min(channels - i * kGroup, kGroup);
    if (c <= 0) break;
    for (int r = 0; r < R; ++r) quant::store8(y.at(r * ldy + i * kGroup), acc[i][r], c);
  }
}

// One tile: G groups (8 G channels) x R rows of x, over all nb blocks; y rows are ldy apart. A
// lane's arithmetic is the same for every R and G. Never inlined: inside the product's loops GCC
// allocated the Q6_K tile's registers worse (0.65x at 4 rows).
template <int kind, bool has_min, bool factored, int R, int G>
__attribute__((noinline)) void tile_avx2(const Groups<G>& gs, int64_t nb, const int8_t* xq, int64_t k, const float* xs,
                                         const float* xsum, const Out& y, int64_t ldy, int channels) {
  constexpr int nh = halves(kind);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[G][R];
  for (int i = 0; i < G; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* wb[G];
    for (int i = 0; i < G; ++i) wb[i] = gs.w[i] + b * quant::block_stride(kind);
    const int8_t* xb = xq + b * kBlock;
    // x's block scales are broadcast only where used: 4 more live registers would spill the tile
    const auto sx = [&](int r) { return _mm256_set1_ps(xs[r * nb + b]); };
    // block (or half) e's int32 sums of group i, scaled into its accumulators
    const auto scale_into = [&](int i, int64_t e, const __m256i(&s32)[R]) {
      const __m256 sw = quant::scales8<factored>(gs.ws[i], e, b);
      for (int r = 0; r < R; ++r)
        acc[i][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32[r]), _mm256_mul_ps(sw, sx(r)), acc[i][r]);
    };
    if constexpr (is_unsigned(kind)) {
      // pairs summed in int16 as far as they cannot overflow: U4's whole block, U5's half (two
      // chunks), then one vpmaddwd each to int32
      constexpr int chunks_per_sum = kind == kU4 ? 4 : 2;
      __m256i s32[G][R];
      for (int c0 = 0; c0 < 4; c0 += chunks_per_sum) {
        __m256i s16[G][R];
        for (int i = 0; i < G; ++i)
          for (int r = 0; r < R; ++r) s16[i][r] = _mm256_setzero_si256();
        for (int c = c0; c < c0 + chunks_per_sum; ++c) {
          __m256i lo[G], hi[G];
          for (int i = 0; i < G; ++i) unsigned_chunk<kind>(wb[i], c, lo[i], hi[i]);
          for (int r = 0; r < R; ++r) {
            const __m256i xl = broadcast4(xb + r * k + 4 * c);
            for (int i = 0; i < G; ++i)
              s16[i][r] = in_order(_mm256_add_epi16(s16[i][r], _mm256_maddubs_epi16(lo[i], xl)));
            const __m256i xh = broadcast4(xb + r * k + 16 + 4 * c);
            for (int i = 0; i < G; ++i)
              s16[i][r] = in_order(_mm256_add_epi16(s16[i][r], _mm256_maddubs_epi16(hi[i], xh)));
          }
        }
        for (int i = 0; i < G; ++i)
          for (int r = 0; r < R; ++r) {
            const __m256i part = _mm256_madd_epi16(s16[i][r], ones);
            s32[i][r] = c0 == 0 ? part : _mm256_add_epi32(s32[i][r], part);
          }
      }
      for (int i = 0; i < G; ++i) scale_into(i, b, s32[i]);
    } else if constexpr (kind == kS8Half) {
      for (int h = 0; h < 2; ++h) {
        __m256i s16[G][R];
        for (int i = 0; i < G; ++i)
          for (int r = 0; r < R; ++r) s16[i][r] = _mm256_setzero_si256();
        for (int s = 4 * h; s < 4 * h + 4; ++s) {
          __m256i wv[G], wa[G];
          signed_step<kind, G>(wb, s, wv, wa);
          for (int r = 0; r < R; ++r) {
            const __m256i x = broadcast4(xb + r * k + 4 * s);
            for (int i = 0; i < G; ++i)
              s16[i][r] = in_order(_mm256_add_epi16(s16[i][r], pair_products<kind>(wv[i], wa[i], x)));
          }
        }
        for (int i = 0; i < G; ++i) {
          __m256i s32[R];
          for (int r = 0; r < R; ++r) s32[r] = _mm256_madd_epi16(s16[i][r], ones);
          scale_into(i, b * nh + h, s32);
        }
      }
    } else {  // kS8: a step's pairs may reach 2 * 128 * 127, to int32 at once
      __m256i s32[G][R];
      for (int i = 0; i < G; ++i)
        for (int r = 0; r < R; ++r) s32[i][r] = _mm256_setzero_si256();
      for (int s = 0; s < 8; ++s) {
        __m256i wv[G], wa[G];
        signed_step<kind, G>(wb, s, wv, wa);
        for (int r = 0; r < R; ++r) {
          const __m256i x = broadcast4(xb + r * k + 4 * s);
          for (int i = 0; i < G; ++i)
            s32[i][r] =
                in_order(_mm256_add_epi32(s32[i][r], _mm256_madd_epi16(pair_products<kind>(wv[i], wa[i], x), ones)));
        }
      }
      for (int i = 0; i < G; ++i) scale_into(i, b, s32[i]);
    }
    if constexpr (has_min) {
      for (int i = 0; i < G; ++i) {
        const __m256 mw = quant::scales8<factored>(gs.wm[i], b, b);
        for (int r = 0; r < R; ++r) acc[i][r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(xsum[r * nb + b]), acc[i][r]);
      }
    }
  }
  store_rows<R, G>(acc, y, ldy, channels);
}

#if defined(CHUNKGEN_HAVE_AVX_VNNI)
// tile_avx2 on AVX-VNNI: every step's products summed into int32 by one vpdpbusd.
template <int kind, bool has_min, bool factored, int R, int G>
__attribute__((noinline)) void tile_avx_vnni(const Groups<G>& gs, int64_t nb, const int8_t* xq, int64_t k,
                                             const float* xs, const float* xsum, const Out& y, int64_t ldy,
                                             int channels) {
  constexpr int nh = halves(kind);
  __m256 acc[G][R];
  for (int i = 0; i < G; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* wb[G];
    for (int i = 0; i < G; ++i) wb[i] = gs.w[i] + b * quant::block_stride(kind);
    const int8_t* xb = xq + b * kBlock;
#pragma GCC unroll 2
    for (int h = 0; h < nh; ++h) {
      __m256i s32[G][R];
      for (int i = 0; i < G; ++i)
        for (int r = 0; r < R; ++r) s32[i][r] = _mm256_setzero_si256();
      if constexpr (is_unsigned(kind)) {
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) {
          __m256i lo[G], hi[G];
          for (int i = 0; i < G; ++i) unsigned_chunk<kind>(wb[i], c, lo[i], hi[i]);
          for (int r = 0; r < R; ++r) {
            const __m256i xl = broadcast4(xb + r * k + 4 * c);
            for (int i = 0; i < G; ++i) s32[i][r] = in_order(_mm256_dpbusd_avx_epi32(s32[i][r], lo[i], xl));
            const __m256i xh = broadcast4(xb + r * k + 16 + 4 * c);
            for (int i = 0; i < G; ++i) s32[i][r] = in_order(_mm256_dpbusd_avx_epi32(s32[i][r], hi[i], xh));
          }
        }
      } else {
        constexpr int steps = 8 / nh;  // of this block (or half)
#pragma GCC unroll 8
        for (int j = 0; j < steps; ++j) {
          const int s = h * steps + j;
          __m256i wv[G], wa[G];
          signed_step<kind, G>(wb, s, wv, wa);
          for (int r = 0; r < R; ++r) {
            const __m256i x = broadcast4(xb + r * k + 4 * s);
            for (int i = 0; i < G; ++i)
              s32[i][r] = in_order(_mm256_dpbusd_avx_epi32(s32[i][r], wa[i], _mm256_sign_epi8(x, wv[i])));
          }
        }
      }
      for (int i = 0; i < G; ++i) {
        const __m256 sw = quant::scales8<factored>(gs.ws[i], b * nh + h, b);
        for (int r = 0; r < R; ++r)
          acc[i][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32[i][r]), _mm256_mul_ps(sw, _mm256_set1_ps(xs[r * nb + b])),
                                      acc[i][r]);
      }
    }
    if constexpr (has_min) {
      for (int i = 0; i < G; ++i) {
        const __m256 mw = quant::scales8<factored>(gs.wm[i], b, b);
        for (int r = 0; r < R; ++r) acc[i][r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(xsum[r * nb + b]), acc[i][r]);
      }
    }
  }
  store_rows<R, G>(acc, y, ldy, channels);
}
#endif

// The 256-bit tile of `path` (AVX-VNNI or AVX2).
template <int kind, bool has_min, bool factored, int R, int G>
void tile_256(Path path, const Groups<G>& gs, int64_t nb, const int8_t* xq, int64_t k, const float* xs,
              const float* xsum, const Out& y, int64_t ldy, int channels) {
#if defined(CHUNKGEN_HAVE_AVX_VNNI)
  if (path == Path::AvxVnni)
    return tile_avx_vnni<kind, has_min, factored, R, G>(gs, nb, xq, k, xs, xsum, y, ldy, channels);
#else
  (void)path;
#endif
  tile_avx2<kind, has_min, factored, R, G>(gs, nb, xq, k, xs, xsum, y, ldy, channels);
}
#endif

// The scalar reference on the same layout: the same integer block sums, scales applied per block.
template <int kind, bool has_min, bool factored>
void tile_scalar(const uint8_t* w, const BlockScales& ws, const BlockScales& wm, int64_t nb, const int8_t* xq,
                 int64_t k, const float* xs, const float* xsum, const Out& y, int64_t ldy, int rows, int channels) {
  constexpr int nh = halves(kind);
  for (int r = 0; r < rows; ++r) {
    for (int c = 0; c < channels; ++c) {
      float sum = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* wb = w + b * quant::block_stride(kind);
        const int8_t* xb = xq + r * k + b * kBlock;
        int isum[2] = {0, 0};
        for (int j = 0; j < kBlock; ++j) {
          int q;
          if constexpr (is_unsigned(kind)) {
            const int chunk = j % 16 / 4, at = 4 * c + j % 4;
            const uint8_t byte = wb[quant::unit_stride(kind) * chunk + at];
            q = j < 16 ? byte & 0x0f : byte >> 4;
            if constexpr (kind == kU5)
              q |= ((wb[quant::unit_stride(kind) * 4 + at] >> (2 * chunk + (j < 16 ? 0 : 1))) & 1) << 4;
          } else {
            q = static_cast<int8_t>(wb[quant::unit_stride(kind) * (j / 4) + 4 * c + j % 4]);
          }
          isum[nh == 2 ? j / 16 : 0] += q * xb[j];
        }
        // Fused as written: left to the compiler's contraction, the factored and plain forms' sums
        // came out fused differently (1 ulp apart).
        for (int h = 0; h < nh; ++h)
          sum = std::fma(static_cast<float>(isum[h]), quant::scale_at<factored>(ws, b * nh + h, b, c) * xs[r * nb + b],
                         sum);
        if constexpr (has_min) sum = std::fma(quant::scale_at<factored>(wm, b, b, c), xsum[r * nb + b], sum);
      }
      y.put(r * ldy + c, sum);
    }
  }
}

struct QuantArgs {
  const uint8_t* w;
  BlockScales ws;
  BlockScales wm;  // all null: no mins
  int64_t n, nb;
  const int8_t* xq;
  const float *xs, *xsum;
  int64_t rows;
  Out y;
};

// Factored scales (and mins) of groups [g0, g1) widened to plain fp32 ones in buf, once for all the
// tiles of x rows that pass over a panel of them (the tiles would widen them once each).
std::pair<BlockScales, BlockScales> widen(const QuantArgs& a, int nh, int64_t g0, int64_t g1,
                                          AlignedVector<float>& buf) {
  const int64_t per_group = a.nb * nh * kGroup, per_group_min = a.wm.q != nullptr ? a.nb * kGroup : 0;
  buf.resize(static_cast<size_t>((g1 - g0) * (per_group + per_group_min)));
  float* ws = buf.data();
  float* wm = ws + (g1 - g0) * per_group;
  for (int64_t g = g0; g < g1; ++g) {
    const BlockScales s = a.ws.group(g, a.nb, nh), m = a.wm.group(g, a.nb, 1);
    for (int64_t b = 0; b < a.nb; ++b) {
      float* sw = ws + ((g - g0) * a.nb + b) * nh * kGroup;
      float* mw = wm + ((g - g0) * a.nb + b) * kGroup;
#if defined(__AVX2__)
      for (int h = 0; h < nh; ++h) _mm256_storeu_ps(sw + h * kGroup, quant::scales8<true>(s, b * nh + h, b));
      if (m.q != nullptr) _mm256_storeu_ps(mw, quant::scales8<true>(m, b, b));
#else
      for (int h = 0; h < nh; ++h)
        for (int c = 0; c < kGroup; ++c) sw[h * kGroup + c] = quant::scale_at<true>(s, b * nh + h, b, c);
      if (m.q != nullptr)
        for (int c = 0; c < kGroup; ++c) mw[c] = quant::scale_at<true>(m, b, b, c);
#endif
    }
  }
  return {BlockScales{ws, nullptr, nullptr, g0}, BlockScales{a.wm.q != nullptr ? wm : nullptr, nullptr, nullptr, g0}};
}

// Runs a panel of a product (groups or pairs [p0, p1)) with its scales as given, or with factored
// ones widened first where more than `widen_above` rows pass over it (where the tiles' own widening,
// once per tile of rows, costs more than a pass over the panel's scales).
template <bool factored, typename Panel>
void each_panel(const QuantArgs& a, int nh, int64_t p0, int64_t p1, int64_t widen_above, int64_t groups_per_p,
                int64_t groups, AlignedVector<float>& buf, Panel&& panel) {
  if constexpr (factored) {
    if (a.rows > widen_above) {
      const auto [ws, wm] = widen(a, nh, p0 * groups_per_p, std::min(p1 * groups_per_p, groups), buf);
      return panel(std::false_type{}, ws, wm);
    }
  }
  panel(std::bool_constant<factored>{}, a.ws, a.wm);
}

#if defined(CHUNKGEN_HAVE_AVX512_VNNI)
// Rows above which the VNNI path widens factored scales per panel: its tile widens a block's in a
// few instructions against its 64-128 dot products, so a pass over the panel's scales pays only for
// many tiles (on Zen 5, widened was slower at 32 rows).
constexpr int64_t kWidenAboveVnni = 32;

// Pairs of groups a VNNI tile takes: two for the unsigned kinds (32 channels, each broadcast of x
// serving two weight vectors: 1.15-1.2x the one-pair tile on Zen 5, the broadcasts being what that
// tile is short of), one for the signed ones (no gain from two: their tiles wait on more than the
// broadcasts).
template <int kind>
constexpr int kVnniPairs = quant::is_unsigned(kind) ? 2 : 1;

// Rows of x in a VNNI tile of P pairs: as many as 32 vector registers hold with their sums, the
// accumulators and the pairs' weight vectors (U5's planes of fifth bits too); then 4, 2, 1.
template <int kind, int P>
constexpr int kVnniRows = P == 1               ? 8
                          : kind == quant::kU5 ? 5
                                               : 6;

template <int kind, int P>
int vnni_rows(int64_t left) {
  constexpr int most = kVnniRows<kind, P>;
  return left >= most ? most : left >= 4 ? 4 : left >= 2 ? 2 : 1;
}

template <int kind, bool has_min, bool factored, int P>
void vnni_tile(int rows, const vnni::GroupPair (&pairs)[P], int64_t nb, const uint8_t* xq, int64_t k, const float* xs,
               const float* xsum, const Out& y, int64_t ldy, int channels) {
  constexpr int most = kVnniRows<kind, P>;
  switch (rows) {
    case most:
      return vnni::tile<kind, has_min, factored, most, P>(pairs, nb, xq, k, xs, xsum, y, ldy, channels);
    case 4:
      return vnni::tile<kind, has_min, factored, 4, P>(pairs, nb, xq, k, xs, xsum, y, ldy, channels);
    case 2:
      return vnni::tile<kind, has_min, factored, 2, P>(pairs, nb, xq, k, xs, xsum, y, ldy, channels);
    default:
      return vnni::tile<kind, has_min, factored, 1, P>(pairs, nb, xq, k, xs, xsum, y, ldy, channels);
  }
}

// Pair p of a product's groups (2p and 2p + 1, or 2p again for a lone last group) with their
// scales (and mins) as given: what a 16-channel tile reads.
template <int kind>
vnni::GroupPair pair_of(const QuantArgs& a, const BlockScales& ws, const BlockScales& wm, int64_t p, int64_t groups) {
  constexpr int nh = halves(kind);
  const int64_t g0 = 2 * p, g1 = std::min(g0 + 1, groups - 1);
  return {quant::group_bytes_at(a.w, g0, a.nb, kind),
          quant::group_bytes_at(a.w, g1, a.nb, kind),
          ws.group(g0, a.nb, nh),
          ws.group(g1, a.nb, nh),
          wm.group(g0, a.nb, 1),
          wm.group(g1, a.nb, 1)};
}

// The AVX512_VNNI path: tiles of kVnniPairs pairs of groups where the panel has them (a last pair,
// or one of fewer than 16 channels, alone), over tiles of vnni_rows rows.
template <int kind, bool has_min, bool factored>
void quant_product_vnni(const QuantArgs& a) {
  constexpr int64_t bb = group_block_bytes(kind);
  constexpr int nh = halves(kind);
  constexpr int P = kVnniPairs<kind>;
  const int64_t groups = (a.n + kGroup - 1) / kGroup, pairs = (groups + 1) / 2, k = a.nb * kBlock;
  const int64_t group_bytes = a.nb * bb;
  const int64_t full_pairs = a.n / (2 * kGroup);                                // pairs of 16 channels
  const int64_t panel = std::max<int64_t>(P, (192 << 10) / (2 * group_bytes));  // pairs whose weights stay in L2
  const auto* xq = reinterpret_cast<const uint8_t*>(a.xq);
  at::parallel_for(0, pairs, P, [&](int64_t p0_, int64_t p1_) {
    AlignedVector<float> buf;
    for (int64_t p0 = p0_; p0 < p1_; p0 += panel) {
      const int64_t p1 = std::min(p1_, p0 + panel);
      each_panel<factored>(
          a, nh, p0, p1, kWidenAboveVnni, 2, groups, buf, [&](auto form, const BlockScales& ws, const BlockScales& wm) {
            constexpr bool f = decltype(form)::value;
            const auto group_pair = [&](int64_t p) { return pair_of<kind>(a, ws, wm, p, groups); };
            const auto wide = [&](int64_t p) { return P > 1 && p + P <= std::min(p1, full_pairs); };
            for (int64_t m0 = 0; m0 < a.rows;) {
              const int step = wide(p0) ? vnni_rows<kind, P>(a.rows - m0) : vnni_rows<kind, 1>(a.rows - m0);
              for (int64_t p = p0; p < p1;) {
                if constexpr (P > 1) {
                  if (wide(p)) {
                    vnni::GroupPair many[P];
                    for (int i = 0; i < P; ++i) many[i] = group_pair(p + i);
                    vnni_tile<kind, has_min, f, P>(step, many, a.nb, xq + m0 * k, k, a.xs + m0 * a.nb,
                                                   a.xsum + m0 * a.nb, a.y.at(m0 * a.n + 2 * p * kGroup), a.n,
                                                   2 * kGroup);
                    p += P;
                    continue;
                  }
                }
                const vnni::GroupPair one[1] = {group_pair(p)};
                const int channels = static_cast<int>(std::min<int64_t>(2 * kGroup, a.n - 2 * p * kGroup));
                for (int64_t m = m0; m < m0 + step;) {  // one pair over the wide tiles' rows
                  const int rows = vnni_rows<kind, 1>(m0 + step - m);
                  vnni_tile<kind, has_min, f, 1>(rows, one, a.nb, xq + m * k, k, a.xs + m * a.nb, a.xsum + m * a.nb,
                                                 a.y.at(m * a.n + 2 * p * kGroup), a.n, channels);
                  m += rows;
                }
                p += 1;
              }
              m0 += step;
            }
          });
    }
  });
}
#endif

#if defined(CHUNKGEN_HAVE_AVX512_VNNI)
// Rows from which the AMX path takes tiles of 16 rows; a smaller product runs on the VNNI tile.
// Measured on a 2-core Xeon (AMX) against the VNNI tile, SmolLM2-135M's products: Q8_0 and int8
// (a block's B tile is its packed bytes) 1.07-1.62x at 16-48 rows; the 4- and 5-bit kinds, whose
// bytes are spread first, and Q6_K's halves 0.81-1.13x below 64 rows (k = 1,536), 1.07-1.24x at 64.
template <int kind>
constexpr int64_t kAmxMinRows = quant::is_unsigned(kind) || quant::halves(kind) == 2 ? 64 : 16;

// The AMX path (Tiles: the CPU's tile instructions or their emulation): each pair of groups (16
// channels) over the tiles of 16 rows, then the rows left on the VNNI tile; threads and panels
// split the pairs as the VNNI path does.
template <typename Tiles, int kind, bool has_min, bool factored>
void quant_product_amx(const QuantArgs& a) {
  if (a.rows < kAmxMinRows<kind>) return quant_product_vnni<kind, has_min, factored>(a);
  constexpr int nh = halves(kind);
  const int64_t groups = (a.n + kGroup - 1) / kGroup, pairs = (groups + 1) / 2, k = a.nb * kBlock;
  const int64_t panel = std::max<int64_t>(1, (192 << 10) / (2 * a.nb * group_block_bytes(kind)));
  const int64_t amx_rows = a.rows / amx::kRows * amx::kRows;
  const auto* xq = reinterpret_cast<const uint8_t*>(a.xq);
  // A large bf16 output goes out whole lines at a time (output_lines.h): a pair's 16 channels are
  // half of a line, so two pairs' rows meet in a stage first.
  const bool stream = a.y.h != nullptr && stream_output(a.y.h, a.rows, a.n * 2);
  at::parallel_for(0, pairs, 1, [&](int64_t q0, int64_t q1) {
    static const amx::TileConfig config(nh);
    Tiles::configure(config);  // per thread
    AlignedVector<float> buf;
    AlignedVector<c10::BFloat16> stage(stream ? static_cast<size_t>(a.rows) * 4 * kGroup : 0);
    amx::PreparedPair prep;
    for (int64_t p0 = q0; p0 < q1; p0 += panel) {
      const int64_t p1 = std::min(q1, p0 + panel);
      each_panel<factored>(
          a, nh, p0, p1, kWidenAboveVnni, 2, groups, buf, [&](auto form, const BlockScales& ws, const BlockScales& wm) {
            constexpr bool f = decltype(form)::value;
            for (int64_t p = p0; p < p1; ++p) {
              const vnni::GroupPair one[1] = {pair_of<kind>(a, ws, wm, p, groups)};
              const int channels = static_cast<int>(std::min<int64_t>(2 * kGroup, a.n - 2 * p * kGroup));
              // Staged: an even pair and the odd one after it in this panel, both whole.
              const int64_t even = p & ~int64_t{1};
              const bool staged = stream && even >= p0 && even + 1 < p1 && (even + 2) * 2 * kGroup <= a.n;
              const Out y = staged ? Out{nullptr, stage.data() + (p - even) * 2 * kGroup} : a.y.at(2 * p * kGroup);
              const int64_t ldy = staged ? 4 * kGroup : a.n;
              amx::prepare_pair<kind>(one[0], a.nb, prep);
              for (int64_t m = 0; m < amx_rows; m += amx::kRows)
                amx::tile<Tiles, kind, has_min, f>(one[0], prep, a.nb, xq + m * k, k, a.xs + m * a.nb,
                                                   a.xsum + m * a.nb, y.at(m * ldy), ldy, channels);
              for (int64_t m = amx_rows; m < a.rows;) {
                const int rows = vnni_rows<kind, 1>(a.rows - m);
                vnni_tile<kind, has_min, f, 1>(rows, one, a.nb, xq + m * k, k, a.xs + m * a.nb, a.xsum + m * a.nb,
                                               y.at(m * ldy), ldy, channels);
                m += rows;
              }
              if (staged && p != even) stream_lines(stage.data(), a.rows, a.y.h + 2 * even * kGroup, a.n);
            }
          });
    }
    if (stream) stream_fence();  // the streamed lines before the other threads read y
    Tiles::release();
  });
}
#endif

#if defined(__AVX2__)
// Rows at most which a 256-bit tile of the paired kinds takes both groups of a pair (16 channels);
// more rows take one group (8 channels x up to kRows): two groups' sums over more rows would not fit
// AVX2's 16 registers, and over many rows the tile waits on its dot products, not its loads.
constexpr int kPairRows256 = 2;

// A 256-bit tile of `rows` rows (at most kRows; a pair tile's at most kPairRows256).
template <int kind, bool has_min, bool factored, int G>
void tile_256_rows(int rows, Path path, const Groups<G>& gs, int64_t nb, const int8_t* xq, int64_t k, const float* xs,
                   const float* xsum, const Out& y, int64_t ldy, int channels) {
  static_assert(kRows == 4 && kPairRows256 == 2, "the cases below");
  if constexpr (G == 1) {
    if (rows == 4) return tile_256<kind, has_min, factored, 4, 1>(path, gs, nb, xq, k, xs, xsum, y, ldy, channels);
    if (rows == 3) return tile_256<kind, has_min, factored, 3, 1>(path, gs, nb, xq, k, xs, xsum, y, ldy, channels);
  }
  if (rows == 2) return tile_256<kind, has_min, factored, 2, G>(path, gs, nb, xq, k, xs, xsum, y, ldy, channels);
  tile_256<kind, has_min, factored, 1, G>(path, gs, nb, xq, k, xs, xsum, y, ldy, channels);
}
#endif

template <int kind, bool has_min, bool factored>
void quant_product(const QuantArgs& a, Path path) {
#if defined(CHUNKGEN_HAVE_AMX_INT8)
  if (path == Path::Amx) return quant_product_amx<amx::AmxTiles, kind, has_min, factored>(a);
#endif
#if defined(CHUNKGEN_HAVE_AVX512_VNNI)
  if (path == Path::AmxEmulated) return quant_product_amx<amx::EmulatedTiles, kind, has_min, factored>(a);
  if (path == Path::Avx512Vnni) return quant_product_vnni<kind, has_min, factored>(a);
#endif
  constexpr int64_t bb = group_block_bytes(kind);
  constexpr int nh = halves(kind);
  const int64_t groups = (a.n + kGroup - 1) / kGroup, k = a.nb * kBlock;
  const int64_t group_bytes = a.nb * bb;
  // Threads and panels split the groups in pairs, so a pair tile never straddles two. A panel's
  // weights stay in L2 (~192 KiB) while all tiles of x rows pass over it.
  const int64_t pairs = (groups + 1) / 2;
  const int64_t panel = std::max<int64_t>(1, (192 << 10) / (2 * group_bytes));
  at::parallel_for(0, pairs, 1, [&](int64_t q0, int64_t q1) {
    AlignedVector<float> buf;
    for (int64_t q = q0; q < q1; q += panel) {
      const int64_t p0 = 2 * q, p1 = std::min(groups, 2 * std::min(q1, q + panel));
      each_panel<factored>(
          a, nh, p0, p1, kRows, 1, groups, buf, [&](auto form, const BlockScales& ws_all, const BlockScales& wm_all) {
            constexpr bool f = decltype(form)::value;
            const auto one_group = [&](int64_t g) {
              return Groups<1>{
                  {quant::group_bytes_at(a.w, g, a.nb, kind)}, {ws_all.group(g, a.nb, nh)}, {wm_all.group(g, a.nb, 1)}};
            };
            for (int64_t m0 = 0; m0 < a.rows; m0 += kRows) {
              const int rows = static_cast<int>(std::min<int64_t>(kRows, a.rows - m0));
              const int8_t* xq = a.xq + m0 * k;
              const float* xs = a.xs + m0 * a.nb;
              const float* xsum = a.xsum + m0 * a.nb;
              for (int64_t g = p0; g < p1;) {
                const Out y = a.y.at(m0 * a.n + g * kGroup);
                const int channels = static_cast<int>(std::min<int64_t>(2 * kGroup, a.n - g * kGroup));
#if defined(__AVX2__)
                if (path != Path::Scalar) {
                  if (quant::paired(kind) && rows <= kPairRows256 && g + 1 < p1) {
                    const Groups<1> g0 = one_group(g), g1 = one_group(g + 1);
                    const Groups<2> both{{g0.w[0], g1.w[0]}, {g0.ws[0], g1.ws[0]}, {g0.wm[0], g1.wm[0]}};
                    tile_256_rows<kind, has_min, f, 2>(rows, path, both, a.nb, xq, k, xs, xsum, y, a.n, channels);
                    g += 2;
                  } else {
                    tile_256_rows<kind, has_min, f, 1>(rows, path, one_group(g), a.nb, xq, k, xs, xsum, y, a.n,
                                                       std::min(channels, kGroup));
                    g += 1;
                  }
                  continue;
                }
#endif
                const Groups<1> one = one_group(g);
                tile_scalar<kind, has_min, f>(one.w[0], one.ws[0], one.wm[0], a.nb, xq, k, xs, xsum, y, a.n, rows,
                                              std::min(channels, kGroup));
                g += 1;
              }
            }
          });
    }
  });
}

// x's int8 values per row, read in x's dtype (fp32, bf16 or fp16); `offset`: stored as x + 128
// (unsigned), the operand the VNNI tile multiplies signed weights by. The vector paths read x as
// it is; the scalar one widens a row at a time. A product's x of fewer than 32,768 values (a decode
// step's 32 rows, a few microseconds of work) is quantized on one thread, without a parallel region.
template <typename T>
void quantize_rows(const T* x, int64_t rows, int64_t k, int8_t* q, float* scale, float* qsum, Path path,
                   bool offset = false) {
  const int64_t nb = k / kBlock;
  const int64_t grain = std::max<int64_t>(1, (32 << 10) / std::max<int64_t>(k, 1));
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
#if defined(__AVX2__)
    if (path != Path::Scalar) {
      // (a 512-bit version ran 1.5x slower on Zen 4: its narrowing stores and reductions cost more)
      for (int64_t r = r0; r < r1; ++r)
        quantize_row_avx2(x + r * k, k, q + r * k, scale + r * nb, qsum + r * nb, offset);
      return;
    }
#endif
    AlignedVector<float> wide(std::is_same_v<T, float> ? 0 : k);
    for (int64_t r = r0; r < r1; ++r) {
      int8_t* qr = q + r * k;
      const float* xr;
      if constexpr (std::is_same_v<T, float>) {
        xr = x + r * k;
      } else {
        for (int64_t j = 0; j < k; ++j) wide[j] = static_cast<float>(x[r * k + j]);
        xr = wide.data();
      }
      quantize_row_scalar(xr, k, qr, scale + r * nb, qsum + r * nb);
      if (offset)
        for (int64_t j = 0; j < k; ++j) qr[j] = static_cast<int8_t>(static_cast<uint8_t>(qr[j]) ^ 0x80u);
    }
  });
}

// x [rows, k] as the products read it: contiguous, its own dtype where that is fp32, bf16 or fp16.
torch::Tensor as_rows(const torch::Tensor& x) {
  TORCH_CHECK_VALUE(x.device().is_cpu() && x.dim() == 2, "x must be a 2-D CPU tensor, got ", x.sizes());
  TORCH_CHECK_VALUE(x.size(1) % kBlock == 0, "x's columns (", x.size(1), ") must be a multiple of 32");
  const auto t = x.scalar_type();
  return (t == torch::kFloat32 || t == torch::kBFloat16 || t == torch::kHalf ? x : x.to(torch::kFloat32)).contiguous();
}

void quantize_rows(const torch::Tensor& x, int8_t* q, float* scale, float* qsum, Path path, bool offset = false) {
  const int64_t rows = x.size(0), k = x.size(1);
  switch (x.scalar_type()) {
    case torch::kBFloat16:
      return quantize_rows(x.data_ptr<at::BFloat16>(), rows, k, q, scale, qsum, path, offset);
    case torch::kHalf:
      return quantize_rows(x.data_ptr<at::Half>(), rows, k, q, scale, qsum, path, offset);
    default:
      return quantize_rows(x.data_ptr<float>(), rows, k, q, scale, qsum, path, offset);
  }
}

// (q int8 [rows, k], scale [rows, k / 32], scale * sum(q) [rows, k / 32]) of x [rows, k].
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> quantize_rows_op(const torch::Tensor& x_in) {
  const auto x = as_rows(x_in);
  const int64_t rows = x.size(0), k = x.size(1);
  auto q = torch::empty({rows, k}, x.options().dtype(torch::kInt8));
  auto scale = torch::empty({rows, k / kBlock}, x.options().dtype(torch::kFloat32));
  auto qsum = torch::empty({rows, k / kBlock}, x.options().dtype(torch::kFloat32));
  quantize_rows(x, q.data_ptr<int8_t>(), scale.data_ptr<float>(), qsum.data_ptr<float>(), current_path());
  return {q, scale, qsum};
}

// x [rows, k] (float32 or bfloat16) times W^T, W [n, k] given packed (see the top of this file):
// qs bytes [groups, k / 32, 128 (kind 0) or 256], scales [groups, k / 32, halves, 8], optional
// mins [groups, k / 32, 8] -> [rows, n] in x's dtype. Scales (and mins) are fp32, or int8 with
// scale_d (and min_d) fp16, the groups in pairs: [pairs, k / 32, halves, 16] and [pairs, k / 256,
// 16], the factored form (quant_layout.h), for U4 and U5 with mins and S8H.
torch::Tensor quant_linear_op(const torch::Tensor& x_in, const torch::Tensor& qs, const torch::Tensor& scales,
                              const std::optional<torch::Tensor>& mins, int64_t kind, int64_t n,
                              const std::optional<torch::Tensor>& scale_d, const std::optional<torch::Tensor>& min_d) {
  const auto x = as_rows(x_in);
  const int64_t rows = x.size(0), k = x.size(1), nb = k / kBlock;
  TORCH_CHECK_VALUE(kind == kU4 || kind == kS8 || kind == kS8Half || kind == kU5, "unknown quantized layout ", kind);
  const int64_t groups = (n + kGroup - 1) / kGroup;
  const int64_t bytes = quant::packed_bytes(groups, nb, kind);
  TORCH_CHECK_VALUE(qs.is_contiguous() && qs.element_size() == 1 && qs.numel() == bytes, "qs must hold ", bytes,
                    " contiguous bytes for ", n, " x ", k, " in layout ", kind, ", got ", qs.numel());
  const bool has_min = mins.has_value() && mins->defined();
  const bool factored = scale_d.has_value() && scale_d->defined();
  const int64_t slots = factored ? (groups + 1) / 2 * 2 : groups;  // factored: groups in pairs (quant_layout.h)
  const int64_t nscales = slots * nb * halves(kind) * kGroup;
  TORCH_CHECK_VALUE(!(kind == kS8Half && has_min), "layout 2 has no mins");
  TORCH_CHECK_VALUE(!(kind == kU5 && !has_min), "layout 3 needs mins");
  if (factored)
    TORCH_CHECK_VALUE((is_unsigned(kind) && has_min) || kind == kS8Half,
                      "factored scales are for layouts 0 and 3 with mins and layout 2, got layout ", kind);
  const auto dtype = factored ? torch::kInt8 : torch::kFloat32;
  const auto check = [&](const torch::Tensor& t, int64_t numel, const char* name) {
    TORCH_CHECK_VALUE(t.is_contiguous() && t.scalar_type() == dtype && t.numel() == numel, name, " must be ", numel,
                      " contiguous ", factored ? "int8 (factored scales)" : "float32");
  };
  check(scales, nscales, "scales");
  if (has_min) check(*mins, slots * nb * kGroup, "mins");
  BlockScales ws, wm;
  if (factored) {
    TORCH_CHECK_VALUE(nb % kSuper == 0, "factored scales need k a multiple of 256, got ", k);
    const int64_t nd = slots * (nb / kSuper) * kGroup;
    const auto check_d = [&](const std::optional<torch::Tensor>& t, const char* name) {
      TORCH_CHECK_VALUE(
          t.has_value() && t->defined() && t->is_contiguous() && t->scalar_type() == torch::kHalf && t->numel() == nd,
          name, " must be ", nd, " contiguous float16");
    };
    check_d(scale_d, "scale_d");
    ws = {nullptr, scales.data_ptr<int8_t>(), static_cast<const uint16_t*>(scale_d->data_ptr())};
    if (has_min) {
      check_d(min_d, "min_d");
      wm = {nullptr, mins->data_ptr<int8_t>(), static_cast<const uint16_t*>(min_d->data_ptr())};
    }
  } else {
    TORCH_CHECK_VALUE(!(min_d.has_value() && min_d->defined()), "min_d needs factored scales (scale_d)");
    ws.f = scales.data_ptr<float>();
    if (has_min) wm.f = mins->data_ptr<float>();
  }
  const Path path = current_path();
  auto q = torch::empty({rows, k}, x.options().dtype(torch::kInt8));
  auto xs = torch::empty({rows, nb}, x.options().dtype(torch::kFloat32));
  auto xsum = torch::empty({rows, nb}, x.options().dtype(torch::kFloat32));
  quantize_rows(x, q.data_ptr<int8_t>(), xs.data_ptr<float>(), xsum.data_ptr<float>(), path,
                path >= Path::Avx512Vnni && !is_unsigned(kind));  // the VNNI and AMX tiles' x + 128
  // bf16 rows are written as the tiles finish them (quant_out.h); fp16 ones go through fp32
  const bool bf16 = x.scalar_type() == torch::kBFloat16;
  auto y = torch::empty({rows, n}, x.options().dtype(bf16 ? torch::kBFloat16 : torch::kFloat32));
  const QuantArgs a{static_cast<const uint8_t*>(qs.data_ptr()),
                    ws,
                    wm,
                    n,
                    nb,
                    q.data_ptr<int8_t>(),
                    xs.data_ptr<float>(),
                    xsum.data_ptr<float>(),
                    rows,
                    bf16 ? Out{nullptr, y.data_ptr<at::BFloat16>()} : Out{y.data_ptr<float>(), nullptr}};
  if (kind == kU4 && has_min && factored)
    quant_product<kU4, true, true>(a, path);
  else if (kind == kU4 && has_min)
    quant_product<kU4, true, false>(a, path);
  else if (kind == kU4)
    quant_product<kU4, false, false>(a, path);
  else if (kind == kU5 && factored)
    quant_product<kU5, true, true>(a, path);
  else if (kind == kU5)
    quant_product<kU5, true, false>(a, path);
  else if (kind == kS8 && has_min)
    quant_product<kS8, true, false>(a, path);
  else if (kind == kS8)
    quant_product<kS8, false, false>(a, path);
  else if (factored)
    quant_product<kS8Half, false, true>(a, path);
  else
    quant_product<kS8Half, false, false>(a, path);
  return y.scalar_type() == x_in.scalar_type() ? y : y.to(x_in.scalar_type());
}

std::string quant_isa_op() { return path_name(current_path()); }

}  // namespace
}  // namespace chunkgen

TORCH_LIBRARY_FRAGMENT(chunkgen, m) {
  m.def("quantize_rows(Tensor x) -> (Tensor, Tensor, Tensor)");
  m.def(
      "quant_linear(Tensor x, Tensor qs, Tensor scales, Tensor? mins, int kind, int n, Tensor? scale_d=None, "
      "Tensor? min_d=None) -> Tensor");
  m.def("quant_isa() -> str", &chunkgen::quant_isa_op);
}

TORCH_LIBRARY_IMPL(chunkgen, CPU, m) {
  m.impl("quantize_rows", &chunkgen::quantize_rows_op);
  m.impl("quant_linear", &chunkgen::quant_linear_op);
}
