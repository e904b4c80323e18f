// experiments/decode/stream: how fast can a deferred decode step's pending step read BF16 states?
// The production kernel (ops/cuda/kernels_gla_decode.cu) gives each (slot, head) a block that brings
// its state [dk, dv] into shared memory by bulk copies and then computes; a block's copies are in
// flight only before its computation, and its SM's other blocks start in step with it. Here the
// pending step's core alone, o[e] = Σ_i q̃[i]·S[i][e] over BF16 S, in two shapes:
//   v1  one block per (slot, head), as production: G bulk copies (one per row group, each on its
//       own barrier), then the product; --pad adds dynamic shared memory so that as few blocks fit
//       per SM as production's (its pairs and staging take ~19 KB beside the state)
//   v2  persistent blocks (--per-sm per SM), each walking (slot, head) items with two state
//       buffers: the next item's copies are issued before the current item is computed, so an SM's
//       memory pipe always has a state in flight
// Both compute each o[e] in the same order (one thread per column e, rows in order), so their
// outputs must be equal byte for byte; sampled items are checked against an F64 product
// (relative RMS ≤ 1e-5). Exit status 1 on a mismatch.
//
//   nvcc -O3 -std=c++17 -I. -gencode=arch=compute_90a,code=sm_90a -o experiment_decode_stream experiments/decode/stream.cu
//   ./experiment_decode_stream [--items 20480] [--per-sm 2] [--pad 18432] [--calls 10] [--rounds 15]
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "experiments/host.h"
#include "ops/cuda/bulk_copy.cuh"

namespace {

namespace cu = laplace::cuda;
using bf16 = __nv_bfloat16;

constexpr int DK = 96, DV = 192, G = 4;  // laplace-3b's head; G row groups, one copy each
constexpr int kRowsG = DK / G;
constexpr uint32_t kStateBytes = DK * DV * 2, kPieceBytes = kStateBytes / G;
static_assert(kPieceBytes % 16 == 0, "bulk copies move multiples of 16 bytes");

// o[e] for the state in sS (thread e owns column e): the rows in order, group by group, each
// group once its copy has landed.
__device__ __forceinline__ void product(const bf16* sS, const float* q, uint64_t* bar, uint32_t parity, float* o) {
  const int e = threadIdx.x;
  float acc = 0.f;
#pragma unroll 1
  for (int g = 0; g < G; ++g) {
    cu::mbar_wait(&bar[g], parity);
#pragma unroll 8
    for (int i = g * kRowsG; i < (g + 1) * kRowsG; ++i) acc = fmaf(q[i], __bfloat162float(sS[i * DV + e]), acc);
  }
  o[e] = acc;
}

__device__ __forceinline__ void issue(const bf16* src, bf16* dst, uint64_t* bar) {
#pragma unroll
  for (int g = 0; g < G; ++g) {
    cu::mbar_arrive_expect_tx(&bar[g], kPieceBytes);
    cu::bulk_g2s(dst + g * kRowsG * DV, src + g * kRowsG * DV, kPieceBytes, &bar[g]);
  }
}

// v1: block = item.
__global__ void __launch_bounds__(DV) stream_v1(const bf16* S, const float* q, float* o) {
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* sS = reinterpret_cast<bf16*>(smem);
  __shared__ uint64_t bar[G];
  __shared__ float qs[DK];
  const int64_t item = blockIdx.x;
  if (threadIdx.x == 0) {
    for (int g = 0; g < G; ++g) cu::mbar_init(&bar[g], 1);
    cu::fence_barrier_init();
    issue(S + item * DK * DV, sS, bar);
  }
  if (threadIdx.x < DK) qs[threadIdx.x] = q[item * DK + threadIdx.x];
  __syncthreads();
  product(sS, qs, bar, 0, o + item * DV);
}

// v2: persistent, two buffers; item n of this block uses buffer n & 1, whose barriers complete
// their (n >> 1)-th phase for it.
__global__ void __launch_bounds__(DV) stream_v2(const bf16* S, const float* q, float* o, int64_t items) {
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* buf[2] = {reinterpret_cast<bf16*>(smem), reinterpret_cast<bf16*>(smem + kStateBytes)};
  __shared__ uint64_t bar[2][G];
  __shared__ float qs[2][DK];
  int64_t item = blockIdx.x;
  if (item >= items) return;
  if (threadIdx.x == 0) {
    for (int b = 0; b < 2; ++b)
      for (int g = 0; g < G; ++g) cu::mbar_init(&bar[b][g], 1);
    cu::fence_barrier_init();
    issue(S + item * DK * DV, buf[0], bar[0]);
  }
  if (threadIdx.x < DK) qs[0][threadIdx.x] = q[item * DK + threadIdx.x];
  __syncthreads();
  for (int64_t n = 0; item < items; ++n, item += gridDim.x) {
    const int cur = static_cast<int>(n & 1), nxt = cur ^ 1;
    const int64_t next = item + gridDim.x;
    // The other buffer was last read by item n − 1, which every thread finished before the
    // barrier at the end of the previous iteration.
    if (next < items) {
      if (threadIdx.x == 0) {
        cu::fence_proxy_async();
        issue(S + next * DK * DV, buf[nxt], bar[nxt]);
      }
      if (threadIdx.x < DK) qs[nxt][threadIdx.x] = q[next * DK + threadIdx.x];
    }
    product(buf[cur], qs[cur], bar[cur], static_cast<uint32_t>((n >> 1) & 1), o + item * DV);
    __syncthreads();
  }
}

}  // namespace

