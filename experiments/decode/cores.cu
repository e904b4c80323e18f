// experiments/decode/cores: can one kernel run a decode step's gemms and its state stream on the
// same SMs at the same time?
//
// Why (docs/serving.md §4): 53,000 tokens/s at 1,280 sequences needs each layer's four gemms
// (0.39 ms) hidden under its state stream (0.77 ms F32). Splitting the SMs between a state
// kernel and cuBLASLt (experiment_decode_overlap) gained at most 3.6 %: each side then runs on half the GPU.
// cuBLASLt's Hopper kernels hold a whole SM (registers and shared memory), so nothing can run
// beside them. This experiment tries the other partition: inside every SM. One persistent block per
// SM has two roles that never wait for each other:
//   gemm role   8 warps: C[M×N] = A[M×K]·W[N×K]ᵀ (bf16 in, fp32 accumulate, bf16 out) in
//               128×128×32 tiles, mma.sync m16n8k16 from a 4-stage cp.async ring (80 KB);
//               warp tile 64×32; tiles walked m-minor so the blocks that share a W tile run
//               together (W read from HBM about once). Up to four problems (the layer's
//               qkvg, wo, w12 and w3 of the other half batch), walked one after the other.
//   state role  6 warps = experiments/decode v1's block (48 four-column vectors × 4 row groups):
//               per (b, h) item S ← λS + kᵀv in place and o = (scale·q)S with v1's fmaf order,
//               UNROLL rows loaded before any is used, items w = block, block + grid, …
// The roles sync only among themselves (named barriers 1 and 2), so each runs at the pace its
// resources allow. The question is how close "both" comes to max(gemm alone, state alone).
//
// The wgmma family (after the first results: the mma.sync role reached 211 TFLOP/s, where the
// design needs ≥ 370 for F32 states and more for BF16): the same state role beside experiments/gemm's
// TMA + wgmma gemm (wgmma_gemm.cuh's gemm_produce / gemm_consume: BN 128, 4 stages, one k-block
// in flight). 480 threads: warps 0-7 are the two consumer warpgroups (wgmma needs warpgroups
// that start at a warp index divisible by 4), warp 8's first thread the TMA producer, warps
// 9-14 the state role; 136 registers a thread (65,536 / 480), no setmaxnreg.
//
//   nvcc -O3 -std=c++17 -I. -gencode=arch=compute_90a,code=sm_90a -o experiment_decode_cores experiments/decode/cores.cu
//   ./experiment_decode_cores [--B 640] [--M 640] [--reps 20] [--sustain 20] [--problems qkvg,wo,w12,w3] [--states f32|bf16]
//
// --B: sequences whose states stream (half of 1,280); --M: rows of the gemms (the other half);
// --states: the state dtype (bf16: half the bytes per state, the 90,000 tokens/s target's case;
// the state role and v1 then load 8-byte BF16 vectors).
// Validation: the state role's states and o must equal v1's bit for bit (count of differing
// 16-byte words, as experiment_decode); every gemm's output is checked at 256 sampled entries against
// an F64 dot product of the same bf16 inputs (relative to the samples' RMS; bf16 output, so
// ~2e-3 is expected, 1e-2 the bound). Exit status 1 on a failed check.
//
// Lines (median ms of `reps` single calls | mean of `sustain` back to back): v1 alone (B·H
// blocks, the production layout), gemm role alone, state role alone (UNROLL 8 and 24), both,
// then the wgmma family's gemm alone, state alone (UNROLL 8) and both (8, 24);
// then "hidden" = (gemm + state − both) / min(gemm, state): 0 = the roles serialise, 1 = the
// shorter one is hidden completely.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <numeric>
#include <string>
#include <vector>

#include "experiments/gemm/wgmma_gemm.cuh"
#include "experiments/host.h"
#include "experiments/decode/kernels.cuh"

