// CPU backend ops: forwards vs naive fp64 references, backwards vs central finite
// differences (fp64) of a scalar loss Σ out ⊙ R, conv windows, optimizer formulas and
// determinism across thread counts.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <vector>

#include "ops/backend.h"
#include "ops/cpu/cpu_backend.h"
#include "ops/cpu/gemm_rows.h"
#include "tests/test_util.h"

namespace laplace {
namespace {

using laplace::testing::fill_uniform;
using laplace::testing::OwnedTensor;

// ---- helpers ---------------------------------------------------------------------------

using testing::element_get;
using testing::element_set;
std::vector<double> vals(const Tensor& t) {
  std::vector<double> r(t.numel());
  for (int64_t i = 0; i < t.numel(); ++i) r[i] = element_get(t, i);
  return r;
}
// max|a − ref| / max|ref|
double rel(const std::vector<double>& a, const std::vector<double>& ref) {
  EXPECT_EQ(a.size(), ref.size());
  double num = 0, den = 1e-300;
  for (size_t i = 0; i < std::min(a.size(), ref.size()); ++i) {
    if (std::isnan(a[i]) || std::isnan(ref[i])) return INFINITY;
    num = std::max(num, std::fabs(a[i] - ref[i]));
    den = std::max(den, std::fabs(ref[i]));
  }
  return num / den;
}
double rel(const Tensor& a, const std::vector<double>& ref) { return rel(vals(a), ref); }
std::vector<double> minus(std::vector<double> a, const std::vector<double>& b) {
  for (size_t i = 0; i < a.size(); ++i) a[i] -= b[i];
  return a;
}
double tol(DType dt) { return dt == DType::kF64 ? 1e-12 : 1e-5; }
const char* dname(DType dt) { return dt == DType::kF64 ? "F64" : "F32"; }

// A view of `base` with the given shape and strides (elements).
Tensor view(const Tensor& base, std::initializer_list<int64_t> shape, std::initializer_list<int64_t> stride,
            int64_t offset = 0) {
  Tensor t = base;
  t.ndim = static_cast<int>(shape.size());
  int i = 0;
  for (int64_t s : shape) t.shape[i++] = s;
  i = 0;
  for (int64_t s : stride) t.stride[i++] = s;
  t.data = static_cast<char*>(base.data) + offset * static_cast<int64_t>(dtype_size(base.dtype));
  return t;
}

// Σ a ⊙ r
double dot(const Tensor& a, const Tensor& r) {
  double s = 0;
  for (int64_t i = 0; i < a.numel(); ++i) s += element_get(a, i) * element_get(r, i);
  return s;
}

// Central finite differences of loss() w.r.t. every element of t (F64), h = 1e-6.
std::vector<double> fd_grad(const Tensor& t, const std::function<double()>& loss, double h = 1e-6) {
  std::vector<double> g(t.numel());
  for (int64_t i = 0; i < t.numel(); ++i) {
    const double x = element_get(t, i);
    element_set(t, i, x + h);
    const double lp = loss();
    element_set(t, i, x - h);
    const double lm = loss();
    element_set(t, i, x);
    g[i] = (lp - lm) / (2 * h);
  }
  return g;
}

constexpr double kFdTol = 1e-6;
const DType kFloatTypes[] = {DType::kF64, DType::kF32};

class CpuOps : public ::testing::Test {
 protected:
  std::unique_ptr<Backend> be = make_cpu_backend();
};

// ---- memory ops -------------------------------------------------------------------------

TEST_F(CpuOps, MemoryOpsStrided) {
  EXPECT_EQ(be->device(), Device::kCPU);
  EXPECT_EQ(&be->allocator(), &cpu_allocator());
  be->synchronize();
  OwnedTensor src(DType::kF32, {5, 9}), dst(DType::kF32, {5, 12}), d64(DType::kF64, {5, 7});
  fill_uniform(src, 1);
  fill_uniform(dst, 2);
  const std::vector<double> dst0 = vals(dst);
  Tensor s = src.t.slice(1, 1, 8), d = dst.t.slice(1, 3, 10);  // [5,7] strided views
  be->copy(d, s);
  EXPECT_EQ(vals(d), vals(s));
  for (int64_t r = 0; r < 5; ++r)  // columns outside the view untouched
    for (int64_t c : {0, 1, 2, 10, 11}) EXPECT_EQ(element_get(dst, r * 12 + c), dst0[r * 12 + c]);
  be->copy(d64, s);  // F32 -> F64
  EXPECT_EQ(vals(d64), vals(s));
  be->fill(d, 2.5);
  for (double v : vals(d)) EXPECT_EQ(v, 2.5);
  be->copy(d, d64);  // F64 -> F32
  EXPECT_EQ(vals(d), vals(s));
  // axpy and scale on strided views
  OwnedTensor y(DType::kF64, {5, 7});
  fill_uniform(y, 3);
  std::vector<double> ref = vals(y), x = vals(d64);
  be->axpy(-0.75, d64, y);
  for (size_t i = 0; i < ref.size(); ++i) ref[i] += -0.75 * x[i];
  EXPECT_LE(rel(y, ref), 1e-15);
  std::vector<double> before = vals(d);
  be->scale(d, 3.0);
  for (int64_t i = 0; i < d.numel(); ++i) EXPECT_EQ(element_get(d, i), static_cast<float>(before[i] * 3.0));
  // I32 copy
  OwnedTensor a(DType::kI32, {3, 4}), b(DType::kI32, {3, 4});
  for (int64_t i = 0; i < 12; ++i) element_set(a, i, i * 7 - 20);
  be->copy(b, a);
  EXPECT_EQ(vals(b), vals(a));
}

// ---- gemm ------------------------------------------------------------------------------

// c = alpha·op(a)·op(b) + beta·c0 in fp64, naive.
std::vector<double> ref_gemm(const Tensor& a, bool ta, const Tensor& b, bool tb, const std::vector<double>& c0,
                             int64_t M, int64_t N, int64_t K, double alpha, double beta) {
  std::vector<double> A = vals(a), B = vals(b), C(M * N);
  const int64_t ac = a.shape[1], bc = b.shape[1];
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      double s = 0;
      for (int64_t k = 0; k < K; ++k)
        s += (ta ? A[k * ac + i] : A[i * ac + k]) * (tb ? B[j * bc + k] : B[k * bc + j]);
      C[i * N + j] = alpha * s + beta * c0[i * N + j];
    }
  return C;
}

TEST_F(CpuOps, GemmAllTransposesOddShapesStrided) {
  struct S { int64_t M, N, K; };
  for (DType dt : kFloatTypes)
    for (S s : {S{1, 1, 1}, S{3, 5, 7}, S{13, 11, 9}, S{17, 1, 5}, S{2, 19, 1}})
      for (bool ta : {false, true})
        for (bool tb : {false, true}) {
          const int64_t ar = ta ? s.K : s.M, ac = ta ? s.M : s.K;
          const int64_t br = tb ? s.N : s.K, bc = tb ? s.K : s.N;
          // Padded buffers: the operands are views with stride[0] > cols.
          OwnedTensor A(dt, {ar, ac + 3}), B(dt, {br, bc + 2}), C(dt, {s.M, s.N + 5});
          fill_uniform(A, 10 + s.M);
          fill_uniform(B, 20 + s.N);
          fill_uniform(C, 30 + s.K);
          Tensor a = A.t.slice(1, 0, ac), b = B.t.slice(1, 2, 2 + bc), c = C.t.slice(1, 1, 1 + s.N);
          const std::vector<double> c0 = vals(c);
          be->gemm(a, ta, b, tb, c, 0.75, -0.5);
          EXPECT_LE(rel(c, ref_gemm(a, ta, b, tb, c0, s.M, s.N, s.K, 0.75, -0.5)), tol(dt))
              << dname(dt) << " M" << s.M << " N" << s.N << " K" << s.K << " ta" << ta << " tb" << tb;
        }
}

// y = x·Wᵀ in fp64, x [M,K], W [N,K] contiguous.
template <class T> std::vector<double> ref_linear(const T* x, const T* w, int64_t M, int64_t N, int64_t K) {
  std::vector<double> y(M * N);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      double s = 0;
      for (int64_t k = 0; k < K; ++k) s += static_cast<double>(x[i * K + k]) * w[j * K + k];
      y[i * N + j] = s;
    }
  return y;
}

