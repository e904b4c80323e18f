// experiments/norm driver: LayerNorm forward and dx (accumulate) kernel versions at laplace-3b's
// shapes, validated against an F64 CPU evaluation of the same BF16 inputs and timed (CUDA
// events: median of `reps` single calls, and the mean over a sustained run of `sustain`
// calls back to back, the GPU at its power limit as in training). Standalone: nvcc only.
//
//   nvcc -O3 -std=c++17 -I. -gencode=arch=compute_90a,code=sm_90a -o experiment_norm experiments/norm/norm.cu
//   ./experiment_norm [--N 16384] [--D 3072] [--reps 20] [--sustain 200] [--check 64]
//
// Versions: v1 (the production kernels, warp per row), v2 (block per row), v2r2 (block per two
// rows). Promote a winner by hand into ops/cuda/kernels_norm.cu (layernorm_fwd_vec_kernel /
// layernorm_bwd_dx_vec_kernel and their launchers), where tests/test_cuda_ops_fast.cpp checks it.

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cstdint>

#include "experiments/host.h"

// Shared helpers of the experiments/norm versions (BF16 rows, 8 columns per 16-byte access).
namespace norm_exp {

__device__ __forceinline__ void ld8(const __nv_bfloat16* p, int64_t i, float (&v)[8]) {
  const uint4 q = *reinterpret_cast<const uint4*>(p + i);
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&q);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float2 f = __bfloat1622float2(h[k]);
    v[2 * k] = f.x;
    v[2 * k + 1] = f.y;
  }
}

__device__ __forceinline__ void st8(__nv_bfloat16* p, int64_t i, const float (&v)[8]) {
  uint4 q;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&q);
#pragma unroll
  for (int k = 0; k < 4; ++k) h[k] = __floats2bfloat162_rn(v[2 * k], v[2 * k + 1]);
  *reinterpret_cast<uint4*>(p + i) = q;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Arguments of every version: x, y, dy, dx [N, D] row-major BF16; w, b [D] BF16;
// mean, rstd [N] F32. The dx kernels compute dx += r·(g − mean(g) − x̂·mean(g·x̂)), g = dy·w.
struct NormArgs {
  const __nv_bfloat16 *x, *w, *b, *dy;
  __nv_bfloat16 *y, *dx;
  float *mean, *rstd;
  int64_t N;
  int D;
  float eps;
};

}  // namespace norm_exp

// v1 — the production kernels of ops/cuda/kernels_norm.cu as of 9d4a5e5 (BF16 only here):
// one warp per row; lane l holds the 8-column chunks q = l + 32i (i < NV) in registers.
// LayerNorm forward: 128 registers at NV = 12 (D = 3072); dx: 254 registers (g and x̂ of
// 96 columns per lane), so 2 blocks of 4 warps per SM, and the accumulate loads of dx come
// after both reductions, one chunk at a time.
namespace norm_exp::v1 {

constexpr int kWarps = 4;

template <int NV>
__global__ void __launch_bounds__(32 * kWarps) ln_fwd(NormArgs a) {
  const int64_t row = blockIdx.x * (int64_t)kWarps + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= a.N) return;
  const int nq = a.D >> 3;
  const int64_t ox = row * a.D;
  float v[NV][8];
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int q = lane + 32 * i;
    if (q < nq) {
      ld8(a.x, ox + 8 * q, v[i]);
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
  const float mu = warp_sum(s) / static_cast<float>(a.D);
  float s2 = 0.f;
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    if (lane + 32 * i >= nq) continue;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const float d = v[i][k] - mu;
      s2 += d * d;
    }
  }
  const float r = 1.0f / sqrtf(warp_sum(s2) / static_cast<float>(a.D) + a.eps);
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int q = lane + 32 * i;
    if (q >= nq) continue;
    float o[8], wb[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) o[k] = (v[i][k] - mu) * r;
    ld8(a.w, 8 * q, wb);
#pragma unroll
    for (int k = 0; k < 8; ++k) o[k] *= wb[k];
    ld8(a.b, 8 * q, wb);
