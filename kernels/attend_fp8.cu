// A decode step's attention over fp8 K/V rows read in place: split-K over the keys, then a
// merge of the splits (launchers.h; Note [fp8 decode attention] in src/fp8_attention.cpp).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
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
  const std::size_t fill = std::max<std::size_t>(
      1, (static_cast<std::size_t>(std::max(a.sm_count, 1) * resident_blocks(a)) + blocks - 1) /
             blocks);
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

// Grid (batch * kv_heads * head groups, splits); kWarps warps. Attends keys [begin, end) of its
// split for GP query heads of one kv head; with one split writes `out`, else its normalized
// output and log2-sum-exp to the workspace ([batch * heads][splits][head_dim] floats, then
// [batch * heads][splits]).
template <typename T, int NV, int GP>
__global__ void __launch_bounds__(kWarps * 32)
    attend_split_kernel(Fp8DecodeArgs a, int splits, std::size_t chunk) {  // (0 when graphed)
  constexpr int kTokens = 32 / GP;                                         // per warp and round
  constexpr int kDim = 128 * NV;
  __shared__ float sm_acc[kWarps][GP][kDim];
  __shared__ float sm_m[kWarps][GP];
  __shared__ float sm_l[kWarps][GP];

  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  const std::size_t groups = (a.heads / a.kv_heads + GP - 1) / GP;
  std::size_t y = blockIdx.x;
  const std::size_t hg = y % groups;
  y /= groups;
  const std::size_t kvh = y % a.kv_heads;
  const std::size_t b = y / a.kv_heads;
  const int split = static_cast<int>(blockIdx.y);
  const std::size_t group = a.heads / a.kv_heads;
  const std::size_t g0 = hg * GP;
  const int count = static_cast<int>(min(static_cast<std::size_t>(GP), group - g0));
  // the step's keys: given, or read now (captured in a graph: its splits share them evenly)
  std::size_t length = a.length, first_key = a.first_key;
  if (a.device_length != nullptr) {
    const std::int64_t given = *a.device_length;
    if (given < 1 || static_cast<std::size_t>(given) > a.length) {  // (NaN out, rows left)
      if (split == 0) write_nan<T>(a, b, kvh * group + g0, count);
      return;
    }
    length = static_cast<std::size_t>(given);
    first_key = a.window > 0 && length > a.window ? length - a.window : 0;
    chunk = (length - first_key + splits - 1) / splits;
  }
  const std::size_t begin = min(length, first_key + static_cast<std::size_t>(split) * chunk);
  const std::size_t end = min(length, begin + chunk);
  const std::size_t dim = a.head_dim;

  unsigned char* k_rows = static_cast<unsigned char*>(a.k_rows);
  unsigned char* v_rows = static_cast<unsigned char*>(a.v_rows);
  if (a.device_rows != nullptr) {
    k_rows = reinterpret_cast<unsigned char*>(static_cast<std::uintptr_t>(a.device_rows[0]));
    v_rows = reinterpret_cast<unsigned char*>(static_cast<std::uintptr_t>(a.device_rows[1]));
  }
  unsigned char* k_base = k_rows + static_cast<std::int64_t>(b) * a.row_stride[0] +
                          static_cast<std::int64_t>(kvh) * a.row_stride[1];
  unsigned char* v_base = v_rows + static_cast<std::int64_t>(b) * a.row_stride[0] +
                          static_cast<std::int64_t>(kvh) * a.row_stride[1];

  // 1. the new token, by the block(s) whose keys end at it
  if (a.k_new != nullptr && begin < end && end == length && warp < 2) {
    const T* src = static_cast<const T*>(warp == 0 ? a.k_new : a.v_new);
    const std::int64_t* s = warp == 0 ? a.k_new_stride : a.v_new_stride;
    src += static_cast<std::int64_t>(b) * s[0] + static_cast<std::int64_t>(kvh) * s[1];
    unsigned char* row =
        (warp == 0 ? k_base : v_base) + static_cast<std::int64_t>(length - 1) * a.row_stride[2];
    quantize_row<T, NV>(src, dim, row, lane);
  }
  __syncthreads();  // (the rows written are read below by every warp of the block)

  // the queries, scaled so that exp2 of a score is exp of the model's
  float q[GP][4 * NV];
  const float qscale = a.scale * kLog2e;
#pragma unroll
  for (int g = 0; g < GP; ++g) {
    const T* qp = static_cast<const T*>(a.q) + static_cast<std::int64_t>(b) * a.q_stride[0] +
                  static_cast<std::int64_t>(kvh * group + g0 + g) * a.q_stride[1];
#pragma unroll
    for (int n = 0; n < NV; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const std::size_t j = 4 * (lane + 32 * n) + e;
        q[g][4 * n + e] = g < count && j < dim ? to_float(qp[j]) * qscale : 0.0f;
      }
  }

  // 2. this warp's rounds of kTokens keys: online softmax per head
  float m = -INFINITY;  // running max of the lane's head (lane % GP), on every lane of that head
  float l = 0.0f;       // the lane's share of the running sum
  float acc[GP][4 * NV];
#pragma unroll
  for (int g = 0; g < GP; ++g)
#pragma unroll
    for (int e = 0; e < 4 * NV; ++e) acc[g][e] = 0.0f;

  // One round's rows in registers: lane l holds 4 NV bytes of each of the round's kTokens keys
  // and values, and the scales of its own token (lane l's token is l / GP). The next round's
  // loads are issued before this round computes (plain loads, not __ldg: step 1 may have
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
        r.k[t][n] = in ? *reinterpret_cast<const unsigned*>(k_base + at + j) : 0u;
        r.v[t][n] = in ? *reinterpret_cast<const unsigned*>(v_base + at + j) : 0u;
      }
    }
    const std::size_t own = base + static_cast<std::size_t>(lane / GP);
    const std::int64_t at = static_cast<std::int64_t>(own) * a.row_stride[2];
    r.k_scale = own < end ? *reinterpret_cast<const float*>(k_base + at + dim) : 0.0f;
    r.v_scale = own < end ? *reinterpret_cast<const float*>(v_base + at + dim) : 0.0f;
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

    // 3. the block's warps merged
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
  float* ws_o = static_cast<float*>(a.workspace);
  float* ws_lse = ws_o == nullptr ? nullptr : ws_o + a.batch * a.heads * splits * dim;
  for (std::size_t i = threadIdx.x; i < static_cast<std::size_t>(count) * dim; i += blockDim.x) {
    const std::size_t g = i / dim, j = i % dim;
    float top = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) top = fmaxf(top, sm_m[w][g]);
    float sum = 0.0f, o = 0.0f;
    if (top > -INFINITY) {
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float f = exp2f(sm_m[w][g] - top);
        sum = fmaf(sm_l[w][g], f, sum);
        o = fmaf(sm_acc[w][g][j], f, o);
      }
    }
    const std::size_t h = kvh * group + g0 + g;
    const float value = sum > 0.0f ? o / sum : 0.0f;
    if (splits == 1) {
      T* out = static_cast<T*>(a.out) + static_cast<std::int64_t>(b) * a.out_stride[0] +
               static_cast<std::int64_t>(h) * a.out_stride[1];
      out[j] = from_float<T>(value);
    } else {
      const std::size_t row = (b * a.heads + h) * splits + split;
      ws_o[row * dim + j] = value;
      if (j == 0) ws_lse[row] = sum > 0.0f ? top + log2f(sum) : -INFINITY;
    }
  }
}

