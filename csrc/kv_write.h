// The step's K/V write into one layer of the pool, on the pool's device (csrc/bindings.cpp): the
// decode op and the prefill wave store rows through it, and the rotary op (elementwise.h) checks
// its fused write with it and hands the GPU kernel the same problem.
#pragma once

#include <torch/extension.h>

#include "attention.h"

namespace chunkgen {

// k, v [rows, kv_heads, head_dim] (any strides) of the pool's heads and device; one write_slot and
// write_offset entry a row.
void check_write(const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& k_layer,
                 const torch::Tensor& write_slot, const torch::Tensor& write_offset);

// Row b's k, v go to (write_slot[b], write_offset[b]) of the layer's K [slots, kv_heads, head_dim,
// chunk] and V [slots, kv_heads, chunk, head_dim], converted to the pool's dtype.
void write_kv(const torch::Tensor& k, const torch::Tensor& v, torch::Tensor& k_layer, torch::Tensor& v_layer,
              const torch::Tensor& write_slot, const torch::Tensor& write_offset);

// Whether the GPU's write kernel takes these: contiguous layers, contiguous int32 indices.
bool fits_write_kernel(const torch::Tensor& k_layer, const torch::Tensor& v_layer, const torch::Tensor& write_slot,
                       const torch::Tensor& write_offset);

// The write as the GPU kernels take it (csrc/cuda/kv_write.cu, and rotary's fused write).
KVWriteProblem kv_write_problem(const torch::Tensor& k, const torch::Tensor& v, torch::Tensor& k_layer,
                                torch::Tensor& v_layer, const torch::Tensor& write_slot,
                                const torch::Tensor& write_offset);

}  // namespace chunkgen
