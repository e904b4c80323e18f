#include "train/trainer.h"

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "core/file_util.h"

namespace laplace {

namespace fs = std::filesystem;

bool needs_master_weights(DType model_dtype) { return model_dtype == DType::kBF16; }

std::vector<Param> make_optimizer_params(const Config& c, const Arena& w, const Arena& grads, bool muon_fused) {
  LAPLACE_CHECK(w.size() == grads.size(), "make_optimizer_params: parameter and gradient tables differ");
  std::vector<Param> ps;
  for (size_t i = 0; i < w.size(); ++i) {
    Param p;
    p.name = w.spec(i).name;
    p.w = w.tensor(i);
    p.g = grads.tensor(i);
    p.muon = is_body_matrix(p.name);
    if (p.muon) p.blocks = muon_fused ? std::vector<int64_t>{p.w.shape[0]} : muon_blocks(c, p.name);
    p.decay = p.muon || is_decayed_by_adamw(p.name);
    ps.push_back(std::move(p));
  }
  return ps;
}

void copy_masters_to_weights(Backend& be, const Arena& masters, const Arena& weights) {
  LAPLACE_CHECK(masters.size() == weights.size(), "copy_masters_to_weights: tables differ");
  for (size_t i = 0; i < weights.size(); ++i) be.copy(weights.tensor(i), masters.tensor(i));
}

std::vector<Param> Trainer::make_params() {
  return make_optimizer_params(cfg_, param_arena(), grads_, opt_.muon_fused);
}

namespace {
// MemAvailable from /proc/meminfo (sysconf's free pages leave out the page cache).
bool host_available_bytes(size_t* out) {
  std::ifstream f("/proc/meminfo");
  std::string key;
  size_t kb = 0;
  std::string unit;
  while (f >> key >> kb >> unit) {
    if (key == "MemAvailable:") {
      *out = kb * 1024;
      return true;
    }
  }
  return false;
}
}  // namespace

MemoryPlanRequest memory_request_for(const TrainOptions& o, Backend& be) {
  MemoryPlanRequest r;
  r.seq = o.seq;
  r.dtype = o.dtype;
  r.batch = o.batch_auto ? 0 : o.batch;
  r.grad_accum = o.grad_accum;
  r.tokens_per_step = o.tokens_per_step;
  r.recompute = o.batch_auto && !o.recompute_mixer ? -1 : (o.recompute_mixer ? 1 : 0);
  r.muon_fused = o.muon_fused;
  const bool cuda = be.device() == Device::kCUDA;
  r.ns_bf16 = cuda;
  size_t free_b = 0, total_b = 0;
  if (be.memory_info(&free_b, &total_b)) r.device_bytes = free_b;
  if (!cuda && host_available_bytes(&free_b)) r.device_bytes = free_b;
  const double reserve_gib = o.reserve_gib >= 0 ? o.reserve_gib : (cuda ? 3.0 : 0.25);
  r.reserve_bytes = static_cast<size_t>(reserve_gib * 1073741824.0);
  return r;
}

Status apply_memory_plan(const Config& c, const MemoryPlanRequest& r, TrainOptions* o, MemoryPlan* plan) {
  if (o->batch_auto || r.tokens_per_step > 0) {
    LAPLACE_RETURN_IF_ERROR(choose_memory_plan(c, r, plan));
  } else {
    *plan = memory_plan_for(c, r, o->batch, o->recompute_mixer);  // as given; allocation decides
  }
  o->batch = plan->batch;
  o->grad_accum = plan->grad_accum;
  o->recompute_mixer = plan->recompute_mixer;
  return Status::ok();
}

Status Trainer::plan_memory() {
  LAPLACE_RETURN_IF_ERROR(apply_memory_plan(cfg_, memory_request_for(opt_, *be_), &opt_, &plan_));
  if (!opt_.quiet) {
    std::fputs(format_memory_plan(plan_, be_->device() == Device::kCUDA ? "device" : "host").c_str(), stdout);
    std::fflush(stdout);
  }
  return Status::ok();
}

Status Trainer::create_loss_buffers() {
  const int64_t N = opt_.batch * opt_.seq;
  const DType st = opt_.dtype == DType::kBF16 ? DType::kF32 : opt_.dtype;
  LAPLACE_RETURN_IF_ERROR(loss_bufs_.create(
      {{"targets", DType::kI32, {N}}, {"losses", st, {N}}, {"loss_sum", DType::kF64, {1}}}, be_->allocator(),
      "loss buffers"));
  targets_dev_ = loss_bufs_.tensor(0);
  losses_dev_ = loss_bufs_.tensor(1);
  loss_sum_ = loss_bufs_.tensor(2);
  return Status::ok();
}

Status Trainer::setup() {
  LAPLACE_RETURN_IF_ERROR(config_load(opt_.config_path, &cfg_));
  if (opt_.batch < 1 || opt_.seq < 1 || opt_.grad_accum < 1 || opt_.steps < 1)
    return Status::invalid_argument("batch, seq, grad-accum and steps must all be ≥ 1");
  if (opt_.dtype != DType::kF32 && opt_.dtype != DType::kF64 && opt_.dtype != DType::kBF16)
    return Status::unsupported(std::string("cannot train in ") + dtype_name(opt_.dtype) + ": use f32, f64 or bf16");
  if (opt_.dtype == DType::kBF16 && opt_.device == "cpu")
    return Status::unsupported("bf16 training needs --device cuda (the CPU backend computes in f32 or f64)");
  opt_.schedule.total_steps = opt_.steps;
  LAPLACE_RETURN_IF_ERROR(opt_.schedule.validate());
  LAPLACE_RETURN_IF_ERROR(opt_.optim.validate());
  if (opt_.tokens_per_step < 0) return Status::invalid_argument("tokens per step must be ≥ 0");
  LAPLACE_RETURN_IF_ERROR(make_backend(opt_.device, &be_));
  LAPLACE_RETURN_IF_ERROR(plan_memory());
  LAPLACE_RETURN_IF_ERROR(model_.create(cfg_, *be_, opt_.dtype));
  mixed_ = needs_master_weights(opt_.dtype);
  const DType param_dtype = mixed_ ? DType::kF32 : opt_.dtype;
  if (mixed_) {
    // Initialised (or loaded) in F32 exactly as an F32 model would be, then rounded once
    // into the BF16 weights at the end of setup().
    LAPLACE_RETURN_IF_ERROR(masters_.create(weight_specs(cfg_, DType::kF32), be_->allocator(), "master weights"));
    if (!opt_.init_ckpt.empty()) LAPLACE_RETURN_IF_ERROR(weights_load(opt_.init_ckpt, *be_, masters_));
    else weights_init(cfg_, *be_, masters_, opt_.seed);
  } else {
    if (!opt_.init_ckpt.empty()) LAPLACE_RETURN_IF_ERROR(model_.load(opt_.init_ckpt));
    else model_.init_weights(opt_.seed);
  }
  LAPLACE_RETURN_IF_ERROR(model_.plan({opt_.batch, opt_.seq, true, opt_.recompute_mixer}));
  LAPLACE_RETURN_IF_ERROR(grads_.create(weight_specs(cfg_, param_dtype), be_->allocator(), "gradients"));
  LAPLACE_RETURN_IF_ERROR(create_loss_buffers());
  // On the GPU, Newton–Schulz runs in bf16 as SPEC §2 has it; the CPU keeps the master
  // dtype so the F32 reference can check it.
  opt_.optim.ns_bf16 = be_->device() == Device::kCUDA;
  LAPLACE_RETURN_IF_ERROR(optimizer_.init(*be_, make_params(), opt_.optim));

  LAPLACE_RETURN_IF_ERROR(open_train_data(opt_, cfg_, 0, 1, &train_loader_, &val_loader_, &has_val_));
  progress_ = TrainProgress{};
  progress_.seed = opt_.seed;
  LAPLACE_RETURN_IF_ERROR(create_out_dir(opt_));
  const std::string resume = resume_path(opt_);
  if (!resume.empty()) {
    LAPLACE_RETURN_IF_ERROR(checkpoint_load(resume, cfg_, *be_, param_arena(), &optimizer_, &progress_));
    LoaderPosition pos;
    LAPLACE_RETURN_IF_ERROR(LoaderPosition::from_json(progress_.loader_position, &pos).with_context(resume));
    LAPLACE_RETURN_IF_ERROR(train_loader_.seek(pos).with_context(resume));
    if (!opt_.quiet) std::printf("resumed from %s at step %lld\n", resume.c_str(), (long long)progress_.step);
  }
  if (mixed_) copy_masters_to_weights(*be_, masters_, model_.weight_arena());
  LAPLACE_RETURN_IF_ERROR(record_.open(opt_, progress_.step, true));
  x_.resize(opt_.batch * opt_.seq);
  y_.resize(opt_.batch * opt_.seq);
  if (!opt_.quiet) {
    std::printf("model: %lld parameters (%lld in Muon matrices), %s %s\n", (long long)cfg_.total_params(),
                (long long)cfg_.body_params(), be_->name(), dtype_name(opt_.dtype));
    std::printf("data: %lld tokens in %lld shards; %lld tokens per step (batch %lld × seq %lld × accum %lld)\n",
                (long long)train_loader_.total_tokens(), (long long)train_loader_.num_shards(),
                (long long)(opt_.batch * opt_.seq * opt_.grad_accum), (long long)opt_.batch, (long long)opt_.seq,
                (long long)opt_.grad_accum);
    std::fflush(stdout);
  }
  return Status::ok();
}

Status Trainer::validate(int64_t batches, double* loss) {
  if (!has_val_) return Status::invalid_argument("no validation data");
  val_loader_.reset();
  double sum = 0;
  for (int64_t i = 0; i < batches; ++i) {
    val_loader_.next(x_.data(), y_.data());
    if (opt_.target_mask) opt_.target_mask(x_.data(), y_.data(), opt_.batch, opt_.seq);
    model_.forward(x_.data(), opt_.batch, opt_.seq, ForwardOptions{});
    sum += model_.loss(y_.data());
  }
  *loss = sum / static_cast<double>(batches);
  return Status::ok();
}

Status Trainer::save_checkpoint() {
  if (opt_.out_dir.empty()) return Status::ok();
  progress_.loader_position = train_loader_.position().to_json();
  progress_.optimizer_steps = optimizer_.step_count();
  LAPLACE_RETURN_IF_ERROR(checkpoint_save(opt_.out_dir + "/checkpoint.safetensors", cfg_, *be_, param_arena(),
                                          optimizer_, progress_));
  // A complete model directory for generate/eval/serve beside it.
  if (mixed_) LAPLACE_RETURN_IF_ERROR(weights_save(opt_.out_dir + "/model.safetensors", cfg_, *be_, masters_));
  else LAPLACE_RETURN_IF_ERROR(model_.save(opt_.out_dir + "/model.safetensors"));
  return write_model_dir_files(opt_, cfg_);
}

void Trainer::enqueue_step(int64_t step) {
  grads_.zero();
  const int64_t N = opt_.batch * opt_.seq;
  for (int64_t micro = 0; micro < opt_.grad_accum; ++micro) {
    train_loader_.next(x_.data(), y_.data());
    if (opt_.target_mask) opt_.target_mask(x_.data(), y_.data(), opt_.batch, opt_.seq);
    model_.forward(x_.data(), opt_.batch, opt_.seq, ForwardOptions{});
    // Model::loss's arithmetic with the sum left on the device (Model::loss would read the
    // losses back): the mean over the counted targets, added up over micro-batches.
    int64_t count = 0;
    for (int64_t i = 0; i < N; ++i) count += y_[i] >= 0;
    be_->copy(targets_dev_, Tensor(y_.data(), DType::kI32, {N}));
    be_->cross_entropy_forward(model_.logits(), targets_dev_, losses_dev_);
    be_->loss_sum_into(losses_dev_, static_cast<double>(count), loss_sum_, micro > 0);
    model_.backward(y_.data(), grads_, 1.0 / static_cast<double>(opt_.grad_accum));
  }
  optimizer_.enqueue_step(lr_at(opt_.schedule, step));
  // Unconditional: a skipped step leaves the masters as they were, so this rewrites the
  // weights with the values they already hold (gating it would need the flag on the host).
  if (mixed_) copy_masters_to_weights(*be_, masters_, model_.weight_arena());
}

StepResult Trainer::finish_step(double* loss) {
  const StepResult r = optimizer_.finish_step();  // synchronises: the step is done after this
  double sum = 0;
  be_->copy(Tensor(&sum, DType::kF64, {1}), loss_sum_);
  *loss = sum / static_cast<double>(opt_.grad_accum);
  return r;
}

Status open_train_data(const TrainOptions& o, const Config& c, int rank, int world, DataLoader* train,
                       DataLoader* val, bool* has_val) {
  DataLoaderOptions dl;
  LAPLACE_RETURN_IF_ERROR(expand_shard_patterns(o.train_data, &dl.shards));
  dl.batch_size = o.batch;
  dl.seq_len = o.seq;
  dl.shuffle = o.shuffle;
  dl.seed = o.data_seed;
  dl.vocab_size = c.vocab_size;
  dl.rank = rank;
  dl.world = world;
  LAPLACE_RETURN_IF_ERROR(DataLoader::open(dl, train).with_context("training data"));
  *has_val = !o.val_data.empty();
  if (!*has_val) return Status::ok();
  DataLoaderOptions vl = dl;
  vl.shards.clear();
  LAPLACE_RETURN_IF_ERROR(expand_shard_patterns(o.val_data, &vl.shards));
  vl.shuffle = false;
  return DataLoader::open(vl, val).with_context("validation data");
}

Status create_out_dir(const TrainOptions& o) {
  if (o.out_dir.empty()) return Status::ok();
  std::error_code ec;
  fs::create_directories(o.out_dir, ec);
  if (ec) return Status::io_error("cannot create " + o.out_dir + ": " + ec.message());
  return Status::ok();
}

std::string resume_path(const TrainOptions& o) {
  if (o.resume != "auto") return o.resume;
  const std::string p = o.out_dir + "/checkpoint.safetensors";
  return fs::exists(p) ? p : "";
}

Status write_model_dir_files(const TrainOptions& o, const Config& c) {
  const std::string cfg_text = c.to_json();
  LAPLACE_RETURN_IF_ERROR(write_file_atomic(o.out_dir + "/config.json", cfg_text.data(), cfg_text.size()));
  if (!o.tokenizer.empty()) {
    std::string tok;
    LAPLACE_RETURN_IF_ERROR(read_file(o.tokenizer, &tok));
    LAPLACE_RETURN_IF_ERROR(write_file_atomic(o.out_dir + "/tokenizer.model", tok.data(), tok.size()));
  }
  if (o.after_model_saved) LAPLACE_RETURN_IF_ERROR(o.after_model_saved(o.out_dir));
  return Status::ok();
}

TrainLoop train_loop_for(const TrainOptions& o, const Config& c, int ranks) {
  TrainLoop loop;
  loop.steps = o.steps;
  loop.stop_after = o.stop_after;
  loop.eval_every = o.eval_every;
  loop.ckpt_every = o.ckpt_every;
  loop.schedule = o.schedule;
  loop.tokens_per_step = static_cast<int64_t>(ranks) * o.batch * o.seq * o.grad_accum;
  loop.flops_per_token = c.train_flops_per_token();
  loop.peak_flops = static_cast<double>(ranks) * o.peak_flops;
  loop.talk = !o.quiet;
  return loop;
}

std::string val_loss_record(int64_t step, double loss) {
  nlohmann::ordered_json j;
  j["step"] = step;
  j["val_loss"] = loss;
  return j.dump();
}

Status Trainer::run(const std::function<void(const StepLog&)>& on_step) {
  TrainLoop loop = train_loop_for(opt_, cfg_, 1);
  loop.has_val = has_val_;
  loop.step = [this](int64_t step, double* loss) {
    enqueue_step(step);
    return finish_step(loss);
  };
  loop.optimizer_steps = [this] { return optimizer_.step_count(); };
  loop.record = [&](const StepLog& s) {
    record_.step(s);
    if (on_step) on_step(s);
  };
  loop.validate = [this](double* loss) { return validate(opt_.eval_batches, loss); };
  loop.record_validation = [this](int64_t step, double loss) { record_.validation(step, loss); };
  loop.save_checkpoint = [this] { return save_checkpoint(); };
  return loop.run(&progress_);
}

}  // namespace laplace
