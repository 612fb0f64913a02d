// The pieces both of the fp8 decode attention's split kernels use (device code, and the host
// functions that hand out each file's kernels): constants, the new token's quantization, what a
// block attends (BlockWork) and the merge of its warps. The split kernels are in
// attend_fp8_cuda_cores.cu and attend_fp8_tensor_cores.cu; the splits, their merge and the
// launchers in attend_fp8.cu (Note [fp8 decode attention] in src/fp8_attention.cpp).
#pragma once

#include <cuda_fp8.h>

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "half_convert.cuh"
#include "launchers.h"

// (Not in an unnamed namespace as the kernels are: each .cu that includes this instantiates the
// device templates for itself, and the two host functions at the end are defined in the other
// files.)
namespace reviva::kernels {

constexpr int kWarps = 4;  // per block
constexpr unsigned kFull = 0xFFFFFFFFu;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kE4M3Max = 448.0f;

__device__ inline std::uint32_t float_to_e4m3(float x) {
  return static_cast<std::uint32_t>(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3));
}

// The new token's vector (16-bit, [head_dim] from `src`) quantized into `row` by one warp, as
// kv_fp8.quantize does: scale amax x fp32(1/448) (1 for a zero vector), values x / scale clamped to
// +-448, e4m3 rounded to nearest even. NV: 4-byte words per lane.
template <typename T, int NV>
__device__ void quantize_row(const T* src, std::size_t head_dim, unsigned char* row, int lane) {
  float x[4 * NV];
  float amax = 0.0f;
#pragma unroll
  for (int n = 0; n < NV; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const std::size_t j = 4 * (lane + 32 * n) + e;
      x[4 * n + e] = j < head_dim ? to_float(src[j]) : 0.0f;
      amax = fmaxf(amax, fabsf(x[4 * n + e]));
    }
#pragma unroll
  for (int off = 16; off >= 1; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(kFull, amax, off));
  const float scale = amax > 0.0f ? amax * (1.0f / kE4M3Max) : 1.0f;
#pragma unroll
  for (int n = 0; n < NV; ++n) {
    const std::size_t j = 4 * (lane + 32 * n);
    if (j >= head_dim) continue;
    std::uint32_t w = 0;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float v = fminf(fmaxf(x[4 * n + e] / scale, -kE4M3Max), kE4M3Max);
      w |= float_to_e4m3(v) << (8 * e);
    }
    *reinterpret_cast<std::uint32_t*>(row + j) = w;
  }
  if (lane == 0) *reinterpret_cast<float*>(row + head_dim) = scale;
}

// NaN into the outputs of `count` heads from `h0` of sequence b (an impossible step length).
template <typename T>
__device__ void write_nan(const Fp8DecodeArgs& a, std::size_t b, std::size_t h0, int count) {
  for (std::size_t i = threadIdx.x; i < static_cast<std::size_t>(count) * a.head_dim;
       i += blockDim.x) {
    T* out = static_cast<T*>(a.out) + static_cast<std::int64_t>(b) * a.out_stride[0] +
             static_cast<std::int64_t>(h0 + i / a.head_dim) * a.out_stride[1];
    out[i % a.head_dim] = from_float<T>(NAN);
  }
}

// What a block of either split kernel attends (grid (batch * kv_heads * head groups, splits)):
// its sequence b, kv head, query heads [g0, g0 + count) of the group, keys [begin, end) of the
// step's `length`, and its rows. Reads the step's length where a graph gives it (its splits then
// share the keys evenly); with an impossible length the block writes NaN and is `done`. The
// block whose keys end at the new token quantizes it into its rows first (warps 0 and 1), and
// every thread waits for that.
struct BlockWork {
  std::size_t b, kvh, group, g0, begin, end, length;
  int count;
  const unsigned char *k_base, *v_base;
  bool done;
};

