// GLA mixer on CUDA (docs/model.md §4), generic path: one 256-thread block per (b, h) walks the chunks
// in order with the fp32 state in shared memory. The model's shapes (dk = 96, dv = 192, bf16)
// take the tensor-core path of kernels_gla_tc.cu instead (tried first by gla_forward /
// gla_backward below); this one serves every other shape, F32 inputs and decode steps. All matrix products are
// register-tiled 4×4 FFMA products over shared-memory tiles (tile_mm); tensor cores and
// sequence splitting come later.
//
// Per head, with q̃ = scale·q, chunk length Le ≤ L (the kernel's own chunk) and S the state
// entering the chunk (i, j, t: positions in the chunk):
//   forward   o_i = λ^{i+1} q̃_i S + Σ_{j≤i} λ^{i−j} (q̃_i·k_j) v_j
//             S  ← λ^{Le} S + Σ_j λ^{Le−1−j} k_jᵀ v_j
//   backward, dq (forward sweep, S recomputed):
//             dq_i = scale·( λ^{i+1} S dO_iᵀ + Σ_{j≤i} λ^{i−j} (dO_i·v_j) k_j )
//   backward, dk/dv (reverse sweep; G = ∂L/∂(state leaving the chunk), G = ds_out at the end):
//             dv_i = λ^{Le−1−i} k_i G + Σ_{t≥i} λ^{t−i} (q̃_t·k_i) dO_t
//             dk_i = λ^{Le−1−i} G v_iᵀ + Σ_{t≥i} λ^{t−i} (dO_t·v_i) q̃_t
//             G  ← λ^{Le} G + Σ_t λ^{t+1} q̃_tᵀ dO_t       (after chunk 0: ds_in = G)
// Every sum runs in a fixed order, so results are bitwise reproducible.
//
// Documents kept apart (GlaParams::doc; the VARLEN instances): with d = doc[b][n0 + ·] of the
// chunk in shared memory (n0 its first position) and ℓ = d_{Le−1} (the chunk's last document
// start when ≥ n0), the chunk's terms are masked as in the tensor-core kernels (gla_tc.cuh):
// the S term of o_i and dq_i only when d_i < n0; pairs (i, j) only when d_i = d_j; the state
// carried across the chunk (S or G) zeroed when ℓ ≥ n0; S gains k_jᵀv_j only for n0 + j ≥ ℓ
// (and dk_j, dv_j get the G term likewise); G gains q̃_tᵀdO_t only for d_t < n0. The kernel's
// own chunk need not be 128: the masks depend on positions only.
#include <cmath>
#include <string>

#include "ops/cuda/cuda_common.cuh"

namespace laplace {
namespace cuda {

constexpr int kGlaThreads = 256;
constexpr int kGlaMaxHeads = 128;
constexpr int kGlaMaxChunk = 64;
constexpr int kGlaMaxDk = 128;
constexpr int kGlaMaxDv = 256;

// [B,T,H,d] activation view: element (b, t, h, i) at p + b·sb + t·st + h·sh + i.
struct HView {
  void* p = nullptr;
  int dt = kF32;
  int64_t sb = 0, st = 0, sh = 0;
  __device__ __forceinline__ int64_t at(int64_t b, int64_t t, int64_t h) const { return b * sb + t * st + h * sh; }
};

// [S,H,dk,dv] F32 state view: element (s, h, i, e) at p + s·ss + h·sh + i·sk + e.
struct SView {
  float* p = nullptr;
  int64_t ss = 0, sh = 0, sk = 0;
  __device__ __forceinline__ float* at(int64_t s, int64_t h) const { return p + s * ss + h * sh; }
};

struct GlaArgs {
  int B, T, H, dk, dv, L;
  float scale;
  double lam[kGlaMaxHeads];  // λ_h
  const int32_t* doc;        // [B, T] document starts (VARLEN instances only)
};

// ---- block-wide register-tiled product ---------------------------------------------------------
// C[M,N] = Σ_k A(i,k)·B(k,j) (and a second product over K2 in tile_mm2). Each thread owns 4×4
// tiles: rows 4·ti + r, columns tj + nt·c (nt = ⌈N/4⌉), so adjacent lanes read adjacent
// columns of B and mostly the same rows of A (broadcast). Out-of-range rows/columns are
// clamped for the loads and skipped in the epilogue.
// The loads' rows ii and columns jj of tile t (clamped into the matrix).
__device__ __forceinline__ void tile_coords(int t, int M, int N, int nt, int& ti, int& tj, int (&ii)[4], int (&jj)[4]) {
  ti = t / nt;
  tj = t - ti * nt;
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    ii[r] = min(4 * ti + r, M - 1);
    jj[r] = min(tj + nt * r, N - 1);
  }
}

// acc[r][c] = Σ_{k<K} A(ii[r], k)·B(k, jj[c]), k in order, from zero.
template <class FA, class FB>
__device__ __forceinline__ void tile_product(float (&acc)[4][4], const int (&ii)[4], const int (&jj)[4], int K, FA fa,
                                             FB fb) {
#pragma unroll
  for (int r = 0; r < 4; ++r)
#pragma unroll
    for (int c = 0; c < 4; ++c) acc[r][c] = 0.f;
  for (int kk = 0; kk < K; ++kk) {
    float av[4], bv[4];
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      av[r] = fa(ii[r], kk);
      bv[r] = fb(kk, jj[r]);
    }
#pragma unroll
    for (int r = 0; r < 4; ++r)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[r][c] = fmaf(av[r], bv[c], acc[r][c]);
  }
}

