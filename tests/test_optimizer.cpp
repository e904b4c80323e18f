// Muon (Newton–Schulz), AdamW, the Optimizer (clipping, skipping, state) and the
// learning-rate schedules, against straightforward references written here.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <numbers>
#include <random>
#include <vector>

#include "model/config.h"
#include "ops/backend.h"
#include "tests/test_util.h"
#include "train/muon.h"
#include "train/optimizer.h"
#include "train/schedule.h"

namespace laplace {
namespace {

using testing::OwnedTensor;
using Vec = std::vector<double>;

// ---- helpers ---------------------------------------------------------------------------

Backend& cpu() {
  static std::unique_ptr<Backend> be = make_cpu_backend();
  return *be;
}

void fill_normal(Tensor t, uint64_t seed, double stddev = 1.0) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> dist(0.0, stddev);
  for (int64_t i = 0; i < t.numel(); ++i) {
    double x = dist(rng);
    if (t.dtype == DType::kF32) static_cast<float*>(t.data)[i] = static_cast<float>(x);
    else static_cast<double*>(t.data)[i] = x;
  }
}

double at(const Tensor& t, int64_t flat) {
  int64_t off = 0;
  for (int d = t.ndim - 1; d >= 0; --d) {
    off += (flat % t.shape[d]) * t.stride[d];
    flat /= t.shape[d];
  }
  return t.dtype == DType::kF32 ? static_cast<const float*>(t.data)[off] : static_cast<const double*>(t.data)[off];
}

Vec to_vec(const Tensor& t) {
  Vec v(static_cast<size_t>(t.numel()));
  for (int64_t i = 0; i < t.numel(); ++i) v[i] = at(t, i);
  return v;
}

void from_vec(Tensor t, const Vec& v) {
  ASSERT_TRUE(t.is_contiguous());
  for (int64_t i = 0; i < t.numel(); ++i) {
    if (t.dtype == DType::kF32) static_cast<float*>(t.data)[i] = static_cast<float>(v[i]);
    else static_cast<double*>(t.data)[i] = v[i];
  }
}

Vec transpose(const Vec& x, int64_t r, int64_t c) {
  Vec t(x.size());
  for (int64_t i = 0; i < r; ++i)
    for (int64_t j = 0; j < c; ++j) t[j * r + i] = x[i * c + j];
  return t;
}

// C[r×c] = A[r×k] · B[k×c]
Vec matmul(const Vec& a, const Vec& b, int64_t r, int64_t k, int64_t c) {
  Vec o(static_cast<size_t>(r * c), 0.0);
  for (int64_t i = 0; i < r; ++i)
    for (int64_t p = 0; p < k; ++p)
      for (int64_t j = 0; j < c; ++j) o[i * c + j] += a[i * k + p] * b[p * c + j];
  return o;
}

// The reference of docs/training.md §6, literally: normalise, transpose when tall, iterate, transpose back.
Vec ref_ns(const Vec& g, int64_t r, int64_t c, int steps = 5) {
  double ss = 0;
  for (double v : g) ss += v * v;
  const double n = std::sqrt(ss);
  Vec x(g.size());
  for (size_t i = 0; i < g.size(); ++i) x[i] = g[i] / (n + 1e-7);
  const bool tall = r > c;
  int64_t R = r, C = c;
  if (tall) {
    x = transpose(x, r, c);
    std::swap(R, C);
  }
  for (int it = 0; it < steps; ++it) {
    Vec a = matmul(x, transpose(x, R, C), R, C, R);
    Vec aa = matmul(a, a, R, R, R);
    Vec b(a.size());
    for (size_t i = 0; i < a.size(); ++i) b[i] = kNsB * a[i] + kNsC * aa[i];
    Vec bx = matmul(b, x, R, R, C);
    for (size_t i = 0; i < x.size(); ++i) x[i] = kNsA * x[i] + bx[i];
  }
  return tall ? transpose(x, R, C) : x;
}

// Eigenvalues of a symmetric n×n matrix (cyclic Jacobi).
Vec jacobi_eigenvalues(Vec a, int64_t n) {
  for (int sweep = 0; sweep < 100; ++sweep) {
    double off = 0;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = i + 1; j < n; ++j) off += a[i * n + j] * a[i * n + j];
    if (off < 1e-26) break;
    for (int64_t p = 0; p < n; ++p)
      for (int64_t q = p + 1; q < n; ++q) {
        const double apq = a[p * n + q];
        if (std::fabs(apq) < 1e-300) continue;
        const double theta = (a[q * n + q] - a[p * n + p]) / (2 * apq);
        const double t = (theta >= 0 ? 1.0 : -1.0) / (std::fabs(theta) + std::sqrt(theta * theta + 1));
        const double cs = 1 / std::sqrt(t * t + 1), sn = t * cs;
        for (int64_t k = 0; k < n; ++k) {  // columns p, q
          const double akp = a[k * n + p], akq = a[k * n + q];
          a[k * n + p] = cs * akp - sn * akq;
          a[k * n + q] = sn * akp + cs * akq;
        }
        for (int64_t k = 0; k < n; ++k) {  // rows p, q
          const double apk = a[p * n + k], aqk = a[q * n + k];
          a[p * n + k] = cs * apk - sn * aqk;
          a[q * n + k] = sn * apk + cs * aqk;
        }
      }
  }
  Vec e(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) e[i] = a[i * n + i];
  return e;
}

Vec singular_values(const Vec& o, int64_t r, int64_t c) {
  Vec gram = r >= c ? matmul(transpose(o, r, c), o, c, r, c) : matmul(o, transpose(o, r, c), r, c, r);
  Vec e = jacobi_eigenvalues(gram, std::min(r, c));
  for (double& x : e) x = std::sqrt(std::max(x, 0.0));
  return e;
}

// A random n×n orthogonal matrix (modified Gram–Schmidt on a Gaussian matrix).
Vec random_orthogonal(int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> dist;
  Vec q(static_cast<size_t>(n * n));
  for (double& x : q) x = dist(rng);
  for (int64_t j = 0; j < n; ++j) {  // columns
    for (int64_t k = 0; k < j; ++k) {
      double d = 0;
      for (int64_t i = 0; i < n; ++i) d += q[i * n + j] * q[i * n + k];
      for (int64_t i = 0; i < n; ++i) q[i * n + j] -= d * q[i * n + k];
    }
    double nn = 0;
    for (int64_t i = 0; i < n; ++i) nn += q[i * n + j] * q[i * n + j];
    nn = std::sqrt(nn);
    for (int64_t i = 0; i < n; ++i) q[i * n + j] /= nn;
  }
  return q;
}

// Runs newton_schulz on g with a freshly allocated scratch.
Vec run_ns(const Tensor& g, int steps = 5) {
  const int64_t r = g.dim(0), c = g.dim(1);
  NsScratch s;
  s.dtype = g.dtype;
  s.plan(r, c);
  EXPECT_TRUE(s.allocate(cpu().allocator()).is_ok());
  OwnedTensor out(g.dtype, {r, c});
  newton_schulz(cpu(), g, out, s, steps);
  return to_vec(out);
}

// Parameters with their own storage, for Optimizer tests.
struct Params {
  std::vector<std::unique_ptr<OwnedTensor>> store;
  std::vector<Param> list;

