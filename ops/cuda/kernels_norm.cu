// Row-wise CUDA ops: embedding, LayerNorm, RMSNorm×SiLU gate, causal conv + SiLU,
// cross-entropy. Parameter gradients (dw, db, dtable) are reduced without atomics:
// per-segment partials [nq, nseg, cols] in a fixed row order, then 32 lanes per column sum
// the segments in a fixed order (colsum_finalize_kernel). The segmentation depends only on
// the shapes, so results are bitwise reproducible.
// The forwards of LayerNorm, RMSNorm × gate and conv + SiLU, LayerNorm's dx, dw, db and the
// RMSNorm × gate backward's d_o, dg, dw have fast paths (16-byte accesses of 8 columns, each
// input read once; the RMSNorm × gate dw partials fused into the d_o, dg kernel) for the common
// shapes; the generic kernels serve the rest (see each launcher for the conditions).
#include <algorithm>
#include <cmath>
#include <string>

#include "ops/cuda/cuda_common.cuh"

namespace laplace {
namespace cuda {

constexpr int kWarpsPerBlock = 8;     // warp-per-row kernels: 256 threads, 8 rows per block
constexpr int kSegRows = 128;         // rows per partial segment in column reductions
constexpr int kMaxColOut = 8;         // outputs per column reduction (conv: K ≤ 8)

// A 1-D float vector (weights, biases), contiguous.
struct Vec {
  void* p = nullptr;
  int dt = kF32;
};

// A vector that DT = kBF16 instances take (dt_as in cuda_common.cuh): none, or BF16 and 16-byte aligned.
bool bf16_vec(const Vec& v) { return !v.p || (v.dt == kBF16 && aligned16(v.p)); }

Vec make_vec(const Tensor& t, int64_t n, const char* what) {
  Vec v;
  if (!t.defined()) return v;
  check_device(t, what);
  if (t.numel() != n || !t.is_contiguous())
    check_failed(__FILE__, __LINE__, what, ("expected a contiguous vector of " + std::to_string(n) +
                                            " elements, got " + t.shape_str()).c_str());
  v.p = t.data;
  v.dt = float_code(t, what);
  return v;
}

float* f32_vec(const Tensor& t, int64_t n, const char* what) {
  if (!t.defined()) return nullptr;
  check_device(t, what);
  if (t.dtype != DType::kF32 || t.numel() != n || !t.is_contiguous())
    check_failed(__FILE__, __LINE__, what, ("expected a contiguous F32 tensor of " + std::to_string(n) +
                                            " elements, got " + t.shape_str()).c_str());
  return static_cast<float*>(t.data);
}

const int32_t* i32_vec(const Tensor& t, int64_t n, const char* what) {
  if (!t.defined()) return nullptr;
  check_device(t, what);
  if (t.dtype != DType::kI32 || t.numel() != n || !t.is_contiguous())
    check_failed(__FILE__, __LINE__, what, ("expected a contiguous I32 tensor of " + std::to_string(n) +
                                            " elements, got " + t.shape_str()).c_str());
  return static_cast<const int32_t*>(t.data);
}

// ---- 16-byte vectors of 8 floats (the fast paths) -------------------------------------------
// ld8 / st8 / vec_rows live in cuda_common.cuh. These overloads take `vec`: when false (a
// tensor whose rows are not 16-byte aligned) they go element by element, same values and
// arithmetic.
namespace {

__device__ __forceinline__ void ld8(const void* p, int64_t i, int dt, bool vec, float (&v)[8]) {
  if (vec) {
    laplace::cuda::ld8(p, i, dt, v);  // the 4-argument one (cuda_common.cuh)
    return;
  }
#pragma unroll
  for (int k = 0; k < 8; ++k) v[k] = ldf(p, i + k, dt);
}

__device__ __forceinline__ void st8(void* p, int64_t i, int dt, bool vec, const float (&v)[8]) {
  if (vec) {
    laplace::cuda::st8(p, i, dt, v);
    return;
  }
#pragma unroll
  for (int k = 0; k < 8; ++k) stf(p, i + k, dt, v[k]);
}

// Launchers of kernels that address rows through RView::row32 check rows ≤ kRow32Max.
constexpr int64_t kRow32Max = 0x7fffffff;

}  // namespace

// ---- column reductions ------------------------------------------------------------------

// Where output q of a column reduction goes: element c at p[off + c·stride].
struct ColOut {
  void* p = nullptr;
  int dt = kF32;
  int64_t off = 0, stride = 1;
};
struct ColOuts {
  ColOut o[kMaxColOut];
};

// Pass 1. Block (32, 8) owns columns [32·bx, 32·bx+32) of segment `seg` = blockIdx.y, rows
// [seg·kSegRows, (seg+1)·kSegRows): thread (tx, ty) sums rows seg·R + ty + 8j in order, then
// the 8 row-lanes are summed in order ty = 0..7. f(r, c, out[nq]) gives the row's terms.
// partial [nq, nseg, cols] F32.
template <class F>
__global__ void colpartial_kernel(F f, int64_t rows, int64_t cols, int nq, float* partial) {
  __shared__ float sh[kMaxColOut][8][33];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t c = blockIdx.x * 32LL + tx;
  const int64_t seg = blockIdx.y, nseg = gridDim.y;
  const int64_t r0 = seg * kSegRows, r1 = min(rows, r0 + kSegRows);
  float acc[kMaxColOut];
#pragma unroll
  for (int q = 0; q < kMaxColOut; ++q) acc[q] = 0.f;
  if (c < cols) {
    for (int64_t r = r0 + ty; r < r1; r += 8) {
      float t[kMaxColOut];
      f(r, c, t);
#pragma unroll
      for (int q = 0; q < kMaxColOut; ++q)
        if (q < nq) acc[q] += t[q];
    }
  }
#pragma unroll
  for (int q = 0; q < kMaxColOut; ++q) sh[q][ty][tx] = acc[q];
  __syncthreads();
  if (ty == 0 && c < cols) {
    for (int q = 0; q < nq; ++q) {
      float s = 0.f;
#pragma unroll
      for (int k = 0; k < 8; ++k) s += sh[q][k][tx];
      partial[(q * nseg + seg) * cols + c] = s;
    }
  }
}

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

// Runs both passes; `partial` holds nq·nseg·cols floats (see colreduce_floats).
inline int64_t colreduce_nseg(int64_t rows) { return (rows + kSegRows - 1) / kSegRows; }
inline size_t colreduce_floats(int64_t rows, int64_t cols, int nq) {
  return static_cast<size_t>(nq) * static_cast<size_t>(colreduce_nseg(rows)) * static_cast<size_t>(cols);
}

template <class F>
void colreduce(F f, int64_t rows, int64_t cols, int nq, const ColOuts& outs, float* partial, cudaStream_t st) {
  if (rows == 0 || cols == 0) return;
  const int64_t nseg = colreduce_nseg(rows);
  LAPLACE_CHECK(nseg <= 65535, "column reduction: too many rows");
  dim3 grid(static_cast<unsigned>((cols + 31) / 32), static_cast<unsigned>(nseg));
  colpartial_kernel<F><<<grid, dim3(32, 8), 0, st>>>(f, rows, cols, nq, partial);
  CUDA_CHECK_LAUNCH();
  colsum_finalize(partial, nseg, cols, nq, outs, st);
}

ColOut col_out(const Tensor& t, int64_t off, int64_t stride, const char* what) {
  ColOut o;
  check_device(t, what);
  o.p = t.data;
  o.dt = float_code(t, what);
  o.off = off;
  o.stride = stride;
  return o;
}

// ---- embedding ----------------------------------------------------------------------------

// out[n, :] = table[ids[n], :]  (a zero row for ids outside [0, V)). One block per row.
// ids [N], table [V,D], out [N,D]
__global__ void embedding_fwd_kernel(const int32_t* ids, RView table, RView out) {
  const int64_t n = blockIdx.x;
  const int64_t D = out.cols;
  const int32_t id = ids[n];
  const bool ok = id >= 0 && id < table.rows;
  const int64_t ot = ok ? table.row(id) : 0, oo = out.row(n);
  for (int64_t c = threadIdx.x; c < D; c += blockDim.x)
    stf(out.p, oo + c, out.dt, ok ? ldf(table.p, ot + c, table.dt) : 0.f);
}

constexpr int kEmbParts = 64;    // vocabulary partitions: id & 63
constexpr int kEmbIdTile = 4096; // ids staged in shared memory per pass

// dtable[ids[n], c] += dout[n, c], without atomics and bitwise equal to the sequential loop:
// block (bx, p) owns columns [256·bx, 256·bx+256) of the rows with id % 64 == p; each thread
// walks all tokens in order and adds the ones of its partition, so every table element
// receives its terms in token order. ids [N]; dout [N,D]; dtable [V,D]
__global__ void embedding_bwd_kernel(const int32_t* ids, int64_t N, RView dout, RView dtab) {
  __shared__ int32_t sid[kEmbIdTile];
  const int64_t c = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  const int part = blockIdx.y;
  const int64_t V = dtab.rows, D = dtab.cols;
  for (int64_t n0 = 0; n0 < N; n0 += kEmbIdTile) {
    const int cnt = static_cast<int>(min(static_cast<int64_t>(kEmbIdTile), N - n0));
    __syncthreads();
    for (int i = threadIdx.x; i < cnt; i += blockDim.x) sid[i] = ids[n0 + i];
    __syncthreads();
    if (c >= D) continue;
    for (int i = 0; i < cnt; ++i) {
      const int32_t id = sid[i];
      if ((id & (kEmbParts - 1)) != part || id < 0 || id >= V) continue;
      const int64_t o = dtab.row(id) + c;
      stf(dtab.p, o, dtab.dt, ldf(dtab.p, o, dtab.dt) + ldf(dout.p, dout.row(n0 + i) + c, dout.dt));
    }
  }
}

}  // namespace cuda

using namespace cuda;

void CudaBackend::embedding_forward(const Tensor& ids, const Tensor& table, Tensor out) {
  RView vt = make_rview(table, "embedding: table"), vo = make_rview(out, "embedding: out");
  const int32_t* pid = i32_vec(ids, vo.rows, "embedding: ids must be I32 [N]");
  LAPLACE_CHECK(vt.cols == vo.cols, "embedding_forward: table and out widths differ");
  if (vo.rows == 0) return;
  LAPLACE_CHECK(vo.rows <= 0x7fffffff, "embedding_forward: too many rows");
  embedding_fwd_kernel<<<static_cast<unsigned>(vo.rows), 256, 0, stream_>>>(pid, vt, vo);
  CUDA_CHECK_LAUNCH();
}

void CudaBackend::embedding_backward(const Tensor& ids, const Tensor& dout, Tensor dtable) {
  RView vd = make_rview(dout, "embedding: dout"), vt = make_rview(dtable, "embedding: dtable");
  const int32_t* pid = i32_vec(ids, vd.rows, "embedding: ids must be I32 [N]");
  LAPLACE_CHECK(vt.cols == vd.cols, "embedding_backward: dtable and dout widths differ");
  if (vd.rows == 0 || vd.cols == 0) return;
  dim3 grid(static_cast<unsigned>((vd.cols + 255) / 256), kEmbParts);
  embedding_bwd_kernel<<<grid, 256, 0, stream_>>>(pid, vd.rows, vd, vt);
  CUDA_CHECK_LAUNCH();
}

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
// x, y [N,D]; w, b [D]; mean, rstd [N]
template <int NV, int XDT, int PDT>
__global__ void __launch_bounds__(32 * kLnWarps)
    layernorm_fwd_vec_kernel(RView x, Vec w, Vec b, float eps, RView y, float* mean, float* rstd, int vec) {
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
  if (y.p) {
    const int64_t oy = y.row(row);
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
      st8(y.p, oy + 8 * q, dt_as<PDT>(y.dt), vec_as<PDT>(vec & kLnVecY), o);
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

// The warp-per-row forward for nv chunks of 256 columns a lane; the lanes' extra chunks are masked.
template <int XDT>
void layernorm_vec_dispatch(int64_t nv, const RView& x, const Vec& w, const Vec& b, float eps, const RView& y,
                            float* mean, float* rstd, int vec, cudaStream_t st) {
  if (nv <= 1) layernorm_vec_launch<1, XDT>(x, w, b, eps, y, mean, rstd, vec, st);
  else if (nv <= 2) layernorm_vec_launch<2, XDT>(x, w, b, eps, y, mean, rstd, vec, st);
  else if (nv <= 3) layernorm_vec_launch<3, XDT>(x, w, b, eps, y, mean, rstd, vec, st);
  else if (nv <= 4) layernorm_vec_launch<4, XDT>(x, w, b, eps, y, mean, rstd, vec, st);
  else if (nv <= 6) layernorm_vec_launch<6, XDT>(x, w, b, eps, y, mean, rstd, vec, st);
  else if (nv <= 8) layernorm_vec_launch<8, XDT>(x, w, b, eps, y, mean, rstd, vec, st);
  else if (nv <= 12) layernorm_vec_launch<12, XDT>(x, w, b, eps, y, mean, rstd, vec, st);
  else layernorm_vec_launch<16, XDT>(x, w, b, eps, y, mean, rstd, vec, st);
}

// ---- LayerNorm, one block per row (wide rows) ----
// For D > 256·kLnRowMinVec the warp-per-row kernels above hold 8·NV values a lane (NV = 12 at
// D = 3072: 128 registers forward, 254 for dx), which leaves an SM 2–4 blocks of 4 warps and
// the dx kernel's accumulate loads after both reductions. Here one block of ⌈D/8⌉ threads
// (rounded to whole warps) owns a row, each thread one 8-column chunk in registers (~48 registers),
// all loads issued before the first barrier (lab/norm v2). Sums over the block: each warp's
// butterfly, then the warps' partials in warp order, read by every thread in the same order
// (deterministic; another order than the warp-per-row kernels, so bits differ from theirs).
// Wide rows take this dx kernel. For the forward it pays only against a warp-per-row kernel
// that reads dtypes at run time (see dt_as in cuda_common.cuh): with x's dtype fixed, BF16
// rows take the warp-per-row forward (launch_layernorm_fwd; BENCHMARKS.md's History).
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
    // The forward's instances; the lanes' extra chunks are masked.
    if (nv <= 1) layernorm_bwd_dx_vec_launch<1>(dy, x, w, mean, rstd, dx, accumulate, st);
    else if (nv <= 2) layernorm_bwd_dx_vec_launch<2>(dy, x, w, mean, rstd, dx, accumulate, st);
    else if (nv <= 3) layernorm_bwd_dx_vec_launch<3>(dy, x, w, mean, rstd, dx, accumulate, st);
    else if (nv <= 4) layernorm_bwd_dx_vec_launch<4>(dy, x, w, mean, rstd, dx, accumulate, st);
    else if (nv <= 6) layernorm_bwd_dx_vec_launch<6>(dy, x, w, mean, rstd, dx, accumulate, st);
    else if (nv <= 8) layernorm_bwd_dx_vec_launch<8>(dy, x, w, mean, rstd, dx, accumulate, st);
    else if (nv <= 12) layernorm_bwd_dx_vec_launch<12>(dy, x, w, mean, rstd, dx, accumulate, st);
    else layernorm_bwd_dx_vec_launch<16>(dy, x, w, mean, rstd, dx, accumulate, st);
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
};

// u_s of sequence b at channel d for s ∈ [−K, T): the window supplies s < 0 (win[K+s]).
__device__ __forceinline__ float conv_input(const ConvArgs& a, int64_t b, int64_t r_of_t0, int64_t s, int64_t d) {
  if (s >= 0) return ldf(a.u.p, a.u.row(r_of_t0 + s) + d, a.u.dt);
  if (!a.win.p) return 0.f;
  const int64_t slot = a.slots ? a.slots[b] : b;
  return ldf(a.win.p, slot * a.win.s0 + (a.K + s) * a.win.s1 + d, a.win.dt);
}

// pre_t = Σ_j w[d,j]·u_{t−K+1+j}
__device__ __forceinline__ float conv_pre(const ConvArgs& a, int64_t r, int64_t d) {
  const int64_t b = r / a.T, t = r - b * a.T, r0 = b * a.T;
  const int64_t ow = a.w.row(d);
  float acc = 0.f;
  for (int j = 0; j < a.K; ++j) acc += ldf(a.w.p, ow + j, a.w.dt) * conv_input(a, b, r0, t - a.K + 1 + j, d);
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

// win_out[slot(b), j, d] = u_{T−K+j} (from win_in when T−K+j < 0). One thread per (b, d); all K
// values are read before any is written, so win_out may alias win_in.
__global__ void conv_window_kernel(ConvArgs a, WView wout) {
  const int64_t n = a.B * a.D;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t b = i / a.D, d = i - b * a.D;
    float vals[kMaxConvK];
#pragma unroll
    for (int j = 0; j < kMaxConvK; ++j)
      vals[j] = j < a.K ? conv_input(a, b, b * a.T, a.T - a.K + j, d) : 0.f;
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

// du_t = Σ_j w[d,j] · dpre_{t+K−1−j}  (terms with t+K−1−j ≥ T vanish). du [B,T,D]
__global__ void conv_bwd_du_kernel(ConvArgs a, RView dc, RView pre, RView du) {
  const int64_t n = a.B * a.T * a.D;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t r = i / a.D, d = i - r * a.D;
    const int64_t t = r % a.T;
    const int64_t ow = a.w.row(d);
    float acc = 0.f;
    for (int j = 0; j < a.K; ++j) {
      const int64_t s = t + a.K - 1 - j;
      if (s < a.T) acc += ldf(a.w.p, ow + j, a.w.dt) * conv_dpre(a, dc, pre, r + (a.K - 1 - j), d);
    }
    stf(du.p, du.row(r) + d, du.dt, acc);
  }
}

// Column terms: dw[d, j] += dpre_t[d] · u_{t−K+1+j}[d]  (zero initial window).
struct ConvDwTerms {
  ConvArgs a;
  RView dc, pre;
  __device__ void operator()(int64_t r, int64_t d, float* t) const {
    const float dp = conv_dpre(a, dc, pre, r, d);
    const int64_t b = r / a.T, tt = r - b * a.T, r0 = b * a.T;
#pragma unroll
    for (int j = 0; j < kMaxConvK; ++j) t[j] = j < a.K ? dp * conv_input(a, b, r0, tt - a.K + 1 + j, d) : 0.f;
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
template <int K, int DT>
__global__ void __launch_bounds__(kConvThreads, K <= 4 ? 4 : 2) conv_prefill_vec_kernel(ConvVecArgs a) {
  const int i = blockIdx.x * kConvThreads + threadIdx.x;
  if (i >= a.B * a.ntile * a.nq) return;
  const int rest = i / a.nq, qd = i - rest * a.nq;
  const int b = rest / a.ntile, tile = rest - b * a.ntile;
  const int d0 = 8 * qd, t0 = tile * kConvTile, t1 = min(a.T, t0 + kConvTile);
  float wf[8][K];
  load_conv_w<K, DT>(a.w, a.wvec, d0, wf);
  // e[j] = u_{t−K+1+j} for the step at t: e[0..K−2] the K−1 inputs before t, then the step's.
  float e[K - 1 + kConvStep][8];
#pragma unroll
  for (int j = 0; j + 1 < K; ++j) {
    const int s = t0 - (K - 1) + j;
    if (s >= 0) {
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
  for (int t = t0; t < t1; t += kConvStep) {
    if (t + kConvStep <= t1) {  // a whole step: the loads unconditional, so all are in flight at once
#pragma unroll
      for (int s = 0; s < kConvStep; ++s) ld8(a.u.p, ou + s * a.u.st, dt_as<DT>(a.u.dt), true, e[K - 1 + s]);
#pragma unroll
      for (int s = 0; s < kConvStep; ++s) conv_out8<K, DT>(a, wf, e + s, oc + s * a.c.st, op + s * a.pre.st);
    } else {
#pragma unroll
      for (int s = 0; s < kConvStep; ++s)
        if (t + s < t1) ld8(a.u.p, ou + s * a.u.st, dt_as<DT>(a.u.dt), true, e[K - 1 + s]);
#pragma unroll
      for (int s = 0; s < kConvStep; ++s)
        if (t + s < t1) conv_out8<K, DT>(a, wf, e + s, oc + s * a.c.st, op + s * a.pre.st);
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

// win_out[slot(b), j] = u_{T−K+j} (from win_in when T−K+j < 0): conv_window_kernel with 8
// channels per thread; all K entries are read before any is written (win_out may alias win_in).
template <int K>
__global__ void __launch_bounds__(kConvThreads) conv_window_vec_kernel(ConvVecArgs a) {
  const int i = blockIdx.x * kConvThreads + threadIdx.x;
  if (i >= a.B * a.nq) return;
  const int b = i / a.nq, d0 = 8 * (i - b * a.nq);
  const int64_t slot = a.slots ? a.slots[b] : b;
  float e[K][8];
#pragma unroll
  for (int j = 0; j < K; ++j) {
    const int s = a.T - K + j;
    if (s >= 0) {
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
  if (a.u.dt == kBF16 && a.c.dt == kBF16 && (!a.pre.p || a.pre.dt == kBF16) && a.w.dt == kBF16 && a.wvec)
    conv_prefill_vec_kernel<K, kBF16><<<grid, kConvThreads, 0, st>>>(a);
  else
    conv_prefill_vec_kernel<K, kDtAny><<<grid, kConvThreads, 0, st>>>(a);
  CUDA_CHECK_LAUNCH();
  if (a.wout.p) {
    conv_window_vec_kernel<K><<<blocks(static_cast<int64_t>(a.B) * a.nq), kConvThreads, 0, st>>>(a);
    CUDA_CHECK_LAUNCH();
  }
}

// The fast path of conv_silu_forward when the arguments allow it (see above); false, having
// queued nothing, otherwise. B, T ≥ 1 here.
bool conv_forward_vec(const ConvArgs& g, const WView& wout, const Tensor& u, const Tensor& c, const Tensor& pre,
                      const Tensor& win_in, const Tensor& win_out, cudaStream_t st) {
  if (g.D % 8 != 0 || g.B < 1 || g.T < 1) return false;
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

template <int K, int DT>
__global__ void __launch_bounds__(kConvThreads) conv_bwd_vec_kernel(ConvBwdVecArgs a) {
  const int i = blockIdx.x * kConvThreads + threadIdx.x;
  if (i >= a.B * a.nseg * a.nq) return;
  const int rest = i / a.nq, qd = i - rest * a.nq;
  const int b = rest / a.nseg, seg = rest - b * a.nseg;
  const int d0 = 8 * qd, t0 = seg * kConvBwdSeg, t1 = min(a.T, t0 + kConvBwdSeg);
  float wf[8][K];
  load_conv_w<K, DT>(a.w, a.wvec, d0, wf);
  float dp[K][8];  // dp[i] = dpre_{t+i} at the step for t (zero beyond T)
  float ue[K][8];  // ue[j] = u_{t−K+1+j} (zero before 0)
#pragma unroll
  for (int j = 1; j < K; ++j) {
    conv_dpre8<DT>(a, b, t0 + j - 1, d0, dp[j]);
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
    for (int j = 0; j + 1 < K; ++j)
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        dp[j][k] = dp[j + 1][k];
        ue[j][k] = ue[j + 1][k];
      }
    conv_dpre8<DT>(a, b, t + K - 1, d0, dp[K - 1]);
    ld8(a.u.p, b * a.u.sb + t * a.u.st + d0, dt_as<DT>(a.u.dt), true, ue[K - 1]);
    if (a.du.p) {
      float duv[8];
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        float s = 0.f;
#pragma unroll
        for (int j = 0; j < K; ++j)
          if (t + K - 1 - j < a.T) s += wf[k][j] * dp[K - 1 - j][k];
        duv[k] = s;
      }
      st8(a.du.p, b * a.du.sb + t * a.du.st + d0, dt_as<DT>(a.du.dt), true, duv);
    }
#pragma unroll
    for (int j = 0; j < K; ++j)
#pragma unroll
      for (int k = 0; k < 8; ++k) acc[j][k] += dp[0][k] * ue[j][k];
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
  if (bf16) conv_bwd_vec_kernel<K, kBF16><<<blocks, kConvThreads, 0, st>>>(a);
  else conv_bwd_vec_kernel<K, kDtAny><<<blocks, kConvThreads, 0, st>>>(a);
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
                                    Tensor win_out, const Tensor& slots) {
  ConvArgs a = conv_args(u, w, "conv_silu_forward: u");
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
                                     Tensor dw) {
  ConvArgs a = conv_args(u, w, "conv_silu_backward: u");
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

// ---- cross-entropy -------------------------------------------------------------------------------

namespace cuda {

constexpr int kCeThreads = 1024;        // generic kernels: one block per row
constexpr int kCeVecThreads = 512;      // fast forward and two-pass backward: 2 blocks per SM at ≤ 64 registers
constexpr int kCeStashThreads = 1024;   // fast backward with the row in shared memory: one block per SM
constexpr int kCeUnroll = 4;            // 8-column chunks a thread loads before it uses them (loads in flight)
constexpr float kCeLog2e = 1.4426950408889634f;

// Online softmax statistics of one row, in a fixed order: each thread scans its elements
// c = tid, tid + blockDim, ... keeping (m, s) with s = Σ exp(x − m); then a fixed tree
// combines (m1,s1)⊕(m2,s2) = (M, s1·e^{m1−M} + s2·e^{m2−M}), M = max(m1, m2).
__device__ __forceinline__ void ms_combine(float& m, float& s, float m2, float s2) {
  const float M = fmaxf(m, m2);
  const float a = (m == -INFINITY) ? 0.f : s * expf(m - M);
  const float b = (m2 == -INFINITY) ? 0.f : s2 * expf(m2 - M);
  m = M;
  s = a + b;
}

// The block's (m, s) from every thread's: warp trees (shfl_down: lane 0 ends with the warp's
// result), then warp 0 combines the warps in order. Every thread returns the row's values.
__device__ __forceinline__ void block_ms_combine(float& m, float& s) {
  __shared__ float shm[32], shs[32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_down_sync(0xffffffffu, m, o), s2 = __shfl_down_sync(0xffffffffu, s, o);
    ms_combine(m, s, m2, s2);
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
  if (lane == 0) {
    shm[warp] = m;
    shs[warp] = s;
  }
  __syncthreads();
  if (warp == 0) {
    m = lane < nw ? shm[lane] : -INFINITY;
    s = lane < nw ? shs[lane] : 0.f;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float m2 = __shfl_down_sync(0xffffffffu, m, o), s2 = __shfl_down_sync(0xffffffffu, s, o);
      ms_combine(m, s, m2, s2);
    }
    if (lane == 0) {
      shm[0] = m;
      shs[0] = s;
    }
  }
  __syncthreads();
  m = shm[0];
  s = shs[0];
}

__device__ void row_softmax_stats(const RView& x, int64_t row, float* m_out, float* s_out) {
  const int64_t V = x.cols, ox = x.row(row);
  float m = -INFINITY, s = 0.f;
  for (int64_t c = threadIdx.x; c < V; c += blockDim.x) {
    const float v = ldf(x.p, ox + c, x.dt);
    if (v > m) {
      s = s * expf(m - v) + 1.0f;  // expf(−inf) = 0 on the first element
      m = v;
    } else {
      s += expf(v - m);
    }
  }
  block_ms_combine(m, s);
  *m_out = m;
  *s_out = s;
}

// losses[n] = m + log(s) − logits[n, target]  (0 when target < 0, NaN when target ≥ V).
// One block per row. logits [N,V]; targets [N]; losses [N]
__global__ void ce_fwd_kernel(RView x, const int32_t* targets, float* losses) {
  const int64_t row = blockIdx.x;
  const int32_t t = targets[row];
  if (t < 0) {
    if (threadIdx.x == 0) losses[row] = 0.f;
    return;
  }
  float m, s;
  row_softmax_stats(x, row, &m, &s);
  if (threadIdx.x == 0)
    losses[row] = t < x.cols ? m + logf(s) - ldf(x.p, x.row(row) + t, x.dt) : NAN;
}

// dlogits = scale·(exp(x − m)/s − onehot(target)); zero rows for target < 0. The statistics
// are complete before any element is written, and each element is read then written by the
// same thread, so dlogits may alias logits.
__global__ void ce_bwd_kernel(RView x, const int32_t* targets, float scale, RView dx) {
  const int64_t row = blockIdx.x;
  const int32_t t = targets[row];
  const int64_t V = x.cols, od = dx.row(row);
  if (t < 0) {
    for (int64_t c = threadIdx.x; c < V; c += blockDim.x) stf(dx.p, od + c, dx.dt, 0.f);
    return;
  }
  float m, s;
  row_softmax_stats(x, row, &m, &s);
  const float inv_s = 1.0f / s;
  const int64_t ox = x.row(row);
  for (int64_t c = threadIdx.x; c < V; c += blockDim.x) {
    const float p = expf(ldf(x.p, ox + c, x.dt) - m) * inv_s;
    stf(dx.p, od + c, dx.dt, scale * (p - (c == t ? 1.0f : 0.0f)));
  }
}

// ---- fast paths: V % 8 == 0, rows 16-byte aligned (ld8 / st8) ----
// A thread owns the 8-column chunks q = tid + i·blockDim. It loads kCeUnroll of them before
// it uses any (the generic kernels have one 2-byte load in flight per thread), takes their max
// first and folds them into its (m, s) with one rescale of s, with no data-dependent branch.
// The exponentials are 2^(x·log2e − m·log2e) on the SFU (ex2.approx, relative error ~2^-22,
// one FFMA + one MUFU per element instead of expf's ~10 instructions: at HBM bandwidth the
// generic arithmetic takes about as long as the loads). The threads' (m, s) are combined by the generic
// kernels' fixed tree, so the order depends only on V and the block size; results agree with
// the generic kernels to rounding, not bitwise.

// 2^x; −inf gives 0, results below 2^-126 flush to 0 (terms that small vanish in s ≥ 1).
__device__ __forceinline__ float ce_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// (m, s) of the row at element offset ox of x (nq chunks); every thread returns the row's
// values. With `stash` (shared memory, the row in x's dtype) each chunk is also copied
// there, so the caller reads the row from global memory once.
__device__ __forceinline__ void row_softmax_stats_vec(const RView& x, int64_t ox, int nq, void* stash, float& m,
                                                      float& s) {
  m = -INFINITY;
  s = 0.f;
  for (int q0 = threadIdx.x; q0 < nq; q0 += kCeUnroll * blockDim.x) {
    float v[kCeUnroll][8];
#pragma unroll
    for (int u = 0; u < kCeUnroll; ++u) {
      const int q = q0 + u * blockDim.x;
      if (q < nq) {
        ld8(x.p, ox + 8LL * q, x.dt, v[u]);
        if (stash) st8(stash, 8LL * q, x.dt, v[u]);  // exact: the values came from x's dtype
      } else {
#pragma unroll
        for (int k = 0; k < 8; ++k) v[u][k] = -INFINITY;  // contributes 0
      }
    }
    float M = m;
#pragma unroll
    for (int u = 0; u < kCeUnroll; ++u)
#pragma unroll
      for (int k = 0; k < 8; ++k) M = fmaxf(M, v[u][k]);
    // All −inf so far: shift by 0 instead (−inf − −inf would be NaN); every term is then 0.
    const float ML = (M == -INFINITY ? 0.f : M) * kCeLog2e;
    float acc = s * ce_exp2(fmaf(m, kCeLog2e, -ML));  // rescale the running sum once per step
#pragma unroll
    for (int u = 0; u < kCeUnroll; ++u)
#pragma unroll
      for (int k = 0; k < 8; ++k) acc += ce_exp2(fmaf(v[u][k], kCeLog2e, -ML));
    m = M;
    s = acc;
  }
  block_ms_combine(m, s);
}

// ce_fwd_kernel's losses. One block of kCeVecThreads per row.
__global__ void __launch_bounds__(kCeVecThreads) ce_fwd_vec_kernel(RView x, const int32_t* targets, float* losses) {
  const int64_t row = blockIdx.x;
  const int32_t t = targets[row];
  if (t < 0) {
    if (threadIdx.x == 0) losses[row] = 0.f;
    return;
  }
  const int64_t ox = x.row(row);
  float m, s;
  row_softmax_stats_vec(x, ox, static_cast<int>(x.cols >> 3), nullptr, m, s);
  if (threadIdx.x == 0) losses[row] = t < x.cols ? m + logf(s) - ldf(x.p, ox + t, x.dt) : NAN;
}

// ce_bwd_kernel's dlogits. kStash: the statistics pass copies the row to shared memory
// (dynamic, V elements of x's dtype) and the second pass reads it from there, so the row
// crosses global memory once each way; otherwise the second pass reads x again. Each
// thread's second pass loads kCeUnroll of its own chunks, then stores them: dlogits may alias
// logits (the block's barrier in the statistics orders every read of the first pass before
// any store).
template <bool kStash>
__global__ void __launch_bounds__(kStash ? kCeStashThreads : kCeVecThreads)
    ce_bwd_vec_kernel(RView x, const int32_t* targets, float scale, RView dx) {
  extern __shared__ uint4 ce_stash[];
  const int64_t row = blockIdx.x;
  const int32_t t = targets[row];
  const int nq = static_cast<int>(x.cols >> 3);
  const int64_t od = dx.row(row);
  if (t < 0) {
    const float z[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int q = threadIdx.x; q < nq; q += blockDim.x) st8(dx.p, od + 8LL * q, dx.dt, z);
    return;
  }
  const int64_t ox = x.row(row);
  float m, s;
  row_softmax_stats_vec(x, ox, nq, kStash ? ce_stash : nullptr, m, s);
  const float ML = m * kCeLog2e, inv_s = 1.0f / s;
  const void* src = kStash ? static_cast<const void*>(ce_stash) : x.p;
  const int64_t os = kStash ? 0 : ox;
  for (int q0 = threadIdx.x; q0 < nq; q0 += kCeUnroll * blockDim.x) {
    float v[kCeUnroll][8];
#pragma unroll
    for (int u = 0; u < kCeUnroll; ++u) {
      const int q = q0 + u * blockDim.x;
      if (q < nq) ld8(src, os + 8LL * q, x.dt, v[u]);
    }
#pragma unroll
    for (int u = 0; u < kCeUnroll; ++u) {
      const int q = q0 + u * blockDim.x;
      if (q >= nq) continue;
      float o[8];
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const float p = ce_exp2(fmaf(v[u][k], kCeLog2e, -ML)) * inv_s;
        o[k] = scale * (p - (8 * q + k == t ? 1.0f : 0.0f));
      }
      st8(dx.p, od + 8LL * q, dx.dt, o);
    }
  }
}

// Whether the fast kernels apply: V % 8 == 0, every row 16-byte aligned, and fewer than 2^30
// chunks (the chunk index and its stride steps stay in an int).
constexpr int64_t kCeMaxChunks = int64_t{1} << 30;
bool ce_vec_ok(const RView& v) { return v.cols > 0 && v.cols % 8 == 0 && v.cols / 8 < kCeMaxChunks && vec_rows(v); }

}  // namespace cuda

void CudaBackend::cross_entropy_forward(const Tensor& logits, const Tensor& targets, Tensor losses) {
  RView vx = make_rview(logits, "cross_entropy: logits");
  const int32_t* pt = i32_vec(targets, vx.rows, "cross_entropy: targets must be I32 [N]");
  float* pl = f32_vec(losses, vx.rows, "cross_entropy: losses must be F32 [N]");
  LAPLACE_CHECK(pl != nullptr, "cross_entropy_forward: losses is required");
  if (vx.rows == 0) return;
  LAPLACE_CHECK(vx.rows <= 0x7fffffff, "cross_entropy: too many rows");
  const unsigned grid = static_cast<unsigned>(vx.rows);
  if (ce_vec_ok(vx)) ce_fwd_vec_kernel<<<grid, kCeVecThreads, 0, stream_>>>(vx, pt, pl);
  else ce_fwd_kernel<<<grid, kCeThreads, 0, stream_>>>(vx, pt, pl);
  CUDA_CHECK_LAUNCH();
}

// The fast kernels need logits and dlogits both vectorisable; the row goes through shared
// memory when it fits (BF16 up to V ≈ 116k on an H200, F32 up to ≈ 58k), which depends only
// on V, the dtype and the device, so a given shape always takes the same kernel.
void CudaBackend::cross_entropy_backward(const Tensor& logits, const Tensor& targets, double scale, Tensor dlogits) {
  RView vx = make_rview(logits, "cross_entropy: logits"), vd = make_rview(dlogits, "cross_entropy: dlogits");
  LAPLACE_CHECK(vd.rows == vx.rows && vd.cols == vx.cols, "cross_entropy_backward: dlogits shape differs");
  const int32_t* pt = i32_vec(targets, vx.rows, "cross_entropy: targets must be I32 [N]");
  if (vx.rows == 0) return;
  LAPLACE_CHECK(vx.rows <= 0x7fffffff, "cross_entropy: too many rows");
  const unsigned grid = static_cast<unsigned>(vx.rows);
  const float sc = static_cast<float>(scale);
  if (ce_vec_ok(vx) && ce_vec_ok(vd)) {
    const size_t stash = static_cast<size_t>(vx.cols) * (vx.dt == kBF16 ? 2 : 4);
    constexpr size_t kStaticSmem = 2 * 32 * sizeof(float);  // block_ms_combine's arrays
    if (stash + kStaticSmem <= static_cast<size_t>(max_smem_optin())) {
      kernel_smem(ce_bwd_vec_kernel<true>, stash);
      ce_bwd_vec_kernel<true><<<grid, kCeStashThreads, stash, stream_>>>(vx, pt, sc, vd);
    } else {
      ce_bwd_vec_kernel<false><<<grid, kCeVecThreads, 0, stream_>>>(vx, pt, sc, vd);
    }
  } else {
    ce_bwd_kernel<<<grid, kCeThreads, 0, stream_>>>(vx, pt, sc, vd);
  }
  CUDA_CHECK_LAUNCH();
}

}  // namespace laplace
