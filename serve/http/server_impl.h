// The inside of `laplace serve` (serve/http/server.h), shared by its parts:
//   server.cpp    lifetime: start, model loading, the engine thread, stop and graceful stop;
//   routes.cpp    the routes: authentication, admission, health, models, metrics, sessions;
//   jobs.cpp      completions: a request's engine work (n choices), its answer streamed or
//                 whole, and what the engine's callbacks feed it;
//   serve/sessions.* the session store and the session file (in laplace_serve, below);
//   static_files.cpp the web page (serve/http/ui/, compiled into the binary);
//   http_server.* the transport (serve/http/http_server.h).
//
// Threads: the HTTP event loops run the routes and the producers of answers; ONE engine
// thread runs Engine::step() and the engine's callbacks, which fill jobs under their lock
// and mark them dirty; after each step the engine thread wakes the dirty jobs' connections
// (one task per event loop). File work (session save / restore) runs on a small pool of
// its own, never on an event loop.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/thread_annotations.h"
#include "model/model.h"
#include "serve/chat_template.h"
#include "serve/engine.h"
#include "serve/http/http_server.h"
#include "serve/http/server.h"
#include "serve/metrics.h"
#include "serve/openai_api.h"
#include "serve/sessions.h"
#include "serve/text_stream.h"
#include "serve/work_queue.h"
#include "text/tokenizer.h"

namespace laplace {

// JSON out: invalid UTF-8 (a model may emit any byte) becomes U+FFFD instead of throwing.
std::string dump_json(const nlohmann::json& j);
http::Response json_response(int status, const nlohmann::json& j);
http::Response error_response(const ApiError& e);
ApiError api_error(int status, const std::string& msg, const std::string& type, const std::string& code = "",
                   const std::string& param = "");
// A 429 (or 503) that tells when to come back.
http::Response busy_response(int status, const std::string& msg, const std::string& code);
// Absolute paths in a message become their last component: errors do not tell a client
// where the server keeps its files.
std::string redact_paths(const std::string& msg);
// A directory whose paths redact_paths cuts to what lies below it (the model's, the sessions').
void add_redacted_root(const std::string& dir);

// One generated sequence of a job (one of n choices of one of its prompts).
struct Choice {
  RequestId id = 0;
  size_t part = 0;  // which prompt of the job (Job::parts)
  bool submitted = false;
  std::unique_ptr<TextStream> text;
  std::vector<int32_t> tokens;          // every generated token, in order
  std::vector<TokenLogprobs> logprobs;  // one per token of `tokens` (when asked)
  std::string pending;                  // text not yet streamed
  size_t lp_sent = 0;                   // logprobs already streamed
  int64_t lp_offset = 0;                // characters started before the next logprobs entry
  bool echo_sent = false;               // streaming: the echoed prompt went out
  bool text_done = false;               // a stop string completed (the engine is told to stop)
  bool stop_now = false;                // ... and, through Request::stop_after, at this token
  bool finished = false;                // the engine's on_finish arrived
  bool end_sent = false;                // streaming: the chunk with finish_reason went out
  bool first = true;                    // streaming: no chunk sent yet
  std::string finish_reason;
  FinishInfo info;
};

// One prompt of a job and its n choices (choices [part × n, part × n + n) of the job): the
// first is prefilled, the others fork its prompt state. A request has one part per prompt.
// Fields set before the job is submitted are read freely after; the others under Job::mu.
struct Part {
  std::vector<int32_t> prompt;  // the whole context it continues (session + own prompt)
  std::vector<int32_t> own;     // its own prompt tokens (what echo returns)
  std::string echo_text;        // echo: the prompt's text
  int64_t cached_tokens = 0;    // of `prompt`, served from a snapshot (under mu)
  bool forked = false;          // its choices 1..n-1 submitted or given up (under mu)
  SnapshotPtr prompt_state;     // after the prompt: forks, sessions (under mu)
  // echo with logprobs: the prompt's tokens' log-probabilities (null first entry when
  // nothing predicts it) (under mu).
  std::vector<TokenLogprobs> prompt_lps;
};

// One HTTP completion request: its prompts' n choices each, streamed or not.
struct Job {
  CompletionParams p;
  std::string api_id;
  int64_t created = 0;
  std::vector<Part> parts;      // one per prompt, in order
  int32_t eos = -1;
  std::vector<std::string> stops;
  std::mutex mu;
  std::vector<Choice> choices GUARDED_BY(mu);
  int64_t finished GUARDED_BY(mu) = 0;
  bool abandoned GUARDED_BY(mu) = false;    // the client went away
  bool discard_first = false;   // echo with max_tokens 0: the one token generated is not shown
  uint64_t session_ticket = 0;  // room reserved for save_session
  int64_t session_base = -1;    // save_session of the session it continues: that one's saved version
  // The answer.
  http::ExchangePtr ex;
  bool head_sent GUARDED_BY(mu) = false;  // non-streamed: the head went out (with whitespace)
  bool cut GUARDED_BY(mu) = false;        // graceful stop: the grace ran out
  bool closed GUARDED_BY(mu) = false;     // the producer said done (or the client left)
  uint64_t serial = 0;          // in the registry of live jobs
  std::atomic<bool> dirty{false};  // engine thread: a wake is due after this step
  bool all_finished() const REQUIRES(mu) { return finished == static_cast<int64_t>(choices.size()); }
};

struct Server::Impl {
  ServerOptions opt;
  std::string name;
  std::unique_ptr<HttpServer> http;

