// The fp8 decode attention's split kernel on the CUDA cores, for any head_dim but 64 and 128
// (Note [fp8 decode attention] in src/fp8_attention.cpp; attend_fp8.cu launches it).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "attend_fp8.cuh"

namespace reviva::kernels {
namespace {

// Four e4m3 values (little-endian bytes of w) to fp32, exactly (each is an fp16 value).
__device__ inline void e4m3x4_to_float(std::uint32_t w, float* f) {
  const __half2_raw lo =
      __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w & 0xFFFFu), __NV_E4M3);
  const __half2_raw hi =
      __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w >> 16), __NV_E4M3);
  const float2 a = __half22float2(__half2(lo));
  const float2 b = __half22float2(__half2(hi));
  f[0] = a.x;
  f[1] = a.y;
  f[2] = b.x;
  f[3] = b.y;
}

// One step of reduce_scatter: lanes that differ in bit `Off` swap halves of vals[0, 2 Off).
template <int Off>
__device__ inline void reduce_scatter_step(float (&vals)[32], int lane) {
  const bool upper = (lane & Off) != 0;
#pragma unroll
  for (int i = 0; i < Off; ++i) {
    const float send = upper ? vals[i] : vals[i + Off];
    const float keep = upper ? vals[i + Off] : vals[i];
    vals[i] = keep + __shfl_xor_sync(kFull, send, Off);
  }
}

// 32 values per lane -> lane l holds the sum over the warp of every lane's vals[l] (in vals[0]).
__device__ inline void reduce_scatter(float (&vals)[32], int lane) {
  reduce_scatter_step<16>(vals, lane);
  reduce_scatter_step<8>(vals, lane);
  reduce_scatter_step<4>(vals, lane);
  reduce_scatter_step<2>(vals, lane);
  reduce_scatter_step<1>(vals, lane);
}

