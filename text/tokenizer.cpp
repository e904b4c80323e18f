#include "text/tokenizer.h"

#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <unordered_map>

#include "core/file_util.h"

namespace laplace {

namespace {

std::string sp_message(const sentencepiece::util::Status& s) {
  const char* m = s.error_message();
  return (m != nullptr && *m != '\0') ? std::string(m) : s.ToString();
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// Feeds training sentences (lines) to SentencePiece from text or JSONL files,
// reading one file at a time so large corpora are never held in memory.
class LineIterator : public sentencepiece::SentenceIterator {
 public:
  explicit LineIterator(std::vector<std::string> files) : files_(std::move(files)) { advance(); }

  bool done() const override { return done_; }
  void Next() override { advance(); }
  const std::string& value() const override { return value_; }
  sentencepiece::util::Status status() const override { return sentencepiece::util::Status(); }

  // Our own error (missing file, bad JSON line): reported after training returns.
  const Status& error() const { return error_; }

 private:
  // Produces the next non-empty line into value_, or sets done_.
  void advance() {
    while (true) {
      if (!pending_.empty()) {
        value_ = std::move(pending_.back());
        pending_.pop_back();
        return;
      }
      if (!in_.is_open() || !std::getline(in_, line_)) {
        if (in_.is_open()) in_.close();
        if (file_index_ >= files_.size() || !error_.is_ok()) {
          done_ = true;
          value_.clear();
          return;
        }
        const std::string& path = files_[file_index_++];
        jsonl_ = ends_with(path, ".jsonl");
        line_no_ = 0;
        in_.open(path, std::ios::binary);
        if (!in_.is_open()) {
          error_ = std::filesystem::exists(path) ? Status::io_error("cannot read tokenizer input " + path)
                                                 : Status::not_found("tokenizer input " + path + " does not exist");
          done_ = true;
          value_.clear();
          return;
        }
        current_ = path;
        continue;
      }
      ++line_no_;
      if (!line_.empty() && line_.back() == '\r') line_.pop_back();
      if (!jsonl_) {
        if (line_.empty()) continue;
        value_ = std::move(line_);
        return;
      }
      // JSONL: split the text field into lines; queue them in reverse order.
      if (line_.find_first_not_of(" \t\r") == std::string::npos) continue;
      nlohmann::json j = nlohmann::json::parse(line_, nullptr, /*allow_exceptions=*/false);
      const char* what = nullptr;
      if (j.is_discarded()) what = "not valid JSON";
      else if (!j.is_object()) what = "not a JSON object";
      else if (!j.contains("text")) what = "no \"text\" field";
      else if (!j["text"].is_string()) what = "\"text\" is not a string";
      if (what != nullptr) {
        error_ = Status::corrupt(current_ + ":" + std::to_string(line_no_) + ": " + what);
        done_ = true;
        value_.clear();
        return;
      }
      const std::string& text = j["text"].get_ref<const std::string&>();
      std::vector<std::string> parts;
      size_t start = 0;
      while (start <= text.size()) {
        size_t nl = text.find('\n', start);
        if (nl == std::string::npos) nl = text.size();
        std::string part = text.substr(start, nl - start);
        if (!part.empty() && part.back() == '\r') part.pop_back();
        if (!part.empty()) parts.push_back(std::move(part));
        start = nl + 1;
      }
      pending_.assign(std::make_move_iterator(parts.rbegin()), std::make_move_iterator(parts.rend()));
    }
  }

  std::vector<std::string> files_;
  size_t file_index_ = 0;
  std::ifstream in_;
  std::string current_;
  bool jsonl_ = false;
  int64_t line_no_ = 0;
  std::string line_;
  std::vector<std::string> pending_;
  std::string value_;
  bool done_ = false;
  Status error_;
};

// SentencePiece keeps its random seed and log level in globals.
std::mutex& train_mutex() {
  static std::mutex m;
  return m;
}

}  // namespace

Tokenizer::Tokenizer() = default;
Tokenizer::~Tokenizer() = default;
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;

Status Tokenizer::load(const std::string& path, Tokenizer* out) {
  std::string bytes;
  Status st = read_file(path, &bytes);
  if (!st.is_ok()) return st.with_context("loading tokenizer");
  return load_from_bytes(bytes, path, out);
}

Status Tokenizer::load_from_bytes(const std::string& bytes, const std::string& name, Tokenizer* out) {
  if (bytes.empty()) return Status::corrupt("tokenizer model " + name + " is empty (0 bytes)");
  auto sp = std::make_unique<sentencepiece::SentencePieceProcessor>();
  sentencepiece::util::Status s = sp->LoadFromSerializedProto(bytes);
  if (!s.ok()) {
    return Status::corrupt("tokenizer model " + name + " (" + std::to_string(bytes.size()) +
                           " bytes) is not a valid SentencePiece model: " + sp_message(s));
  }
  if (sp->GetPieceSize() <= 0) return Status::corrupt("tokenizer model " + name + " has no pieces");
  std::array<int32_t, 256> byte_ids;
  byte_ids.fill(-1);
  for (int id = 0; id < sp->GetPieceSize(); ++id) {
    if (!sp->IsByte(id)) continue;
    const std::string& p = sp->IdToPiece(id);
    if (p.size() == 6 && p.compare(0, 3, "<0x") == 0 && p[5] == '>')
      byte_ids[std::strtol(p.substr(3, 2).c_str(), nullptr, 16) & 0xFF] = id;
  }
  out->sp_ = std::move(sp);
  out->path_ = name;
  out->byte_ids_ = byte_ids;
  return Status::ok();
}

namespace {

// Length of the well-formed UTF-8 sequence at s[i] (RFC 3629: no overlongs, no surrogates,
// nothing past U+10FFFF), or 0 if the byte there does not start one.
size_t utf8_sequence_length(const std::string& s, size_t i) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char c = b(i);
  const size_t left = s.size() - i;
  if (c < 0x80) return 1;
  const auto cont = [&](size_t k) { return (b(k) & 0xC0) == 0x80; };
  if (c >= 0xC2 && c <= 0xDF) return left >= 2 && cont(i + 1) ? 2 : 0;
  if (c >= 0xE0 && c <= 0xEF) {
    if (left < 3 || !cont(i + 1) || !cont(i + 2)) return 0;
    if (c == 0xE0 && b(i + 1) < 0xA0) return 0;   // overlong
    if (c == 0xED && b(i + 1) >= 0xA0) return 0;  // surrogate
    return 3;
  }
  if (c >= 0xF0 && c <= 0xF4) {
    if (left < 4 || !cont(i + 1) || !cont(i + 2) || !cont(i + 3)) return 0;
    if (c == 0xF0 && b(i + 1) < 0x90) return 0;   // overlong
    if (c == 0xF4 && b(i + 1) >= 0x90) return 0;  // past U+10FFFF
    return 4;
  }
  return 0;
}

// SentencePiece's whitespace marker U+2581 ("▁"): in input text it would decode as a space.
constexpr char kSpaceMarker[] = "\xE2\x96\x81";

}  // namespace

Status Tokenizer::encode(const std::string& text, std::vector<int32_t>* ids) const {
  if (!sp_) return Status::invalid_argument("tokenizer is not loaded");
  // SentencePiece sees only well-formed UTF-8 without U+2581; every other byte (a broken
  // sequence, or a literal U+2581) becomes its byte piece, so decode_bytes inverts encode
  // for any byte string. Text without such bytes is one SentencePiece call, as before.
  ids->clear();
  std::vector<int> v;
  size_t run = 0, i = 0;
  const auto flush = [&](size_t end) -> Status {
    if (end == run) return Status::ok();
    sentencepiece::util::Status s =
        run == 0 && end == text.size() ? sp_->Encode(text, &v) : sp_->Encode(text.substr(run, end - run), &v);
    if (!s.ok()) return Status::invalid_argument("tokenizer encode failed: " + sp_message(s));
    ids->insert(ids->end(), v.begin(), v.end());
    return Status::ok();
  };
  while (i < text.size()) {
    size_t n = utf8_sequence_length(text, i);
    if (n == 3 && text.compare(i, 3, kSpaceMarker) == 0) n = 0;
    if (n > 0) {
      i += n;
      continue;
    }
    LAPLACE_RETURN_IF_ERROR(flush(i));
    const size_t bytes = text.compare(i, 3, kSpaceMarker) == 0 ? 3 : 1;
    for (size_t k = 0; k < bytes; ++k) {
      const int32_t id = byte_ids_[static_cast<unsigned char>(text[i + k])];
      if (id < 0) {
        char hex[8];
        std::snprintf(hex, sizeof hex, "0x%02X", static_cast<unsigned char>(text[i + k]));
        return Status::invalid_argument(std::string("tokenizer ") + path_ + " has no byte piece for " + hex +
                                        " (train it with byte fallback)");
      }
      ids->push_back(id);
    }
    i += bytes;
    run = i;
  }
  return flush(text.size());
}

Status Tokenizer::decode_bytes(const std::vector<int32_t>& ids, std::string* bytes) const {
  if (!sp_) return Status::invalid_argument("tokenizer is not loaded");
  const int64_t v = vocab_size();
  std::string out;
  for (size_t i = 0; i < ids.size(); ++i) {
    const int32_t id = ids[i];
    if (id < 0 || id >= v) {
      return Status::invalid_argument("cannot decode token id " + std::to_string(id) + " at position " +
                                      std::to_string(i) + ": out of range [0, " + std::to_string(v) + ")");
    }
    if (sp_->IsControl(id)) continue;
    if (sp_->IsByte(id)) {
      out.push_back(static_cast<char>(byte_of_id(id)));
      continue;
    }
    const std::string& p = sp_->IdToPiece(id);
    for (size_t k = 0; k < p.size();) {
      if (p.compare(k, 3, kSpaceMarker) == 0) {
        out.push_back(' ');
        k += 3;
      } else {
        out.push_back(p[k++]);
      }
    }
  }
  *bytes = std::move(out);
  return Status::ok();
}

int Tokenizer::byte_of_id(int32_t id) const {
  // Byte pieces are spelled "<0xNN>".
  const std::string& p = sp_->IdToPiece(id);
  return static_cast<int>(std::strtol(p.substr(3, 2).c_str(), nullptr, 16));
}

Status Tokenizer::decode(const std::vector<int32_t>& ids, std::string* text) const {
  if (!sp_) return Status::invalid_argument("tokenizer is not loaded");
  const int64_t v = vocab_size();
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= v) {
      return Status::invalid_argument("cannot decode token id " + std::to_string(ids[i]) + " at position " +
                                      std::to_string(i) + ": out of range [0, " + std::to_string(v) + ")");
    }
  }
  std::vector<int> in(ids.begin(), ids.end());
  sentencepiece::util::Status s = sp_->Decode(in, text);
  if (!s.ok()) return Status::invalid_argument("tokenizer decode failed: " + sp_message(s));
  return Status::ok();
}

