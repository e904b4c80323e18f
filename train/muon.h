// Muon's orthogonalisation (docs/training.md §6): a quintic Newton–Schulz iteration written only
// in terms of Backend calls (gemm, sum_squares, scale, copy), so every backend runs it.
//
// Contract (a PyTorch reference reproduces it):
//   X = G / (‖G‖_F + 1e−7)                 ‖G‖_F² from sum_squares (double), kept on the
//                                          device (sum_squares_into + scale_by_inv_norm)
//   if rows > cols: work on Xᵀ              (the Gram matrix is min(rows, cols)²)
//   repeat `steps` times (default 5):
//     A = X·Xᵀ;  B = b·A + c·(A·A);  X = a·X + B·X     (a,b,c) = (3.4445, −4.7750, 2.0315)
//   out = X (transposed back when rows > cols)
// The transposed case is computed with gemm's transpose flags on the [rows, cols]
// layout (A = XᵀX, X = a·X + X·Bᵀ), which is the same arithmetic without a transpose.
// Compute dtype = the scratch dtype (F32/F64 on the CPU; BF16 later on CUDA).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/arena.h"
#include "core/status.h"
#include "core/tensor.h"
#include "ops/backend.h"

namespace laplace {

constexpr double kNsA = 3.4445, kNsB = -4.7750, kNsC = 2.0315;
constexpr double kNsNormEps = 1e-7;

// Update scale applied to a block's orthogonalised update.
//   kRms   (default): 0.2·√max(rows, cols)   (matches AdamW's update RMS, so its lr/wd carry over)
//   kShape          : √max(1, rows/cols)     (rows/cols a real division)
enum class MuonScale { kRms, kShape };

double muon_scale(int64_t rows, int64_t cols, MuonScale mode = MuonScale::kRms);
// "rms" / "shape"; invalid_argument for anything else.
Status muon_scale_from_name(const std::string& name, MuonScale* out);
const char* muon_scale_name(MuonScale mode);

// Scratch for newton_schulz, sized for the largest block it will see. Plan every
// block shape with plan(), then either carve the buffers from a shared Arena
// (add_specs + bind) or give the scratch its own arena (allocate).
// Buffers (flat, viewed per call with the block's shape):
//   x, y : min·max elements (the iterate and its ping-pong partner)
//   a, b : min² elements     (Gram matrix and the polynomial in it)
//   ss   : [1] F64 device scalar, ‖G‖_F² (so the normalisation needs no host read-back;
//          an arena without it makes newton_schulz read the norm on the host, same bits)
struct NsScratch {
  DType dtype = DType::kF32;
  int64_t max_elems = 0;  // max rows·cols over the planned blocks
  int64_t max_gram = 0;   // max min(rows, cols)² over the planned blocks
  Tensor x, y, a, b;      // 1-D views once bound
  Tensor ss;              // [1] F64 once bound

  // Grows the plan to cover a [rows, cols] block.
  void plan(int64_t rows, int64_t cols);
  bool fits(int64_t rows, int64_t cols) const;
  bool bound() const { return x.defined() || max_elems == 0; }

  // Appends the buffer specs ("<prefix>x", "<prefix>y", "<prefix>a", "<prefix>b", "<prefix>ss").
  void add_specs(std::vector<TensorSpec>* specs, const std::string& prefix) const;
  // Points the buffers at an arena created with the specs of add_specs.
  Status bind(const Arena& arena, const std::string& prefix);
  // Standalone use (tests, tools): creates `own` holding just the scratch.
  Status allocate(Allocator& alloc);

  Arena own;
};

// out = NS(g). g, out: [rows, cols] views (g may be a row-range view of a larger
// matrix; out may alias g: g is read only before out is written). The scratch must
// fit the shape. Deterministic when the backend's gemm is.
void newton_schulz(Backend& be, const Tensor& g, Tensor out, NsScratch& scratch, int steps = 5);

}  // namespace laplace
