// FP8 E4M3 (core/fp8.h) and FP8 weight files (model/quantize.h, `laplace quantize`).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/file_util.h"
#include "core/fp8.h"
#include "core/safetensors.h"
#include "model/config.h"
#include "model/model.h"
#include "model/quantize.h"
#include "model/state.h"
#include "ops/backend.h"
#include "tests/test_util.h"

#if LAPLACE_HAVE_CUDA
#include <cuda_fp8.h>
#endif

namespace laplace {
namespace {

bool is_nan_code(int b) { return (b & 0x7F) == 0x7F; }

TEST(Fp8E4M3, KnownValues) {
  EXPECT_EQ(e4m3_from_float(1.f), 0x38);
  EXPECT_EQ(e4m3_from_float(448.f), 0x7E);
  EXPECT_EQ(e4m3_from_float(-448.f), 0xFE);
  EXPECT_EQ(e4m3_from_float(std::ldexp(1.f, -6)), 0x08);  // smallest normal
  EXPECT_EQ(e4m3_from_float(std::ldexp(1.f, -9)), 0x01);  // smallest subnormal
  EXPECT_EQ(e4m3_from_float(0.f), 0x00);
  EXPECT_EQ(e4m3_from_float(-0.f), 0x80);
  EXPECT_EQ(e4m3_to_float(0x7E), 448.f);
  EXPECT_EQ(e4m3_to_float(0x01), std::ldexp(1.f, -9));
  EXPECT_EQ(e4m3_to_float(0x0F), 1.875f * std::ldexp(1.f, -6));  // exponent 1, mantissa 7
  EXPECT_TRUE(std::isnan(e4m3_to_float(0x7F)));
  EXPECT_TRUE(std::isnan(e4m3_to_float(0xFF)));
}

// Every code decodes and encodes back to itself (NaN aside), and the positive codes increase.
TEST(Fp8E4M3, EveryCodeRoundTripsAndOrders) {
  for (int b = 0; b < 256; ++b) {
    if (is_nan_code(b)) continue;
    EXPECT_EQ(e4m3_from_float(e4m3_to_float(static_cast<uint8_t>(b))), b) << b;
  }
  for (int b = 1; b < 0x7F; ++b)
    EXPECT_LT(e4m3_to_float(static_cast<uint8_t>(b - 1)), e4m3_to_float(static_cast<uint8_t>(b)));
}

// Halfway between two neighbours goes to the even code; a hair either side goes to the nearer.
TEST(Fp8E4M3, RoundsToNearestTiesToEven) {
  for (int b = 0; b < 0x7E; ++b) {
    const float lo = e4m3_to_float(static_cast<uint8_t>(b)), hi = e4m3_to_float(static_cast<uint8_t>(b + 1));
    const float mid = 0.5f * (lo + hi);  // exact: both have few significant bits
    const int even = (b % 2 == 0) ? b : b + 1;
    EXPECT_EQ(e4m3_from_float(mid), even) << "between " << b << " and " << b + 1;
    EXPECT_EQ(e4m3_from_float(std::nextafter(mid, lo)), b);
    EXPECT_EQ(e4m3_from_float(std::nextafter(mid, hi)), b + 1);
    EXPECT_EQ(e4m3_from_float(-mid), even | 0x80);
  }
}

TEST(Fp8E4M3, SaturatesAndKeepsNaN) {
  for (float x : {448.5f, 464.f, 500.f, 1e30f, std::numeric_limits<float>::infinity()}) {
    EXPECT_EQ(e4m3_from_float(x), 0x7E) << x;
    EXPECT_EQ(e4m3_from_float(-x), 0xFE) << x;
  }
  EXPECT_TRUE(is_nan_code(e4m3_from_float(std::numeric_limits<float>::quiet_NaN())));
  EXPECT_EQ(e4m3_from_float(std::ldexp(1.f, -10)), 0x00);         // half the smallest subnormal: ties to 0
  EXPECT_EQ(e4m3_from_float(std::ldexp(1.5f, -10)), 0x01);         // nearer 2^-9
  EXPECT_EQ(e4m3_from_float(std::ldexp(1.f, -12)), 0x00);
}

// e4m3_from_float works on the float's bits; here is the definition it must equal, on doubles
// (frexp, a rounded mantissa, a saturating check), for every float sampled across the whole range
// (every 97th bit pattern below 2^9, both signs) and for the floats within 3 ulps of every code
// and of every midpoint between neighbours.
uint8_t e4m3_by_definition(float x) {
  if (std::isnan(x)) return 0x7F;
  const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  const double a = std::fabs(static_cast<double>(x));
  if (a >= kE4M3Max) return sign | 0x7E;
  if (a < std::ldexp(1.0, -6)) return sign | static_cast<uint8_t>(std::nearbyint(std::ldexp(a, 9)));
  int e2 = 0;
  const double f = std::frexp(a, &e2);
  int e = e2 - 1;
  int m = static_cast<int>(std::nearbyint((2.0 * f - 1.0) * 8.0));
  if (m == 8) {
    m = 0;
    ++e;
  }
  const int be = e + 7;
  if (be > 15 || (be == 15 && m == 7)) return sign | 0x7E;
  return sign | static_cast<uint8_t>(be << 3 | m);
}

TEST(Fp8E4M3, BitsEncoderEqualsTheDefinition) {
  std::vector<float> xs;
  auto near = [&](float v) {
    float lo = v, hi = v;
    xs.push_back(v);
    for (int i = 0; i < 3; ++i) {
      lo = std::nextafter(lo, -1.f);
      hi = std::nextafter(hi, 1e9f);
      xs.push_back(lo);
      xs.push_back(hi);
    }
  };
  for (int b = 0; b < 0x7E; ++b) {
    const float v = e4m3_to_float(static_cast<uint8_t>(b)), w = e4m3_to_float(static_cast<uint8_t>(b + 1));
    near(v);
    near(0.5f * (v + w));
  }
  near(448.f);
  int bad = 0;
  int64_t n = 0;
  auto check = [&](float x) {
    ++n;
    for (float y : {x, -x}) {
      const int fast = e4m3_from_float(y), def = e4m3_by_definition(y);
      if (fast != def && bad++ < 10) ADD_FAILURE() << y << ": bits " << fast << ", definition " << def;
    }
  };
  for (float x : xs) check(x);
  for (uint32_t u = 0; u < 0x44000000u; u += 97) {
    float x = 0.f;
    std::memcpy(&x, &u, sizeof x);
    check(x);
  }
  for (float x : {std::numeric_limits<float>::infinity(), std::numeric_limits<float>::denorm_min(), 1e30f})
    check(x);
  EXPECT_EQ(bad, 0);
  EXPECT_GT(n, 11000000);
  EXPECT_EQ(e4m3_from_float(std::numeric_limits<float>::quiet_NaN()), 0x7F);
}

#if LAPLACE_HAVE_CUDA
// CUDA's own conversions (host side of cuda_fp8.h; no GPU needed): the same bytes for every
// float we can think of near the codes, and random ones over the whole range.
TEST(Fp8E4M3, MatchesCudaSatfiniteConversion) {
  std::vector<float> xs;
  for (int b = 0; b < 0x7F; ++b) {
    const float v = e4m3_to_float(static_cast<uint8_t>(b)), w = e4m3_to_float(static_cast<uint8_t>(b + 1));
    for (float x : {v, 0.5f * (v + w), std::nextafter(0.5f * (v + w), v), std::nextafter(0.5f * (v + w), w)}) {
      xs.push_back(x);
      xs.push_back(-x);
    }
  }
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> e(-14.f, 10.f);
  for (int i = 0; i < 100000; ++i) xs.push_back((rng() & 1 ? -1.f : 1.f) * std::exp2(e(rng)));
  for (float x : {1e30f, -1e30f, std::numeric_limits<float>::infinity(), 1e-30f}) xs.push_back(x);
  int bad = 0;
  for (float x : xs) {
    const int ours = e4m3_from_float(x), cuda = __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
    if (ours != cuda && bad++ < 10) ADD_FAILURE() << x << ": ours " << ours << ", CUDA " << cuda;
  }
  for (int b = 0; b < 256; ++b) {
    if (is_nan_code(b)) continue;
    const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(b), __NV_E4M3);
    // half → float by hand: every E4M3 value is a normal or subnormal half.
    const int s = h.x >> 15, ex = (h.x >> 10) & 0x1F, m = h.x & 0x3FF;
    const float f = (s ? -1.f : 1.f) * (ex == 0 ? std::ldexp(static_cast<float>(m), -24)
                                                : std::ldexp(1.f + static_cast<float>(m) / 1024.f, ex - 15));
    EXPECT_EQ(e4m3_to_float(static_cast<uint8_t>(b)), f) << b;
  }
}
#endif

TEST(Fp8Rows, ScalesMapEachRowsLargestToTheLargestCode) {
  const int64_t R = 5, C = 33;
  std::vector<float> w(R * C);
  std::mt19937 rng(2);
  std::normal_distribution<float> n(0.f, 0.02f);
  for (auto& x : w) x = n(rng);
  for (int64_t c = 0; c < C; ++c) w[3 * C + c] = 0.f;  // a row of zeros
  w[1 * C + 7] = -0.5f;                                 // an outlier row
  std::vector<uint8_t> q(R * C);
  std::vector<float> s(R), back(R * C);
  fp8_quantize_rows(w.data(), R, C, q.data(), s.data());
  fp8_dequantize_rows(q.data(), s.data(), R, C, back.data());
  EXPECT_EQ(s[3], 1.f);
  EXPECT_EQ(q[1 * C + 7], 0xFE);
  for (int64_t r = 0; r < R; ++r) {
    float amax = 0;
    for (int64_t c = 0; c < C; ++c) amax = std::max(amax, std::fabs(w[r * C + c]));
    for (int64_t c = 0; c < C; ++c) {
      const float x = w[r * C + c], y = back[r * C + c];
      EXPECT_EQ(y, e4m3_to_float(q[r * C + c]) * s[r]);
      // Normal codes: within half a unit of the 3-bit significand (2^-4 relative); below the
      // normal range (|x| < 2^-6·s) within half the subnormal step (2^-10·s).
      EXPECT_LE(std::fabs(y - x), std::max(std::fabs(x) * 0x1p-4f, std::ldexp(s[r], -10)) * 1.0001f)
          << r << "," << c;
    }
    if (amax > 0) {
      EXPECT_FLOAT_EQ(s[r], amax / 448.f);
    }
  }
}

// A row whose largest value is below 448·FLT_MIN keeps the scale FLT_MIN, whose reciprocal is
// finite: no code is NaN or saturated by an infinite factor, and the values come back as closely
// as E4M3's subnormal step at that scale allows. A row at the threshold maps its largest to 448.
TEST(Fp8Rows, ScalesStopAtTheSmallestNormalFloat) {
  const float tiny = std::numeric_limits<float>::min();
  const std::vector<float> w = {3e-37f, -1.5e-37f, 0.f, 7e-38f, tiny * 448.f, -tiny * 100.f, 0.f, tiny};
  std::vector<uint8_t> q(w.size());
  std::vector<float> s(2), back(w.size());
  fp8_quantize_rows(w.data(), 2, 4, q.data(), s.data());
  fp8_dequantize_rows(q.data(), s.data(), 2, 4, back.data());
  EXPECT_EQ(s[0], tiny);  // 3e-37 / 448 is below FLT_MIN
  EXPECT_EQ(s[1], tiny);  // 448·FLT_MIN / 448, exactly
  EXPECT_EQ(q[4], 0x7E);  // 448
  for (size_t i = 0; i < w.size(); ++i) {
    EXPECT_FALSE(is_nan_code(q[i])) << i;
    EXPECT_LE(std::fabs(back[i] - w[i]), std::max(std::fabs(w[i]) * 0x1p-4f, std::ldexp(tiny, -10)) * 1.0001f) << i;
  }
  EXPECT_EQ(q[0], e4m3_from_float(3e-37f * (1.f / tiny)));
}

// ---- FP8 products on the CPU backend (the reference of the CUDA backend's) ---------------------

// [R, C] F32 values ~N(0, sd) with an outlier every 97 columns (activations have outlier channels).
std::vector<float> fp8_test_values(int64_t R, int64_t C, uint64_t seed, float sd) {
  std::vector<float> v(static_cast<size_t>(R * C));
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> n(0.f, sd);
  for (int64_t i = 0; i < R * C; ++i) v[i] = n(rng) * ((i % C) % 97 == 0 ? 8.f : 1.f);
  return v;
}

TEST(Fp8Ops, CpuQuantizeRowsIsTheFilesQuantiser) {
  auto be = make_cpu_backend();
  const int64_t R = 37, C = 80;
  std::vector<float> x = fp8_test_values(R, C, 4, 1.f);
  for (int64_t c = 0; c < C; ++c) x[5 * C + c] = 0.f;  // a row of zeros: scale 1
  std::vector<uint8_t> q(R * C), want_q(R * C);
  std::vector<float> s(R), want_s(R);
  be->quantize_rows_e4m3(Tensor(x.data(), DType::kF32, {R, C}), Tensor(q.data(), DType::kF8E4M3, {R, C}),
                         Tensor(s.data(), DType::kF32, {R}));
  fp8_quantize_rows(x.data(), R, C, want_q.data(), want_s.data());
  EXPECT_EQ(q, want_q);
  EXPECT_EQ(0, std::memcmp(s.data(), want_s.data(), s.size() * sizeof(float)));
  EXPECT_EQ(s[5], 1.f);
  // F64 input quantises its values rounded to F32.
  std::vector<double> xd(x.begin(), x.end());
  std::vector<uint8_t> q2(R * C);
  std::vector<float> s2(R);
  be->quantize_rows_e4m3(Tensor(xd.data(), DType::kF64, {R, C}), Tensor(q2.data(), DType::kF8E4M3, {R, C}),
                         Tensor(s2.data(), DType::kF32, {R}));
  EXPECT_EQ(q2, want_q);
  EXPECT_TRUE(be->supports({"gemm_e4m3", DType::kF32, {}}));
  EXPECT_TRUE(be->supports({"quantize_rows_e4m3", DType::kF32, {}}));
}

// dequantize_rows_e4m3 gives every code of a row times the row's scale, the product in F32 (the
// file tool's fp8_dequantize_rows), widened exactly into F64; bad shapes are refused.
TEST(Fp8Ops, CpuDequantizeRowsIsCodeTimesScale) {
  auto be = make_cpu_backend();
  const int64_t R = 4, C = 256;
  std::vector<uint8_t> q(R * C);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c) q[r * C + c] = static_cast<uint8_t>((c + 37 * r) % 256);  // every code, every row
  std::vector<float> s = {1.f, 0.0123f, 3.7e-5f, 17.25f};
  std::vector<float> w(R * C), want(R * C);
  std::vector<double> wd(R * C);
  const Tensor qt(q.data(), DType::kF8E4M3, {R, C}), st(s.data(), DType::kF32, {R});
  be->dequantize_rows_e4m3(qt, st, Tensor(w.data(), DType::kF32, {R, C}));
  be->dequantize_rows_e4m3(qt, st, Tensor(wd.data(), DType::kF64, {R, C}));
  fp8_dequantize_rows(q.data(), s.data(), R, C, want.data());
  int nan = 0;
  for (int64_t i = 0; i < R * C; ++i) {
    const float e = e4m3_to_float(q[i]) * s[i / C];
    if (std::isnan(e)) {  // codes 0x7F and 0xFF
      ++nan;
      EXPECT_TRUE(std::isnan(w[i]) && std::isnan(wd[i]) && std::isnan(want[i])) << i;
      continue;
    }
    ASSERT_EQ(w[i], e) << i;
    ASSERT_EQ(w[i], want[i]) << i;
    ASSERT_EQ(wd[i], static_cast<double>(e)) << i;
  }
  EXPECT_EQ(nan, 2 * R);
  EXPECT_TRUE(be->supports({"dequantize_rows_e4m3", DType::kF32, {}}));
  std::vector<float> small(R * (C - 1));
  EXPECT_DEATH(be->dequantize_rows_e4m3(qt, st, Tensor(small.data(), DType::kF32, {R, C - 1})),
               "dequantize_rows_e4m3");
  EXPECT_DEATH(be->dequantize_rows_e4m3(qt, Tensor(s.data(), DType::kF32, {R - 1}), Tensor(w.data(), DType::kF32, {R, C})),
               "dequantize_rows_e4m3");
}

