// Distributed training (docs/distributed.md, issue 7): the Communicator, the global-shape plan, and
// `mpirun -np P laplace train` end to end on a model small enough that some Muon units
// have fewer rows than ranks and some ranks hold empty shards.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include <nlohmann/json.hpp>

#include "core/file_util.h"
#include "distributed/comm.h"
#include "distributed/fsdp_layout.h"
#include "distributed/plan.h"
#include "distributed/sharded_parameters.h"
#include "model/config.h"
#include "model/weights.h"
#include "tests/test_util.h"
#include "text/shard.h"

namespace laplace {
namespace {

namespace fs = std::filesystem;

// ---- Communicator (P = 1) and the plan: in process ---------------------------------------------

TEST(DistComm, SingleProcessCollectivesAreCopiesAndCountNothing) {
  SingleCommunicator c;
  float a[3] = {1.5f, -2.f, 3.f}, b[3] = {};
  c.all_gather(a, b, {3}, {0}, CommType::kF32);
  EXPECT_EQ(0, std::memcmp(a, b, sizeof a));
  double d[2] = {0.25, 4.0}, e[2] = {};
  c.reduce_scatter(d, e, {2}, CommType::kF64);
  EXPECT_EQ(e[0], 0.25);
  EXPECT_EQ(e[1], 4.0);
  int64_t i[2] = {7, -9};
  c.all_reduce(i, 2, CommType::kI64);
  EXPECT_EQ(i[0], 7);
  EXPECT_EQ(i[1], -9);
  uint16_t h[2] = {0x3f80, 0x4000}, g[2] = {};
  c.all_to_all(h, {2}, {0}, g, {2}, {0}, CommType::kBF16);
  EXPECT_EQ(g[0], 0x3f80);
  EXPECT_EQ(g[1], 0x4000);
  EXPECT_EQ(c.stats().bytes_sent, 0);
  EXPECT_EQ(c.stats().bytes_received, 0);
  EXPECT_EQ(c.stats().calls, 3);  // reduce_scatter on one rank adds its part where it lies; all_reduce is one all_gather
}

TEST(DistPlan, RowShardsCoverRowsWithoutPaddingLastRanksShortOrEmpty) {
  for (int64_t rows : {0, 1, 2, 3, 5, 6, 7, 64, 97})
    for (int P : {1, 2, 3, 4, 7}) {
      const int64_t chunk = (rows + P - 1) / P;
      int64_t next = 0;
      for (int r = 0; r < P; ++r) {
        RowRange s = shard_rows(rows, r, P);
        EXPECT_EQ(s.begin, std::min(rows, next)) << rows << " rows, P " << P << ", rank " << r;
        EXPECT_LE(s.rows(), chunk);
        EXPECT_GE(s.rows(), 0);
        if (r > 0 && s.rows() > 0) {
          EXPECT_EQ(shard_rows(rows, r - 1, P).rows(), chunk);
        }
        next = s.end;
      }
      EXPECT_EQ(next, rows);
    }
  EXPECT_EQ(shard_rows(5, 3, 4), (RowRange{5, 5}));  // ⌈5/4⌉ = 2: [0,2) [2,4) [4,5) [5,5)
}

TEST(DistPlan, OwnersAreDeterministicBalancedAndHashed) {
  Config c;
  ASSERT_TRUE(config_load(std::string(LAPLACE_SOURCE_DIR) + "/configs/laplace-3b.json", &c).is_ok());
  const auto params = sharded_params(c, false);
  const auto u64 = assign_muon_owners(params, 64);
  ASSERT_EQ(u64.size(), 24u * 8u);  // q k v g | W_o | a b | W_3 per layer
  EXPECT_EQ(muon_plan_hash(u64, 64), muon_plan_hash(assign_muon_owners(params, 64), 64));
  EXPECT_NE(muon_plan_hash(u64, 64), muon_plan_hash(assign_muon_owners(params, 63), 63));
  auto cost = owner_costs(u64, 64);
  double mx = 0, sum = 0;
  for (double x : cost) mx = std::max(mx, x), sum += x;
  EXPECT_LT(mx / (sum / 64), 1.3);  // greedy largest-first keeps every rank near the mean
  // The formula's headline: gather moves ≈ 2M per rank, all_to_all ≈ 4M/P.
  const auto g = muon_traffic(params, u64, 64, MuonComm::kGather, 2);
  const auto a = muon_traffic(params, u64, 64, MuonComm::kAllToAll, 2);
  double M = 0;
  for (const auto& p : params)
    if (p.muon) M += 2.0 * static_cast<double>(p.rows * p.cols);
  double gmean = 0, amean = 0;
  for (int r = 0; r < 64; ++r) {
    gmean += static_cast<double>(g[r].sent + g[r].received) / 64;
    amean += static_cast<double>(a[r].sent + a[r].received) / 64;
    EXPECT_EQ(a[r].sent, a[r].received);
  }
  EXPECT_NEAR(gmean / (2 * M), 1.0, 0.02);
  EXPECT_NEAR(amean / (4 * M / 64), 1.0, 0.05);
}

// The end-to-end tests need this build's MPI communicator and an mpirun on the PATH.
#define REQUIRE_MPIRUN()                                                                   \
  do {                                                                                     \
    if (!mpi_available()) GTEST_SKIP() << "built without MPI (install libopenmpi-dev)";   \
    if (std::system("command -v mpirun >/dev/null 2>&1") != 0) GTEST_SKIP() << "no mpirun"; \
  } while (0)

// ---- end to end under mpirun -----------------------------------------------------------------

// V37 D6 L1 H1 dk2 dv3 F5: Muon units q,k (2 rows), v,g (3), W_o (6), a,b (5), W_3 (6);
// at P = 4 the D = 6-row params shard as 2,2,2,0 and onorm [3] as 1,1,1,0.
const char* kConfig = R"({"model_type": "laplace", "vocab_size": 37, "hidden_size": 6, "num_layers": 1,
  "num_heads": 1, "head_k_dim": 2, "head_v_dim": 3, "ffn_size": 5, "conv_size": 4, "chunk_size": 8})";

