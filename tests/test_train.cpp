// The training loop: exact resume, crash safety of checkpoints, non-finite steps.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <utility>

#include <nlohmann/json.hpp>

#include "core/file_util.h"
#include "core/safetensors.h"
#include "model/model.h"
#include "tests/test_util.h"
#include "text/shard.h"
#include "train/memory_plan.h"
#include "train/trainer.h"

#ifdef LAPLACE_HAVE_CUDA
#include "ops/cuda/cuda_backend.h"
#endif

namespace laplace {
namespace {

namespace fs = std::filesystem;

const char* kConfig = R"({"model_type": "laplace", "vocab_size": 97, "hidden_size": 32, "num_layers": 2,
  "num_heads": 2, "head_k_dim": 8, "head_v_dim": 16, "ffn_size": 64, "chunk_size": 16})";

struct Fixture {
  std::string dir, config, shard;
  Fixture() {
    dir = testing::make_temp_dir("train");
    config = dir + "/config.json";
    std::ofstream(config) << kConfig;
    std::vector<uint32_t> toks(6000);
    std::mt19937 rng(3);
    uint32_t t = 0;
    for (auto& x : toks) x = t = (t * 7 + rng() % 5) % 97;  // learnable structure
    shard = dir + "/train_000000.bin";
    EXPECT_TRUE(shard_write(shard, toks, 97).is_ok());
  }
  TrainOptions options(const std::string& out) const {
    TrainOptions o;
    o.config_path = config;
    o.train_data = {shard};
    o.out_dir = out;
    o.batch = 3;
    o.seq = 40;
    o.grad_accum = 2;
    o.steps = 8;
    o.schedule.lr = 0.02;
    o.schedule.warmup_steps = 2;
    o.optim.weight_decay = 0.1;
    o.shuffle = true;
    o.data_seed = 5;
    o.quiet = true;
    return o;
  }
};

std::vector<double> train(const TrainOptions& o) {
  Trainer t(o);
  Status st = t.setup();
  EXPECT_TRUE(st.is_ok()) << st.to_string();
  std::vector<double> losses;
  st = t.run([&](const StepLog& s) { losses.push_back(s.loss); });
  EXPECT_TRUE(st.is_ok()) << st.to_string();
  return losses;
}

std::string bytes_of(const std::string& path) {
  std::string s;
  EXPECT_TRUE(read_file(path, &s).is_ok()) << path;
  return s;
}

// 2k steps straight vs k steps, stop, resume, k more: bitwise identical losses and
// weights (shuffled data, gradient accumulation, warm-up + cosine, weight decay).
TEST(TrainResume, BitwiseIdenticalToAStraightRun) {
  Fixture f;
  std::vector<double> straight = train(f.options(f.dir + "/straight"));
  ASSERT_EQ(straight.size(), 8u);
  EXPECT_LT(straight.back(), straight.front());

  TrainOptions first = f.options(f.dir + "/resumed");
  first.stop_after = 4;
  std::vector<double> a = train(first);
  ASSERT_EQ(a.size(), 4u);
  TrainOptions second = f.options(f.dir + "/resumed");
  second.resume = "auto";
  std::vector<double> b = train(second);
  ASSERT_EQ(b.size(), 4u);
  a.insert(a.end(), b.begin(), b.end());
  for (size_t i = 0; i < 8; ++i)
    EXPECT_EQ(std::memcmp(&a[i], &straight[i], sizeof(double)), 0) << "step " << i << ": " << a[i] << " vs "
                                                                   << straight[i];
  EXPECT_EQ(bytes_of(f.dir + "/resumed/model.safetensors"), bytes_of(f.dir + "/straight/model.safetensors"));
  EXPECT_EQ(bytes_of(f.dir + "/resumed/checkpoint.safetensors"),
            bytes_of(f.dir + "/straight/checkpoint.safetensors"));
}

// Documents kept apart (TrainOptions::document_separator; the fixture's stream holds the separator
// 2 about once in 97 tokens): training and validation differ from a packed run, the run resumes
// bit for bit, and `laplace train --documents` refuses an unknown value, naming it.
TEST(TrainDocuments, SeparateDiffersFromPackedResumesExactlyAndBadValuesFail) {
  Fixture f;
  TrainOptions o = f.options(f.dir + "/separate");
  o.document_separator = 2;
  o.val_data = {f.shard};
  o.eval_every = 4;
  o.eval_batches = 2;
  const std::vector<double> separate = train(o);
  TrainOptions p = o;
  p.out_dir = f.dir + "/packed";
  p.document_separator = -1;
  const std::vector<double> packed = train(p);
  ASSERT_EQ(separate.size(), 8u);
  EXPECT_NE(separate, packed);
  EXPECT_LT(separate.back(), separate.front());

  TrainOptions first = o;
  first.out_dir = f.dir + "/resumed";
  first.stop_after = 4;
  std::vector<double> a = train(first);
  TrainOptions second = first;
  second.stop_after = 0;
  second.resume = "auto";
  const std::vector<double> b = train(second);
  a.insert(a.end(), b.begin(), b.end());
  ASSERT_EQ(a.size(), 8u);
  EXPECT_EQ(std::memcmp(a.data(), separate.data(), 8 * sizeof(double)), 0);
  // The validation lines (the other lines carry timings).
  auto val_lines = [&](const std::string& run) {
    std::istringstream in(bytes_of(f.dir + "/" + run + "/metrics.jsonl"));
    std::string all;
    for (std::string line; std::getline(in, line);)
      if (line.find("val_loss") != std::string::npos) all += line + "\n";
    return all;
  };
  EXPECT_EQ(val_lines("resumed"), val_lines("separate"));
  EXPECT_NE(val_lines("separate").find("\"step\":7,\"val_loss\""), std::string::npos);
  EXPECT_NE(val_lines("separate"), val_lines("packed"));

  const std::string log = f.dir + "/bad.log";
  const std::string cmd = std::string(LAPLACE_BINARY) + " train --config " + f.config + " --data " + f.shard +
                          " --out " + f.dir + "/bad --documents apart --steps 1 > " + log + " 2>&1";
  EXPECT_NE(std::system(cmd.c_str()), 0);
  EXPECT_NE(bytes_of(log).find("--documents must be 'separate' or 'packed', got 'apart'"), std::string::npos)
      << bytes_of(log);
}

