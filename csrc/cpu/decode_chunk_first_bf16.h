// The decode kernel's chunk-first phase with bf16 K/V on AMX tiles or AVX512_BF16 dot products:
// an item's shared chunks are packed once, in blocks of up to kBlockTokens tokens, and multiplied
// against the queries of every row that reads them (bf16 products, fp32 accumulation); one fp32
// online softmax runs across the item's chunks and leaves one partial (o, m, l) per row.
#pragma once

#include "bf16_gemm.h"  // says whether this build has the bf16 paths

#if defined(CHUNKGEN_HAVE_AVX512_BF16)

#include "intrinsics.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "../attention.h"
#include "aligned.h"
#include "decode_plan.h"
#include "isa.h"
#include "kv_lines.h"
#include "online_softmax.h"
#include "prefetch.h"

namespace chunkgen {
namespace decode {

// Per-thread buffers of the bf16 chunk-first phase: one block's K and V repacked, then queries,
// scores, probabilities, the product P.V and the running (o, m, l) of the item's rows; o1: the
// batch-invariant path's product for a row done chunk by chunk (continue_rows_bf16).
struct Bf16Scratch {
  AlignedVector<uint16_t> kp, vp, q, p;
  AlignedVector<float> s, o, m, l, lv, o1;
};

constexpr int kBf16Rows = 32;      // query rows per product: two 16-row tiles
constexpr int kBlockTokens = 256;  // chunk tokens per product (a multiple of 16)
// A row's later blocks take their probabilities against the max it has so far, up to 2^8 times
// above it (exact in fp32, and bf16's rounding is relative): no pass for the block's max first.
constexpr float kLazyHeadroom = 8.f;  // log2 units
constexpr float kLog2e = 1.44269504088896341f;

using bf16::Gemm;

// One block of an item's chunks, packed: its chunks' valid tokens, first positions (with a window)
// and a row's first token inside its window; N tokens in all, Kn rounded up for the products.
struct Bf16Block {
  int nc, N, Kn;
  bool first;  // the item's first block: the running sums start here
  int len[kBlockTokens / 16];
  int pos[kBlockTokens / 16];
  int lo[kBlockTokens / 16] = {};
};

// The item's queries as bf16 rows of dp (zero padded; rows past R are padding); every row's max
// starts at -inf and its 16 lane sums of l at 0 (reduced once at the end: no horizontal add per chunk).
template <typename Q>
inline void pack_queries(const DecodeProblem& p, int b0, int h, int R, int Rp, int dp, Bf16Scratch& sc) {
  const int Hq = p.q_heads, G = Hq / p.kv_heads, d = p.head_dim;
  const Q* q = static_cast<const Q*>(p.q);
  for (int r = 0; r < Rp; ++r) {
    uint16_t* dst = sc.q.data() + static_cast<size_t>(r) * dp;
    sc.m[r] = kNegInf;
    if (r >= R) {
      std::fill_n(dst, dp, uint16_t{0});
      continue;
    }
    const Q* src = q + (static_cast<size_t>(b0 + r / G) * Hq + h * G + r % G) * d;
    if constexpr (sizeof(Q) == 2)
      std::memcpy(dst, src, sizeof(uint16_t) * d);
    else
      for (int i = 0; i < d; ++i) dst[i] = bf16::from_float(src[i]);
    std::fill(dst + d, dst + dp, uint16_t{0});
  }
  std::fill_n(sc.lv.data(), static_cast<size_t>(Rp) * 16, 0.f);
}

// K^T [d, C] of the block's chunks side by side (pairs along d); V [C, d] stacked (pairs along
// tokens), zero rows up to Kn.
inline void pack_block(const DecodeProblem& p, const Workspace& ws, const SharedItem& w, int i0, int dp, Bf16Block& blk,
                       Bf16Scratch& sc) {
  const int d = p.head_dim, C = p.chunk;
  const size_t head_elems = static_cast<size_t>(d) * C, slot_elems = head_elems * p.kv_heads;
  const uint16_t* K = static_cast<const uint16_t*>(p.k);
  const uint16_t* V = static_cast<const uint16_t*>(p.v);
  for (int j = 0; j < blk.nc; ++j) {
    const int c = ws.group_chunks[i0 + j];
    blk.len[j] = p.shared_len[c];
    if (p.window > 0) blk.pos[j] = ws.shared_pos[c];
    const size_t off = p.shared_slot[c] * slot_elems + w.head * head_elems;
    bf16::pack_pairs(K + off, C, d, dp, C, blk.len[j], sc.kp.data() + 2 * j * C, blk.N);
    bf16::pack_pairs(V + off, d, blk.len[j], C, d, d, sc.vp.data() + static_cast<size_t>(j) * C * d);
  }
  std::fill(sc.vp.data() + static_cast<size_t>(blk.N) * d, sc.vp.data() + static_cast<size_t>(blk.Kn) * d, uint16_t{0});
}

// The next block's K and V regions, to be fetched into L2 a few lines per softmax row of this one,
// so that its repacking does not wait on memory (measured 4-5% of the kernel).
struct NextBlock {
  const char* region[2 * kBlockTokens / 16];
  int regions = 0, region_lines = 1, lines = 0;

