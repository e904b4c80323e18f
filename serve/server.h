// `laplace serve`: an OpenAI-compatible HTTP server over the engine (serve/engine.h),
// with what only a fixed-state model can offer: an exact state cache at any token
// boundary, n > 1 as forks of one prefill, and named sessions (save / restore / fork /
// delete a whole context). See docs/serving.md §"HTTP server".
//
// Threads: cpp-httplib's worker pool parses requests and streams answers; ONE engine
// thread runs Engine::step() whenever there is work. Engine callbacks (engine thread)
// hand tokens to per-request jobs under the job's lock; HTTP threads wait on the job.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "core/status.h"
#include "serve/engine.h"
#include "serve/openai_api.h"
#include "serve/state_cache.h"

namespace laplace {

struct ServerOptions {
  std::string model_dir;     // config.json, model.safetensors, tokenizer.model [, chat_template.json]
  std::string model_name;    // the id clients send as "model"; "" = the directory's name
  std::string host = "127.0.0.1";
  int port = 8000;           // 0 = any free port (port() tells which)
  std::string api_key;       // "" = no key; else "Authorization: Bearer KEY" on every route
  std::string device = "cpu";
  DType dtype = DType::kF32;
  // max_slots (or memory_budget), max_batch_tokens, prefill_chunk, cache_slots (the state
  // cache's device tier; engine.cache_host_bytes is set from cache_bytes)
  EngineOptions engine;
  int64_t max_queue = 64;    // requests waiting for a slot; more get 429 + Retry-After
  int64_t max_request_bytes = 1 << 20;
  int64_t max_prompt_tokens = 32768;
  ApiLimits limits;
  int64_t cache_bytes = int64_t(256) << 20;  // the state cache's host-RAM tier; 0 = none
  std::string session_dir;   // where sessions are saved to disk; "" = memory only
  int64_t max_sessions = 1024;
  int threads = 16;          // HTTP worker threads
  int read_timeout_s = 10;   // a client that sends nothing for this long is dropped
  int write_timeout_s = 10;
};

struct ServerCounters {
  EngineStats engine;
  StateCacheStats cache;
  int64_t http_requests = 0, rejected_429 = 0, client_disconnects = 0, sessions = 0;
  int64_t outstanding = 0;  // engine requests submitted and not finished
};

class Server {
 public:
  explicit Server(ServerOptions o);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // Binds and starts serving at once (/health answers 503 until the model is loaded),
  // then loads the model on a background thread. Errors: io_error (cannot bind).
  Status start();
  // Blocks until the model is loaded; its error if loading failed.
  Status wait_ready();
  // Stops accepting, cancels running requests, joins every thread. Idempotent.
  void stop();
  // Blocks until stop() (from another thread or a signal handler's flag).
  void wait();

  int port() const;
  ServerCounters counters() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace laplace
