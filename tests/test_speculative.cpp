// Speculative decoding (docs/serving.md §11) on the CPU: the verification forward and its
// commit against decoding the same tokens one by one (logits and slot bytes), the n-gram
// drafter, and the engine with speculation against the engine without it.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <random>

#include "model/model.h"
#include "ops/backend.h"
#include "ops/cpu/cpu_backend.h"
#include "core/file_util.h"
#include "serve/draft_model.h"
#include "serve/drafter.h"
#include "serve/engine.h"
#include "serve/generate.h"
#include "tests/test_util.h"

namespace laplace {
namespace {

using testing::random_tokens;
using testing::small_config;

std::vector<char> pool_bytes(const StatePool& p) {
  std::vector<char> out;
  for (int64_t s = 0; s < p.slots(); ++s) {
    const Tensor t = p.slot(s);
    const char* b = static_cast<const char*>(t.data);
    out.insert(out.end(), b, b + t.nbytes());
  }
  return out;
}

void copy_pool(const StatePool& from, StatePool& to) {
  for (int64_t s = 0; s < from.slots(); ++s) std::memcpy(to.slot(s).data, from.slot(s).data, from.slot(s).nbytes());
}

// Verification of windows of every length 1 … R, then a commit of a random accepted prefix of
// each row (0 included), against the same tokens decoded one step at a time: every position's
// logits are the decode step's bits, and after the commit every byte of the pool (states,
// windows, pending pairs, count words, also the dead pairs past the counts) is the decode
// steps'. Four heads give four phases, so windows meet each head's write-back at a different
// position; 40 rounds from prompts of several lengths pass many cycles.
void check_verify_commit(int64_t R, DType dt) {
  auto be = make_cpu_backend();
  const Config c = small_config(8, 12, 4);
  // m verifies and commits; ref (the same weights) decodes the reference one step at a time, so
  // that no other forward of m comes between a verification and its commit.
  Model m, ref;
  const int64_t B = 3, V = c.vocab_size;
  PlanOptions po;
  po.max_batch = B;
  po.max_seq = 16;
  po.max_tokens = B * 16;
  po.verify_rows = B * R;
  for (Model* x : {&m, &ref}) {
    ASSERT_TRUE(x->create(c, *be, dt).is_ok());
    x->init_weights(23);
    ASSERT_TRUE(x->plan(po).is_ok());
  }
  const PendingSpec spec{R, dt};
  StatePool spec_pool, ref_pool, peek_pool;
  for (StatePool* p : {&spec_pool, &ref_pool, &peek_pool}) ASSERT_TRUE(p->create(c, *be, B + 1, dt, spec).is_ok());
  // Rows in scattered slots, their prompts of 3, 16 and 9 tokens.
  const std::vector<int32_t> slots = {2, 0, 3};
  const int64_t lens[] = {3, 16, 9};
  ForwardOptions pre;
  pre.last_logits_only = true;
  for (int64_t b = 0; b < B; ++b) {
    const auto p = random_tokens(lens[b], V, 50 + b);
    ref.forward(p.data(), 1, lens[b], pre, &ref_pool, &slots[b]);
  }
  copy_pool(ref_pool, spec_pool);
  ForwardOptions step;
  step.form = GlaForm::kRecurrent;
  step.last_logits_only = true;
  std::mt19937_64 rng(99 + R);
  int64_t write_back_windows = 0, partial = 0;
  for (int round = 0; round < 40; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    const int64_t T = 1 + static_cast<int64_t>(rng() % R);
    const std::vector<int32_t> toks = random_tokens(B * T, V, 1000 + round);
    std::vector<int32_t> acc(B);
    for (auto& a : acc) a = static_cast<int32_t>(rng() % (T + 1));
    m.verify(toks.data(), B, T, spec_pool, slots.data());
    std::vector<float> vl;
    logits_rows_to_host(m, 0, B * T, &vl);
    EXPECT_EQ(pool_bytes(spec_pool), pool_bytes(ref_pool)) << "the verification wrote to the pool";
    // Every position against decode steps (on a copy: the reference keeps only the accepted ones).
    copy_pool(ref_pool, peek_pool);
    for (int64_t t = 0; t < T; ++t) {
      std::vector<int32_t> col(B);
      for (int64_t b = 0; b < B; ++b) col[b] = toks[b * T + t];
      ref.forward(col.data(), B, 1, step, &peek_pool, slots.data());
      std::vector<float> dl;
      logits_rows_to_host(ref, 0, B, &dl);
      for (int64_t b = 0; b < B; ++b)
        ASSERT_EQ(std::memcmp(dl.data() + b * V, vl.data() + (b * T + t) * V, V * sizeof(float)), 0)
            << "row " << b << " position " << t << " of " << T;
    }
    // The reference decodes each row's accepted tokens only (rows alone: row-invariant products).
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < acc[b]; ++t) ref.forward(&toks[b * T + t], 1, 1, step, &ref_pool, &slots[b]);
    // Which rows' accepted steps met a write-back (any head), to know the test covered both cases.
    for (int64_t b = 0; b < B; ++b) {
      const int32_t* cnt = static_cast<const int32_t*>(spec_pool.pending(0).count.select(slots[b]).data);
      for (int64_t h = 0; h < c.num_heads; ++h)
        if (pending_m(cnt[h]) + acc[b] + pending_d(cnt[h]) >= R) {
          ++write_back_windows;
          break;
        }
      partial += acc[b] > 0 && acc[b] < T;
    }
    m.commit(acc.data());
    ASSERT_EQ(pool_bytes(spec_pool), pool_bytes(ref_pool)) << "after committing " << acc[0] << ", " << acc[1]
                                                           << ", " << acc[2] << " of " << T;
  }
  EXPECT_GT(write_back_windows, 5);
  EXPECT_GT(partial, 5);
}

TEST(SpeculativeVerify, CommitEqualsDecodingOneByOneBitwiseR4) { check_verify_commit(4, DType::kF32); }
TEST(SpeculativeVerify, CommitEqualsDecodingOneByOneBitwiseR8) { check_verify_commit(8, DType::kF32); }
TEST(SpeculativeVerify, CommitEqualsDecodingOneByOneBitwiseF64) { check_verify_commit(4, DType::kF64); }

// What the verification refuses: a pool without deferred write-back, a window longer than R,
// a plan without verify rows, and a second commit of one verification.
TEST(SpeculativeVerify, RefusesWhatItCannotDoExactly) {
  auto be = make_cpu_backend();
  const Config c = small_config();
  Model m;
  ASSERT_TRUE(m.create(c, *be, DType::kF32).is_ok());
  m.init_weights(3);
  PlanOptions po;
  po.max_batch = 2;
  po.max_seq = 8;
  po.max_tokens = 16;
  po.verify_rows = 16;
  ASSERT_TRUE(m.plan(po).is_ok());
  StatePool plain, r4;
  ASSERT_TRUE(plain.create(c, *be, 2).is_ok());
  ASSERT_TRUE(r4.create(c, *be, 2, DType::kF32, {4, DType::kF32}).is_ok());
  const std::vector<int32_t> toks(16, 1), slots = {0, 1};
  EXPECT_DEATH(m.verify(toks.data(), 2, 2, plain, slots.data()), "deferred write-back");
  EXPECT_DEATH(m.verify(toks.data(), 2, 5, r4, slots.data()), "one write-back per window");
  m.verify(toks.data(), 2, 4, r4, slots.data());
  const std::vector<int32_t> acc = {4, 1};
  m.commit(acc.data());
  EXPECT_DEATH(m.commit(acc.data()), "no verification to commit");
  Model n;
  ASSERT_TRUE(n.create(c, *be, DType::kF32).is_ok());
  po.verify_rows = 0;
  ASSERT_TRUE(n.plan(po).is_ok());
  EXPECT_DEATH(n.verify(toks.data(), 2, 2, r4, slots.data()), "verify_rows");
  po.verify_rows = 17;  // more than the token rows
  EXPECT_FALSE(n.plan(po).is_ok());
}


// ---- the n-gram drafter ------------------------------------------------------------------

std::vector<int32_t> draft(Drafter& d, const std::vector<int32_t>& ctx, int64_t k) {
  std::vector<int32_t> out = {-7};  // cleared by propose
  d.propose(1, ctx, k, &out);
  return out;
}

TEST(NgramDrafter, ContinuesTheMostRecentLongestMatch) {
  NgramDrafter d(3, 1);
  // [1 2 3] occurs at 0 and 4: the more recent one is followed by 7 5.
  EXPECT_EQ(draft(d, {1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3}, 2), (std::vector<int32_t>{7, 5}));
  // A longer match wins over a more recent shorter one: [8 9] at 0 (then 4), [9] alone at 5.
  EXPECT_EQ(draft(d, {8, 9, 4, 6, 2, 9, 1, 8, 9}, 1), (std::vector<int32_t>{4}));
  // Nothing of length 3 or 2 recurs: the last token alone ([6] at 1, then 7 8 6 …); past the
  // context's end the continuation repeats itself.
  EXPECT_EQ(draft(d, {5, 6, 7, 8, 6}, 5), (std::vector<int32_t>{7, 8, 6, 7, 8}));
  EXPECT_EQ(draft(d, {4, 4, 4}, 3), (std::vector<int32_t>{4, 4, 4}));
}

TEST(NgramDrafter, NoGuessGivesNothing) {
  NgramDrafter d(3, 2);
  EXPECT_TRUE(draft(d, {1, 2, 3, 4, 5}, 4).empty());  // no repeat at all
  EXPECT_TRUE(draft(d, {1, 2, 3, 2}, 4).empty());     // only 1-grams recur, min_n is 2
  EXPECT_TRUE(draft(d, {7}, 4).empty());
  EXPECT_TRUE(draft(d, {1, 2, 1, 2}, 0).empty());
  EXPECT_EQ(draft(d, {1, 2, 1, 2}, 1), (std::vector<int32_t>{1}));
}

// ---- the engine ----------------------------------------------------------------------------

SamplingOptions greedy() {
  SamplingOptions s;
  s.temperature = 0;
  return s;
}

// Drafts from known continuations (the tokens a run without speculation gave each prompt),
// each token replaced by a wrong one with probability `error`, and from the n-gram drafter where
// the context is not one it knows: windows then accept anything from none to all of a draft.
class OracleDrafter : public Drafter {
 public:
  OracleDrafter(std::map<std::vector<int32_t>, std::vector<int32_t>> truth, double error, int64_t V)
      : truth_(std::move(truth)), error_(error), V_(V) {}
  void propose(RequestId, std::span<const int32_t> ctx, int64_t k, std::vector<int32_t>* out) override {
    out->clear();
    for (const auto& [prompt, gen] : truth_) {
      if (ctx.size() < prompt.size() || !std::equal(prompt.begin(), prompt.end(), ctx.begin())) continue;
      const size_t done = ctx.size() - prompt.size();
      for (size_t j = done; j < gen.size() && static_cast<int64_t>(out->size()) < k; ++j) {
        const bool wrong = std::uniform_real_distribution<double>(0, 1)(rng_) < error_;
        out->push_back(wrong ? static_cast<int32_t>((gen[j] + 1) % V_) : gen[j]);
      }
      return;
    }
  }

