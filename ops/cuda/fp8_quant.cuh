// The FP8 E4M3 quantisers' kernels (ops/backend.h's quantize_rows_e4m3, quantize_cols_e4m3 and
// quantize_rows_cols_e4m3) and their launches on raw pointers: ops/cuda/kernels_fp8.cu wraps them
// for the backend, experiments/fp8/ times variants against them. The arithmetic and why it is
// shaped this way: kernels_fp8.cu's header comment.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cfloat>
#include <cstdint>

#include "ops/cuda/cuda_check.h"

namespace laplace::cuda::fp8_quant {

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

// V consecutive values at p as floats: one 16-byte load when V > 1 (p 16-byte aligned).
template <typename T, int V>
__device__ __forceinline__ void load_vec(const T* p, float* f) {
  if constexpr (V == 1) {
    f[0] = to_float(p[0]);
  } else {
    static_assert(V * sizeof(T) == 16, "a vector is 16 bytes");
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    const T* t = reinterpret_cast<const T*>(&u);
#pragma unroll
    for (int j = 0; j < V; ++j) f[j] = to_float(t[j]);
  }
}

// The code of v · inv, inv the reciprocal of its scale.
__device__ __forceinline__ uint32_t e4m3(float v, float inv) {
  return __nv_cvt_float_to_fp8(v * inv, __NV_SATFINITE, __NV_E4M3);
}

// The codes of a · ia and b · ib as one 16-bit pair, a's in the low byte.
__device__ __forceinline__ uint32_t e4m3x2(float a, float ia, float b, float ib) {
  return __nv_cvt_float2_to_fp8x2(make_float2(a * ia, b * ib), __NV_SATFINITE, __NV_E4M3);
}

// core/fp8.h's e4m3_scale.
__device__ __forceinline__ float scale_of(float amax) { return amax > 0.f ? fmaxf(amax / 448.f, FLT_MIN) : 1.f; }

// The codes of V adjacent values of one row (scale reciprocal inv), packed in V/4 words, the
// first value in the lowest byte.
template <int V>
__device__ __forceinline__ void pack_row(const float* f, float inv, uint32_t* w) {
  static_assert(V % 4 == 0, "whole words");
#pragma unroll
  for (int j = 0; j < V; j += 4)
    w[j / 4] = e4m3x2(f[j], inv, f[j + 1], inv) | e4m3x2(f[j + 2], inv, f[j + 3], inv) << 16;
}

// A row's V codes at p: one 4- or 8-byte store when V > 1.
template <int V>
__device__ __forceinline__ void store_row_codes(const float* f, float inv, __nv_fp8_storage_t* p) {
  if constexpr (V == 1) {
    p[0] = static_cast<__nv_fp8_storage_t>(e4m3(f[0], inv));
  } else {
    uint32_t w[V / 4];
    pack_row<V>(f, inv, w);
    if constexpr (V == 8) *reinterpret_cast<uint2*>(p) = make_uint2(w[0], w[1]);
    else *reinterpret_cast<uint32_t*>(p) = w[0];
  }
}

// Per row: one block per row finds max |x|, then writes the row's codes (a second read, from L2).
template <typename T, int V>
__global__ void quantize_rows_e4m3_kernel(const T* x, int64_t ld, int64_t cols, __nv_fp8_storage_t* q, float* s) {
  __shared__ float sh[32];
  __shared__ float scale;
  const int64_t r = blockIdx.x;
  const T* row = x + r * ld;
  const int64_t step = static_cast<int64_t>(blockDim.x) * V;
  float amax = 0.f;
  for (int64_t c = static_cast<int64_t>(threadIdx.x) * V; c < cols; c += step) {
    float f[V];
    load_vec<T, V>(row + c, f);
#pragma unroll
    for (int j = 0; j < V; ++j) amax = fmaxf(amax, fabsf(f[j]));
  }
  amax = warp_max(amax);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) sh[warp] = amax;
  __syncthreads();
  if (warp == 0) {
    float m = lane < (blockDim.x + 31) / 32 ? sh[lane] : 0.f;
    m = warp_max(m);
    if (lane == 0) {
      scale = scale_of(m);
      s[r] = scale;
    }
  }
  __syncthreads();
  const float inv = 1.f / scale;
  __nv_fp8_storage_t* qr = q + r * cols;
  for (int64_t c = static_cast<int64_t>(threadIdx.x) * V; c < cols; c += step) {
    float f[V];
    load_vec<T, V>(row + c, f);
    store_row_codes<V>(f, inv, qr + c);
  }
}

