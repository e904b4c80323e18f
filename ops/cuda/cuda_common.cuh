// Shared helpers of the CUDA kernels (included by ops/cuda/*.cu only).
//  - float loads/stores with a run-time dtype code (F32 or BF16): the branch is uniform
//    across a launch, so one kernel serves every dtype combination without templates;
//  - EView (element-wise, any strides) and RView (rows of a contiguous innermost dim)
//    built on the host from a Tensor, with 64-bit offsets;
//  - warp/block sums with a fixed reduction tree (deterministic).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "core/tensor.h"
#include "ops/cuda/cuda_backend.h"
#include "ops/cuda/cuda_check.h"

namespace laplace::cuda {

constexpr int kF32 = 0;
constexpr int kBF16 = 1;

inline int float_code(const Tensor& t, const char* what) {
  if (t.dtype != DType::kF32 && t.dtype != DType::kBF16)
    check_failed(__FILE__, __LINE__, what, (std::string("expected an F32 or BF16 tensor, got ") + t.shape_str()).c_str());
  return t.dtype == DType::kBF16 ? kBF16 : kF32;
}

inline void check_device(const Tensor& t, const char* what) {
  if (t.defined() && t.device != Device::kCUDA)
    check_failed(__FILE__, __LINE__, what, (std::string("tensor must live on the GPU: ") + t.shape_str()).c_str());
}

inline void check_f32(const Tensor& t, const char* what) {
  if (t.defined() && t.dtype != DType::kF32)
    check_failed(__FILE__, __LINE__, what, (std::string("expected an F32 tensor, got ") + t.shape_str()).c_str());
}

// A device scalar block: `n` contiguous F64 values on the GPU (ops/backend.h's "device
// scalars"); returns its address.
inline double* device_scalar(const Tensor& t, int64_t n, const char* what) {
  if (!t.defined() || t.device != Device::kCUDA || t.dtype != DType::kF64 || t.numel() < n ||
      (t.ndim > 0 && t.stride[t.ndim - 1] != 1 && t.numel() > 1))
    check_failed(__FILE__, __LINE__, what,
                 (std::string("expected a contiguous F64 device scalar block of ") + std::to_string(n) +
                  ", got " + t.shape_str())
                     .c_str());
  return static_cast<double*>(t.data);
}

__device__ __forceinline__ float ldf(const void* p, int64_t i, int dt) {
  if (dt == kBF16) return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
  return static_cast<const float*>(p)[i];
}
__device__ __forceinline__ void stf(void* p, int64_t i, int dt, float x) {
  if (dt == kBF16) static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(x);
  else static_cast<float*>(p)[i] = x;
}

__device__ __forceinline__ float sigmoidf_(float x) { return 1.0f / (1.0f + expf(-x)); }

// Element-wise view: logical row-major index -> element offset. Dims that are contiguous
// with each other are merged on the host, so a contiguous tensor has nd == 1.
struct EView {
  void* p = nullptr;
  int dt = kF32;
  int nd = 1;
  int64_t shape[kMaxDims] = {1, 1, 1, 1};
  int64_t stride[kMaxDims] = {1, 1, 1, 1};
  __device__ __forceinline__ int64_t off(int64_t i) const {
    if (nd == 1) return i * stride[0];
    int64_t o = 0;
#pragma unroll
    for (int d = kMaxDims - 1; d >= 0; --d) {  // constant indices: the view stays in registers
      if (d < nd) {
        const int64_t s = shape[d];
        o += (i % s) * stride[d];
        i /= s;
      }
    }
    return o;
  }
};

// Rows view: the tensor as [rows, cols] with cols the (contiguous) innermost dim and the
// outer dims (at most 3) addressed by their own strides: row r = (i0, i1, i2) row-major.
struct RView {
  void* p = nullptr;
  int dt = kF32;
  int64_t rows = 0, cols = 0;
  int64_t d1 = 1, d2 = 1;        // sizes of outer dims 1 and 2 (dim 0 is implied)
  int64_t s0 = 0, s1 = 0, s2 = 0;  // strides of outer dims 0, 1, 2 (elements)
  __device__ __forceinline__ int64_t row(int64_t r) const {
    if (d1 == 1 && d2 == 1) return r * s0;
    const int64_t i2 = r % d2, q = r / d2;
    return (q / d1) * s0 + (q % d1) * s1 + i2 * s2;
  }
};

// Host builders (ops/cuda/kernels_elementwise.cu). They check the device and, for the
// float views, that the dtype is F32 or BF16; an undefined tensor gives a view with p null.
EView make_eview(const Tensor& t, const char* what);
RView make_rview(const Tensor& t, const char* what);

// Grid size for grid-stride element-wise kernels.
inline unsigned grid_for(int64_t n, int threads) {
  int64_t g = (n + threads - 1) / threads;
  if (g < 1) g = 1;
  if (g > 132 * 32) g = 132 * 32;
  return static_cast<unsigned>(g);
}

// ---- reductions with a fixed tree ---------------------------------------------------
// Butterfly sum: every lane ends with the same bits (a+b == b+a in IEEE arithmetic).
template <class T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Sum over the block; every thread gets the total. `sh` holds >= 32 values of T.
template <class T>
__device__ __forceinline__ T block_sum(T v, T* sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int nw = (blockDim.x + 31) >> 5;
  v = warp_sum(v);
  __syncthreads();  // sh may still be read by a previous call
  if (lane == 0) sh[warp] = v;
  __syncthreads();
  return warp_sum(lane < nw ? sh[lane] : T(0));
}

}  // namespace laplace::cuda
