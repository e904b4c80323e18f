// The `laplace` program end to end: sizes, and clear errors (exit code 1, never a
// crash) for bad configs, checkpoints and arguments.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <string>

#include <nlohmann/json.hpp>

#include "tests/test_util.h"

namespace laplace {
namespace {

struct CmdResult {
  int exit_code = -1;
  bool crashed = false;
  std::string output;
};

CmdResult run(const std::string& args) {
  CmdResult r;
  std::string cmd = std::string(LAPLACE_BINARY) + " " + args + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return r;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) r.output.append(buf.data(), n);
  int st = pclose(p);
  if (WIFEXITED(st)) r.exit_code = WEXITSTATUS(st);
  r.crashed = WIFSIGNALED(st) || r.exit_code > 1;  // sanitizers exit with other codes
  return r;
}

void write(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary);
  f << text;
}

const std::string kSrc = LAPLACE_SOURCE_DIR;

TEST(Cli, Info3bPrintsSpecSizes) {
  CmdResult r = run("info --config " + kSrc + "/configs/laplace-3b.json");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("body_params=2717908992\n"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("total_params=3284740608\n"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("state_bytes_per_sequence=29491200\n"), std::string::npos) << r.output;
}

// The real-model presets (docs/quality.md): the shapes of the published small-model anchors.
TEST(Cli, InfoPrintsThe125mAnd350mCounts) {
  CmdResult a = run("info --config " + kSrc + "/configs/laplace-125m.json");
  ASSERT_EQ(a.exit_code, 0) << a.output;
  EXPECT_NE(a.output.find("body_params=84934656\n"), std::string::npos) << a.output;
  EXPECT_NE(a.output.find("total_params=135343872\n"), std::string::npos) << a.output;
  EXPECT_NE(a.output.find("state_bytes_per_sequence=3686400\n"), std::string::npos) << a.output;
  CmdResult b = run("info --config " + kSrc + "/configs/laplace-350m.json");
  ASSERT_EQ(b.exit_code, 0) << b.output;
  EXPECT_NE(b.output.find("body_params=283115520\n"), std::string::npos) << b.output;
  EXPECT_NE(b.output.find("total_params=350427648\n"), std::string::npos) << b.output;
}

TEST(Cli, BadConfigsFailCleanly) {
  std::string dir = testing::make_temp_dir("cli");
  const std::pair<std::string, std::string> cases[] = {
      {"{not json", "not valid JSON"},
      {R"({"model_type": "laplace"})", "missing"},
      {R"({"model_type": "laplace", "vocab_size": 256, "hidden_size": -64, "num_layers": 2, "num_heads": 2,
          "head_k_dim": 16, "head_v_dim": 32, "ffn_size": 256})", "hidden_size"},
  };
  int i = 0;
  for (const auto& [text, needle] : cases) {
    std::string path = dir + "/bad" + std::to_string(i++) + ".json";
    write(path, text);
    CmdResult r = run("info --config " + path);
    EXPECT_EQ(r.exit_code, 1) << r.output;
    EXPECT_FALSE(r.crashed);
    EXPECT_NE(r.output.find(needle), std::string::npos) << r.output;
  }
  CmdResult r = run("info --config " + dir + "/missing.json");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find("missing.json"), std::string::npos);
}

