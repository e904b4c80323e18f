// The ops interface (the laplace_ops library: this header and ops/backend.cpp, on laplace_core
// alone): every computation of the model goes through a Backend, so the same model code runs
// on the CPU (ops/cpu, laplace_ops_cpu) and on CUDA (ops/cuda, laplace_cuda).
//
// Conventions (all backends):
//  - Tensors are row-major views (core/tensor.h); the innermost dim is contiguous,
//    outer strides may be larger (q/k/v/g are views into the fused projection).
//  - N = B·T token rows. Shapes are given next to each argument.
//  - "accumulate" outputs (parameter gradients) are added to, never overwritten:
//    the caller zeroes them once per optimizer step.
//  - Reductions run in a fixed order that does not depend on thread count, so the
//    same inputs give bitwise identical outputs (the determinism contract).
//  - Optional tensors are passed undefined (Tensor{}).
//  - Decode states live in a pool [S, ...] (stride of dim 0 may exceed the row size:
//    a slot holds every layer's state); `slots` [B] I32 maps batch row b to its slot.
//    With `slots` undefined, batch row b uses pool entry b.
//
// Dtypes: the CPU backend computes in F32 or F64 (all float tensors of one call share
// the dtype). The CUDA backend takes BF16 activations/weights with F32 accumulation,
// F32 states and F32 norms' statistics.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/arena.h"
#include "core/status.h"
#include "core/tensor.h"

namespace laplace {

enum class GlaForm { kQuadratic, kRecurrent, kChunked };

// How gemm_e4m3 may accumulate. kF32: in F32 throughout (cuBLASLt moves the tensor cores' partial
// sums into F32 registers as the contraction goes). kFast: in the tensor cores' own accumulator
// over the whole contraction (cuBLASLt's fast accumulation), which keeps fewer bits: faster on
// Hopper, with an error well below what quantising the operands to E4M3 costs, so that FP8
// recipes use it for forward products and keep F32 for gradients, whose sums run over many
// more terms. It is a permission, not an order: a backend that always accumulates exactly (the
// CPU) treats both alike.
enum class Fp8Accum { kF32, kFast };

struct GlaParams {
  GlaForm form = GlaForm::kChunked;
  int64_t chunk = 128;          // C, for kChunked; any C ≥ 1, the tail chunk may be short
  double scale = 1.0;           // q is multiplied by this (1/√dk in the model)
  std::vector<double> decay;    // λ_h per head, size H
  // Documents kept apart (varlen, docs/model.md §4): doc [B, T] I32 on the backend's device,
  // for each token the position in its row of its document's first token, or −1 for a
  // document that began before the row (it continues from s_in). The state restarts from zero
  // at every t with doc[t] = t, so each document is computed as if run alone; undefined: each
  // row is one document. Valid rows (core/doc_starts.h): doc[0] ∈ {−1, 0}, doc[t] ∈ {doc[t−1], t}.
  // The chunked and recurrent forms and the backward take it; decode steps (T = 1) do not.
  Tensor doc;
};

// Deferred write-back of decode states (an engine option; docs/serving.md §4). Beside each
// state S of a pool entry are the (k, v) of the last m < R decode tokens not yet folded into
// it, pair 0 the oldest, and m. The entry's true state is
//   λ^m S + Σ_{j<m} λ^{m−1−j} k_jᵀ v_j,
// so a decode step can read S without writing it, and write it back every R-th step only.
//
// The count word of (entry, head) holds m in bits 0–15 and a phase d in bits 16–30: the
// current cycle is R − d steps long, i.e. the step that finds m + 1 + d = R writes back, and
// the next cycle starts with m = d = 0 (R steps). A flush starts the cycle after it with
// d = pending_phase(h, R), so that sequences in lock-step (admitted together) write back
// 1/R of their heads at each step instead of every head at every R-th step; which step
// writes back depends on the sequence's own history only, never on the other sequences.
// Valid words: 0 ≤ m, 0 ≤ d, m + d < R.
struct GlaPending {
  Tensor k;      // [S, H, R−1, dk] the activations' dtype; dim-0 stride = the slot's
  Tensor v;      // [S, H, R−1, dv]
  Tensor count;  // [S, H] I32: the count word (m, d) per (entry, head)
  int64_t steps = 0;  // R
  bool defined() const { return steps > 0; }
};

constexpr int kPendingPhaseShift = 16;
constexpr int32_t pending_word(int32_t m, int32_t d) { return m | (d << kPendingPhaseShift); }
constexpr int32_t pending_m(int32_t word) { return word & ((1 << kPendingPhaseShift) - 1); }
constexpr int32_t pending_d(int32_t word) { return word >> kPendingPhaseShift; }
// The phase a flush gives head h: consecutive heads write back at consecutive steps.
constexpr int32_t pending_phase(int64_t h, int64_t R) { return static_cast<int32_t>(h % R); }
constexpr bool pending_word_valid(int32_t word, int64_t R) {
  return word >= 0 && pending_m(word) + pending_d(word) < R;
}

struct AdamWParams {
  double lr = 0, beta1 = 0.9, beta2 = 0.95, eps = 1e-8, wd = 0;
  int64_t step = 1;  // 1-based, for bias correction
};

// A recorded sequence of queued ops that can be replayed (a CUDA graph). Replaying reads
// and writes the same device buffers the ops were recorded with, whatever they hold now.
class Graph {
 public:
  virtual ~Graph() = default;
  // Queues the recorded ops on the backend's stream (no synchronisation).
  virtual void launch() = 0;
};

// What a backend is asked whether it computes: an op by its Backend method name ("gemm",
// "gla_forward", …), the dtype of its floating-point operands, and, for the ops a backend
// limits by shape, those dims (the GLA ops: H, dk, dv). See Backend::supports.
struct OpQuery {
  std::string op;
  DType dtype = DType::kF32;
  std::vector<int64_t> dims;
};

// Every op name an OpQuery may carry: the Backend methods that compute.
bool is_backend_op(const std::string& op);

class Backend {
 public:
  virtual ~Backend() = default;
  virtual Device device() const = 0;
  virtual const char* name() const = 0;
  virtual Allocator& allocator() = 0;
  // The CUDA stream (cudaStream_t) every op is queued on; nullptr on the CPU. Lets other
  // device work (NCCL collectives) order itself with the backend's without host syncs.
  virtual void* native_stream() { return nullptr; }
  // Whether this backend computes `q`. Each backend states its own dtypes and shape limits
  // here instead of converting or falling back silently; an op called outside them stops
  // with a LAPLACE_CHECK naming the limit. The cross-backend op test
  // (tests/test_backend_ops.cpp) skips, with a message, the cases a backend declines.
  virtual bool supports(const OpQuery& q) const = 0;

