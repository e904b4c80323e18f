// Chunked GLA forward/backward on tensor cores (mma.sync m16n8k16, bf16 operands,
// fp32 accumulators), templated on the head dims and written for dk = 96, dv = 192 without
// padding (96 = 6·16, 192 = 12·16: every tile is a whole number of 16-wide mma steps).
//
// Math per (sequence b, head h), chunk n of Le ≤ C = 128 rows, q̃ = scale·q, positions i, j, t
// inside the chunk, S_n the state entering chunk n, G_n = ∂L/∂(state leaving chunk n):
//   state scan   S_{n+1} = λ^{Le} S_n + Σ_j λ^{Le−1−j} k_jᵀ v_j               (forward order)
//                G_{n−1} = λ^{Le} G_n + Σ_t λ^{t+1} q̃_tᵀ dO_t                (reverse order)
//   output       o_i  = λ^{i+1} q̃_i S_n + Σ_{j≤i} λ^{i−j} (q̃_i·k_j) v_j
//   dq           dq_i = scale·(λ^{i+1} dO_i S_nᵀ + Σ_{j≤i} λ^{i−j} (dO_i·v_j) k_j)
//   dk           dk_i = λ^{Le−1−i} v_i G_nᵀ + Σ_{t≥i} λ^{t−i} (dO_t·v_i) q̃_t
//   dv           dv_i = λ^{Le−1−i} k_i G_n + Σ_{t≥i} λ^{t−i} (q̃_t·k_i) dO_t
//
// Kernels (the chunk-parallel structure of flash-linear-attention):
//   state_kernel  one block per (b, h, 96-column slice of dv) walks the chunks in order and
//                 writes every S_n (or G_n in reverse) to scratch; the per-chunk K̃ᵀV product
//                 runs on tensor cores, the [dk × 96] fp32 state stays in registers, and the
//                 next chunk's tiles load (cp.async, double-buffered) while this one multiplies.
//   fwd_o_kernel  one block per (b, h, chunk): warp w owns rows 16w..16w+15 (the QKᵀ block
//                 starts while V and the state still load); the decayed
//                 causal QKᵀ block never leaves registers (its accumulator fragments are
//                 re-packed as the A operand of the next product, as in flash attention).
//   bwd_dqk_kernel, bwd_dv_kernel   the same pattern for the gradients.
//   group_fix_kernel  the forward scan of few long sequences (a B = 1 prefill has only
//                 B·H·2 = 32 scan blocks) runs as G chunk groups per sequence in parallel, each
//                 from a zero state (group 0 from S_0); this kernel then carries the true state
//                 across the groups (S_start(g+1) = λ^{len g}·S_start(g) + E_g, elementwise: the
//                 decay is one scalar per head) and adds λ^{128·j}·S_start(g) to the j-th chunk
//                 state of group g, and writes the final state.
//                 The backward splits both of its scans the same way when its B·H·2 scan blocks
//                 are fewer than kBwdScanFill (a long sequence at B = 1: T = 32768 at H = 4 walked
//                 256 chunks in 8 blocks): the reverse scan's groups walk from a zero gradient
//                 (the last group from ds_out) and the carry runs over the groups in reverse
//                 order (G entering group g from the right = λ^{len}·G entering g+1 + E_{g+1}),
//                 chunk j of the walk getting λ^{128·j}·carry. The backward keeps its states as
//                 one bf16 plane, so split scans store their group-relative states as hi/lo
//                 planes (fp32-exact) in a separate buffer, and the fix kernel adds the carry in
//                 fp32 and rounds once into the plane the chunk kernels read: the same single
//                 rounding as an unsplit scan. Training shapes (B·H·2 ≥ kBwdScanFill) keep G = 1
//                 and their bits.
//
// Documents kept apart (GlaParams::doc, varlen): d_t = doc[b][t], the row position of t's
// document's first token (−1: the document began before the row); a document starts at t when
// d_t = t, and there the state restarts from zero. The chunks stay on the global grid (no
// realignment at document starts); the math above becomes, for chunk n (rows t0 … t0+Le−1):
//   reset_n   = a document starts inside the chunk (d_{t0+Le−1} ≥ t0); ℓ_n = d_{t0+Le−1}
//   scans       S_{n+1} = (reset_n ? 0 : λ^{Le} S_n) + Σ_{j: t0+j ≥ ℓ_n} λ^{Le−1−j} k_jᵀ v_j
//               G_{n−1} = (reset_n ? 0 : λ^{Le} G_n) + Σ_{t: d_{t0+t} < t0} λ^{t+1} q̃_tᵀ dO_t
//   o, dq       the S_n term only for rows whose document began before the chunk (d_{t0+i} < t0)
//   dk, dv      the G_n term only for rows t0+i ≥ ℓ_n (the rows that reach the state leaving)
//   blocks      (i, j) kept only when both share a document: below the diagonal j ≥ d_{t0+i} − t0,
//               above it t < the first start after i (d is non-decreasing, so "same document"
//               is one bound per row)
//   group fix   the carry across group g is 0 when a document starts in it (d at its last
//               token ≥ its first position); chunk j of a group's walk gets the carry only when
//               none of the j chunks walked before it has a start; the final state likewise.
// A chunk's starts are one 128-bit mask (bit s: a start at row t0 + s, s < Le); each row's
// bounds are then a few bit operations (start_le / start_gt). The chunk kernels build the mask
// once per block in shared memory; the scans copy each chunk's doc values into shared memory
// with its tiles (cp.async, one chunk ahead) and each warp ballots the mask from them. Kernels
// take VARLEN as a template flag: the instances without doc are the code they were, with
// their bits, registers and speed. A doc whose rows have no start gives the bits of no doc.
//
// Precision: q, k, v, dO are bf16 already (exact as mma operands). Values made inside the
// kernels in fp32 (decayed K̃/Q̃ rows, the decayed QKᵀ block, the fp32 state) would lose
// ~1.6e-3 relative each if rounded once to bf16; the forward's budget (2.5e-3 total, of which the
// final bf16 rounding of o alone costs 1.66e-3) does not allow that, so the forward splits each
// such value into hi = bf16(x) and lo = bf16(x − hi) and runs two mma's (error ~1e-5). The
// backward (budget 5e-3) rounds each such value once, its state scans included (their states
// are stored as one bf16 plane anyway): its errors stay within budget, so the scans, the
// backward's longest part, stay single (split scans would lower the errors and lengthen them).
#pragma once

#include "ops/cuda/cuda_common.cuh"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace laplace::cuda::gla_tc {

// Forward precision switches: the hi/lo split of the decayed block A and of the state S. Both
// stay on. With both, o's error is that of its final bf16 rounding alone; rounding A once
// saves little, and rounding S once brings the error too close to the 2.5e-3 bound.
#ifndef GLA_A_LO
#define GLA_A_LO 1
#endif
#ifndef GLA_S_LO
#define GLA_S_LO 1
#endif

constexpr int kC = 128;          // rows per chunk (fixed: the kernels' tiling assumes 8 warps × 16 rows)
constexpr int kMaxHeads = 128;
constexpr int kF32 = 0, kBF16 = 1;

// [B,T,H,d] view (element offsets, 64-bit): (b, t, h, i) at p + b·sb + t·st + h·sh + i.
struct Act {
  const void* p = nullptr;
  int dt = kBF16;
  int64_t sb = 0, st = 0, sh = 0;
  __device__ __forceinline__ int64_t at(int64_t b, int64_t t, int64_t h) const { return b * sb + t * st + h * sh; }
};
struct OutV {
  void* p = nullptr;
  int dt = kBF16;
  int64_t sb = 0, st = 0, sh = 0;
  __device__ __forceinline__ int64_t at(int64_t b, int64_t t, int64_t h) const { return b * sb + t * st + h * sh; }
};
// [S,H,dk,dv] fp32 state view: (s, h, c, e) at p + s·ss + h·sh + c·sk + e.
struct StV {
  float* p = nullptr;
  int64_t ss = 0, sh = 0, sk = 0;
};