struct DistFixture {
  std::string dir, config, shard, flags;
  explicit DistFixture(const char* config_json = kConfig, uint32_t vocab = 37, std::string common_flags = "") {
    flags = std::move(common_flags);
    dir = testing::make_temp_dir("dist");
    config = dir + "/config.json";
    std::ofstream(config) << config_json;
    std::vector<uint32_t> toks(4000);
    std::mt19937 rng(3);
    uint32_t t = 0;
    for (auto& x : toks) x = t = (t * 7 + rng() % 5) % vocab;
    shard = dir + "/train_000000.bin";
    EXPECT_TRUE(shard_write(shard, toks, vocab).is_ok());
  }
  // P = 0: one process, `--distributed` (SingleCommunicator); P ≥ 1: mpirun -np P.
  std::string command(int P, const std::string& out, const std::string& extra, int steps = 10) const {
    std::string launch = P == 0 ? "OMP_NUM_THREADS=1 " + std::string(LAPLACE_BINARY) + " train --distributed"
                                : "OMP_NUM_THREADS=1 mpirun --allow-run-as-root --oversubscribe -x OMP_NUM_THREADS=1 "
                                  "-np " + std::to_string(P) + " " + LAPLACE_BINARY + " train";
    return launch + " --config " + config + " --data " + shard + " --out " + dir + "/" + out + " --seq 16 --steps " +
           std::to_string(steps) + " --lr 0.02 --warmup 2 --wd 0.1 --quiet " + flags + " " + extra + " 2>&1";
  }
  // Runs, returns the exit code and the output.
  int run(int P, const std::string& out, const std::string& extra, std::string* output = nullptr,
          int steps = 10) const {
    FILE* p = popen(command(P, out, extra, steps).c_str(), "r");
    std::string s;
    char buf[4096];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, p)) > 0) s.append(buf, n);
    int st = pclose(p);
    if (output) *output = s;
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  }
  void must_run(int P, const std::string& out, const std::string& extra, int steps = 10) const {
    std::string o;
    ASSERT_EQ(run(P, out, extra, &o, steps), 0) << command(P, out, extra, steps) << "\n" << o;
  }
  std::vector<nlohmann::json> metrics(const std::string& out) const {
    std::vector<nlohmann::json> r;
    std::ifstream in(dir + "/" + out + "/metrics.jsonl");
    std::string line;
    while (std::getline(in, line)) {
      auto j = nlohmann::json::parse(line);
      if (j.contains("loss")) r.push_back(j);
    }
    return r;
  }
  std::vector<double> losses(const std::string& out) const {
    std::vector<double> l;
    for (const auto& j : metrics(out)) l.push_back(j["loss"].get<double>());
    return l;
  }
  std::string bytes(const std::string& rel) const {
    std::string s;
    EXPECT_TRUE(read_file(dir + "/" + rel, &s).is_ok()) << rel;
    return s;
  }
};

void expect_bitwise_equal(const std::vector<double>& a, const std::vector<double>& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i)
    EXPECT_EQ(0, std::memcmp(&a[i], &b[i], sizeof(double))) << what << " step " << i << ": " << a[i] << " vs " << b[i];
}

