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

// FP8 codes: a contiguous 2-D F8_E4M3 tensor on the device; their scales: contiguous F32 [n].
inline void check_e4m3_matrix(const Tensor& t, const char* what) {
  check_device(t, what);
  if (t.dtype != DType::kF8E4M3 || t.ndim != 2 || !t.is_contiguous())
    check_failed(__FILE__, __LINE__, what,
                 (std::string("expected a contiguous 2-D F8_E4M3 tensor, got ") + t.shape_str()).c_str());
}

inline void check_scales(const Tensor& t, int64_t n, const char* what) {
  check_device(t, what);
  if (t.dtype != DType::kF32 || t.ndim != 1 || t.shape[0] != n || !t.is_contiguous())
    check_failed(__FILE__, __LINE__, what,
                 (std::string("expected contiguous F32 [") + std::to_string(n) + "], got " + t.shape_str()).c_str());
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
// SwiGLU's h = SiLU(a)·b, one expression for every kernel that computes it (the forward's and
// the FP8 codes' must give the same bits).
__device__ __forceinline__ float swiglu_value(float a, float b) { return a * sigmoidf_(a) * b; }

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
    // 32-bit index arithmetic when the rows allow it (uniform over a launch): a 64-bit % and /
    // are long instruction sequences, which made per-row kernels over 4-D views (the gate
    // inside the fused qkvg buffer) instruction-bound. Same quotients, so the same offsets.
    if (rows <= 0xffffffffLL) return row32(static_cast<uint32_t>(r));
    const int64_t i2 = r % d2, q = r / d2;
    return (q / d1) * s0 + (q % d1) * s1 + i2 * s2;
  }
  // row(r) for r < 2^32 in 32-bit divides (callers that walk many rows, rows < 2^32).
  __device__ __forceinline__ int64_t row32(uint32_t r) const {
    if (d1 == 1 && d2 == 1) return static_cast<int64_t>(r) * s0;
    const uint32_t e2 = static_cast<uint32_t>(d2), q = r / e2, i2 = r - q * e2;
    if (d1 == 1) return static_cast<int64_t>(q) * s0 + static_cast<int64_t>(i2) * s2;
    const uint32_t e1 = static_cast<uint32_t>(d1), i0 = q / e1, i1 = q - i0 * e1;
    return static_cast<int64_t>(i0) * s0 + static_cast<int64_t>(i1) * s1 + static_cast<int64_t>(i2) * s2;
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

// ---- 8 consecutive floats per access (the vectorised fast paths) ----------------------
// Element offset i is a multiple of 8 and the base 16-byte aligned (vec_rows() on the
// host): one 16-byte access for BF16, two for F32. A BF16 store rounds each element once,
// as stf does, so the values are those of the element-wise kernels.
__device__ __forceinline__ void ld8(const void* p, int64_t i, int dt, float (&v)[8]) {
  if (dt == kBF16) {
    const uint4 q = *reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(p) + i);
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&q);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float2 f = __bfloat1622float2(h[k]);
      v[2 * k] = f.x;
      v[2 * k + 1] = f.y;
    }
  } else {
    const float4* q = reinterpret_cast<const float4*>(static_cast<const float*>(p) + i);
    const float4 a = q[0], b = q[1];
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
  }
}
__device__ __forceinline__ void st8(void* p, int64_t i, int dt, const float (&v)[8]) {
  if (dt == kBF16) {
    uint4 q;
    __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&q);
#pragma unroll
    for (int k = 0; k < 4; ++k) h[k] = __floats2bfloat162_rn(v[2 * k], v[2 * k + 1]);
    *reinterpret_cast<uint4*>(static_cast<__nv_bfloat16*>(p) + i) = q;
  } else {
    float4* q = reinterpret_cast<float4*>(static_cast<float*>(p) + i);
    q[0] = make_float4(v[0], v[1], v[2], v[3]);
    q[1] = make_float4(v[4], v[5], v[6], v[7]);
  }
}

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// ---- dtypes fixed at compile time (the fast paths' common case) -------------------------
// ld8 with a run-time dtype puts each 16-byte load and its conversion inside a branch, so a
// thread waits for every load before it issues the next one: a kernel with four loads per
// thread pays four memory latencies in a row. Kernels templated on DT
// take every F32/BF16 operand's dtype as dt_as<DT>(view.dt) and its vector flag as
// vec_as<DT>(flag): with DT = kBF16 both are constants, the branches vanish and a thread's
// loads are all in flight at once; with DT = kDtAny they are read at run time as before.
// Launchers choose kBF16 only when every operand is BF16 with 16-byte aligned rows, so
// both instances compute the same expressions on the same values (the same bits).
constexpr int kDtAny = -1;
template <int DT>
__device__ __forceinline__ int dt_as(int dt) {
  return DT == kDtAny ? dt : DT;
}
template <int DT>
__device__ __forceinline__ bool vec_as(int flag) {
  return DT != kDtAny || flag != 0;
}

// Whether every row of v starts 16-byte aligned at a multiple of 8 elements (cols % 8 == 0 is
// the caller's check), so ld8/st8 apply at columns 8j. A null view is not.
inline bool vec_rows(const RView& v) {
  if (!v.p || !aligned16(v.p)) return false;
  if (v.rows > 1 && v.s0 % 8 != 0) return false;
  if (v.d1 > 1 && v.s1 % 8 != 0) return false;
  if (v.d2 > 1 && v.s2 % 8 != 0) return false;
  return true;
}
// A view that DT = kBF16 instances take: no tensor, or BF16 with 16-byte accessible rows.
inline bool bf16_rows(const RView& v) { return !v.p || (v.dt == kBF16 && vec_rows(v)); }

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
