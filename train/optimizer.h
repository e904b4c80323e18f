// The optimizer of docs/training.md §6: Muon for the body matrices, AdamW for everything else,
// global gradient-norm clipping and skipping of non-finite steps. Written only in
// terms of Backend calls, so it runs on any backend.
//
// Row-shardable by construction (for FSDP, docs/distributed.md): every state tensor
// (Muon momentum, AdamW m and v) has the shape of its parameter, and every step phase
// except Newton–Schulz is element-wise, so it works unchanged on a row shard
// [row_begin, row_end) of a parameter. A Muon step is therefore three functions:
//   1. muon_prepare      element-wise: momentum ← μ·momentum + g; u = Nesterov update
//   2. muon_orthogonalise needs WHOLE blocks: o = NS(u) per row block
//   3. muon_finish       element-wise: w ← w·(1 − lr·wd) − lr·s(block)·o per row block
// A distributed optimizer runs 1 on its shard, gathers u (or sends it to the matrix's
// owner), runs 2 on whole matrices, scatters o back and runs 3 on its shard with the
// shard's global row offset (the scale s depends on the GLOBAL block shape).
// The global grad norm is Σ sum_squares over the grads; a sharded version all-reduces
// the partial sums (in a fixed order) before the skip/clip decision.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/arena.h"
#include "core/status.h"
#include "core/tensor.h"
#include "ops/backend.h"
#include "train/muon.h"

namespace laplace {

struct Param {
  std::string name;  // canonical tensor name ("model.layers.0.wqkvg.weight")
  Tensor w;          // fp32 master weights, [rows, cols] or 1-D
  Tensor g;          // its gradient (same shape and dtype); clipping scales it in place
  bool muon = false;
  // Muon only: row counts orthogonalised separately (sum = rows); empty or {rows}
  // means fused. W_qkvg: {H·dk, H·dk, H·dv, H·dv}; W_12: {F, F}.
  std::vector<int64_t> blocks;
  // Weight decay. AdamW params: as given (true for embeddings/head only). Muon params
  // are always decayed (docs/training.md §6), whatever this says.
  bool decay = false;
  // Row shards (with a ShardExchange): w and g are the rows [row_begin, row_begin + rows)
  // of a matrix of global_rows rows (0: w's own), and Muon's blocks are the whole matrix's.
  int64_t row_begin = 0, global_rows = 0;
  // Optional state the caller owns (shape, dtype and device of w): Muon's momentum in
  // state0, AdamW's m and v in state0 and state1. Undefined: the optimizer allocates it.
  Tensor state0, state1;
};

// What a step over row shards needs from the other ranks (distributed/sharded_parameters.h implements it).
// Every call is collective (each rank makes the same calls in the same order) and is queued
// on the device: nothing in it waits for the device or reads a value back.
class ShardExchange {
 public:
  virtual ~ShardExchange() = default;
  // ss (device scalar) = Σ g² over every rank's rows of every parameter, summed in an order
  // that the number of ranks does not change (so the clip coefficient has the same bits).
  virtual void grad_sum_squares_into(Tensor ss) = 0;
  // Where the optimizer's Muon param i writes its update u: w's shape, on the device.
  virtual Tensor muon_update(size_t i) = 0;
  // Every muon_update(i) ← the matching rows of NS(u) of its whole blocks.
  virtual void orthogonalise() = 0;
};

struct OptimizerConfig {
  double lr = 0.0;  // the peak learning rate (informational: step() takes the actual lr)
  double weight_decay = 0.0;
  // AdamW
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8;
  // Muon
  double momentum = 0.95;
  bool nesterov = true;
  int ns_steps = 5;
  MuonScale scale = MuonScale::kRms;
  // Global gradient-norm clipping; 0 = off.
  double max_grad_norm = 1.0;
  // Newton–Schulz in bf16 (docs/training.md §6; the CUDA trainer's choice). Off: in the master dtype
  // (the CPU path, which the F32 PyTorch reference checks).
  bool ns_bf16 = false;

