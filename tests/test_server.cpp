// The HTTP server (serve/http/server.h) over real sockets on 127.0.0.1, CPU backend, a small
// random-weight model with a trained 400-piece tokenizer. Hostile input, the exact state
// cache, forks, sessions, the bounded queue and a bounded load test.
#ifdef LAPLACE_HAVE_SERVER

#include <arpa/inet.h>
#include <malloc.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <condition_variable>
#include <csignal>
#include <limits>
#include <sstream>
#include <tuple>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <latch>
#include <memory>
#include <thread>

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "bench/http_load.h"
#include "core/file_util.h"
#include "core/safetensors.h"
#include "model/model.h"
#include "serve/http/server.h"
#include "serve/metrics.h"
#include "tests/http_client.h"
#include "tests/server_test_util.h"
#include "tests/test_util.h"
#include "text/tokenizer.h"

namespace laplace {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;
namespace httpc = laplace::testing::httpc;

const char* kKey = "secret-key";

// A model directory: config (small shapes, V = 400), random weights, a tokenizer.
std::string make_model_dir() { return testing::make_server_model_dir("server_model", 77); }

// The device the servers under test run on: the CPU, or LAPLACE_SERVER_TEST_DEVICE (e.g.
// cuda, from scripts/device/server_tests.sh). The tests compare a server with itself (cold
// runs, cache hits, forks), so they mean the same on any device.
std::string server_device() {
  const char* d = std::getenv("LAPLACE_SERVER_TEST_DEVICE");
  return d && *d ? d : "cpu";
}

class ServerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string(make_model_dir());
    ServerOptions o;
    o.model_dir = *dir_;
    o.model_name = "tiny";
    o.device = server_device();
    o.port = 0;
    o.api_key = kKey;
    o.engine.max_slots = 2;
    o.engine.prefill_chunk = 16;  // several pieces per prompt: prefill splits are exercised
    o.max_queue = 4;
    o.max_request_bytes = 64 * 1024;
    o.max_prompt_tokens = 2000;
    o.limits.max_tokens = 100000;
    o.limits.max_n = 8;
    o.cache_bytes = 8 << 20;
    o.engine.cache_slots = 2;  // the device tier holds a request's prompt and final states
    o.session_dir = *dir_ + "/sessions";
    o.read_timeout_s = 1;
    o.write_timeout_s = 2;
    o.threads = 24;
    server_ = new Server(o);
    ASSERT_TRUE(server_->start().is_ok());
    Status st = server_->wait_ready();
    ASSERT_TRUE(st.is_ok()) << st.to_string();
    tok_ = new Tokenizer();
    ASSERT_TRUE(Tokenizer::load(*dir_ + "/tokenizer.model", tok_).is_ok());
  }
  static void TearDownTestSuite() {
    server_->stop();
    delete server_;
    delete tok_;
    std::error_code ec;
    fs::remove_all(*dir_, ec);
    delete dir_;
  }

  static httpc::Client client(bool key = true) {
    httpc::Client c("127.0.0.1", server_->port());
    c.set_read_timeout(60, 0);
    if (key) c.set_bearer_token_auth(kKey);
    return c;
  }
  struct Reply {
    int status = 0;
    json body;
    std::string raw;
    std::string retry_after;
  };
  static Reply post(const std::string& path, const std::string& body, bool key = true) {
    auto c = client(key);
    return post_on(c, path, body);
  }
  // The same over an existing client (its kept-alive connection, if it has one).
  static Reply post_on(httpc::Client& c, const std::string& path, const std::string& body) {
    auto r = c.Post(path, body, "application/json");
    Reply out;
    if (!r) return out;
    out.status = r->status;
    out.raw = r->body;
    out.retry_after = r->get_header_value("Retry-After");
    out.body = json::parse(r->body, nullptr, false);
    return out;
  }
  static Reply post(const std::string& path, const json& body) { return post(path, body.dump()); }
  static Reply post(const std::string& path, const char* body, bool key = true) {
    return post(path, std::string(body), key);
  }
  static Reply get(const std::string& path) {
    auto c = client();
    auto r = c.Get(path);
    Reply out;
    if (!r) return out;
    out.status = r->status;
    out.raw = r->body;
    out.body = json::parse(r->body, nullptr, false);
    return out;
  }
  static std::string text_of(const Reply& r, size_t i = 0) {
    const json& c = r.body["choices"][i];
    return c.contains("text") ? c["text"].get<std::string>() : c["message"]["content"].get<std::string>();
  }
  static std::vector<int32_t> encode(const std::string& s) {
    std::vector<int32_t> ids;
    EXPECT_TRUE(tok_->encode(s, &ids).is_ok());
    return ids;
  }
  static bool healthy() { return get("/health").status == 200; }
  // Waits (bounded) until no request is running or queued.
  static void wait_idle() {
    for (int i = 0; i < 200; ++i) {
      ServerCounters c = server_->counters();
      if (c.outstanding == 0 && c.engine.running == 0 && c.engine.queued == 0) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(25));
    }
    ADD_FAILURE() << "the server did not become idle";
  }

  static std::string* dir_;
  static Server* server_;
  static Tokenizer* tok_;
};
std::string* ServerTest::dir_ = nullptr;
Server* ServerTest::server_ = nullptr;
Tokenizer* ServerTest::tok_ = nullptr;

// ---- raw sockets ------------------------------------------------------------------------------
// (connect_local, read_until_close, status_of, metric and eventually: tests/server_test_util.h)
using laplace::testing::srv::connect_local;
using laplace::testing::srv::eventually;
using laplace::testing::srv::metric;
using laplace::testing::srv::read_until_close;
using laplace::testing::srv::status_of;

// Unlike srv::raw_exchange, reads with the socket's 5 s timeout until the server closes.
std::string raw_exchange(int port, const std::string& bytes) {
  int fd = connect_local(port);
  if (fd < 0) return "";
  (void)!write(fd, bytes.data(), bytes.size());
  std::string out;
  char buf[4096];
  ssize_t n;
  while ((n = read(fd, buf, sizeof buf)) > 0) out.append(buf, static_cast<size_t>(n));
  close(fd);
  return out;
}

// ---- hostile and malformed requests -------------------------------------------------------------

TEST_F(ServerTest, MalformedRequestsGetTheRight4xxAndTheServerKeepsServing) {
  struct Case {
    const char* what;
    std::string path, body;
    int status;
    const char* param;  // expected error.param, or nullptr
  };
  const std::string huge_prompt = [] {
    std::string s;
    for (int i = 0; i < 5000; ++i) s += "fox ";
    return s;
  }();
  const std::string C = "/v1/completions", H = "/v1/chat/completions";
  const std::vector<Case> cases = {
      {"bad JSON", C, "{\"prompt\": ", 400, nullptr},
      {"JSON array body", C, "[]", 400, nullptr},
      {"JSON null body", C, "null", 400, nullptr},
      {"empty body", C, "", 400, nullptr},
      {"prompt missing", C, R"({"max_tokens": 4})", 400, "prompt"},
      {"prompt a number", C, R"({"prompt": 5})", 400, "prompt"},
      {"prompt an object", C, R"({"prompt": {"a": 1}})", 400, "prompt"},
      {"negative token id", C, R"({"prompt": [1, -1]})", 400, "prompt"},
      {"token id outside vocab", C, R"({"prompt": [1, 99999]})", 400, "prompt"},
      {"a list of prompts of two kinds", C, R"({"prompt": ["a", [1, 2]]})", 400, "prompt"},
      {"a list of prompts holding a number", C, R"({"prompt": [[1], 2]})", 400, "prompt"},
      {"save_session with a list of prompts", C, R"({"prompt": ["a", "b"], "save_session": "x"})", 400,
       "save_session"},
      {"max_tokens negative", C, R"({"prompt": "a", "max_tokens": -1})", 400, "max_tokens"},
      {"max_tokens zero", C, R"({"prompt": "a", "max_tokens": 0})", 400, "max_tokens"},
      {"max_tokens huge", C, R"({"prompt": "a", "max_tokens": 1000000000000})", 400, "max_tokens"},
      {"max_tokens past uint64", C, R"({"prompt": "a", "max_tokens": 99999999999999999999})", 400, "max_tokens"},
      {"max_tokens a string", C, R"({"prompt": "a", "max_tokens": "10"})", 400, "max_tokens"},
      {"max_tokens fractional", C, R"({"prompt": "a", "max_tokens": 1.5})", 400, "max_tokens"},
      {"max_completion_tokens negative", H,
       R"({"messages": [{"role": "user", "content": "a"}], "max_completion_tokens": -3})", 400,
       "max_completion_tokens"},
      {"n a million", C, R"({"prompt": "a", "n": 1000000})", 400, "n"},
      {"n zero", C, R"({"prompt": "a", "n": 0})", 400, "n"},
      {"temperature negative", C, R"({"prompt": "a", "temperature": -1})", 400, "temperature"},
      {"temperature a string", C, R"({"prompt": "a", "temperature": "hot"})", 400, "temperature"},
      {"top_p zero", C, R"({"prompt": "a", "top_p": 0})", 400, "top_p"},
      {"top_p above one", C, R"({"prompt": "a", "top_p": 2})", 400, "top_p"},
      {"presence_penalty out of range", C, R"({"prompt": "a", "presence_penalty": 5})", 400, "presence_penalty"},
      {"seed a string", C, R"({"prompt": "a", "seed": "x"})", 400, "seed"},
      {"stop a number", C, R"({"prompt": "a", "stop": 5})", 400, "stop"},
      {"five stop strings", C, R"({"prompt": "a", "stop": ["a", "b", "c", "d", "e"]})", 400, "stop"},
      {"empty stop string", C, R"({"prompt": "a", "stop": [""]})", 400, "stop"},
      {"stream a string", C, R"({"prompt": "a", "stream": "yes"})", 400, "stream"},
      {"stream_options without stream", C, R"({"prompt": "a", "stream_options": {"include_usage": true}})", 400,
       "stream_options"},
      {"logprobs too many", C, R"({"prompt": "a", "logprobs": 99})", 400, "logprobs"},
      {"messages missing", H, R"({"max_tokens": 3})", 400, "messages"},
      {"messages empty", H, R"({"messages": []})", 400, "messages"},
      {"unknown role", H, R"({"messages": [{"role": "wizard", "content": "a"}]})", 400, "messages"},
      {"content a number", H, R"({"messages": [{"role": "user", "content": 5}]})", 400, "messages"},
      {"image content part", H,
       R"({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})", 400,
       "messages"},
      {"top_logprobs without logprobs", H, R"({"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2})",
       400, "top_logprobs"},
      {"invalid UTF-8 in the prompt", C, std::string("{\"prompt\": \"a\xff\xfe b\"}"), 400, nullptr},
      {"lone surrogate escape", C, R"({"prompt": "\ud800"})", 400, nullptr},
      {"prompt too many tokens", C, json{{"prompt", huge_prompt}}.dump(), 400, "prompt"},
      {"unknown model", C, R"({"model": "gpt-9", "prompt": "a"})", 404, "model"},
      {"session name with a path", C, R"({"prompt": "a", "session": "../../etc/passwd"})", 400, "session"},
      {"unknown session", C, R"({"prompt": "a", "session": "nobody"})", 404, "session"},
      {"save_session with n > 1", C, R"({"prompt": "a", "n": 2, "save_session": "x"})", 400, "save_session"},
  };
  ASSERT_GE(cases.size(), 30u);
  for (const Case& c : cases) {
    Reply r = post(c.path, c.body);
    EXPECT_EQ(r.status, c.status) << c.what << ": " << r.raw;
    ASSERT_TRUE(r.body.is_object() && r.body.contains("error")) << c.what << ": " << r.raw;
    EXPECT_TRUE(r.body["error"]["message"].is_string()) << c.what;
    EXPECT_TRUE(r.body["error"]["type"].is_string()) << c.what;
    if (c.param) {
      EXPECT_EQ(r.body["error"]["param"], c.param) << c.what << ": " << r.raw;
    }
  }
  // Unknown fields are ignored (ignore_eos: an unseeded sample may be the EOS token).
  Reply ok = post(C, R"({"prompt": "the quick", "max_tokens": 2, "ignore_eos": true, "user": "me", "frobnicate": [1, 2]})");
  EXPECT_EQ(ok.status, 200) << ok.raw;
  EXPECT_EQ(ok.body["usage"]["completion_tokens"], 2);
  EXPECT_TRUE(healthy());
  wait_idle();
}

// Every route but /health (a balancer's probe carries no key; it tells only whether the
// replica serves, and which model) and the page's static files.
TEST_F(ServerTest, KeyIsRequiredOnEveryRoute) {
  {
    auto c = client(false);
    auto h = c.Get("/health");
    ASSERT_TRUE(h);
    EXPECT_EQ(h->status, 200) << h->body;
    EXPECT_EQ(h->body.find("token_ids"), std::string::npos);
  }
  for (const char* path : {"/metrics", "/v1/models", "/v1/sessions", "/v1/sessions/x"}) {
    auto c = client(false);
    auto r = c.Get(path);
    ASSERT_TRUE(r) << path;
    EXPECT_EQ(r->status, 401) << path;
    EXPECT_NE(r->body.find("invalid_api_key"), std::string::npos) << path;
  }
  Reply r = post("/v1/completions", R"({"prompt": "a"})", /*key=*/false);
  EXPECT_EQ(r.status, 401);
  httpc::Client wrong("127.0.0.1", server_->port());
  wrong.set_bearer_token_auth("secret-kez");
  auto w = wrong.Get("/v1/models");
  ASSERT_TRUE(w);
  EXPECT_EQ(w->status, 401);
}

