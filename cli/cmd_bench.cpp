// `laplace bench decode|prefill|serve|http`: the engine's throughput and latency, and the
// server's through HTTP.
//
//   laplace bench decode  --config F | --model DIR [--device cpu|cuda] [--dtype f32|bf16]
//                         --batch N --steps S --prompt-len P [--layers-sweep]
//                         [--state-dtype f32|bf16] [--eager] [--defer-writeback R] [--accuracy-steps K]
//                         [--compare-prompt-len P2 (then P again: the baseline)] [--no-pipeline]
//                         [--speculative ngram[:K] (and the same decode without: the speed-up)]
//   laplace bench prefill --config F | --model DIR --prompt-len P [--reps R]
//   laplace bench serve   --config F | --model DIR --rate R --count N --prompt-len P
//                         --output-len O [--max-slots S | --memory-budget B]
//   laplace bench http    --port N [--host H] --streams S --prompt-len P --max-tokens M
//                         (a running `laplace serve`; bench/http_load.h)
//
// On CUDA, decode replays CUDA graphs captured when the engine is created (--eager: the
// same kernels and padded widths without graphs).
// Without a checkpoint the weights are random (--seed). Every figure is printed and
// appended as one JSON line to --results (default bench/results.jsonl):
//   {"bench": NAME, "value": X, "unit": U, "device": ..., "commit": ..., "date": ISO, "note": ...}
// Names get "_" + --tag appended when a tag is given (e.g. --tag 3b_1280_fp32state gives
// decode_tok_s_3b_1280_fp32state).
#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "bench/bench_log.h"
#include "bench/http_load.h"
#include "cli/common.h"
#include "core/file_util.h"
#include "eval/stream.h"
#include "model/config.h"
#include "serve/engine.h"

#ifdef LAPLACE_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace laplace::cli {