 private:
  std::map<std::vector<int32_t>, std::vector<int32_t>> truth_;
  double error_;
  int64_t V_;
  std::mt19937_64 rng_{5};
};

// What one request gave.
struct Outcome {
  std::vector<int32_t> tokens;
  std::vector<TokenLogprobs> lps;
  FinishInfo info;
  SnapshotPtr final_state;
};

struct SpecRig {
  std::unique_ptr<Backend> be = make_cpu_backend();
  Config c;
  Model m;
  std::unique_ptr<Engine> eng;
  std::map<RequestId, Outcome> out;

  SpecRig(EngineOptions o, Config cfg = small_config(8, 12, 4), uint64_t seed = 7) : c(cfg) {
    EXPECT_TRUE(m.create(c, *be, DType::kF32).is_ok());
    m.init_weights(seed);
    const Status st = Engine::create(m, o, &eng);
    EXPECT_TRUE(st.is_ok()) << st.to_string();
  }
  Request make(const std::vector<int32_t>& prompt, int64_t max_tokens, SamplingOptions so = greedy()) {
    Request r;
    r.prompt = prompt;
    r.max_tokens = max_tokens;
    r.sampling = so;
    r.capture_final_state = true;
    r.on_token = [this](RequestId id, int32_t t) { out[id].tokens.push_back(t); };
    r.on_finish = [this](const FinishInfo& f) {
      out[f.id].info = f;
      out[f.id].final_state = f.final_state;
    };
    return r;
  }
  RequestId add(Request r) {
    RequestId id = 0;
    const Status st = eng->submit(std::move(r), &id);
    EXPECT_TRUE(st.is_ok()) << st.to_string();
    return id;
  }
};

EngineOptions spec_opts(int64_t slots, int64_t R, int64_t k, std::shared_ptr<Drafter> d = nullptr) {
  EngineOptions o;
  o.max_slots = slots;
  o.prefill_chunk = 8;
  o.max_batch_tokens = 64;
  o.defer_writeback = R;
  o.speculative_k = k;
  o.drafter = std::move(d);
  return o;
}

// Prompts with repeats in them (the n-gram drafter's ground) and without, of several lengths.
std::vector<std::vector<int32_t>> mixed_prompts(int64_t V, int n) {
  std::vector<std::vector<int32_t>> ps;
  for (int i = 0; i < n; ++i) {
    std::vector<int32_t> p = random_tokens(2 + 5 * i, V, 300 + i);
    if (i % 2 == 0) {
      const std::vector<int32_t> again = p;
      p.insert(p.end(), again.begin(), again.end());
    }
    ps.push_back(p);
  }
  return ps;
}

// Submits every prompt (one every `stagger` steps), runs to the end; outcomes in prompt order.
std::vector<Outcome> run_all(SpecRig& r, const std::vector<std::vector<int32_t>>& prompts,
                             const std::vector<int64_t>& max_tokens, int stagger, SamplingOptions so = greedy()) {
  std::vector<RequestId> ids;
  for (size_t i = 0; i < prompts.size(); ++i) {
    Request q = r.make(prompts[i], max_tokens[i % max_tokens.size()], so);
    if (i % 3 == 1) q.eos_id = q.prompt.back();  // some end early, at an eos inside a window
    ids.push_back(r.add(std::move(q)));
    for (int s = 0; s < stagger; ++s) r.eng->step();
  }
  r.eng->run_until_idle();
  std::vector<Outcome> res;
  for (RequestId id : ids) res.push_back(r.out[id]);
  return res;
}

void expect_same(const std::vector<Outcome>& got, const std::vector<Outcome>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    SCOPED_TRACE("request " + std::to_string(i));
    EXPECT_EQ(got[i].tokens, want[i].tokens);
    EXPECT_EQ(got[i].info.reason, want[i].info.reason);
    ASSERT_TRUE(got[i].final_state && want[i].final_state);
    EXPECT_EQ(got[i].final_state->tokens, want[i].final_state->tokens);
    EXPECT_TRUE(got[i].final_state->state == want[i].final_state->state) << "final state bytes differ";
    EXPECT_EQ(std::memcmp(got[i].final_state->logits.data(), want[i].final_state->logits.data(),
                          want[i].final_state->logits.size() * sizeof(float)),
              0)
        << "final logits differ";
  }
}

