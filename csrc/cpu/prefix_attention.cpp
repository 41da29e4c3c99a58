// The prefill's prefix product: the new tokens of a wave's group attend to the cached chunks every
// member reads first. The chunks are read in place from the pool (K stored transposed), one block
// of query rows (positions x the GQA group) at a time, by the decode kernel's chunk-first code: in
// fp32 its register-blocked products and online softmax (online_softmax.h), in bf16 its packed
// blocks on AMX tiles or AVX512_BF16 dot products (decode_chunk_first_bf16.h). No gathered copy of
// the prefix, each chunk read once per block of rows. The normalized output and log-sum-exp merge
// with the attention over the rest of each row's path (kernels/prefill.py). The same code reads a
// lone sequence's whole path causally, and a wave's lone sequences all in one parallel region
// (causal_attention): one OpenMP region a layer, not one a sequence, whose barrier on a busy
// machine waits for a descheduled thread each time. A causal product takes sliding windows and
// soft-capping as the decode kernel does (ChunkMask in fp32, the bf16 products' window start and
// cap): each row's fold skips the chunks before its window, so a row reads the same chunks with the
// same arithmetic whatever block of rows it is in.
#include "../prefix_attention.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "../invariant.h"
#include "decode_chunk_first_bf16.h"
#include "isa.h"
#include "online_softmax.h"

