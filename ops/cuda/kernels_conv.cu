// Causal depthwise conv + SiLU, CUDA: forward (prefill, decode step and the state window),
// backward (du, and dw through the column reductions of row_common.cuh). Fast paths move 8
// channels per thread with 16-byte accesses; the generic kernels serve the rest (see each
// launcher for the conditions).
//
// Documents kept apart (doc [B, T], ops/backend.h): token t reads no input before doc[t] (a
// document start at or before t: those inputs count as zeros, the window included), and the
// window output holds zeros before the last token's document. The generic kernels compare each
// input's position with its token's doc; the prefill and backward fast paths (VARLEN instances)
// keep their sliding registers and zero them at starts (forward) or mask each term by the doc
// values slid beside them (backward). Without doc the fast paths are the instances they were.
#include "ops/cuda/row_common.cuh"

namespace laplace {

using namespace cuda;

// ---- causal conv + SiLU -----------------------------------------------------------------------

namespace cuda {

constexpr int kMaxConvK = kMaxColOut;

// Conv window of one layer in a state pool: win[s, j, d] at p + s·s0 + j·s1 + d (F32, or
// BF16 in a BF16 state pool: the window holds conv inputs, so a BF16 model's are exact).
struct WView {
  void* p = nullptr;
  int dt = kF32;
  int64_t s0 = 0, s1 = 0;
};

struct ConvArgs {
  RView u;           // [B·T, D]
  RView w;           // [D, K]
  int64_t B, T, D;
  int K;
  WView win;         // input window (p null: zeros)
  const int32_t* slots;
  const int32_t* doc;  // [B, T] document starts, or null
};

// u_s of sequence b at channel d for s ∈ [−K, T): the window supplies s < 0 (win[K+s]).
__device__ __forceinline__ float conv_input(const ConvArgs& a, int64_t b, int64_t r_of_t0, int64_t s, int64_t d) {
  if (s >= 0) return ldf(a.u.p, a.u.row(r_of_t0 + s) + d, a.u.dt);
  if (!a.win.p) return 0.f;
  const int64_t slot = a.slots ? a.slots[b] : b;
  return ldf(a.win.p, slot * a.win.s0 + (a.K + s) * a.win.s1 + d, a.win.dt);
}

// The first input position token t of row b reads: its document's start when that lies in the
// row, else −K (the window's oldest entry: every input).
__device__ __forceinline__ int64_t conv_lo(const ConvArgs& a, int64_t b, int64_t t) {
  if (!a.doc) return -a.K;
  const int32_t s = a.doc[b * a.T + t];
  return s >= 0 ? s : -a.K;
}

// pre_t = Σ_j w[d,j]·u_{t−K+1+j}   (inputs before conv_lo count as zeros)
__device__ __forceinline__ float conv_pre(const ConvArgs& a, int64_t r, int64_t d) {
  const int64_t b = r / a.T, t = r - b * a.T, r0 = b * a.T;
  const int64_t ow = a.w.row(d), lo = conv_lo(a, b, t);
  float acc = 0.f;
  for (int j = 0; j < a.K; ++j) {
    const int64_t s = t - a.K + 1 + j;
    acc += ldf(a.w.p, ow + j, a.w.dt) * (s >= lo ? conv_input(a, b, r0, s, d) : 0.f);
  }
  return acc;
}

// c = SiLU(pre); one thread per (b, t, d). c, pre [B,T,D] (pre optional)
__global__ void conv_fwd_kernel(ConvArgs a, RView c, RView pre) {
  const int64_t n = a.B * a.T * a.D;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t r = i / a.D, d = i - r * a.D;
    const float p = conv_pre(a, r, d);
    stf(c.p, c.row(r) + d, c.dt, p * sigmoidf_(p));
    if (pre.p) stf(pre.p, pre.row(r) + d, pre.dt, p);
  }
}

// win_out[slot(b), j, d] = u_{T−K+j} (from win_in when T−K+j < 0; zero before the last token's
// document). One thread per (b, d); all K values are read before any is written, so win_out
// may alias win_in.
__global__ void conv_window_kernel(ConvArgs a, WView wout) {
  const int64_t n = a.B * a.D;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t b = i / a.D, d = i - b * a.D;
    const int64_t lo = a.T > 0 ? conv_lo(a, b, a.T - 1) : -a.K;
    float vals[kMaxConvK];
#pragma unroll
    for (int j = 0; j < kMaxConvK; ++j)
      vals[j] = j < a.K && a.T - a.K + j >= lo ? conv_input(a, b, b * a.T, a.T - a.K + j, d) : 0.f;
    const int64_t slot = a.slots ? a.slots[b] : b;
#pragma unroll
    for (int j = 0; j < kMaxConvK; ++j)
      if (j < a.K) stf(wout.p, slot * wout.s0 + j * wout.s1 + d, wout.dt, vals[j]);
  }
}

// dpre_t = dc_t · SiLU'(pre_t)
__device__ __forceinline__ float conv_dpre(const ConvArgs& a, const RView& dc, const RView& pre, int64_t r, int64_t d) {
  const float p = pre.p ? ldf(pre.p, pre.row(r) + d, pre.dt) : conv_pre(a, r, d);
  const float s = sigmoidf_(p);
  return ldf(dc.p, dc.row(r) + d, dc.dt) * s * (1.0f + p * (1.0f - s));
}

