// The inference engine (serve/engine.h) on the CPU backend with a small random F32
// model: greedy tokens equal generate() (mixed batches, prompts longer than the prefill
// chunk, staggered submissions), batch invariance, queueing on a full pool, cancel,
// stop rules, seeded sampling, slot accounting, the per-step token budget, threads.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <random>
#include <thread>
#include <tuple>

#include "model/model.h"
#include "serve/engine.h"
#include "serve/generate.h"
#include "tests/test_util.h"

namespace laplace {
namespace {

using testing::random_tokens;
using testing::small_config;

SamplingOptions greedy() {
  SamplingOptions s;
  s.temperature = 0;
  return s;
}

SamplingOptions sampled(uint64_t seed) {
  SamplingOptions s;
  s.temperature = 0.9;
  s.top_k = 20;
  s.top_p = 0.95;
  s.min_p = 0.02;
  s.presence_penalty = 0.3;
  s.frequency_penalty = 0.2;
  s.repetition_penalty = 1.1;
  s.seed = seed;
  return s;
}

std::vector<char> bytes_of(const Tensor& t) {
  const char* p = static_cast<const char*>(t.data);
  return std::vector<char>(p, p + t.nbytes());
}

// The CPU backend with its gemm made row-invariant by construction (one call per row of
// op(a)): a second way to the property, independent of the backend's own row-invariant
// products, for the tests that check a sequence's decode bits across batch compositions
// (the engine itself: scheduling, slot indexing, padding).
class RowGemmBackend : public Backend {
 public:
  RowGemmBackend() : cpu_(make_cpu_backend()) {}
  Device device() const override { return cpu_->device(); }
  const char* name() const override { return "cpu-rowgemm"; }
  Allocator& allocator() override { return cpu_->allocator(); }
  bool supports(const OpQuery& q) const override { return cpu_->supports(q); }
  void copy(Tensor dst, const Tensor& src) override { cpu_->copy(dst, src); }
  void fill(Tensor dst, double v) override { cpu_->fill(dst, v); }
  void axpy(double a, const Tensor& x, Tensor y) override { cpu_->axpy(a, x, y); }
  void synchronize() override { cpu_->synchronize(); }
  void gemm(const Tensor& a, bool ta, const Tensor& b, bool tb, Tensor c, double alpha, double beta) override {
    if (ta) return cpu_->gemm(a, ta, b, tb, c, alpha, beta);
    for (int64_t m = 0; m < c.shape[0]; ++m) cpu_->gemm(a.slice(0, m, m + 1), ta, b, tb, c.slice(0, m, m + 1), alpha, beta);
  }
  void embedding_forward(const Tensor& i, const Tensor& t, Tensor o) override { cpu_->embedding_forward(i, t, o); }
  void embedding_backward(const Tensor& i, const Tensor& d, Tensor t) override { cpu_->embedding_backward(i, d, t); }
  void layernorm_forward(const Tensor& x, const Tensor& w, const Tensor& b, double eps, Tensor y, Tensor mean,
                         Tensor rstd) override {
    cpu_->layernorm_forward(x, w, b, eps, y, mean, rstd);
  }
  void layernorm_backward(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& mean, const Tensor& rstd,
                          Tensor dx, bool acc, Tensor dw, Tensor db) override {
    cpu_->layernorm_backward(dy, x, w, mean, rstd, dx, acc, dw, db);
  }
  void conv_silu_forward(const Tensor& u, const Tensor& w, Tensor c, Tensor pre, const Tensor& wi, Tensor wo,
                         const Tensor& slots, const Tensor& doc) override {
    cpu_->conv_silu_forward(u, w, c, pre, wi, wo, slots, doc);
  }
  void conv_silu_backward(const Tensor& dc, const Tensor& u, const Tensor& w, const Tensor& pre, Tensor du,
                          Tensor dw, const Tensor& doc) override {
    cpu_->conv_silu_backward(dc, u, w, pre, du, dw, doc);
  }
  void gla_forward(const GlaParams& p, const Tensor& q, const Tensor& k, const Tensor& v, Tensor o, const Tensor& si,
                   Tensor so, const Tensor& slots) override {
    cpu_->gla_forward(p, q, k, v, o, si, so, slots);
  }
  void gla_decode_gate_deferred(const GlaParams& p, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                const Tensor& w, double eps, Tensor st, const GlaPending& pend, const Tensor& slots,
                                Tensor o, Tensor y) override {
    cpu_->gla_decode_gate_deferred(p, q, k, v, g, w, eps, st, pend, slots, o, y);
  }
  void gla_pending_flush(const GlaParams& p, Tensor st, const GlaPending& pend, const Tensor& slots) override {
    cpu_->gla_pending_flush(p, st, pend, slots);
  }
  void gla_backward(const GlaParams& p, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& si,
                    const Tensor& d_o, const Tensor& dso, Tensor dq, Tensor dk, Tensor dv, Tensor dsi) override {
    cpu_->gla_backward(p, q, k, v, si, d_o, dso, dq, dk, dv, dsi);
  }
  void rmsnorm_gate_forward(const Tensor& o, const Tensor& g, const Tensor& w, double eps, Tensor y,
                            Tensor rstd) override {
    cpu_->rmsnorm_gate_forward(o, g, w, eps, y, rstd);
  }
  void rmsnorm_gate_backward(const Tensor& dy, const Tensor& o, const Tensor& g, const Tensor& w, const Tensor& rstd,
                             Tensor d_o, Tensor dg, Tensor dw) override {
    cpu_->rmsnorm_gate_backward(dy, o, g, w, rstd, d_o, dg, dw);
  }
  void swiglu_forward(const Tensor& ab, Tensor h) override { cpu_->swiglu_forward(ab, h); }
  void swiglu_backward(const Tensor& dh, const Tensor& ab, Tensor dab) override { cpu_->swiglu_backward(dh, ab, dab); }
  void cross_entropy_forward(const Tensor& l, const Tensor& t, Tensor out) override {
    cpu_->cross_entropy_forward(l, t, out);
  }
  void cross_entropy_backward(const Tensor& l, const Tensor& t, double s, Tensor d) override {
    cpu_->cross_entropy_backward(l, t, s, d);
  }
  double sum_squares(const Tensor& x) override { return cpu_->sum_squares(x); }
  void argmax_rows(const Tensor& x, Tensor o) override { cpu_->argmax_rows(x, o); }
  void row_sum_squares(const Tensor& x, Tensor out) override { cpu_->row_sum_squares(x, out); }
  void scale(Tensor x, double a) override { cpu_->scale(x, a); }
  void adamw_update(Tensor w, const Tensor& g, Tensor m, Tensor v, const AdamWParams& p) override {
    cpu_->adamw_update(w, g, m, v, p);
  }
  void muon_momentum(const Tensor& g, Tensor m, Tensor u, double mu, bool n) override {
    cpu_->muon_momentum(g, m, u, mu, n);
  }
  void muon_apply(Tensor w, const Tensor& o, double lr, double wd, double s) override {
    cpu_->muon_apply(w, o, lr, wd, s);
  }
  void sum_squares_into(const Tensor& x, Tensor acc, bool a) override { cpu_->sum_squares_into(x, acc, a); }
  void grad_clip_scalars(const Tensor& ss, double mx, Tensor out) override { cpu_->grad_clip_scalars(ss, mx, out); }
  void scale_by(Tensor x, const Tensor& c) override { cpu_->scale_by(x, c); }
  void scale_by_inv_norm(Tensor x, const Tensor& ss, double eps) override { cpu_->scale_by_inv_norm(x, ss, eps); }
  void adamw_update_gated(Tensor w, const Tensor& g, Tensor m, Tensor v, const AdamWParams& p,
                          const Tensor& skip) override { cpu_->adamw_update_gated(w, g, m, v, p, skip); }
  void muon_momentum_gated(const Tensor& g, Tensor m, Tensor u, double mu, bool n, const Tensor& skip) override {
    cpu_->muon_momentum_gated(g, m, u, mu, n, skip);
  }
  void muon_apply_gated(Tensor w, const Tensor& o, double lr, double wd, double s, const Tensor& skip) override {
    cpu_->muon_apply_gated(w, o, lr, wd, s, skip);
  }
  void loss_sum_into(const Tensor& l, double count, Tensor acc, bool a) override { cpu_->loss_sum_into(l, count, acc, a); }

 private:
  std::unique_ptr<Backend> cpu_;
};

// What the engine reported for one request.
struct Outcome {
  std::vector<int32_t> tokens;
  FinishInfo info;
  int finishes = 0;
  std::vector<char> state;  // the slot's state when it finished
};

// A model, an engine on it, and the outcomes of requests submitted through add().
struct Rig {
  std::unique_ptr<Backend> be = make_cpu_backend();
  Config c = small_config();
  Model m;
  std::unique_ptr<Engine> eng;
  std::map<RequestId, Outcome> out;

  explicit Rig(EngineOptions o, uint64_t weight_seed = 7, Config cfg = small_config(), bool row_gemm = false)
      : c(cfg) {
    if (row_gemm) be = std::make_unique<RowGemmBackend>();
    EXPECT_TRUE(m.create(c, *be, DType::kF32).is_ok());
    m.init_weights(weight_seed);
    Status st = Engine::create(m, o, &eng);
    EXPECT_TRUE(st.is_ok()) << st.to_string();
  }

  Request make(const std::vector<int32_t>& prompt, int64_t max_tokens, SamplingOptions so = greedy()) {
    Request r;
    r.prompt = prompt;
    r.max_tokens = max_tokens;
    r.sampling = so;
    r.on_token = [this](RequestId id, int32_t t) { out[id].tokens.push_back(t); };
    r.on_finish = [this](const FinishInfo& f) {
      Outcome& o = out[f.id];
      o.info = f;
      ++o.finishes;
      if (f.slot >= 0 && f.reason != FinishReason::kCancelled) o.state = bytes_of(eng->pool().slot(f.slot));
    };
    return r;
  }
  RequestId add(Request r) {
    RequestId id = 0;
    Status st = eng->submit(std::move(r), &id);
    EXPECT_TRUE(st.is_ok()) << st.to_string();
    return id;
  }
  RequestId add(const std::vector<int32_t>& prompt, int64_t max_tokens, SamplingOptions so = greedy()) {
    return add(make(prompt, max_tokens, so));
  }

