#include "serve/drafter.h"

#include <algorithm>

namespace laplace {

void NgramDrafter::propose(RequestId, std::span<const int32_t> ctx, int64_t k, std::vector<int32_t>* out) {
  out->clear();
  const int64_t L = static_cast<int64_t>(ctx.size());
  if (k <= 0 || L < 2) return;
  for (int64_t n = std::min(max_n_, L - 1); n >= std::max<int64_t>(min_n_, 1); --n) {
    const int32_t* suffix = ctx.data() + L - n;
    // The most recent earlier occurrence: start i < L − n, so that a token follows it.
    for (int64_t i = L - n - 1; i >= 0; --i) {
      if (!std::equal(suffix, suffix + n, ctx.data() + i)) continue;
      // Token j of the continuation: the context's, then (past its end) the proposal's own.
      for (int64_t j = i + n; static_cast<int64_t>(out->size()) < k; ++j)
        out->push_back(j < L ? ctx[static_cast<size_t>(j)] : (*out)[static_cast<size_t>(j - L)]);
      return;
    }
  }
}

}  // namespace laplace
