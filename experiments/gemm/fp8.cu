// experiments/gemm/fp8: e4m3 gemms through cuBLASLt at laplace-3b's projection shapes, per scaling
// granularity, against the bf16 gemm production runs (issue 31's first question: what rate, at what
// error, with which scales).
//
// Shapes: row-major Y[M, n] = X[M, k] · W[n, k]ᵀ as the model's forward projections (qkvg, wo, w12,
// w3), in the "TN" layout FP8 gemms need on Hopper (both operands K-major); Y bf16, F32 accumulate.
// X is drawn with a few outlier channels (every 97th column ×8), as activations have, so that the
// granularities differ; W ~ 0.02·U(−1, 1).
//
// Scalings (each operand quantised by our kernels below: s = amax/448 over the scale's group,
// q = e4m3(x/s) saturating; cuBLASLt multiplies the products back by the scales):
//   tensor  one F32 scale per operand (CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F)
//   row     one per row of W and one per row of X (OUTER_VEC_32F: the output's row × column scale)
//   block   X per 1×128 along k (VEC128_32F), W per 128×128 (BLK128x128_32F): DeepSeek-V3's recipe
// For `block` the order of the scale grids is not stated where we could read it, so both orders of
// each grid are tried (k-blocks fastest, or rows/columns fastest); the right one shows by its error.
//
// Per shape, M and scaling it prints: the median ms of a call (graphs of --calls calls, --reps
// replays interleaved with the bf16 gemm's), TFLOP/s and the speed-up over bf16; the quantisers' own
// ms (simple kernels, one block per group: an upper bound, loosest for `tensor`, whose one group is
// one block); and two errors on a sample of outputs (--check-rows rows × up to 2,048 columns), relative RMS:
//   vs_q    against an F64 product of the same quantised operands (times their scales): the gemm's
//           own error (accumulation, bf16 output), which issue 31's tests bound;
//   vs_bf16 against an F64 product of the bf16 operands: what quantising costs.
//
//   nvcc -O3 -std=c++17 -I. -gencode=arch=compute_90a,code=sm_90a -o experiment_gemm_fp8 experiments/gemm/fp8.cu -lcublasLt
//   ./experiment_gemm_fp8 [--M 1280,8192,16384] [--only qkvg,w12] [--modes tensor,row,block] [--calls 10]
//                         [--reps 20] [--check-rows 16] [--fast-accum]
// Exit status 1 on a CUDA error; a scaling cuBLASLt does not support is reported and skipped.
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "experiments/cublas_host.h"
#include "experiments/fill.cuh"
#include "experiments/host.h"