struct Args {
  int B, T, H, N;  // N = ⌈T / C⌉
  int G = 1, NG = 0;  // state scans: G chunk groups of NG chunks per sequence (G = 1: one walk)
  float scale;
  double lam[kMaxHeads];
  const int32_t* doc = nullptr;  // [B, T] document starts (GlaParams::doc); read by VARLEN instances only
};

// ---- PTX wrappers --------------------------------------------------------------------------
__device__ __forceinline__ uint32_t su32(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

__device__ __forceinline__ void ldsm4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}
__device__ __forceinline__ void ldsm4t(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}
// d += a·b, m16n8k16, bf16 in, fp32 accumulate.
__device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
// 4-byte copy (src_bytes 0: zero-fill), for the doc values of a chunk.
__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

__device__ __forceinline__ uint32_t pack_bf16(float lo_col, float hi_col) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo_col, hi_col);  // .x (low 16 bits) = the lower column
  return *reinterpret_cast<uint32_t*>(&v);
}
// x ≈ hi + lo with hi = bf16(x), lo = bf16(x − hi): 16 significant bits instead of 8.
__device__ __forceinline__ void split2(float x0, float x1, uint32_t& hi, uint32_t& lo) {
  __nv_bfloat162 h = __floats2bfloat162_rn(x0, x1);
  const float2 hf = __bfloat1622float2(h);
  __nv_bfloat162 l = __floats2bfloat162_rn(x0 - hf.x, x1 - hf.y);
  hi = *reinterpret_cast<uint32_t*>(&h);
  lo = *reinterpret_cast<uint32_t*>(&l);
}

// ---- fragment loads from shared memory (bf16, row length ld elements) -----------------------
// Fragment layouts of m16n8k16 (g = lane/4, q = lane%4): A regs (row g | g+8, k 2q,2q+1 | +8),
// B regs (k 2q,2q+1 | +8, col g), C/D (row g | g+8, cols 2q, 2q+1).
// A 16×16 at (r0, k0) of a row-major [m][k] tile.
__device__ __forceinline__ void lda(uint32_t (&a)[4], const __nv_bfloat16* s, int ld, int r0, int k0) {
  const int l = threadIdx.x & 31;
  ldsm4(a, su32(s + (r0 + (l & 15)) * ld + k0 + (l >> 4) * 8));
}
// A 16×16 (m0, k0) of a tile stored transposed, [k][m].
__device__ __forceinline__ void lda_t(uint32_t (&a)[4], const __nv_bfloat16* s, int ld, int m0, int k0) {
  const int l = threadIdx.x & 31, mi = l >> 3;
  ldsm4t(a, su32(s + (k0 + (l & 7) + (mi >> 1) * 8) * ld + m0 + (mi & 1) * 8));
}
// B for two n-tiles (n0, n0+8), k0..k0+15, from a tile stored [n][k] (k contiguous):
// r[0], r[1] = tile n0; r[2], r[3] = tile n0+8.
__device__ __forceinline__ void ldb_nk(uint32_t (&r)[4], const __nv_bfloat16* s, int ld, int n0, int k0) {
  const int l = threadIdx.x & 31, mi = l >> 3;
  ldsm4(r, su32(s + (n0 + (l & 7) + (mi >> 1) * 8) * ld + k0 + (mi & 1) * 8));
}
// The same from a tile stored [k][n] (n contiguous).
__device__ __forceinline__ void ldb_kn(uint32_t (&r)[4], const __nv_bfloat16* s, int ld, int k0, int n0) {
  const int l = threadIdx.x & 31, mi = l >> 3;
  ldsm4t(r, su32(s + (k0 + (l & 7) + (mi & 1) * 8) * ld + n0 + (mi >> 1) * 8));
}

// ---- tile loads -----------------------------------------------------------------------------
// Rows t0..t0+Le−1 of head h of sequence b ([Le, D] bf16) into smem [kC][ld] with cp.async;
// rows Le..kC−1 are zero-filled (src size 0), so every product over a short tail chunk is exact.
template <int D>
__device__ __forceinline__ void load_rows_async(__nv_bfloat16* s, int ld, const Act& v, int b, int t0, int Le,
                                                int h, int c0 = 0, int width = D) {
  const int vpr = width / 8;
  const __nv_bfloat16* base = static_cast<const __nv_bfloat16*>(v.p);
  for (int idx = threadIdx.x; idx < kC * vpr; idx += blockDim.x) {
    const int r = idx / vpr, c = (idx - r * vpr) * 8;
    const bool in = r < Le;
    const __nv_bfloat16* src = base + v.at(b, t0 + (in ? r : 0), h) + c0 + c;
    cp_async16(su32(s + r * ld + c), src, in ? 16 : 0);
  }
}
// bf16 [D1][D2] contiguous plane -> smem [D1][ld] (cp.async).
template <int D1, int D2>
__device__ __forceinline__ void load_plane_async(__nv_bfloat16* s, int ld, const __nv_bfloat16* g) {
  for (int idx = threadIdx.x; idx < D1 * D2 / 8; idx += blockDim.x) {
    const int r = idx / (D2 / 8), c = (idx - r * (D2 / 8)) * 8;
    cp_async16(su32(s + r * ld + c), g + r * D2 + c, 16);
  }
}

__device__ __forceinline__ void load_powers(float* pw, double lam) {
  for (int m = threadIdx.x; m <= kC; m += blockDim.x) pw[m] = static_cast<float>(pow(lam, static_cast<double>(m)));
}

__device__ __forceinline__ void store2(void* p, int dt, int64_t off, float x0, float x1) {
  if (dt == kBF16) {
    *reinterpret_cast<__nv_bfloat162*>(static_cast<__nv_bfloat16*>(p) + off) = __floats2bfloat162_rn(x0, x1);
  } else {
    *reinterpret_cast<float2*>(static_cast<float*>(p) + off) = make_float2(x0, x1);
  }
}

// ---- documents kept apart (see the top) -----------------------------------------------------------
// A chunk's document starts: bit s of m[s / 32] is set when a document starts at row t0 + s
// (s < Le; rows past the chunk's end have none).
constexpr int kMaskWords = kC / 32;
using StartMask = uint32_t[kMaskWords];

// Chunk (b, t0, Le)'s start mask in two steps, so that the doc load's latency hides behind the
// tiles' loads: fetch_doc, first thing in the kernel, reads thread s's doc value (s < Le; −2,
// never a start, for the other threads), and store_starts has warp w < kMaskWords write word w
// of the mask to m (shared; the caller synchronises before reading it). The block must have
// at least kC threads.
__device__ __forceinline__ int fetch_doc(const Args& a, int b, int t0, int Le) {
  const int s = threadIdx.x;
  return s < Le ? a.doc[static_cast<int64_t>(b) * a.T + t0 + s] : -2;
}
__device__ __forceinline__ void store_starts(uint32_t* m, int dval, int t0) {
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (w < kMaskWords) {
    const uint32_t bits = __ballot_sync(0xffffffffu, dval == t0 + static_cast<int>(threadIdx.x));
    if (lane == 0) m[w] = bits;
  }
}
__device__ __forceinline__ void read_starts(StartMask& m, const uint32_t* sm) {
#pragma unroll
  for (int w = 0; w < kMaskWords; ++w) m[w] = sm[w];
}
// The last start at or before row i; −1 when none (row i's document began before the chunk).
__device__ __forceinline__ int start_le(const StartMask& m, int i) {
  int r = -1;
#pragma unroll
  for (int w = 0; w < kMaskWords; ++w) {
    const int k = i - 32 * w;  // bits 0 … k of word w are the rows ≤ i
    const uint32_t bits = k < 0 ? 0u : k >= 31 ? m[w] : m[w] & ((2u << k) - 1u);
    if (bits) r = 32 * w + 31 - __clz(bits);
  }
  return r;
}
// The first start after row i; kC when none.
__device__ __forceinline__ int start_gt(const StartMask& m, int i) {
  int r = kC;
#pragma unroll
  for (int w = kMaskWords - 1; w >= 0; --w) {
    const int k = i - 32 * w;  // bits k+1 … 31 of word w are the rows > i
    const uint32_t bits = k < 0 ? m[w] : k >= 31 ? 0u : m[w] & ~((2u << k) - 1u);
    if (bits) r = 32 * w + __ffs(bits) - 1;
  }
  return r;
}