  // Whether the backend may tune its kernels on their first use (CUDA: a large gemm shape's
  // cuBLASLt algorithm, timed on its first eager call; results are unchanged by it). On by
  // default; the engine turns it off once warmed up, so that no request's latency pays for a
  // shape's first use. The CPU backend does not tune.
  virtual void set_tuning(bool on) { (void)on; }

  // Whether the GLA and conv ops take GlaParams::doc (documents kept apart in one row). A backend
  // that does not refuses a defined doc; the model then runs each document through the ops as a
  // sequence of its own (Model::keeps_documents_apart_by_views), the same function in more calls.
  virtual bool keeps_documents_apart() const { return false; }

  // Records the ops `queue_ops` queues into a Graph instead of running them. Nothing in
  // queue_ops may read host memory or wait for the device (copies to or from the host,
  // synchronize, sum_squares, a growing scratch buffer): the capture then fails with an
  // error naming it. The CPU backend has no graphs (unsupported).
  virtual Status capture(const std::function<void()>& queue_ops, std::unique_ptr<Graph>* out) {
    (void)queue_ops;
    (void)out;
    return Status::unsupported(std::string(name()) + " backend has no graphs");
  }

  // ---- memory -------------------------------------------------------------------
  // dst = src; shapes equal; either may live on the host (H2D/D2H on CUDA).
  virtual void copy(Tensor dst, const Tensor& src) = 0;
  virtual void fill(Tensor dst, double value) = 0;
  // y += alpha · x (same shape).
  virtual void axpy(double alpha, const Tensor& x, Tensor y) = 0;
  // Waits for queued work (a no-op on the CPU).
  virtual void synchronize() = 0;
  // Bytes free and in total on this backend's device (host RAM on the CPU), for memory
  // planning; false when unknown.
  virtual bool memory_info(size_t* free_bytes, size_t* total_bytes) {
    (void)free_bytes;
    (void)total_bytes;
    return false;
  }

