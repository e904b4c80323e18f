// Raw-socket helpers for tests that drive a server (serve/http/server.h) on 127.0.0.1 the way a
// hostile or careless client would: bytes written by hand, connections dropped at will.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <functional>
#include <string>
#include <thread>

namespace laplace::testing::srv {

// A connected socket to 127.0.0.1:port with a 5 s read timeout; -1 when refused.
inline int connect_local(int port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    close(fd);
    return -1;
  }
  timeval tv{5, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  return fd;
}

// Closes with a reset (SO_LINGER 0): the server's next write fails at once, as with a
// client that crashed or a proxy that gave up.
inline void close_abruptly(int fd) {
  linger l{1, 0};
  setsockopt(fd, SOL_SOCKET, SO_LINGER, &l, sizeof l);
  close(fd);
}

inline bool send_all(int fd, const std::string& bytes) {
  size_t off = 0;
  while (off < bytes.size()) {
    const ssize_t n = ::send(fd, bytes.data() + off, bytes.size() - off, MSG_NOSIGNAL);
    if (n <= 0) return false;
    off += static_cast<size_t>(n);
  }
  return true;
}

// Reads what the server sends until it closes the connection or `seconds` pass.
inline std::string read_until_close(int fd, double seconds) {
  std::string out;
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  char buf[8192];
  while (std::chrono::steady_clock::now() < end) {
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, 100) <= 0) continue;
    const ssize_t n = read(fd, buf, sizeof buf);
    if (n <= 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  return out;
}

// Writes `bytes` on a new connection and reads until the server closes it.
inline std::string raw_exchange(int port, const std::string& bytes, double seconds = 10) {
  int fd = connect_local(port);
  if (fd < 0) return "";
  send_all(fd, bytes);
  std::string out = read_until_close(fd, seconds);
  close(fd);
  return out;
}

// A whole HTTP/1.1 request with a JSON body.
inline std::string http_post(const std::string& path, const std::string& body, const std::string& extra = "") {
  return "POST " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: " +
         std::to_string(body.size()) + "\r\n" + extra + "\r\n" + body;
}

inline int status_of(const std::string& http) {
  if (http.size() < 12 || http.compare(0, 5, "HTTP/") != 0) return 0;
  return std::atoi(http.c_str() + 9);
}

// The value of an unlabelled Prometheus metric in /metrics text (-1 if absent).
inline double metric(const std::string& text, const std::string& name) {
  size_t at = 0;
  while ((at = text.find(name + " ", at)) != std::string::npos) {
    if (at == 0 || text[at - 1] == '\n') return std::atof(text.c_str() + at + name.size() + 1);
    at += name.size();
  }
  return -1;
}

// Polls pred until it holds or the time is up; a bound for slow machines, not a delay.
inline bool eventually(const std::function<bool()>& pred, double seconds) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (std::chrono::steady_clock::now() < end) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return pred();
}

}  // namespace laplace::testing::srv