namespace {

using decode_exp::DecArgs;
using experiments::bf2f;
using experiments::f2bf;

constexpr int H = 16, DK = 96, DV = 192, D = 3072, F = 8192;

// ---- gemm role ------------------------------------------------------------------------------
constexpr int BM = 128, BN = 128, BK = 32;
constexpr int LDS = BK + 8;  // row pitch 80 bytes: the 8 rows of an ldmatrix hit distinct banks
constexpr int kStages = 4;
constexpr int kGemmWarps = 8, kGemmThreads = 32 * kGemmWarps;
constexpr int kStateThreads = 192;  // v1's block: dv / 4 column vectors × 4 row groups
constexpr int kThreads = kGemmThreads + kStateThreads;
constexpr int kStageElems = (BM + BN) * LDS;
constexpr int kGemmSmem = kStages * kStageElems * 2;  // 81,920 bytes
constexpr int kMaxProblems = 4;

struct Gemm {
  const __nv_bfloat16* A;  // [M, K] row-major
  const __nv_bfloat16* W;  // [N, K] row-major (a weight matrix as stored)
  __nv_bfloat16* C;        // [M, N]
  int M, N, K;
};
struct GemmList {
  Gemm p[kMaxProblems];
  int n = 0;
};

__device__ __forceinline__ uint32_t su32(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void bar_sync(int id, int n) { asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory"); }
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void ldsm4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}
__device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// A 16×16 at (r0, k0) of a row-major [m][LDS] tile (experiments/gla's lda).
__device__ __forceinline__ void lda(uint32_t (&a)[4], const __nv_bfloat16* s, int r0, int k0) {
  const int l = threadIdx.x & 31;
  ldsm4(a, su32(s + (r0 + (l & 15)) * LDS + k0 + (l >> 4) * 8));
}
// B of the n-tiles n0 and n0 + 8, k0..k0+15, from a [n][LDS] tile: r[0], r[1] = tile n0;
// r[2], r[3] = tile n0 + 8 (experiments/gla's ldb_nk).
__device__ __forceinline__ void ldb(uint32_t (&r)[4], const __nv_bfloat16* s, int n0, int k0) {
  const int l = threadIdx.x & 31, mi = l >> 3;
  ldsm4(r, su32(s + (n0 + (l & 7) + (mi >> 1) * 8) * LDS + k0 + (mi & 1) * 8));
}

// Problem and tile of global tile index t (problems back to back; inside one, m-minor).
__device__ __forceinline__ const Gemm& tile_of(const GemmList& g, int t, int* m0, int* n0) {
  int p = 0;
  for (;;) {
    const int tm = g.p[p].M / BM, tiles = tm * (g.p[p].N / BN);
    if (t < tiles || p + 1 == g.n) {
      *m0 = (t % tm) * BM;
      *n0 = (t / tm) * BN;
      return g.p[p];
    }
    t -= tiles;
    ++p;
  }
}

__device__ void gemm_role(const GemmList& g, __nv_bfloat16* sm) {
  const int gt = threadIdx.x, warp = gt >> 5, lane = gt & 31;
  const int wm = warp >> 2, wn = warp & 3;  // 2 × 4 warps, warp tile 64 × 32
  int total = 0;
  for (int p = 0; p < g.n; ++p) total += (g.p[p].M / BM) * (g.p[p].N / BN);
  for (int t = blockIdx.x; t < total; t += gridDim.x) {
    int m0, n0;
    const Gemm& pb = tile_of(g, t, &m0, &n0);
    const int nk = pb.K / BK;
    // Stage s ← the k-block kb of A's rows m0.. and W's rows n0..: 2 + 2 16-byte pieces a thread.
    auto load_stage = [&](int s, int kb) {
      __nv_bfloat16* As = sm + s * kStageElems;
      __nv_bfloat16* Ws = As + BM * LDS;
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int c = gt + i * kGemmThreads, r = c >> 2, q = c & 3;
        cp_async16(su32(As + r * LDS + q * 8), pb.A + static_cast<int64_t>(m0 + r) * pb.K + kb * BK + q * 8);
        cp_async16(su32(Ws + r * LDS + q * 8), pb.W + static_cast<int64_t>(n0 + r) * pb.K + kb * BK + q * 8);
      }
    };
    float acc[4][4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int r = 0; r < 4; ++r) acc[i][j][r] = 0.f;
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < nk) load_stage(s, s);
      cp_async_commit();
    }
    for (int kb = 0; kb < nk; ++kb) {
      cp_async_wait<kStages - 2>();
      // k-block kb has landed for every gemm thread, and all of them are done reading the stage
      // that the next load overwrites (k-block kb − 1's).
      bar_sync(1, kGemmThreads);
      if (kb + kStages - 1 < nk) load_stage((kb + kStages - 1) % kStages, kb + kStages - 1);
      cp_async_commit();
      const __nv_bfloat16* As = sm + (kb % kStages) * kStageElems;
      const __nv_bfloat16* Ws = As + BM * LDS;
#pragma unroll
      for (int ks = 0; ks < BK / 16; ++ks) {
        uint32_t af[4][4], bfr[2][4];
#pragma unroll
        for (int mt = 0; mt < 4; ++mt) lda(af[mt], As, wm * 64 + mt * 16, ks * 16);
#pragma unroll
        for (int np = 0; np < 2; ++np) ldb(bfr[np], Ws, wn * 32 + np * 16, ks * 16);
#pragma unroll
        for (int mt = 0; mt < 4; ++mt)
#pragma unroll
          for (int np = 0; np < 2; ++np) {
            mma(acc[mt][2 * np], af[mt], bfr[np][0], bfr[np][1]);
            mma(acc[mt][2 * np + 1], af[mt], bfr[np][2], bfr[np][3]);
          }
      }
    }
    cp_async_wait<0>();
    bar_sync(1, kGemmThreads);  // the next tile's first loads overwrite stages still being read
    // C fragment (g = lane / 4, q = lane % 4): rows g and g + 8, columns 2q and 2q + 1.
    const int gr = lane >> 2, gq = lane & 3;
#pragma unroll
    for (int mt = 0; mt < 4; ++mt)
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        const int r = m0 + wm * 64 + mt * 16 + gr, c = n0 + wn * 32 + nt * 8 + 2 * gq;
        *reinterpret_cast<__nv_bfloat162*>(pb.C + static_cast<int64_t>(r) * pb.N + c) =
            __floats2bfloat162_rn(acc[mt][nt][0], acc[mt][nt][1]);
        *reinterpret_cast<__nv_bfloat162*>(pb.C + static_cast<int64_t>(r + 8) * pb.N + c) =
            __floats2bfloat162_rn(acc[mt][nt][2], acc[mt][nt][3]);
      }
  }
}