  // generate() on the same model (its plan's max_seq = the engine's prefill_chunk, so
  // the prompt is prefilled in the same pieces). Returns tokens and the final state.
  std::pair<std::vector<int32_t>, std::vector<char>> reference(const std::vector<int32_t>& prompt,
                                                               int64_t max_tokens, SamplingOptions so = greedy(),
                                                               std::vector<int32_t> stop = {}) {
    StatePool pool;
    EXPECT_TRUE(pool.create(c, *be, 1).is_ok());
    GenerateOptions g;
    g.max_tokens = max_tokens;
    g.sampling = so;
    g.stop_ids = std::move(stop);
    auto toks = generate(m, pool, 0, prompt, g);
    return {toks, bytes_of(pool.slot(0))};
  }
};

// Does the backend's gemm give a row the same bits whatever the number of rows (M) and
// the row's position? Batch invariance of decode needs it; OpenBLAS does not promise it.
bool gemm_rows_invariant(Backend& be, const Config& c) {
  const int64_t shapes[][2] = {{c.qkvg_rows(), c.hidden_size}, {c.hidden_size, c.v_dim()},
                               {2 * c.ffn_size, c.hidden_size}, {c.hidden_size, c.ffn_size},
                               {c.vocab_size, c.hidden_size}};
  for (const auto& s : shapes) {
    const int64_t N = s[0], K = s[1], M = 12;
    testing::OwnedTensor w(DType::kF32, {N, K}), a(DType::kF32, {M, K}), cm(DType::kF32, {M, N}),
        c1(DType::kF32, {1, N});
    testing::fill_uniform(w, 1);
    testing::fill_uniform(a, 2);
    be.gemm(a, false, w, true, cm, 1.0, 0.0);
    for (int64_t r = 0; r < M; ++r) {
      Tensor row = static_cast<Tensor>(a).slice(0, r, r + 1);
      be.gemm(row, false, w, true, c1, 1.0, 0.0);
      if (std::memcmp(static_cast<Tensor>(cm).select(r).data, static_cast<Tensor>(c1).data, N * sizeof(float)))
        return false;
    }
  }
  return true;
}

EngineOptions opts(int64_t slots, int64_t chunk = 8, int64_t budget = 64) {
  EngineOptions o;
  o.max_slots = slots;
  o.prefill_chunk = chunk;
  o.max_batch_tokens = budget;
  return o;
}

// ---- correctness against generate() ----------------------------------------------------

// Prompts of several lengths (1 token, shorter and longer than the prefill chunk) in
// mixed batches, more requests than slots, staggered submissions: every greedy token
// equals generate()'s.
// With the row-invariant gemm the final states are bitwise generate()'s too.
class EngineGreedy : public ::testing::TestWithParam<bool> {};

TEST_P(EngineGreedy, MatchesGenerateTokenForToken) {
  Rig r(opts(3, 8, 20), 7, small_config(), GetParam());
  const int64_t lens[] = {1, 5, 8, 17, 30, 9, 40};
  const int64_t maxt[] = {12, 20, 7, 15, 25, 9, 18};
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 7; ++i) prompts.push_back(random_tokens(lens[i], r.c.vocab_size, 100 + i));
  std::vector<RequestId> ids;
  for (int i = 0; i < 4; ++i) ids.push_back(r.add(prompts[i], maxt[i]));
  // Stagger: the rest arrive while the first ones run.
  for (int s = 0; s < 3; ++s) r.eng->step();
  ids.push_back(r.add(prompts[4], maxt[4]));
  for (int s = 0; s < 5; ++s) r.eng->step();
  ids.push_back(r.add(prompts[5], maxt[5]));
  ids.push_back(r.add(prompts[6], maxt[6]));
  r.eng->run_until_idle();

  const bool gemm_ok = gemm_rows_invariant(*r.be, r.c);
  if (GetParam()) {
    EXPECT_TRUE(gemm_ok);
  }
  for (int i = 0; i < 7; ++i) {
    auto [ref, ref_state] = r.reference(prompts[i], maxt[i]);
    const Outcome& o = r.out[ids[i]];
    EXPECT_EQ(o.tokens, ref) << "request " << i << " (prompt " << lens[i] << ")";
    EXPECT_EQ(o.finishes, 1);
    EXPECT_EQ(o.info.reason, FinishReason::kLength);
    EXPECT_EQ(o.info.generated_tokens, maxt[i]);
    EXPECT_EQ(o.info.prompt_tokens, lens[i]);
    ASSERT_EQ(o.state.size(), ref_state.size());
    if (gemm_ok) {
      EXPECT_EQ(o.state, ref_state) << "request " << i;
    }
    // With maxt ≥ 2 the state went through batched decode steps; it stays within F32
    // rounding of generate()'s even when the gemm is not batch-invariant.
    Tensor a(const_cast<char*>(o.state.data()), DType::kF32, {static_cast<int64_t>(o.state.size() / 4)});
    Tensor b(const_cast<char*>(ref_state.data()), DType::kF32, {static_cast<int64_t>(ref_state.size() / 4)});
    EXPECT_LE(testing::max_rel_error(a, b), 1e-5) << "request " << i;
  }
  const EngineStats s = r.eng->stats();
  int64_t prompt_total = 0, gen_total = 0;
  for (int i = 0; i < 7; ++i) prompt_total += lens[i], gen_total += maxt[i];
  EXPECT_EQ(s.prefill_tokens, prompt_total);
  EXPECT_EQ(s.generated_tokens, gen_total);
  EXPECT_EQ(s.decode_tokens, gen_total - 7);  // the first token of each comes from its prefill
  EXPECT_EQ(s.submitted, 7);
  EXPECT_EQ(s.finished, 7);
  EXPECT_EQ(s.running, 0);
  EXPECT_EQ(s.free_slots, 3);
}

INSTANTIATE_TEST_SUITE_P(Engine, EngineGreedy, ::testing::Values(false, true),
                         [](const auto& info) { return std::string(info.param ? "RowByRow" : "CpuBackend"); });

// Device greedy (the executor's argmax, no logits to the host) against host sampling of
// the same logits: the same tokens, the same final states and the same final-state logits
// (fetched one row at a time when a request finishes); a batch with one sampled request
// falls back to host sampling for that step, and both agree there too.
TEST(EngineDeviceGreedy, SameTokensStatesAndFinalLogitsAsHostSampling) {
  auto run = [](bool device_greedy, bool with_sampled) {
    EngineOptions o = opts(4, 8, 40);
    o.device_greedy = device_greedy;
    Rig r(o);
    std::vector<RequestId> ids;
    std::map<RequestId, SnapshotPtr> finals;
    for (int i = 0; i < 5; ++i) {
      Request q = r.make(random_tokens(3 + 4 * i, r.c.vocab_size, 300 + i), 9 + i,
                         with_sampled && i == 2 ? sampled(11) : greedy());
      q.capture_final_state = true;
      auto prev = q.on_finish;
      q.on_finish = [prev, &finals](const FinishInfo& f) {
        prev(f);
        finals[f.id] = f.final_state;
      };
      ids.push_back(r.add(std::move(q)));
    }
    r.eng->run_until_idle();
    std::vector<std::pair<Outcome, SnapshotPtr>> res;
    for (RequestId id : ids) res.push_back({r.out[id], finals[id]});
    return res;
  };
  for (bool with_sampled : {false, true}) {
    SCOPED_TRACE(with_sampled ? "one sampled request" : "all greedy");
    const auto host = run(false, with_sampled), dev = run(true, with_sampled);
    ASSERT_EQ(host.size(), dev.size());
    for (size_t i = 0; i < host.size(); ++i) {
      EXPECT_EQ(host[i].first.tokens, dev[i].first.tokens) << "request " << i;
      EXPECT_EQ(host[i].first.state, dev[i].first.state) << "request " << i;
      ASSERT_TRUE(host[i].second && dev[i].second) << "request " << i;
      EXPECT_EQ(host[i].second->logits, dev[i].second->logits) << "request " << i;
      EXPECT_EQ(host[i].second->tokens, dev[i].second->tokens) << "request " << i;
    }
  }
}

// argmax_rows: ties go to the lowest index, like the host sampler's argmax.
TEST(EngineDeviceGreedy, ArgmaxRowsTiesGoToTheLowestIndex) {
  auto be = make_cpu_backend();
  testing::OwnedTensor x(DType::kF32, {3, 7});
  const float v[3][7] = {{1, 5, 2, 5, 0, 5, 1}, {-3, -2, -2, -9, -1, -1, -4}, {0, 0, 0, 0, 0, 0, 0}};
  for (int r = 0; r < 3; ++r)
    for (int c = 0; c < 7; ++c) static_cast<float*>(static_cast<Tensor>(x).data)[r * 7 + c] = v[r][c];
  testing::OwnedTensor out(DType::kI32, {3});
  be->argmax_rows(x, out);
  const int32_t* o = static_cast<const int32_t*>(static_cast<Tensor>(out).data);
  for (int r = 0; r < 3; ++r) EXPECT_EQ(o[r], argmax(v[r], 7)) << "row " << r;
  EXPECT_EQ(o[0], 1);
  EXPECT_EQ(o[1], 4);
  EXPECT_EQ(o[2], 0);
}

// ---- batch invariance ---------------------------------------------------------------------

// Prefill pieces depend on the prompt alone, so the state after prefill (and the first
// token) are bitwise identical whatever else is in the batch.
TEST(EngineBatchInvariance, PrefillStateBitwiseAcrossCompositions) {
  Config c = small_config();
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 5; ++i) prompts.push_back(random_tokens(3 + 9 * i, c.vocab_size, 200 + i));
  std::vector<std::vector<char>> alone;
  std::vector<int32_t> alone_tok;
  for (int i = 0; i < 5; ++i) {
    Rig r(opts(1, 8, 16));
    RequestId id = r.add(prompts[i], 1);
    r.eng->run_until_idle();
    alone.push_back(r.out[id].state);
    alone_tok.push_back(r.out[id].tokens.at(0));
  }
  // All together (reverse order, other slots), under a tighter budget.
  Rig r(opts(4, 8, 12));
  std::vector<RequestId> ids;
  for (int i = 4; i >= 0; --i) ids.insert(ids.begin(), r.add(prompts[i], 1));
  r.eng->run_until_idle();
  for (int i = 0; i < 5; ++i) {
    EXPECT_EQ(r.out[ids[i]].state, alone[i]) << "prompt " << i;
    EXPECT_EQ(r.out[ids[i]].tokens.at(0), alone_tok[i]);
  }
}

// Decode: a sequence's tokens and final state do not depend on which sequences share its
// batch, nor on the padded width: tokens and state bytes, with the CPU backend (its x·Wᵀ
// products are row-invariant, ops/cpu/gemm_rows.h) and with RowGemmBackend (one product per
// row, the property by construction).
class EngineDecodeInvariance : public ::testing::TestWithParam<bool> {};

