// The fast paths of the memory-bound CUDA ops (16-byte vectors, 8 columns per thread;
// ops/cuda/kernels_norm.cu, ops/cuda/kernels_elementwise.cu), at shapes and layouts that take
// them and that fall back to the generic kernels:
//  - vs the CPU backend (tolerances of tests/test_cuda_ops.cpp: F32 outputs ≤ 1e-5, BF16 ≤ 1e-2,
//    conv windows exact: they are copies of inputs);
//  - vs the generic kernels, forced by a view whose rows are not 16-byte aligned (row stride
//    D+1): conv_silu, swiglu and rmsnorm_gate keep the generic arithmetic, so the bits agree;
//  - the backward's recomputed LayerNorm / RMSNorm statistics against the forward's (same bits);
//  - the backwards' fast dx (LayerNorm) and d_o, dg (RMSNorm × gate) vs the CPU, and vs the
//    generic kernels through a padded view within the same tolerance (the sums' order differs).
//  - the parameter gradients' fast paths (LayerNorm dw, db; RMSNorm × gate dw fused into the
//    d_o, dg kernel) and the parallel column finalize: vs the CPU within the dw tolerance of
//    tests/test_cuda_ops.cpp (F32 sums over rows ≤ 1e-4), vs the generic colreduce through a
//    padded view within it, two runs bitwise equal, and dw alone bitwise equal to dw computed
//    with the other outputs (its path depends on the inputs' layout only).
// Conv cases: decode (T = 1) from a pool with scattered slots; prefill with an initial window,
// win_out aliasing win_in, T below K and not a multiple of the 16-step tile; F32 and BF16
// windows with F32 and BF16 activations; the backward over 64-step segments (du with the generic
// kernel's bits, dw within rounding of it). Cross-entropy: the fast forward and backward vs the
// CPU, vs the generic kernels (padded rows), in place, twice. Every test skips without a usable GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "ops/backend.h"
#include "tests/test_util.h"

namespace laplace {
namespace {

using laplace::testing::max_rel_error;
using laplace::testing::OwnedTensor;

constexpr DType kF32 = DType::kF32, kBF16 = DType::kBF16;

double round_to(DType dt, double x) {
  if (dt == kBF16) return bf16_to_float(float_to_bf16(static_cast<float>(x)));
  return static_cast<float>(x);
}

std::unique_ptr<OwnedTensor> host_tensor(DType dt, const std::vector<int64_t>& shape) {
  auto h = std::make_unique<OwnedTensor>();
  h->t = Tensor::make(nullptr, dt, shape.data(), static_cast<int>(shape.size()));
  h->storage.assign((h->t.nbytes() + 7) / 8 + 1, 0.0);
  h->t.data = h->storage.data();
  return h;
}

// [rows..., cols] view of the first `cols` columns of a buffer whose rows hold cols + 1
// elements: rows are not 16-byte aligned, so the fast paths step aside (or go element-wise).
Tensor padded_view(const Tensor& buf, const std::vector<int64_t>& shape) {
  Tensor v = buf;
  v.ndim = static_cast<int>(shape.size());
  int64_t s = 1;
  for (int i = v.ndim - 1; i >= 0; --i) {
    v.shape[i] = shape[i];
    v.stride[i] = s;
    s *= (i == v.ndim - 1) ? shape[i] + 1 : shape[i];
  }
  return v;
}

class CudaOpsFast : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    cuda_ = make_cuda_backend(&why);
    if (!cuda_) GTEST_SKIP() << "no CUDA device: " << why;
    cpu_ = make_cpu_backend();
  }
  void TearDown() override {
    if (cuda_) {
      cuda_->synchronize();
      for (void* p : dev_) cuda_->allocator().deallocate(p);
    }
  }

  // Device memory freed at the end of the test.
  Tensor dev(DType dt, const std::vector<int64_t>& shape) {
    Tensor t = Tensor::make(nullptr, dt, shape.data(), static_cast<int>(shape.size()), Device::kCUDA);
    void* p = cuda_->allocator().allocate(std::max<size_t>(t.nbytes(), 1));
    LAPLACE_CHECK(p != nullptr, "test: device allocation failed");
    dev_.push_back(p);
    t.data = p;
    return t;
  }
  // Host F32 tensor (the CPU reference side).
  Tensor host(const std::vector<int64_t>& shape) {
    host_.push_back(host_tensor(kF32, shape));
    return host_.back()->t;
  }
  // Uniform values in [lo, hi) rounded to `grid` (a dtype both sides hold exactly), into the
  // F32 host tensor `ref` and the device tensor `d` (any layout, same shape).
  void fill(const Tensor& ref, const Tensor& d, uint64_t seed, DType grid, double lo = -1, double hi = 1) {
    std::vector<int64_t> shape(ref.shape.begin(), ref.shape.begin() + ref.ndim);
    auto stage = host_tensor(d.dtype, shape);
    std::mt19937_64 rng(seed);
    std::uniform_real_distribution<double> dist(lo, hi);
    for (int64_t i = 0; i < ref.numel(); ++i) {
      const double x = round_to(grid, dist(rng));
      static_cast<float*>(ref.data)[i] = static_cast<float>(x);
      if (d.dtype == kBF16) static_cast<uint16_t*>(stage->t.data)[i] = float_to_bf16(static_cast<float>(x));
      else static_cast<float*>(stage->t.data)[i] = static_cast<float>(x);
    }
    cuda_->copy(d, stage->t);
  }
  std::unique_ptr<OwnedTensor> down(const Tensor& d) {
    std::vector<int64_t> shape(d.shape.begin(), d.shape.begin() + d.ndim);
    auto h = host_tensor(d.dtype, shape);
    cuda_->copy(h->t, d);
    return h;
  }
  double err(const Tensor& d, const Tensor& ref) { return max_rel_error(down(d)->t, ref); }
  bool same_bytes(const Tensor& a, const Tensor& b) {
    auto ha = down(a), hb = down(b);
    return ha->t.nbytes() == hb->t.nbytes() && std::memcmp(ha->t.data, hb->t.data, ha->t.nbytes()) == 0;
  }
  // [B,T,H,dv] view of the columns col·H·dv .. (col+1)·H·dv of a new [B,T,width·H·dv] buffer:
  // the gate g as the model sees it, a strided slice of the fused qkvg projection.
  Tensor gate_view(DType dt, int64_t B, int64_t T, int64_t H, int64_t dv, int64_t col, int64_t width) {
    Tensor fused = dev(dt, {B, T, width * H * dv});
    Tensor g = fused;
    g.data = static_cast<char*>(fused.data) + col * H * dv * static_cast<int64_t>(dtype_size(dt));
    g.ndim = 4;
    g.shape = {B, T, H, dv};
    g.stride = {fused.stride[0], fused.stride[1], dv, 1};
    return g;
  }
  Tensor ints(const std::vector<int32_t>& v, Tensor* ref) {
    const std::vector<int64_t> shape = {static_cast<int64_t>(v.size())};
    host_.push_back(host_tensor(DType::kI32, shape));
    std::memcpy(host_.back()->t.data, v.data(), v.size() * 4);
    *ref = host_.back()->t;
    Tensor d = dev(DType::kI32, shape);
    cuda_->copy(d, *ref);
    return d;
  }

