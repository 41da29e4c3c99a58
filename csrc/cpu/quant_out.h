// Where a quantized product's rows go (quant_linear.cpp, quant_tile_vnni.h): fp32, or bf16 rounded
// to nearest even as torch's conversion rounds. A bf16 layer's output then has the bits that
// y.to(bfloat16) gave, without y's fp32 rows ever in memory: a 7B model's 2,048-token prefill wave
// held 0.18 GiB of fp32 gate/up output and its bf16 copy at once.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX2__)
#include "intrinsics.h"
#endif

namespace chunkgen {
namespace quant {

struct Out {
  float* f = nullptr;          // fp32 rows, or
  c10::BFloat16* h = nullptr;  // bf16 rows

  Out at(int64_t i) const { return {f != nullptr ? f + i : nullptr, h != nullptr ? h + i : nullptr}; }
  void put(int64_t i, float v) const {
    if (h != nullptr)
      h[i] = c10::BFloat16(v);  // round to nearest even (NaN: a quiet NaN)
    else
      f[i] = v;
  }
};

#if defined(__AVX2__)
// 8 floats to bf16, rounded to nearest even (c10::BFloat16's rounding, NaN to its 0x7fc0).
inline __m128i bf16x8(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  r = _mm256_blendv_epi8(_mm256_set1_epi32(0x7fc0), r, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_ORD_Q)));
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

// The first `channels` (<= 8) lanes of v at y.
inline void store8(const Out& y, __m256 v, int channels) {
  if (y.h != nullptr) {
    const __m128i b = bf16x8(v);
    if (channels == 8) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(y.h), b);
    } else {
      alignas(16) c10::BFloat16 out[8];
      _mm_store_si128(reinterpret_cast<__m128i*>(out), b);
      std::memcpy(y.h, out, sizeof(c10::BFloat16) * channels);
    }
  } else if (channels == 8) {
    _mm256_storeu_ps(y.f, v);
  } else {
    alignas(32) float out[8];
    _mm256_store_ps(out, v);
    std::memcpy(y.f, out, sizeof(float) * channels);
  }
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
// The lanes of v that `keep` names at y (bf16 rounded as bf16x8 rounds).
inline void store16(const Out& y, __m512 v, __mmask16 keep) {
  if (y.h != nullptr) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_ORD_Q), _mm512_set1_epi32(0x7fc0), r);
    _mm256_mask_storeu_epi16(y.h, keep, _mm512_cvtepi32_epi16(r));
  } else {
    _mm512_mask_storeu_ps(y.f, keep, v);
  }
}
#endif

}  // namespace quant
}  // namespace chunkgen