TEST_F(ServerTest, OversizedBodyIs413AndUnknownRouteIs404) {
  std::string big = "{\"prompt\": \"" + std::string(100 * 1024, 'a') + "\"}";
  Reply r = post("/v1/completions", big);
  EXPECT_EQ(r.status, 413);
  Reply nf = get("/v1/nothing-here");
  EXPECT_EQ(nf.status, 404);
  EXPECT_TRUE(nf.body.contains("error")) << nf.raw;
  EXPECT_TRUE(healthy());
}

TEST_F(ServerTest, GarbageSlowAndVanishingClientsDoNotHurtTheServer) {
  const int port = server_->port();
  // Not HTTP at all.
  std::string a = raw_exchange(port, "\x16\x03\x01 hello? \r\n\r\n");
  EXPECT_TRUE(a.empty() || status_of(a) == 400) << a.substr(0, 80);
  // A header line without end, then silence past the read timeout: dropped, no answer needed.
  {
    int fd = connect_local(port);
    ASSERT_GE(fd, 0);
    const std::string part = "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le";
    (void)!write(fd, part.data(), part.size());
    char buf[256];
    const auto t0 = std::chrono::steady_clock::now();
    const ssize_t n = read(fd, buf, sizeof buf);  // the server closes the connection
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_LE(n, static_cast<ssize_t>(sizeof buf));
    EXPECT_LT(waited, 4.5) << "a silent client must be dropped after the read timeout";
    close(fd);
  }
  // A body shorter than its Content-Length, then the client vanishes.
  {
    int fd = connect_local(port);
    ASSERT_GE(fd, 0);
    const std::string req = "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + std::string(kKey) +
                            "\r\nContent-Length: 500\r\n\r\n{\"prompt\": \"a";
    (void)!write(fd, req.data(), req.size());
    close(fd);
  }
  // A bad Content-Length.
  std::string b = raw_exchange(port, "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: -5\r\n\r\n");
  EXPECT_TRUE(b.empty() || status_of(b) >= 400) << b.substr(0, 80);
  EXPECT_TRUE(healthy());
  Reply ok = post("/v1/completions", R"({"prompt": "the lazy dog", "max_tokens": 3})");
  EXPECT_EQ(ok.status, 200);
  wait_idle();
}

TEST_F(ServerTest, ClientThatLeavesMidStreamHasItsGenerationCancelled) {
  const int64_t before = server_->counters().client_disconnects;
  const int64_t cancelled_before = server_->counters().engine.cancelled;
  int fd = connect_local(server_->port());
  ASSERT_GE(fd, 0);
  const std::string body = R"({"prompt": "the quick", "max_tokens": 90000, "ignore_eos": true, "stream": true})";
  const std::string req = "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + std::string(kKey) +
                          "\r\nContent-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) +
                          "\r\n\r\n" + body;
  (void)!write(fd, req.data(), req.size());
  char buf[512];
  ASSERT_GT(read(fd, buf, sizeof buf), 0);  // the stream has started
  close(fd);
  const bool freed = eventually([&] {
    const ServerCounters c = server_->counters();
    return c.engine.running == 0 && c.client_disconnects > before;
  }, 30);
  EXPECT_TRUE(freed) << "the slot was not freed after the client left";
  EXPECT_GT(server_->counters().engine.cancelled, cancelled_before);
  wait_idle();
}

TEST_F(ServerTest, NonStreamingClientThatTimesOutIsCancelledToo) {
  const int64_t before = server_->counters().client_disconnects;
  {
    httpc::Client c("127.0.0.1", server_->port());
    c.set_bearer_token_auth(kKey);
    c.set_read_timeout(0, 300000);  // gives up after 0.3 s
    auto r = c.Post("/v1/completions", R"({"prompt": "a", "max_tokens": 90000, "ignore_eos": true})",
                    "application/json");
    EXPECT_FALSE(r && r->status == 200 && r->body.find("choices") != std::string::npos);
  }
  const bool freed = eventually([&] {
    const ServerCounters c = server_->counters();
    return c.engine.running == 0 && c.client_disconnects > before;
  }, 30);
  EXPECT_TRUE(freed);
  wait_idle();
}

// ---- the exact state cache ----------------------------------------------------------------------

TEST_F(ServerTest, PrefixCacheHitIsByteIdenticalAndPrefillsOnlyNewTokens) {
  const json base = {{"prompt", "Why did the programmer quit? Because the quick brown fox"},
                     {"max_tokens", 24},
                     {"temperature", 0}};
  json cold_req = base;
  cold_req["cache"] = false;
  Reply cold = post("/v1/completions", cold_req);
  ASSERT_EQ(cold.status, 200) << cold.raw;
  EXPECT_EQ(cold.body["usage"]["prompt_tokens_details"]["cached_tokens"], 0);

  Reply first = post("/v1/completions", base);  // fills the cache
  ASSERT_EQ(first.status, 200);
  const int64_t prompt_tokens = first.body["usage"]["prompt_tokens"];
  const int64_t prefill_before = server_->counters().engine.prefill_tokens;
  const StateCacheStats c0 = server_->counters().cache;
  Reply second = post("/v1/completions", base);
  ASSERT_EQ(second.status, 200);
  EXPECT_EQ(text_of(second), text_of(cold));
  EXPECT_EQ(text_of(first), text_of(cold));
  EXPECT_EQ(second.body["usage"]["prompt_tokens_details"]["cached_tokens"], prompt_tokens);
  EXPECT_EQ(server_->counters().engine.prefill_tokens - prefill_before, 0) << "a full hit prefills nothing";
  const StateCacheStats c1 = server_->counters().cache;
  EXPECT_EQ(c1.device_hits - c0.device_hits, 1) << "the prompt state was still in a device cache slot";
  EXPECT_EQ(c1.host_hits - c0.host_hits, 0);

  // A longer prompt continues the cached one: only the new tokens are prefilled.
  std::vector<int32_t> ids = encode(base["prompt"].get<std::string>());
  const std::vector<int32_t> more = encode(" jumps over the lazy dog");
  std::vector<int32_t> longer = ids;
  longer.insert(longer.end(), more.begin(), more.end());
  json cold2 = {{"prompt", longer}, {"max_tokens", 16}, {"temperature", 0}, {"cache", false}};
  Reply c2 = post("/v1/completions", cold2);
  const int64_t p0 = server_->counters().engine.prefill_tokens;
  json warm2 = cold2;
  warm2.erase("cache");
  Reply w2 = post("/v1/completions", warm2);
  ASSERT_EQ(w2.status, 200);
  EXPECT_EQ(text_of(w2), text_of(c2));
  EXPECT_EQ(w2.body["usage"]["prompt_tokens_details"]["cached_tokens"], static_cast<int64_t>(ids.size()));
  EXPECT_EQ(server_->counters().engine.prefill_tokens - p0, static_cast<int64_t>(more.size()));
  EXPECT_EQ(server_->counters().cache.device_hits - c1.device_hits, 1);
  const std::string m = get("/metrics").raw;
  EXPECT_GE(metric(m, "laplace_cache_device_hits_total"), 2) << m;
  EXPECT_EQ(metric(m, "laplace_cache_hits_total"),
            metric(m, "laplace_cache_device_hits_total") + metric(m, "laplace_cache_host_hits_total"));
  EXPECT_EQ(metric(m, "laplace_cache_device_slots"), 2);
  EXPECT_EQ(metric(m, "laplace_cache_device_slots_used") + metric(m, "laplace_cache_device_slots_free"), 2);
  wait_idle();
}

