// Training checkpoints: one safetensors file holding the weights ("model.*",
// "lm_head.*" — the canonical names), the optimizer state ("optim.*") and, in the
// metadata, everything else a bitwise-exact resume needs: the step, the optimizer's
// step counter, the data loader's position and the config. Written atomically
// (temp file + rename), so a run killed mid-write leaves the previous one intact.
#pragma once

#include <string>

#include "core/arena.h"
#include "model/config.h"
#include "ops/backend.h"
#include "train/optimizer.h"

namespace laplace {

struct TrainProgress {
  int64_t step = 0;               // optimizer steps taken (the next step's index)
  int64_t optimizer_steps = 0;    // AdamW's bias-correction counter (skipped steps excluded)
  std::string loader_position;    // DataLoader position as JSON
  uint64_t seed = 0;              // init seed of the run
  double tokens_seen = 0;
};

Status checkpoint_save(const std::string& path, const Config& c, Backend& be, const Arena& weights,
                       const Optimizer& opt, const TrainProgress& p);

// Loads into existing weights and an initialised optimizer of the same config.
// The config stored in the file must equal `c` (shapes are checked tensor by tensor).
Status checkpoint_load(const std::string& path, const Config& c, Backend& be, const Arena& weights,
                       Optimizer* opt, TrainProgress* p);

}  // namespace laplace
