// experiments/gemm/wgmma: a hand-written bf16 gemm (TMA + wgmma) at the decode step's shapes, against
// cuBLASLt. The first step towards one kernel per decode layer that streams the GLA states on some
// warps while others run the projections (BENCHMARKS.md: the BF16 target needs the state stream
// hidden under the gemms, and cuBLASLt's kernels leave no room beside them; experiments/decode/cores's
// mma.sync gemm role reached 211 TFLOP/s, far below the ≥ 620 that design needs). Such a kernel
// needs a gemm it owns: this experiment builds that gemm alone first, validated and timed.
//
//   nvcc -O3 -std=c++17 -I. -gencode=arch=compute_90a,code=sm_90a -o experiment_gemm_wgmma experiments/gemm/wgmma.cu -lcublasLt
//   ./experiment_gemm_wgmma [--M 640,1280] [--only qkvg,wo,w12,w3] [--calls 10] [--reps 15] [--versions 1,2,3,4,5,6]
//
// Y[M, N] = X[M, K] · W[N, K]ᵀ, bf16 in, F32 accumulate, bf16 out (the model's projections, β = 0).
// One block of 384 threads per SM (a 168-register cap): warpgroup 0 is the producer (one thread
// issues the TMA loads of X and W tiles into a ring of shared stages; setmaxnreg gives the group
// 40 registers), warpgroups 1 and 2 consume (each owns 64 rows of the 128-row tile, wgmma from
// shared memory, 232 registers). Stages complete on "full" mbarriers (TMA transaction bytes) and
// are handed back on "empty" ones (one arrival per consumer warpgroup). Tiles: BM = 128, BK = 64,
// BN per version; tile t covers rows (t mod M/BM)·BM and columns (t div M/BM)·BN, so CTAs that run
// together share a weight tile (X is small and stays in L2).
//   v1  BN 128, 4 stages, each k-block's MMAs waited for before its stage is handed back
//   v2  BN 128, 5 stages, one k-block's MMAs kept in flight (wait_group 1; the stage before is
//       handed back)
//   v3  BN 256, 4 stages, as v2 (twice the MMA work per byte of X loaded; 128 accumulators)
//   v4  v2 persistent: grid = SMs, each CTA walks tiles t = x, x + grid, ...; the ring runs on
//       across tiles, so the next tile's loads overlap this tile's epilogue (the form a fused
//       decode-layer kernel would take)
//   v5  "co": v2 with 4 stages (129 KB) and 120 registers per thread (46,080 per CTA), leaving
//       an SM room for a state block beside each CTA (experiments/decode/overlap --gemm ours); no
//       setmaxnreg
//   v6  v3 persistent (grid = SMs)
// The kernel is in wgmma_gemm.cuh.
// The epilogue stores each thread's bf16 pairs straight to global memory (no shared staging yet).
//
// Checks, per shape and version: Y poisoned (NaN) before the run, then against cuBLASLt's Y of the
// same inputs: NaNs (unwritten), ‖Δ‖ / ‖Y_cublas‖ (bound 1e-2: both round to bf16 after F32 sums
// in different orders, ~3e-3), the largest |Δ| / RMS and the share of bit-equal outputs
// (informational); and 256 sampled entries against an F64 dot product of the same bf16 inputs
// (‖Δ‖ / ‖ref‖, bound 1e-2) for both.
// Timing: a CUDA graph of `calls` calls per kernel, replays interleaved round-robin over the
// versions and cuBLASLt (`reps` rounds, median), TFLOP/s. Exit status 1 on a failed check.
#include <cublasLt.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "experiments/cublas_host.h"
#include "experiments/fill.cuh"
#include "experiments/host.h"
#include "experiments/gemm/wgmma_gemm.cuh"

