#include "eval/stream.h"

#include <algorithm>
#include <cmath>

#include "core/check.h"
#include "serve/generate.h"
#include "text/data_loader.h"
#include "text/shard.h"

namespace laplace {

Status load_heldout_tokens(const std::vector<std::string>& patterns, int64_t vocab_size, std::vector<int32_t>* out) {
  if (patterns.empty()) return Status::invalid_argument("no held-out shards given (--data)");
  std::vector<std::string> paths;
  LAPLACE_RETURN_IF_ERROR(expand_shard_patterns(patterns, &paths));
  std::vector<int32_t> all;
  for (const std::string& p : paths) {
    ShardReader r;
    LAPLACE_RETURN_IF_ERROR(ShardReader::open(p, vocab_size, &r));
    const size_t at = all.size();
    all.resize(at + static_cast<size_t>(r.size()));
    if (r.size() > 0) r.read(0, r.size(), all.data() + at);
  }
  if (all.empty()) return Status::invalid_argument("the held-out shards hold no tokens");
  *out = std::move(all);
  return Status::ok();
}

int32_t argmax_row(const float* v, int64_t n) {
  return static_cast<int32_t>(std::max_element(v, v + n) - v);
}

double logits_rel_rms(const std::vector<float>& test, const std::vector<float>& ref) {
  LAPLACE_CHECK(test.size() == ref.size(), "logits_rel_rms: blocks of different sizes");
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double d = static_cast<double>(test[i]) - ref[i];
    num += d * d;
    den += static_cast<double>(ref[i]) * ref[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

Status SequenceStream::init(Model* m, int64_t batch, int64_t piece, int64_t logit_tokens) {
  if (batch < 1 || piece < 1 || logit_tokens < 1 || logit_tokens > piece)
    return Status::invalid_argument("sequence stream: need batch >= 1 and 1 <= logit tokens <= piece");
  m_ = m;
  batch_ = batch;
  piece_ = piece;
  logit_tokens_ = logit_tokens;
  PlanOptions po;
  po.max_batch = batch;
  po.max_seq = piece;
  po.max_tokens = batch * piece;
  po.max_logit_rows = batch * logit_tokens;
  LAPLACE_RETURN_IF_ERROR(m->plan(po));
  const DType sd = m->dtype() == DType::kF64 ? DType::kF64 : DType::kF32;
  LAPLACE_RETURN_IF_ERROR(pool_.create(m->config(), m->backend(), batch, sd));
  slots_.resize(static_cast<size_t>(batch));
  for (int64_t b = 0; b < batch; ++b) slots_[static_cast<size_t>(b)] = static_cast<int32_t>(b);
  return Status::ok();
}

void SequenceStream::reset() {
  for (int64_t b = 0; b < batch_; ++b) pool_.reset(m_->backend(), b);
}

const int32_t* SequenceStream::columns(const int32_t* x, int64_t width, int64_t from, int64_t n) {
  if (batch_ == 1 || (from == 0 && n == width)) return x + from;
  stage_.resize(static_cast<size_t>(batch_ * n));
  for (int64_t b = 0; b < batch_; ++b) std::copy_n(x + b * width + from, n, stage_.data() + b * n);
  return stage_.data();
}

void SequenceStream::forward(const int32_t* tokens, int64_t n, bool last_only) {
  ForwardOptions fo;
  fo.last_logits_only = last_only;
  m_->forward(tokens, batch_, n, fo, &pool_, slots_.data());
}

void SequenceStream::feed(const int32_t* tokens, int64_t n) {
  LAPLACE_CHECK(n >= 1, "sequence stream: feed needs at least one token");
  for (int64_t at = 0; at < n; at += piece_) {
    const int64_t k = std::min(piece_, n - at);
    forward(columns(tokens, n, at, k), k, /*last_only=*/true);
  }
}

void SequenceStream::feed_logits(const int32_t* tokens, int64_t n, std::vector<float>* logits) {
  LAPLACE_CHECK(n >= 1 && n <= logit_tokens_, "sequence stream: feed_logits takes 1 to logit_tokens tokens");
  forward(tokens, n, /*last_only=*/false);
  logits_rows_to_host(*m_, 0, batch_ * n, logits);
}

double SequenceStream::feed_loss(const int32_t* tokens, const int32_t* targets, int64_t n, int64_t* count) {
  LAPLACE_CHECK(n >= 1, "sequence stream: feed_loss needs at least one token");
  double sum = 0;
  int64_t counted = 0;
  std::vector<int32_t> t;
  for (int64_t at = 0; at < n; at += logit_tokens_) {
    const int64_t k = std::min(logit_tokens_, n - at);
    t.resize(static_cast<size_t>(batch_ * k));
    for (int64_t b = 0; b < batch_; ++b) std::copy_n(targets + b * n + at, k, t.data() + b * k);
    const int64_t c = std::count_if(t.begin(), t.end(), [](int32_t v) { return v >= 0; });
    forward(columns(tokens, n, at, k), k, /*last_only=*/false);
    // The model's loss is the mean over the counted targets; the sum is what adds up across pieces.
    if (c > 0) sum += m_->loss(t.data()) * static_cast<double>(c);
    counted += c;
  }
  *count = counted;
  return sum;
}

}  // namespace laplace