// du_t = Σ_j w[d,j] · dpre_{t+K−1−j}  (terms with t+K−1−j ≥ T vanish, and those of tokens
// that do not read u_t: t before their conv_lo). du [B,T,D]
__global__ void conv_bwd_du_kernel(ConvArgs a, RView dc, RView pre, RView du) {
  const int64_t n = a.B * a.T * a.D;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t r = i / a.D, d = i - r * a.D;
    const int64_t b = r / a.T, t = r - b * a.T;
    const int64_t ow = a.w.row(d);
    float acc = 0.f;
    for (int j = 0; j < a.K; ++j) {
      const int64_t s = t + a.K - 1 - j;
      if (s < a.T && t >= conv_lo(a, b, s))
        acc += ldf(a.w.p, ow + j, a.w.dt) * conv_dpre(a, dc, pre, r + (a.K - 1 - j), d);
    }
    stf(du.p, du.row(r) + d, du.dt, acc);
  }
}

// Column terms: dw[d, j] += dpre_t[d] · u_{t−K+1+j}[d]  (zero initial window; inputs before
// conv_lo count as zeros).
struct ConvDwTerms {
  ConvArgs a;
  RView dc, pre;
  __device__ void operator()(int64_t r, int64_t d, float* t) const {
    const float dp = conv_dpre(a, dc, pre, r, d);
    const int64_t b = r / a.T, tt = r - b * a.T, r0 = b * a.T, lo = conv_lo(a, b, tt);
#pragma unroll
    for (int j = 0; j < kMaxConvK; ++j) {
      const int64_t s = tt - a.K + 1 + j;
      t[j] = j < a.K ? dp * (s >= lo ? conv_input(a, b, r0, s, d) : 0.f) : 0.f;
    }
  }
};

ConvArgs conv_args(const Tensor& u, const Tensor& w, const char* what) {
  check_device(u, what);
  LAPLACE_CHECK(u.ndim == 3, "conv_silu: u must be [B,T,D]");
  ConvArgs a{};
  a.u = make_rview(u, "conv_silu: u");
  a.w = make_rview(w, "conv_silu: w");
  a.B = u.shape[0];
  a.T = u.shape[1];
  a.D = u.shape[2];
  LAPLACE_CHECK(w.ndim == 2 && w.shape[0] == a.D, "conv_silu: w must be [D,K]");
  a.K = static_cast<int>(w.shape[1]);
  LAPLACE_CHECK(a.K >= 1 && a.K <= kMaxConvK, "conv_silu: K must be in [1, 8]");
  a.slots = nullptr;
  a.doc = nullptr;
  return a;
}

WView window_view(const Tensor& t, int64_t K, int64_t D, const char* what) {
  WView v;
  if (!t.defined()) return v;
  check_device(t, what);
  const int dt = float_code(t, "conv_silu: windows must be F32 or BF16");
  if (t.ndim != 3 || t.shape[1] != K || t.shape[2] != D || t.stride[2] != 1)
    check_failed(__FILE__, __LINE__, what, ("window must be [S,K,D] with D contiguous, got " + t.shape_str()).c_str());
  v.p = t.data;
  v.dt = dt;
  v.s0 = t.stride[0];
  v.s1 = t.stride[1];
  return v;
}

// ---- conv fast paths: 8 channels per thread, 16-byte accesses ----
// They run when D % 8 == 0 and u, c, pre and the windows have 16-byte aligned rows
// (conv_forward_vec); the arithmetic is conv_pre's (Σ_j in order j = 0..K−1, F32), so c and pre
// have the generic kernels' bits.

constexpr int kConvThreads = 128;
constexpr int kConvTile = 16;  // prefill: timesteps per thread (the K−1 before the tile are re-read)
constexpr int kConvStep = 4;   // prefill: timesteps loaded together, for memory-level parallelism

// [B,T,D] with D contiguous: element (b, t, d) at p + b·sb + t·st + d.
struct BtdView {
  void* p = nullptr;
  int dt = kF32;
  int64_t sb = 0, st = 0;
};

struct ConvVecArgs {
  BtdView u, c, pre;   // pre.p null: not written
  RView w;             // [D, K]
  WView win, wout;     // p null: zero input window / no window output
  const int32_t* slots;
  int B, T, nq, ntile;  // nq = D/8 chunks of channels; ntile = ⌈T / kConvTile⌉
  int wvec;             // w is [D,K] contiguous and 16-byte aligned
  const int32_t* doc;   // [B, T] document starts (VARLEN prefill, the window), or null
};

BtdView btd_view(const Tensor& t) {
  BtdView v;
  if (!t.defined()) return v;
  v.p = t.data;
  v.dt = t.dtype == DType::kBF16 ? kBF16 : kF32;
  v.sb = t.stride[0];
  v.st = t.stride[1];
  return v;
}

