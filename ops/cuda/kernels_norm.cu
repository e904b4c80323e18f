// Row-wise CUDA ops: LayerNorm, RMSNorm×SiLU gate (the embedding in kernels_embedding.cu, causal
// conv + SiLU in kernels_conv.cu, cross-entropy in kernels_xent.cu). Parameter gradients (dw, db)
// are reduced without atomics (row_common.cuh), the second pass here: colsum_finalize.
// The forwards of LayerNorm and RMSNorm × gate, LayerNorm's dx, dw, db and the
// RMSNorm × gate backward's d_o, dg, dw have fast paths (16-byte accesses of 8 columns, each
// input read once; the RMSNorm × gate dw partials fused into the d_o, dg kernel) for the common
// shapes; the generic kernels serve the rest (see each launcher for the conditions).
#include <type_traits>

#include "ops/cuda/fp8_quant.cuh"
#include "ops/cuda/row_common.cuh"

namespace laplace {
namespace cuda {

// Pass 2: out_q[c] += Σ_seg partial[q, seg, c]. Block (32, kFinLanes) owns columns
// [32·bx, 32·bx+32) of output q = blockIdx.y: thread (tx, ty) sums segments ty, ty + 32, ...
// in order, then thread ty = 0 adds the 32 lane sums in order ty = 0..31. The order depends
// only on nseg, not on the grid the GPU runs, so the result is bitwise reproducible. One thread
// per column summing all nseg segments serially left the GPU idle (a 192-column dw: 192 threads).
// Outputs with p null are skipped. partial [nq, nseg, cols] F32.
constexpr int kFinLanes = 32;   // segment lanes per column in colsum_finalize_kernel
constexpr int kFinUnroll = 8;   // loads in flight per lane (the partials were just written: L2)
__global__ void __launch_bounds__(32 * kFinLanes)
    colsum_finalize_kernel(const float* partial, int64_t nseg, int64_t cols, ColOuts outs) {
  __shared__ float sh[kFinLanes][33];  // +1: the column reads of thread ty = 0 avoid bank conflicts
  const int tx = threadIdx.x, ty = threadIdx.y, q = blockIdx.y;
  const ColOut o = outs.o[q];
  if (!o.p) return;  // uniform over the block
  const int64_t c = blockIdx.x * 32LL + tx;
  float s = 0.f;
  if (c < cols) {
    const float* p = partial + q * nseg * cols + c;
#pragma unroll kFinUnroll
    for (int64_t g = ty; g < nseg; g += kFinLanes) s += p[g * cols];
  }
  sh[ty][tx] = s;
  __syncthreads();
  if (ty != 0 || c >= cols) return;
  float t = 0.f;
#pragma unroll
  for (int k = 0; k < kFinLanes; ++k) t += sh[k][tx];
  const int64_t i = o.off + c * o.stride;
  stf(o.p, i, o.dt, ldf(o.p, i, o.dt) + t);
}

// Pass 2 of every column reduction (colreduce and the fused / vectorised partial kernels).
void colsum_finalize(const float* partial, int64_t nseg, int64_t cols, int nq, const ColOuts& outs, cudaStream_t st) {
  if (nseg == 0 || cols == 0) return;
  LAPLACE_CHECK(nq >= 1 && nq <= kMaxColOut, "column reduction: bad number of outputs");
  dim3 grid(static_cast<unsigned>((cols + 31) / 32), static_cast<unsigned>(nq));
  colsum_finalize_kernel<<<grid, dim3(32, kFinLanes), 0, st>>>(partial, nseg, cols, outs);
  CUDA_CHECK_LAUNCH();
}

}  // namespace cuda

using namespace cuda;

// ---- LayerNorm ----------------------------------------------------------------------------

namespace cuda {

// One warp per row (F32): mean = Σx/D; var = Σ(x−mean)²/D (second pass, no cancellation);
// rstd = 1/√(var+eps); y = (x−mean)·rstd·w + b. y may be null (statistics only).
// x, y [N,D]; w, b [D]; mean, rstd [N]
__global__ void layernorm_fwd_kernel(RView x, Vec w, Vec b, float eps, RView y, float* mean, float* rstd) {
  const int64_t row = blockIdx.x * (int64_t)kWarpsPerBlock + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= x.rows) return;
  const int64_t D = x.cols, ox = x.row(row);
  float s = 0.f;
  for (int64_t c = lane; c < D; c += 32) s += ldf(x.p, ox + c, x.dt);
  const float mu = warp_sum(s) / static_cast<float>(D);
  float s2 = 0.f;
  for (int64_t c = lane; c < D; c += 32) {
    const float d = ldf(x.p, ox + c, x.dt) - mu;
    s2 += d * d;
  }
  const float r = 1.0f / sqrtf(warp_sum(s2) / static_cast<float>(D) + eps);
  if (y.p) {
    const int64_t oy = y.row(row);
    for (int64_t c = lane; c < D; c += 32) {
      float v = (ldf(x.p, ox + c, x.dt) - mu) * r;
      if (w.p) v *= ldf(w.p, c, w.dt);
      if (b.p) v += ldf(b.p, c, b.dt);
      stf(y.p, oy + c, y.dt, v);
    }
  }
  if (lane == 0) {
    if (mean) mean[row] = mu;
    if (rstd) rstd[row] = r;
  }
}

constexpr int kLnWarps = 4;     // layernorm_fwd_vec_kernel: 128 threads, one row per warp
constexpr int kLnMaxVec = 16;   // chunks of 256 columns a lane may hold: D ≤ 4096
enum : int { kLnVecX = 1, kLnVecY = 2, kLnVecW = 4, kLnVecB = 8 };  // which tensors ld8/st8 vectorize

// The fast LayerNorm (D % 8 == 0, D ≤ 256·NV): the row is read once into registers. One warp
// per row; lane l holds the 8-column chunks q = l + 32i (i < NV, q < D/8). mean = Σx/D, then
// var = Σ(x−mean)²/D from the registers (two passes, no cancellation), y written once with
// the generic kernel's expression. The summation order depends only on D (each lane its
// chunks in order, then the butterfly); the backward's recomputation of the statistics runs
// this same kernel (launch_layernorm_fwd), so it gets the forward's bits. XDT is x's dtype,
// PDT that of y, w and b (dt_as): fixed, they let a lane's NV loads of x all be in flight.
// kCodes (layernorm_forward_e4m3; PDT BF16): y is not written; each value, rounded to BF16 as it
// would be stored, stays in the lane's registers, and the row's E4M3 codes and scale go to codes
// and scales as quantize_rows_e4m3 of that y computes them (ops/cuda/fp8_quant.cuh's functions).
// x, y [N,D]; w, b [D]; mean, rstd [N]; codes [N,D], scales [N]
template <int NV, int XDT, int PDT, bool kCodes = false>
__global__ void __launch_bounds__(32 * kLnWarps)
    layernorm_fwd_vec_kernel(RView x, Vec w, Vec b, float eps, RView y, float* mean, float* rstd, int vec,
                             __nv_fp8_storage_t* codes = nullptr, float* scales = nullptr) {
  static_assert(!kCodes || PDT == kBF16, "codes are of a BF16 y");
  const int64_t row = blockIdx.x * (int64_t)kLnWarps + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= x.rows) return;  // whole warps: the shuffles below see all 32 lanes
  const int nq = static_cast<int>(x.cols >> 3);
  const int64_t ox = x.row(row);
  float v[NV][8];
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int q = lane + 32 * i;
    if (q < nq) {
      ld8(x.p, ox + 8 * q, dt_as<XDT>(x.dt), vec_as<XDT>(vec & kLnVecX), v[i]);
    } else {
#pragma unroll
      for (int k = 0; k < 8; ++k) v[i][k] = 0.f;
    }
  }
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < NV; ++i)
#pragma unroll
    for (int k = 0; k < 8; ++k) s += v[i][k];
  const float mu = warp_sum(s) / static_cast<float>(x.cols);
  float s2 = 0.f;
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    if (lane + 32 * i >= nq) continue;  // absent chunks hold zeros, not x − mean
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const float d = v[i][k] - mu;
      s2 += d * d;
    }
  }
  const float r = 1.0f / sqrtf(warp_sum(s2) / static_cast<float>(x.cols) + eps);
  if (y.p || kCodes) {
    const int64_t oy = kCodes ? 0 : y.row(row);
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int q = lane + 32 * i;
      if (q >= nq) continue;
      float o[8], wb[8];
#pragma unroll
      for (int k = 0; k < 8; ++k) o[k] = (v[i][k] - mu) * r;
      if (w.p) {
        ld8(w.p, 8 * q, dt_as<PDT>(w.dt), vec_as<PDT>(vec & kLnVecW), wb);
#pragma unroll
        for (int k = 0; k < 8; ++k) o[k] *= wb[k];
      }
      if (b.p) {
        ld8(b.p, 8 * q, dt_as<PDT>(b.dt), vec_as<PDT>(vec & kLnVecB), wb);
#pragma unroll
        for (int k = 0; k < 8; ++k) o[k] += wb[k];
      }
      if constexpr (kCodes) {
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          v[i][k] = __bfloat162float(__float2bfloat16_rn(o[k]));
          amax = fmaxf(amax, fabsf(v[i][k]));
        }
      } else {
        st8(y.p, oy + 8 * q, dt_as<PDT>(y.dt), vec_as<PDT>(vec & kLnVecY), o);
      }
    }
    if constexpr (kCodes) {
      const float scale = fp8_quant::scale_of(fp8_quant::warp_max(amax)), inv = 1.f / scale;
      __nv_fp8_storage_t* qr = codes + row * x.cols;
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        const int q = lane + 32 * i;
        if (q < nq) fp8_quant::store_row_codes<8>(v[i], inv, qr + 8 * q);
      }
      if (lane == 0) scales[row] = scale;
    }
  }
  if (lane == 0) {
    if (mean) mean[row] = mu;
    if (rstd) rstd[row] = r;
  }
}

