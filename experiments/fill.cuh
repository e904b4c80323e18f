// Device-side input generation shared by the gemm experiments: a counter-based hash (splitmix64's
// finaliser) gives every element its own value in [-1, 1), so inputs are random-looking, never
// zero, and the same on every run and device. Header-only, for nvcc.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace experiments {

__device__ inline float hash_unit(uint64_t i) {  // in [-1, 1)
  uint64_t z = i * 0x9e3779b97f4a7c15ULL + 0x632be59bd9b4e019ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  z ^= z >> 31;
  return static_cast<float>(static_cast<uint32_t>(z >> 40)) * 0x1p-23f - 1.0f;
}

// p[i] = bf16(scale · hash_unit(i + seed)), i < n.
__global__ void fill_bf16(__nv_bfloat16* p, uint64_t n, uint64_t seed, float scale) {
  for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n; i += (uint64_t)gridDim.x * blockDim.x)
    p[i] = __float2bfloat16_rn(scale * hash_unit(i + seed));
}

}  // namespace experiments
