// FP8 weights: the body matrices (W_qkvg, W_o, W_12, W_3) in E4M3 (core/fp8.h) with one F32
// scale per row, i.e. per output channel, beside them as "<name>_scale" ("...weight_scale", the
// name vLLM uses). Per row rather than one scale per tensor: a row of small weights keeps its own
// range, and cuBLASLt applies per-row scales inside the product (its outer-vector scale mode), so
// they need no pass of their own. Everything else
// (embedding, norms, the LM head) stays as it was. The file says what it holds in its metadata
// (kPrecisionKey).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/safetensors.h"
#include "core/status.h"
#include "model/model.h"

namespace laplace {

inline constexpr const char* kPrecisionKey = "laplace_precision";
inline constexpr const char* kPrecisionFp8Rows = "fp8_e4m3_rows";

// s[r] = e4m3_scale(max_c |w[r][c]|) (max / 448; 1 for a row of zeros); q[r][c] = e4m3(w[r][c] · (1 / s[r]))
// (core/fp8.h's e4m3_quantize_row).
void fp8_quantize_rows(const float* w, int64_t rows, int64_t cols, uint8_t* q, float* scale);
// w[r][c] = e4m3_dequantize(q[r][c], s[r]) (core/fp8.h).
void fp8_dequantize_rows(const uint8_t* q, const float* scale, int64_t rows, int64_t cols, float* w);
// "<weight>_scale".
std::string fp8_scale_name(const std::string& weight);

// A code buffer's first r·c bytes seen as an F8E4M3 matrix [r, c].
inline Tensor fp8_codes(const Tensor& buf, int64_t r, int64_t c) {
  const int64_t shape[2] = {r, c};
  return Tensor::make(buf.data, DType::kF8E4M3, shape, 2, buf.device);
}
// Whether the codes and scales of a matrix read from a file are FP8 weights: every scale finite
// and positive (e4m3_scale gives at least FLT_MIN) and no code NaN (a quantiser saturates, so
// 0x7F and 0xFF never stand for a weight). Says which row or element otherwise, under `name`.
Status fp8_check_rows(const uint8_t* q, const float* scale, int64_t rows, int64_t cols, const std::string& name);
// Matrix `name`'s codes [rows, cols] and its scales (fp8_scale_name) [rows] from a model file into
// q and s, checked by fp8_check_rows: what every loader of FP8 weights reads.
Status fp8_read_rows(const SafeTensorsReader& r, const std::string& name, int64_t rows, int64_t cols,
                     std::vector<uint8_t>* q, std::vector<float>* s);
// Whether a model file holds FP8 weights (its metadata says kPrecisionFp8Rows); reads the header only.
Status is_fp8_model_file(const std::string& path, bool* fp8);
// Every body matrix of `m` ← its FP8 round trip (quantise per row, dequantise), in m's dtype:
// what FP8 weights compute with, for a path that multiplies in BF16/F32 (`eval serving`'s
// fp8-weights option measures what the rounding costs).
Status fp8_round_body_matrices(Model& m);

// `laplace quantize`: model_dir's model.safetensors → out_dir with FP8 body matrices and their
// scales (config.json and tokenizer.model copied), printing each matrix's relative RMS error.
// dequantize: the reverse, an FP8 directory → F32 weights equal to its FP8 values times their
// scales, which every path loads (to measure what the rounding costs, or to serve without FP8).
Status quantize_model_dir(const std::string& model_dir, const std::string& out_dir, bool dequantize, bool quiet);

}  // namespace laplace
