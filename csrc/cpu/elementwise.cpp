// The fused elementwise ops of the decode forward (see elementwise.h): argument checks, the CPU
// kernels, and the hand-off to the CUDA kernels for device tensors.
//
// Bitwise contract: each op computes in fp32 and rounds to the storage dtype wherever the unfused
// torch composition stores an intermediate, so a bf16 model gives the same bits as before. Two
// details matter for that:
// - no fused multiply-add: torch rounds a product before it adds, so contraction is off below;
// - the RMSNorm's sum of squares runs in the order of ATen's CPU sum (SumKernel.cpp's cascade over
//   8-lane vectors, four interleaved accumulators): a different order changes the mean's last bit,
//   and that flips a bf16 rounding now and then.
#include "../elementwise.h"
#include "../kv_write.h"

#ifdef CHUNKGEN_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <array>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "bf16_gemm.h"
#include "vec.h"

#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace chunkgen {
namespace {

// Storage <-> fp32. bf16 as its raw bits (uint16_t: the loops never see c10::BFloat16, whose
// struct copies keep them scalar) by integer operations (round to nearest even, NaN made torch's
// quiet NaN, unlike bf16::from_float, which keeps the payload), so that loops over a row
// vectorise; fp16 through c10's conversion.
inline float load(float x) { return x; }
inline float load(uint16_t x) { return bf16::to_float(x); }
inline float load(c10::Half x) { return static_cast<float>(x); }

template <typename T>
inline T store(float f);
template <>
inline float store<float>(float f) {
  return f;
}
template <>
inline uint16_t store<uint16_t>(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  // NaN told by its bits, not a float compare: a select the vectoriser takes, not a branch.
  const bool nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
  return static_cast<uint16_t>(nan ? 0x7FC0u : rounded);
}
template <>
inline c10::Half store<c10::Half>(float f) {
  return c10::Half(f);
}

// The value a torch op would leave in storage of type T.
template <typename T>
inline float rnd(float f) {
  return load(store<T>(f));
}

// ATen's float sum of one contiguous row (vectorized_inner_sum -> row_sum -> multi_row_sum), with
// the vector width of its AVX2 kernel (8 floats): ATen registers no AVX-512 sum kernel, and its
// default and AVX2 kernels both use 8-float vectors. sq(i) gives element i.
constexpr int kLanes = 8;
using Vec = std::array<float, kLanes>;

inline void vadd(Vec& a, const Vec& b) {
  for (int l = 0; l < kLanes; ++l) a[l] += b[l];
}

template <typename Load>
inline Vec vload(const Load& sq, int64_t vec_index) {
  Vec v;
  for (int l = 0; l < kLanes; ++l) v[l] = sq(vec_index * kLanes + l);
  return v;
}

inline int64_t ceil_log2(int64_t x) {
  int64_t bits = 0;
  while ((int64_t(1) << bits) < x) ++bits;
  return bits;
}

template <typename Load>
float aten_row_sum(const Load& sq, int64_t n) {
  constexpr int64_t ilp = 4, levels = 4;
  const int64_t vec_size = n / kLanes, size = vec_size / ilp;
  // multi_row_sum over the row seen as [size, 4] vectors: chunks of level_step summed level by level.
  const int64_t level_power = std::max<int64_t>(4, ceil_log2(size) / levels);
  const int64_t level_step = int64_t(1) << level_power, level_mask = level_step - 1;
  Vec acc[levels][ilp] = {};
  int64_t i = 0;
  for (; i + level_step <= size;) {
    for (int64_t j = 0; j < level_step; ++j, ++i)
      for (int64_t k = 0; k < ilp; ++k) vadd(acc[0][k], vload(sq, i * ilp + k));
    for (int64_t j = 1; j < levels; ++j) {
      for (int64_t k = 0; k < ilp; ++k) {
        vadd(acc[j][k], acc[j - 1][k]);
        acc[j - 1][k] = Vec{};
      }
      if ((i & (level_mask << (j * level_power))) != 0) break;
    }
  }
  for (; i < size; ++i)
    for (int64_t k = 0; k < ilp; ++k) vadd(acc[0][k], vload(sq, i * ilp + k));
  for (int64_t j = 1; j < levels; ++j)
    for (int64_t k = 0; k < ilp; ++k) vadd(acc[0][k], acc[j][k]);
  // row_sum: the vectors past the last group of four, then the four partial sums.
  for (int64_t v = size * ilp; v < vec_size; ++v) vadd(acc[0][0], vload(sq, v));
  for (int64_t k = 1; k < ilp; ++k) vadd(acc[0][0], acc[0][k]);
  // vectorized_inner_sum: the scalar tail first, then the lanes in order.
  float total = 0.f;
  for (int64_t e = vec_size * kLanes; e < n; ++e) total += sq(e);
  for (int l = 0; l < kLanes; ++l) total += acc[0][0][l];
  return total;
}

// Rows are split over OpenMP threads only when there is enough work to pay for waking them: from
// 2^16 elements (the gated activations, whose exp and division cost several times an add per
// element, from 2^14). A decode step of 256 rows of SmolLM2 on one thread of a Zen 4 spent 95 us
// in a 256 x 576 add_rms_norm (two a layer), 109 us in rotary and 377 us in a 256 x 1536 silu_mul:
// about 20 ms of a 320 ms step, which two threads halve. On a busy machine a region's
// barrier can wait for a descheduled thread (20 ms a call measured at load average 10 on 2 cores),
// but a layer's products and attention already take five such regions.
constexpr int64_t kParallelElems = 1 << 16;
constexpr int64_t kParallelGatedElems = 1 << 14;

// The inverse RMS of n values (F.rms_norm: fp32 copy, pow(2) as x * x, mean = sum / n, + eps,
// rsqrt = 1 / sqrt), the sum in ATen's order.
template <typename T>
inline float inv_rms(const T* x, int64_t n, float eps) {
  const float total = aten_row_sum(
      [x](int64_t i) {
        const float v = load(x[i]);
        return v * v;
      },
      n);
  return 1.f / std::sqrt(total / static_cast<float>(n) + eps);
}

// One normed value as transformers rounds it: Llama's RMSNorm rounds x * inv to the dtype before the
// weight; Gemma's keeps fp32 through (1 + weight) and rounds once.
template <typename T>
inline float normed(T x, T w, float inv, bool offset) {
  return offset ? rnd<T>(load(x) * inv * (1.f + load(w))) : rnd<T>(rnd<T>(load(x) * inv) * load(w));
}

// The value a torch op would leave in storage of type T, a vector at a time (fp32 and bf16).
template <typename T>
inline decode::vf vrnd(decode::vf v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else if constexpr (std::is_same_v<T, uint16_t>) {
    return decode::round_bf16(v);
  } else {
    T tmp[decode::W];
    decode::store(tmp, v);
    return decode::load(tmp);
  }
}

// Whether a row's whole vectors go a vector at a time (fp32, bf16); its tail, and every fp16 row,
// element by element.
template <typename T>
constexpr bool kVectorRows = std::is_same_v<T, float> || std::is_same_v<T, uint16_t>;

template <typename T>
void add_rms_norm_cpu(T* res, const T* delta, const T* w, T* out, int64_t rows, int64_t n, int64_t rs, int64_t ds,
                      int64_t os, float eps, bool offset) {
  using decode::W;
#pragma omp parallel for if (rows * n >= kParallelElems)
  for (int64_t r = 0; r < rows; ++r) {
    T* x = res + r * rs;
    const int64_t nv = kVectorRows<T> ? n / W * W : 0;
    if (delta != nullptr) {  // residual add, rounded as torch's add
      const T* y = delta + r * ds;
      if constexpr (kVectorRows<T>)
        for (int64_t i = 0; i < nv; i += W) decode::store(x + i, decode::load(x + i) + decode::load(y + i));
      for (int64_t i = nv; i < n; ++i) x[i] = store<T>(load(x[i]) + load(y[i]));
    }
    const float inv = inv_rms(x, n, eps);
    T* o = out + r * os;
    if constexpr (kVectorRows<T>) {
      const decode::vf vinv = decode::splat(inv), one = decode::splat(1.f);
      for (int64_t i = 0; i < nv; i += W) {
        const decode::vf xv = decode::load(x + i), wv = decode::load(w + i);
        decode::store(o + i, offset ? xv * vinv * (one + wv) : vrnd<T>(xv * vinv) * wv);
      }
    }
    for (int64_t i = nv; i < n; ++i) o[i] = store<T>(normed(x[i], w[i], inv, offset));
  }
}

template <typename T, typename Q, typename P>
void rotary_cpu(T* qkv, int64_t stride, const P* pos, const T* cos, const T* sin, int64_t ts, int64_t rows, int64_t hq,
                int64_t hk, int64_t d, Q* q_out, const T* q_norm, const T* k_norm, float eps, bool offset) {
  const int64_t half = d / 2;
#pragma omp parallel for if (rows * (hq + hk) * d >= kParallelElems)
  for (int64_t r = 0; r < rows; ++r) {
    const T* c = cos + static_cast<int64_t>(pos[r]) * ts;
    const T* s = sin + static_cast<int64_t>(pos[r]) * ts;
    for (int64_t h = 0; h < hq + hk; ++h) {
      T* x = qkv + r * stride + h * d;
      float in[1024], y[1024];  // the (normed) head and its rotation (d <= 1024, checked)
      const T* w = h < hq ? q_norm : k_norm;
      if (w != nullptr) {
        const float inv = inv_rms(x, d, eps);
        for (int64_t i = 0; i < d; ++i) in[i] = normed(x[i], w[i], inv, offset);
      } else {
        for (int64_t i = 0; i < d; ++i) in[i] = load(x[i]);
      }
      for (int64_t i = 0; i < half; ++i) {
        const float a = in[i], b = in[i + half];
        y[i] = rnd<T>(rnd<T>(a * load(c[i])) + rnd<T>(-b * load(s[i])));
        y[i + half] = rnd<T>(rnd<T>(b * load(c[i + half])) + rnd<T>(a * load(s[i + half])));
      }
      if (h < hq) {
        Q* q = q_out + (r * hq + h) * d;
        for (int64_t i = 0; i < d; ++i) q[i] = store<Q>(y[i]);
      } else {
        for (int64_t i = 0; i < d; ++i) x[i] = store<T>(y[i]);
      }
    }
  }
}

// exp as ATen's vectorised CPU kernels compute it (Vectorized<float>::exp, SLEEF's 1-ulp expf with
// FMA): Cody-Waite reduction by ln 2 in two parts, a degree-6 polynomial, scaling by 2^q in two
// halves. The scalar form, for fp16 rows; fp32 and bf16 rows take vexp_u10 below, which has its bits.
inline float exp_u10(float d) {
  // q = rint(d / ln 2) from the input clamped to where the result is finite and nonzero (the ends
  // are selected below, NaN goes through s), rounded half to even by the 1.5 * 2^23 trick, which
  // is exact in this range and keeps the loop free of calls.
  const float dc = d < -104.f ? -104.f : (d > 100.f ? 100.f : (d == d ? d : 0.f));
  const float t = dc * 1.442695040888963407359924681001892137426645954152985934135449406931f;
  const float qf = (t + 12582912.f) - 12582912.f;
  const int q = static_cast<int>(qf);
  float s = std::fma(qf, -0.693145751953125f, d);
  s = std::fma(qf, -1.428606765330187045e-06f, s);
  float u = 0.000198527617612853646278381f;
  u = std::fma(u, s, 0.00139304355252534151077271f);
  u = std::fma(u, s, 0.00833336077630519866943359f);
  u = std::fma(u, s, 0.0416664853692054748535156f);
  u = std::fma(u, s, 0.166666671633720397949219f);
  u = std::fma(u, s, 0.5f);
  u = 1.f + std::fma(s * s, u, s);
  const auto pow2 = [](int e) {
    const uint32_t b = static_cast<uint32_t>(e + 127) << 23;
    float f;
    std::memcpy(&f, &b, sizeof f);
    return f;
  };
  u = u * pow2(q >> 1) * pow2(q - (q >> 1));
  u = d < -104.f ? 0.f : u;
  return d > 100.f ? INFINITY : u;
}

// exp_u10 on a vector, the operations of ATen's (SLEEF's) vectorised expf in its order, every
// fused multiply-add explicit (rint(d / ln 2) as fma(d, 1/ln 2, 1.5 * 2^23) - 1.5 * 2^23).
inline decode::vf vexp_u10(decode::vf d) {
  using decode::splat;
  using decode::vf;
  using decode::vfma;
  using decode::vi;
  const vf lo = splat(-104.f), hi = splat(100.f), magic = splat(12582912.f);
  const vf dc = d < lo ? lo : (d > hi ? hi : (d == d ? d : vf{}));
  const vf qf = vfma(dc, splat(1.442695040888963407359924681001892137426645954152985934135449406931f), magic) - magic;
  const vi q = __builtin_convertvector(qf, vi);
  vf s = vfma(qf, splat(-0.693145751953125f), d);
  s = vfma(qf, splat(-1.428606765330187045e-06f), s);
  vf u = splat(0.000198527617612853646278381f);
  u = vfma(u, s, splat(0.00139304355252534151077271f));
  u = vfma(u, s, splat(0.00833336077630519866943359f));
  u = vfma(u, s, splat(0.0416664853692054748535156f));
  u = vfma(u, s, splat(0.166666671633720397949219f));
  u = vfma(u, s, splat(0.5f));
  u = splat(1.f) + vfma(s * s, u, s);
  const vi half = q >> 1;
  u = u * (vf)((half + 127) << 23) * (vf)((q - half + 127) << 23);
  u = d < lo ? vf{} : u;
  return d > hi ? splat(INFINITY) : u;
}

// An activation of the gate (vec on a vector, one on an element) times up, a row at a time: fp32
// and bf16 rows a vector at a time, their tail as one more, padded vector (one arithmetic for the
// whole row; ATen takes its last n % 32 elements through libm instead, a rounding apart); fp16
// rows element by element.
template <typename T, typename Vec, typename One>
inline void gated_rows(const T* gu, int64_t is, T* out, int64_t os, int64_t rows, int64_t n, Vec vec, One one) {
  using decode::W;
#pragma omp parallel for if (rows * n >= kParallelGatedElems)
  for (int64_t r = 0; r < rows; ++r) {
    const T* g = gu + r * is;
    const T* u = g + n;
    T* o = out + r * os;
    if constexpr (kVectorRows<T>) {
      const auto gated = [&](const T* gv, const T* uv, T* ov) {
        decode::store(ov, vrnd<T>(vec(decode::load(gv))) * decode::load(uv));
      };
      int64_t i = 0;
      for (; i + W <= n; i += W) gated(g + i, u + i, o + i);
      if (i < n) {
        T gb[W] = {}, ub[W] = {}, ob[W];
        std::memcpy(gb, g + i, sizeof(T) * (n - i));
        std::memcpy(ub, u + i, sizeof(T) * (n - i));
        gated(gb, ub, ob);
        std::memcpy(o + i, ob, sizeof(T) * (n - i));
      }
    } else {
      for (int64_t i = 0; i < n; ++i) o[i] = store<T>(rnd<T>(one(load(g[i]))) * load(u[i]));
    }
  }
}

// SiLU as torch computes it in fp32: x / (1 + exp(-x)), rounded to T, times up.
template <typename T>
void silu_mul_cpu(const T* gu, int64_t is, T* out, int64_t os, int64_t rows, int64_t n) {
  gated_rows(
      gu, is, out, os, rows, n, [](decode::vf x) { return x / (decode::splat(1.f) + vexp_u10(-x)); },
      [](float x) { return x / (1.f + exp_u10(-x)); });
}

// GELU with the tanh approximation (transformers' gelu_pytorch_tanh, Gemma's MLP): 0.5 x (1 +
// tanh(y)) with y = sqrt(2/pi) (x + 0.044715 x^3), evaluated as x / (1 + exp(-2y)), which is the
// same function without 1 + tanh's cancellation for very negative x, rounded to T, times up.
template <typename T>
void gelu_tanh_mul_cpu(const T* gu, int64_t is, T* out, int64_t os, int64_t rows, int64_t n) {
  constexpr float kTwoBeta = 2.f * 0.7978845608028654f;  // 2 sqrt(2 / pi)
  constexpr float kKappa = 0.044715f;
  gated_rows(
      gu, is, out, os, rows, n,
      [](decode::vf x) { return x / (decode::splat(1.f) + vexp_u10(-kTwoBeta * (x + kKappa * x * x * x))); },
      [](float x) { return x / (1.f + exp_u10(-kTwoBeta * (x + kKappa * x * x * x))); });
}

// The storage dtypes the ops take (dtype_code rejects the others first).
#define CHUNKGEN_DISPATCH_MODEL_TYPES(TYPE, NAME, ...)                                                      \
  AT_DISPATCH_SWITCH(TYPE, NAME,                                                                            \
                     AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__) \
                         AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

// The element type the CPU loops take for a dispatched scalar_t: bf16 as raw bits.
template <typename T>
struct Raw {
  using type = T;
};
template <>
struct Raw<c10::BFloat16> {
  using type = uint16_t;
};
template <typename T>
using raw_t = typename Raw<T>::type;

template <typename T>
raw_t<T>* raw_ptr(const torch::Tensor& t) {
  return reinterpret_cast<raw_t<T>*>(t.data_ptr<T>());
}

// ---- argument checks ----------------------------------------------------------------------------

int dtype_code(const torch::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case torch::kFloat32:
      return 0;
    case torch::kBFloat16:
      return 1;
    case torch::kHalf:
      return 2;
    default:
      TORCH_CHECK_TYPE(false, name, " must be float32, bfloat16 or float16, got ", t.scalar_type());
  }
}

