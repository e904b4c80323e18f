#include "model/state.h"

#include <cstring>
#include <string>

namespace laplace {

namespace {

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Element i of a host array of dtype dt, as a double; and back.
double load_value(const void* p, DType dt, int64_t i) {
  switch (dt) {
    case DType::kF64: {
      double x;
      std::memcpy(&x, static_cast<const char*>(p) + 8 * i, 8);
      return x;
    }
    case DType::kBF16: {
      uint16_t x;
      std::memcpy(&x, static_cast<const char*>(p) + 2 * i, 2);
      return bf16_to_float(x);
    }
    default: {
      float x;
      std::memcpy(&x, static_cast<const char*>(p) + 4 * i, 4);
      return x;
    }
  }
}

void store_value(void* p, DType dt, int64_t i, double v) {
  switch (dt) {
    case DType::kF64: std::memcpy(static_cast<char*>(p) + 8 * i, &v, 8); break;
    case DType::kBF16: {
      const uint16_t x = float_to_bf16(static_cast<float>(v));
      std::memcpy(static_cast<char*>(p) + 2 * i, &x, 2);
      break;
    }
    default: {
      const float x = static_cast<float>(v);
      std::memcpy(static_cast<char*>(p) + 4 * i, &x, 4);
    }
  }
}

// Count i (= layer·H + head) of a slot's pending counts [L, H] I32 at `counts` (host bytes).
int32_t count_at(const char* counts, int64_t i) {
  int32_t m = 0;
  std::memcpy(&m, counts + 4 * i, 4);
  return m;
}

// Every count word of a host slot's tail valid for R (ops/backend.h: m + d < R): a corrupt one
// would make the context wrong.
Status check_counts(const Config& c, int64_t R, const char* counts) {
  for (int64_t i = 0; i < c.num_layers * c.num_heads; ++i) {
    const int32_t w = count_at(counts, i);
    if (!pending_word_valid(w, R))
      return Status::corrupt("state: pending count word " + std::to_string(w) + " of layer " +
                             std::to_string(i / c.num_heads) + " head " + std::to_string(i % c.num_heads) +
                             " is not valid for R = " + std::to_string(R) + " (m = " +
                             std::to_string(pending_m(w)) + ", d = " + std::to_string(pending_d(w)) +
                             "; m + d must be below R)");
  }
  return Status::ok();
}

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
  return check_counts(cfg_, pending_.steps, static_cast<const char*>(host) + layout_.count_offset);
}

Status StatePool::convert_slot(const Config& c, DType from_dtype, PendingSpec from, const void* src, DType to_dtype,
                               PendingSpec to, std::vector<uint8_t>* dst) {
  Layout lf, lt;
  LAPLACE_RETURN_IF_ERROR(layout_for(c, from_dtype, from, &lf));
  LAPLACE_RETURN_IF_ERROR(layout_for(c, to_dtype, to, &lt));
  dst->assign(static_cast<size_t>(lt.slot_elems * static_cast<int64_t>(dtype_size(to_dtype))), 0);
  const int64_t L = c.num_layers, H = c.num_heads, dk = c.head_k_dim, dv = c.head_v_dim;
  const int64_t spec_elems = L * lf.layer_elems;  // the states and windows of every layer
  if (from.steps == 0 && from_dtype == to_dtype) {
    std::memcpy(dst->data(), src, static_cast<size_t>(spec_elems * static_cast<int64_t>(dtype_size(from_dtype))));
    return Status::ok();
  }
  std::vector<double> slot(static_cast<size_t>(spec_elems));
  for (int64_t i = 0; i < spec_elems; ++i) slot[static_cast<size_t>(i)] = load_value(src, from_dtype, i);
  if (from.steps != 0) {
    const char* base = static_cast<const char*>(src);
    LAPLACE_RETURN_IF_ERROR(check_counts(c, from.steps, base + lf.count_offset));
    const int64_t P = from.steps - 1, ps = static_cast<int64_t>(dtype_size(from.pair_dtype));
    const std::vector<double> decay = c.decays();
    for (int64_t l = 0; l < L; ++l) {
      const char* pk = base + lf.tail_offset + l * H * P * (dk + dv) * ps;  // [H, P, dk]
      const char* pv = pk + H * P * dk * ps;                                  // [H, P, dv]
      for (int64_t h = 0; h < H; ++h) {
        const int32_t m = pending_m(count_at(base + lf.count_offset, l * H + h));
        // S ← λ^m S + Σ_{j<m} λ^{m−1−j} k_jᵀ v_j (pair j is m − 1 − j steps old).
        double* S = slot.data() + l * lf.layer_elems + h * dk * dv;
        double pw = 1.0;
        for (int64_t j = 0; j < m; ++j) pw *= decay[static_cast<size_t>(h)];
        for (int64_t x = 0; x < dk * dv; ++x) S[x] *= pw;
        for (int64_t j = 0; j < m; ++j) {
          double w = 1.0;
          for (int64_t n = 0; n < m - 1 - j; ++n) w *= decay[static_cast<size_t>(h)];
          for (int64_t i = 0; i < dk; ++i) {
            const double ki = w * load_value(pk, from.pair_dtype, (h * P + j) * dk + i);
            for (int64_t e = 0; e < dv; ++e) S[i * dv + e] += ki * load_value(pv, from.pair_dtype, (h * P + j) * dv + e);
          }
        }
      }
    }
  }
  for (int64_t i = 0; i < spec_elems; ++i) store_value(dst->data(), to_dtype, i, slot[static_cast<size_t>(i)]);
  return Status::ok();
}

}  // namespace laplace
