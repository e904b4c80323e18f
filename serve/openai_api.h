// The OpenAI-compatible request format (/v1/completions, /v1/chat/completions): parsing
// and validation into a plain struct, and the error object. Pure functions, no I/O, so
// every rule is unit-tested without a socket.
//
// Unknown fields are ignored (clients send many); a known field with a wrong type or an
// out-of-range value is an ApiError (HTTP 400, type "invalid_request_error", `param`
// naming the field), as OpenAI answers. Known fields this server does not implement
// (best_of > 1, a suffix, tools, a structured response_format) are a 400 too: ignoring
// them would answer something else than what was asked.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "serve/chat_template.h"
#include "serve/sampler.h"

namespace laplace {

struct ApiError {
  int http_status = 400;
  std::string message;
  std::string type = "invalid_request_error";
  std::string param;  // "" = null
  std::string code;   // "" = null
  nlohmann::json to_json() const;
};

// Server limits the parser enforces.
struct ApiLimits {
  int64_t max_tokens = 4096;         // largest max_tokens a request may ask for
  int64_t default_max_tokens = 16;   // /v1/completions default (OpenAI's)
  int64_t default_chat_max_tokens = 256;
  int64_t max_n = 16;
  int64_t max_prompts = 256;         // prompts in one /v1/completions request
  int64_t max_stop = 4;              // stop strings per request
  int64_t max_stop_bytes = 256;
};

// One prompt of /v1/completions: text, or token ids.
struct PromptInput {
  std::string text;
  std::vector<int32_t> ids;
  bool is_ids = false;
};

struct CompletionParams {
  bool chat = false;
  std::string model;                // "" = not given
  // /v1/completions: one prompt, or a list of them (a string, an array of token ids, or an
  // array of either kind). Each prompt has its own n choices; choice index = prompt × n + k.
  std::vector<PromptInput> prompts;
  std::vector<ChatMessage> messages;  // chat
  int64_t max_tokens = 16;
  SamplingOptions sampling;
  bool seed_given = false;
  std::vector<std::string> stop;
  int64_t n = 1;
  bool stream = false;
  bool include_usage = false;
  int logprobs = -1;  // -1 = none; else the number of top alternatives (0..20)
  // /v1/completions: the prompt's text comes back before the completion's, and with
  // logprobs its tokens' log-probabilities too (the first one null: nothing predicts it).
  // max_tokens may then be 0 (score the prompt, generate nothing).
  bool echo = false;
  // Extensions (named sessions, SPEC §3): start from a session's context, and/or save the
  // context after this request under a name. cache=false bypasses the prefix cache.
  std::string session;
  std::string save_session;
  bool cache = true;
  bool ignore_eos = false;  // keep generating past the end-of-sequence token (vLLM's field)
};

// Parses a request body (already JSON-parsed). chat selects the endpoint's rules.
std::optional<ApiError> parse_completion_params(const nlohmann::json& body, bool chat, const ApiLimits& lim,
                                                CompletionParams* out);

// A session name: 1–64 of [A-Za-z0-9_.-], not starting with '.' (used as a file name).
bool valid_session_name(const std::string& name);

}  // namespace laplace
