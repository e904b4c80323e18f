// Shared pieces of the experiments/decode versions: the kernel arguments (the production DecArgs of
// ops/cuda/kernels_gla_decode.cu without the gate fields), the production dtype-coded loads/stores
// and state vectors (included, not copied), the deterministic initial states,
// and thin inline-PTX wrappers for the Hopper bulk copies and mbarriers used by v2 and v3.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cmath>
#include <cstdint>
#include <cstdio>

#include "ops/cuda/bulk_copy.cuh"
#include "ops/cuda/cuda_common.cuh"
#include "ops/cuda/state_vec.cuh"

namespace decode_exp {

constexpr int kF32 = 0;
constexpr int kBF16 = 1;

constexpr int kDecMaxHeads = 128;
constexpr int kDecMaxDk = 128;
constexpr int kDecMaxDv = 256;

struct DecArgs {
  int B, H, dk, dv;
  float scale;
  float lam[kDecMaxHeads];
  // q, k, v, o: element (b, h, i) at p + b·sb + h·sh + i (T = 1).
  const void* q;
  const void* k;
  const void* v;
  void* o;
  int q_dt, k_dt, v_dt, o_dt;
  int64_t q_sb, q_sh, k_sb, k_sh, v_sb, v_sh, o_sb, o_sh;
  // States: element (slot, h, i, e) at p + slot·ss + h·sh + i·sk + e. The experiments step in place
  // (s_in == s_out), as the model does.
  const void* s_in;
  void* s_out;
  int64_t ss, sh, sk;
  const int32_t* slots;  // null: slot = b
};

// The experiments' arguments for B sequences × H heads: q, k, v BF16 and o F32, each contiguous
// [B, H, d]; states contiguous [slots, H, dk, dv]; λ from 0.95 to 0.99 across the heads;
// scale 1/√dk. The pointers are the caller's to set (slots null: slot = b).
inline DecArgs exp_args(int B, int H, int dk, int dv) {
  DecArgs a{};
  a.B = B, a.H = H, a.dk = dk, a.dv = dv;
  a.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(dk)));
  for (int h = 0; h < H; ++h) a.lam[h] = 0.95f + 0.04f * h / (H - 1);
  a.q_dt = a.k_dt = a.v_dt = kBF16;
  a.o_dt = kF32;
  a.q_sb = a.k_sb = static_cast<int64_t>(H) * dk, a.q_sh = a.k_sh = dk;
  a.v_sb = a.o_sb = static_cast<int64_t>(H) * dv, a.v_sh = a.o_sh = dv;
  a.sk = dv, a.sh = static_cast<int64_t>(dk) * dv, a.ss = a.sh * H;
  return a;
}

// The production dtype-coded scalar access (ops/cuda/cuda_common.cuh; same dtype codes).
using laplace::cuda::ldf;
using laplace::cuda::stf;
static_assert(kF32 == laplace::cuda::kF32 && kBF16 == laplace::cuda::kBF16, "dtype codes differ");

// The production kernel's 4-column state vectors (ops/cuda/state_vec.cuh).
using laplace::cuda::load_vec;
using laplace::cuda::store_vec;

// The experiments' host-side generator (q, k, v and sample picks): a 64-bit LCG, uniform in [0, 1).
struct Rng {
  uint64_t s;
  double uniform() {
    s = s * 6364136223846793005ULL + 1442695040888963407ULL;
    return static_cast<double>(s >> 11) * (1.0 / 9007199254740992.0);
  }
};

// Initial state element `idx` (the flat index into [slots, H, dk, dv]) in [-1, 1): the CPU
// reference recomputes any element from its index, so no host copy of the (GB-sized) states is
// needed. Every float operation is exact (24-bit integer · 2⁻²³ − 1), so host and device agree
// bit for bit, FMA contraction or not.
__host__ __device__ inline float state_init(uint64_t idx) {
  uint64_t z = idx * 0x9e3779b97f4a7c15ULL + 0x632be59bd9b4e019ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  z ^= z >> 31;
  return static_cast<float>(static_cast<uint32_t>(z >> 40)) * 0x1p-23f - 1.0f;
}

