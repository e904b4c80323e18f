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

}  // namespace laplace
