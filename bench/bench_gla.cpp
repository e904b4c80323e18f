// bench_gla: the CUDA GLA mixer (docs/model.md §4, chunked form, C = 128) at the training shape of
// laplace-3b: B = 8, T = 2048, H = 16, dk = 96, dv = 192, BF16 q/k/v/dO, F32 state math.
//
//   forward          gla_forward (o BF16, zero initial state, no final state)
//   forward+backward gla_forward then gla_backward (dq, dk, dv BF16)
// Timed with CUDA events on the backend's stream: `--warmup` untimed runs, then the median
// of `--reps` timed runs (each run timed on its own).
// Accuracy: the relative RMS error of o (and of dq, dk, dv) against an F64 CPU evaluation of
// the same bf16 inputs, over the first `--check-batch` sequences (default 2 of the 8: the
// kernel treats every (sequence, head) alike, so a subset measures the same thing faster).
//
// Appends JSON lines to --results (default bench/results.jsonl):
//   gla_fwd_ms_b8t2048h16, gla_fwdbwd_ms_b8t2048h16, gla_fwd_relerr_b8t2048h16,
//   gla_bwd_relerr_{dq,dk,dv}_b8t2048h16
// (names carry the default shape; other shapes append their own b/t/h).
//
// Usage: bench_gla [--B 8] [--T 2048] [--H 16] [--dk 96] [--dv 192] [--reps 20] [--warmup 3]
//                  [--check-batch 2] [--results PATH] [--commit HASH]
#include <algorithm>
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
#include "core/arena.h"
#include "ops/backend.h"

#ifdef LAPLACE_HAVE_CUDA
#include <cuda_runtime.h>

#include "ops/cuda/cuda_backend.h"
#include "core/rng.h"
#endif

namespace {

using namespace laplace;

struct Args {
  int64_t B = 8, T = 2048, H = 16, dk = 96, dv = 192;
  int reps = 20, warmup = 3;
  int64_t check_batch = 2;
  std::string results = "bench/results.jsonl";
  std::string commit;
};

// The command line (CLI11, as the laplace program); exits through CLI11 on --help or a bad value.
void add_args(CLI::App& app, Args* a) {
  app.add_option("--B", a->B, "sequences")->check(CLI::Range(1, 1 << 30));
  app.add_option("--T", a->T, "tokens per sequence")->check(CLI::Range(1, 1 << 30));
  app.add_option("--H", a->H, "heads")->check(CLI::Range(1, 1 << 30));
  app.add_option("--dk", a->dk, "key dim per head")->check(CLI::Range(1, 1 << 30));
  app.add_option("--dv", a->dv, "value dim per head")->check(CLI::Range(1, 1 << 30));
  app.add_option("--reps", a->reps, "timed runs (median)")->check(CLI::Range(1, 1 << 30));
  app.add_option("--warmup", a->warmup, "untimed runs first")->check(CLI::Range(0, 1 << 30));
  app.add_option("--check-batch", a->check_batch, "sequences checked against F64 on the CPU")
      ->check(CLI::Range(0, 1 << 30));
  app.add_option("--results", a->results, "JSON lines appended here");
  app.add_option("--commit", a->commit, "commit written into each line (default: git's HEAD)");
}

#ifdef LAPLACE_HAVE_CUDA


// SplitMix64 → uniform [-1, 1), rounded to bf16 (fast: ~150M values).
struct Rng {
  uint64_t s;
  explicit Rng(uint64_t seed) : s(seed) {}
  uint64_t next() {
    const uint64_t z = splitmix64_hash(s);
    s += kSplitMixGamma;
    return z;
  }
  float uniform() { return static_cast<float>(static_cast<double>(next() >> 11) * 0x1.0p-53 * 2.0 - 1.0); }
};

std::vector<uint16_t> random_bf16(int64_t n, uint64_t seed) {
  std::vector<uint16_t> v(static_cast<size_t>(n));
  Rng r(seed);
  for (auto& x : v) x = float_to_bf16(r.uniform());
  return v;
}

// Relative RMS of a bf16 device tensor's first rows against an F64 host reference.
double rel_rms_bf16_vs_f64(const std::vector<uint16_t>& a, const std::vector<double>& ref) {
  double num = 0, den = 1e-300;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double d = static_cast<double>(bf16_to_float(a[i])) - ref[i];
    num += d * d;
    den += ref[i] * ref[i];
  }
  return std::sqrt(num / den);
}

#endif  // LAPLACE_HAVE_CUDA

}  // namespace