  // ---- dense ---------------------------------------------------------------------
  // c = alpha · op(a) · op(b) + beta · c, 2-D; op(x) = xᵀ when trans_x.
  virtual void gemm(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, Tensor c,
                    double alpha, double beta) = 0;
  // d = alpha · op(a) · op(b) + beta · c with c and d distinct tensors of one shape and dtype
  // (d may be c): a residual add without first copying c into d. The default copies, then
  // runs gemm; the CUDA backend hands c to cuBLASLt as its C operand (deterministic, but not
  // bitwise the copy + in-place gemm: cuBLASLt may take another kernel when C is not D).
  virtual void gemm_add(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, const Tensor& c, Tensor d,
                        double alpha, double beta);

  // FP8 products (E4M3, core/fp8.h) for weights quantised per row (model/quantize.h): the
  // activations are quantised per row too, and the product is scaled per row and per column.
  // Backends without them state so in supports() and stop with a message when called.
  // x [R, C] (F32/F64 on the CPU, F32/BF16 on CUDA) → q [R, C] F8E4M3, s [R] F32, with
  // s[r] = e4m3_scale(max_c |x[r][c]|) (max / 448; 1 for a row of zeros) and
  // q[r][c] = e4m3(x[r][c] · (1 / s[r])) (core/fp8.h's e4m3_quantize_row).
  virtual void quantize_rows_e4m3(const Tensor& x, Tensor q, Tensor s);
  // The values those codes stand for: q [R, C] F8E4M3 and s [R] F32 → w [R, C] contiguous (F32/F64
  // on the CPU, F32/BF16 on CUDA), w[r][c] = e4m3(q[r][c]) · s[r], the product in F32 rounded once
  // to w's dtype: what a weight's own copy holds when its products use the codes.
  virtual void dequantize_rows_e4m3(const Tensor& q, const Tensor& s, Tensor w);
  // The same per column, written transposed: x [R, C] → qt [C, R] F8E4M3, s [C] F32, with
  // s[c] = e4m3_scale(max_r |x[r][c]|) and qt[c][r] = e4m3(x[r][c] · (1 / s[c])): quantize_rows_e4m3 of xᵀ,
  // bit for bit. A training step's other two products contract over the rows of an operand
  // (dX = dY·W over W's rows, dW = dYᵀ·X over the tokens), and gemm_e4m3 contracts over
  // contiguous rows with one scale per row of each operand: this gives it W, dY and X in
  // that form, each scale along a dimension the product keeps.
  virtual void quantize_cols_e4m3(const Tensor& x, Tensor qt, Tensor s);
  // Both of the above from one x, which a training step needs of dY (per row for dX, per
  // column for dW): the codes and scales of the two calls, bit for bit. The default makes the
  // two calls; CUDA finds both maxima in one pass and writes both codes in another.
  virtual void quantize_rows_cols_e4m3(const Tensor& x, Tensor q, Tensor s, Tensor qt, Tensor st);
  // y[m][n] = c[m][n] + xs[m] · ws[n] · Σ_k x[m][k] · w[n][k], i.e. y = c + X·Wᵀ of the
  // dequantised operands, rounded once (the sum accumulated as `accum` allows): xq [M, K] and
  // wq [N, K] F8E4M3, xs [M] and ws [N] F32, y [M, N] contiguous (the dtypes of
  // quantize_rows_e4m3's x), c undefined (no residual) or of y's shape and dtype (y itself too).
  // CUDA needs K and N multiples of 16 (cuBLASLt's FP8 layouts).
  virtual void gemm_e4m3(const Tensor& xq, const Tensor& xs, const Tensor& wq, const Tensor& ws, const Tensor& c,
                         Tensor y, Fp8Accum accum);
  // quantize_rows_e4m3 of swiglu_forward(ab)'s h, bit for bit: q [N, F] and s [N], for the FP8
  // product that is h's only reader in inference (W_3's). h [N, F] is the default's workspace (it
  // runs the two ops); a backend that fuses them (CUDA, BF16) leaves h unwritten and reads ab once.
  virtual void swiglu_forward_e4m3(const Tensor& ab, Tensor h, Tensor q, Tensor s);
  // The same for layernorm_forward's y (without mean and rstd), for W_12's product in inference.
  virtual void layernorm_forward_e4m3(const Tensor& x, const Tensor& w, const Tensor& b, double eps, Tensor y,
                                      Tensor q, Tensor s);

  // out[n] = table[ids[n]]. ids [N] I32, table [V,D], out [N,D].
  virtual void embedding_forward(const Tensor& ids, const Tensor& table, Tensor out) = 0;
  // dtable[ids[n]] += dout[n] (accumulate).
  virtual void embedding_backward(const Tensor& ids, const Tensor& dout, Tensor dtable) = 0;

