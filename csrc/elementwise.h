// The decode forward's elementwise work, fused into four ops (torch.ops.chunkgen.*): a residual add
// with the RMSNorm after it, rotary embedding (after the q/k norms where a model has them) applied in
// place to the qkv product, SiLU(gate) * up and tanh-GELU(gate) * up.
// Each rounds exactly where the unfused torch composition rounds (every intermediate the torch ops
// would store in the model's dtype is rounded to it here too), so swapping them in changes no bit.
#pragma once

#include <torch/extension.h>

#include <optional>

#include "attention.h"

namespace chunkgen {

// residual += delta (when given, rounded to residual's dtype), then
// out = round(round(residual * rsqrt(mean(residual^2) + eps)) * weight), the mean in fp32; with
// offset (Gemma's norms) out = round(residual * rsqrt(...) * (1 + weight)), all of it in fp32.
void add_rms_norm_op(torch::Tensor& residual, const std::optional<torch::Tensor>& delta, const torch::Tensor& weight,
                     double eps, torch::Tensor& out, bool offset);

// For row r, the first q_heads + kv_heads heads of qkv [rows, >= (q_heads + kv_heads) * d] are rotated
// by position positions[r]: x*cos + rotate_half(x)*sin, each product and the sum rounded to qkv's
// dtype. The k heads are written back in place; the q heads go to q_out [rows, q_heads, d] (any
// float dtype: the rotated value, rounded to qkv's dtype, is then cast). Given q_norm and k_norm
// [head_dim] (Qwen3, Gemma 3), each head is first RMS-normed over its head_dim values with them, as
// add_rms_norm rounds (offset likewise), and the normed head is what gets rotated.
// Given the pool (k_cache, v_cache: [layers, slots, ...]) and write_slot, write_offset (int32, on
// qkv's device), the first write_slot.size(0) rows also store their rotated k heads and their v
// heads (the kv_heads heads after the k heads) in `layer` of the pool, as decode_attention stores a
// step's K/V: on a GPU that is the step's K/V write without a launch of its own.
void rotary_op(torch::Tensor& qkv, const torch::Tensor& positions, const torch::Tensor& cos, const torch::Tensor& sin,
               int64_t q_heads, int64_t kv_heads, torch::Tensor& q_out, const std::optional<torch::Tensor>& q_norm,
               const std::optional<torch::Tensor>& k_norm, double eps, bool offset_norm,
               const std::optional<torch::Tensor>& k_cache, const std::optional<torch::Tensor>& v_cache, int64_t layer,
               const std::optional<torch::Tensor>& write_slot, const std::optional<torch::Tensor>& write_offset);

// out [rows, n] = round(round(silu(gate)) * up), gate_up [rows, 2n] = [gate | up].
void silu_mul_op(const torch::Tensor& gate_up, torch::Tensor& out);

// out [rows, n] = round(round(gelu_tanh(gate)) * up): the GeGLU of Gemma's MLP.
void gelu_tanh_mul_op(const torch::Tensor& gate_up, torch::Tensor& out);

#ifdef CHUNKGEN_WITH_CUDA
// Raw launchers (csrc/cuda/elementwise.cu). dtype: 0 float32, 1 bfloat16, 2 float16.
void add_rms_norm_cuda(void* residual, const void* delta, const void* weight, void* out, int64_t rows, int64_t n,
                       int64_t res_stride, int64_t delta_stride, int64_t out_stride, float eps, bool offset, int dtype,
                       void* stream);
void rotary_cuda(void* qkv, int64_t qkv_stride, const void* positions, bool pos64, const void* cos, const void* sin,
                 int64_t table_stride, int64_t rows, int64_t q_heads, int64_t kv_heads, int64_t d, void* q_out,
                 int q_out_dtype, const void* q_norm, const void* k_norm, float eps, bool offset_norm, int dtype,
                 const KVWriteProblem* write, void* stream);
void silu_mul_cuda(const void* gate_up, int64_t in_stride, void* out, int64_t out_stride, int64_t rows, int64_t n,
                   int dtype, void* stream);
void gelu_tanh_mul_cuda(const void* gate_up, int64_t in_stride, void* out, int64_t out_stride, int64_t rows, int64_t n,
                        int dtype, void* stream);
#endif

}  // namespace chunkgen
