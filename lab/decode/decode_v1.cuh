// v1 — the production decode kernel (ops/cuda/kernels_gla_decode.cu, gla_decode_kernel as of
// 1e3af0f) with the gate epilogue removed (kGate = false). One block of dv threads per (b, h);
// thread (rg, c) owns 4-column vector c of the rows of row group rg (4 groups of ⌈dk/4⌉
// consecutive rows), loads 8 rows before using any, stores each updated row vector straight
// back to global memory, and the per-group partial outputs are added in group order through
// shared memory. Its S and o bits are the lab's reference bits.
#pragma once

#include "decode_common.cuh"

namespace decode_lab::v1 {

template <class ST>
struct DecShape;
template <>
struct DecShape<float> {
  static constexpr int kCols = 4, kGroups = 4;
};
template <>
struct DecShape<__nv_bfloat16> {
  static constexpr int kCols = 4, kGroups = 4;
};
constexpr int kDecUnroll = 8;  // rows loaded before any is used

template <class ST>
__global__ void __launch_bounds__(kDecMaxDv) gla_decode_kernel(DecArgs a) {
  constexpr int C = DecShape<ST>::kCols, G = DecShape<ST>::kGroups;
  __shared__ float qs[kDecMaxDk], ks[kDecMaxDk];
  __shared__ float part[G][kDecMaxDv];
  const int b = blockIdx.x / a.H, h = blockIdx.x - b * a.H;
  const int nv = a.dv / C;
  const int tid = threadIdx.x, c = tid % nv, rg = tid / nv;
  for (int i = tid; i < a.dk; i += blockDim.x) {
    qs[i] = a.scale * ldf(a.q, b * a.q_sb + h * a.q_sh + i, a.q_dt);
    ks[i] = ldf(a.k, b * a.k_sb + h * a.k_sh + i, a.k_dt);
  }
  float vv[C];
  const int64_t vo = b * a.v_sb + h * a.v_sh + C * c;
#pragma unroll
  for (int j = 0; j < C; ++j) vv[j] = ldf(a.v, vo + j, a.v_dt);
  __syncthreads();

  const int64_t slot = a.slots ? a.slots[b] : b;
  const int64_t base = slot * a.ss + h * a.sh + C * c;
  const ST* src = a.s_in ? static_cast<const ST*>(a.s_in) + base : nullptr;
  ST* dst = a.s_out ? static_cast<ST*>(a.s_out) + base : nullptr;
  const float lam = a.lam[h];
  const int rows = (a.dk + G - 1) / G;
  const int r0 = rg * rows, r1 = min(a.dk, r0 + rows);
  float acc[C];
#pragma unroll
  for (int j = 0; j < C; ++j) acc[j] = 0.f;
  for (int i0 = r0; i0 < r1; i0 += kDecUnroll) {
    float s[kDecUnroll][C];
#pragma unroll
    for (int u = 0; u < kDecUnroll; ++u) {
      if (src && i0 + u < r1) {
        load_vec(src + (i0 + u) * a.sk, s[u]);
      } else {
#pragma unroll
        for (int j = 0; j < C; ++j) s[u][j] = 0.f;
      }
    }
#pragma unroll
    for (int u = 0; u < kDecUnroll; ++u) {
      const int i = i0 + u;
      if (i >= r1) break;
      const float kk = ks[i], qq = qs[i];
#pragma unroll
      for (int j = 0; j < C; ++j) {
        s[u][j] = fmaf(lam, s[u][j], kk * vv[j]);
        acc[j] = fmaf(qq, s[u][j], acc[j]);
      }
      if (dst) store_vec(dst + i * a.sk, s[u]);
    }
  }
#pragma unroll
  for (int j = 0; j < C; ++j) part[rg][C * c + j] = acc[j];
  __syncthreads();
  // o_e = Σ_rg part[rg][e] in group order.
  for (int e = tid; e < a.dv; e += blockDim.x) {
    float x = part[0][e];
#pragma unroll
    for (int g = 1; g < G; ++g) x += part[g][e];
    if (a.o) stf(a.o, b * a.o_sb + h * a.o_sh + e, a.o_dt, x);
  }
}

}  // namespace decode_lab::v1
