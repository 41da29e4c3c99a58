// The typed boundary between Python and the kernels: every shape, dtype, device and index is
// checked here, so a bad call raises a Python ValueError/TypeError instead of reading out of bounds.
#include <torch/extension.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#ifdef CHUNKGEN_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include "argmax.h"
#include "attention.h"
#include "cpu/kv_write.h"
#include "elementwise.h"
#include "invariant.h"
#include "invariant_linear.h"
#include "kv_write.h"
#include "linear.h"
#include "prefill_attention.h"
#include "prefix_attention.h"

namespace chunkgen {

double fma_peak_gflops(int64_t iters);
double int8_peak_gops(int64_t iters);
double vnni_peak_gops(int64_t iters);
double bf16_peak_gflops(int64_t iters);
void gather_kv(const torch::Tensor& k_layer, const torch::Tensor& v_layer, const torch::Tensor& slots, int64_t n,
               torch::Tensor k_out, torch::Tensor v_out);

#ifdef CHUNKGEN_WITH_CUDA
void decode_attention_cuda_raw(const DecodeProblem& p, const int32_t* part_off, int max_rows, float* part_o,
                               float* part_m, float* part_l, const SplitSpace& split_space, void* stream);
void write_kv_cuda_raw(const KVWriteProblem& p, void* stream);
#endif

namespace {

// ---- checks on every call: shapes, dtypes, devices (O(1), no index data is read) -----------

void check_index_tensor(const torch::Tensor& t, const char* name, const torch::Device& device) {
  TORCH_CHECK_TYPE(t.scalar_type() == torch::kInt32, name, " must be int32, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK_VALUE(t.device() == device, name, " must be on ", device, " with q, got ", t.device());
}

KVType kv_type_of(const torch::Tensor& t) {
  switch (t.scalar_type()) {
    case torch::kFloat32:
      return KVType::F32;
    case torch::kBFloat16:
      return KVType::BF16;
    case torch::kFloat16:
      return KVType::F16;
    default:
      TORCH_CHECK_TYPE(false, "KV dtype must be float32, bfloat16 or float16, got ", t.scalar_type());
  }
}

// The kernel context's arrays, as the op receives them. Shared arrays may hold unused entries past
// the live ones (rows [0, 0)): their capacity stays fixed while the tree changes.
struct ContextArgs {
  const torch::Tensor &shared_slot, &shared_len, &shared_begin, &shared_end, &part_off;
  const torch::Tensor &seq_shared_ptr, &seq_shared_idx, &priv_slot, &priv_count, &priv_last_len;
};

// Builds the kernel problem for q and one layer of the pool (k, v: [slots, kv_heads, ...]).
DecodeProblem make_problem(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const ContextArgs& c,
                           const torch::Tensor& out, double scale, bool chunk_first) {
  TORCH_CHECK_VALUE(q.dim() == 3, "q must be [batch, q_heads, head_dim], got ", q.sizes());
  // q and out are fp32, or the pool's dtype (the model's): the kernel reads and writes them as they
  // are, with fp32 softmax statistics and sums inside.
  TORCH_CHECK_TYPE(q.scalar_type() == torch::kFloat32 || q.scalar_type() == k.scalar_type(),
                   "q must be float32 or the pool's dtype (", k.scalar_type(), "), got ", q.scalar_type());
  TORCH_CHECK_VALUE(q.is_contiguous(), "q must be contiguous");
  TORCH_CHECK_VALUE(k.dim() == 4 && v.dim() == 4,
                    "k must be [slots, kv_heads, head_dim, chunk] and v [slots, kv_heads, chunk, "
                    "head_dim]; got k ",
                    k.sizes(), " v ", v.sizes());
  TORCH_CHECK_VALUE(k.is_contiguous() && v.is_contiguous(), "k and v must be contiguous");
  TORCH_CHECK_TYPE(k.scalar_type() == v.scalar_type(), "k and v must share a dtype");
  TORCH_CHECK_VALUE(k.device() == q.device() && v.device() == q.device(), "q, k and v must be on one device");
  const int64_t B = q.size(0), Hq = q.size(1), d = q.size(2);
  const int64_t slots = k.size(0), Hk = k.size(1), C = k.size(3);
  TORCH_CHECK_VALUE(k.size(2) == d && v.size(3) == d, "head_dim mismatch: q ", d, ", k ", k.size(2), ", v ", v.size(3));
  TORCH_CHECK_VALUE(v.size(0) == slots && v.size(1) == Hk && v.size(2) == C, "k and v describe different pools: k ",
                    k.sizes(), " v ", v.sizes());
  TORCH_CHECK_VALUE(Hk > 0 && Hq % Hk == 0, "q_heads (", Hq, ") must be a multiple of kv_heads (", Hk, ")");
  TORCH_CHECK_VALUE(d % 16 == 0 && d > 0, "head_dim must be a positive multiple of 16, got ", d);
  TORCH_CHECK_VALUE(C % 16 == 0 && C > 0, "chunk size must be a positive multiple of 16, got ", C);
  TORCH_CHECK_VALUE(out.sizes() == q.sizes() && out.is_contiguous() && out.device() == q.device(),
                    "out must be a contiguous tensor shaped like q on q's device");
  TORCH_CHECK_TYPE(out.scalar_type() == q.scalar_type(), "out must have q's dtype (", q.scalar_type(), "), got ",
                   out.scalar_type());

  const auto dev = q.device();
  check_index_tensor(c.shared_slot, "shared_slot", dev);
  check_index_tensor(c.shared_len, "shared_len", dev);
  check_index_tensor(c.shared_begin, "shared_begin", dev);
  check_index_tensor(c.shared_end, "shared_end", dev);
  check_index_tensor(c.part_off, "part_off", dev);
  check_index_tensor(c.seq_shared_ptr, "seq_shared_ptr", dev);
  check_index_tensor(c.seq_shared_idx, "seq_shared_idx", dev);
  check_index_tensor(c.priv_slot, "priv_slot", dev);
  check_index_tensor(c.priv_count, "priv_count", dev);
  check_index_tensor(c.priv_last_len, "priv_last_len", dev);
  const int64_t S = c.shared_slot.numel();
  TORCH_CHECK_VALUE(c.shared_len.numel() == S && c.shared_begin.numel() == S && c.shared_end.numel() == S,
                    "shared_* arrays must have one entry per shared chunk");
  TORCH_CHECK_VALUE(c.part_off.numel() == S + 1, "part_off must have one entry per shared chunk, plus one");
  TORCH_CHECK_VALUE(c.seq_shared_ptr.numel() == B + 1, "seq_shared_ptr must have batch + 1 (", B + 1, ") entries, got ",
                    c.seq_shared_ptr.numel());
  TORCH_CHECK_VALUE(c.priv_slot.dim() == 2 && c.priv_slot.size(0) == B,
                    "priv_slot must be [batch, max_private_chunks], got ", c.priv_slot.sizes());
  TORCH_CHECK_VALUE(c.priv_count.numel() == B && c.priv_last_len.numel() == B,
                    "priv_count and priv_last_len must have batch entries");

  DecodeProblem p{};
  p.q = q.data_ptr();
  p.out = out.data_ptr();
  p.q_type = kv_type_of(q);
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.kv_type = kv_type_of(k);
  p.batch = static_cast<int>(B);
  p.q_heads = static_cast<int>(Hq);
  p.kv_heads = static_cast<int>(Hk);
  p.head_dim = static_cast<int>(d);
  p.chunk = static_cast<int>(C);
  p.scale = static_cast<float>(scale);
  p.num_shared = static_cast<int>(S);
  p.shared_slot = c.shared_slot.data_ptr<int32_t>();
  p.shared_len = c.shared_len.data_ptr<int32_t>();
  p.shared_begin = c.shared_begin.data_ptr<int32_t>();
  p.shared_end = c.shared_end.data_ptr<int32_t>();
  p.seq_shared_ptr = c.seq_shared_ptr.data_ptr<int32_t>();
  p.seq_shared_idx = c.seq_shared_idx.data_ptr<int32_t>();
  p.priv_slot = c.priv_slot.data_ptr<int32_t>();
  p.priv_stride = static_cast<int>(c.priv_slot.size(1));
  p.priv_count = c.priv_count.data_ptr<int32_t>();
  p.priv_last_len = c.priv_last_len.data_ptr<int32_t>();
  p.chunk_first = chunk_first;
  return p;
}

// ---- the full check of the index data: once per context rebuild, and in debug runs ----------

void check_range(const torch::Tensor& t, int64_t n, int64_t lo, int64_t hi, const char* name) {
  const int32_t* p = t.data_ptr<int32_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK_VALUE(p[i] >= lo && p[i] < hi, name, "[", i, "] = ", p[i], " is outside [", lo, ", ", hi, ")");
}

void check_context(int64_t slots, int64_t chunk, torch::Tensor shared_slot, torch::Tensor shared_len,
                   torch::Tensor shared_begin, torch::Tensor shared_end, torch::Tensor part_off,
                   torch::Tensor seq_shared_ptr, torch::Tensor seq_shared_idx, torch::Tensor priv_slot,
                   torch::Tensor priv_count, torch::Tensor priv_last_len) {
  const torch::Device cpu(torch::kCPU);
  for (auto* t : {&shared_slot, &shared_len, &shared_begin, &shared_end, &part_off, &seq_shared_ptr, &seq_shared_idx,
                  &priv_slot, &priv_count, &priv_last_len})
    check_index_tensor(*t, "kernel context array", cpu);
  const int64_t S = shared_slot.numel(), B = priv_count.numel(), C = chunk;
  TORCH_CHECK_VALUE(seq_shared_ptr.numel() == B + 1 && priv_last_len.numel() == B && priv_slot.dim() == 2 &&
                        priv_slot.size(0) == B && part_off.numel() == S + 1,
                    "kernel context arrays disagree on the batch or the shared capacity");
  check_range(shared_begin, S, 0, B + 1, "shared_begin");
  check_range(shared_end, S, 0, B + 1, "shared_end");
  check_range(priv_count, B, 0, priv_slot.size(1) + 1, "priv_count");
  check_range(priv_last_len, B, 0, C + 1, "priv_last_len");
  const int32_t* sb = shared_begin.data_ptr<int32_t>();
  const int32_t* se = shared_end.data_ptr<int32_t>();
  const int32_t* ss = shared_slot.data_ptr<int32_t>();
  const int32_t* sl = shared_len.data_ptr<int32_t>();
  const int32_t* po = part_off.data_ptr<int32_t>();
  TORCH_CHECK_VALUE(po[0] == 0, "part_off must start at 0");
  for (int64_t c = 0; c < S; ++c) {
    TORCH_CHECK_VALUE(sb[c] <= se[c], "shared chunk ", c, " covers rows [", sb[c], ", ", se[c], ")");
    TORCH_CHECK_VALUE(po[c + 1] == po[c] + se[c] - sb[c], "part_off[", c + 1, "] must add shared chunk ", c,
                      "'s rows to part_off[", c, "]");
    if (sb[c] == se[c]) continue;  // an unused entry: no row reads it
    TORCH_CHECK_VALUE(ss[c] >= 0 && ss[c] < slots, "shared_slot[", c, "] = ", ss[c], " is outside [0, ", slots, ")");
    // A shared chunk without tokens would be a softmax over no scores (NaN): the tree never shares one.
    TORCH_CHECK_VALUE(sl[c] >= 1 && sl[c] <= C, "shared_len[", c, "] = ", sl[c], " is outside [1, ", C + 1, ")");
  }
  const int32_t* ptr = seq_shared_ptr.data_ptr<int32_t>();
  TORCH_CHECK_VALUE(ptr[0] == 0 && ptr[B] <= seq_shared_idx.numel(),
                    "seq_shared_ptr must run from 0 to at most len(seq_shared_idx)");
  for (int64_t b = 0; b < B; ++b) TORCH_CHECK_VALUE(ptr[b] <= ptr[b + 1], "seq_shared_ptr must be non-decreasing");
  check_range(seq_shared_idx, ptr[B], 0, S, "seq_shared_idx");
  const int32_t* pc = priv_count.data_ptr<int32_t>();
  const int32_t* ps = priv_slot.data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < pc[b]; ++i) {
      const int32_t s = ps[b * priv_slot.size(1) + i];
      TORCH_CHECK_VALUE(s >= 0 && s < slots, "priv_slot[", b, ", ", i, "] = ", s, " is outside the pool");
    }
  // The chunk-first phase writes a shared chunk's partial results for rows [begin, end) only, and
  // each row merges those of the chunks on its list: a listed chunk must cover the row.
  const int32_t* idx = seq_shared_idx.data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b)
    for (int32_t i = ptr[b]; i < ptr[b + 1]; ++i) {
      const int32_t c = idx[i];
      TORCH_CHECK_VALUE(sb[c] <= b && b < se[c], "row ", b, " lists shared chunk ", c, ", which covers rows [", sb[c],
                        ", ", se[c], ")");
    }
}

}  // namespace

