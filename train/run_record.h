// What a training run writes down, the same on one device and over ranks:
// a metrics.jsonl line per step and per validation (in the output directory), the progress
// line every log_every steps, and TensorBoard scalars (--tensorboard). Over several ranks
// only rank 0 records; the others open nothing and write nothing.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/status.h"
#include "train/tensorboard.h"
#include "train/train_loop.h"

namespace laplace {

struct TrainOptions;

class RunRecord {
 public:
  // writer: this process records (rank 0). first_step: the step the run starts (or resumes) at,
  // for the progress line's time estimate and TensorBoard's session start.
  Status open(const TrainOptions& o, int64_t first_step, bool writer);
  // A step: metrics.jsonl gets the common fields, then those of `extra` (a JSON object's text,
  // "" for none: the sharded store's traffic); TensorBoard gets loss, lr, grad_norm,
  // tokens_per_s and mfu; the progress line shows `detail` after the throughput.
  void step(const StepLog& s, const std::string& extra = "", const std::string& detail = "");
  void validation(int64_t step, double loss);

 private:
  void append(const std::string& line);
  // A failed TensorBoard write warns once and stops the TensorBoard output (training goes on).
  void scalars(int64_t step, const std::vector<ScalarValue>& values);

  bool writer_ = false, quiet_ = true;
  std::string metrics_path_;  // "" = none
  int64_t first_step_ = 0, steps_ = 0, log_every_ = 1;
  double peak_flops_ = 0;
  EventWriter tensorboard_;
};

}  // namespace laplace
