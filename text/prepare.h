// data_prepare: text / JSONL corpora -> token shards for training (docs/data.md).
//
// Every document is encoded with the tokenizer and preceded by ONE separator
// token, the tokenizer's eos id (</s>, id 2 for models from tokenizer_train) —
// llm.c's convention of an <|endoftext|> before each document. So a shard
// reads  </s> doc0 </s> doc1 ...; a model trained on it predicts </s> at the
// end of a document, and unconditional generation starts from </s>.
//
// Documents go, in input order, to train_000000.bin, train_000001.bin, ...
// (each exactly shard_tokens tokens except the last; a document may continue
// into the next shard), except a deterministic held-out fraction that goes to
// val_000000.bin (val_000001.bin, ... if it exceeds shard_tokens). Document i
// (0-based over all inputs) is held out iff u(seed, i) < val_fraction, where u
// is a SplitMix64 hash mapped to [0, 1) — independent of the other documents.
// A summary is written to prepare.json in the output directory.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/status.h"

namespace laplace {

class Tokenizer;

enum class InputFormat {
  kAuto,   // ".jsonl" files are JSONL, everything else text
  kText,
  kJsonl,  // one JSON object per line with a string field (default "text")
};

// How a text file is cut into documents.
enum class TextSplit {
  kFile,        // the whole file is one document
  kBlankLines,  // documents are separated by one or more blank lines
  kFortune,     // fortune(6) files: a line holding only "%" separates documents
};

struct PrepareOptions {
  std::vector<std::string> inputs;
  std::string tokenizer;   // SentencePiece .model
  std::string output_dir;  // created if missing
  InputFormat format = InputFormat::kAuto;
  TextSplit text_split = TextSplit::kFile;
  std::string jsonl_field = "text";
  int64_t shard_tokens = 100'000'000;
  double val_fraction = 0.01;  // in [0, 1)
  uint64_t seed = 1234;
  // Existing train_*.bin / val_*.bin in output_dir are an error unless true,
  // in which case they are deleted first (stale shards would be globbed in).
  bool overwrite = false;
  int num_threads = 0;  // encoding threads; 0 = hardware concurrency (capped at 16)
  bool quiet = false;   // no summary on stdout
};

struct PrepareStats {
  int64_t documents = 0;  // non-empty documents encoded
  int64_t train_documents = 0;
  int64_t val_documents = 0;
  int64_t skipped_empty = 0;  // empty documents (not written)
  int64_t train_tokens = 0;   // including one separator per document
  int64_t val_tokens = 0;
  int64_t vocab_size = 0;
  int32_t separator_id = -1;
  std::vector<std::string> train_files;
  std::vector<std::string> val_files;
};

// The token data_prepare puts before every document (the eos id); -1 if the
// tokenizer has none.
int32_t document_separator_id(const Tokenizer& tok);
// That token for every tokenizer tokenizer_train makes (</s>): what training assumes of shards
// when no tokenizer is given.
constexpr int32_t kDefaultDocumentSeparator = 2;

Status data_prepare(const PrepareOptions& options, PrepareStats* stats = nullptr);

}  // namespace laplace