namespace {

// ---- results -----------------------------------------------------------------------------

// Free device memory minus a reserve (CUDA), for deriving the slot count.
Status device_state_budget(const std::string& device, int64_t reserve, int64_t* budget) {
#ifdef LAPLACE_HAVE_CUDA
  if (device == "cuda") {
    size_t free_b = 0, total_b = 0;
    if (cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) return Status::unsupported("cudaMemGetInfo failed");
    *budget = std::max<int64_t>(static_cast<int64_t>(free_b) - reserve, 0);
    std::printf("device memory: %.2f GiB free of %.2f GiB; %.2f GiB reserved; %.2f GiB for states\n",
                free_b / 1073741824.0, total_b / 1073741824.0, reserve / 1073741824.0, *budget / 1073741824.0);
    return Status::ok();
  }
#endif
  (void)reserve;
  return Status::invalid_argument("on " + device + " give --max-slots or --memory-budget");
}

std::vector<int32_t> random_prompt(Rng& rng, int64_t n, int64_t V) {
  std::vector<int32_t> p(static_cast<size_t>(n));
  for (auto& t : p) t = static_cast<int32_t>(rng.next() % static_cast<uint64_t>(V));
  return p;
}

// A model from the args; `layers` > 0 overrides num_layers (random weights then).
Status make_model(const ModelArgs& a, uint64_t seed, int64_t layers, LoadedModel* out, bool* random_weights) {
  ModelArgs r = a;
  LAPLACE_RETURN_IF_ERROR(r.resolve());
  Config cfg;
  LAPLACE_RETURN_IF_ERROR(config_load(r.config, &cfg));
  if (layers > 0) cfg.num_layers = layers;
  DType dt;
  LAPLACE_RETURN_IF_ERROR(parse_dtype(r.dtype, &dt));
  LAPLACE_RETURN_IF_ERROR(make_backend(r.device, &out->backend));
  LAPLACE_RETURN_IF_ERROR(out->model.create(cfg, *out->backend, dt));
  *random_weights = r.ckpt.empty() || layers > 0;
  if (!*random_weights) {
    LAPLACE_RETURN_IF_ERROR(load_weights(r.ckpt, r.weights, &out->model));
  } else {
    out->model.init_weights(seed);
    LAPLACE_RETURN_IF_ERROR(apply_weights_option(r.weights, &out->model));
  }
  return apply_fp8_options(r, &out->model);
}

// The figures' note: the shape, the dtype (with FP8 body matrices, "bf16 + fp8 weights") and
// whether the weights are random.
std::string shape_note(const Config& c, const LoadedModel& lm, const std::string& dtype, bool random) {
  char buf[256];
  std::snprintf(buf, sizeof buf, "L%lld D%lld H%lld dk%lld dv%lld F%lld V%lld %s%s%s%s", (long long)c.num_layers,
                (long long)c.hidden_size, (long long)c.num_heads, (long long)c.head_k_dim, (long long)c.head_v_dim,
                (long long)c.ffn_size, (long long)c.vocab_size, dtype.c_str(),
                lm.model.fp8_weights() ? (lm.model.fp8_fast_forward() ? " + fp8 weights (fast accumulation)"
                                                                      : " + fp8 weights")
                                       : "",
                lm.model.fp8_head() ? " + fp8 LM head" : "", random ? " random weights" : "");
  return buf;
}

// 2048 -> "2k", 8192 -> "8k", 1000 -> "1000" (figure names).
std::string short_count(int64_t n) {
  return n % 1024 == 0 ? std::to_string(n / 1024) + "k" : std::to_string(n);
}

// ---- bench decode ------------------------------------------------------------------------

struct DecodeArgs {
  ModelArgs model;
  int64_t batch = 8, steps = 32, prompt_len = 64, warmup = 2;
  int64_t prefill_chunk = 256, max_batch_tokens = 0;
  uint64_t seed = 1234;
  bool layers_sweep = false;
  int64_t sweep_max_layers = 0;
  std::string state_dtype = "f32";
  bool eager = false;
  bool no_pipeline = false;
  int64_t defer_writeback = 0;
  int64_t prefill_graphs = 16;
  int64_t accuracy_steps = 0;
  int64_t compare_prompt_len = 0;
  std::string speculative = "off";
  int64_t spec_reps = 5;
  std::string results = "bench/results.jsonl", tag;
};

struct DecodeFigures {
  double ms_per_step = 0, tok_s = 0, prefill_tok_s = 0;
  double forward_ms = 0, host_ms = 0;  // per step: the executor's decode call; sampling/emitting
  double chain_ms = 0;                  // per step: of forward_ms, queueing the next step (pipeline)
  // Speculative decoding: tokens emitted per decode forward, and the share of drafted tokens accepted.
  double tokens_per_forward = 1, accept_rate = 0;
};

// Prefills `batch` sequences through the engine, then times `steps` engine steps in
// which all of them decode (one batched forward each, sampling included).
Status measure_decode(Model& m, const DecodeArgs& a, bool print_summary, DecodeFigures* f) {
  EngineOptions o;
  LAPLACE_RETURN_IF_ERROR(
      engine_decode_options(a.model.device, a.state_dtype, a.eager, a.defer_writeback, a.prefill_graphs, &o));
  o.pipeline = !a.no_pipeline;
  LAPLACE_RETURN_IF_ERROR(speculative_options(a.speculative, &o));
  if (!a.model.dir.empty()) o.draft_tokenizer = a.model.dir + "/tokenizer.model";
  o.max_slots = a.batch;
  o.prefill_chunk = std::min(a.prefill_chunk, a.prompt_len);
  o.max_batch_tokens = a.max_batch_tokens > 0 ? a.max_batch_tokens : a.batch + 4 * o.prefill_chunk;
  std::unique_ptr<Engine> eng;
  LAPLACE_RETURN_IF_ERROR(Engine::create(m, o, &eng));
  if (print_summary) std::printf("%s\n", eng->summary().c_str());
  Rng rng(a.seed);
  for (int64_t i = 0; i < a.batch; ++i) {
    Request r;
    r.prompt = random_prompt(rng, a.prompt_len, m.config().vocab_size);
    r.sampling.temperature = 0;
    // Sequences prefilled early decode while later ones still prefill (at least one
    // prefill piece runs per step), so the token allowance covers that phase too.
    r.max_tokens = a.warmup + a.steps + 2 + (a.batch * a.prompt_len + o.prefill_chunk - 1) / o.prefill_chunk;
    r.max_tokens *= 1 + o.speculative_k;  // a speculative step emits up to k + 1 tokens
    r.eos_id = -1;
    RequestId id;
    LAPLACE_RETURN_IF_ERROR(eng->submit(std::move(r), &id));
  }
  const int64_t prompt_total = a.batch * a.prompt_len;
  const double p0 = eng->now();
  while (eng->stats().prefill_tokens < prompt_total) eng->step();
  const double prefill_s = eng->now() - p0;
  for (int64_t i = 0; i < a.warmup; ++i) eng->step();
  const EngineStats before = eng->stats();
  const double t0 = eng->now();
  // Each step() returns once its tokens are emitted. With pipelined decode the next step's
  // forward is already queued then, as one was when t0 was read: the window holds `steps`
  // step intervals of the steady state (waiting for the queued one would add a step).
  for (int64_t i = 0; i < a.steps; ++i) eng->step();
  const double secs = eng->now() - t0;
  const EngineStats after = eng->stats();
  if (after.decode_forwards - before.decode_forwards != a.steps ||
      after.decode_tokens - before.decode_tokens != a.steps * a.batch)
    return Status::invalid_argument("bench decode: timed steps were not all full decode steps");
  f->ms_per_step = 1e3 * secs / static_cast<double>(a.steps);
  f->forward_ms = 1e3 * (after.decode_seconds - before.decode_seconds) / static_cast<double>(a.steps);
  f->host_ms = 1e3 * (after.sample_seconds - before.sample_seconds) / static_cast<double>(a.steps);
  f->chain_ms = 1e3 * (after.chain_seconds - before.chain_seconds) / static_cast<double>(a.steps);
  // Tokens emitted (a speculative step emits one or more per sequence).
  const int64_t emitted = after.generated_tokens - before.generated_tokens;
  f->tok_s = static_cast<double>(emitted) / secs;
  f->tokens_per_forward = static_cast<double>(emitted) / static_cast<double>(a.steps * a.batch);
  const int64_t drafted = after.drafted_tokens - before.drafted_tokens;
  f->accept_rate = drafted > 0 ? static_cast<double>(after.accepted_tokens - before.accepted_tokens) / drafted : 0;
  f->prefill_tok_s = static_cast<double>(prompt_total) / prefill_s;
  return Status::ok();
}

// BF16 or deferred-write-back states against F32 states written back every step (SPEC §3's
// accuracy cost): `rows` sequences prefilled with the same random prompts into an F32 pool
// and a test pool (test_dtype, write-back every test_defer-th step), then `steps` decode
// steps fed, in both pools, the token the F32 states choose greedily (teacher forcing, so
// the two runs see the same inputs). Per step: do the two argmaxes agree, and the relative
// RMS error of the test pool's logits against the F32 ones.
struct AccuracyFigures {
  double agreement_pct = 0, logit_relrms_mean = 0, logit_relrms_max = 0;
  int64_t first_disagreement = -1;  // step of the first disagreeing row (-1: none)
};

Status measure_state_accuracy(Model& m, int64_t rows, int64_t prompt_len, int64_t steps, uint64_t seed,
                              DType test_dtype, int64_t test_defer, AccuracyFigures* f) {
  const Config& c = m.config();
  Backend& be = m.backend();
  PlanOptions po;
  po.max_batch = rows;
  po.max_seq = prompt_len;
  po.max_tokens = std::max(rows, prompt_len);
  po.max_logit_rows = rows;
  LAPLACE_RETURN_IF_ERROR(m.plan(po));
  StatePool p32, ptest;
  LAPLACE_RETURN_IF_ERROR(p32.create(c, be, rows, DType::kF32));
  LAPLACE_RETURN_IF_ERROR(ptest.create(c, be, rows, test_dtype, {test_defer, m.dtype()}));
  Rng rng(seed);
  ForwardOptions pre;
  pre.last_logits_only = true;
  std::vector<int32_t> next(static_cast<size_t>(rows));
  std::vector<float> l32, ltest;
  auto argmax = [&](const std::vector<float>& l, int64_t r) {
    const float* x = l.data() + r * c.vocab_size;
    return static_cast<int32_t>(std::max_element(x, x + c.vocab_size) - x);
  };
  for (int64_t r = 0; r < rows; ++r) {
    const auto prompt = random_prompt(rng, prompt_len, c.vocab_size);
    const int32_t slot = static_cast<int32_t>(r);
    m.forward(prompt.data(), 1, prompt_len, pre, &p32, &slot);
    logits_rows_to_host(m, 0, 1, &l32);
    m.forward(prompt.data(), 1, prompt_len, pre, &ptest, &slot);
    next[r] = argmax(l32, 0);
  }
  ForwardOptions dec;
  dec.form = GlaForm::kRecurrent;
  dec.last_logits_only = true;
  int64_t agree = 0;
  double sum_err = 0;
  for (int64_t t = 0; t < steps; ++t) {
    m.forward(next.data(), rows, 1, dec, &p32);
    logits_rows_to_host(m, 0, rows, &l32);
    m.forward(next.data(), rows, 1, dec, &ptest);
    logits_rows_to_host(m, 0, rows, &ltest);
    const double e = logits_rel_rms(ltest, l32);
    sum_err += e;
    f->logit_relrms_max = std::max(f->logit_relrms_max, e);
    for (int64_t r = 0; r < rows; ++r) {
      const int32_t a32 = argmax(l32, r), atest = argmax(ltest, r);
      if (a32 == atest) ++agree;
      else if (f->first_disagreement < 0) f->first_disagreement = t;
      next[r] = a32;
    }
  }
  f->agreement_pct = 100.0 * static_cast<double>(agree) / static_cast<double>(rows * steps);
  f->logit_relrms_mean = sum_err / static_cast<double>(std::max<int64_t>(steps, 1));
  return Status::ok();
}

Status run_bench_decode(const DecodeArgs& a) {
  LoadedModel lm;
  bool random = false;
  LAPLACE_RETURN_IF_ERROR(make_model(a.model, a.seed, 0, &lm, &random));
  const Config& c = lm.model.config();
  BenchLog res{a.results, device_description(a.model.device), BenchLog::commit_hash(), BenchLog::iso_date_utc(), a.tag, "", BenchLog::command_line()};
  char note[512];
  std::snprintf(note, sizeof note, "bench decode: %s, batch %lld, prompt %lld, %lld steps",
                shape_note(c, lm, a.model.dtype, random).c_str(), (long long)a.batch, (long long)a.prompt_len,
                (long long)a.steps);
  res.note = note;
  DecodeFigures f;
  LAPLACE_RETURN_IF_ERROR(measure_decode(lm.model, a, true, &f));
  std::printf("decode: batch %lld after %lld-token prompts: %.3f ms/step, %.1f tokens/s (prefill %.1f tokens/s)\n"
              "  per step: %.3f ms in the decode forward (inputs, forward, argmax, ids back; of it %.3f ms queueing the "
              "next step), %.3f ms emitting tokens\n",
              (long long)a.batch, (long long)a.prompt_len, f.ms_per_step, f.tok_s, f.prefill_tok_s, f.forward_ms,
              f.chain_ms, f.host_ms);
  if (a.speculative != "off") {
    // The same decode without speculation (same prompts, options and R): the speed-up is the
    // ratio of emitted tokens per second; greedy tokens are the same either way. Runs with and
    // without alternate, --spec-reps pairs, and the medians are compared, so that a shared
    // machine's load hits both alike.
    DecodeArgs b = a;
    b.speculative = "off";
    std::vector<double> with, without;
    for (int64_t r = 0; r < a.spec_reps; ++r) {
      DecodeFigures g = f, base;
      if (r > 0) LAPLACE_RETURN_IF_ERROR(measure_decode(lm.model, a, false, &g));
      LAPLACE_RETURN_IF_ERROR(measure_decode(lm.model, b, false, &base));
      std::printf("  pair %lld: %.1f tokens/s with, %.1f without (x%.3f)\n", (long long)r, g.tok_s, base.tok_s,
                  g.tok_s / base.tok_s);
      with.push_back(g.tok_s);
      without.push_back(base.tok_s);
    }
    auto median = [](std::vector<double> v) {
      std::sort(v.begin(), v.end());
      const size_t n = v.size();
      return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
    };
    const double ws = median(with), wo = median(without), speedup = ws / wo;
    std::printf("speculative %s: %.2f tokens per sequence and forward, %.1f%% of drafted tokens accepted; "
                "median %.1f tokens/s against %.1f without over %lld pairs: x%.3f\n",
                a.speculative.c_str(), f.tokens_per_forward, 100.0 * f.accept_rate, ws, wo, (long long)a.spec_reps,
                speedup);
    const std::string kind = a.speculative.substr(0, a.speculative.find(':'));
    const std::string dev = a.model.device == "cuda" ? "gpu" : a.model.device;
    res.note += ", " + a.speculative + ", median of " + std::to_string(a.spec_reps) + " alternating pairs";
    // spec_speedup_ngram_cpu_b1 and its companions: the drafter, the device and the batch.
    const std::string what = kind + "_" + dev + "_b" + std::to_string(a.batch);
    res.add("decode_spec_tok_s_" + what, ws, "tok/s");
    res.add("decode_nospec_tok_s_" + what, wo, "tok/s");
    res.add("decode_spec_tokens_per_forward_" + what, f.tokens_per_forward, "tok");
    res.add("decode_spec_accept_pct_" + what, 100.0 * f.accept_rate, "%");
    res.add("spec_speedup_" + what, speedup, "x");
    return Status::ok();
  }
  res.add("decode_tok_s", f.tok_s, "tok/s");
  res.add("decode_ms_per_step", f.ms_per_step, "ms");
  res.add("decode_prefill_tok_s", f.prefill_tok_s, "tok/s");

  if (a.compare_prompt_len > 0) {
    // The same decode after longer (or shorter) prompts: a fixed-size state makes the step
    // cost independent of the context length, so this should be ~0 (SPEC §3: +0.5% seed).
    // Then the first length again: at its power limit the card's clock drifts from run to run
    // by about as much as the bound, so the baseline is the mean of the runs before and after.
    DecodeArgs b = a;
    b.prompt_len = a.compare_prompt_len;
    DecodeFigures g, f2;
    LAPLACE_RETURN_IF_ERROR(measure_decode(lm.model, b, false, &g));
    LAPLACE_RETURN_IF_ERROR(measure_decode(lm.model, a, false, &f2));
    const double base = 0.5 * (f.ms_per_step + f2.ms_per_step);
    const double pct = 100.0 * (g.ms_per_step / base - 1.0);
    const double drift = 100.0 * (f2.ms_per_step / f.ms_per_step - 1.0);
    std::printf("decode after %lld-token prompts: %.3f ms/step, %.1f tokens/s: %+.3f%% per output token vs %lld-token "
                "prompts (%.3f ms/step before, %.3f after: %+.3f%%)\n",
                (long long)b.prompt_len, g.ms_per_step, g.tok_s, pct, (long long)a.prompt_len, f.ms_per_step,
                f2.ms_per_step, drift);
    res.add("decode_ms_per_step_prompt" + std::to_string(b.prompt_len), g.ms_per_step, "ms");
    res.add("decode_ms_per_step_prompt" + std::to_string(a.prompt_len), base, "ms");
    res.add("decode_baseline_drift_pct_prompt" + std::to_string(a.prompt_len), drift, "%");
    // The issue's name for this figure carries no tag: decode_cost_increase_pct_prompt2k_to_8k.
    BenchLog plain = res;
    plain.tag.clear();
    plain.add("decode_cost_increase_pct_prompt" + short_count(a.prompt_len) + "_to_" + short_count(b.prompt_len), pct,
              "%", res.note + (a.tag.empty() ? "" : ", tag " + a.tag));
  }
  if (a.accuracy_steps > 0) {
    const bool bf16 = a.state_dtype == "bf16";
    if (!bf16 && a.defer_writeback == 0)
      return Status::invalid_argument(
          "--accuracy-steps compares bf16 or deferred-write-back states with f32 ones: add --state-dtype bf16 or "
          "--defer-writeback R");
    const int64_t rows = std::min<int64_t>(a.batch, 64);
    AccuracyFigures acc;
    LAPLACE_RETURN_IF_ERROR(measure_state_accuracy(lm.model, rows, a.prompt_len, a.accuracy_steps, a.seed + 7,
                                                   bf16 ? DType::kBF16 : DType::kF32, a.defer_writeback, &acc));
    // bf16state, fp32state_defer8, bf16state_defer8: the names of the test pool's options.
    const std::string what = std::string(bf16 ? "bf16state" : "fp32state") +
                             (a.defer_writeback ? "_defer" + std::to_string(a.defer_writeback) : "");
    std::printf("%s vs f32 states, %lld sequences x %lld teacher-forced steps: argmax agreement %.2f%% (first "
                "disagreement at step %lld), logits rel RMS mean %.3g max %.3g\n",
                what.c_str(), (long long)rows, (long long)a.accuracy_steps, acc.agreement_pct,
                (long long)acc.first_disagreement, acc.logit_relrms_mean, acc.logit_relrms_max);
    res.add("decode_" + what + "_token_agreement_pct", acc.agreement_pct, "%");
    res.add("decode_" + what + "_logit_relrms_mean", acc.logit_relrms_mean, "");
    res.add("decode_" + what + "_logit_relrms_max", acc.logit_relrms_max, "");
  }

  if (!a.layers_sweep) return Status::ok();
  // Time per step over num_layers ∈ {1, 2, 4, ..., max} and the full model, then
  // ms = intercept + slope·L.
  const int64_t lmax = a.sweep_max_layers > 0 ? a.sweep_max_layers : c.num_layers;
  std::vector<int64_t> ls;
  for (int64_t l = 1; l <= lmax; l *= 2) ls.push_back(l);
  if (ls.back() != lmax) ls.push_back(lmax);
  if (ls.size() < 2 && ls.back() == c.num_layers)
    return Status::invalid_argument("--layers-sweep needs at least 2 layer counts (max layers ≥ 2)");
  // The full model's time, measured above, is a point of the fit too.
  std::vector<double> xs, ys;
  if (std::find(ls.begin(), ls.end(), c.num_layers) == ls.end()) {
    xs.push_back(static_cast<double>(c.num_layers));
    ys.push_back(f.ms_per_step);
    std::printf("  layers %3lld: %.3f ms/step (the run above)\n", (long long)c.num_layers, f.ms_per_step);
  }
  for (int64_t l : ls) {
    LoadedModel sm;
    bool r2 = false;
    LAPLACE_RETURN_IF_ERROR(make_model(a.model, a.seed, l, &sm, &r2));
    DecodeFigures g;
    LAPLACE_RETURN_IF_ERROR(measure_decode(sm.model, a, false, &g));
    std::printf("  layers %3lld: %.3f ms/step, %.1f tokens/s\n", (long long)l, g.ms_per_step, g.tok_s);
    res.add("decode_ms_per_step_L" + std::to_string(l), g.ms_per_step, "ms");
    xs.push_back(static_cast<double>(l));
    ys.push_back(g.ms_per_step);
  }
  const double n = static_cast<double>(xs.size());
  double sx = 0, sy = 0, sxx = 0, sxy = 0;
  for (size_t i = 0; i < xs.size(); ++i) sx += xs[i], sy += ys[i], sxx += xs[i] * xs[i], sxy += xs[i] * ys[i];
  const double slope = (n * sxy - sx * sy) / (n * sxx - sx * sx);
  const double intercept = (sy - slope * sx) / n;
  double ss_res = 0, ss_tot = 0;
  for (size_t i = 0; i < xs.size(); ++i) {
    const double e = ys[i] - (intercept + slope * xs[i]);
    ss_res += e * e;
    ss_tot += (ys[i] - sy / n) * (ys[i] - sy / n);
  }
  const double r2 = ss_tot > 0 ? 1 - ss_res / ss_tot : 1;
  std::printf("layers sweep fit: ms/step = %.4f + %.4f x layers (R^2 %.4f): fixed per-step overhead %.4f ms, "
              "per-layer cost %.4f ms\n",
              intercept, slope, r2, intercept, slope);
  res.add("decode_step_overhead_ms", intercept, "ms");
  res.add("decode_per_layer_ms", slope, "ms");
  return Status::ok();
}

// ---- bench prefill -----------------------------------------------------------------------

struct PrefillArgs {
  ModelArgs model;
  int64_t prompt_len = 8192, reps = 5, warmup = 1;
  uint64_t seed = 1234;
  std::string results = "bench/results.jsonl", tag;
};

// One prompt of prompt_len tokens through the chunked forward into a fresh state slot
// (last-token logits only), as the engine prefills a prompt given in one piece; the
// median of `reps` timed runs.
Status run_bench_prefill(const PrefillArgs& a) {
  LoadedModel lm;
  bool random = false;
  LAPLACE_RETURN_IF_ERROR(make_model(a.model, a.seed, 0, &lm, &random));
  Model& m = lm.model;
  const Config& c = m.config();
  PlanOptions po;
  po.max_batch = 1;
  po.max_seq = a.prompt_len;
  po.max_logit_rows = 1;
  LAPLACE_RETURN_IF_ERROR(m.plan(po));
  StatePool pool;
  LAPLACE_RETURN_IF_ERROR(pool.create(c, m.backend(), 1));
  Rng rng(a.seed);
  const auto prompt = random_prompt(rng, a.prompt_len, c.vocab_size);
  ForwardOptions fo;
  fo.last_logits_only = true;
  std::vector<double> ms;
  for (int64_t i = 0; i < a.warmup + a.reps; ++i) {
    pool.reset(m.backend(), 0);
    m.backend().synchronize();
    const auto t0 = std::chrono::steady_clock::now();
    m.forward(prompt.data(), 1, a.prompt_len, fo, &pool);
    m.backend().synchronize();
    const double t = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (i >= a.warmup) ms.push_back(t);
  }
  const double med = bench_percentile(ms, 50);
  BenchLog res{a.results, device_description(a.model.device), BenchLog::commit_hash(), BenchLog::iso_date_utc(), a.tag, "", BenchLog::command_line()};
  char note[512];
  std::snprintf(note, sizeof note, "bench prefill: %s, one %lld-token prompt, median of %lld", shape_note(c, lm, a.model.dtype, random).c_str(),
                (long long)a.prompt_len, (long long)a.reps);
  res.note = note;
  std::printf("prefill of %lld tokens: median %.2f ms (min %.2f), %.0f tokens/s\n", (long long)a.prompt_len, med,
              *std::min_element(ms.begin(), ms.end()), 1e3 * static_cast<double>(a.prompt_len) / med);
  // Names with the tag before the length and FP8 weights after it (prefill_ms_3b_t8192,
  // prefill_ms_3b_t8192_fp8, as the issues name them; _fp8fast with fast accumulation, then
  // _head with the LM head in FP8).
  const std::string mid = a.tag.empty() ? "" : a.tag + "_";
  const char* fp8 = !lm.model.fp8_weights() ? "" : lm.model.fp8_fast_forward() ? "_fp8fast" : "_fp8";
  const std::string len = "t" + std::to_string(a.prompt_len) + fp8 + (lm.model.fp8_head() ? "_head" : "");
  res.tag.clear();
  res.add("prefill_ms_" + mid + len, med, "ms");
  res.add("prefill_tok_s_" + mid + len, 1e3 * static_cast<double>(a.prompt_len) / med, "tok/s");
  return Status::ok();
}

// ---- bench serve -------------------------------------------------------------------------

struct ServeArgs {
  ModelArgs model;
  double rate = 4.0;  // requests per second
  bool burst = false;           // every request at t = 0
  std::string rates;            // a sweep: comma-separated rates
  double ttft_slo_ms = 300, tpot_slo_ms = 60;
  std::string out;              // the sweep's points (JSON lines)
  int64_t count = 32;
  int64_t prompt_len = 64, prompt_len_max = 0;  // uniform in [min, max] when max > min
  int64_t output_len = 32, output_len_max = 0;
  int64_t max_slots = 0;
  std::string memory_budget, memory_reserve = "4G";
  int64_t max_batch_tokens = 2048, prefill_chunk = 256;
  std::string batch_prefill = "auto";
  uint64_t seed = 1234;
  std::string results = "bench/results.jsonl", tag;
  std::string state_dtype = "f32";
  bool eager = false;
  int64_t defer_writeback = 0;
  int64_t prefill_graphs = 16;
};

struct ServeFigures {
  double span = 0;            // first arrival to last finish (s)
  double first_tokens_s = 0;  // first arrival to the last request's first token (s)
  int64_t out_tokens = 0, prompt_tokens = 0, max_running = 0, max_queued = 0, slots = 0;
  double ttft_p50 = 0, ttft_p99 = 0, tpot_p50 = 0, tpot_p99 = 0;  // ms
  EngineStats stats;
};

// `a.count` requests (lengths uniform, from a.seed) arriving as a Poisson process of `rate`
// per second (rate 0: all at once), through a fresh engine on `m` until the last finishes.
Status measure_serve(Model& m, const EngineOptions& o, const ServeArgs& a, double rate, bool print_summary,
                     ServeFigures* f) {
  const Config& c = m.config();
  std::unique_ptr<Engine> eng;
  LAPLACE_RETURN_IF_ERROR(Engine::create(m, o, &eng));
  if (print_summary) std::printf("%s\n", eng->summary().c_str());
  f->slots = eng->num_slots();
  Rng rng(a.seed);
  const int64_t pmax = std::max(a.prompt_len, a.prompt_len_max), omax = std::max(a.output_len, a.output_len_max);
  struct Arrival {
    double at;
    std::vector<int32_t> prompt;
    int64_t out;
  };
  std::vector<Arrival> arr;
  double t = 0;
  for (int64_t i = 0; i < a.count; ++i) {
    const double gap = -std::log(1.0 - rng.uniform());  // drawn in a burst too: the same prompts
    if (rate > 0) t += gap / rate;
    const int64_t pl = a.prompt_len + static_cast<int64_t>(rng.next() % static_cast<uint64_t>(pmax - a.prompt_len + 1));
    const int64_t ol = a.output_len + static_cast<int64_t>(rng.next() % static_cast<uint64_t>(omax - a.output_len + 1));
    arr.push_back({t, random_prompt(rng, pl, c.vocab_size), ol});
    f->prompt_tokens += pl;
  }

  std::vector<FinishInfo> done(static_cast<size_t>(a.count));
  std::vector<double> arrival_abs(static_cast<size_t>(a.count));
  const double start = eng->now();
  size_t next = 0;
  while (next < arr.size() || !eng->idle()) {
    const double now = eng->now() - start;
    while (next < arr.size() && arr[next].at <= now) {
      Request r;
      r.prompt = arr[next].prompt;
      r.max_tokens = arr[next].out;
      r.sampling.temperature = 0;
      r.eos_id = -1;
      const size_t k = next;
      r.on_finish = [&done, k](const FinishInfo& fi) { done[k] = fi; };
      RequestId id;
      LAPLACE_RETURN_IF_ERROR(eng->submit(std::move(r), &id));
      arrival_abs[k] = start + arr[k].at;
      ++next;
    }
    if (eng->idle()) {
      if (next < arr.size()) {
        const double wait = arr[next].at - (eng->now() - start);
        if (wait > 0) std::this_thread::sleep_for(std::chrono::duration<double>(wait));
      }
      continue;
    }
    eng->step();
    const EngineStats st = eng->stats();
    f->max_running = std::max(f->max_running, st.running);
    f->max_queued = std::max(f->max_queued, st.queued);
  }
  const double end = eng->now();
  std::vector<double> ttft, tpot;
  double last_finish = start, last_first = start;
  for (size_t i = 0; i < done.size(); ++i) {
    const FinishInfo& fi = done[i];
    f->out_tokens += fi.generated_tokens;
    last_finish = std::max(last_finish, fi.finish_time);
    if (fi.first_token_time >= 0) {
      ttft.push_back(1e3 * (fi.first_token_time - arrival_abs[i]));
      last_first = std::max(last_first, fi.first_token_time);
    }
    if (fi.tpot() >= 0) tpot.push_back(1e3 * fi.tpot());
  }
  if (static_cast<int64_t>(ttft.size()) != a.count)
    return Status::invalid_argument("bench serve: not every request produced a first token");
  f->span = std::max(last_finish, end) - start;
  f->first_tokens_s = last_first - start;
  f->ttft_p50 = bench_percentile(ttft, 50);
  f->ttft_p99 = bench_percentile(ttft, 99);
  f->tpot_p50 = bench_percentile(tpot, 50);
  f->tpot_p99 = bench_percentile(tpot, 99);
  f->stats = eng->stats();
  return Status::ok();
}

Status parse_rates(const std::string& s, std::vector<double>* out) {
  LAPLACE_RETURN_IF_ERROR(parse_number_list<double>(s, "--rates", out, "a positive rate",
                                                    [](double r) { return r > 0 && std::isfinite(r); }));
  std::sort(out->begin(), out->end());
  return Status::ok();
}

Status run_bench_serve(const ServeArgs& a) {
  if (a.burst && !a.rates.empty()) return Status::invalid_argument("give --burst or --rates, not both");
  std::vector<double> rates;
  if (!a.rates.empty()) LAPLACE_RETURN_IF_ERROR(parse_rates(a.rates, &rates));
  std::ofstream points;
  if (!a.out.empty()) {
    if (rates.empty()) return Status::invalid_argument("--out writes a sweep's points: add --rates");
    points.open(a.out, std::ios::trunc);
    if (!points) return Status::io_error("cannot write " + a.out);
  }
  LoadedModel lm;
  bool random = false;
  LAPLACE_RETURN_IF_ERROR(make_model(a.model, a.seed, 0, &lm, &random));
  const Config& c = lm.model.config();
  EngineOptions o;
  LAPLACE_RETURN_IF_ERROR(
      engine_decode_options(a.model.device, a.state_dtype, a.eager, a.defer_writeback, a.prefill_graphs, &o));
  o.max_slots = a.max_slots;
  o.max_batch_tokens = a.max_batch_tokens;
  o.prefill_chunk = a.prefill_chunk;
  o.batch_prefill = batch_prefill_value(a.batch_prefill);
  if (o.max_slots == 0) {
    if (!a.memory_budget.empty()) {
      LAPLACE_RETURN_IF_ERROR(parse_bytes(a.memory_budget, &o.memory_budget));
    } else {
      int64_t reserve = 0;
      LAPLACE_RETURN_IF_ERROR(parse_bytes(a.memory_reserve, &reserve));
      LAPLACE_RETURN_IF_ERROR(device_state_budget(a.model.device, reserve, &o.memory_budget));
    }
  }
  const int64_t pmax = std::max(a.prompt_len, a.prompt_len_max), omax = std::max(a.output_len, a.output_len_max);
  BenchLog res{a.results, device_description(a.model.device), BenchLog::commit_hash(), BenchLog::iso_date_utc(), a.tag, "", BenchLog::command_line()};
  auto note_for = [&](const std::string& arrivals, int64_t slots) {
    char note[640];
    std::snprintf(note, sizeof note,
                  "bench serve: %s, %lld requests %s, prompts %lld-%lld, outputs %lld-%lld, %lld slots, "
                  "max_batch_tokens %lld, prefill_chunk %lld, batch prefill %s",
                  shape_note(c, lm, a.model.dtype, random).c_str(), (long long)a.count, arrivals.c_str(),
                  (long long)a.prompt_len, (long long)pmax, (long long)a.output_len, (long long)omax, (long long)slots,
                  (long long)a.max_batch_tokens, (long long)a.prefill_chunk, a.batch_prefill.c_str());
    return std::string(note);
  };
  auto print = [&](const ServeFigures& f) {
    std::printf("serve: %lld requests in %.3f s (max %lld running, %lld queued); %lld steps, %lld prefill tokens in "
                "%lld forwards (%lld replayed from graphs, %lld captured), %lld decode tokens\n",
                (long long)a.count, f.span, (long long)f.max_running, (long long)f.max_queued, (long long)f.stats.steps,
                (long long)f.stats.prefill_tokens, (long long)f.stats.prefill_forwards,
                (long long)f.stats.prefill_graph_replays, (long long)f.stats.prefill_graph_captures,
                (long long)f.stats.decode_tokens);
    std::printf("serve: %.1f output tokens/s, %.3f requests/s; TTFT p50 %.3f ms p99 %.3f ms; TPOT p50 %.3f ms "
                "p99 %.3f ms\n",
                f.out_tokens / f.span, a.count / f.span, f.ttft_p50, f.ttft_p99, f.tpot_p50, f.tpot_p99);
  };

  if (a.burst) {
    ServeFigures f;
    LAPLACE_RETURN_IF_ERROR(measure_serve(lm.model, o, a, 0, true, &f));
    print(f);
    const double prefill_rate = static_cast<double>(f.prompt_tokens) / f.first_tokens_s;
    std::printf("burst: every first token out %.3f s after the burst (%.1f prompt tokens/s)\n", f.first_tokens_s,
                prefill_rate);
    res.note = note_for("at once (a burst)", f.slots);
    res.add("serve_burst_admit_s", f.first_tokens_s, "s");
    res.add("serve_burst_prefill_tok_s", prefill_rate, "tok/s");
    res.add("serve_burst_ttft_p99_ms", f.ttft_p99, "ms");
    return Status::ok();
  }
  if (!rates.empty()) {
    std::printf("%10s %10s %12s %12s %12s %12s %6s\n", "rate/s", "req/s", "TTFT p50", "TTFT p99", "TPOT p50",
                "TPOT p99", "SLO");
    double best = 0;
    int64_t slots = 0;
    for (size_t i = 0; i < rates.size(); ++i) {
      ServeFigures f;
      LAPLACE_RETURN_IF_ERROR(measure_serve(lm.model, o, a, rates[i], i == 0, &f));
      slots = f.slots;
      const bool ok = f.ttft_p99 <= a.ttft_slo_ms && f.tpot_p99 <= a.tpot_slo_ms;
      if (ok) best = std::max(best, rates[i]);
      std::printf("%10.3f %10.3f %12.3f %12.3f %12.3f %12.3f %6s\n", rates[i], a.count / f.span, f.ttft_p50,
                  f.ttft_p99, f.tpot_p50, f.tpot_p99, ok ? "met" : "missed");
      std::fflush(stdout);
      if (points.is_open()) {
        points << nlohmann::json{{"rate", rates[i]},          {"req_s", a.count / f.span},
                                 {"tok_s", f.out_tokens / f.span}, {"ttft_p50_ms", f.ttft_p50},
                                 {"ttft_p99_ms", f.ttft_p99},  {"tpot_p50_ms", f.tpot_p50},
                                 {"tpot_p99_ms", f.tpot_p99},  {"ttft_slo_ms", a.ttft_slo_ms},
                                 {"tpot_slo_ms", a.tpot_slo_ms}, {"slo_met", ok}}
                      .dump()
               << "\n";
        points.flush();
      }
    }
    if (points.is_open() && !points) return Status::io_error("cannot write " + a.out);
    if (best > 0)
      std::printf("sweep: the highest rate within TTFT p99 <= %.0f ms and TPOT p99 <= %.0f ms: %.3f requests/s\n",
                  a.ttft_slo_ms, a.tpot_slo_ms, best);
    else
      std::printf("sweep: no rate met TTFT p99 <= %.0f ms and TPOT p99 <= %.0f ms\n", a.ttft_slo_ms, a.tpot_slo_ms);
    char arrivals[160];
    std::snprintf(arrivals, sizeof arrivals, "per rate of %s/s (Poisson), SLO TTFT p99 <= %.0f ms, TPOT p99 <= %.0f ms",
                  a.rates.c_str(), a.ttft_slo_ms, a.tpot_slo_ms);
    res.note = note_for(arrivals, slots);
    res.add("serve_max_rate_req_s", best, "req/s");
    return Status::ok();
  }
  ServeFigures f;
  LAPLACE_RETURN_IF_ERROR(measure_serve(lm.model, o, a, a.rate, true, &f));
  print(f);
  char arrivals[64];
  std::snprintf(arrivals, sizeof arrivals, "at %.3g/s (Poisson)", a.rate);
  res.note = note_for(arrivals, f.slots);
  res.add("serve_poisson_tok_s", f.out_tokens / f.span, "tok/s");
  res.add("serve_poisson_req_s", static_cast<double>(a.count) / f.span, "req/s");
  res.add("serve_poisson_ttft_p50_ms", f.ttft_p50, "ms");
  res.add("serve_poisson_ttft_p99_ms", f.ttft_p99, "ms");
  res.add("serve_poisson_tpot_p50_ms", f.tpot_p50, "ms");
  res.add("serve_poisson_tpot_p99_ms", f.tpot_p99, "ms");
  return Status::ok();
}

struct HttpArgs {
  HttpLoadOptions load;
  std::string api_key_file, device_name, results = "bench/results.jsonl", tag;
  double compare_tok_s = 0;
};

Status run_bench_http(HttpArgs a) {
  if (!a.api_key_file.empty()) {
    LAPLACE_RETURN_IF_ERROR(read_file(a.api_key_file, &a.load.api_key).with_context("--api-key-file"));
    while (!a.load.api_key.empty() && std::isspace(static_cast<unsigned char>(a.load.api_key.back())))
      a.load.api_key.pop_back();
  }
  const HttpLoadOptions& o = a.load;
  std::printf("http: %d streams to %s:%d, prompts of %lld ids, %lld tokens each\n", o.streams, o.host.c_str(), o.port,
              (long long)o.prompt_len, (long long)o.max_tokens);
  std::fflush(stdout);
  HttpLoadResult r;
  LAPLACE_RETURN_IF_ERROR(run_http_load(o, &r));
  std::printf("http: %d ok (%d of them silent until their end), %d rejected (429), %d failed in %.2f s; %lld tokens\n",
              r.ok, r.silent, r.rejected, r.failed, r.wall_s, (long long)r.tokens);
  std::printf("http: decode %.0f tok/s over the streams (median stream %.1f tok/s x %d, overlap %.2f); TTFT p50 %.1f ms, "
              "p99 %.1f ms\n", r.decode_tok_s, r.stream_tok_s_p50, r.ok, r.overlap, r.ttft_p50_ms, r.ttft_p99_ms);
  if (r.failed > 0)
    return Status::io_error(std::to_string(r.failed) + " of " + std::to_string(r.streams) +
                            " streams failed (no figure recorded); the first: " + r.first_failure);
  if (r.ok == 0) return Status::io_error("no stream was accepted (all 429): no figure recorded");
  BenchLog res{a.results, a.device_name.empty() ? "unknown" : a.device_name, BenchLog::commit_hash(),
               BenchLog::iso_date_utc(), a.tag, "", BenchLog::command_line()};
  char note[384];
  std::snprintf(note, sizeof note,
                "%d concurrent streaming completions through laplace serve (HTTP/1.0, loopback), %lld-id prompts, "
                "%lld tokens each; median stream's decode rate x streams, overlap %.2f; %d ok (%d silent), %d rejected",
                r.streams, (long long)o.prompt_len, (long long)o.max_tokens, r.overlap, r.ok, r.silent, r.rejected);
  res.note = note;
  res.add("serve_http_tok_s", r.decode_tok_s, "tok/s");
  res.add("serve_http_ttft_p99_ms", r.ttft_p99_ms, "ms");
  if (a.compare_tok_s > 0) {
    const double pct = 100.0 * r.decode_tok_s / a.compare_tok_s;
    std::printf("http: %.1f %% of the %.0f tok/s given by --compare-tok-s\n", pct, a.compare_tok_s);
    res.add("serve_http_vs_decode_pct", pct, "%", res.note + "; against bench decode's " +
            std::to_string(static_cast<int64_t>(a.compare_tok_s)) + " tok/s");
  }
  return Status::ok();
}

}  // namespace