namespace chunkgen {
namespace {

// Rows [r0, r1) of one KV head's item, from its running state (state row (r - r0) * G + g: position
// r, query head h * G + g): the normalized output and the log-sum-exp (where lse is not null).
template <typename T>
void write_rows(T* out, float* lse, const float* o, const float* m, const float* l, int r0, int r1, int h, int G,
                int Hq, int d) {
  for (int r = r0; r < r1; ++r)
    for (int g = 0; g < G; ++g) {
      const int s = (r - r0) * G + g;
      const size_t row = static_cast<size_t>(r) * Hq + h * G + g;
      decode::write_normalized(out + row * d, o + static_cast<size_t>(s) * d, l[s], d);
      if (lse != nullptr) lse[row] = m[s] + std::log(l[s]);
    }
}

// One product in fp32 arithmetic (Q: q and out float or bf16, T: the pool's float or bf16 K/V),
// cut into items of a block of query rows x one KV head, each computed whole by one thread: what a
// row gets depends on its own product only, never on the items beside it.
template <typename T, typename Q>
struct Product {
  const Q* q;  // [R, Hq, d]
  Q* out;      // [R, Hq, d]
  float* lse;  // [R, Hq], or null: not wanted
  const int32_t* slot;
  int64_t nc, n_tokens;
  // < 0: every row reads all n_tokens. >= 0: causal, row r sits at position first + r and reads
  // positions [0, first + r] (a lone sequence's whole path, its new tokens already stored).
  int64_t first;
  int R;
};

struct Shape {
  const void* k;  // the pool layer [S, Hk, d, C], K stored transposed
  const void* v;  // [S, Hk, C, d]
  int Hq, Hk, d, C;
  float scale;
  // Causal products only: position t reads positions [t - window + 1, t] (window > 0), and each
  // scaled score s becomes softcap * tanh(s / softcap) (softcap > 0).
  int window = 0;
  float softcap = 0.f;
  int G() const { return Hq / Hk; }
  int per_block() const { return std::max(1, decode::kRowBlock / G()); }
  bool masked() const { return window > 0 || softcap > 0.f; }
  // The first position inside the window of the row at position pos.
  int64_t window_start(int64_t pos) const { return window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0; }
};

Shape shape_of(const torch::Tensor& q, const torch::Tensor& k_layer, const torch::Tensor& v_layer, double scale,
               int64_t window, double softcap) {
  return {k_layer.data_ptr(),          v_layer.data_ptr(),
          static_cast<int>(q.size(1)), static_cast<int>(k_layer.size(1)),
          static_cast<int>(q.size(2)), static_cast<int>(k_layer.size(3)),
          static_cast<float>(scale),   static_cast<int>(window),
          static_cast<float>(softcap)};
}

// The first token of chunk c (of n tokens read) inside the window of the row at position pos: n
// where the window starts past the chunk.
inline int chunk_lo(const Shape& sh, int64_t pos, int64_t c, int n) {
  return static_cast<int>(std::clamp<int64_t>(sh.window_start(pos) - c * sh.C, 0, n));
}

// One chunk into the running state of `rows` state rows, as the decode kernel folds it: masked
// (lo: each row's first token inside its window; the cap) for the whole call where it has a
// window or soft-capping, so that a row's arithmetic does not depend on which rows share the call.
template <typename T>
void fold_chunk(const Shape& sh, decode::Scratch& sc, size_t s0, int rows, const T* k, const T* v, int n) {
  const int d = sh.d;
  float* o = sc.o.data() + s0 * d;
  float* m = sc.m.data() + s0;
  float* l = sc.l.data() + s0;
  if (!sh.masked()) {
    decode::attend_chunk<T, false>(sc.q.data() + s0 * d, rows, k, v, n, sh.C, d, o, m, l, sc.s.data(), sc.alpha.data());
    return;
  }
  decode::attend_chunk<T, true>(sc.q.data() + s0 * d, rows, k, v, n, sh.C, d, o, m, l, sc.s.data(), sc.alpha.data(),
                                decode::ChunkMask{sh.window > 0 ? sc.lo.data() + s0 : nullptr, sh.softcap});
}

// Item (blk, h) of a product: the chunks before the block's first position read by all its rows at
// once, the one or two chunks its positions end in (causal) by each position's rows alone, up to
// that position. With a window, the shared reading starts at the chunk the block's first window
// starts in (a later row's window starts no earlier; the chunks before its own leave its state
// untouched, every lane masked), and each position's own reading at its window's chunk.
template <typename T, typename Q>
void attend_item(const Product<T, Q>& p, const Shape& sh, int blk, int h, decode::Scratch& sc) {
  const int G = sh.G(), d = sh.d, C = sh.C, Hq = sh.Hq, Hk = sh.Hk;
  const T* K = static_cast<const T*>(sh.k);
  const T* V = static_cast<const T*>(sh.v);
  const size_t head_elems = static_cast<size_t>(d) * C;
  const int r0 = blk * sh.per_block(), r1 = std::min(p.R, r0 + sh.per_block()), rows = (r1 - r0) * G;
  sc.reserve(rows, d, C);
  for (int r = r0; r < r1; ++r)  // state row (r - r0) * G + g: position r, query head h * G + g
    for (int i = 0; i < G * d; ++i)
      sc.q[static_cast<size_t>(r - r0) * G * d + i] =
          decode::to_f32(p.q[(static_cast<size_t>(r) * Hq + h * G) * d + i]) * sh.scale;
  sc.reset_state(rows, d);
  const int64_t whole = p.first < 0 ? p.nc : (p.first + r0 + 1) / C;  // chunks every row reads whole
  const int64_t from = p.first < 0 ? 0 : sh.window_start(p.first + r0) / C;
  for (int64_t c = from; c < whole; ++c) {
    const int n = static_cast<int>(std::min<int64_t>(C, p.n_tokens - c * C));
    if (sh.window > 0)
      for (int r = r0; r < r1; ++r)
        std::fill_n(sc.lo.data() + static_cast<size_t>(r - r0) * G, G, chunk_lo(sh, p.first + r, c, n));
    const size_t off = (static_cast<size_t>(p.slot[c]) * Hk + h) * head_elems;
    fold_chunk<T>(sh, sc, 0, rows, K + off, V + off, n);
  }
  if (p.first >= 0)
    for (int r = r0; r < r1; ++r) {
      const int64_t pos = p.first + r;
      const size_t s0 = static_cast<size_t>(r - r0) * G;
      for (int64_t c = std::max(whole, sh.window_start(pos) / C); c <= pos / C; ++c) {
        const int n = static_cast<int>(std::min<int64_t>(C, pos - c * C + 1));
        if (sh.window > 0) std::fill_n(sc.lo.data() + s0, G, chunk_lo(sh, pos, c, n));
        const size_t off = (static_cast<size_t>(p.slot[c]) * Hk + h) * head_elems;
        fold_chunk<T>(sh, sc, s0, G, K + off, V + off, n);
      }
    }
  write_rows(p.out, p.lse, sc.o.data(), sc.m.data(), sc.l.data(), r0, r1, h, G, Hq, d);
}

// Query rows (positions x the GQA group) of a causal bf16 product per item on the bf16 products:
// each chunk's packing serves many rows (a row's results do not depend on its item).
constexpr int kBf16CausalRows = 192;

#if defined(CHUNKGEN_HAVE_AVX512_BF16)
// Item (blk, h) of a causal product (first >= 0) with bf16 K/V on the bf16 products: each
// position's rows continue one state over chunks [0, its own] in order, one chunk at a time, up to
// and including the position (decode::continue_rows_bf16: a row's bits are its own, whatever the
// item's other rows, the wave or whether the prefix was cached). With a window the item starts at
// the chunk its first row's window starts in, each row's tokens from its own window's start (a
// chunk a row reads none of leaves its state as it was, bit for bit); soft-capping as in decode.
void attend_item_bf16(const Product<uint16_t, uint16_t>& pr, const Shape& sh, int blk, int h, bool amx,
                      decode::Bf16Scratch& sc) {
  const int G = sh.G(), d = sh.d, C = sh.C, Hq = sh.Hq;
  const int per_item = std::max(1, kBf16CausalRows / G);
  const int r0 = blk * per_item, r1 = std::min(pr.R, r0 + per_item);
  DecodeProblem p{};
  p.q = pr.q;
  p.q_type = KVType::BF16;
  p.k = sh.k;
  p.v = sh.v;
  p.kv_type = KVType::BF16;
  p.q_heads = Hq;
  p.kv_heads = sh.Hk;
  p.head_dim = d;
  p.chunk = C;
  p.scale = sh.scale;
  p.softcap = sh.softcap;
  decode::Workspace unused;  // a fresh state: nothing resumed
  const int64_t last = pr.first + r1 - 1, from = sh.window_start(pr.first + r0) / C;
  decode::continue_rows_bf16<uint16_t>(
      p, unused, r0, r1, h, false, static_cast<int>(last / C + 1 - from),
      [&](int i) {
        const int64_t c = from + i;
        return decode::ChunkRef{pr.slot[c], static_cast<int>(std::min<int64_t>(C, pr.n_tokens - c * C))};
      },
      [&](int i, int r) {
        const int64_t c = from + i, pos = pr.first + r0 + r / G, n = std::min<int64_t>(C, pr.n_tokens - c * C);
        const int len = static_cast<int>(std::clamp<int64_t>(pos - c * C + 1, 0, n));
        return std::pair<int, int>(chunk_lo(sh, pos, c, len), len);
      },
      sc, amx);
  for (int r = r0; r < r1; ++r)
    for (int g = 0; g < G; ++g) {
      const int s = (r - r0) * G + g;
      const size_t row = static_cast<size_t>(r) * Hq + h * G + g;
      const float l = _mm512_reduce_add_ps(_mm512_loadu_ps(sc.lv.data() + static_cast<size_t>(s) * 16));
      decode::write_normalized(pr.out + row * d, sc.o.data() + static_cast<size_t>(s) * d, l, d);
      if (pr.lse != nullptr) pr.lse[row] = sc.m[s] + std::log(l);
    }
}
#endif

// Whether a causal product with bf16 K/V takes the bf16 products (this CPU has them, CHUNKGEN_CPU_ISA
// lowering), else the fp32 arithmetic.
template <typename T, typename Q>
bool causal_bf16() {
#if defined(CHUNKGEN_HAVE_AVX512_BF16)
  return std::is_same_v<T, uint16_t> && std::is_same_v<Q, uint16_t> && current_isa() != Isa::Fp32;
#else
  return false;
#endif
}

// Every item of several products in one parallel region: the costliest (longest path) first, for
// the dynamic schedule.
template <typename T, typename Q>
void attend_products(const std::vector<Product<T, Q>>& products, const Shape& sh) {
  struct Item {
    int product, blk, h;
    int64_t cost;  // tokens the block's last row reads
  };
  std::vector<Item> items;
  // bf16 on the bf16 products: causal products only (a prefix product, first < 0, is prefix_bf16's)
  bool bf16 = causal_bf16<T, Q>();
  for (const auto& p : products) bf16 = bf16 && p.first >= 0;
  const int per_block = bf16 ? std::max(1, kBf16CausalRows / sh.G()) : sh.per_block();
  for (int i = 0; i < static_cast<int>(products.size()); ++i) {
    const auto& p = products[i];
    for (int blk = 0; blk * per_block < p.R; ++blk) {
      const int64_t cost = p.first < 0 ? p.n_tokens
                                       : p.first + std::min(p.R, (blk + 1) * per_block) -
                                             sh.window_start(p.first + blk * per_block) / sh.C * sh.C;
      for (int h = 0; h < sh.Hk; ++h) items.push_back({i, blk, h, cost});
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  const int n_items = static_cast<int>(items.size());
#pragma omp parallel
  {
    thread_local decode::Scratch sc;
#if defined(CHUNKGEN_HAVE_AVX512_BF16)
    if constexpr (std::is_same_v<T, uint16_t> && std::is_same_v<Q, uint16_t>) {
      if (bf16) {
        thread_local decode::Bf16Scratch bsc;
        // the decode kernel's products (decode_attention.cpp), AMX tiles where it takes them
        const bool amx = current_isa() == Isa::Amx;
#if defined(CHUNKGEN_HAVE_AMX)
        static const bf16::TileConfig tile_config;
        if (amx) _tile_loadconfig(&tile_config);  // per thread
#endif
#pragma omp for schedule(dynamic, 1)
        for (int it = 0; it < n_items; ++it)
          attend_item_bf16(products[items[it].product], sh, items[it].blk, items[it].h, amx, bsc);
#if defined(CHUNKGEN_HAVE_AMX)
        if (amx) _tile_release();
#endif
      }
    }
#endif
    if (!bf16) {
#pragma omp for schedule(dynamic, 1)
      for (int it = 0; it < n_items; ++it) attend_item(products[items[it].product], sh, items[it].blk, items[it].h, sc);
    }
  }
}

template <typename T, typename Q>
void prefix_fp32(const torch::Tensor& q, const torch::Tensor& k_layer, const torch::Tensor& v_layer,
                 const int32_t* slot, int64_t nc, int64_t n_tokens, int64_t first, double scale, int64_t window,
                 double softcap, torch::Tensor& out, torch::Tensor& lse) {
  attend_products<T, Q>({{static_cast<const Q*>(q.data_ptr()), static_cast<Q*>(out.data_ptr()), lse.data_ptr<float>(),
                          slot, nc, n_tokens, first, static_cast<int>(q.size(0))}},
                        shape_of(q, k_layer, v_layer, scale, window, softcap));
}

#if defined(CHUNKGEN_HAVE_AVX512_BF16)
// The prefix as the decode kernel sees a shared node: every row (query position) of the group
// reads every chunk, so it is one run of chunk-first items, cut by rows only (each item packs the
// prefix once: few, long items; about four a thread).
void prefix_bf16(const torch::Tensor& q, const torch::Tensor& k_layer, const torch::Tensor& v_layer,
                 const int32_t* slot, int64_t nc, int64_t n_tokens, double scale, Isa isa, torch::Tensor& out,
                 torch::Tensor& lse) {
  const int R = static_cast<int>(q.size(0)), Hq = static_cast<int>(q.size(1)), d = static_cast<int>(q.size(2));
  const int Hk = static_cast<int>(k_layer.size(1)), C = static_cast<int>(k_layer.size(3)), G = Hq / Hk;
  std::vector<int32_t> len(nc, C);
  len[nc - 1] = static_cast<int>(n_tokens - (nc - 1) * C);
  DecodeProblem p{};
  p.q = q.data_ptr();
  p.q_type = KVType::BF16;
  p.k = k_layer.data_ptr();
  p.v = v_layer.data_ptr();
  p.kv_type = KVType::BF16;
  p.batch = R;
  p.q_heads = Hq;
  p.kv_heads = Hk;
  p.head_dim = d;
  p.chunk = C;
  p.scale = static_cast<float>(scale);
  p.num_shared = static_cast<int>(nc);
  p.shared_slot = slot;
  p.shared_len = len.data();
  decode::Workspace ws;
  ws.group_chunks.resize(nc);
  for (int64_t c = 0; c < nc; ++c) ws.group_chunks[c] = static_cast<int32_t>(c);
  // Rows per item: about four items a thread, at least one product's rows, at most 2,048 state rows
  // (their running o, 512 KiB, stays in L2 while a block's rows go through).
  const int nthreads = omp_get_max_threads();
  const int per_head = std::max(1, (4 * nthreads + Hk - 1) / Hk);
  const int lo = (decode::kBf16Rows + G - 1) / G, hi = std::max(lo, 2048 / G);
  const int per_item = std::clamp((R + per_head - 1) / per_head, lo, hi);
  std::vector<decode::SharedItem> items;
  for (int h = 0; h < Hk; ++h)
    for (int b = 0; b < R; b += per_item) items.push_back({0, static_cast<int>(nc), h, b, std::min(R, b + per_item)});
  const int n_items = static_cast<int>(items.size());
  auto* op = static_cast<uint16_t*>(out.data_ptr());
  float* lp = lse.data_ptr<float>();
#pragma omp parallel
  {
    thread_local decode::Bf16Scratch sc;
#if defined(CHUNKGEN_HAVE_AMX)
    static const bf16::TileConfig tile_config;
    if (isa == Isa::Amx) _tile_loadconfig(&tile_config);  // tile configuration is per thread
#endif
#pragma omp for schedule(dynamic, 1)
    for (int it = 0; it < n_items; ++it) {
      const decode::SharedItem& w = items[it];
      decode::attend_item_bf16<uint16_t>(p, ws, w, isa, sc);
      write_rows(op, lp, sc.o.data(), sc.m.data(), sc.l.data(), w.begin, w.end, w.head, G, Hq, d);
    }
#if defined(CHUNKGEN_HAVE_AMX)
    if (isa == Isa::Amx) _tile_release();
#endif
  }
}
#endif

}  // namespace

namespace {

// What both entry points check: q [R, Hq, d] against one pool layer of its dtype, and slots.
void check_pool_product(const char* op, const torch::Tensor& q, const torch::Tensor& k_layer,
                        const torch::Tensor& v_layer, const torch::Tensor& slots) {
  TORCH_CHECK_VALUE(q.dim() == 3 && k_layer.dim() == 4 && v_layer.dim() == 4 && slots.dim() == 1, op,
                    ": q [R, Hq, d], k_layer [S, Hk, d, C], v_layer [S, Hk, C, d], slots [n], got ", q.sizes(), ", ",
                    k_layer.sizes(), ", ", v_layer.sizes(), ", ", slots.sizes());
  const auto dtype = q.scalar_type();
  TORCH_CHECK_TYPE((dtype == torch::kFloat || dtype == torch::kBFloat16) && k_layer.scalar_type() == dtype &&
                       v_layer.scalar_type() == dtype && slots.scalar_type() == torch::kInt,
                   op, ": q, k_layer, v_layer all float32 or all bfloat16, and slots int32, got ", q.scalar_type(),
                   ", ", k_layer.scalar_type(), ", ", v_layer.scalar_type(), ", ", slots.scalar_type());
  TORCH_CHECK_VALUE(q.device().is_cpu() && k_layer.device().is_cpu() && v_layer.device().is_cpu() &&
                        slots.device().is_cpu() && k_layer.is_contiguous() && v_layer.is_contiguous() &&
                        slots.is_contiguous(),
                    op, ": CPU tensors, the pool layers and slots contiguous");
  const int64_t d = q.size(2), Hq = q.size(1), Hk = k_layer.size(1), C = k_layer.size(3), S = k_layer.size(0);
  TORCH_CHECK_VALUE(Hk > 0 && Hq % Hk == 0 && k_layer.size(2) == d && v_layer.size(0) == S && v_layer.size(1) == Hk &&
                        v_layer.size(2) == C && v_layer.size(3) == d,
                    op, ": shapes do not fit: q ", q.sizes(), ", k_layer ", k_layer.sizes(), ", v_layer ",
                    v_layer.sizes());
  // The score and value vectors span 16 floats at most: whole vectors of every chunk and head.
  TORCH_CHECK_VALUE(d > 0 && d % 16 == 0 && C > 0 && C % 16 == 0, op,
                    ": head_dim and chunk size must be positive multiples of 16, got ", d, " and ", C);
  const int32_t* slot = slots.data_ptr<int32_t>();
  for (int64_t i = 0; i < slots.size(0); ++i)
    TORCH_CHECK_VALUE(slot[i] >= 0 && slot[i] < S, op, ": slot ", slot[i], " outside the pool layer's ", S);
}

void check_masking(const char* op, int64_t window, double softcap) {
  TORCH_CHECK_VALUE(window >= 0 && window <= std::numeric_limits<int>::max() && softcap >= 0, op,
                    ": window and softcap must be >= 0 (0: off), got ", window, " and ", softcap);
}

}  // namespace

std::tuple<torch::Tensor, torch::Tensor> prefix_attention(const torch::Tensor& q, const torch::Tensor& k_layer,
                                                          const torch::Tensor& v_layer, const torch::Tensor& slots,
                                                          int64_t n_tokens, double scale, int64_t first, int64_t window,
                                                          double softcap) {
  check_pool_product("prefix_attention", q, k_layer, v_layer, slots);
  TORCH_CHECK_VALUE(first < 0 || first + q.size(0) <= n_tokens, "prefix_attention: the last query (position ",
                    first + q.size(0) - 1, ") of a causal product (first >= 0) must be inside the ", n_tokens,
                    " tokens");
  check_masking("prefix_attention", window, softcap);
  TORCH_CHECK_VALUE(first >= 0 || (window == 0 && softcap == 0),
                    "prefix_attention: a window or soft-capping needs a causal product (first >= 0)");
  // bf16 K/V: bf16 products on AVX512_BF16 or AMX (in this build and on this CPU, CHUNKGEN_CPU_ISA
  // lowering) for a group's prefix; for a causal product the bf16 products one chunk at a time
  // (attend_item_bf16, the decode kernel's: AMX tiles or AVX512_BF16); the fp32 products (bf16 read, fp32 arithmetic)
  // for a prefix with batch-invariant numerics, or where the CPU has no bf16 products.
  const auto dtype = q.scalar_type();
  const Isa isa = dtype == torch::kBFloat16 ? current_isa() : Isa::Fp32;
  const bool bf16_products = dtype == torch::kBFloat16 && isa != Isa::Fp32 && first < 0 && !batch_invariant();
  const int R = static_cast<int>(q.size(0)), Hq = static_cast<int>(q.size(1)), d = static_cast<int>(q.size(2));
  const int C = static_cast<int>(k_layer.size(3));
  const int64_t nc = slots.size(0);
  TORCH_CHECK_VALUE(n_tokens > 0 && nc == (n_tokens + C - 1) / C, "prefix_attention: ", nc,
                    " slots cannot hold a prefix of ", n_tokens, " tokens in chunks of ", C);
  const int32_t* slot = slots.data_ptr<int32_t>();

  const auto qc = q.contiguous();
  auto out = torch::empty({R, Hq, d}, q.options());
  auto lse = torch::empty({R, Hq}, q.options().dtype(torch::kFloat));
  if (R == 0) return {out, lse};
  if (q.scalar_type() == torch::kFloat) {
    prefix_fp32<float, float>(qc, k_layer, v_layer, slot, nc, n_tokens, first, scale, window, softcap, out, lse);
    return {out, lse};
  }
#if defined(CHUNKGEN_HAVE_AVX512_BF16)
  if (bf16_products) {
    prefix_bf16(qc, k_layer, v_layer, slot, nc, n_tokens, scale, isa, out, lse);
    return {out, lse};
  }
#else
  (void)bf16_products;
#endif
  prefix_fp32<uint16_t, uint16_t>(qc, k_layer, v_layer, slot, nc, n_tokens, first, scale, window, softcap, out, lse);
  return {out, lse};
}

void causal_attention(const torch::Tensor& q, const torch::Tensor& k_layer, const torch::Tensor& v_layer,
                      const torch::Tensor& slots, const torch::Tensor& spans, double scale, torch::Tensor& out,
                      int64_t window, double softcap) {
  check_pool_product("causal_attention", q, k_layer, v_layer, slots);
  check_masking("causal_attention", window, softcap);
  TORCH_CHECK_VALUE(
      out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type() && out.device().is_cpu() && out.is_contiguous(),
      "causal_attention: out must be a contiguous CPU tensor of q's shape and dtype, got ", out.sizes(), " ",
      out.scalar_type());
  TORCH_CHECK_VALUE(spans.dim() == 2 && spans.size(1) == 4 && spans.scalar_type() == torch::kLong &&
                        spans.device().is_cpu() && spans.is_contiguous(),
                    "causal_attention: spans int64 [N, 4] (row, count, first, slot offset), got ", spans.sizes(), " ",
                    spans.scalar_type());
  const auto qc = q.contiguous();
  const int64_t rows = q.size(0), row_elems = q.size(1) * q.size(2), C = k_layer.size(3), n_slots = slots.size(0);
  const int64_t* sp = spans.data_ptr<int64_t>();
  const int32_t* slot = slots.data_ptr<int32_t>();
  const bool fp32 = q.scalar_type() == torch::kFloat;
  std::vector<Product<float, float>> f32;
  std::vector<Product<uint16_t, uint16_t>> b16;
  int64_t end = 0;  // rows before it belong to earlier spans
  for (int64_t i = 0; i < spans.size(0); ++i) {
    const int64_t row = sp[4 * i], count = sp[4 * i + 1], first = sp[4 * i + 2], at = sp[4 * i + 3];
    const int64_t n_tokens = first + count, nc = (n_tokens + C - 1) / C;
    TORCH_CHECK_VALUE(row >= end && count >= 0 && row + count <= rows && first >= 0, "causal_attention: span ", i,
                      " (rows ", row, " + ", count, ", first position ", first,
                      ") overlaps an earlier span or leaves q's ", rows, " rows");
    TORCH_CHECK_VALUE(at >= 0 && at + nc <= n_slots, "causal_attention: span ", i, " needs slots [", at, ", ", at + nc,
                      ") of ", n_slots);
    end = row + count;
    if (count == 0) continue;
    if (fp32)
      f32.push_back({qc.data_ptr<float>() + row * row_elems, out.data_ptr<float>() + row * row_elems, nullptr,
                     slot + at, nc, n_tokens, first, static_cast<int>(count)});
    else
      b16.push_back({static_cast<const uint16_t*>(qc.data_ptr()) + row * row_elems,
                     static_cast<uint16_t*>(out.data_ptr()) + row * row_elems, nullptr, slot + at, nc, n_tokens, first,
                     static_cast<int>(count)});
  }
  const Shape sh = shape_of(q, k_layer, v_layer, scale, window, softcap);
  if (fp32)
    attend_products(f32, sh);
  else
    attend_products(b16, sh);
}

}  // namespace chunkgen