int main(int argc, char** argv) {
  int64_t items = 1280 * 16;
  int per_sm = 2, pad = 18432, calls = 10, rounds = 15;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    const long long v = std::atoll(argv[i + 1]);
    if (k == "--items") items = v;
    else if (k == "--per-sm") per_sm = static_cast<int>(v);
    else if (k == "--pad") pad = static_cast<int>(v);
    else if (k == "--calls") calls = static_cast<int>(v);
    else if (k == "--rounds") rounds = static_cast<int>(v);
    else {
      std::fprintf(stderr, "usage: experiment_decode_stream [--items N] [--per-sm 2] [--pad BYTES] [--calls 10] [--rounds 15]\n");
      return 2;
    }
  }
  if (items < 1 || per_sm < 1 || pad < 0 || calls < 1 || rounds < 1) {
    std::fprintf(stderr, "experiment_decode_stream: positive counts, pad >= 0\n");
    return 2;
  }
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  const size_t sbytes = static_cast<size_t>(items) * kStateBytes;
  std::printf("%s: %lld BF16 states of [%d, %d] (%.3f GB), v1 with %d bytes of padding, v2 with %d blocks per SM\n",
              prop.name, (long long)items, DK, DV, sbytes / 1e9, pad, per_sm);

  // States and q̃ from a fixed generator; BF16 states in [-1, 1), q̃ in [-0.1, 0.1).
  std::vector<uint16_t> hS(static_cast<size_t>(items) * DK * DV);
  std::vector<float> hq(static_cast<size_t>(items) * DK);
  uint64_t x = 88172645463325252ull;
  auto next = [&] {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    return static_cast<float>((x >> 11) * 0x1.0p-53);
  };
  for (auto& s : hS) s = experiments::f2bf(2.f * next() - 1.f);
  for (auto& v : hq) v = 0.2f * next() - 0.1f;
  bf16* S;
  float *q, *o1, *o2;
  CK(cudaMalloc(&S, sbytes));
  CK(cudaMalloc(&q, hq.size() * 4));
  CK(cudaMalloc(&o1, static_cast<size_t>(items) * DV * 4));
  CK(cudaMalloc(&o2, static_cast<size_t>(items) * DV * 4));
  CK(cudaMemcpy(S, hS.data(), sbytes, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(q, hq.data(), hq.size() * 4, cudaMemcpyHostToDevice));

  const int smem1 = static_cast<int>(kStateBytes) + pad, smem2 = 2 * static_cast<int>(kStateBytes);
  CK(cudaFuncSetAttribute(stream_v1, cudaFuncAttributeMaxDynamicSharedMemorySize, smem1));
  CK(cudaFuncSetAttribute(stream_v2, cudaFuncAttributeMaxDynamicSharedMemorySize, smem2));
  CK(cudaFuncSetAttribute(stream_v1, cudaFuncAttributePreferredSharedMemoryCarveout, 100));
  CK(cudaFuncSetAttribute(stream_v2, cudaFuncAttributePreferredSharedMemoryCarveout, 100));
  int fit1 = 0, fit2 = 0;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fit1, stream_v1, DV, smem1));
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fit2, stream_v2, DV, smem2));
  const int grid2 = prop.multiProcessorCount * std::min(per_sm, fit2);
  std::printf("blocks per SM: v1 %d, v2 %d (asked %d)\n", fit1, fit2, per_sm);
  if (fit2 < 1) return 1;

  cudaStream_t st;
  CK(cudaStreamCreate(&st));
  auto run1 = [&](cudaStream_t s) { stream_v1<<<static_cast<unsigned>(items), DV, smem1, s>>>(S, q, o1); };
  auto run2 = [&](cudaStream_t s) { stream_v2<<<static_cast<unsigned>(grid2), DV, smem2, s>>>(S, q, o2, items); };
  run1(st);
  run2(st);
  CK(cudaStreamSynchronize(st));
  CK(cudaGetLastError());

  // Checks: equal bytes, and sampled items against F64.
  std::vector<float> h1(static_cast<size_t>(items) * DV), h2(h1.size());
  CK(cudaMemcpy(h1.data(), o1, h1.size() * 4, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(h2.data(), o2, h2.size() * 4, cudaMemcpyDeviceToHost));
  int bad = std::memcmp(h1.data(), h2.data(), h1.size() * 4) != 0;
  if (bad) std::printf("v1 and v2 outputs differ\n");
  double e2 = 0, r2 = 0;
  for (int64_t it = 0; it < items; it += std::max<int64_t>(1, items / 64))
    for (int e = 0; e < DV; ++e) {
      double want = 0;
      for (int i = 0; i < DK; ++i)
        want += static_cast<double>(hq[it * DK + i]) * experiments::bf2f(hS[(it * DK + i) * DV + e]);
      const double d = h1[it * DV + e] - want;
      e2 += d * d, r2 += want * want;
    }
  const double rel = std::sqrt(e2 / r2);
  std::printf("o vs F64: relative RMS %.2e\n", rel);
  if (!(rel <= 1e-5)) bad = 1;

  std::vector<cudaGraphExec_t> graphs;
  for (int v = 0; v < 2; ++v) {
    cudaGraph_t g;
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    for (int c = 0; c < calls; ++c) {
      if (v == 0) run1(st);
      else run2(st);
    }
    CK(cudaStreamEndCapture(st, &g));
    cudaGraphExec_t ge;
    CK(cudaGraphInstantiate(&ge, g, 0));
    CK(cudaGraphDestroy(g));
    graphs.push_back(ge);
  }
  const auto ms = experiments::time_graphs_interleaved(graphs, st, rounds, calls);
  const char* names[] = {"v1 block per (slot, head)", "v2 persistent, two buffers"};
  for (int v = 0; v < 2; ++v) {
    const double m = experiments::median(ms[v]);
    std::printf("  %-28s %.4f ms per layer-step  %.2f TB/s of states read\n", names[v], m, sbytes / (m * 1e9));
    CK(cudaGraphExecDestroy(graphs[v]));
  }
  CK(cudaFree(S));
  CK(cudaFree(q));
  CK(cudaFree(o1));
  CK(cudaFree(o2));
  CK(cudaStreamDestroy(st));
  return bad;
}