int64_t Tokenizer::vocab_size() const { return sp_ ? sp_->GetPieceSize() : 0; }
int32_t Tokenizer::bos_id() const { return sp_ ? sp_->bos_id() : -1; }
int32_t Tokenizer::eos_id() const { return sp_ ? sp_->eos_id() : -1; }
int32_t Tokenizer::pad_id() const { return sp_ ? sp_->pad_id() : -1; }
int32_t Tokenizer::unk_id() const { return sp_ ? sp_->unk_id() : -1; }

std::string Tokenizer::piece(int32_t id) const {
  if (!sp_ || id < 0 || id >= vocab_size()) return std::string();
  return sp_->IdToPiece(id);
}

int32_t Tokenizer::piece_to_id(const std::string& piece) const {
  if (!sp_) return -1;
  return sp_->PieceToId(piece);
}

Status tokenizer_train(const TokenizerTrainOptions& opt) {
  if (opt.inputs.empty()) return Status::invalid_argument("tokenizer train: no input files");
  if (opt.model_prefix.empty()) return Status::invalid_argument("tokenizer train: empty model prefix");
  // 4 specials + 256 byte pieces + user symbols, plus at least one learned piece.
  const int64_t min_vocab = 4 + 256 + static_cast<int64_t>(opt.user_defined_symbols.size()) + 1;
  if (opt.vocab_size < min_vocab) {
    return Status::invalid_argument("tokenizer train: vocab_size " + std::to_string(opt.vocab_size) +
                                    " is too small: byte fallback needs at least " + std::to_string(min_vocab));
  }
  if (opt.vocab_size > (int64_t{1} << 31) - 1) return Status::invalid_argument("tokenizer train: vocab_size too large");
  if (!(opt.character_coverage > 0.0 && opt.character_coverage <= 1.0)) {
    return Status::invalid_argument("tokenizer train: character_coverage must be in (0, 1]");
  }
  if (opt.num_threads < 1) return Status::invalid_argument("tokenizer train: num_threads must be >= 1");
  if (opt.max_sentence_length < 1) return Status::invalid_argument("tokenizer train: max_sentence_length must be >= 1");
  for (const auto& s : opt.user_defined_symbols) {
    if (s.empty() || s.find(',') != std::string::npos) {
      return Status::invalid_argument("tokenizer train: user-defined symbol '" + s + "' is empty or contains ','");
    }
  }
  for (const auto& p : opt.inputs) {
    std::error_code ec;
    if (!std::filesystem::is_regular_file(p, ec)) {
      return Status::not_found("tokenizer train: input " + p + " does not exist or is not a regular file");
    }
  }

  std::unordered_map<std::string, std::string> kw = {
      {"model_type", "bpe"},
      {"vocab_size", std::to_string(opt.vocab_size)},
      {"byte_fallback", "true"},
      {"character_coverage", std::to_string(opt.character_coverage)},
      {"normalization_rule_name", "identity"},
      {"remove_extra_whitespaces", "false"},
      {"add_dummy_prefix", "false"},
      {"allow_whitespace_only_pieces", "true"},
      {"split_digits", opt.split_digits ? "true" : "false"},
      {"max_sentence_length", std::to_string(opt.max_sentence_length)},
      {"input_sentence_size", std::to_string(opt.input_sentence_size)},
      {"shuffle_input_sentence", "true"},
      {"num_threads", std::to_string(opt.num_threads)},
      {"unk_id", "0"},
      {"bos_id", "1"},
      {"eos_id", "2"},
      {"pad_id", "3"},
      {"hard_vocab_limit", "true"},
      {"vocabulary_output_piece_score", "true"},
      {"minloglevel", opt.verbose ? "0" : "2"},
  };
  if (opt.vocab_size > 100'000) kw["train_extremely_large_corpus"] = "true";
  if (!opt.user_defined_symbols.empty()) {
    std::string joined;
    for (size_t i = 0; i < opt.user_defined_symbols.size(); ++i) {
      if (i) joined += ",";
      joined += opt.user_defined_symbols[i];
    }
    kw["user_defined_symbols"] = joined;
  }

  std::string serialized;
  Status input_error;
  {
    std::lock_guard<std::mutex> lock(train_mutex());
    sentencepiece::SetRandomGeneratorSeed(opt.seed);
    LineIterator it(opt.inputs);
    sentencepiece::util::Status s = sentencepiece::SentencePieceTrainer::Train(kw, &it, &serialized);
    input_error = it.error();
    if (!input_error.is_ok()) return input_error.with_context("tokenizer train");
    if (!s.ok()) return Status::invalid_argument("tokenizer train: SentencePiece failed: " + sp_message(s));
  }

  // Verify the result loads, then write <prefix>.model atomically and a .vocab listing.
  sentencepiece::SentencePieceProcessor sp;
  sentencepiece::util::Status ls = sp.LoadFromSerializedProto(serialized);
  if (!ls.ok()) return Status::corrupt("tokenizer train: the trained model does not load: " + sp_message(ls));
  LAPLACE_RETURN_IF_ERROR(write_file_atomic(opt.model_prefix + ".model", serialized.data(), serialized.size()));
  std::string vocab;
  for (int i = 0; i < sp.GetPieceSize(); ++i) {
    char score[32];
    std::snprintf(score, sizeof(score), "%g", static_cast<double>(sp.GetScore(i)));
    vocab += sp.IdToPiece(i) + "\t" + score + "\n";
  }
  LAPLACE_RETURN_IF_ERROR(write_file_atomic(opt.model_prefix + ".vocab", vocab.data(), vocab.size()));
  return Status::ok();
}

}  // namespace laplace