// P ranks × batch 2 read the same windows as 1 rank × batch 2 × grad-accum P, and every
// sum runs in the same (micro-step, rank) order: bitwise equal losses and weights.
TEST(DistTrain, PRanksBitwiseEqualToOneRank) {
  REQUIRE_MPIRUN();
  DistFixture f;
  for (int P : {1, 2, 3, 4}) {
    const std::string ref = "ref" + std::to_string(P), run = "p" + std::to_string(P);
    f.must_run(0, ref, "--batch 2 --grad-accum " + std::to_string(P));
    f.must_run(P, run, "--batch 2");
    const auto a = f.losses(ref), b = f.losses(run);
    ASSERT_EQ(a.size(), 10u);
    EXPECT_LT(a.back(), a.front());
    expect_bitwise_equal(a, b, "P=" + std::to_string(P));
    EXPECT_EQ(f.bytes(ref + "/model.safetensors"), f.bytes(run + "/model.safetensors")) << "P=" << P;
    // The optimizer state too (the checkpoint's tensors; metadata differs only in dist_world).
    EXPECT_EQ(f.metrics(run).back()["ranks"].get<int>(), P);
  }
  // One rank with batch 8 sums the 8 sequences inside single gemms: equal to rounding only.
  f.must_run(0, "batch8", "--batch 8");
  const auto a = f.losses("batch8"), b = f.losses("p4");
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], 1e-5 * std::abs(b[i])) << "step " << i;
}

// The processes below `root` (children, grandchildren, ...) named `name`.
std::vector<int> descendants_named(int root, const std::string& name) {
  std::vector<std::pair<int, int>> pp;  // (pid, ppid)
  std::vector<std::string> comm;
  for (const auto& e : fs::directory_iterator("/proc")) {
    const std::string d = e.path().filename().string();
    if (d.empty() || !std::all_of(d.begin(), d.end(), ::isdigit)) continue;
    std::string stat;
    if (!read_file(e.path().string() + "/stat", &stat).is_ok()) continue;
    const size_t open = stat.find('('), close = stat.rfind(')');
    if (open == std::string::npos || close == std::string::npos) continue;
    int ppid = 0;
    std::sscanf(stat.c_str() + close + 2, "%*c %d", &ppid);
    pp.push_back({std::stoi(d), ppid});
    comm.push_back(stat.substr(open + 1, close - open - 1));
  }
  std::vector<int> out, frontier = {root};
  while (!frontier.empty()) {
    const int p = frontier.back();
    frontier.pop_back();
    for (size_t i = 0; i < pp.size(); ++i)
      if (pp[i].second == p) {
        frontier.push_back(pp[i].first);
        if (comm[i] == name) out.push_back(pp[i].first);
      }
  }
  return out;
}

// A rank killed with SIGKILL in the middle of a run: the launcher ends the run, says which
// rank was lost, and no other rank is left waiting in a collective (the whole run is bounded
// by `timeout`, whose exit status 124 would mean a hang).
TEST(DistTrain, AKilledRankEndsTheRunOnEveryRankWithoutAHang) {
  REQUIRE_MPIRUN();
  DistFixture f;
  const std::string pid_file = f.dir + "/launcher.pid";
  const std::string cmd = "sh -c 'echo $$ > " + pid_file + "; exec timeout 120 env " +
                          f.command(3, "killed", "--batch 2", 1000000) + "'";
  FILE* p = popen(cmd.c_str(), "r");
  ASSERT_NE(p, nullptr);
  // Wait for a few steps (the metrics file), then kill one rank that is not rank 0's launcher.
  int launcher = 0;
  std::vector<int> ranks;
  // Complete lines only: rank 0 may be in the middle of appending one.
  auto steps_logged = [&] {
    std::string m;
    return read_file(f.dir + "/killed/metrics.jsonl", &m).is_ok() ? std::count(m.begin(), m.end(), '\n') : 0;
  };
  for (int i = 0; i < 1200 && (ranks.size() < 3 || steps_logged() < 3); ++i) {
    std::string s;
    if (!launcher && read_file(pid_file, &s).is_ok() && !s.empty()) launcher = std::stoi(s);
    if (launcher) ranks = descendants_named(launcher, "laplace");
    usleep(50 * 1000);
  }
  ASSERT_EQ(ranks.size(), 3u) << "three ranks under the launcher";
  ASSERT_GE(steps_logged(), 3) << "the run took steps";
  ASSERT_EQ(kill(ranks.back(), SIGKILL), 0);
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  const int st = pclose(p);
  ASSERT_TRUE(WIFEXITED(st)) << out;
  EXPECT_NE(WEXITSTATUS(st), 0) << out;
  EXPECT_NE(WEXITSTATUS(st), 124) << "the run hung after a rank was killed:\n" << out;
  EXPECT_NE(out.find("signal 9"), std::string::npos) << out;
  EXPECT_TRUE(descendants_named(launcher, "laplace").empty()) << "a rank outlived the run";
  if (std::getenv("LAPLACE_TEST_VERBOSE")) std::printf("%s", out.c_str());
}

