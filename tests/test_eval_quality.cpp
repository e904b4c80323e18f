// The quality evaluations on held-out text (eval/stream.h, eval/recall.h, eval/context.h,
// eval/serving.h, `laplace eval copy|passkey|position|serving`): feeding a context in pieces
// equals one forward, the position buckets add up to the whole sequence's loss, results do not
// depend on how trials are batched, deferred write-back passes its indistinguishability bar on
// the CPU, and bad arguments get clear errors.
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <sys/wait.h>
#include <string>

#include <nlohmann/json.hpp>

#include "core/file_util.h"
#include "core/rng.h"
#include "eval/context.h"
#include "eval/recall.h"
#include "eval/serving.h"
#include "model/quantize.h"
#include "eval/stream.h"
#include "model/model.h"
#include "ops/backend.h"
#include "serve/generate.h"
#include "tests/test_util.h"
#include "text/shard.h"
#include "text/tokenizer.h"

namespace laplace {
namespace {

struct Tiny {
  std::unique_ptr<Backend> be = make_cpu_backend();
  Model m;
  explicit Tiny(DType dt, int64_t V = 53) {
    Config c = testing::small_config(8, 12, 2);
    c.vocab_size = V;
    EXPECT_TRUE(m.create(c, *be, dt).is_ok());
    m.init_weights(5);
  }
};

// "Held-out text": a repetitive token stream, so the loss depends on the context.
std::vector<int32_t> heldout_stream(int64_t n, int64_t V) {
  std::vector<int32_t> t = testing::random_tokens(n, V, 99);
  for (int64_t i = 16; i < n; ++i)
    if (i % 3) t[static_cast<size_t>(i)] = t[static_cast<size_t>(i - 16)];
  return t;
}

TEST(EvalStream, PiecesEqualOneForward) {
  Tiny t(DType::kF64);
  const int64_t B = 3, n = 45, K = 6, V = t.m.config().vocab_size;
  const std::vector<int32_t> x = testing::random_tokens(B * n, V, 3);
  // The whole sequences at once, from the empty state.
  ASSERT_TRUE(t.m.plan({B, n, false, false}).is_ok());
  t.m.forward(x.data(), B, n, ForwardOptions{});
  std::vector<float> whole;
  logits_rows_to_host(t.m, 0, B * n, &whole);
  // The same in pieces of 7 (a context carried in the pool), the last 6 positions' logits.
  SequenceStream s;
  ASSERT_TRUE(s.init(&t.m, B, 7, 6).is_ok());
  s.reset();
  std::vector<int32_t> head(B * (n - K)), tail(B * K);
  for (int64_t b = 0; b < B; ++b) {
    std::copy_n(x.data() + b * n, n - K, head.data() + b * (n - K));
    std::copy_n(x.data() + b * n + n - K, K, tail.data() + b * K);
  }
  s.feed(head.data(), n - K);
  std::vector<float> last;
  s.feed_logits(tail.data(), K, &last);
  double worst = 0;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < K; ++i)
      for (int64_t v = 0; v < V; ++v)
        worst = std::max(worst, std::fabs(static_cast<double>(last[(b * K + i) * V + v]) -
                                          whole[(b * n + n - K + i) * V + v]));
  EXPECT_LT(worst, 1e-6) << "F64 model, logits read back as F32";
  // A second pass after reset() gives the same bits: the states were cleared.
  s.reset();
  s.feed(head.data(), n - K);
  std::vector<float> again;
  s.feed_logits(tail.data(), K, &again);
  EXPECT_EQ(again, last);
}

TEST(EvalPosition, BucketsAddUpToTheWholeSequenceLoss) {
  Tiny t(DType::kF64);
  const int64_t V = t.m.config().vocab_size;
  const std::vector<int32_t> held = heldout_stream(5000, V);
  PositionLossOptions o;
  o.context = 300;
  o.streams = 2;
  o.piece = 64;
  o.first_bucket = 16;
  o.seed = 4;
  std::vector<PositionBucket> got;
  ASSERT_TRUE(eval_position_loss(t.m, held, o, [&](const PositionBucket& b) { got.push_back(b); }).is_ok());
  // [0,16) [16,32) [32,64) [64,128) [128,256) [256,300)
  ASSERT_EQ(got.size(), 6u);
  double sum = 0;
  int64_t count = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].begin, i == 0 ? 0 : got[i - 1].end);
    EXPECT_EQ(got[i].count, 2 * (got[i].end - got[i].begin));
    EXPECT_GT(got[i].memory_bytes, 0);
    sum += got[i].loss_sum;
    count += got[i].count;
  }
  EXPECT_EQ(got.back().end, 300);
  // Every bucket after the first is fed after the state of all earlier positions: the total
  // must be the whole sequences' loss in one forward. The streams come from the seeded
  // offsets, so search the held-out text for them.
  std::vector<int32_t> x, y;
  SplitMix64 rng{splitmix64_hash(o.seed)};
  for (int64_t s = 0; s < 2; ++s) {
    const int64_t off = static_cast<int64_t>(rng.below(held.size() - 300));
    x.insert(x.end(), held.begin() + off, held.begin() + off + 300);
    y.insert(y.end(), held.begin() + off + 1, held.begin() + off + 301);
  }
  ASSERT_TRUE(t.m.plan({2, 300, false, false}).is_ok());
  t.m.forward(x.data(), 2, 300, ForwardOptions{});
  const double whole = t.m.loss(y.data());
  EXPECT_NEAR(sum / static_cast<double>(count), whole, 1e-9);
  // (Whether context lowers the loss is not asked of random weights: their buckets differ by
  // noise. The sum above is what shows each bucket saw the state of every earlier position.)
}