  NextBlock(const DecodeProblem& p, const Workspace& ws, const SharedItem& w, int from, int per_block) {
    const size_t head_elems = static_cast<size_t>(p.head_dim) * p.chunk, slot_elems = head_elems * p.kv_heads;
    const uint16_t* K = static_cast<const uint16_t*>(p.k);
    const uint16_t* V = static_cast<const uint16_t*>(p.v);
    region_lines = static_cast<int>(head_elems * sizeof(uint16_t) / 64);
    for (int j = 0; j < per_block && from + j < w.last; ++j) {
      const size_t off = p.shared_slot[ws.group_chunks[from + j]] * slot_elems + w.head * head_elems;
      region[regions++] = reinterpret_cast<const char*>(K + off);
      region[regions++] = reinterpret_cast<const char*>(V + off);
    }
    lines = regions * region_lines;
  }

  // Row r of Rp's share of the lines.
  void prefetch(int r, int Rp) const {
    const int l_end = static_cast<int>(static_cast<int64_t>(r + 1) * lines / Rp);
    for (int l = static_cast<int>(static_cast<int64_t>(r) * lines / Rp); l < l_end; ++l)
      prefetch_l2(region[l / region_lines] + 64 * (l % region_lines));
  }
};

// Row r's probabilities of chunk jc of the block (bf16, stored for the P.V product), summed into
// `sum` as rounded; with TrackMax the largest exponent goes to `xmax`. A full chunk (most of them)
// needs no mask of valid lanes.
template <bool Full, bool TrackMax>
inline void chunk_probabilities(const float* sr, uint16_t* pr, const Bf16Block& blk, int jc, int C, __m512 scale2,
                                __m512 neg_m2, __m512& sum, __m512& xmax) {
  for (int j = jc * C, j_end = j + C; j < j_end; j += 16) {
    const __m512 x = _mm512_fmadd_ps(_mm512_loadu_ps(sr + j), scale2, neg_m2);
    const __mmask16 valid =
        Full ? __mmask16(0xffff)
             : bf16::valid_lanes(j - jc * C, blk.len[jc]) & ~bf16::valid_lanes(j - jc * C, blk.lo[jc]);
    if constexpr (TrackMax) xmax = Full ? _mm512_max_ps(xmax, x) : _mm512_mask_max_ps(xmax, valid, xmax, x);
    const __m512 e = Full ? bf16::exp2_bf16(x) : _mm512_maskz_mov_ps(valid, bf16::exp2_bf16(x));
    // l sums the probabilities as rounded for the product, so o / l stays a weighted mean.
    const __m256bh eb = _mm512_cvtneps_pbh(e);
    sum = _mm512_add_ps(sum, _mm512_cvtpbh_ps(eb));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + j), (__m256i)eb);
  }
}

// Moves row r's max to the largest lane of mx when that is above it, rescaling its running l (and
// o, past the first block) by exp(old - new).
inline void raise_max(Bf16Scratch& sc, const Bf16Block& blk, int r, int d, __m512 mx, float& m) {
  if (!_mm512_cmp_ps_mask(mx, _mm512_set1_ps(m), _CMP_GT_OQ)) return;
  const float mnew = _mm512_reduce_max_ps(mx);
  const float alpha = std::exp(m - mnew);  // 0 on the first block (m was -inf)
  m = mnew;
  sc.m[r] = m;
  float* lv = sc.lv.data() + static_cast<size_t>(r) * 16;
  _mm512_storeu_ps(lv, _mm512_mul_ps(_mm512_loadu_ps(lv), _mm512_set1_ps(alpha)));
  if (blk.first) return;
  float* o = sc.o.data() + static_cast<size_t>(r) * d;
  const __m512 av = _mm512_set1_ps(alpha);
  for (int k = 0; k < d; k += 16) _mm512_storeu_ps(o + k, _mm512_mul_ps(_mm512_loadu_ps(o + k), av));
}

// Scores sr[0, n) capped as scale * s would be, so the scale still applies after.
inline void cap_scores(const DecodeProblem& p, float* sr, int n) {
  const float inv = 1.f / p.scale;
  for (int j = 0; j < n; j += 16) store(sr + j, soft_cap(load(sr + j) * p.scale, p.softcap) * inv);
}

