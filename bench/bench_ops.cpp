// bench_ops: where the time of one laplace-3b decode step, one long prefill and one training
// micro-batch (forward + backward) goes, op by op, on the CUDA backend (bf16 activations and weights, the model's shapes). Each op runs
// `--reps` times back to back after a warm-up; the mean time per call is printed with its
// count per step (×L for per-layer ops) and the implied share of the step. The training section
// then runs its ops in sequence for a few rounds and prints each op's sustained time (the GPU
// at its power limit, as in a real step). The figures guide kernel work; the end-to-end numbers
// come from `laplace bench decode|prefill` and bench_train.
//
// Inputs are the constant 0.01 by default; `--random 1` fills them with uniform noise in
// [−0.5, 0.5] instead. The H200 runs at its power limit, and a tensor core's power depends on
// how many bits toggle: constant operands let the clock stay high, so `--random 1` gives the
// gemm rates of a real forward with real weights.
//
// Usage: bench_ops [--batch 1280] [--prompt 8192] [--layers 24] [--reps 10]
//                  [--train-batch 8] [--train-seq 2048] [--only decode|prefill|train] [--random 0|1]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "core/arena.h"
#include "core/dtype.h"
#include "model/config.h"
#include "model/state.h"
#include "ops/backend.h"

namespace {

using namespace laplace;

struct Row {
  std::string name;
  double ms = 0;
  int64_t per_step = 1;
  std::function<void()> run = nullptr;  // the op (training section: timed again in sequence)
};

bool g_random = false;  // --random 1

// Every non-integer tensor of the arena: 0.01, or (g_random) uniform in [−0.5, 0.5] from a
// fixed-seed generator, made on the host in the tensor's dtype and copied over. FP8 codes are
// left alone: the quantisers write them before a product reads them.
void fill_inputs(Backend& be, Arena& a) {
  uint64_t x = 0x9e3779b97f4a7c15ull;
  for (size_t i = 0; i < a.size(); ++i) {
    Tensor t = a.tensor(i);
    if (t.dtype == DType::kI32 || t.dtype == DType::kF8E4M3) continue;
    if (!g_random || (t.dtype != DType::kBF16 && t.dtype != DType::kF32)) {
      be.fill(t, 0.01);
      continue;
    }
    const int64_t n = t.numel();
    auto next = [&x] {
      x ^= x << 13, x ^= x >> 7, x ^= x << 17;  // xorshift64
      return static_cast<float>(static_cast<double>(x >> 11) * 0x1.0p-53) - 0.5f;
    };
    // The values made in the tensor's host type (to_dt: float → that type), then copied over.
    auto upload = [&](auto to_dt) {
      std::vector<decltype(to_dt(0.f))> h(static_cast<size_t>(n));
      for (auto& v : h) v = to_dt(next());
      be.copy(t, Tensor::make(h.data(), t.dtype, t.shape.data(), t.ndim));
    };
    if (t.dtype == DType::kBF16) upload(float_to_bf16);
    else upload([](float f) { return f; });
  }
  be.synchronize();
}

double time_ms(Backend& be, int reps, const std::function<void()>& f) {
  f();
  f();
  be.synchronize();
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < reps; ++i) f();
  be.synchronize();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / reps;
}

void print(const char* title, const std::vector<Row>& rows) {
  double total = 0;
  for (const Row& r : rows) total += r.ms * static_cast<double>(r.per_step);
  std::printf("%s: %.3f ms in these ops\n", title, total);
  for (const Row& r : rows)
    std::printf("  %-34s %8.4f ms x %3lld = %8.3f ms  (%5.1f%%)\n", r.name.c_str(), r.ms, (long long)r.per_step,
                r.ms * static_cast<double>(r.per_step), 100.0 * r.ms * static_cast<double>(r.per_step) / total);
}

// [B, T, H, d] view of the columns col .. col + H·d of the first B·T rows of a row-major
// [rows, C] buffer (the model's per-head slices of qkvg, o, y).
Tensor heads_view(const Tensor& x2, int64_t B, int64_t T, int64_t H, int64_t col, int64_t d) {
  Tensor v = x2.slice(0, 0, B * T).slice(1, col, col + H * d);
  v.ndim = 4;
  v.shape = {B, T, H, d};
  v.stride = {T * x2.stride[0], x2.stride[0], d, 1};
  return v;
}
// [B, T, C] view of the first B·T rows of a row-major [rows, C] buffer.
Tensor btc_view(const Tensor& x2, int64_t B, int64_t T) {
  Tensor v = x2.slice(0, 0, B * T);
  v.ndim = 3;
  v.shape = {B, T, x2.shape[1], 0};
  v.stride = {T * x2.stride[0], x2.stride[0], 1, 0};
  return v;
}

