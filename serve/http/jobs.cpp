// Completions: a request's engine work (n choices), what the engine's callbacks feed it,
// and its answer (serve/http/server_impl.h).
#include <chrono>
#include <cmath>
#include <random>

#include "serve/http/server_impl.h"

namespace laplace {

using nlohmann::json;

namespace {

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

// Characters that start in s: its bytes other than UTF-8 continuation bytes (for valid
// UTF-8, its code points).
int64_t char_starts(const std::string& s) {
  int64_t n = 0;
  for (unsigned char ch : s) n += (ch & 0xC0) != 0x80;
  return n;
}

// r continues `start` (a snapshot of a prefix of `tokens`, or null) and feeds the rest.
void start_from(const SnapshotPtr& start, const std::vector<int32_t>& tokens, Request* r) {
  const size_t covered = start ? start->tokens.size() : 0;
  r->initial_state = start;
  r->prompt.assign(tokens.begin() + static_cast<ptrdiff_t>(covered), tokens.end());
}

}  // namespace

void Server::Impl::memo_put(const std::string& text, const std::vector<int32_t>& ids) {
  std::lock_guard<std::mutex> lk(memo_mu);
  if (memo.emplace(text, ids).second) memo_order.push_back(text);
  while (memo_order.size() > 4096) {
    memo.erase(memo_order.front());
    memo_order.pop_front();
  }
}

std::optional<ApiError> Server::Impl::tokenize_part(const Job& job, const PromptInput* in, Part* part) {
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
      std::vector<int32_t> piece_ids;
      Status e = tok.encode(piece.text, &piece_ids);
      if (!e.is_ok()) return ApiError{400, e.message(), "invalid_request_error", "messages", ""};
      ids.insert(ids.end(), piece_ids.begin(), piece_ids.end());
    }
  } else if (in->is_ids) {
    for (int32_t t : in->ids)
      if (t >= model.config().vocab_size)
        return ApiError{400, "prompt token id " + std::to_string(t) + " is outside the vocabulary (" +
                                 std::to_string(model.config().vocab_size) + ")",
                        "invalid_request_error", "prompt", ""};
    ids = in->ids;
  } else {
    Status e = tok.encode(in->text, &ids);
    if (!e.is_ok()) return ApiError{400, e.message(), "invalid_request_error", "prompt", ""};
  }
  part->own = ids;
  part->prompt.insert(part->prompt.end(), ids.begin(), ids.end());
  if (part->prompt.empty()) {
    if (tok.bos_id() >= 0) {
      part->prompt.push_back(tok.bos_id());  // an empty prompt starts a document
    } else {
      return ApiError{400, "the prompt is empty", "invalid_request_error", p.chat ? "messages" : "prompt", ""};
    }
  }
  if (static_cast<int64_t>(part->prompt.size()) > opt.max_prompt_tokens)
    return ApiError{400,
                    "the prompt has " + std::to_string(part->prompt.size()) + " tokens; this server accepts at most " +
                        std::to_string(opt.max_prompt_tokens),
                    "invalid_request_error", p.chat ? "messages" : "prompt", "context_length_exceeded"};
  if (p.echo && !p.chat) {
    if (in->is_ids) {
      if (!tok.decode(ids, &part->echo_text).is_ok()) part->echo_text.clear();
    } else {
      part->echo_text = in->text;
    }
  }
  return std::nullopt;
}