void check_rows(const torch::Tensor& t, const char* name, const torch::Tensor& like) {
  TORCH_CHECK_VALUE(t.dim() == 2 && t.stride(1) == 1, name, " must be 2-d with contiguous rows, got ", t.sizes(),
                    " strides ", t.strides());
  TORCH_CHECK_VALUE(t.device() == like.device(), name, " must be on ", like.device(), ", got ", t.device());
  TORCH_CHECK_TYPE(t.scalar_type() == like.scalar_type(), name, " must be ", like.scalar_type(), ", got ",
                   t.scalar_type());
}

#ifdef CHUNKGEN_WITH_CUDA
void* stream_of(const torch::Tensor& t) { return c10::cuda::getCurrentCUDAStream(t.device().index()).stream(); }
#endif

}  // namespace

void add_rms_norm_op(torch::Tensor& residual, const std::optional<torch::Tensor>& delta, const torch::Tensor& weight,
                     double eps, torch::Tensor& out, bool offset) {
  check_rows(residual, "residual", residual);
  check_rows(out, "out", residual);
  const int64_t rows = residual.size(0), n = residual.size(1);
  TORCH_CHECK_VALUE(out.sizes() == residual.sizes(), "out ", out.sizes(), " must be shaped like residual ",
                    residual.sizes());
  TORCH_CHECK_VALUE(weight.dim() == 1 && weight.size(0) == n && weight.is_contiguous(), "weight must be a contiguous [",
                    n, "] tensor, got ", weight.sizes());
  TORCH_CHECK_TYPE(weight.scalar_type() == residual.scalar_type() && weight.device() == residual.device(),
                   "weight must be ", residual.scalar_type(), " on ", residual.device());
  if (delta.has_value()) {
    check_rows(*delta, "delta", residual);
    TORCH_CHECK_VALUE(delta->sizes() == residual.sizes(), "delta ", delta->sizes(), " must be shaped like residual ",
                      residual.sizes());
  }
  const int dt = dtype_code(residual, "residual");
  if (rows == 0) return;
  const int64_t ds = delta.has_value() ? delta->stride(0) : 0;
  if (!residual.device().is_cpu()) {
#ifdef CHUNKGEN_WITH_CUDA
    const c10::cuda::CUDAGuard guard(residual.device());  // launch on the tensors' GPU, whichever is current
    add_rms_norm_cuda(residual.data_ptr(), delta.has_value() ? delta->data_ptr() : nullptr, weight.data_ptr(),
                      out.data_ptr(), rows, n, residual.stride(0), ds, out.stride(0), static_cast<float>(eps), offset,
                      dt, stream_of(residual));
    return;
#else
    TORCH_CHECK_VALUE(false, "chunkgen was built without CUDA kernels; residual is on ", residual.device());
#endif
  }
  CHUNKGEN_DISPATCH_MODEL_TYPES(residual.scalar_type(), "add_rms_norm", [&] {
    add_rms_norm_cpu<raw_t<scalar_t>>(
        raw_ptr<scalar_t>(residual), delta.has_value() ? raw_ptr<scalar_t>(*delta) : nullptr, raw_ptr<scalar_t>(weight),
        raw_ptr<scalar_t>(out), rows, n, residual.stride(0), ds, out.stride(0), static_cast<float>(eps), offset);
  });
  (void)dt;
}