// One training micro-batch of B × T tokens (the model's backward order, model.cpp): every op
// of the forward and the backward at laplace-3b's shapes, BF16 activations and gradients,
// F32 weight gradients (accumulated, as with gradient accumulation).
int bench_train_ops(Backend& e, const Config& c, int64_t B, int64_t T, int64_t L, int reps) {
  const int64_t N = B * T, D = c.hidden_size, R = c.qkvg_rows(), F = c.ffn_size, V = c.vocab_size;
  const int64_t H = c.num_heads, dk = c.head_k_dim, dv = c.head_v_dim, HV = H * dv, K = c.conv_size;
  const DType bf = DType::kBF16, f32 = DType::kF32;
  Arena a;
  Status st = a.create({{"wqkvg", bf, {R, D}},   {"wo", bf, {D, HV}},      {"w12", bf, {2 * F, D}},
                        {"w3", bf, {D, F}},      {"head", bf, {V, D}},     {"embed", bf, {V, D}},
                        {"norm_w", bf, {D}},     {"norm_b", bf, {D}},      {"conv_w", bf, {D, K}},
                        {"onorm_w", bf, {dv}},
                        {"g_wqkvg", f32, {R, D}}, {"g_wo", f32, {D, HV}},  {"g_w12", f32, {2 * F, D}},
                        {"g_w3", f32, {D, F}},   {"g_head", f32, {V, D}},  {"g_embed", f32, {V, D}},
                        {"g_norm_w", f32, {D}},  {"g_norm_b", f32, {D}},   {"g_conv_w", f32, {D, K}},
                        {"g_onorm_w", f32, {dv}},
                        {"x", bf, {N, D}},       {"u", bf, {N, D}},        {"pre", bf, {N, D}},
                        {"c", bf, {N, D}},       {"qkvg", bf, {N, R}},     {"o", bf, {N, HV}},
                        {"y", bf, {N, HV}},      {"ab", bf, {N, 2 * F}},   {"h", bf, {N, F}},
                        {"logits", bf, {N, V}},  {"ids", DType::kI32, {N}}, {"losses", f32, {N}},
                        {"mean", f32, {N}},      {"rstd", f32, {N}},       {"orstd", f32, {N, H}},
                        {"dx", bf, {N, D}},      {"dtmp", bf, {N, D}},     {"dqkvg", bf, {N, R}},
                        {"dy", bf, {N, HV}},     {"do", bf, {N, HV}},      {"dab", bf, {N, 2 * F}},
                        {"dh", bf, {N, F}},
                        // one column wider: views of their first columns have rows that are not 16-byte
                        // aligned, so the ops take their generic kernels (the A/B below)
                        {"dh_u", bf, {N, F + 1}}, {"dtmp_u", bf, {N, D + 1}}, {"dy_u", bf, {N, HV + 1}},
                        {"logits_u", bf, {N, V + 1}}},
                       e.allocator(), "bench_ops train");
  if (!st.is_ok()) {
    std::fprintf(stderr, "bench_ops: train: %s\n", st.to_string().c_str());
    return 1;
  }
  auto t = [&](const char* n) { return a.tensor(static_cast<size_t>(a.find(n))); };
  fill_inputs(e, a);
  std::vector<int32_t> idv(static_cast<size_t>(N));
  for (int64_t i = 0; i < N; ++i) idv[i] = static_cast<int32_t>((i * 7919) % V);
  e.copy(t("ids"), Tensor(idv.data(), DType::kI32, {N}));
  GlaParams gp;
  gp.form = GlaForm::kChunked;
  gp.chunk = 128;
  gp.scale = 1.0 / std::sqrt(static_cast<double>(dk));
  gp.decay = c.decays();
  auto part = [&](const Tensor& x2, int64_t col, int64_t d) { return heads_view(x2, B, T, H, col, d); };
  auto btc = [&](const Tensor& x2) { return btc_view(x2, B, T); };
  Tensor orstd = t("orstd");
  orstd.ndim = 3;
  orstd.shape = {B, T, H, 0};
  orstd.stride = {T * H, H, 1, 0};
  const Tensor q = t("qkvg"), dq = t("dqkvg"), o4 = part(t("o"), 0, dv), y4 = part(t("y"), 0, dv);
  const Tensor do4 = part(t("do"), 0, dv), dy4 = part(t("dy"), 0, dv);
  const Tensor g4 = part(q, 2 * H * dk + HV, dv), dg4 = part(dq, 2 * H * dk + HV, dv);  // the gate and its gradient
  const Tensor none{};
  std::vector<Row> fw, bw;
  auto add = [&](std::vector<Row>& v, const char* name, int64_t per_step, std::function<void()> f) {
    v.push_back({name, time_ms(e, reps, f), per_step, f});
  };
  // forward
  add(fw, "embedding", 1, [&] { e.embedding_forward(t("ids"), t("embed"), t("x")); });
  add(fw, "layernorm (+ stats)", 2 * L + 1, [&] { e.layernorm_forward(t("x"), t("norm_w"), t("norm_b"), 1e-5, t("u"), t("mean"), t("rstd")); });
  add(fw, "conv_silu (keeps pre)", L, [&] { e.conv_silu_forward(btc(t("u")), t("conv_w"), btc(t("c")), btc(t("pre")), none, none, none); });
  add(fw, "gemm qkvg", L, [&] { e.gemm(t("c"), false, t("wqkvg"), true, q, 1.0, 0.0); });
  add(fw, "gla_forward", L, [&] { e.gla_forward(gp, part(q, 0, dk), part(q, H * dk, dk), part(q, 2 * H * dk, dv), o4, none, none, none); });
  add(fw, "rmsnorm_gate (+ rstd)", L, [&] { e.rmsnorm_gate_forward(o4, g4, t("onorm_w"), 1e-5, y4, orstd); });
  add(fw, "gemm wo +=", L, [&] { e.gemm(t("y"), false, t("wo"), true, t("x"), 1.0, 1.0); });
  add(fw, "gemm w12", L, [&] { e.gemm(t("u"), false, t("w12"), true, t("ab"), 1.0, 0.0); });
  add(fw, "swiglu", L, [&] { e.swiglu_forward(t("ab"), t("h")); });
  add(fw, "gemm w3 +=", L, [&] { e.gemm(t("h"), false, t("w3"), true, t("x"), 1.0, 1.0); });
  add(fw, "gemm head (bf16 logits)", 1, [&] { e.gemm(t("u"), false, t("head"), true, t("logits"), 1.0, 0.0); });
  add(fw, "cross_entropy forward", 1, [&] { e.cross_entropy_forward(t("logits"), t("ids"), t("losses")); });
  // backward (dlogits in place; the logits keep their values: 0.01 everywhere)
  add(bw, "cross_entropy backward", 1, [&] { e.cross_entropy_backward(t("logits"), t("ids"), 1e-4, t("logits")); });
  add(bw, "gemm dlogits·W_head", 1, [&] { e.gemm(t("logits"), false, t("head"), false, t("dtmp"), 1.0, 0.0); });
  add(bw, "gemm dW_head += dlogitsᵀ·z", 1, [&] { e.gemm(t("logits"), true, t("u"), false, t("g_head"), 1.0, 1.0); });
  add(bw, "gemm dh = dx·W3", L, [&] { e.gemm(t("dx"), false, t("w3"), false, t("dh"), 1.0, 0.0); });
  add(bw, "gemm dW3 += dxᵀ·h", L, [&] { e.gemm(t("dx"), true, t("h"), false, t("g_w3"), 1.0, 1.0); });
  add(bw, "swiglu backward", L, [&] { e.swiglu_backward(t("dh"), t("ab"), t("dab")); });
  add(bw, "gemm dz = dab·W12", L, [&] { e.gemm(t("dab"), false, t("w12"), false, t("dtmp"), 1.0, 0.0); });
  add(bw, "gemm dW12 += dabᵀ·z", L, [&] { e.gemm(t("dab"), true, t("u"), false, t("g_w12"), 1.0, 1.0); });
  add(bw, "layernorm backward (dx +=, dw, db)", 2 * L + 1, [&] { e.layernorm_backward(t("dtmp"), t("x"), t("norm_w"), t("mean"), t("rstd"), t("dx"), true, t("g_norm_w"), t("g_norm_b")); });
  add(bw, "gemm dy = dx·Wo", L, [&] { e.gemm(t("dx"), false, t("wo"), false, t("dy"), 1.0, 0.0); });
  add(bw, "gemm dWo += dxᵀ·y", L, [&] { e.gemm(t("dx"), true, t("y"), false, t("g_wo"), 1.0, 1.0); });
  add(bw, "rmsnorm_gate backward", L, [&] { e.rmsnorm_gate_backward(dy4, o4, g4, t("onorm_w"), orstd, do4, dg4, t("g_onorm_w")); });
  add(bw, "gla_backward", L, [&] { e.gla_backward(gp, part(q, 0, dk), part(q, H * dk, dk), part(q, 2 * H * dk, dv), none, do4, none, part(dq, 0, dk), part(dq, H * dk, dk), part(dq, 2 * H * dk, dv), none); });
  add(bw, "gemm dc = dqkvg·Wqkvg", L, [&] { e.gemm(dq, false, t("wqkvg"), false, t("dtmp"), 1.0, 0.0); });
  add(bw, "gemm dWqkvg += dqkvgᵀ·c", L, [&] { e.gemm(dq, true, t("c"), false, t("g_wqkvg"), 1.0, 1.0); });
  add(bw, "conv_silu backward", L, [&] { e.conv_silu_backward(btc(t("dtmp")), btc(t("u")), t("conv_w"), btc(t("pre")), btc(t("c")), t("g_conv_w")); });
  add(bw, "embedding backward", 1, [&] { e.embedding_backward(t("ids"), t("dx"), t("g_embed")); });
  // A/B: the ops with vectorised fast paths against their generic kernels (same shapes;
  // one input's rows unaligned). Not part of the micro-batch's totals.
  const Tensor dh_u = t("dh_u").slice(1, 0, F), dtmp_u = t("dtmp_u").slice(1, 0, D);
  const Tensor dy4_u = part(t("dy_u"), 0, dv), logits_u = t("logits_u").slice(1, 0, V);
  std::vector<Row> ab;
  // cross-entropy: the backward in place, as in the micro-batch
  add(ab, "cross_entropy forward: fast", 1, [&] { e.cross_entropy_forward(t("logits"), t("ids"), t("losses")); });
  add(ab, "cross_entropy forward: generic", 1, [&] { e.cross_entropy_forward(logits_u, t("ids"), t("losses")); });
  add(ab, "cross_entropy backward: fast", 1, [&] { e.cross_entropy_backward(t("logits"), t("ids"), 1e-4, t("logits")); });
  add(ab, "cross_entropy backward: generic", 1, [&] { e.cross_entropy_backward(logits_u, t("ids"), 1e-4, logits_u); });
  add(ab, "swiglu backward: fast", 1, [&] { e.swiglu_backward(t("dh"), t("ab"), t("dab")); });
  add(ab, "swiglu backward: generic", 1, [&] { e.swiglu_backward(dh_u, t("ab"), t("dab")); });
  add(ab, "conv_silu backward: fast", 1, [&] { e.conv_silu_backward(btc(t("dtmp")), btc(t("u")), t("conv_w"), btc(t("pre")), btc(t("c")), t("g_conv_w")); });
  add(ab, "conv_silu backward: generic", 1, [&] { e.conv_silu_backward(btc(dtmp_u), btc(t("u")), t("conv_w"), btc(t("pre")), btc(t("c")), t("g_conv_w")); });
  add(ab, "layernorm backward dx only: fast", 1, [&] { e.layernorm_backward(t("dtmp"), t("x"), t("norm_w"), t("mean"), t("rstd"), t("dx"), true, none, none); });
  add(ab, "layernorm backward dx only: generic", 1, [&] { e.layernorm_backward(dtmp_u, t("x"), t("norm_w"), t("mean"), t("rstd"), t("dx"), true, none, none); });
  add(ab, "layernorm backward (dx +=, dw, db): fast", 1, [&] { e.layernorm_backward(t("dtmp"), t("x"), t("norm_w"), t("mean"), t("rstd"), t("dx"), true, t("g_norm_w"), t("g_norm_b")); });
  add(ab, "layernorm backward (dx +=, dw, db): generic", 1, [&] { e.layernorm_backward(dtmp_u, t("x"), t("norm_w"), t("mean"), t("rstd"), t("dx"), true, t("g_norm_w"), t("g_norm_b")); });
  add(ab, "rmsnorm_gate backward (d_o, dg, dw): fast", 1, [&] { e.rmsnorm_gate_backward(dy4, o4, g4, t("onorm_w"), orstd, do4, dg4, t("g_onorm_w")); });
  add(ab, "rmsnorm_gate backward (d_o, dg, dw): generic", 1, [&] { e.rmsnorm_gate_backward(dy4_u, o4, g4, t("onorm_w"), orstd, do4, dg4, t("g_onorm_w")); });
  add(ab, "rmsnorm_gate backward d_o, dg only: fast", 1, [&] { e.rmsnorm_gate_backward(dy4, o4, g4, t("onorm_w"), orstd, do4, dg4, none); });
  add(ab, "rmsnorm_gate backward dw only: fast", 1, [&] { e.rmsnorm_gate_backward(dy4, o4, g4, t("onorm_w"), orstd, none, none, t("g_onorm_w")); });
  char title[160];
  print("A/B, fast path vs generic kernel (one call each, not in the totals)", ab);
  std::snprintf(title, sizeof title, "training micro-batch forward, %lld x %lld tokens, %lld layers", (long long)B,
                (long long)T, (long long)L);
  print(title, fw);
  std::snprintf(title, sizeof title, "training micro-batch backward, %lld x %lld tokens, %lld layers", (long long)B,
                (long long)T, (long long)L);
  print(title, bw);
  double gemm = 0, other = 0;
  for (const auto* v : {&fw, &bw})
    for (const Row& r : *v) (r.name.rfind("gemm", 0) == 0 ? gemm : other) += r.ms * static_cast<double>(r.per_step);
  std::printf("  micro-batch: gemms %.1f ms, everything else %.1f ms (%.0f tokens/s for forward + backward alone)\n", gemm,
              other, 1e3 * static_cast<double>(N) / (gemm + other));

  // Sustained: the micro-batch's ops in order, each its per-step count of times back to back,
  // for kSustainRounds rounds (the first a warm-up), waiting for the GPU after each op's group.
  // A real step keeps the H200 at its power limit (~1.6 GHz against 1.98 idle), which the
  // short bursts above do not reach; these figures are the ones a step sees.
  constexpr int kSustainRounds = 4;
  std::vector<double> sus_fw(fw.size(), 0.0), sus_bw(bw.size(), 0.0);
  for (int round = 0; round < kSustainRounds; ++round) {
    for (auto [rows, acc] : {std::pair{&fw, &sus_fw}, std::pair{&bw, &sus_bw}}) {
      for (size_t i = 0; i < rows->size(); ++i) {
        const Row& r = (*rows)[i];
        e.synchronize();
        const auto t0 = std::chrono::steady_clock::now();
        for (int64_t k = 0; k < r.per_step; ++k) r.run();
        e.synchronize();
        if (round > 0)
          (*acc)[i] += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      }
    }
  }
  double sus_gemm = 0, sus_other = 0;
  std::printf("sustained (the micro-batch's ops in sequence, %d rounds after a warm-up): ms per call, burst -> sustained\n",
              kSustainRounds - 1);
  for (auto [rows, acc] : {std::pair{&fw, &sus_fw}, std::pair{&bw, &sus_bw}}) {
    for (size_t i = 0; i < rows->size(); ++i) {
      const Row& r = (*rows)[i];
      const double total = (*acc)[i] / (kSustainRounds - 1), per_call = total / static_cast<double>(r.per_step);
      (r.name.rfind("gemm", 0) == 0 ? sus_gemm : sus_other) += total;
      std::printf("  %-34s %8.4f -> %8.4f ms (x%.2f) x %3lld = %8.3f ms\n", r.name.c_str(), r.ms, per_call,
                  per_call / r.ms, (long long)r.per_step, total);
    }
  }
  std::printf("  sustained micro-batch: gemms %.1f ms, everything else %.1f ms (%.0f tokens/s for forward + backward)\n",
              sus_gemm, sus_other, 1e3 * static_cast<double>(N) / (sus_gemm + sus_other));
  return 0;
}