// One device cache slot, 2 live slots, several prompts: each request's prompt state is
// demoted to the host tier when its final state takes the slot. A repeated prompt is then
// a host-tier hit, byte-identical to a cold run (and promoted, until the request's own
// final state takes the slot). Under a concurrent load the device tier never holds more than its one
// entry, and afterwards every slot is free and every entry accounted for.
TEST_F(ServerTest, TinyDeviceTierDemotesToHostExactlyAndLeaksNoSlot) {
  ServerOptions o;
  o.model_dir = *dir_;
  o.model_name = "tiny1";
  o.device = server_device();
  o.port = 0;
  o.engine.max_slots = 2;
  o.engine.cache_slots = 1;
  o.engine.prefill_chunk = 16;
  o.cache_bytes = 8 << 20;
  o.max_queue = 64;
  o.threads = 16;
  Server srv(o);
  ASSERT_TRUE(srv.start().is_ok());
  ASSERT_TRUE(srv.wait_ready().is_ok());
  auto call = [&](const json& body) {
    httpc::Client c("127.0.0.1", srv.port());
    c.set_read_timeout(60, 0);
    auto r = c.Post("/v1/completions", body.dump(), "application/json");
    Reply out;
    if (!r) return out;
    out.status = r->status;
    out.raw = r->body;
    out.body = json::parse(r->body, nullptr, false);
    return out;
  };
  // Seeded sampling at temperature 1: every token depends on the whole distribution, so a
  // state that is off anywhere shows in the text (greedy on random weights may not).
  auto req = [](int k, bool cache) {
    return json{{"prompt", "the lazy dog number " + std::to_string(k) + " keeps the doctor away"},
                {"max_tokens", 10}, {"temperature", 1.0}, {"seed", 5}, {"ignore_eos", true}, {"cache", cache}};
  };
  const int K = 4;
  std::vector<std::string> cold(K);
  for (int k = 0; k < K; ++k) {
    Reply c = call(req(k, false));
    ASSERT_EQ(c.status, 200) << c.raw;
    cold[k] = text_of(c);
    Reply w = call(req(k, true));  // a miss; caches the prompt state, then the final state
    ASSERT_EQ(w.status, 200);
    EXPECT_EQ(text_of(w), cold[k]);
  }
  StateCacheStats c = srv.counters().cache;
  EXPECT_EQ(c.device_slots, 1);
  EXPECT_EQ(c.device_used, 1);
  EXPECT_EQ(c.hits, 0);
  EXPECT_EQ(c.demotions, 2 * K - 1);
  EXPECT_EQ(c.host_entries, 2 * K - 1);

  const int64_t pf = srv.counters().engine.prefill_tokens;
  Reply h = call(req(0, true));
  ASSERT_EQ(h.status, 200);
  EXPECT_EQ(text_of(h), cold[0]) << "a host-tier hit is exact";
  EXPECT_EQ(h.body["usage"]["prompt_tokens_details"]["cached_tokens"], h.body["usage"]["prompt_tokens"]);
  EXPECT_EQ(srv.counters().engine.prefill_tokens, pf);
  StateCacheStats c2 = srv.counters().cache;
  EXPECT_EQ(c2.host_hits, 1);
  EXPECT_EQ(c2.device_hits, 0);
  EXPECT_EQ(c2.promotions, 1);
  // The promoted prompt state held the one slot only until h's final state took it (and
  // demoted it again), so a repeat is again a host-tier hit, exact again.
  Reply d = call(req(0, true));
  EXPECT_EQ(text_of(d), cold[0]);
  EXPECT_EQ(srv.counters().cache.host_hits, 2);
  EXPECT_EQ(srv.counters().cache.device_used, 1);

  // Load: 8 clients x 6 requests over the K prompts (repeats hit either tier), some
  // streamed, some with n = 2, while the device tier's occupancy is watched.
  std::atomic<bool> done{false};
  std::atomic<int64_t> max_used{0};
  std::thread watch([&] {
    while (!done.load()) {
      const int64_t u = srv.counters().cache.device_used;
      if (u > max_used.load()) max_used.store(u);
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  });
  std::atomic<int> ok{0}, bad{0};
  std::vector<std::thread> th;
  for (int t = 0; t < 8; ++t)
    th.emplace_back([&, t] {
      for (int i = 0; i < 6; ++i) {
        json b = req((t + i) % K, true);
        if (i % 3 == 1) b["stream"] = true;
        if (i % 3 == 2) b["n"] = 2;
        Reply r = call(b);
        (r.status == 200 ? ok : bad)++;
      }
    });
  for (auto& x : th) x.join();
  eventually([&] { return !srv.counters().outstanding && !srv.counters().engine.running; }, 30);
  done = true;
  watch.join();
  EXPECT_EQ(ok.load(), 48);
  EXPECT_EQ(bad.load(), 0);
  EXPECT_LE(max_used.load(), 1);
  const ServerCounters after = srv.counters();
  EXPECT_EQ(after.outstanding, 0);
  EXPECT_EQ(after.engine.running, 0);
  EXPECT_EQ(after.engine.free_slots, 2) << "every live slot back";
  EXPECT_EQ(after.cache.device_used, 1);
  EXPECT_EQ(after.cache.entries, after.cache.device_used + after.cache.host_entries);
  EXPECT_GT(after.cache.hits, c2.hits + 20);
  // The cache is still exact after the load.
  Reply again = call(req(1, true));
  EXPECT_EQ(text_of(again), cold[1]);
  httpc::Client mc("127.0.0.1", srv.port());
  auto m = mc.Get("/metrics");
  ASSERT_TRUE(m);
  EXPECT_EQ(metric(m->body, "laplace_cache_device_slots"), 1);
  EXPECT_LE(metric(m->body, "laplace_cache_device_slots_used"), 1);
  EXPECT_GE(metric(m->body, "laplace_cache_host_hits_total"), 1);
  EXPECT_GE(metric(m->body, "laplace_cache_demotions_total"), 2 * K - 1);
  srv.stop();
}

TEST_F(ServerTest, ChatNextTurnPrefillsOnlyItsNewTokensAndMatchesAColdRun) {
  json turn1 = {{"messages", {{{"role", "system"}, {"content", "You are terse."}},
                              {{"role", "user"}, {"content", "Tell me about the fox."}}}},
                {"max_tokens", 12},
                {"temperature", 0},
                {"ignore_eos", true}};
  Reply r1 = post("/v1/chat/completions", turn1);
  ASSERT_EQ(r1.status, 200) << r1.raw;
  const std::string reply = text_of(r1);
  const int64_t p1 = r1.body["usage"]["prompt_tokens"];
  json turn2 = turn1;
  turn2["messages"].push_back({{"role", "assistant"}, {"content", reply}});
  turn2["messages"].push_back({{"role", "user"}, {"content", "And the dog?"}});
  json cold = turn2;
  cold["cache"] = false;
  Reply rc = post("/v1/chat/completions", cold);
  ASSERT_EQ(rc.status, 200);
  const int64_t before = server_->counters().engine.prefill_tokens;
  Reply r2 = post("/v1/chat/completions", turn2);
  ASSERT_EQ(r2.status, 200);
  const int64_t prefilled = server_->counters().engine.prefill_tokens - before;
  const int64_t p2 = r2.body["usage"]["prompt_tokens"];
  const int64_t cached = r2.body["usage"]["prompt_tokens_details"]["cached_tokens"];
  EXPECT_EQ(text_of(r2), text_of(rc));
  // The cached state covers turn 1's prompt and all of its reply but the last token (which
  // was sampled, never fed): everything before the new message.
  EXPECT_EQ(cached, p1 + 12 - 1);
  EXPECT_EQ(prefilled, p2 - cached);
  wait_idle();
}

TEST_F(ServerTest, NForksOnePrefillAndEachChoiceEqualsItsOwnRun) {
  const json req = {{"prompt", "a fortune a day keeps"}, {"max_tokens", 10}, {"temperature", 1.0},
                    {"seed", 11},   {"n", 3},          {"cache", false},   {"ignore_eos", true}};
  const int64_t before = server_->counters().engine.prefill_tokens;
  Reply r = post("/v1/completions", req);
  ASSERT_EQ(r.status, 200) << r.raw;
  const int64_t prompt = r.body["usage"]["prompt_tokens"];
  EXPECT_EQ(server_->counters().engine.prefill_tokens - before, prompt) << "one prefill for all choices";
  ASSERT_EQ(r.body["choices"].size(), 3u);
  EXPECT_EQ(r.body["usage"]["completion_tokens"], 30);
  for (int i = 0; i < 3; ++i) {
    json one = req;
    one["n"] = 1;
    one["seed"] = 11 + i;
    Reply s = post("/v1/completions", one);
    ASSERT_EQ(s.status, 200);
    EXPECT_EQ(text_of(r, i), text_of(s)) << "choice " << i;
  }
  wait_idle();
}

// ---- sessions ------------------------------------------------------------------------------------

TEST_F(ServerTest, SessionsSaveRestoreForkAndDeleteExactly) {
  Reply c = post("/v1/sessions", json{{"name", "story"}, {"prompt", "the quick brown fox"}});
  ASSERT_EQ(c.status, 200) << c.raw;
  const std::vector<int32_t> ctx0 = encode("the quick brown fox");
  EXPECT_EQ(c.body["tokens"], ctx0.size());

  // Continue the session and save the result as "story2".
  json cont = {{"prompt", " jumps"}, {"session", "story"}, {"save_session", "story2"}, {"max_tokens", 8},
               {"temperature", 0},  {"ignore_eos", true}};
  Reply r = post("/v1/completions", cont);
  ASSERT_EQ(r.status, 200) << r.raw;
  std::vector<int32_t> full = ctx0;
  const std::vector<int32_t> jumps = encode(" jumps");
  full.insert(full.end(), jumps.begin(), jumps.end());
  Reply cold = post("/v1/completions", json{{"prompt", full}, {"max_tokens", 8}, {"temperature", 0},
                                            {"cache", false}, {"ignore_eos", true}});
  EXPECT_EQ(text_of(r), text_of(cold)) << "a session continuation equals recomputing its context";
  EXPECT_EQ(r.body["usage"]["prompt_tokens_details"]["cached_tokens"], ctx0.size());

  Reply s2 = get("/v1/sessions/story2");
  ASSERT_EQ(s2.status, 200) << s2.raw;
  std::vector<int32_t> ctx2 = s2.body["token_ids"].get<std::vector<int32_t>>();
  ASSERT_EQ(ctx2.size(), full.size() + 8);
  EXPECT_TRUE(std::equal(full.begin(), full.end(), ctx2.begin()));

  // Fork, delete the original, continue the fork: equals a cold run over its tokens.
  ASSERT_EQ(post("/v1/sessions/story2/fork", json{{"name", "story3"}}).status, 200);
  auto cl = client();
  auto del = cl.Delete("/v1/sessions/story2");
  ASSERT_TRUE(del);
  EXPECT_EQ(del->status, 200);
  EXPECT_EQ(get("/v1/sessions/story2").status, 404);
  const json next = {{"prompt", " over"}, {"session", "story3"}, {"max_tokens", 6}, {"temperature", 0},
                     {"ignore_eos", true}};
  Reply f = post("/v1/completions", next);
  ASSERT_EQ(f.status, 200) << f.raw;
  std::vector<int32_t> full3 = ctx2;
  const std::vector<int32_t> over = encode(" over");
  full3.insert(full3.end(), over.begin(), over.end());
  Reply cold3 = post("/v1/completions", json{{"prompt", full3}, {"max_tokens", 6}, {"temperature", 0},
                                             {"cache", false}, {"ignore_eos", true}});
  EXPECT_EQ(text_of(f), text_of(cold3));

  // To disk and back.
  Reply saved = post("/v1/sessions/story3/save", std::string("{}"));
  ASSERT_EQ(saved.status, 200) << saved.raw;
  const std::string path = *dir_ + "/sessions/" + saved.body["file"].get<std::string>();
  ASSERT_TRUE(fs::exists(path));
  ASSERT_EQ(cl.Delete("/v1/sessions/story3")->status, 200);
  Reply restored = post("/v1/sessions/story3/restore", std::string("{}"));
  ASSERT_EQ(restored.status, 200) << restored.raw;
  Reply again = post("/v1/completions", next);
  EXPECT_EQ(text_of(again), text_of(f)) << "a restored session continues exactly";

  // A damaged file is refused with a clear error; the server goes on.
  std::string bytes;
  ASSERT_TRUE(read_file(path, &bytes).is_ok());
  for (size_t cut : {bytes.size() / 2, size_t(10), size_t(0)}) {
    std::ofstream(path, std::ios::binary | std::ios::trunc).write(bytes.data(), static_cast<std::streamsize>(cut));
    Reply bad = post("/v1/sessions/story3/restore", std::string("{}"));
    EXPECT_EQ(bad.status, 400) << "cut at " << cut << ": " << bad.raw;
  }
  std::string flipped = bytes;
  flipped[flipped.size() - 3] ^= 0x5a;  // inside the context tokens: an id outside the vocabulary
  std::ofstream(path, std::ios::binary | std::ios::trunc).write(flipped.data(), static_cast<std::streamsize>(flipped.size()));
  Reply bad2 = post("/v1/sessions/story3/restore", std::string("{}"));
  EXPECT_EQ(bad2.status, 400) << bad2.raw;
  EXPECT_EQ(post("/v1/sessions/nothing/restore", std::string("{}")).status, 404);
  EXPECT_EQ(text_of(post("/v1/completions", next)), text_of(f)) << "the in-memory session is untouched";
  Reply list = get("/v1/sessions");
  EXPECT_EQ(list.status, 200);
  EXPECT_GE(list.body["data"].size(), 2u);
  wait_idle();
}

// ---- queueing and load -----------------------------------------------------------------------------

TEST_F(ServerTest, FullQueueAnswers429WithRetryAfterAndLosesNothing) {
  wait_idle();
  const int clients = 12;  // 2 slots + 4 queued can be outstanding; the rest must get 429
  std::vector<Reply> replies(clients);
  std::vector<std::thread> th;
  // Every client connects first (a kept-alive connection, opened by a /health request),
  // then all post at once. Connecting inside the burst would spread the posts over the
  // connections' set-up, and the first requests could be done before the last arrive, so
  // that nothing is ever refused.
  std::latch connected(clients);
  for (int i = 0; i < clients; ++i)
    th.emplace_back([&, i] {
      auto c = client();
      c.set_keep_alive(true);
      auto h = c.Get("/health");
      EXPECT_TRUE(h && h->status == 200);
      connected.arrive_and_wait();
      replies[i] = post_on(c, "/v1/completions", json{{"prompt", "the lazy dog " + std::to_string(i)},
                                                      {"max_tokens", 400},
                                                      {"ignore_eos", true},
                                                      {"temperature", 0}}.dump());
    });
  for (auto& t : th) t.join();
  int ok = 0, busy = 0;
  for (const Reply& r : replies) {
    if (r.status == 200) {
      ++ok;
      EXPECT_EQ(r.body["usage"]["completion_tokens"], 400);
    } else {
      EXPECT_EQ(r.status, 429) << r.raw;
      EXPECT_EQ(r.retry_after, "1");
      ++busy;
    }
  }
  EXPECT_EQ(ok + busy, clients);
  EXPECT_GE(ok, 6);
  EXPECT_GE(busy, 1);
  wait_idle();
}

TEST_F(ServerTest, BoundedLoadEveryRequestCompletesOr429AndMemoryReturns) {
  wait_idle();
  // Warm-up (thread stacks, allocator pools) before the baseline.
  for (int i = 0; i < 4; ++i) post("/v1/completions", json{{"prompt", "warm"}, {"max_tokens", 8}});
  wait_idle();
  const int64_t rss0 = process_resident_bytes();
  const int clients = 16, each = 4;
  std::atomic<int> ok{0}, busy{0}, other{0};
  std::mutex why_mu;
  std::string why;  // what the first request that got neither answer got
  std::vector<std::thread> th;
  for (int c = 0; c < clients; ++c)
    th.emplace_back([&, c] {
      for (int k = 0; k < each; ++k) {
        json req = {{"prompt", "client " + std::to_string(c) + " request " + std::to_string(k)},
                    {"max_tokens", 20 + (c * 7 + k) % 30}};
        if ((c + k) % 2) req["stream"] = true;
        if (k == 3) req["n"] = 2;
        auto cl = client();
        auto r = cl.Post("/v1/completions", req.dump(), "application/json");
        if (r && r->status == 200 && (r->body.find("[DONE]") != std::string::npos || r->body.find("usage") != std::string::npos))
          ++ok;
        else if (r && r->status == 429)
          ++busy;
        else {
          ++other;
          std::lock_guard<std::mutex> lk(why_mu);
          if (why.empty())
            why = r ? "status " + std::to_string(r->status) + ": " + r->body.substr(0, 300)
                    : "no response: " + httpc::to_string(r.error());
        }
      }
    });
  for (auto& t : th) t.join();
  EXPECT_EQ(other.load(), 0) << why;
  EXPECT_EQ(ok + busy, clients * each);
  EXPECT_GT(ok.load(), 0);
  wait_idle();
  const ServerCounters c = server_->counters();
  EXPECT_EQ(c.outstanding, 0);
  EXPECT_EQ(c.engine.free_slots, 2);
  const int64_t rss1 = process_resident_bytes();
  // Back to the baseline, up to the cache budget (8 MiB) and allocator slack.
  EXPECT_LT(rss1 - rss0, int64_t(48) << 20) << "rss " << rss0 << " -> " << rss1;
}

// A server with deferred write-back (--defer-writeback 8): a session continued after decode
// steps (its slot holds pending pairs) gives the text of recomputing its context, also after
// a round trip through its file. Servers with another slot layout (no deferred write-back,
// R = 4) load that file with the pairs folded in and continue it with the same text, also when
// the file predates the layout metadata; a file whose recorded layout does not fit its state is
// refused, and the server serves on.
TEST(ServerDeferred, SessionsCarryPendingPairsAndLoadIntoOtherLayouts) {
  const std::string dir = make_model_dir();
  auto start = [&](int64_t defer) {
    ServerOptions o;
    o.model_dir = dir;
    o.port = 0;
    o.device = server_device();
    o.engine.max_slots = 2;
    o.engine.prefill_chunk = 16;
    o.engine.defer_writeback = defer;
    o.session_dir = dir + "/sessions";
    auto srv = std::make_unique<Server>(o);
    EXPECT_TRUE(srv->start().is_ok());
    Status st = srv->wait_ready();
    EXPECT_TRUE(st.is_ok()) << st.to_string();
    return srv;
  };
  auto post = [](Server& srv, const std::string& path, const json& body) {
    httpc::Client c("127.0.0.1", srv.port());
    c.set_read_timeout(60, 0);
    auto r = c.Post(path, body.dump(), "application/json");
    return r ? std::make_pair(r->status, json::parse(r->body, nullptr, false)) : std::make_pair(0, json());
  };
  auto text = [](const json& b) { return b["choices"][0]["text"].get<std::string>(); };
  const json greedy = {{"temperature", 0}, {"ignore_eos", true}};
  json next = greedy;
  next.update({{"prompt", " over"}, {"session", "s2"}, {"max_tokens", 9}});
  std::string warm_text;  // s2 continued on the server that saved it
  {
    auto a = start(8);
    ASSERT_EQ(post(*a, "/v1/sessions", json{{"name", "s"}, {"prompt", "the quick brown fox"}}).first, 200);
    json cont = greedy;
    cont.update({{"prompt", " jumps"}, {"session", "s"}, {"save_session", "s2"}, {"max_tokens", 11}});
    ASSERT_EQ(post(*a, "/v1/completions", cont).first, 200);
    auto warm = post(*a, "/v1/completions", next);
    ASSERT_EQ(warm.first, 200) << warm.second.dump();
    warm_text = text(warm.second);
    httpc::Client c("127.0.0.1", a->port());
    auto info = c.Get("/v1/sessions/s2");
    ASSERT_TRUE(info && info->status == 200);
    std::vector<int32_t> ctx = json::parse(info->body)["token_ids"].get<std::vector<int32_t>>();
    std::vector<int32_t> over;
    Tokenizer tok;
    ASSERT_TRUE(Tokenizer::load(dir + "/tokenizer.model", &tok).is_ok());
    ASSERT_TRUE(tok.encode(" over", &over).is_ok());
    ctx.insert(ctx.end(), over.begin(), over.end());
    json cold = greedy;
    cold.update({{"prompt", ctx}, {"max_tokens", 9}, {"cache", false}});
    auto c2 = post(*a, "/v1/completions", cold);
    ASSERT_EQ(c2.first, 200);
    EXPECT_EQ(text(warm.second), text(c2.second)) << "a continuation from pending pairs equals recomputing";
    ASSERT_EQ(post(*a, "/v1/sessions/s2/save", json::object()).first, 200);
    ASSERT_EQ(c.Delete("/v1/sessions/s2")->status, 200);
    ASSERT_EQ(post(*a, "/v1/sessions/s2/restore", json::object()).first, 200);
    auto again = post(*a, "/v1/completions", next);
    ASSERT_EQ(again.first, 200);
    EXPECT_EQ(text(again.second), text(warm.second)) << "a restored session continues exactly";
    a->stop();
  }
  for (int64_t defer : {0, 4}) {
    auto b = start(defer);
    auto restored = post(*b, "/v1/sessions/s2/restore", json::object());
    ASSERT_EQ(restored.first, 200) << "R = " << defer << ": " << restored.second.dump();
    auto cont = post(*b, "/v1/completions", next);
    ASSERT_EQ(cont.first, 200) << cont.second.dump();
    EXPECT_EQ(text(cont.second), warm_text) << "R = " << defer << ": the converted session continues alike";
    b->stop();
  }
  // Copies of the file with its recorded layout wrong (R = 16 over an R = 8 state; an unknown
  // pair dtype) or absent (as files were before the layout was recorded).
  {
    SafeTensorsReader r;
    ASSERT_TRUE(SafeTensorsReader::open(dir + "/sessions/s2.session", &r).is_ok());
    std::vector<NamedTensor> t;
    std::vector<std::vector<uint8_t>> keep;
    keep.reserve(4);
    for (const char* name : {"state", "logits", "snapshot_tokens", "context"}) {
      const SafeTensorInfo* info = r.find(name);
      ASSERT_NE(info, nullptr) << name;
      keep.emplace_back(r.bytes(*info), r.bytes(*info) + info->nbytes());
      ASSERT_EQ(info->shape.size(), 1u) << name;
      t.push_back({name, Tensor(keep.back().data(), info->dtype, {info->shape[0]})});
    }
    auto md = r.metadata();
    EXPECT_EQ(md["defer_writeback"], "8");
    EXPECT_EQ(md["pair_dtype"], "F32");
    auto bad = md;
    bad["defer_writeback"] = "16";
    ASSERT_TRUE(safetensors_write(dir + "/sessions/bad.session", t, bad).is_ok());
    bad = md;
    bad["pair_dtype"] = "I32";
    ASSERT_TRUE(safetensors_write(dir + "/sessions/bad2.session", t, bad).is_ok());
    auto old = md;  // as written before the layout was recorded
    old.erase("defer_writeback");
    old.erase("pair_dtype");
    ASSERT_TRUE(safetensors_write(dir + "/sessions/old.session", t, old).is_ok());
  }
  auto b = start(0);
  auto refused = post(*b, "/v1/sessions/bad/restore", json::object());
  EXPECT_EQ(refused.first, 400);
  EXPECT_NE(refused.second.dump().find("defer_writeback 16"), std::string::npos) << refused.second.dump();
  refused = post(*b, "/v1/sessions/bad2/restore", json::object());
  EXPECT_EQ(refused.first, 400);
  EXPECT_NE(refused.second.dump().find("pair_dtype"), std::string::npos) << refused.second.dump();
  ASSERT_EQ(post(*b, "/v1/sessions/old/restore", json::object()).first, 200) << "R found from the state's size";
  json from_old = next;
  from_old["session"] = "old";
  auto old_cont = post(*b, "/v1/completions", from_old);
  ASSERT_EQ(old_cont.first, 200) << old_cont.second.dump();
  EXPECT_EQ(text(old_cont.second), warm_text);
  json plain = greedy;
  plain.update({{"prompt", "the lazy dog"}, {"max_tokens", 4}});
  EXPECT_EQ(post(*b, "/v1/completions", plain).first, 200) << "the server serves on";
  b->stop();
  std::error_code ec;
  fs::remove_all(dir, ec);
}

TEST(ServerLoading, HealthIs503AndRequestsAre503WhenTheModelCannotLoad) {
  ServerOptions o;
  o.model_dir = testing::make_temp_dir("server_empty");  // no config.json
  o.port = 0;
  Server s(o);
  ASSERT_TRUE(s.start().is_ok());
  EXPECT_FALSE(s.wait_ready().is_ok());
  httpc::Client c("127.0.0.1", s.port());
  auto h = c.Get("/health");
  ASSERT_TRUE(h);
  EXPECT_EQ(h->status, 503);
  EXPECT_EQ(json::parse(h->body, nullptr, false)["status"], "failed") << h->body;  // as docs/serving.md §9 says
  auto r = c.Post("/v1/completions", R"({"prompt": "a"})", "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 503);
  EXPECT_NE(r->body.find("failed to load"), std::string::npos) << r->body;
  EXPECT_EQ(r->get_header_value("Retry-After"), "1");
  // The error names the missing file, not where the server's files are.
  EXPECT_NE(r->body.find("config.json"), std::string::npos) << r->body;
  EXPECT_EQ(r->body.find(o.model_dir), std::string::npos) << r->body;
  s.stop();
}

// A port in use is refused, also when the other server is our own (no SO_REUSEPORT, which
// would split the port's connections between the two). And a burst of connections, many more
// than cpp-httplib's listen backlog of 5, is answered in full under a 1 s read timeout: an
// overflowing accept queue would drop handshakes and first data, which come back only by
// retransmission, so some requests would be cut off half-read.
TEST(ServerLoading, PortInUseIsRefusedAndAConnectionBurstIsAnsweredInFull) {
  ServerOptions o;
  o.model_dir = testing::make_temp_dir("server_port");  // no model: every request is a quick 503
  o.port = 0;
  o.read_timeout_s = 1;
  o.threads = 8;
  Server a(o);
  ASSERT_TRUE(a.start().is_ok());
  EXPECT_FALSE(a.wait_ready().is_ok());

  ServerOptions o2 = o;
  o2.port = a.port();
  Server b(o2);
  const Status st = b.start();
  EXPECT_FALSE(st.is_ok()) << "a second server bound port " << a.port();
  EXPECT_NE(st.to_string().find("cannot bind"), std::string::npos) << st.to_string();

  const int clients = 64;
  std::atomic<int> answered{0};
  std::mutex why_mu;
  std::string why;
  std::latch go(clients);
  std::vector<std::thread> th;
  for (int i = 0; i < clients; ++i)
    th.emplace_back([&] {
      httpc::Client c("127.0.0.1", a.port());
      c.set_read_timeout(30, 0);
      go.arrive_and_wait();
      auto r = c.Post("/v1/completions", R"({"prompt": "a burst"})", "application/json");
      if (r && r->status == 503) {
        ++answered;
      } else {
        std::lock_guard<std::mutex> lk(why_mu);
        if (why.empty()) why = r ? "status " + std::to_string(r->status) : "no response: " + httpc::to_string(r.error());
      }
    });
  for (auto& t : th) t.join();
  EXPECT_EQ(answered.load(), clients) << why;
  a.stop();
}

// ==== issue 29: the transport ==================================================================

// A completion request with the key and a JSON body, in HTTP `version`.
std::string post_request(const std::string& body, const std::string& version = "HTTP/1.1",
                         const std::string& extra = "") {
  return "POST /v1/completions " + version + "\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + std::string(kKey) +
         "\r\nContent-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) + "\r\n" + extra +
         "\r\n" + body;
}

// The part of an HTTP answer after its head (raw: chunk framing included).
std::string body_of(const std::string& http) {
  const size_t at = http.find("\r\n\r\n");
  return at == std::string::npos ? "" : http.substr(at + 4);
}
std::string head_of(const std::string& http) { return http.substr(0, http.find("\r\n\r\n")); }

// A client trickling its header one byte every 100 ms, or its body after a whole header, is
// dropped when the phase's absolute deadline (the read timeout, 1 s here) passes: the bytes
// do not extend it (cpp-httplib's per-read timeout let a trickle hold a thread for good).
TEST_F(ServerTest, TricklingClientsCannotExtendTheReadDeadlines) {
  const int port = server_->port();
  for (bool in_body : {false, true}) {
    int fd = connect_local(port);
    ASSERT_GE(fd, 0);
    const auto t0 = std::chrono::steady_clock::now();
    std::string head = "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + std::string(kKey) +
                       "\r\nContent-Length: 1000\r\n";
    if (in_body) head += "\r\n";
    ASSERT_EQ(send(fd, head.data(), head.size(), MSG_NOSIGNAL), static_cast<ssize_t>(head.size()));
    bool dropped = false;
    for (int i = 0; i < 40 && !dropped; ++i) {  // 4 s of trickling at most
      const char* byte = in_body ? "a" : (i % 2 ? "y" : "X");
      if (send(fd, byte, 1, MSG_NOSIGNAL) != 1) dropped = true;
      pollfd p{fd, POLLIN, 0};
      if (!dropped && poll(&p, 1, 100) > 0) {  // the pace of the trickle: 100 ms a byte
        char buf[512];
        dropped = read(fd, buf, sizeof buf) <= 0;
      }
    }
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_TRUE(dropped) << (in_body ? "body" : "header") << ": still connected after " << waited << " s";
    EXPECT_LT(waited, 2.0) << (in_body ? "body" : "header") << ": the deadline is 1 s";
    close(fd);
  }
  EXPECT_TRUE(healthy());
}

// HTTP/1.0 has no chunked encoding: a stream is the raw body ended by the close, a whole
// answer carries its length.
TEST_F(ServerTest, Http10IsAnsweredWithoutChunking) {
  const int port = server_->port();
  const std::string streamed = raw_exchange(
      port, post_request(R"({"prompt": "the quick", "max_tokens": 4, "stream": true, "ignore_eos": true})", "HTTP/1.0"));
  EXPECT_EQ(status_of(streamed), 200) << streamed.substr(0, 200);
  EXPECT_EQ(head_of(streamed).find("hunked"), std::string::npos) << head_of(streamed);
  const std::string sb = body_of(streamed);
  EXPECT_EQ(sb.rfind("data: {", 0), 0u) << sb.substr(0, 80);
  ASSERT_GE(sb.size(), 14u);
  EXPECT_EQ(sb.substr(sb.size() - 14), "data: [DONE]\n\n");
  const std::string whole = raw_exchange(
      port, post_request(R"({"prompt": "the quick", "max_tokens": 4, "ignore_eos": true})", "HTTP/1.0"));
  EXPECT_EQ(status_of(whole), 200);
  EXPECT_EQ(head_of(whole).find("hunked"), std::string::npos) << head_of(whole);
  const json j = json::parse(body_of(whole), nullptr, false);
  ASSERT_TRUE(j.is_object()) << body_of(whole);
  EXPECT_EQ(j["usage"]["completion_tokens"], 4);
}

// Three requests in one write, the last asking to close: three answers, in order.
TEST_F(ServerTest, PipelinedRequestsAreAnsweredInOrder) {
  const std::string auth = "Authorization: Bearer " + std::string(kKey) + "\r\n";
  const std::string reqs = "GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n" + auth + "\r\n" +
                           post_request(R"({"prompt": "the lazy dog", "max_tokens": 3, "ignore_eos": true})") +
                           "GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n" + auth + "Connection: close\r\n\r\n";
  const std::string out = raw_exchange(server_->port(), reqs);
  const size_t a = out.find("HTTP/1.1 200"), b = out.find("HTTP/1.1 200", a + 1), c = out.find("HTTP/1.1 200", b + 1);
  ASSERT_NE(c, std::string::npos) << out;
  EXPECT_NE(out.substr(a, b - a).find("\"object\":\"list\""), std::string::npos);
  EXPECT_NE(out.substr(b, c - b).find("text_completion"), std::string::npos);
  EXPECT_NE(out.substr(c).find("\"status\":\"ok\""), std::string::npos);
}

// A client that sends its request and then shuts down its sending side still gets its answer.
TEST_F(ServerTest, HalfClosedClientIsStillAnswered) {
  for (bool stream : {false, true}) {
    int fd = connect_local(server_->port());
    ASSERT_GE(fd, 0);
    json body = {{"prompt", "the quick"}, {"max_tokens", 5}, {"ignore_eos", true}, {"stream", stream}};
    const std::string req = post_request(body.dump());
    ASSERT_EQ(write(fd, req.data(), req.size()), static_cast<ssize_t>(req.size()));
    shutdown(fd, SHUT_WR);
    const std::string out = read_until_close(fd, 10);
    close(fd);
    EXPECT_EQ(status_of(out), 200) << out.substr(0, 200);
    EXPECT_NE(out.find(stream ? "data: [DONE]" : "\"completion_tokens\":5"), std::string::npos) << out;
  }
}

// An invalid Content-Length is a 400 at once, not a wait for the read timeout (1 s here).
TEST_F(ServerTest, InvalidContentLengthIsRefusedAtOnce) {
  for (const char* cl : {"Content-Length: -5\r\n", "Content-Length: abc\r\n", "Content-Length: 1e3\r\n",
                         "Content-Length: 5\r\nContent-Length: 6\r\n", "Content-Length: 99999999999999999999999\r\n"}) {
    const auto t0 = std::chrono::steady_clock::now();
    const std::string out = raw_exchange(server_->port(), "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " +
                                                              std::string(kKey) + "\r\n" + cl + "\r\n{\"prompt\":");
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_TRUE(status_of(out) == 400 || status_of(out) == 413) << cl << out.substr(0, 100);
    EXPECT_LT(waited, 0.5) << cl;
  }
  EXPECT_TRUE(healthy());
}

TEST_F(ServerTest, UnauthorizedCarriesWwwAuthenticate) {
  auto c = client(false);
  auto r = c.Get("/v1/models");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 401);
  EXPECT_EQ(r->get_header_value("WWW-Authenticate").rfind("Bearer", 0), 0u) << r->get_header_value("WWW-Authenticate");
}

// ==== issue 29: correct answers ====================================================================

TEST_F(ServerTest, NLargerThanSlotsAndQueueIs400NotA429) {
  // 2 slots + 4 queued: n = 7 can never run.
  Reply r = post("/v1/completions", json{{"prompt", "a"}, {"n", 7}, {"max_tokens", 2}});
  EXPECT_EQ(r.status, 400) << r.raw;
  EXPECT_EQ(r.body["error"]["param"], "n");
  Reply ok = post("/v1/completions", json{{"prompt", "a"}, {"n", 6}, {"max_tokens", 2}, {"ignore_eos", true}});
  EXPECT_EQ(ok.status, 200) << ok.raw;
  wait_idle();
}

TEST_F(ServerTest, UnsupportedFieldsAre400) {
  const std::string H = "/v1/chat/completions";
  const std::vector<std::tuple<std::string, std::string, std::string>> cases = {
      {"/v1/completions", R"({"prompt": "a", "best_of": 3})", "best_of"},
      {"/v1/completions", R"({"prompt": "a", "suffix": "and then"})", "suffix"},
      {H, R"({"messages": [{"role": "user", "content": "a"}], "tools": [{"type": "function"}]})", "tools"},
      {H, R"({"messages": [{"role": "user", "content": "a"}], "response_format": {"type": "json_object"}})",
       "response_format"},
      {"/v1/completions", R"({"prompt": "a", "logit_bias": {"x": 1}})", "logit_bias"},
      {"/v1/completions", R"({"prompt": "a", "logit_bias": {"5": 500}})", "logit_bias"},
      {"/v1/completions", R"({"prompt": "a", "logit_bias": {"99999": 5}})", "logit_bias"},
  };
  for (const auto& [path, body, param] : cases) {
    Reply r = post(path, body);
    EXPECT_EQ(r.status, 400) << body << ": " << r.raw;
    EXPECT_EQ(r.body["error"]["param"], param) << body;
  }
  // What means "nothing special" is accepted.
  EXPECT_EQ(post("/v1/completions", R"({"prompt": "a", "max_tokens": 1, "best_of": 1, "suffix": null})").status, 200);
  wait_idle();
}

// text_offset: each token's character offset in the choice's text, continued across chunks.
TEST_F(ServerTest, LogprobsTextOffsetsAreFilled) {
  for (bool stream : {false, true}) {
    json req = {{"prompt", "the quick brown"}, {"max_tokens", 8}, {"temperature", 0}, {"ignore_eos", true},
                {"logprobs", 1}, {"stream", stream}};
    std::vector<std::string> tokens;
    std::vector<int64_t> offsets;
    std::string text;
    Reply r = post("/v1/completions", req);
    ASSERT_EQ(r.status, 200) << r.raw;
    if (!stream) {
      text = text_of(r);
      for (const auto& t : r.body["choices"][0]["logprobs"]["tokens"]) tokens.push_back(t);
      for (const auto& o : r.body["choices"][0]["logprobs"]["text_offset"]) offsets.push_back(o);
    } else {
      std::istringstream in(r.raw);
      std::string line;
      while (std::getline(in, line)) {
        if (line.rfind("data: {", 0) != 0) continue;
        const json c = json::parse(line.substr(6))["choices"][0];
        text += c["text"].get<std::string>();
        if (c["logprobs"].is_null()) continue;
        for (const auto& t : c["logprobs"]["tokens"]) tokens.push_back(t);
        for (const auto& o : c["logprobs"]["text_offset"]) offsets.push_back(o);
      }
    }
    ASSERT_EQ(tokens.size(), 8u);
    ASSERT_EQ(offsets.size(), 8u);
    int64_t at = 0;
    for (size_t k = 0; k < tokens.size(); ++k) {
      EXPECT_EQ(offsets[k], at) << "token " << k << (stream ? " (stream)" : "");
      for (unsigned char ch : tokens[k]) at += (ch & 0xC0) != 0x80;
    }
    EXPECT_GT(at, 0);
  }
  wait_idle();
}

// logit_bias moves greedy decoding: +100 on a token makes it every token; -100 on the
// greedy choice bans it.
TEST_F(ServerTest, LogitBiasIsApplied) {
  const json base = {{"prompt", "the quick brown"}, {"max_tokens", 6}, {"temperature", 0}, {"ignore_eos", true},
                     {"logprobs", 0}};
  Reply plain = post("/v1/completions", base);
  ASSERT_EQ(plain.status, 200);
  const auto greedy = plain.body["choices"][0]["logprobs"]["tokens"];
  const std::vector<int32_t> fox = encode(" fox");
  ASSERT_FALSE(fox.empty());
  json forced = base;
  forced["logit_bias"] = {{std::to_string(fox[0]), 100}};
  Reply f = post("/v1/completions", forced);
  ASSERT_EQ(f.status, 200) << f.raw;
  std::string piece;
  ASSERT_TRUE(tok_->decode({fox[0]}, &piece).is_ok());
  std::string want;
  for (int i = 0; i < 6; ++i) want += piece;
  EXPECT_EQ(text_of(f), want);
  // The first greedy token banned: the first token differs.
  Reply first = post("/v1/completions", json{{"prompt", "the quick brown"}, {"max_tokens", 1}, {"temperature", 0},
                                             {"logprobs", 1}});
  const std::string top = first.body["choices"][0]["logprobs"]["tokens"][0];
  std::vector<int32_t> top_ids;
  ASSERT_TRUE(tok_->encode(top, &top_ids).is_ok());
  json banned = base;
  banned["max_tokens"] = 1;
  banned["logit_bias"] = json::object();
  // The id of the greedy token: the engine's argmax; find it by trying the vocabulary's ids of its text.
  for (int32_t id = 0; id < 400; ++id) {
    std::string t;
    if (tok_->decode({id}, &t).is_ok() && t == top) banned["logit_bias"][std::to_string(id)] = -100;
  }
  ASSERT_FALSE(banned["logit_bias"].empty());
  Reply b = post("/v1/completions", banned);
  ASSERT_EQ(b.status, 200) << b.raw;
  EXPECT_NE(b.body["choices"][0]["logprobs"]["tokens"][0], top);
  (void)greedy;
  wait_idle();
}

// echo + logprobs scores the prompt: its text comes back first, the first token's
// log-probability is null, and each later one equals the log-probability the model gives
// that token when generating it after the tokens before (forced by logit_bias; the reported
// log-probabilities are the raw logits'). max_tokens 0 generates nothing.
TEST_F(ServerTest, EchoWithLogprobsReturnsThePromptsLogprobs) {
  const std::vector<int32_t> ids = encode("the quick brown fox jumps");
  ASSERT_GE(ids.size(), 4u);
  Reply e = post("/v1/completions", json{{"prompt", ids}, {"echo", true}, {"logprobs", 1}, {"max_tokens", 0}});
  ASSERT_EQ(e.status, 200) << e.raw;
  std::string prompt_text;
  ASSERT_TRUE(tok_->decode(ids, &prompt_text).is_ok());
  EXPECT_EQ(text_of(e), prompt_text);
  EXPECT_EQ(e.body["usage"]["completion_tokens"], 0);
  const json lp = e.body["choices"][0]["logprobs"];
  ASSERT_EQ(lp["token_logprobs"].size(), ids.size());
  EXPECT_TRUE(lp["token_logprobs"][0].is_null());
  EXPECT_TRUE(lp["top_logprobs"][0].is_null());
  EXPECT_EQ(lp["text_offset"][0], 0);
  for (size_t k = 1; k < ids.size(); ++k) {
    const std::vector<int32_t> before(ids.begin(), ids.begin() + static_cast<ptrdiff_t>(k));
    Reply g = post("/v1/completions", json{{"prompt", before},
                                           {"max_tokens", 1},
                                           {"temperature", 0},
                                           {"logprobs", 1},
                                           {"cache", false},
                                           {"logit_bias", {{std::to_string(ids[k]), 100}}}});
    ASSERT_EQ(g.status, 200) << g.raw;
    EXPECT_NEAR(lp["token_logprobs"][k].get<double>(), g.body["choices"][0]["logprobs"]["token_logprobs"][0].get<double>(),
                1e-4)
        << "position " << k;
  }
  // With generation: the text is the prompt's and then the completion's, the logprobs the
  // prompt's and then the completion's.
  Reply e2 = post("/v1/completions", json{{"prompt", "the quick brown"}, {"echo", true}, {"logprobs", 0},
                                          {"max_tokens", 3}, {"ignore_eos", true}, {"temperature", 0}});
  ASSERT_EQ(e2.status, 200);
  EXPECT_EQ(text_of(e2).rfind("the quick brown", 0), 0u) << text_of(e2);
  EXPECT_EQ(e2.body["choices"][0]["logprobs"]["tokens"].size(), encode("the quick brown").size() + 3);
  wait_idle();
}

// What the client sees is what a session keeps, and what text_offset counts (issue 52):
// text_offset is a character index into the choice's text, shared by the byte-fallback
// tokens that make one character (it had counted each as one, drifting after non-ASCII); a
// session saved where a stop string ended the text keeps the text sent and not the stop
// string or the rest of its token; echo with max_tokens 0 keeps only the prompt.
TEST_F(ServerTest, WhatTheClientSeesIsWhatASessionKeeps) {
  const std::vector<int32_t> e_acute = encode("\xC3\xA9");
  ASSERT_EQ(e_acute.size(), 2u) << "expected byte-fallback pieces for a character outside the corpus";
  std::vector<int32_t> ids = e_acute;
  const std::vector<int32_t> rest = encode("a quick fox");
  ids.insert(ids.end(), rest.begin(), rest.end());
  Reply e = post("/v1/completions", json{{"prompt", ids}, {"echo", true}, {"logprobs", 0}, {"max_tokens", 0}});
  ASSERT_EQ(e.status, 200) << e.raw;
  const json off = e.body["choices"][0]["logprobs"]["text_offset"];
  ASSERT_EQ(off.size(), ids.size());
  EXPECT_EQ(off[0], 0);
  EXPECT_EQ(off[1], 0) << "the second byte of one character starts no character of its own";
  int64_t at = 1;
  for (size_t k = 0; k < rest.size(); ++k) {
    EXPECT_EQ(off[2 + k], at) << "token " << 2 + k;
    std::string t;
    ASSERT_TRUE(tok_->decode({rest[k]}, &t).is_ok());
    at += static_cast<int64_t>(t.size());  // ASCII
  }

  // A stop string that starts inside a token.
  std::string full, stop;
  size_t cut = 0;
  for (const char* prompt : {"the quick", "the lazy dog", "a fortune", "why did the"}) {
    Reply g = post("/v1/completions", json{{"prompt", prompt}, {"max_tokens", 12}, {"temperature", 0},
                                           {"ignore_eos", true}, {"logprobs", 0}, {"cache", false}});
    ASSERT_EQ(g.status, 200) << g.raw;
    full = text_of(g);
    size_t start = 0;
    for (const json& tj : g.body["choices"][0]["logprobs"]["tokens"]) {
      const std::string t = tj.get<std::string>();
      bool ascii = t.size() >= 2;
      for (unsigned char ch : t) ascii = ascii && ch >= 0x20 && ch < 0x7F;
      if (ascii && start > 0 && full.find(t.substr(1)) == start + 1) {
        stop = t.substr(1);
        cut = start + 1;
        break;
      }
      start += t.size();
    }
    if (!stop.empty()) {
      Reply s = post("/v1/completions", json{{"prompt", prompt}, {"max_tokens", 12}, {"temperature", 0},
                                             {"ignore_eos", true}, {"stop", stop}, {"save_session", "seen"},
                                             {"cache", false}});
      ASSERT_EQ(s.status, 200) << s.raw;
      EXPECT_EQ(text_of(s), full.substr(0, cut));
      Reply kept = get("/v1/sessions/seen");
      ASSERT_EQ(kept.status, 200) << kept.raw;
      EXPECT_EQ(kept.body["text"], std::string(prompt) + full.substr(0, cut)) << "stop '" << stop << "'";
      // It continues like any session.
      Reply more = post("/v1/completions", json{{"prompt", " and"}, {"session", "seen"}, {"max_tokens", 2},
                                                {"ignore_eos", true}});
      EXPECT_EQ(more.status, 200) << more.raw;
      break;
    }
  }
  EXPECT_FALSE(stop.empty()) << "no generated token to cut a stop string from";

  // Echo scoring with save_session keeps the prompt alone.
  const std::vector<int32_t> scored = encode("the quick brown");
  Reply sc = post("/v1/completions", json{{"prompt", scored}, {"echo", true}, {"logprobs", 0}, {"max_tokens", 0},
                                          {"save_session", "scored"}});
  ASSERT_EQ(sc.status, 200) << sc.raw;
  Reply ks = get("/v1/sessions/scored");
  ASSERT_EQ(ks.status, 200) << ks.raw;
  EXPECT_EQ(ks.body["token_ids"], json(scored));
  for (const char* n : {"seen", "scored"}) client().Delete(std::string("/v1/sessions/") + n);
  wait_idle();
}

// lm-evaluation-harness at batch sizes above 1 (its local-completions model, loglikelihood):
// several prompts of token ids in one request, exactly this payload. Each prompt is its own
// choice, in order (index = prompt), and each equals the same prompt sent alone; the harness
// reads token_logprobs[ctxlen:-1] and compares each with the best of its top_logprobs.
TEST_F(ServerTest, ListOfPromptsIsAnsweredAsLmEvalHarnessReadsIt) {
  const std::vector<std::vector<int32_t>> prompts = {encode("the quick brown fox jumps"), encode("a lazy dog"),
                                                     encode("over the moon and far away")};
  const json payload = {{"model", "tiny"}, {"prompt", prompts}, {"temperature", 0},
                        {"max_tokens", 1}, {"logprobs", 1},     {"seed", 1234}, {"echo", true}};
  Reply all = post("/v1/completions", payload);
  ASSERT_EQ(all.status, 200) << all.raw;
  ASSERT_EQ(all.body["choices"].size(), prompts.size());
  int64_t prompt_tokens = 0;
  for (size_t i = 0; i < prompts.size(); ++i) {
    SCOPED_TRACE("prompt " + std::to_string(i));
    const json& c = all.body["choices"][i];
    EXPECT_EQ(c["index"], i);
    json one_payload = payload;
    one_payload["prompt"] = prompts[i];
    Reply one = post("/v1/completions", one_payload);
    ASSERT_EQ(one.status, 200) << one.raw;
    const json& o = one.body["choices"][0];
    EXPECT_EQ(c["text"], o["text"]);
    const json& lp = c["logprobs"];
    ASSERT_EQ(lp["token_logprobs"].size(), prompts[i].size() + 1);  // the prompt's, then the one generated
    EXPECT_TRUE(lp["token_logprobs"][0].is_null());
    EXPECT_EQ(lp["tokens"], o["logprobs"]["tokens"]);
    EXPECT_EQ(lp["text_offset"], o["logprobs"]["text_offset"]);
    for (size_t k = 1; k < lp["token_logprobs"].size(); ++k)
      EXPECT_NEAR(lp["token_logprobs"][k].get<double>(), o["logprobs"]["token_logprobs"][k].get<double>(), 1e-5);
    // What the harness computes: the continuation's sum and whether it is greedy.
    const size_t ctxlen = 2;
    double sum = 0;
    for (size_t k = ctxlen; k + 1 < lp["token_logprobs"].size(); ++k) {
      sum += lp["token_logprobs"][k].get<double>();
      double best = -1e30;
      for (const auto& [t, v] : lp["top_logprobs"][k].items()) best = std::max(best, v.get<double>());
      EXPECT_GE(best, lp["token_logprobs"][k].get<double>() - 1e-6);
    }
    EXPECT_TRUE(std::isfinite(sum));
    prompt_tokens += static_cast<int64_t>(prompts[i].size());
  }
  EXPECT_EQ(all.body["usage"]["prompt_tokens"], prompt_tokens);
  EXPECT_EQ(all.body["usage"]["completion_tokens"], static_cast<int64_t>(prompts.size()));

  // Its generate_until shape (a list of strings, stop strings), with n = 2: choice index =
  // prompt × n + k, each as the prompt alone with that n.
  const json gen = {{"model", "tiny"}, {"prompt", {"the quick", "a lazy"}}, {"max_tokens", 4},
                    {"temperature", 0.8}, {"stop", {"\n\n"}}, {"seed", 1234}, {"n", 2}, {"ignore_eos", true}};
  Reply g = post("/v1/completions", gen);
  ASSERT_EQ(g.status, 200) << g.raw;
  ASSERT_EQ(g.body["choices"].size(), 4u);
  for (size_t p = 0; p < 2; ++p) {
    json alone = gen;
    alone["prompt"] = gen["prompt"][p];
    Reply a = post("/v1/completions", alone);
    ASSERT_EQ(a.status, 200) << a.raw;
    for (size_t k = 0; k < 2; ++k) {
      EXPECT_EQ(g.body["choices"][p * 2 + k]["index"], p * 2 + k);
      EXPECT_EQ(g.body["choices"][p * 2 + k]["text"], a.body["choices"][k]["text"]) << "prompt " << p << ", choice " << k;
    }
  }
  // Streamed: every choice's chunks carry its index, and each ends once.
  auto c = client();
  json st = gen;
  st["stream"] = true;
  auto r = c.Post("/v1/completions", st.dump(), "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
  std::vector<int> ends(4, 0);
  std::istringstream lines(r->body);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("data: {", 0) != 0) continue;
    const json ch = json::parse(line.substr(6));
    for (const json& x : ch["choices"])
      if (!x["finish_reason"].is_null()) ++ends[x["index"].get<size_t>()];
  }
  EXPECT_EQ(ends, (std::vector<int>{1, 1, 1, 1}));
  // More prompts × n than the slots and the queue can hold is a 400, never a 429.
  Reply big = post("/v1/completions", json{{"prompt", {"a", "b", "c", "d"}}, {"n", 2}});
  EXPECT_EQ(big.status, 400) << big.raw;
  wait_idle();
}

