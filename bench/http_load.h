// A load generator for `laplace serve` (`laplace bench http`): N streaming completions at
// once, each on its own connection, driven by one thread over epoll, so that the client is
// never what limits the server.
//
// Every stream sends a token-id prompt of prompt_len ids (distinct per stream, so no cache
// can share work between them), asks for exactly max_tokens tokens (ignore_eos, greedy) and
// usage in the last event. Requests are HTTP/1.0: the server answers an HTTP/1.0 client
// without chunked framing, so the body is the event stream itself, up to the close.
//
// The decode rate is what `bench decode` measures, seen through HTTP: for each completed
// stream, (max_tokens − 1) tokens over the time from its first to its last content event;
// the engine steps all admitted streams together, so the aggregate is the median stream's
// rate times the streams. `overlap` says how much of the run that was: the window from the
// last stream's first token to the first stream's last token, over the median stream's
// decode time (near 1 when every stream decoded at the same time). A stream whose text only
// arrived at its end (its tokens decoded to nothing until then, e.g. control tokens, for
// which the server sends no event) is counted as `silent` and has no rate or TTFT.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/status.h"

namespace laplace {

struct HttpLoadOptions {
  std::string host = "127.0.0.1";
  int port = 8080;
  std::string api_key;  // sent as "Authorization: Bearer KEY" when set
  int streams = 64;
  int64_t prompt_len = 16;
  int64_t max_tokens = 128;
  int64_t vocab = 256;   // prompt ids are drawn from [0, vocab)
  uint64_t seed = 1;
  double timeout_s = 600;  // the whole run
};

struct HttpLoadResult {
  int streams = 0;
  int ok = 0;          // 200 and a [DONE] with usage.completion_tokens == max_tokens
  int rejected = 0;    // 429
  int failed = 0;      // anything else (another status, a short or cut stream, no answer)
  int silent = 0;      // ok streams whose events all came at the end (no rate, no TTFT)
  std::string first_failure;  // what the first failed stream saw
  int64_t tokens = 0;         // Σ usage.completion_tokens of the ok streams
  double wall_s = 0;          // first connect to last close
  double ttft_p50_ms = 0, ttft_p99_ms = 0;  // request sent → first content event, ok streams with a rate
  double decode_tok_s = 0;    // the median stream's rate × ok streams (see above)
  double stream_tok_s_p50 = 0;  // the median stream's own rate
  double overlap = 0;
};

// Runs the load against host:port; fails only when no connection could be made at all or
// the options are invalid (streams that fail are counted in the result).
Status run_http_load(const HttpLoadOptions& o, HttpLoadResult* r);

}  // namespace laplace
