// CPU GLA mixer, docs/model.md §4 (the three forms of the mixer): the quadratic, recurrent and
// chunked forward forms and the chunk-wise backward, in F32 and F64; and the reference of
// deferred state write-back (a decode option, docs/serving.md §4).
//
// Notation, per batch row b and head h: q_t, k_t ∈ R^dk, v_t ∈ R^dv (row vectors),
// qs_t = scale·q_t, state S ∈ R^{dk×dv}, λ = decay[h]. Within a chunk of length L
// (L = C except for a short tail), local token indices are i, j ∈ [0, L).
//
// Parallelism: one OpenMP work item per (b, h). Every sum is computed by one thread in
// a fixed order, so outputs are bitwise identical for any thread count. Scratch is
// allocated once per work item; inner loops are axpy-shaped (y += a·x over a
// contiguous row) so the compiler vectorises them without reassociating sums.
#include "ops/cpu/gla.h"

#include "ops/cpu/gla_deferred.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace laplace::cpu {
namespace {

// ---- views --------------------------------------------------------------------------

// Rows of a strided matrix: row t starts at base + t·ts, its elements are contiguous.
template <class F>
struct Rows {
  F* base = nullptr;
  int64_t ts = 0;
  F* operator[](int64_t t) const { return base + t * ts; }
};

// The token rows of head h of batch row b in a [B,T,H,d] view.
template <class F>
Rows<F> head_rows(const Tensor& x, int64_t b, int64_t h) {
  return {static_cast<F*>(x.data) + b * x.stride[0] + h * x.stride[2], x.stride[1]};
}

// The dk rows (each dv long) of the state of head h in entry e of a [S,H,dk,dv] view.
template <class F>
Rows<F> state_rows(const Tensor& s, int64_t e, int64_t h) {
  return {static_cast<F*>(s.data) + e * s.stride[0] + h * s.stride[1], s.stride[2]};
}

// ---- small dense kernels (contiguous, vectorisable) ---------------------------------

// y += a·x, n elements. `omp simd` vectorises it at -O2 too; elementwise, so the
// result does not depend on the vector width.
template <class F>
inline void axpy(int64_t n, F a, const F* __restrict x, F* __restrict y) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

// y = a·y, n elements.
template <class F>
inline void scale_in_place(int64_t n, F a, F* y) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] *= a;
}

// x · y, n elements, sequential order (used by the O(T²) test-only quadratic form).
template <class F>
inline F dot(int64_t n, const F* x, const F* y) {
  F s = 0;
  for (int64_t i = 0; i < n; ++i) s += x[i] * y[i];
  return s;
}

// dst [c, r] = srcᵀ, src [r, c] row-major.
template <class F>
void transpose(const F* src, int64_t r, int64_t c, F* dst) {
  for (int64_t i = 0; i < r; ++i)
    for (int64_t j = 0; j < c; ++j) dst[j * r + i] = src[i * c + j];
}

// pw[m] = λ^m for m = 0..n, computed in double and cast to the compute dtype, so a
// decay factor never depends on a ratio of powers (no loss for fast decays).
template <class F>
void decay_powers(double lambda, int64_t n, F* pw) {
  for (int64_t m = 0; m <= n; ++m) pw[m] = static_cast<F>(std::pow(lambda, static_cast<double>(m)));
}

// ---- state I/O ----------------------------------------------------------------------

// S (contiguous [dk, dv]) = s[e, h], or 0 when s is undefined (S_0 = 0).
template <class F>
void load_state(const Tensor& s, int64_t e, int64_t h, int64_t dk, int64_t dv, F* S) {
  if (!s.defined()) {
    std::fill(S, S + dk * dv, F(0));
    return;
  }
  Rows<F> src = state_rows<F>(s, e, h);
  for (int64_t a = 0; a < dk; ++a) std::copy(src[a], src[a] + dv, S + a * dv);
}

// s[e, h] = S.
template <class F>
void store_state(const Tensor& s, int64_t e, int64_t h, int64_t dk, int64_t dv, const F* S) {
  Rows<F> dst = state_rows<F>(s, e, h);
  for (int64_t a = 0; a < dk; ++a) std::copy(S + a * dv, S + (a + 1) * dv, dst[a]);
}

// ---- chunk staging ------------------------------------------------------------------

// dst [len, d] (row-major) = mul · src rows [t0, t0+len).
template <class F>
void load_rows(Rows<F> src, int64_t t0, int64_t len, int64_t d, F mul, F* dst) {
  for (int64_t i = 0; i < len; ++i) {
    const F* s = src[t0 + i];
    F* o = dst + i * d;
    for (int64_t a = 0; a < d; ++a) o[a] = mul * s[a];
  }
}

