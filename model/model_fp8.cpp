// The Model's FP8 weights and products: the arenas of codes and scales, quantising the loaded
// (or, in FP8 training, the current) weights, the FP8 model file, and the projections that
// multiply in FP8 where a matrix has codes.
#include <algorithm>
#include <array>
#include <set>
#include <string>
#include <vector>

#include "core/safetensors.h"
#include "model/model.h"
#include "model/quantize.h"

namespace laplace {

namespace {

constexpr const char* kFp8Kinds[4] = {"wqkvg", "wo", "w12", "w3"};  // Fp8Matrix order per layer

std::string body_name(int64_t layer, int kind) {
  return "model.layers." + std::to_string(layer) + "." + kFp8Kinds[kind] + ".weight";
}

// Codes and scales of every body matrix [n, k], per layer in kFp8Kinds order: per row ([n, k]
// and [n]) or, transposed, per column ([k, n] and [k]).
std::vector<TensorSpec> fp8_matrix_specs(const Config& c, bool transposed) {
  const std::vector<TensorSpec> w = weight_specs(c, DType::kF32);
  std::vector<TensorSpec> s;
  for (int64_t l = 0; l < c.num_layers; ++l)
    for (int k = 0; k < 4; ++k) {
      const std::string n = body_name(l, k);
      const auto it = std::find_if(w.begin(), w.end(), [&](const TensorSpec& t) { return t.name == n; });
      LAPLACE_CHECK(it != w.end(), "FP8 weights: a body matrix is missing from the weight table");
      const int64_t rows = it->shape[0], cols = it->shape[1];
      if (transposed) {
        s.push_back({n + ".t", DType::kF8E4M3, {cols, rows}});
        s.push_back({n + ".t_scale", DType::kF32, {cols}});
      } else {
        s.push_back({n, DType::kF8E4M3, {rows, cols}});
        s.push_back({fp8_scale_name(n), DType::kF32, {rows}});
      }
    }
  return s;
}

// The projections' input codes [N, max K] and scales [N].
std::vector<TensorSpec> fp8_input_specs(const Config& c, int64_t N) {
  const int64_t K = std::max({c.hidden_size, c.v_dim(), c.ffn_size});
  return {{"fp8_xq", DType::kF8E4M3, {N, K}}, {"fp8_xs", DType::kF32, {N}}};
}

// The gradient products' operands: dY per row [N, max out] and per column [max out, N], X per
// column [max in, N], with their scales.
std::vector<TensorSpec> fp8_grad_specs(const Config& c, int64_t N) {
  const int64_t D = c.hidden_size, F = c.ffn_size;
  const int64_t out = std::max({c.qkvg_rows(), D, 2 * F}), in = std::max({D, c.v_dim(), F});
  return {{"fp8_dyq", DType::kF8E4M3, {N, out}}, {"fp8_dys", DType::kF32, {N}},
          {"fp8_dytq", DType::kF8E4M3, {out, N}}, {"fp8_dyts", DType::kF32, {out}},
          {"fp8_xtq", DType::kF8E4M3, {in, N}},   {"fp8_xts", DType::kF32, {in}}};
}


// Per layer, the body matrices' (codes, scales) views of an arena of fp8_matrix_specs.
template <typename Matrix>
std::vector<std::array<Matrix, 4>> fp8_layer_views(const Arena& a, int64_t layers) {
  std::vector<std::array<Matrix, 4>> v(static_cast<size_t>(layers));
  for (int64_t l = 0; l < layers; ++l)
    for (int k = 0; k < 4; ++k) {
      const size_t j = static_cast<size_t>((l * 4 + k) * 2);
      v[l][k] = {a.tensor(j), a.tensor(j + 1)};
    }
  return v;
}

}  // namespace

Status Model::plan_fp8(bool training) {
  if (fp8_on_) {
    if (training) return Status::unsupported("FP8 weights serve inference plans only, not training");
    LAPLACE_RETURN_IF_ERROR(plan_fp8_inputs());
  }
  if (fp8_train_) {
    if (!training) return Status::unsupported("FP8 training needs a training plan");
    LAPLACE_RETURN_IF_ERROR(plan_fp8_inputs());
    // dW = dYᵀ·X contracts over the tokens.
    const int64_t N = plan_rows_;
    if (!be_->supports({"gemm_e4m3", dtype_, {std::max({cfg_.hidden_size, cfg_.v_dim(), cfg_.ffn_size}), N}}))
      return Status::unsupported("FP8 training on " + std::string(be_->name()) + " needs a multiple of 16 tokens per "
                                 "micro-batch, not " + std::to_string(N));
    LAPLACE_RETURN_IF_ERROR(fp8_grads_.create(fp8_grad_specs(cfg_, N), be_->allocator(), "FP8 gradient operands"));
    Tensor* dst[] = {&fp8_dyq_, &fp8_dys_, &fp8_dytq_, &fp8_dyts_, &fp8_xtq_, &fp8_xts_};
    for (size_t i = 0; i < fp8_grads_.size(); ++i) *dst[i] = fp8_grads_.tensor(i);
  }
  return Status::ok();
}

std::vector<std::vector<TensorSpec>> Model::fp8_training_specs(const Config& c, int64_t tokens) {
  return {fp8_matrix_specs(c, false), fp8_matrix_specs(c, true), fp8_input_specs(c, tokens),
          fp8_grad_specs(c, tokens)};
}

size_t Model::fp8_bytes() const {
  return fp8_.bytes() + fp8t_.bytes() + fp8_inputs_.bytes() + fp8_grads_.bytes() + fp8_head_arena_.bytes();
}

Status Model::fp8_product_fits(const std::string& what, int64_t rows, int64_t cols) const {
  if (be_->supports({"gemm_e4m3", dtype_, {rows, cols}})) return Status::ok();
  return Status::unsupported(std::string("the ") + be_->name() + " backend's FP8 products do not take " + what + " [" +
                             std::to_string(rows) + ", " + std::to_string(cols) + "]");
}

Status Model::create_fp8_arena(bool training) {
  if (!be_->supports({"gemm_e4m3", dtype_, {}}) || !be_->supports({"quantize_rows_e4m3", dtype_, {}}) ||
      !be_->supports({"dequantize_rows_e4m3", dtype_, {}}) ||
      (training && (!be_->supports({"quantize_cols_e4m3", dtype_, {}}) ||
                    !be_->supports({"quantize_rows_cols_e4m3", dtype_, {}}))))
    return Status::unsupported(std::string("the ") + be_->name() + " backend has no FP8 products for " +
                               dtype_name(dtype_) + " models");
  if (fp8_on_ || fp8_train_) return Status::unsupported("this model already computes in FP8");
  if (!training && plan_rows_ > 0 && plan_.training) return Status::unsupported("FP8 weights serve inference plans only");
  if (training && plan_rows_ > 0) return Status::unsupported("FP8 training is chosen before the plan");
  for (int64_t l = 0; l < cfg_.num_layers; ++l)
    for (int k = 0; k < 4; ++k) {
      const std::string n = body_name(l, k);
      const int64_t i = weights_.find(n);
      LAPLACE_CHECK(i >= 0, "FP8 weights: a body matrix is missing from the weight table");
      const TensorSpec& w = weights_.spec(static_cast<size_t>(i));
      LAPLACE_RETURN_IF_ERROR(fp8_product_fits(n, w.shape[0], w.shape[1]));
      // The product's other operand shape: Wᵀ [cols, rows] in dX = dY·W.
      if (training) LAPLACE_RETURN_IF_ERROR(fp8_product_fits(n + "ᵀ", w.shape[1], w.shape[0]));
    }
  LAPLACE_RETURN_IF_ERROR(fp8_.create(fp8_matrix_specs(cfg_, false), be_->allocator(), "FP8 weights"));
  fp8_layers_ = fp8_layer_views<Fp8Matrix>(fp8_, cfg_.num_layers);
  if (!training) {
    fp8_on_ = true;
    return plan_rows_ > 0 ? plan_fp8_inputs() : Status::ok();
  }
  LAPLACE_RETURN_IF_ERROR(fp8t_.create(fp8_matrix_specs(cfg_, true), be_->allocator(), "FP8 transposed weights"));
  fp8_cols_ = fp8_layer_views<Fp8Matrix>(fp8t_, cfg_.num_layers);
  fp8_train_ = true;
  return Status::ok();
}

Status Model::use_fp8_training() { return create_fp8_arena(true); }

void Model::quantize_training_weights() {
  LAPLACE_CHECK(fp8_train_, "quantize_training_weights: FP8 training is off");
  for (int64_t l = 0; l < cfg_.num_layers; ++l)
    for (int k = 0; k < 4; ++k) {
      const Tensor w = weights_.tensor(static_cast<size_t>(weights_.find(body_name(l, k))));
      be_->quantize_rows_e4m3(w, fp8_layers_[l][k].q, fp8_layers_[l][k].s);
      be_->quantize_cols_e4m3(w, fp8_cols_[l][k].q, fp8_cols_[l][k].s);
    }
}

Status Model::plan_fp8_inputs() {
  LAPLACE_RETURN_IF_ERROR(fp8_inputs_.create(fp8_input_specs(cfg_, plan_rows_), be_->allocator(), "FP8 projection inputs"));
  fp8_xq_ = fp8_inputs_.tensor(0);
  fp8_xs_ = fp8_inputs_.tensor(1);
  return Status::ok();
}

Status Model::use_fp8_weights() {
  LAPLACE_RETURN_IF_ERROR(create_fp8_arena(false));
  for (int64_t l = 0; l < cfg_.num_layers; ++l)
    for (int k = 0; k < 4; ++k) {
      const Tensor w = weights_.tensor(static_cast<size_t>(weights_.find(body_name(l, k))));
      const Fp8Matrix& f = fp8_layers_[l][k];
      be_->quantize_rows_e4m3(w, f.q, f.s);
      // The weight's own copy takes the values the products use (code × scale).
      be_->dequantize_rows_e4m3(f.q, f.s, w);
    }
  be_->synchronize();
  return Status::ok();
}

Status Model::set_fp8_head(bool on) {
  if (!on) {
    fp8_head_on_ = false;
    return Status::ok();
  }
  if (!fp8_on_) return Status::unsupported("an FP8 LM head needs FP8 weights (--weights fp8 or an FP8 model file)");
  if (!fp8_head_.q.defined()) {
    const int64_t V = cfg_.vocab_size, D = cfg_.hidden_size;
    LAPLACE_RETURN_IF_ERROR(fp8_product_fits("the LM head", V, D));
    LAPLACE_RETURN_IF_ERROR(fp8_head_arena_.create(
        {{"lm_head.fp8", DType::kF8E4M3, {V, D}}, {"lm_head.fp8_scale", DType::kF32, {V}}}, be_->allocator(),
        "FP8 LM head"));
    fp8_head_ = {fp8_head_arena_.tensor(0), fp8_head_arena_.tensor(1)};
    be_->quantize_rows_e4m3(w_.lm_head, fp8_head_.q, fp8_head_.s);
  }
  fp8_head_on_ = true;
  return Status::ok();
}

Status Model::load_fp8(const std::string& path) {
  SafeTensorsReader r;
  LAPLACE_RETURN_IF_ERROR(SafeTensorsReader::open(path, &r));
  const auto prec = r.metadata().find(kPrecisionKey);
  if (prec == r.metadata().end() || prec->second != kPrecisionFp8Rows)
    return Status::invalid_argument(path + " does not hold FP8 weights (no " + std::string(kPrecisionKey) + "=" +
                                    kPrecisionFp8Rows + ")");
  LAPLACE_RETURN_IF_ERROR(create_fp8_arena(false));
  std::set<std::string> expected;
  for (size_t i = 0; i < weights_.size(); ++i) {
    const TensorSpec& s = weights_.spec(i);
    expected.insert(s.name);
    const SafeTensorInfo* info = r.find(s.name);
    if (!info) return Status::invalid_argument(path + ": missing tensor " + s.name);
    const int64_t fi = fp8_.find(s.name);
    if (fi >= 0) {
      const std::string sn = fp8_scale_name(s.name);
      expected.insert(sn);
      if (info->dtype != DType::kF8E4M3 || !r.find(sn))
        return Status::invalid_argument(path + ": " + s.name + " must be F8_E4M3 with its scales " + sn);
      const Tensor q = fp8_.tensor(static_cast<size_t>(fi)), sc = fp8_.tensor(static_cast<size_t>(fi) + 1);
      const int64_t R = q.shape[0], C = q.shape[1];
      std::vector<uint8_t> codes;
      std::vector<float> scales;
      LAPLACE_RETURN_IF_ERROR(fp8_read_rows(r, s.name, R, C, &codes, &scales).with_context(path));
      be_->copy(q, Tensor(codes.data(), DType::kF8E4M3, {R, C}));
      be_->copy(sc, Tensor(scales.data(), DType::kF32, {R}));
      be_->dequantize_rows_e4m3(q, sc, weights_.tensor(i));  // the weight's own copy: code × scale
    } else {
      std::vector<float> v(static_cast<size_t>(s.numel()));
      const Tensor t = Tensor::make(v.data(), DType::kF32, s.shape.data(), static_cast<int>(s.shape.size()));
      LAPLACE_RETURN_IF_ERROR(r.read_into(s.name, t).with_context(path));
      be_->copy(weights_.tensor(i), t);
    }
    be_->synchronize();
  }
  for (const SafeTensorInfo& t : r.tensors())
    if (!expected.count(t.name))
      return Status::invalid_argument(path + ": unexpected tensor " + t.name +
                                      " (is this checkpoint for a different config?)");
  return Status::ok();
}

void Model::project(const Tensor& x, const Tensor& w, const Fp8Matrix& f, const Tensor& residual, Tensor y) {
  Backend& be = *be_;
  if (!f.q.defined()) {
    if (residual.defined()) be.gemm_add(x, false, w, true, residual, y, 1.0, 1.0);
    else be.gemm(x, false, w, true, y, 1.0, 0.0);
    return;
  }
  const int64_t N = x.shape[0], K = x.shape[1];
  const Tensor xq = fp8_codes(fp8_xq_, N, K);
  const Tensor xs = fp8_xs_.slice(0, 0, N);
  be.quantize_rows_e4m3(x, xq, xs);
  project_codes(xq, xs, f, residual, y);
}

void Model::project_codes(const Tensor& xq, const Tensor& xs, const Fp8Matrix& f, const Tensor& residual, Tensor y) {
  be_->gemm_e4m3(xq, xs, f.q, f.s, residual, y, fp8_fast_forward_ ? Fp8Accum::kFast : Fp8Accum::kF32);
}

void Model::project_backward(bool overwrite, const Tensor& dy, const Tensor& w, const Fp8Matrix& ft, const Tensor& x,
                             Tensor dx, Tensor gw) {
  Backend& be = *be_;
  if (!ft.q.defined()) {
    be.gemm(dy, false, w, false, dx, 1.0, 0.0);
    be.gemm(dy, true, x, false, gw, 1.0, overwrite ? 0.0 : 1.0);
    return;
  }
  const int64_t N = dy.shape[0], O = dy.shape[1], I = x.shape[1];
  const Tensor dyq = fp8_codes(fp8_dyq_, N, O), dys = fp8_dys_.slice(0, 0, N);
  const Tensor dytq = fp8_codes(fp8_dytq_, O, N), dyts = fp8_dyts_.slice(0, 0, O);
  be.quantize_rows_cols_e4m3(dy, dyq, dys, dytq, dyts);
  be.gemm_e4m3(dyq, dys, ft.q, ft.s, Tensor{}, dx, Fp8Accum::kF32);  // dx [N, I] = dY·W = dY·(Wᵀ)ᵀ
  const Tensor xtq = fp8_codes(fp8_xtq_, I, N), xts = fp8_xts_.slice(0, 0, I);
  be.quantize_cols_e4m3(x, xtq, xts);
  be.gemm_e4m3(dytq, dyts, xtq, xts, overwrite ? Tensor{} : gw, gw, Fp8Accum::kF32);  // gw [O, I] (+)= dYᵀ·X
}

}  // namespace laplace