template <class ST>
__global__ void init_states(ST* s, uint64_t n) {
  for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n; i += (uint64_t)gridDim.x * blockDim.x)
    s[i] = static_cast<ST>(state_init(i));  // BF16: round to nearest even, as the host's f2bf
}

// Number of 16-byte words that differ between a and b (the full-state bit comparison).
__global__ void count_diff(const uint4* a, const uint4* b, uint64_t n, unsigned long long* cnt) {
  unsigned long long c = 0;
  for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n; i += (uint64_t)gridDim.x * blockDim.x) {
    const uint4 x = a[i], y = b[i];
    c += (x.x != y.x) | (x.y != y.y) | (x.z != y.z) | (x.w != y.w);
  }
  if (c) atomicAdd(cnt, c);
}

// ---- Hopper bulk copies and mbarriers: production's wrappers (ops/cuda/bulk_copy.cuh), except
// the wait, which here gives up after 2 s: a wrong parity or a copy never issued then costs an
// error message instead of a hung GPU.
using laplace::cuda::bulk_commit;
using laplace::cuda::bulk_g2s;
using laplace::cuda::bulk_s2g;
using laplace::cuda::bulk_wait_read;
using laplace::cuda::fence_barrier_init;
using laplace::cuda::fence_proxy_async;
using laplace::cuda::mbar_arrive_expect_tx;
using laplace::cuda::mbar_init;
using laplace::cuda::mbar_try_wait;

__device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
// Until the phase of parity `parity` has completed; the caller makes sure the barrier is
// never two phases ahead of the waiter (see v3's comment).
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  if (mbar_try_wait(bar, parity)) return;
  const uint64_t t0 = globaltimer_ns();
  while (!mbar_try_wait(bar, parity)) {
    if (globaltimer_ns() - t0 > 2000000000ull) {
      printf("experiment_decode: mbarrier wait timed out (block %d, thread %d, parity %u)\n", static_cast<int>(blockIdx.x),
             static_cast<int>(threadIdx.x), parity);
      __trap();
    }
  }
}

}  // namespace decode_exp

// v1 — the production decode kernel (ops/cuda/kernels_gla_decode.cu, gla_decode_kernel as of
// 1e3af0f) with the gate epilogue removed (kGate = false). One block of dv threads per (b, h);
// thread (rg, c) owns 4-column vector c of the rows of row group rg (4 groups of ⌈dk/4⌉
// consecutive rows), loads 8 rows before using any, stores each updated row vector straight
// back to global memory, and the per-group partial outputs are added in group order through
// shared memory. Its S and o bits are the experiment's reference bits.
namespace decode_exp::v1 {

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

}  // namespace decode_exp::v1

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
namespace decode_exp::v2 {

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

}  // namespace decode_exp::v2