// The FP8 products' parts at laplace-3b's four body projections (ops/backend.h's FP8 quantisers
// and gemm_e4m3, as Model::project and project_backward call them): each quantiser's time and its
// rate in GB/s of operand read once plus codes written, each FP8 product against the bf16 gemm
// it replaces (the forward product also with fast accumulation, which the totals leave out), and
// per micro-batch (training, M tokens) and per decode step (B rows) the totals over L layers.
int bench_fp8_ops(Backend& e, const Config& c, int64_t B, int64_t M, int64_t L, int reps) {
  const int64_t D = c.hidden_size, R = c.qkvg_rows(), F = c.ffn_size, HV = c.num_heads * c.head_v_dim;
  struct Proj {
    const char* name;
    int64_t in, out;
  };
  const Proj projs[] = {{"qkvg", D, R}, {"wo", HV, D}, {"w12", D, 2 * F}, {"w3", F, D}};
  int64_t in_max = 0, out_max = 0;
  for (const Proj& p : projs) in_max = std::max(in_max, p.in), out_max = std::max(out_max, p.out);
  const DType bf = DType::kBF16, f32 = DType::kF32, f8 = DType::kF8E4M3;
  Arena a;
  // Flat buffers, viewed at each projection's shapes.
  Status st = a.create({{"x", bf, {M * in_max}},      {"dy", bf, {M * out_max}},     {"y", bf, {M * out_max}},
                        {"dx", bf, {M * in_max}},     {"w", bf, {out_max * in_max}}, {"gw", f32, {out_max * in_max}},
                        {"xq", f8, {M * in_max}},     {"xs", f32, {M}},              {"dyq", f8, {M * out_max}},
                        {"dys", f32, {M}},            {"dytq", f8, {M * out_max}},   {"dyts", f32, {out_max}},
                        {"xtq", f8, {M * in_max}},    {"xts", f32, {in_max}},        {"wq", f8, {out_max * in_max}},
                        {"ws", f32, {out_max}},       {"wtq", f8, {out_max * in_max}}, {"wts", f32, {in_max}}},
                       e.allocator(), "bench_ops fp8");
  if (!st.is_ok()) {
    std::fprintf(stderr, "bench_ops: fp8: %s\n", st.to_string().c_str());
    return 1;
  }
  auto t = [&](const char* n) { return a.tensor(static_cast<size_t>(a.find(n))); };
  fill_inputs(e, a);
  auto mat = [&](const char* n, int64_t r, int64_t cc) { return t(n).slice(0, 0, r * cc).reshape({r, cc}); };
  auto vec = [&](const char* n, int64_t len) { return t(n).slice(0, 0, len); };
  auto gbs = [](double bytes, double ms) { return bytes / (ms * 1e6); };
  std::printf("FP8 parts, laplace-3b projections; decode %lld rows, training %lld tokens, %lld layers\n",
              (long long)B, (long long)M, (long long)L);
  double dec_bf16 = 0, dec_fp8 = 0, tr_bf16 = 0, tr_fp8 = 0, tr_quant = 0;
  for (const Proj& p : projs) {
    const int64_t K = p.in, O = p.out;
    const Tensor w = mat("w", O, K), wq = mat("wq", O, K), ws = vec("ws", O);
    const Tensor wtq = mat("wtq", K, O), wts = vec("wts", K);
    e.quantize_rows_e4m3(w, wq, ws);
    e.quantize_cols_e4m3(w, wtq, wts);
    for (const int64_t n : {B, M}) {
      const Tensor x = mat("x", n, K), y = mat("y", n, O);
      const Tensor xq = mat("xq", n, K), xs = vec("xs", n);
      const double q_rows = time_ms(e, reps, [&] { e.quantize_rows_e4m3(x, xq, xs); });
      const double g8 = time_ms(e, reps, [&] { e.gemm_e4m3(xq, xs, wq, ws, Tensor{}, y, Fp8Accum::kF32); });
      const double g8f = time_ms(e, reps, [&] { e.gemm_e4m3(xq, xs, wq, ws, Tensor{}, y, Fp8Accum::kFast); });
      const double g16 = time_ms(e, reps, [&] { e.gemm(x, false, w, true, y, 1.0, 0.0); });
      std::printf("  %-4s [%6lld, %5lld] x [%5lld]: quantize rows %.4f ms (%5.0f GB/s) | gemm fp8 %.4f ms (fast "
                  "accumulation %.4f), bf16 %.4f ms (x %.2f)\n",
                  p.name, (long long)n, (long long)K, (long long)O, q_rows, gbs(3.0 * n * K, q_rows), g8, g8f, g16,
                  g16 / g8);
      if (n == B) {
        dec_bf16 += g16 * L, dec_fp8 += (q_rows + g8) * L;
        continue;
      }
      const Tensor dy = mat("dy", n, O), dx = mat("dx", n, K), gw = mat("gw", O, K);
      const Tensor dyq = mat("dyq", n, O), dys = vec("dys", n);
      const Tensor dytq = mat("dytq", O, n), dyts = vec("dyts", O);
      const Tensor xtq = mat("xtq", K, n), xts = vec("xts", K);
      const double q_dy = time_ms(e, reps, [&] { e.quantize_rows_e4m3(dy, dyq, dys); });
      const double c_dy = time_ms(e, reps, [&] { e.quantize_cols_e4m3(dy, dytq, dyts); });
      const double c_x = time_ms(e, reps, [&] { e.quantize_cols_e4m3(x, xtq, xts); });
      const double rc_dy = time_ms(e, reps, [&] { e.quantize_rows_cols_e4m3(dy, dyq, dys, dytq, dyts); });
      const double g8_dx = time_ms(e, reps, [&] { e.gemm_e4m3(dyq, dys, wtq, wts, Tensor{}, dx, Fp8Accum::kF32); });
      const double g8_dw = time_ms(e, reps, [&] { e.gemm_e4m3(dytq, dyts, xtq, xts, gw, gw, Fp8Accum::kF32); });
      const double g16_dx = time_ms(e, reps, [&] { e.gemm(dy, false, w, false, dx, 1.0, 0.0); });
      const double g16_dw = time_ms(e, reps, [&] { e.gemm(dy, true, x, false, gw, 1.0, 1.0); });
      std::printf("        backward: quantize dY rows %.4f ms (%5.0f GB/s), dY cols %.4f ms (%5.0f GB/s), X cols %.4f "
                  "ms (%5.0f GB/s)\n",
                  q_dy, gbs(3.0 * n * O, q_dy), c_dy, gbs(3.0 * n * O, c_dy), c_x, gbs(3.0 * n * K, c_x));
      std::printf("        backward: quantize dY rows and cols at once %.4f ms (%5.0f GB/s), the two apart %.4f ms\n",
                  rc_dy, gbs(4.0 * n * O, rc_dy), q_dy + c_dy);
      std::printf("        backward: dX fp8 %.4f ms, bf16 %.4f ms (x %.2f) | dW fp8 %.4f ms, bf16 %.4f ms (x %.2f)\n", g8_dx,
                  g16_dx, g16_dx / g8_dx, g8_dw, g16_dw, g16_dw / g8_dw);
      const double quant = q_rows + rc_dy + c_x;  // what Model::project and project_backward call
      tr_quant += quant * L;
      tr_fp8 += (quant + g8 + g8_dx + g8_dw) * L;
      tr_bf16 += (g16 + g16_dx + g16_dw) * L;
    }
  }
  // LayerNorm and W_12's input codes, SwiGLU and W_3's, as FP8 inference runs them
  // (layernorm_forward_e4m3, swiglu_forward_e4m3) against the two ops each.
  const Tensor nw = mat("w", 1, D).reshape({D}), nb = mat("y", 1, D).reshape({D});
  for (const int64_t n : {B, M}) {
    const Tensor x = mat("x", n, D), z = mat("dx", n, D), zq = mat("xq", n, D), zs = vec("xs", n);
    const double two = time_ms(e, reps, [&] {
      e.layernorm_forward(x, nw, nb, 1e-5, z, Tensor{}, Tensor{});
      e.quantize_rows_e4m3(z, zq, zs);
    });
    const double one = time_ms(e, reps, [&] { e.layernorm_forward_e4m3(x, nw, nb, 1e-5, z, zq, zs); });
    std::printf("  layernorm + W_12's input codes [%6lld, %5lld]: two ops %.4f ms, one pass %.4f ms (%5.0f GB/s)\n",
                (long long)n, (long long)D, two, one, gbs(3.0 * n * D, one));
  }
  for (const int64_t n : {B, M}) {
    const Tensor ab = mat("dy", n, 2 * F), h = mat("dx", n, F), hq = mat("xq", n, F), hs = vec("xs", n);
    const double two = time_ms(e, reps, [&] {
      e.swiglu_forward(ab, h);
      e.quantize_rows_e4m3(h, hq, hs);
    });
    const double one = time_ms(e, reps, [&] { e.swiglu_forward_e4m3(ab, h, hq, hs); });
    std::printf("  swiglu + W_3's input codes [%6lld, %5lld]: two ops %.4f ms, one pass %.4f ms (%5.0f GB/s)\n",
                (long long)n, (long long)F, two, one, gbs(5.0 * n * F, one));
  }
  std::printf("decode step, %lld layers: projections bf16 %.3f ms, fp8 %.3f ms (quantisers included)\n", (long long)L,
              dec_bf16, dec_fp8);
  std::printf("training micro-batch, %lld layers: projections bf16 %.3f ms, fp8 %.3f ms, of which quantisers %.3f ms\n",
              (long long)L, tr_bf16, tr_fp8, tr_quant);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  int64_t B = 1280, P = 8192, L = 24, TB = 8, TT = 2048;
  int reps = 10;
  std::string only;
  CLI::App app{"bench_ops: the ops of a laplace-3b decode step, prefill and training micro-batch, one by one"};
  app.add_option("--batch", B, "decode rows")->check(CLI::Range(1, 1 << 30));
  app.add_option("--prompt", P, "prefill tokens")->check(CLI::Range(1, 1 << 30));
  app.add_option("--layers", L, "layers (per-step totals)")->check(CLI::Range(1, 1 << 30));
  app.add_option("--reps", reps, "timed calls per op (mean)")->check(CLI::Range(1, 1 << 30));
  app.add_option("--train-batch", TB, "training micro-batch")->check(CLI::Range(1, 1 << 30));
  app.add_option("--train-seq", TT, "training tokens per sequence")->check(CLI::Range(1, 1 << 30));
  app.add_option("--only", only, "one section")->check(CLI::IsMember({"decode", "prefill", "train", "fp8"}));
  app.add_option("--random", g_random, "1: uniform noise inputs instead of the constant 0.01");
  CLI11_PARSE(app, argc, argv);
  std::string why;
  std::unique_ptr<Backend> be = make_cuda_backend(&why);
  if (!be) {
    std::fprintf(stderr, "bench_ops: skipped: no CUDA device: %s\n", why.c_str());
    return 0;
  }
  Config c;
  c.vocab_size = 92160, c.hidden_size = 3072, c.num_layers = 1, c.num_heads = 16;
  c.head_k_dim = 96, c.head_v_dim = 192, c.ffn_size = 8192, c.chunk_size = 128;
  if (only == "train") return bench_train_ops(*be, c, TB, TT, L, reps);
  if (only == "fp8") return bench_fp8_ops(*be, c, B, TB * TT, L, reps);
  const int64_t D = c.hidden_size, R = c.qkvg_rows(), F = c.ffn_size, V = c.vocab_size, H = c.num_heads;
  const int64_t dk = c.head_k_dim, dv = c.head_v_dim, K = c.conv_size;
  const int64_t N = std::max(B, P);
  const DType bf = DType::kBF16;
  Arena a;
  Status st = a.create({{"wqkvg", bf, {R, D}},
                        {"wo", bf, {D, H * dv}},
                        {"w12", bf, {2 * F, D}},
                        {"w3", bf, {D, F}},
                        {"head", bf, {V, D}},
                        {"norm_w", bf, {D}},
                        {"norm_b", bf, {D}},
                        {"conv_w", bf, {D, K}},
                        {"onorm_w", bf, {dv}},
                        {"x", bf, {N, D}},      // residual stream
                        {"u", bf, {N, D}},      // norm output
                        {"c", bf, {N, D}},      // conv output
                        {"qkvg", bf, {N, R}},   // projection
                        {"o", bf, {N, H * dv}}, // GLA output
                        {"y", bf, {N, H * dv}}, // gated output
                        {"ab", bf, {N, 2 * F}},
                        {"h", bf, {N, F}},
                        {"logits", DType::kF32, {B, V}},
                        {"ids", DType::kI32, {B}},
                        {"mean", DType::kF32, {N}},
                        {"rstd", DType::kF32, {N}}},
                       be->allocator(), "bench_ops");
  if (!st.is_ok()) {
    std::fprintf(stderr, "bench_ops: %s\n", st.to_string().c_str());
    return 1;
  }
  auto t = [&](const char* n) { return a.tensor(static_cast<size_t>(a.find(n))); };
  fill_inputs(*be, a);
  StatePool p32, p16;
  if (!p32.create(c, *be, B + 1, DType::kF32).is_ok() || !p16.create(c, *be, B + 1, DType::kBF16).is_ok()) {
    std::fprintf(stderr, "bench_ops: out of memory for the state pools\n");
    return 1;
  }
  std::vector<int32_t> sl(static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b) sl[b] = static_cast<int32_t>(b);
  Tensor slots = t("ids");
  be->copy(slots, Tensor(sl.data(), DType::kI32, {B}));

  GlaParams gp;
  gp.form = GlaForm::kRecurrent;
  gp.chunk = 128;
  gp.scale = 1.0 / std::sqrt(static_cast<double>(dk));
  gp.decay = c.decays();
  auto rows = [](const Tensor& x, int64_t n) { return x.slice(0, 0, n); };
  auto heads = [&](const Tensor& x2, int64_t n, int64_t col, int64_t d) { return heads_view(x2, n, 1, H, col, d); };

  // ---- decode step, B rows of one token ----
  Backend& e = *be;
  char title[128];
  if (only.empty() || only == "decode") {
    std::vector<Row> dec;
    const Tensor x = rows(t("x"), B), u = rows(t("u"), B), cc = rows(t("c"), B), q = rows(t("qkvg"), B);
    const Tensor y = rows(t("y"), B), ab = rows(t("ab"), B), hh = rows(t("h"), B);
    dec.push_back({"layernorm", time_ms(e, reps, [&] { e.layernorm_forward(x, t("norm_w"), t("norm_b"), 1e-5, u, rows(t("mean"), B), rows(t("rstd"), B)); }), 2 * L + 1});
    Tensor win = p32.conv(0);
    dec.push_back({"conv_silu (slots, F32 window)", time_ms(e, reps, [&] { e.conv_silu_forward(btc_view(u, B, 1), t("conv_w"), btc_view(cc, B, 1), Tensor{}, win, win, slots); }), L});
    dec.push_back({"gemm qkvg [B,3072]x[3072,9216]", time_ms(e, reps, [&] { e.gemm(cc, false, t("wqkvg"), true, q, 1.0, 0.0); }), L});
    auto qh = heads(t("qkvg"), B, 0, dk), kh = heads(t("qkvg"), B, H * dk, dk), vh = heads(t("qkvg"), B, 2 * H * dk, dv),
         gh = heads(t("qkvg"), B, 2 * H * dk + H * dv, dv);
    auto oh = heads(t("o"), B, 0, dv), yh = heads(t("y"), B, 0, dv);
    Tensor s32 = p32.gla(0), s16 = p16.gla(0);
    dec.push_back({"gla_decode_gate F32 state", time_ms(e, reps, [&] { e.gla_decode_gate(gp, qh, kh, vh, gh, t("onorm_w"), 1e-5, s32, slots, oh, yh); }), L});
    const double g16 = time_ms(e, reps, [&] { e.gla_decode_gate(gp, qh, kh, vh, gh, t("onorm_w"), 1e-5, s16, slots, oh, yh); });
    dec.push_back({"gemm wo [B,3072]x[3072,3072] +=", time_ms(e, reps, [&] { e.gemm(y, false, t("wo"), true, x, 1.0, 1.0); }), L});
    dec.push_back({"gemm w12 [B,3072]x[3072,16384]", time_ms(e, reps, [&] { e.gemm(u, false, t("w12"), true, ab, 1.0, 0.0); }), L});
    dec.push_back({"swiglu", time_ms(e, reps, [&] { e.swiglu_forward(ab, hh); }), L});
    dec.push_back({"gemm w3 [B,8192]x[8192,3072] +=", time_ms(e, reps, [&] { e.gemm(hh, false, t("w3"), true, x, 1.0, 1.0); }), L});
    dec.push_back({"gemm head [B,3072]x[3072,92160] F32", time_ms(e, reps, [&] { e.gemm(u, false, t("head"), true, t("logits"), 1.0, 0.0); }), 1});
    dec.push_back({"argmax_rows [B,92160]", time_ms(e, reps, [&] { e.argmax_rows(t("logits"), slots); }), 1});
    be->copy(slots, Tensor(sl.data(), DType::kI32, {B}));
    std::snprintf(title, sizeof title, "decode step, %lld rows, %lld layers", (long long)B, (long long)L);
    print(title, dec);
    const double state_bytes = 2.0 * static_cast<double>(B) * H * dk * dv;
    std::printf("  gla_decode_gate: F32 state %.1f GB/s, BF16 state %.4f ms = %.1f GB/s (state read + write)\n",
                state_bytes * 4 / (dec[3].ms * 1e6), g16, state_bytes * 2 / (g16 * 1e6));
    // Deferred write-back (--defer-writeback R in the engine): the mean of R consecutive steps,
    // one of which writes the states back, against the every-step kernel above.
    for (int64_t R : {4, 8, 16}) {
      for (DType sdt : {DType::kF32, DType::kBF16}) {
        StatePool pd;
        if (!pd.create(c, *be, B + 1, sdt, {R, bf}).is_ok()) {
          std::fprintf(stderr, "bench_ops: out of memory for a deferred state pool\n");
          return 1;
        }
        const Tensor sd = pd.gla(0);
        const GlaPending pend = pd.pending(0);
        auto cycle = [&] {  // R steps: R − 1 pending, one write-back
          for (int64_t i = 0; i < R; ++i)
            e.gla_decode_gate_deferred(gp, qh, kh, vh, gh, t("onorm_w"), 1e-5, sd, pend, slots, oh, yh);
        };
        const double ms = time_ms(e, reps, cycle) / static_cast<double>(R);
        // The two kinds of step apart: R − 1 steps from empty tails (no write-back), less the
        // counts' reset, give the pending step; the cycle's rest is the write-back step.
        auto reset = [&] { e.fill(pend.count, 0.0); };
        auto pending = [&] {
          reset();
          for (int64_t i = 0; i + 1 < R; ++i)
            e.gla_decode_gate_deferred(gp, qh, kh, vh, gh, t("onorm_w"), 1e-5, sd, pend, slots, oh, yh);
        };
        const double tp = (time_ms(e, reps, pending) - time_ms(e, reps, reset)) / static_cast<double>(R - 1);
        const double tw = ms * static_cast<double>(R) - tp * static_cast<double>(R - 1);
        // Sequences out of step, as under staggered arrivals: slot s starts at count s mod R, so
        // about 1/R of every step's blocks write back beside the others' pending steps.
        for (int64_t s = 0; s < pend.count.shape[0]; ++s) e.fill(pend.count.slice(0, s, s + 1), static_cast<double>(s % R));
        const double mixed = time_ms(e, reps, cycle) / static_cast<double>(R);
        // Heads out of step, as the engine runs after a prefill: the flush starts head h's
        // cycle at phase h mod R (ops/backend.h), so 1/R of each sequence's heads write back
        // at every step even when all sequences were admitted together.
        e.gla_pending_flush(gp, sd, pend, slots);
        const double phased = time_ms(e, reps, cycle) / static_cast<double>(R);
        const double every = sdt == DType::kF32 ? dec[3].ms : g16;
        std::printf("  gla_decode_gate_deferred R = %2lld, %s state: %.4f ms per step (%.2fx the every-step kernel); "
                    "pending step %.4f ms, write-back step %.4f ms; sequences out of step %.4f ms; "
                    "heads out of step (engine) %.4f ms\n",
                    (long long)R, dtype_name(sdt), ms, every / ms, tp, tw, mixed, phased);
      }
    }
    // The BF16 deferred kernel without its bulk copies, for comparison in the same run: the same
    // states with padded rows (row stride dv + 8) take the per-thread loads (bulk_fits in
    // kernels_gla_decode.cu), with the heads phased as above.
    {
      const int64_t R8 = 8;
      StatePool pd;
      Arena pad;
      if (!pd.create(c, *be, B + 1, bf, {R8, bf}).is_ok() ||
          !pad.create({{"padded", bf, {B + 1, H, dk, dv + 8}}}, be->allocator(), "bench_ops padded").is_ok()) {
        std::fprintf(stderr, "bench_ops: out of memory for the padded state pool\n");
        return 1;
      }
      const Tensor sd = pad.tensor(0).slice(3, 0, dv);
      const GlaPending pend = pd.pending(0);
      e.gla_pending_flush(gp, sd, pend, slots);
      const double phased = time_ms(e, reps, [&] {
                              for (int64_t i = 0; i < R8; ++i)
                                e.gla_decode_gate_deferred(gp, qh, kh, vh, gh, t("onorm_w"), 1e-5, sd, pend, slots,
                                                           oh, yh);
                            }) /
                            static_cast<double>(R8);
      std::printf("  gla_decode_gate_deferred R =  8, BF16 state, rows padded to dv + 8 (per-thread loads, no bulk "
                  "copies): heads out of step (engine) %.4f ms\n",
                  phased);
    }
  }
  if (only == "decode") return 0;

  // ---- prefill, one prompt of P tokens ----
  std::vector<Row> pre;
  const Tensor xp = rows(t("x"), P), up = rows(t("u"), P), cp = rows(t("c"), P), qp = rows(t("qkvg"), P);
  const Tensor yp = rows(t("y"), P), abp = rows(t("ab"), P), hp = rows(t("h"), P);
  Tensor win1 = p32.conv(0).slice(0, 0, 1);
  auto q4 = [&](int64_t col, int64_t d) { return heads_view(qp, 1, P, H, col, d); };
  const Tensor o4 = heads_view(t("o"), 1, P, H, 0, dv), y4 = heads_view(t("y"), 1, P, H, 0, dv);
  GlaParams gc = gp;
  gc.form = GlaForm::kChunked;
  Tensor st1 = p32.gla(0).slice(0, 0, 1);
  const std::function<void()> ops[] = {
      [&] { e.layernorm_forward(xp, t("norm_w"), t("norm_b"), 1e-5, up, rows(t("mean"), P), rows(t("rstd"), P)); },
      [&] { e.conv_silu_forward(btc_view(up, 1, P), t("conv_w"), btc_view(cp, 1, P), Tensor{}, win1, win1, Tensor{}); },
      [&] { e.gemm(cp, false, t("wqkvg"), true, qp, 1.0, 0.0); },
      [&] { e.gla_forward(gc, q4(0, dk), q4(H * dk, dk), q4(2 * H * dk, dv), o4, st1, st1, Tensor{}); },
      [&] { e.rmsnorm_gate_forward(o4, q4(2 * H * dk + H * dv, dv), t("onorm_w"), 1e-5, y4, Tensor{}); },
      [&] { e.gemm(yp, false, t("wo"), true, xp, 1.0, 1.0); },
      [&] { e.gemm(up, false, t("w12"), true, abp, 1.0, 0.0); },
      [&] { e.swiglu_forward(abp, hp); },
      [&] { e.gemm(hp, false, t("w3"), true, xp, 1.0, 1.0); }};
  const char* names[] = {"layernorm", "conv_silu", "gemm qkvg", "gla_forward chunked (state in/out)", "rmsnorm_gate",
                         "gemm wo +=", "gemm w12", "swiglu", "gemm w3 +="};
  for (int i = 0; i < 9; ++i) pre.push_back({names[i], time_ms(e, reps, ops[i]), i == 0 ? 2 * L : L, ops[i]});
  std::snprintf(title, sizeof title, "prefill, one %lld-token prompt, %lld layers", (long long)P, (long long)L);
  print(title, pre);
  const double gemm_flop = 2.0 * P * (static_cast<double>(R) * D + D * H * dv + 2.0 * F * D + static_cast<double>(D) * F);
  const double gemm_ms = pre[2].ms + pre[5].ms + pre[6].ms + pre[8].ms;
  std::printf("  prefill gemms: %.1f TFLOP/s\n", gemm_flop / (gemm_ms * 1e9));
  // The same ops in the model's order (LayerNorm twice per layer), L layers back to back as a
  // prefill runs them; the sum above times each op on its own. Their difference is what
  // running in sequence costs (power, caches), not the model's code.
  auto prompt = [&] {
    for (int64_t l = 0; l < L; ++l)
      for (int i : {0, 1, 2, 3, 4, 5, 0, 6, 7, 8}) ops[i]();
  };
  std::printf("  in sequence, %lld layers: %.3f ms per prompt\n", (long long)L, time_ms(e, std::max(1, reps / 4), prompt));
  if (!only.empty()) return 0;
  return bench_train_ops(*be, c, TB, TT, L, reps);
}
