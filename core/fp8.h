#pragma once
// OCP FP8 E4M3 ("e4m3fn": torch.float8_e4m3fn, CUDA's __nv_fp8_e4m3, cuBLASLt's CUDA_R_8F_E4M3):
// 1 sign, 4 exponent (bias 7) and 3 mantissa bits, no infinities, S.1111.111 the only NaN.
// Largest finite 448, smallest normal 2^-6, smallest subnormal 2^-9. Encoding rounds to nearest
// even and saturates beyond ±448 (CUDA's __NV_SATFINITE, what a quantiser with a scale wants).

#include <cmath>
#include <cstdint>
#include <limits>

namespace laplace {

inline constexpr float kE4M3Max = 448.f;

inline float e4m3_to_float(uint8_t b) {
  const float sign = (b & 0x80) ? -1.f : 1.f;
  const int e = (b >> 3) & 0xF, m = b & 0x7;
  if (e == 0xF && m == 0x7) return std::numeric_limits<float>::quiet_NaN();
  if (e == 0) return sign * std::ldexp(static_cast<float>(m), -9);  // subnormal: m·2^-9
  return sign * std::ldexp(1.f + static_cast<float>(m) / 8.f, e - 7);
}

inline uint8_t e4m3_from_float(float x) {
  if (std::isnan(x)) return 0x7F;
  const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  const double a = std::fabs(static_cast<double>(x));
  if (a >= kE4M3Max) return sign | 0x7E;  // saturate (±inf too)
  if (a < std::ldexp(1.0, -6)) {          // subnormal (or zero): a multiple of 2^-9, ties to even
    const int m = static_cast<int>(std::nearbyint(std::ldexp(a, 9)));  // 0…8; 8 is the smallest normal
    return sign | static_cast<uint8_t>(m);
  }
  int e2 = 0;
  const double f = std::frexp(a, &e2);  // a = f·2^e2, f in [0.5, 1)
  int e = e2 - 1;                       // a = (2f)·2^e, 2f in [1, 2)
  int m = static_cast<int>(std::nearbyint((2.0 * f - 1.0) * 8.0));  // exact scaling; ties to even
  if (m == 8) {
    m = 0;
    ++e;
  }
  const int be = e + 7;  // 1…15 here
  if (be > 15 || (be == 15 && m == 7)) return sign | 0x7E;  // rounded past 448: saturate
  return sign | static_cast<uint8_t>(be << 3 | m);
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