// Greedy tokens with speculation are the tokens without it, bitwise on the CPU, and so are the
// final states and logits: for k = 1, 3 and 7, with n-gram drafts and with drafts that are
// right about half or most of the time (every accept length occurs), more requests than slots,
// staggered arrivals, requests ending at an eos inside a window and at max_tokens.
TEST(SpeculativeEngine, GreedyTokensAndStatesEqualDecodingWithoutBitwise) {
  const Config c = small_config(8, 12, 4);
  const auto prompts = mixed_prompts(c.vocab_size, 7);
  const std::vector<int64_t> maxt = {150, 97, 181, 64};
  for (int64_t R : {4, 8}) {
    SpecRig plain(spec_opts(3, R, 0));
    const std::vector<Outcome> want = run_all(plain, prompts, maxt, 2);
    std::map<std::vector<int32_t>, std::vector<int32_t>> truth;
    int64_t steps = 0;
    for (size_t i = 0; i < prompts.size(); ++i) {
      truth[prompts[i]] = want[i].tokens;
      steps += static_cast<int64_t>(want[i].tokens.size());
    }
    EXPECT_GT(steps, 700);
    for (int64_t k : {int64_t{1}, int64_t{3}, R - 1}) {
      for (double error : {-1.0, 0.5, 0.1}) {
        SCOPED_TRACE("R " + std::to_string(R) + " k " + std::to_string(k) + " error " + std::to_string(error));
        std::shared_ptr<Drafter> d;
        if (error >= 0) d = std::make_shared<OracleDrafter>(truth, error, c.vocab_size);
        SpecRig spec(spec_opts(3, R, k, d));
        expect_same(run_all(spec, prompts, maxt, 2), want);
        const EngineStats st = spec.eng->stats();
        EXPECT_GT(st.verify_forwards, 0);
        EXPECT_GT(st.accepted_tokens, 0);
        if (error >= 0) {
          EXPECT_LT(st.accepted_tokens, st.drafted_tokens);
          // Fewer forwards than tokens: several tokens per forward on average.
          EXPECT_LT(st.decode_forwards, st.generated_tokens / 2 + 1);
        }
      }
    }
  }
}