// Grid batch * heads; merges the splits' outputs by their log2-sum-exp into `out`.
template <typename T>
__global__ void __launch_bounds__(128) merge_splits_kernel(Fp8DecodeArgs a, int splits) {
  if (a.device_length != nullptr &&
      (*a.device_length < 1 || static_cast<std::size_t>(*a.device_length) > a.length))
    return;  // (the split kernel wrote NaN)
  __shared__ float weight[kMaxSplits];
  __shared__ float total;
  const std::size_t row = blockIdx.x;  // b * heads + h
  const std::size_t dim = a.head_dim;
  const float* ws_o = static_cast<const float*>(a.workspace);
  const float* lse = ws_o + a.batch * a.heads * splits * dim + row * splits;
  ws_o += row * splits * dim;
  float top = -INFINITY;
  for (int s = 0; s < splits; ++s) top = fmaxf(top, lse[s]);
  for (int s = static_cast<int>(threadIdx.x); s < splits; s += blockDim.x)
    weight[s] = top > -INFINITY ? exp2f(lse[s] - top) : 0.0f;
  __syncthreads();
  if (threadIdx.x == 0) {
    float sum = 0.0f;
    for (int s = 0; s < splits; ++s) sum += weight[s];
    total = sum;
  }
  __syncthreads();
  const std::size_t b = row / a.heads, h = row % a.heads;
  T* out = static_cast<T*>(a.out) + static_cast<std::int64_t>(b) * a.out_stride[0] +
           static_cast<std::int64_t>(h) * a.out_stride[1];
  for (std::size_t j = threadIdx.x; j < dim; j += blockDim.x) {
    float o = 0.0f;
    for (int s = 0; s < splits; ++s) o = fmaf(weight[s], ws_o[s * dim + j], o);
    out[j] = from_float<T>(total > 0.0f ? o / total : 0.0f);
  }
}