// Per column, written transposed, in three passes over tiles of kColRows rows × 32·V columns
// (blocks of 32 × 8 threads, a thread's V columns adjacent): the columns' max |x| into s as F32
// bits by atomicMax (non-negative floats order as their bits do), then the codes, then s turned
// into scales. A block of many rows' worth of columns keeps every SM busy, where one block per
// column strip would serialise the rows. With kRows the same passes also make the per-row codes
// and scales (quantize_rows_cols_e4m3): each warp reads whole rows of the tile, so a row's
// maximum over the tile is one warp reduction and one atomicMax.
constexpr int kColRows = 128;
constexpr int kColWords = kColRows / 4;  // one column of a tile's codes, as 32-bit words

template <typename T, int V, bool kRows>
__global__ void column_amax_kernel(const T* x, int64_t ld, int64_t rows, int64_t cols, unsigned* amax,
                                   unsigned* row_amax) {
  __shared__ float part[8][32 * V];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * 32 * V, c = c0 + tx * V;
  float m[V] = {};
  for (int64_t r0 = static_cast<int64_t>(blockIdx.y) * kColRows; r0 < rows;
       r0 += static_cast<int64_t>(gridDim.y) * kColRows) {
    const int64_t r1 = min(r0 + kColRows, rows);
    for (int64_t r = r0 + ty; r < r1; r += 8) {
      float f[V] = {};
      if (c < cols) load_vec<T, V>(x + r * ld + c, f);
      float rm = 0.f;
#pragma unroll
      for (int j = 0; j < V; ++j) {
        m[j] = fmaxf(m[j], fabsf(f[j]));
        rm = fmaxf(rm, fabsf(f[j]));
      }
      if constexpr (kRows) {
        rm = warp_max(rm);
        if (tx == 0 && rm > 0.f) atomicMax(row_amax + r, __float_as_uint(rm));
      }
    }
  }
#pragma unroll
  for (int j = 0; j < V; ++j) part[ty][tx * V + j] = m[j];
  __syncthreads();
  for (int j = ty * 32 + tx; j < 32 * V; j += 256) {
    float v = part[0][j];
#pragma unroll
    for (int i = 1; i < 8; ++i) v = fmaxf(v, part[i][j]);
    if (c0 + j < cols && v > 0.f) atomicMax(amax + c0 + j, __float_as_uint(v));
  }
}