  std::unique_ptr<Backend> cuda_, cpu_;
  std::vector<void*> dev_;
  std::vector<std::unique_ptr<OwnedTensor>> host_;
};

const char* combo(DType a, DType b) {
  if (a == kF32) return b == kF32 ? "u F32, window F32" : "u F32, window BF16";
  return b == kF32 ? "u BF16, window F32" : "u BF16, window BF16";
}

// ---- conv + SiLU -------------------------------------------------------------------------------

// Decode (T = 1) at the model's width from a pool with more slots than rows (odd B, scattered
// slots), two consecutive steps with win_out aliasing win_in; then the generic kernels on the
// same inputs (u through a padded view) give the same bits.
TEST_F(CudaOpsFast, ConvDecodeSlotsWindowDtypes) {
  const int64_t B = 37, S = 41, D = 3072, K = 4;
  std::vector<int32_t> sl(B);
  for (int64_t b = 0; b < B; ++b) sl[b] = static_cast<int32_t>((b * 7 + 3) % S);  // distinct
  Tensor slots_r;
  const Tensor slots = ints(sl, &slots_r);
  for (DType udt : {kF32, kBF16}) {
    for (DType wdt : {kF32, kBF16}) {
      SCOPED_TRACE(combo(udt, wdt));
      const DType grid = (udt == kBF16 || wdt == kBF16) ? kBF16 : kF32;  // windows copy u exactly
      const double tol = udt == kF32 ? 1e-5 : 1e-2;
      Tensor w_r = host({D, K}), w = dev(udt, {D, K});
      fill(w_r, w, 11, grid, -0.7, 0.7);
      Tensor pool_r = host({S, K, D}), pool = dev(wdt, {S, K, D}), pool2 = dev(wdt, {S, K, D});
      fill(pool_r, pool, 12, grid);
      cuda_->copy(pool2, pool);
      for (int step = 0; step < 2; ++step) {
        SCOPED_TRACE(step);
        Tensor u_r = host({B, 1, D}), u = dev(udt, {B, 1, D});
        fill(u_r, u, 13 + step, grid);
        Tensor c_r = host({B, 1, D}), c = dev(udt, {B, 1, D});
        Tensor pre_r = step == 0 ? host({B, 1, D}) : Tensor{}, pre = step == 0 ? dev(udt, {B, 1, D}) : Tensor{};
        cpu_->conv_silu_forward(u_r, w_r, c_r, pre_r, pool_r, pool_r, slots_r);
        cuda_->conv_silu_forward(u, w, c, pre, pool, pool, slots);
        EXPECT_LE(err(c, c_r), tol);
        if (step == 0) {
          EXPECT_LE(err(pre, pre_r), tol);
        }
        EXPECT_EQ(err(pool, pool_r), 0.0);  // slots outside the batch untouched
        // The generic kernels: u's rows padded to D + 1 elements.
        Tensor ubuf = dev(udt, {B, 1, D + 1}), c2 = dev(udt, {B, 1, D});
        Tensor uv = padded_view(ubuf, {B, 1, D});
        cuda_->copy(uv, u);
        cuda_->conv_silu_forward(uv, w, c2, Tensor{}, pool2, pool2, slots);
        EXPECT_TRUE(same_bytes(c2, c));
        EXPECT_TRUE(same_bytes(pool2, pool));
      }
      // First token (no input window; window out by batch row), and a window read but not written.
      Tensor u_r = host({B, 1, D}), u = dev(udt, {B, 1, D});
      fill(u_r, u, 20, grid);
      Tensor c_r = host({B, 1, D}), c = dev(udt, {B, 1, D});
      Tensor wo_r = host({B, K, D}), wo = dev(wdt, {B, K, D});
      fill(wo_r, wo, 21, grid);
      cpu_->conv_silu_forward(u_r, w_r, c_r, Tensor{}, Tensor{}, wo_r, Tensor{});
      cuda_->conv_silu_forward(u, w, c, Tensor{}, Tensor{}, wo, Tensor{});
      EXPECT_LE(err(c, c_r), tol);
      EXPECT_EQ(err(wo, wo_r), 0.0);
      cpu_->conv_silu_forward(u_r, w_r, c_r, Tensor{}, pool_r, Tensor{}, slots_r);
      cuda_->conv_silu_forward(u, w, c, Tensor{}, pool, Tensor{}, slots);
      EXPECT_LE(err(c, c_r), tol);
      EXPECT_EQ(err(pool, pool_r), 0.0);
    }
  }
}

