#include "serve/generate.h"

#include <algorithm>

namespace laplace {

void logits_row_to_host(const Model& m, int64_t row, std::vector<float>* out) {
  Tensor src = m.logits().select(row);
  const int64_t V = src.numel();
  out->resize(V);
  Backend& be = m.backend();
  if (src.dtype == DType::kF32) {
    be.copy(Tensor(out->data(), DType::kF32, {V}), src);
  } else if (src.dtype == DType::kF64) {
    std::vector<double> d(V);
    be.copy(Tensor(d.data(), DType::kF64, {V}), src);
    be.synchronize();
    std::copy(d.begin(), d.end(), out->begin());
  } else {
    LAPLACE_CHECK(src.dtype == DType::kBF16, "logits_row_to_host: unsupported dtype");
    std::vector<uint16_t> h(V);
    be.copy(Tensor(h.data(), DType::kBF16, {V}), src);
    be.synchronize();
    for (int64_t i = 0; i < V; ++i) (*out)[i] = bf16_to_float(h[i]);
  }
  be.synchronize();
}

void prefill(Model& m, StatePool& pool, int32_t slot, const std::vector<int32_t>& tokens,
             std::vector<float>* last_logits) {
  LAPLACE_CHECK(!tokens.empty(), "prefill: no tokens");
  const int64_t piece = m.plan_options().max_seq;
  ForwardOptions fo;
  fo.form = GlaForm::kChunked;
  fo.last_logits_only = true;
  for (size_t begin = 0; begin < tokens.size(); begin += piece) {
    const int64_t n = std::min<int64_t>(piece, static_cast<int64_t>(tokens.size() - begin));
    m.forward(tokens.data() + begin, 1, n, fo, &pool, &slot);
  }
  logits_row_to_host(m, 0, last_logits);
}

std::vector<int32_t> generate(Model& m, StatePool& pool, int32_t slot, const std::vector<int32_t>& prompt,
                              const GenerateOptions& opt, const std::function<void(int32_t)>& on_token) {
  std::vector<float> logits;
  prefill(m, pool, slot, prompt, &logits);
  Sampler sampler(opt.sampling);
  sampler.observe_prompt(prompt);
  std::vector<int32_t> out;
  ForwardOptions step;
  step.form = GlaForm::kRecurrent;
  step.last_logits_only = true;
  const int64_t V = m.config().vocab_size;
  for (int64_t i = 0; i < opt.max_tokens; ++i) {
    int32_t tok = sampler.sample(logits.data(), V);
    out.push_back(tok);
    if (on_token) on_token(tok);
    if (std::find(opt.stop_ids.begin(), opt.stop_ids.end(), tok) != opt.stop_ids.end()) break;
    if (i + 1 == opt.max_tokens) break;
    m.forward(&tok, 1, 1, step, &pool, &slot);
    logits_row_to_host(m, 0, &logits);
  }
  return out;
}

}  // namespace laplace