TEST(TrainResume, SameSeedSameBytesDifferentSeedDifferent) {
  Fixture f;
  auto a = train(f.options(f.dir + "/a"));
  auto b = train(f.options(f.dir + "/b"));
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(double)));
  TrainOptions o = f.options(f.dir + "/c");
  o.data_seed = 6;
  auto c = train(o);
  EXPECT_NE(a, c);
}

// --precision fp8 (Model::use_fp8_training) on the CPU's reference FP8 products: the run learns,
// stays near the model-precision run without equalling it, is deterministic, resumes bitwise in
// FP8, records its precision in the checkpoint and refuses to resume in another.
TEST(TrainFp8, LearnsNearTheModelPrecisionRunResumesExactlyAndRecordsIt) {
  Fixture f;
  const std::vector<double> base = train(f.options(f.dir + "/f32"));
  TrainOptions o = f.options(f.dir + "/fp8");
  o.fp8 = true;
  const std::vector<double> a = train(o);
  ASSERT_EQ(a.size(), base.size());
  EXPECT_LT(a.back(), a.front() - 0.1);
  double dmax = 0;
  bool differs = false;
  for (size_t i = 0; i < a.size(); ++i) {
    dmax = std::max(dmax, std::fabs(a[i] - base[i]));
    differs |= a[i] != base[i];
  }
  EXPECT_TRUE(differs) << "FP8 products round: the losses cannot all be the model precision's";
  EXPECT_LT(dmax, 0.05) << "FP8 run strays from the model-precision run";

  TrainOptions o2 = f.options(f.dir + "/fp8b");
  o2.fp8 = true;
  EXPECT_EQ(0, std::memcmp(train(o2).data(), a.data(), a.size() * sizeof(double)));

  TrainOptions first = f.options(f.dir + "/fp8r");
  first.fp8 = true;
  first.stop_after = 4;
  std::vector<double> r = train(first);
  TrainOptions second = first;
  second.stop_after = 0;
  second.resume = "auto";
  const std::vector<double> r2 = train(second);
  r.insert(r.end(), r2.begin(), r2.end());
  ASSERT_EQ(r.size(), a.size());
  EXPECT_EQ(0, std::memcmp(r.data(), a.data(), a.size() * sizeof(double)));
  EXPECT_EQ(bytes_of(f.dir + "/fp8r/model.safetensors"), bytes_of(f.dir + "/fp8/model.safetensors"));

  SafeTensorsReader rd;
  ASSERT_TRUE(SafeTensorsReader::open(f.dir + "/fp8/checkpoint.safetensors", &rd).is_ok());
  EXPECT_EQ(rd.metadata().at("train_precision"), "fp8");
  SafeTensorsReader rb;
  ASSERT_TRUE(SafeTensorsReader::open(f.dir + "/f32/checkpoint.safetensors", &rb).is_ok());
  EXPECT_EQ(rb.metadata().at("train_precision"), "model");

  // An FP8 checkpoint does not resume in the model precision, nor the other way round.
  for (const auto& [dir, fp8] : {std::pair<std::string, bool>{"/fp8", false}, {"/f32", true}}) {
    TrainOptions again = f.options(f.dir + dir);
    again.resume = "auto";
    again.fp8 = fp8;
    Trainer t(again);
    const Status st = t.setup();
    EXPECT_FALSE(st.is_ok()) << dir;
    EXPECT_NE(st.to_string().find("--precision"), std::string::npos) << st.to_string();
  }
  // fp8-fast (the forward products accumulated fast) is a permission the CPU's exact sums do not
  // use: the same losses. It is recorded as a precision of its own, so an fp8 checkpoint does not
  // resume as fp8-fast.
  TrainOptions fast = f.options(f.dir + "/fp8fast");
  fast.fp8 = true;
  fast.fp8_fast_forward = true;
  EXPECT_EQ(0, std::memcmp(train(fast).data(), a.data(), a.size() * sizeof(double)));
  SafeTensorsReader rf;
  ASSERT_TRUE(SafeTensorsReader::open(f.dir + "/fp8fast/checkpoint.safetensors", &rf).is_ok());
  EXPECT_EQ(rf.metadata().at("train_precision"), "fp8-fast");
  {
    TrainOptions again = f.options(f.dir + "/fp8");
    again.resume = "auto";
    again.fp8 = true;
    again.fp8_fast_forward = true;
    Trainer t(again);
    const Status st = t.setup();
    EXPECT_NE(st.to_string().find("--precision fp8"), std::string::npos) << st.to_string();
  }
  // The memory plan counts the FP8 arenas as they are allocated.
  TrainOptions planned = f.options(f.dir + "/fp8plan");
  planned.fp8 = true;
  Trainer t(planned);
  ASSERT_TRUE(t.setup().is_ok());
  EXPECT_GT(t.memory_plan().fp8, 0u);
  EXPECT_EQ(t.memory_plan().total(), t.allocated_bytes());
}

