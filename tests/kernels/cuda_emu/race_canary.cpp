// Small kernels with and without the synchronisation they need, run under the emulator built with
// ThreadSanitizer: the race check (`make cuda-racecheck`) is only worth its silence if these races
// are reported and their synchronised twins are not (tests/kernels/test_cuda_racecheck.py).
#include "cuda_emu.h"

// Each thread writes its shared word, then reads its neighbour's: across warps that needs
// __syncthreads, within a warp __syncwarp (lanes do not run in lockstep).
__global__ void neighbour_kernel(float* out, int span, bool sync) {
  float* words = reinterpret_cast<float*>(shared_bytes());
  const int t = threadIdx.x;
  words[t] = static_cast<float>(t);
  if (sync) {
    if (span > 32)
      __syncthreads();
    else
      __syncwarp();
  }
  const int base = t / span * span;
  out[blockIdx.x * blockDim.x + t] = words[base + (t + 1) % span];
}

// Every block adds into out[0] (needs an atomic, or one writer) or into its own out[blockIdx.x].
__global__ void blocks_kernel(float* out, bool shared) {
  if (threadIdx.x == 0) out[shared ? 0 : blockIdx.x] += 1.f;
}

// kind 0-3: neighbours across warps (span 64) or within a warp (32), synchronised when even;
// 4: each block writes its own word; 5: every block writes word 0.
extern "C" int emu_canary(int kind, float* out) {
  if (kind < 4)
    CHUNKGEN_LAUNCH(neighbour_kernel, 2, 64, 64 * sizeof(float), nullptr, out, kind < 2 ? 64 : 32, kind % 2 == 0);
  else
    CHUNKGEN_LAUNCH(blocks_kernel, 4, 32, 0, nullptr, out, kind == 5);
  return emu::device().errors.empty() ? 0 : 2;
}