// dx for one row per warp, with x̂ = (x−mean)·rstd and g = dy·w:
//   dx = rstd · (g − mean(g) − x̂ · mean(g·x̂))   (= or += when accumulate).
// dy, x, dx [N,D]; w [D]; mean, rstd [N]
__global__ void layernorm_bwd_dx_kernel(RView dy, RView x, Vec w, const float* mean, const float* rstd,
                                        RView dx, int accumulate) {
  const int64_t row = blockIdx.x * (int64_t)kWarpsPerBlock + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= x.rows) return;
  const int64_t D = x.cols, ox = x.row(row), ody = dy.row(row), odx = dx.row(row);
  const float mu = mean[row], r = rstd[row];
  float s1 = 0.f, s2 = 0.f;
  for (int64_t c = lane; c < D; c += 32) {
    float g = ldf(dy.p, ody + c, dy.dt);
    if (w.p) g *= ldf(w.p, c, w.dt);
    const float xh = (ldf(x.p, ox + c, x.dt) - mu) * r;
    s1 += g;
    s2 += g * xh;
  }
  const float m1 = warp_sum(s1) / static_cast<float>(D), m2 = warp_sum(s2) / static_cast<float>(D);
  for (int64_t c = lane; c < D; c += 32) {
    float g = ldf(dy.p, ody + c, dy.dt);
    if (w.p) g *= ldf(w.p, c, w.dt);
    const float xh = (ldf(x.p, ox + c, x.dt) - mu) * r;
    float v = r * (g - m1 - xh * m2);
    if (accumulate) v += ldf(dx.p, odx + c, dx.dt);
    stf(dx.p, odx + c, dx.dt, v);
  }
}

// The fast dx (D % 8 == 0, D ≤ 256·NV; dy, x, dx rows and w 16-byte aligned, see
// launch_layernorm_bwd_dx): layernorm_bwd_dx_kernel with dy, x and w read once instead of
// twice. One warp per row; lane l keeps g = dy·w and x̂ of its chunks q = l + 32i (i < NV,
// q < D/8) in registers between the sums and the stores (16·NV floats: NV = 12 takes ~254
// registers, NV = 16 spills ~200 bytes a thread to local memory, sm_90a). Same per-element
// expressions; the sums run in another order (each lane its chunks in order, then the
// butterfly), so dx agrees with the generic kernel to rounding, not bitwise. All accesses are
// 16-byte (the 4-argument ld8/st8): the launcher checks every row.
// dy, x, dx [N,D]; w [D]; mean, rstd [N]
template <int NV>
__global__ void __launch_bounds__(32 * kLnWarps)
    layernorm_bwd_dx_vec_kernel(RView dy, RView x, Vec w, const float* mean, const float* rstd, RView dx,
                                int accumulate) {
  const int64_t row = blockIdx.x * (int64_t)kLnWarps + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= x.rows) return;  // whole warps: the shuffles below see all 32 lanes
  const int nq = static_cast<int>(x.cols >> 3);
  const int64_t ox = x.row(row), ody = dy.row(row);
  const float mu = mean[row], r = rstd[row];
  float gv[NV][8], xh[NV][8];  // g and x̂ of the lane's chunks (zeros in absent chunks)
  float s1 = 0.f, s2 = 0.f;
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int q = lane + 32 * i;
    if (q < nq) {
      ld8(dy.p, ody + 8 * q, dy.dt, gv[i]);
      ld8(x.p, ox + 8 * q, x.dt, xh[i]);
      if (w.p) {
        float wv[8];
        ld8(w.p, 8 * q, w.dt, wv);
#pragma unroll
        for (int k = 0; k < 8; ++k) gv[i][k] *= wv[k];
      }
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        xh[i][k] = (xh[i][k] - mu) * r;
        s1 += gv[i][k];
        s2 += gv[i][k] * xh[i][k];
      }
    } else {
#pragma unroll
      for (int k = 0; k < 8; ++k) gv[i][k] = xh[i][k] = 0.f;
    }
  }
  const float m1 = warp_sum(s1) / static_cast<float>(x.cols), m2 = warp_sum(s2) / static_cast<float>(x.cols);
  const int64_t odx = dx.row(row);
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int q = lane + 32 * i;
    if (q >= nq) continue;
    float v[8], prev[8];
    if (accumulate) ld8(dx.p, odx + 8 * q, dx.dt, prev);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      v[k] = r * (gv[i][k] - m1 - xh[i][k] * m2);
      if (accumulate) v[k] += prev[k];
    }
    st8(dx.p, odx + 8 * q, dx.dt, v);
  }
}

// Column terms of LayerNorm: dw += dy·x̂, db += dy.
struct LnDwDbTerms {
  RView dy, x;
  const float* mean;
  const float* rstd;
  __device__ void operator()(int64_t r, int64_t c, float* t) const {
    const float g = ldf(dy.p, dy.row(r) + c, dy.dt);
    t[0] = g * (ldf(x.p, x.row(r) + c, x.dt) - mean[r]) * rstd[r];
    t[1] = g;
  }
};