  Param& add(const std::string& name, DType dt, std::initializer_list<int64_t> shape, bool muon,
             std::vector<int64_t> blocks = {}, bool decay = false) {
    store.push_back(std::make_unique<OwnedTensor>(dt, shape));
    Tensor w = *store.back();
    store.push_back(std::make_unique<OwnedTensor>(dt, shape));
    Tensor g = *store.back();
    Param p;
    p.name = name;
    p.w = w;
    p.g = g;
    p.muon = muon;
    p.blocks = std::move(blocks);
    p.decay = decay;
    list.push_back(std::move(p));
    return list.back();
  }
};

// A small model-like parameter set: embedding/head (AdamW + decay), a norm (AdamW),
// a wqkvg-like matrix with 4 blocks and a w12-like matrix with 2 blocks (Muon).
Params make_model(DType dt, uint64_t seed) {
  Config cfg;
  cfg.hidden_size = 16;
  cfg.num_heads = 2;
  cfg.head_k_dim = 4;
  cfg.head_v_dim = 8;
  cfg.ffn_size = 24;
  const int64_t D = cfg.hidden_size, F = cfg.ffn_size;
  Params p;
  p.add("model.embed.weight", dt, {20, D}, false, {}, true);
  p.add("model.layers.0.norm1.weight", dt, {D}, false);
  p.add("model.layers.0.wqkvg.weight", dt, {cfg.qkvg_rows(), D}, true,
        {cfg.qk_dim(), cfg.qk_dim(), cfg.v_dim(), cfg.v_dim()}, true);
  p.add("model.layers.0.w12.weight", dt, {2 * F, D}, true, {F, F}, true);
  p.add("model.layers.0.w3.weight", dt, {D, F}, true, {}, true);
  p.add("lm_head.weight", dt, {20, D}, false, {}, true);
  for (size_t i = 0; i < p.list.size(); ++i) {
    testing::fill_uniform(p.list[i].w, seed + 2 * i, -0.5, 0.5);
    testing::fill_uniform(p.list[i].g, seed + 2 * i + 1, -0.05, 0.05);
  }
  return p;
}

void refill_grads(Params& p, uint64_t seed) {
  for (size_t i = 0; i < p.list.size(); ++i) testing::fill_uniform(p.list[i].g, seed + i, -0.05, 0.05);
}

std::vector<char> bytes_of(const Tensor& t) {
  std::vector<char> b(t.nbytes());
  std::memcpy(b.data(), t.data, t.nbytes());
  return b;
}

// ---- Muon --------------------------------------------------------------------------------

TEST(Muon, NewtonSchulzMatchesReferenceF64) {
  const std::pair<int64_t, int64_t> shapes[] = {{8, 24}, {24, 8}, {16, 16}, {5, 7}, {1, 6}, {9, 1}};
  uint64_t seed = 1;
  for (auto [r, c] : shapes) {
    OwnedTensor g(DType::kF64, {r, c});
    fill_normal(g, seed++);
    Vec got = run_ns(g);
    Vec want = ref_ns(to_vec(g), r, c);
    EXPECT_LT(testing::max_rel_error(got, want), 1e-12) << r << "x" << c;
  }
  // Other step counts, including 0 (just the normalisation).
  OwnedTensor g(DType::kF64, {6, 10});
  fill_normal(g, 77);
  for (int steps : {0, 1, 3, 7})
    EXPECT_LT(testing::max_rel_error(run_ns(g, steps), ref_ns(to_vec(g), 6, 10, steps)), 1e-12) << steps;
}

TEST(Muon, NewtonSchulzMatchesReferenceF32) {
  const std::pair<int64_t, int64_t> shapes[] = {{64, 32}, {32, 64}, {48, 48}, {96, 40}};
  uint64_t seed = 11;
  for (auto [r, c] : shapes) {
    OwnedTensor g(DType::kF32, {r, c});
    fill_normal(g, seed++);
    Vec got = run_ns(g);
    Vec want = ref_ns(to_vec(g), r, c);  // double reference on the same (fp32) inputs
    EXPECT_LT(testing::max_rel_error(got, want), 1e-5) << r << "x" << c;
  }
}

TEST(Muon, SingularValuesInBand) {
  // Well-conditioned inputs Q·diag(s)·Pᵀ, s in [0.3, 1], and Gaussian matrices; both orientations.
  for (DType dt : {DType::kF64, DType::kF32}) {
    for (auto [r, c] : {std::pair<int64_t, int64_t>{48, 32}, {32, 48}}) {
      const int64_t k = std::min(r, c);
      Vec q = random_orthogonal(r, 5), p = random_orthogonal(c, 6);
      std::mt19937_64 rng(7);
      std::uniform_real_distribution<double> us(0.3, 1.0);
      Vec s(static_cast<size_t>(k));
      for (double& x : s) x = us(rng);
      Vec m(static_cast<size_t>(r * c), 0.0);
      for (int64_t i = 0; i < r; ++i)
        for (int64_t j = 0; j < c; ++j)
          for (int64_t l = 0; l < k; ++l) m[i * c + j] += q[i * r + l] * s[l] * p[j * c + l];
      OwnedTensor g(dt, {r, c});
      from_vec(g, m);
      for (double sv : singular_values(run_ns(g), r, c)) {
        EXPECT_GE(sv, 0.68) << r << "x" << c;
        EXPECT_LE(sv, 1.21) << r << "x" << c;
      }
    }
    for (auto [r, c] : {std::pair<int64_t, int64_t>{64, 32}, {32, 64}}) {
      OwnedTensor g(dt, {r, c});
      fill_normal(g, 100 + r);
      Vec sv = singular_values(run_ns(g), r, c);
      EXPECT_EQ(static_cast<int64_t>(sv.size()), 32);
      for (double x : sv) {
        EXPECT_GE(x, 0.68) << r << "x" << c;
        EXPECT_LE(x, 1.21) << r << "x" << c;
      }
    }
  }
}

TEST(Muon, TallIsTransposeOfWide) {
  OwnedTensor g(DType::kF64, {12, 30}), gt(DType::kF64, {30, 12});
  fill_normal(g, 3);
  from_vec(gt, transpose(to_vec(g), 12, 30));
  Vec wide = run_ns(g), tall = run_ns(gt);
  EXPECT_LT(testing::max_rel_error(transpose(wide, 12, 30), tall), 1e-12);
}

TEST(Muon, OutMayAliasInputAndInputMayBeAView) {
  // g is a row range of a larger matrix; out aliases it.
  OwnedTensor big(DType::kF64, {20, 16});
  fill_normal(big, 9);
  Vec all = to_vec(big);
  Tensor rows = Tensor(big).slice(0, 4, 12);
  Vec want = ref_ns(to_vec(rows), 8, 16);
  NsScratch s;
  s.dtype = DType::kF64;
  s.plan(8, 16);
  ASSERT_TRUE(s.allocate(cpu().allocator()).is_ok());
  newton_schulz(cpu(), rows, rows, s);
  EXPECT_LT(testing::max_rel_error(to_vec(rows), want), 1e-12);
  Vec after = to_vec(big);
  for (int64_t i = 0; i < 20 * 16; ++i)
    if (i < 4 * 16 || i >= 12 * 16) {
      ASSERT_EQ(after[i], all[i]) << "row outside the view changed";
    }
}

