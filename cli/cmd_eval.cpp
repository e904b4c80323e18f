// `laplace eval`: loss and perplexity of a model over token shards or a text file. Its modes
// (`eval mqar`, `eval copy | passkey | position | serving`) are in cmd_mqar.cpp and
// cmd_eval_quality.cpp.
#include <cmath>
#include <cstdio>

#include "cli/common.h"
#include "core/file_util.h"
#include "text/data_loader.h"
#include "text/prepare.h"
#include "text/tokenizer.h"

namespace laplace::cli {

namespace {

struct EvalArgs {
  ModelArgs m;
  std::vector<std::string> data;
  std::string text;  // a text file instead of shards
  int64_t batch = 4, seq = 256, max_batches = 0;
  std::string documents = "separate";
};

// Loss over a text file: encoded with the model's tokenizer, a separator before it
// (as data prepare does), cut into windows of seq+1 tokens with stride seq.
Status eval_text(LoadedModel& lm, const EvalArgs& a, const ForwardOptions& fo, double* loss, int64_t* tokens) {
  ModelArgs paths = a.m;
  LAPLACE_RETURN_IF_ERROR(paths.resolve());
  if (paths.tokenizer.empty()) return Status::invalid_argument("--text needs a tokenizer (--tokenizer or --model DIR)");
  Tokenizer tok;
  LAPLACE_RETURN_IF_ERROR(Tokenizer::load(paths.tokenizer, &tok));
  std::string text;
  LAPLACE_RETURN_IF_ERROR(read_file(a.text, &text));
  std::vector<int32_t> ids = {document_separator_id(tok)};
  std::vector<int32_t> body;
  LAPLACE_RETURN_IF_ERROR(tok.encode(text, &body));
  ids.insert(ids.end(), body.begin(), body.end());
  const int64_t T = a.seq;
  const int64_t windows = (static_cast<int64_t>(ids.size()) - 1) / T;
  if (windows < 1) return Status::invalid_argument(a.text + " encodes to fewer than seq+1 tokens; lower --seq");
  LAPLACE_RETURN_IF_ERROR(lm.model.plan({1, T, false, false}));
  std::vector<int32_t> x(T), y(T);
  double sum = 0;
  for (int64_t w = 0; w < windows; ++w) {
    std::copy(ids.begin() + w * T, ids.begin() + w * T + T, x.begin());
    std::copy(ids.begin() + w * T + 1, ids.begin() + w * T + T + 1, y.begin());
    lm.model.forward(x.data(), 1, T, fo);
    sum += lm.model.loss(y.data());
  }
  *loss = sum / static_cast<double>(windows);
  *tokens = windows * T;
  return Status::ok();
}

Status run_eval(const EvalArgs& a) {
  LoadedModel lm;
  LAPLACE_RETURN_IF_ERROR(load_model(a.m, &lm));
  ModelArgs paths = a.m;
  LAPLACE_RETURN_IF_ERROR(paths.resolve());
  ForwardOptions fo;
  LAPLACE_RETURN_IF_ERROR(parse_documents(a.documents, paths.tokenizer, &fo.document_separator));
  if (a.data.empty() == a.text.empty()) return Status::invalid_argument("give exactly one of --data or --text");
  if (!a.text.empty()) {
    double loss = 0;
    int64_t tokens = 0;
    LAPLACE_RETURN_IF_ERROR(eval_text(lm, a, fo, &loss, &tokens));
    std::printf("tokens=%lld\nloss=%.6f\nperplexity=%.4f\n", (long long)tokens, loss, std::exp(loss));
    return Status::ok();
  }
  const Config& c = lm.model.config();
  DataLoaderOptions dl;
  LAPLACE_RETURN_IF_ERROR(expand_shard_patterns(a.data, &dl.shards));
  dl.batch_size = a.batch;
  dl.seq_len = a.seq;
  dl.vocab_size = c.vocab_size;
  DataLoader loader;
  LAPLACE_RETURN_IF_ERROR(DataLoader::open(dl, &loader));
  int64_t n = loader.batches_per_epoch();
  if (a.max_batches > 0) n = std::min(n, a.max_batches);
  if (n < 1) return Status::invalid_argument("the data holds fewer than batch·seq+1 tokens");
  LAPLACE_RETURN_IF_ERROR(lm.model.plan({a.batch, a.seq, false, false}));
  std::vector<int32_t> x(a.batch * a.seq), y(a.batch * a.seq);
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) {
    loader.next(x.data(), y.data());
    lm.model.forward(x.data(), a.batch, a.seq, fo);
    sum += lm.model.loss(y.data());
  }
  const double loss = sum / static_cast<double>(n);
  std::printf("batches=%lld\ntokens=%lld\nloss=%.6f\nperplexity=%.4f\n", (long long)n,
              (long long)(n * a.batch * a.seq), loss, std::exp(loss));
  return Status::ok();
}

}  // namespace

void add_eval(CLI::App& app) {
  auto* cmd = app.add_subcommand("eval", "loss and perplexity over token shards");
  auto a = std::make_shared<EvalArgs>();
  a->m.add_to(cmd);
  cmd->add_option("--data", a->data, "token shards (paths or globs)");
  cmd->add_option("--text", a->text, "a text file, encoded with the model's tokenizer");
  cmd->add_option("--batch", a->batch, "sequences per batch")->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--seq", a->seq, "tokens per sequence")->check(CLI::Range(1, 1 << 24));
  cmd->add_option("--max-batches", a->max_batches, "stop after N batches (0 = one pass)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--documents", a->documents,
                  "separate: each document of a window from a zero state (as served); packed: one stream")
      ->capture_default_str();
  add_eval_mqar(cmd);
  add_eval_quality(cmd);
  cmd->callback([a, cmd] {
    if (!cmd->get_subcommands().empty()) return;  // a mode (`eval mqar`, `eval copy`, …) ran instead
    g_exit_code = report(run_eval(*a));
  });
}

}  // namespace laplace::cli