  // y = (x − mean)·rstd·w + b per row. x,y [N,D]; w,b [D]; mean,rstd [N] optional.
  virtual void layernorm_forward(const Tensor& x, const Tensor& w, const Tensor& b, double eps,
                                 Tensor y, Tensor mean, Tensor rstd) = 0;
  // dx (= or += when accumulate_dx) ; dw, db accumulate.
  virtual void layernorm_backward(const Tensor& dy, const Tensor& x, const Tensor& w,
                                  const Tensor& mean, const Tensor& rstd, Tensor dx,
                                  bool accumulate_dx, Tensor dw, Tensor db) = 0;

  // Causal depthwise conv + SiLU, docs/model.md §2. u,c,pre [B,T,D]; w [D,K].
  // win_in/win_out [S,K,D]: the last K conv inputs of each sequence (u_{<0} = 0 when
  // win_in is undefined); win_out receives the last K inputs after this call and may
  // alias win_in. pre (optional) receives the pre-activation for the backward.
  // doc (optional, GlaParams::doc's form): token t reads no input before doc[t] (those count
  // as zeros; doc[t] = −1 reads the window), and win_out holds zeros for the inputs before
  // the last token's document: each document starts from a zero window.
  virtual void conv_silu_forward(const Tensor& u, const Tensor& w, Tensor c, Tensor pre,
                                 const Tensor& win_in, Tensor win_out, const Tensor& slots,
                                 const Tensor& doc = Tensor{}) = 0;
  // Backward with a zero initial window. du written; dw accumulates. doc as in the forward.
  virtual void conv_silu_backward(const Tensor& dc, const Tensor& u, const Tensor& w,
                                  const Tensor& pre, Tensor du, Tensor dw, const Tensor& doc = Tensor{}) = 0;

  // GLA mixer, docs/model.md §4. q,k [B,T,H,dk]; v,o [B,T,H,dv]; states [S,H,dk,dv].
  // s_in undefined means S_0 = 0; s_out (optional) gets the final state and may alias s_in.
  virtual void gla_forward(const GlaParams& p, const Tensor& q, const Tensor& k, const Tensor& v,
                           Tensor o, const Tensor& s_in, Tensor s_out, const Tensor& slots) = 0;
  // dq,dk,dv written. ds_in (optional) gets d(initial state); ds_out (optional) is the
  // gradient flowing into the final state. States here are indexed by batch row.
  virtual void gla_backward(const GlaParams& p, const Tensor& q, const Tensor& k, const Tensor& v,
                            const Tensor& s_in, const Tensor& d_o, const Tensor& ds_out, Tensor dq,
                            Tensor dk, Tensor dv, Tensor ds_in) = 0;

  // One decode step of the mixer fused with its output gate (T = 1, recurrent form):
  //   gla_forward(p, q, k, v, o, states, states, slots), then
  //   rmsnorm_gate_forward(o, g, w, eps, y, {}).
  // q,k [B,1,H,dk]; v,g,o,y [B,1,H,dv]; states [S,H,dk,dv] updated in place in their slots.
  // The default runs those two ops; the CUDA backend streams each state once and gives
  // the same bits as its two ops (ops/cuda/kernels_gla_decode.cu).
  virtual void gla_decode_gate(const GlaParams& p, const Tensor& q, const Tensor& k, const Tensor& v,
                               const Tensor& g, const Tensor& w, double eps, Tensor states,
                               const Tensor& slots, Tensor o, Tensor y);

  // gla_decode_gate for a pool with deferred write-back (GlaPending): o and y are those of
  // the entries' true states, up to F32 rounding order. A step with m + 1 + d < R reads S
  // and the m pairs, writes nothing to S, appends (k, v) as pair m and sets m ← m + 1; the
  // last of the cycle (m + 1 + d = R) writes the true state after this token back to S and
  // sets m ← 0, d ← 0. The states are F32 or BF16 (CUDA), F32 or F64 (CPU); R is 4, 8 or 16.
  virtual void gla_decode_gate_deferred(const GlaParams& p, const Tensor& q, const Tensor& k, const Tensor& v,
                                        const Tensor& g, const Tensor& w, double eps, Tensor states,
                                        const GlaPending& pend, const Tensor& slots, Tensor o, Tensor y);
  // Folds the pending pairs of entries slots[b] into their states (S ← the true state) and
  // sets their count words to (m = 0, d = pending_phase(h, R)), whether or not anything was
  // pending: before anything but a deferred decode step reads the states.
  // slots [B] I32 on this device.
  virtual void gla_pending_flush(const GlaParams& p, Tensor states, const GlaPending& pend, const Tensor& slots);