// The vectorised dw/db partials (D % 8 == 0; dy, x rows 16-byte aligned, see
// launch_layernorm_bwd_dwdb): LnDwDbTerms through colpartial_kernel read 2 bytes per load and
// recomputed the row offsets and mean/rstd per element. Block (kLnDwChunks, kLnDwLanes) owns
// columns [256·bx, 256·bx+256) of segment seg = blockIdx.y, rows [seg·kSegRows, ...):
// thread (tx, ty) owns the 8 columns of chunk 32·bx + tx and sums rows seg·kSegRows + ty + 8j
// in order (one 16-byte load of dy and of x per row, the row's mean/rstd read once), then the
// 8 row-lanes are summed in order ty = 0..7: colpartial_kernel's order and expressions, so
// the result agrees with the generic path to rounding (the compiler may contract differently).
// dy, x [N,D]; mean, rstd [N]; partial [2, nseg, D] F32 (dw terms, then db terms)
constexpr int kLnDwChunks = 32;  // 8-column chunks per block: 256 columns
constexpr int kLnDwLanes = 8;    // row-lanes per block (rows ty, ty + 8, ... of the segment)
__global__ void __launch_bounds__(kLnDwChunks * kLnDwLanes)
    layernorm_bwd_dwdb_vec_kernel(RView dy, RView x, const float* mean, const float* rstd, float* partial) {
  __shared__ __align__(16) float sh[2][kLnDwLanes][8 * kLnDwChunks];  // [dw, db][row-lane][column]
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t D = x.cols, nseg = gridDim.y, seg = blockIdx.y;
  const int64_t chunk = blockIdx.x * (int64_t)kLnDwChunks + tx;
  const int64_t r0 = seg * kSegRows, r1 = min(x.rows, r0 + kSegRows);
  float aw[8], ab[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) aw[k] = ab[k] = 0.f;
  if (chunk < (D >> 3)) {
#pragma unroll 4
    for (int64_t r = r0 + ty; r < r1; r += kLnDwLanes) {
      const float mu = mean[r], rs = rstd[r];
      float gv[8], xv[8];
      ld8(dy.p, dy.row32(static_cast<uint32_t>(r)) + 8 * chunk, dy.dt, gv);
      ld8(x.p, x.row32(static_cast<uint32_t>(r)) + 8 * chunk, x.dt, xv);
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        aw[k] += gv[k] * (xv[k] - mu) * rs;
        ab[k] += gv[k];
      }
    }
  }
  float4* dw4 = reinterpret_cast<float4*>(&sh[0][ty][8 * tx]);
  float4* db4 = reinterpret_cast<float4*>(&sh[1][ty][8 * tx]);
  dw4[0] = make_float4(aw[0], aw[1], aw[2], aw[3]);
  dw4[1] = make_float4(aw[4], aw[5], aw[6], aw[7]);
  db4[0] = make_float4(ab[0], ab[1], ab[2], ab[3]);
  db4[1] = make_float4(ab[4], ab[5], ab[6], ab[7]);
  __syncthreads();
  // Thread t of the block sums column t of the block's 256 over the row-lanes, in order.
  const int t = ty * kLnDwChunks + tx;
  const int64_t c = blockIdx.x * (8LL * kLnDwChunks) + t;
  if (c >= D) return;
#pragma unroll
  for (int q = 0; q < 2; ++q) {
    float s = 0.f;
#pragma unroll
    for (int l = 0; l < kLnDwLanes; ++l) s += sh[q][l][t];
    partial[(q * nseg + seg) * D + c] = s;
  }
}

// dw += Σ dy·x̂ and db += Σ dy over the rows (either output may be null). The vectorised
// partials need D % 8 == 0 and 16-byte accesses to every row of dy and x; other layouts take
// colreduce(LnDwDbTerms). Both write partial [2, colreduce_nseg(N), D] and share the finalize.
void launch_layernorm_bwd_dwdb(const RView& dy, const RView& x, const float* mean, const float* rstd,
                               const ColOuts& outs, float* partial, cudaStream_t st) {
  const int64_t N = x.rows, D = x.cols;
  if (N == 0 || D == 0) return;
  if (D % 8 == 0 && N <= kRow32Max && vec_rows(dy) && vec_rows(x)) {
    const int64_t nseg = colreduce_nseg(N);
    LAPLACE_CHECK(nseg <= 65535, "layernorm_backward: too many rows");
    dim3 grid(static_cast<unsigned>((D / 8 + kLnDwChunks - 1) / kLnDwChunks), static_cast<unsigned>(nseg));
    layernorm_bwd_dwdb_vec_kernel<<<grid, dim3(kLnDwChunks, kLnDwLanes), 0, st>>>(dy, x, mean, rstd, partial);
    CUDA_CHECK_LAUNCH();
    colsum_finalize(partial, nseg, D, 2, outs, st);
  } else {
    colreduce(LnDwDbTerms{dy, x, mean, rstd}, N, D, 2, outs, partial, st);
  }
}

template <int NV, int XDT>
void layernorm_vec_launch(const RView& x, const Vec& w, const Vec& b, float eps, const RView& y, float* mean,
                          float* rstd, int vec, cudaStream_t st) {
  const unsigned grid = static_cast<unsigned>((x.rows + kLnWarps - 1) / kLnWarps);
  if (XDT == kBF16 && bf16_rows(y) && bf16_vec(w) && bf16_vec(b))
    layernorm_fwd_vec_kernel<NV, XDT, kBF16><<<grid, 32 * kLnWarps, 0, st>>>(x, w, b, eps, y, mean, rstd, vec);
  else
    layernorm_fwd_vec_kernel<NV, XDT, kDtAny><<<grid, 32 * kLnWarps, 0, st>>>(x, w, b, eps, y, mean, rstd, vec);
}

// f(std::integral_constant<int, NV>{}) with the warp-per-row kernels' instance NV for nv chunks of
// 256 columns a lane (nv ≤ kLnMaxVec; the lanes' extra chunks are masked). The forward, its FP8
// codes and dx all take their instances from here.
template <class F>
void with_ln_chunks(int64_t nv, F&& f) {
  if (nv <= 1) f(std::integral_constant<int, 1>{});
  else if (nv <= 2) f(std::integral_constant<int, 2>{});
  else if (nv <= 3) f(std::integral_constant<int, 3>{});
  else if (nv <= 4) f(std::integral_constant<int, 4>{});
  else if (nv <= 6) f(std::integral_constant<int, 6>{});
  else if (nv <= 8) f(std::integral_constant<int, 8>{});
  else if (nv <= 12) f(std::integral_constant<int, 12>{});
  else f(std::integral_constant<int, 16>{});
}

// The warp-per-row forward for nv chunks of 256 columns a lane.
template <int XDT>
void layernorm_vec_dispatch(int64_t nv, const RView& x, const Vec& w, const Vec& b, float eps, const RView& y,
                            float* mean, float* rstd, int vec, cudaStream_t st) {
  with_ln_chunks(nv, [&](auto c) {
    layernorm_vec_launch<decltype(c)::value, XDT>(x, w, b, eps, y, mean, rstd, vec, st);
  });
}

// ---- LayerNorm, one block per row (wide rows) ----
// For D > 256·kLnRowMinVec the warp-per-row kernels above hold 8·NV values a lane (NV = 12 at
// D = 3072: 128 registers forward, 254 for dx), which leaves an SM 2–4 blocks of 4 warps and
// the dx kernel's accumulate loads after both reductions. Here one block of ⌈D/8⌉ threads
// (rounded to whole warps) owns a row, each thread one 8-column chunk in registers (~48 registers),
// all loads issued before the first barrier (experiments/norm, v2). Sums over the block: each warp's
// butterfly, then the warps' partials in warp order, read by every thread in the same order
// (deterministic; another order than the warp-per-row kernels, so bits differ from theirs).
// Wide rows take this dx kernel. For the forward it pays only against a warp-per-row kernel
// that reads dtypes at run time (see dt_as in cuda_common.cuh): with x's dtype fixed at compile
// time the warp-per-row forward is as fast, so BF16 rows take it (launch_layernorm_fwd).
constexpr int kLnRowMinVec = 4;       // wider rows than 256·4 columns take the block-per-row kernels
constexpr int kLnRowMaxThreads = 1024;  // D ≤ 8192

