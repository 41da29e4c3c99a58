// The online softmax the decode kernel's fp32 path is made of: scores of a block of query rows
// against one chunk (K stored transposed, so each score vector is vertical FMAs), the running
// (o, m, l) update with the chunk's values, merging partial states, and writing a normalized row.
// Every multiply-add is an explicit vfma: the functions are instantiated per row-block size, and
// the compiler's contraction of a * b + c, free in each instance, had o * alpha + p * v fused one
// way in some and the other way in others, so a row's bits followed how many rows ran with it (AVX2,
// where the blocks are 6 rows: a row's output differed between blocks of 4 and of 6 + 2).
// Soft-capping and sliding windows are compile-time cases (Masked): full attention pays nothing.
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>

#include "../attention.h"
#include "aligned.h"
#include "bf16_gemm.h"
#include "vec.h"

namespace chunkgen {
namespace decode {

// s[r, 0:nv*W] = q[r] . K^T for RB rows; K^T is [d, C], so each score vector is vertical FMAs.
template <typename T, int RB>
inline void scores(const float* q, const T* kt, int nv, int C, int d, float* s) {
  int jv = 0;
  for (; jv + 2 <= nv; jv += 2) {
    vf acc[RB][2] = {};
    const T* kp = kt + jv * W;
    for (int t = 0; t < d; ++t, kp += C) {
      const vf k0 = load(kp), k1 = load(kp + W);
      for (int r = 0; r < RB; ++r) {
        const vf qb = splat(q[r * d + t]);  // d is the row stride: one index per (r, t)
        acc[r][0] = vfma(qb, k0, acc[r][0]);
        acc[r][1] = vfma(qb, k1, acc[r][1]);
      }
    }
    for (int r = 0; r < RB; ++r) {
      store(s + r * C + jv * W, acc[r][0]);
      store(s + r * C + jv * W + W, acc[r][1]);
    }
  }
  if (jv < nv) {
    vf acc[RB] = {};
    const T* kp = kt + jv * W;
    for (int t = 0; t < d; ++t, kp += C) {
      const vf k0 = load(kp);
      for (int r = 0; r < RB; ++r) acc[r] = vfma(splat(q[r * d + t]), k0, acc[r]);
    }
    for (int r = 0; r < RB; ++r) store(s + r * C + jv * W, acc[r]);
  }
}

// o[r] = o[r] * alpha[r] + p[r, :n] @ V for RB rows; V is [C, d].
template <typename T, int RB>
inline void weighted_values(const float* p, int C, const T* v, int n, int d, float* o, const float* alpha) {
  const int dv = d / W;
  int c = 0;
  for (; c + 2 <= dv; c += 2) {
    vf acc[RB][2];
    for (int r = 0; r < RB; ++r) {
      acc[r][0] = load(o + r * d + c * W) * alpha[r];
      acc[r][1] = load(o + r * d + c * W + W) * alpha[r];
    }
    const T* vp = v + c * W;
    for (int j = 0; j < n; ++j, vp += d) {
      const vf v0 = load(vp), v1 = load(vp + W);
      const float* pj = p + j;
      for (int r = 0; r < RB; ++r) {
        const vf pb = splat(pj[static_cast<size_t>(r) * C]);
        acc[r][0] = vfma(pb, v0, acc[r][0]);
        acc[r][1] = vfma(pb, v1, acc[r][1]);
      }
    }
    for (int r = 0; r < RB; ++r) {
      store(o + r * d + c * W, acc[r][0]);
      store(o + r * d + c * W + W, acc[r][1]);
    }
  }
  if (c < dv) {
    vf acc[RB];
    for (int r = 0; r < RB; ++r) acc[r] = load(o + r * d + c * W) * alpha[r];
    const T* vp = v + c * W;
    for (int j = 0; j < n; ++j, vp += d) {
      const vf v0 = load(vp);
      for (int r = 0; r < RB; ++r) acc[r] = vfma(splat(p[r * C + j]), v0, acc[r]);
    }
    for (int r = 0; r < RB; ++r) store(o + r * d + c * W, acc[r]);
  }
}

// Query and output elements as fp32, whatever their dtype (fp32, or bf16 stored as uint16_t).
inline float to_f32(float x) { return x; }
inline float to_f32(uint16_t x) { return bf16::to_float(x); }
inline void from_f32(float x, float* dst) { *dst = x; }
inline void from_f32(float x, uint16_t* dst) { *dst = bf16::from_float(x); }

struct Scratch {
  AlignedVector<float> q, o, m, l, s, alpha;
  std::vector<int> lo;  // per row: first token of the chunk inside the row's window
  void reserve(int rows, int d, int C) {
    const size_t r = static_cast<size_t>(rows);
    if (lo.size() < r) lo.resize(r);
    if (q.size() < r * d) q.resize(r * d);
    if (o.size() < r * d) o.resize(r * d);
    if (m.size() < r) m.resize(r), l.resize(r), alpha.resize(r);
    if (s.size() < r * C) s.resize(r * C);
  }
  void reset_state(int rows, int d) {
    std::fill_n(o.data(), static_cast<size_t>(rows) * d, 0.f);
    std::fill_n(m.data(), rows, kNegInf);
    std::fill_n(l.data(), rows, 0.f);
  }
};

// Row blocks of kRB rows, then one block of the remaining rows (never one row at a time).
template <typename T, int RB>
inline void scores_rows(const float* q, int R, const T* kt, int nv, int C, int d, float* s) {
  if constexpr (RB > 1) {
    if (R < RB) return scores_rows<T, RB - 1>(q, R, kt, nv, C, d, s);
  }
  int r = 0;
  for (; r + RB <= R; r += RB) scores<T, RB>(q + r * d, kt, nv, C, d, s + static_cast<size_t>(r) * C);
  if constexpr (RB > 1) {
    if (r < R) scores_rows<T, RB - 1>(q + r * d, R - r, kt, nv, C, d, s + static_cast<size_t>(r) * C);
  }
}

template <typename T, int RB>
inline void values_rows(const float* p, int R, int C, const T* v, int n, int d, float* o, const float* alpha) {
  if constexpr (RB > 1) {
    if (R < RB) return values_rows<T, RB - 1>(p, R, C, v, n, d, o, alpha);
  }
  int r = 0;
  for (; r + RB <= R; r += RB) weighted_values<T, RB>(p + static_cast<size_t>(r) * C, C, v, n, d, o + r * d, alpha + r);
  if constexpr (RB > 1) {
    if (r < R) values_rows<T, RB - 1>(p + static_cast<size_t>(r) * C, R - r, C, v, n, d, o + r * d, alpha + r);
  }
}

// A row's scores of one chunk beyond what full attention does: soft-capped (cap > 0) and, with a
// window, tokens below `lo` (before the row's window) masked out.
struct ChunkMask {
  const int* lo;  // per row: first token of the chunk inside the row's window (0: all of it)
  float cap;
};

// A vector of scores x in place as 2^(x scale + shift), returned too; masked scores (-inf) give 0.
// (Inlined by force: GCC kept it a call, as a lambda, in the softmax's inner loop.)
__attribute__((always_inline)) inline vf probabilities(float* x, vf scale, vf shift) {
  const vf e = vexp2_nonpos(vfma(load(x), scale, shift));
  store(x, e);
  return e;
}

// Online softmax of R rows' scores of one chunk (row r's nv vectors at s + r C, the last one's
// valid lanes `tail`): each row's scores become its probabilities against its new running max,
// alpha[r] the old state's rescale factor. Two passes over the rows, every row's maximum first,
// so that no row's exponentials wait on its own reduction chain.
template <bool Masked>
inline void rows_softmax(float* s, int R, int C, int nv, vi tail, ChunkMask mask, float* m, float* l, float* alpha) {
  constexpr float kLog2e = 1.44269504088896341f;
  for (int r = 0; r < R; ++r) {
    float* sr = s + static_cast<size_t>(r) * C;
    vf mx;
    if constexpr (!Masked) {
      vf a = splat(kNegInf), b = splat(kNegInf);
      int jv = 0;
      for (; jv + 2 < nv; jv += 2) a = vmax(a, load(sr + jv * W)), b = vmax(b, load(sr + jv * W + W));
      if (jv + 1 < nv) a = vmax(a, load(sr + jv * W));
      mx = vmax(a, vmax(b, tail ? load(sr + (nv - 1) * W) : splat(kNegInf)));
    } else {
      const int lo = mask.lo ? mask.lo[r] : 0;
      mx = splat(kNegInf);
      for (int jv = 0; jv < nv; ++jv) {
        vf x = load(sr + jv * W);
        if (mask.cap > 0.f) x = soft_cap(x, mask.cap);
        vi keep = ~lanes_below(lo - jv * W);
        if (jv + 1 == nv) keep &= tail;
        x = keep ? x : splat(kNegInf);
        store(sr + jv * W, x);
        mx = vmax(mx, x);
      }
    }
    const float mnew = std::max(m[r], hmax(mx));
    alpha[r] = mnew == m[r] ? 1.f : std::exp(m[r] - mnew);  // 0 on a row's first chunk (m = -inf)
    m[r] = mnew;
  }
  for (int r = 0; r < R; ++r) {
    float* sr = s + static_cast<size_t>(r) * C;
    const float mnew = m[r];
    if (Masked && mnew == kNegInf) {  // nothing of this chunk (or before it) in the row's window
      for (int jv = 0; jv < nv; ++jv) store(sr + jv * W, vf{});
      continue;
    }
    // exp(x - max) as 2^(x log2 e - max log2 e): one fused multiply-add a vector (the max's own
    // exponent is then a rounding away from 0, which the normalization by l cancels).
    const vf scale = splat(kLog2e), shift = splat(-mnew * kLog2e);
    vf sum0 = {}, sum1 = {};
    int jv = 0;
    for (; jv + 2 < nv; jv += 2) {
      sum0 += probabilities(sr + jv * W, scale, shift);
      sum1 += probabilities(sr + jv * W + W, scale, shift);
    }
    if (jv + 1 < nv) sum0 += probabilities(sr + W * jv++, scale, shift);
    vf e = probabilities(sr + jv * W, scale, shift);
    if (!Masked && !tail[W - 1]) store(sr + jv * W, e = tail ? e : vf{});  // padded lanes carry no weight
    l[r] = l[r] * alpha[r] + hsum(sum0 + (sum1 + e));
  }
}

// Online-softmax update of R scaled query rows (q [R, d]) with the first n tokens of one chunk.
// Masked: per-row window starts and soft-capping (mask); full attention instantiates without them.
template <typename T, bool Masked>
void attend_chunk(const float* q, int R, const T* kt, const T* v, int n, int C, int d, float* o, float* m, float* l,
                  float* s, float* alpha, ChunkMask mask = {nullptr, 0.f}) {
  const int nv = (n + W - 1) / W;
  scores_rows<T, kRB>(q, R, kt, nv, C, d, s);

  rows_softmax<Masked>(s, R, C, nv, lanes_below(n - (nv - 1) * W), mask, m, l, alpha);

  values_rows<T, kRB>(s, R, C, v, n, d, o, alpha);
}

// Fold a partial (po, pm, pl) into a running state (o, m, l).
inline void merge_partial(float* o, float& m, float& l, const float* po, float pm, float pl, int d) {
  if (pl == 0.f) return;
  const float mn = std::max(m, pm);
  const float a = std::exp(m - mn), b = std::exp(pm - mn);
  // One rounding order wherever this is inlined: two products summed could contract to an FMA
  // either way round, and batch-invariant numerics need the same bits from every call site.
  for (int i = 0; i < d; ++i) o[i] = std::fma(po[i], b, o[i] * a);
  l = std::fma(pl, b, l * a);
  m = mn;
}

// Stores row b's new k, v of head h (see DecodeProblem::new_k) into the pool layer.
template <typename T>
inline void store_new_kv(const DecodeProblem& p, int b, int h) {
  const size_t head_elems = static_cast<size_t>(p.head_dim) * p.chunk, slot = p.write_slot[b];
  const size_t base = (slot * p.kv_heads + h) * head_elems;
  const int C = p.chunk, d = p.head_dim, off = p.write_offset[b];
  // The pool layer is the op's mutable argument; the kernel only reads it through p.k, p.v.
  T* kt = static_cast<T*>(const_cast<void*>(p.k)) + base + off;                           // a column of K^T
  T* vr = static_cast<T*>(const_cast<void*>(p.v)) + base + static_cast<size_t>(off) * d;  // a row of V
  const T* nk = static_cast<const T*>(p.new_k) + b * p.new_k_stride[0] + h * p.new_k_stride[1];
  const T* nv = static_cast<const T*>(p.new_v) + b * p.new_v_stride[0] + h * p.new_v_stride[1];
  for (int i = 0; i < d; ++i) kt[static_cast<size_t>(i) * C] = nk[i * p.new_k_stride[2]];
  for (int i = 0; i < d; ++i) vr[i] = nv[i * p.new_v_stride[2]];
}

template <typename Q>
inline void write_normalized(Q* dst, const float* o, float l, int d) {
  const float inv = l > 0.f ? 1.f / l : 0.f;
  for (int i = 0; i < d; ++i) from_f32(o[i] * inv, dst + i);
}

}  // namespace decode
}  // namespace chunkgen
