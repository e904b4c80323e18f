#include "model/quantize.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <system_error>
#include <vector>

#include "core/file_util.h"
#include "core/fp8.h"
#include "core/safetensors.h"
#include "model/config.h"
#include "model/weights.h"

namespace laplace {

void fp8_quantize_rows(const float* w, int64_t rows, int64_t cols, uint8_t* q, float* scale) {
  for (int64_t r = 0; r < rows; ++r) scale[r] = e4m3_quantize_row(w + r * cols, cols, q + r * cols);
}

void fp8_dequantize_rows(const uint8_t* q, const float* scale, int64_t rows, int64_t cols, float* w) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) w[r * cols + c] = e4m3_dequantize(q[r * cols + c], scale[r]);
}

std::string fp8_scale_name(const std::string& weight) { return weight + "_scale"; }

Status fp8_check_rows(const uint8_t* q, const float* scale, int64_t rows, int64_t cols, const std::string& name) {
  for (int64_t r = 0; r < rows; ++r) {
    if (!(std::isfinite(scale[r]) && scale[r] > 0.f))
      return Status::invalid_argument(fp8_scale_name(name) + ": row " + std::to_string(r) + "'s scale is " +
                                      std::to_string(scale[r]) + " (a scale must be finite and positive)");
    const uint8_t* row = q + r * cols;
    // (b & 0x7F) + 1 reaches 0x80 for the NaN codes alone; byte ORs without an early exit
    // vectorise, and a 3B model has 2.7 billion codes.
    uint8_t any = 0;
    for (int64_t c = 0; c < cols; ++c) any |= static_cast<uint8_t>((row[c] & 0x7F) + 1);
    if (!(any & 0x80)) continue;
    int64_t c = 0;
    while ((row[c] & 0x7F) != 0x7F) ++c;
    return Status::invalid_argument(name + ": a NaN code at row " + std::to_string(r) + ", column " +
                                    std::to_string(c) + " (FP8 weights hold none)");
  }
  return Status::ok();
}

Status fp8_read_rows(const SafeTensorsReader& r, const std::string& name, int64_t rows, int64_t cols,
                     std::vector<uint8_t>* q, std::vector<float>* s) {
  q->resize(static_cast<size_t>(rows * cols));
  s->resize(static_cast<size_t>(rows));
  LAPLACE_RETURN_IF_ERROR(r.read_into(name, Tensor(q->data(), DType::kF8E4M3, {rows, cols})));
  LAPLACE_RETURN_IF_ERROR(r.read_into(fp8_scale_name(name), Tensor(s->data(), DType::kF32, {rows})));
  return fp8_check_rows(q->data(), s->data(), rows, cols, name);
}

Status is_fp8_model_file(const std::string& path, bool* fp8) {
  SafeTensorsReader r;
  LAPLACE_RETURN_IF_ERROR(SafeTensorsReader::open(path, &r));
  const auto prec = r.metadata().find(kPrecisionKey);
  *fp8 = prec != r.metadata().end() && prec->second == kPrecisionFp8Rows;
  return Status::ok();
}

Status fp8_round_body_matrices(Model& m) {
  const Arena& a = m.weight_arena();
  Backend& be = m.backend();
  for (size_t i = 0; i < a.size(); ++i) {
    const TensorSpec& s = a.spec(i);
    if (!is_body_matrix(s.name)) continue;
    const int64_t rows = s.shape[0], cols = s.numel() / rows;
    std::vector<float> w(static_cast<size_t>(rows * cols)), sc(static_cast<size_t>(rows));
    std::vector<uint8_t> q(static_cast<size_t>(rows * cols));
    Tensor host = Tensor::make(w.data(), DType::kF32, s.shape.data(), static_cast<int>(s.shape.size()));
    be.copy(host, a.tensor(i));
    be.synchronize();
    fp8_quantize_rows(w.data(), rows, cols, q.data(), sc.data());
    fp8_dequantize_rows(q.data(), sc.data(), rows, cols, w.data());
    be.copy(a.tensor(i), host);
    be.synchronize();
  }
  return Status::ok();
}

namespace {

Status copy_if_present(const std::string& from, const std::string& to) {
  if (!std::filesystem::exists(from)) return Status::ok();
  std::string s;
  LAPLACE_RETURN_IF_ERROR(read_file(from, &s));
  return write_file_atomic(to, s.data(), s.size());
}

}  // namespace