// ---- state scan -------------------------------------------------------------------------------
// grid (DV/96, B·H·G) (G chunk groups, see group_fix_kernel), 192 threads = 6 warps as
// 2 (row halves of dk) × 3 (32-column groups of the 96-column slice). Forward (REV = false): X = k with row weights λ^{Le−1−j}, Y = v; the state
// starts at s0 (slot-mapped rows, or zero); states[bh][n] = S_n; final state to sfin. Reverse:
// X = q with weights scale·λ^{t+1}, Y = dO; starts at s0 = ds_out (by batch row); states[bh][n]
// = G_n; final to sfin = ds_in. With G > 1 only the group at the walk's start (forward: the
// first, reverse: the last) starts at s0, the others at zero, and every group leaves its end
// state in gend instead of sfin. OUT = kOutHiLo stores each state as two bf16 planes (hi, lo:
// fp32-exact for the forward's output kernel and for split backward scans), kOutHi as one bf16
// plane (the backward's). VARLEN: doc resets (see the top): the chunk's doc values are copied
// into shared memory with its tiles (double-buffered too, after the powers of λ), and each
// warp ballots the chunk's start mask from them. (Kept in registers, one step ahead, they
// took the scan from 80–96 registers to 160.)
//
// The scan is a chain of dependent steps, so it is latency-bound unless loads overlap the
// math: it copies raw bf16 tiles with cp.async, double-buffered (the next chunk loads while
// this one multiplies), and applies the row weights and the hi/lo split to the A fragments in
// registers right after ldmatrix (converting them in shared memory, one serial global load at a
// time, left it latency-bound). 256 blocks of 107 KB: two per SM, one wave on 132 SMs. States
// leave through shared memory as 16-byte row pieces (see step 3). XSPLIT = false rounds the
// weighted rows once (one mma instead of two): for the backward's scans, whose states are
// stored as one bf16 plane anyway.
constexpr int kStateThreads = 192;
constexpr int kSlice = 96;  // dv columns per block
constexpr int kOutHiLo = 0, kOutHi = 1;
template <int DK, int DV, bool VARLEN = false>
constexpr int state_smem_bytes() {
  return 2 * (kC * (DK + 8) + kC * (kSlice + 8)) * 2 + (kC + 4) * 4 + (VARLEN ? 2 * kC * 4 : 0);
}

// bf16 pair × (w0, w1) in fp32, split into hi/lo bf16 pairs.
__device__ __forceinline__ void weigh_split(uint32_t raw, float w0, float w1, uint32_t& hi, uint32_t& lo) {
  const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw));
  split2(f.x * w0, f.y * w1, hi, lo);
}

// bf16 pair × (w0, w1), rounded once to a bf16 pair.
__device__ __forceinline__ uint32_t weigh(uint32_t raw, float w0, float w1) {
  const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw));
  return pack_bf16(f.x * w0, f.y * w1);
}

// Direct store of a state held in fragments (4-byte pairs; used for the first state only).
template <int DK, int DV, int OUT, int MT>
__device__ __forceinline__ void store_state_direct(const float (&acc)[MT][4][4], __nv_bfloat16* states, int bh, int N,
                                                   int n, int mrow, int ecol) {
  const int lane = threadIdx.x & 31, g = lane >> 2, q4 = lane & 3;
  const int64_t base = (static_cast<int64_t>(bh) * N + n) * (OUT == kOutHiLo ? 2 : 1) * DK * DV;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int c = mrow + mt * 16 + g + hr * 8, e = ecol + nt * 8 + 2 * q4;
        const int64_t off = base + c * DV + e;
        if (OUT == kOutHiLo) {
          uint32_t hi, lo;
          split2(acc[mt][nt][2 * hr], acc[mt][nt][2 * hr + 1], hi, lo);
          *reinterpret_cast<uint32_t*>(states + off) = hi;
          *reinterpret_cast<uint32_t*>(states + off + DK * DV) = lo;
        } else {
          *reinterpret_cast<__nv_bfloat162*>(states + off) =
              __floats2bfloat162_rn(acc[mt][nt][2 * hr], acc[mt][nt][2 * hr + 1]);
        }
      }
}

