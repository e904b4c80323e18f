// CPU commit of a speculative verification (Backend::gla_verify_commit; docs/serving.md §11):
// the accepted positions of each row join its entry's context exactly as that many decode steps
// would have left it. With the entry's count word (m0, d0) and the window's write-back position
// w = R − 1 − d0 − m0 (gla_verify.cpp), a row that accepted a positions either
//   a ≤ w:  appends its a pairs after the entry's m0 (count m0 + a, phase d0), or
//   a > w:  writes back at w — the decode step's own sum (ops/cpu/gla_deferred.h) over the m0
//           pairs and the row's pairs 0 … w − 1, into the state in place — then keeps its pairs
//           w + 1 … a − 1 as the new pending ones (count a − 1 − w, phase 0).
// The pairs a decode step would append before the write-back are appended too (dead after it,
// but there): so every byte of the state, pairs and counts is the decode steps'.
#include <algorithm>

#include "ops/cpu/gla.h"
#include "ops/cpu/gla_deferred.h"

namespace laplace::cpu {
namespace {

using deferred::kMaxPendingSteps;

using deferred::token_row;

template <class F>
void commit_typed(const GlaParams& p, const Tensor& k, const Tensor& v, const Tensor& accepted, Tensor states,
                  const GlaPending& pend, const Tensor& slots) {
  const int64_t B = k.shape[0], H = k.shape[2], dk = k.shape[3], dv = v.shape[3], R = pend.steps;
  const int32_t* sl = static_cast<const int32_t*>(slots.data);
  const int32_t* acc = static_cast<const int32_t*>(accepted.data);
#pragma omp parallel for schedule(static)
  for (int64_t bh = 0; bh < B * H; ++bh) {
    const int64_t b = bh / H, h = bh % H, e = sl[b * slots.stride[0]];
    const int64_t a = acc[b * accepted.stride[0]];
    if (a == 0) continue;
    const deferred::HeadPending<F> pp = deferred::head_pending<F>(pend, e, h);
    int64_t m0 = 0, d0 = 0;
    deferred::pending_count(pp.count, R, &m0, &d0);
    const int64_t w = R - 1 - d0 - m0;
    // The steps before the write-back append their pairs (also when a write-back follows: the
    // decode steps leave them there, so the slot's every byte is theirs).
    for (int64_t t = 0; t < std::min(a, w); ++t) {
      std::copy_n(token_row<F>(k, b, t, h), dk, pp.k + (m0 + t) * dk);
      std::copy_n(token_row<F>(v, b, t, h), dv, pp.v + (m0 + t) * dv);
    }
    if (a <= w) {  // no write-back among the accepted steps
      *pp.count = pending_word(static_cast<int32_t>(m0 + a), static_cast<int32_t>(d0));
      continue;
    }
    F pw[kMaxPendingSteps + 1];
    deferred::decay_powers(p.decay[h], R, pw);
    const F* kp[2 * kMaxPendingSteps];
    const F* vp[2 * kMaxPendingSteps];
    deferred::window_pairs<F>(pp, m0, k, v, b, h, w + 1, kp, vp);  // (the values of the pairs just appended)
    F* S = static_cast<F*>(states.data) + e * states.stride[0] + h * states.stride[1];
    const int64_t ss = states.stride[2];
    deferred::write_back<F>(nullptr, S, ss, S, ss, dk, dv, m0 + w, pw, kp, vp, kp[m0 + w], vp[m0 + w], nullptr);
    for (int64_t t = w + 1; t < a; ++t) {  // after the pairs were read: now they may be overwritten
      std::copy_n(token_row<F>(k, b, t, h), dk, pp.k + (t - w - 1) * dk);
      std::copy_n(token_row<F>(v, b, t, h), dv, pp.v + (t - w - 1) * dv);
    }
    *pp.count = pending_word(static_cast<int32_t>(a - 1 - w), 0);
  }
}

}  // namespace

void gla_verify_commit(const GlaParams& p, const Tensor& k, const Tensor& v, const Tensor& accepted, Tensor states,
                       const GlaPending& pend, const Tensor& slots) {
  check_verify_args(k, v, states, pend, slots);
  LAPLACE_CHECK(static_cast<int64_t>(p.decay.size()) == k.shape[2], "gla verify commit: need one decay per head");
  LAPLACE_CHECK(accepted.defined() && accepted.device == Device::kCPU && accepted.dtype == DType::kI32 &&
                    accepted.ndim == 1 && accepted.shape[0] == k.shape[0],
                "gla verify commit: accepted must be [B] I32 on the CPU");
  for (int64_t b = 0; b < k.shape[0]; ++b) {
    const int32_t a = static_cast<const int32_t*>(accepted.data)[b * accepted.stride[0]];
    LAPLACE_CHECK(a >= 0 && a <= k.shape[1], "gla verify commit: accepted outside [0, T]");
  }
  if (k.dtype == DType::kF64)
    commit_typed<double>(p, k, v, accepted, states, pend, slots);
  else
    commit_typed<float>(p, k, v, accepted, states, pend, slots);
}

}  // namespace laplace::cpu
