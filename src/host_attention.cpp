// host_decode_attention (see host_attention.h). Its vectors and their loads are
// host_attention_vectors.h's, its thread pool host_attention_pool.cpp's.
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
// done while the block is in cache (online softmax); threads take chunks of the key range (Note
// [Chunks taken as threads come free]) whose (max, sum, accumulator) are merged at the end.
//
// Laid out for the registers and the prefetchers, because a straightforward version was bound by
// neither memory nor FMAs: on one thread of the 2-core box (a Zen 4 VM, noisy), a 32k-token layer
// of bf16 took 45-55 ms (2.5-3 GB/s), now 9-12 ms (11-14 GB/s); fp32 60-70 ms, now 22-30 ms.
// - Per block and K/V head, all the query heads of its group (4 at the 8B shape) are done
//   together, so each key and value is widened to fp32 once, straight from the rows, and used by
//   every query of the group.
// - Scores: a tile of 4 heads by 4 keys keeps its 16 dot products in registers as 16-lane
//   accumulators over head_dim (a key's and a query's vector feed 4 FMAs each), summed across
//   lanes once per tile, all 16 together (sum_lanes_16). Transposing the block's keys to
//   [head_dim][key] instead, so that scores need no sums across lanes, was tried: the
//   transposition the compiler makes of it cost more than the sums it saves (2.5x this tile).
// - Weighted values: a tile of 4 heads by 64 of head_dim keeps its accumulators in registers over
//   the block's keys, the weight broadcast into 4 FMAs per value vector; the accumulators are
//   loaded and stored once per block, not per key.
// - The next block's rows are prefetched into L2 a few lines per key scored, in address order,
//   so that a block is in cache when it is done. The hardware prefetchers do not do it: one K/V
//   head's keys in a block are a row apart (4 KiB at the 8B shape, a page each), and they follow
//   runs within a page. Blocks are kBlock tokens or fewer (a long row: a batch) so that a block
//   and the next fit in L2 (kBlockBytes).
// fp8 rows (the device store's: each head's key or value is head_dim e4m3 bytes and its fp32
// scale, Note [fp8 K/V rows] in python/reviva/cache/fp8.py) are half of bf16's bytes, read as they
// are: a key's scale multiplies its scores (q.k x k_scale x scale) and a value's its weights
// (w x v_scale, after the weights' sum), key by key, where dequantizing a block into a copy would
// write the rows' bytes again and read them back, the traffic fp8 is there to save. 16 e4m3 bytes
// are widened through fp16: the sign moved to fp16's and the other 7 bits shifted by 7 are the
// fp16 bits of the value x 2^-8 exactly (e4m3's subnormals fp16's), which the hardware converts
// (vcvtph2ps) and a product by 256 undoes. (Made into fp32's bits directly, the value x 2^-120,
// e4m3's subnormals would be fp32 denormals: a microcode assist per instruction that reads one,
// on x86.) S.1111.111, e4m3's NaN, would be fp16's 1.875: it is made fp16's NaN, as the device's
// conversion makes it. The baseline widens a byte at a time from a table. On one thread of a
// 2-core EPYC VM without AVX-512 (the AVX2 variant), a 32k-token layer at the 8B shape took
// 85 ms in fp8 against 76 ms in bf16 (0.8 against 1.75 GB/s of rows): the same FMAs, and a
// widening of more instructions (of which the NaN and the product by 256 ~1% and ~2% of the
// time).
//
// The 16-lane vectors are GCC/Clang vector types: a zmm register under AVX-512, two ymm under
// AVX2, four xmm otherwise, the variant chosen by the CPU's features at the first call, with
// tiles that fit each register file; exp is exp_nonpositive, which the compiler vectorizes. No
// -ffast-math: every sum is in a fixed order, the same on every variant (bar FMA's rounding on
// the baseline).
//
// Note [Chunks taken as threads come free]
// The keys are split into kChunksPerThread chunks per thread, which the threads take one at a
// time as they finish the last (an atomic counter), each into a partial (max, sum, accumulator)
// of its own, merged in chunk order at the end: the result does not depend on which thread did
// which chunk. With one contiguous range per thread (until fb31dd2), a call took as long as its
// slowest thread, so a thread that lost its core for a while (to the process's other threads, or
// the driver's) held every other one up; now it leaves its later chunks to the others. (On the
// H200's host, with every core attending, a 32k bf16 layer took 2.9 ms a call in some decode
// calls and 4.1 ms in others at fb31dd2: the variation this is meant to remove.)
//
// Threads come from a pool made at the first call that wants more than one and grown to the
// most asked for (Note [Attention's thread pool]): the caller makes a call per layer, 32 per
// decode step at 8B, and making a thread per call and part cost tens of microseconds each.
#include "host_attention_pool.h"
#include "host_attention_vectors.h"

