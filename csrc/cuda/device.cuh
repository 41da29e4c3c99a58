// What every CUDA kernel file includes: the CUDA headers, the launch macro, and fp32 to and from
// the pool's dtypes. Under CHUNKGEN_CUDA_EMULATION the emulator (tests/kernels/cuda_emu) has
// already defined the headers' names and the launch on the CPU.
#pragma once
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

}  // namespace chunkgen