// Prefill: T below K, at and around the 16-step tile and not a multiple of it, K = 3 and 4,
// an initial window from scattered slots with win_out aliasing win_in (the window kernel runs
// after the tiles that read win_in), D = 264 (33 chunks of 8 channels: partial blocks).
TEST_F(CudaOpsFast, ConvPrefillTilesWindowsAliasing) {
  const int64_t B = 3, S = 5, D = 264;
  Tensor slots_r;
  const Tensor slots = ints({4, 0, 2}, &slots_r);
  for (int64_t K : {3, 4}) {
    for (int64_t T : {2, 3, 16, 17, 37, 150}) {
      for (DType udt : {kF32, kBF16}) {
        for (DType wdt : {kF32, kBF16}) {
          SCOPED_TRACE("K " + std::to_string(K) + ", T " + std::to_string(T) + ", " + combo(udt, wdt));
          const DType grid = (udt == kBF16 || wdt == kBF16) ? kBF16 : kF32;
          const double tol = udt == kF32 ? 1e-5 : 1e-2;
          Tensor w_r = host({D, K}), w = dev(udt, {D, K});
          fill(w_r, w, 30 + K, grid, -0.7, 0.7);
          Tensor u_r = host({B, T, D}), u = dev(udt, {B, T, D});
          fill(u_r, u, 40 + T, grid);
          Tensor pool_r = host({S, K, D}), pool = dev(wdt, {S, K, D}), pool2 = dev(wdt, {S, K, D});
          fill(pool_r, pool, 50 + T, grid);
          cuda_->copy(pool2, pool);
          Tensor c_r = host({B, T, D}), c = dev(udt, {B, T, D}), pre_r = host({B, T, D}), pre = dev(udt, {B, T, D});
          cpu_->conv_silu_forward(u_r, w_r, c_r, pre_r, pool_r, pool_r, slots_r);
          cuda_->conv_silu_forward(u, w, c, pre, pool, pool, slots);
          EXPECT_LE(err(c, c_r), tol);
          EXPECT_LE(err(pre, pre_r), tol);
          EXPECT_EQ(err(pool, pool_r), 0.0);
          // The generic kernels from the same pool: same bits.
          Tensor ubuf = dev(udt, {B, T, D + 1}), c2 = dev(udt, {B, T, D});
          Tensor uv = padded_view(ubuf, {B, T, D});
          cuda_->copy(uv, u);
          cuda_->conv_silu_forward(uv, w, c2, Tensor{}, pool2, pool2, slots);
          EXPECT_TRUE(same_bytes(c2, c));
          EXPECT_TRUE(same_bytes(pool2, pool));
        }
      }
      if (T != 37) continue;
      // No input window, window output by batch row; and a window read but not written.
      for (DType dt : {kF32, kBF16}) {
        SCOPED_TRACE(std::string("window modes, ") + combo(dt, dt));
        const double tol = dt == kF32 ? 1e-5 : 1e-2;
        Tensor w_r = host({D, K}), w = dev(dt, {D, K});
        fill(w_r, w, 60, dt, -0.7, 0.7);
        Tensor u_r = host({B, T, D}), u = dev(dt, {B, T, D});
        fill(u_r, u, 61, dt);
        Tensor c_r = host({B, T, D}), c = dev(dt, {B, T, D});
        Tensor wo_r = host({B, K, D}), wo = dev(dt, {B, K, D});
        cpu_->conv_silu_forward(u_r, w_r, c_r, Tensor{}, Tensor{}, wo_r, Tensor{});
        cuda_->conv_silu_forward(u, w, c, Tensor{}, Tensor{}, wo, Tensor{});
        EXPECT_LE(err(c, c_r), tol);
        EXPECT_EQ(err(wo, wo_r), 0.0);
        Tensor pool_r = host({S, K, D}), pool = dev(dt, {S, K, D});
        fill(pool_r, pool, 62, dt);
        cpu_->conv_silu_forward(u_r, w_r, c_r, Tensor{}, pool_r, Tensor{}, slots_r);
        cuda_->conv_silu_forward(u, w, c, Tensor{}, pool, Tensor{}, slots);
        EXPECT_LE(err(c, c_r), tol);
        EXPECT_EQ(err(pool, pool_r), 0.0);
      }
    }
  }
}

// Backward (zero initial window) at the model's width and at D = 264, T below K, within one
// 64-step segment, across segments and not a multiple of them, K = 3 and 4:
//  - du and dw vs the CPU (du 1e-5 F32 / 1e-2 BF16, dw 1e-4 as tests/test_cuda_ops.cpp);
//  - du vs the generic kernel (dc through a padded view): same bits; dw within 1e-5 (the
//    fast path sums per 64-step segment, the generic kernel per 128 rows);
//  - dw alone (du undefined) gives the bits of dw with du, and a second run repeats them.
TEST_F(CudaOpsFast, ConvBackwardSegments) {
  for (auto [B, D] : std::vector<std::pair<int64_t, int64_t>>{{2, 3072}, {3, 264}}) {
    for (int64_t K : {3, 4}) {
      for (int64_t T : {2, 64, 150}) {
        if (D == 3072 && (K == 3 || T == 2)) continue;  // the wide case at the model's K only
        for (DType dt : {kF32, kBF16}) {
          SCOPED_TRACE("B " + std::to_string(B) + ", D " + std::to_string(D) + ", K " + std::to_string(K) + ", T " +
                       std::to_string(T) + (dt == kF32 ? ", F32" : ", BF16"));
          const double tol = dt == kF32 ? 1e-5 : 1e-2;
          Tensor w_r = host({D, K}), w = dev(dt, {D, K});
          fill(w_r, w, 70 + K, dt, -0.7, 0.7);
          Tensor u_r = host({B, T, D}), u = dev(dt, {B, T, D});
          fill(u_r, u, 71 + T, dt);
          Tensor c = dev(dt, {B, T, D}), pre = dev(dt, {B, T, D});
          cuda_->conv_silu_forward(u, w, c, pre, Tensor{}, Tensor{}, Tensor{});
          Tensor pre_r = host({B, T, D});
          cuda_->copy(pre_r, pre);  // both sides read the GPU's pre
          Tensor dc_r = host({B, T, D}), dc = dev(dt, {B, T, D});
          fill(dc_r, dc, 72 + T, dt);
          Tensor du_r = host({B, T, D}), du = dev(dt, {B, T, D});
          Tensor dw_r = host({D, K}), dw = dev(kF32, {D, K});
          fill(dw_r, dw, 73, kF32);  // dw accumulates
          Tensor dw0 = dev(kF32, {D, K}), dw2 = dev(kF32, {D, K}), dw3 = dev(kF32, {D, K}), dw4 = dev(kF32, {D, K});
          for (const Tensor& t : {dw0, dw2, dw3, dw4}) cuda_->copy(t, dw);
          cpu_->conv_silu_backward(dc_r, u_r, w_r, pre_r, du_r, dw_r);
          cuda_->conv_silu_backward(dc, u, w, pre, du, dw);
          EXPECT_LE(err(du, du_r), tol);
          EXPECT_LE(err(dw, dw_r), 1e-4);
          // generic kernel: dc's rows padded to D + 1 elements
          Tensor dcbuf = dev(dt, {B, T, D + 1}), du2 = dev(dt, {B, T, D});
          Tensor dcv = padded_view(dcbuf, {B, T, D});
          cuda_->copy(dcv, dc);
          cuda_->conv_silu_backward(dcv, u, w, pre, du2, dw2);
          EXPECT_TRUE(same_bytes(du2, du)) << "fast and generic conv du differ";
          EXPECT_LE(max_rel_error(down(dw2)->t, down(dw)->t), 1e-5);
          cuda_->conv_silu_backward(dc, u, w, pre, Tensor{}, dw3);
          EXPECT_TRUE(same_bytes(dw3, dw)) << "dw alone differs from dw with du";
          cuda_->conv_silu_backward(dc, u, w, pre, du2, dw4);
          EXPECT_TRUE(same_bytes(dw4, dw)) << "a second run differs";
          EXPECT_FALSE(same_bytes(dw0, dw)) << "dw did not change";
        }
      }
    }
  }
}

