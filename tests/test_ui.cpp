// The web page of `laplace serve` (serve/http/static_files.h) over a real socket: the page and its
// files load without the API key while the API still needs it, with the right types and the
// security headers, also while no model is loaded; HEAD answers the head alone; the files
// carry no inline script or style and never build HTML from data. The page in a browser:
// tests/ui_browser.sh.
#ifdef LAPLACE_HAVE_SERVER

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <filesystem>
#include <string>

#include <gtest/gtest.h>

#include "core/file_util.h"
#include "model/model.h"
#include "serve/http/server.h"
#include "serve/http/static_files.h"
#include "tests/http_client.h"
#include "tests/test_util.h"
#include "text/tokenizer.h"

namespace laplace {
namespace {

namespace fs = std::filesystem;
namespace httpc = laplace::testing::httpc;

const char* kUiKey = "ui-secret";

// A model directory: small shapes, random weights, a trained 400-piece tokenizer.
std::string make_ui_model_dir() { return testing::make_server_model_dir("ui_model", 5); }

class UiTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string(make_ui_model_dir());
    ServerOptions o;
    o.model_dir = *dir_;
    o.model_name = "tiny";
    o.port = 0;
    o.api_key = kUiKey;
    o.engine.max_slots = 2;
    server_ = new Server(o);
    ASSERT_TRUE(server_->start().is_ok());
    Status st = server_->wait_ready();
    ASSERT_TRUE(st.is_ok()) << st.to_string();
  }
  static void TearDownTestSuite() {
    server_->stop();
    delete server_;
    std::error_code ec;
    fs::remove_all(*dir_, ec);
    delete dir_;
  }
  static httpc::Result get(const std::string& path, bool key = false) {
    httpc::Client c("127.0.0.1", server_->port());
    c.set_read_timeout(30, 0);
    if (key) c.set_bearer_token_auth(kUiKey);
    return c.Get(path);
  }
  // One request over a fresh connection; everything the server sends until it closes.
  static std::string raw(const std::string& request) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    EXPECT_GE(fd, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(server_->port()));
    ::inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
    EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
    timeval tv{10, 0};
    ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    EXPECT_EQ(::send(fd, request.data(), request.size(), MSG_NOSIGNAL), static_cast<ssize_t>(request.size()));
    std::string out;
    char buf[4096];
    for (ssize_t n; (n = ::recv(fd, buf, sizeof buf, 0)) > 0;) out.append(buf, static_cast<size_t>(n));
    ::close(fd);
    return out;
  }

  static std::string* dir_;
  static Server* server_;
};
std::string* UiTest::dir_ = nullptr;
Server* UiTest::server_ = nullptr;

const char* kPaths[] = {"/", "/ui/app.js", "/ui/style.css", "/ui/icon.svg"};

TEST_F(UiTest, PageLoadsWithoutTheKeyWhileTheApiNeedsIt) {
  auto page = get("/");
  ASSERT_TRUE(page) << httpc::to_string(page.error());
  EXPECT_EQ(page->status, 200);
  EXPECT_EQ(page->get_header_value("Content-Type"), "text/html; charset=utf-8");
  EXPECT_NE(page->body.find("<script src=\"/ui/app.js\" defer></script>"), std::string::npos);
  auto models = get("/v1/models");
  ASSERT_TRUE(models);
  EXPECT_EQ(models->status, 401);
  auto metrics = get("/metrics");
  ASSERT_TRUE(metrics);
  EXPECT_EQ(metrics->status, 401);
  // A path beside the page's files is no page file: the key is checked, then it is a 404.
  auto other = get("/ui/other.js");
  ASSERT_TRUE(other);
  EXPECT_EQ(other->status, 401);
  other = get("/ui/other.js", true);
  ASSERT_TRUE(other);
  EXPECT_EQ(other->status, 404);
  // The key still works for the page.
  page = get("/", true);
  ASSERT_TRUE(page);
  EXPECT_EQ(page->status, 200);
}

