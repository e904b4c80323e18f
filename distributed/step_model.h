// A model of one training step on P GPUs (G per node, N nodes), for the machines we cannot
// run here (docs/distributed.md §7). Its inputs are one GPU's forward + backward rate and
// optimizer time (flags; the defaults are laplace-3b's on one H200) and the exact per-rank
// bytes of distributed/plan.h; it states its assumptions:
//
//   fb      = A·B·T / fb_tok_s                      forward + backward of this rank's tokens
//   coll(S) = (P−1)/P · S / busbw                   a ring all-gather or reduce-scatter of S bytes
//   fsdp    = A · coll(4·W) + coll(2·W)             f32 gradient reduce-scatter per micro-batch,
//                                                   bf16 weight all-gather per step (W parameters)
//   exposed = max(0, fsdp − overlap·fb)             the part the compute stream cannot hide
//   opt     = opt_1gpu·(1 − ns_share)/P             element-wise optimizer work on the shards
//   ns      = opt_1gpu·ns_share·(max owner cost / total cost)   Newton–Schulz, the busiest owner
//   muon    = max_r max(sent_r, received_r) / busbw the Muon exchanges (distributed/plan.h's bytes)
//   step    = fb + exposed + opt + ns + muon (+ overhead, P > 1);   tokens/s = P·A·B·T / step
//
// busbw is NVLink's within one node and the slower of NVLink and InfiniBand (per GPU: one NIC
// each) across nodes, since a ring crosses the node boundary. With P = 1 the model is exactly
// the one-GPU measurement it is given (fb + opt_1gpu).
#pragma once

#include <cstdint>
#include <vector>

#include "distributed/plan.h"

namespace laplace {

// Defaults: laplace-3b on H200s (the sources of each are in docs/distributed.md §7).
struct StepMachine {
  int gpus_per_node = 8;
  int nodes = 1;
  double nvlink_gbs = 360;  // NCCL bus bandwidth inside a node, GB/s
  double ib_gbs = 45;       // across nodes, GB/s per GPU (one NIC per GPU)
  int ranks() const { return gpus_per_node * nodes; }
};

struct StepWorkload {
  int64_t batch = 8, seq = 2048, accum = 2;  // per rank and micro-batch
  double fb_tok_s = 25450;     // one GPU's forward + backward tokens/s at this micro-batch
  double opt_1gpu_s = 0.41;    // the whole optimizer step on one GPU, seconds
  double ns_share = 0.9;       // the part of it that is Newton–Schulz (the rest is element-wise)
  double overlap = 1.0;        // 1: gathers and reductions run beside the compute (the trainer's
                               // overlapped collectives); 0: after it
  double overhead_s = 0;       // per step on more than one GPU, for what the model leaves out
  MuonComm muon_comm = MuonComm::kAllToAll;
  int64_t update_bytes = 2;    // bytes per element of the Muon exchange (bf16)
  bool muon_fused = false;
};

struct StepPrediction {
  int ranks = 1;
  double busbw_gbs = 0;
  double fb_s = 0, fsdp_s = 0, exposed_s = 0, opt_s = 0, ns_s = 0, muon_s = 0, step_s = 0;
  double tokens_per_step = 0, tok_s = 0, tok_s_per_gpu = 0;
  int64_t fsdp_bytes = 0;      // bytes of the step's collectives (full tensor sizes)
  int64_t muon_bytes_max = 0;  // the busiest rank's max(sent, received)
};

StepPrediction predict_step(const Config& c, const StepMachine& m, const StepWorkload& w);

}  // namespace laplace