// ---- LayerNorm -----------------------------------------------------------------------------------

// D = 3072 (BF16: one warp per row; F32: one block per row), 4104 (one block per row), 264 (warp
// per row, partial chunks), 24 (3 lanes); with and without bias. The backward's recomputed
// statistics are the forward's (dx bitwise), and y through a padded view (element-wise stores)
// has the same bits.
TEST_F(CudaOpsFast, LayerNormFastPathShapes) {
  const int64_t N = 67;
  for (int64_t D : {3072, 264, 24, 4104}) {
    for (DType dt : {kF32, kBF16}) {
      SCOPED_TRACE("D " + std::to_string(D) + (dt == kF32 ? ", F32" : ", BF16"));
      const double tol = dt == kF32 ? 1e-5 : 1e-2;
      const bool bias = D != 264;
      Tensor x_r = host({N, D}), x = dev(dt, {N, D}), w_r = host({D}), w = dev(dt, {D});
      fill(x_r, x, 70, dt, -2, 3);
      fill(w_r, w, 71, dt, 0.5, 1.5);
      Tensor b_r = bias ? host({D}) : Tensor{}, b = bias ? dev(dt, {D}) : Tensor{};
      if (bias) fill(b_r, b, 72, dt);
      Tensor y_r = host({N, D}), y = dev(dt, {N, D});
      Tensor m_r = host({N}), m = dev(kF32, {N}), r_r = host({N}), r = dev(kF32, {N});
      cpu_->layernorm_forward(x_r, w_r, b_r, 1e-5, y_r, m_r, r_r);
      cuda_->layernorm_forward(x, w, b, 1e-5, y, m, r);
      EXPECT_LE(err(y, y_r), tol);
      EXPECT_LE(err(m, m_r), 1e-5);
      EXPECT_LE(err(r, r_r), 1e-5);
      Tensor dy_r = host({N, D}), dy = dev(dt, {N, D});
      fill(dy_r, dy, 73, dt);
      Tensor dx1 = dev(dt, {N, D}), dx2 = dev(dt, {N, D});
      cuda_->layernorm_backward(dy, x, w, m, r, dx1, false, Tensor{}, Tensor{});
      cuda_->layernorm_backward(dy, x, w, Tensor{}, Tensor{}, dx2, false, Tensor{}, Tensor{});
      EXPECT_TRUE(same_bytes(dx1, dx2));
      Tensor ybuf = dev(dt, {N, D + 1}), y2 = dev(dt, {N, D});
      Tensor yv = padded_view(ybuf, {N, D});
      cuda_->layernorm_forward(x, w, b, 1e-5, yv, Tensor{}, Tensor{});
      cuda_->copy(y2, yv);
      EXPECT_TRUE(same_bytes(y2, y));
    }
  }
}

// dx: D = 3072 (laplace-3b) and 4096 (one block per row), 1000 (warp per row, 125 chunks: lanes
// with 4 and 3) and 1030 (D % 8 != 0: generic); overwrite and accumulate, with and
// without w (the CPU side takes w = 1, exact), each side with its own forward's statistics as in
// tests/test_cuda_ops.cpp. Then dy through a padded view (rows not 16-byte aligned: the generic
// kernel) agrees with the fast result, and dx aliasing dy (in place) with the CPU.
TEST_F(CudaOpsFast, LayerNormBackwardFastPathShapes) {
  const int64_t N = 67;  // 16 blocks of 4 rows and a partial one
  for (int64_t D : {3072, 1000, 4096, 1030}) {
    for (DType dt : {kF32, kBF16}) {
      const double tol = dt == kF32 ? 1e-5 : 1e-2;
      Tensor x_r = host({N, D}), x = dev(dt, {N, D}), dy_r = host({N, D}), dy = dev(dt, {N, D});
      fill(x_r, x, 100, dt, -2, 3);
      fill(dy_r, dy, 101, dt);
      Tensor w_r = host({D}), w = dev(dt, {D}), ones = host({D});
      fill(w_r, w, 102, dt, 0.5, 1.5);
      std::fill_n(static_cast<float*>(ones.data), D, 1.0f);
      Tensor m_r = host({N}), m = dev(kF32, {N}), r_r = host({N}), r = dev(kF32, {N});
      Tensor y_r = host({N, D}), y = dev(dt, {N, D});
      cpu_->layernorm_forward(x_r, w_r, Tensor{}, 1e-5, y_r, m_r, r_r);
      cuda_->layernorm_forward(x, w, Tensor{}, 1e-5, y, m, r);
      for (bool with_w : {true, false}) {
        for (bool acc : {false, true}) {
          SCOPED_TRACE("D " + std::to_string(D) + (dt == kF32 ? ", F32" : ", BF16") + (with_w ? ", w" : ", no w") +
                       (acc ? ", accumulate" : ", overwrite"));
          const Tensor wd = with_w ? w : Tensor{};
          // dx starts from the same values on both sides (ignored unless accumulating).
          Tensor dx_r = host({N, D}), dx0 = dev(dt, {N, D}), dx = dev(dt, {N, D});
          fill(dx_r, dx0, 103, dt);
          cuda_->copy(dx, dx0);
          cpu_->layernorm_backward(dy_r, x_r, with_w ? w_r : ones, m_r, r_r, dx_r, acc, Tensor{}, Tensor{});
          cuda_->layernorm_backward(dy, x, wd, m, r, dx, acc, Tensor{}, Tensor{});
          EXPECT_LE(err(dx, dx_r), tol);
          // The generic kernel: dy's rows padded to D + 1 elements.
          Tensor dybuf = dev(dt, {N, D + 1}), dx2 = dev(dt, {N, D});
          Tensor dyv = padded_view(dybuf, {N, D});
          cuda_->copy(dyv, dy);
          cuda_->copy(dx2, dx0);
          cuda_->layernorm_backward(dyv, x, wd, m, r, dx2, acc, Tensor{}, Tensor{});
          const auto fast = down(dx);
          EXPECT_LE(err(dx2, fast->t), tol);
          if (!acc) {
            // In place: dx aliases dy (each lane reads its chunks before it writes them).
            Tensor io = dev(dt, {N, D});
            cuda_->copy(io, dy);
            cuda_->layernorm_backward(io, x, wd, m, r, io, false, Tensor{}, Tensor{});
            EXPECT_LE(err(io, dx_r), tol);
          }
        }
      }
    }
  }
}

