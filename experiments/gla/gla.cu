// GLA tensor-core kernels (ops/cuda/gla_tc.cuh, the production kernels themselves): validates
// them against an fp64 per-token recurrence on the CPU and times them (CUDA events, median).
// A kernel change is tried by editing ops/cuda/gla_tc.cuh and running this driver before the
// backend's tests. Built by CMake with -DLAPLACE_EXPERIMENTS=ON (target experiment_gla), or alone:
//
//   nvcc -O3 -std=c++17 -I. -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr
//        [-DGLA_BWD_SPLIT=true] -o experiment_gla experiments/gla/gla.cu
//   ./experiment_gla [--B 8] [--T 2048] [--H 16] [--check 1] [--reps 20] [--states 0|1] [--scan-blocks 256]
//
// Reports relative RMS errors (o, final state, dq, dk, dv, d initial state) over the first
// `check` sequences, the per-kernel times and forward / forward+backward times.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "experiments/host.h"

#include "ops/cuda/gla_tc.cuh"

namespace gla_tc = laplace::cuda::gla_tc;

namespace {

constexpr int DK = 96, DV = 192;

using experiments::bf2f;
using experiments::f2bf;

struct Rng {
  uint64_t s;
  explicit Rng(uint64_t seed) : s(seed) {}
  uint64_t next() {
    uint64_t z = (s += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
  float uniform() { return static_cast<float>(static_cast<double>(next() >> 11) * 0x1.0p-53 * 2.0 - 1.0); }
};
std::vector<uint16_t> rand_bf16(size_t n, uint64_t seed) {
  std::vector<uint16_t> v(n);
  Rng r(seed);
  for (auto& x : v) x = f2bf(r.uniform());
  return v;
}
std::vector<float> rand_f32(size_t n, uint64_t seed, float amp) {
  std::vector<float> v(n);
  Rng r(seed);
  for (auto& x : v) x = amp * r.uniform();
  return v;
}

struct Err {
  double num = 0, den = 1e-300;
  void add(double a, double ref) {
    num += (a - ref) * (a - ref);
    den += ref * ref;
  }
  double rel() const { return std::sqrt(num / den); }
};

}  // namespace

int main(int argc, char** argv) {
  int B = 8, T = 2048, H = 16, check = 1, reps = 20, use_states = 0, scan_blocks = 0;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    const int v = std::atoi(argv[i + 1]);
    if (k == "--B") B = v;
    else if (k == "--T") T = v;
    else if (k == "--H") H = v;
    else if (k == "--check") check = v;
    else if (k == "--reps") reps = v;
    else if (k == "--states") use_states = v;
    else if (k == "--scan-blocks") scan_blocks = v;  // plan_groups' target, instead of kScanBlocks
  }
  check = std::min(check, B);
  const int N = (T + gla_tc::kC - 1) / gla_tc::kC;
  const size_t nk = static_cast<size_t>(B) * T * H * DK, nv = static_cast<size_t>(B) * T * H * DV;
  const size_t ns = static_cast<size_t>(B) * H * DK * DV;
  std::printf("gla: B=%d T=%d H=%d dk=%d dv=%d, chunks %d, states %d\n", B, T, H, DK, DV, N, use_states);

