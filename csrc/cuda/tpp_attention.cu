// Two-phase partition decode attention on CUDA, behind the same DecodeProblem as the CPU kernel.
// The index arrays in the problem point to device memory (uploaded by the binding when the kernel
// context changes). No torch headers here: CI compiles this file with plain nvcc.
//
// Phase 1: one block per (shared chunk, KV head); its warps take the covered query rows (sequences
// times the GQA group) and write partial (o, m, l) rows. Phase 2: one warp per (sequence, query
// head): merge the shared partials, continue over the private chunks, normalise.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "../attention.h"

namespace chunkgen {
namespace {

constexpr int kWarps = 4;
constexpr int kMaxDimsPerLane = 8;  // head_dim <= 256

template <typename T>
__device__ __forceinline__ float to_float(T x);
template <>
__device__ __forceinline__ float to_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }

__device__ __forceinline__ float warp_max(float v) {
  for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}
__device__ __forceinline__ float warp_sum(float v) {
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

struct RowState {
  float o[kMaxDimsPerLane];  // lane owns dims lane, lane + 32, ...
  float m, l;
  __device__ void reset() {
    for (int i = 0; i < kMaxDimsPerLane; ++i) o[i] = 0.f;
    m = -INFINITY;
    l = 0.f;
  }
};

// One warp folds the first n tokens of a chunk into a row's state. q_s: the scaled query (shared
// memory, d floats); p_s: C floats of per-warp scratch. K is [d, C] (transposed), V is [C, d].
template <typename T>
__device__ void warp_attend(const float* q_s, const T* kt, const T* v, int n, int C, int d,
                            RowState& st, float* p_s) {
  const int lane = threadIdx.x & 31;
  float mx = -INFINITY;
  for (int j = lane; j < n; j += 32) {
    float s = 0.f;
    for (int t = 0; t < d; ++t) s += q_s[t] * to_float(kt[t * C + j]);  // lanes read along a K row
    p_s[j] = s;
    mx = fmaxf(mx, s);
  }
  mx = warp_max(mx);
  const float mnew = fmaxf(st.m, mx);
  float sum = 0.f;
  for (int j = lane; j < n; j += 32) {
    const float e = __expf(p_s[j] - mnew);
    p_s[j] = e;
    sum += e;
  }
  sum = warp_sum(sum);
  __syncwarp();
  const float alpha = __expf(st.m - mnew);
  for (int i = 0; i < kMaxDimsPerLane; ++i) {
    const int dim = lane + 32 * i;
    if (dim >= d) break;
    float acc = st.o[i] * alpha;
    for (int j = 0; j < n; ++j) acc += p_s[j] * to_float(v[j * d + dim]);
    st.o[i] = acc;
  }
  st.l = st.l * alpha + sum;
  st.m = mnew;
  __syncwarp();
}

__device__ void load_query(const float* q, float scale, int d, float* q_s) {
  const int lane = threadIdx.x & 31;
  for (int t = lane; t < d; t += 32) q_s[t] = q[t] * scale;
  __syncwarp();
}

template <typename T>
__global__ void chunk_first_kernel(DecodeProblem p, const int32_t* part_off, float* part_o,
                                   float* part_m, float* part_l) {
  extern __shared__ float smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  const int Hk = p.kv_heads, G = p.q_heads / Hk, d = p.head_dim, C = p.chunk;
  const int c = blockIdx.x / Hk, h = blockIdx.x % Hk;
  float* q_s = smem + warp * (d + C);
  float* p_s = q_s + d;
  const int begin = p.shared_begin[c], end = p.shared_end[c], n = p.shared_len[c];
  const size_t head_elems = static_cast<size_t>(d) * C;
  const size_t off = static_cast<size_t>(p.shared_slot[c]) * Hk * head_elems + h * head_elems;
  const T* kt = static_cast<const T*>(p.k) + off;
  const T* v = static_cast<const T*>(p.v) + off;
  RowState st;
  for (int r = warp; r < (end - begin) * G; r += kWarps) {
    const int b = begin + r / G, qh = h * G + r % G;
    load_query(p.q + (static_cast<size_t>(b) * p.q_heads + qh) * d, p.scale, d, q_s);
    st.reset();
    warp_attend<T>(q_s, kt, v, n, C, d, st, p_s);
    const size_t pr = static_cast<size_t>(part_off[c] + b - begin) * p.q_heads + qh;
    for (int i = 0; i < kMaxDimsPerLane && lane + 32 * i < d; ++i) part_o[pr * d + lane + 32 * i] = st.o[i];
    if (lane == 0) {
      part_m[pr] = st.m;
      part_l[pr] = st.l;
    }
  }
}

template <typename T>
__global__ void sequence_first_kernel(DecodeProblem p, const int32_t* part_off, const float* part_o,
                                      const float* part_m, const float* part_l) {
  extern __shared__ float smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  const int row = blockIdx.x * kWarps + warp;
  if (row >= p.batch * p.q_heads) return;
  const int Hq = p.q_heads, Hk = p.kv_heads, G = Hq / Hk, d = p.head_dim, C = p.chunk;
  const int b = row / Hq, qh = row % Hq, h = qh / G;
  float* q_s = smem + warp * (d + C);
  float* p_s = q_s + d;
  load_query(p.q + static_cast<size_t>(row) * d, p.scale, d, q_s);
  RowState st;
  st.reset();
  const size_t head_elems = static_cast<size_t>(d) * C;
  const T* K = static_cast<const T*>(p.k);
  const T* V = static_cast<const T*>(p.v);
  for (int i = p.seq_shared_ptr[b]; i < p.seq_shared_ptr[b + 1]; ++i) {
    const int c = p.seq_shared_idx[i];
    if (p.chunk_first) {
      const size_t pr = static_cast<size_t>(part_off[c] + b - p.shared_begin[c]) * Hq + qh;
      const float pl = part_l[pr];
      if (pl == 0.f) continue;
      const float pm = part_m[pr], mn = fmaxf(st.m, pm);
      const float a = __expf(st.m - mn), bb = __expf(pm - mn);
      for (int k = 0; k < kMaxDimsPerLane && lane + 32 * k < d; ++k)
        st.o[k] = st.o[k] * a + part_o[pr * d + lane + 32 * k] * bb;
      st.l = st.l * a + pl * bb;
      st.m = mn;
    } else {
      const size_t off = static_cast<size_t>(p.shared_slot[c]) * Hk * head_elems + h * head_elems;
      warp_attend<T>(q_s, K + off, V + off, p.shared_len[c], C, d, st, p_s);
    }
  }
  const int np = p.priv_count[b];
  for (int i = 0; i < np; ++i) {
    const int slot = p.priv_slot[static_cast<size_t>(b) * p.priv_stride + i];
    const int n = i + 1 == np ? p.priv_last_len[b] : C;
    if (n <= 0) continue;
    const size_t off = static_cast<size_t>(slot) * Hk * head_elems + h * head_elems;
    warp_attend<T>(q_s, K + off, V + off, n, C, d, st, p_s);
  }
  const float inv = st.l > 0.f ? 1.f / st.l : 0.f;
  for (int k = 0; k < kMaxDimsPerLane && lane + 32 * k < d; ++k)
    p.out[static_cast<size_t>(row) * d + lane + 32 * k] = st.o[k] * inv;
}

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(err));
}