TEST_F(UiTest, EveryFileHasItsTypeAndTheSecurityHeaders) {
  const std::pair<const char*, const char*> want[] = {{"/", "text/html; charset=utf-8"},
                                                      {"/ui/app.js", "text/javascript; charset=utf-8"},
                                                      {"/ui/style.css", "text/css; charset=utf-8"},
                                                      {"/ui/icon.svg", "image/svg+xml"}};
  for (const auto& [path, type] : want) {
    SCOPED_TRACE(path);
    auto r = get(path);
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 200);
    EXPECT_EQ(r->get_header_value("Content-Type"), type);
    EXPECT_FALSE(r->body.empty());
    EXPECT_EQ(r->get_header_value("Content-Security-Policy"), std::string(ui_content_security_policy()));
    EXPECT_EQ(r->get_header_value("X-Content-Type-Options"), "nosniff");
    EXPECT_EQ(r->get_header_value("Cache-Control"), "no-cache");
    EXPECT_EQ(r->get_header_value("Referrer-Policy"), "no-referrer");
  }
  // The policy: nothing by default, and scripts, styles and fetches from this server only.
  const std::string csp(ui_content_security_policy());
  EXPECT_NE(csp.find("default-src 'none'"), std::string::npos);
  EXPECT_NE(csp.find("script-src 'self';"), std::string::npos);
  EXPECT_NE(csp.find("connect-src 'self';"), std::string::npos);
  EXPECT_EQ(csp.find("unsafe"), std::string::npos);
}

TEST_F(UiTest, HeadAnswersTheHeadAlone) {
  auto page = get("/");
  ASSERT_TRUE(page);
  const std::string r = raw("HEAD / HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
  ASSERT_EQ(r.rfind("HTTP/1.1 200", 0), 0u) << r;
  EXPECT_NE(r.find("Content-Length: " + std::to_string(page->body.size()) + "\r\n"), std::string::npos) << r;
  EXPECT_NE(r.find("Content-Security-Policy: "), std::string::npos);
  const size_t end = r.find("\r\n\r\n");
  ASSERT_NE(end, std::string::npos);
  EXPECT_EQ(end + 4, r.size()) << "a body after the head of a HEAD answer";
}

TEST_F(UiTest, OtherMethodsAre405) {
  const std::string r = raw("POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}");
  EXPECT_EQ(r.rfind("HTTP/1.1 405", 0), 0u) << r;
  EXPECT_NE(r.find("Allow: GET\r\n"), std::string::npos) << r;
}

TEST_F(UiTest, FilesHaveNoInlineCodeNoHtmlFromDataAndNoOtherHosts) {
  std::string html, js, css;
  for (const char* p : kPaths) {
    auto r = get(p);
    ASSERT_TRUE(r);
    if (std::string(p) == "/") html = r->body;
    if (std::string(p) == "/ui/app.js") js = r->body;
    if (std::string(p) == "/ui/style.css") css = r->body;
  }
  // Inline script or style would be refused by the policy: every <script> has a src, no
  // element has a style attribute or an on* handler.
  for (size_t at = 0; (at = html.find("<script", at)) != std::string::npos; ++at)
    EXPECT_EQ(html.compare(at, 13, "<script src=\""), 0) << html.substr(at, 40);
  EXPECT_EQ(html.find("<style"), std::string::npos);
  EXPECT_EQ(html.find(" style="), std::string::npos);
  EXPECT_EQ(html.find(" onclick="), std::string::npos);
  EXPECT_EQ(html.find(" onload="), std::string::npos);
  // Model output and server data go in as text: the script never parses strings as HTML.
  for (const char* bad : {"innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function"})
    EXPECT_EQ(js.find(bad), std::string::npos) << bad;
  // Nothing is fetched from elsewhere: no absolute URL in the page, its script or its style.
  for (const std::string* f : {&html, &js, &css}) {
    EXPECT_EQ(f->find("http://"), std::string::npos);
    EXPECT_EQ(f->find("https://"), std::string::npos);
    EXPECT_EQ(f->find("//cdn"), std::string::npos);
  }
}

// The page is shown without a model (loading, or failed to load): it tells why from the
// API's own 503 answers, which it can only do once it is on the screen.
TEST(UiLoading, PageIsServedWhileTheApiAnswers503) {
  ServerOptions o;
  o.model_dir = testing::make_temp_dir("ui_no_model");  // no config.json: the load fails
  o.port = 0;
  o.api_key = kUiKey;
  Server s(o);
  ASSERT_TRUE(s.start().is_ok());
  EXPECT_FALSE(s.wait_ready().is_ok());
  httpc::Client c("127.0.0.1", s.port());
  c.set_read_timeout(30, 0);
  for (const char* p : kPaths) {
    auto r = c.Get(p);
    ASSERT_TRUE(r) << p;
    EXPECT_EQ(r->status, 200) << p;
  }
  c.set_bearer_token_auth(kUiKey);
  auto m = c.Get("/v1/models");
  ASSERT_TRUE(m);
  EXPECT_EQ(m->status, 503);
  s.stop();
  std::error_code ec;
  fs::remove_all(o.model_dir, ec);
}

}  // namespace
}  // namespace laplace

#endif  // LAPLACE_HAVE_SERVER