void rotary_op(torch::Tensor& qkv, const torch::Tensor& positions, const torch::Tensor& cos, const torch::Tensor& sin,
               int64_t q_heads, int64_t kv_heads, torch::Tensor& q_out, const std::optional<torch::Tensor>& q_norm,
               const std::optional<torch::Tensor>& k_norm, double eps, bool offset_norm,
               const std::optional<torch::Tensor>& k_cache, const std::optional<torch::Tensor>& v_cache, int64_t layer,
               const std::optional<torch::Tensor>& write_slot, const std::optional<torch::Tensor>& write_offset) {
  check_rows(qkv, "qkv", qkv);
  const int dt = dtype_code(qkv, "qkv");
  const int64_t rows = qkv.size(0);
  TORCH_CHECK_VALUE(cos.dim() >= 2 && cos.sizes() == sin.sizes() && cos.strides() == sin.strides(),
                    "cos and sin must be tables shaped alike, [positions, ..., head_dim]; got ", cos.sizes(), " and ",
                    sin.sizes());
  const int64_t d = cos.size(-1), table = cos.size(0);
  TORCH_CHECK_VALUE(cos.numel() == table * d && cos.stride(-1) == 1,
                    "cos and sin must hold one contiguous row of head_dim values per position, got ", cos.sizes());
  TORCH_CHECK_TYPE(cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type(),
                   "cos and sin must be in qkv's dtype (", qkv.scalar_type(), "), got ", cos.scalar_type());
  TORCH_CHECK_VALUE(cos.device() == qkv.device() && sin.device() == qkv.device(),
                    "cos and sin must be on qkv's device");
  TORCH_CHECK_VALUE(d > 0 && d % 2 == 0 && d <= 1024, "head_dim must be even and at most 1024, got ", d);
  TORCH_CHECK_VALUE(q_heads >= 0 && kv_heads >= 0 && (q_heads + kv_heads) * d <= qkv.size(1), "qkv rows of ",
                    qkv.size(1), " values cannot hold ", q_heads, " + ", kv_heads, " heads of ", d);
  TORCH_CHECK_VALUE(positions.dim() == 1 && positions.size(0) == rows && positions.is_contiguous() &&
                        positions.device() == qkv.device(),
                    "positions must be a contiguous [", rows, "] tensor on qkv's device, got ", positions.sizes());
  TORCH_CHECK_TYPE(positions.scalar_type() == torch::kInt32 || positions.scalar_type() == torch::kInt64,
                   "positions must be int32 or int64, got ", positions.scalar_type());
  TORCH_CHECK_VALUE(q_out.dim() == 3 && q_out.size(0) == rows && q_out.size(1) == q_heads && q_out.size(2) == d &&
                        q_out.is_contiguous() && q_out.device() == qkv.device(),
                    "q_out must be a contiguous [", rows, ", ", q_heads, ", ", d, "] tensor on qkv's device, got ",
                    q_out.sizes());
  const int qt = dtype_code(q_out, "q_out");
  TORCH_CHECK_VALUE(q_norm.has_value() == k_norm.has_value(), "q_norm and k_norm go together: give both or neither");
  for (const auto* w : {&q_norm, &k_norm}) {
    if (!w->has_value()) continue;
    TORCH_CHECK_VALUE((*w)->dim() == 1 && (*w)->size(0) == d && (*w)->is_contiguous() && (*w)->device() == qkv.device(),
                      "q_norm and k_norm must be contiguous [", d, "] tensors on qkv's device, got ", (*w)->sizes());
    TORCH_CHECK_TYPE((*w)->scalar_type() == qkv.scalar_type(), "q_norm and k_norm must be in qkv's dtype (",
                     qkv.scalar_type(), "), got ", (*w)->scalar_type());
  }
  const bool writes = k_cache.has_value();
  TORCH_CHECK_VALUE(
      v_cache.has_value() == writes && write_slot.has_value() == writes && write_offset.has_value() == writes,
      "k_cache, v_cache, write_slot and write_offset go together: give all four or none");
  torch::Tensor k_layer, v_layer, k_rows, v_rows;  // with the write: the pool's layer, and the rows it takes
  if (writes) {
    TORCH_CHECK_VALUE(k_cache->dim() == 5 && v_cache->dim() == 5 && k_cache->device() == qkv.device() &&
                          v_cache->device() == qkv.device(),
                      "k_cache and v_cache must be the whole pool, [layers, slots, ...], on qkv's device; got ",
                      k_cache->sizes(), " and ", v_cache->sizes());
    TORCH_CHECK_VALUE(layer >= 0 && layer < k_cache->size(0), "layer ", layer, " is outside the pool's ",
                      k_cache->size(0), " layers");
    TORCH_CHECK_VALUE((q_heads + 2 * kv_heads) * d <= qkv.size(1), "qkv rows of ", qkv.size(1), " values cannot hold ",
                      q_heads, " + 2 x ", kv_heads, " heads of ", d, " (q, k and v)");
    for (const auto* t : {&write_slot, &write_offset}) {
      TORCH_CHECK_TYPE((*t)->scalar_type() == torch::kInt32, "write_slot and write_offset must be int32, got ",
                       (*t)->scalar_type());
      TORCH_CHECK_VALUE((*t)->dim() == 1 && (*t)->is_contiguous() && (*t)->device() == qkv.device(),
                        "write_slot and write_offset must be contiguous 1-d tensors on qkv's device");
    }
    const int64_t n = write_slot->size(0);
    TORCH_CHECK_VALUE(n <= rows, "write_slot has ", n, " rows; qkv has ", rows);
    k_layer = k_cache->select(0, layer);
    v_layer = v_cache->select(0, layer);
    k_rows = qkv.narrow(0, 0, n).narrow(1, q_heads * d, kv_heads * d).unflatten(1, {kv_heads, d});
    v_rows = qkv.narrow(0, 0, n).narrow(1, (q_heads + kv_heads) * d, kv_heads * d).unflatten(1, {kv_heads, d});
    check_write(k_rows, v_rows, k_layer, *write_slot, *write_offset);
  }
  if (rows == 0) return;
  const int64_t ts = cos.size(0) > 1 ? cos.stride(0) : d;
  const bool pos64 = positions.scalar_type() == torch::kInt64;
  if (!qkv.device().is_cpu()) {
#ifdef CHUNKGEN_WITH_CUDA
    KVWriteProblem write{};
    if (writes) {
      TORCH_CHECK_VALUE(fits_write_kernel(k_layer, v_layer, *write_slot, *write_offset),
                        "the pool's layers must be contiguous for rotary's K/V write");
      write = kv_write_problem(k_rows, v_rows, k_layer, v_layer, *write_slot, *write_offset);
    }
    const c10::cuda::CUDAGuard guard(qkv.device());
    rotary_cuda(qkv.data_ptr(), qkv.stride(0), positions.data_ptr(), pos64, cos.data_ptr(), sin.data_ptr(), ts, rows,
                q_heads, kv_heads, d, q_out.data_ptr(), qt, q_norm ? q_norm->data_ptr() : nullptr,
                k_norm ? k_norm->data_ptr() : nullptr, static_cast<float>(eps), offset_norm, dt,
                writes ? &write : nullptr, stream_of(qkv));
    return;
#else
    TORCH_CHECK_VALUE(false, "chunkgen was built without CUDA kernels; qkv is on ", qkv.device());
#endif
  }
  // Positions outside the table would read past it: checked here, on the host, at no extra cost.
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t p = pos64 ? positions.data_ptr<int64_t>()[r] : positions.data_ptr<int32_t>()[r];
    TORCH_CHECK_VALUE(p >= 0 && p < table, "position ", p, " of row ", r, " is outside the rotary table (", table,
                      " positions)");
  }
  CHUNKGEN_DISPATCH_MODEL_TYPES(qkv.scalar_type(), "rotary", [&] {
    using S = scalar_t;
    using T = raw_t<S>;
    CHUNKGEN_DISPATCH_MODEL_TYPES(q_out.scalar_type(), "rotary_q", [&] {
      using Q = raw_t<scalar_t>;
      const T* qn = q_norm ? raw_ptr<S>(*q_norm) : nullptr;
      const T* kn = k_norm ? raw_ptr<S>(*k_norm) : nullptr;
      const float e = static_cast<float>(eps);
      if (pos64)
        rotary_cpu<T, Q>(raw_ptr<S>(qkv), qkv.stride(0), positions.data_ptr<int64_t>(), raw_ptr<S>(cos),
                         raw_ptr<S>(sin), ts, rows, q_heads, kv_heads, d, raw_ptr<scalar_t>(q_out), qn, kn, e,
                         offset_norm);
      else
        rotary_cpu<T, Q>(raw_ptr<S>(qkv), qkv.stride(0), positions.data_ptr<int32_t>(), raw_ptr<S>(cos),
                         raw_ptr<S>(sin), ts, rows, q_heads, kv_heads, d, raw_ptr<scalar_t>(q_out), qn, kn, e,
                         offset_norm);
    });
  });
  if (writes) write_kv(k_rows, v_rows, k_layer, v_layer, *write_slot, *write_offset);  // the rotated k
  (void)dt;
  (void)qt;
}

