// Training subcommands: train.
#include <cmath>
#include <cstdlib>
#include <cstdio>

#include "cli/common.h"
#include "core/file_util.h"
#include "distributed/comm.h"
#include "distributed/sharded_parameters.h"
#include "text/data_loader.h"
#include "text/prepare.h"
#include "text/tokenizer.h"
#include "train/trainer.h"

namespace laplace::cli {

namespace {

struct TrainArgs {
  TrainOptions o;
  std::string dtype = "f32";
  std::string schedule = "cosine";
  std::string muon_scale = "rms";
  double lr = 3e-3;
  int64_t warmup = 0;
  double min_lr_frac = 0.1, decay_frac = 0.2;
  bool no_shuffle = false;
  double peak_tflops = 0;
  bool distributed = false;
  std::string muon_comm = "all_to_all";
  std::string batch = "8";  // a count, or "auto" (the memory plan chooses)
  std::string precision = train_precision_name(false);
  std::string documents = "separate";
};

// --batch: a positive count, or "auto".
Status parse_batch(const std::string& v, TrainOptions* o) {
  if (v == "auto") {
    o->batch_auto = true;
    return Status::ok();
  }
  char* end = nullptr;
  const long long b = std::strtoll(v.c_str(), &end, 10);
  if (v.empty() || *end != '\0' || b < 1 || b > (1 << 20))
    return Status::invalid_argument("--batch must be a count in [1, 1048576] or 'auto', got '" + v + "'");
  o->batch = b;
  return Status::ok();
}

Status run_train(TrainArgs& a) {
  LAPLACE_RETURN_IF_ERROR(parse_batch(a.batch, &a.o));
  LAPLACE_RETURN_IF_ERROR(parse_dtype(a.dtype, &a.o.dtype));
  LAPLACE_RETURN_IF_ERROR(parse_documents(a.documents, a.o.tokenizer, &a.o.document_separator));
  a.o.fp8_fast_forward = a.precision == train_precision_name(true, true);
  a.o.fp8 = a.precision == train_precision_name(true) || a.o.fp8_fast_forward;
  if (!a.o.fp8 && a.precision != train_precision_name(false))
    return Status::invalid_argument("--precision must be 'model', 'fp8' or 'fp8-fast', got '" + a.precision + "'");
  LAPLACE_RETURN_IF_ERROR(schedule_kind_from_name(a.schedule, &a.o.schedule.kind));
  LAPLACE_RETURN_IF_ERROR(muon_scale_from_name(a.muon_scale, &a.o.optim.scale));
  a.o.schedule.lr = a.lr;
  a.o.optim.lr = a.lr;
  a.o.schedule.warmup_steps = a.warmup;
  a.o.schedule.min_lr_frac = a.min_lr_frac;
  a.o.schedule.decay_frac = a.decay_frac;
  a.o.shuffle = !a.no_shuffle;
  a.o.peak_flops = a.peak_tflops * 1e12;
  MuonComm mc;
  LAPLACE_RETURN_IF_ERROR(muon_comm_from_name(a.muon_comm, &mc));
  // Every saved model directory also loads in transformers (AutoModelForCausalLM, remote code).
  a.o.after_model_saved = [](const std::string& dir) { return write_hf_files(dir); };
  // The parameter store: whole on one device, or row shards over the ranks of a communicator.
  std::unique_ptr<Communicator> comm;  // outlives the trainer, which detaches from it
  std::unique_ptr<ParameterStore> store;
  if (a.distributed || launched_by_mpi()) {
    // FSDP-style data parallel, one rank per process (P = 1 without mpirun): over MPI on
    // CPUs, over NCCL on GPUs (one GPU per rank; this picks it, so it comes first).
    if (a.o.device == "cpu") LAPLACE_RETURN_IF_ERROR(make_communicator(&comm));
    else LAPLACE_RETURN_IF_ERROR(make_nccl_communicator(&comm));
    if (comm->rank() != 0) a.o.quiet = true;
    store = std::make_unique<ShardedParameters>(mc, *comm);
  }
  Trainer t(a.o, std::move(store));
  LAPLACE_RETURN_IF_ERROR(t.setup());
  return t.run();
}

}  // namespace

void add_train(CLI::App& app) {
  auto* cmd = app.add_subcommand("train", "train a model (Muon for body matrices, AdamW for the rest)");
  auto a = std::make_shared<TrainArgs>();
  TrainOptions& o = a->o;
  cmd->add_option("--config", o.config_path, "config.json")->required();
  cmd->add_option("--data", o.train_data, "training shards (paths or globs)")->required();
  cmd->add_option("--val-data", o.val_data, "validation shards (paths or globs)");
  cmd->add_option("--out", o.out_dir, "output directory (checkpoint, model, metrics.jsonl)");
  cmd->add_option("--init", o.init_ckpt, "start from these weights instead of a seeded init");
  cmd->add_option("--resume", o.resume, "resume from a checkpoint.safetensors ('auto': --out's, if present)");
  cmd->add_option("--tokenizer", o.tokenizer, "tokenizer.model to copy into --out");
  cmd->add_option("--tensorboard", o.tensorboard_dir,
                  "also write TensorBoard event files (loss, val_loss, lr, grad_norm, tokens_per_s, mfu) here");
  cmd->add_option("--batch", a->batch,
                  "sequences per micro-batch, or 'auto': the largest that fits the device (memory plan)");
  cmd->add_option("--tokens-per-step", o.tokens_per_step,
                  "tokens per optimizer step; sets --grad-accum = N / (batch·seq) (implies --batch auto "
                  "unless --batch is given)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--reserve-gib", o.reserve_gib,
                  "memory the plan leaves free (default 3 on CUDA, 0.25 on the CPU)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--precision", a->precision,
                  "model: products in the model dtype; fp8: the body projections' forward and gradient products "
                  "in FP8 E4M3 (docs/training.md); fp8-fast: the same with the forward products accumulated as the "
                  "tensor cores do (faster; the gradients' stay F32)");
  cmd->add_option("--seq", o.seq, "tokens per sequence")->check(CLI::Range(1, 1 << 24));
  cmd->add_option("--documents", a->documents,
                  "separate: each document of a window from a zero state (as served); packed: one stream")
      ->capture_default_str();
  cmd->add_option("--grad-accum", o.grad_accum, "micro-batches per step")->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--steps", o.steps, "optimizer steps")->check(CLI::Range(1, 1 << 30));
  cmd->add_option("--stop-after", o.stop_after, "stop after this step (checkpointed); the schedule still spans --steps")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--lr", a->lr, "peak learning rate (Muon and AdamW)")->check(CLI::Range(0.0, 10.0));
  cmd->add_option("--warmup", a->warmup, "linear warm-up steps")->check(CLI::NonNegativeNumber);
  cmd->add_option("--schedule", a->schedule, "cosine, wsd or constant");
  cmd->add_option("--min-lr-frac", a->min_lr_frac, "final lr as a fraction of --lr")->check(CLI::Range(0.0, 1.0));
  cmd->add_option("--decay-frac", a->decay_frac, "wsd: fraction of steps spent decaying")->check(CLI::Range(0.0, 1.0));
  cmd->add_option("--wd", o.optim.weight_decay, "decoupled weight decay")->check(CLI::Range(0.0, 1.0));
  cmd->add_option("--max-grad-norm", o.optim.max_grad_norm, "global-norm clipping (0 = off)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--momentum", o.optim.momentum, "Muon momentum")->check(CLI::Range(0.0, 1.0));
  cmd->add_option("--muon-scale", a->muon_scale, "rms (0.2·√max(r,c)) or shape (√max(1,r/c))");
  cmd->add_flag("--muon-fused", o.muon_fused, "orthogonalise W_qkvg and W_12 whole");
  cmd->add_option("--seed", o.seed, "initialisation seed");
  cmd->add_option("--data-seed", o.data_seed, "shuffle seed");
  cmd->add_flag("--no-shuffle", a->no_shuffle, "read the data in order (llm.c's sequential loader)");
  cmd->add_flag("--recompute-mixer", o.recompute_mixer, "recompute the GLA output in the backward");
  cmd->add_flag("--recompute-layers", o.recompute_layers,
                "keep only each layer's input; the backward runs each layer's forward again (about one more "
                "forward per step, far less memory; same bits); --batch auto chooses it when nothing else fits");
  cmd->add_option("--eval-every", o.eval_every, "validate every N steps (0 = never)")->check(CLI::NonNegativeNumber);
  cmd->add_option("--eval-batches", o.eval_batches, "validation batches")->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--ckpt-every", o.ckpt_every, "checkpoint every N steps (0 = at the end)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--log-every", o.log_every, "print every N steps")->check(CLI::Range(1, 1 << 30));
  cmd->add_option("--peak-tflops", a->peak_tflops, "device peak for MFU (e.g. 989 for an H200 in bf16)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--device", o.device, "cpu or cuda")->check(CLI::IsMember({"cpu", "cuda"}));
  cmd->add_option("--dtype", a->dtype, "f32 or f64 (CPU), bf16 (CUDA: bf16 compute, f32 master weights)");
  cmd->add_flag("--quiet", o.quiet, "no progress lines");
  cmd->add_flag("--distributed", a->distributed,
                "FSDP-style sharded training (implied under mpirun; one process = 1 rank)");
  cmd->add_option("--muon-comm", a->muon_comm,
                  "distributed Muon: all_to_all (owners get whole matrices in one exchange) or gather")
      ->check(CLI::IsMember({"gather", "all_to_all"}));
  auto* batch_opt = cmd->get_option("--batch");
  auto* accum_opt = cmd->get_option("--grad-accum");
  cmd->callback([a, batch_opt, accum_opt] {
    if (a->o.tokens_per_step > 0) {
      if (accum_opt->count() > 0) {
        g_exit_code = report(Status::invalid_argument("give --tokens-per-step or --grad-accum, not both"));
        return;
      }
      if (batch_opt->count() == 0) a->batch = "auto";
    }
    g_exit_code = report(run_train(*a));
  });
}

}  // namespace laplace::cli
