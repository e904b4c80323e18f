// Global-shape planning for FSDP-style training (docs/distributed.md): row shards,
// Muon owners and the Muon traffic formula. Everything here is a pure function of the
// config, the flags and the rank count, so every rank computes the same plan without
// communicating (the trainer still hashes the owner assignment and checks it on all
// ranks), and `laplace dist plan` can predict a run it never starts.
//
// Row shards: a parameter of R rows (dim 0; 1-D params: R elements) is split into
// chunks of ⌈R/P⌉ rows; rank r holds rows [min(R, r·⌈R/P⌉), min(R, (r+1)·⌈R/P⌉)), so the
// last ranks are short or empty and nothing is padded.
//
// Muon units: each Muon matrix's row blocks (q, k, v, g of W_qkvg; a, b of W_12; whole
// W_o, W_3; or whole matrices with --muon-fused) are orthogonalised separately. A unit
// [rows, cols] costs rows·cols·min(rows, cols) (the Newton–Schulz Gram products). Owners:
// units sorted by cost (descending, ties by unit index), each given to the rank with the
// least assigned cost so far (ties: lowest rank).
//
// Traffic per step (payload to/from OTHER ranks, e = bytes per element of the update
// as communicated; ov_r(u) = rows of unit u in rank r's shard; c = cols):
//   all_to_all  exchange 1 sends each unit's shard rows to its owner, exchange 2 returns
//               the orthogonalised rows, so for every rank sent = received =
//               e·[Σ_{u: owner≠r} ov_r(u)·c + Σ_{u: owner=r} (rows_u − ov_r(u))·c]
//   gather      per unit: the owner collects the unit's rows, orthogonalises, and
//               broadcasts the whole unit to every rank:
//               sent_r = e·[Σ_{u: owner≠r} ov_r(u)·c + Σ_{u: owner=r} (P−1)·rows_u·c]
//               recv_r = e·[Σ_{u: owner=r} (rows_u − ov_r(u))·c + Σ_{u: owner≠r} rows_u·c]
// With M = e·Σ_u rows_u·c (every Muon matrix once), gather moves ≈ 2M per rank
// (sent + received) while all_to_all moves ≈ 4M/P.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/status.h"
#include "model/config.h"

namespace laplace {

struct RowRange {
  int64_t begin = 0, end = 0;
  int64_t rows() const { return end - begin; }
  bool operator==(const RowRange&) const = default;
};

RowRange shard_rows(int64_t rows, int rank, int world);
RowRange overlap(RowRange a, RowRange b);

// A parameter as the sharding sees it (canonical order of weight_specs).
struct ShardedParam {
  std::string name;
  std::vector<int64_t> shape;
  int64_t rows = 0, cols = 1;  // dim 0, product of the other dims
  bool muon = false;
  std::vector<int64_t> blocks;  // Muon only: row blocks (sum = rows)
  bool decay = false;           // AdamW decay (embedding/head); Muon is always decayed
};
std::vector<ShardedParam> sharded_params(const Config& c, bool muon_fused);

struct MuonUnit {
  int param = 0;   // index into the ShardedParam list
  int block = 0;   // block index within the param
  int64_t row_begin = 0, rows = 0, cols = 0;  // global rows of the block
  double cost = 0;  // rows·cols·min(rows, cols)
  int owner = 0;
};
// Units in (param, block) order with owners assigned as described above.
std::vector<MuonUnit> assign_muon_owners(const std::vector<ShardedParam>& params, int world);
// FNV-1a over the world size and every unit's (param, block, rows, cols, owner).
uint64_t muon_plan_hash(const std::vector<MuonUnit>& units, int world);
// Σ cost of the units each rank owns.
std::vector<double> owner_costs(const std::vector<MuonUnit>& units, int world);

enum class MuonComm { kGather, kAllToAll };
Status muon_comm_from_name(const std::string& name, MuonComm* out);  // "gather" | "all_to_all"
const char* muon_comm_name(MuonComm m);

struct RankTraffic {
  int64_t sent = 0, received = 0;
};
// Predicted Muon bytes per rank per optimizer step (formula above).
std::vector<RankTraffic> muon_traffic(const std::vector<ShardedParam>& params, const std::vector<MuonUnit>& units,
                                      int world, MuonComm comm, int64_t elem_bytes);

}  // namespace laplace