namespace {

using namespace gemm_exp;

// ---- host ------------------------------------------------------------------------------------

struct Shape {
  const char* name;
  int n, k;
};
constexpr Shape kShapes[] = {{"qkvg", 9216, 3072}, {"wo", 3072, 3072}, {"w12", 16384, 3072}, {"w3", 3072, 8192}};

struct Version {
  int id;
  const char* what;
  int bn, smem;
  bool persistent;
  void (*k)(CUtensorMap, CUtensorMap, bf16*, int, int, int);
};

template <int BN, int kStages, bool kOverlap, int kRegs = 168>
Version make_version(int id, const char* what, bool persistent) {
  auto k = gemm_tma_wgmma<BN, kStages, kOverlap, kRegs>;
  const int smem = Smem<BN, kStages>::kBytes;
  CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  return Version{id, what, BN, smem, persistent, k};
}

using experiments::fill_bf16;
using experiments::split_list;

std::vector<uint16_t> to_host(const bf16* p, size_t n) {
  std::vector<uint16_t> h(n);
  CK(cudaMemcpy(h.data(), p, n * 2, cudaMemcpyDeviceToHost));
  return h;
}

// ‖a − b‖ / ‖b‖ is the checked figure: two bf16 roundings of F32 sums in different orders differ
// by an ulp here and there (2^-8 of a value, ~0.3 % in this norm); the largest |Δ| over all
// entries, relative to the RMS, is printed too, but an ulp at a 5σ entry is already ~4 % of the
// RMS, so it is no pass/fail figure.
struct Check {
  size_t nan = 0;
  double rel_rms = 0, rel_max = 0, equal = 0;
};
// a against the reference b (both [M, n] bf16 on the host).
Check compare(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b) {
  Check c;
  double ss = 0, se = 0, mx = 0;
  size_t eq = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const float va = experiments::bf2f(a[i]), vb = experiments::bf2f(b[i]);
    if (std::isnan(va)) {
      ++c.nan;
      continue;
    }
    const double e = static_cast<double>(va) - vb;
    ss += static_cast<double>(vb) * vb;
    se += e * e;
    mx = std::max(mx, std::fabs(e));
    eq += a[i] == b[i];
  }
  c.rel_rms = std::sqrt(se / (ss + 1e-300));
  c.rel_max = mx / std::sqrt(ss / static_cast<double>(a.size()) + 1e-300);
  c.equal = static_cast<double>(eq) / static_cast<double>(a.size());
  return c;
}

