// Text subcommands: tokenizer train/encode/decode, data prepare.
#include <cstdio>
#include <iostream>
#include <iterator>

#include "cli/common.h"
#include "text/prepare.h"
#include "text/tokenizer.h"

namespace laplace::cli {

namespace {

Status run_encode(const std::string& model, const std::string& text) {
  Tokenizer tok;
  LAPLACE_RETURN_IF_ERROR(Tokenizer::load(model, &tok));
  std::string in = text;
  if (in.empty()) in.assign(std::istreambuf_iterator<char>(std::cin), std::istreambuf_iterator<char>());
  std::vector<int32_t> ids;
  LAPLACE_RETURN_IF_ERROR(tok.encode(in, &ids));
  for (size_t i = 0; i < ids.size(); ++i) std::printf("%s%d", i ? "," : "", ids[i]);
  std::printf("\n");
  return Status::ok();
}

Status run_decode(const std::string& model, const std::string& ids_text) {
  Tokenizer tok;
  LAPLACE_RETURN_IF_ERROR(Tokenizer::load(model, &tok));
  std::vector<int32_t> ids;
  LAPLACE_RETURN_IF_ERROR(parse_ids(ids_text, &ids));
  std::string text;
  LAPLACE_RETURN_IF_ERROR(tok.decode(ids, &text));
  std::printf("%s\n", text.c_str());
  return Status::ok();
}

}  // namespace

void add_tokenizer(CLI::App& app) {
  auto* cmd = app.add_subcommand("tokenizer", "train a sentencepiece BPE tokenizer; encode and decode");
  cmd->require_subcommand(1);

  auto* train = cmd->add_subcommand("train", "train a BPE tokenizer on text files");
  auto t = std::make_shared<TokenizerTrainOptions>();
  train->add_option("--input", t->inputs, "text files")->required();
  train->add_option("--model-prefix", t->model_prefix, "writes PREFIX.model and PREFIX.vocab")->required();
  train->add_option("--vocab-size", t->vocab_size, "vocabulary size")->check(CLI::Range(8, 1 << 22));
  train->add_option("--seed", t->seed, "training seed");
  train->add_option("--input-sentence-size", t->input_sentence_size, "sentences sampled for training");
  train->add_flag("--verbose", t->verbose, "sentencepiece's own log");
  train->callback([t] { g_exit_code = report(tokenizer_train(*t)); });

  auto* enc = cmd->add_subcommand("encode", "text (--text or stdin) to ids");
  auto e = std::make_shared<std::pair<std::string, std::string>>();
  enc->add_option("--tokenizer", e->first, "tokenizer .model")->required();
  enc->add_option("--text", e->second, "text to encode (default: stdin)");
  enc->callback([e] { g_exit_code = report(run_encode(e->first, e->second)); });

  auto* dec = cmd->add_subcommand("decode", "ids to text");
  auto d = std::make_shared<std::pair<std::string, std::string>>();
  dec->add_option("--tokenizer", d->first, "tokenizer .model")->required();
  dec->add_option("--ids", d->second, "comma-separated ids")->required();
  dec->callback([d] { g_exit_code = report(run_decode(d->first, d->second)); });
}

void add_data(CLI::App& app) {
  auto* cmd = app.add_subcommand("data", "prepare token shards");
  cmd->require_subcommand(1);
  auto* prep = cmd->add_subcommand("prepare", "text files or JSONL → llm.c-format token shards");
  struct A { PrepareOptions o; std::string format = "auto", split = "file"; };
  auto a = std::make_shared<A>();
  prep->add_option("--input", a->o.inputs, "text or .jsonl files")->required();
  prep->add_option("--tokenizer", a->o.tokenizer, "tokenizer .model")->required();
  prep->add_option("--out", a->o.output_dir, "output directory")->required();
  prep->add_option("--format", a->format, "auto, text or jsonl")->check(CLI::IsMember({"auto", "text", "jsonl"}));
  prep->add_option("--split", a->split, "text documents: file, blank-lines or fortune")
      ->check(CLI::IsMember({"file", "blank-lines", "fortune"}));
  prep->add_option("--jsonl-field", a->o.jsonl_field, "JSONL text field");
  prep->add_option("--shard-tokens", a->o.shard_tokens, "tokens per shard")->check(CLI::Range(1024, INT32_MAX));
  prep->add_option("--val-fraction", a->o.val_fraction, "held-out document fraction")->check(CLI::Range(0.0, 0.99));
  prep->add_option("--seed", a->o.seed, "split seed");
  prep->add_flag("--overwrite", a->o.overwrite, "replace existing shards");
  prep->callback([a] {
    a->o.format = a->format == "text" ? InputFormat::kText : a->format == "jsonl" ? InputFormat::kJsonl : InputFormat::kAuto;
    a->o.text_split = a->split == "blank-lines" ? TextSplit::kBlankLines
                      : a->split == "fortune"   ? TextSplit::kFortune
                                                : TextSplit::kFile;
    g_exit_code = report(data_prepare(a->o));
  });
}

}  // namespace laplace::cli
