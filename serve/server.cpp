#include "serve/server.h"

#include <httplib.h>
#include <sys/socket.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <filesystem>
#include <map>
#include <mutex>
#include <random>
#include <thread>

#include "core/file_util.h"
#include "core/safetensors.h"
#include "model/config.h"
#include "model/model.h"
#include "serve/chat_template.h"
#include "serve/metrics.h"
#include "serve/text_stream.h"
#include "text/tokenizer.h"

namespace laplace {

using nlohmann::json;
namespace fs = std::filesystem;

namespace {

// JSON out: invalid UTF-8 (a model may emit any byte) becomes U+FFFD instead of throwing.
std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

void send_json(httplib::Response& res, int status, const json& j) {
  res.status = status;
  res.set_content(dump(j), "application/json");
}

void send_error(httplib::Response& res, const ApiError& e) { send_json(res, e.http_status, e.to_json()); }

ApiError api_error(int status, const std::string& msg, const std::string& type, const std::string& code = "",
                   const std::string& param = "") {
  return ApiError{status, msg, type, param, code};
}

const char* finish_reason_api(FinishReason r) {
  switch (r) {
    case FinishReason::kLength: return "length";
    case FinishReason::kStop:
    case FinishReason::kEos: return "stop";
    case FinishReason::kCancelled: return "cancelled";
  }
  return "stop";
}

int64_t unix_time() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::string random_id(const char* prefix) {
  static std::atomic<uint64_t> counter{0};
  static const uint64_t base = std::random_device{}();
  char buf[64];
  std::snprintf(buf, sizeof buf, "%s-%016llx%04llx", prefix, (unsigned long long)base,
                (unsigned long long)(counter.fetch_add(1) & 0xffff));
  return buf;
}

// One generated sequence of a job (one of n choices).
struct Choice {
  RequestId id = 0;
  bool submitted = false;
  std::unique_ptr<TextStream> text;
  std::vector<int32_t> tokens;          // every generated token, in order
  std::vector<TokenLogprobs> logprobs;  // one per token of `tokens` (when asked)
  std::string pending;                  // text not yet streamed
  size_t lp_sent = 0;                   // logprobs already streamed
  bool text_done = false;               // a stop string completed (the engine is told to cancel)
  bool finished = false;                // the engine's on_finish arrived
  bool end_sent = false;                // streaming: the chunk with finish_reason went out
  std::string finish_reason;
  FinishInfo info;
};

// One HTTP completion request: n choices, streamed or not.
struct Job {
  CompletionParams p;
  std::string api_id;
  int64_t created = 0;
  std::vector<int32_t> prompt;  // the whole context the request continues (session + prompt)
  int64_t cached_tokens = 0;    // of `prompt`, served from a snapshot
  int32_t eos = -1;
  std::vector<std::string> stops;
  std::mutex mu;
  std::condition_variable cv;
  std::vector<Choice> choices;
  int64_t finished = 0;
  bool forked = false;          // choices 1..n-1 submitted (or given up)
  bool abandoned = false;       // the client went away
  SnapshotPtr prompt_state;     // after the prompt (cache, forks, sessions)
  bool all_finished() const { return finished == static_cast<int64_t>(choices.size()); }
};

struct Session {
  std::vector<int32_t> context;  // every token of the session, in order
  SnapshotPtr snap;              // the state after a prefix of `context`
};

}  // namespace

struct Server::Impl {
  ServerOptions opt;
  std::string name;
  httplib::Server http;
  int port = 0;
  int listen_fd = -1;  // the listening socket, seen through http's socket-options hook

  // Loading.
  std::atomic<bool> ready{false};
  std::atomic<bool> load_failed{false};
  Status load_status;
  std::mutex load_mu;
  std::condition_variable load_cv;
  std::thread loader, listener, engine_thread;

  // The model (owned here; the engine refers to it).
  std::unique_ptr<Backend> backend;
  Model model;
  Tokenizer tok;
  ChatTemplate chat_tmpl;
  std::string config_fingerprint;
  std::unique_ptr<Engine> engine;

  // Engine thread wake-up.
  std::mutex wake_mu;
  std::condition_variable wake_cv;
  bool wake = false;
  std::atomic<bool> stopping{false};
  bool stopped = false;
  std::mutex stop_mu;
  std::condition_variable stop_cv;

  std::mutex sessions_mu;
  std::map<std::string, Session> sessions;
  // Assistant message text → the tokens that produced it, so a chat's next turn feeds
  // the model exactly its own tokens (and the cached state after them matches).
  std::mutex memo_mu;
  std::map<std::string, std::vector<int32_t>> memo;
  std::deque<std::string> memo_order;

  std::atomic<int64_t> outstanding{0}, http_requests{0}, rejected_429{0}, disconnects{0};
  Histogram ttft{"laplace_time_to_first_token_seconds", "Time from request to its first token.", latency_buckets()};
  Histogram itl{"laplace_inter_token_latency_seconds", "Time between consecutive tokens of a request.",
                latency_buckets()};
  Histogram e2e{"laplace_e2e_request_latency_seconds", "Time from request to its last token.", latency_buckets()};
  Histogram queue_time{"laplace_queue_time_seconds", "Time a request waited for a state slot.", latency_buckets()};
  std::atomic<int64_t> prompt_tokens_total{0}, generation_tokens_total{0}, requests_ok{0}, requests_error{0};

  explicit Impl(ServerOptions o) : opt(std::move(o)) { opt.engine.cache_host_bytes = opt.cache_bytes; }

  // The engine's state cache (either tier) is on, and this job may use it.
  bool cache_on(const Job& j) const { return engine->cache_enabled() && j.p.cache; }

