// GLA decode step on CUDA (docs/model.md §4, recurrent form, T = 1), optionally fused with the
// mixer's output gate. Per sequence b and head h, with state S [dk, dv] in slot slots[b]:
//   S ← λ_h S + kᵀ v          (in place)
//   o = (scale·q) S           [dv]
//   y = RMSNorm(o; w) ⊙ SiLU(g)   (fused gate only)
//
// Decode is bound by the state traffic (1.18 MB per sequence per layer for laplace-3b in
// F32, read once and written once), so the kernel is a stream over the state: one block of
// dv threads per (b, h); thread (rg, c) owns one vector c of 4 columns (16 bytes of F32,
// 8 of BF16) of the rows of row group rg (4 groups of ⌈dk/4⌉ consecutive rows), loads 8
// rows' vectors before using any of them, and keeps its part of o in registers. The partial outputs are added in group order through shared memory,
// so the result is a fixed function of the inputs (bitwise reproducible, independent of
// the batch and of the other slots).
//
// BF16 states with contiguous rows move through shared memory by Hopper bulk copies instead
// (kBulk), in the deferred kernel too: per-thread loads of 8-byte BF16 vectors stay well below
// the copy bandwidth, which F32 states reach with the per-thread loads they keep.
//
// The gate epilogue reproduces rmsnorm_gate_fwd_kernel (kernels_norm.cu) operation for
// operation, o rounded to its dtype first, so fused and unfused decode give the same bits.
#include <string>
#include <type_traits>

#include "ops/cuda/bulk_copy.cuh"
#include "ops/cuda/cuda_common.cuh"
#include "ops/cuda/state_vec.cuh"

