#include "serve/generate.h"

#include <algorithm>

namespace laplace {

void logits_rows_to_host(const Model& m, int64_t first, int64_t rows, std::vector<float>* out) {
  const Tensor all = m.logits();
  LAPLACE_CHECK(first >= 0 && rows >= 0 && first + rows <= all.shape[0], "logits_rows_to_host: no such rows");
  const int64_t V = all.shape[1];
  out->resize(static_cast<size_t>(rows * V));
  if (rows == 0) return;
  const Tensor src = all.slice(0, first, first + rows);
  Backend& be = m.backend();
  if (src.dtype == DType::kF32) {
    be.copy(Tensor(out->data(), DType::kF32, {rows, V}), src);
  } else if (src.dtype == DType::kF64) {
    std::vector<double> d(static_cast<size_t>(rows * V));
    be.copy(Tensor(d.data(), DType::kF64, {rows, V}), src);
    be.synchronize();
    std::copy(d.begin(), d.end(), out->begin());
  } else {
    LAPLACE_CHECK(src.dtype == DType::kBF16, "logits_rows_to_host: unsupported dtype");
    std::vector<uint16_t> h(static_cast<size_t>(rows * V));
    be.copy(Tensor(h.data(), DType::kBF16, {rows, V}), src);
    be.synchronize();
    for (size_t i = 0; i < h.size(); ++i) (*out)[i] = bf16_to_float(h[i]);
  }
  be.synchronize();
}

void logits_row_to_host(const Model& m, int64_t row, std::vector<float>* out) {
  logits_rows_to_host(m, row, 1, out);
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
