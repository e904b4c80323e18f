#include "serve/openai_api.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdlib>

namespace laplace {

using nlohmann::json;

json ApiError::to_json() const {
  json e = {{"message", message}, {"type", type}};
  e["param"] = param.empty() ? json(nullptr) : json(param);
  e["code"] = code.empty() ? json(nullptr) : json(code);
  return json{{"error", e}};
}

bool valid_session_name(const std::string& name) {
  if (name.empty() || name.size() > 64 || name[0] == '.') return false;
  for (char c : name)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-' || c == '.')) return false;
  return true;
}

namespace {

ApiError bad(const std::string& param, const std::string& msg) { return ApiError{400, msg, "invalid_request_error", param, ""}; }

// Field readers: absent or null leaves *out unchanged; a wrong type is an error.
std::optional<ApiError> get_number(const json& b, const char* k, double lo, double hi, double* out) {
  if (!b.contains(k) || b[k].is_null()) return std::nullopt;
  if (!b[k].is_number()) return bad(k, std::string("'") + k + "' must be a number");
  const double v = b[k].get<double>();
  if (!std::isfinite(v) || v < lo || v > hi)
    return bad(k, std::string("'") + k + "' must be between " + std::to_string(lo) + " and " + std::to_string(hi));
  *out = v;
  return std::nullopt;
}

std::optional<ApiError> get_int(const json& b, const char* k, int64_t lo, int64_t hi, int64_t* out) {
  if (!b.contains(k) || b[k].is_null()) return std::nullopt;
  const json& v = b[k];
  if (!v.is_number_integer()) {
    // 16.0 is accepted as 16 (JSON has one number type); 16.5 is not.
    if (v.is_number_float() && std::isfinite(v.get<double>()) && std::floor(v.get<double>()) == v.get<double>() &&
        std::fabs(v.get<double>()) < 9e15) {
      const int64_t i = static_cast<int64_t>(v.get<double>());
      if (i < lo || i > hi)
        return bad(k, std::string("'") + k + "' must be between " + std::to_string(lo) + " and " + std::to_string(hi));
      *out = i;
      return std::nullopt;
    }
    return bad(k, std::string("'") + k + "' must be an integer");
  }
  // Unsigned values past int64 and huge negatives are range errors, not overflow.
  if (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(hi))
    return bad(k, std::string("'") + k + "' must be at most " + std::to_string(hi));
  const int64_t i = v.get<int64_t>();
  if (i < lo || i > hi)
    return bad(k, std::string("'") + k + "' must be between " + std::to_string(lo) + " and " + std::to_string(hi));
  *out = i;
  return std::nullopt;
}

std::optional<ApiError> get_bool(const json& b, const char* k, bool* out) {
  if (!b.contains(k) || b[k].is_null()) return std::nullopt;
  if (!b[k].is_boolean()) return bad(k, std::string("'") + k + "' must be a boolean");
  *out = b[k].get<bool>();
  return std::nullopt;
}

std::optional<ApiError> get_string(const json& b, const char* k, std::string* out) {
  if (!b.contains(k) || b[k].is_null()) return std::nullopt;
  if (!b[k].is_string()) return bad(k, std::string("'") + k + "' must be a string");
  *out = b[k].get<std::string>();
  return std::nullopt;
}

// Message content: a string, or an array of {"type": "text", "text": ...} parts.
std::optional<ApiError> get_content(const json& m, std::string* out) {
  if (!m.contains("content") || m["content"].is_null()) {
    out->clear();
    return std::nullopt;
  }
  const json& c = m["content"];
  if (c.is_string()) {
    *out = c.get<std::string>();
    return std::nullopt;
  }
  if (!c.is_array()) return bad("messages", "message content must be a string or an array of text parts");
  out->clear();
  for (const json& part : c) {
    if (!part.is_object() || !part.contains("type") || part["type"] != "text" || !part.contains("text") ||
        !part["text"].is_string())
      return bad("messages", "only text content parts ({\"type\": \"text\", \"text\": ...}) are supported");
    *out += part["text"].get<std::string>();
  }
  return std::nullopt;
}

}  // namespace

#define LAPLACE_API_TRY(expr)                 \
  do {                                        \
    if (auto e_ = (expr)) return e_;          \
  } while (0)

std::optional<ApiError> parse_completion_params(const json& b, bool chat, const ApiLimits& lim,
                                                CompletionParams* out) {
  if (!b.is_object()) return bad("", "the request body must be a JSON object");
  CompletionParams p;
  p.chat = chat;
  LAPLACE_API_TRY(get_string(b, "model", &p.model));

  if (chat) {
    if (!b.contains("messages")) return bad("messages", "'messages' is required");
    const json& ms = b["messages"];
    if (!ms.is_array() || ms.empty()) return bad("messages", "'messages' must be a non-empty array");
    for (const json& m : ms) {
      if (!m.is_object()) return bad("messages", "each message must be an object");
      ChatMessage cm;
      if (!m.contains("role") || !m["role"].is_string()) return bad("messages", "each message needs a string 'role'");
      cm.role = m["role"].get<std::string>();
      if (cm.role != "system" && cm.role != "developer" && cm.role != "user" && cm.role != "assistant")
        return bad("messages", "unsupported role '" + cm.role + "' (system, developer, user, assistant)");
      LAPLACE_API_TRY(get_content(m, &cm.content));
      p.messages.push_back(std::move(cm));
    }
  } else {
    if (!b.contains("prompt") || b["prompt"].is_null()) return bad("prompt", "'prompt' is required");
    const json& pr = b["prompt"];
    // A list of token ids is one prompt; a list of strings or of id lists is a batch (what
    // lm-evaluation-harness sends at batch sizes above 1), each prompt its own choices.
    auto ids_of = [](const json& a, PromptInput* out) -> std::optional<ApiError> {
      out->is_ids = true;
      for (const json& t : a) {
        if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() > INT32_MAX)
          return bad("prompt", "a token-id prompt must be an array of non-negative integers");
        out->ids.push_back(static_cast<int32_t>(t.get<int64_t>()));
      }
      return std::nullopt;
    };
    if (pr.is_string()) {
      p.prompts.push_back(PromptInput{pr.get<std::string>(), {}, false});
    } else if (pr.is_array() && !pr.empty() && pr[0].is_number()) {
      PromptInput in;
      LAPLACE_API_TRY(ids_of(pr, &in));
      p.prompts.push_back(std::move(in));
    } else if (pr.is_array() && !pr.empty() && (pr[0].is_string() || pr[0].is_array())) {
      if (static_cast<int64_t>(pr.size()) > lim.max_prompts)
        return bad("prompt", "at most " + std::to_string(lim.max_prompts) + " prompts in one request");
      const bool strings = pr[0].is_string();
      for (const json& one : pr) {
        PromptInput in;
        if (strings && one.is_string()) {
          in.text = one.get<std::string>();
        } else if (!strings && one.is_array()) {
          LAPLACE_API_TRY(ids_of(one, &in));
        } else {
          return bad("prompt", "a list of prompts must be all strings or all arrays of token ids");
        }
        p.prompts.push_back(std::move(in));
      }
    } else {
      return bad("prompt", "'prompt' must be a string, an array of token ids, or an array of either");
    }
  }