TEST(Muon, PerBlockDiffersFromFusedAndEqualsSeparateBlocks) {
  Config cfg;
  cfg.hidden_size = 32;
  cfg.num_heads = 2;
  cfg.head_k_dim = 8;
  cfg.head_v_dim = 16;
  const int64_t rows = cfg.qkvg_rows(), cols = cfg.hidden_size;  // 96 × 32
  const std::vector<int64_t> blocks = {cfg.qk_dim(), cfg.qk_dim(), cfg.v_dim(), cfg.v_dim()};
  for (DType dt : {DType::kF64, DType::kF32}) {
    OwnedTensor u(dt, {rows, cols}), per(dt, {rows, cols}), fused(dt, {rows, cols});
    fill_normal(u, 21);
    NsScratch s;
    s.dtype = dt;
    for (int64_t b : blocks) s.plan(b, cols);
    s.plan(rows, cols);
    ASSERT_TRUE(s.allocate(cpu().allocator()).is_ok());
    muon_orthogonalise(cpu(), u, blocks, per, s, 5);
    muon_orthogonalise(cpu(), u, {rows}, fused, s, 5);
    EXPECT_GT(testing::max_rel_error(to_vec(per), to_vec(fused)), 1e-2);
    int64_t r0 = 0;
    for (int64_t b : blocks) {
      OwnedTensor blk(dt, {b, cols});
      cpu().copy(blk, Tensor(u).slice(0, r0, r0 + b));
      Vec sep = run_ns(blk);
      Vec got = to_vec(Tensor(per).slice(0, r0, r0 + b));
      EXPECT_LT(testing::max_rel_error(got, sep), dt == DType::kF64 ? 1e-13 : 1e-6) << "block at row " << r0;
      EXPECT_LT(testing::max_rel_error(got, ref_ns(to_vec(blk), b, cols)), dt == DType::kF64 ? 1e-12 : 1e-5);
      r0 += b;
    }
  }
}

TEST(Muon, ScaleModes) {
  EXPECT_DOUBLE_EQ(muon_scale(96, 32, MuonScale::kRms), 0.2 * std::sqrt(96.0));
  EXPECT_DOUBLE_EQ(muon_scale(32, 96, MuonScale::kRms), 0.2 * std::sqrt(96.0));
  EXPECT_DOUBLE_EQ(muon_scale(96, 32, MuonScale::kShape), std::sqrt(3.0));
  EXPECT_DOUBLE_EQ(muon_scale(50, 40, MuonScale::kShape), std::sqrt(1.25));
  EXPECT_DOUBLE_EQ(muon_scale(32, 96, MuonScale::kShape), 1.0);
  MuonScale m;
  ASSERT_TRUE(muon_scale_from_name("shape", &m).is_ok());
  EXPECT_EQ(m, MuonScale::kShape);
  ASSERT_TRUE(muon_scale_from_name("rms", &m).is_ok());
  EXPECT_EQ(m, MuonScale::kRms);
  Status st = muon_scale_from_name("spectral", &m);
  EXPECT_EQ(st.code(), Status::Code::kInvalidArgument);
  EXPECT_NE(st.message().find("spectral"), std::string::npos);
}

// Hand-computed Muon steps: momentum, Nesterov, per-block NS, per-block scale, decay.
TEST(Muon, StepMatchesFormula) {
  for (bool nesterov : {true, false}) {
    for (MuonScale mode : {MuonScale::kRms, MuonScale::kShape}) {
      const int64_t r = 12, c = 5;
      const std::vector<int64_t> blocks = {4, 8};
      Params p;
      p.add("w", DType::kF64, {r, c}, true, blocks, /*decay flag ignored for Muon*/ false);
      testing::fill_uniform(p.list[0].w, 1);
      OptimizerConfig cfg;
      cfg.weight_decay = 0.1;
      cfg.momentum = 0.9;
      cfg.nesterov = nesterov;
      cfg.scale = mode;
      cfg.max_grad_norm = 0;
      Optimizer opt;
      ASSERT_TRUE(opt.init(cpu(), p.list, cfg).is_ok());
      Vec w = to_vec(p.list[0].w), m(static_cast<size_t>(r * c), 0.0);
      const double lrs[] = {0.02, 0.01, 0.005};
      for (int step = 0; step < 3; ++step) {
        testing::fill_uniform(p.list[0].g, 10 + step);
        Vec g = to_vec(p.list[0].g);
        Vec u(g.size());
        for (size_t i = 0; i < g.size(); ++i) {
          m[i] = cfg.momentum * m[i] + g[i];
          u[i] = nesterov ? g[i] + cfg.momentum * m[i] : m[i];
        }
        const double lr = lrs[step];
        int64_t r0 = 0;
        for (int64_t b : blocks) {
          Vec ub(u.begin() + r0 * c, u.begin() + (r0 + b) * c);
          Vec o = ref_ns(ub, b, c);
          const double s = muon_scale(b, c, mode);
          for (int64_t i = 0; i < b * c; ++i) {
            double& wi = w[r0 * c + i];
            wi = wi * (1 - lr * cfg.weight_decay) - lr * s * o[i];
          }
          r0 += b;
        }
        StepResult res = opt.step(lr);
        ASSERT_FALSE(res.skipped);
        EXPECT_EQ(res.clip_coef, 1.0);
        EXPECT_EQ(opt.step_count(), step + 1);
        EXPECT_LT(testing::max_rel_error(to_vec(p.list[0].w), w), 1e-12) << "step " << step;
        auto st = opt.state_tensors();
        ASSERT_EQ(st.size(), 1u);
        EXPECT_EQ(st[0].first, "optim.w.momentum");
        EXPECT_LT(testing::max_rel_error(to_vec(st[0].second), m), 1e-14);
      }
    }
  }
}

// ---- AdamW -------------------------------------------------------------------------------

TEST(AdamW, StepMatchesFormula) {
  Params p;
  p.add("a", DType::kF64, {7}, false, {}, /*decay=*/true);
  p.add("b", DType::kF64, {3, 4}, false, {}, /*decay=*/false);
  for (auto& q : p.list) testing::fill_uniform(q.w, 3);
  OptimizerConfig cfg;
  cfg.weight_decay = 0.05;
  cfg.beta1 = 0.8;
  cfg.beta2 = 0.9;
  cfg.eps = 1e-6;
  cfg.max_grad_norm = 0;
  Optimizer opt;
  ASSERT_TRUE(opt.init(cpu(), p.list, cfg).is_ok());
  std::vector<Vec> w, m, v;
  for (auto& q : p.list) {
    w.push_back(to_vec(q.w));
    m.emplace_back(q.w.numel(), 0.0);
    v.emplace_back(q.w.numel(), 0.0);
  }
  for (int t = 1; t <= 3; ++t) {
    const double lr = 1e-2 / t;
    for (size_t k = 0; k < p.list.size(); ++k) {
      testing::fill_uniform(p.list[k].g, 100 * t + k);
      Vec g = to_vec(p.list[k].g);
      const double wd = p.list[k].decay ? cfg.weight_decay : 0.0;
      for (size_t i = 0; i < g.size(); ++i) {
        m[k][i] = cfg.beta1 * m[k][i] + (1 - cfg.beta1) * g[i];
        v[k][i] = cfg.beta2 * v[k][i] + (1 - cfg.beta2) * g[i] * g[i];
        const double mh = m[k][i] / (1 - std::pow(cfg.beta1, t)), vh = v[k][i] / (1 - std::pow(cfg.beta2, t));
        w[k][i] = w[k][i] * (1 - lr * wd) - lr * mh / (std::sqrt(vh) + cfg.eps);
      }
    }
    ASSERT_FALSE(opt.step(lr).skipped);
    auto st = opt.state_tensors();
    ASSERT_EQ(st.size(), 4u);
    for (size_t k = 0; k < p.list.size(); ++k) {
      EXPECT_LT(testing::max_rel_error(to_vec(p.list[k].w), w[k]), 1e-13) << "param " << k << " step " << t;
      EXPECT_EQ(st[2 * k].first, "optim." + p.list[k].name + ".adam_m");
      EXPECT_EQ(st[2 * k + 1].first, "optim." + p.list[k].name + ".adam_v");
      EXPECT_LT(testing::max_rel_error(to_vec(st[2 * k].second), m[k]), 1e-14);
      EXPECT_LT(testing::max_rel_error(to_vec(st[2 * k + 1].second), v[k]), 1e-14);
    }
  }
}

