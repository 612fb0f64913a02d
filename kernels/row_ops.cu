// A decode step's row operations, one kernel each (see launchers.h; Note [Decode row ops] in
// src/row_ops.cpp): each rounds where HF's modules round.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "half_convert.cuh"
#include "launchers.h"

namespace reviva::kernels {
namespace {

constexpr int kNormThreads = 256;
constexpr int kThreads = 256;
constexpr int kMaxBlocks = 4096;

template <typename T>
__device__ inline float rounded(float x) {
  return to_float(from_float<T>(x));
}

// One block per row: pass 1 forms the row (residual + x, rounded and written back) and its sum
// of squares, pass 2 writes the normalized row; each thread reads back only what it wrote.
template <typename T>
__global__ void rms_norm_kernel(RmsNormArgs a) {
  __shared__ float partial[kNormThreads / 32];
  const auto row = static_cast<std::int64_t>(blockIdx.x);
  const T* x = static_cast<const T*>(a.x) + row * a.x_stride;
  T* residual = a.residual ? static_cast<T*>(a.residual) + row * a.residual_stride : nullptr;
  const T* weight = static_cast<const T*>(a.weight);
  T* out = static_cast<T*>(a.out) + row * a.out_stride;
  const auto width = static_cast<std::int64_t>(a.width);
  float sum = 0.0f;
  for (std::int64_t j = threadIdx.x; j < width; j += blockDim.x) {
    float v = to_float(x[j]);
    if (residual) {
      const T s = from_float<T>(to_float(residual[j]) + v);
      residual[j] = s;
      v = to_float(s);
    }
    sum += v * v;
  }
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  if ((threadIdx.x & 31u) == 0) partial[threadIdx.x >> 5] = sum;
  __syncthreads();
  if (threadIdx.x < 32) {
    sum = threadIdx.x < blockDim.x / 32 ? partial[threadIdx.x] : 0.0f;
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (threadIdx.x == 0) partial[0] = sum;
  }
  __syncthreads();
  const float inv = rsqrtf(partial[0] * (1.0f / static_cast<float>(width)) + a.eps);
  const T* src = residual ? residual : x;
  for (std::int64_t j = threadIdx.x; j < width; j += blockDim.x) {
    const float normed = rounded<T>(to_float(src[j]) * inv);
    out[j] = from_float<T>(to_float(weight[j]) * normed);
  }
}

// One thread per (sequence, head, pair j and j + head_dim / 2), queries' heads then keys'.
template <typename T>
__global__ void rotary_kernel(RotaryArgs a) {
  const std::size_t half = a.head_dim / 2;
  const std::size_t heads = a.q_heads + a.k_heads;
  const std::size_t total = a.batch * heads * half;
  for (std::size_t t = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; t < total;
       t += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const auto j = static_cast<std::int64_t>(t % half);
    const std::size_t h = (t / half) % heads;
    const auto b = static_cast<std::int64_t>(t / (half * heads));
    const bool is_q = h < a.q_heads;
    const std::int64_t* stride = is_q ? a.q_stride : a.k_stride;
    T* base = static_cast<T*>(is_q ? a.q : a.k) + b * stride[0] +
              static_cast<std::int64_t>(is_q ? h : h - a.q_heads) * stride[1];
    const T* cos = static_cast<const T*>(a.cos) + b * a.cos_stride;
    const T* sin = static_cast<const T*>(a.sin) + b * a.sin_stride;
    const auto hj = static_cast<std::int64_t>(half) + j;
    const float x1 = to_float(base[j]);
    const float x2 = to_float(base[hj]);
    base[j] = from_float<T>(rounded<T>(x1 * to_float(cos[j])) + rounded<T>(-x2 * to_float(sin[j])));
    base[hj] =
        from_float<T>(rounded<T>(x2 * to_float(cos[hj])) + rounded<T>(x1 * to_float(sin[hj])));
  }
}

template <typename T>
__global__ void silu_mul_kernel(SiluMulArgs a) {
  const std::size_t total = a.rows * a.width;
  for (std::size_t t = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; t < total;
       t += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const auto j = static_cast<std::int64_t>(t % a.width);
    const auto r = static_cast<std::int64_t>(t / a.width);
    const float g = to_float(static_cast<const T*>(a.gate)[r * a.gate_stride + j]);
    const float u = to_float(static_cast<const T*>(a.up)[r * a.up_stride + j]);
    const float act = rounded<T>(g / (1.0f + expf(-g)));
    static_cast<T*>(a.out)[r * a.out_stride + j] = from_float<T>(act * u);
  }
}

int blocks_for(std::size_t items) {
  return static_cast<int>(std::max<std::size_t>(
      1, std::min<std::size_t>((items + kThreads - 1) / kThreads, kMaxBlocks)));
}

}  // namespace

cudaError_t launch_rms_norm(const RmsNormArgs& args, cudaStream_t stream) {
  if (args.rows == 0) return cudaSuccess;
  if (args.x == nullptr || args.weight == nullptr || args.out == nullptr || args.width == 0)
    return cudaErrorInvalidValue;
  const auto rows = static_cast<unsigned>(args.rows);
  if (args.bfloat16)
    rms_norm_kernel<__nv_bfloat16><<<rows, kNormThreads, 0, stream>>>(args);
  else
    rms_norm_kernel<__half><<<rows, kNormThreads, 0, stream>>>(args);
  return cudaGetLastError();
}

cudaError_t launch_rotary(const RotaryArgs& args, cudaStream_t stream) {
  const std::size_t items = args.batch * (args.q_heads + args.k_heads) * (args.head_dim / 2);
  if (items == 0) return cudaSuccess;
  if (args.cos == nullptr || args.sin == nullptr || args.head_dim % 2 != 0)
    return cudaErrorInvalidValue;
  if (args.bfloat16)
    rotary_kernel<__nv_bfloat16><<<blocks_for(items), kThreads, 0, stream>>>(args);
  else
    rotary_kernel<__half><<<blocks_for(items), kThreads, 0, stream>>>(args);
  return cudaGetLastError();
}

cudaError_t launch_silu_mul(const SiluMulArgs& args, cudaStream_t stream) {
  const std::size_t items = args.rows * args.width;
  if (items == 0) return cudaSuccess;
  if (args.gate == nullptr || args.up == nullptr || args.out == nullptr)
    return cudaErrorInvalidValue;
  if (args.bfloat16)
    silu_mul_kernel<__nv_bfloat16><<<blocks_for(items), kThreads, 0, stream>>>(args);
  else
    silu_mul_kernel<__half><<<blocks_for(items), kThreads, 0, stream>>>(args);
  return cudaGetLastError();
}

cudaError_t preload_row_ops() {
  cudaFuncAttributes attributes;
  for (const void* f : {reinterpret_cast<const void*>(rms_norm_kernel<__nv_bfloat16>),
                        reinterpret_cast<const void*>(rms_norm_kernel<__half>),
                        reinterpret_cast<const void*>(rotary_kernel<__nv_bfloat16>),
                        reinterpret_cast<const void*>(rotary_kernel<__half>),
                        reinterpret_cast<const void*>(silu_mul_kernel<__nv_bfloat16>),
                        reinterpret_cast<const void*>(silu_mul_kernel<__half>)}) {
    const cudaError_t e = cudaFuncGetAttributes(&attributes, f);
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

}  // namespace reviva::kernels
