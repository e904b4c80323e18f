// Documents kept apart in one packed row (varlen): the per-token "document start" form that
// the mixer and the conv take (ops/backend.h GlaParams::doc), made from a document separator
// token or from offsets, and checked.
//
// doc[t] is the position in its row of the first token of token t's document, or −1 when that
// document began before the row (it continues from the row's initial state). A valid row has
// doc[0] ∈ {−1, 0} and doc[t] ∈ {doc[t−1], t} for t > 0: a document starts at t exactly when
// doc[t] = t.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/status.h"

namespace laplace {

// A document starts at every token equal to `separator` (the shards' convention: one
// separator before each document, docs/data.md §3); tokens before a row's first separator
// continue the document that was running (−1). tokens and out are [B, T], row-major.
void doc_starts_from_separator(const int32_t* tokens, int64_t B, int64_t T, int32_t separator, int32_t* out);

// One row of T tokens cut at `offsets` (flash-linear-attention's cu_seqlens): offsets[0] = 0,
// strictly increasing, offsets.back() = T; document i is [offsets[i], offsets[i+1]). Errors
// (invalid_argument, naming the value): fewer than two offsets, a first offset other than 0,
// a last other than T, an offset out of order or repeated (an empty document), one past T.
Status doc_starts_from_offsets(std::span<const int64_t> offsets, int64_t T, std::vector<int32_t>* out);

// Checks the form above for B rows of T; invalid_argument naming the row, the position and
// the value otherwise.
Status validate_doc_starts(const int32_t* doc, int64_t B, int64_t T);

// Whether some token after a row's first starts a document (doc[t] = t for t > 0, or doc[0] = 0
// when the row has an initial state to ignore): when none does, the rows are one document each.
bool doc_starts_split(const int32_t* doc, int64_t B, int64_t T);

}  // namespace laplace
