// A decode step's attention over fp8 K/V rows read in place: split-K over the keys, then a
// merge of the splits (launchers.h; Note [fp8 decode attention] in src/fp8_attention.cpp).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>

#include "half_convert.cuh"
#include "launchers.h"

namespace reviva::kernels {
namespace {

constexpr int kWarps = 4;              // per block
constexpr std::size_t kMinKeys = 256;  // keys per split, at least
constexpr int kMaxSplits = 1024;       // the merge kernel's shared table of splits
constexpr unsigned kFull = 0xFFFFFFFFu;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kE4M3Max = 448.0f;

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

__device__ inline std::uint32_t float_to_e4m3(float x) {
  return static_cast<std::uint32_t>(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3));
}

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

struct Split {
  int splits;
  std::size_t chunk;  // keys per split (the last may have fewer)
};

int heads_per_block(const Fp8DecodeArgs& a) {  // GP: 1, 2, 4 or 8 query heads per block
  const std::size_t group = a.heads / a.kv_heads;
  return group >= 8 ? 8 : group >= 4 ? 4 : group >= 2 ? 2 : 1;
}

std::size_t head_groups(const Fp8DecodeArgs& a) {
  const auto gp = static_cast<std::size_t>(heads_per_block(a));
  return (a.heads / a.kv_heads + gp - 1) / gp;
}

// Blocks of the split kernel for `a` that an SM holds at once (its registers decide), so that
// the splits fill the device in one wave; asked of the runtime once per kernel variant.
int resident_blocks(const Fp8DecodeArgs& a);

// The splits (and, with the length known on the host, the keys of each). Captured in a graph
// (device_length) the splits are fixed by the capacity and each launch cuts the keys of its
// step evenly among them (chunk 0 here: the kernel computes it).
Split split_of(const Fp8DecodeArgs& a) {
  const bool graphed = a.device_length != nullptr;
  const std::size_t keys = graphed ? a.length : a.length - a.first_key;
  const std::size_t blocks = a.batch * a.kv_heads * head_groups(a);
  // (rounded down: a block past the wave would run alone after it, Note [fp8 decode attention])
  const std::size_t fill = std::max<std::size_t>(
      1, static_cast<std::size_t>(std::max(a.sm_count, 1) * resident_blocks(a)) / blocks);
  const std::size_t by_keys = std::max<std::size_t>(1, keys / kMinKeys);
  if (graphed) {
    const std::size_t splits =
        std::min<std::size_t>({fill, by_keys, static_cast<std::size_t>(kMaxSplits)});
    return {static_cast<int>(splits), 0};
  }
  const std::size_t want =
      std::min<std::size_t>({fill, by_keys, static_cast<std::size_t>(kMaxSplits)});
  const std::size_t chunk = (keys + want - 1) / want;
  return {static_cast<int>((keys + chunk - 1) / chunk), chunk};
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

// Grid batch * heads; merges the splits' outputs by their log2-sum-exp into `out`. The splits
// are spread over the block's warps (warp w sums splits w, w + kMergeWarps, ...; lane l elements
// l, l + 32, ...), then the warps' partial sums are added: a thread looping over every split in
// turn waited for each load (~10 us a head at 132 splits on an H100).
constexpr int kMergeWarps = 8;

template <typename T>
__global__ void __launch_bounds__(kMergeWarps * 32)
    merge_splits_kernel(Fp8DecodeArgs a, int splits) {
  if (a.device_length != nullptr &&
      (*a.device_length < 1 || static_cast<std::size_t>(*a.device_length) > a.length))
    return;  // (the split kernel wrote NaN)
  constexpr int kMaxDim = 256, kPerLane = kMaxDim / 32;
  __shared__ float weight[kMaxSplits];
  __shared__ float reduce[kMergeWarps];
  __shared__ float part[kMergeWarps][kMaxDim];
  const std::size_t row = blockIdx.x;  // b * heads + h
  const std::size_t dim = a.head_dim;
  const float* ws_o = static_cast<const float*>(a.workspace);
  const float* lse = ws_o + a.batch * a.heads * splits * dim + row * splits;
  ws_o += row * splits * dim;
  const int lane = static_cast<int>(threadIdx.x & 31u), warp = static_cast<int>(threadIdx.x >> 5);
  const auto block_reduce = [&](float v, bool take_max) {
    for (int o = 16; o > 0; o >>= 1) {
      const float other = __shfl_xor_sync(kFull, v, o);
      v = take_max ? fmaxf(v, other) : v + other;
    }
    if (lane == 0) reduce[warp] = v;
    __syncthreads();
    v = reduce[0];
    for (int k = 1; k < kMergeWarps; ++k) v = take_max ? fmaxf(v, reduce[k]) : v + reduce[k];
    __syncthreads();  // (reduce is reused)
    return v;
  };
  float top = -INFINITY;
  for (int s = static_cast<int>(threadIdx.x); s < splits; s += blockDim.x) top = fmaxf(top, lse[s]);
  top = block_reduce(top, true);
  float sum = 0.0f;
  for (int s = static_cast<int>(threadIdx.x); s < splits; s += blockDim.x) {
    weight[s] = top > -INFINITY ? exp2f(lse[s] - top) : 0.0f;
    sum += weight[s];
  }
  const float total = block_reduce(sum, false);  // (its barriers publish weight[])
  float o[kPerLane] = {};
  for (int s = warp; s < splits; s += kMergeWarps) {
    const float ws = weight[s];
    const float* src = ws_o + static_cast<std::size_t>(s) * dim;
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) {
      const std::size_t j = static_cast<std::size_t>(lane + 32 * e);
      if (j < dim) o[e] = fmaf(ws, src[j], o[e]);
    }
  }
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) {
    const std::size_t j = static_cast<std::size_t>(lane + 32 * e);
    if (j < dim) part[warp][j] = o[e];
  }
  __syncthreads();
  const std::size_t b = row / a.heads, h = row % a.heads;
  T* out = static_cast<T*>(a.out) + static_cast<std::int64_t>(b) * a.out_stride[0] +
           static_cast<std::int64_t>(h) * a.out_stride[1];
  for (std::size_t j = threadIdx.x; j < dim; j += blockDim.x) {
    float acc = 0.0f;
#pragma unroll
    for (int k = 0; k < kMergeWarps; ++k) acc += part[k][j];
    out[j] = from_float<T>(total > 0.0f ? acc / total : 0.0f);
  }
}

