// Runs the decode step's CUDA elementwise ops (csrc/cuda/elementwise.cu) under the emulator, with a
// flat C ABI for ctypes. A translation unit of its own: its helpers live in an anonymous namespace
// whose names (kThreads) the attention kernels' would meet.
#include "cuda_emu.h"

#include "../../../csrc/cuda/elementwise.cu"

// The decode step's elementwise ops (csrc/elementwise.h's CUDA entry points, as the binding calls
// them); type: 0 fp32, 1 bf16, 2 fp16 (KVType's codes).
extern "C" int emu_add_rms_norm(void* residual, const void* delta, const void* weight, void* out, int64_t rows,
                                int64_t n, int64_t res_stride, int64_t delta_stride, int64_t out_stride, float eps,
                                int offset, int type, char* err, int err_len) {
  return emu::run_checked(
      [&] {
        chunkgen::add_rms_norm_cuda(residual, delta, weight, out, rows, n, res_stride, delta_stride, out_stride, eps,
                                    offset != 0, type, nullptr);
      },
      err, err_len);
}

// write_rows > 0: rows [0, write_rows) also store their rotated k and their v in the pool layer
// (k_layer, v_layer of pool_type, chunk tokens a slot) at (slot[r], offset[r]).
extern "C" int emu_rotary(void* qkv, int64_t qkv_stride, const void* positions, int pos64, const void* cos,
                          const void* sin, int64_t table_stride, int64_t rows, int64_t q_heads, int64_t kv_heads,
                          int64_t d, void* q_out, int q_out_type, const void* q_norm, const void* k_norm, float eps,
                          int offset_norm, int type, void* k_layer, void* v_layer, int pool_type, const int32_t* slot,
                          const int32_t* offset, int write_rows, int chunk, char* err, int err_len) {
  chunkgen::KVWriteProblem w{};
  w.k_layer = k_layer;
  w.v_layer = v_layer;
  w.pool_type = static_cast<chunkgen::KVType>(pool_type);
  w.slot = slot;
  w.offset = offset;
  w.rows = write_rows;
  w.kv_heads = static_cast<int>(kv_heads);
  w.head_dim = static_cast<int>(d);
  w.chunk = chunk;
  return emu::run_checked(
      [&] {
        chunkgen::rotary_cuda(qkv, qkv_stride, positions, pos64 != 0, cos, sin, table_stride, rows, q_heads, kv_heads,
                              d, q_out, q_out_type, q_norm, k_norm, eps, offset_norm != 0, type,
                              write_rows > 0 ? &w : nullptr, nullptr);
      },
      err, err_len);
}

// gelu: tanh-GELU(gate) * up, else SiLU(gate) * up.
extern "C" int emu_gated(int gelu, const void* gate_up, int64_t in_stride, void* out, int64_t out_stride, int64_t rows,
                         int64_t n, int type, char* err, int err_len) {
  return emu::run_checked(
      [&] {
        (gelu ? chunkgen::gelu_tanh_mul_cuda : chunkgen::silu_mul_cuda)(gate_up, in_stride, out, out_stride, rows, n,
                                                                        type, nullptr);
      },
      err, err_len);
}