// gather and all_to_all feed identical bytes into one newton_schulz per unit: identical
// weights; the per-rank bytes each logs equal the formula of distributed/plan.h.
TEST(DistTrain, GatherEqualsAllToAllAndBytesEqualFormula) {
  REQUIRE_MPIRUN();
  DistFixture f;
  Config c;
  ASSERT_TRUE(config_from_json(kConfig, &c).is_ok());
  const auto params = sharded_params(c, false);
  for (int P : {3, 4}) {
    const auto units = assign_muon_owners(params, P);
    // The shapes this test is about: units with fewer rows than ranks; empty shards at P = 4.
    bool small_unit = false, empty_shard = false;
    for (const auto& u : units) small_unit |= u.rows < P;
    for (const auto& p : params) empty_shard |= shard_rows(p.rows, P - 1, P).rows() == 0;
    EXPECT_TRUE(small_unit);
    if (P == 4) {
      EXPECT_TRUE(empty_shard);
    }

    const std::string g = "gather" + std::to_string(P), a = "a2a" + std::to_string(P);
    f.must_run(P, g, "--batch 2 --muon-comm gather");
    f.must_run(P, a, "--batch 2 --muon-comm all_to_all");
    expect_bitwise_equal(f.losses(g), f.losses(a), "gather vs all_to_all P=" + std::to_string(P));
    EXPECT_EQ(f.bytes(g + "/model.safetensors"), f.bytes(a + "/model.safetensors")) << "P=" << P;

    for (MuonComm m : {MuonComm::kGather, MuonComm::kAllToAll}) {
      const auto predicted = muon_traffic(params, units, P, m, 4);  // f32 on the CPU
      const auto rows = f.metrics(m == MuonComm::kGather ? g : a);
      ASSERT_EQ(rows.size(), 10u);
      int64_t total = 0;
      for (const auto& j : rows) {
        const auto sent = j["muon_bytes_sent"].get<std::vector<int64_t>>();
        const auto recv = j["muon_bytes_received"].get<std::vector<int64_t>>();
        ASSERT_EQ(sent.size(), static_cast<size_t>(P));
        for (int r = 0; r < P; ++r) {
          EXPECT_EQ(sent[r], predicted[r].sent) << muon_comm_name(m) << " P=" << P << " rank " << r;
          EXPECT_EQ(recv[r], predicted[r].received) << muon_comm_name(m) << " P=" << P << " rank " << r;
          total += sent[r];
        }
      }
      EXPECT_GT(total, 0);
    }
  }
}

// A checkpoint written on 4 ranks resumes on 2 and on 3 (other grad-accum, same global
// batch of 12 windows): the next step's loss equals the uninterrupted 4-rank run's.
TEST(DistCheckpoint, SaveOnFourRanksResumeOnTwoAndThree) {
  REQUIRE_MPIRUN();
  DistFixture f;
  f.must_run(4, "straight", "--batch 1 --grad-accum 3", 6);
  f.must_run(4, "saved", "--batch 1 --grad-accum 3 --stop-after 3", 6);
  const auto straight = f.losses("straight");
  ASSERT_EQ(straight.size(), 6u);
  struct Case { int P; int accum; };
  for (Case cs : {Case{2, 6}, Case{3, 4}, Case{4, 3}}) {
    const std::string out = "resumed" + std::to_string(cs.P);
    fs::create_directories(f.dir + "/" + out);
    fs::copy_file(f.dir + "/saved/checkpoint.safetensors", f.dir + "/" + out + "/checkpoint.safetensors");
    f.must_run(cs.P, out, "--batch 1 --grad-accum " + std::to_string(cs.accum) + " --resume auto", 6);
    const auto rows = f.metrics(out);
    ASSERT_FALSE(rows.empty());
    EXPECT_EQ(rows.front()["step"].get<int>(), 3);
    const double next = rows.front()["loss"].get<double>();
    EXPECT_EQ(0, std::memcmp(&next, &straight[3], sizeof(double)))
        << "P=" << cs.P << ": " << next << " vs " << straight[3];
  }
  // P = 4 resumed on P = 4 is the straight run, to the byte.
  EXPECT_EQ(f.bytes("resumed4/model.safetensors"), f.bytes("straight/model.safetensors"));
}

