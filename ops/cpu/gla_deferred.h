// The per-head arithmetic of deferred write-back on the CPU (ops/backend.h GlaPending;
// docs/serving.md §4), shared by the decode step (gla.cpp), speculative verification
// (gla_verify.cpp) and its commit (gla_verify_commit.cpp). One definition of each sum: a
// verified position then gives the bits of the decode step it stands for, and a commit the
// bits of the write-back that step would have made (docs/serving.md §11), because both run
// the very same loops on the very same values.
//
// Per head, with qs = scale·q, λ's powers pw[n] = λ^n and pairs (k_j, v_j), j < m, pair 0
// the oldest:
//   pending step:  o = λ^{m+1} (qs·S) + Σ_{j<m} λ^{m−j} (qs·k_j) v_j + (qs·k) v     S unwritten
//   write-back:    S' = λ^{m+1} S + Σ_{j<m} λ^{m−j} k_jᵀ v_j + kᵀ v,  o = qs·S'
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "core/check.h"
#include "ops/backend.h"

namespace laplace::cpu::deferred {

constexpr int64_t kMaxPendingSteps = 16;

// The pending pairs and count word of entry e, head h.
template <class F>
struct HeadPending {
  F* k;  // [R−1, dk]
  F* v;  // [R−1, dv]
  int32_t* count;
};

template <class F>
HeadPending<F> head_pending(const GlaPending& p, int64_t e, int64_t h) {
  return {static_cast<F*>(p.k.data) + e * p.k.stride[0] + h * p.k.stride[1],
          static_cast<F*>(p.v.data) + e * p.v.stride[0] + h * p.v.stride[1],
          static_cast<int32_t*>(p.count.data) + e * p.count.stride[0] + h * p.count.stride[1]};
}

// The count word's m and d, checked (a corrupt word would index past the pairs).
inline void pending_count(const int32_t* count, int64_t R, int64_t* m, int64_t* d) {
  LAPLACE_CHECK(pending_word_valid(*count, R), "gla deferred: a pending count is out of range (corrupt slot?)");
  *m = pending_m(*count);
  *d = pending_d(*count);
}

// Row t of head h of batch row b in a [B, T, H, d] view.
template <class F>
F* token_row(const Tensor& x, int64_t b, int64_t t, int64_t h) {
  return static_cast<F*>(x.data) + b * x.stride[0] + t * x.stride[1] + h * x.stride[2];
}

// The pairs a window of speculative steps reads, in decode order: the entry's m pending pairs,
// then tokens 0 … n − 1 of row b, head h of k [B, T, H, dk] and v [B, T, H, dv].
template <class F>
void window_pairs(const HeadPending<F>& pp, int64_t m, const Tensor& k, const Tensor& v, int64_t b, int64_t h,
                  int64_t n, const F** kp, const F** vp) {
  const int64_t dk = k.shape[3], dv = v.shape[3];
  for (int64_t j = 0; j < m; ++j) {
    kp[j] = pp.k + j * dk;
    vp[j] = pp.v + j * dv;
  }
  for (int64_t t = 0; t < n; ++t) {
    kp[m + t] = token_row<F>(k, b, t, h);
    vp[m + t] = token_row<F>(v, b, t, h);
  }
}

// pw[n] = λ^n for n = 0..N, each power in double, cast once (as gla.cpp's other forms).
template <class F>
void decay_powers(double lambda, int64_t N, F* pw) {
  for (int64_t n = 0; n <= N; ++n) pw[n] = static_cast<F>(std::pow(lambda, static_cast<double>(n)));
}

// o [dv] of a pending step: S rows i at S + i·ss; pairs j < m at kp[j] [dk], vp[j] [dv]; the
// step's own (kr, vr).
template <class F>
void pending_output(const F* qs, const F* S, int64_t ss, int64_t dk, int64_t dv, int64_t m, const F* pw,
                    const F* const* kp, const F* const* vp, const F* kr, const F* vr, F* out) {
  std::fill(out, out + dv, F(0));
  for (int64_t i = 0; i < dk; ++i) {
    const F* row = S + i * ss;
    for (int64_t x = 0; x < dv; ++x) out[x] += qs[i] * row[x];
  }
  for (int64_t x = 0; x < dv; ++x) out[x] *= pw[m + 1];
  for (int64_t j = 0; j <= m; ++j) {
    const F* kj = j < m ? kp[j] : kr;
    const F* vj = j < m ? vp[j] : vr;
    F d = 0;
    for (int64_t i = 0; i < dk; ++i) d += qs[i] * kj[i];
    const F a = j < m ? pw[m - j] * d : d;
    for (int64_t x = 0; x < dv; ++x) out[x] += a * vj[x];
  }
}

// The write-back step: dst rows (stride ds; dst may be S itself) = S' as above; with out
// non-null, out [dv] = qs·S' as well. Each element is read before it is written.
template <class F>
void write_back(const F* qs, const F* S, int64_t ss, F* dst, int64_t ds, int64_t dk, int64_t dv, int64_t m,
                const F* pw, const F* const* kp, const F* const* vp, const F* kr, const F* vr, F* out) {
  if (out) std::fill(out, out + dv, F(0));
  for (int64_t i = 0; i < dk; ++i) {
    const F* row = S + i * ss;
    F* drow = dst + i * ds;
    for (int64_t x = 0; x < dv; ++x) {
      F t = pw[m + 1] * row[x];
      for (int64_t j = 0; j < m; ++j) t += pw[m - j] * kp[j][i] * vp[j][x];
      drow[x] = t + kr[i] * vr[x];
      if (out) out[x] += qs[i] * drow[x];
    }
  }
}

}  // namespace laplace::cpu::deferred
