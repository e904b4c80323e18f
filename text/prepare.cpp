#include "text/prepare.h"

#include "core/rng.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <thread>

#include "core/file_util.h"
#include "text/shard.h"
#include "text/tokenizer.h"

namespace laplace {

namespace fs = std::filesystem;

namespace {

// u(seed, i) in [0, 1): the held-out test of document i.
double doc_uniform(uint64_t seed, int64_t i) {
  const uint64_t h = splitmix64_hash(splitmix64_hash(seed) ^ static_cast<uint64_t>(i));
  return static_cast<double>(h >> 11) * (1.0 / 9007199254740992.0);  // 2^-53
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// Drops leading and trailing newlines (\n, \r).
void trim_newlines(std::string* s) {
  const size_t b = s->find_first_not_of("\r\n");
  if (b == std::string::npos) {
    s->clear();
    return;
  }
  const size_t e = s->find_last_not_of("\r\n");
  *s = s->substr(b, e - b + 1);
}

bool is_blank(const std::string& line) { return line.find_first_not_of(" \t\r\f\v") == std::string::npos; }

using EmitFn = std::function<Status(std::string&&)>;

Status open_input(const std::string& path, std::ifstream* in) {
  std::error_code ec;
  if (!fs::exists(path, ec)) return Status::not_found("input " + path + " does not exist");
  if (!fs::is_regular_file(path, ec)) return Status::io_error("input " + path + " is not a regular file");
  in->open(path, std::ios::binary);
  if (!in->is_open()) return Status::io_error("cannot open input " + path);
  return Status::ok();
}

Status read_jsonl(const std::string& path, const std::string& field, const EmitFn& emit) {
  std::ifstream in;
  LAPLACE_RETURN_IF_ERROR(open_input(path, &in));
  std::string line;
  int64_t line_no = 0;
  while (std::getline(in, line)) {
    ++line_no;
    if (is_blank(line)) continue;
    nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    const std::string where = path + ":" + std::to_string(line_no) + ": ";
    if (j.is_discarded()) return Status::corrupt(where + "not valid JSON");
    if (!j.is_object()) return Status::corrupt(where + "not a JSON object");
    auto it = j.find(field);
    if (it == j.end()) return Status::corrupt(where + "no \"" + field + "\" field");
    if (!it->is_string()) return Status::corrupt(where + "\"" + field + "\" is not a string");
    LAPLACE_RETURN_IF_ERROR(emit(std::move(it->get_ref<std::string&>())));
  }
  if (in.bad()) return Status::io_error("read error in " + path);
  return Status::ok();
}

Status read_text(const std::string& path, TextSplit split, const EmitFn& emit) {
  if (split == TextSplit::kFile) {
    std::string doc;
    LAPLACE_RETURN_IF_ERROR(read_file(path, &doc));
    trim_newlines(&doc);
    return emit(std::move(doc));
  }
  std::ifstream in;
  LAPLACE_RETURN_IF_ERROR(open_input(path, &in));
  std::string line, doc;
  bool have = false;
  auto flush = [&]() -> Status {
    if (!have) return Status::ok();
    trim_newlines(&doc);
    have = false;
    return emit(std::move(doc));
  };
  while (std::getline(in, line)) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    const bool sep = split == TextSplit::kFortune ? line == "%" : is_blank(line);
    if (sep) {
      LAPLACE_RETURN_IF_ERROR(flush());
      doc.clear();
      continue;
    }
    if (have) doc += '\n';
    doc += line;
    have = true;
  }
  if (in.bad()) return Status::io_error("read error in " + path);
  return flush();
}

// Accumulates tokens and writes <prefix>_NNNNNN.bin shards of exactly shard_tokens.
class ShardSink {
 public:
  ShardSink(std::string dir, std::string prefix, int64_t shard_tokens, int64_t vocab)
      : dir_(std::move(dir)), prefix_(std::move(prefix)), shard_tokens_(shard_tokens), vocab_(vocab) {}

  Status add(const std::vector<int32_t>& ids, int32_t separator) {
    buf_.push_back(static_cast<uint32_t>(separator));
    for (int32_t t : ids) buf_.push_back(static_cast<uint32_t>(t));
    total_ += 1 + static_cast<int64_t>(ids.size());
    int64_t begin = 0;
    while (static_cast<int64_t>(buf_.size()) - begin >= shard_tokens_) {
      LAPLACE_RETURN_IF_ERROR(write(buf_.data() + begin, shard_tokens_));
      begin += shard_tokens_;
    }
    if (begin > 0) buf_.erase(buf_.begin(), buf_.begin() + begin);
    return Status::ok();
  }