// Σ over the block of a and b (every thread gets both), one barrier. sh [2][32], not read by
// a previous call still in flight (callers pass a buffer per call).
__device__ __forceinline__ void block_sum2_ordered(float& a, float& b, float (*sh)[32]) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  a = warp_sum(a);
  b = warp_sum(b);
  if (lane == 0) {
    sh[0][warp] = a;
    sh[1][warp] = b;
  }
  __syncthreads();
  a = b = 0.f;
  for (int i = 0; i < nw; ++i) {
    a += sh[0][i];
    b += sh[1][i];
  }
}

// x, y [N,D]; w, b [D]; mean, rstd [N] (y, w, b, mean, rstd optional); D % 8 == 0.
template <int DT>
__global__ void __launch_bounds__(kLnRowMaxThreads)
    layernorm_fwd_row_kernel(RView x, Vec w, Vec b, float eps, RView y, float* mean, float* rstd, int vec) {
  __shared__ float sh[2][2][32];
  const int64_t row = blockIdx.x;
  const int q = threadIdx.x, nq = static_cast<int>(x.cols >> 3);
  const bool own = q < nq;
  float v[8];
  if (own) {
    ld8(x.p, x.row(row) + 8 * q, dt_as<DT>(x.dt), vec_as<DT>(vec & kLnVecX), v);
  } else {
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = 0.f;
  }
  float s = 0.f, unused = 0.f;
#pragma unroll
  for (int k = 0; k < 8; ++k) s += v[k];
  block_sum2_ordered(s, unused, sh[0]);
  const float mu = s / static_cast<float>(x.cols);
  float s2 = 0.f;
  if (own) {
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const float d = v[k] - mu;
      s2 += d * d;
    }
  }
  unused = 0.f;
  block_sum2_ordered(s2, unused, sh[1]);
  const float r = 1.0f / sqrtf(s2 / static_cast<float>(x.cols) + eps);
  if (y.p && own) {
    float o[8], wb[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) o[k] = (v[k] - mu) * r;
    if (w.p) {
      ld8(w.p, 8 * q, dt_as<DT>(w.dt), vec_as<DT>(vec & kLnVecW), wb);
#pragma unroll
      for (int k = 0; k < 8; ++k) o[k] *= wb[k];
    }
    if (b.p) {
      ld8(b.p, 8 * q, dt_as<DT>(b.dt), vec_as<DT>(vec & kLnVecB), wb);
#pragma unroll
      for (int k = 0; k < 8; ++k) o[k] += wb[k];
    }
    st8(y.p, y.row(row) + 8 * q, dt_as<DT>(y.dt), vec_as<DT>(vec & kLnVecY), o);
  }
  if (q == 0) {
    if (mean) mean[row] = mu;
    if (rstd) rstd[row] = r;
  }
}

// dx (= or += with accumulate) of one row per block: layernorm_bwd_dx_vec_kernel's expressions.
// Every thread loads its chunk of dy, x, w (and dx when accumulating) before the barrier, and
// alone reads then writes its chunk of dx. dy, x, dx [N,D]; w [D]; mean, rstd [N].
template <int DT>
__global__ void __launch_bounds__(kLnRowMaxThreads)
    layernorm_bwd_dx_row_kernel(RView dy, RView x, Vec w, const float* mean, const float* rstd, RView dx,
                                int accumulate) {
  __shared__ float sh[2][32];
  const int64_t row = blockIdx.x;
  const int q = threadIdx.x, nq = static_cast<int>(x.cols >> 3);
  const bool own = q < nq;
  const float mu = mean[row], r = rstd[row];
  float gv[8], xh[8], prev[8];
  float s1 = 0.f, s2 = 0.f;
  if (own) {
    ld8(dy.p, dy.row(row) + 8 * q, dt_as<DT>(dy.dt), gv);
    ld8(x.p, x.row(row) + 8 * q, dt_as<DT>(x.dt), xh);
    if (accumulate) ld8(dx.p, dx.row(row) + 8 * q, dt_as<DT>(dx.dt), prev);
    if (w.p) {
      float wv[8];
      ld8(w.p, 8 * q, dt_as<DT>(w.dt), wv);
#pragma unroll
      for (int k = 0; k < 8; ++k) gv[k] *= wv[k];
    }
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      xh[k] = (xh[k] - mu) * r;
      s1 += gv[k];
      s2 += gv[k] * xh[k];
    }
  }
  block_sum2_ordered(s1, s2, sh);
  if (!own) return;
  const float m1 = s1 / static_cast<float>(x.cols), m2 = s2 / static_cast<float>(x.cols);
  float v[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    v[k] = r * (gv[k] - m1 - xh[k] * m2);
    if (accumulate) v[k] += prev[k];
  }
  st8(dx.p, dx.row(row) + 8 * q, dt_as<DT>(dx.dt), v);
}

unsigned ln_row_threads(int64_t D) { return static_cast<unsigned>(((D / 8 + 31) / 32) * 32); }
bool ln_row_fits(int64_t N, int64_t D) {
  return D % 8 == 0 && D > 256 * kLnRowMinVec && D / 8 <= kLnRowMaxThreads && N <= 0x7fffffff;
}

// LayerNorm statistics (and y when y.p) of every row of x. The forward and the backward's
// recomputation both launch through here with the same x, and the kernel (so the summation
// order) is chosen from x alone (D, dtype, alignment), so the two always compute the
// statistics with the same bits; y, w and b choose only between instances of one kernel.
void launch_layernorm_fwd(const RView& x, const Vec& w, const Vec& b, float eps, const RView& y, float* mean,
                          float* rstd, cudaStream_t st) {
  const int64_t N = x.rows, D = x.cols;
  if (N == 0) return;
  const int64_t nv = (D + 255) / 256;  // chunks of 256 columns per lane
  const int vec = (vec_rows(x) ? kLnVecX : 0) | (vec_rows(y) ? kLnVecY : 0) |
                  (w.p && aligned16(w.p) ? kLnVecW : 0) | (b.p && aligned16(b.p) ? kLnVecB : 0);
  const bool warp_rows = D > 0 && D % 8 == 0 && nv <= kLnMaxVec;
  if (warp_rows && bf16_rows(x)) {
    // BF16 x: one warp per row with x's dtype fixed (the fastest forward for BF16 rows).
    layernorm_vec_dispatch<kBF16>(nv, x, w, b, eps, y, mean, rstd, vec, st);
  } else if (ln_row_fits(N, D)) {
    // Wide rows otherwise: one block per row (faster than a warp with a run-time dtype).
    const dim3 grid(static_cast<unsigned>(N)), block(ln_row_threads(D));
    if (bf16_rows(x) && bf16_rows(y) && bf16_vec(w) && bf16_vec(b))
      layernorm_fwd_row_kernel<kBF16><<<grid, block, 0, st>>>(x, w, b, eps, y, mean, rstd, vec);
    else
      layernorm_fwd_row_kernel<kDtAny><<<grid, block, 0, st>>>(x, w, b, eps, y, mean, rstd, vec);
  } else if (warp_rows) {
    layernorm_vec_dispatch<kDtAny>(nv, x, w, b, eps, y, mean, rstd, vec, st);
  } else {
    layernorm_fwd_kernel<<<static_cast<unsigned>((N + kWarpsPerBlock - 1) / kWarpsPerBlock), 32 * kWarpsPerBlock, 0,
                           st>>>(x, w, b, eps, y, mean, rstd);
  }
  CUDA_CHECK_LAUNCH();
}

