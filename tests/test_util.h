// Helpers shared by the C++ tests.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "model/config.h"

namespace laplace::testing {

// A CPU tensor that owns its memory (tests only; the library uses arenas).
struct OwnedTensor {
  std::vector<double> storage;  // 8-byte aligned, large enough for any dtype
  Tensor t;
  OwnedTensor() = default;
  OwnedTensor(DType dt, std::initializer_list<int64_t> shape);
  OwnedTensor(const OwnedTensor&) = delete;
  OwnedTensor& operator=(const OwnedTensor&) = delete;
  operator Tensor() const { return t; }
  template <class T> T* ptr() { return t.ptr<T>(); }
};

// x as `dt` holds it (BF16: through F32, rounded to nearest even; F32: rounded; F8E4M3: the
// code's value (core/fp8.h); else x).
double round_to(DType dt, double x);
// The element offset (strides applied) of a flat logical (row-major) index.
int64_t offset_of(const Tensor& t, int64_t flat);
// Element at a flat logical (row-major) index, honouring strides: F32, F64, BF16, I32, F8E4M3
// (a code's value; setting one stores the nearest code).
double element_get(const Tensor& t, int64_t flat);
void element_set(const Tensor& t, int64_t flat, double v);

// Fills with uniform values in [lo, hi) from a seeded generator (F32/F64).
void fill_uniform(Tensor t, uint64_t seed, double lo = -1.0, double hi = 1.0);

// max|a−b| / max(max|b|, tiny): the normalised error used by cross-backend tests.
double max_rel_error(const Tensor& a, const Tensor& b);
// The same for two arrays of one length; a value of a that is not finite, or a NaN in b, gives
// infinity.
template <class A, class B>
double max_rel_error(const std::vector<A>& a, const std::vector<B>& b) {
  double num = 0, den = 1e-30;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    const double x = static_cast<double>(a[i]), y = static_cast<double>(b[i]);
    if (!std::isfinite(x) || std::isnan(y)) return INFINITY;
    num = std::max(num, std::fabs(x - y));
    den = std::max(den, std::fabs(y));
  }
  return a.size() == b.size() ? num / den : INFINITY;
}
// sqrt(Σ(a−b)²) / sqrt(Σb²).
double rms_rel_error(const Tensor& a, const Tensor& b);

// A small model for fast tests: V=53, D=24, L=2, F=40, C=8 and the given head shape.
Config small_config(int64_t dk = 8, int64_t dv = 12, int64_t H = 2);

// n token ids uniform in [0, V) from a seeded generator.
std::vector<int32_t> random_tokens(int64_t n, int64_t V, uint64_t seed);

// A fresh empty directory under the system temp dir.
std::string make_temp_dir(const std::string& tag);

// What `laplace ARGS` (the binary these tests were built with) printed, stdout and stderr
// together (stdout alone with with_stderr false), and its exit code (-1 when it did not exit
// normally).
struct CliResult {
  int exit_code = -1;
  std::string output;
};
CliResult run_laplace(const std::string& args, bool with_stderr = true);

// A model directory for the server tests: config.json (small_config's shapes, V = 400,
// eos 2), random weights from `weight_seed`, and a 400-piece tokenizer trained on a
// repetitive English text.
std::string make_server_model_dir(const std::string& tag, uint64_t weight_seed);

}  // namespace laplace::testing