namespace {

struct Shape {
  const char* name;
  int n, k;
};
constexpr Shape kShapes[] = {{"qkvg", 9216, 3072}, {"wo", 3072, 3072}, {"w12", 16384, 3072}, {"w3", 3072, 8192}};
constexpr float kE4M3Max = 448.f;

struct Opts {
  std::vector<int> M = {1280, 8192, 16384};
  std::string only, modes = "tensor,row,block";
  int calls = 10, reps = 20, check_rows = 16;
  bool fast_accum = false;
};

// ---- quantisers ----------------------------------------------------------------------------------
// x is row-major [rows, cols] (cols = k, the reduction dim). Scales hold s = amax/448 of their group.

__device__ inline float group_scale(float amax) { return amax > 0.f ? amax / kE4M3Max : 1.f; }

// One block per group of `gr` rows × `gc` columns; writes the group's scale to sc[sidx(gr_i, gc_j)]
// and its quantised values. sidx: the scale grid's order, given as strides (row-group, col-group).
__global__ void quantise_groups(const __nv_bfloat16* x, int rows, int cols, int gr, int gc, long s_rg, long s_cg,
                                float* sc, __nv_fp8_e4m3* q) {
  const int rg = blockIdx.y, cg = blockIdx.x;
  const int r0 = rg * gr, c0 = cg * gc, r1 = min(rows, r0 + gr), c1 = min(cols, c0 + gc);
  const long n = static_cast<long>(r1 - r0) * (c1 - c0);
  float amax = 0.f;
  for (long i = threadIdx.x; i < n; i += blockDim.x) {
    const int r = r0 + static_cast<int>(i / (c1 - c0)), c = c0 + static_cast<int>(i % (c1 - c0));
    amax = fmaxf(amax, fabsf(__bfloat162float(x[static_cast<long>(r) * cols + c])));
  }
  __shared__ float red[256];
  red[threadIdx.x] = amax;
  __syncthreads();
  for (int w = blockDim.x / 2; w > 0; w >>= 1) {
    if (static_cast<int>(threadIdx.x) < w) red[threadIdx.x] = fmaxf(red[threadIdx.x], red[threadIdx.x + w]);
    __syncthreads();
  }
  const float s = group_scale(red[0]);
  if (threadIdx.x == 0) sc[rg * s_rg + cg * s_cg] = s;
  const float inv = 1.f / s;
  for (long i = threadIdx.x; i < n; i += blockDim.x) {
    const int r = r0 + static_cast<int>(i / (c1 - c0)), c = c0 + static_cast<int>(i % (c1 - c0));
    const long o = static_cast<long>(r) * cols + c;
    q[o] = __nv_fp8_e4m3(fminf(fmaxf(__bfloat162float(x[o]) * inv, -kE4M3Max), kE4M3Max));
  }
}

// The groups of a scaling, the grid's size and its strides.
struct Grouping {
  int gr, gc;        // rows, cols per group (a whole dimension: its size)
  long s_rg, s_cg;   // scale index = row-group · s_rg + col-group · s_cg
  long count;        // scales
};
Grouping grouping(int rows, int cols, int gr, int gc, bool col_groups_fastest) {
  Grouping g{gr, gc, 0, 0, 0};
  const long nrg = (rows + gr - 1) / gr, ncg = (cols + gc - 1) / gc;
  g.count = nrg * ncg;
  if (col_groups_fastest) g.s_rg = ncg, g.s_cg = 1;
  else g.s_rg = 1, g.s_cg = nrg;
  return g;
}

void quantise(const __nv_bfloat16* x, int rows, int cols, const Grouping& g, float* sc, __nv_fp8_e4m3* q,
              cudaStream_t st) {
  dim3 grid((cols + g.gc - 1) / g.gc, (rows + g.gr - 1) / g.gr);
  quantise_groups<<<grid, 256, 0, st>>>(x, rows, cols, g.gr, g.gc, g.s_rg, g.s_cg, sc, q);
  CK(cudaGetLastError());
}

// X with outlier channels: x[m, c] = u · (c % 97 == 0 ? 8 : 1).
__global__ void fill_activations(__nv_bfloat16* p, int M, int k, uint64_t seed) {
  for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < static_cast<long>(M) * k;
       i += (long)gridDim.x * blockDim.x) {
    const int c = static_cast<int>(i % k);
    p[i] = __float2bfloat16_rn(experiments::hash_unit(static_cast<uint64_t>(i) + seed) * (c % 97 == 0 ? 8.f : 1.f));
  }
}

// ---- cuBLASLt -------------------------------------------------------------------------------------