TEST(AdamW, WeightDecayIsDecoupled) {
  // A zero gradient leaves m = v = 0, so the only change is w ← w·(1 − lr·wd): the decay
  // does not pass through the adaptive normalisation. Same for Muon (NS(0) = 0).
  Params p;
  p.add("decayed", DType::kF64, {6}, false, {}, true);
  p.add("plain", DType::kF64, {6}, false, {}, false);
  p.add("matrix", DType::kF64, {4, 6}, true, {}, false);
  for (auto& q : p.list) {
    testing::fill_uniform(q.w, 5);
    cpu().fill(q.g, 0.0);
  }
  std::vector<Vec> w0;
  for (auto& q : p.list) w0.push_back(to_vec(q.w));
  OptimizerConfig cfg;
  cfg.weight_decay = 0.1;
  Optimizer opt;
  ASSERT_TRUE(opt.init(cpu(), p.list, cfg).is_ok());
  const double lr = 0.5;
  ASSERT_FALSE(opt.step(lr).skipped);
  for (size_t i = 0; i < 6; ++i) {
    EXPECT_DOUBLE_EQ(at(p.list[0].w, i), w0[0][i] * (1 - lr * 0.1));
    EXPECT_EQ(at(p.list[1].w, i), w0[1][i]);
  }
  for (size_t i = 0; i < 24; ++i) EXPECT_DOUBLE_EQ(at(p.list[2].w, i), w0[2][i] * (1 - lr * 0.1));
}

// ---- Optimizer ---------------------------------------------------------------------------

TEST(Optimizer, ClippingScalesGradients) {
  for (double max_norm : {1.0, 100.0, 0.0}) {
    Params p = make_model(DType::kF64, 40);
    for (auto& q : p.list) cpu().scale(q.g, 30.0);  // norm well above 1, below 100
    double ss = 0;
    std::vector<Vec> g0;
    for (auto& q : p.list) {
      g0.push_back(to_vec(q.g));
      for (double x : g0.back()) ss += x * x;
    }
    const double norm = std::sqrt(ss);
    ASSERT_GT(norm, 1.0);
    ASSERT_LT(norm, 100.0);
    OptimizerConfig cfg;
    cfg.max_grad_norm = max_norm;
    Optimizer opt;
    ASSERT_TRUE(opt.init(cpu(), p.list, cfg).is_ok());
    StepResult r = opt.step(1e-3);
    ASSERT_FALSE(r.skipped);
    EXPECT_NEAR(r.grad_norm, norm, 1e-12 * norm);
    const double coef = (max_norm > 0 && norm > max_norm) ? max_norm / (norm + 1e-6) : 1.0;
    EXPECT_NEAR(r.clip_coef, coef, 1e-12 * coef);
    for (size_t k = 0; k < p.list.size(); ++k) {
      Vec g = to_vec(p.list[k].g);
      for (size_t i = 0; i < g.size(); ++i) {
        if (coef == 1.0) EXPECT_EQ(g[i], g0[k][i]);
        else EXPECT_NEAR(g[i], g0[k][i] * coef, 1e-12 * std::fabs(g0[k][i]));
      }
    }
    if (max_norm == 1.0) {
      double s2 = 0;
      for (auto& q : p.list) s2 += cpu().sum_squares(q.g);
      EXPECT_NEAR(std::sqrt(s2), 1.0, 1e-6);
    }
  }
}

TEST(Optimizer, NonFiniteGradientSkipsStep) {
  for (double bad : {std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity()}) {
    Params p = make_model(DType::kF32, 50);
    OptimizerConfig cfg;
    cfg.weight_decay = 0.1;
    Optimizer opt;
    ASSERT_TRUE(opt.init(cpu(), p.list, cfg).is_ok());
    ASSERT_FALSE(opt.step(1e-2).skipped);  // non-zero state first
    ASSERT_FALSE(opt.step(1e-2).skipped);
    ASSERT_EQ(opt.step_count(), 2);
    refill_grads(p, 60);
    static_cast<float*>(p.list[3].g.data)[5] = static_cast<float>(bad);
    std::vector<std::vector<char>> before;
    for (auto& q : p.list) {
      before.push_back(bytes_of(q.w));
      before.push_back(bytes_of(q.g));
    }
    for (auto& [name, t] : opt.state_tensors()) before.push_back(bytes_of(t));
    StepResult r = opt.step(1e-2);
    EXPECT_TRUE(r.skipped);
    EXPECT_FALSE(std::isfinite(r.grad_norm));
    EXPECT_EQ(opt.step_count(), 2);
    size_t i = 0;
    for (auto& q : p.list) {
      EXPECT_EQ(bytes_of(q.w), before[i++]) << q.name << " weights changed";
      EXPECT_EQ(bytes_of(q.g), before[i++]) << q.name << " gradient changed";
    }
    for (auto& [name, t] : opt.state_tensors()) EXPECT_EQ(bytes_of(t), before[i++]) << name << " changed";
    // The next finite step proceeds and counts.
    refill_grads(p, 70);
    EXPECT_FALSE(opt.step(1e-2).skipped);
    EXPECT_EQ(opt.step_count(), 3);
  }
}

TEST(Optimizer, Deterministic) {
  Params a = make_model(DType::kF32, 80), b = make_model(DType::kF32, 80);
  OptimizerConfig cfg;
  cfg.weight_decay = 0.1;
  Optimizer oa, ob;
  ASSERT_TRUE(oa.init(cpu(), a.list, cfg).is_ok());
  ASSERT_TRUE(ob.init(cpu(), b.list, cfg).is_ok());
  for (int s = 0; s < 3; ++s) {
    refill_grads(a, 90 + 10 * s);
    refill_grads(b, 90 + 10 * s);
    StepResult ra = oa.step(3e-3), rb = ob.step(3e-3);
    EXPECT_EQ(ra.grad_norm, rb.grad_norm);
  }
  for (size_t k = 0; k < a.list.size(); ++k)
    EXPECT_EQ(0, std::memcmp(a.list[k].w.data, b.list[k].w.data, a.list[k].w.nbytes())) << a.list[k].name;
  auto sa = oa.state_tensors(), sb = ob.state_tensors();
  ASSERT_EQ(sa.size(), sb.size());
  for (size_t k = 0; k < sa.size(); ++k)
    EXPECT_EQ(0, std::memcmp(sa[k].second.data, sb[k].second.data, sa[k].second.nbytes())) << sa[k].first;
}