template <class FA, class FB, class FE>
__device__ __forceinline__ void tile_mm(int M, int N, int K, FA fa, FB fb, FE epi) {
  const int mt = (M + 3) >> 2, nt = (N + 3) >> 2;
  for (int t = threadIdx.x; t < mt * nt; t += blockDim.x) {
    int ti, tj, ii[4], jj[4];
    tile_coords(t, M, N, nt, ti, tj, ii, jj);
    float acc[4][4];
    tile_product(acc, ii, jj, K, fa, fb);
#pragma unroll
    for (int r = 0; r < 4; ++r)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int i = 4 * ti + r, j = tj + nt * c;
        if (i < M && j < N) epi(i, j, acc[r][c]);
      }
  }
}

// Two products with the same output tile: x = Σ_{k<K1} A1(i,k)B1(k,j), y = Σ_{k<K2} A2(i,k)B2(k,j);
// epi(i, j, x, y).
template <class FA1, class FB1, class FA2, class FB2, class FE>
__device__ __forceinline__ void tile_mm2(int M, int N, int K1, int K2, FA1 fa1, FB1 fb1, FA2 fa2, FB2 fb2, FE epi) {
  const int mt = (M + 3) >> 2, nt = (N + 3) >> 2;
  for (int t = threadIdx.x; t < mt * nt; t += blockDim.x) {
    int ti, tj, ii[4], jj[4];
    tile_coords(t, M, N, nt, ti, tj, ii, jj);
    float x[4][4], y[4][4];
    tile_product(x, ii, jj, K1, fa1, fb1);
    tile_product(y, ii, jj, K2, fa2, fb2);
#pragma unroll
    for (int r = 0; r < 4; ++r)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int i = 4 * ti + r, j = tj + nt * c;
        if (i < M && j < N) epi(i, j, x[r][c], y[r][c]);
      }
  }
}

// Loads rows [n0, n0+Le) of head h of sequence b into a shared tile [Le, d] with leading
// dimension ld, multiplied by `mul`.
__device__ __forceinline__ void load_rows(float* dst, int ld, const HView& v, int b, int n0, int Le, int h, int d,
                                          float mul) {
  for (int idx = threadIdx.x; idx < Le * d; idx += blockDim.x) {
    const int i = idx / d, c = idx - i * d;
    dst[i * ld + c] = mul * ldf(v.p, v.at(b, n0 + i, h) + c, v.dt);
  }
}

// pw[m] = λ^m for m = 0..L, from double.
__device__ __forceinline__ void load_powers(float* pw, double lam, int L) {
  for (int m = threadIdx.x; m <= L; m += blockDim.x) pw[m] = static_cast<float>(pow(lam, static_cast<double>(m)));
}

// State plane [dk,dv] (global, row stride sk) <-> shared [dk, dv+1]; src null gives zeros.
__device__ __forceinline__ void load_state(float* Ss, int ldv, const float* src, int64_t sk, int dk, int dv) {
  for (int idx = threadIdx.x; idx < dk * dv; idx += blockDim.x) {
    const int i = idx / dv, e = idx - i * dv;
    Ss[i * ldv + e] = src ? src[i * sk + e] : 0.f;
  }
}
__device__ __forceinline__ void store_state(float* dst, int64_t sk, const float* Ss, int ldv, int dk, int dv) {
  for (int idx = threadIdx.x; idx < dk * dv; idx += blockDim.x) {
    const int i = idx / dv, e = idx - i * dv;
    dst[i * sk + e] = Ss[i * ldv + e];
  }
}

