// `laplace serve`'s lifetime (serve/http/server.h): start, model loading, the engine thread,
// file work, stop and the graceful stop. The routes are in serve/http/routes.cpp, completions
// in serve/http/jobs.cpp, sessions in serve/sessions.cpp, the transport in serve/http/http_server.cpp.
#include "serve/http/server.h"

#include <chrono>
#include <cstdio>
#include <filesystem>

#include <unistd.h>

#include "core/file_util.h"
#include "model/config.h"
#include "serve/http/server_impl.h"

namespace laplace {

namespace fs = std::filesystem;

Server::Impl::Impl(ServerOptions o)
    : opt(std::move(o)),
      sessions(SessionLimits{opt.max_sessions, opt.max_session_bytes, opt.max_session_disk_bytes,
                             opt.max_session_files},
               opt.session_dir) {
  opt.engine.cache_host_bytes = opt.cache_bytes;
}

Status Server::Impl::load() {
  const fs::path dir(opt.model_dir);
  if (!fs::is_directory(dir)) return Status::not_found("model directory " + opt.model_dir + " does not exist");
  Config cfg;
  LAPLACE_RETURN_IF_ERROR(config_load((dir / "config.json").string(), &cfg));
  config_fingerprint = std::to_string(std::hash<std::string>{}(cfg.to_json()));
  if (!fs::exists(dir / "tokenizer.model"))
    return Status::not_found("the model directory has no tokenizer.model (the server speaks text)");
  LAPLACE_RETURN_IF_ERROR(Tokenizer::load((dir / "tokenizer.model").string(), &tok));
  for (int32_t id = 0; id < static_cast<int32_t>(tok.vocab_size()); ++id) {
    std::string text;
    // + 1: a piece's leading space may be dropped when it is decoded alone.
    if (tok.decode_bytes({id}, &text).is_ok()) max_token_bytes = std::max<int64_t>(max_token_bytes, text.size() + 1);
  }
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
  LAPLACE_RETURN_IF_ERROR(hash_files({(dir / "config.json").string(), (dir / "model.safetensors").string(),
                                      (dir / "tokenizer.model").string()},
                                     &model_hash));
  LAPLACE_RETURN_IF_ERROR(Engine::create(model, opt.engine, &engine));
  std::string summary = engine->summary() + "\n";
  for (size_t at = 0, nl; (nl = summary.find('\n', at)) != std::string::npos; at = nl + 1)
    std::fprintf(stderr, "laplace serve: %s\n", summary.substr(at, nl - at).c_str());
  return Status::ok();
}

SessionFormat Server::Impl::session_format() const {
  SessionFormat f;
  f.config = &model.config();
  f.fingerprint = config_fingerprint;
  f.model_hash = model_hash;
  f.replica = replica;
  f.state_dtype = engine->pool().dtype();
  f.pending = PendingSpec{engine->pool().pending_steps(), model.dtype()};
  f.pool = &engine->pool();
  return f;
}

void Server::Impl::engine_loop() {
  while (true) {
    bool counted = false;
    {
      std::unique_lock<std::mutex> lk(wake_mu);
      wake_cv.wait(lk, [&] {
        return stopping.load() || (!held && (wake || !engine->idle())) || (held && steps_left > 0);
      });
      wake = false;
      if (stopping.load()) break;
      counted = held;
    }
    engine->step();
    flush_dirty();
    if (counted) {
      {
        std::lock_guard<std::mutex> lk(wake_mu);
        steps_left = std::max(steps_left - 1, 0);
      }
      step_cv.notify_all();
    }
  }
  step_cv.notify_all();
}

void Server::Impl::flush_dirty() {
  if (dirty_jobs.empty()) return;
  std::vector<http::ExchangePtr> xs;
  xs.reserve(dirty_jobs.size());
  for (auto& j : dirty_jobs) {
    j->dirty.store(false);
    if (j->ex) xs.push_back(j->ex);
  }
  dirty_jobs.clear();
  http::wake_all(xs);  // one task per event loop for the whole step
}

void Server::Impl::kick() {
  {
    std::lock_guard<std::mutex> lk(wake_mu);
    wake = true;
  }
  wake_cv.notify_one();
}

bool Server::Impl::admit(int64_t n) {
  // A bounded queue: the slots plus max_queue waiting requests.
  const int64_t limit = admission_limit();
  int64_t cur = outstanding.load();
  do {
    if (cur + n > limit) return false;
  } while (!outstanding.compare_exchange_weak(cur, cur + n));
  return true;
}

bool Server::Impl::run_file_work(std::function<void()> f) { return files->post(std::move(f)); }

Server::Server(ServerOptions o) : impl_(std::make_unique<Impl>(std::move(o))) {}

Server::~Server() { stop(); }

Status Server::start() {
  Impl& m = *impl_;
  m.name = m.opt.model_name.empty() ? fs::path(m.opt.model_dir).lexically_normal().filename().string()
                                    : m.opt.model_name;
  if (m.name.empty() || m.name == ".") m.name = "laplace";
  // What crashed writers left: session temporaries, and in the model directory (a training
  // run's output, often) the trainer's checkpoint.safetensors.tmp.* and the like.
  add_redacted_root(m.opt.model_dir);
  add_redacted_root(m.opt.session_dir);
  int64_t removed = 0;
  LAPLACE_RETURN_IF_ERROR(m.sessions.open_dir(&removed));
  if (fs::is_directory(m.opt.model_dir)) removed += remove_stale_temporaries(m.opt.model_dir);
  if (removed > 0)
    std::fprintf(stderr, "laplace serve: removed %lld temporary files left by processes that died mid-write\n",
                 (long long)removed);
  http::Options ho;
  ho.host = m.opt.host;
  ho.port = m.opt.port;
  ho.threads = std::clamp(m.opt.threads, 1, 64);
  ho.header_timeout_s = m.opt.read_timeout_s;
  ho.body_timeout_s = m.opt.read_timeout_s;
  ho.write_timeout_s = m.opt.write_timeout_s;
  ho.max_body_bytes = m.opt.max_request_bytes;
  ho.max_connections = m.opt.max_connections;
  m.http = std::make_unique<HttpServer>(
      ho, [&m](const http::Request& r) { return m.check_head(r); },
      [&m](http::Request&& r, http::ExchangePtr ex) { m.route(std::move(r), std::move(ex)); },
      [&m](const http::Request& r) {
        std::vector<http::Header> h = m.cors_headers(r);
        h.push_back({"X-Laplace-Replica", m.replica});  // which replica answered, behind a balancer
        return h;
      });
  Status st = m.http->listen();
  if (!st.is_ok()) return st;
  m.replica = m.opt.replica_id;
  if (m.replica.empty()) {
    char host[256] = {0};
    if (::gethostname(host, sizeof(host) - 1) != 0 || host[0] == 0) std::snprintf(host, sizeof(host), "localhost");
    m.replica = std::string(host) + ":" + std::to_string(m.http->port());
  }
  m.files = std::make_unique<WorkQueue>(2, std::max<int64_t>(m.opt.max_file_queue, 1));
  m.prep = std::make_unique<WorkQueue>(2, 0);
  m.http->start();
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

int Server::port() const { return impl_->http ? impl_->http->port() : 0; }

void Server::hold_engine(bool held) {
  Impl& m = *impl_;
  {
    std::lock_guard<std::mutex> lk(m.wake_mu);
    m.held = held;
  }
  m.wake_cv.notify_all();
  m.step_cv.notify_all();
}

void Server::step_engine(int steps) {
  Impl& m = *impl_;
  if (!m.ready.load()) return;
  std::unique_lock<std::mutex> lk(m.wake_mu);
  if (!m.held) return;
  m.steps_left = std::max(steps, 0);
  m.wake_cv.notify_all();
  m.step_cv.wait(lk, [&] { return m.steps_left == 0 || m.stopping.load() || !m.held; });
}

void Server::stop() {
  Impl& m = *impl_;
  {
    std::lock_guard<std::mutex> lk(m.stop_mu);
    if (m.stopped) return;
    m.stopped = true;
  }
  if (m.http) m.http->stop();  // running answers are aborted: their engine work is cancelled
  if (m.loader.joinable()) m.loader.join();
  m.stopping.store(true);
  m.wake_cv.notify_all();
  if (m.engine_thread.joinable()) m.engine_thread.join();
  if (m.prep) m.prep->stop();
  if (m.files) m.files->stop();
  m.stop_cv.notify_all();
}

void Server::shutdown(double grace_seconds) {
  Impl& m = *impl_;
  m.draining.store(true);
  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(std::max(grace_seconds, 0.0)));
  {
    std::unique_lock<std::mutex> lk(m.jobs_mu);
    m.jobs_cv.wait_until(lk, deadline, [&] { return m.live_jobs.empty() && m.outstanding.load() == 0; });
  }
  // The grace is over: what still runs ends now, each answer with an error its client can
  // read (never an empty 200).
  std::vector<std::shared_ptr<Job>> left;
  {
    std::lock_guard<std::mutex> lk(m.jobs_mu);
    for (auto& [serial, w] : m.live_jobs)
      if (auto j = w.lock()) left.push_back(j);
  }
  for (auto& j : left) {
    {
      std::lock_guard<std::mutex> lk(j->mu);
      if (!j->all_finished()) j->cut = true;
    }
    if (m.ready.load()) m.cancel_job(j);
    if (j->ex) j->ex->wake();
  }
  {
    // Bounded: a client that does not read is dropped by the write deadline anyway.
    std::unique_lock<std::mutex> lk(m.jobs_mu);
    m.jobs_cv.wait_for(lk, std::chrono::seconds(std::max(2, m.opt.write_timeout_s)),
                       [&] { return m.live_jobs.empty(); });
  }
  stop();
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
  c.connections = m.http ? m.http->connections() : 0;
  c.sessions = m.sessions.count();
  c.sessions_reserved = m.sessions.reserved_count();
  return c;
}

}  // namespace laplace
