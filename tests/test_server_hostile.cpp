// The server (serve/http/server.h) under hostile clients (issue 52), over real sockets on
// 127.0.0.1: clients that leave at every stage of a request give back all they held,
// requests are bounded before admission, the server is safe by default on localhost, and
// the protocol is strict.
#ifdef LAPLACE_HAVE_SERVER

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <thread>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "serve/http/server.h"
#include "tests/http_client.h"
#include "tests/server_test_util.h"
#include "tests/test_util.h"

namespace laplace {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;
namespace httpc = laplace::testing::httpc;
using namespace laplace::testing::srv;

// A server on a small random-weight model (V = 400) with a trained tokenizer; removed with
// its directory at the end.
class TestServer {
 public:
  explicit TestServer(ServerOptions o, const std::string& tag = "hostile_model", bool session_dir = false,
                      const std::string& session_subdir = "sessions") {
    dir_ = testing::make_server_model_dir(tag, 52);
    o.model_dir = dir_;
    if (session_dir) o.session_dir = dir_ + "/" + session_subdir;
    o.model_name = "tiny";
    o.port = 0;
    srv_ = std::make_unique<Server>(o);
    ok_ = srv_->start().is_ok() && srv_->wait_ready().is_ok();
  }
  ~TestServer() {
    srv_->stop();
    srv_.reset();
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  bool ok() const { return ok_; }
  Server& operator*() { return *srv_; }
  Server* operator->() { return srv_.get(); }
  int port() const { return srv_->port(); }
  const std::string& dir() const { return dir_; }
  httpc::Client client() const {
    httpc::Client c("127.0.0.1", srv_->port());
    c.set_read_timeout(60, 0);
    return c;
  }
  std::string metrics() const {
    auto c = client();
    auto r = c.Get("/metrics");
    return r ? r->body : "";
  }

 private:
  std::string dir_;
  std::unique_ptr<Server> srv_;
  bool ok_ = false;
};

// ==== 1. no leaked capacity when a client goes away ===================================================

// Where a request is when its client leaves, as engine steps run (a 64-token prompt in
// 16-token pieces, one piece per step: the prefill takes steps 1-4, the first token comes at
// step 4, the 8th and last token of choice 0 at step 11).
enum class Stage { kQueued, kMidPrefill, kFirstToken, kMidStream, kBeforeLastToken, kAnswerDone };
const char* stage_name(Stage s) {
  switch (s) {
    case Stage::kQueued: return "queued";
    case Stage::kMidPrefill: return "mid-prefill";
    case Stage::kFirstToken: return "first token";
    case Stage::kMidStream: return "mid-stream";
    case Stage::kBeforeLastToken: return "before the last token (and the save)";
    case Stage::kAnswerDone: return "answer done, unread";
  }
  return "?";
}
int steps_to(Stage s) {
  switch (s) {
    case Stage::kQueued: return 0;
    case Stage::kMidPrefill: return 2;
    case Stage::kFirstToken: return 4;
    case Stage::kMidStream: return 6;
    case Stage::kBeforeLastToken: return 10;
    case Stage::kAnswerDone: return -1;
  }
  return 0;
}

// A client that disconnects at any stage of a request — queued, mid-prefill, at its first
// token, mid-stream, just before the step that ends it and saves its session, or after its
// answer — for n = 1..4, streamed or not, with and without save_session, leaves nothing
// behind: no admission unit (the job's callbacks had returned early once the job was
// freed, leaking n − 1 units each time until an idle server answered every request 429), no
// session reservation (three abandoned save_session requests had filled --max-sessions 3
// for good), and a graceful stop does not wait for work that is not there.
TEST(ServerHostile, ClientsLeavingAtAnyStageGiveBackEverySlotAndReservation) {
  ServerOptions o;
  o.engine.max_slots = 2;
  o.engine.prefill_chunk = 16;
  o.engine.max_batch_tokens = 16;  // one prefill piece per step: the stages are steps apart
  o.engine.cache_slots = 0;        // no cache hit may skip a prefill
  o.cache_bytes = 0;
  o.max_queue = 6;                 // 8 engine requests at once
  o.max_sessions = 3;
  o.limits.max_n = 4;
  o.write_timeout_s = 5;
  TestServer s(o);
  ASSERT_TRUE(s.ok());
  std::vector<int> prompt;
  for (int i = 0; i < 64; ++i) prompt.push_back(5 + (i * 7) % 300);

  int case_no = 0;
  for (Stage stage : {Stage::kQueued, Stage::kMidPrefill, Stage::kFirstToken, Stage::kMidStream,
                      Stage::kBeforeLastToken, Stage::kAnswerDone}) {
    for (bool stream : {true, false}) {
      for (int n = 1; n <= 5; ++n) {
        const bool save = n == 5;  // save_session needs n = 1
        const int choices = save ? 1 : n;
        const std::string what = std::string(stage_name(stage)) + (stream ? ", streamed" : ", whole") +
                                 ", n = " + std::to_string(choices) + (save ? ", save_session" : "");
        SCOPED_TRACE(what);
        json body = {{"prompt", prompt}, {"max_tokens", 8},    {"ignore_eos", true},
                     {"n", choices},     {"stream", stream},   {"temperature", 0.5}};
        const std::string session = "left" + std::to_string(case_no++);
        if (save) body["save_session"] = session;
        const int64_t left_before = s->counters().client_disconnects;
        s->hold_engine(true);
        const int fd = connect_local(s.port());
        ASSERT_GE(fd, 0);
        ASSERT_TRUE(send_all(fd, http_post("/v1/completions", body.dump())));
        ASSERT_TRUE(eventually([&] { return s->counters().engine.queued == 1; }, 30)) << "never admitted";
        if (stage == Stage::kAnswerDone) {
          s->hold_engine(false);
          ASSERT_TRUE(eventually([&] { return s->counters().outstanding == 0; }, 60));
          close_abruptly(fd);
        } else {
          s->step_engine(steps_to(stage));
          close_abruptly(fd);
          // The server notices at its next write (a keep-alive or a space within 0.5 s)
          // and cancels what is left, while the engine still stands at the stage.
          EXPECT_TRUE(eventually([&] { return s->counters().client_disconnects > left_before; }, 30));
          s->hold_engine(false);
        }
        const bool clean = eventually([&] {
          const ServerCounters c = s->counters();
          return c.outstanding == 0 && c.engine.running == 0 && c.engine.queued == 0 && c.sessions_reserved == 0;
        }, 30);
        const ServerCounters c = s->counters();
        EXPECT_TRUE(clean) << "left behind: " << c.outstanding << " admitted, " << c.engine.running << " running, "
                           << c.engine.queued << " queued, " << c.sessions_reserved << " session reservations";
        if (!clean) return;  // the next cases would only repeat it
        auto cl = s.client();
        cl.Delete("/v1/sessions/" + session);  // kept when the answer was done: not a leak
      }
    }
  }

  // /metrics says so too.
  const std::string m = s.metrics();
  EXPECT_EQ(metric(m, "laplace_requests_running"), 0);
  EXPECT_EQ(metric(m, "laplace_requests_waiting"), 0);
  EXPECT_EQ(metric(m, "laplace_requests_admitted"), 0) << m;
  EXPECT_EQ(metric(m, "laplace_sessions"), 0);
  EXPECT_EQ(metric(m, "laplace_sessions_reserved"), 0);
  EXPECT_EQ(metric(m, "laplace_session_reserved_bytes"), 0);

  // A burst at full capacity is accepted: 8 engine requests, 3 of them saving sessions.
  s->hold_engine(true);
  std::vector<int> fds;
  for (int i = 0; i < 8; ++i) {
    json body = {{"prompt", "burst " + std::to_string(i)}, {"max_tokens", 3}, {"stream", true}};
    if (i < 3) body["save_session"] = "kept" + std::to_string(i);
    const int fd = connect_local(s.port());
    ASSERT_GE(fd, 0);
    ASSERT_TRUE(send_all(fd, http_post("/v1/completions", body.dump(), "Connection: close\r\n")));
    char head[16] = {};
    ASSERT_GT(read(fd, head, 12), 0);
    EXPECT_EQ(std::string(head, 12), "HTTP/1.1 200") << "request " << i << " of the burst";
    fds.push_back(fd);
  }
  s->hold_engine(false);
  for (int fd : fds) {
    EXPECT_NE(read_until_close(fd, 30).find("data: [DONE]"), std::string::npos);
    close(fd);
  }
  EXPECT_TRUE(eventually([&] { return s->counters().sessions == 3 && s->counters().outstanding == 0; }, 30));

  // And a graceful stop of an idle server does not wait out its grace.
  const auto t0 = std::chrono::steady_clock::now();
  s->shutdown(60);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 10);
}

// ==== 2. bounded work before admission =================================================================

// A prompt longer in bytes than --max-prompt-tokens tokens can hold is refused by its size,
// before it is tokenized (a 1 MiB prompt had been tokenized on an event-loop thread first).
TEST(ServerBounded, OversizedPromptIsRefusedByItsBytesBeforeTokenizing) {
  ServerOptions o;
  o.engine.max_slots = 1;
  o.max_prompt_tokens = 100;
  o.max_request_bytes = 2 << 20;
  TestServer s(o);
  ASSERT_TRUE(s.ok());
  const std::string huge(1 << 20, 'a');
  for (const json& body : {json{{"prompt", huge}}, json{{"prompt", {"the quick", huge}}}}) {
    auto c = s.client();
    auto r = c.Post("/v1/completions", body.dump(), "application/json");
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 400) << r->body.substr(0, 300);
    const json e = json::parse(r->body, nullptr, false);
    EXPECT_EQ(e["error"]["code"], "context_length_exceeded") << r->body.substr(0, 300);
    EXPECT_NE(r->body.find("bytes"), std::string::npos) << "refused by its size: " << r->body.substr(0, 300);
  }
  auto c = s.client();
  auto chat = c.Post("/v1/chat/completions", json{{"messages", {{{"role", "user"}, {"content", huge}}}}}.dump(),
                     "application/json");
  ASSERT_TRUE(chat);
  EXPECT_EQ(chat->status, 400);
  EXPECT_NE(chat->body.find("bytes"), std::string::npos) << chat->body.substr(0, 300);
  // A prompt within the cap is served as before.
  auto ok = c.Post("/v1/completions", json{{"prompt", "the quick"}, {"max_tokens", 2}}.dump(), "application/json");
  ASSERT_TRUE(ok);
  EXPECT_EQ(ok->status, 200) << ok->body;
}