TEST_F(CpuOps, GemmRealShapeLinear) {
  // y[4, 9216] = x[4, 3072] · W[9216, 3072]ᵀ (the qkvg projection of 4 decode rows).
  const int64_t M = 4, N = 9216, K = 3072;
  for (DType dt : kFloatTypes) {
    OwnedTensor x(dt, {M, K}), w(dt, {N, K}), y(dt, {M, N});
    fill_uniform(x, 1);
    fill_uniform(w, 2);
    be->gemm(x, false, w, true, y, 1.0, 0.0);
    const std::vector<double> ref = dt == DType::kF64 ? ref_linear(x.ptr<double>(), w.ptr<double>(), M, N, K)
                                                      : ref_linear(x.ptr<float>(), w.ptr<float>(), M, N, K);
    const double e = rel(y, ref);
    EXPECT_LE(e, tol(dt)) << dname(dt);
    std::printf("[gemm 4x9216x3072 %s] max rel err %.3g\n", dname(dt), e);
  }
}

// x·Wᵀ (the forward projections) goes through cpu::gemm_rows: a row's bits do not depend on
// the other rows of the call, on its position, on the thread count, or on the AVX2 / portable
// path; and it agrees with an F64 reference. Row tails (M mod 6), column tails (N mod 16 / 8),
// strided operands and alpha / beta as the model uses them (1, 0) and (1, 1), and others.
TEST_F(CpuOps, GemmRowsInvariantAcrossBatchPositionThreadsAndPaths) {
  struct S { int64_t M, N, K; };
  struct AB { double alpha, beta; };
  auto bytes = [](const Tensor& t, int64_t r) {  // row r of a 2-D view
    const char* p = static_cast<const char*>(t.data) + r * t.stride[0] * static_cast<int64_t>(dtype_size(t.dtype));
    return std::vector<char>(p, p + t.shape[1] * static_cast<int64_t>(dtype_size(t.dtype)));
  };
  int paths = 0;  // code paths compared (the portable one at least)
  for (DType dt : kFloatTypes) {
    for (S s : {S{13, 17, 96}, S{7, 130, 3}, S{97, 33, 257}, S{6, 16, 1}, S{1, 1, 5}, S{9, 40, 64}}) {
      for (AB ab : {AB{1.0, 0.0}, AB{1.0, 1.0}, AB{0.75, -0.5}}) {
        SCOPED_TRACE(std::string(dname(dt)) + " M" + std::to_string(s.M) + " N" + std::to_string(s.N) + " K" +
                     std::to_string(s.K) + " alpha " + std::to_string(ab.alpha) + " beta " + std::to_string(ab.beta));
        OwnedTensor A(dt, {s.M, s.K + 3}), W(dt, {s.N, s.K + 1}), C0(dt, {s.M, s.N + 2});
        fill_uniform(A, 40 + s.M);
        fill_uniform(W, 50 + s.N);
        fill_uniform(C0, 60 + s.K);
        const Tensor a = A.t.slice(1, 0, s.K), w = W.t.slice(1, 1, 1 + s.K);
        auto run = [&](const Tensor& x) {  // C = alpha·x·Wᵀ + beta·C0 rows
          auto out = std::make_unique<OwnedTensor>(dt, std::initializer_list<int64_t>{x.shape[0], s.N + 2});
          Tensor c = out->t.slice(1, 0, s.N);
          for (int64_t r = 0; r < x.shape[0]; ++r) be->copy(c.slice(0, r, r + 1), C0.t.slice(0, r, r + 1).slice(1, 0, s.N));
          be->gemm(x, false, w, true, c, ab.alpha, ab.beta);
          return out;
        };
        const auto full = run(a);
        const Tensor cf = full->t.slice(1, 0, s.N);
        const std::vector<double> c0 = vals(C0.t.slice(1, 0, s.N));
        EXPECT_LE(rel(cf, ref_gemm(a, false, w, true, c0, s.M, s.N, s.K, ab.alpha, ab.beta)), tol(dt));
        // A row alone against its row in the batch (a one-row run adds C0's row 0, so with
        // beta ≠ 0 only row 0 compares).
        for (int64_t r : {int64_t{0}, s.M / 2, s.M - 1}) {
          if (ab.beta != 0 && r != 0) continue;
          const auto one = run(a.slice(0, r, r + 1));
          EXPECT_EQ(bytes(one->t.slice(1, 0, s.N), 0), bytes(cf, r)) << "row " << r << " alone";
        }
        // Every code path this CPU has, and one thread, give the same bytes.
        for (cpu::GemmPath path : {cpu::GemmPath::kPortable, cpu::GemmPath::kAvx2, cpu::GemmPath::kAvx512}) {
          if (!cpu::gemm_rows_select(path)) continue;
          ++paths;
          const auto other = run(a);
          cpu::gemm_rows_select(cpu::GemmPath::kBest);
          for (int64_t r = 0; r < s.M; ++r)
            ASSERT_EQ(bytes(other->t.slice(1, 0, s.N), r), bytes(cf, r)) << "path " << static_cast<int>(path) << ", row " << r;
        }
        const int threads = omp_get_max_threads();
        omp_set_num_threads(1);
        const auto single = run(a);
        omp_set_num_threads(threads);
        for (int64_t r = 0; r < s.M; ++r)
          ASSERT_EQ(bytes(single->t.slice(1, 0, s.N), r), bytes(cf, r)) << "one thread, row " << r;
      }
    }
  }
  EXPECT_GT(paths, 0);
}

TEST_F(CpuOps, GemmBetaZeroIgnoresNaNAndEmptyK) {
  OwnedTensor a(DType::kF64, {3, 4}), b(DType::kF64, {4, 5}), c(DType::kF64, {3, 5});
  fill_uniform(a, 1);
  fill_uniform(b, 2);
  be->fill(c, NAN);
  be->gemm(a, false, b, false, c, 1.0, 0.0);
  EXPECT_LE(rel(c, ref_gemm(a, false, b, false, std::vector<double>(15, 0.0), 3, 5, 4, 1.0, 0.0)), 1e-12);
  // K = 0: c = beta·c
  OwnedTensor a0(DType::kF64, {3, 0}), b0(DType::kF64, {0, 5});
  std::vector<double> c0 = vals(c);
  be->gemm(a0, false, b0, false, c, 1.0, 2.0);
  for (int64_t i = 0; i < 15; ++i) EXPECT_EQ(element_get(c, i), 2.0 * c0[i]);
  be->gemm(a0, false, b0, false, c, 1.0, 0.0);
  for (int64_t i = 0; i < 15; ++i) EXPECT_EQ(element_get(c, i), 0.0);
}