// A run killed (SIGKILL) in the middle of writing its second checkpoint leaves the
// first one intact and loadable; resuming from it finishes with the straight run's
// losses.
TEST(Checkpoint, KilledDuringWriteLeavesPreviousLoadable) {
  Fixture f;
  const std::string bin = LAPLACE_BINARY;
  auto cmd = [&](const std::string& out, const std::string& extra) {
    return bin + " train --config " + f.config + " --data " + f.shard + " --out " + out +
           " --batch 3 --seq 40 --steps 6 --lr 0.02 --warmup 2 --ckpt-every 2 --quiet " + extra + " >/dev/null 2>&1";
  };
  ASSERT_EQ(std::system(cmd(f.dir + "/straight", "").c_str()), 0);
  const std::string killed = "LAPLACE_TEST_KILL_DURING_WRITE=checkpoint.safetensors:2 " + cmd(f.dir + "/run", "");
  int st = std::system(killed.c_str());
  ASSERT_TRUE(WIFEXITED(st));
  EXPECT_NE(WEXITSTATUS(st), 0) << "the run should have been killed";
  // The temp file of the interrupted write is there, half written; the checkpoint is step 2's.
  bool saw_tmp = false;
  for (const auto& e : fs::directory_iterator(f.dir + "/run"))
    saw_tmp |= e.path().filename().string().find("checkpoint.safetensors.tmp.") == 0;
  EXPECT_TRUE(saw_tmp);
  SafeTensorsReader r;
  ASSERT_TRUE(SafeTensorsReader::open(f.dir + "/run/checkpoint.safetensors", &r).is_ok());
  EXPECT_EQ(r.metadata().at("step"), "2");
  ASSERT_EQ(std::system(cmd(f.dir + "/run", "--resume auto").c_str()), 0);
  auto losses = [&](const std::string& path) {
    std::map<int64_t, double> m;  // the last record of each step wins
    std::ifstream in(path);
    std::string line;
    while (std::getline(in, line)) {
      auto j = nlohmann::json::parse(line);
      if (j.contains("loss")) m[j["step"].get<int64_t>()] = j["loss"].get<double>();
    }
    return m;
  };
  auto want = losses(f.dir + "/straight/metrics.jsonl");
  auto got = losses(f.dir + "/run/metrics.jsonl");
  ASSERT_EQ(want.size(), 6u);
  ASSERT_EQ(got.size(), 6u);
  for (auto& [step, loss] : want) EXPECT_EQ(got[step], loss) << "step " << step;
  EXPECT_EQ(bytes_of(f.dir + "/run/model.safetensors"), bytes_of(f.dir + "/straight/model.safetensors"));
}

TEST(Checkpoint, CorruptOrForeignCheckpointsAreRejected) {
  Fixture f;
  train(f.options(f.dir + "/a"));
  const std::string good = bytes_of(f.dir + "/a/checkpoint.safetensors");
  auto try_resume = [&](const std::string& path) {
    TrainOptions o = f.options(f.dir + "/b");
    o.resume = path;
    Trainer t(o);
    return t.setup();
  };
  std::ofstream(f.dir + "/trunc.safetensors", std::ios::binary) << good.substr(0, good.size() - 100);
  EXPECT_FALSE(try_resume(f.dir + "/trunc.safetensors").is_ok());
  Status st = try_resume(f.dir + "/a/model.safetensors");  // weights only: no optimizer state
  EXPECT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("not a training checkpoint"), std::string::npos) << st.to_string();
  EXPECT_FALSE(try_resume(f.dir + "/missing.safetensors").is_ok());
  EXPECT_TRUE(try_resume(f.dir + "/a/checkpoint.safetensors").is_ok());
}

// A non-finite gradient skips the step: weights and optimizer state untouched.
TEST(TrainNonFinite, StepIsSkippedAndNothingChanges) {
  Fixture f;
  Config c;
  ASSERT_TRUE(config_load(f.config, &c).is_ok());
  auto be = make_cpu_backend();
  Model m;
  ASSERT_TRUE(m.create(c, *be, DType::kF32).is_ok());
  m.init_weights(9);
  Tensor head = m.weights().lm_head;
  head.ptr<float>()[5] = NAN;
  ASSERT_TRUE(m.save(f.dir + "/nan.safetensors").is_ok());
  TrainOptions o = f.options(f.dir + "/nan");
  o.init_ckpt = f.dir + "/nan.safetensors";
  o.steps = 3;
  Trainer t(o);
  ASSERT_TRUE(t.setup().is_ok());
  int skipped = 0;
  ASSERT_TRUE(t.run([&](const StepLog& s) { skipped += s.skipped; }).is_ok());
  EXPECT_EQ(skipped, 3);
  EXPECT_EQ(t.progress().optimizer_steps, 0);
  // The saved weights are the initial ones, byte for byte (NaN included).
  SafeTensorsReader a, b;
  ASSERT_TRUE(SafeTensorsReader::open(f.dir + "/nan.safetensors", &a).is_ok());
  ASSERT_TRUE(SafeTensorsReader::open(f.dir + "/nan/model.safetensors", &b).is_ok());
  for (const auto& info : a.tensors()) {
    const SafeTensorInfo* other = b.find(info.name);
    ASSERT_NE(other, nullptr);
    EXPECT_EQ(0, std::memcmp(a.bytes(info), b.bytes(*other), info.nbytes())) << info.name;
  }
}