// y = X·Wᵀ of the dequantised operands, against a long-double sum of the same codes and scales;
// and against the unquantised product, within what E4M3's 3 mantissa bits allow.
TEST(Fp8Ops, CpuGemmIsTheProductOfTheQuantisedOperands) {
  auto be = make_cpu_backend();
  const int64_t M = 33, K = 64, N = 48;
  std::vector<float> x = fp8_test_values(M, K, 5, 1.f), w = fp8_test_values(N, K, 6, 0.02f);
  std::vector<uint8_t> xq(M * K), wq(N * K);
  std::vector<float> xs(M), ws(N), y(M * N);
  be->quantize_rows_e4m3(Tensor(x.data(), DType::kF32, {M, K}), Tensor(xq.data(), DType::kF8E4M3, {M, K}),
                         Tensor(xs.data(), DType::kF32, {M}));
  be->quantize_rows_e4m3(Tensor(w.data(), DType::kF32, {N, K}), Tensor(wq.data(), DType::kF8E4M3, {N, K}),
                         Tensor(ws.data(), DType::kF32, {N}));
  be->gemm_e4m3(Tensor(xq.data(), DType::kF8E4M3, {M, K}), Tensor(xs.data(), DType::kF32, {M}),
                Tensor(wq.data(), DType::kF8E4M3, {N, K}), Tensor(ws.data(), DType::kF32, {N}), Tensor{},
                Tensor(y.data(), DType::kF32, {M, N}), Fp8Accum::kF32);
  double err2 = 0, ref2 = 0;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      long double acc = 0, mag = 0, exact = 0;
      for (int64_t k = 0; k < K; ++k) {
        const long double t = static_cast<long double>(e4m3_to_float(xq[m * K + k])) * e4m3_to_float(wq[n * K + k]);
        acc += t;
        mag += std::fabs(t);
        exact += static_cast<long double>(x[m * K + k]) * w[n * K + k];
      }
      const double want = static_cast<double>(acc * xs[m] * ws[n]);
      const double bound = 1e-6 * static_cast<double>(mag * xs[m] * ws[n]) + 1e-30;
      ASSERT_LE(std::fabs(y[m * N + n] - want), bound) << m << "," << n;
      err2 += std::pow(y[m * N + n] - static_cast<double>(exact), 2);
      ref2 += std::pow(static_cast<double>(exact), 2);
    }
  const double rel = std::sqrt(err2 / ref2);
  EXPECT_GT(rel, 1e-4);  // the rounding is there
  EXPECT_LT(rel, 0.06);  // and no more than E4M3's
  // F64 output: the same sums, rounded to F64 instead.
  std::vector<double> yd(M * N);
  be->gemm_e4m3(Tensor(xq.data(), DType::kF8E4M3, {M, K}), Tensor(xs.data(), DType::kF32, {M}),
                Tensor(wq.data(), DType::kF8E4M3, {N, K}), Tensor(ws.data(), DType::kF32, {N}), Tensor{},
                Tensor(yd.data(), DType::kF64, {M, N}), Fp8Accum::kF32);
  for (int64_t i = 0; i < M * N; ++i) ASSERT_EQ(y[i], static_cast<float>(yd[i])) << i;
  // Fast accumulation is a permission the CPU does not use: the same bytes.
  std::vector<float> yf(M * N);
  be->gemm_e4m3(Tensor(xq.data(), DType::kF8E4M3, {M, K}), Tensor(xs.data(), DType::kF32, {M}),
                Tensor(wq.data(), DType::kF8E4M3, {N, K}), Tensor(ws.data(), DType::kF32, {N}), Tensor{},
                Tensor(yf.data(), DType::kF32, {M, N}), Fp8Accum::kFast);
  EXPECT_EQ(0, std::memcmp(yf.data(), y.data(), y.size() * sizeof(float)));
  // A residual, added before the one rounding; in place too.
  std::vector<float> r(M * N, 0.25f), yr(M * N);
  const Tensor xqt(xq.data(), DType::kF8E4M3, {M, K}), xst(xs.data(), DType::kF32, {M});
  const Tensor wqt(wq.data(), DType::kF8E4M3, {N, K}), wst(ws.data(), DType::kF32, {N});
  be->gemm_e4m3(xqt, xst, wqt, wst, Tensor(r.data(), DType::kF32, {M, N}), Tensor(yr.data(), DType::kF32, {M, N}),
                Fp8Accum::kF32);
  be->gemm_e4m3(xqt, xst, wqt, wst, Tensor(r.data(), DType::kF32, {M, N}), Tensor(r.data(), DType::kF32, {M, N}),
                Fp8Accum::kF32);
  for (int64_t i = 0; i < M * N; ++i) {
    ASSERT_EQ(yr[i], static_cast<float>(0.25 + yd[i])) << i;
    ASSERT_EQ(r[i], yr[i]) << i;
  }
}