// The same with a sampler that is greedy but not plain (a repetition penalty, logit biases):
// its penalties count the tokens accepted earlier in the same window.
TEST(SpeculativeEngine, PenalisedGreedyEqualsDecodingWithout) {
  const Config c = small_config(8, 12, 4);
  const auto prompts = mixed_prompts(c.vocab_size, 5);
  SamplingOptions so = greedy();
  so.repetition_penalty = 1.3;
  so.frequency_penalty = 0.2;
  so.logit_bias = {{3, 0.5f}};
  SpecRig plain(spec_opts(2, 8, 0));
  const std::vector<Outcome> want = run_all(plain, prompts, {60, 45}, 1, so);
  std::map<std::vector<int32_t>, std::vector<int32_t>> truth;
  for (size_t i = 0; i < prompts.size(); ++i) truth[prompts[i]] = want[i].tokens;
  SpecRig spec(spec_opts(2, 8, 5, std::make_shared<OracleDrafter>(truth, 0.2, c.vocab_size)));
  expect_same(run_all(spec, prompts, {60, 45}, 1, so), want);
  EXPECT_GT(spec.eng->stats().accepted_tokens, 0);
}

// Logprobs, a stop that only the caller sees (Request::stop_after, e.g. a stop string), cancel
// from a callback inside a window, and the state cache: as without speculation.
TEST(SpeculativeEngine, LogprobsStopAfterCancelAndCacheKeepWorking) {
  const Config c = small_config(8, 12, 4);
  const auto prompts = mixed_prompts(c.vocab_size, 4);
  auto run = [&](int64_t k, std::shared_ptr<Drafter> d) {
    EngineOptions o = spec_opts(2, 8, k, d);
    o.cache_slots = 2;
    o.cache_host_bytes = 1 << 20;
    SpecRig r(o);
    std::vector<RequestId> ids;
    for (size_t i = 0; i < prompts.size(); ++i) {
      Request q = r.make(prompts[i], 40);
      q.top_logprobs = 3;
      q.on_logprobs = [&r](RequestId id, const TokenLogprobs& lp) { r.out[id].lps.push_back(lp); };
      q.cache_final_state = true;
      if (i == 1) {  // a stop string ends it after its 13th token
        q.stop_after = [&r](RequestId id, int32_t) { return r.out[id].tokens.size() == 13; };
      }
      if (i == 2) {  // cancelled from its own 9th token's callback
        RequestId* self = new RequestId(0);
        auto prev = q.on_token;
        q.on_token = [&r, prev, self](RequestId id, int32_t t) {
          prev(id, t);
          if (r.out[id].tokens.size() == 9) r.eng->cancel(id);
        };
        delete self;
      }
      ids.push_back(r.add(std::move(q)));
    }
    r.eng->run_until_idle();
    // A second turn of prompt 0 through the cache: its context, then more.
    std::vector<int32_t> turn = prompts[0];
    turn.insert(turn.end(), r.out[ids[0]].tokens.begin(), r.out[ids[0]].tokens.end());
    turn.push_back(5);
    Request q = r.make(turn, 20);
    q.use_cache = true;
    ids.push_back(r.add(std::move(q)));
    r.eng->run_until_idle();
    std::vector<Outcome> res;
    for (RequestId id : ids) res.push_back(r.out[id]);
    return res;
  };
  const std::vector<Outcome> want = run(0, nullptr);
  std::map<std::vector<int32_t>, std::vector<int32_t>> truth;
  for (size_t i = 0; i < prompts.size(); ++i) truth[prompts[i]] = want[i].tokens;
  for (auto d : {std::shared_ptr<Drafter>(), std::shared_ptr<Drafter>(std::make_shared<OracleDrafter>(truth, 0.1, c.vocab_size))}) {
    const std::vector<Outcome> got = run(7, d);
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) {
      SCOPED_TRACE("request " + std::to_string(i));
      EXPECT_EQ(got[i].tokens, want[i].tokens);
      EXPECT_EQ(got[i].info.reason, want[i].info.reason);
      EXPECT_EQ(got[i].info.cached_tokens, want[i].info.cached_tokens);
      ASSERT_EQ(got[i].lps.size(), want[i].lps.size());
      for (size_t j = 0; j < want[i].lps.size(); ++j) {
        EXPECT_EQ(got[i].lps[j].token, want[i].lps[j].token);
        EXPECT_EQ(got[i].lps[j].logprob, want[i].lps[j].logprob);
        EXPECT_EQ(got[i].lps[j].top, want[i].lps[j].top);
      }
      if (want[i].final_state) {
        ASSERT_TRUE(got[i].final_state);
        EXPECT_TRUE(got[i].final_state->state == want[i].final_state->state);
      }
    }
    EXPECT_EQ(got[1].tokens.size(), 13u);
    EXPECT_EQ(got[1].info.reason, FinishReason::kStop);
    EXPECT_EQ(got[2].tokens.size(), 9u);
    EXPECT_EQ(got[2].info.reason, FinishReason::kCancelled);
    EXPECT_GT(got[4].info.cached_tokens, 0);
  }
}