// Yᵀ[n, M] = scale_w·scale_x · (W'ᵀ · X') column-major, W' [k, n] and X' [k, M] e4m3 (cublas_host.h's
// TN layout); `why` says why cuBLASLt has no algorithm for it (g.cands empty).
struct Fp8Gemm {
  experiments::TnGemm g;
  std::string why;
};
Fp8Gemm fp8_gemm_create(cublasLtHandle_t lt, int M, int n, int k, cublasLtMatmulMatrixScale_t mode_w,
                        cublasLtMatmulMatrixScale_t mode_x, const float* scale_w, const float* scale_x, uint64_t ws,
                        bool fast_accum) {
  Fp8Gemm f;
  cublasLtMatmulDesc_t d = experiments::tn_gemm_desc();
  CKB(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &scale_w, sizeof scale_w));
  CKB(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &scale_x, sizeof scale_x));
  const int32_t mw = mode_w, mx = mode_x;
  CKB(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &mw, sizeof mw));
  CKB(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mx, sizeof mx));
  const int8_t fa = fast_accum ? 1 : 0;
  CKB(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fa, sizeof fa));
  f.g.desc = d;
  const cublasStatus_t s = experiments::tn_gemm_plan(lt, f.g, M, n, k, CUDA_R_8F_E4M3, CUDA_R_16BF, ws, 1, true);
  if (f.g.cands.empty()) f.why = s == CUBLAS_STATUS_SUCCESS ? "no algorithm" : cublasLtGetStatusName(s);
  return f;
}

// A graph of `calls` calls of f.
template <typename F>
cudaGraphExec_t capture(cudaStream_t st, int calls, F f) {
  cudaGraph_t g;
  cudaGraphExec_t e;
  CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < calls; ++i) f();
  CK(cudaStreamEndCapture(st, &g));
  CK(cudaGraphInstantiate(&e, g, 0));
  CK(cudaGraphDestroy(g));
  return e;
}

// ---- host references ------------------------------------------------------------------------------

float fp8_to_float(__nv_fp8_e4m3 v) { return static_cast<float>(v); }

struct Err {
  double vs_q = 0, vs_bf16 = 0;
};

// Relative RMS errors of y (bf16 [M, n]) on rows [0, rows) × columns c·stride (up to 2,048 columns).
Err check(const std::vector<uint16_t>& y, const std::vector<uint16_t>& x, const std::vector<uint16_t>& w,
          const std::vector<__nv_fp8_e4m3>& xq, const std::vector<__nv_fp8_e4m3>& wq,
          const std::vector<float>& xs, const std::vector<float>& ws, const Grouping& gx, const Grouping& gw, int M,
          int n, int k, int rows) {
  const int stride = std::max(1, n / 2048);
  double e_q = 0, n_q = 0, e_b = 0, n_b = 0;
  for (int m = 0; m < std::min(rows, M); ++m)
    for (int c = 0; c < n; c += stride) {
      double dq = 0, db = 0;
      for (int j = 0; j < k; ++j) {
        const double sx = xs[(m / gx.gr) * gx.s_rg + (j / gx.gc) * gx.s_cg];
        const double sw = ws[(c / gw.gr) * gw.s_rg + (j / gw.gc) * gw.s_cg];
        dq += sx * fp8_to_float(xq[static_cast<size_t>(m) * k + j]) * sw * fp8_to_float(wq[static_cast<size_t>(c) * k + j]);
        db += static_cast<double>(experiments::bf2f(x[static_cast<size_t>(m) * k + j])) *
              experiments::bf2f(w[static_cast<size_t>(c) * k + j]);
      }
      const double got = experiments::bf2f(y[static_cast<size_t>(m) * n + c]);
      e_q += (got - dq) * (got - dq), n_q += dq * dq;
      e_b += (got - db) * (got - db), n_b += db * db;
    }
  return {std::sqrt(e_q / std::max(n_q, 1e-300)), std::sqrt(e_b / std::max(n_b, 1e-300))};
}