int main(int argc, char** argv) {
  Args a;
  CLI::App app{"bench_gla: the CUDA GLA mixer, forward and forward + backward"};
  add_args(app, &a);
  CLI11_PARSE(app, argc, argv);
#ifndef LAPLACE_HAVE_CUDA
  std::fprintf(stderr, "bench_gla: skipped: this build has no CUDA backend\n");
  return 0;
#else
  std::string why;
  std::unique_ptr<Backend> be = make_cuda_backend(&why);
  if (!be) {
    std::fprintf(stderr, "bench_gla: skipped: no CUDA device: %s\n", why.c_str());
    return 0;
  }
  auto* cb = dynamic_cast<CudaBackend*>(be.get());
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, cb->device_id());
  BenchLog res;
  res.path = a.results;
  res.device = prop.name;
  res.commit = BenchLog::commit_hash(a.commit);
  res.date = BenchLog::iso_date_utc();

  const int64_t B = a.B, T = a.T, H = a.H, dk = a.dk, dv = a.dv;
  const int64_t nk = B * T * H * dk, nv = B * T * H * dv;
  std::printf("bench_gla: %s, B=%lld T=%lld H=%lld dk=%lld dv=%lld, chunk 128, bf16 inputs/outputs, F32 state\n",
              prop.name, (long long)B, (long long)T, (long long)H, (long long)dk, (long long)dv);

  GlaParams p;
  p.form = GlaForm::kChunked;
  p.chunk = 128;
  p.scale = 1.0 / std::sqrt(static_cast<double>(dk));
  for (int64_t h = 0; h < H; ++h) p.decay.push_back(1.0 - std::ldexp(1.0, static_cast<int>(-5 - h)));

  Arena arena;
  {
    std::vector<TensorSpec> s = {
        {"q", DType::kBF16, {B, T, H, dk}},  {"k", DType::kBF16, {B, T, H, dk}},  {"v", DType::kBF16, {B, T, H, dv}},
        {"o", DType::kBF16, {B, T, H, dv}},  {"do", DType::kBF16, {B, T, H, dv}}, {"dq", DType::kBF16, {B, T, H, dk}},
        {"dk", DType::kBF16, {B, T, H, dk}}, {"dv", DType::kBF16, {B, T, H, dv}},
    };
    Status st = arena.create(std::move(s), be->allocator(), "gla bench");
    if (!st.is_ok()) {
      std::fprintf(stderr, "bench_gla: %s\n", st.to_string().c_str());
      return 1;
    }
  }
  Tensor q = arena.tensor(0), k = arena.tensor(1), v = arena.tensor(2), o = arena.tensor(3), d_o = arena.tensor(4),
         dq = arena.tensor(5), dkt = arena.tensor(6), dvt = arena.tensor(7);
  const std::vector<uint16_t> hq = random_bf16(nk, 1), hk = random_bf16(nk, 2), hv = random_bf16(nv, 3),
                              hdo = random_bf16(nv, 4);
  be->copy(q, Tensor::make(const_cast<uint16_t*>(hq.data()), DType::kBF16, q.shape.data(), 4));
  be->copy(k, Tensor::make(const_cast<uint16_t*>(hk.data()), DType::kBF16, k.shape.data(), 4));
  be->copy(v, Tensor::make(const_cast<uint16_t*>(hv.data()), DType::kBF16, v.shape.data(), 4));
  be->copy(d_o, Tensor::make(const_cast<uint16_t*>(hdo.data()), DType::kBF16, d_o.shape.data(), 4));
  be->synchronize();

  auto fwd = [&]() { be->gla_forward(p, q, k, v, o, {}, {}, {}); };
  auto fwdbwd = [&]() {
    be->gla_forward(p, q, k, v, o, {}, {}, {});
    be->gla_backward(p, q, k, v, {}, d_o, {}, dq, dkt, dvt, {});
  };
  cudaStream_t stream = cb->stream();
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  auto time_ms = [&](const auto& fn) {
    for (int i = 0; i < a.warmup; ++i) fn();
    be->synchronize();
    std::vector<double> ms;
    for (int i = 0; i < a.reps; ++i) {
      cudaEventRecord(e0, stream);
      fn();
      cudaEventRecord(e1, stream);
      cudaEventSynchronize(e1);
      float t = 0;
      cudaEventElapsedTime(&t, e0, e1);
      ms.push_back(t);
    }
    std::printf("  min %.3f ms, median %.3f ms, max %.3f ms over %d reps\n", *std::min_element(ms.begin(), ms.end()),
                bench_median(ms), *std::max_element(ms.begin(), ms.end()), a.reps);
    return bench_median(ms);
  };
  std::printf("forward:\n");
  const double t_fwd = time_ms(fwd);
  std::printf("forward+backward:\n");
  const double t_fb = time_ms(fwdbwd);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);

  // FLOPs of the chunked algorithm (as docs/model.md §7 counts the mixer: 3·H·(C(dk+dv) + 4·dk·dv)
  // per token for fwd+bwd), for an achieved-rate figure.
  const double flops_fb = 3.0 * static_cast<double>(B * T) * static_cast<double>(H) *
                          (128.0 * static_cast<double>(dk + dv) + 4.0 * static_cast<double>(dk * dv));
  std::printf("forward %.3f ms, forward+backward %.3f ms (%.1f TFLOP/s by the SPEC §2 mixer count)\n", t_fwd, t_fb,
              flops_fb / (t_fb * 1e-3) / 1e12);

  // Accuracy vs F64 on the first check-batch sequences. The last timed run left o, dq, dk,
  // dv of these inputs on the device.
  const int64_t cbn = std::min(a.check_batch, B);
  double e_o = -1, e_dq = -1, e_dk = -1, e_dv = -1;
  if (cbn > 0) {
    auto cpu = make_cpu_backend();
    const int64_t mk = cbn * T * H * dk, mv = cbn * T * H * dv;
    auto f64 = [](const std::vector<uint16_t>& h, int64_t n) {
      std::vector<double> r(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) r[i] = bf16_to_float(h[i]);
      return r;
    };
    std::vector<double> rq = f64(hq, mk), rk = f64(hk, mk), rv = f64(hv, mv), rdo = f64(hdo, mv);
    std::vector<double> ro(mv), rdq(mk), rdk(mk), rdv(mv);
    auto t4 = [&](std::vector<double>& x, int64_t d) { return Tensor(x.data(), DType::kF64, {cbn, T, H, d}); };
    cpu->gla_forward(p, t4(rq, dk), t4(rk, dk), t4(rv, dv), t4(ro, dv), {}, {}, {});
    cpu->gla_backward(p, t4(rq, dk), t4(rk, dk), t4(rv, dv), {}, t4(rdo, dv), {}, t4(rdq, dk), t4(rdk, dk),
                      t4(rdv, dv), {});
    auto down = [&](const Tensor& t, int64_t n) {
      std::vector<uint16_t> h(static_cast<size_t>(n));
      Tensor part = t.slice(0, 0, cbn);
      be->copy(Tensor::make(h.data(), DType::kBF16, part.shape.data(), 4), part);
      return h;
    };
    e_o = rel_rms_bf16_vs_f64(down(o, mv), ro);
    e_dq = rel_rms_bf16_vs_f64(down(dq, mk), rdq);
    e_dk = rel_rms_bf16_vs_f64(down(dkt, mk), rdk);
    e_dv = rel_rms_bf16_vs_f64(down(dvt, mv), rdv);
    std::printf("relative RMS error vs F64 (first %lld of %lld sequences): o %.3e | dq %.3e dk %.3e dv %.3e\n",
                (long long)cbn, (long long)B, e_o, e_dq, e_dk, e_dv);
  }

  std::string tag = "b" + std::to_string(B) + "t" + std::to_string(T) + "h" + std::to_string(H);
  if (dk != 96 || dv != 192) tag += "dk" + std::to_string(dk) + "dv" + std::to_string(dv);
  res.note = "bf16 q/k/v/dO, zero initial state, chunk 128, median of " + std::to_string(a.reps) + " reps after " +
             std::to_string(a.warmup) + " warm-up (CUDA events)";
  res.add("gla_fwd_ms_" + tag, t_fwd, "ms");
  res.add("gla_fwdbwd_ms_" + tag, t_fb, "ms");
  if (e_o >= 0) {
    res.note = "bf16 output vs an fp64 CPU evaluation of the same bf16 inputs, first " + std::to_string(cbn) +
               " of " + std::to_string(B) + " sequences";
    res.add("gla_fwd_relerr_" + tag, e_o, "relative RMS");
    res.add("gla_bwd_relerr_dq_" + tag, e_dq, "relative RMS");
    res.add("gla_bwd_relerr_dk_" + tag, e_dk, "relative RMS");
    res.add("gla_bwd_relerr_dv_" + tag, e_dv, "relative RMS");
  }
  arena = Arena();  // device memory goes before the backend
  return 0;
#endif
}
