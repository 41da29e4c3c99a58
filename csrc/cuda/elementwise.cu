// The fused elementwise ops of the decode forward on the GPU (see elementwise.h). The same roundings
// as the CPU kernels: fp32 math, a product rounded to the storage dtype before it is added (the
// explicit __fmul_rn / __fadd_rn keep nvcc from contracting them into an FMA, even under fast math).
// The RMSNorm's sum of squares is a block reduction here, so its last bit may differ from the CPU's.
#include <cstdint>
#include <type_traits>

#include "../attention.h"
#include "device.cuh"

namespace chunkgen {
namespace {

template <typename T>
__device__ __forceinline__ float rnd(float f) {
  return to_float(from_float<T>(f));
}

constexpr int kThreads = 256;
constexpr size_t kNormSmem = (kThreads / 32 + 1) * sizeof(float);

// One block per row: the residual add, the sum of squares, then the normalised, weighted row.
// One normed value as transformers rounds it (see the CPU kernel): Llama's norm rounds x * inv
// before the weight; Gemma's (offset) multiplies by 1 + weight in fp32 and rounds once.
template <typename T>
__device__ __forceinline__ float normed(T x, T w, float inv, bool offset) {
  const float v = __fmul_rn(to_float(x), inv);
  return offset ? rnd<T>(__fmul_rn(v, __fadd_rn(1.f, to_float(w)))) : rnd<T>(__fmul_rn(rnd<T>(v), to_float(w)));
}

__device__ __forceinline__ float inv_rms(float sum_sq, int64_t n, float eps) {
  return __fdiv_rn(1.f, __fsqrt_rn(__fadd_rn(__fdiv_rn(sum_sq, static_cast<float>(n)), eps)));
}

template <typename T>
__global__ void add_rms_norm_kernel(T* res, const T* delta, const T* w, T* out, int64_t n, int64_t rs, int64_t ds,
                                    int64_t os, float eps, bool offset) {
  const int64_t r = blockIdx.x;
  T* x = res + r * rs;
  float part = 0.f;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    float v = to_float(x[i]);
    if (delta != nullptr) {
      v = rnd<T>(__fadd_rn(v, to_float(delta[r * ds + i])));
      x[i] = from_float<T>(v);
    }
    part = __fadd_rn(part, __fmul_rn(v, v));
  }
  // Dynamic shared memory (kNormSmem): each warp's sum, then the row's 1 / rms.
  float* sums = reinterpret_cast<float*>(shared_bytes());
  for (int off = 16; off > 0; off >>= 1) part += __shfl_down_sync(0xffffffffu, part, off);
  if (threadIdx.x % 32 == 0) sums[threadIdx.x / 32] = part;
  __syncthreads();
  if (threadIdx.x == 0) {
    float total = 0.f;
    for (int i = 0; i < kThreads / 32; ++i) total += sums[i];
    sums[kThreads / 32] = inv_rms(total, n, eps);
  }
  __syncthreads();
  const float inv = sums[kThreads / 32];
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x)
    out[r * os + i] = from_float<T>(normed(x[i], w[i], inv, offset));
}

// The step's K/V write fused into rotary (kv.rows > 0; see KVWriteProblem): rows below kv.rows store
// their rotated k pair and, from the v heads that follow the k heads in qkv, their v pair in the
// pool, as csrc/cuda/kv_write.cu stores them. The pool's dtype is a branch uniform over the grid.
__device__ __forceinline__ void store_pool(void* base, int64_t i, KVType type, float f) {
  if (type == KVType::F32)
    static_cast<float*>(base)[i] = f;
  else if (type == KVType::BF16)
    static_cast<__nv_bfloat16*>(base)[i] = from_float<__nv_bfloat16>(f);
  else
    static_cast<__half*>(base)[i] = from_float<__half>(f);
}

// Element (t, offset) of row r's kv head h in the pool: K heads are [d, chunk], V heads [chunk, d].
__device__ __forceinline__ int64_t pool_head(const KVWriteProblem& w, int64_t r, int64_t h) {
  return (static_cast<int64_t>(w.slot[r]) * w.kv_heads + h) * w.head_dim * w.chunk;
}

__device__ __forceinline__ void store_k_pair(const KVWriteProblem& w, int64_t r, int64_t h, int64_t i, int64_t half,
                                             float lo, float hi) {
  const int64_t base = pool_head(w, r, h) + w.offset[r];
  store_pool(w.k_layer, base + i * w.chunk, w.pool_type, lo);
  store_pool(w.k_layer, base + (i + half) * w.chunk, w.pool_type, hi);
}

template <typename T>
__device__ __forceinline__ void store_v_pair(const KVWriteProblem& w, const T* v, int64_t r, int64_t h, int64_t i,
                                             int64_t half) {
  const int64_t base = pool_head(w, r, h) + static_cast<int64_t>(w.offset[r]) * w.head_dim;
  store_pool(w.v_layer, base + i, w.pool_type, to_float(v[i]));
  store_pool(w.v_layer, base + i + half, w.pool_type, to_float(v[i + half]));
}

