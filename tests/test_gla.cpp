// Tests of the CPU GLA mixer (ops/cpu/gla.cpp), docs/model.md §4 (the three forms of the mixer):
// the quadratic, recurrent and chunked forms agree; states chain, alias and live in
// slot pools; strided q/k/v views work; the backward matches finite differences; and
// results are bitwise deterministic.
#include "ops/cpu/gla.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "tests/test_util.h"

namespace laplace {
namespace {

using testing::max_rel_error;
using testing::OwnedTensor;
using Owned = std::unique_ptr<OwnedTensor>;

Owned owned(DType dt, std::initializer_list<int64_t> shape) {
  return std::make_unique<OwnedTensor>(dt, shape);
}

struct Dims {
  int64_t B, T, H, dk, dv;
};

// λ_h = 1 − 2^(−5−h), the model's decays (docs/model.md §3).
std::vector<double> model_decays(int64_t H) {
  std::vector<double> d;
  for (int64_t h = 0; h < H; ++h) d.push_back(1.0 - std::ldexp(1.0, static_cast<int>(-5 - h)));
  return d;
}

// Fast decays 0.5, 0.25, ...: λ^C underflows in F32 for C = 128.
std::vector<double> fast_decays(int64_t H) {
  std::vector<double> d;
  for (int64_t h = 0; h < H; ++h) d.push_back(std::ldexp(1.0, static_cast<int>(-1 - h)));
  return d;
}

GlaParams make_params(GlaForm form, int64_t chunk, std::vector<double> decay, int64_t dk) {
  GlaParams p;
  p.form = form;
  p.chunk = chunk;
  p.scale = 1.0 / std::sqrt(static_cast<double>(dk));
  p.decay = std::move(decay);
  return p;
}

// Element (flat logical index) access of an F32/F64 tensor, honouring strides.
using testing::element_get;
using testing::element_set;

// dst = src elementwise (any strides, dtype converted).
void copy_into(const Tensor& src, const Tensor& dst) {
  ASSERT_EQ(src.numel(), dst.numel());
  for (int64_t i = 0; i < src.numel(); ++i) element_set(dst, i, element_get(src, i));
}

// A contiguous copy of src with dtype dt.
Owned clone(const Tensor& src, DType dt) {
  Owned r = owned(dt, {1});
  r->t = Tensor::make(nullptr, dt, src.shape.data(), src.ndim);
  r->storage.assign(static_cast<size_t>(src.numel()) + 1, 0.0);
  r->t.data = r->storage.data();
  copy_into(src, r->t);
  return r;
}

bool bitwise_equal(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.data, b.data, a.nbytes()) == 0;
}

// Contiguous q,k,v [B,T,H,d] and initial states s0 [B,H,dk,dv], drawn in F32 and then
// converted, so the F32 and F64 versions hold the same values.
struct Inputs {
  Dims d;
  Owned q, k, v, s0;
};

Inputs random_inputs(const Dims& d, DType dt, uint64_t seed) {
  Inputs in{d, owned(DType::kF32, {d.B, d.T, d.H, d.dk}), owned(DType::kF32, {d.B, d.T, d.H, d.dk}),
            owned(DType::kF32, {d.B, d.T, d.H, d.dv}), owned(DType::kF32, {d.B, d.H, d.dk, d.dv})};
  testing::fill_uniform(*in.q, seed + 1);
  testing::fill_uniform(*in.k, seed + 2);
  testing::fill_uniform(*in.v, seed + 3);
  testing::fill_uniform(*in.s0, seed + 4);
  if (dt == DType::kF64)
    for (Owned* t : {&in.q, &in.k, &in.v, &in.s0}) *t = clone(**t, DType::kF64);
  return in;
}

Inputs convert(const Inputs& in, DType dt) {
  return {in.d, clone(*in.q, dt), clone(*in.k, dt), clone(*in.v, dt), clone(*in.s0, dt)};
}

struct FwdOut {
  Owned o, s;
};

// One forward call with fresh contiguous outputs (s_in = s0 or undefined).
FwdOut run_forward(const GlaParams& p, const Inputs& in, bool with_state) {
  const Dims& d = in.d;
  const DType dt = in.q->t.dtype;
  FwdOut r{owned(dt, {d.B, d.T, d.H, d.dv}), owned(dt, {d.B, d.H, d.dk, d.dv})};
  cpu::gla_forward(p, *in.q, *in.k, *in.v, *r.o, with_state ? in.s0->t : Tensor{}, *r.s, Tensor{});
  return r;
}

struct Grads {
  Owned dq, dk, dv, ds;
};

Grads run_backward(const GlaParams& p, const Inputs& in, bool with_state, const Tensor& d_o,
                   const Tensor& ds_out) {
  const Dims& d = in.d;
  const DType dt = in.q->t.dtype;
  Grads g{owned(dt, {d.B, d.T, d.H, d.dk}), owned(dt, {d.B, d.T, d.H, d.dk}),
          owned(dt, {d.B, d.T, d.H, d.dv}), owned(dt, {d.B, d.H, d.dk, d.dv})};
  cpu::gla_backward(p, *in.q, *in.k, *in.v, with_state ? in.s0->t : Tensor{}, d_o, ds_out, *g.dq,
                    *g.dk, *g.dv, *g.ds);
  return g;
}

// ---- forms agree ----------------------------------------------------------------------

// For T ∈ {200, 300}, with/without S_0, model and fast decays: every form in dtype dt
// (recurrent, chunked C ∈ {16, 64, 128} and more, quadratic) against the F64 quadratic form.
void check_forms_agree(Dims d, DType dt, double tol, std::vector<int64_t> chunks) {
  double worst = 0;
  for (int64_t T : {200, 300}) {
    d.T = T;
    for (bool with_state : {false, true}) {
      for (bool fast : {false, true}) {
        const Inputs in = random_inputs(d, dt, 100 + static_cast<uint64_t>(T) + (fast ? 7 : 0));
        const Inputs in64 = convert(in, DType::kF64);
        const auto decay = fast ? fast_decays(d.H) : model_decays(d.H);
        const FwdOut ref =
            run_forward(make_params(GlaForm::kQuadratic, 0, decay, d.dk), in64, with_state);
        std::vector<std::pair<std::string, GlaParams>> runs = {
            {"recurrent", make_params(GlaForm::kRecurrent, 0, decay, d.dk)}};
        if (dt != DType::kF64)
          runs.push_back({"quadratic", make_params(GlaForm::kQuadratic, 0, decay, d.dk)});
        for (int64_t C : chunks)
          runs.push_back(
              {"chunked C=" + std::to_string(C), make_params(GlaForm::kChunked, C, decay, d.dk)});
        for (const auto& [name, p] : runs) {
          SCOPED_TRACE(name + " T=" + std::to_string(T) + " state=" + std::to_string(with_state) +
                       " fast=" + std::to_string(fast));
          const FwdOut r = run_forward(p, in, with_state);
          const double eo = max_rel_error(*r.o, *ref.o), es = max_rel_error(*r.s, *ref.s);
          EXPECT_LE(eo, tol);
          EXPECT_LE(es, tol);
          worst = std::max({worst, eo, es});
        }
      }
    }
  }
  std::printf("  [forms %s dk=%lld dv=%lld] worst max_rel_error %.3g\n",
              dt == DType::kF64 ? "F64" : "F32", static_cast<long long>(d.dk),
              static_cast<long long>(d.dv), worst);
}

TEST(GlaForms, AgreeF64Large) {
  check_forms_agree({2, 0, 2, 96, 192}, DType::kF64, 1e-10, {16, 64, 128});
}
TEST(GlaForms, AgreeF32Large) {
  check_forms_agree({2, 0, 2, 96, 192}, DType::kF32, 1e-5, {16, 64, 128});
}
TEST(GlaForms, AgreeF64Small) {
  check_forms_agree({2, 0, 3, 8, 12}, DType::kF64, 1e-10, {1, 7, 16, 64, 128, 1000});
}
TEST(GlaForms, AgreeF32Small) {
  check_forms_agree({2, 0, 3, 8, 12}, DType::kF32, 1e-5, {1, 7, 16, 64, 128, 1000});
}

// ---- states ---------------------------------------------------------------------------

// Chunked over T tokens == chunked over T1 tokens, then T−T1 more from the passed state;
// also == chunked prefill of T−3 tokens then 3 recurrent decode steps in place.
void check_continuation(DType dt, double tol) {
  const Dims d{2, 300, 2, 96, 192};
  const int64_t T1 = 150, C = 64;
  const Inputs in = random_inputs(d, dt, 7);
  const GlaParams pc = make_params(GlaForm::kChunked, C, model_decays(d.H), d.dk);
  const GlaParams pr = make_params(GlaForm::kRecurrent, 0, model_decays(d.H), d.dk);
  const FwdOut full = run_forward(pc, in, true);

  Owned o = owned(dt, {d.B, d.T, d.H, d.dv}), mid = owned(dt, {d.B, d.H, d.dk, d.dv});
  Owned fin = owned(dt, {d.B, d.H, d.dk, d.dv});
  auto part = [](const Tensor& t, int64_t a, int64_t b) { return t.slice(1, a, b); };
  cpu::gla_forward(pc, part(*in.q, 0, T1), part(*in.k, 0, T1), part(*in.v, 0, T1), part(*o, 0, T1),
                   *in.s0, *mid, Tensor{});
  cpu::gla_forward(pc, part(*in.q, T1, d.T), part(*in.k, T1, d.T), part(*in.v, T1, d.T),
                   part(*o, T1, d.T), *mid, *fin, Tensor{});
  EXPECT_LE(max_rel_error(*o, *full.o), tol);
  EXPECT_LE(max_rel_error(*fin, *full.s), tol);

  Owned o2 = owned(dt, {d.B, d.T, d.H, d.dv}), s = clone(*in.s0, dt);
  const int64_t Tp = d.T - 3;
  cpu::gla_forward(pc, part(*in.q, 0, Tp), part(*in.k, 0, Tp), part(*in.v, 0, Tp), part(*o2, 0, Tp),
                   *s, *s, Tensor{});
  for (int64_t t = Tp; t < d.T; ++t)
    cpu::gla_forward(pr, part(*in.q, t, t + 1), part(*in.k, t, t + 1), part(*in.v, t, t + 1),
                     part(*o2, t, t + 1), *s, *s, Tensor{});
  EXPECT_LE(max_rel_error(*o2, *full.o), tol);
  EXPECT_LE(max_rel_error(*s, *full.s), tol);
  std::printf("  [continuation %s] o %.3g state %.3g; prefill+decode o %.3g state %.3g\n",
              dt == DType::kF64 ? "F64" : "F32", max_rel_error(*o, *full.o),
              max_rel_error(*fin, *full.s), max_rel_error(*o2, *full.o),
              max_rel_error(*s, *full.s));
}

TEST(GlaState, ContinuationF64) { check_continuation(DType::kF64, 1e-12); }
TEST(GlaState, ContinuationF32) { check_continuation(DType::kF32, 1e-5); }

// s_out aliasing s_in gives bitwise the same outputs as separate tensors.
TEST(GlaState, InPlaceAlias) {
  const Dims d{2, 0, 3, 8, 12};
  for (GlaForm form : {GlaForm::kRecurrent, GlaForm::kChunked, GlaForm::kQuadratic}) {
    for (int64_t T : {1, 5, 37}) {
      SCOPED_TRACE("form=" + std::to_string(static_cast<int>(form)) + " T=" + std::to_string(T));
      Dims dt = d;
      dt.T = T;
      const Inputs in = random_inputs(dt, DType::kF64, 11);
      const GlaParams p = make_params(form, 16, model_decays(d.H), d.dk);
      const FwdOut ref = run_forward(p, in, true);
      Owned o = owned(DType::kF64, {d.B, T, d.H, d.dv}), s = clone(*in.s0, DType::kF64);
      cpu::gla_forward(p, *in.q, *in.k, *in.v, *o, *s, *s, Tensor{});
      EXPECT_TRUE(bitwise_equal(*o, *ref.o));
      EXPECT_TRUE(bitwise_equal(*s, *ref.s));
    }
  }
}

// A pool of S = 5 entries whose dim-0 stride holds 3 layers plus padding; the view is
// layer 1. slots = {3, 0}: batch row 0 uses entry 3, row 1 entry 0; the other entries,
// the other layers and the padding stay bitwise untouched.
TEST(GlaState, SlotPool) {
  const Dims d{2, 0, 3, 8, 12};
  const int64_t S = 5, per_layer = d.H * d.dk * d.dv, pitch = 3 * per_layer + 5;
  std::vector<int32_t> slot_ids = {3, 0};
  const Tensor slots(slot_ids.data(), DType::kI32, {2});
  for (GlaForm form : {GlaForm::kRecurrent, GlaForm::kChunked}) {
    for (bool in_place : {true, false}) {
      SCOPED_TRACE("form=" + std::to_string(static_cast<int>(form)) +
                   " in_place=" + std::to_string(in_place));
      Dims dt = d;
      dt.T = form == GlaForm::kRecurrent ? 1 : 37;
      const Inputs in = random_inputs(dt, DType::kF64, 21);
      const GlaParams p = make_params(form, 16, model_decays(d.H), d.dk);

      Owned store = owned(DType::kF64, {S * pitch}), out_store = owned(DType::kF64, {S * pitch});
      testing::fill_uniform(*store, 5);
      testing::fill_uniform(*out_store, 6);
      const std::vector<double> before = store->storage, out_before = out_store->storage;
      auto pool_view = [&](const Owned& st) {
        Tensor t(st->ptr<double>() + per_layer, DType::kF64, {S, d.H, d.dk, d.dv});
        t.stride[0] = pitch;
        return t;
      };
      const Tensor pool = pool_view(store), out_pool = in_place ? pool : pool_view(out_store);

      // Reference: contiguous initial states gathered from the pool, no slots.
      Inputs ref_in = convert(in, DType::kF64);
      for (int64_t b = 0; b < d.B; ++b) copy_into(pool.select(slot_ids[b]), ref_in.s0->t.select(b));
      const FwdOut ref = run_forward(p, ref_in, true);

      Owned o = owned(DType::kF64, {d.B, dt.T, d.H, d.dv});
      cpu::gla_forward(p, *in.q, *in.k, *in.v, *o, pool, out_pool, slots);
      EXPECT_TRUE(bitwise_equal(*o, *ref.o));
      for (int64_t b = 0; b < d.B; ++b)
        EXPECT_EQ(max_rel_error(out_pool.select(slot_ids[b]), ref.s->t.select(b)), 0.0);
      // Everything outside the written entries is untouched (input pool too when not in place).
      auto written = [&](int64_t flat) {
        const int64_t e = flat / pitch, r = flat % pitch;
        return (e == 3 || e == 0) && r >= per_layer && r < 2 * per_layer;
      };
      const std::vector<double>& out_now = in_place ? store->storage : out_store->storage;
      const std::vector<double>& out_orig = in_place ? before : out_before;
      int64_t changed_elsewhere = 0;
      for (int64_t i = 0; i < S * pitch; ++i)
        if (!written(i) && out_now[i] != out_orig[i]) ++changed_elsewhere;
      EXPECT_EQ(changed_elsewhere, 0);
      if (!in_place) {
        EXPECT_EQ(store->storage, before);
      }
    }
  }
}

// A prefill of a fresh sequence: s_in undefined (S_0 = 0), s_out = a pool entry.
TEST(GlaState, PrefillIntoSlotFromZero) {
  const Dims d{1, 29, 2, 8, 12};
  const Inputs in = random_inputs(d, DType::kF64, 31);
  const GlaParams p = make_params(GlaForm::kChunked, 8, model_decays(d.H), d.dk);
  const FwdOut ref = run_forward(p, in, false);
  Owned pool = owned(DType::kF64, {4, d.H, d.dk, d.dv});
  testing::fill_uniform(*pool, 3);
  std::vector<int32_t> slot_ids = {2};
  Owned o = owned(DType::kF64, {d.B, d.T, d.H, d.dv});
  cpu::gla_forward(p, *in.q, *in.k, *in.v, *o, Tensor{}, *pool,
                   Tensor(slot_ids.data(), DType::kI32, {1}));
  EXPECT_TRUE(bitwise_equal(*o, *ref.o));
  EXPECT_EQ(max_rel_error(pool->t.select(2), ref.s->t.select(0)), 0.0);
}

// ---- strided views --------------------------------------------------------------------

// q/k/v carved from a fused [B,T,H·(2dk+2dv)] projection (and o, dq/dk/dv written into
// padded / fused buffers) give bitwise the results of contiguous copies.
TEST(GlaStrided, FusedProjectionViews) {
  for (DType dt : {DType::kF64, DType::kF32}) {
    const Dims d{2, 45, 3, 8, 12};
    const int64_t R = d.H * (2 * d.dk + 2 * d.dv);
    Owned fused = owned(dt, {d.B, d.T, R});
    testing::fill_uniform(*fused, 41);
    auto view = [&](const Tensor& buf, int64_t col, int64_t hd) {
      Tensor t = buf;
      t.data = static_cast<char*>(buf.data) + col * static_cast<int64_t>(dtype_size(dt));
      t.ndim = 4;
      t.shape = {d.B, d.T, d.H, hd};
      t.stride = {buf.stride[0], buf.stride[1], hd, 1};
      return t;
    };
    const Tensor q = view(*fused, 0, d.dk), k = view(*fused, d.H * d.dk, d.dk),
                 v = view(*fused, 2 * d.H * d.dk, d.dv);
    Inputs in{d, clone(q, dt), clone(k, dt), clone(v, dt), owned(dt, {d.B, d.H, d.dk, d.dv})};
    testing::fill_uniform(*in.s0, 42);

    for (GlaForm form : {GlaForm::kQuadratic, GlaForm::kRecurrent, GlaForm::kChunked}) {
      const GlaParams p = make_params(form, 16, model_decays(d.H), d.dk);
      const FwdOut ref = run_forward(p, in, true);
      Owned obuf = owned(dt, {d.B, d.T, d.H * d.dv + 3}), s = owned(dt, {d.B, d.H, d.dk, d.dv});
      Tensor o = view(*obuf, 1, d.dv);
      cpu::gla_forward(p, q, k, v, o, *in.s0, *s, Tensor{});
      EXPECT_EQ(max_rel_error(o, *ref.o), 0.0);
      EXPECT_TRUE(bitwise_equal(*s, *ref.s));
    }

    // Backward: gradients into the matching columns of a fused d_qkvg buffer.
    const GlaParams p = make_params(GlaForm::kChunked, 16, model_decays(d.H), d.dk);
    Owned d_o = owned(dt, {d.B, d.T, d.H, d.dv}), ds_out = owned(dt, {d.B, d.H, d.dk, d.dv});
    testing::fill_uniform(*d_o, 43);
    testing::fill_uniform(*ds_out, 44);
    const Grads ref = run_backward(p, in, true, *d_o, *ds_out);
    Owned dfused = owned(dt, {d.B, d.T, R});
    testing::fill_uniform(*dfused, 45);
    const Owned dfused_before = clone(*dfused, dt);
    const Tensor dq = view(*dfused, 0, d.dk), dk = view(*dfused, d.H * d.dk, d.dk),
                 dv = view(*dfused, 2 * d.H * d.dk, d.dv);
    Owned ds = owned(dt, {d.B, d.H, d.dk, d.dv});
    cpu::gla_backward(p, q, k, v, *in.s0, *d_o, *ds_out, dq, dk, dv, *ds);
    EXPECT_EQ(max_rel_error(dq, *ref.dq), 0.0);
    EXPECT_EQ(max_rel_error(dk, *ref.dk), 0.0);
    EXPECT_EQ(max_rel_error(dv, *ref.dv), 0.0);
    EXPECT_TRUE(bitwise_equal(*ds, *ref.ds));
    const Tensor g_cols = view(*dfused, 2 * d.H * d.dk + d.H * d.dv, d.dv);
    const Tensor g_before = view(*dfused_before, 2 * d.H * d.dk + d.H * d.dv, d.dv);
    EXPECT_EQ(max_rel_error(g_cols, g_before), 0.0);  // the g columns are not touched
  }
}

// ---- backward -------------------------------------------------------------------------

// L = Σ o⊙R + Σ S_T⊙R2 (F64, chunked form with chunk C; S_0 always passed, zeros when
// the case has no initial state).
double loss(const GlaParams& p, const Inputs& in, const Tensor& R, const Tensor& R2, bool use_r2) {
  const FwdOut f = run_forward(p, in, true);
  double l = 0;
  const double* o = f.o->ptr<double>();
  const double* r = R.ptr<double>();
  for (int64_t i = 0; i < f.o->t.numel(); ++i) l += o[i] * r[i];
  if (use_r2) {
    const double* s = f.s->ptr<double>();
    const double* r2 = R2.ptr<double>();
    for (int64_t i = 0; i < f.s->t.numel(); ++i) l += s[i] * r2[i];
  }
  return l;
}

// Central differences of L for every element of x (L is affine in each single input).
Owned finite_difference(const GlaParams& p, const Inputs& in, const Tensor& x, const Tensor& R,
                        const Tensor& R2, bool use_r2) {
  Owned g = clone(x, DType::kF64);
  const double eps = 1e-3;
  double* xp = x.ptr<double>();
  for (int64_t i = 0; i < x.numel(); ++i) {
    const double x0 = xp[i];
    xp[i] = x0 + eps;
    const double lp = loss(p, in, R, R2, use_r2);
    xp[i] = x0 - eps;
    const double lm = loss(p, in, R, R2, use_r2);
    xp[i] = x0;
    g->ptr<double>()[i] = (lp - lm) / (2 * eps);
  }
  return g;
}

// Runs the enclosing scope with one OpenMP thread (results do not depend on it; the
// finite differences make thousands of tiny calls, where thread start-up dominates).
struct SingleThreaded {
#ifdef _OPENMP
  int saved = omp_get_max_threads();
  SingleThreaded() { omp_set_num_threads(1); }
  ~SingleThreaded() { omp_set_num_threads(saved); }
#endif
};

TEST(GlaBackward, FiniteDifferenceF64) {
  const SingleThreaded one_thread;
  const Dims d{2, 23, 2, 6, 10};
  const std::vector<double> decay = {1.0 - std::ldexp(1.0, -5), 0.5};
  double worst = 0;
  for (int64_t C : {4, 16}) {
    for (bool use_ds_out : {false, true}) {
      for (bool with_state : {false, true}) {
        SCOPED_TRACE("C=" + std::to_string(C) + " ds_out=" + std::to_string(use_ds_out) +
                     " state=" + std::to_string(with_state));
        Inputs in = random_inputs(d, DType::kF64, 50 + static_cast<uint64_t>(C));
        if (!with_state) std::fill(in.s0->storage.begin(), in.s0->storage.end(), 0.0);
        Owned R = owned(DType::kF64, {d.B, d.T, d.H, d.dv}),
              R2 = owned(DType::kF64, {d.B, d.H, d.dk, d.dv});
        testing::fill_uniform(*R, 61);
        testing::fill_uniform(*R2, 62);
        const GlaParams p = make_params(GlaForm::kChunked, C, decay, d.dk);
        // dL/do = R and dL/dS_T = R2; s_in undefined in the backward when there is no S_0.
        const Grads g = run_backward(p, in, with_state, *R, use_ds_out ? R2->t : Tensor{});
        const std::pair<const char*, std::pair<const Tensor*, const Tensor*>> checks[] = {
            {"dq", {&in.q->t, &g.dq->t}},
            {"dk", {&in.k->t, &g.dk->t}},
            {"dv", {&in.v->t, &g.dv->t}},
            {"ds_in", {&in.s0->t, &g.ds->t}}};
        for (const auto& [name, xg] : checks) {
          const Owned fd = finite_difference(p, in, *xg.first, *R, *R2, use_ds_out);
          const double e = max_rel_error(*xg.second, *fd);
          EXPECT_LE(e, 1e-6) << name;
          worst = std::max(worst, e);
        }
      }
    }
  }
  std::printf("  [backward vs finite differences] worst max_rel_error %.3g\n", worst);
}

// The backward is the gradient of one function: any chunk size gives the same result.
TEST(GlaBackward, ChunkSizeInvariantF64) {
  const Dims d{2, 37, 3, 8, 12};
  const Inputs in = random_inputs(d, DType::kF64, 71);
  Owned d_o = owned(DType::kF64, {d.B, d.T, d.H, d.dv}),
        ds_out = owned(DType::kF64, {d.B, d.H, d.dk, d.dv});
  testing::fill_uniform(*d_o, 72);
  testing::fill_uniform(*ds_out, 73);
  const Grads ref = run_backward(make_params(GlaForm::kChunked, 16, model_decays(d.H), d.dk), in,
                                 true, *d_o, *ds_out);
  for (int64_t C : {1, 3, 8, 36, 37, 128}) {
    SCOPED_TRACE("C=" + std::to_string(C));
    const Grads g = run_backward(make_params(GlaForm::kChunked, C, model_decays(d.H), d.dk), in,
                                 true, *d_o, *ds_out);
    EXPECT_LE(max_rel_error(*g.dq, *ref.dq), 1e-12);
    EXPECT_LE(max_rel_error(*g.dk, *ref.dk), 1e-12);
    EXPECT_LE(max_rel_error(*g.dv, *ref.dv), 1e-12);
    EXPECT_LE(max_rel_error(*g.ds, *ref.ds), 1e-12);
  }
}

// F32 backward at the model's head dims against the F64 backward of the same inputs.
TEST(GlaBackward, F32MatchesF64Large) {
  const Dims d{2, 300, 2, 96, 192};
  double worst = 0;
  for (bool fast : {false, true}) {
    const Inputs in32 = random_inputs(d, DType::kF32, fast ? 81 : 82);
    const Inputs in64 = convert(in32, DType::kF64);
    Owned d_o = owned(DType::kF32, {d.B, d.T, d.H, d.dv}),
          ds_out = owned(DType::kF32, {d.B, d.H, d.dk, d.dv});
    testing::fill_uniform(*d_o, 83);
    testing::fill_uniform(*ds_out, 84);
    const Owned d_o64 = clone(*d_o, DType::kF64), ds_out64 = clone(*ds_out, DType::kF64);
    const auto decay = fast ? fast_decays(d.H) : model_decays(d.H);
    for (int64_t C : {64, 128}) {
      SCOPED_TRACE("C=" + std::to_string(C) + " fast=" + std::to_string(fast));
      const GlaParams p = make_params(GlaForm::kChunked, C, decay, d.dk);
      const Grads g32 = run_backward(p, in32, true, *d_o, *ds_out);
      const Grads g64 = run_backward(p, in64, true, *d_o64, *ds_out64);
      for (const auto& [a, b] : {std::pair{&g32.dq, &g64.dq}, std::pair{&g32.dk, &g64.dk},
                                 std::pair{&g32.dv, &g64.dv}, std::pair{&g32.ds, &g64.ds}}) {
        const double e = max_rel_error(**a, **b);
        EXPECT_LE(e, 1e-4);
        worst = std::max(worst, e);
      }
    }
  }
  std::printf("  [backward F32 vs F64, dk=96 dv=192] worst max_rel_error %.3g\n", worst);
}

// ---- determinism ----------------------------------------------------------------------

// Two identical calls, and calls with different thread counts, are bitwise identical.
TEST(GlaDeterminism, BitwiseRepeatAndThreadCount) {
  const Dims d{2, 200, 2, 96, 192};
  const Inputs in = random_inputs(d, DType::kF32, 91);
  Owned d_o = owned(DType::kF32, {d.B, d.T, d.H, d.dv}),
        ds_out = owned(DType::kF32, {d.B, d.H, d.dk, d.dv});
  testing::fill_uniform(*d_o, 92);
  testing::fill_uniform(*ds_out, 93);
  const GlaParams p = make_params(GlaForm::kChunked, 64, model_decays(d.H), d.dk);
  const FwdOut f1 = run_forward(p, in, true);
  const Grads g1 = run_backward(p, in, true, *d_o, *ds_out);
  std::vector<int> thread_counts = {0};  // 0: the default
#ifdef _OPENMP
  const int default_threads = omp_get_max_threads();
  thread_counts = {0, 1, 3};
#endif
  for (int nt : thread_counts) {
#ifdef _OPENMP
    omp_set_num_threads(nt == 0 ? default_threads : nt);
#endif
    SCOPED_TRACE("threads=" + std::to_string(nt));
    const FwdOut f2 = run_forward(p, in, true);
    const Grads g2 = run_backward(p, in, true, *d_o, *ds_out);
    EXPECT_TRUE(bitwise_equal(*f1.o, *f2.o));
    EXPECT_TRUE(bitwise_equal(*f1.s, *f2.s));
    EXPECT_TRUE(bitwise_equal(*g1.dq, *g2.dq));
    EXPECT_TRUE(bitwise_equal(*g1.dk, *g2.dk));
    EXPECT_TRUE(bitwise_equal(*g1.dv, *g2.dv));
    EXPECT_TRUE(bitwise_equal(*g1.ds, *g2.ds));
  }
#ifdef _OPENMP
  omp_set_num_threads(default_threads);
#endif
}

// ---- deferred write-back (ops/cpu/gla.cpp) ---------------------------------------------

// The deferred decode against the recurrent form, step by step over 2R + 3 tokens from a
// random start, three rows in scattered slots of a five-entry pool, twice: from zero count
// words (every head's cycle R steps), then after a flush of the run's own pool, which starts
// each head's next cycle R − pending_phase(h, R) steps long. The outputs agree, the count
// words follow ops/backend.h's rule, a flush (of a copy, at every step) gives the recurrent
// form's state and phase words, entries outside the batch keep every byte, and a flush with
// nothing pending changes no state bit.
void check_deferred(DType dt, double tol) {
  const int64_t E = 5, B = 3, H = 3, dk = 8, dv = 12;
  const std::vector<int32_t> slot_ids = {4, 0, 2};
  Tensor slots(const_cast<int32_t*>(slot_ids.data()), DType::kI32, {B});
  const GlaParams p = make_params(GlaForm::kRecurrent, 1, fast_decays(H), dk);
  auto used = [](int64_t e) { return e == 4 || e == 0 || e == 2; };
  for (int64_t R : {4, 8, 16}) {
    SCOPED_TRACE("R " + std::to_string(R));
    const Inputs start = random_inputs({E, 1, H, dk, dv}, dt, 40 + R);
    Owned plain = clone(*start.s0, dt), def = clone(*start.s0, dt);
    Owned pk = owned(dt, {E, H, R - 1, dk}), pv = owned(dt, {E, H, R - 1, dv});
    Owned cnt = owned(DType::kI32, {E, H});
    const GlaPending pend{*pk, *pv, *cnt, R};
    std::vector<int32_t> expect(E * H, 0);  // the count words the rule gives
    int64_t short_cycles = 0;               // write-backs with fewer than R − 1 pairs
    for (int round = 0; round < 2; ++round) {
      SCOPED_TRACE("round " + std::to_string(round));
      if (round == 1) {  // the run's own flush: phases on
        cpu::gla_pending_flush(p, *def, pend, slots);
        for (int64_t e = 0; e < E; ++e)
          for (int64_t h = 0; h < H; ++h)
            if (used(e)) expect[e * H + h] = pending_word(0, pending_phase(h, R));
      }
      for (int64_t t = 0; t < 2 * R + 3; ++t) {
        const Inputs in = random_inputs({B, 1, H, dk, dv}, dt, 100 + 10 * t + 1000 * round);
        Owned o1 = owned(dt, {B, 1, H, dv}), o2 = owned(dt, {B, 1, H, dv});
        cpu::gla_forward(p, *in.q, *in.k, *in.v, *o1, *plain, *plain, slots);
        cpu::gla_decode_deferred(p, *in.q, *in.k, *in.v, *o2, *def, pend, slots);
        EXPECT_LE(max_rel_error(*o2, *o1), tol) << "step " << t;
        for (int64_t e = 0; e < E; ++e) {
          for (int64_t h = 0; h < H; ++h) {
            int32_t& w = expect[e * H + h];
            if (used(e)) {
              const int32_t m = pending_m(w), d = pending_d(w);
              if (m + 1 + d == R) short_cycles += m + 1 < R;
              w = m + 1 + d == R ? 0 : pending_word(m + 1, d);
            }
            ASSERT_EQ(cnt->ptr<int32_t>()[e * H + h], w) << "entry " << e << " head " << h << " step " << t;
          }
        }
        // The true state, from copies (the run goes on with its pairs pending).
        Owned sc = clone(*def, dt), kc = clone(*pk, dt), vc = clone(*pv, dt), cc = owned(DType::kI32, {E, H});
        std::memcpy(cc->t.data, cnt->t.data, cnt->t.nbytes());
        cpu::gla_pending_flush(p, *sc, {*kc, *vc, *cc, R}, slots);
        EXPECT_LE(max_rel_error(*sc, *plain), tol) << "step " << t;
        for (int64_t e = 0; e < E; ++e)
          for (int64_t h = 0; h < H; ++h)
            ASSERT_EQ(cc->ptr<int32_t>()[e * H + h], used(e) ? pending_word(0, pending_phase(h, R)) : 0);
      }
    }
    EXPECT_GT(short_cycles, 0) << "no cycle shortened by a phase";
    for (int64_t e : {1, 3})
      EXPECT_TRUE(bitwise_equal(static_cast<Tensor>(*def).select(e), static_cast<Tensor>(*start.s0).select(e)));
    // Nothing pending: the flush leaves the states' bits alone.
    Owned zero = owned(DType::kI32, {E, H});
    Owned before = clone(*def, dt);
    cpu::gla_pending_flush(p, *def, {*pk, *pv, *zero, R}, slots);
    EXPECT_TRUE(bitwise_equal(*def, *before));
  }
}

TEST(GlaDeferred, DecodeTracksRecurrentAndFlushGivesTheTrueStateF64) { check_deferred(DType::kF64, 1e-12); }
TEST(GlaDeferred, DecodeTracksRecurrentAndFlushGivesTheTrueStateF32) { check_deferred(DType::kF32, 1e-5); }

// ---- documents kept apart (GlaParams::doc) --------------------------------------------------
namespace docs {

// Row starts: row 0 at 0, mid-chunk (37), both edges of a 64-token chunk (64, 128), a one-token
// document (128), and a short tail (250 of 300); row 1 continues its initial state up to 100.
const std::vector<std::vector<int64_t>> kStarts = {{0, 37, 64, 128, 129, 250}, {100, 192}};

Owned doc_tensor(int64_t B, int64_t T) {
  Owned d = owned(DType::kI32, {B, T});
  for (int64_t b = 0; b < B; ++b) {
    int32_t cur = -1;
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t s : kStarts[static_cast<size_t>(b)])
        if (s == t) cur = static_cast<int32_t>(t);
      d->ptr<int32_t>()[b * T + t] = cur;
    }
  }
  return d;
}