// Online softmax of one row's scores of the block (sr: N scores; pr: its Kn probabilities). A
// row's first block finds its max first; a later block uses the max so far and moves it only when a
// probability would exceed 2^kLazyHeadroom (rare after the first blocks): then the row is rescaled
// and its block done again.
inline void row_block_softmax(const DecodeProblem& p, Bf16Scratch& sc, const Bf16Block& blk, int r, float* sr,
                              uint16_t* pr) {
  const int C = p.chunk, d = p.head_dim;
  const __m512 scale = _mm512_set1_ps(p.scale), scale2 = _mm512_set1_ps(p.scale * kLog2e);
  const __m512 neg_inf = _mm512_set1_ps(kNegInf);
  if (p.softcap > 0.f) cap_scores(p, sr, blk.N);
  float m = sc.m[r];
  bool lazy = m != kNegInf;
  __m512 mx = neg_inf;
  if (!lazy)
    for (int jc = 0; jc < blk.nc; ++jc)
      for (int j = 0; j < C; j += 16)
        mx = _mm512_max_ps(
            mx, _mm512_mask_mul_ps(neg_inf, bf16::valid_lanes(j, blk.len[jc]) & ~bf16::valid_lanes(j, blk.lo[jc]),
                                   _mm512_loadu_ps(sr + jc * C + j), scale));
  for (;;) {
    raise_max(sc, blk, r, d, mx, m);
    if (m == kNegInf) {  // the row's window starts past this block (and every earlier one)
      std::fill_n(pr, blk.Kn, uint16_t{0});
      return;
    }
    // exp(s * scale - m) = 2^(s * scale log2(e) - m log2(e)): one FMA before the power of two.
    const __m512 neg_m2 = _mm512_set1_ps(-m * kLog2e);
    __m512 sum = _mm512_setzero_ps(), xmax = neg_inf;
    for (int jc = 0; jc < blk.nc; ++jc) {
      const bool full = blk.len[jc] == C && blk.lo[jc] == 0;
      if (lazy)
        full ? chunk_probabilities<true, true>(sr, pr, blk, jc, C, scale2, neg_m2, sum, xmax)
             : chunk_probabilities<false, true>(sr, pr, blk, jc, C, scale2, neg_m2, sum, xmax);
      else
        full ? chunk_probabilities<true, false>(sr, pr, blk, jc, C, scale2, neg_m2, sum, xmax)
             : chunk_probabilities<false, false>(sr, pr, blk, jc, C, scale2, neg_m2, sum, xmax);
    }
    // Too far above the max so far (a lane's log2 probability past the headroom): again, from a
    // new max. The lanes are compared first, the horizontal max taken only then.
    if (lazy && _mm512_cmp_ps_mask(xmax, _mm512_set1_ps(kLazyHeadroom), _CMP_GT_OQ)) {
      const float over = _mm512_reduce_max_ps(xmax);  // log2 of the largest probability
      mx = _mm512_set1_ps(m + over / kLog2e);
      lazy = false;
      continue;
    }
    std::fill(pr + blk.N, pr + blk.Kn, uint16_t{0});
    float* lv = sc.lv.data() + static_cast<size_t>(r) * 16;
    _mm512_storeu_ps(lv, _mm512_add_ps(_mm512_loadu_ps(lv), sum));
    return;
  }
}

// Row r's chunks [from, blk.nc) of a block whose max is found (C scores and C probabilities a
// chunk), each against the max so far as row_block_softmax takes a single chunk, bit for bit, with
// its fixed costs once: the first chunk that would move the max (blk.nc when none does), the
// state as the chunks before it left it.
inline int lazy_chunks(const DecodeProblem& p, Bf16Scratch& sc, const Bf16Block& blk, int r, float* sr, uint16_t* pr,
                       int from) {
  const int C = p.chunk;
  const float m = sc.m[r];
  if (m == kNegInf) return from;
  const __m512 scale2 = _mm512_set1_ps(p.scale * kLog2e), neg_m2 = _mm512_set1_ps(-m * kLog2e);
  const __m512 neg_inf = _mm512_set1_ps(kNegInf), headroom = _mm512_set1_ps(kLazyHeadroom);
  float* lv = sc.lv.data() + static_cast<size_t>(r) * 16;
  __m512 l = _mm512_loadu_ps(lv);
  int jc = from;
  for (; jc < blk.nc; ++jc) {
    if (p.softcap > 0.f) cap_scores(p, sr + jc * C, C);
    __m512 sum = _mm512_setzero_ps(), xmax = neg_inf;
    if (blk.len[jc] == C && blk.lo[jc] == 0)
      chunk_probabilities<true, true>(sr, pr, blk, jc, C, scale2, neg_m2, sum, xmax);
    else
      chunk_probabilities<false, true>(sr, pr, blk, jc, C, scale2, neg_m2, sum, xmax);
    if (_mm512_cmp_ps_mask(xmax, headroom, _CMP_GT_OQ)) break;
    l = _mm512_add_ps(l, sum);
  }
  _mm512_storeu_ps(lv, l);
  return jc;
}

