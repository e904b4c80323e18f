// CPU GLA mixer kernels (docs/model.md §4), F32 and F64. The CPU backend forwards its
// gla_forward/gla_backward here; argument meanings are those of ops/backend.h.
#pragma once

#include "ops/backend.h"

namespace laplace::cpu {

void gla_forward(const GlaParams& p, const Tensor& q, const Tensor& k, const Tensor& v, Tensor o,
                 const Tensor& s_in, Tensor s_out, const Tensor& slots);

void gla_backward(const GlaParams& p, const Tensor& q, const Tensor& k, const Tensor& v,
                  const Tensor& s_in, const Tensor& d_o, const Tensor& ds_out, Tensor dq, Tensor dk,
                  Tensor dv, Tensor ds_in);

// Deferred write-back (ops/backend.h GlaPending): one decode step (T = 1) of o only, and
// the flush of slots' pending pairs into their states.
void gla_decode_deferred(const GlaParams& p, const Tensor& q, const Tensor& k, const Tensor& v, Tensor o,
                         Tensor states, const GlaPending& pend, const Tensor& slots);
void gla_pending_flush(const GlaParams& p, Tensor states, const GlaPending& pend, const Tensor& slots);

// Speculative verification (ops/backend.h gla_verify_deferred, o only; gla_verify.cpp) and its
// commit (gla_verify_commit.cpp); check_verify_args is their shared argument check.
void gla_verify_deferred(const GlaParams& p, const Tensor& q, const Tensor& k, const Tensor& v, Tensor o,
                         const Tensor& states, const GlaPending& pend, const Tensor& slots);
void gla_verify_commit(const GlaParams& p, const Tensor& k, const Tensor& v, const Tensor& accepted, Tensor states,
                       const GlaPending& pend, const Tensor& slots);
void check_verify_args(const Tensor& k, const Tensor& v, const Tensor& states, const GlaPending& pend,
                       const Tensor& slots);

}  // namespace laplace::cpu
