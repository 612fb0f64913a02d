// 16-bit float conversions the core's kernels share (device code only).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace reviva::kernels {

__device__ inline float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ inline float to_float(__half x) { return __half2float(x); }

// fp32 to the output type, rounded to nearest even.
template <typename Out>
__device__ inline Out from_float(float x);
template <>
__device__ inline __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
__device__ inline __half from_float<__half>(float x) {
  return __float2half_rn(x);
}

}  // namespace reviva::kernels