// dst [d, ld] (column i = token i) = (src rows [t0, t0+len))ᵀ.
template <class F>
void load_cols(Rows<F> src, int64_t t0, int64_t len, int64_t d, int64_t ld, F* dst) {
  for (int64_t i = 0; i < len; ++i) {
    const F* s = src[t0 + i];
    for (int64_t a = 0; a < d; ++a) dst[a * ld + i] = s[a];
  }
}

// The operands of one (b, h) work item.
template <class F>
struct HeadIn {
  Rows<F> q, k, v;
  int64_t n_tok, dk, dv;
  F scale;
  double lambda;
};

// ---- chunk math (docs/model.md §4, chunked form) -------------------------------------

// out[i][j] = λ^{i−j} (x_i · y_j) for 0 ≤ j ≤ i < len (the masked intra-chunk "attention"
// matrix); entries j > i are left untouched and never read. x [len, d] row-major,
// yt [d, ld] holds y transposed; out has leading dimension ld.
template <class F>
void masked_decayed_scores(const F* x, const F* yt, int64_t len, int64_t d, int64_t ld, const F* pw,
                           F* out) {
  for (int64_t i = 0; i < len; ++i) {
    F* row = out + i * ld;
    std::fill(row, row + i + 1, F(0));
    for (int64_t a = 0; a < d; ++a) axpy(i + 1, x[i * d + a], yt + a * ld, row);
    for (int64_t j = 0; j <= i; ++j) row[j] *= pw[i - j];
  }
}

// o_i = λ^{i+1} qs_i S_n + Σ_{j≤i} A_ij v_j  (docs/model.md §4: chunked output), written to o rows
// [t0, t0+len). qs [len, dk], v [len, dv], A from masked_decayed_scores(qs, kᵀ).
template <class F>
void chunk_outputs(const F* qs, const F* v, const F* A, const F* S, int64_t len, int64_t dk,
                   int64_t dv, int64_t ld, const F* pw, Rows<F> o, int64_t t0) {
  for (int64_t i = 0; i < len; ++i) {
    F* out = o[t0 + i];
    std::fill(out, out + dv, F(0));
    const F w = pw[i + 1];
    for (int64_t a = 0; a < dk; ++a) axpy(dv, w * qs[i * dk + a], S + a * dv, out);
    for (int64_t j = 0; j <= i; ++j) axpy(dv, A[i * ld + j], v + j * dv, out);
  }
}

// S ← λ^L S + Σ_j λ^{L−1−j} k_jᵀ v_j  (SPEC: chunked state update, L = actual length).
// kt [dk, ld] is k transposed, v [len, dv].
template <class F>
void chunk_state_update(F* S, const F* kt, const F* v, int64_t len, int64_t dk, int64_t dv,
                        int64_t ld, const F* pw) {
  for (int64_t a = 0; a < dk; ++a) {
    F* srow = S + a * dv;
    scale_in_place(dv, pw[len], srow);
    for (int64_t j = 0; j < len; ++j) axpy(dv, pw[len - 1 - j] * kt[a * ld + j], v + j * dv, srow);
  }
}

// Scratch of the chunked forward, sized for chunks of C tokens.
template <class F>
struct ForwardScratch {
  std::vector<F> pw, qs, kt, v, A;
  ForwardScratch(int64_t C, int64_t dk, int64_t dv)
      : pw(C + 1), qs(C * dk), kt(dk * C), v(C * dv), A(C * C) {}
};

// Chunked form over all tokens of one head; S holds S_0 on entry and S_T on exit.
// Chunks longer than the sequence are clamped (same result, smaller scratch).
template <class F>
void chunked_forward_head(const HeadIn<F>& in, int64_t chunk, F* S, Rows<F> o) {
  const int64_t dk = in.dk, dv = in.dv;
  const int64_t C = std::max<int64_t>(1, std::min(chunk, in.n_tok));
  ForwardScratch<F> w(C, dk, dv);
  decay_powers(in.lambda, C, w.pw.data());
  for (int64_t t0 = 0; t0 < in.n_tok; t0 += C) {
    const int64_t len = std::min(C, in.n_tok - t0);
    load_rows(in.q, t0, len, dk, in.scale, w.qs.data());
    load_cols(in.k, t0, len, dk, C, w.kt.data());
    load_rows(in.v, t0, len, dv, F(1), w.v.data());
    masked_decayed_scores(w.qs.data(), w.kt.data(), len, dk, C, w.pw.data(), w.A.data());
    chunk_outputs(w.qs.data(), w.v.data(), w.A.data(), S, len, dk, dv, C, w.pw.data(), o, t0);
    chunk_state_update(S, w.kt.data(), w.v.data(), len, dk, dv, C, w.pw.data());
  }
}

// ---- recurrent and quadratic forms --------------------------------------------------