// v3 — persistent: a grid of nblocks (one block per SM: the stage ring takes nearly all of an
// SM's shared memory), block x walks the (b, h) work items w = x, x + nblocks, ... The
// question it answers is how much HBM bandwidth a given number of SMs can pull, i.e. whether
// the state stream could run on ~40 SMs beside gemms on the rest.
//
// Each item is cut into kSplit units of dk/kSplit rows; a unit is copied by cp.async.bulk
// into one stage of a ring of kStages shared-memory buffers (state rows + the item's q, k, v:
// everything the unit needs arrives on the stage's mbarrier, so the compute never waits on a
// global load) while earlier units are computed. kStages is as many as fit in the 227 KB a
// block may use (F32 whole items: 3; BF16 whole items or F32 halves: 6), so a block keeps
// 1-2 items (~150-220 KB) of loads in flight, which is what a small grid needs to cover HBM
// latency. Thread 0 is the producer; it issues after the block-wide barrier that ends a unit.
//
// Write-back, kBulkStore:
//   true:  updated rows go back into the stage, then cp.async.bulk shared->global (one bulk
//          group per unit); the stage of unit u-1 is refilled at unit u once
//          wait_group.read 1 says that unit's store has read it, so the ring runs one unit
//          shallower than with vector stores;
//   false: each thread stores its row vectors to global memory (v1's stores); the stage is
//          refilled as soon as the unit's closing __syncthreads has passed.
//
// Barrier phases. Stage s = u % kStages is filled for units s, s + kStages, s + 2·kStages, ...;
// its barrier (arrival count 1: the producer's arrive.expect_tx) completes one phase per fill,
// so unit u is the (u / kStages)-th fill of its stage and waiters use parity (u / kStages) & 1.
// Parity alone is unambiguous only if the barrier is never more than one phase ahead of a
// waiter: a stage is refilled (its next phase armed) only after the __syncthreads that ends
// the unit that used it, i.e. after every thread has passed its wait on the current phase; so
// when a thread waits with parity P, the phase with parity P is either the current one (not
// complete yet: try_wait fails) or has just completed (try_wait succeeds), never a phase two
// fills old.
//
// With kSplit = 1, the rows per thread, their order and the group-order reduction are v1's,
// so S and o have v1's bits; kSplit = 2 gives each thread two 12-row runs (o bits differ).
// Shapes are compile-time (dk = 96, dv = 192), states contiguous, q, k, v BF16 with each
// (b, h) row 16-byte aligned (the experiment's contiguous layout guarantees it).
namespace decode_exp::v3 {

constexpr int kDk = 96, kDv = 192;
constexpr int C = 4, G = 4, kNv = kDv / C, kThreads = G * kNv;
constexpr int kQkvBytes = (2 * kDk + kDv) * 2;      // BF16 q, k, v of one (b, h)
constexpr int kSmemBudget = 232448;                  // opt-in shared memory per block (H100/H200)
constexpr int kPartBytes = 2 * (G - 1) * kDv * 4;    // double-buffered partial outputs
constexpr int kMaxStages = 12;

template <class ST, int kSplit, int kStageCap = kMaxStages>
struct Cfg {
  static constexpr int kRows = kDk / kSplit;  // rows per unit
  static constexpr int kGroupRows = kRows / G;
  static constexpr int kUnroll = kGroupRows % 8 == 0 ? 8 : kGroupRows % 6 == 0 ? 6 : kGroupRows % 4 == 0 ? 4 : 1;
  static constexpr int kPieceBytes = kRows * kDv * static_cast<int>(sizeof(ST));
  static constexpr int kStageBytes = kPieceBytes + kQkvBytes;
  static constexpr int kFit = (kSmemBudget - kPartBytes) / (kStageBytes + 16);  // + barrier, slot
  static constexpr int kStages = kFit < kStageCap ? kFit : kStageCap;
  static constexpr int kPartOff = kStages * kStageBytes;  // float [2][G - 1][kDv]
  static constexpr int kBarOff = kPartOff + kPartBytes;   // uint64 [kStages]
  static constexpr int kSlotOff = kBarOff + kStages * 8;  // int64 [kStages]: the unit's slot
  static constexpr int kBytes = kSlotOff + kStages * 8;
  static_assert(kDk % (kSplit * G) == 0, "whole rows per group");
  static_assert(kPieceBytes % 16 == 0 && kStageBytes % 16 == 0, "bulk copy sizes and stage alignment");
  static_assert(kStages >= 2 && kBytes <= kSmemBudget, "stage ring");
};

// kStageCap and kMinBlocks make a small-footprint variant (experiment_decode_overlap --co): a ring of few
// stages and registers capped for kMinBlocks blocks per SM, so that one block can share an SM
// with a gemm CTA.
template <class ST, bool kBulkStore, int kSplit, int kStageCap = kMaxStages, int kMinBlocks = 1>
__global__ void __launch_bounds__(kThreads, kMinBlocks) decode_v3(DecArgs a) {
  using K = Cfg<ST, kSplit, kStageCap>;
  constexpr int NS = K::kStages, U = K::kUnroll;
  extern __shared__ __align__(128) unsigned char smem[];
  float* part = reinterpret_cast<float*>(smem + K::kPartOff);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + K::kBarOff);
  int64_t* sslot = reinterpret_cast<int64_t*>(smem + K::kSlotOff);
  const int tid = threadIdx.x, c = tid % kNv, rg = tid / kNv;
  const int items = a.B * a.H, x = blockIdx.x, nb = gridDim.x;
  const int mine = x < items ? (items - 1 - x) / nb + 1 : 0;
  const int units = mine * kSplit;
  const __nv_bfloat16* q = static_cast<const __nv_bfloat16*>(a.q);
  const __nv_bfloat16* k = static_cast<const __nv_bfloat16*>(a.k);
  const __nv_bfloat16* v = static_cast<const __nv_bfloat16*>(a.v);

