// `laplace eval copy | passkey | position | serving`: the quality evaluations of a trained
// model on held-out text (eval/recall.h, eval/context.h, eval/serving.h, docs/quality.md).
//
//   laplace eval copy     --model DIR --data VAL [--m 16,64,256] [--d 0,1024,4096,16384,65536]
//   laplace eval passkey  --model DIR --data VAL [--contexts 1024,4096,16384,65536] [--depths 0,0.25,0.5,0.75,1]
//   laplace eval position --model DIR --data VAL [--context 131072] [--streams 1]
//                         [--documents [--min-doc-tokens N]]   (whole documents, each from a zero state)
//   laplace eval serving  --model DIR --data VAL [--options defer4,defer8,defer16,bf16-weights,bf16-states]
//   common: [--device cpu|cuda] [--dtype f32|f64|bf16] [--seed S] [--out DIR] [--results FILE --tag T]
//
// stdout: one table row per grid point as it finishes; --out DIR writes DIR/<mode>.jsonl;
// --results appends the recorded figures (bench/results.jsonl form).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "bench/bench_log.h"
#include "cli/common.h"
#include "eval/context.h"
#include "eval/recall.h"
#include "eval/serving.h"
#include "model/quantize.h"
#include "eval/stream.h"

namespace laplace::cli {

namespace {

struct QualityArgs {
  ModelArgs model;
  std::vector<std::string> data;
  std::string out, results, tag;
  uint64_t seed = 1;
};

// The model, its held-out tokens and the outputs every mode opens before its long run, so a
// bad path or a mismatch fails at once.
struct QualityRun {
  LoadedModel lm;
  std::vector<int32_t> heldout;
  std::ofstream jsonl;
  std::string jsonl_path;
  BenchLog res;
  struct Figure {
    std::string name, unit, note;
    double value;
  };
  std::vector<Figure> figures;  // written after the table (BenchLog prints each line too)
  void record(const std::string& name, double value, const std::string& unit, const std::string& note) {
    if (!res.path.empty()) figures.push_back({name, unit, note, value});
  }
};

Status open_run(const QualityArgs& a, const std::string& mode, QualityRun* r) {
  ModelArgs m = a.model;
  LAPLACE_RETURN_IF_ERROR(m.resolve());
  if (m.ckpt.empty())
    return Status::invalid_argument("eval " + mode + " needs trained weights: " +
                                    (m.dir.empty() ? "pass --ckpt" : m.dir + " has no model.safetensors"));
  LAPLACE_RETURN_IF_ERROR(load_model(m, &r->lm));
  LAPLACE_RETURN_IF_ERROR(load_heldout_tokens(a.data, r->lm.model.config().vocab_size, &r->heldout));
  if (!a.out.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(a.out, ec);
    if (ec) return Status::io_error("cannot create " + a.out + ": " + ec.message());
    r->jsonl_path = a.out + "/" + mode + ".jsonl";
    r->jsonl.open(r->jsonl_path, std::ios::trunc);
    if (!r->jsonl) return Status::io_error("cannot write " + r->jsonl_path);
  }
  r->res = BenchLog{a.results, "", "", "", a.tag, "", BenchLog::command_line()};
  if (!a.results.empty()) {
    r->res.device = device_description(a.model.device);
    r->res.commit = BenchLog::commit_hash();
    r->res.date = BenchLog::iso_date_utc();
  }
  return Status::ok();
}

Status close_run(QualityRun* r, const Status& st) {
  // Also the points finished before an error.
  for (const QualityRun::Figure& f : r->figures) r->res.add(f.name, f.value, f.unit, f.note);
  if (r->jsonl.is_open()) {
    r->jsonl.close();
    if (!r->jsonl && st.is_ok()) return Status::io_error("cannot write " + r->jsonl_path);
  }
  return st;
}

void emit(QualityRun* r, const nlohmann::json& j) {
  if (!r->jsonl.is_open()) return;
  r->jsonl << j.dump() << "\n";
  r->jsonl.flush();
}

std::string model_note(const QualityArgs& a, const QualityRun& r) {
  const Config& c = r.lm.model.config();
  char buf[256];
  std::snprintf(buf, sizeof buf, "V%lld D%lld L%lld H%lld dk%lld dv%lld, %s %s, %zu held-out tokens, seed %llu",
                (long long)c.vocab_size, (long long)c.hidden_size, (long long)c.num_layers, (long long)c.num_heads,
                (long long)c.head_k_dim, (long long)c.head_v_dim, a.model.device.c_str(), a.model.dtype.c_str(),
                r.heldout.size(), (unsigned long long)a.seed);
  return buf;
}

void add_common(CLI::App* cmd, QualityArgs* a) {
  a->model.add_to(cmd);
  cmd->add_option("--data", a->data, "held-out token shards (paths or globs)")->required();
  cmd->add_option("--seed", a->seed, "seed of the trials")->capture_default_str();
  cmd->add_option("--out", a->out, "write DIR/<mode>.jsonl (one JSON line per point)");
  cmd->add_option("--results", a->results, "append the figures to FILE (bench/results.jsonl form)");
  cmd->add_option("--tag", a->tag, "appended to every --results name as _TAG");
}

// ---- copy ----------------------------------------------------------------------------------

struct CopyArgs : QualityArgs {
  std::string ms = "16,64,256", ds = "0,1024,4096,16384,65536";
  RecallOptions o;
};

Status run_copy(CopyArgs& a) {
  std::vector<int64_t> ms, ds;
  LAPLACE_RETURN_IF_ERROR(parse_number_list(a.ms, "--m", &ms));
  LAPLACE_RETURN_IF_ERROR(parse_number_list(a.ds, "--d", &ds));
  a.o.seed = a.seed;
  QualityRun r;
  LAPLACE_RETURN_IF_ERROR(open_run(a, "copy", &r));
  const std::string note = "laplace eval copy: " + model_note(a, r) + ", " + std::to_string(a.o.trials) + " trials";
  std::printf("%8s %8s %8s %12s %10s\n", "m", "d", "trials", "predictions", "accuracy");
  const Status st = eval_copy(r.lm.model, r.heldout, ms, ds, a.o, [&](const CopyResult& c) {
    std::printf("%8lld %8lld %8lld %12lld %10.4f\n", (long long)c.m, (long long)c.d, (long long)c.trials,
                (long long)c.predictions, c.accuracy());
    std::fflush(stdout);
    emit(&r, {{"mode", "copy"}, {"m", c.m}, {"d", c.d}, {"trials", c.trials}, {"predictions", c.predictions},
              {"correct", c.correct}, {"accuracy", c.accuracy()}});
    r.record("recall_copy_acc_m" + std::to_string(c.m) + "_d" + std::to_string(c.d), c.accuracy(), "fraction", note);
  });
  return close_run(&r, st);
}

// ---- passkey -------------------------------------------------------------------------------

struct PasskeyArgs : QualityArgs {
  std::string contexts = "1024,4096,16384,65536", depths = "0,0.25,0.5,0.75,1";
  RecallOptions o;
};

Status run_passkey(PasskeyArgs& a) {
  std::vector<int64_t> ls;
  std::vector<double> ps;
  LAPLACE_RETURN_IF_ERROR(parse_number_list(a.contexts, "--contexts", &ls));
  LAPLACE_RETURN_IF_ERROR(parse_number_list(a.depths, "--depths", &ps));
  a.o.seed = a.seed;
  QualityRun r;
  LAPLACE_RETURN_IF_ERROR(open_run(a, "passkey", &r));
  ModelArgs m = a.model;
  LAPLACE_RETURN_IF_ERROR(m.resolve());
  if (m.tokenizer.empty()) return Status::invalid_argument("eval passkey needs the model's tokenizer (--tokenizer)");
  Tokenizer tok;
  LAPLACE_RETURN_IF_ERROR(Tokenizer::load(m.tokenizer, &tok));
  const std::string note = "laplace eval passkey: " + model_note(a, r) + ", " + std::to_string(a.o.trials) + " trials";
  std::printf("%8s %8s %8s %8s %10s\n", "context", "depth", "trials", "found", "accuracy");
  const Status st = eval_passkey(r.lm.model, tok, r.heldout, ls, ps, a.o, [&](const PasskeyResult& p) {
    std::printf("%8lld %8.3f %8lld %8lld %10.4f\n", (long long)p.context, p.depth, (long long)p.trials,
                (long long)p.found, p.accuracy());
    std::fflush(stdout);
    emit(&r, {{"mode", "passkey"}, {"context", p.context}, {"depth", p.depth}, {"trials", p.trials},
              {"found", p.found}, {"accuracy", p.accuracy()}});
    r.record("recall_passkey_acc_l" + std::to_string(p.context) + "_p" + std::to_string(std::lround(p.depth * 100)),
                p.accuracy(), "fraction", note);
  });
  return close_run(&r, st);
}

// ---- position ------------------------------------------------------------------------------

struct PositionArgs : QualityArgs {
  PositionLossOptions o;
  bool documents = false;
  int64_t min_doc_tokens = 1;
};

// --documents: every held-out document alone from the zero state (eval/context.h), figures longdoc_*.
Status run_documents(PositionArgs& a) {
  QualityRun r;
  LAPLACE_RETURN_IF_ERROR(open_run(a, "longdoc", &r));
  DocumentLossOptions o;
  o.context = a.o.context;
  o.min_tokens = a.min_doc_tokens;
  o.streams = a.o.streams;
  o.piece = a.o.piece;
  o.first_bucket = a.o.first_bucket;
  // The note names the documents once they are counted; the figures are recorded after the run.
  std::vector<PositionBucket> got;
  DocumentLossSummary sum;
  const Status st = eval_document_position_loss(r.lm.model, r.heldout, o, [&](const PositionBucket& b) {
    got.push_back(b);
  }, &sum);
  if (!st.is_ok()) return close_run(&r, st);
  const std::string note = "laplace eval position --documents: " + model_note(a, r) + ", " +
                           std::to_string(sum.scored) + " of " + std::to_string(sum.documents) +
                           " documents of at least " + std::to_string(o.min_tokens) + " tokens, each from a zero "
                           "state, scored to " + std::to_string(o.context) + " tokens";
  std::printf("%lld of %lld documents of at least %lld tokens (the longest %lld), %lld positions scored to at most "
              "%lld per document\n",
              (long long)sum.scored, (long long)sum.documents, (long long)o.min_tokens, (long long)sum.longest,
              (long long)sum.scored_tokens, (long long)o.context);
  std::printf("%10s %10s %10s %10s %14s\n", "from", "to", "tokens", "loss", "memory MiB");
  int64_t mem_lo = -1, mem_hi = 0;
  for (const PositionBucket& b : got) {
    std::printf("%10lld %10lld %10lld %10.4f %14.1f\n", (long long)b.begin, (long long)b.end, (long long)b.count,
                b.mean_loss(), static_cast<double>(b.memory_bytes) / (1 << 20));
    emit(&r, {{"mode", "longdoc"}, {"begin", b.begin}, {"end", b.end}, {"tokens", b.count}, {"loss", b.mean_loss()},
              {"memory_bytes", b.memory_bytes}, {"documents", sum.scored}, {"min_doc_tokens", o.min_tokens}});
    r.record("longdoc_loss_" + std::to_string(b.begin) + "_" + std::to_string(b.end), b.mean_loss(), "nats", note);
    mem_lo = mem_lo < 0 ? b.memory_bytes : std::min(mem_lo, b.memory_bytes);
    mem_hi = std::max(mem_hi, b.memory_bytes);
  }
  std::printf("memory from the first bucket to the last: %.1f MiB to %.1f MiB (spread %.1f MiB)\n",
              static_cast<double>(mem_lo) / (1 << 20), static_cast<double>(mem_hi) / (1 << 20),
              static_cast<double>(mem_hi - mem_lo) / (1 << 20));
  std::fflush(stdout);
  r.record("longdoc_documents", static_cast<double>(sum.scored), "documents", note);
  r.record("longdoc_memory_spread_mib", static_cast<double>(mem_hi - mem_lo) / (1 << 20), "MiB", note);
  return close_run(&r, st);
}

Status run_position(PositionArgs& a) {
  if (a.documents) return run_documents(a);
  if (a.min_doc_tokens != 1) return Status::invalid_argument("--min-doc-tokens goes with --documents");
  a.o.seed = a.seed;
  QualityRun r;
  LAPLACE_RETURN_IF_ERROR(open_run(a, "position", &r));
  const std::string note = "laplace eval position: " + model_note(a, r) + ", " + std::to_string(a.o.streams) +
                           " streams of " + std::to_string(a.o.context) + " tokens";
  std::printf("%10s %10s %10s %10s %14s\n", "from", "to", "tokens", "loss", "memory MiB");
  int64_t mem_lo = -1, mem_hi = 0;
  const Status st = eval_position_loss(r.lm.model, r.heldout, a.o, [&](const PositionBucket& b) {
    std::printf("%10lld %10lld %10lld %10.4f %14.1f\n", (long long)b.begin, (long long)b.end, (long long)b.count,
                b.mean_loss(), static_cast<double>(b.memory_bytes) / (1 << 20));
    std::fflush(stdout);
    emit(&r, {{"mode", "position"}, {"begin", b.begin}, {"end", b.end}, {"tokens", b.count},
              {"loss", b.mean_loss()}, {"memory_bytes", b.memory_bytes}});
    r.record("position_loss_" + std::to_string(b.begin) + "_" + std::to_string(b.end), b.mean_loss(), "nats", note);
    mem_lo = mem_lo < 0 ? b.memory_bytes : std::min(mem_lo, b.memory_bytes);
    mem_hi = std::max(mem_hi, b.memory_bytes);
  });
  if (st.is_ok()) {
    std::printf("memory from the first bucket to the last: %.1f MiB to %.1f MiB (spread %.1f MiB)\n",
                static_cast<double>(mem_lo) / (1 << 20), static_cast<double>(mem_hi) / (1 << 20),
                static_cast<double>(mem_hi - mem_lo) / (1 << 20));
    r.record("position_memory_spread_mib", static_cast<double>(mem_hi - mem_lo) / (1 << 20), "MiB", note);
  }
  return close_run(&r, st);
}

// ---- serving -------------------------------------------------------------------------------

struct ServingArgs : QualityArgs {
  std::string options = "defer4,defer8,defer16";
  ServingOptionsRun run;
};

Status run_serving(ServingArgs& a) {
  std::vector<ServingOption> opts;
  LAPLACE_RETURN_IF_ERROR(parse_serving_options(a.options, &opts));
  a.run.seed = a.seed;
  bool need_low = false;
  for (const ServingOption& o : opts) need_low |= o.low_weights;
  if (need_low && a.model.device != "cuda")
    return Status::invalid_argument("the bf16 serving options run on --device cuda (the CPU backend has no bf16 model)");
  if (need_low && a.model.dtype != "f32")
    return Status::invalid_argument("the bf16 options compare against f32 weights: use --dtype f32");
  QualityRun r;
  LAPLACE_RETURN_IF_ERROR(open_run(a, "serving", &r));
  LoadedModel low, fp8, fp8c;
  const bool need_fp8 = std::any_of(opts.begin(), opts.end(), [](const ServingOption& o) { return o.fp8_weights; });
  const bool need_fp8c = std::any_of(opts.begin(), opts.end(), [](const ServingOption& o) { return o.fp8_compute; });
  if (need_low) {
    ModelArgs m = a.model;
    m.dtype = "bf16";
    LAPLACE_RETURN_IF_ERROR(load_model(m, &low));
  }
  if (need_fp8) {
    LAPLACE_RETURN_IF_ERROR(load_model(a.model, &fp8));
    LAPLACE_RETURN_IF_ERROR(fp8_round_body_matrices(fp8.model));
  }
  if (need_fp8c) {
    ModelArgs m = a.model;
    m.weights = "fp8";
    LAPLACE_RETURN_IF_ERROR(load_model(m, &fp8c));
  }
  const std::string note = "laplace eval serving: " + model_note(a, r) + ", " + std::to_string(a.run.prompts) +
                           " prompts of " + std::to_string(a.run.prompt_len) + " tokens, " +
                           std::to_string(a.run.steps) + " teacher-forced decode steps";
  std::printf("%-14s %10s %10s %12s %10s %12s %12s\n", "option", "ref loss", "loss", "delta loss", "agree %",
              "logit err", "max err");
  const Status st = eval_serving_options(
      r.lm.model, need_low ? &low.model : nullptr, need_fp8 ? &fp8.model : nullptr, need_fp8c ? &fp8c.model : nullptr,
      r.heldout, opts, a.run,
      [&](const ServingAccuracy& s) {
        std::printf("%-14s %10.5f %10.5f %12.3e %10.3f %12.3e %12.3e\n", s.option.c_str(), s.ref_loss, s.option_loss,
                    s.delta_loss(), 100 * s.agreement, s.logit_relrms_mean, s.logit_relrms_max);
        std::fflush(stdout);
        emit(&r, {{"mode", "serving"}, {"option", s.option}, {"positions", s.positions}, {"ref_loss", s.ref_loss},
                  {"loss", s.option_loss}, {"delta_loss", s.delta_loss()}, {"agreement", s.agreement},
                  {"logit_relrms_mean", s.logit_relrms_mean}, {"logit_relrms_max", s.logit_relrms_max},
                  {"first_disagreement", s.first_disagreement}});
        std::string n = s.option;
        for (char& ch : n)
          if (ch == '-') ch = '_';
        r.record("serving_" + n + "_delta_loss", s.delta_loss(), "nats", note);
        r.record("serving_" + n + "_agreement_pct", 100 * s.agreement, "%", note);
        r.record("serving_" + n + "_logit_relrms", s.logit_relrms_mean, "ratio", note);
      });
  return close_run(&r, st);
}

void add_recall_options(CLI::App* cmd, RecallOptions* o) {
  cmd->add_option("--trials", o->trials, "trials per point (rounded up to a multiple of --batch)")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  cmd->add_option("--batch", o->batch, "trials run side by side")->check(CLI::Range(1, 4096))->capture_default_str();
  cmd->add_option("--piece", o->piece, "tokens per forward while feeding the context")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
}

}  // namespace

void add_eval_quality(CLI::App* eval) {
  {
    auto* cmd = eval->add_subcommand("copy", "recall at distance: a random string, d tokens of held-out text, the "
                                             "string again; accuracy of the second copy");
    auto a = std::make_shared<CopyArgs>();
    add_common(cmd, a.get());
    cmd->add_option("--m", a->ms, "comma-separated string lengths")->capture_default_str();
    cmd->add_option("--d", a->ds, "comma-separated distances (held-out tokens between the copies)")
        ->capture_default_str();
    add_recall_options(cmd, &a->o);
    cmd->callback([a] { g_exit_code = report(run_copy(*a)); });
  }
  {
    auto* cmd = eval->add_subcommand("passkey", "a pass key hidden in held-out text at a depth; is it recalled?");
    auto a = std::make_shared<PasskeyArgs>();
    add_common(cmd, a.get());
    cmd->add_option("--contexts", a->contexts, "comma-separated context lengths (tokens before the key)")
        ->capture_default_str();
    cmd->add_option("--depths", a->depths, "comma-separated needle depths in [0, 1]")->capture_default_str();
    add_recall_options(cmd, &a->o);
    a->o.trials = 16;
    a->o.batch = 4;
    cmd->callback([a] { g_exit_code = report(run_passkey(*a)); });
  }
  {
    auto* cmd = eval->add_subcommand("position", "held-out loss by position up to long contexts, and the memory held");
    auto a = std::make_shared<PositionArgs>();
    add_common(cmd, a.get());
    cmd->add_option("--context", a->o.context, "positions per stream (with --documents: per document, at most)")
        ->check(CLI::Range(2, 1 << 26))
        ->capture_default_str();
    cmd->add_option("--streams", a->o.streams, "streams run side by side")->check(CLI::Range(1, 4096))->capture_default_str();
    cmd->add_option("--piece", a->o.piece, "tokens per forward (a power of two)")->capture_default_str();
    cmd->add_option("--first-bucket", a->o.first_bucket, "the first bucket's width (a power of two); each next "
                                                            "bucket doubles")
        ->capture_default_str();
    cmd->add_flag("--documents", a->documents, "score every held-out document alone, from a zero state, to its end "
                                               "(or --context): documents are the tokens after each separator (id 2)");
    cmd->add_option("--min-doc-tokens", a->min_doc_tokens, "with --documents: only documents of at least N tokens")
        ->check(CLI::Range(int64_t{1}, int64_t{1} << 40))
        ->capture_default_str();
    cmd->callback([a] { g_exit_code = report(run_position(*a)); });
  }
  {
    auto* cmd = eval->add_subcommand("serving", "what bf16 weights, bf16 states and deferred write-back cost: Δ loss, "
                                                "greedy agreement and logit error against the reference");
    auto a = std::make_shared<ServingArgs>();
    add_common(cmd, a.get());
    cmd->add_option("--options", a->options,
                    "comma-separated: defer4, defer8, defer16, bf16-weights, bf16-states, fp8-weights, fp8, fp8-fast, "
                    "fp8-head, fp8-fast-head")
        ->capture_default_str();
    cmd->add_option("--prompts", a->run.prompts, "held-out prompts")->check(CLI::Range(1, 4096))->capture_default_str();
    cmd->add_option("--prompt-len", a->run.prompt_len, "tokens per prompt")->check(CLI::Range(1, 1 << 20))->capture_default_str();
    cmd->add_option("--steps", a->run.steps, "decode steps per prompt")->check(CLI::Range(1, 1 << 20))->capture_default_str();
    cmd->callback([a] { g_exit_code = report(run_serving(*a)); });
  }
}

}  // namespace laplace::cli