#pragma unroll
    for (int k = 0; k < 8; ++k) o[k] += wb[k];
    st8(a.y, ox + 8 * q, o);
  }
  if (lane == 0) {
    a.mean[row] = mu;
    a.rstd[row] = r;
  }
}

template <int NV>
__global__ void __launch_bounds__(32 * kWarps) ln_dx(NormArgs a) {
  const int64_t row = blockIdx.x * (int64_t)kWarps + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= a.N) return;
  const int nq = a.D >> 3;
  const int64_t o = row * a.D;
  const float mu = a.mean[row], r = a.rstd[row];
  float gv[NV][8], xh[NV][8];
  float s1 = 0.f, s2 = 0.f;
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int q = lane + 32 * i;
    if (q < nq) {
      ld8(a.dy, o + 8 * q, gv[i]);
      ld8(a.x, o + 8 * q, xh[i]);
      float wv[8];
      ld8(a.w, 8 * q, wv);
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        gv[i][k] *= wv[k];
        xh[i][k] = (xh[i][k] - mu) * r;
        s1 += gv[i][k];
        s2 += gv[i][k] * xh[i][k];
      }
    } else {
#pragma unroll
      for (int k = 0; k < 8; ++k) gv[i][k] = xh[i][k] = 0.f;
    }
  }
  const float m1 = warp_sum(s1) / static_cast<float>(a.D), m2 = warp_sum(s2) / static_cast<float>(a.D);
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int q = lane + 32 * i;
    if (q >= nq) continue;
    float v[8], prev[8];
    ld8(a.dx, o + 8 * q, prev);
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = r * (gv[i][k] - m1 - xh[i][k] * m2) + prev[k];
    st8(a.dx, o + 8 * q, v);
  }
}

inline void launch_fwd(const NormArgs& a, cudaStream_t st) {
  const unsigned grid = static_cast<unsigned>((a.N + kWarps - 1) / kWarps);
  ln_fwd<12><<<grid, 32 * kWarps, 0, st>>>(a);  // the experiment's D = 3072
}
inline void launch_dx(const NormArgs& a, cudaStream_t st) {
  const unsigned grid = static_cast<unsigned>((a.N + kWarps - 1) / kWarps);
  ln_dx<12><<<grid, 32 * kWarps, 0, st>>>(a);
}

}  // namespace norm_exp::v1

// v2 — one block per ROWS rows, one thread per 8-column chunk (D/8 threads: 384 at D = 3072).
// Each thread holds 8 values per row instead of 96, so a block needs ~40 registers a thread and
// an SM runs ~5 blocks (60 warps) instead of 2–4 blocks of 4 warps; every load of a row (dx's
// accumulate input included) is issued before the first reduction. The sums over the block run
// in a fixed order: each warp's butterfly, then the warps' partial sums in warp order (the same
// order in every thread), so the results are bitwise reproducible. Their bits differ from v1's
// (another summation order). ROWS = 2 amortises the barriers over two rows.
namespace norm_exp::v2 {

constexpr int kMaxWarps = 32;

// Σ over the block of each row's v[j], fixed order; sh [ROWS][kMaxWarps], not read by a
// previous call (callers alternate two buffers).
template <int ROWS>
__device__ __forceinline__ void block_sums(float (&v)[ROWS], float (*sh)[kMaxWarps]) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
  for (int j = 0; j < ROWS; ++j) {
    const float s = warp_sum(v[j]);
    if (lane == 0) sh[j][warp] = s;
  }
  __syncthreads();
#pragma unroll
  for (int j = 0; j < ROWS; ++j) {
    float t = 0.f;
    for (int i = 0; i < nw; ++i) t += sh[j][i];
    v[j] = t;
  }
}

