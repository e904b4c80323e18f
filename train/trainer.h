// The training loop behind `laplace train`, on one device and over the ranks of a
// communicator alike: data → forward → backward → clip → Muon/AdamW, with a progress line
// per step, a JSONL metrics log, periodic validation, atomic checkpoints and exact resume.
//
// One Trainer class runs every case. What differs is where the parameters live between
// steps and how the gradients reach them, and that is its ParameterStore
// (train/parameter_store.h): WholeParameters (train/whole_parameters.h, the default) keeps
// whole masters and gradients on one device; ShardedParameters (distributed/sharded_parameters.h)
// keeps this rank's row shards and reaches the other ranks through a communicator. The
// Trainer owns the rest (backend, model, optimizer, data, device loss buffers, progress,
// record) and does setup, the step, validation and checkpointing once, calling the store's
// hooks; the collectives it needs (agreeing on a status, comparing values across ranks,
// the validation loss of every rank) go through the store too, so train/ does not depend
// on distributed/.
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
#include "train/memory_plan.h"
#include "train/optimizer.h"
#include "train/parameter_store.h"
#include "train/run_record.h"
#include "train/schedule.h"
#include "train/train_loop.h"

namespace laplace {

struct TrainOptions {
  std::string config_path;            // config.json
  std::string init_ckpt;              // optional: start from these weights (else seeded init)
  std::vector<std::string> train_data;  // shard paths or glob patterns
  std::vector<std::string> val_data;
  std::string out_dir;                // checkpoint.safetensors, model.safetensors, config.json, metrics.jsonl
  std::string resume;                 // checkpoint to resume from ("auto": out_dir's, if any)
  std::string tokenizer;              // copied into out_dir so it is a complete model directory
  std::string tensorboard_dir;        // optional: TensorBoard event files (train/tensorboard.h)
  // Called on out_dir each time the model directory there has been written (the CLI adds the
  // Hugging Face files, so every saved model loads in transformers too). Optional.
  std::function<Status(const std::string& dir)> after_model_saved;

  int64_t batch = 8, seq = 256, grad_accum = 1, steps = 100;
  // Memory plan (train/memory_plan.h). batch_auto: choose the micro-batch (and, unless
  // recompute_mixer or recompute_layers is set, the recompute) that fits the device.
  // tokens_per_step > 0: grad_accum = tokens_per_step / (batch·seq) (with batch_auto, B must
  // divide it).
  bool batch_auto = false;
  int64_t tokens_per_step = 0;
  double reserve_gib = -1;            // left free by the plan; < 0: 3 GiB on CUDA, 0.25 GiB on the CPU
  int64_t stop_after = 0;             // stop (with a checkpoint) after this step; the schedule still spans `steps`
  ScheduleConfig schedule;            // lr, warmup, kind, min_lr_frac, decay_frac (total_steps = steps)
  OptimizerConfig optim;              // weight decay, betas, momentum, clipping, Muon scale
  bool muon_fused = false;            // orthogonalise W_qkvg and W_12 whole
  bool shuffle = true;
  // Documents kept apart (`--documents separate`, docs/training.md): ≥ 0 is the token that starts
  // a document (the shards' separator), at which the mixer and the conv restart from zero, in
  // training and validation alike; −1 runs each window as one stream ("packed").
  int32_t document_separator = -1;
  uint64_t seed = 1234;               // init seed
  uint64_t data_seed = 1;             // shuffle seed
  // What the backward recomputes instead of keeping it (Model's PlanOptions): the GLA output
  // (--recompute-mixer) or every layer's activations from the layer's input (--recompute-layers,
  // the single-device trainer only); at most one. As given, or as the memory plan chose.
  bool recompute_mixer = false;
  bool recompute_layers = false;
  // --precision fp8: the body projections compute their forward and gradient products in FP8
  // (Model::use_fp8_training); one device only. fp8-fast: the forward's accumulated fast
  // (Model::set_fp8_fast_forward).
  bool fp8 = false;
  bool fp8_fast_forward = false;

