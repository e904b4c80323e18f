// The model definition: decode after prefill equals the full forward, states are
// per slot, chunked prefill in pieces equals one piece, the backward matches finite
// differences, and runs are bitwise deterministic.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <random>

#include "core/rng.h"
#include "model/config.h"
#include "model/model.h"
#include "model/weights.h"
#include "ops/cpu/cpu_backend.h"
#include "serve/generate.h"
#include "tests/test_util.h"

namespace laplace {
namespace {

using testing::random_tokens;
using testing::small_config;

std::vector<double> logits_of(const Model& m, int64_t row) {
  Tensor t = m.logits().select(row);
  std::vector<double> out(t.numel());
  for (int64_t i = 0; i < t.numel(); ++i)
    out[i] = t.dtype == DType::kF64 ? t.ptr<double>()[i] : t.ptr<float>()[i];
  return out;
}

double rel_err(const std::vector<double>& a, const std::vector<double>& b) {
  double num = 0, den = 1e-30;
  for (size_t i = 0; i < a.size(); ++i) {
    num = std::max(num, std::fabs(a[i] - b[i]));
    den = std::max(den, std::fabs(b[i]));
  }
  return num / den;
}

class ModelTest : public ::testing::TestWithParam<DType> {};

// docs/model.md §5: decoding after a prefill of T tokens gives the logits of a full forward
// over T+1 tokens.
TEST_P(ModelTest, PrefillThenStepEqualsForward) {
  const DType dt = GetParam();
  const double tol = dt == DType::kF64 ? 1e-10 : 1e-5;
  auto be = make_cpu_backend();
  for (const Config& c : {small_config(), small_config(96, 192, 2)}) {
    Model m;
    ASSERT_TRUE(m.create(c, *be, dt).is_ok());
    m.init_weights(7);
    const int64_t T = 21;  // not a multiple of the chunk size
    auto toks = random_tokens(T + 1, c.vocab_size, 3);
    ASSERT_TRUE(m.plan({1, T + 1, false, false}).is_ok());
    m.forward(toks.data(), 1, T + 1, ForwardOptions{});
    auto full = logits_of(m, T);
    auto full_prev = logits_of(m, T - 1);

    StatePool pool;
    ASSERT_TRUE(pool.create(c, *be, 3, dt).is_ok());
    EXPECT_EQ(pool.slot_bytes(), c.state_bytes_per_sequence() * static_cast<int64_t>(dtype_size(dt)) / 4);
    int32_t slot = 2;
    ForwardOptions pre;
    pre.last_logits_only = true;
    m.forward(toks.data(), 1, T, pre, &pool, &slot);
    EXPECT_LE(rel_err(logits_of(m, 0), full_prev), tol);
    ForwardOptions step;
    step.form = GlaForm::kRecurrent;
    step.last_logits_only = true;
    m.forward(toks.data() + T, 1, 1, step, &pool, &slot);
    EXPECT_LE(rel_err(logits_of(m, 0), full), tol);
  }
}

// Prefill in pieces (any split, including pieces shorter than the conv window)
// equals prefill in one piece; different slots do not interfere.
TEST_P(ModelTest, PiecewisePrefillAndSlots) {
  const DType dt = GetParam();
  const double tol = dt == DType::kF64 ? 1e-10 : 1e-5;
  auto be = make_cpu_backend();
  Config c = small_config();
  Model m;
  ASSERT_TRUE(m.create(c, *be, dt).is_ok());
  m.init_weights(11);
  ASSERT_TRUE(m.plan({2, 40, false, false}).is_ok());
  auto a = random_tokens(37, c.vocab_size, 5);
  auto b = random_tokens(37, c.vocab_size, 6);
  StatePool pool;
  ASSERT_TRUE(pool.create(c, *be, 4, dt).is_ok());
  ForwardOptions fo;
  fo.last_logits_only = true;
  int32_t s0 = 0;
  m.forward(a.data(), 1, 37, fo, &pool, &s0);
  auto one_piece = logits_of(m, 0);
  // Slots 3 (a) and 1 (b) fed together in pieces of 2, 9 and 26 tokens.
  int32_t slots[2] = {3, 1};
  const int64_t cuts[] = {0, 2, 11, 37};
  for (int p = 0; p < 3; ++p) {
    const int64_t n = cuts[p + 1] - cuts[p];
    std::vector<int32_t> batch;
    batch.insert(batch.end(), a.begin() + cuts[p], a.begin() + cuts[p + 1]);
    batch.insert(batch.end(), b.begin() + cuts[p], b.begin() + cuts[p + 1]);
    m.forward(batch.data(), 2, n, fo, &pool, slots);
  }
  EXPECT_LE(rel_err(logits_of(m, 0), one_piece), tol);
  // Slot 3 holds exactly slot 0's state (same tokens); slot 2 was never touched.
  Tensor s3 = pool.slot(3), sz = pool.slot(0), s2 = pool.slot(2);
  EXPECT_LE(testing::max_rel_error(s3, sz), tol);
  const char* z = static_cast<const char*>(s2.data);
  for (size_t i = 0; i < s2.nbytes(); ++i) ASSERT_EQ(z[i], 0);
}

// A ragged forward (sequences of different lengths in one forward, adjacent equal lengths
// batched in the mixer) gives, on the CPU, bitwise each sequence's logits and state of a
// forward of that sequence alone, from and into its own slot; other slots are untouched.
TEST_P(ModelTest, RaggedForwardEqualsOneSequenceAtATime) {
  const DType dt = GetParam();
  auto be = make_cpu_backend();
  Config c = small_config();
  Model m;
  ASSERT_TRUE(m.create(c, *be, dt).is_ok());
  m.init_weights(13);
  // Lengths with runs of equal ones, pieces shorter than the conv window and the chunk.
  const std::vector<int64_t> lengths = {5, 5, 17, 2, 2, 2, 40, 1};
  const std::vector<int32_t> slots = {6, 0, 3, 8, 1, 5, 2, 7};
  const int64_t G = static_cast<int64_t>(lengths.size());
  int64_t N = 0;
  for (int64_t n : lengths) N += n;
  PlanOptions po;
  po.max_batch = G;
  po.max_seq = 40;
  po.max_tokens = N;
  po.max_logit_rows = G;
  ASSERT_TRUE(m.plan(po).is_ok());
  std::vector<std::vector<int32_t>> seqs;
  std::vector<int32_t> all;
  for (int64_t g = 0; g < G; ++g) {
    seqs.push_back(random_tokens(lengths[g], c.vocab_size, 71 + g));
    all.insert(all.end(), seqs[g].begin(), seqs[g].end());
  }
  ForwardOptions fo;
  fo.last_logits_only = true;
  auto fresh_pool = [&](StatePool* p) {
    ASSERT_TRUE(p->create(c, *be, 10, dt).is_ok());
    for (int32_t s = 0; s < 9; ++s) {
      auto t = random_tokens(9, c.vocab_size, 200 + s);
      m.forward(t.data(), 1, 9, fo, p, &s);
    }
  };
  StatePool one, ragged;
  fresh_pool(&one);
  fresh_pool(&ragged);
  std::vector<std::vector<double>> want(G);
  for (int64_t g = 0; g < G; ++g) {
    m.forward(seqs[g].data(), 1, lengths[g], fo, &one, &slots[g]);
    want[g] = logits_of(m, 0);
  }
  m.forward_ragged(all.data(), lengths, ragged, slots.data());
  ASSERT_EQ(m.logits().shape[0], G);
  for (int64_t g = 0; g < G; ++g) EXPECT_EQ(logits_of(m, g), want[g]) << "sequence " << g;
  for (int32_t s = 0; s < 10; ++s) {
    Tensor a = one.slot(s), b = ragged.slot(s);
    ASSERT_EQ(a.nbytes(), b.nbytes());
    EXPECT_EQ(std::memcmp(a.data, b.data, a.nbytes()), 0) << "slot " << s;
  }
}

// The whole model's gradient vs central finite differences (fp64).
TEST(ModelGrad, MatchesFiniteDifferences) {
  auto be = make_cpu_backend();
  Config c = small_config();
  c.num_layers = 2;
  Model m;
  ASSERT_TRUE(m.create(c, *be, DType::kF64).is_ok());
  m.init_weights(5);
  // Larger weights than the init so every path carries signal.
  for (const Tensor& t : m.weight_arena().tensors()) {
    double* p = t.ptr<double>();
    std::mt19937_64 rng(t.numel());
    std::normal_distribution<double> nd(0, 0.3);
    for (int64_t i = 0; i < t.numel(); ++i) p[i] += nd(rng);
  }
  const int64_t B = 2, T = 11;
  auto toks = random_tokens(B * T, c.vocab_size, 9);
  auto targets = random_tokens(B * T, c.vocab_size, 10);
  targets[4] = -1;  // ignored position
  ASSERT_TRUE(m.plan({B, T, true, false}).is_ok());
  Arena grads;
  ASSERT_TRUE(grads.create(weight_specs(c, DType::kF64), be->allocator(), "grads").is_ok());
  m.forward(toks.data(), B, T, ForwardOptions{});
  m.backward(targets.data(), grads);

  auto loss_at = [&]() {
    m.forward(toks.data(), B, T, ForwardOptions{});
    return m.loss(targets.data());
  };
  std::mt19937_64 pick(1);
  double worst = 0;
  for (size_t i = 0; i < m.weight_arena().size(); ++i) {
    Tensor w = m.weight_arena().tensor(i);
    Tensor g = grads.tensor(i);
    for (int rep = 0; rep < 3; ++rep) {
      const int64_t j = static_cast<int64_t>(pick() % w.numel());
      double* p = w.ptr<double>() + j;
      const double keep = *p, h = 1e-5;
      *p = keep + h;
      const double lp = loss_at();
      *p = keep - h;
      const double lm = loss_at();
      *p = keep;
      const double fd = (lp - lm) / (2 * h);
      const double an = g.ptr<double>()[j];
      const double err = std::fabs(fd - an) / std::max(1e-6, std::fabs(fd) + std::fabs(an));
      worst = std::max(worst, err);
      EXPECT_LE(err, 1e-6) << m.weight_arena().spec(i).name << "[" << j << "] fd=" << fd << " analytic=" << an;
    }
  }
  RecordProperty("worst_rel_error", std::to_string(worst));
}

// Recomputing the mixer in the backward gives the same gradients, bit for bit.
TEST(ModelGrad, RecomputeMixerIsBitwiseIdentical) {
  auto be = make_cpu_backend();
  Config c = small_config();
  std::vector<std::vector<char>> results;
  for (bool recompute : {false, true}) {
    Model m;
    ASSERT_TRUE(m.create(c, *be, DType::kF32).is_ok());
    m.init_weights(5);
    auto toks = random_tokens(2 * 13, c.vocab_size, 9);
    auto targets = random_tokens(2 * 13, c.vocab_size, 10);
    ASSERT_TRUE(m.plan({2, 13, true, recompute}).is_ok());
    Arena grads;
    ASSERT_TRUE(grads.create(weight_specs(c, DType::kF32), be->allocator(), "grads").is_ok());
    m.forward(toks.data(), 2, 13, ForwardOptions{});
    m.backward(targets.data(), grads);
    const char* p = static_cast<const char*>(grads.base());
    results.emplace_back(p, p + grads.bytes());
  }
  EXPECT_EQ(results[0], results[1]);
}

// Full-layer recompute (PlanOptions::recompute_layers) gives the loss and the gradients of the
// plan without recompute (and the mixer recompute's) bit for bit: F32 and F64, with documents
// kept apart and packed, and with FP8 products. Three layers, so two share the first's buffers;
// the documents start mid-chunk and on a chunk edge (the small config's chunk is 8).
TEST(ModelGrad, RecomputeLayersIsBitwiseIdentical) {
  auto be = make_cpu_backend();
  Config c = small_config();
  c.num_layers = 3;
  const int64_t B = 2, T = 21;
  const int32_t sep = 2;
  auto toks = random_tokens(B * T, c.vocab_size, 9);
  auto targets = random_tokens(B * T, c.vocab_size, 10);
  targets[5] = -1;  // ignored position
  for (int32_t& t : toks)
    if (t == sep) t = sep + 1;
  for (int64_t t : {int64_t{3}, int64_t{8}, T + 9}) toks[t] = sep;
  struct Variant {
    DType dt;
    bool docs, fp8;
  };
  for (const Variant v : {Variant{DType::kF32, false, false}, Variant{DType::kF32, true, false},
                          Variant{DType::kF64, false, false}, Variant{DType::kF64, true, false},
                          Variant{DType::kF32, true, true}}) {
    SCOPED_TRACE(std::string(dtype_name(v.dt)) + (v.docs ? " documents" : " packed") + (v.fp8 ? " fp8" : ""));
    std::vector<std::vector<char>> grads_of;
    std::vector<double> losses;
    for (int mode : {0, 1, 2}) {  // none, the mixer, every layer
      Model m;
      ASSERT_TRUE(m.create(c, *be, v.dt).is_ok());
      m.init_weights(5);
      if (v.fp8) {
        ASSERT_TRUE(m.use_fp8_training().is_ok());
      }
      PlanOptions po{B, T, true, mode == 1};
      po.recompute_layers = mode == 2;
      ASSERT_TRUE(m.plan(po).is_ok());
      if (v.fp8) m.quantize_training_weights();
      Arena grads;
      ASSERT_TRUE(grads.create(weight_specs(c, v.dt), be->allocator(), "grads").is_ok());
      grads.zero();
      ForwardOptions fo;
      fo.document_separator = v.docs ? sep : -1;
      m.forward(toks.data(), B, T, fo);
      losses.push_back(m.loss(targets.data()));
      m.backward(targets.data(), grads, 0.5);
      const char* p = static_cast<const char*>(grads.base());
      grads_of.emplace_back(p, p + grads.bytes());
    }
    for (int mode : {1, 2}) {
      EXPECT_EQ(std::memcmp(&losses[mode], &losses[0], sizeof(double)), 0) << "mode " << mode;
      EXPECT_EQ(grads_of[mode], grads_of[0]) << "mode " << mode;
    }
  }
  // The two recomputes exclude each other.
  Model m;
  ASSERT_TRUE(m.create(c, *be, DType::kF32).is_ok());
  PlanOptions both{B, T, true, true};
  both.recompute_layers = true;
  EXPECT_EQ(m.plan(both).code(), Status::Code::kInvalidArgument);
}

// The group hooks with full-layer recompute: the backward calls the forward's before_group(1 + l)
// again before it runs layer l's forward again, and after_group(1 + l) once that layer's
// gradients are queued. A store that releases each layer's weights once the forward (and later
// the backward) is done with them, and gathers them again in before_group, gets the gradients
// of weights that stayed in place.
TEST(ModelGrad, RecomputeLayersGathersEachLayerAgain) {
  auto be = make_cpu_backend();
  Config c = small_config();
  c.num_layers = 3;
  const int64_t B = 2, T = 13, L = c.num_layers;
  auto toks = random_tokens(B * T, c.vocab_size, 29);
  auto targets = random_tokens(B * T, c.vocab_size, 30);
  PlanOptions po{B, T, true, false};
  po.recompute_layers = true;
  auto gradients = [&](Model& m, const ForwardOptions& fo, const GroupHook& after, const std::function<void()>& between) {
    Arena grads;
    EXPECT_TRUE(grads.create(weight_specs(c, DType::kF32), be->allocator(), "grads").is_ok());
    grads.zero();
    m.forward(toks.data(), B, T, fo);
    if (between) between();
    m.backward(targets.data(), grads, 1.0, after);
    const char* p = static_cast<const char*>(grads.base());
    return std::vector<char>(p, p + grads.bytes());
  };
  Model ref;  // without recompute, without hooks
  ASSERT_TRUE(ref.create(c, *be, DType::kF32).is_ok());
  ref.init_weights(3);
  ASSERT_TRUE(ref.plan({B, T, true, false}).is_ok());
  const std::vector<char> want = gradients(ref, ForwardOptions{}, nullptr, nullptr);

  Model m;
  ASSERT_TRUE(m.create(c, *be, DType::kF32).is_ok());
  m.init_weights(3);
  ASSERT_TRUE(m.plan(po).is_ok());
  const Arena& w = m.weight_arena();
  const std::vector<char> full(static_cast<const char*>(w.base()), static_cast<const char*>(w.base()) + w.bytes());
  // Layer l's tensors (group 1 + l): released = zeroed, gathered = copied back.
  auto layer_tensors = [&](int64_t l) {
    std::vector<size_t> idx;
    const std::string prefix = "model.layers." + std::to_string(l) + ".";
    for (size_t i = 0; i < w.size(); ++i)
      if (w.spec(i).name.rfind(prefix, 0) == 0) idx.push_back(i);
    EXPECT_FALSE(idx.empty());
    return idx;
  };
  auto release = [&](int64_t l) {
    for (size_t i : layer_tensors(l)) be->fill(w.tensor(i), 0.0);
  };
  auto gather = [&](int64_t l) {
    for (size_t i : layer_tensors(l)) {
      const Tensor t = w.tensor(i);
      const size_t off = static_cast<size_t>(static_cast<const char*>(t.data) - static_cast<const char*>(w.base()));
      std::memcpy(t.data, full.data() + off, t.nbytes());
    }
  };
  for (int64_t l = 0; l < L; ++l) release(l);
  std::vector<std::string> calls;
  ForwardOptions fo;
  fo.before_group = [&](int64_t g) {
    calls.push_back(std::string("b").append(std::to_string(g)));  // not "b" + …: GCC 12's false -Wrestrict
    if (g >= 1 && g <= L) gather(g - 1);
  };
  const GroupHook after = [&](int64_t g) {
    calls.push_back(std::string("a").append(std::to_string(g)));
    if (g >= 1 && g <= L) release(g - 1);
  };
  const std::vector<char> got = gradients(m, fo, after, [&] {
    for (int64_t l = 0; l < L; ++l) release(l);  // the forward is done with every layer
  });
  EXPECT_EQ(got, want);
  const std::vector<std::string> order = {"b0", "b1", "b2", "b3", "b4", "a4", "b3", "a3", "b2", "a2", "b1", "a1", "a0"};
  EXPECT_EQ(calls, order);
}

// backward(..., overwrite = true) into an arena of NaNs whose accumulated part
// zero_accumulated_gradients() zeroed gives the values of a backward into a zeroed arena:
// every product-written gradient is written whole and everything else is zeroed first. With
// untied and tied embeddings (the head's product then writes the embedding's gradient before
// the embedding adds to it), and with FP8 products. Values, not bytes: a written product may
// keep a -0 that adding it to +0 would have turned into +0.
TEST(ModelGrad, OverwriteEqualsAccumulatingIntoZeros) {
  auto be = make_cpu_backend();
  for (int variant = 0; variant < 3; ++variant) {
    SCOPED_TRACE(variant == 0 ? "untied" : variant == 1 ? "tied embeddings" : "FP8 products");
    Config c = small_config();
    c.tie_embeddings = variant == 1;
    Model m;
    ASSERT_TRUE(m.create(c, *be, DType::kF32).is_ok());
    m.init_weights(7);
    if (variant == 2) {
      ASSERT_TRUE(m.use_fp8_training().is_ok());
    }
    const int64_t B = 2, T = 13;
    auto toks = random_tokens(B * T, c.vocab_size, 19);
    auto targets = random_tokens(B * T, c.vocab_size, 20);
    ASSERT_TRUE(m.plan({B, T, true, false}).is_ok());
    Arena zeroed, garbage;
    ASSERT_TRUE(zeroed.create(weight_specs(c, DType::kF32), be->allocator(), "zeroed").is_ok());
    ASSERT_TRUE(garbage.create(weight_specs(c, DType::kF32), be->allocator(), "garbage").is_ok());
    zeroed.zero();
    for (size_t i = 0; i < garbage.size(); ++i) be->fill(garbage.tensor(i), std::nan(""));
    m.zero_accumulated_gradients(garbage);
    m.forward(toks.data(), B, T, ForwardOptions{});
    m.backward(targets.data(), zeroed, 0.5);
    m.forward(toks.data(), B, T, ForwardOptions{});
    m.backward(targets.data(), garbage, 0.5, nullptr, true);
    for (size_t i = 0; i < zeroed.size(); ++i) {
      const Tensor a = zeroed.tensor(i), b = garbage.tensor(i);
      int64_t differ = 0;
      for (int64_t j = 0; j < a.numel(); ++j) differ += !(a.ptr<float>()[j] == b.ptr<float>()[j]);
      EXPECT_EQ(differ, 0) << zeroed.spec(i).name;
    }
  }
}

// Documents kept apart (ForwardOptions::document_separator): a packed batch with separators
// gives each document's logits bit for bit as the document run alone from a zero state (the CPU's
// ops are row-invariant and the mixer runs each document with its own chunk alignment), and the
// gradient of the batch's mean loss equals the sum of the documents' (n_i / N)-weighted mean-loss
// gradients (F64, to the rounding of sums taken in another order). Documents start at 0, mid-chunk,
// on a chunk edge (the small config's chunk is 8), and one is a single token.
TEST(ModelDocuments, PackedBatchEqualsTheDocumentsOneByOne) {
  const int32_t sep = 2;
  for (DType dt : {DType::kF32, DType::kF64}) {
    SCOPED_TRACE(dtype_name(dt));
    auto be = make_cpu_backend();
    const Config c = small_config();
    const int64_t B = 2, T = 29;
    auto toks = random_tokens(B * T, c.vocab_size, 31);
    auto targets = random_tokens(B * T, c.vocab_size, 32);
    for (int32_t& t : toks)
      if (t == sep) t = sep + 1;
    for (int64_t t : {0, 5, 8, 16, 17}) toks[t] = sep;  // row 0
    for (int64_t t : {11, 24}) toks[T + t] = sep;       // row 1: tokens 0..10 continue a document
    Model m;
    ASSERT_TRUE(m.create(c, *be, dt).is_ok());
    m.init_weights(9);
    ASSERT_TRUE(m.plan({B, T, true, false}).is_ok());
    Arena packed, alone;
    const DType gdt = dt;
    ASSERT_TRUE(packed.create(weight_specs(c, gdt), be->allocator(), "packed").is_ok());
    ASSERT_TRUE(alone.create(weight_specs(c, gdt), be->allocator(), "alone").is_ok());
    packed.zero();
    alone.zero();
    ForwardOptions fo;
    fo.document_separator = sep;
    m.forward(toks.data(), B, T, fo);
    std::vector<std::vector<double>> packed_logits;
    for (int64_t r = 0; r < B * T; ++r) packed_logits.push_back(logits_of(m, r));
    m.backward(targets.data(), packed);
    for (int64_t b = 0; b < B; ++b) {
      std::vector<int64_t> cuts = {0};
      for (int64_t t = 1; t < T; ++t)
        if (toks[b * T + t] == sep) cuts.push_back(t);
      cuts.push_back(T);
      for (size_t i = 0; i + 1 < cuts.size(); ++i) {
        const int64_t t0 = cuts[i], n = cuts[i + 1] - cuts[i];
        SCOPED_TRACE("row " + std::to_string(b) + " from " + std::to_string(t0));
        m.forward(toks.data() + b * T + t0, 1, n, ForwardOptions{});
        for (int64_t r = 0; r < n; ++r) {
          const std::vector<double> got = logits_of(m, r);
          EXPECT_EQ(std::memcmp(got.data(), packed_logits[b * T + t0 + r].data(), got.size() * sizeof(double)), 0)
              << "logits of position " << t0 + r;
        }
        m.backward(targets.data() + b * T + t0, alone, static_cast<double>(n) / static_cast<double>(B * T));
      }
    }
    double worst = 0;
    for (size_t i = 0; i < packed.size(); ++i) {
      const Tensor a = packed.tensor(i), r = alone.tensor(i);
      double num = 0, den = 1e-30;
      for (int64_t j = 0; j < a.numel(); ++j) {
        num = std::max(num, std::fabs(testing::element_get(a, j) - testing::element_get(r, j)));
        den = std::max(den, std::fabs(testing::element_get(r, j)));
      }
      worst = std::max(worst, num / den);
    }
    EXPECT_LE(worst, dt == DType::kF64 ? 1e-12 : 1e-5);
    // Packed (no separator honoured) differs: the test can fail.
    m.forward(toks.data(), B, T, ForwardOptions{});
    EXPECT_NE(logits_of(m, 6), packed_logits[6]);
  }
}

// A CPU backend whose GLA and conv ops do not take documents (as a backend without the masked
// kernels): every call must come without doc, so the model runs each document by itself.
class DocumentlessBackend : public CpuBackend {
 public:
  bool keeps_documents_apart() const override { return false; }
  void conv_silu_forward(const Tensor& u, const Tensor& w, Tensor c, Tensor pre, const Tensor& wi, Tensor wo,
                         const Tensor& slots, const Tensor& doc) override {
    EXPECT_FALSE(doc.defined());
    CpuBackend::conv_silu_forward(u, w, c, pre, wi, wo, slots, doc);
  }
  void conv_silu_backward(const Tensor& dc, const Tensor& u, const Tensor& w, const Tensor& pre, Tensor du, Tensor dw,
                          const Tensor& doc) override {
    EXPECT_FALSE(doc.defined());
    CpuBackend::conv_silu_backward(dc, u, w, pre, du, dw, doc);
  }
  void gla_forward(const GlaParams& p, const Tensor& q, const Tensor& k, const Tensor& v, Tensor o, const Tensor& si,
                   Tensor so, const Tensor& slots) override {
    EXPECT_FALSE(p.doc.defined());
    ++gla_calls;
    CpuBackend::gla_forward(p, q, k, v, o, si, so, slots);
  }
  void gla_backward(const GlaParams& p, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& si,
                    const Tensor& d_o, const Tensor& dso, Tensor dq, Tensor dk, Tensor dv, Tensor dsi) override {
    EXPECT_FALSE(p.doc.defined());
    CpuBackend::gla_backward(p, q, k, v, si, d_o, dso, dq, dk, dv, dsi);
  }
  int64_t gla_calls = 0;
};

// Model::documents_by_views: on a backend whose ops take no documents, the model runs each document
// as its own sequence and gets the ops' own result — logits bit for bit (the CPU's documents run with
// their own chunk alignment either way), gradients to the order of the conv weight's sums — for
// training (with each recompute) and inference plans; a state pool is refused.
TEST(ModelDocuments, ByViewsOnABackendWithoutDocumentsEqualsTheOps) {
  const int32_t sep = 2;
  const Config c = small_config();
  const int64_t B = 2, T = 29;
  auto toks = random_tokens(B * T, c.vocab_size, 41);
  auto targets = random_tokens(B * T, c.vocab_size, 42);
  for (int32_t& t : toks)
    if (t == sep) t = sep + 1;
  for (int64_t t : {0, 5, 8, 16, 17}) toks[t] = sep;
  for (int64_t t : {11, 24}) toks[T + t] = sep;
  ForwardOptions fo;
  fo.document_separator = sep;
  for (int recompute = 0; recompute < 3; ++recompute) {
    SCOPED_TRACE("recompute " + std::to_string(recompute));
    auto views = std::make_unique<DocumentlessBackend>();
    std::unique_ptr<Backend> cpu = make_cpu_backend();
    Backend* bes[2] = {cpu.get(), views.get()};
    std::vector<std::vector<double>> logits[2];
    Arena grads[2];
    for (int side = 0; side < 2; ++side) {
      Backend& be = *bes[side];
      Model m;
      ASSERT_TRUE(m.create(c, be, DType::kF64).is_ok());
      m.init_weights(13);
      PlanOptions po{B, T, true, recompute == 1};
      po.recompute_layers = recompute == 2;
      ASSERT_TRUE(m.plan(po).is_ok());
      ASSERT_TRUE(grads[side].create(weight_specs(c, DType::kF64), be.allocator(), "grads").is_ok());
      grads[side].zero();
      m.forward(toks.data(), B, T, fo);
      for (int64_t r = 0; r < B * T; ++r) logits[side].push_back(logits_of(m, r));
      m.backward(targets.data(), grads[side]);
    }
    EXPECT_GE(views->gla_calls, c.num_layers * 7);  // 7 documents in the batch, each layer
    for (int64_t r = 0; r < B * T; ++r) EXPECT_EQ(logits[1][r], logits[0][r]) << "row " << r;
    double worst = 0;
    for (size_t i = 0; i < grads[0].size(); ++i) {
      const Tensor a = grads[0].tensor(i), g = grads[1].tensor(i);
      for (int64_t j = 0; j < a.numel(); ++j)
        worst = std::max(worst, std::fabs(a.ptr<double>()[j] - g.ptr<double>()[j]) /
                                    std::max(1e-3, std::fabs(a.ptr<double>()[j])));
    }
    EXPECT_LE(worst, 1e-10);
    // Inference: the same logits; a state pool with documents is refused on such a backend.
    Model inf;
    ASSERT_TRUE(inf.create(c, *views, DType::kF64).is_ok());
    inf.init_weights(13);
    ASSERT_TRUE(inf.plan({B, T, false, false}).is_ok());
    inf.forward(toks.data(), B, T, fo);
    for (int64_t r = 0; r < B * T; ++r) EXPECT_EQ(logits_of(inf, r), logits[0][r]) << "inference row " << r;
  }
}

// weights_init's values are its documented definition (model/weights.h) with any number of
// threads: each random tensor's element 2j and 2j + 1 are the Box–Muller pair of outputs 2j and
// 2j + 1 of a SplitMix64 stream keyed by the seed and the FNV-1a hash of the tensor's name, times
// its standard deviation; constants for norms and biases. The vocabulary is odd so that the
// embedding ends in half a pair.
TEST(ModelInit, WeightsAreTheSeededStreamOfEachTensor) {
  auto be = make_cpu_backend();
  Config c;
  ASSERT_TRUE(config_load(std::string(LAPLACE_SOURCE_DIR) + "/configs/laplace-tiny.json", &c).is_ok());
  c.vocab_size = 2047;
  Model m;
  ASSERT_TRUE(m.create(c, *be, DType::kF32).is_ok());
  for (int threads : {1, 2, 7, 0}) {
    SCOPED_TRACE("threads " + std::to_string(threads));
    weights_init(c, *be, m.weight_arena(), 77, threads);
    const Arena& a = m.weight_arena();
    const double out_scale = 1.0 / std::sqrt(2.0 * static_cast<double>(c.num_layers));
    int64_t random_tensors = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      const std::string& name = a.spec(i).name;
      const Tensor t = a.tensor(i);
      const float* got = t.ptr<float>();
      const auto ends = [&](const char* suffix) {
        const std::string sfx(suffix);
        return name.size() >= sfx.size() && name.compare(name.size() - sfx.size(), sfx.size(), sfx) == 0;
      };
      if (ends("norm1.weight") || ends("norm2.weight") || name == "model.norm.weight" || ends("onorm.weight") ||
          ends(".bias")) {
        const float want = ends(".bias") ? 0.f : 1.f;
        for (int64_t k = 0; k < t.numel(); ++k) ASSERT_EQ(got[k], want) << name << " " << k;
        continue;
      }
      ++random_tensors;
      const double sd = ends("conv.weight") ? 1.0 / std::sqrt(static_cast<double>(c.conv_size))
                        : ends("wo.weight") || ends("w3.weight") ? 0.02 * out_scale
                                                                 : 0.02;
      uint64_t h = 0xcbf29ce484222325ull;
      for (unsigned char ch : name) h = (h ^ ch) * 0x100000001b3ull;
      SplitMix64 g{splitmix64_hash(77 ^ h)};
      double sum2 = 0;
      for (int64_t k = 0; k < t.numel(); k += 2) {
        const double u1 = 1.0 - g.uniform(), u2 = g.uniform();
        const double r = std::sqrt(-2.0 * std::log(u1)), th = 6.283185307179586 * u2;
        ASSERT_EQ(got[k], static_cast<float>(sd * r * std::cos(th))) << name << " " << k;
        if (k + 1 < t.numel()) {
          ASSERT_EQ(got[k + 1], static_cast<float>(sd * r * std::sin(th))) << name << " " << k + 1;
        }
        sum2 += static_cast<double>(got[k]) * got[k];
      }
      if (t.numel() >= 4096) {  // half the values, the even ones: their RMS is the standard deviation
        const double rms = std::sqrt(sum2 / static_cast<double>((t.numel() + 1) / 2));
        EXPECT_NEAR(rms / sd, 1.0, 0.05) << name;
      }
    }
    EXPECT_EQ(random_tensors, 1 + 5 * c.num_layers + (c.tie_embeddings ? 0 : 1));
  }
  m.init_weights(77);
  // Another seed, other values; the same seed, the same bytes.
  Model m2;
  ASSERT_TRUE(m2.create(c, *be, DType::kF32).is_ok());
  m2.init_weights(78);
  const Tensor e1 = m.weights().embed, e2 = m2.weights().embed;
  EXPECT_NE(0, std::memcmp(e1.data, e2.data, e1.nbytes()));
  m2.init_weights(77);
  EXPECT_EQ(0, std::memcmp(e1.data, e2.data, e1.nbytes()));
}

TEST(ModelDeterminism, TwoRunsAreBitwiseIdentical) {
  auto be = make_cpu_backend();
  Config c = small_config(96, 192, 2);
  std::vector<std::vector<char>> out;
  for (int run = 0; run < 2; ++run) {
    Model m;
    ASSERT_TRUE(m.create(c, *be, DType::kF32).is_ok());
    m.init_weights(1);
    ASSERT_TRUE(m.plan({2, 30, false, false}).is_ok());
    auto toks = random_tokens(60, c.vocab_size, 2);
    m.forward(toks.data(), 2, 30, ForwardOptions{});
    const char* p = static_cast<const char*>(m.logits().data);
    out.emplace_back(p, p + m.logits().nbytes());
  }
  EXPECT_EQ(out[0], out[1]);
}

TEST(Generate, GreedyIsReproducibleAndSeededSamplingDiffers) {
  auto be = make_cpu_backend();
  Config c = small_config();
  Model m;
  ASSERT_TRUE(m.create(c, *be, DType::kF32).is_ok());
  m.init_weights(3);
  ASSERT_TRUE(m.plan({1, 16, false, false}).is_ok());
  StatePool pool;
  ASSERT_TRUE(pool.create(c, *be, 1).is_ok());
  std::vector<int32_t> prompt = {1, 2, 3, 4, 5};
  auto run = [&](double temp, uint64_t seed) {
    pool.reset(*be, 0);
    GenerateOptions o;
    o.max_tokens = 24;
    o.sampling.temperature = temp;
    o.sampling.seed = seed;
    return generate(m, pool, 0, prompt, o);
  };
  EXPECT_EQ(run(0, 0), run(0, 99));
  EXPECT_EQ(run(1.0, 7), run(1.0, 7));
  EXPECT_NE(run(1.0, 7), run(1.0, 8));
  // Greedy decode equals the argmax of a full forward at every step.
  auto g = run(0, 0);
  std::vector<int32_t> seq = prompt;
  seq.insert(seq.end(), g.begin(), g.end() - 1);
  Model full;
  ASSERT_TRUE(full.create(c, *be, DType::kF32).is_ok());
  full.init_weights(3);
  ASSERT_TRUE(full.plan({1, static_cast<int64_t>(seq.size()), false, false}).is_ok());
  full.forward(seq.data(), 1, static_cast<int64_t>(seq.size()), ForwardOptions{});
  for (size_t i = 0; i < g.size(); ++i) {
    Tensor row = full.logits().select(static_cast<int64_t>(prompt.size() - 1 + i));
    EXPECT_EQ(argmax(row.ptr<float>(), c.vocab_size), g[i]) << "step " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, ModelTest, ::testing::Values(DType::kF32, DType::kF64),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

}  // namespace
}  // namespace laplace
