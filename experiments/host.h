// Host helpers shared by the kernel experiments (experiments/*/*.cu): a check macro for CUDA calls,
// BF16 ⇄ F32 conversions (core/dtype.h's, round to nearest even) and the timings' median. Header-only: each experiment builds
// with nvcc alone.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "core/dtype.h"

#define CK(x)                                                                                  \
  do {                                                                                         \
    cudaError_t e_ = (x);                                                                      \
    if (e_ != cudaSuccess) {                                                                   \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                            \
    }                                                                                          \
  } while (0)

namespace experiments {

// The project's BF16 conversions (core/dtype.h is header-only for these).
inline uint16_t f2bf(float f) { return laplace::float_to_bf16(f); }
inline float bf2f(uint16_t h) { return laplace::bf16_to_float(h); }

// "a,b,c" -> {"a", "b", "c"} (empty items dropped): the experiments' list options.
inline std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  for (size_t p = 0; p <= s.size();) {
    size_t e = s.find(',', p);
    if (e == std::string::npos) e = s.size();
    if (e > p) out.push_back(s.substr(p, e - p));
    p = e + 1;
  }
  return out;
}

// The upper median of an experiment's timings (v.size() / 2 after sorting).
inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Times CUDA graphs against each other: `rounds` rounds, each replaying every graph once on
// `st`, the starting graph rotating, so that the card's clock drifting under load (±5 % over
// seconds) falls on all graphs alike rather than on whichever ran last. Returns, per graph, the
// ms of each replay divided by `calls_per_graph` (ms per call).
inline std::vector<std::vector<double>> time_graphs_interleaved(const std::vector<cudaGraphExec_t>& graphs,
                                                                cudaStream_t st, int rounds, int calls_per_graph) {
  std::vector<std::vector<double>> ms(graphs.size());
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  const size_t n = graphs.size();
  for (int r = 0; r < rounds; ++r)
    for (size_t j = 0; j < n; ++j) {
      const size_t g = (j + static_cast<size_t>(r)) % n;
      CK(cudaEventRecord(e0, st));
      CK(cudaGraphLaunch(graphs[g], st));
      CK(cudaEventRecord(e1, st));
      CK(cudaEventSynchronize(e1));
      float t = 0;
      CK(cudaEventElapsedTime(&t, e0, e1));
      ms[g].push_back(t / calls_per_graph);
    }
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  return ms;
}

}  // namespace experiments