// ---- memory plan ----------------------------------------------------------------------------

Config laplace_3b() {
  Config c;
  c.vocab_size = 92160;
  c.hidden_size = 3072;
  c.num_layers = 24;
  c.num_heads = 16;
  c.head_k_dim = 96;
  c.head_v_dim = 192;
  c.ffn_size = 8192;
  return c;
}

// The planner's spec lists are copies of Model::plan's and Optimizer::init's: its bytes
// must be the real arenas' bytes (a drift in either fails here).
TEST(MemoryPlan, BytesMatchTheRealArenas) {
  Fixture f;
  Config c;
  ASSERT_TRUE(config_load(f.config, &c).is_ok());
  auto be = make_cpu_backend();
  for (DType dt : {DType::kF32, DType::kBF16}) {
    for (int rc : {kRecomputeNone, kRecomputeMixer, kRecomputeLayers}) {
      for (bool fused : {false, true}) {
        SCOPED_TRACE(std::string(dtype_name(dt)) + " recompute " + recompute_name(rc) + (fused ? " fused" : ""));
        MemoryPlanRequest r;
        r.seq = 40;
        r.dtype = dt;
        r.muon_fused = fused;
        r.ns_bf16 = true;  // BF16 models: NS scratch in bf16 (ignored for F32 masters)
        const MemoryPlan p = memory_plan_for(c, r, 3, rc);
        EXPECT_EQ(p.recompute(), rc);
        Model m;
        ASSERT_TRUE(m.create(c, *be, dt).is_ok());
        ASSERT_TRUE(m.plan(training_plan_options(p)).is_ok());
        EXPECT_EQ(m.plan_options().recompute_mixer, rc == kRecomputeMixer);
        EXPECT_EQ(m.plan_options().recompute_layers, rc == kRecomputeLayers);
        EXPECT_EQ(p.weights, m.weight_arena().bytes());
        EXPECT_EQ(p.activations + p.backward_scratch, m.activation_bytes());
        const DType pdt = dt == DType::kBF16 ? DType::kF32 : dt;
        Arena params, grads;
        ASSERT_TRUE(params.create(weight_specs(c, pdt), be->allocator(), "p").is_ok());
        ASSERT_TRUE(grads.create(weight_specs(c, pdt), be->allocator(), "g").is_ok());
        EXPECT_EQ(p.gradients, grads.bytes());
        EXPECT_EQ(p.masters, dt == DType::kBF16 ? params.bytes() : 0u);
        OptimizerConfig oc;
        oc.ns_bf16 = dt == DType::kBF16;
        Optimizer opt;
        ASSERT_TRUE(opt.init(*be, make_optimizer_params(c, params, grads, fused), oc).is_ok());
        EXPECT_EQ(p.optimizer, opt.state_bytes());
      }
    }
  }
}

// Synthetic device sizes around the real totals of laplace-3b at T = 2048.
TEST(MemoryPlan, ChoosesTheLargestMicroBatchThatFitsThenRecompute) {
  const Config c = laplace_3b();
  MemoryPlanRequest r;
  r.seq = 2048;
  r.dtype = DType::kBF16;
  r.reserve_bytes = size_t{3} << 30;
  auto total = [&](int64_t b, bool rc) { return memory_plan_for(c, r, b, rc).total(); };
  // The orderings the cases below rely on.
  ASSERT_LT(total(8, true), total(8, false));
  ASSERT_LT(total(4, false), total(8, true));
  ASSERT_LT(total(4, true), total(4, false));
  // The 3B weights: ~3.3e9 parameters, bf16 weights + f32 masters + f32 gradients.
  const MemoryPlan p8 = memory_plan_for(c, r, 8, false);
  EXPECT_NEAR(static_cast<double>(p8.weights), 2.0 * static_cast<double>(c.total_params()), 1e6);
  EXPECT_NEAR(static_cast<double>(p8.masters), 4.0 * static_cast<double>(c.total_params()), 1e6);
  EXPECT_EQ(p8.gradients, p8.masters);

  struct Case { size_t device; int64_t batch; bool recompute; };
  const Case cases[] = {
      {total(8, false) + r.reserve_bytes, 8, false},      // exactly fits
      {total(8, false) + r.reserve_bytes - 1, 8, true},   // one byte short: recompute
      {total(8, true) + r.reserve_bytes - 1, 4, false},   // halve B before recomputing at 4
      {total(4, false) + r.reserve_bytes - 1, 4, true},
      {total(1, true) + r.reserve_bytes, 1, true},
  };
  for (const Case& k : cases) {
    MemoryPlanRequest q = r;
    q.device_bytes = k.device;
    MemoryPlan p;
    ASSERT_TRUE(choose_memory_plan(c, q, &p).is_ok()) << k.device;
    EXPECT_EQ(p.batch, k.batch) << k.device;
    EXPECT_EQ(p.recompute_mixer, k.recompute) << k.device;
    EXPECT_EQ(p.grad_accum, 1);
    EXPECT_TRUE(p.chosen);
    EXPECT_TRUE(p.fits());
    EXPECT_LE(p.total() + q.reserve_bytes, q.device_bytes);
  }
  // Nothing fits: out of memory, listing all 8 candidates tried.
  MemoryPlanRequest q = r;
  q.device_bytes = total(1, true) + r.reserve_bytes - 1;
  MemoryPlan p;
  const Status st = choose_memory_plan(c, q, &p);
  EXPECT_EQ(st.code(), Status::Code::kOutOfMemory) << st.to_string();
  EXPECT_NE(st.to_string().find("B=1 recompute on"), std::string::npos) << st.to_string();
  // An H200 (≈ 140 GB free): some plan fits, and it is one of the candidates.
  q.device_bytes = size_t{140} * 1000 * 1000 * 1000;
  ASSERT_TRUE(choose_memory_plan(c, q, &p).is_ok());
  EXPECT_GE(p.batch, 1);
  EXPECT_NE(format_memory_plan(p, "device").find("master weights (f32)"), std::string::npos);
}