  // ---- loading ------------------------------------------------------------------------
  Status load() {
    const fs::path dir(opt.model_dir);
    if (!fs::is_directory(dir)) return Status::not_found("model directory " + opt.model_dir + " does not exist");
    Config cfg;
    LAPLACE_RETURN_IF_ERROR(config_load((dir / "config.json").string(), &cfg));
    config_fingerprint = std::to_string(std::hash<std::string>{}(cfg.to_json()));
    if (!fs::exists(dir / "tokenizer.model"))
      return Status::not_found("the model directory has no tokenizer.model (the server speaks text)");
    LAPLACE_RETURN_IF_ERROR(Tokenizer::load((dir / "tokenizer.model").string(), &tok));
    if (tok.vocab_size() > cfg.vocab_size)
      return Status::invalid_argument("tokenizer has " + std::to_string(tok.vocab_size()) +
                                      " pieces but the model only " + std::to_string(cfg.vocab_size));
    chat_tmpl = ChatTemplate::default_template();
    if (fs::exists(dir / "chat_template.json")) {
      std::string text;
      LAPLACE_RETURN_IF_ERROR(read_file((dir / "chat_template.json").string(), &text));
      LAPLACE_RETURN_IF_ERROR(ChatTemplate::parse(text, &chat_tmpl).with_context("chat_template.json"));
    }
    LAPLACE_RETURN_IF_ERROR(make_backend(opt.device, &backend));
    LAPLACE_RETURN_IF_ERROR(model.create(cfg, *backend, opt.dtype));
    if (!fs::exists(dir / "model.safetensors")) return Status::not_found("the model directory has no model.safetensors");
    LAPLACE_RETURN_IF_ERROR(model.load((dir / "model.safetensors").string()));
    LAPLACE_RETURN_IF_ERROR(Engine::create(model, opt.engine, &engine));
    std::string summary = engine->summary() + "\n";
    for (size_t at = 0, nl; (nl = summary.find('\n', at)) != std::string::npos; at = nl + 1)
      std::fprintf(stderr, "laplace serve: %s\n", summary.substr(at, nl - at).c_str());
    return Status::ok();
  }

  void engine_loop() {
    while (true) {
      {
        std::unique_lock<std::mutex> lk(wake_mu);
        wake_cv.wait(lk, [&] { return stopping.load() || wake || !engine->idle(); });
        wake = false;
        if (stopping.load()) break;
      }
      engine->step();
    }
  }

  void kick() {
    {
      std::lock_guard<std::mutex> lk(wake_mu);
      wake = true;
    }
    wake_cv.notify_one();
  }

  // ---- tokenization -------------------------------------------------------------------
  Status encode(const std::string& text, std::vector<int32_t>* ids) { return tok.encode(text, ids); }

  void memo_put(const std::string& text, const std::vector<int32_t>& ids) {
    std::lock_guard<std::mutex> lk(memo_mu);
    if (memo.emplace(text, ids).second) memo_order.push_back(text);
    while (memo_order.size() > 4096) {
      memo.erase(memo_order.front());
      memo_order.pop_front();
    }
  }

  std::optional<ApiError> tokenize(Job& job) {
    const CompletionParams& p = job.p;
    std::vector<int32_t> ids;
    if (p.chat) {
      std::vector<ChatTemplate::Piece> pieces;
      Status st = chat_tmpl.render(p.messages, &pieces);
      if (!st.is_ok()) return ApiError{400, st.message(), "invalid_request_error", "messages", ""};
      for (const auto& piece : pieces) {
        if (piece.assistant_content) {
          std::lock_guard<std::mutex> lk(memo_mu);
          auto it = memo.find(piece.text);
          if (it != memo.end()) {
            ids.insert(ids.end(), it->second.begin(), it->second.end());
            continue;
          }
        }
        std::vector<int32_t> part;
        Status e = encode(piece.text, &part);
        if (!e.is_ok()) return ApiError{400, e.message(), "invalid_request_error", "messages", ""};
        ids.insert(ids.end(), part.begin(), part.end());
      }
    } else if (p.prompt_is_ids) {
      for (int32_t t : p.prompt_ids)
        if (t >= model.config().vocab_size)
          return ApiError{400, "prompt token id " + std::to_string(t) + " is outside the vocabulary (" +
                                   std::to_string(model.config().vocab_size) + ")",
                          "invalid_request_error", "prompt", ""};
      ids = p.prompt_ids;
    } else {
      Status e = encode(p.prompt_text, &ids);
      if (!e.is_ok()) return ApiError{400, e.message(), "invalid_request_error", "prompt", ""};
    }
    job.prompt.clear();
    if (!p.session.empty()) {
      std::lock_guard<std::mutex> lk(sessions_mu);
      auto it = sessions.find(p.session);
      if (it == sessions.end())
        return ApiError{404, "session '" + p.session + "' does not exist", "invalid_request_error", "session",
                        "session_not_found"};
      job.prompt = it->second.context;
      job.prompt_state = it->second.snap;  // a candidate start
    }
    job.prompt.insert(job.prompt.end(), ids.begin(), ids.end());
    if (job.prompt.empty()) {
      if (tok.bos_id() >= 0) {
        job.prompt.push_back(tok.bos_id());  // an empty prompt starts a document
      } else {
        return ApiError{400, "the prompt is empty", "invalid_request_error", p.chat ? "messages" : "prompt", ""};
      }
    }
    if (static_cast<int64_t>(job.prompt.size()) > opt.max_prompt_tokens)
      return ApiError{400,
                      "the prompt has " + std::to_string(job.prompt.size()) + " tokens; this server accepts at most " +
                          std::to_string(opt.max_prompt_tokens),
                      "invalid_request_error", p.chat ? "messages" : "prompt", "context_length_exceeded"};
    return std::nullopt;
  }

  // ---- engine requests ------------------------------------------------------------------
  // r continues `start` (a snapshot of a prefix of `tokens`, or null) and feeds the rest.
  // Returns the number of tokens the snapshot covers.
  static int64_t start_from(const SnapshotPtr& start, const std::vector<int32_t>& tokens, Request* r) {
    const size_t covered = start ? start->tokens.size() : 0;
    r->initial_state = start;
    r->prompt.assign(tokens.begin() + static_cast<ptrdiff_t>(covered), tokens.end());
    return static_cast<int64_t>(covered);
  }

  Request make_request(const std::shared_ptr<Job>& job, size_t i) {
    const CompletionParams& p = job->p;
    Request r;
    r.sampling = p.sampling;
    r.sampling.seed = p.sampling.seed + i;  // choices differ; choice 0 keeps the given seed
    r.max_tokens = p.max_tokens;
    r.top_logprobs = p.logprobs;
    r.eos_id = job->eos;
    // The cache keeps the final context itself (device tier first); a host snapshot is
    // made only when a session needs one.
    r.use_cache = cache_on(*job);
    r.cache_final_state = cache_on(*job);
    r.capture_final_state = !p.save_session.empty();
    std::weak_ptr<Job> wj = job;
    r.on_logprobs = [wj, i](RequestId, const TokenLogprobs& lp) {
      if (auto j = wj.lock()) {
        std::lock_guard<std::mutex> lk(j->mu);
        j->choices[i].logprobs.push_back(lp);
      }
    };
    r.on_token = [this, wj, i](RequestId id, int32_t t) { on_token(wj.lock(), i, id, t); };
    r.on_finish = [this, wj, i](const FinishInfo& f) { on_finish(wj.lock(), i, f); };
    return r;
  }

