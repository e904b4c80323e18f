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

// The block's answer from each thread's (value, index): a warp and block tree with
// better()'s rule, so the lowest index of the largest value whatever the thread count.
// Thread 0 writes it (0 for an empty row).
__device__ __forceinline__ void argmax_block_store(ArgBest best, int32_t* dst) {
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
    if (lane == 0) *dst = best.i == 0x7fffffff ? 0 : best.i;
  }
}

// One block per row. Thread t scans columns t, t + blockDim, … keeping its first largest
// (strict >, so the lowest index among its equals), then argmax_block_store's tree.
__global__ void argmax_rows_kernel(RView x, int32_t* out) {
  const int64_t row = blockIdx.x;
  const int64_t base = x.row(row);
  ArgBest best{-INFINITY, 0x7fffffff};
  for (int64_t c = threadIdx.x; c < x.cols; c += blockDim.x) {
    const float v = ldf(x.p, base + c, x.dt);
    if (v > best.v || best.i == 0x7fffffff) best = ArgBest{v, static_cast<int>(c)};
  }
  argmax_block_store(best, out + row);
}

// The decode step's case: F32 rows, 16-byte aligned, cols % 4 == 0 (a whole batch's logits,
// read once). The generic kernel's loads go through a run-time dtype branch one at a time,
// about half the copy bandwidth; here each thread keeps kArgUnroll float4 loads in flight. Thread t scans
// the vectors t, t + blockDim, … in increasing column order and within a vector its lanes
// left to right with the same strict >, so every thread holds the lowest index of its largest
// value and the tree gives the generic kernel's answer (for rows without NaN, whose place
// in the scan order decides).
constexpr int kArgUnroll = 4;
__global__ void argmax_rows_f32v_kernel(RView x, int32_t* out) {
  const float4* row = reinterpret_cast<const float4*>(static_cast<const float*>(x.p) + x.row(blockIdx.x));
  const int64_t nv = x.cols / 4;
  ArgBest best{-INFINITY, 0x7fffffff};
  const auto take = [&best](const float4 q, int c) {
    if (q.x > best.v || best.i == 0x7fffffff) best = ArgBest{q.x, c};
    if (q.y > best.v) best = ArgBest{q.y, c + 1};
    if (q.z > best.v) best = ArgBest{q.z, c + 2};
    if (q.w > best.v) best = ArgBest{q.w, c + 3};
  };
  int64_t j = threadIdx.x;
  for (; j + (kArgUnroll - 1) * blockDim.x < nv; j += kArgUnroll * blockDim.x) {
    float4 q[kArgUnroll];
#pragma unroll
    for (int u = 0; u < kArgUnroll; ++u) q[u] = __ldcs(row + j + u * blockDim.x);
#pragma unroll
    for (int u = 0; u < kArgUnroll; ++u) take(q[u], static_cast<int>(4 * (j + u * blockDim.x)));
  }
  for (; j < nv; j += blockDim.x) take(__ldcs(row + j), static_cast<int>(4 * j));
  argmax_block_store(best, out + blockIdx.x);
}

}  // namespace cuda

void CudaBackend::argmax_rows(const Tensor& x, Tensor out) {
  cuda::RView vx = cuda::make_rview(x, "argmax_rows: x");
  LAPLACE_CHECK(out.dtype == DType::kI32 && out.is_contiguous() && out.device == Device::kCUDA &&
                    out.numel() == vx.rows,
                "argmax_rows: out must be a contiguous device I32 tensor with one entry per row of x");
  LAPLACE_CHECK(vx.cols <= 0x7ffffffe, "argmax_rows: rows longer than 2^31 − 2");
  if (vx.rows == 0) return;
  const bool f32v = vx.dt == cuda::kF32 && vx.cols % 4 == 0 && cuda::aligned16(vx.p) &&
                    (vx.rows <= 1 || vx.s0 % 4 == 0) && (vx.d1 <= 1 || vx.s1 % 4 == 0) && (vx.d2 <= 1 || vx.s2 % 4 == 0);
  if (f32v)
    cuda::argmax_rows_f32v_kernel<<<static_cast<unsigned>(vx.rows), 512, 0, stream_>>>(vx, static_cast<int32_t*>(out.data));
  else
    cuda::argmax_rows_kernel<<<static_cast<unsigned>(vx.rows), 512, 0, stream_>>>(vx, static_cast<int32_t*>(out.data));
  CUDA_CHECK_LAUNCH();
}

}  // namespace laplace
