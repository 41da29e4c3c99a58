// The decode kernel's plan, made once per call before any thread starts: the chunk-first work
// items (shared chunks x rows x KV head), the chunks each row reads itself and their segments, the
// sliding-window bounds, and the reused workspace the partial results go to.
#pragma once

#include <algorithm>
#include <cstring>
#include <vector>

#include "../attention.h"
#include "aligned.h"
#include "online_softmax.h"

namespace chunkgen {
namespace decode {

// Chunk-first work: shared chunks group_chunks[first, last), which all cover rows [begin, end) of
// the batch, against one KV head. Chunks covering the same rows lie on the same paths, so one
// online softmax runs over all of them and leaves one partial per row (stored at the first chunk's
// partial rows; the others get l = 0, which the merge skips) instead of one per chunk.
// Batch-invariant: an item takes its group's chunks whole, in path order, and continues each row's
// running state (left by the item of the group before it on the row's path, `level` - 1) instead
// of starting a partial: every row is then one online softmax over its path, chunk by chunk, in
// path order, whichever rows read a chunk together and whichever phase reads it.
struct SharedItem {
  int first, last, head, begin, end;
  int level = 0;  // groups before this one on its rows' paths (batch-invariant plan only)
};
// Sequence-first work: rows [begin, end), each against KV heads [head, head + heads), over segment
// `seg` of its own chunks (several segments only for a lone long tail; then end = begin + 1 and
// one head an item).
struct SeqItem {
  int begin, end, head, heads, seg;
};

// Reused between calls so that a steady decode loop does not allocate.
struct Workspace {
  std::vector<int64_t> shared_row;  // first partial row of each shared chunk
  AlignedVector<float> part_o, part_m, part_l;
  // Shared chunk c's partial rows hold a result (it is the first chunk of its items): the merge
  // reads only those, not every chunk's rows, which lie a whole batch of rows apart.
  std::vector<uint8_t> holds_partial;
  std::vector<SharedItem> shared_items;
  std::vector<int32_t> group_chunks;                          // live shared chunks, ordered by their row range
  std::vector<int32_t> chunk_slot, chunk_len, seq_chunk_ptr;  // chunks each sequence reads itself
  std::vector<int32_t> seq_nseg, seg_row;
  AlignedVector<float> seg_o, seg_m, seg_l;
  std::vector<SeqItem> seq_items;
  std::vector<uint8_t> item_writes;  // row b's new K/V are stored by its sequence-first item
  // Batch-invariant plan: shared_items ordered by level, level L's items at
  // [level_ptr[L], level_ptr[L + 1]); each row's running state (o, m, l per query head) after the
  // shared chunks read so far lives in part_o / part_m / part_l at row b * q_heads + query head
  // (the bf16 path keeps l as 16 lane sums, part_lv).
  std::vector<int32_t> level_ptr;
  AlignedVector<float> part_lv;
  // Sliding windows: rows [eff_begin, eff_end) of each shared chunk read it (all its rows without a
  // window); with one, each shared chunk's first position, each row's window start, and the first
  // token inside the window of each chunk a row reads itself.
  std::vector<int32_t> eff_begin, eff_end, shared_pos, row_lo, chunk_lo;
};

// The pool's layout: a slot holds every KV head's [d, C] keys (transposed) and [C, d] values.
struct PoolView {
  size_t head_elems, slot_elems;
  explicit PoolView(const DecodeProblem& p)
      : head_elems(static_cast<size_t>(p.head_dim) * p.chunk), slot_elems(head_elems * p.kv_heads) {}
  size_t at(int64_t slot, int head) const { return slot * slot_elems + head * head_elems; }
};

inline Workspace& workspace() {
  static Workspace ws;
  return ws;
}

template <typename Vec>
inline void grow(Vec& v, size_t n) {
  if (v.size() < n) v.resize(n);
}

// The rows of each shared chunk that read it. With a window, a row whose window starts past a
// chunk's last position skips it: the chunk's rows shrink to the first and last row that reach it
// (rows between that do not are masked whole), and a chunk no row reaches has none, so nothing
// reads it. Also each shared chunk's first position and each row's window start.
inline void plan_windows(const DecodeProblem& p, Workspace& ws) {
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
inline int window_lo(const Workspace& ws, int b, int pos, int n) { return std::clamp(ws.row_lo[b] - pos, 0, n); }

// Tokens row b reads in the sequence-first phase.
inline int64_t seq_tokens(const Workspace& ws, int b) {
  int64_t n = 0;
  for (int i = ws.seq_chunk_ptr[b]; i < ws.seq_chunk_ptr[b + 1]; ++i) n += ws.chunk_len[i];
  return n;
}

// The partials of rows [b0, b1) of item w (state rows (b - b0) * G + g), at the item's first chunk.
inline void store_partials(const DecodeProblem& p, Workspace& ws, const SharedItem& w, int b0, int b1, const float* o,
                           const float* m, const float* l) {
  if (w.first == w.last) return;
  const int Hq = p.q_heads, G = Hq / p.kv_heads, d = p.head_dim, h = w.head;
  const int c = ws.group_chunks[w.first];
  for (int b = b0; b < b1; ++b)
    for (int g = 0; g < G; ++g) {
      const size_t pr = static_cast<size_t>(ws.shared_row[c] + b - p.shared_begin[c]) * Hq + h * G + g;
      const int r = (b - b0) * G + g;
      std::memcpy(ws.part_o.data() + pr * d, o + static_cast<size_t>(r) * d, sizeof(float) * d);
      ws.part_m[pr] = m[r];
      ws.part_l[pr] = l[r];
    }
}

// Batch-invariant: group group_chunks[g0, g1) (every chunk read by the same rows) as items over
// all its chunks, reordered into path order (the order its first row's path lists them), cut by
// rows only into `pieces` per head. Its level: the groups before it on that row's path (rows
// along a path shrink, so the chunks of one group are one run of it, the same for all its rows).
inline void add_group_in_path_order(const DecodeProblem& p, Workspace& ws, int g0, int g1, int64_t pieces) {
  const int c0 = ws.group_chunks[g0], row = ws.eff_begin[c0], end = ws.eff_end[c0], cover = end - row;
  const auto same_rows = [&](int a, int b) {
    return ws.eff_begin[a] == ws.eff_begin[b] && ws.eff_end[a] == ws.eff_end[b];
  };
  int level = 0, at = g0, prev = -1;
  for (int i = p.seq_shared_ptr[row]; i < p.seq_shared_ptr[row + 1]; prev = p.seq_shared_idx[i++]) {
    const int c = p.seq_shared_idx[i];
    if (same_rows(c, c0))
      ws.group_chunks[at++] = c;
    else if (at == g0 && (prev < 0 || !same_rows(c, prev)))
      ++level;  // a group before this one starts here
  }
  const int rows_per = static_cast<int>((cover + pieces - 1) / pieces);
  for (int h = 0; h < p.kv_heads; ++h)
    for (int b = row; b < end; b += rows_per)
      ws.shared_items.push_back({g0, g1, h, b, std::min(b + rows_per, end), level});
}

// Batch-invariant: the items by level (a stable sort: the plan's order within a level) and where
// each level starts.
inline void order_by_level(Workspace& ws) {
  std::stable_sort(ws.shared_items.begin(), ws.shared_items.end(),
                   [](const SharedItem& a, const SharedItem& b) { return a.level < b.level; });
  ws.level_ptr.assign(1, 0);
  for (size_t i = 0; i < ws.shared_items.size(); ++i)
    while (static_cast<int>(ws.level_ptr.size()) <= ws.shared_items[i].level)
      ws.level_ptr.push_back(static_cast<int32_t>(i));
  ws.level_ptr.push_back(static_cast<int32_t>(ws.shared_items.size()));
}

// Phase 1's items: the live shared chunks grouped by the rows that read them; each group's (rows x
// chunks) work per head cut into about three equal pieces a thread, by chunks first (each piece
// repacks / reads its chunks once), never cutting a bf16 block of `block` chunks short. Also the
// partial rows each shared chunk's rows take in the workspace.
inline void plan_shared_items(const DecodeProblem& p, Workspace& ws, int nthreads, int block) {
  const int Hk = p.kv_heads, S = p.chunk_first ? p.num_shared : 0;
  const int32_t* eff_begin = ws.eff_begin.data();
  const int32_t* eff_end = ws.eff_end.data();
  grow(ws.shared_row, S + 1);
  ws.shared_row[0] = 0;
  int64_t shared_work = 0;
  ws.group_chunks.clear();
  for (int c = 0; c < S; ++c) {
    ws.shared_row[c + 1] = ws.shared_row[c] + p.shared_end[c] - p.shared_begin[c];
    shared_work += static_cast<int64_t>(eff_end[c] - eff_begin[c]) * Hk;
    if (eff_end[c] > eff_begin[c]) ws.group_chunks.push_back(c);
  }
  std::sort(ws.group_chunks.begin(), ws.group_chunks.end(), [&](int a, int b) {
    if (eff_begin[a] != eff_begin[b]) return eff_begin[a] < eff_begin[b];
    if (eff_end[a] != eff_end[b]) return eff_end[a] < eff_end[b];
    return a < b;
  });
  // Pieces are long: every piece restarts its rows' softmax and adds partial rows for phase 2 to
  // merge (8 pieces a thread measured 6-17% slower than 3), and enough for the dynamic schedule.
  const int64_t per_item = std::max<int64_t>(4, (shared_work + 3 * nthreads - 1) / (3 * nthreads));
  ws.shared_items.clear();
  const int n_live = static_cast<int>(ws.group_chunks.size());
  grow(ws.holds_partial, S);
  std::fill_n(ws.holds_partial.begin(), S, uint8_t{0});
  for (int g0 = 0, g1; g0 < n_live; g0 = g1) {
    const int c0 = ws.group_chunks[g0], begin = eff_begin[c0], end = eff_end[c0];
    for (g1 = g0 + 1; g1 < n_live && eff_begin[ws.group_chunks[g1]] == begin && eff_end[ws.group_chunks[g1]] == end;
         ++g1) {
    }
    const int nch = g1 - g0, cover = end - begin;
    const int64_t pieces = (static_cast<int64_t>(cover) * nch + per_item - 1) / per_item;
    if (p.invariant) {
      add_group_in_path_order(p, ws, g0, g1, std::max<int64_t>(1, pieces));
      continue;
    }
    const int blocks = (nch + block - 1) / block;
    const int chunk_pieces = static_cast<int>(std::min<int64_t>(blocks, pieces));
    const int row_pieces = static_cast<int>(std::max<int64_t>(1, (pieces + chunk_pieces - 1) / chunk_pieces));
    const int rows_per = (cover + row_pieces - 1) / row_pieces;
    const auto cut = [&](int cp) { return g0 + std::min(nch, cp * blocks / chunk_pieces * block); };
    for (int h = 0; h < Hk; ++h)
      for (int cp = 0; cp < chunk_pieces; ++cp)
        for (int b = begin; b < end; b += rows_per)
          ws.shared_items.push_back(
              {cut(cp), cp + 1 == chunk_pieces ? g1 : cut(cp + 1), h, b, std::min(b + rows_per, end)});
    for (int cp = 0; cp < chunk_pieces; ++cp) ws.holds_partial[ws.group_chunks[cut(cp)]] = 1;
  }
  if (p.invariant) order_by_level(ws);
  const size_t part_rows = static_cast<size_t>(p.invariant ? p.batch : ws.shared_row[S]) * p.q_heads;
  grow(ws.part_o, part_rows * p.head_dim);
  grow(ws.part_m, part_rows);
  grow(ws.part_l, part_rows);
  if (p.invariant) grow(ws.part_lv, part_rows * 16);
}

// The chunks each row reads itself in phase 2 (its private chunks, and its shared ones when phase 1
// is off). With a window, a chunk that ends before the row's window is left out, and the first
// token inside the window is kept for each chunk that is read.
inline void plan_own_chunks(const DecodeProblem& p, Workspace& ws) {
  const int B = p.batch, C = p.chunk;
  grow(ws.seq_chunk_ptr, B + 1);
  ws.chunk_slot.clear();
  ws.chunk_len.clear();
  ws.chunk_lo.clear();
  ws.seq_chunk_ptr[0] = 0;
  for (int b = 0; b < B; ++b) {
    int pos = 0;
    const auto add = [&](int slot, int n) {
      if (p.window > 0) {
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
}

// Phase 2's items. Few rows: one item per (row, head, segment), a long tail cut into segments so
// every thread has work. Many rows: consecutive rows grouped into items of about equal work (tokens
// read, plus a fixed cost per row), a few items per thread: a row's few hundred nanoseconds of work
// would otherwise be matched by the cost of handing it out.
inline void plan_seq_items(const DecodeProblem& p, Workspace& ws, int target_items) {
  const int B = p.batch, Hk = p.kv_heads;
  const int base_items = B * Hk;
  // Batch-invariant: no segments, whose merge order would follow the thread count.
  const int max_seg = p.invariant || base_items >= target_items ? 1 : (target_items + base_items - 1) / base_items;
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
  if (max_seg > 1) {
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < Hk; ++h)
        for (int sgi = 0; sgi < ws.seq_nseg[b]; ++sgi) ws.seq_items.push_back({b, b + 1, h, 1, sgi});
  } else {
    constexpr int64_t kRowCost = 32;
    int64_t total = 0;
    for (int b = 0; b < B; ++b) total += kRowCost + seq_tokens(ws, b);
    // Each item takes every head of its rows (see seq_item).
    const int items = 4 * target_items;
    const int64_t per_item = std::max<int64_t>(1, (total + items - 1) / items);
    for (int b0 = 0, b1; b0 < B; b0 = b1) {
      int64_t work = 0;
      for (b1 = b0; b1 < B && (b1 == b0 || work < per_item); ++b1) work += kRowCost + seq_tokens(ws, b1);
      ws.seq_items.push_back({b0, b1, 0, Hk, 0});
    }
  }
  const size_t seg_rows = static_cast<size_t>(ws.seg_row[B]) * p.q_heads;
  grow(ws.seg_o, seg_rows * p.head_dim);
  grow(ws.seg_m, seg_rows);
  grow(ws.seg_l, seg_rows);
}

}  // namespace decode
}  // namespace chunkgen