// Shared-memory footprint (floats) of each kernel for a chunk of L rows. Rows are padded by
// one float (odd leading dimensions) so that column walks hit distinct banks. VARLEN kernels
// keep the chunk's doc values (L ints) after the powers.
enum GlaKernel { kGlaFwd = 0, kGlaBwdDq = 1, kGlaBwdDkv = 2 };
inline int64_t gla_smem_floats(int kind, int L, int dk, int dv, bool varlen = false) {
  const int64_t ldk = dk + 1, ldv = dv + 1, ldl = L + 1;
  const int64_t pw = L + 1 + (varlen ? L : 0);
  switch (kind) {
    case kGlaFwd: return 2 * L * ldk + L * ldv + dk * ldv + L * ldl + pw;    // Q K V S A pw
    case kGlaBwdDq: return L * ldk + 2 * L * ldv + dk * ldv + L * ldl + pw;  // K V dO S P pw
    default: return 2 * L * ldk + 2 * L * ldv + dk * ldv + L * ldl + pw;     // Q K V dO G M pw
  }
}

// VARLEN: the chunk's doc values Ds[i] = doc[b][n0 + i], i < Le (the caller synchronises).
__device__ __forceinline__ void load_doc(int* Ds, const GlaArgs& a, int b, int n0, int Le) {
  for (int i = threadIdx.x; i < Le; i += blockDim.x) Ds[i] = a.doc[static_cast<int64_t>(b) * a.T + n0 + i];
}

// ---- forward -------------------------------------------------------------------------------------
// grid B·H, block 256. q,k [B,T,H,dk]; v,o [B,T,H,dv]; s_in, s_out [S,H,dk,dv] (slot = slots[b] or b)
template <bool VARLEN>
__global__ void __launch_bounds__(kGlaThreads) gla_fwd_kernel(GlaArgs a, HView q, HView k, HView v, HView o,
                                                              SView s_in, SView s_out, const int32_t* slots) {
  extern __shared__ float sm[];
  const int b = blockIdx.x / a.H, h = blockIdx.x - (blockIdx.x / a.H) * a.H;
  const int dk = a.dk, dv = a.dv, L = a.L;
  const int ldk = dk + 1, ldv = dv + 1, ldl = L + 1;
  float* Qs = sm;              // [L, dk+1]  q̃ of the chunk
  float* Ks = Qs + L * ldk;    // [L, dk+1]
  float* Vs = Ks + L * ldk;    // [L, dv+1]
  float* Ss = Vs + L * ldv;    // [dk, dv+1] state entering the chunk (fp32)
  float* As = Ss + dk * ldv;   // [L, L+1]   λ^{i−j} q̃_i·k_j for j ≤ i, else 0
  float* pw = As + L * ldl;    // [L+1]      λ^m
  int* Ds = reinterpret_cast<int*>(pw + L + 1);  // [L] VARLEN: the chunk's doc values
  load_powers(pw, a.lam[h], L);
  const int64_t slot = slots ? slots[b] : b;
  load_state(Ss, ldv, s_in.p ? s_in.at(slot, h) : nullptr, s_in.sk, dk, dv);
  __syncthreads();
  for (int n0 = 0; n0 < a.T; n0 += L) {
    const int Le = min(L, a.T - n0);
    load_rows(Qs, ldk, q, b, n0, Le, h, dk, a.scale);
    load_rows(Ks, ldk, k, b, n0, Le, h, dk, 1.f);
    load_rows(Vs, ldv, v, b, n0, Le, h, dv, 1.f);
    if (VARLEN) load_doc(Ds, a, b, n0, Le);
    __syncthreads();
    // A[i][j] = λ^{i−j} q̃_i·k_j (j ≤ i; VARLEN: of one document)
    tile_mm(
        Le, Le, dk, [=](int i, int c) { return Qs[i * ldk + c]; }, [=](int c, int j) { return Ks[j * ldk + c]; },
        [=](int i, int j, float x) {
          As[i * ldl + j] = j <= i && (!VARLEN || Ds[j] == Ds[i]) ? pw[i - j] * x : 0.f;
        });
    __syncthreads();
    // o_i = λ^{i+1} q̃_i S + Σ_j A[i][j] v_j   (VARLEN: the S term when i's document began earlier)
    tile_mm2(
        Le, dv, dk, Le, [=](int i, int c) { return Qs[i * ldk + c]; }, [=](int c, int e) { return Ss[c * ldv + e]; },
        [=](int i, int j) { return As[i * ldl + j]; }, [=](int j, int e) { return Vs[j * ldv + e]; },
        [=](int i, int e, float x, float y) {
          const float f = !VARLEN || Ds[i] < n0 ? pw[i + 1] : 0.f;
          stf(o.p, o.at(b, n0 + i, h) + e, o.dt, f * x + y);
        });
    __syncthreads();
    // S ← λ^{Le} S + Σ_j λ^{Le−1−j} k_jᵀ v_j   (each thread updates the S entries it owns;
    // VARLEN: from zero when a document starts in the chunk, with the rows of its last one)
    const int last = VARLEN ? Ds[Le - 1] : -1;
    const float dec = VARLEN && last >= n0 ? 0.f : pw[Le];
    tile_mm(
        dk, dv, Le, [=](int c, int j) { return Ks[j * ldk + c] * (!VARLEN || n0 + j >= last ? pw[Le - 1 - j] : 0.f); },
        [=](int j, int e) { return Vs[j * ldv + e]; },
        [=](int c, int e, float x) { Ss[c * ldv + e] = dec * Ss[c * ldv + e] + x; });
    __syncthreads();
  }
  if (s_out.p) store_state(s_out.at(slot, h), s_out.sk, Ss, ldv, dk, dv);
}

