// The Laplace model (docs/model.md §2): one definition that drives training (forward +
// backward, chunked mixer), prefill (chunked mixer from and into decode states) and
// decode (one token per sequence, recurrent mixer, states updated in place).
// All arithmetic goes through a Backend, so the same code runs on CPU and CUDA.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "core/arena.h"
#include "model/config.h"
#include "model/state.h"
#include "model/weights.h"
#include "ops/backend.h"

namespace laplace {

struct PlanOptions {
  int64_t max_batch = 1;         // B
  int64_t max_seq = 1;           // T
  bool training = false;         // keep per-layer activations for the backward
  bool recompute_mixer = false;  // training: recompute the GLA output in the backward
                                 // instead of storing it per layer
  // Inference: token rows of the largest forward (0 = max_batch · max_seq). A serving
  // engine runs B decode rows of 1 token or 1 prompt piece of T tokens, never B × T, so it
  // plans max(B, T) rows instead of B·T.
  int64_t max_tokens = 0;
  // Inference: rows of the logits buffer (0 = the token rows). An engine only asks for
  // each sequence's last logits, so max_batch rows are enough.
  int64_t max_logit_rows = 0;
  // Training: full-layer recompute (activation checkpointing per layer). The forward keeps
  // only each layer's input x_in (and the head's x_final, final-norm statistics and logits),
  // running every layer's intermediates through one shared set of buffers; the backward, for
  // l = L−1 … 0, first runs layer l's forward again from its x_in into that set, then layer l's
  // backward as without recompute: the same ops on the same inputs, so the same gradients bit
  // for bit, for about one more forward's work. Excludes recompute_mixer (the layer's GLA output
  // is recomputed with the rest).
  bool recompute_layers = false;
  // Inference: token rows of the largest speculative verification (Model::verify; 0 = none).
  // Each layer then keeps its conv input and projections of those rows, which the commit reads
  // after the forward has gone on to the next layers.
  int64_t verify_rows = 0;
};

// Weight groups, in forward order: 0 = embedding, 1 + l = layer l, L + 1 = final norm
// and head. A distributed trainer gathers group g's weights before the forward uses them
// and reduce-scatters its gradients once the backward has finished them (distributed/).
using GroupHook = std::function<void(int64_t group)>;

struct ForwardOptions {
  GlaForm form = GlaForm::kChunked;  // kRecurrent for decode
  bool last_logits_only = false;     // logits of each sequence's last token only
  // Optional: called before the first op that reads group g. A training plan with
  // recompute_layers keeps it for the backward, which calls before_group(1 + l) again before it
  // runs layer l's forward again (and then that layer's backward): the hook must stay callable
  // until the backward, and a store that releases a layer's weights after its forward gathers
  // them again there.
  GroupHook before_group;
  // Documents kept apart (docs/model.md §4): ≥ 0 makes every token equal to it start a document,
  // from a zero state and a zero conv window (core/doc_starts.h), as serving starts each request;
  // −1 runs each row as one stream ("packed"). forward() only (not decode steps, ragged or queued
  // forwards); the backward follows the forward it differentiates.
  int32_t document_separator = -1;
};

class Model {
 public:
  // Allocates the weights (zeroed) on the backend's device in `dtype`.
  Status create(const Config& c, Backend& be, DType dtype);

  const Config& config() const { return cfg_; }
  Backend& backend() const { return *be_; }
  DType dtype() const { return dtype_; }
  const Arena& weight_arena() const { return weights_; }
  const ModelWeights& weights() const { return w_; }

