#include "train/schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace laplace {

Status ScheduleConfig::validate() const {
  auto bad = [](const std::string& m) { return Status::invalid_argument("lr schedule: " + m); };
  if (!(lr >= 0) || !std::isfinite(lr)) return bad("lr must be a finite value >= 0");
  if (warmup_steps < 0) return bad("warmup_steps must be >= 0");
  if (total_steps < 1) return bad("total_steps must be >= 1");
  if (!(min_lr_frac >= 0 && min_lr_frac <= 1)) return bad("min_lr_frac must be in [0, 1]");
  if (!(decay_frac >= 0 && decay_frac <= 1)) return bad("decay_frac must be in [0, 1]");
  return Status::ok();
}

Status schedule_kind_from_name(const std::string& name, ScheduleKind* out) {
  if (name == "constant") *out = ScheduleKind::kConstant;
  else if (name == "cosine") *out = ScheduleKind::kCosine;
  else if (name == "wsd") *out = ScheduleKind::kWsd;
  else return Status::invalid_argument("unknown lr schedule '" + name + "' (expected constant, cosine or wsd)");
  return Status::ok();
}

const char* schedule_kind_name(ScheduleKind kind) {
  switch (kind) {
    case ScheduleKind::kConstant: return "constant";
    case ScheduleKind::kCosine: return "cosine";
    case ScheduleKind::kWsd: return "wsd";
  }
  return "?";
}

double lr_at(const ScheduleConfig& c, int64_t s) {
  if (s < 0) s = 0;
  if (s < c.warmup_steps) return c.lr * static_cast<double>(s + 1) / static_cast<double>(c.warmup_steps);
  const double min_lr = c.min_lr();
  switch (c.kind) {
    case ScheduleKind::kConstant:
      return c.lr;
    case ScheduleKind::kCosine: {
      const int64_t den = c.total_steps - 1 - c.warmup_steps;
      double p = den > 0 ? static_cast<double>(s - c.warmup_steps) / static_cast<double>(den) : 1.0;
      p = std::clamp(p, 0.0, 1.0);
      return min_lr + (c.lr - min_lr) * 0.5 * (1.0 + std::cos(std::numbers::pi * p));
    }
    case ScheduleKind::kWsd: {
      const int64_t d = static_cast<int64_t>(c.decay_frac * static_cast<double>(c.total_steps));
      const int64_t start = c.total_steps - d;
      if (d <= 0 || s < start) return c.lr;
      const double p = std::min(1.0, static_cast<double>(s - start + 1) / static_cast<double>(d));
      return c.lr + (min_lr - c.lr) * p;
    }
  }
  return c.lr;
}

}  // namespace laplace