// Each thread quantises its V columns over 4 consecutive rows, two rows at a time (a column's
// codes of both in one paired conversion), and packs each column's 4 codes
// into one word of the shared tile [32·V columns][kColWords]; the word's place in its column is
// rotated by the writing lane, so that a warp's lanes hit 32 different banks both when they
// write (one word each of different columns) and when they read (the words of one column).
// Each warp then writes whole rows of qt: kColRows codes of one column, as words when `words`.
// With kRows each thread also writes its V codes of each of its rows into q, in place, with the
// rows' scale reciprocals that the tile's first kColRows threads put in shared memory (one
// division per row and tile, not one per row in every thread that writes part of it; fewer
// registers, so that four blocks fit on an SM).
template <typename T, int V, bool kRows>
__global__ void __launch_bounds__(256, kRows ? 4 : 1)
    column_codes_kernel(const T* x, int64_t ld, int64_t rows, int64_t cols, const unsigned* amax,
                        __nv_fp8_storage_t* qt, bool words, const unsigned* row_amax, __nv_fp8_storage_t* q) {
  __shared__ uint32_t tile[32 * V * kColWords];
  __shared__ float row_inv[kRows ? kColRows : 1];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * 32 * V, c = c0 + tx * V;
  float inv[V];  // the columns' scale reciprocals
#pragma unroll
  for (int j = 0; j < V; ++j) inv[j] = 1.f / scale_of(c + j < cols ? __uint_as_float(amax[c + j]) : 0.f);
  for (int64_t r0 = static_cast<int64_t>(blockIdx.y) * kColRows; r0 < rows;
       r0 += static_cast<int64_t>(gridDim.y) * kColRows) {
    if constexpr (kRows) {
      const int t = ty * 32 + tx;
      if (t < kColRows) row_inv[t] = r0 + t < rows ? 1.f / scale_of(__uint_as_float(row_amax[r0 + t])) : 0.f;
      __syncthreads();
    }
    for (int w = ty; w < kColWords; w += 8) {
      uint32_t packed[V] = {};
#pragma unroll
      for (int k = 0; k < 4; k += 2) {
        const int64_t r = r0 + 4 * w + k;
        const bool in0 = r < rows && c < cols, in1 = r + 1 < rows && c < cols;
        float f0[V] = {}, f1[V] = {};
        if (in0) load_vec<T, V>(x + r * ld + c, f0);
        if (in1) load_vec<T, V>(x + (r + 1) * ld + c, f1);
#pragma unroll
        for (int j = 0; j < V; ++j) packed[j] |= e4m3x2(f0[j], inv[j], f1[j], inv[j]) << (8 * k);
        if constexpr (kRows) {
          if (in0) store_row_codes<V>(f0, row_inv[4 * w + k], q + r * cols + c);
          if (in1) store_row_codes<V>(f1, row_inv[4 * w + k + 1], q + (r + 1) * cols + c);
        }
      }
#pragma unroll
      for (int j = 0; j < V; ++j) tile[(tx * V + j) * kColWords + ((w + tx) & (kColWords - 1))] = packed[j];
    }
    __syncthreads();
    const int64_t r = r0 + 4 * tx;
    for (int i = ty; i < 32 * V && c0 + i < cols; i += 8) {
      const uint32_t word = tile[i * kColWords + ((tx + i / V) & (kColWords - 1))];
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

static __global__ void column_scales_kernel(float* s, int64_t cols) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c < cols) s[c] = scale_of(s[c]);
}

// One block per row: x [R, C] (leading dimension ld) → codes q [R, C], scales s [R].
template <typename T, int V>
void launch_rows(const T* x, int64_t ld, int64_t R, int64_t C, __nv_fp8_storage_t* q, float* s, cudaStream_t st) {
  const int threads = V == 1 ? 256 : 128;
  quantize_rows_e4m3_kernel<T, V><<<static_cast<unsigned>(R), threads, 0, st>>>(x, ld, C, q, s);
}

// The column passes: x [R, C] → codes qt [C, R], scales st [C]; with kRows also the row codes
// q [R, C] and scales s [R].
template <typename T, int V, bool kRows>
void launch_cols(const T* x, int64_t ld, int64_t R, int64_t C, __nv_fp8_storage_t* qt, float* st,
                 __nv_fp8_storage_t* q, float* s, cudaStream_t stream) {
  const dim3 block(32, 8);
  const dim3 grid(static_cast<unsigned>((C + 32 * V - 1) / (32 * V)),
                  static_cast<unsigned>(std::clamp<int64_t>((R + kColRows - 1) / kColRows, 1, 65535)));
  unsigned* amax = reinterpret_cast<unsigned*>(st);
  unsigned* row_amax = kRows ? reinterpret_cast<unsigned*>(s) : nullptr;
  const bool words = R % 4 == 0 && reinterpret_cast<uintptr_t>(qt) % 4 == 0;
  CUDA_CHECK(cudaMemsetAsync(st, 0, static_cast<size_t>(C) * sizeof(float), stream));
  if (kRows) CUDA_CHECK(cudaMemsetAsync(s, 0, static_cast<size_t>(R) * sizeof(float), stream));
  column_amax_kernel<T, V, kRows><<<grid, block, 0, stream>>>(x, ld, R, C, amax, row_amax);
  column_codes_kernel<T, V, kRows><<<grid, block, 0, stream>>>(x, ld, R, C, amax, qt, words, row_amax, q);
  column_scales_kernel<<<static_cast<unsigned>((C + 255) / 256), 256, 0, stream>>>(st, C);
  if (kRows) column_scales_kernel<<<static_cast<unsigned>((R + 255) / 256), 256, 0, stream>>>(s, R);
}

}  // namespace laplace::cuda::fp8_quant
