// The fp32 prefill's prefix product: the new tokens of a wave's group attend to the cached chunks
// every member reads first. The chunks are read in place from the pool (K stored transposed), one
// block of query rows (positions x the GQA group) at a time, with the decode kernel's online
// softmax (online_softmax.h): no gathered copy of the prefix, each chunk read once per block, the
// products register-blocked as in the decode kernel's chunk-first phase. The normalized output and
// log-sum-exp merge with the attention over the rest of each row's path (kernels/prefill.py).
#include "../prefix_attention.h"

#include <omp.h>

#include <algorithm>
#include <cmath>

#include "online_softmax.h"

namespace chunkgen {

std::tuple<torch::Tensor, torch::Tensor> prefix_attention(const torch::Tensor& q, const torch::Tensor& k_layer,
                                                          const torch::Tensor& v_layer, const torch::Tensor& slots,
                                                          int64_t n_tokens, double scale) {
  TORCH_CHECK_VALUE(q.dim() == 3 && k_layer.dim() == 4 && v_layer.dim() == 4 && slots.dim() == 1,
                    "prefix_attention: q [R, Hq, d], k_layer [S, Hk, d, C], v_layer [S, Hk, C, d], slots [n], got ",
                    q.sizes(), ", ", k_layer.sizes(), ", ", v_layer.sizes(), ", ", slots.sizes());
  TORCH_CHECK_TYPE(q.scalar_type() == torch::kFloat && k_layer.scalar_type() == torch::kFloat &&
                       v_layer.scalar_type() == torch::kFloat && slots.scalar_type() == torch::kInt,
                   "prefix_attention: q, k_layer, v_layer float32 and slots int32, got ", q.scalar_type(), ", ",
                   k_layer.scalar_type(), ", ", v_layer.scalar_type(), ", ", slots.scalar_type());
  TORCH_CHECK_VALUE(q.device().is_cpu() && k_layer.device().is_cpu() && v_layer.device().is_cpu() &&
                        slots.device().is_cpu() && k_layer.is_contiguous() && v_layer.is_contiguous() &&
                        slots.is_contiguous(),
                    "prefix_attention: CPU tensors, the pool layers and slots contiguous");
  const int R = static_cast<int>(q.size(0)), Hq = static_cast<int>(q.size(1)), d = static_cast<int>(q.size(2));
  const int Hk = static_cast<int>(k_layer.size(1)), C = static_cast<int>(k_layer.size(3));
  const int64_t S = k_layer.size(0), nc = slots.size(0);
  TORCH_CHECK_VALUE(Hk > 0 && Hq % Hk == 0 && k_layer.size(2) == d && v_layer.size(0) == S && v_layer.size(1) == Hk &&
                        v_layer.size(2) == C && v_layer.size(3) == d,
                    "prefix_attention: shapes do not fit: q ", q.sizes(), ", k_layer ", k_layer.sizes(), ", v_layer ",
                    v_layer.sizes());
  // The score and value vectors span 16 floats at most: whole vectors of every chunk and head.
  TORCH_CHECK_VALUE(d > 0 && d % 16 == 0 && C > 0 && C % 16 == 0,
                    "prefix_attention: head_dim and chunk size must be positive multiples of 16, got ", d, " and ", C);
  TORCH_CHECK_VALUE(n_tokens > 0 && nc == (n_tokens + C - 1) / C, "prefix_attention: ", nc,
                    " slots cannot hold a prefix of ", n_tokens, " tokens in chunks of ", C);
  const int32_t* slot = slots.data_ptr<int32_t>();
  for (int64_t i = 0; i < nc; ++i)
    TORCH_CHECK_VALUE(slot[i] >= 0 && slot[i] < S, "prefix_attention: slot ", slot[i], " outside the pool layer's ", S);

  const auto qc = q.contiguous();
  auto out = torch::empty({R, Hq, d}, q.options());
  auto lse = torch::empty({R, Hq}, q.options());
  if (R == 0) return {out, lse};
  const float* qp = qc.data_ptr<float>();
  const float* K = k_layer.data_ptr<float>();
  const float* V = v_layer.data_ptr<float>();
  float* op = out.data_ptr<float>();
  float* lp = lse.data_ptr<float>();
  const int G = Hq / Hk, per_block = std::max(1, decode::kRowBlock / G);
  const int blocks = (R + per_block - 1) / per_block, items = blocks * Hk;
  const size_t head_elems = static_cast<size_t>(d) * C;
#pragma omp parallel
  {
    thread_local decode::Scratch sc;
#pragma omp for schedule(dynamic, 1)
    for (int it = 0; it < items; ++it) {
      const int h = it % Hk, r0 = it / Hk * per_block, r1 = std::min(R, r0 + per_block), rows = (r1 - r0) * G;
      sc.reserve(rows, d, C);
      for (int r = r0; r < r1; ++r)  // state row (r - r0) * G + g: position r, query head h * G + g
        for (int i = 0; i < G * d; ++i)
          sc.q[static_cast<size_t>(r - r0) * G * d + i] =
              qp[(static_cast<size_t>(r) * Hq + h * G) * d + i] * static_cast<float>(scale);
      sc.reset_state(rows, d);
      for (int64_t c = 0; c < nc; ++c) {
        const int n = static_cast<int>(std::min<int64_t>(C, n_tokens - c * C));
        const size_t off = (static_cast<size_t>(slot[c]) * Hk + h) * head_elems;
        decode::attend_chunk<float, false>(sc.q.data(), rows, K + off, V + off, n, C, d, sc.o.data(), sc.m.data(),
                                           sc.l.data(), sc.s.data(), sc.alpha.data());
      }
      for (int r = r0; r < r1; ++r)
        for (int g = 0; g < G; ++g) {
          const int s = (r - r0) * G + g;
          const size_t row = static_cast<size_t>(r) * Hq + h * G + g;
          decode::write_normalized(op + row * d, sc.o.data() + static_cast<size_t>(s) * d, sc.l[s], d);
          lp[row] = sc.m[s] + std::log(sc.l[s]);
        }
    }
  }
  return {out, lse};
}

}  // namespace chunkgen
