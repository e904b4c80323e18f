// `laplace bench serve`: the burst mode (all requests at once: the time until every first
// token is out), the rate sweep (the highest Poisson rate within the TTFT/TPOT p99 bounds, one
// JSON line per rate) and their argument errors, on a tiny random model on the CPU. Timings
// are not checked (no timed tests); what the modes count and record is.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench/bench_log.h"
#include "tests/test_util.h"

namespace laplace {
namespace {

namespace fs = std::filesystem;

using Result = testing::CliResult;
using testing::run_laplace;

std::vector<nlohmann::json> json_lines(const fs::path& p) {
  std::ifstream f(p);
  std::vector<nlohmann::json> v;
  for (std::string l; std::getline(f, l);)
    if (!l.empty()) v.push_back(nlohmann::json::parse(l));
  return v;
}

class BenchServe : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::make_temp_dir("bench_serve");
    std::ofstream(dir_ / "tiny.json") << R"({"model_type": "laplace", "vocab_size": 256, "hidden_size": 32,
      "num_layers": 2, "num_heads": 2, "head_k_dim": 8, "head_v_dim": 16, "ffn_size": 64, "chunk_size": 16})";
    base_ = "bench serve --config " + (dir_ / "tiny.json").string() + " --prefill-chunk 16 ";
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  fs::path dir_;
  std::string base_;
};

// The forwards the prefill took, from "... prefill tokens in N forwards".
long long prefill_forwards(const std::string& out) {
  std::smatch m;
  std::regex re("([0-9]+) prefill tokens in ([0-9]+) forwards");
  if (!std::regex_search(out, m, re)) return -1;
  return std::stoll(m[2]);
}

TEST_F(BenchServe, BurstRecordsAdmitTimeAndBatchesThePrefill) {
  const std::string res = (dir_ / "res.jsonl").string();
  const std::string args = base_ + "--burst --count 48 --prompt-len 16 --output-len 3 --max-slots 48 --results " + res;
  Result on = run_laplace(args + " --batch-prefill equal");
  ASSERT_EQ(on.exit_code, 0) << on.output;
  Result off = run_laplace(args + " --batch-prefill off");
  ASSERT_EQ(off.exit_code, 0) << off.output;
  EXPECT_NE(on.output.find("burst: every first token out"), std::string::npos) << on.output;
  EXPECT_EQ(prefill_forwards(off.output), 48) << off.output;  // one forward per prompt
  EXPECT_EQ(prefill_forwards(on.output), 1) << on.output;     // 48 pieces of 16 in one forward
  const auto lines = json_lines(res);
  ASSERT_EQ(lines.size(), 6u);
  EXPECT_EQ(lines[0]["bench"], "serve_burst_admit_s");
  EXPECT_EQ(lines[1]["bench"], "serve_burst_prefill_tok_s");
  EXPECT_GT(lines[0]["value"].get<double>(), 0);
  EXPECT_NE(lines[0]["note"].get<std::string>().find("48 requests at once"), std::string::npos);
  EXPECT_NE(lines[3]["note"].get<std::string>().find("batch prefill off"), std::string::npos);
}

