// The training loop behind `laplace train`: data → forward → backward → clip →
// Muon/AdamW, with a progress line per step, a JSONL metrics log, periodic
// validation, atomic checkpoints and exact resume.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/status.h"
#include "model/model.h"
#include "text/data_loader.h"
#include "train/checkpoint.h"
#include "train/optimizer.h"
#include "train/schedule.h"

namespace laplace {

struct TrainOptions {
  std::string config_path;            // config.json
  std::string init_ckpt;              // optional: start from these weights (else seeded init)
  std::vector<std::string> train_data;  // shard paths or glob patterns
  std::vector<std::string> val_data;
  std::string out_dir;                // checkpoint.safetensors, model.safetensors, config.json, metrics.jsonl
  std::string resume;                 // checkpoint to resume from ("auto": out_dir's, if any)
  std::string tokenizer;              // copied into out_dir so it is a complete model directory

  int64_t batch = 8, seq = 256, grad_accum = 1, steps = 100;
  int64_t stop_after = 0;             // stop (with a checkpoint) after this step; the schedule still spans `steps`
  ScheduleConfig schedule;            // lr, warmup, kind, min_lr_frac, decay_frac (total_steps = steps)
  OptimizerConfig optim;              // weight decay, betas, momentum, clipping, Muon scale
  bool muon_fused = false;            // orthogonalise W_qkvg and W_12 whole
  bool shuffle = true;
  uint64_t seed = 1234;               // init seed
  uint64_t data_seed = 1;             // shuffle seed
  bool recompute_mixer = false;

  int64_t eval_every = 0, eval_batches = 8;  // 0 = no validation
  int64_t ckpt_every = 0;                    // 0 = only at the end
  int64_t log_every = 1;
  double peak_flops = 0;                     // for MFU; 0 = report FLOP/s only
  std::string device = "cpu";
  DType dtype = DType::kF32;
  bool quiet = false;
};

struct StepLog {
  int64_t step = 0;
  double loss = 0, lr = 0, grad_norm = 0, tokens_per_s = 0, flops_per_s = 0, mfu = 0, elapsed_s = 0;
  bool skipped = false;
};

class Trainer {
 public:
  explicit Trainer(TrainOptions o) : opt_(std::move(o)) {}
  // Builds backend, model, optimizer, data; resumes when asked.
  Status setup();
  // Runs until opt.steps; `on_step` sees every step (tests record losses).
  Status run(const std::function<void(const StepLog&)>& on_step = nullptr);
  // Mean loss over `batches` validation batches, from the start of the val data.
  Status validate(int64_t batches, double* loss);
  Status save_checkpoint();

  const Model& model() const { return model_; }
  const TrainProgress& progress() const { return progress_; }

 private:
  std::vector<Param> make_params();
  void log_line(const StepLog& s);
  void append_metrics(const std::string& json_line);

  TrainOptions opt_;
  Config cfg_;
  std::unique_ptr<Backend> be_;
  Model model_;
  Arena grads_;
  Optimizer optimizer_;
  DataLoader train_loader_;
  DataLoader val_loader_;
  bool has_val_ = false;
  TrainProgress progress_;
  int64_t first_step_ = 0;
  std::vector<int32_t> x_, y_;
};

}  // namespace laplace