// ---- backward: dq (forward sweep) ------------------------------------------------------------------
// grid B·H. k [B,T,H,dk]; v, d_o [B,T,H,dv]; dq [B,T,H,dk]; s_in [≥B,H,dk,dv] by batch row
template <bool VARLEN>
__global__ void __launch_bounds__(kGlaThreads) gla_bwd_dq_kernel(GlaArgs a, HView k, HView v, HView d_o, HView dq,
                                                                 SView s_in) {
  extern __shared__ float sm[];
  const int b = blockIdx.x / a.H, h = blockIdx.x - (blockIdx.x / a.H) * a.H;
  const int dk = a.dk, dv = a.dv, L = a.L;
  const int ldk = dk + 1, ldv = dv + 1, ldl = L + 1;
  float* Ks = sm;              // [L, dk+1]
  float* Vs = Ks + L * ldk;    // [L, dv+1]
  float* Gs = Vs + L * ldv;    // [L, dv+1]  dO of the chunk
  float* Ss = Gs + L * ldv;    // [dk, dv+1] state entering the chunk
  float* Ps = Ss + dk * ldv;   // [L, L+1]   λ^{i−j} dO_i·v_j for j ≤ i, else 0
  float* pw = Ps + L * ldl;    // [L+1]
  int* Ds = reinterpret_cast<int*>(pw + L + 1);  // [L] VARLEN: the chunk's doc values
  load_powers(pw, a.lam[h], L);
  load_state(Ss, ldv, s_in.p ? s_in.at(b, h) : nullptr, s_in.sk, dk, dv);
  __syncthreads();
  const float scale = a.scale;
  for (int n0 = 0; n0 < a.T; n0 += L) {
    const int Le = min(L, a.T - n0);
    load_rows(Ks, ldk, k, b, n0, Le, h, dk, 1.f);
    load_rows(Vs, ldv, v, b, n0, Le, h, dv, 1.f);
    load_rows(Gs, ldv, d_o, b, n0, Le, h, dv, 1.f);
    if (VARLEN) load_doc(Ds, a, b, n0, Le);
    __syncthreads();
    // P[i][j] = λ^{i−j} dO_i·v_j (j ≤ i; VARLEN: of one document)
    tile_mm(
        Le, Le, dv, [=](int i, int e) { return Gs[i * ldv + e]; }, [=](int e, int j) { return Vs[j * ldv + e]; },
        [=](int i, int j, float x) {
          Ps[i * ldl + j] = j <= i && (!VARLEN || Ds[j] == Ds[i]) ? pw[i - j] * x : 0.f;
        });
    __syncthreads();
    // dq_i = scale·(λ^{i+1} Σ_e dO_i[e] S[:,e] + Σ_j P[i][j] k_j)   (VARLEN: the S term as in the forward)
    tile_mm2(
        Le, dk, dv, Le, [=](int i, int e) { return Gs[i * ldv + e]; }, [=](int e, int c) { return Ss[c * ldv + e]; },
        [=](int i, int j) { return Ps[i * ldl + j]; }, [=](int j, int c) { return Ks[j * ldk + c]; },
        [=](int i, int c, float x, float y) {
          const float f = !VARLEN || Ds[i] < n0 ? pw[i + 1] : 0.f;
          stf(dq.p, dq.at(b, n0 + i, h) + c, dq.dt, scale * (f * x + y));
        });
    __syncthreads();
    // S ← λ^{Le} S + Σ_j λ^{Le−1−j} k_jᵀ v_j   (VARLEN as in the forward)
    const int last = VARLEN ? Ds[Le - 1] : -1;
    const float dec = VARLEN && last >= n0 ? 0.f : pw[Le];
    tile_mm(
        dk, dv, Le, [=](int c, int j) { return Ks[j * ldk + c] * (!VARLEN || n0 + j >= last ? pw[Le - 1 - j] : 0.f); },
        [=](int j, int e) { return Vs[j * ldv + e]; },
        [=](int c, int e, float x) { Ss[c * ldv + e] = dec * Ss[c * ldv + e] + x; });
    __syncthreads();
  }
}

