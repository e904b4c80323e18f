// Drafts from a second, smaller Laplace model (docs/serving.md §11): its greedy continuation of
// each sequence's context, which the target model then verifies in one forward.
//
// The draft model keeps each sequence's state in a slot of its own pool, fed up to (not
// including) the context's last token, so a call feeds only the tokens the target accepted
// since the last one. The k draft steps run in a scratch slot copied from that state and are
// thrown away with it: a rejected draft costs the draft model nothing to roll back, and the
// accepted tokens come back through the context. With more sequences than slots, the one
// drafted for least recently gives up its slot and is fed again from its start when it
// returns (its drafts are the same; only the work is repeated).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/status.h"
#include "model/model.h"
#include "model/state.h"
#include "serve/drafter.h"

namespace laplace {

class DraftModelDrafter : public Drafter {
 public:
  // `model`: created and loaded (its plan is made here: one sequence, pieces of `chunk` tokens);
  // `vocab`: the target's vocabulary size, which the draft model's must equal; `slots`: the
  // sequences whose draft states are kept at once (the engine's live slots suit).
  static Status create(std::unique_ptr<Model> model, int64_t vocab, int64_t slots, int64_t chunk,
                       std::unique_ptr<DraftModelDrafter>* out);
  void propose(RequestId id, std::span<const int32_t> context, int64_t k, std::vector<int32_t>* out) override;

  const Model& model() const { return *model_; }
  // Context tokens fed through the draft model (drafted tokens not counted), and the slots
  // given up to another sequence: the cost side of drafting.
  int64_t fed_tokens() const { return fed_tokens_; }
  int64_t evictions() const { return evictions_; }

 private:
  struct Entry {
    RequestId id = 0;  // 0: free
    int64_t fed = 0;   // context tokens in the slot's state
    uint64_t used = 0; // when it was last drafted for
  };
  DraftModelDrafter() = default;
  int32_t slot_for(RequestId id);
  std::unique_ptr<Model> model_;
  StatePool pool_;
  std::vector<Entry> entries_;  // one per slot but the last, the scratch slot
  int64_t chunk_ = 0;
  uint64_t clock_ = 0;
  int64_t fed_tokens_ = 0, evictions_ = 0;
  std::vector<float> logits_;
};

// --speculative draft:DIR: the model directory DIR (config.json, model.safetensors and, where it
// has one, tokenizer.model) on `be` in `dtype`. Refused with a message: a vocabulary other than
// the target's, a tokenizer file that differs from `target_tokenizer` (when both exist), a
// directory that is not a model.
Status open_draft_model(const std::string& dir, const Config& target, const std::string& target_tokenizer,
                        Backend& be, DType dtype, int64_t slots, std::unique_ptr<DraftModelDrafter>* out);

}  // namespace laplace