// Recurrent form, one token at a time: S_t = λ S_{t−1} + k_tᵀ v_t; o_t = qs_t S_t.
template <class F>
void recurrent_forward_head(const HeadIn<F>& in, F* S, Rows<F> o) {
  const int64_t dk = in.dk, dv = in.dv;
  const F lam = static_cast<F>(in.lambda);
  for (int64_t t = 0; t < in.n_tok; ++t) {
    const F* k = in.k[t];
    const F* v = in.v[t];
    const F* q = in.q[t];
    F* out = o[t];
    std::fill(out, out + dv, F(0));
    for (int64_t a = 0; a < dk; ++a) {
      F* srow = S + a * dv;
      scale_in_place(dv, lam, srow);
      axpy(dv, k[a], v, srow);
      axpy(dv, in.scale * q[a], srow, out);
    }
  }
}

// Quadratic form (tests only): o_t = λ^{t+1} qs_t S_0 + Σ_{s≤t} λ^{t−s} (qs_t·k_s) v_s, and the
// closed-form final state S_T = λ^T S_0 + Σ_s λ^{T−1−s} k_sᵀ v_s. O(T²) per head.
template <class F>
void quadratic_forward_head(const HeadIn<F>& in, F* S, Rows<F> o) {
  const int64_t n = in.n_tok, dk = in.dk, dv = in.dv;
  std::vector<F> pw(n + 1), qs(dk);
  decay_powers(in.lambda, n, pw.data());
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t a = 0; a < dk; ++a) qs[a] = in.scale * in.q[t][a];
    F* out = o[t];
    std::fill(out, out + dv, F(0));
    for (int64_t a = 0; a < dk; ++a) axpy(dv, pw[t + 1] * qs[a], S + a * dv, out);
    for (int64_t s = 0; s <= t; ++s)
      axpy(dv, pw[t - s] * dot(dk, qs.data(), in.k[s]), in.v[s], out);
  }
  for (int64_t a = 0; a < dk; ++a) {
    F* srow = S + a * dv;
    scale_in_place(dv, pw[n], srow);
    for (int64_t s = 0; s < n; ++s) axpy(dv, pw[n - 1 - s] * in.k[s][a], in.v[s], srow);
  }
}

// ---- backward (chunked form) --------------------------------------------------------
//
// Per chunk with entering state S_n and gradient dS = ∂L/∂S_{n+1} (A_ij = λ^{i−j} qs_i·k_j,
// dP_ij = λ^{i−j} dO_i·v_j, both for j ≤ i):
//   dqs_i = λ^{i+1} dO_i S_nᵀ + Σ_{j≤i} dP_ij k_j,                 dq_i = scale · dqs_i
//   dk_j  = Σ_{i≥j} dP_ij qs_i + λ^{L−1−j} v_j dSᵀ
//   dv_j  = Σ_{i≥j} A_ij dO_i  + λ^{L−1−j} k_j dS
//   dS_n  = λ^L dS + Σ_i λ^{i+1} qs_iᵀ dO_i
// Pass 1 recomputes the entering states S_n from s_in (stored transposed); pass 2 walks
// the chunks in reverse carrying dS. Cost O(T·C·(dk+dv) + T·dk·dv) per head.

template <class F>
struct BackwardScratch {
  std::vector<F> pw, states_t, S, dS, dSt, qs, k, kt, v, vt, dO, A, dP;
  BackwardScratch(int64_t C, int64_t n_chunks, int64_t dk, int64_t dv)
      : pw(C + 1),
        states_t(n_chunks * dv * dk),
        S(dk * dv),
        dS(dk * dv),
        dSt(dv * dk),
        qs(C * dk),
        k(C * dk),
        kt(dk * C),
        v(C * dv),
        vt(dv * C),
        dO(C * dv),
        A(C * C),
        dP(C * C) {}
};

// dq rows [t0, t0+len): dq_i = scale · (λ^{i+1} dO_i S_nᵀ + Σ_{j≤i} dP_ij k_j); St = S_nᵀ [dv, dk].
template <class F>
void chunk_dq(const BackwardScratch<F>& w, const F* St, int64_t len, int64_t dk, int64_t dv,
              int64_t ld, F scale, Rows<F> dq, int64_t t0) {
  for (int64_t i = 0; i < len; ++i) {
    F* out = dq[t0 + i];
    std::fill(out, out + dk, F(0));
    const F pwi = w.pw[i + 1];
    for (int64_t c = 0; c < dv; ++c) axpy(dk, pwi * w.dO[i * dv + c], St + c * dk, out);
    for (int64_t j = 0; j <= i; ++j) axpy(dk, w.dP[i * ld + j], w.k.data() + j * dk, out);
    scale_in_place(dk, scale, out);
  }
}

