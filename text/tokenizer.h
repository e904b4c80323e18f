// Tokenizer: a thin, Status-returning wrapper over a SentencePiece model
// (BPE with byte fallback), plus deterministic training of such a model.
//
// Ids are int32 in [0, vocab_size()). Training (tokenizer_train) fixes
//   <unk> = 0, <s> (bos) = 1, </s> (eos) = 2, <pad> = 3,
// then the user-defined special tokens (4, 5, ...), then the 256 byte pieces
// <0x00>..<0xFF>, then the learned pieces. Text is not normalised (identity rule, whitespace kept), so
// decode(encode(s)) == s for any valid UTF-8 string s, and decode_bytes(encode(s)) == s
// for any byte string s (bytes SentencePiece cannot take go to their byte pieces).
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/status.h"

namespace sentencepiece {
class SentencePieceProcessor;
}

namespace laplace {

class Tokenizer {
 public:
  Tokenizer();
  ~Tokenizer();
  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;

  // Loads a SentencePiece .model file. A missing file is not_found; an empty,
  // truncated or otherwise unparsable file is corrupt. *out is replaced only
  // on success.
  static Status load(const std::string& path, Tokenizer* out);
  // Same, from the bytes of a .model file.
  static Status load_from_bytes(const std::string& bytes, const std::string& name, Tokenizer* out);

  bool is_loaded() const { return sp_ != nullptr; }

  // Bytes -> ids. No bos/eos is added. Well-formed UTF-8 goes through SentencePiece;
  // any other byte, and the three bytes of a literal U+2581, become byte pieces, so
  // decode_bytes(encode(s)) == s for every byte string s (binary data included).
  Status encode(const std::string& text, std::vector<int32_t>* ids) const;
  // Ids -> text. Any id outside [0, vocab_size()) is an invalid_argument error
  // naming its position. Control ids (bos/eos/pad) decode to nothing.
  // The result is always well-formed UTF-8: byte pieces that do not form a sequence
  // decode to U+FFFD (what streamed text and JSON need).
  Status decode(const std::vector<int32_t>& ids, std::string* text) const;
  // Ids -> the exact bytes encode() read (the inverse of encode for any byte string).
  Status decode_bytes(const std::vector<int32_t>& ids, std::string* bytes) const;

  int64_t vocab_size() const;
  // -1 when the model does not define the token.
  int32_t bos_id() const;
  int32_t eos_id() const;
  int32_t pad_id() const;
  int32_t unk_id() const;

  // The piece string of `id` ("▁the", "<0x0A>", "</s>"); "" when id is out of range.
  std::string piece(int32_t id) const;
  // The id of a piece (e.g. a user-defined special token); unk_id() if unknown.
  int32_t piece_to_id(const std::string& piece) const;

  // Where the model was loaded from ("" if not loaded).
  const std::string& path() const { return path_; }

 private:
  int byte_of_id(int32_t id) const;

  std::unique_ptr<sentencepiece::SentencePieceProcessor> sp_;
  std::string path_;
  std::array<int32_t, 256> byte_ids_{};  // byte value -> its byte piece's id, -1 if none
};

struct TokenizerTrainOptions {
  // Plain text files: every line is a training sentence. Files ending in
  // ".jsonl" are read as JSON Lines instead: the `text` string field of every
  // object, split into lines.
  std::vector<std::string> inputs;
  // Writes <model_prefix>.model (atomically) and <model_prefix>.vocab
  // ("piece<TAB>score" per line, for humans).
  std::string model_prefix;
  int64_t vocab_size = 32000;
  // Extra special tokens (e.g. "<|user|>"): never split, matched in text (so
  // typing them in a prompt produces them), ids 4, 5, ... in this order.
  std::vector<std::string> user_defined_symbols;
  // Characters covering this fraction of the corpus become pieces; rarer ones
  // are spelled with byte pieces.
  double character_coverage = 0.9995;
  // Lines longer than this many bytes are skipped in training (they are still
  // encoded normally later).
  int64_t max_sentence_length = 1 << 16;
  // At most this many lines are used; when the corpus has more, a seeded
  // uniform sample is taken. 0 = all lines.
  int64_t input_sentence_size = 2'000'000;
  // Seed of SentencePiece's random generator (line sampling). With the same
  // inputs, options and num_threads = 1, training is bit-for-bit deterministic.
  uint32_t seed = 1234;
  int num_threads = 1;
  bool split_digits = true;
  // Print SentencePiece's training log.
  bool verbose = false;
};

// Trains a BPE SentencePiece model with byte fallback. The .model file does
// not record the input paths or the prefix, so identical inputs give
// identical bytes wherever they are.
Status tokenizer_train(const TokenizerTrainOptions& opt);

}  // namespace laplace
