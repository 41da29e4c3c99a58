// The decode step's linear layers in bf16 (AMX, else AVX512_BF16): y = x W^T for a few rows of x
// (a decode batch), with W repacked once into 32-column blocks that each stream from memory in
// one pass.
#pragma once

#include <torch/extension.h>

namespace chunkgen {

// Rows of x the packed product takes; more rows go to the general GEMM.
constexpr int64_t kPackedLinearMaxRows = 32;

// W [n, k] bfloat16 -> [ceil(n / 32), ceil(k / 32) * 16, 32, 2] bfloat16: block b holds output
// columns [32 b, 32 b + 32) as pairs along k (the layout AMX reads), zero past n and k.
torch::Tensor pack_linear_op(const torch::Tensor& w);

// x [rows <= kPackedLinearMaxRows, k] bfloat16, packed from pack_linear_op of a W with n rows ->
// [rows, n] bfloat16, fp32 accumulation. Needs the amx or avx512_bf16 path (cpu_kernel_isa()).
torch::Tensor packed_linear_op(const torch::Tensor& x, const torch::Tensor& packed, int64_t n);

}  // namespace chunkgen
