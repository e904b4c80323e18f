// Element-wise CUDA ops: view builders, dtype-converting copy, fill, axpy, scale,
// sum_squares, AdamW, Muon momentum/apply, SwiGLU. All memory-bound, grid-stride loops.
#include <cmath>
#include <cstring>

#include "ops/cuda/cuda_common.cuh"
#include "core/rng.h"

namespace laplace {
namespace cuda {

// ---- views ------------------------------------------------------------------------------

EView make_eview(const Tensor& t, const char* what) {
  EView v;
  if (!t.defined()) return v;
  check_device(t, what);
  v.p = t.data;
  v.dt = float_code(t, what);
  int nd = 0;
  for (int i = 0; i < t.ndim; ++i) {
    if (t.shape[i] == 1) continue;
    if (nd > 0 && v.stride[nd - 1] == t.stride[i] * t.shape[i]) {  // merge with the previous dim
      v.shape[nd - 1] *= t.shape[i];
      v.stride[nd - 1] = t.stride[i];
    } else {
      v.shape[nd] = t.shape[i];
      v.stride[nd] = t.stride[i];
      ++nd;
    }
  }
  if (nd == 0) {
    v.shape[0] = 1;
    v.stride[0] = 1;
    nd = 1;
  }
  v.nd = nd;
  return v;
}

RView make_rview(const Tensor& t, const char* what) {
  RView v;
  if (!t.defined()) return v;
  check_device(t, what);
  LAPLACE_CHECK(t.ndim >= 1, what);
  v.p = t.data;
  v.dt = (t.dtype == DType::kF32 || t.dtype == DType::kBF16) ? float_code(t, what) : kF32;
  const int n = t.ndim;
  v.cols = t.shape[n - 1];
  if (v.cols > 1 && t.stride[n - 1] != 1)
    check_failed(__FILE__, __LINE__, what, ("the innermost dim must be contiguous: " + t.shape_str()).c_str());
  int64_t shp[3], str[3];
  int m = 0;
  for (int i = 0; i < n - 1; ++i) {
    if (t.shape[i] == 1) continue;
    if (m > 0 && str[m - 1] == t.stride[i] * t.shape[i]) {
      shp[m - 1] *= t.shape[i];
      str[m - 1] = t.stride[i];
    } else {
      shp[m] = t.shape[i];
      str[m] = t.stride[i];
      ++m;
    }
  }
  v.rows = 1;
  for (int i = 0; i < n - 1; ++i) v.rows *= t.shape[i];
  if (m == 0) {
    v.s0 = v.cols;
  } else if (m == 1) {
    v.s0 = str[0];
  } else if (m == 2) {  // [d0, 1, d2]
    v.s0 = str[0];
    v.d2 = shp[1];
    v.s2 = str[1];
  } else {
    v.s0 = str[0];
    v.d1 = shp[1];
    v.s1 = str[1];
    v.d2 = shp[2];
    v.s2 = str[2];
  }
  return v;
}

// ---- probe ----------------------------------------------------------------------------

__global__ void probe_kernel(int* p) {
  if (p) *p = 1;
}

cudaError_t probe_kernel_image() {
  cudaFuncAttributes attr;
  return cudaFuncGetAttributes(&attr, probe_kernel);
}

// ---- copy with conversion -------------------------------------------------------------

// dst[i] = src[i], F32/BF16 on either side (one rounding when narrowing).
__global__ void convert_kernel(EView dst, EView src, int64_t n) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    stf(dst.p, dst.off(i), dst.dt, ldf(src.p, src.off(i), src.dt));
}

void convert_copy(Tensor dst, const Tensor& src, cudaStream_t stream) {
  EView d = make_eview(dst, "copy: dst");
  EView s = make_eview(src, "copy: src");
  const int64_t n = dst.numel();
  if (n == 0) return;
  convert_kernel<<<grid_for(n, 256), 256, 0, stream>>>(d, s, n);
  CUDA_CHECK_LAUNCH();
}

// ---- fill / axpy / scale ----------------------------------------------------------------

// dst[i] = value, for F32/BF16 (dt 0/1), F64 (2), I32 (3).
__global__ void fill_kernel(EView dst, int64_t n, int kind, double value) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t o = dst.off(i);
    if (kind == 2) static_cast<double*>(dst.p)[o] = value;
    else if (kind == 3) static_cast<int32_t*>(dst.p)[o] = static_cast<int32_t>(value);
    else stf(dst.p, o, kind, static_cast<float>(value));
  }
}

