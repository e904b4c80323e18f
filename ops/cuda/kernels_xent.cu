// Cross-entropy over rows of logits, CUDA: per-row losses and dlogits, with an online softmax
// in a fixed reduction order; fast paths for rows of a multiple of 8 columns, 16-byte aligned.
#include "ops/cuda/row_common.cuh"

namespace laplace {

using namespace cuda;

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