// Item w (shared chunks x rows, one KV head) in bf16 products with fp32 accumulation and an fp32
// online softmax across its chunks; leaves each state row's running (o, m, l) in sc.o, sc.m and
// sc.l (state row (b - w.begin) * G + g: row b, query head w.head * G + g).
template <typename Q>
void attend_item_bf16(const DecodeProblem& p, const Workspace& ws, const SharedItem& w, Isa isa, Bf16Scratch& sc) {
  const int G = p.q_heads / p.kv_heads, d = p.head_dim, C = p.chunk;
  const int dp = bf16::round_up(d, 32);
  const Gemm gemm = bf16::gemm_for(isa == Isa::Amx);
  // Chunks go through in blocks of up to kBlockTokens tokens: one product per block, not per
  // chunk, since each hand-over between the AMX tiles and the vector units goes through memory and
  // waits for it; a longer product also keeps more tile operations in flight.
  const int per_block = std::max(1, kBlockTokens / C);
  const int Nb = per_block * C, Kb = bf16::round_up(Nb, 32);  // columns of S, rows of packed V
  const int R = (w.end - w.begin) * G, Rp = bf16::round_up(R, 16);
  grow(sc.kp, static_cast<size_t>(dp) * Nb);
  grow(sc.vp, static_cast<size_t>(Kb) * d);
  grow(sc.q, static_cast<size_t>(Rp) * dp);
  grow(sc.o, static_cast<size_t>(Rp) * d);
  grow(sc.m, Rp);
  grow(sc.l, Rp);
  grow(sc.s, static_cast<size_t>(kBf16Rows) * Nb);
  grow(sc.p, static_cast<size_t>(kBf16Rows) * Kb);
  grow(sc.lv, static_cast<size_t>(Rp) * 16);
  pack_queries<Q>(p, w.begin, w.head, R, Rp, dp, sc);
  Bf16Block blk;
  for (int i0 = w.first; i0 < w.last; i0 += per_block) {
    blk.nc = std::min(per_block, w.last - i0);
    blk.N = blk.nc * C;
    blk.Kn = bf16::round_up(blk.N, 32);
    blk.first = i0 == w.first;
    const NextBlock next(p, ws, w, i0 + per_block, per_block);
    pack_block(p, ws, w, i0, dp, blk, sc);
    for (int r0 = 0; r0 < Rp; r0 += kBf16Rows) {
      const int rows = std::min(kBf16Rows, Rp - r0);
      gemm(sc.q.data() + static_cast<size_t>(r0) * dp, dp, sc.kp.data(), dp, blk.N, sc.s.data(), blk.N, rows, false);
      for (int rr = 0; rr < rows; ++rr) {
        const int r = r0 + rr;
        uint16_t* pr = sc.p.data() + static_cast<size_t>(rr) * blk.Kn;
        next.prefetch(r, Rp);
        if (r >= R) {  // padding rows carry no weight
          std::fill_n(pr, blk.Kn, uint16_t{0});
          continue;
        }
        if (p.window > 0)
          for (int jc = 0; jc < blk.nc; ++jc) blk.lo[jc] = window_lo(ws, w.begin + r / G, blk.pos[jc], blk.len[jc]);
        row_block_softmax(p, sc, blk, r, sc.s.data() + static_cast<size_t>(rr) * blk.N, pr);
      }
      // o (+)= P V straight into the running sums (AMX loads them into the accumulator tiles).
      gemm(sc.p.data(), blk.Kn, sc.vp.data(), blk.Kn, d, sc.o.data() + static_cast<size_t>(r0) * d, d, rows,
           !blk.first);
    }
  }
  for (int r = 0; r < R; ++r)
    sc.l[r] = _mm512_reduce_add_ps(_mm512_loadu_ps(sc.lv.data() + static_cast<size_t>(r) * 16));
}

// The decode kernel's chunk-first item: each row's partial (o, m, l), as the fp32 path stores it.
template <typename Q>
void shared_item_bf16(const DecodeProblem& p, Workspace& ws, const SharedItem& w, Isa isa, Bf16Scratch& sc) {
  attend_item_bf16<Q>(p, ws, w, isa, sc);
  store_partials(p, ws, w, w.begin, w.end, sc.o.data(), sc.m.data(), sc.l.data());
}

