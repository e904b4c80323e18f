// CUDA backend vs the CPU backend on the same inputs, at the real shapes of laplace-3b
// (D = 3072, the 9216-row projection, H = 16, dk = 96, dv = 192, V = 92160).
//
// Every test skips when make_cuda_backend() finds no usable GPU. Inputs are drawn once,
// rounded to the GPU dtype, and the CPU reference gets the same (rounded) values in F32
// (or F64 for GLA). Errors are max|a−b| / max|b| (testing::max_rel_error) unless noted:
//   F32 ops                 ≤ 1e-5 (element-wise, norms, losses), ≤ 1e-4 (long sums: gemm
//                           K=3072, parameter gradients summed over rows)
//   BF16 outputs            ≤ 1e-2 (one bf16 rounding of the output, 2^-8 relative)
//   F32 outputs of BF16 inputs (dw/db, states, losses, gemm C F32)  ≤ 1e-4
//   GLA vs F64 CPU, relative RMS (testing::rms_rel_error): BF16 o ≤ 2.5e-3, dq/dk/dv/ds_in ≤ 5e-3
//                           (bf16 inputs at dk = 96, dv = 192 take the tensor-core path);
//                           F32 ≤ 1e-5 (o, states) and ≤ 2e-5 (gradients)
//   sum_squares             relative ≤ 1e-10 (both accumulate in F64); row_sum_squares ≤ 1e-12 per row
// Determinism: ops with reductions run twice and their outputs are compared bytewise.
// Element-wise ops, the embedding, LayerNorm, SwiGLU and the cross-entropy at these shapes are
// cases of the cross-backend table (tests/test_backend_ops.cpp); what stays here needs more than
// the table gives: strided and fused views, graphs, tuning, the GLA forms and decode paths.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/fp8.h"
#include "ops/backend.h"
#include "tests/cuda_test_util.h"
#include "tests/test_util.h"
#ifdef LAPLACE_HAVE_CUDA
#include <cuda_runtime.h>

#include "ops/cuda/cuda_backend.h"
#endif