// `laplace bench http`'s client (bench/http_load.h) against this server: as many streams as
// it admits (2 slots + 4 queued) all complete with exactly max_tokens tokens and give a rate;
// without the API key every stream fails with the 401 named; no server is an error.
TEST_F(ServerTest, BenchHttpLoadCountsStreamsTokensAndFailures) {
  HttpLoadOptions o;
  o.port = server_->port();
  o.api_key = kKey;
  o.streams = 6;
  o.prompt_len = 5;
  o.max_tokens = 300;  // long enough that no stream arrives in one read (it would have no rate)
  o.vocab = 50;
  o.timeout_s = 120;
  HttpLoadResult r;
  ASSERT_TRUE(run_http_load(o, &r).is_ok());
  EXPECT_EQ(r.ok, 6) << r.first_failure;
  EXPECT_EQ(r.rejected + r.failed, 0) << r.first_failure;
  EXPECT_EQ(r.tokens, 6 * 300);
  EXPECT_GT(r.decode_tok_s, 0);
  EXPECT_GE(r.ttft_p99_ms, r.ttft_p50_ms);
  EXPECT_GT(r.ttft_p50_ms, 0);

  o.api_key.clear();
  o.streams = 3;
  ASSERT_TRUE(run_http_load(o, &r).is_ok());
  EXPECT_EQ(r.ok, 0);
  EXPECT_EQ(r.failed, 3);
  EXPECT_NE(r.first_failure.find("status 401"), std::string::npos) << r.first_failure;

  // A port nobody listens on: bind one, note it, close it.
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  socklen_t len = sizeof a;
  ASSERT_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len), 0);
  close(fd);
  o.port = ntohs(a.sin_port);
  const Status st = run_http_load(o, &r);
  EXPECT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("no connection"), std::string::npos) << st.to_string();
  o.streams = 0;
  EXPECT_EQ(run_http_load(o, &r).code(), Status::Code::kInvalidArgument);
}

