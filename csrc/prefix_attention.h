// The prefill's prefix product (cpu/prefix_attention.cpp): a group's new tokens against the cached
// chunks every member reads first, read in place from one pool layer.
#pragma once

#include <torch/extension.h>

#include <tuple>

namespace chunkgen {

// q [R, Hq, d] (query head h reads kv head h / (Hq / Hk)); k_layer [S, Hk, d, C] and v_layer
// [S, Hk, C, d], one layer of the pool, q's dtype: float32, or bfloat16 on the AVX512_BF16 or AMX
// path (bf16 products, fp32 softmax and sums); slots int32: the prefix's chunks in order, all full
// but the last, n_tokens in all. Returns softmax(q K^T * scale) V [R, Hq, d] in q's dtype and its
// natural-log log-sum-exp [R, Hq], float32. first >= 0: causal, query r at position first + r
// reads positions [0, first + r] only (a lone sequence's whole path, its new tokens stored). A
// causal product only: window > 0 narrows that to [first + r - window + 1, first + r] (chunks before
// every row's window are not read), softcap > 0 caps each scaled score s as softcap * tanh(s /
// softcap), as the decode kernel does; 0 turns either off.
std::tuple<torch::Tensor, torch::Tensor> prefix_attention(const torch::Tensor& q, const torch::Tensor& k_layer,
                                                          const torch::Tensor& v_layer, const torch::Tensor& slots,
                                                          int64_t n_tokens, double scale, int64_t first = -1,
                                                          int64_t window = 0, double softcap = 0);

// Several lone sequences' causal products (prefix_attention with first >= 0, lse not made) in one
// parallel region, into out [R, Hq, d] (q's shape and dtype, contiguous): span i = (row, count,
// first, at) of spans int64 [N, 4] is rows [row, row + count) of q at positions first..first + count
// - 1, its path the ceil((first + count) / C) chunks slots[at...]. Spans in row order, disjoint; rows
// of no span are not written; window and softcap as for prefix_attention. Each row gets the same
// bits as from its sequence's own call.
void causal_attention(const torch::Tensor& q, const torch::Tensor& k_layer, const torch::Tensor& v_layer,
                      const torch::Tensor& slots, const torch::Tensor& spans, double scale, torch::Tensor& out,
                      int64_t window = 0, double softcap = 0);

}  // namespace chunkgen
