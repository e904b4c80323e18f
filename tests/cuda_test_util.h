// Test helpers for comparing the CUDA backend with the CPU one: host and device tensors of one
// logical quantity. Shared by the CUDA op tests (test_cuda_ops.cpp, test_cuda_varlen.cpp).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "core/check.h"
#include "core/dtype.h"
#include "ops/backend.h"
#include "tests/test_util.h"

namespace laplace::testing {

// Flat index into a contiguous host tensor.
inline void set_flat(const Tensor& t, int64_t i, double x) {
  switch (t.dtype) {
    case DType::kF32: static_cast<float*>(t.data)[i] = static_cast<float>(x); break;
    case DType::kF64: static_cast<double*>(t.data)[i] = x; break;
    case DType::kBF16: static_cast<uint16_t*>(t.data)[i] = float_to_bf16(static_cast<float>(x)); break;
    case DType::kI32: static_cast<int32_t*>(t.data)[i] = static_cast<int32_t>(x); break;
    default: FAIL() << "set_flat: unsupported dtype";
  }
}

// GPU memory owned by a test (freed through the backend's allocator).
struct DevTensor {
  Backend* be = nullptr;
  void* p = nullptr;
  Tensor t;
  DevTensor(Backend& b, DType dt, const std::vector<int64_t>& shape) : be(&b) {
    t = Tensor::make(nullptr, dt, shape.data(), static_cast<int>(shape.size()), Device::kCUDA);
    p = b.allocator().allocate(std::max<size_t>(t.nbytes(), 1));
    LAPLACE_CHECK(p != nullptr, "test: device allocation failed");
    t.data = p;
  }
  ~DevTensor() { be->allocator().deallocate(p); }
  DevTensor(const DevTensor&) = delete;
  DevTensor& operator=(const DevTensor&) = delete;
};

inline std::unique_ptr<OwnedTensor> host_tensor(DType dt, const std::vector<int64_t>& shape) {
  auto h = std::make_unique<OwnedTensor>();
  h->t = Tensor::make(nullptr, dt, shape.data(), static_cast<int>(shape.size()));
  h->storage.assign((h->t.nbytes() + 7) / 8 + 1, 0.0);
  h->t.data = h->storage.data();
  return h;
}

// One logical quantity on both sides: `ref` on the CPU (reference dtype), `dev` on the GPU.
struct Buf {
  std::unique_ptr<OwnedTensor> ref;
  std::unique_ptr<DevTensor> dev;
  Tensor r() const { return ref->t; }
  Tensor d() const { return dev->t; }
};

}  // namespace laplace::testing