// Batch-invariant: the rows of sequences [b0, b1) (head h's query heads) continue their running
// state over n chunks, one chunk at a time, with the same bf16 products and softmax whichever phase
// calls it and whatever other rows share the call: phase 1 for a level's shared group (the state
// from the workspace, left there again), phase 2 for a row's own chunks. Every row's arithmetic is
// its own chain (the products' sums per row and column, the softmax per row, l's 16 lane sums
// carried as they are), so a row's bits do not depend on the rows beside it or on where its path
// is cut into shared groups. chunk(i) gives chunk i's (slot, valid tokens), span(i,
// r) the tokens [lo, len) of it row r reads (its window's first token; a causal row's last). A
// chunk a row reads none of leaves its state as it was, bit for bit. amx: the products on AMX tiles
// (the caller has loaded bf16::TileConfig on this thread), rows padded to whole tiles of 16, else on
// AVX512_BF16's dot products. Either way a row's sums are its own (a tile's row reads only its own
// row of A), but the two are other orders of sums: every caller in a process takes the same one.
struct ChunkRef {
  int64_t slot;
  int len;
};

// The columns of a chunk of len tokens that its products take: S's (K^T's columns, a multiple of
// 16) and P.V's (V's rows, a multiple of 32). Past them every probability and every V row is 0, so
// a partly filled chunk (a row's last) costs what its tokens do; both phases take a chunk alike.
struct ChunkCols {
  int s, pv;
};
inline ChunkCols chunk_cols(int len, int C) { return {std::min(C, bf16::round_up(len, 16)), bf16::round_up(len, 32)}; }

// Chunk `slot`'s K^T [dp, cols.s] (pairs along d) then, at dp * C, V [cols.pv, d] (pairs along
// tokens), head h, its first len tokens (zero past them) into dst: what the bf16 products of one
// chunk read.
inline void pack_chunk(const DecodeProblem& p, int64_t slot, int h, int len, uint16_t* dst) {
  const int d = p.head_dim, C = p.chunk, dp = bf16::round_up(d, 32);
  const ChunkCols cols = chunk_cols(len, C);
  const PoolView pool(p);
  const size_t off = pool.at(slot, h);
  uint16_t* vp = dst + static_cast<size_t>(dp) * C;
  bf16::pack_pairs(static_cast<const uint16_t*>(p.k) + off, C, d, dp, cols.s, len, dst, cols.s);
  bf16::pack_pairs(static_cast<const uint16_t*>(p.v) + off, d, len, cols.pv, d, d, vp);
}
inline size_t packed_chunk_elems(const DecodeProblem& p) {
  return static_cast<size_t>(bf16::round_up(p.head_dim, 32)) * p.chunk +
         static_cast<size_t>(bf16::round_up(p.chunk, 32)) * p.head_dim;
}

// Chunks of one product pass of the batch-invariant path at the most (kBlockTokens of the
// smallest chunks).
constexpr int kMaxBlockChunks = kBlockTokens / 16;

// The next chunks' lines, toward L2 a share per softmax row of the chunks before them, for phase
// 1, which packs each shared chunk as it reaches it (one pack per row piece; the second from L2 or
// L3). A pass that packed every shared chunk once before the items read the step's shared K/V from
// memory with nothing to overlap it, and with its 1.5 MiB of packed chunks a layer some processes
// ran the phase 1.4-1.8x slower than others (32 rows on 2,048 shared, SmolLM2's heads, Zen 5).
struct NextChunkLines {
  const char* k[kMaxBlockChunks];
  const char* v[kMaxBlockChunks];
  int v_lines[kMaxBlockChunks];
  int n = 0, k_lines = 0, lines = 0;

  NextChunkLines() = default;
  NextChunkLines(const DecodeProblem& p, int h, const ChunkRef& c) { add(p, h, c); }

  void add(const DecodeProblem& p, int h, const ChunkRef& c) {
    if (c.len <= 0 || n == kMaxBlockChunks) return;
    const size_t off = PoolView(p).at(c.slot, h);
    k[n] = reinterpret_cast<const char*>(static_cast<const uint16_t*>(p.k) + off);
    v[n] = reinterpret_cast<const char*>(static_cast<const uint16_t*>(p.v) + off);
    k_lines = p.head_dim * p.chunk * 2 / 64;
    v_lines[n] = (c.len * p.head_dim * 2 + 63) / 64;
    lines += k_lines + v_lines[n++];
  }

  void prefetch(int r, int Rp) const {
    const int l_end = static_cast<int>(static_cast<int64_t>(r + 1) * lines / Rp);
    int j = 0, base = 0;  // chunk j's lines start at line base
    for (int l = static_cast<int>(static_cast<int64_t>(r) * lines / Rp); l < l_end; ++l) {
      while (l - base >= k_lines + v_lines[j]) base += k_lines + v_lines[j++];
      const int x = l - base;
      prefetch_l2(x < k_lines ? k[j] + 64 * x : v[j] + 64 * (x - k_lines));
    }
  }
};