using SplitKernel = void (*)(Fp8DecodeArgs, int, std::size_t);

// The split kernel for a head_dim: the tensor cores' for 64 and 128, the CUDA cores' otherwise.
template <typename T, int GP>
SplitKernel split_kernel_for(std::size_t head_dim) {
  if (head_dim == 64) return attend_split_mma_kernel<T, 64, GP>;
  if (head_dim == 128) return attend_split_mma_kernel<T, 128, GP>;
  return head_dim <= 128 ? attend_split_kernel<T, 1, GP> : attend_split_kernel<T, 2, GP>;
}

template <typename T>
SplitKernel split_kernel_typed(int gp, std::size_t head_dim) {
  switch (gp) {
    case 1: return split_kernel_for<T, 1>(head_dim);
    case 2: return split_kernel_for<T, 2>(head_dim);
    case 4: return split_kernel_for<T, 4>(head_dim);
    default: return split_kernel_for<T, 8>(head_dim);
  }
}

SplitKernel split_kernel(bool bfloat16, int gp, std::size_t head_dim) {
  return bfloat16 ? split_kernel_typed<__nv_bfloat16>(gp, head_dim)
                  : split_kernel_typed<__half>(gp, head_dim);
}

// The variants' head_dims as split_kernel tells them apart: 64, 128, other up to 128, over 128.
constexpr std::size_t kVariantDims[] = {64, 128, 96, 256};