// ---- whole documents from the zero state (eval_document_position_loss) ---------------------

// Held-out "documents": a stray tail of an earlier document, then each document after its
// separator (2); the tokens themselves never 2.
std::vector<int32_t> documents_stream(const std::vector<int64_t>& lengths, int64_t V) {
  std::vector<int32_t> t = {7, 8, 9};
  uint64_t seed = 40;
  for (int64_t n : lengths) {
    t.push_back(2);
    std::vector<int32_t> d = heldout_stream(std::max<int64_t>(n, 1), V);
    std::vector<int32_t> r = testing::random_tokens(std::max<int64_t>(n, 1), V, ++seed);
    for (int64_t i = 0; i < n; ++i) {
      int32_t v = i % 2 ? d[static_cast<size_t>(i)] : r[static_cast<size_t>(i)];
      t.push_back(v == 2 ? 3 : v);
    }
  }
  return t;
}

// The reference: each document alone in one plain forward from the empty state, [sep, t1, …]
// predicting [t1, t2, …], up to `context` positions; the loss of every position by log-softmax.
std::vector<PositionBucket> documents_alone(Model& m, const std::vector<int32_t>& toks, int64_t min_tokens,
                                            int64_t context, int64_t first_bucket) {
  const int64_t V = m.config().vocab_size;
  std::vector<std::pair<int64_t, int64_t>> docs;  // begin, scored positions
  for (const DocumentSpan& d : split_documents(toks, 2))
    if (d.tokens >= min_tokens) docs.push_back({d.begin, std::min(d.tokens, context)});
  int64_t L = 0;
  for (const auto& d : docs) L = std::max(L, d.second);
  std::vector<PositionBucket> out;
  for (int64_t b0 = 0; b0 < L;) {
    PositionBucket b;
    b.begin = b0;
    b.end = std::min(L, b0 == 0 ? first_bucket : 2 * b0);
    out.push_back(b);
    b0 = b.end;
  }
  for (const auto& [begin, n] : docs) {
    EXPECT_TRUE(m.plan({1, n, false, false}).is_ok());
    m.forward(toks.data() + begin, 1, n, ForwardOptions{});
    std::vector<float> logits;
    logits_rows_to_host(m, 0, n, &logits);
    for (int64_t p = 0; p < n; ++p) {
      const float* row = logits.data() + p * V;
      double mx = row[0], z = 0;
      for (int64_t v = 1; v < V; ++v) mx = std::max(mx, static_cast<double>(row[v]));
      for (int64_t v = 0; v < V; ++v) z += std::exp(static_cast<double>(row[v]) - mx);
      const double nll = mx + std::log(z) - row[toks[static_cast<size_t>(begin + p + 1)]];
      for (PositionBucket& b : out)
        if (p >= b.begin && p < b.end) {
          b.loss_sum += nll;
          ++b.count;
        }
    }
  }
  return out;
}