  // Producer state (thread 0): the slot of the item being issued and, loaded one item ahead so
  // that its latency is not paid at issue time, the slot of the next one.
  int pn = -1;
  int64_t pslot = 0, pnext = 0;
  auto slot_of = [&](int w) -> int64_t { return a.slots ? a.slots[w / a.H] : w / a.H; };
  auto issue = [&](int u) {
    const int n = u / kSplit, p = u - n * kSplit, s = u % NS;
    if (n != pn) {
      pn = n;
      pslot = pnext;
      if (x + (n + 1) * nb < items) pnext = slot_of(x + (n + 1) * nb);
    }
    const int w = x + n * nb, b = w / a.H, h = w - b * a.H;
    unsigned char* st = smem + s * K::kStageBytes;
    sslot[s] = pslot;  // published to the consumers by the arrive (release) / wait (acquire)
    mbar_arrive_expect_tx(&full[s], K::kStageBytes);
    bulk_g2s(st, static_cast<const ST*>(a.s_in) + pslot * a.ss + h * a.sh + p * K::kRows * kDv, K::kPieceBytes,
             &full[s]);
    bulk_g2s(st + K::kPieceBytes, q + b * a.q_sb + h * a.q_sh, kDk * 2, &full[s]);
    bulk_g2s(st + K::kPieceBytes + kDk * 2, k + b * a.k_sb + h * a.k_sh, kDk * 2, &full[s]);
    bulk_g2s(st + K::kPieceBytes + kDk * 4, v + b * a.v_sb + h * a.v_sh, kDv * 2, &full[s]);
  };

  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < NS; ++s) mbar_init(&full[s], 1);
    fence_barrier_init();
    if (mine > 0) pnext = slot_of(x);
    for (int u = 0; u < NS && u < units; ++u) issue(u);
  }
  __syncthreads();  // barriers initialised before anyone waits on them

  float acc[C];
