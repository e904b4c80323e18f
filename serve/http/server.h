// `laplace serve`: an OpenAI-compatible HTTP server over the engine (serve/engine.h),
// with what only a fixed-state model can offer: an exact state cache at any token
// boundary, n > 1 as forks of one prefill, and named sessions (save / restore / fork /
// delete a whole context). See docs/serving.md §"HTTP server".
//
// Threads: a few HTTP event-loop threads (serve/http/http_server.h) parse requests and write
// answers, thousands of connections each; ONE engine thread runs Engine::step() whenever
// there is work. Engine callbacks (engine thread) hand tokens to per-request jobs under
// the job's lock; after each step the engine thread wakes the connections of the jobs
// that moved. The parts: serve/http/server_impl.h.
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
  // This server's name in a fleet: in /health, /metrics, the X-Laplace-Replica header of
  // every answer, and the session files it saves. "" = HOSTNAME:PORT.
  std::string replica_id;
  std::string host = "127.0.0.1";
  int port = 8000;           // 0 = any free port (port() tells which)
  std::string api_key;       // "" = no key; else "Authorization: Bearer KEY" on every route
  // Host names a request may name besides IP addresses and localhost ("*" = any): what
  // keeps a web page from reaching this server through a DNS name rebound to it.
  std::vector<std::string> allowed_hosts;
  // Web origins (scheme://host[:port]) whose pages may call the API (CORS); "*" = any.
  // Other cross-origin requests are refused (403).
  std::vector<std::string> cors_origins;
  std::string device = "cpu";
  DType dtype = DType::kF32;
  // max_slots (or memory_budget), max_batch_tokens, prefill_chunk, cache_slots (the state
  // cache's device tier; engine.cache_host_bytes is set from cache_bytes)
  EngineOptions engine;
  int64_t max_queue = 64;    // requests waiting for a slot; more get 429 + Retry-After
  int64_t max_request_bytes = 1 << 20;
  int64_t max_prompt_tokens = 32768;  // also caps a prompt's bytes before it is tokenized (docs/serving.md)
  int64_t max_file_queue = 32;         // session saves and restores waiting; more get 429 + Retry-After
  ApiLimits limits;
  int64_t cache_bytes = int64_t(256) << 20;  // the state cache's host-RAM tier; 0 = none
  std::string session_dir;   // where sessions are saved to disk; "" = memory only
  int64_t max_sessions = 1024;        // sessions in memory
  int64_t max_session_bytes = 0;      // host bytes they hold; 0 = no bound
  int64_t max_session_disk_bytes = 0; // bytes of session files; 0 = no bound
  int64_t max_session_files = 0;      // session files; 0 = no bound
  int threads = 4;           // HTTP event-loop threads (not per connection)
  // A request's header must be in within read_timeout_s of the server waiting for it, and
  // its body within read_timeout_s of the header's end: absolute deadlines, which bytes
  // trickled in do not extend. An idle keep-alive connection is closed after it too.
  int read_timeout_s = 10;
  int write_timeout_s = 10;  // a client that reads nothing for this long is dropped
  int64_t max_connections = 0;  // 0 = from RLIMIT_NOFILE (raised to its hard limit)
};

struct ServerCounters {
  EngineStats engine;
  StateCacheStats cache;
  int64_t http_requests = 0, rejected_429 = 0, client_disconnects = 0, sessions = 0;
  int64_t outstanding = 0;  // engine requests admitted and not finished (the admission limit's count)
  int64_t sessions_reserved = 0;  // room reserved for sessions that running requests will save
  int64_t connections = 0;  // open HTTP connections
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
  // Graceful stop (SIGTERM): admits nothing new (503 + Retry-After; /health 503
  // "stopping"), lets running requests finish for up to grace_seconds, then ends each
  // answer still running — a stream with an error event and [DONE], a whole answer with an
  // error object (a 503 when its head has not gone out) — and stops.
  void shutdown(double grace_seconds);
  // While held, the engine runs no step: requests are admitted (or refused) as usual and
  // wait. For tests that need requests to stay in flight, and for maintenance.
  void hold_engine(bool held);
  // While held: runs `steps` engine steps, then returns (the engine stays held). For tests
  // that need a request at a given point: queued, part-way through its prefill, at its first
  // token, part-way through its answer.
  void step_engine(int steps);
  // Blocks until stop() (from another thread or a signal handler's flag).
  void wait();

  int port() const;
  ServerCounters counters() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace laplace