// Full-layer recompute comes after every B without it (and with the mixer's), and only where
// the caller allows it: laplace-3b at T = 32768 on synthetic device sizes, and the H200 case.
TEST(MemoryPlan, ChoosesLayerRecomputeWhenNothingElseFits) {
  const Config c = laplace_3b();
  MemoryPlanRequest r;
  r.seq = 32768;
  r.dtype = DType::kBF16;
  r.reserve_bytes = size_t{3} << 30;
  r.allow_recompute_layers = true;
  auto total = [&](int64_t b, int rc) { return memory_plan_for(c, r, b, rc).total(); };
  // The orderings the cases below rely on.
  ASSERT_LT(total(1, kRecomputeMixer), total(1, kRecomputeNone));
  ASSERT_LT(total(4, kRecomputeLayers), total(1, kRecomputeMixer));
  ASSERT_LT(total(1, kRecomputeMixer), total(8, kRecomputeLayers));
  ASSERT_LT(total(1, kRecomputeLayers), total(2, kRecomputeLayers));
  struct Case {
    size_t device;
    int64_t batch;
    int recompute;
  };
  const Case cases[] = {
      {total(1, kRecomputeMixer) + r.reserve_bytes, 1, kRecomputeMixer},
      {total(1, kRecomputeMixer) + r.reserve_bytes - 1, 4, kRecomputeLayers},  // the largest B that fits
      {total(2, kRecomputeLayers) + r.reserve_bytes - 1, 1, kRecomputeLayers},
      {total(1, kRecomputeLayers) + r.reserve_bytes, 1, kRecomputeLayers},
  };
  for (const Case& k : cases) {
    MemoryPlanRequest q = r;
    q.device_bytes = k.device;
    MemoryPlan p;
    ASSERT_TRUE(choose_memory_plan(c, q, &p).is_ok()) << k.device;
    EXPECT_EQ(p.batch, k.batch) << k.device;
    EXPECT_EQ(p.recompute(), k.recompute) << k.device;
    EXPECT_TRUE(p.chosen);
    EXPECT_LE(p.total() + q.reserve_bytes, q.device_bytes);
  }
  // Not allowed (a store that cannot plan it, or a caller that does not know it): out of memory.
  MemoryPlanRequest q = r;
  q.device_bytes = total(1, kRecomputeMixer) + r.reserve_bytes - 1;
  q.allow_recompute_layers = false;
  MemoryPlan p;
  EXPECT_EQ(choose_memory_plan(c, q, &p).code(), Status::Code::kOutOfMemory);
  // Nothing fits: every candidate is listed, the layer recompute's last.
  q.allow_recompute_layers = true;
  q.device_bytes = total(1, kRecomputeLayers) + r.reserve_bytes - 1;
  const Status st = choose_memory_plan(c, q, &p);
  EXPECT_EQ(st.code(), Status::Code::kOutOfMemory);
  EXPECT_NE(st.to_string().find("B=1 recompute layers"), std::string::npos) << st.to_string();
  // Given: B = 1 with the layer recompute is kept as given.
  q.device_bytes = 0;
  q.batch = 1;
  q.recompute = kRecomputeLayers;
  ASSERT_TRUE(choose_memory_plan(c, q, &p).is_ok());
  EXPECT_TRUE(p.recompute_layers);
  EXPECT_FALSE(p.recompute_mixer);
  EXPECT_FALSE(p.chosen);
  // One H200 (141 GB, the 3 GiB reserve): B = 1 fits only with the layer recompute.
  q = r;
  q.device_bytes = size_t{141} * 1000 * 1000 * 1000;
  q.batch = 1;
  ASSERT_TRUE(choose_memory_plan(c, q, &p).is_ok());
  EXPECT_TRUE(p.recompute_layers);
  const std::string text = format_memory_plan(p, "device");
  EXPECT_NE(text.find("recompute_layers on"), std::string::npos) << text;
  EXPECT_NE(text.find("activations (layers recomputed)"), std::string::npos) << text;
}

TEST(MemoryPlan, TokensPerStepSetsAccumulation) {
  const Config c = laplace_3b();
  MemoryPlanRequest r;
  r.seq = 2048;
  r.dtype = DType::kBF16;
  r.device_bytes = 0;  // unknown: the largest candidate
  r.tokens_per_step = 524288;  // the seed's step: 256 sequences
  MemoryPlan p;
  ASSERT_TRUE(choose_memory_plan(c, r, &p).is_ok());
  EXPECT_EQ(p.batch, 8);
  EXPECT_EQ(p.grad_accum, 32);
  EXPECT_EQ(p.tokens_per_step(), 524288);
  r.tokens_per_step = 2048 * 3;  // 3 sequences: B ∈ {1} among the powers of two dividing 3
  ASSERT_TRUE(choose_memory_plan(c, r, &p).is_ok());
  EXPECT_EQ(p.batch, 1);
  EXPECT_EQ(p.grad_accum, 3);
  r.tokens_per_step = 2048 * 4 + 1;
  EXPECT_EQ(choose_memory_plan(c, r, &p).code(), Status::Code::kInvalidArgument);
  r.tokens_per_step = 2048 * 8;
  r.batch = 3;
  EXPECT_EQ(choose_memory_plan(c, r, &p).code(), Status::Code::kInvalidArgument);
  r.batch = 2;  // given (with the recompute): kept, accumulation derived
  r.recompute = 0;
  ASSERT_TRUE(choose_memory_plan(c, r, &p).is_ok());
  EXPECT_EQ(p.batch, 2);
  EXPECT_EQ(p.grad_accum, 4);
  EXPECT_FALSE(p.chosen);
}