// Linear layer Y = X·Wᵀ: dX = dY·W, dW += dYᵀ·X, via gemm.
TEST_F(CpuOps, LinearBackwardFiniteDiff) {
  const int64_t N = 3, I = 5, O = 4;
  OwnedTensor x(DType::kF64, {N, I}), w(DType::kF64, {O, I}), y(DType::kF64, {N, O}), r(DType::kF64, {N, O});
  OwnedTensor dx(DType::kF64, {N, I}), dw(DType::kF64, {O, I});
  fill_uniform(x, 1);
  fill_uniform(w, 2);
  fill_uniform(r, 3);
  fill_uniform(dw, 4);
  auto loss = [&] {
    be->gemm(x, false, w, true, y, 1.0, 0.0);
    return dot(y, r);
  };
  const std::vector<double> dw0 = vals(dw);
  be->gemm(r, false, w, false, dx, 1.0, 0.0);
  be->gemm(r, true, x, false, dw, 1.0, 1.0);  // accumulate
  EXPECT_LE(rel(dx, fd_grad(x, loss)), kFdTol);
  EXPECT_LE(rel(minus(vals(dw), dw0), fd_grad(w, loss)), kFdTol);
}

// ---- embedding -------------------------------------------------------------------------

TEST_F(CpuOps, EmbeddingForward) {
  for (DType dt : kFloatTypes) {
    const int64_t V = 11, D = 7;
    OwnedTensor table(dt, {V, D}), ids(DType::kI32, {2, 5}), out(dt, {10, D});
    fill_uniform(table, 1);
    const int ii[10] = {3, 0, 10, 3, 7, 7, 1, 10, 2, 5};
    for (int i = 0; i < 10; ++i) element_set(ids, i, ii[i]);
    be->embedding_forward(ids, table, out);
    for (int64_t n = 0; n < 10; ++n)
      for (int64_t d = 0; d < D; ++d) EXPECT_EQ(element_get(out, n * D + d), element_get(table, ii[n] * D + d));
  }
}

TEST_F(CpuOps, EmbeddingBackwardFiniteDiff) {
  const int64_t V = 6, D = 5, N = 9;
  OwnedTensor table(DType::kF64, {V, D}), ids(DType::kI32, {N}), out(DType::kF64, {N, D}),
      r(DType::kF64, {N, D}), dtable(DType::kF64, {V, D});
  fill_uniform(table, 1);
  fill_uniform(r, 2);
  fill_uniform(dtable, 3);
  const int ii[N] = {2, 0, 2, 5, 2, 0, 1, 5, 3};  // id 4 unused, 2 repeated
  for (int64_t i = 0; i < N; ++i) element_set(ids, i, ii[i]);
  auto loss = [&] {
    be->embedding_forward(ids, table, out);
    return dot(out, r);
  };
  const std::vector<double> d0 = vals(dtable);
  be->embedding_backward(ids, r, dtable);
  EXPECT_LE(rel(minus(vals(dtable), d0), fd_grad(table, loss)), kFdTol);
}

TEST_F(CpuOps, EmbeddingIdOutOfRangeDies) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  OwnedTensor table(DType::kF32, {4, 3}), ids(DType::kI32, {2}), out(DType::kF32, {2, 3});
  element_set(ids, 0, 1);
  element_set(ids, 1, 4);
  EXPECT_DEATH(be->embedding_forward(ids, table, out), "out of range");
  element_set(ids, 1, -1);
  EXPECT_DEATH(be->embedding_backward(ids, out, table), "out of range");
}

// ---- layernorm -------------------------------------------------------------------------

TEST_F(CpuOps, LayerNormForward) {
  struct S { int64_t N, D; };
  const double eps = 1e-5;
  for (DType dt : kFloatTypes)
    for (S s : {S{1, 1}, S{3, 7}, S{5, 64}, S{4, 3072}}) {
      OwnedTensor xb(dt, {s.N, s.D + 5}), w(dt, {s.D}), b(dt, {s.D}), y(dt, {s.N, s.D}), mean(dt, {s.N}),
          rstd(dt, {s.N});
      fill_uniform(xb, s.D, -2.0, 3.0);
      fill_uniform(w, 2);
      fill_uniform(b, 3);
      Tensor x = xb.t.slice(1, 2, 2 + s.D);  // strided rows
      be->layernorm_forward(x, w, b, eps, y, mean, rstd);
      std::vector<double> X = vals(x), W = vals(w), Bv = vals(b), Y(s.N * s.D), M(s.N), R(s.N);
      for (int64_t i = 0; i < s.N; ++i) {
        double mu = 0, var = 0;
        for (int64_t d = 0; d < s.D; ++d) mu += X[i * s.D + d];
        mu /= s.D;
        for (int64_t d = 0; d < s.D; ++d) var += (X[i * s.D + d] - mu) * (X[i * s.D + d] - mu);
        var /= s.D;
        M[i] = mu;
        R[i] = 1 / std::sqrt(var + eps);
        for (int64_t d = 0; d < s.D; ++d) Y[i * s.D + d] = (X[i * s.D + d] - mu) * R[i] * W[d] + Bv[d];
      }
      EXPECT_LE(rel(y, Y), tol(dt)) << dname(dt) << " N" << s.N << " D" << s.D;
      EXPECT_LE(rel(mean, M), tol(dt));
      EXPECT_LE(rel(rstd, R), tol(dt));
      // Without the optional statistics.
      OwnedTensor y2(dt, {s.N, s.D});
      be->layernorm_forward(x, w, b, eps, y2, Tensor{}, Tensor{});
      EXPECT_EQ(vals(y2), vals(y));
    }
}

TEST_F(CpuOps, LayerNormBackwardFiniteDiff) {
  struct S { int64_t N, D; };
  const double eps = 1e-5;
  for (S s : {S{3, 7}, S{4, 33}, S{70, 3}}) {
    const DType dt = DType::kF64;
    OwnedTensor x(dt, {s.N, s.D}), w(dt, {s.D}), b(dt, {s.D}), y(dt, {s.N, s.D}), r(dt, {s.N, s.D});
    OwnedTensor mean(dt, {s.N}), rstd(dt, {s.N}), dx(dt, {s.N, s.D}), dw(dt, {s.D}), db(dt, {s.D});
    fill_uniform(x, 1, -2.0, 2.0);
    fill_uniform(w, 2);
    fill_uniform(b, 3);
    fill_uniform(r, 4);
    fill_uniform(dw, 5);
    fill_uniform(db, 6);
    auto loss = [&] {
      be->layernorm_forward(x, w, b, eps, y, mean, rstd);
      return dot(y, r);
    };
    loss();
    const std::vector<double> dw0 = vals(dw), db0 = vals(db);
    be->layernorm_backward(r, x, w, mean, rstd, dx, false, dw, db);
    const std::vector<double> dxv = vals(dx);
    EXPECT_LE(rel(dxv, fd_grad(x, loss)), kFdTol) << "dx N" << s.N << " D" << s.D;
    EXPECT_LE(rel(minus(vals(dw), dw0), fd_grad(w, loss)), kFdTol) << "dw";
    EXPECT_LE(rel(minus(vals(db), db0), fd_grad(b, loss)), kFdTol) << "db";
    // accumulate_dx adds onto dx; undefined dw/db are skipped.
    OwnedTensor dx2(dt, {s.N, s.D});
    fill_uniform(dx2, 7);
    const std::vector<double> dx20 = vals(dx2);
    loss();
    be->layernorm_backward(r, x, w, mean, rstd, dx2, true, Tensor{}, Tensor{});
    EXPECT_LE(rel(minus(vals(dx2), dx20), dxv), 1e-14);
  }
}

