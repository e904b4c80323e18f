#include "train/trainer.h"

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "core/file_util.h"
#include "train/whole_parameters.h"

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
  r.recompute = o.recompute_layers ? kRecomputeLayers
                : o.recompute_mixer ? kRecomputeMixer
                : o.batch_auto      ? kRecomputeChoose
                                    : kRecomputeNone;
  r.allow_recompute_layers = true;  // the Trainer turns it off for a store that cannot plan it
  r.muon_fused = o.muon_fused;
  r.fp8 = o.fp8;
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
  if (o->recompute_mixer && o->recompute_layers)
    return Status::invalid_argument("--recompute-layers already recomputes the mixer: give one of "
                                    "--recompute-mixer and --recompute-layers");
  if (o->batch_auto || r.tokens_per_step > 0) {
    LAPLACE_RETURN_IF_ERROR(choose_memory_plan(c, r, plan));
  } else {
    const int rc = o->recompute_layers ? kRecomputeLayers : o->recompute_mixer ? kRecomputeMixer : kRecomputeNone;
    *plan = memory_plan_for(c, r, o->batch, rc);  // as given; allocation decides
  }
  o->batch = plan->batch;
  o->grad_accum = plan->grad_accum;
  o->recompute_mixer = plan->recompute_mixer;
  o->recompute_layers = plan->recompute_layers;
  return Status::ok();
}

