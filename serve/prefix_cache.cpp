#include "serve/prefix_cache.h"

#include <algorithm>

namespace laplace {

std::vector<uint64_t> PrefixCache::prefix_hashes(const std::vector<int32_t>& tokens) {
  // FNV-1a over the tokens' bytes, extended one token at a time: h[n] covers tokens[0, n).
  std::vector<uint64_t> h(tokens.size() + 1);
  uint64_t x = 0xcbf29ce484222325ull;
  h[0] = x;
  for (size_t i = 0; i < tokens.size(); ++i) {
    uint32_t t = static_cast<uint32_t>(tokens[i]);
    for (int b = 0; b < 4; ++b) {
      x ^= (t >> (8 * b)) & 0xffu;
      x *= 0x100000001b3ull;
    }
    h[i + 1] = x;
  }
  return h;
}

bool PrefixCache::insert(SnapshotPtr s) {
  if (!s || s->tokens.empty() || s->bytes() > budget_) return false;
  const uint64_t h = prefix_hashes(s->tokens).back();
  std::lock_guard<std::mutex> lk(mu_);
  auto range = index_.equal_range(h);
  for (auto it = range.first; it != range.second; ++it) {
    if (it->second->snap->tokens == s->tokens) {  // already cached: refresh
      lru_.splice(lru_.begin(), lru_, it->second);
      return true;
    }
  }
  lru_.push_front({h, std::move(s)});
  index_.emplace(h, lru_.begin());
  stats_.bytes += lru_.front().snap->bytes();
  ++stats_.entries;
  ++stats_.inserts;
  evict_locked();
  return true;
}

void PrefixCache::drop_locked(std::list<Entry>::iterator e) {
  auto range = index_.equal_range(e->hash);
  for (auto it = range.first; it != range.second; ++it)
    if (it->second == e) {
      index_.erase(it);
      break;
    }
  stats_.bytes -= e->snap->bytes();
  --stats_.entries;
  lru_.erase(e);
}

void PrefixCache::evict_locked() {
  while (stats_.bytes > budget_ && !lru_.empty()) {
    drop_locked(std::prev(lru_.end()));
    ++stats_.evictions;
  }
}

bool PrefixCache::erase(const std::vector<int32_t>& tokens) {
  if (tokens.empty()) return false;
  const uint64_t h = prefix_hashes(tokens).back();
  std::lock_guard<std::mutex> lk(mu_);
  auto range = index_.equal_range(h);
  for (auto it = range.first; it != range.second; ++it)
    if (it->second->snap->tokens == tokens) {
      drop_locked(it->second);
      return true;
    }
  return false;
}

SnapshotPtr PrefixCache::lookup(const std::vector<int32_t>& tokens, size_t min_tokens) {
  const std::vector<uint64_t> h = prefix_hashes(tokens);
  std::lock_guard<std::mutex> lk(mu_);
  for (size_t n = tokens.size(); n >= std::max<size_t>(min_tokens, 1); --n) {
    auto range = index_.equal_range(h[n]);
    for (auto it = range.first; it != range.second; ++it) {
      const std::vector<int32_t>& t = it->second->snap->tokens;
      if (t.size() == n && std::equal(t.begin(), t.end(), tokens.begin())) {
        lru_.splice(lru_.begin(), lru_, it->second);
        ++stats_.hits;
        stats_.hit_tokens += static_cast<int64_t>(n);
        return lru_.front().snap;
      }
    }
  }
  ++stats_.misses;
  return nullptr;
}

void PrefixCache::clear() {
  std::lock_guard<std::mutex> lk(mu_);
  lru_.clear();
  index_.clear();
  stats_.entries = stats_.bytes = 0;
}

PrefixCacheStats PrefixCache::stats() const {
  std::lock_guard<std::mutex> lk(mu_);
  PrefixCacheStats s = stats_;
  s.budget = budget_;
  return s;
}

}  // namespace laplace