// dk_j = Σ_{i≥j} dP_ij qs_i + λ^{L−1−j} v_j dSᵀ and dv_j = Σ_{i≥j} A_ij dO_i + λ^{L−1−j} k_j dS,
// written to rows [t0, t0+len) (dS = ∂L/∂S_{n+1}, dSt its transpose).
template <class F>
void chunk_dk_dv(const BackwardScratch<F>& w, int64_t len, int64_t dk, int64_t dv, int64_t ld,
                 Rows<F> dk_out, Rows<F> dv_out, int64_t t0) {
  for (int64_t j = 0; j < len; ++j) {
    const F pwj = w.pw[len - 1 - j];
    F* gk = dk_out[t0 + j];
    std::fill(gk, gk + dk, F(0));
    for (int64_t i = j; i < len; ++i) axpy(dk, w.dP[i * ld + j], w.qs.data() + i * dk, gk);
    for (int64_t c = 0; c < dv; ++c) axpy(dk, pwj * w.v[j * dv + c], w.dSt.data() + c * dk, gk);
    F* gv = dv_out[t0 + j];
    std::fill(gv, gv + dv, F(0));
    for (int64_t i = j; i < len; ++i) axpy(dv, w.A[i * ld + j], w.dO.data() + i * dv, gv);
    for (int64_t a = 0; a < dk; ++a) axpy(dv, pwj * w.k[j * dk + a], w.dS.data() + a * dv, gv);
  }
}

// dS ← λ^L dS + Σ_i λ^{i+1} qs_iᵀ dO_i  (gradient into the state entering the chunk).
template <class F>
void chunk_dstate(BackwardScratch<F>& w, int64_t len, int64_t dk, int64_t dv) {
  for (int64_t a = 0; a < dk; ++a) {
    F* row = w.dS.data() + a * dv;
    scale_in_place(dv, w.pw[len], row);
    for (int64_t i = 0; i < len; ++i)
      axpy(dv, w.pw[i + 1] * w.qs[i * dk + a], w.dO.data() + i * dv, row);
  }
}

// Outputs of one (b, h) work item of the backward.
template <class F>
struct HeadGrads {
  Rows<F> d_o, dq, dk, dv;
};

// Both passes for one head; w.S holds S_0 and w.dS holds ∂L/∂S_T on entry, w.dS holds
// ∂L/∂S_0 on exit.
template <class F>
void chunked_backward_head(const HeadIn<F>& in, int64_t C, BackwardScratch<F>& w, HeadGrads<F> g) {
  const int64_t dk = in.dk, dv = in.dv, n = in.n_tok;
  const int64_t n_chunks = (n + C - 1) / C;
  decay_powers(in.lambda, C, w.pw.data());
  // Pass 1: S_{n+1} = λ^L S_n + Σ_j λ^{L−1−j} k_jᵀ v_j; keep S_nᵀ for the dq term.
  for (int64_t c = 0; c < n_chunks; ++c) {
    const int64_t t0 = c * C, len = std::min(C, n - t0);
    transpose(w.S.data(), dk, dv, w.states_t.data() + c * dv * dk);
    load_cols(in.k, t0, len, dk, C, w.kt.data());
    load_rows(in.v, t0, len, dv, F(1), w.v.data());
    chunk_state_update(w.S.data(), w.kt.data(), w.v.data(), len, dk, dv, C, w.pw.data());
  }
  // Pass 2: chunks in reverse, dS = ∂L/∂S_{c+1} on entry to each step.
  for (int64_t c = n_chunks - 1; c >= 0; --c) {
    const int64_t t0 = c * C, len = std::min(C, n - t0);
    load_rows(in.q, t0, len, dk, in.scale, w.qs.data());
    load_rows(in.k, t0, len, dk, F(1), w.k.data());
    load_cols(in.k, t0, len, dk, C, w.kt.data());
    load_rows(in.v, t0, len, dv, F(1), w.v.data());
    load_cols(in.v, t0, len, dv, C, w.vt.data());
    load_rows(g.d_o, t0, len, dv, F(1), w.dO.data());
    masked_decayed_scores(w.qs.data(), w.kt.data(), len, dk, C, w.pw.data(), w.A.data());
    masked_decayed_scores(w.dO.data(), w.vt.data(), len, dv, C, w.pw.data(), w.dP.data());
    transpose(w.dS.data(), dk, dv, w.dSt.data());
    chunk_dq(w, w.states_t.data() + c * dv * dk, len, dk, dv, C, in.scale, g.dq, t0);
    chunk_dk_dv(w, len, dk, dv, C, g.dk, g.dv, t0);
    chunk_dstate(w, len, dk, dv);
  }
}

// ---- argument checks ----------------------------------------------------------------

void check_cpu_float(const Tensor& t, DType dt, int ndim) {
  LAPLACE_CHECK(t.device == Device::kCPU, "gla: tensor is not on the CPU");
  LAPLACE_CHECK(t.dtype == dt, "gla: all float tensors must share q's dtype (F32 or F64)");
  LAPLACE_CHECK(t.ndim == ndim, "gla: wrong number of dimensions");
  LAPLACE_CHECK(t.stride[ndim - 1] == 1, "gla: innermost dimension must be contiguous");
}