#pragma unroll
  for (int j = 0; j < C; ++j) acc[j] = 0.f;
  for (int u = 0; u < units; ++u) {
    const int n = u / kSplit, p = u - n * kSplit, s = u % NS;
    const int w = x + n * nb, b = w / a.H, h = w - b * a.H;
    const float lam = a.lam[h];
    unsigned char* st = smem + s * K::kStageBytes;
    ST* sS = reinterpret_cast<ST*>(st);
    const __nv_bfloat16* sq = reinterpret_cast<const __nv_bfloat16*>(st + K::kPieceBytes);
    const __nv_bfloat16* sk = sq + kDk;
    const __nv_bfloat16* sv = sk + kDk;
    mbar_wait(&full[s], (u / NS) & 1);

    float vv[C];
#pragma unroll
    for (int j = 0; j < C; ++j) vv[j] = __bfloat162float(sv[C * c + j]);
    const int lr0 = rg * K::kGroupRows;  // first row of this thread in the unit
    const int gr0 = p * K::kRows + lr0;  // ... in the state (q, k index)
    ST* gdst = static_cast<ST*>(a.s_out) + sslot[s] * a.ss + h * a.sh + p * K::kRows * kDv;
#pragma unroll
    for (int i0 = 0; i0 < K::kGroupRows; i0 += U) {
      float sv4[U][C];
#pragma unroll
      for (int uu = 0; uu < U; ++uu) load_vec(sS + (lr0 + i0 + uu) * kDv + C * c, sv4[uu]);
#pragma unroll
      for (int uu = 0; uu < U; ++uu) {
        const int i = gr0 + i0 + uu;
        const float kk = __bfloat162float(sk[i]), qq = a.scale * __bfloat162float(sq[i]);
#pragma unroll
        for (int j = 0; j < C; ++j) {
          sv4[uu][j] = fmaf(lam, sv4[uu][j], kk * vv[j]);
          acc[j] = fmaf(qq, sv4[uu][j], acc[j]);
        }
        if constexpr (kBulkStore) store_vec(sS + (lr0 + i0 + uu) * kDv + C * c, sv4[uu]);
        else store_vec(gdst + (lr0 + i0 + uu) * kDv + C * c, sv4[uu]);
      }
    }
    const bool last = p == kSplit - 1;
    // part[n & 1] is read by group 0 after this unit's __syncthreads and rewritten two items
    // later, after the __syncthreads of the next item's last unit, which group 0 reaches only
    // once it has read it.
    float* pb = part + (n & 1) * (G - 1) * kDv;
    if (last && rg > 0) {
#pragma unroll
      for (int j = 0; j < C; ++j) pb[(rg - 1) * kDv + C * c + j] = acc[j];
    }
    if constexpr (kBulkStore) fence_proxy_async();  // our shared writes -> the bulk store's reads
    __syncthreads();  // the unit is done with stage s: everyone has waited on and read it
    if (tid == 0) {
      if constexpr (kBulkStore) {
        bulk_s2g(gdst, sS, K::kPieceBytes);
        bulk_commit();
        // Refill the previous unit's stage once its store has read it (at most this unit's
        // store may still be reading).
        if (u >= 1 && u - 1 + NS < units) {
          bulk_wait_read<1>();
          issue(u - 1 + NS);
        }
      } else {
        if (u + NS < units) issue(u + NS);
      }
    }
    if (last) {
      // o_e = ((part0 + part1) + part2) + part3: v1's order.
      if (rg == 0) {
#pragma unroll
        for (int j = 0; j < C; ++j) {
          float o = acc[j];
#pragma unroll
          for (int g = 1; g < G; ++g) o += pb[(g - 1) * kDv + C * c + j];
          stf(a.o, b * a.o_sb + h * a.o_sh + C * c + j, a.o_dt, o);
        }
      }
#pragma unroll
      for (int j = 0; j < C; ++j) acc[j] = 0.f;
    }
  }
  // The block's shared memory must outlive the bulk stores' reads of it.
  if constexpr (kBulkStore) {
    if (tid == 0) bulk_wait_read<0>();
  }
}

}  // namespace decode_exp::v3