  void init_weights(uint64_t seed) { weights_init(cfg_, *be_, weights_, seed); }
  Status load(const std::string& path) { return weights_load(path, *be_, weights_); }
  Status save(const std::string& path) const { return weights_save(path, cfg_, *be_, weights_); }
  // FP8 weights (model/quantize.h's format: E4M3 codes with one F32 scale per row): the body
  // matrices' projections in inference forwards then quantise their inputs per row and multiply
  // in FP8 (Backend::quantize_rows_e4m3, Backend::gemm_e4m3), reading half the bytes of BF16
  // weights. The weight arena keeps each matrix's dequantised values (code × scale, in the
  // model dtype) for everything else that reads weights. Training plans refuse them.
  // use_fp8_weights quantises the loaded weights on the backend; load_fp8 loads an FP8 model
  // file (`laplace quantize`) with its own codes and scales. Errors: unsupported (the backend
  // has no FP8 products), invalid_argument (a file that is not FP8, a missing tensor).
  Status use_fp8_weights();
  Status load_fp8(const std::string& path);
  bool fp8_weights() const { return fp8_on_; }
  // How the FP8 forward products (inference and FP8 training's forward) accumulate: in F32 (the
  // default) or, when on, as the tensor cores do (Fp8Accum::kFast: faster on Hopper, at an
  // error well below what rounding the operands to E4M3 costs). The gradients' products always
  // accumulate in F32. May be changed between forwards; captured graphs keep the choice they
  // were captured with.
  void set_fp8_fast_forward(bool on) { fp8_fast_forward_ = on; }
  bool fp8_fast_forward() const { return fp8_fast_forward_; }
  // The LM head in FP8 as well (inference, with FP8 weights on): the head's rows quantised as
  // the body matrices' are, into codes of their own (the head's own values stay, since a tied
  // embedding shares them), and the final norm's rows per row; the logits keep their dtype.
  // Off by default, because the head decides every greedy token (`eval serving`'s fp8-head
  // options compare it with the model's own head). The codes come from the head as it is when
  // first turned on; set_fp8_head(false) turns it off again.
  // Captured graphs keep the choice they were captured with. Errors: unsupported (no FP8
  // weights, or the backend's FP8 products do not take the head's shape).
  Status set_fp8_head(bool on);
  bool fp8_head() const { return fp8_head_on_; }

  // FP8 training (`laplace train --precision fp8`): in training plans the four body projections
  // of every layer compute all three of their products in FP8 E4M3 — the forward Y = X·Wᵀ (X and
  // W scaled per row), dX = dY·W (dY per row, W per column) and dW += dYᵀ·X (dY and X per
  // column): every scale lies along a dimension its product keeps (Backend::quantize_rows_e4m3 /
  // quantize_cols_e4m3, Backend::gemm_e4m3), the gradients' products accumulated in F32, the
  // forward's as set_fp8_fast_forward says. The quantisation is straight-through: the backward
  // treats it as the identity. Everything else (embedding, conv, norms, the GLA mixer, the LM
  // head, the optimizer and its F32 masters) keeps its precision.
  // Call before plan() (a training plan); the weights stay in the model dtype, and after every
  // change of them quantize_training_weights() writes both codes of each body matrix.
  // Errors: unsupported (the backend has no FP8 products, FP8 inference weights are on, or
  // the model is already planned).
  Status use_fp8_training();
  bool fp8_training() const { return fp8_train_; }
  void quantize_training_weights();
  // The spec lists of the FP8 arenas (FP8 weights, per row and transposed; the projections' input
  // codes; the gradient products' operands) for `tokens` rows, which the memory plan counts,
  // and the bytes this model allocated for them.
  static std::vector<std::vector<TensorSpec>> fp8_training_specs(const Config& c, int64_t tokens);
  size_t fp8_bytes() const;

  // Plans and allocates the activation arena (and, for training, the backward
  // scratch). Returns the bytes of each buffer class through activation_bytes().
  Status plan(const PlanOptions& opt);
  size_t activation_bytes() const { return acts_.bytes() + scratch_.bytes(); }
  const PlanOptions& plan_options() const { return plan_; }
  // Token rows and logit rows the plan holds (max_tokens / max_logit_rows resolved).
  int64_t plan_rows() const { return plan_rows_; }
  int64_t logit_rows() const { return logit_rows_; }