// The documents of row b as [begin, end, continues the initial state].
std::vector<std::tuple<int64_t, int64_t, bool>> segments(int64_t b, int64_t T) {
  std::vector<int64_t> cuts = {0};
  for (int64_t s : kStarts[static_cast<size_t>(b)])
    if (s > 0) cuts.push_back(s);
  cuts.push_back(T);
  std::vector<std::tuple<int64_t, int64_t, bool>> out;
  for (size_t i = 0; i + 1 < cuts.size(); ++i)
    out.emplace_back(cuts[i], cuts[i + 1], i == 0 && kStarts[static_cast<size_t>(b)].front() != 0);
  return out;
}

// Rows [t0, t1) of batch row b: a [1, t1 − t0, H, d] view.
Tensor rows_of(const Tensor& x, int64_t b, int64_t t0, int64_t t1) { return x.slice(0, b, b + 1).slice(1, t0, t1); }

bool same_bits(const Tensor& a, const Tensor& b) {
  if (a.numel() != b.numel()) return false;
  for (int64_t i = 0; i < a.numel(); ++i) {
    const double x = element_get(a, i), y = element_get(b, i);
    if (std::memcmp(&x, &y, sizeof x) != 0) return false;
  }
  return true;
}

// A packed batch with documents gives, bit for bit, what each document gives run alone (from
// s0 when it continues the row's initial state, else from zero): outputs, final states, and
// every gradient, ∂L/∂S_T flowing into the last document only.
void check_packed_equals_one_by_one(DType dt, GlaForm form) {
  const Dims d{2, 300, 2, 16, 24};
  const Inputs in = random_inputs(d, dt, 404);
  GlaParams p = make_params(form, 64, model_decays(d.H), d.dk);
  const Owned doc = doc_tensor(d.B, d.T);
  GlaParams pd = p;
  pd.doc = *doc;
  const FwdOut packed = run_forward(pd, in, true);
  Owned d_o = owned(dt, {d.B, d.T, d.H, d.dv}), ds_out = owned(dt, {d.B, d.H, d.dk, d.dv});
  testing::fill_uniform(*d_o, 405);
  testing::fill_uniform(*ds_out, 406);
  const Grads g = form == GlaForm::kChunked ? run_backward(pd, in, true, *d_o, *ds_out) : Grads{};
  for (int64_t b = 0; b < d.B; ++b) {
    const auto segs = segments(b, d.T);
    for (size_t i = 0; i < segs.size(); ++i) {
      const auto [t0, t1, from_s0] = segs[i];
      SCOPED_TRACE("row " + std::to_string(b) + " document [" + std::to_string(t0) + ", " + std::to_string(t1) + ")");
      const int64_t n = t1 - t0;
      const Tensor s0 = from_s0 ? in.s0->t.slice(0, b, b + 1) : Tensor{};
      Owned o = owned(dt, {1, n, d.H, d.dv}), s = owned(dt, {1, d.H, d.dk, d.dv});
      cpu::gla_forward(p, rows_of(*in.q, b, t0, t1), rows_of(*in.k, b, t0, t1), rows_of(*in.v, b, t0, t1), *o, s0, *s,
                       Tensor{});
      EXPECT_TRUE(same_bits(*o, rows_of(*packed.o, b, t0, t1)));
      const bool last = i + 1 == segs.size();
      if (last) {
        EXPECT_TRUE(same_bits(*s, packed.s->t.slice(0, b, b + 1)));
      }
      if (form != GlaForm::kChunked) continue;
      Owned dq = owned(dt, {1, n, d.H, d.dk}), dk = owned(dt, {1, n, d.H, d.dk}), dv = owned(dt, {1, n, d.H, d.dv}),
            ds = owned(dt, {1, d.H, d.dk, d.dv});
      cpu::gla_backward(p, rows_of(*in.q, b, t0, t1), rows_of(*in.k, b, t0, t1), rows_of(*in.v, b, t0, t1), s0,
                        rows_of(*d_o, b, t0, t1), last ? ds_out->t.slice(0, b, b + 1) : Tensor{}, *dq, *dk, *dv, *ds);
      EXPECT_TRUE(same_bits(*dq, rows_of(*g.dq, b, t0, t1)));
      EXPECT_TRUE(same_bits(*dk, rows_of(*g.dk, b, t0, t1)));
      EXPECT_TRUE(same_bits(*dv, rows_of(*g.dv, b, t0, t1)));
      if (i == 0) {
        const Tensor packed_ds = g.ds->t.slice(0, b, b + 1);
        if (from_s0) {
          EXPECT_TRUE(same_bits(*ds, packed_ds));
        } else {
          for (int64_t e = 0; e < packed_ds.numel(); ++e) EXPECT_EQ(element_get(packed_ds, e), 0.0);
        }
      }
    }
  }
}

}  // namespace docs