// y[i] += alpha · x[i]   (F32 math)
__global__ void axpy_kernel(float alpha, EView x, EView y, int64_t n) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t oy = y.off(i);
    stf(y.p, oy, y.dt, ldf(y.p, oy, y.dt) + alpha * ldf(x.p, x.off(i), x.dt));
  }
}

// x[i] *= alpha
__global__ void scale_kernel(EView x, float alpha, int64_t n) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t o = x.off(i);
    stf(x.p, o, x.dt, ldf(x.p, o, x.dt) * alpha);
  }
}

}  // namespace cuda

using namespace cuda;

void CudaBackend::fill(Tensor dst, double value) {
  check_device(dst, "fill");
  if (!dst.defined() || dst.numel() == 0) return;
  int kind;
  EView v;
  if (dst.dtype == DType::kF64 || dst.dtype == DType::kI32) {
    Tensor tmp = dst;
    tmp.dtype = DType::kF32;  // only for the view's geometry
    v = make_eview(tmp, "fill");
    kind = dst.dtype == DType::kF64 ? 2 : 3;
  } else {
    v = make_eview(dst, "fill: dtype must be F32, BF16, F64 or I32");
    kind = v.dt;
  }
  const int64_t n = dst.numel();
  fill_kernel<<<grid_for(n, 256), 256, 0, stream_>>>(v, n, kind, value);
  CUDA_CHECK_LAUNCH();
}

void CudaBackend::axpy(double alpha, const Tensor& x, Tensor y) {
  LAPLACE_CHECK(same_shape(x, y), "axpy: shapes differ");
  EView vx = make_eview(x, "axpy: x"), vy = make_eview(y, "axpy: y");
  const int64_t n = y.numel();
  if (n == 0) return;
  axpy_kernel<<<grid_for(n, 256), 256, 0, stream_>>>(static_cast<float>(alpha), vx, vy, n);
  CUDA_CHECK_LAUNCH();
}

void CudaBackend::scale(Tensor x, double alpha) {
  EView vx = make_eview(x, "scale: x");
  const int64_t n = x.numel();
  if (n == 0) return;
  scale_kernel<<<grid_for(n, 256), 256, 0, stream_>>>(vx, static_cast<float>(alpha), n);
  CUDA_CHECK_LAUNCH();
}

// ---- sum of squares -------------------------------------------------------------------------

namespace cuda {

constexpr int kSsqThreads = 256;
constexpr int kSsqMaxBlocks = 1024;

// Pass 1: block b sums x[i]² (in F64) over i = b·256 + t + k·(grid·256), then a fixed tree.
// partial [grid] F64.
__global__ void ssq_partial_kernel(EView x, int64_t n, double* partial) {
  __shared__ double sh[32];
  double acc = 0;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const double v = ldf(x.p, x.off(i), x.dt);
    acc += v * v;
  }
  acc = block_sum(acc, sh);
  if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

// Pass 2: one block sums the partials [np] in a fixed order; out [1] F64.
__global__ void ssq_final_kernel(const double* partial, int np, double* out) {
  __shared__ double sh[32];
  double acc = 0;
  for (int i = threadIdx.x; i < np; i += blockDim.x) acc += partial[i];
  acc = block_sum(acc, sh);
  if (threadIdx.x == 0) *out = acc;
}

}  // namespace cuda

double CudaBackend::sum_squares(const Tensor& x) {
  EView vx = make_eview(x, "sum_squares: x");
  const int64_t n = x.numel();
  if (n == 0) return 0.0;
  // The grid depends on n only, so the summation order is fixed for a given size.
  int64_t g = (n + kSsqThreads * 16 - 1) / (kSsqThreads * 16);
  if (g > kSsqMaxBlocks) g = kSsqMaxBlocks;
  double* partial = static_cast<double*>(scratch((g + 1) * sizeof(double)));  // [g] + result
  ssq_partial_kernel<<<static_cast<unsigned>(g), kSsqThreads, 0, stream_>>>(vx, n, partial);
  CUDA_CHECK_LAUNCH();
  ssq_final_kernel<<<1, 1024, 0, stream_>>>(partial, static_cast<int>(g), partial + g);
  CUDA_CHECK_LAUNCH();
  CUDA_CHECK(cudaMemcpyAsync(host_f64_, partial + g, sizeof(double), cudaMemcpyDeviceToHost, stream_));
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  ++host_syncs_;
  return *host_f64_;
}

