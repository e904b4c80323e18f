// lab/gemm: the hand-written bf16 gemm (TMA + wgmma) of wgmma_lab.cu, as a header so that other
// labs (lab/decode/overlap_lab --gemm ours) run the same kernel. Y[M, N] = X[M, K] · W[N, K]ᵀ,
// bf16 in, F32 accumulate, bf16 out; M a multiple of 128, N of BN, K of 64; X, W and Y rows
// 16-byte aligned (tensor maps). wgmma_lab.cu's header describes the design and the versions.
#pragma once

#include <cudaTypedefs.h>

#include <cstdio>
#include <cstdlib>

#include "../lab_host.h"
#include "wgmma_common.cuh"

namespace gemm_lab {

using bf16 = __nv_bfloat16;

constexpr int BM = 128, BK = 64, kThreads = 384;

template <int BN, int kStages>
struct Smem {
  static constexpr int kA = BM * BK * 2, kB = BN * BK * 2;  // bytes per stage (1,024-aligned)
  static constexpr int kStage = kA + kB;
  static constexpr int kBarOff = kStages * kStage;
  static constexpr int kBytes = kBarOff + 2 * kStages * 8 + 1024;  // + alignment slack
  static_assert(kA % 1024 == 0 && kB % 1024 == 0, "swizzle atoms");
};

// ---- the two roles, as device functions (wgmma_lab's kernel below; lab/decode/cores_lab runs
// them beside a state role in one block) ----------------------------------------------------------
// Where a tile's operands and output are: X and W tensor maps (boxes {64, BM} and {64, BN}), the
// output's row pitch, the tile's first row and column, and its number of 64-wide k-blocks.
struct TileInfo {
  const CUtensorMap* mx;
  const CUtensorMap* mw;
  bf16* y;
  int n, m0, n0, nk;
};

// The stage ring in shared memory: kStages × (X tile, W tile), then the full and empty barriers.
template <int BN, int kStages>
struct Ring {
  unsigned char* smem;  // 1,024-aligned
  uint64_t* full;       // [kStages] TMA bytes landed (count 1: the producer's arrive.expect_tx)
  uint64_t* empty;      // [kStages] stage consumed (count 2: one arrival per consumer warpgroup)
  __device__ static Ring carve(unsigned char* raw) {
    using S = Smem<BN, kStages>;
    Ring r;
    r.smem = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t{1023});
    r.full = reinterpret_cast<uint64_t*>(r.smem + S::kBarOff);
    r.empty = r.full + kStages;
    return r;
  }
  // One thread, before the block-wide barrier that precedes both roles.
  __device__ void init() const {
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], 2);
    }
    fence_barrier_init();
  }
};

// Producer (one thread): the tiles t = first, first + stride, ... < tiles, each's k-blocks in
// order, into the ring. `tile_of(t)` gives a TileInfo.
template <int BN, int kStages, class TileOf>
__device__ void gemm_produce(const Ring<BN, kStages>& ring, int tiles, int first, int stride, TileOf tile_of) {
  using S = Smem<BN, kStages>;
  int it = 0;  // k-blocks issued, over all tiles: the ring's position
  for (int tile = first; tile < tiles; tile += stride) {
    const TileInfo ti = tile_of(tile);
    for (int kb = 0; kb < ti.nk; ++kb, ++it) {
      const int s = it % kStages;
      // Fill f = it / kStages of stage s needs fill f − 1 consumed: empty[s]'s phase f − 1.
      if (it >= kStages) mbar_wait(&ring.empty[s], ((it / kStages) & 1) ^ 1);
      unsigned char* st = ring.smem + s * S::kStage;
      mbar_arrive_expect_tx(&ring.full[s], S::kStage);
      tma_load_2d(st, ti.mx, kb * BK, ti.m0, &ring.full[s]);
      tma_load_2d(st + S::kA, ti.mw, kb * BK, ti.n0, &ring.full[s]);
    }
  }
}