  void on_token(const std::shared_ptr<Job>& j, size_t i, RequestId id, int32_t t) {
    if (!j) return;
    bool cancel = false;
    {
      std::lock_guard<std::mutex> lk(j->mu);
      Choice& c = j->choices[i];
      if (c.text_done) return;
      c.tokens.push_back(t);
      if (t != j->eos) c.pending += c.text->push(t);
      if (c.text->stopped()) {
        c.text_done = true;
        c.finish_reason = "stop";
        cancel = true;  // the rest of this sequence is not wanted
      }
    }
    j->cv.notify_all();
    if (cancel) engine->cancel(id);
  }

  void on_finish(const std::shared_ptr<Job>& j, size_t i, const FinishInfo& f) {
    outstanding.fetch_sub(1);
    if (f.first_token_time >= 0) {
      ttft.observe(f.ttft());
      e2e.observe(f.finish_time - f.submit_time);
      for (size_t k = 1; k < f.token_times.size(); ++k) itl.observe(f.token_times[k] - f.token_times[k - 1]);
    }
    if (f.admit_time >= 0) queue_time.observe(f.admit_time - f.submit_time);
    generation_tokens_total.fetch_add(f.generated_tokens);
    if (!j) return;
    {
      std::lock_guard<std::mutex> lk(j->mu);
      Choice& c = j->choices[i];
      c.info = f;
      if (i == 0) j->cached_tokens = f.cached_tokens;
      c.finished = true;
      ++j->finished;
      if (!c.text_done) {
        c.text_done = true;
        c.finish_reason = finish_reason_api(f.reason);
        if (f.reason != FinishReason::kCancelled) c.pending += c.text->finish();
      }
      // Choice 0 ended before its prompt state could seed the others: they never start.
      if (i == 0 && !j->forked) {
        j->forked = true;
        for (size_t k = 1; k < j->choices.size(); ++k) {
          j->choices[k].finished = j->choices[k].text_done = true;
          j->choices[k].finish_reason = "cancelled";
          ++j->finished;
          outstanding.fetch_sub(1);  // counted at submit, never started
        }
      }
      if (j->p.chat && c.finish_reason != "cancelled") {
        // Remember which tokens produced this reply (without a trailing end-of-sequence).
        std::vector<int32_t> ids = c.text->tokens();
        if (!ids.empty() && ids.back() == j->eos) ids.pop_back();
        std::string text;
        if (tok.decode(ids, &text).is_ok() && text == c.text->sent()) memo_put(text, ids);
      }
      if (!j->p.save_session.empty() && i == 0 && f.reason != FinishReason::kCancelled) {
        Session s;
        s.context = j->prompt;
        s.context.insert(s.context.end(), c.tokens.begin(), c.tokens.end());
        s.snap = f.final_state ? f.final_state : j->prompt_state;
        if (s.snap) {
          std::lock_guard<std::mutex> sk(sessions_mu);
          if (static_cast<int64_t>(sessions.size()) < opt.max_sessions || sessions.count(j->p.save_session))
            sessions[j->p.save_session] = std::move(s);
        }
      }
    }
    j->cv.notify_all();
  }

  // The prompt is in the state (the engine has cached it): start choices 1..n-1 from it.
  void on_prompt_state(const std::shared_ptr<Job>& j, const SnapshotPtr& st) {
    if (!j) return;
    std::lock_guard<std::mutex> lk(j->mu);
    j->prompt_state = st;
    if (j->forked) return;
    j->forked = true;
    for (size_t k = 1; k < j->choices.size(); ++k) {
      Choice& c = j->choices[k];
      if (j->abandoned) {
        c.finished = c.text_done = true;
        c.finish_reason = "cancelled";
        ++j->finished;
        outstanding.fetch_sub(1);  // counted when the job was admitted
        continue;
      }
      Request r = make_request(j, k);
      r.initial_state = st;  // a fork: no prefill of its own
      Status s = engine->submit(std::move(r), &c.id);
      if (!s.is_ok()) {
        outstanding.fetch_sub(1);
        c.finished = c.text_done = true;
        c.finish_reason = "cancelled";
        ++j->finished;
      } else {
        c.submitted = true;
      }
    }
  }

  void cancel_job(const std::shared_ptr<Job>& j) {
    std::vector<RequestId> ids;
    {
      std::lock_guard<std::mutex> lk(j->mu);
      j->abandoned = true;
      for (auto& c : j->choices)
        if (c.submitted && !c.finished) ids.push_back(c.id);
    }
    for (RequestId id : ids) engine->cancel(id);
    kick();
  }

  // ---- responses -----------------------------------------------------------------------
  json logprobs_json(const Job& j, const std::vector<TokenLogprobs>& lps, size_t from, size_t to) {
    if (j.p.chat) {
      json content = json::array();
      for (size_t k = from; k < to; ++k) {
        const TokenLogprobs& lp = lps[k];
        auto entry = [&](int32_t t, float v) {
          const std::string s = token_text(tok, t);
          json bytes = json::array();
          for (unsigned char ch : s) bytes.push_back(ch);
          return json{{"token", s}, {"logprob", v}, {"bytes", bytes}};
        };
        json e = entry(lp.token, lp.logprob);
        json top = json::array();
        for (const auto& [t, v] : lp.top) top.push_back(entry(t, v));
        e["top_logprobs"] = top;
        content.push_back(e);
      }
      return json{{"content", content}};
    }
    json tokens = json::array(), token_lps = json::array(), tops = json::array(), offsets = json::array();
    for (size_t k = from; k < to; ++k) {
      const TokenLogprobs& lp = lps[k];
      tokens.push_back(token_text(tok, lp.token));
      token_lps.push_back(lp.logprob);
      json top = json::object();
      for (const auto& [t, v] : lp.top) top[token_text(tok, t)] = v;
      tops.push_back(top);
      offsets.push_back(0);
    }
    return json{{"tokens", tokens}, {"token_logprobs", token_lps}, {"top_logprobs", tops}, {"text_offset", offsets}};
  }

  json usage_json(const Job& j) {
    int64_t gen = 0;
    for (const auto& c : j.choices) gen += static_cast<int64_t>(c.tokens.size());
    const int64_t prompt = static_cast<int64_t>(j.prompt.size());
    return json{{"prompt_tokens", prompt},
                {"completion_tokens", gen},
                {"total_tokens", prompt + gen},
                {"prompt_tokens_details", {{"cached_tokens", j.cached_tokens}}}};
  }