// q,k [B,T,H,dk], v,o [B,T,H,dv] (or d_o/dq/dk/dv in the backward).
void check_qkv(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o) {
  LAPLACE_CHECK(q.dtype == DType::kF32 || q.dtype == DType::kF64,
                "gla: CPU computes in F32 or F64");
  for (const Tensor* t : {&q, &k, &v, &o}) check_cpu_float(*t, q.dtype, 4);
  LAPLACE_CHECK(same_shape(q, k), "gla: q and k shapes differ");
  for (int d = 0; d < 3; ++d) {
    LAPLACE_CHECK(v.shape[d] == q.shape[d], "gla: v must be [B,T,H,dv] like q");
    LAPLACE_CHECK(o.shape[d] == q.shape[d], "gla: o must be [B,T,H,dv] like q");
  }
  LAPLACE_CHECK(o.shape[3] == v.shape[3], "gla: o and v head dims differ");
}

// A state tensor [S,H,dk,dv] with at least min_entries entries.
void check_state(const Tensor& s, const Tensor& q, const Tensor& v, int64_t min_entries) {
  if (!s.defined()) return;
  check_cpu_float(s, q.dtype, 4);
  LAPLACE_CHECK(s.shape[0] >= min_entries, "gla: state tensor has too few entries");
  LAPLACE_CHECK(s.shape[1] == q.shape[2] && s.shape[2] == q.shape[3] && s.shape[3] == v.shape[3],
                "gla: state must be [S,H,dk,dv]");
}

void check_params(const GlaParams& p, int64_t H) {
  LAPLACE_CHECK(static_cast<int64_t>(p.decay.size()) == H, "gla: need one decay per head");
  LAPLACE_CHECK(p.form != GlaForm::kChunked || p.chunk >= 1, "gla: chunk size must be >= 1");
}

// Pool entry used by batch row b: slots[b], or b when slots is undefined.
int64_t slot_of(const Tensor& slots, int64_t b) {
  if (!slots.defined()) return b;
  return static_cast<const int32_t*>(slots.data)[b * slots.stride[0]];
}

void check_slots(const Tensor& slots, int64_t B, const Tensor& s_in, const Tensor& s_out) {
  if (!slots.defined()) {
    for (const Tensor* s : {&s_in, &s_out})
      LAPLACE_CHECK(!s->defined() || s->shape[0] >= B, "gla: state pool smaller than the batch");
    return;
  }
  LAPLACE_CHECK(slots.dtype == DType::kI32 && slots.ndim == 1 && slots.shape[0] == B,
                "gla: slots must be [B] I32");
  for (int64_t b = 0; b < B; ++b) {
    const int64_t e = slot_of(slots, b);
    for (const Tensor* s : {&s_in, &s_out})
      LAPLACE_CHECK(!s->defined() || (e >= 0 && e < s->shape[0]), "gla: slot index out of range");
  }
}

// ---- documents kept apart (GlaParams::doc) --------------------------------------------
//
// A row with document starts runs as its documents one after another, each from a zero
// state (the first from s_in when it began before the row): the same chunk alignment and
// sums as each document run alone, so a packed row gives the bits of its documents run one
// by one.

struct Segment {
  int64_t begin, end;
  bool from_initial;  // continues the row's initial state (doc = −1)
};

void check_doc(const Tensor& doc, int64_t B, int64_t T) {
  if (!doc.defined()) return;
  LAPLACE_CHECK(doc.device == Device::kCPU && doc.dtype == DType::kI32 && doc.ndim == 2 && doc.shape[0] == B &&
                    doc.shape[1] == T && doc.stride[1] == 1,
                "gla: doc must be [B, T] I32 on the CPU, contiguous in T");
  for (int64_t b = 0; b < B; ++b) {
    const int32_t* d = static_cast<const int32_t*>(doc.data) + b * doc.stride[0];
    for (int64_t t = 0; t < T; ++t)
      LAPLACE_CHECK(t == 0 ? (d[0] == -1 || d[0] == 0) : (d[t] == d[t - 1] || d[t] == t),
                    "gla: doc is not a valid document-start row (core/doc_starts.h)");
  }
}

std::vector<Segment> row_segments(const Tensor& doc, int64_t b, int64_t T) {
  if (!doc.defined() || T == 0) return {{0, T, true}};
  const int32_t* d = static_cast<const int32_t*>(doc.data) + b * doc.stride[0];
  std::vector<Segment> segs;
  int64_t begin = 0;
  for (int64_t t = 1; t <= T; ++t)
    if (t == T || d[t] == t) {
      segs.push_back({begin, t, d[begin] == -1});
      begin = t;
    }
  return segs;
}