// dw, db (accumulated into non-zero starting values): D = 3072 with N = 4100 rows (33 segments
// of 128, the last partial: the finalize's lanes sum more than one segment), D = 1000 (125
// chunks: a partial block of 256 columns), D = 1030 (D % 8 != 0: generic). dw and db vs the CPU,
// then alone (the other null) and with dx: bitwise the same; a second run: bitwise the same;
// dy through a padded view (the generic colreduce) within the tolerance of the fast result.
TEST_F(CudaOpsFast, LayerNormDwDbFastPathShapes) {
  constexpr double kDwTol = 1e-4;  // F32 sums over the rows (tests/test_cuda_ops.cpp)
  for (auto [N, D] : std::vector<std::pair<int64_t, int64_t>>{{4100, 3072}, {300, 1000}, {300, 1030}}) {
    for (DType dt : {kF32, kBF16}) {
      SCOPED_TRACE("N " + std::to_string(N) + ", D " + std::to_string(D) + (dt == kF32 ? ", F32" : ", BF16"));
      Tensor x_r = host({N, D}), x = dev(dt, {N, D}), dy_r = host({N, D}), dy = dev(dt, {N, D});
      fill(x_r, x, 120, dt, -2, 3);
      fill(dy_r, dy, 121, dt);
      Tensor w_r = host({D}), w = dev(dt, {D});
      fill(w_r, w, 122, dt, 0.5, 1.5);
      Tensor m_r = host({N}), m = dev(kF32, {N}), r_r = host({N}), r = dev(kF32, {N});
      Tensor y_r = host({N, D}), y = dev(dt, {N, D});
      cpu_->layernorm_forward(x_r, w_r, Tensor{}, 1e-5, y_r, m_r, r_r);
      cuda_->layernorm_forward(x, w, Tensor{}, 1e-5, y, m, r);
      // Starting values (the gradients accumulate): the same on every device copy.
      Tensor dw_r = host({D}), dw0 = dev(kF32, {D}), db_r = host({D}), db0 = dev(kF32, {D});
      fill(dw_r, dw0, 123, kF32);
      fill(db_r, db0, 124, kF32);
      auto start = [&](const Tensor& from) {
        Tensor t = dev(kF32, {D});
        cuda_->copy(t, from);
        return t;
      };
      cpu_->layernorm_backward(dy_r, x_r, w_r, m_r, r_r, Tensor{}, false, dw_r, db_r);
      Tensor dw = start(dw0), db = start(db0);
      cuda_->layernorm_backward(dy, x, w, m, r, Tensor{}, false, dw, db);
      EXPECT_LE(err(dw, dw_r), kDwTol);
      EXPECT_LE(err(db, db_r), kDwTol);
      // Each alone; with dx (accumulating); a second run.
      Tensor dw1 = start(dw0), db1 = start(db0), dw2 = start(dw0), db2 = start(db0), dx = dev(dt, {N, D});
      cuda_->layernorm_backward(dy, x, w, m, r, Tensor{}, false, dw1, Tensor{});
      cuda_->layernorm_backward(dy, x, w, m, r, Tensor{}, false, Tensor{}, db1);
      EXPECT_TRUE(same_bytes(dw1, dw));
      EXPECT_TRUE(same_bytes(db1, db));
      cuda_->copy(dx, dy);
      cuda_->layernorm_backward(dy, x, w, m, r, dx, true, dw2, db2);
      EXPECT_TRUE(same_bytes(dw2, dw));
      EXPECT_TRUE(same_bytes(db2, db));
      Tensor dw3 = start(dw0), db3 = start(db0);
      cuda_->layernorm_backward(dy, x, w, m, r, Tensor{}, false, dw3, db3);
      EXPECT_TRUE(same_bytes(dw3, dw));
      EXPECT_TRUE(same_bytes(db3, db));
      // The generic colreduce: dy's rows padded to D + 1 elements.
      Tensor dybuf = dev(dt, {N, D + 1}), dw4 = start(dw0), db4 = start(db0);
      Tensor dyv = padded_view(dybuf, {N, D});
      cuda_->copy(dyv, dy);
      cuda_->layernorm_backward(dyv, x, w, m, r, Tensor{}, false, dw4, db4);
      const auto fast_dw = down(dw), fast_db = down(db);
      EXPECT_LE(err(dw4, fast_dw->t), kDwTol);
      EXPECT_LE(err(db4, fast_db->t), kDwTol);
      EXPECT_LE(err(dw4, dw_r), kDwTol);
      EXPECT_LE(err(db4, db_r), kDwTol);
    }
  }
}

// ---- RMSNorm × gate ------------------------------------------------------------------------------