  json final_json(Job& j) {
    json choices = json::array();
    for (size_t i = 0; i < j.choices.size(); ++i) {
      Choice& c = j.choices[i];
      json ch = {{"index", i}, {"finish_reason", c.finish_reason == "cancelled" ? "stop" : c.finish_reason}};
      const size_t nlp = std::min(c.logprobs.size(), c.tokens.size());
      if (j.p.chat) {
        ch["message"] = {{"role", "assistant"}, {"content", c.text->sent()}};
        ch["logprobs"] = j.p.logprobs >= 0 ? logprobs_json(j, c.logprobs, 0, nlp) : json(nullptr);
      } else {
        ch["text"] = c.text->sent();
        ch["logprobs"] = j.p.logprobs >= 0 ? logprobs_json(j, c.logprobs, 0, nlp) : json(nullptr);
      }
      choices.push_back(ch);
    }
    return json{{"id", j.api_id},
                {"object", j.p.chat ? "chat.completion" : "text_completion"},
                {"created", j.created},
                {"model", name},
                {"system_fingerprint", "laplace-" + config_fingerprint},
                {"choices", choices},
                {"usage", usage_json(j)}};
  }

  json chunk_json(Job& j, json choices) {
    return json{{"id", j.api_id},
                {"object", j.p.chat ? "chat.completion.chunk" : "text_completion"},
                {"created", j.created},
                {"model", name},
                {"system_fingerprint", "laplace-" + config_fingerprint},
                {"choices", std::move(choices)}};
  }

  // Stream chunks for whatever the choices produced since the last call (job locked).
  void drain_stream(Job& j, std::vector<bool>& first, std::string* out) {
    for (size_t i = 0; i < j.choices.size(); ++i) {
      Choice& c = j.choices[i];
      const size_t nlp = std::min(c.logprobs.size(), c.tokens.size());
      const bool has_lp = j.p.logprobs >= 0 && nlp > c.lp_sent;
      const bool end = c.text_done && c.finished && !c.end_sent;
      if (c.pending.empty() && !has_lp && !end) continue;
      json ch = {{"index", i}};
      if (j.p.chat) {
        json delta = json::object();
        if (first[i]) delta["role"] = "assistant";
        if (!c.pending.empty() || first[i]) delta["content"] = c.pending;
        ch["delta"] = delta;
      } else {
        ch["text"] = c.pending;
      }
      ch["logprobs"] = has_lp ? logprobs_json(j, c.logprobs, c.lp_sent, nlp) : json(nullptr);
      c.lp_sent = nlp;
      first[i] = false;
      ch["finish_reason"] = end ? json(c.finish_reason == "cancelled" ? "stop" : c.finish_reason) : json(nullptr);
      *out += "data: " + dump(chunk_json(j, json::array({ch}))) + "\n\n";
      c.pending.clear();
      if (end) c.end_sent = true;
    }
  }

  void handle_completion(const httplib::Request& req, httplib::Response& res, bool chat) {
    json body = json::parse(req.body, nullptr, /*allow_exceptions=*/false);
    if (body.is_discarded())
      return send_error(res, api_error(400, "the request body is not valid JSON (or not valid UTF-8)",
                                       "invalid_request_error"));
    auto job = std::make_shared<Job>();
    if (auto e = parse_completion_params(body, chat, opt.limits, &job->p)) return send_error(res, *e);
    if (!job->p.model.empty() && job->p.model != name)
      return send_error(res, api_error(404, "The model '" + job->p.model + "' does not exist (this server serves '" +
                                                name + "')",
                                       "invalid_request_error", "model_not_found", "model"));
    job->eos = tok.eos_id() >= 0 && !job->p.ignore_eos ? tok.eos_id() : -1;
    if (auto e = tokenize(*job)) return send_error(res, *e);
    const int64_t n = job->p.n;
    // A bounded queue: the slots plus max_queue waiting requests, then 429.
    const int64_t limit = engine->num_slots() + opt.max_queue;
    int64_t cur = outstanding.load();
    do {
      if (cur + n > limit) {
        rejected_429.fetch_add(1);
        res.set_header("Retry-After", "1");
        return send_error(res, api_error(429, "the server is at capacity (" + std::to_string(cur) +
                                                  " requests running or queued); retry shortly",
                                         "rate_limit_exceeded", "rate_limit_exceeded"));
      }
    } while (!outstanding.compare_exchange_weak(cur, cur + 1));
    if (!job->p.seed_given) job->p.sampling.seed = std::random_device{}() * 0x100000001ull + std::random_device{}();
    if (chat) job->stops = chat_tmpl.stop;
    job->stops.insert(job->stops.end(), job->p.stop.begin(), job->p.stop.end());
    job->api_id = random_id(chat ? "chatcmpl" : "cmpl");
    job->created = unix_time();
    job->choices.resize(static_cast<size_t>(n));
    for (auto& c : job->choices) c.text = std::make_unique<TextStream>(&tok, job->stops);
    prompt_tokens_total.fetch_add(static_cast<int64_t>(job->prompt.size()));

    // Where to start: the session's own state, or (chosen by the engine when the request
    // gets its slot, r.use_cache) the longest cached prefix if that covers more.
    const SnapshotPtr start = job->prompt_state;
    job->prompt_state = nullptr;
    Request r = make_request(job, 0);
    start_from(start, job->prompt, &r);
    r.cache_prompt_state = cache_on(*job);
    // A host snapshot of the prompt only where one is needed: forks and sessions.
    if (n > 1 || !job->p.save_session.empty()) {
      r.capture_prompt_state = true;
      std::weak_ptr<Job> wj = job;
      r.on_prompt_state = [this, wj](RequestId, const SnapshotPtr& st) { on_prompt_state(wj.lock(), st); };
    } else {
      job->forked = true;
    }
    {
      std::lock_guard<std::mutex> lk(job->mu);
      Status st = engine->submit(std::move(r), &job->choices[0].id);
      if (!st.is_ok()) {
        outstanding.fetch_sub(1);
        return send_error(res, api_error(400, st.message(), "invalid_request_error"));
      }
      job->choices[0].submitted = true;
      outstanding.fetch_add(n - 1);  // the forks, submitted once the prompt is in
    }
    kick();

    // The answer is produced by a content provider so that a client that goes away is
    // noticed (a failed write, or is_writable() false) and its requests cancelled.
    // While a non-streamed answer is being generated, a space (leading whitespace is
    // valid JSON) goes out every half second: writing is the only way to learn that the
    // client has gone (the write fails), so that its generation is cancelled.
    struct Progress {
      std::vector<bool> first;
      std::chrono::steady_clock::time_point last_write = std::chrono::steady_clock::now();
    };
    auto prog = std::make_shared<Progress>();
    prog->first.assign(static_cast<size_t>(n), true);
    const bool stream = job->p.stream;
    res.set_header("Cache-Control", "no-cache");
    res.set_chunked_content_provider(
        stream ? "text/event-stream" : "application/json",
        [this, job, prog, stream](size_t, httplib::DataSink& sink) {
          std::string out;
          bool done;
          {
            std::unique_lock<std::mutex> lk(job->mu);
            job->cv.wait_for(lk, std::chrono::milliseconds(50));
            done = job->all_finished();
            if (stream) {
              drain_stream(*job, prog->first, &out);
              if (done) {
                if (job->p.include_usage)
                  out += "data: " + dump([&] {
                           json u = chunk_json(*job, json::array());
                           u["usage"] = usage_json(*job);
                           return u;
                         }()) + "\n\n";
                out += "data: [DONE]\n\n";
              }
            } else if (done) {
              out = dump(final_json(*job));
            }
          }
          const auto now = std::chrono::steady_clock::now();
          if (out.empty() && now - prog->last_write > std::chrono::milliseconds(500))
            out = stream ? ": keep-alive\n\n" : " ";
          if (!out.empty()) prog->last_write = now;
          if (!sink.is_writable() || (!out.empty() && !sink.write(out.data(), out.size()))) {
            disconnects.fetch_add(1);
            cancel_job(job);
            return false;
          }
          if (done) {
            requests_ok.fetch_add(1);
            sink.done();
          }
          return true;
        },
        [this, job](bool success) {
          if (!success) cancel_job(job);
        });
  }

