#include "eval/mqar.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <set>

#include <nlohmann/json.hpp>

#include "core/file_util.h"
#include "text/shard.h"
#include "train/trainer.h"

namespace laplace {

namespace fs = std::filesystem;

namespace {

constexpr int64_t kMaxPairs = 16384;
constexpr int64_t kMaxSeq = 1 << 16;
constexpr int64_t kMaxVocab = 1 << 20;
constexpr int64_t kAutoTrainTokens = int64_t{1} << 25;  // 32M tokens: a 64 MiB shard at V ≤ 65536

uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// splitmix64, with exact uniform integers (rejection: no modulo bias), so a stream is the
// same on every platform and compiler.
struct Rng {
  uint64_t s;
  Rng(uint64_t seed, uint64_t index) : s(mix64(seed + 0x9E3779B97F4A7C15ull) ^ mix64(index ^ 0xD1B54A32D192ED03ull)) {}
  uint64_t next() { return mix64(s += 0x9E3779B97F4A7C15ull); }
  uint64_t below(uint64_t n) {
    const uint64_t lim = (0 - n) % n;  // 2^64 mod n: draws below it would bias the modulo
    for (;;) {
      const uint64_t r = next();
      if (r >= lim) return r % n;
    }
  }
};

// Distinct tokens from [lo, hi): rejection against `mark` (cleared by the caller).
void draw_distinct(Rng& rng, int64_t lo, int64_t hi, int64_t n, std::vector<uint8_t>& mark, int32_t* out) {
  const uint64_t span = static_cast<uint64_t>(hi - lo);
  for (int64_t i = 0; i < n; ++i) {
    int64_t t;
    do t = lo + static_cast<int64_t>(rng.below(span));
    while (mark[t]);
    mark[t] = 1;
    out[i] = static_cast<int32_t>(t);
  }
}

Status list_error(const std::string& flag, const std::string& what) {
  return Status::invalid_argument(flag + ": " + what);
}

// Parses a whole decimal integer (optional leading '-'); false for anything else.
bool parse_int(const std::string& s, int64_t* out) {
  if (s.empty() || s.size() > 18) return false;
  size_t i = s[0] == '-' ? 1 : 0;
  if (i == s.size()) return false;
  int64_t v = 0;
  for (; i < s.size(); ++i) {
    if (s[i] < '0' || s[i] > '9') return false;
    v = v * 10 + (s[i] - '0');
  }
  *out = s[0] == '-' ? -v : v;
  return true;
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> parts;
  size_t start = 0;
  for (;;) {
    const size_t p = s.find(sep, start);
    parts.push_back(s.substr(start, p == std::string::npos ? std::string::npos : p - start));
    if (p == std::string::npos) return parts;
    start = p + 1;
  }
}

std::string trim(const std::string& s) {
  const size_t b = s.find_first_not_of(" \t");
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(" \t") - b + 1);
}

double now_s() {
  using namespace std::chrono;
  return duration<double>(steady_clock::now().time_since_epoch()).count();
}

}  // namespace

// ---- the task -----------------------------------------------------------------------------------

Status MqarTask::validate() const {
  const std::string where = "MQAR (vocab " + std::to_string(vocab_size) + ", seq " + std::to_string(seq_len) +
                            ", pairs " + std::to_string(num_pairs) + "): ";
  if (num_pairs < 1 || num_pairs > kMaxPairs)
    return Status::invalid_argument(where + "pairs must be in [1, " + std::to_string(kMaxPairs) + "]");
  if (seq_len < 4 || seq_len > kMaxSeq)
    return Status::invalid_argument(where + "seq must be in [4, " + std::to_string(kMaxSeq) + "]");
  if (vocab_size < 4 || vocab_size > kMaxVocab)
    return Status::invalid_argument(where + "vocab must be in [4, " + std::to_string(kMaxVocab) + "]");
  if (4 * num_pairs > seq_len)
    return Status::invalid_argument(where + std::to_string(num_pairs) + " pairs do not fit a sequence of " +
                                    std::to_string(seq_len) + " tokens: the pairs take 2·pairs tokens and the " +
                                    "queries (key + value) 2·pairs more, so seq must be ≥ 4·pairs = " +
                                    std::to_string(4 * num_pairs));
  if (key_end() - 1 < num_pairs)
    return Status::invalid_argument(where + "the keys [1, vocab/2) hold " + std::to_string(key_end() - 1) +
                                    " tokens, fewer than the pairs: vocab must be ≥ 2·pairs + 2 = " +
                                    std::to_string(2 * num_pairs + 2));
  if (!(power_a > 0.0 && power_a <= 1.0))
    return Status::invalid_argument(where + "power_a must be in (0, 1]");
  return Status::ok();
}

