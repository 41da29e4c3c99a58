// Small kernels with and without the synchronisation or bounds they need, run under the emulator
// built with ThreadSanitizer or AddressSanitizer: the race and memory checks (`make cuda-racecheck`,
// `make cuda-memcheck`) are only worth their silence if these defects are reported and their
// correct twins are not (tests/kernels/test_cuda_sanitizers.py).
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

// Each thread copies in[i] for i < n; one thread too many reads one element past the end of in.
__global__ void copy_kernel(const float* in, float* out, int n, bool one_past) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n + (one_past ? 1 : 0)) out[i] = in[i];
}

// Each lane shuffles its value down: the warp's halves at two different shuffles, or together.
__global__ void shuffle_kernel(float* out, bool diverge) {
  const float v = static_cast<float>(threadIdx.x);
  float r;
  if (diverge && threadIdx.x % 32 < 16)
    r = __shfl_down_sync(0xffffffffu, v, 1);
  else
    r = __shfl_down_sync(0xffffffffu, v, 2);
  out[threadIdx.x] = r;
}

// kind 0-3: neighbours across warps (span 64) or within a warp (32), synchronised when even;
// 4: each block writes its own word; 5: every block writes word 0; 6: `in` (n floats) copied
// within its bounds; 7: one past them; 8: one shuffle for the warp; 9: two, half the warp at each
// (the emulator's own check, any build). out has room for 128 floats. Misuse the emulator found
// goes to stderr.
extern "C" int emu_canary(int kind, const float* in, int n, float* out) {
  if (kind < 4)
    CHUNKGEN_LAUNCH(neighbour_kernel, 2, 64, 64 * sizeof(float), nullptr, out, kind < 2 ? 64 : 32, kind % 2 == 0);
  else if (kind < 6)
    CHUNKGEN_LAUNCH(blocks_kernel, 4, 32, 0, nullptr, out, kind == 5);
  else if (kind < 8)
    CHUNKGEN_LAUNCH(copy_kernel, 2, 64, 0, nullptr, in, out, n, kind == 7);
  else
    CHUNKGEN_LAUNCH(shuffle_kernel, 1, 32, 0, nullptr, out, kind == 9);
  if (emu::device().errors.empty()) return 0;
  std::fprintf(stderr, "%s", emu::device().errors.c_str());
  return 2;
}
