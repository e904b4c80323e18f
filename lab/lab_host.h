// Host helpers shared by the kernel labs (lab/*/…_lab.cu): a check macro for CUDA calls,
// BF16 ⇄ F32 conversions (core/dtype.h's, round to nearest even) and the timings' median. Header-only: each lab builds
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

#include "../core/dtype.h"

#define CK(x)                                                                                  \
  do {                                                                                         \
    cudaError_t e_ = (x);                                                                      \
    if (e_ != cudaSuccess) {                                                                   \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                            \
    }                                                                                          \
  } while (0)

namespace lab {

// The project's BF16 conversions (core/dtype.h is header-only for these).
inline uint16_t f2bf(float f) { return laplace::float_to_bf16(f); }
inline float bf2f(uint16_t h) { return laplace::bf16_to_float(h); }

// "a,b,c" -> {"a", "b", "c"} (empty items dropped): the labs' list options.
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

// The upper median of a lab's timings (v.size() / 2 after sorting).
inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace lab
