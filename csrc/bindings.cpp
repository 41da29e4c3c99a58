// The typed boundary between Python and the kernels: every shape, dtype, device and index is
// checked here, so a bad call raises a Python ValueError/TypeError instead of reading out of bounds.
#include <torch/extension.h>

#include <string>
#include <vector>

#ifdef CHUNKGEN_WITH_CUDA
#include <c10/cuda/CUDAStream.h>
#endif

#include "attention.h"

namespace chunkgen {

double fma_peak_gflops(int64_t iters);

#ifdef CHUNKGEN_WITH_CUDA
void decode_attention_cuda_raw(const DecodeProblem& p, const int32_t* part_off, int max_rows,
                               float* part_o, float* part_m, float* part_l, void* stream);
#endif

namespace {

void check_index_tensor(const torch::Tensor& t, const char* name) {
  TORCH_CHECK_TYPE(t.scalar_type() == torch::kInt32, name, " must be int32, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK_VALUE(t.device().is_cpu(), name, " must live on the CPU (the kernel context is host data)");
}

void check_range(const torch::Tensor& t, int64_t lo, int64_t hi, const char* name) {
  const int32_t* p = t.data_ptr<int32_t>();
  for (int64_t i = 0; i < t.numel(); ++i)
    TORCH_CHECK_VALUE(p[i] >= lo && p[i] < hi, name, "[", i, "] = ", p[i], " is outside [", lo, ", ",
                      hi, ")");
}

#ifdef CHUNKGEN_WITH_CUDA
// The kernel context lives on the host (the tree is Python); the device keeps one packed copy and
// re-uploads it only when the context's stamp changes, i.e. when the tree or a count changed.
struct DeviceContext {
  int64_t stamp = -1;
  torch::Device device{torch::kCPU};
  torch::Tensor buffer;
};

void run_on_cuda(DecodeProblem& p, int64_t stamp, torch::Device device) {
  static DeviceContext cache;
  const int S = p.num_shared, B = p.batch;
  std::vector<int32_t> part_off(S + 1, 0);
  int max_rows = 0;
  for (int c = 0; c < S; ++c) {
    part_off[c + 1] = part_off[c] + p.shared_end[c] - p.shared_begin[c];
    max_rows = std::max(max_rows, p.shared_end[c] - p.shared_begin[c]);
  }
  const int64_t nnz = p.seq_shared_ptr[B];
  const int64_t priv = static_cast<int64_t>(B) * p.priv_stride;
  // Layout: slot, len, begin, end, part_off, seq_shared_ptr, seq_shared_idx, priv_slot, count, last_len.
  const int64_t sizes[] = {S, S, S, S, S + 1, B + 1, nnz, priv, B, B};
  const int32_t* sources[] = {p.shared_slot, p.shared_len, p.shared_begin, p.shared_end, part_off.data(),
                              p.seq_shared_ptr, p.seq_shared_idx, p.priv_slot, p.priv_count, p.priv_last_len};
  int64_t total = 0;
  for (int64_t n : sizes) total += n;
  if (stamp < 0 || stamp != cache.stamp || cache.device != device || cache.buffer.numel() < total) {
    auto host = torch::empty({std::max<int64_t>(total, 1)}, torch::dtype(torch::kInt32).pinned_memory(true));
    int32_t* dst = host.data_ptr<int32_t>();
    for (int i = 0; i < 10; ++i) {
      std::copy(sources[i], sources[i] + sizes[i], dst);
      dst += sizes[i];
    }
    cache.buffer = host.to(device, /*non_blocking=*/true);
    cache.stamp = stamp;
    cache.device = device;
  }
  const int32_t* d = cache.buffer.data_ptr<int32_t>();
  const int32_t** targets[] = {&p.shared_slot, &p.shared_len, &p.shared_begin, &p.shared_end, nullptr,
                               &p.seq_shared_ptr, &p.seq_shared_idx, &p.priv_slot, &p.priv_count,
                               &p.priv_last_len};
  const int32_t* dev_part_off = nullptr;
  for (int i = 0; i < 10; ++i) {
    if (targets[i]) *targets[i] = d; else dev_part_off = d;
    d += sizes[i];
  }
  const int64_t rows = static_cast<int64_t>(part_off[S]) * p.q_heads;
  auto f32 = torch::dtype(torch::kFloat32).device(device);
  auto part_o = torch::empty({std::max<int64_t>(rows * p.head_dim, 1)}, f32);
  auto part_m = torch::empty({std::max<int64_t>(rows, 1)}, f32);
  auto part_l = torch::empty({std::max<int64_t>(rows, 1)}, f32);
  decode_attention_cuda_raw(p, dev_part_off, max_rows, part_o.data_ptr<float>(), part_m.data_ptr<float>(),
                            part_l.data_ptr<float>(), c10::cuda::getCurrentCUDAStream().stream());
}
#endif

torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                               torch::Tensor shared_slot, torch::Tensor shared_len,
                               torch::Tensor shared_begin, torch::Tensor shared_end,
                               torch::Tensor seq_shared_ptr, torch::Tensor seq_shared_idx,
                               torch::Tensor priv_slot, torch::Tensor priv_count,
                               torch::Tensor priv_last_len, double scale, bool chunk_first,
                               c10::optional<torch::Tensor> out_opt, int64_t stamp) {
  TORCH_CHECK_VALUE(q.dim() == 3, "q must be [batch, q_heads, head_dim], got ", q.sizes());
  TORCH_CHECK_TYPE(q.scalar_type() == torch::kFloat32, "q must be float32, got ", q.scalar_type());
  TORCH_CHECK_VALUE(q.is_contiguous(), "q must be contiguous");
  TORCH_CHECK_VALUE(k.dim() == 4 && v.dim() == 4,
                    "k must be [slots, kv_heads, head_dim, chunk] and v [slots, kv_heads, chunk, "
                    "head_dim]; got k ", k.sizes(), " v ", v.sizes());
  TORCH_CHECK_VALUE(k.is_contiguous() && v.is_contiguous(), "k and v must be contiguous");
  TORCH_CHECK_TYPE(k.scalar_type() == v.scalar_type(), "k and v must share a dtype");
  TORCH_CHECK_VALUE(k.device() == q.device() && v.device() == q.device(),
                    "q, k and v must be on one device");
  const int64_t B = q.size(0), Hq = q.size(1), d = q.size(2);
  const int64_t slots = k.size(0), Hk = k.size(1), C = k.size(3);
  TORCH_CHECK_VALUE(k.size(2) == d && v.size(3) == d, "head_dim mismatch: q ", d, ", k ", k.size(2),
                    ", v ", v.size(3));
  TORCH_CHECK_VALUE(v.size(0) == slots && v.size(1) == Hk && v.size(2) == C,
                    "k and v describe different pools: k ", k.sizes(), " v ", v.sizes());
  TORCH_CHECK_VALUE(Hk > 0 && Hq % Hk == 0, "q_heads (", Hq, ") must be a multiple of kv_heads (",
                    Hk, ")");
  TORCH_CHECK_VALUE(d % 16 == 0 && d > 0, "head_dim must be a positive multiple of 16, got ", d);
  TORCH_CHECK_VALUE(C % 16 == 0 && C > 0, "chunk size must be a positive multiple of 16, got ", C);

  check_index_tensor(shared_slot, "shared_slot");
  check_index_tensor(shared_len, "shared_len");
  check_index_tensor(shared_begin, "shared_begin");
  check_index_tensor(shared_end, "shared_end");
  check_index_tensor(seq_shared_ptr, "seq_shared_ptr");
  check_index_tensor(seq_shared_idx, "seq_shared_idx");
  check_index_tensor(priv_slot, "priv_slot");
  check_index_tensor(priv_count, "priv_count");
  check_index_tensor(priv_last_len, "priv_last_len");
  const int64_t S = shared_slot.numel();
  TORCH_CHECK_VALUE(shared_len.numel() == S && shared_begin.numel() == S && shared_end.numel() == S,
                    "shared_* arrays must have one entry per shared chunk");
  TORCH_CHECK_VALUE(seq_shared_ptr.numel() == B + 1, "seq_shared_ptr must have batch + 1 entries");
  TORCH_CHECK_VALUE(priv_slot.dim() == 2 && priv_slot.size(0) == B,
                    "priv_slot must be [batch, max_private_chunks], got ", priv_slot.sizes());
  TORCH_CHECK_VALUE(priv_count.numel() == B && priv_last_len.numel() == B,
                    "priv_count and priv_last_len must have batch entries");
  check_range(shared_slot, 0, slots, "shared_slot");
  // An empty shared chunk would make a softmax over no scores (NaN): the tree never shares one.
  check_range(shared_len, 1, C + 1, "shared_len");
  check_range(shared_begin, 0, B, "shared_begin");
  check_range(shared_end, 1, B + 1, "shared_end");
  check_range(seq_shared_idx, 0, S, "seq_shared_idx");
  check_range(priv_count, 0, priv_slot.size(1) + 1, "priv_count");
  check_range(priv_last_len, 0, C + 1, "priv_last_len");
  {
    const int32_t* ptr = seq_shared_ptr.data_ptr<int32_t>();
    TORCH_CHECK_VALUE(ptr[0] == 0 && ptr[B] == seq_shared_idx.numel(),
                      "seq_shared_ptr must run from 0 to len(seq_shared_idx)");
    for (int64_t b = 0; b < B; ++b)
      TORCH_CHECK_VALUE(ptr[b] <= ptr[b + 1], "seq_shared_ptr must be non-decreasing");
    const int32_t* pc = priv_count.data_ptr<int32_t>();
    const int32_t* ps = priv_slot.data_ptr<int32_t>();
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < pc[b]; ++i) {
        const int32_t s = ps[b * priv_slot.size(1) + i];
        TORCH_CHECK_VALUE(s >= 0 && s < slots, "priv_slot[", b, ", ", i, "] = ", s,
                          " is outside the pool");
      }
    const int32_t* sb = shared_begin.data_ptr<int32_t>();
    const int32_t* se = shared_end.data_ptr<int32_t>();
    for (int64_t c = 0; c < S; ++c)
      TORCH_CHECK_VALUE(sb[c] < se[c], "shared chunk ", c, " covers an empty range");
    // The chunk-first phase writes a shared chunk's partial results for rows [begin, end) only, and
    // each row merges those of the chunks on its list: a listed chunk must cover the row.
    const int32_t* idx = seq_shared_idx.data_ptr<int32_t>();
    for (int64_t b = 0; b < B; ++b)
      for (int32_t i = ptr[b]; i < ptr[b + 1]; ++i) {
        const int32_t c = idx[i];
        TORCH_CHECK_VALUE(sb[c] <= b && b < se[c], "row ", b, " lists shared chunk ", c,
                          ", which covers rows [", sb[c], ", ", se[c], ")");
      }
  }

