// A decode step's row-wise operations: the argument checks and the host references
// (Backend::rms_norm_async, rotary_async, silu_mul_async; the CUDA kernels are
// kernels/row_ops.cu).
//
// Note [Decode row ops]
// ~~~~~~~~~~~~~~~~~~~~~
// A decode step of one token is bound by the bytes it reads (the weights, the K/V), but inside
// a CUDA graph every kernel also costs its launch and its tail, ~2.5-3 us on an H100 even when it
// touches 8 KB. HF's Llama layer runs ~47 kernels a step: RMSNorm alone is seven (to fp32, pow,
// mean, add, rsqrt, mul, to bf16, mul), RoPE ten (mul, slice, neg, cat, mul, add for q and k),
// the gated MLP two between its GEMMs, each residual add two. At 64k with fp8 K/V read in place
// (Note [fp8 decode attention]) those ~1200 small kernels a step took ~3 ms of a 12.5 ms step.
// These three operations replace them: RmsNorm (the residual add folded in), Rotary (q and k in
// place), SiluMul; a layer's step then runs ~20 kernels.
//
// They compute as HF's modules do, rounding where they round, so that their results are HF's:
// Rotary and SiluMul to the bit (the same fp32 products and sums, rounded the same way);
// RmsNorm's sum of squares is taken in another order than torch's reduction, so its output may
// differ from HF's by one unit in the last place of a few values. Their callers
// (python/reviva/generate/decode_ops.py) use them where that is acceptable (decode steps whose
// attention already reads fp8 K/V) and check them against the modules they replace before using
// them.
#include <cmath>
#include <cstring>
#include <vector>

#include "half_bits.h"
#include "reviva/backend.h"
#include "reviva/error.h"