namespace cuda {

// Pass 2 of sum_squares_into: the same fixed-order sum of the partials as ssq_final_kernel,
// then acc = (accumulate ? acc : 0) + sum in F64 (the host's `ss += sum_squares(g)`).
__global__ void ssq_final_into_kernel(const double* partial, int np, double* acc, int accumulate) {
  __shared__ double sh[32];
  double s = 0;
  for (int i = threadIdx.x; i < np; i += blockDim.x) s += partial[i];
  s = block_sum(s, sh);
  if (threadIdx.x == 0) *acc = accumulate ? *acc + s : s;
}

}  // namespace cuda

void CudaBackend::sum_squares_into(const Tensor& x, Tensor acc, bool accumulate) {
  EView vx = make_eview(x, "sum_squares_into: x");
  double* a = cuda::device_scalar(acc, 1, "sum_squares_into: acc");
  const int64_t n = x.numel();
  if (n == 0) {
    if (!accumulate) fill(acc.numel() == 1 ? acc : acc.slice(0, 0, 1), 0.0);
    return;
  }
  // The grid of sum_squares (n alone fixes it), so the partials have the same bits.
  int64_t g = (n + kSsqThreads * 16 - 1) / (kSsqThreads * 16);
  if (g > kSsqMaxBlocks) g = kSsqMaxBlocks;
  double* partial = static_cast<double*>(scratch(g * sizeof(double)));
  ssq_partial_kernel<<<static_cast<unsigned>(g), kSsqThreads, 0, stream_>>>(vx, n, partial);
  CUDA_CHECK_LAUNCH();
  ssq_final_into_kernel<<<1, 1024, 0, stream_>>>(partial, static_cast<int>(g), a, accumulate ? 1 : 0);
  CUDA_CHECK_LAUNCH();
}

namespace cuda {

// One warp per row: lane l sums x[r][l + 32·j] for j = 0, 1, … (F64), then a fixed
// butterfly; the order depends on C only. out [R] F64.
__global__ void row_ssq_kernel(RView x, double* out) {
  const int64_t row = blockIdx.x * (int64_t)(blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= x.rows) return;
  const int64_t base = x.row(row);
  double acc = 0;
  for (int64_t c = lane; c < x.cols; c += 32) {
    const double v = ldf(x.p, base + c, x.dt);
    acc += v * v;
  }
  for (int o = 16; o > 0; o /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if (lane == 0) out[row] = acc;
}

}  // namespace cuda

void CudaBackend::row_sum_squares(const Tensor& x, Tensor out) {
  RView vx = make_rview(x, "row_sum_squares: x");
  LAPLACE_CHECK(out.dtype == DType::kF64 && out.numel() == vx.rows && out.is_contiguous() &&
                    out.device == Device::kCUDA,
                "row_sum_squares: out must be a contiguous device F64 tensor with one entry per row of x");
  if (vx.rows == 0) return;
  constexpr int kRowsPerBlock = 8;
  const unsigned grid = static_cast<unsigned>((vx.rows + kRowsPerBlock - 1) / kRowsPerBlock);
  cuda::row_ssq_kernel<<<grid, 32 * kRowsPerBlock, 0, stream_>>>(vx, static_cast<double*>(out.data));
  CUDA_CHECK_LAUNCH();
}

// ---- optimizers -----------------------------------------------------------------------------

namespace cuda {

// AdamW, docs/training.md §6 (F32 math; bias corrections bc1 = 1−β1^t, bc2 = 1−β2^t from the host):
//   m ← β1 m + (1−β1) g;  v ← β2 v + (1−β2) g²;
//   w ← w·(1 − lr·wd) − lr · (m/bc1) / (√(v/bc2) + eps)
struct AdamWArgs {
  float b1, omb1, b2, omb2, inv_bc1, inv_bc2, lr, decay, eps;
};
// skip (nullable): a device scalar; non-zero leaves everything untouched.
__global__ void adamw_kernel(EView w, EView g, EView m, EView v, int64_t n, AdamWArgs a, const double* skip) {
  if (skip && *skip != 0.0) return;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t ow = w.off(i), om = m.off(i), ov = v.off(i);
    const float gi = ldf(g.p, g.off(i), g.dt);
    const float mi = a.b1 * ldf(m.p, om, kF32) + a.omb1 * gi;
    const float vi = a.b2 * ldf(v.p, ov, kF32) + a.omb2 * gi * gi;
    stf(m.p, om, kF32, mi);
    stf(v.p, ov, kF32, vi);
    const float upd = (mi * a.inv_bc1) / (sqrtf(vi * a.inv_bc2) + a.eps);
    stf(w.p, ow, kF32, ldf(w.p, ow, kF32) * a.decay - a.lr * upd);
  }
}

// Muon momentum: m ← μ m + g;  u = g + μ m (Nesterov, with the new m) or u = m.
__global__ void muon_momentum_kernel(EView g, EView m, EView u, int64_t n, float mu, int nesterov,
                                     const double* skip) {
  if (skip && *skip != 0.0) return;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t om = m.off(i);
    const float gi = ldf(g.p, g.off(i), g.dt);
    const float mi = mu * ldf(m.p, om, kF32) + gi;
    stf(m.p, om, kF32, mi);
    if (u.p) stf(u.p, u.off(i), u.dt, nesterov ? gi + mu * mi : mi);
  }
}