template <class F>
Rows<F> shifted(Rows<F> r, int64_t t0) {
  return {r.base + t0 * r.ts, r.ts};
}

template <class F>
HeadIn<F> segment_in(HeadIn<F> in, const Segment& s) {
  in.q = shifted(in.q, s.begin);
  in.k = shifted(in.k, s.begin);
  in.v = shifted(in.v, s.begin);
  in.n_tok = s.end - s.begin;
  return in;
}

// ---- typed drivers ------------------------------------------------------------------

template <class F>
HeadIn<F> head_in(const GlaParams& p, const Tensor& q, const Tensor& k, const Tensor& v, int64_t b,
                  int64_t h) {
  return {head_rows<F>(q, b, h),
          head_rows<F>(k, b, h),
          head_rows<F>(v, b, h),
          q.shape[1],
          q.shape[3],
          v.shape[3],
          static_cast<F>(p.scale),
          p.decay[static_cast<size_t>(h)]};
}

template <class F>
void forward_typed(const GlaParams& p, const Tensor& q, const Tensor& k, const Tensor& v, Tensor o,
                   const Tensor& s_in, Tensor s_out, const Tensor& slots) {
  const int64_t B = q.shape[0], H = q.shape[2], dk = q.shape[3], dv = v.shape[3];
#pragma omp parallel for schedule(static)
  for (int64_t bh = 0; bh < B * H; ++bh) {
    const int64_t b = bh / H, h = bh % H, e = slot_of(slots, b);
    const HeadIn<F> in = head_in<F>(p, q, k, v, b, h);
    const Rows<F> out = head_rows<F>(o, b, h);
    // The whole initial state is read before anything is written: s_out may alias s_in.
    std::vector<F> S(dk * dv);
    for (const Segment& sg : row_segments(p.doc, b, q.shape[1])) {
      if (sg.from_initial) load_state(s_in, e, h, dk, dv, S.data());
      else std::fill(S.begin(), S.end(), F(0));
      const HeadIn<F> si = segment_in(in, sg);
      const Rows<F> so = shifted(out, sg.begin);
      switch (p.form) {
        case GlaForm::kQuadratic: quadratic_forward_head(si, S.data(), so); break;
        case GlaForm::kRecurrent: recurrent_forward_head(si, S.data(), so); break;
        case GlaForm::kChunked: chunked_forward_head(si, p.chunk, S.data(), so); break;
      }
    }
    if (s_out.defined()) store_state(s_out, e, h, dk, dv, S.data());
  }
}

template <class F>
void backward_typed(const GlaParams& p, const Tensor& q, const Tensor& k, const Tensor& v,
                    const Tensor& s_in, const Tensor& d_o, const Tensor& ds_out, Tensor dq,
                    Tensor dk, Tensor dv, Tensor ds_in) {
  const int64_t B = q.shape[0], T = q.shape[1], H = q.shape[2], Dk = q.shape[3], Dv = v.shape[3];
  const int64_t C = std::max<int64_t>(1, std::min(p.chunk, std::max<int64_t>(T, 1)));
  const int64_t n_chunks = (T + C - 1) / C;
#pragma omp parallel for schedule(static)
  for (int64_t bh = 0; bh < B * H; ++bh) {
    const int64_t b = bh / H, h = bh % H;
    BackwardScratch<F> w(C, n_chunks, Dk, Dv);
    const HeadGrads<F> g{head_rows<F>(d_o, b, h), head_rows<F>(dq, b, h), head_rows<F>(dk, b, h),
                         head_rows<F>(dv, b, h)};
    const HeadIn<F> in = head_in<F>(p, q, k, v, b, h);
    // Documents in reverse: ∂L/∂S_T enters the last; each earlier one ends in a reset, so
    // nothing flows into its final state; only a first one that continues s_in gives ds_in.
    const std::vector<Segment> segs = row_segments(p.doc, b, T);
    bool ds_in_set = false;
    for (size_t i = segs.size(); i-- > 0;) {
      const Segment& sg = segs[i];
      if (sg.from_initial) load_state(s_in, b, h, Dk, Dv, w.S.data());
      else std::fill(w.S.begin(), w.S.end(), F(0));
      if (i + 1 == segs.size()) load_state(ds_out, b, h, Dk, Dv, w.dS.data());
      else std::fill(w.dS.begin(), w.dS.end(), F(0));
      const HeadGrads<F> gs{shifted(g.d_o, sg.begin), shifted(g.dq, sg.begin), shifted(g.dk, sg.begin),
                            shifted(g.dv, sg.begin)};
      chunked_backward_head(segment_in(in, sg), C, w, gs);
      if (i == 0 && sg.from_initial) ds_in_set = true;
    }
    if (ds_in.defined()) {
      if (!ds_in_set) std::fill(w.dS.begin(), w.dS.end(), F(0));
      store_state(ds_in, b, h, Dk, Dv, w.dS.data());
    }
  }
}