TEST(DistCheckpoint, CorruptOrMismatchedCheckpointGivesClearError) {
  REQUIRE_MPIRUN();
  DistFixture f;
  f.must_run(2, "good", "--batch 1", 2);
  std::string ck = f.bytes("good/checkpoint.safetensors");
  // Truncated: every rank refuses it with the file's name, nobody hangs.
  fs::create_directories(f.dir + "/trunc");
  ASSERT_TRUE(write_file_atomic(f.dir + "/trunc/checkpoint.safetensors", ck.data(), ck.size() / 2).is_ok());
  std::string out;
  EXPECT_EQ(f.run(3, "trunc", "--batch 1 --resume auto", &out, 4), 1) << out;
  EXPECT_NE(out.find("laplace: error: corrupt"), std::string::npos) << out;
  EXPECT_NE(out.find("trunc/checkpoint.safetensors"), std::string::npos) << out;
  // Written for another model.
  const std::string other = f.dir + "/other.json";
  std::ofstream(other) << R"({"model_type": "laplace", "vocab_size": 37, "hidden_size": 8, "num_layers": 1,
    "num_heads": 1, "head_k_dim": 2, "head_v_dim": 3, "ffn_size": 5, "conv_size": 4, "chunk_size": 8})";
  std::string cmd = "mpirun --allow-run-as-root --oversubscribe -x OMP_NUM_THREADS=1 -np 2 " +
                    std::string(LAPLACE_BINARY) + " train --config " + other + " --data " + f.shard +
                    " --seq 16 --steps 4 --batch 1 --quiet --resume " + f.dir + "/good/checkpoint.safetensors 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  char buf[4096];
  size_t n;
  out.clear();
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  int st = pclose(p);
  EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 1) << out;
  EXPECT_NE(out.find("written for a different config"), std::string::npos) << out;
  // A checkpoint whose optimizer state does not fit the run (a tensor renamed away).
  std::string bad = ck;
  const size_t pos = bad.find("optim.model.norm.weight.adam_v");
  ASSERT_NE(pos, std::string::npos);
  bad.replace(pos, 6, "optiX.");  // same length: the header stays valid, the state goes missing
  fs::create_directories(f.dir + "/renamed");
  ASSERT_TRUE(write_file_atomic(f.dir + "/renamed/checkpoint.safetensors", bad.data(), bad.size()).is_ok());
  EXPECT_EQ(f.run(2, "renamed", "--batch 1 --resume auto", &out, 4), 1) << out;
  EXPECT_NE(out.find("missing tensor optim.model.norm.weight.adam_v"), std::string::npos) << out;
}

// Ranks given other data, or other checkpoints to resume from: the run ends with a clear message
// (every rank decides the same, but mpirun may stop the others once the first has exited, so
// the output holds one or both), and nobody hangs (timeout's 124 would say so). Each rank's
// arguments come from its own shell, through Open MPI's OMPI_COMM_WORLD_RANK.
TEST(DistTrain, RanksGivenOtherDataOrCheckpointsRefuse) {
  REQUIRE_MPIRUN();
  DistFixture f;
  auto per_rank = [&](const std::string& args, std::string* out) {
    const std::string cmd = "OMP_NUM_THREADS=1 timeout 120 mpirun --allow-run-as-root --oversubscribe -np 2 sh -c '" +
                            std::string(LAPLACE_BINARY) + " train --config " + f.config + " --seq 16 --steps 4 " +
                            "--lr 0.02 --warmup 2 --quiet --batch 1 " + args + "' 2>&1";
    FILE* p = popen(cmd.c_str(), "r");
    char buf[4096];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, p)) > 0) out->append(buf, n);
    const int st = pclose(p);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  };
  auto count = [](const std::string& s, const std::string& what) {
    int k = 0;
    for (size_t at = s.find(what); at != std::string::npos; at = s.find(what, at + 1)) ++k;
    return k;
  };
  // Rank 1 reads a shorter shard.
  std::vector<uint32_t> other(3000, 5);
  ASSERT_TRUE(shard_write(f.dir + "/d1.bin", other, 37).is_ok());
  fs::copy_file(f.shard, f.dir + "/d0.bin");
  std::string out;
  int rc = per_rank("--data " + f.dir + "/d$OMPI_COMM_WORLD_RANK.bin --out " + f.dir + "/x", &out);
  EXPECT_NE(rc, 0) << out;
  EXPECT_NE(rc, 124) << out;
  EXPECT_GE(count(out, "rank 1 was given other data than rank 0 (training: 3000 tokens"), 1) << out;

  // Rank 0 resumes at step 2, rank 1 has no checkpoint; then rank 1 one at step 3.
  f.must_run(2, "s2", "--batch 1 --stop-after 2", 4);
  f.must_run(2, "s3", "--batch 1 --stop-after 3", 4);
  fs::create_directories(f.dir + "/o0");
  fs::create_directories(f.dir + "/o1");
  fs::copy_file(f.dir + "/s2/checkpoint.safetensors", f.dir + "/o0/checkpoint.safetensors");
  out.clear();
  rc = per_rank("--data " + f.shard + " --out " + f.dir + "/o$OMPI_COMM_WORLD_RANK --resume auto", &out);
  EXPECT_NE(rc, 0) << out;
  EXPECT_NE(rc, 124) << out;
  EXPECT_GE(count(out, "rank 1 starts afresh and rank 0 resumes"), 1) << out;
  fs::copy_file(f.dir + "/s3/checkpoint.safetensors", f.dir + "/o1/checkpoint.safetensors");
  out.clear();
  rc = per_rank("--data " + f.shard + " --out " + f.dir + "/o$OMPI_COMM_WORLD_RANK --resume auto", &out);
  EXPECT_NE(rc, 0) << out;
  EXPECT_NE(rc, 124) << out;
  EXPECT_GE(count(out, "rank 1 starts at step 3, rank 0 at step 2"), 1) << out;
}

