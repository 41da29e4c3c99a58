// Two-phase partition (TPP) decode attention on the CPU.
//
// Phase 1 (chunk-first): for each shared chunk and KV head, the queries of every covered sequence
// (times the GQA group) form one matrix multiplied against the chunk once; partial (o, m, l) rows go
// to a workspace. Phase 2 (sequence-first): for each sequence and KV head, merge the shared partials
// and continue over the private chunks with online softmax. Long private tails are split into
// segments (merged in phase 3) so both cores have work whatever the tree looks like.
//
// SIMD width comes from the build machine (-march=native): GCC vector extensions keep one source
// for AVX-512, AVX2 and narrower targets. With bf16 KV, the chunk-first products run in bf16 on AMX
// tiles or AVX512_BF16 dot products where the build targets them and the CPU (and for AMX the OS)
// grants them at run time; everything else (fp32 KV, the sequence-first phase) is the fp32 path.
// q and out are fp32 or bf16 (the model's dtype); softmax statistics and sums are fp32 throughout.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "bf16_gemm.h"
#include "isa.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "../attention.h"

namespace chunkgen {
namespace {

#if defined(__AVX512F__)
constexpr int W = 16;
#elif defined(__AVX__)
constexpr int W = 8;
#else
constexpr int W = 4;
#endif

typedef float vf __attribute__((vector_size(W * 4)));
typedef int32_t vi __attribute__((vector_size(W * 4)));
typedef uint16_t vh __attribute__((vector_size(W * 2)));
typedef uint32_t vu __attribute__((vector_size(W * 4)));

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Query rows per register block: RB rows x 2 vectors of accumulators must fit the register file
// (16 vector registers below AVX-512, 32 with it).
constexpr int kRB = W == 16 ? 8 : 6;
constexpr int kRowBlock = 32;  // rows of a chunk-first matrix kept hot together

// A plain broadcast: `vf{} + x` would add 0.0f first (not a no-op under IEEE signed zeros) and
// put a scalar add on the inner loops' critical path; a lane loop becomes a chain of inserts.
#if defined(__AVX512F__)
inline vf splat(float x) { return (vf)_mm512_set1_ps(x); }
#elif defined(__AVX__)
inline vf splat(float x) { return (vf)_mm256_set1_ps(x); }
#elif defined(__SSE__)
inline vf splat(float x) { return (vf)_mm_set1_ps(x); }
#else
inline vf splat(float x) { return vf{} + x; }
#endif
inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline vf load(const uint16_t* p) {  // bf16 -> fp32 is a 16-bit shift
  vh h;
  std::memcpy(&h, p, sizeof h);
  vu u = __builtin_convertvector(h, vu) << 16;
  return (vf)u;
}
inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
inline vf vmax(vf a, vf b) { return a > b ? a : b; }
inline vf vmin(vf a, vf b) { return a < b ? a : b; }
#if defined(__AVX512F__)
inline float hsum(vf v) { return _mm512_reduce_add_ps((__m512)v); }
inline float hmax(vf v) { return _mm512_reduce_max_ps((__m512)v); }
#else
inline float hsum(vf v) {
  float s = 0.f;
  for (int i = 0; i < W; ++i) s += v[i];
  return s;
}
inline float hmax(vf v) {
  float m = v[0];
  for (int i = 1; i < W; ++i) m = std::max(m, v[i]);
  return m;
}
#endif
// Lanes [0, left) of a vector: token masks for a chunk's last, partly filled vector (no scalar
// stores into a buffer that is then read as a vector: that stalls store forwarding).
inline vi lanes_below(int left) {
  vi iota;
  for (int i = 0; i < W; ++i) iota[i] = i;
  return iota < (vi{} + left);
}

// exp on a vector (Cephes polynomial, ~1 ulp in the range softmax uses); scalar expf per score
// would cost as much as the matrix products themselves.
inline vf vexp(vf x) {
  x = vmax(vmin(x, splat(88.3762626647949f)), splat(-87.3365447504f));
  vf fx = x * 1.44269504088896341f + 0.5f;
  vi ti = __builtin_convertvector(fx, vi);
  vf tf = __builtin_convertvector(ti, vf);
  tf = tf + __builtin_convertvector((vi)(tf > fx), vf);  // floor: subtract 1 where trunc rounded up
  x = x - tf * 0.693359375f + tf * 2.12194440e-4f;
  vf z = x * x;
  vf y = splat(1.9875691500E-4f);
  y = y * x + 1.3981999507E-3f;
  y = y * x + 8.3334519073E-3f;
  y = y * x + 4.1665795894E-2f;
  y = y * x + 1.6666665459E-1f;
  y = y * x + 5.0000001201E-1f;
  y = y * z + x + 1.0f;
  vi n = (__builtin_convertvector(tf, vi) + 127) << 23;
  return y * (vf)n;
}

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
        acc[r][0] += qb * k0;
        acc[r][1] += qb * k1;
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
      for (int r = 0; r < RB; ++r) acc[r] += splat(q[r * d + t]) * k0;
    }
    for (int r = 0; r < RB; ++r) store(s + r * C + jv * W, acc[r]);
  }
}

