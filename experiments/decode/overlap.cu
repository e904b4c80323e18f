// experiments/decode/overlap: can the decode step hide its projection gemms under the GLA state
// stream by splitting the GPU's SMs between them?
//
// The batch is cut into halves A and B (--half sequences each). Half A's state step runs as v3's
// persistent kernel (kernels.cuh, "pers bulk-st split1") with grid N on stream s1 while half B's
// four bf16 gemms of one layer run on stream s2 through cuBLASLt with
// CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET = SMs - N. Earlier tries (BENCHMARKS.md, docs/serving.md)
// left the partition to the block scheduler and got ~nothing; v3 fixes the state side to N SMs,
// this experiment measures whether cuBLASLt then keeps to the rest.
//
//   nvcc -O3 -std=c++17 -I. -gencode=arch=compute_90a,code=sm_90a -o experiment_decode_overlap experiments/decode/overlap.cu -lcublasLt
//   ./experiment_decode_overlap [--N 0,40,52,66,80] [--reps 20] [--steps 8] [--dtypes f32,bf16] [--prio 0,1]
//                 [--splitk 0] [--half 640] [--co 0|1|2|4] [--cands 16] [--gemm cublas|ours]
//
// --co S (co-residency; the SM split above never paid): instead of giving the two kernels
// different SMs, let them share every SM. The state kernel becomes v3 with a 2-stage ring of
// units of dk/S rows and registers capped for 3 blocks per SM (so ~112 per thread), grid = one
// block per SM; each gemm takes, among cuBLASLt's first --cands candidates (heuristic order),
// the first whose every kernel leaves beside one CTA the registers and shared memory of one
// state block (read from the captured graph's kernel nodes, driver_api.h). Each candidate's
// footprint is printed, so even a run that finds none answers the question: does cuBLASLt have
// a kernel at these shapes that lets a state-stream block share its SM? --N is then 0 only.
//
// --gemm ours (with --co): the four gemms run as experiments/gemm's own TMA + wgmma kernel
// (wgmma_gemm.cuh, experiment_gemm_wgmma's v5: BN 128, 4 stages, 120-register cap, ~129 KB of shared memory
// and 384 × 90 registers per CTA), which leaves an SM room for a state block by construction;
// the unsplit baseline keeps cuBLASLt (production's gemms).
//
// Per state dtype, N and (for the concurrent variants) prio, one line each (median of `reps`
// timed calls after 3 warm-ups, CUDA events on s0):
//   a  state kernel alone (grid N; N = 0: grid = all SMs)
//   b  the 4 gemms alone (SM target SMs - N; N = 0: target 0 = all)
//   c  a then b on one stream (eager)
//   d  a on s1 || b on s2, forked from and joined to s0 by events (eager)
//   e  d captured into a CUDA graph (how production runs decode)
//   f  `steps` × d in one graph, roles alternating (state A || gemms B, then state B || gemms A),
//      each step joined before the next; ms per step
//   g  the same work as f, but as two independent chains (half A's chain on s1, B's on s2, each
//      alternating state and gemms, joined only at the end): the halves share no data, so this
//      is all the ordering a real decode step needs; ms per step
// with "eff" = (a + b - t) / min(a, b): 0 = serialised, 1 = the shorter fully hidden.
// prio 1 launches the state kernel with the greatest launch priority (a per-kernel attribute,
// kept by graph capture; graphs are instantiated with cudaGraphInstantiateFlagUseNodePriority,
// without which a graph ignores node priorities), so that whenever SMs free up the state
// kernel's blocks, which need a whole SM's shared memory, go first.
//
// Validation: d, e, f, g each run once from pristine states; the whole state array and o must
// equal, bit for bit, the same steps run alone (v3 split1's bits do not depend on the grid or on
// what runs beside it), so a concurrency bug (a lost or doubled item, a stray write) shows as
// "S diff" / "o diff" words (16-byte) ≠ 0. The gemms are timed only.
//
// Summary per dtype: one layer of the full batch unsplit (state of all 2·half sequences on all
// SMs, then the 4 gemms at M = 2·half on all SMs, in one graph) against 2 steps of f or g.
#include <cublasLt.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "experiments/cublas_host.h"
#include "experiments/driver_api.h"
#include "experiments/host.h"
#include "experiments/gemm/wgmma_gemm.cuh"
#include "experiments/decode/kernels.cuh"

namespace {

namespace v3 = decode_exp::v3;
using decode_exp::DecArgs;

constexpr int H = 16, DK = v3::kDk, DV = v3::kDv;
constexpr size_t kWsBytes = size_t{32} << 20;

// laplace-3b's per-layer projections, C[M, n] = X[M, k] · W[n, k]ᵀ.
struct Proj {
  const char* name;
  int n, k;
};
constexpr Proj kProj[4] = {{"qkvg", 9216, 3072}, {"wo", 3072, 3072}, {"w12", 16384, 3072}, {"w3", 3072, 8192}};

struct Opts {
  int half = 640, reps = 20, steps = 8, co = 0, cands = 16;
  bool ours = false;  // --gemm ours
  bool splitk = false;
  std::vector<int> Ns = {0, 40, 52, 66, 80}, prios = {0, 1};
  std::vector<std::string> dtypes = {"f32", "bf16"};
};

using experiments::median;
using experiments::split_list;

using decode_exp::Rng;  // experiment_decode's inputs generator

__global__ void fill_bf16(__nv_bfloat16* p, uint64_t n, uint64_t seed, float scale) {
  for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n; i += (uint64_t)gridDim.x * blockDim.x)
    p[i] = __float2bfloat16_rn(scale * decode_exp::state_init(i + seed));
}