  gla_tc::Args a{};
  a.B = B;
  a.T = T;
  a.H = H;
  a.N = N;
  a.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(DK)));
  for (int h = 0; h < H; ++h) a.lam[h] = 1.0 - std::ldexp(1.0, -5 - h);

  auto hq = rand_bf16(nk, 1), hk = rand_bf16(nk, 2), hv = rand_bf16(nv, 3), hdo = rand_bf16(nv, 4);
  auto hs0 = rand_f32(ns, 5, 1.0f), hgo = rand_f32(ns, 6, 0.05f);

  uint16_t *q, *k, *v, *o, *dO, *dq, *dk, *dv;
  float *s0, *s1, *go, *gi, *scratch;
  CK(cudaMalloc(&q, nk * 2));
  CK(cudaMalloc(&k, nk * 2));
  CK(cudaMalloc(&v, nv * 2));
  CK(cudaMalloc(&o, nv * 2));
  CK(cudaMalloc(&dO, nv * 2));
  CK(cudaMalloc(&dq, nk * 2));
  CK(cudaMalloc(&dk, nk * 2));
  CK(cudaMalloc(&dv, nv * 2));
  CK(cudaMalloc(&s0, ns * 4));
  CK(cudaMalloc(&s1, ns * 4));
  CK(cudaMalloc(&go, ns * 4));
  CK(cudaMalloc(&gi, ns * 4));
  const size_t nstate = static_cast<size_t>(B) * H * N * DK * DV;
  CK(cudaMalloc(&scratch, nstate * 4 * 1));  // fp32 states, or two bf16 state sets
  CK(cudaMemcpy(q, hq.data(), nk * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(k, hk.data(), nk * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(v, hv.data(), nv * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dO, hdo.data(), nv * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(s0, hs0.data(), ns * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(go, hgo.data(), ns * 4, cudaMemcpyHostToDevice));

  auto act = [&](const void* p, int d) {
    gla_tc::Act x;
    x.p = p;
    x.dt = gla_tc::kBF16;
    x.sb = static_cast<int64_t>(T) * H * d;
    x.st = static_cast<int64_t>(H) * d;
    x.sh = d;
    return x;
  };
  auto outv = [&](void* p, int d) {
    gla_tc::OutV x;
    x.p = p;
    x.dt = gla_tc::kBF16;
    x.sb = static_cast<int64_t>(T) * H * d;
    x.st = static_cast<int64_t>(H) * d;
    x.sh = d;
    return x;
  };
  auto stv = [&](float* p) {
    gla_tc::StV s;
    s.p = p;
    s.ss = static_cast<int64_t>(H) * DK * DV;
    s.sh = static_cast<int64_t>(DK) * DV;
    s.sk = DV;
    return s;
  };
  const gla_tc::StV none{};
  const int st_smem = gla_tc::state_smem_bytes<DK, DV>(), fo_smem = gla_tc::fwd_smem_bytes<DK, DV>(),
            dv_smem = gla_tc::bwd_dv_smem_bytes<DK, DV>(), dqk_smem = gla_tc::bwd_dqk_smem_bytes<DK, DV>();
  constexpr int kFwdOut = gla_tc::kOutHiLo, kBwdOut = gla_tc::kOutHi;
  // GLA_BWD_SPLIT=true: the backward's scans split their weighted rows into hi/lo (production: false).
#ifndef GLA_BWD_SPLIT
#define GLA_BWD_SPLIT false
#endif
#define BWD_SPLIT , GLA_BWD_SPLIT
  using StPtr = __nv_bfloat16*;
  using FoPtr = const __nv_bfloat16*;
  CK(cudaFuncSetAttribute(gla_tc::state_kernel<DK, DV, false, kFwdOut>, cudaFuncAttributeMaxDynamicSharedMemorySize, st_smem));
  CK(cudaFuncSetAttribute(gla_tc::state_kernel<DK, DV, false, kBwdOut BWD_SPLIT>, cudaFuncAttributeMaxDynamicSharedMemorySize, st_smem));
  CK(cudaFuncSetAttribute(gla_tc::state_kernel<DK, DV, true, kBwdOut BWD_SPLIT>, cudaFuncAttributeMaxDynamicSharedMemorySize, st_smem));
  CK(cudaFuncSetAttribute(gla_tc::fwd_o_kernel<DK, DV>, cudaFuncAttributeMaxDynamicSharedMemorySize, fo_smem));
  CK(cudaFuncSetAttribute(gla_tc::bwd_dv_kernel<DK, DV>, cudaFuncAttributeMaxDynamicSharedMemorySize, dv_smem));
  CK(cudaFuncSetAttribute(gla_tc::bwd_dqk_kernel<DK, DV>, cudaFuncAttributeMaxDynamicSharedMemorySize, dqk_smem));
  std::printf("smem: state %d, fwd_o %d, bwd_dv %d, bwd_dqk %d bytes\n", st_smem, fo_smem, dv_smem, dqk_smem);

  const dim3 sgrid(DV / gla_tc::kSlice, B * H);
  const unsigned cgrid = static_cast<unsigned>(B * H * N);
  __nv_bfloat16* sst = reinterpret_cast<__nv_bfloat16*>(scratch);
  __nv_bfloat16* gst = sst + nstate;
  // the forward scan in chunk groups when B·H is small (B = 1 prefill), then the carry.
  gla_tc::Args af = a;
  gla_tc::plan_groups(af, DV / gla_tc::kSlice);
  if (scan_blocks > 0) {  // plan_groups with another target (an experiment; the bits change with G)
    const int per_seq = B * H * (DV / gla_tc::kSlice);
    const int g = std::max(1, std::min(per_seq >= scan_blocks ? 1 : scan_blocks / per_seq, N / 2));
    af.NG = (N + g - 1) / g;
    af.G = (N + af.NG - 1) / af.NG;
  }
  float* gend = nullptr;
  if (af.G > 1) CK(cudaMalloc(&gend, static_cast<size_t>(B) * H * af.G * DK * DV * 4));
  std::printf("forward scan: %d chunk groups of %d chunks\n", af.G, af.NG);
  auto k_state_fwd = [&](bool st) {
    const dim3 g(DV / gla_tc::kSlice, B * H * af.G);
    gla_tc::state_kernel<DK, DV, false, kFwdOut><<<g, gla_tc::kStateThreads, st_smem>>>(
        af, act(k, DK), act(v, DV), st ? stv(s0) : none, nullptr, st ? stv(s1) : none,
        reinterpret_cast<StPtr>(scratch), gend);
    CK(cudaGetLastError());
    if (af.G > 1) {
      const dim3 fg = gla_tc::fix_grid<DK, DV>(af);
      gla_tc::group_fix_kernel<DK, DV><<<fg, gla_tc::kFixThreads>>>(af, nullptr, st ? stv(s1) : none,
                                                                     reinterpret_cast<StPtr>(scratch), gend);
      CK(cudaGetLastError());
    }
  };
  auto k_fwd_o = [&]() {
    gla_tc::fwd_o_kernel<DK, DV><<<cgrid, gla_tc::kThreads, fo_smem>>>(a, act(q, DK), act(k, DK), act(v, DV),
                                                                       outv(o, DV), reinterpret_cast<FoPtr>(scratch));
    CK(cudaGetLastError());
  };
  auto k_state_s = [&](bool st) {
    gla_tc::state_kernel<DK, DV, false, kBwdOut BWD_SPLIT><<<sgrid, gla_tc::kStateThreads, st_smem>>>(
        a, act(k, DK), act(v, DV), st ? stv(s0) : none, nullptr, none, sst);
    CK(cudaGetLastError());
  };
  auto k_state_g = [&](bool st) {
    gla_tc::state_kernel<DK, DV, true, kBwdOut BWD_SPLIT><<<sgrid, gla_tc::kStateThreads, st_smem>>>(
        a, act(q, DK), act(dO, DV), st ? stv(go) : none, nullptr, st ? stv(gi) : none, gst);
    CK(cudaGetLastError());
  };
  auto k_dqk = [&]() {
    gla_tc::bwd_dqk_kernel<DK, DV><<<cgrid, gla_tc::kThreads, dqk_smem>>>(
        a, act(q, DK), act(k, DK), act(v, DV), act(dO, DV), outv(dq, DK), outv(dk, DK), sst, gst);
    CK(cudaGetLastError());
  };
  auto k_dv = [&]() {
    gla_tc::bwd_dv_kernel<DK, DV><<<cgrid, gla_tc::kThreads, dv_smem>>>(a, act(q, DK), act(k, DK), act(dO, DV),
                                                                        outv(dv, DV), gst);
    CK(cudaGetLastError());
  };
  const bool st = use_states != 0;
  auto fwd = [&]() {
    k_state_fwd(st);
    k_fwd_o();
  };
  auto bwd = [&]() {
    k_state_s(st);
    k_state_g(st);
    k_dqk();
    k_dv();
  };

  // ---- correctness ----
  fwd();
  CK(cudaDeviceSynchronize());
  std::vector<uint16_t> ro(nv);
  std::vector<float> rs1(ns);
  CK(cudaMemcpy(ro.data(), o, nv * 2, cudaMemcpyDeviceToHost));
  if (st) CK(cudaMemcpy(rs1.data(), s1, ns * 4, cudaMemcpyDeviceToHost));
  {
    // Bit fingerprints of the forward (FNV-1a over the bytes): a kernel change that promises
    // the same bits prints the same values for the same arguments.
    auto fnv = [](const void* p, size_t n) {
      uint64_t x = 1469598103934665603ull;
      for (size_t i = 0; i < n; ++i) x = (x ^ static_cast<const unsigned char*>(p)[i]) * 1099511628211ull;
      return static_cast<unsigned long long>(x);
    };
    std::printf("forward bits: o %016llx, final state %016llx\n", fnv(ro.data(), nv * 2),
                st ? fnv(rs1.data(), ns * 4) : 0ull);
  }
  bwd();
  CK(cudaDeviceSynchronize());
  std::vector<uint16_t> rdq(nk), rdk(nk), rdv(nv);
  std::vector<float> rgi(ns);
  CK(cudaMemcpy(rdq.data(), dq, nk * 2, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(rdk.data(), dk, nk * 2, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(rdv.data(), dv, nv * 2, cudaMemcpyDeviceToHost));
  if (st) CK(cudaMemcpy(rgi.data(), gi, ns * 4, cudaMemcpyDeviceToHost));

  // fp64 per-token recurrence, one thread per (b, h)
  std::vector<Err> eo(check * H), es(check * H), eq(check * H), ek(check * H), ev(check * H), eg(check * H);
  auto ref = [&](int b, int h) {
    const int id = b * H + h;
    const double lam = a.lam[h], sc = static_cast<double>(a.scale);
    std::vector<double> S(DK * DV, 0.0), G(DK * DV, 0.0);
    if (st)
      for (int i = 0; i < DK * DV; ++i) S[i] = hs0[(static_cast<size_t>(b) * H + h) * DK * DV + i];
    std::vector<std::vector<double>> Ss;  // S_t after token t (needed by dq)
    Ss.reserve(0);
    auto iq = [&](int t, int c) { return bf2f(hq[((static_cast<size_t>(b) * T + t) * H + h) * DK + c]) * sc; };
    auto ik = [&](int t, int c) { return static_cast<double>(bf2f(hk[((static_cast<size_t>(b) * T + t) * H + h) * DK + c])); };
    auto iv = [&](int t, int e) { return static_cast<double>(bf2f(hv[((static_cast<size_t>(b) * T + t) * H + h) * DV + e])); };
    auto ido = [&](int t, int e) { return static_cast<double>(bf2f(hdo[((static_cast<size_t>(b) * T + t) * H + h) * DV + e])); };
    std::vector<double> dqr(static_cast<size_t>(T) * DK);
    for (int t = 0; t < T; ++t) {
      for (int c = 0; c < DK; ++c) {
        const double kc = ik(t, c);
        for (int e = 0; e < DV; ++e) S[c * DV + e] = lam * S[c * DV + e] + kc * iv(t, e);
      }
      for (int e = 0; e < DV; ++e) {
        double acc = 0;
        for (int c = 0; c < DK; ++c) acc += iq(t, c) * S[c * DV + e];
        eo[id].add(bf2f(ro[((static_cast<size_t>(b) * T + t) * H + h) * DV + e]), acc);
      }
      // dq_t = scale · dO_t S_tᵀ
      for (int c = 0; c < DK; ++c) {
        double acc = 0;
        for (int e = 0; e < DV; ++e) acc += ido(t, e) * S[c * DV + e];
        dqr[static_cast<size_t>(t) * DK + c] = acc * sc;
      }
    }
    if (st)
      for (int i = 0; i < DK * DV; ++i) es[id].add(rs1[(static_cast<size_t>(b) * H + h) * DK * DV + i], S[i]);
    for (int t = 0; t < T; ++t)
      for (int c = 0; c < DK; ++c)
        eq[id].add(bf2f(rdq[((static_cast<size_t>(b) * T + t) * H + h) * DK + c]), dqr[static_cast<size_t>(t) * DK + c]);
    // reverse: D = ∂L/∂S_t (total) = λ D_{t+1} + q̃_tᵀ dO_t, D_{T+1} = ds_out / λ convention:
    // S_T is the final state, so D_T = ds_out + q̃_Tᵀ dO_T; D_t = λ D_{t+1} + q̃_tᵀ dO_t.
    if (st)
      for (int i = 0; i < DK * DV; ++i) G[i] = hgo[(static_cast<size_t>(b) * H + h) * DK * DV + i];
    for (int t = T - 1; t >= 0; --t) {
      if (t < T - 1)
        for (int i = 0; i < DK * DV; ++i) G[i] *= lam;
      for (int c = 0; c < DK; ++c) {
        const double qc = iq(t, c);
        for (int e = 0; e < DV; ++e) G[c * DV + e] += qc * ido(t, e);
      }
      for (int c = 0; c < DK; ++c) {
        double acc = 0;
        for (int e = 0; e < DV; ++e) acc += G[c * DV + e] * iv(t, e);
        ek[id].add(bf2f(rdk[((static_cast<size_t>(b) * T + t) * H + h) * DK + c]), acc);
      }
      for (int e = 0; e < DV; ++e) {
        double acc = 0;
        for (int c = 0; c < DK; ++c) acc += ik(t, c) * G[c * DV + e];
        ev[id].add(bf2f(rdv[((static_cast<size_t>(b) * T + t) * H + h) * DV + e]), acc);
      }
    }
    if (st)
      for (int i = 0; i < DK * DV; ++i) eg[id].add(rgi[(static_cast<size_t>(b) * H + h) * DK * DV + i], lam * G[i]);
  };
  {
    std::vector<std::thread> th;
    for (int b = 0; b < check; ++b)
      for (int h = 0; h < H; ++h) th.emplace_back(ref, b, h);
    for (auto& t : th) t.join();
  }
  auto tot = [&](const std::vector<Err>& e) {
    Err s;
    for (auto& x : e) {
      s.num += x.num;
      s.den += x.den;
    }
    return s.rel();
  };
  std::printf("rel RMS vs fp64 (first %d seq): o %.3e  s_out %.3e | dq %.3e dk %.3e dv %.3e ds_in %.3e\n", check,
              tot(eo), st ? tot(es) : 0.0, tot(eq), tot(ek), tot(ev), st ? tot(eg) : 0.0);
  const bool ok = tot(eo) <= 2.5e-3 && tot(eq) <= 5e-3 && tot(ek) <= 5e-3 && tot(ev) <= 5e-3 &&
                  (!st || (tot(es) <= 1e-4 && tot(eg) <= 5e-3));
  std::printf("%s\n", ok ? "CHECK PASS" : "CHECK FAIL");

  // ---- timing ----
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  auto time_ms = [&](const char* name, auto fn) {
    for (int i = 0; i < 3; ++i) fn();
    CK(cudaDeviceSynchronize());
    std::vector<float> ms;
    for (int i = 0; i < reps; ++i) {
      CK(cudaEventRecord(e0));
      fn();
      CK(cudaEventRecord(e1));
      CK(cudaEventSynchronize(e1));
      float t = 0;
      CK(cudaEventElapsedTime(&t, e0, e1));
      ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    std::printf("  %-12s median %.4f ms (min %.4f)\n", name, ms[ms.size() / 2], ms[0]);
    return ms[ms.size() / 2];
  };
  time_ms("state_fwd", [&] { k_state_fwd(st); });
  time_ms("fwd_o", k_fwd_o);
  time_ms("state_s_bf16", [&] { k_state_s(st); });
  time_ms("state_g_bf16", [&] { k_state_g(st); });
  time_ms("bwd_dqk", k_dqk);
  time_ms("bwd_dv", k_dv);
  const float tf = time_ms("FWD", fwd);
  const float tb = time_ms("FWD+BWD", [&] {
    fwd();
    bwd();
  });
  std::printf("RESULT fwd %.4f ms fwdbwd %.4f ms\n", tf, tb);
  return ok ? 0 : 1;
}