// ---- conv ------------------------------------------------------------------------------

struct ConvRef {
  std::vector<double> pre, c, win;  // [B,T,D], [B,T,D], [B,K,D]
};
// e = [window (or zeros) | u];  pre_t = Σ_j w[d,j]·e[t+1+j];  win_out[i] = e[T+i].
ConvRef ref_conv(const std::vector<double>& u, const std::vector<double>& w, const std::vector<double>* win,
                 int64_t B, int64_t T, int64_t D, int64_t K) {
  ConvRef r;
  r.pre.resize(B * T * D);
  r.c.resize(B * T * D);
  r.win.resize(B * K * D);
  for (int64_t b = 0; b < B; ++b) {
    auto e = [&](int64_t i, int64_t d) {
      if (i >= K) return u[(b * T + i - K) * D + d];
      return win ? (*win)[(b * K + i) * D + d] : 0.0;
    };
    for (int64_t t = 0; t < T; ++t)
      for (int64_t d = 0; d < D; ++d) {
        double s = 0;
        for (int64_t j = 0; j < K; ++j) s += w[d * K + j] * e(t + 1 + j, d);
        r.pre[(b * T + t) * D + d] = s;
        r.c[(b * T + t) * D + d] = s / (1 + std::exp(-s));
      }
    for (int64_t i = 0; i < K; ++i)
      for (int64_t d = 0; d < D; ++d) r.win[(b * K + i) * D + d] = e(T + i, d);
  }
  return r;
}

TEST_F(CpuOps, ConvSiluForward) {
  struct S { int64_t B, T, D, K; };
  for (DType dt : kFloatTypes)
    for (S s : {S{2, 7, 5, 4}, S{1, 3, 37, 4}, S{3, 1, 70, 4}, S{2, 5, 3, 1}, S{2, 6, 4, 2}})
      for (bool with_win : {false, true}) {
        OwnedTensor u(dt, {s.B, s.T, s.D}), w(dt, {s.D, s.K}), c(dt, {s.B, s.T, s.D}), pre(dt, {s.B, s.T, s.D});
        OwnedTensor win(dt, {s.B, s.K, s.D}), wout(dt, {s.B, s.K, s.D});
        fill_uniform(u, 1, -2.0, 2.0);
        fill_uniform(w, 2);
        fill_uniform(win, 3, -2.0, 2.0);
        const std::vector<double> winv = vals(win);
        be->conv_silu_forward(u, w, c, pre, with_win ? Tensor(win) : Tensor{}, wout, Tensor{});
        ConvRef r = ref_conv(vals(u), vals(w), with_win ? &winv : nullptr, s.B, s.T, s.D, s.K);
        EXPECT_LE(rel(pre, r.pre), tol(dt)) << dname(dt) << " T" << s.T << " D" << s.D << " win" << with_win;
        EXPECT_LE(rel(c, r.c), tol(dt));
        EXPECT_EQ(vals(wout), r.win);  // copies, exact
        EXPECT_EQ(vals(win), winv);    // input window untouched
      }
}

TEST_F(CpuOps, ConvSiluBackwardFiniteDiff) {
  struct S { int64_t B, T, D, K; };
  for (S s : {S{2, 6, 5, 4}, S{1, 3, 35, 4}, S{2, 5, 3, 2}}) {
    const DType dt = DType::kF64;
    OwnedTensor u(dt, {s.B, s.T, s.D}), w(dt, {s.D, s.K}), c(dt, {s.B, s.T, s.D}), pre(dt, {s.B, s.T, s.D});
    OwnedTensor r(dt, {s.B, s.T, s.D}), du(dt, {s.B, s.T, s.D}), dw(dt, {s.D, s.K});
    fill_uniform(u, 1, -2.0, 2.0);
    fill_uniform(w, 2);
    fill_uniform(r, 3);
    fill_uniform(dw, 4);
    auto loss = [&] {
      be->conv_silu_forward(u, w, c, pre, Tensor{}, Tensor{}, Tensor{});
      return dot(c, r);
    };
    loss();
    const std::vector<double> dw0 = vals(dw);
    be->conv_silu_backward(r, u, w, pre, du, dw);
    const std::vector<double> duv = vals(du), dwv = minus(vals(dw), dw0);
    EXPECT_LE(rel(duv, fd_grad(u, loss)), kFdTol) << "du D" << s.D;
    EXPECT_LE(rel(dwv, fd_grad(w, loss)), kFdTol) << "dw D" << s.D;
    // Without the saved pre-activation: recomputed, same result.
    OwnedTensor du2(dt, {s.B, s.T, s.D}), dw2(dt, {s.D, s.K});
    fill_uniform(dw2, 4);
    be->conv_silu_backward(r, u, w, Tensor{}, du2, dw2);
    EXPECT_EQ(vals(du2), duv);
    EXPECT_EQ(vals(dw2), vals(dw));
  }
}

// Running T tokens at once equals running them in pieces (window passed in place) and
// token by token (window ping-ponged between two buffers); bitwise.
TEST_F(CpuOps, ConvWindowPiecesEqualFull) {
  for (DType dt : kFloatTypes) {
    const int64_t B = 2, T = 9, D = 37, K = 4;
    OwnedTensor u(dt, {B, T, D}), w(dt, {D, K}), c(dt, {B, T, D}), wfull(dt, {B, K, D});
    fill_uniform(u, 1, -2.0, 2.0);
    fill_uniform(w, 2);
    be->conv_silu_forward(u, w, c, Tensor{}, Tensor{}, wfull, Tensor{});
    const std::vector<double> cfull = vals(c), winfull = vals(wfull);
    for (int64_t T1 : {2, 6}) {  // T1 < K and T1 ≥ K
      OwnedTensor c2(dt, {B, T, D}), win(dt, {B, K, D});
      be->conv_silu_forward(u.t.slice(1, 0, T1), w, c2.t.slice(1, 0, T1), Tensor{}, Tensor{}, win, Tensor{});
      be->conv_silu_forward(u.t.slice(1, T1, T), w, c2.t.slice(1, T1, T), Tensor{}, win, win, Tensor{});
      EXPECT_EQ(vals(c2), cfull) << dname(dt) << " T1=" << T1;
      EXPECT_EQ(vals(win), winfull) << dname(dt) << " T1=" << T1;
    }
    OwnedTensor c3(dt, {B, T, D}), wa(dt, {B, K, D}), wb(dt, {B, K, D});
    fill_uniform(wa, 9);  // garbage: the first call has no input window
    Tensor cur = wa, nxt = wb;
    for (int64_t t = 0; t < T; ++t) {
      be->conv_silu_forward(u.t.slice(1, t, t + 1), w, c3.t.slice(1, t, t + 1), Tensor{},
                            t == 0 ? Tensor{} : cur, nxt, Tensor{});
      std::swap(cur, nxt);
    }
    EXPECT_EQ(vals(c3), cfull) << dname(dt) << " token by token";
    EXPECT_EQ(vals(cur), winfull);
    // In-place token by token too.
    OwnedTensor c4(dt, {B, T, D}), wi(dt, {B, K, D});
    for (int64_t t = 0; t < T; ++t)
      be->conv_silu_forward(u.t.slice(1, t, t + 1), w, c4.t.slice(1, t, t + 1), Tensor{}, wi, wi, Tensor{});
    EXPECT_EQ(vals(c4), cfull);
    EXPECT_EQ(vals(wi), winfull);
  }
}

