// The sharded ParameterStore (train/parameter_store.h): FSDP-style data-parallel training
// (docs/distributed.md) behind `mpirun -np P laplace train …` (or `laplace train
// --distributed` in one process), with train/trainer.h's Trainer running the loop.
//
// Every rank holds, for every parameter, the rows shard_rows(rows, rank, P) (distributed/plan.h)
// of its fp32/fp64 master weights, gradient and optimizer state (Muon momentum or
// AdamW m, v). A step:
//   for each of the A = grad-accum micro-steps:
//     zero the local full-size gradient; forward + backward on this rank's B sequences
//     (loss scale 1/(A·P)); reduce-scatter the gradient into the shards (sum over ranks
//     in rank order); the first micro-step copies, later ones add (shard = shard + part).
//   optimizer on the shards, train/optimizer.h's Optimizer queued with no host sync, this
//   store its ShardExchange: global norm from per-row partial sums gathered from every
//   rank into (param, row) order and summed on the device in one fixed order (so the norm
//   does not depend on P); skip when non-finite (a device flag gates the updates); clip;
//   AdamW element-wise on the shards; Muon: momentum on the shards, whole units
//   orthogonalised by their owners via --muon-comm gather|all_to_all (identical bytes into
//   one newton_schulz call per unit, so the two are bitwise equal), update applied on the
//   shards; then all-gather the shards into the full weights, and read the step's result.
// Parameters are gathered and gradients reduce-scattered per parameter, walked in
// per-layer groups (embedding; layer 0 … L−1; final norm + head; model/model.h's weight
// groups). Overlap (distributed/comm.h): after the optimizer every shard is rounded, then the
// groups are all-gathered in forward order beside the compute, and the forward waits
// for group g's all-gather only just before it reads group g; the backward hands each
// group to the reduce-scatter as soon as its gradients are queued, so the reductions of
// layer l run while layer l−1's backward computes. A later micro-step's reduce-scatter
// adds into the shard (recv = recv + rank-order sum), the same sum as before. With a
// host communicator (MPI) the same calls simply run in turn.
//
// Equivalence: with P ranks of batch B and grad-accum A, the micro-batches of a step
// are, in order, (a = 0, r = 0), (0, 1), …, (0, P−1), (1, 0), … and read exactly the
// windows that one rank with batch B and grad-accum A·P reads in its A·P micro-steps.
// Every gradient and loss sum follows that order, so P ranks with grad-accum 1 are
// bitwise identical to 1 rank with grad-accum P (tests/test_dist.cpp). One rank with
// batch B·P is NOT bitwise identical: its gemms sum all B·P·T token rows inside one
// BLAS call, in an order the library chooses; it agrees to rounding.
//
// Checkpoints: rank 0 gathers the shards and writes ONE full checkpoint in the
// single-process format (train/checkpoint.h; atomic temp + rename) plus the metadata
// "dist_world" and "muon_comm"; every rank loads its own rows from it, so a checkpoint
// written on P ranks resumes on any P′ (or in a single-process run, and vice versa).
//
// Precision and devices: on the CPU the masters are the compute dtype (F32/F64). On
// CUDA (with the NCCL communicator, one rank per GPU) the model computes in BF16 and the
// shards hold F32 masters, F32 gradients and F32 optimizer state, as WholeParameters
// (train/whole_parameters.h) does on one GPU: each shard's masters are rounded to BF16 on
// their own rank and the BF16 rows are all-gathered (half the bytes); gradients are
// reduce-scattered in F32; Newton–Schulz runs in BF16. Every buffer the collectives touch
// lives on the backend's device, and the collectives are queued on the backend's stream.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "distributed/comm.h"
#include "distributed/plan.h"
#include "model/model.h"
#include "train/checkpoint.h"
#include "train/optimizer.h"
#include "train/parameter_store.h"
#include "train/trainer.h"

namespace laplace {

// A step's bytes over the communicator: the metrics.jsonl fields and the progress line's detail.
struct DistStepTraffic {
  int64_t muon_sent = 0, muon_received = 0;  // this rank, this step, Muon exchanges only
  int64_t fsdp_sent = 0, fsdp_received = 0;  // weight all-gather + gradient reduce-scatter + norm
  std::vector<int64_t> muon_sent_per_rank, muon_received_per_rank;
};

// The optimizer step is train/optimizer.h's Optimizer over this rank's shards, queued with
// no host synchronisation as on one device; the store is its ShardExchange (the norm's row
// sums from every rank, the Muon exchanges).
class ShardedParameters : public ParameterStore, private ShardExchange {
 public:
  ShardedParameters(MuonComm muon_comm, Communicator& comm);

  int rank() const override { return me_; }
  int ranks() const override { return P_; }
  Status agree(const Status& local) override { return agree_status(comm_, local); }
  std::vector<int64_t> all_gather_value(int64_t v) override { return laplace::all_gather_value(comm_, v); }
  void all_gather_value(double v, double* all) override;
  void quiesce() override { comm_.overlap_end(); }

  Status check_options(const TrainOptions& o) override;
  Status attach(const TrainerParts& parts) override;
  // Every rank plans with the same numbers: the least free memory of any rank (on the CPU,
  // where the ranks share one host's memory, a 1/P share of it) and the largest shards of
  // any rank, so they all choose the same micro-batch.
  void plan_request(MemoryPlanRequest* r) override;
  Status create() override;
  std::vector<TensorSpec> loss_specs() const override;
  void bind_loss(const Arena& a, size_t first) override;
  Status load_checkpoint(const std::string& path, TrainProgress* progress) override;
  void refresh_weights() override { gather_weights(); }
  // The plan hash covers the owner assignment, the config and the flags that shape it.
  uint64_t plan_hash() const override { return plan_hash_; }
  size_t allocated_bytes() const override;

