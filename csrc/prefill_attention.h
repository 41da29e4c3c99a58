// The contract between the binding and the CPU prefill-attention kernel (bf16 in and out).
#pragma once
#include <cstdint>

namespace chunkgen {

// softmax(q k^T * scale [+ mask]) v for q [B, Hq, T, d], k, v [B, Hk, S, d] (query head h reads
// kv head h / (Hq / Hk)); strides in elements, the last dimension unit-stride.
struct PrefillProblem {
  const uint16_t* q;  // bf16
  const uint16_t* k;
  const uint16_t* v;
  int64_t q_stride[3], k_stride[3], v_stride[3];  // batch, head, token
  // Additive bf16 mask [B (or 1: stride 0), 1, T, S] (null: none); -inf hides a key.
  const uint16_t* mask = nullptr;
  int64_t mask_stride[2] = {0, 0};  // batch, query
  uint16_t* out;                    // [B, T, Hq, d] contiguous, bf16
  float* lse;                       // [B, T, Hq] contiguous: natural-log log-sum-exp of the scaled, masked scores
  int batch, q_heads, kv_heads, q_len, kv_len, head_dim;
  float scale;
  // Query i sees keys 0..kv_len - q_len + i (the last query aligned with the last key).
  bool causal;
};

// false (nothing written) when neither AMX nor AVX512_BF16 is usable: the caller takes another path.
// A row that sees no key gets o = 0 and lse = -inf.
bool prefill_attention_cpu(const PrefillProblem& p);

}  // namespace chunkgen
