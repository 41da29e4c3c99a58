// Batch-invariant linear layers on the GPU (see csrc/invariant_linear.h). Blocks of 64 rows x BN
// columns (64, or 16 where 64 would leave most SMs idle), k in steps of 32 through shared memory by
// asynchronous copies in a ring of stages: the next steps' tiles load while this one is multiplied.
// fp16/bf16 on the tensor cores (m16n16k16, fp32 accumulate), fp32 by FMAs; either way every output
// is the same sequence of operations along k, whichever block width, warp, tile position or stage
// computes it, and no block splits k. So a row's outputs do not depend on how many rows there are
// or which, and the launch may shape the grid and the ring by the problem. The price against
// cuBLAS: no split of k where the grid is small (a decode batch's few blocks; narrow blocks and a
// deep ring keep more of W in flight instead), and no Hopper wgmma.
#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "../invariant_linear.h"
#include "device.cuh"

namespace chunkgen {
namespace {

namespace wmma = nvcuda::wmma;

constexpr int kBM = 64, kBK = 32;
constexpr int kWide = 64, kNarrow = 16;  // the block widths (BN)
constexpr int kLinearThreads = 128;      // 4 warps: warp w takes rows [16 w, 16 w + 16) of the block
// The ring's depth: two stages where the grid fills the GPU (its other blocks hide a block's
// loads); where it does not, as many of k's steps as fit in kDeepRingBytes, up to kMaxStages.
constexpr int kMaxStages = 8;
constexpr size_t kDeepRingBytes = 96 * 1024;

// Shared memory: a ring of stages, each an x tile [kBM, kBK] then a W tile [BN, kBK] (rows padded
// by 16 bytes against bank conflicts), then, after the last step, the fp32 output tile in the same
// bytes.
template <typename T, int BN>
struct LinearTiles {
  static constexpr int ld = kBK + 16 / static_cast<int>(sizeof(T));  // elements per tile row
  static constexpr size_t x_bytes = static_cast<size_t>(kBM) * ld * sizeof(T);
  static constexpr size_t stage = static_cast<size_t>(kBM + BN) * ld * sizeof(T);
  static constexpr int out_ld = BN + 4;  // floats per output row
  static constexpr size_t out_bytes = static_cast<size_t>(kBM) * out_ld * sizeof(float);
  static size_t bytes(int stages) { return std::max(stages * stage, out_bytes); }
  __device__ static T* x_tile(unsigned char* base, int s) { return reinterpret_cast<T*>(base + s * stage); }
  __device__ static T* w_tile(unsigned char* base, int s) { return reinterpret_cast<T*>(base + s * stage + x_bytes); }
};

// Rows [r0, r0 + R) of src (row stride ld_src, `rows` and `cols` valid) from column k0 into a tile
// of R rows: 16-byte asynchronous copies where a vector is whole and aligned, element by element at
// the edges, zeros past them (a zero adds nothing to any sum).
template <typename T, int R>
__device__ void load_tile(T* dst, const T* src, int64_t ld_src, int r0, int rows, int k0, int cols) {
  constexpr int per_vec = 16 / sizeof(T);
  constexpr int ld = LinearTiles<T, kWide>::ld;
  for (int i = threadIdx.x; i < R * kBK / per_vec; i += kLinearThreads) {
    const int r = i / (kBK / per_vec), c = i % (kBK / per_vec) * per_vec;
    T* d = dst + r * ld + c;
    const int row = r0 + r, col = k0 + c;
    const T* s = src + row * ld_src + col;
    if (row < rows && col + per_vec <= cols && reinterpret_cast<uintptr_t>(s) % 16 == 0) {
      __pipeline_memcpy_async(d, s, 16);
    } else {
      for (int e = 0; e < per_vec; ++e) d[e] = row < rows && col + e < cols ? s[e] : from_float<T>(0.f);
    }
  }
}

template <typename T, int BN>
__global__ void invariant_linear_kernel(InvariantLinearProblem p, int m_blocks, int stages) {
  using L = LinearTiles<T, BN>;
  // fp32: thread t computes rows kRows (t / kColThreads) + i, columns 4 (t % kColThreads) + j
  constexpr int kColThreads = BN / 4, kRows = kBM * BN / (kLinearThreads * 4);
  const int m0 = (blockIdx.x % m_blocks) * kBM, n0 = (blockIdx.x / m_blocks) * BN;
  const int warp = threadIdx.x / 32;
  const T* x = static_cast<const T*>(p.x);
  const T* w = static_cast<const T*>(p.w);
  unsigned char* base = shared_bytes();
  const int steps = (p.k + kBK - 1) / kBK;
  // The block's consecutive ids share n0 (blockIdx.x / m_blocks): the blocks reading one W tile run
  // together and meet it in L2.
  const bool busy = m0 + warp * 16 < p.m;  // a warp whose rows are all past m has nothing to add
  constexpr bool kTensorCores = !std::is_same_v<T, float>;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[BN / 16];
  float facc[kRows][4];
  if constexpr (kTensorCores) {
    for (auto& a : acc) wmma::fill_fragment(a, 0.f);
  } else {
    for (auto& row : facc)
      for (float& v : row) v = 0.f;
  }

  // Steps 0 .. stages - 2 in flight before the first product; then each step issues the one
  // stages - 1 ahead into the stage the last step read (free since that step's closing barrier).
  // Every step commits a group, empty past the last step, so that waiting for all but the newest
  // stages - 1 groups always means this step's tiles.
  for (int s = 0; s < stages - 1; ++s) {
    if (s < steps) {
      load_tile<T, kBM>(L::x_tile(base, s), x, p.ldx, m0, p.m, s * kBK, p.k);
      load_tile<T, BN>(L::w_tile(base, s), w, p.k, n0, p.n, s * kBK, p.k);
    }
    __pipeline_commit();
  }
  for (int s = 0; s < steps; ++s) {
    const int st = s % stages, ahead = s + stages - 1;
    if (ahead < steps) {
      load_tile<T, kBM>(L::x_tile(base, ahead % stages), x, p.ldx, m0, p.m, ahead * kBK, p.k);
      load_tile<T, BN>(L::w_tile(base, ahead % stages), w, p.k, n0, p.n, ahead * kBK, p.k);
    }
    __pipeline_commit();
    __pipeline_wait_prior(stages - 1);
    __syncthreads();  // this step's tiles have landed, every thread's part of them
    const T* xs = L::x_tile(base, st);
    const T* ws = L::w_tile(base, st);
    if constexpr (kTensorCores) {
      if (busy) {
        for (int kk = 0; kk < kBK; kk += 16) {
          wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> fa;
          wmma::load_matrix_sync(fa, xs + warp * 16 * L::ld + kk, L::ld);
          for (int j = 0; j < BN / 16; ++j) {
            // W's tile is [n, k] row-major: W^T [k, n] column-major, as matrix_b reads it
            wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> fb;
            wmma::load_matrix_sync(fb, ws + j * 16 * L::ld + kk, L::ld);
            wmma::mma_sync(acc[j], fa, fb, acc[j]);
          }
        }
      }
    } else {
      const int r = threadIdx.x / kColThreads * kRows, c = threadIdx.x % kColThreads * 4;
      for (int kk = 0; kk < kBK; ++kk)
        for (int i = 0; i < kRows; ++i) {
          const float a = to_float(xs[(r + i) * L::ld + kk]);
          for (int j = 0; j < 4; ++j) facc[i][j] = fmaf(a, to_float(ws[(c + j) * L::ld + kk]), facc[i][j]);
        }
    }
    __syncthreads();  // every warp is done with this stage before it is filled again
  }

  // The fp32 tile through shared memory (every copy has landed: the groups after the last step's
  // are empty), then out row by row, coalesced.
  float* out = reinterpret_cast<float*>(base);
  if constexpr (kTensorCores) {
    if (busy)
      for (int j = 0; j < BN / 16; ++j)
        wmma::store_matrix_sync(out + warp * 16 * L::out_ld + j * 16, acc[j], L::out_ld, wmma::mem_row_major);
  } else {
    const int r = threadIdx.x / kColThreads * kRows, c = threadIdx.x % kColThreads * 4;
    for (int i = 0; i < kRows; ++i)
      for (int j = 0; j < 4; ++j) out[(r + i) * L::out_ld + c + j] = facc[i][j];
  }
  __syncthreads();
  T* y = static_cast<T*>(p.y);
  const T* bias = static_cast<const T*>(p.bias);
  for (int i = threadIdx.x; i < kBM * BN; i += kLinearThreads) {
    const int r = i / BN, c = i % BN, row = m0 + r, col = n0 + c;
    if (row >= p.m || col >= p.n) continue;
    float v = out[r * L::out_ld + c];
    if (bias != nullptr) v = __fadd_rn(v, to_float(bias[col]));
    y[row * p.ldy + col] = from_float<T>(v);
  }
}

// The ring's depth for this grid: see kMaxStages. Any depth gives the same bits.
template <typename T, int BN>
int ring_stages(int64_t blocks, int steps, const DeviceLimits& lim) {
  if (blocks >= 2 * static_cast<int64_t>(lim.sms)) return 2;
  const size_t room = std::min(kDeepRingBytes, static_cast<size_t>(lim.max_smem));
  int stages = std::min(kMaxStages, std::max(2, steps));
  while (stages > 2 && LinearTiles<T, BN>::bytes(stages) > room) --stages;
  return stages;
}

template <typename T, int BN>
void launch_linear(const InvariantLinearProblem& p, const DeviceLimits& lim, cudaStream_t stream) {
  const int m_blocks = (p.m + kBM - 1) / kBM;
  const int64_t blocks = static_cast<int64_t>(m_blocks) * ((p.n + BN - 1) / BN);
  if (blocks > 0x7fffffff) throw std::invalid_argument("invariant linear: too many blocks for one grid");
  const int stages = ring_stages<T, BN>(blocks, (p.k + kBK - 1) / kBK, lim);
  const size_t bytes = LinearTiles<T, BN>::bytes(stages);
  const auto kernel = invariant_linear_kernel<T, BN>;
  reserve_smem(kernel, bytes, lim, "invariant linear");
  CHUNKGEN_LAUNCH(kernel, blocks, kLinearThreads, bytes, stream, p, m_blocks, stages);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) throw std::runtime_error(std::string("invariant linear launch: ") + cudaGetErrorString(err));
}

// Wide blocks where they make a wave of the GPU; else narrow ones, four times as many (a decode
// step's products: SmolLM2's q/k/v product at 32 rows is 15 wide blocks, 60 narrow).
template <typename T>
void launch_linear(const InvariantLinearProblem& p, cudaStream_t stream) {
  const DeviceLimits lim = device_limits();
  const int64_t wide = static_cast<int64_t>((p.m + kBM - 1) / kBM) * ((p.n + kWide - 1) / kWide);
  if (wide >= lim.sms)
    launch_linear<T, kWide>(p, lim, stream);
  else
    launch_linear<T, kNarrow>(p, lim, stream);
}

}  // namespace

void invariant_linear_cuda_raw(const InvariantLinearProblem& p, void* stream) {
  if (p.m <= 0 || p.n <= 0) return;
  auto s = static_cast<cudaStream_t>(stream);
  switch (p.type) {
    case KVType::F32:
      launch_linear<float>(p, s);
      break;
    case KVType::F16:
      launch_linear<__half>(p, s);
      break;
    case KVType::BF16:
      launch_linear<__nv_bfloat16>(p, s);
      break;
  }
}

}  // namespace chunkgen