  // Forward of B sequences of T tokens (host ids, row-major [B,T]). With `pool`,
  // row b starts from the state in slot slots[b] (host ids; nullptr = slot b) and
  // leaves it updated; without, every sequence starts from the zero state. F32 pools
  // (F64 for F64 models); BF16 models may also use a BF16 pool on backends that take
  // BF16 states (CUDA): decode reads and writes it directly, chunked forwards convert
  // each row's state to F32 and back around the mixer. A pool with deferred write-back
  // (pairs in the model's dtype) is decoded by gla_decode_gate_deferred; a chunked forward
  // first folds its rows' pending pairs into their states.
  void forward(const int32_t* tokens, int64_t B, int64_t T, const ForwardOptions& opt,
               StatePool* pool = nullptr, const int32_t* slots = nullptr);

  // A ragged forward: G = lengths.size() sequences, sequence g's lengths[g] tokens at
  // offset Σ_{h<g} lengths[h] of `tokens`, each from and into its slot slots[g] of `pool`,
  // chunked form, each sequence's last-token logits (logits() is [G, V], row g). The
  // token-wise ops (norms, projections, FFN, head) run once over all Σ lengths rows; the
  // conv and the mixer once per run of adjacent sequences of one length, as [G_k, n_k] —
  // so put sequences that share a length next to each other. On the CPU every row is
  // bitwise what a forward of its sequence alone gives (its ops are row-invariant).
  void forward_ragged(const int32_t* tokens, const std::vector<int64_t>& lengths, StatePool& pool,
                      const int32_t* slots);

  // The ragged forward split for CUDA graphs: the caller has put the ids [Σ lengths] in
  // input_ids() and the slot ids [G] in input_slots() on the device (slots not range-checked
  // here); forward_ragged_queued() queues the forward without host copies or syncs, and
  // set_replayed_ragged(G) makes logits() view a replay's [G, V]. Pools whose chunked forward
  // stages states by host slot ids (BF16 states) cannot be queued: ragged_queueable().
  bool ragged_queueable(const StatePool& pool) const;
  void forward_ragged_queued(const std::vector<int64_t>& lengths, StatePool& pool);
  void set_replayed_ragged(int64_t G);

  // The same forward split for CUDA graphs: the caller has put the ids [B·T] and (with
  // a pool) the slot ids [B] in input_ids() / input_slots() on the device, then
  // forward_queued() queues the whole forward without touching host memory (no copies,
  // no synchronisation), so it can be captured and replayed. Decode (kRecurrent, T = 1)
  // with a pool, or any forward without one; slots are not range-checked here.
  Tensor input_ids() const { return ids_; }
  Tensor input_slots() const { return slots_; }
  void forward_queued(int64_t B, int64_t T, const ForwardOptions& opt, StatePool* pool);
  // After a replay of a captured forward_queued(B, T, opt, ...): logits() views its logits.
  void set_replayed(int64_t B, int64_t T, const ForwardOptions& opt);

  // Speculative verification (docs/serving.md §11): B rows of T tokens (host ids [B, T]), row b
  // continuing the context of slot slots[b] of a pool with deferred write-back (R ≥ T), every
  // position's logits ([B·T, V], row b·T + t). Position t computes what the (t + 1)-th of T
  // decode steps feeding the row's tokens would (on the CPU the same bits: every op is
  // row-invariant there and the mixer is Backend::gla_verify_deferred). Nothing in the pool is
  // written; commit() then makes the accepted prefix of each row part of its context. Needs a
  // plan with verify_rows ≥ B·T and a backend that supports gla_verify_deferred.
  void verify(const int32_t* tokens, int64_t B, int64_t T, StatePool& pool, const int32_t* slots);
  // After verify(), before any other forward: row b's first accepted[b] tokens (host, 0 … T; 0
  // leaves its slot alone) join its slot's context. The slot's bytes are then those that
  // accepted[b] decode steps of those tokens leave (on the CPU bitwise): the mixer's states,
  // pairs and counts through Backend::gla_verify_commit, the conv window from the kept inputs.
  void commit(const int32_t* accepted);