TEST(EvalDocuments, EachDocumentIsScoredAloneFromTheZeroState) {
  Tiny t(DType::kF64);
  const int64_t V = t.m.config().vocab_size;
  const std::vector<int32_t> toks = documents_stream({150, 37, 300, 5, 0, 90}, V);
  const std::vector<DocumentSpan> spans = split_documents(toks, 2);
  ASSERT_EQ(spans.size(), 6u);
  EXPECT_EQ(spans[0].begin, 3);
  EXPECT_EQ(spans[2].tokens, 300);
  EXPECT_EQ(spans[4].tokens, 0);
  const std::vector<PositionBucket> want = documents_alone(t.m, toks, 1, 100000, 16);
  // [0,16) [16,32) [32,64) [64,128) [128,256) [256,300): to the longest document's end.
  ASSERT_EQ(want.size(), 6u);
  EXPECT_EQ(want.back().end, 300);
  EXPECT_EQ(want[0].count, 5 * 16 - 11);          // the 5-token document has 5 positions
  EXPECT_EQ(want[5].count, 44);                   // only the 300-token one reaches [256, 300)
  for (const int64_t streams : {1, 3, 8}) {
    DocumentLossOptions o;
    o.context = 100000;
    o.piece = 32;
    o.first_bucket = 16;
    o.streams = streams;
    std::vector<PositionBucket> got;
    DocumentLossSummary sum;
    ASSERT_TRUE(eval_document_position_loss(t.m, toks, o, [&](const PositionBucket& b) { got.push_back(b); }, &sum)
                    .is_ok());
    EXPECT_EQ(sum.documents, 6);
    EXPECT_EQ(sum.scored, 5);  // not the empty one
    EXPECT_EQ(sum.longest, 300);
    EXPECT_EQ(sum.scored_tokens, 150 + 37 + 300 + 5 + 90);
    ASSERT_EQ(got.size(), want.size()) << streams << " streams";
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_EQ(got[i].begin, want[i].begin);
      EXPECT_EQ(got[i].end, want[i].end);
      EXPECT_EQ(got[i].count, want[i].count) << streams << " streams, bucket " << i;
      EXPECT_NEAR(got[i].loss_sum, want[i].loss_sum, 1e-9 * want[i].loss_sum) << streams << " streams, bucket " << i;
      EXPECT_GT(got[i].memory_bytes, 0);
    }
  }
}

TEST(EvalDocuments, MinimumLengthAndContextCap) {
  Tiny t(DType::kF64);
  const int64_t V = t.m.config().vocab_size;
  const std::vector<int32_t> toks = documents_stream({150, 37, 300, 5, 90}, V);
  struct Case {
    int64_t min_tokens, context, scored, last_end;
  } cases[] = {{100, 100000, 2, 300}, {100, 100, 2, 100}, {37, 64, 4, 64}, {300, 1000, 1, 300}};
  for (const Case& c : cases) {
    DocumentLossOptions o;
    o.min_tokens = c.min_tokens;
    o.context = c.context;
    o.piece = 64;
    o.first_bucket = 16;
    o.streams = 2;
    std::vector<PositionBucket> got;
    DocumentLossSummary sum;
    ASSERT_TRUE(eval_document_position_loss(t.m, toks, o, [&](const PositionBucket& b) { got.push_back(b); }, &sum)
                    .is_ok());
    EXPECT_EQ(sum.scored, c.scored) << c.min_tokens;
    const std::vector<PositionBucket> want = documents_alone(t.m, toks, c.min_tokens, c.context, 16);
    ASSERT_EQ(got.size(), want.size());
    EXPECT_EQ(got.back().end, c.last_end);
    EXPECT_EQ(got.front().count, 16 * c.scored);
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_EQ(got[i].count, want[i].count) << c.min_tokens << " " << c.context << " bucket " << i;
      EXPECT_NEAR(got[i].loss_sum, want[i].loss_sum, 1e-9 * want[i].loss_sum);
    }
  }
  // No document long enough, no document at all, bad options: clear errors.
  DocumentLossOptions o;
  o.min_tokens = 1000;
  Status st = eval_document_position_loss(t.m, toks, o, nullptr);
  EXPECT_NE(st.message().find("no document of at least 1000 tokens among the 5 documents"), std::string::npos)
      << st.to_string();
  EXPECT_NE(st.message().find("the longest has 300"), std::string::npos) << st.to_string();
  o.min_tokens = 1;
  st = eval_document_position_loss(t.m, heldout_stream(500, 2), o, nullptr);  // only ids 0 and 1
  EXPECT_NE(st.message().find("no separator token (id 2)"), std::string::npos) << st.to_string();
  o.piece = 100;
  EXPECT_NE(eval_document_position_loss(t.m, toks, o, nullptr).message().find("powers of two"), std::string::npos);
}