TEST(Optimizer, StateTensorsAndLoad) {
  Params a = make_model(DType::kF32, 100), b = make_model(DType::kF32, 100);
  OptimizerConfig cfg;
  Optimizer oa, ob;
  ASSERT_TRUE(oa.init(cpu(), a.list, cfg).is_ok());
  ASSERT_TRUE(ob.init(cpu(), b.list, cfg).is_ok());
  for (int s = 0; s < 2; ++s) {
    refill_grads(a, 200 + s);
    oa.step(1e-2);
  }
  auto st = oa.state_tensors();
  std::vector<std::string> names;
  for (auto& [n, t] : st) names.push_back(n);
  const std::vector<std::string> want = {
      "optim.model.embed.weight.adam_m",         "optim.model.embed.weight.adam_v",
      "optim.model.layers.0.norm1.weight.adam_m", "optim.model.layers.0.norm1.weight.adam_v",
      "optim.model.layers.0.wqkvg.weight.momentum", "optim.model.layers.0.w12.weight.momentum",
      "optim.model.layers.0.w3.weight.momentum",  "optim.lm_head.weight.adam_m",
      "optim.lm_head.weight.adam_v"};
  EXPECT_EQ(names, want);
  // All state lives in one arena: the views are disjoint and ordered.
  for (size_t k = 1; k < st.size(); ++k)
    EXPECT_GE(static_cast<char*>(st[k].second.data), static_cast<char*>(st[k - 1].second.data) + st[k - 1].second.nbytes());

  // Errors leave the target untouched.
  auto missing = st;
  missing.erase(missing.begin() + 4);
  Status e1 = ob.load_state(missing, 2);
  EXPECT_EQ(e1.code(), Status::Code::kNotFound);
  EXPECT_NE(e1.message().find("wqkvg.weight.momentum"), std::string::npos) << e1.to_string();
  auto wrong = st;
  wrong[1].second = wrong[1].second.slice(0, 0, 10);
  Status e2 = ob.load_state(wrong, 2);
  EXPECT_EQ(e2.code(), Status::Code::kInvalidArgument);
  EXPECT_NE(e2.message().find("embed.weight.adam_v"), std::string::npos) << e2.to_string();
  auto extra = st;
  extra.emplace_back("optim.model.layers.7.wo.weight.momentum", st[4].second);
  Status e3 = ob.load_state(extra, 2);
  EXPECT_EQ(e3.code(), Status::Code::kInvalidArgument);
  EXPECT_NE(e3.message().find("layers.7.wo"), std::string::npos) << e3.to_string();
  EXPECT_EQ(ob.step_count(), 0);
  for (auto& [n, t] : ob.state_tensors()) EXPECT_EQ(cpu().sum_squares(t), 0.0) << n;

  // A good load (other names ignored) makes the two optimizers step identically.
  auto good = st;
  good.emplace_back("model.embed.weight", a.list[0].w);
  ASSERT_TRUE(ob.load_state(good, oa.step_count()).is_ok());
  EXPECT_EQ(ob.step_count(), 2);
  for (size_t k = 0; k < a.list.size(); ++k) cpu().copy(b.list[k].w, a.list[k].w);
  refill_grads(a, 300);
  refill_grads(b, 300);
  oa.step(1e-2);
  ob.step(1e-2);
  for (size_t k = 0; k < a.list.size(); ++k)
    EXPECT_EQ(0, std::memcmp(a.list[k].w.data, b.list[k].w.data, a.list[k].w.nbytes())) << a.list[k].name;
  ob.set_step_count(7);
  EXPECT_EQ(ob.step_count(), 7);
}

TEST(Optimizer, InitValidation) {
  OptimizerConfig cfg;
  auto init_code = [&](Params& p, const OptimizerConfig& c) {
    Optimizer o;
    return o.init(cpu(), p.list, c).code();
  };
  {
    Params p;
    p.add("w", DType::kF32, {8, 4}, true, {3, 4});
    EXPECT_EQ(init_code(p, cfg), Status::Code::kInvalidArgument);  // blocks sum to 7
  }
  {
    Params p;
    p.add("w", DType::kF32, {8}, true);
    EXPECT_EQ(init_code(p, cfg), Status::Code::kInvalidArgument);  // Muon on a vector
  }
  {
    Params p;
    p.add("w", DType::kF32, {8}, false);
    p.add("w", DType::kF32, {8}, false);
    EXPECT_EQ(init_code(p, cfg), Status::Code::kInvalidArgument);  // duplicate
  }
  {
    Params p;
    p.add("w", DType::kF32, {8, 4}, false);
    p.list[0].g = p.list[0].g.reshape({4, 8});
    EXPECT_EQ(init_code(p, cfg), Status::Code::kInvalidArgument);  // shape mismatch
  }
  {
    Params p;
    p.add("w", DType::kF32, {8, 4}, true);  // fused by default
    Optimizer o;
    ASSERT_TRUE(o.init(cpu(), p.list, cfg).is_ok());
    EXPECT_EQ(o.params()[0].blocks, std::vector<int64_t>{8});
    OptimizerConfig bad = cfg;
    bad.beta2 = 1.0;
    EXPECT_EQ(init_code(p, bad), Status::Code::kInvalidArgument);
    bad = cfg;
    bad.max_grad_norm = -1;
    EXPECT_EQ(init_code(p, bad), Status::Code::kInvalidArgument);
  }
}

// ---- Schedule ----------------------------------------------------------------------------

// ---- row shards (ShardExchange) ----------------------------------------------------------

int64_t rows_of(const Tensor& t) { return t.ndim == 2 ? t.dim(0) : t.numel(); }

// A ShardExchange inside one process, as the sharded trainer's is across ranks: the
// optimizer's params are row pieces of whole matrices (a matrix's pieces adjacent, in row
// order). The norm adds per-row Σg² in (matrix, row) order with the fixed-order sum; the
// orthogonalisation assembles each matrix's update, runs Newton–Schulz per block and hands
// every piece its rows back.
class PiecesExchange : public ShardExchange {
 public:
  PiecesExchange(const std::vector<Param>& ps, int ns_steps) : ps_(ps), steps_(ns_steps) {
    int64_t rows = 0, most = 1;
    for (const Param& p : ps_) {
      rows += rows_of(p.w);
      if (!p.muon) {
        upd_.push_back(nullptr);
        continue;
      }
      upd_.push_back(std::make_unique<OwnedTensor>(p.w.dtype, std::initializer_list<int64_t>{p.w.dim(0), p.w.dim(1)}));
      const int64_t global = p.global_rows > 0 ? p.global_rows : p.w.dim(0);
      most = std::max(most, global * p.w.dim(1));
      for (int64_t b : p.blocks.empty() ? std::vector<int64_t>{global} : p.blocks) ns_.plan(b, p.w.dim(1));
    }
    rowsq_ = std::make_unique<OwnedTensor>(DType::kF64, std::initializer_list<int64_t>{rows});
    whole_ = std::make_unique<OwnedTensor>(DType::kF32, std::initializer_list<int64_t>{most});
    ns_.dtype = DType::kF32;
    EXPECT_TRUE(ns_.allocate(cpu().allocator()).is_ok());
  }
  void grad_sum_squares_into(Tensor ss) override {
    int64_t off = 0;
    for (const Param& p : ps_) {
      const int64_t r = rows_of(p.g), gs[2] = {r, p.g.numel() / r}, os[1] = {r};
      cpu().row_sum_squares(Tensor::make(p.g.data, p.g.dtype, gs, 2, Device::kCPU),
                            Tensor::make(static_cast<double*>(rowsq_->t.data) + off, DType::kF64, os, 1, Device::kCPU));
      off += r;
    }
    cpu().loss_sum_into(*rowsq_, 1.0, ss, false);
  }
  Tensor muon_update(size_t i) override { return *upd_[i]; }
  void orthogonalise() override {
    ++calls;
    for (size_t i = 0; i < ps_.size();) {
      if (!ps_[i].muon) {
        ++i;
        continue;
      }
      const int64_t R = ps_[i].global_rows > 0 ? ps_[i].global_rows : ps_[i].w.dim(0), C = ps_[i].w.dim(1);
      const int64_t shape[2] = {R, C};
      Tensor whole = Tensor::make(whole_->t.data, DType::kF32, shape, 2, Device::kCPU);
      size_t j = i;
      for (int64_t r = 0; r < R; r += rows_of(ps_[j].w), ++j)
        cpu().copy(whole.slice(0, r, r + rows_of(ps_[j].w)), *upd_[j]);
      const std::vector<int64_t> blocks = ps_[i].blocks.empty() ? std::vector<int64_t>{R} : ps_[i].blocks;
      muon_orthogonalise(cpu(), whole, blocks, whole, ns_, steps_);
      for (int64_t r = 0; i < j; r += rows_of(ps_[i].w), ++i)
        cpu().copy(*upd_[i], whole.slice(0, r, r + rows_of(ps_[i].w)));
    }
  }
  int calls = 0;

