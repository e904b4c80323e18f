#include "tests/test_util.h"

#include <sys/wait.h>

#include <array>
#include <cstdio>

#include <cmath>
#include <cstdlib>
#include <filesystem>

#include <gtest/gtest.h>

#include "core/file_util.h"
#include "core/fp8.h"
#include "model/model.h"
#include "ops/backend.h"
#include "text/tokenizer.h"

namespace laplace::testing {

int64_t offset_of(const Tensor& t, int64_t flat) {
  int64_t off = 0;
  for (int d = t.ndim - 1; d >= 0; --d) {
    off += (flat % t.shape[d]) * t.stride[d];
    flat /= t.shape[d];
  }
  return off;
}

double round_to(DType dt, double x) {
  if (dt == DType::kBF16) return bf16_to_float(float_to_bf16(static_cast<float>(x)));
  if (dt == DType::kF32) return static_cast<float>(x);
  if (dt == DType::kF8E4M3) return e4m3_to_float(e4m3_from_float(static_cast<float>(x)));
  return x;
}

double element_get(const Tensor& t, int64_t flat) {
  const int64_t off = offset_of(t, flat);
  switch (t.dtype) {
    case DType::kF32: return static_cast<const float*>(t.data)[off];
    case DType::kF64: return static_cast<const double*>(t.data)[off];
    case DType::kBF16: return bf16_to_float(static_cast<const uint16_t*>(t.data)[off]);
    case DType::kI32: return static_cast<const int32_t*>(t.data)[off];
    case DType::kF8E4M3: return e4m3_to_float(static_cast<const uint8_t*>(t.data)[off]);
    default: LAPLACE_CHECK(false, "element_get: unsupported dtype"); return 0;
  }
}

void element_set(const Tensor& t, int64_t flat, double v) {
  const int64_t off = offset_of(t, flat);
  switch (t.dtype) {
    case DType::kF32: static_cast<float*>(t.data)[off] = static_cast<float>(v); break;
    case DType::kF64: static_cast<double*>(t.data)[off] = v; break;
    case DType::kBF16: static_cast<uint16_t*>(t.data)[off] = float_to_bf16(static_cast<float>(v)); break;
    case DType::kI32: static_cast<int32_t*>(t.data)[off] = static_cast<int32_t>(v); break;
    case DType::kF8E4M3: static_cast<uint8_t*>(t.data)[off] = e4m3_from_float(static_cast<float>(v)); break;
    default: LAPLACE_CHECK(false, "element_set: unsupported dtype");
  }
}

OwnedTensor::OwnedTensor(DType dt, std::initializer_list<int64_t> shape) {
  t = Tensor(nullptr, dt, shape);
  storage.assign((t.nbytes() + 7) / 8 + 1, 0.0);
  t.data = storage.data();
}

void fill_uniform(Tensor t, uint64_t seed, double lo, double hi) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> dist(lo, hi);
  LAPLACE_CHECK(t.is_contiguous(), "fill_uniform needs a contiguous tensor");
  int64_t n = t.numel();
  for (int64_t i = 0; i < n; ++i) {
    double x = dist(rng);
    if (t.dtype == DType::kF32) static_cast<float*>(t.data)[i] = static_cast<float>(x);
    else if (t.dtype == DType::kF64) static_cast<double*>(t.data)[i] = x;
    else if (t.dtype == DType::kBF16) static_cast<uint16_t*>(t.data)[i] = float_to_bf16(static_cast<float>(x));
    else LAPLACE_CHECK(false, "fill_uniform: unsupported dtype");
  }
}

double max_rel_error(const Tensor& a, const Tensor& b) {
  LAPLACE_CHECK(a.numel() == b.numel(), "max_rel_error: sizes differ");
  double num = 0, den = 1e-30;
  for (int64_t i = 0; i < a.numel(); ++i) {
    double x = element_get(a, i), y = element_get(b, i);
    if (std::isnan(x) || std::isnan(y)) return INFINITY;
    num = std::max(num, std::fabs(x - y));
    den = std::max(den, std::fabs(y));
  }
  return num / den;
}

double rms_rel_error(const Tensor& a, const Tensor& b) {
  LAPLACE_CHECK(a.numel() == b.numel(), "rms_rel_error: sizes differ");
  double num = 0, den = 1e-300;
  for (int64_t i = 0; i < a.numel(); ++i) {
    double x = element_get(a, i), y = element_get(b, i);
    num += (x - y) * (x - y);
    den += y * y;
  }
  return std::sqrt(num / den);
}

Config small_config(int64_t dk, int64_t dv, int64_t H) {
  Config c;
  c.vocab_size = 53;
  c.hidden_size = 24;
  c.num_layers = 2;
  c.num_heads = H;
  c.head_k_dim = dk;
  c.head_v_dim = dv;
  c.ffn_size = 40;
  c.chunk_size = 8;
  return c;
}

std::vector<int32_t> random_tokens(int64_t n, int64_t V, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (auto& x : t) x = static_cast<int32_t>(rng() % static_cast<uint64_t>(V));
  return t;
}

std::string make_temp_dir(const std::string& tag) {
  std::string tmpl = (std::filesystem::temp_directory_path() / ("laplace_" + tag + "_XXXXXX")).string();
  char* p = mkdtemp(tmpl.data());
  LAPLACE_CHECK(p != nullptr, "mkdtemp failed");
  return tmpl;
}

CliResult run_laplace(const std::string& args, bool with_stderr) {
  CliResult r;
  const std::string cmd = std::string(LAPLACE_BINARY) + " " + args + (with_stderr ? " 2>&1" : " 2>/dev/null");
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return r;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) r.output.append(buf.data(), n);
  const int st = pclose(p);
  if (WIFEXITED(st)) r.exit_code = WEXITSTATUS(st);
  return r;
}

std::string make_server_model_dir(const std::string& tag, uint64_t weight_seed) {
  const std::string dir = make_temp_dir(tag);
  std::string corpus;
  for (int i = 0; i < 300; ++i)
    corpus += "the quick brown fox " + std::to_string(i) +
              " jumps over the lazy dog; a fortune a day keeps the doctor away.\nWhy did the programmer quit? "
              "Because he did not get arrays.\n";
  EXPECT_TRUE(write_file_atomic(dir + "/corpus.txt", corpus.data(), corpus.size()).is_ok());
  TokenizerTrainOptions to;
  to.inputs = {dir + "/corpus.txt"};
  to.model_prefix = dir + "/tokenizer";
  to.vocab_size = 400;
  const Status st = tokenizer_train(to);
  EXPECT_TRUE(st.is_ok()) << st.to_string();
  Config c = small_config(8, 12, 2);
  c.vocab_size = 400;
  c.eos_token_id = 2;
  const std::string cj = c.to_json();
  EXPECT_TRUE(write_file_atomic(dir + "/config.json", cj.data(), cj.size()).is_ok());
  auto be = make_cpu_backend();
  Model m;
  EXPECT_TRUE(m.create(c, *be, DType::kF32).is_ok());
  m.init_weights(weight_seed);
  EXPECT_TRUE(m.save(dir + "/model.safetensors").is_ok());
  return dir;
}

}  // namespace laplace::testing