TEST_P(EngineDecodeInvariance, TokensAndStatesAcrossCompositions) {
  const bool row_gemm = GetParam();
  Config c = small_config();
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 6; ++i) prompts.push_back(random_tokens(2 + 7 * i, c.vocab_size, 300 + i));
  const int64_t T = 24;
  struct Run {
    std::vector<int32_t> tokens;
    std::vector<char> state;
  };
  auto run = [&](const std::vector<int>& which, EngineOptions o, int stagger) {
    Rig r(o, 7, c, row_gemm);
    std::map<int, RequestId> ids;
    for (int i : which) {
      ids[i] = r.add(prompts[i], T);
      for (int s = 0; s < stagger; ++s) r.eng->step();
    }
    r.eng->run_until_idle();
    std::map<int, Run> res;
    for (auto [i, id] : ids) res[i] = {r.out[id].tokens, r.out[id].state};
    return res;
  };
  std::map<int, Run> alone;
  for (int i = 0; i < 6; ++i) alone[i] = run({i}, opts(1), 0)[i];
  EngineOptions padded = opts(6);
  padded.decode_widths = {2, 4, 8};
  const std::vector<std::pair<std::vector<int>, EngineOptions>> mixes = {
      {{0, 1, 2, 3, 4, 5}, opts(6)},   // all at once
      {{5, 3, 1}, opts(2)},            // queued behind a 2-slot pool
      {{2, 0, 4, 1}, padded},          // padded widths 2/4/8
      {{1, 5, 0, 2, 4, 3}, opts(3, 8, 9)},
  };
  std::unique_ptr<Backend> be = row_gemm ? std::make_unique<RowGemmBackend>() : make_cpu_backend();
  EXPECT_TRUE(gemm_rows_invariant(*be, c));
  for (size_t m = 0; m < mixes.size(); ++m) {
    for (int stagger : {0, 3}) {
      auto res = run(mixes[m].first, mixes[m].second, stagger);
      for (auto& [i, got] : res) {
        EXPECT_EQ(got.tokens, alone[i].tokens) << "mix " << m << " stagger " << stagger << " prompt " << i;
        EXPECT_EQ(got.state, alone[i].state) << "mix " << m << " stagger " << stagger << " prompt " << i;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Engine, EngineDecodeInvariance, ::testing::Values(false, true),
                         [](const auto& info) { return std::string(info.param ? "RowByRow" : "CpuBackend"); });

// The property decode batch invariance rests on: a gemm row's bits do not depend on how
// many rows the call has. The CPU backend's x·Wᵀ products (ops/cpu/gemm_rows.h) guarantee it;
// OpenBLAS's sgemm, used before, did not (docs/serving.md, 'Batch invariance').
TEST(EngineBatchInvariance, CpuGemmRowInvariance) {
  auto be = make_cpu_backend();
  EXPECT_TRUE(gemm_rows_invariant(*be, small_config()));
  EXPECT_TRUE(gemm_rows_invariant(*be, small_config(32, 64, 4)));
}

// ---- queueing, cancel, stop rules -----------------------------------------------------------

TEST(EngineQueue, FullPoolQueuesAndAllComplete) {
  Rig r(opts(2, 8, 32));
  std::vector<std::vector<int32_t>> prompts;
  std::vector<RequestId> ids;
  for (int i = 0; i < 7; ++i) {
    prompts.push_back(random_tokens(4 + 3 * i, r.c.vocab_size, 400 + i));
    ids.push_back(r.add(prompts.back(), 6 + i));
  }
  EXPECT_EQ(r.eng->stats().queued, 7);
  int64_t max_running = 0;
  while (!r.eng->idle()) {
    r.eng->step();
    const EngineStats s = r.eng->stats();
    max_running = std::max(max_running, s.running);
    EXPECT_EQ(s.running + s.free_slots, 2);
    EXPECT_EQ(s.queued + s.running + s.finished, 7);
  }
  EXPECT_EQ(max_running, 2);
  for (int i = 0; i < 7; ++i) {
    EXPECT_EQ(r.out[ids[i]].tokens, r.reference(prompts[i], 6 + i).first) << "request " << i;
    EXPECT_EQ(r.out[ids[i]].finishes, 1);
    EXPECT_GE(r.out[ids[i]].info.admit_time, r.out[ids[i]].info.submit_time);
    EXPECT_GE(r.out[ids[i]].info.ttft(), 0);
  }
}

TEST(EngineCancel, FreesSlotAtOnceAndQueuedRequestTakesIt) {
  Rig r(opts(2, 8, 32));
  auto p0 = random_tokens(10, r.c.vocab_size, 1), p1 = random_tokens(12, r.c.vocab_size, 2),
       p2 = random_tokens(7, r.c.vocab_size, 3), p3 = random_tokens(5, r.c.vocab_size, 4);
  RequestId a = r.add(p0, 50), b = r.add(p1, 50), q = r.add(p2, 10), gone = r.add(p3, 10);
  for (int s = 0; s < 4; ++s) r.eng->step();
  EngineStats s = r.eng->stats();
  EXPECT_EQ(s.running, 2);
  EXPECT_EQ(s.queued, 2);
  EXPECT_EQ(s.free_slots, 0);

  // A queued request leaves the queue at once and is never admitted.
  EXPECT_TRUE(r.eng->cancel(gone));
  EXPECT_EQ(r.eng->stats().queued, 1);
  // A running one frees its slot at once.
  const size_t a_tokens = r.out[a].tokens.size();
  EXPECT_TRUE(r.eng->cancel(a));
  s = r.eng->stats();
  EXPECT_EQ(s.free_slots, 1);
  EXPECT_EQ(s.running, 1);
  EXPECT_FALSE(r.eng->cancel(a));        // already cancelled
  EXPECT_FALSE(r.eng->cancel(987654));   // unknown
  // The next step admits the queued request into the freed slot and delivers on_finish.
  r.eng->step();
  s = r.eng->stats();
  EXPECT_EQ(s.queued, 0);
  EXPECT_EQ(s.running, 2);
  EXPECT_EQ(r.out[a].finishes, 1);
  EXPECT_EQ(r.out[a].info.reason, FinishReason::kCancelled);
  EXPECT_EQ(r.out[a].tokens.size(), a_tokens);  // nothing after cancel
  EXPECT_EQ(r.out[gone].finishes, 1);
  EXPECT_EQ(r.out[gone].info.reason, FinishReason::kCancelled);
  EXPECT_EQ(r.out[gone].info.slot, -1);
  EXPECT_TRUE(r.out[gone].tokens.empty());
  EXPECT_EQ(r.out[q].info.slot, -1);  // not finished yet
  // Cancel from inside a callback (during a step): freed at the end of that step.
  int seen = 0;
  r.eng->step();
  Request cb = r.make(p3, 40);
  RequestId self = 0;
  auto inner = cb.on_token;
  cb.on_token = [&, inner](RequestId id, int32_t t) {
    inner(id, t);
    if (++seen == 3) {
      EXPECT_TRUE(r.eng->cancel(id));
    }
  };
  self = r.add(std::move(cb));
  r.eng->run_until_idle();
  EXPECT_EQ(r.out[self].info.reason, FinishReason::kCancelled);
  EXPECT_EQ(r.out[self].tokens.size(), 3u);
  // The queued request reused a cancelled sequence's slot (reset on admission) and is exact.
  EXPECT_EQ(r.out[q].tokens, r.reference(p2, 10).first);
  EXPECT_EQ(r.out[b].tokens, r.reference(p1, 50).first);
  s = r.eng->stats();
  EXPECT_EQ(s.cancelled, 3);
  EXPECT_EQ(s.finished, 5);
  EXPECT_EQ(s.free_slots, 2);
}

// Pipelined decode (EngineOptions::pipeline): a step that leaves the next one's batch
// unchanged queues it before emitting. The same script with and without it: requests
// submitted between steps, one cancelled between steps while a decode is queued for it, one
// cancelled from its own callback, a stop id: the same tokens, finish reasons and final
// states byte for byte, the cancelled ones getting no token after cancel(), and the
// pipelined run did queue decodes ahead (on the CPU the "queued" forward runs at once; the
// bookkeeping is what this checks; CudaModel.* checks the GPU's).
TEST(EnginePipeline, QueuedAheadGivesTheUnpipelinedTokensStatesAndFinishes) {
  auto script = [](bool pipeline) {
    EngineOptions o = opts(3, 8, 32);
    o.pipeline = pipeline;
    auto r = std::make_unique<Rig>(o);
    std::vector<RequestId> ids;
    for (int i = 0; i < 3; ++i) ids.push_back(r->add(random_tokens(5 + 4 * i, r->c.vocab_size, 20 + i), 30 + 7 * i));
    Request cb = r->make(random_tokens(9, r->c.vocab_size, 30), 40);
    auto inner = cb.on_token;
    Engine* eng = r->eng.get();
    int seen = 0;
    cb.on_token = [&seen, eng, inner](RequestId id, int32_t t) {
      inner(id, t);
      if (++seen == 12) {
        EXPECT_TRUE(eng->cancel(id));
      }
    };
    ids.push_back(r->add(std::move(cb)));  // queued until a slot frees
    size_t cancelled_at = 0;
    int64_t chained_before_17 = 0, chained_after_17 = 0;
    for (int step = 0; !r->eng->idle(); ++step) {
      if (step == 17) chained_before_17 = r->eng->stats().chained_decodes;
      if (step == 18) chained_after_17 = r->eng->stats().chained_decodes;
      if (step == 14) {
        Request st = r->make(random_tokens(6, r->c.vocab_size, 31), 25);
        st.stop_ids = {r->out[ids[0]].tokens.empty() ? 0 : r->out[ids[0]].tokens[0]};
        ids.push_back(r->add(std::move(st)));
      }
      if (step == 18) {
        cancelled_at = r->out[ids[1]].tokens.size();
        EXPECT_TRUE(r->eng->cancel(ids[1]));
      }
      r->eng->step();
    }
    EXPECT_EQ(r->out[ids[1]].tokens.size(), cancelled_at);  // nothing after cancel()
    EXPECT_EQ(r->out[ids[1]].info.reason, FinishReason::kCancelled);
    EXPECT_EQ(r->out[ids[3]].tokens.size(), 12u);
    // With the pipeline, step 17 queued step 18's decode, so the cancel at 18 came with
    // request 2's row already queued.
    EXPECT_EQ(chained_after_17 - chained_before_17, pipeline ? 1 : 0);
    return r;
  };
  const auto on = script(true), off = script(false);
  EXPECT_GT(on->eng->stats().chained_decodes, 10);
  EXPECT_EQ(off->eng->stats().chained_decodes, 0);
  // The time spent queueing ahead is counted (on the CPU the chained forward runs inside it)
  // and is part of the decode time; without the pipeline there is none.
  EXPECT_GT(on->eng->stats().chain_seconds, 0.0);
  EXPECT_LE(on->eng->stats().chain_seconds, on->eng->stats().decode_seconds);
  EXPECT_EQ(off->eng->stats().chain_seconds, 0.0);
  EXPECT_EQ(on->eng->stats().generated_tokens, off->eng->stats().generated_tokens);
  ASSERT_EQ(on->out.size(), 5u);
  ASSERT_EQ(off->out.size(), 5u);
  for (const auto& [id, o] : off->out) {
    SCOPED_TRACE(id);
    const Outcome& p = on->out.at(id);
    EXPECT_EQ(p.tokens, o.tokens);
    EXPECT_EQ(p.finishes, 1);
    EXPECT_EQ(p.info.reason, o.info.reason);
    EXPECT_EQ(p.info.generated_tokens, o.info.generated_tokens);
    EXPECT_TRUE(p.state == o.state) << "final state bytes differ";
  }
}

TEST(EngineStop, StopIdsEosAndMaxTokens) {
  Config c = small_config();
  c.eos_token_id = -1;
  Rig r(opts(3), 7, c);
  auto prompt = random_tokens(9, c.vocab_size, 11);
  auto ref = r.reference(prompt, 30).first;
  // A token that first appears at position k > 0 of the greedy continuation.
  size_t k = 1;
  while (k < ref.size() && std::find(ref.begin(), ref.begin() + k, ref[k]) != ref.begin() + k) ++k;
  ASSERT_LT(k, ref.size()) << "no repeated-free token to stop on";
  const int32_t stop = ref[k];
  const size_t first = std::find(ref.begin(), ref.end(), stop) - ref.begin();
  const std::vector<int32_t> upto(ref.begin(), ref.begin() + first + 1);

  Request rs = r.make(prompt, 30);
  rs.stop_ids = {999, stop};
  RequestId s_id = r.add(std::move(rs));
  Request re = r.make(prompt, 30);
  re.eos_id = stop;
  RequestId e_id = r.add(std::move(re));
  RequestId l_id = r.add(prompt, 3);
  r.eng->run_until_idle();
  EXPECT_EQ(r.out[s_id].tokens, upto);
  EXPECT_EQ(r.out[s_id].info.reason, FinishReason::kStop);
  EXPECT_EQ(r.out[e_id].tokens, upto);
  EXPECT_EQ(r.out[e_id].info.reason, FinishReason::kEos);
  EXPECT_EQ(r.out[l_id].tokens, std::vector<int32_t>(ref.begin(), ref.begin() + 3));
  EXPECT_EQ(r.out[l_id].info.reason, FinishReason::kLength);
  EXPECT_EQ(r.out[l_id].info.generated_tokens, 3);

  // The config's eos_token_id is the default; eos_id = -1 turns it off.
  Config ce = small_config();
  ce.eos_token_id = stop;
  Rig r2(opts(2), 7, ce);
  RequestId d_id = r2.add(prompt, 30);
  Request off = r2.make(prompt, 30);
  off.eos_id = -1;
  RequestId o_id = r2.add(std::move(off));
  r2.eng->run_until_idle();
  EXPECT_EQ(r2.out[d_id].tokens, upto);
  EXPECT_EQ(r2.out[d_id].info.reason, FinishReason::kEos);
  EXPECT_EQ(r2.out[o_id].tokens, ref);
  EXPECT_EQ(r2.out[o_id].info.reason, FinishReason::kLength);
}

TEST(EngineRequest, InvalidRequestsAreRejected) {
  Rig r(opts(1));
  RequestId id = 0;
  Request empty;
  EXPECT_EQ(r.eng->submit(empty, &id).code(), Status::Code::kInvalidArgument);
  Request big;
  big.prompt = {1, static_cast<int32_t>(r.c.vocab_size)};
  EXPECT_EQ(r.eng->submit(big, &id).code(), Status::Code::kInvalidArgument);
  Request zero;
  zero.prompt = {1};
  zero.max_tokens = 0;
  EXPECT_EQ(r.eng->submit(zero, &id).code(), Status::Code::kInvalidArgument);
  Request badp;
  badp.prompt = {1};
  badp.sampling.top_p = 0;
  EXPECT_EQ(r.eng->submit(badp, &id).code(), Status::Code::kInvalidArgument);
  EXPECT_TRUE(r.eng->idle());
  EXPECT_EQ(r.eng->stats().submitted, 0);
}

// ---- sampling ---------------------------------------------------------------------------

// Seeded sampling is reproducible, equals generate() with the same options (one Sampler
// per request, its own generator), and does not depend on the batch composition.
TEST(EngineSampling, SeededReproducibleAndIndependentOfBatch) {
  Config c = small_config();
  auto p0 = random_tokens(6, c.vocab_size, 21), p1 = random_tokens(19, c.vocab_size, 22);
  auto p2 = random_tokens(3, c.vocab_size, 23);
  std::vector<int32_t> alone;
  {
    Rig r(opts(1));
    RequestId id = r.add(p0, 30, sampled(5));
    r.eng->run_until_idle();
    alone = r.out[id].tokens;
    EXPECT_EQ(alone, r.reference(p0, 30, sampled(5)).first);
  }
  Rig r(opts(3));
  RequestId x = r.add(p1, 25, sampled(5));   // same seed, other prompt
  RequestId y = r.add(p0, 30, sampled(5));
  RequestId z = r.add(p2, 30, greedy());
  RequestId w = r.add(p0, 30, sampled(6));   // other seed
  r.eng->run_until_idle();
  EXPECT_EQ(r.out[y].tokens, alone);
  EXPECT_NE(r.out[w].tokens, alone);
  EXPECT_EQ(r.out[x].tokens, r.reference(p1, 25, sampled(5)).first);
  EXPECT_EQ(r.out[z].tokens, r.reference(p2, 30).first);
}

// ---- slots, memory, budget ------------------------------------------------------------

// Graph decode widths: 1, 2, 4, 8, 16, then steps of at most 1.5× up to max_slots, which
// ends the list; every batch size up to max_slots pads by less than half its width.
TEST(EngineGraphs, DefaultDecodeWidths) {
  for (int64_t slots : {int64_t{1}, int64_t{3}, int64_t{16}, int64_t{17}, int64_t{100}, int64_t{1280}}) {
    SCOPED_TRACE(slots);
    const auto w = default_decode_widths(slots);
    ASSERT_FALSE(w.empty());
    EXPECT_EQ(w.back(), slots);
    EXPECT_EQ(w.front(), 1);
    for (size_t i = 1; i < w.size(); ++i) {
      EXPECT_LT(w[i - 1], w[i]);
      EXPECT_LE(w[i], std::max<int64_t>(2 * w[i - 1], w[i - 1] * 3 / 2 + 1));
    }
    for (int64_t n = 1; n <= slots; ++n) {
      const int64_t width = *std::lower_bound(w.begin(), w.end(), n);
      EXPECT_LT(width - n, std::max<int64_t>(1, (width + 1) / 2)) << "batch " << n;
    }
  }
  const auto w = default_decode_widths(1280);
  EXPECT_EQ(w, (std::vector<int64_t>{1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1280}));
}

// Options the CPU backend cannot honour fail Engine::create with a reason, not later.
TEST(EngineGraphs, CpuRefusesGraphsAndBf16StatesClearly) {
  auto be = make_cpu_backend();
  Model m;
  ASSERT_TRUE(m.create(small_config(), *be, DType::kF32).is_ok());
  m.init_weights(3);
  std::unique_ptr<Engine> eng;
  EngineOptions o = opts(4);
  o.graphs = true;
  Status st = Engine::create(m, o, &eng);
  EXPECT_FALSE(st.is_ok());
  EXPECT_NE(st.to_string().find("no graphs"), std::string::npos) << st.to_string();
  EXPECT_NE(st.to_string().find("--eager"), std::string::npos) << st.to_string();
  o = opts(4);
  o.state_dtype = DType::kBF16;
  st = Engine::create(m, o, &eng);
  EXPECT_FALSE(st.is_ok());
  EXPECT_NE(st.to_string().find("BF16 states need a BF16 model on CUDA"), std::string::npos) << st.to_string();
  o = opts(4);
  o.state_dtype = DType::kI32;
  EXPECT_FALSE(Engine::create(m, o, &eng).is_ok());
}

// The engine plans max(width, prefill_chunk) token rows and width logit rows, not
// width × prefill_chunk: with 64 slots and 64-token pieces that is ~64× fewer bytes, and
// the engine still serves decode batches of 64 and full prefill pieces.
TEST(EngineSlots, PlanHoldsWidthOrPieceRowsNotTheirProduct) {
  EngineOptions o = opts(64, 64, 128);
  Rig r(o);
  PlanOptions full;
  full.max_batch = 64;
  full.max_seq = 64;
  Model big;
  ASSERT_TRUE(big.create(r.c, *r.be, DType::kF32).is_ok());
  ASSERT_TRUE(big.plan(full).is_ok());
  EXPECT_LT(r.m.activation_bytes() * 32, big.activation_bytes());
  std::vector<RequestId> ids;
  for (int i = 0; i < 64; ++i) ids.push_back(r.add(r.make(random_tokens(70 + i, r.c.vocab_size, 40 + i), 3)));
  r.eng->run_until_idle();
  for (RequestId id : ids) EXPECT_EQ(r.out[id].tokens.size(), 3u);
  EXPECT_EQ(r.eng->stats().generated_tokens, 64 * 3);
}

TEST(EngineSlots, BytesPerSlotAndSlotsFromMemory) {
  Rig r(opts(5));
  const int64_t bytes = r.c.state_bytes_per_sequence();
  EXPECT_EQ(r.eng->slot_bytes(), bytes);
  EXPECT_EQ(r.eng->num_slots(), 5);
  EXPECT_EQ(r.eng->pool().slots(), 6);  // + scratch
  EXPECT_EQ(r.eng->scratch_slot(), 5);
  EXPECT_EQ(r.eng->pool_bytes(), 6 * bytes);
  EXPECT_EQ(r.eng->stats().free_slots, 5);
  EXPECT_NE(r.eng->summary().find("5 slots"), std::string::npos);

  // Slots from a byte budget: the scratch slot and the arena's rounding count.
  EXPECT_EQ(slots_for_memory(r.c, 0), 0);
  EXPECT_EQ(slots_for_memory(r.c, bytes), 0);
  EXPECT_EQ(slots_for_memory(r.c, 2 * bytes + 256), 1);
  EXPECT_EQ(slots_for_memory(r.c, 11 * bytes + 256), 10);
  EXPECT_EQ(slots_for_memory(r.c, 11 * bytes + 256, DType::kF64), 4);
  for (int64_t budget : {int64_t{100000}, int64_t{1} << 20, int64_t{3} << 20}) {
    const int64_t s = slots_for_memory(r.c, budget);
    EXPECT_LE(static_cast<int64_t>(Arena::planned_bytes({{"s", DType::kF32, {s + 1, bytes / 4}}})), budget);
    EXPECT_GT(static_cast<int64_t>(Arena::planned_bytes({{"s", DType::kF32, {s + 2, bytes / 4}}})), budget);
  }
  // laplace-3b: 29,491,200 bytes per slot (docs/model.md §5); 80 GiB hold 2,911 slots + scratch.
  Config big;
  big.vocab_size = 92160, big.hidden_size = 3072, big.num_layers = 24, big.num_heads = 16;
  big.head_k_dim = 96, big.head_v_dim = 192, big.ffn_size = 8192;
  EXPECT_EQ(big.state_bytes_per_sequence(), 29491200);
  EXPECT_EQ(slots_for_memory(big, int64_t{80} << 30), (int64_t{80} << 30) / 29491200 - 1);

  // The engine derives its slot count from a budget when max_slots = 0.
  auto be = make_cpu_backend();
  Model m;
  ASSERT_TRUE(m.create(r.c, *be, DType::kF32).is_ok());
  EngineOptions o = opts(0);
  o.memory_budget = 4 * bytes + 256;
  std::unique_ptr<Engine> e;
  ASSERT_TRUE(Engine::create(m, o, &e).is_ok());
  EXPECT_EQ(e->num_slots(), 3);
  o.memory_budget = bytes;
  EXPECT_EQ(Engine::create(m, o, &e).code(), Status::Code::kOutOfMemory);
  o.memory_budget = 0;
  EXPECT_EQ(Engine::create(m, o, &e).code(), Status::Code::kInvalidArgument);
}

// A long prompt is prefilled in pieces of prefill_chunk, as many per step as the token
// budget leaves after the decode rows; one piece always runs.
TEST(EngineBudget, ChunkedPrefillUnderTheStepBudget) {
  Rig r(opts(2, 8, 10));
  auto longp = random_tokens(30, r.c.vocab_size, 31);
  RequestId a = r.add(longp, 5);
  // Pieces 8, 8, 8, 6: one per step (8 + 8 > 10).
  const int64_t expect_tokens[] = {8, 16, 24, 30};
  for (int s = 0; s < 4; ++s) {
    r.eng->step();
    EXPECT_EQ(r.eng->stats().prefill_tokens, expect_tokens[s]) << "step " << s;
  }
  EXPECT_EQ(r.out[a].tokens.size(), 1u);  // first token from the last piece
  // Now `a` decodes (1 row), leaving 9 tokens of budget for a second prompt's pieces.
  auto p2 = random_tokens(17, r.c.vocab_size, 32);
  RequestId b = r.add(p2, 3);
  r.eng->step();
  EngineStats s = r.eng->stats();
  EXPECT_EQ(s.prefill_tokens, 38);
  EXPECT_EQ(s.decode_tokens, 1);
  r.eng->step();  // 1 decode row + pieces 8 and 1 = 10 tokens: b's prefill ends
  EXPECT_EQ(r.eng->stats().prefill_tokens, 47);
  EXPECT_EQ(r.out[b].tokens.size(), 1u);
  r.eng->run_until_idle();
  s = r.eng->stats();
  EXPECT_EQ(s.prefill_tokens, 47);
  EXPECT_EQ(s.prefill_forwards, 4 + 3);
  EXPECT_EQ(r.out[a].tokens, r.reference(longp, 5).first);
  EXPECT_EQ(r.out[b].tokens, r.reference(p2, 3).first);

  // A big budget runs several pieces of one prompt in a single step.
  Rig big(opts(1, 8, 100));
  big.add(longp, 1);
  big.eng->step();
  EXPECT_EQ(big.eng->stats().prefill_tokens, 30);
  EXPECT_EQ(big.eng->stats().prefill_forwards, 4);
  EXPECT_TRUE(big.eng->idle());
}

// A burst of prompts: the step's pieces of one length from different sequences run as one
// forward, and every token and final state is bitwise what one piece at a time gives
// (and generate()'s), with far fewer forwards.
TEST(EngineBudget, BatchedPrefillEqualsOnePieceAtATime) {
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 24; ++i) {
    const int64_t len = i % 4 == 3 ? 30 : (i % 4 == 2 ? 11 : 16);  // pieces 8+8, 8+3, 8+8+8+6
    prompts.push_back(random_tokens(len, small_config().vocab_size, 900 + i));
  }
  auto run = [&](int batch) {
    EngineOptions o = opts(24, 8, 512);
    o.batch_prefill = batch;
    Rig r(o);
    std::vector<RequestId> ids;
    for (const auto& p : prompts) ids.push_back(r.add(p, 6));
    r.eng->run_until_idle();
    std::vector<Outcome> outs;
    for (RequestId id : ids) outs.push_back(r.out[id]);
    return std::make_pair(outs, r.eng->stats());
  };
  const auto [batched, sb] = run(kBatchPrefillEqual);
  const auto [ragged, sr] = run(kBatchPrefillRagged);
  const auto [single, ss] = run(kBatchPrefillOff);
  ASSERT_EQ(batched.size(), single.size());
  for (size_t i = 0; i < batched.size(); ++i) {
    EXPECT_EQ(batched[i].tokens, single[i].tokens) << "request " << i;
    EXPECT_EQ(batched[i].state, single[i].state) << "request " << i << ": final state bytes";
    EXPECT_EQ(ragged[i].tokens, single[i].tokens) << "request " << i << " (ragged)";
    EXPECT_EQ(ragged[i].state, single[i].state) << "request " << i << ": final state bytes (ragged)";
    EXPECT_EQ(batched[i].tokens.size(), 6u);
  }
  EXPECT_EQ(sb.prefill_tokens, ss.prefill_tokens);
  EXPECT_EQ(sr.prefill_tokens, ss.prefill_tokens);
  EXPECT_EQ(ss.prefill_forwards, 12 * 2 + 6 * 2 + 6 * 4);  // one forward per piece
  // Round 0: one [24, 8] forward; round 1: [18, 8] and [6, 3]; rounds 2 and 3: [6, 8], [6, 6].
  EXPECT_EQ(sb.prefill_forwards, 5);
  // Ragged: round 1's pieces of 8 and 3 tokens in one forward.
  EXPECT_EQ(sr.prefill_forwards, 4);
  Rig ref(opts(1, 8, 512));
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(batched[i].tokens, ref.reference(prompts[i], 6).first) << i;
}

// A batched group of greedy last pieces takes its first tokens from the device's argmax
// (StepExecutor::prefill_group_greedy) and fetches a row's logits only when a finishing
// request's final state needs them; a group with any other row uses the host's logits.
// Both give what one piece at a time gives: tokens, final states and their logits.
TEST(EngineBudget, GreedyBatchedPrefillFirstTokensAndFinalStates) {
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 12; ++i) prompts.push_back(random_tokens(8, small_config().vocab_size, 300 + i));
  auto run = [&](int batch, bool mixed) {
    EngineOptions o = opts(12, 8, 512);
    o.batch_prefill = batch;
    Rig r(o);
    std::vector<RequestId> ids;
    for (size_t i = 0; i < prompts.size(); ++i) {
      Request q = r.make(prompts[i], i % 3 == 0 ? 1 : 4, mixed && i == 5 ? sampled(7) : greedy());
      q.capture_final_state = i % 2 == 0;  // some finish at their first token and keep the state
      ids.push_back(r.add(std::move(q)));
    }
    r.eng->run_until_idle();
    std::vector<Outcome> outs;
    for (RequestId id : ids) outs.push_back(r.out[id]);
    return std::make_pair(outs, r.eng->stats());
  };
  for (bool mixed : {false, true}) {
    const auto [batched, sb] = run(1, mixed);
    const auto [single, ss] = run(0, mixed);
    EXPECT_EQ(sb.prefill_forwards, 1) << "one [12, 8] forward";
    EXPECT_EQ(ss.prefill_forwards, 12);
    for (size_t i = 0; i < prompts.size(); ++i) {
      SCOPED_TRACE(::testing::Message() << "mixed " << mixed << ", request " << i);
      EXPECT_EQ(batched[i].tokens, single[i].tokens);
      EXPECT_EQ(batched[i].tokens.size(), i % 3 == 0 ? 1u : 4u);
      ASSERT_EQ(batched[i].info.final_state != nullptr, i % 2 == 0);
      if (i % 2 == 0) {
        EXPECT_EQ(batched[i].info.final_state->logits, single[i].info.final_state->logits);
        EXPECT_EQ(batched[i].info.final_state->state, single[i].info.final_state->state);
        EXPECT_EQ(batched[i].info.final_state->tokens, single[i].info.final_state->tokens);
      }
    }
  }
}

