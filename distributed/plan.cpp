#include "distributed/plan.h"

#include <algorithm>
#include <numeric>

#include "core/check.h"
#include "model/weights.h"

namespace laplace {

RowRange shard_rows(int64_t rows, int rank, int world) {
  LAPLACE_CHECK(world >= 1 && rank >= 0 && rank < world && rows >= 0, "shard_rows: bad arguments");
  const int64_t chunk = (rows + world - 1) / world;
  RowRange r;
  r.begin = std::min(rows, static_cast<int64_t>(rank) * chunk);
  r.end = std::min(rows, r.begin + chunk);
  return r;
}

RowRange overlap(RowRange a, RowRange b) {
  RowRange r{std::max(a.begin, b.begin), std::min(a.end, b.end)};
  if (r.end < r.begin) r.end = r.begin;
  return r;
}

std::vector<ShardedParam> sharded_params(const Config& c, bool muon_fused) {
  std::vector<ShardedParam> out;
  for (const TensorSpec& s : weight_specs(c, DType::kF32)) {
    ShardedParam p;
    p.name = s.name;
    p.shape = s.shape;
    p.rows = s.shape.empty() ? 1 : s.shape[0];
    p.cols = 1;
    for (size_t d = 1; d < s.shape.size(); ++d) p.cols *= s.shape[d];
    p.muon = is_body_matrix(p.name);
    if (p.muon) p.blocks = muon_fused ? std::vector<int64_t>{p.rows} : muon_blocks(c, p.name);
    p.decay = p.muon || is_decayed_by_adamw(p.name);
    out.push_back(std::move(p));
  }
  return out;
}

std::vector<MuonUnit> assign_muon_owners(const std::vector<ShardedParam>& params, int world) {
  std::vector<MuonUnit> units;
  for (size_t i = 0; i < params.size(); ++i) {
    if (!params[i].muon) continue;
    int64_t r0 = 0;
    for (size_t b = 0; b < params[i].blocks.size(); ++b) {
      MuonUnit u;
      u.param = static_cast<int>(i);
      u.block = static_cast<int>(b);
      u.row_begin = r0;
      u.rows = params[i].blocks[b];
      u.cols = params[i].cols;
      u.cost = static_cast<double>(u.rows) * static_cast<double>(u.cols) *
               static_cast<double>(std::min(u.rows, u.cols));
      units.push_back(u);
      r0 += u.rows;
    }
  }
  std::vector<size_t> order(units.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return units[a].cost > units[b].cost; });
  std::vector<double> load(world, 0.0);
  for (size_t k : order) {
    int best = 0;
    for (int r = 1; r < world; ++r)
      if (load[r] < load[best]) best = r;
    units[k].owner = best;
    load[best] += units[k].cost;
  }
  return units;
}

uint64_t muon_plan_hash(const std::vector<MuonUnit>& units, int world) {
  uint64_t h = 1469598103934665603ull;
  auto mix = [&](int64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= static_cast<uint64_t>(v >> (8 * i)) & 0xffu;
      h *= 1099511628211ull;
    }
  };
  mix(world);
  mix(static_cast<int64_t>(units.size()));
  for (const MuonUnit& u : units) {
    mix(u.param);
    mix(u.block);
    mix(u.row_begin);
    mix(u.rows);
    mix(u.cols);
    mix(u.owner);
  }
  return h;
}

std::vector<double> owner_costs(const std::vector<MuonUnit>& units, int world) {
  std::vector<double> c(world, 0.0);
  for (const MuonUnit& u : units) c[u.owner] += u.cost;
  return c;
}

Status muon_comm_from_name(const std::string& name, MuonComm* out) {
  if (name == "gather") *out = MuonComm::kGather;
  else if (name == "all_to_all") *out = MuonComm::kAllToAll;
  else return Status::invalid_argument("--muon-comm must be gather or all_to_all, got '" + name + "'");
  return Status::ok();
}

const char* muon_comm_name(MuonComm m) { return m == MuonComm::kGather ? "gather" : "all_to_all"; }

std::vector<RankTraffic> muon_traffic(const std::vector<ShardedParam>& params, const std::vector<MuonUnit>& units,
                                      int world, MuonComm comm, int64_t e) {
  std::vector<RankTraffic> t(world);
  for (int r = 0; r < world; ++r) {
    for (const MuonUnit& u : units) {
      const RowRange mine = shard_rows(params[u.param].rows, r, world);
      const int64_t ov = overlap(mine, {u.row_begin, u.row_begin + u.rows}).rows();
      const int64_t c = u.cols;
      if (comm == MuonComm::kAllToAll) {
        const int64_t x = (u.owner != r) ? ov * c : (u.rows - ov) * c;
        // exchange 1 sends x (non-owned rows) and receives the owned units' other rows;
        // exchange 2 is its mirror image, so sent = received = Σ x.
        t[r].sent += x * e;
      } else {
        if (u.owner != r) {
          t[r].sent += ov * c * e;
          t[r].received += u.rows * c * e;
        } else {
          t[r].sent += static_cast<int64_t>(world - 1) * u.rows * c * e;
          t[r].received += (u.rows - ov) * c * e;
        }
      }
    }
    if (comm == MuonComm::kAllToAll) t[r].received = t[r].sent;
  }
  return t;
}

}  // namespace laplace