// Rows (b, t) of a [B,T,D] tensor start 16-byte aligned at multiples of 8 elements.
bool vec_btd(const Tensor& t) {
  return aligned16(t.data) && (t.shape[0] <= 1 || t.stride[0] % 8 == 0) && (t.shape[1] <= 1 || t.stride[1] % 8 == 0);
}
bool vec_window(const Tensor& t) {
  return aligned16(t.data) && (t.shape[0] <= 1 || t.stride[0] % 8 == 0) && (t.shape[1] <= 1 || t.stride[1] % 8 == 0);
}

// w [D, K] contiguous and 16-byte aligned: load_conv_w's 16-byte loads apply.
bool conv_w_vec(const ConvArgs& g) { return aligned16(g.w.p) && g.w.s0 == g.K && g.w.d1 == 1 && g.w.d2 == 1; }

// wf[ch][j] = w[d0 + ch, j]: K 16-byte loads when w is contiguous (its 8 rows are then 8K
// consecutive elements starting at a multiple of 8), element by element otherwise.
template <int K, int DT = kDtAny>
__device__ __forceinline__ void load_conv_w(const RView& w, int wvec, int d0, float (&wf)[8][K]) {
  if (vec_as<DT>(wvec)) {
#pragma unroll
    for (int q = 0; q < K; ++q) {
      float t[8];
      ld8(w.p, static_cast<int64_t>(d0) * K + 8 * q, dt_as<DT>(w.dt), true, t);
#pragma unroll
      for (int k = 0; k < 8; ++k) wf[(8 * q + k) / K][(8 * q + k) % K] = t[k];
    }
  } else {
#pragma unroll
    for (int ch = 0; ch < 8; ++ch) {
      const int64_t ow = w.row(d0 + ch);
#pragma unroll
      for (int j = 0; j < K; ++j) wf[ch][j] = ldf(w.p, ow + j, dt_as<DT>(w.dt));
    }
  }
}

// pre = Σ_j w[·, j]·in[j] per channel (conv_pre's order), c = SiLU(pre); stores c and pre.
template <int K, int DT = kDtAny>
__device__ __forceinline__ void conv_out8(const ConvVecArgs& a, const float (&wf)[8][K], const float (*in)[8],
                                          int64_t oc, int64_t op) {
  float cv[8], pv[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    float acc = 0.f;
#pragma unroll
    for (int j = 0; j < K; ++j) acc += wf[k][j] * in[j][k];
    pv[k] = acc;
    cv[k] = acc * sigmoidf_(acc);
  }
  st8(a.c.p, oc, dt_as<DT>(a.c.dt), true, cv);
  if (a.pre.p) st8(a.pre.p, op, dt_as<DT>(a.pre.dt), true, pv);
}

// Decode (T = 1): one thread per (b, 8 channels) reads the window entries 1..K−1 of its slot
// (entry 0 drops out) and u_0 once, writes c (and pre) and the shifted window
// win_out[j] = u_{1−K+j} in the same pass. All its reads precede its writes and no other
// thread touches this (slot, channels), so win_out may alias win_in. DT fixes the dtype of u,
// c, pre and w and WDT that of both windows (dt_as): with both fixed a thread's K loads are
// all in flight at once (the decode step's case: BF16 activations, F32 or BF16 windows).
template <int K, int DT = kDtAny, int WDT = kDtAny>
__global__ void __launch_bounds__(kConvThreads) conv_decode_vec_kernel(ConvVecArgs a) {
  const int i = blockIdx.x * kConvThreads + threadIdx.x;
  if (i >= a.B * a.nq) return;
  const int b = i / a.nq, d0 = 8 * (i - b * a.nq);
  float wf[8][K];
  load_conv_w<K, DT>(a.w, a.wvec, d0, wf);
  const int64_t slot = a.slots ? a.slots[b] : b;
  float e[K][8];  // e[j] = u_{j−K+1}: window entries 1..K−1, then u_0
#pragma unroll
  for (int j = 0; j + 1 < K; ++j) {
    if (a.win.p) {
      ld8(a.win.p, slot * a.win.s0 + (j + 1) * a.win.s1 + d0, dt_as<WDT>(a.win.dt), true, e[j]);
    } else {
#pragma unroll
      for (int k = 0; k < 8; ++k) e[j][k] = 0.f;
    }
  }
  ld8(a.u.p, b * a.u.sb + d0, dt_as<DT>(a.u.dt), true, e[K - 1]);
  conv_out8<K, DT>(a, wf, e, b * a.c.sb + d0, b * a.pre.sb + d0);
  if (a.wout.p) {
#pragma unroll
    for (int j = 0; j < K; ++j)
      st8(a.wout.p, slot * a.wout.s0 + j * a.wout.s1 + d0, dt_as<WDT>(a.wout.dt), true, e[j]);
  }
}

