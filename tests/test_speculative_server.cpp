// `laplace serve --speculative ngram:K` (docs/serving.md §11) against the same server without
// it, over HTTP: greedy completions (text, logprobs, finish reasons), a stop string ending a
// completion inside a verification window, and sessions created, continued, saved to disk and
// restored give the same answers.
#ifdef LAPLACE_HAVE_SERVER

#include <gtest/gtest.h>

#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "serve/drafter.h"
#include "serve/http/server.h"
#include "tests/http_client.h"
#include "tests/test_util.h"

namespace laplace {
namespace {

using nlohmann::json;
namespace httpc = testing::httpc;

struct Answers {
  std::vector<json> choices;  // choices[0] of each completion, in order
  int64_t accepted = 0;       // the engine's accepted drafted tokens
};

Answers run_server(const std::string& model_dir, const std::string& session_dir, int64_t k, const std::string& stop) {
  ServerOptions o;
  o.model_dir = model_dir;
  o.port = 0;
  o.device = "cpu";
  o.engine.max_slots = 2;
  o.engine.prefill_chunk = 16;
  o.engine.defer_writeback = 8;
  o.engine.speculative_k = k;
  o.engine.drafter = k > 0 ? std::make_shared<NgramDrafter>() : nullptr;
  o.session_dir = session_dir;
  Server srv(o);
  EXPECT_TRUE(srv.start().is_ok());
  const Status st = srv.wait_ready();
  EXPECT_TRUE(st.is_ok()) << st.to_string();
  Answers a;
  auto post = [&](const std::string& path, const json& body, bool keep) {
    httpc::Client c("127.0.0.1", srv.port());
    c.set_read_timeout(60, 0);
    auto r = c.Post(path, body.dump(), "application/json");
    EXPECT_TRUE(r && r->status == 200) << path << ": " << (r ? r->body : "no answer");
    if (!r || r->status != 200) return;
    const json j = json::parse(r->body, nullptr, false);
    if (keep) a.choices.push_back(j["choices"][0]);
  };
  const json greedy = {{"temperature", 0}, {"ignore_eos", true}, {"logprobs", 2}};
  // A prompt that repeats itself: the n-gram drafter's ground.
  const std::string p = "the cat sat on the mat and the cat sat on the mat and the cat";
  json c1 = greedy;
  c1.update({{"prompt", p}, {"max_tokens", 40}});
  post("/v1/completions", c1, true);
  json c2 = c1;
  c2.update({{"stop", json::array({stop})}});
  post("/v1/completions", c2, true);
  post("/v1/sessions", json{{"name", "s"}, {"prompt", p}}, false);
  json s1 = greedy;
  s1.update({{"prompt", " and then"}, {"session", "s"}, {"save_session", "s2"}, {"max_tokens", 25}});
  post("/v1/completions", s1, true);
  post("/v1/sessions/s2/save", json::object(), false);
  httpc::Client c("127.0.0.1", srv.port());
  auto del = c.Delete("/v1/sessions/s2");
  EXPECT_TRUE(del && del->status == 200);
  post("/v1/sessions/s2/restore", json::object(), false);
  json s2 = greedy;
  s2.update({{"prompt", " the"}, {"session", "s2"}, {"max_tokens", 25}});
  post("/v1/completions", s2, true);
  a.accepted = srv.counters().engine.accepted_tokens;
  srv.stop();
  return a;
}

TEST(SpeculativeServer, CompletionsStopStringsAndSessionsAnswerAsWithout) {
  const std::string dir = testing::make_server_model_dir("spec_server", 77);
  // The stop string: a piece of the plain server's first answer, so that it ends a completion.
  const Answers probe = run_server(dir, dir + "/sessions_probe", 0, "\x01");
  ASSERT_FALSE(probe.choices.empty());
  const std::string text = probe.choices[0]["text"].get<std::string>();
  ASSERT_GE(text.size(), 12u);
  const std::string stop = text.substr(text.size() / 2, 3);
  const Answers plain = run_server(dir, dir + "/sessions_plain", 0, stop);
  const Answers spec = run_server(dir, dir + "/sessions_spec", 4, stop);
  ASSERT_EQ(plain.choices.size(), 4u);
  ASSERT_EQ(spec.choices.size(), 4u);
  for (size_t i = 0; i < plain.choices.size(); ++i) EXPECT_EQ(spec.choices[i], plain.choices[i]) << "completion " << i;
  EXPECT_EQ(plain.choices[1]["finish_reason"], "stop");
  EXPECT_NE(spec.accepted, 0) << "no drafted token was accepted: speculation was not exercised";
}

}  // namespace
}  // namespace laplace

#endif  // LAPLACE_HAVE_SERVER