// Padded decode widths: padded rows go to the scratch slot and are counted; tokens equal.
TEST(EngineBudget, PaddedDecodeWidths) {
  EngineOptions o = opts(5);
  o.decode_widths = {4, 2};
  Rig r(o);
  EXPECT_EQ(r.eng->decode_widths(), (std::vector<int64_t>{2, 4, 5}));
  std::vector<std::vector<int32_t>> prompts;
  std::vector<RequestId> ids;
  for (int i = 0; i < 3; ++i) {
    prompts.push_back(random_tokens(3 + i, r.c.vocab_size, 40 + i));
    ids.push_back(r.add(prompts[i], 6));
  }
  r.eng->run_until_idle();
  const EngineStats s = r.eng->stats();
  EXPECT_EQ(s.decode_forwards, 5);
  EXPECT_EQ(s.padded_rows, 5);  // 3 live rows padded to 4, five times
  for (int i = 0; i < 3; ++i) EXPECT_EQ(r.out[ids[i]].tokens, r.reference(prompts[i], 6).first);
}

// ---- threads ----------------------------------------------------------------------------

// submit() and cancel() from other threads while the engine thread steps: every request
// finishes exactly once and the accounting adds up.
TEST(EngineThreads, SubmitAndCancelFromOtherThreads) {
  auto be = make_cpu_backend();
  Config c = small_config();
  Model m;
  ASSERT_TRUE(m.create(c, *be, DType::kF32).is_ok());
  m.init_weights(3);
  std::unique_ptr<Engine> eng;
  ASSERT_TRUE(Engine::create(m, opts(3, 8, 24), &eng).is_ok());
  std::mutex mu;
  std::map<RequestId, int> finishes;
  std::atomic<int> submitted{0};
  std::atomic<bool> producers_done{false};
  auto producer = [&](int t) {
    for (int i = 0; i < 12; ++i) {
      Request r;
      r.prompt = random_tokens(1 + (i * 7 + t) % 20, c.vocab_size, t * 100 + i);
      r.max_tokens = 3 + i % 5;
      r.sampling = greedy();
      r.on_finish = [&](const FinishInfo& f) {
        std::lock_guard<std::mutex> lk(mu);
        ++finishes[f.id];
      };
      RequestId id = 0;
      ASSERT_TRUE(eng->submit(std::move(r), &id).is_ok());
      ++submitted;
      if (i % 4 == 3) eng->cancel(id);
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  };
  std::thread p1(producer, 1), p2(producer, 2);
  std::thread stepper([&] {
    while (!producers_done.load() || !eng->idle()) {
      if (!eng->step()) std::this_thread::yield();
    }
  });
  p1.join();
  p2.join();
  producers_done = true;
  stepper.join();
  EXPECT_EQ(submitted.load(), 24);
  EXPECT_EQ(finishes.size(), 24u);
  for (auto& [id, n] : finishes) EXPECT_EQ(n, 1) << "request " << id;
  const EngineStats s = eng->stats();
  EXPECT_EQ(s.finished, 24);
  EXPECT_EQ(s.running, 0);
  EXPECT_EQ(s.free_slots, 3);
}


// ---- state snapshots (the server's cache, forks and sessions) ------------------------------------

namespace {
SnapshotPtr run_capturing(Rig& r, const std::vector<int32_t>& prompt, int64_t max_tokens, SnapshotPtr initial,
                          SnapshotPtr* prompt_state, SnapshotPtr* final_state, RequestId* id_out = nullptr) {
  Request q = r.make(prompt, max_tokens);
  q.initial_state = std::move(initial);
  q.capture_prompt_state = true;
  q.capture_final_state = true;
  q.on_prompt_state = [prompt_state](RequestId, const SnapshotPtr& s) { *prompt_state = s; };
  auto prev = q.on_finish;
  q.on_finish = [prev, final_state](const FinishInfo& f) {
    prev(f);
    *final_state = f.final_state;
  };
  RequestId id = r.add(std::move(q));
  if (id_out) *id_out = id;
  r.eng->run_until_idle();
  return *final_state;
}
}  // namespace

// Continuing from a snapshot equals feeding the whole context again: the same tokens, the
// state within F32 rounding (the prefill pieces differ, so not bitwise), and only the new
// tokens are prefilled.
TEST(EngineSnapshot, ContinuationEqualsRecomputingTheContext) {
  Rig r(opts(2, 8, 64));
  const std::vector<int32_t> p = random_tokens(21, r.c.vocab_size, 901);
  const std::vector<int32_t> q = random_tokens(13, r.c.vocab_size, 902);
  SnapshotPtr ps, fs;
  RequestId a;
  run_capturing(r, p, 9, nullptr, &ps, &fs, &a);
  ASSERT_TRUE(ps && fs);
  EXPECT_EQ(ps->tokens, p);
  const std::vector<int32_t>& gen = r.out[a].tokens;
  ASSERT_EQ(gen.size(), 9u);
  std::vector<int32_t> covered = p;
  covered.insert(covered.end(), gen.begin(), gen.end() - 1);  // the last token was never fed
  EXPECT_EQ(fs->tokens, covered);
  EXPECT_EQ(static_cast<int64_t>(fs->state.size()), r.eng->slot_bytes());
  EXPECT_EQ(static_cast<int64_t>(fs->logits.size()), r.c.vocab_size);

  // Warm: from the final snapshot, feed the last generated token and q.
  std::vector<int32_t> rest = {gen.back()};
  rest.insert(rest.end(), q.begin(), q.end());
  const int64_t before = r.eng->stats().prefill_tokens;
  SnapshotPtr ps2, fs2;
  RequestId b;
  run_capturing(r, rest, 12, fs, &ps2, &fs2, &b);
  EXPECT_EQ(r.eng->stats().prefill_tokens - before, static_cast<int64_t>(rest.size()));
  // Cold: the whole context as one prompt.
  std::vector<int32_t> whole = covered;
  whole.insert(whole.end(), rest.begin(), rest.end());
  SnapshotPtr ps3, fs3;
  RequestId c;
  run_capturing(r, whole, 12, nullptr, &ps3, &fs3, &c);
  EXPECT_EQ(r.out[b].tokens, r.out[c].tokens);
  ASSERT_TRUE(fs2 && fs3);
  EXPECT_EQ(fs2->tokens, fs3->tokens);
  Tensor x(const_cast<uint8_t*>(fs2->state.data()), DType::kF32, {static_cast<int64_t>(fs2->state.size() / 4)});
  Tensor y(const_cast<uint8_t*>(fs3->state.data()), DType::kF32, {static_cast<int64_t>(fs3->state.size() / 4)});
  EXPECT_LE(testing::max_rel_error(x, y), 1e-5);
}

// A fork (the prompt snapshot, nothing to prefill) emits its first token from the
// snapshot's logits and then decodes exactly as the original did: bitwise the same state.
TEST(EngineSnapshot, ForkFromPromptStateReproducesTheOriginalBitwise) {
  Rig r(opts(3, 8, 64));
  const std::vector<int32_t> p = random_tokens(17, r.c.vocab_size, 903);
  SnapshotPtr ps, fs;
  RequestId a;
  run_capturing(r, p, 11, nullptr, &ps, &fs, &a);
  const int64_t before = r.eng->stats().prefill_tokens;
  SnapshotPtr ps2, fs2;
  RequestId b;
  run_capturing(r, {}, 11, ps, &ps2, &fs2, &b);
  EXPECT_EQ(r.eng->stats().prefill_tokens, before) << "a fork prefills nothing";
  EXPECT_EQ(ps2, ps) << "with nothing to feed, the prompt state is the initial state itself";
  EXPECT_EQ(r.out[b].tokens, r.out[a].tokens);
  ASSERT_TRUE(fs2);
  EXPECT_EQ(fs2->state, fs->state);
  EXPECT_EQ(fs2->logits, fs->logits);
  EXPECT_EQ(fs2->tokens, fs->tokens);
  EXPECT_EQ(r.out[b].info.prompt_tokens, 0);
}

TEST(EngineSnapshot, RejectsStatesOfAnotherShapeAndEmptyPromptsWithoutOne) {
  Rig r(opts(1));
  Request q = r.make({}, 4);
  RequestId id;
  EXPECT_EQ(r.eng->submit(q, &id).code(), Status::Code::kInvalidArgument);
  auto bad = std::make_shared<StateSnapshot>();
  bad->state.resize(16);
  bad->logits.resize(static_cast<size_t>(r.c.vocab_size));
  bad->tokens = {1};
  q.initial_state = bad;
  Status st = r.eng->submit(q, &id);
  EXPECT_EQ(st.code(), Status::Code::kInvalidArgument);
  EXPECT_NE(st.message().find("initial state"), std::string::npos) << st.message();
  Request l = r.make({1, 2}, 2);
  l.top_logprobs = 21;
  EXPECT_EQ(r.eng->submit(l, &id).code(), Status::Code::kInvalidArgument);
}

// ---- deferred write-back (EngineOptions::defer_writeback) -------------------------------

EngineOptions deferred(int64_t R, int64_t slots, int64_t chunk = 8, int64_t budget = 64) {
  EngineOptions o = opts(slots, chunk, budget);
  o.defer_writeback = R;
  return o;
}

// Greedy tokens with the state written back every R-th step equal those of the write-back
// every step, and the final logits agree to F32 rounding (its order is all that differs), with more requests than slots so
// that slots are reused (a reused slot must start with no pending pairs).
TEST(EngineDeferred, GreedyTokensEqualWriteBackEveryStep) {
  Config c = small_config();
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 5; ++i) prompts.push_back(random_tokens(3 + 6 * i, c.vocab_size, 700 + i));
  struct Run {
    std::vector<int32_t> tokens;
    std::vector<float> logits;  // after the last token fed
  };
  auto run = [&](EngineOptions o) {
    Rig r(o);
    std::vector<RequestId> ids;
    std::map<RequestId, std::vector<float>> logits;
    for (const auto& p : prompts) {
      Request q = r.make(p, 29);
      q.capture_final_state = true;
      auto prev = q.on_finish;
      q.on_finish = [prev, &logits](const FinishInfo& f) {
        prev(f);
        if (f.final_state) logits[f.id] = f.final_state->logits;
      };
      ids.push_back(r.add(std::move(q)));
    }
    r.eng->run_until_idle();
    std::vector<Run> res;
    for (RequestId id : ids) res.push_back({r.out[id].tokens, logits[id]});
    return res;
  };
  const auto want = run(opts(3));
  for (int64_t R : {4, 8, 16}) {
    SCOPED_TRACE("R " + std::to_string(R));
    const auto got = run(deferred(R, 3));
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_EQ(got[i].tokens, want[i].tokens) << "prompt " << i;
      ASSERT_EQ(got[i].logits.size(), static_cast<size_t>(c.vocab_size));
      Tensor a(const_cast<float*>(got[i].logits.data()), DType::kF32, {c.vocab_size});
      Tensor b(const_cast<float*>(want[i].logits.data()), DType::kF32, {c.vocab_size});
      EXPECT_LE(testing::max_rel_error(a, b), 1e-5) << "prompt " << i;
    }
  }
}

