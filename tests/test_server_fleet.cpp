// What a fleet of replicas needs of one `laplace serve` (docs/deployment.md): who answered
// and with which model (/health, /metrics, X-Laplace-Replica), and sessions in a directory
// shared by several servers: a session saved on one continues on another, a stale copy is
// refreshed from the file, and two replicas changing one session meet a 409, never a mix.
// Two servers in this process over real sockets share the directory as two processes would
// (the save lock is an open-file-description lock: it separates them as it does processes;
// tests/test_fleet.py runs separate processes behind HAProxy).
#ifdef LAPLACE_HAVE_SERVER

#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <functional>
#include <fstream>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "core/safetensors.h"
#include "serve/http/server.h"
#include "serve/sessions.h"
#include "tests/http_client.h"
#include "tests/server_test_util.h"
#include "tests/test_util.h"

namespace laplace {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;
namespace httpc = laplace::testing::httpc;

struct Reply {
  int status = 0;
  json body;
  std::string raw, replica;
};

bool testing_eventually(const std::function<bool()>& pred) {
  for (int i = 0; i < 400; ++i) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

class Replica {
 public:
  Replica(const std::string& model_dir, const std::string& sessions, const std::string& id,
          int64_t max_connections = 0) {
    ServerOptions o;
    o.model_dir = model_dir;
    o.model_name = "tiny";
    o.port = 0;
    o.replica_id = id;
    o.engine.max_slots = 2;
    o.engine.prefill_chunk = 16;
    o.session_dir = sessions;
    o.max_connections = max_connections;
    srv_ = std::make_unique<Server>(o);
    start_status_ = srv_->start();
    if (start_status_.is_ok()) start_status_ = srv_->wait_ready();
  }
  ~Replica() { srv_->stop(); }
  const Status& start_status() const { return start_status_; }
  Server& server() { return *srv_; }

  Reply send(const std::string& method, const std::string& path, const json& body = json()) {
    httpc::Client c("127.0.0.1", srv_->port());
    c.set_read_timeout(60, 0);
    auto r = method == "GET"      ? c.Get(path)
             : method == "DELETE" ? c.Delete(path)
                                  : c.Post(path, body.is_null() ? std::string("{}") : body.dump(), "application/json");
    Reply out;
    if (!r) return out;
    out.status = r->status;
    out.raw = r->body;
    out.replica = r->get_header_value("X-Laplace-Replica");
    out.body = json::parse(r->body, nullptr, false);
    return out;
  }
  // A greedy continuation of session `name` by `tokens` tokens, kept under the same name.
  Reply continue_session(const std::string& name, int tokens) {
    return send("POST", "/v1/completions",
                json{{"prompt", " and"}, {"session", name}, {"save_session", name}, {"max_tokens", tokens},
                     {"temperature", 0}, {"ignore_eos", true}});
  }
  json context(const std::string& name) { return send("GET", "/v1/sessions/" + name).body["token_ids"]; }

 private:
  std::unique_ptr<Server> srv_;
  Status start_status_;
};

class Fleet : public ::testing::Test {
 protected:
  void SetUp() override {
    model_ = testing::make_server_model_dir("fleet_model", 77);
    sessions_ = model_ + "/shared-sessions";
    a_ = std::make_unique<Replica>(model_, sessions_, "rA");
    b_ = std::make_unique<Replica>(model_, sessions_, "rB");
    ASSERT_TRUE(a_->start_status().is_ok()) << a_->start_status().to_string();
    ASSERT_TRUE(b_->start_status().is_ok()) << b_->start_status().to_string();
  }
  void TearDown() override {
    a_.reset();
    b_.reset();
    std::error_code ec;
    fs::remove_all(model_, ec);
  }
  int64_t file_version(const std::string& name) {
    int64_t v = -1;
    std::string by;
    EXPECT_TRUE(session_file_version(sessions_ + "/" + name + ".session", &v, &by).is_ok());
    return v;
  }
  std::string model_, sessions_;
  std::unique_ptr<Replica> a_, b_;
};

// /health names the replica and the model's hash (the balancer's check compares it), every
// answer says which replica gave it, and /metrics carries both as labels.
TEST_F(Fleet, HealthAndMetricsNameTheReplicaAndTheModel) {
  Reply h = a_->send("GET", "/health");
  ASSERT_EQ(h.status, 200) << h.raw;
  EXPECT_EQ(h.body["status"], "ok");
  EXPECT_EQ(h.body["replica"], "rA");
  EXPECT_EQ(h.body["model"], "tiny");
  const std::string hash = h.body["model_hash"].get<std::string>();
  EXPECT_EQ(hash.size(), 32u);
  EXPECT_EQ(h.replica, "rA");
  EXPECT_EQ(b_->send("GET", "/health").body["model_hash"], hash) << "one model, one hash";
  EXPECT_EQ(b_->send("GET", "/v1/models").replica, "rB");
  EXPECT_EQ(a_->send("GET", "/v1/nothing-here").replica, "rA") << "errors carry it too";
  const std::string m = a_->send("GET", "/metrics").raw;
  EXPECT_NE(m.find("laplace_replica_info{replica=\"rA\",model=\"tiny\",model_hash=\"" + hash + "\"} 1"),
            std::string::npos)
      << m.substr(0, 600);

  // Other weights under the same configuration: another hash.
  const std::string other = testing::make_server_model_dir("fleet_other", 78);
  {
    Replica c(other, other + "/sessions", "rC");
    ASSERT_TRUE(c.start_status().is_ok());
    EXPECT_NE(c.send("GET", "/health").body["model_hash"], hash);
  }
  // A draining replica answers 503 at once, still naming itself (a request held in flight
  // keeps it draining for the grace period).
  a_->server().hold_engine(true);
  std::thread held([&] { a_->send("POST", "/v1/completions", json{{"prompt", "the"}, {"max_tokens", 4}}); });
  ASSERT_TRUE(testing_eventually([&] { return a_->server().counters().outstanding == 1; }));
  std::thread stopper([&] { a_->server().shutdown(2); });
  bool saw = false;
  for (int i = 0; i < 200 && !saw; ++i) {
    Reply d = a_->send("GET", "/health");
    saw = d.status == 503 && d.body["status"] == "stopping" && d.body["replica"] == "rA";
    if (!saw) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  stopper.join();
  held.join();
  EXPECT_TRUE(saw);
  std::error_code ec;
  fs::remove_all(other, ec);
}

// A connection past --max-connections is refused at once with a 503 that names the replica
// too (a balancer's log and the client then say which one was full).
TEST_F(Fleet, AConnectionOverTheLimitIsRefusedNamingTheReplica) {
  Replica small(model_, sessions_, "rSmall", 3);
  ASSERT_TRUE(small.start_status().is_ok());
  const int port = small.server().port();
  std::vector<int> held;
  std::string refused;
  for (int i = 0; i < 8 && refused.empty(); ++i) {
    const int fd = testing::srv::connect_local(port);
    ASSERT_GE(fd, 0);
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, 300) > 0) {
      refused = testing::srv::read_until_close(fd, 2);
      close(fd);
    } else {
      held.push_back(fd);  // accepted and waiting for its request
    }
  }
  for (int fd : held) close(fd);
  ASSERT_FALSE(refused.empty()) << "no connection was refused past the limit of 3";
  EXPECT_EQ(refused.rfind("HTTP/1.1 503", 0), 0u) << refused;
  EXPECT_NE(refused.find("X-Laplace-Replica: rSmall\r\n"), std::string::npos) << refused;
}

// Saved on A, continued on B: B holds nothing of it and takes it from the shared directory,
// to the same text A gives; B's save is the next version.
TEST_F(Fleet, ASessionSavedOnOneReplicaContinuesOnAnother) {
  ASSERT_EQ(a_->send("POST", "/v1/sessions", json{{"name", "s1"}, {"prompt", "the quick brown fox"}}).status, 200);
  EXPECT_EQ(b_->send("GET", "/v1/sessions/s1").status, 404) << "not saved yet: only A has it";
  Reply saved = a_->send("POST", "/v1/sessions/s1/save");
  ASSERT_EQ(saved.status, 200) << saved.raw;
  EXPECT_EQ(saved.body["version"], 1);
  EXPECT_EQ(file_version("s1"), 1);
  EXPECT_EQ(b_->context("s1"), a_->context("s1"));

  Reply on_b = b_->continue_session("s1", 6);
  ASSERT_EQ(on_b.status, 200) << on_b.raw;
  Reply on_a = a_->send("POST", "/v1/completions",
                        json{{"prompt", " and"}, {"session", "s1"}, {"max_tokens", 6}, {"temperature", 0},
                             {"ignore_eos", true}});
  ASSERT_EQ(on_a.status, 200);
  EXPECT_EQ(on_b.body["choices"][0]["text"], on_a.body["choices"][0]["text"]) << "the same state on both";
  Reply b_saved = b_->send("POST", "/v1/sessions/s1/save");
  ASSERT_EQ(b_saved.status, 200) << b_saved.raw;
  EXPECT_EQ(b_saved.body["version"], 2);
  // A's copy is version 1 and unchanged: A now takes version 2 from the file.
  EXPECT_EQ(a_->context("s1"), b_->context("s1"));
  EXPECT_EQ(a_->send("GET", "/v1/sessions/s1").body["version"], 2);
}

// Both replicas continue version 1: the first save wins (version 2); the other replica's
// changed copy is refused with 409 — on its save and on its next use — and the file stays
// the winner's whole. A restore takes the saved version, after which it goes on.
TEST_F(Fleet, TwoReplicasChangingOneSessionMeetAConflictNeverAMix) {
  ASSERT_EQ(a_->send("POST", "/v1/sessions", json{{"name", "s2"}, {"prompt", "why did the programmer quit"}}).status,
            200);
  ASSERT_EQ(a_->send("POST", "/v1/sessions/s2/save").status, 200);
  ASSERT_EQ(a_->continue_session("s2", 4).status, 200);
  ASSERT_EQ(b_->continue_session("s2", 7).status, 200);
  const json a_ctx = a_->context("s2"), b_ctx = b_->context("s2");
  ASSERT_NE(a_ctx, b_ctx);
  ASSERT_EQ(a_->send("POST", "/v1/sessions/s2/save").status, 200);
  Reply refused = b_->send("POST", "/v1/sessions/s2/save");
  EXPECT_EQ(refused.status, 409) << refused.raw;
  EXPECT_EQ(refused.body["error"]["code"], "session_conflict");
  EXPECT_NE(refused.raw.find("rA"), std::string::npos) << "names the replica that saved it: " << refused.raw;
  Reply use = b_->continue_session("s2", 2);
  EXPECT_EQ(use.status, 409) << use.raw;
  EXPECT_EQ(use.body["error"]["code"], "session_conflict");
  // The file is A's save, whole.
  EXPECT_EQ(file_version("s2"), 2);
  ASSERT_EQ(b_->send("POST", "/v1/sessions/s2/restore").status, 200);
  EXPECT_EQ(b_->context("s2"), a_ctx);
  EXPECT_EQ(b_->continue_session("s2", 3).status, 200);
  EXPECT_EQ(b_->send("POST", "/v1/sessions/s2/save").body["version"], 3);
}

// Saves racing from two replicas for one name: every answer is a 200 or a 409, the
// versions of the 200s are distinct, and the file is always one of the replicas' whole.
TEST_F(Fleet, RacingSavesFromTwoReplicasAreOrderedByVersion) {
  ASSERT_EQ(a_->send("POST", "/v1/sessions", json{{"name", "s3"}, {"prompt", "a fortune a day"}}).status, 200);
  ASSERT_EQ(a_->send("POST", "/v1/sessions/s3/save").status, 200);
  std::vector<std::pair<int64_t, std::string>> versions;  // of each 200: the version and who answered
  std::mutex mu;
  int other = 0;
  for (int round = 0; round < 4; ++round) {
    ASSERT_EQ(a_->send("POST", "/v1/sessions/s3/restore").status, 200);
    ASSERT_EQ(b_->send("POST", "/v1/sessions/s3/restore").status, 200);
    ASSERT_EQ(a_->continue_session("s3", 2).status, 200);
    ASSERT_EQ(b_->continue_session("s3", 3).status, 200);
    const json ctx_a = a_->context("s3"), ctx_b = b_->context("s3");
    ASSERT_NE(ctx_a, ctx_b);
    std::vector<std::thread> th;
    for (Replica* r : {a_.get(), b_.get(), a_.get(), b_.get()})
      th.emplace_back([&, r] {
        Reply s = r->send("POST", "/v1/sessions/s3/save");
        std::lock_guard<std::mutex> lk(mu);
        if (s.status == 200) versions.push_back({s.body["version"].get<int64_t>(), s.replica});
        else if (s.status != 409) ++other;
      });
    for (auto& t : th) t.join();
    ASSERT_EQ(b_->send("POST", "/v1/sessions/s3/restore").status, 200);
    const json file_ctx = b_->context("s3");
    EXPECT_TRUE(file_ctx == ctx_a || file_ctx == ctx_b) << "round " << round << ": the file is neither replica's save";
  }
  EXPECT_EQ(other, 0);
  // A version is one replica's: the same number twice only when a replica's second save
  // found its copy saved already.
  std::sort(versions.begin(), versions.end());
  for (size_t i = 1; i < versions.size(); ++i) {
    if (versions[i].first == versions[i - 1].first) {
      EXPECT_EQ(versions[i].second, versions[i - 1].second) << "version " << versions[i].first << " written by two";
    }
  }
  EXPECT_EQ(versions.back().first, file_version("s3"));
}

// A session file saved by other weights under the same configuration is refused; a session
// directory that cannot be one is a clear error at start.
TEST_F(Fleet, AnotherModelsSessionAndABadDirectoryAreRefused) {
  const std::string other = testing::make_server_model_dir("fleet_other2", 78);
  {
    Replica c(other, sessions_, "rC");
    ASSERT_TRUE(c.start_status().is_ok());
    ASSERT_EQ(c.send("POST", "/v1/sessions", json{{"name", "theirs"}, {"prompt", "the lazy dog"}}).status, 200);
    ASSERT_EQ(c.send("POST", "/v1/sessions/theirs/save").status, 200);
  }
  Reply r = a_->send("POST", "/v1/sessions/theirs/restore");
  EXPECT_EQ(r.status, 400) << r.raw;
  EXPECT_NE(r.raw.find("different model"), std::string::npos) << r.raw;
  EXPECT_EQ(a_->continue_session("theirs", 2).status, 400);

  std::ofstream(model_ + "/not-a-dir") << "x";
  Replica bad(model_, model_ + "/not-a-dir", "rD");
  EXPECT_FALSE(bad.start_status().is_ok());
  EXPECT_NE(bad.start_status().message().find("session"), std::string::npos) << bad.start_status().to_string();
  std::error_code ec;
  fs::remove_all(other, ec);
}

}  // namespace
}  // namespace laplace

#endif  // LAPLACE_HAVE_SERVER