template <typename T, int NV, int GP>
__device__ BlockWork block_work(const Fp8DecodeArgs& a, int splits, std::size_t chunk) {
  BlockWork w{};
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  w.group = a.heads / a.kv_heads;
  const std::size_t groups = (w.group + GP - 1) / GP;
  std::size_t y = blockIdx.x;
  w.g0 = (y % groups) * GP;
  y /= groups;
  w.kvh = y % a.kv_heads;
  w.b = y / a.kv_heads;
  w.count = static_cast<int>(min(static_cast<std::size_t>(GP), w.group - w.g0));
  const int split = static_cast<int>(blockIdx.y);
  std::size_t first_key = a.first_key;
  w.length = a.length;
  if (a.device_length != nullptr) {
    const std::int64_t given = *a.device_length;
    if (given < 1 || static_cast<std::size_t>(given) > a.length) {  // (NaN out, rows left)
      if (split == 0) write_nan<T>(a, w.b, w.kvh * w.group + w.g0, w.count);
      w.done = true;
      return w;
    }
    w.length = static_cast<std::size_t>(given);
    first_key = a.window > 0 && w.length > a.window ? w.length - a.window : 0;
    chunk = (w.length - first_key + splits - 1) / splits;
  }
  w.begin = min(w.length, first_key + static_cast<std::size_t>(split) * chunk);
  w.end = min(w.length, w.begin + chunk);

  unsigned char* k_rows = static_cast<unsigned char*>(a.k_rows);
  unsigned char* v_rows = static_cast<unsigned char*>(a.v_rows);
  if (a.device_rows != nullptr) {
    k_rows = reinterpret_cast<unsigned char*>(static_cast<std::uintptr_t>(a.device_rows[0]));
    v_rows = reinterpret_cast<unsigned char*>(static_cast<std::uintptr_t>(a.device_rows[1]));
  }
  const std::int64_t at = static_cast<std::int64_t>(w.b) * a.row_stride[0] +
                          static_cast<std::int64_t>(w.kvh) * a.row_stride[1];
  w.k_base = k_rows + at;
  w.v_base = v_rows + at;

  if (a.k_new != nullptr && w.begin < w.end && w.end == w.length && warp < 2) {
    const T* src = static_cast<const T*>(warp == 0 ? a.k_new : a.v_new);
    const std::int64_t* s = warp == 0 ? a.k_new_stride : a.v_new_stride;
    src += static_cast<std::int64_t>(w.b) * s[0] + static_cast<std::int64_t>(w.kvh) * s[1];
    unsigned char* row = (warp == 0 ? k_rows : v_rows) + at +
                         static_cast<std::int64_t>(w.length - 1) * a.row_stride[2];
    quantize_row<T, NV>(src, a.head_dim, row, lane);
  }
  __syncthreads();  // (the rows written are read by every warp of the block)
  return w;
}

// The block's warps merged: each warp's output for head g (unnormalized, [g * dim_stride + j]
// of acc[warp]), its running max (log2) m[warp][g] and sum l[warp][g]. To `out` with one split,
// else the normalized output and log2-sum-exp to the workspace ([batch * heads][splits][head_dim]
// floats, then [batch * heads][splits]).
template <typename T, int GP>
__device__ void merge_warps(const Fp8DecodeArgs& a, const BlockWork& w, int splits,
                            const float* acc, std::size_t warp_stride, std::size_t dim_stride,
                            const float (*m)[GP], const float (*l)[GP]) {
  const std::size_t dim = a.head_dim;
  float* ws_o = static_cast<float*>(a.workspace);
  float* ws_lse = ws_o == nullptr ? nullptr : ws_o + a.batch * a.heads * splits * dim;
  for (std::size_t i = threadIdx.x; i < static_cast<std::size_t>(w.count) * dim; i += blockDim.x) {
    const std::size_t g = i / dim, j = i % dim;
    float top = -INFINITY;
#pragma unroll
    for (int k = 0; k < kWarps; ++k) top = fmaxf(top, m[k][g]);
    float sum = 0.0f, o = 0.0f;
    if (top > -INFINITY) {
#pragma unroll
      for (int k = 0; k < kWarps; ++k) {
        const float f = exp2f(m[k][g] - top);
        sum = fmaf(l[k][g], f, sum);
        o = fmaf(acc[k * warp_stride + g * dim_stride + j], f, o);
      }
    }
    const std::size_t h = w.kvh * w.group + w.g0 + g;
    const float value = sum > 0.0f ? o / sum : 0.0f;
    if (splits == 1) {
      T* out = static_cast<T*>(a.out) + static_cast<std::int64_t>(w.b) * a.out_stride[0] +
               static_cast<std::int64_t>(h) * a.out_stride[1];
      out[j] = from_float<T>(value);
    } else {
      const std::size_t row = (w.b * a.heads + h) * splits + blockIdx.y;
      ws_o[row * dim + j] = value;
      if (j == 0) ws_lse[row] = sum > 0.0f ? top + log2f(sum) : -INFINITY;
    }
  }
}

// The split kernels' signature: (arguments, splits, keys per split: 0 when graphed).
using SplitKernel = void (*)(Fp8DecodeArgs, int, std::size_t);

// The split kernel on the tensor cores for a head_dim of 64 or 128 (attend_fp8_tensor_cores.cu).
template <typename T, int GP>
SplitKernel tensor_core_split_kernel(std::size_t head_dim);

// The split kernel on the CUDA cores for any other head_dim (attend_fp8_cuda_cores.cu).
template <typename T, int GP>
SplitKernel cuda_core_split_kernel(std::size_t head_dim);

}  // namespace reviva::kernels
