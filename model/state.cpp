#include "model/state.h"

namespace laplace {

Status StatePool::create(const Config& c, Backend& be, int64_t slots, DType dtype) {
  if (slots < 1) return Status::invalid_argument("a state pool needs at least one slot");
  if (dtype != DType::kF32 && dtype != DType::kF64 && dtype != DType::kBF16)
    return Status::invalid_argument("states are F32 (F64 on the CPU; BF16 as an option on CUDA)");
  dtype_ = dtype;
  cfg_ = c;
  layer_elems_ = c.num_heads * c.head_k_dim * c.head_v_dim + c.conv_size * c.hidden_size;
  slot_elems_ = c.num_layers * layer_elems_;
  slots_ = slots;
  LAPLACE_RETURN_IF_ERROR(arena_.create({{"states", dtype, {slots, slot_elems_}}}, be.allocator(), "state pool"));
  all_ = arena_.tensor(0);
  return Status::ok();
}

Tensor StatePool::gla(int64_t l) const {
  Tensor t(static_cast<char*>(all_.data) + l * layer_elems_ * dtype_size(dtype_), dtype_,
           {slots_, cfg_.num_heads, cfg_.head_k_dim, cfg_.head_v_dim}, all_.device);
  t.stride[0] = slot_elems_;
  return t;
}

Tensor StatePool::conv(int64_t l) const {
  const int64_t off = l * layer_elems_ + cfg_.num_heads * cfg_.head_k_dim * cfg_.head_v_dim;
  Tensor t(static_cast<char*>(all_.data) + off * dtype_size(dtype_), dtype_,
           {slots_, cfg_.conv_size, cfg_.hidden_size}, all_.device);
  t.stride[0] = slot_elems_;
  return t;
}

Tensor StatePool::slot(int64_t s) const { return all_.select(s); }

void StatePool::reset(Backend& be, int64_t s) { be.fill(slot(s), 0.0); }

void StatePool::copy_slot(Backend& be, int64_t dst, int64_t src) {
  if (dst != src) be.copy(slot(dst), slot(src));
}

void StatePool::read_slot(Backend& be, int64_t s, void* host) const {
  be.copy(Tensor(host, dtype_, {slot_elems_}), slot(s));
  be.synchronize();
}

void StatePool::write_slot(Backend& be, int64_t s, const void* host) {
  be.copy(slot(s), Tensor(const_cast<void*>(host), dtype_, {slot_elems_}));
  be.synchronize();
}

}  // namespace laplace