// ---- deferred write-back (ops/backend.h GlaPending; docs/serving.md §4) ----------------
//
// Per pool entry e and head h, with the count word (m, d) (ops/backend.h), m pending pairs
// (k_j, v_j) and qs = scale·q:
//   true state  T = λ^m S + Σ_{j<m} λ^{m−1−j} k_jᵀ v_j
//   decode, m + 1 + d < R:  o = λ^{m+1} (qs S) + Σ_{j<m} λ^{m−j} (qs·k_j) v_j + (qs·k) v;
//                           pair m ← (k, v), m ← m + 1; S untouched
//   decode, m + 1 + d = R:  S ← λ^{m+1} S + Σ_{j<m} λ^{m−j} k_jᵀ v_j + kᵀ v; o = qs S; m, d ← 0
//   flush:                  S ← T; m ← 0, d ← pending_phase(h, R)
// The CUDA kernels sum in another order, so the two agree to rounding only.

using deferred::head_pending;
using deferred::HeadPending;
using deferred::kMaxPendingSteps;
using deferred::pending_count;

template <class F>
void deferred_decode_typed(const GlaParams& p, const Tensor& q, const Tensor& k, const Tensor& v, Tensor states,
                           const GlaPending& pend, const Tensor& slots, Tensor o) {
  const int64_t B = q.shape[0], H = q.shape[2], dk = q.shape[3], dv = v.shape[3], R = pend.steps;
#pragma omp parallel for schedule(static)
  for (int64_t bh = 0; bh < B * H; ++bh) {
    const int64_t b = bh / H, h = bh % H, e = slot_of(slots, b);
    const F* qr = head_rows<F>(q, b, h)[0];
    const F* kr = head_rows<F>(k, b, h)[0];
    const F* vr = head_rows<F>(v, b, h)[0];
    F* out = head_rows<F>(o, b, h)[0];
    const Rows<F> S = state_rows<F>(states, e, h);
    const HeadPending<F> pp = head_pending<F>(pend, e, h);
    int64_t m = 0, d = 0;
    pending_count(pp.count, R, &m, &d);
    F pw[kMaxPendingSteps + 1];
    deferred::decay_powers(p.decay[h], R, pw);
    std::vector<F> qs(dk);
    for (int64_t i = 0; i < dk; ++i) qs[i] = static_cast<F>(p.scale) * qr[i];
    const F* kp[kMaxPendingSteps];
    const F* vp[kMaxPendingSteps];
    for (int64_t j = 0; j < m; ++j) {
      kp[j] = pp.k + j * dk;
      vp[j] = pp.v + j * dv;
    }
    if (m + 1 + d == R) {  // the write-back step
      deferred::write_back(qs.data(), S[0], S.ts, S[0], S.ts, dk, dv, m, pw, kp, vp, kr, vr, out);
      *pp.count = 0;
      continue;
    }
    deferred::pending_output(qs.data(), S[0], S.ts, dk, dv, m, pw, kp, vp, kr, vr, out);
    std::copy(kr, kr + dk, pp.k + m * dk);
    std::copy(vr, vr + dv, pp.v + m * dv);
    *pp.count = pending_word(static_cast<int32_t>(m + 1), static_cast<int32_t>(d));
  }
}

template <class F>
void pending_flush_typed(const GlaParams& p, Tensor states, const GlaPending& pend, const Tensor& slots) {
  const int64_t B = slots.shape[0], H = states.shape[1], dk = states.shape[2], dv = states.shape[3];
#pragma omp parallel for schedule(static)
  for (int64_t bh = 0; bh < B * H; ++bh) {
    const int64_t b = bh / H, h = bh % H, e = slot_of(slots, b);
    const HeadPending<F> pp = head_pending<F>(pend, e, h);
    int64_t m = 0, d = 0;
    pending_count(pp.count, pend.steps, &m, &d);
    *pp.count = pending_word(0, pending_phase(h, pend.steps));
    if (m == 0) continue;
    F pw[kMaxPendingSteps + 1];
    decay_powers(p.decay[h], m, pw);
    const Rows<F> S = state_rows<F>(states, e, h);
    for (int64_t i = 0; i < dk; ++i) {
      F* row = S[i];
      for (int64_t x = 0; x < dv; ++x) {
        F t = pw[m] * row[x];
        for (int64_t j = 0; j < m; ++j) t += pw[m - 1 - j] * pp.k[j * dk + i] * pp.v[j * dv + x];
        row[x] = t;
      }
    }
  }
}