  // Logits of the last forward: [B·T, V], or [B, V] with last_logits_only. In the
  // model dtype, except BF16 models in inference plans, whose logits are F32.
  Tensor logits() const { return logits_; }

  // Mean cross-entropy of the last forward's logits against host targets [B·T]
  // (targets < 0 are ignored). Synchronises.
  double loss(const int32_t* targets);

  // Gradient of the mean loss of the last (training) forward. Accumulates into a
  // gradient arena created from weight_specs(config, F32-or-compute dtype; F32 for
  // BF16 models, whose optimizer updates F32 master weights); the
  // caller zeroes it once per optimizer step. `loss_scale` multiplies the gradient
  // (1/accumulation steps when micro-batches are averaged). Overwrites the logits.
  // `after_group` (optional) is called once every op that writes group g's gradients
  // has been queued, in backward order (L + 1, L, …, 0). With recompute_layers the backward
  // first runs layer l's forward again (the same GLA form, documents and FP8 codes as the
  // forward's; the FP8 accumulation as set_fp8_fast_forward says now), after calling the
  // forward's before_group(1 + l).
  //
  // With `overwrite`, the gradients that products write (the four projections of every
  // layer and the LM head) are written, not added to, so the caller need not zero them:
  // zero_accumulated_gradients() zeroes the rest (norms, conv, embedding), whose ops add.
  // The values are those of a backward into a zeroed arena (a sum's first term is itself).
  // A store that takes each micro-batch's gradient apart (the sharded trainer) then zeroes
  // about a tenth of laplace-3b's arena (mostly the embedding) before each micro-batch, not all.
  void backward(const int32_t* targets, const Arena& grads, double loss_scale = 1.0,
                const GroupHook& after_group = nullptr, bool overwrite = false);
  void zero_accumulated_gradients(const Arena& grads);

 private:
  struct LayerActs {
    Tensor x_in;         // [N, D]     residual stream entering the layer
    Tensor ln1_mean;     // [N]
    Tensor ln1_rstd;     // [N]
    Tensor u;            // [N, D]     norm1 output = conv input
    Tensor conv_pre;     // [N, D]     conv pre-activation
    Tensor c;            // [N, D]     conv output (SiLU)
    Tensor qkvg;         // [N, H(2dk+2dv)]
    Tensor o;            // [N, H·dv]  GLA output
    Tensor onorm_rstd;   // [N, H]
    Tensor y;            // [N, H·dv]  RMSNorm(o) ⊙ SiLU(g)
    Tensor x_mid;        // [N, D]     residual stream after the mixer
    Tensor ln2_mean;     // [N]
    Tensor ln2_rstd;     // [N]
    Tensor z;            // [N, D]     norm2 output
    Tensor ab;           // [N, 2F]
    Tensor h;            // [N, F]     SiLU(a) ⊙ b
  };

