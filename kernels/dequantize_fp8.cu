// fp8 K/V rows to bf16 or fp16 in one kernel (see launchers.h; Note [fp8 K/V rows] in
// python/reviva/cache/fp8.py).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>

#include "half_convert.cuh"
#include "launchers.h"

namespace reviva::kernels {
namespace {

constexpr int kThreads = 256;  // 8 warps: 8 rows at a time per block
constexpr int kMaxBlocks = 8192;

// e4m3 to fp32, exactly (every e4m3 value is an fp16 value).
__device__ inline float e4m3_to_float(unsigned char b) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(b), __NV_E4M3);
  return __half2float(__half(h));
}

// One warp per row: lane l converts bytes [4l, 4l + 4) of each 128-byte stretch of the row.
template <typename Out>
__global__ void dequantize_fp8_rows_kernel(Fp8RowsArgs a, Out* __restrict__ out) {
  const std::size_t rows = a.count[0] * a.count[1] * a.count[2];
  const unsigned lane = threadIdx.x & 31u;
  const std::size_t warps = (static_cast<std::size_t>(gridDim.x) * blockDim.x) >> 5;
  std::size_t r = (static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  for (; r < rows; r += warps) {
    const std::size_t i2 = r % a.count[2];
    const std::size_t i1 = (r / a.count[2]) % a.count[1];
    const std::size_t i0 = r / (a.count[2] * a.count[1]);
    const unsigned char* row =
        static_cast<const unsigned char*>(a.base) + static_cast<std::int64_t>(i0) * a.stride[0] +
        static_cast<std::int64_t>(i1) * a.stride[1] + static_cast<std::int64_t>(i2) * a.stride[2];
    const float scale = *reinterpret_cast<const float*>(row + a.head_dim);
    Out* o = out + r * a.head_dim;
    for (std::size_t j = 4 * lane; j < a.head_dim; j += 128) {
      const uchar4 q = *reinterpret_cast<const uchar4*>(row + j);
      o[j] = from_float<Out>(e4m3_to_float(q.x) * scale);
      o[j + 1] = from_float<Out>(e4m3_to_float(q.y) * scale);
      o[j + 2] = from_float<Out>(e4m3_to_float(q.z) * scale);
      o[j + 3] = from_float<Out>(e4m3_to_float(q.w) * scale);
    }
  }
}

bool aligned4(std::int64_t x) { return (x & 3) == 0; }

}  // namespace

cudaError_t launch_dequantize_fp8_rows(const Fp8RowsArgs& args, void* out, bool bfloat16,
                                       cudaStream_t stream) {
  const std::size_t rows = args.count[0] * args.count[1] * args.count[2];
  if (rows == 0 || args.head_dim == 0) return cudaSuccess;
  if (out == nullptr || args.base == nullptr || args.head_dim % 4 != 0 ||
      !aligned4(reinterpret_cast<std::intptr_t>(args.base)) || !aligned4(args.stride[0]) ||
      !aligned4(args.stride[1]) || !aligned4(args.stride[2]))
    return cudaErrorInvalidValue;
  const std::size_t per_block = kThreads / 32;
  const int blocks =
      static_cast<int>(std::min<std::size_t>((rows + per_block - 1) / per_block, kMaxBlocks));
  if (bfloat16)
    dequantize_fp8_rows_kernel<<<blocks, kThreads, 0, stream>>>(args,
                                                                static_cast<__nv_bfloat16*>(out));
  else
    dequantize_fp8_rows_kernel<<<blocks, kThreads, 0, stream>>>(args, static_cast<__half*>(out));
  return cudaGetLastError();
}

}  // namespace reviva::kernels
