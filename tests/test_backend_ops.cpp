// One table of op cases — (op, shapes, dtype, tolerance) — run on every backend this build
// has and compared with the CPU backend in F64, as ggml's test-backend-ops does. Each case
// draws its inputs once (seeded, rounded to the tested dtype, so both sides see the same
// values), runs the op on the tested backend in that dtype and on the reference in F64, and
// compares every output: max|a − b| / max|b| ≤ the case's tolerance (argmax: equal). Every
// buffer on the tested backend sits between guard elements holding a NaN pattern; an op that
// writes outside its tensor changes them and fails the case. A backend that declines a case
// (Backend::supports) is skipped with a message, never silently converted. Every case then
// runs a second time from the same inputs and must give the same bytes.
//
// Shape sets: small shapes that cut chunks and tiles short, then the head shapes of laplace-tiny
// (H 4, dk 32, dv 64, chunk 64) and laplace-3b (H 16, dk 96, dv 192, chunk 128; D 3072, F 8192,
// V 92160) where the CUDA kernels take their tensor-core, vectorised and multi-block paths. A
// padded argument (`padded`) is a view whose token rows sit `pad` elements apart beyond their
// width, as the model's q, k, v and g are views into one projection: the kernels' strided (generic)
// paths; the padding holds the guard pattern, so reading it gives NaN and writing it is caught.
//
// Backends: the CPU in F32 (always) and CUDA in F32 and BF16 when a GPU is present.
// LAPLACE_OPS_PERF=1 also times each case on the tested backend (median of 10 runs);
// LAPLACE_OPS_VERBOSE=1 prints every compared output's error.
//
// Tolerances: F32 ≤ 2e-5 (the F32 rounding of sums over at most a few hundred terms), the
// GLA ops ≤ 1e-4 (chunked sums of products of decays); BF16 outputs ≤ 1e-2 (one bf16 rounding
// of the output, 2^-8 relative); F32 outputs of BF16 inputs ≤ 1e-4. I32 outputs and FP8 codes
// are compared exactly (both backends quantise with the same rounded reciprocal: core/fp8.h).
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "core/check.h"
#include "ops/backend.h"
#include "tests/test_util.h"
#ifdef LAPLACE_HAVE_CUDA
#include "ops/cuda/cuda_backend.h"
#endif

