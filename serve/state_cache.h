// The exact prefix cache in two tiers (issue 6): the state at the end of a prompt or a
// response, kept under a hash of its token prefix, so a request whose tokens start with a
// cached prefix feeds only the rest — at any token boundary.
//
//   device tier: N spare "cache slots" of the engine's StatePool (beyond the live slots
//                and the scratch slot). A hit starts the request by a slot-to-slot copy
//                on the device (StatePool::copy_slot, one Backend::copy): no host trip.
//   host tier:   PrefixCache (serve/prefix_cache.h): StateSnapshot bytes in host RAM,
//                bounded by bytes. A hit is a host→device write into the request's slot.
//
// One LRU order across tiers, exclusive: the device tier holds the most recently used
// entries; inserting into a full device tier demotes its least recently used entry to the
// host tier (device→host copy), where the byte bound evicts as before. A host-tier hit is
// promoted back into the device tier (it is now the most recently used entry).
//
// Where things live: a device entry's state is its cache slot; its logits [V] and tokens
// stay in host memory (the engine samples on the host from host logits, and lookups hash
// tokens on the host) and are not counted against the host tier's byte bound. The host
// tier's snapshots hold all three.
//
// Threads: every call that copies state (restore, insert) runs on the engine thread,
// which owns the backend and the pool; only that thread changes the device tier, so a
// cache slot cannot be reused while it is being copied from. stats() may be called from
// any thread (the counters and the device index are guarded by a mutex; the host tier is
// thread-safe on its own).
#pragma once

#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "model/state.h"
#include "core/thread_annotations.h"
#include "serve/prefix_cache.h"

namespace laplace {

struct StateCacheStats {
  // Both tiers (the names the host-only cache had, so existing metrics keep their meaning).
  int64_t entries = 0;     // device + host entries
  int64_t bytes = 0;       // host-tier bytes (state + logits + tokens)
  int64_t budget = 0;      // host-tier byte bound
  int64_t hits = 0, misses = 0;
  int64_t hit_tokens = 0;  // prompt tokens served from the cache (not prefilled)
  int64_t inserts = 0;     // new entries (refreshes of an existing prefix not counted)
  int64_t evictions = 0;   // entries dropped from the host tier by its byte bound (gone)
  // Device tier.
  int64_t device_slots = 0, device_used = 0;  // used + free = slots, always
  int64_t device_hits = 0, device_hit_tokens = 0;
  int64_t demotions = 0;   // device → host (the device tier was full)
  int64_t promotions = 0;  // host → device (a host-tier hit)
  // Host tier.
  int64_t host_entries = 0, host_hits = 0, host_hit_tokens = 0;
};

struct CacheHit {
  StateSource source = StateSource::kEmpty;  // kDeviceCache, kHostCache, or kEmpty (a miss)
  int64_t tokens = 0;                        // the prefix length the state covers
  std::shared_ptr<const std::vector<float>> logits;  // [V] after that prefix
};

class StateCache {
 public:
  // Cache slots are pool slots [first_slot, first_slot + slots); host_bytes bounds the
  // host tier (0: no host tier, a demoted entry is dropped).
  StateCache(StatePool& pool, Backend& be, int32_t first_slot, int64_t slots, int64_t host_bytes);
  StateCache(const StateCache&) = delete;
  StateCache& operator=(const StateCache&) = delete;

  // False when both tiers have no room (the cache is off).
  bool enabled() const { return slots_ > 0 || host_.stats().budget > 0; }
  int64_t device_slots() const { return slots_; }

  // Engine thread. The longest cached prefix of `tokens` with at least min_tokens tokens
  // (a host-tier entry must be longer than min_tokens: the caller's own start, e.g. an
  // initial snapshot of min_tokens tokens, costs the same host write). On a hit its state
  // is now in slot `dst`. Counts a hit (per tier) or a miss.
  CacheHit restore(const std::vector<int32_t>& tokens, size_t min_tokens, int32_t dst);
  // Engine thread. Keeps the state now in slot `src` as the context `tokens` (non-empty)
  // with the logits after it. A prefix already cached is only refreshed (it is the same
  // context).
  void insert(int32_t src, const std::vector<int32_t>& tokens, std::shared_ptr<const std::vector<float>> logits);

  StateCacheStats stats() const;

 private:
  struct Entry {
    uint64_t hash;
    std::vector<int32_t> tokens;
    std::shared_ptr<const std::vector<float>> logits;
    int32_t slot;
  };
  using Iter = std::list<Entry>::iterator;
  Iter find_locked(uint64_t hash, const std::vector<int32_t>& tokens, size_t n) REQUIRES(mu_);
  void unindex_locked(Iter e) REQUIRES(mu_);
  // Puts the state in slot src into the device tier (demoting its LRU entry when full);
  // false if these tokens were there already (then only refreshed).
  bool to_device(int32_t src, const std::vector<int32_t>& tokens, std::shared_ptr<const std::vector<float>> logits);
  // Copies a device entry's state to a host snapshot and hands it to the host tier.
  void demote(const Entry& e);

  StatePool& pool_;
  Backend& be_;
  const int64_t slots_;
  PrefixCache host_;

  mutable std::mutex mu_;  // guards lru_, index_, free_, stats_ (changed on the engine thread only)
  std::list<Entry> lru_ GUARDED_BY(mu_);   // front = most recently used
  std::unordered_multimap<uint64_t, Iter> index_ GUARDED_BY(mu_);
  std::vector<int32_t> free_ GUARDED_BY(mu_);  // free cache slots
  StateCacheStats stats_ GUARDED_BY(mu_);      // the device-tier and cross-tier counters
};

}  // namespace laplace