// Prefill (T > 1): one thread per (b, 8 channels, tile of kConvTile timesteps) keeps the last
// K−1 inputs in registers, so each u is read about once (the K−1 before a tile twice, mostly
// from L2); inputs before t = 0 come from win_in (zeros without one), as conv_input. The
// window output is conv_window_vec_kernel's, launched after this kernel because win_out may
// alias win_in, which the first tile reads. At most 128 registers (4 blocks per SM) for K ≤ 4:
// left alone, the compiler interleaves the steps' SiLUs and takes ~170 at K = 4.
// VARLEN (a.doc): the inputs before doc[t0] are zeros in the prologue (the window unread), and
// a document start at t zeroes the registers holding the inputs before t, so that t and the
// rest of its document read none of them.
template <int K, int DT, bool VARLEN = false>
__global__ void __launch_bounds__(kConvThreads, K <= 4 ? 4 : 2) conv_prefill_vec_kernel(ConvVecArgs a) {
  const int i = blockIdx.x * kConvThreads + threadIdx.x;
  if (i >= a.B * a.ntile * a.nq) return;
  const int rest = i / a.nq, qd = i - rest * a.nq;
  const int b = rest / a.ntile, tile = rest - b * a.ntile;
  const int d0 = 8 * qd, t0 = tile * kConvTile, t1 = min(a.T, t0 + kConvTile);
  const int32_t* doc = VARLEN ? a.doc + static_cast<int64_t>(b) * a.T : nullptr;
  const int lo = VARLEN ? doc[t0] : -1;  // t0's document start (−1: before the row)
  float wf[8][K];
  load_conv_w<K, DT>(a.w, a.wvec, d0, wf);
  // e[j] = u_{t−K+1+j} for the step at t: e[0..K−2] the K−1 inputs before t, then the step's.
  float e[K - 1 + kConvStep][8];
#pragma unroll
  for (int j = 0; j + 1 < K; ++j) {
    const int s = t0 - (K - 1) + j;
    if (VARLEN && lo >= 0 && s < lo) {
#pragma unroll
      for (int k = 0; k < 8; ++k) e[j][k] = 0.f;
    } else if (s >= 0) {
      ld8(a.u.p, b * a.u.sb + s * a.u.st + d0, dt_as<DT>(a.u.dt), true, e[j]);
    } else if (a.win.p) {
      const int64_t slot = a.slots ? a.slots[b] : b;
      ld8(a.win.p, slot * a.win.s0 + (K + s) * a.win.s1 + d0, a.win.dt, true, e[j]);  // any dtype (F32 states)
    } else {
#pragma unroll
      for (int k = 0; k < 8; ++k) e[j][k] = 0.f;
    }
  }
  int64_t ou = b * a.u.sb + t0 * a.u.st + d0, oc = b * a.c.sb + t0 * a.c.st + d0,
          op = b * a.pre.sb + t0 * a.pre.st + d0;
  // VARLEN: before step s, a start at t + s zeroes e[0 … K−2+s], the inputs before it
  auto reset = [&](int s, bool start) {
    if (start) {
#pragma unroll
      for (int j = 0; j < K - 1 + s; ++j)
#pragma unroll
        for (int k = 0; k < 8; ++k) e[j][k] = 0.f;
    }
  };
  for (int t = t0; t < t1; t += kConvStep) {
    bool start[kConvStep] = {};
    if (t + kConvStep <= t1) {  // a whole step: the loads unconditional, so all are in flight at once
#pragma unroll
      for (int s = 0; s < kConvStep; ++s) ld8(a.u.p, ou + s * a.u.st, dt_as<DT>(a.u.dt), true, e[K - 1 + s]);
      if (VARLEN) {
#pragma unroll
        for (int s = 0; s < kConvStep; ++s) start[s] = doc[t + s] == t + s;
      }
#pragma unroll
      for (int s = 0; s < kConvStep; ++s) {
        if (VARLEN) reset(s, start[s]);
        conv_out8<K, DT>(a, wf, e + s, oc + s * a.c.st, op + s * a.pre.st);
      }
    } else {
#pragma unroll
      for (int s = 0; s < kConvStep; ++s)
        if (t + s < t1) ld8(a.u.p, ou + s * a.u.st, dt_as<DT>(a.u.dt), true, e[K - 1 + s]);
      if (VARLEN) {
#pragma unroll
        for (int s = 0; s < kConvStep; ++s) start[s] = t + s < t1 && doc[t + s] == t + s;
      }
#pragma unroll
      for (int s = 0; s < kConvStep; ++s) {
        if (VARLEN) reset(s, start[s]);
        if (t + s < t1) conv_out8<K, DT>(a, wf, e + s, oc + s * a.c.st, op + s * a.pre.st);
      }
    }
#pragma unroll
    for (int j = 0; j + 1 < K; ++j)
#pragma unroll
      for (int k = 0; k < 8; ++k) e[j][k] = e[j + kConvStep][k];
    ou += kConvStep * a.u.st;
    oc += kConvStep * a.c.st;
    op += kConvStep * a.pre.st;
  }
}