// The distributed checkpoint is the single-process format: a plain run resumes from it.
TEST(DistCheckpoint, SingleProcessTrainerResumesADistributedCheckpoint) {
  REQUIRE_MPIRUN();
  DistFixture f;
  f.must_run(3, "d", "--batch 1 --stop-after 2", 4);
  const std::string cmd = std::string(LAPLACE_BINARY) + " train --config " + f.config + " --data " + f.shard +
                          " --out " + f.dir + "/d --seq 16 --steps 4 --batch 3 --lr 0.02 --warmup 2 --wd 0.1 "
                          "--quiet --resume auto";
  ASSERT_EQ(std::system(cmd.c_str()), 0);
  const auto l = f.losses("d");
  ASSERT_EQ(l.size(), 4u);
  EXPECT_TRUE(std::isfinite(l.back()));
}

// FP8 training is a one-device store's: the sharded trainer says so (one process, no mpirun
// needed); an unknown precision is refused before anything runs.
TEST(DistCli, ShardedTrainerRefusesFp8AndUnknownPrecisions) {
  DistFixture f;
  std::string out;
  EXPECT_EQ(f.run(0, "fp8", "--batch 2 --precision fp8", &out, 2), 1) << out;
  EXPECT_NE(out.find("--precision fp8 trains on one device"), std::string::npos) << out;
  EXPECT_EQ(f.run(0, "fp8fast", "--batch 2 --precision fp8-fast", &out, 2), 1) << out;  // FP8 too
  EXPECT_NE(out.find("--precision fp8 trains on one device"), std::string::npos) << out;
  EXPECT_EQ(f.run(0, "fp16", "--batch 2 --precision fp16", &out, 2), 1) << out;
  EXPECT_NE(out.find("--precision must be 'model', 'fp8' or 'fp8-fast'"), std::string::npos) << out;
}

// The memory plan in distributed mode: per rank, with its shards. --tokens-per-step counts
// the whole step over all ranks; the plan then splits it into the same micro-batches as the
// explicit flags, so the runs are bitwise equal. --batch auto picks the largest candidate
// that fits (8 here: this model fits anywhere).
TEST(DistCli, TokensPerStepAndBatchAutoPlanEveryRank) {
  REQUIRE_MPIRUN();
  DistFixture f;
  f.must_run(2, "explicit", "--batch 2 --grad-accum 2", 4);
  f.must_run(2, "tps", "--tokens-per-step 128 --batch 2", 4);  // 128 / 16 = 8 sequences: 2 ranks × B 2 × A 2
  expect_bitwise_equal(f.losses("explicit"), f.losses("tps"), "--tokens-per-step");
  f.must_run(2, "b8", "--batch 8", 4);
  f.must_run(2, "auto", "--batch auto --reserve-gib 0", 4);
  expect_bitwise_equal(f.losses("b8"), f.losses("auto"), "--batch auto");
  std::string out;
  EXPECT_EQ(f.run(3, "uneven", "--tokens-per-step 64", &out, 2), 1) << out;
  EXPECT_NE(out.find("must split evenly over the 3 ranks"), std::string::npos) << out;
}

// What the distributed plan counts is what the trainer allocates (one process, P = 1), and a
// rank's shards are its rows: over P = 4 ranks the master shards hold every element once.
TEST(DistPlan, MemoryPlanCountsWhatTheTrainerAllocates) {
  DistFixture f;
  TrainOptions o;
  o.config_path = f.config;
  o.train_data = {f.shard};
  o.batch = 2;
  o.seq = 16;
  o.steps = 1;
  o.quiet = true;
  SingleCommunicator comm;
  Trainer t(o, std::make_unique<ShardedParameters>(MuonComm::kAllToAll, comm));
  ASSERT_TRUE(t.setup().is_ok());
  const MemoryPlan& p = t.memory_plan();
  EXPECT_EQ(p.ranks, 1);
  EXPECT_EQ(p.init_table, 0u);  // F32 on the CPU: the masters initialise in place
  EXPECT_EQ(p.total(), t.allocated_bytes());
  EXPECT_NE(format_memory_plan(p, "host").find("collective staging"), std::string::npos);

  Config c;
  ASSERT_TRUE(config_load(f.config, &c).is_ok());
  const auto params = sharded_params(c, false);
  const auto units = assign_muon_owners(params, 4);
  int64_t elems = 0, want = 0;
  for (const ShardedParam& sp : params) want += sp.rows * sp.cols;
  for (int r = 0; r < 4; ++r) {
    const FsdpLayout l = fsdp_layout(params, units, 4, r, DType::kF32, DType::kF32, DType::kF32);
    for (const TensorSpec& s : l.shards)
      if (s.name.rfind("master.", 0) == 0) elems += s.numel();
  }
  EXPECT_EQ(elems, want);
  // BF16 weights with F32 masters: the setup-only initial table is the full F32 weights.
  const ShardBytes b = fsdp_shard_bytes_max(c, params, units, 4, DType::kF32, DType::kBF16, DType::kBF16);
  EXPECT_EQ(b.init_table, Arena::planned_bytes(weight_specs(c, DType::kF32)));
}

