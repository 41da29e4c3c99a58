// Prefill (flash) attention on the CPU in bf16: online softmax over blocks of keys, the products on
// AMX tiles or AVX512_BF16 dot products, no score matrix beyond one block.
//
// Each (batch, kv head)'s K and V are repacked once into the pair-interleaved layout the products
// read, and every query block of every query head of the GQA group reuses them: the group's heads
// are stacked as rows of one query matrix (row r: position r / G, head r % G of the group). Rows go
// 16 at a time (one tile) through scores, softmax and P.V, so a key block's packed K and V stay in
// L1 while every tile reads them. Causal tiles that see none of a block skip it. P is rounded to bf16 for the P.V
// product, so the exponential only needs bf16 accuracy (exp2_bf16), and the row sum l adds the
// rounded values the product uses, so o / l stays a weighted mean.
#include "../prefill_attention.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "aligned.h"
#include "bf16_gemm.h"
#include "isa.h"

namespace chunkgen {
namespace {

#if defined(CHUNKGEN_HAVE_AVX512_BF16)

// Measured on the Xeon: 64-key blocks pay the per-row softmax bookkeeping twice as often, 256-key
// ones compute more of the causal diagonal and leave L1.
constexpr int kKeys = 128;  // keys per block
constexpr int kRows = 128;  // query matrix rows per work item (positions x group heads)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kLog2e = 1.44269504088896341f;

// Rows [t0, t1) of batch b's queries against kv head h.
struct Item {
  int b, h, t0, t1;
  int64_t cost;  // rows x keys read: the longest items are handed out first
};

// Reused between calls (one call at a time, as prefill runs): no allocation per layer.
struct Workspace {
  AlignedVector<uint16_t> kp, vp;  // packed K^T and V blocks of every (batch, kv head)
  std::vector<Item> items;
};

// Per-thread buffers of one item: queries and the running state, and one tile's scores and
// probabilities.
struct Scratch {
  AlignedVector<uint16_t> q;
  AlignedVector<float> o, m, lv;
  alignas(64) float s[16 * kKeys];
  alignas(64) uint16_t p[16 * kKeys];
};

template <typename Vec>
void grow(Vec& v, size_t n) {
  if (v.size() < n) v.resize(n);
}

// K^T of keys [s0, s0 + n) as the B operand of q k^T: dst[i][c][0..1] = k[s0 + c][2i..2i+1], i.e.
// a transpose of 32-bit pairs ([n, d / 2] -> [dp / 2, nb]), zero for c >= n and 2i >= d.
void pack_keys(const uint16_t* k, int64_t stride, int n, int d, int dp, int nb, uint16_t* dst) {
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
  std::fill_n(out, static_cast<size_t>(dp / 2) * nb, 0u);
  for (int c = 0; c < n; ++c) {
    const uint16_t* row = k + c * stride;
    for (int i = 0; i < d / 2; ++i) std::memcpy(out + static_cast<size_t>(i) * nb + c, row + 2 * i, 4);
  }
}

using bf16::Gemm;

// One item: the online softmax over its visible key blocks, then o / l and the lse into place.
void run_item(const PrefillProblem& p, const Workspace& ws, const Item& w, Gemm gemm, Scratch& sc) {
  const int Hq = p.q_heads, Hk = p.kv_heads, G = Hq / Hk, d = p.head_dim, T = p.q_len, S = p.kv_len;
  const int dp = bf16::round_up(d, 32), nkb = (S + kKeys - 1) / kKeys;
  const int R = (w.t1 - w.t0) * G, Rp = bf16::round_up(R, 16);
  const bool masked = p.mask != nullptr;
  // Masked scores are stored as scaled + mask (natural units); plain ones stay raw, the scale
  // folded into the exponent's multiplier. m is kept in the stored units.
  const float unit = masked ? 1.f : p.scale;
  const __m512 c = _mm512_set1_ps(unit * kLog2e), scale = _mm512_set1_ps(p.scale);
  const __m512 neg_inf = _mm512_set1_ps(kNegInf), hidden = _mm512_set1_ps(-1e30f);
  const __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3f80);  // bf16 1.0: dpbf16 against it sums pairs
  const int shift = S - T;                                    // causal: position t sees keys < t + shift + 1

  grow(sc.q, static_cast<size_t>(Rp) * dp);
  grow(sc.o, static_cast<size_t>(Rp) * d);
  grow(sc.m, Rp);
  grow(sc.lv, static_cast<size_t>(Rp) * 16);
  for (int r = 0; r < Rp; ++r) {
    uint16_t* dst = sc.q.data() + static_cast<size_t>(r) * dp;
    if (r < R) {
      const uint16_t* src = p.q + w.b * p.q_stride[0] + (w.h * G + r % G) * p.q_stride[1] +
                            static_cast<int64_t>(w.t0 + r / G) * p.q_stride[2];
      std::memcpy(dst, src, sizeof(uint16_t) * d);
      std::fill(dst + d, dst + dp, uint16_t{0});
    } else {
      std::fill_n(dst, dp, uint16_t{0});
    }
  }
  std::fill_n(sc.o.data(), static_cast<size_t>(Rp) * d, 0.f);
  std::fill_n(sc.m.data(), R, kNegInf);
  std::fill_n(sc.lv.data(), static_cast<size_t>(R) * 16, 0.f);