// Batch invariance holds with deferred write-back too: with the row-invariant gemm, each
// sequence's tokens and whole slot (states, pending pairs, counts) are bitwise the same
// alone, all at once, queued, padded and staggered.
TEST(EngineDeferred, BatchInvariantBitwiseWithRowInvariantGemm) {
  Config c = small_config();
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 4; ++i) prompts.push_back(random_tokens(2 + 9 * i, c.vocab_size, 720 + i));
  auto run = [&](const std::vector<int>& which, EngineOptions o, int stagger) {
    Rig r(o, 7, c, /*row_gemm=*/true);
    std::map<int, RequestId> ids;
    for (int i : which) {
      ids[i] = r.add(prompts[i], 21);
      for (int s = 0; s < stagger; ++s) r.eng->step();
    }
    r.eng->run_until_idle();
    std::map<int, Outcome> res;
    for (auto [i, id] : ids) res[i] = r.out[id];
    return res;
  };
  std::map<int, Outcome> alone;
  for (int i = 0; i < 4; ++i) alone[i] = run({i}, deferred(4, 1), 0)[i];
  EngineOptions padded = deferred(4, 4);
  padded.decode_widths = {2, 8};
  for (auto& [which, o, stagger] : std::vector<std::tuple<std::vector<int>, EngineOptions, int>>{
           {{0, 1, 2, 3}, deferred(4, 4), 0}, {{3, 1, 0}, deferred(4, 2), 3}, {{2, 0, 3, 1}, padded, 5}}) {
    for (auto& [i, got] : run(which, o, stagger)) {
      EXPECT_EQ(got.tokens, alone[i].tokens) << "prompt " << i;
      EXPECT_EQ(got.state, alone[i].state) << "prompt " << i;
    }
  }
}

