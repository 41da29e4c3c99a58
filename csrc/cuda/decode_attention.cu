// Two-phase partition decode attention on CUDA, behind the same DecodeProblem as the CPU kernel.
// The index arrays in the problem point to device memory (uploaded by the binding when the kernel
// context changes). No torch headers here: CI compiles this file with plain nvcc.
//
// Phase 1 (chunk-first), one block per (shared chunk, KV head, row group): a chunk's covered query
// rows (sequences x GQA group) in groups of up to 4 tiles of 16, a tile per warp. Where chunks x
// heads x groups would fill more than two waves of SMs, the chunks of a run of the tree (those that
// cover the same rows) go in segments: the block of a segment's first chunk walks its chunks, the
// warps sharing each chunk's K/V in shared memory (cp.async copies, the next chunk's in flight while
// this one is multiplied where two stages fit), and each warp keeps an online softmax over them;
// scores and the weighted sum are tensor-core products (fp16/bf16 in, fp32 accumulate). Each
// row leaves one partial (o, m, l) a segment; the segment's other chunks leave theirs empty (l = 0).
// fp32 K/V take a SIMT path, one partial a chunk.
// Phase 2 (sequence-first), one block per (sequence, KV head), or `splits` of them where those
// alone would fill less than two waves of SMs: the warps share out the work items of the sequence
// (shared partials to merge, or shared chunks to read in the paged mode, then private chunks),
// each keeping a running (o, m, l) for the whole GQA group; a final reduction across warps merges
// them and normalises, or, split, leaves each block's sums for a merge kernel (flash-decoding).
//
// Batch-invariant (p.invariant, csrc/invariant.h): phase 1 also reads every private chunk, a block a
// (row, chunk, KV head), so each chunk of a row's path leaves the row one partial made by the same
// code whether other rows share the chunk or not; no segments, no splits; phase 2 merges the
// partials in path order, dealt to its warps by the row's own chunk count. Nothing a row computes
// then depends on the rows beside it.
//
// Sliding windows and soft-capping (Masked kernels; full attention instantiates without them): a
// row's position is the sum of its path's chunk lengths, read from the index arrays on the device.
// A block or warp whose rows' windows all start past a chunk does not read it; partly covered
// chunks mask per row, and the sequence-first phase leaves out the partials of chunks before the
// row's window (a chunk-first block that skipped its chunk wrote none).
//
// Partials are laid out per (chunk, KV head) with the chunk's rows contiguous:
//   row(c, h, r) = part_off[c] * q_heads + h * rows_c + r,  rows_c = (end_c - begin_c) * G,
//   r = (sequence - begin_c) * G + g.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "../attention.h"
#include "device.cuh"