// layernorm_forward_e4m3's fused forward (kCodes) for the rows it takes: BF16 rows of x whose
// chunks the warp-per-row kernel holds, w and b BF16 (or none). False for any other: the caller
// then runs the two ops.
template <int NV>
void layernorm_codes_launch(const RView& x, const Vec& w, const Vec& b, float eps, int vec,
                            __nv_fp8_storage_t* codes, float* scales, cudaStream_t st) {
  const unsigned grid = static_cast<unsigned>((x.rows + kLnWarps - 1) / kLnWarps);
  layernorm_fwd_vec_kernel<NV, kBF16, kBF16, true>
      <<<grid, 32 * kLnWarps, 0, st>>>(x, w, b, eps, RView{}, nullptr, nullptr, vec, codes, scales);
}

bool launch_layernorm_fwd_codes(const RView& x, const Vec& w, const Vec& b, float eps, __nv_fp8_storage_t* codes,
                                float* scales, cudaStream_t st) {
  const int64_t N = x.rows, D = x.cols;
  const int64_t nv = (D + 255) / 256;
  if (!(D > 0 && D % 8 == 0 && nv <= kLnMaxVec && bf16_rows(x) && bf16_vec(w) && bf16_vec(b))) return false;
  if (N == 0) return true;
  const int vec = kLnVecX | (w.p && aligned16(w.p) ? kLnVecW : 0) | (b.p && aligned16(b.p) ? kLnVecB : 0);
  with_ln_chunks(nv, [&](auto c) { layernorm_codes_launch<decltype(c)::value>(x, w, b, eps, vec, codes, scales, st); });
  CUDA_CHECK_LAUNCH();
  return true;
}

template <int NV>
void layernorm_bwd_dx_vec_launch(const RView& dy, const RView& x, const Vec& w, const float* mean, const float* rstd,
                                 const RView& dx, int accumulate, cudaStream_t st) {
  const unsigned grid = static_cast<unsigned>((x.rows + kLnWarps - 1) / kLnWarps);
  layernorm_bwd_dx_vec_kernel<NV><<<grid, 32 * kLnWarps, 0, st>>>(dy, x, w, mean, rstd, dx, accumulate);
}

// dx of every row. The fast kernel needs D % 8 == 0, D ≤ 256·kLnMaxVec and 16-byte accesses
// to every row of dy, x, dx and to w (or no w): it has no element-wise fallback, so a view
// with unaligned rows takes the generic kernel.
void launch_layernorm_bwd_dx(const RView& dy, const RView& x, const Vec& w, const float* mean, const float* rstd,
                             const RView& dx, int accumulate, cudaStream_t st) {
  const int64_t N = x.rows, D = x.cols;
  if (N == 0) return;
  const int64_t nv = (D + 255) / 256;  // chunks of 256 columns per lane
  const bool vec = vec_rows(dy) && vec_rows(x) && vec_rows(dx) && (!w.p || aligned16(w.p));
  if (vec && ln_row_fits(N, D)) {
    const dim3 grid(static_cast<unsigned>(N)), block(ln_row_threads(D));
    if (bf16_rows(dy) && bf16_rows(x) && bf16_rows(dx) && bf16_vec(w))
      layernorm_bwd_dx_row_kernel<kBF16><<<grid, block, 0, st>>>(dy, x, w, mean, rstd, dx, accumulate);
    else
      layernorm_bwd_dx_row_kernel<kDtAny><<<grid, block, 0, st>>>(dy, x, w, mean, rstd, dx, accumulate);
  } else if (D > 0 && D % 8 == 0 && nv <= kLnMaxVec && vec) {
    // The forward's instances.
    with_ln_chunks(nv, [&](auto c) {
      layernorm_bwd_dx_vec_launch<decltype(c)::value>(dy, x, w, mean, rstd, dx, accumulate, st);
    });
  } else {
    layernorm_bwd_dx_kernel<<<static_cast<unsigned>((N + kWarpsPerBlock - 1) / kWarpsPerBlock),
                              32 * kWarpsPerBlock, 0, st>>>(dy, x, w, mean, rstd, dx, accumulate);
  }
  CUDA_CHECK_LAUNCH();
}

}  // namespace cuda

void CudaBackend::layernorm_forward(const Tensor& x, const Tensor& w, const Tensor& b, double eps, Tensor y,
                                    Tensor mean, Tensor rstd) {
  RView vx = make_rview(x, "layernorm: x"), vy = make_rview(y, "layernorm: y");
  const int64_t N = vx.rows, D = vx.cols;
  LAPLACE_CHECK(!y.defined() || (vy.rows == N && vy.cols == D), "layernorm_forward: y shape differs from x");
  Vec vw = make_vec(w, D, "layernorm: w"), vb = make_vec(b, D, "layernorm: b");
  float* pm = f32_vec(mean, N, "layernorm: mean");
  float* pr = f32_vec(rstd, N, "layernorm: rstd");
  if (N == 0) return;
  launch_layernorm_fwd(vx, vw, vb, static_cast<float>(eps), vy, pm, pr, stream_);
}

void CudaBackend::layernorm_forward_e4m3(const Tensor& x, const Tensor& w, const Tensor& b, double eps, Tensor y,
                                         Tensor q, Tensor s) {
  RView vx = make_rview(x, "layernorm_forward_e4m3: x");
  const int64_t N = vx.rows, D = vx.cols;
  check_e4m3_matrix(q, "layernorm_forward_e4m3: q");
  check_scales(s, N, "layernorm_forward_e4m3: s");
  if (!y.defined() || y.ndim != 2 || y.shape[0] != N || y.shape[1] != D || q.shape[0] != N || q.shape[1] != D)
    check_failed(__FILE__, __LINE__, "layernorm_forward_e4m3",
                 ("expected x [N, D], y and q [N, D]: x " + x.shape_str() + ", y " + y.shape_str() + ", q " +
                  q.shape_str())
                     .c_str());
  Vec vw = make_vec(w, D, "layernorm_forward_e4m3: w"), vb = make_vec(b, D, "layernorm_forward_e4m3: b");
  if (x.ndim == 2 && y.dtype == DType::kBF16 && reinterpret_cast<uintptr_t>(q.data) % 8 == 0 && N <= 0x7fffffff) {
    if (launch_layernorm_fwd_codes(vx, vw, vb, static_cast<float>(eps), static_cast<__nv_fp8_storage_t*>(q.data),
                                   static_cast<float*>(s.data), stream_))
      return;
  }
  Backend::layernorm_forward_e4m3(x, w, b, eps, y, q, s);
}

