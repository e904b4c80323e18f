// Arena: one allocation per buffer class (weights, gradients, optimizer state,
// activations, decode states). Tensors are planned first as a size table of named
// specs, then carved from a single block at 256-byte aligned 64-bit offsets.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/status.h"
#include "core/tensor.h"

namespace laplace {

// Raw memory for one device. The CPU one lives in core; the CUDA one in ops/cuda.
class Allocator {
 public:
  virtual ~Allocator() = default;
  virtual Device device() const = 0;
  virtual void* allocate(size_t bytes) = 0;  // nullptr on failure
  virtual void deallocate(void* p) = 0;
  virtual void zero(void* p, size_t bytes) = 0;
};

Allocator& cpu_allocator();

struct TensorSpec {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;

  int64_t numel() const;
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype); }
};

class Arena {
 public:
  static constexpr size_t kAlign = 256;

  Arena() = default;
  ~Arena();
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;
  Arena(Arena&& o) noexcept;
  Arena& operator=(Arena&& o) noexcept;

  // Bytes the specs take once carved (alignment padding included); no allocation.
  static size_t planned_bytes(const std::vector<TensorSpec>& specs);

  // Allocates one block holding every spec and zero-fills it.
  Status create(std::vector<TensorSpec> specs, Allocator& alloc, const std::string& label);

  size_t size() const { return specs_.size(); }
  size_t bytes() const { return bytes_; }
  const std::string& label() const { return label_; }
  const TensorSpec& spec(size_t i) const { return specs_[i]; }
  Tensor tensor(size_t i) const { return tensors_[i]; }
  const std::vector<Tensor>& tensors() const { return tensors_; }
  // Index of a named tensor, or -1.
  int64_t find(const std::string& name) const;
  void* base() const { return base_; }
  void zero();

 private:
  void release();

  Allocator* alloc_ = nullptr;
  void* base_ = nullptr;
  size_t bytes_ = 0;
  std::string label_;
  std::vector<TensorSpec> specs_;
  std::vector<Tensor> tensors_;
};

}  // namespace laplace