// ---- state role: decode_v1's block as 6 warps of a shared block -----------------------------
// kBase: the block's first state-role thread.
template <class ST, int UNROLL, int kBase = kGemmThreads>
__device__ void state_role(const DecArgs& a, float* qs, float* ks, float (*part)[DV]) {
  constexpr int C = 4, G = 4;
  const int tid = threadIdx.x - kBase;
  const int nv = DV / C, c = tid % nv, rg = tid / nv;
  constexpr int rows = (DK + G - 1) / G;
  const int r0 = rg * rows, r1 = min(DK, r0 + rows);
  for (int item = blockIdx.x; item < a.B * a.H; item += gridDim.x) {
    const int b = item / a.H, h = item - b * a.H;
    for (int i = tid; i < DK; i += kStateThreads) {
      qs[i] = a.scale * decode_exp::ldf(a.q, b * a.q_sb + h * a.q_sh + i, a.q_dt);
      ks[i] = decode_exp::ldf(a.k, b * a.k_sb + h * a.k_sh + i, a.k_dt);
    }
    float vv[C];
    const int64_t vo = b * a.v_sb + h * a.v_sh + C * c;
#pragma unroll
    for (int j = 0; j < C; ++j) vv[j] = decode_exp::ldf(a.v, vo + j, a.v_dt);
    bar_sync(2, kStateThreads);
    const int64_t slot = a.slots ? a.slots[b] : b;
    const int64_t base = slot * a.ss + h * a.sh + C * c;
    const ST* src = static_cast<const ST*>(a.s_in) + base;
    ST* dst = static_cast<ST*>(a.s_out) + base;
    const float lam = a.lam[h];
    float acc[C];
#pragma unroll
    for (int j = 0; j < C; ++j) acc[j] = 0.f;
    for (int i0 = r0; i0 < r1; i0 += UNROLL) {
      float s[UNROLL][C];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        if (i0 + u < r1) {
          decode_exp::load_vec(src + (i0 + u) * a.sk, s[u]);
        } else {
#pragma unroll
          for (int j = 0; j < C; ++j) s[u][j] = 0.f;
        }
      }
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int i = i0 + u;
        if (i >= r1) break;
        const float kk = ks[i], qq = qs[i];
#pragma unroll
        for (int j = 0; j < C; ++j) {
          s[u][j] = fmaf(lam, s[u][j], kk * vv[j]);
          acc[j] = fmaf(qq, s[u][j], acc[j]);
        }
        decode_exp::store_vec(dst + i * a.sk, s[u]);
      }
    }