// `laplace train --batch auto` chooses and prints the plan before training.
TEST(MemoryPlan, TrainBatchAutoPrintsThePlan) {
  Fixture f;
  const std::string bin = LAPLACE_BINARY;
  const std::string log = f.dir + "/auto.log";
  const std::string cmd = bin + " train --config " + f.config + " --data " + f.shard + " --out " + f.dir +
                          "/auto --batch auto --seq 40 --steps 1 --lr 0.02 > " + log + " 2>&1";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << bytes_of(log);
  const std::string out = bytes_of(log);
  for (const char* want : {"memory plan: T=40, micro-batch B=8 (chosen), grad accumulation 1 (320 tokens/step)",
                           "weights (f32)", "gradients (f32)", "optimizer state", "activations", "backward scratch",
                           "total", "host memory available"})
    EXPECT_NE(out.find(want), std::string::npos) << "missing '" << want << "' in:\n" << out;
  // --tokens-per-step alone implies --batch auto; with --grad-accum it is an error.
  const std::string cmd2 = bin + " train --config " + f.config + " --data " + f.shard + " --out " + f.dir +
                           "/tps --tokens-per-step 160 --seq 40 --steps 1 --lr 0.02 > " + log + " 2>&1";
  ASSERT_EQ(std::system(cmd2.c_str()), 0) << bytes_of(log);
  EXPECT_NE(bytes_of(log).find("micro-batch B=4 (chosen), grad accumulation 1 (160 tokens/step)"), std::string::npos)
      << bytes_of(log);
  const std::string cmd3 = bin + " train --config " + f.config + " --data " + f.shard + " --out " + f.dir +
                           "/bad --tokens-per-step 160 --grad-accum 2 --seq 40 --steps 1 > " + log + " 2>&1";
  EXPECT_NE(std::system(cmd3.c_str()), 0);
  const std::string cmd4 = bin + " train --config " + f.config + " --data " + f.shard + " --out " + f.dir +
                           "/bad --batch many --seq 40 --steps 1 > " + log + " 2>&1";
  EXPECT_NE(std::system(cmd4.c_str()), 0);
  EXPECT_NE(bytes_of(log).find("'auto'"), std::string::npos) << bytes_of(log);
}

// An explicit --batch/--grad-accum is kept as given (the plan is only printed).
TEST(MemoryPlan, ExplicitBatchIsKept) {
  Fixture f;
  TrainOptions o = f.options(f.dir + "/explicit");
  o.steps = 1;
  Trainer t(o);
  ASSERT_TRUE(t.setup().is_ok());
  EXPECT_EQ(t.memory_plan().batch, 3);
  EXPECT_EQ(t.memory_plan().grad_accum, 2);
  EXPECT_FALSE(t.memory_plan().chosen);
  // The plan counts what the one-device store allocates (as the sharded store's test checks).
  EXPECT_EQ(t.memory_plan().total(), t.allocated_bytes());
}

// --recompute-layers (TrainOptions::recompute_layers) trains step for step as without recompute:
// bitwise losses and weights, documents kept apart; the plan counts what is allocated; the CLI
// prints the mode and refuses both recomputes at once.
TEST(TrainRecompute, LayersEqualsNoRecomputeStepForStep) {
  Fixture f;
  TrainOptions o = f.options(f.dir + "/none");
  o.document_separator = 2;
  const std::vector<double> none = train(o);
  TrainOptions l = o;
  l.out_dir = f.dir + "/layers";
  l.recompute_layers = true;
  const std::vector<double> layers = train(l);
  ASSERT_EQ(none.size(), 8u);
  ASSERT_EQ(layers.size(), 8u);
  for (size_t i = 0; i < 8; ++i)
    EXPECT_EQ(std::memcmp(&layers[i], &none[i], sizeof(double)), 0) << "step " << i << ": " << layers[i] << " vs "
                                                                     << none[i];
  EXPECT_EQ(bytes_of(f.dir + "/layers/model.safetensors"), bytes_of(f.dir + "/none/model.safetensors"));

  l.out_dir = f.dir + "/layers-plan";
  l.steps = 1;
  Trainer t(l);
  ASSERT_TRUE(t.setup().is_ok());
  EXPECT_TRUE(t.memory_plan().recompute_layers);
  EXPECT_TRUE(t.model().plan_options().recompute_layers);
  EXPECT_EQ(t.memory_plan().total(), t.allocated_bytes());
  l.recompute_mixer = true;
  Trainer both(l);
  EXPECT_EQ(both.setup().code(), Status::Code::kInvalidArgument);

  const std::string bin = LAPLACE_BINARY;
  const std::string log = f.dir + "/layers.log";
  const std::string cmd = bin + " train --config " + f.config + " --data " + f.shard + " --out " + f.dir +
                          "/cli --batch 2 --seq 40 --steps 1 --lr 0.02 --recompute-layers > " + log + " 2>&1";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << bytes_of(log);
  EXPECT_NE(bytes_of(log).find("recompute_layers on"), std::string::npos) << bytes_of(log);
  const std::string cmd2 = bin + " train --config " + f.config + " --data " + f.shard + " --out " + f.dir +
                           "/cli2 --steps 1 --recompute-layers --recompute-mixer > " + log + " 2>&1";
  EXPECT_NE(std::system(cmd2.c_str()), 0);
  EXPECT_NE(bytes_of(log).find("--recompute-layers already recomputes the mixer"), std::string::npos) << bytes_of(log);
}