// dv = 192, 64, 256 (fast; g a view into a fused buffer as in the model), 12 and 264 (generic).
// The fast kernel keeps the generic kernel's bits: o through a padded view (element-wise
// loads) gives the same y; the backward's recomputed rstd gives the same d_o, dg.
TEST_F(CudaOpsFast, RmsNormGateFastPathShapes) {
  const int64_t B = 3, T = 5, H = 3;  // 45 rows: a partial last block of 8
  for (int64_t dv : {192, 64, 256, 12, 264}) {
    for (DType dt : {kF32, kBF16}) {
      SCOPED_TRACE("dv " + std::to_string(dv) + (dt == kF32 ? ", F32" : ", BF16"));
      const double tol = dt == kF32 ? 1e-5 : 1e-2;
      Tensor o_r = host({B, T, H, dv}), o = dev(dt, {B, T, H, dv}), g_r = host({B, T, H, dv});
      fill(o_r, o, 80, dt, -2, 2);
      const Tensor g = gate_view(dt, B, T, H, dv, 1, 2);  // g at column 1·H·dv of [B,T,2·H·dv]
      fill(g_r, g, 81, dt, -3, 3);
      Tensor w_r = host({dv}), w = dev(dt, {dv});
      fill(w_r, w, 82, dt, 0.5, 1.5);
      Tensor y_r = host({B, T, H, dv}), y = dev(dt, {B, T, H, dv}), r_r = host({B, T, H}), r = dev(kF32, {B, T, H});
      cpu_->rmsnorm_gate_forward(o_r, g_r, w_r, 1e-5, y_r, r_r);
      cuda_->rmsnorm_gate_forward(o, g, w, 1e-5, y, r);
      EXPECT_LE(err(y, y_r), tol);
      EXPECT_LE(err(r, r_r), 1e-5);
      Tensor obuf = dev(dt, {B, T, H, dv + 1}), y2 = dev(dt, {B, T, H, dv});
      Tensor ov = padded_view(obuf, {B, T, H, dv});
      cuda_->copy(ov, o);
      cuda_->rmsnorm_gate_forward(ov, g, w, 1e-5, y2, Tensor{});
      EXPECT_TRUE(same_bytes(y2, y));
      Tensor dy_r = host({B, T, H, dv}), dy = dev(dt, {B, T, H, dv});
      fill(dy_r, dy, 83, dt);
      Tensor do1 = dev(dt, {B, T, H, dv}), dg1 = dev(dt, {B, T, H, dv}), do2 = dev(dt, {B, T, H, dv}),
             dg2 = dev(dt, {B, T, H, dv});
      cuda_->rmsnorm_gate_backward(dy, o, g, w, r, do1, dg1, Tensor{});
      cuda_->rmsnorm_gate_backward(dy, o, g, w, Tensor{}, do2, dg2, Tensor{});
      EXPECT_TRUE(same_bytes(do1, do2));
      EXPECT_TRUE(same_bytes(dg1, dg2));
    }
  }
}

// Backward: rows = 37 tokens × 16 heads (a partial last block of 8 rows), dv = 192 and 64
// (fast), 12 (dv % 8 != 0: generic); with and without w (the CPU side takes w = 1, exact), g a
// view into a fused buffer as in the model. d_o and dg vs the CPU (tolerances of
// tests/test_cuda_ops.cpp), each output alone (the other null), d_o aliasing dy; then o through
// a padded view (rows not 16-byte aligned: the generic kernel) agrees with the fast result.
TEST_F(CudaOpsFast, RmsNormGateBackwardFastPathShapes) {
  const int64_t B = 1, T = 37, H = 16;
  for (int64_t dv : {192, 64, 12}) {
    for (DType dt : {kF32, kBF16}) {
      const double tol = dt == kF32 ? 1e-5 : 1e-2;
      const std::vector<int64_t> shape = {B, T, H, dv};
      Tensor o_r = host(shape), o = dev(dt, shape), g_r = host(shape), dy_r = host(shape), dy = dev(dt, shape);
      fill(o_r, o, 110, dt, -2, 2);
      fill(dy_r, dy, 111, dt);
      const Tensor g = gate_view(dt, B, T, H, dv, 1, 2);  // g at column 1·H·dv of [B,T,2·H·dv]
      fill(g_r, g, 112, dt, -3, 3);
      Tensor w_r = host({dv}), w = dev(dt, {dv}), ones = host({dv});
      fill(w_r, w, 113, dt, 0.5, 1.5);
      std::fill_n(static_cast<float*>(ones.data), dv, 1.0f);
      Tensor y_r = host(shape), y = dev(dt, shape), r_r = host({B, T, H}), r = dev(kF32, {B, T, H});
      cpu_->rmsnorm_gate_forward(o_r, g_r, w_r, 1e-5, y_r, r_r);
      cuda_->rmsnorm_gate_forward(o, g, w, 1e-5, y, r);
      for (bool with_w : {true, false}) {
        SCOPED_TRACE("dv " + std::to_string(dv) + (dt == kF32 ? ", F32" : ", BF16") + (with_w ? ", w" : ", no w"));
        const Tensor wd = with_w ? w : Tensor{};
        Tensor do_r = host(shape), dg_r = host(shape);
        cpu_->rmsnorm_gate_backward(dy_r, o_r, g_r, with_w ? w_r : ones, r_r, do_r, dg_r, Tensor{});
        Tensor d_o = dev(dt, shape), dg = dev(dt, shape);
        cuda_->rmsnorm_gate_backward(dy, o, g, wd, r, d_o, dg, Tensor{});
        EXPECT_LE(err(d_o, do_r), tol);
        EXPECT_LE(err(dg, dg_r), tol);
        // One output at a time.
        Tensor d_o1 = dev(dt, shape), dg1 = dev(dt, shape);
        cuda_->rmsnorm_gate_backward(dy, o, g, wd, r, d_o1, Tensor{}, Tensor{});
        cuda_->rmsnorm_gate_backward(dy, o, g, wd, r, Tensor{}, dg1, Tensor{});
        EXPECT_LE(err(d_o1, do_r), tol);
        EXPECT_LE(err(dg1, dg_r), tol);
        // d_o in place of dy (each lane loads its columns before it stores them).
        Tensor io = dev(dt, shape), dg2 = dev(dt, shape);
        cuda_->copy(io, dy);
        cuda_->rmsnorm_gate_backward(io, o, g, wd, r, io, dg2, Tensor{});
        EXPECT_LE(err(io, do_r), tol);
        EXPECT_LE(err(dg2, dg_r), tol);
        // The generic kernel: o's rows padded to dv + 1 elements.
        Tensor obuf = dev(dt, {B, T, H, dv + 1}), d_o3 = dev(dt, shape), dg3 = dev(dt, shape);
        Tensor ov = padded_view(obuf, shape);
        cuda_->copy(ov, o);
        cuda_->rmsnorm_gate_backward(dy, ov, g, wd, r, d_o3, dg3, Tensor{});
        const auto fast_do = down(d_o), fast_dg = down(dg);
        EXPECT_LE(err(d_o3, fast_do->t), tol);
        EXPECT_LE(err(dg3, fast_dg->t), tol);
      }
    }
  }
}