#pragma unroll
    for (int j = 0; j < C; ++j) part[rg][C * c + j] = acc[j];
    bar_sync(2, kStateThreads);
    for (int e = tid; e < DV; e += kStateThreads) {  // o_e = Σ_rg part[rg][e] in group order (v1)
      float x = part[0][e];
#pragma unroll
      for (int g = 1; g < G; ++g) x += part[g][e];
      decode_exp::stf(a.o, b * a.o_sb + h * a.o_sh + e, a.o_dt, x);
    }
    bar_sync(2, kStateThreads);  // qs, ks and part are the next item's
  }
}

// At most 65,536 / 448 = 146 registers a thread (one block per SM): the gemm role's 64
// accumulators and fragments fit; the compiler gives both roles the same count.
template <class ST, bool kGemm, bool kState, int UNROLL>
__global__ void __launch_bounds__(kThreads, 1) cores_kernel(GemmList g, DecArgs d) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ float qs[DK], ks[DK];
  __shared__ float part[4][DV];
  if (threadIdx.x < kGemmThreads) {
    if constexpr (kGemm) gemm_role(g, reinterpret_cast<__nv_bfloat16*>(smem));
  } else {
    if constexpr (kState) state_role<ST, UNROLL>(d, qs, ks, part);
  }
}

// ---- the wgmma family: experiments/gemm's roles beside the state role ------------------------------------
constexpr int kWgBn = 128, kWgStages = 4;
constexpr int kWgProducer = 8 * 32;                       // warp 8's first thread
constexpr int kWgStateBase = 9 * 32;                      // warps 9-14
constexpr int kWgThreads = kWgStateBase + kStateThreads;  // 480
constexpr int kWgSmem = gemm_exp::Smem<kWgBn, kWgStages>::kBytes;

// The problems as tensor maps (kernel parameter space, where TMA may read them).
struct WgList {
  CUtensorMap x[kMaxProblems], w[kMaxProblems];
  __nv_bfloat16* y[kMaxProblems];
  int M[kMaxProblems], N[kMaxProblems], K[kMaxProblems];
  int n = 0;
};

template <class ST, bool kGemm, bool kState, int UNROLL>
__global__ void __launch_bounds__(kWgThreads, 1) cores_wgmma_kernel(const __grid_constant__ WgList L, DecArgs d) {
  extern __shared__ unsigned char smem_raw[];
  __shared__ float qs[DK], ks[DK];
  __shared__ float part[4][DV];
  const auto ring = gemm_exp::Ring<kWgBn, kWgStages>::carve(smem_raw);
  int total = 0;
  for (int p = 0; p < L.n; ++p) total += (L.M[p] / BM) * (L.N[p] / kWgBn);
  // Problems back to back; inside one, m-minor (as tile_of above).
  auto tile_of = [&](int t) {
    int p = 0;
    for (;;) {
      const int tm = L.M[p] / BM, tiles = tm * (L.N[p] / kWgBn);
      if (t < tiles || p + 1 == L.n)
        return gemm_exp::TileInfo{&L.x[p], &L.w[p], L.y[p], L.N[p], (t % tm) * BM, (t / tm) * kWgBn, L.K[p] / 64};
      t -= tiles;
      ++p;
    }
  };
  if (threadIdx.x == 0) ring.init();
  __syncthreads();
  // The other roles branch off and return; the consumers fall through. With the consumer code
  // inside an if-branch instead, ptxas serialised the MMAs (warning C7518, "WG.DP in divergent
  // path"), whatever the branch's condition.
  const int wg = threadIdx.x / 128;
  if (wg >= 2) {
    if (threadIdx.x >= kWgStateBase) {
      if constexpr (kState) state_role<ST, UNROLL, kWgStateBase>(d, qs, ks, part);
    } else if (threadIdx.x == kWgProducer) {
      if constexpr (kGemm) gemm_exp::gemm_produce(ring, total, blockIdx.x, gridDim.x, tile_of);
    }
    return;
  }
  if constexpr (kGemm)
    gemm_exp::gemm_consume<kWgBn, kWgStages, true>(ring, wg, threadIdx.x % 128, total, blockIdx.x, gridDim.x, tile_of);
}