// A CPU backend that lacks the verification ops, as the CUDA backend does today.
class NoVerifyBackend : public CpuBackend {
 public:
  bool supports(const OpQuery& q) const override {
    return q.op != "gla_verify_deferred" && q.op != "gla_verify_commit" && CpuBackend::supports(q);
  }
};

// Start-up errors, never a wrong token: k out of range, R ≤ k or no deferred write-back, a
// backend without the verification ops.
TEST(SpeculativeEngine, ClearErrorsAtStartUp) {
  auto be = make_cpu_backend();
  const Config c = small_config();
  Model m;
  ASSERT_TRUE(m.create(c, *be, DType::kF32).is_ok());
  m.init_weights(1);
  std::unique_ptr<Engine> e;
  Status st = Engine::create(m, spec_opts(2, 16, 9), &e);
  EXPECT_EQ(st.code(), Status::Code::kInvalidArgument);
  EXPECT_NE(st.message().find("1 to 8"), std::string::npos) << st.message();
  st = Engine::create(m, spec_opts(2, 16, -1), &e);
  EXPECT_EQ(st.code(), Status::Code::kInvalidArgument);
  st = Engine::create(m, spec_opts(2, 4, 4), &e);
  EXPECT_EQ(st.code(), Status::Code::kInvalidArgument);
  EXPECT_NE(st.message().find("R > k"), std::string::npos) << st.message();
  st = Engine::create(m, spec_opts(2, 0, 2), &e);
  EXPECT_EQ(st.code(), Status::Code::kInvalidArgument);
  EXPECT_NE(st.message().find("--defer-writeback 4, 8 or 16"), std::string::npos) << st.message();
  EXPECT_TRUE(Engine::create(m, spec_opts(2, 16, 8), &e).is_ok());
  NoVerifyBackend nv;
  Model n;
  ASSERT_TRUE(n.create(c, nv, DType::kF32).is_ok());
  st = Engine::create(n, spec_opts(2, 8, 3), &e);
  EXPECT_EQ(st.code(), Status::Code::kUnsupported);
  EXPECT_NE(st.message().find("verification"), std::string::npos) << st.message();
}

// ---- the draft model -------------------------------------------------------------------------

// A draft model with the target's shapes and the weights of init seed `seed`.
std::unique_ptr<DraftModelDrafter> draft_model(Backend& be, const Config& c, uint64_t seed, int64_t slots,
                                               int64_t chunk = 64) {
  auto m = std::make_unique<Model>();
  EXPECT_TRUE(m->create(c, be, DType::kF32).is_ok());
  m->init_weights(seed);
  std::unique_ptr<DraftModelDrafter> d;
  const Status st = DraftModelDrafter::create(std::move(m), c.vocab_size, slots, chunk, &d);
  EXPECT_TRUE(st.is_ok()) << st.to_string();
  return d;
}