  Status finish() {
    if (!buf_.empty()) LAPLACE_RETURN_IF_ERROR(write(buf_.data(), static_cast<int64_t>(buf_.size())));
    buf_.clear();
    return Status::ok();
  }

  int64_t total() const { return total_; }
  const std::vector<std::string>& files() const { return files_; }

 private:
  Status write(const uint32_t* p, int64_t n) {
    char name[64];
    std::snprintf(name, sizeof(name), "%s_%06lld.bin", prefix_.c_str(), static_cast<long long>(files_.size()));
    const std::string path = (fs::path(dir_) / name).string();
    LAPLACE_RETURN_IF_ERROR(shard_write(path, p, n, vocab_));
    files_.push_back(path);
    return Status::ok();
  }

  std::string dir_, prefix_;
  int64_t shard_tokens_, vocab_;
  std::vector<uint32_t> buf_;
  std::vector<std::string> files_;
  int64_t total_ = 0;
};

bool is_shard_name(const std::string& name) {
  for (const char* prefix : {"train_", "val_"}) {
    const std::string p(prefix);
    if (name.size() == p.size() + 6 + 4 && name.compare(0, p.size(), p) == 0 && ends_with(name, ".bin") &&
        std::all_of(name.begin() + p.size(), name.begin() + p.size() + 6, [](char c) { return c >= '0' && c <= '9'; })) {
      return true;
    }
  }
  return false;
}

std::string with_commas(int64_t v) {
  std::string s = std::to_string(v);
  for (int i = static_cast<int>(s.size()) - 3; i > (v < 0 ? 1 : 0); i -= 3) s.insert(static_cast<size_t>(i), 1, ',');
  return s;
}

}  // namespace

int32_t document_separator_id(const Tokenizer& tok) { return tok.eos_id(); }

Status data_prepare(const PrepareOptions& o, PrepareStats* stats_out) {
  if (o.inputs.empty()) return Status::invalid_argument("data prepare: no input files");
  if (o.output_dir.empty()) return Status::invalid_argument("data prepare: no output directory");
  if (o.shard_tokens < 1) return Status::invalid_argument("data prepare: shard_tokens must be >= 1");
  if (!(o.val_fraction >= 0.0 && o.val_fraction < 1.0)) {
    return Status::invalid_argument("data prepare: val_fraction must be in [0, 1)");
  }
  if (o.jsonl_field.empty()) return Status::invalid_argument("data prepare: empty jsonl field name");

  Tokenizer tok;
  LAPLACE_RETURN_IF_ERROR(Tokenizer::load(o.tokenizer, &tok).with_context("data prepare"));
  const int32_t sep = document_separator_id(tok);
  if (sep < 0) return Status::invalid_argument("data prepare: tokenizer " + o.tokenizer + " has no eos token");
  const int64_t vocab = tok.vocab_size();

  // Check all inputs exist before doing any work.
  for (const std::string& p : o.inputs) {
    std::error_code ec;
    if (!fs::is_regular_file(p, ec)) return Status::not_found("data prepare: input " + p + " does not exist or is not a file");
  }

  std::error_code ec;
  fs::create_directories(o.output_dir, ec);
  if (ec || !fs::is_directory(o.output_dir)) {
    return Status::io_error("data prepare: cannot create output directory " + o.output_dir + ": " + ec.message());
  }
  std::vector<fs::path> stale;
  for (const auto& e : fs::directory_iterator(o.output_dir, ec)) {
    if (is_shard_name(e.path().filename().string())) stale.push_back(e.path());
  }
  if (ec) return Status::io_error("data prepare: cannot list " + o.output_dir + ": " + ec.message());
  if (!stale.empty()) {
    if (!o.overwrite) {
      return Status::invalid_argument("data prepare: " + o.output_dir + " already holds shards (" +
                                      stale.front().filename().string() + ", ...); pass overwrite to replace them");
    }
    for (const auto& p : stale) {
      if (!fs::remove(p, ec) || ec) return Status::io_error("data prepare: cannot remove " + p.string());
    }
  }

  PrepareStats st;
  st.vocab_size = vocab;
  st.separator_id = sep;
  ShardSink train(o.output_dir, "train", o.shard_tokens, vocab);
  ShardSink val(o.output_dir, "val", o.shard_tokens, vocab);

  int nthreads = o.num_threads > 0 ? o.num_threads : static_cast<int>(std::thread::hardware_concurrency());
  nthreads = std::clamp(nthreads, 1, 16);

  // Documents are encoded in batches (in parallel), then routed in order.
  std::vector<std::string> batch;
  size_t batch_bytes = 0;
  constexpr size_t kBatchBytes = size_t{16} << 20;
  auto process = [&]() -> Status {
    const int64_t n = static_cast<int64_t>(batch.size());
    std::vector<std::vector<int32_t>> ids(static_cast<size_t>(n));
    std::vector<Status> errs(static_cast<size_t>(n));
    auto work = [&](int64_t t, int64_t nt) {
      for (int64_t i = t; i < n; i += nt) errs[i] = tok.encode(batch[i], &ids[i]);
    };
    const int64_t nt = std::min<int64_t>(nthreads, n);
    if (nt <= 1) {
      work(0, 1);
    } else {
      std::vector<std::thread> threads;
      for (int64_t t = 0; t < nt; ++t) threads.emplace_back(work, t, nt);
      for (auto& th : threads) th.join();
    }
    for (int64_t i = 0; i < n; ++i) {
      LAPLACE_RETURN_IF_ERROR(errs[i].with_context("data prepare: document " + std::to_string(st.documents)));
      const bool is_val = o.val_fraction > 0.0 && doc_uniform(o.seed, st.documents) < o.val_fraction;
      ++st.documents;
      if (is_val) {
        ++st.val_documents;
        LAPLACE_RETURN_IF_ERROR(val.add(ids[i], sep));
      } else {
        ++st.train_documents;
        LAPLACE_RETURN_IF_ERROR(train.add(ids[i], sep));
      }
    }
    batch.clear();
    batch_bytes = 0;
    return Status::ok();
  };
  EmitFn emit = [&](std::string&& doc) -> Status {
    if (doc.empty()) {
      ++st.skipped_empty;
      return Status::ok();
    }
    batch_bytes += doc.size();
    batch.push_back(std::move(doc));
    if (batch_bytes >= kBatchBytes) return process();
    return Status::ok();
  };

  for (const std::string& path : o.inputs) {
    const bool jsonl = o.format == InputFormat::kJsonl || (o.format == InputFormat::kAuto && ends_with(path, ".jsonl"));
    Status s = jsonl ? read_jsonl(path, o.jsonl_field, emit) : read_text(path, o.text_split, emit);
    LAPLACE_RETURN_IF_ERROR(s.with_context("data prepare"));
  }
  LAPLACE_RETURN_IF_ERROR(process());
  if (st.documents == 0) return Status::invalid_argument("data prepare: the inputs hold no (non-empty) documents");
  if (st.train_documents == 0) {
    return Status::invalid_argument("data prepare: every document was held out for validation; lower val_fraction");
  }
  LAPLACE_RETURN_IF_ERROR(train.finish());
  LAPLACE_RETURN_IF_ERROR(val.finish());
  st.train_tokens = train.total();
  st.val_tokens = val.total();
  st.train_files = train.files();
  st.val_files = val.files();

  nlohmann::json summary = {
      {"tokenizer", o.tokenizer},
      {"vocab_size", vocab},
      {"separator_id", sep},
      {"separator", "eos before each document"},
      {"shard_tokens", o.shard_tokens},
      {"val_fraction", o.val_fraction},
      {"seed", o.seed},
      {"documents", st.documents},
      {"train_documents", st.train_documents},
      {"val_documents", st.val_documents},
      {"skipped_empty", st.skipped_empty},
      {"train_tokens", st.train_tokens},
      {"val_tokens", st.val_tokens},
      {"train_shards", st.train_files.size()},
      {"val_shards", st.val_files.size()},
      {"inputs", o.inputs},
  };
  const std::string js = summary.dump(2) + "\n";
  LAPLACE_RETURN_IF_ERROR(write_file_atomic((fs::path(o.output_dir) / "prepare.json").string(), js.data(), js.size()));

  if (!o.quiet) {
    std::printf("data prepare: %s documents (%s train, %s val, %s empty skipped)\n", with_commas(st.documents).c_str(),
                with_commas(st.train_documents).c_str(), with_commas(st.val_documents).c_str(),
                with_commas(st.skipped_empty).c_str());
    std::printf("data prepare: %s train tokens in %zu shard(s), %s val tokens in %zu shard(s) -> %s\n",
                with_commas(st.train_tokens).c_str(), st.train_files.size(), with_commas(st.val_tokens).c_str(),
                st.val_files.size(), o.output_dir.c_str());
    std::fflush(stdout);
  }
  if (o.val_fraction > 0.0 && st.val_documents == 0) {
    std::fprintf(stderr, "data prepare: warning: val_fraction %g selected no documents; no val shard written\n",
                 o.val_fraction);
  }
  if (stats_out != nullptr) *stats_out = std::move(st);
  return Status::ok();
}

}  // namespace laplace
