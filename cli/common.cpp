#include "cli/common.h"

#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <thread>

#include "model/config.h"
#include "model/quantize.h"
#include "text/prepare.h"
#include "text/tokenizer.h"

#ifdef LAPLACE_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace laplace::cli {

int g_exit_code = 0;

void ModelArgs::add_to(CLI::App* app, bool need_ckpt) {
  app->add_option("--model", dir, "model directory (config.json, model.safetensors, tokenizer.model)");
  app->add_option("--config", config, "config.json (overrides --model's)");
  if (need_ckpt) app->add_option("--ckpt", ckpt, "weights .safetensors (overrides --model's)");
  app->add_option("--tokenizer", tokenizer, "sentencepiece .model (overrides --model's)");
  app->add_option("--device", device, "cpu or cuda")->check(CLI::IsMember({"cpu", "cuda"}));
  app->add_option("--dtype", dtype, "compute dtype: f32, f64 (CPU) or bf16 (CUDA)");
  app->add_option("--weights", weights,
                  "body matrices: auto (FP8 when the model file holds FP8 weights), fp8 (quantise them to FP8 "
                  "E4M3 with per-row scales at load and multiply in FP8), fp8-fast (the same, the products "
                  "accumulated as the tensor cores do: faster) or dtype (--dtype's)")
      ->check(CLI::IsMember({"auto", "fp8", "fp8-fast", "dtype"}));
  app->add_flag("--fp8-head", fp8_head,
                "with FP8 weights, the LM head in FP8 too (faster decode; its cost on greedy tokens is what "
                "`laplace eval serving --options fp8-head` measures)");
}

Status ModelArgs::resolve() {
  namespace fs = std::filesystem;
  if (!dir.empty()) {
    if (!fs::is_directory(dir)) return Status::not_found("model directory " + dir + " does not exist");
    if (config.empty()) config = (fs::path(dir) / "config.json").string();
    if (ckpt.empty() && fs::exists(fs::path(dir) / "model.safetensors"))
      ckpt = (fs::path(dir) / "model.safetensors").string();
    if (tokenizer.empty() && fs::exists(fs::path(dir) / "tokenizer.model"))
      tokenizer = (fs::path(dir) / "tokenizer.model").string();
  }
  if (config.empty()) return Status::invalid_argument("no model given: pass --model DIR or --config FILE");
  return Status::ok();
}

std::string device_description(const std::string& device) {
#ifdef LAPLACE_HAVE_CUDA
  if (device == "cuda") {
    cudaDeviceProp prop{};
    int dev = 0;
    if (cudaGetDevice(&dev) == cudaSuccess && cudaGetDeviceProperties(&prop, dev) == cudaSuccess) return prop.name;
    return "cuda";
  }
#endif
  std::string model = "cpu";
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("model name", 0) == 0) {
      auto c = line.find(':');
      if (c != std::string::npos) model = line.substr(c + 2);
      break;
    }
  }
  return model + " x" + std::to_string(std::thread::hardware_concurrency());
}

Status parse_dtype(const std::string& s, DType* out) {
  if (s == "f32") *out = DType::kF32;
  else if (s == "f64") *out = DType::kF64;
  else if (s == "bf16") *out = DType::kBF16;
  else return Status::invalid_argument("unknown dtype '" + s + "' (use f32, f64 or bf16)");
  return Status::ok();
}

void add_decode_options(CLI::App* cmd, std::string* state_dtype, bool* eager, int64_t* defer_writeback,
                        int64_t* prefill_graphs) {
  cmd->add_option("--state-dtype", *state_dtype, "decode state dtype: f32, or bf16 (CUDA, bf16 models: half the bytes)")
      ->check(CLI::IsMember({"f32", "bf16"}));
  cmd->add_flag("--eager", *eager, "CUDA: decode without CUDA graphs (same kernels and padded widths)");
  cmd->add_option("--defer-writeback", *defer_writeback,
                  "write each decode state back every R-th step only (R = 4, 8 or 16; 0 = every step, SPEC's slot "
                  "size): less state traffic, slots larger by the last R-1 tokens' k and v")
      ->check(CLI::IsMember({0, 4, 8, 16}));
  cmd->add_option("--prefill-graphs", *prefill_graphs,
                  "CUDA: ragged prefill layouts kept as CUDA graphs (captured when a layout recurs; 0 = eager prefill)")
      ->check(CLI::Range(int64_t{0}, int64_t{1024}));
}