// The CPU product's sums are exact (ops/cpu/cpu_backend.cpp: dgemm over tiles of 256 rows, whose
// sums of E4M3 products are exact in any order), so every output is, bit for bit, its exact sum
// scaled and rounded once: at shapes that cross the tiles' edges, with every code but NaN (the
// largest values and the subnormals among them), widely spread scales, a residual, F32 and F64
// outputs; a few rows (the loop) give the same bytes; the longest exact K, in tiles of 32 rows.
// And past it, the loop's order.
TEST(Fp8Ops, CpuGemmSumsAreExactAtEveryTile) {
  auto be = make_cpu_backend();
  const int64_t M = 300, K = 520, N = 270;
  std::mt19937_64 rng(21);
  auto codes = [&](int64_t n) {
    std::vector<uint8_t> q(static_cast<size_t>(n));
    for (auto& b : q) {
      do b = static_cast<uint8_t>(rng() & 0xff);
      while ((b & 0x7f) == 0x7f);  // not NaN
    }
    return q;
  };
  auto scales = [&](int64_t n) {
    std::vector<float> v(static_cast<size_t>(n));
    for (auto& x : v)
      x = std::ldexp(1.f + static_cast<float>(rng() % 1000) / 1000.f, static_cast<int>(rng() % 24) - 16);
    return v;
  };
  std::vector<uint8_t> xq = codes(M * K), wq = codes(N * K);
  std::vector<float> xs = scales(M), ws = scales(N);
  std::vector<long double> exact(static_cast<size_t>(M * N));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      long double acc = 0;  // 64 mantissa bits: these sums (below 2^48 units of 2^-18) are exact
      for (int64_t k = 0; k < K; ++k)
        acc += static_cast<long double>(e4m3_to_float(xq[m * K + k])) * e4m3_to_float(wq[n * K + k]);
      exact[static_cast<size_t>(m * N + n)] = acc;
    }
  const Tensor xqt(xq.data(), DType::kF8E4M3, {M, K}), xst(xs.data(), DType::kF32, {M});
  const Tensor wqt(wq.data(), DType::kF8E4M3, {N, K}), wst(ws.data(), DType::kF32, {N});
  auto want = [&](int64_t i, double add) {
    const double acc = static_cast<double>(exact[static_cast<size_t>(i)]);
    const double scaled = acc * static_cast<double>(xs[i / N]) * static_cast<double>(ws[i % N]);
    return add + scaled;
  };
  std::vector<float> y(M * N), r(M * N);
  for (int64_t i = 0; i < M * N; ++i) r[i] = static_cast<float>(rng() % 7) - 3.f;
  be->gemm_e4m3(xqt, xst, wqt, wst, Tensor{}, Tensor(y.data(), DType::kF32, {M, N}), Fp8Accum::kF32);
  for (int64_t i = 0; i < M * N; ++i) ASSERT_EQ(y[i], static_cast<float>(want(i, 0.0))) << i;
  std::vector<double> yd(M * N);
  be->gemm_e4m3(xqt, xst, wqt, wst, Tensor{}, Tensor(yd.data(), DType::kF64, {M, N}), Fp8Accum::kF32);
  for (int64_t i = 0; i < M * N; ++i) ASSERT_EQ(yd[i], want(i, 0.0)) << i;
  // A few rows (a decode step's shape, which loops over the codes): the same bytes as in the whole.
  for (int64_t rows : {1, 5, 15}) {
    std::vector<float> ys(rows * N);
    be->gemm_e4m3(Tensor(xq.data(), DType::kF8E4M3, {rows, K}), Tensor(xs.data(), DType::kF32, {rows}), wqt, wst,
                  Tensor{}, Tensor(ys.data(), DType::kF32, {rows, N}), Fp8Accum::kF32);
    ASSERT_EQ(0, std::memcmp(ys.data(), y.data(), ys.size() * sizeof(float))) << rows << " rows";
  }
  be->gemm_e4m3(xqt, xst, wqt, wst, Tensor(r.data(), DType::kF32, {M, N}), Tensor(y.data(), DType::kF32, {M, N}),
                Fp8Accum::kF32);
  for (int64_t i = 0; i < M * N; ++i) ASSERT_EQ(y[i], static_cast<float>(want(i, r[i]))) << i;

  // The longest exact K, in tiles of 32 rows (32 MB of values each): the rows alone (the loop)
  // give the same bytes as the whole product (dgemm), and those are the exact sums.
  {
    const int64_t M3 = 40, N3 = 36, K3 = (int64_t{1} << 17) - 16;
    std::vector<uint8_t> xq3 = codes(M3 * K3), wq3 = codes(N3 * K3);
    std::vector<float> y3(M3 * N3), y3r(N3);
    const Tensor w3(wq3.data(), DType::kF8E4M3, {N3, K3}), ws3(ws.data(), DType::kF32, {N3});
    be->gemm_e4m3(Tensor(xq3.data(), DType::kF8E4M3, {M3, K3}), Tensor(xs.data(), DType::kF32, {M3}), w3, ws3,
                  Tensor{}, Tensor(y3.data(), DType::kF32, {M3, N3}), Fp8Accum::kF32);
    for (int64_t m = 0; m < M3; m += 13) {
      be->gemm_e4m3(Tensor(xq3.data() + m * K3, DType::kF8E4M3, {1, K3}), Tensor(xs.data() + m, DType::kF32, {1}),
                    w3, ws3, Tensor{}, Tensor(y3r.data(), DType::kF32, {1, N3}), Fp8Accum::kF32);
      ASSERT_EQ(0, std::memcmp(y3r.data(), y3.data() + m * N3, y3r.size() * sizeof(float))) << "row " << m;
      for (int64_t n = 0; n < N3; n += 7) {
        long double acc = 0;
        for (int64_t k = 0; k < K3; ++k)
          acc += static_cast<long double>(e4m3_to_float(xq3[m * K3 + k])) * e4m3_to_float(wq3[n * K3 + k]);
        const double scaled = static_cast<double>(acc) * static_cast<double>(xs[m]) * static_cast<double>(ws[n]);
        ASSERT_EQ(y3[m * N3 + n], static_cast<float>(scaled)) << m << "," << n;
      }
    }
  }

  // K past 2^17: the loop, in k order.
  const int64_t M2 = 2, N2 = 3, K2 = (int64_t{1} << 17) + 16;
  std::vector<uint8_t> xq2 = codes(M2 * K2), wq2 = codes(N2 * K2);
  std::vector<float> y2(M2 * N2);
  be->gemm_e4m3(Tensor(xq2.data(), DType::kF8E4M3, {M2, K2}), Tensor(xs.data(), DType::kF32, {M2}),
                Tensor(wq2.data(), DType::kF8E4M3, {N2, K2}), Tensor(ws.data(), DType::kF32, {N2}), Tensor{},
                Tensor(y2.data(), DType::kF32, {M2, N2}), Fp8Accum::kF32);
  for (int64_t m = 0; m < M2; ++m)
    for (int64_t n = 0; n < N2; ++n) {
      double acc = 0;
      for (int64_t k = 0; k < K2; ++k)
        acc += static_cast<double>(e4m3_to_float(xq2[m * K2 + k])) *
               static_cast<double>(e4m3_to_float(wq2[n * K2 + k]));
      const double scaled = acc * static_cast<double>(xs[m]) * static_cast<double>(ws[n]);
      ASSERT_EQ(y2[m * N2 + n], static_cast<float>(scaled)) << m << "," << n;
    }
}

