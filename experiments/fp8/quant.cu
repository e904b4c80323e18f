// experiments/fp8/quant: a training step's dY quantised per row and per column in one call
// (Backend::quantize_rows_cols_e4m3) — the production passes (ops/cuda/fp8_quant.cuh, v1) against
// the two apart (v2), at laplace-3b's dY shapes, BF16. Standalone: nvcc only.
//
//   nvcc -O3 -std=c++17 -I. --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a \
//     -o experiment_fp8_quant experiments/fp8/quant.cu
//   ./experiment_fp8_quant [--shapes 16384x9216,16384x3072,16384x16384] [--calls 10] [--rounds 15]
//
// Variants:
//   v1  production: column maxima with the row maxima, then column codes with the row codes
//   v2  the two apart: the row quantiser, then the column passes alone
// Variants of the codes kernel that lost to production (per-thread row divisions; a five-block
// bound) are in BENCHMARKS.md and git, not here. v2's codes and scales must equal v1's byte for
// byte (v1's equal the CPU backend's: CudaOps.Fp8QuantizeColsAtTrainingShapes); a mismatch ends
// the run with exit status 1.
// Speed: each variant's `calls` calls captured in one CUDA graph, the graphs replayed in rotating
// order `rounds` times (experiments/host.h); ms per call (median) and the bytes a call really moves
// (maxima pass: one read; codes pass: one read and both codes written) per second.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "experiments/host.h"
#include "ops/cuda/fp8_quant.cuh"

namespace {

namespace fq = laplace::cuda::fp8_quant;
using bf16 = __nv_bfloat16;
constexpr int V = 8;  // a thread's columns: one 16-byte load of BF16

struct Out {
  __nv_fp8_storage_t *q, *qt;
  float *s, *st;
};

using Variant = void (*)(const bf16* x, int64_t R, int64_t C, const Out& o, cudaStream_t st);

void v1(const bf16* x, int64_t R, int64_t C, const Out& o, cudaStream_t st) {
  fq::launch_cols<bf16, V, true>(x, C, R, C, o.qt, o.st, o.q, o.s, st);
}
void v2(const bf16* x, int64_t R, int64_t C, const Out& o, cudaStream_t st) {
  fq::launch_rows<bf16, V>(x, C, R, C, o.q, o.s, st);
  fq::launch_cols<bf16, V, false>(x, C, R, C, o.qt, o.st, nullptr, nullptr, st);
}

template <typename T>
std::vector<T> down(const T* d, size_t n) {
  std::vector<T> h(n);
  CK(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}

}  // namespace

int main(int argc, char** argv) {
  std::string shapes = "16384x9216,16384x3072,16384x16384";
  int calls = 10, rounds = 15;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    if (k == "--shapes") shapes = argv[i + 1];
    else if (k == "--calls") calls = std::atoi(argv[i + 1]);
    else if (k == "--rounds") rounds = std::atoi(argv[i + 1]);
    else {
      std::fprintf(stderr, "usage: experiment_fp8_quant [--shapes RxC,...] [--calls 10] [--rounds 15]\n");
      return 2;
    }
  }
  const Variant variants[] = {v1, v2};
  const char* names[] = {"v1 production", "v2 rows, then columns"};
  constexpr int kN = 2;
  cudaStream_t st;
  CK(cudaStreamCreate(&st));
  int bad = 0;
  for (const std::string& sh : experiments::split_list(shapes)) {
    const int64_t R = std::atoll(sh.c_str()), C = std::atoll(sh.c_str() + sh.find('x') + 1);
    // dY-like values: N(0, 1e-3) with an outlier column every 97 and an outlier row every 89.
    std::vector<uint16_t> hx(static_cast<size_t>(R * C));
    std::mt19937_64 rng(7);
    std::normal_distribution<float> n(0.f, 1e-3f);
    for (int64_t r = 0; r < R; ++r)
      for (int64_t c = 0; c < C; ++c)
        hx[r * C + c] = experiments::f2bf(n(rng) * (c % 97 == 0 ? 8.f : 1.f) * (r % 89 == 0 ? 4.f : 1.f));
    bf16* x;
    CK(cudaMalloc(&x, hx.size() * 2));
    CK(cudaMemcpy(x, hx.data(), hx.size() * 2, cudaMemcpyHostToDevice));
    Out o[kN];
    for (Out& a : o) {
      CK(cudaMalloc(&a.q, R * C));
      CK(cudaMalloc(&a.qt, R * C));
      CK(cudaMalloc(&a.s, R * 4));
      CK(cudaMalloc(&a.st, C * 4));
    }
    for (int v = 0; v < kN; ++v) variants[v](x, R, C, o[v], st);
    CK(cudaStreamSynchronize(st));
    const auto q1 = down(o[0].q, R * C), qt1 = down(o[0].qt, R * C);
    const auto s1 = down(o[0].s, R), st1 = down(o[0].st, C);
    for (int v = 1; v < kN; ++v) {
      const bool same = down(o[v].q, R * C) == q1 && down(o[v].qt, R * C) == qt1 &&
                        std::memcmp(down(o[v].s, R).data(), s1.data(), R * 4) == 0 &&
                        std::memcmp(down(o[v].st, C).data(), st1.data(), C * 4) == 0;
      if (!same) {
        std::printf("[%lld, %lld] %s: codes or scales differ from v1\n", (long long)R, (long long)C, names[v]);
        ++bad;
      }
    }
    std::vector<cudaGraphExec_t> graphs(kN);
    for (int v = 0; v < kN; ++v) {
      cudaGraph_t g;
      CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
      for (int i = 0; i < calls; ++i) variants[v](x, R, C, o[v], st);
      CK(cudaStreamEndCapture(st, &g));
      CK(cudaGraphInstantiate(&graphs[v], g, 0));
      CK(cudaGraphDestroy(g));
    }
    const auto ms = experiments::time_graphs_interleaved(graphs, st, rounds, calls);
    const double bytes = 2.0 * R * C * 2 + 2.0 * R * C;  // dY read twice (BF16), both codes written once
    std::printf("dY [%lld, %lld], bf16, %d calls per graph, %d rounds:\n", (long long)R, (long long)C, calls, rounds);
    for (int v = 0; v < kN; ++v) {
      const double m = experiments::median(ms[v]);
      std::printf("  %-28s %.4f ms  %6.0f GB/s moved\n", names[v], m, bytes / (m * 1e6));
      CK(cudaGraphExecDestroy(graphs[v]));
    }
    for (Out& a : o) {
      CK(cudaFree(a.q));
      CK(cudaFree(a.qt));
      CK(cudaFree(a.s));
      CK(cudaFree(a.st));
    }
    CK(cudaFree(x));
  }
  CK(cudaStreamDestroy(st));
  return bad ? 1 : 0;
}