// w ← w·(1 − lr·wd) − (lr·s)·o
__global__ void muon_apply_kernel(EView w, EView o, int64_t n, float decay, float step, const double* skip) {
  if (skip && *skip != 0.0) return;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t ow = w.off(i);
    stf(w.p, ow, kF32, ldf(w.p, ow, kF32) * decay - step * ldf(o.p, o.off(i), o.dt));
  }
}

}  // namespace cuda

void CudaBackend::adamw_update(Tensor w, const Tensor& g, Tensor m, Tensor v, const AdamWParams& p) {
  adamw_launch(w, g, m, v, p, nullptr);
}

void CudaBackend::adamw_update_gated(Tensor w, const Tensor& g, Tensor m, Tensor v, const AdamWParams& p,
                                     const Tensor& skip) {
  adamw_launch(w, g, m, v, p, cuda::device_scalar(skip, 1, "adamw_update_gated: skip"));
}

void CudaBackend::adamw_launch(Tensor w, const Tensor& g, Tensor m, Tensor v, const AdamWParams& p,
                               const double* skip) {
  LAPLACE_CHECK(same_shape(w, g) && same_shape(w, m) && same_shape(w, v), "adamw_update: shapes differ");
  check_f32(w, "adamw_update: w must be F32 (master weights)");
  check_f32(m, "adamw_update: m must be F32");
  check_f32(v, "adamw_update: v must be F32");
  LAPLACE_CHECK(p.step >= 1, "adamw_update: step is 1-based");
  EView vw = make_eview(w, "adamw: w"), vg = make_eview(g, "adamw: g"), vm = make_eview(m, "adamw: m"),
        vv = make_eview(v, "adamw: v");
  const int64_t n = w.numel();
  if (n == 0) return;
  AdamWArgs a;
  a.b1 = static_cast<float>(p.beta1);
  a.omb1 = static_cast<float>(1.0 - p.beta1);
  a.b2 = static_cast<float>(p.beta2);
  a.omb2 = static_cast<float>(1.0 - p.beta2);
  a.inv_bc1 = static_cast<float>(1.0 / (1.0 - std::pow(p.beta1, static_cast<double>(p.step))));
  a.inv_bc2 = static_cast<float>(1.0 / (1.0 - std::pow(p.beta2, static_cast<double>(p.step))));
  a.lr = static_cast<float>(p.lr);
  a.decay = static_cast<float>(1.0 - p.lr * p.wd);
  a.eps = static_cast<float>(p.eps);
  adamw_kernel<<<grid_for(n, 256), 256, 0, stream_>>>(vw, vg, vm, vv, n, a, skip);
  CUDA_CHECK_LAUNCH();
}

