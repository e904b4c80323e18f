// Four consecutive columns of a state row (16 bytes of F32, 8 of BF16) as floats, and a value
// rounded as a store to a dtype would round it. The decode kernels step states through these;
// experiments/decode includes them so that its variants read and write states exactly as the
// production kernel does. The pointers may be global or shared, 16-byte (F32) or 8-byte (BF16)
// aligned.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "ops/cuda/cuda_common.cuh"

namespace laplace {
namespace cuda {

__device__ __forceinline__ void load_vec(const float* p, float* x) {
  const float4 t = *reinterpret_cast<const float4*>(p);
  x[0] = t.x, x[1] = t.y, x[2] = t.z, x[3] = t.w;
}
__device__ __forceinline__ void load_vec(const __nv_bfloat16* p, float* x) {
  const uint2 t = *reinterpret_cast<const uint2*>(p);
  const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&t.x));
  const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&t.y));
  x[0] = a.x, x[1] = a.y, x[2] = b.x, x[3] = b.y;
}
__device__ __forceinline__ void store_vec(float* p, const float* x) {
  *reinterpret_cast<float4*>(p) = make_float4(x[0], x[1], x[2], x[3]);
}
__device__ __forceinline__ void store_vec(__nv_bfloat16* p, const float* x) {
  const __nv_bfloat162 a = __floats2bfloat162_rn(x[0], x[1]), b = __floats2bfloat162_rn(x[2], x[3]);
  uint2 t;
  t.x = *reinterpret_cast<const uint32_t*>(&a);
  t.y = *reinterpret_cast<const uint32_t*>(&b);
  *reinterpret_cast<uint2*>(p) = t;
}

// x rounded to dtype dt and back (what a store followed by a load gives).
__device__ __forceinline__ float round_to(float x, int dt) {
  return dt == kBF16 ? __bfloat162float(__float2bfloat16_rn(x)) : x;
}

}  // namespace cuda
}  // namespace laplace