void CudaBackend::layernorm_backward(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& mean,
                                     const Tensor& rstd, Tensor dx, bool accumulate_dx, Tensor dw, Tensor db) {
  RView vx = make_rview(x, "layernorm: x"), vdy = make_rview(dy, "layernorm: dy"),
        vdx = make_rview(dx, "layernorm: dx");
  const int64_t N = vx.rows, D = vx.cols;
  LAPLACE_CHECK(vdy.rows == N && vdy.cols == D, "layernorm_backward: dy shape differs from x");
  LAPLACE_CHECK(!dx.defined() || (vdx.rows == N && vdx.cols == D), "layernorm_backward: dx shape differs from x");
  Vec vw = make_vec(w, D, "layernorm: w");
  const float* pm = f32_vec(mean, N, "layernorm: mean");
  const float* pr = f32_vec(rstd, N, "layernorm: rstd");
  if (N == 0) return;
  LAPLACE_CHECK((pm == nullptr) == (pr == nullptr), "layernorm_backward: pass both mean and rstd, or neither");
  const bool need_w = dw.defined() || db.defined();
  if (dw.defined()) LAPLACE_CHECK(dw.numel() == D && dw.is_contiguous(), "layernorm_backward: dw must be contiguous [D]");
  if (db.defined()) LAPLACE_CHECK(db.numel() == D && db.is_contiguous(), "layernorm_backward: db must be contiguous [D]");
  // scratch: [mean N][rstd N] when recomputed, then the column partials [2, nseg, D].
  const size_t stat_floats = pm ? 0 : 2 * static_cast<size_t>(N);
  const size_t part_floats = need_w ? colreduce_floats(N, D, 2) : 0;
  float* sc = static_cast<float*>(scratch((stat_floats + part_floats + 64) * sizeof(float)));
  if (!pm) {
    // The forward's statistics were not kept: recompute them. eps is not an argument of the
    // backward, so the model's norm_eps (docs/model.md §1, 1e-5) is assumed; pass mean/rstd otherwise.
    launch_layernorm_fwd(vx, Vec{}, Vec{}, 1e-5f, RView{}, sc, sc + N, stream_);
    pm = sc;
    pr = sc + N;
  }
  // dw/db first: dx may alias dy.
  if (need_w) {
    ColOuts outs;  // a missing dw or db keeps p == nullptr and is skipped by the finalize pass
    if (dw.defined()) outs.o[0] = col_out(dw, 0, 1, "layernorm: dw");
    if (db.defined()) outs.o[1] = col_out(db, 0, 1, "layernorm: db");
    launch_layernorm_bwd_dwdb(vdy, vx, pm, pr, outs, sc + stat_floats, stream_);
  }
  if (dx.defined()) launch_layernorm_bwd_dx(vdy, vx, vw, pm, pr, vdx, accumulate_dx ? 1 : 0, stream_);
}

// ---- RMSNorm × SiLU gate --------------------------------------------------------------------

namespace cuda {

// One warp per (token, head) row of dv (F32):
//   rstd = 1/√(mean(o²) + eps);  y = o·rstd·w ⊙ SiLU(g).   y may be null (statistics only).
// o, g, y [B,T,H,dv] as rows [B·T·H, dv]; w [dv]; rstd [B·T·H]
__global__ void rmsnorm_gate_fwd_kernel(RView o, RView g, Vec w, float eps, RView y, float* rstd) {
  const int64_t row = blockIdx.x * (int64_t)kWarpsPerBlock + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= o.rows) return;
  const int64_t dv = o.cols, oo = o.row(row);
  float ss = 0.f;
  for (int64_t c = lane; c < dv; c += 32) {
    const float v = ldf(o.p, oo + c, o.dt);
    ss += v * v;
  }
  const float r = 1.0f / sqrtf(warp_sum(ss) / static_cast<float>(dv) + eps);
  if (y.p) {
    const int64_t og = g.row(row), oy = y.row(row);
    for (int64_t c = lane; c < dv; c += 32) {
      const float gv = ldf(g.p, og + c, g.dt);
      float v = ldf(o.p, oo + c, o.dt) * r * gv * sigmoidf_(gv);
      if (w.p) v *= ldf(w.p, c, w.dt);
      stf(y.p, oy + c, y.dt, v);
    }
  }
  if (lane == 0 && rstd) rstd[row] = r;
}

constexpr int kRmsMaxDv = 256;  // rmsnorm_gate_fwd_vec_kernel: one 8-column chunk per lane
enum : int { kRmsVecO = 1, kRmsVecG = 2, kRmsVecY = 4, kRmsVecW = 8 };  // which tensors ld8/st8 vectorize

// The fast RMSNorm × gate (dv % 8 == 0, dv ≤ 256): rmsnorm_gate_fwd_kernel with o and g read
// once, 8 columns per lane (lane l < dv/8 owns columns [8l, 8l+8)), and y written once.
// Its bits are that kernel's, on which the fused decode gate (kernels_gla_decode.cu) relies:
// the sum of squares keeps the order lane l: columns l, l+32, ... then the butterfly (the row
// is staged through shared memory for it), and y is the same expression.
// o, g, y [B,T,H,dv] as rows [B·T·H, dv]; w [dv]; rstd [B·T·H]
template <int DT>
__global__ void __launch_bounds__(32 * kWarpsPerBlock)
    rmsnorm_gate_fwd_vec_kernel(RView o, RView g, Vec w, float eps, RView y, float* rstd, int vec) {
  __shared__ __align__(16) float sh[kWarpsPerBlock][kRmsMaxDv];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t row = blockIdx.x * (int64_t)kWarpsPerBlock + warp;
  if (row >= o.rows) return;  // whole warps: the shuffles below see all 32 lanes
  const int dv = static_cast<int>(o.cols);
  const bool own = lane < (dv >> 3);
  float ov[8], gv[8];
  if (own) {
    ld8(o.p, o.row(row) + 8 * lane, dt_as<DT>(o.dt), vec_as<DT>(vec & kRmsVecO), ov);
    if (y.p) ld8(g.p, g.row(row) + 8 * lane, dt_as<DT>(g.dt), vec_as<DT>(vec & kRmsVecG), gv);
    float4* d = reinterpret_cast<float4*>(&sh[warp][8 * lane]);
    d[0] = make_float4(ov[0], ov[1], ov[2], ov[3]);
    d[1] = make_float4(ov[4], ov[5], ov[6], ov[7]);
  }
  __syncwarp();
  float ss = 0.f;
  for (int c = lane; c < dv; c += 32) {
    const float v = sh[warp][c];
    ss += v * v;
  }
  const float r = 1.0f / sqrtf(warp_sum(ss) / static_cast<float>(dv) + eps);
  if (y.p && own) {
    float wv[8], out[8];
    if (w.p) ld8(w.p, 8 * lane, dt_as<DT>(w.dt), vec_as<DT>(vec & kRmsVecW), wv);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      float v = ov[k] * r * gv[k] * sigmoidf_(gv[k]);
      if (w.p) v *= wv[k];
      out[k] = v;
    }
    st8(y.p, y.row(row) + 8 * lane, dt_as<DT>(y.dt), vec_as<DT>(vec & kRmsVecY), out);
  }
  if (lane == 0 && rstd) rstd[row] = r;
}

// Backward per row, with ô = o·rstd, s = SiLU(g), a = dy·w·s:
//   d_o = rstd·(a − ô·mean(a·ô));   dg = dy·w·ô·SiLU'(g),  SiLU'(g) = σ(g)(1 + g(1−σ(g))).
__global__ void rmsnorm_gate_bwd_kernel(RView dy, RView o, RView g, Vec w, const float* rstd, RView d_o,
                                        RView dg) {
  const int64_t row = blockIdx.x * (int64_t)kWarpsPerBlock + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= o.rows) return;
  const int64_t dv = o.cols, oo = o.row(row), og = g.row(row), ody = dy.row(row);
  const float r = rstd[row];
  float s = 0.f;
  for (int64_t c = lane; c < dv; c += 32) {
    const float gv = ldf(g.p, og + c, g.dt);
    float a = ldf(dy.p, ody + c, dy.dt) * gv * sigmoidf_(gv);
    if (w.p) a *= ldf(w.p, c, w.dt);
    s += a * ldf(o.p, oo + c, o.dt) * r;
  }
  const float m = warp_sum(s) / static_cast<float>(dv);
  const int64_t odo = d_o.row(row), odg = dg.row(row);
  for (int64_t c = lane; c < dv; c += 32) {
    const float gv = ldf(g.p, og + c, g.dt);
    const float sg = sigmoidf_(gv);
    float dyw = ldf(dy.p, ody + c, dy.dt);
    if (w.p) dyw *= ldf(w.p, c, w.dt);
    const float oh = ldf(o.p, oo + c, o.dt) * r;
    if (d_o.p) stf(d_o.p, odo + c, d_o.dt, r * (dyw * gv * sg - oh * m));
    if (dg.p) stf(dg.p, odg + c, dg.dt, dyw * oh * sg * (1.0f + gv * (1.0f - sg)));
  }
}

