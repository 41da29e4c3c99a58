// Two-phase partition decode attention on the CPU (the decode_attention op's CPU side).
//
// Phase 1 (chunk-first): for each shared chunk and KV head, the queries of every covered sequence
// (times the GQA group) form one matrix multiplied against the chunk once; partial (o, m, l) rows go
// to a workspace. Phase 2 (sequence-first): for each sequence and KV head, merge the shared partials
// and continue over the private chunks with online softmax. Long private tails are split into
// segments (merged in phase 3) so that every thread has work whatever the tree looks like.
// Batch-invariant (csrc/invariant.h): phase 1 continues each row's running state over its shared
// groups in path order, level by level, and phase 2 continues it over the row's own chunks, with no
// partials merged and no segments: each row is one online softmax over its path whatever the batch
// (per-chunk partials merged afterwards cost 16% of the kernel's time at 32 rows on 2,048 shared
// tokens; this costs nothing measurable).
//
// The pieces: vec.h (SIMD primitives for the build's vector width), online_softmax.h (the fp32
// scores / softmax / values path and the merge), decode_plan.h (work items and workspace),
// decode_chunk_first_bf16.h (phase 1 with bf16 K/V on AMX or AVX512_BF16, chosen at run time).
// q and out are fp32 or bf16 (the model's dtype); softmax statistics and sums are fp32 throughout.
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "../attention.h"
#include "../invariant.h"
#include "bf16_gemm.h"
#include "decode_chunk_first_bf16.h"
#include "decode_plan.h"
#include "isa.h"
#include "kv_lines.h"
#include "online_softmax.h"
#include "prefetch.h"
#include "vec.h"