// Tokenizing runs off the event loops: with one event-loop thread, /health answers at once
// while long prompts are tokenized (it had waited for each of them).
TEST(ServerBounded, TokenizingLongPromptsDoesNotStallTheEventLoop) {
  ServerOptions o;
  o.engine.max_slots = 1;
  o.max_queue = 8;
  o.threads = 1;
  o.max_prompt_tokens = 4 << 20;
  o.max_request_bytes = 4 << 20;
  TestServer s(o);
  ASSERT_TRUE(s.ok());
  // Text that the tokenizer splits into many pieces (no long merges).
  std::string text;
  for (int i = 0; text.size() < (1u << 20); ++i) {
    text += 'q';
    text += std::to_string(i % 97);
    text += "z ";
  }
  s->hold_engine(true);  // what matters is the tokenizing, not the prefill
  std::vector<int> fds;
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < 3; ++i) {
    const int fd = connect_local(s.port());
    ASSERT_GE(fd, 0);
    ASSERT_TRUE(send_all(fd, http_post("/v1/completions", json{{"prompt", text}, {"max_tokens", 1}}.dump(),
                                       "Connection: close\r\n")));
    fds.push_back(fd);
  }
  // /health, while they are tokenized.
  double worst = 0;
  int asked = 0;
  while (s->counters().outstanding < 3 || s->counters().engine.queued < 3) {
    const auto h0 = std::chrono::steady_clock::now();
    const std::string r = raw_exchange(s.port(), "GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
    worst = std::max(worst, std::chrono::duration<double>(std::chrono::steady_clock::now() - h0).count());
    ++asked;
    if (std::chrono::steady_clock::now() - t0 > std::chrono::seconds(120)) break;
  }
  const double tokenizing = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(s->counters().engine.queued, 3);
  // Meaningful only if tokenizing took long enough to see: it does (seconds on 2 cores).
  EXPECT_GT(tokenizing, 0.2) << "the prompts were tokenized too fast to tell";
  EXPECT_LT(worst, std::max(0.5, tokenizing / 3)) << asked << " /health calls in " << tokenizing << " s";
  s->hold_engine(false);
  for (int fd : fds) close_abruptly(fd);
}

