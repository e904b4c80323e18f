// The memory plan of a training run (issue #4): which micro-batch B, gradient
// accumulation A and recompute (none, the mixer's GLA output, or every layer's activations)
// fit on the device, and the bytes of each buffer class. A pure function of the config and the request (no allocation), so it runs before
// anything is allocated and tests can feed it synthetic memory sizes.
//
// Buffer classes (each an Arena; sizes include the arena's 256-byte alignment padding):
//   weights           weight_specs(c, model dtype)
//   masters           F32 copies of the weights (BF16 models only, docs/training.md)
//   gradients         weight_specs(c, F32 or the compute dtype)
//   optimizer         Muon momentum / AdamW m, v (param dtype) + the Muon update buffer +
//                     Newton–Schulz scratch + the step's device scalars (Optimizer::init)
//   activations       Model::plan's activation arena for a training plan of B×T: every layer's
//                     intermediates; with the mixer recompute one GLA output for all layers;
//                     with full-layer recompute each layer's input and one layer's intermediates
//   backward scratch  Model::plan's backward scratch arena
//   fp8               FP8 training (Model::use_fp8_training): both codes and scales of every
//                     body matrix, the projections' input codes and the gradient products' operands
// The same spec lists as Optimizer::init and Model::plan (tests check the sums against
// the real arenas); anything else (cuBLASLt workspace, op scratch, the loss buffers)
// comes out of the reserve.
//
// Choice (when asked to choose): micro-batches from the largest candidate down; for each,
// recompute off before the mixer's (which costs a GLA forward per layer; a smaller B costs
// GEMM efficiency everywhere); then, where allowed, full-layer recompute for each B from the
// largest down (it costs about one more forward per step: a last resort, e.g. laplace-3b at
// T = 32768); the first that leaves `reserve_bytes` of `device_bytes` free wins. With a
// tokens-per-step target, B must divide the step's sequences and A = sequences / B; otherwise
// A is as requested.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "core/status.h"
#include "core/tensor.h"
#include "model/config.h"

namespace laplace {

struct PlanOptions;  // model/model.h

// FSDP (distributed/fsdp_layout.h): one rank's sharded buffers, in bytes. The full weights and the
// full local gradient of a micro-batch stay the plan's own classes.
struct ShardBytes {
  size_t masters = 0;     // master-weight shards
  size_t gradients = 0;   // gradient shards (beside the full local gradient)
  size_t optimizer = 0;   // optimizer-state shards, the Muon update, owned and broadcast buffers, NS scratch
  size_t staging = 0;     // the collectives' staging buffers
  size_t init_table = 0;  // full initial weights held during setup (BF16 models); counted as if held throughout
};

// What a training plan recomputes in the backward (MemoryPlanRequest::recompute).
enum : int {
  kRecomputeChoose = -1,  // choose (see above)
  kRecomputeNone = 0,     // every layer's activations kept
  kRecomputeMixer = 1,    // PlanOptions::recompute_mixer
  kRecomputeLayers = 2,   // PlanOptions::recompute_layers
};
const char* recompute_name(int recompute);  // "none", "mixer", "layers" ("auto" for choose)

struct MemoryPlanRequest {
  int64_t seq = 2048;            // T
  DType dtype = DType::kBF16;    // model dtype (BF16 trains F32 masters and F32 gradients)
  int64_t batch = 0;             // micro-batch B; 0 = choose
  int64_t grad_accum = 1;        // A, when tokens_per_step is 0
  int64_t tokens_per_step = 0;   // B·T·A target; 0 = none (A = grad_accum)
  int recompute = kRecomputeChoose;  // -1 choose, 0 none, 1 the mixer, 2 full layers (kRecompute*)
  // Choosing: whether full-layer recompute is a candidate. Off unless the caller plans it
  // (PlanOptions::recompute_layers from MemoryPlan::recompute_layers).
  bool allow_recompute_layers = false;
  bool muon_fused = false;       // Newton–Schulz scratch sized for whole matrices
  bool ns_bf16 = true;           // Newton–Schulz scratch in BF16 (the CUDA trainer)
  size_t device_bytes = 0;       // memory available before anything is allocated; 0 = unknown
  size_t reserve_bytes = 0;      // left free for everything the plan does not count
  int64_t max_batch = 8;         // largest candidate B (powers of two down to 1)
  bool fp8 = false;              // FP8 training (--precision fp8)
  // FSDP over `ranks` ranks: this rank's shards replace the single-process trainer's masters,
  // optimizer state and Newton–Schulz scratch; B, A and tokens_per_step are per rank.
  const ShardBytes* sharded = nullptr;
  int ranks = 1;
};

struct MemoryPlan {
  int64_t batch = 0, grad_accum = 0, seq = 0;
  bool recompute_mixer = false;   // PlanOptions::recompute_mixer
  bool recompute_layers = false;  // PlanOptions::recompute_layers
  bool chosen = false;  // B (and recompute) were chosen here, not given
  DType dtype = DType::kF32;
  size_t weights = 0, masters = 0, gradients = 0, optimizer = 0, activations = 0, backward_scratch = 0;
  size_t staging = 0, init_table = 0;  // FSDP only
  size_t fp8 = 0;                      // FP8 training only
  int ranks = 0;                       // FSDP: the rank count (0: the single-process trainer)
  size_t device_bytes = 0, reserve_bytes = 0;
  std::vector<std::string> rejected;  // "B=8 recompute off: 151.2 GB > 140.4 GB" per rejected candidate

  int recompute() const {
    return recompute_layers ? kRecomputeLayers : recompute_mixer ? kRecomputeMixer : kRecomputeNone;
  }

  size_t total() const {
    return weights + masters + gradients + optimizer + activations + backward_scratch + staging + init_table + fp8;
  }
  int64_t tokens_per_step() const { return batch * seq * grad_accum; }
  // total + reserve ≤ device_bytes (true when the device size is unknown).
  bool fits() const { return device_bytes == 0 || total() + reserve_bytes <= device_bytes; }
};

// Model::plan's options for this plan's training micro-batch (B, T and the recompute).
PlanOptions training_plan_options(const MemoryPlan& p);

// The FP8 training arenas of a model for N tokens per micro-batch (Model::use_fp8_training's and
// its plan's spec lists).
size_t fp8_training_bytes(const Config& c, int64_t tokens);

// The bytes of each class for a given B, T and recompute (kRecomputeNone/Mixer/Layers; false and
// true are none and the mixer's); no choice, fits() as given.
MemoryPlan memory_plan_for(const Config& c, const MemoryPlanRequest& r, int64_t batch, int recompute);

// Chooses B/A/recompute as described above. Errors: invalid request (T < 1, a
// tokens-per-step target that is not a multiple of T, a given B that does not divide
// the target's sequences) or nothing fits (the message lists what was tried).
Status choose_memory_plan(const Config& c, const MemoryPlanRequest& r, MemoryPlan* out);

// The plan as printed at the start of training: a header line and one line per class,
// total against `device_label` memory.
std::string format_memory_plan(const MemoryPlan& p, const std::string& device_label);

}  // namespace laplace