PlanOptions training_plan_options(const TrainOptions& o) {
  PlanOptions p;
  p.max_batch = o.batch;
  p.max_seq = o.seq;
  p.training = true;
  p.recompute_mixer = o.recompute_mixer;
  p.recompute_layers = o.recompute_layers;
  return p;
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

// ---- the Trainer ---------------------------------------------------------------------------

namespace {
uint64_t fnv1a(const std::string& s, uint64_t h) {
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}
}  // namespace

Trainer::Trainer(TrainOptions o, std::unique_ptr<ParameterStore> store)
    : opt_(std::move(o)), store_(store ? std::move(store) : std::make_unique<WholeParameters>()) {}

Trainer::~Trainer() {
  store_->detach();
}

const Arena& Trainer::param_arena() const {
  const Arena* a = store_->param_arena();
  LAPLACE_CHECK(a != nullptr, "Trainer::param_arena: the parameter store holds no whole parameters");
  return *a;
}

size_t Trainer::allocated_bytes() const {
  return model_.weight_arena().bytes() + model_.activation_bytes() + model_.fp8_bytes() + store_->allocated_bytes() +
         optimizer_.state_bytes();
}

Status Trainer::setup_backend() {
  LAPLACE_RETURN_IF_ERROR(config_load(opt_.config_path, &cfg_));
  if ((!opt_.batch_auto && opt_.batch < 1) || opt_.seq < 1 || opt_.grad_accum < 1 || opt_.steps < 1)
    return Status::invalid_argument("batch, seq, grad-accum and steps must all be ≥ 1");
  if (opt_.tokens_per_step < 0) return Status::invalid_argument("tokens per step must be ≥ 0");
  LAPLACE_RETURN_IF_ERROR(store_->check_options(opt_));
  if (opt_.recompute_layers && !store_plans_layer_recompute())
    return Status::unsupported("--recompute-layers trains on one device; the sharded trainer (--distributed, "
                               "mpirun) recomputes the mixer at most (--recompute-mixer)");
  opt_.schedule.total_steps = opt_.steps;
  LAPLACE_RETURN_IF_ERROR(opt_.schedule.validate());
  LAPLACE_RETURN_IF_ERROR(opt_.optim.validate());
  LAPLACE_RETURN_IF_ERROR(make_backend(opt_.device, &be_));
  TrainerParts parts;
  parts.opt = &opt_;
  parts.cfg = &cfg_;
  parts.be = be_.get();
  parts.model = &model_;
  parts.optimizer = &optimizer_;
  return store_->attach(parts);
}

bool Trainer::store_plans_layer_recompute() const {
  // WholeParameters::create plans training_plan_options(opt_); the sharded store does not yet.
  return dynamic_cast<const WholeParameters*>(store_.get()) != nullptr;
}

Status Trainer::plan_memory() {
  MemoryPlanRequest r = memory_request_for(opt_, *be_);
  r.allow_recompute_layers = store_plans_layer_recompute();
  store_->plan_request(&r);
  LAPLACE_RETURN_IF_ERROR(apply_memory_plan(cfg_, r, &opt_, &plan_));
  if (!opt_.quiet) {
    std::fputs(format_memory_plan(plan_, be_->device() == Device::kCUDA ? "device" : "host").c_str(), stdout);
    std::fflush(stdout);
  }
  return Status::ok();
}

Status Trainer::setup_local() {
  LAPLACE_RETURN_IF_ERROR(store_->create());
  const PlanOptions& po = model_.plan_options();
  if (po.recompute_mixer != opt_.recompute_mixer || po.recompute_layers != opt_.recompute_layers)
    return Status::unsupported("the parameter store planned the model with another recompute than the memory plan's");
  LAPLACE_RETURN_IF_ERROR(
      open_train_data(opt_, cfg_, store_->rank(), store_->ranks(), &train_loader_, &val_loader_, &has_val_));
  progress_ = TrainProgress{};
  progress_.seed = opt_.seed;
  progress_.precision = train_precision_name(opt_.fp8, opt_.fp8_fast_forward);
  if (store_->rank() == 0) LAPLACE_RETURN_IF_ERROR(create_out_dir(opt_));
  const int64_t N = opt_.batch * opt_.seq;
  x_.resize(N);
  y_.resize(N);
  // The step's loss on the device (not in the memory plan: a few vectors of B·T): targets,
  // per-token losses, and what the store sums them into.
  std::vector<TensorSpec> specs = {{"targets", DType::kI32, {N}},
                                   {"losses", opt_.dtype == DType::kBF16 ? DType::kF32 : opt_.dtype, {N}}};
  for (TensorSpec& s : store_->loss_specs()) specs.push_back(std::move(s));
  LAPLACE_RETURN_IF_ERROR(loss_bufs_.create(std::move(specs), be_->allocator(), "loss buffers"));
  targets_dev_ = loss_bufs_.tensor(0);
  losses_dev_ = loss_bufs_.tensor(1);
  store_->bind_loss(loss_bufs_, 2);
  return Status::ok();
}

// Every rank must have derived the same plan and been given the same data.
Status Trainer::check_ranks_agree() {
  const int64_t mine = static_cast<int64_t>(store_->plan_hash());
  const std::vector<int64_t> hashes = store_->all_gather_value(mine);
  for (size_t q = 0; q < hashes.size(); ++q)
    if (hashes[q] != mine)
      return Status::invalid_argument("rank " + std::to_string(q) + " derived a different sharding/Muon owner plan " +
                                      "(hash mismatch): every rank must get the same config and flags");
  // The shards' token counts, compared with rank 0's.
  const std::vector<int64_t> train_tokens = store_->all_gather_value(train_loader_.total_tokens());
  const std::vector<int64_t> train_shards = store_->all_gather_value(train_loader_.num_shards());
  const std::vector<int64_t> val_tokens = store_->all_gather_value(has_val_ ? val_loader_.total_tokens() : -1);
  for (size_t q = 1; q < train_tokens.size(); ++q)
    if (train_tokens[q] != train_tokens[0] || train_shards[q] != train_shards[0] || val_tokens[q] != val_tokens[0])
      return Status::invalid_argument(
          "rank " + std::to_string(q) + " was given other data than rank 0 (training: " +
          std::to_string(train_tokens[q]) + " tokens in " + std::to_string(train_shards[q]) + " shard(s) against " +
          std::to_string(train_tokens[0]) + " in " + std::to_string(train_shards[0]) + "; validation: " +
          std::to_string(val_tokens[q]) + " against " + std::to_string(val_tokens[0]) +
          " tokens): every rank must read the same shards");
  return Status::ok();
}

Status Trainer::load_checkpoint(const std::string& path) {
  LAPLACE_RETURN_IF_ERROR(store_->load_checkpoint(path, &progress_));
  if (progress_.precision != train_precision_name(opt_.fp8, opt_.fp8_fast_forward))
    return Status::invalid_argument(path + " was trained with --precision " + progress_.precision +
                                    "; resume it with the same (or start a new run from its model.safetensors "
                                    "with --init)");
  LoaderPosition pos;
  LAPLACE_RETURN_IF_ERROR(LoaderPosition::from_json(progress_.loader_position, &pos).with_context(path));
  return train_loader_.seek(pos).with_context(path);
}

Status Trainer::setup() {
  LAPLACE_RETURN_IF_ERROR(store_->agree(setup_backend()));
  LAPLACE_RETURN_IF_ERROR(store_->agree(plan_memory()));
  LAPLACE_RETURN_IF_ERROR(store_->agree(setup_local()));
  LAPLACE_RETURN_IF_ERROR(check_ranks_agree());
  // Whether to resume is agreed first: loading is collective.
  const std::string resume = resume_path(opt_);
  const std::vector<int64_t> resuming = store_->all_gather_value(resume.empty() ? 0 : 1);
  for (size_t q = 1; q < resuming.size(); ++q)
    if (resuming[q] != resuming[0])
      return Status::invalid_argument("rank " + std::to_string(q) +
                                      (resuming[q] ? " resumes from a checkpoint" : " starts afresh") + " and rank 0 " +
                                      (resuming[0] ? "resumes" : "does not") +
                                      ": every rank must be given the same --resume and --out");
  if (!resume.empty()) {
    LAPLACE_RETURN_IF_ERROR(store_->agree(load_checkpoint(resume)));
    if (!opt_.quiet && store_->rank() == 0)
      std::printf("resumed from %s at step %lld\n", resume.c_str(), (long long)progress_.step);
  }
  // ... and resumed from the same point (a rank given another --resume or output directory).
  const std::vector<int64_t> steps = store_->all_gather_value(progress_.step);
  const std::vector<int64_t> positions =
      store_->all_gather_value(static_cast<int64_t>(fnv1a(progress_.loader_position, 1469598103934665603ull)));
  for (size_t q = 1; q < steps.size(); ++q)
    if (steps[q] != steps[0] || positions[q] != positions[0])
      return Status::invalid_argument("rank " + std::to_string(q) + " starts at step " + std::to_string(steps[q]) +
                                      (steps[q] == steps[0] ? " from another data position" : "") +
                                      ", rank 0 at step " + std::to_string(steps[0]) +
                                      ": every rank must resume from the same checkpoint");
  store_->refresh_weights();
  LAPLACE_RETURN_IF_ERROR(store_->agree(record_.open(opt_, progress_.step, store_->rank() == 0)));
  if (!opt_.quiet && store_->rank() == 0) print_setup();
  return Status::ok();
}

void Trainer::print_setup() const {
  std::printf("model: %lld parameters (%lld in Muon matrices), %s %s%s\n", (long long)cfg_.total_params(),
              (long long)cfg_.body_params(), be_->name(), dtype_name(opt_.dtype), store_->dtype_note().c_str());
  std::fputs(store_->setup_lines().c_str(), stdout);
  std::printf("data: %lld tokens in %lld shards; %lld tokens per step (%sbatch %lld × seq %lld × accum %lld)\n",
              (long long)train_loader_.total_tokens(), (long long)train_loader_.num_shards(),
              (long long)(store_->ranks() * opt_.batch * opt_.seq * opt_.grad_accum), store_->ranks_note().c_str(),
              (long long)opt_.batch, (long long)opt_.seq, (long long)opt_.grad_accum);
  std::fflush(stdout);
}

Status Trainer::validate(int64_t batches, double* loss) {
  if (!has_val_) return Status::invalid_argument("no validation data");
  store_->quiesce();  // every weight the forward reads is in place
  val_loader_.reset();
  const int P = store_->ranks();
  std::vector<double> all(P);
  double sum = 0;
  for (int64_t i = 0; i < batches; ++i) {
    val_loader_.next(x_.data(), y_.data());
    if (opt_.target_mask) opt_.target_mask(x_.data(), y_.data(), opt_.batch, opt_.seq);
    ForwardOptions vo;
    vo.document_separator = opt_.document_separator;
    model_.forward(x_.data(), opt_.batch, opt_.seq, vo);
    store_->all_gather_value(model_.loss(y_.data()), all.data());
    for (int q = 0; q < P; ++q) sum += all[q];
  }
  *loss = sum / static_cast<double>(batches * P);
  return Status::ok();
}

Status Trainer::save_checkpoint() {
  if (opt_.out_dir.empty()) return Status::ok();
  store_->quiesce();  // the parameters' collectives below order with the compute
  progress_.loader_position = train_loader_.position().to_json();
  progress_.optimizer_steps = optimizer_.step_count();
  Status st = store_->save_checkpoint(opt_.out_dir, progress_);
  // Beside the weights, the rest of a model directory for generate/eval/serve.
  if (st.is_ok() && store_->rank() == 0) st = write_model_dir_files(opt_, cfg_);
  return store_->agree(st);
}

void Trainer::enqueue_step(int64_t step) {
  store_->begin_step();
  ForwardOptions fo = store_->forward_options();
  fo.document_separator = opt_.document_separator;
  const int64_t N = opt_.batch * opt_.seq;
  for (int64_t micro = 0; micro < opt_.grad_accum; ++micro) {
    store_->begin_micro(micro);
    train_loader_.next(x_.data(), y_.data());
    if (opt_.target_mask) opt_.target_mask(x_.data(), y_.data(), opt_.batch, opt_.seq);
    model_.forward(x_.data(), opt_.batch, opt_.seq, fo);
    // Model::loss's arithmetic with the sum left on the device (Model::loss would read the
    // losses back): the mean over the counted targets, which the store adds up.
    int64_t count = 0;
    for (int64_t i = 0; i < N; ++i) count += y_[i] >= 0;
    be_->copy(targets_dev_, Tensor(y_.data(), DType::kI32, {N}));
    be_->cross_entropy_forward(model_.logits(), targets_dev_, losses_dev_);
    store_->micro_loss(losses_dev_, static_cast<double>(count), micro);
    model_.backward(y_.data(), store_->gradients(), store_->loss_scale(), store_->after_group(micro),
                    store_->overwrite_gradients());
    store_->end_micro(micro);
  }
  store_->before_optimizer();
  optimizer_.enqueue_step(lr_at(opt_.schedule, step));
  store_->after_optimizer();
}

StepResult Trainer::finish_step(double* loss) {
  const StepResult r = optimizer_.finish_step();  // synchronises: the step is done after this
  *loss = store_->step_loss();
  return r;
}

Status Trainer::run(const std::function<void(const StepLog&)>& on_step) {
  TrainLoop loop = train_loop_for(opt_, cfg_, store_->ranks());
  loop.has_val = has_val_;
  loop.talk = loop.talk && store_->rank() == 0;
  loop.step = [this](int64_t step, double* loss) {
    enqueue_step(step);
    return finish_step(loss);
  };
  loop.optimizer_steps = [this] { return optimizer_.step_count(); };
  loop.record = [&](const StepLog& s) {
    if (store_->rank() == 0) record_.step(s, store_->record_fields(), store_->progress_detail());
    if (on_step) on_step(s);
  };
  loop.validate = [this](double* loss) { return validate(opt_.eval_batches, loss); };
  loop.record_validation = [this](int64_t step, double loss) { record_.validation(step, loss); };
  loop.save_checkpoint = [this] { return save_checkpoint(); };
  return loop.run(&progress_);
}

}  // namespace laplace