Status MqarGenerator::create(const MqarTask& task, MqarGenerator* out) {
  LAPLACE_RETURN_IF_ERROR(task.validate());
  MqarGenerator g;
  g.task_ = task;
  const int64_t n = task.query_slots();
  // Integer weights (g+1)^(a−1) · 2^32, at least 1: the draws below are exact integer
  // arithmetic; only this table depends on the C library's pow.
  std::vector<uint64_t> w(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    w[i] = std::max<uint64_t>(1, static_cast<uint64_t>(std::llround(std::ldexp(
                                     std::pow(static_cast<double>(i + 1), task.power_a - 1.0), 32))));
  g.gap_w_ = w;
  g.gap_tree_.assign(static_cast<size_t>(n + 1), 0);
  for (int64_t i = 1; i <= n; ++i) {
    g.gap_tree_[i] += w[i - 1];
    const int64_t parent = i + (i & -i);
    if (parent <= n) g.gap_tree_[parent] += g.gap_tree_[i];
    g.gap_total_ += w[i - 1];
  }
  *out = std::move(g);
  return Status::ok();
}

void MqarGenerator::example(uint64_t seed, int64_t index, int32_t* tokens, int32_t* answers) const {
  const int64_t V = task_.vocab_size, T = task_.seq_len, P = task_.num_pairs, n = task_.query_slots();
  Rng rng(seed, static_cast<uint64_t>(index));
  std::vector<uint8_t> mark(static_cast<size_t>(V), 0);
  std::vector<int32_t> keys(P), values(P);
  draw_distinct(rng, 1, task_.key_end(), P, mark, keys.data());
  draw_distinct(rng, task_.key_end(), V, P, mark, values.data());
  for (int64_t i = 0; i < P; ++i) mark[values[i]] = 0;  // values may appear as filler; keys may not

  // Filler everywhere first (tokens other than this example's keys), then the pairs and
  // the queries on top.
  for (int64_t t = 0; t < T; ++t) {
    int64_t x;
    do x = static_cast<int64_t>(rng.below(static_cast<uint64_t>(V)));
    while (mark[x]);
    tokens[t] = static_cast<int32_t>(x);
  }
  if (answers) std::fill(answers, answers + T, -1);
  for (int64_t i = 0; i < P; ++i) {
    tokens[2 * i] = keys[i];
    tokens[2 * i + 1] = values[i];
  }
  // Gaps without replacement, ∝ weight: a Fenwick tree over the slots' integer weights,
  // each drawn slot's weight then removed.
  std::vector<uint64_t> tree = gap_tree_;
  uint64_t total = gap_total_;
  int64_t top = 1;
  while (top * 2 <= n) top *= 2;
  for (int64_t i = 0; i < P; ++i) {
    uint64_t r = rng.below(total);
    int64_t pos = 0;
    for (int64_t step = top; step > 0; step /= 2) {
      if (pos + step <= n && tree[pos + step] <= r) {
        pos += step;
        r -= tree[pos];
      }
    }
    // pos = the 0-based slot whose cumulative range holds r (never a drawn one: its
    // weight is 0 by now and every weight is ≥ 1).
    const uint64_t w = gap_w_[pos];
    for (int64_t k = pos + 1; k <= n; k += k & -k) tree[k] -= w;
    total -= w;
    const int64_t at = 2 * P + 2 * pos;
    tokens[at] = keys[i];
    tokens[at + 1] = values[i];
    if (answers) answers[at] = values[i];
  }
}

void MqarGenerator::examples(uint64_t seed, int64_t first, int64_t count, std::vector<int32_t>* tokens,
                             std::vector<int32_t>* answers) const {
  const int64_t T = task_.seq_len;
  tokens->resize(static_cast<size_t>(count * T));
  if (answers) answers->resize(static_cast<size_t>(count * T));
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < count; ++i)
    example(seed, first + i, tokens->data() + i * T, answers ? answers->data() + i * T : nullptr);
}

