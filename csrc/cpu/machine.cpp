// The machine's fp32 FMA ceiling, measured the way the kernel computes (same SIMD width, all
// OpenMP threads), so `bench` can put the kernel's GFLOP/s next to it; and the ceiling of the
// quantized linear layers' inner loop on AVX2 (quant_linear.cpp: vpmaddubsw products summed in
// int16), which is what their speed against fp32 can reach on this core; where the build has them,
// the same for AVX512_VNNI's vpdpbusd (the quantized tile's instruction there) and AVX512_BF16's
// vdpbf16ps (the bf16 products'), so the two dot-product paths are held against their own peaks.
#include <omp.h>

#include <cstdint>
#include <cstring>
#include <initializer_list>

#include "vec.h"

namespace chunkgen {
namespace {
using decode::vf;  // the build's vector width, as the kernels use it
using decode::W;
}  // namespace

double fma_peak_gflops(int64_t iters) {
  double flops = 0;
  const double t0 = omp_get_wtime();
  float sink = 0;
#pragma omp parallel reduction(+ : sink) reduction(+ : flops)
  {
    // Ten independent chains cover the FMA latency x throughput product of current x86 cores.
    vf a0 = vf{} + 1.f, a1 = vf{} + 2.f, a2 = vf{} + 3.f, a3 = vf{} + 4.f, a4 = vf{} + 5.f, a5 = vf{} + 6.f,
       a6 = vf{} + 7.f, a7 = vf{} + 8.f, a8 = vf{} + 9.f, a9 = vf{} + 10.f;
    const vf x = vf{} + 0.999f, y = vf{} + 0.001f;
    for (int64_t i = 0; i < iters; ++i) {
      a0 = a0 * x + y;
      a1 = a1 * x + y;
      a2 = a2 * x + y;
      a3 = a3 * x + y;
      a4 = a4 * x + y;
      a5 = a5 * x + y;
      a6 = a6 * x + y;
      a7 = a7 * x + y;
      a8 = a8 * x + y;
      a9 = a9 * x + y;
#if defined(__x86_64__)
      // Opaque to the optimiser: the chains must really run, one FMA per chain per iteration.
      asm volatile(""
                   : "+x"(a0), "+x"(a1), "+x"(a2), "+x"(a3), "+x"(a4), "+x"(a5), "+x"(a6), "+x"(a7), "+x"(a8),
                     "+x"(a9));
#endif
    }
    const vf s = a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7 + a8 + a9;
    sink += s[0];
    flops += 2.0 * W * 10 * static_cast<double>(iters);
  }
  const double dt = omp_get_wtime() - t0;
  return sink == 12345.f ? 0.0 : flops / dt / 1e9;  // the sink keeps the loop alive
}

// Multiply-adds of int8 pairs per second x 2 (so comparable with FLOP/s) in the quantized kernel's
// inner step: vpmaddubsw (32 u8 x s8 products summed in pairs to int16) and the vpaddw that sums
// it into an int16 accumulator, six independent chains, all threads; 0 where there is no AVX2.
double int8_peak_gops(int64_t iters) {
#if defined(__AVX2__)
  double ops = 0;
  const double t0 = omp_get_wtime();
  int sink = 0;
#pragma omp parallel reduction(+ : sink) reduction(+ : ops)
  {
    __m256i w = _mm256_set1_epi8(3);
    const __m256i x0 = _mm256_set1_epi8(1), x1 = _mm256_set1_epi8(2), x2 = _mm256_set1_epi8(3),
                  x3 = _mm256_set1_epi8(4), x4 = _mm256_set1_epi8(5), x5 = _mm256_set1_epi8(6);
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0;
    for (int64_t i = 0; i < iters; ++i) {
      a0 = _mm256_add_epi16(a0, _mm256_maddubs_epi16(w, x0));
      a1 = _mm256_add_epi16(a1, _mm256_maddubs_epi16(w, x1));
      a2 = _mm256_add_epi16(a2, _mm256_maddubs_epi16(w, x2));
      a3 = _mm256_add_epi16(a3, _mm256_maddubs_epi16(w, x3));
      a4 = _mm256_add_epi16(a4, _mm256_maddubs_epi16(w, x4));
      a5 = _mm256_add_epi16(a5, _mm256_maddubs_epi16(w, x5));
      // w opaque: the products are made anew each iteration, not hoisted out of the loop
      asm volatile("" : "+x"(w), "+x"(a0), "+x"(a1), "+x"(a2), "+x"(a3), "+x"(a4), "+x"(a5));
    }
    const __m256i s = _mm256_add_epi16(_mm256_add_epi16(_mm256_add_epi16(a0, a1), _mm256_add_epi16(a2, a3)),
                                       _mm256_add_epi16(a4, a5));
    sink += _mm256_extract_epi16(s, 0);
    ops += 2.0 * 32 * 6 * static_cast<double>(iters);
  }
  const double dt = omp_get_wtime() - t0;
  return sink == 12345 ? 0.0 : ops / dt / 1e9;
#else
  return 0.0 * static_cast<double>(iters);
#endif
}

// Multiply-adds x 2 per second of 512-bit dot-product instructions, twelve independent chains (their
// latency x throughput is up to 6 x 2 on current cores), all threads: `dot(acc, a, b)` is one
// instruction of `macs` multiply-adds.
template <typename Acc, typename In, typename Dot>
double dot_peak(int64_t iters, In a, In b, Acc zero, int macs, Dot dot) {
  double ops = 0;
  const double t0 = omp_get_wtime();
  int sink = 0;
#pragma omp parallel reduction(+ : sink) reduction(+ : ops)
  {
    In w = a;
    Acc c0 = zero, c1 = zero, c2 = zero, c3 = zero, c4 = zero, c5 = zero, c6 = zero, c7 = zero, c8 = zero, c9 = zero,
        c10 = zero, c11 = zero;
    for (int64_t i = 0; i < iters; ++i) {
      c0 = dot(c0, w, b);
      c1 = dot(c1, w, b);
      c2 = dot(c2, w, b);
      c3 = dot(c3, w, b);
      c4 = dot(c4, w, b);
      c5 = dot(c5, w, b);
      c6 = dot(c6, w, b);
      c7 = dot(c7, w, b);
      c8 = dot(c8, w, b);
      c9 = dot(c9, w, b);
      c10 = dot(c10, w, b);
      c11 = dot(c11, w, b);
      asm volatile(""
                   : "+v"(w), "+v"(c0), "+v"(c1), "+v"(c2), "+v"(c3), "+v"(c4), "+v"(c5), "+v"(c6), "+v"(c7), "+v"(c8),
                     "+v"(c9), "+v"(c10), "+v"(c11));
    }
    for (const Acc& c : {c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11}) {
      int v;
      std::memcpy(&v, &c, sizeof v);
      sink += v & 1;
    }
    ops += 2.0 * macs * 12 * static_cast<double>(iters);
  }
  const double dt = omp_get_wtime() - t0;
  return sink == -1 ? 0.0 : ops / dt / 1e9;
}

// AVX512_VNNI vpdpbusd: 64 u8 x s8 multiply-adds into int32; 0 where the build has no AVX512_VNNI.
double vnni_peak_gops(int64_t iters) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  return dot_peak(iters, _mm512_set1_epi8(3), _mm512_set1_epi8(1), _mm512_setzero_si512(), 64,
                  [](__m512i c, __m512i a, __m512i b) { return _mm512_dpbusd_epi32(c, a, b); });
#else
  return 0.0 * static_cast<double>(iters);
#endif
}

// AVX512_BF16 vdpbf16ps: 32 bf16 x bf16 multiply-adds into fp32; 0 where the build has no AVX512_BF16.
double bf16_peak_gflops(int64_t iters) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  const __m512bh one = (__m512bh)_mm512_set1_epi16(0x3f80);
  return dot_peak(iters, one, one, _mm512_setzero_ps(), 32,
                  [](__m512 c, __m512bh a, __m512bh b) { return _mm512_dpbf16_ps(c, a, b); });
#else
  return 0.0 * static_cast<double>(iters);
#endif
}

}  // namespace chunkgen
