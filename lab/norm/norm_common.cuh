// Shared helpers of the lab/norm versions (BF16 rows, 8 columns per 16-byte access).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace norm_lab {

__device__ __forceinline__ void ld8(const __nv_bfloat16* p, int64_t i, float (&v)[8]) {
  const uint4 q = *reinterpret_cast<const uint4*>(p + i);
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&q);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float2 f = __bfloat1622float2(h[k]);
    v[2 * k] = f.x;
    v[2 * k + 1] = f.y;
  }
}

__device__ __forceinline__ void st8(__nv_bfloat16* p, int64_t i, const float (&v)[8]) {
  uint4 q;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&q);
#pragma unroll
  for (int k = 0; k < 4; ++k) h[k] = __floats2bfloat162_rn(v[2 * k], v[2 * k + 1]);
  *reinterpret_cast<uint4*>(p + i) = q;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Arguments of every version: x, y, dy, dx [N, D] row-major BF16; w, b [D] BF16;
// mean, rstd [N] F32. The dx kernels compute dx += r·(g − mean(g) − x̂·mean(g·x̂)), g = dy·w.
struct NormArgs {
  const __nv_bfloat16 *x, *w, *b, *dy;
  __nv_bfloat16 *y, *dx;
  float *mean, *rstd;
  int64_t N;
  int D;
  float eps;
};

}  // namespace norm_lab