 private:
  std::vector<Param> ps_;
  int steps_;
  std::vector<std::unique_ptr<OwnedTensor>> upd_;
  std::unique_ptr<OwnedTensor> rowsq_, whole_;
  NsScratch ns_;
};

// Every param of `whole` cut into two row pieces at R/4 + 1, off the Muon blocks' boundaries
// (a 48-row matrix at 13). The first piece of each param brings its own state.
struct Pieces {
  Params p;
  std::vector<std::unique_ptr<OwnedTensor>> state;
  explicit Pieces(const Params& whole) {
    for (const Param& w : whole.list) {
      const int64_t R = rows_of(w.w), cut = R / 4 + 1, C = w.w.numel() / R;
      for (auto [a, b] : {std::pair<int64_t, int64_t>{0, cut}, {cut, R}}) {
        Param& q = w.w.ndim == 2 ? p.add(w.name + ".rows" + std::to_string(a), w.w.dtype, {b - a, C}, w.muon)
                                 : p.add(w.name + ".rows" + std::to_string(a), w.w.dtype, {b - a}, w.muon);
        q.blocks = w.muon ? (w.blocks.empty() ? std::vector<int64_t>{R} : w.blocks) : std::vector<int64_t>{};
        q.decay = w.decay;
        q.row_begin = a;
        q.global_rows = R;
        std::memcpy(q.w.data, static_cast<const float*>(w.w.data) + a * C, q.w.nbytes());
        if (a == 0) {
          for (int k = 0; k < (w.muon ? 1 : 2); ++k) {
            state.push_back(std::make_unique<OwnedTensor>(q.w.dtype, std::initializer_list<int64_t>{q.w.numel()}));
            Tensor t = Tensor::make(state.back()->t.data, q.w.dtype, q.w.shape.data(), q.w.ndim, Device::kCPU);
            std::memset(t.data, 0, t.nbytes());
            (k == 0 ? q.state0 : q.state1) = t;
          }
        }
      }
    }
  }
  // The pieces' gradients ← the whole params' (after refill_grads on them).
  void copy_grads(const Params& whole) {
    size_t k = 0;
    for (const Param& w : whole.list)
      for (size_t off = 0; off < w.g.nbytes(); off += p.list[k].g.nbytes(), ++k)
        std::memcpy(p.list[k].g.data, static_cast<const char*>(w.g.data) + off, p.list[k].g.nbytes());
  }
};

// The same steps over row pieces and over whole matrices, each through an exchange that
// sums the norm in (matrix, row) order: the same norm, clip coefficient, weights and state,
// bit for bit — what lets the sharded trainer be exact for any number of ranks.
TEST(OptimizerShards, RowPiecesStepLikeWholeMatrices) {
  Params whole = make_model(DType::kF32, 7);
  // And a matrix whose blocks scale differently (rows 16 and 32 over 16 columns), its second
  // piece (from row 13) across the boundary.
  Param& x = whole.add("model.layers.0.extra.weight", DType::kF32, {48, 16}, true, {16, 32}, true);
  testing::fill_uniform(x.w, 77, -0.5, 0.5);
  Pieces pieces(whole);
  OptimizerConfig cfg;
  cfg.weight_decay = 0.1;
  cfg.max_grad_norm = 0.5;
  PiecesExchange ew(whole.list, cfg.ns_steps), ep(pieces.p.list, cfg.ns_steps);
  Optimizer ow, op;
  ASSERT_TRUE(ow.init(cpu(), whole.list, cfg, &ew).is_ok());
  ASSERT_TRUE(op.init(cpu(), pieces.p.list, cfg, &ep).is_ok());
  for (int s = 0; s < 3; ++s) {
    refill_grads(whole, 200 + 10 * s);
    pieces.copy_grads(whole);
    const StepResult rw = ow.step(3e-3), rp = op.step(3e-3);
    EXPECT_EQ(0, std::memcmp(&rw.grad_norm, &rp.grad_norm, sizeof(double))) << rw.grad_norm << " vs " << rp.grad_norm;
    EXPECT_EQ(rw.clip_coef, rp.clip_coef);
    EXPECT_LT(rw.clip_coef, 1.0);  // the clip is exercised
  }
  EXPECT_EQ(ew.calls, 3);
  EXPECT_EQ(ep.calls, 3);
  // Weights and state: each whole param against its two pieces, concatenated (state_tensors
  // lists a param's momentum, or its m then v, in param order).
  const auto sw = ow.state_tensors(), sp = op.state_tensors();
  size_t k = 0, iw = 0, ip = 0;
  for (const Param& w : whole.list) {
    std::vector<char> cat;
    for (int piece = 0; piece < 2; ++piece) {
      const auto b = bytes_of(pieces.p.list[k + static_cast<size_t>(piece)].w);
      cat.insert(cat.end(), b.begin(), b.end());
    }
    EXPECT_EQ(cat, bytes_of(w.w)) << w.name;
    const size_t per = w.muon ? 1 : 2;
    for (size_t s = 0; s < per; ++s) {
      std::vector<char> st;
      for (size_t piece = 0; piece < 2; ++piece) {
        const auto b = bytes_of(sp[ip + piece * per + s].second);
        st.insert(st.end(), b.begin(), b.end());
      }
      EXPECT_EQ(st, bytes_of(sw[iw + s].second)) << sw[iw + s].first;
    }
    k += 2;
    iw += per;
    ip += 2 * per;
  }
  EXPECT_NE(pieces.state.size(), 0u);
}