  const int key_end = p.causal ? std::min(S, w.t1 + shift) : S;  // keys any row of the item sees
  const size_t head_blocks = (static_cast<size_t>(w.b) * Hk + w.h) * nkb;
  for (int j = 0; j * kKeys < key_end; ++j) {
    const int s0 = j * kKeys, valid = std::min(kKeys, S - s0);
    const uint16_t* kb = ws.kp.data() + (head_blocks + j) * dp * kKeys;
    const uint16_t* vb = ws.vp.data() + (head_blocks + j) * kKeys * d;
    // One 16-row tile at a time through scores, softmax and P.V: the block's packed K and V stay
    // in L1 across the tiles, and each tile's scores and probabilities are read while still there.
    for (int r0 = 0; r0 < R; r0 += 16) {
      const int r1 = std::min(R, r0 + 16);
      // Keys of the block the tile's last (latest) row sees; the other rows see a prefix of them.
      const int seen = p.causal ? std::min(valid, w.t0 + (r1 - 1) / G + shift + 1 - s0) : valid;
      if (seen <= 0) continue;
      // Scores of the whole block (the packed K^T's width), P.V over the keys seen only.
      const int kv = bf16::round_up(seen, 32);
      gemm(sc.q.data() + static_cast<size_t>(r0) * dp, dp, kb, dp, bf16::round_up(valid, 16), sc.s, kKeys, 16, false);
      for (int r = r0; r < r1; ++r) {
        const int t = w.t0 + r / G;
        const int n = p.causal ? std::min(seen, t + shift + 1 - s0) : seen;
        uint16_t* pr = sc.p + static_cast<size_t>(r - r0) * kKeys;
        if (n <= 0) {
          std::fill_n(pr, kv, uint16_t{0});
          continue;
        }
        float* sr = sc.s + static_cast<size_t>(r - r0) * kKeys;
        __m512 mx = neg_inf;
        if (masked) {
          const uint16_t* mr = p.mask + w.b * p.mask_stride[0] + t * p.mask_stride[1] + s0;
          for (int jj = 0; jj < n; jj += 16) {
            const __mmask16 lanes = bf16::valid_lanes(jj, n);
            const __m256i mb = _mm512_castsi512_si256(_mm512_maskz_loadu_epi16(lanes, mr + jj));
            const __m512 x = _mm512_fmadd_ps(_mm512_loadu_ps(sr + jj), scale, _mm512_cvtpbh_ps((__m256bh)mb));
            mx = _mm512_mask_max_ps(mx, lanes, mx, x);
            // Hidden keys stored finite, so that (x - m) * c stays a number; their exp is 0.
            _mm512_storeu_ps(sr + jj, _mm512_max_ps(x, hidden));
          }
        } else {
          for (int jj = 0; jj < n; jj += 16)
            mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(neg_inf, bf16::valid_lanes(jj, n), sr + jj));
        }
        // The running max only moves when a score exceeds it; only then is the row rescaled.
        float m = sc.m[r];
        float* lv = sc.lv.data() + static_cast<size_t>(r) * 16;
        if (_mm512_cmp_ps_mask(mx, _mm512_set1_ps(m), _CMP_GT_OQ)) {
          const float mnew = _mm512_reduce_max_ps(mx);
          const __m512 alpha = _mm512_set1_ps(std::exp2((m - mnew) * unit * kLog2e));  // 0 from -inf
          _mm512_storeu_ps(lv, _mm512_mul_ps(_mm512_loadu_ps(lv), alpha));
          float* o = sc.o.data() + static_cast<size_t>(r) * d;
          for (int i = 0; i < d; i += 16) _mm512_storeu_ps(o + i, _mm512_mul_ps(_mm512_loadu_ps(o + i), alpha));
          m = mnew;
          sc.m[r] = m;
        }
        if (m == kNegInf) {  // every key so far hidden by the mask
          std::fill_n(pr, kv, uint16_t{0});
          continue;
        }
        const __m512 neg_mc = _mm512_set1_ps(-m * unit * kLog2e);
        __m512 sum = _mm512_setzero_ps();
        for (int jj = 0; jj < kv; jj += 32) {
          const __m512 e0 = _mm512_maskz_mov_ps(bf16::valid_lanes(jj, n),
                                                bf16::exp2_bf16(_mm512_fmadd_ps(_mm512_loadu_ps(sr + jj), c, neg_mc)));
          const __m512 e1 =
              _mm512_maskz_mov_ps(bf16::valid_lanes(jj + 16, n),
                                  bf16::exp2_bf16(_mm512_fmadd_ps(_mm512_loadu_ps(sr + jj + 16), c, neg_mc)));
          const __m512bh pb = _mm512_cvtne2ps_pbh(e1, e0);
          sum = _mm512_dpbf16_ps(sum, pb, ones);  // l adds the rounded probabilities the product uses
          _mm512_storeu_si512(pr + jj, (__m512i)pb);
        }
        _mm512_storeu_ps(lv, _mm512_add_ps(_mm512_loadu_ps(lv), sum));
      }
      for (int r = r1; r < r0 + 16; ++r) std::fill_n(sc.p + static_cast<size_t>(r - r0) * kKeys, kv, uint16_t{0});
      gemm(sc.p, kKeys, vb, kv, d, sc.o.data() + static_cast<size_t>(r0) * d, d, 16, true);
    }
  }