// Session saves and restores wait in a bounded queue: a burst of saves past it is answered
// 429 + Retry-After at once (2,000 saves had all been queued, and an unrelated restore
// waited 18 s behind them), and a restore meanwhile is answered promptly.
TEST(ServerBounded, SessionFileWorkHasABoundedQueue) {
  ServerOptions o;
  o.engine.max_slots = 2;
  o.max_file_queue = 4;
  o.threads = 8;
  TestServer s(o, "hostile_files_model", /*session_dir=*/true);
  ASSERT_TRUE(s.ok());
  std::vector<int> ids;
  for (int i = 0; i < 600; ++i) ids.push_back(5 + (i * 13) % 390);
  auto c = s.client();
  for (const char* name : {"big", "other"}) {
    auto r = c.Post("/v1/sessions", json{{"name", name}, {"prompt", ids}}.dump(), "application/json");
    ASSERT_TRUE(r && r->status == 200) << (r ? r->body : "no answer");
  }
  auto saved = c.Post("/v1/sessions/other/save", "{}", "application/json");
  ASSERT_TRUE(saved && saved->status == 200) << (saved ? saved->body : "no answer");
  // 200 saves of one session, all sent at once.
  std::vector<int> fds;
  for (int i = 0; i < 200; ++i) {
    const int fd = connect_local(s.port());
    ASSERT_GE(fd, 0);
    ASSERT_TRUE(send_all(fd, http_post("/v1/sessions/big/save", "{}", "Connection: close\r\n")));
    fds.push_back(fd);
  }
  // An unrelated restore meanwhile: answered at once, or told to come back at once.
  const auto t0 = std::chrono::steady_clock::now();
  int restore_status = 0;
  while (std::chrono::steady_clock::now() - t0 < std::chrono::seconds(30)) {
    auto r = c.Post("/v1/sessions/other/restore", "{}", "application/json");
    ASSERT_TRUE(r);
    restore_status = r->status;
    if (r->status != 429) break;
    EXPECT_EQ(r->get_header_value("Retry-After"), "1");
  }
  EXPECT_EQ(restore_status, 200);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 10);
  int ok = 0, busy = 0;
  for (int fd : fds) {
    const std::string raw = read_until_close(fd, 60);
    close(fd);
    const int st = status_of(raw);
    if (st == 200) ++ok;
    if (st == 429) {
      ++busy;
      EXPECT_NE(raw.find("Retry-After: 1"), std::string::npos) << raw;
    }
    EXPECT_TRUE(st == 200 || st == 429) << raw;
  }
  EXPECT_GT(ok, 0);
  EXPECT_GT(busy, 0) << "all 200 saves were queued";
  // The file is one whole save.
  auto back = c.Post("/v1/sessions/big/restore", "{}", "application/json");
  ASSERT_TRUE(back);
  EXPECT_EQ(back->status, 200) << back->body;
}

