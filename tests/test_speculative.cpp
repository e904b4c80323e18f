// Speculative decoding (docs/serving.md §12) on the CPU: the verification forward and its
// commit against decoding the same tokens one by one (logits and slot bytes).
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <random>

#include "model/model.h"
#include "ops/backend.h"
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


}  // namespace
}  // namespace laplace
