// The HTTP/1.1 transport of `laplace serve` (docs/serving.md §9, "Transport"): a small,
// fixed number of event-loop threads (Boost.Asio; requests parsed by Boost.Beast's
// parser), each owning the connections it accepted. No thread per connection: an idle
// keep-alive connection or a stream waiting for its next token costs a socket and a few
// kilobytes, not a thread, so thousands of clients stream at once.
//
// Per connection, one request at a time, in order (pipelined requests wait in the read
// buffer and are answered in the order sent):
//   header phase  ── an absolute deadline (header_timeout) from the moment the server
//                    waits for a request: bytes trickled in do not extend it;
//   head check    ── HeadCheck may answer at once (401, 404, 413, ...), before any body;
//                    an invalid Content-Length is a 400 from the parser, at once;
//   body phase    ── an absolute deadline (body_timeout) from the end of the header;
//   handler       ── Handler(request, exchange) on the connection's thread; it answers
//                    later, from any thread, through the Exchange;
//   response      ── whole (Content-Length), or streamed: chunked for HTTP/1.1, the raw
//                    body ended by closing the connection for HTTP/1.0. Every write has a
//                    deadline (write_timeout); a client that does not read is dropped.
// A client that half-closes (shutdown(SHUT_WR)) after its request is still answered: the
// server reads nothing while it answers, and sees the end of input only when it looks
// for the next request. Closing is lingering: the server stops sending, then reads and
// discards what the client still sends (up to linger_s), so that a response that refuses
// an unread body is not destroyed by a TCP reset before the client reads it.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"

namespace laplace {

namespace http {

struct Header {
  std::string name, value;
};

struct Request {
  std::string method;  // "GET", "POST", ...
  std::string target;  // as sent: path and query
  std::string path;    // the target without its query
  int version = 11;    // 10 = HTTP/1.0, 11 = HTTP/1.1
  std::vector<Header> headers;
  std::string body;
  std::vector<std::string> params;  // a route's captures (filled by the router)
  // The first header of that name (case-insensitive), or null.
  const std::string* find(std::string_view name) const;
  std::string header(std::string_view name) const;  // "" when absent
};

struct Response {
  int status = 200;
  std::string content_type = "application/json";
  std::vector<Header> headers;  // besides Content-Type, Content-Length, Connection
  std::string body;
  // "Connection: close" among the headers makes the connection close after this response.
};

// What a streamed response's producer hands over each time it is asked.
struct Chunk {
  std::string data;   // body bytes to send now (may be empty: nothing yet)
  bool done = false;  // the body ends after `data`
  // Only while no byte of the response has gone out (a deferred head): answer with this
  // whole response instead (its own status and Content-Length).
  std::optional<Response> whole;
};
// Called on the connection's thread: after Exchange::wake(), and with tick = true when
// nothing was written for tick_s (a stream sends a keep-alive; writing is also how a
// client that went away is noticed). Fills *out; never blocks.
using Producer = std::function<void(bool tick, Chunk* out)>;

struct StreamHead {
  int status = 200;
  std::string content_type;
  std::vector<Header> headers;
  // The head goes out with the first body bytes rather than at once, so that a producer
  // done before its first tick may still answer with any status (Chunk::whole).
  bool defer = false;
};

// One request's answer. Any thread; exactly one of respond() / stream(), once. An
// exchange dropped unanswered is answered 500.
class Exchange {
 public:
  virtual ~Exchange() = default;
  virtual void respond(Response r) = 0;
  // on_abort: called once, on the connection's thread, when the connection fails or the
  // server stops before the producer said done (the client is gone: stop its work).
  virtual void stream(StreamHead head, Producer produce, std::function<void()> on_abort) = 0;
  // The producer has something new (any thread; coalesced: one call may cover many).
  virtual void wake() = 0;
  virtual int version() const = 0;
};
using ExchangePtr = std::shared_ptr<Exchange>;

// Wakes many exchanges with one task per event-loop thread (an engine step's tokens).
void wake_all(const std::vector<ExchangePtr>& exchanges);

struct Options {
  std::string host = "127.0.0.1";
  int port = 0;                 // 0 = any free port
  int threads = 2;              // event-loop threads
  double header_timeout_s = 10;  // absolute, per request, from when the server waits for it
  double body_timeout_s = 10;    // absolute, from the end of the header
  double write_timeout_s = 10;   // per write
  double linger_s = 2;           // reading what a closing client still sends
  double tick_s = 0.5;           // Producer ticks
  int64_t max_header_bytes = 16 << 10;
  int64_t max_body_bytes = 1 << 20;
  int64_t max_connections = 0;  // 0 = from RLIMIT_NOFILE (raised to its hard limit)
  int keep_alive_max = 1000;    // requests per connection
};

// Called on the connection's thread once a request's header is in, before its body is
// read: an answer here is sent at once (the body is never read).
using HeadCheck = std::function<std::optional<Response>(const Request& head)>;
// Called on the connection's thread with a whole request. Must not block.
using Handler = std::function<void(Request&& req, ExchangePtr ex)>;
// Called on the connection's thread once a request's header is in: headers every answer to
// it carries (its refusals included), e.g. CORS headers that depend on its Origin.
using ResponseHeaders = std::function<std::vector<Header>(const Request& head)>;

}  // namespace http

class HttpServer {
 public:
  HttpServer(http::Options o, http::HeadCheck check, http::Handler handler, http::ResponseHeaders headers = nullptr);
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // Binds and listens (SO_REUSEADDR, not SO_REUSEPORT: a port in use is an error; backlog
  // SOMAXCONN). Errors: io_error.
  Status listen();
  int port() const;
  // Starts the event-loop threads.
  void start();
  // Stops accepting (the listening socket is closed: new connections are refused).
  void stop_accepting();
  // Closes every connection (running streams are aborted) and joins the threads. Idempotent.
  void stop();
  int64_t connections() const;
  int64_t max_connections() const;

  struct Impl;  // the event loops and connections (http_server.cpp)

 private:
  std::shared_ptr<Impl> impl_;
};

}  // namespace laplace