Status engine_decode_options(const std::string& device, const std::string& state_dtype, bool eager,
                             int64_t defer_writeback, int64_t prefill_graphs, EngineOptions* o) {
  o->defer_writeback = defer_writeback;
  o->prefill_graphs = prefill_graphs;
  if (state_dtype == "bf16") o->state_dtype = DType::kBF16;
  else if (state_dtype == "f32") o->state_dtype = DType::kF32;
  else return Status::invalid_argument("--state-dtype must be f32 or bf16, got '" + state_dtype + "'");
  const bool cuda = device == "cuda";
  o->graphs = cuda && !eager;
  o->default_widths = cuda;
  return Status::ok();
}

void add_speculative_option(CLI::App* cmd, std::string* spec) {
  cmd->add_option("--speculative", *spec,
                  "speculative decoding: ngram[:K] drafts up to K tokens (1-8, default 4) by prompt lookup in each "
                  "sequence's context, draft:DIR[:K] by a smaller model with the same tokenizer (a model directory); "
                  "either is checked in one forward: greedy output is unchanged, sampled output keeps its "
                  "distribution. Needs --defer-writeback R with R > K. off = none");
}

Status speculative_options(const std::string& spec, EngineOptions* o) {
  o->speculative_k = 0;
  o->drafter = nullptr;
  o->draft_model.clear();
  if (spec.empty() || spec == "off") return Status::ok();
  const std::string kind = spec.substr(0, spec.find(':'));
  if (kind != "ngram" && kind != "draft")
    return Status::invalid_argument("--speculative: '" + spec + "' is not off, ngram[:K] or draft:DIR[:K]");
  // What follows the kind: ngram's K; the draft's directory, then K after a last ':' if it is a number.
  std::string rest = spec.size() > kind.size() ? spec.substr(kind.size() + 1) : "";
  std::string num;
  if (kind == "ngram") {
    num = rest;
    if (spec.size() > kind.size() && num.empty())
      return Status::invalid_argument("--speculative " + spec + ": K is missing after ':'");
  } else {
    const size_t colon = rest.rfind(':');
    if (colon != std::string::npos && colon + 1 < rest.size() &&
        rest.find_first_not_of("0123456789", colon + 1) == std::string::npos) {
      num = rest.substr(colon + 1);
      rest.resize(colon);
    }
    if (rest.empty()) return Status::invalid_argument("--speculative " + spec + ": draft:DIR names no directory");
  }
  int64_t k = 4;
  if (!num.empty()) {
    std::istringstream is(num);
    if (!(is >> k) || !is.eof() || k < 1 || k > kMaxSpeculativeK)
      return Status::invalid_argument("--speculative " + spec + ": K must be a whole number from 1 to " +
                                      std::to_string(kMaxSpeculativeK));
  }
  o->speculative_k = k;
  if (kind == "ngram") o->drafter = std::make_shared<NgramDrafter>();
  else o->draft_model = rest;
  return Status::ok();
}

namespace {
// Whether --weights asks for the FP8 products (quantising weights held in another dtype).
bool fp8_products(const std::string& weights) { return weights == "fp8" || weights == "fp8-fast"; }
}  // namespace

Status load_model(const ModelArgs& args, LoadedModel* out) {
  ModelArgs a = args;
  LAPLACE_RETURN_IF_ERROR(a.resolve());
  Config cfg;
  LAPLACE_RETURN_IF_ERROR(config_load(a.config, &cfg));
  DType dt;
  LAPLACE_RETURN_IF_ERROR(parse_dtype(a.dtype, &dt));
  LAPLACE_RETURN_IF_ERROR(make_backend(a.device, &out->backend));
  LAPLACE_RETURN_IF_ERROR(out->model.create(cfg, *out->backend, dt));
  if (a.ckpt.empty()) {
    if (fp8_products(a.weights))
      return Status::invalid_argument("--weights " + a.weights + " needs weights to quantise (--model or --ckpt)");
  } else {
    LAPLACE_RETURN_IF_ERROR(load_weights(a.ckpt, a.weights, &out->model));
  }
  return apply_fp8_options(a, &out->model);
}

