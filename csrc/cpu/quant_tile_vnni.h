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

// 32 bytes of group g and 32 of group g + 1 at the same offset: one vector of 16 channels.
inline __m512i load_pair(const uint8_t* a, const uint8_t* b) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a))),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)), 1);
}

// U5's fifth bits of nibble vector v, from the two groups' planes side by side (quant_linear.cpp's
// fifth_bits on 512 bits).
inline __m512i fifth_bits(__m512i plane, int v) {
  const __m512i moved = v <= 4 ? _mm512_slli_epi16(plane, 4 - v) : _mm512_srli_epi16(plane, v - 4);
  return _mm512_and_si512(moved, _mm512_set1_epi8(16));
}

// 4 bytes of x in every lane (a load with broadcast, no ALU work).
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

// One tile: channels of groups w0 and w1 (w1 may repeat w0 when the layer has one group left; then
// only `channels` <= 8 lanes are stored) x R rows of x over all nb blocks. xq holds x's int8 values
// for U4 and x + 128 for the signed kinds; y rows are ldy apart.
template <int kind, bool has_min, bool factored, int R>
void tile(const uint8_t* w0, const uint8_t* w1, const quant::BlockScales& ws0, const quant::BlockScales& ws1,
          const quant::BlockScales& wm0, const quant::BlockScales& wm1, int64_t nb, const uint8_t* xq, int64_t k,
          const float* xs, const float* xsum, const quant::Out& y, int64_t ldy, int channels) {
  constexpr int64_t bb = quant::group_block_bytes(kind);
  constexpr int nh = quant::halves(kind);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i offset = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* a0 = w0 + b * bb;
    const uint8_t* a1 = w1 + b * bb;
    const uint8_t* xb = xq + b * 32;
    // fully unrolled (GCC leaves the halves' loops rolled otherwise, and spills the tile)
#pragma GCC unroll 2
    for (int h = 0; h < nh; ++h) {
      __m512i s32[R];
      for (int r = 0; r < R; ++r) s32[r] = _mm512_setzero_si512();
      if constexpr (quant::is_unsigned(kind)) {
        const __m512i mask = _mm512_set1_epi8(0x0f);
        const __m512i plane = kind == quant::kU5 ? load_pair(a0 + 128, a1 + 128) : mask;
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) {
          const __m512i raw = load_pair(a0 + 32 * c, a1 + 32 * c);
          __m512i lo = _mm512_and_si512(raw, mask);
          __m512i hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), mask);
          if constexpr (kind == quant::kU5) {
            lo = _mm512_or_si512(lo, fifth_bits(plane, 2 * c));
            hi = _mm512_or_si512(hi, fifth_bits(plane, 2 * c + 1));
          }
          for (int r = 0; r < R; ++r) {
            s32[r] = in_order(_mm512_dpbusd_epi32(s32[r], lo, broadcast4(xb + r * k + 4 * c)));
            s32[r] = in_order(_mm512_dpbusd_epi32(s32[r], hi, broadcast4(xb + r * k + 16 + 4 * c)));
          }
        }
      } else {
        // the steps of this block (or half): 8 (or 4) x 4 values
        constexpr int steps = 8 / nh;
        __m512i corr = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int j = 0; j < steps; ++j) {
          const int s = h * steps + j;
          const __m512i wv = load_pair(a0 + 32 * s, a1 + 32 * s);
          corr = _mm512_dpbusd_epi32(corr, offset, wv);
          for (int r = 0; r < R; ++r)
            s32[r] = in_order(_mm512_dpbusd_epi32(s32[r], broadcast4(xb + r * k + 4 * s), wv));
        }
        for (int r = 0; r < R; ++r) s32[r] = _mm512_sub_epi32(s32[r], corr);
      }
      const __m512 sw = quant::scales16<factored>(ws0, ws1, b * nh + h, b);
      for (int r = 0; r < R; ++r)
        acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(s32[r]), _mm512_set1_ps(xs[r * nb + b])), sw, acc[r]);
    }
    if constexpr (has_min) {
      const __m512 mw = quant::scales16<factored>(wm0, wm1, b, b);
      for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(xsum[r * nb + b]), acc[r]);
    }
  }
  const __mmask16 keep = static_cast<__mmask16>((1u << channels) - 1);
  for (int r = 0; r < R; ++r) quant::store16(y.at(r * ldy), acc[r], keep);
}

}  // namespace vnni
}  // namespace chunkgen
#endif