namespace laplace {
namespace {

using laplace::testing::max_rel_error;
using laplace::testing::OwnedTensor;
using laplace::testing::rms_rel_error;

// ---- helpers -------------------------------------------------------------------------

using laplace::testing::round_to;

using laplace::testing::Buf;
using laplace::testing::CudaVsCpu;
using laplace::testing::DevTensor;
using laplace::testing::host_tensor;
using laplace::testing::set_flat;

class CudaOps : public CudaVsCpu {
 protected:
  // Makes the CPU side hold the GPU side's values (e.g. a bf16 pre-activation that both
  // backwards should then read).
  void adopt(Buf& b) {
    auto h = down(b.d());
    const int64_t n = b.r().numel();
    for (int64_t i = 0; i < n; ++i) {
      double x = 0;
      switch (h->t.dtype) {
        case DType::kF32: x = static_cast<const float*>(h->t.data)[i]; break;
        case DType::kBF16: x = bf16_to_float(static_cast<const uint16_t*>(h->t.data)[i]); break;
        default: FAIL() << "adopt: unsupported dtype";
      }
      set_flat(b.r(), i, x);
    }
  }
  // CudaBackend::kernel_attr_calls() of cuda_ (a build without CUDA never gets past SetUp).
  int64_t kernel_attr_calls() const {
#ifdef LAPLACE_HAVE_CUDA
    return dynamic_cast<const CudaBackend&>(*cuda_).kernel_attr_calls();
#else
    return 0;
#endif
  }

};

// [B,T,H,d] view at column offset `off` of a [B,T,W] tensor.
Tensor head_view(const Tensor& base, int64_t off, int64_t H, int64_t d) {
  Tensor v = base;
  v.data = static_cast<char*>(base.data) + off * static_cast<int64_t>(dtype_size(base.dtype));
  v.ndim = 4;
  v.shape = {base.shape[0], base.shape[1], H, d};
  v.stride = {base.stride[0], base.stride[1], d, 1};
  return v;
}

constexpr DType kF32 = DType::kF32, kBF16 = DType::kBF16, kF64 = DType::kF64;

// ---- memory ------------------------------------------------------------------------------

TEST_F(CudaOps, CopyRoundTripsAndStridedViews) {
  // H2D, D2D, D2H of a contiguous tensor are exact.
  Buf a = input({4, 6, 10}, kF32, kF32, 1);
  auto back = down(a.d());
  EXPECT_EQ(std::memcmp(back->t.data, a.r().data, a.r().nbytes()), 0);
  // D2D copy of a strided slice into a contiguous tensor, and H2D into a strided view.
  Tensor sl = a.d().slice(2, 2, 8);                   // [4,6,6], row stride 10
  DevTensor c(*cuda_, kF32, {4, 6, 6});
  cuda_->copy(c.t, sl);
  auto hc = down(c.t);
  Tensor ref_sl = a.r().slice(2, 2, 8);
  EXPECT_EQ(max_rel_error(hc->t, ref_sl), 0.0);
  DevTensor big(*cuda_, kF32, {4, 6, 10});
  cuda_->fill(big.t, 7.0);
  cuda_->copy(big.t.slice(2, 2, 8), ref_sl);         // H2D into a view
  auto hb = down(big.t);
  EXPECT_EQ(max_rel_error(hb->t.slice(2, 2, 8), ref_sl), 0.0);
  EXPECT_EQ(static_cast<float*>(hb->t.data)[0], 7.0f);
  EXPECT_EQ(static_cast<float*>(hb->t.data)[9], 7.0f);
  // 4-D strided view whose batch and time dims cannot merge (a loop of 2-D copies).
  Buf q = input({2, 5, 3, 8}, kBF16, kF32, 2);
  DevTensor fused(*cuda_, kBF16, {2, 6, 40});
  Tensor qv = head_view(fused.t.slice(1, 0, 5), 8, 3, 8);  // [2,5,3,8] inside [2,6,40]
  cuda_->copy(qv, q.d());
  DevTensor q2(*cuda_, kBF16, {2, 5, 3, 8});
  cuda_->copy(q2.t, qv);
  EXPECT_TRUE(same_bytes(q2.t, q.d()));
  // F32 <-> BF16 conversion: D2D, H2D and D2H.
  DevTensor cb(*cuda_, kBF16, {4, 6, 10});
  cuda_->copy(cb.t, a.d());
  auto hcb = down(cb.t);
  const float* src = static_cast<const float*>(a.r().data);
  const uint16_t* dst = static_cast<const uint16_t*>(hcb->t.data);
  for (int64_t i = 0; i < a.r().numel(); ++i) ASSERT_EQ(dst[i], float_to_bf16(src[i])) << i;
  DevTensor cb2(*cuda_, kBF16, {4, 6, 10});
  cuda_->copy(cb2.t, a.r());                          // H2D with conversion
  EXPECT_TRUE(same_bytes(cb2.t, cb.t));
  auto hf = host_tensor(kF32, {4, 6, 10});
  cuda_->copy(hf->t, cb.t);                           // D2H with conversion
  for (int64_t i = 0; i < a.r().numel(); ++i)
    ASSERT_EQ(static_cast<float*>(hf->t.data)[i], bf16_to_float(dst[i])) << i;
}

// ---- gemm ------------------------------------------------------------------------------------

// The three products of a 9216×3072 projection over 300 token rows: y = x·Wᵀ, dx = dy·W,
// dW += dyᵀ·x; then transposed/strided operand variants.
// FP8 products (ops/backend.h) at laplace-3b's decode, prefill and training shapes: the quantiser
// gives the CPU backend's codes and scales bit for bit, from F32 and from BF16 activations; the
// product, against a long-double sum of the same codes and scales (checked on a sample of
// entries: the whole reference would take the host minutes), in F32 and BF16 output, is
// deterministic and, accumulated in F32, within 1e-5 of the sum of the terms' magnitudes.
// Fast accumulation keeps fewer bits: each entry within 2^-9 of that magnitude and, in F32
// output, a relative RMS error under 6e-3 over the sample, a sixth of what quantising the
// operands costs (BENCHMARKS.md has both errors as measured).
TEST_F(CudaOps, Fp8QuantizeAndGemmAtModelShapes) {
  struct Shape {
    const char* what;
    int64_t M, K, N;
  };
  const Shape shapes[] = {{"decode: 1,280 rows, W_qkvg", 1280, 3072, 9216},
                          {"prefill: 8,192 tokens, W_o", 8192, 3072, 3072},
                          {"training: 16,384 tokens, W_3", 16384, 8192, 3072}};
  uint64_t seed = 40;
  for (const Shape& sh : shapes) {
    SCOPED_TRACE(sh.what);
    const DType xdt = sh.M == 8192 ? kF32 : kBF16;
    Buf x = input({sh.M, sh.K}, xdt, kF32, ++seed, -2, 2), w = input({sh.N, sh.K}, kBF16, kF32, ++seed, -0.05, 0.05);
    auto quant = [&](const Buf& b, int64_t R, int64_t C, DevTensor* q, DevTensor* sc) {
      auto hq = host_tensor(DType::kF8E4M3, {R, C});
      auto hs = host_tensor(kF32, {R});
      cpu_->quantize_rows_e4m3(b.r(), hq->t, hs->t);
      cuda_->quantize_rows_e4m3(b.d(), q->t, sc->t);
      auto dq = down(q->t), ds = down(sc->t);
      EXPECT_EQ(0, std::memcmp(dq->t.data, hq->t.data, static_cast<size_t>(R * C))) << "codes";
      EXPECT_EQ(0, std::memcmp(ds->t.data, hs->t.data, static_cast<size_t>(R) * 4)) << "scales";
    };
    DevTensor xq(*cuda_, DType::kF8E4M3, {sh.M, sh.K}), xs(*cuda_, kF32, {sh.M});
    DevTensor wq(*cuda_, DType::kF8E4M3, {sh.N, sh.K}), ws(*cuda_, kF32, {sh.N});
    quant(x, sh.M, sh.K, &xq, &xs);
    quant(w, sh.N, sh.K, &wq, &ws);
    auto hxq = down(xq.t), hwq = down(wq.t), hxs = down(xs.t), hws = down(ws.t);
    const uint8_t* cx = static_cast<const uint8_t*>(hxq->t.data);
    const uint8_t* cw = static_cast<const uint8_t*>(hwq->t.data);
    const float* sx = static_cast<const float*>(hxs->t.data);
    const float* sw = static_cast<const float*>(hws->t.data);
    for (int variant = 0; variant < 4; ++variant) {
      const bool fast = variant >= 2;
      const Fp8Accum accum = fast ? Fp8Accum::kFast : Fp8Accum::kF32;
      const DType ydt = variant % 2 == 0 ? kF32 : kBF16;
      SCOPED_TRACE(fast ? "fast accumulation" : "F32 accumulation");
      DevTensor y(*cuda_, ydt, {sh.M, sh.N}), y2(*cuda_, ydt, {sh.M, sh.N});
      cuda_->gemm_e4m3(xq.t, xs.t, wq.t, ws.t, Tensor{}, y.t, accum);
      cuda_->gemm_e4m3(xq.t, xs.t, wq.t, ws.t, Tensor{}, y2.t, accum);
      EXPECT_TRUE(same_bytes(y.t, y2.t)) << "deterministic";
      auto hy = down(y.t);
      std::mt19937_64 rng(seed);
      int bad = 0;
      double err2 = 0, ref2 = 0;
      for (int i = 0; i < 2000; ++i) {
        const int64_t m = static_cast<int64_t>(rng() % sh.M), n = static_cast<int64_t>(rng() % sh.N);
        long double acc = 0, mag = 0;
        for (int64_t k = 0; k < sh.K; ++k) {
          const long double t =
              static_cast<long double>(e4m3_to_float(cx[m * sh.K + k])) * e4m3_to_float(cw[n * sh.K + k]);
          acc += t;
          mag += std::fabs(t);
        }
        const double want = static_cast<double>(acc * sx[m] * sw[n]);
        const double got = ydt == kF32 ? static_cast<const float*>(hy->t.data)[m * sh.N + n]
                                       : bf16_to_float(static_cast<const uint16_t*>(hy->t.data)[m * sh.N + n]);
        const double bound = (fast ? 0x1p-9 : 1e-5) * static_cast<double>(mag * sx[m] * sw[n]) +
                             (ydt == kBF16 ? std::ldexp(std::fabs(want), -8) : 0.0) + 1e-30;
        if (std::fabs(got - want) > bound && bad++ < 5)
          ADD_FAILURE() << dtype_name(ydt) << " y[" << m << "][" << n << "] = " << got << ", want " << want;
        err2 += (got - want) * (got - want);
        ref2 += want * want;
      }
      EXPECT_EQ(bad, 0) << dtype_name(ydt);
      if (fast && ydt == kF32) {
        EXPECT_LT(std::sqrt(err2 / ref2), 6e-3) << "relative RMS error";
      }
      // A residual (cuBLASLt's C), in place: y = 0.5 + X·Wᵀ, the same sums before one rounding.
      cuda_->fill(y2.t, 0.5);
      cuda_->gemm_e4m3(xq.t, xs.t, wq.t, ws.t, y2.t, y2.t, accum);
      auto hr = down(y2.t);
      for (int i = 0; i < 200; ++i) {
        const int64_t m = static_cast<int64_t>(rng() % sh.M), n = static_cast<int64_t>(rng() % sh.N);
        const auto val = [&](const OwnedTensor& h) {
          return ydt == kF32 ? static_cast<double>(static_cast<const float*>(h.t.data)[m * sh.N + n])
                             : static_cast<double>(bf16_to_float(static_cast<const uint16_t*>(h.t.data)[m * sh.N + n]));
        };
        // Against the product without residual: both round within 2^-8 (BF16) or F32; with fast
        // accumulation each sum is also within 2^-9 of its terms' magnitude (cuBLASLt may take
        // another kernel when C is read).
        double fast_tol = 0;
        if (fast) {
          long double mag = 0;
          for (int64_t k = 0; k < sh.K; ++k) {
            const long double t =
                static_cast<long double>(e4m3_to_float(cx[m * sh.K + k])) * e4m3_to_float(cw[n * sh.K + k]);
            mag += std::fabs(t);
          }
          fast_tol = 2 * 0x1p-9 * static_cast<double>(mag * sx[m] * sw[n]);
        }
        const double tol = (ydt == kBF16 ? 0x1p-7 : 1e-6) * (std::fabs(val(*hy)) + 0.5) + 1e-6 + fast_tol;
        EXPECT_NEAR(val(*hr), 0.5 + val(*hy), tol) << dtype_name(ydt) << " residual at " << m << "," << n;
      }
    }
  }
}

// dequantize_rows_e4m3 (what a weight's own copy takes under FP8 weights): the CPU's F32 values,
// byte for byte, in F32 and rounded once to BF16, at W_12's shape with every finite code.
TEST_F(CudaOps, Fp8DequantizeRowsEqualsTheCpu) {
  const int64_t R = 16384, C = 3072;
  std::vector<uint8_t> q(R * C);
  std::mt19937_64 rng(95);
  for (int64_t i = 0; i < R * C; ++i) {
    uint8_t b = static_cast<uint8_t>(i < 256 ? i : rng());
    if ((b & 0x7F) == 0x7F) b ^= 1;  // not the NaN codes: their payloads are not the op's business
    q[i] = b;
  }
  std::vector<float> s(R);
  for (int64_t r = 0; r < R; ++r) s[r] = std::ldexp(1.f + static_cast<float>(rng() % 1000) / 1000.f, -12 + static_cast<int>(r % 20));
  const Tensor qh(q.data(), DType::kF8E4M3, {R, C}), sh(s.data(), kF32, {R});
  std::vector<float> want(R * C);
  std::vector<uint16_t> want16(R * C);
  cpu_->dequantize_rows_e4m3(qh, sh, Tensor(want.data(), kF32, {R, C}));
  for (int64_t i = 0; i < R * C; ++i) want16[i] = float_to_bf16(want[i]);
  DevTensor qd(*cuda_, DType::kF8E4M3, {R, C}), sd(*cuda_, kF32, {R}), w32(*cuda_, kF32, {R, C}),
      w16(*cuda_, kBF16, {R, C});
  cuda_->copy(qd.t, qh);
  cuda_->copy(sd.t, sh);
  cuda_->dequantize_rows_e4m3(qd.t, sd.t, w32.t);
  cuda_->dequantize_rows_e4m3(qd.t, sd.t, w16.t);
  auto h32 = down(w32.t), h16 = down(w16.t);
  EXPECT_EQ(0, std::memcmp(h32->t.data, want.data(), want.size() * sizeof(float))) << "F32";
  EXPECT_EQ(0, std::memcmp(h16->t.data, want16.data(), want16.size() * sizeof(uint16_t))) << "BF16";
}

// SwiGLU with W_3's input codes in one pass (Backend::swiglu_forward_e4m3): the codes and scales
// of swiglu_forward followed by quantize_rows_e4m3 on this backend, byte for byte, at laplace-3b's
// decode and prefill rows (F 8,192: four chunks a thread), at widths that leave threads idle or
// use one chunk, and where the fused kernel does not apply (F32, F not a multiple of 8, F past
// its registers), which takes the two ops.
TEST_F(CudaOps, Fp8SwigluCodesEqualTheTwoOps) {
  struct Shape {
    int64_t N, F;
    DType dt;
  };
  const Shape shapes[] = {{1280, 8192, kBF16}, {8192, 8192, kBF16}, {7, 2056, kBF16}, {3, 8, kBF16},
                          {5, 8192, kF32},     {4, 1000, kBF16},   {3, 12, kBF16},   {2, 8200, kBF16}};
  uint64_t seed = 90;
  for (const Shape& sh : shapes) {
    SCOPED_TRACE("N " + std::to_string(sh.N) + " F " + std::to_string(sh.F) + " " + dtype_name(sh.dt));
    // Pre-activations in [-6, 6); row 1 all zero (its scale is 1).
    Buf ab = input({sh.N, 2 * sh.F}, sh.dt, kF32, ++seed, -6, 6);
    if (sh.N > 2) cuda_->fill(ab.d().select(1), 0.0);
    DevTensor h(*cuda_, sh.dt, {sh.N, sh.F}), h2(*cuda_, sh.dt, {sh.N, sh.F});
    DevTensor q(*cuda_, DType::kF8E4M3, {sh.N, sh.F}), s(*cuda_, kF32, {sh.N});
    DevTensor q2(*cuda_, DType::kF8E4M3, {sh.N, sh.F}), s2(*cuda_, kF32, {sh.N});
    cuda_->swiglu_forward(ab.d(), h2.t);
    cuda_->quantize_rows_e4m3(h2.t, q2.t, s2.t);
    cuda_->swiglu_forward_e4m3(ab.d(), h.t, q.t, s.t);
    EXPECT_TRUE(same_bytes(q.t, q2.t)) << "codes";
    EXPECT_TRUE(same_bytes(s.t, s2.t)) << "scales";
  }
}

// LayerNorm with W_12's input codes in one pass (Backend::layernorm_forward_e4m3): the codes and
// scales of layernorm_forward followed by quantize_rows_e4m3 on this backend, byte for byte, at
// laplace-3b's decode and prefill rows (D 3,072), at widths that leave lanes idle, without w and
// b, and where the fused kernel does not apply (F32 rows, D not a multiple of 8), which takes the
// two ops.
TEST_F(CudaOps, Fp8LayerNormCodesEqualTheTwoOps) {
  struct Shape {
    int64_t N, D;
    DType dt;
    bool affine;
  };
  const Shape shapes[] = {{1280, 3072, kBF16, true}, {8192, 3072, kBF16, true}, {9, 264, kBF16, true},
                          {5, 3072, kBF16, false},   {6, 3072, kF32, true},     {3, 100, kBF16, true}};
  uint64_t seed = 120;
  for (const Shape& sh : shapes) {
    SCOPED_TRACE("N " + std::to_string(sh.N) + " D " + std::to_string(sh.D) + " " + dtype_name(sh.dt) +
                 (sh.affine ? "" : ", no w and b"));
    Buf x = input({sh.N, sh.D}, sh.dt, kF32, ++seed, -3, 3);
    Buf w = input({sh.D}, sh.dt, kF32, ++seed, 0.5, 1.5), b = input({sh.D}, sh.dt, kF32, ++seed, -0.2, 0.2);
    if (sh.N > 2) cuda_->fill(x.d().select(1), 0.25);  // a constant row: y = b
    const Tensor wt = sh.affine ? w.d() : Tensor{}, bt = sh.affine ? b.d() : Tensor{};
    DevTensor y(*cuda_, sh.dt, {sh.N, sh.D}), y2(*cuda_, sh.dt, {sh.N, sh.D});
    DevTensor q(*cuda_, DType::kF8E4M3, {sh.N, sh.D}), s(*cuda_, kF32, {sh.N});
    DevTensor q2(*cuda_, DType::kF8E4M3, {sh.N, sh.D}), s2(*cuda_, kF32, {sh.N});
    cuda_->layernorm_forward(x.d(), wt, bt, 1e-5, y2.t, Tensor{}, Tensor{});
    cuda_->quantize_rows_e4m3(y2.t, q2.t, s2.t);
    cuda_->layernorm_forward_e4m3(x.d(), wt, bt, 1e-5, y.t, q.t, s.t);
    EXPECT_TRUE(same_bytes(q.t, q2.t)) << "codes";
    EXPECT_TRUE(same_bytes(s.t, s2.t)) << "scales";
  }
}

// Per column, transposed, at the training step's operands of laplace-3b (W_qkvg for dX = dY·W, a
// micro-batch's dY of W_o and its input X for dW = dYᵀ·X, X a column block of a wider matrix) and
// at ragged shapes that take the kernels' edge paths: the CPU backend's codes and scales bit for
// bit, from BF16 and F32, per column and per row.
TEST_F(CudaOps, Fp8QuantizeColsAtTrainingShapes) {
  struct Shape {
    const char* what;
    int64_t R, C, ld;
    DType dt;
    double range = 3;  // values in [-range, range]
  };
  const Shape shapes[] = {{"W_qkvg [9216, 3072], bf16", 9216, 3072, 3072, kBF16},
                          {"dY of W_o [16384, 3072], bf16", 16384, 3072, 3072, kBF16},
                          {"X [16384, 3072] inside [16384, 3200], f32", 16384, 3072, 3200, kF32},
                          {"ragged [1000, 77], f32", 1000, 77, 77, kF32},
                          {"ragged [999, 77], bf16 (rows not whole words)", 999, 77, 77, kBF16},
                          {"[1001, 264] inside [1001, 272], bf16 (rows not whole tiles)", 1001, 264, 272, kBF16},
                          {"tiny [520, 264], bf16 (scales at FLT_MIN)", 520, 264, 264, kBF16, 1e-37},
                          {"tiny [520, 77], f32 (scales at FLT_MIN)", 520, 77, 77, kF32, 1e-37}};
  // A device tensor's bytes against the CPU backend's.
  auto expect_bytes = [&](const Tensor& dev, const auto& host, const char* what) {
    auto d = down(dev);
    EXPECT_EQ(0, std::memcmp(d->t.data, host->t.data, host->t.nbytes())) << what;
  };
  uint64_t seed = 60;
  for (const Shape& sh : shapes) {
    SCOPED_TRACE(sh.what);
    Buf wide = input({sh.R, sh.ld}, sh.dt, kF32, ++seed, -sh.range, sh.range);
    const Tensor xr = wide.r().slice(1, 0, sh.C), xd = wide.d().slice(1, 0, sh.C);
    auto hq = host_tensor(DType::kF8E4M3, {sh.C, sh.R});
    auto hs = host_tensor(kF32, {sh.C});
    DevTensor q(*cuda_, DType::kF8E4M3, {sh.C, sh.R}), sc(*cuda_, kF32, {sh.C});
    cpu_->quantize_cols_e4m3(xr, hq->t, hs->t);
    cuda_->quantize_cols_e4m3(xd, q.t, sc.t);
    expect_bytes(q.t, hq, "codes");
    expect_bytes(sc.t, hs, "scales");
    // The same rows per row: the strided, ragged and odd-length rows take the one-element kernel.
    auto hrq = host_tensor(DType::kF8E4M3, {sh.R, sh.C});
    auto hrs = host_tensor(kF32, {sh.R});
    DevTensor rq(*cuda_, DType::kF8E4M3, {sh.R, sh.C}), rs(*cuda_, kF32, {sh.R});
    cpu_->quantize_rows_e4m3(xr, hrq->t, hrs->t);
    cuda_->quantize_rows_e4m3(xd, rq.t, rs.t);
    expect_bytes(rq.t, hrq, "row codes");
    expect_bytes(rs.t, hrs, "row scales");
    // Both at once (a training step's dY): the same codes and scales as the two calls.
    DevTensor bq(*cuda_, DType::kF8E4M3, {sh.R, sh.C}), bs(*cuda_, kF32, {sh.R});
    DevTensor bqt(*cuda_, DType::kF8E4M3, {sh.C, sh.R}), bst(*cuda_, kF32, {sh.C});
    cuda_->quantize_rows_cols_e4m3(xd, bq.t, bs.t, bqt.t, bst.t);
    expect_bytes(bq.t, hrq, "both: row codes");
    expect_bytes(bs.t, hrs, "both: row scales");
    expect_bytes(bqt.t, hq, "both: column codes");
    expect_bytes(bst.t, hs, "both: column scales");
  }
}

TEST_F(CudaOps, GemmProjectionShapesF32) {
  const int64_t N = 300, D = 3072, O = 9216;
  Buf x = input({N, D}, kF32, kF32, 10), w = input({O, D}, kF32, kF32, 11);
  Buf y = zeros({N, O}, kF32, kF32);
  cpu_->gemm(x.r(), false, w.r(), true, y.r(), 1.0, 0.0);  // y = x·Wᵀ
  cuda_->gemm(x.d(), false, w.d(), true, y.d(), 1.0, 0.0);
  EXPECT_LE(err(y), 1e-5);
  Buf dy = input({N, O}, kF32, kF32, 12), dx = zeros({N, D}, kF32, kF32);
  cpu_->gemm(dy.r(), false, w.r(), false, dx.r(), 1.0, 0.0);  // dx = dy·W
  cuda_->gemm(dy.d(), false, w.d(), false, dx.d(), 1.0, 0.0);
  EXPECT_LE(err(dx), 1e-5);
  Buf dw = input({O, D}, kF32, kF32, 13);
  cpu_->gemm(dy.r(), true, x.r(), false, dw.r(), 0.5, 1.0);  // dW = 0.5·dyᵀ·x + dW
  cuda_->gemm(dy.d(), true, x.d(), false, dw.d(), 0.5, 1.0);
  EXPECT_LE(err(dw), 1e-5);
  // both transposed, and a strided (column-sliced) operand
  Buf xt = input({D, N}, kF32, kF32, 14), z = zeros({N, 2000}, kF32, kF32);
  Tensor w_sl_r = w.r().slice(0, 0, 2000).slice(1, 0, D), w_sl_d = w.d().slice(0, 0, 2000);
  cpu_->gemm(xt.r(), true, w_sl_r, true, z.r(), 1.0, 0.0);
  cuda_->gemm(xt.d(), true, w_sl_d, true, z.d(), 1.0, 0.0);
  EXPECT_LE(err(z), 1e-5);
  Buf big = zeros({N, 4000}, kF32, kF32);  // c as a column slice (ldc = 4000)
  cpu_->gemm(x.r(), false, w_sl_r, true, big.r().slice(1, 1000, 3000), 1.0, 0.0);
  cuda_->gemm(x.d(), false, w_sl_d, true, big.d().slice(1, 1000, 3000), 1.0, 0.0);
  EXPECT_LE(err(big), 1e-5);
  // determinism
  DevTensor y2(*cuda_, kF32, {N, O});
  cuda_->gemm(x.d(), false, w.d(), true, y2.t, 1.0, 0.0);
  EXPECT_TRUE(same_bytes(y2.t, y.d()));
}

TEST_F(CudaOps, GemmProjectionShapesBF16) {
  const int64_t N = 300, D = 3072, O = 9216;
  Buf x = input({N, D}, kBF16, kF32, 20), w = input({O, D}, kBF16, kF32, 21);
  Buf y32 = zeros({N, O}, kF32, kF32), y16 = zeros({N, O}, kBF16, kF32);
  cpu_->gemm(x.r(), false, w.r(), true, y32.r(), 1.0, 0.0);
  cuda_->gemm(x.d(), false, w.d(), true, y32.d(), 1.0, 0.0);
  EXPECT_LE(err(y32), 1e-4);
  cpu_->gemm(x.r(), false, w.r(), true, y16.r(), 1.0, 0.0);
  cuda_->gemm(x.d(), false, w.d(), true, y16.d(), 1.0, 0.0);
  EXPECT_LE(err(y16), 1e-2);
  Buf dy = input({N, O}, kBF16, kF32, 22), dx = zeros({N, D}, kBF16, kF32);
  cpu_->gemm(dy.r(), false, w.r(), false, dx.r(), 1.0, 0.0);
  cuda_->gemm(dy.d(), false, w.d(), false, dx.d(), 1.0, 0.0);
  EXPECT_LE(err(dx), 1e-2);
  Buf dw = input({O, D}, kF32, kF32, 23);  // F32 gradient accumulator
  cpu_->gemm(dy.r(), true, x.r(), false, dw.r(), 1.0, 1.0);
  cuda_->gemm(dy.d(), true, x.d(), false, dw.d(), 1.0, 1.0);
  EXPECT_LE(err(dw), 1e-4);
  DevTensor y2(*cuda_, kBF16, {N, O});
  cuda_->gemm(x.d(), false, w.d(), true, y2.t, 1.0, 0.0);
  EXPECT_TRUE(same_bytes(y2.t, y16.d()));
}

// The model's residual add: x_out = x_mid + h·W_3ᵀ with x_mid a distinct BF16 buffer (cuBLASLt's
// C operand): vs the CPU and vs copy + in-place gemm (1e-2: cuBLASLt may pick another kernel
// when C is not D), x_mid left unchanged, a second call bitwise equal.
TEST_F(CudaOps, GemmAddResidualBF16) {
  const int64_t N = 300, D = 3072, F = 8192;
  Buf h = input({N, F}, kBF16, kF32, 24, -0.1, 0.1), w3 = input({D, F}, kBF16, kF32, 25, -0.1, 0.1);
  Buf x_mid = input({N, D}, kBF16, kF32, 26), x_out = zeros({N, D}, kBF16, kF32);
  cpu_->gemm_add(h.r(), false, w3.r(), true, x_mid.r(), x_out.r(), 1.0, 1.0);
  cuda_->gemm_add(h.d(), false, w3.d(), true, x_mid.d(), x_out.d(), 1.0, 1.0);
  EXPECT_LE(err(x_out), 1e-2);
  EXPECT_EQ(err(x_mid), 0.0);  // the input is not written
  DevTensor y(*cuda_, kBF16, {N, D});
  cuda_->copy(y.t, x_mid.d());
  cuda_->gemm(h.d(), false, w3.d(), true, y.t, 1.0, 1.0);
  EXPECT_LE(max_rel_error(down(y.t)->t, x_out.r()), 1e-2);
  DevTensor y2(*cuda_, kBF16, {N, D});
  cuda_->gemm_add(h.d(), false, w3.d(), true, x_mid.d(), y2.t, 1.0, 1.0);
  EXPECT_TRUE(same_bytes(y2.t, x_out.d()));
  EXPECT_FALSE(same_bytes(y2.t, x_mid.d()));
}

#ifdef LAPLACE_HAVE_CUDA
// A captured chain of the decode step's gemm shapes (β = 0, M = 1,280: qkvg 9216 × 3072, w12
// 16384 × 3072 reading a strided slice of the first's output, then qkvg again) with an
// element-wise op between each. Before such multi-wave gemms cuBLASLt queues a memset of a
// tile counter, which capture() replaces by one zeroing kernel at the end (or, under
// LAPLACE_GRAPH_COUNTERS=head, the head) of the graph (gather_gemm_memsets). Replays must give
// eager's bytes, twice with fresh inputs (and a second replay the same: the counters are zeroed
// again), and on sm_90 (cuBLASLt 13 on the H200 queues one before each of these three gemms) the
// rewiring must have happened: the memsets replaced are counted.
TEST_F(CudaOps, GraphOfGemmsMovesMemsetsAndKeepsEagerBits) {
  // Twice: counters zeroed by the graph's last node (the default; the arena zeroed once when
  // allocated), then by its first, on a backend made under LAPLACE_GRAPH_COUNTERS=head.
  const auto check = [&] {
    auto* be = dynamic_cast<CudaBackend*>(cuda_.get());
    ASSERT_NE(be, nullptr);
    const int64_t N = 1280, D = 3072, O = 9216, F = 16384;
    Buf x = input({N, D}, kBF16, kF32, 90), w1 = input({O, D}, kBF16, kF32, 91, -0.05, 0.05);
    Buf w2 = input({F, D}, kBF16, kF32, 92, -0.05, 0.05);
    struct Outs {
      std::unique_ptr<DevTensor> y1, y2, y3;
    };
    const auto make_outs = [&] {
      Outs o;
      o.y1 = std::make_unique<DevTensor>(*cuda_, kBF16, std::vector<int64_t>{N, O});
      o.y2 = std::make_unique<DevTensor>(*cuda_, kBF16, std::vector<int64_t>{N, F});
      o.y3 = std::make_unique<DevTensor>(*cuda_, kBF16, std::vector<int64_t>{N, O});
      return o;
    };
    const auto queue = [&](const Outs& o) {
      cuda_->gemm(x.d(), false, w1.d(), true, o.y1->t, 1.0, 0.0);
      cuda_->scale(o.y1->t, 0.5);
      Tensor y1s = o.y1->t;  // [N, D] columns 0..D−1 of y1, row stride O
      y1s.shape[1] = D;
      cuda_->gemm(y1s, false, w2.d(), true, o.y2->t, 1.0, 0.0);
      cuda_->scale(o.y2->t, 2.0);
      cuda_->gemm(x.d(), false, w1.d(), true, o.y3->t, 1.0, 0.0);
    };
    Outs eager = make_outs(), graph = make_outs();
    const int64_t moved_before = be->graph_memsets_moved();
    std::unique_ptr<Graph> g;
    ASSERT_TRUE(cuda_->capture([&] { queue(graph); }, &g).is_ok());
    const int64_t moved = be->graph_memsets_moved() - moved_before;
    EXPECT_LE(moved, 3);
    cudaDeviceProp prop{};
    ASSERT_EQ(cudaGetDeviceProperties(&prop, be->device_id()), cudaSuccess);
    if (prop.major == 9) {
      EXPECT_EQ(moved, 3) << "cuBLASLt's memsets before these gemms were not gathered on this sm_90";
    }
    std::printf("memsets gathered: %lld\n", static_cast<long long>(moved));
    for (uint64_t seed : {93u, 94u}) {
      Buf fresh = input({N, D}, kBF16, kF32, seed);
      cuda_->copy(x.d(), fresh.d());
      for (const Outs* o : {&eager, &graph}) {  // stale outputs must not pass for results
        cuda_->fill(o->y1->t, 0.0);
        cuda_->fill(o->y2->t, 0.0);
        cuda_->fill(o->y3->t, 0.0);
      }
      queue(eager);
      g->launch();
      if (seed == 94u) {  // a replay right after another: every counter must be back at zero
        cuda_->fill(graph.y2->t, 0.0);
        g->launch();
      }
      EXPECT_TRUE(same_bytes(graph.y1->t, eager.y1->t)) << "seed " << seed;
      EXPECT_TRUE(same_bytes(graph.y2->t, eager.y2->t)) << "seed " << seed;
      EXPECT_TRUE(same_bytes(graph.y3->t, eager.y3->t)) << "seed " << seed;
      EXPECT_FALSE(same_bytes(graph.y1->t, graph.y3->t));  // y1 was halved after its gemm
    }
  };
  check();
  ::setenv("LAPLACE_GRAPH_COUNTERS", "head", 1);
  std::string why;
  std::unique_ptr<Backend> head = make_cuda_backend(&why);
  ::unsetenv("LAPLACE_GRAPH_COUNTERS");
  ASSERT_NE(head, nullptr) << why;
  std::swap(cuda_, head);  // input(), same_bytes() and the rest use cuda_
  {
    SCOPED_TRACE("counters zeroed at the graph's head");
    check();
  }
  std::swap(cuda_, head);
}

// Gemm tuning (gemm_tune in cuda_backend.cpp): the first eager call of a large shape times
// cuBLASLt's candidates on its operands and may switch to another. At laplace-3b's decode
// shapes (β = 0 with BF16 and F32 outputs, and the residual add in place with β = 1) the
// outputs must be the bytes of a backend that does not tune, on the tuning call and on a later
// one with new inputs. On sm_90 every one of these shapes has candidates with the pick's bytes
// (experiments/gemm/algo), so each must have been timed.
TEST_F(CudaOps, GemmTuningKeepsTheHeuristicPicksBytes) {
  auto* be = dynamic_cast<CudaBackend*>(cuda_.get());
  ASSERT_NE(be, nullptr);
  std::string why;
  std::unique_ptr<Backend> plain_owner = make_cuda_backend(&why);
  auto* plain = dynamic_cast<CudaBackend*>(plain_owner.get());
  ASSERT_NE(plain, nullptr) << why;
  plain->set_tuning(false);
  be->set_tuning(true);
  const int64_t M = 1280, D = 3072, O = 9216, F = 8192, W = 16384;
  Buf x = input({M, D}, kBF16, kF32, 95), w1 = input({O, D}, kBF16, kF32, 96, -0.05, 0.05);
  Buf w2 = input({W, D}, kBF16, kF32, 97, -0.05, 0.05), w3 = input({D, F}, kBF16, kF32, 98, -0.05, 0.05);
  Buf h = input({M, F}, kBF16, kF32, 99), r = input({M, D}, kBF16, kF32, 100);
  DevTensor y1(*cuda_, kBF16, {M, O}), y2(*cuda_, kF32, {M, W}), y3(*cuda_, kBF16, {M, D});
  DevTensor z1(*cuda_, kBF16, {M, O}), z2(*cuda_, kF32, {M, W}), z3(*cuda_, kBF16, {M, D});
  const auto queue = [&](Backend& b, DevTensor& o1, DevTensor& o2, DevTensor& o3) {
    b.gemm(x.d(), false, w1.d(), true, o1.t, 1.0, 0.0);
    b.gemm(x.d(), false, w2.d(), true, o2.t, 1.0, 0.0);
    b.copy(o3.t, r.d());
    b.gemm(h.d(), false, w3.d(), true, o3.t, 1.0, 1.0);  // o3 += h·w3ᵀ
  };
  const int64_t tuned_before = be->gemm_shapes_tuned();
  for (uint64_t seed : {101u, 102u}) {
    if (seed == 102u) {  // new inputs: the tuned plans are reused
      Buf fresh = input({M, D}, kBF16, kF32, seed), fresh_h = input({M, F}, kBF16, kF32, seed + 10);
      cuda_->copy(x.d(), fresh.d());
      cuda_->copy(h.d(), fresh_h.d());
    }
    cuda_->synchronize();
    queue(*cuda_, y1, y2, y3);
    cuda_->synchronize();
    queue(*plain, z1, z2, z3);
    plain->synchronize();
    EXPECT_TRUE(same_bytes(y1.t, z1.t)) << "qkvg-shaped, BF16 out, seed " << seed;
    EXPECT_TRUE(same_bytes(y2.t, z2.t)) << "w12-shaped, F32 out, seed " << seed;
    EXPECT_TRUE(same_bytes(y3.t, z3.t)) << "w3-shaped, in place, β = 1, seed " << seed;
    EXPECT_FALSE(same_bytes(y3.t, r.d()));  // the residual add did add
  }
  const int64_t tuned = be->gemm_shapes_tuned() - tuned_before;
  std::printf("gemm shapes tuned: %lld, switched from the heuristic's pick so far: %lld\n",
              static_cast<long long>(tuned), static_cast<long long>(be->gemm_shapes_switched()));
  EXPECT_LE(tuned, 3);
  EXPECT_EQ(plain->gemm_shapes_tuned(), 0);
  cudaDeviceProp prop{};
  ASSERT_EQ(cudaGetDeviceProperties(&prop, be->device_id()), cudaSuccess);
  if (prop.major == 9) {
    EXPECT_EQ(tuned, 3) << "these shapes' candidates were not timed on this sm_90";
  }
}
#endif  // LAPLACE_HAVE_CUDA

// ---- conv + SiLU -----------------------------------------------------------------------------

TEST_F(CudaOps, ConvSiluWindowsSlotsAndBackward) {
  const int64_t B = 2, T = 150, D = 3072, K = 4, S = 3;
  Buf slots = ints({2, 0});
  for (DType dt : {kF32, kBF16}) {
    SCOPED_TRACE(dtype_name(dt));
    const double tol_act = dt == kF32 ? 1e-5 : 1e-2;
    Buf u = input({B, T, D}, dt, kF32, 50), w = input({D, K}, dt, kF32, 51, -0.7, 0.7);
    Buf c = zeros({B, T, D}, dt, kF32), pre = zeros({B, T, D}, dt, kF32);
    Buf win = input({S, K, D}, kF32, kF32, 52);  // pool; win_out aliases win_in
    cpu_->conv_silu_forward(u.r(), w.r(), c.r(), pre.r(), win.r(), win.r(), slots.r());
    cuda_->conv_silu_forward(u.d(), w.d(), c.d(), pre.d(), win.d(), win.d(), slots.d());
    EXPECT_LE(err(c), tol_act);
    EXPECT_LE(err(pre), tol_act);
    EXPECT_EQ(err(win), 0.0);  // copies of inputs (slot 1 untouched)
    // decode-sized call (T = 2 < K) continuing from the pool
    Buf u2 = input({B, 2, D}, dt, kF32, 53), c2 = zeros({B, 2, D}, dt, kF32);
    cpu_->conv_silu_forward(u2.r(), w.r(), c2.r(), Tensor{}, win.r(), win.r(), slots.r());
    cuda_->conv_silu_forward(u2.d(), w.d(), c2.d(), Tensor{}, win.d(), win.d(), slots.d());
    EXPECT_LE(err(c2), tol_act);
    EXPECT_EQ(err(win), 0.0);
    // no input window, window output by batch row
    Buf wo = zeros({B, K, D}, kF32, kF32);
    cpu_->conv_silu_forward(u.r(), w.r(), c.r(), pre.r(), Tensor{}, wo.r(), Tensor{});
    cuda_->conv_silu_forward(u.d(), w.d(), c.d(), pre.d(), Tensor{}, wo.d(), Tensor{});
    EXPECT_LE(err(c), tol_act);
    EXPECT_EQ(err(wo), 0.0);
    // backward (zero initial window), with and without pre; both sides read the GPU's pre
    adopt(pre);
    Buf dc = input({B, T, D}, dt, kF32, 54), du = zeros({B, T, D}, dt, kF32), dw = input({D, K}, kF32, kF32, 55);
    Buf dw_ref32 = input({D, K}, kF32, kF32, 55);
    cpu_->conv_silu_backward(dc.r(), u.r(), w.r(), pre.r(), du.r(), dw.r());
    cuda_->conv_silu_backward(dc.d(), u.d(), w.d(), pre.d(), du.d(), dw.d());
    EXPECT_LE(err(du), tol_act);
    EXPECT_LE(err(dw), 1e-4);
    Buf du2 = zeros({B, T, D}, dt, kF32);
    cuda_->conv_silu_backward(dc.d(), u.d(), w.d(), Tensor{}, du2.d(), dw_ref32.d());
    EXPECT_LE(max_rel_error(down(du2.d())->t, du.r()), tol_act);
    if (dt == kF32) {
      EXPECT_LE(max_rel_error(down(dw_ref32.d())->t, dw.r()), 1e-4);
    }
    Buf dw3 = input({D, K}, kF32, kF32, 55);
    cuda_->conv_silu_backward(dc.d(), u.d(), w.d(), pre.d(), Tensor{}, dw3.d());
    EXPECT_TRUE(same_bytes(dw3.d(), dw.d()));
  }
}

// ---- RMSNorm × gate ---------------------------------------------------------------------------

TEST_F(CudaOps, RmsNormGateStridedGate) {
  const int64_t B = 2, T = 150, H = 16, dv = 192;
  for (DType dt : {kF32, kBF16}) {
    SCOPED_TRACE(dtype_name(dt));
    const double tol_act = dt == kF32 ? 1e-5 : 1e-2;
    Buf o = input({B, T, H, dv}, dt, kF32, 60, -2, 2), g = input({B, T, H, dv}, dt, kF32, 61, -3, 3);
    Buf w = input({dv}, dt, kF32, 62, 0.5, 1.5);
    // on the GPU, g is a view into a fused [B, T, 2·H·dv] buffer (like the qkvg projection)
    DevTensor fused(*cuda_, dt, {B, T, 2 * H * dv});
    Tensor gv = head_view(fused.t, H * dv, H, dv);
    cuda_->copy(gv, g.d());
    Buf y = zeros({B, T, H, dv}, dt, kF32), rstd = zeros({B, T, H}, kF32, kF32);
    cpu_->rmsnorm_gate_forward(o.r(), g.r(), w.r(), 1e-5, y.r(), rstd.r());
    cuda_->rmsnorm_gate_forward(o.d(), gv, w.d(), 1e-5, y.d(), rstd.d());
    EXPECT_LE(err(y), tol_act);
    EXPECT_LE(err(rstd), 1e-5);
    Buf dy = input({B, T, H, dv}, dt, kF32, 63), d_o = zeros({B, T, H, dv}, dt, kF32),
        dg = zeros({B, T, H, dv}, dt, kF32), dw = input({dv}, kF32, kF32, 64);
    cpu_->rmsnorm_gate_backward(dy.r(), o.r(), g.r(), w.r(), rstd.r(), d_o.r(), dg.r(), dw.r());
    cuda_->rmsnorm_gate_backward(dy.d(), o.d(), gv, w.d(), rstd.d(), d_o.d(), dg.d(), dw.d());
    EXPECT_LE(err(d_o), tol_act);
    EXPECT_LE(err(dg), tol_act);
    EXPECT_LE(err(dw), 1e-4);
    Buf dw2 = input({dv}, kF32, kF32, 64);
    cuda_->rmsnorm_gate_backward(dy.d(), o.d(), gv, w.d(), rstd.d(), Tensor{}, Tensor{}, dw2.d());
    EXPECT_TRUE(same_bytes(dw2.d(), dw.d()));
  }
}

// ---- optimizer ---------------------------------------------------------------------------------

TEST_F(CudaOps, SumSquares) {
  for (DType dt : {kF32, kBF16}) {
    SCOPED_TRACE(dtype_name(dt));
    Buf x = input({1024, 3072}, dt, kF32, 90);
    const double ref = cpu_->sum_squares(x.r());
    const double a = cuda_->sum_squares(x.d()), b = cuda_->sum_squares(x.d());
    EXPECT_LE(std::fabs(a - ref) / ref, 1e-10);
    EXPECT_EQ(a, b);
    // a strided view
    Tensor sl = x.d().slice(1, 100, 2100);
    const double rs = cpu_->sum_squares(x.r().slice(1, 100, 2100));
    EXPECT_LE(std::fabs(cuda_->sum_squares(sl) - rs) / rs, 1e-10);
  }
}

// Greedy token selection at the real vocabulary: every row's argmax equals the CPU's,
// including planted ties (lowest index wins) and a strided view.
TEST_F(CudaOps, ArgmaxRowsVocabWithTies) {
  const int64_t R = 67, V = 92160;
  Buf x = input({R, V}, kF32, kF32, 95);
  auto h = down(x.d());
  float* hp = static_cast<float*>(h->t.data);
  float* rp = static_cast<float*>(x.r().data);
  for (int64_t r = 0; r < R; ++r) {  // a tie of the row's maximum at two places
    const int64_t a = (r * 7919) % V, b = (r * 104729 + 11) % V;
    hp[r * V + a] = hp[r * V + b] = rp[r * V + a] = rp[r * V + b] = 2.0f;
  }
  cuda_->copy(x.d(), h->t);
  Buf out = zeros({R}, DType::kI32, DType::kI32);
  cpu_->argmax_rows(x.r(), out.r());
  cuda_->argmax_rows(x.d(), out.d());
  auto got = down(out.d());
  EXPECT_EQ(0, std::memcmp(got->t.data, out.r().data, R * sizeof(int32_t)));
  for (int64_t r = 0; r < R; ++r) {
    const int64_t a = (r * 7919) % V, b = (r * 104729 + 11) % V;
    EXPECT_EQ(static_cast<const int32_t*>(got->t.data)[r], static_cast<int32_t>(std::min(a, b))) << "row " << r;
  }
  Buf strided = zeros({R}, DType::kI32, DType::kI32);
  cpu_->argmax_rows(x.r().slice(1, 5, V - 3), strided.r());
  cuda_->argmax_rows(x.d().slice(1, 5, V - 3), strided.d());
  EXPECT_EQ(0, std::memcmp(down(strided.d())->t.data, strided.r().data, R * sizeof(int32_t)));
}

// Per-row Σx² (the distributed global norm's partials): each row vs the CPU's left-to-right
// F64 sum, and a row shard gives the same bits as those rows of the whole matrix.
TEST_F(CudaOps, RowSumSquaresRowsAndShards) {
  for (DType dt : {kF32, kBF16}) {
    SCOPED_TRACE(dtype_name(dt));
    Buf x = input({777, 3072}, dt, kF32, 91);
    Buf whole = zeros({777}, kF64, kF64), shard = zeros({200}, kF64, kF64);
    cpu_->row_sum_squares(x.r(), whole.r());
    cuda_->row_sum_squares(x.d(), whole.d());
    cuda_->row_sum_squares(x.d().slice(0, 300, 500), shard.d());
    auto w = down(whole.d()), s = down(shard.d());
    const double* wd = static_cast<const double*>(w->t.data);
    const double* ref = static_cast<const double*>(whole.r().data);
    for (int64_t r = 0; r < 777; ++r) EXPECT_LE(std::fabs(wd[r] - ref[r]) / ref[r], 1e-12) << "row " << r;
    EXPECT_EQ(0, std::memcmp(wd + 300, s->t.data, 200 * sizeof(double)));
  }
}

TEST_F(CudaOps, AdamWAndMuon) {
  const int64_t R = 1024, C = 3072;
  for (DType gdt : {kF32, kBF16}) {
    SCOPED_TRACE(dtype_name(gdt));
    Buf w = input({R, C}, kF32, kF32, 100), g = input({R, C}, gdt, kF32, 101, -0.01, 0.01);
    Buf m = input({R, C}, kF32, kF32, 102, -0.01, 0.01), v = input({R, C}, kF32, kF32, 103, 0, 1e-4);
    AdamWParams p;
    p.lr = 3e-4;
    p.wd = 0.1;
    p.step = 7;
    cpu_->adamw_update(w.r(), g.r(), m.r(), v.r(), p);
    cuda_->adamw_update(w.d(), g.d(), m.d(), v.d(), p);
    EXPECT_LE(err(w), 1e-6);
    EXPECT_LE(err(m), 1e-6);
    EXPECT_LE(err(v), 1e-6);
    for (bool nesterov : {true, false}) {
      Buf mm = input({R, C}, kF32, kF32, 104), u = zeros({R, C}, kF32, kF32);
      cpu_->muon_momentum(g.r(), mm.r(), u.r(), 0.95, nesterov);
      cuda_->muon_momentum(g.d(), mm.d(), u.d(), 0.95, nesterov);
      EXPECT_LE(err(mm), 1e-6);
      EXPECT_LE(err(u), 1e-6);
    }
    Buf o = input({R, C}, gdt, kF32, 105);
    cpu_->muon_apply(w.r(), o.r(), 0.02, 0.1, 0.2 * std::sqrt(3072.0));
    cuda_->muon_apply(w.d(), o.d(), 0.02, 0.1, 0.2 * std::sqrt(3072.0));
    EXPECT_LE(err(w), 1e-6);
  }
}

// ---- GLA ----------------------------------------------------------------------------------------

GlaParams gla_params(int64_t H, int64_t dk, int64_t chunk, GlaForm form = GlaForm::kChunked) {
  GlaParams p;
  p.form = form;
  p.chunk = chunk;
  p.scale = 1.0 / std::sqrt(static_cast<double>(dk));
  for (int64_t h = 0; h < H; ++h) p.decay.push_back(1.0 - std::ldexp(1.0, -5 - static_cast<int>(h)));
  return p;
}

// laplace-3b mixer shapes: BF16 q/k/v (views into a fused qkvg buffer on the GPU), F32
// states, vs the F64 CPU evaluation of the same bf16-rounded inputs.
TEST_F(CudaOps, GlaForwardBackwardBF16VsF64) {
  const int64_t B = 2, T = 300, H = 16, dk = 96, dv = 192, W = H * (2 * dk + 2 * dv);
  const GlaParams p = gla_params(H, dk, 128);
  Buf q = input({B, T, H, dk}, kBF16, kF64, 110), k = input({B, T, H, dk}, kBF16, kF64, 111),
      v = input({B, T, H, dv}, kBF16, kF64, 112);
  DevTensor qkvg(*cuda_, kBF16, {B, T, W});
  const Tensor qd = head_view(qkvg.t, 0, H, dk), kd = head_view(qkvg.t, H * dk, H, dk),
               vd = head_view(qkvg.t, 2 * H * dk, H, dv);
  cuda_->copy(qd, q.d());
  cuda_->copy(kd, k.d());
  cuda_->copy(vd, v.d());
  // state pool of 3 slots, batch rows in slots {2, 0}; s_out aliases s_in
  Buf pool = input({3, H, dk, dv}, kF32, kF64, 113);
  Buf slots = ints({2, 0});
  Buf o = zeros({B, T, H, dv}, kBF16, kF64);
  auto pool0 = down(pool.d());  // the initial states, for the backward
  cpu_->gla_forward(p, q.r(), k.r(), v.r(), o.r(), pool.r(), pool.r(), slots.r());
  cuda_->gla_forward(p, qd, kd, vd, o.d(), pool.d(), pool.d(), slots.d());
  EXPECT_LE(rms(o), 2.5e-3);
  EXPECT_LE(rms(pool), 1e-5);
  // backward, states by batch row: s_in[b] = initial pool[slots[b]]
  Buf s_in = zeros({B, H, dk, dv}, kF32, kF64);
  {
    auto h = host_tensor(kF32, {B, H, dk, dv});
    const int64_t plane = H * dk * dv;
    const int sl[2] = {2, 0};
    for (int64_t b = 0; b < B; ++b) {
      std::memcpy(static_cast<float*>(h->t.data) + b * plane, static_cast<float*>(pool0->t.data) + sl[b] * plane,
                  plane * 4);
      for (int64_t i = 0; i < plane; ++i)
        static_cast<double*>(s_in.r().data)[b * plane + i] = static_cast<float*>(h->t.data)[b * plane + i];
    }
    cuda_->copy(s_in.d(), h->t);
  }
  Buf d_o = input({B, T, H, dv}, kBF16, kF64, 114), ds_out = input({B, H, dk, dv}, kF32, kF64, 115);
  Buf dq = zeros({B, T, H, dk}, kBF16, kF64), dk_ = zeros({B, T, H, dk}, kBF16, kF64),
      dv_ = zeros({B, T, H, dv}, kBF16, kF64), ds_in = zeros({B, H, dk, dv}, kF32, kF64);
  cpu_->gla_backward(p, q.r(), k.r(), v.r(), s_in.r(), d_o.r(), ds_out.r(), dq.r(), dk_.r(), dv_.r(), ds_in.r());
  cuda_->gla_backward(p, qd, kd, vd, s_in.d(), d_o.d(), ds_out.d(), dq.d(), dk_.d(), dv_.d(), ds_in.d());
  EXPECT_LE(rms(dq), 5e-3);
  EXPECT_LE(rms(dk_), 5e-3);
  EXPECT_LE(rms(dv_), 5e-3);
  EXPECT_LE(rms(ds_in), 5e-3);
  // determinism
  DevTensor o2(*cuda_, kBF16, {B, T, H, dv}), dq2(*cuda_, kBF16, {B, T, H, dk}), dk2(*cuda_, kBF16, {B, T, H, dk}),
      dv2(*cuda_, kBF16, {B, T, H, dv}), dsi2(*cuda_, kF32, {B, H, dk, dv}), so2(*cuda_, kF32, {B, H, dk, dv});
  cuda_->gla_forward(p, qd, kd, vd, o2.t, s_in.d(), so2.t, Tensor{});
  EXPECT_TRUE(same_bytes(o2.t, o.d()));
  cuda_->gla_backward(p, qd, kd, vd, s_in.d(), d_o.d(), ds_out.d(), dq2.t, dk2.t, dv2.t, dsi2.t);
  EXPECT_TRUE(same_bytes(dq2.t, dq.d()));
  EXPECT_TRUE(same_bytes(dk2.t, dk_.d()));
  EXPECT_TRUE(same_bytes(dv2.t, dv_.d()));
  EXPECT_TRUE(same_bytes(dsi2.t, ds_in.d()));
}

// F32 inputs, small and maximal head dims, short tail chunks, every form, optional states.
TEST_F(CudaOps, GlaF32ShapesAndForms) {
  struct Case {
    int64_t B, T, H, dk, dv, chunk;
    GlaForm form;
    bool states;
  };
  const Case cases[] = {
      {3, 37, 2, 16, 32, 8, GlaForm::kChunked, true},   {2, 37, 2, 16, 32, 128, GlaForm::kRecurrent, false},
      {1, 20, 3, 32, 64, 5, GlaForm::kQuadratic, true}, {1, 70, 2, 128, 256, 128, GlaForm::kChunked, true},
      {2, 1, 4, 96, 192, 128, GlaForm::kRecurrent, true},
  };
  uint64_t seed = 200;
  for (const Case& c : cases) {
    char trace[96];
    std::snprintf(trace, sizeof(trace), "B%lld T%lld H%lld dk%lld dv%lld chunk%lld", static_cast<long long>(c.B),
                  static_cast<long long>(c.T), static_cast<long long>(c.H), static_cast<long long>(c.dk),
                  static_cast<long long>(c.dv), static_cast<long long>(c.chunk));
    SCOPED_TRACE(trace);
    const GlaParams p = gla_params(c.H, c.dk, c.chunk, c.form);
    Buf q = input({c.B, c.T, c.H, c.dk}, kF32, kF64, seed++), k = input({c.B, c.T, c.H, c.dk}, kF32, kF64, seed++),
        v = input({c.B, c.T, c.H, c.dv}, kF32, kF64, seed++);
    Buf o = zeros({c.B, c.T, c.H, c.dv}, kF32, kF64);
    Buf s_in = input({c.B, c.H, c.dk, c.dv}, kF32, kF64, seed++), s_out = zeros({c.B, c.H, c.dk, c.dv}, kF32, kF64);
    const Tensor si_r = c.states ? s_in.r() : Tensor{}, si_d = c.states ? s_in.d() : Tensor{};
    cpu_->gla_forward(p, q.r(), k.r(), v.r(), o.r(), si_r, s_out.r(), Tensor{});
    cuda_->gla_forward(p, q.d(), k.d(), v.d(), o.d(), si_d, s_out.d(), Tensor{});
    EXPECT_LE(rms(o), 1e-5);
    EXPECT_LE(rms(s_out), 1e-5);
    Buf d_o = input({c.B, c.T, c.H, c.dv}, kF32, kF64, seed++), ds_out = input({c.B, c.H, c.dk, c.dv}, kF32, kF64, seed++);
    Buf dq = zeros({c.B, c.T, c.H, c.dk}, kF32, kF64), dk_ = zeros({c.B, c.T, c.H, c.dk}, kF32, kF64),
        dv_ = zeros({c.B, c.T, c.H, c.dv}, kF32, kF64), ds_in = zeros({c.B, c.H, c.dk, c.dv}, kF32, kF64);
    const Tensor dso_r = c.states ? ds_out.r() : Tensor{}, dso_d = c.states ? ds_out.d() : Tensor{};
    GlaParams pc = p;
    pc.form = GlaForm::kChunked;  // the CPU backward is chunk-wise
    cpu_->gla_backward(pc, q.r(), k.r(), v.r(), si_r, d_o.r(), dso_r, dq.r(), dk_.r(), dv_.r(), ds_in.r());
    cuda_->gla_backward(p, q.d(), k.d(), v.d(), si_d, d_o.d(), dso_d, dq.d(), dk_.d(), dv_.d(), ds_in.d());
    EXPECT_LE(rms(dq), 2e-5);
    EXPECT_LE(rms(dk_), 2e-5);
    EXPECT_LE(rms(dv_), 2e-5);
    EXPECT_LE(rms(ds_in), 2e-5);
  }
}

// The tensor-core path (dk = 96, dv = 192, bf16): sequences shorter than one chunk, a whole
// number of chunks and a short tail chunk, with and without states, F32 outputs, and partial
// gradient requests (each must equal the same gradient of a full request, bytewise).
TEST_F(CudaOps, GlaTensorCorePathShapes) {
  struct Case {
    int64_t B, T, H;
    bool states;
    DType out;
  };
  const Case cases[] = {{1, 32, 2, true, kBF16}, {3, 129, 3, false, kBF16}, {2, 256, 2, true, kF32},
                        {1, 383, 4, true, kBF16}};
  const int64_t dk = 96, dv = 192;
  uint64_t seed = 400;
  for (const Case& c : cases) {
    char trace[96];
    std::snprintf(trace, sizeof(trace), "B%lld T%lld H%lld states %d", static_cast<long long>(c.B),
                  static_cast<long long>(c.T), static_cast<long long>(c.H), c.states ? 1 : 0);
    SCOPED_TRACE(trace);
    const GlaParams p = gla_params(c.H, dk, 128);
    Buf q = input({c.B, c.T, c.H, dk}, kBF16, kF64, seed++), k = input({c.B, c.T, c.H, dk}, kBF16, kF64, seed++),
        v = input({c.B, c.T, c.H, dv}, kBF16, kF64, seed++);
    Buf o = zeros({c.B, c.T, c.H, dv}, c.out, kF64);
    Buf s_in = input({c.B, c.H, dk, dv}, kF32, kF64, seed++), s_out = zeros({c.B, c.H, dk, dv}, kF32, kF64);
    const Tensor si_r = c.states ? s_in.r() : Tensor{}, si_d = c.states ? s_in.d() : Tensor{};
    cpu_->gla_forward(p, q.r(), k.r(), v.r(), o.r(), si_r, s_out.r(), Tensor{});
    cuda_->gla_forward(p, q.d(), k.d(), v.d(), o.d(), si_d, s_out.d(), Tensor{});
    EXPECT_LE(rms(o), 2.5e-3);
    EXPECT_LE(rms(s_out), 1e-5);
    Buf d_o = input({c.B, c.T, c.H, dv}, kBF16, kF64, seed++), ds_out = input({c.B, c.H, dk, dv}, kF32, kF64, seed++);
    Buf dq = zeros({c.B, c.T, c.H, dk}, c.out, kF64), dk_ = zeros({c.B, c.T, c.H, dk}, c.out, kF64),
        dv_ = zeros({c.B, c.T, c.H, dv}, c.out, kF64), ds_in = zeros({c.B, c.H, dk, dv}, kF32, kF64);
    const Tensor dso_r = c.states ? ds_out.r() : Tensor{}, dso_d = c.states ? ds_out.d() : Tensor{};
    cpu_->gla_backward(p, q.r(), k.r(), v.r(), si_r, d_o.r(), dso_r, dq.r(), dk_.r(), dv_.r(), ds_in.r());
    cuda_->gla_backward(p, q.d(), k.d(), v.d(), si_d, d_o.d(), dso_d, dq.d(), dk_.d(), dv_.d(), ds_in.d());
    EXPECT_LE(rms(dq), 5e-3);
    EXPECT_LE(rms(dk_), 5e-3);
    EXPECT_LE(rms(dv_), 5e-3);
    EXPECT_LE(rms(ds_in), 5e-3);
    // one gradient at a time
    DevTensor dq2(*cuda_, c.out, {c.B, c.T, c.H, dk}), dk2(*cuda_, c.out, {c.B, c.T, c.H, dk}),
        dv2(*cuda_, c.out, {c.B, c.T, c.H, dv}), dsi2(*cuda_, kF32, {c.B, c.H, dk, dv});
    cuda_->gla_backward(p, q.d(), k.d(), v.d(), si_d, d_o.d(), dso_d, dq2.t, Tensor{}, Tensor{}, Tensor{});
    cuda_->gla_backward(p, q.d(), k.d(), v.d(), si_d, d_o.d(), dso_d, Tensor{}, dk2.t, Tensor{}, Tensor{});
    cuda_->gla_backward(p, q.d(), k.d(), v.d(), si_d, d_o.d(), dso_d, Tensor{}, Tensor{}, dv2.t, Tensor{});
    cuda_->gla_backward(p, q.d(), k.d(), v.d(), si_d, d_o.d(), dso_d, Tensor{}, Tensor{}, Tensor{}, dsi2.t);
    EXPECT_TRUE(same_bytes(dq2.t, dq.d()));
    EXPECT_TRUE(same_bytes(dk2.t, dk_.d()));
    EXPECT_TRUE(same_bytes(dv2.t, dv_.d()));
    EXPECT_TRUE(same_bytes(dsi2.t, ds_in.d()));
  }
}

// Few long sequences (B·H·2 < 256 scan blocks): the forward state scan runs as parallel
// chunk groups joined by group_fix_kernel (kernels_gla_tc.cu v6): whole and partial last
// groups, a B = 1 prefill at the 3B head count, slot-indexed in-place states with other
// slots left alone, vs the F64 CPU evaluation of the same bf16 inputs (same bounds as above).
TEST_F(CudaOps, GlaTensorCoreChunkGroups) {
  struct Case {
    int64_t B, T, H;
  };
  // T=1100: 9 chunks in groups of 3 / T=1000: 8 chunks, groups of 2 / T=4096: 32 chunks, 8 groups of 4
  const Case cases[] = {{1, 1100, 4}, {2, 1000, 3}, {1, 4096, 16}};
  const int64_t dk = 96, dv = 192;
  uint64_t seed = 700;
  for (const Case& c : cases) {
    char trace[96];
    std::snprintf(trace, sizeof(trace), "B%lld T%lld H%lld", static_cast<long long>(c.B), static_cast<long long>(c.T),
                  static_cast<long long>(c.H));
    SCOPED_TRACE(trace);
    const GlaParams p = gla_params(c.H, dk, 128);
    Buf q = input({c.B, c.T, c.H, dk}, kBF16, kF64, seed++), k = input({c.B, c.T, c.H, dk}, kBF16, kF64, seed++),
        v = input({c.B, c.T, c.H, dv}, kBF16, kF64, seed++);
    Buf o = zeros({c.B, c.T, c.H, dv}, kBF16, kF64);
    // pool of B + 2 slots; row b in slot B + 1 − b; s_out aliases s_in
    Buf pool = input({c.B + 2, c.H, dk, dv}, kF32, kF64, seed++);
    std::vector<int32_t> sl;
    for (int64_t b = 0; b < c.B; ++b) sl.push_back(static_cast<int32_t>(c.B + 1 - b));
    Buf slots = ints(sl);
    auto before = down(pool.d());
    cpu_->gla_forward(p, q.r(), k.r(), v.r(), o.r(), pool.r(), pool.r(), slots.r());
    cuda_->gla_forward(p, q.d(), k.d(), v.d(), o.d(), pool.d(), pool.d(), slots.d());
    EXPECT_LE(rms(o), 2.5e-3);
    EXPECT_LE(rms(pool), 1e-5);
    auto after = down(pool.d());
    const int64_t plane = c.H * dk * dv * 4;
    for (int64_t s = 0; s < 2; ++s)  // slots 0 and 1 hold no batch row (rows use slots 2..B+1)
      EXPECT_EQ(std::memcmp(static_cast<char*>(before->t.data) + s * plane, static_cast<char*>(after->t.data) + s * plane,
                            plane),
                0)
          << "slot " << s << " is not in the batch and must keep its bytes";
    // the same forward again: bitwise the same output (fixed group plan, no atomics)
    DevTensor o2(*cuda_, kBF16, {c.B, c.T, c.H, dv});
    cuda_->gla_forward(p, q.d(), k.d(), v.d(), o2.t, Tensor{}, Tensor{}, Tensor{});
    DevTensor o3(*cuda_, kBF16, {c.B, c.T, c.H, dv});
    cuda_->gla_forward(p, q.d(), k.d(), v.d(), o3.t, Tensor{}, Tensor{}, Tensor{});
    EXPECT_TRUE(same_bytes(o2.t, o3.t));
  }
}

// Prefill T tokens, then decode one token in place on the slots: the last output equals
// that of one forward over T+1 tokens.
TEST_F(CudaOps, GlaDecodeContinuesPrefill) {
  const int64_t B = 2, T = 200, H = 16, dk = 96, dv = 192;
  const GlaParams p = gla_params(H, dk, 128);
  GlaParams pr = p;
  pr.form = GlaForm::kRecurrent;
  Buf q = input({B, T + 1, H, dk}, kF32, kF32, 300), k = input({B, T + 1, H, dk}, kF32, kF32, 301),
      v = input({B, T + 1, H, dv}, kF32, kF32, 302);
  DevTensor o_full(*cuda_, kF32, {B, T + 1, H, dv}), o_pre(*cuda_, kF32, {B, T, H, dv}), o_dec(*cuda_, kF32, {B, 1, H, dv});
  DevTensor pool(*cuda_, kF32, {4, H, dk, dv});
  Buf slots = ints({3, 1});
  cuda_->fill(pool.t, 0.0);
  cuda_->gla_forward(p, q.d(), k.d(), v.d(), o_full.t, Tensor{}, Tensor{}, Tensor{});
  cuda_->gla_forward(p, q.d().slice(1, 0, T), k.d().slice(1, 0, T), v.d().slice(1, 0, T), o_pre.t, Tensor{}, pool.t,
                     slots.d());
  cuda_->gla_forward(pr, q.d().slice(1, T, T + 1), k.d().slice(1, T, T + 1), v.d().slice(1, T, T + 1), o_dec.t,
                     pool.t, pool.t, slots.d());
  auto full = down(o_full.t), dec = down(o_dec.t), pre = down(o_pre.t);
  EXPECT_LE(max_rel_error(dec->t, full->t.slice(1, T, T + 1)), 1e-5);
  EXPECT_LE(max_rel_error(pre->t, full->t.slice(1, 0, T)), 1e-5);
}

// The decode kernel (T = 1, kernels_gla_decode.cu) at the model's shapes, slot-indexed
// into a pool with more slots than rows (odd B, scattered slots): vs the CPU recurrent form
// in F64 from the same rounded inputs, for an F32 and a BF16 pool. Slots not in the batch
// keep their bytes; the fused gate gives the bits of gla_forward + rmsnorm_gate_forward.
TEST_F(CudaOps, GlaDecodeSlotsF32Bf16StatesAndFusedGate) {
  const int64_t B = 37, S = 41, H = 16, dk = 96, dv = 192;
  GlaParams p = gla_params(H, dk, 128, GlaForm::kRecurrent);
  Buf q = input({B, 1, H, dk}, kBF16, kF64, 400), k = input({B, 1, H, dk}, kBF16, kF64, 401),
      v = input({B, 1, H, dv}, kBF16, kF64, 402), g = input({B, 1, H, dv}, kBF16, kF64, 403, -3, 3),
      w = input({dv}, kBF16, kF64, 404, 0.5, 1.5);
  std::vector<int32_t> sl(B);
  for (int64_t b = 0; b < B; ++b) sl[b] = static_cast<int32_t>((b * 7 + 3) % S);  // distinct (gcd(7, 41) = 1)
  Buf slots = ints(sl);
  for (DType sdt : {kF32, kBF16}) {
    SCOPED_TRACE(dtype_name(sdt));
    Buf pool = input({S, H, dk, dv}, sdt, kF64, 405);  // the reference starts from the rounded values
    auto before = down(pool.d());
    Buf o = zeros({B, 1, H, dv}, kBF16, kF64), y = zeros({B, 1, H, dv}, kBF16, kF64);
    cpu_->gla_forward(p, q.r(), k.r(), v.r(), o.r(), pool.r(), pool.r(), slots.r());
    cpu_->rmsnorm_gate_forward(o.r(), g.r(), w.r(), 1e-5, y.r(), Tensor{});
    // Unfused on a copy of the pool, then fused on the pool itself.
    DevTensor pool2(*cuda_, sdt, {S, H, dk, dv}), o2(*cuda_, kBF16, {B, 1, H, dv}), y2(*cuda_, kBF16, {B, 1, H, dv});
    cuda_->copy(pool2.t, pool.d());
    // BF16 states with contiguous rows take the bulk-copy kernel; the same states with padded
    // rows (row stride dv + 8) take the per-thread one, which must give the same bits.
    DevTensor padded(*cuda_, sdt, {S, H, dk, dv + 8}), o3(*cuda_, kBF16, {B, 1, H, dv}),
        y3(*cuda_, kBF16, {B, 1, H, dv}), pool3(*cuda_, sdt, {S, H, dk, dv});
    const Tensor pool_padded = padded.t.slice(3, 0, dv);
    cuda_->copy(pool_padded, pool.d());
    cuda_->gla_decode_gate(p, q.d(), k.d(), v.d(), g.d(), w.d(), 1e-5, pool_padded, slots.d(), o3.t, y3.t);
    cuda_->copy(pool3.t, pool_padded);
    cuda_->gla_forward(p, q.d(), k.d(), v.d(), o2.t, pool2.t, pool2.t, slots.d());
    cuda_->rmsnorm_gate_forward(o2.t, g.d(), w.d(), 1e-5, y2.t, Tensor{});
    cuda_->gla_decode_gate(p, q.d(), k.d(), v.d(), g.d(), w.d(), 1e-5, pool.d(), slots.d(), o.d(), y.d());
    EXPECT_TRUE(same_bytes(o.d(), o2.t));
    EXPECT_TRUE(same_bytes(y.d(), y2.t));
    EXPECT_TRUE(same_bytes(pool.d(), pool2.t));
    EXPECT_TRUE(same_bytes(o3.t, o2.t));
    EXPECT_TRUE(same_bytes(y3.t, y2.t));
    EXPECT_TRUE(same_bytes(pool3.t, pool2.t));
    // o and y are BF16 outputs (≤ 1e-2); y's norm reads the rounded o, the reference the exact one.
    EXPECT_LE(err(o), 1e-2);
    EXPECT_LE(err(y), 1.5e-2);
    // States: F32 arithmetic (≤ 1e-5), or one BF16 rounding of the result (≤ 2^-8 of the max).
    EXPECT_LE(err(pool), sdt == kF32 ? 1e-5 : 4e-3);
    auto after = down(pool.d());
    const size_t plane = static_cast<size_t>(H * dk * dv) * dtype_size(sdt);
    std::vector<bool> used(S, false);
    for (int32_t s : sl) used[s] = true;
    for (int64_t s = 0; s < S; ++s) {
      const char* a0 = static_cast<const char*>(before->t.data) + s * plane;
      const char* a1 = static_cast<const char*>(after->t.data) + s * plane;
      EXPECT_EQ(std::memcmp(a0, a1, plane) == 0, !used[s]) << "slot " << s;
    }
  }
}

// Deferred write-back (kernels_gla_decode.cu, GlaPending) at the model's shapes: pending
// pairs and count words start random (every m in [0, R) and phases d with m + d < R among the
// (slot, head)s, so write-backs fall on different steps, some with fewer than R − 1 pairs),
// then 2R + 3 decode steps with new q, k, v, g each, against the CPU
// reference in F64 from the same rounded values; then the flush op, after which the states
// are the true ones. Counts must match exactly; slots outside the batch keep every byte.
TEST_F(CudaOps, GlaDecodeDeferredVsCpuReferenceAndFlush) {
  const int64_t B = 37, S = 41, H = 16, dk = 96, dv = 192;
  GlaParams p = gla_params(H, dk, 128, GlaForm::kRecurrent);
  std::vector<int32_t> sl(B);
  for (int64_t b = 0; b < B; ++b) sl[b] = static_cast<int32_t>((b * 7 + 3) % S);  // distinct (gcd(7, 41) = 1)
  Buf slots = ints(sl);
  Buf w = input({dv}, kBF16, kF64, 504, 0.5, 1.5);
  for (int64_t R : {4, 8, 16}) {
    for (DType sdt : {kF32, kBF16}) {
      SCOPED_TRACE(std::string(dtype_name(sdt)) + " R " + std::to_string(R));
      const int64_t P = R - 1;
      Buf pool = input({S, H, dk, dv}, sdt, kF64, 505);
      Buf pk = input({S, H, P, dk}, kBF16, kF64, 506), pv = input({S, H, P, dv}, kBF16, kF64, 507);
      std::vector<int32_t> counts(S * H);
      for (size_t i = 0; i < counts.size(); ++i) {  // count words (m, d), m + d < R: some cycles shortened
        const int32_t m = static_cast<int32_t>((i * 5 + 1) % R);
        counts[i] = pending_word(m, static_cast<int32_t>((i * 3) % (R - m)));
      }
      Buf cnt = ints(counts);
      auto pend = [&](bool dev) {
        GlaPending g;
        g.k = dev ? pk.d() : pk.r();
        g.v = dev ? pv.d() : pv.r();
        g.count = (dev ? cnt.d() : cnt.r()).reshape({S, H});
        g.steps = R;
        return g;
      };
      // A BF16 pool with contiguous rows takes the bulk-copy kernel; the same states with padded
      // rows (row stride dv + 8), with copies of the pairs and counts, take the per-thread one,
      // which must give the same bits at every step.
      DevTensor padded(*cuda_, sdt, {S, H, dk, dv + 8}), pk2(*cuda_, kBF16, {S, H, P, dk}),
          pv2(*cuda_, kBF16, {S, H, P, dv}), cnt2(*cuda_, DType::kI32, {S, H}), pool2(*cuda_, sdt, {S, H, dk, dv});
      const Tensor pool_padded = padded.t.slice(3, 0, dv);
      cuda_->copy(pool_padded, pool.d());
      cuda_->copy(pk2.t, pk.d());
      cuda_->copy(pv2.t, pv.d());
      cuda_->copy(cnt2.t, cnt.d().reshape({S, H}));
      const GlaPending pend2{pk2.t, pv2.t, cnt2.t, R};
      auto before = down(pool.d());
      auto pk_before = down(pk.d());
      double worst_o = 0, worst_y = 0;
      int64_t attr_calls = kernel_attr_calls();
      for (int64_t t = 0; t < 2 * R + 3; ++t) {
        const uint64_t sd = 600 + 10 * t;
        Buf q = input({B, 1, H, dk}, kBF16, kF64, sd), k = input({B, 1, H, dk}, kBF16, kF64, sd + 1),
            v = input({B, 1, H, dv}, kBF16, kF64, sd + 2), g = input({B, 1, H, dv}, kBF16, kF64, sd + 3, -3, 3);
        Buf o = zeros({B, 1, H, dv}, kBF16, kF64), y = zeros({B, 1, H, dv}, kBF16, kF64);
        cpu_->gla_decode_gate_deferred(p, q.r(), k.r(), v.r(), g.r(), w.r(), 1e-5, pool.r(), pend(false), slots.r(),
                                       o.r(), y.r());
        cuda_->gla_decode_gate_deferred(p, q.d(), k.d(), v.d(), g.d(), w.d(), 1e-5, pool.d(), pend(true), slots.d(),
                                        o.d(), y.d());
        DevTensor o2(*cuda_, kBF16, {B, 1, H, dv}), y2(*cuda_, kBF16, {B, 1, H, dv});
        cuda_->gla_decode_gate_deferred(p, q.d(), k.d(), v.d(), g.d(), w.d(), 1e-5, pool_padded, pend2, slots.d(),
                                        o2.t, y2.t);
        // The bulk-copy kernel (BF16, contiguous rows) needs its shared-memory attributes raised:
        // at its first launch (a new kernel for each R), never again (CudaBackend::kernel_smem).
        if (t == 0 && sdt == kBF16) {
          EXPECT_GT(kernel_attr_calls(), attr_calls) << "first launch";
        }
        if (t == 0) attr_calls = kernel_attr_calls();
        EXPECT_EQ(kernel_attr_calls(), attr_calls) << "attributes set again at step " << t;
        EXPECT_TRUE(same_bytes(o2.t, o.d())) << "padded rows, o, step " << t;
        EXPECT_TRUE(same_bytes(y2.t, y.d())) << "padded rows, y, step " << t;
        worst_o = std::max(worst_o, err(o));
        worst_y = std::max(worst_y, err(y));
        auto c = down(cnt.d());
        ASSERT_EQ(std::memcmp(c->t.data, cnt.r().data, counts.size() * 4), 0) << "counts after step " << t;
      }
      cuda_->copy(pool2.t, pool_padded);
      EXPECT_TRUE(same_bytes(pool2.t, pool.d())) << "padded rows, states";
      EXPECT_TRUE(same_bytes(pk2.t, pk.d())) << "padded rows, pending k";
      EXPECT_TRUE(same_bytes(pv2.t, pv.d())) << "padded rows, pending v";
      EXPECT_TRUE(same_bytes(cnt2.t, cnt.d().reshape({S, H}))) << "padded rows, counts";
      // BF16 outputs (≤ 1e-2); y's norm reads the rounded o, the reference the exact one. A
      // BF16 pool's written-back states carry one rounding each (the reference none).
      EXPECT_LE(worst_o, sdt == kF32 ? 1e-2 : 2e-2);
      EXPECT_LE(worst_y, sdt == kF32 ? 1.5e-2 : 3e-2);
      // Slots outside the batch: states, pairs and counts untouched.
      auto after = down(pool.d());
      auto pk_after = down(pk.d());
      auto c_after = down(cnt.d());
      std::vector<bool> used(S, false);
      for (int32_t s : sl) used[s] = true;
      const size_t plane = static_cast<size_t>(H * dk * dv) * dtype_size(sdt), pplane = H * P * dk * 2;
      for (int64_t s = 0; s < S; ++s) {
        if (used[s]) continue;
        EXPECT_EQ(std::memcmp(static_cast<char*>(before->t.data) + s * plane,
                              static_cast<char*>(after->t.data) + s * plane, plane), 0) << "slot " << s;
        EXPECT_EQ(std::memcmp(static_cast<char*>(pk_before->t.data) + s * pplane,
                              static_cast<char*>(pk_after->t.data) + s * pplane, pplane), 0) << "slot " << s;
        for (int64_t h = 0; h < H; ++h)
          EXPECT_EQ(static_cast<int32_t*>(c_after->t.data)[s * H + h], counts[s * H + h]) << "slot " << s;
      }
      // The flush: states become the true ones and the count words (0, pending_phase(h, R)).
      cpu_->gla_pending_flush(p, pool.r(), pend(false), slots.r());
      cuda_->gla_pending_flush(p, pool.d(), pend(true), slots.d());
      EXPECT_LE(err(pool), sdt == kF32 ? 1e-5 : 1e-2);
      auto c = down(cnt.d());
      for (int32_t s : sl)
        for (int64_t h = 0; h < H; ++h)
          EXPECT_EQ(static_cast<int32_t*>(c->t.data)[s * H + h], pending_word(0, pending_phase(h, R)));
    }
  }
}

// Deferred decode against the plain decode kernel over 3R steps from the same start: the
// outputs agree to BF16 rounding and, after a flush, the states to F32 rounding order.
TEST_F(CudaOps, GlaDecodeDeferredTracksPlainDecode) {
  const int64_t B = 8, H = 16, dk = 96, dv = 192, R = 8;
  GlaParams p = gla_params(H, dk, 128, GlaForm::kRecurrent);
  Buf w = input({dv}, kBF16, kF64, 704, 0.5, 1.5);
  Buf plain = input({B, H, dk, dv}, kF32, kF64, 705);
  DevTensor deferred(*cuda_, kF32, {B, H, dk, dv}), pk(*cuda_, kBF16, {B, H, R - 1, dk}),
      pv(*cuda_, kBF16, {B, H, R - 1, dv}), cnt(*cuda_, DType::kI32, {B, H});
  cuda_->copy(deferred.t, plain.d());
  cuda_->fill(cnt.t, 0.0);
  GlaPending pend{pk.t, pv.t, cnt.t, R};
  std::vector<int32_t> ident(B);
  for (int64_t b = 0; b < B; ++b) ident[b] = static_cast<int32_t>(b);
  Buf slots = ints(ident);
  double worst = 0;
  for (int64_t t = 0; t < 3 * R + 2; ++t) {
    const uint64_t sd = 800 + 10 * t;
    Buf q = input({B, 1, H, dk}, kBF16, kF64, sd), k = input({B, 1, H, dk}, kBF16, kF64, sd + 1),
        v = input({B, 1, H, dv}, kBF16, kF64, sd + 2), g = input({B, 1, H, dv}, kBF16, kF64, sd + 3, -3, 3);
    DevTensor o1(*cuda_, kF32, {B, 1, H, dv}), y1(*cuda_, kBF16, {B, 1, H, dv}), o2(*cuda_, kF32, {B, 1, H, dv}),
        y2(*cuda_, kBF16, {B, 1, H, dv});
    cuda_->gla_decode_gate(p, q.d(), k.d(), v.d(), g.d(), w.d(), 1e-5, plain.d(), slots.d(), o1.t, y1.t);
    cuda_->gla_decode_gate_deferred(p, q.d(), k.d(), v.d(), g.d(), w.d(), 1e-5, deferred.t, pend, slots.d(), o2.t,
                                    y2.t);
    worst = std::max(worst, max_rel_error(down(o2.t)->t, down(o1.t)->t));
  }
  EXPECT_LE(worst, 1e-5) << "F32 outputs of the two schemes";
  cuda_->gla_pending_flush(p, deferred.t, pend, slots.d());
  EXPECT_LE(max_rel_error(down(deferred.t)->t, down(plain.d())->t), 1e-5);
}

// ---- device-scalar optimizer ops (no host sync): vs the CPU op / the ungated CUDA op ----

TEST_F(CudaOps, DeviceScalarOpsMatchHostScalarOps) {
  Buf x = input({1024, 3072}, kF32, kF32, 120), y = input({333, 7}, kBF16, kF32, 121);
  Buf s = zeros({4}, kF64, kF64);
  Tensor acc = s.d().slice(0, 0, 1);
  auto scalar_of = [&](const Tensor& d) {
    double h = 0;
    cuda_->copy(Tensor(&h, DType::kF64, {1}), d);
    return h;
  };
  // Σ x² into a device scalar: the bits of sum_squares, accumulated in F64 like the host.
  cuda_->sum_squares_into(x.d(), acc, false);
  cuda_->sum_squares_into(y.d(), acc, true);
  double want = 0;
  want += cuda_->sum_squares(x.d());
  want += cuda_->sum_squares(y.d());
  EXPECT_EQ(scalar_of(acc), want);
  const double cpu_ss = cpu_->sum_squares(x.r()) + cpu_->sum_squares(y.r());
  EXPECT_LE(std::fabs(scalar_of(acc) - cpu_ss) / cpu_ss, 1e-10);
  // {norm, coef, skip}: bitwise the CPU's (the same F64 sqrt/add/divide).
  for (double ss : std::vector<double>{0.25, 4.0, 1e6, 3.3e-5, HUGE_VAL, std::nan("")}) {
    for (double mx : {1.0, 0.0}) {
      double hs = ss, hc[3];
      cpu_->grad_clip_scalars(Tensor(&hs, DType::kF64, {1}), mx, Tensor(hc, DType::kF64, {3}));
      cuda_->copy(acc, Tensor(&hs, DType::kF64, {1}));
      cuda_->grad_clip_scalars(acc, mx, s.d().slice(0, 1, 4));
      double d[4];
      cuda_->copy(Tensor(d, DType::kF64, {4}), s.d());
      for (int i = 0; i < 3; ++i) {
        if (std::isnan(hc[i])) EXPECT_TRUE(std::isnan(d[i + 1])) << "ss " << ss << " field " << i;  // NaN payloads may differ
        else EXPECT_EQ(std::memcmp(&d[i + 1], &hc[i], sizeof(double)), 0) << "ss " << ss << " max " << mx << " field " << i;
      }
    }
  }
  // scale_by / scale_by_inv_norm: the bits of scale(x, coef) / scale(x, 1/(√ss + eps)).
  Buf a = input({513, 65}, kBF16, kF32, 122), b = input({513, 65}, kBF16, kF32, 122);
  double c = 0.3719, ssv = 17.25;
  cuda_->copy(acc, Tensor(&c, DType::kF64, {1}));
  cuda_->scale_by(a.d(), acc);
  cuda_->scale(b.d(), c);
  cuda_->copy(acc, Tensor(&ssv, DType::kF64, {1}));
  cuda_->scale_by_inv_norm(a.d(), acc, 1e-7);
  cuda_->scale(b.d(), 1.0 / (std::sqrt(ssv) + 1e-7));
  auto ha = down(a.d()), hb = down(b.d());
  EXPECT_EQ(std::memcmp(ha->t.data, hb->t.data, ha->t.nbytes()), 0);
  // loss_sum_into: the CPU's fixed-order F64 sum (core/fixed_sum.h), bit for bit.
  Buf l = input({5000}, kF32, kF32, 123, 0.0, 9.0);
  double hl = 0;
  cpu_->loss_sum_into(l.r(), 4999, Tensor(&hl, DType::kF64, {1}), false);
  cuda_->loss_sum_into(l.d(), 4999, acc, false);
  EXPECT_EQ(scalar_of(acc), hl);
  // ... and of an F64 vector (the sharded optimizer's per-row sums of squares), divided by 1.
  Buf r = input({70001}, kF64, kF64, 124, 0.0, 2.0);
  cpu_->loss_sum_into(r.r(), 1.0, Tensor(&hl, DType::kF64, {1}), false);
  cuda_->loss_sum_into(r.d(), 1.0, acc, false);
  EXPECT_EQ(scalar_of(acc), hl);
}

TEST_F(CudaOps, GatedOptimizerOpsSkipOrMatchUngated) {
  const std::vector<int64_t> shape = {300, 97};
  Buf g = input(shape, kBF16, kF32, 130, -0.1, 0.1);
  Buf w1 = input(shape, kF32, kF32, 131), w2 = input(shape, kF32, kF32, 131);
  Buf m1 = input(shape, kF32, kF32, 132, -0.01, 0.01), m2 = input(shape, kF32, kF32, 132, -0.01, 0.01);
  Buf v1 = input(shape, kF32, kF32, 133, 0, 0.01), v2 = input(shape, kF32, kF32, 133, 0, 0.01);
  Buf u1 = zeros(shape, kBF16, kF32), u2 = zeros(shape, kBF16, kF32);
  Buf sk = zeros({1}, kF64, kF64);
  AdamWParams p;
  p.lr = 0.01;
  p.wd = 0.1;
  p.step = 3;
  auto same = [&](const Buf& a, const Buf& b) {
    auto ha = down(a.d()), hb = down(b.d());
    return std::memcmp(ha->t.data, hb->t.data, ha->t.nbytes()) == 0;
  };
  double one = 1.0;
  cuda_->copy(sk.d(), Tensor(&one, DType::kF64, {1}));  // skip: nothing changes
  cuda_->adamw_update_gated(w1.d(), g.d(), m1.d(), v1.d(), p, sk.d());
  cuda_->muon_momentum_gated(g.d(), m1.d(), u1.d(), 0.95, true, sk.d());
  cuda_->muon_apply_gated(w1.d(), u1.d(), 0.01, 0.1, 2.0, sk.d());
  EXPECT_TRUE(same(w1, w2) && same(m1, m2) && same(v1, v2) && same(u1, u2));
  double zero = 0.0;
  cuda_->copy(sk.d(), Tensor(&zero, DType::kF64, {1}));  // not skipped: the ungated bits
  cuda_->adamw_update_gated(w1.d(), g.d(), m1.d(), v1.d(), p, sk.d());
  cuda_->adamw_update(w2.d(), g.d(), m2.d(), v2.d(), p);
  cuda_->muon_momentum_gated(g.d(), m1.d(), u1.d(), 0.95, true, sk.d());
  cuda_->muon_momentum(g.d(), m2.d(), u2.d(), 0.95, true);
  cuda_->muon_apply_gated(w1.d(), u1.d(), 0.01, 0.1, 2.0, sk.d());
  cuda_->muon_apply(w2.d(), u2.d(), 0.01, 0.1, 2.0);
  EXPECT_TRUE(same(w1, w2));
  EXPECT_TRUE(same(m1, m2));
  EXPECT_TRUE(same(v1, v2));
  EXPECT_TRUE(same(u1, u2));
  auto w0 = input(shape, kF32, kF32, 131);
  EXPECT_FALSE(same(w1, w0)) << "the unskipped update changed nothing";
}

}  // namespace
}  // namespace laplace