// A pool of S slots whose dim-0 stride exceeds K·D; only the named slots change.
TEST_F(CpuOps, ConvWindowSlotsTouchOnlyNamedSlots) {
  const DType dt = DType::kF64;
  const int64_t S = 5, B = 2, T = 3, D = 7, K = 4, P = K * D + 13;
  OwnedTensor poolbuf(dt, {S * P}), u(dt, {B, T, D}), w(dt, {D, K}), c(dt, {B, T, D}), slots(DType::kI32, {B});
  fill_uniform(poolbuf, 1);
  fill_uniform(u, 2);
  fill_uniform(w, 3);
  const int slot_of[B] = {3, 0};
  for (int64_t b = 0; b < B; ++b) element_set(slots, b, slot_of[b]);
  Tensor pool = view(poolbuf, {S, K, D}, {P, D, 1});
  const std::vector<double> before = vals(poolbuf);
  // The windows of the named slots as a dense [B,K,D] for the reference.
  std::vector<double> win(B * K * D);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < K * D; ++i) win[b * K * D + i] = before[slot_of[b] * P + i];
  be->conv_silu_forward(u, w, c, Tensor{}, pool, pool, slots);
  ConvRef r = ref_conv(vals(u), vals(w), &win, B, T, D, K);
  EXPECT_LE(rel(c, r.c), 1e-12);
  const std::vector<double> after = vals(poolbuf);
  for (int64_t s = 0; s < S; ++s)
    for (int64_t i = 0; i < P; ++i) {
      const int64_t b = s == 3 ? 0 : s == 0 ? 1 : -1;
      if (b >= 0 && i < K * D) {
        EXPECT_EQ(after[s * P + i], r.win[b * K * D + i]) << "slot " << s;
      } else {
        EXPECT_EQ(after[s * P + i], before[s * P + i]) << "slot " << s << " elem " << i;
      }
    }
}

// ---- rmsnorm gate ------------------------------------------------------------------------

struct GateCase {
  int64_t B, T, H, dv, dk;
  int64_t fused() const { return H * (2 * dk + 2 * dv); }
  int64_t goff() const { return H * (2 * dk + dv); }
};
// g as a view into the fused [B,T,H·(2dk+2dv)] buffer (the g block of the projection).
Tensor gate_view(const Tensor& fused, const GateCase& s) {
  return view(fused, {s.B, s.T, s.H, s.dv}, {s.T * s.fused(), s.fused(), s.dv, 1}, s.goff());
}

TEST_F(CpuOps, RmsNormGateForward) {
  const double eps = 1e-5;
  for (DType dt : kFloatTypes)
    for (GateCase s : {GateCase{2, 3, 16, 192, 96}, GateCase{1, 5, 3, 7, 4}}) {
      OwnedTensor o(dt, {s.B, s.T, s.H, s.dv}), fused(dt, {s.B, s.T, s.fused()}), w(dt, {s.dv}),
          y(dt, {s.B, s.T, s.H, s.dv}), rstd(dt, {s.B, s.T, s.H});
      fill_uniform(o, 1, -2.0, 2.0);
      fill_uniform(fused, 2, -3.0, 3.0);
      fill_uniform(w, 3);
      Tensor g = gate_view(fused, s);
      be->rmsnorm_gate_forward(o, g, w, eps, y, rstd);
      std::vector<double> O = vals(o), G = vals(g), W = vals(w), Y(O.size()), R(s.B * s.T * s.H);
      for (int64_t r = 0; r < s.B * s.T * s.H; ++r) {
        double ss = 0;
        for (int64_t d = 0; d < s.dv; ++d) ss += O[r * s.dv + d] * O[r * s.dv + d];
        R[r] = 1 / std::sqrt(ss / s.dv + eps);
        for (int64_t d = 0; d < s.dv; ++d) {
          const double gv = G[r * s.dv + d];
          Y[r * s.dv + d] = O[r * s.dv + d] * R[r] * W[d] * gv / (1 + std::exp(-gv));
        }
      }
      EXPECT_LE(rel(y, Y), tol(dt)) << dname(dt) << " H" << s.H << " dv" << s.dv;
      EXPECT_LE(rel(rstd, R), tol(dt));
    }
}

TEST_F(CpuOps, RmsNormGateBackwardFiniteDiff) {
  const double eps = 1e-5;
  const DType dt = DType::kF64;
  for (GateCase s : {GateCase{2, 3, 3, 7, 4}, GateCase{1, 2, 2, 64, 4}}) {
    OwnedTensor o(dt, {s.B, s.T, s.H, s.dv}), fused(dt, {s.B, s.T, s.fused()}), dfused(dt, {s.B, s.T, s.fused()}),
        w(dt, {s.dv}), y(dt, {s.B, s.T, s.H, s.dv}), r(dt, {s.B, s.T, s.H, s.dv}), rstd(dt, {s.B, s.T, s.H}),
        d_o(dt, {s.B, s.T, s.H, s.dv}), dw(dt, {s.dv});
    fill_uniform(o, 1, -2.0, 2.0);
    fill_uniform(fused, 2, -3.0, 3.0);
    fill_uniform(w, 3);
    fill_uniform(r, 4);
    fill_uniform(dw, 5);
    be->fill(dfused, 123.0);  // sentinel outside the dg view
    Tensor g = gate_view(fused, s), dg = gate_view(dfused, s);
    auto loss = [&] {
      be->rmsnorm_gate_forward(o, g, w, eps, y, rstd);
      return dot(y, r);
    };
    loss();
    const std::vector<double> dw0 = vals(dw);
    be->rmsnorm_gate_backward(r, o, g, w, rstd, d_o, dg, dw);
    EXPECT_LE(rel(d_o, fd_grad(o, loss)), kFdTol) << "d_o dv" << s.dv;
    EXPECT_LE(rel(dg, fd_grad(g, loss)), kFdTol) << "dg";
    EXPECT_LE(rel(minus(vals(dw), dw0), fd_grad(w, loss)), kFdTol) << "dw";
    // Nothing outside the g block of the fused gradient was written.
    const int64_t F = s.fused();
    for (int64_t i = 0; i < dfused.t.numel(); ++i) {
      const int64_t col = i % F;
      if (col < s.goff() || col >= s.goff() + s.H * s.dv) {
        ASSERT_EQ(element_get(dfused, i), 123.0) << i;
      }
    }
  }
}

// ---- swiglu ----------------------------------------------------------------------------

TEST_F(CpuOps, SwigluForward) {
  for (DType dt : kFloatTypes) {
    const int64_t N = 5, F = 9;
    OwnedTensor ab(dt, {N, 2 * F}), h(dt, {N, F});
    fill_uniform(ab, 1, -4.0, 4.0);
    be->swiglu_forward(ab, h);
    std::vector<double> A = vals(ab), ref(N * F);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t f = 0; f < F; ++f) {
        const double a = A[n * 2 * F + f], b = A[n * 2 * F + F + f];
        ref[n * F + f] = a / (1 + std::exp(-a)) * b;
      }
    EXPECT_LE(rel(h, ref), tol(dt)) << dname(dt);
  }
}

