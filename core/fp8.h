#pragma once
// OCP FP8 E4M3 ("e4m3fn": torch.float8_e4m3fn, CUDA's __nv_fp8_e4m3, cuBLASLt's CUDA_R_8F_E4M3):
// 1 sign, 4 exponent (bias 7) and 3 mantissa bits, no infinities, S.1111.111 the only NaN.
// Largest finite 448, smallest normal 2^-6, smallest subnormal 2^-9. Encoding rounds to nearest
// even and saturates beyond ±448 (CUDA's __NV_SATFINITE, what a quantiser with a scale wants).

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace laplace {

inline constexpr float kE4M3Max = 448.f;

namespace detail {
inline float e4m3_decode(uint8_t b) {
  const float sign = (b & 0x80) ? -1.f : 1.f;
  const int e = (b >> 3) & 0xF, m = b & 0x7;
  if (e == 0xF && m == 0x7) return std::numeric_limits<float>::quiet_NaN();
  if (e == 0) return sign * std::ldexp(static_cast<float>(m), -9);  // subnormal: m·2^-9
  return sign * std::ldexp(1.f + static_cast<float>(m) / 8.f, e - 7);
}
}  // namespace detail

// A code's value (exact in F32), from a table: dequantising a model's weights decodes billions.
inline float e4m3_to_float(uint8_t b) {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int c = 0; c < 256; ++c) t[static_cast<size_t>(c)] = detail::e4m3_decode(static_cast<uint8_t>(c));
    return t;
  }();
  return table[b];
}

// What code q of a row with scale s stands for: the F32 product, rounded once. The file tool
// (fp8_dequantize_rows), the backends' dequantize_rows_e4m3 and so a weight's own copy in an
// FP8 model all give these bits.
inline float e4m3_dequantize(uint8_t q, float s) { return e4m3_to_float(q) * s; }

// On the float's bits: a normal E4M3 keeps the top 3 of F32's 23 mantissa bits, rounded to
// nearest even, and a carry out of them moves into the exponent, so the code is the rounded
// top bits less the exponent bias difference ((127 − 7) << 3); below 2^-6 the value is a
// multiple of 2^-9 (x·2^9 is exact, then rounded to an integer, ties to even).
inline uint8_t e4m3_from_float(float x) {
  uint32_t u = 0;
  std::memcpy(&u, &x, sizeof u);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return 0x7F;                   // NaN
  if (a >= 0x43E00000u) return sign | 0x7E;           // ≥ 448 (and ±inf): saturate
  if (a < 0x3C800000u) {                              // below 2^-6: subnormal (or zero)
    const float m = std::nearbyint(std::fabs(x) * 512.f);  // 0…8; 8 is the smallest normal
    return sign | static_cast<uint8_t>(m);
  }
  const uint32_t rest = a & 0xFFFFFu, half = 0x80000u;
  uint32_t top = a >> 20;  // exponent and 3 mantissa bits
  top += (rest > half || (rest == half && (top & 1u))) ? 1u : 0u;
  return sign | static_cast<uint8_t>(top - (120u << 3));  // below 448, so at most 0x7E
}

// The scale of a row (or column) whose largest magnitude is amax: amax / 448, which maps that value
// to the largest code; 1 for a row of zeros. It never goes below FLT_MIN, so that its reciprocal is
// finite (a row whose largest value is below 448·FLT_MIN, about 5e-36, keeps codes below 448).
inline float e4m3_scale(float amax) {
  return amax > 0.f ? std::fmax(amax / kE4M3Max, std::numeric_limits<float>::min()) : 1.f;
}

// One row of a per-row quantisation: s = e4m3_scale(max |x|), q[c] = e4m3(x[c] · (1/s)), the
// product rounded to F32 first. A product rather than a division: the CUDA quantisers are bound by
// their instructions, and an IEEE division costs several times a product; both backends multiply
// by the same rounded reciprocal, so they give the same codes. Returns s.
inline float e4m3_quantize_row(const float* x, int64_t n, uint8_t* q) {
  float amax = 0.f;
  for (int64_t c = 0; c < n; ++c) amax = std::fmax(amax, std::fabs(x[c]));
  const float s = e4m3_scale(amax), inv = 1.f / s;
  for (int64_t c = 0; c < n; ++c) q[c] = e4m3_from_float(x[c] * inv);
  return s;
}

}  // namespace laplace
