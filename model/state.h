// Decode states: one fixed-size slot per live sequence (SPEC §1 "Inference state").
// A slot holds, for each layer l, the H GLA states [H, dk, dv] followed by the conv
// window of the last K conv inputs [K, D], all F32, so a slot is exactly
// Config::state_bytes_per_sequence() bytes and a whole sequence's context is one
// contiguous block (one memcpy to snapshot, fork or restore it).
#pragma once

#include <cstdint>

#include "core/arena.h"
#include "model/config.h"
#include "ops/backend.h"

namespace laplace {

class StatePool {
 public:
  // Allocates `slots` zeroed slots on the backend's device. States are F32 (SPEC
  // §1); F64 exists for the CPU backend's verification runs of F64 models; BF16 (half
  // the bytes, one rounding per update) is the serving option for BF16 models on CUDA.
  Status create(const Config& c, Backend& be, int64_t slots, DType dtype = DType::kF32);

  int64_t slots() const { return slots_; }
  DType dtype() const { return dtype_; }
  int64_t slot_elems() const { return slot_elems_; }  // values per slot
  // == Config::state_bytes_per_sequence() for F32 states.
  int64_t slot_bytes() const { return slot_elems_ * static_cast<int64_t>(dtype_size(dtype_)); }
  // Layer l's GLA states of every slot: [S, H, dk, dv], dim-0 stride = slot_elems.
  Tensor gla(int64_t layer) const;
  // Layer l's conv windows of every slot: [S, K, D], dim-0 stride = slot_elems.
  Tensor conv(int64_t layer) const;
  // The whole slot as a flat [slot_elems] view in the pool's dtype.
  Tensor slot(int64_t s) const;
  // Zeroes one slot (a new, empty context).
  void reset(Backend& be, int64_t s);
  // dst slot = src slot (fork / restore).
  void copy_slot(Backend& be, int64_t dst, int64_t src);
  // Host copies of one slot (snapshots): `host` holds slot_bytes() bytes in the pool's
  // dtype. Both wait for the device (the bytes are usable / reusable on return).
  void read_slot(Backend& be, int64_t s, void* host) const;
  void write_slot(Backend& be, int64_t s, const void* host);

 private:
  Config cfg_;
  Arena arena_;
  DType dtype_ = DType::kF32;
  Tensor all_;  // [S, slot_elems]
  int64_t slots_ = 0, slot_elems_ = 0, layer_elems_ = 0;
};

}  // namespace laplace