namespace chunkgen {
namespace decode {

// One chunk into the running state of R query rows; with a window or soft-capping, each row's
// first token inside its window (lo) and the cap go with it.
template <typename T>
inline void attend(const DecodeProblem& p, Scratch& sc, int R, const T* k, const T* v, int n, const int* lo, float* o,
                   float* m, float* l) {
  const int C = p.chunk, d = p.head_dim;
  if (p.window <= 0 && p.softcap <= 0.f) {
    attend_chunk<T, false>(sc.q.data(), R, k, v, n, C, d, o, m, l, sc.s.data(), sc.alpha.data());
    return;
  }
  attend_chunk<T, true>(sc.q.data(), R, k, v, n, C, d, o, m, l, sc.s.data(), sc.alpha.data(),
                        ChunkMask{p.window > 0 ? lo : nullptr, p.softcap});
}
template <typename T>
inline void attend(const DecodeProblem& p, Scratch& sc, int R, const T* k, const T* v, int n, const int* lo) {
  attend<T>(p, sc, R, k, v, n, lo, sc.o.data(), sc.m.data(), sc.l.data());
}

// Query rows of sequences [b0, b1), head h's GQA group, scaled, as fp32 rows of sc.q.
template <typename Q>
inline void load_queries(const DecodeProblem& p, Scratch& sc, int b0, int b1, int h) {
  const int Hq = p.q_heads, G = Hq / p.kv_heads, d = p.head_dim;
  const Q* q = static_cast<const Q*>(p.q);
  for (int b = b0; b < b1; ++b) {
    const Q* src = q + (static_cast<size_t>(b) * Hq + h * G) * d;
    float* dst = sc.q.data() + static_cast<size_t>(b - b0) * G * d;
    for (int i = 0; i < G * d; ++i) dst[i] = to_f32(src[i]) * p.scale;
  }
}

// Batch-invariant: rows [b0, b1)'s running states (head h's query heads) from the workspace into
// the scratch (store: the other way), where phase 1 leaves them between the groups on their paths
// and for phase 2 to continue over the rows' own chunks.
inline void running_state(const DecodeProblem& p, Workspace& ws, Scratch& sc, int b0, int b1, int h, bool store) {
  const int Hq = p.q_heads, G = Hq / p.kv_heads, d = p.head_dim;
  for (int b = b0; b < b1; ++b) {
    const size_t at = static_cast<size_t>(b) * Hq + h * G, r = static_cast<size_t>(b - b0) * G;
    float* o = ws.part_o.data() + at * d;
    float* so = sc.o.data() + r * d;
    if (store) {
      std::memcpy(o, so, sizeof(float) * G * d);
      std::copy_n(sc.m.data() + r, G, ws.part_m.data() + at);
      std::copy_n(sc.l.data() + r, G, ws.part_l.data() + at);
    } else {
      std::memcpy(so, o, sizeof(float) * G * d);
      std::copy_n(ws.part_m.data() + at, G, sc.m.data() + r);
      std::copy_n(ws.part_l.data() + at, G, sc.l.data() + r);
    }
  }
}

// Phase 1, fp32 path: item w's chunks for blocks of its rows kept hot together.
template <typename T, typename Q>
void shared_item_fp32(const DecodeProblem& p, Workspace& ws, const SharedItem& w, Scratch& sc) {
  const int G = p.q_heads / p.kv_heads, h = w.head;
  const PoolView pool(p);
  const T* K = static_cast<const T*>(p.k);
  const T* V = static_cast<const T*>(p.v);
  const int seq_block = std::max(1, kRowBlock / G);
  for (int b0 = w.begin; b0 < w.end; b0 += seq_block) {
    const int b1 = std::min(w.end, b0 + seq_block);
    const int R = (b1 - b0) * G;
    sc.reserve(R, p.head_dim, p.chunk);
    load_queries<Q>(p, sc, b0, b1, h);
    if (p.invariant && w.level > 0)
      running_state(p, ws, sc, b0, b1, h, false);
    else
      sc.reset_state(R, p.head_dim);
    for (int i = w.first; i < w.last; ++i) {
      const int c = ws.group_chunks[i], n = p.shared_len[c];
      const size_t off = pool.at(p.shared_slot[c], h);
      if (p.window > 0)
        for (int r = 0; r < R; ++r) sc.lo[r] = window_lo(ws, b0 + r / G, ws.shared_pos[c], n);
      attend<T>(p, sc, R, K + off, V + off, n, sc.lo.data());
    }
    if (p.invariant)
      running_state(p, ws, sc, b0, b1, h, true);
    else
      store_partials(p, ws, w, b0, b1, sc.o.data(), sc.m.data(), sc.l.data());
  }
}

// Row b's partials of the shared chunks it reads (phase 1's results) into its running state.
inline void merge_shared_partials(const DecodeProblem& p, const Workspace& ws, Scratch& sc, int b, int h) {
  const int Hq = p.q_heads, G = Hq / p.kv_heads, d = p.head_dim;
  for (int i = p.seq_shared_ptr[b]; i < p.seq_shared_ptr[b + 1]; ++i) {
    const int c = p.seq_shared_idx[i];
    if (!ws.holds_partial[c] || b < ws.eff_begin[c] || b >= ws.eff_end[c]) continue;  // no partial here
    for (int g = 0; g < G; ++g) {
      const size_t pr = static_cast<size_t>(ws.shared_row[c] + b - p.shared_begin[c]) * Hq + h * G + g;
      merge_partial(sc.o.data() + g * d, sc.m[g], sc.l[g], ws.part_o.data() + pr * d, ws.part_m[pr], ws.part_l[pr], d);
    }
  }
}

// Chunks [lo, hi) of the own-chunk list, at most two, toward L2 for the row after this one: its
// slots lie anywhere in the pool, so the hardware prefetchers cannot see them coming, and phase 2
// reads each of them once, from memory.
template <typename T>
inline void prefetch_chunks(const DecodeProblem& p, const Workspace& ws, const PoolView& pool, int lo, int hi, int h) {
  constexpr int kLine = 64 / sizeof(T);
  const int C = p.chunk, d = p.head_dim;
  for (int i = lo; i < std::min(hi, lo + 2); ++i) {
    const int n = ws.chunk_len[i];
    const size_t off = pool.at(ws.chunk_slot[i], h);
    const T* k = static_cast<const T*>(p.k) + off;
    const T* v = static_cast<const T*>(p.v) + off;
    for (int t = 0; t < d; ++t)
      for (int j = 0; j < n; j += kLine) prefetch_l2(k + static_cast<size_t>(t) * C + j);
    for (size_t e = 0; e < static_cast<size_t>(n) * d; e += kLine) prefetch_l2(v + e);
  }
}

// Row b's segment seg of its own chunks: [lo, hi) of the own-chunk list.
inline std::pair<int, int> segment_chunks(const Workspace& ws, int b, int seg) {
  const int nseg = ws.seq_nseg[b], c0 = ws.seq_chunk_ptr[b], nc = ws.seq_chunk_ptr[b + 1] - c0;
  return {c0 + static_cast<int>(static_cast<int64_t>(nc) * seg / nseg),
          c0 + static_cast<int>(static_cast<int64_t>(nc) * (seg + 1) / nseg)};
}

// Phase 2: each (row, KV head) of item w over its segment of its own chunks, then written out (or
// kept as the segment's partial for phase 3). A row's heads go one after another: a slot holds
// them side by side, so the item reads its rows' K and V in address order (with prefetch.h's
// prefetches, 256 rows on 2,048 shared tokens, Xeon, fp32: the phase 39.3 -> 30 ms a step).
template <typename T, typename Q>
void seq_item(const DecodeProblem& p, Workspace& ws, const SeqItem& w, Isa isa, Scratch& sc) {
  const int Hq = p.q_heads, G = Hq / p.kv_heads, d = p.head_dim;
  const PoolView pool(p);
  const T* K = static_cast<const T*>(p.k);
  const T* V = static_cast<const T*>(p.v);
  Q* out = static_cast<Q*>(p.out);
  sc.reserve(G, d, p.chunk);
  // bf16 K/V, batch-invariant: the products phase 1 ran, one chunk at a time
  const bool bf16_rows = p.invariant && isa != Isa::Fp32;
  const int n = (w.end - w.begin) * w.heads;
  for (int i = 0; i < n; ++i) {
    const int b = w.begin + i / w.heads, h = w.head + i % w.heads;
    const int next_b = w.begin + (i + 1) / w.heads, next_h = w.head + (i + 1) % w.heads;  // if i + 1 < n
    const int nseg = ws.seq_nseg[b];
    const auto [lo, hi] = segment_chunks(ws, b, w.seg);
    if (i + 1 < n && !bf16_rows) {
      const auto [next_lo, next_hi] = segment_chunks(ws, next_b, w.seg);
      prefetch_chunks<T>(p, ws, pool, next_lo, next_hi, next_h);
    }
    if (ws.item_writes[b] && w.seg == nseg - 1) store_new_kv<T>(p, b, h);  // its segment has the last chunk
    const bool resume = p.invariant && p.chunk_first && p.seq_shared_ptr[b + 1] > p.seq_shared_ptr[b];
#if defined(CHUNKGEN_HAVE_AVX512_BF16)
    if (bf16_rows) {
      thread_local Bf16Scratch bsc;
      // The next (row, head)'s first chunk comes in a share per softmax row of this one's first
      // chunk, spread so that its 100-odd lines are never more prefetches than the core keeps in
      // flight (the phase 25.5 -> 17.5 ms a step at 256 rows, Zen 4).
      NextChunkLines ahead;
      if (i + 1 < n) {
        const auto [next_lo, next_hi] = segment_chunks(ws, next_b, w.seg);
        if (next_lo < next_hi)
          ahead = NextChunkLines(p, next_h, ChunkRef{ws.chunk_slot[next_lo], ws.chunk_len[next_lo]});
      }
      own_chunks_bf16_invariant<Q>(p, ws, b, h, resume, lo, hi, isa == Isa::Amx, bsc, ahead);
      continue;
    }
#endif
    load_queries<Q>(p, sc, b, b + 1, h);
    if (resume)
      running_state(p, ws, sc, b, b + 1, h, false);  // where its shared chunks left it
    else
      sc.reset_state(G, d);
    if (w.seg == 0 && p.chunk_first && !p.invariant) merge_shared_partials(p, ws, sc, b, h);
    for (int c = lo; c < hi; ++c) {
      if ((c - lo) % kLoadChunks == 0) load_chunks<T>(p, ws, pool, c, std::min(hi, c + kLoadChunks), h);
      const int len = ws.chunk_len[c];
      if (len <= 0) continue;
      const size_t off = pool.at(ws.chunk_slot[c], h);
      if (p.window > 0) std::fill_n(sc.lo.data(), G, ws.chunk_lo[c]);
      attend<T>(p, sc, G, K + off, V + off, len, sc.lo.data());
    }
    for (int g = 0; g < G; ++g) {
      const size_t row = static_cast<size_t>(b) * Hq + h * G + g;
      if (nseg == 1) {
        write_normalized(out + row * d, sc.o.data() + g * d, sc.l[g], d);
        continue;
      }
      const size_t sr = static_cast<size_t>(ws.seg_row[b] + w.seg) * Hq + h * G + g;
      std::memcpy(ws.seg_o.data() + sr * d, sc.o.data() + g * d, sizeof(float) * d);
      ws.seg_m[sr] = sc.m[g];
      ws.seg_l[sr] = sc.l[g];
    }
  }
}

// Phase 3: output row `row` (sequence x query head) from the partials of its tail's segments.
template <typename Q>
inline void merge_segments(const DecodeProblem& p, const Workspace& ws, Scratch& sc, int row) {
  const int Hq = p.q_heads, d = p.head_dim, b = row / Hq, qh = row % Hq, nseg = ws.seq_nseg[b];
  if (nseg == 1) return;
  sc.reserve(1, d, p.chunk);
  sc.reset_state(1, d);
  for (int sgi = 0; sgi < nseg; ++sgi) {
    const size_t sr = static_cast<size_t>(ws.seg_row[b] + sgi) * Hq + qh;
    merge_partial(sc.o.data(), sc.m[0], sc.l[0], ws.seg_o.data() + sr * d, ws.seg_m[sr], ws.seg_l[sr], d);
  }
  write_normalized(static_cast<Q*>(p.out) + static_cast<size_t>(row) * d, sc.o.data(), sc.l[0], d);
}

// Phase 1 on this thread's share of the items: bf16 products where the ISA has them, else fp32.
template <typename T, typename Q>
inline void chunk_first_phase(const DecodeProblem& p, Workspace& ws, Isa isa, Scratch& sc) {
  const int n_items = static_cast<int>(ws.shared_items.size());
#if defined(CHUNKGEN_HAVE_AVX512_BF16)
  thread_local Bf16Scratch bsc;
  if (isa != Isa::Fp32 && p.invariant) {  // level by level, each row's state continued chunk by chunk
    for (size_t level = 0; level + 1 < ws.level_ptr.size(); ++level)
#pragma omp for schedule(dynamic, 1)
      for (int it = ws.level_ptr[level]; it < ws.level_ptr[level + 1]; ++it)
        shared_item_bf16_invariant<Q>(p, ws, ws.shared_items[it], isa == Isa::Amx, bsc);
    return;
  }
  if (isa != Isa::Fp32) {
#if defined(CHUNKGEN_HAVE_AMX)
    static const bf16::TileConfig tile_config;
    if (isa == Isa::Amx) _tile_loadconfig(&tile_config);  // tile configuration is per thread
#endif
#pragma omp for schedule(dynamic, 1)
    for (int it = 0; it < n_items; ++it) shared_item_bf16<Q>(p, ws, ws.shared_items[it], isa, bsc);
#if defined(CHUNKGEN_HAVE_AMX)
    if (isa == Isa::Amx) _tile_release();
#endif
    return;
  }
#else
  (void)isa;
#endif
  if (p.invariant) {  // level by level: an item continues the states its level's items left
    for (size_t level = 0; level + 1 < ws.level_ptr.size(); ++level)
#pragma omp for schedule(dynamic, 1)
      for (int it = ws.level_ptr[level]; it < ws.level_ptr[level + 1]; ++it)
        shared_item_fp32<T, Q>(p, ws, ws.shared_items[it], sc);
    return;
  }
#pragma omp for schedule(dynamic, 1)
  for (int it = 0; it < n_items; ++it) shared_item_fp32<T, Q>(p, ws, ws.shared_items[it], sc);
}

DecodeClock clock;

// The multiply-adds' FLOPs of both phases: every query row against every key it reads.
inline void count_flop(const DecodeProblem& p, const Workspace& ws) {
  const double per_key = 4.0 * p.head_dim * p.q_heads;  // q.k and p.v for each query head
  int64_t shared = 0, own = 0;
  if (p.chunk_first)
    for (int c = 0; c < p.num_shared; ++c)
      shared += static_cast<int64_t>(ws.eff_end[c] - ws.eff_begin[c]) * p.shared_len[c];
  for (int b = 0; b < p.batch; ++b) own += seq_tokens(ws, b);
  clock.chunk_first_flop += per_key * static_cast<double>(shared);
  clock.seq_first_flop += per_key * static_cast<double>(own);
}

template <typename T, typename Q>
void run(DecodeProblem p, Isa isa) {
  const double t0 = omp_get_wtime();
  // Batch-invariant: both phases run each row's arithmetic chunk by chunk, the same in either (bf16
  // K/V: the same bf16 products, AMX's tiles where the CPU has them; fp32 K/V: the fp32 path); with
  // a window, every row reads its chunks itself (a window's rows of a shared chunk need not nest).
  if (p.invariant && p.window > 0) p.chunk_first = false;
  [[maybe_unused]] const bool invariant_tiles = p.invariant && isa == Isa::Amx && sizeof(T) == 2;  // AMX builds
  const int nthreads = omp_get_max_threads();
  Workspace& ws = workspace();
  int block = 1;  // chunks the bf16 path multiplies at once
#if defined(CHUNKGEN_HAVE_AVX512_BF16)
  if (isa != Isa::Fp32 && sizeof(T) == 2) block = std::max(1, kBlockTokens / p.chunk);
#endif
  plan_windows(p, ws);
  plan_shared_items(p, ws, nthreads, block);
  plan_own_chunks(p, ws);
  plan_seq_items(p, ws, 4 * nthreads);
  // The step's K/V: a live row writes into its last private chunk, which only it reads, so its
  // sequence-first item stores them (on the lines it is about to read); any other row (padding rows
  // write to the scratch slot) is stored now, before anything reads the pool.
  grow(ws.item_writes, p.batch);
  std::fill_n(ws.item_writes.begin(), p.batch, uint8_t{0});
  if (p.new_k != nullptr)
    for (int b = 0; b < p.batch; ++b) {
      const int np = p.priv_count[b];
      ws.item_writes[b] = np > 0 && p.write_slot[b] == p.priv_slot[static_cast<size_t>(b) * p.priv_stride + np - 1];
      if (!ws.item_writes[b])
        for (int h = 0; h < p.kv_heads; ++h) store_new_kv<T>(p, b, h);
    }
  const int n_seq_items = static_cast<int>(ws.seq_items.size());
  const bool segments = ws.seg_row[p.batch] > 0;
  const int out_rows = p.batch * p.q_heads;
  count_flop(p, ws);
  double t1 = omp_get_wtime(), t2 = t1, t3 = t1;
#pragma omp parallel
  {
    thread_local Scratch sc;
#if defined(CHUNKGEN_HAVE_AMX)
    static const bf16::TileConfig tile_config;
    if (invariant_tiles) _tile_loadconfig(&tile_config);  // both phases' products; per thread
#endif
    chunk_first_phase<T, Q>(p, ws, isa, sc);
#pragma omp master
    t2 = omp_get_wtime();
#pragma omp for schedule(dynamic, 1)
    for (int it = 0; it < n_seq_items; ++it) seq_item<T, Q>(p, ws, ws.seq_items[it], isa, sc);
#pragma omp master
    t3 = omp_get_wtime();
    // No segments: no loop, one barrier less, which matters when the cores are shared and a
    // waiting thread may lose its time slice.
    if (segments)
#pragma omp for schedule(static)
      for (int row = 0; row < out_rows; ++row) merge_segments<Q>(p, ws, sc, row);
#if defined(CHUNKGEN_HAVE_AMX)
    if (invariant_tiles) _tile_release();
#endif
  }
  const double t4 = omp_get_wtime();
  clock.plan_s += t1 - t0;
  clock.chunk_first_s += t2 - t1;
  clock.seq_first_s += t3 - t2;
  clock.merge_s += t4 - t3;
  clock.calls += 1;
}

}  // namespace decode

int simd_width() { return decode::W; }

const char* cpu_kernel_isa() { return isa_name(current_isa()); }

DecodeClock decode_clock(bool reset) {
  const DecodeClock now = decode::clock;
  if (reset) decode::clock = DecodeClock{};
  return now;
}

void decode_attention_cpu(const DecodeProblem& problem) {
  DecodeProblem p = problem;
  p.invariant = batch_invariant();
  const bool q32 = p.q_type == KVType::F32;
  if (p.kv_type == KVType::F32) {
    decode::run<float, float>(p, Isa::Fp32);
    return;
  }
  const Isa isa = current_isa();
  if (q32)
    decode::run<uint16_t, float>(p, isa);
  else
    decode::run<uint16_t, uint16_t>(p, isa);
}

}  // namespace chunkgen