// ---- cuBLASLt ----------------------------------------------------------------------------------
// The four projections as cublas_host.h's TN gemms. The SM target is a desc attribute, so each
// (M, target) gets its own descs and heuristic picks.
struct Plan {
  int M = 0, target = 0;
  experiments::TnGemm g[4];                          // cands: the first `ncands`, heuristic order
  cublasLtMatmulHeuristicResult_t res[4]{};  // the ones used
};

Plan make_plan(cublasLtHandle_t lt, int M, int target, bool splitk, int ncands = 1) {
  Plan p;
  p.M = M, p.target = target;
  for (int i = 0; i < 4; ++i) {
    const Proj& q = kProj[i];
    p.g[i] = experiments::tn_gemm_create(lt, M, q.n, q.k, CUDA_R_16BF, kWsBytes, ncands, target, splitk);
    if (p.g[i].cands.empty() || p.g[i].cands[0].state != CUBLAS_STATUS_SUCCESS) {
      std::fprintf(stderr, "experiment_decode_overlap: no cuBLASLt algorithm for %s M=%d target %d\n", q.name, M, target);
      std::exit(1);
    }
    p.res[i] = p.g[i].cands[0];
  }
  return p;
}

void destroy_plan(Plan& p) {
  for (experiments::TnGemm& g : p.g) experiments::tn_gemm_destroy(g);
}

// One set of weights (shared by every call: 226 MB, far beyond L2, so reuse flatters nothing);
// activations for 2·half rows, half h using rows [h·half, (h+1)·half); a workspace per half, since
// in variant g the two halves' gemms may run at the same time.
struct GemmBufs {
  __nv_bfloat16 *w[4], *x[4], *y[4];
  void* ws[2];
};

void enqueue_gemms(cublasLtHandle_t lt, const Plan& p, const GemmBufs& g, int row0, int wsi, cudaStream_t st) {
  const float one = 1.f, zero = 0.f;
  for (int i = 0; i < 4; ++i) {
    const size_t xo = static_cast<size_t>(row0) * kProj[i].k, yo = static_cast<size_t>(row0) * kProj[i].n;
    CKB(cublasLtMatmul(lt, p.g[i].desc, &one, g.w[i], p.g[i].lw, g.x[i] + xo, p.g[i].lx, &zero, g.y[i] + yo,
                       p.g[i].ly, g.y[i] + yo, p.g[i].ly, &p.res[i].algo, g.ws[wsi], kWsBytes, st));
  }
}

// ---- our own gemm (--gemm ours) ------------------------------------------------------------------
// experiment_gemm_wgmma's v5: BN 128, 4 stages, one k-block in flight, 120 registers per thread at most.
constexpr auto kOurGemm = gemm_exp::gemm_tma_wgmma<128, 4, true, 120>;
constexpr int kOurBn = 128, kOurSmem = gemm_exp::Smem<128, 4>::kBytes;

// Tensor maps of both halves' X rows and of the weights, per projection.
struct OurGemms {
  CUtensorMap mx[4][2], mw[4];
};
OurGemms make_our_gemms(const GemmBufs& g, int half) {
  static const auto enc = gemm_exp::get_encoder();
  CK(cudaFuncSetAttribute(kOurGemm, cudaFuncAttributeMaxDynamicSharedMemorySize, kOurSmem));
  OurGemms o;
  for (int i = 0; i < 4; ++i) {
    for (int h = 0; h < 2; ++h)
      o.mx[i][h] = gemm_exp::make_map(enc, g.x[i] + static_cast<size_t>(h) * half * kProj[i].k, half, kProj[i].k,
                                      gemm_exp::BM);
    o.mw[i] = gemm_exp::make_map(enc, g.w[i], kProj[i].n, kProj[i].k, kOurBn);
  }
  return o;
}
void enqueue_our_gemms(const OurGemms& o, const GemmBufs& g, int half, int h, cudaStream_t st) {
  for (int i = 0; i < 4; ++i) {
    const int tiles = (half / gemm_exp::BM) * (kProj[i].n / kOurBn);
    kOurGemm<<<tiles, gemm_exp::kThreads, kOurSmem, st>>>(o.mx[i][h], o.mw[i],
                                                           g.y[i] + static_cast<size_t>(h) * half * kProj[i].n, half,
                                                           kProj[i].n, kProj[i].k);
    CK(cudaGetLastError());
  }
}

