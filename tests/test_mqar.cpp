// `laplace eval mqar` (eval/mqar.h): the generated task's structure and determinism, the
// answer mask, the shard the trainer reads, argument validation, a CPU toy that must learn
// to recall, and byte-identical output from two runs of the same grid.
#include <gtest/gtest.h>
#include <omp.h>
#include <sys/wait.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

#include "core/file_util.h"
#include "eval/mqar.h"
#include "tests/test_util.h"
#include "text/data_loader.h"

namespace laplace {
namespace {

MqarGenerator make_gen(int64_t V, int64_t T, int64_t P, double a = 0.01) {
  MqarGenerator g;
  const Status st = MqarGenerator::create(MqarTask{V, T, P, a}, &g);
  EXPECT_TRUE(st.is_ok()) << st.to_string();
  return g;
}

TEST(Mqar, ExamplesHaveZoologysLayout) {
  const int64_t V = 128, T = 96, P = 8;
  MqarGenerator g = make_gen(V, T, P);
  std::vector<int32_t> toks, ans;
  g.examples(7, 0, 200, &toks, &ans);
  for (int64_t e = 0; e < 200; ++e) {
    const int32_t* x = toks.data() + e * T;
    const int32_t* y = ans.data() + e * T;
    std::set<int32_t> keys, values;
    for (int64_t i = 0; i < P; ++i) {
      EXPECT_GE(x[2 * i], 1);
      EXPECT_LT(x[2 * i], V / 2);
      EXPECT_GE(x[2 * i + 1], V / 2);
      EXPECT_LT(x[2 * i + 1], V);
      keys.insert(x[2 * i]);
      values.insert(x[2 * i + 1]);
      EXPECT_EQ(y[2 * i], -1);
      EXPECT_EQ(y[2 * i + 1], -1);
    }
    ASSERT_EQ(keys.size(), static_cast<size_t>(P)) << "keys must be distinct";
    ASSERT_EQ(values.size(), static_cast<size_t>(P)) << "values must be distinct";
    // After the storage phase every key appears exactly once, at an even offset, followed by
    // its value; that position and no other holds an answer.
    int64_t queries = 0;
    for (int64_t t = 2 * P; t < T; ++t) {
      if (!keys.count(x[t])) {
        EXPECT_EQ(y[t], -1) << "example " << e << " position " << t;
        continue;
      }
      ++queries;
      EXPECT_EQ((t - 2 * P) % 2, 0);
      ASSERT_LT(t + 1, T);
      int64_t i = 0;
      while (x[2 * i] != x[t]) ++i;
      EXPECT_EQ(x[t + 1], x[2 * i + 1]) << "a query's next token is its value";
      EXPECT_EQ(y[t], x[2 * i + 1]);
    }
    EXPECT_EQ(queries, P);
  }
}

TEST(Mqar, DeterministicPerSeedAndIndex) {
  MqarGenerator g = make_gen(64, 32, 4);
  std::vector<int32_t> a, b, c, ans;
  g.examples(3, 0, 10, &a, &ans);
  g.examples(3, 4, 3, &b, nullptr);  // examples 4..6 alone: the same as inside the larger draw
  EXPECT_TRUE(std::equal(b.begin(), b.end(), a.begin() + 4 * 32));
  g.examples(3, 0, 10, &b, nullptr);
  EXPECT_EQ(a, b);
  g.examples(4, 0, 10, &c, nullptr);
  EXPECT_NE(a, c);
  // Pinned bits (integer arithmetic only, the same on every platform): a change to the
  // generator changes every stored result, so it shows up here first.
  EXPECT_EQ(std::vector<int32_t>(a.begin(), a.begin() + 32),
            (std::vector<int32_t>{31, 42, 24, 60, 9, 40, 23, 56, 24, 60, 41, 58, 2, 56, 23, 56,
                                  31, 42, 9, 40, 17, 34, 46, 36, 47, 15, 28, 43, 35, 17, 18, 11}));
}

TEST(Mqar, QueryGapsFollowThePowerLaw) {
  // a = 0.01: p(gap g) ∝ (g+1)^−0.99, so the first slot is drawn first far more often than
  // the last; a = 1: uniform.
  const int64_t T = 64, P = 1, n = 4000;  // one pair: its query slot is the single draw
  for (double a : {0.01, 1.0}) {
    MqarGenerator g = make_gen(64, T, P, a);
    std::vector<int32_t> toks, ans;
    g.examples(11, 0, n, &toks, &ans);
    std::vector<int64_t> hist(static_cast<size_t>((T - 2 * P) / 2), 0);
    for (int64_t e = 0; e < n; ++e)
      for (int64_t t = 2 * P; t < T; ++t)
        if (ans[e * T + t] >= 0) ++hist[(t - 2 * P) / 2];
    const double slots = static_cast<double>(hist.size());
    if (a < 1) {
      // Σ_{g=1..31} g^−0.99 ≈ 4.0: slot 0 holds about a quarter of the draws, slot 30 under 1%.
      EXPECT_GT(hist[0], n / 5);
      EXPECT_LT(hist.back(), n / 50);
    } else {
      for (int64_t h : hist) EXPECT_NEAR(static_cast<double>(h), n / slots, 5 * std::sqrt(n / slots));
    }
  }
}

TEST(Mqar, InvalidTasksAreRejected) {
  struct Case {
    MqarTask t;
    const char* message;
  } cases[] = {
      {{8192, 60, 16, 0.01}, "seq must be ≥ 4·pairs = 64"},
      {{16, 64, 8, 0.01}, "vocab must be ≥ 2·pairs + 2 = 18"},
      {{8192, 64, 0, 0.01}, "pairs must be in [1, 16384]"},
      {{8192, 2, 1, 0.01}, "seq must be in [4, 65536]"},
      {{8192, 64, 4, 0.0}, "power_a must be in (0, 1]"},
      {{2, 64, 4, 0.01}, "vocab must be in [4, 1048576]"},
  };
  for (const Case& c : cases) {
    MqarGenerator g;
    const Status st = MqarGenerator::create(c.t, &g);
    EXPECT_EQ(st.code(), Status::Code::kInvalidArgument);
    EXPECT_NE(st.message().find(c.message), std::string::npos) << st.message();
  }
  EXPECT_TRUE((MqarTask{18, 32, 8, 0.01}.validate().is_ok()));  // the bounds themselves fit
}

TEST(Mqar, MaskKeepsExactlyTheAnswers) {
  const int64_t T = 48, P = 6, B = 50;
  MqarGenerator g = make_gen(40, T, P);
  std::vector<int32_t> toks, ans;
  g.examples(5, 0, B, &toks, &ans);
  // The trainer's targets: the next token of the stream.
  std::vector<int32_t> y(toks.size());
  for (size_t i = 0; i + 1 < toks.size(); ++i) y[i] = toks[i + 1];
  y.back() = 0;
  mqar_mask_targets(g.task(), toks.data(), y.data(), B, T);
  EXPECT_EQ(y, ans);
}

TEST(Mqar, ShardWindowsAreTheExamples) {
  const std::string dir = testing::make_temp_dir("mqar_shard");
  const int64_t T = 32, n = 20;
  MqarGenerator g = make_gen(64, T, 4);
  ASSERT_TRUE(mqar_write_shard(g, 9, n, dir + "/train_000000.bin").is_ok());
  DataLoaderOptions o;
  o.shards = {dir + "/train_000000.bin"};
  o.batch_size = 4;
  o.seq_len = T;
  o.shuffle = true;
  o.seed = 1;
  o.vocab_size = 64;
  DataLoader dl;
  ASSERT_TRUE(DataLoader::open(o, &dl).is_ok());
  EXPECT_EQ(dl.batches_per_epoch(), n / 4);
  std::vector<int32_t> all, x, y;
  g.examples(9, 0, n, &all, nullptr);
  std::set<int64_t> seen;
  for (int64_t b = 0; b < n / 4; ++b) {
    dl.next(&x, &y);
    for (int64_t r = 0; r < 4; ++r) {
      int64_t found = -1;
      for (int64_t e = 0; e < n; ++e)
        if (std::equal(x.begin() + r * T, x.begin() + r * T + T, all.begin() + e * T)) found = e;
      ASSERT_GE(found, 0) << "a window that is not an example";
      seen.insert(found);
    }
  }
  EXPECT_EQ(seen.size(), static_cast<size_t>(n));
  std::filesystem::remove_all(dir);
}

TEST(Mqar, GridListsAreValidated) {
  std::vector<int64_t> v;
  EXPECT_TRUE(mqar_parse_int_list("4, 8,16", "--pairs", 1, 100, &v).is_ok());
  EXPECT_EQ(v, (std::vector<int64_t>{4, 8, 16}));
  const std::pair<const char*, const char*> bad_ints[] = {
      {"", "empty list"},     {"4,,8", "empty item"},          {"4,x", "'x' is not an integer"},
      {"4.5", "not an integer"}, {"0", "0 is outside [1, 100]"}, {"4,101", "101 is outside"},
      {"8,8", "8 is listed twice"}, {"-4", "outside"},
  };
  for (const auto& [text, msg] : bad_ints) {
    const Status st = mqar_parse_int_list(text, "--pairs", 1, 100, &v);
    EXPECT_EQ(st.code(), Status::Code::kInvalidArgument) << text;
    EXPECT_NE(st.message().find(msg), std::string::npos) << text << ": " << st.message();
    EXPECT_EQ(st.message().rfind("--pairs: ", 0), 0u) << st.message();
  }
  std::vector<MqarStateShape> s;
  EXPECT_TRUE(mqar_parse_state_sizes("2x16x32,4x32x64", &s).is_ok());
  ASSERT_EQ(s.size(), 2u);
  EXPECT_EQ(s[1].name(), "4x32x64");
  const std::pair<const char*, const char*> bad_states[] = {
      {"4x32", "is not HxDKxDV"}, {"2x16x32x1", "is not HxDKxDV"}, {"2X16X32", "is not HxDKxDV"},
      {"0x16x16", "heads must be in [1, 64]"}, {"2x200x16", "dk must be in [1, 128]"},
      {"2x16x300", "dv must be in [1, 256]"}, {"2x16x16,2x16x16", "listed twice"}, {"", "empty list"},
  };
  for (const auto& [text, msg] : bad_states) {
    const Status st = mqar_parse_state_sizes(text, &s);
    EXPECT_EQ(st.code(), Status::Code::kInvalidArgument) << text;
    EXPECT_NE(st.message().find(msg), std::string::npos) << text << ": " << st.message();
  }
}

TEST(Mqar, OptionsAreValidated) {
  MqarOptions o;
  o.vocab = 64;
  o.pairs = {4, 64};
  o.seq_lens = {64};
  EXPECT_TRUE(o.validate().is_ok());  // 64 pairs do not fit seq 64, but 4 do: that point is skipped
  EXPECT_TRUE(o.fits(4, 64));
  EXPECT_FALSE(o.fits(64, 64));
  o.pairs = {64};
  Status st = o.validate();
  EXPECT_NE(st.message().find("no (pairs, seq) combination of the grid fits"), std::string::npos) << st.message();
  o.pairs = {4};
  o.dtype = DType::kBF16;
  EXPECT_EQ(o.validate().code(), Status::Code::kUnsupported);
  o.dtype = DType::kF32;
  o.steps = 0;
  EXPECT_NE(o.validate().message().find("--steps must be in [1,"), std::string::npos);
  o.steps = 10;
  o.lr = 0;
  EXPECT_NE(o.validate().message().find("--lr"), std::string::npos);
  o.lr = 1e-3;
  o.chunk = 0;
  EXPECT_NE(o.validate().message().find("--chunk"), std::string::npos);
}

// ---- end to end ---------------------------------------------------------------------------------

using CmdResult = testing::CliResult;

CmdResult run(const std::string& args, bool with_stderr = true) { return testing::run_laplace(args, with_stderr); }

std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

TEST(MqarCli, BadArgumentsFailCleanly) {
  const std::pair<const char*, const char*> cases[] = {
      {"--pairs 4,x", "--pairs: 'x' is not an integer"},
      {"--pairs 4,,8", "--pairs: empty item"},
      {"--seq-lens 64,2", "--seq-lens: 2 is outside [4, 65536]"},
      {"--state-sizes 2x16", "--state-sizes: '2x16' is not HxDKxDV"},
      {"--pairs 32 --seq-lens 64", "32 pairs do not fit a sequence of 64 tokens"},
      {"--vocab 16 --pairs 8 --seq-lens 64", "vocab must be ≥ 2·pairs + 2 = 18"},
      {"--dtype bf16", "--dtype bf16 needs --device cuda"},
      {"--dtype f16", "unknown dtype 'f16'"},
      {"--steps 0", "--steps must be in [1, 1073741824], got 0"},
  };
  for (const auto& [args, msg] : cases) {
    const CmdResult r = run(std::string("eval mqar --quiet ") + args);
    EXPECT_EQ(r.exit_code, 1) << args << "\n" << r.output;
    EXPECT_NE(r.output.find(msg), std::string::npos) << args << "\n" << r.output;
  }
  EXPECT_EQ(run("eval mqar --device tpu").exit_code, 2);  // malformed command line (CLI11)
}

// A toy grid: two state sizes, three pair counts (one of which does not fit seq 16 and is
// skipped), a few steps each. Twice, with the same seed: the same bytes.
TEST(MqarCli, SameSeedSameBytes) {
  const std::string dir = testing::make_temp_dir("mqar_det");
  const std::string grid =
      "eval mqar --vocab 32 --dim 16 --layers 1 --state-sizes 1x8x8,2x8x4 --pairs 2,4,8 --seq-lens 16 "
      "--steps 12 --batch 4 --eval-examples 24 --eval-batch 5 --lr 1e-2 --seed 5 --quiet";
  const CmdResult a = run(grid + " --out " + dir + "/a --results " + dir + "/results.jsonl --tag t", false);
  const CmdResult b = run(grid + " --out " + dir + "/b", false);
  ASSERT_EQ(a.exit_code, 0) << a.output;
  ASSERT_EQ(b.exit_code, 0) << b.output;
  const std::string ja = slurp(dir + "/a/mqar.jsonl"), jb = slurp(dir + "/b/mqar.jsonl");
  EXPECT_FALSE(ja.empty());
  EXPECT_EQ(ja, jb);
  // stdout: the table (a's also has the results lines after it).
  EXPECT_EQ(a.output.substr(0, b.output.size()), b.output);

  std::istringstream lines(ja);
  std::string line;
  int n = 0;
  std::set<int64_t> pairs;
  while (std::getline(lines, line)) {
    const auto j = nlohmann::json::parse(line);
    ++n;
    pairs.insert(j["pairs"].get<int64_t>());
    EXPECT_EQ(j["seq"], 16);
    EXPECT_EQ(j["total"].get<int64_t>(), 24 * j["pairs"].get<int64_t>());
    const auto st = j["state"].get<std::string>();
    const int64_t bytes = st == "1x8x8" ? 1 * (1 * 8 * 8 + 4 * 16) * 4 : 1 * (2 * 8 * 4 + 4 * 16) * 4;
    EXPECT_EQ(j["state_bytes"].get<int64_t>(), bytes) << st;
    EXPECT_DOUBLE_EQ(j["chance"].get<double>(), 1.0 / 16);
  }
  EXPECT_EQ(n, 4);
  EXPECT_EQ(pairs, (std::set<int64_t>{2, 4}));
  // The point that does not fit is named on stderr before any training.
  const CmdResult c = run(grid);
  ASSERT_EQ(c.exit_code, 0) << c.output;
  EXPECT_NE(c.output.find("skipping pairs 8 at seq 16: MQAR (vocab 32, seq 16, pairs 8): 8 pairs do not fit"),
            std::string::npos)
      << c.output;

  // --results: one line per point in bench/results.jsonl's format, with the command.
  std::istringstream res(slurp(dir + "/results.jsonl"));
  n = 0;
  while (std::getline(res, line)) {
    const auto j = nlohmann::json::parse(line);
    ++n;
    for (const char* k : {"bench", "value", "unit", "device", "commit", "date", "note", "command"})
      EXPECT_TRUE(j.contains(k)) << k << " in " << line;
    EXPECT_EQ(j["bench"].get<std::string>().rfind("mqar_acc_", 0), 0u) << line;
    EXPECT_NE(j["command"].get<std::string>().find("eval mqar"), std::string::npos);
  }
  EXPECT_EQ(n, 4);
  EXPECT_NE(ja.find("\"state\":\"2x8x4\",\"heads\":2,\"dk\":8,\"dv\":4"), std::string::npos) << ja;
  EXPECT_NE(slurp(dir + "/results.jsonl").find("\"bench\":\"mqar_acc_2x8x4_p4_t16_t\""), std::string::npos);
  std::filesystem::remove_all(dir);
}

// The CPU toy: 4 pairs at seq 32 (vocabulary 64, so chance is 1/32 and a model that only
// learnt to name some value of its context gets about 1/4). The trained model must recall well
// above both, the untrained one must not. Recall appears late (accuracy 0.17 after 200 steps,
// 0.20 after 400, 0.27 after 600, 0.70 after 800), so the steps stay; the run is one thread,
// whose bits are those of any thread count: the model is so small that two threads spend most
// of each step waiting for each other, and on 2 shared cores (ctest -j2) took ~6 times as long
// (124 s alone against 22 s on one thread; 345 s beside the other tests).
TEST(MqarToy, LearnsToRecallFourPairs) {
  struct OneThread {
    int saved = omp_get_max_threads();
    OneThread() { omp_set_num_threads(1); }
    ~OneThread() { omp_set_num_threads(saved); }
  } one_thread;
  MqarOptions o;
  o.vocab = 64;
  o.dim = 64;
  o.layers = 2;
  o.states = {{2, 16, 16}};
  o.pairs = {4};
  o.seq_lens = {32};
  o.batch = 16;
  o.lr = 3e-3;
  o.eval_examples = 256;
  o.seed = 1;
  o.quiet = true;
  std::vector<MqarResult> rs;
  o.steps = 1;
  ASSERT_TRUE(mqar_run_grid(o, [&](const MqarResult& r) { rs.push_back(r); }).is_ok());
  o.steps = 800;
  ASSERT_TRUE(mqar_run_grid(o, [&](const MqarResult& r) { rs.push_back(r); }).is_ok());
  ASSERT_EQ(rs.size(), 2u);
  EXPECT_EQ(rs[0].total, 256 * 4);
  EXPECT_DOUBLE_EQ(rs[0].chance, 1.0 / 32);
  std::printf("MQAR toy: untrained accuracy %.4f, trained (800 steps) %.4f, training loss %.3f\n",
              rs[0].accuracy(), rs[1].accuracy(), rs[1].train_loss);
  EXPECT_LT(rs[0].accuracy(), 0.15);
  EXPECT_GT(rs[1].accuracy(), 0.35);
}

}  // namespace
}  // namespace laplace
