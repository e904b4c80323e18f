// Decode states: one fixed-size slot per live sequence (docs/model.md §5).
// A slot holds, for each layer l, the H GLA states [H, dk, dv] followed by the conv
// window of the last K conv inputs [K, D], all F32, so a slot is exactly
// Config::state_bytes_per_sequence() bytes and a whole sequence's context is one
// contiguous block (one memcpy to snapshot, fork or restore it).
//
// With deferred write-back (an option, docs/serving.md §4) each slot also ends in a
// pending tail: per layer the last R − 1 tokens' (k, v) [H, R−1, dk] and [H, R−1, dv] in
// the activations' dtype, then every layer's counts [L, H] I32. The tail is part of the
// slot, so snapshots, forks and restores carry it and continue bit for bit.
#pragma once

#include <cstdint>
#include <vector>

#include "core/arena.h"
#include "model/config.h"
#include "ops/backend.h"

namespace laplace {

// Deferred write-back of a pool: R (0 = off; else 4, 8 or 16) and the pairs' dtype (the
// model's activations).
struct PendingSpec {
  int64_t steps = 0;
  DType pair_dtype = DType::kF32;
  // The R values the deferred kernels are built for.
  static bool supported(int64_t r) { return r == 4 || r == 8 || r == 16; }
};

class StatePool {
 public:
  // Allocates `slots` zeroed slots on the backend's device. States are F32 (docs/model.md
  // §5); F64 exists for the CPU backend's verification runs of F64 models; BF16 (half
  // the bytes, one rounding per update) is the serving option for BF16 models on CUDA.
  Status create(const Config& c, Backend& be, int64_t slots, DType dtype = DType::kF32, PendingSpec pending = {});
  // Bytes of one slot for these options (what create() gives slot_bytes()).
  static int64_t slot_bytes_for(const Config& c, DType dtype, PendingSpec pending = {});

  int64_t slots() const { return slots_; }
  DType dtype() const { return dtype_; }
  int64_t slot_elems() const { return slot_elems_; }  // values per slot
  // == Config::state_bytes_per_sequence() for F32 states without deferred write-back.
  int64_t slot_bytes() const { return slot_elems_ * static_cast<int64_t>(dtype_size(dtype_)); }
  // Layer l's GLA states of every slot: [S, H, dk, dv], dim-0 stride = slot_elems.
  Tensor gla(int64_t layer) const;
  // Layer l's conv windows of every slot: [S, K, D], dim-0 stride = slot_elems.
  Tensor conv(int64_t layer) const;
  // Layer l's pending pairs and counts of every slot (steps = 0: write-back not deferred).
  GlaPending pending(int64_t layer) const;
  int64_t pending_steps() const { return pending_.steps; }
  // The whole slot as a flat [slot_elems] view in the pool's dtype.
  Tensor slot(int64_t s) const;
  // Zeroes one slot (a new, empty context; no pending pairs).
  void reset(Backend& be, int64_t s);
  // dst slot = src slot (fork / restore).
  void copy_slot(Backend& be, int64_t dst, int64_t src);
  // Host copies of one slot (snapshots): `host` holds slot_bytes() bytes in the pool's
  // dtype. Both wait for the device (the bytes are usable / reusable on return).
  void read_slot(Backend& be, int64_t s, void* host) const;
  void write_slot(Backend& be, int64_t s, const void* host);
  // Whether a host copy of a slot (slot_bytes() bytes, e.g. a snapshot read from a file)
  // may be written into this pool: its pending count words, if any, are valid for R
  // (ops/backend.h: m + d < R). Kernels mask a bad word rather than index outside the pairs,
  // but the context would be wrong.
  Status check_slot_bytes(const void* host) const;
  // A host copy of a slot laid out for (from_dtype, from), re-laid out for (to_dtype, to) in
  // `dst` (slot_bytes_for(c, to_dtype, to) bytes): the pending pairs folded into the GLA states
  // (the flush a chunked forward starts with, summed in F64 here), every value converted to
  // to_dtype (BF16: through F32, each rounding to nearest even) and an empty tail. So a session saved with one
  // --state-dtype / --defer-writeback loads into a server with another. Without pairs and with
  // one dtype the bytes are copied unchanged. Fails on a count word not valid for R, like
  // check_slot_bytes.
  static Status convert_slot(const Config& c, DType from_dtype, PendingSpec from, const void* src, DType to_dtype,
                             PendingSpec to, std::vector<uint8_t>* dst);

 private:
  // The slot's byte layout: the states and windows of every layer, then the pending tail.
  struct Layout {
    int64_t slot_elems = 0, layer_elems = 0;
    int64_t tail_offset = 0;   // bytes: where the pending pairs start (16-byte aligned)
    int64_t count_offset = 0;  // bytes: where the counts [L, H] start
  };
  static Status layout_for(const Config& c, DType dtype, PendingSpec pending, Layout* out);

  Config cfg_;
  Arena arena_;
  DType dtype_ = DType::kF32;
  PendingSpec pending_;
  Layout layout_;
  Tensor all_;  // [S, slot_elems]
  int64_t slots_ = 0, slot_elems_ = 0, layer_elems_ = 0;
};

}  // namespace laplace
