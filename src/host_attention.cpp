// host_decode_attention (see host_attention.h).
//
// Note [Attention on the host]
// A decode step of an 8B model on an 8 GB card moves ~10-13 GB over PCIe, of which 0.9 GB (fp8)
// to 2.4 GB (bf16) is K/V of the layers whose K/V is not resident (the H200 at 10ddabe:
// benchmarks/results/weights-8b-2026-12-02-10ddabe.json). Attending to that K/V where it lives,
// on the host's cores, moves a query and an output per layer instead; it pays only if the cores
// read the rows about as fast as the copies they replace would have taken (a step's K/V at the
// pace of the weights' copies: 14-27 GB/s at 32k on 16 cores). torch's CPU SDPA reads one
// decode query's K/V at 0.5 GB/s (bf16) on 2 threads here, so this is a kernel of its own: the
// rows are read once, in token order (the store's layout, a row of every sequence's keys and
// values per token), in blocks of kBlock tokens whose scores, maximum and weighted values are
// done while the block is in cache (online softmax); threads take contiguous key ranges and
// their (max, sum, accumulator) are merged at the end. Vectorized by the compiler for AVX-512,
// AVX2 or neither (chosen by the CPU's features at the first call), exp included
// (exp_nonpositive).
#include <reviva/error.h>
#include <reviva/host_attention.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <thread>
#include <vector>