template <typename T>
void launch(const DecodeProblem& p, const int32_t* part_off, float* part_o, float* part_m,
            float* part_l, cudaStream_t stream) {
  const size_t smem = sizeof(float) * kWarps * (p.head_dim + p.chunk);
  if (p.chunk_first && p.num_shared > 0) {
    chunk_first_kernel<T><<<p.num_shared * p.kv_heads, 32 * kWarps, smem, stream>>>(p, part_off, part_o,
                                                                                  part_m, part_l);
    check(cudaGetLastError(), "chunk-first kernel launch");
  }
  const int rows = p.batch * p.q_heads;
  sequence_first_kernel<T><<<(rows + kWarps - 1) / kWarps, 32 * kWarps, smem, stream>>>(
      p, part_off, part_o, part_m, part_l);
  check(cudaGetLastError(), "sequence-first kernel launch");
}

}  // namespace

void decode_attention_cuda_raw(const DecodeProblem& p, const int32_t* part_off, float* part_o,
                               float* part_m, float* part_l, void* stream) {
  if (p.head_dim > 32 * kMaxDimsPerLane) throw std::invalid_argument("head_dim > 256 is not supported on CUDA");
  auto s = static_cast<cudaStream_t>(stream);
  switch (p.kv_type) {
    case KVType::F32: launch<float>(p, part_off, part_o, part_m, part_l, s); break;
    case KVType::F16: launch<__half>(p, part_off, part_o, part_m, part_l, s); break;
    case KVType::BF16: launch<__nv_bfloat16>(p, part_off, part_o, part_m, part_l, s); break;
  }
}

}  // namespace chunkgen
