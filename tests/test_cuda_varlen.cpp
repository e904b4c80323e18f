// Documents kept apart (varlen, GlaParams::doc and conv_silu's doc) on CUDA: the GLA mixer
// (tensor-core and generic paths, forward and backward, the chunk-group splits of both state
// scans) and the causal conv, against the CPU backend on the same inputs.
//
// Every test skips when make_cuda_backend() finds no usable GPU. Inputs are drawn once, rounded
// to the GPU dtype, and the CPU reference gets the same (rounded) values in F64 (GLA) or F32
// (conv). Tolerances (those of tests/test_cuda_ops.cpp):
//   GLA vs F64 CPU, relative RMS (testing::rms_rel_error), per batch row:
//     BF16 at dk = 96, dv = 192 (tensor cores)  o ≤ 2.5e-3, s_out ≤ 1e-5, dq/dk/dv/ds_in ≤ 5e-3
//     F32 (generic kernels)                     o, s_out ≤ 1e-5, gradients ≤ 2e-5
//   a row whose reference is exactly zero (ds_in of a row starting a document at 0) must be zero.
//   packed row vs its documents run alone (both CUDA): o ≤ 2.5e-3, s_out ≤ 2e-5 relative RMS
//   conv: F32 ≤ 1e-5, BF16 c/pre/du ≤ 1e-2 (max relative), dw ≤ 1e-4, windows exact
// Rows that keep one document (doc all −1) must give the bits of the same call without doc.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "ops/backend.h"
#include "tests/cuda_test_util.h"
#include "tests/test_util.h"