// ---- what the gemms actually launch ------------------------------------------------------------
// The SM target only steers cuBLASLt's choice; whether the kernel it picks really stays on
// target - N SMs is seen in its grid (a persistent kernel's grid is its SM count; a tiled one with
// more CTAs than SMs floods every SM), read from the captured graph (driver_api.h).
using experiments::DriverFns;
using experiments::load_driver_fns;

void print_launches(const DriverFns& d, cudaStream_t s0, const std::function<void(cudaStream_t)>& enqueue) {
  cudaGraph_t g;
  CK(cudaStreamBeginCapture(s0, cudaStreamCaptureModeThreadLocal));
  enqueue(s0);
  CK(cudaStreamEndCapture(s0, &g));
  experiments::print_graph_nodes(d, g);
  CK(cudaGraphDestroy(g));
}

void print_plan(const Plan& p) {
  for (int i = 0; i < 4; ++i)
    std::printf("    %-4s M %d target %3d: %s\n", kProj[i].name, p.M, p.target, experiments::algo_config_str(p.res[i]).c_str());
}

// --co: per gemm, the first candidate whose every kernel leaves `room_regs` registers and
// `room_smem` bytes of shared memory of an SM beside one of its CTAs; its footprint and that of
// every candidate before it printed. False if a gemm has none.
bool choose_coresident(cublasLtHandle_t lt, Plan& p, const GemmBufs& g, const DriverFns& drv, cudaStream_t st,
                       int room_regs, int room_smem) {
  bool all = true;
  for (int i = 0; i < 4; ++i) {
    const float one = 1.f, zero = 0.f;
    const size_t yo = static_cast<size_t>(p.M) * kProj[i].n, xo = static_cast<size_t>(p.M) * kProj[i].k;
    int chosen = -1;
    for (size_t j = 0; j < p.g[i].cands.size() && chosen < 0; ++j) {
      const cublasLtMatmulHeuristicResult_t& r = p.g[i].cands[j];
      if (r.state != CUBLAS_STATUS_SUCCESS) continue;
      cudaGraph_t gr;
      CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
      const cublasStatus_t cs = cublasLtMatmul(lt, p.g[i].desc, &one, g.w[i], p.g[i].lw, g.x[i] + xo, p.g[i].lx,
                                               &zero, g.y[i] + yo, p.g[i].ly, g.y[i] + yo, p.g[i].ly, &r.algo, g.ws[1], kWsBytes, st);
      CK(cudaStreamEndCapture(st, &gr));
      int regs = 0, smem = 0, kernels = 0;
      bool known = cs == CUBLAS_STATUS_SUCCESS;
      size_t n = 0;
      CK(cudaGraphGetNodes(gr, nullptr, &n));
      std::vector<cudaGraphNode_t> nodes(n);
      CK(cudaGraphGetNodes(gr, nodes.data(), &n));
      for (cudaGraphNode_t node : nodes) {
        cudaGraphNodeType t;
        CK(cudaGraphNodeGetType(node, &t));
        if (t != cudaGraphNodeTypeKernel) continue;
        CUDA_KERNEL_NODE_PARAMS_v2 kp{};
        const char* name = nullptr;
        if (!experiments::kernel_node_info(drv, node, &kp, &name)) {
          known = false;
          continue;
        }
        const experiments::CtaFootprint f = experiments::kernel_node_footprint(drv, kp);
        if (f.regs < 0 || f.smem < 0) known = false;
        regs = std::max(regs, f.regs), smem = std::max(smem, f.smem);
        ++kernels;
      }
      CK(cudaGraphDestroy(gr));
      const bool fits = known && kernels > 0 && regs <= room_regs && smem <= room_smem;
      std::printf("    %-4s [%zu] %s\n           largest CTA: %d registers, %d B shared%s -> %s\n", kProj[i].name, j,
                  experiments::algo_config_str(r).c_str(), regs, smem, known ? "" : " (unknown)",
                  fits ? "fits beside a state block" : "no room");
      if (fits) chosen = static_cast<int>(j);
    }
    if (chosen < 0) {
      std::printf("    %-4s: none of %zu candidates leaves %d registers and %d B beside its CTA\n", kProj[i].name,
                  p.g[i].cands.size(), room_regs, room_smem);
      all = false;
    } else {
      p.res[i] = p.g[i].cands[static_cast<size_t>(chosen)];
    }
  }
  return all;
}

// ---- the state kernel ----------------------------------------------------------------------------
struct StateKernel {
  void (*k)(DecArgs) = nullptr;
  int smem = 0, prio_value = 0;  // prio_value: the device's greatest stream priority
  void launch(const DecArgs& a, int grid, bool prio, cudaStream_t st) const {
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(static_cast<unsigned>(grid));
    cfg.blockDim = dim3(v3::kThreads);
    cfg.dynamicSmemBytes = static_cast<size_t>(smem);
    cfg.stream = st;
    cudaLaunchAttribute at[1];
    at[0].id = cudaLaunchAttributePriority;
    at[0].val.priority = prio_value;
    cfg.attrs = at;
    cfg.numAttrs = prio ? 1 : 0;
    CK(cudaLaunchKernelEx(&cfg, k, a));
  }
};