// Consecutive chunks that go through one pair of products: their indices and references. Only a
// block's last chunk may be partly filled.
struct ChunkBlock {
  int nc = 0;
  int at[kMaxBlockChunks];
  ChunkRef c[kMaxBlockChunks];
};

// prefetch_next: bring each next block in while this one is read (phase 1's shared chunks; a row's
// own chunks are loaded by the caller, load_chunks). ahead: lines to bring in during the first
// block, a share per softmax row (phase 2: the next row's first chunk).
//
// The arithmetic is one chunk after another; the products take up to kBlockTokens of consecutive
// chunks at once, which leaves every bit as it is: each product's output is one chain of sums over
// k in order (AMX's steps of 32 along k fall on chunk boundaries), so a block's P.V is its chunks'
// P.V one after the other, and each row's softmax still steps chunk by chunk. A row whose max would
// move past a block's first chunk (rare: a probability 2^kLazyHeadroom above its max so far, or a
// window's first token) takes the rest of the block one chunk at a time, alone. Blocks read every
// row's queries and sums once a block, not once a chunk (at 256 rows on SmolLM2's heads they do
// not fit L1), and pay the softmax's fixed costs once a block (lazy_chunks): the phase went from
// 1.2x the fast plan's time to 0.95x at 256 rows on a Zen 5.
template <typename Q, typename ChunkAt, typename SpanAt>
void continue_rows_bf16(const DecodeProblem& p, Workspace& ws, int b0, int b1, int h, bool resume, int n, ChunkAt chunk,
                        SpanAt span, Bf16Scratch& sc, bool amx, bool prefetch_next = false,
                        const NextChunkLines& ahead = NextChunkLines()) {
  const int Hq = p.q_heads, G = Hq / p.kv_heads, d = p.head_dim, C = p.chunk;
  const int dp = bf16::round_up(d, 32), Kn = bf16::round_up(C, 32);
  // Chunks side by side need the products' steps along k to meet at their boundaries.
  const int per_block = C % 32 == 0 ? std::clamp(kBlockTokens / C, 1, kMaxBlockChunks) : 1;
  const int Nb = per_block * C, Kb = per_block * Kn;  // a block's columns of S, rows of V
  // The products' row blocks: AMX's tiles of 16; on dot products register blocks of 8 rows, or 4,
  // or up to 3 rows exactly, for a row's own chunks in phase 2 (one sequence's query heads: 1 to
  // 3 in most models' GQA groups; padding rows would be dot products for nothing).
  const int R = (b1 - b0) * G, Rp = bf16::round_up(R, amx ? 16 : R <= 4 ? 4 : 8);
  const Gemm gemm = amx      ? bf16::gemm_for(true)
                    : R == 1 ? bf16::gemm_dpbf16_rows<1>
                    : R == 2 ? bf16::gemm_dpbf16_rows<2>
                    : R == 3 ? bf16::gemm_dpbf16_rows<3>
                    : R <= 4 ? bf16::gemm_dpbf16<4>
                             : bf16::gemm_dpbf16<8>;
  grow(sc.kp, static_cast<size_t>(dp) * Nb + static_cast<size_t>(Kb) * d);  // a block's K^T, then its V
  grow(sc.vp, packed_chunk_elems(p));                                       // one chunk's, for a row alone
  grow(sc.q, static_cast<size_t>(Rp) * dp);
  grow(sc.o, static_cast<size_t>(Rp) * d);
  grow(sc.o1, static_cast<size_t>(16) * d);
  grow(sc.m, Rp);
  grow(sc.l, Rp);
  grow(sc.s, static_cast<size_t>(kBf16Rows) * Nb);
  grow(sc.p, static_cast<size_t>(kBf16Rows) * Kb);
  grow(sc.lv, static_cast<size_t>(Rp) * 16);
  pack_queries<Q>(p, b0, h, R, Rp, dp, sc);  // m = -inf, lv = 0
  std::fill_n(sc.o.data(), static_cast<size_t>(Rp) * d, 0.f);
  if (resume)
    for (int r = 0; r < R; ++r) {
      const size_t at = static_cast<size_t>(b0 + r / G) * Hq + h * G + r % G;
      std::memcpy(sc.o.data() + static_cast<size_t>(r) * d, ws.part_o.data() + at * d, sizeof(float) * d);
      std::memcpy(sc.lv.data() + static_cast<size_t>(r) * 16, ws.part_lv.data() + at * 16, sizeof(float) * 16);
      sc.m[r] = ws.part_m[at];
    }
  Bf16Block blk;  // the softmax's view: one chunk
  blk.nc = 1;
  blk.N = C;
  blk.Kn = Kn;
  blk.first = false;  // the state is always continued (a fresh one is o = 0, m = -inf)
  int asked = 0;      // chunks asked for so far, in order (phase 2's loads go with the asking)
  auto gather = [&](ChunkBlock& b) {
    b.nc = 0;
    while (b.nc < per_block && asked < n) {
      const int i = asked++;
      const ChunkRef c = chunk(i);
      if (c.len <= 0) continue;
      b.at[b.nc] = i;
      b.c[b.nc++] = c;
      if (c.len < C) break;
    }
  };
  const PoolView pool(p);
  const uint16_t* K = static_cast<const uint16_t*>(p.k);
  const uint16_t* V = static_cast<const uint16_t*>(p.v);
  uint16_t* kp = sc.kp.data();
  uint16_t* vp = kp + static_cast<size_t>(dp) * Nb;
  // Row r (a declined one) over the block's chunks [from, nc), one at a time: the products of the
  // smallest row group that holds it, of which only its row is kept.
  const int group = amx ? 16 : 4;
  const Gemm gemm_group = amx ? bf16::gemm_for(true) : bf16::gemm_dpbf16<4>;
  auto alone = [&](const ChunkBlock& b, int r, int from) {
    const int g0 = r - r % group;
    for (int jc = from; jc < b.nc; ++jc) {
      const ChunkRef& c = b.c[jc];
      const ChunkCols cols = chunk_cols(c.len, C);
      pack_chunk(p, c.slot, h, c.len, sc.vp.data());
      gemm_group(sc.q.data() + static_cast<size_t>(g0) * dp, dp, sc.vp.data(), dp, cols.s, sc.s.data(), C, group,
                 false);
      uint16_t* pr = sc.p.data();
      std::fill_n(pr, static_cast<size_t>(group) * Kn, uint16_t{0});
      const std::pair<int, int> lo_len = span(b.at[jc], r);
      blk.lo[0] = lo_len.first;
      blk.len[0] = lo_len.second;
      row_block_softmax(p, sc, blk, r, sc.s.data() + static_cast<size_t>(r - g0) * C,
                        pr + static_cast<size_t>(r - g0) * Kn);
      float* o1 = sc.o1.data();
      std::memcpy(o1, sc.o.data() + static_cast<size_t>(g0) * d, sizeof(float) * group * d);
      gemm_group(pr, Kn, sc.vp.data() + static_cast<size_t>(dp) * C, cols.pv, d, o1, d, group, true);
      std::memcpy(sc.o.data() + static_cast<size_t>(r) * d, o1 + static_cast<size_t>(r - g0) * d, sizeof(float) * d);
    }
  };
  ChunkBlock cur, next;
  gather(cur);
  if (prefetch_next && cur.nc > 0) NextChunkLines(p, h, cur.c[0]).prefetch(0, 1);
  for (bool first = true; cur.nc > 0; first = false) {
    gather(next);
    Bf16Block row;  // the softmax's view of a row's whole block (lazy_chunks)
    row.nc = cur.nc;
    NextChunkLines next_lines;
    if (prefetch_next)
      for (int j = 0; j < next.nc; ++j) next_lines.add(p, h, next.c[j]);
    // The block packed: K^T [dp, Ns] with its chunks side by side, V [Kv, d] stacked.
    const ChunkCols last = chunk_cols(cur.c[cur.nc - 1].len, C);
    const int Ns = (cur.nc - 1) * C + last.s, Kv = (cur.nc - 1) * Kn + last.pv;
    for (int j = 0; j < cur.nc; ++j) {
      const ChunkRef& c = cur.c[j];
      const bool full = j + 1 < cur.nc;
      const size_t off = pool.at(c.slot, h);
      bf16::pack_pairs(K + off, C, d, dp, full ? C : last.s, c.len, kp + 2 * j * C, Ns);
      bf16::pack_pairs(V + off, d, c.len, full ? Kn : last.pv, d, d, vp + static_cast<size_t>(j) * Kn * d);
    }
    for (int r0 = 0; r0 < Rp; r0 += kBf16Rows) {
      const int rows = std::min(kBf16Rows, Rp - r0);
      // Scores past Ns are left as they were: the softmax masks them.
      gemm(sc.q.data() + static_cast<size_t>(r0) * dp, dp, kp, dp, Ns, sc.s.data(), Nb, rows, false);
      int declined = 0, declined_row[kBf16Rows], declined_from[kBf16Rows];
      for (int rr = 0; rr < rows; ++rr) {
        const int r = r0 + rr;
        uint16_t* pr = sc.p.data() + static_cast<size_t>(rr) * Kb;
        next_lines.prefetch(r, Rp);
        if (first) ahead.prefetch(r, Rp);
        if (r >= R) {  // padding rows carry no weight
          std::fill_n(pr, Kv, uint16_t{0});
          continue;
        }
        float* sr = sc.s.data() + static_cast<size_t>(rr) * Nb;
        for (int jc = 0; jc < cur.nc; ++jc) {
          const std::pair<int, int> lo_len = span(cur.at[jc], r);
          row.lo[jc] = lo_len.first;
          row.len[jc] = lo_len.second;
        }
        blk.lo[0] = row.lo[0];
        blk.len[0] = row.len[0];
        row_block_softmax(p, sc, blk, r, sr, pr);
        const int jc = cur.nc > 1 ? lazy_chunks(p, sc, row, r, sr, pr, 1) : 1;
        if (jc < cur.nc) {
          std::fill(pr + jc * Kn, pr + Kv, uint16_t{0});  // this product takes its chunks before jc
          declined_row[declined] = r;
          declined_from[declined++] = jc;
        }
      }
      gemm(sc.p.data(), Kb, vp, Kv, d, sc.o.data() + static_cast<size_t>(r0) * d, d, rows, true);
      for (int k = 0; k < declined; ++k) alone(cur, declined_row[k], declined_from[k]);
    }
    cur = next;
  }
}

