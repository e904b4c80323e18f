// `laplace eval mqar`: multi-query associative recall (eval/mqar.h) over a grid of state
// sizes, pair counts and sequence lengths; one small model trained per point.
//
//   laplace eval mqar --state-sizes 2x16x32,4x32x64 --pairs 4,8,16 --seq-lens 64,128
//                     [--vocab 8192 --dim 128 --layers 2 --ffn 0 --chunk 64 --power-a 0.01]
//                     [--steps 1000 --batch 32 --lr 3e-3 --wd 0.1 --warmup -1 --seed 1]
//                     [--train-examples 0 --eval-examples 1000 --eval-batch 0]
//                     [--device cpu|cuda --dtype f32|f64|bf16]
//                     [--out DIR (DIR/mqar.jsonl)] [--results FILE (mqar_acc_* lines)] [--tag T]
//                     [--work-dir DIR --keep-work] [--quiet]
//
// stdout: a table (state, state bytes per sequence, pairs, seq, training loss, accuracy,
// chance); stderr: progress. Combinations whose pairs do not fit the sequence (seq < 4·pairs)
// are skipped with a line on stderr; a grid where none fits is an error.
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <vector>

#include "cli/common.h"
#include "bench/bench_log.h"
#include "eval/mqar.h"

namespace laplace::cli {

namespace {

struct MqarArgs {
  MqarOptions o;
  std::string pairs = "4", seq_lens = "64", states = "2x16x32";
  std::string dtype = "f32", train_on = "answers";
  std::string out, results, tag;
};

Status run_mqar(MqarArgs& a) {
  LAPLACE_RETURN_IF_ERROR(mqar_parse_int_list(a.pairs, "--pairs", 1, 16384, &a.o.pairs));
  LAPLACE_RETURN_IF_ERROR(mqar_parse_int_list(a.seq_lens, "--seq-lens", 4, 1 << 16, &a.o.seq_lens));
  LAPLACE_RETURN_IF_ERROR(mqar_parse_state_sizes(a.states, &a.o.states));
  LAPLACE_RETURN_IF_ERROR(parse_dtype(a.dtype, &a.o.dtype));
  a.o.all_targets = a.train_on == "all";
  LAPLACE_RETURN_IF_ERROR(a.o.validate());

  // Outputs are opened before hours of training, so a bad path fails at once.
  std::string jsonl;
  std::ofstream out;
  if (!a.out.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(a.out, ec);
    if (ec) return Status::io_error("cannot create " + a.out + ": " + ec.message());
    jsonl = a.out + "/mqar.jsonl";
    out.open(jsonl, std::ios::trunc);
    if (!out) return Status::io_error("cannot write " + jsonl);
  }
  BenchLog res{a.results, "", "", "", a.tag, "", BenchLog::command_line()};
  if (!a.results.empty()) {
    res.device = device_description(a.o.device);
    res.commit = BenchLog::commit_hash();
    res.date = BenchLog::iso_date_utc();
  }

  std::fputs(mqar_table_header().c_str(), stdout);
  std::fflush(stdout);
  std::vector<MqarResult> done;
  Status st = mqar_run_grid(a.o, [&](const MqarResult& r) {
    std::fputs(mqar_table_row(r).c_str(), stdout);
    std::fflush(stdout);
    if (out.is_open()) {
      out << mqar_result_json(a.o, r) << "\n";
      out.flush();
    }
    done.push_back(r);
  });
  // The results lines after the table (BenchLog prints each one too), also for the points
  // finished before an error.
  if (!a.results.empty()) {
    for (const MqarResult& r : done) {
      const Config c = a.o.config(r.state);
      char note[512];
      std::snprintf(note, sizeof note,
                    "laplace eval mqar: V%lld D%lld L%lld F%lld, state %s (%lld B/seq), %lld pairs, seq %lld, "
                    "%lld steps x batch %lld, lr %g, seed %llu, %lld eval sequences (%lld answers), %s %s, "
                    "chance %.4g",
                    (long long)c.vocab_size, (long long)c.hidden_size, (long long)c.num_layers,
                    (long long)c.ffn_size, r.state.name().c_str(), (long long)r.state_bytes, (long long)r.pairs,
                    (long long)r.seq, (long long)a.o.steps, (long long)a.o.batch, a.o.lr,
                    (unsigned long long)a.o.seed, (long long)a.o.eval_examples, (long long)r.total,
                    a.o.device.c_str(), dtype_name(a.o.dtype), r.chance);
      res.add("mqar_acc_" + r.state.name() + "_p" + std::to_string(r.pairs) + "_t" + std::to_string(r.seq),
              r.accuracy(), "fraction", note);
    }
  }
  if (out.is_open()) {
    out.close();
    if (!out && st.is_ok()) return Status::io_error("cannot write " + jsonl);
  }
  return st;
}

}  // namespace

void add_eval_mqar(CLI::App* eval) {
  auto* cmd = eval->add_subcommand("mqar", "multi-query associative recall (Zoology): train small models over a "
                                           "grid of state sizes, pairs and sequence lengths; accuracy per point");
  auto a = std::make_shared<MqarArgs>();
  MqarOptions& o = a->o;
  cmd->add_option("--state-sizes", a->states, "comma-separated HxDKxDV (heads x key dim x value dim), e.g. 2x16x32,4x32x64")
      ->capture_default_str();
  cmd->add_option("--pairs", a->pairs, "comma-separated key-value pair counts, e.g. 4,8,16,32,64")->capture_default_str();
  cmd->add_option("--seq-lens", a->seq_lens, "comma-separated sequence lengths, e.g. 64,128,256")->capture_default_str();
  cmd->add_option("--vocab", o.vocab, "vocabulary: keys [1, V/2), values [V/2, V)")->capture_default_str();
  cmd->add_option("--dim", o.dim, "model width D")->capture_default_str();
  cmd->add_option("--layers", o.layers, "layers L")->capture_default_str();
  cmd->add_option("--ffn", o.ffn, "FFN width (0: 4·D)")->capture_default_str();
  cmd->add_option("--chunk", o.chunk, "GLA chunk size for training")->capture_default_str();
  cmd->add_option("--power-a", o.power_a, "query gaps ∝ (g+1)^(a-1) (Zoology's 0.01; 1 = uniform)")
      ->capture_default_str();
  cmd->add_option("--train-on", a->train_on,
                  "answers: the loss counts the answer positions only (Zoology); all: every next-token target")
      ->check(CLI::IsMember({"answers", "all"}))
      ->capture_default_str();
  cmd->add_option("--steps", o.steps, "training steps per model")->capture_default_str();
  cmd->add_option("--batch", o.batch, "training sequences per step")->capture_default_str();
  cmd->add_option("--lr", o.lr, "peak learning rate (cosine schedule, Muon + AdamW)")->capture_default_str();
  cmd->add_option("--wd", o.weight_decay, "decoupled weight decay")->capture_default_str();
  cmd->add_option("--warmup", o.warmup, "warm-up steps (-1: steps/10)")->capture_default_str();
  cmd->add_option("--seed", o.seed, "seed of the data, the initialisation and the shuffle")->capture_default_str();
  cmd->add_option("--train-examples", o.train_examples,
                  "distinct training sequences (0: steps·batch, at most 2^25 tokens; epochs repeat them)")
      ->capture_default_str();
  cmd->add_option("--eval-examples", o.eval_examples, "held-out sequences scored per point")->capture_default_str();
  cmd->add_option("--eval-batch", o.eval_batch, "sequences per evaluation forward (0: --batch)")->capture_default_str();
  cmd->add_option("--device", o.device, "cpu or cuda")->check(CLI::IsMember({"cpu", "cuda"}))->capture_default_str();
  cmd->add_option("--dtype", a->dtype, "f32, f64 (CPU) or bf16 (CUDA: bf16 compute, f32 master weights)")
      ->capture_default_str();
  cmd->add_option("--out", a->out, "write DIR/mqar.jsonl (one JSON line per point)");
  cmd->add_option("--results", a->results, "append mqar_acc_<state>_p<pairs>_t<seq> lines (bench/results.jsonl format)");
  cmd->add_option("--tag", a->tag, "appended to every --results name as _TAG");
  cmd->add_option("--work-dir", o.work_dir, "shards, configs and checkpoints (default: a temporary directory)");
  cmd->add_flag("--keep-work", o.keep_work, "keep the work files");
  cmd->add_flag("--quiet", o.quiet, "no progress lines on stderr");
  cmd->callback([a] { g_exit_code = report(run_mqar(*a)); });
}

}  // namespace laplace::cli
