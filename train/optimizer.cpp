#include "train/optimizer.h"

#include <algorithm>
#include <cmath>
#include <unordered_set>

namespace laplace {

namespace {

std::string shape_of(const Tensor& t) { return t.shape_str(); }

std::string spec_shape_str(const TensorSpec& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.shape.size(); ++i) r += (i ? ", " : "") + std::to_string(s.shape[i]);
  return r + "] " + dtype_name(s.dtype);
}

std::vector<int64_t> shape_vec(const Tensor& t) { return std::vector<int64_t>(t.shape.begin(), t.shape.begin() + t.ndim); }

Tensor view_as(const Tensor& flat, const Tensor& like) {
  return Tensor::make(flat.data, flat.dtype, like.shape.data(), like.ndim, flat.device);
}

}  // namespace

Status OptimizerConfig::validate() const {
  auto bad = [](const std::string& m) { return Status::invalid_argument("optimizer config: " + m); };
  if (!(lr >= 0)) return bad("lr must be >= 0");
  if (!(weight_decay >= 0)) return bad("weight_decay must be >= 0");
  if (!(beta1 >= 0 && beta1 < 1)) return bad("beta1 must be in [0, 1)");
  if (!(beta2 >= 0 && beta2 < 1)) return bad("beta2 must be in [0, 1)");
  if (!(eps > 0)) return bad("eps must be > 0");
  if (!(momentum >= 0 && momentum < 1)) return bad("momentum must be in [0, 1)");
  if (ns_steps < 0) return bad("ns_steps must be >= 0");
  if (!(max_grad_norm >= 0)) return bad("max_grad_norm must be >= 0 (0 = off)");
  return Status::ok();
}

// ---- Muon phases -----------------------------------------------------------------------

void muon_prepare(Backend& be, const Tensor& g, Tensor momentum, Tensor u, double mu, bool nesterov) {
  LAPLACE_CHECK(same_shape(g, momentum) && same_shape(g, u), "muon_prepare: shapes differ");
  be.muon_momentum(g, momentum, u, mu, nesterov);
}

void muon_orthogonalise(Backend& be, const Tensor& u, const std::vector<int64_t>& blocks, Tensor o,
                        NsScratch& scratch, int ns_steps) {
  LAPLACE_CHECK(u.ndim == 2 && same_shape(u, o), "muon_orthogonalise: u and o must be equal 2-D shapes");
  int64_t r0 = 0;
  for (int64_t br : blocks) {
    newton_schulz(be, u.slice(0, r0, r0 + br), o.slice(0, r0, r0 + br), scratch, ns_steps);
    r0 += br;
  }
  LAPLACE_CHECK(r0 == u.dim(0), "muon_orthogonalise: blocks do not sum to the rows");
}

void muon_finish(Backend& be, Tensor w, const Tensor& o, const std::vector<int64_t>& blocks,
                 int64_t row_begin, double lr, double wd, MuonScale mode) {
  LAPLACE_CHECK(w.ndim == 2 && same_shape(w, o), "muon_finish: w and o must be equal 2-D shapes");
  const int64_t cols = w.dim(1);
  const int64_t row_end = row_begin + w.dim(0);
  int64_t b0 = 0, covered = 0;
  for (int64_t br : blocks) {
    const int64_t b1 = b0 + br;
    const int64_t lo = std::max(b0, row_begin), hi = std::min(b1, row_end);
    if (lo < hi) {
      be.muon_apply(w.slice(0, lo - row_begin, hi - row_begin), o.slice(0, lo - row_begin, hi - row_begin), lr, wd,
                    muon_scale(br, cols, mode));
      covered += hi - lo;
    }
    b0 = b1;
  }
  LAPLACE_CHECK(covered == w.dim(0), "muon_finish: shard rows fall outside the blocks");
}

double global_grad_norm(Backend& be, const std::vector<Param>& params) {
  double ss = 0.0;
  for (const Param& p : params) ss += be.sum_squares(p.g);
  return std::sqrt(ss);
}

void global_grad_sum_squares_into(Backend& be, const std::vector<Param>& params, Tensor acc) {
  bool first = true;
  for (const Param& p : params) {
    be.sum_squares_into(p.g, acc, !first);
    first = false;
  }
  if (first) be.fill(acc, 0.0);
}

// ---- Optimizer ------------------------------------------------------------------------------