constexpr int kRmsBwdRows = 128;    // rows per block of the fast backward = per dw partial segment
constexpr int kRmsBwdMinBlocks = 3; // resident blocks per SM asked of ptxas (≤ 80 registers): loads in flight

// The fast backward (dv % 8 == 0, dv ≤ 256; every row of dy, o, g and of d_o, dg when present
// and w 16-byte aligned, see launch_rmsnorm_gate_bwd): rmsnorm_gate_bwd_kernel with dy, o, g
// and w read once instead of twice, lane l < dv/8 owning columns [8l, 8l+8). Same per-element
// expressions; the sum of a·ô runs in another order (each lane its 8 columns, then the
// butterfly), so d_o agrees with the generic kernel to rounding, not bitwise. Each lane loads
// all its inputs before it stores, and only its own columns, so d_o / dg may alias dy, o or g
// as in the generic kernel.
// Block b owns rows [b·kRmsBwdRows, (b+1)·kRmsBwdRows): warp w takes rows w, w + 8, ... of them
// in order. With DW it also writes the block's dw partial, fused so that dy, o, g are read once
// for all three outputs: each lane sums RmsDwTerms' dy·o·rstd·g·σ(g) (same expression) over its
// rows in order, then the 8 warps are added in order w = 0..7 (colpartial_kernel's order over
// the same segment), and one row of partial is written per block; colsum_finalize adds them.
// d_o and dg may both be null (dw only).
// dy, o, g, d_o, dg [B,T,H,dv] as rows [B·T·H, dv]; w [dv]; rstd [B·T·H];
// partial [nseg = ceil(B·T·H / kRmsBwdRows), dv] F32
template <bool DW, int DT>
__global__ void __launch_bounds__(32 * kWarpsPerBlock, kRmsBwdMinBlocks)
    rmsnorm_gate_bwd_vec_kernel(RView dy, RView o, RView g, Vec w, const float* rstd, RView d_o, RView dg,
                                float* partial) {
  __shared__ __align__(16) float sh[DW ? kWarpsPerBlock : 1][DW ? kRmsMaxDv : 4];  // dw per warp
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int dv = static_cast<int>(o.cols);
  const bool own = lane < (dv >> 3);
  const int c0 = 8 * lane;
  const int64_t r0 = blockIdx.x * (int64_t)kRmsBwdRows, r1 = min(o.rows, r0 + kRmsBwdRows);
  float acc[8];  // the lane's dw terms over its rows
#pragma unroll
  for (int k = 0; k < 8; ++k) acc[k] = 0.f;
  for (int64_t row = r0 + warp; row < r1; row += kWarpsPerBlock) {  // uniform over the warp
    const uint32_t r32 = static_cast<uint32_t>(row);
    const float r = rstd[row];
    float dyv[8], ov[8], gv[8], sg[8], wv[8];  // w reloaded per row (L1): fewer live registers
    float s = 0.f;
    if (own) {
      ld8(dy.p, dy.row32(r32) + c0, dt_as<DT>(dy.dt), dyv);
      ld8(o.p, o.row32(r32) + c0, dt_as<DT>(o.dt), ov);
      ld8(g.p, g.row32(r32) + c0, dt_as<DT>(g.dt), gv);
      if (w.p) ld8(w.p, c0, dt_as<DT>(w.dt), wv);
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        sg[k] = sigmoidf_(gv[k]);
        if (DW) acc[k] += dyv[k] * ov[k] * r * gv[k] * sg[k];
        float a = dyv[k] * gv[k] * sg[k];
        if (w.p) a *= wv[k];
        s += a * ov[k] * r;
      }
    }
    if (!d_o.p && !dg.p) continue;  // dw only (uniform)
    const float m = d_o.p ? warp_sum(s) / static_cast<float>(dv) : 0.f;  // d_o.p uniform: all lanes shuffle
    if (!own) continue;
    float dov[8], dgv[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      float dyw = dyv[k];
      if (w.p) dyw *= wv[k];
      const float oh = ov[k] * r;
      dov[k] = r * (dyw * gv[k] * sg[k] - oh * m);
      dgv[k] = dyw * oh * sg[k] * (1.0f + gv[k] * (1.0f - sg[k]));
    }
    if (d_o.p) st8(d_o.p, d_o.row32(r32) + c0, dt_as<DT>(d_o.dt), dov);
    if (dg.p) st8(dg.p, dg.row32(r32) + c0, dt_as<DT>(dg.dt), dgv);
  }
  if (!DW) return;
  if (own) {
    float4* d = reinterpret_cast<float4*>(&sh[warp][c0]);
    d[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
    d[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
  }
  __syncthreads();
  // Thread c < dv adds column c of the 8 warps, in order.
  const int c = threadIdx.x;
  if (c >= dv) return;
  float t = 0.f;
#pragma unroll
  for (int k = 0; k < kWarpsPerBlock; ++k) t += sh[k][c];
  partial[blockIdx.x * (int64_t)dv + c] = t;
}

// Column terms: dw += dy·ô·SiLU(g).
struct RmsDwTerms {
  RView dy, o, g;
  const float* rstd;
  __device__ void operator()(int64_t r, int64_t c, float* t) const {
    const float gv = ldf(g.p, g.row(r) + c, g.dt);
    t[0] = ldf(dy.p, dy.row(r) + c, dy.dt) * ldf(o.p, o.row(r) + c, o.dt) * rstd[r] * gv * sigmoidf_(gv);
  }
};

void check_bthd(const Tensor& t, const Tensor& ref, const char* what) {
  if (!t.defined()) return;
  if (!same_shape(t, ref))
    check_failed(__FILE__, __LINE__, what, ("shape " + t.shape_str() + " differs from " + ref.shape_str()).c_str());
}

// rstd (and y when y.p) of every row; the forward and the backward's recomputation both
// launch through here. Both kernels give the same bits; the fast one needs dv % 8 == 0 and
// dv ≤ 256, and vectorizes each tensor whose rows are 16-byte aligned.
void launch_rmsnorm_gate_fwd(const RView& o, const RView& g, const Vec& w, float eps, const RView& y, float* rstd,
                             cudaStream_t st) {
  const int64_t R = o.rows, dv = o.cols;
  if (R == 0) return;
  const unsigned grid = static_cast<unsigned>((R + kWarpsPerBlock - 1) / kWarpsPerBlock);
  if (dv > 0 && dv % 8 == 0 && dv <= kRmsMaxDv) {
    const int vec = (vec_rows(o) ? kRmsVecO : 0) | (vec_rows(g) ? kRmsVecG : 0) | (vec_rows(y) ? kRmsVecY : 0) |
                    (w.p && aligned16(w.p) ? kRmsVecW : 0);
    if (bf16_rows(o) && bf16_rows(y.p ? g : RView{}) && bf16_rows(y) && bf16_vec(y.p ? w : Vec{}))
      rmsnorm_gate_fwd_vec_kernel<kBF16><<<grid, 32 * kWarpsPerBlock, 0, st>>>(o, g, w, eps, y, rstd, vec);
    else
      rmsnorm_gate_fwd_vec_kernel<kDtAny><<<grid, 32 * kWarpsPerBlock, 0, st>>>(o, g, w, eps, y, rstd, vec);
  } else {
    rmsnorm_gate_fwd_kernel<<<grid, 32 * kWarpsPerBlock, 0, st>>>(o, g, w, eps, y, rstd);
  }
  CUDA_CHECK_LAUNCH();
}

// Scratch floats of launch_rmsnorm_gate_bwd's dw partials: the larger of the two layouts.
size_t rmsnorm_gate_dw_floats(int64_t R, int64_t dv) {
  const size_t fused = static_cast<size_t>((R + kRmsBwdRows - 1) / kRmsBwdRows) * static_cast<size_t>(dv);
  return std::max(fused, colreduce_floats(R, dv, 1));
}

// d_o, dg and dw += Σ dy·ô·SiLU(g) (any of them may be null / dw.p null) of every row.
// The fast kernel needs dv % 8 == 0, dv ≤ 256, 16-byte accesses to every row of dy, o, g (its
// inputs) and, to write d_o / dg, of d_o, dg when present and of w (or no w): it has no
// element-wise fallback. dw's path depends on dy, o, g alone, so dw has the same bits whether
// or not d_o / dg are asked for; outputs the fast kernel cannot store take the generic kernel
// afterwards (it may overwrite dy, o or g through an alias, so it runs last).
// partial: rmsnorm_gate_dw_floats(R, dv) floats when dw.p.
void launch_rmsnorm_gate_bwd(const RView& dy, const RView& o, const RView& g, const Vec& w, const float* rstd,
                             const RView& d_o, const RView& dg, const ColOut& dw, float* partial, cudaStream_t st) {
  const int64_t R = o.rows, dv = o.cols;
  if (R == 0 || dv == 0) return;
  const bool fast_in = dv % 8 == 0 && dv <= kRmsMaxDv && R <= kRow32Max && vec_rows(dy) && vec_rows(o) && vec_rows(g);
  const bool fast_out = fast_in && (!d_o.p || vec_rows(d_o)) && (!dg.p || vec_rows(dg)) && (!w.p || aligned16(w.p));
  const bool want_out = d_o.p || dg.p;
  const bool bf16_in = bf16_rows(dy) && bf16_rows(o) && bf16_rows(g);
  const unsigned blocks = static_cast<unsigned>((R + kRmsBwdRows - 1) / kRmsBwdRows);
  bool out_done = false;
  if (dw.p) {
    ColOuts outs;
    outs.o[0] = dw;
    if (fast_in) {
      const RView no{};  // w too is passed only when this kernel writes d_o, dg (dw does not use it)
      const Vec kw = fast_out ? w : Vec{};
      const RView kdo = fast_out ? d_o : no, kdg = fast_out ? dg : no;
      if (bf16_in && bf16_rows(kdo) && bf16_rows(kdg) && bf16_vec(kw))
        rmsnorm_gate_bwd_vec_kernel<true, kBF16><<<blocks, 32 * kWarpsPerBlock, 0, st>>>(dy, o, g, kw, rstd, kdo, kdg,
                                                                                         partial);
      else
        rmsnorm_gate_bwd_vec_kernel<true, kDtAny><<<blocks, 32 * kWarpsPerBlock, 0, st>>>(dy, o, g, kw, rstd, kdo,
                                                                                          kdg, partial);
      CUDA_CHECK_LAUNCH();
      colsum_finalize(partial, blocks, dv, 1, outs, st);
      out_done = fast_out;
    } else {
      colreduce(RmsDwTerms{dy, o, g, rstd}, R, dv, 1, outs, partial, st);
    }
  }
  if (!want_out || out_done) return;
  if (fast_out) {
    if (bf16_in && bf16_rows(d_o) && bf16_rows(dg) && bf16_vec(w))
      rmsnorm_gate_bwd_vec_kernel<false, kBF16><<<blocks, 32 * kWarpsPerBlock, 0, st>>>(dy, o, g, w, rstd, d_o, dg,
                                                                                         nullptr);
    else
      rmsnorm_gate_bwd_vec_kernel<false, kDtAny><<<blocks, 32 * kWarpsPerBlock, 0, st>>>(dy, o, g, w, rstd, d_o, dg,
                                                                                          nullptr);
  } else {
    rmsnorm_gate_bwd_kernel<<<static_cast<unsigned>((R + kWarpsPerBlock - 1) / kWarpsPerBlock), 32 * kWarpsPerBlock,
                              0, st>>>(dy, o, g, w, rstd, d_o, dg);
  }
  CUDA_CHECK_LAUNCH();
}

}  // namespace cuda

