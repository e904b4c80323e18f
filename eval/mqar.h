// MQAR, multi-query associative recall (Zoology: Arora et al. 2023, arXiv 2312.04927), the
// recall benchmark behind `laplace eval mqar` (docs/quality.md, "Recall: MQAR").
//
// One example of T tokens over a vocabulary of V, with P key–value pairs:
//
//   keys   K = [1, V/2)   values  [V/2, V)       (token 0 is never a key)
//   0 .. 2P−1             k1 v1 k2 v2 … kP vP     P distinct keys, P distinct values
//   2P .. T−1             queries: key i at 2P + 2·gap_i, its value right after it; every
//                         other position is filler
//
// gap_1 … gap_P are drawn without replacement from {0 … ⌊(T−2P)/2⌋−1} with probability
// ∝ (g+1)^(a−1) (a = power_a, Zoology's 0.01: short gaps are far likelier), in draw order
// for keys 1 … P, as Zoology's multiquery_ar does. Filler is uniform over the vocabulary
// minus this example's keys (Zoology draws it from the whole vocabulary; leaving the keys
// out makes every later appearance of a key a query whose next token is its value).
// Needs T ≥ 4P and V/2 − 1 ≥ P.
//
// The answers: the target at a query's key position is that key's value; accuracy is
// the fraction of those positions where the model's argmax over the whole vocabulary is
// the value. Zoology feeds the query and scores the next-token prediction with every
// other target masked; here the value follows its query in the stream, so the task is
// ordinary next-token data that `laplace train`'s Trainer reads from llm.c shards and
// trains on at every position (filler and storage targets are unpredictable noise, the
// answers are the only learnable ones).
//
// Everything is a pure function of the seed: example i of a stream is drawn from its own
// generator seeded by (seed, i), with integer arithmetic only apart from the power-law
// table (std::pow, once per task).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/status.h"
#include "model/config.h"
#include "model/model.h"

namespace laplace {

struct MqarTask {
  int64_t vocab_size = 8192;  // V
  int64_t seq_len = 64;       // T
  int64_t num_pairs = 4;      // P
  double power_a = 0.01;      // query gap distribution ∝ (g+1)^(a−1); 1 = uniform

  int64_t key_end() const { return vocab_size / 2; }  // keys [1, key_end), values [key_end, V)
  int64_t value_vocab() const { return vocab_size - vocab_size / 2; }
  // Slots for queries: each takes two tokens (the key and its value).
  int64_t query_slots() const { return (seq_len - 2 * num_pairs) / 2; }
  // invalid_argument naming the first violated bound (T ≥ 4P, V/2 − 1 ≥ P, 0 < a ≤ 1, …).
  Status validate() const;
};

// Draws examples of one task; build once (validates the task), then call example() from
// any number of threads.
class MqarGenerator {
 public:
  static Status create(const MqarTask& task, MqarGenerator* out);
  const MqarTask& task() const { return task_; }

  // Example `index` of stream `seed`: tokens[T] and, when answers is not null,
  // answers[T] = the value expected as the next token at each query's key position and
  // −1 everywhere else.
  void example(uint64_t seed, int64_t index, int32_t* tokens, int32_t* answers) const;
  // Examples [first, first + count) of stream `seed`, back to back: tokens and answers
  // resized to count·T.
  void examples(uint64_t seed, int64_t first, int64_t count, std::vector<int32_t>* tokens,
                std::vector<int32_t>* answers) const;