void mqar_mask_targets(const MqarTask& task, const int32_t* x, int32_t* y, int64_t batch, int64_t seq) {
  const int64_t P = task.num_pairs;
  LAPLACE_CHECK(seq == task.seq_len, "mqar_mask_targets: rows must be whole examples");
  std::vector<int32_t> keys(static_cast<size_t>(P));
  for (int64_t b = 0; b < batch; ++b) {
    const int32_t* xr = x + b * seq;
    int32_t* yr = y + b * seq;
    for (int64_t i = 0; i < P; ++i) keys[i] = xr[2 * i];
    std::sort(keys.begin(), keys.end());
    for (int64_t t = 0; t < seq; ++t)
      if (t < 2 * P || !std::binary_search(keys.begin(), keys.end(), xr[t])) yr[t] = -1;
  }
}

Status mqar_write_shard(const MqarGenerator& gen, uint64_t seed, int64_t count, const std::string& path) {
  if (count < 1) return Status::invalid_argument("MQAR shard: need at least one example");
  const int64_t T = gen.task().seq_len;
  std::vector<int32_t> toks;
  gen.examples(seed, 0, count, &toks, nullptr);
  std::vector<uint32_t> out(static_cast<size_t>(count * T + 1));
  for (int64_t i = 0; i < count * T; ++i) out[i] = static_cast<uint32_t>(toks[i]);
  out.back() = 0;  // the last window's final target; any token would do
  return shard_write(path, out, gen.task().vocab_size);
}

Status mqar_evaluate(Model& model, const MqarGenerator& gen, uint64_t seed, int64_t count, int64_t batch,
                     int64_t* correct, int64_t* total) {
  const MqarTask& task = gen.task();
  if (model.config().vocab_size != task.vocab_size)
    return Status::invalid_argument("MQAR: the model's vocabulary (" + std::to_string(model.config().vocab_size) +
                                    ") is not the task's (" + std::to_string(task.vocab_size) + ")");
  if (count < 1 || batch < 1) return Status::invalid_argument("MQAR: need at least one example and batch ≥ 1");
  const int64_t T = task.seq_len;
  batch = std::min(batch, count);
  LAPLACE_RETURN_IF_ERROR(model.plan({batch, T, false, false}));
  Backend& be = model.backend();
  const size_t id_bytes = static_cast<size_t>(batch * T) * sizeof(int32_t);
  void* ids_dev = be.allocator().allocate(id_bytes);
  if (ids_dev == nullptr) return Status::out_of_memory("MQAR: no device memory for the argmax ids");
  std::vector<int32_t> toks, answers, pred(static_cast<size_t>(batch * T));
  int64_t right = 0, asked = 0;
  for (int64_t first = 0; first < count; first += batch) {
    const int64_t b = std::min(batch, count - first), N = b * T;
    gen.examples(seed, first, b, &toks, &answers);
    model.forward(toks.data(), b, T, ForwardOptions{});
    Tensor ids(ids_dev, DType::kI32, {N}, be.device());
    be.argmax_rows(model.logits().slice(0, 0, N), ids);
    be.copy(Tensor(pred.data(), DType::kI32, {N}), ids);
    be.synchronize();
    for (int64_t i = 0; i < N; ++i) {
      if (answers[i] < 0) continue;
      ++asked;
      right += pred[i] == answers[i];
    }
  }
  be.allocator().deallocate(ids_dev);
  *correct = right;
  *total = asked;
  return Status::ok();
}

