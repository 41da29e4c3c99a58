// The decode step's linear layers: y = x W^T for a few rows of x (a decode batch), with W
// repacked once into column blocks that each stream from memory in one pass. bf16 on AMX, else
// AVX512_BF16 (cpu/linear.cpp); fp32 on FMA vectors, every x86 ISA (cpu/linear_fp32.cpp).
#pragma once

#include <torch/extension.h>

namespace chunkgen {

// bf16 takes any rows in one parallel region (on AMX, panels of rows over each block of W while it
// is in cache); the model sends more than 32 rows to the general GEMM unless its numerics are
// batch-invariant (csrc/invariant.h).
// fp32: the product keeps its rate at every decode batch (x stays in L2 while the blocks pass);
// more rows go in panels of these.
constexpr int64_t kPackedLinearFp32MaxRows = 256;

// W [n, k] bfloat16 -> [ceil(n / 32), ceil(k / 32) * 16, 32, 2] bfloat16: block b holds output
// columns [32 b, 32 b + 32) as pairs along k (the layout AMX reads), zero past n and k.
// W [n, k] float32 -> [ceil(n / C), k, C] float32, C = packed_linear_fp32_cols() (two vectors of
// the build's width): block b holds output columns [C b, C b + C) along k, zero past n.
torch::Tensor pack_linear_op(const torch::Tensor& w);

// x [rows, k], packed from pack_linear_op of a W with n rows, in x's
// dtype -> [rows, n] in x's dtype, fp32 accumulation. bf16 needs the amx or avx512_bf16 path
// (cpu_kernel_isa()); fp32 runs on any CPU.
torch::Tensor packed_linear_op(const torch::Tensor& x, const torch::Tensor& packed, int64_t n);

torch::Tensor pack_linear_fp32(const torch::Tensor& w);
int64_t packed_linear_fp32_cols();
// Any number of rows, in panels of kPackedLinearFp32MaxRows inside one parallel region.
void packed_linear_fp32(const float* x, int64_t ldx, int64_t rows, const float* w, int64_t k, int64_t n, float* y);

}  // namespace chunkgen