// The trainer's loss (cross-entropy + loss_sum_into, read at the step boundary) is
// Model::loss's value bit for bit.
TEST(TrainDeviceLoss, SameBitsAsModelLoss) {
  Fixture f;
  Config c;
  ASSERT_TRUE(config_load(f.config, &c).is_ok());
  auto be = make_cpu_backend();
  Model m;
  ASSERT_TRUE(m.create(c, *be, DType::kF32).is_ok());
  m.init_weights(3);
  ASSERT_TRUE(m.plan({2, 40, true, false}).is_ok());
  std::vector<int32_t> x(80), y(80);
  for (int i = 0; i < 80; ++i) {
    x[i] = (i * 7) % 97;
    y[i] = i % 13 == 0 ? -1 : (i * 5) % 97;  // some ignored targets
  }
  m.forward(x.data(), 2, 40, ForwardOptions{});
  const double want = m.loss(y.data());
  testing::OwnedTensor losses(DType::kF32, {80});
  double acc = 0;
  int64_t count = 0;
  for (int32_t t : y) count += t >= 0;
  be->cross_entropy_forward(m.logits(), Tensor(y.data(), DType::kI32, {80}), losses);
  be->loss_sum_into(losses, static_cast<double>(count), Tensor(&acc, DType::kF64, {1}), false);
  EXPECT_EQ(acc, want);
}

#ifdef LAPLACE_HAVE_CUDA
// ---- GPU: the training step queues without a host sync; runs are bitwise repeatable ----
// Skips without a usable GPU. A bf16 model (F32 masters, Muon with bf16 Newton–Schulz)
// trains on the fixture's data; CudaBackend::host_syncs() counts every point where the
// host waits for the device.

std::string cuda_unavailable() {
  std::string why;
  return make_cuda_backend(&why) ? "" : why;
}

TrainOptions gpu_options(const Fixture& f, const std::string& out) {
  TrainOptions o = f.options(out);
  o.device = "cuda";
  o.dtype = DType::kBF16;
  o.out_dir = "";
  return o;
}

TEST(CudaTrain, StepQueuesWithoutHostSync) {
  const std::string why = cuda_unavailable();
  if (!why.empty()) GTEST_SKIP() << "no CUDA device: " << why;
  Fixture f;
  for (bool nan_step : {false, true}) {
    SCOPED_TRACE(nan_step ? "skipped (NaN) step" : "normal step");
    TrainOptions o = gpu_options(f, "");
    if (nan_step) {  // a NaN in the head: every step is skipped
      Config c;
      ASSERT_TRUE(config_load(f.config, &c).is_ok());
      auto cpu = make_cpu_backend();
      Model m;
      ASSERT_TRUE(m.create(c, *cpu, DType::kF32).is_ok());
      m.init_weights(9);
      Tensor head = m.weights().lm_head;
      head.ptr<float>()[5] = NAN;
      ASSERT_TRUE(m.save(f.dir + "/nan.safetensors").is_ok());
      o.init_ckpt = f.dir + "/nan.safetensors";
    }
    Trainer t(o);
    ASSERT_TRUE(t.setup().is_ok());
    auto* cb = dynamic_cast<CudaBackend*>(&t.backend());
    ASSERT_NE(cb, nullptr);
    double loss = 0;
    t.enqueue_step(0);  // warm-up: scratch, staging buffers and gemm plans are created here
    t.finish_step(&loss);
    for (int64_t step = 1; step < 3; ++step) {
      const int64_t before = cb->host_syncs();
      t.enqueue_step(step);
      EXPECT_EQ(cb->host_syncs(), before) << "the host waited for the device inside step " << step;
      const StepResult r = t.finish_step(&loss);
      EXPECT_GT(cb->host_syncs(), before) << "finish_step must read back (sync) at the step boundary";
      EXPECT_EQ(r.skipped, nan_step);
      EXPECT_TRUE(std::isfinite(loss) || nan_step);
    }
  }
}

TEST(CudaTrain, TwoRunsGiveBitwiseIdenticalLosses) {
  const std::string why = cuda_unavailable();
  if (!why.empty()) GTEST_SKIP() << "no CUDA device: " << why;
  Fixture f;
  const TrainOptions o = gpu_options(f, "");
  const std::vector<double> a = train(o), b = train(o);
  ASSERT_EQ(a.size(), 8u);
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(std::memcmp(&a[i], &b[i], sizeof(double)), 0) << "step " << i << ": " << a[i] << " vs " << b[i];
    EXPECT_TRUE(std::isfinite(a[i]));
  }
  EXPECT_LT(a.back(), a.front()) << "the loss should fall on the fixture's learnable data";
}

