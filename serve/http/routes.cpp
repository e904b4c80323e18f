// The routes of `laplace serve` (docs/serving.md §9): authentication and readiness before
// any body is read, then health, models, metrics, completions (serve/http/jobs.cpp), sessions and
// the web page (serve/http/static_files.h).
#include <arpa/inet.h>
#include <netinet/in.h>

#include <algorithm>
#include <filesystem>
#include <mutex>
#include <regex>

#include "serve/http/server_impl.h"
#include "serve/http/static_files.h"

namespace laplace {

using nlohmann::json;

std::string dump_json(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

http::Response json_response(int status, const json& j) {
  http::Response r;
  r.status = status;
  r.body = dump_json(j);
  return r;
}

namespace {
std::mutex roots_mu;
std::vector<std::string>& redacted_roots() {
  static std::vector<std::string> roots;
  return roots;
}
}  // namespace

void add_redacted_root(const std::string& dir) {
  if (dir.empty()) return;
  std::error_code ec;
  std::vector<std::string> forms = {std::filesystem::absolute(dir, ec).lexically_normal().string()};
  const auto canon = std::filesystem::weakly_canonical(dir, ec);
  if (!ec) forms.push_back(canon.string());
  std::lock_guard<std::mutex> lk(roots_mu);
  for (std::string f : forms) {
    while (f.size() > 1 && f.back() == '/') f.pop_back();
    if (f.size() > 1 && std::find(redacted_roots().begin(), redacted_roots().end(), f) == redacted_roots().end())
      redacted_roots().push_back(f);
  }
  // Longest first: a root inside another is taken whole.
  std::sort(redacted_roots().begin(), redacted_roots().end(),
            [](const std::string& a, const std::string& b) { return a.size() > b.size(); });
}

std::string redact_paths(const std::string& msg) {
  // The directories the server uses are known, whatever characters their names hold (spaces,
  // ':', ',', parentheses): a path under one becomes the part below it.
  std::string out = msg;
  {
    std::lock_guard<std::mutex> lk(roots_mu);
    for (const std::string& root : redacted_roots())
      for (size_t at; (at = out.find(root + "/")) != std::string::npos;) out.erase(at, root.size() + 1);
  }
  // Any other absolute path: a '/' at the start of a word, then at least one more component.
  static const std::regex abs(R"((^|[\s'"(=:,])(/[^\s'"():,]*/)([^\s'"():,/]*))");
  return std::regex_replace(out, abs, "$1$3");
}

http::Response error_response(const ApiError& e) {
  ApiError clean = e;
  clean.message = redact_paths(e.message);
  return json_response(e.http_status, clean.to_json());
}

ApiError api_error(int status, const std::string& msg, const std::string& type, const std::string& code,
                   const std::string& param) {
  return ApiError{status, msg, type, param, code};
}

http::Response busy_response(int status, const std::string& msg, const std::string& code) {
  http::Response r = error_response(
      api_error(status, msg, status == 429 ? "rate_limit_exceeded" : "server_error", code));
  r.headers.push_back({"Retry-After", "1"});
  return r;
}

namespace {

std::string lower(std::string s) {
  for (char& c : s)
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  return s;
}

std::string trim(const std::string& s) {
  const size_t a = s.find_first_not_of(" \t");
  if (a == std::string::npos) return "";
  return s.substr(a, s.find_last_not_of(" \t") - a + 1);
}

// The host of a Host header or an origin's authority: lowercase, without port, brackets or
// a trailing dot.
std::string host_name(const std::string& authority) {
  std::string s = lower(trim(authority));
  if (!s.empty() && s[0] == '[') {
    const size_t e = s.find(']');
    return e == std::string::npos ? "" : s.substr(1, e - 1);
  }
  const size_t colon = s.rfind(':');
  if (colon != std::string::npos && s.find(':') == colon) s.resize(colon);
  if (!s.empty() && s.back() == '.') s.pop_back();
  return s;
}

bool is_ip_literal(const std::string& h) {
  unsigned char buf[sizeof(in6_addr)];
  return inet_pton(AF_INET, h.c_str(), buf) == 1 || inet_pton(AF_INET6, h.c_str(), buf) == 1;
}

http::Response refused(int status, const std::string& msg, const std::string& code) {
  return error_response(api_error(status, msg, "invalid_request_error", code));
}

}  // namespace

bool Server::Impl::host_allowed(const http::Request& req) const {
  const std::string* h = req.find("Host");
  if (!h) return req.version == 10;  // HTTP/1.0 may omit it; HTTP/1.1 may not
  const std::string name = host_name(*h);
  if (name.empty()) return false;
  // A page can reach this server under a name only through DNS, which its attacker may point
  // here (DNS rebinding); an IP address or localhost names the server itself.
  if (name == "localhost" || (name.size() > 10 && name.compare(name.size() - 10, 10, ".localhost") == 0)) return true;
  if (is_ip_literal(name)) return true;
  for (const std::string& a : opt.allowed_hosts) {
    const std::string want = lower(a);
    if (want == "*" || want == name) return true;
    if (want.size() > 1 && want[0] == '.' && name.size() > want.size() &&
        name.compare(name.size() - want.size(), want.size(), want) == 0)
      return true;
  }
  return false;
}

std::string Server::Impl::foreign_origin(const http::Request& req) const {
  const std::string* o = req.find("Origin");
  if (!o) return "";
  const std::string origin = trim(*o);
  const size_t sep = origin.find("://");
  const std::string* h = req.find("Host");
  // Same origin: the page this server served (its Origin names the Host it was loaded from).
  if (sep != std::string::npos && h && lower(origin.substr(sep + 3)) == lower(trim(*h))) return "";
  return origin.empty() ? "null" : origin;
}

bool Server::Impl::cors_allowed(const std::string& origin) const {
  std::string o = lower(origin);
  while (!o.empty() && o.back() == '/') o.pop_back();
  for (const std::string& a : opt.cors_origins) {
    std::string want = lower(a);
    while (!want.empty() && want.back() == '/') want.pop_back();
    if (want == "*" || want == o) return true;
  }
  return false;
}

std::vector<http::Header> Server::Impl::cors_headers(const http::Request& req) const {
  const std::string origin = foreign_origin(req);
  if (origin.empty() || !cors_allowed(origin)) return {};
  return {{"Access-Control-Allow-Origin", origin},
          {"Vary", "Origin"},
          {"Access-Control-Expose-Headers", "Retry-After, X-Laplace-Replica"}};
}

std::optional<http::Response> Server::Impl::check_head(const http::Request& req) {
  http_requests.fetch_add(1);
  // Safe by default on localhost: a web page the user visits must not drive the server.
  // A name it does not answer to is a rebound DNS name (403); a page of another origin is
  // refused unless --cors-origin names it (403); a POST must be JSON, which no page of
  // another origin can send without asking first (a preflight this server refuses).
  if (!req.find("Host") && req.version != 10)
    return refused(400, "a Host header is required (HTTP/1.1)", "missing_host");
  if (!host_allowed(req))
    return refused(403, "this server does not answer to the host '" + req.header("Host") +
                            "' (start it with --allowed-hosts to add names)",
                   "host_not_allowed");
  const std::string origin = foreign_origin(req);
  if (!origin.empty() && !cors_allowed(origin))
    return refused(403, "requests from the web origin '" + origin + "' are not allowed (see --cors-origin)",
                   "origin_not_allowed");
  if (req.method == "OPTIONS" && !origin.empty()) {
    // A CORS preflight from an allowed origin (its Access-Control-Allow-Origin comes from
    // cors_headers).
    http::Response r;
    r.status = 204;
    r.content_type.clear();
    r.headers = {{"Access-Control-Allow-Methods", "GET, POST, DELETE"},
                 {"Access-Control-Allow-Headers", "Authorization, Content-Type, X-Laplace-Affinity"},
                 {"Access-Control-Max-Age", "600"}};
    return r;
  }
  // The page is public and shown while the model loads: it holds no data, and its API calls
  // carry the key and meet the readiness check themselves.
  if (is_static_path(req.path)) return std::nullopt;
  // /health too: a balancer's or an orchestrator's probe carries no key, and it tells only
  // whether this replica serves and which model (no data).
  if (req.path == "/health") return std::nullopt;
  if (!opt.api_key.empty()) {
    const std::string want = "Bearer " + opt.api_key;
    const std::string got = req.header("Authorization");
    // Constant-time comparison: the time taken does not tell how much of a key matched.
    unsigned diff = got.size() != want.size();
    for (size_t i = 0; i < want.size(); ++i) diff |= static_cast<unsigned>(want[i] ^ (i < got.size() ? got[i] : 0));
    if (diff) {
      http::Response r = error_response(api_error(401, "missing or wrong API key (send 'Authorization: Bearer KEY')",
                                                  "invalid_request_error", "invalid_api_key"));
      r.headers.push_back({"WWW-Authenticate", "Bearer realm=\"laplace\""});
      return r;
    }
  }
  if (req.method == "POST") {
    const std::string type = lower(trim(req.header("Content-Type").substr(0, req.header("Content-Type").find(';'))));
    if (type != "application/json")
      return refused(415, "the request body must be JSON, sent as 'Content-Type: application/json'",
                     "unsupported_media_type");
  }
  if (!ready.load() && req.path != "/health" && req.path != "/metrics") {
    if (load_failed.load())
      return busy_response(503, "the model failed to load: " + load_status.message(), "model_load_failed");
    return busy_response(503, "the model is loading", "model_loading");
  }
  return std::nullopt;
}

json Server::Impl::session_json(const std::string& n, const Session& s) {
  json j{{"name", n},
         {"object", "session"},
         {"tokens", s.context.size()},
         {"cached_tokens", s.snap ? s.snap->tokens.size() : 0},
         {"state_bytes", s.snap ? s.snap->state.size() : 0}};
  // The saved version it descends from (a shared --session-dir: docs/deployment.md).
  if (s.base_version > 0) j["version"] = s.base_version;
  return j;
}

namespace {

std::vector<std::string> split_path(const std::string& path) {
  std::vector<std::string> out;
  size_t at = 0;
  while (at < path.size()) {
    if (path[at] == '/') {
      ++at;
      continue;
    }
    size_t next = path.find('/', at);
    if (next == std::string::npos) next = path.size();
    out.push_back(path.substr(at, next - at));
    at = next;
  }
  return out;
}

http::Response not_found() { return error_response(api_error(404, "no such route", "invalid_request_error")); }

http::Response method_not_allowed(const std::string& allow) {
  http::Response r = error_response(api_error(405, "method not allowed", "invalid_request_error"));
  r.headers.push_back({"Allow", allow});
  return r;
}

}  // namespace

void Server::Impl::route(http::Request&& req, http::ExchangePtr ex) {
  try {
    const std::vector<std::string> p = split_path(req.path);
    const std::string& m = req.method;
    const bool get = m == "GET" || m == "HEAD";
    if (p.size() == 1 && p[0] == "health") {
      if (!get) return ex->respond(method_not_allowed("GET"));
      // A balancer's check reads the replica and the model's hash (a fleet never mixes
      // models); a draining replica answers 503 at once, so it is sent nothing new.
      json h{{"replica", replica}, {"model", name}};
      if (ready.load()) h["model_hash"] = model_hash;
      if (ready.load() && !draining.load()) {
        h["status"] = "ok";
        return ex->respond(json_response(200, h));
      }
      h["status"] = draining.load() ? "stopping" : load_failed.load() ? "failed" : "loading";
      http::Response r = json_response(503, h);
      if (!load_failed.load()) r.headers.push_back({"Retry-After", "1"});
      return ex->respond(std::move(r));
    }
    if (p.size() == 1 && p[0] == "metrics") {
      if (!get) return ex->respond(method_not_allowed("GET"));
      http::Response r;
      r.content_type = "text/plain; version=0.0.4";
      r.body = metrics_text();
      return ex->respond(std::move(r));
    }
    if (is_static_path(req.path)) {
      if (!get) return ex->respond(method_not_allowed("GET"));
      return ex->respond(*static_file_response(req.path));
    }
    if (p.empty() || p[0] != "v1") return ex->respond(not_found());
    auto model_json = [this] {
      return json{{"id", name}, {"object", "model"}, {"created", 0}, {"owned_by", "laplace"}};
    };
    if (p.size() >= 2 && p[1] == "models") {
      if (!get) return ex->respond(method_not_allowed("GET"));
      if (p.size() == 2)
        return ex->respond(json_response(200, json{{"object", "list"}, {"data", json::array({model_json()})}}));
      std::string id = req.path.substr(req.path.find("/models/") + 8);
      if (id != name)
        return ex->respond(error_response(
            api_error(404, "The model '" + id + "' does not exist", "invalid_request_error", "model_not_found")));
      return ex->respond(json_response(200, model_json()));
    }
    if (p.size() == 2 && p[1] == "completions") {
      if (m != "POST") return ex->respond(method_not_allowed("POST"));
      return handle_completion(req, ex, false);
    }
    if (p.size() == 3 && p[1] == "chat" && p[2] == "completions") {
      if (m != "POST") return ex->respond(method_not_allowed("POST"));
      return handle_completion(req, ex, true);
    }
    if (p.size() >= 2 && p[1] == "sessions") {
      if (p.size() == 2) {
        if (m == "POST") return handle_session_create(req, ex);
        if (!get) return ex->respond(method_not_allowed("GET, POST"));
        json data = json::array();
        for (const auto& [n, s] : sessions.list()) data.push_back(session_json(n, s));
        return ex->respond(json_response(200, json{{"object", "list"}, {"data", data}}));
      }
      if (p.size() == 3) {
        if (!get && m != "DELETE") return ex->respond(method_not_allowed("GET, DELETE"));
        return handle_session_op(req, ex, p[2], "");
      }
      if (p.size() == 4 && (p[3] == "fork" || p[3] == "save" || p[3] == "restore")) {
        if (m != "POST") return ex->respond(method_not_allowed("POST"));
        return handle_session_op(req, ex, p[2], p[3]);
      }
    }
    return ex->respond(not_found());
  } catch (const std::exception& e) {
    ex->respond(error_response(api_error(500, e.what(), "server_error")));
  }
}

// ---- sessions --------------------------------------------------------------------------------

void Server::Impl::handle_session_create(const http::Request& req, const http::ExchangePtr& ex) {
  json b = json::parse(req.body, nullptr, false);
  if (b.is_discarded() || !b.is_object())
    return ex->respond(error_response(api_error(400, "the request body must be a JSON object", "invalid_request_error")));
  if (!b.contains("name") || !b["name"].is_string() || !valid_session_name(b["name"].get<std::string>()))
    return ex->respond(error_response(
        api_error(400, "'name' must be 1-64 characters of [A-Za-z0-9_.-]", "invalid_request_error", "", "name")));
  const std::string n = b["name"].get<std::string>();
  // Prefill the prompt: a one-token completion whose prompt state is kept.
  json creq = {{"prompt", b.contains("prompt") ? b["prompt"] : json("")}, {"max_tokens", 1}, {"temperature", 0}};
  auto job = std::make_shared<Job>();
  if (auto e = parse_completion_params(creq, false, opt.limits, &job->p)) return ex->respond(error_response(*e));
  if (job->p.prompts.size() != 1)
    return ex->respond(error_response(
        api_error(400, "a session is made from one prompt", "invalid_request_error", "", "prompt")));
  if (auto e = check_prompt_bytes(job->p)) return ex->respond(error_response(*e));
  if (draining.load()) return ex->respond(busy_response(503, "the server is shutting down", "server_shutdown"));
  // Admitted like any request: it takes a slot for its prefill. Tokenizing runs after, off
  // the event loops (as for completions).
  if (!admit(1)) {
    rejected_429.fetch_add(1);
    return ex->respond(busy_response(429, "the server is at capacity; retry shortly", "rate_limit_exceeded"));
  }
  if (!prep->post([this, job, ex, n] { start_session_create(job, ex, n); })) {
    outstanding.fetch_sub(1);
    jobs_cv.notify_all();
    return ex->respond(busy_response(503, "the server is shutting down", "server_shutdown"));
  }
}

void Server::Impl::start_session_create(const std::shared_ptr<Job>& job, const http::ExchangePtr& ex,
                                        const std::string& n) {
  job->eos = tok.eos_id();
  if (auto e = tokenize(*job)) {
    outstanding.fetch_sub(1);
    jobs_cv.notify_all();
    return ex->respond(error_response(*e));
  }
  struct Pending {
    SnapshotPtr snap;
    uint64_t ticket = 0;
    std::vector<int32_t> prompt;
  };
  auto pend = std::make_shared<Pending>();
  pend->prompt = job->parts[0].prompt;
  const int64_t bound =
      engine->slot_bytes() + model.config().vocab_size * 4 + 8 * static_cast<int64_t>(pend->prompt.size()) + 64;
  Status rs = sessions.reserve(n, bound, &pend->ticket);
  if (!rs.is_ok()) {
    outstanding.fetch_sub(1);
    jobs_cv.notify_all();
    rejected_429.fetch_add(1);
    return ex->respond(busy_response(429, rs.message(), "too_many_sessions"));
  }
  Request r;
  r.initial_state = nullptr;
  r.prompt = pend->prompt;
  r.use_cache = r.cache_prompt_state = cache_on(*job);
  r.max_tokens = 1;
  r.sampling.temperature = 0;
  r.eos_id = -1;
  r.capture_prompt_state = true;
  r.on_prompt_state = [pend](RequestId, const SnapshotPtr& st) { pend->snap = st; };
  // The engine thread answers when the prefill is done: no HTTP thread waits for it.
  r.on_finish = [this, pend, ex, n](const FinishInfo&) {
    outstanding.fetch_sub(1);
    jobs_cv.notify_all();
    if (!pend->snap) {
      sessions.release(pend->ticket);
      return ex->respond(error_response(api_error(500, "the prompt could not be prefilled", "server_error")));
    }
    Session s{pend->prompt, pend->snap};
    json out = session_json(n, s);
    sessions.commit(pend->ticket, std::move(s));
    ex->respond(json_response(200, out));
  };
  RequestId id;
  Status st = engine->submit(std::move(r), &id);
  if (!st.is_ok()) {
    outstanding.fetch_sub(1);
    jobs_cv.notify_all();
    sessions.release(pend->ticket);
    return ex->respond(error_response(api_error(400, st.message(), "invalid_request_error")));
  }
  kick();
}

void Server::Impl::file_queue_full(const http::ExchangePtr& ex) {
  rejected_429.fetch_add(1);
  ex->respond(busy_response(429,
                            "too many session saves and restores are waiting (at most " +
                                std::to_string(opt.max_file_queue) + "); retry shortly",
                            "file_queue_full"));
}

void Server::Impl::handle_session_op(const http::Request& req, const http::ExchangePtr& ex, const std::string& n,
                                     const std::string& op) {
  if (!valid_session_name(n))
    return ex->respond(error_response(api_error(400, "invalid session name", "invalid_request_error", "", "name")));
  const auto memory_only = [&] {
    ex->respond(error_response(api_error(400, "this server keeps sessions in memory only (start it with --session-dir)",
                                         "invalid_request_error")));
  };
  if (op == "restore") {
    if (!sessions.has_dir()) return memory_only();
    // Reading and checking a file (up to a state's size: 29.5 MB for laplace-3b) is file
    // work: off the event loop.
    const bool queued = run_file_work([this, ex, n] {
      Session s;
      Status st = sessions.read(n, [&](const std::string& path) { return session_file_read(path, session_format(), &s); });
      if (!st.is_ok())
        return ex->respond(error_response(api_error(st.code() == Status::Code::kNotFound ? 404 : 400, st.message(),
                                                    "invalid_request_error", "session_file_invalid")));
      json out = session_json(n, s);
      Status put = sessions.put(n, std::move(s));  // the caps hold for restored sessions too
      if (!put.is_ok()) {
        rejected_429.fetch_add(1);
        return ex->respond(busy_response(429, put.message(), "too_many_sessions"));
      }
      ex->respond(json_response(200, out));
    });
    if (!queued) return file_queue_full(ex);
    return;
  }
  if (req.method == "DELETE") {
    // From memory; with ?file=true its saved file too (removed in its turn, after a save in
    // progress: file work, off the event loop). Without it the file stays, so a session can
    // be dropped from memory and restored later; the answer says whether a file is kept.
    const bool in_memory = sessions.erase(n);
    const std::string query = req.target.find('?') == std::string::npos ? "" : req.target.substr(req.target.find('?') + 1);
    const bool with_file = query == "file=true" || query == "file=1";
    const auto gone = [ex, n] {
      ex->respond(error_response(
          api_error(404, "session '" + n + "' does not exist", "invalid_request_error", "session_not_found")));
    };
    if (!with_file || !sessions.has_dir()) {
      if (!in_memory) return gone();
      json out = {{"name", n}, {"object", "session"}, {"deleted", true}};
      if (sessions.has_dir()) {
        std::error_code ec;
        out["file_kept"] = std::filesystem::exists(sessions.path(n), ec);
      }
      return ex->respond(json_response(200, out));
    }
    const bool queued = run_file_work([this, ex, n, in_memory, gone] {
      bool removed = false;
      Status st = sessions.remove_file(n, &removed);
      if (!st.is_ok()) return ex->respond(error_response(api_error(500, st.message(), "server_error")));
      if (!in_memory && !removed) return gone();
      ex->respond(json_response(
          200, json{{"name", n}, {"object", "session"}, {"deleted", true}, {"file_deleted", removed}}));
    });
    if (!queued) return file_queue_full(ex);
    return;
  }
  if (!(req.method == "GET" || req.method == "HEAD") && op != "fork" && op != "save")
    return ex->respond(error_response(api_error(404, "unknown session operation", "invalid_request_error")));
  // What to do with the session once it is found (on the event loop, or on a file thread).
  auto act = [this, ex, n, op, method = req.method, body = req.body](Session s) {
    if (method == "GET" || method == "HEAD") {
      json out = session_json(n, s);
      std::string text;
      if (tok.decode(s.context, &text).is_ok()) out["text"] = text;
      out["token_ids"] = s.context;
      return ex->respond(json_response(200, out));
    }
    if (op == "fork") {
      json b = json::parse(body, nullptr, false);
      if (b.is_discarded() || !b.is_object() || !b.contains("name") || !b["name"].is_string() ||
          !valid_session_name(b["name"].get<std::string>()))
        return ex->respond(
            error_response(api_error(400, "fork needs {\"name\": NEW_NAME}", "invalid_request_error", "", "name")));
      const std::string to = b["name"].get<std::string>();
      Session copy = s;  // snapshots are immutable: a fork shares its state until it moves on
      copy.base_version = -1;  // new content under its name: its save replaces what is saved there
      copy.changed = true;
      json out = session_json(to, copy);
      Status st = sessions.put(to, std::move(copy));
      if (!st.is_ok()) {
        rejected_429.fetch_add(1);
        return ex->respond(busy_response(429, st.message(), "too_many_sessions"));
      }
      return ex->respond(json_response(200, out));
    }
    ex->respond(error_response(api_error(500, "unknown session operation", "server_error")));
  };
  if (op == "save") {
    if (!sessions.has_dir()) return memory_only();
    // In its turn across every replica sharing the directory; refused (409) when another
    // saved the name since this replica's copy was read.
    const bool queued = run_file_work([this, ex, n] {
      Session s;
      int64_t version = 0;
      Status st = sessions.save(
          n, [this](const std::string& path, Session* out) { return session_file_read(path, session_format(), out); },
          [this](const std::string& path, const Session& s, int64_t v) {
            return session_file_write(path, s, session_format(), v);
          },
          &s, &version);
      if (!st.is_ok()) return ex->respond(session_error(st));
      json out = session_json(n, s);
      out["file"] = n + ".session";  // in --session-dir; where that is stays the server's
      ex->respond(json_response(200, out));
    });
    if (!queued) return file_queue_full(ex);
    return;
  }
  if (!sessions.has_dir()) {
    if (op == "save") return memory_only();
    std::optional<Session> it = sessions.get(n);
    if (!it)
      return ex->respond(error_response(
          api_error(404, "session '" + n + "' does not exist", "invalid_request_error", "session_not_found")));
    return act(std::move(*it));
  }
  // With a directory (perhaps shared by a fleet), the session as this replica should use
  // it: memory's, or the saved one when memory has none or an older unchanged copy.
  const bool queued = run_file_work([this, ex, n, act] {
    Session s;
    Status st = sessions.current(n, [this](const std::string& path, Session* out) {
      return session_file_read(path, session_format(), out);
    }, &s);
    if (!st.is_ok()) return ex->respond(session_error(st));
    act(std::move(s));
  });
  if (!queued) return file_queue_full(ex);
}

ApiError Server::Impl::session_api_error(const Status& st) {
  switch (st.code()) {
    case Status::Code::kNotFound:
      return api_error(404, st.message(), "invalid_request_error", "session_not_found");
    case Status::Code::kConflict:
      return api_error(409, st.message(), "invalid_request_error", "session_conflict");
    case Status::Code::kOutOfMemory:
      if (st.message().find("session directory") != std::string::npos)
        return api_error(507, st.message(), "server_error", "session_storage_full");
      rejected_429.fetch_add(1);
      return api_error(429, st.message(), "invalid_request_error", "too_many_sessions");
    case Status::Code::kCorrupt:
    case Status::Code::kInvalidArgument:
      return api_error(400, st.message(), "invalid_request_error", "session_file_invalid");
    default:
      return api_error(500, st.message(), "server_error");
  }
}

http::Response Server::Impl::session_error(const Status& st) {
  const ApiError e = session_api_error(st);
  if (e.http_status == 429) return busy_response(429, e.message, e.code);  // with Retry-After
  return error_response(e);
}

// ---- metrics --------------------------------------------------------------------------------

std::string Server::Impl::metrics_text() {
  std::string out;
  const bool up = ready.load();
  render_metric(&out, "laplace_ready", "gauge", "1 when the model is loaded.", up ? 1 : 0);
  {
    // Which replica and model these figures are of (a fleet is scraped replica by replica).
    auto label = [](const std::string& v) {
      std::string e;
      for (char c : v) e += c == '\\' ? "\\\\" : c == '"' ? "\\\"" : c == '\n' ? "\\n" : std::string(1, c);
      return e;
    };
    out += "# HELP laplace_replica_info This replica's id, the model it serves and the model's hash.\n"
           "# TYPE laplace_replica_info gauge\n"
           "laplace_replica_info{replica=\"" + label(replica) + "\",model=\"" + label(name) + "\",model_hash=\"" +
           label(up ? model_hash : "") + "\"} 1\n";
  }
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
  render_metric(&out, "laplace_generation_tokens_total", "counter", "Generated tokens.", generation_tokens_total.load());
  render_metric(&out, "laplace_http_requests_total", "counter", "HTTP requests received.", http_requests.load());
  render_metric(&out, "laplace_http_connections", "gauge", "Open HTTP connections.",
                static_cast<double>(http ? http->connections() : 0));
  render_metric(&out, "laplace_requests_rejected_total", "counter", "Requests answered 429.", rejected_429.load());
  render_metric(&out, "laplace_client_disconnects_total", "counter", "Requests cancelled because the client left.",
                disconnects.load());
  render_metric(&out, "laplace_requests_admitted", "gauge",
                "Engine requests admitted and not finished (an n-choice request counts n): what the admission "
                "limit (slots + queue) counts.",
                static_cast<double>(outstanding.load()));
  render_metric(&out, "laplace_sessions", "gauge", "Named sessions in memory.", static_cast<double>(sessions.count()));
  render_metric(&out, "laplace_sessions_reserved", "gauge",
                "Room reserved for sessions that running requests will save (counted against the caps).",
                static_cast<double>(sessions.reserved_count()));
  render_metric(&out, "laplace_session_reserved_bytes", "gauge", "Host bytes reserved for those sessions.",
                static_cast<double>(sessions.reserved_bytes()));
  render_metric(&out, "laplace_session_bytes", "gauge", "Host bytes held by named sessions.",
                static_cast<double>(sessions.bytes()));
  render_metric(&out, "laplace_session_files", "gauge", "Session files in --session-dir.",
                static_cast<double>(sessions.disk_files()));
  render_metric(&out, "laplace_session_file_bytes", "gauge", "Bytes of the session files in --session-dir.",
                static_cast<double>(sessions.disk_bytes()));
  render_metric(&out, "laplace_process_resident_bytes", "gauge", "Resident memory of the server process.",
                static_cast<double>(process_resident_bytes()));
  ttft.render(&out);
  itl.render(&out);
  e2e.render(&out);
  queue_time.render(&out);
  return out;
}

}  // namespace laplace
