// The Trainer's loop (train/trainer.h), on one device and over P ranks alike: for each step
// from the progress's, run the step, fill its StepLog (learning rate, throughput, MFU),
// report it, validate every eval_every steps, checkpoint every ckpt_every steps and at the
// end, and stop early after stop_after. What a step is, and how a step or a validation is
// written down, belong to the Trainer: it passes them in as functions, so the cadence, the
// counters and the messages stay apart from the step's arithmetic.
#pragma once

#include <cstdint>
#include <functional>

#include "core/status.h"
#include "train/checkpoint.h"
#include "train/optimizer.h"
#include "train/schedule.h"

namespace laplace {

struct StepLog {
  int64_t step = 0;
  double loss = 0, lr = 0, grad_norm = 0, tokens_per_s = 0, flops_per_s = 0, mfu = 0, elapsed_s = 0;
  bool skipped = false;
};

struct TrainLoop {
  int64_t steps = 0, stop_after = 0, eval_every = 0, ckpt_every = 0;
  ScheduleConfig schedule;
  int64_t tokens_per_step = 0;   // over all ranks
  double flops_per_token = 0;
  double peak_flops = 0;         // over all devices; 0: no MFU
  bool has_val = false;
  bool talk = true;              // print progress messages (not quiet, and rank 0)

  // One whole step: queue it, finish it, return the optimizer's result and the mean loss.
  std::function<StepResult(int64_t step, double* loss)> step;
  // Optimizer steps taken so far (the checkpoint's counter).
  std::function<int64_t()> optimizer_steps;
  // Writes the step down (metrics, progress line, TensorBoard, the caller's callback).
  std::function<void(const StepLog&)> record;
  // Mean validation loss (collective where the trainer's ranks are), and its record.
  std::function<Status(double* loss)> validate;
  std::function<void(int64_t step, double loss)> record_validation;
  std::function<Status()> save_checkpoint;

  // Runs from progress->step to `steps` (or stop_after), updating *progress after each step.
  Status run(TrainProgress* progress) const;
};

}  // namespace laplace
