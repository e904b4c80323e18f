#include "train/memory_plan.h"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <utility>

#include "core/arena.h"
#include "model/model.h"
#include "model/weights.h"
#include "train/muon.h"

namespace laplace {

namespace {

// Optimizer::init's state specs for params made by make_optimizer_params (same order,
// shapes and dtypes; the names do not change the bytes).
size_t optimizer_bytes(const Config& c, DType param_dtype, bool muon_fused, bool ns_bf16) {
  std::vector<TensorSpec> specs;
  NsScratch ns;
  int64_t max_muon = 0;
  for (const TensorSpec& w : weight_specs(c, param_dtype)) {
    if (is_body_matrix(w.name)) {
      specs.push_back({w.name + ".momentum", param_dtype, w.shape});
      const int64_t rows = w.shape[0], cols = w.shape[1];
      const std::vector<int64_t> blocks = muon_fused ? std::vector<int64_t>{rows} : muon_blocks(c, w.name);
      for (int64_t b : blocks) ns.plan(b, cols);
      max_muon = std::max(max_muon, rows * cols);
    } else {
      specs.push_back({w.name + ".adam_m", param_dtype, w.shape});
      specs.push_back({w.name + ".adam_v", param_dtype, w.shape});
    }
  }
  specs.push_back({"scalars", DType::kF64, {4}});
  if (max_muon > 0) {
    specs.push_back({"muon_update", param_dtype, {max_muon}});
    ns.dtype = ns_bf16 ? DType::kBF16 : param_dtype;
    ns.add_specs(&specs, "ns.");
  }
  return Arena::planned_bytes(specs);
}

// Model::plan's activation arena for a training plan: a set per layer (with kRecomputeMixer one
// GLA output for all), or (kRecomputeLayers) each layer's input and one set of the rest.
size_t activation_bytes(const Config& c, DType dt, int64_t B, int64_t T, int recompute) {
  const int64_t N = B * T, D = c.hidden_size, R = c.qkvg_rows(), HV = c.v_dim(), H = c.num_heads;
  const int64_t F = c.ffn_size, V = c.vocab_size;
  const DType st = dt == DType::kBF16 ? DType::kF32 : dt;
  std::vector<TensorSpec> s = {{"ids", DType::kI32, {N}}, {"targets", DType::kI32, {N}}, {"slots", DType::kI32, {B}},
                               {"doc", DType::kI32, {N}}};
  for (int64_t l = 0; l < c.num_layers; ++l) {
    s.push_back({"x_in", dt, {N, D}});
    if (l > 0 && recompute == kRecomputeLayers) continue;
    for (const TensorSpec& t : std::vector<TensorSpec>{{"ln1_mean", st, {N}},
                                                       {"ln1_rstd", st, {N}},
                                                       {"u", dt, {N, D}},
                                                       {"conv_pre", dt, {N, D}},
                                                       {"c", dt, {N, D}},
                                                       {"qkvg", dt, {N, R}},
                                                       {"onorm_rstd", st, {N, H}},
                                                       {"y", dt, {N, HV}},
                                                       {"x_mid", dt, {N, D}},
                                                       {"ln2_mean", st, {N}},
                                                       {"ln2_rstd", st, {N}},
                                                       {"z", dt, {N, D}},
                                                       {"ab", dt, {N, 2 * F}},
                                                       {"h", dt, {N, F}}})
      s.push_back(t);
    // With the mixer recompute, one shared GLA output buffer instead of one per layer.
    if (l == 0 || recompute != kRecomputeMixer) s.push_back({"o", dt, {N, HV}});
  }
  for (const TensorSpec& t : std::vector<TensorSpec>{{"x_final", dt, {N, D}},
                                                     {"lnf_mean", st, {N}},
                                                     {"lnf_rstd", st, {N}},
                                                     {"zf", dt, {N, D}},
                                                     {"logits", dt, {N, V}},  // training: compute dtype
                                                     {"losses", st, {N}}})
    s.push_back(t);
  return Arena::planned_bytes(s);
}

// Model::plan's backward scratch.
size_t backward_scratch_bytes(const Config& c, DType dt, int64_t N) {
  const int64_t D = c.hidden_size, R = c.qkvg_rows(), HV = c.v_dim(), F = c.ffn_size;
  return Arena::planned_bytes({{"dx", dt, {N, D}},
                               {"dtmp", dt, {N, D}},
                               {"du", dt, {N, D}},
                               {"dc", dt, {N, D}},
                               {"dqkvg", dt, {N, R}},
                               {"do", dt, {N, HV}},
                               {"dy", dt, {N, HV}},
                               {"dz", dt, {N, D}},
                               {"dab", dt, {N, 2 * F}},
                               {"dh", dt, {N, F}}});
}

double gb(size_t b) { return static_cast<double>(b) / 1e9; }

}  // namespace

PlanOptions training_plan_options(const MemoryPlan& p) {
  PlanOptions o;
  o.max_batch = p.batch;
  o.max_seq = p.seq;
  o.training = true;
  o.recompute_mixer = p.recompute_mixer;
  o.recompute_layers = p.recompute_layers;
  return o;
}

size_t fp8_training_bytes(const Config& c, int64_t N) {
  const std::vector<std::vector<TensorSpec>> arenas = Model::fp8_training_specs(c, N);
  size_t b = 0;
  for (const auto& a : arenas) b += Arena::planned_bytes(a);
  return b;
}

const char* recompute_name(int recompute) {
  switch (recompute) {
    case kRecomputeNone: return "none";
    case kRecomputeMixer: return "mixer";
    case kRecomputeLayers: return "layers";
    default: return "auto";
  }
}

MemoryPlan memory_plan_for(const Config& c, const MemoryPlanRequest& r, int64_t batch, int recompute) {
  LAPLACE_CHECK(recompute >= kRecomputeNone && recompute <= kRecomputeLayers, "memory_plan_for: bad recompute mode");
  const bool mixed = r.dtype == DType::kBF16;
  const DType param_dtype = mixed ? DType::kF32 : r.dtype;
  MemoryPlan p;
  p.batch = batch;
  p.seq = r.seq;
  p.grad_accum = r.grad_accum;
  p.recompute_mixer = recompute == kRecomputeMixer;
  p.recompute_layers = recompute == kRecomputeLayers;
  p.dtype = r.dtype;
  p.device_bytes = r.device_bytes;
  p.reserve_bytes = r.reserve_bytes;
  p.weights = Arena::planned_bytes(weight_specs(c, r.dtype));
  p.gradients = Arena::planned_bytes(weight_specs(c, param_dtype));
  if (r.sharded) {
    p.ranks = r.ranks;
    p.masters = r.sharded->masters;
    p.gradients += r.sharded->gradients;
    p.optimizer = r.sharded->optimizer;
    p.staging = r.sharded->staging;
    p.init_table = r.sharded->init_table;
  } else {
    p.masters = mixed ? Arena::planned_bytes(weight_specs(c, DType::kF32)) : 0;
    p.optimizer = optimizer_bytes(c, param_dtype, r.muon_fused, r.ns_bf16 && mixed);
  }
  p.activations = activation_bytes(c, r.dtype, batch, r.seq, recompute);
  p.fp8 = r.fp8 ? fp8_training_bytes(c, batch * r.seq) : 0;
  p.backward_scratch = backward_scratch_bytes(c, r.dtype, batch * r.seq);
  return p;
}

Status choose_memory_plan(const Config& c, const MemoryPlanRequest& r, MemoryPlan* out) {
  if (r.seq < 1) return Status::invalid_argument("memory plan: seq must be ≥ 1");
  if (r.batch < 0 || r.grad_accum < 1 || r.tokens_per_step < 0 || r.max_batch < 1)
    return Status::invalid_argument("memory plan: batch ≥ 0, grad-accum ≥ 1, tokens-per-step ≥ 0 and max batch ≥ 1");
  int64_t seqs = 0;  // sequences per step when a token target is given
  if (r.tokens_per_step > 0) {
    if (r.tokens_per_step % r.seq != 0)
      return Status::invalid_argument("tokens per step (" + std::to_string(r.tokens_per_step) +
                                      ") must be a multiple of seq (" + std::to_string(r.seq) + ")");
    seqs = r.tokens_per_step / r.seq;
    if (r.batch > 0 && seqs % r.batch != 0)
      return Status::invalid_argument("tokens per step / seq = " + std::to_string(seqs) +
                                      " sequences is not a multiple of the micro-batch " + std::to_string(r.batch));
  }
  std::vector<int64_t> batches;
  if (r.batch > 0) {
    batches = {r.batch};
  } else {
    int64_t top = 1;
    while (top * 2 <= r.max_batch) top *= 2;
    for (int64_t b = top; b >= 1; b /= 2)
      if (seqs == 0 || (b <= seqs && seqs % b == 0)) batches.push_back(b);
  }
  if (r.recompute < kRecomputeChoose || r.recompute > kRecomputeLayers)
    return Status::invalid_argument("memory plan: recompute must be -1 (choose), 0 (none), 1 (mixer) or 2 (layers)");
  // The candidates (B, recompute) in order: every B with recompute off, then the mixer's; then,
  // if allowed, every B with full-layer recompute (about one more forward per step, which costs
  // more than a smaller B's GEMMs lose, so it comes only once nothing else fits).
  std::vector<std::pair<int64_t, int>> candidates;
  if (r.recompute != kRecomputeChoose) {
    for (int64_t b : batches) candidates.push_back({b, r.recompute});
  } else {
    for (int64_t b : batches)
      for (int rc : {kRecomputeNone, kRecomputeMixer}) candidates.push_back({b, rc});
    if (r.allow_recompute_layers)
      for (int64_t b : batches) candidates.push_back({b, kRecomputeLayers});
  }
  std::vector<std::string> rejected;
  for (const auto& [b, rc] : candidates) {
    MemoryPlanRequest rr = r;
    if (seqs > 0) rr.grad_accum = seqs / b;
    MemoryPlan p = memory_plan_for(c, rr, b, rc);
    if (p.fits()) {
      p.chosen = r.batch == 0 || r.recompute == kRecomputeChoose;
      p.rejected = std::move(rejected);
      *out = std::move(p);
      return Status::ok();
    }
    char line[160];
    std::snprintf(line, sizeof line, "B=%lld recompute %s: %.2f GB + %.2f GB reserve > %.2f GB", (long long)b,
                  rc == kRecomputeNone ? "off" : rc == kRecomputeMixer ? "on" : "layers", gb(p.total()),
                  gb(r.reserve_bytes), gb(r.device_bytes));
    rejected.push_back(line);
  }
  std::string msg = "memory plan: nothing fits at T=" + std::to_string(r.seq) + ":";
  for (const std::string& s : rejected) msg += "\n  " + s;
  return Status::out_of_memory(msg + "\n  (try a smaller --seq, --recompute-mixer, --recompute-layers or a smaller "
                                     "--reserve-gib)");
}

std::string format_memory_plan(const MemoryPlan& p, const std::string& device_label) {
  const bool mixed = p.dtype == DType::kBF16;
  std::string wdt = dtype_name(p.dtype);
  for (char& ch : wdt) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  const std::string pdt = mixed ? "f32" : wdt;
  std::string s;
  char line[256];
  std::snprintf(line, sizeof line,
                "memory plan: T=%lld, micro-batch B=%lld%s, grad accumulation %lld (%lld tokens/step%s), %s\n",
                (long long)p.seq, (long long)p.batch, p.chosen ? " (chosen)" : "", (long long)p.grad_accum,
                (long long)p.tokens_per_step(), p.ranks > 0 ? " per rank" : "",
                p.recompute_layers  ? "recompute_layers on"
                : p.recompute_mixer ? "recompute_mixer on"
                                    : "recompute_mixer off");
  s += line;
  auto row = [&](const std::string& name, size_t bytes) {
    std::snprintf(line, sizeof line, "  %-34s %14zu bytes %9.3f GB\n", name.c_str(), bytes, gb(bytes));
    s += line;
  };
  row(std::string("weights (") + wdt + ")", p.weights);
  const std::string shard = p.ranks > 0 ? ", shard of " + std::to_string(p.ranks) : "";
  if (p.ranks > 0) row("master weights (" + pdt + shard + ")", p.masters);
  else if (mixed) row("master weights (f32)", p.masters);
  row(std::string("gradients (") + pdt + (p.ranks > 0 ? ", local + shard" : "") + ")", p.gradients);
  row(p.ranks > 0 ? "optimizer state (" + shard.substr(2) + ")" : "optimizer state (Muon, AdamW, NS)", p.optimizer);
  row(std::string("activations") + (p.recompute_layers  ? " (layers recomputed)"
                                     : p.recompute_mixer ? " (GLA output recomputed)"
                                                         : ""),
      p.activations);
  row("backward scratch", p.backward_scratch);
  if (p.fp8 > 0) row("FP8 codes and operands", p.fp8);
  if (p.ranks > 0) row("collective staging", p.staging);
  if (p.init_table > 0) row("initial weights (" + pdt + ", setup only)", p.init_table);
  row("total", p.total());
  if (p.device_bytes > 0) {
    std::snprintf(line, sizeof line, "  of %.3f GB %s memory available (reserve %.3f GB): %.3f GB left\n",
                  gb(p.device_bytes), device_label.c_str(), gb(p.reserve_bytes),
                  p.total() <= p.device_bytes ? gb(p.device_bytes - p.total()) : -gb(p.total() - p.device_bytes));
  } else {
    std::snprintf(line, sizeof line, "  %s memory size unknown\n", device_label.c_str());
  }
  s += line;
  return s;
}

}  // namespace laplace