TEST(EvalCopy, BatchingDoesNotChangeTheResultAndCountsAreExact) {
  Tiny t(DType::kF32);
  const int64_t V = t.m.config().vocab_size;
  const std::vector<int32_t> held = heldout_stream(3000, V);
  auto run = [&](int64_t batch, int64_t piece) {
    RecallOptions o;
    o.trials = 4;
    o.batch = batch;
    o.piece = piece;
    o.seed = 9;
    std::vector<CopyResult> r;
    EXPECT_TRUE(eval_copy(t.m, held, {4, 12}, {0, 50}, o, [&](const CopyResult& c) { r.push_back(c); }).is_ok());
    return r;
  };
  const auto a = run(1, 16), b = run(4, 32), c = run(2, 5);
  ASSERT_EQ(a.size(), 4u);
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].predictions, 4 * (a[i].m - 1));
    EXPECT_EQ(a[i].correct, b[i].correct) << "m " << a[i].m << " d " << a[i].d;
    EXPECT_EQ(a[i].correct, c[i].correct) << "m " << a[i].m << " d " << a[i].d;
    EXPECT_GE(a[i].accuracy(), 0.0);
    EXPECT_LE(a[i].accuracy(), 1.0);
  }
  EXPECT_EQ(a[0].m, 4);
  EXPECT_EQ(a[0].d, 0);
  EXPECT_EQ(a[1].d, 50);
  RecallOptions o;
  const auto bad = [&](std::vector<int64_t> ms, std::vector<int64_t> ds) {
    return eval_copy(t.m, held, ms, ds, o, nullptr);
  };
  EXPECT_FALSE(bad({1}, {0}).is_ok());
  EXPECT_FALSE(bad({4}, {-1}).is_ok());
  const Status big = bad({4}, {3000});
  EXPECT_NE(big.message().find("held-out"), std::string::npos) << big.to_string();
}