// ---- the K/V write: row b's k, v [kv_heads, head_dim] go to (write_slot[b], write_offset[b]) ----
// (csrc/kv_write.h; outside the anonymous namespace: the rotary op writes K/V too)

void check_write(const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& k_layer,
                 const torch::Tensor& write_slot, const torch::Tensor& write_offset) {
  const int64_t rows = k.size(0);
  TORCH_CHECK_VALUE(
      k.dim() == 3 && k.sizes() == v.sizes() && k.size(1) == k_layer.size(1) && k.size(2) == k_layer.size(2),
      "k and v must be [rows, kv_heads, head_dim] of the pool's heads; got k ", k.sizes(), " v ", v.sizes(), ", pool ",
      k_layer.sizes());
  TORCH_CHECK_TYPE(k.scalar_type() == v.scalar_type(), "k and v must share a dtype");
  TORCH_CHECK_VALUE(k.device() == k_layer.device() && v.device() == k_layer.device(),
                    "k and v must be on the pool's device");
  TORCH_CHECK_VALUE(write_slot.numel() == rows && write_offset.numel() == rows,
                    "write_slot and write_offset must have one entry per row of k");
}

bool fits_write_kernel(const torch::Tensor& k_layer, const torch::Tensor& v_layer, const torch::Tensor& write_slot,
                       const torch::Tensor& write_offset) {
  return k_layer.is_contiguous() && v_layer.is_contiguous() && write_slot.is_contiguous() &&
         write_offset.is_contiguous() && write_slot.scalar_type() == torch::kInt32 &&
         write_offset.scalar_type() == torch::kInt32;
}

