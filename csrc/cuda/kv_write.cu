// The decode step's K/V write on the GPU in one launch per layer (see KVWriteProblem in
// attention.h). The torch composition it replaces took two int64 casts of the indices and an
// index_put_ for each of K and V: four or more kernels a layer in every step's graph. No torch
// headers here: CI compiles this file with plain nvcc, and the CUDA emulator runs it.
#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "../attention.h"
#include "device.cuh"

namespace chunkgen {
namespace {

constexpr int kWriteThreads = 256;
constexpr int kMaxWriteBlocks = 1024;  // a grid-stride loop covers the rest

// Thread i takes element (row, head, dim) of both k and v: consecutive threads read consecutive
// dims of a row (coalesced), and write V's row contiguously; K's column is strided by the chunk.
template <typename Pool, typename Src>
__global__ void write_kv_kernel(KVWriteProblem p) {
  const int Hk = p.kv_heads, d = p.head_dim, C = p.chunk;
  const int64_t n = static_cast<int64_t>(p.rows) * Hk * d;
  const Src* k = static_cast<const Src*>(p.k);
  const Src* v = static_cast<const Src*>(p.v);
  Pool* kc = static_cast<Pool*>(p.k_layer);
  Pool* vc = static_cast<Pool*>(p.v_layer);
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int t = static_cast<int>(i % d), h = static_cast<int>(i / d % Hk);
    const int64_t b = i / (static_cast<int64_t>(d) * Hk);
    const int64_t head = (static_cast<int64_t>(p.slot[b]) * Hk + h) * d * C;  // K and V heads are d x C
    const int64_t off = p.offset[b];
    kc[head + static_cast<int64_t>(t) * C + off] =
        from_float<Pool>(to_float(k[b * p.k_stride[0] + h * p.k_stride[1] + t * p.k_stride[2]]));
    vc[head + off * d + t] = from_float<Pool>(to_float(v[b * p.v_stride[0] + h * p.v_stride[1] + t * p.v_stride[2]]));
  }
}

template <typename Pool, typename Src>
void launch_write(const KVWriteProblem& p, cudaStream_t stream) {
  const int64_t n = static_cast<int64_t>(p.rows) * p.kv_heads * p.head_dim;
  const int blocks = static_cast<int>(std::min<int64_t>((n + kWriteThreads - 1) / kWriteThreads, kMaxWriteBlocks));
  const auto kernel = write_kv_kernel<Pool, Src>;  // one name: the launch macro splits on commas
  CHUNKGEN_LAUNCH(kernel, blocks, kWriteThreads, 0, stream, p);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) throw std::runtime_error(std::string("K/V write kernel launch: ") + cudaGetErrorString(err));
}

template <typename Pool>
void dispatch_source(const KVWriteProblem& p, cudaStream_t stream) {
  switch (p.src_type) {
    case KVType::F32:
      launch_write<Pool, float>(p, stream);
      break;
    case KVType::F16:
      launch_write<Pool, __half>(p, stream);
      break;
    case KVType::BF16:
      launch_write<Pool, __nv_bfloat16>(p, stream);
      break;
  }
}

}  // namespace

void write_kv_cuda_raw(const KVWriteProblem& p, void* stream) {
  if (p.rows <= 0) return;
  auto s = static_cast<cudaStream_t>(stream);
  switch (p.pool_type) {
    case KVType::F32:
      dispatch_source<float>(p, s);
      break;
    case KVType::F16:
      dispatch_source<__half>(p, s);
      break;
    case KVType::BF16:
      dispatch_source<__nv_bfloat16>(p, s);
      break;
  }
}

}  // namespace chunkgen