  int64_t eval_every = 0, eval_batches = 8;  // 0 = no validation
  int64_t ckpt_every = 0;                    // 0 = only at the end
  int64_t log_every = 1;
  double peak_flops = 0;                     // for MFU; 0 = report FLOP/s only
  std::string device = "cpu";
  DType dtype = DType::kF32;
  bool quiet = false;
  // Optional: sees each batch's inputs and targets ([batch, seq], row-major) before the
  // loss, training and validation alike, and may set targets to −1, which the loss and its
  // mean ignore (`laplace eval mqar` keeps its answer positions only).
  std::function<void(const int32_t* x, int32_t* y, int64_t batch, int64_t seq)> target_mask;
};

// True for model dtypes that train F32 master copies of their weights (BF16).
bool needs_master_weights(DType model_dtype);
// The optimizer's parameter list over `params` (the model's weights, or its F32 masters)
// and `grads`, both created from weight_specs(c, ·): Muon for the body matrices (split
// per block unless muon_fused), AdamW for the rest; decay for Muon, embedding and head.
std::vector<Param> make_optimizer_params(const Config& c, const Arena& params, const Arena& grads,
                                         bool muon_fused);
// The loop's settings from the options (train/train_loop.h), for `ranks` ranks each running
// batch × seq × grad_accum tokens a step; MFU is per device. The Trainer adds its functions.
TrainLoop train_loop_for(const TrainOptions& o, const Config& c, int ranks);
// The metrics.jsonl line of a validation: {"step": S, "val_loss": L}.
std::string val_loss_record(int64_t step, double loss);
// The memory plan's request for these options on `be`: its free memory (the host's on the
// CPU) and the reserve (--reserve-gib; 3 GiB on CUDA, 0.25 GiB on the CPU by default).
MemoryPlanRequest memory_request_for(const TrainOptions& o, Backend& be);
// With --batch auto or a tokens-per-step target, chooses the plan (choose_memory_plan); else
// computes it for the given micro-batch. Either way writes its batch, grad_accum,
// recompute_mixer and recompute_layers into *o.
Status apply_memory_plan(const Config& c, const MemoryPlanRequest& r, TrainOptions* o, MemoryPlan* plan);
// Model::plan's training plan for these options (batch, seq and the recompute), once applied.
PlanOptions training_plan_options(const TrainOptions& o);
// The Trainer's setup and saving helpers:
// the training loader (rank `rank` of `world` reads its part of every step's windows) and,
// with --val-data, the validation loader (*has_val); the output directory, created; the
// checkpoint to resume from ("auto": the output directory's, if there is one; "" for none);
// and, beside the weights a trainer saves, the rest of a model directory: config.json, the
// tokenizer and what after_model_saved adds.
Status open_train_data(const TrainOptions& o, const Config& c, int rank, int world, DataLoader* train,
                       DataLoader* val, bool* has_val);
Status create_out_dir(const TrainOptions& o);
std::string resume_path(const TrainOptions& o);
Status write_model_dir_files(const TrainOptions& o, const Config& c);
// weights ← masters (same table), converting to the weights' dtype with the backend's
// copy. Queued on the device; no synchronisation.
void copy_masters_to_weights(Backend& be, const Arena& masters, const Arena& weights);

class Trainer {
 public:
  // store: where the parameters live; null: WholeParameters (one device).
  explicit Trainer(TrainOptions o, std::unique_ptr<ParameterStore> store = nullptr);
  // Hands the store back its parts (a sharded store detaches from the backend's stream).
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  // Builds backend, model, parameters, optimizer, data; resumes when asked. Collective over
  // the store's ranks: a failure on one rank fails all.
  Status setup();
  // Runs until opt.steps; `on_step` sees every step (tests record losses).
  Status run(const std::function<void(const StepLog&)>& on_step = nullptr);
  // Mean loss over `batches` validation batches of every rank, from the start of the val data.
  Status validate(int64_t batches, double* loss);
  Status save_checkpoint();

  const Model& model() const { return model_; }
  // The arena of whole parameters the optimizer updates (the F32 masters of a BF16 model,
  // else the weights); only a store that holds whole parameters has one.
  const Arena& param_arena() const;
  const TrainProgress& progress() const { return progress_; }
  // The memory plan (train/memory_plan.h; a sharded store's counts this rank's shards), and
  // the bytes of what setup allocated for its classes, without the setup-only initial table.
  const MemoryPlan& memory_plan() const { return plan_; }
  size_t allocated_bytes() const;
  Backend& backend() const { return *be_; }

  // One training step in two halves (run() calls them). enqueue_step queues all of step
  // `step`'s work: the micro-batches (forward, loss into a device scalar, backward, and
  // whatever the store moves between ranks), the optimizer step and the weights' refresh;
  // on CUDA nothing in it waits for the device. finish_step is the step boundary: it reads
  // the loss and the optimizer's result back (one sync) and returns them.
  void enqueue_step(int64_t step);
  StepResult finish_step(double* loss);

 private:
  // setup's collective phases: options, backend and the store's attachment; the memory
  // plan; the parameters, data and buffers; then what every rank must agree on.
  Status setup_backend();
  // Whether the store plans the model with recompute_layers (the single-device store does).
  bool store_plans_layer_recompute() const;
  // Chooses (or, with an explicit batch, just computes) the memory plan before anything
  // is allocated, and applies it to opt_ (batch, grad_accum, recompute_mixer, recompute_layers).
  Status plan_memory();
  Status setup_local();
  Status check_ranks_agree();
  Status load_checkpoint(const std::string& path);
  void print_setup() const;

  TrainOptions opt_;
  Config cfg_;
  std::unique_ptr<Backend> be_;
  Model model_;
  Optimizer optimizer_;
  std::unique_ptr<ParameterStore> store_;  // after what it borrows, so it goes first
  DataLoader train_loader_;
  DataLoader val_loader_;
  bool has_val_ = false;
  TrainProgress progress_;
  std::vector<int32_t> x_, y_;
  MemoryPlan plan_;
  Arena loss_bufs_;  // targets [B·T] I32, per-token losses [B·T], then the store's (loss_specs)
  Tensor targets_dev_, losses_dev_;
  RunRecord record_;  // metrics.jsonl, progress lines, TensorBoard: rank 0's
};

}  // namespace laplace