  void begin_step() override;
  ForwardOptions forward_options() override;
  void begin_micro(int64_t a) override;
  void micro_loss(const Tensor& losses, double count, int64_t a) override;
  const Arena& gradients() const override { return grads_; }
  bool overwrite_gradients() const override { return true; }
  double loss_scale() const override;
  GroupHook after_group(int64_t a) override;
  void end_micro(int64_t a) override;
  void before_optimizer() override;
  void after_optimizer() override;
  double step_loss() override;

  Status save_checkpoint(const std::string& out_dir, const TrainProgress& progress) override;

  std::string dtype_note() const override;
  std::string setup_lines() const override;
  std::string ranks_note() const override;
  std::string record_fields() const override;
  std::string progress_detail() const override;
  // Detaches the communicator from the backend's stream, which goes with the backend.
  void detach() override;

 private:
  struct Local {
    RowRange mine;
    std::vector<RowRange> all;  // every rank's rows
    Tensor full_w, full_g;       // the model's full weights / local micro-batch gradient
    Tensor w, g, s0, s1;         // shards: master, gradient, momentum or adam_m, adam_v
    int64_t u_off = -1;          // Muon: offset of this rank's rows in the update buffers
    int64_t ws_off = 0;          // offset of this rank's rows in wshard_
  };

  DType ns_dtype() const;  // Newton–Schulz scratch: BF16 on the GPU, the master dtype on the CPU
  void gather_weights();
  void reduce_scatter_group(size_t group, bool accumulate);
  // ShardExchange. The norm: every shard's per-row Σg², gathered parameter by parameter into
  // (param, row) order, which no rank count changes, and summed there in core/fixed_sum.h's order.
  void grad_sum_squares_into(Tensor ss) override;
  Tensor muon_update(size_t i) override;
  void orthogonalise() override;
  char* owned_block(size_t unit);
  void muon_exchange_all_to_all();
  void muon_exchange_gather();
  void gather_rows_to_root(const Tensor& shard, const ShardedParam& p, const Local& l, void* full);
  std::vector<int64_t> counts_of(size_t param) const;
  Tensor shard_view(void* base, int64_t elem_off, const ShardedParam& p, int64_t rows) const;
  // dst[0, n) = src[0, n) (elements of type t) on the backend, either side on the host.
  void copy_elems(void* dst, Device dd, const void* src, Device sd, int64_t n, DType t);
  Status init_masters();

  MuonComm muon_comm_;
  Communicator& comm_;
  int P_ = 1, me_ = 0;
  // The Trainer's parts (attach): options, config, backend, model, optimizer.
  TrainOptions* opt_ = nullptr;
  const Config* cfg_ = nullptr;
  Backend* be_ = nullptr;
  Model* model_ = nullptr;
  Optimizer* optimizer_ = nullptr;
  Arena grads_;   // full-size local gradient of one micro-batch
  Arena shards_;  // masters, gradients, optimizer state: this rank's rows
  Arena muon_;    // update shard, orthogonalised shard, owned units, broadcast buffer, NS scratch
  Arena stage_;   // collective staging (see create), on the backend's device
  DType dtype_ = DType::kF32;   // masters, gradients, optimizer state (F32/F64)
  DType wdtype_ = DType::kF32;  // the model's weights (BF16 on CUDA, else dtype_)
  Device dev_ = Device::kCPU;
  CommType ctype_ = CommType::kF32;
  std::vector<ShardedParam> params_;
  std::vector<Local> local_;
  std::vector<std::vector<size_t>> groups_;  // per-layer parameter groups, in forward order
  std::vector<MuonUnit> units_;
  std::vector<std::vector<RowRange>> unit_ov_;  // [unit][rank] rows of the unit in that rank's shard
  std::vector<int64_t> owned_off_;              // [unit] offset in owned buffer, -1 if not mine
  Tensor ushard_, owned_, bcast_;  // ushard_: the Muon update u, overwritten in place by o = NS(u)
  Tensor wshard_;  // [Σ my shard elements] wdtype_: every shard's masters rounded for the weight all-gather
  std::vector<int64_t> gather_mark_;  // [group] the communicator's mark after the group's all-gather
  Tensor rowsq_;      // [my rows, all params] F64: per-row Σg² for the global norm
  Tensor rowsq_all_;  // [every row of every param] F64: everybody's, in (param, row) order
  std::vector<size_t> opt_param_;  // [optimizer's param] the index in params_ (this rank's non-empty shards)
  int64_t muon_sent_ = 0, muon_received_ = 0;  // the last orthogonalise()'s traffic
  Tensor full_;    // [max param] dtype_: one parameter gathered for a checkpoint
  Tensor a2a_send_, a2a_recv_;  // Muon all_to_all exchange buffers (dtype_)
  std::vector<int64_t> a2a_to_, a2a_from_;  // elements to / from each rank per exchange
  NsScratch ns_;
  uint64_t plan_hash_ = 0;
  ShardBytes shard_bytes_;  // the largest shards of any rank, for the memory plan
  // The step's loss on the device: this micro-batch's mean, every rank's means of the step
  // in micro-batch order, and their mean.
  Tensor micro_loss_, step_losses_, loss_sum_;
  // The step's traffic: the communicator's counters at its start, and its record.
  CommStats at_start_;
  DistStepTraffic tr_;
};

}  // namespace laplace