// ---- grid arguments -------------------------------------------------------------------------------

std::string MqarStateShape::name() const {
  return std::to_string(heads) + "x" + std::to_string(dk) + "x" + std::to_string(dv);
}

Status mqar_parse_int_list(const std::string& text, const std::string& flag, int64_t lo, int64_t hi,
                           std::vector<int64_t>* out) {
  out->clear();
  if (trim(text).empty()) return list_error(flag, "empty list (give comma-separated integers, e.g. 4,8,16)");
  for (const std::string& raw : split(text, ',')) {
    const std::string item = trim(raw);
    int64_t v = 0;
    if (item.empty()) return list_error(flag, "empty item in '" + text + "'");
    if (!parse_int(item, &v)) return list_error(flag, "'" + item + "' is not an integer");
    if (v < lo || v > hi)
      return list_error(flag, item + " is outside [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
    if (std::find(out->begin(), out->end(), v) != out->end()) return list_error(flag, item + " is listed twice");
    out->push_back(v);
  }
  return Status::ok();
}

Status mqar_parse_state_sizes(const std::string& text, std::vector<MqarStateShape>* out) {
  const std::string flag = "--state-sizes";
  out->clear();
  if (trim(text).empty()) return list_error(flag, "empty list (give HxDKxDV items, e.g. 2x16x32,4x32x64)");
  for (const std::string& raw : split(text, ',')) {
    const std::string item = trim(raw);
    if (item.empty()) return list_error(flag, "empty item in '" + text + "'");
    const std::vector<std::string> f = split(item, 'x');
    MqarStateShape s;
    if (f.size() != 3 || !parse_int(f[0], &s.heads) || !parse_int(f[1], &s.dk) || !parse_int(f[2], &s.dv))
      return list_error(flag, "'" + item + "' is not HxDKxDV (heads x key dim x value dim, e.g. 2x16x32)");
    // dk ≤ 128 and dv ≤ 256: the CUDA GLA kernels' limits (the CPU has none, but a grid
    // should run on either).
    if (s.heads < 1 || s.heads > 64) return list_error(flag, "'" + item + "': heads must be in [1, 64]");
    if (s.dk < 1 || s.dk > 128) return list_error(flag, "'" + item + "': dk must be in [1, 128]");
    if (s.dv < 1 || s.dv > 256) return list_error(flag, "'" + item + "': dv must be in [1, 256]");
    if (std::find(out->begin(), out->end(), s) != out->end()) return list_error(flag, item + " is listed twice");
    out->push_back(s);
  }
  return Status::ok();
}

// ---- options ----------------------------------------------------------------------------------------

bool MqarOptions::fits(int64_t pairs, int64_t seq) const {
  MqarTask t{vocab, seq, pairs, power_a};
  return t.validate().is_ok();
}

Config MqarOptions::config(const MqarStateShape& s) const {
  Config c;
  c.vocab_size = vocab;
  c.hidden_size = dim;
  c.num_layers = layers;
  c.num_heads = s.heads;
  c.head_k_dim = s.dk;
  c.head_v_dim = s.dv;
  c.ffn_size = ffn > 0 ? ffn : 4 * dim;
  c.conv_size = 4;
  c.chunk_size = chunk;
  return c;
}

int64_t MqarOptions::train_examples_for(int64_t seq) const {
  if (train_examples > 0) return std::max(train_examples, batch);
  const int64_t cap = std::max<int64_t>(1, kAutoTrainTokens / seq);
  return std::max(batch, std::min(steps * batch, cap));
}

Status MqarOptions::validate() const {
  auto range = [](const char* flag, int64_t v, int64_t lo, int64_t hi) {
    if (v >= lo && v <= hi) return Status::ok();
    return Status::invalid_argument(std::string(flag) + " must be in [" + std::to_string(lo) + ", " +
                                    std::to_string(hi) + "], got " + std::to_string(v));
  };
  if (pairs.empty() || seq_lens.empty() || states.empty())
    return Status::invalid_argument("--pairs, --seq-lens and --state-sizes each need at least one item");
  LAPLACE_RETURN_IF_ERROR(range("--vocab", vocab, 4, kMaxVocab));
  LAPLACE_RETURN_IF_ERROR(range("--dim", dim, 1, 16384));
  LAPLACE_RETURN_IF_ERROR(range("--layers", layers, 1, 256));
  LAPLACE_RETURN_IF_ERROR(range("--ffn", ffn, 0, 65536));
  LAPLACE_RETURN_IF_ERROR(range("--chunk", chunk, 1, 1 << 16));
  LAPLACE_RETURN_IF_ERROR(range("--steps", steps, 1, 1 << 30));
  LAPLACE_RETURN_IF_ERROR(range("--batch", batch, 1, 1 << 20));
  LAPLACE_RETURN_IF_ERROR(range("--warmup", warmup, -1, steps));
  LAPLACE_RETURN_IF_ERROR(range("--train-examples", train_examples, 0, int64_t{1} << 30));
  LAPLACE_RETURN_IF_ERROR(range("--eval-examples", eval_examples, 1, int64_t{1} << 30));
  LAPLACE_RETURN_IF_ERROR(range("--eval-batch", eval_batch, 0, 1 << 20));
  if (!(lr > 0.0 && lr <= 10.0)) return Status::invalid_argument("--lr must be in (0, 10]");
  if (!(weight_decay >= 0.0 && weight_decay <= 1.0)) return Status::invalid_argument("--wd must be in [0, 1]");
  if (!(power_a > 0.0 && power_a <= 1.0)) return Status::invalid_argument("--power-a must be in (0, 1]");
  if (device != "cpu" && device != "cuda") return Status::invalid_argument("--device must be cpu or cuda");
  if (dtype == DType::kBF16 && device != "cuda")
    return Status::unsupported("--dtype bf16 needs --device cuda (the CPU backend computes in f32 or f64)");
  if (dtype != DType::kF32 && dtype != DType::kBF16 && dtype != DType::kF64)
    return Status::unsupported("--dtype must be f32, f64 (CPU) or bf16 (CUDA)");
  for (const MqarStateShape& s : states) LAPLACE_RETURN_IF_ERROR(config(s).validate().with_context(s.name()));
  int64_t fit = 0;
  for (int64_t p : pairs)
    for (int64_t t : seq_lens) fit += fits(p, t);
  if (fit == 0) {
    // Nothing to run: say why for the first combination.
    const MqarTask t{vocab, seq_lens[0], pairs[0], power_a};
    return t.validate().with_context("no (pairs, seq) combination of the grid fits");
  }
  return Status::ok();
}

// ---- output -------------------------------------------------------------------------------------------

std::string mqar_result_json(const MqarOptions& o, const MqarResult& r) {
  const Config c = o.config(r.state);
  nlohmann::ordered_json j;
  j["state"] = r.state.name();
  j["heads"] = r.state.heads;
  j["dk"] = r.state.dk;
  j["dv"] = r.state.dv;
  j["state_bytes"] = r.state_bytes;
  j["pairs"] = r.pairs;
  j["seq"] = r.seq;
  j["accuracy"] = r.accuracy();
  j["correct"] = r.correct;
  j["total"] = r.total;
  j["chance"] = r.chance;
  j["train_loss"] = r.train_loss;
  j["train_targets"] = o.all_targets ? "all" : "answers";
  j["params"] = r.params;
  j["vocab"] = c.vocab_size;
  j["dim"] = c.hidden_size;
  j["layers"] = c.num_layers;
  j["ffn"] = c.ffn_size;
  j["chunk"] = c.chunk_size;
  j["steps"] = o.steps;
  j["batch"] = o.batch;
  j["lr"] = o.lr;
  j["wd"] = o.weight_decay;
  j["warmup"] = o.warmup >= 0 ? o.warmup : o.steps / 10;
  j["train_examples"] = o.train_examples_for(r.seq);
  j["eval_examples"] = o.eval_examples;
  j["power_a"] = o.power_a;
  j["seed"] = o.seed;
  j["device"] = o.device;
  j["dtype"] = dtype_name(o.dtype);
  return j.dump();
}

std::string mqar_table_header() {
  char buf[160];
  std::snprintf(buf, sizeof buf, "%-12s %12s %6s %6s %10s %9s %8s\n", "state", "state_bytes", "pairs", "seq",
                "train_loss", "accuracy", "chance");
  return buf;
}

std::string mqar_table_row(const MqarResult& r) {
  char buf[160];
  std::snprintf(buf, sizeof buf, "%-12s %12lld %6lld %6lld %10.4f %9.4f %8.4f\n", r.state.name().c_str(),
                (long long)r.state_bytes, (long long)r.pairs, (long long)r.seq, r.train_loss, r.accuracy(), r.chance);
  return buf;
}

// ---- the grid ---------------------------------------------------------------------------------------

namespace {

// Streams of one run: training and evaluation never share examples.
uint64_t train_stream(uint64_t seed) { return mix64(seed * 4 + 1); }
uint64_t eval_stream(uint64_t seed) { return mix64(seed * 4 + 2); }

Status remove_all(const std::string& path) {
  std::error_code ec;
  fs::remove_all(path, ec);
  if (ec) return Status::io_error("cannot remove " + path + ": " + ec.message());
  return Status::ok();
}

Status run_point(const MqarOptions& o, const MqarGenerator& gen, const MqarStateShape& s, const std::string& shard,
                 const std::string& dir, const std::string& label, MqarResult* r) {
  const MqarTask& task = gen.task();
  const Config cfg = o.config(s);
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return Status::io_error("cannot create " + dir + ": " + ec.message());
  const std::string cfg_path = dir + "/config.json", cfg_text = cfg.to_json();
  LAPLACE_RETURN_IF_ERROR(write_file_atomic(cfg_path, cfg_text.data(), cfg_text.size()));

  TrainOptions t;
  t.config_path = cfg_path;
  t.train_data = {shard};
  t.out_dir = dir + "/train";
  t.batch = o.batch;
  t.seq = task.seq_len;
  t.steps = o.steps;
  t.schedule.kind = ScheduleKind::kCosine;
  t.schedule.lr = o.lr;
  t.schedule.warmup_steps = o.warmup >= 0 ? o.warmup : o.steps / 10;
  t.optim.lr = o.lr;
  t.optim.weight_decay = o.weight_decay;
  t.shuffle = true;
  t.seed = o.seed;
  t.data_seed = o.seed;
  t.device = o.device;
  t.dtype = o.dtype;
  t.quiet = true;
  if (!o.all_targets)
    t.target_mask = [&task](const int32_t* x, int32_t* y, int64_t b, int64_t T) { mqar_mask_targets(task, x, y, b, T); };

  const double t0 = now_s();
  Trainer trainer(t);
  LAPLACE_RETURN_IF_ERROR(trainer.setup().with_context(label));
  const int64_t last = std::min<int64_t>(10, o.steps), every = std::max<int64_t>(1, o.steps / 10);
  double tail = 0;
  LAPLACE_RETURN_IF_ERROR(trainer
                              .run([&](const StepLog& l) {
                                if (l.step >= o.steps - last) tail += l.loss;
                                if (!o.quiet && ((l.step + 1) % every == 0))
                                  std::fprintf(stderr, "mqar: %s: step %lld/%lld loss %.4f (%.1f s)\n", label.c_str(),
                                               (long long)(l.step + 1), (long long)o.steps, l.loss, now_s() - t0);
                              })
                              .with_context(label));

  Model m;
  LAPLACE_RETURN_IF_ERROR(m.create(cfg, trainer.backend(), o.dtype));
  LAPLACE_RETURN_IF_ERROR(m.load(t.out_dir + "/model.safetensors"));
  const int64_t eval_batch = o.eval_batch > 0 ? o.eval_batch : o.batch;
  r->state = s;
  r->pairs = task.num_pairs;
  r->seq = task.seq_len;
  r->state_bytes = cfg.state_bytes_per_sequence();
  r->params = cfg.total_params();
  r->train_loss = tail / static_cast<double>(last);
  r->chance = 1.0 / static_cast<double>(task.value_vocab());
  LAPLACE_RETURN_IF_ERROR(
      mqar_evaluate(m, gen, eval_stream(o.seed), o.eval_examples, eval_batch, &r->correct, &r->total)
          .with_context(label));
  if (!o.quiet)
    std::fprintf(stderr, "mqar: %s: accuracy %.4f (%lld/%lld, chance %.4f) in %.1f s\n", label.c_str(),
                 r->accuracy(), (long long)r->correct, (long long)r->total, r->chance, now_s() - t0);
  return Status::ok();
}

}  // namespace

Status mqar_run_grid(const MqarOptions& o, const std::function<void(const MqarResult&)>& on_result) {
  LAPLACE_RETURN_IF_ERROR(o.validate());
  std::string work = o.work_dir;
  const bool temp = work.empty();
  if (temp) {
    std::string tmpl = (fs::temp_directory_path() / "laplace_mqar_XXXXXX").string();
    if (mkdtemp(tmpl.data()) == nullptr) return Status::io_error("cannot create a temporary directory for MQAR");
    work = tmpl;
  } else {
    std::error_code ec;
    fs::create_directories(work, ec);
    if (ec) return Status::io_error("cannot create " + work + ": " + ec.message());
  }
  // Points that do not fit are announced before any training, not hours into a grid.
  int64_t points = 0, done = 0;
  for (int64_t seq : o.seq_lens) {
    for (int64_t p : o.pairs) {
      if (o.fits(p, seq)) {
        points += static_cast<int64_t>(o.states.size());
        continue;
      }
      const MqarTask t{o.vocab, seq, p, o.power_a};
      std::fprintf(stderr, "mqar: skipping pairs %lld at seq %lld: %s\n", (long long)p, (long long)seq,
                   t.validate().message().c_str());
    }
  }

  Status st;
  for (int64_t seq : o.seq_lens) {
    for (int64_t p : o.pairs) {
      if (!o.fits(p, seq)) continue;
      MqarGenerator gen;
      st = MqarGenerator::create(MqarTask{o.vocab, seq, p, o.power_a}, &gen);
      if (!st.is_ok()) break;
      const std::string task_dir = work + "/p" + std::to_string(p) + "_t" + std::to_string(seq);
      const std::string shard = task_dir + "/train_000000.bin";
      std::error_code ec;
      fs::create_directories(task_dir, ec);
      if (ec) {
        st = Status::io_error("cannot create " + task_dir + ": " + ec.message());
        break;
      }
      st = mqar_write_shard(gen, train_stream(o.seed), o.train_examples_for(seq), shard);
      if (!st.is_ok()) break;
      for (const MqarStateShape& s : o.states) {
        char label[160];
        std::snprintf(label, sizeof label, "[%lld/%lld] state %s pairs %lld seq %lld", (long long)++done,
                      (long long)points, s.name().c_str(), (long long)p, (long long)seq);
        MqarResult r;
        st = run_point(o, gen, s, shard, task_dir + "/" + s.name(), label, &r);
        if (!st.is_ok()) break;
        if (on_result) on_result(r);
        if (!o.keep_work) st = remove_all(task_dir + "/" + s.name());
        if (!st.is_ok()) break;
      }
      if (st.is_ok() && !o.keep_work) st = remove_all(task_dir);
      if (!st.is_ok()) break;
    }
    if (!st.is_ok()) break;
  }
  if (temp && !o.keep_work) (void)remove_all(work);  // best-effort cleanup of scratch files
  else if (!o.quiet) std::fprintf(stderr, "mqar: work files kept in %s\n", work.c_str());
  return st;
}

}  // namespace laplace