int resident_blocks(const Fp8DecodeArgs& a) {
  // (asked once per variant: 2 types x 4 head counts x 4 head_dims)
  static std::atomic<int> known[2 * 4 * 4];
  const int gp = heads_per_block(a);
  const int dim_variant = a.head_dim == 64 ? 0 : a.head_dim == 128 ? 1 : a.head_dim < 128 ? 2 : 3;
  const int gp_variant = gp == 1 ? 0 : gp == 2 ? 1 : gp == 4 ? 2 : 3;
  std::atomic<int>& slot = known[(a.bfloat16 ? 16 : 0) + 4 * gp_variant + dim_variant];
  int blocks = slot.load(std::memory_order_relaxed);
  if (blocks == 0) {
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(
            &blocks, split_kernel(a.bfloat16, gp, a.head_dim), kWarps * 32, 0) != cudaSuccess) {
      (void)cudaGetLastError();  // (not sticky: the launch reports any real failure)
      blocks = 1;
    }
    blocks = std::max(blocks, 1);
    slot.store(blocks, std::memory_order_relaxed);
  }
  return blocks;
}

template <typename T>
cudaError_t launch_typed(const Fp8DecodeArgs& a, cudaStream_t stream) {
  const Split sp = split_of(a);
  const dim3 grid(static_cast<unsigned>(a.batch * a.kv_heads * head_groups(a)),
                  static_cast<unsigned>(sp.splits));
  split_kernel(a.bfloat16, heads_per_block(a), a.head_dim)<<<grid, kWarps * 32, 0, stream>>>(
      a, sp.splits, sp.chunk);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess || sp.splits == 1) return e;
  merge_splits_kernel<T>
      <<<static_cast<unsigned>(a.batch * a.heads), kMergeWarps * 32, 0, stream>>>(a, sp.splits);
  return cudaGetLastError();
}

bool aligned4(std::int64_t x) { return (x & 3) == 0; }

}  // namespace

cudaError_t preload_attend_fp8() {
  // (every variant: one module, but each kernel's own load under lazy loading)
  cudaFuncAttributes f{};
  cudaError_t e = cudaSuccess;
  const auto load = [&](const void* kernel) {
    if (e == cudaSuccess) e = cudaFuncGetAttributes(&f, kernel);
  };
  load(reinterpret_cast<const void*>(merge_splits_kernel<__nv_bfloat16>));
  load(reinterpret_cast<const void*>(merge_splits_kernel<__half>));
  for (const bool bf16 : {true, false})
    for (const int gp : {1, 2, 4, 8})
      for (const std::size_t dim : kVariantDims)
        load(reinterpret_cast<const void*>(split_kernel(bf16, gp, dim)));
  return e;
}

std::size_t fp8_decode_workspace_bytes(const Fp8DecodeArgs& a) {
  if (a.kv_heads == 0 || (a.device_length == nullptr && a.length <= a.first_key)) return 0;
  const Split sp = split_of(a);
  if (sp.splits == 1) return 0;
  return a.batch * a.heads * static_cast<std::size_t>(sp.splits) * (a.head_dim + 1) * sizeof(float);
}

cudaError_t launch_attend_fp8_decode(const Fp8DecodeArgs& a, cudaStream_t stream) {
  const bool graphed = a.device_length != nullptr, rows_given = a.device_rows == nullptr;
  if (a.batch == 0 || a.heads == 0 || a.kv_heads == 0 || a.heads % a.kv_heads != 0 ||
      a.head_dim == 0 || a.head_dim % 4 != 0 || a.head_dim > 256 ||
      (graphed ? a.length == 0 : a.first_key >= a.length) || a.q == nullptr || a.out == nullptr ||
      (rows_given && (a.k_rows == nullptr || a.v_rows == nullptr)) ||
      (a.k_new == nullptr) != (a.v_new == nullptr) ||
      (rows_given && (!aligned4(reinterpret_cast<std::intptr_t>(a.k_rows)) ||
                      !aligned4(reinterpret_cast<std::intptr_t>(a.v_rows)))) ||
      !aligned4(a.row_stride[0]) || !aligned4(a.row_stride[1]) || !aligned4(a.row_stride[2]))
    return cudaErrorInvalidValue;
  const std::size_t need = fp8_decode_workspace_bytes(a);
  if (need > 0 && (a.workspace == nullptr || a.workspace_bytes < need))
    return cudaErrorInvalidValue;
  return a.bfloat16 ? launch_typed<__nv_bfloat16>(a, stream) : launch_typed<__half>(a, stream);
}

}  // namespace reviva::kernels