// dw (fused into the fast d_o, dg kernel), accumulated into non-zero starting values, at the
// model's layout: H = 16, dv = 192 (also 64; 12 generic), g a [B,T,H,dv] view at column offset
// 2·H·dv of a [B,T,3·H·dv] buffer (laplace-3b's qkvg: row stride 9216, g at column 6144).
// B·T·H = 4800 rows: 38 segments of 128, the last partial. dw vs the CPU; dw alone (d_o, dg
// null), with d_o aliasing dy, with d_o through a padded view (d_o then takes the generic
// kernel, dw still the fused one) and a second run: all bitwise the first; o through a padded
// view (the generic colreduce) within the tolerance of the fast result.
TEST_F(CudaOpsFast, RmsNormGateDwFastPathShapes) {
  constexpr double kDwTol = 1e-4;  // F32 sums over the rows (tests/test_cuda_ops.cpp)
  const int64_t B = 3, T = 100, H = 16;
  for (int64_t dv : {192, 64, 12}) {
    for (DType dt : {kF32, kBF16}) {
      SCOPED_TRACE("dv " + std::to_string(dv) + (dt == kF32 ? ", F32" : ", BF16"));
      const double tol = dt == kF32 ? 1e-5 : 1e-2;
      const std::vector<int64_t> shape = {B, T, H, dv};
      Tensor o_r = host(shape), o = dev(dt, shape), g_r = host(shape), dy_r = host(shape), dy = dev(dt, shape);
      fill(o_r, o, 130, dt, -2, 2);
      fill(dy_r, dy, 131, dt);
      const Tensor g = gate_view(dt, B, T, H, dv, 2, 3);  // g at column 2·H·dv of [B,T,3·H·dv]
      fill(g_r, g, 132, dt, -3, 3);
      Tensor w_r = host({dv}), w = dev(dt, {dv});
      fill(w_r, w, 133, dt, 0.5, 1.5);
      Tensor r_r = host({B, T, H}), r = dev(kF32, {B, T, H});
      Tensor y_r = host(shape), y = dev(dt, shape);
      cpu_->rmsnorm_gate_forward(o_r, g_r, w_r, 1e-5, y_r, r_r);
      cuda_->rmsnorm_gate_forward(o, g, w, 1e-5, y, r);
      Tensor dw_r = host({dv}), dw0 = dev(kF32, {dv});
      fill(dw_r, dw0, 134, kF32);
      auto start = [&] {
        Tensor t = dev(kF32, {dv});
        cuda_->copy(t, dw0);
        return t;
      };
      Tensor do_r = host(shape), dg_r = host(shape);
      cpu_->rmsnorm_gate_backward(dy_r, o_r, g_r, w_r, r_r, do_r, dg_r, dw_r);
      Tensor d_o = dev(dt, shape), dg = dev(dt, shape), dw = start();
      cuda_->rmsnorm_gate_backward(dy, o, g, w, r, d_o, dg, dw);
      EXPECT_LE(err(dw, dw_r), kDwTol);
      EXPECT_LE(err(d_o, do_r), tol);
      EXPECT_LE(err(dg, dg_r), tol);
      // dw alone.
      Tensor dw1 = start();
      cuda_->rmsnorm_gate_backward(dy, o, g, w, r, Tensor{}, Tensor{}, dw1);
      EXPECT_TRUE(same_bytes(dw1, dw));
      // d_o in place of dy, and dg.
      Tensor io = dev(dt, shape), dg2 = dev(dt, shape), dw2 = start();
      cuda_->copy(io, dy);
      cuda_->rmsnorm_gate_backward(io, o, g, w, r, io, dg2, dw2);
      EXPECT_TRUE(same_bytes(dw2, dw));
      EXPECT_LE(err(io, do_r), tol);
      EXPECT_LE(err(dg2, dg_r), tol);
      // d_o with unaligned rows: the generic kernel writes it, dw keeps its path.
      Tensor dobuf = dev(dt, {B, T, H, dv + 1}), dg3 = dev(dt, shape), dw3 = start();
      Tensor dov = padded_view(dobuf, shape);
      cuda_->rmsnorm_gate_backward(dy, o, g, w, r, dov, dg3, dw3);
      EXPECT_TRUE(same_bytes(dw3, dw));
      EXPECT_LE(err(dov, do_r), tol);
      EXPECT_LE(err(dg3, dg_r), tol);
      // A second run.
      Tensor dw4 = start();
      cuda_->rmsnorm_gate_backward(dy, o, g, w, r, d_o, dg, dw4);
      EXPECT_TRUE(same_bytes(dw4, dw));
      // The generic colreduce: o's rows padded to dv + 1 elements (with and without d_o, dg).
      Tensor obuf = dev(dt, {B, T, H, dv + 1}), dw5 = start(), dw6 = start();
      Tensor ov = padded_view(obuf, shape);
      cuda_->copy(ov, o);
      cuda_->rmsnorm_gate_backward(dy, ov, g, w, r, d_o, dg, dw5);
      cuda_->rmsnorm_gate_backward(dy, ov, g, w, r, Tensor{}, Tensor{}, dw6);
      const auto fast = down(dw);
      EXPECT_LE(err(dw5, fast->t), kDwTol);
      EXPECT_LE(err(dw5, dw_r), kDwTol);
      EXPECT_TRUE(same_bytes(dw6, dw5));
    }
  }
}

// ---- SwiGLU -----------------------------------------------------------------------------------------

// F = 8200 (a partial block of chunks), 8192, 1030 (F % 8 != 0: generic); h through a padded
// view (generic) has the same bits.
TEST_F(CudaOpsFast, SwiGluFastPathShapes) {
  for (auto [N, F] : std::vector<std::pair<int64_t, int64_t>>{{33, 8200}, {300, 8192}, {5, 1030}}) {
    for (DType dt : {kF32, kBF16}) {
      SCOPED_TRACE("F " + std::to_string(F) + (dt == kF32 ? ", F32" : ", BF16"));
      const double tol = dt == kF32 ? 1e-5 : 1e-2;
      Tensor ab_r = host({N, 2 * F}), ab = dev(dt, {N, 2 * F});
      fill(ab_r, ab, 90, dt, -4, 4);
      Tensor h_r = host({N, F}), h = dev(dt, {N, F});
      cpu_->swiglu_forward(ab_r, h_r);
      cuda_->swiglu_forward(ab, h);
      EXPECT_LE(err(h, h_r), tol);
      Tensor hbuf = dev(dt, {N, F + 1}), h2 = dev(dt, {N, F});
      Tensor hv = padded_view(hbuf, {N, F});
      cuda_->swiglu_forward(ab, hv);
      cuda_->copy(h2, hv);
      EXPECT_TRUE(same_bytes(h2, h));
      // backward: vs the CPU; a padded dh (rows not 16-byte aligned) takes the scalar
      // kernel, whose bits the vector kernel must give; in place (dab = ab) too
      Tensor dh_r = host({N, F}), dh = dev(dt, {N, F});
      fill(dh_r, dh, 91, dt, -1, 1);
      Tensor dab_r = host({N, 2 * F}), dab = dev(dt, {N, 2 * F});
      cpu_->swiglu_backward(dh_r, ab_r, dab_r);
      cuda_->swiglu_backward(dh, ab, dab);
      EXPECT_LE(err(dab, dab_r), tol);
      Tensor dhbuf = dev(dt, {N, F + 1}), dab2 = dev(dt, {N, 2 * F});
      Tensor dhv = padded_view(dhbuf, {N, F});
      cuda_->copy(dhv, dh);
      cuda_->swiglu_backward(dhv, ab, dab2);
      EXPECT_TRUE(same_bytes(dab2, dab)) << "vector and scalar swiglu backward differ";
      cuda_->swiglu_backward(dh, ab, ab);
      EXPECT_TRUE(same_bytes(ab, dab)) << "in-place swiglu backward differs";
    }
  }
}

