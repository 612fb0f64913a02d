// A decode step's attention over fp8 K/V rows read in place: split-K over the keys, then a
// merge of the splits (launchers.h; Note [fp8 decode attention] in src/fp8_attention.cpp).
// The split kernels are in attend_fp8_cuda_cores.cu and attend_fp8_tensor_cores.cu (what they
// share in attend_fp8.cuh); this file plans the splits, merges them and launches both.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>

#include "attend_fp8.cuh"
#include "half_convert.cuh"
#include "launchers.h"

namespace reviva::kernels {
namespace {

constexpr std::size_t kMinKeys = 256;  // keys per split, at least
constexpr int kMaxSplits = 1024;       // the merge kernel's shared table of splits

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

// The split kernel for a head_dim: the tensor cores' for 64 and 128, the CUDA cores' otherwise.
template <typename T, int GP>
SplitKernel split_kernel_for(std::size_t head_dim) {
  if (head_dim == 64 || head_dim == 128) return tensor_core_split_kernel<T, GP>(head_dim);
  return cuda_core_split_kernel<T, GP>(head_dim);
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