// Phase 1, batch-invariant: item w's rows continue their states over its shared group.
template <typename Q>
void shared_item_bf16_invariant(const DecodeProblem& p, Workspace& ws, const SharedItem& w, bool amx, Bf16Scratch& sc) {
  const int Hq = p.q_heads, G = Hq / p.kv_heads, d = p.head_dim;
  continue_rows_bf16<Q>(
      p, ws, w.begin, w.end, w.head, w.level > 0, w.last - w.first,
      [&](int i) {
        const int c = ws.group_chunks[w.first + i];
        return ChunkRef{p.shared_slot[c], p.shared_len[c]};
      },
      [&](int i, int r) {
        const int c = ws.group_chunks[w.first + i], n = p.shared_len[c];
        return std::pair<int, int>(p.window > 0 ? window_lo(ws, w.begin + r / G, ws.shared_pos[c], n) : 0, n);
      },
      sc, amx, true);
  for (int r = 0; r < (w.end - w.begin) * G; ++r) {
    const size_t at = static_cast<size_t>(w.begin + r / G) * Hq + w.head * G + r % G;
    std::memcpy(ws.part_o.data() + at * d, sc.o.data() + static_cast<size_t>(r) * d, sizeof(float) * d);
    std::memcpy(ws.part_lv.data() + at * 16, sc.lv.data() + static_cast<size_t>(r) * 16, sizeof(float) * 16);
    ws.part_m[at] = sc.m[r];
  }
}

