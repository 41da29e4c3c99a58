// fp32 to and from the pool's dtypes on the device, shared by the CUDA kernels that the emulator
// also runs (tests/kernels/cuda_emu defines the same names on the CPU).
#pragma once
#ifndef CHUNKGEN_CUDA_EMULATION
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

namespace chunkgen {

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
