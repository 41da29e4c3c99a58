// Runs the CUDA decode-attention, K/V-write and invariant linear kernels under the emulator, with a flat C ABI
// for ctypes (the elementwise ops: harness_elementwise.cpp). Mirrors what the binding does before a real launch:
// partial offsets, the largest shared range, the partial buffers (filled with NaN, so a row the kernels forget to write
// cannot pass).
#include "cuda_emu.h"

#include "../../../csrc/cuda/decode_attention.cu"
#include "../../../csrc/cuda/invariant_linear.cu"
#include "../../../csrc/cuda/kv_write.cu"

#include <algorithm>
#include <limits>

// One emulated device per SM count, as the kernels cache each device's limits.
static void select_device(int sms) {
  emu::Device& dev = emu::device();
  dev.current = -1;
  for (const auto& [ordinal, count] : dev.sms)
    if (count == sms) dev.current = ordinal;
  if (dev.current < 0) {
    dev.current = static_cast<int>(dev.sms.size());
    dev.sms[dev.current] = sms;
  }
}

extern "C" int emu_decode_attention(const void* q, void* out, int q_type, const void* k, const void* v, int kv_type,
                                    int batch, int q_heads, int kv_heads, int head_dim, int chunk, float scale,
                                    int num_shared, const int32_t* shared_slot, const int32_t* shared_len,
                                    const int32_t* shared_begin, const int32_t* shared_end,
                                    const int32_t* seq_shared_ptr, const int32_t* seq_shared_idx,
                                    const int32_t* priv_slot, int priv_stride, const int32_t* priv_count,
                                    const int32_t* priv_last_len, int chunk_first, int window, float softcap, int sms,
                                    int split_cap, int invariant, char* err, int err_len) {
  using namespace chunkgen;
  DecodeProblem p{};
  p.q = q;
  p.out = out;
  p.q_type = static_cast<KVType>(q_type);  // q and out: fp32 or the pool's dtype
  p.k = k;
  p.v = v;
  p.kv_type = static_cast<KVType>(kv_type);
  p.batch = batch;
  p.q_heads = q_heads;
  p.kv_heads = kv_heads;
  p.head_dim = head_dim;
  p.chunk = chunk;
  p.scale = scale;
  p.num_shared = num_shared;
  p.shared_slot = shared_slot;
  p.shared_len = shared_len;
  p.shared_begin = shared_begin;
  p.shared_end = shared_end;
  p.seq_shared_ptr = seq_shared_ptr;
  p.seq_shared_idx = seq_shared_idx;
  p.priv_slot = priv_slot;
  p.priv_stride = priv_stride;
  p.priv_count = priv_count;
  p.priv_last_len = priv_last_len;
  p.chunk_first = chunk_first != 0;
  p.invariant = invariant != 0;
  p.window = window;
  p.softcap = softcap;

  std::vector<int32_t> part_off(num_shared + 1, 0);
  int max_rows = 0;
  for (int c = 0; c < num_shared; ++c) {
    part_off[c + 1] = part_off[c] + shared_end[c] - shared_begin[c];
    max_rows = std::max(max_rows, shared_end[c] - shared_begin[c]);
  }
  const size_t rows = static_cast<size_t>(part_off[num_shared]) * q_heads;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> part_o(std::max<size_t>(rows * head_dim, 1), nan), part_m(std::max<size_t>(rows, 1), nan),
      part_l(std::max<size_t>(rows, 1), nan);
  // The sequence-first splits' sums (or, batch-invariant, the private chunks' partials): split_cap
  // blocks a (row, query head), NaN like the partials.
  const size_t split_rows = static_cast<size_t>(batch) * q_heads * split_cap;
  std::vector<float> split_o(std::max<size_t>(split_rows * head_dim, 1), nan),
      split_m(std::max<size_t>(split_rows, 1), nan), split_l(std::max<size_t>(split_rows, 1), nan);
  SplitSpace split_space;
  split_space.o = split_o.data();
  split_space.m = split_m.data();
  split_space.l = split_l.data();
  split_space.splits = split_cap;
  select_device(sms);
  return emu::run_checked(
      [&] {
        decode_attention_cuda_raw(p, part_off.data(), max_rows, part_o.data(), part_m.data(), part_l.data(),
                                  split_space, nullptr);
      },
      err, err_len);
}

// k, v [rows, kv_heads, head_dim] with the given strides (elements) into one pool layer.
extern "C" int emu_write_kv(const void* k, const void* v, int src_type, const int64_t* k_stride,
                            const int64_t* v_stride, void* k_layer, void* v_layer, int pool_type, const int32_t* slot,
                            const int32_t* offset, int rows, int kv_heads, int head_dim, int chunk, char* err,
                            int err_len) {
  using namespace chunkgen;
  KVWriteProblem p{};
  p.k = k;
  p.v = v;
  p.src_type = static_cast<KVType>(src_type);
  for (int i = 0; i < 3; ++i) p.k_stride[i] = k_stride[i], p.v_stride[i] = v_stride[i];
  p.k_layer = k_layer;
  p.v_layer = v_layer;
  p.pool_type = static_cast<KVType>(pool_type);
  p.slot = slot;
  p.offset = offset;
  p.rows = rows;
  p.kv_heads = kv_heads;
  p.head_dim = head_dim;
  p.chunk = chunk;
  return emu::run_checked([&] { write_kv_cuda_raw(p, nullptr); }, err, err_len);
}

// y [m, n] (row stride ldy) = x [m, k] (row stride ldx) w [n, k]^T (+ bias [n] where not null).
// sms: the emulated GPU's SM count (the launch deepens the copy ring where the grid leaves SMs idle).
extern "C" int emu_invariant_linear(const void* x, int64_t ldx, const void* w, const void* bias, void* y, int64_t ldy,
                                    int m, int n, int k, int type, int sms, char* err, int err_len) {
  using namespace chunkgen;
  InvariantLinearProblem p{x, ldx, w, bias, y, ldy, m, n, k, static_cast<KVType>(type)};
  select_device(sms);
  return emu::run_checked([&] { invariant_linear_cuda_raw(p, nullptr); }, err, err_len);
}
