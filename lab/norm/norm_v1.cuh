// v1 — the production kernels of ops/cuda/kernels_norm.cu as of 9d4a5e5 (BF16 only here):
// one warp per row; lane l holds the 8-column chunks q = l + 32i (i < NV) in registers.
// LayerNorm forward: 128 registers at NV = 12 (D = 3072); dx: 254 registers (g and x̂ of
// 96 columns per lane), so 2 blocks of 4 warps per SM, and the accumulate loads of dx come
// after both reductions, one chunk at a time.
#pragma once

#include "norm_common.cuh"

namespace norm_lab::v1 {

constexpr int kWarps = 4;

template <int NV>
__global__ void __launch_bounds__(32 * kWarps) ln_fwd(NormArgs a) {
  const int64_t row = blockIdx.x * (int64_t)kWarps + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= a.N) return;
  const int nq = a.D >> 3;
  const int64_t ox = row * a.D;
  float v[NV][8];
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int q = lane + 32 * i;
    if (q < nq) {
      ld8(a.x, ox + 8 * q, v[i]);
    } else {
#pragma unroll
      for (int k = 0; k < 8; ++k) v[i][k] = 0.f;
    }
  }
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < NV; ++i)
#pragma unroll
    for (int k = 0; k < 8; ++k) s += v[i][k];
  const float mu = warp_sum(s) / static_cast<float>(a.D);
  float s2 = 0.f;
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    if (lane + 32 * i >= nq) continue;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const float d = v[i][k] - mu;
      s2 += d * d;
    }
  }
  const float r = 1.0f / sqrtf(warp_sum(s2) / static_cast<float>(a.D) + a.eps);
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int q = lane + 32 * i;
    if (q >= nq) continue;
    float o[8], wb[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) o[k] = (v[i][k] - mu) * r;
    ld8(a.w, 8 * q, wb);
#pragma unroll
    for (int k = 0; k < 8; ++k) o[k] *= wb[k];
    ld8(a.b, 8 * q, wb);
#pragma unroll
    for (int k = 0; k < 8; ++k) o[k] += wb[k];
    st8(a.y, ox + 8 * q, o);
  }
  if (lane == 0) {
    a.mean[row] = mu;
    a.rstd[row] = r;
  }
}

template <int NV>
__global__ void __launch_bounds__(32 * kWarps) ln_dx(NormArgs a) {
  const int64_t row = blockIdx.x * (int64_t)kWarps + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= a.N) return;
  const int nq = a.D >> 3;
  const int64_t o = row * a.D;
  const float mu = a.mean[row], r = a.rstd[row];
  float gv[NV][8], xh[NV][8];
  float s1 = 0.f, s2 = 0.f;
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int q = lane + 32 * i;
    if (q < nq) {
      ld8(a.dy, o + 8 * q, gv[i]);
      ld8(a.x, o + 8 * q, xh[i]);
      float wv[8];
      ld8(a.w, 8 * q, wv);
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        gv[i][k] *= wv[k];
        xh[i][k] = (xh[i][k] - mu) * r;
        s1 += gv[i][k];
        s2 += gv[i][k] * xh[i][k];
      }
    } else {
#pragma unroll
      for (int k = 0; k < 8; ++k) gv[i][k] = xh[i][k] = 0.f;
    }
  }
  const float m1 = warp_sum(s1) / static_cast<float>(a.D), m2 = warp_sum(s2) / static_cast<float>(a.D);
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int q = lane + 32 * i;
    if (q >= nq) continue;
    float v[8], prev[8];
    ld8(a.dx, o + 8 * q, prev);
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = r * (gv[i][k] - m1 - xh[i][k] * m2) + prev[k];
    st8(a.dx, o + 8 * q, v);
  }
}

inline void launch_fwd(const NormArgs& a, cudaStream_t st) {
  const unsigned grid = static_cast<unsigned>((a.N + kWarps - 1) / kWarps);
  ln_fwd<12><<<grid, 32 * kWarps, 0, st>>>(a);  // the lab's D = 3072
}
inline void launch_dx(const NormArgs& a, cudaStream_t st) {
  const unsigned grid = static_cast<unsigned>((a.N + kWarps - 1) / kWarps);
  ln_dx<12><<<grid, 32 * kWarps, 0, st>>>(a);
}

}  // namespace norm_lab::v1
