// Recall at distance on a trained model (docs/quality.md): what a fixed-size state still
// holds after a stretch of real text.
//
// Copy test: a random token string s of length m, then d tokens of held-out text, then s
// again. The model sees all of it (teacher forcing); a prediction counts when the greedy
// token at position i of the second copy equals s[i + 1], for i = 0 … m − 2 (the first token
// of the second copy cannot be known: nothing says that a copy starts). Chance is ~1/V.
//
// Passkey test: held-out text of total context L with a needle ("The pass key is 48213.
// Remember it.") at a depth p (0 = the start of the text, 1 = just before the question),
// then "What is the pass key? The pass key is" and the key: a trial succeeds when every token
// of the key is the greedy choice. Keys are 5 random digits.
//
// Rows of a batch run side by side in one SequenceStream; all trials are seeded, so a run
// is reproducible given (model, data, options).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/status.h"
#include "model/model.h"
#include "text/tokenizer.h"

namespace laplace {

struct RecallOptions {
  int64_t trials = 64;   // per grid point
  int64_t batch = 16;    // rows run together (trials is rounded up to a multiple)
  int64_t piece = 2048;  // tokens per forward while feeding long contexts
  uint64_t seed = 1;
};

struct CopyResult {
  int64_t m = 0, d = 0, trials = 0;
  int64_t predictions = 0, correct = 0;
  double accuracy() const { return predictions ? static_cast<double>(correct) / static_cast<double>(predictions) : 0; }
};

// Every (m, d) of the grid, in order; `each` sees each point as it finishes. Needs held-out
// text of at least max(d) + 1 tokens.
Status eval_copy(Model& m, const std::vector<int32_t>& heldout, const std::vector<int64_t>& ms,
                 const std::vector<int64_t>& ds, const RecallOptions& o,
                 const std::function<void(const CopyResult&)>& each);

struct PasskeyResult {
  int64_t context = 0;  // L: tokens before the key
  double depth = 0;     // 0 … 1
  int64_t trials = 0, found = 0;
  double accuracy() const { return trials ? static_cast<double>(found) / static_cast<double>(trials) : 0; }
};

Status eval_passkey(Model& m, const Tokenizer& tok, const std::vector<int32_t>& heldout,
                    const std::vector<int64_t>& contexts, const std::vector<double>& depths, const RecallOptions& o,
                    const std::function<void(const PasskeyResult&)>& each);

}  // namespace laplace