TEST(GlaDocuments, PackedEqualsOneByOneChunkedF64) { docs::check_packed_equals_one_by_one(DType::kF64, GlaForm::kChunked); }
TEST(GlaDocuments, PackedEqualsOneByOneChunkedF32) { docs::check_packed_equals_one_by_one(DType::kF32, GlaForm::kChunked); }
TEST(GlaDocuments, PackedEqualsOneByOneRecurrentF32) {
  docs::check_packed_equals_one_by_one(DType::kF32, GlaForm::kRecurrent);
}

// An independent statement of the semantics: S_t = (t starts a document ? 0 : λ S_{t−1}) + k_tᵀ v_t,
// o_t = scale·q_t S_t, written as plain loops in F64, against the chunked form with documents.
TEST(GlaDocuments, ChunkedMatchesTheRecurrenceWithResets) {
  const Dims d{2, 300, 2, 8, 12};
  const Inputs in = random_inputs(d, DType::kF64, 77);
  GlaParams p = make_params(GlaForm::kChunked, 64, fast_decays(d.H), d.dk);
  p.decay = {0.97, 0.999};
  const Owned doc = docs::doc_tensor(d.B, d.T);
  p.doc = *doc;
  const FwdOut r = run_forward(p, in, true);
  double worst = 0;
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t h = 0; h < d.H; ++h) {
      std::vector<double> S(d.dk * d.dv);
      for (int64_t i = 0; i < d.dk * d.dv; ++i) S[i] = element_get(*in.s0, (b * d.H + h) * d.dk * d.dv + i);
      for (int64_t t = 0; t < d.T; ++t) {
        const bool start = doc->ptr<int32_t>()[b * d.T + t] == t;
        const auto at = [&](const Tensor& x, int64_t dim, int64_t i) {
          return element_get(x, ((b * d.T + t) * d.H + h) * dim + i);
        };
        for (int64_t a = 0; a < d.dk; ++a)
          for (int64_t c = 0; c < d.dv; ++c)
            S[a * d.dv + c] = (start ? 0.0 : p.decay[h] * S[a * d.dv + c]) + at(*in.k, d.dk, a) * at(*in.v, d.dv, c);
        for (int64_t c = 0; c < d.dv; ++c) {
          double o = 0;
          for (int64_t a = 0; a < d.dk; ++a) o += p.scale * at(*in.q, d.dk, a) * S[a * d.dv + c];
          const double got = at(*r.o, d.dv, c);
          worst = std::max(worst, std::fabs(got - o) / std::max(1.0, std::fabs(o)));
        }
      }
    }
  EXPECT_LE(worst, 1e-12);
}

}  // namespace
}  // namespace laplace