TEST(Cli, CorruptCheckpointFailsCleanly) {
  std::string dir = testing::make_temp_dir("cli_ckpt");
  CmdResult init = run("init --config " + kSrc + "/configs/laplace-tiny.json --out " + dir + "/m --seed 1");
  ASSERT_EQ(init.exit_code, 0) << init.output;
  // A healthy checkpoint works.
  CmdResult ok = run("forward --model " + dir + "/m --tokens 1,2,3");
  ASSERT_EQ(ok.exit_code, 0) << ok.output;
  // Truncated, garbage and wrong-config checkpoints do not.
  std::ifstream in(dir + "/m/model.safetensors", std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  write(dir + "/trunc.safetensors", bytes.substr(0, bytes.size() / 2));
  write(dir + "/garbage.safetensors", "\xff\xff\xff\xff\xff\xff\xff\x7fhello");
  for (const char* f : {"trunc", "garbage"}) {
    CmdResult r = run("forward --model " + dir + "/m --ckpt " + dir + "/" + f + ".safetensors --tokens 1,2,3");
    EXPECT_EQ(r.exit_code, 1) << r.output;
    EXPECT_FALSE(r.crashed);
    EXPECT_NE(r.output.find("error"), std::string::npos);
  }
  CmdResult other = run("init --config " + kSrc + "/configs/laplace-tiny.json --out " + dir + "/m2 --seed 2");
  ASSERT_EQ(other.exit_code, 0);
  write(dir + "/small.json", R"({"model_type": "laplace", "vocab_size": 256, "hidden_size": 64, "num_layers": 2,
      "num_heads": 2, "head_k_dim": 16, "head_v_dim": 32, "ffn_size": 256})");
  CmdResult wrong = run("forward --config " + dir + "/small.json --ckpt " + dir + "/m2/model.safetensors --tokens 1,2");
  EXPECT_EQ(wrong.exit_code, 1) << wrong.output;
  EXPECT_NE(wrong.output.find("shape"), std::string::npos) << wrong.output;
}

TEST(Cli, BadArgumentsFailCleanly) {
  std::string dir = testing::make_temp_dir("cli_args");
  ASSERT_EQ(run("init --config " + kSrc + "/configs/laplace-tiny.json --out " + dir + "/m").exit_code, 0);
  const char* cases[] = {
      "forward --model DIR --tokens 1,x,3",
      "forward --model DIR --tokens 1,,3",
      "forward --model DIR --tokens 1,99999999",
      "forward --model DIR --tokens '1,2;3'",
      "generate --model DIR --prompt-ids 1,-2",
      "generate --model DIR",
      "forward --model DIR/nothing --tokens 1",
  };
  for (std::string c : cases) {
    for (size_t p; (p = c.find("DIR")) != std::string::npos;) c.replace(p, 3, dir + "/m");
    CmdResult r = run(c);
    EXPECT_EQ(r.exit_code, 1) << c << "\n" << r.output;
    EXPECT_FALSE(r.crashed) << c;
  }
}

