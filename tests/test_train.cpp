// The training loop: exact resume, crash safety of checkpoints, non-finite steps.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>

#include <nlohmann/json.hpp>

#include "core/file_util.h"
#include "core/safetensors.h"
#include "model/model.h"
#include "tests/test_util.h"
#include "text/shard.h"
#include "train/trainer.h"

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

}  // namespace
}  // namespace laplace
