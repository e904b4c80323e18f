// Learning-rate schedules (docs/training.md). Steps are 0-based; step total_steps−1 is the last.
//   warmup  : s < warmup_steps ⇒ lr·(s+1)/warmup_steps (takes precedence over the rest)
//   constant: lr
//   cosine  : min_lr + (lr − min_lr)·½(1 + cos(π·p)), p = (s − warmup)/(total − 1 − warmup)
//             clamped to [0, 1] (p = 1 when total − 1 ≤ warmup): lr right after warm-up,
//             min_lr = lr·min_lr_frac at the final step and after it
//   wsd     : warm-up, stable, decay. D = ⌊decay_frac·total_steps⌋ (integer truncation);
//             the last D steps decay linearly: s ≥ total − D ⇒
//             lr + (min_lr − lr)·min(1, (s − (total − D) + 1)/D), so the final step is
//             min_lr and the step before the decay is the last one at lr; D = 0: constant
#pragma once

#include <cstdint>
#include <string>

#include "core/status.h"

namespace laplace {

enum class ScheduleKind { kConstant, kCosine, kWsd };

struct ScheduleConfig {
  ScheduleKind kind = ScheduleKind::kCosine;
  double lr = 3e-4;          // peak learning rate
  int64_t warmup_steps = 0;
  int64_t total_steps = 1;
  double min_lr_frac = 0.1;  // min_lr = lr · min_lr_frac (cosine, wsd)
  double decay_frac = 0.2;   // wsd: fraction of total_steps spent decaying

  double min_lr() const { return lr * min_lr_frac; }
  Status validate() const;
};

// "constant", "cosine", "wsd"; invalid_argument naming the choices otherwise.
Status schedule_kind_from_name(const std::string& name, ScheduleKind* out);
const char* schedule_kind_name(ScheduleKind kind);

double lr_at(const ScheduleConfig& cfg, int64_t step);

}  // namespace laplace
