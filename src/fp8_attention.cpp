// A decode step's attention over fp8 K/V rows: the argument checks and the host reference
// (Backend::attend_fp8_decode_async; the CUDA kernel is kernels/attend_fp8.cu).
//
// Note [fp8 decode attention]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// fp8 K/V (Note [fp8 K/V rows] in python/reviva/cache/fp8.py) exists to move and hold half of
// bf16's bytes. A decode step reads every key and value of a layer once, so it is bound by the
// bytes it reads; dequantizing a layer into a bf16 copy first reads the rows, writes twice their
// bytes and reads those again (three times bf16's traffic instead of half), and took 15 tok/s
// against bf16's 92 at 64k on the H200 (Llama-3-8B shape, every layer resident). So the rows are
// read where the store holds them and dequantized in registers, and one call does the step:
//   1. the new token's key and value (16-bit) are quantized into row length - 1 exactly as
//      kv_fp8.quantize does (amax x fp32(1/448) per row, e4m3 rounded to nearest even), by the
//      kernel block whose keys end there: the token's attention then reads the values every
//      later step reads;
//   2. split-K: the keys [first_key, length) are cut into splits, and each block attends one
//      split for one kv head and up to 8 of the query heads that share it (the rows read once
//      for all of them), with an online softmax in fp32; its output (normalized) and its
//      log-sum-exp go to the workspace;
//   3. a second kernel merges the splits by their log-sum-exp into `out`.
// The number of splits fills the device in one wave (the blocks an SM holds at once, rounded
// down: one block more than a wave holds runs alone after it, latency-bound; at 64k on an H100,
// 400 blocks for 396 places took 75 us a layer), each split at least 256 keys. For head_dim 64
// and 128 the blocks run on the tensor cores (Note [fp8 decode attention on the tensor cores]);
// for other head_dims on the CUDA cores: each warp takes 32 / heads-per-block tokens at a time,
// lane l holding elements [4l, 4l + 4) (and [128 + 4l, ...) for head_dim > 128) of each row, the
// partial dot products of all (token, head) pairs summed across the warp by one reduce-scatter
// (31 shuffles for 32 sums), after which lane j * heads + g holds token j's score for head g.
//
// Note [fp8 decode attention on the tensor cores]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// On the CUDA cores the kernel read a 64k layer at 1.64 TB/s on the H200 (c27175f), no faster
// than bf16's flash decode reading twice the bytes: it was bound by its instructions (per 4
// tokens, ~75 per token of dequantization, FMAs and shuffles), not by HBM. On the tensor cores a
// warp takes 16 tokens at a time for all the heads of its kv head (up to 8) with two products
// of PTX's mma.m16n8k16 (fp16 in, fp32 out):
//   S^T = Q K^T   (A: the heads' queries, rows 8-15 zero; B: 8 keys a tile, two tiles)
//   O^T += V^T P  (A: 16 elements of 16 values; B: the weights)
// and S^T's fragment (lane (g, t) holds head g's scores of tokens 2t, 2t + 1, 2t + 8, 2t + 9)
// is exactly P's as B of the second product: the softmax needs no shuffle but the max across a
// head's 4 lanes. e4m3 to fp16 is exact (one cvt per pair), and fp16 holds a bf16 query exactly
// within its range (clamped to +-65504 beyond it). The order of elements in the dot product is
// free as long as Q and K agree, and the order of a value's elements is undone when the output
// is written: so every lane reads whole 4-byte words of a row (K: bytes 16 s + 4 t for k-step s;
// V: bytes 32 k + 4 g, paired across two tokens by one byte permute per m-tile).
// The row scales: a key's scale multiplies its score in fp32; a value's cannot sit inside the
// product, so it goes into the weight, relative to the largest value scale r seen so far
// (p * v_scale / r in [0, 1]: fp16 keeps its precision whatever the rows' scales), the output
// being kept in units of r and rescaled with the softmax's max when r grows.
//
// The host reference computes the same in fp32 with expf; the kernel uses exp2f on scores
// scaled by log2(e): they agree to fp32 rounding, not to the bit.

#include <reviva/backend.h>
#include <reviva/error.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "half_bits.h"

