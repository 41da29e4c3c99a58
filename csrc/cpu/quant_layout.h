// The quantized linear layers' packed layout, as the tiles of every path read it (quant_linear.cpp's
// top comment gives the bytes): its kinds of values, and the two forms of a group's block scales
// (and mins):
//   plain:    an fp32 per block (or half) and channel;
//   factored: an int8 per block (or half) and channel times an fp32 per super-block of 8 blocks
//             (256 values) and channel: the K-types' sub-block scales and mins as GGUF ships them
//             (Q4_K's and Q5_K's 6-bit scales and mins under fp16 d and dmin, Q6_K's int8 scales
//             under d).
// The factored form is a quarter of the plain one's bytes, which made the scales a quarter of a
// repacked Q4_K weight. It gives the same bits: an int8 times an fp16 value (every GGUF super-block
// scale is one) needs at most 18 significant bits, so its fp32 product is exact, and equal to the
// plain form's fp32 scale made from the same two numbers at load.
#pragma once

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

// One packed group's scales (or mins): entry (b * halves + h) * 8 + c for block b, half h, channel c.
struct BlockScales {
  const float* f = nullptr;   // plain: [nb, halves, 8]
  const int8_t* q = nullptr;  // factored: [nb, halves, 8]
  const float* d = nullptr;   // factored: [nb / 8, 8]

  // Group g's part of a weight's scales, nb blocks of `halves` entries per channel.
  BlockScales group(int64_t g, int64_t nb, int halves) const {
    const int64_t per_group = nb * halves * kGroup;
    if (q == nullptr) return {f == nullptr ? nullptr : f + g * per_group, nullptr, nullptr};
    return {nullptr, q + g * per_group, d + g * (nb / kSuper) * kGroup};
  }
};

// Entry i (of block b) for channel c.
template <bool factored>
inline float scale_at(const BlockScales& s, int64_t i, int64_t b, int c) {
  if constexpr (factored)
    return static_cast<float>(s.q[i]) * s.d[(b / kSuper) * kGroup + c];
  else
    return s.f[i];
}

#if defined(__AVX2__)
// Entries i..i + 7 (block b): one group's 8 channels.
template <bool factored>
inline __m256 scales8(const BlockScales& s, int64_t i, int64_t b) {
  if constexpr (factored) {
    const __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(s.q + i)));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(q), _mm256_loadu_ps(s.d + (b / kSuper) * kGroup));
  } else {
    return _mm256_loadu_ps(s.f + i);
  }
}
#endif

#if defined(__AVX512F__)
// 8 floats at a and 8 at b: one vector of 16 channels.
inline __m512 load_pair_ps(const float* a, const float* b) {
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(_mm256_loadu_ps(a))),
                                             _mm256_castps_pd(_mm256_loadu_ps(b)), 1));
}

// Entries i..i + 7 (block b) of groups s0 and s1 side by side: 16 channels.
template <bool factored>
inline __m512 scales16(const BlockScales& s0, const BlockScales& s1, int64_t i, int64_t b) {
  if constexpr (factored) {
    const __m128i q = _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(s0.q + i)),
                                         _mm_loadl_epi64(reinterpret_cast<const __m128i*>(s1.q + i)));
    const int64_t sb = (b / kSuper) * kGroup;
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), load_pair_ps(s0.d + sb, s1.d + sb));
  } else {
    return load_pair_ps(s0.f + i, s1.f + i);
  }
}
#endif

}  // namespace quant
}  // namespace chunkgen