// ‖y − F64 dot‖ / ‖F64 dot‖ over `samples` random entries.
double f64_check(const std::vector<uint16_t>& y, const std::vector<uint16_t>& x, const std::vector<uint16_t>& w,
                 int M, int n, int k, int samples, uint64_t seed) {
  double ss = 0, se = 0;
  uint64_t z = seed;
  for (int s = 0; s < samples; ++s) {
    z = z * 6364136223846793005ULL + 1442695040888963407ULL;
    const int i = static_cast<int>((z >> 33) % static_cast<uint64_t>(M));
    z = z * 6364136223846793005ULL + 1442695040888963407ULL;
    const int j = static_cast<int>((z >> 33) % static_cast<uint64_t>(n));
    double ref = 0;
    for (int kk = 0; kk < k; ++kk)
      ref += static_cast<double>(experiments::bf2f(x[static_cast<size_t>(i) * k + kk])) *
             experiments::bf2f(w[static_cast<size_t>(j) * k + kk]);
    const double e = experiments::bf2f(y[static_cast<size_t>(i) * n + j]) - ref;
    ss += ref * ref;
    se += e * e;
  }
  return std::sqrt(se / (ss + 1e-300));
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> Ms = {640, 1280}, want = {1, 2, 3, 4, 5, 6};
  std::string only;
  int calls = 10, reps = 15;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i], v = argv[i + 1];
    auto ints = [&](std::vector<int>& dst) {
      dst.clear();
      for (const auto& s : split_list(v)) dst.push_back(std::atoi(s.c_str()));
    };
    if (a == "--M") ints(Ms);
    else if (a == "--versions") ints(want);
    else if (a == "--only") only = v;
    else if (a == "--calls") calls = std::atoi(v.c_str());
    else if (a == "--reps") reps = std::atoi(v.c_str());
    else {
      std::fprintf(stderr,
                   "usage: experiment_gemm_wgmma [--M 640,1280] [--only qkvg,wo,w12,w3] [--calls 10] [--reps 15] "
                   "[--versions 1,2,3,4,5,6]\n");
      return 2;
    }
  }
  for (int M : Ms)
    if (M <= 0 || M % BM) {
      std::fprintf(stderr, "experiment_gemm_wgmma: M must be a positive multiple of %d\n", BM);
      return 2;
    }
  if (calls < 1 || reps < 1) return 2;
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, 0));
  if (prop.major != 9) {
    std::fprintf(stderr, "experiment_gemm_wgmma: needs an sm_90 GPU (this is sm_%d%d)\n", prop.major, prop.minor);
    return 2;
  }
  const int sms = prop.multiProcessorCount;
  std::printf("experiment_gemm_wgmma: %s, %d SMs, cuBLASLt %zu; %d calls per graph, median of %d interleaved rounds\n", prop.name,
              sms, cublasLtGetVersion(), calls, reps);

  std::vector<Version> all = {make_version<128, 4, false>(1, "BN128 4 stages, wait 0", false),
                              make_version<128, 5, true>(2, "BN128 5 stages, 1 k-block in flight", false),
                              make_version<256, 4, true>(3, "BN256 4 stages, 1 k-block in flight", false),
                              make_version<128, 5, true>(4, "v2 persistent (grid = SMs)", true),
                              make_version<128, 4, true, 120>(5, "co: BN128 4 stages, 120 registers", false),
                              make_version<256, 4, true>(6, "v3 persistent (grid = SMs)", true)};
  std::vector<Version> vs;
  for (const Version& v : all)
    if (std::find(want.begin(), want.end(), v.id) != want.end()) vs.push_back(v);

  const auto enc = get_encoder();
  cublasLtHandle_t lt;
  CKB(cublasLtCreate(&lt));
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  const size_t ws_bytes = size_t{32} << 20;
  void* ws = nullptr;
  CK(cudaMalloc(&ws, ws_bytes));
  int fails = 0;

  std::vector<std::string> summary;
  for (int M : Ms) {
    for (const Shape& sh : kShapes) {
      if (!only.empty() && ("," + only + ",").find(std::string(",") + sh.name + ",") == std::string::npos) continue;
      const size_t nx = static_cast<size_t>(M) * sh.k, nw = static_cast<size_t>(sh.n) * sh.k,
                   ny = static_cast<size_t>(M) * sh.n;
      bf16 *x, *w, *y, *yref;
      CK(cudaMalloc(&x, nx * 2));
      CK(cudaMalloc(&w, nw * 2));
      CK(cudaMalloc(&y, ny * 2));
      CK(cudaMalloc(&yref, ny * 2));
      fill_bf16<<<1024, 256, 0, st>>>(x, nx, 7 + M, 1.0f);
      CK(cudaGetLastError());
      fill_bf16<<<1024, 256, 0, st>>>(w, nw, 1000003ull * sh.n + sh.k, 0.02f);
      CK(cudaGetLastError());
      const double gflop = 2.0 * M * sh.n * sh.k * 1e-9;
      std::printf("\n%s: M %d N %d K %d (%.1f GFLOP)\n", sh.name, M, sh.n, sh.k, gflop);

      // cuBLASLt's pick for the same product, as production calls it.
      experiments::TnGemm p = experiments::tn_gemm_create(lt, M, sh.n, sh.k, CUDA_R_16BF, ws_bytes, 1);
      if (p.cands.empty()) {
        std::fprintf(stderr, "experiment_gemm_wgmma: no cuBLASLt algorithm\n");
        return 1;
      }
      const float one = 1.f, zero = 0.f;
      auto lt_call = [&](cudaStream_t s) {
        CKB(cublasLtMatmul(lt, p.desc, &one, w, p.lw, x, p.lx, &zero, yref, p.ly, yref, p.ly, &p.cands[0].algo, ws,
                           ws_bytes, s));
      };
      lt_call(st);
      CK(cudaStreamSynchronize(st));
      const auto hx = to_host(x, nx), hw = to_host(w, nw), href = to_host(yref, ny);
      const double lt_f64 = f64_check(href, hx, hw, M, sh.n, sh.k, 256, 99);
      std::printf("  cuBLASLt  %s\n            vs F64 (256 samples): ‖Δ‖ / ‖ref‖ %.2e\n",
                  experiments::algo_config_str(p.cands[0]).c_str(), lt_f64);
      if (!(lt_f64 < 1e-2)) ++fails;

      struct Timed {
        std::string what;
        cudaGraphExec_t g = nullptr;
        std::vector<double> ms;
      };
      std::vector<Timed> timed;
      auto capture = [&](const std::string& what, const std::function<void(cudaStream_t)>& call) {
        cudaGraph_t g;
        CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
        for (int i = 0; i < calls; ++i) call(st);
        CK(cudaStreamEndCapture(st, &g));
        Timed tm;
        tm.what = what;
        CK(cudaGraphInstantiate(&tm.g, g, 0));
        CK(cudaGraphDestroy(g));
        timed.push_back(std::move(tm));
      };
      capture("cuBLASLt", lt_call);

      for (const Version& v : vs) {
        if (sh.n % v.bn) {
          std::printf("  v%d: N %% %d != 0, skipped\n", v.id, v.bn);
          continue;
        }
        const CUtensorMap mx = make_map(enc, x, M, sh.k, BM), mw = make_map(enc, w, sh.n, sh.k, v.bn);
        const int tiles = (M / BM) * (sh.n / v.bn), grid = v.persistent ? std::min(tiles, sms) : tiles;
        auto call = [&, v, mx, mw, grid](cudaStream_t s) {
          v.k<<<grid, kThreads, v.smem, s>>>(mx, mw, y, M, sh.n, sh.k);
          CK(cudaGetLastError());
        };
        CK(cudaMemsetAsync(y, 0xff, ny * 2, st));  // NaN: an unwritten output shows
        call(st);
        CK(cudaStreamSynchronize(st));
        const auto hy = to_host(y, ny);
        const Check c = compare(hy, href);
        const double f64 = f64_check(hy, hx, hw, M, sh.n, sh.k, 256, 99);
        const bool ok = c.nan == 0 && c.rel_rms < 1e-2 && f64 < 1e-2;
        fails += !ok;
        std::printf("  v%d %-38s grid %4d, %6d B smem: unwritten %zu, vs cuBLASLt ‖Δ‖ / ‖ref‖ %.2e (max |Δ| / RMS "
                    "%.2e, %.1f %% bit-equal), vs F64 %.2e  %s\n",
                    v.id, v.what, grid, v.smem, c.nan, c.rel_rms, c.rel_max, 100 * c.equal, f64, ok ? "PASS" : "FAIL");
        if (ok) capture("v" + std::to_string(v.id), call);
      }

      for (Timed& tm : timed) CK(cudaGraphLaunch(tm.g, st));  // warm-up
      CK(cudaStreamSynchronize(st));
      {
        std::vector<cudaGraphExec_t> execs;
        for (const Timed& tm : timed) execs.push_back(tm.g);
        const auto ms = experiments::time_graphs_interleaved(execs, st, reps, calls);
        for (size_t j = 0; j < timed.size(); ++j) timed[j].ms = ms[j];
      }
      const double base = experiments::median(timed.front().ms);
      for (Timed& tm : timed) {
        const double ms = experiments::median(tm.ms);
        char line[256];
        std::snprintf(line, sizeof line, "  %-5s M %5d %-9s %8.4f ms  %5.0f TFLOP/s  (%.2f× cuBLASLt; min %.4f)",
                      sh.name, M, tm.what.c_str(), ms, gflop / ms, base / ms,
                      *std::min_element(tm.ms.begin(), tm.ms.end()));
        summary.push_back(line);  // printed at the end, all shapes together
        CK(cudaGraphExecDestroy(tm.g));
      }
      experiments::tn_gemm_destroy(p);
      for (void* ptr : {static_cast<void*>(x), static_cast<void*>(w), static_cast<void*>(y), static_cast<void*>(yref)})
        CK(cudaFree(ptr));
    }
  }
  std::printf("\ntimes (graph of %d calls, median of %d rounds):\n", calls, reps);
  for (const auto& l : summary) std::printf("%s\n", l.c_str());
  CK(cudaFree(ws));
  CKB(cublasLtDestroy(lt));
  std::printf("\n%s: %d failed check(s)\n", fails ? "FAIL" : "PASS", fails);
  return fails ? 1 : 0;
}