  // ---- sessions ------------------------------------------------------------------------
  json session_json(const std::string& n, const Session& s) {
    return json{{"name", n},
                {"object", "session"},
                {"tokens", s.context.size()},
                {"cached_tokens", s.snap ? s.snap->tokens.size() : 0},
                {"state_bytes", s.snap ? s.snap->state.size() : 0}};
  }

  std::string session_path(const std::string& n) { return (fs::path(opt.session_dir) / (n + ".session")).string(); }

  Status session_save(const std::string& n, const Session& s) {
    const StateSnapshot& sn = *s.snap;
    const int64_t esz = static_cast<int64_t>(dtype_size(sn.state_dtype));
    std::vector<int32_t> snap_tokens = sn.tokens, context = s.context;
    std::vector<float> logits = sn.logits;
    std::vector<uint8_t> state = sn.state;
    std::vector<NamedTensor> t = {
        {"state", Tensor(state.data(), sn.state_dtype, {static_cast<int64_t>(state.size()) / esz})},
        {"logits", Tensor(logits.data(), DType::kF32, {static_cast<int64_t>(logits.size())})},
        {"snapshot_tokens", Tensor(snap_tokens.data(), DType::kI32, {static_cast<int64_t>(snap_tokens.size())})},
        {"context", Tensor(context.data(), DType::kI32, {static_cast<int64_t>(context.size())})}};
    std::error_code ec;
    fs::create_directories(opt.session_dir, ec);
    return safetensors_write(session_path(n), t,
                             {{"laplace_session", "1"},
                              {"config_fingerprint", config_fingerprint},
                              {"defer_writeback", std::to_string(engine->pool().pending_steps())},
                              {"pair_dtype", dtype_name(model.dtype())}});
  }

  Status session_load(const std::string& n, Session* out) {
    SafeTensorsReader r;
    LAPLACE_RETURN_IF_ERROR(SafeTensorsReader::open(session_path(n), &r));
    auto md = r.metadata();
    if (md["laplace_session"] != "1") return Status::corrupt("not a Laplace session file (or an unknown version)");
    if (md["config_fingerprint"] != config_fingerprint)
      return Status::invalid_argument("the session was saved by a different model");
    auto get = [&](const char* name, DType dt, const SafeTensorInfo** info) -> Status {
      *info = r.find(name);
      if (!*info || (*info)->dtype != dt || (*info)->shape.size() != 1)
        return Status::corrupt(std::string("session file: '") + name + "' missing or malformed");
      return Status::ok();
    };
    const SafeTensorInfo* st = r.find("state");
    if (!st || st->shape.size() != 1 ||
        (st->dtype != DType::kF32 && st->dtype != DType::kBF16 && st->dtype != DType::kF64))
      return Status::corrupt("session file: 'state' missing or malformed");
    const SafeTensorInfo *lg, *sk, *cx;
    LAPLACE_RETURN_IF_ERROR(get("logits", DType::kF32, &lg));
    LAPLACE_RETURN_IF_ERROR(get("snapshot_tokens", DType::kI32, &sk));
    LAPLACE_RETURN_IF_ERROR(get("context", DType::kI32, &cx));
    // The saving server's slot layout: its state dtype, deferred write-back and pair dtype, from
    // the metadata (files written before it was recorded: the R whose slot size fits, pairs in
    // this model's dtype).
    const Config& c = model.config();
    DType pair_dtype = model.dtype();  // the pairs are in the saving model's activation dtype
    if (md.count("pair_dtype") && (!dtype_from_name(md["pair_dtype"], &pair_dtype) ||
                                   (pair_dtype != DType::kF32 && pair_dtype != DType::kBF16 &&
                                    pair_dtype != DType::kF64)))
      return Status::corrupt("session file: pair_dtype '" + md["pair_dtype"] + "' is not F32, BF16 or F64");
    int64_t saved_r = 0;
    if (md.count("defer_writeback")) {
      const std::string& v = md["defer_writeback"];
      if (v != "0" && v != "4" && v != "8" && v != "16")
        return Status::corrupt("session file: defer_writeback '" + v + "' is not 0, 4, 8 or 16");
      saved_r = std::stoll(v);
    } else {
      for (int64_t r : {4, 8, 16})
        if (static_cast<int64_t>(st->nbytes()) == StatePool::slot_bytes_for(c, st->dtype, {r, pair_dtype})) saved_r = r;
    }
    const PendingSpec saved{saved_r, pair_dtype};
    const int64_t saved_bytes = StatePool::slot_bytes_for(c, st->dtype, saved);
    if (static_cast<int64_t>(st->nbytes()) != saved_bytes)
      return Status::corrupt("session file: a state of " + std::to_string(st->nbytes()) + " bytes; " +
                             dtype_name(st->dtype) + " states with defer_writeback " + std::to_string(saved_r) +
                             " take " + std::to_string(saved_bytes));
    if (lg->numel() != c.vocab_size) return Status::corrupt("session file: logits of the wrong size for this model");
    auto snap = std::make_shared<StateSnapshot>();
    snap->state_dtype = engine->pool().dtype();
    // Another layout (--state-dtype, --defer-writeback) is converted: pairs folded in, values
    // rounded to this server's dtype. The same layout is taken byte for byte.
    const PendingSpec mine{engine->pool().pending_steps(), model.dtype()};
    if (st->dtype == snap->state_dtype && saved_r == mine.steps && (saved_r == 0 || pair_dtype == mine.pair_dtype))
      snap->state.assign(r.bytes(*st), r.bytes(*st) + st->nbytes());
    else
      LAPLACE_RETURN_IF_ERROR(
          StatePool::convert_slot(c, st->dtype, saved, r.bytes(*st), snap->state_dtype, mine, &snap->state));
    snap->logits.resize(static_cast<size_t>(lg->numel()));
    std::memcpy(snap->logits.data(), r.bytes(*lg), lg->nbytes());
    snap->tokens.resize(static_cast<size_t>(sk->numel()));
    std::memcpy(snap->tokens.data(), r.bytes(*sk), sk->nbytes());
    out->context.resize(static_cast<size_t>(cx->numel()));
    std::memcpy(out->context.data(), r.bytes(*cx), cx->nbytes());
    const int64_t V = c.vocab_size;
    for (int32_t t : out->context)
      if (t < 0 || t >= V) return Status::corrupt("session file: a token id outside the vocabulary");
    if (snap->tokens.empty() || snap->tokens.size() > out->context.size() ||
        !std::equal(snap->tokens.begin(), snap->tokens.end(), out->context.begin()))
      return Status::corrupt("session file: the state's tokens are not a prefix of the context");
    out->snap = std::move(snap);
    return Status::ok();
  }