// Per column, transposed: quantize_rows_e4m3 of xᵀ, bit for bit, from a strided x too (a column
// block of a wider matrix) and with a column of zeros (scale 1).
TEST(Fp8Ops, CpuQuantizeColsIsQuantizeRowsOfTheTranspose) {
  auto be = make_cpu_backend();
  const int64_t R = 45, C = 38, W = 50;  // x is the first C columns of a [R, W] matrix
  std::vector<float> wide = fp8_test_values(R, W, 7, 1.f);
  for (int64_t r = 0; r < R; ++r) wide[r * W + 3] = 0.f;
  Tensor x(wide.data(), DType::kF32, {R, W});
  x = x.slice(1, 0, C);
  std::vector<float> xt(C * R);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c) xt[c * R + r] = wide[r * W + c];
  std::vector<uint8_t> q(C * R), want_q(C * R);
  std::vector<float> s(C), want_s(C);
  be->quantize_cols_e4m3(x, Tensor(q.data(), DType::kF8E4M3, {C, R}), Tensor(s.data(), DType::kF32, {C}));
  be->quantize_rows_e4m3(Tensor(xt.data(), DType::kF32, {C, R}), Tensor(want_q.data(), DType::kF8E4M3, {C, R}),
                         Tensor(want_s.data(), DType::kF32, {C}));
  EXPECT_EQ(q, want_q);
  EXPECT_EQ(0, std::memcmp(s.data(), want_s.data(), s.size() * sizeof(float)));
  EXPECT_EQ(s[3], 1.f);
  EXPECT_GT(s[0], 0.f);
  EXPECT_TRUE(be->supports({"quantize_cols_e4m3", DType::kF32, {}}));
  // A transposed shape that does not fit is refused.
  std::vector<uint8_t> bad(C * R);
  EXPECT_DEATH(be->quantize_cols_e4m3(x, Tensor(bad.data(), DType::kF8E4M3, {R, C}), Tensor(s.data(), DType::kF32, {C})),
               "quantize_cols_e4m3");
}