template <typename T>
std::vector<T> down(const T* d, size_t n) {
  std::vector<T> h(n);
  CK(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}

// A scaling as run: the modes given to cuBLASLt and the grouping of each operand.
struct Variant {
  std::string name;
  cublasLtMatmulMatrixScale_t mode_w, mode_x;
  Grouping gw, gx;
};

std::vector<Variant> variants(const std::string& mode, int M, int n, int k) {
  std::vector<Variant> v;
  if (mode == "tensor")
    v.push_back({"tensor", CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F, CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F,
                 grouping(n, k, n, k, true), grouping(M, k, M, k, true)});
  if (mode == "row")
    v.push_back({"row", CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F, CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F,
                 grouping(n, k, 1, k, true), grouping(M, k, 1, k, true)});
  if (mode == "block")
    for (bool w_kfast : {true, false})
      for (bool x_kfast : {true, false})
        v.push_back({std::string("block w:") + (w_kfast ? "k" : "n") + "-fast x:" + (x_kfast ? "k" : "m") + "-fast",
                     CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F, CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F,
                     grouping(n, k, 128, 128, w_kfast), grouping(M, k, 1, 128, x_kfast)});
  return v;
}

int run(const Opts& o) {
  cudaStream_t st;
  CK(cudaStreamCreate(&st));
  cublasLtHandle_t lt;
  CKB(cublasLtCreate(&lt));
  const uint64_t ws_bytes = 32ull << 20;
  void* ws = nullptr;
  CK(cudaMalloc(&ws, ws_bytes));
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("experiment_gemm_fp8 on %s, cuBLASLt %zu, fast accumulation %s\n", prop.name, cublasLtGetVersion(),
              o.fast_accum ? "on" : "off");
  const std::vector<std::string> only = experiments::split_list(o.only), modes = experiments::split_list(o.modes);
  for (const Shape& sh : kShapes) {
    if (!only.empty() && std::find(only.begin(), only.end(), sh.name) == only.end()) continue;
    for (int M : o.M) {
      const int n = sh.n, k = sh.k;
      __nv_bfloat16 *x, *w, *y, *yb;
      __nv_fp8_e4m3 *xq, *wq;
      float *xs, *wsc;
      CK(cudaMalloc(&x, sizeof(__nv_bfloat16) * M * k));
      CK(cudaMalloc(&w, sizeof(__nv_bfloat16) * n * k));
      CK(cudaMalloc(&y, sizeof(__nv_bfloat16) * M * n));
      CK(cudaMalloc(&yb, sizeof(__nv_bfloat16) * M * n));
      CK(cudaMalloc(&xq, static_cast<size_t>(M) * k));
      CK(cudaMalloc(&wq, static_cast<size_t>(n) * k));
      CK(cudaMalloc(&xs, sizeof(float) * (static_cast<size_t>(M) * ((k + 127) / 128) + 1)));
      CK(cudaMalloc(&wsc, sizeof(float) * (static_cast<size_t>(n) * ((k + 127) / 128) + 1)));
      fill_activations<<<1024, 256, 0, st>>>(x, M, k, 11);
      experiments::fill_bf16<<<1024, 256, 0, st>>>(w, static_cast<uint64_t>(n) * k, 977, 0.02f);
      CK(cudaGetLastError());
      const std::vector<uint16_t> hx = down(reinterpret_cast<uint16_t*>(x), static_cast<size_t>(M) * k);
      const std::vector<uint16_t> hw = down(reinterpret_cast<uint16_t*>(w), static_cast<size_t>(n) * k);

      // The bf16 gemm as production runs it: the baseline.
      experiments::TnGemm gb = experiments::tn_gemm_create(lt, M, n, k, CUDA_R_16BF, ws_bytes, 1);
      const float one = 1.f, zero = 0.f;
      cudaGraphExec_t g_bf16 = capture(st, o.calls, [&] {
        CKB(cublasLtMatmul(lt, gb.desc, &one, w, gb.lw, x, gb.lx, &zero, yb, gb.ly, yb, gb.ly, &gb.cands[0].algo, ws,
                           ws_bytes, st));
      });
      const double flops = 2.0 * M * n * k;
      for (const std::string& mode : modes)
        for (const Variant& v : variants(mode, M, n, k)) {
          // The quantisers alone, timed as a graph of both operands (W would be quantised once
          // per optimizer step in training, X every call).
          cudaGraphExec_t g_q = capture(st, 1, [&] {
            quantise(w, n, k, v.gw, wsc, wq, st);
            quantise(x, M, k, v.gx, xs, xq, st);
          });
          CK(cudaGraphLaunch(g_q, st));
          CK(cudaStreamSynchronize(st));
          Fp8Gemm g = fp8_gemm_create(lt, M, n, k, v.mode_w, v.mode_x, wsc, xs, ws_bytes, o.fast_accum);
          if (g.g.cands.empty()) {
            std::printf("%-5s M %5d  %-26s unsupported: %s\n", sh.name, M, v.name.c_str(), g.why.c_str());
            experiments::tn_gemm_destroy(g.g);
            CK(cudaGraphExecDestroy(g_q));
            continue;
          }
          cudaGraphExec_t g_f = capture(st, o.calls, [&] {
            CKB(cublasLtMatmul(lt, g.g.desc, &one, wq, g.g.lw, xq, g.g.lx, &zero, y, g.g.ly, y, g.g.ly, &g.g.cands[0].algo,
                               ws, ws_bytes, st));
          });
          const auto ms = experiments::time_graphs_interleaved({g_bf16, g_f, g_q}, st, o.reps, o.calls);
          const double t_b = experiments::median(ms[0]), t_f = experiments::median(ms[1]);
          const double t_q = experiments::median(ms[2]) * o.calls;  // g_q holds one quantisation
          const Err e = check(down(reinterpret_cast<uint16_t*>(y), static_cast<size_t>(M) * n), hx, hw,
                              down(xq, static_cast<size_t>(M) * k), down(wq, static_cast<size_t>(n) * k),
                              down(xs, static_cast<size_t>(v.gx.count)), down(wsc, static_cast<size_t>(v.gw.count)),
                              v.gx, v.gw, M, n, k, o.check_rows);
          std::printf("%-5s M %5d  %-26s fp8 %.4f ms %6.1f TFLOP/s  bf16 %.4f ms %6.1f TFLOP/s  x%.2f  "
                      "quantise %.4f ms  err vs_q %.2e vs_bf16 %.2e\n",
                      sh.name, M, v.name.c_str(), t_f, flops / t_f * 1e-9, t_b, flops / t_b * 1e-9, t_b / t_f, t_q,
                      e.vs_q, e.vs_bf16);
          std::fflush(stdout);
          CK(cudaGraphExecDestroy(g_f));
          CK(cudaGraphExecDestroy(g_q));
          experiments::tn_gemm_destroy(g.g);
        }
      CK(cudaGraphExecDestroy(g_bf16));
      experiments::tn_gemm_destroy(gb);
      for (void* p : {static_cast<void*>(x), static_cast<void*>(w), static_cast<void*>(y), static_cast<void*>(yb),
                      static_cast<void*>(xq), static_cast<void*>(wq), static_cast<void*>(xs), static_cast<void*>(wsc)})
        CK(cudaFree(p));
    }
  }
  CK(cudaFree(ws));
  CKB(cublasLtDestroy(lt));
  CK(cudaStreamDestroy(st));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Opts o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--M") {
      o.M.clear();
      for (const std::string& s : experiments::split_list(next())) o.M.push_back(std::atoi(s.c_str()));
    } else if (a == "--only") o.only = next();
    else if (a == "--modes") o.modes = next();
    else if (a == "--calls") o.calls = std::atoi(next().c_str());
    else if (a == "--reps") o.reps = std::atoi(next().c_str());
    else if (a == "--check-rows") o.check_rows = std::atoi(next().c_str());
    else if (a == "--fast-accum") o.fast_accum = true;
    else {
      std::fprintf(stderr, "unknown option %s\n", a.c_str());
      return 2;
    }
  }
  if (o.M.empty() || o.calls < 1 || o.reps < 1 || o.check_rows < 1) {
    std::fprintf(stderr, "--M, --calls, --reps and --check-rows must be positive\n");
    return 2;
  }
  return run(o);
}
