// bench_train: whole training steps of laplace-3b (docs/training.md) on one GPU: BF16 weights and
// compute, F32 master weights, F32 gradients, Muon (body matrices) + AdamW (the rest),
// gradient-norm clipping, then masters → BF16 weights. The same pieces as `laplace train`
// (train/trainer.h: make_optimizer_params, copy_masters_to_weights), driven directly so
// that no data files are needed (weights from weights_init, random tokens).
//
// One step = grad_accum micro-batches of B×T random tokens (forward, loss, backward), then
// the optimizer step. The micro-batch B is the largest of 8, 4, 2, 1 whose memory plan
// (train/memory_plan.h) leaves --reserve-gib free on the device, unless --batch is given; either
// way the plan chooses what the backward recomputes (nothing, the GLA output, or every layer's
// activations) unless --recompute-mixer or --recompute-layers forces it. The memory plan is
// printed before the first step. --doc-len N puts a document start every N tokens on average
// (documents kept apart); --tag names the model in the figures.
//
// Reported (median over --steps timed steps after --warmup untimed ones):
//   train_tok_s_laplace3b_t2048      tokens/s of whole steps (optimizer included)
//   train_mfu_laplace3b_t2048        that × Config::train_flops_per_token() / (--peak-tflops, 989)
//   train_fwdbwd_tok_s_laplace3b_t2048  tokens/s of forward+loss+backward alone
//   train_optstep_ms_laplace3b       the optimizer step (+ masters → bf16 copy)
//   train_tok_s_laplace3b_t2048_524k_projected  the seed's 524,288-token step from the two
//                                    measured parts (micro-batches × fwd+bwd + one optimizer step)
//
// Usage: bench_train [--config configs/laplace-3b.json] [--seq 2048] [--batch N] [--accum 2]
//                    [--steps 2] [--warmup 1] [--recompute-mixer | --recompute-layers] [--reserve-gib 3]
//                    [--doc-len N] [--tag NAME]
//                    [--peak-tflops 989] [--lr 3e-4] [--results bench/results.jsonl] [--commit HASH]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "bench/bench_log.h"
#include "model/model.h"
#include "model/weights.h"
#include "train/memory_plan.h"
#include "train/trainer.h"

#ifdef LAPLACE_HAVE_CUDA
#include <cuda_runtime.h>

#include "ops/cuda/cuda_backend.h"
#include "core/rng.h"
#endif