// The three products of a linear layer in a training step, each through FP8 with every scale along
// a dimension the product keeps: Y = X·Wᵀ (X and W per row), dX = dY·W (dY per row, W per column),
// dW = dYᵀ·X (dY and X per column). Each is within E4M3's rounding of the exact product.
TEST(Fp8Ops, ForwardAndBothGradientProductsOfALinearLayer) {
  auto be = make_cpu_backend();
  const int64_t M = 64, K = 48, N = 32;  // tokens, inputs, outputs
  std::vector<float> x = fp8_test_values(M, K, 8, 1.f), w = fp8_test_values(N, K, 9, 0.02f),
                     dy = fp8_test_values(M, N, 10, 1e-3f);
  auto rows = [&](const std::vector<float>& v, int64_t r, int64_t c, std::vector<uint8_t>* q, std::vector<float>* sc) {
    q->assign(r * c, 0);
    sc->assign(r, 0.f);
    be->quantize_rows_e4m3(Tensor(const_cast<float*>(v.data()), DType::kF32, {r, c}),
                           Tensor(q->data(), DType::kF8E4M3, {r, c}), Tensor(sc->data(), DType::kF32, {r}));
  };
  auto cols = [&](const std::vector<float>& v, int64_t r, int64_t c, std::vector<uint8_t>* q, std::vector<float>* sc) {
    q->assign(r * c, 0);
    sc->assign(c, 0.f);
    be->quantize_cols_e4m3(Tensor(const_cast<float*>(v.data()), DType::kF32, {r, c}),
                           Tensor(q->data(), DType::kF8E4M3, {c, r}), Tensor(sc->data(), DType::kF32, {c}));
  };
  // out [a, b] = A·Bᵀ of quantised A [a, k] and B [b, k]; rel. RMS error against `exact`.
  auto product = [&](const std::vector<uint8_t>& aq, const std::vector<float>& as, const std::vector<uint8_t>& bq,
                     const std::vector<float>& bs, int64_t a, int64_t b, int64_t k,
                     const std::function<double(int64_t, int64_t)>& exact) {
    std::vector<float> out(a * b);
    be->gemm_e4m3(Tensor(const_cast<uint8_t*>(aq.data()), DType::kF8E4M3, {a, k}),
                  Tensor(const_cast<float*>(as.data()), DType::kF32, {a}),
                  Tensor(const_cast<uint8_t*>(bq.data()), DType::kF8E4M3, {b, k}),
                  Tensor(const_cast<float*>(bs.data()), DType::kF32, {b}), Tensor{},
                  Tensor(out.data(), DType::kF32, {a, b}), Fp8Accum::kF32);
    double e2 = 0, r2 = 0;
    for (int64_t i = 0; i < a; ++i)
      for (int64_t j = 0; j < b; ++j) {
        const double want = exact(i, j);
        e2 += (out[i * b + j] - want) * (out[i * b + j] - want);
        r2 += want * want;
      }
    return std::sqrt(e2 / r2);
  };
  std::vector<uint8_t> xq, wq, dyq, wtq, dytq, xtq;
  std::vector<float> xs, ws, dys, wts, dyts, xts;
  rows(x, M, K, &xq, &xs);
  rows(w, N, K, &wq, &ws);
  rows(dy, M, N, &dyq, &dys);
  cols(w, N, K, &wtq, &wts);   // Wᵀ [K, N] per row of Wᵀ
  cols(dy, M, N, &dytq, &dyts);  // dYᵀ [N, M]
  cols(x, M, K, &xtq, &xts);   // Xᵀ [K, M]
  const double fwd = product(xq, xs, wq, ws, M, N, K, [&](int64_t m, int64_t n) {
    double a = 0;
    for (int64_t k = 0; k < K; ++k) a += static_cast<double>(x[m * K + k]) * w[n * K + k];
    return a;
  });
  const double dgrad = product(dyq, dys, wtq, wts, M, K, N, [&](int64_t m, int64_t k) {
    double a = 0;
    for (int64_t n = 0; n < N; ++n) a += static_cast<double>(dy[m * N + n]) * w[n * K + k];
    return a;
  });
  const double wgrad = product(dytq, dyts, xtq, xts, N, K, M, [&](int64_t n, int64_t k) {
    double a = 0;
    for (int64_t m = 0; m < M; ++m) a += static_cast<double>(dy[m * N + n]) * x[m * K + k];
    return a;
  });
  for (double e : {fwd, dgrad, wgrad}) {
    EXPECT_GT(e, 1e-4);  // quantised
    EXPECT_LT(e, 0.06);  // within E4M3's three mantissa bits
  }
}

// ---- a model computing with FP8 weights (CPU) --------------------------------------------------

std::vector<float> logits_row(const Model& m, int64_t row) {
  const Tensor t = m.logits().select(row);
  return std::vector<float>(t.ptr<float>(), t.ptr<float>() + t.numel());
}

// The FP8 forward against the same weights' FP8 values in F32 products: they differ by the
// activations' rounding to E4M3 only (a few per cent of the logits, never zero); weights
// quantised at load and the same model saved by `laplace quantize` and loaded give the same
// bits; each sequence of a batch gets what it gets alone; and a training plan refuses.
TEST(Fp8Model, ForwardWithFp8WeightsOnTheCpu) {
  const std::string dir = testing::make_temp_dir("fp8model");
  auto be = make_cpu_backend();
  Config c;
  ASSERT_TRUE(config_load(std::string(LAPLACE_SOURCE_DIR) + "/configs/laplace-tiny.json", &c).is_ok());
  const int64_t T = 24;
  std::vector<int32_t> toks(2 * T);
  std::mt19937 rng(9);
  for (auto& t : toks) t = static_cast<int32_t>(rng() % c.vocab_size);

  Model ref;  // F32 products of the FP8-rounded weights
  ASSERT_TRUE(ref.create(c, *be, DType::kF32).is_ok());
  ref.init_weights(11);
  ASSERT_TRUE(ref.save(dir + "/m.safetensors").is_ok());
  ASSERT_TRUE(fp8_round_body_matrices(ref).is_ok());
  ASSERT_TRUE(ref.plan({2, T, false, false}).is_ok());
  ref.forward(toks.data(), 2, T, ForwardOptions{});

  Model a;  // quantised at load
  ASSERT_TRUE(a.create(c, *be, DType::kF32).is_ok());
  ASSERT_TRUE(a.load(dir + "/m.safetensors").is_ok());
  ASSERT_TRUE(a.use_fp8_weights().is_ok());
  EXPECT_TRUE(a.fp8_weights());
  ASSERT_TRUE(a.plan({2, T, false, false}).is_ok());
  a.forward(toks.data(), 2, T, ForwardOptions{});
  // The weights' own copies hold the FP8 values, as fp8_round_body_matrices leaves them.
  const Tensor wa = a.weights().layers[1].w12, wr = ref.weights().layers[1].w12;
  EXPECT_EQ(0, std::memcmp(wa.data, wr.data, wa.nbytes()));
  for (int64_t row : {int64_t{0}, T - 1, 2 * T - 1}) {
    const double e = testing::max_rel_error(logits_row(a, row), logits_row(ref, row));
    EXPECT_GT(e, 1e-6) << row;  // the activations' rounding is there
    EXPECT_LT(e, 0.1) << row;
  }

  // `laplace quantize`'s directory, loaded: the same codes and scales, the same logits.
  ASSERT_TRUE(std::filesystem::create_directories(dir + "/m"));
  std::filesystem::copy_file(dir + "/m.safetensors", dir + "/m/model.safetensors");
  const std::string cfg_text = c.to_json();
  std::ofstream(dir + "/m/config.json") << cfg_text;
  ASSERT_TRUE(quantize_model_dir(dir + "/m", dir + "/q", false, true).is_ok());
  Model b;
  ASSERT_TRUE(b.create(c, *be, DType::kF32).is_ok());
  ASSERT_TRUE(b.load_fp8(dir + "/q/model.safetensors").is_ok());
  ASSERT_TRUE(b.plan({2, T, false, false}).is_ok());
  b.forward(toks.data(), 2, T, ForwardOptions{});
  for (int64_t row = 0; row < 2 * T; ++row) ASSERT_EQ(logits_row(b, row), logits_row(a, row)) << row;

  // Batch invariance: the second sequence alone.
  b.forward(toks.data() + T, 1, T, ForwardOptions{});
  for (int64_t t = 0; t < T; ++t) ASSERT_EQ(logits_row(b, t), logits_row(a, T + t)) << t;
  // Fast accumulation: the CPU's sums are exact either way.
  EXPECT_FALSE(b.fp8_fast_forward());
  b.set_fp8_fast_forward(true);
  b.forward(toks.data(), 2, T, ForwardOptions{});
  for (int64_t row = 0; row < 2 * T; ++row) ASSERT_EQ(logits_row(b, row), logits_row(a, row)) << row;

  // Not for training; not from a file that is not FP8.
  EXPECT_EQ(b.plan({2, T, true, false}).code(), Status::Code::kUnsupported);
  Model d;
  ASSERT_TRUE(d.create(c, *be, DType::kF32).is_ok());
  const Status st = d.load_fp8(dir + "/m.safetensors");
  EXPECT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("does not hold FP8 weights"), std::string::npos) << st.message();
}

