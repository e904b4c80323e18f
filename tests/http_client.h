// A small blocking HTTP/1.1 client for the server tests (the calls cpp-httplib's Client
// had, so that the tests read the same): one request at a time over a socket to
// 127.0.0.1, kept alive when asked; bodies by Content-Length, chunked, or up to the close.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace laplace::testing::httpc {

enum class Error { Success, Connection, Read, Write, Timeout };

inline std::string to_string(Error e) {
  switch (e) {
    case Error::Success: return "success";
    case Error::Connection: return "connection failed";
    case Error::Read: return "read failed (connection closed)";
    case Error::Write: return "write failed";
    case Error::Timeout: return "read timed out";
  }
  return "?";
}

struct Response {
  int status = 0;
  std::vector<std::pair<std::string, std::string>> headers;
  std::string body;
  bool has_header(const std::string& name) const {
    for (const auto& [k, v] : headers)
      if (strcasecmp(k.c_str(), name.c_str()) == 0) return true;
    return false;
  }
  std::string get_header_value(const std::string& name) const {
    for (const auto& [k, v] : headers)
      if (strcasecmp(k.c_str(), name.c_str()) == 0) return v;
    return "";
  }
};

class Result {
 public:
  Result() = default;
  explicit Result(Error e) : err_(e) {}
  explicit Result(Response r) : res_(std::move(r)) {}
  explicit operator bool() const { return res_.has_value(); }
  const Response* operator->() const { return &*res_; }
  const Response& operator*() const { return *res_; }
  Error error() const { return err_; }

 private:
  std::optional<Response> res_;
  Error err_ = Error::Success;
};

class Client {
 public:
  Client(std::string host, int port) : host_(std::move(host)), port_(port) {}
  ~Client() { close_fd(); }
  Client(Client&& o) noexcept { *this = std::move(o); }
  Client& operator=(Client&& o) noexcept {
    host_ = o.host_;
    port_ = o.port_;
    fd_ = std::exchange(o.fd_, -1);
    timeout_us_ = o.timeout_us_;
    token_ = o.token_;
    keep_alive_ = o.keep_alive_;
    buf_ = std::move(o.buf_);
    return *this;
  }

  void set_read_timeout(long sec, long usec = 0) { timeout_us_ = sec * 1000000L + usec; }
  void set_bearer_token_auth(const std::string& token) { token_ = token; }
  void set_keep_alive(bool on) { keep_alive_ = on; }

  Result Get(const std::string& path) { return send("GET", path, "", ""); }
  Result Delete(const std::string& path) { return send("DELETE", path, "", ""); }
  Result Post(const std::string& path, const std::string& body, const std::string& type) {
    return send("POST", path, body, type);
  }

