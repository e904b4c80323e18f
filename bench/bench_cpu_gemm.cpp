// bench_cpu_gemm: the CPU backend's row-invariant products (ops/cpu/gemm_rows.h) against
// OpenBLAS's sgemm, which they replace for x·Wᵀ, at a model's five projection shapes (qkvg,
// wo, w12, w3, head) and a few row counts M (decode batches and training micro-batches).
// F32, inputs uniform in [−1, 1]; each timing is the mean over at least `--seconds` of calls
// after one warm-up call. Prints ms and GFLOP/s of both and their ratio; no results lines
// (a CPU property of the machine it runs on, quoted in BENCHMARKS.md with the machine).
//
// Usage: bench_cpu_gemm [--config configs/laplace-tiny.json] [--rows 1,16,512,2048] [--seconds 0.3]
//                       [--path best|avx512|avx2|portable]
#include <cblas.h>

#include <chrono>
#include <functional>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "model/config.h"
#include "ops/cpu/gemm_rows.h"

namespace {

double mean_ms(double seconds, const std::function<void()>& f) {
  f();
  int reps = 0;
  const auto t0 = std::chrono::steady_clock::now();
  double el = 0;
  do {
    f();
    ++reps;
    el = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  } while (el < seconds);
  return el / reps * 1e3;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"bench_cpu_gemm: row-invariant x·Wᵀ (cpu::gemm_rows) against OpenBLAS sgemm"};
  std::string config = "configs/laplace-tiny.json";
  std::vector<int64_t> rows = {1, 16, 512, 2048};
  double seconds = 0.3;
  app.add_option("--config", config, "model config (its projection shapes)");
  app.add_option("--rows", rows, "row counts M")->delimiter(',');
  app.add_option("--seconds", seconds, "time per measurement")->check(CLI::Range(0.01, 60.0));
  std::string path = "best";
  app.add_option("--path", path, "gemm_rows' code path")->check(CLI::IsMember({"best", "avx512", "avx2", "portable"}));
  CLI11_PARSE(app, argc, argv);
  using laplace::cpu::GemmPath;
  const GemmPath p = path == "avx512" ? GemmPath::kAvx512
                     : path == "avx2" ? GemmPath::kAvx2
                     : path == "portable" ? GemmPath::kPortable
                                          : GemmPath::kBest;
  if (!laplace::cpu::gemm_rows_select(p)) {
    std::fprintf(stderr, "bench_cpu_gemm: this CPU (or build) has no %s path\n", path.c_str());
    return 1;
  }
  laplace::Config c;
  if (laplace::Status st = laplace::config_load(config, &c); !st.is_ok()) {
    std::fprintf(stderr, "bench_cpu_gemm: %s\n", st.to_string().c_str());
    return 1;
  }
  struct Shape {
    const char* name;
    int64_t N, K;
  };
  const Shape shapes[] = {{"qkvg", c.qkvg_rows(), c.hidden_size},
                          {"wo", c.hidden_size, c.v_dim()},
                          {"w12", 2 * c.ffn_size, c.hidden_size},
                          {"w3", c.hidden_size, c.ffn_size},
                          {"head", c.vocab_size, c.hidden_size}};
  std::mt19937 gen(1);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  std::printf("%-5s %6s %6s %6s  %10s %8s  %10s %8s  %s\n", "op", "M", "N", "K", "openblas", "GFLOP/s", "gemm_rows",
              "GFLOP/s", "time ratio (rows / openblas)");
  for (const Shape& s : shapes) {
    for (int64_t M : rows) {
      std::vector<float> a(static_cast<size_t>(M * s.K)), w(static_cast<size_t>(s.N * s.K)),
          out(static_cast<size_t>(M * s.N));
      for (float& x : a) x = u(gen);
      for (float& x : w) x = u(gen);
      const double tb = mean_ms(seconds, [&] {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(M), static_cast<int>(s.N),
                    static_cast<int>(s.K), 1.f, a.data(), static_cast<int>(s.K), w.data(), static_cast<int>(s.K), 0.f,
                    out.data(), static_cast<int>(s.N));
      });
      const double tr = mean_ms(seconds, [&] {
        laplace::cpu::gemm_rows<float>(M, s.N, s.K, 1.f, a.data(), s.K, w.data(), s.K, 0.f, out.data(), s.N);
      });
      const double gf = 2.0 * static_cast<double>(M) * static_cast<double>(s.N) * static_cast<double>(s.K) * 1e-6;
      std::printf("%-5s %6lld %6lld %6lld  %7.3f ms %8.1f  %7.3f ms %8.1f  %.2f\n", s.name, (long long)M,
                  (long long)s.N, (long long)s.K, tb, gf / tb, tr, gf / tr, tr / tb);
    }
  }
  return 0;
}
