#include "serve/draft_model.h"

#include <algorithm>
#include <filesystem>

#include "core/file_util.h"
#include "model/config.h"
#include "serve/generate.h"
#include "serve/sampler.h"

namespace laplace {

Status DraftModelDrafter::create(std::unique_ptr<Model> model, int64_t vocab, int64_t slots, int64_t chunk,
                                 std::unique_ptr<DraftModelDrafter>* out) {
  if (!model) return Status::invalid_argument("draft model: none given");
  const Config& c = model->config();
  if (c.vocab_size != vocab)
    return Status::invalid_argument("draft model: its vocabulary has " + std::to_string(c.vocab_size) +
                                    " tokens, the served model's " + std::to_string(vocab) +
                                    "; a draft model needs the served model's tokenizer");
  if (slots < 1) return Status::invalid_argument("draft model: slots must be ≥ 1, not " + std::to_string(slots));
  if (chunk < 1) return Status::invalid_argument("draft model: chunk must be ≥ 1, not " + std::to_string(chunk));
  std::unique_ptr<DraftModelDrafter> d(new DraftModelDrafter());
  PlanOptions po;
  po.max_batch = 1;
  po.max_seq = chunk;
  LAPLACE_RETURN_IF_ERROR(model->plan(po).with_context("draft model"));
  // States as the served model's pool holds them by default (F32; F64 for an F64 model).
  const DType sdt = model->dtype() == DType::kF64 ? DType::kF64 : DType::kF32;
  LAPLACE_RETURN_IF_ERROR(d->pool_.create(c, model->backend(), slots + 1, sdt).with_context("draft model"));
  d->entries_.assign(static_cast<size_t>(slots), Entry{});
  d->chunk_ = chunk;
  d->model_ = std::move(model);
  *out = std::move(d);
  return Status::ok();
}

int32_t DraftModelDrafter::slot_for(RequestId id) {
  size_t pick = 0;
  for (size_t i = 0; i < entries_.size(); ++i) {
    if (entries_[i].id == id) return static_cast<int32_t>(i);
    if (entries_[i].used < entries_[pick].used) pick = i;  // a free entry has used 0
  }
  if (entries_[pick].id != 0) ++evictions_;
  entries_[pick] = Entry{id, 0, 0};
  pool_.reset(model_->backend(), static_cast<int64_t>(pick));
  return static_cast<int32_t>(pick);
}

void DraftModelDrafter::propose(RequestId id, std::span<const int32_t> context, int64_t k,
                                std::vector<int32_t>* out) {
  out->clear();
  const int64_t L = static_cast<int64_t>(context.size());
  if (k <= 0 || L < 1) return;
  int32_t slot = slot_for(id);
  Entry& e = entries_[static_cast<size_t>(slot)];
  e.used = ++clock_;
  // A context that is not the one fed so far (it only grows) starts over.
  if (e.fed > L - 1) {
    pool_.reset(model_->backend(), slot);
    e.fed = 0;
  }
  // The engine's contexts hold vocabulary ids only; a context with anything else gets no guess.
  const int64_t V = model_->config().vocab_size;
  if (std::any_of(context.begin() + e.fed, context.end(), [V](int32_t t) { return t < 0 || t >= V; })) return;
  ForwardOptions piece;
  piece.last_logits_only = true;
  // The context's new tokens but the last, in pieces of at most chunk_ (chunked form).
  while (e.fed < L - 1) {
    const int64_t n = std::min(chunk_, L - 1 - e.fed);
    model_->forward(context.data() + e.fed, 1, n, piece, &pool_, &slot);
    e.fed += n;
    fed_tokens_ += n;
  }
  // The draft: greedy steps from the last token in the scratch slot, which is then let go.
  const int32_t scratch = static_cast<int32_t>(entries_.size());
  pool_.copy_slot(model_->backend(), scratch, slot);
  ForwardOptions step;
  step.form = GlaForm::kRecurrent;
  step.last_logits_only = true;
  int32_t tok = context[static_cast<size_t>(L - 1)];
  for (int64_t j = 0; j < k; ++j) {
    model_->forward(&tok, 1, 1, step, &pool_, &scratch);
    logits_row_to_host(*model_, 0, &logits_);
    tok = argmax(logits_.data(), V);
    out->push_back(tok);
  }
}

Status open_draft_model(const std::string& dir, const Config& target, const std::string& target_tokenizer,
                        Backend& be, DType dtype, int64_t slots, std::unique_ptr<DraftModelDrafter>* out) {
  Config c;
  LAPLACE_RETURN_IF_ERROR(config_load(dir + "/config.json", &c).with_context("draft model " + dir));
  const std::string tok = dir + "/tokenizer.model";
  if (!target_tokenizer.empty() && std::filesystem::exists(tok) && std::filesystem::exists(target_tokenizer)) {
    std::string a, b;
    LAPLACE_RETURN_IF_ERROR(read_file(tok, &a));
    LAPLACE_RETURN_IF_ERROR(read_file(target_tokenizer, &b));
    if (a != b)
      return Status::invalid_argument("draft model " + dir + ": its tokenizer.model differs from the served model's " +
                                      target_tokenizer + "; a draft model needs the served model's tokenizer");
  }
  auto m = std::make_unique<Model>();
  LAPLACE_RETURN_IF_ERROR(m->create(c, be, dtype).with_context("draft model " + dir));
  LAPLACE_RETURN_IF_ERROR(m->load(dir + "/model.safetensors").with_context("draft model " + dir));
  return DraftModelDrafter::create(std::move(m), target.vocab_size, slots, 64, out);
}

}  // namespace laplace