Status Optimizer::init(Backend& be, std::vector<Param> params, const OptimizerConfig& cfg) {
  LAPLACE_RETURN_IF_ERROR(cfg.validate());
  std::unordered_set<std::string> names;
  bool have_muon_dtype = false;
  DType muon_dtype = DType::kF32;
  NsScratch ns;
  int64_t max_muon = 0;
  for (Param& p : params) {
    auto bad = [&](const std::string& m) { return Status::invalid_argument("optimizer param '" + p.name + "': " + m); };
    if (p.name.empty()) return Status::invalid_argument("optimizer param with an empty name");
    if (!names.insert(p.name).second) return bad("duplicate name");
    if (!p.w.defined() || !p.g.defined()) return bad("weight or gradient is undefined");
    if (!same_shape(p.w, p.g))
      return bad("gradient shape " + shape_of(p.g) + " differs from weight shape " + shape_of(p.w));
    if (p.w.dtype != DType::kF32 && p.w.dtype != DType::kF64)
      return bad("master weights must be F32 or F64, got " + shape_of(p.w));
    if (p.g.dtype != p.w.dtype) return bad("gradient dtype differs from the weight dtype");
    if (p.w.device != be.device() || p.g.device != be.device())
      return bad(std::string("tensors must live on the backend's device (") + device_name(be.device()) + ")");
    if (!p.w.is_contiguous() || !p.g.is_contiguous()) return bad("weight and gradient must be contiguous");
    if (p.muon) {
      if (p.w.ndim != 2) return bad("Muon needs a 2-D matrix, got " + shape_of(p.w));
      const int64_t rows = p.w.dim(0), cols = p.w.dim(1);
      if (p.blocks.empty()) p.blocks = {rows};
      int64_t sum = 0;
      for (int64_t b : p.blocks) {
        if (b <= 0) return bad("Muon blocks must be positive row counts");
        sum += b;
      }
      if (sum != rows)
        return bad("Muon blocks sum to " + std::to_string(sum) + " rows, the matrix has " + std::to_string(rows));
      if (have_muon_dtype && p.w.dtype != muon_dtype) return bad("all Muon params must share one dtype");
      have_muon_dtype = true;
      muon_dtype = p.w.dtype;
      for (int64_t b : p.blocks) ns.plan(b, cols);
      max_muon = std::max(max_muon, p.w.numel());
    } else if (!p.blocks.empty()) {
      return bad("blocks are only meaningful for Muon params");
    }
  }

  std::vector<TensorSpec> specs;
  std::vector<Slot> slots(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    const Param& p = params[i];
    if (p.muon) {
      slots[i].state0 = static_cast<int64_t>(specs.size());
      specs.push_back({"optim." + p.name + ".momentum", p.w.dtype, shape_vec(p.w)});
    } else {
      slots[i].state0 = static_cast<int64_t>(specs.size());
      specs.push_back({"optim." + p.name + ".adam_m", p.w.dtype, shape_vec(p.w)});
      slots[i].state1 = static_cast<int64_t>(specs.size());
      specs.push_back({"optim." + p.name + ".adam_v", p.w.dtype, shape_vec(p.w)});
    }
  }
  const size_t scalars_idx = specs.size();
  specs.push_back({"optim.scratch.scalars", DType::kF64, {4}});
  const size_t update_idx = specs.size();
  if (max_muon > 0) {
    specs.push_back({"optim.scratch.muon_update", muon_dtype, {max_muon}});
    ns.dtype = cfg.ns_bf16 ? DType::kBF16 : muon_dtype;
    ns.add_specs(&specs, "optim.scratch.ns.");
  }

  Arena arena;
  LAPLACE_RETURN_IF_ERROR(arena.create(std::move(specs), be.allocator(), "optimizer state"));
  Tensor update;
  if (max_muon > 0) {
    update = arena.tensor(update_idx);
    LAPLACE_RETURN_IF_ERROR(ns.bind(arena, "optim.scratch.ns."));
  }

  be_ = &be;
  cfg_ = cfg;
  params_ = std::move(params);
  slots_ = std::move(slots);
  arena_ = std::move(arena);
  update_ = update;
  scalars_ = arena_.tensor(scalars_idx);
  ns_ = std::move(ns);
  t_ = 0;
  pending_ = false;
  return Status::ok();
}

