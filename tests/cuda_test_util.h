// Test helpers for comparing the CUDA backend with the CPU one: host and device tensors of one
// logical quantity. Shared by the CUDA op tests (test_cuda_ops.cpp, test_cuda_varlen.cpp).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <string>
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

// A test that runs an op on the GPU and its reference on the CPU: skipped without a GPU.
class CudaVsCpu : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    cuda_ = make_cuda_backend(&why);
    if (!cuda_) GTEST_SKIP() << "no CUDA device: " << why;
    cpu_ = make_cpu_backend();
  }

  // Same values (rounded to dev_dt) on both sides; uniform in [lo, hi).
  Buf input(const std::vector<int64_t>& shape, DType dev_dt, DType ref_dt, uint64_t seed, double lo = -1,
            double hi = 1) {
    Buf b;
    b.ref = host_tensor(ref_dt, shape);
    auto stage = host_tensor(dev_dt, shape);
    std::mt19937_64 rng(seed);
    std::uniform_real_distribution<double> dist(lo, hi);
    const int64_t n = b.ref->t.numel();
    for (int64_t i = 0; i < n; ++i) {
      const double x = round_to(dev_dt, dist(rng));
      set_flat(stage->t, i, x);
      set_flat(b.ref->t, i, x);
    }
    b.dev = std::make_unique<DevTensor>(*cuda_, dev_dt, shape);
    cuda_->copy(b.dev->t, stage->t);
    return b;
  }
  Buf zeros(const std::vector<int64_t>& shape, DType dev_dt, DType ref_dt) {
    Buf b;
    b.ref = host_tensor(ref_dt, shape);  // zero-filled storage
    auto stage = host_tensor(dev_dt, shape);
    b.dev = std::make_unique<DevTensor>(*cuda_, dev_dt, shape);
    cuda_->copy(b.dev->t, stage->t);
    return b;
  }
  Buf ints(const std::vector<int32_t>& v) {
    Buf b;
    const std::vector<int64_t> shape = {static_cast<int64_t>(v.size())};
    b.ref = host_tensor(DType::kI32, shape);
    std::memcpy(b.ref->t.data, v.data(), v.size() * 4);
    b.dev = std::make_unique<DevTensor>(*cuda_, DType::kI32, shape);
    cuda_->copy(b.dev->t, b.ref->t);
    return b;
  }
  // Host copy (in the device dtype) of a device tensor.
  std::unique_ptr<OwnedTensor> down(const Tensor& d) {
    std::vector<int64_t> shape(d.shape.begin(), d.shape.begin() + d.ndim);
    auto h = host_tensor(d.dtype, shape);
    cuda_->copy(h->t, d);
    return h;
  }
  // max relative error of the GPU side against the CPU side.
  double err(const Buf& b) { return max_rel_error(down(b.d())->t, b.r()); }
  double rms(const Buf& b) { return rms_rel_error(down(b.d())->t, b.r()); }
  bool same_bytes(const Tensor& a, const Tensor& b) {
    auto ha = down(a), hb = down(b);
    return ha->t.nbytes() == hb->t.nbytes() && std::memcmp(ha->t.data, hb->t.data, ha->t.nbytes()) == 0;
  }

  std::unique_ptr<Backend> cuda_, cpu_;
};

}  // namespace laplace::testing
