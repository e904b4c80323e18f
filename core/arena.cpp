#include "core/arena.h"

#include <cstdlib>
#include <cstring>
#include <unordered_map>

namespace laplace {

namespace {

class CpuAllocator final : public Allocator {
 public:
  Device device() const override { return Device::kCPU; }
  void* allocate(size_t bytes) override {
    size_t n = (bytes + Arena::kAlign - 1) / Arena::kAlign * Arena::kAlign;
    return std::aligned_alloc(Arena::kAlign, n ? n : Arena::kAlign);
  }
  void deallocate(void* p) override { std::free(p); }
  void zero(void* p, size_t bytes) override { std::memset(p, 0, bytes); }
};

size_t align_up(size_t x) { return (x + Arena::kAlign - 1) / Arena::kAlign * Arena::kAlign; }

}  // namespace

Allocator& cpu_allocator() {
  static CpuAllocator a;
  return a;
}

int64_t TensorSpec::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

Arena::~Arena() { release(); }

Arena::Arena(Arena&& o) noexcept { *this = std::move(o); }

Arena& Arena::operator=(Arena&& o) noexcept {
  if (this != &o) {
    release();
    alloc_ = o.alloc_;
    base_ = o.base_;
    bytes_ = o.bytes_;
    label_ = std::move(o.label_);
    specs_ = std::move(o.specs_);
    tensors_ = std::move(o.tensors_);
    o.base_ = nullptr;
    o.bytes_ = 0;
  }
  return *this;
}

void Arena::release() {
  if (base_ && alloc_) alloc_->deallocate(base_);
  base_ = nullptr;
  bytes_ = 0;
}

size_t Arena::planned_bytes(const std::vector<TensorSpec>& specs) {
  size_t total = 0;
  for (const auto& s : specs) total += align_up(s.nbytes());
  return total;
}

Status Arena::create(std::vector<TensorSpec> specs, Allocator& alloc, const std::string& label) {
  release();
  for (const auto& s : specs) {
    if (s.shape.size() > static_cast<size_t>(kMaxDims))
      return Status::invalid_argument(label + ": tensor " + s.name + " has more than 4 dimensions");
    for (int64_t d : s.shape)
      if (d < 0) return Status::invalid_argument(label + ": tensor " + s.name + " has a negative dimension");
  }
  size_t total = planned_bytes(specs);
  void* p = alloc.allocate(total);
  if (!p && total > 0)
    return Status::out_of_memory(label + ": cannot allocate " + std::to_string(total) + " bytes on " +
                                 device_name(alloc.device()));
  alloc_ = &alloc;
  base_ = p;
  bytes_ = total;
  label_ = label;
  specs_ = std::move(specs);
  tensors_.clear();
  tensors_.reserve(specs_.size());
  size_t off = 0;
  for (const auto& s : specs_) {
    tensors_.push_back(Tensor::make(static_cast<char*>(base_) + off, s.dtype, s.shape.data(),
                                    static_cast<int>(s.shape.size()), alloc.device()));
    off += align_up(s.nbytes());
  }
  if (total) alloc.zero(base_, total);
  return Status::ok();
}

int64_t Arena::find(const std::string& name) const {
  for (size_t i = 0; i < specs_.size(); ++i)
    if (specs_[i].name == name) return static_cast<int64_t>(i);
  return -1;
}

void Arena::zero() {
  if (base_) alloc_->zero(base_, bytes_);
}

}  // namespace laplace