#include <reviva/error.h>
#include <reviva/host_attention.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace reviva {
namespace {

constexpr std::size_t kBlock = 64;               // tokens whose scores are kept at once, at most
constexpr std::size_t kBlockBytes = 512 * 1024;  // a block's rows, at most (bar a tile's keys)
constexpr std::size_t kHeads = 4;                // query heads done together (the 8B shape's group)
constexpr std::size_t kChunksPerThread = 4;      // Note [Chunks taken as threads come free]

using detail::pool;

// One thread's share: keys [t0, t1) for every sequence and head; m, l, acc per (b, h), and the
// scores (then weights) of a block for kHeads heads. Sized by the caller, before the threads
// start: the threads allocate nothing.
struct Partial {
  std::vector<float> m, l, acc, scores;
};

// Where the tiles read: the rows' geometry, and the next block's rows, which are prefetched a
// little per key scored.
struct Tile {
  std::size_t row;        // elements of T per token (bytes for fp8)
  std::size_t D;          // head_dim
  const char* ahead;      // the next block's rows not yet prefetched
  const char* ahead_end;  // their end
  std::size_t lines;      // cache lines to prefetch per key scored
};

// Prefetches the next `keys` keys' share of the next block, into L2 (L1 holds 32-48 KiB, less
// than a block).
[[gnu::always_inline]] inline void prefetch_ahead(Tile& tile, std::size_t keys) {
  if (tile.ahead >= tile.ahead_end) return;
  const std::size_t lines = tile.lines * keys;
#pragma GCC unroll 8
  for (std::size_t i = 0; i < lines; ++i) __builtin_prefetch(tile.ahead + 64 * i, 0, 1);
  tile.ahead += 64 * lines;
}

// scores[h][j] = q_h . k_j * scale for HT heads (q: HT rows of D) and JT keys from k (a row
// apart), into s[h * kBlock + j]; for fp8, q_h . k_j * k_scale_j * scale.
template <typename Isa, std::size_t HT, std::size_t JT, typename T>
[[gnu::always_inline]] inline void score_tile(const T* k, const float* q, float scale,
                                              const Tile& tile, float* s) {
  const std::size_t D = tile.D;
  Vec acc[JT][HT] = {};
  std::size_t d = 0;
  for (; d + kLanes <= D; d += kLanes) {
    Vec key[JT];
#pragma GCC unroll 16
    for (std::size_t j = 0; j < JT; ++j) load<Isa>(key[j], k + j * tile.row + d);
#pragma GCC unroll 16
    for (std::size_t h = 0; h < HT; ++h) {
      Vec query;
      load<Isa>(query, q + h * D + d);
#pragma GCC unroll 16
      for (std::size_t j = 0; j < JT; ++j) acc[j][h] += query * key[j];
    }
  }
  [[maybe_unused]] float key_scale[JT];
  if constexpr (kFp8<T>) {
#pragma GCC unroll 16
    for (std::size_t j = 0; j < JT; ++j) key_scale[j] = row_scale(k + j * tile.row, D);
  }
#ifdef REVIVA_HAVE_SHUFFLEVECTOR
  if constexpr (HT == 4 && JT == 4) {
    if (d == D) {
      Vec sums;
      sum_lanes_16(acc, sums);
      if constexpr (kFp8<T>) {  // (lane 4h + j is key j's)
        typedef float Quarter __attribute__((vector_size(4 * sizeof(float))));
        Quarter four;
        std::memcpy(&four, key_scale, sizeof four);
        sums *= __builtin_shufflevector(four, four, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3);
      }
      sums *= scale;
#pragma GCC unroll 4
      for (std::size_t h = 0; h < 4; ++h)
        std::memcpy(s + h * kBlock, reinterpret_cast<const char*>(&sums) + h * 4 * sizeof(float),
                    4 * sizeof(float));
      return;
    }
  }
#endif
#pragma GCC unroll 16
  for (std::size_t h = 0; h < HT; ++h) {
#pragma GCC unroll 16
    for (std::size_t j = 0; j < JT; ++j) {
      float sum = sum_lanes(acc[j][h]);
      for (std::size_t e = d; e < D; ++e) sum += q[h * D + e] * to_float(k[j * tile.row + e]);
      if constexpr (kFp8<T>) sum *= key_scale[j];
      s[h * kBlock + j] = sum * scale;
    }
  }
}

// acc[h][d0 + d] += sum_j w[h][j] v_j[d0 + d] for HT heads (acc: HT rows of D), n values from v
// (a row apart, at d0) and d < DT * kLanes.
template <typename Isa, std::size_t HT, std::size_t DT, typename T>
[[gnu::always_inline]] inline void value_tile(const T* v, std::size_t n, const float* w,
                                              const Tile& tile, float* acc) {
  Vec sum[HT][DT];
#pragma GCC unroll 16
  for (std::size_t h = 0; h < HT; ++h)
#pragma GCC unroll 16
    for (std::size_t c = 0; c < DT; ++c) load<Isa>(sum[h][c], acc + h * tile.D + c * kLanes);
  for (std::size_t j = 0; j < n; ++j) {
    Vec value[DT];
#pragma GCC unroll 16
    for (std::size_t c = 0; c < DT; ++c) load<Isa>(value[c], v + j * tile.row + c * kLanes);
#pragma GCC unroll 16
    for (std::size_t h = 0; h < HT; ++h) {
      const float weight = w[h * kBlock + j];
#pragma GCC unroll 16
      for (std::size_t c = 0; c < DT; ++c) sum[h][c] += weight * value[c];
    }
  }
#pragma GCC unroll 16
  for (std::size_t h = 0; h < HT; ++h)
#pragma GCC unroll 16
    for (std::size_t c = 0; c < DT; ++c) store(acc + h * tile.D + c * kLanes, sum[h][c]);
}

// One block of n tokens for HT query heads sharing a K/V head: k and v are the first token's key
// and value, q the heads' queries, m/l/acc their running maximum, sum and accumulator, s the
// block's scores, then its weights (for fp8 each times its value's scale).
template <typename Isa, std::size_t HT, typename T>
[[gnu::always_inline]] inline void attend_heads(const T* k, const T* v, std::size_t n,
                                                const float* q, float scale, Tile& tile, float* m,
                                                float* l, float* acc, float* s) {
  constexpr std::size_t JT = Isa::JT, DT = Isa::DT;
  const std::size_t D = tile.D, row = tile.row;
  std::size_t j = 0;
  for (; j + JT <= n; j += JT) {
    score_tile<Isa, HT, JT>(k + j * row, q, scale, tile, s + j);
    prefetch_ahead(tile, JT);
  }
  for (; j < n; ++j) {
    score_tile<Isa, HT, 1>(k + j * row, q, scale, tile, s + j);
    prefetch_ahead(tile, 1);
  }
  [[maybe_unused]] float value_scale[kFp8<T> ? kBlock : 1];
  if constexpr (kFp8<T>)
    for (std::size_t i = 0; i < n; ++i) value_scale[i] = row_scale(v + i * row, D);
  // (maximum, exp and sum in kLanes lanes, which the compiler vectorizes; the padding to a
  // multiple of kLanes is -inf for the maximum and 0 after the exp)
  const std::size_t padded = (n + kLanes - 1) / kLanes * kLanes;
  for (std::size_t h = 0; h < HT; ++h) {
    float* __restrict w = s + h * kBlock;
    std::fill(w + n, w + padded, -std::numeric_limits<float>::infinity());
    float lane[kLanes];
    std::fill(lane, lane + kLanes, m[h]);
    for (std::size_t i = 0; i < padded; i += kLanes)
      for (std::size_t e = 0; e < kLanes; ++e) lane[e] = std::max(lane[e], w[i + e]);
    float top = m[h];
    for (std::size_t e = 0; e < kLanes; ++e) top = std::max(top, lane[e]);
    if (top > m[h]) {
      // (0 from -inf: nothing yet)
      const float f = std::isinf(m[h]) ? 0.0f : exp_nonpositive(m[h] - top);
      float* __restrict a = acc + h * D;
      for (std::size_t d = 0; d < D; ++d) a[d] *= f;
      l[h] *= f;
      m[h] = top;
    }
    for (std::size_t i = 0; i < padded; ++i) w[i] = exp_nonpositive(w[i] - top);
    std::fill(w + n, w + padded, 0.0f);
    std::fill(lane, lane + kLanes, 0.0f);
    for (std::size_t i = 0; i < padded; i += kLanes)
      for (std::size_t e = 0; e < kLanes; ++e) lane[e] += w[i + e];
    float sum = 0.0f;
    for (std::size_t e = 0; e < kLanes; ++e) sum += lane[e];
    l[h] += sum;
    // (fp8: the weights of the values' elements, w x v_scale; the sum above is of w)
    if constexpr (kFp8<T>)
      for (std::size_t i = 0; i < n; ++i) w[i] *= value_scale[i];
  }
  std::size_t d = 0;
  for (; d + DT * kLanes <= D; d += DT * kLanes)
    value_tile<Isa, HT, DT>(v + d, n, s, tile, acc + d);
  for (; d + kLanes <= D; d += kLanes) value_tile<Isa, HT, 1>(v + d, n, s, tile, acc + d);
  for (; d < D; ++d) {  // (head_dim not a multiple of kLanes)
    for (std::size_t h = 0; h < HT; ++h) {
      float a = acc[h * D + d];
      for (std::size_t i = 0; i < n; ++i) a += s[h * kBlock + i] * to_float(v[i * row + d]);
      acc[h * D + d] = a;
    }
  }
}

template <typename Isa, typename T>
[[gnu::always_inline]] inline void attend_range_body(const T* rows, const HostAttentionShape& s,
                                                     std::size_t t0, std::size_t t1, const float* q,
                                                     float scale, Partial& part) {
  const std::size_t B = s.batch, G = s.kv_heads, H = s.heads, D = s.head_dim;
  const std::size_t per_group = H / G, head_groups = (per_group + kHeads - 1) / kHeads;
  const std::size_t RD = head_row<T>(D);
  Tile tile{2 * B * G * RD, D, nullptr, nullptr, 0};
  // Tokens per block: kBlock, or fewer where rows are long (a batch), so that a block and the
  // next one, prefetched, stay within L2.
  const std::size_t row_bytes = tile.row * sizeof(T);
  const std::size_t block =
      std::clamp<std::size_t>(kBlockBytes / row_bytes / Isa::JT * Isa::JT, Isa::JT, kBlock);
  std::fill(part.m.begin(), part.m.end(), -std::numeric_limits<float>::infinity());
  std::fill(part.l.begin(), part.l.end(), 0.0f);
  std::fill(part.acc.begin(), part.acc.end(), 0.0f);
  float* const scores = part.scores.data();
  for (std::size_t t = t0; t < t1; t += block) {
    const std::size_t n = std::min(block, t1 - t);
    const std::size_t t_next = std::min(t1, t + block), n_next = std::min(block, t1 - t_next);
    tile.ahead = reinterpret_cast<const char*>(rows + t_next * tile.row);
    tile.ahead_end = tile.ahead + n_next * row_bytes;
    tile.lines =
        (n_next * row_bytes / 64 + B * G * head_groups * n - 1) / (B * G * head_groups * n);
    for (std::size_t b = 0; b < B; ++b) {
      for (std::size_t g = 0; g < G; ++g) {
        const T* k = rows + t * tile.row + (b * G + g) * RD;
        const T* v = k + B * G * RD;
        for (std::size_t h0 = 0; h0 < per_group; h0 += kHeads) {
          const std::size_t i = b * H + g * per_group + h0;
          float *m = part.m.data() + i, *l = part.l.data() + i, *acc = part.acc.data() + i * D;
          const float* qh = q + i * D;
          switch (std::min(kHeads, per_group - h0)) {
            case 4: attend_heads<Isa, 4>(k, v, n, qh, scale, tile, m, l, acc, scores); break;
            case 3: attend_heads<Isa, 3>(k, v, n, qh, scale, tile, m, l, acc, scores); break;
            case 2: attend_heads<Isa, 2>(k, v, n, qh, scale, tile, m, l, acc, scores); break;
            default: attend_heads<Isa, 1>(k, v, n, qh, scale, tile, m, l, acc, scores); break;
          }
        }
      }
    }
  }
}

// The body compiled three times, for AVX-512 (with BW, for vpermw), AVX2 with FMA and F16C (for
// vcvtph2ps) and the baseline, chosen once by the CPU's features (not by target_clones: its
// load-time resolver crashed the ThreadSanitizer build before main).
template <typename T>
[[gnu::target("avx512f,avx512bw")]] void attend_range_avx512(const T* rows,
                                                             const HostAttentionShape& s,
                                                             std::size_t t0, std::size_t t1,
                                                             const float* q, float scale,
                                                             Partial& part) {
  attend_range_body<Avx512>(rows, s, t0, t1, q, scale, part);
}
template <typename T>
[[gnu::target("avx2,fma,f16c")]] void attend_range_avx2(const T* rows, const HostAttentionShape& s,
                                                        std::size_t t0, std::size_t t1,
                                                        const float* q, float scale,
                                                        Partial& part) {
  attend_range_body<Avx2>(rows, s, t0, t1, q, scale, part);
}
template <typename T>
void attend_range_baseline(const T* rows, const HostAttentionShape& s, std::size_t t0,
                           std::size_t t1, const float* q, float scale, Partial& part) {
  attend_range_body<Baseline>(rows, s, t0, t1, q, scale, part);
}

template <typename T>
void attend_range(const T* rows, const HostAttentionShape& s, std::size_t t0, std::size_t t1,
                  const float* q, float scale, Partial& part) {
  static const int level = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
                               ? 2
                           : __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                                   __builtin_cpu_supports("f16c")
                               ? 1
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
  REVIVA_CHECK_ARG(
      type == RowType::BFloat16 || type == RowType::Float32 || type == RowType::Fp8E4M3,
      "host_decode_attention: row type ", static_cast<int>(type), " is not a RowType");
  // (the device store's rows: each scale 4-byte aligned after head_dim bytes)
  REVIVA_CHECK_ARG(type != RowType::Fp8E4M3 || shape.head_dim % 4 == 0,
                   "host_decode_attention: head_dim ", shape.head_dim,
                   " of fp8 rows must be a multiple of 4");
  const std::size_t keys = last - first;
  const std::size_t BH = shape.batch * shape.heads, D = shape.head_dim;
  // (at least a block per thread: fewer threads for short ranges)
  const std::size_t blocks = (keys + kBlock - 1) / kBlock;
  const std::size_t n = std::min<std::size_t>(static_cast<std::size_t>(threads), blocks);
  // Note [Chunks taken as threads come free]
  const std::size_t chunks = std::min(blocks, n * kChunksPerThread);
  std::vector<Partial> parts(chunks);
  for (Partial& p : parts) {
    p.m.resize(BH);
    p.l.resize(BH);
    p.acc.resize(BH * D);
    p.scores.resize(kHeads * kBlock);
  }
  std::atomic<std::size_t> next{0};
  auto work = [&](std::size_t) {
    for (std::size_t c = next.fetch_add(1, std::memory_order_relaxed); c < chunks;
         c = next.fetch_add(1, std::memory_order_relaxed)) {
      const std::size_t t0 = first + keys * c / chunks, t1 = first + keys * (c + 1) / chunks;
      if (type == RowType::BFloat16)
        attend_range(static_cast<const std::uint16_t*>(rows), shape, t0, t1, q, scale, parts[c]);
      else if (type == RowType::Fp8E4M3)
        attend_range(static_cast<const std::uint8_t*>(rows), shape, t0, t1, q, scale, parts[c]);
      else
        attend_range(static_cast<const float*>(rows), shape, t0, t1, q, scale, parts[c]);
    }
  };
  pool().run(n, work);
  // Merge by log-sum-exp, in chunk order: out = sum_c acc_c e^(m_c - M) / sum_c l_c e^(m_c - M).
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