void CudaBackend::muon_momentum(const Tensor& g, Tensor m, Tensor u, double mu, bool nesterov) {
  muon_momentum_launch(g, m, u, mu, nesterov, nullptr);
}

void CudaBackend::muon_momentum_gated(const Tensor& g, Tensor m, Tensor u, double mu, bool nesterov,
                                      const Tensor& skip) {
  muon_momentum_launch(g, m, u, mu, nesterov, cuda::device_scalar(skip, 1, "muon_momentum_gated: skip"));
}

void CudaBackend::muon_momentum_launch(const Tensor& g, Tensor m, Tensor u, double mu, bool nesterov,
                                       const double* skip) {
  LAPLACE_CHECK(same_shape(g, m), "muon_momentum: shapes differ");
  LAPLACE_CHECK(!u.defined() || same_shape(g, u), "muon_momentum: u has the wrong shape");
  check_f32(m, "muon_momentum: m must be F32");
  EView vg = make_eview(g, "muon_momentum: g"), vm = make_eview(m, "muon_momentum: m"),
        vu = make_eview(u, "muon_momentum: u");
  const int64_t n = g.numel();
  if (n == 0) return;
  muon_momentum_kernel<<<grid_for(n, 256), 256, 0, stream_>>>(vg, vm, vu, n, static_cast<float>(mu),
                                                                 nesterov ? 1 : 0, skip);
  CUDA_CHECK_LAUNCH();
}

void CudaBackend::muon_apply(Tensor w, const Tensor& o, double lr, double wd, double s) {
  muon_apply_launch(w, o, lr, wd, s, nullptr);
}

void CudaBackend::muon_apply_gated(Tensor w, const Tensor& o, double lr, double wd, double s, const Tensor& skip) {
  muon_apply_launch(w, o, lr, wd, s, cuda::device_scalar(skip, 1, "muon_apply_gated: skip"));
}

void CudaBackend::muon_apply_launch(Tensor w, const Tensor& o, double lr, double wd, double s, const double* skip) {
  LAPLACE_CHECK(same_shape(w, o), "muon_apply: shapes differ");
  check_f32(w, "muon_apply: w must be F32 (master weights)");
  EView vw = make_eview(w, "muon_apply: w"), vo = make_eview(o, "muon_apply: o");
  const int64_t n = w.numel();
  if (n == 0) return;
  muon_apply_kernel<<<grid_for(n, 256), 256, 0, stream_>>>(vw, vo, n, static_cast<float>(1.0 - lr * wd),
                                                              static_cast<float>(lr * s), skip);
  CUDA_CHECK_LAUNCH();
}

// ---- SwiGLU ------------------------------------------------------------------------------

namespace cuda {

// h[n,f] = SiLU(a)·b with a = ab[n,f], b = ab[n,F+f]; SiLU(x) = x·σ(x).
// ab [N,2F], h [N,F]
__global__ void swiglu_fwd_kernel(RView ab, RView h, int64_t F) {
  const int64_t n = h.rows * F;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t r = i / F, f = i - r * F;
    const int64_t oab = ab.row(r);
    const float a = ldf(ab.p, oab + f, ab.dt), b = ldf(ab.p, oab + F + f, ab.dt);
    stf(h.p, h.row(r) + f, h.dt, swiglu_value(a, b));
  }
}

// ---- 16-byte vectors of 8 floats (ld8 / st8 / vec_rows: cuda_common.cuh) ----

constexpr int kSwiThreads = 256;

// The SwiGLU forward of swiglu_fwd_kernel (same expression, so the same bits), 8 columns per
// thread with 16-byte accesses: block (x, y) covers row x, chunks [256·y, 256·y + 256) of 8
// columns. Needs F % 8 == 0 and ab, h rows 16-byte aligned. ab [N,2F], h [N,F]
template <int DT>  // dt_as (cuda_common.cuh)
__global__ void __launch_bounds__(kSwiThreads) swiglu_fwd_vec_kernel(RView ab, RView h, int F8) {
  const int q = blockIdx.y * kSwiThreads + threadIdx.x;  // chunk of 8 columns
  if (q >= F8) return;
  const int64_t r = blockIdx.x;
  const int64_t oab = ab.row(r) + 8 * q, oh = h.row(r) + 8 * q;
  float a[8], b[8], y[8];
  ld8(ab.p, oab, dt_as<DT>(ab.dt), a);
  ld8(ab.p, oab + 8LL * F8, dt_as<DT>(ab.dt), b);
#pragma unroll
  for (int k = 0; k < 8; ++k) y[k] = swiglu_value(a[k], b[k]);
  st8(h.p, oh, dt_as<DT>(h.dt), y);
}