Status quantize_model_dir(const std::string& model_dir, const std::string& out_dir, bool dequantize, bool quiet) {
  const std::string in_path = model_dir + "/model.safetensors";
  Config c;
  LAPLACE_RETURN_IF_ERROR(config_load(model_dir + "/config.json", &c));
  SafeTensorsReader r;
  LAPLACE_RETURN_IF_ERROR(SafeTensorsReader::open(in_path, &r));
  const auto prec = r.metadata().find(kPrecisionKey);
  const bool is_fp8 = prec != r.metadata().end() && prec->second == kPrecisionFp8Rows;
  if (dequantize && !is_fp8)
    return Status::invalid_argument(in_path + " does not hold FP8 weights (no " + std::string(kPrecisionKey) + "=" +
                                    kPrecisionFp8Rows + "): nothing to dequantise");
  if (!dequantize && is_fp8) return Status::invalid_argument(in_path + " holds FP8 weights already");
  // The error_code overloads: a path that cannot be examined (missing, no permission) is simply
  // not the same file, and writing there fails later with its own message.
  std::error_code ec;
  if (std::filesystem::equivalent(model_dir, out_dir, ec) ||
      std::filesystem::equivalent(in_path, out_dir + "/model.safetensors", ec))
    return Status::invalid_argument("--out must be another directory than --model");

  std::vector<std::vector<char>> bufs;  // owns every tensor written
  bufs.reserve(weight_specs(c, DType::kF32).size() * 2);
  std::vector<NamedTensor> named;
  double err2 = 0, ref2 = 0;
  for (const TensorSpec& s : weight_specs(c, DType::kF32)) {
    const bool body = is_body_matrix(s.name);
    const int64_t rows = s.shape[0], cols = s.numel() / rows;
    const int64_t shape2[2] = {rows, cols}, shape1[1] = {rows};
    if (!r.find(s.name)) return Status::invalid_argument(in_path + ": missing tensor " + s.name);
    if (dequantize && body) {
      if (!r.find(fp8_scale_name(s.name)))
        return Status::invalid_argument(in_path + ": missing tensor " + fp8_scale_name(s.name));
      std::vector<uint8_t> q;
      std::vector<float> sc;
      LAPLACE_RETURN_IF_ERROR(fp8_read_rows(r, s.name, rows, cols, &q, &sc).with_context(in_path));
      bufs.emplace_back(static_cast<size_t>(rows * cols) * 4);
      fp8_dequantize_rows(q.data(), sc.data(), rows, cols, reinterpret_cast<float*>(bufs.back().data()));
      named.push_back({s.name, Tensor::make(bufs.back().data(), DType::kF32, s.shape.data(),
                                            static_cast<int>(s.shape.size()))});
      continue;
    }
    bufs.emplace_back(static_cast<size_t>(s.numel()) * 4);
    float* w = reinterpret_cast<float*>(bufs.back().data());
    LAPLACE_RETURN_IF_ERROR(
        r.read_into(s.name, Tensor::make(w, DType::kF32, s.shape.data(), static_cast<int>(s.shape.size()))));
    if (dequantize || !body) {
      named.push_back({s.name, Tensor::make(w, DType::kF32, s.shape.data(), static_cast<int>(s.shape.size()))});
      continue;
    }
    std::vector<char> q(static_cast<size_t>(rows * cols)), sc(static_cast<size_t>(rows) * 4);
    fp8_quantize_rows(w, rows, cols, reinterpret_cast<uint8_t*>(q.data()), reinterpret_cast<float*>(sc.data()));
    double e2 = 0, w2 = 0;
    for (int64_t r0 = 0; r0 < rows; ++r0)
      for (int64_t c0 = 0; c0 < cols; ++c0) {
        const double x = w[r0 * cols + c0];
        const double d = static_cast<double>(e4m3_dequantize(static_cast<uint8_t>(q[r0 * cols + c0]),
                                                             reinterpret_cast<const float*>(sc.data())[r0])) -
                         x;
        e2 += d * d;
        w2 += x * x;
      }
    err2 += e2;
    ref2 += w2;
    if (!quiet) std::printf("%-40s [%lld, %lld] rel. RMS error %.3e\n", s.name.c_str(), (long long)rows,
                            (long long)cols, w2 > 0 ? std::sqrt(e2 / w2) : 0.0);
    bufs.push_back(std::move(q));
    named.push_back({s.name, Tensor::make(bufs.back().data(), DType::kF8E4M3, shape2, 2)});
    bufs.push_back(std::move(sc));
    named.push_back({fp8_scale_name(s.name), Tensor::make(bufs.back().data(), DType::kF32, shape1, 1)});
  }
  ec.clear();
  std::filesystem::create_directories(out_dir, ec);
  if (ec) return Status::io_error("cannot create " + out_dir + ": " + ec.message());
  std::map<std::string, std::string> meta = model_file_metadata(c, DType::kF32);
  if (!dequantize) meta[kPrecisionKey] = kPrecisionFp8Rows;
  LAPLACE_RETURN_IF_ERROR(safetensors_write(out_dir + "/model.safetensors", named, meta));
  const std::string cfg_text = c.to_json();
  LAPLACE_RETURN_IF_ERROR(write_file_atomic(out_dir + "/config.json", cfg_text.data(), cfg_text.size()));
  LAPLACE_RETURN_IF_ERROR(copy_if_present(model_dir + "/tokenizer.model", out_dir + "/tokenizer.model"));
  if (!quiet) {
    if (dequantize) std::printf("wrote %s/model.safetensors: F32 weights from the FP8 ones\n", out_dir.c_str());
    else
      std::printf("wrote %s/model.safetensors: body matrices FP8 E4M3 with per-row scales; all of them: rel. RMS "
                  "error %.3e\n", out_dir.c_str(), ref2 > 0 ? std::sqrt(err2 / ref2) : 0.0);
  }
  return Status::ok();
}

}  // namespace laplace
