// experiments/gemm: the hand-written bf16 gemm (TMA + wgmma) of wgmma.cu, as a header so that other
// experiments (experiments/decode/overlap --gemm ours) run the same kernel. Y[M, N] = X[M, K] · W[N, K]ᵀ,
// bf16 in, F32 accumulate, bf16 out; M a multiple of 128, N of BN, K of 64; X, W and Y rows
// 16-byte aligned (tensor maps). wgmma.cu's header describes the design and the versions.
#pragma once

#include <cudaTypedefs.h>
#include <cstdio>
#include <cstdlib>
#include <cuda.h>  // CUtensorMap (driver types only: the encoder is fetched at run time)
#include <cuda_bf16.h>
#include <cstdint>

#include "experiments/host.h"
#include "ops/cuda/bulk_copy.cuh"

// experiments/gemm: the Hopper pieces a hand-written bf16 gemm needs, as thin inline-PTX wrappers: tensor
// copies (TMA) into 128-byte-swizzled shared tiles, shared-memory matrix descriptors for those
// tiles, warpgroup MMAs (wgmma) and register reallocation (setmaxnreg). sm_90a only. The
// mbarrier and bulk-copy wrappers are production's (ops/cuda/bulk_copy.cuh).
//
// Tile layout. A tensor map with CU_TENSOR_MAP_SWIZZLE_128B and a box of {64, rows} bf16 (the
// inner 64 elements = 128 bytes along K) writes `rows` rows of 128 bytes each, the 16-byte chunks
// of row r XOR-permuted by (r mod 8); eight rows make one 1,024-byte swizzle atom, so each tile
// starts on a 1,024-byte boundary. wgmma reads such a tile "K-major" through a descriptor whose
// stride byte offset is 1,024 (from one 8-row group to the next) and swizzle mode 128B; the
// leading byte offset is unused for swizzled K-major layouts (1 by convention). The k-th 16-wide
// slice of the 64-wide tile starts 32·k bytes after the tile: the hardware applies the swizzle to
// the address it computes, so the start address simply advances inside the atom.
namespace gemm_exp {

using laplace::cuda::fence_barrier_init;
using laplace::cuda::fence_proxy_async;
using laplace::cuda::mbar_arrive_expect_tx;
using laplace::cuda::mbar_init;
using laplace::cuda::mbar_try_wait;
using laplace::cuda::smem_u32;

// Until the phase of parity `parity` has completed; traps after 2 s (a wrong parity or a copy
// never issued then fails the launch instead of hanging the GPU). No printf: any function call in
// a kernel makes ptxas serialise its wgmma pipeline (warning C7510).
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  if (mbar_try_wait(bar, parity)) return;
  uint64_t t0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  while (!mbar_try_wait(bar, parity)) {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    if (t - t0 > 2000000000ull) asm volatile("trap;");
  }
}

// A plain arrival (no transaction bytes).
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}

// A 2-D tile of `map` at element coordinates (c0 along the inner dimension, c1 along the outer)
// into shared memory at `dst`; its bytes complete on `bar`.
__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, int c0, int c1, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(
          smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(smem_u32(bar))
      : "memory");
}

// Descriptor of a K-major, 128-byte-swizzled tile slice at `p` (see the header comment).
__device__ __forceinline__ uint64_t desc_k128(const void* p) {
  const uint64_t a = smem_u32(p);
  return ((a & 0x3FFFF) >> 4) | (uint64_t{1} << 16) | (uint64_t{1024 >> 4} << 32) | (uint64_t{1} << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
// Until at most N of this warpgroup's committed wgmma groups are pending.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// The accumulators are written by the asynchronous MMAs behind the compiler's back: this tells it
// that they may have changed (after a wait), so that it neither caches nor reorders them.
template <int N>
__device__ __forceinline__ void fence_regs(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

template <int R>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(R));
}
template <int R>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(R));
}

// D[64×128] (+)= A[64×16]·B[16×128], A and B K-major in shared memory (descriptors), F32
// accumulators: 64 per thread. scale-d = 1 (accumulate): callers zero D first.
__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], uint64_t da, uint64_t db) {
  asm volatile(
      "{\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, "
      "%23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, "
      "%44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "%64, %65, 1, 1, 1, 0, 0;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(da), "l"(db));
}

// D[64×256] (+)= A[64×16]·B[16×256]: 128 accumulators per thread.
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], uint64_t da, uint64_t db) {
  asm volatile(
      "{\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, "
      "%23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, "
      "%44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, "
      "%65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, "
      "%86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, "
      "%106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, "
      "%123, %124, %125, %126, %127}, "
      "%128, %129, 1, 1, 1, 0, 0;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
        "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]),
        "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]),
        "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]),
        "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "l"(da), "l"(db));
}

// The D fragment of m64nNk16 (F32): thread t of the warpgroup (warp w = t / 32, lane l) holds,
// for each 8-column group j < N / 8, d[4j + 0, 1] at row 16w + l / 4, columns 8j + 2(l % 4) + {0, 1},
// and d[4j + 2, 3] at row 16w + l / 4 + 8, the same columns.
__device__ __forceinline__ int frag_row(int t) { return 16 * (t / 32) + (t % 32) / 4; }
__device__ __forceinline__ int frag_col(int t) { return 2 * (t % 4); }

}  // namespace gemm_exp

namespace gemm_exp {

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

// ---- the two roles, as device functions (experiment_gemm_wgmma's kernel below; experiments/decode/experiment_decode_cores runs
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
// kernel's block (experiments/decode/overlap --gemm ours: a state block beside each gemm CTA), and
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
// The driver's encoder, fetched at run time (the experiments need not link -lcuda); nullptr if absent.
inline PFN_cuTensorMapEncodeTiled_v12000 get_encoder() {
  void* fp = nullptr;
  cudaDriverEntryPointQueryResult q{};
  CK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fp, 12000, cudaEnableDefault, &q));
  if (q != cudaDriverEntryPointSuccess || !fp) {
    std::fprintf(stderr, "experiment_gemm_wgmma: cuTensorMapEncodeTiled is not available\n");
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
    std::fprintf(stderr, "experiment_gemm_wgmma: cuTensorMapEncodeTiled failed (%d) for [%d, %d] box %d\n", static_cast<int>(r),
                 rows, k, box_rows);
    std::exit(1);
  }
  return m;
}

}  // namespace gemm_exp