  void handle_session_create(const httplib::Request& req, httplib::Response& res) {
    json b = json::parse(req.body, nullptr, false);
    if (b.is_discarded() || !b.is_object())
      return send_error(res, api_error(400, "the request body must be a JSON object", "invalid_request_error"));
    if (!b.contains("name") || !b["name"].is_string() || !valid_session_name(b["name"].get<std::string>()))
      return send_error(res, api_error(400, "'name' must be 1-64 characters of [A-Za-z0-9_.-]", "invalid_request_error",
                                       "", "name"));
    const std::string n = b["name"].get<std::string>();
    // Prefill the prompt: a one-token completion whose prompt state is kept.
    json creq = {{"prompt", b.contains("prompt") ? b["prompt"] : json("")},
                 {"max_tokens", 1},
                 {"temperature", 0}};
    auto job = std::make_shared<Job>();
    if (auto e = parse_completion_params(creq, false, opt.limits, &job->p)) return send_error(res, *e);
    job->eos = tok.eos_id();
    if (auto e = tokenize(*job)) return send_error(res, *e);
    {
      std::lock_guard<std::mutex> lk(sessions_mu);
      if (static_cast<int64_t>(sessions.size()) >= opt.max_sessions && !sessions.count(n))
        return send_error(res, api_error(429, "too many sessions", "rate_limit_exceeded"));
    }
    std::mutex mu;
    std::condition_variable cv;
    SnapshotPtr snap;
    bool finished = false;
    Request r;
    start_from(nullptr, job->prompt, &r);
    r.use_cache = r.cache_prompt_state = cache_on(*job);
    r.max_tokens = 1;
    r.sampling.temperature = 0;
    r.eos_id = -1;
    r.capture_prompt_state = true;
    r.on_prompt_state = [&](RequestId, const SnapshotPtr& st) {
      std::lock_guard<std::mutex> lk(mu);
      snap = st;
    };
    r.on_finish = [&](const FinishInfo&) {
      outstanding.fetch_sub(1);
      std::lock_guard<std::mutex> lk(mu);
      finished = true;
      cv.notify_all();
    };
    outstanding.fetch_add(1);
    RequestId id;
    Status st = engine->submit(std::move(r), &id);
    if (!st.is_ok()) {
      outstanding.fetch_sub(1);
      return send_error(res, api_error(400, st.message(), "invalid_request_error"));
    }
    kick();
    std::unique_lock<std::mutex> lk(mu);
    while (!cv.wait_for(lk, std::chrono::milliseconds(100), [&] { return finished; })) {
      if (stopping.load()) {  // shutting down: the engine thread is gone; the callbacks never run
        return send_error(res, api_error(503, "the server is shutting down", "server_error"));
      }
    }
    if (!snap) return send_error(res, api_error(500, "the prompt could not be prefilled", "server_error"));
    Session s{job->prompt, snap};
    json out = session_json(n, s);
    {
      std::lock_guard<std::mutex> sk(sessions_mu);
      sessions[n] = std::move(s);
    }
    send_json(res, 200, out);
  }

  void handle_session_op(const httplib::Request& req, httplib::Response& res) {
    const std::string n = req.matches[1];
    const std::string op = req.matches.size() > 2 ? std::string(req.matches[2]) : "";
    if (!valid_session_name(n))
      return send_error(res, api_error(400, "invalid session name", "invalid_request_error", "", "name"));
    if (op == "restore") {
      if (opt.session_dir.empty())
        return send_error(res, api_error(400, "this server keeps sessions in memory only (start it with --session-dir)",
                                         "invalid_request_error"));
      Session s;
      Status st = session_load(n, &s);
      if (!st.is_ok())
        return send_error(res, api_error(st.code() == Status::Code::kNotFound ? 404 : 400, st.message(),
                                         "invalid_request_error", "session_file_invalid"));
      json out = session_json(n, s);
      std::lock_guard<std::mutex> lk(sessions_mu);
      sessions[n] = std::move(s);
      return send_json(res, 200, out);
    }
    std::unique_lock<std::mutex> lk(sessions_mu);
    auto it = sessions.find(n);
    if (it == sessions.end())
      return send_error(res, api_error(404, "session '" + n + "' does not exist", "invalid_request_error",
                                       "session_not_found"));
    if (req.method == "GET") {
      json out = session_json(n, it->second);
      std::string text;
      if (tok.decode(it->second.context, &text).is_ok()) out["text"] = text;
      out["token_ids"] = it->second.context;
      return send_json(res, 200, out);
    }
    if (req.method == "DELETE") {
      sessions.erase(it);
      return send_json(res, 200, json{{"name", n}, {"object", "session"}, {"deleted", true}});
    }
    if (op == "fork") {
      json b = json::parse(req.body, nullptr, false);
      if (b.is_discarded() || !b.is_object() || !b.contains("name") || !b["name"].is_string() ||
          !valid_session_name(b["name"].get<std::string>()))
        return send_error(res, api_error(400, "fork needs {\"name\": NEW_NAME}", "invalid_request_error", "", "name"));
      const std::string to = b["name"].get<std::string>();
      if (static_cast<int64_t>(sessions.size()) >= opt.max_sessions && !sessions.count(to))
        return send_error(res, api_error(429, "too many sessions", "rate_limit_exceeded"));
      Session copy = it->second;  // snapshots are immutable: a fork shares its state until it moves on
      sessions[to] = copy;
      return send_json(res, 200, session_json(to, copy));
    }
    if (op == "save") {
      if (opt.session_dir.empty())
        return send_error(res, api_error(400, "this server keeps sessions in memory only (start it with --session-dir)",
                                         "invalid_request_error"));
      Session s = it->second;
      lk.unlock();
      Status st = session_save(n, s);
      if (!st.is_ok()) return send_error(res, api_error(500, st.message(), "server_error"));
      json out = session_json(n, s);
      out["path"] = session_path(n);
      return send_json(res, 200, out);
    }
    return send_error(res, api_error(404, "unknown session operation", "invalid_request_error"));
  }