 private:
  MqarTask task_;
  std::vector<uint64_t> gap_w_;     // integer weight of each query slot (gap)
  std::vector<uint64_t> gap_tree_;  // Fenwick tree (1-based) over gap_w_
  uint64_t gap_total_ = 0;
};

// Keeps only the answers among next-token targets: y[b, t] stays where x[b, t] is a query
// (t ≥ 2P and x[b, t] one of the row's stored keys x[b, 0], x[b, 2], …, x[b, 2P−2]: filler
// never repeats a key, so that is exactly the answer positions) and becomes −1 (ignored by
// the loss) elsewhere. Each row of x must be one whole example, as the loader's windows of
// an mqar_write_shard shard are.
void mqar_mask_targets(const MqarTask& task, const int32_t* x, int32_t* y, int64_t batch, int64_t seq);

// Writes examples [0, count) of stream `seed` as one llm.c shard (text/shard.h): the
// sequences back to back and one filler token after them, so the data loader's windows
// of T + 1 tokens at stride T are exactly the examples.
Status mqar_write_shard(const MqarGenerator& gen, uint64_t seed, int64_t count, const std::string& path);

// Accuracy of `model` on examples [0, count) of stream `seed`: argmax over the vocabulary
// at every answer position, `batch` sequences per forward (the model is planned for
// inference at [batch, T] here). The model's vocabulary must be the task's.
Status mqar_evaluate(Model& model, const MqarGenerator& gen, uint64_t seed, int64_t count, int64_t batch,
                     int64_t* correct, int64_t* total);

// One state size of the grid: H heads of dk × dv ("HxDKxDV").
struct MqarStateShape {
  int64_t heads = 0, dk = 0, dv = 0;
  std::string name() const;  // "2x16x32"
  bool operator==(const MqarStateShape&) const = default;
};

// Grid lists from the command line. Errors are invalid_argument naming the flag and the
// bad item: "--pairs: 'x' is not an integer", "--pairs: 0 is outside [1, 16384]",
// "--pairs: 8 is listed twice", "--state-sizes: '4x32' is not HxDKxDV".
Status mqar_parse_int_list(const std::string& text, const std::string& flag, int64_t lo, int64_t hi,
                           std::vector<int64_t>* out);
Status mqar_parse_state_sizes(const std::string& text, std::vector<MqarStateShape>* out);

struct MqarOptions {
  std::vector<int64_t> pairs = {4};
  std::vector<int64_t> seq_lens = {64};
  std::vector<MqarStateShape> states = {{2, 16, 32}};

  // The model around the state: V, D, L, F (0: 4·D), chunk C, conv K = 4.
  int64_t vocab = 8192, dim = 128, layers = 2, ffn = 0, chunk = 64;
  double power_a = 0.01;

  // Training (train/trainer.h): cosine schedule with linear warm-up, Muon + AdamW. The
  // loss counts the answer positions only (Zoology's labels; mqar_mask_targets), or every
  // next-token target with all_targets.
  bool all_targets = false;
  int64_t steps = 1000, batch = 32;
  int64_t warmup = -1;                 // < 0: steps / 10
  double lr = 3e-3, weight_decay = 0.1;
  int64_t train_examples = 0;          // 0: steps·batch, at most 2^25 tokens (then epochs repeat)
  int64_t eval_examples = 1000;
  int64_t eval_batch = 0;              // 0: batch
  uint64_t seed = 1;
  std::string device = "cpu";
  DType dtype = DType::kF32;

  std::string work_dir;                // shards, configs, checkpoints; empty: a fresh temp dir
  bool keep_work = false;              // keep work_dir's per-point files
  bool quiet = false;                  // no progress lines on stderr

  // invalid_argument for bad ranges and grids in which no (pairs, seq) fits; the ones
  // that do not fit are skipped by mqar_run_grid (see fits()).
  Status validate() const;
  bool fits(int64_t pairs, int64_t seq) const;
  Config config(const MqarStateShape& s) const;
  int64_t train_examples_for(int64_t seq) const;
};

struct MqarResult {
  MqarStateShape state;
  int64_t pairs = 0, seq = 0;
  int64_t state_bytes = 0;   // per sequence: L·(H·dk·dv + K·D)·4 (Config::state_bytes_per_sequence)
  int64_t params = 0;
  double train_loss = 0;     // mean training loss over the last min(10, steps) steps
  int64_t correct = 0, total = 0;
  double chance = 0;         // 1 / value vocabulary
  double accuracy() const { return total > 0 ? static_cast<double>(correct) / static_cast<double>(total) : 0.0; }
};

// One JSON line (no timings, so equal runs give equal bytes).
std::string mqar_result_json(const MqarOptions& o, const MqarResult& r);
// The stdout table: a header line, then one line per result.
std::string mqar_table_header();
std::string mqar_table_row(const MqarResult& r);

// Trains one model per (state, pairs, seq) that fits and evaluates it; `on_result` sees
// each result as it is done (the grid runs seq, then pairs, then state sizes).
Status mqar_run_grid(const MqarOptions& o, const std::function<void(const MqarResult&)>& on_result);

}  // namespace laplace
