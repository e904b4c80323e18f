// Training checkpoints: one safetensors file holding the weights ("model.*",
// "lm_head.*" — the canonical names), the optimizer state ("optim.*") and, in the
// metadata, everything else a bitwise-exact resume needs: the step, the optimizer's
// step counter, the data loader's position and the config. Written atomically
// (temp file + rename), so a run killed mid-write leaves the previous one intact.
#pragma once

#include <string>

#include <map>

#include "core/arena.h"
#include "core/safetensors.h"
#include "model/config.h"
#include "ops/backend.h"
#include "train/optimizer.h"

namespace laplace {

// The precision of a run's products, as checkpoints and --precision name it: with FP8 products
// (Model::use_fp8_training) "fp8", or "fp8-fast" with the forward products accumulated fast
// (Model::set_fp8_fast_forward); else "model" (the model dtype's).
inline const char* train_precision_name(bool fp8, bool fast_forward = false) {
  return fp8 ? (fast_forward ? "fp8-fast" : "fp8") : "model";
}

struct TrainProgress {
  int64_t step = 0;               // optimizer steps taken (the next step's index)
  int64_t optimizer_steps = 0;    // AdamW's bias-correction counter (skipped steps excluded)
  std::string loader_position;    // DataLoader position as JSON
  uint64_t seed = 0;              // init seed of the run
  double tokens_seen = 0;
  // train_precision_name of the run; it resumes only in the precision it was written in.
  std::string precision = train_precision_name(false);
};

// The metadata every training checkpoint carries (kind, version, config, counters,
// loader position); the sharded parameter store writes the same keys (distributed/sharded_parameters.h).
std::map<std::string, std::string> checkpoint_metadata(const Config& c, const TrainProgress& p);
// Checks an open checkpoint's metadata (kind, version, config equal to `c`, consistent
// counters) and reads the progress from it.
Status checkpoint_read_progress(const SafeTensorsReader& r, const Config& c, TrainProgress* p);

Status checkpoint_save(const std::string& path, const Config& c, Backend& be, const Arena& weights,
                       const Optimizer& opt, const TrainProgress& p);

// Loads into existing weights and an initialised optimizer of the same config.
// The config stored in the file must equal `c` (shapes are checked tensor by tensor).
Status checkpoint_load(const std::string& path, const Config& c, Backend& be, const Arena& weights,
                       Optimizer* opt, TrainProgress* p);

}  // namespace laplace