void Optimizer::enqueue_step(double lr) {
  LAPLACE_CHECK(be_ != nullptr, "Optimizer::enqueue_step before init");
  LAPLACE_CHECK(!pending_, "Optimizer::enqueue_step twice without finish_step");
  Backend& be = *be_;
  pending_ = true;
  const Tensor ss = scalars_.slice(0, 0, 1), clip = scalars_.slice(0, 1, 4);
  const Tensor coef = scalars_.slice(0, 2, 3), skip = scalars_.slice(0, 3, 4);
  // 1–2: norm, skip flag and clip coefficient on the device; g *= coef (a no-op at 1).
  global_grad_sum_squares_into(be, params_, ss);
  be.grad_clip_scalars(ss, cfg_.max_grad_norm, clip);
  for (Param& p : params_) be.scale_by(p.g, coef);

  // 3: AdamW at step t_ + 1, which finish_step makes the count unless the step is skipped.
  AdamWParams ap;
  ap.lr = lr;
  ap.beta1 = cfg_.beta1;
  ap.beta2 = cfg_.beta2;
  ap.eps = cfg_.eps;
  ap.step = t_ + 1;
  for (size_t i = 0; i < params_.size(); ++i) {
    Param& p = params_[i];
    if (p.muon) continue;
    ap.wd = p.decay ? cfg_.weight_decay : 0.0;
    be.adamw_update_gated(p.w, p.g, arena_.tensor(slots_[i].state0), arena_.tensor(slots_[i].state1), ap, skip);
  }
  // 4: Muon. u and the Newton–Schulz scratch are scratch, so only the momentum and the
  // weights need the gate.
  for (size_t i = 0; i < params_.size(); ++i) {
    Param& p = params_[i];
    if (!p.muon) continue;
    Tensor u = view_as(update_, p.w);
    LAPLACE_CHECK(same_shape(p.g, u), "muon_prepare: shapes differ");
    be.muon_momentum_gated(p.g, arena_.tensor(slots_[i].state0), u, cfg_.momentum, cfg_.nesterov, skip);
    muon_orthogonalise(be, u, p.blocks, u, ns_, cfg_.ns_steps);
    const int64_t cols = p.w.dim(1);
    int64_t r0 = 0;
    for (int64_t br : p.blocks) {  // muon_finish's per-block scale, gated
      be.muon_apply_gated(p.w.slice(0, r0, r0 + br), u.slice(0, r0, r0 + br), lr, cfg_.weight_decay,
                          muon_scale(br, cols, cfg_.scale), skip);
      r0 += br;
    }
  }
}

StepResult Optimizer::finish_step() {
  LAPLACE_CHECK(pending_, "Optimizer::finish_step without enqueue_step");
  pending_ = false;
  double host[4] = {0, 0, 0, 0};
  be_->copy(Tensor(host, DType::kF64, {4}), scalars_);  // the step boundary's one sync
  StepResult r;
  r.grad_norm = host[1];
  r.clip_coef = host[2];
  r.skipped = host[3] != 0.0;
  if (!r.skipped) ++t_;
  return r;
}

std::vector<std::pair<std::string, Tensor>> Optimizer::state_tensors() const {
  std::vector<std::pair<std::string, Tensor>> out;
  for (size_t i = 0; i < params_.size(); ++i) {
    for (int64_t idx : {slots_[i].state0, slots_[i].state1}) {
      if (idx < 0) continue;
      out.emplace_back(arena_.spec(static_cast<size_t>(idx)).name, arena_.tensor(static_cast<size_t>(idx)));
    }
  }
  return out;
}

Status Optimizer::load_state(const std::vector<std::pair<std::string, Tensor>>& tensors, int64_t step_count) {
  if (be_ == nullptr) return Status::invalid_argument("optimizer state: load before init");
  if (step_count < 0) return Status::invalid_argument("optimizer state: negative step count " + std::to_string(step_count));
  const auto mine = state_tensors();
  std::vector<const Tensor*> src(mine.size(), nullptr);
  for (const auto& [name, t] : tensors) {
    if (name.rfind("optim.", 0) != 0) continue;
    size_t j = 0;
    while (j < mine.size() && mine[j].first != name) ++j;
    if (j == mine.size())
      return Status::invalid_argument("optimizer state: unexpected tensor '" + name +
                                      "' (no such parameter or state in this optimizer)");
    if (src[j] != nullptr) return Status::invalid_argument("optimizer state: tensor '" + name + "' given twice");
    const TensorSpec& spec = arena_.spec(static_cast<size_t>(arena_.find(name)));
    if (!same_shape(t, mine[j].second) || t.dtype != mine[j].second.dtype)
      return Status::invalid_argument("optimizer state: tensor '" + name + "' is " + shape_of(t) + ", expected " +
                                      spec_shape_str(spec));
    if (!t.defined()) return Status::invalid_argument("optimizer state: tensor '" + name + "' has no data");
    src[j] = &t;
  }
  for (size_t j = 0; j < mine.size(); ++j)
    if (src[j] == nullptr) return Status::not_found("optimizer state: tensor '" + mine[j].first + "' is missing");
  for (size_t j = 0; j < mine.size(); ++j) be_->copy(mine[j].second, *src[j]);
  t_ = step_count;
  return Status::ok();
}

}  // namespace laplace