// v3 as run beside the gemms: the full-budget ring (co = 0) or, for --co S, units of dk/S rows
// in a 2-stage ring with registers capped for 3 blocks per SM.
template <class ST>
StateKernel state_kernel(int co) {
  StateKernel sk;
  switch (co) {
    case 0: sk.k = v3::decode_v3<ST, true, 1>, sk.smem = v3::Cfg<ST, 1>::kBytes; break;
    case 1: sk.k = v3::decode_v3<ST, true, 1, 2, 3>, sk.smem = v3::Cfg<ST, 1, 2>::kBytes; break;
    case 2: sk.k = v3::decode_v3<ST, true, 2, 2, 3>, sk.smem = v3::Cfg<ST, 2, 2>::kBytes; break;
    default: sk.k = v3::decode_v3<ST, true, 4, 2, 3>, sk.smem = v3::Cfg<ST, 4, 2>::kBytes; break;
  }
  int least = 0, greatest = 0;
  CK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  sk.prio_value = greatest;
  CK(cudaFuncSetAttribute(sk.k, cudaFuncAttributeMaxDynamicSharedMemorySize, sk.smem));
  CK(cudaFuncSetAttribute(sk.k, cudaFuncAttributePreferredSharedMemoryCarveout, 100));
  return sk;
}

struct Ctx {
  cudaStream_t s0, s1, s2;
  cudaEvent_t e0, e1, fork, j1, j2;
  cublasLtHandle_t lt;
  int sms, reps;
};

// s0 forks to s1 and s2 and joins both; the state side is enqueued first, so that in eager runs
// its blocks are dispatched before the gemms' (a graph's branches have no such order).
void fork_join(const Ctx& c, const std::function<void(cudaStream_t)>& on_s1,
               const std::function<void(cudaStream_t)>& on_s2) {
  CK(cudaEventRecord(c.fork, c.s0));
  CK(cudaStreamWaitEvent(c.s1, c.fork, 0));
  CK(cudaStreamWaitEvent(c.s2, c.fork, 0));
  on_s1(c.s1);
  on_s2(c.s2);
  CK(cudaEventRecord(c.j1, c.s1));
  CK(cudaEventRecord(c.j2, c.s2));
  CK(cudaStreamWaitEvent(c.s0, c.j1, 0));
  CK(cudaStreamWaitEvent(c.s0, c.j2, 0));
}

cudaGraphExec_t capture(const Ctx& c, const std::function<void()>& enqueue_on_s0) {
  cudaGraph_t g;
  CK(cudaStreamBeginCapture(c.s0, cudaStreamCaptureModeThreadLocal));
  enqueue_on_s0();
  CK(cudaStreamEndCapture(c.s0, &g));
  cudaGraphExec_t x;
  CK(cudaGraphInstantiateWithFlags(&x, g, cudaGraphInstantiateFlagUseNodePriority));
  CK(cudaGraphDestroy(g));
  return x;
}

double time_ms(const Ctx& c, const std::function<void()>& enqueue_on_s0) {
  std::vector<double> t;
  for (int i = 0; i < c.reps + 3; ++i) {
    CK(cudaEventRecord(c.e0, c.s0));
    enqueue_on_s0();
    CK(cudaEventRecord(c.e1, c.s0));
    CK(cudaEventSynchronize(c.e1));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, c.e0, c.e1));
    if (i >= 3) t.push_back(ms);
  }
  CK(cudaGetLastError());
  return median(t);
}