// One thread per (row, head, pair i / i + d/2): both halves of the pair are read before either is
// written, so the rotation is safe in place. Heads: the q and k heads, then, when the K/V are
// written here, the v heads (copied, not rotated).
// Rotates the pair (a, b) = (x[i], x[i + half]) of head h of row r by its position's cos and sin,
// rounding each product and the sum to T as the CPU kernel does; a q head goes to q_out, a k head
// back in place (and to the pool when the step's K/V are written here).
template <typename T, typename Q>
__device__ __forceinline__ void rotate_pair(T* x, const T* c, const T* s, float a, float b, int64_t r, int64_t h,
                                            int64_t i, int64_t half, int64_t hq, int64_t d, Q* q_out,
                                            const KVWriteProblem& kv) {
  const float lo = rnd<T>(__fadd_rn(rnd<T>(__fmul_rn(a, to_float(c[i]))), rnd<T>(__fmul_rn(-b, to_float(s[i])))));
  const float hi =
      rnd<T>(__fadd_rn(rnd<T>(__fmul_rn(b, to_float(c[i + half]))), rnd<T>(__fmul_rn(a, to_float(s[i + half])))));
  if (h < hq) {
    Q* q = q_out + (r * hq + h) * d;
    q[i] = from_float<Q>(lo);
    q[i + half] = from_float<Q>(hi);
  } else {
    x[i] = from_float<T>(lo);
    x[i + half] = from_float<T>(hi);
    if (r < kv.rows) store_k_pair(kv, r, h - hq, i, half, lo, hi);
  }
}

template <typename T, typename Q, typename P>
__global__ void rotary_kernel(T* qkv, int64_t stride, const P* pos, const T* cos, const T* sin, int64_t ts,
                              int64_t rows, int64_t hq, int64_t hk, int64_t d, Q* q_out, KVWriteProblem kv) {
  const int64_t half = d / 2, heads = hq + hk + (kv.rows > 0 ? hk : 0);
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= rows * heads * half) return;
  const int64_t i = idx % half, h = (idx / half) % heads, r = idx / (half * heads);
  T* x = qkv + r * stride + h * d;
  if (h >= hq + hk) {
    if (r < kv.rows) store_v_pair(kv, x, r, h - hq - hk, i, half);
    return;
  }
  const T* c = cos + static_cast<int64_t>(pos[r]) * ts;
  const T* s = sin + static_cast<int64_t>(pos[r]) * ts;
  rotate_pair(x, c, s, to_float(x[i]), to_float(x[i + half]), r, h, i, half, hq, d, q_out, kv);
}

// With q/k norms: one warp per (row, head). The warp sums the head's squares (every lane ends with
// the total), then each lane norms and rotates its own pairs: a pair is read only by the lane that
// writes it, and all reads of the sum come before the shuffle, so the head is safe in place. When
// the K/V are written here, the v heads follow (a warp copies one).
template <typename T, typename Q, typename P>
__global__ void norm_rotary_kernel(T* qkv, int64_t stride, const P* pos, const T* cos, const T* sin, int64_t ts,
                                   int64_t rows, int64_t hq, int64_t hk, int64_t d, Q* q_out, const T* qn, const T* kn,
                                   float eps, bool offset, KVWriteProblem kv) {
  const int64_t heads = hq + hk + (kv.rows > 0 ? hk : 0);
  const int64_t head = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (head >= rows * heads) return;  // the whole warp leaves together
  const int lane = threadIdx.x % 32;
  const int64_t h = head % heads, r = head / heads, half = d / 2;
  T* x = qkv + r * stride + h * d;
  if (h >= hq + hk) {  // a v head: the whole warp takes this branch, before any shuffle
    if (r < kv.rows)
      for (int64_t i = lane; i < half; i += 32) store_v_pair(kv, x, r, h - hq - hk, i, half);
    return;
  }
  float part = 0.f;
  for (int64_t i = lane; i < d; i += 32) part = __fadd_rn(part, __fmul_rn(to_float(x[i]), to_float(x[i])));
  for (int off = 16; off > 0; off >>= 1) part += __shfl_xor_sync(0xffffffffu, part, off);
  const float inv = inv_rms(part, d, eps);
  const T* w = h < hq ? qn : kn;
  const T* c = cos + static_cast<int64_t>(pos[r]) * ts;
  const T* s = sin + static_cast<int64_t>(pos[r]) * ts;
  for (int64_t i = lane; i < half; i += 32) {
    const float a = normed(x[i], w[i], inv, offset), b = normed(x[i + half], w[i + half], inv, offset);
    rotate_pair(x, c, s, a, b, r, h, i, half, hq, d, q_out, kv);
  }
}

template <typename T>
__global__ void silu_mul_kernel(const T* gu, int64_t is, T* out, int64_t os, int64_t rows, int64_t n) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= rows * n) return;
  const int64_t r = idx / n, i = idx % n;
  const float g = to_float(gu[r * is + i]);
  const float silu = rnd<T>(__fdiv_rn(g, __fadd_rn(1.f, expf(-g))));
  out[r * os + i] = from_float<T>(__fmul_rn(silu, to_float(gu[r * is + n + i])));
}