// da = dh·b·SiLU'(a), SiLU'(a) = σ(a)(1 + a(1−σ(a)));  db = dh·SiLU(a).
// dh [N,F]; ab, dab [N,2F] (dab may alias ab: each thread reads a, b before writing)
__global__ void swiglu_bwd_kernel(RView dh, RView ab, RView dab, int64_t F) {
  const int64_t n = dh.rows * F;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t r = i / F, f = i - r * F;
    const int64_t oab = ab.row(r), od = dab.row(r);
    const float a = ldf(ab.p, oab + f, ab.dt), b = ldf(ab.p, oab + F + f, ab.dt);
    const float g = ldf(dh.p, dh.row(r) + f, dh.dt);
    const float s = sigmoidf_(a);
    stf(dab.p, od + f, dab.dt, g * b * s * (1.0f + a * (1.0f - s)));
    stf(dab.p, od + F + f, dab.dt, g * a * s);
  }
}

// The same, 8 columns per thread with 16-byte (F32: 2 × 16-byte) loads and stores; grid
// (rows, ⌈F/8 / kSwiThreads⌉). Each element's arithmetic is the scalar kernel's.
template <int DT>
__global__ void __launch_bounds__(kSwiThreads) swiglu_bwd_vec_kernel(RView dh, RView ab, RView dab, int F8) {
  const int q = blockIdx.y * kSwiThreads + threadIdx.x;  // chunk of 8 columns
  if (q >= F8) return;
  const int64_t r = blockIdx.x;
  const int64_t oab = ab.row(r) + 8 * q, od = dab.row(r) + 8 * q;
  float a[8], b[8], g[8], da[8], db[8];
  ld8(ab.p, oab, dt_as<DT>(ab.dt), a);
  ld8(ab.p, oab + 8LL * F8, dt_as<DT>(ab.dt), b);
  ld8(dh.p, dh.row(r) + 8 * q, dt_as<DT>(dh.dt), g);
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const float s = sigmoidf_(a[k]);
    da[k] = g[k] * b[k] * s * (1.0f + a[k] * (1.0f - s));
    db[k] = g[k] * a[k] * s;
  }
  st8(dab.p, od, dt_as<DT>(dab.dt), da);
  st8(dab.p, od + 8LL * F8, dt_as<DT>(dab.dt), db);
}

}  // namespace cuda

void CudaBackend::swiglu_forward(const Tensor& ab, Tensor h) {
  RView vab = make_rview(ab, "swiglu: ab"), vh = make_rview(h, "swiglu: h");
  const int64_t F = vh.cols;
  LAPLACE_CHECK(vab.cols == 2 * F && vab.rows == vh.rows, "swiglu_forward: ab must be [N,2F] and h [N,F]");
  if (vh.rows * F == 0) return;
  const int64_t F8 = F / 8, yblocks = (F8 + kSwiThreads - 1) / kSwiThreads;
  if (F % 8 == 0 && vec_rows(vab) && vec_rows(vh) && vh.rows <= 0x7fffffff && yblocks <= 65535) {
    const dim3 grid(static_cast<unsigned>(vh.rows), static_cast<unsigned>(yblocks));
    if (bf16_rows(vab) && bf16_rows(vh))
      swiglu_fwd_vec_kernel<kBF16><<<grid, kSwiThreads, 0, stream_>>>(vab, vh, static_cast<int>(F8));
    else
      swiglu_fwd_vec_kernel<kDtAny><<<grid, kSwiThreads, 0, stream_>>>(vab, vh, static_cast<int>(F8));
  } else {
    swiglu_fwd_kernel<<<grid_for(vh.rows * F, 256), 256, 0, stream_>>>(vab, vh, F);
  }
  CUDA_CHECK_LAUNCH();
}