// Phase 2, batch-invariant: row b continues its state (from its shared groups, if it has any) over
// own chunks [lo, hi) and is written out.
template <typename Q>
void own_chunks_bf16_invariant(const DecodeProblem& p, Workspace& ws, int b, int h, bool resume, int lo, int hi,
                               bool amx, Bf16Scratch& sc, const NextChunkLines& ahead = NextChunkLines()) {
  const int Hq = p.q_heads, G = Hq / p.kv_heads, d = p.head_dim;
  continue_rows_bf16<Q>(
      p, ws, b, b + 1, h, resume, hi - lo,
      [&](int i) {
        // Their lines in flight a few chunks at a time, as phase 2's fp32 path does (the same
        // shape: the phase 112 -> 79 us a layer).
        if (i % kLoadChunks == 0)
          load_chunks<uint16_t>(p, ws, PoolView(p), lo + i, std::min(hi, lo + i + kLoadChunks), h);
        return ChunkRef{ws.chunk_slot[lo + i], ws.chunk_len[lo + i]};
      },
      [&](int i, int) { return std::pair<int, int>(p.window > 0 ? ws.chunk_lo[lo + i] : 0, ws.chunk_len[lo + i]); }, sc,
      amx, false, ahead);
  Q* out = static_cast<Q*>(p.out);
  for (int g = 0; g < G; ++g) {
    const float l = _mm512_reduce_add_ps(_mm512_loadu_ps(sc.lv.data() + static_cast<size_t>(g) * 16));
    write_normalized(out + (static_cast<size_t>(b) * Hq + h * G + g) * d, sc.o.data() + static_cast<size_t>(g) * d, l,
                     d);
  }
}

}  // namespace decode
}  // namespace chunkgen

#endif  // CHUNKGEN_HAVE_AVX512_BF16