TEST(EvalServing, DeferredWriteBackIsIndistinguishableOnTheCpu) {
  Tiny t(DType::kF32, 97);
  const std::vector<int32_t> held = heldout_stream(4000, 97);
  std::vector<ServingOption> opts;
  ASSERT_TRUE(parse_serving_options("defer4,defer8,defer16", &opts).is_ok());
  ServingOptionsRun run;
  run.prompts = 6;
  run.prompt_len = 20;
  run.steps = 40;
  std::vector<ServingAccuracy> got;
  ASSERT_TRUE(eval_serving_options(t.m, nullptr, nullptr, nullptr, held, opts, run, [&](const ServingAccuracy& s) {
    got.push_back(s);
  }).is_ok());
  ASSERT_EQ(got.size(), 3u);
  for (const ServingAccuracy& s : got) {
    EXPECT_EQ(s.positions, 6 * 40);
    EXPECT_GT(s.ref_loss, 0);
    EXPECT_LE(std::fabs(s.delta_loss()), 1e-4) << s.option;
    EXPECT_GE(s.agreement, 0.99) << s.option;
    EXPECT_LT(s.logit_relrms_mean, 1e-4) << s.option;
  }
  // The bf16 options need bf16 weights, which the CPU has not.
  ASSERT_TRUE(parse_serving_options("bf16-states", &opts).is_ok());
  EXPECT_TRUE(opts[0].low_weights);
  const Status st = eval_serving_options(t.m, nullptr, nullptr, nullptr, held, opts, run, nullptr);
  EXPECT_NE(st.message().find("bf16"), std::string::npos) << st.to_string();
  // fp8-weights needs the rounded copy; with it, the rounding shows, small.
  ASSERT_TRUE(parse_serving_options("fp8-weights", &opts).is_ok());
  EXPECT_TRUE(opts[0].fp8_weights);
  EXPECT_NE(eval_serving_options(t.m, nullptr, nullptr, nullptr, held, opts, run, nullptr).message().find("FP8"),
            std::string::npos);
  Tiny f(DType::kF32, 97);
  ASSERT_TRUE(fp8_round_body_matrices(f.m).is_ok());
  got.clear();
  ASSERT_TRUE(eval_serving_options(t.m, nullptr, &f.m, nullptr, held, opts, run, [&](const ServingAccuracy& s) {
    got.push_back(s);
  }).is_ok());
  ASSERT_EQ(got.size(), 1u);
  EXPECT_GT(got[0].logit_relrms_mean, 1e-4);  // not the reference itself
  EXPECT_LT(got[0].logit_relrms_mean, 0.2);
  EXPECT_LT(std::fabs(got[0].delta_loss()), 0.05);
  // fp8: FP8 products too, the activations rounded as well: further from the reference than the
  // weights' rounding alone, still small.
  const double weights_only = got[0].logit_relrms_mean;
  ASSERT_TRUE(parse_serving_options("fp8", &opts).is_ok());
  EXPECT_TRUE(opts[0].fp8_compute);
  EXPECT_NE(eval_serving_options(t.m, nullptr, nullptr, &f.m, held, opts, run, nullptr).message().find("FP8"),
            std::string::npos);  // f computes in F32
  Tiny c(DType::kF32, 97);
  ASSERT_TRUE(c.m.use_fp8_weights().is_ok());
  got.clear();
  ASSERT_TRUE(eval_serving_options(t.m, nullptr, nullptr, &c.m, held, opts, run, [&](const ServingAccuracy& s) {
    got.push_back(s);
  }).is_ok());
  ASSERT_EQ(got.size(), 1u);
  EXPECT_GT(got[0].logit_relrms_mean, weights_only);
  EXPECT_LT(got[0].logit_relrms_mean, 0.3);
  EXPECT_LT(std::fabs(got[0].delta_loss()), 0.1);
  // fp8-fast: the same model with its products accumulated fast, which the CPU's exact sums
  // do not change; the model is left as the option found it.
  ASSERT_TRUE(parse_serving_options("fp8,fp8-fast", &opts).is_ok());
  ASSERT_EQ(opts.size(), 2u);
  EXPECT_TRUE(opts[0].fp8_compute && !opts[0].fp8_fast);
  EXPECT_TRUE(opts[1].fp8_compute && opts[1].fp8_fast);
  const ServingAccuracy fp8_alone = got[0];
  got.clear();
  ASSERT_TRUE(eval_serving_options(t.m, nullptr, nullptr, &c.m, held, opts, run, [&](const ServingAccuracy& s) {
    got.push_back(s);
  }).is_ok());
  ASSERT_EQ(got.size(), 2u);
  for (const ServingAccuracy& s : got) {
    EXPECT_EQ(s.option_loss, fp8_alone.option_loss) << s.option;
    EXPECT_EQ(s.agreement, fp8_alone.agreement) << s.option;
  }
  EXPECT_FALSE(c.m.fp8_fast_forward());
  // fp8-head and fp8-fast-head: the LM head in FP8 as well, one more rounding: further from the
  // reference than fp8 (a mutation that leaves the head alone gives fp8's figures); the model is
  // left with its head as the option found it.
  ASSERT_TRUE(parse_serving_options("fp8-head,fp8-fast-head", &opts).is_ok());
  ASSERT_EQ(opts.size(), 2u);
  EXPECT_TRUE(opts[0].fp8_compute && !opts[0].fp8_fast && opts[0].fp8_head);
  EXPECT_TRUE(opts[1].fp8_compute && opts[1].fp8_fast && opts[1].fp8_head);
  got.clear();
  ASSERT_TRUE(eval_serving_options(t.m, nullptr, nullptr, &c.m, held, opts, run, [&](const ServingAccuracy& s) {
    got.push_back(s);
  }).is_ok());
  ASSERT_EQ(got.size(), 2u);
  EXPECT_GT(got[0].logit_relrms_mean, fp8_alone.logit_relrms_mean);
  EXPECT_LT(got[0].logit_relrms_mean, 0.3);
  EXPECT_LT(std::fabs(got[0].delta_loss()), 0.1);
  EXPECT_EQ(got[1].option_loss, got[0].option_loss);  // the CPU's sums are exact either way
  EXPECT_FALSE(c.m.fp8_head());
  EXPECT_FALSE(parse_serving_options("fp8-head-fast", &opts).is_ok());
  EXPECT_FALSE(parse_serving_options("defer5", &opts).is_ok());
  EXPECT_FALSE(parse_serving_options("fp4", &opts).is_ok());
  EXPECT_FALSE(parse_serving_options("", &opts).is_ok());
}

