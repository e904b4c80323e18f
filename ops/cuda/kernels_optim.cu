// The optimizer's device-scalar ops (ops/backend.h): the clip/skip decision, scaling by a
// device scalar and the loss sum. Single-thread kernels (the loss sum: one block in a fixed
// order) where the arithmetic must match the host's bit for bit (IEEE F64 sqrt, add and
// divide are correctly rounded on the device as on the host, and none of these expressions
// contains a multiply-add nvcc could contract).
#include <cmath>

#include "core/fixed_sum.h"
#include "ops/cuda/cuda_common.cuh"

namespace laplace {
namespace cuda {

// out = {norm = √ss, coef, skip}: see Backend::grad_clip_scalars.
__global__ void grad_clip_scalars_kernel(const double* ss, double max_norm, double* out) {
  const double norm = sqrt(*ss);
  const bool skip = !isfinite(norm);
  out[0] = norm;
  out[1] = (!skip && max_norm > 0 && norm > max_norm) ? max_norm / (norm + 1e-6) : 1.0;
  out[2] = skip ? 1.0 : 0.0;
}

// x *= (float)coef, as scale_kernel with alpha = coef; nothing when coef == 1.
__global__ void scale_by_kernel(EView x, const double* coef, int64_t n) {
  const double c = *coef;
  if (c == 1.0) return;
  const float alpha = static_cast<float>(c);
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t o = x.off(i);
    stf(x.p, o, x.dt, ldf(x.p, o, x.dt) * alpha);
  }
}

// x *= (float)(1 / (√ss + eps)): the host's scale(x, 1.0 / (sqrt(ss) + eps)).
__global__ void scale_by_inv_norm_kernel(EView x, const double* ss, double eps, int64_t n) {
  const float alpha = static_cast<float>(1.0 / (sqrt(*ss) + eps));
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t o = x.off(i);
    stf(x.p, o, x.dt, ldf(x.p, o, x.dt) * alpha);
  }
}

// The F64 sum of core/fixed_sum.h, one block: thread t is lane t (its elements in index
// order), then the fixed pairwise fold in shared memory; the same bits as Model::loss.
// f64: a contiguous F64 vector (the sharded optimizer's per-row sums of squares) instead of
// the losses' F32/BF16 view.
__global__ void __launch_bounds__(kFixedSumLanes)
    loss_sum_kernel(EView losses, const double* f64, int64_t n, double count, double* acc, int accumulate) {
  __shared__ double lane[kFixedSumLanes];
  double s = 0;
  for (int64_t i = threadIdx.x; i < n; i += kFixedSumLanes)
    s += f64 != nullptr ? f64[i] : static_cast<double>(ldf(losses.p, losses.off(i), losses.dt));
  lane[threadIdx.x] = s;
  __syncthreads();
  for (int w = kFixedSumLanes / 2; w > 0; w >>= 1) {
    if (static_cast<int>(threadIdx.x) < w) lane[threadIdx.x] += lane[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    const double l = count > 0 ? lane[0] / count : 0.0;
    *acc = accumulate ? *acc + l : l;
  }
}

}  // namespace cuda

using namespace cuda;

void CudaBackend::grad_clip_scalars(const Tensor& ss, double max_norm, Tensor out) {
  grad_clip_scalars_kernel<<<1, 1, 0, stream_>>>(device_scalar(ss, 1, "grad_clip_scalars: ss"), max_norm,
                                                 device_scalar(out, 3, "grad_clip_scalars: out"));
  CUDA_CHECK_LAUNCH();
}

void CudaBackend::scale_by(Tensor x, const Tensor& coef) {
  EView vx = make_eview(x, "scale_by: x");
  const double* c = device_scalar(coef, 1, "scale_by: coef");
  const int64_t n = x.numel();
  if (n == 0) return;
  scale_by_kernel<<<grid_for(n, 256), 256, 0, stream_>>>(vx, c, n);
  CUDA_CHECK_LAUNCH();
}

void CudaBackend::scale_by_inv_norm(Tensor x, const Tensor& ss, double eps) {
  EView vx = make_eview(x, "scale_by_inv_norm: x");
  const double* s = device_scalar(ss, 1, "scale_by_inv_norm: ss");
  const int64_t n = x.numel();
  if (n == 0) return;
  scale_by_inv_norm_kernel<<<grid_for(n, 256), 256, 0, stream_>>>(vx, s, eps, n);
  CUDA_CHECK_LAUNCH();
}

void CudaBackend::loss_sum_into(const Tensor& losses, double count, Tensor acc, bool accumulate) {
  LAPLACE_CHECK(losses.ndim == 1, "loss_sum_into: losses must be a vector [N]");
  const bool f64 = losses.dtype == DType::kF64;
  if (f64) {
    check_device(losses, "loss_sum_into: losses");
    LAPLACE_CHECK(losses.is_contiguous(), "loss_sum_into: F64 losses must be contiguous");
  }
  EView vl = f64 ? EView{} : make_eview(losses, "loss_sum_into: losses");
  double* a = device_scalar(acc, 1, "loss_sum_into: acc");
  loss_sum_kernel<<<1, kFixedSumLanes, 0, stream_>>>(vl, f64 ? static_cast<const double*>(losses.data) : nullptr,
                                                     losses.numel(), count, a, accumulate ? 1 : 0);
  CUDA_CHECK_LAUNCH();
}

}  // namespace laplace