  // Loading.
  std::atomic<bool> ready{false};
  std::atomic<bool> load_failed{false};
  Status load_status;
  std::mutex load_mu;  // load_status is written under it, then published by ready / load_failed
  std::condition_variable load_cv;
  std::thread loader, engine_thread;

  // The model (owned here; the engine refers to it).
  std::unique_ptr<Backend> backend;
  Model model;
  Tokenizer tok;
  ChatTemplate chat_tmpl;
  std::string config_fingerprint;
  // XXH3-128 of config.json, model.safetensors and tokenizer.model: replicas of one fleet
  // must serve the same model (the balancer's health check compares it), and a session
  // saved by another model is refused. Set before `ready`.
  std::string model_hash;
  std::string replica;  // opt.replica_id, or HOSTNAME:PORT (set in start(), before serving)
  std::unique_ptr<Engine> engine;

  // Engine thread wake-up.
  std::mutex wake_mu;
  std::condition_variable wake_cv;
  bool wake GUARDED_BY(wake_mu) = false;
  bool held GUARDED_BY(wake_mu) = false;  // hold_engine(): no step runs
  int steps_left GUARDED_BY(wake_mu) = 0;  // step_engine(): steps still to run while held
  std::condition_variable step_cv;        // a counted step ran
  std::atomic<bool> stopping{false};
  std::atomic<bool> draining{false};  // graceful stop: no new work is admitted
  bool stopped GUARDED_BY(stop_mu) = false;
  std::mutex stop_mu;
  std::condition_variable stop_cv;
  // Engine thread only: jobs with news since the last wake.
  std::vector<std::shared_ptr<Job>> dirty_jobs;

  // Live jobs (admitted, answer not finished), for the graceful stop.
  std::mutex jobs_mu;
  std::condition_variable jobs_cv;
  std::map<uint64_t, std::weak_ptr<Job>> live_jobs GUARDED_BY(jobs_mu);
  uint64_t next_serial GUARDED_BY(jobs_mu) = 1;

  SessionStore sessions;
  // Assistant message text → the tokens that produced it, so a chat's next turn feeds
  // the model exactly its own tokens (and the cached state after them matches).
  std::mutex memo_mu;
  std::map<std::string, std::vector<int32_t>> memo GUARDED_BY(memo_mu);
  std::deque<std::string> memo_order GUARDED_BY(memo_mu);

  // Work off the event loops. Session saves and restores: a bounded queue (429 when full),
  // so a burst of saves neither grows without end nor makes an unrelated restore wait long.
  // Tokenizing admitted requests: bounded by admission itself (each waiting task holds its
  // admission units), so it has no bound of its own.
  std::unique_ptr<WorkQueue> files, prep;
  // Longest text one token stands for (bytes): a prompt longer than max_prompt_tokens times
  // this has more tokens than the cap, whatever they are, and is refused before tokenizing.
  int64_t max_token_bytes = 1;

