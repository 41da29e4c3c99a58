// The quantized linear layers' packed layout, as the tiles of every path read it (quant_linear.cpp's
// top comment gives the bytes): its kinds of values, and the two forms of a group's block scales
// (and mins):
//   plain:    an fp32 per block (or half) and channel;
//   factored: an int8 per block (or half) and channel times an fp16 per super-block of 8 blocks
//             (256 values) and channel: the K-types' sub-block scales and mins as GGUF ships them
//             (Q4_K's and Q5_K's 6-bit scales and mins under fp16 d and dmin, Q6_K's int8 scales
//             under d). The fp16 is the file's own: held as fp32 it took 4 bytes more a super-block
//             and channel for each of d and dmin, 0.1 GiB of a 7B Q4_K model.
// The factored form is a quarter of the plain one's bytes, which made the scales a quarter of a
// repacked Q4_K weight. It gives the same bits: an int8 times an fp16 value (every GGUF super-block
// scale is one) needs at most 18 significant bits, so its fp32 product is exact, and equal to the
// plain form's fp32 scale made from the same two numbers at load (the fp16 widens exactly). The
// products widen it in the tile where few rows of x pass over the weights, and once per panel of
// them where many do (quant_linear.cpp's widen).
#pragma once

#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX2__)
#include "intrinsics.h"
#endif

namespace chunkgen {
namespace quant {

constexpr int kGroup = 8;  // output channels a packed group interleaves (one fp32 lane each)
constexpr int kSuper = 8;  // blocks of 32 a factored scale's super-block holds

// U4: nibbles (Q4_0, Q4_1, Q4_K); U5: nibbles and a plane of fifth bits (Q5_K); S8: int8 (Q8_0,
// int8); S8H: int8 with a scale per half block (Q6_K).
enum Kind : int64_t { kU4 = 0, kS8 = 1, kS8Half = 2, kU5 = 3 };

// Bytes of one group's block (8 channels x 32 values).
constexpr int64_t group_block_bytes(int64_t kind) { return kind == kU4 ? 128 : kind == kU5 ? 160 : 256; }

constexpr int halves(int64_t kind) { return kind == kS8Half ? 2 : 1; }
// Unsigned values: the VNNI tiles' unsigned operand as they are (signed ones take x + 128 instead).
constexpr bool is_unsigned(int64_t kind) { return kind == kU4 || kind == kU5; }

// A block's bytes come in units of 32 (8 channels x 4 values, or U5's plane of fifth bits). The
// signed kinds' groups go in pairs (the last padded with a zero group) whose blocks interleave their
// units: unit u of groups 2p and 2p + 1 side by side, so one 64-byte load reads the same unit of
// both (the VNNI tile's vector of 16 channels; Q8_0 1.00-1.11x, Q6_K 1.04-1.11x at 8-256 rows). The
// unsigned kinds' groups stay one after another: interleaved, their products ran 0.84-0.98x at
// 8-32 rows on Zen 5.
constexpr int64_t kUnit = 32;
constexpr bool paired(int64_t kind) { return !is_unsigned(kind); }
// Bytes from a group's unit to its next, and from a group's block to its next.
constexpr int64_t unit_stride(int64_t kind) { return paired(kind) ? 2 * kUnit : kUnit; }
constexpr int64_t block_stride(int64_t kind) {
  return paired(kind) ? 2 * group_block_bytes(kind) : group_block_bytes(kind);
}
// Group g's first unit of block 0 in the packed bytes qs (nb blocks).
inline const uint8_t* group_bytes_at(const uint8_t* qs, int64_t g, int64_t nb, int64_t kind) {
  if (!paired(kind)) return qs + g * nb * group_block_bytes(kind);
  return qs + (g / 2) * nb * 2 * group_block_bytes(kind) + (g % 2) * kUnit;
}
// Bytes of a weight's packed groups.
inline int64_t packed_bytes(int64_t groups, int64_t nb, int64_t kind) {
  return (paired(kind) ? (groups + 1) / 2 * 2 : groups) * nb * group_block_bytes(kind);
}

// One packed group's scales (or mins), entry e = b * halves + h for block b (half h). Factored
// ones interleave the groups in pairs (g and g + 1 side by side, 16 channels an entry: the VNNI
// tile's two groups are one load and one widening), the plain ones do not.
struct BlockScales {
  const float* f = nullptr;     // plain: [groups, nb, halves, 8], from group `first` on
  const int8_t* q = nullptr;    // factored: [pairs, nb, halves, 16]
  const uint16_t* d = nullptr;  // factored: fp16 bits [pairs, nb / 8, 16]
  int64_t first = 0;

  // Group g's part of a weight's scales, nb blocks of `halves` entries per channel.
  BlockScales group(int64_t g, int64_t nb, int halves) const {
    if (q == nullptr) return {f == nullptr ? nullptr : f + (g - first) * nb * halves * kGroup, nullptr, nullptr, g};
    const int64_t pair = g / 2, side = (g % 2) * kGroup;
    return {nullptr, q + pair * nb * halves * 2 * kGroup + side, d + pair * (nb / kSuper) * 2 * kGroup + side, g};
  }
};

// Entry e (of block b) for channel c.
template <bool factored>
inline float scale_at(const BlockScales& s, int64_t e, int64_t b, int c) {
  if constexpr (factored)
    return static_cast<float>(s.q[e * 2 * kGroup + c]) *
           c10::detail::fp16_ieee_to_fp32_value(s.d[(b / kSuper) * 2 * kGroup + c]);
  else
    return s.f[e * kGroup + c];
}

#if defined(__AVX2__)
// 8 fp16 values widened to fp32 (F16C, which every AVX2 x86 has; the scalar form where a build
// leaves it out).
inline __m256 half8(const uint16_t* p) {
#if defined(__F16C__)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  alignas(32) float f[8];
  for (int i = 0; i < 8; ++i) f[i] = c10::detail::fp16_ieee_to_fp32_value(p[i]);
  return _mm256_load_ps(f);
#endif
}

// Entry e (of block b): one group's 8 channels.
template <bool factored>
inline __m256 scales8(const BlockScales& s, int64_t e, int64_t b) {
  if constexpr (factored) {
    const __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(s.q + e * 2 * kGroup)));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(q), half8(s.d + (b / kSuper) * 2 * kGroup));
  } else {
    return _mm256_loadu_ps(s.f + e * kGroup);
  }
}
#endif

#if defined(__AVX512F__)
// 8 floats at a and 8 at b: one vector of 16 channels.
inline __m512 load_pair_ps(const float* a, const float* b) {
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(_mm256_loadu_ps(a))),
                                             _mm256_castps_pd(_mm256_loadu_ps(b)), 1));
}

// Entry e (of block b) of groups s0 and s1 side by side: 16 channels. Factored: s0 is an even
// group and s1 the next (or s0 again for a lone last group, whose other 8 lanes are padding).
template <bool factored>
inline __m512 scales16(const BlockScales& s0, const BlockScales& s1, int64_t e, int64_t b) {
  if constexpr (factored) {
    const __m512i q = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s0.q + e * 2 * kGroup)));
    const __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s0.d + (b / kSuper) * 2 * kGroup));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(q), _mm512_cvtph_ps(d));
  } else {
    (void)b;
    return load_pair_ps(s0.f + e * kGroup, s1.f + e * kGroup);
  }
}
#endif

}  // namespace quant
}  // namespace chunkgen