namespace laplace {
namespace cuda {

namespace {

constexpr int kDecMaxHeads = 128;
constexpr int kDecMaxDk = 128;
constexpr int kDecMaxDv = 256;
// Block shape: kGroups row groups × (dv / kCols) column vectors, one vector per state row
// per thread, so a block has dv threads.
template <class ST>
struct DecShape;
template <>
struct DecShape<float> {
  static constexpr int kCols = 4, kGroups = 4;
};
// BF16 keeps F32's 4 × 4 shape with 8-byte vectors: wider vectors (8 BF16 columns × 8
// groups) and 16 rows in flight instead of kDecUnroll's 8 did not stream faster.
template <>
struct DecShape<__nv_bfloat16> {
  static constexpr int kCols = 4, kGroups = 4;
};
constexpr int kDecUnroll = 8;  // rows loaded before any is used

struct DecArgs {
  int B, H, dk, dv;
  float scale;
  float lam[kDecMaxHeads];
  // q, k, v, g, o, y: element (b, h, i) at p + b·sb + h·sh + i (T = 1).
  const void* q;
  const void* k;
  const void* v;
  const void* g;
  void* o;
  void* y;
  int q_dt, k_dt, v_dt, g_dt, o_dt, y_dt;
  int64_t q_sb, q_sh, k_sb, k_sh, v_sb, v_sh, g_sb, g_sh, o_sb, o_sh, y_sb, y_sh;
  const void* w;  // [dv] gate norm weight (may be null: 1)
  int w_dt;
  float eps;
  // States: element (slot, h, i, e) at p + slot·ss + h·sh + i·sk + e.
  const void* s_in;  // null: zero initial state
  void* s_out;       // null: not stored
  int64_t ss, sh, sk;
  const int32_t* slots;  // null: slot = b
};

// g and w of row (b, h) staged in shared memory at the start of a step (before its first
// barrier), so that the gate epilogue after the state stream does not wait on global loads.
// Thread t stages columns t, t + blockDim.x, ..., the ones it reads back in gate_epilogue.
__device__ __forceinline__ void gate_stage(const DecArgs& a, int b, int h, float* gs, float* ws) {
  for (int e = threadIdx.x; e < a.dv; e += blockDim.x) {
    gs[e] = ldf(a.g, b * a.g_sb + h * a.g_sh + e, a.g_dt);
    if (a.w) ws[e] = ldf(a.w, e, a.w_dt);
  }
}

// y = RMSNorm(o; w) ⊙ SiLU(g) of row (b, h), o [dv] in shared memory already rounded to o's
// dtype, g and w staged by gate_stage: rmsnorm_gate_fwd_kernel's operations in its order (lane l
// sums columns l, l+32, ..., then a butterfly), so fused and unfused decode give the same bits.
// Block-wide.
__device__ __forceinline__ void gate_epilogue(const DecArgs& a, int b, int h, const float* o, const float* gs,
                                              const float* ws, float* rstd_s) {
  const int tid = threadIdx.x;
  __syncthreads();
  if (tid < 32) {
    float ss = 0.f;
    for (int e = tid; e < a.dv; e += 32) ss += o[e] * o[e];
    const float r = 1.0f / sqrtf(warp_sum(ss) / static_cast<float>(a.dv) + a.eps);
    if (tid == 0) *rstd_s = r;
  }
  __syncthreads();
  const float r = *rstd_s;
  for (int e = tid; e < a.dv; e += blockDim.x) {
    const float gv = gs[e];
    float y = o[e] * r * gv * sigmoidf_(gv);
    if (a.w) y *= ws[e];
    stf(a.y, b * a.y_sb + h * a.y_sh + e, a.y_dt, y);
  }
}

// Rows i0 … min(i0 + kDecUnroll, r1) − 1 of a thread's column vector (row stride sk) into s,
// all loads issued before any is used; rows past r1, or all rows when src is null (a zero
// state), are zeros.
template <class ST, int C>
__device__ __forceinline__ void load_rows(const ST* src, int64_t sk, int i0, int r1, float (&s)[kDecUnroll][C]) {
#pragma unroll
  for (int u = 0; u < kDecUnroll; ++u) {
    if (src && i0 + u < r1) {
      load_vec(src + (i0 + u) * sk, s[u]);
    } else {
#pragma unroll
      for (int j = 0; j < C; ++j) s[u][j] = 0.f;
    }
  }
}

// Thread 0 of a block: the state of one (slot, head) [G·rows, dv] from gs into sS by G bulk
// copies of `piece` bytes, row group g completing on bar[g]. Each barrier completes once
// (parity 0); a block barrier must come between this and any thread's wait.
template <int G, class ST>
__device__ __forceinline__ void state_load_bulk(const ST* gs, ST* sS, int rows, int dv, uint32_t piece,
                                                uint64_t* bar) {
#pragma unroll
  for (int g = 0; g < G; ++g) mbar_init(&bar[g], 1);
  fence_barrier_init();
#pragma unroll
  for (int g = 0; g < G; ++g) {
    mbar_arrive_expect_tx(&bar[g], piece);
    bulk_g2s(sS + g * rows * dv, gs + g * rows * dv, piece, &bar[g]);
  }
}

// kBulk (BF16 states, see gla_decode_forward): the state reaches shared memory through G bulk
// copies, one per row group, each completing on its own mbarrier so that group 0 computes
// while the others still arrive; the updated rows go back into shared memory and G bulk
// copies write them out. The arithmetic and its order are unchanged (the same bits).
template <class ST, bool kGate, bool kBulk>
__global__ void __launch_bounds__(kDecMaxDv) gla_decode_kernel(DecArgs a) {
  constexpr int C = DecShape<ST>::kCols, G = DecShape<ST>::kGroups;
  __shared__ float qs[kDecMaxDk], ks[kDecMaxDk];
  __shared__ float part[G][kDecMaxDv];
  __shared__ float rstd_s;
  __shared__ float gs[kGate ? kDecMaxDv : 1], ws[kGate ? kDecMaxDv : 1];  // g, w (gate_stage)
  __shared__ uint64_t bar[kBulk ? G : 1];
  extern __shared__ __align__(128) unsigned char state_smem[];  // kBulk: the state [dk, dv]
  const int b = blockIdx.x / a.H, h = blockIdx.x - b * a.H;
  const int nv = a.dv / C;
  const int tid = threadIdx.x, c = tid % nv, rg = tid / nv;
  const int rows = (a.dk + G - 1) / G;
  const int64_t slot = a.slots ? a.slots[b] : b;
  ST* sS = reinterpret_cast<ST*>(state_smem);
  // kBulk: one bulk copy per row group, each of `piece` bytes, both ways.
  [[maybe_unused]] const uint32_t piece = static_cast<uint32_t>(rows * a.dv * static_cast<int>(sizeof(ST)));
  if constexpr (kBulk) {  // the copies first: they are the long pole
    if (tid == 0)
      state_load_bulk<G>(static_cast<const ST*>(a.s_in) + slot * a.ss + h * a.sh, sS, rows, a.dv, piece, bar);
  }
  for (int i = tid; i < a.dk; i += blockDim.x) {
    qs[i] = a.scale * ldf(a.q, b * a.q_sb + h * a.q_sh + i, a.q_dt);
    ks[i] = ldf(a.k, b * a.k_sb + h * a.k_sh + i, a.k_dt);
  }
  if constexpr (kGate) gate_stage(a, b, h, gs, ws);
  float vv[C];
  const int64_t vo = b * a.v_sb + h * a.v_sh + C * c;
#pragma unroll
  for (int j = 0; j < C; ++j) vv[j] = ldf(a.v, vo + j, a.v_dt);
  __syncthreads();

  const int64_t base = slot * a.ss + h * a.sh + C * c;
  // Rows are read from src and written to dst with row stride sk: the global states, or with
  // kBulk the shared copy (row stride dv).
  const ST* src = kBulk ? sS + C * c : a.s_in ? static_cast<const ST*>(a.s_in) + base : nullptr;
  ST* dst = kBulk ? sS + C * c : a.s_out ? static_cast<ST*>(a.s_out) + base : nullptr;
  const int64_t sk = kBulk ? a.dv : a.sk;
  const float lam = a.lam[h];
  const int r0 = rg * rows, r1 = min(a.dk, r0 + rows);
  if constexpr (kBulk) mbar_wait(&bar[rg], 0);
  float acc[C];
#pragma unroll
  for (int j = 0; j < C; ++j) acc[j] = 0.f;
  for (int i0 = r0; i0 < r1; i0 += kDecUnroll) {
    float s[kDecUnroll][C];
    load_rows(src, sk, i0, r1, s);
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
      if (dst) store_vec(dst + i * sk, s[u]);
    }
  }
#pragma unroll
  for (int j = 0; j < C; ++j) part[rg][C * c + j] = acc[j];
  if constexpr (kBulk) fence_proxy_async();  // this thread's rows in sS -> the bulk store's reads
  __syncthreads();
  if constexpr (kBulk) {
    if (tid == 0) {
      ST* gd = static_cast<ST*>(a.s_out) + slot * a.ss + h * a.sh;
#pragma unroll
      for (int p = 0; p < G; ++p) bulk_s2g(gd + p * rows * a.dv, sS + p * rows * a.dv, piece);
      bulk_commit();
    }
  }
  // o_e = Σ_rg part[rg][e] in group order; rounded to o's dtype (as stored).
  for (int e = tid; e < a.dv; e += blockDim.x) {
    float x = part[0][e];
#pragma unroll
    for (int g = 1; g < G; ++g) x += part[g][e];
    if (a.o) stf(a.o, b * a.o_sb + h * a.o_sh + e, a.o_dt, x);
    part[0][e] = round_to(x, a.o_dt);
  }
  if constexpr (kBulk) {
    if (tid == 0) bulk_wait_read<0>();  // sS must outlive the bulk store's reads of it
  }
  if constexpr (!kGate) return;
  gate_epilogue(a, b, h, part[0], gs, ws, &rstd_s);
}


// ---- deferred write-back (ops/backend.h GlaPending; docs/serving.md §4) ------------------
//
// A decode step must read every state (o = q̃S needs all of S) but need not write it. With
// the m < R pending pairs (k_j, v_j) of (slot, head) beside S_base:
//   m + 1 + d < R:  o = λ^{m+1} (q̃ S_base) + Σ_{j<m} λ^{m−j} (q̃·k_j) v_j + (q̃·k) v, no state
//                   write, (k, v) appended as pair m;
//   m + 1 + d = R:  S ← λ^{m+1} S_base + Σ_{j<m} λ^{m−j} k_jᵀ v_j + kᵀ v, written back; o = q̃ S,
// d being the count word's phase (ops/backend.h: 0 but in a cycle started by a flush).
// At R = 8 a (slot, head) moves 85.5 KB per step on average in F32 instead of 147.5 KB. The
// write-back step, which folds the pairs into every element, costs more than a pending step,
// so the engine phases the heads' write-backs (the count word's d) rather than let every head
// of a batch admitted together write back in the same step, which would make that step slow.
// The block and thread layout are gla_decode_kernel's; the pairs, q̃, k, v, g, w and the
// scalars λ^{m−j}(q̃·k_j) sit in shared memory as F32.

constexpr int kMaxDeferSteps = 16;

struct PendArgs {
  void* pk;  // element (slot, h, j, i) at pk + slot·k_ss + h·k_sh + j·dk + i
  void* pv;  // element (slot, h, j, e) at pv + slot·v_ss + h·v_sh + j·dv + e
  int p_dt;
  int64_t k_ss, k_sh, v_ss, v_sh;
  int32_t* cnt;  // (slot, h) at cnt + slot·c_ss + h
  int64_t c_ss;
};

// m and d of a slot's count word (ops/backend.h), each kept in [0, R) by a mask (R is a power
// of two): a corrupt word must not send the kernel out of its pair arrays (the host validates
// the words it restores; padded rows share the scratch slot). The write-back test is
// m + 1 + d ≥ R, so a corrupt word with m + d ≥ R folds its m < R pairs. Keep the mask: a
// min/max clamp in its place took the write-back step at every step on the GPU (CUDA 13.0,
// sm_90a) although its PTX compared the clamped count correctly; the cause was not found, and
// the mask passes the op and model tests.
__device__ __forceinline__ void pending_count(const PendArgs& p, int64_t slot, int h, int R, int* m, int* d) {
  const int32_t w = p.cnt[slot * p.c_ss + h];
  *m = pending_m(w) & (R - 1);
  *d = pending_d(w) & (R - 1);
}

// Shared memory of one deferred step: the pairs, q̃, k, v, g, w and the scalars as F32 (16-byte
// aligned: the write-back step reads the pairs' v as float4).
template <int R>
struct alignas(16) DeferSmem {
  float qs[kDecMaxDk], ks[kDecMaxDk], vs[kDecMaxDv];
  float pks[R - 1][kDecMaxDk + kDecUnroll];  // pair j scaled by λ^{m−j} (write-back); padded rows
  float pvs[R - 1][kDecMaxDv];
  float part[4][kDecMaxDv];
  float gs[kDecMaxDv], ws[kDecMaxDv];  // g, w (gate_stage)
  float aj[R];           // λ^{m−j}(q̃·k_j) for j < m, then q̃·k at index m
  float lam_pow[R + 1];  // λ^0 … λ^R
  float rstd;
};

// q̃ = scale·q, k, v, g and w of a step into shared memory with every load issued before the
// first store: loop by loop, each load costs the block a round trip to memory before the next
// is issued. Element t of each vector is thread t's; longer vectors (not laplace-3b's shapes)
// take a loop for the rest.
template <int R>
__device__ __forceinline__ void stage_inputs(const DecArgs& a, int64_t kq, int64_t kk, int64_t kv, int64_t kg,
                                             DeferSmem<R>& sm) {
  const int t = threadIdx.x, n = blockDim.x;
  const bool hk = t < a.dk, hv = t < a.dv;
  float q = 0.f, k = 0.f, v = 0.f, g = 0.f, w = 0.f;
  if (hk) q = ldf(a.q, kq + t, a.q_dt), k = ldf(a.k, kk + t, a.k_dt);
  if (hv) v = ldf(a.v, kv + t, a.v_dt), g = ldf(a.g, kg + t, a.g_dt);
  if (hv && a.w) w = ldf(a.w, t, a.w_dt);
  if (hk) sm.qs[t] = a.scale * q, sm.ks[t] = k;
  if (hv) sm.vs[t] = v, sm.gs[t] = g, sm.ws[t] = w;
  for (int i = t + n; i < a.dk; i += n) {
    sm.qs[i] = a.scale * ldf(a.q, kq + i, a.q_dt);
    sm.ks[i] = ldf(a.k, kk + i, a.k_dt);
  }
  for (int e = t + n; e < a.dv; e += n) {
    sm.vs[e] = ldf(a.v, kv + e, a.v_dt);
    sm.gs[e] = ldf(a.g, kg + e, a.g_dt);
    if (a.w) sm.ws[e] = ldf(a.w, e, a.w_dt);
  }
}

// The m pending pairs of (slot, head), k_j [dk] and v_j [dv] contiguous from pk0 and pv0, into
// shared memory as F32, in 16-byte vectors with up to kPairVecs per thread in flight at once (at
// R = 8 with BF16 pairs: at most 252 vectors, 2 per thread); a scalar loop where the rows are
// not whole 16-byte vectors.
constexpr int kPairVecs = 2;

// λ^n as the kernels' lam_pow tables hold it: n products in F64, rounded to F32.
__device__ __forceinline__ float lam_power(float lam, int n) {
  double w = 1.0;
  for (int i = 0; i < n; ++i) w *= static_cast<double>(lam);
  return static_cast<float>(w);
}

// out[i] = λ^i for i = 0 … n, lam_power's values, the block's threads striding over i (the
// callers' barrier follows before anyone reads the table).
__device__ __forceinline__ void lam_table(float lam, int n, float* out) {
  for (int i = threadIdx.x; i <= n; i += blockDim.x) out[i] = lam_power(lam, i);
}

// kScale (the write-back step): pair j's k is stored as λ^{m−j} k_j, the coefficients the fold
// multiplies by (the same F32 products as scaling it afterwards).
template <int R, bool kScale>
__device__ __forceinline__ void stage_pairs(const PendArgs& p, int64_t pk0, int64_t pv0, int m, int dk, int dv,
                                            float lam, DeferSmem<R>& sm) {
  const int t = threadIdx.x, n = blockDim.x;
  const int es = p.p_dt == kBF16 ? 2 : 4, per = 16 / es;
  const char* gk = static_cast<const char*>(p.pk) + pk0 * es;
  const char* gv = static_cast<const char*>(p.pv) + pv0 * es;
  if (dk % per != 0 || dv % per != 0 || (reinterpret_cast<uintptr_t>(gk) | reinterpret_cast<uintptr_t>(gv)) % 16 != 0) {
    for (int x = t; x < m * dk; x += n) {
      const float k = ldf(p.pk, pk0 + x, p.p_dt);
      sm.pks[x / dk][x % dk] = kScale ? k * lam_power(lam, m - x / dk) : k;
    }
    for (int x = t; x < m * dv; x += n) sm.pvs[x / dv][x % dv] = ldf(p.pv, pv0 + x, p.p_dt);
    return;
  }
  const int nk = m * dk / per, nt = nk + m * dv / per;  // vectors of k, of k and v
  for (int x0 = 0; x0 < nt; x0 += kPairVecs * n) {
    uint4 r[kPairVecs];
#pragma unroll
    for (int u = 0; u < kPairVecs; ++u) {
      const int x = x0 + u * n + t;
      r[u] = x < nt ? *reinterpret_cast<const uint4*>(x < nk ? gk + 16 * static_cast<int64_t>(x)
                                                             : gv + 16 * static_cast<int64_t>(x - nk))
                    : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kPairVecs; ++u) {
      const int x = x0 + u * n + t;
      if (x >= nt) break;
      const int e0 = (x < nk ? x : x - nk) * per;  // first element in the [m, d] rows
      float* d = x < nk ? &sm.pks[e0 / dk][e0 % dk] : &sm.pvs[e0 / dv][e0 % dv];
      const float c = kScale && x < nk ? lam_power(lam, m - e0 / dk) : 1.f;
      if (es == 2) {
        const uint32_t w[4] = {r[u].x, r[u].y, r[u].z, r[u].w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w[j]));
          d[2 * j] = kScale ? f.x * c : f.x, d[2 * j + 1] = kScale ? f.y * c : f.y;
        }
      } else {
        const float f[4] = {__uint_as_float(r[u].x), __uint_as_float(r[u].y), __uint_as_float(r[u].z),
                            __uint_as_float(r[u].w)};
#pragma unroll
        for (int j = 0; j < 4; ++j) d[j] = kScale ? f[j] * c : f[j];
      }
    }
  }
}

