// A generation request for the engine (serve/engine.h): prompt ids, sampling,
// stopping rules and streaming callbacks, and what the engine reports when it ends.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "core/dtype.h"
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

// Where a request's context started (FinishInfo::start).
enum class StateSource : uint8_t {
  kEmpty,        // a zeroed slot: the whole prompt was prefilled
  kSnapshot,     // Request::initial_state, written from host memory
  kDeviceCache,  // a device-tier hit of the engine's state cache: a slot-to-slot copy
  kHostCache,    // a host-tier hit: written from host memory
};
const char* state_source_name(StateSource s);  // "empty", "snapshot", "device_cache", "host_cache"

// A sequence's whole context as one fixed-size value (docs/model.md §5): the bytes of its state
// slot after `tokens`, and the logits those tokens leave for the next one. A request
// that starts from a snapshot continues that context exactly as if its tokens had been
// fed again; one snapshot may seed many requests (forks) since it is never modified.
struct StateSnapshot {
  std::vector<uint8_t> state;   // one slot, as StatePool stores it (state_dtype)
  DType state_dtype = DType::kF32;
  std::vector<float> logits;    // [V]: the model's logits after the last of `tokens`
  std::vector<int32_t> tokens;  // the context the state covers, in order (non-empty)
  // Host bytes this snapshot holds (what a cache budget counts).
  int64_t bytes() const {
    return static_cast<int64_t>(state.size() + logits.size() * sizeof(float) + tokens.size() * sizeof(int32_t));
  }
};
using SnapshotPtr = std::shared_ptr<const StateSnapshot>;

// Log-probabilities of one generated token under the model's distribution (log-softmax of
// the raw logits, before temperature and penalties), with the most likely alternatives.
struct TokenLogprobs {
  int32_t token = 0;
  float logprob = 0;
  std::vector<std::pair<int32_t, float>> top;  // best first, ties by lower id; top_logprobs entries
};

// What on_finish receives. Times are seconds on the engine's steady clock.
struct FinishInfo {
  RequestId id = 0;
  FinishReason reason = FinishReason::kLength;
  int64_t prompt_tokens = 0;     // prompt tokens actually fed (prefilled)
  int64_t cached_tokens = 0;     // context tokens the start state covered (not prefilled)
  StateSource start = StateSource::kEmpty;
  int64_t generated_tokens = 0;  // tokens delivered through on_token (a stop/eos token included)
  int32_t slot = -1;             // the slot it ran in (-1: never admitted); its state is left there
                                 // until the slot is given to another request
  double submit_time = 0;        // Engine::now() at submit
  double admit_time = -1;        // when it got a slot (-1: never)
  double first_token_time = -1;  // when its first token was emitted (-1: none)
  double finish_time = 0;
  std::vector<double> token_times;  // emission time of each generated token
  // Request::capture_final_state: the context after the request (initial tokens, prompt and
  // every generated token but the last, which was never fed), with the logits that gave
  // the last token. Null when not asked for, or when cancelled.
  SnapshotPtr final_state;

  // Time to first token (from submit); -1 without tokens.
  double ttft() const { return first_token_time < 0 ? -1 : first_token_time - submit_time; }
  // Mean time per output token after the first; -1 with fewer than 2 tokens.
  double tpot() const {
    return generated_tokens < 2 ? -1 : (token_times.back() - token_times.front()) / double(generated_tokens - 1);
  }
};

struct Request {
  // Tokens to feed, ids < vocab_size. Non-empty unless initial_state is given; then they
  // continue its context and may be empty (the first token comes from its logits).
  std::vector<int32_t> prompt;
  // Start from this context instead of an empty one (prefix cache, fork, session). Its
  // state dtype and size must be the pool's. Penalties see its tokens as prompt tokens.
  SnapshotPtr initial_state;
  SamplingOptions sampling;     // temperature 0 = greedy; seed makes sampling reproducible
  int64_t max_tokens = 64;      // ≥ 1
  std::vector<int32_t> stop_ids;  // finish (reason kStop) after emitting one of these
  // End-of-sequence id: unset = the model config's eos_token_id (none when < 0);
  // -1 = none. Emitting it finishes with kEos (checked before stop_ids).
  std::optional<int32_t> eos_id;
  // Log-probabilities: -1 = none; k ≥ 0 = the chosen token's and the k best (k ≤ 20).
  int top_logprobs = -1;
  // Snapshots (copied off the slot on the engine thread; costs one slot copy each).
  bool capture_prompt_state = false;  // after the prompt: on_prompt_state
  bool capture_final_state = false;   // at the end: FinishInfo::final_state
  // The engine's state cache (EngineOptions::cache_slots / cache_host_bytes; no effect
  // when both are 0). use_cache: when the request gets its slot, start from the longest
  // cached prefix of initial_state's tokens + prompt if it covers more than initial_state
  // (device tier: a slot-to-slot copy; host tier: a write from host memory); only the
  // rest is prefilled. cache_*_state: keep the prompt's / the final context in the cache
  // (the device tier first; no host copy unless an entry is demoted).
  bool use_cache = false;
  bool cache_prompt_state = false;
  bool cache_final_state = false;

  // Log-probabilities of the prompt's own tokens (OpenAI's echo with logprobs): entry i is
  // prompt[i] under the logits before it, with the top_logprobs best (top_logprobs ≥ 0
  // needed). Entry 0 comes from initial_state's logits; without one nothing predicts it and
  // its logprob is NaN. Prefill then keeps every position's logits (pieces of at most the
  // model's logit rows) and the state cache is not looked up (its hit would skip them).
  // on_prompt_logprobs gets them all at once, before the first token's callbacks.
  bool prompt_logprobs = false;
  std::function<void(RequestId, const std::vector<TokenLogprobs>&)> on_prompt_logprobs;
  // Called after on_token for each token that no stop rule ended: true ends the request
  // there, reason kStop, exactly as if the token were one of stop_ids (final state and
  // state cache included) — a stop that only the caller can see, e.g. a stop string in
  // the decoded text. A request with it never joins a pipelined decode (its end cannot be
  // known ahead).
  std::function<bool(RequestId, int32_t token)> stop_after;

  // Called on the thread running Engine::step(), never under the engine's lock, so
  // they may call submit() and cancel(). on_token gets every generated token in order
  // (a stop/eos token included); on_finish is called exactly once per accepted request.
  std::function<void(RequestId, int32_t token)> on_token;
  // Called just before on_token for the same token when top_logprobs ≥ 0.
  std::function<void(RequestId, const TokenLogprobs&)> on_logprobs;
  // capture_prompt_state: the context after initial_state + prompt, before the first
  // generated token is emitted (so a callback may fork it into more requests at once).
  std::function<void(RequestId, const SnapshotPtr&)> on_prompt_state;
  std::function<void(const FinishInfo&)> on_finish;
};

}  // namespace laplace