  std::atomic<int64_t> outstanding{0}, http_requests{0}, rejected_429{0}, disconnects{0};
  Histogram ttft{"laplace_time_to_first_token_seconds", "Time from request to its first token.", latency_buckets()};
  Histogram itl{"laplace_inter_token_latency_seconds", "Time between consecutive tokens of a request.",
                latency_buckets()};
  Histogram e2e{"laplace_e2e_request_latency_seconds", "Time from request to its last token.", latency_buckets()};
  Histogram queue_time{"laplace_queue_time_seconds", "Time a request waited for a state slot.", latency_buckets()};
  std::atomic<int64_t> prompt_tokens_total{0}, generation_tokens_total{0}, requests_ok{0}, requests_error{0};

  explicit Impl(ServerOptions o);

  // server.cpp
  Status load();
  void engine_loop();
  void kick();
  void flush_dirty();  // engine thread, after a step
  // Queues file work; false (answer 429) when its queue is full.
  bool run_file_work(std::function<void()> f);
  // A prompt over the byte cap (max_prompt_tokens × max_token_bytes), found without tokenizing.
  std::optional<ApiError> check_prompt_bytes(const CompletionParams& p) const;
  SessionFormat session_format() const;
  // Admission: one more engine request (or n), under slots + max_queue. False = full.
  bool admit(int64_t n);
  int64_t admission_limit() const { return engine->num_slots() + opt.max_queue; }

  // routes.cpp
  std::optional<http::Response> check_head(const http::Request& req);
  bool host_allowed(const http::Request& req) const;
  // The request's Origin when it is another origin than the page's own ("" = none or same).
  std::string foreign_origin(const http::Request& req) const;
  bool cors_allowed(const std::string& origin) const;
  std::vector<http::Header> cors_headers(const http::Request& req) const;
  void route(http::Request&& req, http::ExchangePtr ex);
  std::string metrics_text();
  nlohmann::json session_json(const std::string& n, const Session& s);
  void handle_session_create(const http::Request& req, const http::ExchangePtr& ex);
  void start_session_create(const std::shared_ptr<Job>& job, const http::ExchangePtr& ex, const std::string& n);
  void file_queue_full(const http::ExchangePtr& ex);
  // A session operation's error: 404, 409 (conflict), 429 / 507 (caps; a 429 is counted), 400,
  // 500; as an answer (a 429 with Retry-After).
  ApiError session_api_error(const Status& st);
  http::Response session_error(const Status& st);
  void handle_session_op(const http::Request& req, const http::ExchangePtr& ex, const std::string& n,
                         const std::string& op);

  // jobs.cpp
  bool cache_on(const Job& j) const { return engine->cache_enabled() && j.p.cache; }
  void memo_put(const std::string& text, const std::vector<int32_t>& ids);
  std::optional<ApiError> tokenize(Job& job);
  std::optional<ApiError> tokenize_part(const Job& job, const PromptInput* in, Part* part);
  Request make_request(const std::shared_ptr<Job>& job, size_t i);
  void on_token(const std::shared_ptr<Job>& j, size_t i, RequestId id, int32_t t);
  void on_finish(const std::shared_ptr<Job>& j, size_t i, const FinishInfo& f);
  void on_prompt_state(const std::shared_ptr<Job>& j, size_t part, const SnapshotPtr& st);
  void give_up_forks(Job& j, size_t part) REQUIRES(j.mu);
  bool kept_session(const Job& j, const Part& part, const Choice& c, const FinishInfo& f, Session* out);
  Status submit_part(const std::shared_ptr<Job>& job, size_t part);
  void mark_dirty(const std::shared_ptr<Job>& j);
  void cancel_job(const std::shared_ptr<Job>& j);
  void register_job(const std::shared_ptr<Job>& j);
  void unregister_job(Job& j);
  nlohmann::json logprobs_json(const Job& j, Choice& c, const std::vector<TokenLogprobs>& lps, size_t from, size_t to,
                               const std::vector<TokenLogprobs>* prompt_lps);
  nlohmann::json usage_json(const Job& j);
  nlohmann::json final_json(Job& j);
  nlohmann::json chunk_json(Job& j, nlohmann::json choices);
  void drain_stream(Job& j, std::string* out);
  void produce(const std::shared_ptr<Job>& job, bool tick, http::Chunk* out);
  void handle_completion(const http::Request& req, const http::ExchangePtr& ex, bool chat);
  void start_completion(const std::shared_ptr<Job>& job, const http::ExchangePtr& ex, int64_t units);
};

}  // namespace laplace
