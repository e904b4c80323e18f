// The exact state cache (issue 6, SPEC §5): a fixed-size state snapshot per cached token
// prefix, so a request whose tokens start with a cached prefix feeds only the rest. This
// class is the host-RAM tier; serve/state_cache.h puts a device tier (spare pool slots)
// in front of it.
// Unlike block-aligned prefix caches, any token boundary works: an entry is the whole
// context up to its last token.
//
// Entries are keyed by a hash of their token prefix and checked token by token on a hit
// (a hash collision can never return a wrong state). Bounded by bytes, least recently
// used evicted first. Thread-safe.
#pragma once

#include <cstdint>
#include <list>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "serve/request.h"
#include "core/thread_annotations.h"

namespace laplace {

struct PrefixCacheStats {
  int64_t entries = 0, bytes = 0, budget = 0;
  int64_t hits = 0, misses = 0, inserts = 0, evictions = 0;
  int64_t hit_tokens = 0;  // prompt tokens served from the cache (not prefilled)
};

class PrefixCache {
 public:
  explicit PrefixCache(int64_t budget_bytes) : budget_(budget_bytes) {}

  // Adds (or refreshes) the snapshot of its tokens. Snapshots larger than the budget are
  // not kept (returns false).
  bool insert(SnapshotPtr s);
  // The longest entry whose tokens are a prefix of `tokens` (possibly all of them) and at
  // least min_tokens long, or null. Counts a hit or a miss.
  SnapshotPtr lookup(const std::vector<int32_t>& tokens, size_t min_tokens = 1);
  // Drops the entry of exactly these tokens (not counted as an eviction). False if absent.
  bool erase(const std::vector<int32_t>& tokens);
  void clear();
  PrefixCacheStats stats() const;

  // The hash of tokens[0, n) for every n, as the cache keys entries (exposed for tests).
  static std::vector<uint64_t> prefix_hashes(const std::vector<int32_t>& tokens);

 private:
  struct Entry {
    uint64_t hash;
    SnapshotPtr snap;
  };
  void evict_locked() REQUIRES(mu_);
  void drop_locked(std::list<Entry>::iterator e) REQUIRES(mu_);

  const int64_t budget_;
  mutable std::mutex mu_;
  std::list<Entry> lru_ GUARDED_BY(mu_);  // front = most recently used
  std::unordered_multimap<uint64_t, std::list<Entry>::iterator> index_ GUARDED_BY(mu_);
  PrefixCacheStats stats_ GUARDED_BY(mu_);
};

}  // namespace laplace