  torch::Tensor out = out_opt.has_value() ? *out_opt : torch::empty_like(q);
  TORCH_CHECK_VALUE(out.sizes() == q.sizes() && out.scalar_type() == torch::kFloat32 &&
                        out.is_contiguous() && out.device() == q.device(),
                    "out must be a contiguous float32 tensor shaped like q");

  DecodeProblem p{};
  p.q = q.data_ptr<float>();
  p.out = out.data_ptr<float>();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  switch (k.scalar_type()) {
    case torch::kFloat32: p.kv_type = KVType::F32; break;
    case torch::kBFloat16: p.kv_type = KVType::BF16; break;
    case torch::kFloat16: p.kv_type = KVType::F16; break;
    default: TORCH_CHECK_TYPE(false, "KV dtype must be float32, bfloat16 or float16, got ", k.scalar_type());
  }
  p.batch = static_cast<int>(B);
  p.q_heads = static_cast<int>(Hq);
  p.kv_heads = static_cast<int>(Hk);
  p.head_dim = static_cast<int>(d);
  p.chunk = static_cast<int>(C);
  p.scale = static_cast<float>(scale);
  p.num_shared = static_cast<int>(S);
  p.shared_slot = shared_slot.data_ptr<int32_t>();
  p.shared_len = shared_len.data_ptr<int32_t>();
  p.shared_begin = shared_begin.data_ptr<int32_t>();
  p.shared_end = shared_end.data_ptr<int32_t>();
  p.seq_shared_ptr = seq_shared_ptr.data_ptr<int32_t>();
  p.seq_shared_idx = seq_shared_idx.data_ptr<int32_t>();
  p.priv_slot = priv_slot.data_ptr<int32_t>();
  p.priv_stride = static_cast<int>(priv_slot.size(1));
  p.priv_count = priv_count.data_ptr<int32_t>();
  p.priv_last_len = priv_last_len.data_ptr<int32_t>();
  p.chunk_first = chunk_first;
  if (B == 0) return out;