// o[r] = o[r] * alpha[r] + p[r, :n] @ V for RB rows; V is [C, d].
template <typename T, int RB>
inline void weighted_values(const float* p, int C, const T* v, int n, int d, float* o,
                            const float* alpha) {
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
        acc[r][0] += pb * v0;
        acc[r][1] += pb * v1;
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
      for (int r = 0; r < RB; ++r) acc[r] += splat(p[r * C + j]) * v0;
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
  std::vector<float> q, o, m, l, s, alpha;
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
inline void values_rows(const float* p, int R, int C, const T* v, int n, int d, float* o,
                        const float* alpha) {
  if constexpr (RB > 1) {
    if (R < RB) return values_rows<T, RB - 1>(p, R, C, v, n, d, o, alpha);
  }
  int r = 0;
  for (; r + RB <= R; r += RB)
    weighted_values<T, RB>(p + static_cast<size_t>(r) * C, C, v, n, d, o + r * d, alpha + r);
  if constexpr (RB > 1) {
    if (r < R)
      values_rows<T, RB - 1>(p + static_cast<size_t>(r) * C, R - r, C, v, n, d, o + r * d, alpha + r);
  }
}

// cap * tanh(x / cap) (Gemma 2's logit soft-capping), tanh(y) = 1 - 2 / (e^2y + 1): its absolute
// error (~1e-7, times cap) is far below the scores' own rounding.
inline vf soft_cap(vf x, float cap) {
  const vf e = vexp(x * (2.f / cap));
  return (1.f - 2.f / (e + 1.f)) * cap;
}

// A row's scores of one chunk beyond what full attention does: soft-capped (cap > 0) and, with a
// window, tokens below `lo` (before the row's window) masked out.
struct ChunkMask {
  const int* lo;  // per row: first token of the chunk inside the row's window (0: all of it)
  float cap;
};

// Online softmax of row r's n scores (nv vectors at sr, the last one's valid lanes `tail`): sr
// becomes the probabilities against the new max, alpha the old state's rescale factor.
template <bool Masked>
inline void row_softmax(float* sr, int nv, vi tail, int lo, float cap, float& m, float& l, float& alpha) {
  vf mx = splat(kNegInf);
  if constexpr (!Masked) {
    for (int jv = 0; jv + 1 < nv; ++jv) mx = vmax(mx, load(sr + jv * W));
    mx = vmax(mx, tail ? load(sr + (nv - 1) * W) : splat(kNegInf));
  } else {
    for (int jv = 0; jv < nv; ++jv) {
      vf x = load(sr + jv * W);
      if (cap > 0.f) x = soft_cap(x, cap);
      vi keep = ~lanes_below(lo - jv * W);
      if (jv + 1 == nv) keep &= tail;
      x = keep ? x : splat(kNegInf);
      store(sr + jv * W, x);
      mx = vmax(mx, x);
    }
  }
  const float mnew = std::max(m, hmax(mx));
  if (Masked && mnew == kNegInf) {  // nothing of this chunk (or before it) in the row's window
    for (int jv = 0; jv < nv; ++jv) store(sr + jv * W, vf{});
    alpha = 1.f;
    return;
  }
  const vf mv = splat(mnew);
  vf sum = {};
  for (int jv = 0; jv < nv; ++jv) {
    const vf x = load(sr + jv * W);
    vf e = vexp(x - mv);
    if constexpr (Masked)
      e = x == splat(kNegInf) ? vf{} : e;  // vexp clamps -inf to a tiny positive value
    else if (jv + 1 == nv)
      e = tail ? e : vf{};  // padded lanes carry no weight
    store(sr + jv * W, e);
    sum += e;
  }
  alpha = mnew == m ? 1.f : std::exp(m - mnew);  // 0 on a row's first chunk (m = -inf)
  l = l * alpha + hsum(sum);
  m = mnew;
}

// Online-softmax update of R scaled query rows (q [R, d]) with the first n tokens of one chunk.
// Masked: per-row window starts and soft-capping (mask); full attention instantiates without them.
template <typename T, bool Masked>
void attend_chunk(const float* q, int R, const T* kt, const T* v, int n, int C, int d, float* o,
                  float* m, float* l, float* s, float* alpha, ChunkMask mask = {nullptr, 0.f}) {
  const int nv = (n + W - 1) / W;
  scores_rows<T, kRB>(q, R, kt, nv, C, d, s);

  const vi tail = lanes_below(n - (nv - 1) * W);  // valid lanes of the last vector
  for (int r = 0; r < R; ++r)
    row_softmax<Masked>(s + static_cast<size_t>(r) * C, nv, tail, Masked && mask.lo ? mask.lo[r] : 0,
                        mask.cap, m[r], l[r], alpha[r]);

  values_rows<T, kRB>(s, R, C, v, n, d, o, alpha);
}

// Fold a partial (po, pm, pl) into a running state (o, m, l).
inline void merge_partial(float* o, float& m, float& l, const float* po, float pm, float pl, int d) {
  if (pl == 0.f) return;
  const float mn = std::max(m, pm);
  const float a = std::exp(m - mn), b = std::exp(pm - mn);
  for (int i = 0; i < d; ++i) o[i] = o[i] * a + po[i] * b;
  l = l * a + pl * b;
  m = mn;
}

// Stores row b's new k, v of head h (see DecodeProblem::new_k) into the pool layer.
template <typename T>
inline void store_new_kv(const DecodeProblem& p, int b, int h) {
  const size_t head_elems = static_cast<size_t>(p.head_dim) * p.chunk, slot = p.write_slot[b];
  const size_t base = (slot * p.kv_heads + h) * head_elems;
  const int C = p.chunk, d = p.head_dim, off = p.write_offset[b];
  // The pool layer is the op's mutable argument; the kernel only reads it through p.k, p.v.
  T* kt = static_cast<T*>(const_cast<void*>(p.k)) + base + off;  // a column of K^T
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

// Chunk-first work: shared chunks group_chunks[first, last), which all cover rows [begin, end) of
// the batch, against one KV head. Chunks covering the same rows lie on the same paths, so one
// online softmax runs over all of them and leaves one partial per row (stored at the first chunk's
// partial rows; the others get l = 0, which the merge skips) instead of one per chunk.
struct SharedItem {
  int first, last, head, begin, end;
};
// Sequence-first work: rows [begin, end) against one KV head, each over segment `seg` of its own
// chunks (several segments only for a lone long tail; then end = begin + 1).
struct SeqItem {
  int begin, end, head, seg;
};

// Reused between calls so that a steady decode loop does not allocate.
struct Workspace {
  std::vector<int64_t> shared_row;  // first partial row of each shared chunk
  std::vector<float> part_o, part_m, part_l;
  std::vector<SharedItem> shared_items;
  std::vector<int32_t> group_chunks;  // live shared chunks, ordered by their row range
  std::vector<int32_t> chunk_slot, chunk_len, seq_chunk_ptr;  // chunks each sequence reads itself
  std::vector<int32_t> seq_nseg, seg_row;
  std::vector<float> seg_o, seg_m, seg_l;
  std::vector<SeqItem> seq_items;
  std::vector<uint8_t> item_writes;  // row b's new K/V are stored by its sequence-first item
  // Sliding windows: rows [eff_begin, eff_end) of each shared chunk read it (all its rows without a
  // window); with one, each shared chunk's first position, each row's window start, and the first
  // token inside the window of each chunk a row reads itself.
  std::vector<int32_t> eff_begin, eff_end, shared_pos, row_lo, chunk_lo;
};

Workspace& workspace() {
  static Workspace ws;
  return ws;
}

template <typename Vec>
void grow(Vec& v, size_t n) {
  if (v.size() < n) v.resize(n);
}

// The rows of each shared chunk that read it. With a window, a row whose window starts past a
// chunk's last position skips it: the chunk's rows shrink to the first and last row that reach it
// (rows between that do not are masked whole), and a chunk no row reaches has none, so nothing
// reads it. Also each shared chunk's first position and each row's window start.
void plan_windows(const DecodeProblem& p, Workspace& ws) {
  const int S = p.num_shared, B = p.batch, C = p.chunk;
  grow(ws.eff_begin, S);
  grow(ws.eff_end, S);
  std::copy_n(p.shared_begin, S, ws.eff_begin.begin());
  std::copy_n(p.shared_end, S, ws.eff_end.begin());
  if (p.window <= 0) return;
  grow(ws.shared_pos, S);
  grow(ws.row_lo, B);
  for (int b = 0; b < B; ++b) {
    int pos = 0;
    for (int i = p.seq_shared_ptr[b]; i < p.seq_shared_ptr[b + 1]; ++i) {
      const int c = p.seq_shared_idx[i];
      ws.shared_pos[c] = pos;  // a shared chunk is one node of the tree: one position for all rows
      pos += p.shared_len[c];
    }
    const int np = p.priv_count[b];
    const int len = pos + (np > 0 ? (np - 1) * C + p.priv_last_len[b] : 0);
    ws.row_lo[b] = std::max(0, len - p.window);
  }
  for (int c = 0; c < S; ++c) {
    const int end_pos = ws.shared_pos[c] + p.shared_len[c];
    int lo = p.shared_end[c], hi = p.shared_begin[c];
    for (int b = p.shared_begin[c]; b < p.shared_end[c]; ++b)
      if (ws.row_lo[b] < end_pos) lo = std::min(lo, b), hi = b + 1;
    ws.eff_begin[c] = lo < hi ? lo : p.shared_begin[c];
    ws.eff_end[c] = lo < hi ? hi : p.shared_begin[c];
  }
}

// First token of a chunk at position pos with n tokens inside row b's window (n: none).
inline int window_lo(const Workspace& ws, int b, int pos, int n) {
  return std::clamp(ws.row_lo[b] - pos, 0, n);
}

// Tokens row b reads in the sequence-first phase.
inline int64_t seq_tokens(const Workspace& ws, int b) {
  int64_t n = 0;
  for (int i = ws.seq_chunk_ptr[b]; i < ws.seq_chunk_ptr[b + 1]; ++i) n += ws.chunk_len[i];
  return n;
}

// The partials of rows [b0, b1) of item w (state rows (b - b0) * G + g): at the item's first chunk;
// its other chunks' partials for those rows are marked empty (l = 0).
inline void store_partials(const DecodeProblem& p, Workspace& ws, const SharedItem& w, int b0, int b1,
                           const float* o, const float* m, const float* l) {
  const int Hq = p.q_heads, G = Hq / p.kv_heads, d = p.head_dim, h = w.head;
  for (int i = w.first; i < w.last; ++i) {
    const int c = ws.group_chunks[i];
    for (int b = b0; b < b1; ++b)
      for (int g = 0; g < G; ++g) {
        const size_t pr = static_cast<size_t>(ws.shared_row[c] + b - p.shared_begin[c]) * Hq + h * G + g;
        const int r = (b - b0) * G + g;
        if (i == w.first) {
          std::memcpy(ws.part_o.data() + pr * d, o + static_cast<size_t>(r) * d, sizeof(float) * d);
          ws.part_m[pr] = m[r];
          ws.part_l[pr] = l[r];
        } else {
          ws.part_l[pr] = 0.f;
        }
      }
  }
}

#if defined(CHUNKGEN_HAVE_AVX512_BF16)

// Per-thread buffers of the bf16 chunk-first phase: one chunk's K and V repacked, then queries,
// scores, probabilities, the product P.V and the running (o, m, l) of a block of rows.
struct Bf16Scratch {
  std::vector<uint16_t> kp, vp, q, p;
  std::vector<float> s, o, m, l, lv;
};

constexpr int kBf16Rows = 32;     // query rows per product: two 16-row tiles
constexpr int kBlockTokens = 256;  // chunk tokens per product (a multiple of 16)
// A row's later blocks take their probabilities against the max it has so far, up to 2^8 times
// above it (exact in fp32, and bf16's rounding is relative): no pass for the block's max first.
constexpr float kLazyHeadroom = 8.f;  // log2 units

// Item w (shared chunks x rows, one KV head) in bf16 products with fp32 accumulation and an fp32
// online softmax across its chunks; stores each row's partial (o, m, l) like the fp32 path.
template <typename Q>
void shared_item_bf16(const DecodeProblem& p, Workspace& ws, const SharedItem& w, Isa isa,
                      Bf16Scratch& sc) {
  const int Hq = p.q_heads, Hk = p.kv_heads, G = Hq / Hk, d = p.head_dim, C = p.chunk, h = w.head;
  const int dp = bf16::round_up(d, 32), Cp = bf16::round_up(C, 32);
  const size_t head_elems = static_cast<size_t>(d) * C, slot_elems = head_elems * Hk;
  const auto gemm = isa == Isa::Amx ?
#if defined(CHUNKGEN_HAVE_AMX)
                                    bf16::gemm_amx
#else
                                    bf16::gemm_dpbf16
#endif
                                    : bf16::gemm_dpbf16;
  const Q* q = static_cast<const Q*>(p.q);
  const uint16_t* K = static_cast<const uint16_t*>(p.k);
  const uint16_t* V = static_cast<const uint16_t*>(p.v);
  const __m512 scale = _mm512_set1_ps(p.scale);
  constexpr float kLog2e = 1.44269504088896341f;
  const __m512 scale2 = _mm512_set1_ps(p.scale * kLog2e);
  const __m512 neg_inf = _mm512_set1_ps(kNegInf);
  // Chunks go through in blocks of up to kBlockTokens tokens: one product per block, not per
  // chunk, since each hand-over between the AMX tiles and the vector units goes through memory and
  // waits for it; a longer product also keeps more tile operations in flight.
  const int per_block = std::max(1, kBlockTokens / C);
  const int Nb = per_block * C, Kb = bf16::round_up(Nb, 32);  // columns of S, rows of packed V
  grow(sc.kp, static_cast<size_t>(dp) * Nb);
  grow(sc.vp, static_cast<size_t>(Kb) * d);
  const int R = (w.end - w.begin) * G, Rp = bf16::round_up(R, 16);
  grow(sc.q, static_cast<size_t>(Rp) * dp);
  grow(sc.o, static_cast<size_t>(Rp) * d);
  grow(sc.m, Rp);
  grow(sc.l, Rp);
  grow(sc.s, static_cast<size_t>(kBf16Rows) * Nb);
  grow(sc.p, static_cast<size_t>(kBf16Rows) * Kb);
  // Queries of the item as bf16 rows of dp (zero padded); the scale is applied to the fp32 scores.
  for (int r = 0; r < Rp; ++r) {
    uint16_t* dst = sc.q.data() + static_cast<size_t>(r) * dp;
    sc.m[r] = kNegInf;
    if (r >= R) {
      std::fill_n(dst, dp, uint16_t{0});
      continue;
    }
    const Q* src = q + (static_cast<size_t>(w.begin + r / G) * Hq + h * G + r % G) * d;
    if constexpr (sizeof(Q) == 2)
      std::memcpy(dst, src, sizeof(uint16_t) * d);
    else
      for (int i = 0; i < d; ++i) dst[i] = bf16::from_float(src[i]);
    std::fill(dst + d, dst + dp, uint16_t{0});
  }

  // l is kept as 16 lane sums per row (reduced once at the end): no horizontal add per chunk.
  grow(sc.lv, static_cast<size_t>(Rp) * 16);
  std::fill_n(sc.lv.data(), static_cast<size_t>(Rp) * 16, 0.f);
  int len[kBlockTokens / 16];  // valid tokens of each chunk of the block
  int pos[kBlockTokens / 16];  // and their first positions (with a window)
  int lo[kBlockTokens / 16] = {};  // a row's first token of each chunk inside its window
  const bool windowed = p.window > 0;
  const float cap = p.softcap;
  const int region_lines = static_cast<int>(head_elems * sizeof(uint16_t) / 64);  // of one chunk's K or V
  for (int i0 = w.first; i0 < w.last; i0 += per_block) {
    const int nc = std::min(per_block, w.last - i0), N = nc * C, Kn = bf16::round_up(N, 32);
    const bool first = i0 == w.first;
    // The next block's K and V, fetched into L2 a few lines per softmax row of this one, so that
    // its repacking does not wait on memory (measured 4-5% of the kernel).
    const char* next[2 * kBlockTokens / 16];
    int n_next = 0;
    for (int j = 0; j < per_block && i0 + per_block + j < w.last; ++j) {
      const int c = ws.group_chunks[i0 + per_block + j];
      const size_t off = p.shared_slot[c] * slot_elems + h * head_elems;
      next[n_next++] = reinterpret_cast<const char*>(K + off);
      next[n_next++] = reinterpret_cast<const char*>(V + off);
    }
    const int next_lines = n_next * region_lines;
    for (int j = 0; j < nc; ++j) {
      const int c = ws.group_chunks[i0 + j];
      len[j] = p.shared_len[c];
      if (windowed) pos[j] = ws.shared_pos[c];
      const size_t off = p.shared_slot[c] * slot_elems + h * head_elems;
      // K^T [d, C] side by side (pairs along d); V [C, d] stacked (pairs along tokens).
      bf16::pack_pairs(K + off, C, d, dp, C, len[j], sc.kp.data() + 2 * j * C, N);
      bf16::pack_pairs(V + off, d, len[j], C, d, d, sc.vp.data() + static_cast<size_t>(j) * C * d);
    }
    std::fill(sc.vp.data() + static_cast<size_t>(N) * d, sc.vp.data() + static_cast<size_t>(Kn) * d, uint16_t{0});
    for (int r0 = 0; r0 < Rp; r0 += kBf16Rows) {
      const int rows = std::min(kBf16Rows, Rp - r0);
      gemm(sc.q.data() + static_cast<size_t>(r0) * dp, dp, sc.kp.data(), dp, N, sc.s.data(), N, rows, false);

      // Online softmax. A row's first block finds its max first; a later block uses the max so
      // far and moves it only when a probability would exceed 2^kLazyHeadroom (rare after the
      // first blocks): then the row is rescaled and its block done again.
      for (int rr = 0; rr < rows; ++rr) {
        const int r = r0 + rr;
        float* sr = sc.s.data() + static_cast<size_t>(rr) * N;
        uint16_t* pr = sc.p.data() + static_cast<size_t>(rr) * Kn;
        for (int l = static_cast<int>(static_cast<int64_t>(r) * next_lines / Rp),
                 l_end = static_cast<int>(static_cast<int64_t>(r + 1) * next_lines / Rp);
             l < l_end; ++l)
          _mm_prefetch(next[l / region_lines] + 64 * (l % region_lines), _MM_HINT_T1);
        if (r >= R) {  // padding rows carry no weight
          std::fill_n(pr, Kn, uint16_t{0});
          continue;
        }
        if (windowed)
          for (int jc = 0; jc < nc; ++jc) lo[jc] = window_lo(ws, w.begin + r / G, pos[jc], len[jc]);
        if (cap > 0.f) {  // capped as scale * s would be, so the scale still applies below
          const float inv = 1.f / p.scale;
          for (int j = 0; j < N; j += 16) store(sr + j, soft_cap(load(sr + j) * p.scale, cap) * inv);
        }
        float m = sc.m[r];
        bool lazy = m != kNegInf;
        __m512 mx = neg_inf;
        if (!lazy)
          for (int jc = 0; jc < nc; ++jc)
            for (int j = 0; j < C; j += 16)
              mx = _mm512_max_ps(mx, _mm512_mask_mul_ps(neg_inf, bf16::valid_lanes(j, len[jc]) & ~bf16::valid_lanes(j, lo[jc]),
                                                         _mm512_loadu_ps(sr + jc * C + j), scale));
      rescale:
        if (_mm512_cmp_ps_mask(mx, _mm512_set1_ps(m), _CMP_GT_OQ)) {
          const float mnew = _mm512_reduce_max_ps(mx);
          const float alpha = std::exp(m - mnew);  // 0 on the first block (m was -inf)
          m = mnew;
          sc.m[r] = m;
          float* lv = sc.lv.data() + static_cast<size_t>(r) * 16;
          _mm512_storeu_ps(lv, _mm512_mul_ps(_mm512_loadu_ps(lv), _mm512_set1_ps(alpha)));
          if (!first) {
            float* o = sc.o.data() + static_cast<size_t>(r) * d;
            const __m512 av = _mm512_set1_ps(alpha);
            for (int k = 0; k < d; k += 16) _mm512_storeu_ps(o + k, _mm512_mul_ps(_mm512_loadu_ps(o + k), av));
          }
        }
        if (m == kNegInf) {  // the row's window starts past this block (and every earlier one)
          std::fill_n(pr, Kn, uint16_t{0});
          continue;
        }
        // exp(s * scale - m) = 2^(s * scale log2(e) - m log2(e)): one FMA before the power of two.
        const __m512 neg_m2 = _mm512_set1_ps(-m * kLog2e);
        __m512 sum = _mm512_setzero_ps(), xmax = neg_inf;
        // One chunk's probabilities; a full chunk (most of them) needs no mask of valid lanes.
        const auto probabilities = [&](auto full, auto track_max, int jc) {
          for (int j = jc * C, j_end = j + C; j < j_end; j += 16) {
            const __m512 x = _mm512_fmadd_ps(_mm512_loadu_ps(sr + j), scale2, neg_m2);
            const __mmask16 valid = full ? __mmask16(0xffff)
                                         : bf16::valid_lanes(j - jc * C, len[jc]) & ~bf16::valid_lanes(j - jc * C, lo[jc]);
            if constexpr (track_max) xmax = full ? _mm512_max_ps(xmax, x) : _mm512_mask_max_ps(xmax, valid, xmax, x);
            const __m512 e = full ? bf16::exp2_bf16(x) : _mm512_maskz_mov_ps(valid, bf16::exp2_bf16(x));
            // l sums the probabilities as rounded for the product, so o / l stays a weighted mean.
            const __m256bh eb = _mm512_cvtneps_pbh(e);
            sum = _mm512_add_ps(sum, _mm512_cvtpbh_ps(eb));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + j), (__m256i)eb);
          }
        };
        using Yes = std::true_type;
        using No = std::false_type;
        for (int jc = 0; jc < nc; ++jc) {
          const bool full = len[jc] == C && lo[jc] == 0;
          if (lazy)
            full ? probabilities(Yes{}, Yes{}, jc) : probabilities(No{}, Yes{}, jc);
          else
            full ? probabilities(Yes{}, No{}, jc) : probabilities(No{}, No{}, jc);
        }
        if (lazy) {
          const float over = _mm512_reduce_max_ps(xmax);  // log2 of the largest probability
          if (over > kLazyHeadroom) {
            mx = _mm512_set1_ps(m + over / kLog2e);
            lazy = false;
            goto rescale;
          }
        }
        std::fill(pr + N, pr + Kn, uint16_t{0});
        float* lv = sc.lv.data() + static_cast<size_t>(r) * 16;
        _mm512_storeu_ps(lv, _mm512_add_ps(_mm512_loadu_ps(lv), sum));
      }
      // o (+)= P V straight into the running sums (AMX loads them into the accumulator tiles).
      gemm(sc.p.data(), Kn, sc.vp.data(), Kn, d, sc.o.data() + static_cast<size_t>(r0) * d, d, rows, !first);
    }
  }
  for (int r = 0; r < R; ++r) sc.l[r] = _mm512_reduce_add_ps(_mm512_loadu_ps(sc.lv.data() + static_cast<size_t>(r) * 16));
  store_partials(p, ws, w, w.begin, w.end, sc.o.data(), sc.m.data(), sc.l.data());
}

