// Draft sources for speculative decoding (docs/serving.md §11): a guess of what a sequence
// says next, made cheaply on the host and checked by the model in one verification forward
// (Model::verify). A wrong guess costs compute, never a wrong token: the engine keeps only
// what the model itself would have produced.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "serve/request.h"

namespace laplace {

class Drafter {
 public:
  virtual ~Drafter() = default;
  // Up to k tokens that may follow `context` (request `id`'s whole context: its prompt and every
  // token emitted so far), into *out (cleared first); fewer or none when there is no guess. A
  // request's context only grows from one call to the next; a drafter that keeps state per
  // request (DraftModelDrafter) keys it by id. Called on the engine thread only.
  virtual void propose(RequestId id, std::span<const int32_t> context, int64_t k, std::vector<int32_t>* out) = 0;
};

// Prompt lookup (n-gram) drafts, with no second model: the context's last n tokens are looked
// up earlier in the context, n from max_n down to min_n, and the tokens that followed the most
// recent earlier occurrence are proposed. Where that continuation runs into the context's end,
// it goes on with the proposal itself (a repeating pattern continues as a repetition), so a
// match near the end still yields k tokens. Text that quotes or repeats its context — code
// edits, summaries, extraction, loops of a small model — is where it pays.
class NgramDrafter : public Drafter {
 public:
  explicit NgramDrafter(int64_t max_n = 3, int64_t min_n = 1) : max_n_(max_n), min_n_(min_n) {}
  void propose(RequestId id, std::span<const int32_t> context, int64_t k, std::vector<int32_t>* out) override;

 private:
  int64_t max_n_, min_n_;
};

}  // namespace laplace