// --recompute-layers on the GPU (bf16, documents kept apart): every step's loss is the run's
// without recompute, bit for bit (the same kernels on the same inputs), and the plan counts what
// was allocated.
TEST(CudaTrain, RecomputeLayersGivesBitwiseIdenticalLosses) {
  const std::string why = cuda_unavailable();
  if (!why.empty()) GTEST_SKIP() << "no CUDA device: " << why;
  Fixture f;
  TrainOptions o = gpu_options(f, "");
  o.document_separator = 2;
  const std::vector<double> none = train(o);
  o.recompute_layers = true;
  const std::vector<double> layers = train(o);
  ASSERT_EQ(none.size(), 8u);
  ASSERT_EQ(layers.size(), 8u);
  for (size_t i = 0; i < none.size(); ++i)
    EXPECT_EQ(std::memcmp(&layers[i], &none[i], sizeof(double)), 0) << "step " << i << ": " << layers[i] << " vs "
                                                                     << none[i];
  Trainer t(o);
  ASSERT_TRUE(t.setup().is_ok());
  EXPECT_TRUE(t.model().plan_options().recompute_layers);
  EXPECT_EQ(t.memory_plan().total(), t.allocated_bytes());
}

// The device-scalar optimizer on the GPU: bitwise the host-scalar step (the CPU backend's
// orchestration of the same CUDA ops, replayed here by hand), with no sync while queued.
TEST(CudaTrain, OptimizerStepBitwiseLikeHostScalarsAndSyncFree) {
  std::string why;
  auto be = make_cuda_backend(&why);
  if (!be) GTEST_SKIP() << "no CUDA device: " << why;
  auto* cb = dynamic_cast<CudaBackend*>(be.get());
  Fixture f;
  Config c;
  ASSERT_TRUE(config_load(f.config, &c).is_ok());
  // Two identical F32 parameter/gradient sets on the device.
  Arena w[2], g[2];
  for (int k = 0; k < 2; ++k) {
    ASSERT_TRUE(w[k].create(weight_specs(c, DType::kF32), be->allocator(), "w").is_ok());
    ASSERT_TRUE(g[k].create(weight_specs(c, DType::kF32), be->allocator(), "g").is_ok());
    weights_init(c, *be, w[k], 5);
    weights_init(c, *be, g[k], 6);  // any finite values serve as gradients
  }
  OptimizerConfig oc;
  oc.max_grad_norm = 1.0;  // weights_init-sized "gradients" have a norm far above 1: clipped
  oc.ns_bf16 = true;
  oc.weight_decay = 0.1;
  Optimizer opt;
  ASSERT_TRUE(opt.init(*be, make_optimizer_params(c, w[0], g[0], false), oc).is_ok());
  be->synchronize();
  const int64_t before = cb->host_syncs();
  opt.enqueue_step(0.01);
  EXPECT_EQ(cb->host_syncs(), before) << "Optimizer::enqueue_step synchronised";
  const StepResult r = opt.finish_step();
  EXPECT_FALSE(r.skipped);
  EXPECT_LT(r.clip_coef, 1.0);
  // The old host-scalar path on the second set: its norm read back, the decision on the host.
  std::vector<Param> ps = make_optimizer_params(c, w[1], g[1], false);
  EXPECT_EQ(global_grad_norm(*be, ps), r.grad_norm) << "device and host gradient norms differ";
  Optimizer ref;  // state for the reference: its own arena (zeroed), driven by hand
  ASSERT_TRUE(ref.init(*be, ps, oc).is_ok());
  const double coef = oc.max_grad_norm / (r.grad_norm + 1e-6);
  EXPECT_EQ(coef, r.clip_coef);
  for (Param& p : ps) be->scale(p.g, coef);
  const auto st = ref.state_tensors();
  size_t j = 0;
  NsScratch ns;  // host-norm Newton–Schulz: no "ss" scratch
  ns.dtype = DType::kBF16;
  int64_t max_muon = 0;
  for (const Param& p : ps)
    if (p.muon) {
      for (int64_t b : p.blocks) ns.plan(b, p.w.dim(1));
      max_muon = std::max(max_muon, p.w.numel());
    }
  std::vector<TensorSpec> specs = {{"u", DType::kF32, {max_muon}}};
  ns.add_specs(&specs, "ns.");
  specs.pop_back();
  Arena scratch;
  ASSERT_TRUE(scratch.create(std::move(specs), be->allocator(), "ref scratch").is_ok());
  ASSERT_TRUE(ns.bind(scratch, "ns.").is_ok());
  for (Param& p : ps) {
    if (p.muon) {
      Tensor u = Tensor::make(scratch.tensor(0).data, DType::kF32, p.w.shape.data(), 2, Device::kCUDA);
      muon_prepare(*be, p.g, st[j++].second, u, oc.momentum, oc.nesterov);
      muon_orthogonalise(*be, u, p.blocks, u, ns, oc.ns_steps);
      muon_finish(*be, p.w, u, p.blocks, 0, 0.01, oc.weight_decay, oc.scale);
    } else {
      AdamWParams ap;
      ap.lr = 0.01;
      ap.wd = p.decay ? oc.weight_decay : 0.0;
      ap.step = 1;
      be->adamw_update(p.w, p.g, st[j].second, st[j + 1].second, ap);
      j += 2;
    }
  }
  for (size_t i = 0; i < w[0].size(); ++i) {
    const Tensor a = w[0].tensor(i), b = w[1].tensor(i);
    std::vector<char> ha(a.nbytes()), hb(b.nbytes());
    be->copy(Tensor::make(ha.data(), a.dtype, a.shape.data(), a.ndim), a);
    be->copy(Tensor::make(hb.data(), b.dtype, b.shape.data(), b.ndim), b);
    EXPECT_EQ(ha, hb) << w[0].spec(i).name;
  }
}
#endif  // LAPLACE_HAVE_CUDA

}  // namespace
}  // namespace laplace
