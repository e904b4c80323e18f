// Single-sequence generation: chunked prefill of the prompt into a state slot, then
// one recurrent decode step per token. The engine (serve/engine.h) batches this over
// many sequences; this path is the simple reference the CLI and tests use.
#pragma once

#include <functional>
#include <vector>

#include "model/model.h"
#include "serve/sampler.h"

namespace laplace {

struct GenerateOptions {
  int64_t max_tokens = 64;
  SamplingOptions sampling;
  std::vector<int32_t> stop_ids;  // generation ends after emitting one of these
};

// Rows [first, first + rows) of the model's last logits, as host F32 [rows × V]; the one
// place that converts the model's logits dtype for the host.
void logits_rows_to_host(const Model& m, int64_t first, int64_t rows, std::vector<float>* out);
// Row `row` alone, as host F32 [V].
void logits_row_to_host(const Model& m, int64_t row, std::vector<float>* out);

// Feeds `tokens` into slot `slot` of `pool` (chunked form, in pieces of at most the
// plan's max_seq) and leaves the host logits of the last token in *last_logits.
void prefill(Model& m, StatePool& pool, int32_t slot, const std::vector<int32_t>& tokens,
             std::vector<float>* last_logits);

// Generates up to max_tokens tokens after `prompt` (which must be non-empty), calling
// on_token for each as it is produced. The slot's state is left after the last token
// fed to the model (the final sampled token is not fed).
std::vector<int32_t> generate(Model& m, StatePool& pool, int32_t slot, const std::vector<int32_t>& prompt,
                              const GenerateOptions& opt,
                              const std::function<void(int32_t)>& on_token = nullptr);

}  // namespace laplace
