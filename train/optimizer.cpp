#include "train/optimizer.h"

#include <algorithm>
#include <cmath>
#include <unordered_set>

namespace laplace {

namespace {

std::string shape_of(const Tensor& t) { return t.shape_str(); }

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
                 int64_t row_begin, double lr, double wd, MuonScale mode, const Tensor& skip) {
  LAPLACE_CHECK(w.ndim == 2 && same_shape(w, o), "muon_finish: w and o must be equal 2-D shapes");
  const int64_t cols = w.dim(1);
  const int64_t row_end = row_begin + w.dim(0);
  int64_t b0 = 0, covered = 0;
  for (int64_t br : blocks) {
    const int64_t b1 = b0 + br;
    const int64_t lo = std::max(b0, row_begin), hi = std::min(b1, row_end);
    if (lo < hi) {
      const Tensor wr = w.slice(0, lo - row_begin, hi - row_begin), orr = o.slice(0, lo - row_begin, hi - row_begin);
      const double sc = muon_scale(br, cols, mode);
      if (skip.defined()) be.muon_apply_gated(wr, orr, lr, wd, sc, skip);
      else be.muon_apply(wr, orr, lr, wd, sc);
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

size_t Optimizer::sharded_scratch_bytes() {
  return Arena::planned_bytes({{"optim.scratch.scalars", DType::kF64, {4}}});
}

Status Optimizer::init(Backend& be, std::vector<Param> params, const OptimizerConfig& cfg, ShardExchange* exchange) {
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
    const int64_t rows = p.w.ndim > 0 ? p.w.dim(0) : 1;
    const int64_t global = p.global_rows > 0 ? p.global_rows : rows;
    if (p.row_begin < 0 || p.row_begin + rows > global)
      return bad("rows [" + std::to_string(p.row_begin) + ", " + std::to_string(p.row_begin + rows) +
                 ") fall outside the matrix's " + std::to_string(global));
    if (exchange == nullptr && (p.row_begin != 0 || global != rows))
      return bad("a row shard needs a ShardExchange");
    for (const Tensor* st : {&p.state0, &p.state1})
      if (st->defined() && (!same_shape(*st, p.w) || st->dtype != p.w.dtype || st->device != p.w.device ||
                            !st->is_contiguous()))
        return bad("given state " + shape_of(*st) + " must match the weight " + shape_of(p.w));
    if (p.state0.defined() != (p.muon || p.state1.defined()) && (p.state0.defined() || p.state1.defined()))
      return bad(p.muon ? "Muon state is state0 alone" : "AdamW state needs both state0 and state1");
    if (p.muon) {
      if (p.w.ndim != 2) return bad("Muon needs a 2-D matrix, got " + shape_of(p.w));
      const int64_t cols = p.w.dim(1);
      if (p.blocks.empty()) p.blocks = {global};
      int64_t sum = 0;
      for (int64_t b : p.blocks) {
        if (b <= 0) return bad("Muon blocks must be positive row counts");
        sum += b;
      }
      if (sum != global)
        return bad("Muon blocks sum to " + std::to_string(sum) + " rows, the matrix has " + std::to_string(global));
      if (have_muon_dtype && p.w.dtype != muon_dtype) return bad("all Muon params must share one dtype");
      have_muon_dtype = true;
      muon_dtype = p.w.dtype;
      if (exchange == nullptr) {  // the exchange orthogonalises in buffers of its own
        for (int64_t b : p.blocks) ns.plan(b, cols);
        max_muon = std::max(max_muon, p.w.numel());
      }
    } else if (!p.blocks.empty()) {
      return bad("blocks are only meaningful for Muon params");
    }
  }

  std::vector<TensorSpec> specs;
  std::vector<Slot> slots(params.size());
  std::vector<std::pair<int64_t, int64_t>> in_arena(params.size(), {-1, -1});  // spec indices of allocated state
  for (size_t i = 0; i < params.size(); ++i) {
    const Param& p = params[i];
    Slot& sl = slots[i];
    sl.name0 = "optim." + p.name + (p.muon ? ".momentum" : ".adam_m");
    if (!p.muon) sl.name1 = "optim." + p.name + ".adam_v";
    if (p.state0.defined()) {
      sl.state0 = p.state0;
      sl.state1 = p.state1;
      continue;
    }
    in_arena[i].first = static_cast<int64_t>(specs.size());
    specs.push_back({sl.name0, p.w.dtype, shape_vec(p.w)});
    if (!p.muon) {
      in_arena[i].second = static_cast<int64_t>(specs.size());
      specs.push_back({sl.name1, p.w.dtype, shape_vec(p.w)});
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

  for (size_t i = 0; i < params.size(); ++i) {
    if (in_arena[i].first >= 0) slots[i].state0 = arena.tensor(static_cast<size_t>(in_arena[i].first));
    if (in_arena[i].second >= 0) slots[i].state1 = arena.tensor(static_cast<size_t>(in_arena[i].second));
  }

  be_ = &be;
  exchange_ = exchange;
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
  if (exchange_ != nullptr) exchange_->grad_sum_squares_into(ss);
  else global_grad_sum_squares_into(be, params_, ss);
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
    be.adamw_update_gated(p.w, p.g, slots_[i].state0, slots_[i].state1, ap, skip);
  }
  // 4: Muon. u and the Newton–Schulz scratch are scratch, so only the momentum and the
  // weights need the gate. Over shards every update is prepared before the exchange
  // orthogonalises them all; on whole matrices each param goes through one buffer in turn.
  if (exchange_ != nullptr) {
    for (size_t i = 0; i < params_.size(); ++i) {
      if (!params_[i].muon) continue;
      const Tensor u = exchange_->muon_update(i);
      LAPLACE_CHECK(same_shape(params_[i].g, u), "ShardExchange::muon_update: shape differs from the param's");
      be.muon_momentum_gated(params_[i].g, slots_[i].state0, u, cfg_.momentum, cfg_.nesterov, skip);
    }
    exchange_->orthogonalise();
    for (size_t i = 0; i < params_.size(); ++i) {
      const Param& p = params_[i];
      if (p.muon)
        muon_finish(be, p.w, exchange_->muon_update(i), p.blocks, p.row_begin, lr, cfg_.weight_decay, cfg_.scale, skip);
    }
    return;
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    Param& p = params_[i];
    if (!p.muon) continue;
    Tensor u = view_as(update_, p.w);
    LAPLACE_CHECK(same_shape(p.g, u), "muon_prepare: shapes differ");
    be.muon_momentum_gated(p.g, slots_[i].state0, u, cfg_.momentum, cfg_.nesterov, skip);
    muon_orthogonalise(be, u, p.blocks, u, ns_, cfg_.ns_steps);
    muon_finish(be, p.w, u, p.blocks, 0, lr, cfg_.weight_decay, cfg_.scale, skip);
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
  for (const Slot& sl : slots_) {
    out.emplace_back(sl.name0, sl.state0);
    if (sl.state1.defined()) out.emplace_back(sl.name1, sl.state1);
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
    if (!same_shape(t, mine[j].second) || t.dtype != mine[j].second.dtype)
      return Status::invalid_argument("optimizer state: tensor '" + name + "' is " + shape_of(t) + ", expected " +
                                      shape_of(mine[j].second));
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