// One step of (slot, head) with m pending pairs and phase d; kFlush: the write-back step.
// The two kinds of step are separate instances, each with only its own code.
// kBulk (BF16 states, bulk_fits): the state [dk, dv] arrives in sS by G bulk copies, one per
// row group on its own barrier of bar, issued before anything else; the rows are then read
// from shared memory, and a write-back step stores them to global memory as before. The
// arithmetic and its order are unchanged (the same bits).
template <class ST, int R, bool kFlush, bool kBulk>
__device__ __forceinline__ void deferred_step(const DecArgs& a, const PendArgs& p, DeferSmem<R>& sm, ST* sS,
                                              uint64_t* bar, int b, int h, int64_t slot, int m, int d) {
  constexpr int C = DecShape<ST>::kCols, G = DecShape<ST>::kGroups;
  static_assert(G <= 4, "DeferSmem holds 4 row groups");
  const int nv = a.dv / C, tid = threadIdx.x, c = tid % nv, rg = tid / nv;
  const int64_t kq = b * a.q_sb + h * a.q_sh, kk = b * a.k_sb + h * a.k_sh, kv = b * a.v_sb + h * a.v_sh;
  const int64_t pk0 = slot * p.k_ss + h * p.k_sh, pv0 = slot * p.v_ss + h * p.v_sh;
  // The state rows do not depend on the prologue: without kBulk the first kDecUnroll of them
  // are in flight while q, k, v, the pairs, g and w are staged and the dot products computed.
  const int64_t base = slot * a.ss + h * a.sh + C * c;
  const ST* src = kBulk ? sS + C * c : static_cast<const ST*>(a.s_in) + base;
  const int64_t sk = kBulk ? a.dv : a.sk;  // src's row stride
  [[maybe_unused]] ST* dst = static_cast<ST*>(a.s_out) + base;
  const int rows = (a.dk + G - 1) / G;
  const int r0 = rg * rows, r1 = min(a.dk, r0 + rows);
  float s[kDecUnroll][C];
  if constexpr (kBulk) {  // the copies first: they are the long pole
    if (tid == 0) {
      const uint32_t piece = static_cast<uint32_t>(rows * a.dv * static_cast<int>(sizeof(ST)));
      state_load_bulk<G>(static_cast<const ST*>(a.s_in) + slot * a.ss + h * a.sh, sS, rows, a.dv, piece, bar);
    }
  } else {
    load_rows(src, sk, r0, r1, s);
  }
  stage_inputs(a, kq, kk, kv, b * a.g_sb + h * a.g_sh, sm);
  stage_pairs<R, kFlush>(p, pk0, pv0, m, a.dk, a.dv, a.lam[h], sm);
  lam_table(a.lam[h], R, sm.lam_pow);
  __syncthreads();
  if constexpr (!kFlush) {  // one warp per dot product q̃·k_j (m + 1 ≤ R − 1 of them)
    const int warp = tid >> 5, lane = tid & 31, warps = blockDim.x >> 5;
    for (int j = warp; j <= m; j += warps) {
      const float* kj = j < m ? sm.pks[j] : sm.ks;
      float d = 0.f;
      for (int i = lane; i < a.dk; i += 32) d = fmaf(sm.qs[i], kj[i], d);
      d = warp_sum(d);
      if (lane == 0) sm.aj[j] = j < m ? sm.lam_pow[m - j] * d : d;
    }
  }

  float acc[C], vt[C];
#pragma unroll
  for (int j = 0; j < C; ++j) {
    acc[j] = 0.f;
    vt[j] = sm.vs[C * c + j];
  }
  if constexpr (kBulk) {
    mbar_wait(&bar[rg], 0);
    load_rows(src, sk, r0, r1, s);
  }
  for (int i0 = r0; i0 < r1; i0 += kDecUnroll) {
    if (i0 != r0) load_rows(src, sk, i0, r1, s);
    if constexpr (kFlush) {
      // S ← λ^{m+1} S_base + Σ_j λ^{m−j} k_jᵀ v_j + kᵀ v, each element's chain of fmas in the
      // reference's order (ops/cpu/gla.cpp): pair by pair over the kDecUnroll rows in flight, so
      // a pair's v is read from shared memory once per kDecUnroll rows, not once per row (row by
      // row, those float4 reads were 4 of every 5 shared-memory wavefronts of the step). The
      // loop over the pairs stays a loop:
      // unrolled, the compiler issues every pair's loads ahead of their fmas and spills the rows
      // in flight. Rows past r1 (zeros) are folded too and never used.
#pragma unroll
      for (int u = 0; u < kDecUnroll; ++u)
#pragma unroll
        for (int j = 0; j < C; ++j) s[u][j] = sm.lam_pow[m + 1] * s[u][j];
#pragma unroll 1
      for (int jj = 0; jj < m; ++jj) {  // pair jj is m − jj tokens old
        const float4 pv4 = *reinterpret_cast<const float4*>(&sm.pvs[jj][C * c]);
        const float pv[C] = {pv4.x, pv4.y, pv4.z, pv4.w};
        const float* kc = &sm.pks[jj][i0];  // rows are padded by kDecUnroll: no read past them
#pragma unroll
        for (int u = 0; u < kDecUnroll; ++u)
#pragma unroll
          for (int j = 0; j < C; ++j) s[u][j] = fmaf(kc[u], pv[j], s[u][j]);
      }
    }
#pragma unroll
    for (int u = 0; u < kDecUnroll; ++u) {
      const int i = i0 + u;
      if (i >= r1) break;
      const float qq = sm.qs[i];
      if constexpr (kFlush) {
#pragma unroll
        for (int j = 0; j < C; ++j) {
          s[u][j] = fmaf(sm.ks[i], vt[j], s[u][j]);
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
  for (int j = 0; j < C; ++j) sm.part[rg][C * c + j] = acc[j];
  __syncthreads();
  for (int e = tid; e < a.dv; e += blockDim.x) {
    float x = sm.part[0][e];
#pragma unroll
    for (int g = 1; g < G; ++g) x += sm.part[g][e];
    if constexpr (!kFlush) {
      x *= sm.lam_pow[m + 1];
      for (int j = 0; j < m; ++j) x = fmaf(sm.aj[j], sm.pvs[j][e], x);
      x = fmaf(sm.aj[m], sm.vs[e], x);
    }
    if (a.o) stf(a.o, b * a.o_sb + h * a.o_sh + e, a.o_dt, x);
    sm.part[0][e] = round_to(x, a.o_dt);  // each thread rewrites only the columns it summed
  }
  if constexpr (!kFlush) {  // append (k, v) as pair m
    for (int i = tid; i < a.dk; i += blockDim.x) stf(p.pk, pk0 + m * a.dk + i, p.p_dt, sm.ks[i]);
    for (int e = tid; e < a.dv; e += blockDim.x) stf(p.pv, pv0 + m * a.dv + e, p.p_dt, sm.vs[e]);
  }
  if (tid == 0) p.cnt[slot * p.c_ss + h] = kFlush ? 0 : pending_word(m + 1, d);
  gate_epilogue(a, b, h, sm.part[0], sm.gs, sm.ws, &sm.rstd);
}

// At most 64 registers (__launch_bounds__(256, 4)), so 5 decode blocks of dv = 192 threads fit
// per SM: unbounded, the kernel takes ~118 registers and 2 blocks per SM, and at 80 registers
// 4 blocks fit without spills. The fifth block is worth the few bytes that 64 registers spill.
template <class ST, int R, bool kBulk>
__global__ void __launch_bounds__(kDecMaxDv, 4) gla_decode_deferred_kernel(DecArgs a, PendArgs p) {
  static_assert(R >= 2 && R <= kMaxDeferSteps && (R & (R - 1)) == 0, "R: a power of two up to 16");
  __shared__ DeferSmem<R> sm;
  __shared__ uint64_t bar[kBulk ? DecShape<ST>::kGroups : 1];
  extern __shared__ __align__(128) unsigned char state_smem[];  // kBulk: the state [dk, dv]
  ST* sS = reinterpret_cast<ST*>(state_smem);
  const int b = blockIdx.x / a.H, h = blockIdx.x - b * a.H;
  const int64_t slot = a.slots ? a.slots[b] : b;
  int m, d;
  pending_count(p, slot, h, R, &m, &d);  // thread 0 rewrites the word after the step's barriers
  if (m + 1 + d >= R) deferred_step<ST, R, true, kBulk>(a, p, sm, sS, bar, b, h, slot, m, d);
  else deferred_step<ST, R, false, kBulk>(a, p, sm, sS, bar, b, h, slot, m, d);
}

// S ← λ^m S + Σ_{j<m} λ^{m−1−j} k_jᵀ v_j and the count word ← (0, pending_phase(h, R)) for the
// (slot, head) of each block. Run before a chunked forward reads the states; not on the decode path.
template <class ST>
__global__ void gla_pending_flush_kernel(DecArgs a, PendArgs p, int R) {
  __shared__ float pks[kMaxDeferSteps - 1][kDecMaxDk], pvs[kMaxDeferSteps - 1][kDecMaxDv];
  __shared__ float lam_pow[kMaxDeferSteps];
  const int b = blockIdx.x / a.H, h = blockIdx.x - b * a.H, tid = threadIdx.x;
  const int64_t slot = a.slots[b];
  int m, d;
  pending_count(p, slot, h, R, &m, &d);
  if (m == 0) {
    if (tid == 0) p.cnt[slot * p.c_ss + h] = pending_word(0, pending_phase(h, R));
    return;
  }
  const int64_t pk0 = slot * p.k_ss + h * p.k_sh, pv0 = slot * p.v_ss + h * p.v_sh;
  for (int x = tid; x < m * a.dk; x += blockDim.x) pks[x / a.dk][x % a.dk] = ldf(p.pk, pk0 + x, p.p_dt);
  for (int x = tid; x < m * a.dv; x += blockDim.x) pvs[x / a.dv][x % a.dv] = ldf(p.pv, pv0 + x, p.p_dt);
  lam_table(a.lam[h], m, lam_pow);
  __syncthreads();
  ST* S = static_cast<ST*>(a.s_out) + slot * a.ss + h * a.sh;
  for (int x = tid; x < a.dk * a.dv; x += blockDim.x) {
    const int i = x / a.dv, e = x - i * a.dv;
    float t = lam_pow[m] * static_cast<float>(S[i * a.sk + e]);
    for (int j = 0; j < m; ++j) t = fmaf(lam_pow[m - 1 - j] * pks[j][i], pvs[j][e], t);
    S[i * a.sk + e] = static_cast<ST>(t);
  }
  if (tid == 0) p.cnt[slot * p.c_ss + h] = pending_word(0, pending_phase(h, R));
}

// The pending pairs and counts as kernel arguments; false when their layout is not the
// one the kernels index ([S, H, R−1, d] with contiguous pairs, counts [S, H] I32, one device).
bool pend_args(const GlaPending& pend, const DecArgs& a, PendArgs* out) {
  const Tensor& k = pend.k;
  const Tensor& v = pend.v;
  const Tensor& c = pend.count;
  if (pend.steps < 2 || pend.steps > kMaxDeferSteps) return false;
  for (const Tensor* t : {&k, &v})
    if (t->device != Device::kCUDA || (t->dtype != DType::kF32 && t->dtype != DType::kBF16) || t->ndim != 4 ||
        t->dtype != k.dtype || t->shape[1] != a.H || t->shape[2] != pend.steps - 1 || t->stride[3] != 1)
      return false;
  if (k.shape[3] != a.dk || v.shape[3] != a.dv || k.stride[2] != a.dk || v.stride[2] != a.dv) return false;
  if (c.device != Device::kCUDA || c.dtype != DType::kI32 || c.ndim != 2 || c.shape[1] != a.H || c.stride[1] != 1)
    return false;
  *out = PendArgs{k.data, v.data, k.dtype == DType::kBF16 ? kBF16 : kF32, k.stride[0], k.stride[1], v.stride[0],
                  v.stride[1], static_cast<int32_t*>(c.data), c.stride[0]};
  return true;
}

// q/k/v/g/o/y as [B, 1, H, d] views with the last dim contiguous; false if not.
bool act_view(const Tensor& t, int64_t B, int64_t H, int64_t d, const void** p, int* dt, int64_t* sb, int64_t* sh) {
  if (!t.defined()) return true;
  if (t.device != Device::kCUDA || (t.dtype != DType::kF32 && t.dtype != DType::kBF16)) return false;
  if (t.ndim != 4 || t.shape[0] != B || t.shape[1] != 1 || t.shape[2] != H || t.shape[3] != d || t.stride[3] != 1)
    return false;
  *p = t.data;
  *dt = t.dtype == DType::kBF16 ? kBF16 : kF32;
  *sb = t.stride[0];
  *sh = t.stride[2];
  return true;
}

bool aligned(const void* p, int64_t bytes) { return reinterpret_cast<uintptr_t>(p) % static_cast<uintptr_t>(bytes) == 0; }

// Whether the BF16 bulk-copy variant applies: states read and written (in place or not), rows
// contiguous (sk = dv), dk a multiple of the row groups, and every (slot, head) state and row
// group starting 16-byte aligned (piece sizes rows·dv·2 bytes, multiples of 16). Only BF16:
// F32 states stream as fast with per-thread loads.
bool bulk_fits(const DecArgs& a, const Tensor& s_in, const Tensor& s_out) {
  constexpr int G = DecShape<__nv_bfloat16>::kGroups;
  if (!s_in.defined() || !s_out.defined() || a.sk != a.dv || a.dk % G != 0) return false;
  const int64_t rows = a.dk / G;
  return (rows * a.dv) % 8 == 0 && a.ss % 8 == 0 && a.sh % 8 == 0 && aligned(s_in.data, 16) &&
         aligned(s_out.data, 16);
}

// Launches kernel with `smem` bytes of dynamic shared memory (the bulk-copy kernels: dk·dv·2 ≤
// 64 KB; with their static shared memory, laplace-3b's deferred kernel needs 19 + 36 KB, past the
// default 48 KB) and the largest shared-memory carveout: these kernels stream the state through
// shared memory, and at laplace-3b's shapes it fits 4 deferred blocks per SM (5 every-step ones)
// only at the largest.
template <class Kernel, class... Args>
void launch_with_smem(CudaBackend& be, Kernel kernel, unsigned grid, unsigned threads, size_t smem,
                      const Args&... args) {
  be.kernel_smem(kernel, smem, /*max_carveout=*/true);
  kernel<<<grid, threads, smem, be.stream()>>>(args...);
}

// The deferred kernel for R pending steps; bulk: BF16 states through bulk copies (bulk_fits).
template <class ST>
void launch_deferred(CudaBackend& be, int R, bool bulk, unsigned grid, unsigned threads, const DecArgs& a,
                     const PendArgs& p) {
  cudaStream_t st = be.stream();
  if constexpr (std::is_same_v<ST, __nv_bfloat16>) {
    if (bulk) {
      const size_t smem = static_cast<size_t>(a.dk) * a.dv * sizeof(ST);
      switch (R) {
        case 4: return launch_with_smem(be, gla_decode_deferred_kernel<ST, 4, true>, grid, threads, smem, a, p);
        case 8: return launch_with_smem(be, gla_decode_deferred_kernel<ST, 8, true>, grid, threads, smem, a, p);
        case 16: return launch_with_smem(be, gla_decode_deferred_kernel<ST, 16, true>, grid, threads, smem, a, p);
        default: LAPLACE_CHECK(false, "gla deferred decode: R must be 4, 8 or 16");
      }
    }
  }
  LAPLACE_CHECK(!bulk, "gla deferred decode: bulk copies are for BF16 states");
  switch (R) {
    case 4: gla_decode_deferred_kernel<ST, 4, false><<<grid, threads, 0, st>>>(a, p); break;
    case 8: gla_decode_deferred_kernel<ST, 8, false><<<grid, threads, 0, st>>>(a, p); break;
    case 16: gla_decode_deferred_kernel<ST, 16, false><<<grid, threads, 0, st>>>(a, p); break;
    default: LAPLACE_CHECK(false, "gla deferred decode: R must be 4, 8 or 16");
  }
}

}  // namespace

// The decode fast path (see the file comment). Returns false, having queued nothing, when the
// arguments are outside it: T != 1, dk > 128, dv not a multiple of 4 or > 256, states
// not F32/BF16, state rows not aligned to 4 elements, or s_in and s_out of different dtypes.
bool decode_args(const GlaParams& p, const Tensor& q, const Tensor& k, const Tensor& v, Tensor o, const Tensor& s_in,
                 Tensor s_out, const Tensor& slots, const Tensor* g, const Tensor* w, double eps, Tensor* y,
                 DecArgs* out, DType* state_dtype) {
  if (q.ndim != 4 || v.ndim != 4 || q.shape[1] != 1) return false;
  DecArgs& a = *out;
  a = DecArgs{};
  a.B = static_cast<int>(q.shape[0]);
  a.H = static_cast<int>(q.shape[2]);
  a.dk = static_cast<int>(q.shape[3]);
  a.dv = static_cast<int>(v.shape[3]);
  if (q.shape[0] >= (1LL << 31) || a.H < 1 || a.H > kDecMaxHeads || a.dk < 1 || a.dk > kDecMaxDk || a.dv < 4 ||
      a.dv > kDecMaxDv || a.dv % 4 != 0 || static_cast<int64_t>(p.decay.size()) != a.H ||
      static_cast<int64_t>(a.B) * a.H >= (1LL << 31))
    return false;
  const void* po = nullptr;
  if (!act_view(q, a.B, a.H, a.dk, &a.q, &a.q_dt, &a.q_sb, &a.q_sh) ||
      !act_view(k, a.B, a.H, a.dk, &a.k, &a.k_dt, &a.k_sb, &a.k_sh) ||
      !act_view(v, a.B, a.H, a.dv, &a.v, &a.v_dt, &a.v_sb, &a.v_sh) ||
      !act_view(o, a.B, a.H, a.dv, &po, &a.o_dt, &a.o_sb, &a.o_sh))
    return false;
  a.o = const_cast<void*>(po);
  if (!a.q || !a.k || !a.v) return false;
  const bool gate = y != nullptr;
  if (gate) {
    const void* pg = nullptr;
    const void* py = nullptr;
    if (!g || !act_view(*g, a.B, a.H, a.dv, &pg, &a.g_dt, &a.g_sb, &a.g_sh) || !pg ||
        !act_view(*y, a.B, a.H, a.dv, &py, &a.y_dt, &a.y_sb, &a.y_sh) || !py)
      return false;
    a.g = pg;
    a.y = const_cast<void*>(py);
    if (w && w->defined()) {
      if (w->device != Device::kCUDA || w->numel() != a.dv || !w->is_contiguous() ||
          (w->dtype != DType::kF32 && w->dtype != DType::kBF16))
        return false;
      a.w = w->data;
      a.w_dt = w->dtype == DType::kBF16 ? kBF16 : kF32;
    }
    a.eps = static_cast<float>(eps);
  }
  // States: one dtype, same layout for in and out, rows aligned for vector access.
  const Tensor& ref = s_in.defined() ? s_in : s_out;
  DType sdt = DType::kF32;
  if (ref.defined()) {
    sdt = ref.dtype;
    if (sdt != DType::kF32 && sdt != DType::kBF16) return false;
    for (const Tensor* t : {&s_in, static_cast<const Tensor*>(&s_out)}) {
      if (!t->defined()) continue;
      if (t->device != Device::kCUDA || t->dtype != sdt || t->ndim != 4 || t->shape[1] != a.H ||
          t->shape[2] != a.dk || t->shape[3] != a.dv || t->stride[3] != 1 || t->stride[0] != ref.stride[0] ||
          t->stride[1] != ref.stride[1] || t->stride[2] != ref.stride[2])
        return false;
      // Vectors of 4 columns along dv (16 bytes of F32, 8 of BF16).
      if (t->stride[0] % 4 || t->stride[1] % 4 || t->stride[2] % 4 || !aligned(t->data, 4 * dtype_size(sdt)))
        return false;
    }
    a.ss = ref.stride[0];
    a.sh = ref.stride[1];
    a.sk = ref.stride[2];
  }
  a.s_in = s_in.defined() ? s_in.data : nullptr;
  a.s_out = s_out.defined() ? s_out.data : nullptr;
  if (slots.defined()) {
    LAPLACE_CHECK(slots.device == Device::kCUDA && slots.dtype == DType::kI32 && slots.numel() == a.B &&
                      slots.is_contiguous(),
                  "gla decode: slots must be I32 [B] on the GPU");
    a.slots = static_cast<const int32_t*>(slots.data);
  } else if (ref.defined()) {
    LAPLACE_CHECK(ref.shape[0] >= a.B, "gla decode: fewer states than batch rows");
  }
  a.scale = static_cast<float>(p.scale);
  for (int h = 0; h < a.H; ++h) a.lam[h] = static_cast<float>(p.decay[h]);
  *state_dtype = sdt;
  return true;
}

bool gla_decode_forward(CudaBackend& be, const GlaParams& p, const Tensor& q, const Tensor& k, const Tensor& v,
                        Tensor o, const Tensor& s_in, Tensor s_out, const Tensor& slots, const Tensor* g,
                        const Tensor* w, double eps, Tensor* y) {
  DecArgs a;
  DType sdt = DType::kF32;
  if (!decode_args(p, q, k, v, o, s_in, s_out, slots, g, w, eps, y, &a, &sdt)) return false;
  const bool gate = y != nullptr;
  if (a.B == 0) return true;
  // dv threads: (dv / 4) column vectors × 4 row groups.
  const unsigned grid = static_cast<unsigned>(a.B * a.H), threads = static_cast<unsigned>(a.dv);
  cudaStream_t st = be.stream();
  if (sdt == DType::kBF16 && bulk_fits(a, s_in, s_out)) {
    using BF = __nv_bfloat16;
    const size_t smem = static_cast<size_t>(a.dk) * a.dv * sizeof(BF);
    if (gate) launch_with_smem(be, gla_decode_kernel<BF, true, true>, grid, threads, smem, a);
    else launch_with_smem(be, gla_decode_kernel<BF, false, true>, grid, threads, smem, a);
  } else if (sdt == DType::kBF16) {
    if (gate) gla_decode_kernel<__nv_bfloat16, true, false><<<grid, threads, 0, st>>>(a);
    else gla_decode_kernel<__nv_bfloat16, false, false><<<grid, threads, 0, st>>>(a);
  } else {
    if (gate) gla_decode_kernel<float, true, false><<<grid, threads, 0, st>>>(a);
    else gla_decode_kernel<float, false, false><<<grid, threads, 0, st>>>(a);
  }
  CUDA_CHECK_LAUNCH();
  return true;
}

}  // namespace cuda

void CudaBackend::gla_decode_gate(const GlaParams& p, const Tensor& q, const Tensor& k, const Tensor& v,
                                  const Tensor& g, const Tensor& w, double eps, Tensor states, const Tensor& slots,
                                  Tensor o, Tensor y) {
  if (cuda::gla_decode_forward(*this, p, q, k, v, o, states, states, slots, &g, &w, eps, &y)) return;
  Backend::gla_decode_gate(p, q, k, v, g, w, eps, states, slots, o, y);
}

void CudaBackend::gla_decode_gate_deferred(const GlaParams& p, const Tensor& q, const Tensor& k, const Tensor& v,
                                           const Tensor& g, const Tensor& w, double eps, Tensor states,
                                           const GlaPending& pend, const Tensor& slots, Tensor o, Tensor y) {
  cuda::DecArgs a;
  cuda::PendArgs pa;
  DType sdt = DType::kF32;
  LAPLACE_CHECK(cuda::decode_args(p, q, k, v, o, states, states, slots, &g, &w, eps, &y, &a, &sdt) &&
                    states.defined() && cuda::pend_args(pend, a, &pa) && pend.count.shape[0] == states.shape[0],
                "gla deferred decode: arguments outside the kernel's layout (T = 1, dk ≤ 128, dv ≤ 256 and a "
                "multiple of 4, F32/BF16 states, pending pairs [S, H, R−1, d], counts [S, H] I32)");
  if (a.B == 0) return;
  const unsigned grid = static_cast<unsigned>(a.B * a.H), threads = static_cast<unsigned>(a.dv);
  const int R = static_cast<int>(pend.steps);
  if (sdt == DType::kBF16)
    cuda::launch_deferred<__nv_bfloat16>(*this, R, cuda::bulk_fits(a, states, states), grid, threads, a, pa);
  else
    cuda::launch_deferred<float>(*this, R, false, grid, threads, a, pa);
  CUDA_CHECK_LAUNCH();
}

void CudaBackend::gla_pending_flush(const GlaParams& p, Tensor states, const GlaPending& pend, const Tensor& slots) {
  LAPLACE_CHECK(states.defined() && states.device == Device::kCUDA && states.ndim == 4 &&
                    (states.dtype == DType::kF32 || states.dtype == DType::kBF16) && states.stride[3] == 1,
                "gla pending flush: states must be [S, H, dk, dv] F32/BF16 on the GPU");
  LAPLACE_CHECK(slots.defined() && slots.device == Device::kCUDA && slots.dtype == DType::kI32 && slots.ndim == 1 &&
                    slots.is_contiguous(),
                "gla pending flush: slots must be I32 [B] on the GPU");
  cuda::DecArgs a{};
  a.B = static_cast<int>(slots.shape[0]);
  a.H = static_cast<int>(states.shape[1]);
  a.dk = static_cast<int>(states.shape[2]);
  a.dv = static_cast<int>(states.shape[3]);
  LAPLACE_CHECK(a.H <= cuda::kDecMaxHeads && a.dk <= cuda::kDecMaxDk && a.dv <= cuda::kDecMaxDv &&
                    static_cast<int64_t>(p.decay.size()) == a.H,
                "gla pending flush: at most 128 heads, dk ≤ 128, dv ≤ 256, one decay per head");
  for (int h = 0; h < a.H; ++h) a.lam[h] = static_cast<float>(p.decay[h]);
  a.s_out = states.data;
  a.ss = states.stride[0];
  a.sh = states.stride[1];
  a.sk = states.stride[2];
  a.slots = static_cast<const int32_t*>(slots.data);
  cuda::PendArgs pa;
  LAPLACE_CHECK(cuda::pend_args(pend, a, &pa) && pend.count.shape[0] == states.shape[0],
                "gla pending flush: pending pairs must be [S, H, R−1, d] F32/BF16, counts [S, H] I32");
  if (a.B == 0) return;
  const unsigned grid = static_cast<unsigned>(a.B * a.H);
  const int R = static_cast<int>(pend.steps);
  if (states.dtype == DType::kBF16)
    cuda::gla_pending_flush_kernel<__nv_bfloat16><<<grid, 256, 0, stream()>>>(a, pa, R);
  else
    cuda::gla_pending_flush_kernel<float><<<grid, 256, 0, stream()>>>(a, pa, R);
  CUDA_CHECK_LAUNCH();
}

}  // namespace laplace