// ---- backward: dk, dv, ds_in (reverse sweep) ---------------------------------------------------------
// grid B·H. q, k, dk [B,T,H,dk]; v, d_o, dv [B,T,H,dv]; ds_out, ds_in [≥B,H,dk,dv] by batch row
template <bool VARLEN>
__global__ void __launch_bounds__(kGlaThreads) gla_bwd_dkv_kernel(GlaArgs a, HView q, HView k, HView v, HView d_o,
                                                                  HView dk_out, HView dv_out, SView ds_out,
                                                                  SView ds_in) {
  extern __shared__ float sm[];
  const int b = blockIdx.x / a.H, h = blockIdx.x - (blockIdx.x / a.H) * a.H;
  const int dk = a.dk, dv = a.dv, L = a.L;
  const int ldk = dk + 1, ldv = dv + 1, ldl = L + 1;
  float* Qs = sm;              // [L, dk+1]  q̃
  float* Ks = Qs + L * ldk;    // [L, dk+1]
  float* Vs = Ks + L * ldk;    // [L, dv+1]
  float* Os = Vs + L * ldv;    // [L, dv+1]  dO
  float* Gs = Os + L * ldv;    // [dk, dv+1] G: gradient of the state leaving the chunk
  float* Ms = Gs + dk * ldv;   // [L, L+1]   M[i][t], t ≥ i (two uses, see below)
  float* pw = Ms + L * ldl;    // [L+1]
  int* Ds = reinterpret_cast<int*>(pw + L + 1);  // [L] VARLEN: the chunk's doc values
  load_powers(pw, a.lam[h], L);
  load_state(Gs, ldv, ds_out.p ? ds_out.at(b, h) : nullptr, ds_out.sk, dk, dv);
  __syncthreads();
  const int nchunks = (a.T + L - 1) / L;
  for (int ch = nchunks - 1; ch >= 0; --ch) {
    const int n0 = ch * L;
    const int Le = min(L, a.T - n0);
    load_rows(Qs, ldk, q, b, n0, Le, h, dk, a.scale);
    load_rows(Ks, ldk, k, b, n0, Le, h, dk, 1.f);
    load_rows(Vs, ldv, v, b, n0, Le, h, dv, 1.f);
    load_rows(Os, ldv, d_o, b, n0, Le, h, dv, 1.f);
    if (VARLEN) load_doc(Ds, a, b, n0, Le);
    __syncthreads();
    // VARLEN: pairs of one document; the G term for rows from the chunk's last start on
    const int last = VARLEN ? Ds[Le - 1] : -1;
    if (dv_out.p) {
      // M[i][t] = λ^{t−i} q̃_t·k_i (t ≥ i)
      tile_mm(
          Le, Le, dk, [=](int i, int c) { return Ks[i * ldk + c]; }, [=](int c, int t) { return Qs[t * ldk + c]; },
          [=](int i, int t, float x) {
            Ms[i * ldl + t] = t >= i && (!VARLEN || Ds[t] == Ds[i]) ? pw[t - i] * x : 0.f;
          });
      __syncthreads();
      // dv_i = λ^{Le−1−i} Σ_c k_i[c] G[c,:] + Σ_t M[i][t] dO_t
      tile_mm2(
          Le, dv, dk, Le, [=](int i, int c) { return Ks[i * ldk + c]; }, [=](int c, int e) { return Gs[c * ldv + e]; },
          [=](int i, int t) { return Ms[i * ldl + t]; }, [=](int t, int e) { return Os[t * ldv + e]; },
          [=](int i, int e, float x, float y) {
            const float f = !VARLEN || n0 + i >= last ? pw[Le - 1 - i] : 0.f;
            stf(dv_out.p, dv_out.at(b, n0 + i, h) + e, dv_out.dt, f * x + y);
          });
      __syncthreads();
    }
    if (dk_out.p) {
      // M[i][t] = λ^{t−i} dO_t·v_i (t ≥ i)
      tile_mm(
          Le, Le, dv, [=](int i, int e) { return Vs[i * ldv + e]; }, [=](int e, int t) { return Os[t * ldv + e]; },
          [=](int i, int t, float x) {
            Ms[i * ldl + t] = t >= i && (!VARLEN || Ds[t] == Ds[i]) ? pw[t - i] * x : 0.f;
          });
      __syncthreads();
      // dk_i = λ^{Le−1−i} Σ_e G[:,e] v_i[e] + Σ_t M[i][t] q̃_t
      tile_mm2(
          Le, dk, dv, Le, [=](int i, int e) { return Vs[i * ldv + e]; }, [=](int e, int c) { return Gs[c * ldv + e]; },
          [=](int i, int t) { return Ms[i * ldl + t]; }, [=](int t, int c) { return Qs[t * ldk + c]; },
          [=](int i, int c, float x, float y) {
            const float f = !VARLEN || n0 + i >= last ? pw[Le - 1 - i] : 0.f;
            stf(dk_out.p, dk_out.at(b, n0 + i, h) + c, dk_out.dt, f * x + y);
          });
      __syncthreads();
    }
    // G ← λ^{Le} G + Σ_t λ^{t+1} q̃_tᵀ dO_t   (VARLEN: from zero when a document starts in the
    // chunk, with the rows whose document began before it)
    const float dec = VARLEN && last >= n0 ? 0.f : pw[Le];
    tile_mm(
        dk, dv, Le, [=](int c, int t) { return Qs[t * ldk + c] * (!VARLEN || Ds[t] < n0 ? pw[t + 1] : 0.f); },
        [=](int t, int e) { return Os[t * ldv + e]; },
        [=](int c, int e, float x) { Gs[c * ldv + e] = dec * Gs[c * ldv + e] + x; });
    __syncthreads();
  }
  if (ds_in.p) store_state(ds_in.at(b, h), ds_in.sk, Gs, ldv, dk, dv);
}