// A decode step with FP8 weights gives the logits of the full FP8 forward over the same tokens:
// in F64 the recurrent and chunked forms differ by rounding far below any E4M3 step, so every
// code agrees and the logits to ~1e-12 (a step that used another row's or a stale code would be
// off by per cents).
TEST(Fp8Model, DecodeStepFollowsTheFullForward) {
  auto be = make_cpu_backend();
  Config c;
  ASSERT_TRUE(config_load(std::string(LAPLACE_SOURCE_DIR) + "/configs/laplace-tiny.json", &c).is_ok());
  Model m;
  ASSERT_TRUE(m.create(c, *be, DType::kF64).is_ok());
  m.init_weights(5);
  ASSERT_TRUE(m.use_fp8_weights().is_ok());
  const int64_t T = 19;
  std::vector<int32_t> toks(T + 1);
  std::mt19937 rng(4);
  for (auto& t : toks) t = static_cast<int32_t>(rng() % c.vocab_size);
  ASSERT_TRUE(m.plan({2, T + 1, false, false}).is_ok());
  m.forward(toks.data(), 1, T + 1, ForwardOptions{});
  const Tensor fr = m.logits().select(T);
  std::vector<double> full(fr.ptr<double>(), fr.ptr<double>() + fr.numel());
  StatePool pool;
  ASSERT_TRUE(pool.create(c, *be, 2, DType::kF64).is_ok());
  const int32_t slots[2] = {1, 0};  // the step's sequence beside another, in slot 1
  ForwardOptions pre;
  pre.last_logits_only = true;
  std::vector<int32_t> two(2 * T);
  for (int64_t t = 0; t < T; ++t) two[t] = toks[t], two[T + t] = toks[(t + 7) % T];
  m.forward(two.data(), 2, T, pre, &pool, slots);
  ForwardOptions step;
  step.form = GlaForm::kRecurrent;
  step.last_logits_only = true;
  const int32_t next[2] = {toks[T], toks[3]};
  m.forward(next, 2, 1, step, &pool, slots);
  const Tensor want(full.data(), DType::kF64, {static_cast<int64_t>(full.size())});
  EXPECT_LT(testing::max_rel_error(m.logits().select(0), want), 1e-9);
}

// The LM head in FP8 (Model::set_fp8_head): each logit is the exact sum of the products of the
// final norm's row and the head's row, each quantised per row as the file quantiser does,
// scaled once; refused without FP8 weights; rows stay independent; off again, the logits are
// the head's own product's bytes.
TEST(Fp8Model, Fp8HeadIsTheProductOfTheQuantisedNormRowsAndHeadRows) {
  auto be = make_cpu_backend();
  Config c;
  ASSERT_TRUE(config_load(std::string(LAPLACE_SOURCE_DIR) + "/configs/laplace-tiny.json", &c).is_ok());
  ASSERT_FALSE(c.tie_embeddings);
  const int64_t T = 8, B = 2, V = c.vocab_size, D = c.hidden_size;
  ASSERT_GE(V, D);
  std::vector<int32_t> toks(B * T);
  std::mt19937 rng(4);
  for (auto& t : toks) t = static_cast<int32_t>(rng() % V);
  Model a;
  ASSERT_TRUE(a.create(c, *be, DType::kF32).is_ok());
  a.init_weights(5);
  EXPECT_EQ(a.set_fp8_head(true).code(), Status::Code::kUnsupported);  // no FP8 weights yet
  EXPECT_FALSE(a.fp8_head());
  ASSERT_TRUE(a.use_fp8_weights().is_ok());
  ASSERT_TRUE(a.plan({B, T, false, false}).is_ok());
  a.forward(toks.data(), B, T, ForwardOptions{});
  std::vector<std::vector<float>> own(B * T);
  for (int64_t r = 0; r < B * T; ++r) own[r] = logits_row(a, r);

  // The final norm's rows: with the identity as the head's first D rows (and zeros after), the
  // first D logits are those rows, bit for bit.
  const Tensor head = a.weights().lm_head;
  ASSERT_EQ(head.dtype, DType::kF32);
  float* hp = static_cast<float*>(head.data);
  const std::vector<float> hw(hp, hp + V * D);
  std::fill(hp, hp + V * D, 0.f);
  for (int64_t i = 0; i < D; ++i) hp[i * D + i] = 1.f;
  a.forward(toks.data(), B, T, ForwardOptions{});
  std::vector<float> zf(B * T * D);
  for (int64_t r = 0; r < B * T; ++r) {
    const std::vector<float> l = logits_row(a, r);
    std::copy_n(l.begin(), D, zf.begin() + r * D);
  }
  std::copy(hw.begin(), hw.end(), hp);

  ASSERT_TRUE(a.set_fp8_head(true).is_ok());
  EXPECT_TRUE(a.fp8_head());
  a.forward(toks.data(), B, T, ForwardOptions{});
  std::vector<uint8_t> xq(B * T * D), wq(V * D);
  std::vector<float> xs(B * T), ws(V);
  fp8_quantize_rows(zf.data(), B * T, D, xq.data(), xs.data());
  fp8_quantize_rows(hw.data(), V, D, wq.data(), ws.data());
  double worst = 0;
  for (int64_t r = 0; r < B * T; ++r) {
    const std::vector<float> got = logits_row(a, r);
    for (int64_t v = 0; v < V; ++v) {
      long double acc = 0;  // exact: sums of E4M3 products at this K
      for (int64_t k = 0; k < D; ++k)
        acc += static_cast<long double>(e4m3_to_float(xq[r * D + k])) * e4m3_to_float(wq[v * D + k]);
      const float want = static_cast<float>(static_cast<double>(acc) * xs[r] * ws[v]);
      ASSERT_EQ(got[v], want) << "row " << r << " logit " << v;
    }
    worst = std::max(worst, testing::max_rel_error(got, own[r]));
  }
  EXPECT_GT(worst, 1e-6);  // the head's rounding shows
  EXPECT_LT(worst, 0.1);
  // Each sequence alone gets its rows of the batch.
  const std::vector<float> second = logits_row(a, T + 3);
  a.forward(toks.data() + T, 1, T, ForwardOptions{});
  EXPECT_EQ(logits_row(a, 3), second);
  // Off again: the head's own product.
  ASSERT_TRUE(a.set_fp8_head(false).is_ok());
  a.forward(toks.data(), B, T, ForwardOptions{});
  for (int64_t r = 0; r < B * T; ++r) ASSERT_EQ(logits_row(a, r), own[r]) << r;
}