// Consumer warpgroup c (0 or 1: rows [64c, 64c + 64) of each tile), thread t of its 128: the same
// tiles as the producer, wgmma from the ring, bf16 pairs straight to the output.
template <int BN, int kStages, bool kOverlap, class TileOf>
__device__ void gemm_consume(const Ring<BN, kStages>& ring, int c, int t, int tiles, int first, int stride,
                             TileOf tile_of) {
  using S = Smem<BN, kStages>;
  constexpr int kAcc = BN / 2;  // F32 accumulators per thread (64 rows × BN / 128 threads)
  int it = 0;
  for (int tile = first; tile < tiles; tile += stride) {
    const TileInfo ti = tile_of(tile);
    float d[kAcc];
#pragma unroll
    for (int i = 0; i < kAcc; ++i) d[i] = 0.f;
    int prev = -1;  // kOverlap: the stage whose MMAs may still be running
    for (int kb = 0; kb < ti.nk; ++kb, ++it) {
      const int s = it % kStages;
      mbar_wait(&ring.full[s], (it / kStages) & 1);
      const unsigned char* st = ring.smem + s * S::kStage;
      const unsigned char* a = st + c * 64 * BK * 2;  // this warpgroup's 64 rows: 8 atoms in
      const unsigned char* b = st + S::kA;
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < BK / 16; ++kk) {
        if constexpr (BN == 128) wgmma_m64n128k16(d, desc_k128(a + 32 * kk), desc_k128(b + 32 * kk));
        else wgmma_m64n256k16(d, desc_k128(a + 32 * kk), desc_k128(b + 32 * kk));
      }
      wgmma_commit();
      if constexpr (kOverlap) {
        wgmma_wait<1>();  // the previous k-block's MMAs are done: its stage can go back
        if (prev >= 0 && t == 0) mbar_arrive(&ring.empty[prev]);
        prev = s;
      } else {
        wgmma_wait<0>();
        if (t == 0) mbar_arrive(&ring.empty[s]);
      }
    }
    if constexpr (kOverlap) {
      wgmma_wait<0>();
      if (prev >= 0 && t == 0) mbar_arrive(&ring.empty[prev]);
    }
    fence_regs(d);
    const int r = ti.m0 + 64 * c + frag_row(t), c0 = ti.n0 + frag_col(t);
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
      const int col = c0 + 8 * j;
      *reinterpret_cast<__nv_bfloat162*>(ti.y + static_cast<int64_t>(r) * ti.n + col) =
          __floats2bfloat162_rn(d[4 * j], d[4 * j + 1]);
      *reinterpret_cast<__nv_bfloat162*>(ti.y + static_cast<int64_t>(r + 8) * ti.n + col) =
          __floats2bfloat162_rn(d[4 * j + 2], d[4 * j + 3]);
    }
  }
}

// One gemm. Tile t covers rows (t mod M/BM)·BM and columns (t div M/BM)·BN, so CTAs that run
// together share a weight tile; a grid smaller than the tiles makes the kernel persistent.
// kRegs: the register cap at launch, per thread (ptxas allocates every role within it). At 168
// (= 65,536 / 384, one block per SM) the producer gives registers back and the consumers take
// them (setmaxnreg 40 / 232). Below that the block leaves registers of its SM free for another
// kernel's block (lab/decode/overlap_lab --gemm ours: a state block beside each gemm CTA), and
// no role reallocates.
template <int BN, int kStages, bool kOverlap, int kRegs = 168>
__global__ void __maxnreg__(kRegs)
    gemm_tma_wgmma(const __grid_constant__ CUtensorMap mx, const __grid_constant__ CUtensorMap mw, bf16* y, int M,
                   int N, int K) {
  extern __shared__ unsigned char smem_raw[];
  const Ring<BN, kStages> ring = Ring<BN, kStages>::carve(smem_raw);
  const int wg = threadIdx.x / 128, t = threadIdx.x % 128;
  const int mt = M / BM, tiles = mt * (N / BN);
  auto tile_of = [&](int tile) { return TileInfo{&mx, &mw, y, N, (tile % mt) * BM, (tile / mt) * BN, K / BK}; };
  if (threadIdx.x == 0) ring.init();
  __syncthreads();
  if (wg == 0) {  // producer warpgroup: one thread issues
    if constexpr (kRegs >= 168) setmaxnreg_dec<40>();
    if (t == 0) gemm_produce(ring, tiles, blockIdx.x, gridDim.x, tile_of);
    return;
  }
  if constexpr (kRegs >= 168) setmaxnreg_inc<232>();
  gemm_consume<BN, kStages, kOverlap>(ring, wg - 1, t, tiles, blockIdx.x, gridDim.x, tile_of);
}

// ---- host: tensor maps --------------------------------------------------------------------------
// The driver's encoder, fetched at run time (the labs need not link -lcuda); nullptr if absent.
inline PFN_cuTensorMapEncodeTiled_v12000 get_encoder() {
  void* fp = nullptr;
  cudaDriverEntryPointQueryResult q{};
  CK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fp, 12000, cudaEnableDefault, &q));
  if (q != cudaDriverEntryPointSuccess || !fp) {
    std::fprintf(stderr, "wgmma_lab: cuTensorMapEncodeTiled is not available\n");
    std::exit(1);
  }
  return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fp);
}

// A row-major [rows, k] bf16 matrix read in boxes of {64 along k, box_rows rows}, 128-byte swizzle.
inline CUtensorMap make_map(PFN_cuTensorMapEncodeTiled_v12000 enc, const bf16* p, int rows, int k, int box_rows) {
  CUtensorMap m;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(k), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(k) * 2};
  const cuuint32_t box[2] = {BK, static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t estr[2] = {1, 1};
  const CUresult r = enc(&m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<bf16*>(p), dims, strides, box, estr,
                         CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                         CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    std::fprintf(stderr, "wgmma_lab: cuTensorMapEncodeTiled failed (%d) for [%d, %d] box %d\n", static_cast<int>(r),
                 rows, k, box_rows);
    std::exit(1);
  }
  return m;
}

}  // namespace gemm_lab