  if (q.device().is_cpu()) {
    TORCH_CHECK_TYPE(p.kv_type != KVType::F16, "the CPU kernel takes float32 or bfloat16 KV");
    decode_attention_cpu(p);
    return out;
  }
#ifdef CHUNKGEN_WITH_CUDA
  run_on_cuda(p, stamp, q.device());
  return out;
#else
  TORCH_CHECK_VALUE(false, "chunkgen was built without CUDA kernels; q is on ", q.device());
#endif
}

}  // namespace
}  // namespace chunkgen

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "chunkgen native kernels: two-phase partition decode attention";
  m.def("decode_attention", &chunkgen::decode_attention, "Two-phase partition decode attention",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("shared_slot"), py::arg("shared_len"),
        py::arg("shared_begin"), py::arg("shared_end"), py::arg("seq_shared_ptr"),
        py::arg("seq_shared_idx"), py::arg("priv_slot"), py::arg("priv_count"),
        py::arg("priv_last_len"), py::arg("scale"), py::arg("chunk_first") = true,
        py::arg("out") = py::none(), py::arg("stamp") = -1);
  m.def("simd_width", &chunkgen::simd_width, "fp32 lanes the CPU kernel was compiled for");
  m.def("fma_peak_gflops", &chunkgen::fma_peak_gflops, "measured fp32 FMA GFLOP/s on all OpenMP threads",
        py::arg("iters") = 200000000);
#ifdef CHUNKGEN_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
}