namespace reviva {
namespace {

float load(HalfType type, const void* base, std::int64_t index) {
  std::uint16_t bits;
  std::memcpy(&bits, static_cast<const std::uint16_t*>(base) + index, 2);
  return type == HalfType::BFloat16 ? detail::from_bf16(bits) : detail::from_fp16(bits);
}

// fp32 rounded to `type` (nearest even), returned as the fp32 value of the result.
float round_to(HalfType type, float x) {
  return type == HalfType::BFloat16 ? detail::from_bf16(detail::to_bf16(x))
                                    : detail::from_fp16(detail::to_fp16(x));
}

void store(HalfType type, void* base, std::int64_t index, float x) {
  const std::uint16_t bits = type == HalfType::BFloat16 ? detail::to_bf16(x) : detail::to_fp16(x);
  std::memcpy(static_cast<std::uint16_t*>(base) + index, &bits, 2);
}

std::int64_t width_of(std::size_t n) { return static_cast<std::int64_t>(n); }

}  // namespace

void check_rms_norm(const RmsNorm& n) {
  if (n.rows == 0) return;
  REVIVA_CHECK_ARG(n.width > 0, "rms_norm: width must be > 0");
  REVIVA_CHECK_ARG(n.x != nullptr && n.weight != nullptr && n.out != nullptr,
                   "rms_norm: null pointer (x ", n.x, ", weight ", n.weight, ", out ", n.out, ")");
  const std::int64_t w = width_of(n.width);
  REVIVA_CHECK_ARG(n.rows == 1 || (n.x_stride >= w && n.out_stride >= w),
                   "rms_norm: row strides must be >= the width ", w, ", got x ", n.x_stride,
                   " and out ", n.out_stride);
  REVIVA_CHECK_ARG(n.residual == nullptr || n.rows == 1 || n.residual_stride >= w,
                   "rms_norm: the residual's row stride must be >= the width ", w, ", got ",
                   n.residual_stride);
  REVIVA_CHECK_ARG(n.residual == nullptr || n.residual != n.out,
                   "rms_norm: out must not be the residual (it is written with the sum)");
  REVIVA_CHECK_ARG(std::isfinite(n.eps) && n.eps >= 0.0f, "rms_norm: eps must be >= 0, got ",
                   n.eps);
}

void check_rotary(const Rotary& r) {
  if (r.batch == 0 || (r.q_heads == 0 && r.k_heads == 0)) return;
  REVIVA_CHECK_ARG(r.head_dim > 0 && r.head_dim % 2 == 0,
                   "rotary: head_dim must be even and > 0, got ", r.head_dim);
  REVIVA_CHECK_ARG((r.q_heads == 0 || r.q != nullptr) && (r.k_heads == 0 || r.k != nullptr) &&
                       r.cos != nullptr && r.sin != nullptr,
                   "rotary: null pointer (q ", r.q, ", k ", r.k, ", cos ", r.cos, ", sin ", r.sin,
                   ")");
  const std::int64_t d = width_of(r.head_dim);
  REVIVA_CHECK_ARG((r.q_heads <= 1 || r.q_stride[1] >= d) && (r.k_heads <= 1 || r.k_stride[1] >= d),
                   "rotary: head strides must be >= head_dim ", d, ", got q ", r.q_stride[1],
                   " and k ", r.k_stride[1]);
}

void check_silu_mul(const SiluMul& op) {
  if (op.rows == 0) return;
  REVIVA_CHECK_ARG(op.width > 0, "silu_mul: width must be > 0");
  REVIVA_CHECK_ARG(op.gate != nullptr && op.up != nullptr && op.out != nullptr,
                   "silu_mul: null pointer (gate ", op.gate, ", up ", op.up, ", out ", op.out, ")");
  const std::int64_t w = width_of(op.width);
  REVIVA_CHECK_ARG(op.rows == 1 || (op.gate_stride >= w && op.up_stride >= w && op.out_stride >= w),
                   "silu_mul: row strides must be >= the width ", w, ", got gate ", op.gate_stride,
                   ", up ", op.up_stride, " and out ", op.out_stride);
}

void rms_norm(const RmsNorm& n) {
  check_rms_norm(n);
  const std::int64_t w = width_of(n.width);
  std::vector<float> row(n.width);
  for (std::size_t r = 0; r < n.rows; ++r) {
    const auto i = static_cast<std::int64_t>(r);
    float sum = 0.0f;
    for (std::int64_t j = 0; j < w; ++j) {
      float v = load(n.type, n.x, i * n.x_stride + j);
      if (n.residual != nullptr) {
        v = round_to(n.type, load(n.type, n.residual, i * n.residual_stride + j) + v);
        store(n.type, n.residual, i * n.residual_stride + j, v);
      }
      row[static_cast<std::size_t>(j)] = v;
      sum += v * v;
    }
    const float inv = 1.0f / std::sqrt(sum * (1.0f / static_cast<float>(w)) + n.eps);
    for (std::int64_t j = 0; j < w; ++j) {
      const float normed = round_to(n.type, row[static_cast<std::size_t>(j)] * inv);
      store(n.type, n.out, i * n.out_stride + j, load(n.type, n.weight, j) * normed);
    }
  }
}

void rotary(const Rotary& r) {
  check_rotary(r);
  const std::int64_t half = width_of(r.head_dim / 2);
  for (std::size_t b = 0; b < r.batch; ++b) {
    const auto bi = static_cast<std::int64_t>(b);
    for (int which = 0; which < 2; ++which) {
      void* base = which == 0 ? r.q : r.k;
      const std::int64_t* stride = which == 0 ? r.q_stride : r.k_stride;
      const std::size_t heads = which == 0 ? r.q_heads : r.k_heads;
      for (std::size_t h = 0; h < heads; ++h) {
        const std::int64_t at = bi * stride[0] + static_cast<std::int64_t>(h) * stride[1];
        for (std::int64_t j = 0; j < half; ++j) {
          const float x1 = load(r.type, base, at + j);
          const float x2 = load(r.type, base, at + j + half);
          const float c1 = load(r.type, r.cos, bi * r.cos_stride + j);
          const float c2 = load(r.type, r.cos, bi * r.cos_stride + j + half);
          const float s1 = load(r.type, r.sin, bi * r.sin_stride + j);
          const float s2 = load(r.type, r.sin, bi * r.sin_stride + j + half);
          // rotate_half(x) = cat(-x2, x1)
          store(r.type, base, at + j, round_to(r.type, x1 * c1) + round_to(r.type, -x2 * s1));
          store(r.type, base, at + j + half, round_to(r.type, x2 * c2) + round_to(r.type, x1 * s2));
        }
      }
    }
  }
}

void silu_mul(const SiluMul& op) {
  check_silu_mul(op);
  const std::int64_t w = width_of(op.width);
  for (std::size_t r = 0; r < op.rows; ++r) {
    const auto i = static_cast<std::int64_t>(r);
    for (std::int64_t j = 0; j < w; ++j) {
      const float g = load(op.type, op.gate, i * op.gate_stride + j);
      const float u = load(op.type, op.up, i * op.up_stride + j);
      const float act = round_to(op.type, g / (1.0f + std::exp(-g)));
      store(op.type, op.out, i * op.out_stride + j, act * u);
    }
  }
}

}  // namespace reviva