// ---- cross-entropy ------------------------------------------------------------------------------

// V = 92160 (laplace-3b: a BF16 row goes through shared memory, an F32 row is read twice), 4096
// (fast) and 1000 (V % 8 != 0: generic); N = 37 rows whose targets include 0, V − 1, −1 (zero
// loss, zero gradient row) and V (NaN loss; the backward writes the row's plain softmax, as the
// generic kernel does). Losses and dlogits vs the CPU (tolerances of tests/test_cuda_ops.cpp; the
// CPU rejects target V, so its row there is computed on the host); the generic kernels through a
// padded view (rows not 16-byte aligned) within the same tolerance; the in-place backward equals
// the out-of-place one bitwise; a second run gives the same bits.
TEST_F(CudaOpsFast, CrossEntropyFastPathShapes) {
  const int64_t N = 37;
  const double scale = 0.25;
  const int64_t kNeg1 = 3, kNeg2 = 17, kOver = 20;  // rows with target −1, −1, V
  for (int64_t V : {92160, 4096, 1000}) {
    std::vector<int32_t> tv(N), tcpu(N);
    for (int64_t i = 0; i < N; ++i) tv[i] = static_cast<int32_t>((i * 7919 + 13) % V);
    tv[0] = 0;
    tv[1] = static_cast<int32_t>(V - 1);
    tv[kNeg1] = tv[kNeg2] = -1;
    tv[kOver] = static_cast<int32_t>(V);
    tcpu = tv;
    tcpu[kOver] = -1;  // the CPU's zero row there is replaced below
    Tensor t_unused, t_cpu;
    const Tensor tg = ints(tv, &t_unused);
    ints(tcpu, &t_cpu);
    for (DType dt : {kF32, kBF16}) {
      SCOPED_TRACE("V " + std::to_string(V) + (dt == kF32 ? ", F32" : ", BF16"));
      const double tol = dt == kF32 ? 1e-5 : 1e-2;
      Tensor x_r = host({N, V}), x = dev(dt, {N, V});
      fill(x_r, x, 120, dt, -8, 8);
      // CPU reference; row kOver: loss NaN (checked apart), dlogits = scale·softmax in double.
      Tensor l_r = host({N}), dl_r = host({N, V});
      cpu_->cross_entropy_forward(x_r, t_cpu, l_r);
      cpu_->cross_entropy_backward(x_r, t_cpu, scale, dl_r);
      {
        const float* xr = static_cast<const float*>(x_r.data) + kOver * V;
        float* dr = static_cast<float*>(dl_r.data) + kOver * V;
        double m = -INFINITY, s = 0;
        for (int64_t c = 0; c < V; ++c) m = std::max(m, static_cast<double>(xr[c]));
        for (int64_t c = 0; c < V; ++c) s += std::exp(xr[c] - m);
        for (int64_t c = 0; c < V; ++c) dr[c] = static_cast<float>(scale * std::exp(xr[c] - m) / s);
      }
      // Losses on the host: NaN at row kOver, the rest within tol of the reference.
      auto check_losses = [&](const Tensor& l, const Tensor& ref) {
        auto h = down(l);
        float* hp = static_cast<float*>(h->t.data);
        EXPECT_TRUE(std::isnan(hp[kOver])) << "target V must give a NaN loss";
        EXPECT_EQ(hp[kNeg1], 0.0f);
        EXPECT_EQ(hp[kNeg2], 0.0f);
        hp[kOver] = 0.0f;
        auto hr = host_tensor(kF32, {N});
        std::memcpy(hr->t.data, ref.data, N * sizeof(float));
        static_cast<float*>(hr->t.data)[kOver] = 0.0f;
        EXPECT_LE(max_rel_error(h->t, hr->t), 1e-5);
      };
      Tensor l = dev(kF32, {N});
      cuda_->cross_entropy_forward(x, tg, l);
      check_losses(l, l_r);
      Tensor dl = dev(dt, {N, V});
      cuda_->cross_entropy_backward(x, tg, scale, dl);
      EXPECT_LE(err(dl, dl_r), tol);
      // Two runs: the same bits.
      Tensor l2 = dev(kF32, {N}), dl2 = dev(dt, {N, V});
      cuda_->cross_entropy_forward(x, tg, l2);
      cuda_->cross_entropy_backward(x, tg, scale, dl2);
      EXPECT_TRUE(same_bytes(l2, l));
      EXPECT_TRUE(same_bytes(dl2, dl));
      // The generic kernels: logits' rows padded to V + 1 elements; also in place there.
      Tensor xbuf = dev(dt, {N, V + 1});
      Tensor xv = padded_view(xbuf, {N, V});
      cuda_->copy(xv, x);
      Tensor lg = dev(kF32, {N}), dlg = dev(dt, {N, V});
      cuda_->cross_entropy_forward(xv, tg, lg);
      const auto fast_l = down(l);
      check_losses(lg, fast_l->t);
      cuda_->cross_entropy_backward(xv, tg, scale, dlg);
      const auto fast_dl = down(dl);
      EXPECT_LE(err(dlg, fast_dl->t), tol);
      cuda_->cross_entropy_backward(xv, tg, scale, xv);
      Tensor dlg2 = dev(dt, {N, V});
      cuda_->copy(dlg2, xv);
      EXPECT_TRUE(same_bytes(dlg2, dlg)) << "in-place generic backward differs";
      // In place on the fast path: dlogits aliasing logits, the same bits as out of place.
      Tensor io = dev(dt, {N, V});
      cuda_->copy(io, x);
      cuda_->cross_entropy_backward(io, tg, scale, io);
      EXPECT_TRUE(same_bytes(io, dl)) << "in-place backward differs";
    }
  }
}

}  // namespace
}  // namespace laplace
