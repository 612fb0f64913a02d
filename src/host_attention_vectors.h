// The 16-lane float vectors of decode attention on the host (Note [Attention on the host] in
// host_attention.cpp): the ISA variants' tiles and widenings, rows of fp32, bf16 and fp8 (e4m3)
// loaded as fp32 vectors, the sums across lanes, and an exp the compiler vectorizes. Part of
// host_attention.cpp's kernel, the one file that includes this, and compiled with its options (no
// errno: src/CMakeLists.txt). In that file's unnamed namespace, as before the split: internal
// linkage, so the compiler inlines and lays out the kernel as it did (the same instructions, at
// -O3). Internal to src/: not installed.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include <immintrin.h>

namespace reviva {
namespace {

constexpr std::size_t kLanes = 16;  // floats in a Vec

// 16 floats. Passed by reference only: a by-value vector parameter would change the calling
// convention between the ISA variants (-Wpsabi); all of these are inlined anyway.
typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));

// (GCC 12 and Clang; without it, sums lane by lane and bf16 widened by convertvector)
#if defined(__has_builtin) && __has_builtin(__builtin_shufflevector)
#define REVIVA_HAVE_SHUFFLEVECTOR 1
#endif

[[gnu::always_inline]] inline float to_float(float v) { return v; }
[[gnu::always_inline]] inline float to_float(std::uint16_t v) {
  const std::uint32_t bits = static_cast<std::uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// e4m3 (CUDA's __NV_E4M3: no infinities, S.1111.111 is NaN) as fp32, exactly: subnormals are
// mantissa x 2^-9, normals (8 + mantissa) x 2^(exponent - 10).
constexpr float e4m3_value(unsigned b) {
  const unsigned exponent = (b >> 3) & 15, mantissa = b & 7;
  if (exponent == 15 && mantissa == 7) return std::numeric_limits<float>::quiet_NaN();
  float v = static_cast<float>(exponent == 0 ? mantissa : 8 + mantissa) / 512.0f;
  for (unsigned e = 1; e < exponent; ++e) v *= 2.0f;
  return b & 0x80 ? -v : v;
}
constexpr std::array<float, 256> kE4M3 = [] {
  std::array<float, 256> table{};
  for (unsigned b = 0; b < 256; ++b) table[b] = e4m3_value(b);
  return table;
}();
[[gnu::always_inline]] inline float to_float(std::uint8_t v) { return kE4M3[v]; }

// Whether T is an fp8 row's element: its rows end in a scale.
template <typename T>
constexpr bool kFp8 = std::is_same_v<T, std::uint8_t>;

// Elements of T per head's key or value in a token's row: fp8's has its scale after it.
template <typename T>
constexpr std::size_t head_row(std::size_t D) {
  return kFp8<T> ? D + sizeof(float) : D;
}

// The scale of the fp8 row whose first element is at p (head_dim D).
[[gnu::always_inline]] inline float row_scale(const std::uint8_t* p, std::size_t D) {
  float scale;
  std::memcpy(&scale, p + D, sizeof scale);
  return scale;
}

// What differs between the ISA variants: tiles whose accumulators leave room in the register
// file for their operands (JT keys by 4 heads of scores, DT x kLanes of head_dim by 4 heads of
// values: 16 of 32 zmm; 8 of 16 ymm, a Vec being two), and how bf16 and e4m3 are widened. (The
// baseline's SSE registers take the AVX2 tiles, spilling some: it is there to be correct.)
enum class Fp8Widening { Zmm, Ymm, Table };  // (16 fp16 to fp32 in one zmm, two ymm, or none)
struct Avx512 {
  static constexpr std::size_t JT = 4, DT = 4;
  static constexpr bool word_permute = true;  // (AVX512BW's vpermw: one instruction)
  static constexpr Fp8Widening fp8 = Fp8Widening::Zmm;
};
struct Avx2 {
  static constexpr std::size_t JT = 1, DT = 1;
  static constexpr bool word_permute = false;  // (a 16-bit permute is element by element here)
  static constexpr Fp8Widening fp8 = Fp8Widening::Ymm;  // (F16C's vcvtph2ps)
};
struct Baseline {
  static constexpr std::size_t JT = 1, DT = 1;
  static constexpr bool word_permute = false;
  static constexpr Fp8Widening fp8 = Fp8Widening::Table;
};

// 16 e4m3 bytes as the fp16 bits of their values x 2^-8 (Note [Attention on the host]): the byte
// sign-extended and shifted by 7 has the sign in bits 15 and 14 (bit 15 kept) and the rest in
// bits 13-7, an fp16's exponent (bias 15 for e4m3's 7) and its mantissa's top bits; 0x7F and
// 0xFF get fp16's all-ones exponent, NaN.
typedef std::uint16_t Halves __attribute__((vector_size(kLanes * sizeof(std::uint16_t))));
[[gnu::always_inline]] inline void e4m3_as_halves(Halves& out, const std::uint8_t* p) {
  typedef std::int8_t Bytes __attribute__((vector_size(kLanes)));
  typedef std::int16_t Signed __attribute__((vector_size(kLanes * sizeof(std::int16_t))));
  Bytes bytes;
  std::memcpy(&bytes, p, sizeof bytes);
  const Halves x = reinterpret_cast<Halves>(__builtin_convertvector(bytes, Signed)) << 7;
  const Halves nan = reinterpret_cast<Halves>((x & 0x3F80) == 0x3F80);
  out = (x & 0xBF80) | (nan & 0x7C00);
}

// The hardware's fp16 conversions need their targets: these are inlined into the ISA variants'
// bodies (attend_range_avx512 and attend_range_avx2, whose targets include theirs) once the
// always_inline functions between are, not into those functions themselves (GCC refuses an
// always_inline function a target its caller lacks).
[[gnu::target("avx512f,avx512bw")]] inline void widen_e4m3_zmm(Vec& out, const std::uint8_t* p) {
  Halves halves;
  e4m3_as_halves(halves, p);
  __m256i h;
  std::memcpy(&h, &halves, sizeof h);
  // (maskz with every lane: _mm512_cvtph_ps's _mm512_undefined_ps is a -Wmaybe-uninitialized
  // warning in GCC 12)
  const __m512 f = _mm512_mul_ps(_mm512_maskz_cvtph_ps(0xFFFF, h), _mm512_set1_ps(256.0f));
  std::memcpy(&out, &f, sizeof out);
}
[[gnu::target("avx2,fma,f16c")]] inline void widen_e4m3_ymm(Vec& out, const std::uint8_t* p) {
  Halves halves;
  e4m3_as_halves(halves, p);
  __m128i h[2];
  std::memcpy(h, &halves, sizeof h);
  __m256 f[2];
  for (int i = 0; i < 2; ++i) f[i] = _mm256_mul_ps(_mm256_cvtph_ps(h[i]), _mm256_set1_ps(256.0f));
  std::memcpy(&out, f, sizeof out);
}

// kLanes consecutive elements as floats (unaligned).
template <typename Isa>
[[gnu::always_inline]] inline void load(Vec& out, const float* p) {
  std::memcpy(&out, p, sizeof out);
}
template <typename Isa>
[[gnu::always_inline]] inline void load(Vec& out, const std::uint16_t* p) {
  // bf16 is fp32's top half: each element below 16 zero bits.
  typedef std::uint16_t Narrow __attribute__((vector_size(kLanes * sizeof(std::uint16_t))));
  Narrow narrow;
  std::memcpy(&narrow, p, sizeof narrow);
#ifdef REVIVA_HAVE_SHUFFLEVECTOR
  if constexpr (Isa::word_permute) {
    // (GCC 12 widens with convertvector in two halves and a merge, three shuffles, not one)
    typedef std::uint16_t Words __attribute__((vector_size(2 * kLanes * sizeof(std::uint16_t))));
    const Narrow zero = {};
    const Words words =
        __builtin_shufflevector(zero, narrow, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7,
                                23, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    std::memcpy(&out, &words, sizeof out);
    return;
  }
#endif
  typedef std::uint32_t Wide __attribute__((vector_size(kLanes * sizeof(std::uint32_t))));
  const Wide wide = __builtin_convertvector(narrow, Wide) << 16;
  std::memcpy(&out, &wide, sizeof out);
}
template <typename Isa>
[[gnu::always_inline]] inline void load(Vec& out, const std::uint8_t* p) {
  if constexpr (Isa::fp8 == Fp8Widening::Zmm) {
    widen_e4m3_zmm(out, p);
  } else if constexpr (Isa::fp8 == Fp8Widening::Ymm) {
    widen_e4m3_ymm(out, p);
  } else {
    for (std::size_t i = 0; i < kLanes; ++i) out[i] = to_float(p[i]);
  }
}
[[gnu::always_inline]] inline void store(float* p, const Vec& v) { std::memcpy(p, &v, sizeof v); }

// The lanes' sum, halves first (a fixed order: the same result on every ISA).
[[gnu::always_inline]] inline float sum_lanes(const Vec& v) {
  typedef float Half __attribute__((vector_size(kLanes / 2 * sizeof(float))));
  typedef float Quarter __attribute__((vector_size(kLanes / 4 * sizeof(float))));
  Half lo, hi;
  std::memcpy(&lo, &v, sizeof lo);
  std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof lo, sizeof hi);
  const Half h = lo + hi;
  Quarter a, b;
  std::memcpy(&a, &h, sizeof a);
  std::memcpy(&b, reinterpret_cast<const char*>(&h) + sizeof a, sizeof b);
  const Quarter q = a + b;
  return (q[0] + q[2]) + (q[1] + q[3]);
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

#ifdef REVIVA_HAVE_SHUFFLEVECTOR
// The lane sums of 16 vectors v[j][h] in one vector, its lane 4h + j the sum of v[j][h], in
// 45 operations instead of 16 sum_lanes' ~200, and in sum_lanes' order (halves, quarters, then
// (0 + 2) + (1 + 3)): the same results. Each step adds pairs of lanes of two vectors at once.
// (Below, v[i] is v flattened: v[j][h] is v[4j + h].)
[[gnu::always_inline]] inline void sum_lanes_16(const Vec (&v)[4][4], Vec& out) {
  Vec x[8], z[4], u[2];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i)  // halves: x[i] = v[2i]'s 8 in lanes 0-7, v[2i+1]'s in 8-15
    x[i] = __builtin_shufflevector(v[i / 2][i % 2 * 2], v[i / 2][i % 2 * 2 + 1], 0, 1, 2, 3, 4, 5,
                                   6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(v[i / 2][i % 2 * 2], v[i / 2][i % 2 * 2 + 1], 8, 9, 10, 11, 12,
                                   13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i)  // quarters: z[i] has v[4i..4i+3]'s 4 in its four 128-bit lanes
    z[i] = __builtin_shufflevector(x[2 * i], x[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19,
                                   24, 25, 26, 27) +
           __builtin_shufflevector(x[2 * i], x[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22,
                                   23, 28, 29, 30, 31);
#pragma GCC unroll 2
  for (int i = 0; i < 2; ++i)  // (0 + 2), (1 + 3): u[i]'s 128-bit lane k has v[8i+k]'s two
    u[i] = __builtin_shufflevector(z[2 * i], z[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25,
                                   12, 13, 28, 29) +  // and v[8i+4+k]'s two
           __builtin_shufflevector(z[2 * i], z[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26,
                                   27, 14, 15, 30, 31);
  out = __builtin_shufflevector(u[0], u[1], 0, 2, 16, 18, 4, 6, 20, 22, 8, 10, 24, 26, 12, 14, 28,
                                30) +
        __builtin_shufflevector(u[0], u[1], 1, 3, 17, 19, 5, 7, 21, 23, 9, 11, 25, 27, 13, 15, 29,
                                31);
}
#endif

}  // namespace
}  // namespace reviva
