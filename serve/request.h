// A generation request for the engine (serve/engine.h): prompt ids, sampling,
// stopping rules and streaming callbacks, and what the engine reports when it ends.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include "serve/sampler.h"

namespace laplace {

using RequestId = uint64_t;  // 1, 2, 3, ... in submission order; 0 is never used

enum class FinishReason : uint8_t {
  kLength,     // max_tokens generated
  kStop,       // emitted one of stop_ids
  kEos,        // emitted the end-of-sequence id
  kCancelled,  // Engine::cancel
};
const char* finish_reason_name(FinishReason r);  // "length", "stop", "eos", "cancelled"

// What on_finish receives. Times are seconds on the engine's steady clock.
struct FinishInfo {
  RequestId id = 0;
  FinishReason reason = FinishReason::kLength;
  int64_t prompt_tokens = 0;
  int64_t generated_tokens = 0;  // tokens delivered through on_token (a stop/eos token included)
  int32_t slot = -1;             // the slot it ran in (-1: never admitted); its state is left there
                                 // until the slot is given to another request
  double submit_time = 0;        // Engine::now() at submit
  double admit_time = -1;        // when it got a slot (-1: never)
  double first_token_time = -1;  // when its first token was emitted (-1: none)
  double finish_time = 0;
  std::vector<double> token_times;  // emission time of each generated token

  // Time to first token (from submit); -1 without tokens.
  double ttft() const { return first_token_time < 0 ? -1 : first_token_time - submit_time; }
  // Mean time per output token after the first; -1 with fewer than 2 tokens.
  double tpot() const {
    return generated_tokens < 2 ? -1 : (token_times.back() - token_times.front()) / double(generated_tokens - 1);
  }
};

struct Request {
  std::vector<int32_t> prompt;  // non-empty, ids < vocab_size
  SamplingOptions sampling;     // temperature 0 = greedy; seed makes sampling reproducible
  int64_t max_tokens = 64;      // ≥ 1
  std::vector<int32_t> stop_ids;  // finish (reason kStop) after emitting one of these
  // End-of-sequence id: unset = the model config's eos_token_id (none when < 0);
  // -1 = none. Emitting it finishes with kEos (checked before stop_ids).
  std::optional<int32_t> eos_id;

  // Called on the thread running Engine::step(), never under the engine's lock, so
  // they may call submit() and cancel(). on_token gets every generated token in order
  // (a stop/eos token included); on_finish is called exactly once per accepted request.
  std::function<void(RequestId, int32_t token)> on_token;
  std::function<void(const FinishInfo&)> on_finish;
};

}  // namespace laplace