// generate and eval take text through the model directory's tokenizer.
TEST(Cli, GenerateAndEvalAcceptText) {
  std::string dir = testing::make_temp_dir("cli_text");
  std::string corpus;
  const char* words[] = {"alpha", "beta", "gamma", "delta", "stone", "river", "cloud", "light"};
  for (int i = 0; i < 400; ++i)
    corpus += std::string(words[i % 8]) + " " + words[(i * 5 + 3) % 8] + " " + words[(i * 3 + 1) % 8] + ".\n";
  write(dir + "/corpus.txt", corpus);
  CmdResult tok = run("tokenizer train --input " + dir + "/corpus.txt --model-prefix " + dir + "/tok --vocab-size 300");
  ASSERT_EQ(tok.exit_code, 0) << tok.output;
  write(dir + "/config.json", R"({"model_type": "laplace", "vocab_size": 300, "hidden_size": 32, "num_layers": 2,
      "num_heads": 2, "head_k_dim": 8, "head_v_dim": 16, "ffn_size": 64, "chunk_size": 16})");
  ASSERT_EQ(run("init --config " + dir + "/config.json --out " + dir + "/m").exit_code, 0);
  ASSERT_EQ(std::system(("cp " + dir + "/tok.model " + dir + "/m/tokenizer.model").c_str()), 0);
  CmdResult gen = run("generate --model " + dir + "/m --prompt 'alpha beta' --max-tokens 5");
  ASSERT_EQ(gen.exit_code, 0) << gen.output;
  EXPECT_NE(gen.output.find("text=alpha beta"), std::string::npos) << gen.output;
  CmdResult ev = run("eval --model " + dir + "/m --text " + dir + "/corpus.txt --seq 32");
  ASSERT_EQ(ev.exit_code, 0) << ev.output;
  EXPECT_NE(ev.output.find("perplexity="), std::string::npos) << ev.output;
  CmdResult enc = run("tokenizer encode --tokenizer " + dir + "/tok.model --text 'river light'");
  ASSERT_EQ(enc.exit_code, 0) << enc.output;
  CmdResult dec = run("tokenizer decode --tokenizer " + dir + "/tok.model --ids " + enc.output.substr(0, enc.output.size() - 1));
  ASSERT_EQ(dec.exit_code, 0) << dec.output;
  EXPECT_EQ(dec.output, "river light\n");
  // Every --dtype its help offers on the CPU generates (f64 used to abort on the state pool's
  // dtype), and f64 gives the same greedy ids as f32 on this model.
  CmdResult g32 = run("generate --model " + dir + "/m --prompt-ids 5,6,7 --max-tokens 8 --dtype f32");
  CmdResult g64 = run("generate --model " + dir + "/m --prompt-ids 5,6,7 --max-tokens 8 --dtype f64");
  ASSERT_EQ(g32.exit_code, 0) << g32.output;
  ASSERT_EQ(g64.exit_code, 0) << g64.output;
  const auto ids_line = [](const std::string& out) {
    const size_t p = out.find("ids=");
    return p == std::string::npos ? std::string() : out.substr(p, out.find('\n', p) - p);
  };
  EXPECT_NE(ids_line(g32.output), "") << g32.output;
  EXPECT_EQ(ids_line(g64.output), ids_line(g32.output));
  // Without a tokenizer, text is refused with a clear message.
  std::remove((dir + "/m/tokenizer.model").c_str());
  CmdResult no = run("generate --model " + dir + "/m --prompt 'alpha'");
  EXPECT_EQ(no.exit_code, 1);
  EXPECT_NE(no.output.find("tokenizer"), std::string::npos);
}

// `bench decode --compare-prompt-len`: the decode after the first prompt length, after the
// second, then after the first again; the change is reported against the mean of the two
// first-length runs, each figure as a JSON line.
TEST(Cli, BenchDecodeComparesPromptLengthsAgainstABaselineBeforeAndAfter) {
  std::string dir = testing::make_temp_dir("cli_bench");
  const std::string results = dir + "/r.jsonl";
  CmdResult r = run("bench decode --config " + kSrc + "/configs/laplace-tiny.json --device cpu --batch 2 --steps 2 " +
                    "--warmup 1 --prompt-len 4 --prefill-chunk 4 --compare-prompt-len 12 --tag t --results " + results);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("decode after 12-token prompts"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(" after: "), std::string::npos) << r.output;
  std::ifstream f(results);
  std::map<std::string, double> v;
  for (std::string line; std::getline(f, line);) {
    const nlohmann::json j = nlohmann::json::parse(line);
    v[j.at("bench").get<std::string>()] = j.at("value").get<double>();
  }
  for (const char* name : {"decode_ms_per_step_t", "decode_ms_per_step_prompt12_t", "decode_ms_per_step_prompt4_t",
                           "decode_baseline_drift_pct_prompt4_t", "decode_cost_increase_pct_prompt4_to_12"}) {
    ASSERT_EQ(v.count(name), 1u) << name;
    EXPECT_TRUE(std::isfinite(v[name])) << name;
  }
  // The baseline is the mean of the runs before and after, the change is against it, and the
  // drift relates the two: all three from the recorded step times.
  const double before = v["decode_ms_per_step_t"], base = v["decode_ms_per_step_prompt4_t"];
  const double after = 2 * base - before, longer = v["decode_ms_per_step_prompt12_t"];
  EXPECT_GT(after, 0);
  EXPECT_NEAR(v["decode_baseline_drift_pct_prompt4_t"], 100 * (after / before - 1), 1e-6 * std::abs(after / before) * 100);
  EXPECT_NEAR(v["decode_cost_increase_pct_prompt4_to_12"], 100 * (longer / base - 1), 1e-9 + 1e-6 * std::abs(longer / base) * 100);
}

}  // namespace
}  // namespace laplace
