// A decode step's row operations, one kernel each (see launchers.h; Note [Decode row ops] in
// src/row_ops.cpp): each rounds where HF's modules round.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "half_convert.cuh"
#include "launchers.h"

namespace reviva::kernels {
namespace {

constexpr int kWideNormThreads = 1024;
constexpr int kThreads = 256;
constexpr int kMaxBlocks = 4096;

template <typename T>
__device__ inline float rounded(float x) {
  return to_float(from_float<T>(x));
}

// One block per row: pass 1 forms the row (residual + x, rounded and written back) and its sum
// of squares, pass 2 writes the normalized row. A row of up to kRowItems * 1024 values (every
// hidden size seen) is held in registers, kRowItems values a thread: every load of the row is
// issued before the first store, so in place is safe and the loads overlap (a loop that reads and
// writes each value in turn waits for each load: 12.5 us a row of 4096 on an H100, against ~2 us
// here); a wider row takes the loop (rms_norm_wide_kernel).
constexpr int kRowItems = 8;

// The block's sum of `sum` (every thread gets it); partial: kWarpsMax floats of shared memory.
__device__ inline float block_sum(float sum, float* partial) {
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  if ((threadIdx.x & 31u) == 0) partial[threadIdx.x >> 5] = sum;
  __syncthreads();
  if (threadIdx.x < 32) {
    sum = threadIdx.x < blockDim.x / 32 ? partial[threadIdx.x] : 0.0f;
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (threadIdx.x == 0) partial[0] = sum;
  }
  __syncthreads();
  return partial[0];
}

template <typename T>
__global__ void __launch_bounds__(1024) rms_norm_kernel(RmsNormArgs a) {
  __shared__ float partial[32];
  const auto row = static_cast<std::int64_t>(blockIdx.x);
  const T* x = static_cast<const T*>(a.x) + row * a.x_stride;
  T* residual = a.residual ? static_cast<T*>(a.residual) + row * a.residual_stride : nullptr;
  const T* weight = static_cast<const T*>(a.weight);
  T* out = static_cast<T*>(a.out) + row * a.out_stride;
  const auto width = static_cast<std::int64_t>(a.width);
  const auto step = static_cast<std::int64_t>(blockDim.x);
  float v[kRowItems], r[kRowItems], w[kRowItems];
#pragma unroll
  for (int i = 0; i < kRowItems; ++i) {
    const std::int64_t j = threadIdx.x + i * step;
    const bool in = j < width;
    v[i] = in ? to_float(x[j]) : 0.0f;
    r[i] = in && residual ? to_float(residual[j]) : 0.0f;
    w[i] = in ? to_float(weight[j]) : 0.0f;
  }
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < kRowItems; ++i) {
    if (residual) v[i] = rounded<T>(r[i] + v[i]);
    sum += v[i] * v[i];
  }
  const float inv = rsqrtf(block_sum(sum, partial) * (1.0f / static_cast<float>(width)) + a.eps);
#pragma unroll
  for (int i = 0; i < kRowItems; ++i) {
    const std::int64_t j = threadIdx.x + i * step;
    if (j < width) {
      if (residual) residual[j] = from_float<T>(v[i]);
      out[j] = from_float<T>(w[i] * rounded<T>(v[i] * inv));
    }
  }
}

// A row wider than kRowItems * 1024: each thread reads back only what it wrote.
template <typename T>
__global__ void rms_norm_wide_kernel(RmsNormArgs a) {
  __shared__ float partial[32];
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
  const float inv = rsqrtf(block_sum(sum, partial) * (1.0f / static_cast<float>(width)) + a.eps);
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
  if (args.width > static_cast<std::size_t>(kRowItems) * 1024) {
    if (args.bfloat16)
      rms_norm_wide_kernel<__nv_bfloat16><<<rows, kWideNormThreads, 0, stream>>>(args);
    else
      rms_norm_wide_kernel<__half><<<rows, kWideNormThreads, 0, stream>>>(args);
    return cudaGetLastError();
  }
  // kRowItems values a thread, whole warps
  const std::size_t per = (args.width + kRowItems - 1) / kRowItems;
  const auto threads = static_cast<unsigned>(std::max<std::size_t>(32, (per + 31) / 32 * 32));
  if (args.bfloat16)
    rms_norm_kernel<__nv_bfloat16><<<rows, threads, 0, stream>>>(args);
  else
    rms_norm_kernel<__half><<<rows, threads, 0, stream>>>(args);
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
                        reinterpret_cast<const void*>(rms_norm_wide_kernel<__nv_bfloat16>),
                        reinterpret_cast<const void*>(rms_norm_wide_kernel<__half>),
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