  // ---- metrics ---------------------------------------------------------------------------
  std::string metrics_text() {
    std::string out;
    const bool up = ready.load();
    render_metric(&out, "laplace_ready", "gauge", "1 when the model is loaded.", up ? 1 : 0);
    if (up) {
      const EngineStats s = engine->stats();
      render_metric(&out, "laplace_requests_running", "gauge", "Requests holding a state slot.", s.running);
      render_metric(&out, "laplace_requests_waiting", "gauge", "Requests queued for a state slot.", s.queued);
      render_metric(&out, "laplace_state_slots_used", "gauge", "State slots in use.", s.running);
      render_metric(&out, "laplace_state_slots_free", "gauge", "Free state slots.", s.free_slots);
      render_metric(&out, "laplace_state_slot_bytes", "gauge", "Bytes of one state slot.", engine->slot_bytes());
      render_metric(&out, "laplace_prefill_tokens_total", "counter", "Prompt tokens fed through prefill forwards.",
                    s.prefill_tokens);
      render_metric(&out, "laplace_decode_tokens_total", "counter", "Tokens fed through decode forwards.",
                    s.decode_tokens);
      render_metric(&out, "laplace_engine_steps_total", "counter", "Engine steps that did work.", s.steps);
      const StateCacheStats c = engine->cache_stats();
      render_metric(&out, "laplace_cache_entries", "gauge", "Cached contexts (both tiers).", c.entries);
      render_metric(&out, "laplace_cache_bytes", "gauge", "Bytes held by the cache's host tier.", c.bytes);
      render_metric(&out, "laplace_cache_hits_total", "counter", "Prefix cache hits (both tiers).", c.hits);
      render_metric(&out, "laplace_cache_misses_total", "counter", "Prefix cache misses.", c.misses);
      render_metric(&out, "laplace_cache_hit_tokens_total", "counter", "Prompt tokens served from the cache.",
                    c.hit_tokens);
      render_metric(&out, "laplace_cache_device_hits_total", "counter",
                    "Cache hits served from the device tier (slot-to-slot copy).", c.device_hits);
      render_metric(&out, "laplace_cache_host_hits_total", "counter",
                    "Cache hits served from the host tier (host-to-device write).", c.host_hits);
      render_metric(&out, "laplace_cache_device_slots", "gauge", "Cache slots of the device tier.", c.device_slots);
      render_metric(&out, "laplace_cache_device_slots_used", "gauge", "Device-tier cache slots holding a context.",
                    c.device_used);
      render_metric(&out, "laplace_cache_device_slots_free", "gauge", "Free device-tier cache slots.",
                    c.device_slots - c.device_used);
      render_metric(&out, "laplace_cache_host_entries", "gauge", "Contexts in the host tier.", c.host_entries);
      render_metric(&out, "laplace_cache_demotions_total", "counter",
                    "Device-tier entries moved to the host tier (device tier full).", c.demotions);
      render_metric(&out, "laplace_cache_promotions_total", "counter",
                    "Host-tier entries moved to the device tier on a hit.", c.promotions);
      render_metric(&out, "laplace_cache_evictions_total", "counter", "Cached contexts dropped (host tier full).",
                    c.evictions);
    }
    render_metric(&out, "laplace_prompt_tokens_total", "counter", "Prompt tokens of accepted requests.",
                  prompt_tokens_total.load());
    render_metric(&out, "laplace_generation_tokens_total", "counter", "Generated tokens.",
                  generation_tokens_total.load());
    render_metric(&out, "laplace_http_requests_total", "counter", "HTTP requests received.", http_requests.load());
    render_metric(&out, "laplace_requests_rejected_total", "counter", "Requests answered 429.", rejected_429.load());
    render_metric(&out, "laplace_client_disconnects_total", "counter", "Requests cancelled because the client left.",
                  disconnects.load());
    {
      std::lock_guard<std::mutex> lk(sessions_mu);
      render_metric(&out, "laplace_sessions", "gauge", "Named sessions in memory.", static_cast<double>(sessions.size()));
    }
    render_metric(&out, "laplace_process_resident_bytes", "gauge", "Resident memory of the server process.",
                  static_cast<double>(process_resident_bytes()));
    ttft.render(&out);
    itl.render(&out);
    e2e.render(&out);
    queue_time.render(&out);
    return out;
  }