  GlaParams gla_params(GlaForm form) const;
  Tensor doc_view(int64_t B, int64_t T) const;  // doc_ as [B, T]
  Tensor rstd_view(const Tensor& onorm_rstd, int64_t B, int64_t T) const;
  // Documents kept apart on a backend whose ops do not take GlaParams::doc
  // (Backend::keeps_documents_apart() false): each document of each row of the last forward
  // (doc_segs_) runs through the conv and the mixer as a [1, n] sequence of its own (views into the
  // batch), from a zero state and window: the same function as the ops' doc, in more calls. Only
  // forwards without a state pool (training, evaluation). With a backend that takes doc, or no
  // documents, each wrapper is the one op call.
  bool documents_by_views() const;
  void conv_forward(const Tensor& u, const Tensor& w, Tensor c, Tensor pre, const Tensor& doc);
  void conv_backward(const Tensor& dc, const Tensor& u, const Tensor& w, const Tensor& pre, Tensor du, Tensor dw,
                     const Tensor& doc);
  void mixer_forward(const GlaParams& gp, const Tensor& q, const Tensor& k, const Tensor& v, Tensor o);
  void mixer_backward(const GlaParams& gp, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& d_o,
                      Tensor dq, Tensor dk, Tensor dv);
  // Views of the fused projection as q, k, v, g: [B, T, H, d].
  Tensor qkvg_part(const Tensor& qkvg, int64_t B, int64_t T, int part) const;
  void check_forward(int64_t B, int64_t T, const ForwardOptions& opt, const StatePool* pool) const;
  // F32 staging for B rows' states [B, H, dk, dv] (grown on demand).
  Tensor state_stage(int64_t B);
  // One layer's forward in a training plan ([B, T] from the zero state, no pool): reads layer l's
  // x_in, writes its intermediates (with recompute_layers, the shared set) and, with write_out,
  // x_out (the next layer's x_in, or x_final_). run_forward runs it for every layer; the backward
  // of a recompute_layers plan runs it again for layer l without x_out (nothing reads it again).
  void train_layer_forward(int64_t l, int64_t B, int64_t T, const GlaParams& gp, bool write_out);
  // Sequences [first, first + B) of one length T, at token row `row` of the forward.
  struct Segment {
    int64_t row = 0, first = 0, B = 0, T = 0;
  };
  // The forward once ids_ (and slots_) are on the device: one segment [B, T], or the
  // segments of a ragged forward (last-token logits only); host_slots: only for a BF16
  // pool in a chunked forward (its rows' states are staged through stage_).
  void run_forward(std::span<const Segment> segs, const ForwardOptions& opt, StatePool* pool,
                   const int32_t* host_slots);
  // run_forward's parts in an inference plan: per layer the mixer block (x_in → x_mid) and the
  // channel mixer (x_mid → x_out), then the head. Pass: what the layers of one forward share.
  struct Pass;
  void infer_mixer(int64_t l, const Pass& p);
  void infer_channel_mixer(int64_t l, const Pass& p);
  void infer_head(const Pass& p, const ForwardOptions& opt);
  // A ragged forward's segments (runs of adjacent sequences of one length), checked against
  // the plan and the pool; and its options (chunked form, last-token logits).
  std::vector<Segment> ragged_segments(const std::vector<int64_t>& lengths, const StatePool& pool) const;
  static ForwardOptions ragged_options();
  void run_forward(int64_t B, int64_t T, const ForwardOptions& opt, StatePool* pool, const int32_t* host_slots) {
    const Segment one{0, 0, B, T};
    run_forward(std::span<const Segment>(&one, 1), opt, pool, host_slots);
  }

  // One body matrix in FP8: codes [rows, cols] F8E4M3 and scales [rows] F32.
  struct Fp8Matrix {
    Tensor q, s;
  };
  // y = residual + x·Wᵀ (residual may be undefined, or y itself): in FP8 when f holds the
  // matrix's codes (FP8 weights in inference, or FP8 training), else the backend's gemm / gemm_add.
  void project(const Tensor& x, const Tensor& w, const Fp8Matrix& f, const Tensor& residual, Tensor y);
  // The FP8 product of project from x's codes and scales (quantize_rows_e4m3's xq, xs).
  void project_codes(const Tensor& xq, const Tensor& xs, const Fp8Matrix& f, const Tensor& residual, Tensor y);
  // The backward of project: dx = dy·W and gw += dyᵀ·x (gw = dyᵀ·x with overwrite), in FP8 when
  // ft (W's per-column codes, [cols, rows]) is defined, else the backend's gemms.
  void project_backward(bool overwrite, const Tensor& dy, const Tensor& w, const Fp8Matrix& ft, const Tensor& x,
                        Tensor dx, Tensor gw);
  Status create_fp8_arena(bool training);
  // Whether the backend's FP8 products take a weight [rows, cols]; else why not, naming `what`.
  Status fp8_product_fits(const std::string& what, int64_t rows, int64_t cols) const;
  Status plan_fp8_inputs();  // the projections' input codes and scales, for plan_rows_ rows
  Status plan_fp8(bool training);  // plan()'s FP8 buffers, for the FP8 mode chosen before it
  Config cfg_;
  Backend* be_ = nullptr;
  DType dtype_ = DType::kF32;
  Arena weights_;
  ModelWeights w_;

