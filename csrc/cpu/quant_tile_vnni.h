// The quantized linear layers' tile on AVX512_VNNI (included by quant_linear.cpp, whose top comment
// gives the packed layout): vpdpbusd multiplies 4 unsigned bytes by 4 signed bytes and adds the
// four products to an int32 lane in one instruction, where AVX2 needs vpmaddubsw, vpmaddwd and an
// add (and int16 partial sums that can saturate).
//
// A 512-bit vector holds two packed groups side by side (16 output channels): the same step of
// groups g and g + 1, so the layout stays the one the AVX2 and scalar paths read and the repacking
// at load knows nothing of the ISA. A tile is those 16 channels x up to 8 rows of x (32 vector
// registers hold 8 int32 block sums, 8 fp32 accumulators and the shared weight vectors).
//
// The unsigned operand: U4 and U5 weights are unsigned (nibbles, U5's with a fifth bit from its
// plane), so they are it and x is the signed one. Signed weights (S8, S8H) take x shifted to unsigned, x + 128 (x
// XOR 0x80, done once per row at quantization), and the sum is corrected by 128 sum(w) per block (or half), itself one
// vpdpbusd of the weights against 128 per step, shared by every row of the tile.
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define CHUNKGEN_HAVE_AVX512_VNNI 1
#include "intrinsics.h"
#include "quant_layout.h"
#include "quant_out.h"

namespace chunkgen {
namespace vnni {

// Unit u of groups g and g + 1 at their block's bytes a and b: one vector of 16 channels, one
// 64-byte load where the kind pairs its groups (b is then a's second half).
template <int kind>
inline __m512i load_pair(const uint8_t* a, const uint8_t* b, int u) {
  if constexpr (quant::paired(kind)) return _mm512_loadu_si512(a + quant::unit_stride(kind) * u);
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 32 * u))),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32 * u)), 1);
}

// U5's fifth bits of nibble vector v, from the two groups' planes side by side (quant_linear.cpp's
// fifth_bits on 512 bits).
inline __m512i fifth_bits(__m512i plane, int v) {
  const __m512i moved = v <= 4 ? _mm512_slli_epi16(plane, 4 - v) : _mm512_srli_epi16(plane, v - 4);
  return _mm512_and_si512(moved, _mm512_set1_epi8(16));
}