namespace {

// SiLU or tanh-GELU of the gate times up: one checked entry point for both activations.
void gated_mul(const torch::Tensor& gate_up, torch::Tensor& out, bool gelu) {
  check_rows(gate_up, "gate_up", gate_up);
  check_rows(out, "out", gate_up);
  const int dt = dtype_code(gate_up, "gate_up");
  const int64_t rows = gate_up.size(0), n = out.size(1);
  TORCH_CHECK_VALUE(out.size(0) == rows && gate_up.size(1) == 2 * n, "gate_up ", gate_up.sizes(),
                    " must be [rows, 2n] for out [rows, n], got out ", out.sizes());
  if (rows == 0) return;
  if (!gate_up.device().is_cpu()) {
#ifdef CHUNKGEN_WITH_CUDA
    const c10::cuda::CUDAGuard guard(gate_up.device());
    (gelu ? gelu_tanh_mul_cuda : silu_mul_cuda)(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), out.stride(0),
                                                rows, n, dt, stream_of(gate_up));
    return;
#else
    TORCH_CHECK_VALUE(false, "chunkgen was built without CUDA kernels; gate_up is on ", gate_up.device());
#endif
  }
  CHUNKGEN_DISPATCH_MODEL_TYPES(gate_up.scalar_type(), "gated_mul", [&] {
    using T = raw_t<scalar_t>;
    (gelu ? gelu_tanh_mul_cpu<T> : silu_mul_cpu<T>)(raw_ptr<scalar_t>(gate_up), gate_up.stride(0),
                                                    raw_ptr<scalar_t>(out), out.stride(0), rows, n);
  });
  (void)dt;
}

}  // namespace

void silu_mul_op(const torch::Tensor& gate_up, torch::Tensor& out) { gated_mul(gate_up, out, false); }

void gelu_tanh_mul_op(const torch::Tensor& gate_up, torch::Tensor& out) { gated_mul(gate_up, out, true); }

}  // namespace chunkgen
