// CPU speculative verification (Backend::gla_verify_deferred; docs/serving.md §11): T tokens
// per row after the context of a deferred-write-back pool entry, every position's output as the
// decode step it stands for would give it, nothing written to the pool.
//
// Per (row b, head h), with the entry's count word (m0, d0): position t is the decode step that
// would find m = m0 + t pairs, so the step that writes back is w = R − 1 − d0 − m0 (a window of
// T ≤ R positions holds at most one). Positions t < w are pending steps over the entry's m0 pairs
// followed by the row's own pairs 0 … t − 1; position w is the write-back, whose new state goes
// to a local buffer instead of the pool; positions t > w are pending steps from that buffer over
// the row's pairs w + 1 … t − 1, with d = 0. ops/cpu/gla_deferred.h holds the sums, shared with
// the decode step, so every output has the decode step's bits.
#include <vector>

#include "ops/cpu/gla.h"
#include "ops/cpu/gla_deferred.h"

namespace laplace::cpu {
namespace {

using deferred::kMaxPendingSteps;

using deferred::token_row;

template <class F>
void verify_typed(const GlaParams& p, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& states,
                  const GlaPending& pend, const Tensor& slots, Tensor o) {
  const int64_t B = q.shape[0], T = q.shape[1], H = q.shape[2], dk = q.shape[3], dv = v.shape[3], R = pend.steps;
  const int32_t* sl = static_cast<const int32_t*>(slots.data);
#pragma omp parallel for schedule(static)
  for (int64_t bh = 0; bh < B * H; ++bh) {
    const int64_t b = bh / H, h = bh % H, e = sl[b * slots.stride[0]];
    const F* S = static_cast<const F*>(states.data) + e * states.stride[0] + h * states.stride[1];
    const int64_t ss = states.stride[2];
    const deferred::HeadPending<F> pp = deferred::head_pending<F>(pend, e, h);
    int64_t m0 = 0, d0 = 0;
    deferred::pending_count(pp.count, R, &m0, &d0);
    const int64_t w = R - 1 - d0 - m0;  // the window's write-back position (≥ 0)
    F pw[kMaxPendingSteps + 1];
    deferred::decay_powers(p.decay[h], R, pw);
    // The pairs in decode order: the entry's m0, then the row's T.
    const F* kp[2 * kMaxPendingSteps];
    const F* vp[2 * kMaxPendingSteps];
    deferred::window_pairs<F>(pp, m0, k, v, b, h, T, kp, vp);
    std::vector<F> qs(dk);
    std::vector<F> written(w < T ? dk * dv : 0);  // the state the write-back step leaves
    for (int64_t t = 0; t < T; ++t) {
      const F* qr = token_row<F>(q, b, t, h);
      for (int64_t i = 0; i < dk; ++i) qs[i] = static_cast<F>(p.scale) * qr[i];
      F* out = token_row<F>(o, b, t, h);
      if (t < w) {
        deferred::pending_output(qs.data(), S, ss, dk, dv, m0 + t, pw, kp, vp, kp[m0 + t], vp[m0 + t], out);
      } else if (t == w) {
        deferred::write_back(qs.data(), S, ss, written.data(), dv, dk, dv, m0 + w, pw, kp, vp, kp[m0 + t],
                             vp[m0 + t], out);
      } else {
        const int64_t first = m0 + w + 1;  // the pairs after the write-back
        deferred::pending_output(qs.data(), written.data(), dv, dk, dv, t - w - 1, pw, kp + first, vp + first,
                                 kp[m0 + t], vp[m0 + t], out);
      }
    }
  }
}

}  // namespace

void check_verify_args(const Tensor& k, const Tensor& v, const Tensor& states, const GlaPending& pend,
                       const Tensor& slots) {
  const DType dt = k.dtype;
  LAPLACE_CHECK(dt == DType::kF32 || dt == DType::kF64, "gla verify: the CPU computes in F32 or F64");
  for (const Tensor* t : {&k, &v, &states, &pend.k, &pend.v})
    LAPLACE_CHECK(t->device == Device::kCPU && t->dtype == dt && t->ndim == 4 && t->stride[3] == 1,
                  "gla verify: float tensors must be 4-D, on the CPU, of one dtype, contiguous innermost");
  const int64_t B = k.shape[0], T = k.shape[1], H = k.shape[2], dk = k.shape[3], dv = v.shape[3];
  const int64_t R = pend.steps, S = states.shape[0];
  LAPLACE_CHECK(v.shape[0] == B && v.shape[1] == T && v.shape[2] == H, "gla verify: v must be [B, T, H, dv] like k");
  LAPLACE_CHECK(states.shape[1] == H && states.shape[2] == dk && states.shape[3] == dv,
                "gla verify: states must be [S, H, dk, dv]");
  LAPLACE_CHECK(R >= 2 && R <= deferred::kMaxPendingSteps, "gla verify: needs deferred write-back (R in [2, 16])");
  LAPLACE_CHECK(T >= 1 && T <= R, "gla verify: a row feeds 1 to R tokens (at most one write-back per window)");
  LAPLACE_CHECK(pend.k.shape[0] == S && pend.k.shape[1] == H && pend.k.shape[2] == R - 1 && pend.k.shape[3] == dk &&
                    pend.k.stride[2] == dk && pend.v.shape[0] == S && pend.v.shape[1] == H &&
                    pend.v.shape[2] == R - 1 && pend.v.shape[3] == dv && pend.v.stride[2] == dv,
                "gla verify: pending pairs must be [S, H, R−1, d] with contiguous pairs");
  LAPLACE_CHECK(pend.count.device == Device::kCPU && pend.count.dtype == DType::kI32 && pend.count.ndim == 2 &&
                    pend.count.shape[0] == S && pend.count.shape[1] == H,
                "gla verify: count must be [S, H] I32");
  LAPLACE_CHECK(slots.defined() && slots.device == Device::kCPU && slots.dtype == DType::kI32 && slots.ndim == 1 &&
                    slots.shape[0] == B,
                "gla verify: slots must be [B] I32 on the CPU");
  for (int64_t b = 0; b < B; ++b) {
    const int32_t e = static_cast<const int32_t*>(slots.data)[b * slots.stride[0]];
    LAPLACE_CHECK(e >= 0 && e < S, "gla verify: slot index out of range");
  }
}

void gla_verify_deferred(const GlaParams& p, const Tensor& q, const Tensor& k, const Tensor& v, Tensor o,
                         const Tensor& states, const GlaPending& pend, const Tensor& slots) {
  check_verify_args(k, v, states, pend, slots);
  LAPLACE_CHECK(static_cast<int64_t>(p.decay.size()) == q.shape[2], "gla verify: need one decay per head");
  for (const Tensor* t : {&q, static_cast<const Tensor*>(&o)})
    LAPLACE_CHECK(t->device == Device::kCPU && t->dtype == k.dtype && t->ndim == 4 && t->stride[3] == 1,
                  "gla verify: q and o must be 4-D, on the CPU, of k's dtype");
  for (int d = 0; d < 4; ++d) LAPLACE_CHECK(q.shape[d] == k.shape[d], "gla verify: q and k shapes differ");
  for (int d = 0; d < 4; ++d) LAPLACE_CHECK(o.shape[d] == v.shape[d], "gla verify: o must be [B, T, H, dv]");
  if (q.dtype == DType::kF64)
    verify_typed<double>(p, q, k, v, states, pend, slots, o);
  else
    verify_typed<float>(p, q, k, v, states, pend, slots, o);
}

}  // namespace laplace::cpu