// Snapshots carry the pending pairs: a fork from the prompt state decodes bitwise as the
// original did, and a continuation from the final state (its prefill folds the pairs in
// first) gives the tokens of feeding the whole context again.
TEST(EngineDeferred, SnapshotsCarryPendingPairs) {
  Rig r(deferred(8, 2));
  const std::vector<int32_t> p = random_tokens(19, r.c.vocab_size, 740);
  const std::vector<int32_t> q = random_tokens(11, r.c.vocab_size, 741);
  SnapshotPtr ps, fs;
  RequestId a;
  run_capturing(r, p, 13, nullptr, &ps, &fs, &a);
  ASSERT_TRUE(ps && fs);
  EXPECT_EQ(static_cast<int64_t>(fs->state.size()), r.eng->slot_bytes());
  SnapshotPtr ps2, fs2;
  RequestId b;
  run_capturing(r, {}, 13, ps, &ps2, &fs2, &b);
  EXPECT_EQ(r.out[b].tokens, r.out[a].tokens);
  ASSERT_TRUE(fs2);
  EXPECT_EQ(fs2->state, fs->state);

  const std::vector<int32_t>& gen = r.out[a].tokens;
  std::vector<int32_t> rest = {gen.back()};
  rest.insert(rest.end(), q.begin(), q.end());
  SnapshotPtr ps3, fs3, ps4, fs4;
  RequestId warm, cold;
  run_capturing(r, rest, 10, fs, &ps3, &fs3, &warm);
  std::vector<int32_t> whole = fs->tokens;
  whole.insert(whole.end(), rest.begin(), rest.end());
  run_capturing(r, whole, 10, nullptr, &ps4, &fs4, &cold);
  EXPECT_EQ(r.out[warm].tokens, r.out[cold].tokens);
}

// A prefill ends with every head's count word at its phase (the flush Model::forward runs first
// sets (0, h mod R)), so head h's first write-back comes R − (h mod R) decode steps later and
// the heads of sequences admitted together do not all write back at the same step; from there
// the words follow ops/backend.h's rule. Read from the prompt and final snapshots' count words.
TEST(EngineDeferred, PrefillStartsEachHeadsCycleAtItsPhase) {
  const int64_t R = 4;
  Rig r(deferred(R, 1), 7, small_config(8, 12, 4));
  SnapshotPtr ps, fs;
  run_capturing(r, random_tokens(7, r.c.vocab_size, 760), 7, nullptr, &ps, &fs);
  ASSERT_TRUE(ps && fs);
  const int64_t L = r.c.num_layers, H = r.c.num_heads;
  auto words = [&](const SnapshotPtr& s) {  // the count words [L, H] end the slot (32 bytes: no padding)
    std::vector<int32_t> w(static_cast<size_t>(L * H));
    std::memcpy(w.data(), s->state.data() + s->state.size() - 4 * L * H, 4 * L * H);
    return w;
  };
  const std::vector<int32_t> at_prompt = words(ps), at_end = words(fs);
  const int64_t steps = static_cast<int64_t>(fs->tokens.size() - ps->tokens.size());  // tokens fed by decode
  ASSERT_EQ(steps, 6);
  for (int64_t l = 0; l < L; ++l) {
    for (int64_t h = 0; h < H; ++h) {
      SCOPED_TRACE("layer " + std::to_string(l) + " head " + std::to_string(h));
      int32_t w = at_prompt[static_cast<size_t>(l * H + h)];
      EXPECT_EQ(w, pending_word(0, pending_phase(h, R)));
      int64_t first = -1;
      for (int64_t t = 0; t < steps; ++t) {
        const int32_t m = pending_m(w), d = pending_d(w);
        if (m + 1 + d == R && first < 0) first = t;
        w = m + 1 + d == R ? 0 : pending_word(m + 1, d);
      }
      EXPECT_EQ(first, R - 1 - pending_phase(h, R)) << "the step of the first write-back";
      EXPECT_EQ(at_end[static_cast<size_t>(l * H + h)], w);
    }
  }
}

