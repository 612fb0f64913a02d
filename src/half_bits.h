// The core's own conversions between fp32 and the 16-bit and fp8 formats its kernels read and
// write, for the host backend's loops (the references the CUDA kernels are tested against).
// Internal to src/: not installed.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace reviva::detail {

// e4m3 (no infinities; S.1111.111 is NaN) to fp32, exactly.
inline float e4m3_to_float(std::uint8_t b) {
  const int exponent = (b >> 3) & 15, mantissa = b & 7;
  float v;
  if (exponent == 15 && mantissa == 7)
    v = std::numeric_limits<float>::quiet_NaN();
  else if (exponent == 0)
    v = std::ldexp(static_cast<float>(mantissa), -9);
  else
    v = std::ldexp(1.0f + static_cast<float>(mantissa) / 8.0f, exponent - 7);
  return (b & 0x80) ? -v : v;
}

// fp32 in [-448, 448] to e4m3, rounded to nearest even (as torch's float8_e4m3fn conversion and
// CUDA's __nv_cvt_float_to_fp8 round); the sign of a zero is kept.
inline std::uint8_t float_to_e4m3(float x) {
  const std::uint8_t sign = std::signbit(x) ? 0x80 : 0;
  const float m = std::fabs(x);
  if (!(m > 0.0f)) return sign;
  if (m < 0x1p-6f) {  // subnormal: a multiple of 2^-9 (8 of them is the smallest normal, 0x08)
    return static_cast<std::uint8_t>(sign | static_cast<std::uint8_t>(std::nearbyint(m * 512.0f)));
  }
  int e = 0;
  const float f = std::frexp(m, &e);  // m = f * 2^e, f in [0.5, 1)
  int mantissa = static_cast<int>(std::nearbyint((2.0f * f - 1.0f) * 8.0f));  // 3 bits, rounded
  int exponent = e - 1 + 7;
  if (mantissa == 8) {
    mantissa = 0;
    ++exponent;
  }
  if (exponent > 15 || (exponent == 15 && mantissa == 7)) return sign | 0x7E;  // 448
  return static_cast<std::uint8_t>(sign | (exponent << 3) | mantissa);
}

// fp32 to bf16 bits, rounded to nearest even (a NaN stays a quiet NaN).
inline std::uint16_t to_bf16(float x) {
  std::uint32_t bits;
  std::memcpy(&bits, &x, 4);
  if (std::isnan(x)) return static_cast<std::uint16_t>((bits >> 16) | 0x40);
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<std::uint16_t>(bits >> 16);
}

inline float from_bf16(std::uint16_t b) {
  const std::uint32_t bits = static_cast<std::uint32_t>(b) << 16;
  float x;
  std::memcpy(&x, &bits, 4);
  return x;
}

// fp32 to fp16 bits, rounded to nearest even.
inline std::uint16_t to_fp16(float x) {
  const _Float16 h = static_cast<_Float16>(x);
  std::uint16_t bits;
  std::memcpy(&bits, &h, 2);
  return bits;
}

inline float from_fp16(std::uint16_t b) {
  _Float16 h;
  std::memcpy(&h, &b, 2);
  return static_cast<float>(h);
}

}  // namespace reviva::detail