template <int ROWS>
__global__ void __launch_bounds__(1024) ln_fwd(NormArgs a) {
  __shared__ float sh[2][ROWS][kMaxWarps];
  const int q = threadIdx.x, nq = a.D >> 3;
  const bool own = q < nq;
  const int64_t row0 = blockIdx.x * (int64_t)ROWS;
  float v[ROWS][8], s[ROWS];
#pragma unroll
  for (int j = 0; j < ROWS; ++j) {
    if (own && row0 + j < a.N) {
      ld8(a.x, (row0 + j) * a.D + 8 * q, v[j]);
    } else {
#pragma unroll
      for (int k = 0; k < 8; ++k) v[j][k] = 0.f;
    }
    s[j] = 0.f;
#pragma unroll
    for (int k = 0; k < 8; ++k) s[j] += v[j][k];
  }
  block_sums<ROWS>(s, sh[0]);
  float mu[ROWS], s2[ROWS];
#pragma unroll
  for (int j = 0; j < ROWS; ++j) {
    mu[j] = s[j] / static_cast<float>(a.D);
    s2[j] = 0.f;
    if (own) {
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const float d = v[j][k] - mu[j];
        s2[j] += d * d;
      }
    }
  }
  block_sums<ROWS>(s2, sh[1]);
  float wv[8], bv[8];
  if (own) {
    ld8(a.w, 8 * q, wv);
    ld8(a.b, 8 * q, bv);
  }
#pragma unroll
  for (int j = 0; j < ROWS; ++j) {
    const int64_t row = row0 + j;
    if (row >= a.N) break;
    const float r = 1.0f / sqrtf(s2[j] / static_cast<float>(a.D) + a.eps);
    if (own) {
      float o[8];
#pragma unroll
      for (int k = 0; k < 8; ++k) o[k] = (v[j][k] - mu[j]) * r * wv[k] + bv[k];
      st8(a.y, row * a.D + 8 * q, o);
    }
    if (q == 0) {
      a.mean[row] = mu[j];
      a.rstd[row] = r;
    }
  }
}

template <int ROWS>
__global__ void __launch_bounds__(1024) ln_dx(NormArgs a) {
  __shared__ float sh[2][ROWS][kMaxWarps];
  const int q = threadIdx.x, nq = a.D >> 3;
  const bool own = q < nq;
  const int64_t row0 = blockIdx.x * (int64_t)ROWS;
  float gv[ROWS][8], xh[ROWS][8], prev[ROWS][8], s1[ROWS], s2[ROWS];
  float wv[8];
  if (own) ld8(a.w, 8 * q, wv);
#pragma unroll
  for (int j = 0; j < ROWS; ++j) {
    const int64_t row = row0 + j;
    s1[j] = s2[j] = 0.f;
    if (own && row < a.N) {
      const int64_t o = row * a.D + 8 * q;
      ld8(a.dy, o, gv[j]);
      ld8(a.x, o, xh[j]);
      ld8(a.dx, o, prev[j]);  // this thread alone reads and then writes these elements
      const float mu = a.mean[row], r = a.rstd[row];
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        gv[j][k] *= wv[k];
        xh[j][k] = (xh[j][k] - mu) * r;
        s1[j] += gv[j][k];
        s2[j] += gv[j][k] * xh[j][k];
      }
    }
  }
  block_sums<ROWS>(s1, sh[0]);
  block_sums<ROWS>(s2, sh[1]);
#pragma unroll
  for (int j = 0; j < ROWS; ++j) {
    const int64_t row = row0 + j;
    if (!own || row >= a.N) continue;
    const float r = a.rstd[row], m1 = s1[j] / static_cast<float>(a.D), m2 = s2[j] / static_cast<float>(a.D);
    float v[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = r * (gv[j][k] - m1 - xh[j][k] * m2) + prev[j][k];
    st8(a.dx, row * a.D + 8 * q, v);
  }
}

// Threads: D/8 rounded up to whole warps (D ≤ 8192).
inline unsigned threads_for(int D) { return static_cast<unsigned>(((D / 8 + 31) / 32) * 32); }

template <int ROWS>
void launch_fwd(const NormArgs& a, cudaStream_t st) {
  ln_fwd<ROWS><<<static_cast<unsigned>((a.N + ROWS - 1) / ROWS), threads_for(a.D), 0, st>>>(a);
}
template <int ROWS>
void launch_dx(const NormArgs& a, cudaStream_t st) {
  ln_dx<ROWS><<<static_cast<unsigned>((a.N + ROWS - 1) / ROWS), threads_for(a.D), 0, st>>>(a);
}

}  // namespace norm_exp::v2

