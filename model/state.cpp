#include "model/state.h"

#include <cstring>
#include <string>

namespace laplace {

namespace {

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

}  // namespace

Status StatePool::layout_for(const Config& c, DType dtype, PendingSpec pending, Layout* out) {
  if (dtype != DType::kF32 && dtype != DType::kF64 && dtype != DType::kBF16)
    return Status::invalid_argument("states are F32 (F64 on the CPU; BF16 as an option on CUDA)");
  Layout l;
  l.layer_elems = c.num_heads * c.head_k_dim * c.head_v_dim + c.conv_size * c.hidden_size;
  const int64_t es = static_cast<int64_t>(dtype_size(dtype));
  l.slot_elems = c.num_layers * l.layer_elems;
  if (pending.steps != 0) {
    if (!PendingSpec::supported(pending.steps))
      return Status::invalid_argument("deferred write-back: R must be 4, 8 or 16 (got " +
                                      std::to_string(pending.steps) + ")");
    const int64_t ps = static_cast<int64_t>(dtype_size(pending.pair_dtype));
    const int64_t pairs = c.num_layers * c.num_heads * (pending.steps - 1) * (c.head_k_dim + c.head_v_dim) * ps;
    // 16-byte boundaries keep every slot's states, pairs and counts aligned for vector access.
    l.tail_offset = round_up(l.slot_elems * es, 16);
    l.count_offset = l.tail_offset + round_up(pairs, 16);
    const int64_t bytes = round_up(l.count_offset + c.num_layers * c.num_heads * 4, 16);
    l.slot_elems = bytes / es;
  }
  *out = l;
  return Status::ok();
}

int64_t StatePool::slot_bytes_for(const Config& c, DType dtype, PendingSpec pending) {
  Layout l;
  if (!layout_for(c, dtype, pending, &l).is_ok()) return 0;
  return l.slot_elems * static_cast<int64_t>(dtype_size(dtype));
}

Status StatePool::create(const Config& c, Backend& be, int64_t slots, DType dtype, PendingSpec pending) {
  if (slots < 1) return Status::invalid_argument("a state pool needs at least one slot");
  LAPLACE_RETURN_IF_ERROR(layout_for(c, dtype, pending, &layout_));
  dtype_ = dtype;
  pending_ = pending;
  cfg_ = c;
  layer_elems_ = layout_.layer_elems;
  slot_elems_ = layout_.slot_elems;
  slots_ = slots;
  LAPLACE_RETURN_IF_ERROR(arena_.create({{"states", dtype, {slots, slot_elems_}}}, be.allocator(), "state pool"));
  all_ = arena_.tensor(0);  // zero-filled: states 0, no pending pairs
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

GlaPending StatePool::pending(int64_t l) const {
  GlaPending p;
  if (pending_.steps == 0) return p;
  const int64_t H = cfg_.num_heads, dk = cfg_.head_k_dim, dv = cfg_.head_v_dim, P = pending_.steps - 1;
  const DType pt = pending_.pair_dtype;
  const int64_t ps = static_cast<int64_t>(dtype_size(pt));
  char* base = static_cast<char*>(all_.data);
  const int64_t k_off = layout_.tail_offset + l * H * P * (dk + dv) * ps;
  p.k = Tensor(base + k_off, pt, {slots_, H, P, dk}, all_.device);
  p.k.stride[0] = slot_bytes() / ps;
  p.v = Tensor(base + k_off + H * P * dk * ps, pt, {slots_, H, P, dv}, all_.device);
  p.v.stride[0] = slot_bytes() / ps;
  p.count = Tensor(base + layout_.count_offset + l * H * 4, DType::kI32, {slots_, H}, all_.device);
  p.count.stride[0] = slot_bytes() / 4;
  p.steps = pending_.steps;
  return p;
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

Status StatePool::check_slot_bytes(const void* host) const {
  if (pending_.steps == 0) return Status::ok();
  const int64_t n = cfg_.num_layers * cfg_.num_heads;
  const char* counts = static_cast<const char*>(host) + layout_.count_offset;
  for (int64_t i = 0; i < n; ++i) {
    int32_t m = 0;
    std::memcpy(&m, counts + 4 * i, 4);
    if (m < 0 || m >= pending_.steps)
      return Status::corrupt("state: pending count " + std::to_string(m) + " of layer " +
                             std::to_string(i / cfg_.num_heads) + " head " + std::to_string(i % cfg_.num_heads) +
                             " is outside [0, " + std::to_string(pending_.steps) + ")");
  }
  return Status::ok();
}

}  // namespace laplace
