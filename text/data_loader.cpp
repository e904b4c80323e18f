#include "text/data_loader.h"

#include "core/rng.h"

#include <glob.h>

#include <algorithm>
#include <nlohmann/json.hpp>

#include "core/check.h"

namespace laplace {

namespace {

// The shuffle RNG, spelled out so other implementations can reproduce it
// (docs/data.md): SplitMix64 seeded by mixing (seed, epoch, stream id), and
// Fisher–Yates with unbiased rejection sampling.
// stream = 0 for the shard order of an epoch, 1 + file index for a shard's windows.
uint64_t stream_seed(uint64_t seed, int64_t epoch, int64_t stream) {
  uint64_t h = splitmix64_hash(seed);
  h = splitmix64_hash(h ^ static_cast<uint64_t>(epoch));
  return splitmix64_hash(h ^ static_cast<uint64_t>(stream));
}

void permutation(int64_t n, uint64_t seed, std::vector<int64_t>* out) {
  out->resize(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) (*out)[i] = i;
  SplitMix64 rng{seed};
  for (int64_t i = n - 1; i >= 1; --i) {
    const int64_t j = static_cast<int64_t>(rng.below(static_cast<uint64_t>(i + 1)));
    std::swap((*out)[i], (*out)[j]);
  }
}

bool has_glob_chars(const std::string& s) { return s.find_first_of("*?[") != std::string::npos; }

}  // namespace

// ---------------------------------------------------------------- position

std::string LoaderPosition::to_json() const {
  nlohmann::json j = {
      {"format", "laplace.loader_position"},
      {"version", 1},
      {"mode", shuffle ? "shuffled" : "sequential"},
      {"epoch", epoch},
      {"shard", shard},
      {"window", window},
      {"seed", seed},
      {"seq_len", seq_len},
      {"global_batch", global_batch},
      {"num_shards", num_shards},
      {"total_tokens", total_tokens},
  };
  return j.dump();
}

Status LoaderPosition::from_json(const std::string& text, LoaderPosition* out) {
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return Status::corrupt("loader position: not a JSON object");
  LoaderPosition p;
  try {
    if (j.value("format", std::string()) != "laplace.loader_position") {
      return Status::corrupt("loader position: missing or wrong \"format\" (expected laplace.loader_position)");
    }
    if (j.at("version").get<int>() != 1) {
      return Status::unsupported("loader position: version " + j.at("version").dump() + " (expected 1)");
    }
    const std::string mode = j.at("mode").get<std::string>();
    if (mode != "sequential" && mode != "shuffled") {
      return Status::corrupt("loader position: mode \"" + mode + "\" (expected sequential or shuffled)");
    }
    p.shuffle = mode == "shuffled";
    for (const char* key : {"epoch", "shard", "window", "seq_len", "global_batch", "num_shards", "total_tokens"}) {
      if (!j.contains(key) || !j[key].is_number_integer()) {
        return Status::corrupt(std::string("loader position: \"") + key + "\" is missing or not an integer");
      }
    }
    p.epoch = j["epoch"].get<int64_t>();
    p.shard = j["shard"].get<int64_t>();
    p.window = j["window"].get<int64_t>();
    if (!j.contains("seed") || !j["seed"].is_number_integer() ||
        (!j["seed"].is_number_unsigned() && j["seed"].get<int64_t>() < 0)) {
      return Status::corrupt("loader position: \"seed\" is missing or not a non-negative integer");
    }
    p.seed = j["seed"].get<uint64_t>();
    p.seq_len = j["seq_len"].get<int64_t>();
    p.global_batch = j["global_batch"].get<int64_t>();
    p.num_shards = j["num_shards"].get<int64_t>();
    p.total_tokens = j["total_tokens"].get<int64_t>();
  } catch (const nlohmann::json::exception& e) {
    return Status::corrupt(std::string("loader position: ") + e.what());
  }
  if (p.epoch < 0 || p.shard < 0 || p.window < 0) return Status::corrupt("loader position: negative epoch/shard/window");
  *out = p;
  return Status::ok();
}

// ---------------------------------------------------------------- globbing

Status expand_shard_patterns(const std::vector<std::string>& patterns, std::vector<std::string>* paths) {
  std::vector<std::string> result;
  for (const std::string& pat : patterns) {
    if (!has_glob_chars(pat)) {
      result.push_back(pat);
      continue;
    }
    glob_t g{};
    const int rc = ::glob(pat.c_str(), 0, nullptr, &g);
    if (rc == GLOB_NOMATCH) {
      globfree(&g);
      return Status::not_found("shard pattern " + pat + " matches no files");
    }
    if (rc != 0) {
      globfree(&g);
      return Status::io_error("shard pattern " + pat + ": glob failed");
    }
    std::vector<std::string> matches(g.gl_pathv, g.gl_pathv + g.gl_pathc);
    globfree(&g);
    std::sort(matches.begin(), matches.end());
    result.insert(result.end(), matches.begin(), matches.end());
  }
  *paths = std::move(result);
  return Status::ok();
}

// ---------------------------------------------------------------- loader

Status DataLoader::open(const DataLoaderOptions& o, DataLoader* out) {
  if (o.batch_size < 1 || o.seq_len < 1) {
    return Status::invalid_argument("data loader: batch_size (" + std::to_string(o.batch_size) + ") and seq_len (" +
                                    std::to_string(o.seq_len) + ") must be >= 1");
  }
  if (o.world < 1 || o.rank < 0 || o.rank >= o.world) {
    return Status::invalid_argument("data loader: rank " + std::to_string(o.rank) + " is not in [0, world=" +
                                    std::to_string(o.world) + ")");
  }
  if (o.batch_size > (int64_t{1} << 24) || o.seq_len > (int64_t{1} << 24) ||
      o.batch_size * o.seq_len * o.world > (int64_t{1} << 40)) {
    return Status::invalid_argument("data loader: batch_size * seq_len * world is implausibly large");
  }
  if (o.shards.empty()) return Status::invalid_argument("data loader: no shards given");

  DataLoader dl;
  LAPLACE_RETURN_IF_ERROR(expand_shard_patterns(o.shards, &dl.paths_).with_context("data loader"));
  if (dl.paths_.empty()) return Status::invalid_argument("data loader: no shards given");
  dl.B_ = o.batch_size;
  dl.T_ = o.seq_len;
  dl.rank_ = o.rank;
  dl.world_ = o.world;
  dl.shuffle_ = o.shuffle;
  dl.seed_ = o.seed;
  const int64_t S = dl.world_ * dl.B_ * dl.T_;
  for (const std::string& path : dl.paths_) {
    ShardReader r;
    LAPLACE_RETURN_IF_ERROR(ShardReader::open(path, o.vocab_size, &r).with_context("data loader"));
    const int64_t n = r.size();
    if (!dl.shuffle_ && n < S + 1) {
      return Status::invalid_argument("data loader: shard " + path + " has " + std::to_string(n) +
                                      " tokens; sequential mode needs at least world*B*T + 1 = " +
                                      std::to_string(S + 1));
    }
    const int64_t w = n < 1 ? 0 : (dl.shuffle_ ? (n - 1) / dl.T_ : (n - 1) / S);
    dl.nwin_.push_back(w);
    dl.total_windows_ += w;
    dl.total_tokens_ += n;
    dl.shards_.push_back(std::move(r));
  }
  if (dl.total_windows_ == 0) {
    return Status::invalid_argument("data loader: no shard holds a full window of seq_len + 1 = " +
                                    std::to_string(dl.T_ + 1) + " tokens (" + std::to_string(dl.total_tokens_) +
                                    " tokens in " + std::to_string(dl.paths_.size()) + " shards)");
  }
  dl.reset();
  *out = std::move(dl);
  return Status::ok();
}

void DataLoader::reset() {
  epoch_ = 0;
  shard_ = 0;
  window_ = 0;
  perm_epoch_ = perm_file_ = -1;
  if (shuffle_) {
    permutation(num_shards(), stream_seed(seed_, 0, 0), &order_);
    normalize();
  }
}

void DataLoader::normalize() {
  LAPLACE_CHECK(shuffle_ && total_windows_ > 0, "DataLoader::normalize: shuffled mode with data");
  while (window_ >= nwin_[order_[shard_]]) {
    window_ = 0;
    if (++shard_ == num_shards()) {
      shard_ = 0;
      ++epoch_;
      permutation(num_shards(), stream_seed(seed_, epoch_, 0), &order_);
    }
  }
  const int64_t file = order_[shard_];
  if (perm_epoch_ != epoch_ || perm_file_ != file) {
    permutation(nwin_[file], stream_seed(seed_, epoch_, 1 + file), &perm_);
    perm_epoch_ = epoch_;
    perm_file_ = file;
  }
}

void DataLoader::next(int32_t* x, int32_t* y) {
  LAPLACE_CHECK(!shards_.empty(), "DataLoader::next on a loader that is not open");
  const int64_t BT = B_ * T_;
  if (!shuffle_) {
    const ShardReader& sh = shards_[shard_];
    const int64_t S = world_ * BT;
    const int64_t base = window_ * S + rank_ * BT;
    for (int64_t b = 0; b < B_; ++b) {
      sh.read(base + b * T_, T_, x + b * T_);
      sh.read(base + b * T_ + 1, T_, y + b * T_);
    }
    ++window_;
    if (window_ * S + S + 1 > sh.size()) {
      window_ = 0;
      if (++shard_ == num_shards()) {
        shard_ = 0;
        ++epoch_;
      }
    }
    return;
  }
  const int64_t global = world_ * B_;
  const int64_t lo = rank_ * B_;
  for (int64_t i = 0; i < global; ++i) {
    if (i >= lo && i < lo + B_) {
      const int64_t row = i - lo;
      const ShardReader& sh = shards_[order_[shard_]];
      const int64_t start = perm_[window_] * T_;
      sh.read(start, T_, x + row * T_);
      sh.read(start + 1, T_, y + row * T_);
    }
    ++window_;
    normalize();
  }
}

void DataLoader::next(std::vector<int32_t>* x, std::vector<int32_t>* y) {
  x->resize(static_cast<size_t>(B_ * T_));
  y->resize(static_cast<size_t>(B_ * T_));
  next(x->data(), y->data());
}

LoaderPosition DataLoader::position() const {
  LoaderPosition p;
  p.epoch = epoch_;
  p.shard = shard_;
  p.window = window_;
  p.shuffle = shuffle_;
  p.seed = shuffle_ ? seed_ : 0;
  p.seq_len = T_;
  p.global_batch = world_ * B_;
  p.num_shards = num_shards();
  p.total_tokens = total_tokens_;
  return p;
}

Status DataLoader::seek(const LoaderPosition& p) {
  auto mismatch = [](const std::string& what, int64_t saved, int64_t now) {
    return Status::invalid_argument("data loader seek: the position was saved with " + what + " = " +
                                    std::to_string(saved) + ", this loader has " + std::to_string(now));
  };
  if (p.shuffle != shuffle_) {
    return Status::invalid_argument(std::string("data loader seek: the position is for ") +
                                    (p.shuffle ? "shuffled" : "sequential") + " mode, this loader is " +
                                    (shuffle_ ? "shuffled" : "sequential"));
  }
  if (p.num_shards != num_shards()) return mismatch("num_shards", p.num_shards, num_shards());
  if (p.total_tokens != total_tokens_) return mismatch("total_tokens", p.total_tokens, total_tokens_);
  if (p.seq_len != T_) return mismatch("seq_len", p.seq_len, T_);
  if (shuffle_ && p.seed != seed_) {
    return Status::invalid_argument("data loader seek: the position was saved with seed " + std::to_string(p.seed) +
                                    ", this loader has seed " + std::to_string(seed_));
  }
  if (!shuffle_ && p.global_batch != world_ * B_) return mismatch("world*batch_size", p.global_batch, world_ * B_);
  if (p.epoch < 0 || p.shard < 0 || p.shard >= num_shards() || p.window < 0) {
    return Status::invalid_argument("data loader seek: epoch/shard/window (" + std::to_string(p.epoch) + ", " +
                                    std::to_string(p.shard) + ", " + std::to_string(p.window) + ") out of range");
  }
  if (!shuffle_) {
    if (p.window >= nwin_[p.shard]) {
      return Status::invalid_argument("data loader seek: window " + std::to_string(p.window) + " is past the end of shard " +
                                      std::to_string(p.shard) + " (" + std::to_string(nwin_[p.shard]) + " batches)");
    }
    epoch_ = p.epoch;
    shard_ = p.shard;
    window_ = p.window;
    return Status::ok();
  }
  std::vector<int64_t> order;
  permutation(num_shards(), stream_seed(seed_, p.epoch, 0), &order);
  const int64_t file = order[p.shard];
  if (p.window >= nwin_[file]) {
    return Status::invalid_argument("data loader seek: window " + std::to_string(p.window) + " is past the end of shard " +
                                    paths_[file] + " (" + std::to_string(nwin_[file]) + " windows)");
  }
  epoch_ = p.epoch;
  shard_ = p.shard;
  window_ = p.window;
  order_ = std::move(order);
  normalize();
  return Status::ok();
}

int64_t DataLoader::batches_per_epoch() const {
  if (!shuffle_) return total_windows_;
  return total_windows_ / (world_ * B_);
}

}  // namespace laplace