Status load_weights(const std::string& ckpt, const std::string& weights, Model* m) {
  bool fp8_file = false;
  LAPLACE_RETURN_IF_ERROR(is_fp8_model_file(ckpt, &fp8_file));
  if (fp8_file && weights != "dtype") return m->load_fp8(ckpt);
  LAPLACE_RETURN_IF_ERROR(m->load(ckpt));
  return apply_weights_option(weights, m);
}

Status apply_weights_option(const std::string& weights, Model* m) {
  return fp8_products(weights) ? m->use_fp8_weights() : Status::ok();
}

Status apply_fp8_options(const ModelArgs& a, Model* m) {
  m->set_fp8_fast_forward(a.weights == "fp8-fast");
  return a.fp8_head ? m->set_fp8_head(true) : Status::ok();
}

Status parse_ids(const std::string& s, std::vector<int32_t>* out) {
  out->clear();
  size_t i = 0;
  while (i <= s.size()) {
    size_t j = s.find(',', i);
    if (j == std::string::npos) j = s.size();
    std::string item = s.substr(i, j - i);
    while (!item.empty() && item.front() == ' ') item.erase(item.begin());
    while (!item.empty() && item.back() == ' ') item.pop_back();
    if (item.empty()) return Status::invalid_argument("empty token id in '" + s + "'");
    char* end = nullptr;
    errno = 0;
    long long v = std::strtoll(item.c_str(), &end, 10);
    if (*end != '\0' || errno == ERANGE || v < 0 || v > INT32_MAX)
      return Status::invalid_argument("bad token id '" + item + "'");
    out->push_back(static_cast<int32_t>(v));
    i = j + 1;
  }
  return Status::ok();
}

Status parse_id_rows(const std::string& s, std::vector<std::vector<int32_t>>* out) {
  out->clear();
  size_t i = 0;
  while (i <= s.size()) {
    size_t j = s.find(';', i);
    if (j == std::string::npos) j = s.size();
    std::vector<int32_t> row;
    LAPLACE_RETURN_IF_ERROR(parse_ids(s.substr(i, j - i), &row));
    out->push_back(std::move(row));
    i = j + 1;
  }
  return Status::ok();
}

int report(const Status& st) {
  if (st.is_ok()) return 0;
  std::fprintf(stderr, "laplace: error: %s\n", st.to_string().c_str());
  return 1;
}

// "123", "64k", "512M", "2G" (binary multiples) → bytes.
Status parse_bytes(const std::string& s, int64_t* out) {
  if (s.empty()) return Status::invalid_argument("empty byte count");
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  std::string suf(end);
  for (auto& ch : suf) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  double mul = 1;
  if (suf.empty() || suf == "b") mul = 1;
  else if (suf == "k" || suf == "kib" || suf == "kb") mul = 1024.0;
  else if (suf == "m" || suf == "mib" || suf == "mb") mul = 1024.0 * 1024;
  else if (suf == "g" || suf == "gib" || suf == "gb") mul = 1024.0 * 1024 * 1024;
  else return Status::invalid_argument("bad byte count '" + s + "' (use e.g. 512M, 4G)");
  if (!(v >= 0) || end == s.c_str()) return Status::invalid_argument("bad byte count '" + s + "'");
  *out = static_cast<int64_t>(v * mul);
  return Status::ok();
}

Status parse_documents(const std::string& v, const std::string& tokenizer, int32_t* sep) {
  if (v == "packed") {
    *sep = -1;
    return Status::ok();
  }
  if (v != "separate") return Status::invalid_argument("--documents must be 'separate' or 'packed', got '" + v + "'");
  *sep = kDefaultDocumentSeparator;
  if (!tokenizer.empty()) {
    Tokenizer tok;
    LAPLACE_RETURN_IF_ERROR(Tokenizer::load(tokenizer, &tok));
    *sep = document_separator_id(tok);
  }
  return Status::ok();
}

int batch_prefill_value(const std::string& s) {
  if (s == "off") return kBatchPrefillOff;
  if (s == "equal") return kBatchPrefillEqual;
  if (s == "ragged") return kBatchPrefillRagged;
  return -1;  // auto (the option's check admits nothing else)
}

}  // namespace laplace::cli
