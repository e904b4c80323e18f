// experiments/gemm/algo: what cuBLASLt's candidate algorithms launch and cost at laplace-3b's gemm
// shapes, memsets included.
//
// A decode step's trace (BENCHMARKS.md, "Where a decode step's time goes") shows a memset before
// every β = 0 gemm (qkvg, w12, head: 49 per step) and ~0.21 ms of idle gaps around them. The
// production plan (ops/cuda/cuda_backend.cpp) takes cuBLASLt's first heuristic result under
// these preferences: 32 MiB workspace, no split-K reduction, the operands' alignments. This experiment
// asks for the first --algos results under the same preferences and, per result:
//   - captures one call into a CUDA graph and lists its nodes: kernels (grid, block, dynamic
//     shared memory, name, read through the driver API) and memsets (bytes);
//   - times a graph of --calls calls (median of --reps replays, ms per call), so launch gaps
//     and memsets count as they do in the decode graph; the candidates' replays are
//     interleaved round by round, so the clock's drift under load falls on all of them alike;
//   - compares the output with result 0's: bytes equal or not, and the largest difference
//     relative to the output's RMS.
// Per shape it also runs the same with the β = 0 output given a distinct C (cin ≠ d), to see
// whether the memset follows the aliasing.
//
//   nvcc -O3 -std=c++17 -I. -gencode=arch=compute_90a,code=sm_90a -o experiment_gemm_algo experiments/gemm/algo.cu -lcublasLt
//   ./experiment_gemm_algo [--M 1280] [--algos 8] [--calls 10] [--reps 20] [--only qkvg,w12,head] [--ws-mib 32]
//
// Shapes: row-major C[M, n] = X[M, k] · W[n, k]ᵀ, bf16 in, F32 accumulate; out bf16 (head: F32),
// β = 0 in place (qkvg, w12, head) or β = 1 with C ≠ D (wo, w3: the residual adds), as the model.
// Exit status 1 on any CUDA or cuBLASLt error.
#include <cublasLt.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "experiments/cublas_host.h"
#include "experiments/driver_api.h"
#include "experiments/fill.cuh"
#include "experiments/host.h"

