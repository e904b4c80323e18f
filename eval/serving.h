// What each serving option costs on a trained model (docs/quality.md, docs/serving.md §4):
// bf16 weights, bf16 states and deferred write-back, each against the reference (the
// model's own weights, F32 states written back every step).
//
// P held-out windows of prompt + S + 1 tokens: both runs prefill the prompt, then decode
// the window's real next tokens one at a time (teacher forcing on real text, so both see the
// same inputs). At each of the S steps: the loss of the real next token under each run, whether
// the two greedy choices agree, and the relative RMS error of the option's logits. The mean
// loss difference is the option's Δ validation loss on decode.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/status.h"
#include "model/model.h"

namespace laplace {

struct ServingOption {
  std::string name;           // "bf16-weights", "bf16-states", "defer8", …
  bool low_weights = false;   // run on the bf16 copy of the weights
  // run on the weights with their body matrices rounded to FP8 E4M3 with per-row scales
  // (model/quantize.h): the weights' rounding alone, activations as they are
  bool fp8_weights = false;
  // "fp8": FP8 weights and FP8 products (Model::use_fp8_weights, what `--weights fp8` serves):
  // the weights' and the activations' rounding together; "fp8-fast": the same with the products
  // accumulated fast (`--weights fp8-fast`, Model::set_fp8_fast_forward); "fp8-head" and
  // "fp8-fast-head": each of those with the LM head in FP8 too (`--fp8-head`, Model::set_fp8_head)
  bool fp8_compute = false;
  bool fp8_fast = false;
  bool fp8_head = false;
  DType states = DType::kF32;
  int64_t defer = 0;          // deferred write-back R (0: every step)
};

// "defer4,defer8,bf16-weights,bf16-states,fp8-weights,fp8,fp8-head" → options; bf16-states implies bf16
// weights (bf16 state pools belong to bf16 models). Unknown names and R outside {4, 8, 16} are
// errors.
Status parse_serving_options(const std::string& list, std::vector<ServingOption>* out);

struct ServingOptionsRun {
  int64_t prompts = 64, prompt_len = 128, steps = 256;
  uint64_t seed = 1;
};

struct ServingAccuracy {
  std::string option;
  int64_t positions = 0;                 // prompts × steps
  double ref_loss = 0, option_loss = 0;  // mean nats per position
  double agreement = 0;                  // fraction of positions whose greedy tokens agree
  double logit_relrms_mean = 0, logit_relrms_max = 0;
  int64_t first_disagreement = -1;       // step of the first disagreeing position (-1: none)
  double delta_loss() const { return option_loss - ref_loss; }
};

// `ref`: the reference model; `low`: the same checkpoint in bf16 (needed by the bf16 options,
// else may be null); `fp8`: the same checkpoint in ref's dtype after fp8_round_body_matrices
// (needed by fp8-weights, else may be null); `fp8c`: the same checkpoint computing with FP8 weights
// (Model::use_fp8_weights; needed by fp8, else may be null). The caller need not plan them: this
// function does.
Status eval_serving_options(Model& ref, Model* low, Model* fp8, Model* fp8c, const std::vector<int32_t>& heldout,
                            const std::vector<ServingOption>& options, const ServingOptionsRun& run,
                            const std::function<void(const ServingAccuracy&)>& each);

}  // namespace laplace