// ---- the CLI, on a model directory with a tokenizer --------------------------------------

using CmdResult = testing::CliResult;

CmdResult run_cli(const std::string& args) { return testing::run_laplace(args); }

class EvalCli : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    // The server tests' model directory, and its tokenizer's corpus as the held-out shard.
    dir_ = new std::string(testing::make_server_model_dir("eval_cli", 3));
    const std::string& d = *dir_;
    std::string corpus;
    ASSERT_TRUE(read_file(d + "/corpus.txt", &corpus).is_ok());
    Tokenizer tok;
    ASSERT_TRUE(Tokenizer::load(d + "/tokenizer.model", &tok).is_ok());
    std::vector<int32_t> ids;
    ASSERT_TRUE(tok.encode(corpus, &ids).is_ok());
    std::vector<uint32_t> u(ids.begin(), ids.end());
    ASSERT_TRUE(shard_write(d + "/val.bin", u, tok.vocab_size()).is_ok());
    // The same text as three documents of 40, 300 and 120 tokens, each after its separator.
    ASSERT_GE(u.size(), 460u);
    std::vector<uint32_t> docs;
    for (const auto& [from, to] : {std::pair{0, 40}, std::pair{40, 340}, std::pair{340, 460}}) {
      docs.push_back(2);
      docs.insert(docs.end(), u.begin() + from, u.begin() + to);
    }
    ASSERT_TRUE(shard_write(d + "/docs.bin", docs, tok.vocab_size()).is_ok());
  }
  static void TearDownTestSuite() {
    std::error_code ec;
    std::filesystem::remove_all(*dir_, ec);
    delete dir_;
  }
  static std::string* dir_;
};
std::string* EvalCli::dir_ = nullptr;

TEST_F(EvalCli, EachModeRunsAndWritesItsLines) {
  const std::string& d = *dir_;
  const std::string common = "--model " + d + " --data " + d + "/val.bin --out " + d + "/out --results " + d + "/res.jsonl";
  CmdResult r = run_cli("eval copy " + common + " --m 4,8 --d 0,64 --trials 4 --batch 2");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = run_cli("eval passkey " + common + " --contexts 100,200 --depths 0,1 --trials 2 --batch 2");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = run_cli("eval position " + common + " --context 500 --piece 128 --first-bucket 32");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("memory from the first bucket"), std::string::npos) << r.output;
  r = run_cli("eval serving " + common + " --options defer8,fp8-weights --prompts 4 --prompt-len 16 --steps 16");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto lines = [](const std::string& path) {
    std::ifstream f(path);
    std::vector<nlohmann::json> v;
    for (std::string l; std::getline(f, l);) v.push_back(nlohmann::json::parse(l));
    return v;
  };
  EXPECT_EQ(lines(d + "/out/copy.jsonl").size(), 4u);
  EXPECT_EQ(lines(d + "/out/passkey.jsonl").size(), 4u);
  EXPECT_EQ(lines(d + "/out/position.jsonl").size(), 5u);  // [0,32) [32,64) [64,128) [128,256) [256,500)
  EXPECT_EQ(lines(d + "/out/serving.jsonl").size(), 2u);
  std::set<std::string> names;
  for (const auto& j : lines(d + "/res.jsonl")) names.insert(j["bench"].get<std::string>());
  EXPECT_TRUE(names.count("recall_copy_acc_m8_d64"));
  EXPECT_TRUE(names.count("recall_passkey_acc_l200_p100"));
  EXPECT_TRUE(names.count("position_loss_256_500"));
  EXPECT_TRUE(names.count("serving_defer8_delta_loss"));
  EXPECT_TRUE(names.count("serving_fp8_weights_delta_loss"));
}