TEST_F(CpuOps, SwigluBackwardFiniteDiff) {
  const int64_t N = 3, F = 5;
  OwnedTensor ab(DType::kF64, {N, 2 * F}), h(DType::kF64, {N, F}), r(DType::kF64, {N, F}), dab(DType::kF64, {N, 2 * F});
  fill_uniform(ab, 1, -4.0, 4.0);
  fill_uniform(r, 2);
  auto loss = [&] {
    be->swiglu_forward(ab, h);
    return dot(h, r);
  };
  be->swiglu_backward(r, ab, dab);
  EXPECT_LE(rel(dab, fd_grad(ab, loss)), kFdTol);
  // dab may alias ab.
  OwnedTensor ab2(DType::kF64, {N, 2 * F});
  be->copy(ab2, ab);
  be->swiglu_backward(r, ab2, ab2);
  EXPECT_EQ(vals(ab2), vals(dab));
}

// ---- cross entropy -----------------------------------------------------------------------

TEST_F(CpuOps, CrossEntropyForward) {
  for (DType dt : kFloatTypes)
    for (int64_t V : {13, 1000})
      for (double shift : {0.0, 1000.0}) {
        const int64_t N = 6;
        OwnedTensor logits(dt, {N, V}), targets(DType::kI32, {N}), losses(dt, {N}), losses32(DType::kF32, {N});
        fill_uniform(logits, V, shift - 5.0, shift + 5.0);
        const int tt[N] = {3, -1, 0, 12, -100, 7};
        for (int64_t n = 0; n < N; ++n) element_set(targets, n, tt[n]);
        be->cross_entropy_forward(logits, targets, losses);
        be->cross_entropy_forward(logits, targets, losses32);
        std::vector<double> L = vals(logits), ref(N, 0.0);
        for (int64_t n = 0; n < N; ++n) {
          if (tt[n] < 0) continue;
          double m = -INFINITY, s = 0;
          for (int64_t v = 0; v < V; ++v) m = std::max(m, L[n * V + v]);
          for (int64_t v = 0; v < V; ++v) s += std::exp(L[n * V + v] - m);
          ref[n] = m + std::log(s) - L[n * V + tt[n]];
        }
        EXPECT_LE(rel(losses, ref), tol(dt)) << dname(dt) << " V" << V << " shift " << shift;
        EXPECT_LE(rel(losses32, ref), 1e-6);
        EXPECT_EQ(element_get(losses, 1), 0.0);
        EXPECT_EQ(element_get(losses, 4), 0.0);
      }
}

TEST_F(CpuOps, CrossEntropyBackwardFiniteDiff) {
  const int64_t N = 4, V = 7;
  const double scale = 0.37;
  OwnedTensor logits(DType::kF64, {N, V}), targets(DType::kI32, {N}), losses(DType::kF64, {N}),
      dl(DType::kF64, {N, V});
  fill_uniform(logits, 1, -3.0, 3.0);
  const int tt[N] = {2, -1, 6, 0};
  for (int64_t n = 0; n < N; ++n) element_set(targets, n, tt[n]);
  auto loss = [&] {
    be->cross_entropy_forward(logits, targets, losses);
    double s = 0;
    for (int64_t n = 0; n < N; ++n) s += element_get(losses, n);
    return scale * s;
  };
  be->fill(dl, 99.0);
  be->cross_entropy_backward(logits, targets, scale, dl);
  EXPECT_LE(rel(dl, fd_grad(logits, loss)), kFdTol);
  for (int64_t v = 0; v < V; ++v) EXPECT_EQ(element_get(dl, 1 * V + v), 0.0);  // ignored row
  // In place (dlogits aliasing logits) gives the same bytes.
  OwnedTensor l2(DType::kF64, {N, V});
  be->copy(l2, logits);
  be->cross_entropy_backward(l2, targets, scale, l2);
  EXPECT_EQ(vals(l2), vals(dl));
}

// ---- GLA (forwarded to ops/cpu/gla.h): wiring check at a tiny shape -----------------------

// o_t = Σ_{s≤t} λ^{t−s} (scale·q_t·k_s) v_s per head (the quadratic form).
TEST_F(CpuOps, GlaForwardsToKernels) {
  const int64_t B = 1, T = 5, H = 2, dk = 2, dv = 3;
  const DType dt = DType::kF64;
  GlaParams p;
  p.form = GlaForm::kChunked;
  p.chunk = 2;
  p.scale = 1 / std::sqrt(2.0);
  p.decay = {0.9, 0.5};
  OwnedTensor q(dt, {B, T, H, dk}), k(dt, {B, T, H, dk}), v(dt, {B, T, H, dv}), o(dt, {B, T, H, dv}),
      r(dt, {B, T, H, dv}), dq(dt, {B, T, H, dk}), dk_(dt, {B, T, H, dk}), dv_(dt, {B, T, H, dv});
  fill_uniform(q, 1);
  fill_uniform(k, 2);
  fill_uniform(v, 3);
  fill_uniform(r, 4);
  be->gla_forward(p, q, k, v, o, Tensor{}, Tensor{}, Tensor{});
  std::vector<double> ref(o.t.numel());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = 0; t < T; ++t)
        for (int64_t e = 0; e < dv; ++e) {
          double acc = 0;
          for (int64_t s2 = 0; s2 <= t; ++s2) {
            double qk = 0;
            for (int64_t i = 0; i < dk; ++i)
              qk += element_get(q, ((b * T + t) * H + h) * dk + i) * element_get(k, ((b * T + s2) * H + h) * dk + i);
            acc += std::pow(p.decay[h], static_cast<double>(t - s2)) * p.scale * qk *
                   element_get(v, ((b * T + s2) * H + h) * dv + e);
          }
          ref[((b * T + t) * H + h) * dv + e] = acc;
        }
  EXPECT_LE(rel(o, ref), 1e-12);
  auto loss = [&] {
    be->gla_forward(p, q, k, v, o, Tensor{}, Tensor{}, Tensor{});
    return dot(o, r);
  };
  be->gla_backward(p, q, k, v, Tensor{}, r, Tensor{}, dq, dk_, dv_, Tensor{});
  EXPECT_LE(rel(dq, fd_grad(q, loss)), kFdTol);
  EXPECT_LE(rel(dk_, fd_grad(k, loss)), kFdTol);
  EXPECT_LE(rel(dv_, fd_grad(v, loss)), kFdTol);
}

// ---- optimizer --------------------------------------------------------------------------

TEST_F(CpuOps, SumSquaresExactOnSmallIntegers) {
  for (DType dt : kFloatTypes) {
    const int64_t R = 317, C = 331;  // > kSumBlock elements
    OwnedTensor x(dt, {R, C + 4});
    std::mt19937 rng(5);
    std::uniform_int_distribution<int> dist(-8, 8);
    for (int64_t i = 0; i < x.t.numel(); ++i) element_set(x, i, dist(rng));
    int64_t whole = 0, sub = 0;
    for (int64_t r = 0; r < R; ++r)
      for (int64_t c = 0; c < C + 4; ++c) {
        const int64_t v = static_cast<int64_t>(element_get(x, r * (C + 4) + c));
        whole += v * v;
        if (c >= 1 && c < 1 + C) sub += v * v;
      }
    EXPECT_EQ(be->sum_squares(x), static_cast<double>(whole)) << dname(dt);
    EXPECT_EQ(be->sum_squares(x.t.slice(1, 1, 1 + C)), static_cast<double>(sub)) << dname(dt) << " strided";
  }
}