template <int DK, int DV, bool REV, int OUT, bool XSPLIT = true, bool VARLEN = false>
__global__ void __launch_bounds__(kStateThreads) state_kernel(Args a, Act X, Act Y, StV s0, const int32_t* slots,
                                                              StV sfin, __nv_bfloat16* states, float* gend = nullptr) {
  static_assert(DK % 32 == 0 && DV % kSlice == 0, "state_kernel tiling");
  constexpr int LDX = DK + 8, LDY = kSlice + 8, MT = DK / 32;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __nv_bfloat16* Xs = reinterpret_cast<__nv_bfloat16*>(smem_raw);  // [2][kC][LDX]
  __nv_bfloat16* Ys = Xs + 2 * kC * LDX;                              // [2][kC][LDY]
  float* pw = reinterpret_cast<float*>(Ys + 2 * kC * LDY);
  int* dbuf = reinterpret_cast<int*>(pw + kC + 4);  // VARLEN: [2][kC] the chunks' doc values

  // blockIdx.y = bh·G + group; the group walks chunks [n_lo, n_lo + steps) (in reverse when
  // REV) from a zero state (the walk's first group from s0) and leaves its end state in gend
  // (G > 1).
  const int G = max(a.G, 1);
  const int bh = blockIdx.y / G, grp = blockIdx.y - bh * G, b = bh / a.H, h = bh - b * a.H;
  const int n_lo = G > 1 ? grp * a.NG : 0, steps = G > 1 ? min(a.N - n_lo, a.NG) : a.N;
  const bool from_s0 = REV ? grp == G - 1 : grp == 0;
  const int e0 = blockIdx.x * kSlice;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q4 = lane & 3;
  const int mrow = (warp / 3) * (DK / 2);  // this warp's first state row
  const int ncol = (warp % 3) * 32;        // its first column inside the slice
  load_powers(pw, a.lam[h]);

  auto issue = [&](int step, int buf) {
    const int n = REV ? n_lo + steps - 1 - step : n_lo + step;
    const int t0 = n * kC, Le = min(kC, a.T - t0);
    load_rows_async<DK>(Xs + buf * kC * LDX, LDX, X, b, t0, Le, h);
    load_rows_async<DV>(Ys + buf * kC * LDY, LDY, Y, b, t0, Le, h, e0, kSlice);
    if (VARLEN && threadIdx.x < kC) {
      // rows past the chunk's end read as 0, never a start there (t0 + r ≥ Le ≥ 1)
      const int r = threadIdx.x;
      const bool in = r < Le;
      cp_async4(su32(dbuf + buf * kC + r), a.doc + static_cast<int64_t>(b) * a.T + t0 + (in ? r : 0), in ? 4 : 0);
    }
    asm volatile("cp.async.commit_group;\n" ::: "memory");
  };
  issue(0, 0);

  float acc[MT][4][4];
  {
    const int64_t srow = slots ? slots[b] : b;
    const float* src = s0.p && from_s0 ? s0.p + srow * s0.ss + h * s0.sh : nullptr;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          const int c = mrow + mt * 16 + g + hr * 8, e = e0 + ncol + nt * 8 + 2 * q4;
          float2 x = make_float2(0.f, 0.f);
          if (src) x = *reinterpret_cast<const float2*>(src + c * s0.sk + e);
          acc[mt][nt][2 * hr] = x.x;
          acc[mt][nt][2 * hr + 1] = x.y;
        }
  }

  for (int step = 0; step < steps; ++step) {
    const int n = REV ? n_lo + steps - 1 - step : n_lo + step;
    const int t0 = n * kC, Le = min(kC, a.T - t0);
    const int buf = step & 1;
    if (step + 1 < steps) {
      issue(step + 1, buf ^ 1);  // that buffer was released by the barrier ending the last step
      asm volatile("cp.async.wait_group 1;\n" ::: "memory");
    } else {
      asm volatile("cp.async.wait_group 0;\n" ::: "memory");
    }
    __syncthreads();
    if (step == 0) store_state_direct<DK, DV, OUT>(acc, states, bh, a.N, n, mrow, e0 + ncol);
    // 2. state ← λ^{Le}·state + X̃ᵀ Y, X̃ = diag(w) X made fragment by fragment. VARLEN: a start
    // in the chunk zeroes the carried state; lim = the first row reaching the state leaving
    // the chunk (forward: its last start, or 0), or the first row not reading the state
    // entering it (reverse: its first start, or kC).
    float decay = pw[Le];
    int lim = 0;
    if (VARLEN) {
      StartMask m;
#pragma unroll
      for (int u = 0; u < kMaskWords; ++u)
        m[u] = __ballot_sync(0xffffffffu, dbuf[buf * kC + 32 * u + lane] == t0 + 32 * u + lane);
      if ((m[0] | m[1] | m[2] | m[3]) != 0) decay = 0.f;
      lim = REV ? start_gt(m, -1) : max(start_le(m, kC - 1), 0);
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r) acc[mt][nt][r] *= decay;
    const __nv_bfloat16* xb = Xs + buf * kC * LDX;
    const __nv_bfloat16* yb = Ys + buf * kC * LDY;
    const int ksteps = (Le + 15) / 16;
    for (int ks = 0; ks < ksteps; ++ks) {
      // weights of the k indices this thread holds: j0, j0+1 (regs 0, 1), j0+8, j0+9 (regs 2, 3)
      const int j0 = ks * 16 + 2 * q4;
      float w[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int j = j0 + (u & 1) + (u >> 1) * 8;
        if (VARLEN) w[u] = REV ? (j < lim ? a.scale * pw[j + 1] : 0.f) : (j < Le && j >= lim ? pw[Le - 1 - j] : 0.f);
        else w[u] = REV ? a.scale * pw[j + 1] : (j < Le ? pw[Le - 1 - j] : 0.f);
      }
      uint32_t bf[2][4];
      ldb_kn(bf[0], yb, LDY, ks * 16, ncol);
      ldb_kn(bf[1], yb, LDY, ks * 16, ncol + 16);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        uint32_t raw[4], ah[4], al[4];
        lda_t(raw, xb, LDX, mrow + mt * 16, ks * 16);
        if (XSPLIT) {
          weigh_split(raw[0], w[0], w[1], ah[0], al[0]);
          weigh_split(raw[1], w[0], w[1], ah[1], al[1]);
          weigh_split(raw[2], w[2], w[3], ah[2], al[2]);
          weigh_split(raw[3], w[2], w[3], ah[3], al[3]);
        } else {
          ah[0] = weigh(raw[0], w[0], w[1]);
          ah[1] = weigh(raw[1], w[0], w[1]);
          ah[2] = weigh(raw[2], w[2], w[3]);
          ah[3] = weigh(raw[3], w[2], w[3]);
        }
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
          mma(acc[mt][nt], ah, bf[nt >> 1][(nt & 1) * 2], bf[nt >> 1][(nt & 1) * 2 + 1]);
          if (XSPLIT) mma(acc[mt][nt], al, bf[nt >> 1][(nt & 1) * 2], bf[nt >> 1][(nt & 1) * 2 + 1]);
        }
      }
    }
    __syncthreads();  // every warp is done reading buffer `buf`
    if (step + 1 < steps) {
      // 3. store the next chunk's state through buffer `buf` (free until the next step's issue
      // refills it), so that global stores are whole 16-byte rows pieces instead of the
      // fragments' 4-byte pairs (8 half-used sectors per warp store)
      const int nn = REV ? n - 1 : n + 1;
      __nv_bfloat16* stage_h = Xs + buf * kC * LDX;  // [DK][kSlice + 8] hi (fits: DK ≤ kC)
      __nv_bfloat16* stage_l = Ys + buf * kC * LDY;  // [DK][kSlice + 8] lo
      constexpr int LDS = kSlice + 8;
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
          for (int hr = 0; hr < 2; ++hr) {
            const int c = mrow + mt * 16 + g + hr * 8, e = ncol + nt * 8 + 2 * q4;
            uint32_t hi, lo;
            if (OUT == kOutHiLo) {
              split2(acc[mt][nt][2 * hr], acc[mt][nt][2 * hr + 1], hi, lo);
              *reinterpret_cast<uint32_t*>(stage_l + c * LDS + e) = lo;
            } else {
              hi = pack_bf16(acc[mt][nt][2 * hr], acc[mt][nt][2 * hr + 1]);
            }
            *reinterpret_cast<uint32_t*>(stage_h + c * LDS + e) = hi;
          }
      __syncthreads();
      const int64_t base = (static_cast<int64_t>(bh) * a.N + nn) * (OUT == kOutHiLo ? 2 : 1) * DK * DV;
      constexpr int VPR = kSlice / 8, PLANES = OUT == kOutHiLo ? 2 : 1;
      for (int idx = threadIdx.x; idx < PLANES * DK * VPR; idx += blockDim.x) {
        const int pl = idx / (DK * VPR), rem = idx - pl * DK * VPR, r = rem / VPR, cc = (rem - r * VPR) * 8;
        const __nv_bfloat16* src = (pl ? stage_l : stage_h) + r * LDS + cc;
        *reinterpret_cast<uint4*>(states + base + pl * DK * DV + r * DV + e0 + cc) = *reinterpret_cast<const uint4*>(src);
      }
      __syncthreads();
    }
  }
  // G > 1: this group's end state goes to gend [B·H][G][DK][DV] (group_fix_kernel makes the
  // final state); G = 1: the final state itself.
  float* dst = nullptr;
  int64_t ld = DV;
  if (G > 1) {
    dst = gend + (static_cast<int64_t>(bh) * G + grp) * DK * DV;
  } else if (sfin.p) {
    const int64_t srow = slots ? slots[b] : b;
    dst = sfin.p + srow * sfin.ss + h * sfin.sh;
    ld = sfin.sk;
  }
  if (dst) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          const int c = mrow + mt * 16 + g + hr * 8, e = e0 + ncol + nt * 8 + 2 * q4;
          *reinterpret_cast<float2*>(dst + c * ld + e) = make_float2(acc[mt][nt][2 * hr], acc[mt][nt][2 * hr + 1]);
        }
  }
}

// ---- carry across chunk groups --------------------------------------------------------------
// states: a scan's hi/lo planes [B·H][N][2][DK][DV], each group's chunk states relative to a
// zero start (those of the walk's first group exact); gend: each group's end state. Groups
// are taken in the walk's order k (forward: group g = k, reverse: g = G − 1 − k), so that k = 0
// is the exact group. The carry is the true state entering group k: carry(1) = E_0,
// carry(k+1) = λ^{len k}·carry(k) + E_k; the j-th chunk state of group k's walk (forward chunk
// n_lo + j, reverse chunk n_hi − 1 − j) gets λ^{128·j}·carry(k) added (in reverse the groups
// before the last are whole, so every chunk walked before chunk j of the walk is 128 long).
// VARLEN (doc non-null): λ^{len k} is 0 when a document starts in group k, and chunk j's
// weight is 0 once one starts in the j chunks walked before it (see the top).
//
// SINGLE = false (the forward): groups k = 1 … G−1 are fixed in place, as hi/lo planes.
// SINGLE = true (the backward's split scans): every group, the exact one too, is written to
// `out` as one bf16 plane [B·H][N][DK][DV], the carry added in fp32 and rounded once.
//
// Grid (⌈DK·DV / (4·kFixThreads)⌉, B·H, G − 1 or G), blockIdx.z (+ 1 unless SINGLE) = the k
// whose chunk states the block fixes; each thread owns four consecutive elements (c, e..e+3)
// of one head's state. Each thread rebuilds the carry entering its own group from gend (one
// thread walking every group, with a double-precision pow per chunk, took longer than the scan
// itself), the powers of λ come from tables in shared memory, and the loads of kFixUnroll
// chunks are issued before any of their stores. The expressions and their order are those of
// a walk over the groups in order, so the bits do not depend on how the groups are spread over
// blocks. The final state (sfin, slot-mapped when slots is given) is written by the block of
// the walk's last group.
constexpr int kFixThreads = 256, kFixVec = 4, kFixUnroll = 4;
constexpr int kFixTab = 256;  // chunk weights λ^{128·j} tabled for j < kFixTab (more: computed)
constexpr int kMaxGroups = 128;  // G ≤ kScanBlocks / 2 (plan_groups)