  for (int r = 0; r < R; ++r) {
    const int t = w.t0 + r / G, hq = w.h * G + r % G;
    const float l = _mm512_reduce_add_ps(_mm512_loadu_ps(sc.lv.data() + static_cast<size_t>(r) * 16));
    const size_t row = (static_cast<size_t>(w.b) * T + t) * Hq + hq;
    p.lse[row] = l > 0.f ? sc.m[r] * unit + std::log(l) : kNegInf;
    const __m512 inv = _mm512_set1_ps(l > 0.f ? 1.f / l : 0.f);
    const float* o = sc.o.data() + static_cast<size_t>(r) * d;
    uint16_t* dst = p.out + row * d;
    for (int i = 0; i < d; i += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(o + i), inv)));
  }
}

Workspace& workspace() {
  static Workspace ws;
  return ws;
}

void run(const PrefillProblem& p, Isa isa) {
  const int B = p.batch, Hq = p.q_heads, Hk = p.kv_heads, G = Hq / Hk, d = p.head_dim, T = p.q_len, S = p.kv_len;
  const int dp = bf16::round_up(d, 32), nkb = (S + kKeys - 1) / kKeys;
  Workspace& ws = workspace();
  grow(ws.kp, static_cast<size_t>(B) * Hk * nkb * dp * kKeys);
  grow(ws.vp, static_cast<size_t>(B) * Hk * nkb * kKeys * d);

  // Query blocks of about kRows rows, equal in size (no ragged last block).
  const int per_block = std::max(1, kRows / G);
  const int nqb = (T + per_block - 1) / per_block;
  ws.items.clear();
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < Hk; ++h)
      for (int i = 0; i < nqb; ++i) {
        const int t0 = static_cast<int>(static_cast<int64_t>(T) * i / nqb);
        const int t1 = static_cast<int>(static_cast<int64_t>(T) * (i + 1) / nqb);
        if (t1 == t0) continue;
        const int keys = p.causal ? std::max(0, std::min(S, t1 + S - T)) : S;
        ws.items.push_back({b, h, t0, t1, static_cast<int64_t>(t1 - t0) * (keys + kKeys)});
      }
  std::stable_sort(ws.items.begin(), ws.items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  const Gemm gemm = bf16::gemm_for(isa == Isa::Amx);
  const int n_blocks = B * Hk * nkb, n_items = static_cast<int>(ws.items.size());

#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int i = 0; i < n_blocks; ++i) {
      const int b = i / (Hk * nkb), h = i / nkb % Hk, j = i % nkb;
      const int s0 = j * kKeys, valid = std::min(kKeys, S - s0);
      const uint16_t* k = p.k + b * p.k_stride[0] + h * p.k_stride[1] + s0 * p.k_stride[2];
      const uint16_t* v = p.v + b * p.v_stride[0] + h * p.v_stride[1] + s0 * p.v_stride[2];
      pack_keys(k, p.k_stride[2], valid, d, dp, bf16::round_up(valid, 16),
                ws.kp.data() + static_cast<size_t>(i) * dp * kKeys);
      bf16::pack_pairs(v, static_cast<int>(p.v_stride[2]), valid, bf16::round_up(valid, 32), d, d,
                       ws.vp.data() + static_cast<size_t>(i) * kKeys * d);
    }
    thread_local Scratch sc;
#if defined(CHUNKGEN_HAVE_AMX)
    static const bf16::TileConfig tile_config;
    if (isa == Isa::Amx) _tile_loadconfig(&tile_config);  // tile configuration is per thread
#endif
#pragma omp for schedule(dynamic, 1)
    for (int it = 0; it < n_items; ++it) run_item(p, ws, ws.items[it], gemm, sc);
#if defined(CHUNKGEN_HAVE_AMX)
    if (isa == Isa::Amx) _tile_release();
#endif
  }
}

#endif  // CHUNKGEN_HAVE_AVX512_BF16

}  // namespace

bool prefill_attention_cpu(const PrefillProblem& p) {
#if defined(CHUNKGEN_HAVE_AVX512_BF16)
  const Isa isa = current_isa();
  if (isa == Isa::Fp32) return false;
  run(p, isa);
  return true;
#else
  (void)p;
  return false;
#endif
}

}  // namespace chunkgen