// One F64 sum per row, exact on small integers, for a strided view too; a row shard's
// sums are the whole matrix's rows' sums.
TEST_F(CpuOps, RowSumSquaresPerRowAndStrided) {
  for (DType dt : kFloatTypes) {
    const int64_t R = 37, C = 331;
    OwnedTensor x(dt, {R, C + 4});
    std::mt19937 rng(6);
    std::uniform_int_distribution<int> dist(-8, 8);
    for (int64_t i = 0; i < x.t.numel(); ++i) element_set(x, i, dist(rng));
    OwnedTensor whole(DType::kF64, {R}), sub(DType::kF64, {R}), shard(DType::kF64, {10});
    be->row_sum_squares(x, whole);
    be->row_sum_squares(x.t.slice(1, 1, 1 + C), sub);
    be->row_sum_squares(x.t.slice(0, 20, 30), shard);
    for (int64_t r = 0; r < R; ++r) {
      int64_t w = 0, s = 0;
      for (int64_t c = 0; c < C + 4; ++c) {
        const int64_t v = static_cast<int64_t>(element_get(x, r * (C + 4) + c));
        w += v * v;
        if (c >= 1 && c < 1 + C) s += v * v;
      }
      EXPECT_EQ(static_cast<const double*>(whole.t.data)[r], static_cast<double>(w)) << dname(dt) << " row " << r;
      EXPECT_EQ(static_cast<const double*>(sub.t.data)[r], static_cast<double>(s)) << dname(dt) << " strided";
    }
    EXPECT_EQ(0, std::memcmp(static_cast<const double*>(whole.t.data) + 20, shard.t.data, 10 * sizeof(double)));
  }
}

TEST_F(CpuOps, AdamWUpdateMatchesFormula) {
  for (DType dt : kFloatTypes) {
    OwnedTensor w(dt, {5, 7}), g(dt, {5, 7}), m(dt, {5, 7}), v(dt, {5, 7});
    fill_uniform(w, 1);
    fill_uniform(g, 2);
    fill_uniform(m, 3, -0.1, 0.1);
    fill_uniform(v, 4, 0.0, 0.01);
    AdamWParams p;
    p.lr = 3e-3;
    p.beta1 = 0.9;
    p.beta2 = 0.95;
    p.eps = 1e-8;
    p.wd = 0.1;
    p.step = 3;
    std::vector<double> W = vals(w), G = vals(g), M = vals(m), V = vals(v);
    for (size_t i = 0; i < W.size(); ++i) {
      M[i] = p.beta1 * M[i] + (1 - p.beta1) * G[i];
      V[i] = p.beta2 * V[i] + (1 - p.beta2) * G[i] * G[i];
      const double mh = M[i] / (1 - std::pow(p.beta1, 3)), vh = V[i] / (1 - std::pow(p.beta2, 3));
      W[i] = W[i] * (1 - p.lr * p.wd) - p.lr * mh / (std::sqrt(vh) + p.eps);
    }
    be->adamw_update(w, g, m, v, p);
    const double t = dt == DType::kF64 ? 1e-14 : 1e-6;
    EXPECT_LE(rel(w, W), t) << dname(dt);
    EXPECT_LE(rel(m, M), t);
    EXPECT_LE(rel(v, V), t);
  }
}

TEST_F(CpuOps, MuonMomentumAndApplyMatchFormula) {
  for (DType dt : kFloatTypes)
    for (bool nesterov : {false, true}) {
      const double mu = 0.95, t = dt == DType::kF64 ? 1e-15 : 1e-6;
      OwnedTensor g(dt, {4, 9}), m(dt, {4, 9}), u(dt, {4, 9});
      fill_uniform(g, 1);
      fill_uniform(m, 2);
      std::vector<double> G = vals(g), M = vals(m), U(G.size());
      for (size_t i = 0; i < G.size(); ++i) {
        M[i] = mu * M[i] + G[i];
        U[i] = nesterov ? G[i] + mu * M[i] : M[i];
      }
      be->muon_momentum(g, m, u, mu, nesterov);
      EXPECT_LE(rel(m, M), t) << dname(dt) << " nesterov " << nesterov;
      EXPECT_LE(rel(u, U), t);
      // w ← w·(1 − lr·wd) − lr·s·o
      OwnedTensor w(dt, {4, 9});
      fill_uniform(w, 3);
      std::vector<double> W = vals(w), O = vals(u);
      const double lr = 0.02, wd = 0.1, s = 0.2 * std::sqrt(9.0);
      for (size_t i = 0; i < W.size(); ++i) W[i] = W[i] * (1 - lr * wd) - lr * s * O[i];
      be->muon_apply(w, u, lr, wd, s);
      EXPECT_LE(rel(w, W), t);
    }
}

// ---- determinism -------------------------------------------------------------------------

std::vector<char> bytes(const Tensor& t) {
  std::vector<char> b(t.nbytes());
  std::memcpy(b.data(), t.data, b.size());
  return b;
}

TEST_F(CpuOps, DeterministicAcrossThreadCounts) {
  const int saved = omp_get_max_threads();
  const DType dt = DType::kF32;
  // Inputs.
  const int64_t N = 300, D = 3072;
  OwnedTensor x(dt, {N, D}), w(dt, {D}), b(dt, {D}), y(dt, {N, D}), dy(dt, {N, D}), mean(dt, {N}), rstd(dt, {N});
  fill_uniform(x, 1);
  fill_uniform(w, 2);
  fill_uniform(b, 3);
  fill_uniform(dy, 4);
  be->layernorm_forward(x, w, b, 1e-5, y, mean, rstd);
  const GateCase gs{2, 64, 16, 192, 96};
  OwnedTensor o(dt, {gs.B, gs.T, gs.H, gs.dv}), gg(dt, {gs.B, gs.T, gs.H, gs.dv}), gw(dt, {gs.dv}),
      gy(dt, {gs.B, gs.T, gs.H, gs.dv}), grstd(dt, {gs.B, gs.T, gs.H});
  fill_uniform(o, 5);
  fill_uniform(gg, 6);
  fill_uniform(gw, 7);
  be->rmsnorm_gate_forward(o, gg, gw, 1e-5, gy, grstd);
  const int64_t CB = 2, CT = 64, CD = 256, CK = 4;
  OwnedTensor cu(dt, {CB, CT, CD}), cw(dt, {CD, CK}), cc(dt, {CB, CT, CD}), cpre(dt, {CB, CT, CD});
  fill_uniform(cu, 8);
  fill_uniform(cw, 9);
  be->conv_silu_forward(cu, cw, cc, cpre, Tensor{}, Tensor{}, Tensor{});
  const int64_t EN = 512, EV = 50, ED = 256;
  OwnedTensor ids(DType::kI32, {EN}), edout(dt, {EN, ED});
  for (int64_t i = 0; i < EN; ++i) element_set(ids, i, (i * 7919) % EV);
  fill_uniform(edout, 10);
  OwnedTensor big(dt, {1 << 20});
  fill_uniform(big, 11);

  struct Out {
    std::vector<char> dx, dw, db, d_o, dg, gdw, du, cdw, dtab;
    double ss;
  };
  auto run = [&](int threads) {
    omp_set_num_threads(threads);
    EXPECT_EQ(omp_get_max_threads(), threads);
    Out r;
    OwnedTensor dx(dt, {N, D}), dw(dt, {D}), db(dt, {D});
    be->layernorm_backward(dy, x, w, mean, rstd, dx, false, dw, db);
    r.dx = bytes(dx);
    r.dw = bytes(dw);
    r.db = bytes(db);
    OwnedTensor d_o(dt, {gs.B, gs.T, gs.H, gs.dv}), dg(dt, {gs.B, gs.T, gs.H, gs.dv}), gdw(dt, {gs.dv});
    be->rmsnorm_gate_backward(gy, o, gg, gw, grstd, d_o, dg, gdw);
    r.d_o = bytes(d_o);
    r.dg = bytes(dg);
    r.gdw = bytes(gdw);
    OwnedTensor du(dt, {CB, CT, CD}), cdw(dt, {CD, CK});
    be->conv_silu_backward(cc, cu, cw, cpre, du, cdw);
    r.du = bytes(du);
    r.cdw = bytes(cdw);
    OwnedTensor dtab(dt, {EV, ED});
    be->embedding_backward(ids, edout, dtab);
    r.dtab = bytes(dtab);
    r.ss = be->sum_squares(big);
    return r;
  };
  const Out a = run(1), b2 = run(2);
  omp_set_num_threads(saved);
  EXPECT_TRUE(a.dx == b2.dx) << "layernorm dx";
  EXPECT_TRUE(a.dw == b2.dw) << "layernorm dw";
  EXPECT_TRUE(a.db == b2.db) << "layernorm db";
  EXPECT_TRUE(a.d_o == b2.d_o && a.dg == b2.dg && a.gdw == b2.gdw) << "rmsnorm_gate";
  EXPECT_TRUE(a.du == b2.du && a.cdw == b2.cdw) << "conv";
  EXPECT_TRUE(a.dtab == b2.dtab) << "embedding";
  EXPECT_EQ(std::memcmp(&a.ss, &b2.ss, sizeof(double)), 0) << "sum_squares";
}

