// The greedy sampler's one reduction: the index of each row's largest value.
#pragma once

#include <torch/extension.h>

namespace chunkgen {

// x [rows, n] float32 or bfloat16 with contiguous rows (CPU) -> int64 [rows]: the first index of
// each row's maximum; a row holding NaN gives its first NaN (as torch.max(x, -1).indices does).
torch::Tensor argmax_rows_op(const torch::Tensor& x);

}  // namespace chunkgen
