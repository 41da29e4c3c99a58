// Row argmax on the CPU (csrc/argmax.h). torch.max(x, -1) over a step's logits [32, 49152] takes
// 0.4-0.9 ms here, single-threaded, and needs fp32 logits (a further copy) to be fast; two
// vectorisable passes over each row, rows split over threads, take a few tens of microseconds.
#include "../argmax.h"

#include <omp.h>

#include "intrinsics.h"

#include <cstdint>
#include <cstring>
#include <limits>

#include "bf16_gemm.h"

namespace chunkgen {
namespace {

inline float value(float x) { return x; }
inline float value(c10::BFloat16 x) { return bf16::to_float(x.x); }

#if defined(__AVX512F__)
inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load16(const c10::BFloat16* x) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

template <typename T>
int64_t row_argmax(const T* x, int64_t n) {
  // Pass 1: the maximum, and whether there is a NaN (whose first index is then the answer).
  float m = -std::numeric_limits<float>::infinity();
  bool nan = false;
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 m0 = _mm512_set1_ps(m), m1 = m0;
  __mmask16 unordered = 0;
  for (; i + 32 <= n; i += 32) {
    const __m512 a = load16(x + i), b = load16(x + i + 16);
    m0 = _mm512_max_ps(m0, a);
    m1 = _mm512_max_ps(m1, b);
    unordered |= _mm512_cmp_ps_mask(a, b, _CMP_UNORD_Q);
  }
  m = _mm512_reduce_max_ps(_mm512_max_ps(m0, m1));
  nan = unordered != 0;
#endif
  for (; i < n; ++i) {
    const float v = value(x[i]);
    m = v > m ? v : m;
    nan |= v != v;
  }
  // Pass 2: the first index holding it (or the first NaN).
  i = 0;
#if defined(__AVX512F__)
  const __m512 mv = _mm512_set1_ps(m);
  for (; i + 16 <= n; i += 16) {
    const __m512 v = load16(x + i);
    const __mmask16 hit = nan ? _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) : _mm512_cmp_ps_mask(v, mv, _CMP_EQ_OQ);
    if (hit) return i + __builtin_ctz(hit);
  }
#endif
  for (; i < n; ++i) {
    const float v = value(x[i]);
    if (nan ? v != v : v == m) return i;
  }
  return 0;  // an all -inf row gives its first element, as torch
}

}  // namespace

torch::Tensor argmax_rows_op(const torch::Tensor& x) {
  TORCH_CHECK_VALUE(x.device().is_cpu(), "argmax_rows: x must be on the CPU, got ", x.device());
  TORCH_CHECK_VALUE(x.dim() == 2 && x.stride(1) == 1 && x.size(1) > 0,
                    "argmax_rows: x must be [rows, n > 0] with contiguous rows, got ", x.sizes(), " strides ",
                    x.strides());
  TORCH_CHECK_TYPE(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16,
                   "argmax_rows: x must be float32 or bfloat16, got ", x.scalar_type());
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  auto out = torch::empty({rows}, x.options().dtype(torch::kInt64));
  int64_t* o = out.data_ptr<int64_t>();
  const bool parallel = rows > 1 && rows * n >= (int64_t{1} << 16);
  if (x.scalar_type() == torch::kFloat32) {
    const float* p = x.data_ptr<float>();
#pragma omp parallel for if (parallel)
    for (int64_t r = 0; r < rows; ++r) o[r] = row_argmax(p + r * stride, n);
  } else {
    const c10::BFloat16* p = x.data_ptr<c10::BFloat16>();
#pragma omp parallel for if (parallel)
    for (int64_t r = 0; r < rows; ++r) o[r] = row_argmax(p + r * stride, n);
  }
  return out;
}

}  // namespace chunkgen
