// `laplace export hf --model SRC --out DIR`: a model directory that Hugging Face transformers loads with
// AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True).
//
// DIR gets config.json (SRC's, with "architectures" and "auto_map" added), model.safetensors and
// tokenizer.model (copied), and configuration_laplace.py + modeling_laplace.py: python/laplace's files,
// embedded into this binary at build time (cmake/embed_files.cmake -> cli/hf_files.h), so the export needs
// no source tree and always ships the modeling code the binary was built with. SRC is checked first: its
// config must load and its model.safetensors must hold exactly the config's tensors (names and shapes).
// DIR may equal SRC (the files are then added in place).
#include <cstdio>
#include <filesystem>
#include <set>
#include <string>

#include <nlohmann/json.hpp>
#include <unistd.h>

#include "cli/common.h"
#include "cli/hf_files.h"
#include "core/file_util.h"
#include "core/safetensors.h"
#include "model/config.h"
#include "model/quantize.h"
#include "model/weights.h"

namespace laplace::cli {

namespace {

namespace fs = std::filesystem;

std::string shape_string(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

// model.safetensors must hold exactly the tensors of weight_specs(c), and for each FP8 one (`laplace
// quantize`) its per-row F32 scales, which the Python package applies: the error names the tensor.
Status check_weights(const Config& c, const std::string& path) {
  SafeTensorsReader r;
  LAPLACE_RETURN_IF_ERROR(SafeTensorsReader::open(path, &r));
  std::set<std::string> expected;
  for (const TensorSpec& spec : weight_specs(c, DType::kF32)) {
    expected.insert(spec.name);
    const SafeTensorInfo* info = r.find(spec.name);
    if (!info) return Status::invalid_argument(path + " lacks tensor " + spec.name + " " + shape_string(spec.shape));
    if (info->shape != spec.shape)
      return Status::invalid_argument(path + ": tensor " + spec.name + " has shape " + shape_string(info->shape) +
                                      ", the config needs " + shape_string(spec.shape));
    if (info->dtype != DType::kF8E4M3) continue;
    const std::string scale = fp8_scale_name(spec.name);
    const SafeTensorInfo* si = r.find(scale);
    const std::vector<int64_t> rows = {spec.shape[0]};
    if (!si || si->dtype != DType::kF32 || si->shape != rows)
      return Status::invalid_argument(path + ": FP8 tensor " + spec.name + " needs its scales " + scale + ", F32 " +
                                      shape_string(rows) + (si ? ", not " + std::string(dtype_name(si->dtype)) + " " +
                                                                     shape_string(si->shape)
                                                               : ", which are missing"));
    // Their values too: the package would otherwise turn a NaN code or a bad scale into NaN weights.
    const int64_t cols = info->numel() / rows[0];
    std::vector<float> scales(static_cast<size_t>(rows[0]));
    LAPLACE_RETURN_IF_ERROR(r.read_into(scale, Tensor(scales.data(), DType::kF32, {rows[0]})).with_context(path));
    LAPLACE_RETURN_IF_ERROR(fp8_check_rows(r.bytes(*info), scales.data(), rows[0], cols, spec.name).with_context(path));
    expected.insert(scale);
  }
  for (const SafeTensorInfo& info : r.tensors())
    if (!expected.count(info.name))
      return Status::invalid_argument(path + " has unexpected tensor " + info.name +
                                      " (not a parameter of this config)");
  return Status::ok();
}

// Copies src to dst through a temporary file in dst's directory, renamed over dst (no half-written file).
Status copy_file_atomic(const fs::path& src, const fs::path& dst) {
  std::error_code ec;
  if (fs::exists(dst, ec) && fs::equivalent(src, dst, ec)) return Status::ok();
  const fs::path tmp = dst.string() + ".tmp." + std::to_string(::getpid());
  fs::copy_file(src, tmp, fs::copy_options::overwrite_existing, ec);
  if (ec) {
    fs::remove(tmp, ec);
    return Status::io_error("cannot copy " + src.string() + " to " + tmp.string() + ": " + ec.message());
  }
  fs::rename(tmp, dst, ec);
  if (ec) {
    std::error_code ec2;
    fs::remove(tmp, ec2);
    return Status::io_error("cannot rename " + tmp.string() + " to " + dst.string() + ": " + ec.message());
  }
  return Status::ok();
}

Status run_export_hf(const std::string& src, const std::string& out) {
  if (!fs::is_directory(src)) return Status::not_found("model directory " + src + " does not exist");
  const fs::path s(src), d(out);
  const fs::path cfg_path = s / "config.json", weights = s / "model.safetensors", tok = s / "tokenizer.model";
  Config c;
  LAPLACE_RETURN_IF_ERROR(config_load(cfg_path.string(), &c));
  if (!fs::exists(weights)) return Status::not_found("model directory " + src + " has no model.safetensors");
  LAPLACE_RETURN_IF_ERROR(check_weights(c, weights.string()));

  std::error_code ec;
  fs::create_directories(d, ec);
  if (ec) return Status::io_error("cannot create " + out + ": " + ec.message());
  LAPLACE_RETURN_IF_ERROR(copy_file_atomic(weights, d / "model.safetensors"));
  const bool have_tok = fs::exists(tok);
  if (have_tok) LAPLACE_RETURN_IF_ERROR(copy_file_atomic(tok, d / "tokenizer.model"));
  LAPLACE_RETURN_IF_ERROR(copy_file_atomic(cfg_path, d / "config.json"));
  LAPLACE_RETURN_IF_ERROR(write_hf_files(out));
  std::printf("wrote %s: config.json (auto_map), model.safetensors, %sconfiguration_laplace.py, modeling_laplace.py\n",
              out.c_str(), have_tok ? "tokenizer.model, " : "");
  if (!have_tok) std::printf("note: %s has no tokenizer.model, so the export has none\n", src.c_str());
  std::printf("load it with: AutoModelForCausalLM.from_pretrained(\"%s\", trust_remote_code=True)\n", out.c_str());
  return Status::ok();
}

}  // namespace

Status write_hf_files(const std::string& dir) {
  const fs::path d(dir);
  const fs::path cfg_path = d / "config.json";
  // config.json: every key (in order), plus what transformers needs to find the classes.
  std::string text;
  LAPLACE_RETURN_IF_ERROR(read_file(cfg_path.string(), &text));
  nlohmann::ordered_json j = nlohmann::ordered_json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return Status::invalid_argument(cfg_path.string() + " is not a JSON object");
  j["architectures"] = nlohmann::ordered_json::array({"LaplaceForCausalLM"});
  j["auto_map"] = {{"AutoConfig", "configuration_laplace.LaplaceConfig"},
                   {"AutoModelForCausalLM", "modeling_laplace.LaplaceForCausalLM"}};
  const std::string cfg_text = j.dump(2) + "\n";
  LAPLACE_RETURN_IF_ERROR(write_file_atomic((d / "configuration_laplace.py").string(),
                                            embedded::kConfigurationLaplacePy, embedded::kConfigurationLaplacePySize));
  LAPLACE_RETURN_IF_ERROR(write_file_atomic((d / "modeling_laplace.py").string(), embedded::kModelingLaplacePy,
                                            embedded::kModelingLaplacePySize));
  // config.json last: a directory with auto_map always has the files it names.
  return write_file_atomic(cfg_path.string(), cfg_text.data(), cfg_text.size());
}

void add_export(CLI::App& app) {
  auto* cmd = app.add_subcommand("export", "write a model directory for other tools");
  cmd->require_subcommand(1);
  auto* hf = cmd->add_subcommand(
      "hf", "a Hugging Face transformers directory: loads with from_pretrained(DIR, trust_remote_code=True)");
  struct A { std::string model, out; };
  auto a = std::make_shared<A>();
  hf->add_option("--model", a->model, "model directory (config.json, model.safetensors, tokenizer.model)")->required();
  hf->add_option("--out", a->out, "output directory (created; may be --model's)")->required();
  hf->callback([a] { g_exit_code = report(run_export_hf(a->model, a->out)); });
}

}  // namespace laplace::cli