using testing::run_laplace;

// init → quantize: FP8 body matrices with scales, the precision in the metadata, and a clear
// refusal from a path that cannot use them; → dequantize: F32 weights that are exactly the
// FP8 values times their scales, and a model whose loss is near the original's.
// FP8 training's forward and backward (Model::use_fp8_training) against the model's own F32
// products on the same weights: the loss and every gradient within FP8's rounding and never
// equal to them where FP8 enters (the body matrices); the codes follow the weights
// (quantize_training_weights), and the choice is refused where it cannot apply.
TEST(Fp8Model, TrainingProductsFollowTheF32Gradients) {
  auto be = make_cpu_backend();
  Config c;
  ASSERT_TRUE(config_load(std::string(LAPLACE_SOURCE_DIR) + "/configs/laplace-tiny.json", &c).is_ok());
  const int64_t B = 2, T = 32;
  std::vector<int32_t> toks(B * T), tgt(B * T);
  std::mt19937 rng(12);
  for (auto& t : toks) t = static_cast<int32_t>(rng() % c.vocab_size);
  for (int64_t i = 0; i < B * T; ++i) tgt[i] = toks[(i + 1) % (B * T)];
  auto run = [&](Model& m, Arena* g) {
    EXPECT_TRUE(g->create(weight_specs(c, DType::kF32), be->allocator(), "grads").is_ok());
    g->zero();
    m.forward(toks.data(), B, T, ForwardOptions{});
    const double loss = m.loss(tgt.data());
    m.backward(tgt.data(), *g);
    return loss;
  };
  Model ref, f8;
  for (Model* m : {&ref, &f8}) {
    ASSERT_TRUE(m->create(c, *be, DType::kF32).is_ok());
    m->init_weights(21);
  }
  ASSERT_TRUE(f8.use_fp8_training().is_ok());
  EXPECT_TRUE(f8.fp8_training());
  ASSERT_TRUE(ref.plan({B, T, true, false}).is_ok());
  ASSERT_TRUE(f8.plan({B, T, true, false}).is_ok());
  f8.quantize_training_weights();
  Arena gr, gf;
  const double lr = run(ref, &gr), lf = run(f8, &gf);
  EXPECT_NE(lr, lf);
  EXPECT_NEAR(lf, lr, 0.02 * lr);
  for (size_t i = 0; i < gr.size(); ++i) {
    const Tensor a = gr.tensor(i), b = gf.tensor(i);
    double e2 = 0, r2 = 0;
    for (int64_t k = 0; k < a.numel(); ++k) {
      const double d = static_cast<double>(b.ptr<float>()[k]) - a.ptr<float>()[k];
      e2 += d * d;
      r2 += static_cast<double>(a.ptr<float>()[k]) * a.ptr<float>()[k];
    }
    const double rel = r2 > 0 ? std::sqrt(e2 / r2) : std::sqrt(e2);
    const std::string& name = gr.spec(i).name;
    // One FP8 product is within about 4 % (relative RMS) of the exact one; the gradients here sum
    // the errors of every product between them and the loss (this untrained 4-layer model: 10–15 %).
    EXPECT_LT(rel, 0.25) << name;
    if (name.find("wqkvg") != std::string::npos || name.find(".w3.") != std::string::npos) {
      EXPECT_GT(rel, 1e-4) << name << ": FP8's rounding must show in the body matrices' gradients";
    }
  }
  // Deterministic; and the codes follow the weights: after a change, another loss.
  Arena g2;
  EXPECT_EQ(run(f8, &g2), lf);
  for (size_t i = 0; i < gf.size(); ++i)
    EXPECT_EQ(0, std::memcmp(gf.tensor(i).data, g2.tensor(i).data, gf.tensor(i).nbytes())) << gf.spec(i).name;
  be->scale(f8.weights().layers[0].w12, 0.5);
  f8.quantize_training_weights();
  Arena g3;
  EXPECT_NE(run(f8, &g3), lf);
  // Chosen before the plan, for training plans only, and not beside FP8 inference weights.
  EXPECT_EQ(f8.use_fp8_training().code(), Status::Code::kUnsupported);
  Model late;
  ASSERT_TRUE(late.create(c, *be, DType::kF32).is_ok());
  ASSERT_TRUE(late.plan({B, T, true, false}).is_ok());
  EXPECT_EQ(late.use_fp8_training().code(), Status::Code::kUnsupported);
  Model inf;
  ASSERT_TRUE(inf.create(c, *be, DType::kF32).is_ok());
  ASSERT_TRUE(inf.use_fp8_training().is_ok());
  EXPECT_EQ(inf.plan({B, T, false, false}).code(), Status::Code::kUnsupported);
}

