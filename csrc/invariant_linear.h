// Batch-invariant linear layers on the GPU (csrc/cuda/invariant_linear.cu): y = x W^T (+ bias) with
// every output one fp32 sum over k in one order, whatever the number of rows. cuBLAS chooses its
// kernel, tiles and split of k by the shape, so a row's sums there change with the rows beside it.
// No torch headers: CI compiles the kernel with plain nvcc, and the CUDA emulator runs it.
#pragma once
#include <cstdint>

#include "attention.h"  // KVType

namespace chunkgen {

// x [m, k] (row stride ldx), w [n, k] contiguous, bias [n] or null, y [m, n] (row stride ldy), all
// of one dtype, device memory; fp32 accumulation, rounded once to the dtype after the bias.
struct InvariantLinearProblem {
  const void* x;
  int64_t ldx;
  const void* w;
  const void* bias;
  void* y;
  int64_t ldy;
  int m, n, k;
  KVType type;
};

void invariant_linear_cuda_raw(const InvariantLinearProblem& p, void* stream);

}  // namespace chunkgen
