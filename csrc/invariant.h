// Batch-invariant numerics: a row's results do not depend on the rows computed beside it. With it
// on (off by default: docs/batch-invariance.md), the CPU kernels give every row the same reduction order whatever the
// batch: the linear layers the same k order per row at any row count (no switch of kernel by row count), attention one
// online softmax per row over its path's chunks in path order, whichever rows read a chunk together (no partials merged
// in an order that depends on which rows share them, no segments that depend on the thread count), and the prefill's
// attention per sequence over its whole path, in the same fold. The CUDA decode kernel reads it too
// (one partial a chunk of every row's path, merged in path order: csrc/cuda/decode_attention.cu), and
// the GPU's linear layers then take csrc/cuda/invariant_linear.cu. Off: the faster plan of each call.
#pragma once

namespace chunkgen {

bool batch_invariant();
void set_batch_invariant(bool on);

}  // namespace chunkgen