template <class ST>
int run_dtype(const Opts& opt, Ctx& c, const GemmBufs& gb, const DriverFns& drv, const char* dtname, bool show_gemms) {
  const int half = opt.half, B = 2 * half;
  const int64_t npairs = static_cast<int64_t>(B) * H, state_elems = npairs * DK * DV;
  const size_t state_bytes = static_cast<size_t>(state_elems) * sizeof(ST), o_bytes = npairs * DV * 4;

  // sk runs beside the gemms; sk_full is the unsplit layer's (the full ring).
  const StateKernel sk = state_kernel<ST>(opt.co), sk_full = state_kernel<ST>(0);
  // What one state block holds of an SM, hence what a gemm CTA may use beside it (--co).
  int room_regs = 0, room_smem = 0;
  {
    cudaFuncAttributes fa{};
    CK(cudaFuncGetAttributes(&fa, sk.k));
    const int regs = (fa.numRegs + 7) / 8 * 8 * v3::kThreads, smem = static_cast<int>(fa.sharedSizeBytes) + sk.smem + 1024;
    room_regs = 65536 - regs, room_smem = 233472 - smem;
    std::printf("\n%s state kernel (co %d): %d regs/thread × %d threads = %d registers, %d B shared per block "
                "(ring of %d B); beside one block an SM has %d registers and %d B left\n",
                dtname, opt.co, fa.numRegs, v3::kThreads, regs, smem, sk.smem, room_regs, room_smem);
  }

  // experiment_decode's inputs and layout: slots b -> 7919·b mod B (halves get disjoint slot sets),
  // q, k, v BF16 in [-1, 1), lam in [0.95, 0.99], o F32.
  int mult = 7919;
  while (std::gcd(mult, B) != 1) ++mult;
  std::vector<int32_t> hslots(B);
  for (int b = 0; b < B; ++b) hslots[b] = static_cast<int32_t>((static_cast<int64_t>(b) * mult) % B);
  std::vector<uint16_t> hq(npairs * DK), hk(npairs * DK), hv(npairs * DV);
  Rng r{12345};
  for (auto& x : hq) x = experiments::f2bf(static_cast<float>(2 * r.uniform() - 1));
  for (auto& x : hk) x = experiments::f2bf(static_cast<float>(2 * r.uniform() - 1));
  for (auto& x : hv) x = experiments::f2bf(static_cast<float>(2 * r.uniform() - 1));

  ST *states, *pristine, *ref1, *refS;
  __nv_bfloat16 *q, *k, *v;
  float *o, *oref1, *orefS;
  int32_t* slots;
  unsigned long long* ndiff;
  CK(cudaMalloc(&states, state_bytes));
  CK(cudaMalloc(&pristine, state_bytes));
  CK(cudaMalloc(&ref1, state_bytes));
  CK(cudaMalloc(&refS, state_bytes));
  CK(cudaMalloc(&q, hq.size() * 2));
  CK(cudaMalloc(&k, hk.size() * 2));
  CK(cudaMalloc(&v, hv.size() * 2));
  CK(cudaMalloc(&o, o_bytes));
  CK(cudaMalloc(&oref1, o_bytes));
  CK(cudaMalloc(&orefS, o_bytes));
  CK(cudaMalloc(&slots, B * 4));
  CK(cudaMalloc(&ndiff, 2 * sizeof(unsigned long long)));
  CK(cudaMemcpy(q, hq.data(), hq.size() * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(k, hk.data(), hk.size() * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(v, hv.data(), hv.size() * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(slots, hslots.data(), B * 4, cudaMemcpyHostToDevice));
  decode_exp::init_states<ST><<<4096, 256, 0, c.s0>>>(pristine, static_cast<uint64_t>(state_elems));
  CK(cudaGetLastError());

  DecArgs full = decode_exp::exp_args(B, H, DK, DV);
  full.q = q, full.k = k, full.v = v, full.o = o;
  full.s_in = states, full.s_out = states;
  full.slots = slots;
  DecArgs hargs[2];
  for (int h = 0; h < 2; ++h) {
    DecArgs& a = hargs[h];
    a = full;
    const int64_t b0 = static_cast<int64_t>(h) * half;
    a.B = half;
    a.q = q + b0 * full.q_sb, a.k = k + b0 * full.k_sb, a.v = v + b0 * full.v_sb;
    a.o = o + b0 * full.o_sb;
    a.slots = slots + b0;
  }

  auto restore = [&] {
    CK(cudaMemcpyAsync(states, pristine, state_bytes, cudaMemcpyDeviceToDevice, c.s0));
    CK(cudaMemsetAsync(o, 0xff, o_bytes, c.s0));  // NaN: an unwritten o differs
  };
  auto save = [&](ST* sref, float* oref) {
    CK(cudaMemcpyAsync(sref, states, state_bytes, cudaMemcpyDeviceToDevice, c.s0));
    CK(cudaMemcpyAsync(oref, o, o_bytes, cudaMemcpyDeviceToDevice, c.s0));
    CK(cudaStreamSynchronize(c.s0));
  };
  // References, run alone on all SMs: A stepped once (d, e), and A stepped ceil(steps/2) times,
  // B floor(steps/2) times (f, g).
  const int stepsA = (opt.steps + 1) / 2, stepsB = opt.steps / 2;
  restore();
  sk.launch(hargs[0], c.sms, false, c.s0);
  save(ref1, oref1);
  restore();
  for (int i = 0; i < stepsA; ++i) sk.launch(hargs[0], c.sms, false, c.s0);
  for (int i = 0; i < stepsB; ++i) sk.launch(hargs[1], c.sms, false, c.s0);
  save(refS, orefS);
  // One run of `enqueue` from pristine states against a reference: {S words, o words} that differ.
  auto validate = [&](const std::function<void()>& enqueue, const ST* sref, const float* oref) {
    restore();
    enqueue();
    CK(cudaMemsetAsync(ndiff, 0, 2 * sizeof(unsigned long long), c.s0));
    decode_exp::count_diff<<<1024, 256, 0, c.s0>>>(reinterpret_cast<const uint4*>(states),
                                                  reinterpret_cast<const uint4*>(sref), state_bytes / 16, ndiff);
    CK(cudaGetLastError());
    decode_exp::count_diff<<<256, 256, 0, c.s0>>>(reinterpret_cast<const uint4*>(o),
                                                 reinterpret_cast<const uint4*>(oref), o_bytes / 16, ndiff + 1);
    CK(cudaGetLastError());
    unsigned long long h[2];
    CK(cudaMemcpyAsync(h, ndiff, sizeof h, cudaMemcpyDeviceToHost, c.s0));
    CK(cudaStreamSynchronize(c.s0));
    return std::pair<unsigned long long, unsigned long long>(h[0], h[1]);
  };

  const double sbytes_half = 2.0 * half * H * DK * DV * sizeof(ST);
  double gflop_half = 0;
  for (const Proj& p : kProj) gflop_half += 2.0 * half * p.n * p.k / 1e9;
  std::printf("\n=== %s states: 2 halves × %d sequences × %d heads (%.3f GB of states per half, read + written "
              "per step); gemms per half: %.1f GFLOP\n",
              dtname, half, H, sbytes_half / 2e9, gflop_half);

  int fails = 0;
  std::vector<std::pair<int, std::pair<double, double>>> per_layer;  // N -> best {f, g} ms per step
  for (int N : opt.Ns) {
    const int grid = N > 0 ? N : c.sms, target = N > 0 ? c.sms - N : 0;
    Plan p = make_plan(c.lt, half, target, opt.splitk, opt.co ? opt.cands : 1);
    std::printf("\n-- N %d: state grid %d, gemm SM target %d (%s)\n", N, grid, target,
                opt.co ? "co-resident: both on every SM" : N > 0 ? "split" : "no split: both on all SMs");
    if (opt.ours) {
      cudaFuncAttributes fa{};
      CK(cudaFuncGetAttributes(&fa, kOurGemm));
      const int regs = (fa.numRegs + 7) / 8 * 8 * gemm_exp::kThreads,
                smem = static_cast<int>(fa.sharedSizeBytes) + kOurSmem + 1024;
      std::printf("    our gemm (experiment_gemm_wgmma v5): %d regs/thread × %d = %d registers, %d B shared per CTA -> %s\n",
                  fa.numRegs, gemm_exp::kThreads, regs, smem,
                  regs <= room_regs && smem <= room_smem ? "fits beside a state block" : "NO ROOM beside a state block");
    } else if (opt.co && !choose_coresident(c.lt, p, gb, drv, c.s0, room_regs, room_smem)) {
      std::printf("  %-5s co %d: no co-resident gemm set at M = %d; skipped\n", dtname, opt.co, half);
      destroy_plan(p);
      continue;
    }
    // Run the gemms once eagerly before any capture: cuBLASLt's (lazily loaded) kernels and their
    // attributes are then set up outside a capture.
    enqueue_gemms(c.lt, p, gb, half, 1, c.s0);
    CK(cudaStreamSynchronize(c.s0));
    if (show_gemms && !opt.ours) {  // the picks depend on M and the target only, not on the state dtype
      print_plan(p);
      for (int i = 0; i < 4; ++i) {
        std::printf("    %-4s launches:\n", kProj[i].name);
        print_launches(drv, c.s0, [&](cudaStream_t st) {
          const float one = 1.f, zero = 0.f;
          const size_t yo = static_cast<size_t>(half) * kProj[i].n, xo = static_cast<size_t>(half) * kProj[i].k;
          CKB(cublasLtMatmul(c.lt, p.g[i].desc, &one, gb.w[i], p.g[i].lw, gb.x[i] + xo, p.g[i].lx, &zero,
                             gb.y[i] + yo, p.g[i].ly, gb.y[i] + yo, p.g[i].ly, &p.res[i].algo, gb.ws[1], kWsBytes, st));
        });
      }
    }
    auto state = [&](int h, bool prio, cudaStream_t st) { sk.launch(hargs[h], grid, prio, st); };
    const OurGemms ours = opt.ours ? make_our_gemms(gb, half) : OurGemms{};
    auto gemms = [&](int h, cudaStream_t st) {
      if (opt.ours) enqueue_our_gemms(ours, gb, half, h, st);
      else enqueue_gemms(c.lt, p, gb, h * half, h, st);
    };

    const double ta = time_ms(c, [&] { state(0, false, c.s0); });
    const double tb = time_ms(c, [&] { gemms(1, c.s0); });
    const double tc = time_ms(c, [&] {
      state(0, false, c.s0);
      gemms(1, c.s0);
    });
    auto eff = [&](double t) { return (ta + tb - t) / std::min(ta, tb); };
    std::printf("  %-5s N %3d  a state alone             %8.4f ms  (%.2f TB/s of states)\n", dtname, N, ta,
                sbytes_half / (ta * 1e9));
    std::printf("  %-5s N %3d  b gemms alone             %8.4f ms  (%.0f TFLOP/s)\n", dtname, N, tb,
                gflop_half / tb);
    std::printf("  %-5s N %3d  c sequence, one stream    %8.4f ms  eff %5.2f   (ideal overlap: %.4f ms)\n", dtname,
                N, tc, eff(tc), std::max(ta, tb));
    double best_f = 1e30, best_g = 1e30;
    for (int prio : opt.prios) {
      const bool pr = prio != 0;
      auto one_pair = [&] { fork_join(c, [&](cudaStream_t s) { state(0, pr, s); }, [&](cudaStream_t s) { gemms(1, s); }); };
      auto steps_joined = [&] {
        for (int i = 0; i < opt.steps; ++i)
          fork_join(c, [&](cudaStream_t s) { state(i & 1, pr, s); }, [&](cudaStream_t s) { gemms(1 - (i & 1), s); });
      };
      auto steps_chains = [&] {
        fork_join(
            c,
            [&](cudaStream_t s) {  // half A: state, gemms, state, ...
              for (int i = 0; i < opt.steps; ++i) (i & 1) ? gemms(0, s) : state(0, pr, s);
            },
            [&](cudaStream_t s) {  // half B: gemms, state, gemms, ...
              for (int i = 0; i < opt.steps; ++i) (i & 1) ? state(1, pr, s) : gemms(1, s);
            });
      };
      // Chains: host order A-chain-first puts all of A's launches before B's; a graph has no
      // launch order anyway, so g is only meaningful as a graph.
      cudaGraphExec_t ge = capture(c, one_pair), gf = capture(c, steps_joined), gg = capture(c, steps_chains);
      struct Var {
        const char* name;
        std::function<void()> run;
        bool multi;
      };
      const Var vars[] = {
          {"d concurrent, eager", one_pair, false},
          {"e concurrent, graph", [&] { CK(cudaGraphLaunch(ge, c.s0)); }, false},
          {"f steps joined, graph", [&] { CK(cudaGraphLaunch(gf, c.s0)); }, true},
          {"g steps chains, graph", [&] { CK(cudaGraphLaunch(gg, c.s0)); }, true},
      };
      for (const Var& var : vars) {
        const auto d = validate(var.run, var.multi ? refS : ref1, var.multi ? orefS : oref1);
        const bool ok = d.first == 0 && d.second == 0;
        fails += !ok;
        const double t = time_ms(c, var.run) / (var.multi ? opt.steps : 1);
        if (var.multi) {
          if (var.name[0] == 'f') best_f = std::min(best_f, t);
          else best_g = std::min(best_g, t);
        }
        std::printf("  %-5s N %3d  %-22s prio %d %8.4f ms%s eff %5.2f   S diff %llu o diff %llu %s\n", dtname, N,
                    var.name, prio, t, var.multi ? "/step" : "     ", eff(t), d.first, d.second, ok ? "PASS" : "FAIL");
      }
      CK(cudaGraphExecDestroy(ge));
      CK(cudaGraphExecDestroy(gf));
      CK(cudaGraphExecDestroy(gg));
    }
    std::fflush(stdout);
    per_layer.push_back({N, {best_f, best_g}});
    destroy_plan(p);
  }

  // One layer of the full batch without the split, as production runs it today (one graph, in
  // sequence, everything on all SMs), against two split steps (each half's state and gemms once).
  {
    Plan p = make_plan(c.lt, B, 0, opt.splitk);
    std::printf("\n-- unsplit layer: state of %d sequences on %d SMs, then the gemms at M = %d on all SMs\n", B,
                c.sms, B);
    enqueue_gemms(c.lt, p, gb, 0, 0, c.s0);
    CK(cudaStreamSynchronize(c.s0));
    if (show_gemms) print_plan(p);
    cudaGraphExec_t gu = capture(c, [&] {
      sk_full.launch(full, c.sms, false, c.s0);
      enqueue_gemms(c.lt, p, gb, 0, 0, c.s0);
    });
    const double tsa = time_ms(c, [&] { sk_full.launch(full, c.sms, false, c.s0); });
    const double tga = time_ms(c, [&] { enqueue_gemms(c.lt, p, gb, 0, 0, c.s0); });
    const double tu = time_ms(c, [&] { CK(cudaGraphLaunch(gu, c.s0)); });
    CK(cudaGraphExecDestroy(gu));
    destroy_plan(p);
    std::printf("  %-5s unsplit layer: %.4f ms (state %.4f + gemms %.4f alone)\n", dtname, tu, tsa, tga);
    for (const auto& [N, fg] : per_layer)
      std::printf("  %-5s split layer, N %3d: f %.4f ms (%+.1f%%), g %.4f ms (%+.1f%%)  [2 steps, best prio]\n",
                  dtname, N, 2 * fg.first, 100.0 * (2 * fg.first - tu) / tu, 2 * fg.second,
                  100.0 * (2 * fg.second - tu) / tu);
  }

  for (void* ptr : std::initializer_list<void*>{states, pristine, ref1, refS, q, k, v, o, oref1, orefS, slots, ndiff})
    CK(cudaFree(ptr));
  return fails;
}

}  // namespace

int main(int argc, char** argv) {
  Opts opt;
  auto usage = [] {
    std::fprintf(stderr,
                 "usage: experiment_decode_overlap [--N 0,40,52,66,80] [--reps 20] [--steps 8] [--dtypes f32,bf16] [--prio 0,1] "
                 "[--splitk 0|1] [--half 640] [--co 0|1|2|4] [--cands 16] [--gemm cublas|ours]\n");
    return 2;
  };
  for (int i = 1; i < argc; i += 2) {
    if (i + 1 >= argc) return usage();
    const std::string key = argv[i], val = argv[i + 1];
    auto ints = [&](std::vector<int>& dst) {
      dst.clear();
      for (const auto& s : split_list(val)) dst.push_back(std::atoi(s.c_str()));
    };
    if (key == "--N") ints(opt.Ns);
    else if (key == "--prio") ints(opt.prios);
    else if (key == "--reps") opt.reps = std::atoi(val.c_str());
    else if (key == "--steps") opt.steps = std::atoi(val.c_str());
    else if (key == "--half") opt.half = std::atoi(val.c_str());
    else if (key == "--splitk") opt.splitk = std::atoi(val.c_str()) != 0;
    else if (key == "--co") opt.co = std::atoi(val.c_str());
    else if (key == "--cands") opt.cands = std::atoi(val.c_str());
    else if (key == "--gemm" && (val == "cublas" || val == "ours")) opt.ours = val == "ours";
    else if (key == "--dtypes") opt.dtypes = split_list(val);
    else return usage();
  }
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount;
  if (opt.reps < 1 || opt.steps < 1 || opt.half < 1 || opt.Ns.empty() || opt.prios.empty() || opt.dtypes.empty() ||
      (opt.co != 0 && opt.co != 1 && opt.co != 2 && opt.co != 4) || opt.cands < 1 || (opt.ours && !opt.co) ||
      (opt.ours && opt.half % gemm_exp::BM != 0))
    return usage();
  if (opt.co) opt.Ns = {0};  // co-resident: both kernels on every SM
  for (int N : opt.Ns)
    if (N < 0 || N >= sms) return usage();
  for (const auto& d : opt.dtypes)
    if (d != "f32" && d != "bf16") return usage();
  if (prop.sharedMemPerBlockOptin < static_cast<size_t>(v3::kSmemBudget)) {
    std::fprintf(stderr, "experiment_decode_overlap: v3 needs %d bytes of shared memory per block\n", v3::kSmemBudget);
    return 2;
  }
  std::printf("%s, %d SMs; half batch %d sequences, %d reps (median), %d steps in f/g, split-K %s; cuBLASLt %zu\n",
              prop.name, sms, opt.half, opt.reps, opt.steps, opt.splitk ? "allowed" : "off (as production)",
              cublasLtGetVersion());

  Ctx c{};
  c.sms = sms, c.reps = opt.reps;
  CK(cudaStreamCreateWithFlags(&c.s0, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&c.s1, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&c.s2, cudaStreamNonBlocking));
  for (cudaEvent_t* e : {&c.e0, &c.e1}) CK(cudaEventCreate(e));
  for (cudaEvent_t* e : {&c.fork, &c.j1, &c.j2}) CK(cudaEventCreateWithFlags(e, cudaEventDisableTiming));
  CKB(cublasLtCreate(&c.lt));

  GemmBufs gb{};
  const size_t rows = 2 * static_cast<size_t>(opt.half);
  for (int i = 0; i < 4; ++i) {
    const size_t nw = static_cast<size_t>(kProj[i].n) * kProj[i].k, nx = rows * kProj[i].k, ny = rows * kProj[i].n;
    CK(cudaMalloc(&gb.w[i], nw * 2));
    CK(cudaMalloc(&gb.x[i], nx * 2));
    CK(cudaMalloc(&gb.y[i], ny * 2));
    fill_bf16<<<1024, 256, 0, c.s0>>>(gb.w[i], nw, 1000003ull * (i + 1), 0.02f);
    CK(cudaGetLastError());
    fill_bf16<<<1024, 256, 0, c.s0>>>(gb.x[i], nx, 7000003ull * (i + 1), 1.0f);
    CK(cudaGetLastError());
  }
  for (void*& w : gb.ws) CK(cudaMalloc(&w, kWsBytes));
  CK(cudaStreamSynchronize(c.s0));
  const DriverFns drv = load_driver_fns();

  int fails = 0;
  for (size_t i = 0; i < opt.dtypes.size(); ++i)
    fails += opt.dtypes[i] == "f32" ? run_dtype<float>(opt, c, gb, drv, "F32", i == 0)
                                    : run_dtype<__nv_bfloat16>(opt, c, gb, drv, "BF16", i == 0);

  for (int i = 0; i < 4; ++i) {
    CK(cudaFree(gb.w[i]));
    CK(cudaFree(gb.x[i]));
    CK(cudaFree(gb.y[i]));
  }
  for (void* w : gb.ws) CK(cudaFree(w));
  CKB(cublasLtDestroy(c.lt));
  CK(cudaDeviceSynchronize());
  std::printf("\n%s: %d validation failure(s)\n", fails ? "FAIL" : "PASS", fails);
  return fails ? 1 : 0;
}