namespace chunkgen {
namespace {

namespace wmma = nvcuda::wmma;

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kTile = 16;      // query rows per tensor-core tile (the m of m16n16k16)
constexpr int kHeadBlock = 4;  // GQA heads whose scores share one read of K (and of V)
constexpr int kMaxHeadDim = 256;

__device__ __forceinline__ float warp_max(float v) {
  for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}
__device__ __forceinline__ float warp_sum(float v) {
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

// exp(a - b) that treats an empty state (m = -inf) as weight 0 instead of NaN.
__device__ __forceinline__ float rescale(float a, float b) { return a == -INFINITY ? 0.f : __expf(a - b); }

__host__ __device__ constexpr size_t align128(size_t bytes) { return (bytes + 127) / 128 * 128; }

__device__ __forceinline__ size_t head_offset(int slot, int h, int kv_heads, int d, int C) {
  return (static_cast<size_t>(slot) * kv_heads + h) * d * C;
}

// Tokens on row b's path before its private chunks, and in all: its current token is at position
// all - 1 and, with a window W, its window starts at max(0, all - W).
struct RowExtent {
  int shared, all;
};
__device__ __forceinline__ RowExtent row_extent(const DecodeProblem& p, int b) {
  RowExtent e{0, 0};
  for (int i = p.seq_shared_ptr[b]; i < p.seq_shared_ptr[b + 1]; ++i) e.shared += p.shared_len[p.seq_shared_idx[i]];
  const int np = p.priv_count[b];
  e.all = e.shared + (np > 0 ? (np - 1) * p.chunk + p.priv_last_len[b] : 0);
  return e;
}
__device__ __forceinline__ int window_start(const DecodeProblem& p, int b) {
  const int start = row_extent(p, b).all - p.window;
  return p.window > 0 && start > 0 ? start : 0;
}
// First position of shared chunk c (the same on every row that reads it: one node of the tree);
// 0 for an unused entry (no rows).
__device__ __forceinline__ int shared_position(const DecodeProblem& p, int c) {
  const int b = p.shared_begin[c];
  int pos = 0;
  if (b >= p.shared_end[c]) return 0;
  for (int i = p.seq_shared_ptr[b]; i < p.seq_shared_ptr[b + 1] && p.seq_shared_idx[i] != c; ++i)
    pos += p.shared_len[p.seq_shared_idx[i]];
  return pos;
}
// cap * tanh(s / cap), Gemma 2's logit soft-capping.
__device__ __forceinline__ float soft_cap(float s, float cap) { return cap * tanhf(s / cap); }

__device__ __forceinline__ size_t part_row(const DecodeProblem& p, const int32_t* part_off, int c, int h, int seq,
                                           int g) {
  const int G = p.q_heads / p.kv_heads, n_seqs = p.shared_end[c] - p.shared_begin[c];
  return static_cast<size_t>(part_off[c]) * p.q_heads + static_cast<size_t>(h) * n_seqs * G +
         (seq - p.shared_begin[c]) * G + g;
}

// ---- SIMT: one warp, one sequence, the G query heads of one KV head -----------------------------

// q and out are fp32 or the pool's dtype T (the model's): a branch uniform over the whole grid,
// loads convert to fp32, all math stays fp32.
template <typename T>
__device__ __forceinline__ float load_q(const DecodeProblem& p, size_t i) {
  return p.q_type == KVType::F32 ? static_cast<const float*>(p.q)[i] : to_float(static_cast<const T*>(p.q)[i]);
}
// Scaled queries of G consecutive rows (from element row0 of the [batch * q_heads, d] query
// matrix), copied by the threads [first, first + stride) of the block.
template <typename T>
__device__ void load_queries(float* dst, const DecodeProblem& p, size_t row0, int n, int first, int stride) {
  for (int i = first; i < n; i += stride) dst[i] = load_q<T>(p, row0 + i) * p.scale;
}
template <typename T>
__device__ __forceinline__ void store_out(const DecodeProblem& p, size_t i, float x) {
  if (p.q_type == KVType::F32)
    static_cast<float*>(p.out)[i] = x;
  else
    static_cast<T*>(p.out)[i] = from_float<T>(x);
}

// One warp's running state in shared memory, for the G query heads of one KV head. The queries
// are read-only and may be shared by the warps of a block.
struct WarpState {
  const float* q;  // [G, d]
  float* o;        // [G, d]
  float* p;        // [G, C]  score / probability scratch
  float* m;        // [G]
  float* l;        // [G]
  float* alpha;    // [G]

  __host__ __device__ static size_t floats(int G, int d, int C) { return static_cast<size_t>(G) * (d + C + 3); }
  __device__ static WarpState at(float* base, const float* q, int G, int d, int C) {
    WarpState s;
    s.q = q;
    s.o = base;
    s.p = s.o + G * d;
    s.m = s.p + G * C;
    s.l = s.m + G;
    s.alpha = s.l + G;
    return s;
  }
  __device__ void reset(int G, int d) {
    const int lane = threadIdx.x & 31;
    for (int i = lane; i < G * d; i += 32) o[i] = 0.f;
    for (int g = lane; g < G; g += 32) {
      m[g] = -INFINITY;
      l[g] = 0.f;
    }
    __syncwarp();
  }
};

// Elements [0, count) of src into the warp's shared buffer dst as 16-byte asynchronous copies
// (count a multiple of 16 bytes; both 16-byte aligned), committed as one batch.
template <typename T>
__device__ __forceinline__ void warp_copy_async(T* dst, const T* src, int count) {
  constexpr int per_vec = 16 / sizeof(T);
  for (int e = (threadIdx.x & 31) * per_vec; e < count; e += 32 * per_vec)
    __pipeline_memcpy_async(dst + e, src + e, 16);
  __pipeline_commit();
}

// Fold the first n tokens of one chunk (K [d, C] transposed, V [C, d]) into the warp's state.
// Masked: tokens below lo (before the row's window; lo < n) are left out, scores soft-capped.
// stage (d * C elements of the warp's shared memory, or null): K, then V, are copied there first,
// every load of a lane issued at once, instead of the loops waiting on each global load in turn.
template <typename T, bool Masked = false>
__device__ void warp_attend(WarpState& s, const T* kt, const T* v, int n, int G, int d, int C, int lo = 0,
                            float cap = 0.f, T* stage = nullptr) {
  const int lane = threadIdx.x & 31;
  if (stage != nullptr) {
    warp_copy_async(stage, kt, d * C);
    __pipeline_wait_prior(0);
    __syncwarp();
    kt = stage;
  }
  // Scores: a lane owns tokens j = lane, lane + 32, ...; reads of a K row are coalesced.
  for (int j = lane; j < n; j += 32) {
    for (int g0 = 0; g0 < G; g0 += kHeadBlock) {
      float acc[kHeadBlock] = {0.f, 0.f, 0.f, 0.f};
      for (int t = 0; t < d; ++t) {
        const float k = to_float(kt[t * C + j]);
#pragma unroll
        for (int u = 0; u < kHeadBlock; ++u)
          if (g0 + u < G) acc[u] += s.q[(g0 + u) * d + t] * k;
      }
#pragma unroll
      for (int u = 0; u < kHeadBlock; ++u) {
        if constexpr (Masked) {
          if (cap > 0.f) acc[u] = soft_cap(acc[u], cap);
          if (j < lo) acc[u] = -INFINITY;  // __expf(-inf - m) is 0 for the finite m that lo < n gives
        }
        if (g0 + u < G) s.p[(g0 + u) * C + j] = acc[u];
      }
    }
  }
  __syncwarp();
  if (stage != nullptr) {  // V's rows in flight while the softmax runs (rows past n are not read)
    warp_copy_async(stage, v, n * d);
    v = stage;
  }
  // Online softmax, one head at a time; every lane ends with the same statistics.
  for (int g = 0; g < G; ++g) {
    float mx = -INFINITY;
    for (int j = lane; j < n; j += 32) mx = fmaxf(mx, s.p[g * C + j]);
    mx = warp_max(mx);
    const float m_old = s.m[g], m_new = fmaxf(m_old, mx);
    float sum = 0.f;
    for (int j = lane; j < n; j += 32) {
      const float e = __expf(s.p[g * C + j] - m_new);
      s.p[g * C + j] = e;
      sum += e;
    }
    sum = warp_sum(sum);
    const float a = rescale(m_old, m_new), l_new = s.l[g] * a + sum;
    __syncwarp();
    if (lane == 0) {
      s.m[g] = m_new;
      s.l[g] = l_new;
      s.alpha[g] = a;
    }
  }
  if (stage != nullptr) __pipeline_wait_prior(0);
  __syncwarp();
  // Weighted values: a lane owns dims lane, lane + 32, ...; reads of a V row are coalesced.
  for (int dim = lane; dim < d; dim += 32) {
    for (int g0 = 0; g0 < G; g0 += kHeadBlock) {
      float acc[kHeadBlock];
#pragma unroll
      for (int u = 0; u < kHeadBlock; ++u) acc[u] = g0 + u < G ? s.o[(g0 + u) * d + dim] * s.alpha[g0 + u] : 0.f;
      for (int j = 0; j < n; ++j) {
        const float x = to_float(v[j * d + dim]);
#pragma unroll
        for (int u = 0; u < kHeadBlock; ++u)
          if (g0 + u < G) acc[u] += s.p[(g0 + u) * C + j] * x;
      }
#pragma unroll
      for (int u = 0; u < kHeadBlock; ++u)
        if (g0 + u < G) s.o[(g0 + u) * d + dim] = acc[u];
    }
  }
  __syncwarp();
}

// Merge one saved partial (o, m, l) per head into the warp's state; heads whose partial is empty
// (l = 0) are left as they are. Lane g takes head g's statistics (32 heads at a time), so every
// load of the partial is issued before any result is needed, and the heads' weights reach the
// other lanes by shuffles, not through a barrier per head.
__device__ void warp_merge(WarpState& s, const float* po, const float* pm, const float* pl, int G, int d) {
  const int lane = threadIdx.x & 31;
  for (int g0 = 0; g0 < G; g0 += 32) {
    const int g = g0 + lane;
    float a = 0.f, b = 0.f, m_new = 0.f, l_new = 0.f, live = 0.f;
    if (g < G && pl[g] != 0.f) {
      const float m_old = s.m[g];
      m_new = fmaxf(m_old, pm[g]);
      a = rescale(m_old, m_new);
      b = __expf(pm[g] - m_new);
      l_new = s.l[g] * a + pl[g] * b;
      live = 1.f;
    }
    __syncwarp();  // every lane has read its head's statistics
    if (live != 0.f) {
      s.m[g] = m_new;
      s.l[g] = l_new;
    }
    for (int u = 0; u < 32 && g0 + u < G; ++u) {
      const float au = __shfl_sync(0xffffffffu, a, u), bu = __shfl_sync(0xffffffffu, b, u);
      if (__shfl_sync(0xffffffffu, live, u) == 0.f) continue;
      float* o = s.o + (g0 + u) * d;
      const float* p = po + (g0 + u) * d;
      for (int dim = lane; dim < d; dim += 32) o[dim] = o[dim] * au + p[dim] * bu;
    }
  }
  __syncwarp();
}

// ---- phase 1 --------------------------------------------------------------------------------

// Shared memory of the tensor-core kernel, for the kernel (pointers) and the host (size): one
// chunk's K and V, then for each of the block's W row tiles (one per warp) its queries, scores,
// probabilities, running output and row statistics. Every row is padded by 16 bytes: unpadded, a
// 64- or 128-element row is a multiple of 128 bytes and the 16 rows of a fragment load would all
// fall in the same banks.
template <typename T>
struct MmaTiles {
  static constexpr int kPadT = 16 / sizeof(T), kPadF = 16 / sizeof(float);
  int ks_ld, vs_ld, qs_ld, ss_ld, ps_ld, os_ld;  // leading dimensions, in elements
  size_t stage_bytes, v_at, flags;               // stage s's K at s * stage_bytes, its V v_at after; 128-aligned
  size_t warp0, per_warp;                        // warp w's part at warp0 + w * per_warp
  size_t qs, ss, ps, os, stats, lo;              // byte offsets within a warp's part
  size_t bytes;
  // stages: 2 to load a segment's next chunk while the warps multiply this one, 1 where two
  // chunks' K and V do not fit beside the row tiles.
  __host__ __device__ MmaTiles(int d, int C, int W, int stages)
      : ks_ld(C + kPadT), vs_ld(d + kPadT), qs_ld(d + kPadT), ss_ld(C + kPadF), ps_ld(C + kPadT), os_ld(d + kPadF) {
    v_at = align128(sizeof(T) * d * ks_ld);                // K [d, C]
    stage_bytes = v_at + align128(sizeof(T) * C * vs_ld);  // V [C, d]
    size_t at = stages * stage_bytes;
    flags = take(at, sizeof(float) * kWarps);  // block_reaches' votes
    warp0 = at;
    size_t w = 0;
    qs = take(w, sizeof(T) * kTile * qs_ld);      // Q [16, d]
    ss = take(w, sizeof(float) * kTile * ss_ld);  // S [16, C]
    ps = take(w, sizeof(T) * kTile * ps_ld);      // P [16, C]
    os = take(w, sizeof(float) * kTile * os_ld);  // O [16, d], running
    stats = take(w, sizeof(float) * 3 * kTile);   // running row max, row sum; this chunk's rescale
    lo = take(w, sizeof(int) * kTile);            // rows' first token in their window
    per_warp = w;
    bytes = warp0 + W * per_warp;
  }
  __host__ __device__ static size_t take(size_t& at, size_t n) {
    const size_t off = at;
    at += align128(n);
    return off;
  }
};

// Whether any of the block's rows [r0, r1) reaches the chunk ending at position end_pos (all threads
// get the answer).
__device__ bool block_reaches(const DecodeProblem& p, int begin, int G, int r0, int r1, int end_pos, float* flags) {
  float any = 0.f;
  for (int r = r0 + threadIdx.x; r < r1; r += kThreads)
    if (window_start(p, begin + r / G) < end_pos) any = 1.f;
  any = warp_max(any);
  if ((threadIdx.x & 31) == 0) flags[threadIdx.x / 32] = any;
  __syncthreads();
  bool reached = false;
  for (int w = 0; w < kWarps; ++w) reached = reached || flags[w] > 0.f;
  return reached;
}

// C[16, cols] (+)= A[16, k] B[k, cols] on the tensor cores (row-major, fp32 accumulate), all by
// the calling warp; accumulate: C's prior values are the products' starting point.
template <typename T>
__device__ __forceinline__ void warp_product(const T* a, int lda, const T* b, int ldb, float* c, int ldc, int k,
                                             int cols, bool accumulate) {
  for (int ct = 0; ct < cols / 16; ++ct) {
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
    if (accumulate)
      wmma::load_matrix_sync(acc, c + ct * 16, ldc, wmma::mem_row_major);
    else
      wmma::fill_fragment(acc, 0.f);
    for (int kt = 0; kt < k / 16; ++kt) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> fa;
      wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> fb;
      wmma::load_matrix_sync(fa, a + kt * 16, lda);
      wmma::load_matrix_sync(fb, b + kt * 16 * ldb + ct * 16, ldb);
      wmma::mma_sync(acc, fa, fb, acc);
    }
    wmma::store_matrix_sync(c + ct * 16, acc, ldc, wmma::mem_row_major);
  }
}

// A chunk's K and V (n tokens, at pool slot `slot`) of KV head h into padded rows of shared memory,
// 16 bytes per thread and step, as asynchronous copies (cp.async: they land by the
// __pipeline_wait_prior that covers the batch the caller commits). V rows past the chunk's n tokens
// are zeroed: their probabilities are 0, but the pool bytes there may be NaN.
template <typename T>
__device__ void load_chunk_tiles(const DecodeProblem& p, int slot, int n, int h, const MmaTiles<T>& L, T* ks, T* vs) {
  const int d = p.head_dim, C = p.chunk;
  const size_t off = head_offset(slot, h, p.kv_heads, d, C);
  const T* kg = static_cast<const T*>(p.k) + off;
  const T* vg = static_cast<const T*>(p.v) + off;
  constexpr int per_vec = 16 / sizeof(T);
  for (int i = threadIdx.x; i < d * C / per_vec; i += kThreads) {
    const int e = i * per_vec;
    __pipeline_memcpy_async(ks + (e / C) * L.ks_ld + e % C, kg + e, 16);
    T* vd = vs + (e / d) * L.vs_ld + e % d;
    if (e / d < n)
      __pipeline_memcpy_async(vd, vg + e, 16);
    else
      *reinterpret_cast<uint4*>(vd) = make_uint4(0, 0, 0, 0);
  }
}

// Whether shared chunk c starts a segment: the chunks [c, segment_end) that cover the same rows
// (one run of the tree without a branch: consecutive indices, KernelContext numbers chunks in the
// order the rows' paths meet them) and stop at the next multiple of seg. One block folds a
// segment's chunks into one partial, written at its first chunk's rows.
__device__ __forceinline__ bool segment_starts(const DecodeProblem& p, int c, int seg) {
  return c % seg == 0 || p.shared_begin[c - 1] != p.shared_begin[c] || p.shared_end[c - 1] != p.shared_end[c];
}
__device__ __forceinline__ int segment_end(const DecodeProblem& p, int c, int seg) {
  int e = c + 1;
  while (e < p.num_shared && !segment_starts(p, e, seg)) ++e;
  return e;
}

// The running state of one warp's row tile, in its part of shared memory.
template <typename T>
struct RowTile {
  T* qs;
  float* ss;
  T* ps;
  float* os;
  float *m, *l, *alpha;
  int* lo;
  __device__ RowTile(unsigned char* part, const MmaTiles<T>& L)
      : qs(reinterpret_cast<T*>(part + L.qs)),
        ss(reinterpret_cast<float*>(part + L.ss)),
        ps(reinterpret_cast<T*>(part + L.ps)),
        os(reinterpret_cast<float*>(part + L.os)),
        m(reinterpret_cast<float*>(part + L.stats)),
        l(m + kTile),
        alpha(l + kTile),
        lo(reinterpret_cast<int*>(part + L.lo)) {}
};

// One chunk's K and V (n tokens; in shared memory) into a warp's row tile: S = Q K, the online
// softmax of each row, O = alpha O + P V.
template <typename T, bool Masked>
__device__ void chunk_into_tile(const DecodeProblem& p, RowTile<T>& t, const MmaTiles<T>& L, const T* ks, const T* vs,
                                int n) {
  const int d = p.head_dim, C = p.chunk, lane = threadIdx.x & 31;
  // S[16, C] = Q[16, d] K[d, C].
  warp_product(t.qs, L.qs_ld, ks, L.ks_ld, t.ss, L.ss_ld, d, C, false);
  __syncwarp();
  // Online softmax of each row over the chunk's n tokens; P rounded to T for the second product.
  for (int r = 0; r < kTile; ++r) {
    float* sr = t.ss + r * L.ss_ld;
    const int lo = t.lo[r];
    if constexpr (Masked) {
      if (p.softcap > 0.f)
        for (int j = lane; j < n; j += 32) sr[j] = soft_cap(sr[j], p.softcap);
      __syncwarp();
    }
    float mx = -INFINITY;
    for (int j = lo + lane; j < n; j += 32) mx = fmaxf(mx, sr[j]);
    mx = warp_max(mx);
    const float m_old = t.m[r], m_new = fmaxf(m_old, mx);
    float sum = 0.f;
    for (int j = lane; j < C; j += 32) {
      // A row whose window starts past the chunk (lo = n) has no valid token: all weights 0.
      const float e = j >= lo && j < n ? __expf(sr[j] - m_new) : 0.f;
      t.ps[r * L.ps_ld + j] = from_float<T>(e);
      sum += e;
    }
    sum = warp_sum(sum);
    __syncwarp();
    if (lane == 0) {
      const float a = rescale(m_old, m_new);
      t.alpha[r] = a;
      t.l[r] = t.l[r] * a + sum;
      t.m[r] = m_new;
    }
  }
  __syncwarp();
  // O[16, d] = alpha O + P[16, C] V[C, d].
  for (int i = lane; i < kTile * d; i += 32) t.os[(i / d) * L.os_ld + i % d] *= t.alpha[i / d];
  __syncwarp();
  warp_product(t.ps, L.ps_ld, vs, L.vs_ld, t.os, L.os_ld, C, d, true);
  __syncwarp();
}

// Batch-invariant: the partial (o, m, l) of row b's private chunk i for query head qh, at this row
// of the split space (which holds no splits' sums then: one sequence-first block a row and head).
__device__ __forceinline__ size_t private_part_row(const DecodeProblem& p, int b, int i, int qh) {
  return (static_cast<size_t>(b) * p.priv_stride + i) * p.q_heads + qh;
}

// Tensor-core chunk-first for fp16/bf16 K/V. Grid: num_shared * kv_heads * groups blocks
// (shared_blocks), then, batch-invariant, batch * priv_stride * kv_heads * pgroups more. Block
// (c, h, g) takes row group g of shared chunk c (rows [g * W * 16, (g + 1) * W * 16): a row tile of
// 16 per warp) through the chunks of c's segment, each warp with an online softmax over them; the
// warps share each chunk's K/V load. A chunk that does not start a segment leaves its rows'
// partials empty (l = 0: the merge skips them). Block (b, i, h, g) of the second part takes row b's
// private chunk i the same way (its G query rows), so that every chunk of a row, shared with other
// rows or not, gives the row the same partial: the same products in the same order.
template <typename T, bool Masked>
__global__ void chunk_first_mma_kernel(DecodeProblem p, const int32_t* part_off, int groups, int seg, int W, int stages,
                                       float* part_o, float* part_m, float* part_l, int shared_blocks, int pgroups,
                                       SplitSpace own) {
  const int Hk = p.kv_heads, G = p.q_heads / Hk, d = p.head_dim, C = p.chunk;
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  const bool shared = static_cast<int>(blockIdx.x) < shared_blocks;
  int g, h, c = 0, begin, rows, own_slot = 0, own_n = 0, own_i = 0;
  size_t part_base;
  float *po = part_o, *pm = part_m, *pl = part_l;
  if (shared) {
    g = blockIdx.x % groups, h = (blockIdx.x / groups) % Hk, c = blockIdx.x / groups / Hk;
    begin = p.shared_begin[c];
    rows = (p.shared_end[c] - begin) * G;
    part_base = static_cast<size_t>(part_off[c]) * p.q_heads + static_cast<size_t>(h) * rows;
  } else {
    const int idx = blockIdx.x - shared_blocks, bi = idx / pgroups / Hk;
    g = idx % pgroups, h = (idx / pgroups) % Hk, begin = bi / p.priv_stride, own_i = bi % p.priv_stride;
    if (begin >= p.batch || own_i >= p.priv_count[begin]) return;
    own_slot = p.priv_slot[bi];
    own_n = own_i + 1 == p.priv_count[begin] ? p.priv_last_len[begin] : C;
    if (own_n <= 0) return;  // nothing to read; the sequence-first phase skips it the same way
    rows = G;
    part_base = private_part_row(p, begin, own_i, h * G);
    po = own.o, pm = own.m, pl = own.l;
  }
  const int first = g * W * kTile;
  if (first >= rows) return;
  const int past = rows - first < W * kTile ? rows : first + W * kTile;  // one past the group's last row
  if (shared && !segment_starts(p, c, seg)) {
    for (int r = first + threadIdx.x; r < past; r += kThreads) {
      pm[part_base + r] = -INFINITY;
      pl[part_base + r] = 0.f;
    }
    return;
  }
  // The chunks the block walks: shared chunks [c, c + count), or the one private chunk.
  const int count = shared ? segment_end(p, c, seg) - c : 1;
  const auto slot_of = [&](int k) { return shared ? p.shared_slot[c + k] : own_slot; };
  const auto len_of = [&](int k) { return shared ? p.shared_len[c + k] : own_n; };

  const MmaTiles<T> L(d, C, W, stages);
  unsigned char* base = shared_bytes();
  int pos = 0;  // Masked: the segment is this one chunk (seg = 1)
  if constexpr (Masked) {
    if (p.window > 0) pos = shared ? shared_position(p, c) : row_extent(p, begin).shared + own_i * C;
    if (p.window > 0 &&
        !block_reaches(p, begin, G, first, past, pos + len_of(0), reinterpret_cast<float*>(base + L.flags)))
      return;  // no row of this block sees the chunk: not read (the merge skips these rows' partials)
  }
  const auto stage_k = [&](int s) { return reinterpret_cast<T*>(base + s * L.stage_bytes); };
  const auto stage_v = [&](int s) { return reinterpret_cast<T*>(base + s * L.stage_bytes + L.v_at); };
  load_chunk_tiles<T>(p, slot_of(0), len_of(0), h, L, stage_k(0), stage_v(0));  // in flight while the queries load
  __pipeline_commit();
  const bool computes = warp < W;
  RowTile<T> t(base + L.warp0 + (computes ? warp : 0) * L.per_warp, L);

  const int r0 = first + warp * kTile;
  const int tile_rows = !computes || r0 >= rows ? 0 : rows - r0 < kTile ? rows - r0 : kTile;
  if (tile_rows > 0) {
    // Scaled queries of the tile's rows (missing rows zero), an empty running state.
    for (int i = lane; i < kTile * d; i += 32) {
      const int r = i / d, k = i % d;
      float x = 0.f;
      if (r < tile_rows) {
        const int seq = begin + (r0 + r) / G, gq = (r0 + r) % G;
        x = load_q<T>(p, (static_cast<size_t>(seq) * p.q_heads + h * G + gq) * d + k) * p.scale;
      }
      t.qs[r * L.qs_ld + k] = from_float<T>(x);
      t.os[r * L.os_ld + k] = 0.f;
    }
    for (int r = lane; r < kTile; r += 32) {
      t.m[r] = -INFINITY;
      t.l[r] = 0.f;
      int lo = 0;
      if constexpr (Masked) {
        const int n = len_of(0);
        lo = r < tile_rows && p.window > 0 ? window_start(p, begin + (r0 + r) / G) - pos : 0;
        lo = lo < 0 ? 0 : lo < n ? lo : n;
      }
      t.lo[r] = lo;
    }
  }
  for (int k = 0; k < count; ++k) {
    const int n = len_of(k), s = stages == 2 ? k & 1 : 0;
    const T* ks = stage_k(s);
    const T* vs = stage_v(s);
    if (stages == 2 && k + 1 < count) {
      // the next chunk into the other stage, which every warp finished with in the last iteration
      load_chunk_tiles<T>(p, slot_of(k + 1), len_of(k + 1), h, L, stage_k(s ^ 1), stage_v(s ^ 1));
      __pipeline_commit();
      __pipeline_wait_prior(1);
    } else {
      __pipeline_wait_prior(0);
    }
    __syncthreads();  // this chunk's K and V have landed, every thread's part of them
    if (tile_rows > 0) chunk_into_tile<T, Masked>(p, t, L, ks, vs, n);
    __syncthreads();  // every warp is done with this stage before it is filled again
    if (stages == 1 && k + 1 < count) {
      load_chunk_tiles<T>(p, slot_of(k + 1), len_of(k + 1), h, L, stage_k(0), stage_v(0));
      __pipeline_commit();
    }
  }

  if (tile_rows > 0) {
    for (int i = lane; i < tile_rows * d; i += 32) po[(part_base + r0) * d + i] = t.os[(i / d) * L.os_ld + i % d];
    for (int r = lane; r < tile_rows; r += 32) {
      pm[part_base + r0 + r] = t.l[r] > 0.f ? t.m[r] : -INFINITY;
      pl[part_base + r0 + r] = t.l[r];
    }
    __syncwarp();
  }
}

// SIMT chunk-first for fp32 K/V: each warp takes whole sequences of the chunk's range. Grid:
// num_shared * kv_heads * splits blocks (shared_blocks), then, batch-invariant, a block for each
// (row, private chunk, KV head), whose first warp leaves the row's partial of that chunk the way a
// shared chunk's warp would.
template <typename T, bool Masked>
__global__ void chunk_first_simt_kernel(DecodeProblem p, const int32_t* part_off, int splits, float* part_o,
                                        float* part_m, float* part_l, int shared_blocks, SplitSpace own) {
  const int Hk = p.kv_heads, G = p.q_heads / Hk, d = p.head_dim, C = p.chunk;
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  const bool shared = static_cast<int>(blockIdx.x) < shared_blocks;
  int split = 0, h, c = 0, begin, end, slot, n, own_i = 0;
  if (shared) {
    split = blockIdx.x % splits, h = (blockIdx.x / splits) % Hk, c = blockIdx.x / splits / Hk;
    begin = p.shared_begin[c], end = p.shared_end[c], slot = p.shared_slot[c], n = p.shared_len[c];
  } else {
    const int bi = (blockIdx.x - shared_blocks) / Hk;
    h = (blockIdx.x - shared_blocks) % Hk, begin = bi / p.priv_stride, end = begin + 1, own_i = bi % p.priv_stride;
    if (begin >= p.batch || own_i >= p.priv_count[begin]) return;
    slot = p.priv_slot[bi];
    n = own_i + 1 == p.priv_count[begin] ? p.priv_last_len[begin] : C;
    if (n <= 0) return;
  }
  // Each warp has its own sequence, so its own copy of the queries in front of its state.
  float* mine = reinterpret_cast<float*>(shared_bytes()) + warp * (G * d + WarpState::floats(G, d, C));
  WarpState s = WarpState::at(mine + G * d, mine, G, d, C);
  const size_t off = head_offset(slot, h, Hk, d, C);
  int pos = 0;
  if (Masked && p.window > 0) pos = shared ? shared_position(p, c) : row_extent(p, begin).shared + own_i * C;
  for (int seq = begin + split * kWarps + warp; seq < end; seq += splits * kWarps) {
    int lo = 0;
    if constexpr (Masked) {
      lo = window_start(p, seq) - pos;
      if (lo >= n) continue;  // the row's window starts past the chunk: not read, no partial
      lo = lo < 0 ? 0 : lo;
    }
    load_queries<T>(mine, p, (static_cast<size_t>(seq) * p.q_heads + h * G) * d, G * d, lane, 32);
    s.reset(G, d);
    warp_attend<T, Masked>(s, static_cast<const T*>(p.k) + off, static_cast<const T*>(p.v) + off, n, G, d, C, lo,
                           p.softcap);
    const size_t row = shared ? part_row(p, part_off, c, h, seq, 0) : private_part_row(p, seq, own_i, h * G);
    float* po = shared ? part_o : own.o;
    float* pm = shared ? part_m : own.m;
    float* pl = shared ? part_l : own.l;
    for (int i = lane; i < G * d; i += 32) po[row * d + i] = s.o[i];
    for (int g = lane; g < G; g += 32) {
      pm[row + g] = s.m[g];
      pl[row + g] = s.l[g];
    }
    __syncwarp();
  }
}

// ---- phase 2 --------------------------------------------------------------------------------

// Where a block's shared memory holds a chunk's K (then V) per warp beside the states: the byte
// offset of warp 0's buffer, each warp's d * C elements 128-aligned after it; 0 where it does not.
template <typename T>
__host__ __device__ size_t stage_bytes_per_warp(int d, int C) {
  return align128(sizeof(T) * d * C);
}

template <typename T, bool Masked>
__global__ void sequence_first_kernel(DecodeProblem p, const int32_t* part_off, const float* part_o,
                                      const float* part_m, const float* part_l, size_t stage_at, int splits,
                                      SplitSpace sp) {
  const int Hk = p.kv_heads, G = p.q_heads / Hk, d = p.head_dim, C = p.chunk;
  const int bh = blockIdx.x / splits, split = blockIdx.x % splits;
  const int b = bh / Hk, h = bh % Hk;
  const int warp = threadIdx.x / 32;
  // The block's one copy of the G queries, then one state per warp.
  float* q_s = reinterpret_cast<float*>(shared_bytes());
  float* base = q_s + G * d;
  const size_t per_warp = WarpState::floats(G, d, C);
  load_queries<T>(q_s, p, (static_cast<size_t>(b) * p.q_heads + h * G) * d, G * d, threadIdx.x, kThreads);
  __syncthreads();
  WarpState s = WarpState::at(base + warp * per_warp, q_s, G, d, C);
  s.reset(G, d);
  T* stage =
      stage_at == 0 ? nullptr : reinterpret_cast<T*>(shared_bytes() + stage_at + warp * stage_bytes_per_warp<T>(d, C));

  const T* K = static_cast<const T*>(p.k);
  const T* V = static_cast<const T*>(p.v);
  const int first = p.seq_shared_ptr[b], n_shared = p.seq_shared_ptr[b + 1] - first;
  const int n_priv = p.priv_count[b];
  // With a window: the row's window start, and each item's first position (the warp walks its
  // items in order, so one running sum over the shared chunks serves them all).
  RowExtent extent{0, 0};
  int row_lo = 0, walked = 0, pos = 0;
  if constexpr (Masked) {
    if (p.window > 0) {
      extent = row_extent(p, b);
      row_lo = extent.all - p.window > 0 ? extent.all - p.window : 0;
    }
  }
  // The row's items dealt out to the kWarps * splits warps of its blocks in turn; each warp walks
  // its own in order.
  for (int item = split * kWarps + warp; item < n_shared + n_priv; item += kWarps * splits) {
    const bool shared = item < n_shared;
    const int c = shared ? p.seq_shared_idx[first + item] : -1;
    const int i = item - n_shared;
    const int n = shared ? p.shared_len[c] : i + 1 == n_priv ? p.priv_last_len[b] : C;
    int lo = 0;
    if constexpr (Masked) {
      if (p.window > 0) {
        if (shared) {
          for (; walked < item; ++walked) pos += p.shared_len[p.seq_shared_idx[first + walked]];
        } else {
          pos = extent.shared + i * C;
        }
        if (pos + n <= row_lo) continue;  // wholly before the row's window: not read
        lo = row_lo > pos ? row_lo - pos : 0;
      }
    }
    if (shared) {
      if (p.chunk_first) {
        const size_t row = part_row(p, part_off, c, h, b, 0);
        warp_merge(s, part_o + row * d, part_m + row, part_l + row, G, d);
      } else {
        const size_t off = head_offset(p.shared_slot[c], h, Hk, d, C);
        warp_attend<T, Masked>(s, K + off, V + off, n, G, d, C, lo, p.softcap, stage);
      }
    } else {
      if (n <= 0) continue;
      if (p.invariant && p.chunk_first) {  // the chunk-first kernel left this chunk's partial
        const size_t row = private_part_row(p, b, i, h * G);
        warp_merge(s, sp.o + row * d, sp.m + row, sp.l + row, G, d);
        continue;
      }
      const size_t off = head_offset(p.priv_slot[static_cast<size_t>(b) * p.priv_stride + i], h, Hk, d, C);
      warp_attend<T, Masked>(s, K + off, V + off, n, G, d, C, lo, p.softcap, stage);
    }
  }
  __syncthreads();

  // Reduce across warps: out = sum_w o_w e^(m_w - m) / sum_w l_w e^(m_w - m). A split block leaves
  // its sums unnormalised (l = 0 where none of its warps had an item) at its row of sp, ((b * Hk +
  // h) * splits + split) * G + g, for the merge.
  const size_t split_row = static_cast<size_t>(blockIdx.x) * G;
  for (int i = threadIdx.x; i < G * d; i += kThreads) {
    const int g = i / d;
    float m = -INFINITY;
    for (int w = 0; w < kWarps; ++w) m = fmaxf(m, WarpState::at(base + w * per_warp, q_s, G, d, C).m[g]);
    float o = 0.f, l = 0.f;
    for (int w = 0; w < kWarps; ++w) {
      const WarpState sw = WarpState::at(base + w * per_warp, q_s, G, d, C);
      if (sw.l[g] == 0.f) continue;
      const float a = __expf(sw.m[g] - m);
      o += sw.o[i] * a;
      l += sw.l[g] * a;
    }
    if (splits == 1) {
      store_out<T>(p, (static_cast<size_t>(b) * p.q_heads + h * G) * d + i, l > 0.f ? o / l : 0.f);
    } else {
      sp.o[(split_row + g) * d + i % d] = o;
      if (i % d == 0) {
        sp.m[split_row + g] = m;
        sp.l[split_row + g] = l;
      }
    }
  }
}

// One block per (sequence, KV head): the splits' sums merged in split order and normalised.
template <typename T>
__global__ void merge_splits_kernel(DecodeProblem p, int splits, SplitSpace sp) {
  const int G = p.q_heads / p.kv_heads, d = p.head_dim;
  const size_t first = static_cast<size_t>(blockIdx.x) * splits * G;  // split 0's row of head 0
  for (int i = threadIdx.x; i < G * d; i += kThreads) {
    const int g = i / d;
    float m = -INFINITY;
    for (int s = 0; s < splits; ++s)
      if (sp.l[first + s * G + g] > 0.f) m = fmaxf(m, sp.m[first + s * G + g]);
    float o = 0.f, l = 0.f;
    for (int s = 0; s < splits; ++s) {
      const size_t row = first + s * G + g;
      if (sp.l[row] == 0.f) continue;
      const float a = __expf(sp.m[row] - m);
      o += sp.o[row * d + i % d] * a;
      l += sp.l[row] * a;
    }
    store_out<T>(p, static_cast<size_t>(blockIdx.x) * G * d + i, l > 0.f ? o / l : 0.f);
  }
}

// ---- host side ------------------------------------------------------------------------------

// CHUNKGEN_CUDA_SEGMENTS=off (a partial for every chunk), CHUNKGEN_CUDA_STAGE=off (the
// sequence-first loops read K and V from global memory) and CHUNKGEN_CUDA_SPLITS=off (one
// sequence-first block a row and KV head): the kernels without those steps, to time them side by
// side (bench kernel's chunk_tpp_per_chunk, chunk_tpp_unstaged and chunk_tpp_unsplit rows). Read
// at every launch.
bool switched_off(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && (std::string(v) == "off" || std::string(v) == "0");
}

template <typename T, bool kTensorCores, bool Masked>
void launch(const DecodeProblem& p, const int32_t* part_off, int max_rows, float* part_o, float* part_m, float* part_l,
            const SplitSpace& split_space, cudaStream_t stream) {
  const DeviceLimits lim = device_limits();
  const int G = p.q_heads / p.kv_heads;
  const size_t gd = static_cast<size_t>(G) * p.head_dim;
  const size_t state = WarpState::floats(G, p.head_dim, p.chunk);
  const size_t simt_smem = sizeof(float) * kWarps * (gd + state);  // a query copy per warp
  const size_t seq_smem = sizeof(float) * (gd + kWarps * state);   // one query copy per block
  // Batch-invariant: the chunk-first kernel also reads every private chunk (a block a row, chunk
  // and KV head), leaving its partial in the split space, one partial a chunk (no segments, whose
  // lengths follow the grid), and one sequence-first block a row merges them all in path order (no
  // splits, whose number follows the batch). So a row's arithmetic is the same whichever rows share
  // its chunks and however many rows run.
  const bool own_partials = p.invariant && p.chunk_first;
  if (own_partials && split_space.splits < p.priv_stride)
    throw std::invalid_argument("batch-invariant decode attention needs room for " + std::to_string(p.priv_stride) +
                                " private partials a row in the workspace; it has " +
                                std::to_string(split_space.splits) + " (kernels/decode.py: workspace_for)");
  const int own_rows = own_partials ? p.batch * p.priv_stride * p.kv_heads : 0;
  if (p.chunk_first && (p.num_shared > 0 || own_rows > 0)) {
    if constexpr (kTensorCores) {
      // Row tiles a block takes at once (one per warp; fewer where the shared memory for four
      // does not fit, or the rows are fewer), and segments of `seg` chunks per block where chunks x
      // heads x row groups would fill more than two waves of SMs: each segment leaves one partial a
      // row for the sequence-first phase to merge, not one per chunk. Windows keep one chunk a
      // segment (a row's window is masked per chunk).
      const int tiles = (max_rows * G + kTile - 1) / kTile;
      const int most = std::max(1, std::min(kWarps, tiles));
      // Two stages (a segment's next chunk loads while this one is multiplied) where they fit with
      // some W, with the most row tiles that fit beside them; else one (refused below, with its
      // byte count, if even one tile does not fit).
      int W = 1, stages = 1;
      [&] {
        for (int st = 2; st >= 1; --st)
          for (int w = most; w >= 1; w /= 2)
            if (MmaTiles<T>(p.head_dim, p.chunk, w, st).bytes <= static_cast<size_t>(lim.max_smem)) {
              W = w, stages = st;
              return;
            }
      }();
      const int groups = std::max(1, (tiles + W - 1) / W);  // one where no chunk has rows
      const bool fold = !Masked && !switched_off("CHUNKGEN_CUDA_SEGMENTS");
      const int seg = fold && !p.invariant ? std::max(1, p.num_shared * p.kv_heads * groups / (2 * lim.sms)) : 1;
      const int pgroups = ((G + kTile - 1) / kTile + W - 1) / W;  // a private chunk's row groups
      const int shared_blocks = p.num_shared * p.kv_heads * groups;
      const size_t smem = MmaTiles<T>(p.head_dim, p.chunk, W, stages).bytes;
      const auto kernel = chunk_first_mma_kernel<T, Masked>;  // one name: the launch macro splits on commas
      reserve_smem(kernel, smem, lim, "chunk-first kernel");
      CHUNKGEN_LAUNCH(kernel, shared_blocks + own_rows * pgroups, kThreads, smem, stream, p, part_off, groups, seg, W,
                      stages, part_o, part_m, part_l, shared_blocks, pgroups, split_space);
    } else {
      // Split each chunk's rows over more blocks when chunks x heads alone would leave SMs idle.
      const int items = p.num_shared * p.kv_heads;
      const int most = (max_rows + kWarps - 1) / kWarps;
      const int splits = items > 0 ? std::max(1, std::min(most, (2 * lim.sms + items - 1) / items)) : 1;
      const auto kernel = chunk_first_simt_kernel<T, Masked>;
      reserve_smem(kernel, simt_smem, lim, "chunk-first kernel");
      CHUNKGEN_LAUNCH(kernel, items * splits + own_rows, kThreads, simt_smem, stream, p, part_off, splits, part_o,
                      part_m, part_l, items * splits, split_space);
    }
    check(cudaGetLastError(), "chunk-first kernel launch");
  }
  // Each warp's chunk staged in shared memory where that fits beside the states.
  const size_t stage_at = align128(seq_smem);
  const size_t staged = stage_at + kWarps * stage_bytes_per_warp<T>(p.head_dim, p.chunk);
  const bool stage = staged <= static_cast<size_t>(lim.max_smem) && !switched_off("CHUNKGEN_CUDA_STAGE");
  // A row's items over several blocks where (sequence, KV head) blocks alone would fill less than
  // two waves of SMs (small batches, few KV heads, long private parts), as many as the workspace
  // holds; the merge kernel then combines the blocks' sums.
  const int rows_heads = std::max(1, p.batch * p.kv_heads);
  const int want = (2 * lim.sms + rows_heads - 1) / rows_heads;
  const int splits =
      p.invariant || switched_off("CHUNKGEN_CUDA_SPLITS") ? 1 : std::max(1, std::min(want, split_space.splits));
  const auto seq_kernel = sequence_first_kernel<T, Masked>;
  reserve_smem(seq_kernel, stage ? staged : seq_smem, lim, "sequence-first kernel");
  CHUNKGEN_LAUNCH(seq_kernel, p.batch * p.kv_heads * splits, kThreads, stage ? staged : seq_smem, stream, p, part_off,
                  part_o, part_m, part_l, stage ? stage_at : size_t{0}, splits, split_space);
  check(cudaGetLastError(), "sequence-first kernel launch");
  if (splits > 1) {
    const auto merge_kernel = merge_splits_kernel<T>;
    CHUNKGEN_LAUNCH(merge_kernel, p.batch * p.kv_heads, kThreads, 0, stream, p, splits, split_space);
    check(cudaGetLastError(), "split merge kernel launch");
  }
}

}  // namespace

// part_off: device [num_shared + 1], prefix sums of the shared chunks' sequence counts; max_rows:
// the largest sequence count of one shared chunk; part_*: part_off[num_shared] * q_heads rows;
// split_space: room for the sequence-first splits' sums (splits 0: one block a row and KV head).
void decode_attention_cuda_raw(const DecodeProblem& p, const int32_t* part_off, int max_rows, float* part_o,
                               float* part_m, float* part_l, const SplitSpace& split_space, void* stream) {
  if (p.head_dim > kMaxHeadDim) throw std::invalid_argument("head_dim > 256 is not supported on CUDA");
  auto s = static_cast<cudaStream_t>(stream);
  // Windows and soft-capping in their own kernels: the full-attention ones are compiled as before.
  const bool masked = p.window > 0 || p.softcap > 0.f;
  switch (p.kv_type) {
    case KVType::F32:
      (masked ? launch<float, false, true> : launch<float, false, false>)(p, part_off, max_rows, part_o, part_m, part_l,
                                                                          split_space, s);
      break;
    case KVType::F16:
      (masked ? launch<__half, true, true> : launch<__half, true, false>)(p, part_off, max_rows, part_o, part_m, part_l,
                                                                          split_space, s);
      break;
    case KVType::BF16:
      (masked ? launch<__nv_bfloat16, true, true> : launch<__nv_bfloat16, true, false>)(p, part_off, max_rows, part_o,
                                                                                        part_m, part_l, split_space, s);
      break;
  }
}

}  // namespace chunkgen
