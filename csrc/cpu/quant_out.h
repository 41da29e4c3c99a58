// Where a quantized product's rows go (quant_linear.cpp, quant_tile_vnni.h): fp32, or bf16 rounded
// to nearest even as torch's conversion rounds. A bf16 layer's output then has the bits that
// y.to(bfloat16) gave, without y's fp32 rows ever in memory: a 7B model's 2,048-token prefill wave
// held 0.17 GiB of fp32 gate/up output and its bf16 copy at once.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

#include "vec.h"

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
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));

// The first `channels` (<= 8) lanes of v at y (bf16 rounded by vec.h's bf16_bits_of).
inline void store8(const Out& y, __m256 v, int channels) {
  if (y.h != nullptr) {
    const u16x8 h = __builtin_convertvector(decode::bf16_bits_of<u32x8>(v), u16x8);
    if (channels == 8)
      std::memcpy(y.h, &h, sizeof h);
    else
      std::memcpy(y.h, &h, sizeof(c10::BFloat16) * channels);
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
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));

// The lanes of v that `keep` names at y (bf16 rounded as store8 rounds).
inline void store16(const Out& y, __m512 v, __mmask16 keep) {
  if (y.h != nullptr)
    _mm256_mask_storeu_epi16(y.h, keep, (__m256i) __builtin_convertvector(decode::bf16_bits_of<u32x16>(v), u16x16));
  else
    _mm512_mask_storeu_ps(y.f, keep, v);
}
#endif

}  // namespace quant
}  // namespace chunkgen