// 4 bytes of x in every lane (a load with broadcast, which on Zen 5 takes a vector pipe's slot too).
inline __m512i broadcast4(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// Opaque to the compiler, as in the AVX2 tile: keeps each row's chain of sums in program order
// instead of trees that hold every product live and spill the tile.
inline __m512i in_order(__m512i v) {
  __asm__("" : "+v"(v));
  return v;
}

// The groups of one 16-channel vector, g and g + 1 (for a layer's lone last group, g + 1 is its
// zero padding where the kind pairs its groups, else g again): their bytes and block scales (and
// mins; ws1 and wm1 repeat ws0 and wm0 for a lone group).
struct GroupPair {
  const uint8_t *w0, *w1;
  quant::BlockScales ws0, ws1, wm0, wm1;
};

// One tile: P pairs of groups (16 P channels) x R rows of x over all nb blocks; the last pair stores
// only its first `channels` lanes (< 16 where the layer ends inside it). xq holds x's int8 values
// for U4 and x + 128 for the signed kinds; y rows are ldy apart, pair p's channels at 16 p.
// Each broadcast of x's bytes serves the P weight vectors of a step: the broadcasts, not the dot
// products, fill the vector pipes of a one-pair tile. A lane's arithmetic is the same for every R
// and P, so the tile's shape never changes a bit of y. Never inlined: inside the product's loops GCC
// allocated its registers worse (Q8_0 lost 15% to spills).
template <int kind, bool has_min, bool factored, int R, int P>
__attribute__((noinline)) void tile(const GroupPair (&pair)[P], int64_t nb, const uint8_t* xq, int64_t k,
                                    const float* xs, const float* xsum, const quant::Out& y, int64_t ldy,
                                    int channels) {
  constexpr int nh = quant::halves(kind);
  __m512 acc[R][P];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) acc[r][p] = _mm512_setzero_ps();
  const __m512i offset = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t *a0[P], *a1[P];
    for (int p = 0; p < P; ++p)
      a0[p] = pair[p].w0 + b * quant::block_stride(kind), a1[p] = pair[p].w1 + b * quant::block_stride(kind);
    const uint8_t* xb = xq + b * 32;
    // fully unrolled (GCC leaves the halves' loops rolled otherwise, and spills the tile)
#pragma GCC unroll 2
    for (int h = 0; h < nh; ++h) {
      __m512i s32[R][P];
      for (int r = 0; r < R; ++r)
        for (int p = 0; p < P; ++p) s32[r][p] = _mm512_setzero_si512();
      if constexpr (quant::is_unsigned(kind)) {
        const __m512i mask = _mm512_set1_epi8(0x0f);
        __m512i plane[P];
        for (int p = 0; p < P; ++p) plane[p] = kind == quant::kU5 ? load_pair<kind>(a0[p], a1[p], 4) : mask;
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) {
          __m512i lo[P], hi[P];
          for (int p = 0; p < P; ++p) {
            const __m512i raw = load_pair<kind>(a0[p], a1[p], c);
            lo[p] = _mm512_and_si512(raw, mask);
            hi[p] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), mask);
            if constexpr (kind == quant::kU5) {
              lo[p] = _mm512_or_si512(lo[p], fifth_bits(plane[p], 2 * c));
              hi[p] = _mm512_or_si512(hi[p], fifth_bits(plane[p], 2 * c + 1));
            }
          }
          for (int r = 0; r < R; ++r) {
            const __m512i xlo = broadcast4(xb + r * k + 4 * c);
            for (int p = 0; p < P; ++p) s32[r][p] = in_order(_mm512_dpbusd_epi32(s32[r][p], lo[p], xlo));
            const __m512i xhi = broadcast4(xb + r * k + 16 + 4 * c);
            for (int p = 0; p < P; ++p) s32[r][p] = in_order(_mm512_dpbusd_epi32(s32[r][p], hi[p], xhi));
          }
        }
      } else {
        // the steps of this block (or half): 8 (or 4) x 4 values
        constexpr int steps = 8 / nh;
        __m512i corr[P];
        for (int p = 0; p < P; ++p) corr[p] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int j = 0; j < steps; ++j) {
          const int s = h * steps + j;
          __m512i wv[P];
          for (int p = 0; p < P; ++p) {
            wv[p] = load_pair<kind>(a0[p], a1[p], s);
            corr[p] = _mm512_dpbusd_epi32(corr[p], offset, wv[p]);
          }
          for (int r = 0; r < R; ++r) {
            const __m512i xr = broadcast4(xb + r * k + 4 * s);
            for (int p = 0; p < P; ++p) s32[r][p] = in_order(_mm512_dpbusd_epi32(s32[r][p], xr, wv[p]));
          }
        }
        for (int r = 0; r < R; ++r)
          for (int p = 0; p < P; ++p) s32[r][p] = _mm512_sub_epi32(s32[r][p], corr[p]);
      }
      for (int p = 0; p < P; ++p) {
        const __m512 sw = quant::scales16<factored>(pair[p].ws0, pair[p].ws1, b * nh + h, b);
        for (int r = 0; r < R; ++r)
          acc[r][p] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(s32[r][p]), _mm512_set1_ps(xs[r * nb + b])), sw,
                                      acc[r][p]);
      }
    }
    if constexpr (has_min) {
      for (int p = 0; p < P; ++p) {
        const __m512 mw = quant::scales16<factored>(pair[p].wm0, pair[p].wm1, b, b);
        for (int r = 0; r < R; ++r) acc[r][p] = _mm512_fmadd_ps(mw, _mm512_set1_ps(xsum[r * nb + b]), acc[r][p]);
      }
    }
  }
  const __mmask16 keep = static_cast<__mmask16>((1u << channels) - 1);
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p)
      quant::store16(y.at(r * ldy + 16 * p), acc[r][p], p == P - 1 ? keep : __mmask16(0xffff));
}

}  // namespace vnni
}  // namespace chunkgen
#endif
