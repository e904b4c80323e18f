// Where the Trainer's parameters live between steps and how the gradients reach them
// (train/trainer.h): the one seam between training on one device and training over ranks.
//
// The Trainer owns what every run has (options, config, backend, model, optimizer, data,
// loss buffers, progress, record) and runs one setup, one step and one loop. The store
// owns the parameters, their gradients and the collectives, and the Trainer calls its
// hooks at fixed points of the step:
//
//   begin_step()                          once, before the first micro-batch
//   forward_options()                     the forward's options (before_group: wait for a group's weights)
//   for a in [0, grad_accum):
//     begin_micro(a)                      before the micro-batch's forward
//     forward, per-token losses on the device
//     micro_loss(losses, count, a)        the micro-batch's mean loss into the step's sum
//     Model::backward(gradients(), loss_scale(), after_group(a), overwrite_gradients())
//     end_micro(a)
//   before_optimizer(); Optimizer::enqueue_step; after_optimizer()  (weights refreshed there)
//   Optimizer::finish_step (the one synchronisation); step_loss()
//
// Two implementations: WholeParameters (train/whole_parameters.h), whole masters and
// gradients on one device, the gradient accumulated in place over the micro-batches; and
// ShardedParameters (distributed/sharded_parameters.h), row shards over the ranks of a
// communicator with per-group weight all-gathers and gradient reduce-scatters. The store
// is also the Trainer's only way to the other ranks (agree, all_gather_value, ...), so
// train/ needs no collective of its own: on one device they are the identity.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "core/arena.h"
#include "core/status.h"
#include "model/model.h"
#include "train/checkpoint.h"
#include "train/memory_plan.h"
#include "train/optimizer.h"

namespace laplace {

struct TrainOptions;

// What the Trainer lends its store: valid from attach() to the store's destruction.
struct TrainerParts {
  TrainOptions* opt = nullptr;  // the store may settle option fields before the model exists
  const Config* cfg = nullptr;
  Backend* be = nullptr;
  Model* model = nullptr;
  Optimizer* optimizer = nullptr;
};

class ParameterStore {
 public:
  virtual ~ParameterStore() = default;

  // ---- ranks: on one device a rank of one, and every collective the identity ----
  virtual int rank() const { return 0; }
  virtual int ranks() const { return 1; }
  // ok only if every rank's `local` is (collective).
  virtual Status agree(const Status& local) { return local; }
  // Every rank's value, in rank order (collective).
  virtual std::vector<int64_t> all_gather_value(int64_t v) { return {v}; }
  // all[0, ranks()) = every rank's v, in rank order (collective).
  virtual void all_gather_value(double v, double* all) { all[0] = v; }
  // Every queued collective done before the host reads or the model computes outside a step.
  virtual void quiesce() {}

  // ---- setup, in this order ----
  // The options this store can train with (dtype, device, the split over the ranks).
  virtual Status check_options(const TrainOptions& o) = 0;
  // Once the backend exists (the Trainer's parts stay where they are from now on).
  virtual Status attach(const TrainerParts& parts) = 0;
  // The store's part of the memory plan's request (shards, ranks, the rank's memory).
  virtual void plan_request(MemoryPlanRequest* r) { (void)r; }
  // Creates the model, the parameters and gradients, initialises them (seed or --init)
  // and initialises the optimizer over them; the plan (batch, grad_accum) is settled.
  virtual Status create() = 0;
  // The device loss buffers past the Trainer's targets and per-token losses, and where
  // they were allocated (their specs' order).
  virtual std::vector<TensorSpec> loss_specs() const = 0;
  virtual void bind_loss(const Arena& a, size_t first) = 0;
  // The parameters from a checkpoint (and *progress, the optimizer's step count).
  virtual Status load_checkpoint(const std::string& path, TrainProgress* progress) = 0;
  // The model's weights from the parameters (after create or a load); queued.
  virtual void refresh_weights() = 0;
  // Hash of what every rank must have derived alike (0: nothing to compare).
  virtual uint64_t plan_hash() const { return 0; }
  // Bytes of the store's arenas (its part of the memory plan, without the optimizer state).
  virtual size_t allocated_bytes() const = 0;
  // The arena of whole parameters the optimizer updates, if the store holds one.
  virtual const Arena* param_arena() const { return nullptr; }

  // ---- the step (see the top of this file) ----
  virtual void begin_step() = 0;
  virtual ForwardOptions forward_options() { return ForwardOptions{}; }
  virtual void begin_micro(int64_t a) = 0;
  virtual void micro_loss(const Tensor& losses, double count, int64_t a) = 0;
  virtual const Arena& gradients() const = 0;
  virtual double loss_scale() const = 0;
  // Whether the backward writes the products' gradients instead of adding to them
  // (Model::backward's overwrite; begin_micro has then zeroed only the rest).
  virtual bool overwrite_gradients() const { return false; }
  virtual GroupHook after_group(int64_t a) { (void)a; return nullptr; }
  virtual void end_micro(int64_t a) = 0;
  virtual void before_optimizer() = 0;
  virtual void after_optimizer() = 0;
  // The step's mean loss, read back after the optimizer's finish_step.
  virtual double step_loss() = 0;

  // ---- saving ----
  // checkpoint.safetensors and model.safetensors in out_dir (written by rank 0; collective).
  // Returns this rank's status; the Trainer agrees on it.
  virtual Status save_checkpoint(const std::string& out_dir, const TrainProgress& progress) = 0;

  // ---- what the run prints and records ----
  virtual std::string dtype_note() const { return ""; }   // after the model's dtype
  virtual std::string setup_lines() const { return ""; }  // printed after the model line
  virtual std::string ranks_note() const { return ""; }   // before "batch" in the data line
  // The last step's extra metrics.jsonl fields (a JSON object's text, "" for none) and
  // the progress line's detail.
  virtual std::string record_fields() const { return ""; }
  virtual std::string progress_detail() const { return ""; }

  // Before the Trainer's parts go: nothing left queued that uses them.
  virtual void detach() {}
};

}  // namespace laplace