// The drafts are the draft model's own greedy continuation (the engine's tokens without
// speculation, for a draft model that is the target), fed incrementally: a second call feeds
// only the tokens the context gained, and a context that is not the one fed starts over.
TEST(DraftModel, ProposesItsGreedyContinuationFeedingOnlyWhatIsNew) {
  const Config c = small_config(8, 12, 4);
  SpecRig plain(spec_opts(2, 8, 0));
  const std::vector<int32_t> prompt = random_tokens(37, c.vocab_size, 71);
  const RequestId id = plain.add(plain.make(prompt, 12));
  plain.eng->run_until_idle();
  const std::vector<int32_t> want = plain.out[id].tokens;
  ASSERT_EQ(want.size(), 12u);
  auto d = draft_model(*plain.be, c, 7, 2, 16);  // the target's weights (SpecRig's seed 7)
  // The context as the engine holds it: the prompt and the tokens emitted so far (the last of
  // them is the next input); the draft continues it.
  std::vector<int32_t> ctx = prompt;
  ctx.push_back(want[0]);
  std::vector<int32_t> out;
  d->propose(5, ctx, 4, &out);
  EXPECT_EQ(out, std::vector<int32_t>(want.begin() + 1, want.begin() + 5));
  EXPECT_EQ(d->fed_tokens(), static_cast<int64_t>(prompt.size()));
  ctx.insert(ctx.end(), want.begin() + 1, want.begin() + 4);
  d->propose(5, ctx, 5, &out);
  EXPECT_EQ(out, std::vector<int32_t>(want.begin() + 4, want.begin() + 9));
  EXPECT_EQ(d->fed_tokens(), static_cast<int64_t>(prompt.size()) + 3);
  // Another request, then more than the two slots: the least recent gives its slot up.
  d->propose(6, prompt, 2, &out);
  d->propose(7, prompt, 2, &out);
  EXPECT_EQ(d->evictions(), 1);
  d->propose(5, ctx, 5, &out);  // fed again from the start, the same drafts
  EXPECT_EQ(out, std::vector<int32_t>(want.begin() + 4, want.begin() + 9));
  EXPECT_EQ(d->evictions(), 2);
  // A context that is not the one fed for that id (shorter) starts over.
  d->propose(5, std::vector<int32_t>(prompt.begin(), prompt.begin() + 3), 0, &out);
  EXPECT_TRUE(out.empty());
  d->propose(5, ctx, 5, &out);
  EXPECT_EQ(out, std::vector<int32_t>(want.begin() + 4, want.begin() + 9));
}

// Greedy decoding with a draft model gives the tokens, final states and logits of decoding
// without it, bitwise: with the target's own weights as the draft (nearly every draft taken)
// and with other weights (few taken), with fewer draft slots than sequences.
TEST(SpeculativeEngine, DraftModelGreedyEqualsDecodingWithoutBitwise) {
  const Config c = small_config(8, 12, 4);
  const auto prompts = mixed_prompts(c.vocab_size, 6);
  const std::vector<int64_t> maxt = {90, 61, 120};
  SpecRig plain(spec_opts(3, 8, 0));
  const std::vector<Outcome> want = run_all(plain, prompts, maxt, 2);
  for (uint64_t seed : {uint64_t{7}, uint64_t{8}}) {
    SCOPED_TRACE("draft seed " + std::to_string(seed));
    auto be = make_cpu_backend();
    std::shared_ptr<DraftModelDrafter> d = draft_model(*be, c, seed, 2);
    SpecRig spec(spec_opts(3, 8, 5, d));
    expect_same(run_all(spec, prompts, maxt, 2), want);
    const EngineStats st = spec.eng->stats();
    EXPECT_GT(st.verify_forwards, 0);
    EXPECT_GT(d->evictions(), 0);
    if (seed == 7) {
      EXPECT_GT(st.accepted_tokens, st.drafted_tokens * 9 / 10);
      EXPECT_LT(st.decode_forwards, st.generated_tokens / 3);
    } else {
      EXPECT_LT(st.accepted_tokens, st.drafted_tokens / 2);
    }
  }
}