 private:
  void close_fd() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
    buf_.clear();
  }

  bool connect_fd() {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd_ < 0) return false;
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port_));
    ::inet_pton(AF_INET, host_ == "localhost" ? "127.0.0.1" : host_.c_str(), &a.sin_addr);
    if (::connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
      close_fd();
      return false;
    }
    int one = 1;
    ::setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    timeval tv{static_cast<time_t>(timeout_us_ / 1000000), static_cast<suseconds_t>(timeout_us_ % 1000000)};
    ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    return true;
  }

  // Reads more into buf_; false on close, error or timeout (err says which).
  bool fill(Error* err) {
    char tmp[16384];
    for (;;) {
      const ssize_t n = ::recv(fd_, tmp, sizeof tmp, 0);
      if (n > 0) {
        buf_.append(tmp, static_cast<size_t>(n));
        return true;
      }
      if (n < 0 && errno == EINTR) continue;
      *err = n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK) ? Error::Timeout : Error::Read;
      return false;
    }
  }

  bool read_line(std::string* line, Error* err) {
    size_t at;
    while ((at = buf_.find("\r\n")) == std::string::npos)
      if (!fill(err)) return false;
    *line = buf_.substr(0, at);
    buf_.erase(0, at + 2);
    return true;
  }

  bool read_exact(size_t n, std::string* out, Error* err) {
    while (buf_.size() < n)
      if (!fill(err)) return false;
    out->append(buf_, 0, n);
    buf_.erase(0, n);
    return true;
  }

  Result send(const std::string& method, const std::string& path, const std::string& body, const std::string& type) {
    const bool reused = fd_ >= 0;
    if (!reused && !connect_fd()) return Result(Error::Connection);
    std::string req = method + " " + path + " HTTP/1.1\r\nHost: " + host_ + ":" + std::to_string(port_) + "\r\n";
    if (!token_.empty()) req += "Authorization: Bearer " + token_ + "\r\n";
    if (!type.empty()) req += "Content-Type: " + type + "\r\n";
    if (method == "POST" || !body.empty()) req += "Content-Length: " + std::to_string(body.size()) + "\r\n";
    req += keep_alive_ ? "Connection: keep-alive\r\n" : "Connection: close\r\n";
    req += "\r\n";
    req += body;
    size_t off = 0;
    while (off < req.size()) {
      const ssize_t n = ::send(fd_, req.data() + off, req.size() - off, MSG_NOSIGNAL);
      if (n <= 0) {
        if (n < 0 && errno == EINTR) continue;
        close_fd();
        // The server may close a kept-alive connection between requests: one retry.
        if (reused) return send(method, path, body, type);
        return Result(Error::Write);
      }
      off += static_cast<size_t>(n);
    }
    Response r;
    Error err = Error::Read;
    std::string line;
    for (;;) {  // skip 1xx interim responses
      if (!read_line(&line, &err)) {
        close_fd();
        if (reused && err == Error::Read && buf_.empty()) return send(method, path, body, type);
        return Result(err);
      }
      if (line.size() < 12 || line.compare(0, 5, "HTTP/") != 0) {
        close_fd();
        return Result(Error::Read);
      }
      r.status = std::atoi(line.c_str() + 9);
      r.headers.clear();
      for (;;) {
        if (!read_line(&line, &err)) {
          close_fd();
          return Result(err);
        }
        if (line.empty()) break;
        const size_t colon = line.find(':');
        if (colon == std::string::npos) continue;
        size_t v = colon + 1;
        while (v < line.size() && line[v] == ' ') ++v;
        r.headers.emplace_back(line.substr(0, colon), line.substr(v));
      }
      if (r.status >= 200) break;
    }
    const std::string te = r.get_header_value("Transfer-Encoding");
    const std::string cl = r.get_header_value("Content-Length");
    bool ok = true;
    if (strcasecmp(te.c_str(), "chunked") == 0) {
      for (;;) {
        if (!read_line(&line, &err)) {
          ok = false;
          break;
        }
        const size_t len = std::strtoul(line.c_str(), nullptr, 16);
        if (len == 0) {
          while (read_line(&line, &err) && !line.empty()) {
          }
          break;
        }
        std::string crlf;
        if (!read_exact(len, &r.body, &err) || !read_exact(2, &crlf, &err)) {
          ok = false;
          break;
        }
      }
    } else if (!cl.empty()) {
      ok = read_exact(std::strtoul(cl.c_str(), nullptr, 10), &r.body, &err);
    } else if (method != "HEAD" && r.status != 204 && r.status != 304) {
      while (fill(&err)) {
      }
      ok = err == Error::Read;  // the close ends the body
      r.body = std::move(buf_);
      buf_.clear();
    }
    if (!ok) {
      close_fd();
      return Result(err);
    }
    if (!keep_alive_ || strcasecmp(r.get_header_value("Connection").c_str(), "close") == 0) close_fd();
    return Result(std::move(r));
  }

  std::string host_;
  int port_ = 0;
  int fd_ = -1;
  long timeout_us_ = 300L * 1000000L;
  std::string token_;
  bool keep_alive_ = false;
  std::string buf_;
};

}  // namespace laplace::testing::httpc