TEST_F(ServerTest, ErrorsDoNotRevealAbsolutePathsAndSessionFilesAreOwnerOnly) {
  ASSERT_EQ(post("/v1/sessions", json{{"name", "private"}, {"prompt", "the quick"}}).status, 200);
  Reply saved = post("/v1/sessions/private/save", std::string("{}"));
  ASSERT_EQ(saved.status, 200) << saved.raw;
  struct stat st {};
  EXPECT_EQ(saved.body["file"], "private.session");
  EXPECT_EQ(saved.raw.find(*dir_), std::string::npos) << "a save's answer names no absolute path: " << saved.raw;
  ASSERT_EQ(::stat((*dir_ + "/sessions/private.session").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  // A damaged file: the error names what is wrong, not where the server keeps its files.
  std::ofstream(*dir_ + "/sessions/broken.session", std::ios::binary) << "short";
  Reply bad = post("/v1/sessions/broken/restore", std::string("{}"));
  EXPECT_EQ(bad.status, 400) << bad.raw;
  EXPECT_EQ(bad.raw.find(*dir_), std::string::npos) << bad.raw;
  EXPECT_EQ(bad.raw.find("/tmp"), std::string::npos) << bad.raw;
}

// ==== issue 29: sessions ============================================================================

// Saves of one name from many clients at once, while the session under that name changes
// between two contexts: the file is always one whole save. (With one temporary per process
// the saves truncated and interleaved each other: files empty, cut short, or mixing two
// sessions' bytes that restored with 200 and the wrong state.)
TEST_F(ServerTest, ConcurrentSavesOfOneNameNeverMixSessions) {
  ASSERT_EQ(post("/v1/sessions", json{{"name", "mixA"}, {"prompt", "the quick brown fox jumps over the lazy dog"}}).status,
            200);
  ASSERT_EQ(post("/v1/sessions", json{{"name", "mixB"}, {"prompt", "why did the programmer quit"}}).status, 200);
  const auto ctx = [&](const char* n) { return get(std::string("/v1/sessions/") + n).body["token_ids"]; };
  const json a = ctx("mixA"), b = ctx("mixB");
  for (int round = 0; round < 6; ++round) {
    std::vector<std::thread> th;
    std::atomic<int> failed{0};
    for (int t = 0; t < 6; ++t)
      th.emplace_back([&, t] {
        for (int i = 0; i < 3; ++i) {
          if (post(std::string("/v1/sessions/") + ((t + i) % 2 ? "mixA" : "mixB") + "/fork", json{{"name", "mix"}}).status != 200)
            ++failed;
          if (post("/v1/sessions/mix/save", std::string("{}")).status != 200) ++failed;
        }
      });
    for (auto& x : th) x.join();
    EXPECT_EQ(failed.load(), 0);
    auto cl = client();
    ASSERT_EQ(cl.Delete("/v1/sessions/mix")->status, 200);
    Reply r = post("/v1/sessions/mix/restore", std::string("{}"));
    ASSERT_EQ(r.status, 200) << "round " << round << ": " << r.raw;
    const json got = ctx("mix");
    EXPECT_TRUE(got == a || got == b) << "round " << round << ": a context of neither session";
  }
  for (const auto& e : fs::directory_iterator(*dir_ + "/sessions"))
    EXPECT_EQ(e.path().filename().string().find(".tmp."), std::string::npos) << e.path();
}

// save_session when a stop string ends the request: the context up to the stop is kept (it
// was silently skipped, the request being cancelled at the stop).
TEST_F(ServerTest, SaveSessionWorksWhenAStopStringEndsTheRequest) {
  const json base = {{"prompt", "the lazy dog"}, {"max_tokens", 12}, {"temperature", 0}, {"ignore_eos", true}};
  Reply plain = post("/v1/completions", base);
  ASSERT_EQ(plain.status, 200);
  const std::string text = text_of(plain);
  ASSERT_GE(text.size(), 6u) << text;
  // Two printable ASCII characters from the middle on (the random model emits other bytes too).
  std::string stop;
  for (size_t at = text.size() / 2; at + 2 <= text.size() && stop.empty(); ++at)
    if (std::isalnum(static_cast<unsigned char>(text[at])) && std::isalnum(static_cast<unsigned char>(text[at + 1])))
      stop = text.substr(at, 2);
  ASSERT_FALSE(stop.empty()) << text;
  json req = base;
  req["stop"] = stop;
  req["save_session"] = "stopped";
  Reply r = post("/v1/completions", req);
  ASSERT_EQ(r.status, 200) << r.raw;
  EXPECT_EQ(r.body["choices"][0]["finish_reason"], "stop");
  Reply s = get("/v1/sessions/stopped");
  ASSERT_EQ(s.status, 200) << "the session was not saved: " << s.raw;
  const std::vector<int32_t> ctx = s.body["token_ids"].get<std::vector<int32_t>>();
  const std::vector<int32_t> prompt = encode("the lazy dog");
  EXPECT_GT(ctx.size(), prompt.size());
  EXPECT_LT(ctx.size(), prompt.size() + 12) << "the context ends at the stop";
  // It continues exactly like its context fed again.
  json cont = {{"prompt", " over"}, {"session", "stopped"}, {"max_tokens", 5}, {"temperature", 0}, {"ignore_eos", true}};
  std::vector<int32_t> full = ctx;
  const std::vector<int32_t> over = encode(" over");
  full.insert(full.end(), over.begin(), over.end());
  Reply c1 = post("/v1/completions", cont);
  Reply c2 = post("/v1/completions", json{{"prompt", full}, {"max_tokens", 5}, {"temperature", 0}, {"cache", false},
                                          {"ignore_eos", true}});
  EXPECT_EQ(text_of(c1), text_of(c2));
  wait_idle();
}

// A state or logits that are not finite are refused at restore (they were taken, and every
// continuation answered garbage).
TEST_F(ServerTest, RestoreRefusesNonFiniteStates) {
  ASSERT_EQ(post("/v1/sessions", json{{"name", "finite"}, {"prompt", "the quick brown fox"}}).status, 200);
  ASSERT_EQ(post("/v1/sessions/finite/save", std::string("{}")).status, 200);
  SafeTensorsReader r;
  ASSERT_TRUE(SafeTensorsReader::open(*dir_ + "/sessions/finite.session", &r).is_ok());
  for (const char* which : {"state", "logits"}) {
    std::vector<NamedTensor> t;
    std::vector<std::vector<uint8_t>> keep;
    keep.reserve(4);
    for (const char* name : {"state", "logits", "snapshot_tokens", "context"}) {
      const SafeTensorInfo* info = r.find(name);
      ASSERT_NE(info, nullptr);
      keep.emplace_back(r.bytes(*info), r.bytes(*info) + info->nbytes());
      if (std::string(name) == which) {
        float* f = reinterpret_cast<float*>(keep.back().data());
        f[keep.back().size() / sizeof(float) / 2] = std::numeric_limits<float>::quiet_NaN();
      }
      t.push_back({name, Tensor(keep.back().data(), info->dtype, {info->shape[0]})});
    }
    ASSERT_TRUE(safetensors_write(*dir_ + "/sessions/nonfinite.session", t, r.metadata()).is_ok());
    Reply bad = post("/v1/sessions/nonfinite/restore", std::string("{}"));
    EXPECT_EQ(bad.status, 400) << which << ": " << bad.raw;
    EXPECT_NE(bad.raw.find("finite"), std::string::npos) << bad.raw;
  }
  // Not taken into memory: asked for by name, it is read from its file again, and refused again.
  Reply again = get("/v1/sessions/nonfinite");
  EXPECT_EQ(again.status, 400) << again.raw;
  EXPECT_NE(again.raw.find("finite"), std::string::npos) << again.raw;
}

// POST /v1/sessions is admitted like any request: with every slot and queue place taken
// (the engine held, so they stay taken) it is a 429 with Retry-After, not a prefill that
// blocks a thread behind them.
TEST_F(ServerTest, SessionCreationIsAdmittedLikeAnyRequest) {
  wait_idle();
  server_->hold_engine(true);
  std::vector<int> fds;
  for (int i = 0; i < 6; ++i) {  // 2 slots + 4 queued
    int fd = connect_local(server_->port());
    ASSERT_GE(fd, 0);
    const std::string req =
        post_request(json{{"prompt", "held " + std::to_string(i)}, {"max_tokens", 3}, {"stream", true}}.dump(),
                     "HTTP/1.1", "Connection: close\r\n");
    ASSERT_EQ(write(fd, req.data(), req.size()), static_cast<ssize_t>(req.size()));
    char buf[64];
    ASSERT_GT(read(fd, buf, sizeof buf), 0);  // the stream's head: admitted
    EXPECT_EQ(std::string(buf, 12), "HTTP/1.1 200");
    fds.push_back(fd);
  }
  auto c = client();
  auto r = c.Post("/v1/sessions", json{{"name", "blocked"}, {"prompt", "the quick"}}.dump(), "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 429) << r->body;
  EXPECT_EQ(r->get_header_value("Retry-After"), "1");
  server_->hold_engine(false);
  for (int fd : fds) {
    EXPECT_NE(read_until_close(fd, 20).find("data: [DONE]"), std::string::npos);
    close(fd);
  }
  wait_idle();
  EXPECT_EQ(post("/v1/sessions", json{{"name", "blocked"}, {"prompt", "the quick"}}).status, 200);
}

// The caps on sessions hold for every way in — create, fork, save_session, restore — with a
// 429 and Retry-After; save_session at the cap is refused before it runs (it answered 200 and
// saved nothing); the disk caps refuse a save with 507.
TEST(ServerSessions, CapsHoldForEveryWayInAndOnDisk) {
  const std::string dir = make_model_dir();
  ServerOptions o;
  o.model_dir = dir;
  o.port = 0;
  o.device = server_device();
  o.engine.max_slots = 2;
  o.session_dir = dir + "/sessions";
  o.max_sessions = 2;
  o.max_session_files = 1;
  Server srv(o);
  ASSERT_TRUE(srv.start().is_ok());
  ASSERT_TRUE(srv.wait_ready().is_ok());
  auto call = [&](const std::string& path, const json& body) {
    httpc::Client c("127.0.0.1", srv.port());
    auto r = c.Post(path, body.dump(), "application/json");
    return r ? std::make_tuple(r->status, r->get_header_value("Retry-After"), r->body)
             : std::make_tuple(0, std::string(), std::string());
  };
  EXPECT_EQ(std::get<0>(call("/v1/sessions", json{{"name", "a"}, {"prompt", "the quick"}})), 200);
  EXPECT_EQ(std::get<0>(call("/v1/sessions", json{{"name", "b"}, {"prompt", "the lazy"}})), 200);
  for (const auto& [path, body] : std::vector<std::pair<std::string, json>>{
           {"/v1/sessions", json{{"name", "c"}, {"prompt", "a fortune"}}},
           {"/v1/sessions/a/fork", json{{"name", "c"}}},
           {"/v1/completions", json{{"prompt", "the dog"}, {"max_tokens", 2}, {"save_session", "c"}}}}) {
    const auto [status, retry, text] = call(path, body);
    EXPECT_EQ(status, 429) << path << ": " << text;
    EXPECT_EQ(retry, "1") << path;
  }
  httpc::Client g("127.0.0.1", srv.port());
  EXPECT_EQ(g.Get("/v1/sessions/c")->status, 404) << "nothing saved";
  // Replacing a session that exists is within the cap.
  EXPECT_EQ(std::get<0>(call("/v1/completions", json{{"prompt", " dog"}, {"session", "a"}, {"max_tokens", 2},
                                                      {"save_session", "a"}, {"ignore_eos", true}})),
            200);
  // Disk: one file at most.
  EXPECT_EQ(std::get<0>(call("/v1/sessions/a/save", json::object())), 200);
  const auto [st, ra, text] = call("/v1/sessions/b/save", json::object());
  EXPECT_EQ(st, 507) << text;
  // A restore of a third name is held to the cap too (it bypassed it).
  fs::copy_file(dir + "/sessions/a.session", dir + "/sessions/c.session");
  const auto [rs, rra, rtext] = call("/v1/sessions/c/restore", json::object());
  EXPECT_EQ(rs, 429) << rtext;
  EXPECT_EQ(rra, "1");
  EXPECT_EQ(srv.counters().sessions, 2);
  srv.stop();
  std::error_code ec;
  fs::remove_all(dir, ec);
}

// A `laplace serve` killed (SIGKILL) in the middle of saving a session leaves the previous
// save whole; the next server removes the dead writer's temporary at start and restores it.
TEST(ServerSessions, KillDuringASaveLeavesTheLastSaveWholeAndItsTemporaryIsCleaned) {
  const std::string dir = make_model_dir();
  const std::string sdir = dir + "/sessions";
  int out[2];
  ASSERT_EQ(pipe(out), 0);
  const pid_t pid = fork();
  if (pid == 0) {
    dup2(out[1], 1);
    close(out[0]);
    setenv("LAPLACE_TEST_KILL_DURING_WRITE", ".session:2", 1);
    execl(LAPLACE_BINARY, LAPLACE_BINARY, "serve", "--model", dir.c_str(), "--port", "0", "--max-slots", "2",
          "--session-dir", sdir.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  close(out[1]);
  std::string log;
  int port = 0;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (log.find("ready") == std::string::npos && std::chrono::steady_clock::now() < until) {
    pollfd p{out[0], POLLIN, 0};
    if (poll(&p, 1, 200) <= 0) continue;
    char buf[512];
    const ssize_t n = read(out[0], buf, sizeof buf);
    if (n <= 0) break;
    log.append(buf, static_cast<size_t>(n));
  }
  const size_t at = log.find("127.0.0.1:");
  ASSERT_NE(at, std::string::npos) << log;
  port = std::atoi(log.c_str() + at + 10);
  ASSERT_NE(log.find("ready"), std::string::npos) << log;
  httpc::Client c("127.0.0.1", port);
  ASSERT_EQ(c.Post("/v1/sessions", R"({"name": "s", "prompt": "the quick brown fox"})", "application/json")->status, 200);
  ASSERT_EQ(c.Post("/v1/sessions/s/save", "{}", "application/json")->status, 200);
  httpc::Client c2("127.0.0.1", port);
  ASSERT_EQ(c2.Post("/v1/sessions", R"({"name": "s", "prompt": "why did the programmer quit"})", "application/json")->status,
            200);
  auto killed = c2.Post("/v1/sessions/s/save", "{}", "application/json");  // the second write: killed half way
  EXPECT_FALSE(killed);
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
  close(out[0]);
  int temporaries = 0;
  for (const auto& e : fs::directory_iterator(sdir)) temporaries += e.path().filename().string().find(".tmp.") != std::string::npos;
  EXPECT_EQ(temporaries, 1) << "the killed save's temporary";
  ServerOptions o;
  o.model_dir = dir;
  o.port = 0;
  o.engine.max_slots = 2;
  o.session_dir = sdir;
  Server srv(o);
  ASSERT_TRUE(srv.start().is_ok());
  ASSERT_TRUE(srv.wait_ready().is_ok());
  for (const auto& e : fs::directory_iterator(sdir))
    EXPECT_EQ(e.path().filename().string().find(".tmp."), std::string::npos) << "not cleaned: " << e.path();
  httpc::Client c3("127.0.0.1", srv.port());
  auto r = c3.Post("/v1/sessions/s/restore", "{}", "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200) << r->body;
  auto info = c3.Get("/v1/sessions/s");
  Tokenizer tok;
  ASSERT_TRUE(Tokenizer::load(dir + "/tokenizer.model", &tok).is_ok());
  std::vector<int32_t> first;
  ASSERT_TRUE(tok.encode("the quick brown fox", &first).is_ok());
  EXPECT_EQ(json::parse(info->body)["token_ids"].get<std::vector<int32_t>>(), first) << "the first save, whole";
  srv.stop();
  std::error_code ec;
  fs::remove_all(dir, ec);
}

// ==== issue 29: graceful stop ==========================================================================

struct RawStream {
  int fd = -1;
  std::string got;
};

RawStream open_stream(int port, const json& body, bool read_head) {
  RawStream s;
  s.fd = connect_local(port);
  const std::string req = "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: " +
                          std::to_string(body.dump().size()) + "\r\nConnection: close\r\n\r\n" + body.dump();
  (void)!write(s.fd, req.data(), req.size());
  if (read_head) {
    timeval tv{30, 0};
    setsockopt(s.fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    char buf[4096];
    const ssize_t n = read(s.fd, buf, sizeof buf);
    if (n > 0) s.got.append(buf, static_cast<size_t>(n));
  }
  return s;
}

// Within the grace, running requests finish normally and new ones are refused with 503.
TEST(ServerShutdown, RunningRequestsFinishWithinTheGrace) {
  const std::string dir = make_model_dir();
  ServerOptions o;
  o.model_dir = dir;
  o.port = 0;
  o.device = server_device();
  o.engine.max_slots = 2;
  Server srv(o);
  ASSERT_TRUE(srv.start().is_ok());
  ASSERT_TRUE(srv.wait_ready().is_ok());
  const int port = srv.port();
  srv.hold_engine(true);  // both requests stay running until the stop has begun
  RawStream s = open_stream(port, json{{"prompt", "the quick"}, {"max_tokens", 300}, {"stream", true}, {"ignore_eos", true}}, true);
  RawStream w = open_stream(port, json{{"prompt", "the lazy"}, {"max_tokens", 200}, {"ignore_eos", true}}, false);
  ASSERT_EQ(status_of(s.got), 200);
  ASSERT_TRUE(eventually([&] { return srv.counters().outstanding == 2; }, 30));
  std::thread stopper([&] { srv.shutdown(60); });
  // The stop has begun once /health says so; from then on a new request is refused. Waiting
  // for that first keeps a loaded machine (the stopper not yet scheduled) from failing this.
  httpc::Client c("127.0.0.1", port);
  EXPECT_TRUE(eventually([&] {
    auto h = c.Get("/health");
    return h && h->status == 503 && h->body.find("stopping") != std::string::npos;
  }, 30));
  auto late = c.Post("/v1/completions", R"({"prompt": "late", "max_tokens": 2})", "application/json");
  ASSERT_TRUE(late);
  EXPECT_EQ(late->status, 503) << late->body;
  EXPECT_EQ(late->get_header_value("Retry-After"), "1");
  EXPECT_NE(late->body.find("server_shutdown"), std::string::npos) << late->body;
  srv.hold_engine(false);
  const std::string sb = s.got + read_until_close(s.fd, 60);
  const std::string wb = read_until_close(w.fd, 60);
  stopper.join();
  EXPECT_NE(sb.find("data: [DONE]"), std::string::npos);
  EXPECT_EQ(sb.find("server_shutdown"), std::string::npos) << "finished within the grace";
  EXPECT_EQ(status_of(wb), 200);
  EXPECT_NE(wb.find("\"completion_tokens\":200"), std::string::npos) << wb.substr(0, 300);
  close(s.fd);
  close(w.fd);
  std::error_code ec;
  fs::remove_all(dir, ec);
}

// After the grace, a stream ends with an error event and [DONE]; a non-streamed answer whose
// head went out gets an error object as its body, never an empty 200.
TEST(ServerShutdown, AfterTheGraceAnswersEndWithAnErrorNeverEmpty) {
  const std::string dir = make_model_dir();
  ServerOptions o;
  o.model_dir = dir;
  o.port = 0;
  o.device = server_device();
  o.engine.max_slots = 2;
  o.limits.max_tokens = 100000;
  Server srv(o);
  ASSERT_TRUE(srv.start().is_ok());
  ASSERT_TRUE(srv.wait_ready().is_ok());
  const int port = srv.port();
  const json endless = {{"prompt", "the quick"}, {"max_tokens", 90000}, {"ignore_eos", true}};
  json st = endless;
  st["stream"] = true;
  RawStream s = open_stream(port, st, true);
  RawStream w = open_stream(port, endless, true);  // its head comes with the first space (0.5 s)
  ASSERT_EQ(status_of(s.got), 200);
  ASSERT_EQ(status_of(w.got), 200);
  srv.shutdown(0.2);
  const std::string sb = s.got + read_until_close(s.fd, 10);
  const std::string wb = w.got + read_until_close(w.fd, 10);
  const size_t err = sb.find("\"code\":\"server_shutdown\"");
  EXPECT_NE(err, std::string::npos) << sb.substr(sb.size() > 300 ? sb.size() - 300 : 0);
  EXPECT_NE(sb.find("data: [DONE]", err == std::string::npos ? 0 : err), std::string::npos);
  // The non-streamed body: whitespace, then an error object.
  std::string body;
  std::istringstream in(body_of(wb));
  for (std::string line; std::getline(in, line);) {  // drop the chunk framing
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.find_first_not_of("0123456789abcdef") == std::string::npos) continue;
    body += line;
  }
  const json j = json::parse(body, nullptr, false);
  ASSERT_TRUE(j.is_object()) << wb.substr(0, 400);
  EXPECT_EQ(j["error"]["code"], "server_shutdown");
  close(s.fd);
  close(w.fd);
  std::error_code ec;
  fs::remove_all(dir, ec);
}

// ==== issue 29: load ==================================================================================

// 2,200 streaming connections at once to a server of 512 slots and a queue of 1,536 (tiny
// model, CPU, loopback): with the engine held until every client has its answer's head,
// exactly 2,048 are accepted and 152 get 429 with Retry-After; then every accepted stream
// completes with all its tokens and [DONE]; /health answers within 50 ms (p99) throughout;
// the resident memory returns to its baseline. Twice: the first round is the warm-up the
// baseline is taken after. Run alone (ctest server_load): its latency bound assumes the
// machine is not shared with other tests.
TEST(ServerLoad, TwoThousandStreamsCompleteOr429WhileHealthStaysFast) {
  if (!std::getenv("LAPLACE_SERVER_LOAD")) GTEST_SKIP() << "run by ctest as server_load (alone), LAPLACE_SERVER_LOAD=1";
  const int conns = 2200, accepted_want = 2048, tokens = 64;
  rlimit rl{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &rl), 0);
  rl.rlim_cur = rl.rlim_max;
  setrlimit(RLIMIT_NOFILE, &rl);
  getrlimit(RLIMIT_NOFILE, &rl);
  if (rl.rlim_cur < static_cast<rlim_t>(2 * conns + 256)) GTEST_SKIP() << "RLIMIT_NOFILE hard limit " << rl.rlim_max;
  const std::string dir = make_model_dir();
  ServerOptions o;
  o.model_dir = dir;
  o.port = 0;
  o.device = "cpu";
  o.engine.max_slots = 512;
  o.max_queue = accepted_want - 512;
  o.cache_bytes = 0;
  o.engine.cache_slots = 0;
  o.threads = 2;
  o.read_timeout_s = 30;
  Server srv(o);
  ASSERT_TRUE(srv.start().is_ok());
  ASSERT_TRUE(srv.wait_ready().is_ok());
  const int port = srv.port();

  struct Conn {
    int fd = -1;
    std::string out, in;
    size_t sent = 0;
    int status = 0;
    bool closed = false;
  };
  auto round = [&](int r, std::vector<double>* health_ms) {
    srv.hold_engine(true);
    std::atomic<bool> done{false};
    std::mutex mu;
    std::condition_variable cv;
    std::thread health([&] {
      httpc::Client c("127.0.0.1", port);
      c.set_keep_alive(true);
      c.set_read_timeout(10);
      while (!done.load()) {
        const auto t0 = std::chrono::steady_clock::now();
        auto h = c.Get("/health");
        const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
        health_ms->push_back(h && h->status == 200 ? ms : 1e9);
        std::unique_lock<std::mutex> lk(mu);
        cv.wait_for(lk, std::chrono::milliseconds(5), [&] { return done.load(); });  // the poll's pace
      }
    });
    std::vector<Conn> cs(conns);
    const int ep = epoll_create1(0);
    for (int i = 0; i < conns; ++i) {
      Conn& c = cs[i];
      c.fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
      ASSERT_GE(c.fd, 0) << "socket " << i;
      sockaddr_in a{};
      a.sin_family = AF_INET;
      a.sin_port = htons(static_cast<uint16_t>(port));
      a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      connect(c.fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
      const json body = {{"prompt", "stream " + std::to_string(r) + " " + std::to_string(i)},
                         {"max_tokens", tokens}, {"stream", true}, {"ignore_eos", true}, {"temperature", 0},
                         {"stream_options", {{"include_usage", true}}}};
      c.out = "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Type: application/json\r\n"
              "Content-Length: " + std::to_string(body.dump().size()) + "\r\n\r\n" + body.dump();
      epoll_event ev{};
      ev.events = EPOLLIN | EPOLLOUT;
      ev.data.u32 = static_cast<uint32_t>(i);
      epoll_ctl(ep, EPOLL_CTL_ADD, c.fd, &ev);
    }
    int with_status = 0, open = conns;
    bool released = false;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
    std::vector<epoll_event> evs(512);
    while (open > 0 && std::chrono::steady_clock::now() < deadline) {
      const int n = epoll_wait(ep, evs.data(), static_cast<int>(evs.size()), 100);
      for (int k = 0; k < n; ++k) {
        Conn& c = cs[evs[k].data.u32];
        if ((evs[k].events & EPOLLOUT) && c.sent < c.out.size()) {
          const ssize_t w = send(c.fd, c.out.data() + c.sent, c.out.size() - c.sent, MSG_NOSIGNAL);
          if (w > 0) c.sent += static_cast<size_t>(w);
          if (c.sent == c.out.size()) {
            epoll_event ev{};
            ev.events = EPOLLIN;
            ev.data.u32 = evs[k].data.u32;
            epoll_ctl(ep, EPOLL_CTL_MOD, c.fd, &ev);
          }
        }
        if (evs[k].events & (EPOLLIN | EPOLLHUP | EPOLLERR)) {
          char buf[16384];
          for (;;) {
            const ssize_t got = read(c.fd, buf, sizeof buf);
            if (got > 0) {
              c.in.append(buf, static_cast<size_t>(got));
              continue;
            }
            if (got == 0 || (errno != EAGAIN && errno != EWOULDBLOCK)) {
              c.closed = true;
              epoll_ctl(ep, EPOLL_CTL_DEL, c.fd, nullptr);
              close(c.fd);
              --open;
            }
            break;
          }
          if (c.status == 0 && c.in.size() >= 12) {
            c.status = status_of(c.in);
            ++with_status;
          }
        }
      }
      if (!released && with_status == conns) {
        // Every client has its answer's head (or its whole 429): now let the engine run.
        int ok = 0;
        for (const Conn& c : cs) ok += c.status == 200;
        EXPECT_EQ(ok, accepted_want) << "round " << r;
        srv.hold_engine(false);
        released = true;
      }
    }
    close(ep);
    if (!released) srv.hold_engine(false);
    done.store(true);
    cv.notify_all();
    health.join();
    EXPECT_EQ(open, 0) << "round " << r << ": connections still open at the deadline";
    int ok = 0, busy = 0, bad = 0;
    std::string why;
    for (const Conn& c : cs) {
      if (c.status == 200) {
        const bool complete = c.in.find("\"completion_tokens\":" + std::to_string(tokens)) != std::string::npos &&
                              c.in.find("data: [DONE]") != std::string::npos;
        (complete ? ok : bad)++;
        if (!complete && why.empty()) why = c.in.substr(0, 600);
      } else if (c.status == 429) {
        ++busy;
        if (c.in.find("Retry-After: 1") == std::string::npos) {
          ++bad;
          if (why.empty()) why = c.in;
        }
      } else {
        ++bad;
        if (why.empty()) why = "status " + std::to_string(c.status) + ": " + c.in.substr(0, 300);
      }
    }
    EXPECT_EQ(ok, accepted_want) << "round " << r;
    EXPECT_EQ(busy, conns - accepted_want) << "round " << r;
    EXPECT_EQ(bad, 0) << "round " << r << ": " << why;
  };
  auto settle = [&] {
    // Every connection closed on the server's side and every request finished (bounded).
    for (int i = 0; i < 400 && (srv.counters().outstanding != 0 || srv.counters().connections > 0); ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(25));
    malloc_trim(0);
  };
  std::vector<double> warm_ms, ms;
  const auto t0 = std::chrono::steady_clock::now();
  round(0, &warm_ms);
  settle();
  const int64_t rss0 = process_resident_bytes();
  round(1, &ms);
  settle();
  const int64_t rss1 = process_resident_bytes();
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_GT(ms.size(), 10u);
  std::sort(ms.begin(), ms.end());
  const double p99 = ms[static_cast<size_t>(0.99 * static_cast<double>(ms.size() - 1))];
  std::printf("server load: 2 rounds of %d connections in %.1f s; /health p50 %.2f ms, p99 %.2f ms, max %.2f ms "
              "(%zu probes); rss %.1f -> %.1f MiB\n",
              conns, secs, ms[ms.size() / 2], p99, ms.back(), ms.size(), rss0 / 1048576.0, rss1 / 1048576.0);
  EXPECT_LT(p99, 50.0);
  EXPECT_EQ(srv.counters().outstanding, 0);
  EXPECT_EQ(srv.counters().engine.free_slots, 512);
  EXPECT_LT(rss1 - rss0, int64_t(32) << 20) << "rss " << rss0 << " -> " << rss1;
  srv.stop();
  std::error_code ec;
  fs::remove_all(dir, ec);
}

}  // namespace
}  // namespace laplace

#endif  // LAPLACE_HAVE_SERVER