namespace {

using namespace laplace;

struct Args {
  std::string config = "configs/laplace-3b.json";
  int64_t seq = 2048, batch = 0, accum = 2;
  int steps = 2, warmup = 1;
  bool recompute = false, recompute_layers = false;
  double reserve_gib = 3.0, peak_tflops = 989.0, lr = 3e-4;
  std::string results = "bench/results.jsonl";
  std::string commit;
  std::string tag;     // the figures' model name (default: laplace3b, or L<layers>D<width>)
  int64_t doc_len = 0;  // > 0: a separator starts a document every doc_len tokens on average
};

// The command line (CLI11, as the laplace program); exits through CLI11 on --help or a bad value.
void add_args(CLI::App& app, Args* a) {
  app.add_option("--config", a->config, "model config (JSON)");
  app.add_option("--seq", a->seq, "tokens per sequence")->check(CLI::Range(1, 1 << 30));
  app.add_option("--batch", a->batch, "micro-batch (0: the largest of 8, 4, 2, 1 that fits)")
      ->check(CLI::Range(0, 1 << 30));
  app.add_option("--accum", a->accum, "micro-batches per step")->check(CLI::Range(1, 1 << 30));
  app.add_option("--steps", a->steps, "timed steps (median)")->check(CLI::Range(1, 1 << 30));
  app.add_option("--warmup", a->warmup, "untimed steps first")->check(CLI::Range(0, 1 << 30));
  app.add_flag("--recompute-mixer", a->recompute, "recompute the GLA output in the backward");
  app.add_flag("--recompute-layers", a->recompute_layers, "recompute every layer's activations in the backward");
  app.add_option("--reserve-gib", a->reserve_gib, "device memory left free by the plan")->check(CLI::Range(0.0, 1e4));
  app.add_option("--peak-tflops", a->peak_tflops, "peak for MFU")->check(CLI::Range(1.0, 1e6));
  app.add_option("--lr", a->lr, "learning rate")->check(CLI::Range(0.0, 10.0));
  app.add_option("--results", a->results, "JSON lines appended here");
  app.add_option("--commit", a->commit, "commit written into each line (default: git's HEAD)");
  app.add_option("--tag", a->tag, "model name in the figures' names (e.g. laplace125m)");
  app.add_option("--doc-len", a->doc_len,
                 "documents kept apart: a separator token (2) every N tokens on average (0: one stream, no separator)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 30));
}

#ifdef LAPLACE_HAVE_CUDA


double now_s() {
  using namespace std::chrono;
  return duration<double>(steady_clock::now().time_since_epoch()).count();
}

double gb(size_t bytes) { return static_cast<double>(bytes) / 1e9; }

bool is_laplace_3b(const Config& c) {
  return c.vocab_size == 92160 && c.hidden_size == 3072 && c.num_layers == 24 && c.num_heads == 16 &&
         c.head_k_dim == 96 && c.head_v_dim == 192 && c.ffn_size == 8192;
}

int run(const Args& a) {
  Config cfg;
  Status st = config_load(a.config, &cfg);
  if (!st.is_ok()) {
    std::fprintf(stderr, "bench_train: %s\n", st.to_string().c_str());
    return 1;
  }
  std::string why;
  std::unique_ptr<Backend> be = make_cuda_backend(&why);
  if (!be) {
    std::fprintf(stderr, "bench_train: skipped: no CUDA device: %s\n", why.c_str());
    return 0;
  }
  auto* cb = dynamic_cast<CudaBackend*>(be.get());
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, cb->device_id());
  size_t free0 = 0, total_mem = 0;
  cudaMemGetInfo(&free0, &total_mem);
  const std::string tag = !a.tag.empty()        ? a.tag
                          : is_laplace_3b(cfg) ? std::string("laplace3b")
                                               : "L" + std::to_string(cfg.num_layers) + "D" + std::to_string(cfg.hidden_size);
  const std::string tag_t = tag + "_t" + std::to_string(a.seq) + (a.doc_len > 0 ? "_docs" : "");
  std::printf("bench_train: %s (%.1f GB, %.1f GB free), %s: %lld parameters (%lld in Muon matrices)\n", prop.name,
              gb(total_mem), gb(free0), a.config.c_str(), (long long)cfg.total_params(), (long long)cfg.body_params());

  double t0 = now_s();
  Model model;
  Arena masters, grads;
  Optimizer opt;
  {
    st = model.create(cfg, *be, DType::kBF16);
    if (st.is_ok()) st = masters.create(weight_specs(cfg, DType::kF32), be->allocator(), "master weights");
    if (st.is_ok()) st = grads.create(weight_specs(cfg, DType::kF32), be->allocator(), "gradients");
    OptimizerConfig oc;
    oc.ns_bf16 = true;  // docs/training.md §6: Newton–Schulz in bf16 on the GPU
    oc.lr = a.lr;
    oc.weight_decay = 0.1;
    if (st.is_ok()) st = opt.init(*be, make_optimizer_params(cfg, masters, grads, false), oc);
    if (!st.is_ok()) {
      std::fprintf(stderr, "bench_train: %s\n", st.to_string().c_str());
      return 1;
    }
  }
  weights_init(cfg, *be, masters, 12345);
  be->synchronize();
  copy_masters_to_weights(*be, masters, model.weight_arena());
  be->synchronize();
  std::printf("weights, masters, gradients, optimizer allocated and initialised in %.1f s\n", now_s() - t0);

  // The memory plan (train/memory_plan.h, as `laplace train --batch auto`): the largest
  // micro-batch (recompute off before on, unless --recompute-mixer) that leaves the
  // reserve free of the memory that was free before anything was allocated.
  MemoryPlanRequest req;
  req.seq = a.seq;
  req.dtype = DType::kBF16;
  req.batch = a.batch;
  req.grad_accum = a.accum;
  // Long sequences: with a given B the plan still chooses the recompute (none, the mixer's, then
  // every layer's) unless one is forced.
  req.recompute = a.recompute_layers ? kRecomputeLayers : a.recompute ? kRecomputeMixer : kRecomputeChoose;
  req.allow_recompute_layers = true;
  req.ns_bf16 = true;
  req.device_bytes = free0;
  req.reserve_bytes = static_cast<size_t>(a.reserve_gib * 1073741824.0);
  MemoryPlan mp;
  st = choose_memory_plan(cfg, req, &mp);
  if (st.is_ok()) st = model.plan(training_plan_options(mp));
  if (!st.is_ok()) {
    std::fprintf(stderr, "bench_train: %s\n", st.to_string().c_str());
    return 1;
  }
  for (const std::string& r : mp.rejected) std::printf("  rejected: %s\n", r.c_str());
  std::fputs(format_memory_plan(mp, "device").c_str(), stdout);
  const int64_t B = mp.batch;
  const std::string recompute = recompute_name(mp.recompute());
  const int64_t T = a.seq, N = B * T, tokens_per_step = N * a.accum;
  const size_t planned = model.weight_arena().bytes() + masters.bytes() + grads.bytes() + opt.state_bytes() +
                         model.activation_bytes();
  size_t free_after = 0;
  cudaMemGetInfo(&free_after, &total_mem);
  std::printf("  allocated %.3f GB (plan %.3f GB); %.2f GB of %.2f GB left free\n", gb(planned), gb(mp.total()),
              gb(free_after), gb(total_mem));

  // Data: random tokens (loss ≈ ln V), a fresh micro-batch each time. With --doc-len, token 2
  // (the shards' separator) starts a document with probability 1/doc_len at each position, and
  // the forward keeps the documents apart (ForwardOptions::document_separator); otherwise token 2
  // is drawn like any other and the window is one stream.
  constexpr int32_t kSep = 2;
  SplitMix64 drng{7};
  std::vector<int32_t> x(static_cast<size_t>(N)), y(static_cast<size_t>(N));
  auto next_batch = [&]() {
    for (int64_t i = 0; i < N; ++i) {
      x[i] = static_cast<int32_t>(drng.next() % static_cast<uint64_t>(cfg.vocab_size));
      y[i] = static_cast<int32_t>(drng.next() % static_cast<uint64_t>(cfg.vocab_size));
      if (a.doc_len > 0) {
        if (x[i] == kSep) x[i] = kSep + 1;
        if (drng.next() % static_cast<uint64_t>(a.doc_len) == 0) x[i] = kSep;
      }
    }
  };
  ForwardOptions fo;
  if (a.doc_len > 0) fo.document_separator = kSep;

  // The trainer's queued loss (train/trainer.cpp enqueue_step): the per-token losses are summed
  // on the device and read back once the step is done, so no micro-batch waits for the host.
  Arena loss_bufs;
  st = loss_bufs.create({{"targets", DType::kI32, {N}}, {"losses", DType::kF32, {N}}, {"loss_sum", DType::kF64, {1}}},
                        be->allocator(), "loss buffers");
  if (!st.is_ok()) {
    std::fprintf(stderr, "bench_train: %s\n", st.to_string().c_str());
    return 1;
  }
  const Tensor targets_dev = loss_bufs.tensor(0), losses_dev = loss_bufs.tensor(1), loss_sum = loss_bufs.tensor(2);

  std::vector<double> t_step, t_fb, t_opt;
  for (int s = 0; s < a.warmup + a.steps; ++s) {
    const double s0 = now_s();
    grads.zero();
    double loss = 0;
    for (int64_t m = 0; m < a.accum; ++m) {
      next_batch();
      model.forward(x.data(), B, T, fo);
      be->copy(targets_dev, Tensor(y.data(), DType::kI32, {N}));
      be->cross_entropy_forward(model.logits(), targets_dev, losses_dev);
      be->loss_sum_into(losses_dev, static_cast<double>(N), loss_sum, m > 0);  // random targets: all counted
      model.backward(y.data(), grads, 1.0 / static_cast<double>(a.accum));
    }
    be->synchronize();
    be->copy(Tensor(&loss, DType::kF64, {1}), loss_sum);
    const double s1 = now_s();
    const StepResult r = opt.step(a.lr);
    if (!r.skipped) copy_masters_to_weights(*be, masters, model.weight_arena());
    be->synchronize();
    const double s2 = now_s();
    const bool timed = s >= a.warmup;
    std::printf("step %d%s: loss %.4f | grad norm %.4f%s | fwd+bwd %.3f s (%lld micro-batches) | optimizer %.3f s | "
                "step %.3f s | %.0f tok/s\n",
                s, timed ? "" : " (warm-up)", loss / static_cast<double>(a.accum), r.grad_norm,
                r.skipped ? " SKIPPED" : "", s1 - s0, (long long)a.accum, s2 - s1, s2 - s0,
                static_cast<double>(tokens_per_step) / (s2 - s0));
    std::fflush(stdout);
    if (timed) {
      t_step.push_back(s2 - s0);
      t_fb.push_back(s1 - s0);
      t_opt.push_back(s2 - s1);
    }
  }
  // Where a micro-batch's time goes (one more micro-batch, waited for after each phase; the
  // waits add a little idle time, so the phases sum to slightly more than a queued micro-batch).
  {
    next_batch();
    be->synchronize();
    const double p0 = now_s();
    model.forward(x.data(), B, T, fo);
    be->synchronize();
    const double p1 = now_s();
    be->copy(targets_dev, Tensor(y.data(), DType::kI32, {N}));
    be->cross_entropy_forward(model.logits(), targets_dev, losses_dev);
    be->loss_sum_into(losses_dev, static_cast<double>(N), loss_sum, false);
    be->synchronize();
    const double p2 = now_s();
    model.backward(y.data(), grads, 1.0);
    be->synchronize();
    const double p3 = now_s();
    std::printf("one micro-batch, phase by phase: forward %.1f ms | loss %.1f ms | backward %.1f ms\n",
                1e3 * (p1 - p0), 1e3 * (p2 - p1), 1e3 * (p3 - p2));
  }
  size_t free_end = 0;
  cudaMemGetInfo(&free_end, &total_mem);
  std::printf("device memory in use after the steps: %.2f GB of %.2f GB\n", gb(total_mem - free_end), gb(total_mem));

  const double step_s = bench_median(t_step), fb_s = bench_median(t_fb), opt_s = bench_median(t_opt);
  const double tok_s = static_cast<double>(tokens_per_step) / step_s;
  const double fb_tok_s = static_cast<double>(tokens_per_step) / fb_s;
  const double fpt = cfg.train_flops_per_token();
  const double mfu = tok_s * fpt / (a.peak_tflops * 1e12);
  const double micro_per_seed_step = 524288.0 / static_cast<double>(N);
  const double proj = 524288.0 / (micro_per_seed_step * fb_s / static_cast<double>(a.accum) + opt_s);
  std::printf("\nresult: %.0f tokens/s whole steps (%.3f s per %lld-token step), MFU %.2f%% of %.0f TFLOP/s "
              "(%.4g FLOP/token)\n",
              tok_s, step_s, (long long)tokens_per_step, 100.0 * mfu, a.peak_tflops, fpt);
  std::printf("        forward+backward alone %.0f tokens/s (MFU %.2f%%); optimizer step %.3f s\n", fb_tok_s,
              100.0 * fb_tok_s * fpt / (a.peak_tflops * 1e12), opt_s);
  std::printf("        projected 524,288-token step (%.0f micro-batches + 1 optimizer step): %.0f tokens/s\n",
              micro_per_seed_step, proj);

  BenchLog res;
  res.path = a.results;
  res.device = prop.name;
  res.commit = BenchLog::commit_hash(a.commit);
  res.date = BenchLog::iso_date_utc();
  char note[384];
  std::snprintf(note, sizeof note,
                "bf16 + f32 masters, B=%lld x T=%lld, accum %lld (%lld tokens/step), recompute %s, "
                "optimizer included, median of %d steps%s",
                (long long)B, (long long)T, (long long)a.accum, (long long)tokens_per_step, recompute.c_str(),
                a.steps, a.doc_len > 0 ? ("; documents kept apart, one every " + std::to_string(a.doc_len) +
                                          " tokens on average").c_str() : "");
  res.add("train_tok_s_" + tag_t, tok_s, "tokens/s", note);
  res.add("train_mfu_" + tag_t, mfu, "fraction of " + std::to_string(static_cast<int>(a.peak_tflops)) + " TFLOP/s",
          note);
  res.add("train_fwdbwd_tok_s_" + tag_t, fb_tok_s, "tokens/s", std::string(note) + "; forward+loss+backward only");
  res.add("train_optstep_ms_" + tag, 1e3 * opt_s, "ms", "Muon (Newton-Schulz in bf16) + AdamW + clip + masters->bf16");
  res.add("train_tok_s_" + tag_t + "_524k_projected", proj, "tokens/s",
          "projected from the measured fwd+bwd per micro-batch and optimizer step, not measured whole");
  return 0;
}

#endif  // LAPLACE_HAVE_CUDA

}  // namespace

int main(int argc, char** argv) {
  Args a;
  CLI::App app{"bench_train: whole laplace-3b training steps on one GPU"};
  add_args(app, &a);
  CLI11_PARSE(app, argc, argv);
#ifdef LAPLACE_HAVE_CUDA
  return run(a);
#else
  std::fprintf(stderr, "bench_train: skipped: this build has no CUDA backend\n");
  return 0;
#endif
}