// ---- host side ----------------------------------------------------------------------------------

HView head_view(const Tensor& t, int64_t B, int64_t T, int64_t H, int64_t d, const char* what) {
  HView v;
  if (!t.defined()) return v;
  check_device(t, what);
  if (t.ndim != 4 || t.shape[0] != B || t.shape[1] != T || t.shape[2] != H || t.shape[3] != d ||
      (d > 1 && t.stride[3] != 1))
    check_failed(__FILE__, __LINE__, what,
                 ("expected [" + std::to_string(B) + ", " + std::to_string(T) + ", " + std::to_string(H) + ", " +
                  std::to_string(d) + "] with the last dim contiguous, got " + t.shape_str())
                     .c_str());
  v.p = t.data;
  v.dt = float_code(t, what);
  v.sb = t.stride[0];
  v.st = t.stride[1];
  v.sh = t.stride[2];
  return v;
}

SView state_view(const Tensor& t, int64_t min_entries, int64_t H, int64_t dk, int64_t dv, const char* what) {
  SView v;
  if (!t.defined()) return v;
  check_device(t, what);
  check_f32(t, what);
  if (t.ndim != 4 || t.shape[0] < min_entries || t.shape[1] != H || t.shape[2] != dk || t.shape[3] != dv ||
      (dv > 1 && t.stride[3] != 1))
    check_failed(__FILE__, __LINE__, what,
                 ("expected an F32 state [S>=" + std::to_string(min_entries) + ", " + std::to_string(H) + ", " +
                  std::to_string(dk) + ", " + std::to_string(dv) + "] with dv contiguous, got " +
                  t.shape_str())
                     .c_str());
  v.p = static_cast<float*>(t.data);
  v.ss = t.stride[0];
  v.sh = t.stride[1];
  v.sk = t.stride[2];
  return v;
}