#endif  // CHUNKGEN_HAVE_AVX512_BF16

template <typename T, typename Q>
void run(const DecodeProblem& p, Isa isa) {
  const int B = p.batch, Hq = p.q_heads, Hk = p.kv_heads, G = Hq / Hk, d = p.head_dim,
            C = p.chunk;
  const T* K = static_cast<const T*>(p.k);
  const T* V = static_cast<const T*>(p.v);
  const Q* q = static_cast<const Q*>(p.q);
  Q* out = static_cast<Q*>(p.out);
  const size_t head_elems = static_cast<size_t>(d) * C;
  const size_t slot_elems = head_elems * Hk;
  const int nthreads = omp_get_max_threads();
  const int target_items = 4 * nthreads;
  Workspace& ws = workspace();

  // ---- plan phase 1: (shared chunk, kv head, sequence range) items.
  const bool windowed = p.window > 0, masked = windowed || p.softcap > 0.f;
  plan_windows(p, ws);
  const int32_t* eff_begin = ws.eff_begin.data();
  const int32_t* eff_end = ws.eff_end.data();
  const int S = p.chunk_first ? p.num_shared : 0;
  grow(ws.shared_row, S + 1);
  ws.shared_row[0] = 0;
  int64_t shared_work = 0;
  for (int c = 0; c < S; ++c) {
    ws.shared_row[c + 1] = ws.shared_row[c] + p.shared_end[c] - p.shared_begin[c];
    shared_work += static_cast<int64_t>(eff_end[c] - eff_begin[c]) * Hk;
  }
  // Group the live chunks by the rows that read them; split each group's (rows x chunks) work per
  // head into about target_items pieces, by chunks first (each piece repacks/reads its chunks once).
  ws.group_chunks.clear();
  for (int c = 0; c < S; ++c)
    if (eff_end[c] > eff_begin[c]) ws.group_chunks.push_back(c);
  std::sort(ws.group_chunks.begin(), ws.group_chunks.end(), [&](int a, int b) {
    if (eff_begin[a] != eff_begin[b]) return eff_begin[a] < eff_begin[b];
    if (eff_end[a] != eff_end[b]) return eff_end[a] < eff_end[b];
    return a < b;
  });
  // About three equal pieces a thread: enough for the dynamic schedule to even out, and long, since
  // every piece restarts its rows' softmax and adds partial rows for phase 2 to merge (8 pieces a
  // thread measured 6-17% slower than 3).
  const int64_t per_item = std::max<int64_t>(4, (shared_work + 3 * nthreads - 1) / (3 * nthreads));
  int block = 1;  // chunks the bf16 path multiplies at once
#if defined(CHUNKGEN_HAVE_AVX512_BF16)
  if (isa != Isa::Fp32 && sizeof(T) == 2) block = std::max(1, kBlockTokens / C);
#endif
  ws.shared_items.clear();
  const int n_live = static_cast<int>(ws.group_chunks.size());
  for (int g0 = 0, g1; g0 < n_live; g0 = g1) {
    const int c0 = ws.group_chunks[g0], begin = eff_begin[c0], end = eff_end[c0];
    for (g1 = g0 + 1; g1 < n_live && eff_begin[ws.group_chunks[g1]] == begin &&
                      eff_end[ws.group_chunks[g1]] == end;
         ++g1) {
    }
    const int nch = g1 - g0, cover = end - begin;
    const int64_t pieces = (static_cast<int64_t>(cover) * nch + per_item - 1) / per_item;
    // The bf16 path multiplies chunks in blocks: a piece of whole blocks, never a block cut short.
    const int blocks = (nch + block - 1) / block;
    const int chunk_pieces = static_cast<int>(std::min<int64_t>(blocks, pieces));
    const int row_pieces = static_cast<int>(std::max<int64_t>(1, (pieces + chunk_pieces - 1) / chunk_pieces));
    const int rows_per = (cover + row_pieces - 1) / row_pieces;
    const auto cut = [&](int cp) {
      return g0 + std::min(nch, cp * blocks / chunk_pieces * block);
    };
    for (int h = 0; h < Hk; ++h)
      for (int cp = 0; cp < chunk_pieces; ++cp)
        for (int b = begin; b < end; b += rows_per)
          ws.shared_items.push_back({cut(cp), cp + 1 == chunk_pieces ? g1 : cut(cp + 1), h, b, std::min(b + rows_per, end)});
  }
  const size_t part_rows = static_cast<size_t>(ws.shared_row[S]) * Hq;
  grow(ws.part_o, part_rows * d);
  grow(ws.part_m, part_rows);
  grow(ws.part_l, part_rows);

  // ---- plan phase 2: the chunks each sequence reads itself, split into segments.
  grow(ws.seq_chunk_ptr, B + 1);
  ws.chunk_slot.clear();
  ws.chunk_len.clear();
  ws.chunk_lo.clear();
  ws.seq_chunk_ptr[0] = 0;
  for (int b = 0; b < B; ++b) {
    // With a window, a chunk that ends before the row's window is left out, and the first token
    // inside the window is kept for each chunk that is read.
    int pos = 0;
    const auto add = [&](int slot, int n) {
      if (windowed) {
        const int lo = window_lo(ws, b, pos, n);
        pos += n;
        if (lo == n) return;
        ws.chunk_lo.push_back(lo);
      }
      ws.chunk_slot.push_back(slot);
      ws.chunk_len.push_back(n);
    };
    for (int i = p.seq_shared_ptr[b]; i < p.seq_shared_ptr[b + 1]; ++i) {
      const int c = p.seq_shared_idx[i];
      if (!p.chunk_first)
        add(p.shared_slot[c], p.shared_len[c]);
      else
        pos += p.shared_len[c];
    }
    const int np = p.priv_count[b];
    for (int i = 0; i < np; ++i)
      add(p.priv_slot[static_cast<size_t>(b) * p.priv_stride + i], i + 1 == np ? p.priv_last_len[b] : C);
    ws.seq_chunk_ptr[b + 1] = static_cast<int32_t>(ws.chunk_slot.size());
  }
  const int base_items = B * Hk;
  const int max_seg = base_items >= target_items ? 1 : (target_items + base_items - 1) / base_items;
  grow(ws.seq_nseg, B);
  grow(ws.seg_row, B + 1);
  ws.seg_row[0] = 0;
  ws.seq_items.clear();
  for (int b = 0; b < B; ++b) {
    const int nc = ws.seq_chunk_ptr[b + 1] - ws.seq_chunk_ptr[b];
    const int nseg = std::max(1, std::min(nc, max_seg));
    ws.seq_nseg[b] = nseg;
    ws.seg_row[b + 1] = ws.seg_row[b] + (nseg > 1 ? nseg : 0);
  }
  if (max_seg > 1) {  // few rows: one item per (row, head, segment), so both cores have work
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < Hk; ++h)
        for (int sgi = 0; sgi < ws.seq_nseg[b]; ++sgi) ws.seq_items.push_back({b, b + 1, h, sgi});
  } else {
    // Many rows: consecutive rows grouped into items of about equal work (tokens read, plus a
    // fixed cost per row), a few items per thread: a row's few hundred nanoseconds of work would
    // otherwise be matched by the cost of handing it out.
    constexpr int64_t kRowCost = 32;
    int64_t total = 0;
    for (int b = 0; b < B; ++b) total += kRowCost + seq_tokens(ws, b);
    const int per_head = std::max(1, (4 * target_items + Hk - 1) / Hk);
    const int64_t per_item = std::max<int64_t>(1, (total + per_head - 1) / per_head);
    for (int b0 = 0, b1; b0 < B; b0 = b1) {
      int64_t work = 0;
      for (b1 = b0; b1 < B && (b1 == b0 || work < per_item); ++b1) work += kRowCost + seq_tokens(ws, b1);
      for (int h = 0; h < Hk; ++h) ws.seq_items.push_back({b0, b1, h, 0});
    }
  }
  // ---- the step's K/V: a live row writes into its last private chunk, which only it reads, so
  // its sequence-first item stores them (on the lines it is about to read); any other row (padding
  // rows write to the scratch slot) is stored now, before anything reads the pool.
  grow(ws.item_writes, B);
  if (p.new_k != nullptr) {
    for (int b = 0; b < B; ++b) {
      const int np = p.priv_count[b];
      ws.item_writes[b] = np > 0 && p.write_slot[b] == p.priv_slot[static_cast<size_t>(b) * p.priv_stride + np - 1];
      if (!ws.item_writes[b])
        for (int h = 0; h < Hk; ++h) store_new_kv<T>(p, b, h);
    }
  } else {
    std::fill_n(ws.item_writes.begin(), B, uint8_t{0});
  }
  const size_t seg_rows = static_cast<size_t>(ws.seg_row[B]) * Hq;
  grow(ws.seg_o, seg_rows * d);
  grow(ws.seg_m, seg_rows);
  grow(ws.seg_l, seg_rows);

  const float scale = p.scale;
  const ChunkMask no_lo{nullptr, p.softcap};
  const int n_shared_items = static_cast<int>(ws.shared_items.size());
  const int n_seq_items = static_cast<int>(ws.seq_items.size());