// win_out[slot(b), j] = u_{T−K+j} (from win_in when T−K+j < 0; with doc, zeros before the last
// token's document start): conv_window_kernel with 8 channels per thread; all K entries are
// read before any is written (win_out may alias win_in).
template <int K>
__global__ void __launch_bounds__(kConvThreads) conv_window_vec_kernel(ConvVecArgs a) {
  const int i = blockIdx.x * kConvThreads + threadIdx.x;
  if (i >= a.B * a.nq) return;
  const int b = i / a.nq, d0 = 8 * (i - b * a.nq);
  const int64_t slot = a.slots ? a.slots[b] : b;
  const int lo = a.doc ? a.doc[static_cast<int64_t>(b) * a.T + a.T - 1] : -1;
  float e[K][8];
#pragma unroll
  for (int j = 0; j < K; ++j) {
    const int s = a.T - K + j;
    if (lo >= 0 && s < lo) {
#pragma unroll
      for (int k = 0; k < 8; ++k) e[j][k] = 0.f;
    } else if (s >= 0) {
      ld8(a.u.p, b * a.u.sb + s * a.u.st + d0, a.u.dt, true, e[j]);
    } else if (a.win.p) {
      ld8(a.win.p, slot * a.win.s0 + (K + s) * a.win.s1 + d0, a.win.dt, true, e[j]);
    } else {
#pragma unroll
      for (int k = 0; k < 8; ++k) e[j][k] = 0.f;
    }
  }
#pragma unroll
  for (int j = 0; j < K; ++j) st8(a.wout.p, slot * a.wout.s0 + j * a.wout.s1 + d0, a.wout.dt, true, e[j]);
}

template <int K>
void conv_vec_launch(const ConvVecArgs& a, cudaStream_t st) {
  const auto blocks = [](int64_t n) { return static_cast<unsigned>((n + kConvThreads - 1) / kConvThreads); };
  if (a.T == 1) {
    const unsigned grid = blocks(static_cast<int64_t>(a.B) * a.nq);
    const bool bf16 = a.u.dt == kBF16 && a.c.dt == kBF16 && (!a.pre.p || a.pre.dt == kBF16) && a.w.dt == kBF16 && a.wvec;
    const auto win_is = [&a](int dt) { return (!a.win.p || a.win.dt == dt) && (!a.wout.p || a.wout.dt == dt); };
    if (bf16 && win_is(kF32))
      conv_decode_vec_kernel<K, kBF16, kF32><<<grid, kConvThreads, 0, st>>>(a);
    else if (bf16 && win_is(kBF16))
      conv_decode_vec_kernel<K, kBF16, kBF16><<<grid, kConvThreads, 0, st>>>(a);
    else
      conv_decode_vec_kernel<K><<<grid, kConvThreads, 0, st>>>(a);
    CUDA_CHECK_LAUNCH();
    return;
  }
  const unsigned grid = blocks(static_cast<int64_t>(a.B) * a.ntile * a.nq);
  // DT fixes the dtype of u, c, pre and w; the window (only the first tile's prologue reads it)
  // keeps its run-time dtype, so prefills into F32 state slots take the BF16 instance too.
  const bool bf16 = a.u.dt == kBF16 && a.c.dt == kBF16 && (!a.pre.p || a.pre.dt == kBF16) && a.w.dt == kBF16 && a.wvec;
  if (a.doc) {
    if (bf16) conv_prefill_vec_kernel<K, kBF16, true><<<grid, kConvThreads, 0, st>>>(a);
    else conv_prefill_vec_kernel<K, kDtAny, true><<<grid, kConvThreads, 0, st>>>(a);
  } else if (bf16) {
    conv_prefill_vec_kernel<K, kBF16><<<grid, kConvThreads, 0, st>>>(a);
  } else {
    conv_prefill_vec_kernel<K, kDtAny><<<grid, kConvThreads, 0, st>>>(a);
  }
  CUDA_CHECK_LAUNCH();
  if (a.wout.p) {
    conv_window_vec_kernel<K><<<blocks(static_cast<int64_t>(a.B) * a.nq), kConvThreads, 0, st>>>(a);
    CUDA_CHECK_LAUNCH();
  }
}

// The fast path of conv_silu_forward when the arguments allow it (see above); false, having
// queued nothing, otherwise. B, T ≥ 1 here. A one-token call with doc takes the generic kernels
// (the decode kernel has no doc).
bool conv_forward_vec(const ConvArgs& g, const WView& wout, const Tensor& u, const Tensor& c, const Tensor& pre,
                      const Tensor& win_in, const Tensor& win_out, cudaStream_t st) {
  if (g.D % 8 != 0 || g.B < 1 || g.T < 1 || (g.doc && g.T == 1)) return false;
  const int64_t nq = g.D / 8, ntile = (g.T + kConvTile - 1) / kConvTile;
  if (g.B * ntile * nq > 0x7fffffff || g.T > 0x7fffffff) return false;  // 32-bit thread and time indices
  if (!vec_btd(u) || !vec_btd(c) || (pre.defined() && !vec_btd(pre))) return false;
  if ((win_in.defined() && !vec_window(win_in)) || (win_out.defined() && !vec_window(win_out))) return false;
  ConvVecArgs a;
  a.u = btd_view(u);
  a.c = btd_view(c);
  a.pre = btd_view(pre);
  a.w = g.w;
  a.win = g.win;
  a.wout = wout;
  a.slots = g.slots;
  a.doc = g.doc;
  a.B = static_cast<int>(g.B);
  a.T = static_cast<int>(g.T);
  a.nq = static_cast<int>(nq);
  a.ntile = static_cast<int>(ntile);
  a.wvec = conv_w_vec(g);
  switch (g.K) {
    case 1: conv_vec_launch<1>(a, st); break;
    case 2: conv_vec_launch<2>(a, st); break;
    case 3: conv_vec_launch<3>(a, st); break;
    case 4: conv_vec_launch<4>(a, st); break;
    case 5: conv_vec_launch<5>(a, st); break;
    case 6: conv_vec_launch<6>(a, st); break;
    case 7: conv_vec_launch<7>(a, st); break;
    default: conv_vec_launch<8>(a, st); break;
  }
  return true;
}

