#include "eval/context.h"

#include <algorithm>

#include "core/rng.h"
#include "eval/stream.h"
#include "serve/metrics.h"

namespace laplace {

namespace {

bool power_of_two(int64_t x) { return x > 0 && (x & (x - 1)) == 0; }

int64_t memory_in_use(Backend& be, bool cuda) {
  if (!cuda) return process_resident_bytes();
  size_t free_b = 0, total_b = 0;
  return be.memory_info(&free_b, &total_b) ? static_cast<int64_t>(total_b - free_b) : 0;
}

}  // namespace

Status eval_position_loss(Model& m, const std::vector<int32_t>& heldout, const PositionLossOptions& o,
                          const std::function<void(const PositionBucket&)>& each) {
  if (o.context < 2) return Status::invalid_argument("position loss: --context must be at least 2");
  if (o.streams < 1) return Status::invalid_argument("position loss: --streams must be at least 1");
  if (!power_of_two(o.first_bucket) || !power_of_two(o.piece) || o.piece < o.first_bucket)
    return Status::invalid_argument("position loss: --piece and --first-bucket must be powers of two, piece >= "
                                    "first bucket");
  const int64_t n = static_cast<int64_t>(heldout.size());
  if (n < o.context + 1)
    return Status::invalid_argument("position loss: context " + std::to_string(o.context) + " needs " +
                                    std::to_string(o.context + 1) + " held-out tokens; the data holds " +
                                    std::to_string(n));
  const int64_t S = o.streams, T = o.context;
  // Stream s: T + 1 consecutive held-out tokens from a seeded offset (inputs and their targets).
  std::vector<int32_t> x(static_cast<size_t>(S * T)), y(static_cast<size_t>(S * T));
  SplitMix64 rng{splitmix64_hash(o.seed)};
  for (int64_t s = 0; s < S; ++s) {
    const int64_t off = static_cast<int64_t>(rng.below(static_cast<uint64_t>(n - T)));
    std::copy_n(heldout.data() + off, T, x.data() + s * T);
    std::copy_n(heldout.data() + off + 1, T, y.data() + s * T);
  }
  SequenceStream st;
  LAPLACE_RETURN_IF_ERROR(st.init(&m, S, o.piece, o.piece));
  st.reset();
  const bool cuda = m.backend().name() == std::string("cuda");
  std::vector<int32_t> bx, by;
  for (int64_t b0 = 0; b0 < T;) {
    const int64_t b1 = std::min(T, b0 == 0 ? o.first_bucket : 2 * b0);
    const int64_t w = b1 - b0;
    bx.resize(static_cast<size_t>(S * w));
    by.resize(static_cast<size_t>(S * w));
    for (int64_t s = 0; s < S; ++s) {
      std::copy_n(x.data() + s * T + b0, w, bx.data() + s * w);
      std::copy_n(y.data() + s * T + b0, w, by.data() + s * w);
    }
    PositionBucket r;
    r.begin = b0;
    r.end = b1;
    r.loss_sum = st.feed_loss(bx.data(), by.data(), w, &r.count);
    r.memory_bytes = memory_in_use(m.backend(), cuda);
    if (each) each(r);
    b0 = b1;
  }
  return Status::ok();
}

}  // namespace laplace
