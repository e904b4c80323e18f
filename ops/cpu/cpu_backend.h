// CPU backend: every op of ops/backend.h in F32 and F64 (all float tensors of one call
// share the dtype), on strided views whose innermost stride is 1. The forward products x·Wᵀ
// go through cpu::gemm_rows (row-invariant: a row's bits do not depend on the batch), the
// other products through OpenBLAS; row loops are parallelised with OpenMP; every reduction (parameter
// gradients, embedding backward, sum_squares) runs in a fixed order that does not
// depend on the thread count, so results are bitwise identical for any OMP_NUM_THREADS.
// The GLA mixer forwards to ops/cpu/gla.h.
#pragma once

#include <memory>

#include "ops/backend.h"

namespace laplace {

class CpuBackend : public Backend {
 public:
  Device device() const override { return Device::kCPU; }
  const char* name() const override { return "cpu"; }
  Allocator& allocator() override;
  // Every op in F32 and F64 (the reference dtype of the cross-backend tests); copy converts
  // between any of F32, F64, BF16 and I32. No BF16 compute: a BF16 model runs on CUDA.
  bool supports(const OpQuery& q) const override;

  void copy(Tensor dst, const Tensor& src) override;
  void fill(Tensor dst, double value) override;
  void axpy(double alpha, const Tensor& x, Tensor y) override;
  void synchronize() override {}

  void gemm(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, Tensor c, double alpha,
            double beta) override;

  void quantize_rows_e4m3(const Tensor& x, Tensor q, Tensor s) override;
  void dequantize_rows_e4m3(const Tensor& q, const Tensor& s, Tensor w) override;
  void quantize_cols_e4m3(const Tensor& x, Tensor qt, Tensor s) override;
  void gemm_e4m3(const Tensor& xq, const Tensor& xs, const Tensor& wq, const Tensor& ws, const Tensor& c,
                 Tensor y, Fp8Accum accum) override;

  void embedding_forward(const Tensor& ids, const Tensor& table, Tensor out) override;
  void embedding_backward(const Tensor& ids, const Tensor& dout, Tensor dtable) override;

  void layernorm_forward(const Tensor& x, const Tensor& w, const Tensor& b, double eps, Tensor y,
                         Tensor mean, Tensor rstd) override;
  void layernorm_backward(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& mean,
                          const Tensor& rstd, Tensor dx, bool accumulate_dx, Tensor dw,
                          Tensor db) override;

  bool keeps_documents_apart() const override { return true; }

  void conv_silu_forward(const Tensor& u, const Tensor& w, Tensor c, Tensor pre,
                         const Tensor& win_in, Tensor win_out, const Tensor& slots, const Tensor& doc) override;
  void conv_silu_backward(const Tensor& dc, const Tensor& u, const Tensor& w, const Tensor& pre,
                          Tensor du, Tensor dw, const Tensor& doc) override;

  void gla_forward(const GlaParams& p, const Tensor& q, const Tensor& k, const Tensor& v, Tensor o,
                   const Tensor& s_in, Tensor s_out, const Tensor& slots) override;
  void gla_backward(const GlaParams& p, const Tensor& q, const Tensor& k, const Tensor& v,
                    const Tensor& s_in, const Tensor& d_o, const Tensor& ds_out, Tensor dq,
                    Tensor dk, Tensor dv, Tensor ds_in) override;

  void gla_decode_gate_deferred(const GlaParams& p, const Tensor& q, const Tensor& k, const Tensor& v,
                                const Tensor& g, const Tensor& w, double eps, Tensor states, const GlaPending& pend,
                                const Tensor& slots, Tensor o, Tensor y) override;
  void gla_pending_flush(const GlaParams& p, Tensor states, const GlaPending& pend, const Tensor& slots) override;
  void gla_verify_deferred(const GlaParams& p, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                           const Tensor& w, double eps, const Tensor& states, const GlaPending& pend,
                           const Tensor& slots, Tensor o, Tensor y) override;
  void gla_verify_commit(const GlaParams& p, const Tensor& k, const Tensor& v, const Tensor& accepted, Tensor states,
                         const GlaPending& pend, const Tensor& slots) override;

  void rmsnorm_gate_forward(const Tensor& o, const Tensor& g, const Tensor& w, double eps, Tensor y,
                            Tensor rstd) override;
  void rmsnorm_gate_backward(const Tensor& dy, const Tensor& o, const Tensor& g, const Tensor& w,
                             const Tensor& rstd, Tensor d_o, Tensor dg, Tensor dw) override;

  void swiglu_forward(const Tensor& ab, Tensor h) override;
  void swiglu_backward(const Tensor& dh, const Tensor& ab, Tensor dab) override;

  void argmax_rows(const Tensor& x, Tensor out) override;
  void cross_entropy_forward(const Tensor& logits, const Tensor& targets, Tensor losses) override;
  void cross_entropy_backward(const Tensor& logits, const Tensor& targets, double scale,
                              Tensor dlogits) override;

  double sum_squares(const Tensor& x) override;
  void row_sum_squares(const Tensor& x, Tensor out) override;
  void scale(Tensor x, double alpha) override;
  void adamw_update(Tensor w, const Tensor& g, Tensor m, Tensor v, const AdamWParams& p) override;
  void muon_momentum(const Tensor& g, Tensor m, Tensor u, double mu, bool nesterov) override;
  void muon_apply(Tensor w, const Tensor& o, double lr, double wd, double s) override;
  bool memory_info(size_t* free_bytes, size_t* total_bytes) override;  // host RAM (sysconf)
  void sum_squares_into(const Tensor& x, Tensor acc, bool accumulate) override;
  void grad_clip_scalars(const Tensor& ss, double max_norm, Tensor out) override;
  void scale_by(Tensor x, const Tensor& coef) override;
  void scale_by_inv_norm(Tensor x, const Tensor& ss, double eps) override;
  void adamw_update_gated(Tensor w, const Tensor& g, Tensor m, Tensor v, const AdamWParams& p,
                          const Tensor& skip) override;
  void muon_momentum_gated(const Tensor& g, Tensor m, Tensor u, double mu, bool nesterov,
                           const Tensor& skip) override;
  void muon_apply_gated(Tensor w, const Tensor& o, double lr, double wd, double s, const Tensor& skip) override;
  void loss_sum_into(const Tensor& losses, double count, Tensor acc, bool accumulate) override;
};

}  // namespace laplace