  Status validate() const;
};

struct StepResult {
  bool skipped = false;    // non-finite gradient norm: nothing was touched
  double grad_norm = 0.0;  // global norm before clipping
  double clip_coef = 1.0;  // factor the gradients were scaled by (1 when not clipped)
};

// ---- the three Muon phases (see the header comment) ---------------------------------
// m ← μ·m + g;  u = g + μ·m (Nesterov) or u = m. Element-wise; any row shard.
void muon_prepare(Backend& be, const Tensor& g, Tensor momentum, Tensor u, double mu, bool nesterov);
// o = NS(u) for each row block of u (blocks sum to u's rows). Needs whole blocks.
// o may alias u.
void muon_orthogonalise(Backend& be, const Tensor& u, const std::vector<int64_t>& blocks, Tensor o,
                        NsScratch& scratch, int ns_steps);
// w ← w·(1 − lr·wd) − lr·muon_scale(block_rows, cols)·o, row by row block. w and o are
// the rows [row_begin, row_begin + w.rows) of a matrix whose global row blocks are
// `blocks`; rows of the shard outside every block are a programming error.
// With a device scalar `skip`, the gated form (nothing when skip is non-zero).
void muon_finish(Backend& be, Tensor w, const Tensor& o, const std::vector<int64_t>& blocks,
                 int64_t row_begin, double lr, double wd, MuonScale mode, const Tensor& skip = Tensor{});

// Global gradient norm: sqrt(Σ sum_squares(g)) in param order, in double.
double global_grad_norm(Backend& be, const std::vector<Param>& params);
// The same Σ sum_squares(g), in the same order, into a device scalar acc (no host sync).
void global_grad_sum_squares_into(Backend& be, const std::vector<Param>& params, Tensor acc);

class Optimizer {
 public:
  Optimizer() = default;
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  // Validates the params (unique names, w/g same shape, dtype F32 or F64, on the
  // backend's device; Muon params 2-D with blocks summing to rows) and the config,
  // then allocates every state tensor in ONE zeroed Arena on the backend's allocator:
  // "optim.<name>.momentum" (Muon) or "optim.<name>.adam_m"/".adam_v" (AdamW), in the
  // dtype of w (except state a Param brings), plus the Muon update buffer, the
  // Newton–Schulz scratch and the step's device scalars.
  // With `exchange` the params may be row shards (Param::row_begin, global_rows): the norm
  // and the Muon orthogonalisation go through it, and the optimizer allocates no Muon
  // buffers of its own. Without it every param must be whole.
  Status init(Backend& be, std::vector<Param> params, const OptimizerConfig& cfg,
              ShardExchange* exchange = nullptr);
  // The bytes init allocates for params that bring their state, with an exchange: the
  // step's device scalars alone (a sharded trainer's memory plan counts them).
  static size_t sharded_scratch_bytes();

  // One step at learning rate lr (the schedule is the caller's):
  //  1. norm = global_grad_norm; non-finite ⇒ {skipped, norm}, nothing touched.
  //  2. norm > max_grad_norm > 0 ⇒ every g *= max_grad_norm / (norm + 1e−6).
  //  3. t += 1; AdamW params: adamw_update(step t, wd = decay ? weight_decay : 0).
  //  4. Muon params: muon_prepare → muon_orthogonalise → muon_finish (wd = weight_decay).
  StepResult step(double lr) {
    enqueue_step(lr);
    return finish_step();
  }
  // step() in two halves, so a trainer can queue the whole step with no host sync:
  // enqueue_step queues 1–4 with the norm, the clip coefficient and the skip flag kept in
  // device scalars (every update op is gated on the flag, so a skipped step touches
  // nothing); finish_step reads them back (the one sync, at the step boundary), counts the
  // step unless it was skipped and returns the result. Exactly step()'s arithmetic.
  void enqueue_step(double lr);
  StepResult finish_step();

  // Checkpoint state: views of the persistent state ("optim.<name>.momentum",
  // "optim.<name>.adam_m", "optim.<name>.adam_v"), in param order.
  std::vector<std::pair<std::string, Tensor>> state_tensors() const;
  // Copies checkpointed state in. Every state tensor must be present with the same
  // shape and dtype; names starting with "optim." that are not state tensors of this
  // optimizer are errors; other names are ignored. Nothing changes on error.
  Status load_state(const std::vector<std::pair<std::string, Tensor>>& tensors, int64_t step_count);

  int64_t step_count() const { return t_; }
  void set_step_count(int64_t t) { t_ = t; }

  const std::vector<Param>& params() const { return params_; }
  const OptimizerConfig& config() const { return cfg_; }
  size_t state_bytes() const { return arena_.bytes(); }

 private:
  struct Slot {
    std::string name0, name1;  // "optim.<param>.momentum" (Muon) or ".adam_m", ".adam_v" (AdamW)
    Tensor state0, state1;     // the caller's or views of arena_
  };

  Backend* be_ = nullptr;
  ShardExchange* exchange_ = nullptr;
  OptimizerConfig cfg_;
  std::vector<Param> params_;
  std::vector<Slot> slots_;
  Arena arena_;
  Tensor update_;  // flat buffer for the Muon update u / o, sized for the largest Muon param
  // [4] F64 device scalars of the step: {Σ g², norm, clip coef, skip} (grad_clip_scalars).
  Tensor scalars_;
  bool pending_ = false;  // enqueue_step ran, finish_step not yet
  NsScratch ns_;
  int64_t t_ = 0;
};

}  // namespace laplace