namespace {

struct Shape {
  const char* name;
  int n, k;
  bool f32_out;  // head: F32 logits
  float beta;    // 0: D = X·Wᵀ in place; 1: D = C + X·Wᵀ with C ≠ D
};
constexpr Shape kShapes[] = {{"qkvg", 9216, 3072, false, 0.f},
                             {"wo", 3072, 3072, false, 1.f},
                             {"w12", 16384, 3072, false, 0.f},
                             {"w3", 3072, 8192, false, 1.f},
                             {"head", 92160, 3072, true, 0.f}};

struct Opts {
  int M = 1280, algos = 8, calls = 10, reps = 20, ws_mib = 32;
  std::string only;
};

using experiments::fill_bf16;

using experiments::DriverFns;

struct Bufs {
  __nv_bfloat16 *x = nullptr, *w = nullptr;
  void *c = nullptr, *d = nullptr, *ref = nullptr, *ws = nullptr;
  size_t ws_bytes = 0;
};

// Largest |a − b| over RMS(b) and whether the bytes agree, of n outputs (F32 or bf16) on the host.
void compare(const void* dev_a, const void* dev_b, size_t n, bool f32, double* rel, bool* same) {
  const size_t bytes = n * (f32 ? 4 : 2);
  std::vector<unsigned char> a(bytes), b(bytes);
  CK(cudaMemcpy(a.data(), dev_a, bytes, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(b.data(), dev_b, bytes, cudaMemcpyDeviceToHost));
  *same = std::memcmp(a.data(), b.data(), bytes) == 0;
  double ss = 0, mx = 0;
  for (size_t i = 0; i < n; ++i) {
    float va, vb;
    if (f32) {
      std::memcpy(&va, &a[4 * i], 4), std::memcpy(&vb, &b[4 * i], 4);
    } else {
      uint16_t ha, hb;
      std::memcpy(&ha, &a[2 * i], 2), std::memcpy(&hb, &b[2 * i], 2);
      va = experiments::bf2f(ha), vb = experiments::bf2f(hb);
    }
    ss += static_cast<double>(vb) * vb;
    mx = std::fmax(mx, std::fabs(static_cast<double>(va) - vb));
  }
  *rel = mx / std::sqrt(ss / static_cast<double>(n) + 1e-300);
}

void run_shape(const Opts& o, const Shape& s, bool distinct_c, cublasLtHandle_t lt, const DriverFns& drv,
               const Bufs& b, cudaStream_t st) {
  const cudaDataType_t out_t = s.f32_out ? CUDA_R_32F : CUDA_R_16BF;
  const size_t out_n = static_cast<size_t>(o.M) * s.n, out_bytes = out_n * (s.f32_out ? 4 : 2);
  experiments::TnGemm tg = experiments::tn_gemm_create(lt, o.M, s.n, s.k, out_t, b.ws_bytes, o.algos);
  const cublasLtMatmulDesc_t desc = tg.desc;
  const cublasLtMatrixLayout_t lw = tg.lw, lx = tg.lx, ly = tg.ly;
  const std::vector<cublasLtMatmulHeuristicResult_t>& res = tg.cands;
  const int found = static_cast<int>(res.size());
  const bool in_place = s.beta == 0.f && !distinct_c;
  void* cin = in_place ? b.d : b.c;
  const double gflop = 2.0 * o.M * s.n * s.k * 1e-9;
  std::printf("\n%s: M %d n %d k %d, %s out, beta %.0f, %s; %d candidates\n", s.name, o.M, s.n, s.k,
              s.f32_out ? "F32" : "bf16", s.beta, in_place ? "C = D" : "C != D", found);
  const float one = 1.f;
  struct Cand {
    int i = 0, memsets = 0;
    bool same = true;
    double rel = 0;
    cudaGraphExec_t exec = nullptr;
    std::vector<double> ms;
  };
  std::vector<Cand> cands;
  for (int i = 0; i < found; ++i) {
    if (res[i].state != CUBLAS_STATUS_SUCCESS) continue;
    auto call = [&](cudaStream_t q) {
      return cublasLtMatmul(lt, desc, &one, b.w, lw, b.x, lx, &s.beta, cin, ly, b.d, ly, &res[i].algo, b.ws,
                            b.ws_bytes, q);
    };
    // One captured call: its nodes.
    cudaGraph_t g1;
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    const cublasStatus_t cs = call(st);
    CK(cudaStreamEndCapture(st, &g1));
    if (cs != CUBLAS_STATUS_SUCCESS) {
      std::printf("  [%d] %s: capture failed (%s)\n", i, experiments::algo_config_str(res[i]).c_str(), cublasLtGetStatusName(cs));
      CK(cudaGraphDestroy(g1));
      continue;
    }
    Cand c;
    c.i = i;
    std::printf("  [%d] %s\n", i, experiments::algo_config_str(res[i]).c_str());
    c.memsets = experiments::print_graph_nodes(drv, g1);
    CK(cudaGraphDestroy(g1));
    // Output against result 0's (β = 1: C is the same constant input every call, so repeat
    // calls give the same D).
    CK(cudaMemsetAsync(b.d, 0x7f, out_bytes, st));  // a stale D must not pass for a result
    CKB(call(st));
    CK(cudaStreamSynchronize(st));
    if (cands.empty()) CK(cudaMemcpy(b.ref, b.d, out_bytes, cudaMemcpyDeviceToDevice));
    else compare(b.d, b.ref, out_n, s.f32_out, &c.rel, &c.same);
    // `calls` calls in one graph, replayed below.
    cudaGraph_t g;
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    for (int k = 0; k < o.calls; ++k) CKB(call(st));
    CK(cudaStreamEndCapture(st, &g));
    CK(cudaGraphInstantiate(&c.exec, g, 0));
    CK(cudaGraphDestroy(g));
    for (int w = 0; w < 3; ++w) CK(cudaGraphLaunch(c.exec, st));
    cands.push_back(std::move(c));
  }
  // Timing: `reps` rounds over all candidates, interleaved (host.h).
  {
    std::vector<cudaGraphExec_t> execs;
    for (const Cand& c : cands) execs.push_back(c.exec);
    const auto ms = experiments::time_graphs_interleaved(execs, st, o.reps, o.calls);
    for (size_t j = 0; j < cands.size(); ++j) cands[j].ms = ms[j];
  }
  for (Cand& c : cands) {
    const double ms = experiments::median(c.ms);
    std::printf("  [%d] => %.4f ms per call (%.0f TFLOP/s; min %.4f), %d memset(s); vs [0]: %s, max diff / RMS %.2e\n",
                c.i, ms, gflop / ms, *std::min_element(c.ms.begin(), c.ms.end()), c.memsets,
                c.i == cands.front().i ? "reference" : (c.same ? "same bytes" : "differs"), c.rel);
    CK(cudaGraphExecDestroy(c.exec));
  }
  experiments::tn_gemm_destroy(tg);
}

}  // namespace

int main(int argc, char** argv) {
  Opts o;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i], v = argv[i + 1];
    if (a == "--M") o.M = std::atoi(v.c_str());
    else if (a == "--algos") o.algos = std::atoi(v.c_str());
    else if (a == "--calls") o.calls = std::atoi(v.c_str());
    else if (a == "--reps") o.reps = std::atoi(v.c_str());
    else if (a == "--ws-mib") o.ws_mib = std::atoi(v.c_str());
    else if (a == "--only") o.only = v;
    else {
      std::fprintf(stderr, "experiment_gemm_algo: unknown option %s\n", a.c_str());
      return 2;
    }
  }
  if (o.M <= 0 || o.algos <= 0 || o.calls <= 0 || o.reps <= 0 || o.ws_mib < 0) {
    std::fprintf(stderr, "experiment_gemm_algo: sizes must be positive\n");
    return 2;
  }
  const DriverFns drv = experiments::load_driver_fns();
  cublasLtHandle_t lt;
  CKB(cublasLtCreate(&lt));
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  size_t max_w = 0, max_x = 0, max_out = 0;
  for (const Shape& s : kShapes) {
    max_w = std::max(max_w, static_cast<size_t>(s.n) * s.k);
    max_x = std::max(max_x, static_cast<size_t>(o.M) * s.k);
    max_out = std::max(max_out, static_cast<size_t>(o.M) * s.n * (s.f32_out ? 4 : 2));
  }
  Bufs b;
  b.ws_bytes = static_cast<size_t>(o.ws_mib) << 20;
  CK(cudaMalloc(&b.w, max_w * 2));  // [n, k] bf16
  CK(cudaMalloc(&b.x, max_x * 2));  // [M, k] bf16
  CK(cudaMalloc(&b.c, max_out));    // [M, n] the β = 1 input
  CK(cudaMalloc(&b.d, max_out));    // [M, n] the output
  CK(cudaMalloc(&b.ref, max_out));  // [M, n] result 0's output
  if (b.ws_bytes) CK(cudaMalloc(&b.ws, b.ws_bytes));
  fill_bf16<<<1024, 256>>>(b.w, max_w, 1, 0.02f);
  fill_bf16<<<1024, 256>>>(b.x, max_x, 7, 1.0f);
  fill_bf16<<<1024, 256>>>(static_cast<__nv_bfloat16*>(b.c), max_out / 2, 11, 1.0f);  // bits: also valid F32
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("experiment_gemm_algo: %s, %d SMs, cuBLASLt %zu; M %d, %d candidates, %d calls per graph, median of %d\n", prop.name,
              prop.multiProcessorCount, cublasLtGetVersion(), o.M, o.algos, o.calls, o.reps);
  for (const Shape& s : kShapes) {
    if (!o.only.empty() && ("," + o.only + ",").find(std::string(",") + s.name + ",") == std::string::npos) continue;
    run_shape(o, s, false, lt, drv, b, st);
    if (s.beta == 0.f) run_shape(o, s, true, lt, drv, b, st);
  }
  CK(cudaFree(b.w));
  CK(cudaFree(b.x));
  CK(cudaFree(b.c));
  CK(cudaFree(b.d));
  CK(cudaFree(b.ref));
  if (b.ws) CK(cudaFree(b.ws));
  CKB(cublasLtDestroy(lt));
  return 0;
}
