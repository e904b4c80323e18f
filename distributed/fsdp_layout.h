// One rank's FSDP buffers (distributed/sharded_parameters.h) as a pure function of the plan: which rows of
// every parameter each rank holds, where they sit in the rank's Muon and staging buffers, and
// the spec lists of the three arenas the sharded store allocates besides the model's (its
// shards, the Muon buffers, the collective staging). It allocates exactly these lists and
// the memory plan (train/memory_plan.h) counts them, so the plan is the allocation.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/arena.h"
#include "distributed/plan.h"
#include "train/memory_plan.h"
#include "train/muon.h"

namespace laplace {

inline constexpr int64_t kOwnedInUpdate = -2;

struct FsdpLayout {
  std::vector<std::vector<RowRange>> rows;       // [param][rank]: the rank's rows of the parameter
  std::vector<std::vector<RowRange>> unit_rows;  // [unit][rank]: the unit's rows in that rank's shard
  std::vector<int64_t> update_off;  // [param] this rank's rows in the Muon update buffer (−1: AdamW)
  std::vector<int64_t> wshard_off;  // [param] this rank's rows in the rounded-weights staging buffer
  // [unit] offset in the owned-units buffer; −1: another rank's; kOwnedInUpdate: this rank's and
  // wholly in its shard, orthogonalised where it lies in the update buffer (no copy, no room).
  std::vector<int64_t> owned_off;
  // [rank] Muon all_to_all elements to / from each rank; 0 for this rank (its own rows of its
  // own units are copied, not exchanged)
  std::vector<int64_t> a2a_to, a2a_from;
  NsScratch ns;                     // planned for every unit (unbound)
  // "master.<p>", "grad.<p>", then "optim.<p>.momentum" (Muon) or ".adam_m", ".adam_v" (AdamW)
  std::vector<TensorSpec> shards;
  // "muon.u", "muon.owned", "muon.bcast", then the Newton–Schulz scratch "muon.ns.*"
  std::vector<TensorSpec> muon;
  // "dist.wshard", "dist.rowsq", "dist.full", "dist.a2a_send", "dist.a2a_recv", "dist.rowsq_all"
  std::vector<TensorSpec> staging;
};

// Rank `rank` of `world`. dtype: masters, gradients and optimizer state (F32/F64); wdtype: the
// model's weights (BF16 on CUDA, else dtype); ns_dtype: the Newton–Schulz scratch.
FsdpLayout fsdp_layout(const std::vector<ShardedParam>& params, const std::vector<MuonUnit>& units, int world,
                       int rank, DType dtype, DType wdtype, DType ns_dtype);

// What the memory plan counts for a rank besides the full weights and the full local
// gradient: its shards of masters, gradients and optimizer state (Muon buffers and the
// optimizer's device scalars included),
// the staging, and the full table of initial weights in `dtype` that setup holds for a
// moment when the model computes in another dtype (BF16).
ShardBytes fsdp_shard_bytes(const Config& c, const FsdpLayout& l, DType dtype, DType wdtype);

// The largest of every class over all `world` ranks (each rank plans with the same numbers,
// so they all choose the same micro-batch).
ShardBytes fsdp_shard_bytes_max(const Config& c, const std::vector<ShardedParam>& params,
                                const std::vector<MuonUnit>& units, int world, DType dtype, DType wdtype,
                                DType ns_dtype);

}  // namespace laplace