// Deterministic bf16 matrices from an element hash (decode_common's state_init, exact on host
// and device), scaled; the host recomputes any element for the F64 check.
__host__ __device__ inline float mat_value(uint64_t seed, uint64_t idx, float scale) {
  return scale * decode_exp::state_init(idx + (seed << 40));
}
__global__ void init_mat(__nv_bfloat16* p, uint64_t n, uint64_t seed, float scale) {
  for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n; i += (uint64_t)gridDim.x * blockDim.x)
    p[i] = __float2bfloat16_rn(mat_value(seed, i, scale));
}

struct Shape {
  const char* name;
  int N, K;
};
const Shape kShapes[] = {{"qkvg", 9216, D}, {"wo", D, H * DV}, {"w12", 2 * F, D}, {"w3", D, F}};

using experiments::median;

template <class T>
struct Tag {
  using type = T;
};

}  // namespace

int main(int argc, char** argv) {
  int B = 640, M = 640, reps = 20, sustain = 20;
  std::string problems = "qkvg,wo,w12,w3", states_dt = "f32";
  auto usage = [] {
    std::fprintf(stderr,
                 "usage: experiment_decode_cores [--B 640] [--M 640] [--reps 20] [--sustain 20] [--problems qkvg,wo,w12,w3] "
                 "[--states f32|bf16]\n");
    return 2;
  };
  for (int i = 1; i < argc; i += 2) {
    if (i + 1 >= argc) return usage();
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--B") B = std::atoi(v.c_str());
    else if (k == "--M") M = std::atoi(v.c_str());
    else if (k == "--reps") reps = std::atoi(v.c_str());
    else if (k == "--sustain") sustain = std::atoi(v.c_str());
    else if (k == "--problems") problems = v;
    else if (k == "--states" && (v == "f32" || v == "bf16")) states_dt = v;
    else return usage();
  }
  if (B < 1 || M < BM || M % BM != 0 || reps < 1 || sustain < 1) {
    std::fprintf(stderr, "experiment_decode_cores: need B >= 1 and M a positive multiple of %d\n", BM);
    return 2;
  }
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount;
  std::printf("%s, %d SMs; one block of %d threads per SM (%d gemm, %d state), %d bytes of dynamic shared memory\n",
              prop.name, sms, kThreads, kGemmThreads, kStateThreads, kGemmSmem);

  // ---- gemm problems (the other half batch's layer: M rows each)
  GemmList gl;
  double flop = 0;
  std::vector<__nv_bfloat16*> bufs;
  std::vector<std::string> names;
  for (size_t p = 0; p <= problems.size();) {
    size_t e = problems.find(',', p);
    if (e == std::string::npos) e = problems.size();
    const std::string nm = problems.substr(p, e - p);
    p = e + 1;
    const Shape* sh = nullptr;
    for (const Shape& s : kShapes)
      if (nm == s.name) sh = &s;
    if (!sh || gl.n == kMaxProblems) {
      std::fprintf(stderr, "experiment_decode_cores: unknown or too many problems: %s\n", problems.c_str());
      return 2;
    }
    Gemm& g = gl.p[gl.n];
    g.M = M, g.N = sh->N, g.K = sh->K;
    __nv_bfloat16 *A, *W, *C;
    CK(cudaMalloc(&A, static_cast<size_t>(M) * g.K * 2));
    CK(cudaMalloc(&W, static_cast<size_t>(g.N) * g.K * 2));
    CK(cudaMalloc(&C, static_cast<size_t>(M) * g.N * 2));
    init_mat<<<2048, 256>>>(A, static_cast<uint64_t>(M) * g.K, 2 * gl.n + 1, 1.0f);
    init_mat<<<2048, 256>>>(W, static_cast<uint64_t>(g.N) * g.K, 2 * gl.n + 2, 0.05f);
    CK(cudaGetLastError());
    g.A = A, g.W = W, g.C = C;
    bufs.insert(bufs.end(), {A, W, C});
    names.push_back(nm);
    flop += 2.0 * M * g.N * static_cast<double>(g.K);
    ++gl.n;
  }

  // The same problems as tensor maps, for the wgmma family.
  static_assert(BM == gemm_exp::BM, "one tile height for both families");
  WgList wl;
  {
    const auto enc = gemm_exp::get_encoder();
    for (int p = 0; p < gl.n; ++p) {
      const Gemm& g = gl.p[p];
      wl.x[p] = gemm_exp::make_map(enc, g.A, g.M, g.K, gemm_exp::BM);
      wl.w[p] = gemm_exp::make_map(enc, g.W, g.N, g.K, kWgBn);
      wl.y[p] = g.C, wl.M[p] = g.M, wl.N[p] = g.N, wl.K[p] = g.K;
    }
    wl.n = gl.n;
  }

  // ---- states of B sequences (F32 or BF16), experiment_decode's inputs
  const bool bf16_states = states_dt == "bf16";
  const int64_t npairs = static_cast<int64_t>(B) * H, state_elems = npairs * DK * DV;
  const size_t state_bytes = static_cast<size_t>(state_elems) * (bf16_states ? 2 : 4);
  std::vector<uint16_t> hq(npairs * DK), hk(npairs * DK), hv(npairs * DV);
  decode_exp::Rng rs{12345};
  for (auto& x : hq) x = f2bf(static_cast<float>(2 * rs.uniform() - 1));
  for (auto& x : hk) x = f2bf(static_cast<float>(2 * rs.uniform() - 1));
  for (auto& x : hv) x = f2bf(static_cast<float>(2 * rs.uniform() - 1));
  void *states, *pristine, *sref;
  float *o, *oref;
  __nv_bfloat16 *q, *k, *v;
  unsigned long long* ndiff;
  CK(cudaMalloc(&states, state_bytes));
  CK(cudaMalloc(&pristine, state_bytes));
  CK(cudaMalloc(&sref, state_bytes));
  CK(cudaMalloc(&o, npairs * DV * 4));
  CK(cudaMalloc(&oref, npairs * DV * 4));
  CK(cudaMalloc(&q, hq.size() * 2));
  CK(cudaMalloc(&k, hk.size() * 2));
  CK(cudaMalloc(&v, hv.size() * 2));
  CK(cudaMalloc(&ndiff, sizeof(unsigned long long)));
  CK(cudaMemcpy(q, hq.data(), hq.size() * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(k, hk.data(), hk.size() * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(v, hv.data(), hv.size() * 2, cudaMemcpyHostToDevice));
  if (bf16_states)
    decode_exp::init_states<__nv_bfloat16>
        <<<4096, 256>>>(static_cast<__nv_bfloat16*>(pristine), static_cast<uint64_t>(state_elems));
  else
    decode_exp::init_states<float><<<4096, 256>>>(static_cast<float*>(pristine), static_cast<uint64_t>(state_elems));
  CK(cudaGetLastError());
  DecArgs a = decode_exp::exp_args(B, H, DK, DV);
  a.q = q, a.k = k, a.v = v, a.o = o;
  a.s_in = states, a.s_out = states;
  CK(cudaDeviceSynchronize());

  // v1's bits: one step from the pristine states.
  CK(cudaMemcpy(states, pristine, state_bytes, cudaMemcpyDeviceToDevice));
  auto v1_step = [&] {
    if (bf16_states) decode_exp::v1::gla_decode_kernel<__nv_bfloat16><<<static_cast<unsigned>(npairs), DV>>>(a);
    else decode_exp::v1::gla_decode_kernel<float><<<static_cast<unsigned>(npairs), DV>>>(a);
  };
  v1_step();
  CK(cudaGetLastError());
  CK(cudaMemcpy(sref, states, state_bytes, cudaMemcpyDeviceToDevice));
  CK(cudaMemcpy(oref, o, npairs * DV * 4, cudaMemcpyDeviceToDevice));

  // family 0: the mma.sync gemm role (448 threads); 1: the wgmma roles (480 threads).
  struct Variant {
    std::string name;
    bool gemm, state;
    int family;
    const void* fn;
    std::function<void()> launch;
  };
  auto mma_var = [&](const char* name, bool gemm, bool state, void (*k)(GemmList, DecArgs)) {
    return Variant{name, gemm, state, 0, reinterpret_cast<const void*>(k),
                   [&, k] { k<<<sms, kThreads, kGemmSmem>>>(gl, a); }};
  };
  auto wg_var = [&](const char* name, bool gemm, bool state, void (*k)(WgList, DecArgs)) {
    return Variant{name, gemm, state, 1, reinterpret_cast<const void*>(k),
                   [&, k] { k<<<sms, kWgThreads, kWgSmem>>>(wl, a); }};
  };
  auto variants = [&](auto tag) {
    using ST = typename decltype(tag)::type;
    return std::vector<Variant>{
        mma_var("gemm role alone", true, false, cores_kernel<ST, true, false, 8>),
        mma_var("state role alone, unroll 8", false, true, cores_kernel<ST, false, true, 8>),
        mma_var("state role alone, unroll 24", false, true, cores_kernel<ST, false, true, 24>),
        mma_var("both, unroll 8", true, true, cores_kernel<ST, true, true, 8>),
        mma_var("both, unroll 24", true, true, cores_kernel<ST, true, true, 24>),
        wg_var("wgmma gemm alone", true, false, cores_wgmma_kernel<ST, true, false, 8>),
        wg_var("wgmma: state alone, unroll 8", false, true, cores_wgmma_kernel<ST, false, true, 8>),
        wg_var("wgmma: both, unroll 8", true, true, cores_wgmma_kernel<ST, true, true, 8>),
        wg_var("wgmma: both, unroll 24", true, true, cores_wgmma_kernel<ST, true, true, 24>),
    };
  };
  const std::vector<Variant> vars = bf16_states ? variants(Tag<__nv_bfloat16>{}) : variants(Tag<float>{});
  for (const Variant& var : vars) {
    const int smem = var.family ? kWgSmem : kGemmSmem, threads = var.family ? kWgThreads : kThreads;
    CK(cudaFuncSetAttribute(var.fn, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    cudaFuncAttributes fa;
    CK(cudaFuncGetAttributes(&fa, var.fn));
    int occ = 0;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, var.fn, threads, smem));
    std::printf("  %-28s %3d registers, %5zu bytes spilled, %d block(s) per SM\n", var.name.c_str(), fa.numRegs,
                static_cast<size_t>(fa.localSizeBytes), occ);
  }

  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  auto timed = [&](const std::function<void()>& f, double* sus) {
    std::vector<double> t;
    for (int i = 0; i < reps + 2; ++i) {
      CK(cudaEventRecord(e0));
      f();
      CK(cudaEventRecord(e1));
      CK(cudaEventSynchronize(e1));
      float ms = 0;
      CK(cudaEventElapsedTime(&ms, e0, e1));
      if (i >= 2) t.push_back(ms);
    }
    CK(cudaEventRecord(e0));
    for (int i = 0; i < sustain; ++i) f();
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    *sus = ms / sustain;
    CK(cudaGetLastError());
    return median(t);
  };
  const double sbytes = 2.0 * static_cast<double>(state_bytes);
  std::printf("%s states: %d sequences x %d heads, %.3f GB read + written; gemms (M = %d):", bf16_states ? "BF16" : "F32",
              B, H, sbytes / 1e9, M);
  for (const auto& n : names) std::printf(" %s", n.c_str());
  std::printf(", %.1f GFLOP\n", flop / 1e9);

  int fails = 0;
  // v1 alone (production layout) for reference.
  {
    double sus = 0;
    const double t = timed(v1_step, &sus);
    std::printf("  %-28s %8.4f ms | %8.4f ms sustained  %5.3f TB/s\n", "v1 alone (B·H blocks)", t, sus, sbytes / (sus * 1e9));
  }
  double t_gemm[2] = {0, 0}, t_state[2][2] = {{0, 0}, {0, 0}};  // [family], [family][unroll 24]
  std::vector<uint16_t> hc;
  for (const Variant& var : vars) {
    // Validation run from the pristine states.
    CK(cudaMemcpy(states, pristine, state_bytes, cudaMemcpyDeviceToDevice));
    CK(cudaMemset(o, 0xff, npairs * DV * 4));
    for (int p = 0; p < gl.n; ++p) CK(cudaMemset(gl.p[p].C, 0xff, static_cast<size_t>(M) * gl.p[p].N * 2));
    var.launch();
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
    std::string check;
    if (var.state) {
      unsigned long long sd = 0, od = 0;
      CK(cudaMemset(ndiff, 0, sizeof sd));
      decode_exp::count_diff<<<1024, 256>>>(reinterpret_cast<const uint4*>(states), reinterpret_cast<const uint4*>(sref),
                                            state_bytes / 16, ndiff);
      CK(cudaMemcpy(&sd, ndiff, sizeof sd, cudaMemcpyDeviceToHost));
      CK(cudaMemset(ndiff, 0, sizeof od));
      decode_exp::count_diff<<<1024, 256>>>(reinterpret_cast<const uint4*>(o), reinterpret_cast<const uint4*>(oref),
                                            npairs * DV * 4 / 16, ndiff);
      CK(cudaMemcpy(&od, ndiff, sizeof od, cudaMemcpyDeviceToHost));
      check += " S diff/v1 " + std::to_string(sd) + ", o diff/v1 " + std::to_string(od);
      fails += sd != 0 || od != 0;
    }
    if (var.gemm) {
      double worst = 0;
      for (int p = 0; p < gl.n; ++p) {
        const Gemm& g = gl.p[p];
        hc.resize(static_cast<size_t>(M) * g.N);
        CK(cudaMemcpy(hc.data(), g.C, hc.size() * 2, cudaMemcpyDeviceToHost));
        double num = 0, den = 0;
        uint64_t r = 777 + p;
        for (int s = 0; s < 256; ++s) {
          r = r * 6364136223846793005ULL + 1442695040888963407ULL;
          const int row = static_cast<int>((r >> 33) % static_cast<uint64_t>(M));
          const int col = static_cast<int>((r >> 13) % static_cast<uint64_t>(g.N));
          double ref = 0;
          for (int kk = 0; kk < g.K; ++kk) {
            const double x = bf2f(f2bf(mat_value(2 * p + 1, static_cast<uint64_t>(row) * g.K + kk, 1.0f)));
            const double w = bf2f(f2bf(mat_value(2 * p + 2, static_cast<uint64_t>(col) * g.K + kk, 0.05f)));
            ref += x * w;
          }
          const double got = bf2f(hc[static_cast<size_t>(row) * g.N + col]);
          num += (got - ref) * (got - ref);
          den += ref * ref;
        }
        const double rel = std::sqrt(num / std::max(den, 1e-300));
        worst = std::isfinite(rel) ? std::max(worst, rel) : INFINITY;
      }
      char buf[64];
      std::snprintf(buf, sizeof buf, " gemm rel err %.2e", worst);
      check += buf;
      fails += !(worst <= 1e-2);
    }
    double sus = 0;
    const double t = timed(var.launch, &sus);
    std::string rate;
    char buf[96];
    const bool u24 = var.name.find("24") != std::string::npos;
    if (var.gemm && !var.state) {
      t_gemm[var.family] = sus;
      std::snprintf(buf, sizeof buf, "  %.0f TFLOP/s", flop / (sus * 1e9));
      rate = buf;
    } else if (var.state && !var.gemm) {
      t_state[var.family][u24] = sus;
      std::snprintf(buf, sizeof buf, "  %5.3f TB/s", sbytes / (sus * 1e9));
      rate = buf;
    } else {
      // The wgmma family has no unroll-24 state-alone line: the state role is the same code, so
      // the mma.sync family's figure stands in for it.
      double ts = t_state[var.family][u24];
      if (ts == 0) ts = t_state[0][u24];
      const double tg = t_gemm[var.family];
      std::snprintf(buf, sizeof buf, "  hidden %.2f (alone: %.4f + %.4f ms)", (tg + ts - sus) / std::min(tg, ts), tg,
                    ts);
      rate = buf;
    }
    std::printf("  %-28s %8.4f ms | %8.4f ms sustained%s |%s\n", var.name.c_str(), t, sus, rate.c_str(), check.c_str());
    std::fflush(stdout);
  }
  std::printf("%s: %d check(s) failed\n", fails ? "FAIL" : "PASS", fails);
  for (auto* p : bufs) CK(cudaFree(p));
  CK(cudaFree(states));
  CK(cudaFree(pristine));
  CK(cudaFree(sref));
  CK(cudaFree(o));
  CK(cudaFree(oref));
  CK(cudaFree(q));
  CK(cudaFree(k));
  CK(cudaFree(v));
  CK(cudaFree(ndiff));
  return fails ? 1 : 0;
}