// v4 — deferred write-back (docs/serving.md §4). A decode step must read every state (o = q̃S
// needs all of S) but need not write it. Each (slot, head) keeps, beside its F32 state S_base, the
// last m < R tokens' (k, v) as they came (bf16, so keeping them is exact) and a count m:
//   S_t = λ^{m+1} S_base + Σ_{j<m} λ^{m−j} k_jᵀ v_j + k_tᵀ v_t        (pending j = 0 oldest)
//   o_t = λ^{m+1} (q̃_t S_base) + Σ_{j<m} λ^{m−j} (q̃_t·k_j) v_j + (q̃_t·k_t) v_t
// A step with m + 1 < R reads S_base and the m pairs, appends (k_t, v_t) and writes o: no state
// write. The step with m + 1 = R (the flush) reads S_base, folds the pairs in row by row, writes
// S_t back and resets m; its o is q̃_t S_t as v1's. Per (b, h) and step at R = 8, F32 states:
// 73.7 KB read + ~2 KB of pairs + 9.2 KB written on average, against v1's 147.5 KB.
//
// Block: v1's 192 threads (48 four-column vectors × 4 row groups) per (b, h). The pairs, q̃, k_t,
// v_t and the scalars a_j = λ^{m−j}(q̃·k_j) sit in shared memory. Only the rounding order of the
// state differs from v1 (a flush sums R terms per element), so the experiment checks against F64, not
// against v1's bits.
namespace decode_exp::v4 {

constexpr int kThreads = 192, kCols = 4, kGroups = 4, kUnroll = 8;
constexpr int kMaxR = 16;

// Pending pairs and counts of every (slot, head): pk [slots][H][R−1][dk], pv [slots][H][R−1][dv]
// (bf16), cnt [slots][H].
struct Pending {
  __nv_bfloat16* pk = nullptr;
  __nv_bfloat16* pv = nullptr;
  int32_t* cnt = nullptr;
};

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// S is F32 [slots][H][dk][dv] with rows of dv (sk = dv); q, k, v BF16; o F32 (DecArgs' dtypes
// are not consulted: the experiment's layout is fixed). dk ≤ kDecMaxDk, dv = kCols · 48.
template <int R>
__global__ void __launch_bounds__(kThreads) decode_v4(DecArgs a, Pending p) {
  static_assert(R >= 2 && R <= kMaxR, "R pending steps between write-backs");
  constexpr int C = kCols, G = kGroups, P = R - 1;
  __shared__ float qs[kDecMaxDk], ks[kDecMaxDk], vs[kDecMaxDv];
  __shared__ float pks[P][kDecMaxDk], pvs[P][kDecMaxDv];
  __shared__ float part[G][kDecMaxDv];
  __shared__ float aj[R];          // λ^{m−j}(q̃·k_j) for j < m, then (q̃·k_t) at index m
  __shared__ float lam_pow[R + 1];  // λ^0 … λ^R
  const int b = blockIdx.x / a.H, h = blockIdx.x - b * a.H;
  const int tid = threadIdx.x, nv = a.dv / C, c = tid % nv, rg = tid / nv;
  const int64_t slot = a.slots ? a.slots[b] : b;
  const int64_t sh_idx = slot * a.H + h;
  const int m = p.cnt[sh_idx];  // read by every thread before the first barrier; thread 0 rewrites it last
  const bool flush = m + 1 == R;
  const __nv_bfloat16* q = static_cast<const __nv_bfloat16*>(a.q) + b * a.q_sb + h * a.q_sh;
  const __nv_bfloat16* k = static_cast<const __nv_bfloat16*>(a.k) + b * a.k_sb + h * a.k_sh;
  const __nv_bfloat16* v = static_cast<const __nv_bfloat16*>(a.v) + b * a.v_sb + h * a.v_sh;
  __nv_bfloat16* pk = p.pk + sh_idx * P * a.dk;
  __nv_bfloat16* pv = p.pv + sh_idx * P * a.dv;
  for (int i = tid; i < a.dk; i += kThreads) {
    qs[i] = a.scale * __bfloat162float(q[i]);
    ks[i] = __bfloat162float(k[i]);
  }
  for (int e = tid; e < a.dv; e += kThreads) vs[e] = __bfloat162float(v[e]);
  for (int x = tid; x < m * a.dk; x += kThreads) pks[x / a.dk][x % a.dk] = __bfloat162float(pk[x]);
  for (int x = tid; x < m * a.dv; x += kThreads) pvs[x / a.dv][x % a.dv] = __bfloat162float(pv[x]);
  if (tid == 0) {
    double w = 1.0;
    for (int i = 0; i <= R; ++i, w *= static_cast<double>(a.lam[h])) lam_pow[i] = static_cast<float>(w);
  }
  __syncthreads();
  const int warp = tid >> 5, lane = tid & 31;
  if (!flush) {  // the pending scalars, one warp per pair (6 warps, m + 1 ≤ R − 1 dot products)
    for (int j = warp; j <= m; j += kThreads / 32) {
      const float* kj = j < m ? pks[j] : ks;
      float d = 0.f;
      for (int i = lane; i < a.dk; i += 32) d = fmaf(qs[i], kj[i], d);
      d = warp_sum(d);
      if (lane == 0) aj[j] = j < m ? lam_pow[m - j] * d : d;
    }
  }

  const float* src = static_cast<const float*>(a.s_in) + slot * a.ss + h * a.sh + C * c;
  float* dst = static_cast<float*>(a.s_out) + slot * a.ss + h * a.sh + C * c;
  const int rows = (a.dk + G - 1) / G;
  const int r0 = rg * rows, r1 = min(a.dk, r0 + rows);
  float acc[C];
#pragma unroll
  for (int j = 0; j < C; ++j) acc[j] = 0.f;
  // The flush reads the pairs' v from shared memory row by row rather than holding them in
  // registers: only one step in R flushes, and the others need the registers for rows in flight.
  float vt[C];
#pragma unroll
  for (int j = 0; j < C; ++j) vt[j] = vs[C * c + j];
  const float lam_r = lam_pow[R];
  for (int i0 = r0; i0 < r1; i0 += kUnroll) {
    float s[kUnroll][C];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (i0 + u < r1) {
        load_vec(src + (i0 + u) * a.sk, s[u]);
      } else {
#pragma unroll
        for (int j = 0; j < C; ++j) s[u][j] = 0.f;
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = i0 + u;
      if (i >= r1) break;
      const float qq = qs[i];
      if (flush) {  // S_t = λ^R S_base + Σ_jj λ^{R−1−jj} k_jj v_jj + k_t v_t, then o from S_t
#pragma unroll
        for (int j = 0; j < C; ++j) {
          float x = lam_r * s[u][j];
#pragma unroll
          for (int jj = 0; jj < P; ++jj)  // pair jj is R − 1 − jj tokens old at the flush
            x = fmaf(lam_pow[P - jj] * pks[jj][i], pvs[jj][C * c + j], x);
          s[u][j] = fmaf(ks[i], vt[j], x);
          acc[j] = fmaf(qq, s[u][j], acc[j]);
        }
        store_vec(dst + i * a.sk, s[u]);
      } else {
#pragma unroll
        for (int j = 0; j < C; ++j) acc[j] = fmaf(qq, s[u][j], acc[j]);
      }
    }
  }
#pragma unroll
  for (int j = 0; j < C; ++j) part[rg][C * c + j] = acc[j];
  __syncthreads();
  for (int e = tid; e < a.dv; e += kThreads) {
    float x = part[0][e];
#pragma unroll
    for (int g = 1; g < G; ++g) x += part[g][e];
    if (!flush) {  // o = λ^{m+1}(q̃ S_base) + Σ_j a_j v_j + (q̃·k_t) v_t
      x *= lam_pow[m + 1];
      for (int j = 0; j < m; ++j) x = fmaf(aj[j], pvs[j][e], x);
      x = fmaf(aj[m], vs[e], x);
    }
    static_cast<float*>(a.o)[b * a.o_sb + h * a.o_sh + e] = x;
  }
  if (!flush) {  // append (k_t, v_t) as pair m: the bf16 inputs, copied
    for (int i = tid; i < a.dk; i += kThreads) pk[m * a.dk + i] = k[i];
    for (int e = tid; e < a.dv; e += kThreads) pv[m * a.dv + e] = v[e];
  }
  if (tid == 0) p.cnt[sh_idx] = flush ? 0 : m + 1;
}

}  // namespace decode_exp::v4
