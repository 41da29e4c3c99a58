// Prefill's reads of the pool on the CPU: a path of chunks as dense per-head K and V, in one pass
// (indexing the pool, then making the permuted view contiguous, took two copies of each).
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstring>

namespace chunkgen {

// k_out, v_out [kv_heads, n, head_dim] = the first n tokens along `slots` (int64, host) of one
// layer of the pool: K [slots, kv_heads, head_dim, chunk] (stored transposed), V [slots, kv_heads,
// chunk, head_dim].
void gather_kv(const torch::Tensor& k_layer, const torch::Tensor& v_layer, const torch::Tensor& slots, int64_t n,
               torch::Tensor k_out, torch::Tensor v_out) {
  TORCH_CHECK_VALUE(k_layer.device().is_cpu() && v_layer.device().is_cpu(), "gather_kv reads a CPU pool");
  TORCH_CHECK_VALUE(k_layer.dim() == 4 && v_layer.dim() == 4 && k_layer.is_contiguous() && v_layer.is_contiguous(),
                    "k_layer and v_layer must be one contiguous layer of the pool; got ", k_layer.sizes(), " and ",
                    v_layer.sizes());
  const int64_t pool_slots = k_layer.size(0), Hk = k_layer.size(1), d = k_layer.size(2), C = k_layer.size(3);
  TORCH_CHECK_VALUE(
      v_layer.size(0) == pool_slots && v_layer.size(1) == Hk && v_layer.size(2) == C && v_layer.size(3) == d,
      "k_layer ", k_layer.sizes(), " and v_layer ", v_layer.sizes(), " describe different pools");
  TORCH_CHECK_TYPE(slots.scalar_type() == torch::kInt64 && slots.device().is_cpu() && slots.is_contiguous(),
                   "slots must be a contiguous int64 CPU tensor");
  const int64_t S = slots.numel();
  TORCH_CHECK_VALUE(n >= 0 && n <= S * C, "n = ", n, " tokens do not fit ", S, " chunks of ", C);
  for (auto* t : {&k_out, &v_out})
    TORCH_CHECK_VALUE(t->sizes() == torch::IntArrayRef({Hk, n, d}) && t->is_contiguous() &&
                          t->scalar_type() == k_layer.scalar_type() && t->device().is_cpu(),
                      "k_out and v_out must be contiguous [", Hk, ", ", n, ", ", d, "] tensors of the pool's dtype");
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t c = 0; c < S; ++c)
    TORCH_CHECK_VALUE(slot[c] >= 0 && slot[c] < pool_slots, "slots[", c, "] = ", slot[c], " is outside the pool");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k_layer.scalar_type(), "gather_kv", [&] {
    const scalar_t* K = k_layer.data_ptr<scalar_t>();
    const scalar_t* V = v_layer.data_ptr<scalar_t>();
    scalar_t* ko = k_out.data_ptr<scalar_t>();
    scalar_t* vo = v_out.data_ptr<scalar_t>();
    at::parallel_for(0, Hk * S, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) {
        const int64_t h = i / S, c = i % S, t0 = c * C, count = std::min(C, n - t0);
        if (count <= 0) continue;
        const size_t chunk_off = (static_cast<size_t>(slot[c]) * Hk + h) * d * C;
        const scalar_t* kc = K + chunk_off;    // [d, C]
        scalar_t* kd = ko + (h * n + t0) * d;  // [count, d]
        for (int64_t j = 0; j < d; ++j)        // rows of the chunk read in order; writes strided by d
          for (int64_t t = 0; t < count; ++t) kd[t * d + j] = kc[j * C + t];
        std::memcpy(vo + (h * n + t0) * d, V + chunk_off, sizeof(scalar_t) * count * d);
      }
    });
  });
}

}  // namespace chunkgen