// ---- conv backward fast path ----
// One thread per (b, 8 channels, segment of kConvBwdSeg timesteps) walks its timesteps in
// order, keeping dpre_{t..t+K−1} and u_{t−K+1..t} in registers, so dc, pre and u are each
// read about once (the K−1 beyond a segment twice, mostly from L2) and du is written once:
//   du_t = Σ_j w[·, j]·dpre_{t+K−1−j}   (conv_bwd_du_kernel's terms and order: bits agree),
//   dw[·, j] += dpre_t·u_{t−K+1+j}     (zero initial window),
// with dpre = dc·SiLU'(pre) from the kept pre. The thread's dw sums over its segment go to
// partial[j, b·nseg + seg, d] (F32), which colsum_finalize adds to dw in a fixed segment order:
// the grouping depends only on B, T and D, so dw is bitwise reproducible (its bits differ
// from the generic colreduce's, whose segments are 128 rows of the flattened [B·T, D]).
constexpr int kConvBwdSeg = 64;  // timesteps per thread: B·T/64 partial rows of D·K floats
inline int64_t conv_bwd_nseg(int64_t T) { return (T + kConvBwdSeg - 1) / kConvBwdSeg; }

struct ConvBwdVecArgs {
  BtdView dc, u, pre, du;  // du.p null: dw only
  RView w;                 // [D, K]
  float* partial;          // [K, B·nseg, D]; null: du only
  int B, T, nq, nseg, wvec;
  int64_t D;
  const int32_t* doc;      // [B, T] document starts (VARLEN instances), or null
};

template <int DT>
__device__ __forceinline__ void conv_dpre8(const ConvBwdVecArgs& a, int b, int s, int d0, float (&dp)[8]) {
  if (s >= a.T) {
#pragma unroll
    for (int k = 0; k < 8; ++k) dp[k] = 0.f;
    return;
  }
  float dc[8], p[8];
  ld8(a.dc.p, b * a.dc.sb + s * a.dc.st + d0, dt_as<DT>(a.dc.dt), true, dc);
  ld8(a.pre.p, b * a.pre.sb + s * a.pre.st + d0, dt_as<DT>(a.pre.dt), true, p);
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const float sg = sigmoidf_(p[k]);
    dp[k] = dc[k] * sg * (1.0f + p[k] * (1.0f - sg));  // conv_dpre's expression
  }
}

// VARLEN (a.doc): dd[i] = doc[t+i] slides beside dp; token t+i reads u_t only when its
// document began at or before t (dd[i] ≤ t), and u_{t−K+1+j} counts for t's dw term only from
// t's document start on (position ≥ dd[0]; −1: the zero window anyway).
template <int K, int DT, bool VARLEN = false>
__global__ void __launch_bounds__(kConvThreads) conv_bwd_vec_kernel(ConvBwdVecArgs a) {
  const int i = blockIdx.x * kConvThreads + threadIdx.x;
  if (i >= a.B * a.nseg * a.nq) return;
  const int rest = i / a.nq, qd = i - rest * a.nq;
  const int b = rest / a.nseg, seg = rest - b * a.nseg;
  const int d0 = 8 * qd, t0 = seg * kConvBwdSeg, t1 = min(a.T, t0 + kConvBwdSeg);
  const int32_t* doc = VARLEN ? a.doc + static_cast<int64_t>(b) * a.T : nullptr;
  float wf[8][K];
  load_conv_w<K, DT>(a.w, a.wvec, d0, wf);
  float dp[K][8];  // dp[i] = dpre_{t+i} at the step for t (zero beyond T)
  float ue[K][8];  // ue[j] = u_{t−K+1+j} (zero before 0)
  int dd[K];       // VARLEN: dd[i] = doc[t+i] (0 beyond T, where dp is zero)
#pragma unroll
  for (int j = 1; j < K; ++j) {
    conv_dpre8<DT>(a, b, t0 + j - 1, d0, dp[j]);
    if (VARLEN) dd[j] = t0 + j - 1 < a.T ? doc[t0 + j - 1] : 0;
    const int s = t0 - K + j;
    if (s >= 0) {
      ld8(a.u.p, b * a.u.sb + s * a.u.st + d0, dt_as<DT>(a.u.dt), true, ue[j]);
    } else {
#pragma unroll
      for (int k = 0; k < 8; ++k) ue[j][k] = 0.f;
    }
  }
  float acc[K][8];
#pragma unroll
  for (int j = 0; j < K; ++j)
#pragma unroll
    for (int k = 0; k < 8; ++k) acc[j][k] = 0.f;
  for (int t = t0; t < t1; ++t) {
#pragma unroll
    for (int j = 0; j + 1 < K; ++j) {
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        dp[j][k] = dp[j + 1][k];
        ue[j][k] = ue[j + 1][k];
      }
      if (VARLEN) dd[j] = dd[j + 1];
    }
    conv_dpre8<DT>(a, b, t + K - 1, d0, dp[K - 1]);
    if (VARLEN) dd[K - 1] = t + K - 1 < a.T ? doc[t + K - 1] : 0;
    ld8(a.u.p, b * a.u.sb + t * a.u.st + d0, dt_as<DT>(a.u.dt), true, ue[K - 1]);
    if (a.du.p) {
      float duv[8];
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        float s = 0.f;
#pragma unroll
        for (int j = 0; j < K; ++j)
          if (t + K - 1 - j < a.T && (!VARLEN || dd[K - 1 - j] <= t)) s += wf[k][j] * dp[K - 1 - j][k];
        duv[k] = s;
      }
      st8(a.du.p, b * a.du.sb + t * a.du.st + d0, dt_as<DT>(a.du.dt), true, duv);
    }
