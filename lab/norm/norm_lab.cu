// lab/norm driver: LayerNorm forward and dx (accumulate) kernel versions at laplace-3b's
// shapes, validated against an F64 CPU evaluation of the same BF16 inputs and timed (CUDA
// events: median of `reps` single calls, and the mean over a sustained run of `sustain`
// calls back to back, the GPU at its power limit as in training). Standalone: nvcc only.
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o norm_lab lab/norm/norm_lab.cu
//   ./norm_lab [--N 16384] [--D 3072] [--reps 20] [--sustain 200] [--check 64]
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

#include "../lab_host.h"
#include "norm_v1.cuh"
#include "norm_v2.cuh"

namespace {

using lab::bf2f;
using lab::f2bf;
using norm_lab::NormArgs;

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

using lab::median;

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
      std::fprintf(stderr, "usage: norm_lab [--N 16384] [--D 3072] [--reps 20] [--sustain 200] [--check 64]\n");
      return 2;
    }
  }
  if (D != 3072) {
    std::fprintf(stderr, "norm_lab: v1 is instantiated for D = 3072 only\n");
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
      {"v1 warp/row", norm_lab::v1::launch_fwd, norm_lab::v1::launch_dx},
      {"v2 block/row", norm_lab::v2::launch_fwd<1>, norm_lab::v2::launch_dx<1>},
      {"v2r2 block/2 rows", norm_lab::v2::launch_fwd<2>, norm_lab::v2::launch_dx<2>},
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
