#include "ops/backend.h"

#include <string>

namespace laplace {

void Backend::gemm_add(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, const Tensor& c, Tensor d,
                       double alpha, double beta) {
  LAPLACE_CHECK(same_shape(c, d) && c.dtype == d.dtype, "gemm_add: c and d must have one shape and dtype");
  if (c.data != d.data) copy(d, c);
  gemm(a, trans_a, b, trans_b, d, alpha, beta);
}

void Backend::quantize_rows_e4m3(const Tensor&, Tensor, Tensor) {
  LAPLACE_CHECK(false, (std::string(name()) + " backend has no FP8 products (quantize_rows_e4m3)").c_str());
}

void Backend::dequantize_rows_e4m3(const Tensor&, const Tensor&, Tensor) {
  LAPLACE_CHECK(false, (std::string(name()) + " backend has no FP8 products (dequantize_rows_e4m3)").c_str());
}

void Backend::quantize_cols_e4m3(const Tensor&, Tensor, Tensor) {
  LAPLACE_CHECK(false, (std::string(name()) + " backend has no FP8 products (quantize_cols_e4m3)").c_str());
}

void Backend::quantize_rows_cols_e4m3(const Tensor& x, Tensor q, Tensor s, Tensor qt, Tensor st) {
  quantize_rows_e4m3(x, q, s);
  quantize_cols_e4m3(x, qt, st);
}

void Backend::swiglu_forward_e4m3(const Tensor& ab, Tensor h, Tensor q, Tensor s) {
  swiglu_forward(ab, h);
  quantize_rows_e4m3(h, q, s);
}

void Backend::layernorm_forward_e4m3(const Tensor& x, const Tensor& w, const Tensor& b, double eps, Tensor y,
                                     Tensor q, Tensor s) {
  layernorm_forward(x, w, b, eps, y, Tensor{}, Tensor{});
  quantize_rows_e4m3(y, q, s);
}

void Backend::gemm_e4m3(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, Tensor, Fp8Accum) {
  LAPLACE_CHECK(false, (std::string(name()) + " backend has no FP8 products (gemm_e4m3)").c_str());
}

void Backend::gla_decode_gate(const GlaParams& p, const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor& g, const Tensor& w, double eps, Tensor states, const Tensor& slots,
                              Tensor o, Tensor y) {
  GlaParams r = p;
  r.form = GlaForm::kRecurrent;
  gla_forward(r, q, k, v, o, states, states, slots);
  rmsnorm_gate_forward(o, g, w, eps, y, Tensor{});
}

void Backend::gla_decode_gate_deferred(const GlaParams&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                       const Tensor&, double, Tensor, const GlaPending&, const Tensor&, Tensor,
                                       Tensor) {
  LAPLACE_CHECK(false, "this backend has no deferred state write-back");
}

void Backend::gla_pending_flush(const GlaParams&, Tensor, const GlaPending&, const Tensor&) {
  LAPLACE_CHECK(false, "this backend has no deferred state write-back");
}

void Backend::gla_verify_deferred(const GlaParams&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                  const Tensor&, double, const Tensor&, const GlaPending&, const Tensor&, Tensor,
                                  Tensor) {
  LAPLACE_CHECK(false, (std::string(name()) + " backend has no speculative verification (gla_verify_deferred)").c_str());
}

void Backend::gla_verify_commit(const GlaParams&, const Tensor&, const Tensor&, const Tensor&, Tensor,
                                const GlaPending&, const Tensor&) {
  LAPLACE_CHECK(false, (std::string(name()) + " backend has no speculative verification (gla_verify_commit)").c_str());
}

bool is_backend_op(const std::string& op) {
  static const char* const kOps[] = {
      "copy", "fill", "axpy", "gemm", "gemm_add", "embedding_forward", "embedding_backward", "layernorm_forward",
      "layernorm_backward", "conv_silu_forward", "conv_silu_backward", "gla_forward", "gla_backward",
      "gla_decode_gate", "gla_decode_gate_deferred", "gla_pending_flush", "gla_verify_deferred", "gla_verify_commit",
      "rmsnorm_gate_forward",
      "rmsnorm_gate_backward", "swiglu_forward", "swiglu_backward", "argmax_rows", "cross_entropy_forward",
      "cross_entropy_backward", "sum_squares", "row_sum_squares", "scale", "adamw_update", "muon_momentum",
      "muon_apply", "sum_squares_into", "grad_clip_scalars", "scale_by", "scale_by_inv_norm", "adamw_update_gated",
      "muon_momentum_gated", "muon_apply_gated", "loss_sum_into", "quantize_rows_e4m3", "quantize_cols_e4m3",
      "quantize_rows_cols_e4m3", "dequantize_rows_e4m3", "gemm_e4m3"};
  for (const char* o : kOps)
    if (op == o) return true;
  return false;
}

}  // namespace laplace
