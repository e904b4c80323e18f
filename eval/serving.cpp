#include "eval/serving.h"

#include <algorithm>
#include <cmath>
#include <sstream>

#include "core/rng.h"
#include "eval/stream.h"
#include "model/state.h"
#include "serve/generate.h"

namespace laplace {

Status parse_serving_options(const std::string& list, std::vector<ServingOption>* out) {
  std::vector<ServingOption> v;
  std::stringstream ss(list);
  for (std::string item; std::getline(ss, item, ',');) {
    if (item.empty()) continue;
    ServingOption o;
    o.name = item;
    if (item == "bf16-weights") {
      o.low_weights = true;
    } else if (item == "bf16-states") {
      o.low_weights = true;
      o.states = DType::kBF16;
    } else if (item == "fp8-weights") {
      o.fp8_weights = true;
    } else if (item == "fp8" || item == "fp8-fast" || item == "fp8-head" || item == "fp8-fast-head") {
      o.fp8_compute = true;
      o.fp8_fast = item.rfind("fp8-fast", 0) == 0;
      o.fp8_head = item.size() > 5 && item.compare(item.size() - 5, 5, "-head") == 0;
    } else if (item.rfind("defer", 0) == 0) {
      const std::string r = item.substr(5);
      const bool digits = !r.empty() && r.size() <= 3 && std::all_of(r.begin(), r.end(), ::isdigit);
      o.defer = digits ? std::stoll(r) : -1;
      if (!PendingSpec::supported(o.defer))
        return Status::invalid_argument("serving option '" + item + "': deferred write-back takes R = 4, 8 or 16");
    } else {
      return Status::invalid_argument("unknown serving option '" + item +
                                      "' (bf16-weights, bf16-states, fp8-weights, fp8, fp8-fast, fp8-head, "
                                      "fp8-fast-head, defer4, defer8, defer16)");
    }
    v.push_back(o);
  }
  if (v.empty()) return Status::invalid_argument("no serving options given");
  *out = std::move(v);
  return Status::ok();
}

namespace {

// −log softmax(l)[target], in double: the options' loss differences go down to 1e-8 nats, below
// the F32 log-probability serve/sampler.h's token_logprobs returns.
double nll(const float* l, int64_t V, int32_t target) {
  const float mx = *std::max_element(l, l + V);
  double s = 0;
  for (int64_t i = 0; i < V; ++i) s += std::exp(static_cast<double>(l[i]) - mx);
  return std::log(s) + mx - l[target];
}

Status plan_for(Model& m, const ServingOptionsRun& run) {
  PlanOptions po;
  po.max_batch = run.prompts;
  po.max_seq = run.prompt_len;
  po.max_tokens = run.prompts * run.prompt_len;
  po.max_logit_rows = run.prompts;
  return m.plan(po);
}

}  // namespace

Status eval_serving_options(Model& ref, Model* low, Model* fp8, Model* fp8c, const std::vector<int32_t>& heldout,
                            const std::vector<ServingOption>& options, const ServingOptionsRun& run,
                            const std::function<void(const ServingAccuracy&)>& each) {
  if (run.prompts < 1 || run.prompt_len < 1 || run.steps < 1)
    return Status::invalid_argument("serving options: --prompts, --prompt-len and --steps must be at least 1");
  const Config& c = ref.config();
  const int64_t V = c.vocab_size, P = run.prompts, W = run.prompt_len + run.steps + 1;
  if (static_cast<int64_t>(heldout.size()) <= W)
    return Status::invalid_argument("serving options: windows of " + std::to_string(W) + " tokens need more held-out "
                                    "text than the " + std::to_string(heldout.size()) + " tokens given");
  for (const ServingOption& o : options) {
    if (o.low_weights && !low)
      return Status::invalid_argument("serving option '" + o.name + "' needs the bf16 weights (--device cuda)");
    if (o.fp8_weights && !fp8) return Status::invalid_argument("serving option '" + o.name + "' needs the FP8 weights");
    if (o.fp8_compute && (!fp8c || !fp8c->fp8_weights()))
      return Status::invalid_argument("serving option '" + o.name + "' needs a model computing with FP8 weights");
  }
  // The windows: P seeded offsets into the held-out text.
  std::vector<int32_t> win(static_cast<size_t>(P * W));
  SplitMix64 rng{splitmix64_hash(run.seed)};
  for (int64_t p = 0; p < P; ++p) {
    const int64_t off = static_cast<int64_t>(rng.below(heldout.size() - static_cast<uint64_t>(W)));
    std::copy_n(heldout.data() + off, W, win.data() + p * W);
  }
  std::vector<int32_t> prompts(static_cast<size_t>(P * run.prompt_len)), next(static_cast<size_t>(P));
  for (int64_t p = 0; p < P; ++p) std::copy_n(win.data() + p * W, run.prompt_len, prompts.data() + p * run.prompt_len);
  LAPLACE_RETURN_IF_ERROR(plan_for(ref, run));
  if (low) LAPLACE_RETURN_IF_ERROR(plan_for(*low, run));
  if (fp8) LAPLACE_RETURN_IF_ERROR(plan_for(*fp8, run));
  if (fp8c) LAPLACE_RETURN_IF_ERROR(plan_for(*fp8c, run));
  const DType ref_states = ref.dtype() == DType::kF64 ? DType::kF64 : DType::kF32;

  // The fp8 options share fp8c, each with its accumulation and head; fp8c gets its own back at
  // the end.
  struct Fp8ChoiceRestore {
    Model* m;
    bool fast, head;
    ~Fp8ChoiceRestore() {
      if (!m) return;
      m->set_fp8_fast_forward(fast);
      (void)m->set_fp8_head(head);  // turning back to a state it was in cannot fail
    }
  } restore{fp8c, fp8c && fp8c->fp8_fast_forward(), fp8c && fp8c->fp8_head()};
  for (const ServingOption& o : options) {
    Model& tm = o.fp8_compute ? *fp8c : o.fp8_weights ? *fp8 : o.low_weights ? *low : ref;
    if (o.fp8_compute) {
      fp8c->set_fp8_fast_forward(o.fp8_fast);
      LAPLACE_RETURN_IF_ERROR(fp8c->set_fp8_head(o.fp8_head).with_context("serving option '" + o.name + "'"));
    }
    StatePool pref, ptest;
    LAPLACE_RETURN_IF_ERROR(pref.create(c, ref.backend(), P, ref_states));
    const DType test_states = o.states == DType::kBF16 ? DType::kBF16 : (tm.dtype() == DType::kF64 ? DType::kF64 : DType::kF32);
    LAPLACE_RETURN_IF_ERROR(ptest.create(c, tm.backend(), P, test_states, {o.defer, tm.dtype()}));
    ForwardOptions pre;
    pre.last_logits_only = true;
    ref.forward(prompts.data(), P, run.prompt_len, pre, &pref);
    tm.forward(prompts.data(), P, run.prompt_len, pre, &ptest);
    ForwardOptions dec;
    dec.form = GlaForm::kRecurrent;
    dec.last_logits_only = true;
    ServingAccuracy r;
    r.option = o.name;
    std::vector<float> lr, lt;
    double sum_ref = 0, sum_opt = 0, sum_err = 0;
    int64_t agree = 0;
    for (int64_t t = 0; t < run.steps; ++t) {
      for (int64_t p = 0; p < P; ++p) next[static_cast<size_t>(p)] = win[static_cast<size_t>(p * W + run.prompt_len + t)];
      ref.forward(next.data(), P, 1, dec, &pref);
      logits_rows_to_host(ref, 0, P, &lr);
      tm.forward(next.data(), P, 1, dec, &ptest);
      logits_rows_to_host(tm, 0, P, &lt);
      const double e = logits_rel_rms(lt, lr);
      sum_err += e;
      r.logit_relrms_max = std::max(r.logit_relrms_max, e);
      for (int64_t p = 0; p < P; ++p) {
        const int32_t target = win[static_cast<size_t>(p * W + run.prompt_len + t + 1)];
        const float* a = lr.data() + p * V;
        const float* b = lt.data() + p * V;
        sum_ref += nll(a, V, target);
        sum_opt += nll(b, V, target);
        if (argmax_row(a, V) == argmax_row(b, V)) ++agree;
        else if (r.first_disagreement < 0) r.first_disagreement = t;
      }
    }
    r.positions = P * run.steps;
    const double n = static_cast<double>(r.positions);
    r.ref_loss = sum_ref / n;
    r.option_loss = sum_opt / n;
    r.agreement = static_cast<double>(agree) / n;
    r.logit_relrms_mean = sum_err / static_cast<double>(run.steps);
    if (each) each(r);
  }
  return Status::ok();
}

}  // namespace laplace