// ==== 3. safe by default on localhost ==================================================================

// A whole raw request and its answer, for headers a test must choose itself.
std::string raw_request(int port, const std::string& method, const std::string& path, const std::string& headers,
                        const std::string& body = "") {
  std::string req = method + " " + path + " HTTP/1.1\r\n" + headers + "Connection: close\r\n";
  if (!body.empty() || method == "POST") req += "Content-Length: " + std::to_string(body.size()) + "\r\n";
  return raw_exchange(port, req + "\r\n" + body);
}

// With no API key (the default), a web page the user visits cannot drive the server: its
// cross-site text/plain POST (which a browser sends without asking) is refused and creates no
// session, a DNS name rebound to 127.0.0.1 cannot read one back, and a page of another origin
// gets no CORS answer. The server's own page, localhost and IP addresses work as before.
TEST(ServerLocalhost, CrossSitePagesCannotDriveAServerWithoutAKey) {
  ServerOptions o;
  o.engine.max_slots = 1;
  TestServer s(o);
  ASSERT_TRUE(s.ok());
  const int port = s.port();
  const std::string self = "127.0.0.1:" + std::to_string(port);
  const std::string make = R"({"name": "planted", "prompt": "the quick"})";
  // A form or no-cors fetch from evil.example: text/plain, with its Origin.
  std::string r = raw_request(port, "POST", "/v1/sessions",
                              "Host: " + self + "\r\nContent-Type: text/plain\r\nOrigin: http://evil.example\r\n", make);
  EXPECT_EQ(status_of(r), 403) << r;
  // The same without an Origin (a client that hides it): still not JSON.
  r = raw_request(port, "POST", "/v1/sessions", "Host: " + self + "\r\nContent-Type: text/plain\r\n", make);
  EXPECT_EQ(status_of(r), 415) << r;
  r = raw_request(port, "POST", "/v1/sessions", "Host: " + self + "\r\n", make);
  EXPECT_EQ(status_of(r), 415) << r;
  auto c = s.client();
  EXPECT_EQ(c.Get("/v1/sessions/planted")->status, 404) << "a cross-site POST made a session";
  // DNS rebinding: a name pointed at 127.0.0.1 by the page's owner.
  ASSERT_EQ(c.Post("/v1/sessions", R"({"name": "mine", "prompt": "the quick"})", "application/json")->status, 200);
  for (const std::string& host :
       std::vector<std::string>{"evil.example:" + std::to_string(port), "evil.example", "localhost.evil.example"}) {
    r = raw_request(port, "GET", "/v1/sessions/mine", "Host: " + host + "\r\n");
    EXPECT_EQ(status_of(r), 403) << host << ": " << r;
    EXPECT_EQ(r.find("the quick"), std::string::npos) << host;
  }
  r = raw_request(port, "GET", "/v1/sessions/mine", "");
  EXPECT_EQ(status_of(r), 400) << "HTTP/1.1 without Host: " << r;
  for (const std::string& host : std::vector<std::string>{self, "localhost:" + std::to_string(port), "LOCALHOST",
                                                         "[::1]:" + std::to_string(port), "127.0.0.1"}) {
    r = raw_request(port, "GET", "/v1/sessions/mine", "Host: " + host + "\r\n");
    EXPECT_EQ(status_of(r), 200) << host << ": " << r;
  }
  // CORS: none unless configured. A preflight from another origin is refused.
  r = raw_request(port, "OPTIONS", "/v1/completions",
                  "Host: " + self + "\r\nOrigin: http://evil.example\r\nAccess-Control-Request-Method: POST\r\n");
  EXPECT_EQ(status_of(r), 403) << r;
  EXPECT_EQ(r.find("Access-Control-Allow-Origin"), std::string::npos) << r;
  // The server's own page (same origin) is not a foreign origin.
  r = raw_request(port, "POST", "/v1/completions",
                  "Host: " + self + "\r\nOrigin: http://" + self + "\r\nContent-Type: application/json\r\n",
                  R"({"prompt": "the quick", "max_tokens": 2})");
  EXPECT_EQ(status_of(r), 200) << r;
  EXPECT_EQ(r.find("Access-Control-Allow-Origin"), std::string::npos) << r;
  // JSON with parameters is JSON.
  r = raw_request(port, "POST", "/v1/completions", "Host: " + self + "\r\nContent-Type: Application/JSON; charset=utf-8\r\n",
                  R"({"prompt": "the quick", "max_tokens": 2})");
  EXPECT_EQ(status_of(r), 200) << r;
}

