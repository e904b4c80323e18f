#include "serve/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "serve/request.h"

namespace laplace {

int32_t argmax(const float* x, int64_t n) {
  int64_t best = 0;
  for (int64_t i = 1; i < n; ++i)
    if (x[i] > x[best]) best = i;
  return static_cast<int32_t>(best);
}

void Sampler::observe_prompt(const std::vector<int32_t>& ids) {
  if (!penalized()) return;  // only penalties read the history
  for (int32_t t : ids) seen_[t] = true;
}

void Sampler::apply_penalties(const float* logits, int64_t V) {
  work_.assign(logits, logits + V);
  // Penalties act on logits before temperature (OpenAI / vLLM semantics).
  if (opt_.repetition_penalty != 1.0) {
    for (const auto& [t, _] : seen_) {
      if (t < 0 || t >= V) continue;
      float& x = work_[t];
      x = x > 0 ? static_cast<float>(x / opt_.repetition_penalty) : static_cast<float>(x * opt_.repetition_penalty);
    }
  }
  for (const auto& [t, n] : generated_counts_) {
    if (t < 0 || t >= V) continue;
    work_[t] -= static_cast<float>(opt_.frequency_penalty * static_cast<double>(n) + opt_.presence_penalty);
  }
  for (const auto& [t, bias] : opt_.logit_bias)
    if (t >= 0 && t < V) work_[t] += bias;
}

int64_t Sampler::distribution(int64_t V, std::vector<double>* probs, double* total) {
  // Softmax at temperature, in double, over the candidates kept by top-k.
  order_.resize(V);
  std::iota(order_.begin(), order_.end(), 0);
  auto by_logit = [&](int32_t a, int32_t b) { return work_[a] > work_[b] || (work_[a] == work_[b] && a < b); };
  int64_t keep = V;
  if (opt_.top_k > 0 && opt_.top_k < V) {
    keep = opt_.top_k;
    std::partial_sort(order_.begin(), order_.begin() + keep, order_.end(), by_logit);
  } else {
    std::sort(order_.begin(), order_.end(), by_logit);
  }
  std::vector<double>& p = *probs;
  p.assign(keep, 0.0);
  const double mx = work_[order_[0]];
  double sum = 0;
  for (int64_t i = 0; i < keep; ++i) sum += p[i] = std::exp((work_[order_[i]] - mx) / opt_.temperature);
  for (auto& x : p) x /= sum;
  // min-p relative to the most likely token, then top-p (nucleus) on what is left.
  if (opt_.min_p > 0) {
    const double floor = opt_.min_p * p[0];
    int64_t k = 1;
    while (k < keep && p[k] >= floor) ++k;
    keep = k;
  }
  if (opt_.top_p < 1.0) {
    double cum = 0;
    int64_t k = 0;
    while (k < keep) {
      cum += p[k++];
      if (cum >= opt_.top_p) break;
    }
    keep = std::max<int64_t>(k, 1);
  }
  double t = 0;
  for (int64_t i = 0; i < keep; ++i) t += p[i];
  *total = t;
  return keep;
}

int32_t Sampler::sample(const float* logits, int64_t V) {
  apply_penalties(logits, V);
  int32_t token;
  if (opt_.temperature <= 0.0) {
    token = argmax(work_.data(), V);
  } else {
    double total = 0;
    const int64_t keep = distribution(V, &probs_, &total);
    const std::vector<double>& p = probs_;
    double r = rng_.uniform() * total;
    int64_t pick = keep - 1;
    for (int64_t i = 0; i < keep; ++i) {
      r -= p[i];
      if (r < 0) {
        pick = i;
        break;
      }
    }
    token = order_[pick];
  }
  record(token);
  return token;
}

int32_t Sampler::sample_speculative(const float* logits, int64_t V, int32_t draft) {
  if (draft < 0 || draft >= V) return sample(logits, V);
  apply_penalties(logits, V);
  int32_t token;
  if (opt_.temperature <= 0.0) {
    token = argmax(work_.data(), V);  // the draft is right or not; nothing is drawn
  } else {
    // Rejection sampling with a point-mass draft q = δ_x (Leviathan et al. 2023; Chen et al.
    // 2023): accept x with probability min(1, p(x)/q(x)) = p(x), else draw from the residual
    // max(p − q, 0) normalised, which is p without x. P(x) = p(x) and, for y ≠ x,
    // P(y) = (1 − p(x)) · p(y) / (1 − p(x)) = p(y): the token is distributed as sample()'s.
    double total = 0;
    const int64_t keep = distribution(V, &probs_, &total);
    const std::vector<double>& p = probs_;
    double px = 0;
    for (int64_t i = 0; i < keep; ++i)
      if (order_[i] == draft) px = p[i];
    if (rng_.uniform() * total < px) {
      token = draft;
    } else {
      double r = rng_.uniform() * (total - px);
      int64_t pick = -1;
      for (int64_t i = 0; i < keep; ++i) {
        if (order_[i] == draft) continue;
        pick = i;  // the last candidate other than x, should rounding leave r ≥ 0
        r -= p[i];
        if (r < 0) break;
      }
      token = pick >= 0 ? order_[pick] : draft;  // (x the only candidate: px = total, accepted above)
    }
  }
  record(token);
  return token;
}

bool Sampler::plain_greedy() const {
  return opt_.temperature <= 0.0 && opt_.repetition_penalty == 1.0 && opt_.frequency_penalty == 0.0 &&
         opt_.presence_penalty == 0.0 && opt_.logit_bias.empty();
}

void Sampler::record(int32_t token) {
  // Without penalties nothing reads these counts, so a large greedy batch does not pay two
  // hash-map updates per token on the host.
  if (!penalized()) return;
  ++generated_counts_[token];
  seen_[token] = true;
}

TokenLogprobs token_logprobs(const float* logits, int64_t V, int32_t token, int k) {
  double mx = -std::numeric_limits<double>::infinity();
  for (int64_t i = 0; i < V; ++i) mx = std::max(mx, static_cast<double>(logits[i]));
  double sum = 0;  // fixed order: the same logits give the same bits
  for (int64_t i = 0; i < V; ++i) sum += std::exp(static_cast<double>(logits[i]) - mx);
  const double lse = mx + std::log(sum);
  TokenLogprobs r;
  r.token = token;
  r.logprob = static_cast<float>(static_cast<double>(logits[token]) - lse);
  const int64_t n = std::min<int64_t>(k, V);
  if (n > 0) {
    std::vector<int32_t> idx(static_cast<size_t>(V));
    for (int64_t i = 0; i < V; ++i) idx[i] = static_cast<int32_t>(i);
    std::partial_sort(idx.begin(), idx.begin() + n, idx.end(), [&](int32_t a, int32_t b) {
      return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
    });
    for (int64_t i = 0; i < n; ++i)
      r.top.emplace_back(idx[i], static_cast<float>(static_cast<double>(logits[idx[i]]) - lse));
  }
  return r;
}

}  // namespace laplace