#pragma unroll
    for (int j = 0; j < K; ++j) {
      const bool in = !VARLEN || t - K + 1 + j >= dd[0];
#pragma unroll
      for (int k = 0; k < 8; ++k) acc[j][k] += dp[0][k] * (in ? ue[j][k] : 0.f);
    }
  }
  if (!a.partial) return;
  const int64_t nrow = static_cast<int64_t>(a.B) * a.nseg, prow = static_cast<int64_t>(b) * a.nseg + seg;
#pragma unroll
  for (int j = 0; j < K; ++j) {
    float* out = a.partial + (j * nrow + prow) * a.D + d0;
    reinterpret_cast<float4*>(out)[0] = make_float4(acc[j][0], acc[j][1], acc[j][2], acc[j][3]);
    reinterpret_cast<float4*>(out)[1] = make_float4(acc[j][4], acc[j][5], acc[j][6], acc[j][7]);
  }
}

template <int K>
void conv_bwd_vec_launch(const ConvBwdVecArgs& a, bool bf16, unsigned blocks, cudaStream_t st) {
  if (a.doc) {
    if (bf16) conv_bwd_vec_kernel<K, kBF16, true><<<blocks, kConvThreads, 0, st>>>(a);
    else conv_bwd_vec_kernel<K, kDtAny, true><<<blocks, kConvThreads, 0, st>>>(a);
  } else if (bf16) {
    conv_bwd_vec_kernel<K, kBF16><<<blocks, kConvThreads, 0, st>>>(a);
  } else {
    conv_bwd_vec_kernel<K, kDtAny><<<blocks, kConvThreads, 0, st>>>(a);
  }
}

// Whether the fast backward can run: D % 8 == 0, pre kept, every [B,T,D] operand with 16-byte
// aligned rows, 32-bit thread and time indices.
bool conv_backward_vec_fits(const ConvArgs& g, const Tensor& dc, const Tensor& u, const Tensor& pre,
                            const Tensor& du) {
  if (g.D % 8 != 0 || g.B < 1 || g.T < 1 || !pre.defined()) return false;
  const int64_t nq = g.D / 8, nseg = conv_bwd_nseg(g.T);
  if (g.B * nseg * nq > 0x7fffffff || g.T > 0x7fffffff) return false;
  return vec_btd(dc) && vec_btd(u) && vec_btd(pre) && (!du.defined() || vec_btd(du));
}

// F32 partials the fast backward needs for dw: [K, B·nseg, D].
size_t conv_bwd_vec_partial_floats(const ConvArgs& g) {
  const int64_t nseg = conv_bwd_nseg(g.T);
  return static_cast<size_t>(g.K) * static_cast<size_t>(g.B * nseg) * static_cast<size_t>(g.D);
}

// Queues the fast backward (conv_backward_vec_fits holds): du when defined, and dw += Σ
// through `partial` when dw_outs is given.
void conv_backward_vec(const ConvArgs& g, const Tensor& dc, const Tensor& u, const Tensor& pre, const Tensor& du,
                       const ColOuts* dw_outs, float* partial, cudaStream_t st) {
  const int64_t nq = g.D / 8, nseg = conv_bwd_nseg(g.T);
  ConvBwdVecArgs a;
  a.dc = btd_view(dc);
  a.u = btd_view(u);
  a.pre = btd_view(pre);
  a.du = btd_view(du);
  a.w = g.w;
  a.partial = dw_outs ? partial : nullptr;
  a.doc = g.doc;
  a.B = static_cast<int>(g.B);
  a.T = static_cast<int>(g.T);
  a.nq = static_cast<int>(nq);
  a.nseg = static_cast<int>(nseg);
  a.D = g.D;
  a.wvec = conv_w_vec(g);
  const unsigned blocks = static_cast<unsigned>((g.B * nseg * nq + kConvThreads - 1) / kConvThreads);
  const bool bf16 = a.dc.dt == kBF16 && a.u.dt == kBF16 && a.pre.dt == kBF16 && (!a.du.p || a.du.dt == kBF16) &&
                    a.w.dt == kBF16 && a.wvec;
  switch (g.K) {
    case 1: conv_bwd_vec_launch<1>(a, bf16, blocks, st); break;
    case 2: conv_bwd_vec_launch<2>(a, bf16, blocks, st); break;
    case 3: conv_bwd_vec_launch<3>(a, bf16, blocks, st); break;
    case 4: conv_bwd_vec_launch<4>(a, bf16, blocks, st); break;
    case 5: conv_bwd_vec_launch<5>(a, bf16, blocks, st); break;
    case 6: conv_bwd_vec_launch<6>(a, bf16, blocks, st); break;
    case 7: conv_bwd_vec_launch<7>(a, bf16, blocks, st); break;
    default: conv_bwd_vec_launch<8>(a, bf16, blocks, st); break;
  }
  CUDA_CHECK_LAUNCH();
  if (dw_outs) colsum_finalize(partial, g.B * nseg, g.D, g.K, *dw_outs, st);
}

}  // namespace cuda