// --allowed-hosts adds names; --cors-origin lets a named origin's pages call the API, with
// a preflight and Access-Control-Allow-Origin on every answer (errors included).
TEST(ServerLocalhost, AllowedHostsAndCorsOriginsAreHonoured) {
  ServerOptions o;
  o.engine.max_slots = 1;
  o.allowed_hosts = {"laplace.internal", ".corp.example"};
  o.cors_origins = {"https://app.example"};
  o.api_key = "k";
  TestServer s(o);
  ASSERT_TRUE(s.ok());
  const int port = s.port();
  for (const std::string host : {"laplace.internal:8000", "gpu1.corp.example", "Laplace.Internal"}) {
    const std::string r = raw_request(port, "GET", "/", "Host: " + host + "\r\n");  // the page: no key needed
    EXPECT_EQ(status_of(r), 200) << host << ": " << r;
  }
  EXPECT_EQ(status_of(raw_request(port, "GET", "/", "Host: corp.example.evil\r\n")), 403);
  const std::string pre = raw_request(port, "OPTIONS", "/v1/completions",
                                      "Host: 127.0.0.1\r\nOrigin: https://app.example\r\n"
                                      "Access-Control-Request-Method: POST\r\n"
                                      "Access-Control-Request-Headers: authorization, content-type\r\n");
  EXPECT_EQ(status_of(pre), 204) << pre;
  EXPECT_NE(pre.find("Access-Control-Allow-Origin: https://app.example"), std::string::npos) << pre;
  EXPECT_NE(pre.find("Access-Control-Allow-Headers: Authorization, Content-Type"), std::string::npos) << pre;
  const std::string body = R"({"prompt": "the quick", "max_tokens": 2})";
  const std::string ok = raw_request(port, "POST", "/v1/completions",
                                     "Host: 127.0.0.1\r\nOrigin: https://app.example\r\nAuthorization: Bearer k\r\n"
                                     "Content-Type: application/json\r\n", body);
  EXPECT_EQ(status_of(ok), 200) << ok;
  EXPECT_NE(ok.find("Access-Control-Allow-Origin: https://app.example"), std::string::npos) << ok;
  const std::string no_key = raw_request(port, "POST", "/v1/completions",
                                         "Host: 127.0.0.1\r\nOrigin: https://app.example\r\n"
                                         "Content-Type: application/json\r\n", body);
  EXPECT_EQ(status_of(no_key), 401) << no_key;
  EXPECT_NE(no_key.find("Access-Control-Allow-Origin: https://app.example"), std::string::npos) << no_key;
  const std::string other = raw_request(port, "POST", "/v1/completions",
                                        "Host: 127.0.0.1\r\nOrigin: https://app.example.evil\r\nAuthorization: Bearer k\r\n"
                                        "Content-Type: application/json\r\n", body);
  EXPECT_EQ(status_of(other), 403) << other;
}