// A rank's own rows of its own Muon units never pass through the exchange buffers, and the
// units it holds whole are orthogonalised in the update buffer: at P = 1 (the sharded trainer
// on one device) there is no owned-units copy and no exchange buffer at all.
TEST(DistPlan, OwnRowsStayOutOfTheExchangeBuffers) {
  Config c;
  DistFixture f;
  ASSERT_TRUE(config_load(f.config, &c).is_ok());
  const auto params = sharded_params(c, false);
  auto bytes_of = [](const FsdpLayout& l, const std::string& name) {
    for (const auto* list : {&l.muon, &l.staging})
      for (const TensorSpec& s : *list)
        if (s.name == name) return s.numel();
    return int64_t{-1};
  };
  const FsdpLayout one =
      fsdp_layout(params, assign_muon_owners(params, 1), 1, 0, DType::kF32, DType::kF32, DType::kF32);
  for (int64_t off : one.owned_off) EXPECT_EQ(off, kOwnedInUpdate);
  EXPECT_EQ(bytes_of(one, "muon.owned"), 0);
  EXPECT_EQ(bytes_of(one, "muon.bcast"), 0);
  EXPECT_EQ(bytes_of(one, "dist.a2a_send"), 0);
  EXPECT_EQ(bytes_of(one, "dist.a2a_recv"), 0);
  int in_place = 0, assembled = 0;
  for (int P : {2, 3, 4}) {
    const auto units = assign_muon_owners(params, P);
    for (int r = 0; r < P; ++r) {
      const FsdpLayout l = fsdp_layout(params, units, P, r, DType::kF32, DType::kF32, DType::kF32);
      EXPECT_EQ(l.a2a_to[r], 0);
      EXPECT_EQ(l.a2a_from[r], 0);
      for (size_t k = 0; k < units.size(); ++k) {
        if (units[k].owner != r) continue;
        const bool whole = l.unit_rows[k][r].rows() == units[k].rows;
        EXPECT_EQ(l.owned_off[k] == kOwnedInUpdate, whole) << "P=" << P << " rank " << r << " unit " << k;
        (whole ? in_place : assembled) += 1;
      }
    }
  }
  EXPECT_GT(in_place, 0);  // the P-rank tests above run both kinds of unit
  EXPECT_GT(assembled, 0);
}

// Every collective and type over Open MPI, checked on every rank (cli/cmd_dist.cpp).
TEST(DistComm, MpiSelftestOnThreeAndFourRanks) {
  REQUIRE_MPIRUN();
  for (int P : {3, 4}) {
    const std::string cmd = "mpirun --allow-run-as-root --oversubscribe -np " + std::to_string(P) + " " +
                            LAPLACE_BINARY + " dist selftest 2>&1";
    FILE* p = popen(cmd.c_str(), "r");
    std::string out;
    char buf[4096];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
    ASSERT_EQ(pclose(p), 0) << out;
    for (int r = 0; r < P; ++r)
      EXPECT_NE(out.find("rank " + std::to_string(r) + "/" + std::to_string(P) + " (mpi): communicator selftest ok"),
                std::string::npos)
          << out;
  }
}

TEST(DistCli, PlanPrintsBothStrategiesAndBalance) {
  const testing::CliResult r = testing::run_laplace("dist plan --config " + std::string(LAPLACE_SOURCE_DIR) +
                                                    "/configs/laplace-3b.json --ranks 64");
  const std::string& out = r.output;
  ASSERT_EQ(r.exit_code, 0) << out;
  EXPECT_NE(out.find("gather"), std::string::npos) << out;
  EXPECT_NE(out.find("all_to_all"), std::string::npos) << out;
  EXPECT_NE(out.find("max/mean"), std::string::npos) << out;
  EXPECT_NE(out.find("10.869 GB"), std::string::npos) << out;  // mean gather sent+recv, bf16
}

// --memory-gb: one rank's memory plan, from the same layout the sharded trainer allocates; at
// P = 1 beside the single-device trainer's. laplace-3b at B 8 must fit the --memory-gb given, sharded too.
TEST(DistCli, PlanPrintsTheMemoryPlanPerGpu) {
  auto plan = [](int P) {
    const testing::CliResult r = testing::run_laplace("dist plan --config " + std::string(LAPLACE_SOURCE_DIR) +
                                                      "/configs/laplace-3b.json --show-ranks 0 --memory-gb 148.9 "
                                                      "--ranks " + std::to_string(P));
    EXPECT_EQ(r.exit_code, 0) << r.output;
    return r.output;
  };
  const std::string one = plan(1), eight = plan(8);
  EXPECT_NE(one.find("master weights (f32, shard of 1)"), std::string::npos) << one;
  EXPECT_NE(one.find("the single-device trainer"), std::string::npos) << one;
  EXPECT_NE(eight.find("shard of 8"), std::string::npos) << eight;
  EXPECT_EQ(eight.find("single-device"), std::string::npos) << eight;
  // A negative remainder would print as "-N.NNN GB left".
  for (const std::string* o : {&one, &eight}) EXPECT_EQ(o->find(": -"), std::string::npos) << *o;
}


