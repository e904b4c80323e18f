#include "serve/state_cache.h"

#include <algorithm>

namespace laplace {

StateCache::StateCache(StatePool& pool, Backend& be, int32_t first_slot, int64_t slots, int64_t host_bytes)
    : pool_(pool), be_(be), slots_(slots), host_(host_bytes) {
  LAPLACE_CHECK(slots >= 0 && first_slot >= 0 && first_slot + slots <= pool.slots(),
                "state cache: cache slots outside the pool");
  // Highest first, so that pop_back hands out the lowest free slot (easier to read in logs).
  for (int64_t s = slots - 1; s >= 0; --s) free_.push_back(static_cast<int32_t>(first_slot + s));
  stats_.device_slots = slots;
}

StateCache::Iter StateCache::find_locked(uint64_t hash, const std::vector<int32_t>& tokens, size_t n) {
  auto range = index_.equal_range(hash);
  for (auto it = range.first; it != range.second; ++it) {
    const std::vector<int32_t>& t = it->second->tokens;
    // The hash only selects candidates; the tokens decide (a collision never hits).
    if (t.size() == n && std::equal(t.begin(), t.end(), tokens.begin())) return it->second;
  }
  return lru_.end();
}

void StateCache::unindex_locked(Iter e) {
  auto range = index_.equal_range(e->hash);
  for (auto it = range.first; it != range.second; ++it)
    if (it->second == e) {
      index_.erase(it);
      return;
    }
}

void StateCache::demote(const Entry& e) {
  auto snap = std::make_shared<StateSnapshot>();
  snap->state_dtype = pool_.dtype();
  snap->state.resize(static_cast<size_t>(pool_.slot_bytes()));
  pool_.read_slot(be_, e.slot, snap->state.data());  // waits for the device: the slot may be reused next
  snap->logits = *e.logits;
  snap->tokens = e.tokens;
  const bool kept = host_.insert(std::move(snap));
  std::lock_guard<std::mutex> lk(mu_);
  ++stats_.demotions;
  if (!kept) ++stats_.evictions;  // no host tier (or it cannot hold one state): the entry is gone
}

CacheHit StateCache::restore(const std::vector<int32_t>& tokens, size_t min_tokens, int32_t dst) {
  CacheHit hit;
  if (tokens.empty()) return hit;
  const std::vector<uint64_t> h = PrefixCache::prefix_hashes(tokens);
  const size_t lo = std::max<size_t>(min_tokens, 1);
  int32_t src = -1;
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (size_t n = tokens.size(); n >= lo && !lru_.empty(); --n) {
      Iter e = find_locked(h[n], tokens, n);
      if (e == lru_.end()) continue;
      lru_.splice(lru_.begin(), lru_, e);
      src = e->slot;
      hit = {StateSource::kDeviceCache, static_cast<int64_t>(n), e->logits};
      ++stats_.device_hits;
      stats_.device_hit_tokens += static_cast<int64_t>(n);
      break;
    }
  }
  if (src >= 0) {
    // Only this (the engine) thread reuses cache slots, so src stays this entry's state
    // while it is copied; on CUDA the copy is ordered before any later write to either slot
    // on the backend's one stream.
    pool_.copy_slot(be_, dst, src);
    return hit;
  }
  // A host-tier entry must beat the device tier's best (none) and the caller's own start.
  SnapshotPtr snap = host_.lookup(tokens, std::max<size_t>(min_tokens + 1, 1));
  if (!snap) {
    std::lock_guard<std::mutex> lk(mu_);
    ++stats_.misses;
    return hit;
  }
  pool_.write_slot(be_, dst, snap->state.data());
  // The logits stay owned by the snapshot (aliasing pointer: no copy of [V] floats).
  hit = {StateSource::kHostCache, static_cast<int64_t>(snap->tokens.size()),
         std::shared_ptr<const std::vector<float>>(snap, &snap->logits)};
  {
    std::lock_guard<std::mutex> lk(mu_);
    ++stats_.host_hits;
    stats_.host_hit_tokens += hit.tokens;
  }
  // Promote: the entry is now the most recently used, so it belongs in the device tier.
  // dst holds exactly its state until the request's prefill starts (after this returns).
  if (slots_ > 0 && to_device(dst, snap->tokens, hit.logits)) {
    std::lock_guard<std::mutex> lk(mu_);
    ++stats_.promotions;
  }
  return hit;
}

void StateCache::insert(int32_t src, const std::vector<int32_t>& tokens,
                        std::shared_ptr<const std::vector<float>> logits) {
  LAPLACE_CHECK(!tokens.empty() && logits, "state cache: an entry needs tokens and logits");
  if (slots_ == 0) {  // host tier only: one device→host copy, as before the device tier
    auto snap = std::make_shared<StateSnapshot>();
    snap->state_dtype = pool_.dtype();
    snap->state.resize(static_cast<size_t>(pool_.slot_bytes()));
    pool_.read_slot(be_, src, snap->state.data());
    snap->logits = *logits;
    snap->tokens = tokens;
    const int64_t before = host_.stats().inserts;
    host_.insert(std::move(snap));
    if (host_.stats().inserts > before) {
      std::lock_guard<std::mutex> lk(mu_);
      ++stats_.inserts;
    }
    return;
  }
  if (to_device(src, tokens, std::move(logits))) {
    std::lock_guard<std::mutex> lk(mu_);
    ++stats_.inserts;
  }
}

bool StateCache::to_device(int32_t src, const std::vector<int32_t>& tokens,
                           std::shared_ptr<const std::vector<float>> logits) {
  const uint64_t hash = PrefixCache::prefix_hashes(tokens).back();
  Entry victim{0, {}, nullptr, -1};
  int32_t slot = -1;
  {
    std::lock_guard<std::mutex> lk(mu_);
    Iter e = find_locked(hash, tokens, tokens.size());
    if (e != lru_.end()) {  // the same context is cached already: refresh it
      lru_.splice(lru_.begin(), lru_, e);
      return false;
    }
    if (!free_.empty()) {
      slot = free_.back();
      free_.pop_back();
    } else {
      // Full: the least recently used entry leaves the device tier; its slot is ours.
      Iter last = std::prev(lru_.end());
      unindex_locked(last);
      victim = std::move(*last);
      lru_.erase(last);
      slot = victim.slot;
    }
  }
  if (victim.slot >= 0) demote(victim);  // before the slot is overwritten (read_slot waits)
  pool_.copy_slot(be_, slot, src);
  host_.erase(tokens);  // exclusive tiers: a host copy of the same context is now redundant
  std::lock_guard<std::mutex> lk(mu_);
  lru_.push_front({hash, tokens, std::move(logits), slot});
  index_.emplace(hash, lru_.begin());
  return true;
}

StateCacheStats StateCache::stats() const {
  const PrefixCacheStats h = host_.stats();
  std::lock_guard<std::mutex> lk(mu_);
  StateCacheStats s = stats_;
  s.device_used = static_cast<int64_t>(lru_.size());
  s.host_entries = h.entries;
  s.entries = s.device_used + h.entries;
  s.bytes = h.bytes;
  s.budget = h.budget;
  s.hits = s.device_hits + s.host_hits;
  s.hit_tokens = s.device_hit_tokens + s.host_hit_tokens;
  s.evictions += h.evictions;
  return s;
}

}  // namespace laplace