// ==== 6. loose ends ====================================================================================

// A save's answer names the file, not where the server keeps it; errors name no part of the
// session directory's path even when it holds spaces, ':', ',' or parentheses (redaction had
// stopped there and shown the rest); DELETE with ?file=true removes the saved file too.
TEST(ServerLooseEnds, NoServerPathsInAnswersAndDeleteCanRemoveTheFile) {
  ServerOptions o;
  o.engine.max_slots = 1;
  const std::string odd = "my sessions (v1): a,b";
  TestServer s(o, "hostile_paths_model", /*session_dir=*/true, odd);
  ASSERT_TRUE(s.ok());
  auto c = s.client();
  ASSERT_EQ(c.Post("/v1/sessions", R"({"name": "keep", "prompt": "the quick"})", "application/json")->status, 200);
  auto saved = c.Post("/v1/sessions/keep/save", "{}", "application/json");
  ASSERT_TRUE(saved && saved->status == 200) << (saved ? saved->body : "");
  EXPECT_EQ(saved->body.find(s.dir()), std::string::npos) << saved->body;
  EXPECT_EQ(json::parse(saved->body)["file"], "keep.session");
  const std::string file = s.dir() + "/" + odd + "/keep.session";
  ASSERT_TRUE(fs::exists(file));
  // A damaged file's error.
  { std::ofstream(s.dir() + "/" + odd + "/broken.session", std::ios::binary) << "short"; }
  auto bad = c.Post("/v1/sessions/broken/restore", "{}", "application/json");
  ASSERT_TRUE(bad);
  EXPECT_EQ(bad->status, 400) << bad->body;
  for (const std::string& piece : {s.dir(), std::string("(v1)"), std::string("a,b"), std::string("my sessions")})
    EXPECT_EQ(bad->body.find(piece), std::string::npos) << piece << " in " << bad->body;
  // DELETE keeps the file (and says so), so a session can leave memory and come back...
  auto del = c.Delete("/v1/sessions/keep");
  ASSERT_TRUE(del && del->status == 200) << (del ? del->body : "");
  EXPECT_EQ(json::parse(del->body)["file_kept"], true);
  EXPECT_TRUE(fs::exists(file));
  ASSERT_EQ(c.Post("/v1/sessions/keep/restore", "{}", "application/json")->status, 200);
  // ... and with ?file=true removes it too.
  del = c.Delete("/v1/sessions/keep?file=true");
  ASSERT_TRUE(del && del->status == 200) << (del ? del->body : "");
  EXPECT_EQ(json::parse(del->body)["file_deleted"], true);
  EXPECT_FALSE(fs::exists(file));
  EXPECT_EQ(c.Post("/v1/sessions/keep/restore", "{}", "application/json")->status, 404);
  EXPECT_EQ(c.Delete("/v1/sessions/keep?file=true")->status, 404);
  EXPECT_EQ(s->counters().sessions, 0);
  const std::string m = s.metrics();
  EXPECT_EQ(metric(m, "laplace_session_files"), 0) << "keep.session is no longer counted against the disk caps";
}