// ---- NCCL on GPUs (issue 7's properties over NCCL; they run on a machine with GPUs) ----------

int visible_gpus() {
  FILE* p = popen("nvidia-smi -L 2>/dev/null | grep -c '^GPU'", "r");
  if (!p) return 0;
  int n = 0;
  if (fscanf(p, "%d", &n) != 1) n = 0;
  pclose(p);
  return n;
}

#define REQUIRE_NCCL_GPUS(n)                                                                          \
  do {                                                                                                \
    if (!nccl_available()) GTEST_SKIP() << "built without NCCL (no CUDA or no nccl.h): GPU tests skipped"; \
    const int gpus_ = visible_gpus();                                                                 \
    if (gpus_ < (n)) GTEST_SKIP() << "needs " << (n) << " GPU(s), " << gpus_ << " visible";           \
    if ((n) > 1) REQUIRE_MPIRUN();                                                                    \
  } while (0)

// A small model whose shapes suit the CUDA kernels (bf16 rows of 16-byte multiples);
// at P = 2 every matrix splits into two non-empty shards.
const char* kGpuConfig = R"({"model_type": "laplace", "vocab_size": 64, "hidden_size": 64, "num_layers": 2,
  "num_heads": 2, "head_k_dim": 16, "head_v_dim": 32, "ffn_size": 96, "conv_size": 4, "chunk_size": 16})";

TEST(DistNccl, SelftestDeviceAndHostBuffers) {
  REQUIRE_NCCL_GPUS(1);
  const int P = std::min(visible_gpus(), 8);
  const std::string cmd = (P > 1 ? "mpirun --allow-run-as-root --oversubscribe -np " + std::to_string(P) + " " : "") +
                          std::string(LAPLACE_BINARY) + " dist selftest --device cuda 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  const int st = pclose(p);
  ASSERT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << cmd << "\n" << out;
  for (int q = 0; q < P; ++q)
    EXPECT_NE(out.find("rank " + std::to_string(q) + "/" + std::to_string(P) + " (nccl"), std::string::npos) << out;
  EXPECT_NE(out.find("device and host buffers"), std::string::npos) << out;
}

// Two GPUs × batch 2 against one GPU × batch 2 × grad-accum 2 (a one-rank NCCL
// communicator): bitwise equal losses and weights; gather and all_to_all Muon likewise.
TEST(DistNccl, TwoGpusBitwiseEqualToOneGpuAndMuonStrategiesAgree) {
  REQUIRE_NCCL_GPUS(2);
  DistFixture f(kGpuConfig, 64, "--device cuda --dtype bf16");
  f.must_run(0, "ref", "--batch 2 --grad-accum 2");
  f.must_run(2, "a2a", "--batch 2 --muon-comm all_to_all");
  f.must_run(2, "gather", "--batch 2 --muon-comm gather");
  const auto ref = f.losses("ref"), a2a = f.losses("a2a"), gather = f.losses("gather");
  ASSERT_EQ(ref.size(), 10u);
  EXPECT_LT(ref.back(), ref.front());
  expect_bitwise_equal(ref, a2a, "2 GPUs vs 1 GPU");
  expect_bitwise_equal(a2a, gather, "gather vs all_to_all");
  EXPECT_EQ(f.bytes("ref/model.safetensors"), f.bytes("a2a/model.safetensors"));
  EXPECT_EQ(f.bytes("a2a/model.safetensors"), f.bytes("gather/model.safetensors"));
  EXPECT_EQ(f.metrics("a2a").back()["ranks"].get<int>(), 2);
}

// Saved on two GPUs, resumed on one (grad-accum 2): the rest of the run is bitwise the
// uninterrupted two-GPU run's.
TEST(DistNccl, SaveOnTwoGpusResumeOnOne) {
  REQUIRE_NCCL_GPUS(2);
  DistFixture f(kGpuConfig, 64, "--device cuda --dtype bf16");
  f.must_run(2, "straight", "--batch 2", 6);
  f.must_run(2, "resumed", "--batch 2 --stop-after 3", 6);
  f.must_run(0, "resumed", "--batch 2 --grad-accum 2 --resume auto", 6);
  const auto a = f.losses("straight"), b = f.losses("resumed");
  ASSERT_EQ(a.size(), 6u);
  ASSERT_EQ(b.size(), 6u);  // 3 before the stop + 3 after the resume, in one metrics file
  expect_bitwise_equal(a, b, "resume on one GPU");
  EXPECT_EQ(f.bytes("straight/model.safetensors"), f.bytes("resumed/model.safetensors"));
}

}  // namespace
}  // namespace laplace
