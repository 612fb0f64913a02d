// The fp8 decode attention's split kernel on the tensor cores, for head_dim 64 and 128 (Note
// [fp8 decode attention on the tensor cores] in src/fp8_attention.cpp; attend_fp8.cu launches it).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "attend_fp8.cuh"

namespace reviva::kernels {
namespace {

// Two e4m3 values (the low 16 bits of w, low byte first) to an fp16 pair, exactly.
__device__ inline std::uint32_t e4m3x2_to_f16x2(std::uint32_t w) {
  const __half2_raw h =
      __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w & 0xFFFFu), __NV_E4M3);
  return static_cast<std::uint32_t>(h.x) | (static_cast<std::uint32_t>(h.y) << 16);
}

// Two floats to an fp16 pair (lo in the low half), rounded to nearest, clamped to fp16's range.
__device__ inline std::uint32_t f16x2_of(float lo, float hi) {
  constexpr float kF16Max = 65504.0f;
  const __half2 h =
      __floats2half2_rn(fminf(fmaxf(lo, -kF16Max), kF16Max), fminf(fmaxf(hi, -kF16Max), kF16Max));
  return *reinterpret_cast<const std::uint32_t*>(&h);
}

// d += a b: one m16n8k16 tensor-core product of fp16 A (row-major 16 x 16) and B (16 x 8) in
// fp32 (the fragments' layout is PTX's for mma.m16n8k16).
__device__ inline void mma_f16(float (&d)[4], std::uint32_t a0, std::uint32_t a1, std::uint32_t a2,
                               std::uint32_t a3, std::uint32_t b0, std::uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The kernel for head_dim D of 64 or 128, on the tensor cores (Note [fp8 decode attention on
// the tensor cores] in src/fp8_attention.cpp): each warp takes 16 tokens at a time; lane
// (g, t) = (lane / 4, lane % 4) in PTX's fragment terms.
template <typename T, int D, int GP>
__global__ void __launch_bounds__(kWarps * 32)
    attend_split_mma_kernel(Fp8DecodeArgs a, int splits, std::size_t chunk) {
  static_assert(D == 64 || D == 128, "the tensor-core kernel's head_dim");
  static_assert(GP <= 8, "a warp's product holds 8 heads");
  constexpr int kSteps = D / 16;  // k-steps of Q K^T, m-tiles of V^T P
  constexpr int kWords = D / 32;  // 4-byte words of a value row per lane
  __shared__ float sm_acc[kWarps][GP][D];
  __shared__ float sm_m[kWarps][GP];
  __shared__ float sm_l[kWarps][GP];

  const BlockWork w = block_work<T, 1, GP>(a, splits, chunk);
  if (w.done) return;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  const int g = lane >> 2, t = lane & 3;
  const std::size_t end = w.end;

  // Q as A of Q K^T (rows: heads; rows 8-15 zero): lane (g, t) holds head g's elements
  // [16 s + 4 t, 16 s + 4 t + 4) for each k-step s, as A's columns (2t, 2t + 1) and (2t + 8,
  // 2t + 9): the dot product's order of elements is permuted alike in Q and K.
  std::uint32_t qa[kSteps][2];
  {
    const T* qp = static_cast<const T*>(a.q) + static_cast<std::int64_t>(w.b) * a.q_stride[0] +
                  static_cast<std::int64_t>(w.kvh * w.group + w.g0 + g) * a.q_stride[1];
    const bool mine = g < w.count;
#pragma unroll
    for (int s = 0; s < kSteps; ++s) {
      const int j = 16 * s + 4 * t;
      qa[s][0] = mine ? f16x2_of(to_float(qp[j]), to_float(qp[j + 1])) : 0u;
      qa[s][1] = mine ? f16x2_of(to_float(qp[j + 2]), to_float(qp[j + 3])) : 0u;
    }
  }
  const float qscale = a.scale * kLog2e;

  // A tile of 16 tokens from `base`, in registers. K as B of Q K^T (columns: tokens): lane
  // (g, t) holds the word at byte 16 s + 4 t of tokens g and 8 + g. V as A of V^T P (rows:
  // elements, columns: tokens): lane (g, t) holds the words at bytes 32 k + 4 g of tokens 2t,
  // 2t + 1, 2t + 8, 2t + 9 (its tokens i = 0..3), whose scores it also holds after Q K^T, and
  // those tokens' scales.
  struct Tile {
    std::uint32_t k[2][kSteps];
    std::uint32_t v[4][kWords];
    float k_scale[4], v_scale[4];
  };
  const auto token = [&](int i) { return 2 * t + (i & 1) + 8 * (i >> 1); };
  const auto load = [&](std::size_t base, Tile& r) {
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      const std::size_t at = base + 8 * n + g;
      const unsigned char* row = w.k_base + static_cast<std::int64_t>(at) * a.row_stride[2];
#pragma unroll
      for (int s = 0; s < kSteps; ++s)
        r.k[n][s] = at < end ? *reinterpret_cast<const std::uint32_t*>(row + 16 * s + 4 * t) : 0u;
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const std::size_t at = base + token(i);
      const std::int64_t off = static_cast<std::int64_t>(at) * a.row_stride[2];
      const bool in = at < end;
#pragma unroll
      for (int k = 0; k < kWords; ++k)
        r.v[i][k] =
            in ? *reinterpret_cast<const std::uint32_t*>(w.v_base + off + 32 * k + 4 * g) : 0u;
      r.k_scale[i] = in ? *reinterpret_cast<const float*>(w.k_base + off + D) : 0.0f;
      r.v_scale[i] = in ? *reinterpret_cast<const float*>(w.v_base + off + D) : 0.0f;
    }
  };

  // acc: O^T (rows: elements, columns: heads) per m-tile k: lane (g, t) holds elements
  // 32 (k / 2) + 4 g + 2 (k % 2) (+ 1 for [2], [3]) of heads 2t ([0], [2]) and 2t + 1 ([1], [3]),
  // in units of r (the largest value scale seen: the weights P are relative to it, so that they
  // stay in [0, 1] in fp16 whatever the rows' scales).
  float acc[kSteps][4];
#pragma unroll
  for (int k = 0; k < kSteps; ++k) acc[k][0] = acc[k][1] = acc[k][2] = acc[k][3] = 0.0f;
  float m = -INFINITY;  // running max of head g (every lane of the head holds it)
  float l = 0.0f;       // the lane's share of head g's running sum
  float r = 0.0f;

  constexpr std::size_t kStep = static_cast<std::size_t>(kWarps) * 16;
  Tile cur, next;
  std::size_t base = w.begin + static_cast<std::size_t>(warp) * 16;
  if (base < end) load(base, cur);
  for (; base < end; base += kStep) {
    if (base + kStep < end) load(base + kStep, next);
    // S^T = Q K^T: lane (g, t) gets head g's scores of its tokens 0, 1 (tile n = 0's [0], [1])
    // and 2, 3 (n = 1's)
    float st[2][4] = {};
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int s = 0; s < kSteps; ++s)
        mma_f16(st[n], qa[s][0], 0u, qa[s][1], 0u, e4m3x2_to_f16x2(cur.k[n][s]),
                e4m3x2_to_f16x2(cur.k[n][s] >> 16));
    float sc[4] = {st[0][0], st[0][1], st[1][0], st[1][1]};
    float top = -INFINITY, vtop = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      sc[i] = base + token(i) < end ? sc[i] * qscale * cur.k_scale[i] : -INFINITY;
      top = fmaxf(top, sc[i]);
      vtop = fmaxf(vtop, cur.v_scale[i]);
    }
#pragma unroll
    for (int off = 1; off < 4; off <<= 1) {  // (the 4 lanes of a head hold the tile's 16 tokens)
      top = fmaxf(top, __shfl_xor_sync(kFull, top, off));
      vtop = fmaxf(vtop, __shfl_xor_sync(kFull, vtop, off));
    }
    const float m_new = fmaxf(m, top);   // finite: the tile's first token is valid
    const float c = exp2f(m - m_new);    // 0 while m is -inf
    const float r_new = fmaxf(r, vtop);  // > 0: a valid token's scale is
    float p[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) p[i] = exp2f(sc[i] - m_new);  // 0 for a token past the end
    l = l * c + (p[0] + p[1]) + (p[2] + p[3]);
    m = m_new;
    const float inv_r = 1.0f / r_new;
    // P as B of V^T P (rows: tokens, columns: heads): exactly the scores' places
    const std::uint32_t pb0 =
        f16x2_of(p[0] * cur.v_scale[0] * inv_r, p[1] * cur.v_scale[1] * inv_r);
    const std::uint32_t pb1 =
        f16x2_of(p[2] * cur.v_scale[2] * inv_r, p[3] * cur.v_scale[3] * inv_r);
    // the output's columns are heads 2t and 2t + 1: their rescaling is held by lanes 8t, 8t + 4
    const float f0 = __shfl_sync(kFull, c, 8 * t) * (r * inv_r);
    const float f1 = __shfl_sync(kFull, c, 8 * t + 4) * (r * inv_r);
    r = r_new;
#pragma unroll
    for (int k = 0; k < kSteps; ++k) {
      acc[k][0] *= f0;
      acc[k][1] *= f1;
      acc[k][2] *= f0;
      acc[k][3] *= f1;
      // the bytes 2 (k % 2) and 2 (k % 2) + 1 of word k / 2, paired across tokens (0, 1), (2, 3)
      const unsigned sel = (k & 1) ? 0x7362u : 0x5140u;
      const std::uint32_t lo = __byte_perm(cur.v[0][k / 2], cur.v[1][k / 2], sel);
      const std::uint32_t hi = __byte_perm(cur.v[2][k / 2], cur.v[3][k / 2], sel);
      mma_f16(acc[k], e4m3x2_to_f16x2(lo), e4m3x2_to_f16x2(lo >> 16), e4m3x2_to_f16x2(hi),
              e4m3x2_to_f16x2(hi >> 16), pb0, pb1);
    }
    cur = next;
  }
#pragma unroll
  for (int off = 1; off < 4; off <<= 1) l += __shfl_xor_sync(kFull, l, off);

#pragma unroll
  for (int k = 0; k < kSteps; ++k) {
    const int j = 32 * (k / 2) + 4 * g + 2 * (k % 2);
    if (2 * t < GP) {
      sm_acc[warp][2 * t][j] = acc[k][0] * r;
      sm_acc[warp][2 * t][j + 1] = acc[k][2] * r;
    }
    if (2 * t + 1 < GP) {
      sm_acc[warp][2 * t + 1][j] = acc[k][1] * r;
      sm_acc[warp][2 * t + 1][j + 1] = acc[k][3] * r;
    }
  }
  if (t == 0 && g < GP) {
    sm_m[warp][g] = m;
    sm_l[warp][g] = l;
  }
  __syncthreads();
  merge_warps<T, GP>(a, w, splits, &sm_acc[0][0][0], GP * D, D, sm_m, sm_l);
}

}  // namespace

template <typename T, int GP>
SplitKernel tensor_core_split_kernel(std::size_t head_dim) {  // (64 or 128)
  return head_dim == 64 ? attend_split_mma_kernel<T, 64, GP> : attend_split_mma_kernel<T, 128, GP>;
}

// (every variant attend_fp8.cu's split_kernel asks for)
template SplitKernel tensor_core_split_kernel<__nv_bfloat16, 1>(std::size_t);
template SplitKernel tensor_core_split_kernel<__nv_bfloat16, 2>(std::size_t);
template SplitKernel tensor_core_split_kernel<__nv_bfloat16, 4>(std::size_t);
template SplitKernel tensor_core_split_kernel<__nv_bfloat16, 8>(std::size_t);
template SplitKernel tensor_core_split_kernel<__half, 1>(std::size_t);
template SplitKernel tensor_core_split_kernel<__half, 2>(std::size_t);
template SplitKernel tensor_core_split_kernel<__half, 4>(std::size_t);
template SplitKernel tensor_core_split_kernel<__half, 8>(std::size_t);

}  // namespace reviva::kernels