template <typename T>
__global__ void gelu_tanh_mul_kernel(const T* gu, int64_t is, T* out, int64_t os, int64_t rows, int64_t n) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= rows * n) return;
  const int64_t r = idx / n, i = idx % n;
  const float x = to_float(gu[r * is + i]);
  // 0.5 x (1 + tanh(y)) as x / (1 + exp(-2y)), the CPU kernel's form: 1 + tanh(y) cancels for
  // negative y and loses the small products' digits.
  const float two_y = 2.f * 0.7978845608028654f * (x + 0.044715f * x * x * x);
  const float gelu = rnd<T>(__fdiv_rn(x, __fadd_rn(1.f, expf(-two_y))));
  out[r * os + i] = from_float<T>(__fmul_rn(gelu, to_float(gu[r * is + n + i])));
}

unsigned blocks_for(int64_t items) { return static_cast<unsigned>((items + kThreads - 1) / kThreads); }

template <typename F>
void by_dtype(int dtype, F&& f) {
  if (dtype == 0)
    f(float{});
  else if (dtype == 1)
    f(__nv_bfloat16{});
  else
    f(__half{});
}

}  // namespace

void add_rms_norm_cuda(void* residual, const void* delta, const void* weight, void* out, int64_t rows, int64_t n,
                       int64_t res_stride, int64_t delta_stride, int64_t out_stride, float eps, bool offset, int dtype,
                       void* stream) {
  by_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    CHUNKGEN_LAUNCH(add_rms_norm_kernel<T>, static_cast<unsigned>(rows), kThreads, kNormSmem,
                    static_cast<cudaStream_t>(stream), static_cast<T*>(residual), static_cast<const T*>(delta),
                    static_cast<const T*>(weight), static_cast<T*>(out), n, res_stride, delta_stride, out_stride, eps,
                    offset);
  });
}

void rotary_cuda(void* qkv, int64_t qkv_stride, const void* positions, bool pos64, const void* cos, const void* sin,
                 int64_t table_stride, int64_t rows, int64_t q_heads, int64_t kv_heads, int64_t d, void* q_out,
                 int q_out_dtype, const void* q_norm, const void* k_norm, float eps, bool offset_norm, int dtype,
                 const KVWriteProblem* write, void* stream) {
  KVWriteProblem kv{};  // rows 0: nothing written
  if (write != nullptr) kv = *write;
  const int64_t heads = q_heads + kv_heads + (kv.rows > 0 ? kv_heads : 0);
  const unsigned grid = q_norm != nullptr ? blocks_for(rows * heads * 32) : blocks_for(rows * heads * (d / 2));
  by_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    by_dtype(q_out_dtype, [&](auto qtag) {
      using Q = decltype(qtag);
      auto launch = [&](auto* pos) {
        const auto cuda_stream = static_cast<cudaStream_t>(stream);
        using P = std::remove_const_t<std::remove_pointer_t<decltype(pos)>>;
        const auto norm_kernel = norm_rotary_kernel<T, Q, P>;  // one name: the launch macro splits on commas
        const auto plain_kernel = rotary_kernel<T, Q, P>;
        if (q_norm != nullptr)
          CHUNKGEN_LAUNCH(norm_kernel, grid, kThreads, 0, cuda_stream, static_cast<T*>(qkv), qkv_stride, pos,
                          static_cast<const T*>(cos), static_cast<const T*>(sin), table_stride, rows, q_heads, kv_heads,
                          d, static_cast<Q*>(q_out), static_cast<const T*>(q_norm), static_cast<const T*>(k_norm), eps,
                          offset_norm, kv);
        else
          CHUNKGEN_LAUNCH(plain_kernel, grid, kThreads, 0, cuda_stream, static_cast<T*>(qkv), qkv_stride, pos,
                          static_cast<const T*>(cos), static_cast<const T*>(sin), table_stride, rows, q_heads, kv_heads,
                          d, static_cast<Q*>(q_out), kv);
      };
      if (pos64)
        launch(static_cast<const int64_t*>(positions));
      else
        launch(static_cast<const int32_t*>(positions));
    });
  });
}

void silu_mul_cuda(const void* gate_up, int64_t in_stride, void* out, int64_t out_stride, int64_t rows, int64_t n,
                   int dtype, void* stream) {
  by_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    CHUNKGEN_LAUNCH(silu_mul_kernel<T>, blocks_for(rows * n), kThreads, 0, static_cast<cudaStream_t>(stream),
                    static_cast<const T*>(gate_up), in_stride, static_cast<T*>(out), out_stride, rows, n);
  });
}

void gelu_tanh_mul_cuda(const void* gate_up, int64_t in_stride, void* out, int64_t out_stride, int64_t rows, int64_t n,
                        int dtype, void* stream) {
  by_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    CHUNKGEN_LAUNCH(gelu_tanh_mul_kernel<T>, blocks_for(rows * n), kThreads, 0, static_cast<cudaStream_t>(stream),
                    static_cast<const T*>(gate_up), in_stride, static_cast<T*>(out), out_stride, rows, n);
  });
}

}  // namespace chunkgen