namespace reviva {
namespace {

constexpr std::size_t kBlock = 32;  // tokens whose scores are kept at once

[[gnu::always_inline]] inline float bf16_to_float(std::uint16_t v) {
  const std::uint32_t bits = static_cast<std::uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// One thread's share: keys [t0, t1) for every sequence and head; m, l, acc per (b, h).
struct Partial {
  std::vector<float> m, l, acc;
};

template <typename T>
[[gnu::always_inline]] inline float load(const T* p, std::size_t i);
template <>
[[gnu::always_inline]] inline float load<float>(const float* p, std::size_t i) {
  return p[i];
}
template <>
[[gnu::always_inline]] inline float load<std::uint16_t>(const std::uint16_t* p, std::size_t i) {
  return bf16_to_float(p[i]);
}

// e^x for x <= 0 (a score less the running maximum), to ~2e-7 relative: 2^n e^r with
// |r| <= ln2/2 and a degree-6 polynomial. Plain float and integer operations, which the compiler
// vectorizes (glibc's expf is a call per value: most of this kernel's time at 32k keys).
[[gnu::always_inline]] inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);  // (e^-87 is below float's normal range: 0 from here on)
  const float n = std::floor(x * 1.44269504f + 0.5f);
  const float r = (x - n * 0.693145752f) - n * 1.42860677e-6f;  // ln 2, split in two
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const std::int32_t bits = (static_cast<std::int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// q.k in kLanes independent sums (a float sum in one order cannot be vectorized without
// -ffast-math; kLanes partial sums can, and are as accurate).
constexpr std::size_t kLanes = 16;

[[gnu::always_inline]] inline float dot(const float* __restrict a, const float* __restrict b,
                                        std::size_t n) {
  float part[kLanes] = {};
  std::size_t d = 0;
  for (; d + kLanes <= n; d += kLanes)
    for (std::size_t l = 0; l < kLanes; ++l) part[l] += a[d + l] * b[d + l];
  float sum = 0.0f;
  for (; d < n; ++d) sum += a[d] * b[d];
  for (std::size_t l = 0; l < kLanes; ++l) sum += part[l];
  return sum;
}

template <typename T>
[[gnu::always_inline]] inline void attend_range_body(const T* rows, const HostAttentionShape& s,
                                                     std::size_t t0, std::size_t t1, const float* q,
                                                     float scale, Partial& part) {
  const std::size_t B = s.batch, G = s.kv_heads, H = s.heads, D = s.head_dim;
  const std::size_t per_group = H / G;
  const std::size_t row = 2 * B * G * D;  // elements per token
  part.m.assign(B * H, -std::numeric_limits<float>::infinity());
  part.l.assign(B * H, 0.0f);
  part.acc.assign(B * H * D, 0.0f);
  float scores[kBlock];
  std::vector<float> kv(2 * kBlock * D);  // one (b, g)'s keys then values of a block, in fp32
  for (std::size_t t = t0; t < t1; t += kBlock) {
    const std::size_t n = std::min(kBlock, t1 - t);
    for (std::size_t b = 0; b < B; ++b) {
      for (std::size_t g = 0; g < G; ++g) {
        float* __restrict keys = kv.data();
        float* __restrict values = kv.data() + kBlock * D;
        for (std::size_t j = 0; j < n; ++j) {
          const T* k = rows + (t + j) * row + (b * G + g) * D;
          const T* v = k + B * G * D;
          for (std::size_t d = 0; d < D; ++d) {
            keys[j * D + d] = load(k, d);
            values[j * D + d] = load(v, d);
          }
        }
        for (std::size_t hh = 0; hh < per_group; ++hh) {
          const std::size_t h = g * per_group + hh;
          const float* qv = q + (b * H + h) * D;
          float block_max = -std::numeric_limits<float>::infinity();
          for (std::size_t j = 0; j < n; ++j) {
            scores[j] = dot(qv, keys + j * D, D) * scale;
            block_max = std::max(block_max, scores[j]);
          }
          const std::size_t i = b * H + h;
          float* __restrict acc = part.acc.data() + i * D;
          if (block_max > part.m[i]) {
            // (0 from -inf: nothing yet)
            const float f = std::isinf(part.m[i]) ? 0.0f : exp_nonpositive(part.m[i] - block_max);
            for (std::size_t d = 0; d < D; ++d) acc[d] *= f;
            part.l[i] *= f;
            part.m[i] = block_max;
          }
          float weights[kBlock];
          const float top = part.m[i];
          for (std::size_t j = 0; j < n; ++j) weights[j] = exp_nonpositive(scores[j] - top);
          for (std::size_t j = 0; j < n; ++j) {
            part.l[i] += weights[j];
            for (std::size_t d = 0; d < D; ++d) acc[d] += weights[j] * values[j * D + d];
          }
        }
      }
    }
  }
}

// The body compiled three times, for AVX-512, AVX2 with FMA and the baseline, chosen once by the
// CPU's features (not by target_clones: its load-time resolver crashed the ThreadSanitizer
// build before main).
template <typename T>
[[gnu::target("avx512f")]] void attend_range_avx512(const T* rows, const HostAttentionShape& s,
                                                    std::size_t t0, std::size_t t1, const float* q,
                                                    float scale, Partial& part) {
  attend_range_body(rows, s, t0, t1, q, scale, part);
}
template <typename T>
[[gnu::target("avx2,fma")]] void attend_range_avx2(const T* rows, const HostAttentionShape& s,
                                                   std::size_t t0, std::size_t t1, const float* q,
                                                   float scale, Partial& part) {
  attend_range_body(rows, s, t0, t1, q, scale, part);
}
template <typename T>
void attend_range_baseline(const T* rows, const HostAttentionShape& s, std::size_t t0,
                           std::size_t t1, const float* q, float scale, Partial& part) {
  attend_range_body(rows, s, t0, t1, q, scale, part);
}

template <typename T>
void attend_range(const T* rows, const HostAttentionShape& s, std::size_t t0, std::size_t t1,
                  const float* q, float scale, Partial& part) {
  static const int level = __builtin_cpu_supports("avx512f")                                 ? 2
                           : __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? 1
                                                                                             : 0;
  if (level == 2)
    attend_range_avx512(rows, s, t0, t1, q, scale, part);
  else if (level == 1)
    attend_range_avx2(rows, s, t0, t1, q, scale, part);
  else
    attend_range_baseline(rows, s, t0, t1, q, scale, part);
}

}  // namespace

void host_decode_attention(const void* rows, RowType type, const HostAttentionShape& shape,
                           std::size_t first, std::size_t last, const float* q, float scale,
                           float* out, int threads) {
  REVIVA_CHECK_ARG(rows != nullptr && q != nullptr && out != nullptr,
                   "host_decode_attention: rows, q and out must not be null");
  REVIVA_CHECK_ARG(first < last, "host_decode_attention: keys [", first, ", ", last, ") are empty");
  REVIVA_CHECK_ARG(shape.batch > 0 && shape.kv_heads > 0 && shape.head_dim > 0,
                   "host_decode_attention: batch ", shape.batch, ", kv_heads ", shape.kv_heads,
                   " and head_dim ", shape.head_dim, " must be > 0");
  REVIVA_CHECK_ARG(shape.heads > 0 && shape.heads % shape.kv_heads == 0,
                   "host_decode_attention: heads ", shape.heads,
                   " must be a positive multiple of kv_heads ", shape.kv_heads);
  REVIVA_CHECK_ARG(threads >= 1, "host_decode_attention: threads must be >= 1, got ", threads);
  const std::size_t keys = last - first;
  // (at least a block per thread: fewer threads for short ranges)
  const std::size_t n =
      std::min<std::size_t>(static_cast<std::size_t>(threads), (keys + kBlock - 1) / kBlock);
  std::vector<Partial> parts(n);
  auto work = [&](std::size_t w) {
    const std::size_t t0 = first + keys * w / n, t1 = first + keys * (w + 1) / n;
    if (type == RowType::BFloat16)
      attend_range(static_cast<const std::uint16_t*>(rows), shape, t0, t1, q, scale, parts[w]);
    else
      attend_range(static_cast<const float*>(rows), shape, t0, t1, q, scale, parts[w]);
  };
  std::vector<std::thread> pool;
  pool.reserve(n - 1);
  for (std::size_t w = 1; w < n; ++w) pool.emplace_back(work, w);
  work(0);
  for (std::thread& t : pool) t.join();
  // Merge by log-sum-exp: out = sum_w acc_w e^(m_w - M) / sum_w l_w e^(m_w - M).
  const std::size_t BH = shape.batch * shape.heads, D = shape.head_dim;
  for (std::size_t i = 0; i < BH; ++i) {
    float M = -std::numeric_limits<float>::infinity();
    for (const Partial& p : parts) M = std::max(M, p.m[i]);
    float L = 0.0f;
    float* o = out + i * D;
    std::fill(o, o + D, 0.0f);
    for (const Partial& p : parts) {
      if (p.l[i] == 0.0f) continue;
      const float f = std::exp(p.m[i] - M);
      L += p.l[i] * f;
      for (std::size_t d = 0; d < D; ++d) o[d] += p.acc[i * D + d] * f;
    }
    for (std::size_t d = 0; d < D; ++d) o[d] /= L;
  }
}

}  // namespace reviva