// A row shard needs an exchange; state a param brings must match its weight.
TEST(OptimizerShards, InitChecksShardsAndGivenState) {
  Params whole = make_model(DType::kF32, 9);
  Pieces pieces(whole);
  OptimizerConfig cfg;
  Optimizer o;
  Status st = o.init(cpu(), pieces.p.list, cfg);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("needs a ShardExchange"), std::string::npos) << st.message();
  PiecesExchange ex(pieces.p.list, cfg.ns_steps);
  std::vector<Param> bad = pieces.p.list;
  bad[0].row_begin = bad[0].global_rows;  // rows past the matrix's end
  st = o.init(cpu(), bad, cfg, &ex);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("fall outside"), std::string::npos) << st.message();
  bad = pieces.p.list;
  bad[0].state1 = Tensor{};  // AdamW's m without its v
  st = o.init(cpu(), bad, cfg, &ex);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("needs both"), std::string::npos) << st.message();
  bad = pieces.p.list;
  bad[0].state0 = bad[2].w;  // another shape
  st = o.init(cpu(), bad, cfg, &ex);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("must match the weight"), std::string::npos) << st.message();
  EXPECT_TRUE(o.init(cpu(), pieces.p.list, cfg, &ex).is_ok());
}

TEST(Schedule, Warmup) {
  ScheduleConfig c;
  c.kind = ScheduleKind::kCosine;
  c.lr = 1.0;
  c.warmup_steps = 10;
  c.total_steps = 100;
  EXPECT_DOUBLE_EQ(lr_at(c, 0), 0.1);
  EXPECT_DOUBLE_EQ(lr_at(c, 4), 0.5);
  EXPECT_DOUBLE_EQ(lr_at(c, 9), 1.0);
  EXPECT_DOUBLE_EQ(lr_at(c, 10), 1.0);  // first post-warm-up step: the peak
  c.kind = ScheduleKind::kConstant;
  EXPECT_DOUBLE_EQ(lr_at(c, 0), 0.1);
  EXPECT_DOUBLE_EQ(lr_at(c, 50), 1.0);
  EXPECT_DOUBLE_EQ(lr_at(c, 1000), 1.0);
}

TEST(Schedule, Cosine) {
  ScheduleConfig c;
  c.kind = ScheduleKind::kCosine;
  c.lr = 2e-3;
  c.min_lr_frac = 0.1;
  c.warmup_steps = 11;
  c.total_steps = 100;  // decay over steps 11..99 (88 intervals)
  const double lo = 2e-4;
  EXPECT_DOUBLE_EQ(lr_at(c, 11), 2e-3);
  EXPECT_NEAR(lr_at(c, 55), (2e-3 + lo) / 2, 1e-15);
  EXPECT_NEAR(lr_at(c, 33), lo + (2e-3 - lo) * 0.5 * (1 + std::cos(std::numbers::pi * 0.25)), 1e-15);
  EXPECT_DOUBLE_EQ(lr_at(c, 99), lo);
  EXPECT_DOUBLE_EQ(lr_at(c, 150), lo);
  for (int64_t s = 12; s < 100; ++s) EXPECT_LT(lr_at(c, s), lr_at(c, s - 1));
  c.warmup_steps = 0;
  EXPECT_DOUBLE_EQ(lr_at(c, 0), 2e-3);
  EXPECT_DOUBLE_EQ(lr_at(c, 99), lo);
}

TEST(Schedule, Wsd) {
  ScheduleConfig c;
  c.kind = ScheduleKind::kWsd;
  c.lr = 1.0;
  c.min_lr_frac = 0.0;
  c.warmup_steps = 5;
  c.total_steps = 100;
  c.decay_frac = 0.2;  // last 20 steps: 80..99
  EXPECT_DOUBLE_EQ(lr_at(c, 0), 0.2);
  EXPECT_DOUBLE_EQ(lr_at(c, 5), 1.0);
  EXPECT_DOUBLE_EQ(lr_at(c, 50), 1.0);
  EXPECT_DOUBLE_EQ(lr_at(c, 79), 1.0);
  EXPECT_DOUBLE_EQ(lr_at(c, 80), 1.0 - 1.0 / 20);
  EXPECT_DOUBLE_EQ(lr_at(c, 89), 0.5);
  EXPECT_DOUBLE_EQ(lr_at(c, 99), 0.0);
  EXPECT_DOUBLE_EQ(lr_at(c, 120), 0.0);
  c.min_lr_frac = 0.1;
  EXPECT_DOUBLE_EQ(lr_at(c, 99), 0.1);
  EXPECT_DOUBLE_EQ(lr_at(c, 89), 0.55);
  c.decay_frac = 0.0;
  EXPECT_DOUBLE_EQ(lr_at(c, 99), 1.0);
}

TEST(Schedule, NamesAndValidation) {
  ScheduleKind k;
  for (const char* n : {"constant", "cosine", "wsd"}) {
    ASSERT_TRUE(schedule_kind_from_name(n, &k).is_ok()) << n;
    EXPECT_STREQ(schedule_kind_name(k), n);
  }
  Status st = schedule_kind_from_name("linear", &k);
  EXPECT_EQ(st.code(), Status::Code::kInvalidArgument);
  EXPECT_NE(st.message().find("linear"), std::string::npos);
  ScheduleConfig c;
  EXPECT_TRUE(c.validate().is_ok());
  c.total_steps = 0;
  EXPECT_FALSE(c.validate().is_ok());
  c.total_steps = 10;
  c.min_lr_frac = 1.5;
  EXPECT_FALSE(c.validate().is_ok());
}

// ---- device scalars (enqueue_step / finish_step) -------------------------------------------
//
// The optimizer keeps the norm, the clip coefficient and the skip flag in device scalars
// and gates every update on the flag. RefOptimizer below is the host-scalar step as it was
// written before (global_grad_norm read back, the decision on the host, ungated ops,
// Newton–Schulz normalised from a host norm): both must leave bitwise identical weights
// and state after clipped, unclipped and skipped (NaN) steps.

namespace {

struct RefOptimizer {
  OptimizerConfig cfg;
  std::vector<std::unique_ptr<OwnedTensor>> state0, state1;
  std::unique_ptr<OwnedTensor> update;
  NsScratch ns;
  Arena ns_arena;
  int64_t t = 0;

  void init(std::vector<Param>& ps, const OptimizerConfig& c) {
    cfg = c;
    for (Param& p : ps)
      if (p.muon && p.blocks.empty()) p.blocks = {p.w.dim(0)};  // as Optimizer::init does
    int64_t max_muon = 0;
    ns.dtype = ps[0].w.dtype;
    for (Param& p : ps) {
      auto shape = [&] { return std::vector<int64_t>(p.w.shape.begin(), p.w.shape.begin() + p.w.ndim); };
      auto zeros = [&] {
        auto o = std::make_unique<OwnedTensor>();
        const std::vector<int64_t> s = shape();
        o->t = Tensor::make(nullptr, p.w.dtype, s.data(), p.w.ndim);
        o->storage.assign(o->t.numel() + 1, 0.0);
        o->t.data = o->storage.data();
        return o;
      };
      state0.push_back(zeros());
      state1.push_back(p.muon ? nullptr : zeros());
      if (p.muon) {
        for (int64_t b : p.blocks) ns.plan(b, p.w.dim(1));
        max_muon = std::max(max_muon, p.w.numel());
      }
    }
    update = std::make_unique<OwnedTensor>(ps[0].w.dtype, std::initializer_list<int64_t>{max_muon});
    // Without the "ss" spec: newton_schulz takes the host-norm path (the old code).
    std::vector<TensorSpec> specs;
    ns.add_specs(&specs, "ns.");
    specs.pop_back();
    ASSERT_TRUE(ns_arena.create(std::move(specs), cpu().allocator(), "ref ns").is_ok());
    ASSERT_TRUE(ns.bind(ns_arena, "ns.").is_ok());
    ASSERT_FALSE(ns.ss.defined());
  }

