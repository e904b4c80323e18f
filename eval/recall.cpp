#include "eval/recall.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "core/rng.h"
#include "eval/stream.h"

namespace laplace {

namespace {

// Ids below this are the tokenizer's control pieces (<unk>, <s>, </s>, <pad>): never part of
// a random string, so the copy is made of ordinary tokens.
constexpr int64_t kFirstOrdinaryId = 4;

// One generator per (seed, grid point): a point's trials do not depend on which other points run.
SplitMix64 point_rng(uint64_t seed, uint64_t a, uint64_t b) {
  return SplitMix64{splitmix64_hash(splitmix64_hash(seed ^ splitmix64_hash(a)) ^ b)};
}

int64_t rounded_trials(const RecallOptions& o) { return (o.trials + o.batch - 1) / o.batch * o.batch; }

Status check_options(const RecallOptions& o) {
  if (o.trials < 1) return Status::invalid_argument("--trials must be at least 1");
  if (o.batch < 1) return Status::invalid_argument("--batch must be at least 1");
  if (o.piece < 1) return Status::invalid_argument("--piece must be at least 1");
  return Status::ok();
}

}  // namespace

Status eval_copy(Model& m, const std::vector<int32_t>& heldout, const std::vector<int64_t>& ms,
                 const std::vector<int64_t>& ds, const RecallOptions& o,
                 const std::function<void(const CopyResult&)>& each) {
  LAPLACE_RETURN_IF_ERROR(check_options(o));
  const int64_t V = m.config().vocab_size;
  if (V <= kFirstOrdinaryId + 1) return Status::invalid_argument("copy test: the vocabulary is too small");
  if (ms.empty() || ds.empty()) return Status::invalid_argument("copy test: give at least one m and one d");
  const int64_t m_max = *std::max_element(ms.begin(), ms.end());
  const int64_t d_max = *std::max_element(ds.begin(), ds.end());
  for (int64_t v : ms)
    if (v < 2) return Status::invalid_argument("copy test: every m must be at least 2 (got " + std::to_string(v) + ")");
  for (int64_t v : ds)
    if (v < 0) return Status::invalid_argument("copy test: every d must be >= 0 (got " + std::to_string(v) + ")");
  if (static_cast<int64_t>(heldout.size()) <= d_max)
    return Status::invalid_argument("copy test: d = " + std::to_string(d_max) + " needs more held-out text than the " +
                                    std::to_string(heldout.size()) + " tokens given");
  const int64_t piece = std::max(o.piece, m_max);
  SequenceStream s;
  LAPLACE_RETURN_IF_ERROR(s.init(&m, o.batch, piece, m_max));
  const int64_t B = o.batch, trials = rounded_trials(o);
  std::vector<int32_t> prefix, copy2, logits_rows;
  std::vector<float> logits;
  for (int64_t mm : ms) {
    for (int64_t d : ds) {
      CopyResult r;
      r.m = mm;
      r.d = d;
      r.trials = trials;
      SplitMix64 rng = point_rng(o.seed, static_cast<uint64_t>(mm), static_cast<uint64_t>(d));
      for (int64_t t0 = 0; t0 < trials; t0 += B) {
        // Row b: s (m tokens), a held-out stretch of d tokens, then s again.
        prefix.assign(static_cast<size_t>(B * (mm + d)), 0);
        copy2.assign(static_cast<size_t>(B * mm), 0);
        for (int64_t b = 0; b < B; ++b) {
          int32_t* p = prefix.data() + b * (mm + d);
          for (int64_t i = 0; i < mm; ++i)
            p[i] = static_cast<int32_t>(kFirstOrdinaryId + rng.below(static_cast<uint64_t>(V - kFirstOrdinaryId)));
          const int64_t off = static_cast<int64_t>(rng.below(static_cast<uint64_t>(heldout.size() - d)));
          std::copy_n(heldout.data() + off, d, p + mm);
          std::copy_n(p, mm, copy2.data() + b * mm);
        }
        s.reset();
        s.feed(prefix.data(), mm + d);
        s.feed_logits(copy2.data(), mm, &logits);
        for (int64_t b = 0; b < B; ++b)
          for (int64_t i = 0; i + 1 < mm; ++i) {
            const int32_t want = copy2[static_cast<size_t>(b * mm + i + 1)];
            r.correct += argmax_row(logits.data() + (b * mm + i) * V, V) == want;
            ++r.predictions;
          }
      }
      if (each) each(r);
    }
  }
  return Status::ok();
}

Status eval_passkey(Model& m, const Tokenizer& tok, const std::vector<int32_t>& heldout,
                    const std::vector<int64_t>& contexts, const std::vector<double>& depths, const RecallOptions& o,
                    const std::function<void(const PasskeyResult&)>& each) {
  LAPLACE_RETURN_IF_ERROR(check_options(o));
  if (contexts.empty() || depths.empty())
    return Status::invalid_argument("passkey test: give at least one context length and one depth");
  for (double p : depths)
    if (!(p >= 0 && p <= 1)) return Status::invalid_argument("passkey test: depths must lie in [0, 1]");
  const int64_t V = m.config().vocab_size;
  if (tok.vocab_size() != V)
    return Status::invalid_argument("passkey test: the tokenizer has " + std::to_string(tok.vocab_size()) +
                                    " pieces but the model's vocabulary is " + std::to_string(V));
  // The question, and each key's tokens as they follow it (encoded together, so the key's
  // first token is the one the model would write after "is").
  const std::string question = "\nWhat is the pass key? The pass key is";
  std::vector<int32_t> q;
  LAPLACE_RETURN_IF_ERROR(tok.encode(question, &q));
  struct Trial {
    std::vector<int32_t> needle, answer;
  };
  auto make_trial = [&](SplitMix64& rng, Trial* t) -> Status {
    char key[8];
    std::snprintf(key, sizeof key, "%05llu", static_cast<unsigned long long>(rng.below(100000)));
    LAPLACE_RETURN_IF_ERROR(tok.encode(std::string(" The pass key is ") + key + ". Remember it. ", &t->needle));
    std::vector<int32_t> full;
    LAPLACE_RETURN_IF_ERROR(tok.encode(question + " " + key, &full));
    if (full.size() <= q.size() || !std::equal(q.begin(), q.end(), full.begin()))
      return Status::unsupported("passkey test: the tokenizer does not keep the question's tokens before the key");
    t->answer.assign(full.begin() + static_cast<std::ptrdiff_t>(q.size()), full.end());
    return Status::ok();
  };
  const int64_t B = o.batch, trials = rounded_trials(o);
  int64_t need_max = 0;
  for (int64_t L : contexts) need_max = std::max(need_max, L);
  // Room for the question and a needle (about 16 tokens with the corpus tokenizer; 32 allowed):
  // an early check of the grid, before any forward. Each trial checks its own needle again.
  const int64_t overhead = static_cast<int64_t>(q.size()) + 32;
  for (int64_t L : contexts)
    if (L < overhead + 1)
      return Status::invalid_argument("passkey test: context " + std::to_string(L) + " is shorter than the needle and "
                                      "question (" + std::to_string(overhead) + " tokens)");
  if (static_cast<int64_t>(heldout.size()) <= need_max)
    return Status::invalid_argument("passkey test: context " + std::to_string(need_max) +
                                    " needs more held-out text than the " + std::to_string(heldout.size()) +
                                    " tokens given");
  const int64_t answer_max = 16;
  SequenceStream s;
  LAPLACE_RETURN_IF_ERROR(s.init(&m, B, std::max<int64_t>(o.piece, answer_max), answer_max));
  std::vector<int32_t> prefix, tail;
  std::vector<float> logits;
  std::vector<Trial> rows(static_cast<size_t>(B));
  for (int64_t L : contexts) {
    for (double depth : depths) {
      PasskeyResult r;
      r.context = L;
      r.depth = depth;
      r.trials = trials;
      SplitMix64 rng = point_rng(o.seed, static_cast<uint64_t>(L), static_cast<uint64_t>(std::llround(depth * 1e6)));
      for (int64_t t0 = 0; t0 < trials; t0 += B) {
        // Row b: text[0, at) + needle + text[at, h) + question, L tokens in all; the last
        // question token is fed with the answer so its logits predict the key's first token.
        prefix.assign(static_cast<size_t>(B * (L - 1)), 0);
        int64_t a_len = 0;
        for (int64_t b = 0; b < B; ++b) {
          Trial& t = rows[static_cast<size_t>(b)];
          LAPLACE_RETURN_IF_ERROR(make_trial(rng, &t));
          if (static_cast<int64_t>(t.answer.size()) > answer_max)
            return Status::unsupported("passkey test: a key took more than 16 tokens");
          a_len = std::max<int64_t>(a_len, static_cast<int64_t>(t.answer.size()));
          const int64_t h = L - static_cast<int64_t>(t.needle.size() + q.size());
          if (h < 1) return Status::invalid_argument("passkey test: context " + std::to_string(L) + " is too short");
          const int64_t at = static_cast<int64_t>(std::llround(depth * static_cast<double>(h)));
          const int64_t off = static_cast<int64_t>(rng.below(static_cast<uint64_t>(heldout.size() - h)));
          std::vector<int32_t> row;
          row.reserve(static_cast<size_t>(L));
          row.insert(row.end(), heldout.begin() + off, heldout.begin() + off + at);
          row.insert(row.end(), t.needle.begin(), t.needle.end());
          row.insert(row.end(), heldout.begin() + off + at, heldout.begin() + off + h);
          row.insert(row.end(), q.begin(), q.end());
          std::copy_n(row.data(), L - 1, prefix.data() + b * (L - 1));
        }
        tail.assign(static_cast<size_t>(B * a_len), q.back());
        for (int64_t b = 0; b < B; ++b) {
          const Trial& t = rows[static_cast<size_t>(b)];
          int32_t* x = tail.data() + b * a_len;
          x[0] = q.back();
          for (size_t i = 0; i + 1 < t.answer.size(); ++i) x[i + 1] = t.answer[i];
        }
        s.reset();
        if (L > 1) s.feed(prefix.data(), L - 1);
        s.feed_logits(tail.data(), a_len, &logits);
        for (int64_t b = 0; b < B; ++b) {
          const Trial& t = rows[static_cast<size_t>(b)];
          bool ok = true;
          for (size_t i = 0; i < t.answer.size() && ok; ++i)
            ok = argmax_row(logits.data() + (b * a_len + static_cast<int64_t>(i)) * V, V) == t.answer[i];
          r.found += ok;
        }
      }
      if (each) each(r);
    }
  }
  return Status::ok();
}

}  // namespace laplace