template <int DK, int DV>
inline dim3 fix_grid(const Args& a, bool single = false) {
  return dim3((DK * DV / kFixVec + kFixThreads - 1) / kFixThreads, a.B * a.H, single ? a.G : a.G - 1);
}

template <int DK, int DV, bool REV = false, bool SINGLE = false>
__global__ void __launch_bounds__(kFixThreads) group_fix_kernel(Args a, const int32_t* slots, StV sfin,
                                                                __nv_bfloat16* states, const float* gend,
                                                                __nv_bfloat16* out = nullptr) {
  static_assert(DV % kFixVec == 0, "a thread's four elements must lie in one state row");
  static_assert(!REV || SINGLE, "the reverse scan is the backward's: its states leave as one plane");
  __shared__ float wtab[kFixTab];    // λ^{128·j}
  __shared__ float dtab[kMaxGroups];  // λ^{len k}: the decay across the k-th group walked
  const int bh = blockIdx.y, b = bh / a.H, h = bh - b * a.H;
  const int k = SINGLE ? static_cast<int>(blockIdx.z) : static_cast<int>(blockIdx.z) + 1;
  const int grp = REV ? a.G - 1 - k : k;
  const double lam = a.lam[h];
  const int64_t tg = static_cast<int64_t>(a.NG) * kC;  // tokens per whole group
  const int n_lo = grp * a.NG, n_hi = min(a.N, n_lo + a.NG);
  const int32_t* doc = a.doc ? a.doc + static_cast<int64_t>(b) * a.T : nullptr;
  // Whether a document starts in the j chunks walked before chunk j of the walk (k > 0 only:
  // those chunks then lie before the row's last chunk, so the doc reads stay inside the row).
  auto cut = [&](int j) {
    if (REV) return doc[static_cast<int64_t>(n_hi) * kC - 1] >= static_cast<int64_t>(n_hi - j) * kC;
    return doc[static_cast<int64_t>(n_lo + j) * kC - 1] >= static_cast<int64_t>(n_lo) * kC;
  };
  for (int j = threadIdx.x; j < min(a.NG, kFixTab); j += kFixThreads) {
    float wj = static_cast<float>(pow(lam, static_cast<double>(j * kC)));
    if (doc && k > 0 && j > 0 && j < n_hi - n_lo && cut(j)) wj = 0.f;
    wtab[j] = wj;
  }
  for (int kk = threadIdx.x; kk <= k; kk += kFixThreads) {
    const int g = REV ? a.G - 1 - kk : kk;
    const int64_t len = min(tg, static_cast<int64_t>(a.T) - g * tg);
    float d = static_cast<float>(pow(lam, static_cast<double>(len)));
    if (doc && doc[g * tg + len - 1] >= g * tg) d = 0.f;  // a document starts in group g
    dtab[kk] = d;
  }
  __syncthreads();
  const int quad = blockIdx.x * kFixThreads + threadIdx.x;
  if (quad >= DK * DV / kFixVec) return;
  const int c = (kFixVec * quad) / DV, e = kFixVec * quad - c * DV;
  const float* E = gend + static_cast<int64_t>(bh) * a.G * DK * DV + c * DV + e;
  // the end state of the kk-th group walked
  auto end_of = [&](int kk) { return E + static_cast<int64_t>(REV ? a.G - 1 - kk : kk) * DK * DV; };
  float4 carry = make_float4(0.f, 0.f, 0.f, 0.f);  // the exact group (SINGLE, k = 0) gets none
  if (k > 0) {
    carry = *reinterpret_cast<const float4*>(end_of(0));  // the state entering the second group walked
    for (int kk = 1; kk < k; ++kk) {
      const float d = dtab[kk];
      const float4 eg = *reinterpret_cast<const float4*>(end_of(kk));
      carry = make_float4(d * carry.x + eg.x, d * carry.y + eg.y, d * carry.z + eg.z, d * carry.w + eg.w);
    }
  }
  const int steps = n_hi - n_lo;
  __nv_bfloat16* base = states + ((static_cast<int64_t>(bh) * a.N) * 2 * DK + c) * DV + e;
  __nv_bfloat16* obase = SINGLE ? out + ((static_cast<int64_t>(bh) * a.N) * DK + c) * DV + e : nullptr;
  const int64_t chunk = 2 * DK * DV;  // elements per chunk's hi/lo pair
  for (int j0 = 0; j0 < steps; j0 += kFixUnroll) {
    uint2 hr[kFixUnroll], lr[kFixUnroll];
#pragma unroll
    for (int u = 0; u < kFixUnroll; ++u) {
      const int j = j0 + u;
      if (j < steps) {
        const int n = REV ? n_hi - 1 - j : n_lo + j;
        const __nv_bfloat16* sp = base + n * chunk;
        hr[u] = *reinterpret_cast<const uint2*>(sp);
        lr[u] = *reinterpret_cast<const uint2*>(sp + DK * DV);
      }
    }
#pragma unroll
    for (int u = 0; u < kFixUnroll; ++u) {
      const int j = j0 + u;
      if (j >= steps) break;
      const int n = REV ? n_hi - 1 - j : n_lo + j;
      float w = j < kFixTab ? wtab[j] : static_cast<float>(pow(lam, static_cast<double>(j * kC)));
      if (doc && j >= kFixTab && k > 0 && cut(j)) w = 0.f;
      const float2 h0 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&hr[u].x));
      const float2 h1 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&hr[u].y));
      const float2 l0 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&lr[u].x));
      const float2 l1 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&lr[u].y));
      const float x0 = h0.x + l0.x + w * carry.x, x1 = h0.y + l0.y + w * carry.y;
      const float x2 = h1.x + l1.x + w * carry.z, x3 = h1.y + l1.y + w * carry.w;
      if (SINGLE) {
        __nv_bfloat162 o01 = __floats2bfloat162_rn(x0, x1), o23 = __floats2bfloat162_rn(x2, x3);
        uint2 o;
        o.x = *reinterpret_cast<uint32_t*>(&o01);
        o.y = *reinterpret_cast<uint32_t*>(&o23);
        *reinterpret_cast<uint2*>(obase + n * static_cast<int64_t>(DK * DV)) = o;
      } else {
        uint2 nh, nl;
        split2(x0, x1, nh.x, nl.x);
        split2(x2, x3, nh.y, nl.y);
        __nv_bfloat16* sp = base + n * chunk;
        *reinterpret_cast<uint2*>(sp) = nh;
        *reinterpret_cast<uint2*>(sp + DK * DV) = nl;
      }
    }
  }
  if (k == a.G - 1 && sfin.p) {  // the walk's last group also leaves the final state
    const float d = dtab[k];
    const float4 eg = *reinterpret_cast<const float4*>(end_of(k));
    const int64_t srow = slots ? slots[b] : b;
    float* f = sfin.p + srow * sfin.ss + h * sfin.sh + c * sfin.sk + e;
    *reinterpret_cast<float2*>(f) = make_float2(d * carry.x + eg.x, d * carry.y + eg.y);
    *reinterpret_cast<float2*>(f + 2) = make_float2(d * carry.z + eg.z, d * carry.w + eg.w);
  }
}

