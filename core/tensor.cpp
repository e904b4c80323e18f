#include "core/tensor.h"

#include <cstdio>

namespace laplace {

namespace {
void set_contiguous_strides(Tensor* t) {
  int64_t s = 1;
  for (int i = t->ndim - 1; i >= 0; --i) {
    t->stride[i] = s;
    s *= t->shape[i];
  }
}
}  // namespace

Tensor::Tensor(void* p, DType t, std::initializer_list<int64_t> dims, Device dev)
    : data(p), dtype(t), device(dev), ndim(static_cast<int>(dims.size())) {
  LAPLACE_CHECK(ndim <= kMaxDims, "too many dimensions");
  int i = 0;
  for (int64_t d : dims) shape[i++] = d;
  set_contiguous_strides(this);
}

Tensor Tensor::make(void* p, DType t, const int64_t* dims, int nd, Device dev) {
  LAPLACE_CHECK(nd >= 0 && nd <= kMaxDims, "too many dimensions");
  Tensor r;
  r.data = p;
  r.dtype = t;
  r.device = dev;
  r.ndim = nd;
  for (int i = 0; i < nd; ++i) r.shape[i] = dims[i];
  set_contiguous_strides(&r);
  return r;
}

int64_t Tensor::numel() const {
  int64_t n = 1;
  for (int i = 0; i < ndim; ++i) n *= shape[i];
  return n;
}

bool Tensor::is_contiguous() const {
  int64_t s = 1;
  for (int i = ndim - 1; i >= 0; --i) {
    if (shape[i] != 1 && stride[i] != s) return false;
    s *= shape[i];
  }
  return true;
}

std::string Tensor::shape_str() const {
  std::string s = "[";
  for (int i = 0; i < ndim; ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  s += "] ";
  s += dtype_name(dtype);
  s += " ";
  s += device_name(device);
  return s;
}

Tensor Tensor::reshape(std::initializer_list<int64_t> dims) const {
  LAPLACE_CHECK(is_contiguous(), "reshape of a non-contiguous view");
  LAPLACE_CHECK(static_cast<int>(dims.size()) <= kMaxDims, "too many dimensions");
  int64_t known = 1;
  int infer = -1;
  int64_t d[kMaxDims];
  int nd = 0;
  for (int64_t x : dims) {
    if (x == -1) {
      LAPLACE_CHECK(infer < 0, "reshape: at most one -1");
      infer = nd;
    } else {
      known *= x;
    }
    d[nd++] = x;
  }
  if (infer >= 0) d[infer] = known ? numel() / known : 0;
  Tensor r = make(data, dtype, d, nd, device);
  LAPLACE_CHECK(r.numel() == numel(), "reshape changes the element count");
  return r;
}

Tensor Tensor::slice(int d, int64_t begin, int64_t end) const {
  LAPLACE_CHECK(d >= 0 && d < ndim, "slice: bad dimension");
  LAPLACE_CHECK(0 <= begin && begin <= end && end <= shape[d], "slice: range out of bounds");
  Tensor r = *this;
  r.data = static_cast<char*>(data) + begin * stride[d] * static_cast<int64_t>(dtype_size(dtype));
  r.shape[d] = end - begin;
  return r;
}

Tensor Tensor::select(int64_t i) const {
  LAPLACE_CHECK(ndim >= 1 && i >= 0 && i < shape[0], "select: index out of bounds");
  Tensor r;
  r.data = static_cast<char*>(data) + i * stride[0] * static_cast<int64_t>(dtype_size(dtype));
  r.dtype = dtype;
  r.device = device;
  r.ndim = ndim - 1;
  for (int k = 1; k < ndim; ++k) {
    r.shape[k - 1] = shape[k];
    r.stride[k - 1] = stride[k];
  }
  return r;
}

bool same_shape(const Tensor& a, const Tensor& b) {
  if (a.ndim != b.ndim) return false;
  for (int i = 0; i < a.ndim; ++i)
    if (a.shape[i] != b.shape[i]) return false;
  return true;
}

}  // namespace laplace
