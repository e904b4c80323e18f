// Shared plumbing of the `laplace` subcommands.
#pragma once

#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "core/status.h"
#include "model/model.h"
#include "ops/backend.h"
#include "serve/engine.h"

namespace laplace::cli {

// Where a model lives: --model DIR (config.json, model.safetensors, tokenizer.model)
// or explicit --config/--ckpt/--tokenizer files.
struct ModelArgs {
  std::string dir, config, ckpt, tokenizer;
  std::string device = "cpu";
  std::string dtype = "f32";
  // auto: an FP8 model file (`laplace quantize`) computes with FP8 weights, any other with
  // --dtype's; fp8: the body matrices quantised to FP8 at load (an FP8 file's as they are);
  // fp8-fast: fp8 with the products accumulated fast (Model::set_fp8_fast_forward); dtype:
  // --dtype's weights only (an FP8 file is refused).
  std::string weights = "auto";
  // --fp8-head: with FP8 weights, the LM head in FP8 too (Model::set_fp8_head).
  bool fp8_head = false;
  void add_to(CLI::App* app, bool need_ckpt = true);
  Status resolve();  // fills config/ckpt/tokenizer from dir
};

struct LoadedModel {
  std::unique_ptr<Backend> backend;
  Model model;
};

Status parse_dtype(const std::string& s, DType* out);
// Creates the backend and the model, and loads the checkpoint when one is named.
Status load_model(const ModelArgs& a, LoadedModel* out);
// Loads `ckpt` into a created model as ModelArgs::weights ("auto", "fp8", "fp8-fast", "dtype") says.
Status load_weights(const std::string& ckpt, const std::string& weights, Model* m);
// ModelArgs::weights for the weights a model already holds: fp8 and fp8-fast quantise its body
// matrices (Model::use_fp8_weights); auto and dtype keep them.
Status apply_weights_option(const std::string& weights, Model* m);
// What ModelArgs asks of a model whose weights are in place: fp8-fast's fast accumulation
// (Model::set_fp8_fast_forward) and --fp8-head (Model::set_fp8_head, refused without FP8 weights).
Status apply_fp8_options(const ModelArgs& a, Model* m);

// "1,2,3" → {1,2,3}; "1,2;3,4" → {{1,2},{3,4}}. Errors name the bad item.
Status parse_ids(const std::string& s, std::vector<int32_t>* out);
Status parse_id_rows(const std::string& s, std::vector<std::vector<int32_t>>* out);

// Engine decode options shared by serve and the benches: --state-dtype f32|bf16, --eager,
// --defer-writeback R and --prefill-graphs N. On CUDA, decode runs from CUDA graphs captured at
// start-up, and ragged prefill from graphs of the N layouts last used, unless --eager (which
// keeps the same padded widths); on the CPU, decode is eager at exact widths.
void add_decode_options(CLI::App* cmd, std::string* state_dtype, bool* eager, int64_t* defer_writeback,
                        int64_t* prefill_graphs);
Status engine_decode_options(const std::string& device, const std::string& state_dtype, bool eager,
                             int64_t defer_writeback, int64_t prefill_graphs, EngineOptions* o);

// --speculative (docs/serving.md §11): "off", "ngram[:K]" (prompt-lookup drafts of up to K
// tokens, 1 … 8; default 4) or "draft:DIR[:K]" (a draft model's directory, which
// Engine::create loads and checks) as EngineOptions::speculative_k, drafter and draft_model.
// K must be below --defer-writeback's R (Engine::create says so).
void add_speculative_option(CLI::App* cmd, std::string* spec);
Status speculative_options(const std::string& spec, EngineOptions* o);

// --batch-prefill's values (auto, off, equal, ragged) as EngineOptions::batch_prefill, and the list
// for the option's check.
int batch_prefill_value(const std::string& s);
inline const std::vector<std::string> kBatchPrefillChoices = {"auto", "off", "equal", "ragged"};

// "1,2,3" → numbers (each item whole, of T, and passing `ok` when given). An empty list or an
// item that is not one is an error naming the flag and the item ("--m: 'x' is not a number";
// `what` replaces "a number").
template <class T>
Status parse_number_list(const std::string& s, const std::string& flag, std::vector<T>* out,
                         const std::string& what = "a number", const std::function<bool(T)>& ok = nullptr) {
  out->clear();
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');) {
    std::istringstream is(item);
    T v{};
    if (!(is >> v) || !is.eof() || (ok && !ok(v)))
      return Status::invalid_argument(flag + ": '" + item + "' is not " + what);
    out->push_back(v);
  }
  if (out->empty()) return Status::invalid_argument(flag + " is empty");
  return Status::ok();
}

// "123", "64k", "512M", "2G" (binary multiples) → bytes.
Status parse_bytes(const std::string& s, int64_t* out);

// --documents: "separate" keeps the documents of a packed window apart (each from a zero state,
// as serving starts each request), "packed" runs the window as one stream. The separator is the
// tokenizer's (the shards were written with it), else the one `data prepare` writes (</s>, 2).
Status parse_documents(const std::string& v, const std::string& tokenizer, int32_t* sep);

// What BenchLog records as the device: the GPU's name for "cuda", else the CPU model and
// its thread count ("AMD EPYC 7R32 x16").
std::string device_description(const std::string& device);

// Prints "laplace: error: <status>" and returns the exit code 1 (0 when ok).
int report(const Status& st);

// Subcommand registration: each adds itself to the app and sets its callback.
void add_info(CLI::App& app);
void add_init(CLI::App& app);
void add_quantize(CLI::App& app);
void add_forward(CLI::App& app);
void add_generate(CLI::App& app);
void add_eval(CLI::App& app);
// `eval mqar` (cli/cmd_mqar.cpp), a subcommand of `eval`.
void add_eval_mqar(CLI::App* eval);
// `eval copy|passkey|position|serving` (cli/cmd_eval_quality.cpp).
void add_eval_quality(CLI::App* eval);
void add_train(CLI::App& app);
void add_tokenizer(CLI::App& app);
void add_data(CLI::App& app);
void add_debug(CLI::App& app);
void add_bench(CLI::App& app);
void add_dist(CLI::App& app);
void add_serve(CLI::App& app);
// `export hf` (cli/cmd_export.cpp).
void add_export(CLI::App& app);
// Makes the model directory `dir` (config.json, model.safetensors) loadable by transformers'
// AutoModelForCausalLM with trust_remote_code: adds "architectures" and "auto_map" to its
// config.json and writes the modeling files this binary embeds. `export hf` and `train` use it.
Status write_hf_files(const std::string& dir);

// Set by subcommand callbacks; main returns it.
extern int g_exit_code;

}  // namespace laplace::cli