std::optional<ApiError> Server::Impl::tokenize(Job& job) {
  const CompletionParams& p = job.p;
  for (const auto& [t, bias] : p.sampling.logit_bias)
    if (t >= model.config().vocab_size)
      return ApiError{400, "logit_bias names token id " + std::to_string(t) + ", outside the vocabulary (" +
                               std::to_string(model.config().vocab_size) + ")",
                      "invalid_request_error", "logit_bias", ""};
  Part base;
  if (!p.session.empty()) {
    // The session as this replica should use it: with a --session-dir shared by a fleet,
    // the saved one when this replica holds none or an older unchanged copy (file work, but
    // this runs on a prep thread, not an event loop).
    Session s;
    Status st = sessions.current(p.session, [this](const std::string& path, Session* out) {
      return session_file_read(path, session_format(), out);
    }, &s);
    if (!st.is_ok()) {
      ApiError e = session_api_error(st);
      e.param = "session";
      return e;
    }
    // Saved back under its own name, the answer's context descends from this version.
    if (p.save_session == p.session) job.session_base = s.base_version;
    base.prompt = s.context;
    base.prompt_state = s.snap;  // a candidate start
  }
  job.parts.clear();
  const size_t count = p.chat ? 1 : p.prompts.size();
  for (size_t k = 0; k < count; ++k) {
    Part part = base;
    if (auto e = tokenize_part(job, p.chat ? nullptr : &p.prompts[k], &part)) return e;
    job.parts.push_back(std::move(part));
  }
  return std::nullopt;
}

Request Server::Impl::make_request(const std::shared_ptr<Job>& job, size_t i) {
  const CompletionParams& p = job->p;
  Request r;
  r.sampling = p.sampling;
  // Choices of a prompt differ; its choice 0 keeps the given seed, so each prompt of a list
  // is answered as it would be alone.
  r.sampling.seed = p.sampling.seed + i % static_cast<size_t>(p.n);
  r.max_tokens = std::max<int64_t>(p.max_tokens, 1);
  r.top_logprobs = p.logprobs;
  r.eos_id = job->eos;
  // The cache keeps the final context itself (device tier first); a host snapshot is
  // made only when a session needs one.
  r.use_cache = cache_on(*job);
  r.cache_final_state = cache_on(*job);
  r.capture_final_state = !p.save_session.empty();
  // The callbacks hold the job, not a weak reference to it: what the job holds of the
  // server's capacity (its n admission units, its session reservation) is given back only
  // in them, so the job must outlive a client that went away. The engine drops a request's
  // callbacks when it finishes, so this keeps the job no longer than its engine work.
  r.on_logprobs = [job, i](RequestId, const TokenLogprobs& lp) {
    std::lock_guard<std::mutex> lk(job->mu);
    job->choices[i].logprobs.push_back(lp);
  };
  r.on_token = [this, job, i](RequestId id, int32_t t) { on_token(job, i, id, t); };
  r.on_finish = [this, job, i](const FinishInfo& f) { on_finish(job, i, f); };
  if (!p.save_session.empty() && !job->stops.empty()) {
    // A stop string ends the request at its token with the final state captured, so the
    // session is saved (a cancel would leave none).
    r.stop_after = [job, i](RequestId, int32_t) {
      std::lock_guard<std::mutex> lk(job->mu);
      return job->choices[i].stop_now;
    };
  }
  return r;
}

void Server::Impl::mark_dirty(const std::shared_ptr<Job>& j) {
  // Engine thread (every caller is an engine callback): woken after the step.
  if (!j->dirty.exchange(true)) dirty_jobs.push_back(j);
}

void Server::Impl::on_token(const std::shared_ptr<Job>& j, size_t i, RequestId id, int32_t t) {
  if (!j) return;
  bool cancel = false;
  {
    std::lock_guard<std::mutex> lk(j->mu);
    Choice& c = j->choices[i];
    if (c.text_done) return;
    c.tokens.push_back(t);
    if (j->discard_first) {
      // echo with max_tokens 0: the token only gave the prompt its log-probabilities.
      c.text_done = true;
      c.finish_reason = "length";
    } else {
      if (t != j->eos) c.pending += c.text->push(t);
      if (c.text->stopped()) {
        c.text_done = true;
        c.finish_reason = "stop";
        if (!j->p.save_session.empty() && i == 0) c.stop_now = true;  // Request::stop_after ends it here
        else cancel = true;  // the rest of this sequence is not wanted
      }
    }
  }
  mark_dirty(j);
  if (cancel) engine->cancel(id);
}