void CudaBackend::swiglu_backward(const Tensor& dh, const Tensor& ab, Tensor dab) {
  RView vdh = make_rview(dh, "swiglu: dh"), vab = make_rview(ab, "swiglu: ab"),
        vdab = make_rview(dab, "swiglu: dab");
  const int64_t F = vdh.cols;
  LAPLACE_CHECK(vab.cols == 2 * F && vab.rows == vdh.rows && vdab.cols == 2 * F && vdab.rows == vdh.rows,
                "swiglu_backward: ab, dab must be [N,2F] and dh [N,F]");
  if (vdh.rows * F == 0) return;
  const int64_t F8 = F / 8, yblocks = (F8 + kSwiThreads - 1) / kSwiThreads;
  if (F % 8 == 0 && vec_rows(vdh) && vec_rows(vab) && vec_rows(vdab) && vdh.rows <= 0x7fffffff && yblocks <= 65535) {
    const dim3 grid(static_cast<unsigned>(vdh.rows), static_cast<unsigned>(yblocks));
    if (bf16_rows(vdh) && bf16_rows(vab) && bf16_rows(vdab))
      swiglu_bwd_vec_kernel<kBF16><<<grid, kSwiThreads, 0, stream_>>>(vdh, vab, vdab, static_cast<int>(F8));
    else
      swiglu_bwd_vec_kernel<kDtAny><<<grid, kSwiThreads, 0, stream_>>>(vdh, vab, vdab, static_cast<int>(F8));
  } else {
    swiglu_bwd_kernel<<<grid_for(vdh.rows * F, 256), 256, 0, stream_>>>(vdh, vab, vdab, F);
  }
  CUDA_CHECK_LAUNCH();
}

}  // namespace laplace

// ---- fingerprint (gemm tuning's check that two outputs have the same bytes) ---------------

namespace laplace {
namespace cuda {

// splitmix64's finaliser: every input bit reaches every output bit.
__device__ __forceinline__ unsigned long long mix64(unsigned long long z) { return splitmix64_hash(z); }

// out += Σ mix(word_i ^ mix(i)) over the 8-byte words of p (when p is 8-byte aligned), then
// over the tail bytes each with its position: a sum modulo 2^64, so the value does not depend
// on the order in which the blocks add their parts.
__global__ void fingerprint_kernel(const unsigned char* p, int64_t n, unsigned long long* out) {
  __shared__ unsigned long long sh[32];
  const int64_t words = reinterpret_cast<uintptr_t>(p) % 8 == 0 ? n / 8 : 0;
  const auto* w = reinterpret_cast<const unsigned long long*>(p);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  unsigned long long acc = 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < words; i += stride)
    acc += mix64(w[i] ^ mix64(static_cast<unsigned long long>(i)));
  for (int64_t i = words * 8 + blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n; i += stride)
    acc += mix64(static_cast<unsigned long long>(p[i]) ^ mix64(~static_cast<unsigned long long>(i)));
  acc = block_sum(acc, sh);
  if (threadIdx.x == 0) atomicAdd(out, acc);
}

}  // namespace cuda

uint64_t CudaBackend::fingerprint(const void* p, size_t bytes) {
  auto* acc = static_cast<unsigned long long*>(scratch(sizeof(unsigned long long)));
  CUDA_CHECK(cudaMemsetAsync(acc, 0, sizeof(unsigned long long), stream_));
  if (bytes > 0) {
    const int64_t n = static_cast<int64_t>(bytes);
    const unsigned grid = static_cast<unsigned>(std::min<int64_t>(1024, (n / 8 + 255) / 256 + 1));
    cuda::fingerprint_kernel<<<grid, 256, 0, stream_>>>(static_cast<const unsigned char*>(p), n, acc);
    CUDA_CHECK_LAUNCH();
  }
  CUDA_CHECK(cudaMemcpyAsync(host_f64_, acc, sizeof(unsigned long long), cudaMemcpyDeviceToHost, stream_));
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  ++host_syncs_;
  uint64_t v = 0;
  std::memcpy(&v, host_f64_, sizeof v);
  return v;
}

}  // namespace laplace