// Pairs [S, H, R−1, d] in the states' dtype with contiguous pairs, counts [S, H] I32, on the CPU.
void check_pending(const GlaPending& p, const Tensor& states) {
  const int64_t S = states.shape[0], H = states.shape[1], dk = states.shape[2], dv = states.shape[3];
  LAPLACE_CHECK(p.steps >= 2 && p.steps <= kMaxPendingSteps, "gla deferred: R must be in [2, 16]");
  check_cpu_float(p.k, states.dtype, 4);
  check_cpu_float(p.v, states.dtype, 4);
  LAPLACE_CHECK(p.count.device == Device::kCPU && p.count.dtype == DType::kI32 && p.count.ndim == 2 &&
                    p.count.shape[0] == S && p.count.shape[1] == H && p.count.stride[1] == 1,
                "gla deferred: count must be [S, H] I32");
  LAPLACE_CHECK(p.k.shape[0] == S && p.k.shape[1] == H && p.k.shape[2] == p.steps - 1 && p.k.shape[3] == dk &&
                    p.k.stride[2] == dk,
                "gla deferred: pending k must be [S, H, R−1, dk] with contiguous pairs");
  LAPLACE_CHECK(p.v.shape[0] == S && p.v.shape[1] == H && p.v.shape[2] == p.steps - 1 && p.v.shape[3] == dv &&
                    p.v.stride[2] == dv,
                "gla deferred: pending v must be [S, H, R−1, dv] with contiguous pairs");
}

}  // namespace

void gla_forward(const GlaParams& p, const Tensor& q, const Tensor& k, const Tensor& v, Tensor o,
                 const Tensor& s_in, Tensor s_out, const Tensor& slots) {
  check_qkv(q, k, v, o);
  check_params(p, q.shape[2]);
  check_state(s_in, q, v, 0);
  check_state(s_out, q, v, 0);
  check_slots(slots, q.shape[0], s_in, s_out);
  check_doc(p.doc, q.shape[0], q.shape[1]);
  if (q.dtype == DType::kF64)
    forward_typed<double>(p, q, k, v, o, s_in, s_out, slots);
  else
    forward_typed<float>(p, q, k, v, o, s_in, s_out, slots);
}

void gla_backward(const GlaParams& p, const Tensor& q, const Tensor& k, const Tensor& v,
                  const Tensor& s_in, const Tensor& d_o, const Tensor& ds_out, Tensor dq, Tensor dk,
                  Tensor dv, Tensor ds_in) {
  check_qkv(q, k, v, d_o);
  check_qkv(dq, dk, dv, d_o);
  LAPLACE_CHECK(dq.dtype == q.dtype && same_shape(dq, q) && same_shape(dv, v),
                "gla: gradients must match their inputs");
  LAPLACE_CHECK(p.chunk >= 1, "gla: chunk size must be >= 1");
  LAPLACE_CHECK(static_cast<int64_t>(p.decay.size()) == q.shape[2], "gla: need one decay per head");
  const int64_t B = q.shape[0];
  check_state(s_in, q, v, B);
  check_state(ds_out, q, v, B);
  check_state(ds_in, q, v, B);
  check_doc(p.doc, B, q.shape[1]);
  if (q.dtype == DType::kF64)
    backward_typed<double>(p, q, k, v, s_in, d_o, ds_out, dq, dk, dv, ds_in);
  else
    backward_typed<float>(p, q, k, v, s_in, d_o, ds_out, dq, dk, dv, ds_in);
}

void gla_decode_deferred(const GlaParams& p, const Tensor& q, const Tensor& k, const Tensor& v, Tensor o,
                         Tensor states, const GlaPending& pend, const Tensor& slots) {
  check_qkv(q, k, v, o);
  LAPLACE_CHECK(q.shape[1] == 1, "gla deferred: decode takes one token per sequence");
  check_params(p, q.shape[2]);
  LAPLACE_CHECK(states.defined(), "gla deferred: needs the states");
  check_state(states, q, v, 0);
  check_slots(slots, q.shape[0], states, Tensor{});
  check_pending(pend, states);
  if (q.dtype == DType::kF64)
    deferred_decode_typed<double>(p, q, k, v, states, pend, slots, o);
  else
    deferred_decode_typed<float>(p, q, k, v, states, pend, slots, o);
}

void gla_pending_flush(const GlaParams& p, Tensor states, const GlaPending& pend, const Tensor& slots) {
  LAPLACE_CHECK(states.defined() && (states.dtype == DType::kF32 || states.dtype == DType::kF64),
                "gla deferred: states must be F32 or F64");
  check_cpu_float(states, states.dtype, 4);
  check_params(p, states.shape[1]);
  LAPLACE_CHECK(slots.defined(), "gla deferred: flush takes slots [B] I32");
  check_slots(slots, slots.shape[0], states, Tensor{});
  check_pending(pend, states);
  if (states.dtype == DType::kF64)
    pending_flush_typed<double>(p, states, pend, slots);
  else
    pending_flush_typed<float>(p, states, pend, slots);
}

}  // namespace laplace::cpu