// A slot converted to another layout (StatePool::convert_slot, what a server does with a session
// saved under other --defer-writeback / --state-dtype options): pairs folded in, it matches the
// state of writing back every step, and continuing from it gives that run's tokens; without pairs
// the conversion is exact both ways; BF16 is rounding to nearest; a corrupt count is refused.
TEST(EngineDeferred, ConvertedSlotsContinueAsWrittenBackEveryStep) {
  Rig r8(deferred(8, 2)), r0(opts(2));
  const Config& c = r8.c;
  const std::vector<int32_t> p = random_tokens(19, c.vocab_size, 760);
  SnapshotPtr ps8, fs8, ps0, fs0;
  RequestId a8, a0;
  run_capturing(r8, p, 13, nullptr, &ps8, &fs8, &a8);  // 13 steps: pairs pending in every head
  run_capturing(r0, p, 13, nullptr, &ps0, &fs0, &a0);
  ASSERT_TRUE(fs8 && fs0);
  ASSERT_EQ(r8.out[a8].tokens, r0.out[a0].tokens);
  const PendingSpec d8{8, DType::kF32}, d4{4, DType::kF32}, none{};
  const int64_t spec = c.state_bytes_per_sequence(), n = spec / 4;
  std::vector<uint8_t> flat;
  ASSERT_TRUE(StatePool::convert_slot(c, DType::kF32, d8, fs8->state.data(), DType::kF32, none, &flat).is_ok());
  ASSERT_EQ(static_cast<int64_t>(flat.size()), spec);
  Tensor got(flat.data(), DType::kF32, {n});
  Tensor want(const_cast<uint8_t*>(fs0->state.data()), DType::kF32, {n});
  EXPECT_LE(testing::max_rel_error(got, want), 1e-5);
  EXPECT_NE(std::memcmp(flat.data(), fs8->state.data(), static_cast<size_t>(spec)), 0) << "the pairs were folded in";

  // Continuing from the converted slot gives the tokens of continuing the every-step run.
  auto conv = std::make_shared<StateSnapshot>(*fs8);
  conv->state = flat;
  const std::vector<int32_t> rest = random_tokens(7, c.vocab_size, 761);
  SnapshotPtr x1, x2, y1, y2;
  RequestId warm, want_id;
  run_capturing(r0, rest, 10, conv, &x1, &x2, &warm);
  run_capturing(r0, rest, 10, fs0, &y1, &y2, &want_id);
  EXPECT_EQ(r0.out[warm].tokens, r0.out[want_id].tokens);

  // To R = 4: the same front, an empty tail; no pairs: exact both ways.
  std::vector<uint8_t> to4, back;
  ASSERT_TRUE(StatePool::convert_slot(c, DType::kF32, d8, fs8->state.data(), DType::kF32, d4, &to4).is_ok());
  ASSERT_EQ(static_cast<int64_t>(to4.size()), StatePool::slot_bytes_for(c, DType::kF32, d4));
  EXPECT_EQ(std::memcmp(to4.data(), flat.data(), static_cast<size_t>(spec)), 0);
  EXPECT_TRUE(std::all_of(to4.begin() + spec, to4.end(), [](uint8_t b) { return b == 0; }));
  ASSERT_TRUE(StatePool::convert_slot(c, DType::kF32, d4, to4.data(), DType::kF32, none, &back).is_ok());
  EXPECT_EQ(back, flat);

  // BF16: every value rounded to nearest.
  std::vector<uint8_t> b16;
  ASSERT_TRUE(StatePool::convert_slot(c, DType::kF32, none, fs0->state.data(), DType::kBF16, none, &b16).is_ok());
  ASSERT_EQ(static_cast<int64_t>(b16.size()), n * 2);
  int64_t wrong = 0;
  for (int64_t i = 0; i < n; ++i) {
    float f;
    uint16_t h;
    std::memcpy(&f, fs0->state.data() + 4 * i, 4);
    std::memcpy(&h, b16.data() + 2 * i, 2);
    wrong += h != float_to_bf16(f);
  }
  EXPECT_EQ(wrong, 0);

  // A count word that is not valid for R (m = R; m + d = R) is refused.
  // The counts [L, H] end the slot (L·H = 4 here: 16 bytes, no padding); the first is made bad.
  for (const int32_t word : {pending_word(8, 0), pending_word(3, 5)}) {
    std::vector<uint8_t> bad = fs8->state;
    std::memcpy(bad.data() + bad.size() - 4 * c.num_layers * c.num_heads, &word, 4);
    std::vector<uint8_t> out;
    Status st = StatePool::convert_slot(c, DType::kF32, d8, bad.data(), DType::kF32, none, &out);
    EXPECT_EQ(st.code(), Status::Code::kCorrupt) << st.to_string();
    EXPECT_NE(st.message().find("m + d must be below R"), std::string::npos) << st.to_string();
  }
}

// Slot bytes: docs/model.md §5's state, then R − 1 pairs of (dk + dv) values per head and layer in the
// activations' dtype, then L·H count words; a bad R and a snapshot with a count word not valid
// for R are refused with a clear error.
TEST(EngineDeferred, SlotBytesBadOptionsAndCorruptCounts) {
  Config big;  // laplace-3b's shapes
  big.vocab_size = 92160, big.hidden_size = 3072, big.num_layers = 24, big.num_heads = 16;
  big.head_k_dim = 96, big.head_v_dim = 192, big.ffn_size = 8192;
  const int64_t spec = big.state_bytes_per_sequence();
  EXPECT_EQ(StatePool::slot_bytes_for(big, DType::kF32, {8, DType::kBF16}), spec + 24 * 16 * 7 * 288 * 2 + 24 * 16 * 4);
  EXPECT_EQ(StatePool::slot_bytes_for(big, DType::kF32, {}), spec);
  const int64_t with = StatePool::slot_bytes_for(big, DType::kF32, {8, DType::kBF16});
  EXPECT_EQ(slots_for_memory(big, 11 * with + 256, DType::kF32, {8, DType::kBF16}), 10);

  {
    Config c = small_config();
    auto be = make_cpu_backend();
    Model m;
    ASSERT_TRUE(m.create(c, *be, DType::kF32).is_ok());
    std::unique_ptr<Engine> e;
    EngineOptions o = deferred(3, 2);
    Status st = Engine::create(m, o, &e);
    EXPECT_FALSE(st.is_ok());
    EXPECT_NE(st.message().find("R = 4, 8 or 16"), std::string::npos) << st.to_string();
  }
  Rig r(deferred(4, 1));
  SnapshotPtr ps, fs;
  run_capturing(r, random_tokens(9, r.c.vocab_size, 750), 6, nullptr, &ps, &fs);
  ASSERT_TRUE(fs);
  auto bad = std::make_shared<StateSnapshot>(*fs);
  // The count words are the slot's last L·H int32 values (16-byte padding aside): find one of
  // the final snapshot's with m > 0 and no phase (head 0's after a flush) and make its m R.
  const int64_t n = r.c.num_layers * r.c.num_heads;
  int32_t* counts = nullptr;
  for (int64_t off = static_cast<int64_t>(bad->state.size()) - 4 * n; off >= 0; off -= 4) {
    int32_t v0 = 0;
    std::memcpy(&v0, bad->state.data() + off, 4);
    if (v0 > 0 && v0 < 4) {
      counts = reinterpret_cast<int32_t*>(bad->state.data() + off);
      break;
    }
  }
  ASSERT_NE(counts, nullptr) << "no pending count in the final snapshot";
  *counts = 4;
  Request q = r.make({1}, 2);
  q.initial_state = bad;
  RequestId id;
  Status st = r.eng->submit(std::move(q), &id);
  EXPECT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("pending count word 4"), std::string::npos) << st.to_string();
}

// ---- the state cache: device tier (spare pool slots) in front of the host tier ------------------

namespace {
EngineOptions cache_opts(int64_t live, int64_t cache_slots, int64_t host_bytes) {
  EngineOptions o = opts(live, 8, 64);
  o.cache_slots = cache_slots;
  o.cache_host_bytes = host_bytes;
  return o;
}

// Runs one request alone; cached = use the cache and keep its prompt and final states.
RequestId run_cached(Rig& r, const std::vector<int32_t>& prompt, int64_t max_tokens, bool cached,
                     bool cache_final = true) {
  Request q = r.make(prompt, max_tokens);
  q.use_cache = cached;
  q.cache_prompt_state = cached;
  q.cache_final_state = cached && cache_final;
  RequestId id = r.add(std::move(q));
  r.eng->run_until_idle();
  return id;
}

// Every live slot free, the device tier's used + free = its size and ≤ it, both tiers'
// entries accounted for, and no cache slot ever handed to a request.
void expect_baseline(Rig& r, int64_t live, int64_t cache_slots) {
  const EngineStats s = r.eng->stats();
  EXPECT_EQ(s.running, 0);
  EXPECT_EQ(s.queued, 0);
  EXPECT_EQ(s.free_slots, live);
  const StateCacheStats c = r.eng->cache_stats();
  EXPECT_EQ(c.device_slots, cache_slots);
  EXPECT_LE(c.device_used, cache_slots);
  EXPECT_GE(c.device_used, 0);
  EXPECT_EQ(c.entries, c.device_used + c.host_entries);
  for (const auto& [id, o] : r.out) EXPECT_LT(o.info.slot, live) << "request " << id << " ran in a non-live slot";
}
}  // namespace

// A device-tier hit (slot-to-slot copy) continues the cached context exactly: a repeated
// prompt prefills nothing and reproduces the first run bit for bit (same state, same
// tokens); a longer prompt prefills only its new tokens and emits what a cold run emits.
TEST(EngineCache, DeviceTierHitIsExactAndPrefillsOnlyNewTokens) {
  Rig r(cache_opts(2, 4, 1 << 20));
  EXPECT_EQ(r.eng->pool().slots(), 2 + 1 + 4);
  EXPECT_NE(r.eng->summary().find("+4 cache"), std::string::npos) << r.eng->summary();
  EXPECT_NE(r.eng->summary().find("device tier 4 slots"), std::string::npos) << r.eng->summary();
  const std::vector<int32_t> p = random_tokens(21, r.c.vocab_size, 1101);
  const std::vector<int32_t> q = random_tokens(11, r.c.vocab_size, 1102);

  const RequestId cold = run_cached(r, p, 8, false);
  EXPECT_EQ(r.eng->cache_stats().entries, 0) << "a request that does not ask keeps nothing";
  const RequestId first = run_cached(r, p, 8, true);  // a miss; caches the prompt and final states
  StateCacheStats c = r.eng->cache_stats();
  EXPECT_EQ(c.misses, 1);
  EXPECT_EQ(c.device_used, 2);
  EXPECT_EQ(c.host_entries, 0) << "nothing goes to host memory while the device tier has room";
  EXPECT_EQ(r.out[first].info.start, StateSource::kEmpty);

  const int64_t before = r.eng->stats().prefill_tokens;
  const RequestId again = run_cached(r, p, 8, true);
  EXPECT_EQ(r.eng->stats().prefill_tokens, before) << "a full hit prefills nothing";
  const FinishInfo& ai = r.out[again].info;
  EXPECT_EQ(ai.start, StateSource::kDeviceCache);
  EXPECT_EQ(ai.cached_tokens, 21);
  EXPECT_EQ(ai.prompt_tokens, 0);
  EXPECT_EQ(r.out[again].tokens, r.out[cold].tokens);
  EXPECT_EQ(r.out[again].tokens, r.out[first].tokens);
  EXPECT_EQ(r.out[again].state, r.out[first].state) << "bitwise the state the first run ended with";
  c = r.eng->cache_stats();
  EXPECT_EQ(c.device_hits, 1);
  EXPECT_EQ(c.host_hits, 0);
  EXPECT_EQ(c.device_hit_tokens, 21);

  // p + q: the cached prompt state covers p; only q is prefilled.
  std::vector<int32_t> pq = p;
  pq.insert(pq.end(), q.begin(), q.end());
  const RequestId cold2 = run_cached(r, pq, 8, false);
  const int64_t b2 = r.eng->stats().prefill_tokens;
  const RequestId warm2 = run_cached(r, pq, 8, true);
  EXPECT_EQ(r.eng->stats().prefill_tokens - b2, static_cast<int64_t>(q.size()));
  EXPECT_EQ(r.out[warm2].info.start, StateSource::kDeviceCache);
  EXPECT_EQ(r.out[warm2].info.cached_tokens, 21);
  EXPECT_EQ(r.out[warm2].tokens, r.out[cold2].tokens);
  EXPECT_EQ(r.eng->cache_stats().device_hits, 2);
  expect_baseline(r, 2, 4);
}