  if (!chat) LAPLACE_API_TRY(get_bool(b, "echo", &p.echo));
  p.max_tokens = chat ? lim.default_chat_max_tokens : lim.default_max_tokens;
  // max_tokens 0 only asks for something with echo (the prompt's log-probabilities).
  LAPLACE_API_TRY(get_int(b, "max_tokens", p.echo ? 0 : 1, lim.max_tokens, &p.max_tokens));
  LAPLACE_API_TRY(get_int(b, "max_completion_tokens", 1, lim.max_tokens, &p.max_tokens));

  // Fields we do not implement: a 400 rather than an answer to another question.
  if (!chat) {
    int64_t best_of = 1;
    LAPLACE_API_TRY(get_int(b, "best_of", 1, INT64_MAX, &best_of));
    if (best_of != 1) return bad("best_of", "'best_of' is not supported (use n and pick on the client)");
    std::string suffix;
    LAPLACE_API_TRY(get_string(b, "suffix", &suffix));
    if (!suffix.empty()) return bad("suffix", "'suffix' (insertion) is not supported");
  } else {
    for (const char* k : {"tools", "functions"})
      if (b.contains(k) && !b[k].is_null() && !(b[k].is_array() && b[k].empty()))
        return bad(k, std::string("'") + k + "' (tool calls) is not supported");
    if (b.contains("response_format") && !b["response_format"].is_null()) {
      const json& rf = b["response_format"];
      if (!rf.is_object() || !rf.contains("type") || rf["type"] != "text")
        return bad("response_format", "only {\"type\": \"text\"} is supported as 'response_format'");
    }
  }

  if (b.contains("logit_bias") && !b["logit_bias"].is_null()) {
    const json& lb = b["logit_bias"];
    if (!lb.is_object()) return bad("logit_bias", "'logit_bias' must be an object of token id -> bias");
    if (lb.size() > 1024) return bad("logit_bias", "'logit_bias' may name at most 1024 tokens");
    for (const auto& [key, v] : lb.items()) {
      char* end = nullptr;
      const long long id = std::strtoll(key.c_str(), &end, 10);
      if (key.empty() || *end != '\0' || id < 0 || id > INT32_MAX || !std::isdigit(static_cast<unsigned char>(key[0])))
        return bad("logit_bias", "'logit_bias' keys must be token ids (non-negative integers as strings)");
      if (!v.is_number() || !std::isfinite(v.get<double>()) || v.get<double>() < -100 || v.get<double>() > 100)
        return bad("logit_bias", "'logit_bias' values must be numbers between -100 and 100");
      p.sampling.logit_bias.emplace_back(static_cast<int32_t>(id), static_cast<float>(v.get<double>()));
    }
  }