// Chunk groups for the state scans: enough (b, h, slice, group) blocks for about two per SM
// on a 132-SM part (a fixed target, so results do not depend on the device), groups of at
// least two chunks. G = 1 when the batch has `fill` scan blocks already: kScanBlocks for the
// forward; the backward (kBwdScanFill) splits only when its scans have fewer than one block per
// SM, so that training shapes (B·H·2 = 128 at B = 16, H = 4) keep one walk and their bits.
constexpr int kScanBlocks = 256;
constexpr int kBwdScanFill = 128;
static_assert(kMaxGroups >= kScanBlocks / 2, "group_fix_kernel tables λ^{len g} for every group");
inline void plan_groups(Args& a, int slices, int fill = kScanBlocks) {
  const int per_seq = a.B * a.H * slices;
  int G = per_seq >= fill ? 1 : kScanBlocks / per_seq;
  G = max(1, min(G, a.N / 2));
  const int NG = (a.N + G - 1) / G;
  a.G = (a.N + NG - 1) / NG;
  a.NG = NG;
}

// ---- row tiles ------------------------------------------------------------------------------------
// The chunk kernels give each warp one 16-row tile; causal work grows with the tile index
// (j ≤ i) or shrinks with it (t ≥ i). Warps w and w+4 share one of the SM's four tensor-core
// partitions, so tiles are paired (r, 7 − r) on a partition: warp w < 4 takes tile w, warp
// w ≥ 4 takes tile 11 − w. Every partition then gets the same amount of causal work (tiles in
// warp order would give partition 3 tiles 3 and 7: 1.4× the work of partition 0).
__device__ __forceinline__ int row_tile() {
  const int w = threadIdx.x >> 5;
  return w < 4 ? w : 11 - w;
}

// ---- causal decayed block in registers -------------------------------------------------------
// P[i][j] = Σ_k X[i][k]·Y[j][k] for the 16 rows of this warp (r0 = 16·warp) and all kC columns,
// X, Y row-major [kC][ld] in smem with a contraction length KD. LOWER: keep j ≤ i (column
// blocks 0..warp), else keep j ≥ i (blocks warp..7). Then P ← mul·λ^{|i−j|} on the kept
// triangle, 0 elsewhere, packed as bf16 A fragments (hi, and lo when SPLIT) per 16-column step.
// VARLEN: only pairs of one document are kept, as bounds of the lane's two rows (g, g + 8):
// LOWER keeps j ≥ lim0 / lim1 (the row's last start, −1: none), else j < lim0 / lim1 (the
// first start after the row, kC: none).
template <int KD, bool LOWER, bool SPLIT, bool VARLEN = false>
__device__ __forceinline__ void decayed_block(uint32_t (&ph)[8][4], uint32_t (&pl)[8][4], const __nv_bfloat16* Xs,
                                              const __nv_bfloat16* Ys, int ld, const float* pw, float mul,
                                              int lim0 = 0, int lim1 = 0) {
  const int rt = row_tile(), lane = threadIdx.x & 31, g = lane >> 2, q4 = lane & 3;
  const int r0 = rt * 16;
  float s[16][4];
#pragma unroll
  for (int nt = 0; nt < 16; ++nt)
#pragma unroll
    for (int r = 0; r < 4; ++r) s[nt][r] = 0.f;
#pragma unroll
  for (int ks = 0; ks < KD / 16; ++ks) {
    uint32_t xa[4];
    lda(xa, Xs, ld, r0, ks * 16);
#pragma unroll
    for (int np = 0; np < 8; ++np) {
      if (LOWER ? np <= rt : np >= rt) {
        uint32_t bf[4];
        ldb_nk(bf, Ys, ld, np * 16, ks * 16);
        mma(s[2 * np], xa, bf[0], bf[1]);
        mma(s[2 * np + 1], xa, bf[2], bf[3]);
      }
    }
  }
#pragma unroll
  for (int nt = 0; nt < 16; ++nt)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int i = r0 + g + (r >> 1) * 8, j = nt * 8 + 2 * q4 + (r & 1);
      const int d = LOWER ? i - j : j - i;
      if (VARLEN) {
        const int lim = r >> 1 ? lim1 : lim0;
        const bool keep = d >= 0 && (LOWER ? j >= lim : j < lim);
        s[nt][r] = keep ? mul * pw[d] * s[nt][r] : 0.f;
      } else {
        s[nt][r] = d >= 0 ? mul * pw[d] * s[nt][r] : 0.f;
      }
    }
#pragma unroll
  for (int st = 0; st < 8; ++st) {
    if (SPLIT) {
      split2(s[2 * st][0], s[2 * st][1], ph[st][0], pl[st][0]);
      split2(s[2 * st][2], s[2 * st][3], ph[st][1], pl[st][1]);
      split2(s[2 * st + 1][0], s[2 * st + 1][1], ph[st][2], pl[st][2]);
      split2(s[2 * st + 1][2], s[2 * st + 1][3], ph[st][3], pl[st][3]);
    } else {
      ph[st][0] = pack_bf16(s[2 * st][0], s[2 * st][1]);
      ph[st][1] = pack_bf16(s[2 * st][2], s[2 * st][3]);
      ph[st][2] = pack_bf16(s[2 * st + 1][0], s[2 * st + 1][1]);
      ph[st][3] = pack_bf16(s[2 * st + 1][2], s[2 * st + 1][3]);
    }
  }
}

// Row scale of a [16 × 8·NT] accumulator: rows g get f0, rows g+8 get f1.
template <int NT>
__device__ __forceinline__ void scale_rows(float (&acc)[NT][4], float f0, float f1) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    acc[nt][0] *= f0;
    acc[nt][1] *= f0;
    acc[nt][2] *= f1;
    acc[nt][3] *= f1;
  }
}
template <int NT>
__device__ __forceinline__ void zero(float (&acc)[NT][4]) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int r = 0; r < 4; ++r) acc[nt][r] = 0.f;
}
// Stores rows r0+g, r0+g+8 (when < Le) of a [16 × 8·NT] accumulator at columns c0 + 8·nt + 2·q.
template <int NT>
__device__ __forceinline__ void store_rows(const float (&acc)[NT][4], const OutV& o, int b, int t0, int Le, int h,
                                           int c0) {
  const int rt = row_tile(), lane = threadIdx.x & 31, g = lane >> 2, q4 = lane & 3;
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int i = rt * 16 + g + hr * 8;
    if (i >= Le) continue;
    const int64_t row = o.at(b, t0 + i, h) + c0 + 2 * q4;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) store2(o.p, o.dt, row + nt * 8, acc[nt][2 * hr], acc[nt][2 * hr + 1]);
  }
}

// Where a chunk kernel's block and warp work (grid B·H·N, block = bh·N + n): sequence b, head h,
// chunk n of Le rows from t0; the warp's row tile rt (rows r0 … r0 + 15) and its lane's g.
struct ChunkTile {
  int bh, n, b, h, t0, Le, rt, g, r0;
};
__device__ __forceinline__ ChunkTile chunk_tile(const Args& a) {
  ChunkTile c;
  c.bh = blockIdx.x / a.N;
  c.n = blockIdx.x - c.bh * a.N;
  c.b = c.bh / a.H;
  c.h = c.bh - c.b * a.H;
  c.t0 = c.n * kC;
  c.Le = min(kC, a.T - c.t0);
  c.rt = row_tile();
  c.g = (threadIdx.x & 31) >> 2;
  c.r0 = c.rt * 16;
  return c;
}