namespace {

using experiments::bf2f;
using experiments::f2bf;
using norm_exp::NormArgs;

struct Rng {
  uint64_t s;
  double uniform() {  // [0, 1)
    s = s * 6364136223846793005ULL + 1442695040888963407ULL;
    return static_cast<double>(s >> 11) * (1.0 / 9007199254740992.0);
  }
};

std::vector<uint16_t> random_bf16(size_t n, uint64_t seed, double lo, double hi) {
  Rng r{seed};
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = f2bf(static_cast<float>(lo + (hi - lo) * r.uniform()));
  return v;
}

struct Version {
  const char* name;
  std::function<void(const NormArgs&, cudaStream_t)> fwd, dx;
};

using experiments::median;

}  // namespace

int main(int argc, char** argv) {
  int64_t N = 16384;
  int D = 3072, reps = 20, sustain = 200, check = 64;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    const long long v = std::atoll(argv[i + 1]);
    if (k == "--N") N = v;
    else if (k == "--D") D = static_cast<int>(v);
    else if (k == "--reps") reps = static_cast<int>(v);
    else if (k == "--sustain") sustain = static_cast<int>(v);
    else if (k == "--check") check = static_cast<int>(v);
    else {
      std::fprintf(stderr, "usage: experiment_norm [--N 16384] [--D 3072] [--reps 20] [--sustain 200] [--check 64]\n");
      return 2;
    }
  }
  if (D != 3072) {
    std::fprintf(stderr, "experiment_norm: v1 is instantiated for D = 3072 only\n");
    return 2;
  }
  check = static_cast<int>(std::min<int64_t>(check, N));
  const size_t nd = static_cast<size_t>(N) * D;
  const auto hx = random_bf16(nd, 1, -2, 2), hdy = random_bf16(nd, 2, -1, 1), hdx0 = random_bf16(nd, 3, -1, 1);
  const auto hw = random_bf16(D, 4, 0.5, 1.5), hb = random_bf16(D, 5, -0.5, 0.5);

  // F64 reference of the first `check` rows: y, mean, rstd, and dx0 + dx.
  std::vector<double> ry(static_cast<size_t>(check) * D), rdx(static_cast<size_t>(check) * D), rmu(check), rr(check);
  for (int n = 0; n < check; ++n) {
    const uint16_t* x = hx.data() + static_cast<size_t>(n) * D;
    double mu = 0, var = 0;
    for (int c = 0; c < D; ++c) mu += bf2f(x[c]);
    mu /= D;
    for (int c = 0; c < D; ++c) var += (bf2f(x[c]) - mu) * (bf2f(x[c]) - mu);
    const double r = 1.0 / std::sqrt(var / D + 1e-5);
    rmu[n] = mu;
    rr[n] = r;
    double m1 = 0, m2 = 0;
    for (int c = 0; c < D; ++c) {
      const double xh = (bf2f(x[c]) - mu) * r, g = bf2f(hdy[static_cast<size_t>(n) * D + c]) * bf2f(hw[c]);
      ry[static_cast<size_t>(n) * D + c] = xh * bf2f(hw[c]) + bf2f(hb[c]);
      m1 += g;
      m2 += g * xh;
    }
    m1 /= D;
    m2 /= D;
    for (int c = 0; c < D; ++c) {
      const double xh = (bf2f(x[c]) - mu) * r, g = bf2f(hdy[static_cast<size_t>(n) * D + c]) * bf2f(hw[c]);
      rdx[static_cast<size_t>(n) * D + c] = bf2f(hdx0[static_cast<size_t>(n) * D + c]) + r * (g - m1 - xh * m2);
    }
  }

  __nv_bfloat16 *x, *w, *b, *dy, *y, *dx, *dx0;
  float *mean, *rstd;
  CK(cudaMalloc(&x, nd * 2));
  CK(cudaMalloc(&dy, nd * 2));
  CK(cudaMalloc(&y, nd * 2));
  CK(cudaMalloc(&dx, nd * 2));
  CK(cudaMalloc(&dx0, nd * 2));
  CK(cudaMalloc(&w, D * 2));
  CK(cudaMalloc(&b, D * 2));
  CK(cudaMalloc(&mean, N * 4));
  CK(cudaMalloc(&rstd, N * 4));
  CK(cudaMemcpy(x, hx.data(), nd * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dy, hdy.data(), nd * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dx0, hdx0.data(), nd * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(w, hw.data(), D * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(b, hb.data(), D * 2, cudaMemcpyHostToDevice));
  const NormArgs a{x, w, b, dy, y, dx, mean, rstd, N, D, 1e-5f};
  cudaStream_t st;
  CK(cudaStreamCreate(&st));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));

  const std::vector<Version> versions = {
      {"v1 warp/row", norm_exp::v1::launch_fwd, norm_exp::v1::launch_dx},
      {"v2 block/row", norm_exp::v2::launch_fwd<1>, norm_exp::v2::launch_dx<1>},
      {"v2r2 block/2 rows", norm_exp::v2::launch_fwd<2>, norm_exp::v2::launch_dx<2>},
  };
  const double fwd_bytes = 2.0 * nd * 2, dx_bytes = 4.0 * nd * 2;  // fwd: x in, y out; dx: dy, x, dx in, dx out
  std::printf("N %lld, D %d, BF16; F64 reference of %d rows; times: median of %d calls | mean of %d back to back\n",
              (long long)N, D, check, reps, sustain);
  for (const Version& v : versions) {
    // correctness: forward, then dx = dx0 + LN backward (with this version's mean, rstd)
    v.fwd(a, st);
    CK(cudaMemcpyAsync(dx, dx0, nd * 2, cudaMemcpyDeviceToDevice, st));
    v.dx(a, st);
    CK(cudaStreamSynchronize(st));
    CK(cudaGetLastError());
    std::vector<uint16_t> gy(static_cast<size_t>(check) * D), gdx(static_cast<size_t>(check) * D);
    std::vector<float> gmu(check), gr(check);
    CK(cudaMemcpy(gy.data(), y, gy.size() * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(gdx.data(), dx, gdx.size() * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(gmu.data(), mean, check * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(gr.data(), rstd, check * 4, cudaMemcpyDeviceToHost));
    double ey = 0, edx = 0, emu = 0, er = 0, my = 0, mdx = 0;
    for (size_t i = 0; i < gy.size(); ++i) {
      ey = std::max(ey, std::fabs(bf2f(gy[i]) - ry[i]));
      edx = std::max(edx, std::fabs(bf2f(gdx[i]) - rdx[i]));
      my = std::max(my, std::fabs(ry[i]));
      mdx = std::max(mdx, std::fabs(rdx[i]));
    }
    for (int n = 0; n < check; ++n) {
      emu = std::max(emu, std::fabs(gmu[n] - rmu[n]) / (std::fabs(rmu[n]) + 1e-3));
      er = std::max(er, std::fabs(gr[n] - rr[n]) / rr[n]);
    }
    // timing
    auto time = [&](const std::function<void()>& f, double* med_ms, double* sus_ms) {
      std::vector<double> t;
      for (int i = 0; i < reps + 2; ++i) {
        CK(cudaEventRecord(e0, st));
        f();
        CK(cudaEventRecord(e1, st));
        CK(cudaEventSynchronize(e1));
        float ms = 0;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        if (i >= 2) t.push_back(ms);
      }
      *med_ms = median(t);
      CK(cudaEventRecord(e0, st));
      for (int i = 0; i < sustain; ++i) f();
      CK(cudaEventRecord(e1, st));
      CK(cudaEventSynchronize(e1));
      float ms = 0;
      CK(cudaEventElapsedTime(&ms, e0, e1));
      *sus_ms = ms / sustain;
    };
    double fm, fs, dm, ds;
    time([&] { v.fwd(a, st); }, &fm, &fs);
    time([&] { v.dx(a, st); }, &dm, &ds);  // dx accumulates: values grow, time does not
    CK(cudaGetLastError());
    std::printf("%-18s fwd %.4f | %.4f ms (%.2f TB/s) err y %.2e mean %.1e rstd %.1e | dx %.4f | %.4f ms (%.2f TB/s) "
                "err %.2e\n",
                v.name, fm, fs, fwd_bytes / (fs * 1e9), ey / my, emu, er, dm, ds, dx_bytes / (ds * 1e9), edx / mdx);
  }
  return 0;
}
