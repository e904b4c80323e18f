// Evaluations on a trained model over long contexts share one way of running them: B
// sequences fed through the model piece by piece, each row's context carried in a state
// slot between pieces, exactly as the server prefills a long prompt. A context of any length
// then costs the activations of one piece plus the fixed state (docs/model.md §5), which is
// what lets these evaluations reach 128k tokens and what the position evaluation shows.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/status.h"
#include "model/model.h"
#include "model/state.h"

namespace laplace {

// Held-out tokens: every token of the shards matching `patterns`, in order (documents are
// concatenated as the trainer reads them). Errors name the shard; an empty result is an error.
Status load_heldout_tokens(const std::vector<std::string>& patterns, int64_t vocab_size, std::vector<int32_t>* out);

class SequenceStream {
 public:
  // Plans `m` for `batch` rows of at most `piece` tokens per forward, with the logits of
  // every position of up to `logit_tokens` tokens per row (feed_logits, feed_loss), and a
  // pool of `batch` slots (F32 states; F64 for F64 models). Replaces the model's plan.
  Status init(Model* m, int64_t batch, int64_t piece, int64_t logit_tokens);
  int64_t batch() const { return batch_; }
  int64_t piece() const { return piece_; }
  // Every row back to the empty context.
  void reset();
  // Feeds tokens [batch, n] (row-major, any n ≥ 1), continuing each row's context.
  void feed(const int32_t* tokens, int64_t n);
  // Feeds [batch, n], n ≤ logit_tokens, and leaves the host logits of every position,
  // [batch·n, V] (row r's position i at r·n + i).
  void feed_logits(const int32_t* tokens, int64_t n, std::vector<float>* logits);
  // Feeds [batch, n] (any n) and returns the summed cross-entropy (nats) of the targets
  // [batch, n] (< 0: not counted), with the count of counted targets in *count.
  double feed_loss(const int32_t* tokens, const int32_t* targets, int64_t n, int64_t* count);

 private:
  // Columns [from, from + n) of a [batch, width] block into stage_ ([batch, n], contiguous).
  const int32_t* columns(const int32_t* x, int64_t width, int64_t from, int64_t n);
  void forward(const int32_t* tokens, int64_t n, bool last_only);

  Model* m_ = nullptr;
  StatePool pool_;
  std::vector<int32_t> slots_, stage_;
  int64_t batch_ = 0, piece_ = 0, logit_tokens_ = 0;
};

// Index of the largest of v[0..n) (the first on ties: the model's greedy choice).
int32_t argmax_row(const float* v, int64_t n);

// sqrt(Σ (test − ref)²) / sqrt(Σ ref²) over two logits blocks of one size, in double: how far
// a serving option's logits are from the reference's.
double logits_rel_rms(const std::vector<float>& test, const std::vector<float>& ref);

}  // namespace laplace