// acc += rows r0 … r0 + 15 of X [·][ldx] times columns c0 … c0 + 8·NT − 1 of a [KD × ·] operand B,
// contracting over KD: B stored row-major [KD][ldb] (KN), or as its transpose, B[k][c] at
// c·ldb + k. TWO adds B2's product (the state's lo plane) right after B's at each step.
template <int KD, int NT, bool KN, bool TWO = false>
__device__ __forceinline__ void mma_rows(float (&acc)[NT][4], const __nv_bfloat16* X, int ldx, int r0,
                                         const __nv_bfloat16* B, const __nv_bfloat16* B2, int ldb, int c0) {
#pragma unroll
  for (int ks = 0; ks < KD / 16; ++ks) {
    uint32_t xa[4];
    lda(xa, X, ldx, r0, ks * 16);
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
      uint32_t bf[4];
      if (KN) ldb_kn(bf, B, ldb, ks * 16, c0 + np * 16);
      else ldb_nk(bf, B, ldb, c0 + np * 16, ks * 16);
      mma(acc[2 * np], xa, bf[0], bf[1]);
      mma(acc[2 * np + 1], xa, bf[2], bf[3]);
      if (TWO) {
        if (KN) ldb_kn(bf, B2, ldb, ks * 16, c0 + np * 16);
        else ldb_nk(bf, B2, ldb, c0 + np * 16, ks * 16);
        mma(acc[2 * np], xa, bf[0], bf[1]);
        mma(acc[2 * np + 1], xa, bf[2], bf[3]);
      }
    }
  }
}

// acc += P·Y over the 16-column steps of this warp's causal triangle (LOWER: steps 0 … rt, else
// rt … 7): P packed by decayed_block (ph, then pl when LO), Y [kC][ldy], columns c0 … c0 + 8·NT − 1.
template <int NT, bool LOWER, bool LO = false>
__device__ __forceinline__ void mma_causal(float (&acc)[NT][4], const uint32_t (&ph)[8][4], const uint32_t (&pl)[8][4],
                                           int rt, const __nv_bfloat16* Y, int ldy, int c0) {
#pragma unroll
  for (int ks = 0; ks < 8; ++ks) {
    if (LOWER ? ks <= rt : ks >= rt) {
#pragma unroll
      for (int np = 0; np < NT / 2; ++np) {
        uint32_t bf[4];
        ldb_kn(bf, Y, ldy, ks * 16, c0 + np * 16);
        mma(acc[2 * np], ph[ks], bf[0], bf[1]);
        mma(acc[2 * np + 1], ph[ks], bf[2], bf[3]);
        if (LO) {
          mma(acc[2 * np], pl[ks], bf[0], bf[1]);
          mma(acc[2 * np + 1], pl[ks], bf[2], bf[3]);
        }
      }
    }
  }
}

// ---- forward output ----------------------------------------------------------------------------
// grid B·H·N (block = bh·N + n), 256 threads; states bf16 hi/lo planes [B·H][N][2][DK][DV].
// VARLEN: the chunk's start mask (store_starts) follows the powers of λ in shared memory.
constexpr int kThreads = 256;
constexpr int kMaskBytes = kMaskWords * 4;
template <int DK, int DV, bool VARLEN = false>
constexpr int fwd_smem_bytes() {
  return 2 * kC * (DK + 8) * 2 + kC * (DV + 8) * 2 + 2 * DK * (DV + 8) * 2 + (kC + 4) * 4 + (VARLEN ? kMaskBytes : 0);
}

template <int DK, int DV, bool VARLEN = false>
__global__ void __launch_bounds__(kThreads, 1) fwd_o_kernel(Args a, Act Q, Act K, Act V, OutV O,
                                                            const __nv_bfloat16* states) {
  static_assert(DK % 16 == 0 && DV % 32 == 0, "fwd_o_kernel tiling");
  constexpr int LDK = DK + 8, LDV = DV + 8, HALF = DV / 2, NT = HALF / 8;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __nv_bfloat16* Qs = reinterpret_cast<__nv_bfloat16*>(smem_raw);
  __nv_bfloat16* Ks = Qs + kC * LDK;
  __nv_bfloat16* Vs = Ks + kC * LDK;
  __nv_bfloat16* Sh = Vs + kC * LDV;
  __nv_bfloat16* Sl = Sh + DK * LDV;
  float* pw = reinterpret_cast<float*>(Sl + DK * LDV);
  uint32_t* starts = reinterpret_cast<uint32_t*>(pw + kC + 4);  // VARLEN only

  const auto [bh, n, b, h, t0, Le, rt, g, r0] = chunk_tile(a);
  const int dval = VARLEN ? fetch_doc(a, b, t0, Le) : 0;

  // two cp.async groups: Q, K first (the QKᵀ block starts as soon as they land), then V and
  // the state's hi/lo planes, which load while the block is computed
  load_rows_async<DK>(Qs, LDK, Q, b, t0, Le, h);
  load_rows_async<DK>(Ks, LDK, K, b, t0, Le, h);
  asm volatile("cp.async.commit_group;\n" ::: "memory");
  load_rows_async<DV>(Vs, LDV, V, b, t0, Le, h);
  const __nv_bfloat16* sp = states + (static_cast<int64_t>(bh) * a.N + n) * 2 * DK * DV;
  load_plane_async<DK, DV>(Sh, LDV, sp);
  load_plane_async<DK, DV>(Sl, LDV, sp + DK * DV);
  asm volatile("cp.async.commit_group;\n" ::: "memory");
  load_powers(pw, a.lam[h]);
  if (VARLEN) store_starts(starts, dval, t0);
  asm volatile("cp.async.wait_group 1;\n" ::: "memory");
  __syncthreads();

  // A = scale·λ^{i−j}·(q_i·k_j), j ≤ i, split hi/lo (see the precision note at the top).
  // VARLEN: j in row i's document only, and the state term only for rows whose document
  // began before the chunk (last start lo < 0).
  int lo0 = -1, lo1 = -1;
  if (VARLEN) {
    StartMask m;
    read_starts(m, starts);
    lo0 = start_le(m, r0 + g);
    lo1 = start_le(m, r0 + g + 8);
  }
  uint32_t ah[8][4], al[8][4];
  decayed_block<DK, true, GLA_A_LO, VARLEN>(ah, al, Qs, Ks, LDK, pw, a.scale, lo0, lo1);
  cp_async_wait_all();
  __syncthreads();

  const int i0 = r0 + g, i1 = i0 + 8;
  float f0 = a.scale * pw[i0 + 1], f1 = a.scale * pw[i1 + 1];
  if (VARLEN) {
    if (lo0 >= 0) f0 = 0.f;
    if (lo1 >= 0) f1 = 0.f;
  }
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    float acc[NT][4];
    zero(acc);
    // inter-chunk: q_i · S (hi + lo), then the row factor scale·λ^{i+1}
    mma_rows<DK, NT, true, GLA_S_LO>(acc, Qs, LDK, r0, Sh, Sl, LDV, hf * HALF);
    scale_rows(acc, f0, f1);
    // intra-chunk: A · V over the column blocks j ≤ this warp's rows
    mma_causal<NT, true, GLA_A_LO>(acc, ah, al, rt, Vs, LDV, hf * HALF);
    store_rows(acc, O, b, t0, Le, h, hf * HALF);
  }
}