KVWriteProblem kv_write_problem(const torch::Tensor& k, const torch::Tensor& v, torch::Tensor& k_layer,
                                torch::Tensor& v_layer, const torch::Tensor& write_slot,
                                const torch::Tensor& write_offset) {
  TORCH_CHECK_TYPE(v_layer.scalar_type() == k_layer.scalar_type(), "k and v pools must share a dtype");
  KVWriteProblem p{};
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.src_type = kv_type_of(k);
  for (int i = 0; i < 3; ++i) p.k_stride[i] = k.stride(i), p.v_stride[i] = v.stride(i);
  p.k_layer = k_layer.data_ptr();
  p.v_layer = v_layer.data_ptr();
  p.pool_type = kv_type_of(k_layer);
  p.slot = write_slot.data_ptr<int32_t>();
  p.offset = write_offset.data_ptr<int32_t>();
  p.rows = static_cast<int>(k.size(0));
  p.kv_heads = static_cast<int>(k_layer.size(1));
  p.head_dim = static_cast<int>(k_layer.size(2));
  p.chunk = static_cast<int>(k_layer.size(3));
  return p;
}

// k and v may be strided views (e.g. split from one qkv product): no copy before the write.
void write_kv(const torch::Tensor& k, const torch::Tensor& v, torch::Tensor& k_layer, torch::Tensor& v_layer,
              const torch::Tensor& write_slot, const torch::Tensor& write_offset) {
  check_write(k, v, k_layer, write_slot, write_offset);
  const int64_t rows = k.size(0);
  if (rows == 0) return;
#ifdef CHUNKGEN_WITH_CUDA
  // On the GPU one kernel writes both (csrc/cuda/kv_write.cu): no host read of the indices, no
  // int64 casts, one node in a step's graph instead of four or more.
  if (k.is_cuda() && fits_write_kernel(k_layer, v_layer, write_slot, write_offset)) {
    const KVWriteProblem p = kv_write_problem(k, v, k_layer, v_layer, write_slot, write_offset);
    const c10::cuda::CUDAGuard guard(k.device());
    write_kv_cuda_raw(p, c10::cuda::getCurrentCUDAStream(k.device().index()).stream());
    return;
  }
#endif
  if (!k.device().is_cpu()) {  // one index_put_ per pool elsewhere: no host read of the indices
    using torch::indexing::Slice;
    const auto slot = write_slot.to(torch::kLong), off = write_offset.to(torch::kLong);
    k_layer.index_put_({slot, Slice(), Slice(), off}, k.to(k_layer.scalar_type()));
    v_layer.index_put_({slot, Slice(), off}, v.to(v_layer.scalar_type()));
    return;
  }
  const int64_t Hk = k_layer.size(1), d = k_layer.size(2), C = k_layer.size(3);
  const int32_t* slot = write_slot.data_ptr<int32_t>();
  const int32_t* off = write_offset.data_ptr<int32_t>();
  const int64_t ks[3] = {k.stride(0), k.stride(1), k.stride(2)};
  const int64_t vs[3] = {v.stride(0), v.stride(1), v.stride(2)};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k_layer.scalar_type(), "write_kv_pool", [&] {
    using Dst = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "write_kv_rows", [&] {
      write_rows<Dst, scalar_t>(k_layer.data_ptr<Dst>(), v_layer.data_ptr<Dst>(), k.data_ptr<scalar_t>(),
                                v.data_ptr<scalar_t>(), ks, vs, slot, off, rows, Hk, d, C);
    });
  });
}