  PlanOptions plan_;
  Arena acts_;     // activations (per layer when training)
  Arena scratch_;  // backward scratch (training only)
  std::vector<LayerActs> layer_;
  // Speculative verification: each layer's conv input u [verify_rows, D] and projections
  // [verify_rows, H(2dk+2dv)] (PlanOptions::verify_rows), the commit's accepted counts [B] I32,
  // and the forward being verified (its pool, shape and host slots; B = 0: none to commit).
  struct VerifyActs {
    Tensor u, qkvg;
  };
  std::vector<VerifyActs> verify_acts_;
  Tensor accepted_;
  bool verifying_ = false;  // run_forward: the forward is a verification
  StatePool* verify_pool_ = nullptr;
  int64_t verify_B_ = 0, verify_T_ = 0;
  std::vector<int32_t> verify_slots_;
  Tensor ids_, targets_, slots_;  // [N] I32, [N] I32, [B] I32 on the device
  Tensor doc_;                    // [N] I32 on the device: the last forward's document starts
  bool doc_on_ = false;           // whether the last forward kept documents apart
  std::vector<std::array<int64_t, 3>> doc_segs_;  // its documents: (row, first, end) each
  // The last training forward's GLA form and group hook, for the backward's recompute_layers.
  GlaForm last_form_ = GlaForm::kChunked;
  GroupHook last_before_;
  Tensor x_final_;                // [N, D] residual stream after the last layer
  Tensor lnf_mean_, lnf_rstd_;    // [N]
  Tensor zf_;                     // [N, D] final norm output
  Tensor logits_buf_;             // [N, V]
  Tensor losses_;                 // [N]
  Tensor logits_;                 // view of logits_buf_ for the last forward
  int64_t plan_rows_ = 0, logit_rows_ = 0;
  Arena stage_;                   // [B, H, dk, dv] F32: BF16-pool states of a chunked forward
  int64_t last_B_ = 0, last_T_ = 0;
  bool last_only_ = false;
  // Backward scratch.
  Tensor dx_, dtmp_, du_, dc_, dqkvg_, do_, dy_, dz_, dab_, dh_;
  // FP8 weights: per layer W_qkvg, W_o, W_12, W_3 (empty tensors when off), and the inputs'
  // codes [N, max K] and scales [N] of the projection being run.
  bool fp8_on_ = false;
  Arena fp8_, fp8_inputs_;
  std::vector<std::array<Fp8Matrix, 4>> fp8_layers_;
  Tensor fp8_xq_, fp8_xs_;
  // FP8 training: fp8_layers_ hold each matrix's per-row codes, fp8_cols_ its per-column codes
  // (Wᵀ [cols, rows], scales [cols]); the backward's operands: dY per row [N, max out] and
  // per column [max out, N], X per column [max in, N].
  bool fp8_train_ = false;
  Arena fp8t_, fp8_grads_;
  std::vector<std::array<Fp8Matrix, 4>> fp8_cols_;
  Tensor fp8_dyq_, fp8_dys_, fp8_dytq_, fp8_dyts_, fp8_xtq_, fp8_xts_;
  bool fp8_fast_forward_ = false;
  // The FP8 LM head (set_fp8_head): codes [V, D] and scales [V], and whether forwards use them.
  Arena fp8_head_arena_;
  Fp8Matrix fp8_head_;
  bool fp8_head_on_ = false;
};

}  // namespace laplace