// --speculative draft:DIR loads the directory at Engine::create and refuses, naming the reason,
// a draft model of another vocabulary or another tokenizer file, and a directory with no model.
TEST(SpeculativeEngine, DraftModelDirectoryIsCheckedAtStartUp) {
  const Config c = small_config(8, 12, 4);
  const std::string dir = testing::make_temp_dir("draft_model");
  auto save = [&](const std::string& d, const Config& cc, const std::string& tok) {
    std::filesystem::create_directories(d);
    const std::string cj = cc.to_json();
    ASSERT_TRUE(write_file_atomic(d + "/config.json", cj.data(), cj.size()).is_ok());
    auto be = make_cpu_backend();
    Model m;
    ASSERT_TRUE(m.create(cc, *be, DType::kF32).is_ok());
    m.init_weights(7);
    ASSERT_TRUE(m.save(d + "/model.safetensors").is_ok());
    ASSERT_TRUE(write_file_atomic(d + "/tokenizer.model", tok.data(), tok.size()).is_ok());
  };
  save(dir + "/good", c, "the tokenizer");
  Config other = c;
  other.vocab_size = c.vocab_size + 1;
  save(dir + "/vocab", other, "the tokenizer");
  save(dir + "/tok", c, "another tokenizer");
  const std::string target_tok = dir + "/target.model";
  ASSERT_TRUE(write_file_atomic(target_tok, "the tokenizer", 13).is_ok());

  auto opts = [&](const std::string& d) {
    EngineOptions o = spec_opts(2, 8, 3);
    o.draft_model = d;
    o.draft_tokenizer = target_tok;
    return o;
  };
  auto be = make_cpu_backend();
  Model m;
  ASSERT_TRUE(m.create(c, *be, DType::kF32).is_ok());
  m.init_weights(7);
  std::unique_ptr<Engine> e;
  Status st = Engine::create(m, opts(dir + "/vocab"), &e);
  EXPECT_EQ(st.code(), Status::Code::kInvalidArgument);
  EXPECT_NE(st.message().find("vocabulary"), std::string::npos) << st.message();
  st = Engine::create(m, opts(dir + "/tok"), &e);
  EXPECT_EQ(st.code(), Status::Code::kInvalidArgument);
  EXPECT_NE(st.message().find("tokenizer"), std::string::npos) << st.message();
  st = Engine::create(m, opts(dir + "/none"), &e);
  EXPECT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("none"), std::string::npos) << st.message();
  st = Engine::create(m, opts(dir + "/good"), &e);
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  // The loaded draft is the target's weights: its drafts are taken.
  Request r;
  r.prompt = random_tokens(20, c.vocab_size, 3);
  r.max_tokens = 40;
  r.sampling = greedy();
  ASSERT_TRUE(e->submit(std::move(r), nullptr).is_ok());
  e->run_until_idle();
  EXPECT_GT(e->stats().accepted_tokens, 20);
}

// ---- sampling keeps the target distribution ---------------------------------------------

// The chi-square statistic of observed counts against probabilities (bins with an expected
// count under 5 pooled into one), and the critical value at level 1e-3 for its degrees of
// freedom (Wilson–Hilferty: df·(1 − 2/(9df) + z·√(2/(9df)))³, z = 3.090 for the upper 0.1 %).
struct ChiSquare {
  double stat = 0, critical = 0;
  int64_t df = 0;
};
ChiSquare chi_square(const std::vector<int64_t>& counts, const std::vector<double>& p, int64_t n) {
  ChiSquare r;
  double pooled_obs = 0, pooled_exp = 0;
  int64_t bins = 0;
  for (size_t i = 0; i < p.size(); ++i) {
    const double e = p[i] * static_cast<double>(n);
    if (e < 5) {
      pooled_obs += static_cast<double>(counts[i]);
      pooled_exp += e;
      continue;
    }
    r.stat += (static_cast<double>(counts[i]) - e) * (static_cast<double>(counts[i]) - e) / e;
    ++bins;
  }
  if (pooled_exp > 0) {
    r.stat += (pooled_obs - pooled_exp) * (pooled_obs - pooled_exp) / std::max(pooled_exp, 1e-9);
    ++bins;
  }
  r.df = bins - 1;
  const double df = static_cast<double>(r.df), a = 2.0 / (9.0 * df);
  r.critical = df * std::pow(1.0 - a + 3.090 * std::sqrt(a), 3.0);
  return r;
}

// The distribution Sampler draws from at temperature t with top-k and top-p (no penalties):
// softmax(logits / t) over the k best, cut where the cumulative probability reaches top_p.
std::vector<double> target(const std::vector<float>& logits, double t, int64_t top_k, double top_p) {
  const int64_t V = static_cast<int64_t>(logits.size());
  std::vector<int32_t> order(V);
  for (int64_t i = 0; i < V; ++i) order[i] = static_cast<int32_t>(i);
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); });
  const int64_t keep = top_k > 0 ? std::min(top_k, V) : V;
  std::vector<double> q(keep);
  double sum = 0;
  for (int64_t i = 0; i < keep; ++i) sum += q[i] = std::exp((logits[order[i]] - logits[order[0]]) / t);
  int64_t cut = 0;
  double cum = 0;
  while (cut < keep) {
    cum += q[cut++] / sum;
    if (cum >= top_p) break;
  }
  double kept = 0;
  for (int64_t i = 0; i < cut; ++i) kept += q[i];
  std::vector<double> p(V, 0.0);
  for (int64_t i = 0; i < cut; ++i) p[order[i]] = q[i] / kept;
  return p;
}

// Sampler::sample_speculative against a fixed row: whatever the draft — the likeliest token, a
// less likely one, one that top-k/top-p cut off — the tokens follow the sampler's distribution
// (chi-square at level 1e-3, 40,000 draws each), as sample()'s do; and the draft is taken about
// p(draft) of the time.
TEST(SpeculativeSampling, RejectionAgainstAPointDraftKeepsTheDistribution) {
  const int64_t V = 24, n = 40000;
  std::vector<float> logits(V);
  std::mt19937_64 g(17);
  for (auto& x : logits) x = static_cast<float>(std::normal_distribution<double>(0, 1.5)(g));
  SamplingOptions so;
  so.temperature = 0.8;
  so.top_k = 16;
  so.top_p = 0.95;
  const std::vector<double> p = target(logits, so.temperature, so.top_k, so.top_p);
  std::vector<int32_t> by_p(V);
  for (int64_t i = 0; i < V; ++i) by_p[i] = static_cast<int32_t>(i);
  std::sort(by_p.begin(), by_p.end(), [&](int32_t a, int32_t b) { return p[a] > p[b]; });
  ASSERT_EQ(p[by_p[V - 1]], 0.0);  // some tokens are cut off
  for (int32_t draft : {-1, by_p[0], by_p[3], by_p[V - 1]}) {
    SCOPED_TRACE("draft " + std::to_string(draft));
    std::vector<int64_t> counts(V, 0);
    for (int64_t i = 0; i < n; ++i) {
      so.seed = 1000 + static_cast<uint64_t>(i);
      Sampler s(so);
      ++counts[s.sample_speculative(logits.data(), V, draft)];
    }
    const ChiSquare x = chi_square(counts, p, n);
    EXPECT_LT(x.stat, x.critical) << "df " << x.df;
    for (int64_t v = 0; v < V; ++v) {
      if (p[v] == 0) {
        EXPECT_EQ(counts[v], 0) << "token " << v << " has probability 0";
      }
    }
  }
}