namespace {

// Prefill's K/V write (outside the decode op): its indices are checked once a wave, on the host
// where the engine builds them (check_write_indices: a bad one is an error naming it, not a
// device-side assert that ends the process), then given on the pool's device for every layer.
void check_write_indices(const torch::Tensor& write_slot, const torch::Tensor& write_offset, int64_t slots,
                         int64_t chunk) {
  const torch::Device host(torch::kCPU);
  check_index_tensor(write_slot, "write_slot", host);
  check_index_tensor(write_offset, "write_offset", host);
  TORCH_CHECK_VALUE(write_slot.numel() == write_offset.numel(),
                    "write_slot and write_offset must have one entry a row");
  check_range(write_slot, write_slot.numel(), 0, slots, "write_slot");
  check_range(write_offset, write_offset.numel(), 0, chunk, "write_offset");
}

void write_kv_layer(const torch::Tensor& k, const torch::Tensor& v, torch::Tensor k_layer, torch::Tensor v_layer,
                    const torch::Tensor& write_slot, const torch::Tensor& write_offset) {
  TORCH_CHECK_VALUE(k_layer.dim() == 4 && v_layer.dim() == 4 && k_layer.is_contiguous() && v_layer.is_contiguous(),
                    "k_layer and v_layer must be one contiguous layer of the pool");
  check_index_tensor(write_slot, "write_slot", k_layer.device());
  check_index_tensor(write_offset, "write_offset", k_layer.device());
  write_kv(k, v, k_layer, v_layer, write_slot, write_offset);
}

// ---- prefill attention ------------------------------------------------------------------------

// (o, lse) as torch's CPU flash attention returns them: o [B, Hq, T, d] and lse [B, Hq, T] (fp32,
// natural log) as views of [B, T, Hq, ...] storage.
std::tuple<torch::Tensor, torch::Tensor> prefill_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                                                           double scale, bool causal,
                                                           c10::optional<torch::Tensor> mask) {
  TORCH_CHECK_VALUE(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
                    "q must be [batch, q_heads, q_len, head_dim] and k, v [batch, kv_heads, kv_len, head_dim]; "
                    "got q ",
                    q.sizes(), " k ", k.sizes(), " v ", v.sizes());
  for (const auto* t : {&q, &k, &v}) {
    TORCH_CHECK_TYPE(t->scalar_type() == torch::kBFloat16, "q, k and v must be bfloat16, got ", t->scalar_type());
    TORCH_CHECK_VALUE(t->device().is_cpu(), "q, k and v must be CPU tensors, got ", t->device());
  }
  TORCH_CHECK_VALUE(k.sizes() == v.sizes(), "k and v must have one shape; got k ", k.sizes(), " v ", v.sizes());
  const int64_t B = q.size(0), Hq = q.size(1), T = q.size(2), d = q.size(3), Hk = k.size(1), S = k.size(2);
  TORCH_CHECK_VALUE(k.size(0) == B && k.size(3) == d, "k must be [", B, ", kv_heads, kv_len, ", d, "], got ",
                    k.sizes());
  TORCH_CHECK_VALUE(Hk > 0 && Hq % Hk == 0, "q_heads (", Hq, ") must be a multiple of kv_heads (", Hk, ")");
  TORCH_CHECK_VALUE(d > 0 && d % 16 == 0, "head_dim must be a positive multiple of 16, got ", d);
  // Rows are read as unit-stride vectors; any other strides are taken as they are.
  q = q.stride(3) == 1 ? q : q.contiguous();
  k = k.stride(3) == 1 ? k : k.contiguous();
  v = v.stride(3) == 1 ? v : v.contiguous();
  PrefillProblem p{};
  if (mask.has_value()) {
    torch::Tensor& m = *mask;
    TORCH_CHECK_TYPE(m.scalar_type() == torch::kBFloat16, "mask must be bfloat16 (q's dtype), got ", m.scalar_type());
    TORCH_CHECK_VALUE(m.device().is_cpu(), "mask must be a CPU tensor, got ", m.device());
    TORCH_CHECK_VALUE(
        m.dim() == 4 && (m.size(0) == B || m.size(0) == 1) && m.size(1) == 1 && m.size(2) == T && m.size(3) == S,
        "mask must be [", B, " or 1, 1, ", T, ", ", S, "], got ", m.sizes());
    if (m.stride(3) != 1) m = m.contiguous();
    p.mask = reinterpret_cast<const uint16_t*>(m.data_ptr());
    p.mask_stride[0] = m.size(0) == 1 ? 0 : m.stride(0);
    p.mask_stride[1] = m.stride(2);
  }
  for (const int64_t n : {B, Hq, T, S, d})
    TORCH_CHECK_VALUE(n <= std::numeric_limits<int>::max(), "prefill attention sizes must fit int32");
  auto out = torch::empty({B, T, Hq, d}, q.options());
  auto lse = torch::empty({B, T, Hq}, q.options().dtype(torch::kFloat32));
  p.q = reinterpret_cast<const uint16_t*>(q.data_ptr());
  p.k = reinterpret_cast<const uint16_t*>(k.data_ptr());
  p.v = reinterpret_cast<const uint16_t*>(v.data_ptr());
  for (int i = 0; i < 3; ++i) p.q_stride[i] = q.stride(i), p.k_stride[i] = k.stride(i), p.v_stride[i] = v.stride(i);
  p.out = reinterpret_cast<uint16_t*>(out.data_ptr());
  p.lse = lse.data_ptr<float>();
  p.batch = static_cast<int>(B);
  p.q_heads = static_cast<int>(Hq);
  p.kv_heads = static_cast<int>(Hk);
  p.q_len = static_cast<int>(T);
  p.kv_len = static_cast<int>(S);
  p.head_dim = static_cast<int>(d);
  p.scale = static_cast<float>(scale);
  p.causal = causal;
  if (B * Hq * T > 0)
    TORCH_CHECK_VALUE(prefill_attention_cpu(p),
                      "the prefill attention kernel needs AMX or AVX512_BF16 (in this build and this CPU); "
                      "cpu_kernel_isa() is ",
                      cpu_kernel_isa());
  return {out.transpose(1, 2), lse.transpose(1, 2)};
}