void CudaBackend::rmsnorm_gate_forward(const Tensor& o, const Tensor& g, const Tensor& w, double eps, Tensor y,
                                       Tensor rstd) {
  check_bthd(g, o, "rmsnorm_gate: g");
  check_bthd(y, o, "rmsnorm_gate: y");
  RView vo = make_rview(o, "rmsnorm_gate: o"), vg = make_rview(g, "rmsnorm_gate: g"),
        vy = make_rview(y, "rmsnorm_gate: y");
  Vec vw = make_vec(w, vo.cols, "rmsnorm_gate: w");
  float* pr = f32_vec(rstd, vo.rows, "rmsnorm_gate: rstd");
  if (vo.rows == 0) return;
  launch_rmsnorm_gate_fwd(vo, vg, vw, static_cast<float>(eps), vy, pr, stream_);
}

void CudaBackend::rmsnorm_gate_backward(const Tensor& dy, const Tensor& o, const Tensor& g, const Tensor& w,
                                        const Tensor& rstd, Tensor d_o, Tensor dg, Tensor dw) {
  check_bthd(g, o, "rmsnorm_gate: g");
  check_bthd(dy, o, "rmsnorm_gate: dy");
  check_bthd(d_o, o, "rmsnorm_gate: d_o");
  check_bthd(dg, o, "rmsnorm_gate: dg");
  RView vo = make_rview(o, "rmsnorm_gate: o"), vg = make_rview(g, "rmsnorm_gate: g"),
        vdy = make_rview(dy, "rmsnorm_gate: dy"), vdo = make_rview(d_o, "rmsnorm_gate: d_o"),
        vdg = make_rview(dg, "rmsnorm_gate: dg");
  const int64_t R = vo.rows, dv = vo.cols;
  Vec vw = make_vec(w, dv, "rmsnorm_gate: w");
  const float* pr = f32_vec(rstd, R, "rmsnorm_gate: rstd");
  if (R == 0) return;
  const size_t stat_floats = pr ? 0 : static_cast<size_t>(R);
  const size_t part_floats = dw.defined() ? rmsnorm_gate_dw_floats(R, dv) : 0;
  float* sc = static_cast<float*>(scratch((stat_floats + part_floats + 64) * sizeof(float)));
  if (!pr) {
    // eps is not an argument of the backward: the model keeps rstd from the forward. Without
    // it we use the model's eps (docs/model.md §1: norm_eps = 1e-5).
    launch_rmsnorm_gate_fwd(vo, vg, Vec{}, 1e-5f, RView{}, sc, stream_);
    pr = sc;
  }
  ColOut odw;  // p null: no dw
  if (dw.defined()) {
    LAPLACE_CHECK(dw.numel() == dv && dw.is_contiguous(), "rmsnorm_gate_backward: dw must be contiguous [dv]");
    odw = col_out(dw, 0, 1, "rmsnorm_gate: dw");
  }
  launch_rmsnorm_gate_bwd(vdy, vo, vg, vw, pr, vdo, vdg, odw, sc + stat_floats, stream_);
}

}  // namespace laplace
