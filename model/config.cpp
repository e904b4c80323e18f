#include "model/config.h"

#include <cmath>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

namespace laplace {

int64_t Config::body_params() const {
  const int64_t D = hidden_size;
  const int64_t per_layer = qkvg_rows() * D      // W_qkvg
                            + D * v_dim()        // W_o
                            + 2 * ffn_size * D   // W_12
                            + D * ffn_size;      // W_3
  return num_layers * per_layer;
}

int64_t Config::total_params() const {
  const int64_t D = hidden_size;
  const int64_t per_layer_small = 2 * D          // norm1
                                  + D * conv_size
                                  + head_v_dim   // onorm
                                  + 2 * D;       // norm2
  int64_t n = body_params() + num_layers * per_layer_small;
  n += vocab_size * D;                 // embedding
  n += 2 * D;                          // final norm
  if (!tie_embeddings) n += vocab_size * D;  // lm_head
  return n;
}

int64_t Config::state_bytes_per_sequence() const {
  return num_layers * (num_heads * head_k_dim * head_v_dim + conv_size * hidden_size) * 4;
}

double Config::train_flops_per_token() const {
  const double body = static_cast<double>(body_params());
  const double vd = static_cast<double>(vocab_size) * hidden_size;
  const double mixer = static_cast<double>(num_layers) * 3.0 * num_heads *
                       (chunk_size * (head_k_dim + head_v_dim) + 4.0 * head_k_dim * head_v_dim);
  return 6.0 * (body + vd) + mixer;
}

std::vector<double> Config::decays() const {
  std::vector<double> d(num_heads);
  for (int64_t h = 0; h < num_heads; ++h) {
    const int64_t e = decay_exponents.empty() ? 5 + h : decay_exponents[static_cast<size_t>(h)];
    d[h] = 1.0 - std::ldexp(1.0, static_cast<int>(-e));
  }
  return d;
}

Status Config::validate() const {
  auto bad = [](const std::string& f, const std::string& why) {
    return Status::invalid_argument("config field '" + f + "' " + why);
  };
  struct Range { const char* name; int64_t v, lo, hi; };
  const Range ranges[] = {
      {"vocab_size", vocab_size, 2, int64_t{1} << 31},
      {"hidden_size", hidden_size, 1, 1 << 16},
      {"num_layers", num_layers, 1, 1024},
      {"num_heads", num_heads, 1, 256},
      {"head_k_dim", head_k_dim, 1, 1024},
      {"head_v_dim", head_v_dim, 1, 1024},
      {"ffn_size", ffn_size, 1, 1 << 18},
      {"conv_size", conv_size, 1, 64},
      {"chunk_size", chunk_size, 1, 1 << 16},
  };
  for (const auto& r : ranges)
    if (r.v < r.lo || r.v > r.hi)
      return bad(r.name, "= " + std::to_string(r.v) + " is outside [" + std::to_string(r.lo) + ", " +
                             std::to_string(r.hi) + "]");
  // λ_h = 1 − 2^(−5−h) must stay distinguishable from 1 in double precision.
  if (decay_exponents.empty() && num_heads > 40) return bad("num_heads", "> 40 gives decays that round to 1.0");
  if (!decay_exponents.empty()) {
    if (static_cast<int64_t>(decay_exponents.size()) != num_heads)
      return bad("decay_exponents", "has " + std::to_string(decay_exponents.size()) + " entries; num_heads is " +
                                        std::to_string(num_heads));
    for (int64_t e : decay_exponents)
      if (e < 1 || e > 44)
        return bad("decay_exponents", "holds " + std::to_string(e) + ", outside [1, 44] (λ = 1 − 2^(−e) must be in (0, 1))");
  }
  if (!(norm_eps > 0 && norm_eps < 1)) return bad("norm_eps", "must be in (0, 1)");
  if (bos_token_id >= vocab_size) return bad("bos_token_id", "must be < vocab_size");
  if (eos_token_id >= vocab_size) return bad("eos_token_id", "must be < vocab_size");
  return Status::ok();
}

std::string Config::to_json() const {
  nlohmann::ordered_json j;
  j["model_type"] = "laplace";
  j["vocab_size"] = vocab_size;
  j["hidden_size"] = hidden_size;
  j["num_layers"] = num_layers;
  j["num_heads"] = num_heads;
  j["head_k_dim"] = head_k_dim;
  j["head_v_dim"] = head_v_dim;
  j["ffn_size"] = ffn_size;
  j["conv_size"] = conv_size;
  j["chunk_size"] = chunk_size;
  j["norm_eps"] = norm_eps;
  j["tie_embeddings"] = tie_embeddings;
  if (bos_token_id >= 0) j["bos_token_id"] = bos_token_id;
  if (eos_token_id >= 0) j["eos_token_id"] = eos_token_id;
  if (!decay_exponents.empty()) j["decay_exponents"] = decay_exponents;
  return j.dump(2) + "\n";
}

Status config_from_json(const std::string& text, Config* out) {
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return Status::invalid_argument("config is not valid JSON");
  if (!j.is_object()) return Status::invalid_argument("config must be a JSON object");
  if (!j.contains("model_type") || !j["model_type"].is_string() || j["model_type"] != "laplace")
    return Status::invalid_argument("config field 'model_type' must be \"laplace\"");

  Config c;
  auto get_int = [&](const char* key, int64_t* dst, bool required) -> Status {
    if (!j.contains(key)) {
      return required ? Status::invalid_argument(std::string("config field '") + key + "' is missing")
                      : Status::ok();
    }
    const auto& v = j[key];
    if (!v.is_number_integer())
      return Status::invalid_argument(std::string("config field '") + key + "' must be an integer");
    *dst = v.get<int64_t>();
    return Status::ok();
  };
  LAPLACE_RETURN_IF_ERROR(get_int("vocab_size", &c.vocab_size, true));
  LAPLACE_RETURN_IF_ERROR(get_int("hidden_size", &c.hidden_size, true));
  LAPLACE_RETURN_IF_ERROR(get_int("num_layers", &c.num_layers, true));
  LAPLACE_RETURN_IF_ERROR(get_int("num_heads", &c.num_heads, true));
  LAPLACE_RETURN_IF_ERROR(get_int("head_k_dim", &c.head_k_dim, true));
  LAPLACE_RETURN_IF_ERROR(get_int("head_v_dim", &c.head_v_dim, true));
  LAPLACE_RETURN_IF_ERROR(get_int("ffn_size", &c.ffn_size, true));
  LAPLACE_RETURN_IF_ERROR(get_int("conv_size", &c.conv_size, false));
  LAPLACE_RETURN_IF_ERROR(get_int("chunk_size", &c.chunk_size, false));
  LAPLACE_RETURN_IF_ERROR(get_int("bos_token_id", &c.bos_token_id, false));
  LAPLACE_RETURN_IF_ERROR(get_int("eos_token_id", &c.eos_token_id, false));
  if (j.contains("norm_eps")) {
    if (!j["norm_eps"].is_number()) return Status::invalid_argument("config field 'norm_eps' must be a number");
    c.norm_eps = j["norm_eps"].get<double>();
  }
  if (j.contains("tie_embeddings")) {
    if (!j["tie_embeddings"].is_boolean())
      return Status::invalid_argument("config field 'tie_embeddings' must be true or false");
    c.tie_embeddings = j["tie_embeddings"].get<bool>();
  }
  if (j.contains("decay_exponents") && !j["decay_exponents"].is_null()) {
    const auto& v = j["decay_exponents"];
    if (!v.is_array()) return Status::invalid_argument("config field 'decay_exponents' must be an array of integers");
    for (const auto& e : v) {
      if (!e.is_number_integer())
        return Status::invalid_argument("config field 'decay_exponents' must be an array of integers");
      c.decay_exponents.push_back(e.get<int64_t>());
    }
  }
  LAPLACE_RETURN_IF_ERROR(c.validate());
  *out = c;
  return Status::ok();
}

Status config_load(const std::string& path, Config* out) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return Status::not_found("cannot open config file " + path);
  std::ostringstream ss;
  ss << f.rdbuf();
  if (f.bad()) return Status::io_error("error reading config file " + path);
  return config_from_json(ss.str(), out).with_context(path);
}

}  // namespace laplace