  // Speculative verification (docs/serving.md §11), for a pool with deferred write-back: row b
  // feeds T tokens (1 ≤ T ≤ R) after the context of entry slots[b], and position t reads the
  // entry's state, its pending pairs and the pairs of positions 0 … t − 1 of its own row
  // (causally). o and y of position t are those the (t + 1)-th of T consecutive
  // gla_decode_gate_deferred steps would give, a write-back within the window included (on
  // the CPU the same bits: ops/cpu/gla_deferred.h). Nothing in the pool is written.
  // q,k [B,T,H,dk]; v,g,o,y [B,T,H,dv]; slots [B] I32. Backends without it say so in
  // supports() and stop with a message when called (the CUDA backend, for now).
  virtual void gla_verify_deferred(const GlaParams& p, const Tensor& q, const Tensor& k, const Tensor& v,
                                   const Tensor& g, const Tensor& w, double eps, const Tensor& states,
                                   const GlaPending& pend, const Tensor& slots, Tensor o, Tensor y);
  // After gla_verify_deferred of the same rows: the first accepted[b] positions of row b
  // (0 ≤ accepted[b] ≤ T; 0 leaves the entry alone) join entry slots[b]'s context: the state,
  // pairs and count words become those of accepted[b] gla_decode_gate_deferred steps of those
  // positions (on the CPU the same bytes). k [B,T,H,dk], v [B,T,H,dv]: the verified pairs;
  // accepted [B] I32 on this device.
  virtual void gla_verify_commit(const GlaParams& p, const Tensor& k, const Tensor& v, const Tensor& accepted,
                                 Tensor states, const GlaPending& pend, const Tensor& slots);

  // y = RMSNorm(o; w) ⊙ SiLU(g), per head. o,g [B,T,H,dv]; w [dv]; y [B,T,H,dv];
  // rstd [B,T,H] optional.
  virtual void rmsnorm_gate_forward(const Tensor& o, const Tensor& g, const Tensor& w, double eps,
                                    Tensor y, Tensor rstd) = 0;
  // d_o, dg written; dw accumulates.
  virtual void rmsnorm_gate_backward(const Tensor& dy, const Tensor& o, const Tensor& g,
                                     const Tensor& w, const Tensor& rstd, Tensor d_o, Tensor dg,
                                     Tensor dw) = 0;

  // h = SiLU(a) ⊙ b where ab [N,2F] = [a | b]; h [N,F].
  virtual void swiglu_forward(const Tensor& ab, Tensor h) = 0;
  virtual void swiglu_backward(const Tensor& dh, const Tensor& ab, Tensor dab) = 0;

  // out[r] = the index of row r's largest value; ties go to the lowest index (the host
  // sampler's greedy rule, serve/sampler.h). x [R, V] float; out [R] I32 on this device.
  // NaN-free rows only (a NaN's position in the result is unspecified).
  virtual void argmax_rows(const Tensor& x, Tensor out) = 0;

  // losses[n] = logsumexp(logits[n]) − logits[n][targets[n]]; targets < 0 give 0.
  // logits [N,V]; targets [N] I32; losses [N] (always F32 or the compute dtype).
  virtual void cross_entropy_forward(const Tensor& logits, const Tensor& targets, Tensor losses) = 0;
  // dlogits = scale · (softmax(logits) − onehot(target)); rows with target < 0 get 0.
  // dlogits may alias logits.
  virtual void cross_entropy_backward(const Tensor& logits, const Tensor& targets, double scale,
                                      Tensor dlogits) = 0;

