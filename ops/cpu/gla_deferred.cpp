// CPU reference of deferred state write-back (ops/backend.h GlaPending; docs/serving.md §4),
// F32 and F64. Per pool entry e and head h, with m = count[e][h] pending pairs (k_j, v_j),
// λ = decay[h] and qs = scale·q:
//   true state  T = λ^m S + Σ_{j<m} λ^{m−1−j} k_jᵀ v_j
//   decode, m + 1 < R:  o = λ^{m+1} (qs S) + Σ_{j<m} λ^{m−j} (qs·k_j) v_j + (qs·k) v;
//                       pair m ← (k, v), m ← m + 1; S untouched
//   decode, m + 1 = R:  S ← λ^R S + Σ_{j<R−1} λ^{R−1−j} k_jᵀ v_j + kᵀ v; o = qs S; m ← 0
//   flush:              S ← T; m ← 0
// Every sum runs in index order, one (e, h) per work item: bitwise identical for any thread
// count. The CUDA kernels sum in another order, so the two agree to rounding only.
#include <cmath>
#include <cstdint>
#include <vector>

#include "ops/cpu/gla.h"

namespace laplace::cpu {
namespace {

constexpr int64_t kMaxSteps = 16;

// The pending pairs and count of entry e, head h.
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

int64_t entry_of(const Tensor& slots, int64_t b) {
  return slots.defined() ? static_cast<const int32_t*>(slots.data)[b * slots.stride[0]] : b;
}

void check_pending(const GlaPending& p, const Tensor& states) {
  const int64_t S = states.shape[0], H = states.shape[1], dk = states.shape[2], dv = states.shape[3];
  LAPLACE_CHECK(p.steps >= 2 && p.steps <= kMaxSteps, "gla deferred: R must be in [2, 16]");
  LAPLACE_CHECK(p.k.device == Device::kCPU && p.v.device == Device::kCPU && p.count.device == Device::kCPU,
                "gla deferred: pending pairs must be on the CPU");
  LAPLACE_CHECK(p.k.dtype == states.dtype && p.v.dtype == states.dtype,
                "gla deferred: CPU pending pairs share the states' dtype");
  LAPLACE_CHECK(p.count.dtype == DType::kI32 && p.count.ndim == 2 && p.count.shape[0] == S && p.count.shape[1] == H &&
                    p.count.stride[1] == 1,
                "gla deferred: count must be [S, H] I32");
  LAPLACE_CHECK(p.k.ndim == 4 && p.k.shape[0] == S && p.k.shape[1] == H && p.k.shape[2] == p.steps - 1 &&
                    p.k.shape[3] == dk && p.k.stride[3] == 1 && p.k.stride[2] == dk,
                "gla deferred: pending k must be [S, H, R−1, dk] with contiguous pairs");
  LAPLACE_CHECK(p.v.ndim == 4 && p.v.shape[0] == S && p.v.shape[1] == H && p.v.shape[2] == p.steps - 1 &&
                    p.v.shape[3] == dv && p.v.stride[3] == 1 && p.v.stride[2] == dv,
                "gla deferred: pending v must be [S, H, R−1, dv] with contiguous pairs");
}

void check_states(const Tensor& s) {
  LAPLACE_CHECK(s.device == Device::kCPU && (s.dtype == DType::kF32 || s.dtype == DType::kF64) && s.ndim == 4 &&
                    s.stride[3] == 1,
                "gla deferred: states must be [S, H, dk, dv] F32/F64 on the CPU, rows contiguous");
}

template <class F>
void decode_typed(const GlaParams& p, const Tensor& q, const Tensor& k, const Tensor& v, Tensor states,
                  const GlaPending& pend, const Tensor& slots, Tensor o) {
  const int64_t B = q.shape[0], H = q.shape[2], dk = q.shape[3], dv = v.shape[3], R = pend.steps;
#pragma omp parallel for schedule(static)
  for (int64_t bh = 0; bh < B * H; ++bh) {
    const int64_t b = bh / H, h = bh % H, e = entry_of(slots, b);
    const F* qr = static_cast<const F*>(q.data) + b * q.stride[0] + h * q.stride[2];
    const F* kr = static_cast<const F*>(k.data) + b * k.stride[0] + h * k.stride[2];
    const F* vr = static_cast<const F*>(v.data) + b * v.stride[0] + h * v.stride[2];
    F* out = static_cast<F*>(o.data) + b * o.stride[0] + h * o.stride[2];
    F* S = static_cast<F*>(states.data) + e * states.stride[0] + h * states.stride[1];
    const int64_t ss = states.stride[2];
    const HeadPending<F> pp = head_pending<F>(pend, e, h);
    const int64_t m = *pp.count;
    LAPLACE_CHECK(m >= 0 && m < R, "gla deferred: a pending count is out of range (corrupt slot?)");
    F pw[kMaxSteps + 1];
    for (int64_t i = 0; i <= R; ++i) pw[i] = static_cast<F>(std::pow(p.decay[h], static_cast<double>(i)));
    std::vector<F> qs(dk);
    for (int64_t i = 0; i < dk; ++i) qs[i] = static_cast<F>(p.scale) * qr[i];
    for (int64_t x = 0; x < dv; ++x) out[x] = F(0);
    if (m + 1 == R) {  // the write-back step
      for (int64_t i = 0; i < dk; ++i) {
        F* row = S + i * ss;
        for (int64_t x = 0; x < dv; ++x) {
          F t = pw[R] * row[x];
          for (int64_t j = 0; j < R - 1; ++j) t += pw[R - 1 - j] * pp.k[j * dk + i] * pp.v[j * dv + x];
          row[x] = t + kr[i] * vr[x];
          out[x] += qs[i] * row[x];
        }
      }
      *pp.count = 0;
      continue;
    }
    for (int64_t i = 0; i < dk; ++i) {
      const F* row = S + i * ss;
      for (int64_t x = 0; x < dv; ++x) out[x] += qs[i] * row[x];
    }
    for (int64_t x = 0; x < dv; ++x) out[x] *= pw[m + 1];
    for (int64_t j = 0; j <= m; ++j) {
      const F* kj = j < m ? pp.k + j * dk : kr;
      const F* vj = j < m ? pp.v + j * dv : vr;
      F d = 0;
      for (int64_t i = 0; i < dk; ++i) d += qs[i] * kj[i];
      const F a = j < m ? pw[m - j] * d : d;
      for (int64_t x = 0; x < dv; ++x) out[x] += a * vj[x];
    }
    for (int64_t i = 0; i < dk; ++i) pp.k[m * dk + i] = kr[i];
    for (int64_t x = 0; x < dv; ++x) pp.v[m * dv + x] = vr[x];
    *pp.count = static_cast<int32_t>(m + 1);
  }
}

template <class F>
void flush_typed(const GlaParams& p, Tensor states, const GlaPending& pend, const Tensor& slots) {
  const int64_t B = slots.shape[0], H = states.shape[1], dk = states.shape[2], dv = states.shape[3];
#pragma omp parallel for schedule(static)
  for (int64_t bh = 0; bh < B * H; ++bh) {
    const int64_t b = bh / H, h = bh % H, e = entry_of(slots, b);
    const HeadPending<F> pp = head_pending<F>(pend, e, h);
    const int64_t m = *pp.count;
    LAPLACE_CHECK(m >= 0 && m < pend.steps, "gla deferred: a pending count is out of range (corrupt slot?)");
    if (m == 0) continue;
    F pw[kMaxSteps + 1];
    for (int64_t i = 0; i <= m; ++i) pw[i] = static_cast<F>(std::pow(p.decay[h], static_cast<double>(i)));
    F* S = static_cast<F*>(states.data) + e * states.stride[0] + h * states.stride[1];
    for (int64_t i = 0; i < dk; ++i) {
      F* row = S + i * states.stride[2];
      for (int64_t x = 0; x < dv; ++x) {
        F t = pw[m] * row[x];
        for (int64_t j = 0; j < m; ++j) t += pw[m - 1 - j] * pp.k[j * dk + i] * pp.v[j * dv + x];
        row[x] = t;
      }
    }
    *pp.count = 0;
  }
}

}  // namespace

void gla_decode_deferred(const GlaParams& p, const Tensor& q, const Tensor& k, const Tensor& v, Tensor o,
                         Tensor states, const GlaPending& pend, const Tensor& slots) {
  check_states(states);
  LAPLACE_CHECK(q.ndim == 4 && q.shape[1] == 1, "gla deferred: decode takes one token per sequence");
  for (const Tensor* t : {&q, &k, &v, static_cast<const Tensor*>(&o)})
    LAPLACE_CHECK(t->device == Device::kCPU && t->dtype == states.dtype && t->ndim == 4 && t->stride[3] == 1,
                  "gla deferred: q, k, v, o must be [B, 1, H, d] in the states' dtype on the CPU");
  LAPLACE_CHECK(same_shape(q, k) && v.shape[0] == q.shape[0] && v.shape[2] == q.shape[2] && same_shape(v, o) &&
                    states.shape[1] == q.shape[2] && states.shape[2] == q.shape[3] && states.shape[3] == v.shape[3],
                "gla deferred: q, k [B,1,H,dk], v, o [B,1,H,dv], states [S,H,dk,dv]");
  LAPLACE_CHECK(static_cast<int64_t>(p.decay.size()) == q.shape[2], "gla deferred: need one decay per head");
  check_pending(pend, states);
  for (int64_t b = 0; b < q.shape[0]; ++b) {
    const int64_t e = entry_of(slots, b);
    LAPLACE_CHECK(e >= 0 && e < states.shape[0], "gla deferred: slot index out of range");
  }
  if (states.dtype == DType::kF64)
    decode_typed<double>(p, q, k, v, states, pend, slots, o);
  else
    decode_typed<float>(p, q, k, v, states, pend, slots, o);
}

void gla_pending_flush(const GlaParams& p, Tensor states, const GlaPending& pend, const Tensor& slots) {
  check_states(states);
  check_pending(pend, states);
  LAPLACE_CHECK(slots.defined() && slots.dtype == DType::kI32 && slots.ndim == 1 && slots.device == Device::kCPU,
                "gla deferred: flush takes slots [B] I32");
  LAPLACE_CHECK(static_cast<int64_t>(p.decay.size()) == states.shape[1], "gla deferred: need one decay per head");
  for (int64_t b = 0; b < slots.shape[0]; ++b) {
    const int64_t e = entry_of(slots, b);
    LAPLACE_CHECK(e >= 0 && e < states.shape[0], "gla deferred: slot index out of range");
  }
  if (states.dtype == DType::kF64)
    flush_typed<double>(p, states, pend, slots);
  else
    flush_typed<float>(p, states, pend, slots);
}

}  // namespace laplace::cpu