namespace laplace {
namespace {

using laplace::testing::max_rel_error;
using laplace::testing::OwnedTensor;
using laplace::testing::rms_rel_error;
using laplace::testing::round_to;

constexpr DType kF32 = DType::kF32, kBF16 = DType::kBF16, kF64 = DType::kF64, kI32 = DType::kI32;

using laplace::testing::Buf;
using laplace::testing::CudaVsCpu;
using laplace::testing::DevTensor;
using laplace::testing::host_tensor;
using laplace::testing::set_flat;


// Document-start rows (GlaParams::doc's form) from each row's starts: doc[t] = the last start
// ≤ t, −1 before the row's first.
std::vector<int32_t> doc_rows(int64_t T, const std::vector<std::vector<int64_t>>& starts) {
  std::vector<int32_t> d;
  for (const auto& row : starts) {
    std::vector<int64_t> s = row;
    std::sort(s.begin(), s.end());
    size_t k = 0;
    int32_t cur = -1;
    for (int64_t t = 0; t < T; ++t) {
      while (k < s.size() && s[k] <= t) cur = static_cast<int32_t>(s[k++]);
      d.push_back(cur);
    }
  }
  return d;
}

// Starts at random positions of a row of T (about one per `mean` tokens), from a seed.
std::vector<int64_t> random_starts(int64_t T, int64_t mean, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int64_t> gap(1, 2 * mean);
  std::vector<int64_t> s;
  for (int64_t t = gap(rng); t < T; t += gap(rng)) s.push_back(t);
  return s;
}

GlaParams gla_params(int64_t H, int64_t dk, int64_t chunk, GlaForm form = GlaForm::kChunked) {
  GlaParams p;
  p.form = form;
  p.chunk = chunk;
  p.scale = 1.0 / std::sqrt(static_cast<double>(dk));
  for (int64_t h = 0; h < H; ++h) p.decay.push_back(1.0 - std::ldexp(1.0, -5 - static_cast<int>(h % 8)));
  return p;
}

class CudaVarlen : public CudaVsCpu {
 protected:
  // doc [B, T] I32 on both sides.
  Buf doc(int64_t B, int64_t T, const std::vector<int32_t>& v) {
    EXPECT_EQ(static_cast<int64_t>(v.size()), B * T);
    Buf b;
    b.ref = host_tensor(kI32, {B, T});
    std::memcpy(b.ref->t.data, v.data(), v.size() * 4);
    b.dev = std::make_unique<DevTensor>(*cuda_, kI32, std::vector<int64_t>{B, T});
    cuda_->copy(b.dev->t, b.ref->t);
    return b;
  }
  // Relative RMS error of the GPU side against the CPU side for each batch row (dim 0); a row
  // whose reference is all zeros reports 0 when the GPU's is all zeros too, else infinity.
  std::vector<double> row_rms(const Buf& b) {
    auto h = down(b.d());
    const int64_t rows = b.r().shape[0], per = b.r().numel() / rows;
    std::vector<double> out;
    for (int64_t r = 0; r < rows; ++r) {
      double num = 0, den = 0;
      for (int64_t i = r * per; i < (r + 1) * per; ++i) {
        const double x = testing::element_get(h->t, i), y = testing::element_get(b.r(), i);
        num += (x - y) * (x - y);
        den += y * y;
      }
      out.push_back(den > 0 ? std::sqrt(num / den) : (num == 0 ? 0.0 : INFINITY));
    }
    return out;
  }
  void expect_rows(const Buf& b, double tol, const char* what) {
    const std::vector<double> e = row_rms(b);
    for (size_t r = 0; r < e.size(); ++r) EXPECT_LE(e[r], tol) << what << ", batch row " << r;
  }

};

// ---- GLA: tensor-core path --------------------------------------------------------------------

// The model's head dims, bf16: rows with starts at 0 (with an s_in, which must be ignored),
// mid-chunk, exactly at chunk edges (128, 256), a one-token document, two consecutive starts, a
// start at the last token, a row with no start (continues s_in) and random starts, against the
// F64 CPU. T = 2048 at B = 4, H = 4 splits both backward scans and the forward's into chunk
// groups (B·H·2 = 32 scan blocks); T = 300 at H = 16 is one walk with a short tail chunk.
TEST_F(CudaVarlen, GlaTensorCoreMatchesCpu) {
  struct Case {
    int64_t B, T, H;
  };
  const Case cases[] = {{4, 2048, 4}, {4, 300, 16}};
  const int64_t dk = 96, dv = 192;
  uint64_t seed = 1000;
  for (const Case& c : cases) {
    char trace[64];
    std::snprintf(trace, sizeof(trace), "B%lld T%lld H%lld", static_cast<long long>(c.B),
                  static_cast<long long>(c.T), static_cast<long long>(c.H));
    SCOPED_TRACE(trace);
    const std::vector<std::vector<int64_t>> starts = {
        {0, 77, 128, 256, 257, 258, c.T - 1},  // 256 and 257: one-token documents (consecutive starts)
        {},                                     // one document continuing s_in
        {5, 127, 128, 200, c.T - 2},            // 127: a one-token document ending chunk 0
        random_starts(c.T, 150, seed),
    };
    Buf docs = doc(c.B, c.T, doc_rows(c.T, starts));
    GlaParams pr = gla_params(c.H, dk, 128), pd = pr;
    pr.doc = docs.r();
    pd.doc = docs.d();
    Buf q = input({c.B, c.T, c.H, dk}, kBF16, kF64, seed++), k = input({c.B, c.T, c.H, dk}, kBF16, kF64, seed++),
        v = input({c.B, c.T, c.H, dv}, kBF16, kF64, seed++);
    Buf s_in = input({c.B, c.H, dk, dv}, kF32, kF64, seed++), s_out = zeros({c.B, c.H, dk, dv}, kF32, kF64);
    Buf o = zeros({c.B, c.T, c.H, dv}, kBF16, kF64);
    cpu_->gla_forward(pr, q.r(), k.r(), v.r(), o.r(), s_in.r(), s_out.r(), Tensor{});
    cuda_->gla_forward(pd, q.d(), k.d(), v.d(), o.d(), s_in.d(), s_out.d(), Tensor{});
    expect_rows(o, 2.5e-3, "o");
    expect_rows(s_out, 1e-5, "s_out");

    Buf d_o = input({c.B, c.T, c.H, dv}, kBF16, kF64, seed++), ds_out = input({c.B, c.H, dk, dv}, kF32, kF64, seed++);
    Buf dq = zeros({c.B, c.T, c.H, dk}, kBF16, kF64), dk_ = zeros({c.B, c.T, c.H, dk}, kBF16, kF64),
        dv_ = zeros({c.B, c.T, c.H, dv}, kBF16, kF64), ds_in = zeros({c.B, c.H, dk, dv}, kF32, kF64);
    cpu_->gla_backward(pr, q.r(), k.r(), v.r(), s_in.r(), d_o.r(), ds_out.r(), dq.r(), dk_.r(), dv_.r(), ds_in.r());
    cuda_->gla_backward(pd, q.d(), k.d(), v.d(), s_in.d(), d_o.d(), ds_out.d(), dq.d(), dk_.d(), dv_.d(), ds_in.d());
    expect_rows(dq, 5e-3, "dq");
    expect_rows(dk_, 5e-3, "dk");
    expect_rows(dv_, 5e-3, "dv");
    expect_rows(ds_in, 5e-3, "ds_in");  // row 0 starts at 0: its ds_in must be exactly zero
    EXPECT_EQ(row_rms(ds_in)[0], 0.0);

    // partial requests give the bits of the full one; a second run the same bits
    DevTensor dq2(*cuda_, kBF16, {c.B, c.T, c.H, dk}), dk2(*cuda_, kBF16, {c.B, c.T, c.H, dk}),
        dv2(*cuda_, kBF16, {c.B, c.T, c.H, dv}), dsi2(*cuda_, kF32, {c.B, c.H, dk, dv});
    cuda_->gla_backward(pd, q.d(), k.d(), v.d(), s_in.d(), d_o.d(), ds_out.d(), dq2.t, Tensor{}, Tensor{}, Tensor{});
    cuda_->gla_backward(pd, q.d(), k.d(), v.d(), s_in.d(), d_o.d(), ds_out.d(), Tensor{}, dk2.t, Tensor{}, Tensor{});
    cuda_->gla_backward(pd, q.d(), k.d(), v.d(), s_in.d(), d_o.d(), ds_out.d(), Tensor{}, Tensor{}, dv2.t, Tensor{});
    cuda_->gla_backward(pd, q.d(), k.d(), v.d(), s_in.d(), d_o.d(), ds_out.d(), Tensor{}, Tensor{}, Tensor{}, dsi2.t);
    EXPECT_TRUE(same_bytes(dq2.t, dq.d()));
    EXPECT_TRUE(same_bytes(dk2.t, dk_.d()));
    EXPECT_TRUE(same_bytes(dv2.t, dv_.d()));
    EXPECT_TRUE(same_bytes(dsi2.t, ds_in.d()));
    DevTensor o2(*cuda_, kBF16, {c.B, c.T, c.H, dv});
    cuda_->gla_forward(pd, q.d(), k.d(), v.d(), o2.t, s_in.d(), Tensor{}, Tensor{});
    EXPECT_TRUE(same_bytes(o2.t, o.d()));
  }
}

// ---- GLA: generic kernels ---------------------------------------------------------------------

// F32 inputs at small head dims (the generic kernels, whose own chunk is 16 or 64 here), the
// chunked and recurrent forms, starts at 0, at chunk edges of either chunk, one-token and
// consecutive documents; and one-token calls with doc (the generic kernel, not decode).
TEST_F(CudaVarlen, GlaGenericF32MatchesCpu) {
  struct Case {
    int64_t B, T, H, dk, dv, chunk;
    GlaForm form;
  };
  const Case cases[] = {{3, 150, 2, 16, 32, 16, GlaForm::kChunked},
                        {3, 150, 2, 32, 64, 128, GlaForm::kRecurrent},
                        {2, 1, 3, 16, 32, 128, GlaForm::kRecurrent}};
  uint64_t seed = 2000;
  for (const Case& c : cases) {
    char trace[96];
    std::snprintf(trace, sizeof(trace), "B%lld T%lld H%lld dk%lld dv%lld chunk%lld", static_cast<long long>(c.B),
                  static_cast<long long>(c.T), static_cast<long long>(c.H), static_cast<long long>(c.dk),
                  static_cast<long long>(c.dv), static_cast<long long>(c.chunk));
    SCOPED_TRACE(trace);
    std::vector<std::vector<int64_t>> starts;
    if (c.T == 1) {
      starts = {{0}, {}};
    } else {
      starts = {{0, 16, 17, 18, 63, 64, 100, c.T - 1}, {}, {1, 32, 128, 129, 140}};
    }
    Buf docs = doc(c.B, c.T, doc_rows(c.T, starts));
    GlaParams pr = gla_params(c.H, c.dk, c.chunk, c.form), pd = pr;
    pr.doc = docs.r();
    pd.doc = docs.d();
    Buf q = input({c.B, c.T, c.H, c.dk}, kF32, kF64, seed++), k = input({c.B, c.T, c.H, c.dk}, kF32, kF64, seed++),
        v = input({c.B, c.T, c.H, c.dv}, kF32, kF64, seed++);
    Buf s_in = input({c.B, c.H, c.dk, c.dv}, kF32, kF64, seed++), s_out = zeros({c.B, c.H, c.dk, c.dv}, kF32, kF64);
    Buf o = zeros({c.B, c.T, c.H, c.dv}, kF32, kF64);
    cpu_->gla_forward(pr, q.r(), k.r(), v.r(), o.r(), s_in.r(), s_out.r(), Tensor{});
    cuda_->gla_forward(pd, q.d(), k.d(), v.d(), o.d(), s_in.d(), s_out.d(), Tensor{});
    expect_rows(o, 1e-5, "o");
    expect_rows(s_out, 1e-5, "s_out");
    if (c.T == 1) continue;  // the backward of one token is the T > 1 kernels' (covered above)
    Buf d_o = input({c.B, c.T, c.H, c.dv}, kF32, kF64, seed++), ds_out = input({c.B, c.H, c.dk, c.dv}, kF32, kF64, seed++);
    Buf dq = zeros({c.B, c.T, c.H, c.dk}, kF32, kF64), dk_ = zeros({c.B, c.T, c.H, c.dk}, kF32, kF64),
        dv_ = zeros({c.B, c.T, c.H, c.dv}, kF32, kF64), ds_in = zeros({c.B, c.H, c.dk, c.dv}, kF32, kF64);
    GlaParams pc = pr;
    pc.form = GlaForm::kChunked;  // the CPU backward is chunk-wise
    cpu_->gla_backward(pc, q.r(), k.r(), v.r(), s_in.r(), d_o.r(), ds_out.r(), dq.r(), dk_.r(), dv_.r(), ds_in.r());
    cuda_->gla_backward(pd, q.d(), k.d(), v.d(), s_in.d(), d_o.d(), ds_out.d(), dq.d(), dk_.d(), dv_.d(), ds_in.d());
    expect_rows(dq, 2e-5, "dq");
    expect_rows(dk_, 2e-5, "dk");
    expect_rows(dv_, 2e-5, "dv");
    expect_rows(ds_in, 2e-5, "ds_in");
    EXPECT_EQ(row_rms(ds_in)[0], 0.0);
  }
}

// ---- one document per row: the bits of no doc ----------------------------------------------------

// doc all −1 (every row one document continuing s_in) runs the VARLEN kernels with no start:
// they must give the bits of the call without doc. Tensor-core path with split scans (B = 1) and
// with one walk (B = 16, the training shape), the generic kernels, and the conv (fast and
// generic paths, forward and backward).
TEST_F(CudaVarlen, NoStartKeepsTheBitsOfNoDoc) {
  struct Case {
    int64_t B, T, H, dk, dv;
    DType dt;
  };
  const Case cases[] = {{1, 2048, 4, 96, 192, kBF16}, {16, 2048, 4, 96, 192, kBF16}, {2, 150, 2, 16, 32, kF32}};
  uint64_t seed = 3000;
  for (const Case& c : cases) {
    char trace[64];
    std::snprintf(trace, sizeof(trace), "B%lld T%lld H%lld dk%lld", static_cast<long long>(c.B),
                  static_cast<long long>(c.T), static_cast<long long>(c.H), static_cast<long long>(c.dk));
    SCOPED_TRACE(trace);
    Buf docs = doc(c.B, c.T, std::vector<int32_t>(c.B * c.T, -1));
    GlaParams p0 = gla_params(c.H, c.dk, 128), p1 = p0;
    p1.doc = docs.d();
    Buf q = input({c.B, c.T, c.H, c.dk}, c.dt, kF64, seed++), k = input({c.B, c.T, c.H, c.dk}, c.dt, kF64, seed++),
        v = input({c.B, c.T, c.H, c.dv}, c.dt, kF64, seed++), d_o = input({c.B, c.T, c.H, c.dv}, c.dt, kF64, seed++);
    Buf s_in = input({c.B, c.H, c.dk, c.dv}, kF32, kF64, seed++), ds_out = input({c.B, c.H, c.dk, c.dv}, kF32, kF64, seed++);
    Buf o0 = zeros({c.B, c.T, c.H, c.dv}, c.dt, kF64), o1 = zeros({c.B, c.T, c.H, c.dv}, c.dt, kF64);
    Buf so0 = zeros({c.B, c.H, c.dk, c.dv}, kF32, kF64), so1 = zeros({c.B, c.H, c.dk, c.dv}, kF32, kF64);
    cuda_->gla_forward(p0, q.d(), k.d(), v.d(), o0.d(), s_in.d(), so0.d(), Tensor{});
    cuda_->gla_forward(p1, q.d(), k.d(), v.d(), o1.d(), s_in.d(), so1.d(), Tensor{});
    EXPECT_TRUE(same_bytes(o0.d(), o1.d()));
    EXPECT_TRUE(same_bytes(so0.d(), so1.d()));
    Buf dq0 = zeros({c.B, c.T, c.H, c.dk}, c.dt, kF64), dk0 = zeros({c.B, c.T, c.H, c.dk}, c.dt, kF64),
        dv0 = zeros({c.B, c.T, c.H, c.dv}, c.dt, kF64), dsi0 = zeros({c.B, c.H, c.dk, c.dv}, kF32, kF64);
    Buf dq1 = zeros({c.B, c.T, c.H, c.dk}, c.dt, kF64), dk1 = zeros({c.B, c.T, c.H, c.dk}, c.dt, kF64),
        dv1 = zeros({c.B, c.T, c.H, c.dv}, c.dt, kF64), dsi1 = zeros({c.B, c.H, c.dk, c.dv}, kF32, kF64);
    cuda_->gla_backward(p0, q.d(), k.d(), v.d(), s_in.d(), d_o.d(), ds_out.d(), dq0.d(), dk0.d(), dv0.d(), dsi0.d());
    cuda_->gla_backward(p1, q.d(), k.d(), v.d(), s_in.d(), d_o.d(), ds_out.d(), dq1.d(), dk1.d(), dv1.d(), dsi1.d());
    EXPECT_TRUE(same_bytes(dq0.d(), dq1.d()));
    EXPECT_TRUE(same_bytes(dk0.d(), dk1.d()));
    EXPECT_TRUE(same_bytes(dv0.d(), dv1.d()));
    EXPECT_TRUE(same_bytes(dsi0.d(), dsi1.d()));
  }
  // conv: D = 3072 (8-channel fast paths) and D = 20 (generic kernels), F32 and BF16
  for (int64_t D : {3072, 20}) {
    for (DType dt : {kF32, kBF16}) {
      SCOPED_TRACE(std::string("conv D ") + std::to_string(D) + " " + dtype_name(dt));
      const int64_t B = 2, T = 150, K = 4;
      Buf docs = doc(B, T, std::vector<int32_t>(B * T, -1));
      Buf u = input({B, T, D}, dt, kF32, seed++), w = input({D, K}, dt, kF32, seed++, -0.7, 0.7);
      Buf win = input({B, K, D}, kF32, kF32, seed++), wo0 = zeros({B, K, D}, kF32, kF32), wo1 = zeros({B, K, D}, kF32, kF32);
      Buf c0 = zeros({B, T, D}, dt, kF32), c1 = zeros({B, T, D}, dt, kF32), pre0 = zeros({B, T, D}, dt, kF32),
          pre1 = zeros({B, T, D}, dt, kF32);
      cuda_->conv_silu_forward(u.d(), w.d(), c0.d(), pre0.d(), win.d(), wo0.d(), Tensor{});
      cuda_->conv_silu_forward(u.d(), w.d(), c1.d(), pre1.d(), win.d(), wo1.d(), Tensor{}, docs.d());
      EXPECT_TRUE(same_bytes(c0.d(), c1.d()));
      EXPECT_TRUE(same_bytes(pre0.d(), pre1.d()));
      EXPECT_TRUE(same_bytes(wo0.d(), wo1.d()));
      Buf dc = input({B, T, D}, dt, kF32, seed++);
      Buf du0 = zeros({B, T, D}, dt, kF32), du1 = zeros({B, T, D}, dt, kF32), dw0 = zeros({D, K}, kF32, kF32),
          dw1 = zeros({D, K}, kF32, kF32);
      cuda_->conv_silu_backward(dc.d(), u.d(), w.d(), pre0.d(), du0.d(), dw0.d());
      cuda_->conv_silu_backward(dc.d(), u.d(), w.d(), pre0.d(), du1.d(), dw1.d(), docs.d());
      EXPECT_TRUE(same_bytes(du0.d(), du1.d()));
      EXPECT_TRUE(same_bytes(dw0.d(), dw1.d()));
    }
  }
}

// ---- property: a packed row is its documents run alone ------------------------------------------

// One row of three documents (the first from position 0, so s_in is ignored) against each
// document run alone from a zero state, all on CUDA (tensor-core path): the same outputs up to
// rounding (the chunks fall differently), and the row's final state that of its last document.
TEST_F(CudaVarlen, PackedRowEqualsDocumentsAlone) {
  const int64_t H = 4, dk = 96, dv = 192;
  const std::vector<int64_t> lens = {200, 333, 515};
  int64_t T = 0;
  for (int64_t n : lens) T += n;
  std::vector<int64_t> starts;
  for (int64_t t = 0, i = 0; i < static_cast<int64_t>(lens.size()); t += lens[i++]) starts.push_back(t);
  Buf docs = doc(1, T, doc_rows(T, {starts}));
  GlaParams p = gla_params(H, dk, 128), pd = p;
  pd.doc = docs.d();
  Buf q = input({1, T, H, dk}, kBF16, kF64, 4000), k = input({1, T, H, dk}, kBF16, kF64, 4001),
      v = input({1, T, H, dv}, kBF16, kF64, 4002), s_in = input({1, H, dk, dv}, kF32, kF64, 4003);
  DevTensor o(*cuda_, kBF16, {1, T, H, dv}), s_out(*cuda_, kF32, {1, H, dk, dv});
  cuda_->gla_forward(pd, q.d(), k.d(), v.d(), o.t, s_in.d(), s_out.t, Tensor{});
  auto packed = down(o.t);
  for (size_t i = 0; i < lens.size(); ++i) {
    SCOPED_TRACE("document " + std::to_string(i));
    const int64_t t0 = starts[i], n = lens[i];
    // the document's rows as their own tensors
    auto slice = [&](const Buf& x, int64_t d) {
      auto h = down(x.d());
      auto stage = host_tensor(kBF16, {1, n, H, d});
      std::memcpy(stage->t.data, static_cast<const uint16_t*>(h->t.data) + t0 * H * d, n * H * d * 2);
      auto dev = std::make_unique<DevTensor>(*cuda_, kBF16, std::vector<int64_t>{1, n, H, d});
      cuda_->copy(dev->t, stage->t);
      return dev;
    };
    auto qi = slice(q, dk), ki = slice(k, dk), vi = slice(v, dv);
    DevTensor oi(*cuda_, kBF16, {1, n, H, dv}), si(*cuda_, kF32, {1, H, dk, dv});
    cuda_->gla_forward(p, qi->t, ki->t, vi->t, oi.t, Tensor{}, si.t, Tensor{});
    auto alone = down(oi.t);
    auto want = host_tensor(kBF16, {1, n, H, dv});
    std::memcpy(want->t.data, static_cast<const uint16_t*>(packed->t.data) + t0 * H * dv, n * H * dv * 2);
    EXPECT_LE(rms_rel_error(want->t, alone->t), 2.5e-3);
    if (i + 1 == lens.size()) {
      EXPECT_LE(rms_rel_error(down(s_out.t)->t, down(si.t)->t), 2e-5);
    }
  }
}

// ---- conv -----------------------------------------------------------------------------------------

// Rows with starts at 0, mid-row, on consecutive tokens, within the last K tokens (the window
// output then holds zeros before it) and at the last token; a row with no start (reads win_in);
// a row whose first document continues the window for one token. Fast (D = 3072) and generic
// (D = 20) paths, F32 and BF16, slot-mapped windows (win_out aliases win_in), the backward with
// and without pre, and one-token calls (the generic kernels).
TEST_F(CudaVarlen, ConvSiluMatchesCpu) {
  const int64_t B = 4, T = 150, K = 4, S = 5;
  const std::vector<std::vector<int64_t>> starts = {{0, 3, 64, 65, 66, 148}, {}, {1, 100, T - 1}, {T - 3}};
  Buf slots = ints({3, 0, 4, 1});
  uint64_t seed = 5000;
  for (int64_t D : {3072, 20}) {
    for (DType dt : {kF32, kBF16}) {
      SCOPED_TRACE(std::string("D ") + std::to_string(D) + " " + dtype_name(dt));
      const double tol_act = dt == kF32 ? 1e-5 : 1e-2;
      Buf docs = doc(B, T, doc_rows(T, starts));
      Buf u = input({B, T, D}, dt, kF32, seed++), w = input({D, K}, dt, kF32, seed++, -0.7, 0.7);
      Buf c = zeros({B, T, D}, dt, kF32), pre = zeros({B, T, D}, dt, kF32);
      Buf win = input({S, K, D}, kF32, kF32, seed++);  // pool; win_out aliases win_in
      cpu_->conv_silu_forward(u.r(), w.r(), c.r(), pre.r(), win.r(), win.r(), slots.r(), docs.r());
      cuda_->conv_silu_forward(u.d(), w.d(), c.d(), pre.d(), win.d(), win.d(), slots.d(), docs.d());
      EXPECT_LE(err(c), tol_act);
      EXPECT_LE(err(pre), tol_act);
      EXPECT_EQ(err(win), 0.0);  // copies of inputs and zeros (slot 2 untouched)
      // one token per row with doc: row 0 starts a document (reads no window), row 1 continues
      Buf d1 = doc(2, 1, {0, -1});
      Buf slots1 = ints({3, 0});
      Buf u1 = input({2, 1, D}, dt, kF32, seed++), c1 = zeros({2, 1, D}, dt, kF32);
      cpu_->conv_silu_forward(u1.r(), w.r(), c1.r(), Tensor{}, win.r(), win.r(), slots1.r(), d1.r());
      cuda_->conv_silu_forward(u1.d(), w.d(), c1.d(), Tensor{}, win.d(), win.d(), slots1.d(), d1.d());
      EXPECT_LE(err(c1), tol_act);
      EXPECT_EQ(err(win), 0.0);
      // backward (zero initial window), with and without pre; both sides read the GPU's pre
      {
        auto h = down(pre.d());
        for (int64_t i = 0; i < pre.r().numel(); ++i) set_flat(pre.r(), i, testing::element_get(h->t, i));
      }
      Buf dc = input({B, T, D}, dt, kF32, seed++), du = zeros({B, T, D}, dt, kF32), dw = input({D, K}, kF32, kF32, seed);
      Buf dw2 = input({D, K}, kF32, kF32, seed++);
      cpu_->conv_silu_backward(dc.r(), u.r(), w.r(), pre.r(), du.r(), dw.r(), docs.r());
      cuda_->conv_silu_backward(dc.d(), u.d(), w.d(), pre.d(), du.d(), dw.d(), docs.d());
      EXPECT_LE(err(du), tol_act);
      EXPECT_LE(err(dw), 1e-4);
      // without pre, both sides recompute it with a zero initial window (not the forward's)
      Buf du2 = zeros({B, T, D}, dt, kF32);
      cpu_->conv_silu_backward(dc.r(), u.r(), w.r(), Tensor{}, du2.r(), dw2.r(), docs.r());
      cuda_->conv_silu_backward(dc.d(), u.d(), w.d(), Tensor{}, du2.d(), dw2.d(), docs.d());
      EXPECT_LE(err(du2), tol_act);
      EXPECT_LE(err(dw2), 1e-4);
    }
  }
}

// ---- long sequences: split scans ------------------------------------------------------------------

// T = 32768 at B = 1, H = 4 (laplace-125m's mixer): both backward scans split into 32 chunk
// groups of 8 chunks (B·H·2 = 8 scan blocks), joined by group_fix_kernel, vs the F64 CPU with
// and without doc. The starts fall on group edges (multiples of 1024), one token after one, mid
// group, in a group's first and last chunks, with groups between them that have none (the
// carry crosses several groups) and one group with two.
TEST_F(CudaVarlen, LongSequenceSplitScansMatchCpu) {
  const int64_t B = 1, T = 32768, H = 4, dk = 96, dv = 192;
  const std::vector<int64_t> starts = {1024, 2049, 2500, 6143, 8192, 8200, 20000, 31744, 32767};
  uint64_t seed = 6000;
  Buf q = input({B, T, H, dk}, kBF16, kF64, seed++), k = input({B, T, H, dk}, kBF16, kF64, seed++),
      v = input({B, T, H, dv}, kBF16, kF64, seed++), d_o = input({B, T, H, dv}, kBF16, kF64, seed++);
  Buf s_in = input({B, H, dk, dv}, kF32, kF64, seed++), ds_out = input({B, H, dk, dv}, kF32, kF64, seed++);
  Buf docs = doc(B, T, doc_rows(T, {starts}));
  for (bool with_doc : {false, true}) {
    SCOPED_TRACE(with_doc ? "doc" : "no doc");
    GlaParams pr = gla_params(H, dk, 128), pd = pr;
    if (with_doc) {
      pr.doc = docs.r();
      pd.doc = docs.d();
    }
    Buf o = zeros({B, T, H, dv}, kBF16, kF64), s_out = zeros({B, H, dk, dv}, kF32, kF64);
    cpu_->gla_forward(pr, q.r(), k.r(), v.r(), o.r(), s_in.r(), s_out.r(), Tensor{});
    cuda_->gla_forward(pd, q.d(), k.d(), v.d(), o.d(), s_in.d(), s_out.d(), Tensor{});
    expect_rows(o, 2.5e-3, "o");
    expect_rows(s_out, 1e-5, "s_out");
    Buf dq = zeros({B, T, H, dk}, kBF16, kF64), dk_ = zeros({B, T, H, dk}, kBF16, kF64),
        dv_ = zeros({B, T, H, dv}, kBF16, kF64), ds_in = zeros({B, H, dk, dv}, kF32, kF64);
    cpu_->gla_backward(pr, q.r(), k.r(), v.r(), s_in.r(), d_o.r(), ds_out.r(), dq.r(), dk_.r(), dv_.r(), ds_in.r());
    cuda_->gla_backward(pd, q.d(), k.d(), v.d(), s_in.d(), d_o.d(), ds_out.d(), dq.d(), dk_.d(), dv_.d(), ds_in.d());
    expect_rows(dq, 5e-3, "dq");
    expect_rows(dk_, 5e-3, "dk");
    expect_rows(dv_, 5e-3, "dv");
    expect_rows(ds_in, 5e-3, "ds_in");
    // fixed group plan, no atomics: the same bits again
    DevTensor dk2(*cuda_, kBF16, {B, T, H, dk}), dsi2(*cuda_, kF32, {B, H, dk, dv});
    cuda_->gla_backward(pd, q.d(), k.d(), v.d(), s_in.d(), d_o.d(), ds_out.d(), Tensor{}, dk2.t, Tensor{}, dsi2.t);
    EXPECT_TRUE(same_bytes(dk2.t, dk_.d()));
    EXPECT_TRUE(same_bytes(dsi2.t, ds_in.d()));
  }
}

}  // namespace
}  // namespace laplace
