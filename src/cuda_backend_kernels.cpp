// CudaBackend's work queued on a stream (see cuda_backend_impl.h): copies, memsets and the
// library's kernels (segment copies, fp8 rows, fp8 decode attention, row gathers, RMSNorm, rotary,
// SiLU x up), each launched with the backend's device current and its status checked.
#include "cuda_backend_impl.h"
#include "launchers.h"

#include <cstddef>

namespace reviva::detail {
namespace {

static_assert(sizeof(CopySegment) == sizeof(kernels::CopySegment) &&
                  offsetof(CopySegment, src) == offsetof(kernels::CopySegment, src) &&
                  offsetof(CopySegment, dst) == offsetof(kernels::CopySegment, dst) &&
                  offsetof(CopySegment, bytes) == offsetof(kernels::CopySegment, bytes),
              "reviva::CopySegment and kernels::CopySegment must share one layout");

kernels::Fp8DecodeArgs fp8_decode_args(const Fp8DecodeAttention& a, int sm_count) {
  kernels::Fp8DecodeArgs k{};
  k.bfloat16 = a.type == HalfType::BFloat16;
  k.batch = a.batch;
  k.heads = a.heads;
  k.kv_heads = a.kv_heads;
  k.head_dim = a.head_dim;
  k.q = a.q;
  k.k_new = a.k_new;
  k.v_new = a.v_new;
  k.k_rows = a.k_rows;
  k.v_rows = a.v_rows;
  for (int d = 0; d < 2; ++d) {
    k.q_stride[d] = a.q_stride[d];
    k.k_new_stride[d] = a.k_new_stride[d];
    k.v_new_stride[d] = a.v_new_stride[d];
    k.out_stride[d] = a.out_stride[d];
  }
  for (int d = 0; d < 3; ++d) k.row_stride[d] = a.row_stride[d];
  k.first_key = a.first_key;
  k.length = a.length;
  k.device_length = a.device_length;
  k.device_rows = a.device_rows;
  k.window = a.window;
  k.scale = a.scale;
  k.out = a.out;
  k.workspace = a.workspace;
  k.workspace_bytes = a.workspace_bytes;
  k.sm_count = sm_count;
  return k;
}

}  // namespace

void CudaBackend::copy_async(void* dst, const void* src, std::size_t bytes, StreamHandle stream) {
  REVIVA_CHECK_ARG(dst != nullptr && src != nullptr, "copy_async: null pointer");
  REVIVA_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, as_stream(stream)));
}

void CudaBackend::copy_segments_async(const CopySegment* segments, std::size_t count,
                                      StreamHandle stream) {
  REVIVA_CHECK_ARG(segments != nullptr || count == 0, "copy_segments_async: null segments");
  DeviceGuard guard(device_);
  REVIVA_CUDA_CHECK(kernels::launch_copy_segments(
      reinterpret_cast<const kernels::CopySegment*>(segments), count, as_stream(stream)));
}

void CudaBackend::dequantize_fp8_rows_async(const Fp8Rows& rows, void* out, HalfType type,
                                            StreamHandle stream) {
  check_fp8_rows(rows, out);
  DeviceGuard guard(device_);
  kernels::Fp8RowsArgs args{rows.base,
                            {rows.count[0], rows.count[1], rows.count[2]},
                            {rows.stride[0], rows.stride[1], rows.stride[2]},
                            rows.head_dim};
  REVIVA_CUDA_CHECK(kernels::launch_dequantize_fp8_rows(args, out, type == HalfType::BFloat16,
                                                        as_stream(stream)));
}

void CudaBackend::attend_fp8_decode_async(const Fp8DecodeAttention& attention,
                                          StreamHandle stream) {
  check_fp8_decode_attention(attention);
  const kernels::Fp8DecodeArgs args = fp8_decode_args(attention, sm_count_);
  const std::size_t need = kernels::fp8_decode_workspace_bytes(args);
  REVIVA_CHECK_ARG(
      need == 0 || (attention.workspace != nullptr && attention.workspace_bytes >= need),
      "attend_fp8_decode: a workspace of ", need, " bytes is needed, got ",
      attention.workspace_bytes, " at ", attention.workspace);
  DeviceGuard guard(device_);
  REVIVA_CUDA_CHECK(kernels::launch_attend_fp8_decode(args, as_stream(stream)));
}

std::size_t CudaBackend::fp8_decode_workspace_bytes(const Fp8DecodeAttention& attention) const {
  DeviceGuard guard(device_);  // (the splits follow the kernel's occupancy on this device)
  return kernels::fp8_decode_workspace_bytes(fp8_decode_args(attention, sm_count_));
}

// The table may be pinned host memory: with unified addressing its host pointer is the
// device's (Note [Pinning by registration]: registered only where the device can use it so).
void CudaBackend::gather_rows_async(const RowGather& gather, StreamHandle stream) {
  check_row_gather(gather);
  DeviceGuard guard(device_);
  const kernels::RowGatherArgs args{gather.table, gather.rows,  gather.row_bytes,
                                    gather.ids,   gather.count, gather.out};
  REVIVA_CUDA_CHECK(kernels::launch_gather_rows(args, as_stream(stream)));
}

void CudaBackend::rms_norm_async(const RmsNorm& n, StreamHandle stream) {
  check_rms_norm(n);
  DeviceGuard guard(device_);
  const kernels::RmsNormArgs args{n.type == HalfType::BFloat16,
                                  n.rows,
                                  n.width,
                                  n.x,
                                  n.x_stride,
                                  n.residual,
                                  n.residual_stride,
                                  n.weight,
                                  n.eps,
                                  n.out,
                                  n.out_stride};
  REVIVA_CUDA_CHECK(kernels::launch_rms_norm(args, as_stream(stream)));
}

void CudaBackend::rotary_async(const Rotary& r, StreamHandle stream) {
  check_rotary(r);
  DeviceGuard guard(device_);
  const kernels::RotaryArgs args{r.type == HalfType::BFloat16,
                                 r.batch,
                                 r.q_heads,
                                 r.k_heads,
                                 r.head_dim,
                                 r.q,
                                 {r.q_stride[0], r.q_stride[1]},
                                 r.k,
                                 {r.k_stride[0], r.k_stride[1]},
                                 r.cos,
                                 r.sin,
                                 r.cos_stride,
                                 r.sin_stride};
  REVIVA_CUDA_CHECK(kernels::launch_rotary(args, as_stream(stream)));
}

void CudaBackend::silu_mul_async(const SiluMul& op, StreamHandle stream) {
  check_silu_mul(op);
  DeviceGuard guard(device_);
  const kernels::SiluMulArgs args{op.type == HalfType::BFloat16,
                                  op.rows,
                                  op.width,
                                  op.gate,
                                  op.gate_stride,
                                  op.up,
                                  op.up_stride,
                                  op.out,
                                  op.out_stride};
  REVIVA_CUDA_CHECK(kernels::launch_silu_mul(args, as_stream(stream)));
}

void CudaBackend::memset_async(void* dst, int value, std::size_t bytes, StreamHandle stream) {
  REVIVA_CHECK_ARG(dst != nullptr, "memset_async: null pointer");
  REVIVA_CUDA_CHECK(cudaMemsetAsync(dst, value, bytes, as_stream(stream)));
}

}  // namespace reviva::detail