  // ---- routes ------------------------------------------------------------------------------
  void setup_routes() {
    http.new_task_queue = [n = opt.threads] { return new httplib::ThreadPool(static_cast<size_t>(std::max(n, 2))); };
    http.set_payload_max_length(static_cast<size_t>(opt.max_request_bytes));
    http.set_read_timeout(opt.read_timeout_s, 0);
    http.set_write_timeout(opt.write_timeout_s, 0);
    http.set_keep_alive_max_count(100);
    // SO_REUSEADDR only: cpp-httplib's default also sets SO_REUSEPORT, which would let a
    // second server bind our port and silently take half of its connections.
    http.set_socket_options([this](socket_t sock) {
      int yes = 1;
      ::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
      listen_fd = sock;
    });

    http.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
      http_requests.fetch_add(1);
      if (!opt.api_key.empty()) {
        const std::string want = "Bearer " + opt.api_key;
        const std::string got = req.get_header_value("Authorization");
        // Constant-time comparison: the time taken does not tell how much of a key matched.
        unsigned diff = got.size() != want.size();
        for (size_t i = 0; i < want.size(); ++i) diff |= static_cast<unsigned>(want[i] ^ (i < got.size() ? got[i] : 0));
        if (diff) {
          send_error(res, api_error(401, "missing or wrong API key (send 'Authorization: Bearer KEY')",
                                    "invalid_request_error", "invalid_api_key"));
          return httplib::Server::HandlerResponse::Handled;
        }
      }
      if (!ready.load() && req.path != "/health" && req.path != "/metrics") {
        res.set_header("Retry-After", "1");
        send_error(res, api_error(503, load_failed.load() ? "the model failed to load: " + load_status.message()
                                                          : "the model is loading",
                                  "server_error", "model_loading"));
        return httplib::Server::HandlerResponse::Handled;
      }
      return httplib::Server::HandlerResponse::Unhandled;
    });
    http.set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
      std::string what = "internal error";
      try {
        if (ep) std::rethrow_exception(ep);
      } catch (const std::exception& e) {
        what = e.what();
      } catch (...) {
      }
      send_error(res, api_error(500, what, "server_error"));
    });
    // A bare 404/405/413 from the library gets an OpenAI-style body too.
    http.set_error_handler([](const httplib::Request&, httplib::Response& res) {
      if (!res.body.empty()) return;
      const char* msg = res.status == 404   ? "no such route"
                        : res.status == 413 ? "the request is too large"
                        : res.status == 405 ? "method not allowed"
                                            : "bad request";
      send_error(res, api_error(res.status, msg, "invalid_request_error"));
    });

    http.Get("/health", [this](const httplib::Request&, httplib::Response& res) {
      if (ready.load()) return send_json(res, 200, json{{"status", "ok"}});
      send_json(res, 503, json{{"status", load_failed.load() ? "failed" : "loading"}});
    });
    http.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
      res.set_content(metrics_text(), "text/plain; version=0.0.4");
    });
    auto model_json = [this] {
      return json{{"id", name}, {"object", "model"}, {"created", 0}, {"owned_by", "laplace"}};
    };
    http.Get("/v1/models", [model_json](const httplib::Request&, httplib::Response& res) {
      send_json(res, 200, json{{"object", "list"}, {"data", json::array({model_json()})}});
    });
    http.Get(R"(/v1/models/(.+))", [this, model_json](const httplib::Request& req, httplib::Response& res) {
      if (req.matches[1] != name)
        return send_error(res, api_error(404, "The model '" + std::string(req.matches[1]) + "' does not exist",
                                         "invalid_request_error", "model_not_found"));
      send_json(res, 200, model_json());
    });
    http.Post("/v1/completions",
              [this](const httplib::Request& req, httplib::Response& res) { handle_completion(req, res, false); });
    http.Post("/v1/chat/completions",
              [this](const httplib::Request& req, httplib::Response& res) { handle_completion(req, res, true); });
    http.Get("/v1/sessions", [this](const httplib::Request&, httplib::Response& res) {
      json data = json::array();
      std::lock_guard<std::mutex> lk(sessions_mu);
      for (const auto& [n, s] : sessions) data.push_back(session_json(n, s));
      send_json(res, 200, json{{"object", "list"}, {"data", data}});
    });
    http.Post("/v1/sessions",
              [this](const httplib::Request& req, httplib::Response& res) { handle_session_create(req, res); });
    auto op = [this](const httplib::Request& req, httplib::Response& res) { handle_session_op(req, res); };
    http.Get(R"(/v1/sessions/([^/]+))", op);
    http.Delete(R"(/v1/sessions/([^/]+))", op);
    http.Post(R"(/v1/sessions/([^/]+)/(fork|save|restore))", op);
  }
};

Server::Server(ServerOptions o) : impl_(std::make_unique<Impl>(std::move(o))) {}

Server::~Server() { stop(); }

Status Server::start() {
  Impl& m = *impl_;
  m.name = m.opt.model_name.empty() ? fs::path(m.opt.model_dir).lexically_normal().filename().string()
                                    : m.opt.model_name;
  if (m.name.empty() || m.name == ".") m.name = "laplace";
  m.setup_routes();
  if (m.opt.port == 0) {
    m.port = m.http.bind_to_any_port(m.opt.host);
    if (m.port < 0) return Status::io_error("cannot bind to " + m.opt.host);
  } else {
    if (!m.http.bind_to_port(m.opt.host, m.opt.port))
      return Status::io_error("cannot bind to " + m.opt.host + ":" + std::to_string(m.opt.port) +
                              " (in use, or not an address of this machine)");
    m.port = m.opt.port;
  }
  // cpp-httplib listens with a backlog of 5, compiled into Debian's library. A burst of more
  // connections than that overflows the accept queue; the kernel then drops the handshakes'
  // last packets and the clients' first data, which come back only by retransmission, up to
  // seconds later: requests stall, or time out half-read. Listening again on a listening
  // socket sets a new backlog (Linux), capped by net.core.somaxconn.
  if (m.listen_fd >= 0) {
    int accepting = 0;
    socklen_t len = sizeof(accepting);
    if (::getsockopt(m.listen_fd, SOL_SOCKET, SO_ACCEPTCONN, &accepting, &len) == 0 && accepting)
      ::listen(m.listen_fd, SOMAXCONN);
  }
  m.listener = std::thread([&m] { m.http.listen_after_bind(); });
  m.loader = std::thread([&m] {
    Status st = m.load();
    {
      std::lock_guard<std::mutex> lk(m.load_mu);
      m.load_status = st;
      if (st.is_ok()) {
        m.engine_thread = std::thread([&m] { m.engine_loop(); });
        m.ready.store(true);
      } else {
        std::fprintf(stderr, "laplace serve: %s\n", st.to_string().c_str());
        m.load_failed.store(true);
      }
    }
    m.load_cv.notify_all();
  });
  return Status::ok();
}

Status Server::wait_ready() {
  Impl& m = *impl_;
  std::unique_lock<std::mutex> lk(m.load_mu);
  m.load_cv.wait(lk, [&] { return m.ready.load() || m.load_failed.load(); });
  return m.load_status;
}

int Server::port() const { return impl_->port; }

void Server::stop() {
  Impl& m = *impl_;
  {
    std::lock_guard<std::mutex> lk(m.stop_mu);
    if (m.stopped) return;
    m.stopped = true;
  }
  m.http.stop();
  if (m.listener.joinable()) m.listener.join();
  if (m.loader.joinable()) m.loader.join();
  m.stopping.store(true);
  m.wake_cv.notify_all();
  if (m.engine_thread.joinable()) m.engine_thread.join();
  m.stop_cv.notify_all();
}

void Server::wait() {
  Impl& m = *impl_;
  std::unique_lock<std::mutex> lk(m.stop_mu);
  m.stop_cv.wait(lk, [&] { return m.stopped; });
}

ServerCounters Server::counters() const {
  const Impl& m = *impl_;
  ServerCounters c;
  if (m.ready.load()) c.engine = m.engine->stats();
  if (m.ready.load()) c.cache = m.engine->cache_stats();
  c.http_requests = m.http_requests.load();
  c.rejected_429 = m.rejected_429.load();
  c.client_disconnects = m.disconnects.load();
  c.outstanding = m.outstanding.load();
  {
    std::lock_guard<std::mutex> lk(const_cast<Impl&>(m).sessions_mu);
    c.sessions = static_cast<int64_t>(m.sessions.size());
  }
  return c;
}

}  // namespace laplace