void add_bench(CLI::App& app) {
  auto* bench = app.add_subcommand("bench", "engine benchmarks: batched decode, long-prompt prefill, Poisson serving");
  bench->require_subcommand(1);

  auto* dec = bench->add_subcommand("decode", "batched decode throughput (tokens/s, ms/step) after prefilling N sequences");
  auto d = std::make_shared<DecodeArgs>();
  d->model.add_to(dec);
  dec->add_option("--batch", d->batch, "sequences decoding together")->check(CLI::Range(1, 1 << 20));
  dec->add_option("--steps", d->steps, "timed decode steps")->check(CLI::Range(1, 1 << 20));
  dec->add_option("--prompt-len", d->prompt_len, "prompt tokens per sequence")->check(CLI::Range(1, 1 << 24));
  dec->add_option("--warmup", d->warmup, "untimed decode steps first")->check(CLI::Range(0, 1 << 20));
  dec->add_option("--prefill-chunk", d->prefill_chunk, "engine prefill piece (tokens)")->check(CLI::Range(1, 1 << 20));
  dec->add_option("--max-batch-tokens", d->max_batch_tokens, "engine per-step token budget (0: batch + 4 pieces)")
      ->check(CLI::NonNegativeNumber);
  dec->add_option("--seed", d->seed, "seed of the random weights (no checkpoint) and prompts");
  dec->add_flag("--layers-sweep", d->layers_sweep,
                "also time num_layers = 1, 2, 4, ... (random weights) and fit ms/step = overhead + slope x layers");
  dec->add_option("--sweep-max-layers", d->sweep_max_layers, "largest layer count of the sweep (default: config's)")
      ->check(CLI::NonNegativeNumber);
  add_decode_options(dec, &d->state_dtype, &d->eager, &d->defer_writeback, &d->prefill_graphs);
  add_speculative_option(dec, &d->speculative);
  dec->add_option("--spec-reps", d->spec_reps,
                  "with --speculative: alternating runs with and without it; the medians give the speed-up")
      ->check(CLI::Range(1, 100));
  dec->add_flag("--no-pipeline", d->no_pipeline,
                "queue each decode step only after the last one's tokens are emitted (EngineOptions::pipeline)");
  dec->add_option("--accuracy-steps", d->accuracy_steps,
                  "with --state-dtype bf16 or --defer-writeback: teacher-forced steps comparing those states to f32 "
                  "states written back every step (0 = skip)")
      ->check(CLI::Range(0, 1 << 20));
  dec->add_option("--results", d->results, "append JSON lines here (empty: don't)");
  dec->add_option("--tag", d->tag, "suffix for the figure names (e.g. 3b_1280_fp32state)");
  dec->callback([d] { g_exit_code = report(run_bench_decode(*d)); });

  dec->add_option("--compare-prompt-len", d->compare_prompt_len,
                  "also time decode after prompts of this length, then after --prompt-len's again, and report the "
                  "change per output token against the mean of the two")
      ->check(CLI::NonNegativeNumber);

  auto* pf = bench->add_subcommand("prefill", "one long prompt through the chunked forward (ms, tokens/s)");
  auto pa = std::make_shared<PrefillArgs>();
  pa->model.add_to(pf);
  pf->add_option("--prompt-len", pa->prompt_len, "prompt tokens")->check(CLI::Range(1, 1 << 24));
  pf->add_option("--reps", pa->reps, "timed runs (the median is reported)")->check(CLI::Range(1, 1000));
  pf->add_option("--warmup", pa->warmup, "untimed runs first")->check(CLI::Range(0, 1000));
  pf->add_option("--seed", pa->seed, "seed of the random weights (no checkpoint) and the prompt");
  pf->add_option("--results", pa->results, "append JSON lines here (empty: don't)");
  pf->add_option("--tag", pa->tag, "suffix for the figure names (e.g. 3b)");
  pf->callback([pa] { g_exit_code = report(run_bench_prefill(*pa)); });

  auto* srv = bench->add_subcommand("serve", "Poisson arrivals against the engine: throughput, TTFT and TPOT p50/p99");
  auto s = std::make_shared<ServeArgs>();
  s->model.add_to(srv);
  srv->add_option("--rate", s->rate, "mean arrivals per second")->check(CLI::PositiveNumber);
  srv->add_flag("--burst", s->burst, "every request at once: the time until all first tokens are out "
                                     "(serve_burst_admit_s) and the prompt tokens/s until then");
  srv->add_option("--rates", s->rates, "a sweep: comma-separated rates; records the highest meeting the SLOs "
                                       "(serve_max_rate_req_s)");
  srv->add_option("--ttft-slo-ms", s->ttft_slo_ms, "sweep: TTFT p99 bound")->check(CLI::PositiveNumber);
  srv->add_option("--tpot-slo-ms", s->tpot_slo_ms, "sweep: TPOT p99 bound")->check(CLI::PositiveNumber);
  srv->add_option("--out", s->out, "sweep: one JSON line per rate (scripts/plot_serve_sweep.py draws them)");
  srv->add_option("--count", s->count, "requests")->check(CLI::Range(1, 1 << 24));
  srv->add_option("--prompt-len", s->prompt_len, "prompt tokens (the minimum with --prompt-len-max)")
      ->check(CLI::Range(1, 1 << 24));
  srv->add_option("--prompt-len-max", s->prompt_len_max, "prompt lengths uniform in [prompt-len, this]");
  srv->add_option("--output-len", s->output_len, "output tokens (the minimum with --output-len-max)")
      ->check(CLI::Range(1, 1 << 24));
  srv->add_option("--output-len-max", s->output_len_max, "output lengths uniform in [output-len, this]");
  srv->add_option("--max-slots", s->max_slots, "state slots (0: from --memory-budget, or free GPU memory)")
      ->check(CLI::NonNegativeNumber);
  srv->add_option("--memory-budget", s->memory_budget, "bytes for the state pool, e.g. 64M (with --max-slots 0)");
  srv->add_option("--memory-reserve", s->memory_reserve, "CUDA: free memory left unused when deriving slots");
  srv->add_option("--max-batch-tokens", s->max_batch_tokens, "per-step token budget")->check(CLI::Range(1, 1 << 24));
  srv->add_option("--prefill-chunk", s->prefill_chunk, "prefill piece (tokens)")->check(CLI::Range(1, 1 << 20));
  srv->add_option("--batch-prefill", s->batch_prefill,
                  "prefill pieces of many requests in one forward: equal (one length), ragged (any), off, or auto")
      ->check(CLI::IsMember(kBatchPrefillChoices));
  srv->add_option("--seed", s->seed, "seed of the random weights (no checkpoint), arrivals and prompts");
  add_decode_options(srv, &s->state_dtype, &s->eager, &s->defer_writeback, &s->prefill_graphs);
  srv->add_option("--results", s->results, "append JSON lines here (empty: don't)");
  srv->add_option("--tag", s->tag, "suffix for the figure names");
  srv->callback([s] { g_exit_code = report(run_bench_serve(*s)); });

  auto* http = bench->add_subcommand("http", "a running laplace serve under N concurrent streaming completions: "
                                             "decode tokens/s through HTTP and TTFT");
  auto h = std::make_shared<HttpArgs>();
  http->add_option("--host", h->load.host, "server address")->capture_default_str();
  http->add_option("--port", h->load.port, "server port")->required()->check(CLI::Range(1, 65535));
  http->add_option("--api-key-file", h->api_key_file, "file with the server's API key, if it needs one");
  http->add_option("--streams", h->load.streams, "concurrent streams (one connection each)")
      ->capture_default_str()->check(CLI::Range(1, 1 << 20));
  http->add_option("--prompt-len", h->load.prompt_len, "prompt token ids per stream")
      ->capture_default_str()->check(CLI::Range(1, 1 << 24));
  http->add_option("--max-tokens", h->load.max_tokens, "tokens each stream asks for (ignore_eos)")
      ->capture_default_str()->check(CLI::Range(2, 1 << 24));
  http->add_option("--vocab", h->load.vocab, "prompt ids are drawn below this (at most the model's vocabulary)")
      ->capture_default_str()->check(CLI::Range(1, 1 << 30));
  http->add_option("--seed", h->load.seed, "seed of the prompts");
  http->add_option("--timeout", h->load.timeout_s, "seconds for the whole run")->capture_default_str()
      ->check(CLI::PositiveNumber);
  http->add_option("--compare-tok-s", h->compare_tok_s,
                   "bench decode's tokens/s at the same concurrency: also record the percentage reached");
  http->add_option("--device-name", h->device_name, "the server's device, for the results (e.g. \"NVIDIA H200\")");
  http->add_option("--results", h->results, "append JSON lines here (empty: don't)");
  http->add_option("--tag", h->tag, "suffix for the figure names (e.g. 3b_1280)");
  http->callback([h] { g_exit_code = report(run_bench_http(*h)); });
}

}  // namespace laplace::cli