namespace laplace {
namespace {

enum class Init { kUniform, kPositive, kIds, kTargets, kSlots, kDocs, kZero, kOne };

struct Arg {
  std::vector<int64_t> shape;
  Init init = Init::kUniform;
  bool compared = false;            // an output (or in-place operand) checked after the op
  std::optional<DType> fixed = {};  // this dtype on every side (I32 ids, F64 sums); else the case's
  int64_t range = 0;                // ids/targets in [0, range); slots a permutation of [0, range)
  bool f32_at_bf16 = false;         // F32 where the case runs in BF16, as the model keeps it (below)
  int64_t pad = 0;                  // elements between token rows beyond their width (padded)
};

Arg in(std::vector<int64_t> s, Init i = Init::kUniform) { return Arg{std::move(s), i}; }
Arg out(std::vector<int64_t> s) { return Arg{std::move(s), Init::kUniform, true}; }
Arg io(std::vector<int64_t> s, Init i = Init::kUniform) { return Arg{std::move(s), i, true}; }
Arg ids(std::vector<int64_t> s, int64_t range, Init i = Init::kIds) { return Arg{std::move(s), i, false, DType::kI32, range}; }
Arg ints_out(std::vector<int64_t> s) { return Arg{std::move(s), Init::kUniform, true, DType::kI32}; }
Arg f64_out(std::vector<int64_t> s) { return Arg{std::move(s), Init::kUniform, true, DType::kF64}; }
// Document starts [B, T] (GlaParams::doc) with chunk 8: even rows start documents at 0, mid-chunk
// (5), at both chunk edges (8, 16) and hold a one-token document (16); odd rows continue the
// initial state up to 3, then a one-token document (3) and starts at 4 and mid-chunk (11).
Arg docs(std::vector<int64_t> s) { return Arg{std::move(s), Init::kDocs, false, DType::kI32}; }

// A device scalar (one F64 element on the tested backend: the optimizer's norm, clip and skip).
Arg scalar(Init i = Init::kPositive) { return Arg{{1}, i, false, DType::kF64}; }
Arg scalar_io(Init i = Init::kPositive) { return Arg{{1}, i, true, DType::kF64}; }
// FP8 codes (compared exactly) and their F32 scales, whatever dtype the case runs in.
Arg codes(std::vector<int64_t> s) { return Arg{std::move(s), Init::kUniform, false, DType::kF8E4M3}; }
Arg codes_out(std::vector<int64_t> s) { return Arg{std::move(s), Init::kUniform, true, DType::kF8E4M3}; }
Arg scales(std::vector<int64_t> s) { return Arg{std::move(s), Init::kPositive, false, DType::kF32}; }
Arg scales_out(std::vector<int64_t> s) { return Arg{std::move(s), Init::kUniform, true, DType::kF32}; }
// The argument as a view whose token rows (dim 1 of [B, T, H, d], dim 0 of a matrix) lie `pad`
// elements apart beyond their width.
Arg padded(Arg a, int64_t pad = 8) {
  a.pad = pad;
  return a;
}

// Where a case runs in BF16, these stay F32, as the model and the CUDA kernels keep them: norm statistics,
// GLA states of the chunked forms, per-row losses, master weights and optimizer moments.
Arg f32(Arg a) {
  a.f32_at_bf16 = true;
  return a;
}

using Run = std::function<void(Backend&, const std::vector<Tensor>&)>;

struct OpCase {
  std::string op, label;
  std::vector<int64_t> dims;  // what supports() is asked about (GLA: H, dk, dv)
  std::vector<Arg> args;
  double tol_f32 = 2e-5, tol_bf16 = 1e-2;
  Run run;
};

GlaParams gla_params(GlaForm form, int64_t chunk, int64_t H) {
  GlaParams p;
  p.form = form;
  p.chunk = chunk;
  p.scale = 0.35;
  for (int64_t h = 0; h < H; ++h) p.decay.push_back(0.9 + 0.07 * static_cast<double>(h) / std::max<int64_t>(H - 1, 1));
  return p;
}

// Products, the embedding, the norms and the conv, at small shapes.
void dense_row_and_conv_cases(std::vector<OpCase>& v) {
  auto add = [&](OpCase c) { v.push_back(std::move(c)); };
  // ---- dense
  add({"gemm", "[64,96]·[96,80]", {}, {in({64, 96}), in({96, 80}), out({64, 80})},
       2e-5, 1e-2, [](Backend& b, const std::vector<Tensor>& t) { b.gemm(t[0], false, t[1], false, t[2], 1.0, 0.0); }});
  add({"gemm", "[64,96]·[80,96]ᵀ, alpha 0.5", {}, {in({64, 96}), in({80, 96}), out({64, 80})},
       2e-5, 1e-2, [](Backend& b, const std::vector<Tensor>& t) { b.gemm(t[0], false, t[1], true, t[2], 0.5, 0.0); }});
  add({"gemm", "[96,33]ᵀ·[96,40] + 0.5·c", {}, {in({96, 33}), in({96, 40}), io({33, 40})},
       2e-5, 1e-2, [](Backend& b, const std::vector<Tensor>& t) { b.gemm(t[0], true, t[1], false, t[2], 1.0, 0.5); }});
  add({"gemm_add", "d = a·bᵀ + c", {}, {in({17, 48}), in({24, 48}), in({17, 24}), out({17, 24})},
       2e-5, 1e-2, [](Backend& b, const std::vector<Tensor>& t) { b.gemm_add(t[0], false, t[1], true, t[2], t[3], 1.0, 1.0); }});
  // ---- embedding
  add({"embedding_forward", "37 ids of 50, D 24", {}, {ids({37}, 50), in({50, 24}), out({37, 24})},
       2e-5, 1e-2, [](Backend& b, const std::vector<Tensor>& t) { b.embedding_forward(t[0], t[1], t[2]); }});
  add({"embedding_backward", "37 ids of 12 (repeats), accumulate", {}, {ids({37}, 12), in({37, 24}), io({12, 24})},
       2e-5, 1e-2, [](Backend& b, const std::vector<Tensor>& t) { b.embedding_backward(t[0], t[1], t[2]); }});
  // About 75 tokens per id: runs of one id that cross the CUDA kernel's 128-position tiles.
  add({"embedding_backward", "600 ids of 8 (long runs), accumulate", {}, {ids({600}, 8), in({600, 40}), f32(io({8, 40}))},
       2e-5, 1e-2, [](Backend& b, const std::vector<Tensor>& t) { b.embedding_backward(t[0], t[1], t[2]); }});
  // ---- norms
  add({"layernorm_forward", "[33,40]", {}, {in({33, 40}), in({40}), in({40}), out({33, 40}), f32(out({33})), f32(out({33}))},
       2e-5, 1e-2, [](Backend& b, const std::vector<Tensor>& t) { b.layernorm_forward(t[0], t[1], t[2], 1e-5, t[3], t[4], t[5]); }});
  add({"layernorm_backward", "[33,40], dw db accumulate",
       {}, {in({33, 40}), in({33, 40}), in({40}), f32(in({33})), f32(in({33}, Init::kPositive)), out({33, 40}), io({40}), io({40})},
       2e-5, 1e-2, [](Backend& b, const std::vector<Tensor>& t) {
         b.layernorm_backward(t[0], t[1], t[2], t[3], t[4], t[5], false, t[6], t[7]);
       }});
  add({"rmsnorm_gate_forward", "[2,5,2,12]", {}, {in({2, 5, 2, 12}), in({2, 5, 2, 12}), in({12}), out({2, 5, 2, 12}), f32(out({2, 5, 2}))},
       2e-5, 1e-2, [](Backend& b, const std::vector<Tensor>& t) { b.rmsnorm_gate_forward(t[0], t[1], t[2], 1e-5, t[3], t[4]); }});
  add({"rmsnorm_gate_backward", "[2,5,2,12], dw accumulates",
       {}, {in({2, 5, 2, 12}), in({2, 5, 2, 12}), in({2, 5, 2, 12}), in({12}), f32(in({2, 5, 2}, Init::kPositive)),
            out({2, 5, 2, 12}), out({2, 5, 2, 12}), io({12})},
       2e-5, 1e-2, [](Backend& b, const std::vector<Tensor>& t) {
         b.rmsnorm_gate_backward(t[0], t[1], t[2], t[3], t[4], t[5], t[6], t[7]);
       }});
  // ---- conv
  add({"conv_silu_forward", "[2,9,16], K 4, zero window", {}, {in({2, 9, 16}), in({16, 4}), out({2, 9, 16}), out({2, 9, 16})},
       2e-5, 1e-2, [](Backend& b, const std::vector<Tensor>& t) { b.conv_silu_forward(t[0], t[1], t[2], t[3], {}, {}, {}); }});
  add({"conv_silu_forward", "[2,3,16] from windows in slots {2,0} of 3",
       {}, {in({2, 3, 16}), in({16, 4}), out({2, 3, 16}), io({3, 4, 16}), ids({2}, 3, Init::kSlots)},
       2e-5, 1e-2, [](Backend& b, const std::vector<Tensor>& t) { b.conv_silu_forward(t[0], t[1], t[2], {}, t[3], t[3], t[4]); }});
  add({"conv_silu_backward", "[2,9,16], dw accumulates",
       {}, {in({2, 9, 16}), in({2, 9, 16}), in({16, 4}), in({2, 9, 16}), out({2, 9, 16}), io({16, 4})},
       2e-5, 1e-2, [](Backend& b, const std::vector<Tensor>& t) { b.conv_silu_backward(t[0], t[1], t[2], t[3], t[4], t[5]); }});
  add({"conv_silu_forward", "[2,9,16], documents, windows in slots {2,0} of 3",
       {}, {in({2, 9, 16}), in({16, 4}), out({2, 9, 16}), out({2, 9, 16}), io({3, 4, 16}), ids({2}, 3, Init::kSlots), docs({2, 9})},
       2e-5, 1e-2, [](Backend& b, const std::vector<Tensor>& t) { b.conv_silu_forward(t[0], t[1], t[2], t[3], t[4], t[4], t[5], t[6]); }});
  add({"conv_silu_forward", "[2,19,16], documents, zero window", {}, {in({2, 19, 16}), in({16, 4}), out({2, 19, 16}), docs({2, 19})},
       2e-5, 1e-2, [](Backend& b, const std::vector<Tensor>& t) { b.conv_silu_forward(t[0], t[1], t[2], {}, {}, {}, {}, t[3]); }});
  add({"conv_silu_backward", "[2,19,16], documents, dw accumulates",
       {}, {in({2, 19, 16}), in({2, 19, 16}), in({16, 4}), in({2, 19, 16}), out({2, 19, 16}), io({16, 4}), docs({2, 19})},
       2e-5, 1e-2, [](Backend& b, const std::vector<Tensor>& t) { b.conv_silu_backward(t[0], t[1], t[2], t[3], t[4], t[5], t[6]); }});
}

// The GLA mixer in every form, at small shapes and at the models' head shapes.
void gla_cases(std::vector<OpCase>& v) {
  auto add = [&](OpCase c) { v.push_back(std::move(c)); };
  // ---- GLA (B 2, T 19, H 2, dk 8, dv 12; chunk 8 leaves a short tail chunk)
  const GlaParams chunked = gla_params(GlaForm::kChunked, 8, 2), recurrent = gla_params(GlaForm::kRecurrent, 8, 2);
  add({"gla_forward", "chunked, T 19, from and into states", {2, 8, 12},
       {in({2, 19, 2, 8}), in({2, 19, 2, 8}), in({2, 19, 2, 12}), out({2, 19, 2, 12}), f32(in({2, 2, 8, 12})), f32(out({2, 2, 8, 12}))},
       1e-4, 1e-2, [chunked](Backend& b, const std::vector<Tensor>& t) { b.gla_forward(chunked, t[0], t[1], t[2], t[3], t[4], t[5], {}); }});
  add({"gla_forward", "recurrent, T 5, zero state", {2, 8, 12},
       {in({2, 5, 2, 8}), in({2, 5, 2, 8}), in({2, 5, 2, 12}), out({2, 5, 2, 12})},
       1e-4, 1e-2, [recurrent](Backend& b, const std::vector<Tensor>& t) { b.gla_forward(recurrent, t[0], t[1], t[2], t[3], {}, {}, {}); }});
  add({"gla_backward", "chunked, T 19, state gradients", {2, 8, 12},
       {in({2, 19, 2, 8}), in({2, 19, 2, 8}), in({2, 19, 2, 12}), f32(in({2, 2, 8, 12})), in({2, 19, 2, 12}), f32(in({2, 2, 8, 12})),
        out({2, 19, 2, 8}), out({2, 19, 2, 8}), out({2, 19, 2, 12}), f32(out({2, 2, 8, 12}))},
       1e-4, 1e-2, [chunked](Backend& b, const std::vector<Tensor>& t) {
         b.gla_backward(chunked, t[0], t[1], t[2], t[3], t[4], t[5], t[6], t[7], t[8], t[9]);
       }});
  // Documents kept apart (varlen): the doc argument (last) is set into the params per call.
  auto with_doc = [](GlaParams p, const Tensor& doc) {
    p.doc = doc;
    return p;
  };
  add({"gla_forward", "chunked, T 19, documents, from and into states", {2, 8, 12},
       {in({2, 19, 2, 8}), in({2, 19, 2, 8}), in({2, 19, 2, 12}), out({2, 19, 2, 12}), f32(in({2, 2, 8, 12})), f32(out({2, 2, 8, 12})),
        docs({2, 19})},
       1e-4, 1e-2, [chunked, with_doc](Backend& b, const std::vector<Tensor>& t) {
         b.gla_forward(with_doc(chunked, t[6]), t[0], t[1], t[2], t[3], t[4], t[5], {});
       }});
  add({"gla_forward", "recurrent, T 19, documents, from a state", {2, 8, 12},
       {in({2, 19, 2, 8}), in({2, 19, 2, 8}), in({2, 19, 2, 12}), out({2, 19, 2, 12}), f32(in({2, 2, 8, 12})), f32(out({2, 2, 8, 12})),
        docs({2, 19})},
       1e-4, 1e-2, [recurrent, with_doc](Backend& b, const std::vector<Tensor>& t) {
         b.gla_forward(with_doc(recurrent, t[6]), t[0], t[1], t[2], t[3], t[4], t[5], {});
       }});
  add({"gla_backward", "chunked, T 19, documents, state gradients", {2, 8, 12},
       {in({2, 19, 2, 8}), in({2, 19, 2, 8}), in({2, 19, 2, 12}), f32(in({2, 2, 8, 12})), in({2, 19, 2, 12}), f32(in({2, 2, 8, 12})),
        out({2, 19, 2, 8}), out({2, 19, 2, 8}), out({2, 19, 2, 12}), f32(out({2, 2, 8, 12})), docs({2, 19})},
       1e-4, 1e-2, [chunked, with_doc](Backend& b, const std::vector<Tensor>& t) {
         b.gla_backward(with_doc(chunked, t[10]), t[0], t[1], t[2], t[3], t[4], t[5], t[6], t[7], t[8], t[9]);
       }});
  add({"gla_decode_gate", "3 rows in slots of 4, states in place", {2, 8, 12},
       {in({3, 1, 2, 8}), in({3, 1, 2, 8}), in({3, 1, 2, 12}), in({3, 1, 2, 12}), in({12}), io({4, 2, 8, 12}),
        ids({3}, 4, Init::kSlots), out({3, 1, 2, 12}), out({3, 1, 2, 12})},
       1e-4, 1e-2, [recurrent](Backend& b, const std::vector<Tensor>& t) {
         b.gla_decode_gate(recurrent, t[0], t[1], t[2], t[3], t[4], 1e-5, t[5], t[6], t[7], t[8]);
       }});
  // Speculative verification (R 4): 2 rows of T 4 in slots of 3, count words m ∈ {0, 1, 2}
  // (phase 0), so each head's write-back falls at position 3 − m: pending steps, the write-back
  // and steps after it in one window. The commit keeps 0 … 4 positions of each row.
  auto pend = [](const std::vector<Tensor>& t, size_t i) { return GlaPending{t[i], t[i + 1], t[i + 2], 4}; };
  add({"gla_verify_deferred", "T 4, R 4, slots {2,0} of 3, pending 0–2 pairs", {2, 8, 12},
       {in({2, 4, 2, 8}), in({2, 4, 2, 8}), in({2, 4, 2, 12}), in({2, 4, 2, 12}), in({12}), f32(in({3, 2, 8, 12})),
        in({3, 2, 3, 8}), in({3, 2, 3, 12}), ids({3, 2}, 3), ids({2}, 3, Init::kSlots), out({2, 4, 2, 12}),
        out({2, 4, 2, 12})},
       1e-4, 1e-2, [recurrent, pend](Backend& b, const std::vector<Tensor>& t) {
         b.gla_verify_deferred(recurrent, t[0], t[1], t[2], t[3], t[4], 1e-5, t[5], pend(t, 6), t[9], t[10], t[11]);
       }});
  add({"gla_verify_commit", "T 4, R 4, slots {2,0} of 3, 0–4 accepted", {2, 8, 12},
       {in({2, 4, 2, 8}), in({2, 4, 2, 12}), ids({2}, 5), f32(io({3, 2, 8, 12})), io({3, 2, 3, 8}), io({3, 2, 3, 12}),
        Arg{{3, 2}, Init::kIds, true, DType::kI32, 3}, ids({2}, 3, Init::kSlots)},
       1e-4, 1e-2, [recurrent, pend](Backend& b, const std::vector<Tensor>& t) {
         b.gla_verify_commit(recurrent, t[0], t[1], t[2], t[3], pend(t, 4), t[7]);
       }});
  // ---- GLA at the models' head shapes: laplace-tiny (H 4, dk 32, dv 64, chunk 64; T 150: two
  // chunks and a tail) and laplace-3b (H 16, dk 96, dv 192, chunk 128; T 300), the latter also with
  // q, k, v (and their gradients) as padded views, as the model's qkvg parts are, and documents.
  const GlaParams tiny = gla_params(GlaForm::kChunked, 64, 4), big = gla_params(GlaForm::kChunked, 128, 16);
  add({"gla_forward", "tiny heads, B 2, T 150, from and into states", {4, 32, 64},
       {in({2, 150, 4, 32}), in({2, 150, 4, 32}), in({2, 150, 4, 64}), out({2, 150, 4, 64}), f32(in({2, 4, 32, 64})),
        f32(out({2, 4, 32, 64}))},
       1e-4, 1e-2, [tiny](Backend& b, const std::vector<Tensor>& t) { b.gla_forward(tiny, t[0], t[1], t[2], t[3], t[4], t[5], {}); }});
  add({"gla_backward", "tiny heads, B 2, T 150, state gradients", {4, 32, 64},
       {in({2, 150, 4, 32}), in({2, 150, 4, 32}), in({2, 150, 4, 64}), f32(in({2, 4, 32, 64})), in({2, 150, 4, 64}),
        f32(in({2, 4, 32, 64})), out({2, 150, 4, 32}), out({2, 150, 4, 32}), out({2, 150, 4, 64}), f32(out({2, 4, 32, 64}))},
       1e-4, 1e-2, [tiny](Backend& b, const std::vector<Tensor>& t) {
         b.gla_backward(tiny, t[0], t[1], t[2], t[3], t[4], t[5], t[6], t[7], t[8], t[9]);
       }});
  add({"gla_forward", "3b heads, B 1, T 300, q k v padded", {16, 96, 192},
       {padded(in({1, 300, 16, 96})), padded(in({1, 300, 16, 96})), padded(in({1, 300, 16, 192})), out({1, 300, 16, 192})},
       1e-4, 1e-2, [big](Backend& b, const std::vector<Tensor>& t) { b.gla_forward(big, t[0], t[1], t[2], t[3], {}, {}, {}); }});
  add({"gla_forward", "3b heads, B 1, T 300", {16, 96, 192},
       {in({1, 300, 16, 96}), in({1, 300, 16, 96}), in({1, 300, 16, 192}), out({1, 300, 16, 192})},
       1e-4, 1e-2, [big](Backend& b, const std::vector<Tensor>& t) { b.gla_forward(big, t[0], t[1], t[2], t[3], {}, {}, {}); }});
  add({"gla_backward", "3b heads, B 1, T 300, q k v and dq dk dv padded", {16, 96, 192},
       {padded(in({1, 300, 16, 96})), padded(in({1, 300, 16, 96})), padded(in({1, 300, 16, 192})),
        in({1, 300, 16, 192}), padded(out({1, 300, 16, 96})), padded(out({1, 300, 16, 96})),
        padded(out({1, 300, 16, 192}))},
       1e-4, 1e-2, [big](Backend& b, const std::vector<Tensor>& t) {
         b.gla_backward(big, t[0], t[1], t[2], {}, t[3], {}, t[4], t[5], t[6], {});
       }});
  add({"gla_backward", "3b heads, B 1, T 300, documents", {16, 96, 192},
       {in({1, 300, 16, 96}), in({1, 300, 16, 96}), in({1, 300, 16, 192}), in({1, 300, 16, 192}),
        out({1, 300, 16, 96}), out({1, 300, 16, 96}), out({1, 300, 16, 192}), docs({1, 300})},
       1e-4, 1e-2, [big, with_doc](Backend& b, const std::vector<Tensor>& t) {
         b.gla_backward(with_doc(big, t[7]), t[0], t[1], t[2], {}, t[3], {}, t[4], t[5], t[6], {});
       }});
  add({"rmsnorm_gate_forward", "3b heads [1,300,16,192], gate padded", {},
       {in({1, 300, 16, 192}), padded(in({1, 300, 16, 192})), in({192}), out({1, 300, 16, 192}), f32(out({1, 300, 16}))},
       2e-5, 1e-2, [](Backend& b, const std::vector<Tensor>& t) { b.rmsnorm_gate_forward(t[0], t[1], t[2], 1e-5, t[3], t[4]); }});
  // Deferred write-back (R 4): count words m ∈ {0 … 3} (phase 0), so some rows write their state
  // back this step and the rest append a pair; then a flush folds every entry's pairs in.
  add({"gla_decode_gate_deferred", "3 rows in slots of 4, R 4, 0–3 pending pairs", {2, 8, 12},
       {in({3, 1, 2, 8}), in({3, 1, 2, 8}), in({3, 1, 2, 12}), in({3, 1, 2, 12}), in({12}), f32(io({4, 2, 8, 12})),
        io({4, 2, 3, 8}), io({4, 2, 3, 12}), Arg{{4, 2}, Init::kIds, true, DType::kI32, 4}, ids({3}, 4, Init::kSlots),
        out({3, 1, 2, 12}), out({3, 1, 2, 12})},
       1e-4, 1e-2, [recurrent, pend](Backend& b, const std::vector<Tensor>& t) {
         b.gla_decode_gate_deferred(recurrent, t[0], t[1], t[2], t[3], t[4], 1e-5, t[5], pend(t, 6), t[9], t[10], t[11]);
       }});
  add({"gla_pending_flush", "slots {2,0} of 3, R 4, 0–3 pending pairs", {2, 8, 12},
       {f32(io({3, 2, 8, 12})), in({3, 2, 3, 8}), in({3, 2, 3, 12}), Arg{{3, 2}, Init::kIds, true, DType::kI32, 4},
        ids({2}, 3, Init::kSlots)},
       1e-4, 1e-2, [recurrent, pend](Backend& b, const std::vector<Tensor>& t) {
         b.gla_pending_flush(recurrent, t[0], pend(t, 1), t[4]);
       }});
}

// Element-wise ops, losses and reductions, at small shapes and at laplace-3b's.
void elementwise_cases(std::vector<OpCase>& v) {
  auto add = [&](OpCase c) { v.push_back(std::move(c)); };
  // ---- element-wise, losses, reductions
  add({"swiglu_forward", "[13,2·20]", {}, {in({13, 40}), out({13, 20})},
       2e-5, 1e-2, [](Backend& b, const std::vector<Tensor>& t) { b.swiglu_forward(t[0], t[1]); }});
  add({"swiglu_backward", "[13,2·20]", {}, {in({13, 20}), in({13, 40}), out({13, 40})},
       2e-5, 1e-2, [](Backend& b, const std::vector<Tensor>& t) { b.swiglu_backward(t[0], t[1], t[2]); }});
  add({"argmax_rows", "[7,53]", {}, {in({7, 53}), ints_out({7})},
       0, 0, [](Backend& b, const std::vector<Tensor>& t) { b.argmax_rows(t[0], t[1]); }});
  add({"cross_entropy_forward", "[9,53], some targets ignored", {}, {in({9, 53}), ids({9}, 53, Init::kTargets), f32(out({9}))},
       2e-5, 1e-2, [](Backend& b, const std::vector<Tensor>& t) { b.cross_entropy_forward(t[0], t[1], t[2]); }});
  add({"cross_entropy_backward", "[9,53], scale 0.25", {}, {in({9, 53}), ids({9}, 53, Init::kTargets), out({9, 53})},
       2e-5, 1e-2, [](Backend& b, const std::vector<Tensor>& t) { b.cross_entropy_backward(t[0], t[1], 0.25, t[2]); }});
  add({"row_sum_squares", "[6,40] → F64", {}, {in({6, 40}), f64_out({6})},
       2e-5, 1e-2, [](Backend& b, const std::vector<Tensor>& t) { b.row_sum_squares(t[0], t[1]); }});
  add({"scale", "[11,7] ·= −1.5", {}, {io({11, 7})},
       2e-5, 1e-2, [](Backend& b, const std::vector<Tensor>& t) { b.scale(t[0], -1.5); }});
  add({"axpy", "y += 0.75·x", {}, {in({5, 9}), io({5, 9})},
       2e-5, 1e-2, [](Backend& b, const std::vector<Tensor>& t) { b.axpy(0.75, t[0], t[1]); }});
  // ---- at the model's shapes (laplace-3b: D 3072, F 8192, V 92160; 300 token rows, not a
  // multiple of any tile), where the CUDA kernels take their vectorised and multi-block paths
  add({"fill", "[1024,3072] = 0.25", {}, {out({1024, 3072})},
       0, 0, [](Backend& b, const std::vector<Tensor>& t) { b.fill(t[0], 0.25); }});
  add({"axpy", "[1024,3072] y += 0.37·x", {}, {in({1024, 3072}), io({1024, 3072})},
       2e-5, 1e-2, [](Backend& b, const std::vector<Tensor>& t) { b.axpy(0.37, t[0], t[1]); }});
  add({"axpy", "[1024,3072] F32 accumulator += x (BF16 gradients)", {}, {in({1024, 3072}), f32(io({1024, 3072}))},
       2e-5, 1e-2, [](Backend& b, const std::vector<Tensor>& t) { b.axpy(1.0, t[0], t[1]); }});
  add({"scale", "[1024,3072] ·= −1.7", {}, {io({1024, 3072})},
       2e-5, 1e-2, [](Backend& b, const std::vector<Tensor>& t) { b.scale(t[0], -1.7); }});
  add({"embedding_forward", "300 ids of 4096, D 3072", {}, {ids({300}, 4096), in({4096, 3072}), out({300, 3072})},
       0, 0, [](Backend& b, const std::vector<Tensor>& t) { b.embedding_forward(t[0], t[1], t[2]); }});
  add({"embedding_backward", "300 ids of 4096, D 3072, accumulate", {},
       {ids({300}, 4096), in({300, 3072}), f32(io({4096, 3072}))},
       2e-5, 1e-2, [](Backend& b, const std::vector<Tensor>& t) { b.embedding_backward(t[0], t[1], t[2]); }});
  add({"layernorm_forward", "[300,3072]", {},
       {in({300, 3072}), in({3072}, Init::kPositive), in({3072}), out({300, 3072}), f32(out({300})), f32(out({300}))},
       2e-5, 1e-2, [](Backend& b, const std::vector<Tensor>& t) { b.layernorm_forward(t[0], t[1], t[2], 1e-5, t[3], t[4], t[5]); }});
  add({"layernorm_backward", "[300,3072], dx accumulates, dw db accumulate", {},
       {in({300, 3072}), in({300, 3072}), in({3072}, Init::kPositive), f32(in({300})), f32(in({300}, Init::kPositive)),
        io({300, 3072}), f32(io({3072})), f32(io({3072}))},
       1e-4, 1e-2, [](Backend& b, const std::vector<Tensor>& t) {
         b.layernorm_backward(t[0], t[1], t[2], t[3], t[4], t[5], true, t[6], t[7]);
       }});
  add({"swiglu_forward", "[300,2·8192]", {}, {in({300, 16384}), out({300, 8192})},
       2e-5, 1e-2, [](Backend& b, const std::vector<Tensor>& t) { b.swiglu_forward(t[0], t[1]); }});
  add({"swiglu_backward", "[300,2·8192], in place", {}, {in({300, 8192}), io({300, 16384})},
       2e-5, 1e-2, [](Backend& b, const std::vector<Tensor>& t) { b.swiglu_backward(t[0], t[1], t[1]); }});
  add({"cross_entropy_forward", "[4,92160]", {}, {in({4, 92160}), ids({4}, 92160, Init::kTargets), f32(out({4}))},
       2e-5, 1e-2, [](Backend& b, const std::vector<Tensor>& t) { b.cross_entropy_forward(t[0], t[1], t[2]); }});
  add({"cross_entropy_backward", "[4,92160], in place", {}, {io({4, 92160}), ids({4}, 92160, Init::kTargets)},
       2e-5, 1e-2, [](Backend& b, const std::vector<Tensor>& t) { b.cross_entropy_backward(t[0], t[1], 0.25, t[0]); }});
}

// The optimizer's ops, with host scalars and with device scalars.
void optimizer_cases(std::vector<OpCase>& v) {
  auto add = [&](OpCase c) { v.push_back(std::move(c)); };
  // ---- optimizer
  add({"adamw_update", "[8,12], step 3", {}, {f32(io({8, 12})), in({8, 12}), f32(io({8, 12})), f32(io({8, 12}, Init::kPositive))},
       2e-5, 1e-2, [](Backend& b, const std::vector<Tensor>& t) {
         AdamWParams p;
         p.lr = 1e-2;
         p.wd = 0.1;
         p.step = 3;
         b.adamw_update(t[0], t[1], t[2], t[3], p);
       }});
  add({"muon_momentum", "[8,12], Nesterov", {}, {in({8, 12}), f32(io({8, 12})), out({8, 12})},
       2e-5, 1e-2, [](Backend& b, const std::vector<Tensor>& t) { b.muon_momentum(t[0], t[1], t[2], 0.95, true); }});
  add({"muon_apply", "[8,12]", {}, {f32(io({8, 12})), in({8, 12})},
       2e-5, 1e-2, [](Backend& b, const std::vector<Tensor>& t) { b.muon_apply(t[0], t[1], 2e-2, 0.1, 1.3); }});
  // ---- optimizer on device scalars (F64 [1] on the tested backend)
  add({"sum_squares_into", "[7,13] accumulated into a scalar", {}, {in({7, 13}), scalar_io()},
       2e-5, 1e-2, [](Backend& b, const std::vector<Tensor>& t) { b.sum_squares_into(t[0], t[1], true); }});
  add({"grad_clip_scalars", "norm above max_norm 0.5: clipped", {}, {scalar(), f64_out({3})},
       2e-5, 1e-2, [](Backend& b, const std::vector<Tensor>& t) { b.grad_clip_scalars(t[0], 0.5, t[1]); }});
  add({"grad_clip_scalars", "norm below max_norm 5: coefficient 1", {}, {scalar(), f64_out({3})},
       2e-5, 1e-2, [](Backend& b, const std::vector<Tensor>& t) { b.grad_clip_scalars(t[0], 5.0, t[1]); }});
  add({"scale_by", "[11,7] ·= coef", {}, {io({11, 7}), scalar()},
       2e-5, 1e-2, [](Backend& b, const std::vector<Tensor>& t) { b.scale_by(t[0], t[1]); }});
  add({"scale_by_inv_norm", "[11,7] /= √ss + eps", {}, {io({11, 7}), scalar()},
       2e-5, 1e-2, [](Backend& b, const std::vector<Tensor>& t) { b.scale_by_inv_norm(t[0], t[1], 1e-7); }});
  for (const Init skip : {Init::kZero, Init::kOne}) {
    const std::string when = skip == Init::kZero ? ", not skipped" : ", skipped: nothing changes";
    add({"adamw_update_gated", "[8,12], step 3" + when, {},
         {f32(io({8, 12})), in({8, 12}), f32(io({8, 12})), f32(io({8, 12}, Init::kPositive)), scalar(skip)},
         2e-5, 1e-2, [](Backend& b, const std::vector<Tensor>& t) {
           AdamWParams p;
           p.lr = 1e-2;
           p.wd = 0.1;
           p.step = 3;
           b.adamw_update_gated(t[0], t[1], t[2], t[3], p, t[4]);
         }});
    add({"muon_momentum_gated", "[8,12], Nesterov" + when, {}, {in({8, 12}), f32(io({8, 12})), io({8, 12}), scalar(skip)},
         2e-5, 1e-2, [](Backend& b, const std::vector<Tensor>& t) { b.muon_momentum_gated(t[0], t[1], t[2], 0.95, true, t[3]); }});
    add({"muon_apply_gated", "[8,12]" + when, {}, {f32(io({8, 12})), in({8, 12}), scalar(skip)},
         2e-5, 1e-2, [](Backend& b, const std::vector<Tensor>& t) { b.muon_apply_gated(t[0], t[1], 2e-2, 0.1, 1.3, t[2]); }});
  }
  add({"loss_sum_into", "[300] losses / 280, accumulated", {}, {f32(in({300}, Init::kPositive)), scalar_io()},
       2e-5, 1e-2, [](Backend& b, const std::vector<Tensor>& t) { b.loss_sum_into(t[0], 280.0, t[1], true); }});
}

// FP8 quantisers, the dequantiser and the product.
void fp8_cases(std::vector<OpCase>& v) {
  auto add = [&](OpCase c) { v.push_back(std::move(c)); };
  // ---- FP8 (E4M3 codes, F32 scales): quantisers, the dequantiser and the product. The product
  // needs K and N multiples of 16 on CUDA (cuBLASLt's FP8 layouts).
  add({"quantize_rows_e4m3", "[33,48]", {}, {in({33, 48}), codes_out({33, 48}), scales_out({33})},
       2e-5, 1e-2, [](Backend& b, const std::vector<Tensor>& t) { b.quantize_rows_e4m3(t[0], t[1], t[2]); }});
  add({"quantize_cols_e4m3", "[40,24] → [24,40]", {}, {in({40, 24}), codes_out({24, 40}), scales_out({24})},
       2e-5, 1e-2, [](Backend& b, const std::vector<Tensor>& t) { b.quantize_cols_e4m3(t[0], t[1], t[2]); }});
  add({"quantize_rows_cols_e4m3", "[32,48], both", {},
       {in({32, 48}), codes_out({32, 48}), scales_out({32}), codes_out({48, 32}), scales_out({48})},
       2e-5, 1e-2, [](Backend& b, const std::vector<Tensor>& t) { b.quantize_rows_cols_e4m3(t[0], t[1], t[2], t[3], t[4]); }});
  add({"dequantize_rows_e4m3", "[16,32]", {}, {codes({16, 32}), scales({16}), out({16, 32})},
       2e-5, 1e-2, [](Backend& b, const std::vector<Tensor>& t) { b.dequantize_rows_e4m3(t[0], t[1], t[2]); }});
  add({"gemm_e4m3", "[32,48]·[16,48]ᵀ + c", {}, {codes({32, 48}), scales({32}), codes({16, 48}), scales({16}), in({32, 16}), out({32, 16})},
       2e-5, 1e-2, [](Backend& b, const std::vector<Tensor>& t) { b.gemm_e4m3(t[0], t[1], t[2], t[3], t[4], t[5], Fp8Accum::kF32); }});
  add({"gemm_e4m3", "[300,3072]·[1024,3072]ᵀ, no residual", {},
       {codes({300, 3072}), scales({300}), codes({1024, 3072}), scales({1024}), out({300, 1024})},
       2e-5, 1e-2, [](Backend& b, const std::vector<Tensor>& t) { b.gemm_e4m3(t[0], t[1], t[2], t[3], {}, t[4], Fp8Accum::kF32); }});
  add({"quantize_rows_e4m3", "[300,8192]", {}, {in({300, 8192}), codes_out({300, 8192}), scales_out({300})},
       2e-5, 1e-2, [](Backend& b, const std::vector<Tensor>& t) { b.quantize_rows_e4m3(t[0], t[1], t[2]); }});
  add({"quantize_rows_cols_e4m3", "[300,3072], both", {},
       {in({300, 3072}), codes_out({300, 3072}), scales_out({300}), codes_out({3072, 300}), scales_out({3072})},
       2e-5, 1e-2, [](Backend& b, const std::vector<Tensor>& t) { b.quantize_rows_cols_e4m3(t[0], t[1], t[2], t[3], t[4]); }});
}

std::vector<OpCase> all_cases() {
  std::vector<OpCase> v;
  dense_row_and_conv_cases(v);
  gla_cases(v);
  elementwise_cases(v);
  optimizer_cases(v);
  fp8_cases(v);
  return v;
}

// ---- buffers with guards ----------------------------------------------------------------

constexpr int64_t kGuard = 16;  // elements on each side

// A quiet NaN with a payload no op computes, in each dtype's width.
void fill_guard(DType dt, void* base, int64_t from, int64_t n) {
  const size_t es = dtype_size(dt);
  unsigned char* p = static_cast<unsigned char*>(base) + from * static_cast<int64_t>(es);
  for (int64_t i = 0; i < n; ++i, p += es) {
    if (es == 8) { const uint64_t g = 0x7ff8dead5eed5eedull; std::memcpy(p, &g, 8); }
    else if (es == 4) { const uint32_t g = 0x7fc5eed5u; std::memcpy(p, &g, 4); }
    else { const uint16_t g = 0x7fd5u; std::memcpy(p, &g, 2); }
  }
}

// One argument on one backend: the tensor's elements (with its padding, if any) between kGuard
// guard elements on each side. Everything that is not the tensor holds the guard pattern.
struct Buffer {
  Backend* be = nullptr;
  void* mem = nullptr;
  DType dt = DType::kF32;
  int64_t n = 0;      // the tensor's elements
  int64_t phys = 0;   // the elements it spans (n, plus the padding between its token rows)
  Tensor view;
  std::vector<unsigned char> host;  // the whole buffer as staged (guards included)
  std::vector<bool> used;           // [phys]: whether an element of the tensor sits there
  Buffer(Backend& b, DType d, const std::vector<int64_t>& shape, int64_t pad = 0) : be(&b), dt(d) {
    view = Tensor::make(nullptr, d, shape.data(), static_cast<int>(shape.size()), b.device());
    n = view.numel();
    phys = n;
    if (pad > 0) {
      // Token rows: dim 1 of [B, T, H, d], else dim 0; the dims after it stay contiguous.
      const int rd = view.ndim == 4 ? 1 : 0;
      LAPLACE_CHECK(view.ndim >= 2, "test: a padded argument has at least two dims");
      view.stride[rd] += pad;
      for (int d = rd - 1; d >= 0; --d) view.stride[d] = view.stride[d + 1] * view.shape[d + 1];
      phys = view.stride[0] * view.shape[0];
    }
    const size_t es = dtype_size(d);
    host.assign(static_cast<size_t>(phys + 2 * kGuard) * es, 0);
    fill_guard(d, host.data(), 0, phys + 2 * kGuard);
    used.assign(static_cast<size_t>(phys), false);
    const Tensor layout = values_host();
    for (int64_t e = 0; e < n; ++e) used[static_cast<size_t>(testing::offset_of(layout, e))] = true;
    mem = b.allocator().allocate(host.size());
    LAPLACE_CHECK(mem != nullptr, "test: allocation failed");
    view.data = static_cast<unsigned char*>(mem) + kGuard * static_cast<int64_t>(es);
  }
  ~Buffer() { be->allocator().deallocate(mem); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  void* values() { return host.data() + kGuard * static_cast<int64_t>(dtype_size(dt)); }
  // The staged tensor (its strides, guards excluded) on the host, for testing::element_set / _get.
  Tensor values_host() {
    Tensor t = view;
    t.data = values();
    t.device = Device::kCPU;
    return t;
  }
  Tensor whole_host() {
    const int64_t all = phys + 2 * kGuard;
    return Tensor::make(host.data(), dt, &all, 1, Device::kCPU);
  }
  Tensor whole_dev() {
    const int64_t all = phys + 2 * kGuard;
    return Tensor::make(mem, dt, &all, 1, be->device());
  }
  void upload() { be->copy(whole_dev(), whole_host()); }
  void download() {
    be->copy(whole_host(), whole_dev());
    be->synchronize();
  }
  // Whether the guards and the padding still hold their pattern, bit for bit.
  bool guards_intact() const {
    const size_t es = dtype_size(dt);
    std::vector<unsigned char> want(es);
    fill_guard(dt, want.data(), 0, 1);
    for (int64_t i = 0; i < phys + 2 * kGuard; ++i) {
      const int64_t j = i - kGuard;
      if (j >= 0 && j < phys && used[static_cast<size_t>(j)]) continue;
      if (std::memcmp(want.data(), host.data() + static_cast<size_t>(i) * es, es) != 0) return false;
    }
    return true;
  }
};

// The case's input values for argument a (seeded by case and argument), rounded to `dt`.
std::vector<double> values_for(const Arg& a, int64_t n, DType dt, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<double> x(static_cast<size_t>(n));
  std::uniform_real_distribution<double> uni(-1, 1), pos(0.5, 2.0);
  for (int64_t i = 0; i < n; ++i) {
    switch (a.init) {
      case Init::kUniform: x[i] = testing::round_to(dt, uni(rng)); break;
      case Init::kZero: x[i] = 0; break;
      case Init::kOne: x[i] = 1; break;
      case Init::kPositive: x[i] = testing::round_to(dt, pos(rng)); break;
      case Init::kIds: x[i] = static_cast<double>(rng() % static_cast<uint64_t>(a.range)); break;
      case Init::kTargets: x[i] = i % 4 == 3 ? -1.0 : static_cast<double>(rng() % static_cast<uint64_t>(a.range)); break;
      case Init::kSlots: {
        // Distinct slots, out of order and with gaps: range−1, range−3, …, then range−2, range−4, ….
        // Two rows on one slot would make the in-place state update depend on the order rows run in.
        LAPLACE_CHECK(n <= a.range, "a slots argument needs as many slots as rows");
        const int64_t half = (a.range + 1) / 2;
        x[i] = static_cast<double>(i < half ? a.range - 1 - 2 * i : a.range - 2 - 2 * (i - half));
        break;
      }
      case Init::kDocs: {
        const int64_t T = a.shape[1], b = i / T, t = i % T;
        const std::vector<int64_t> starts = b % 2 ? std::vector<int64_t>{3, 4, 11} : std::vector<int64_t>{0, 5, 8, 16, 17};
        int64_t d = -1;
        for (int64_t s : starts)
          if (s <= t) d = s;
        x[i] = static_cast<double>(d);
        break;
      }
    }
  }
  return x;
}

struct Tested {
  std::string name;
  Backend* be;
  DType dt;
};

// Runs `c` on `t` and on the F64 reference; returns "" or what went wrong.
std::string run_case(const OpCase& c, size_t index, const Tested& t, Backend& ref, bool perf) {
  std::vector<std::unique_ptr<Buffer>> mine, refs;
  std::vector<Tensor> tv, rv;
  for (size_t i = 0; i < c.args.size(); ++i) {
    const Arg& a = c.args[i];
    const DType dt = a.fixed.value_or(a.f32_at_bf16 && t.dt == DType::kBF16 ? DType::kF32 : t.dt);
    const DType rdt = a.fixed.value_or(DType::kF64);
    mine.push_back(std::make_unique<Buffer>(*t.be, dt, a.shape, a.pad));
    refs.push_back(std::make_unique<Buffer>(ref, rdt, a.shape));
    const std::vector<double> x = values_for(a, mine.back()->n, dt, 1000003ull * (index + 1) + i);
    for (int64_t e = 0; e < mine.back()->n; ++e) {
      testing::element_set(mine.back()->values_host(), e, x[e]);
      testing::element_set(refs.back()->values_host(), e, x[e]);
    }
    mine.back()->upload();
    refs.back()->upload();
    tv.push_back(mine.back()->view);
    rv.push_back(refs.back()->view);
  }
  std::vector<std::vector<unsigned char>> staged;  // every buffer as uploaded, for the second run
  for (const auto& m : mine) staged.push_back(m->host);
  c.run(*t.be, tv);
  c.run(ref, rv);
  std::string err;
  char line[320];
  for (size_t i = 0; i < c.args.size(); ++i) {
    mine[i]->download();
    refs[i]->download();
    if (!mine[i]->guards_intact()) {
      std::snprintf(line, sizeof line, "argument %zu: a write outside the tensor (its guard or padding changed)\n", i);
      err += line;
    }
    if (!c.args[i].compared) continue;
    double worst = 0, scale = 0;
    int64_t mismatches = 0;
    for (int64_t e = 0; e < mine[i]->n; ++e) {
      const double a = testing::element_get(mine[i]->values_host(), e);
      const double b = testing::element_get(refs[i]->values_host(), e);
      if (!std::isfinite(a)) ++mismatches;
      worst = std::max(worst, std::fabs(a - b));
      scale = std::max(scale, std::fabs(b));
    }
    const bool exact = c.args[i].fixed == DType::kI32 || c.args[i].fixed == DType::kF8E4M3;
    const double rel = worst / std::max(scale, 1e-30);
    const bool out_bf16 = mine[i]->dt == DType::kBF16;
    const double tol = t.dt == DType::kBF16 ? (out_bf16 ? c.tol_bf16 : 1e-4) : c.tol_f32;
    if (std::getenv("LAPLACE_OPS_VERBOSE"))
      std::printf("  %-22s %-8s %-40s arg %zu: max rel error %.3g (tol %.3g)\n", c.op.c_str(), t.name.c_str(),
                  c.label.c_str(), i, rel, tol);
    if (mismatches || (exact ? worst != 0 : rel > tol)) {
      std::snprintf(line, sizeof line, "argument %zu: max rel error %.3g > %.3g (%lld non-finite)\n", i, rel, tol,
                    static_cast<long long>(mismatches));
      err += line;
    }
  }
  // Determinism: the same inputs again give the same bytes in every output (the trainer's
  // bitwise resume and the engine's reproducible decoding rest on it).
  if (err.empty()) {
    std::vector<std::vector<unsigned char>> first;
    for (size_t i = 0; i < mine.size(); ++i) {
      first.push_back(mine[i]->host);
      mine[i]->host = staged[i];
      mine[i]->upload();
    }
    c.run(*t.be, tv);
    for (size_t i = 0; i < mine.size(); ++i) {
      mine[i]->download();
      if (c.args[i].compared && mine[i]->host != first[i]) {
        std::snprintf(line, sizeof line, "argument %zu: a second run from the same inputs gave other bytes\n", i);
        err += line;
      }
    }
  }
  if (perf && err.empty()) {
    std::vector<double> us;
    for (int r = 0; r < 10; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      c.run(*t.be, tv);
      t.be->synchronize();
      us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(us.begin(), us.end());
    std::printf("  perf %-22s %-8s %-40s %10.1f us\n", c.op.c_str(), t.name.c_str(), c.label.c_str(), us[5]);
  }
  return err;
}

std::vector<Tested> tested_backends(std::vector<std::unique_ptr<Backend>>* own) {
  std::vector<Tested> v;
  own->push_back(make_cpu_backend());
  v.push_back({"cpu f32", own->back().get(), DType::kF32});
#ifdef LAPLACE_HAVE_CUDA
  std::string why;
  if (auto cuda = make_cuda_backend(&why)) {
    own->push_back(std::move(cuda));
    v.push_back({"cuda f32", own->back().get(), DType::kF32});
    v.push_back({"cuda bf16", own->back().get(), DType::kBF16});
  } else {
    std::printf("backend ops: no CUDA device (%s): CUDA cases skipped\n", why.c_str());
  }
#else
  std::printf("backend ops: built without CUDA: CUDA cases skipped\n");
#endif
  return v;
}

TEST(BackendOps, EveryCaseOnEveryBackendMatchesTheF64Reference) {
  const bool perf = std::getenv("LAPLACE_OPS_PERF") != nullptr;
  std::vector<std::unique_ptr<Backend>> own;
  const std::vector<Tested> backends = tested_backends(&own);
  auto ref = make_cpu_backend();
  const std::vector<OpCase> cases = all_cases();
  int ran = 0, declined = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    const OpCase& c = cases[i];
    ASSERT_TRUE(is_backend_op(c.op)) << c.op;
    ASSERT_TRUE(ref->supports({c.op, DType::kF64, c.dims})) << "the reference must compute " << c.op << " in F64";
    for (const Tested& t : backends) {
      // Cases with document starts need a backend whose ops take them (Backend::keeps_documents_apart).
      const bool docs = std::any_of(c.args.begin(), c.args.end(), [](const Arg& a) { return a.init == Init::kDocs; });
      if (!t.be->supports({c.op, t.dt, c.dims}) || (docs && !t.be->keeps_documents_apart())) {
        std::printf("backend ops: %s declines %s (%s)\n", t.name.c_str(), c.op.c_str(), c.label.c_str());
        ++declined;
        continue;
      }
      const std::string err = run_case(c, i, t, *ref, perf);
      EXPECT_TRUE(err.empty()) << c.op << " (" << c.label << ") on " << t.name << ":\n" << err;
      ++ran;
    }
  }
  std::printf("backend ops: %zu cases, %d runs, %d declined\n", cases.size(), ran, declined);
  EXPECT_GE(ran, static_cast<int>(cases.size())) << "every case runs at least on the CPU";
}

// The harness itself can fail: a deliberately wrong op (the CPU's gemm with the wrong alpha),
// one that writes past its output and one that is not deterministic are all caught.
TEST(BackendOps, TheHarnessCatchesWrongValuesAndStrayWrites) {
  auto cpu = make_cpu_backend();
  auto ref = make_cpu_backend();
  const Tested t{"cpu f32", cpu.get(), DType::kF32};
  OpCase wrong{"gemm", "alpha differs", {}, {in({8, 8}), in({8, 8}), out({8, 8})}, 2e-5, 1e-2,
               [&](Backend& b, const std::vector<Tensor>& x) { b.gemm(x[0], false, x[1], false, x[2], &b == cpu.get() ? 1.001 : 1.0, 0.0); }};
  EXPECT_NE(run_case(wrong, 0, t, *ref, false).find("max rel error"), std::string::npos);
  OpCase stray{"fill", "one past the end", {}, {out({4, 4})}, 2e-5, 1e-2, [&](Backend& b, const std::vector<Tensor>& x) {
                 Tensor wide = x[0];
                 if (&b == cpu.get()) {
                   const int64_t n = 17;
                   wide = Tensor::make(x[0].data, x[0].dtype, &n, 1, x[0].device);
                 } else {
                   const int64_t n = 16;
                   wide = Tensor::make(x[0].data, x[0].dtype, &n, 1, x[0].device);
                 }
                 b.fill(wide, 3.0);
               }};
  EXPECT_NE(run_case(stray, 1, t, *ref, false).find("guard or padding changed"), std::string::npos);
  // A padded argument: an op that writes its rows as if they were contiguous lands in the
  // padding between them, and one that ignores the row stride reads it back (NaN).
  OpCase packed{"fill", "padded rows written as contiguous", {}, {padded(out({4, 4}))}, 2e-5, 1e-2,
                [&](Backend& b, const std::vector<Tensor>& x) {
                  Tensor dense = x[0];
                  if (&b == cpu.get()) dense.stride[0] = 4;
                  b.fill(dense, 3.0);
                }};
  EXPECT_NE(run_case(packed, 4, t, *ref, false).find("guard or padding changed"), std::string::npos);
  OpCase reads{"scale", "padded rows read as contiguous", {}, {padded(io({4, 4}))}, 2e-5, 1e-2,
               [&](Backend& b, const std::vector<Tensor>& x) {
                 Tensor dense = x[0];
                 if (&b == cpu.get()) dense.stride[0] = 4;
                 b.scale(dense, 2.0);
               }};
  EXPECT_NE(run_case(reads, 5, t, *ref, false), "");
  // An op whose second run from the same inputs differs (in the last bits) is caught too.
  int calls = 0;
  OpCase flaky{"fill", "another value on the second run", {}, {out({4, 4})}, 2e-5, 1e-2,
               [&](Backend& b, const std::vector<Tensor>& x) {
                 b.fill(x[0], &b == cpu.get() && calls++ > 0 ? 3.0 + 1e-6 : 3.0);
               }};
  EXPECT_NE(run_case(flaky, 3, t, *ref, false).find("other bytes"), std::string::npos);
  // And a correct case passes.
  OpCase fine{"fill", "exactly the tensor", {}, {out({4, 4})}, 2e-5, 1e-2,
              [](Backend& b, const std::vector<Tensor>& x) { b.fill(x[0], 3.0); }};
  EXPECT_EQ(run_case(fine, 2, t, *ref, false), "");
}

TEST(BackendOps, BackendsStateWhatTheySupport) {
  auto cpu = make_cpu_backend();
  EXPECT_TRUE(cpu->supports({"gemm", DType::kF32, {}}));
  EXPECT_TRUE(cpu->supports({"gla_forward", DType::kF64, {2, 8, 12}}));
  EXPECT_FALSE(cpu->supports({"gemm", DType::kBF16, {}}));
  EXPECT_FALSE(cpu->supports({"no_such_op", DType::kF32, {}}));
  EXPECT_TRUE(cpu->supports({"copy", DType::kBF16, {}}));
#ifdef LAPLACE_HAVE_CUDA
  std::string why;
  if (auto cuda = make_cuda_backend(&why)) {
    EXPECT_TRUE(cuda->supports({"gla_forward", DType::kBF16, {16, 96, 192}}));
    EXPECT_FALSE(cuda->supports({"gla_forward", DType::kBF16, {16, 160, 192}}));
    EXPECT_FALSE(cuda->supports({"gemm", DType::kF64, {}}));
  }
#endif
}

}  // namespace
}  // namespace laplace
