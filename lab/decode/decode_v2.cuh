// v2 — v1's block per (b, h) and thread layout, but the state reaches shared memory through
// Hopper bulk async copies (cp.async.bulk global->shared) instead of per-thread vector loads:
// one instruction per row group moves 24 rows (18 KB F32, 9 KB BF16), so the load of a whole
// state costs 4 instructions instead of 24 vector loads per thread, and the SM keeps 72 KB
// (F32) per block in flight without holding it in registers. Each row group has its own
// mbarrier, so group 0 computes while groups 1-3's rows are still arriving.
//
// Write-back, kBulkStore:
//   true:  the updated rows go back into shared memory and one thread copies the state out
//          with cp.async.bulk shared->global, one copy per piece, after fence.proxy.async +
//          __syncthreads, and waits for the copies to have read shared memory before exiting;
//   false: each thread stores its updated row vectors to global memory as v1 does.
//
// Rows per thread, their order and the group-order reduction are v1's, so S and o have v1's
// bits. Shapes are compile-time (dk = 96, dv = 192) and each state contiguous (sk = dv,
// sh = dk·dv); q, k, v are BF16.
//
// Shared memory: state + part[3][dv] F32 + q, k as BF16 + 4 barriers = 76,448 bytes for F32
// states, so 3 blocks fit in an SM's 228 KB (each block also pays 1 KB of reserved shared
// memory): q and k are kept as BF16 (the scale is applied when used, the same float product
// as v1's) because their F32 copies would push the block 384 bytes past that.
#pragma once

#include "decode_common.cuh"

namespace decode_lab::v2 {

constexpr int kDk = 96, kDv = 192;
constexpr int C = 4, G = 4, kNv = kDv / C, kThreads = G * kNv;
constexpr int kRows = kDk / G;  // rows per group = per bulk-copy piece
constexpr int kUnroll = 8;      // rows read from shared memory before any is used
static_assert(kRows % kUnroll == 0, "whole unrolled row batches");

template <class ST>
struct Smem {
  static constexpr int kPieceBytes = kRows * kDv * static_cast<int>(sizeof(ST));
  static constexpr int kStateBytes = G * kPieceBytes;
  static constexpr int kPartOff = kStateBytes;                     // float [G - 1][kDv]
  static constexpr int kQkOff = kPartOff + (G - 1) * kDv * 4;      // bf16 [2][kDk]
  static constexpr int kBarOff = kQkOff + 2 * kDk * 2;             // uint64 [G]
  static constexpr int kBytes = kBarOff + G * 8;
  static_assert(kPieceBytes % 16 == 0 && kBarOff % 8 == 0, "bulk copy sizes, barrier alignment");
};

template <class ST, bool kBulkStore>
__global__ void __launch_bounds__(kThreads) decode_v2(DecArgs a) {
  using L = Smem<ST>;
  extern __shared__ __align__(128) unsigned char smem[];
  ST* sS = reinterpret_cast<ST*>(smem);
  float* part = reinterpret_cast<float*>(smem + L::kPartOff);
  __nv_bfloat16* sq = reinterpret_cast<__nv_bfloat16*>(smem + L::kQkOff);
  __nv_bfloat16* sk = sq + kDk;
  uint64_t* bar = reinterpret_cast<uint64_t*>(smem + L::kBarOff);

  const int b = blockIdx.x / a.H, h = blockIdx.x - b * a.H;
  const int tid = threadIdx.x, c = tid % kNv, rg = tid / kNv;
  const int64_t slot = a.slots ? a.slots[b] : b;
  const ST* src = static_cast<const ST*>(a.s_in) + slot * a.ss + h * a.sh;
  ST* dst = static_cast<ST*>(a.s_out) + slot * a.ss + h * a.sh;

  // Issue the state copies first: they are the long pole. Every barrier is used once per
  // block, so every wait is on phase 0 (parity 0).
  if (tid == 0) {
#pragma unroll
    for (int p = 0; p < G; ++p) mbar_init(&bar[p], 1);
    fence_barrier_init();
#pragma unroll
    for (int p = 0; p < G; ++p) {
      mbar_arrive_expect_tx(&bar[p], L::kPieceBytes);
      bulk_g2s(sS + p * kRows * kDv, src + p * kRows * kDv, L::kPieceBytes, &bar[p]);
    }
  }
  const __nv_bfloat16* q = static_cast<const __nv_bfloat16*>(a.q);
  const __nv_bfloat16* k = static_cast<const __nv_bfloat16*>(a.k);
  if (tid < kDk) {
    sq[tid] = q[b * a.q_sb + h * a.q_sh + tid];
    sk[tid] = k[b * a.k_sb + h * a.k_sh + tid];
  }
  float vv[C];
  const int64_t vo = b * a.v_sb + h * a.v_sh + C * c;
#pragma unroll
  for (int j = 0; j < C; ++j) vv[j] = ldf(a.v, vo + j, a.v_dt);
  __syncthreads();  // q, k in shared memory; the barriers initialised before anyone waits

  const float lam = a.lam[h];
  const int r0 = rg * kRows;
  float acc[C];
#pragma unroll
  for (int j = 0; j < C; ++j) acc[j] = 0.f;
  mbar_wait(&bar[rg], 0);
#pragma unroll
  for (int i0 = r0; i0 < r0 + kRows; i0 += kUnroll) {
    float s[kUnroll][C];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) load_vec(sS + (i0 + u) * kDv + C * c, s[u]);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = i0 + u;
      const float kk = __bfloat162float(sk[i]), qq = a.scale * __bfloat162float(sq[i]);
#pragma unroll
      for (int j = 0; j < C; ++j) {
        s[u][j] = fmaf(lam, s[u][j], kk * vv[j]);
        acc[j] = fmaf(qq, s[u][j], acc[j]);
      }
      if constexpr (kBulkStore) store_vec(sS + i * kDv + C * c, s[u]);
      else store_vec(dst + i * a.sk + C * c, s[u]);
    }
  }
  if (rg > 0) {
#pragma unroll
    for (int j = 0; j < C; ++j) part[(rg - 1) * kDv + C * c + j] = acc[j];
  }
  if constexpr (kBulkStore) fence_proxy_async();  // our shared writes -> the bulk store's reads
  __syncthreads();
  if constexpr (kBulkStore) {
    if (tid == 0) {
#pragma unroll
      for (int p = 0; p < G; ++p) bulk_s2g(dst + p * kRows * kDv, sS + p * kRows * kDv, L::kPieceBytes);
      bulk_commit();
    }
  }
  // o_e = ((part0 + part1) + part2) + part3: v1's order (group 0's part stays in registers).
  if (rg == 0) {
#pragma unroll
    for (int j = 0; j < C; ++j) {
      float x = acc[j];
#pragma unroll
      for (int g = 1; g < G; ++g) x += part[(g - 1) * kDv + C * c + j];
      stf(a.o, b * a.o_sb + h * a.o_sh + C * c + j, a.o_dt, x);
    }
  }
  // The block's shared memory must outlive the bulk store's reads of it.
  if constexpr (kBulkStore) {
    if (tid == 0) bulk_wait_read<0>();
  }
}

}  // namespace decode_lab::v2
