#include "distributed/step_model.h"

#include <algorithm>

namespace laplace {

StepPrediction predict_step(const Config& c, const StepMachine& m, const StepWorkload& w) {
  StepPrediction p;
  const int P = std::max(1, m.ranks());
  p.ranks = P;
  const auto params = sharded_params(c, w.muon_fused);
  double W = 0;
  for (const auto& x : params) W += static_cast<double>(x.rows * x.cols);
  p.busbw_gbs = m.nodes > 1 ? std::min(m.nvlink_gbs, m.ib_gbs) : m.nvlink_gbs;
  const double bw = p.busbw_gbs * 1e9;
  const double ring = static_cast<double>(P - 1) / static_cast<double>(P);
  auto coll = [&](double bytes) { return ring * bytes / bw; };

  const double A = static_cast<double>(w.accum);
  p.tokens_per_step = static_cast<double>(P) * A * static_cast<double>(w.batch * w.seq);
  p.fb_s = A * static_cast<double>(w.batch * w.seq) / w.fb_tok_s;
  if (P > 1) {
    p.fsdp_bytes = static_cast<int64_t>(A * 4 * W + 2 * W);
    p.fsdp_s = A * coll(4 * W) + coll(2 * W);
    p.exposed_s = std::max(0.0, p.fsdp_s - w.overlap * p.fb_s);
  }
  p.opt_s = w.opt_1gpu_s * (1 - w.ns_share) / static_cast<double>(P);
  const auto units = assign_muon_owners(params, P);
  const auto cost = owner_costs(units, P);
  double total = 0, busiest = 0;
  for (double x : cost) {
    total += x;
    busiest = std::max(busiest, x);
  }
  p.ns_s = w.opt_1gpu_s * w.ns_share * (total > 0 ? busiest / total : 0);
  if (P > 1) {
    for (const auto& t : muon_traffic(params, units, P, w.muon_comm, w.update_bytes))
      p.muon_bytes_max = std::max({p.muon_bytes_max, t.sent, t.received});
    p.muon_s = static_cast<double>(p.muon_bytes_max) / bw;
  }
  p.step_s = p.fb_s + p.exposed_s + p.opt_s + p.ns_s + p.muon_s + (P > 1 ? w.overhead_s : 0.0);
  p.tok_s = p.tokens_per_step / p.step_s;
  p.tok_s_per_gpu = p.tok_s / static_cast<double>(P);
  return p;
}

}  // namespace laplace