// ---- the op ---------------------------------------------------------------------------------

void decode_attention_op(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, torch::Tensor& k_cache,
                         torch::Tensor& v_cache, int64_t layer, const torch::Tensor& write_slot,
                         const torch::Tensor& write_offset, const torch::Tensor& shared_slot,
                         const torch::Tensor& shared_len, const torch::Tensor& shared_begin,
                         const torch::Tensor& shared_end, const torch::Tensor& part_off,
                         const torch::Tensor& seq_shared_ptr, const torch::Tensor& seq_shared_idx,
                         const torch::Tensor& priv_slot, const torch::Tensor& priv_count,
                         const torch::Tensor& priv_last_len, torch::Tensor& workspace, torch::Tensor& out, double scale,
                         bool chunk_first, int64_t window, double softcap, bool store_kv) {
  TORCH_CHECK_VALUE(window >= 0 && window <= std::numeric_limits<int>::max(),
                    "window must be 0 (full attention) or a positive number of positions, got ", window);
  TORCH_CHECK_VALUE(softcap >= 0.0 && std::isfinite(softcap), "softcap must be 0 (none) or positive, got ", softcap);
  TORCH_CHECK_VALUE(k_cache.dim() == 5 && v_cache.dim() == 5,
                    "k_cache and v_cache must be the whole pool, [layers, slots, ...]; got ", k_cache.sizes(), " and ",
                    v_cache.sizes());
  TORCH_CHECK_VALUE(layer >= 0 && layer < k_cache.size(0), "layer ", layer, " is outside the pool's ", k_cache.size(0),
                    " layers");
  auto k_layer = k_cache.select(0, layer), v_layer = v_cache.select(0, layer);
  const ContextArgs ctx{shared_slot,    shared_len,     shared_begin, shared_end, part_off,
                        seq_shared_ptr, seq_shared_idx, priv_slot,    priv_count, priv_last_len};
  DecodeProblem p = make_problem(q, k_layer, v_layer, ctx, out, scale, chunk_first);
  p.window = static_cast<int>(window);
  p.softcap = static_cast<float>(softcap);
  check_index_tensor(write_slot, "write_slot", q.device());
  check_index_tensor(write_offset, "write_offset", q.device());
  const bool kernel_writes = store_kv && q.device().is_cpu() && p.batch > 0 && k.size(0) == p.batch &&
                             k.scalar_type() == k_layer.scalar_type() && v.scalar_type() == k.scalar_type();
  if (kernel_writes) {
    check_write(k, v, k_layer, write_slot, write_offset);
    p.new_k = k.data_ptr();
    p.new_v = v.data_ptr();
    for (int i = 0; i < 3; ++i) p.new_k_stride[i] = k.stride(i), p.new_v_stride[i] = v.stride(i);
    p.write_slot = write_slot.data_ptr<int32_t>();
    p.write_offset = write_offset.data_ptr<int32_t>();
  } else if (store_kv) {  // else the rows' K/V are in the pool already (the rotary op stored them)
    write_kv(k, v, k_layer, v_layer, write_slot, write_offset);
  }
  if (p.batch == 0) return;
  if (q.device().is_cpu()) {
    TORCH_CHECK_TYPE(p.kv_type != KVType::F16, "the CPU kernel takes float32 or bfloat16 KV");
    decode_attention_cpu(p);
    return;
  }
#ifdef CHUNKGEN_WITH_CUDA
  // Grids are sized by capacity (every shared entry, every row of the batch); unused entries cover
  // no rows and padded rows read no chunk, so nothing here depends on the tree's live values.
  // The workspace (kernels/decode.py: workspace_for): the chunk-first partials, a row for each
  // (row, shared chunk) pair the context holds (seq_shared_idx's entries) and query head; then
  // whatever follows, in whole (batch row, query head) sets, for the sequence-first splits' sums or,
  // batch-invariant, the private chunks' partials.
  TORCH_CHECK_VALUE(
      workspace.scalar_type() == torch::kFloat32 && workspace.is_contiguous() && workspace.device() == q.device(),
      "workspace must be a contiguous float32 tensor on q's device");
  const int64_t per_row = static_cast<int64_t>(p.q_heads) * (p.head_dim + 2);
  const int64_t pairs = std::max<int64_t>(seq_shared_idx.numel(), 1);
  TORCH_CHECK_VALUE(workspace.numel() >= pairs * per_row, "workspace has ", workspace.numel(),
                    " floats; the context's partials need ", pairs * per_row);
  float* part_o = workspace.data_ptr<float>();
  float* part_m = part_o + pairs * p.q_heads * p.head_dim;
  float* part_l = part_m + pairs * p.q_heads;
  const int64_t split_rows = workspace.numel() / per_row - pairs;  // in (batch row, query head) units
  SplitSpace split_space;
  split_space.splits = static_cast<int>(std::min<int64_t>(split_rows / p.batch, 1 << 16));
  split_space.o = part_l + pairs * p.q_heads;
  split_space.m = split_space.o + split_rows * p.q_heads * p.head_dim;
  split_space.l = split_space.m + split_rows * p.q_heads;
  p.invariant = batch_invariant();
  // On q's GPU and that GPU's current stream, whichever device the caller has current: the kernels
  // read the device's limits and launch on the current device.
  const c10::cuda::CUDAGuard guard(q.device());
  decode_attention_cuda_raw(p, part_off.data_ptr<int32_t>(), p.batch, part_o, part_m, part_l, split_space,
                            c10::cuda::getCurrentCUDAStream(q.device().index()).stream());
#else
  TORCH_CHECK_VALUE(false, "chunkgen was built without CUDA kernels; q is on ", q.device());
#endif
}