TEST_F(EvalCli, PositionOnWholeDocuments) {
  const std::string& d = *dir_;
  const std::string common = "eval position --documents --model " + d + " --data " + d + "/docs.bin --out " + d +
                             "/docout --results " + d + "/docres.jsonl --piece 128 --first-bucket 32";
  CmdResult r = run_cli(common + " --min-doc-tokens 100 --streams 2");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("2 of 3 documents of at least 100 tokens (the longest 300)"), std::string::npos) << r.output;
  std::vector<nlohmann::json> lines;
  {
    std::ifstream f(d + "/docout/longdoc.jsonl");
    for (std::string l; std::getline(f, l);) lines.push_back(nlohmann::json::parse(l));
  }
  // [0,32) [32,64) [64,128) [128,256) [256,300): to the longest document's end.
  ASSERT_EQ(lines.size(), 5u);
  EXPECT_EQ(lines[0]["mode"], "longdoc");
  EXPECT_EQ(lines[0]["tokens"], 64);   // both documents
  EXPECT_EQ(lines[2]["tokens"], 64 + 56);  // [64, 128): the 120-token document ends at 120
  EXPECT_EQ(lines[3]["tokens"], 128);      // [128, 256): the 300-token one alone
  EXPECT_EQ(lines[4]["end"], 300);
  EXPECT_EQ(lines[4]["tokens"], 44);
  std::set<std::string> names;
  {
    std::ifstream f(d + "/docres.jsonl");
    for (std::string l; std::getline(f, l);) names.insert(nlohmann::json::parse(l)["bench"].get<std::string>());
  }
  EXPECT_TRUE(names.count("longdoc_loss_0_32"));
  EXPECT_TRUE(names.count("longdoc_loss_256_300"));
  EXPECT_TRUE(names.count("longdoc_documents"));
  EXPECT_TRUE(names.count("longdoc_memory_spread_mib"));
  EXPECT_FALSE(names.count("position_loss_0_32"));
  r = run_cli(common + " --min-doc-tokens 100000");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("no document of at least 100000 tokens among the 3 documents"), std::string::npos)
      << r.output;
  r = run_cli("eval position --model " + d + " --data " + d + "/docs.bin --min-doc-tokens 100");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("--min-doc-tokens goes with --documents"), std::string::npos) << r.output;
}

TEST_F(EvalCli, BadArgumentsGetClearErrors) {
  const std::string& d = *dir_;
  const std::string m = "--model " + d + " --data " + d + "/val.bin";
  struct Case {
    std::string args, says;
  } cases[] = {
      {"eval copy " + m + " --m 4,x", "--m: 'x' is not a number"},
      {"eval copy " + m + " --d 100000000", "held-out"},
      {"eval copy --model " + d + " --data " + d + "/nothing.bin", "nothing.bin"},
      {"eval copy --model " + d + "/missing --data " + d + "/val.bin", "does not exist"},
      {"eval passkey " + m + " --depths 1.5", "depths"},
      {"eval passkey " + m + " --contexts 10", "shorter than the needle"},
      {"eval position " + m + " --piece 100", "powers of two"},
      {"eval serving " + m + " --options bf16-weights", "cuda"},
      {"eval serving " + m + " --options defer3", "R = 4, 8 or 16"},
  };
  for (const Case& c : cases) {
    const CmdResult r = run_cli(c.args);
    EXPECT_EQ(r.exit_code, 1) << c.args << "\n" << r.output;
    EXPECT_NE(r.output.find(c.says), std::string::npos) << c.args << "\n" << r.output;
  }
}

}  // namespace
}  // namespace laplace
