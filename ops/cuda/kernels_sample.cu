// Device-side token selection for the engine (serve/engine.h): greedy argmax over each
// row of the logits, so a decode step copies B token ids to the host, not B × V logits.
#include "ops/cuda/cuda_backend.h"
#include "ops/cuda/cuda_common.cuh"

namespace laplace {

namespace cuda {

// (value, index) pairs: b beats a when larger, or equal with a lower index.
struct ArgBest {
  float v;
  int i;
};
__device__ __forceinline__ ArgBest better(ArgBest a, ArgBest b) {
  return (b.v > a.v || (b.v == a.v && b.i < a.i)) ? b : a;
}

// One block per row. Thread t scans columns t, t + blockDim, … keeping its first largest
// (strict >, so the lowest index among its equals), then a warp and block tree with the
// same rule: the result is the row's lowest index of its largest value, whatever the
// thread count.
__global__ void argmax_rows_kernel(RView x, int32_t* out) {
  const int64_t row = blockIdx.x;
  const int64_t base = x.row(row);
  ArgBest best{-INFINITY, 0x7fffffff};
  for (int64_t c = threadIdx.x; c < x.cols; c += blockDim.x) {
    const float v = ldf(x.p, base + c, x.dt);
    if (v > best.v || best.i == 0x7fffffff) best = ArgBest{v, static_cast<int>(c)};
  }
  for (int o = 16; o > 0; o /= 2) {
    ArgBest other{__shfl_xor_sync(0xffffffffu, best.v, o), __shfl_xor_sync(0xffffffffu, best.i, o)};
    best = better(best, other);
  }
  __shared__ ArgBest warp_best[32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  if (lane == 0) warp_best[warp] = best;
  __syncthreads();
  if (warp == 0) {
    best = lane < warps ? warp_best[lane] : ArgBest{-INFINITY, 0x7fffffff};
    for (int o = 16; o > 0; o /= 2) {
      ArgBest other{__shfl_xor_sync(0xffffffffu, best.v, o), __shfl_xor_sync(0xffffffffu, best.i, o)};
      best = better(best, other);
    }
    if (lane == 0) out[row] = best.i == 0x7fffffff ? 0 : best.i;
  }
}

}  // namespace cuda

void CudaBackend::argmax_rows(const Tensor& x, Tensor out) {
  cuda::RView vx = cuda::make_rview(x, "argmax_rows: x");
  LAPLACE_CHECK(out.dtype == DType::kI32 && out.is_contiguous() && out.device == Device::kCUDA &&
                    out.numel() == vx.rows,
                "argmax_rows: out must be a contiguous device I32 tensor with one entry per row of x");
  LAPLACE_CHECK(vx.cols <= 0x7ffffffe, "argmax_rows: rows longer than 2^31 − 2");
  if (vx.rows == 0) return;
  cuda::argmax_rows_kernel<<<static_cast<unsigned>(vx.rows), 512, 0, stream_>>>(vx, static_cast<int32_t*>(out.data));
  CUDA_CHECK_LAUNCH();
}

}  // namespace laplace