TEST_F(BenchServe, RateSweepWritesAPointPerRateAndTheBestRate) {
  const fs::path out = dir_ / "sweep.jsonl", res = dir_ / "res.jsonl";
  Result r = run_laplace(base_ + "--rates 400,100 --count 12 --prompt-len 8 --prompt-len-max 24 --output-len 2 "
                                 "--output-len-max 6 --max-slots 8 --out " + out.string() + " --results " + res.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto pts = json_lines(out);
  ASSERT_EQ(pts.size(), 2u);
  EXPECT_EQ(pts[0]["rate"], 100.0);  // sorted
  EXPECT_EQ(pts[1]["rate"], 400.0);
  for (const auto& p : pts) {
    for (const char* k : {"req_s", "tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms"})
      EXPECT_TRUE(p[k].is_number()) << k;
    EXPECT_LE(p["ttft_p50_ms"].get<double>(), p["ttft_p99_ms"].get<double>());
    EXPECT_EQ(p["ttft_slo_ms"], 300.0);
  }
  const auto lines = json_lines(res);
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_EQ(lines[0]["bench"], "serve_max_rate_req_s");
  // The recorded rate is the highest one whose point says it met both bounds (0: none).
  double best = 0;
  for (const auto& p : pts)
    if (p["slo_met"].get<bool>()) best = std::max(best, p["rate"].get<double>());
  EXPECT_EQ(lines[0]["value"].get<double>(), best);
}

// The latency percentiles of bench serve and bench http: nearest rank, in any input order.
TEST(BenchLog, PercentileIsTheNearestRankAndMedianAveragesTheMiddle) {
  const std::vector<double> v = {5, 1, 4, 2, 3, 10, 9, 8, 7, 6};
  EXPECT_EQ(bench_percentile(v, 50), 5);
  EXPECT_EQ(bench_percentile(v, 99), 10);
  EXPECT_EQ(bench_percentile(v, 10), 1);
  EXPECT_EQ(bench_percentile(v, 11), 2);
  EXPECT_EQ(bench_percentile(v, 0), 1);
  EXPECT_EQ(bench_percentile({}, 99), 0);
  EXPECT_EQ(bench_median(v), 5.5);
  EXPECT_EQ(bench_median({3, 1, 2}), 2);
}

// A figure's commit is the working tree's, marked "-dirty" when tracked files differ from it.
TEST(BenchLog, CommitMarksATreeThatDiffersFromItsCommit) {
  if (std::system("git --version > /dev/null 2>&1") != 0) GTEST_SKIP() << "no git";
  const fs::path dir = fs::path(::testing::TempDir()) / ("bench_log_git_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  const std::string git = "git -C " + dir.string() + " ";
  std::ofstream(dir / "a.txt") << "one\n";
  ASSERT_EQ(std::system((git + "init -q && " + git + "add a.txt && " + git +
                         "-c user.name=t -c user.email=t@t commit -qm one").c_str()),
            0);
  const fs::path here = fs::current_path();
  const char* env = std::getenv("LAPLACE_COMMIT");
  const std::string saved = env ? env : "";
  ::unsetenv("LAPLACE_COMMIT");
  fs::current_path(dir);
  const std::string clean = BenchLog::commit_hash();
  std::ofstream(dir / "a.txt") << "two\n";
  const std::string dirty = BenchLog::commit_hash();
  const std::string given = BenchLog::commit_hash("abc1234");
  fs::current_path(here);
  if (env) ::setenv("LAPLACE_COMMIT", saved.c_str(), 1);
  fs::remove_all(dir);
  EXPECT_TRUE(std::regex_match(clean, std::regex("[0-9a-f]{7,}"))) << clean;
  EXPECT_EQ(dirty, clean + "-dirty");
  EXPECT_EQ(given, "abc1234");
}

TEST_F(BenchServe, BadArgumentsAreClearErrors) {
  struct Case {
    std::string args, says;
  } cases[] = {
      {"--rates 0,5", "'0' is not a positive rate"},
      {"--rates 5,x", "'x' is not a positive rate"},
      {"--burst --rates 5", "--burst or --rates, not both"},
      {"--out " + (dir_ / "o.jsonl").string(), "add --rates"},
      {"--rates 5 --out /nonexistent-dir/o.jsonl", "cannot write"},
      {"--batch-prefill sometimes", "batch-prefill"},
  };
  for (const Case& c : cases) {
    const Result r = run_laplace(base_ + "--count 2 --max-slots 2 --results '' " + c.args);
    EXPECT_NE(r.exit_code, 0) << c.args;
    EXPECT_NE(r.output.find(c.says), std::string::npos) << c.args << "\n" << r.output;
  }
}

}  // namespace
}  // namespace laplace
