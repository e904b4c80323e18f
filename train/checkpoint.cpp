#include "train/checkpoint.h"

#include <nlohmann/json.hpp>

#include "core/safetensors.h"

namespace laplace {

namespace {

constexpr const char* kKind = "laplace-train-checkpoint";
constexpr const char* kVersion = "1";

// Host copies of device tensors, kept alive until the file is written.
struct Staging {
  std::vector<std::vector<char>> bufs;
  std::vector<NamedTensor> named;
  void add(Backend& be, const std::string& name, const Tensor& t) {
    bufs.emplace_back(t.nbytes());
    Tensor h = Tensor::make(bufs.back().data(), t.dtype, t.shape.data(), t.ndim);
    be.copy(h, t);
    named.push_back({name, h});
  }
};

Status read_tensor(const SafeTensorsReader& r, Backend& be, const std::string& name, Tensor dst) {
  if (!r.find(name)) return Status::invalid_argument(r.path() + ": missing tensor " + name);
  if (dst.device == Device::kCPU) return r.read_into(name, dst);
  std::vector<char> host(dst.nbytes());
  Tensor h = Tensor::make(host.data(), dst.dtype, dst.shape.data(), dst.ndim);
  LAPLACE_RETURN_IF_ERROR(r.read_into(name, h));
  be.copy(dst, h);
  be.synchronize();
  return Status::ok();
}

}  // namespace

std::map<std::string, std::string> checkpoint_metadata(const Config& c, const TrainProgress& p) {
  return {
      {"format", "pt"},
      {"kind", kKind},
      {"version", kVersion},
      {"laplace_config", c.to_json()},
      {"step", std::to_string(p.step)},
      {"optimizer_steps", std::to_string(p.optimizer_steps)},
      {"loader_position", p.loader_position},
      {"seed", std::to_string(p.seed)},
      {"tokens_seen", std::to_string(static_cast<int64_t>(p.tokens_seen))},
      {"train_precision", p.precision},
  };
}

Status checkpoint_read_progress(const SafeTensorsReader& r, const Config& c, TrainProgress* p) {
  const std::string& path = r.path();
  const auto& meta = r.metadata();
  auto get = [&](const char* key, std::string* out) -> Status {
    auto it = meta.find(key);
    if (it == meta.end()) return Status::corrupt(path + ": not a training checkpoint (metadata '" + key + "' missing)");
    *out = it->second;
    return Status::ok();
  };
  std::string kind, version, cfg_json, step, opt_steps, seed, tokens;
  LAPLACE_RETURN_IF_ERROR(get("kind", &kind));
  if (kind != kKind) return Status::corrupt(path + ": not a training checkpoint (kind '" + kind + "')");
  LAPLACE_RETURN_IF_ERROR(get("version", &version));
  if (version != kVersion) return Status::unsupported(path + ": checkpoint version " + version + " (this build reads 1)");
  LAPLACE_RETURN_IF_ERROR(get("laplace_config", &cfg_json));
  Config stored;
  LAPLACE_RETURN_IF_ERROR(config_from_json(cfg_json, &stored).with_context(path + ": stored config"));
  if (stored.to_json() != c.to_json())
    return Status::invalid_argument(path + ": checkpoint was written for a different config");
  LAPLACE_RETURN_IF_ERROR(get("step", &step));
  LAPLACE_RETURN_IF_ERROR(get("optimizer_steps", &opt_steps));
  LAPLACE_RETURN_IF_ERROR(get("loader_position", &p->loader_position));
  LAPLACE_RETURN_IF_ERROR(get("seed", &seed));
  LAPLACE_RETURN_IF_ERROR(get("tokens_seen", &tokens));
  try {
    p->step = std::stoll(step);
    p->optimizer_steps = std::stoll(opt_steps);
    p->seed = std::stoull(seed);
    p->tokens_seen = static_cast<double>(std::stoll(tokens));
  } catch (const std::exception&) {
    return Status::corrupt(path + ": bad step counters in the metadata");
  }
  if (p->step < 0 || p->optimizer_steps < 0 || p->optimizer_steps > p->step)
    return Status::corrupt(path + ": inconsistent step counters in the metadata");
  // Checkpoints from before FP8 training computed in the model dtype.
  const auto prec = meta.find("train_precision");
  p->precision = prec == meta.end() ? train_precision_name(false) : prec->second;
  if (p->precision != train_precision_name(false) && p->precision != train_precision_name(true) &&
      p->precision != train_precision_name(true, true))
    return Status::corrupt(path + ": unknown train_precision '" + p->precision + "'");

  return Status::ok();
}

Status checkpoint_save(const std::string& path, const Config& c, Backend& be, const Arena& weights,
                       const Optimizer& opt, const TrainProgress& p) {
  Staging s;
  for (size_t i = 0; i < weights.size(); ++i) s.add(be, weights.spec(i).name, weights.tensor(i));
  for (const auto& [name, t] : opt.state_tensors()) s.add(be, name, t);
  be.synchronize();
  return safetensors_write(path, s.named, checkpoint_metadata(c, p));
}

Status checkpoint_load(const std::string& path, const Config& c, Backend& be, const Arena& weights, Optimizer* opt,
                       TrainProgress* p) {
  SafeTensorsReader r;
  LAPLACE_RETURN_IF_ERROR(SafeTensorsReader::open(path, &r));
  LAPLACE_RETURN_IF_ERROR(checkpoint_read_progress(r, c, p));

  for (size_t i = 0; i < weights.size(); ++i)
    LAPLACE_RETURN_IF_ERROR(read_tensor(r, be, weights.spec(i).name, weights.tensor(i)).with_context(path));
  // Read the optimizer state into host staging, then hand it over (load_state
  // checks names, shapes and dtypes and changes nothing on error).
  Staging s;
  std::vector<std::pair<std::string, Tensor>> state;
  for (const auto& [name, t] : opt->state_tensors()) {
    s.bufs.emplace_back(t.nbytes());
    Tensor h = Tensor::make(s.bufs.back().data(), t.dtype, t.shape.data(), t.ndim);
    if (!r.find(name)) return Status::invalid_argument(path + ": missing optimizer tensor " + name);
    LAPLACE_RETURN_IF_ERROR(r.read_into(name, h).with_context(path));
    state.emplace_back(name, h);
  }
  return opt->load_state(state, p->optimizer_steps).with_context(path);
}

}  // namespace laplace