void CudaBackend::conv_silu_forward(const Tensor& u, const Tensor& w, Tensor c, Tensor pre, const Tensor& win_in,
                                    Tensor win_out, const Tensor& slots, const Tensor& doc) {
  ConvArgs a = conv_args(u, w, "conv_silu_forward: u");
  a.doc = doc_starts_arg(doc, a.B, a.T, "conv_silu_forward: doc");
  LAPLACE_CHECK(same_shape(c, u), "conv_silu_forward: c must be [B,T,D]");
  LAPLACE_CHECK(!pre.defined() || same_shape(pre, u), "conv_silu_forward: pre must be [B,T,D]");
  a.win = window_view(win_in, a.K, a.D, "conv_silu: win_in");
  WView wout = window_view(win_out, a.K, a.D, "conv_silu: win_out");
  a.slots = i32_vec(slots, a.B, "conv_silu: slots must be I32 [B]");
  if (win_in.defined() && !slots.defined()) LAPLACE_CHECK(win_in.shape[0] >= a.B, "conv_silu: win_in has fewer than B entries");
  if (win_out.defined() && !slots.defined()) LAPLACE_CHECK(win_out.shape[0] >= a.B, "conv_silu: win_out has fewer than B entries");
  RView vc = make_rview(c, "conv_silu: c"), vp = make_rview(pre, "conv_silu: pre");
  if (conv_forward_vec(a, wout, u, c, pre, win_in, win_out, stream_)) return;
  const int64_t n = a.B * a.T * a.D;
  if (n > 0) {
    conv_fwd_kernel<<<grid_for(n, 256), 256, 0, stream_>>>(a, vc, vp);
    CUDA_CHECK_LAUNCH();
  }
  if (wout.p && a.B * a.D > 0) {
    // Ordered after conv_fwd_kernel on the stream, which reads win_in (win_out may alias it).
    conv_window_kernel<<<grid_for(a.B * a.D, 256), 256, 0, stream_>>>(a, wout);
    CUDA_CHECK_LAUNCH();
  }
}

void CudaBackend::conv_silu_backward(const Tensor& dc, const Tensor& u, const Tensor& w, const Tensor& pre, Tensor du,
                                     Tensor dw, const Tensor& doc) {
  ConvArgs a = conv_args(u, w, "conv_silu_backward: u");
  a.doc = doc_starts_arg(doc, a.B, a.T, "conv_silu_backward: doc");
  LAPLACE_CHECK(same_shape(dc, u), "conv_silu_backward: dc must be [B,T,D]");
  LAPLACE_CHECK(!pre.defined() || same_shape(pre, u), "conv_silu_backward: pre must be [B,T,D]");
  LAPLACE_CHECK(!du.defined() || same_shape(du, u), "conv_silu_backward: du must be [B,T,D]");
  RView vdc = make_rview(dc, "conv_silu: dc"), vp = make_rview(pre, "conv_silu: pre"),
        vdu = make_rview(du, "conv_silu: du");
  const int64_t n = a.B * a.T * a.D;
  if (n == 0) return;
  ColOuts outs;
  if (dw.defined()) {
    check_device(dw, "conv_silu: dw");
    LAPLACE_CHECK(dw.ndim == 2 && dw.shape[0] == a.D && dw.shape[1] == a.K && dw.stride[1] == 1,
                  "conv_silu_backward: dw must be [D,K] with K contiguous");
    for (int j = 0; j < a.K; ++j) outs.o[j] = col_out(dw, j, dw.stride[0], "conv_silu: dw");
  }
  if (conv_backward_vec_fits(a, dc, u, pre, du)) {
    float* part = dw.defined()
                      ? static_cast<float*>(scratch((conv_bwd_vec_partial_floats(a) + 64) * sizeof(float)))
                      : nullptr;
    conv_backward_vec(a, dc, u, pre, du, dw.defined() ? &outs : nullptr, part, stream_);
    return;
  }
  if (du.defined()) {
    conv_bwd_du_kernel<<<grid_for(n, 256), 256, 0, stream_>>>(a, vdc, vp, vdu);
    CUDA_CHECK_LAUNCH();
  }
  if (dw.defined()) {
    const int64_t rows = a.B * a.T;
    float* part = static_cast<float*>(scratch((colreduce_floats(rows, a.D, a.K) + 64) * sizeof(float)));
    colreduce(ConvDwTerms{a, vdc, vp}, rows, a.D, a.K, outs, part, stream_);
  }
}

}  // namespace laplace