// ---- backward: dv ------------------------------------------------------------------------------
// grid B·H·N, 256 threads; gstates bf16 [B·H][N][DK][DV] (G_n). VARLEN as in fwd_o_kernel.
template <int DK, int DV, bool VARLEN = false>
constexpr int bwd_dv_smem_bytes() {
  return 2 * kC * (DK + 8) * 2 + kC * (DV + 8) * 2 + DK * (DV + 8) * 2 + (kC + 4) * 4 + (VARLEN ? kMaskBytes : 0);
}
template <int DK, int DV, bool VARLEN = false>
__global__ void __launch_bounds__(kThreads, 1) bwd_dv_kernel(Args a, Act Q, Act K, Act dO, OutV dV,
                                                            const __nv_bfloat16* gstates) {
  constexpr int LDK = DK + 8, LDV = DV + 8, HALF = DV / 2, NT = HALF / 8;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __nv_bfloat16* Qs = reinterpret_cast<__nv_bfloat16*>(smem_raw);
  __nv_bfloat16* Ks = Qs + kC * LDK;
  __nv_bfloat16* Os = Ks + kC * LDK;
  __nv_bfloat16* Gs = Os + kC * LDV;
  float* pw = reinterpret_cast<float*>(Gs + DK * LDV);
  uint32_t* starts = reinterpret_cast<uint32_t*>(pw + kC + 4);  // VARLEN only

  const auto [bh, n, b, h, t0, Le, rt, g, r0] = chunk_tile(a);
  const int dval = VARLEN ? fetch_doc(a, b, t0, Le) : 0;

  load_rows_async<DK>(Qs, LDK, Q, b, t0, Le, h);
  load_rows_async<DK>(Ks, LDK, K, b, t0, Le, h);
  asm volatile("cp.async.commit_group;\n" ::: "memory");
  load_rows_async<DV>(Os, LDV, dO, b, t0, Le, h);
  load_plane_async<DK, DV>(Gs, LDV, gstates + (static_cast<int64_t>(bh) * a.N + n) * DK * DV);
  asm volatile("cp.async.commit_group;\n" ::: "memory");
  load_powers(pw, a.lam[h]);
  if (VARLEN) store_starts(starts, dval, t0);
  asm volatile("cp.async.wait_group 1;\n" ::: "memory");
  __syncthreads();

  // Aᵀ[i][t] = scale·λ^{t−i}·(k_i·q_t), t ≥ i   (while dO and G_n load). VARLEN: t before the
  // first start after i, and the G_n term only for rows from the chunk's last start on.
  int hi0 = kC, hi1 = kC, last = -1;
  if (VARLEN) {
    StartMask m;
    read_starts(m, starts);
    hi0 = start_gt(m, r0 + g);
    hi1 = start_gt(m, r0 + g + 8);
    last = start_le(m, kC - 1);
  }
  uint32_t ph[8][4], pl[8][4];
  decayed_block<DK, false, false, VARLEN>(ph, pl, Ks, Qs, LDK, pw, a.scale, hi0, hi1);
  cp_async_wait_all();
  __syncthreads();
  const int i0 = r0 + g, i1 = i0 + 8;
  float f0 = i0 < Le ? pw[Le - 1 - i0] : 0.f, f1 = i1 < Le ? pw[Le - 1 - i1] : 0.f;
  if (VARLEN) {
    if (i0 < last) f0 = 0.f;
    if (i1 < last) f1 = 0.f;
  }
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    float acc[NT][4];
    zero(acc);
    mma_rows<DK, NT, true>(acc, Ks, LDK, r0, Gs, nullptr, LDV, hf * HALF);
    scale_rows(acc, f0, f1);
    mma_causal<NT, false>(acc, ph, pl, rt, Os, LDV, hf * HALF);
    store_rows(acc, dV, b, t0, Le, h, hf * HALF);
  }
}

// ---- backward: dq and dk -----------------------------------------------------------------------
// grid B·H·N, 256 threads; sstates (S_n) and gstates (G_n) bf16 [B·H][N][DK][DV]. The S and G
// tiles share one smem buffer (all tiles at once would need 233 KB > 227 KB).
template <int DK, int DV, bool VARLEN = false>
constexpr int bwd_dqk_smem_bytes() {
  return 2 * kC * (DK + 8) * 2 + 2 * kC * (DV + 8) * 2 + DK * (DV + 8) * 2 + (kC + 4) * 4 + (VARLEN ? kMaskBytes : 0);
}
template <int DK, int DV, bool VARLEN = false>
__global__ void __launch_bounds__(kThreads, 1) bwd_dqk_kernel(Args a, Act Q, Act K, Act V, Act dO, OutV dQ, OutV dK,
                                                             const __nv_bfloat16* sstates,
                                                             const __nv_bfloat16* gstates) {
  constexpr int LDK = DK + 8, LDV = DV + 8, NT = DK / 8;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __nv_bfloat16* Qs = reinterpret_cast<__nv_bfloat16*>(smem_raw);
  __nv_bfloat16* Ks = Qs + kC * LDK;
  __nv_bfloat16* Vs = Ks + kC * LDK;
  __nv_bfloat16* Os = Vs + kC * LDV;
  __nv_bfloat16* SG = Os + kC * LDV;
  float* pw = reinterpret_cast<float*>(SG + DK * LDV);
  uint32_t* starts = reinterpret_cast<uint32_t*>(pw + kC + 4);  // VARLEN only

  const auto [bh, n, b, h, t0, Le, rt, g, r0] = chunk_tile(a);
  const int64_t plane = (static_cast<int64_t>(bh) * a.N + n) * DK * DV;
  const int dval = VARLEN ? fetch_doc(a, b, t0, Le) : 0;

  load_rows_async<DV>(Vs, LDV, V, b, t0, Le, h);
  load_rows_async<DV>(Os, LDV, dO, b, t0, Le, h);
  asm volatile("cp.async.commit_group;\n" ::: "memory");
  load_rows_async<DK>(Qs, LDK, Q, b, t0, Le, h);
  load_rows_async<DK>(Ks, LDK, K, b, t0, Le, h);
  if (dQ.p) load_plane_async<DK, DV>(SG, LDV, sstates + plane);
  asm volatile("cp.async.commit_group;\n" ::: "memory");
  load_powers(pw, a.lam[h]);
  if (VARLEN) store_starts(starts, dval, t0);
  asm volatile("cp.async.wait_group 1;\n" ::: "memory");
  __syncthreads();

  const int i0 = r0 + g, i1 = i0 + 8;
  uint32_t ph[8][4], pl[8][4];
  if (dQ.p) {
    // P[i][j] = scale·λ^{i−j}·(dO_i·v_j), j ≤ i   (while Q, K and S_n load); VARLEN as in
    // fwd_o_kernel
    int lo0 = -1, lo1 = -1;
    if (VARLEN) {
      StartMask m;
      read_starts(m, starts);
      lo0 = start_le(m, i0);
      lo1 = start_le(m, i1);
    }
    decayed_block<DV, true, false, VARLEN>(ph, pl, Os, Vs, LDV, pw, a.scale, lo0, lo1);
    cp_async_wait_all();
    __syncthreads();
    float acc[NT][4];
    zero(acc);
    // dO_i · S_nᵀ: B[e][c] = S[c][e], i.e. S is the transposed layout
    mma_rows<DV, NT, false>(acc, Os, LDV, r0, SG, nullptr, LDV, 0);
    float f0 = a.scale * pw[i0 + 1], f1 = a.scale * pw[i1 + 1];
    if (VARLEN) {
      if (lo0 >= 0) f0 = 0.f;
      if (lo1 >= 0) f1 = 0.f;
    }
    scale_rows(acc, f0, f1);
    mma_causal<NT, true>(acc, ph, pl, rt, Ks, LDK, 0);
    store_rows(acc, dQ, b, t0, Le, h, 0);
  }
  if (dK.p) {
    cp_async_wait_all();  // Q, K when dQ was not requested
    __syncthreads();      // every warp is done with S_n
    load_plane_async<DK, DV>(SG, LDV, gstates + plane);
    asm volatile("cp.async.commit_group;\n" ::: "memory");
    // Pᵀ[i][t] = scale·λ^{t−i}·(v_i·dO_t), t ≥ i   (computed while G_n loads); VARLEN as in
    // bwd_dv_kernel
    int hi0 = kC, hi1 = kC, last = -1;
    if (VARLEN) {
      StartMask m;
      read_starts(m, starts);
      hi0 = start_gt(m, i0);
      hi1 = start_gt(m, i1);
      last = start_le(m, kC - 1);
    }
    decayed_block<DV, false, false, VARLEN>(ph, pl, Vs, Os, LDV, pw, a.scale, hi0, hi1);
    cp_async_wait_all();
    __syncthreads();
    float acc[NT][4];
    zero(acc);
    mma_rows<DV, NT, false>(acc, Vs, LDV, r0, SG, nullptr, LDV, 0);
    float f0 = i0 < Le ? pw[Le - 1 - i0] : 0.f, f1 = i1 < Le ? pw[Le - 1 - i1] : 0.f;
    if (VARLEN) {
      if (i0 < last) f0 = 0.f;
      if (i1 < last) f1 = 0.f;
    }
    scale_rows(acc, f0, f1);
    mma_causal<NT, false>(acc, ph, pl, rt, Qs, LDK, 0);
    store_rows(acc, dK, b, t0, Le, h, 0);
  }
}

}  // namespace laplace::cuda::gla_tc
