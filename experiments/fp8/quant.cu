// experiments/fp8/quant: a training step's dY quantised per row and per column in one call
// (Backend::quantize_rows_cols_e4m3) — the production passes (ops/cuda/fp8_quant.cuh, v1) against
// the two apart (v2) and variants of the codes pass, at laplace-3b's dY shapes, BF16.
// Standalone: nvcc only.
//
//   nvcc -O3 -std=c++17 -I. --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a \
//     -o experiment_fp8_quant experiments/fp8/quant.cu
//   ./experiment_fp8_quant [--shapes 16384x9216,16384x3072,16384x16384] [--calls 10] [--rounds 15]
//
// Variants:
//   v1  production: column maxima with the row maxima, then column codes with the row codes, the
//       tile's row reciprocals staged in shared memory, four blocks per SM
//   v2  the two apart: the row quantiser, then the column passes alone
//   v3  v1's codes kernel as it was before the staging: each thread divides once per row it
//       writes part of, registers unbounded (three blocks per SM)
//   v4  v1 with __launch_bounds__(256, 5): five blocks per SM
// Every variant's codes and scales must equal v1's byte for byte (v1's equal the CPU backend's:
// CudaOps.Fp8QuantizeColsAtTrainingShapes); a mismatch ends the run with exit status 1.
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

// v3/v4: column_codes_kernel<bf16, 8, true> with its row reciprocals staged (kStaged, as
// production) or divided per row in each thread, at kMinBlocks blocks per SM.
template <int kMinBlocks, bool kStaged>
__global__ void __launch_bounds__(256, kMinBlocks)
    codes_variant(const bf16* x, int64_t ld, int64_t rows, int64_t cols, const unsigned* amax,
                  __nv_fp8_storage_t* qt, bool words, const unsigned* row_amax, __nv_fp8_storage_t* q) {
  constexpr int kRowsT = fq::kColRows, kWords = fq::kColWords;
  __shared__ uint32_t tile[32 * V * kWords];
  __shared__ float rinv[kRowsT];
  const int tx = threadIdx.x, ty = threadIdx.y, t = ty * 32 + tx;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * 32 * V, c = c0 + tx * V;
  float inv[V];
#pragma unroll
  for (int j = 0; j < V; ++j) inv[j] = 1.f / fq::scale_of(c + j < cols ? __uint_as_float(amax[c + j]) : 0.f);
  for (int64_t r0 = static_cast<int64_t>(blockIdx.y) * kRowsT; r0 < rows;
       r0 += static_cast<int64_t>(gridDim.y) * kRowsT) {
    if (kStaged) {
      if (t < kRowsT) rinv[t] = r0 + t < rows ? 1.f / fq::scale_of(__uint_as_float(row_amax[r0 + t])) : 0.f;
      __syncthreads();
    }
    for (int w = ty; w < kWords; w += 8) {
      uint32_t packed[V] = {};
#pragma unroll
      for (int k = 0; k < 4; k += 2) {
        const int64_t r = r0 + 4 * w + k;
        const bool in0 = r < rows && c < cols, in1 = r + 1 < rows && c < cols;
        float f0[V] = {}, f1[V] = {};
        if (in0) fq::load_vec<bf16, V>(x + r * ld + c, f0);
        if (in1) fq::load_vec<bf16, V>(x + (r + 1) * ld + c, f1);
#pragma unroll
        for (int j = 0; j < V; ++j) packed[j] |= fq::e4m3x2(f0[j], inv[j], f1[j], inv[j]) << (8 * k);
        const auto row_inv = [&](int64_t rr) {
          return kStaged ? rinv[rr - r0] : 1.f / fq::scale_of(__uint_as_float(row_amax[rr]));
        };
        if (in0) fq::store_row_codes<V>(f0, row_inv(r), q + r * cols + c);
        if (in1) fq::store_row_codes<V>(f1, row_inv(r + 1), q + (r + 1) * cols + c);
      }
#pragma unroll
      for (int j = 0; j < V; ++j) tile[(tx * V + j) * kWords + ((w + tx) & (kWords - 1))] = packed[j];
    }
    __syncthreads();
    const int64_t r = r0 + 4 * tx;
    for (int i = ty; i < 32 * V && c0 + i < cols; i += 8) {
      const uint32_t word = tile[i * kWords + ((tx + i / V) & (kWords - 1))];
      __nv_fp8_storage_t* dst = qt + (c0 + i) * rows + r;
      if (words && r + 3 < rows) {
        *reinterpret_cast<uint32_t*>(dst) = word;
      } else {
        for (int k = 0; k < 4 && r + k < rows; ++k) dst[k] = static_cast<__nv_fp8_storage_t>(word >> (8 * k));
      }
    }
    __syncthreads();
  }
}

// The production launch sequence (fq::launch_cols<bf16, 8, true>) with another codes kernel.
template <int kMinBlocks, bool kStaged>
void launch_variant(const bf16* x, int64_t R, int64_t C, __nv_fp8_storage_t* qt, float* st, __nv_fp8_storage_t* q,
                   float* s, cudaStream_t stream) {
  const dim3 block(32, 8);
  const dim3 grid(static_cast<unsigned>((C + 32 * V - 1) / (32 * V)),
                  static_cast<unsigned>(std::clamp<int64_t>((R + fq::kColRows - 1) / fq::kColRows, 1, 65535)));
  unsigned* amax = reinterpret_cast<unsigned*>(st);
  unsigned* row_amax = reinterpret_cast<unsigned*>(s);
  const bool words = R % 4 == 0 && reinterpret_cast<uintptr_t>(qt) % 4 == 0;
  CK(cudaMemsetAsync(st, 0, static_cast<size_t>(C) * sizeof(float), stream));
  CK(cudaMemsetAsync(s, 0, static_cast<size_t>(R) * sizeof(float), stream));
  fq::column_amax_kernel<bf16, V, true><<<grid, block, 0, stream>>>(x, C, R, C, amax, row_amax);
  codes_variant<kMinBlocks, kStaged><<<grid, block, 0, stream>>>(x, C, R, C, amax, qt, words, row_amax, q);
  fq::column_scales_kernel<<<static_cast<unsigned>((C + 255) / 256), 256, 0, stream>>>(st, C);
  fq::column_scales_kernel<<<static_cast<unsigned>((R + 255) / 256), 256, 0, stream>>>(s, R);
}

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
void v3(const bf16* x, int64_t R, int64_t C, const Out& o, cudaStream_t st) {
  launch_variant<1, false>(x, R, C, o.qt, o.st, o.q, o.s, st);
}
void v4(const bf16* x, int64_t R, int64_t C, const Out& o, cudaStream_t st) {
  launch_variant<5, true>(x, R, C, o.qt, o.st, o.q, o.s, st);
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
  const Variant variants[] = {v1, v2, v3, v4};
  const char* names[] = {"v1 production", "v2 rows, then columns", "v3 row divisions per thread",
                         "v4 v1, 5 blocks/SM"};
  constexpr int kN = 4;
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
