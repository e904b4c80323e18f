// `laplace export hf`: the transformers directory (config.json with auto_map, the weights, the embedded
// python/laplace files byte for byte) and its errors. python/test_package.py loads such a directory and
// compares its logits with `laplace forward`; scripts/device/hf_check.py does it through transformers.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

#include "tests/test_util.h"
#include "text/shard.h"

namespace laplace {
namespace {

namespace fs = std::filesystem;

using Result = testing::CliResult;
using testing::run_laplace;

std::string slurp(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

void spit(const fs::path& p, const std::string& text) {
  std::ofstream f(p, std::ios::binary);
  f << text;
}

const char* kTiny = R"({"model_type": "laplace", "vocab_size": 61, "hidden_size": 16, "num_layers": 2,
  "num_heads": 2, "head_k_dim": 4, "head_v_dim": 8, "ffn_size": 32, "chunk_size": 8, "eos_token_id": 2})";

class CliExport : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::make_temp_dir("export");
    src_ = dir_ / "src";
    spit(dir_ / "tiny.json", kTiny);
    Result r = run_laplace("init --config " + (dir_ / "tiny.json").string() + " --out " + src_.string());
    ASSERT_EQ(r.exit_code, 0) << r.output;
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  fs::path dir_, src_;
};

TEST_F(CliExport, WritesATransformersDirectory) {
  spit(src_ / "tokenizer.model", "tok bytes");
  const fs::path out = dir_ / "hf";
  Result r = run_laplace("export hf --model " + src_.string() + " --out " + out.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("trust_remote_code=True"), std::string::npos) << r.output;
  for (const char* f : {"config.json", "model.safetensors", "tokenizer.model", "configuration_laplace.py",
                        "modeling_laplace.py"})
    EXPECT_TRUE(fs::exists(out / f)) << f;
  EXPECT_EQ(slurp(out / "model.safetensors"), slurp(src_ / "model.safetensors"));
  EXPECT_EQ(slurp(out / "tokenizer.model"), "tok bytes");
  const fs::path py = fs::path(LAPLACE_SOURCE_DIR) / "python" / "laplace";
  EXPECT_EQ(slurp(out / "configuration_laplace.py"), slurp(py / "configuration_laplace.py"))
      << "the embedded file is stale";
  EXPECT_EQ(slurp(out / "modeling_laplace.py"), slurp(py / "modeling_laplace.py")) << "the embedded file is stale";

  const auto j = nlohmann::json::parse(slurp(out / "config.json"));
  const auto src = nlohmann::json::parse(slurp(src_ / "config.json"));
  EXPECT_EQ(j["auto_map"]["AutoConfig"], "configuration_laplace.LaplaceConfig");
  EXPECT_EQ(j["auto_map"]["AutoModelForCausalLM"], "modeling_laplace.LaplaceForCausalLM");
  EXPECT_EQ(j["architectures"], nlohmann::json::array({"LaplaceForCausalLM"}));
  for (const auto& [k, v] : src.items()) EXPECT_EQ(j[k], v) << k;  // every field kept (eos_token_id too)
  EXPECT_EQ(j["eos_token_id"], 2);

  // The exported directory is still a model directory of ours.
  r = run_laplace("forward --model " + out.string() + " --tokens 1,2,3");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  // Exporting again over it, and in place, works.
  EXPECT_EQ(run_laplace("export hf --model " + src_.string() + " --out " + out.string()).exit_code, 0);
  r = run_laplace("export hf --model " + src_.string() + " --out " + src_.string());
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(fs::exists(src_ / "modeling_laplace.py"));
}