  StepResult step(std::vector<Param>& ps, double lr) {
    Backend& be = cpu();
    StepResult r;
    r.grad_norm = global_grad_norm(be, ps);
    if (!std::isfinite(r.grad_norm)) {
      r.skipped = true;
      return r;
    }
    if (cfg.max_grad_norm > 0 && r.grad_norm > cfg.max_grad_norm) {
      r.clip_coef = cfg.max_grad_norm / (r.grad_norm + 1e-6);
      for (Param& p : ps) be.scale(p.g, r.clip_coef);
    }
    ++t;
    AdamWParams ap;
    ap.lr = lr;
    ap.beta1 = cfg.beta1;
    ap.beta2 = cfg.beta2;
    ap.eps = cfg.eps;
    ap.step = t;
    for (size_t i = 0; i < ps.size(); ++i) {
      if (ps[i].muon) continue;
      ap.wd = ps[i].decay ? cfg.weight_decay : 0.0;
      be.adamw_update(ps[i].w, ps[i].g, state0[i]->t, state1[i]->t, ap);
    }
    for (size_t i = 0; i < ps.size(); ++i) {
      Param& p = ps[i];
      if (!p.muon) continue;
      Tensor u = Tensor::make(update->t.data, p.w.dtype, p.w.shape.data(), p.w.ndim);
      muon_prepare(be, p.g, state0[i]->t, u, cfg.momentum, cfg.nesterov);
      muon_orthogonalise(be, u, p.blocks, u, ns, cfg.ns_steps);
      muon_finish(be, p.w, u, p.blocks, 0, lr, cfg.weight_decay, cfg.scale);
    }
    return r;
  }
};

void scale_grads(Params& p, double f) {
  for (Param& q : p.list) cpu().scale(q.g, f);
}

}  // namespace

TEST(OptimizerDeviceScalars, BitwiseLikeHostScalarStepClippedUnclippedSkipped) {
  for (DType dt : {DType::kF32, DType::kF64}) {
    Params a = make_model(dt, 11), b = make_model(dt, 11);
    OptimizerConfig cfg;
    cfg.weight_decay = 0.1;
    cfg.max_grad_norm = 1.0;
    Optimizer opt;
    ASSERT_TRUE(opt.init(cpu(), a.list, cfg).is_ok());
    RefOptimizer ref;
    ref.init(b.list, cfg);
    // Per step: the factor the fresh gradients are scaled by, and whether a NaN goes in.
    struct Case { double factor; bool nan; const char* what; };
    const Case cases[] = {{0.1, false, "unclipped"}, {100.0, false, "clipped"}, {1.0, true, "skipped (NaN)"},
                          {0.1, false, "unclipped after a skip"}, {50.0, false, "clipped again"}};
    int64_t k = 0;
    for (const Case& c : cases) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " step " + std::to_string(k) + ": " + c.what);
      refill_grads(a, 100 + k);
      refill_grads(b, 100 + k);
      scale_grads(a, c.factor);
      scale_grads(b, c.factor);
      if (c.nan) {
        const double nan = std::nan("");
        for (Params* p : {&a, &b}) {
          Tensor g = p->list[2].g;
          if (dt == DType::kF32) static_cast<float*>(g.data)[3] = static_cast<float>(nan);
          else static_cast<double*>(g.data)[3] = nan;
        }
      }
      std::vector<std::vector<char>> grads_before;
      for (const Param& p : a.list) grads_before.push_back(bytes_of(p.g));
      const StepResult got = opt.step(0.01);
      const StepResult want = ref.step(b.list, 0.01);
      EXPECT_EQ(got.skipped, want.skipped);
      EXPECT_EQ(got.skipped, c.nan);
      if (!c.nan) {
        EXPECT_EQ(got.grad_norm, want.grad_norm);
        EXPECT_EQ(got.clip_coef, want.clip_coef);
        EXPECT_EQ(got.clip_coef != 1.0, c.factor > 10) << "the case should " << (c.factor > 10 ? "" : "not ") << "clip";
      } else {
        EXPECT_TRUE(std::isnan(got.grad_norm));
        EXPECT_EQ(got.clip_coef, 1.0);
        for (size_t i = 0; i < a.list.size(); ++i)
          EXPECT_EQ(bytes_of(a.list[i].g), grads_before[i]) << "a skipped step scaled gradient " << a.list[i].name;
      }
      EXPECT_EQ(opt.step_count(), ref.t);
      for (size_t i = 0; i < a.list.size(); ++i)
        EXPECT_EQ(bytes_of(a.list[i].w), bytes_of(b.list[i].w)) << a.list[i].name;
      const auto st = opt.state_tensors();
      size_t j = 0;
      for (size_t i = 0; i < b.list.size(); ++i) {
        EXPECT_EQ(bytes_of(st[j++].second), bytes_of(ref.state0[i]->t)) << b.list[i].name << " state 0";
        if (ref.state1[i]) {
          EXPECT_EQ(bytes_of(st[j++].second), bytes_of(ref.state1[i]->t)) << b.list[i].name;
        }
      }
      ++k;
    }
    EXPECT_EQ(opt.step_count(), 4);
  }
}

TEST(OptimizerDeviceScalars, EnqueueThenFinishIsStep) {
  Params a = make_model(DType::kF32, 5), b = make_model(DType::kF32, 5);
  OptimizerConfig cfg;
  Optimizer oa, ob;
  ASSERT_TRUE(oa.init(cpu(), a.list, cfg).is_ok());
  ASSERT_TRUE(ob.init(cpu(), b.list, cfg).is_ok());
  oa.enqueue_step(0.02);
  EXPECT_EQ(oa.step_count(), 0) << "the step is counted at finish_step, once the skip flag is known";
  const StepResult ra = oa.finish_step();
  const StepResult rb = ob.step(0.02);
  EXPECT_EQ(ra.grad_norm, rb.grad_norm);
  EXPECT_EQ(oa.step_count(), 1);
  for (size_t i = 0; i < a.list.size(); ++i) EXPECT_EQ(bytes_of(a.list[i].w), bytes_of(b.list[i].w));
}

TEST(OptimizerDeviceScalars, NewtonSchulzDeviceNormPathIsBitwiseHostPath) {
  for (auto [r, c] : std::vector<std::pair<int64_t, int64_t>>{{8, 24}, {24, 8}, {16, 16}}) {
    OwnedTensor g(DType::kF32, {r, c});
    testing::fill_uniform(g, 7 + r, -1, 1);
    NsScratch dev, host;
    dev.plan(r, c);
    host.plan(r, c);
    ASSERT_TRUE(dev.allocate(cpu().allocator()).is_ok());
    ASSERT_TRUE(dev.ss.defined());
    std::vector<TensorSpec> specs;
    host.add_specs(&specs, "h.");
    specs.pop_back();  // no "ss": the host-norm path
    Arena arena;
    ASSERT_TRUE(arena.create(std::move(specs), cpu().allocator(), "host ns").is_ok());
    ASSERT_TRUE(host.bind(arena, "h.").is_ok());
    OwnedTensor o1(DType::kF32, {r, c}), o2(DType::kF32, {r, c});
    newton_schulz(cpu(), g, o1, dev, 5);
    newton_schulz(cpu(), g, o2, host, 5);
    EXPECT_EQ(bytes_of(o1), bytes_of(o2)) << r << "x" << c;
  }
}

}  // namespace
}  // namespace laplace