void Server::Impl::on_finish(const std::shared_ptr<Job>& j, size_t i, const FinishInfo& f) {
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
    Part& part = j->parts[c.part];
    const bool lead = i % static_cast<size_t>(j->p.n) == 0;  // the choice that prefilled the prompt
    c.info = f;
    if (lead) part.cached_tokens = f.cached_tokens;
    c.finished = true;
    ++j->finished;
    if (!c.text_done) {
      c.text_done = true;
      c.finish_reason = finish_reason_api(f.reason);
      if (f.reason != FinishReason::kCancelled) c.pending += c.text->finish();
    }
    // The lead ended before its prompt state could seed the others: they never start.
    if (lead && !part.forked) give_up_forks(*j, c.part);
    if (j->p.chat && c.finish_reason != "cancelled") {
      // Remember which tokens produced this reply (without a trailing end-of-sequence).
      std::vector<int32_t> ids = c.text->tokens();
      if (!ids.empty() && ids.back() == j->eos) ids.pop_back();
      std::string text;
      if (tok.decode(ids, &text).is_ok() && text == c.text->sent()) memo_put(text, ids);
    }
    if (j->session_ticket && i == 0) {
      // The room was reserved at admission: a finished request's context is always kept.
      Session s;
      if (f.reason != FinishReason::kCancelled && kept_session(*j, part, c, f, &s)) {
        s.base_version = j->session_base;
        s.changed = true;
        sessions.commit(j->session_ticket, std::move(s));
      } else {
        sessions.release(j->session_ticket);
      }
      j->session_ticket = 0;
    }
  }
  mark_dirty(j);
  jobs_cv.notify_all();
}

// What save_session keeps of a finished choice: the context its client saw. The prompt, then
// the generated tokens whose text went out whole; where a stop string ended the text inside a
// token, the part of that token's text that went out, tokenized again (the stop string and
// what follows it are not kept); the end-of-sequence token when it ended the answer. With
// echo and max_tokens 0, only the prompt (the one token generated was never shown). The
// state is the final one when it covers a prefix of that context, else the prompt's.
bool Server::Impl::kept_session(const Job& j, const Part& part, const Choice& c, const FinishInfo& f, Session* out) {
  out->context = part.prompt;
  std::vector<int32_t> gen = j.discard_first ? std::vector<int32_t>() : c.tokens;
  const bool eos_end = f.reason == FinishReason::kEos && !gen.empty() && gen.back() == j.eos;
  if (eos_end) gen.pop_back();
  if (c.text->stopped()) {
    // The longest run of tokens whose text is a prefix of what was sent, then the rest.
    const std::string& sent = c.text->sent();
    size_t k = gen.size();
    std::string text;
    for (; k > 0; --k) {
      const std::vector<int32_t> head(gen.begin(), gen.begin() + static_cast<ptrdiff_t>(k));
      if (tok.decode(head, &text).is_ok() && sent.compare(0, text.size(), text) == 0 && text.size() <= sent.size())
        break;
      text.clear();
    }
    std::vector<int32_t> tail;
    if (text.size() < sent.size() && !tok.encode(sent.substr(text.size()), &tail).is_ok()) tail.clear();
    gen.resize(k);
    gen.insert(gen.end(), tail.begin(), tail.end());
  }
  out->context.insert(out->context.end(), gen.begin(), gen.end());
  if (eos_end) out->context.push_back(j.eos);
  const auto covers = [&](const SnapshotPtr& snap) {
    return snap && snap->tokens.size() <= out->context.size() &&
           std::equal(snap->tokens.begin(), snap->tokens.end(), out->context.begin());
  };
  if (covers(f.final_state)) out->snap = f.final_state;
  else if (covers(part.prompt_state)) out->snap = part.prompt_state;
  return out->snap != nullptr;
}