  // ---- optimizer (element-wise, so they work unchanged on a row shard) ------------
  // Σ x² accumulated in double in a fixed order (for norms and clipping).
  virtual double sum_squares(const Tensor& x) = 0;
  // out[r] = Σ_c x[r][c]², accumulated in F64; x [R, C] (any float dtype), out [R] F64 on
  // this backend's device. Each row's sum depends on that row alone (a fixed order for a
  // given C), so a row shard gives the same per-row bits as the whole matrix: the
  // distributed global norm adds these in (param, row) order for any rank count.
  // Queued; no synchronisation.
  virtual void row_sum_squares(const Tensor& x, Tensor out) = 0;
  // x *= alpha.
  virtual void scale(Tensor x, double alpha) = 0;
  // AdamW (docs/training.md §6): m ← β1 m + (1−β1) g; v ← β2 v + (1−β2) g²;
  // w ← w·(1 − lr·wd) − lr · (m/(1−β1^t)) / (√(v/(1−β2^t)) + eps), t = p.step (1-based).
  virtual void adamw_update(Tensor w, const Tensor& g, Tensor m, Tensor v, const AdamWParams& p) = 0;
  // Muon momentum: m ← μ·m + g; u = g + μ·m (Nesterov) or u = m.
  virtual void muon_momentum(const Tensor& g, Tensor m, Tensor u, double mu, bool nesterov) = 0;
  // w ← w·(1 − lr·wd) − lr·s·o (o the orthogonalised update).
  virtual void muon_apply(Tensor w, const Tensor& o, double lr, double wd, double s) = 0;

  // ---- optimizer on device scalars (no host synchronisation) -------------------------
  // A "device scalar" is a 1-element F64 tensor on this backend's device (host memory on
  // the CPU). These ops let a whole optimizer step be queued without reading anything
  // back: the norm, the clip coefficient and the skip decision stay on the device, and
  // the host reads them only at the step boundary. Each gives the same bits as the
  // host-scalar op it mirrors (same F64 arithmetic, same F32/compute-dtype rounding).
  //
  // acc = (accumulate ? acc : 0) + Σ x², the same order and F64 sum as sum_squares, so
  // summing params one by one reproduces `ss += sum_squares(g)` bit for bit.
  virtual void sum_squares_into(const Tensor& x, Tensor acc, bool accumulate) = 0;
  // From ss = Σ g² (device scalar): out [3] F64 = {norm = √ss, coef, skip} with
  // skip = 1 when norm is not finite (else 0), coef = max_norm / (norm + 1e−6) when
  // max_norm > 0 and norm > max_norm and not skipped, else 1.
  virtual void grad_clip_scalars(const Tensor& ss, double max_norm, Tensor out) = 0;
  // x *= coef (device scalar, applied as scale(x, coef) would); nothing when coef == 1.
  virtual void scale_by(Tensor x, const Tensor& coef) = 0;
  // x *= 1 / (√ss + eps), ss a device scalar: Newton–Schulz's X = G / (‖G‖_F + eps).
  virtual void scale_by_inv_norm(Tensor x, const Tensor& ss, double eps) = 0;
  // adamw_update / muon_momentum / muon_apply that do nothing when the device scalar
  // `skip` is non-zero (a non-finite gradient norm: docs/training.md §6, nothing is touched).
  virtual void adamw_update_gated(Tensor w, const Tensor& g, Tensor m, Tensor v, const AdamWParams& p,
                                  const Tensor& skip) = 0;
  virtual void muon_momentum_gated(const Tensor& g, Tensor m, Tensor u, double mu, bool nesterov,
                                   const Tensor& skip) = 0;
  virtual void muon_apply_gated(Tensor w, const Tensor& o, double lr, double wd, double s, const Tensor& skip) = 0;
  // acc = (accumulate ? acc : 0) + (Σ_n losses[n]) / count, the sum in F64 in the order of
  // core/fixed_sum.h (the order Model::loss sums on the host, so the same bits). losses [N]
  // (F32 or the compute dtype, entries of ignored targets are 0); acc a device scalar. Lets a
  // trainer keep the step's loss on the device until the step boundary.
  virtual void loss_sum_into(const Tensor& losses, double count, Tensor acc, bool accumulate) = 0;
};

// The factories: declared with the interface, defined in the libraries above laplace_ops, so
// code that links only the interface (the model) calls none of them.
// Defined in laplace_ops_cpu (ops/cpu/cpu_backend.cpp).
std::unique_ptr<Backend> make_cpu_backend();
// "cpu" or "cuda"; an unsupported error says why CUDA is unavailable. Defined in
// laplace_backends (ops/backends/make_backend.cpp), which links both backends.
Status make_backend(const std::string& device, std::unique_ptr<Backend>* out);
// nullptr with a reason in *why when CUDA is not compiled in or no GPU is present. Defined in
// laplace_cuda (ops/cuda/cuda_backend.cpp) or laplace_nocuda (ops/cuda/no_cuda.cpp).
std::unique_ptr<Backend> make_cuda_backend(std::string* why);

}  // namespace laplace
