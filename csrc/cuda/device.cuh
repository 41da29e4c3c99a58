// What every CUDA kernel file includes: the CUDA headers, the launch macro, fp32 to and from the
// pool's dtypes, and the host's error check and per-device limits. Under CHUNKGEN_CUDA_EMULATION
// the emulator (tests/kernels/cuda_emu) has already defined the headers' names and the launch on
// the CPU.
#pragma once
#include <cstddef>
#include <stdexcept>
#include <string>

#ifndef CHUNKGEN_CUDA_EMULATION
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_pipeline.h>
#include <cuda_runtime.h>
#include <mma.h>
#define CHUNKGEN_LAUNCH(kernel, grid, block, smem, stream, ...) \
  kernel<<<(grid), (block), (smem), (stream)>>>(__VA_ARGS__)
#endif

namespace chunkgen {

#ifndef CHUNKGEN_CUDA_EMULATION
// The block's dynamic shared memory (the emulator defines its own).
__device__ __forceinline__ unsigned char* shared_bytes() {
  extern __shared__ __align__(128) unsigned char smem[];
  return smem;
}
#endif

template <typename T>
__device__ __forceinline__ float to_float(T x);
template <>
__device__ __forceinline__ float to_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ float to_float<__half>(__half x) {
  return __half2float(x);
}
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat162float(x);
}
template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16(x);
}

// ---- host side ------------------------------------------------------------------------------

inline void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(err));
}

struct DeviceLimits {
  int sms = 0;
  int max_smem = 0;  // dynamic shared memory a block may opt in to
};

// Read once per device: a decode step launches the kernels once per layer.
inline DeviceLimits device_limits() {
  constexpr int kMaxDevices = 64;
  static DeviceLimits cache[kMaxDevices];
  int dev = 0;
  check(cudaGetDevice(&dev), "cudaGetDevice");
  DeviceLimits& lim = cache[dev < kMaxDevices ? dev : 0];
  if (lim.sms == 0 || dev >= kMaxDevices) {
    check(cudaDeviceGetAttribute(&lim.max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev), "shared memory limit");
    check(cudaDeviceGetAttribute(&lim.sms, cudaDevAttrMultiProcessorCount, dev), "SM count");
  }
  return lim;
}

// Kernels asking for more than the default 48 KiB of dynamic shared memory must opt in first.
template <typename Kernel>
void reserve_smem(Kernel kernel, size_t bytes, const DeviceLimits& lim, const char* what) {
  if (bytes > static_cast<size_t>(lim.max_smem))
    throw std::invalid_argument(std::string(what) + " needs " + std::to_string(bytes) +
                                " bytes of shared memory; this GPU allows " + std::to_string(lim.max_smem));
  if (bytes > 48 * 1024)
    check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)),
          "cudaFuncSetAttribute");
}

}  // namespace chunkgen