#ifdef CHUNKGEN_WITH_CUDA
// x [m, k] (unit stride along k) W [n, k]^T (+ bias [n]) on the GPU, each output one fp32 sum over k
// in one order at any m (csrc/invariant_linear.h): the model's linear layers with batch-invariant
// numerics on CUDA.
torch::Tensor invariant_linear_op(const torch::Tensor& x, const torch::Tensor& w,
                                  const std::optional<torch::Tensor>& bias) {
  TORCH_CHECK_VALUE(x.is_cuda() && w.device() == x.device(), "invariant_linear takes x and w on one GPU, got ",
                    x.device(), " and ", w.device());
  TORCH_CHECK_VALUE(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
                    "invariant_linear takes x [m, k] and w [n, k], got ", x.sizes(), " and ", w.sizes());
  TORCH_CHECK_TYPE(x.scalar_type() == w.scalar_type(), "invariant_linear takes x and w of one dtype, got ",
                   x.scalar_type(), " and ", w.scalar_type());
  TORCH_CHECK_VALUE(x.stride(1) == 1 || x.size(1) <= 1, "invariant_linear takes x with unit stride along k");
  TORCH_CHECK_VALUE(w.is_contiguous(), "invariant_linear takes a contiguous w");
  TORCH_CHECK_VALUE(x.size(0) <= std::numeric_limits<int>::max() && w.size(0) <= std::numeric_limits<int>::max() &&
                        x.size(1) <= std::numeric_limits<int>::max(),
                    "invariant_linear: sizes past 2^31");
  const void* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == w.size(0) && bias->is_contiguous() &&
                          bias->scalar_type() == w.scalar_type() && bias->device() == w.device(),
                      "invariant_linear takes a contiguous bias [n] of w's dtype and device");
    b = bias->data_ptr();
  }
  auto y = torch::empty({x.size(0), w.size(0)}, x.options());
  InvariantLinearProblem p{x.data_ptr(),
                           x.stride(0),
                           w.data_ptr(),
                           b,
                           y.data_ptr(),
                           y.stride(0),
                           static_cast<int>(x.size(0)),
                           static_cast<int>(w.size(0)),
                           static_cast<int>(x.size(1)),
                           kv_type_of(x)};
  const c10::cuda::CUDAGuard guard(x.device());
  invariant_linear_cuda_raw(p, c10::cuda::getCurrentCUDAStream(x.device().index()).stream());
  return y;
}
#endif

}  // namespace
}  // namespace chunkgen