template <typename T, int NV, int GP>
int occupancy() {
  static const int blocks = [] {
    int n = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, attend_split_kernel<T, NV, GP>,
                                                      kWarps * 32, 0) != cudaSuccess) {
      (void)cudaGetLastError();  // (not sticky: the launch reports any real failure)
      n = 1;
    }
    return std::max(n, 1);
  }();
  return blocks;
}

template <typename T, int NV>
int occupancy_by_heads(const Fp8DecodeArgs& a) {
  switch (heads_per_block(a)) {
    case 1: return occupancy<T, NV, 1>();
    case 2: return occupancy<T, NV, 2>();
    case 4: return occupancy<T, NV, 4>();
    default: return occupancy<T, NV, 8>();
  }
}

int resident_blocks(const Fp8DecodeArgs& a) {
  if (a.bfloat16)
    return a.head_dim <= 128 ? occupancy_by_heads<__nv_bfloat16, 1>(a)
                             : occupancy_by_heads<__nv_bfloat16, 2>(a);
  return a.head_dim <= 128 ? occupancy_by_heads<__half, 1>(a) : occupancy_by_heads<__half, 2>(a);
}

template <typename T, int NV, int GP>
cudaError_t launch_split(const Fp8DecodeArgs& a, const Split& sp, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(a.batch * a.kv_heads * head_groups(a)),
                  static_cast<unsigned>(sp.splits));
  attend_split_kernel<T, NV, GP><<<grid, kWarps * 32, 0, stream>>>(a, sp.splits, sp.chunk);
  return cudaGetLastError();
}

template <typename T, int NV>
cudaError_t launch_by_heads(const Fp8DecodeArgs& a, const Split& sp, cudaStream_t stream) {
  switch (heads_per_block(a)) {
    case 1: return launch_split<T, NV, 1>(a, sp, stream);
    case 2: return launch_split<T, NV, 2>(a, sp, stream);
    case 4: return launch_split<T, NV, 4>(a, sp, stream);
    default: return launch_split<T, NV, 8>(a, sp, stream);
  }
}

template <typename T>
cudaError_t launch_typed(const Fp8DecodeArgs& a, cudaStream_t stream) {
  const Split sp = split_of(a);
  const cudaError_t e = a.head_dim <= 128 ? launch_by_heads<T, 1>(a, sp, stream)
                                          : launch_by_heads<T, 2>(a, sp, stream);
  if (e != cudaSuccess || sp.splits == 1) return e;
  merge_splits_kernel<T>
      <<<static_cast<unsigned>(a.batch * a.heads), 128, 0, stream>>>(a, sp.splits);
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
  load(reinterpret_cast<const void*>(attend_split_kernel<__nv_bfloat16, 1, 1>));
  load(reinterpret_cast<const void*>(attend_split_kernel<__nv_bfloat16, 1, 2>));
  load(reinterpret_cast<const void*>(attend_split_kernel<__nv_bfloat16, 1, 4>));
  load(reinterpret_cast<const void*>(attend_split_kernel<__nv_bfloat16, 1, 8>));
  load(reinterpret_cast<const void*>(attend_split_kernel<__nv_bfloat16, 2, 1>));
  load(reinterpret_cast<const void*>(attend_split_kernel<__nv_bfloat16, 2, 2>));
  load(reinterpret_cast<const void*>(attend_split_kernel<__nv_bfloat16, 2, 4>));
  load(reinterpret_cast<const void*>(attend_split_kernel<__nv_bfloat16, 2, 8>));
  load(reinterpret_cast<const void*>(attend_split_kernel<__half, 1, 1>));
  load(reinterpret_cast<const void*>(attend_split_kernel<__half, 1, 2>));
  load(reinterpret_cast<const void*>(attend_split_kernel<__half, 1, 4>));
  load(reinterpret_cast<const void*>(attend_split_kernel<__half, 1, 8>));
  load(reinterpret_cast<const void*>(attend_split_kernel<__half, 2, 1>));
  load(reinterpret_cast<const void*>(attend_split_kernel<__half, 2, 2>));
  load(reinterpret_cast<const void*>(attend_split_kernel<__half, 2, 4>));
  load(reinterpret_cast<const void*>(attend_split_kernel<__half, 2, 8>));
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