// `laplace train` leaves the same files at every save, so a trained directory loads in
// transformers without an export step.
TEST_F(CliExport, TrainWritesTheTransformersFilesToo) {
  std::vector<uint32_t> toks(4096);
  for (size_t i = 0; i < toks.size(); ++i) toks[i] = static_cast<uint32_t>((i * 7 + i / 5) % 61);
  ASSERT_TRUE(shard_write((dir_ / "train.bin").string(), toks, 61).is_ok());
  const fs::path out = dir_ / "trained";
  Result r = run_laplace("train --config " + (dir_ / "tiny.json").string() + " --data " + (dir_ / "train.bin").string() +
                         " --out " + out.string() + " --steps 2 --batch 2 --seq 8 --quiet");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* f : {"config.json", "model.safetensors", "configuration_laplace.py", "modeling_laplace.py"})
    EXPECT_TRUE(fs::exists(out / f)) << f;
  const auto j = nlohmann::json::parse(slurp(out / "config.json"));
  EXPECT_EQ(j["auto_map"]["AutoModelForCausalLM"], "modeling_laplace.LaplaceForCausalLM");
  EXPECT_EQ(j["hidden_size"], 16);
  const fs::path py = fs::path(LAPLACE_SOURCE_DIR) / "python" / "laplace";
  EXPECT_EQ(slurp(out / "modeling_laplace.py"), slurp(py / "modeling_laplace.py"));
  // Still ours too: it generates, and training resumes from it.
  r = run_laplace("forward --model " + out.string() + " --tokens 1,2,3");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  r = run_laplace("train --config " + (out / "config.json").string() + " --data " + (dir_ / "train.bin").string() +
                  " --out " + out.string() + " --steps 3 --batch 2 --seq 8 --resume auto --quiet");
  EXPECT_EQ(r.exit_code, 0) << r.output;
}

TEST_F(CliExport, WithoutTokenizerSaysSo) {
  Result r = run_laplace("export hf --model " + src_.string() + " --out " + (dir_ / "hf").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("has no tokenizer.model"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(dir_ / "hf" / "tokenizer.model"));
}

TEST_F(CliExport, MismatchedCheckpointsAreErrorsNamingTheTensor) {
  const fs::path out = dir_ / "hf";
  // tie_embeddings: the checkpoint's lm_head.weight is not a parameter any more.
  auto cfg = nlohmann::json::parse(kTiny);
  cfg["tie_embeddings"] = true;
  spit(src_ / "config.json", cfg.dump());
  Result r = run_laplace("export hf --model " + src_.string() + " --out " + out.string());
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("unexpected tensor lm_head.weight"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(out));
  // Another head size: the first layer's wqkvg has the wrong shape.
  cfg = nlohmann::json::parse(kTiny);
  cfg["head_v_dim"] = 4;
  spit(src_ / "config.json", cfg.dump());
  r = run_laplace("export hf --model " + src_.string() + " --out " + out.string());
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("tensor model.layers.0.wqkvg.weight has shape [48, 16], the config needs [32, 16]"),
            std::string::npos)
      << r.output;
  // More layers than the checkpoint has: the missing tensor is named.
  cfg = nlohmann::json::parse(kTiny);
  cfg["num_layers"] = 3;
  spit(src_ / "config.json", cfg.dump());
  r = run_laplace("export hf --model " + src_.string() + " --out " + out.string());
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("lacks tensor model.layers.2.norm1.weight"), std::string::npos) << r.output;
  // Not a laplace config.
  cfg = nlohmann::json::parse(kTiny);
  cfg["model_type"] = "llama";
  spit(src_ / "config.json", cfg.dump());
  r = run_laplace("export hf --model " + src_.string() + " --out " + out.string());
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("model_type"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(out));
}

TEST_F(CliExport, MissingInputsAreErrors) {
  Result r = run_laplace("export hf --model " + (dir_ / "nope").string() + " --out " + (dir_ / "o").string());
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("does not exist"), std::string::npos) << r.output;
  fs::remove(src_ / "model.safetensors");
  r = run_laplace("export hf --model " + src_.string() + " --out " + (dir_ / "o").string());
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("has no model.safetensors"), std::string::npos) << r.output;
  EXPECT_EQ(run_laplace("export hf --model " + src_.string()).exit_code, 2);  // --out is required
}

}  // namespace
}  // namespace laplace
