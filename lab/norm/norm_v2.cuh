// v2 — one block per ROWS rows, one thread per 8-column chunk (D/8 threads: 384 at D = 3072).
// Each thread holds 8 values per row instead of 96, so a block needs ~40 registers a thread and
// an SM runs ~5 blocks (60 warps) instead of 2–4 blocks of 4 warps; every load of a row (dx's
// accumulate input included) is issued before the first reduction. The sums over the block run
// in a fixed order: each warp's butterfly, then the warps' partial sums in warp order (the same
// order in every thread), so the results are bitwise reproducible. Their bits differ from v1's
// (another summation order). ROWS = 2 amortises the barriers over two rows.
#pragma once

#include "norm_common.cuh"

namespace norm_lab::v2 {

constexpr int kMaxWarps = 32;

// Σ over the block of each row's v[j], fixed order; sh [ROWS][kMaxWarps], not read by a
// previous call (callers alternate two buffers).
template <int ROWS>
__device__ __forceinline__ void block_sums(float (&v)[ROWS], float (*sh)[kMaxWarps]) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
  for (int j = 0; j < ROWS; ++j) {
    const float s = warp_sum(v[j]);
    if (lane == 0) sh[j][warp] = s;
  }
  __syncthreads();
#pragma unroll
  for (int j = 0; j < ROWS; ++j) {
    float t = 0.f;
    for (int i = 0; i < nw; ++i) t += sh[j][i];
    v[j] = t;
  }
}

template <int ROWS>
__global__ void __launch_bounds__(1024) ln_fwd(NormArgs a) {
  __shared__ float sh[2][ROWS][kMaxWarps];
  const int q = threadIdx.x, nq = a.D >> 3;
  const bool own = q < nq;
  const int64_t row0 = blockIdx.x * (int64_t)ROWS;
  float v[ROWS][8], s[ROWS];
#pragma unroll
  for (int j = 0; j < ROWS; ++j) {
    if (own && row0 + j < a.N) {
      ld8(a.x, (row0 + j) * a.D + 8 * q, v[j]);
    } else {
#pragma unroll
      for (int k = 0; k < 8; ++k) v[j][k] = 0.f;
    }
    s[j] = 0.f;
#pragma unroll
    for (int k = 0; k < 8; ++k) s[j] += v[j][k];
  }
  block_sums<ROWS>(s, sh[0]);
  float mu[ROWS], s2[ROWS];
#pragma unroll
  for (int j = 0; j < ROWS; ++j) {
    mu[j] = s[j] / static_cast<float>(a.D);
    s2[j] = 0.f;
    if (own) {
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const float d = v[j][k] - mu[j];
        s2[j] += d * d;
      }
    }
  }
  block_sums<ROWS>(s2, sh[1]);
  float wv[8], bv[8];
  if (own) {
    ld8(a.w, 8 * q, wv);
    ld8(a.b, 8 * q, bv);
  }
#pragma unroll
  for (int j = 0; j < ROWS; ++j) {
    const int64_t row = row0 + j;
    if (row >= a.N) break;
    const float r = 1.0f / sqrtf(s2[j] / static_cast<float>(a.D) + a.eps);
    if (own) {
      float o[8];
#pragma unroll
      for (int k = 0; k < 8; ++k) o[k] = (v[j][k] - mu[j]) * r * wv[k] + bv[k];
      st8(a.y, row * a.D + 8 * q, o);
    }
    if (q == 0) {
      a.mean[row] = mu[j];
      a.rstd[row] = r;
    }
  }
}

template <int ROWS>
__global__ void __launch_bounds__(1024) ln_dx(NormArgs a) {
  __shared__ float sh[2][ROWS][kMaxWarps];
  const int q = threadIdx.x, nq = a.D >> 3;
  const bool own = q < nq;
  const int64_t row0 = blockIdx.x * (int64_t)ROWS;
  float gv[ROWS][8], xh[ROWS][8], prev[ROWS][8], s1[ROWS], s2[ROWS];
  float wv[8];
  if (own) ld8(a.w, 8 * q, wv);
#pragma unroll
  for (int j = 0; j < ROWS; ++j) {
    const int64_t row = row0 + j;
    s1[j] = s2[j] = 0.f;
    if (own && row < a.N) {
      const int64_t o = row * a.D + 8 * q;
      ld8(a.dy, o, gv[j]);
      ld8(a.x, o, xh[j]);
      ld8(a.dx, o, prev[j]);  // this thread alone reads and then writes these elements
      const float mu = a.mean[row], r = a.rstd[row];
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        gv[j][k] *= wv[k];
        xh[j][k] = (xh[j][k] - mu) * r;
        s1[j] += gv[j][k];
        s2[j] += gv[j][k] * xh[j][k];
      }
    }
  }
  block_sums<ROWS>(s1, sh[0]);
  block_sums<ROWS>(s2, sh[1]);
#pragma unroll
  for (int j = 0; j < ROWS; ++j) {
    const int64_t row = row0 + j;
    if (!own || row >= a.N) continue;
    const float r = a.rstd[row], m1 = s1[j] / static_cast<float>(a.D), m2 = s2[j] / static_cast<float>(a.D);
    float v[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = r * (gv[j][k] - m1 - xh[j][k] * m2) + prev[j][k];
    st8(a.dx, row * a.D + 8 * q, v);
  }
}

// Threads: D/8 rounded up to whole warps (D ≤ 8192).
inline unsigned threads_for(int D) { return static_cast<unsigned>(((D / 8 + 31) / 32) * 32); }

template <int ROWS>
void launch_fwd(const NormArgs& a, cudaStream_t st) {
  ln_fwd<ROWS><<<static_cast<unsigned>((a.N + ROWS - 1) / ROWS), threads_for(a.D), 0, st>>>(a);
}
template <int ROWS>
void launch_dx(const NormArgs& a, cudaStream_t st) {
  ln_dx<ROWS><<<static_cast<unsigned>((a.N + ROWS - 1) / ROWS), threads_for(a.D), 0, st>>>(a);
}

}  // namespace norm_lab::v2