#pragma omp parallel
  {
    thread_local Scratch sc;

    // ---- phase 1: chunk-first.
    bool fp32_phase1 = true;
#if defined(CHUNKGEN_HAVE_AVX512_BF16)
    if (isa != Isa::Fp32) {
      fp32_phase1 = false;
      thread_local Bf16Scratch bsc;
#if defined(CHUNKGEN_HAVE_AMX)
      static const bf16::TileConfig tile_config;
      if (isa == Isa::Amx) _tile_loadconfig(&tile_config);  // tile configuration is per thread
#endif
#pragma omp for schedule(dynamic, 1)
      for (int it = 0; it < n_shared_items; ++it)
        shared_item_bf16<Q>(p, ws, ws.shared_items[it], isa, bsc);
#if defined(CHUNKGEN_HAVE_AMX)
      if (isa == Isa::Amx) _tile_release();
#endif
    }
#endif
    if (fp32_phase1) {
#pragma omp for schedule(dynamic, 1)
    for (int it = 0; it < n_shared_items; ++it) {
      const SharedItem& w = ws.shared_items[it];
      const int h = w.head;
      const int seq_block = std::max(1, kRowBlock / G);
      for (int b0 = w.begin; b0 < w.end; b0 += seq_block) {
        const int b1 = std::min(w.end, b0 + seq_block);
        const int R = (b1 - b0) * G;
        sc.reserve(R, d, C);
        for (int b = b0; b < b1; ++b)
          for (int g = 0; g < G; ++g) {
            const Q* src = q + (static_cast<size_t>(b) * Hq + h * G + g) * d;
            float* dst = sc.q.data() + static_cast<size_t>((b - b0) * G + g) * d;
            for (int i = 0; i < d; ++i) dst[i] = to_f32(src[i]) * scale;
          }
        sc.reset_state(R, d);
        for (int i = w.first; i < w.last; ++i) {
          const int c = ws.group_chunks[i], n = p.shared_len[c];
          const size_t off = p.shared_slot[c] * slot_elems + h * head_elems;
          if (!masked) {
            attend_chunk<T, false>(sc.q.data(), R, K + off, V + off, n, C, d, sc.o.data(), sc.m.data(),
                                   sc.l.data(), sc.s.data(), sc.alpha.data());
            continue;
          }
          if (windowed)
            for (int r = 0; r < R; ++r) sc.lo[r] = window_lo(ws, b0 + r / G, ws.shared_pos[c], n);
          attend_chunk<T, true>(sc.q.data(), R, K + off, V + off, n, C, d, sc.o.data(), sc.m.data(),
                                sc.l.data(), sc.s.data(), sc.alpha.data(),
                                windowed ? ChunkMask{sc.lo.data(), p.softcap} : no_lo);
        }
        store_partials(p, ws, w, b0, b1, sc.o.data(), sc.m.data(), sc.l.data());
      }
    }
    }  // fp32_phase1

    // ---- phase 2: sequence-first.
#pragma omp for schedule(dynamic, 1)
    for (int it = 0; it < n_seq_items; ++it) {
      const SeqItem& w = ws.seq_items[it];
      const int h = w.head;
      sc.reserve(G, d, C);
      for (int b = w.begin; b < w.end; ++b) {
        const int nseg = ws.seq_nseg[b];
        const int c0 = ws.seq_chunk_ptr[b], nc = ws.seq_chunk_ptr[b + 1] - c0;
        const int lo = c0 + static_cast<int>(static_cast<int64_t>(nc) * w.seg / nseg);
        const int hi = c0 + static_cast<int>(static_cast<int64_t>(nc) * (w.seg + 1) / nseg);
        if (ws.item_writes[b] && w.seg == nseg - 1) store_new_kv<T>(p, b, h);  // its segment has the last chunk
        const Q* src = q + (static_cast<size_t>(b) * Hq + h * G) * d;
        for (int i = 0; i < G * d; ++i) sc.q[i] = to_f32(src[i]) * scale;
        sc.reset_state(G, d);
        if (w.seg == 0 && p.chunk_first) {
          for (int i = p.seq_shared_ptr[b]; i < p.seq_shared_ptr[b + 1]; ++i) {
            const int c = p.seq_shared_idx[i];
            if (b < eff_begin[c] || b >= eff_end[c]) continue;  // outside the row's window: no partial
            for (int g = 0; g < G; ++g) {
              const size_t pr =
                  static_cast<size_t>(ws.shared_row[c] + b - p.shared_begin[c]) * Hq + h * G + g;
              merge_partial(sc.o.data() + g * d, sc.m[g], sc.l[g], ws.part_o.data() + pr * d,
                            ws.part_m[pr], ws.part_l[pr], d);
            }
          }
        }
        for (int i = lo; i < hi; ++i) {
          const int n = ws.chunk_len[i];
          if (n <= 0) continue;
          const size_t off = ws.chunk_slot[i] * slot_elems + h * head_elems;
          if (!masked) {
            attend_chunk<T, false>(sc.q.data(), G, K + off, V + off, n, C, d, sc.o.data(), sc.m.data(),
                                   sc.l.data(), sc.s.data(), sc.alpha.data());
            continue;
          }
          if (windowed) std::fill_n(sc.lo.data(), G, ws.chunk_lo[i]);
          attend_chunk<T, true>(sc.q.data(), G, K + off, V + off, n, C, d, sc.o.data(), sc.m.data(),
                                sc.l.data(), sc.s.data(), sc.alpha.data(),
                                windowed ? ChunkMask{sc.lo.data(), p.softcap} : no_lo);
        }
        for (int g = 0; g < G; ++g) {
          const size_t row = static_cast<size_t>(b) * Hq + h * G + g;
          if (nseg == 1) {
            write_normalized(out + row * d, sc.o.data() + g * d, sc.l[g], d);
          } else {
            const size_t sr = static_cast<size_t>(ws.seg_row[b] + w.seg) * Hq + h * G + g;
            std::memcpy(ws.seg_o.data() + sr * d, sc.o.data() + g * d, sizeof(float) * d);
            ws.seg_m[sr] = sc.m[g];
            ws.seg_l[sr] = sc.l[g];
          }
        }
      }
    }

    // ---- phase 3: merge the segments of long private tails (none: no loop, one barrier less,
    // which matters when the cores are shared and a waiting thread may lose its time slice).
    if (seg_rows > 0)
#pragma omp for schedule(static)
    for (int row = 0; row < B * Hq; ++row) {
      const int b = row / Hq, qh = row % Hq, nseg = ws.seq_nseg[b];
      if (nseg == 1) continue;
      sc.reserve(1, d, C);
      sc.reset_state(1, d);
      for (int sgi = 0; sgi < nseg; ++sgi) {
        const size_t sr = static_cast<size_t>(ws.seg_row[b] + sgi) * Hq + qh;
        merge_partial(sc.o.data(), sc.m[0], sc.l[0], ws.seg_o.data() + sr * d, ws.seg_m[sr],
                      ws.seg_l[sr], d);
      }
      write_normalized(out + static_cast<size_t>(row) * d, sc.o.data(), sc.l[0], d);
    }
  }
}

}  // namespace

int simd_width() { return W; }

const char* cpu_kernel_isa() { return isa_name(current_isa()); }

void decode_attention_cpu(const DecodeProblem& p) {
  const bool q32 = p.q_type == KVType::F32;
  if (p.kv_type == KVType::F32) {
    run<float, float>(p, Isa::Fp32);
    return;
  }
  const Isa isa = current_isa();
  if (q32)
    run<uint16_t, float>(p, isa);
  else
    run<uint16_t, uint16_t>(p, isa);
}

}  // namespace chunkgen