GlaArgs gla_args(const GlaParams& p, const Tensor& q, const Tensor& v) {
  LAPLACE_CHECK(q.ndim == 4 && v.ndim == 4, "gla: q must be [B,T,H,dk] and v [B,T,H,dv]");
  GlaArgs a{};
  a.B = static_cast<int>(q.shape[0]);
  a.T = static_cast<int>(q.shape[1]);
  a.H = static_cast<int>(q.shape[2]);
  a.dk = static_cast<int>(q.shape[3]);
  a.dv = static_cast<int>(v.shape[3]);
  LAPLACE_CHECK(q.shape[0] < (1LL << 31) && q.shape[1] < (1LL << 31), "gla: B and T must fit in 32 bits");
  LAPLACE_CHECK(a.H >= 1 && a.H <= kGlaMaxHeads, "gla: H must be in [1, 128]");
  LAPLACE_CHECK(a.dk >= 1 && a.dk <= kGlaMaxDk, "gla: dk must be in [1, 128]");
  LAPLACE_CHECK(a.dv >= 1 && a.dv <= kGlaMaxDv, "gla: dv must be in [1, 256]");
  LAPLACE_CHECK(static_cast<int64_t>(p.decay.size()) == a.H, "gla: decay must hold one λ per head");
  LAPLACE_CHECK(static_cast<int64_t>(a.B) * a.H < (1LL << 31), "gla: B·H too large for the grid");
  a.scale = static_cast<float>(p.scale);
  for (int h = 0; h < a.H; ++h) a.lam[h] = p.decay[h];
  a.doc = nullptr;
  return a;
}

// The kernel's chunk: at most 64, at most p.chunk for the chunked form, at most T (decode
// needs one row), halved until the shared-memory tiles fit. Depends on the shapes only: with
// doc (varlen) it is the chunk without, unless the doc values do not fit beside its tiles
// (then halved again), so that a doc without starts keeps the bits of no doc.
int gla_chunk(const GlaParams& p, int kind, int T, int dk, int dv, int max_smem, bool varlen) {
  int L = kGlaMaxChunk;
  if (p.form == GlaForm::kChunked && p.chunk >= 1 && p.chunk < L) L = static_cast<int>(p.chunk);
  if (T >= 1 && T < L) L = T;
  while (L > 1 && gla_smem_floats(kind, L, dk, dv) * 4 > max_smem) L = (L + 1) / 2;
  while (L > 1 && gla_smem_floats(kind, L, dk, dv, varlen) * 4 > max_smem) L = (L + 1) / 2;
  LAPLACE_CHECK(gla_smem_floats(kind, L, dk, dv, varlen) * 4 <= max_smem,
                "gla: the state does not fit in shared memory");
  return L;
}


}  // namespace cuda

using namespace cuda;

void CudaBackend::gla_forward(const GlaParams& p, const Tensor& q, const Tensor& k, const Tensor& v, Tensor o,
                              const Tensor& s_in, Tensor s_out, const Tensor& slots) {
  // One token per sequence: the streaming decode kernel (F32 or BF16 states). Decode steps
  // take no doc (ops/backend.h); a one-token call with doc runs the generic kernel below.
  if (q.ndim == 4 && q.shape[1] == 1 && !p.doc.defined() &&
      gla_decode_forward(*this, p, q, k, v, o, s_in, s_out, slots, nullptr, nullptr, 0, nullptr))
    return;
  GlaArgs a = gla_args(p, q, v);
  a.doc = doc_starts_arg(p.doc, a.B, a.T, "gla_forward: doc");
  HView vq = head_view(q, a.B, a.T, a.H, a.dk, "gla_forward: q");
  HView vk = head_view(k, a.B, a.T, a.H, a.dk, "gla_forward: k");
  HView vv = head_view(v, a.B, a.T, a.H, a.dv, "gla_forward: v");
  HView vo = head_view(o, a.B, a.T, a.H, a.dv, "gla_forward: o");
  LAPLACE_CHECK(o.defined(), "gla_forward: o is required");
  const int32_t* ps = nullptr;
  if (slots.defined()) {
    check_device(slots, "gla_forward: slots");
    LAPLACE_CHECK(slots.dtype == DType::kI32 && slots.numel() == a.B && slots.is_contiguous(),
                  "gla_forward: slots must be I32 [B]");
    ps = static_cast<const int32_t*>(slots.data);
  }
  const int64_t min_entries = ps ? 1 : a.B;
  SView si = state_view(s_in, min_entries, a.H, a.dk, a.dv, "gla_forward: s_in");
  SView so = state_view(s_out, min_entries, a.H, a.dk, a.dv, "gla_forward: s_out");
  if (a.B == 0) return;
  if (gla_tc_forward(*this, p, q, k, v, o, s_in, s_out, slots)) return;  // tensor-core path
  const bool varlen = a.doc != nullptr;
  a.L = gla_chunk(p, kGlaFwd, a.T, a.dk, a.dv, max_smem_optin(), varlen);
  const size_t bytes = gla_smem_floats(kGlaFwd, a.L, a.dk, a.dv, varlen) * sizeof(float);
  const auto kern = varlen ? gla_fwd_kernel<true> : gla_fwd_kernel<false>;
  kernel_smem(kern, bytes);
  kern<<<static_cast<unsigned>(a.B * a.H), kGlaThreads, bytes, stream_>>>(a, vq, vk, vv, vo, si, so, ps);
  CUDA_CHECK_LAUNCH();
}