// The kernel for any head_dim (a multiple of 4 up to 256), on the CUDA cores: each warp takes
// 32 / GP tokens at a time, lane l holding bytes [4l, 4l + 4) (and [128 + 4l, ...)) of each row;
// the partial dot products of all (token, head) pairs are summed across the warp by one
// reduce-scatter.
template <typename T, int NV, int GP>
__global__ void __launch_bounds__(kWarps * 32)
    attend_split_kernel(Fp8DecodeArgs a, int splits, std::size_t chunk) {  // (0 when graphed)
  constexpr int kTokens = 32 / GP;                                         // per warp and round
  constexpr int kDim = 128 * NV;
  __shared__ float sm_acc[kWarps][GP][kDim];
  __shared__ float sm_m[kWarps][GP];
  __shared__ float sm_l[kWarps][GP];

  const BlockWork w = block_work<T, NV, GP>(a, splits, chunk);
  if (w.done) return;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  const std::size_t dim = a.head_dim, begin = w.begin, end = w.end;
  const int count = w.count;

  // the queries, scaled so that exp2 of a score is exp of the model's
  float q[GP][4 * NV];
  const float qscale = a.scale * kLog2e;
#pragma unroll
  for (int g = 0; g < GP; ++g) {
    const T* qp = static_cast<const T*>(a.q) + static_cast<std::int64_t>(w.b) * a.q_stride[0] +
                  static_cast<std::int64_t>(w.kvh * w.group + w.g0 + g) * a.q_stride[1];
#pragma unroll
    for (int n = 0; n < NV; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const std::size_t j = 4 * (lane + 32 * n) + e;
        q[g][4 * n + e] = g < count && j < dim ? to_float(qp[j]) * qscale : 0.0f;
      }
  }

  // this warp's rounds of kTokens keys: online softmax per head
  float m = -INFINITY;  // running max of the lane's head (lane % GP), on every lane of that head
  float l = 0.0f;       // the lane's share of the running sum
  float acc[GP][4 * NV];
#pragma unroll
  for (int g = 0; g < GP; ++g)
#pragma unroll
    for (int e = 0; e < 4 * NV; ++e) acc[g][e] = 0.0f;

  // One round's rows in registers: lane l holds 4 NV bytes of each of the round's kTokens keys
  // and values, and the scales of its own token (lane l's token is l / GP). The next round's
  // loads are issued before this round computes (plain loads, not __ldg: block_work may have
  // written the last row in this kernel).
  struct Round {
    std::uint32_t k[kTokens][NV], v[kTokens][NV];
    float k_scale, v_scale;
  };
  const auto load = [&](std::size_t base, Round& r) {
#pragma unroll
    for (int t = 0; t < kTokens; ++t) {
      const bool valid = base + t < end;
      const std::int64_t at = static_cast<std::int64_t>(base + t) * a.row_stride[2];
#pragma unroll
      for (int n = 0; n < NV; ++n) {
        const std::size_t j = 4 * (lane + 32 * n);
        const bool in = valid && j < dim;
        r.k[t][n] = in ? *reinterpret_cast<const unsigned*>(w.k_base + at + j) : 0u;
        r.v[t][n] = in ? *reinterpret_cast<const unsigned*>(w.v_base + at + j) : 0u;
      }
    }
    const std::size_t own = base + static_cast<std::size_t>(lane / GP);
    const std::int64_t at = static_cast<std::int64_t>(own) * a.row_stride[2];
    r.k_scale = own < end ? *reinterpret_cast<const float*>(w.k_base + at + dim) : 0.0f;
    r.v_scale = own < end ? *reinterpret_cast<const float*>(w.v_base + at + dim) : 0.0f;
  };
  constexpr std::size_t kStep = static_cast<std::size_t>(kWarps) * kTokens;
  Round cur, next;
  std::size_t base = begin + static_cast<std::size_t>(warp) * kTokens;
  if (base < end) load(base, cur);
  for (; base < end; base += kStep) {
    if (base + kStep < end) load(base + kStep, next);
    float vals[32];
#pragma unroll
    for (int t = 0; t < kTokens; ++t) {
      float kf[4 * NV];
#pragma unroll
      for (int n = 0; n < NV; ++n) e4m3x4_to_float(cur.k[t][n], kf + 4 * n);
#pragma unroll
      for (int g = 0; g < GP; ++g) {
        float d = 0.0f;
#pragma unroll
        for (int e = 0; e < 4 * NV; ++e) d = fmaf(q[g][e], kf[e], d);
        vals[t * GP + g] = d;
      }
    }
    reduce_scatter(vals, lane);  // lane l: token l / GP's dot product for head l % GP, unscaled
    const bool mine = base + static_cast<std::size_t>(lane / GP) < end;
    const float s = mine ? vals[0] * cur.k_scale : -INFINITY;
    float top = s;
#pragma unroll
    for (int off = GP; off < 32; off <<= 1) top = fmaxf(top, __shfl_xor_sync(kFull, top, off));
    const float m_new = fmaxf(m, top);  // finite: the round's first key is valid
    const float c = exp2f(m - m_new);   // 0 while m is -inf
    const float p = exp2f(s - m_new);   // 0 for a key past the end
    l = l * c + p;
    m = m_new;
    const float pv_own = p * cur.v_scale;  // (the value's scale folded into its weight)
#pragma unroll
    for (int g = 0; g < GP; ++g) {
      const float cg = __shfl_sync(kFull, c, g);
#pragma unroll
      for (int e = 0; e < 4 * NV; ++e) acc[g][e] *= cg;
    }
#pragma unroll
    for (int t = 0; t < kTokens; ++t) {
      float vf[4 * NV];
#pragma unroll
      for (int n = 0; n < NV; ++n) e4m3x4_to_float(cur.v[t][n], vf + 4 * n);
#pragma unroll
      for (int g = 0; g < GP; ++g) {
        const float pv = __shfl_sync(kFull, pv_own, t * GP + g);
#pragma unroll
        for (int e = 0; e < 4 * NV; ++e) acc[g][e] = fmaf(pv, vf[e], acc[g][e]);
      }
    }
    cur = next;
  }
#pragma unroll
  for (int off = GP; off < 32; off <<= 1) l += __shfl_xor_sync(kFull, l, off);

#pragma unroll
  for (int g = 0; g < GP; ++g)
#pragma unroll
    for (int n = 0; n < NV; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) sm_acc[warp][g][4 * (lane + 32 * n) + e] = acc[g][4 * n + e];
  if (lane < GP) {
    sm_m[warp][lane] = m;
    sm_l[warp][lane] = l;
  }
  __syncthreads();
  merge_warps<T, GP>(a, w, splits, &sm_acc[0][0][0], GP * kDim, kDim, sm_m, sm_l);
}

}  // namespace

template <typename T, int GP>
SplitKernel cuda_core_split_kernel(std::size_t head_dim) {
  return head_dim <= 128 ? attend_split_kernel<T, 1, GP> : attend_split_kernel<T, 2, GP>;
}

// (every variant attend_fp8.cu's split_kernel asks for)
template SplitKernel cuda_core_split_kernel<__nv_bfloat16, 1>(std::size_t);
template SplitKernel cuda_core_split_kernel<__nv_bfloat16, 2>(std::size_t);
template SplitKernel cuda_core_split_kernel<__nv_bfloat16, 4>(std::size_t);
template SplitKernel cuda_core_split_kernel<__nv_bfloat16, 8>(std::size_t);
template SplitKernel cuda_core_split_kernel<__half, 1>(std::size_t);
template SplitKernel cuda_core_split_kernel<__half, 2>(std::size_t);
template SplitKernel cuda_core_split_kernel<__half, 4>(std::size_t);
template SplitKernel cuda_core_split_kernel<__half, 8>(std::size_t);

}  // namespace reviva::kernels
