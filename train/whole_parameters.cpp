#include "train/whole_parameters.h"

#include "train/trainer.h"

namespace laplace {

Status WholeParameters::check_options(const TrainOptions& o) {
  if (o.dtype != DType::kF32 && o.dtype != DType::kF64 && o.dtype != DType::kBF16)
    return Status::unsupported(std::string("cannot train in ") + dtype_name(o.dtype) + ": use f32, f64 or bf16");
  if (o.dtype == DType::kBF16 && o.device == "cpu")
    return Status::unsupported("bf16 training needs --device cuda (the CPU backend computes in f32 or f64)");
  return Status::ok();
}

Status WholeParameters::attach(const TrainerParts& parts) {
  t_ = parts;
  return Status::ok();
}

const Arena* WholeParameters::param_arena() const { return mixed_ ? &masters_ : &t_.model->weight_arena(); }

Status WholeParameters::create() {
  const TrainOptions& o = *t_.opt;
  const Config& c = *t_.cfg;
  Backend& be = *t_.be;
  Model& model = *t_.model;
  LAPLACE_RETURN_IF_ERROR(model.create(c, be, o.dtype));
  mixed_ = needs_master_weights(o.dtype);
  const DType param_dtype = mixed_ ? DType::kF32 : o.dtype;
  if (mixed_) {
    // Initialised (or loaded) in F32 exactly as an F32 model would be, then rounded once
    // into the BF16 weights by refresh_weights().
    LAPLACE_RETURN_IF_ERROR(masters_.create(weight_specs(c, DType::kF32), be.allocator(), "master weights"));
    if (!o.init_ckpt.empty()) LAPLACE_RETURN_IF_ERROR(weights_load(o.init_ckpt, be, masters_));
    else weights_init(c, be, masters_, o.seed);
  } else {
    if (!o.init_ckpt.empty()) LAPLACE_RETURN_IF_ERROR(model.load(o.init_ckpt));
    else model.init_weights(o.seed);
  }
  if (o.fp8) {
    LAPLACE_RETURN_IF_ERROR(model.use_fp8_training());
    model.set_fp8_fast_forward(o.fp8_fast_forward);
  }
  LAPLACE_RETURN_IF_ERROR(model.plan(training_plan_options(o)));
  LAPLACE_RETURN_IF_ERROR(grads_.create(weight_specs(c, param_dtype), be.allocator(), "gradients"));
  // On the GPU, Newton–Schulz runs in bf16 as SPEC §2 has it; the CPU keeps the master
  // dtype so the F32 reference can check it.
  t_.opt->optim.ns_bf16 = be.device() == Device::kCUDA;
  return t_.optimizer->init(be, make_optimizer_params(c, *param_arena(), grads_, o.muon_fused), o.optim);
}

std::vector<TensorSpec> WholeParameters::loss_specs() const { return {{"loss_sum", DType::kF64, {1}}}; }

void WholeParameters::bind_loss(const Arena& a, size_t first) { loss_sum_ = a.tensor(first); }

Status WholeParameters::load_checkpoint(const std::string& path, TrainProgress* progress) {
  return checkpoint_load(path, *t_.cfg, *t_.be, *param_arena(), t_.optimizer, progress);
}

void WholeParameters::refresh_weights() {
  if (mixed_) copy_masters_to_weights(*t_.be, masters_, t_.model->weight_arena());
  // The FP8 codes follow every change of the weights (in place for F32/F64 models).
  if (t_.model->fp8_training()) t_.model->quantize_training_weights();
}

size_t WholeParameters::allocated_bytes() const { return masters_.bytes() + grads_.bytes(); }

void WholeParameters::begin_step() { grads_.zero(); }

void WholeParameters::micro_loss(const Tensor& losses, double count, int64_t a) {
  t_.be->loss_sum_into(losses, count, loss_sum_, a > 0);
}

double WholeParameters::loss_scale() const { return 1.0 / static_cast<double>(t_.opt->grad_accum); }

// Unconditional: a skipped step leaves the masters as they were, so this rewrites the
// weights with the values they already hold (gating it would need the flag on the host).
void WholeParameters::after_optimizer() { refresh_weights(); }

double WholeParameters::step_loss() {
  double sum = 0;
  t_.be->copy(Tensor(&sum, DType::kF64, {1}), loss_sum_);
  return sum / static_cast<double>(t_.opt->grad_accum);
}

Status WholeParameters::save_checkpoint(const std::string& out_dir, const TrainProgress& progress) {
  LAPLACE_RETURN_IF_ERROR(checkpoint_save(out_dir + "/checkpoint.safetensors", *t_.cfg, *t_.be, *param_arena(),
                                          *t_.optimizer, progress));
  // A complete model directory for generate/eval/serve beside it.
  if (mixed_) return weights_save(out_dir + "/model.safetensors", *t_.cfg, *t_.be, masters_);
  return t_.model->save(out_dir + "/model.safetensors");
}

}  // namespace laplace
