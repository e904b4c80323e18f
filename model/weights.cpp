#include "model/weights.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <set>

#include <omp.h>

#include "core/rng.h"
#include "core/safetensors.h"
#include "model/quantize.h"

namespace laplace {

namespace {

std::string layer_name(int64_t i, const char* leaf) {
  return "model.layers." + std::to_string(i) + "." + leaf;
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

std::vector<TensorSpec> weight_specs(const Config& c, DType dt) {
  const int64_t D = c.hidden_size, V = c.vocab_size;
  std::vector<TensorSpec> s;
  s.push_back({"model.embed.weight", dt, {V, D}});
  for (int64_t i = 0; i < c.num_layers; ++i) {
    s.push_back({layer_name(i, "norm1.weight"), dt, {D}});
    s.push_back({layer_name(i, "norm1.bias"), dt, {D}});
    s.push_back({layer_name(i, "conv.weight"), dt, {D, c.conv_size}});
    s.push_back({layer_name(i, "wqkvg.weight"), dt, {c.qkvg_rows(), D}});
    s.push_back({layer_name(i, "onorm.weight"), dt, {c.head_v_dim}});
    s.push_back({layer_name(i, "wo.weight"), dt, {D, c.v_dim()}});
    s.push_back({layer_name(i, "norm2.weight"), dt, {D}});
    s.push_back({layer_name(i, "norm2.bias"), dt, {D}});
    s.push_back({layer_name(i, "w12.weight"), dt, {2 * c.ffn_size, D}});
    s.push_back({layer_name(i, "w3.weight"), dt, {D, c.ffn_size}});
  }
  s.push_back({"model.norm.weight", dt, {D}});
  s.push_back({"model.norm.bias", dt, {D}});
  if (!c.tie_embeddings) s.push_back({"lm_head.weight", dt, {V, D}});
  return s;
}

ModelWeights weights_bind(const Config& c, const Arena& a) {
  size_t i = 0;
  auto next = [&]() { return a.tensor(i++); };
  ModelWeights w;
  w.embed = next();
  w.layers.resize(c.num_layers);
  for (auto& l : w.layers) {
    l.norm1_w = next();
    l.norm1_b = next();
    l.conv_w = next();
    l.wqkvg = next();
    l.onorm_w = next();
    l.wo = next();
    l.norm2_w = next();
    l.norm2_b = next();
    l.w12 = next();
    l.w3 = next();
  }
  w.norm_w = next();
  w.norm_b = next();
  w.lm_head = c.tie_embeddings ? w.embed : next();
  LAPLACE_CHECK(i == a.size(), "weights_bind: arena does not match weight_specs");
  return w;
}

bool is_body_matrix(const std::string& n) {
  return ends_with(n, ".wqkvg.weight") || ends_with(n, ".wo.weight") || ends_with(n, ".w12.weight") ||
         ends_with(n, ".w3.weight");
}

std::vector<int64_t> muon_blocks(const Config& c, const std::string& n) {
  if (ends_with(n, ".wqkvg.weight")) return {c.qk_dim(), c.qk_dim(), c.v_dim(), c.v_dim()};
  if (ends_with(n, ".w12.weight")) return {c.ffn_size, c.ffn_size};
  if (ends_with(n, ".wo.weight")) return {c.hidden_size};
  if (ends_with(n, ".w3.weight")) return {c.hidden_size};
  return {};
}

bool is_decayed_by_adamw(const std::string& n) { return n == "model.embed.weight" || n == "lm_head.weight"; }

namespace {

// A 64-bit FNV-1a hash of a tensor's name: each tensor's draws depend on its name, not on
// where it sits in the table.
uint64_t name_hash(const std::string& s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char ch : s) h = (h ^ ch) * 0x100000001b3ull;
  return h;
}

// Below this many values a tensor is filled by one thread.
constexpr int64_t kParallelValues = int64_t{1} << 16;

// A tensor's n values of N(0, sd): elements 2j and 2j + 1 are the Box–Muller pair of outputs
// 2j and 2j + 1 of the tensor's SplitMix64 stream (which starts at `key`), so each pair is
// computed on its own and the values do not depend on the thread count.
void normal_values(uint64_t key, double sd, int64_t n, int threads, float* out) {
#pragma omp parallel for schedule(static) num_threads(threads) if (n >= kParallelValues)
  for (int64_t j = 0; j < (n + 1) / 2; ++j) {
    SplitMix64 g{key + 2 * static_cast<uint64_t>(j) * kSplitMixGamma};
    const double u1 = 1.0 - g.uniform(), u2 = g.uniform();  // u1 in (0, 1]
    const double r = std::sqrt(-2.0 * std::log(u1)), t = 6.283185307179586 * u2;
    out[2 * j] = static_cast<float>(sd * r * std::cos(t));
    if (2 * j + 1 < n) out[2 * j + 1] = static_cast<float>(sd * r * std::sin(t));
  }
}

}  // namespace

void weights_init(const Config& c, Backend& be, const Arena& arena, uint64_t seed, int threads) {
  const int nt = threads > 0 ? threads : omp_get_max_threads();
  const double out_scale = 1.0 / std::sqrt(2.0 * static_cast<double>(c.num_layers));
  std::vector<float> host;
  std::vector<uint16_t> half;
  for (size_t i = 0; i < arena.size(); ++i) {
    const TensorSpec& s = arena.spec(i);
    const int64_t n = s.numel();
    host.resize(static_cast<size_t>(n));
    double std_dev = 0.02;
    double constant = -1;  // < 0: random
    if (ends_with(s.name, "norm1.weight") || ends_with(s.name, "norm2.weight") ||
        s.name == "model.norm.weight" || ends_with(s.name, "onorm.weight")) {
      constant = 1.0;
    } else if (ends_with(s.name, ".bias")) {
      constant = 0.0;
    } else if (ends_with(s.name, "conv.weight")) {
      std_dev = 1.0 / std::sqrt(static_cast<double>(c.conv_size));
    } else if (ends_with(s.name, "wo.weight") || ends_with(s.name, "w3.weight")) {
      std_dev = 0.02 * out_scale;
    }
    if (constant >= 0) {
      std::fill(host.begin(), host.end(), static_cast<float>(constant));
    } else {
      const uint64_t key = splitmix64_hash(seed ^ name_hash(s.name));
      normal_values(key, std_dev, n, nt, host.data());
    }
    Tensor src = Tensor::make(host.data(), DType::kF32, s.shape.data(), static_cast<int>(s.shape.size()));
    Tensor dst = arena.tensor(i);
    if (dst.dtype == DType::kF32) {
      be.copy(dst, src);
    } else if (dst.dtype == DType::kF64) {
      std::vector<double> d(host.begin(), host.end());
      be.copy(dst, Tensor::make(d.data(), DType::kF64, s.shape.data(), static_cast<int>(s.shape.size())));
    } else {
      LAPLACE_CHECK(dst.dtype == DType::kBF16, "weights_init: unsupported dtype");
      half.resize(host.size());
#pragma omp parallel for schedule(static) num_threads(nt) if (n >= kParallelValues)
      for (int64_t k = 0; k < n; ++k) half[static_cast<size_t>(k)] = float_to_bf16(host[static_cast<size_t>(k)]);
      be.copy(dst, Tensor::make(half.data(), DType::kBF16, s.shape.data(), static_cast<int>(s.shape.size())));
    }
  }
}

Status weights_save(const std::string& path, const Config& c, Backend& be, const Arena& arena) {
  // Stage each tensor on the host (a no-op copy on the CPU backend) in its own dtype.
  std::vector<std::vector<char>> staging(arena.size());
  std::vector<NamedTensor> named;
  for (size_t i = 0; i < arena.size(); ++i) {
    const TensorSpec& s = arena.spec(i);
    staging[i].resize(s.nbytes());
    Tensor host = Tensor::make(staging[i].data(), s.dtype, s.shape.data(), static_cast<int>(s.shape.size()));
    be.copy(host, arena.tensor(i));
    named.push_back({s.name, host});
  }
  be.synchronize();
  DType dt = DType::kF32;
  if (arena.size() > 0) dt = arena.spec(0).dtype;
  return safetensors_write(path, named, model_file_metadata(c, dt));
}

std::map<std::string, std::string> model_file_metadata(const Config& c, DType weights) {
  std::string prec = dtype_name(weights);
  for (char& ch : prec) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  return {{"format", "pt"}, {"laplace_config", c.to_json()}, {kPrecisionKey, prec}};
}

Status weights_load(const std::string& path, Backend& be, const Arena& arena) {
  SafeTensorsReader reader;
  LAPLACE_RETURN_IF_ERROR(SafeTensorsReader::open(path, &reader));
  const auto prec = reader.metadata().find(kPrecisionKey);
  bool fp8 = prec != reader.metadata().end() && prec->second.rfind("fp8", 0) == 0;
  for (const auto& t : reader.tensors()) fp8 = fp8 || t.dtype == DType::kF8E4M3;
  if (fp8)
    return Status::unsupported(path + " holds FP8 weights (" + kPrecisionKey + " " +
                               (prec != reader.metadata().end() ? prec->second : std::string("F8_E4M3 tensors")) +
                               "), which this path cannot compute with: load the model they were quantised from, "
                               "or write F32 weights from them with `laplace quantize --dequantize`");
  std::set<std::string> expected;
  for (size_t i = 0; i < arena.size(); ++i) {
    const TensorSpec& s = arena.spec(i);
    expected.insert(s.name);
    if (!reader.find(s.name)) return Status::invalid_argument(path + ": missing tensor " + s.name);
    Tensor dst = arena.tensor(i);
    if (dst.device == Device::kCPU) {
      LAPLACE_RETURN_IF_ERROR(reader.read_into(s.name, dst).with_context(path));
    } else {
      std::vector<char> host(s.nbytes());
      Tensor h = Tensor::make(host.data(), s.dtype, s.shape.data(), static_cast<int>(s.shape.size()));
      LAPLACE_RETURN_IF_ERROR(reader.read_into(s.name, h).with_context(path));
      be.copy(dst, h);
      be.synchronize();
    }
  }
  for (const auto& t : reader.tensors())
    if (!expected.count(t.name))
      return Status::invalid_argument(path + ": unexpected tensor " + t.name +
                                      " (is this checkpoint for a different config?)");
  return Status::ok();
}

}  // namespace laplace