void CudaBackend::gla_backward(const GlaParams& p, const Tensor& q, const Tensor& k, const Tensor& v,
                               const Tensor& s_in, const Tensor& d_o, const Tensor& ds_out, Tensor dq, Tensor dk,
                               Tensor dv, Tensor ds_in) {
  GlaArgs a = gla_args(p, q, v);
  HView vq = head_view(q, a.B, a.T, a.H, a.dk, "gla_backward: q");
  HView vk = head_view(k, a.B, a.T, a.H, a.dk, "gla_backward: k");
  HView vv = head_view(v, a.B, a.T, a.H, a.dv, "gla_backward: v");
  HView vdo = head_view(d_o, a.B, a.T, a.H, a.dv, "gla_backward: d_o");
  HView vdq = head_view(dq, a.B, a.T, a.H, a.dk, "gla_backward: dq");
  HView vdk = head_view(dk, a.B, a.T, a.H, a.dk, "gla_backward: dk");
  HView vdv = head_view(dv, a.B, a.T, a.H, a.dv, "gla_backward: dv");
  LAPLACE_CHECK(d_o.defined(), "gla_backward: d_o is required");
  SView si = state_view(s_in, a.B, a.H, a.dk, a.dv, "gla_backward: s_in");
  SView sgo = state_view(ds_out, a.B, a.H, a.dk, a.dv, "gla_backward: ds_out");
  SView sgi = state_view(ds_in, a.B, a.H, a.dk, a.dv, "gla_backward: ds_in");
  a.doc = doc_starts_arg(p.doc, a.B, a.T, "gla_backward: doc");
  if (a.B == 0) return;
  if (gla_tc_backward(*this, p, q, k, v, s_in, d_o, ds_out, dq, dk, dv, ds_in)) return;  // tensor-core path
  const unsigned grid = static_cast<unsigned>(a.B * a.H);
  const bool varlen = a.doc != nullptr;
  if (vdq.p) {
    GlaArgs a1 = a;
    a1.L = gla_chunk(p, kGlaBwdDq, a.T, a.dk, a.dv, max_smem_optin(), varlen);
    const size_t bytes = gla_smem_floats(kGlaBwdDq, a1.L, a.dk, a.dv, varlen) * sizeof(float);
    const auto kern = varlen ? gla_bwd_dq_kernel<true> : gla_bwd_dq_kernel<false>;
    kernel_smem(kern, bytes);
    kern<<<grid, kGlaThreads, bytes, stream_>>>(a1, vk, vv, vdo, vdq, si);
    CUDA_CHECK_LAUNCH();
  }
  if (vdk.p || vdv.p || sgi.p) {
    GlaArgs a2 = a;
    a2.L = gla_chunk(p, kGlaBwdDkv, a.T, a.dk, a.dv, max_smem_optin(), varlen);
    const size_t bytes = gla_smem_floats(kGlaBwdDkv, a2.L, a.dk, a.dv, varlen) * sizeof(float);
    const auto kern = varlen ? gla_bwd_dkv_kernel<true> : gla_bwd_dkv_kernel<false>;
    kernel_smem(kern, bytes);
    kern<<<grid, kGlaThreads, bytes, stream_>>>(a2, vq, vk, vv, vdo, vdk, vdv, sgo, sgi);
    CUDA_CHECK_LAUNCH();
  }
}

}  // namespace laplace