// ---- device-scalar optimizer ops (host memory on the CPU) ---------------------------------

TEST(CpuDeviceScalars, SumSquaresIntoAccumulatesLikeTheHostSum) {
  CpuBackend be;
  OwnedTensor a(DType::kF32, {37, 5}), b(DType::kF32, {1000});
  fill_uniform(a, 1);
  fill_uniform(b, 2);
  double acc = -7;  // overwritten, not added to, when accumulate is false
  Tensor s(&acc, DType::kF64, {1});
  be.sum_squares_into(a, s, false);
  be.sum_squares_into(b, s, true);
  double want = 0;
  want += be.sum_squares(a);
  want += be.sum_squares(b);
  EXPECT_EQ(acc, want);
}

TEST(CpuDeviceScalars, GradClipScalars) {
  CpuBackend be;
  struct Case { double ss, max_norm, norm, coef, skip; };
  const double inf = std::numeric_limits<double>::infinity(), nan = std::nan("");
  const Case cases[] = {
      {0.25, 1.0, 0.5, 1.0, 0},                          // below the threshold
      {4.0, 1.0, 2.0, 1.0 / (2.0 + 1e-6), 0},            // clipped: max / (norm + 1e-6)
      {4.0, 0.0, 2.0, 1.0, 0},                           // clipping off
      {inf, 1.0, inf, 1.0, 1},                           // skipped
      {nan, 1.0, nan, 1.0, 1},
  };
  for (const Case& c : cases) {
    double ss = c.ss, out[3] = {-1, -1, -1};
    be.grad_clip_scalars(Tensor(&ss, DType::kF64, {1}), c.max_norm, Tensor(out, DType::kF64, {3}));
    if (std::isnan(c.norm)) EXPECT_TRUE(std::isnan(out[0]));
    else EXPECT_EQ(out[0], c.norm) << c.ss;
    EXPECT_EQ(out[1], c.coef) << c.ss;
    EXPECT_EQ(out[2], c.skip) << c.ss;
  }
}

TEST(CpuDeviceScalars, GatedOpsTouchNothingWhenSkipped) {
  CpuBackend be;
  OwnedTensor w(DType::kF32, {4, 6}), g(DType::kF32, {4, 6}), m(DType::kF32, {4, 6}), v(DType::kF32, {4, 6});
  fill_uniform(w, 1);
  fill_uniform(g, 2);
  fill_uniform(m, 3);
  fill_uniform(v, 4, 0.0, 1.0);
  auto snap = [](const Tensor& t) {
    std::vector<char> b(t.nbytes());
    std::memcpy(b.data(), t.data, b.size());
    return b;
  };
  const auto w0 = snap(w), m0 = snap(m), v0 = snap(v);
  double skip = 1;
  const Tensor sk(&skip, DType::kF64, {1});
  AdamWParams p;
  p.lr = 0.1;
  p.wd = 0.1;
  be.adamw_update_gated(w, g, m, v, p, sk);
  be.muon_momentum_gated(g, m, v, 0.9, true, sk);
  be.muon_apply_gated(w, g, 0.1, 0.1, 2.0, sk);
  EXPECT_EQ(snap(w), w0);
  EXPECT_EQ(snap(m), m0);
  EXPECT_EQ(snap(v), v0);
  skip = 0;  // not skipped: the ungated op's bits
  OwnedTensor w2(DType::kF32, {4, 6}), m2(DType::kF32, {4, 6}), v2(DType::kF32, {4, 6});
  std::memcpy(w2.t.data, w.t.data, w0.size());
  std::memcpy(m2.t.data, m.t.data, m0.size());
  std::memcpy(v2.t.data, v.t.data, v0.size());
  be.adamw_update_gated(w, g, m, v, p, sk);
  be.adamw_update(w2, g, m2, v2, p);
  EXPECT_EQ(snap(w), snap(w2));
  EXPECT_EQ(snap(m), snap(m2));
  EXPECT_NE(snap(w), w0);
}

TEST(CpuDeviceScalars, ScaleByAndInvNorm) {
  CpuBackend be;
  OwnedTensor x(DType::kF32, {50}), y(DType::kF32, {50});
  fill_uniform(x, 9);
  std::memcpy(y.t.data, x.t.data, 200);
  double c = 0.37;
  be.scale_by(x, Tensor(&c, DType::kF64, {1}));
  be.scale(y, 0.37);
  EXPECT_EQ(std::memcmp(x.t.data, y.t.data, 200), 0);
  double ss = 12.5;
  be.scale_by_inv_norm(x, Tensor(&ss, DType::kF64, {1}), 1e-7);
  be.scale(y, 1.0 / (std::sqrt(12.5) + 1e-7));
  EXPECT_EQ(std::memcmp(x.t.data, y.t.data, 200), 0);
}

TEST(CpuDeviceScalars, LossSumIntoIsTheHostMean) {
  CpuBackend be;
  OwnedTensor l(DType::kF32, {33});
  fill_uniform(l, 4, 0.0, 5.0);
  double acc = 0;
  Tensor a(&acc, DType::kF64, {1});
  be.loss_sum_into(l, 33, a, false);
  be.loss_sum_into(l, 11, a, true);
  double s = 0;
  for (int i = 0; i < 33; ++i) s += static_cast<const float*>(l.t.data)[i];
  double want = 0;
  want += s / 33;
  want += s / 11;
  EXPECT_EQ(acc, want);
}

}  // namespace
}  // namespace laplace