// Decode attention of one step, registered with the dispatcher so torch.compile and CUDA graphs see
// one opaque op that honestly mutates the pool and `out`: it stores row b's k, v at
// (write_slot[b], write_offset[b]) of `layer` in the pool (unless store_kv is false: the rotary op
// stored them), then attends q over the kernel context.
TORCH_LIBRARY(chunkgen, m) {
  m.def(
      "decode_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, int layer, "
      "Tensor write_slot, Tensor write_offset, Tensor shared_slot, Tensor shared_len, Tensor shared_begin, "
      "Tensor shared_end, Tensor part_off, Tensor seq_shared_ptr, Tensor seq_shared_idx, Tensor priv_slot, "
      "Tensor priv_count, Tensor priv_last_len, Tensor(c!) workspace, Tensor(d!) out, float scale, "
      "bool chunk_first, int window=0, float softcap=0.0, bool store_kv=True) -> ()");
  // The decode forward's elementwise work, fused (csrc/elementwise.h says what each one rounds where).
  m.def(
      "add_rms_norm(Tensor(a!) residual, Tensor? delta, Tensor weight, float eps, Tensor(b!) out, "
      "bool offset=False) -> ()");
  m.def(
      "rotary(Tensor(a!) qkv, Tensor positions, Tensor cos, Tensor sin, int q_heads, int kv_heads, "
      "Tensor(b!) q_out, Tensor? q_norm=None, Tensor? k_norm=None, float eps=0.0, bool offset_norm=False, "
      "Tensor(c!)? k_cache=None, Tensor(d!)? v_cache=None, int layer=0, Tensor? write_slot=None, "
      "Tensor? write_offset=None) -> ()");
  m.def("silu_mul(Tensor gate_up, Tensor(a!) out) -> ()");
  m.def("gelu_tanh_mul(Tensor gate_up, Tensor(a!) out) -> ()");
  // The greedy sampler's argmax (csrc/argmax.h); CPU only: other devices use torch.max.
  m.def("argmax_rows(Tensor x) -> Tensor");
  // The decode step's bf16 linear layers on AMX or AVX512_BF16 (csrc/linear.h); CPU only.
  m.def("pack_linear(Tensor w) -> Tensor");
  m.def("packed_linear(Tensor x, Tensor packed, int n) -> Tensor");
  // The linear layers with batch-invariant numerics on the GPU (csrc/invariant_linear.h); CUDA only.
  m.def("invariant_linear(Tensor x, Tensor w, Tensor? bias=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(chunkgen, CPU, m) {
  m.impl("decode_attention", &chunkgen::decode_attention_op);
  m.impl("add_rms_norm", &chunkgen::add_rms_norm_op);
  m.impl("rotary", &chunkgen::rotary_op);
  m.impl("silu_mul", &chunkgen::silu_mul_op);
  m.impl("gelu_tanh_mul", &chunkgen::gelu_tanh_mul_op);
  m.impl("argmax_rows", &chunkgen::argmax_rows_op);
  m.impl("pack_linear", &chunkgen::pack_linear_op);
  m.impl("packed_linear", &chunkgen::packed_linear_op);
}

#ifdef CHUNKGEN_WITH_CUDA
TORCH_LIBRARY_IMPL(chunkgen, CUDA, m) {
  m.impl("decode_attention", &chunkgen::decode_attention_op);
  m.impl("add_rms_norm", &chunkgen::add_rms_norm_op);
  m.impl("rotary", &chunkgen::rotary_op);
  m.impl("silu_mul", &chunkgen::silu_mul_op);
  m.impl("gelu_tanh_mul", &chunkgen::gelu_tanh_mul_op);
  m.impl("invariant_linear", &chunkgen::invariant_linear_op);
}
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "chunkgen native kernels: two-phase partition decode attention (torch.ops.chunkgen)";
  m.def("check_context", &chunkgen::check_context,
        "Full check of a kernel context's index arrays (host tensors) against a pool's slots and chunk size",
        py::arg("slots"), py::arg("chunk"), py::arg("shared_slot"), py::arg("shared_len"), py::arg("shared_begin"),
        py::arg("shared_end"), py::arg("part_off"), py::arg("seq_shared_ptr"), py::arg("seq_shared_idx"),
        py::arg("priv_slot"), py::arg("priv_count"), py::arg("priv_last_len"));
  m.def("gather_kv", &chunkgen::gather_kv,
        "Dense K, V [kv_heads, n, head_dim] (into k_out, v_out) of the first n tokens along a path of slots of "
        "one CPU pool layer",
        py::arg("k_layer"), py::arg("v_layer"), py::arg("slots"), py::arg("n"), py::arg("k_out"), py::arg("v_out"));
  m.def("write_kv", &chunkgen::write_kv_layer,
        "Store rows of k, v [rows, kv_heads, head_dim] at (write_slot, write_offset) (int32, on the pool's "
        "device, checked by check_write_indices) of one pool layer",
        py::arg("k"), py::arg("v"), py::arg("k_layer"), py::arg("v_layer"), py::arg("write_slot"),
        py::arg("write_offset"));
  m.def("check_write_indices", &chunkgen::check_write_indices,
        "Raise ValueError naming the first (slot, offset) (int32, on the host) outside slots x chunk",
        py::arg("write_slot"), py::arg("write_offset"), py::arg("slots"), py::arg("chunk"));
  m.def("prefill_attention", &chunkgen::prefill_attention,
        "(o, lse) of softmax(q k^T * scale + mask) v for bfloat16 CPU q [B, Hq, T, d], k, v [B, Hk, S, d] "
        "(GQA: Hq a multiple of Hk), optional additive mask [B or 1, 1, T, S]; causal aligns the last query "
        "with the last key. Needs the amx or avx512_bf16 path (cpu_kernel_isa())",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("scale"), py::arg("causal") = false,
        py::arg("mask") = py::none());
  m.def("prefix_attention", &chunkgen::prefix_attention,
        "(o [R, Hq, d], lse [R, Hq]) of softmax(q K^T * scale) V for CPU q [R, Hq, d] against a prefix of "
        "n_tokens read in place from one pool layer of q's dtype (k_layer [S, Hk, d, C], v_layer [S, Hk, C, d]) "
        "along slots (int32); float32, or bfloat16 on the amx or avx512_bf16 path (cpu_kernel_isa()). first >= 0: "
        "causal, query r at position first + r reads positions [0, first + r] only; a causal product also takes a "
        "sliding window (window > 0: positions [first + r - window + 1, first + r]) and soft-capping (softcap > 0: "
        "each scaled score s becomes softcap * tanh(s / softcap))",
        py::arg("q"), py::arg("k_layer"), py::arg("v_layer"), py::arg("slots"), py::arg("n_tokens"), py::arg("scale"),
        py::arg("first") = -1, py::arg("window") = 0, py::arg("softcap") = 0.0);
  m.def("causal_attention", &chunkgen::causal_attention,
        "Several lone sequences' causal products (prefix_attention with first >= 0) in one call, into out "
        "[R, Hq, d]: spans int64 [N, 4] of (row, count, first position, offset into slots), in row order; "
        "window and softcap as for prefix_attention",
        py::arg("q"), py::arg("k_layer"), py::arg("v_layer"), py::arg("slots"), py::arg("spans"), py::arg("scale"),
        py::arg("out"), py::arg("window") = 0, py::arg("softcap") = 0.0);
  m.def("simd_width", &chunkgen::simd_width, "fp32 lanes the CPU kernel was compiled for");
  m.def("batch_invariant", &chunkgen::batch_invariant,
        "whether the kernels give each row the same reduction order whatever the batch (csrc/invariant.h)");
  m.def("set_batch_invariant", &chunkgen::set_batch_invariant,
        "turn batch-invariant numerics of the kernels on (the default) or off", py::arg("on"));
  m.def("cpu_kernel_isa", &chunkgen::cpu_kernel_isa,
        "the CPU kernel path a bfloat16 call takes now (amx, avx512_bf16, or the fp32 path's ISA); "
        "CHUNKGEN_CPU_ISA forces a lower one");
  m.def(
      "decode_clock",
      [](bool reset) {
        const chunkgen::DecodeClock c = chunkgen::decode_clock(reset);
        return py::dict(py::arg("plan_s") = c.plan_s, py::arg("chunk_first_s") = c.chunk_first_s,
                        py::arg("seq_first_s") = c.seq_first_s, py::arg("merge_s") = c.merge_s,
                        py::arg("chunk_first_flop") = c.chunk_first_flop, py::arg("seq_first_flop") = c.seq_first_flop,
                        py::arg("calls") = c.calls);
      },
      "what the CPU decode kernel did since the last reset: seconds of its parts (plan, chunk_first, "
      "seq_first, merge, each to the barrier after it) and the FLOPs of its two phases",
      py::arg("reset") = false);
  m.def("fma_peak_gflops", &chunkgen::fma_peak_gflops, "measured fp32 FMA GFLOP/s on all OpenMP threads",
        py::arg("iters") = 200000000);
  m.def("int8_peak_gops", &chunkgen::int8_peak_gops,
        "measured int8 multiply-adds x 2 per second of the quantized kernel's AVX2 inner step (vpmaddubsw + "
        "vpaddw) on all OpenMP threads; 0 without AVX2",
        py::arg("iters") = 100000000);
  m.def("vnni_peak_gops", &chunkgen::vnni_peak_gops,
        "measured int8 multiply-adds x 2 per second of AVX512_VNNI vpdpbusd (the quantized kernel's instruction "
        "there) on all OpenMP threads; 0 where the build has no AVX512_VNNI",
        py::arg("iters") = 50000000);
  m.def("bf16_peak_gflops", &chunkgen::bf16_peak_gflops,
        "measured bf16 multiply-adds x 2 per second of AVX512_BF16 vdpbf16ps on all OpenMP threads; 0 where the "
        "build has no AVX512_BF16",
        py::arg("iters") = 50000000);
#ifdef CHUNKGEN_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
}