// A streaming client that stops reading is dropped, and its generation cancelled, once
// nothing the server sent has been acknowledged for the write timeout — not only after the
// server's own send buffer (megabytes on loopback) has filled too, which a slow stream takes
// far longer than that to do. Tokens come one every 0.2 s here, a few kilobytes in all.
TEST(ServerLooseEnds, ClientThatStopsReadingIsDroppedAtTheWriteDeadline) {
  ServerOptions o;
  o.engine.max_slots = 1;
  o.write_timeout_s = 2;
  o.limits.max_tokens = 100000;
  TestServer s(o);
  ASSERT_TRUE(s.ok());
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  const int small = 4096;  // its receive window closes after a few kilobytes
  setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &small, sizeof small);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(s.port()));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  s->hold_engine(true);
  const int64_t left_before = s->counters().client_disconnects;
  ASSERT_TRUE(send_all(fd, http_post("/v1/completions", json{{"prompt", "the quick"}, {"max_tokens", 90000},
                                                              {"ignore_eos", true}, {"stream", true},
                                                              {"logprobs", 5}}.dump())));
  ASSERT_TRUE(eventually([&] { return s->counters().engine.queued == 1; }, 30));
  s->step_engine(80);  // enough to fill the client's window (logprobs make each chunk large)
  const auto t0 = std::chrono::steady_clock::now();
  bool dropped = false;
  while (std::chrono::steady_clock::now() - t0 < std::chrono::seconds(10)) {
    s->step_engine(1);
    if (s->counters().client_disconnects > left_before) {
      dropped = true;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_TRUE(dropped) << "a client that reads nothing kept its slot for " << took << " s";
  EXPECT_LT(took, 6);
  s->hold_engine(false);
  EXPECT_TRUE(eventually([&] { return s->counters().engine.running == 0 && s->counters().outstanding == 0; }, 30));
  close(fd);
}

// ==== 4. protocol strictness ===========================================================================

// How many HTTP responses a byte stream holds (status lines at the start of a line).
int responses_in(const std::string& raw) {
  int n = 0;
  for (size_t at = 0; (at = raw.find("HTTP/1.", at)) != std::string::npos; at += 7)
    if (at == 0 || raw[at - 1] == '\n') ++n;
  return n;
}

// RFC 9112 §6.3: a request whose Transfer-Encoding is not exactly chunked gets a 400 and a
// closed connection. Its body had been read as empty and the bytes after the header served
// as a second request (a request smuggled past whatever stands in front of the server).
TEST(ServerProtocol, TransferEncodingOtherThanChunkedIs400AndCloses) {
  ServerOptions o;
  o.engine.max_slots = 1;
  TestServer s(o);
  ASSERT_TRUE(s.ok());
  const std::string smuggled = "GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n";
  for (const std::string te : {"gzip", "chunked, gzip", "gzip, chunked", "identity", "chunked\r\nTransfer-Encoding: chunked",
                               "CHUNKED, identity"}) {
    SCOPED_TRACE(te);
    const std::string raw = raw_exchange(
        s.port(), "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  "Transfer-Encoding: " + te + "\r\n\r\n" + smuggled);
    EXPECT_EQ(status_of(raw), 400) << raw;
    EXPECT_NE(raw.find("Connection: close"), std::string::npos) << raw;
    EXPECT_EQ(responses_in(raw), 1) << "the bytes after the header were served as a request:\n" << raw;
  }
  // HTTP/1.0 has no transfer codings at all.
  const std::string old = raw_exchange(s.port(), "POST /v1/completions HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n"
                                                 "0\r\n\r\n");
  EXPECT_EQ(status_of(old), 400) << old;
  // Chunked itself (any case) is read as before.
  const std::string body = R"({"prompt": "the quick", "max_tokens": 2, "ignore_eos": true})";
  char len[16];
  std::snprintf(len, sizeof len, "%zx", body.size());
  const std::string ok = raw_exchange(
      s.port(), "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                "Transfer-Encoding: Chunked\r\nConnection: close\r\n\r\n" + std::string(len) + "\r\n" + body +
                "\r\n0\r\n\r\n");
  EXPECT_EQ(status_of(ok), 200) << ok;
  EXPECT_NE(ok.find("\"completion_tokens\":2"), std::string::npos) << ok;
}

// A request line ending in a bare LF is malformed (400), not another version of HTTP (505);
// a well-formed line of another version is still a 505.
TEST(ServerProtocol, BareLfRequestLineIs400AndAnotherVersionIs505) {
  ServerOptions o;
  o.engine.max_slots = 1;
  TestServer s(o);
  ASSERT_TRUE(s.ok());
  for (const std::string req : {"GET /health HTTP/1.1\nHost: 127.0.0.1\r\n\r\n", "GET /health HTTP/1.1\n\n",
                                "GET /health HTTP/1.x\r\n\r\n", "GET /health HTTP/11\r\n\r\n"}) {
    const std::string raw = raw_exchange(s.port(), req);
    EXPECT_EQ(status_of(raw), 400) << req << " -> " << raw;
  }
  for (const std::string req : {"GET /health HTTP/2.0\r\nHost: 127.0.0.1\r\n\r\n", "GET /health HTTP/0.9\r\n\r\n"}) {
    const std::string raw = raw_exchange(s.port(), req);
    EXPECT_EQ(status_of(raw), 505) << req << " -> " << raw;
  }
  const std::string fine = raw_exchange(s.port(), "GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
  EXPECT_EQ(status_of(fine), 200) << fine;
}

}  // namespace
}  // namespace laplace

#endif  // LAPLACE_HAVE_SERVER
