// Long context at constant memory (docs/quality.md): the loss of held-out text by position,
// up to contexts far past the training length. A model that uses its context keeps lowering
// the loss as positions grow; one whose state saturates flattens. The memory the run holds is
// measured per bucket: it is the plan of one piece plus the fixed state, the same at 1k
// tokens and at 128k.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "core/status.h"
#include "model/model.h"

namespace laplace {

struct PositionLossOptions {
  int64_t context = 131072;  // positions scored per stream
  int64_t streams = 1;       // held-out streams run side by side (random offsets)
  int64_t piece = 2048;      // tokens per forward (a power of two ≥ first_bucket)
  int64_t first_bucket = 64; // buckets [0, f), [f, 2f), [2f, 4f), …
  uint64_t seed = 1;
};

struct PositionBucket {
  int64_t begin = 0, end = 0;  // positions [begin, end)
  double loss_sum = 0;         // nats, over every stream
  int64_t count = 0;
  int64_t memory_bytes = 0;    // device memory in use (CUDA) or the process's resident bytes (CPU) after it
  double mean_loss() const { return count ? loss_sum / static_cast<double>(count) : 0; }
};

Status eval_position_loss(Model& m, const std::vector<int32_t>& heldout, const PositionLossOptions& o,
                          const std::function<void(const PositionBucket&)>& each);

// Whole documents (`laplace eval position --documents`): the held-out tokens are documents, each
// preceded by the separator (id 2, docs/data.md §3); tokens before the first separator (a document
// begun in an earlier shard) are not one. A document of n tokens after its separator is scored
// from a zero state, as a fresh sequence [sep, t1, …, t(n−1)] predicting t1 … tn: position p
// predicts t(p+1), up to min(n, context) positions. The buckets are those of eval_position_loss,
// to the longest scored document's end; a shorter document contributes the positions it has.
// Documents run `streams` side by side (in order of length, a finished row padded and not
// counted) and piece by piece, their states carried: the memory held is one piece plus the fixed
// state, whatever the documents' lengths. The buckets are reported (through `each`) once every
// document is scored; a bucket's memory is the most seen after it.
struct DocumentLossOptions {
  int64_t context = 131072;   // positions scored per document at most
  int64_t min_tokens = 1;     // only documents of at least this many tokens (after the separator)
  int64_t streams = 1;        // documents run side by side
  int64_t piece = 2048;       // tokens per forward (a power of two ≥ first_bucket)
  int64_t first_bucket = 64;  // buckets [0, f), [f, 2f), [2f, 4f), …
  int32_t separator = 2;      // the token that precedes every document
};

struct DocumentSpan {
  int64_t begin = 0;   // index of the document's separator
  int64_t tokens = 0;  // tokens after it, up to the next separator or the end
};

struct DocumentLossSummary {
  int64_t documents = 0;       // documents in the data
  int64_t scored = 0;          // documents of at least min_tokens: the ones scored
  int64_t longest = 0;         // the longest document's tokens
  int64_t scored_tokens = 0;   // positions scored over every document
};

// The documents of `tokens`, in order; empty documents (a separator right after another) are kept
// with tokens = 0.
std::vector<DocumentSpan> split_documents(const std::vector<int32_t>& tokens, int32_t separator);

Status eval_document_position_loss(Model& m, const std::vector<int32_t>& tokens, const DocumentLossOptions& o,
                                   const std::function<void(const PositionBucket&)>& each,
                                   DocumentLossSummary* summary = nullptr);

}  // namespace laplace
