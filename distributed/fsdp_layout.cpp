#include "distributed/fsdp_layout.h"

#include <algorithm>

#include "model/weights.h"
#include "train/optimizer.h"

namespace laplace {

FsdpLayout fsdp_layout(const std::vector<ShardedParam>& params, const std::vector<MuonUnit>& units, int world,
                       int rank, DType dtype, DType wdtype, DType ns_dtype) {
  FsdpLayout l;
  l.rows.resize(params.size());
  l.update_off.assign(params.size(), -1);
  l.wshard_off.assign(params.size(), 0);
  int64_t update_total = 0, my_elems = 0, my_rows = 0, all_rows = 0, max_param = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    const ShardedParam& p = params[i];
    for (int q = 0; q < world; ++q) l.rows[i].push_back(shard_rows(p.rows, q, world));
    const int64_t n = l.rows[i][rank].rows() * p.cols;
    l.shards.push_back({"master." + p.name, dtype, {n}});
    l.shards.push_back({"grad." + p.name, dtype, {n}});
    if (p.muon) {
      l.shards.push_back({"optim." + p.name + ".momentum", dtype, {n}});
      l.update_off[i] = update_total;
      update_total += n;
    } else {
      l.shards.push_back({"optim." + p.name + ".adam_m", dtype, {n}});
      l.shards.push_back({"optim." + p.name + ".adam_v", dtype, {n}});
    }
    l.wshard_off[i] = my_elems;
    my_elems += n;
    my_rows += l.rows[i][rank].rows();
    all_rows += params[i].rows;
    max_param = std::max(max_param, p.rows * p.cols);
  }

  // Muon: each unit's rows in every rank's shard; the units this rank owns, back to back.
  l.unit_rows.resize(units.size());
  l.owned_off.assign(units.size(), -1);
  l.a2a_to.assign(world, 0);
  l.a2a_from.assign(world, 0);
  int64_t owned_total = 0, max_unit = 0;
  for (size_t k = 0; k < units.size(); ++k) {
    const MuonUnit& u = units[k];
    for (int q = 0; q < world; ++q)
      l.unit_rows[k].push_back(overlap(l.rows[u.param][q], {u.row_begin, u.row_begin + u.rows}));
    // A unit this rank owns and holds whole (every unit at P = 1) is orthogonalised where its
    // rows lie in the update buffer; the others it owns are assembled in the owned buffer.
    if (u.owner == rank && l.unit_rows[k][rank].rows() == u.rows) {
      l.owned_off[k] = kOwnedInUpdate;
    } else if (u.owner == rank) {
      l.owned_off[k] = owned_total;
      owned_total += u.rows * u.cols;
    }
    max_unit = std::max(max_unit, u.rows * u.cols);
    l.ns.plan(u.rows, u.cols);
    // all_to_all: to owner q go my rows of q's units; from rank q come q's rows of the units I
    // own. A rank's rows of its own units never pass through the exchange buffers.
    if (u.owner != rank) l.a2a_to[u.owner] += l.unit_rows[k][rank].rows() * u.cols;
    if (u.owner == rank)
      for (int q = 0; q < world; ++q)
        if (q != rank) l.a2a_from[q] += l.unit_rows[k][q].rows() * u.cols;
  }
  l.ns.dtype = ns_dtype;
  // The orthogonalised update o overwrites u in place: both exchanges read a unit's u rows
  // (into the send buffer or the owner's block) before they write its o rows.
  l.muon = {{"muon.u", dtype, {update_total}},
            {"muon.owned", dtype, {owned_total}},
            {"muon.bcast", dtype, {world > 1 ? max_unit : 0}}};  // another rank's unit, in gather mode
  l.ns.add_specs(&l.muon, "muon.ns.");

  int64_t to_total = 0, from_total = 0;
  for (int q = 0; q < world; ++q) to_total += l.a2a_to[q], from_total += l.a2a_from[q];
  // wshard: every shard rounded at once, so one group's all-gather can still be reading its
  // rows while the next ones are rounded (BF16 models over several ranks; one element otherwise:
  // on one rank the masters are rounded straight into the weights).
  l.staging = {{"dist.wshard", wdtype, {wdtype != dtype && world > 1 ? my_elems : 1}},
               {"dist.rowsq", DType::kF64, {my_rows}},    // per-row Σg² for the global norm
               {"dist.full", dtype, {max_param}},         // one parameter gathered for a checkpoint
               {"dist.a2a_send", dtype, {to_total}},      // Muon exchange 1 out / 2 in
               {"dist.a2a_recv", dtype, {from_total}},    // Muon exchange 1 in / 2 out
               // every rank's per-row Σg² in (param, row) order; one rank's own are that already
               {"dist.rowsq_all", DType::kF64, {world > 1 ? all_rows : 0}}};
  return l;
}

ShardBytes fsdp_shard_bytes(const Config& c, const FsdpLayout& l, DType dtype, DType wdtype) {
  ShardBytes b;
  for (const TensorSpec& s : l.shards) {
    const size_t n = Arena::planned_bytes({s});
    if (s.name.rfind("master.", 0) == 0) b.masters += n;
    else if (s.name.rfind("grad.", 0) == 0) b.gradients += n;
    else b.optimizer += n;
  }
  b.optimizer += Arena::planned_bytes(l.muon) + Optimizer::sharded_scratch_bytes();
  b.staging = Arena::planned_bytes(l.staging);
  b.init_table = wdtype != dtype ? Arena::planned_bytes(weight_specs(c, dtype)) : 0;
  return b;
}

ShardBytes fsdp_shard_bytes_max(const Config& c, const std::vector<ShardedParam>& params,
                                const std::vector<MuonUnit>& units, int world, DType dtype, DType wdtype,
                                DType ns_dtype) {
  ShardBytes m;
  for (int r = 0; r < world; ++r) {
    const FsdpLayout l = fsdp_layout(params, units, world, r, dtype, wdtype, ns_dtype);
    const ShardBytes b = fsdp_shard_bytes(c, l, dtype, wdtype);
    m.masters = std::max(m.masters, b.masters);
    m.gradients = std::max(m.gradients, b.gradients);
    m.optimizer = std::max(m.optimizer, b.optimizer);
    m.staging = std::max(m.staging, b.staging);
    m.init_table = std::max(m.init_table, b.init_table);
  }
  return m;
}

}  // namespace laplace