// A drafter that always proposes the same tokens.
class FixedDrafter : public Drafter {
 public:
  explicit FixedDrafter(std::vector<int32_t> d) : d_(std::move(d)) {}
  void propose(RequestId, std::span<const int32_t>, int64_t k, std::vector<int32_t>* out) override {
    out->assign(d_.begin(), d_.begin() + std::min<int64_t>(k, static_cast<int64_t>(d_.size())));
  }

 private:
  std::vector<int32_t> d_;
};

// The engine's sampled tokens with speculation follow the model's distribution. Each of 3,000
// requests (seeds 0 … 2,999) samples two tokens after one prompt: y0 from the prefill's logits,
// y1 in a verification window whose draft is the likeliest y1, so that y1 is accepted in a good
// share of the requests and drawn from the residual in the rest. The exact law of y1,
// Σ_y0 p(y0 | prompt) p(y1 | prompt, y0), comes from one forward per y0; the counts of y1 with
// and without speculation each pass a chi-square test against it at level 1e-3.
TEST(SpeculativeSampling, EngineTokensFollowTheModelsDistribution) {
  const Config c = small_config(8, 12, 4);
  const int64_t V = c.vocab_size, n = 3000;
  const std::vector<int32_t> prompt = random_tokens(6, V, 77);
  SamplingOptions so;
  so.temperature = 0.04;  // the random model's logits are flat; sharpen them so drafts get taken
  // The exact law of y1 from the model alone.
  std::vector<double> law(V, 0.0);
  {
    auto be = make_cpu_backend();
    Model m;
    ASSERT_TRUE(m.create(c, *be, DType::kF32).is_ok());
    m.init_weights(7);
    ASSERT_TRUE(m.plan({1, 8, false, false}).is_ok());
    ForwardOptions fo;
    fo.last_logits_only = true;
    std::vector<float> lg;
    m.forward(prompt.data(), 1, static_cast<int64_t>(prompt.size()), fo);
    logits_rows_to_host(m, 0, 1, &lg);
    const std::vector<double> p0 = target(lg, so.temperature, 0, 1.0);
    for (int64_t y0 = 0; y0 < V; ++y0) {
      std::vector<int32_t> ctx = prompt;
      ctx.push_back(static_cast<int32_t>(y0));
      m.forward(ctx.data(), 1, static_cast<int64_t>(ctx.size()), fo);
      logits_rows_to_host(m, 0, 1, &lg);
      const std::vector<double> p1 = target(lg, so.temperature, 0, 1.0);
      for (int64_t y1 = 0; y1 < V; ++y1) law[y1] += p0[y0] * p1[y1];
    }
  }
  const int32_t likeliest = static_cast<int32_t>(std::max_element(law.begin(), law.end()) - law.begin());
  std::printf("p(y1 = %d) = %.3f\n", likeliest, law[likeliest]);
  for (int64_t k : {0, 1}) {
    SCOPED_TRACE("k " + std::to_string(k));
    EngineOptions o = spec_opts(64, 8, k, std::make_shared<FixedDrafter>(std::vector<int32_t>{likeliest}));
    o.max_batch_tokens = 512;
    SpecRig r(o);
    std::vector<RequestId> ids;
    for (int64_t i = 0; i < n; ++i) {
      so.seed = static_cast<uint64_t>(i);
      Request q = r.make(prompt, 3, so);  // room for a one-token draft after y0
      q.capture_final_state = false;
      q.eos_id = -1;
      ids.push_back(r.add(std::move(q)));
    }
    r.eng->run_until_idle();
    std::vector<int64_t> counts(V, 0);
    for (RequestId id : ids) {
      ASSERT_EQ(r.out[id].tokens.size(), 3u);
      ++counts[r.out[id].tokens[1]];
    }
    const ChiSquare x = chi_square(counts, law, n);
    EXPECT_LT(x.stat, x.critical) << "df " << x.df;
    const EngineStats st = r.eng->stats();
    if (k == 1) {
      EXPECT_EQ(st.drafted_tokens, n);
      EXPECT_GT(st.accepted_tokens, n / 10) << "the accepting branch was hardly tested";
      EXPECT_LT(st.accepted_tokens, n * 9 / 10) << "the residual branch was hardly tested";
    }
  }
}

}  // namespace
}  // namespace laplace
