// DataLoader: training batches from token shards (text/shard.h).
//
// Every call to next() yields x [B, T] and y [B, T] (int32, row-major), where
// each row comes from a window of T + 1 consecutive tokens of one shard:
// x = window[0 : T], y = window[1 : T + 1]. The exact rules (docs/data.md):
//
// Sequential mode (shuffle = false) — llm.c's / train_gpt2.py's loader.
//   Let S = world * B * T. A global position p starts at 0 in shard 0. Rank r
//   reads buf = tokens[p + r*B*T : p + r*B*T + B*T + 1], x = buf[:-1], y = buf[1:].
//   Then p += S, and if p + S + 1 > n (n = tokens in the shard) the loader
//   moves to the next shard (after the last: back to the first, epoch + 1)
//   with p = 0. Every shard must hold at least S + 1 tokens.
//
// Shuffled mode (shuffle = true) — deterministic from `seed`.
//   A shard of n tokens has floor((n - 1) / T) windows starting at k*T (stride
//   T, length T + 1; none crosses the shard end). Epoch e visits the shards in
//   the order of a seeded permutation and, inside each shard, its windows in
//   the order of a seeded permutation. This infinite stream of windows is cut
//   into global batches of world*B consecutive windows (a batch may span
//   shards and epochs); rank r takes windows r*B .. r*B + B - 1 of each.
//
// In both modes, P ranks with batch B each read exactly the windows that one
// rank with batch P*B reads, and rank r's x/y equal rows r*B .. r*B + B - 1 of
// that single rank's batch.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/status.h"
#include "text/shard.h"

namespace laplace {

struct DataLoaderOptions {
  // Shard paths, or glob patterns ("data/train_*.bin"); each pattern expands to
  // its matches in sorted order and must match at least one file.
  std::vector<std::string> shards;
  int64_t batch_size = 0;  // B, rows per rank
  int64_t seq_len = 0;     // T
  bool shuffle = false;
  uint64_t seed = 0;       // shuffled mode only
  int rank = 0;
  int world = 1;
  // > 0: every token of every shard is checked to be < vocab_size at open.
  int64_t vocab_size = 0;
};

// Where the loader is in its (rank-independent) stream: the next batch to be
// produced. All ranks hold the same position; saving rank 0's is enough.
struct LoaderPosition {
  int64_t epoch = 0;
  // Sequential: shard file index. Shuffled: index into epoch `epoch`'s shard order.
  int64_t shard = 0;
  // Sequential: batch index in the shard (global offset p = window * world*B*T).
  // Shuffled: index into the shard's window permutation of the next window.
  int64_t window = 0;

  // The stream this position belongs to; seek() refuses a mismatch.
  bool shuffle = false;
  uint64_t seed = 0;
  int64_t seq_len = 0;
  int64_t global_batch = 0;  // world * B (may differ on seek in shuffled mode)
  int64_t num_shards = 0;
  int64_t total_tokens = 0;

  std::string to_json() const;
  static Status from_json(const std::string& json, LoaderPosition* out);
  bool operator==(const LoaderPosition&) const = default;
};

// Expands glob patterns (entries without * ? [ are kept as they are).
// A pattern that matches nothing is not_found.
Status expand_shard_patterns(const std::vector<std::string>& patterns, std::vector<std::string>* paths);

class DataLoader {
 public:
  DataLoader() = default;
  DataLoader(DataLoader&&) noexcept = default;
  DataLoader& operator=(DataLoader&&) noexcept = default;
  DataLoader(const DataLoader&) = delete;
  DataLoader& operator=(const DataLoader&) = delete;

  // Opens and validates every shard (ShardReader::open with options.vocab_size)
  // and checks that there is data for at least one batch. Starts at epoch 0.
  static Status open(const DataLoaderOptions& options, DataLoader* out);

  // Writes the next batch: x and y each hold B*T int32 (row-major [B, T]).
  void next(int32_t* x, int32_t* y);
  void next(std::vector<int32_t>* x, std::vector<int32_t>* y);

  // The position of the next batch; seek(position()) is a no-op, and a loader
  // opened with the same options and seeked to a saved position yields the
  // same batches as the original from that point on.
  LoaderPosition position() const;
  Status seek(const LoaderPosition& pos);
  // Back to the start of epoch 0.
  void reset();

  int64_t batch_size() const { return B_; }
  int64_t seq_len() const { return T_; }
  int rank() const { return rank_; }
  int world() const { return world_; }
  bool shuffle() const { return shuffle_; }
  int64_t num_shards() const { return static_cast<int64_t>(shards_.size()); }
  int64_t total_tokens() const { return total_tokens_; }
  const std::vector<std::string>& shard_paths() const { return paths_; }
  // Global batches in one epoch: sequential Σ floor((n_s - 1) / S); shuffled
  // floor(total windows / (world*B)) (batches may straddle epochs there).
  int64_t batches_per_epoch() const;

 private:
  void normalize();  // shuffled: skip past exhausted/empty shards, build perm_

  std::vector<std::string> paths_;
  std::vector<ShardReader> shards_;
  int64_t B_ = 0, T_ = 0;
  int rank_ = 0, world_ = 1;
  bool shuffle_ = false;
  uint64_t seed_ = 0;
  int64_t total_tokens_ = 0;
  int64_t total_windows_ = 0;
  std::vector<int64_t> nwin_;       // per shard file: sequential batches or shuffled windows

  int64_t epoch_ = 0, shard_ = 0, window_ = 0;
  std::vector<int64_t> order_;      // shuffled: shard order of epoch_
  std::vector<int64_t> perm_;       // shuffled: window order of the current shard
  int64_t perm_epoch_ = -1, perm_file_ = -1;  // which (epoch, file) perm_ belongs to
};

}  // namespace laplace
