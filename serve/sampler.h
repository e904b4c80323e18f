// Token sampling from one row of logits, on the host. Deterministic: the same
// logits, options and seed give the same token on every machine (the generator
// and its conversion to [0,1) are our own, not the standard library's
// implementation-defined distributions).
#pragma once

#include <cstdint>
#include <unordered_map>
#include <vector>

#include "core/rng.h"

namespace laplace {

struct SamplingOptions {
  double temperature = 1.0;  // 0 = greedy
  int64_t top_k = 0;         // 0 = off
  double top_p = 1.0;        // 1 = off
  double min_p = 0.0;        // 0 = off; keeps tokens with p ≥ min_p·p_max
  double presence_penalty = 0.0;
  double frequency_penalty = 0.0;
  double repetition_penalty = 1.0;  // 1 = off (CTRL-style: divide positive logits)
  uint64_t seed = 0;
  // Added to the logits before sampling (OpenAI's logit_bias: token id, bias in [-100, 100];
  // -100 in effect bans a token, 100 all but forces it). After the penalties.
  std::vector<std::pair<int32_t, float>> logit_bias;
};

// The sampler's generator (core/rng.h), with its state exposed for snapshots.
class Rng {
 public:
  explicit Rng(uint64_t seed = 0) : g_{seed} {}
  uint64_t next() { return g_.next(); }
  double uniform() { return g_.uniform(); }  // [0, 1)
  uint64_t state() const { return g_.state; }
  void set_state(uint64_t s) { g_.state = s; }

 private:
  SplitMix64 g_;
};

class Sampler {
 public:
  explicit Sampler(const SamplingOptions& o) : opt_(o), rng_(o.seed) {}

  // Picks a token from logits[0..V) and records it for the penalties.
  int32_t sample(const float* logits, int64_t V);
  // A token for a position of a speculative verification (docs/serving.md §11) whose drafted
  // token is `draft` (< 0: none, then sample()). Greedy: the argmax, as sample() (the draft is
  // accepted when they are equal). Otherwise rejection sampling against the point-mass draft:
  // draft with probability p(draft), else a draw from p without it, so the token is distributed
  // exactly as sample()'s (p: the distribution sample() draws from, penalties, temperature,
  // top-k/p and min-p applied). Records the token as sample() does.
  int32_t sample_speculative(const float* logits, int64_t V, int32_t draft);
  // True when sample() is argmax(logits) whatever was seen: temperature 0 and no
  // penalty. The engine then takes the token from a device argmax (ops argmax_rows,
  // the same tie rule) and reports it with record().
  bool plain_greedy() const;
  // Records a token chosen elsewhere as sample() would have recorded it.
  void record(int32_t token);
  // Records prompt tokens too (penalties count them, as OpenAI's and vLLM's do for
  // repetition; presence/frequency count only generated tokens).
  void observe_prompt(const std::vector<int32_t>& ids);
  const SamplingOptions& options() const { return opt_; }

 private:
  SamplingOptions opt_;
  Rng rng_;
  bool penalized() const {
    return opt_.repetition_penalty != 1.0 || opt_.frequency_penalty != 0.0 || opt_.presence_penalty != 0.0;
  }
  std::unordered_map<int32_t, int64_t> generated_counts_;
  std::unordered_map<int32_t, bool> seen_;  // prompt or generated, for repetition
  // work_ = logits with the penalties and biases applied.
  void apply_penalties(const float* logits, int64_t V);
  // The distribution sample() draws from (temperature > 0): candidates order_[0, keep) with
  // probabilities (*p)[0, keep) summing to *total (≤ 1 after min-p / top-p); returns keep.
  int64_t distribution(int64_t V, std::vector<double>* p, double* total);
  std::vector<float> work_;
  std::vector<int32_t> order_;
  std::vector<double> probs_;
};

struct TokenLogprobs;  // serve/request.h
// log-softmax of logits[0..V) at `token`, and the k most likely tokens (ties: lower id).
TokenLogprobs token_logprobs(const float* logits, int64_t V, int32_t token, int k);

// Index of the largest value; ties go to the lowest index.
int32_t argmax(const float* x, int64_t n);

}  // namespace laplace
