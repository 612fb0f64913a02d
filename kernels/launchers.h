// Launchers of the CUDA kernels the core owns. Each takes raw pointers, sizes and an explicit
// stream, and returns the launch status; none of them uses the default stream or includes torch.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace reviva::kernels {

// One segment of a coalesced copy. Either side may be device memory or mapped pinned host
// memory (with unified addressing, pinned host pointers are valid in kernels).
struct CopySegment {
  const void* src;
  void* dst;
  std::size_t bytes;
};

// Copies `count` independent segments in one launch: the way many small copies become one
// operation instead of `count` DMA submissions, each with its own fixed cost.
// `segments` must be readable by the device (device memory or mapped pinned host memory) and
// stay valid until the launch completes on `stream`.
cudaError_t launch_copy_segments(const CopySegment* segments,  // [count]
                                 std::size_t count, cudaStream_t stream);

// Loads the segment-copy kernel now. Under CUDA's lazy module loading (the default since CUDA
// 12) a kernel's first launch loads its module, which can wait for work in flight on the device;
// called once when a backend is made, so that no copy pays that mid-stream.
cudaError_t preload_copy_segments();

// fp8 K/V rows (layout shared with reviva::Fp8Rows): head_dim e4m3 bytes then an fp32 scale
// per row, rows indexed [count0][count1][count2] by byte strides from `base`.
struct Fp8RowsArgs {
  const void* base;
  std::size_t count[3];
  std::int64_t stride[3];
  std::size_t head_dim;
};

// Writes the rows' values times their scales, contiguous [count0][count1][count2][head_dim],
// as bf16 (`bfloat16`) or fp16, rounded to nearest even; one warp per row. cudaErrorInvalidValue
// when head_dim, `base` or a stride is not a multiple of 4 (the scale is read as one fp32).
cudaError_t launch_dequantize_fp8_rows(const Fp8RowsArgs& args, void* out, bool bfloat16,
                                       cudaStream_t stream);

// Table rows by index (layout shared with reviva::RowGather): row i of `out` is row ids[i] of
// `table` (device memory, or pinned host memory read in place), zeros for an index outside
// [0, rows); one block per row at a time, 16-byte accesses where every address allows.
struct RowGatherArgs {
  const void* table;
  std::size_t rows;
  std::size_t row_bytes;
  const std::int64_t* ids;
  std::size_t count;
  void* out;
};

cudaError_t launch_gather_rows(const RowGatherArgs& args, cudaStream_t stream);

// A decode step's attention over fp8 K/V rows read in place (layout shared with
// reviva::Fp8DecodeAttention, whose comments say what each field holds; Note [fp8 decode
// attention] in src/fp8_attention.cpp).
struct Fp8DecodeArgs {
  bool bfloat16;  // q, k_new, v_new and out are bf16 (else fp16)
  std::size_t batch, heads, kv_heads, head_dim;
  const void* q;  // [batch][heads][head_dim]
  std::int64_t q_stride[2];
  const void* k_new;  // [batch][kv_heads][head_dim] or null
  const void* v_new;
  std::int64_t k_new_stride[2];
  std::int64_t v_new_stride[2];
  void* k_rows;  // [batch][kv_heads][tokens] rows of head_dim + 4 bytes
  void* v_rows;
  std::int64_t row_stride[3];  // bytes
  std::size_t first_key, length;
  const std::int64_t* device_length;  // or null (captured in a graph: length read at run time)
  const std::uint64_t* device_rows;   // or null (k_rows, v_rows read at run time)
  std::size_t window;                 // with device_length: first key = length - window (0: none)
  float scale;
  void* out;  // [batch][heads][head_dim]
  std::int64_t out_stride[2];
  void* workspace;
  std::size_t workspace_bytes;
  int sm_count;  // the device's multiprocessors (how many splits fill it)
};

// Bytes of workspace launch_attend_fp8_decode needs for these arguments (0: one split).
std::size_t fp8_decode_workspace_bytes(const Fp8DecodeArgs& args);
// cudaErrorInvalidValue when the arguments break the layout above (checked first by the
// backend, which names the value) or the workspace is smaller than fp8_decode_workspace_bytes.
cudaError_t launch_attend_fp8_decode(const Fp8DecodeArgs& args, cudaStream_t stream);
// Loads the fp8 decode attention's kernels now (as preload_copy_segments): their first launch
// may be inside a CUDA graph's capture (Note [fp8 attention in the decode graphs]).
cudaError_t preload_attend_fp8();

// A decode step's row operations (layouts shared with reviva::RmsNorm, Rotary and SiluMul,
// whose comments say what each field holds; Note [Decode row ops] in src/row_ops.cpp). Element
// strides; q/k, x/residual/out and gate/up/out are bf16 (`bfloat16`) or fp16, as are the weight
// and cos/sin. cudaErrorInvalidValue on a null operand or an odd head_dim (checked first, and
// named, by the backend).
struct RmsNormArgs {
  bool bfloat16;
  std::size_t rows, width;
  const void* x;
  std::int64_t x_stride;
  void* residual;
  std::int64_t residual_stride;
  const void* weight;
  float eps;
  void* out;
  std::int64_t out_stride;
};
struct RotaryArgs {
  bool bfloat16;
  std::size_t batch, q_heads, k_heads, head_dim;
  void* q;
  std::int64_t q_stride[2];
  void* k;
  std::int64_t k_stride[2];
  const void* cos;
  const void* sin;
  std::int64_t cos_stride, sin_stride;
};
struct SiluMulArgs {
  bool bfloat16;
  std::size_t rows, width;
  const void* gate;
  std::int64_t gate_stride;
  const void* up;
  std::int64_t up_stride;
  void* out;
  std::int64_t out_stride;
};

// One block per row (RmsNorm), one thread per pair of rotated values (Rotary), per value
// (SiluMul).
cudaError_t launch_rms_norm(const RmsNormArgs& args, cudaStream_t stream);
cudaError_t launch_rotary(const RotaryArgs& args, cudaStream_t stream);
cudaError_t launch_silu_mul(const SiluMulArgs& args, cudaStream_t stream);
// Loads the row operations' kernels now (their first launch may be inside a graph's capture).
cudaError_t preload_row_ops();

}  // namespace reviva::kernels
