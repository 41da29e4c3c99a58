// The one contract between the prefix tree (Python) and the decode-attention kernels.
//
// Pool layout for one layer:  K [slots, kv_heads, head_dim, chunk]  (transposed: scores are
// vertical FMAs over the chunk's tokens), V [slots, kv_heads, chunk, head_dim].
// Batch order is the tree's leaf order, so every shared chunk covers a contiguous range of rows.
#pragma once
#include <cstdint>

namespace chunkgen {

enum class KVType { F32, BF16, F16 };

struct DecodeProblem {
  // queries [batch, q_heads, head_dim], contiguous; output the same shape and dtype. Both are fp32,
  // or both the pool's dtype (q_type == kv_type): softmax statistics and sums stay fp32 inside.
  const void* q;
  void* out;
  KVType q_type;
  const void* k;  // one layer of the pool
  const void* v;
  KVType kv_type;
  int batch, q_heads, kv_heads, head_dim, chunk;
  float scale;

  // Chunks read by more than one sequence of the batch: slot, valid tokens, rows [begin, end).
  int num_shared;
  const int32_t* shared_slot;
  const int32_t* shared_len;
  const int32_t* shared_begin;
  const int32_t* shared_end;
  // CSR: the shared chunks on each sequence's path, root first (indices into shared_*).
  const int32_t* seq_shared_ptr;  // [batch + 1]
  const int32_t* seq_shared_idx;
  // Private chunks of each sequence: a row of `priv_stride` slots, `priv_count` used; every private
  // chunk is full except the last, which holds `priv_last_len` tokens.
  const int32_t* priv_slot;  // [batch, priv_stride]
  int priv_stride;
  const int32_t* priv_count;     // [batch]
  const int32_t* priv_last_len;  // [batch]

  // Sliding window: a row whose current token is at position t (the row's length - 1) attends
  // positions max(0, t - window + 1)..t only; 0 is full attention. softcap > 0 caps each scaled
  // score s as softcap * tanh(s / softcap) before the softmax; 0 leaves scores as they are.
  int window = 0;
  float softcap = 0.f;

  // false: the "paged" baseline: every sequence reads its shared chunks itself.
  bool chunk_first;
  // Batch-invariant (csrc/invariant.h; each device's entry sets it from batch_invariant()). On the
  // CPU every row is one online softmax over its path's chunks in path order (shared groups continue
  // the row's state, no partials merged), no segments; on CUDA every chunk of a row leaves a partial
  // made by one code path, merged in path order (csrc/cuda/decode_attention.cu).
  bool invariant = false;

  // The step's new K/V for the CPU kernel to store (null: the caller stored them): row b's k, v
  // [kv_heads, head_dim] in the pool's dtype (strides in elements) go to the pool layer at
  // (write_slot[b], write_offset[b]). The kernel stores a row's K/V in the same pass that reads
  // the row's chunks, while their lines are in cache, where the row's last private chunk is the
  // target (always, for a live row), and before any reading otherwise.
  const void* new_k = nullptr;
  const void* new_v = nullptr;
  int64_t new_k_stride[3] = {0, 0, 0};
  int64_t new_v_stride[3] = {0, 0, 0};
  const int32_t* write_slot = nullptr;
  const int32_t* write_offset = nullptr;
};

// The CUDA sequence-first phase's space for a row's work items split over several blocks
// (flash-decoding): each block's unnormalised (o [d], m, l) of a query head, for up to `splits`
// blocks a (row, query head). splits 0 or 1: no space, one block a (row, KV head). Batch-invariant,
// it holds the rows' private chunks' partials instead (priv_stride a row: splits >= priv_stride).
struct SplitSpace {
  float* o = nullptr;
  float* m = nullptr;
  float* l = nullptr;
  int splits = 0;
};

// The step's K/V rows into one layer of the pool on the GPU (csrc/cuda/kv_write.cu), in one launch:
// row b's k, v [kv_heads, head_dim] (any strides, in elements; converted to the pool's dtype) go
// to (slot[b], offset[b]) of the layer's contiguous K [slots, kv_heads, head_dim, chunk] and
// V [slots, kv_heads, chunk, head_dim]. Every pointer is device memory.
struct KVWriteProblem {
  const void* k;
  const void* v;
  KVType src_type;
  int64_t k_stride[3], v_stride[3];
  void* k_layer;
  void* v_layer;
  KVType pool_type;
  const int32_t* slot;
  const int32_t* offset;
  int rows, kv_heads, head_dim, chunk;
};

void decode_attention_cpu(const DecodeProblem& p);
int simd_width();  // fp32 lanes the CPU kernel was compiled for
// The CPU kernel path a bf16 call takes now: "amx", "avx512_bf16", or the fp32 path ("avx512",
// "avx2", "avx", "sse", "generic"; fp32 KV always takes it). CHUNKGEN_CPU_ISA names a lower path to
// force one (tests run every path the machine has); a higher one than available is not granted.
const char* cpu_kernel_isa();

// What the CPU decode kernel did since the clock was last reset, for profiles (`bench step`):
// wall seconds of its parts as the calling thread sees them (planning, chunk-first, sequence-first,
// the segment merge; each part ends at the barrier after it) and the multiply-adds' FLOPs of the
// two phases (4 x head_dim per query row and key). Kept by every call; costs a few clock reads.
struct DecodeClock {
  double plan_s = 0, chunk_first_s = 0, seq_first_s = 0, merge_s = 0;
  double chunk_first_flop = 0, seq_first_flop = 0;
  int64_t calls = 0;
};
DecodeClock decode_clock(bool reset);

}  // namespace chunkgen