  double temperature = 1.0, top_p = 1.0, min_p = 0.0, presence = 0.0, frequency = 0.0, repetition = 1.0;
  LAPLACE_API_TRY(get_number(b, "temperature", 0.0, 2.0, &temperature));
  LAPLACE_API_TRY(get_number(b, "top_p", 0.0, 1.0, &top_p));
  if (top_p <= 0) return bad("top_p", "'top_p' must be greater than 0");
  LAPLACE_API_TRY(get_number(b, "min_p", 0.0, 1.0, &min_p));
  LAPLACE_API_TRY(get_number(b, "presence_penalty", -2.0, 2.0, &presence));
  LAPLACE_API_TRY(get_number(b, "frequency_penalty", -2.0, 2.0, &frequency));
  LAPLACE_API_TRY(get_number(b, "repetition_penalty", 1e-3, 100.0, &repetition));
  int64_t top_k = 0;
  LAPLACE_API_TRY(get_int(b, "top_k", -1, 1 << 30, &top_k));
  p.sampling.temperature = temperature;
  p.sampling.top_p = top_p;
  p.sampling.min_p = min_p;
  p.sampling.presence_penalty = presence;
  p.sampling.frequency_penalty = frequency;
  p.sampling.repetition_penalty = repetition;
  p.sampling.top_k = top_k < 0 ? 0 : top_k;  // -1 (vLLM's "off") = 0
  std::sort(p.sampling.logit_bias.begin(), p.sampling.logit_bias.end());

  if (b.contains("seed") && !b["seed"].is_null()) {
    const json& s = b["seed"];
    if (!s.is_number_integer()) return bad("seed", "'seed' must be an integer");
    p.sampling.seed = s.is_number_unsigned() ? s.get<uint64_t>() : static_cast<uint64_t>(s.get<int64_t>());
    p.seed_given = true;
  }

  if (b.contains("stop") && !b["stop"].is_null()) {
    const json& s = b["stop"];
    if (s.is_string()) {
      p.stop.push_back(s.get<std::string>());
    } else if (s.is_array()) {
      for (const json& x : s) {
        if (!x.is_string()) return bad("stop", "'stop' must be a string or an array of strings");
        p.stop.push_back(x.get<std::string>());
      }
    } else {
      return bad("stop", "'stop' must be a string or an array of strings");
    }
    if (static_cast<int64_t>(p.stop.size()) > lim.max_stop)
      return bad("stop", "at most " + std::to_string(lim.max_stop) + " stop sequences");
    for (const std::string& x : p.stop) {
      if (x.empty()) return bad("stop", "stop sequences must not be empty");
      if (static_cast<int64_t>(x.size()) > lim.max_stop_bytes) return bad("stop", "stop sequence too long");
    }
  }

  LAPLACE_API_TRY(get_int(b, "n", 1, lim.max_n, &p.n));
  LAPLACE_API_TRY(get_bool(b, "stream", &p.stream));
  if (b.contains("stream_options") && !b["stream_options"].is_null()) {
    const json& so = b["stream_options"];
    if (!so.is_object()) return bad("stream_options", "'stream_options' must be an object");
    LAPLACE_API_TRY(get_bool(so, "include_usage", &p.include_usage));
    if (!p.stream) return bad("stream_options", "'stream_options' is only allowed when 'stream' is true");
  }

  if (chat) {
    bool lp = false;
    LAPLACE_API_TRY(get_bool(b, "logprobs", &lp));
    int64_t top = -1;
    LAPLACE_API_TRY(get_int(b, "top_logprobs", 0, 20, &top));
    if (top >= 0 && !lp) return bad("top_logprobs", "'top_logprobs' needs 'logprobs': true");
    p.logprobs = lp ? static_cast<int>(std::max<int64_t>(top, 0)) : -1;
  } else {
    int64_t lp = -1;
    LAPLACE_API_TRY(get_int(b, "logprobs", 0, 5, &lp));
    p.logprobs = static_cast<int>(lp);
  }

  LAPLACE_API_TRY(get_string(b, "session", &p.session));
  LAPLACE_API_TRY(get_string(b, "save_session", &p.save_session));
  if (!p.session.empty() && !valid_session_name(p.session))
    return bad("session", "session names are 1-64 characters of [A-Za-z0-9_.-], not starting with '.'");
  if (!p.save_session.empty() && !valid_session_name(p.save_session))
    return bad("save_session", "session names are 1-64 characters of [A-Za-z0-9_.-], not starting with '.'");
  if (!p.save_session.empty() && p.n > 1) return bad("save_session", "'save_session' needs n = 1");
  if (!p.save_session.empty() && p.prompts.size() > 1)
    return bad("save_session", "'save_session' needs a single prompt");
  if (p.echo && p.logprobs < 0 && p.max_tokens == 0)
    return bad("max_tokens", "'max_tokens' 0 needs 'echo' with 'logprobs' (there is nothing else to return)");
  LAPLACE_API_TRY(get_bool(b, "cache", &p.cache));
  LAPLACE_API_TRY(get_bool(b, "ignore_eos", &p.ignore_eos));
  *out = std::move(p);
  return std::nullopt;
}

}  // namespace laplace