TEST(Fp8Files, QuantizeRefuseDequantize) {
  const std::string dir = testing::make_temp_dir("fp8");
  const std::string cfg = std::string(LAPLACE_SOURCE_DIR) + "/configs/laplace-tiny.json";
  ASSERT_EQ(run_laplace("init --config " + cfg + " --out " + dir + "/m --seed 3").exit_code, 0);
  testing::CliResult r = run_laplace("quantize --model " + dir + "/m --out " + dir + "/q");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("rel. RMS error"), std::string::npos) << r.output;

  SafeTensorsReader m, q;
  ASSERT_TRUE(SafeTensorsReader::open(dir + "/m/model.safetensors", &m).is_ok());
  ASSERT_TRUE(SafeTensorsReader::open(dir + "/q/model.safetensors", &q).is_ok());
  EXPECT_EQ(m.metadata().at(kPrecisionKey), "f32");
  EXPECT_EQ(q.metadata().at(kPrecisionKey), kPrecisionFp8Rows);
  const std::string name = "model.layers.0.wqkvg.weight";
  ASSERT_NE(q.find(name), nullptr);
  EXPECT_EQ(q.find(name)->dtype, DType::kF8E4M3);
  ASSERT_NE(q.find(fp8_scale_name(name)), nullptr);
  EXPECT_EQ(q.find("model.embed.weight")->dtype, DType::kF32);  // only the body matrices

  // Inference computes with them (--weights auto); a path that cannot is refused, saying what to do.
  r = run_laplace("forward --model " + dir + "/q --tokens 1,2,3,4");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  // --weights fp8-fast: the products accumulated fast, which the CPU's exact sums do not change.
  const testing::CliResult fast = run_laplace("forward --model " + dir + "/q --weights fp8-fast --tokens 1,2,3,4");
  EXPECT_EQ(fast.exit_code, 0) << fast.output;
  EXPECT_EQ(fast.output, r.output);
  // --fp8-head: the LM head in FP8 too, another loss; without FP8 weights a clear refusal.
  const testing::CliResult head = run_laplace("forward --model " + dir + "/q --fp8-head --tokens 1,2,3,4");
  EXPECT_EQ(head.exit_code, 0) << head.output;
  EXPECT_NE(head.output.find("loss="), std::string::npos) << head.output;
  EXPECT_NE(head.output, r.output);
  const testing::CliResult nohead = run_laplace("forward --model " + dir + "/m --fp8-head --tokens 1,2,3,4");
  EXPECT_NE(nohead.exit_code, 0) << nohead.output;
  EXPECT_NE(nohead.output.find("needs FP8 weights"), std::string::npos) << nohead.output;
  const testing::CliResult random_head = run_laplace("forward --config " + cfg + " --fp8-head --tokens 1,2,3,4");
  EXPECT_NE(random_head.exit_code, 0) << "random weights: refused, not ignored\n" << random_head.output;
  EXPECT_NE(random_head.output.find("needs FP8 weights"), std::string::npos) << random_head.output;
  for (const std::string& cmd : {"forward --model " + dir + "/q --weights dtype --tokens 1,2,3,4",
                                 "train --config " + cfg + " --init " + dir + "/q/model.safetensors --data " + dir +
                                     "/none.bin --steps 1"}) {
    r = run_laplace(cmd);
    EXPECT_NE(r.exit_code, 0) << cmd << "\n" << r.output;
    EXPECT_NE(r.output.find("holds FP8 weights"), std::string::npos) << cmd << "\n" << r.output;
    EXPECT_NE(r.output.find("quantize --dequantize"), std::string::npos) << cmd << "\n" << r.output;
  }
  r = run_laplace("quantize --model " + dir + "/q --out " + dir + "/q2");
  EXPECT_NE(r.output.find("holds FP8 weights already"), std::string::npos) << r.output;
  r = run_laplace("quantize --model " + dir + "/m --out " + dir + "/m2 --dequantize");
  EXPECT_NE(r.output.find("nothing to dequantise"), std::string::npos) << r.output;
  // The output may not be the input, under its own name or another (a link to it).
  std::filesystem::create_directory_symlink(dir + "/m", dir + "/m_link");
  for (const char* out : {"/m", "/m_link"}) {
    r = run_laplace("quantize --model " + dir + "/m --out " + dir + out);
    EXPECT_NE(r.exit_code, 0) << out;
    EXPECT_NE(r.output.find("another directory than --model"), std::string::npos) << out << ": " << r.output;
  }

  r = run_laplace("quantize --model " + dir + "/q --out " + dir + "/d --dequantize");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  SafeTensorsReader d;
  ASSERT_TRUE(SafeTensorsReader::open(dir + "/d/model.safetensors", &d).is_ok());
  const SafeTensorInfo* qi = q.find(name);
  const int64_t R = qi->shape[0], C = qi->shape[1];
  std::vector<uint8_t> codes(R * C);
  std::vector<float> s(R), got(R * C);
  const int64_t sh2[2] = {R, C}, sh1[1] = {R};
  ASSERT_TRUE(q.read_into(name, Tensor::make(codes.data(), DType::kF8E4M3, sh2, 2)).is_ok());
  ASSERT_TRUE(q.read_into(fp8_scale_name(name), Tensor::make(s.data(), DType::kF32, sh1, 1)).is_ok());
  ASSERT_TRUE(d.read_into(name, Tensor::make(got.data(), DType::kF32, sh2, 2)).is_ok());
  for (int64_t i = 0; i < R * C; ++i) ASSERT_EQ(got[i], e4m3_to_float(codes[i]) * s[i / C]) << i;

  auto loss_of = [&](const std::string& model) {
    const std::string o = run_laplace("forward --model " + model + " --tokens 5,17,3,99,42,7,250,11,64,8").output;
    const size_t at = o.find("loss=");
    EXPECT_NE(at, std::string::npos) << o;
    return at == std::string::npos ? 0.0 : std::atof(o.c_str() + at + 5);
  };
  const double l0 = loss_of(dir + "/m"), l1 = loss_of(dir + "/d");
  EXPECT_GT(l0, 0);
  EXPECT_NEAR(l1, l0, 0.01 * l0);
  EXPECT_NE(l1, l0);  // the rounding is there
  // Computing in FP8 (the activations rounded too): near both, equal to neither.
  const double lq = loss_of(dir + "/q");
  EXPECT_NEAR(lq, l0, 0.02 * l0);
  EXPECT_NE(lq, l1);
}

// FP8 weights from a file are checked before use: a scale that is not finite and positive, or a
// NaN code (0x7F, 0xFF: a quantiser saturates and never writes one), is refused by every loader
// (inference, `quantize --dequantize`, `export hf`) with the tensor and row, and nothing is written.
TEST(Fp8Files, CorruptScalesAndCodesAreRefused) {
  const std::string dir = testing::make_temp_dir("fp8bad");
  const std::string cfg = std::string(LAPLACE_SOURCE_DIR) + "/configs/laplace-tiny.json";
  ASSERT_EQ(run_laplace("init --config " + cfg + " --out " + dir + "/m --seed 4").exit_code, 0);
  ASSERT_EQ(run_laplace("quantize --model " + dir + "/m --out " + dir + "/q").exit_code, 0);
  const std::string name = "model.layers.1.w3.weight";
  std::string file;
  ASSERT_TRUE(read_file(dir + "/q/model.safetensors", &file).is_ok());
  uint64_t header = 0;
  std::memcpy(&header, file.data(), 8);
  SafeTensorsReader q;
  ASSERT_TRUE(SafeTensorsReader::open(dir + "/q/model.safetensors", &q).is_ok());
  const SafeTensorInfo* codes = q.find(name);
  const SafeTensorInfo* scales = q.find(fp8_scale_name(name));
  ASSERT_NE(codes, nullptr);
  ASSERT_NE(scales, nullptr);
  const int64_t C = codes->shape[1];
  struct Case {
    std::string what, want;
    uint64_t at;  // file offset of the bytes to replace
    std::string bytes;
  };
  auto f32 = [](float v) { return std::string(reinterpret_cast<const char*>(&v), 4); };
  const uint64_t data = 8 + header;
  const std::vector<Case> cases = {
      {"NaN scale", "row 2's scale is", data + scales->begin + 2 * 4, f32(std::nanf(""))},
      {"zero scale", "row 0's scale is", data + scales->begin, f32(0.f)},
      {"negative scale", "finite and positive", data + scales->begin + 5 * 4, f32(-1.f)},
      {"infinite scale", "finite and positive", data + scales->begin + 1 * 4, f32(INFINITY)},
      {"code 0x7F", "a NaN code at row 3, column 7", data + codes->begin + 3 * C + 7, std::string(1, '\x7f')},
      {"code 0xFF", "a NaN code at row 0, column 0", data + codes->begin, std::string(1, '\xff')},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    const std::string bad = dir + "/bad";
    std::filesystem::remove_all(bad);
    std::filesystem::remove_all(dir + "/d");
    std::filesystem::remove_all(dir + "/hf");
    std::filesystem::create_directory(bad);
    std::filesystem::copy_file(dir + "/q/config.json", bad + "/config.json");
    std::string patched = file;
    patched.replace(c.at, c.bytes.size(), c.bytes);
    ASSERT_TRUE(write_file_atomic(bad + "/model.safetensors", patched.data(), patched.size()).is_ok());
    for (const std::string& cmd :
         {"forward --model " + bad + " --tokens 1,2,3", "quantize --model " + bad + " --out " + dir + "/d --dequantize",
          "export hf --model " + bad + " --out " + dir + "/hf"}) {
      const testing::CliResult r = run_laplace(cmd);
      EXPECT_NE(r.exit_code, 0) << cmd << "\n" << r.output;
      EXPECT_NE(r.output.find(name), std::string::npos) << cmd << "\n" << r.output;
      EXPECT_NE(r.output.find(c.want), std::string::npos) << cmd << "\n" << r.output;
    }
    EXPECT_FALSE(std::filesystem::exists(dir + "/d/model.safetensors")) << "nothing written";
    EXPECT_FALSE(std::filesystem::exists(dir + "/hf")) << "nothing exported";
  }
}

}  // namespace
}  // namespace laplace
