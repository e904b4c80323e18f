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
// (b, h) row 16-byte aligned (the lab's contiguous layout guarantees it).
#pragma once

#include "decode_common.cuh"

namespace decode_lab::v3 {

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

// kStageCap and kMinBlocks make a small-footprint variant (overlap_lab --co): a ring of few
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

}  // namespace decode_lab::v3
