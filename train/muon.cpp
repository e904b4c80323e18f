#include "train/muon.h"

#include <algorithm>
#include <cmath>
#include <utility>

namespace laplace {

double muon_scale(int64_t rows, int64_t cols, MuonScale mode) {
  switch (mode) {
    case MuonScale::kRms:
      return 0.2 * std::sqrt(static_cast<double>(std::max(rows, cols)));
    case MuonScale::kShape:
      return std::sqrt(std::max(1.0, static_cast<double>(rows) / static_cast<double>(cols)));
  }
  return 1.0;
}

Status muon_scale_from_name(const std::string& name, MuonScale* out) {
  if (name == "rms") {
    *out = MuonScale::kRms;
  } else if (name == "shape") {
    *out = MuonScale::kShape;
  } else {
    return Status::invalid_argument("unknown Muon update scale '" + name + "' (expected rms or shape)");
  }
  return Status::ok();
}

const char* muon_scale_name(MuonScale mode) { return mode == MuonScale::kShape ? "shape" : "rms"; }

void NsScratch::plan(int64_t rows, int64_t cols) {
  int64_t m = std::min(rows, cols);
  max_elems = std::max(max_elems, rows * cols);
  max_gram = std::max(max_gram, m * m);
}

bool NsScratch::fits(int64_t rows, int64_t cols) const {
  int64_t m = std::min(rows, cols);
  return rows * cols <= max_elems && m * m <= max_gram;
}

void NsScratch::add_specs(std::vector<TensorSpec>* specs, const std::string& prefix) const {
  specs->push_back({prefix + "x", dtype, {max_elems}});
  specs->push_back({prefix + "y", dtype, {max_elems}});
  specs->push_back({prefix + "a", dtype, {max_gram}});
  specs->push_back({prefix + "b", dtype, {max_gram}});
  specs->push_back({prefix + "ss", DType::kF64, {1}});
}

Status NsScratch::bind(const Arena& arena, const std::string& prefix) {
  Tensor* dst[4] = {&x, &y, &a, &b};
  const char* names[4] = {"x", "y", "a", "b"};
  const int64_t want[4] = {max_elems, max_elems, max_gram, max_gram};
  for (int i = 0; i < 4; ++i) {
    int64_t idx = arena.find(prefix + names[i]);
    if (idx < 0) return Status::not_found("Newton-Schulz scratch '" + prefix + names[i] + "' is not in arena " + arena.label());
    Tensor t = arena.tensor(static_cast<size_t>(idx));
    if (t.dtype != dtype || t.numel() < want[i])
      return Status::invalid_argument("Newton-Schulz scratch '" + prefix + names[i] + "' is " + t.shape_str() +
                                      ", too small or of the wrong dtype");
    *dst[i] = t;
  }
  const int64_t ss = arena.find(prefix + "ss");
  this->ss = ss >= 0 ? arena.tensor(static_cast<size_t>(ss)) : Tensor{};
  return Status::ok();
}

Status NsScratch::allocate(Allocator& alloc) {
  std::vector<TensorSpec> specs;
  add_specs(&specs, "ns.");
  LAPLACE_RETURN_IF_ERROR(own.create(std::move(specs), alloc, "newton_schulz scratch"));
  return bind(own, "ns.");
}

namespace {
// A [rows, cols] contiguous view over the start of a flat buffer.
Tensor view2(const Tensor& flat, int64_t rows, int64_t cols) {
  int64_t dims[2] = {rows, cols};
  return Tensor::make(flat.data, flat.dtype, dims, 2, flat.device);
}
}  // namespace

void newton_schulz(Backend& be, const Tensor& g, Tensor out, NsScratch& s, int steps) {
  LAPLACE_CHECK(g.ndim == 2 && out.ndim == 2 && same_shape(g, out), "newton_schulz: g and out must be equal 2-D shapes");
  LAPLACE_CHECK(steps >= 0, "newton_schulz: negative step count");
  const int64_t rows = g.dim(0), cols = g.dim(1);
  if (rows == 0 || cols == 0) return;
  LAPLACE_CHECK(s.fits(rows, cols) && s.x.defined(), "newton_schulz: scratch was not planned/bound for this block");
  const bool tall = rows > cols;  // work on Xᵀ: Gram = XᵀX (cols²)
  const int64_t m = tall ? cols : rows;

  Tensor x = view2(s.x, rows, cols);
  Tensor y = view2(s.y, rows, cols);
  Tensor a = view2(s.a, m, m);
  Tensor b = view2(s.b, m, m);

  // X = G / (‖G‖_F + eps). g is not read after this, so out may alias it. With the ss
  // scalar the norm stays on the device (no host sync); both paths give the same bits.
  if (s.ss.defined()) {
    be.sum_squares_into(g, s.ss, false);
    be.copy(x, g);
    be.scale_by_inv_norm(x, s.ss, kNsNormEps);
  } else {
    const double norm = std::sqrt(be.sum_squares(g));
    be.copy(x, g);
    be.scale(x, 1.0 / (norm + kNsNormEps));
  }

  for (int it = 0; it < steps; ++it) {
    // A = X·Xᵀ (wide) or XᵀX (tall: the Gram of the transposed iterate).
    if (tall) be.gemm(x, true, x, false, a, 1.0, 0.0);
    else be.gemm(x, false, x, true, a, 1.0, 0.0);
    // B = b·A + c·A·A
    be.copy(b, a);
    be.gemm(a, false, a, false, b, kNsC, kNsB);
    // X ← a·X + B·X (wide) or, transposed, X ← a·X + X·Bᵀ (tall).
    be.copy(y, x);
    if (tall) be.gemm(x, false, b, true, y, 1.0, kNsA);
    else be.gemm(b, false, x, false, y, 1.0, kNsA);
    std::swap(x, y);
  }
  be.copy(out, x);
}

}  // namespace laplace
