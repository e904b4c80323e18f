// Pieces shared by the row-wise CUDA ops (kernels_norm.cu, kernels_conv.cu, kernels_xent.cu):
// argument views of weight vectors, the 8-column vector accesses of the fast paths, and the
// column reductions of parameter gradients (dw, db, dtable). Those are reduced without atomics:
// per-segment partials [nq, nseg, cols] in a fixed row order, then 32 lanes per column sum the
// segments in a fixed order (colsum_finalize_kernel). The segmentation depends only on the
// shapes, so results are bitwise reproducible.
#pragma once

#include <algorithm>
#include <cmath>
#include <string>

#include "ops/cuda/cuda_common.cuh"

namespace laplace {
namespace cuda {

constexpr int kWarpsPerBlock = 8;     // warp-per-row kernels: 256 threads, 8 rows per block
constexpr int kSegRows = 128;         // rows per partial segment in column reductions
constexpr int kMaxColOut = 8;         // outputs per column reduction (conv: K ≤ 8)

// A 1-D float vector (weights, biases), contiguous.
struct Vec {
  void* p = nullptr;
  int dt = kF32;
};

// A vector that DT = kBF16 instances take (dt_as in cuda_common.cuh): none, or BF16 and 16-byte aligned.
inline bool bf16_vec(const Vec& v) { return !v.p || (v.dt == kBF16 && aligned16(v.p)); }

inline Vec make_vec(const Tensor& t, int64_t n, const char* what) {
  Vec v;
  if (!t.defined()) return v;
  check_device(t, what);
  if (t.numel() != n || !t.is_contiguous())
    check_failed(__FILE__, __LINE__, what, ("expected a contiguous vector of " + std::to_string(n) +
                                            " elements, got " + t.shape_str()).c_str());
  v.p = t.data;
  v.dt = float_code(t, what);
  return v;
}

inline float* f32_vec(const Tensor& t, int64_t n, const char* what) {
  if (!t.defined()) return nullptr;
  check_device(t, what);
  if (t.dtype != DType::kF32 || t.numel() != n || !t.is_contiguous())
    check_failed(__FILE__, __LINE__, what, ("expected a contiguous F32 tensor of " + std::to_string(n) +
                                            " elements, got " + t.shape_str()).c_str());
  return static_cast<float*>(t.data);
}

inline const int32_t* i32_vec(const Tensor& t, int64_t n, const char* what) {
  if (!t.defined()) return nullptr;
  check_device(t, what);
  if (t.dtype != DType::kI32 || t.numel() != n || !t.is_contiguous())
    check_failed(__FILE__, __LINE__, what, ("expected a contiguous I32 tensor of " + std::to_string(n) +
                                            " elements, got " + t.shape_str()).c_str());
  return static_cast<const int32_t*>(t.data);
}

// ---- 16-byte vectors of 8 floats (the fast paths) -------------------------------------------
// ld8 / st8 / vec_rows live in cuda_common.cuh. These overloads take `vec`: when false (a
// tensor whose rows are not 16-byte aligned) they go element by element, same values and
// arithmetic.
namespace {

__device__ __forceinline__ void ld8(const void* p, int64_t i, int dt, bool vec, float (&v)[8]) {
  if (vec) {
    laplace::cuda::ld8(p, i, dt, v);  // the 4-argument one (cuda_common.cuh)
    return;
  }
#pragma unroll
  for (int k = 0; k < 8; ++k) v[k] = ldf(p, i + k, dt);
}

__device__ __forceinline__ void st8(void* p, int64_t i, int dt, bool vec, const float (&v)[8]) {
  if (vec) {
    laplace::cuda::st8(p, i, dt, v);
    return;
  }
#pragma unroll
  for (int k = 0; k < 8; ++k) stf(p, i + k, dt, v[k]);
}

// Launchers of kernels that address rows through RView::row32 check rows ≤ kRow32Max.
constexpr int64_t kRow32Max = 0x7fffffff;

}  // namespace

// ---- column reductions ------------------------------------------------------------------

// Where output q of a column reduction goes: element c at p[off + c·stride].
struct ColOut {
  void* p = nullptr;
  int dt = kF32;
  int64_t off = 0, stride = 1;
};
struct ColOuts {
  ColOut o[kMaxColOut];
};

// Pass 1. Block (32, 8) owns columns [32·bx, 32·bx+32) of segment `seg` = blockIdx.y, rows
// [seg·kSegRows, (seg+1)·kSegRows): thread (tx, ty) sums rows seg·R + ty + 8j in order, then
// the 8 row-lanes are summed in order ty = 0..7. f(r, c, out[nq]) gives the row's terms.
// partial [nq, nseg, cols] F32.
template <class F>
__global__ void colpartial_kernel(F f, int64_t rows, int64_t cols, int nq, float* partial) {
  __shared__ float sh[kMaxColOut][8][33];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t c = blockIdx.x * 32LL + tx;
  const int64_t seg = blockIdx.y, nseg = gridDim.y;
  const int64_t r0 = seg * kSegRows, r1 = min(rows, r0 + kSegRows);
  float acc[kMaxColOut];
#pragma unroll
  for (int q = 0; q < kMaxColOut; ++q) acc[q] = 0.f;
  if (c < cols) {
    for (int64_t r = r0 + ty; r < r1; r += 8) {
      float t[kMaxColOut];
      f(r, c, t);
#pragma unroll
      for (int q = 0; q < kMaxColOut; ++q)
        if (q < nq) acc[q] += t[q];
    }
  }
#pragma unroll
  for (int q = 0; q < kMaxColOut; ++q) sh[q][ty][tx] = acc[q];
  __syncthreads();
  if (ty == 0 && c < cols) {
    for (int q = 0; q < nq; ++q) {
      float s = 0.f;
#pragma unroll
      for (int k = 0; k < 8; ++k) s += sh[q][k][tx];
      partial[(q * nseg + seg) * cols + c] = s;
    }
  }
}

// Pass 2 of every column reduction (colreduce and the fused / vectorised partial kernels):
// out_q[c] += Σ_seg partial[q, seg, c] in a fixed order (kernels_norm.cu).
void colsum_finalize(const float* partial, int64_t nseg, int64_t cols, int nq, const ColOuts& outs, cudaStream_t st);

// Runs both passes; `partial` holds nq·nseg·cols floats (see colreduce_floats).
inline int64_t colreduce_nseg(int64_t rows) { return (rows + kSegRows - 1) / kSegRows; }
inline size_t colreduce_floats(int64_t rows, int64_t cols, int nq) {
  return static_cast<size_t>(nq) * static_cast<size_t>(colreduce_nseg(rows)) * static_cast<size_t>(cols);
}

template <class F>
void colreduce(F f, int64_t rows, int64_t cols, int nq, const ColOuts& outs, float* partial, cudaStream_t st) {
  if (rows == 0 || cols == 0) return;
  const int64_t nseg = colreduce_nseg(rows);
  LAPLACE_CHECK(nseg <= 65535, "column reduction: too many rows");
  dim3 grid(static_cast<unsigned>((cols + 31) / 32), static_cast<unsigned>(nseg));
  colpartial_kernel<F><<<grid, dim3(32, 8), 0, st>>>(f, rows, cols, nq, partial);
  CUDA_CHECK_LAUNCH();
  colsum_finalize(partial, nseg, cols, nq, outs, st);
}

inline ColOut col_out(const Tensor& t, int64_t off, int64_t stride, const char* what) {
  ColOut o;
  check_device(t, what);
  o.p = t.data;
  o.dt = float_code(t, what);
  o.off = off;
  o.stride = stride;
  return o;
}

}  // namespace cuda
}  // namespace laplace
