// The single-device ParameterStore (train/parameter_store.h): every parameter whole on one
// device, its gradient accumulated in place over the micro-batches.
//
// Precision (SPEC §2): F32/F64 models train their own weights (master = compute dtype).
// BF16 models (CUDA) train F32 master weights: an F32 master arena and an F32 gradient
// arena, both from weight_specs(cfg, F32); the optimizer (and its state) works on the
// masters; after every step the masters are copied into the BF16 weights (one rounding,
// the backend's copy conversion). Initialisation, --init and checkpoints (save and resume)
// all go through the masters, so a checkpoint holds F32 weights, and model.safetensors is
// written from the masters too.
//
// A step: the gradient arena is zeroed once, every micro-batch's backward adds into it
// (loss scale 1/grad_accum), the losses add up in one device scalar, the Optimizer runs
// without a ShardExchange, and the masters are copied into the weights. Nothing here
// synchronises with the device.
#pragma once

#include "train/parameter_store.h"

namespace laplace {

class WholeParameters : public ParameterStore {
 public:
  Status check_options(const TrainOptions& o) override;
  Status attach(const TrainerParts& parts) override;
  Status create() override;
  std::vector<TensorSpec> loss_specs() const override;
  void bind_loss(const Arena& a, size_t first) override;
  Status load_checkpoint(const std::string& path, TrainProgress* progress) override;
  void refresh_weights() override;
  size_t allocated_bytes() const override;
  const Arena* param_arena() const override;

  void begin_step() override;
  void begin_micro(int64_t) override {}
  void micro_loss(const Tensor& losses, double count, int64_t a) override;
  const Arena& gradients() const override { return grads_; }
  double loss_scale() const override;
  void end_micro(int64_t) override {}
  void before_optimizer() override {}
  void after_optimizer() override;
  double step_loss() override;

  Status save_checkpoint(const std::string& out_dir, const TrainProgress& progress) override;

 private:
  TrainerParts t_;
  bool mixed_ = false;  // BF16 model trained through F32 masters
  Arena masters_;       // F32 master weights (mixed precision only)
  Arena grads_;
  Tensor loss_sum_;     // [1] F64: the step's sum of micro-batch mean losses
};

}  // namespace laplace