// One cache slot and several prefixes: inserting into the full device tier demotes its
// least recently used entry to the host tier; a later hit on a demoted prefix is a
// host-tier hit, exact, and promotes the entry back (demoting another). A load of mixed
// requests never puts more than the configured entries on the device and leaves every
// slot as it was.
TEST(EngineCache, FullDeviceTierDemotesToHostAndHostHitsStayExact) {
  Rig r(cache_opts(2, 1, 1 << 20));
  std::vector<std::vector<int32_t>> ps;
  std::vector<RequestId> firsts;
  for (int k = 0; k < 3; ++k) {
    ps.push_back(random_tokens(13 + k, r.c.vocab_size, 1200 + k));
    firsts.push_back(run_cached(r, ps[k], 6, true, /*cache_final=*/false));
  }
  StateCacheStats c = r.eng->cache_stats();
  EXPECT_EQ(c.device_used, 1);
  EXPECT_EQ(c.demotions, 2);
  EXPECT_EQ(c.host_entries, 2);
  EXPECT_EQ(c.entries, 3);
  EXPECT_EQ(c.hits, 0);

  // ps[0] was demoted first: a host-tier hit, then promoted (ps[2] goes to the host).
  const int64_t before = r.eng->stats().prefill_tokens;
  const RequestId h = run_cached(r, ps[0], 6, true, false);
  EXPECT_EQ(r.eng->stats().prefill_tokens, before);
  EXPECT_EQ(r.out[h].info.start, StateSource::kHostCache);
  EXPECT_EQ(r.out[h].info.cached_tokens, 13);
  EXPECT_EQ(r.out[h].tokens, r.out[firsts[0]].tokens);
  EXPECT_EQ(r.out[h].state, r.out[firsts[0]].state) << "the host copy is bit-exact";
  c = r.eng->cache_stats();
  EXPECT_EQ(c.host_hits, 1);
  EXPECT_EQ(c.device_hits, 0);
  EXPECT_EQ(c.promotions, 1);
  EXPECT_EQ(c.demotions, 3);
  EXPECT_EQ(c.device_used, 1);
  EXPECT_EQ(c.host_entries, 2) << "exclusive tiers: the promoted entry left the host";

  // Now ps[0] is the device entry: the next hit is a device hit.
  const RequestId d = run_cached(r, ps[0], 6, true, false);
  EXPECT_EQ(r.out[d].info.start, StateSource::kDeviceCache);
  EXPECT_EQ(r.out[d].state, r.out[firsts[0]].state);
  // ps[2] + more: a host hit of ps[2]'s 15 tokens, only the rest prefilled.
  std::vector<int32_t> longer = ps[2];
  const std::vector<int32_t> more = random_tokens(5, r.c.vocab_size, 1299);
  longer.insert(longer.end(), more.begin(), more.end());
  const RequestId cold = run_cached(r, longer, 6, false);
  const int64_t b2 = r.eng->stats().prefill_tokens;
  const RequestId w = run_cached(r, longer, 6, true, false);
  EXPECT_EQ(r.eng->stats().prefill_tokens - b2, 5);
  EXPECT_EQ(r.out[w].info.start, StateSource::kHostCache);
  EXPECT_EQ(r.out[w].info.cached_tokens, 15);
  EXPECT_EQ(r.out[w].tokens, r.out[cold].tokens);

  // Load: 24 requests over 2 live slots, 6 prefixes (some repeated, some extended),
  // submitted at once, stepped while the device tier's occupancy is watched.
  std::vector<RequestId> ids;
  for (int i = 0; i < 24; ++i) {
    std::vector<int32_t> pr = random_tokens(9 + i % 6, r.c.vocab_size, 1300 + i % 6);
    if (i % 4 == 3) pr.push_back(static_cast<int32_t>(i % r.c.vocab_size));
    Request q = r.make(pr, 3 + i % 5);
    q.use_cache = q.cache_prompt_state = q.cache_final_state = true;
    ids.push_back(r.add(std::move(q)));
  }
  int64_t max_used = 0;
  while (!r.eng->idle()) {
    r.eng->step();
    max_used = std::max(max_used, r.eng->cache_stats().device_used);
  }
  EXPECT_EQ(max_used, 1);
  for (RequestId id : ids) EXPECT_EQ(r.out[id].finishes, 1);
  c = r.eng->cache_stats();
  EXPECT_GT(c.hits, 2);
  EXPECT_GT(c.demotions, 3);
  expect_baseline(r, 2, 1);
}

// Without a host tier a demoted entry is dropped; without a device tier every entry lives
// in host memory (the cache as it was before the device tier). Both stay exact.
TEST(EngineCache, EitherTierAlone) {
  {
    Rig r(cache_opts(1, 1, 0));
    const std::vector<int32_t> a = random_tokens(10, r.c.vocab_size, 1401), b = random_tokens(10, r.c.vocab_size, 1402);
    run_cached(r, a, 4, true, false);
    run_cached(r, b, 4, true, false);  // a is demoted, and dropped
    StateCacheStats c = r.eng->cache_stats();
    EXPECT_EQ(c.demotions, 1);
    EXPECT_EQ(c.evictions, 1);
    EXPECT_EQ(c.entries, 1);
    const RequestId m = run_cached(r, a, 4, true, false);
    EXPECT_EQ(r.out[m].info.start, StateSource::kEmpty) << "gone: a miss";
    expect_baseline(r, 1, 1);
  }
  {
    Rig r(cache_opts(1, 0, 1 << 20));
    const std::vector<int32_t> a = random_tokens(10, r.c.vocab_size, 1403);
    const RequestId first = run_cached(r, a, 4, true);
    const RequestId hit = run_cached(r, a, 4, true);
    EXPECT_EQ(r.out[hit].info.start, StateSource::kHostCache);
    EXPECT_EQ(r.out[hit].tokens, r.out[first].tokens);
    EXPECT_EQ(r.out[hit].state, r.out[first].state);
    const StateCacheStats c = r.eng->cache_stats();
    EXPECT_EQ(c.device_slots, 0);
    EXPECT_EQ(c.host_hits, 1);
    EXPECT_EQ(c.promotions, 0);
    EXPECT_EQ(r.eng->pool().slots(), 2);
  }
  {
    Rig r(cache_opts(1, 0, 0));
    EXPECT_FALSE(r.eng->cache_enabled());
    const RequestId id = run_cached(r, random_tokens(5, r.c.vocab_size, 1404), 3, true);
    EXPECT_EQ(r.out[id].tokens.size(), 3u);
    EXPECT_EQ(r.eng->cache_stats().entries, 0);
  }
}

// A session-style start (initial snapshot) and the cache together: the cache is used
// only when it covers more than the snapshot; a longer cached prefix wins.
TEST(EngineCache, InitialSnapshotAndLongerCachedPrefix) {
  Rig r(cache_opts(2, 2, 1 << 20));
  const std::vector<int32_t> p = random_tokens(12, r.c.vocab_size, 1501), q = random_tokens(6, r.c.vocab_size, 1502);
  SnapshotPtr ps, fs;
  run_capturing(r, p, 4, nullptr, &ps, &fs);
  ASSERT_TRUE(ps);
  // Cache p + q's prompt state.
  std::vector<int32_t> pq = p;
  pq.insert(pq.end(), q.begin(), q.end());
  const RequestId seed = run_cached(r, pq, 4, true, false);
  // From the snapshot of p with q to feed: the cached p + q covers more.
  Request a = r.make(q, 4);
  a.initial_state = ps;
  a.use_cache = true;
  const int64_t before = r.eng->stats().prefill_tokens;
  const RequestId ia = r.add(std::move(a));
  r.eng->run_until_idle();
  EXPECT_EQ(r.eng->stats().prefill_tokens, before);
  EXPECT_EQ(r.out[ia].info.start, StateSource::kDeviceCache);
  EXPECT_EQ(r.out[ia].info.cached_tokens, 18);
  EXPECT_EQ(r.out[ia].tokens, r.out[seed].tokens);
  // Without the cache the snapshot starts it and q is prefilled.
  Request b = r.make(q, 4);
  b.initial_state = ps;
  const RequestId ib = r.add(std::move(b));
  r.eng->run_until_idle();
  EXPECT_EQ(r.out[ib].info.start, StateSource::kSnapshot);
  EXPECT_EQ(r.out[ib].info.cached_tokens, 12);
  EXPECT_EQ(r.out[ib].info.prompt_tokens, 6);
  EXPECT_EQ(r.out[ib].tokens, r.out[seed].tokens);
}

TEST(EngineCache, SlotCountsFromOptionsAndBudget) {
  Config c = small_config();
  const int64_t bytes = c.state_bytes_per_sequence();
  int64_t live = 0, cache = 0;
  EngineOptions o = opts(5);
  o.cache_slots = -1;
  ASSERT_TRUE(resolve_slots(c, o, DType::kF32, &live, &cache).is_ok());
  EXPECT_EQ(live, 5);
  EXPECT_EQ(cache, 5);
  o.cache_slots = 3;
  ASSERT_TRUE(resolve_slots(c, o, DType::kF32, &live, &cache).is_ok());
  EXPECT_EQ(cache, 3);
  // A budget of 11 slots (+ arena rounding): scratch + 5 live + 5 cache.
  o = opts(0);
  o.memory_budget = 11 * bytes + 256;
  o.cache_slots = -1;
  ASSERT_TRUE(resolve_slots(c, o, DType::kF32, &live, &cache).is_ok());
  EXPECT_EQ(live, 5);
  EXPECT_EQ(cache, 5);
  o.cache_slots = 2;
  ASSERT_TRUE(resolve_slots(c, o, DType::kF32, &live, &cache).is_ok());
  EXPECT_EQ(live, 8);
  EXPECT_EQ(cache, 2);
  o.cache_slots = 10;  // leaves no live slot
  EXPECT_EQ(resolve_slots(c, o, DType::kF32, &live, &cache).code(), Status::Code::kOutOfMemory);
  o.cache_slots = -2;
  EXPECT_EQ(resolve_slots(c, o, DType::kF32, &live, &cache).code(), Status::Code::kInvalidArgument);
  // The engine allocates exactly that: live + scratch + cache, within the budget.
  auto be = make_cpu_backend();
  Model m;
  ASSERT_TRUE(m.create(c, *be, DType::kF32).is_ok());
  o.cache_slots = -1;
  std::unique_ptr<Engine> e;
  ASSERT_TRUE(Engine::create(m, o, &e).is_ok());
  EXPECT_EQ(e->num_slots(), 5);
  EXPECT_EQ(e->cache_slots(), 5);
  EXPECT_EQ(e->pool().slots(), 11);
  EXPECT_LE(e->pool_bytes(), o.memory_budget);
}

TEST(EngineLogprobs, ChosenTokenAndAlternativesAreTheLogSoftmax) {
  Rig r(opts(1));
  std::vector<TokenLogprobs> lps;
  Request q = r.make(random_tokens(9, r.c.vocab_size, 904), 6);
  q.top_logprobs = 4;
  q.on_logprobs = [&](RequestId, const TokenLogprobs& lp) { lps.push_back(lp); };
  RequestId id = r.add(std::move(q));
  r.eng->run_until_idle();
  ASSERT_EQ(lps.size(), 6u);
  for (size_t i = 0; i < lps.size(); ++i) {
    const TokenLogprobs& lp = lps[i];
    EXPECT_EQ(lp.token, r.out[id].tokens[i]);
    ASSERT_EQ(lp.top.size(), 4u);
    EXPECT_EQ(lp.top[0].first, lp.token) << "greedy takes the most likely token";
    EXPECT_FLOAT_EQ(lp.top[0].second, lp.logprob);
    EXPECT_LT(lp.logprob, 0.f);
    for (size_t k = 1; k < lp.top.size(); ++k) EXPECT_LE(lp.top[k].second, lp.top[k - 1].second);
    double mass = 0;
    for (const auto& [t, v] : lp.top) mass += std::exp(static_cast<double>(v));
    EXPECT_LT(mass, 1.0 + 1e-6);
  }
  // token_logprobs itself on a known row: log-softmax of {0, ln 3} = {ln .25, ln .75}.
  const float row[2] = {0.f, static_cast<float>(std::log(3.0))};
  TokenLogprobs t = token_logprobs(row, 2, 0, 2);
  EXPECT_NEAR(t.logprob, std::log(0.25), 1e-6);
  EXPECT_EQ(t.top[0].first, 1);
  EXPECT_NEAR(t.top[0].second, std::log(0.75), 1e-6);
}

}  // namespace
}  // namespace laplace