namespace reviva {
namespace {

float load_half(const void* base, std::int64_t index, HalfType type) {
  std::uint16_t bits;
  std::memcpy(&bits, static_cast<const std::uint8_t*>(base) + 2 * index, 2);
  return type == HalfType::BFloat16 ? detail::from_bf16(bits) : detail::from_fp16(bits);
}

void store_half(void* base, std::int64_t index, float v, HalfType type) {
  const std::uint16_t bits = type == HalfType::BFloat16 ? detail::to_bf16(v) : detail::to_fp16(v);
  std::memcpy(static_cast<std::uint8_t*>(base) + 2 * index, &bits, 2);
}

constexpr float kE4M3Max = 448.0f;

// One head's vector (head_dim floats) into a row: e4m3 values then the fp32 scale.
void quantize_row(const float* x, std::size_t head_dim, std::uint8_t* row) {
  float amax = 0.0f;
  for (std::size_t j = 0; j < head_dim; ++j) amax = std::max(amax, std::fabs(x[j]));
  const float scale = amax > 0.0f ? amax * (1.0f / kE4M3Max) : 1.0f;  // (Note [fp8 K/V rows])
  for (std::size_t j = 0; j < head_dim; ++j)
    row[j] = detail::float_to_e4m3(std::clamp(x[j] / scale, -kE4M3Max, kE4M3Max));
  std::memcpy(row + head_dim, &scale, 4);
}

std::uint8_t* row_at(void* rows, const std::int64_t* stride, std::size_t b, std::size_t h,
                     std::size_t t) {
  return static_cast<std::uint8_t*>(rows) + static_cast<std::int64_t>(b) * stride[0] +
         static_cast<std::int64_t>(h) * stride[1] + static_cast<std::int64_t>(t) * stride[2];
}

float row_value(const std::uint8_t* row, std::size_t j, std::size_t head_dim) {
  float scale;
  std::memcpy(&scale, row + head_dim, 4);
  return detail::e4m3_to_float(row[j]) * scale;
}

}  // namespace

void check_fp8_decode_attention(const Fp8DecodeAttention& a) {
  REVIVA_CHECK_ARG(a.batch > 0 && a.heads > 0 && a.kv_heads > 0,
                   "attend_fp8_decode: batch, heads and kv_heads must be > 0, got ", a.batch, ", ",
                   a.heads, ", ", a.kv_heads);
  REVIVA_CHECK_ARG(a.heads % a.kv_heads == 0, "attend_fp8_decode: ", a.heads,
                   " heads are not a multiple of ", a.kv_heads, " kv heads");
  REVIVA_CHECK_ARG(a.head_dim > 0 && a.head_dim % 4 == 0 && a.head_dim <= kFp8DecodeMaxHeadDim,
                   "attend_fp8_decode: head_dim must be a positive multiple of 4 up to ",
                   kFp8DecodeMaxHeadDim, ", got ", a.head_dim);
  const bool graphed = a.device_length != nullptr;
  REVIVA_CHECK_ARG(graphed || a.first_key < a.length,
                   "attend_fp8_decode: no keys to attend (first_key ", a.first_key, ", length ",
                   a.length, ")");
  REVIVA_CHECK_ARG(!graphed || a.length > 0,
                   "attend_fp8_decode: a capacity of 0 tokens (the most a step's length can be)");
  const bool rows = a.device_rows != nullptr || (a.k_rows != nullptr && a.v_rows != nullptr);
  REVIVA_CHECK_ARG(a.q != nullptr && a.out != nullptr && rows,
                   "attend_fp8_decode: null pointer (q ", a.q, ", out ", a.out, ", k_rows ",
                   a.k_rows, ", v_rows ", a.v_rows, ")");
  REVIVA_CHECK_ARG((a.k_new == nullptr) == (a.v_new == nullptr),
                   "attend_fp8_decode: k_new and v_new must be given together");
  const auto aligned = [](const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 4 == 0; };
  REVIVA_CHECK_ARG(a.device_rows != nullptr || (aligned(a.k_rows) && aligned(a.v_rows)),
                   "attend_fp8_decode: rows at ", a.k_rows, " and ", a.v_rows,
                   " are not 4-byte aligned (values and scales are read 4 bytes at a time)");
  for (int d = 0; d < 3; ++d)
    REVIVA_CHECK_ARG(a.row_stride[d] % 4 == 0, "attend_fp8_decode: row stride ", d, " of ",
                     a.row_stride[d], " bytes is not a multiple of 4");
  REVIVA_CHECK_ARG(std::isfinite(a.scale), "attend_fp8_decode: scale ", a.scale, " is not finite");
}

void attend_fp8_decode(const Fp8DecodeAttention& given) {
  check_fp8_decode_attention(given);
  Fp8DecodeAttention a = given;  // (the step's length and rows, where they are read at run time)
  if (a.device_length != nullptr) {
    // (read when the step runs, on the backend's stream: an impossible length is not thrown
    // from there; the step writes NaN and leaves the rows, as the CUDA kernel does)
    const std::int64_t length = *a.device_length;
    if (length < 1 || static_cast<std::size_t>(length) > a.length) {
      for (std::size_t b = 0; b < a.batch; ++b)
        for (std::size_t h = 0; h < a.heads; ++h)
          for (std::size_t j = 0; j < a.head_dim; ++j)
            store_half(a.out,
                       static_cast<std::int64_t>(b) * a.out_stride[0] +
                           static_cast<std::int64_t>(h) * a.out_stride[1] +
                           static_cast<std::int64_t>(j),
                       std::numeric_limits<float>::quiet_NaN(), a.type);
      return;
    }
    a.length = static_cast<std::size_t>(length);
    a.first_key = a.window > 0 && a.length > a.window ? a.length - a.window : 0;
  }
  if (a.device_rows != nullptr) {
    a.k_rows = reinterpret_cast<void*>(static_cast<std::uintptr_t>(a.device_rows[0]));
    a.v_rows = reinterpret_cast<void*>(static_cast<std::uintptr_t>(a.device_rows[1]));
  }
  const std::size_t d = a.head_dim, group = a.heads / a.kv_heads;
  std::vector<float> x(d);
  if (a.k_new != nullptr) {
    for (std::size_t b = 0; b < a.batch; ++b)
      for (std::size_t h = 0; h < a.kv_heads; ++h) {
        const auto at = [&](const std::int64_t* s) {
          return static_cast<std::int64_t>(b) * s[0] + static_cast<std::int64_t>(h) * s[1];
        };
        for (std::size_t j = 0; j < d; ++j)
          x[j] = load_half(a.k_new, at(a.k_new_stride) + static_cast<std::int64_t>(j), a.type);
        quantize_row(x.data(), d, row_at(a.k_rows, a.row_stride, b, h, a.length - 1));
        for (std::size_t j = 0; j < d; ++j)
          x[j] = load_half(a.v_new, at(a.v_new_stride) + static_cast<std::int64_t>(j), a.type);
        quantize_row(x.data(), d, row_at(a.v_rows, a.row_stride, b, h, a.length - 1));
      }
  }
  const std::size_t keys = a.length - a.first_key;
  std::vector<float> scores(keys), acc(d);
  for (std::size_t b = 0; b < a.batch; ++b)
    for (std::size_t h = 0; h < a.heads; ++h) {
      const std::size_t kvh = h / group;
      const std::int64_t qi = static_cast<std::int64_t>(b) * a.q_stride[0] +
                              static_cast<std::int64_t>(h) * a.q_stride[1];
      for (std::size_t j = 0; j < d; ++j)
        x[j] = load_half(a.q, qi + static_cast<std::int64_t>(j), a.type);
      float top = -std::numeric_limits<float>::infinity();
      for (std::size_t t = 0; t < keys; ++t) {
        const std::uint8_t* row = row_at(a.k_rows, a.row_stride, b, kvh, a.first_key + t);
        float s = 0.0f;
        for (std::size_t j = 0; j < d; ++j) s += x[j] * row_value(row, j, d);
        scores[t] = s * a.scale;
        top = std::max(top, scores[t]);
      }
      float total = 0.0f;
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (std::size_t t = 0; t < keys; ++t) {
        const float p = std::exp(scores[t] - top);
        total += p;
        const std::uint8_t* row = row_at(a.v_rows, a.row_stride, b, kvh, a.first_key + t);
        for (std::size_t j = 0; j < d; ++j) acc[j] += p * row_value(row, j, d);
      }
      const std::int64_t oi = static_cast<std::int64_t>(b) * a.out_stride[0] +
                              static_cast<std::int64_t>(h) * a.out_stride[1];
      for (std::size_t j = 0; j < d; ++j)
        store_half(a.out, oi + static_cast<std::int64_t>(j), acc[j] / total, a.type);
    }
}

}  // namespace reviva
