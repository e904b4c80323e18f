// Model subcommands: info, init, quantize, forward, generate.
#include <cstdio>
#include <filesystem>
#include <map>

#include "cli/common.h"
#include "core/file_util.h"
#include "core/safetensors.h"
#include "model/config.h"
#include "model/quantize.h"
#include "serve/generate.h"
#include "text/tokenizer.h"

namespace laplace::cli {

namespace {

double bytes_gib(double b) { return b / (1024.0 * 1024.0 * 1024.0); }

Status run_info(const std::string& path) {
  Config c;
  LAPLACE_RETURN_IF_ERROR(config_load(path, &c));
  // Everything below is computed from the shapes alone; no weights are allocated.
  std::printf("model_type=laplace\n");
  std::printf("vocab_size=%lld\nhidden_size=%lld\nnum_layers=%lld\nnum_heads=%lld\n", (long long)c.vocab_size,
              (long long)c.hidden_size, (long long)c.num_layers, (long long)c.num_heads);
  std::printf("head_k_dim=%lld\nhead_v_dim=%lld\nffn_size=%lld\nconv_size=%lld\nchunk_size=%lld\n",
              (long long)c.head_k_dim, (long long)c.head_v_dim, (long long)c.ffn_size, (long long)c.conv_size,
              (long long)c.chunk_size);
  std::printf("body_params=%lld\n", (long long)c.body_params());
  std::printf("total_params=%lld\n", (long long)c.total_params());
  std::printf("state_bytes_per_sequence=%lld\n", (long long)c.state_bytes_per_sequence());
  std::printf("weights_bytes_bf16=%lld\n", (long long)(c.total_params() * 2));
  std::printf("train_flops_per_token=%.6e\n", c.train_flops_per_token());
  std::printf("decays=");
  auto d = c.decays();
  for (size_t h = 0; h < d.size(); ++h) std::printf("%s%.12g", h ? "," : "", d[h]);
  std::printf("\n");
  std::printf("# %.3f B params, %.2f GiB in bf16, %.2f MB of state per sequence at any context length\n",
              c.total_params() / 1e9, bytes_gib(2.0 * c.total_params()), c.state_bytes_per_sequence() / 1e6);
  return Status::ok();
}

Status run_init(const std::string& config_path, uint64_t seed, const std::string& out_dir) {
  Config c;
  LAPLACE_RETURN_IF_ERROR(config_load(config_path, &c));
  std::unique_ptr<Backend> be = make_cpu_backend();
  Model m;
  LAPLACE_RETURN_IF_ERROR(m.create(c, *be, DType::kF32));
  m.init_weights(seed);
  std::error_code ec;
  std::filesystem::create_directories(out_dir, ec);
  if (ec) return Status::io_error("cannot create " + out_dir + ": " + ec.message());
  const std::string cfg_text = c.to_json();
  LAPLACE_RETURN_IF_ERROR(write_file_atomic(out_dir + "/config.json", cfg_text.data(), cfg_text.size()));
  LAPLACE_RETURN_IF_ERROR(m.save(out_dir + "/model.safetensors"));
  std::printf("wrote %s/config.json and %s/model.safetensors (%lld parameters, seed %llu)\n", out_dir.c_str(),
              out_dir.c_str(), (long long)c.total_params(), (unsigned long long)seed);
  return Status::ok();
}

Status run_forward(const ModelArgs& a, const std::string& tokens, const std::string& out_path) {
  std::vector<std::vector<int32_t>> rows;
  LAPLACE_RETURN_IF_ERROR(parse_id_rows(tokens, &rows));
  const int64_t B = static_cast<int64_t>(rows.size()), T = static_cast<int64_t>(rows[0].size());
  for (const auto& r : rows)
    if (static_cast<int64_t>(r.size()) != T) return Status::invalid_argument("all sequences must have one length");
  LoadedModel lm;
  LAPLACE_RETURN_IF_ERROR(load_model(a, &lm));
  const Config& c = lm.model.config();
  std::vector<int32_t> flat, targets;
  for (const auto& r : rows) {
    for (int64_t t = 0; t < T; ++t) {
      if (r[t] >= c.vocab_size) return Status::invalid_argument("token id " + std::to_string(r[t]) + " ≥ vocab_size");
      flat.push_back(r[t]);
      targets.push_back(t + 1 < T ? r[t + 1] : -1);
    }
  }
  LAPLACE_RETURN_IF_ERROR(lm.model.plan({B, T, false, false}));
  lm.model.forward(flat.data(), B, T, ForwardOptions{});
  // Stage the logits on the host in the model's dtype.
  Tensor lg = lm.model.logits();
  std::vector<char> host(lg.nbytes());
  Tensor h(host.data(), lg.dtype, {B, T, c.vocab_size});
  lm.backend->copy(h.reshape({B * T, c.vocab_size}), lg);
  lm.backend->synchronize();
  const double loss = T > 1 ? lm.model.loss(targets.data()) : 0.0;
  std::printf("loss=%.9g\n", loss);
  if (!out_path.empty()) {
    std::map<std::string, std::string> meta = {{"format", "pt"}, {"loss", std::to_string(loss)}};
    LAPLACE_RETURN_IF_ERROR(safetensors_write(out_path, {{"logits", h}}, meta));
  }
  return Status::ok();
}

struct GenerateArgs {
  ModelArgs model;
  std::string prompt_ids;
  std::string prompt;
  int64_t max_tokens = 64;
  double temperature = 0.0;
  int64_t top_k = 0;
  double top_p = 1.0;
  double min_p = 0.0;
  uint64_t seed = 0;
  int64_t prefill_chunk = 512;
};

Status run_generate(const GenerateArgs& g);

}  // namespace

void add_info(CLI::App& app) {
  auto* cmd = app.add_subcommand("info", "print a config's sizes (parameters, state bytes) without allocating");
  auto path = std::make_shared<std::string>();
  cmd->add_option("--config", *path, "config.json")->required();
  cmd->callback([path] { g_exit_code = report(run_info(*path)); });
}

void add_init(CLI::App& app) {
  auto* cmd = app.add_subcommand("init", "write a freshly initialised model directory");
  struct A { std::string config, out; uint64_t seed = 1234; };
  auto a = std::make_shared<A>();
  cmd->add_option("--config", a->config, "config.json")->required();
  cmd->add_option("--out", a->out, "output directory")->required();
  cmd->add_option("--seed", a->seed, "initialisation seed");
  cmd->callback([a] { g_exit_code = report(run_init(a->config, a->seed, a->out)); });
}

void add_quantize(CLI::App& app) {
  auto* cmd = app.add_subcommand("quantize", "write a model directory with FP8 E4M3 body matrices and per-row "
                                             "scales (model/quantize.h), or F32 weights back from one");
  struct A { std::string model, out; bool dequantize = false; };
  auto a = std::make_shared<A>();
  cmd->add_option("--model", a->model, "model directory (config.json, model.safetensors)")->required();
  cmd->add_option("--out", a->out, "output directory")->required();
  cmd->add_flag("--dequantize", a->dequantize, "from an FP8 directory, F32 weights equal to its FP8 values × scales");
  cmd->callback([a] { g_exit_code = report(quantize_model_dir(a->model, a->out, a->dequantize, false)); });
}

void add_forward(CLI::App& app) {
  auto* cmd = app.add_subcommand("forward", "logits and loss of token sequences (\"1,2,3;4,5,6\")");
  struct A { ModelArgs m; std::string tokens, out; };
  auto a = std::make_shared<A>();
  a->m.add_to(cmd);
  cmd->add_option("--tokens", a->tokens, "sequences of ids, ';' between sequences")->required();
  cmd->add_option("--out", a->out, "write the logits [B,T,V] to this .safetensors");
  cmd->callback([a] { g_exit_code = report(run_forward(a->m, a->tokens, a->out)); });
}

void add_generate(CLI::App& app) {
  auto* cmd = app.add_subcommand("generate", "continue a prompt (greedy or sampled)");
  auto a = std::make_shared<GenerateArgs>();
  a->model.add_to(cmd);
  cmd->add_option("--prompt-ids", a->prompt_ids, "prompt as token ids, e.g. 1,2,3");
  cmd->add_option("--prompt", a->prompt, "prompt as text (needs a tokenizer)");
  cmd->add_option("--max-tokens", a->max_tokens, "tokens to generate")->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--temperature", a->temperature, "0 = greedy")->check(CLI::Range(0.0, 100.0));
  cmd->add_option("--top-k", a->top_k, "keep the k most likely tokens (0 = off)")->check(CLI::NonNegativeNumber);
  cmd->add_option("--top-p", a->top_p, "nucleus sampling mass (1 = off)")->check(CLI::Range(0.0, 1.0));
  cmd->add_option("--min-p", a->min_p, "min-p filter (0 = off)")->check(CLI::Range(0.0, 1.0));
  cmd->add_option("--seed", a->seed, "sampling seed");
  cmd->add_option("--prefill-chunk", a->prefill_chunk, "tokens per prefill forward")->check(CLI::Range(1, 1 << 20));
  cmd->callback([a] { g_exit_code = report(run_generate(*a)); });
}

namespace {

Status run_generate(const GenerateArgs& g) {
  if (g.prompt_ids.empty() == g.prompt.empty())
    return Status::invalid_argument("give exactly one of --prompt-ids or --prompt");
  LoadedModel lm;
  LAPLACE_RETURN_IF_ERROR(load_model(g.model, &lm));
  ModelArgs paths = g.model;
  LAPLACE_RETURN_IF_ERROR(paths.resolve());
  Tokenizer tok;
  if (!paths.tokenizer.empty()) LAPLACE_RETURN_IF_ERROR(Tokenizer::load(paths.tokenizer, &tok));
  std::vector<int32_t> prompt;
  if (!g.prompt_ids.empty()) {
    LAPLACE_RETURN_IF_ERROR(parse_ids(g.prompt_ids, &prompt));
  } else {
    if (!tok.is_loaded()) return Status::invalid_argument("--prompt needs a tokenizer (--tokenizer or --model DIR)");
    LAPLACE_RETURN_IF_ERROR(tok.encode(g.prompt, &prompt));
    if (prompt.empty()) return Status::invalid_argument("the prompt encodes to no tokens");
  }
  const Config& c = lm.model.config();
  for (int32_t t : prompt)
    if (t >= c.vocab_size) return Status::invalid_argument("prompt token id " + std::to_string(t) + " ≥ vocab_size");
  LAPLACE_RETURN_IF_ERROR(lm.model.plan({1, g.prefill_chunk, false, false}));
  StatePool pool;
  // The state is F32 (docs/model.md §5) except for an F64 model, whose verification runs keep it in F64.
  const DType state_dtype = lm.model.dtype() == DType::kF64 ? DType::kF64 : DType::kF32;
  LAPLACE_RETURN_IF_ERROR(pool.create(c, *lm.backend, 1, state_dtype));
  GenerateOptions opt;
  opt.max_tokens = g.max_tokens;
  opt.sampling.temperature = g.temperature;
  opt.sampling.top_k = g.top_k;
  opt.sampling.top_p = g.top_p;
  opt.sampling.min_p = g.min_p;
  opt.sampling.seed = g.seed;
  if (c.eos_token_id >= 0) opt.stop_ids.push_back(static_cast<int32_t>(c.eos_token_id));
  std::vector<int32_t> out = generate(lm.model, pool, 0, prompt, opt);
  std::string line;
  for (size_t i = 0; i < out.size(); ++i) line += (i ? "," : "") + std::to_string(out[i]);
  std::printf("ids=%s\n", line.c_str());
  if (tok.is_loaded()) {
    std::string text, prompt_text;
    LAPLACE_RETURN_IF_ERROR(tok.decode(out, &text));
    LAPLACE_RETURN_IF_ERROR(tok.decode(prompt, &prompt_text));
    std::printf("text=%s\n", (prompt_text + text).c_str());
  }
  return Status::ok();
}

}  // namespace

}  // namespace laplace::cli
