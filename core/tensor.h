// Tensor: a non-owning, strided view of up to 4 dimensions. Memory is owned by an
// Arena (or by the caller); tensors are cheap to copy and never free anything.
// Strides are in elements; the innermost dimension of every tensor an op reads is
// contiguous (stride 1), outer strides may be larger (e.g. q/k/v views into the
// fused qkvg projection, or sequences living in slots of a state pool).
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "core/check.h"
#include "core/dtype.h"

namespace laplace {

constexpr int kMaxDims = 4;

struct Tensor {
  void* data = nullptr;
  DType dtype = DType::kF32;
  Device device = Device::kCPU;
  int ndim = 0;
  std::array<int64_t, kMaxDims> shape{};
  std::array<int64_t, kMaxDims> stride{};

  Tensor() = default;
  // Contiguous row-major view.
  Tensor(void* p, DType t, std::initializer_list<int64_t> dims, Device dev = Device::kCPU);
  static Tensor make(void* p, DType t, const int64_t* dims, int nd, Device dev = Device::kCPU);

  bool defined() const { return data != nullptr; }
  int64_t dim(int i) const { return shape[i < 0 ? ndim + i : i]; }
  int64_t numel() const;
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype); }
  bool is_contiguous() const;
  std::string shape_str() const;  // "[8, 2048, 3072] F32 cpu"

  template <class T> T* ptr() const {
    LAPLACE_CHECK(dtype == dtype_of<T>(), "tensor dtype does not match the requested pointer type");
    return static_cast<T*>(data);
  }

  // Views. All keep the element type and device.
  Tensor reshape(std::initializer_list<int64_t> dims) const;   // contiguous only; one dim may be -1
  Tensor slice(int d, int64_t begin, int64_t end) const;        // [begin, end) along d
  Tensor select(int64_t i) const;                               // drops dim 0
};

// Shape equality, ignoring strides and dtype.
bool same_shape(const Tensor& a, const Tensor& b);

}  // namespace laplace