// A part's choices 1..n-1 will never start: they finish as cancelled, and what admission
// counted for them is given back.
void Server::Impl::give_up_forks(Job& j, size_t part) {
  Part& pt = j.parts[part];
  pt.forked = true;
  const size_t n = static_cast<size_t>(j.p.n);
  for (size_t k = part * n + 1; k < part * n + n; ++k) {
    Choice& c = j.choices[k];
    c.finished = c.text_done = true;
    c.finish_reason = "cancelled";
    ++j.finished;
    outstanding.fetch_sub(1);  // counted when the job was admitted, never started
  }
}

// The prompt is in the state (the engine has cached it): start the part's choices 1..n-1 from it.
void Server::Impl::on_prompt_state(const std::shared_ptr<Job>& j, size_t part, const SnapshotPtr& st) {
  if (!j) return;
  std::lock_guard<std::mutex> lk(j->mu);
  Part& pt = j->parts[part];
  pt.prompt_state = st;
  if (pt.forked) return;
  if (j->abandoned) return give_up_forks(*j, part);
  pt.forked = true;
  const size_t n = static_cast<size_t>(j->p.n);
  for (size_t k = part * n + 1; k < part * n + n; ++k) {
    Choice& c = j->choices[k];
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

void Server::Impl::cancel_job(const std::shared_ptr<Job>& j) {
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

void Server::Impl::register_job(const std::shared_ptr<Job>& j) {
  std::lock_guard<std::mutex> lk(jobs_mu);
  j->serial = next_serial++;
  live_jobs[j->serial] = j;
}

void Server::Impl::unregister_job(Job& j) {
  {
    std::lock_guard<std::mutex> lk(jobs_mu);
    live_jobs.erase(j.serial);
  }
  jobs_cv.notify_all();
}

// ---- answers ------------------------------------------------------------------------------

json Server::Impl::logprobs_json(const Job& j, Choice& c, const std::vector<TokenLogprobs>& lps, size_t from,
                                 size_t to, const std::vector<TokenLogprobs>* prompt_lps) {
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
  auto add = [&](const TokenLogprobs& lp) {
    const std::string s = token_text(tok, lp.token);
    tokens.push_back(s);
    if (std::isnan(lp.logprob)) {
      token_lps.push_back(nullptr);  // nothing before it predicts the first token
      tops.push_back(nullptr);
    } else {
      token_lps.push_back(lp.logprob);
      json top = json::object();
      for (const auto& [t, v] : lp.top) top[token_text(tok, t)] = v;
      tops.push_back(top);
    }
    // Where the token's text starts in the choice's text (prompt included when echoed), in
    // characters: the index of the character its first byte belongs to, so the byte-fallback
    // tokens that make up one character share its offset (and later offsets do not drift).
    const bool inside = !s.empty() && (static_cast<unsigned char>(s[0]) & 0xC0) == 0x80 && c.lp_offset > 0;
    offsets.push_back(c.lp_offset - (inside ? 1 : 0));
    c.lp_offset += char_starts(s);
  };
  if (prompt_lps)
    for (const TokenLogprobs& lp : *prompt_lps) add(lp);
  for (size_t k = from; k < to; ++k) add(lps[k]);
  return json{{"tokens", tokens}, {"token_logprobs", token_lps}, {"top_logprobs", tops}, {"text_offset", offsets}};
}

json Server::Impl::usage_json(const Job& j) {
  int64_t gen = 0;
  for (const auto& c : j.choices) gen += static_cast<int64_t>(c.tokens.size());
  if (j.discard_first) gen = 0;
  int64_t prompt = 0, cached = 0;
  for (const Part& part : j.parts) {
    prompt += static_cast<int64_t>(part.prompt.size());
    cached += part.cached_tokens;
  }
  return json{{"prompt_tokens", prompt},
              {"completion_tokens", gen},
              {"total_tokens", prompt + gen},
              {"prompt_tokens_details", {{"cached_tokens", cached}}}};
}

json Server::Impl::final_json(Job& j) {
  json choices = json::array();
  for (size_t i = 0; i < j.choices.size(); ++i) {
    Choice& c = j.choices[i];
    json ch = {{"index", i}, {"finish_reason", c.finish_reason == "cancelled" ? "stop" : c.finish_reason}};
    const size_t nlp = j.discard_first ? 0 : std::min(c.logprobs.size(), c.tokens.size());
    const bool echo = j.p.echo && !j.p.chat;
    c.lp_offset = 0;
    if (j.p.chat) {
      ch["message"] = {{"role", "assistant"}, {"content", c.text->sent()}};
      ch["logprobs"] = j.p.logprobs >= 0 ? logprobs_json(j, c, c.logprobs, 0, nlp, nullptr) : json(nullptr);
    } else {
      const Part& part = j.parts[c.part];
      ch["text"] = (echo ? part.echo_text : std::string()) + c.text->sent();
      ch["logprobs"] =
          j.p.logprobs >= 0 ? logprobs_json(j, c, c.logprobs, 0, nlp, echo ? &part.prompt_lps : nullptr) : json(nullptr);
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

json Server::Impl::chunk_json(Job& j, json choices) {
  return json{{"id", j.api_id},
              {"object", j.p.chat ? "chat.completion.chunk" : "text_completion"},
              {"created", j.created},
              {"model", name},
              {"system_fingerprint", "laplace-" + config_fingerprint},
              {"choices", std::move(choices)}};
}

// Stream chunks for whatever the choices produced since the last call (job locked).
void Server::Impl::drain_stream(Job& j, std::string* out) {
  const bool echo = j.p.echo && !j.p.chat;
  for (size_t i = 0; i < j.choices.size(); ++i) {
    Choice& c = j.choices[i];
    const size_t nlp = j.discard_first ? 0 : std::min(c.logprobs.size(), c.tokens.size());
    const bool has_lp = j.p.logprobs >= 0 && nlp > c.lp_sent;
    const bool end = c.text_done && c.finished && !c.end_sent;
    // The echoed prompt goes out with the choice's first chunk (and, asked for, its
    // log-probabilities, which are there once the first token is).
    const bool echo_now = echo && !c.echo_sent && (!c.tokens.empty() || end);
    if (c.pending.empty() && !has_lp && !end && !echo_now) continue;
    json ch = {{"index", i}};
    if (j.p.chat) {
      json delta = json::object();
      if (c.first) delta["role"] = "assistant";
      if (!c.pending.empty() || c.first) delta["content"] = c.pending;
      ch["delta"] = delta;
    } else {
      ch["text"] = (echo_now ? j.parts[c.part].echo_text : std::string()) + c.pending;
    }
    const bool lp_prompt = echo_now && j.p.logprobs >= 0;
    ch["logprobs"] = has_lp || lp_prompt ? logprobs_json(j, c, c.logprobs, c.lp_sent, nlp,
                                                         lp_prompt ? &j.parts[c.part].prompt_lps : nullptr)
                                         : json(nullptr);
    if (echo_now) c.echo_sent = true;
    c.lp_sent = nlp;
    c.first = false;
    ch["finish_reason"] = end ? json(c.finish_reason == "cancelled" ? "stop" : c.finish_reason) : json(nullptr);
    *out += "data: " + dump_json(chunk_json(j, json::array({ch}))) + "\n\n";
    c.pending.clear();
    if (end) c.end_sent = true;
  }
}

// The answer's producer (an event loop; see http::Producer).
void Server::Impl::produce(const std::shared_ptr<Job>& job, bool tick, http::Chunk* out) {
  std::lock_guard<std::mutex> lk(job->mu);
  if (job->closed) {
    out->done = true;
    return;
  }
  const bool done = job->all_finished();
  if (job->p.stream) {
    drain_stream(*job, &out->data);
    // (cut first: the cancels it made may have finished the choices since.)
    if (job->cut) {
      // The graceful stop's grace ran out: say so, then end the stream as streams end.
      const ApiError e = api_error(503, "the server is shutting down; the request was stopped", "server_error",
                                   "server_shutdown");
      out->data += "data: " + dump_json(e.to_json()) + "\n\ndata: [DONE]\n\n";
      out->done = true;
      requests_error.fetch_add(1);
    } else if (done) {
      if (job->p.include_usage) {
        json u = chunk_json(*job, json::array());
        u["usage"] = usage_json(*job);
        out->data += "data: " + dump_json(u) + "\n\n";
      }
      out->data += "data: [DONE]\n\n";
      out->done = true;
      requests_ok.fetch_add(1);
    } else if (tick && out->data.empty()) {
      out->data = ": keep-alive\n\n";
    }
  } else {
    if (job->cut) {
      http::Response r = busy_response(503, "the server is shutting down; the request was stopped", "server_shutdown");
      if (job->head_sent) out->data = std::move(r.body);  // the status went out already: the body says it
      else out->whole = std::move(r);
      out->done = true;
      requests_error.fetch_add(1);
    } else if (done) {
      http::Response r = json_response(200, final_json(*job));
      if (job->head_sent) out->data = std::move(r.body);
      else out->whole = std::move(r);
      out->done = true;
      requests_ok.fetch_add(1);
    } else if (tick) {
      // Leading whitespace is valid JSON; writing is how a client that left is noticed.
      out->data = " ";
      job->head_sent = true;
    }
  }
  if (out->done) {
    job->closed = true;
    std::lock_guard<std::mutex> jl(jobs_mu);
    live_jobs.erase(job->serial);
    jobs_cv.notify_all();
  }
}

std::optional<ApiError> Server::Impl::check_prompt_bytes(const CompletionParams& p) const {
  const int64_t cap = opt.max_prompt_tokens * max_token_bytes;
  auto refuse = [&](int64_t bytes, const char* param) {
    return ApiError{400,
                    "the prompt has " + std::to_string(bytes) + " bytes, more than " +
                        std::to_string(opt.max_prompt_tokens) + " tokens can hold (at most " + std::to_string(cap) +
                        "); this server accepts at most " + std::to_string(opt.max_prompt_tokens) + " tokens",
                    "invalid_request_error", param, "context_length_exceeded"};
  };
  if (p.chat) {
    int64_t bytes = 0;
    for (const ChatMessage& m : p.messages) bytes += static_cast<int64_t>(m.content.size());
    if (bytes > cap) return refuse(bytes, "messages");
    return std::nullopt;
  }
  for (const PromptInput& in : p.prompts) {
    if (in.is_ids && static_cast<int64_t>(in.ids.size()) > opt.max_prompt_tokens)
      return ApiError{400,
                      "the prompt has " + std::to_string(in.ids.size()) + " tokens; this server accepts at most " +
                          std::to_string(opt.max_prompt_tokens),
                      "invalid_request_error", "prompt", "context_length_exceeded"};
    if (!in.is_ids && static_cast<int64_t>(in.text.size()) > cap)
      return refuse(static_cast<int64_t>(in.text.size()), "prompt");
  }
  return std::nullopt;
}

// Submits a part's first choice (its prefill); the others fork its prompt state.
Status Server::Impl::submit_part(const std::shared_ptr<Job>& job, size_t k) {
  Part& part = job->parts[k];
  const size_t n = static_cast<size_t>(job->p.n);
  // Where to start: the session's own state, or (chosen by the engine when the request
  // gets its slot, r.use_cache) the longest cached prefix if that covers more.
  SnapshotPtr start;
  {
    std::lock_guard<std::mutex> lk(job->mu);
    start = std::move(part.prompt_state);
    part.prompt_state = nullptr;
  }
  Request r = make_request(job, k * n);
  start_from(start, part.prompt, &r);
  r.cache_prompt_state = cache_on(*job);
  const bool echo_lps = job->p.echo && job->p.logprobs >= 0 && !part.own.empty();
  if (echo_lps) {
    // The prompt's own tokens' log-probabilities: every one of them is fed (no cache hit
    // skips any), and the session's state, when there is one, predicts the first.
    r.prompt_logprobs = true;
    r.use_cache = false;
    const size_t own = part.own.size();
    r.on_prompt_logprobs = [job, k, own](RequestId, const std::vector<TokenLogprobs>& lps) {
      std::lock_guard<std::mutex> lk(job->mu);
      const size_t take = std::min(own, lps.size());
      job->parts[k].prompt_lps.assign(lps.end() - static_cast<ptrdiff_t>(take), lps.end());
    };
  }
  // A host snapshot of the prompt only where one is needed: forks and sessions.
  if (n > 1 || !job->p.save_session.empty()) {
    r.capture_prompt_state = true;
    r.on_prompt_state = [this, job, k](RequestId, const SnapshotPtr& st) { on_prompt_state(job, k, st); };
  }
  std::lock_guard<std::mutex> lk(job->mu);
  if (n == 1 && job->p.save_session.empty()) part.forked = true;
  Status st = engine->submit(std::move(r), &job->choices[k * n].id);
  if (st.is_ok()) job->choices[k * n].submitted = true;
  return st;
}

void Server::Impl::handle_completion(const http::Request& req, const http::ExchangePtr& ex, bool chat) {
  json body = json::parse(req.body, nullptr, /*allow_exceptions=*/false);
  if (body.is_discarded())
    return ex->respond(error_response(
        api_error(400, "the request body is not valid JSON (or not valid UTF-8)", "invalid_request_error")));
  auto job = std::make_shared<Job>();
  if (auto e = parse_completion_params(body, chat, opt.limits, &job->p)) return ex->respond(error_response(*e));
  if (!job->p.model.empty() && job->p.model != name)
    return ex->respond(error_response(api_error(
        404, "The model '" + job->p.model + "' does not exist (this server serves '" + name + "')",
        "invalid_request_error", "model_not_found", "model")));
  const int64_t n = job->p.n;
  const size_t prompts = chat ? 1 : job->p.prompts.size();
  // n choices of each prompt are engine requests at once: more than the slots and the queue
  // can ever hold is a request that can never succeed, not a busy server.
  const int64_t units = n * static_cast<int64_t>(prompts);
  if (units > admission_limit())
    return ex->respond(error_response(api_error(
        400, (prompts > 1 ? std::to_string(prompts) + " prompts x " : std::string()) + "n = " + std::to_string(n) +
                 " is more than this server can run at once (" + std::to_string(admission_limit()) +
                 ": slots + queue)",
        "invalid_request_error", "", prompts > 1 ? "prompt" : "n")));
  if (auto e = check_prompt_bytes(job->p)) return ex->respond(error_response(*e));
  if (draining.load())
    return ex->respond(busy_response(503, "the server is shutting down", "server_shutdown"));
  if (!admit(units)) {
    rejected_429.fetch_add(1);
    return ex->respond(busy_response(429,
                                     "the server is at capacity (" + std::to_string(outstanding.load()) +
                                         " requests running or queued); retry shortly",
                                     "rate_limit_exceeded"));
  }
  // Tokenizing costs in proportion to the prompt: it runs off the event loops, after
  // admission, so the requests waiting for it are bounded by the admission limit (and their
  // bytes by it times --max-request-kb).
  if (!prep->post([this, job, ex, units] { start_completion(job, ex, units); })) {
    outstanding.fetch_sub(units);
    jobs_cv.notify_all();
    return ex->respond(busy_response(503, "the server is shutting down", "server_shutdown"));
  }
}

// The rest of a completion, on a prep thread: tokenize, reserve a session's room, submit.
void Server::Impl::start_completion(const std::shared_ptr<Job>& job, const http::ExchangePtr& ex, int64_t units) {
  const bool chat = job->p.chat;
  const int64_t n = job->p.n;
  job->eos = tok.eos_id() >= 0 && !job->p.ignore_eos ? tok.eos_id() : -1;
  if (auto e = tokenize(*job)) {
    outstanding.fetch_sub(units);
    jobs_cv.notify_all();
    return ex->respond(error_response(*e));
  }
  if (!job->p.save_session.empty()) {
    // Room for the session it will save, now: full means a 429 before any work, never a
    // 200 with nothing saved.
    const int64_t bound = engine->slot_bytes() + model.config().vocab_size * 4 +
                          8 * static_cast<int64_t>(job->parts[0].prompt.size() + job->p.max_tokens) + 64;
    Status st = sessions.reserve(job->p.save_session, bound, &job->session_ticket);
    if (!st.is_ok()) {
      outstanding.fetch_sub(units);
      jobs_cv.notify_all();
      rejected_429.fetch_add(1);
      return ex->respond(busy_response(429, st.message(), "too_many_sessions"));
    }
  }
  if (!job->p.seed_given) job->p.sampling.seed = std::random_device{}() * 0x100000001ull + std::random_device{}();
  if (chat) job->stops = chat_tmpl.stop;
  job->stops.insert(job->stops.end(), job->p.stop.begin(), job->p.stop.end());
  job->api_id = random_id(chat ? "chatcmpl" : "cmpl");
  job->created = unix_time();
  job->discard_first = job->p.echo && job->p.max_tokens == 0;
  job->ex = ex;
  {
    std::lock_guard<std::mutex> lk(job->mu);
    job->choices.resize(static_cast<size_t>(units));
    for (size_t i = 0; i < job->choices.size(); ++i) {
      job->choices[i].part = i / static_cast<size_t>(n);
      job->choices[i].text = std::make_unique<TextStream>(&tok, job->stops);
    }
  }
  for (size_t k = 0; k < job->parts.size(); ++k) {
    prompt_tokens_total.fetch_add(static_cast<int64_t>(job->parts[k].prompt.size()));
    Status st = submit_part(job, k);
    if (!st.is_ok() && k == 0) {  // nothing runs yet
      outstanding.fetch_sub(units);
      jobs_cv.notify_all();
      if (job->session_ticket) sessions.release(job->session_ticket);
      return ex->respond(error_response(api_error(400, st.message(), "invalid_request_error")));
    }
    if (!st.is_ok()) {
      // Every part passed the checks the first did, so this is not expected; its choices
      // end as cancelled rather than leave the others' answer waiting.
      std::lock_guard<std::mutex> lk(job->mu);
      Choice& lead = job->choices[k * static_cast<size_t>(n)];
      lead.finished = lead.text_done = true;
      lead.finish_reason = "cancelled";
      ++job->finished;
      outstanding.fetch_sub(1);
      give_up_forks(*job, k);
    }
  }
  register_job(job);
  kick();

  http::StreamHead head;
  head.status = 200;
  head.content_type = job->p.stream ? "text/event-stream" : "application/json";
  head.headers.push_back({"Cache-Control", "no-cache"});
  // A whole answer ready before the first tick goes out with its own status and length;
  // after that the head goes out with whitespace (a write notices a client that left).
  head.defer = !job->p.stream;
  ex->stream(
      std::move(head), [this, job](bool tick, http::Chunk* out) { produce(job, tick, out); },
      [this, job] {
        // The connection failed or the server stopped before the answer was done.
        {
          std::lock_guard<std::mutex> lk(job->mu);
          if (job->closed) return;
          job->closed = true;
        }
        disconnects.fetch_add(1);
        cancel_job(job);
        unregister_job(*job);
      });
}

}  // namespace laplace
