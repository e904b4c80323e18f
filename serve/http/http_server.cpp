// Boost 1.74's asio/awaitable.hpp uses std::exchange without including <utility> (C++20).
#include <utility>

#include "serve/http/http_server.h"
#include "core/thread_annotations.h"

#include <linux/sockios.h>
#include <sys/ioctl.h>
#include <sys/resource.h>

#include <atomic>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/http/error.hpp>
#include <boost/beast/http/parser.hpp>
#include <boost/beast/http/read.hpp>
#include <boost/beast/http/string_body.hpp>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <map>
#include <mutex>
#include <thread>
#include <unordered_map>

namespace laplace {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace bh = boost::beast::http;
using tcp = asio::ip::tcp;
using Clock = std::chrono::steady_clock;

namespace {

bool iequals(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    char x = a[i], y = b[i];
    if (x >= 'A' && x <= 'Z') x = static_cast<char>(x - 'A' + 'a');
    if (y >= 'A' && y <= 'Z') y = static_cast<char>(y - 'A' + 'a');
    if (x != y) return false;
  }
  return true;
}

const char* reason_phrase(int s) {
  switch (s) {
    case 100: return "Continue";
    case 200: return "OK";
    case 204: return "No Content";
    case 400: return "Bad Request";
    case 401: return "Unauthorized";
    case 403: return "Forbidden";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 408: return "Request Timeout";
    case 409: return "Conflict";
    case 411: return "Length Required";
    case 413: return "Payload Too Large";
    case 415: return "Unsupported Media Type";
    case 429: return "Too Many Requests";
    case 431: return "Request Header Fields Too Large";
    case 500: return "Internal Server Error";
    case 501: return "Not Implemented";
    case 503: return "Service Unavailable";
    case 505: return "HTTP Version Not Supported";
    case 507: return "Insufficient Storage";
    default: return "Status";
  }
}

Clock::duration seconds(double s) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
}

std::string percent_decode(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  auto hexval = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '%' && i + 2 < s.size() && hexval(s[i + 1]) >= 0 && hexval(s[i + 2]) >= 0) {
      out += static_cast<char>(hexval(s[i + 1]) * 16 + hexval(s[i + 2]));
      i += 2;
    } else {
      out += s[i];
    }
  }
  return out;
}

// A JSON error object like the API's (serve/openai_api.h), for what the transport refuses.
std::string error_body(const std::string& msg) {
  std::string esc;
  for (char c : msg) {
    if (c == '"' || c == '\\') esc += '\\';
    esc += (static_cast<unsigned char>(c) < 0x20) ? ' ' : c;
  }
  return "{\"error\":{\"message\":\"" + esc + "\",\"type\":\"invalid_request_error\",\"param\":null,\"code\":null}}";
}

bool has_close(const std::vector<http::Header>& hs) {
  for (const auto& h : hs)
    if (iequals(h.name, "Connection") && iequals(h.value, "close")) return true;
  return false;
}

}  // namespace

namespace http {

const std::string* Request::find(std::string_view name) const {
  for (const Header& h : headers)
    if (iequals(h.name, name)) return &h.value;
  return nullptr;
}

std::string Request::header(std::string_view name) const {
  const std::string* v = find(name);
  return v ? *v : std::string();
}

}  // namespace http

namespace {

class Connection;

// One event-loop thread's context and the connections it owns (touched on its thread only).
struct Loop {
  asio::io_context io{1};
  std::unordered_map<Connection*, std::weak_ptr<Connection>> conns;
};

}  // namespace

struct HttpServer::Impl : std::enable_shared_from_this<HttpServer::Impl> {
  http::Options opt;
  http::HeadCheck check;
  http::Handler handler;
  http::ResponseHeaders response_headers;
  std::vector<std::unique_ptr<Loop>> loops;
  std::vector<asio::executor_work_guard<asio::io_context::executor_type>> guards;
  std::unique_ptr<tcp::acceptor> acceptor;
  std::unique_ptr<asio::steady_timer> accept_retry;
  std::vector<std::thread> threads;
  std::atomic<int64_t> conns{0};
  int64_t max_conns = 1024;
  size_t next_loop = 0;
  std::atomic<bool> stopping{false};
  int port = 0;
  std::mutex mu;
  bool started = false;  // set under mu by start(); stop() reads it after its own turn of mu
  bool stopped GUARDED_BY(mu) = false;

  void do_accept();
  void refuse(tcp::socket& s);
  ~Impl() {
    // The io_contexts go first: their pending handlers own the connections, which count
    // themselves out of `conns` and use the timers' and sockets' services as they go.
    accept_retry.reset();
    acceptor.reset();
    loops.clear();
  }
};

namespace {

class ExchangeImpl;

class Connection : public std::enable_shared_from_this<Connection> {
 public:
  Connection(HttpServer::Impl& srv, Loop& loop, tcp::socket s)
      : srv_(srv), loop_(loop), sock_(std::move(s)), timer_(loop.io), tick_(loop.io) {}
  ~Connection() { srv_.conns.fetch_sub(1); }

  void start() {
    loop_.conns[this] = weak_from_this();
    beast::error_code ec;
    sock_.set_option(tcp::no_delay(true), ec);
    if (srv_.stopping.load()) return close_now();
    read_request();
  }

  // Loop thread: the server stops. A running stream is aborted.
  void close_now() {
    if (closed_) return;
    closed_ = true;
    phase_ = Phase::kClosed;
    ++timer_gen_;
    beast::error_code ec;
    timer_.cancel();
    tick_.cancel();
    sock_.shutdown(tcp::socket::shutdown_both, ec);
    sock_.close(ec);
    loop_.conns.erase(this);
    abort_stream();
    auto keep = std::move(hold_);  // may be the last reference: released as this returns
  }

  void on_respond(uint64_t seq, http::Response r) {
    if (seq != seq_ || phase_ != Phase::kHandling) return;
    auto keep = std::move(hold_);
    send_whole(std::move(r));
  }

  void on_stream(uint64_t seq, http::StreamHead head, http::Producer produce, std::function<void()> on_abort) {
    if (seq != seq_ || phase_ != Phase::kHandling) {
      if (on_abort) on_abort();  // the connection is gone: stop the work behind it
      return;
    }
    auto keep = std::move(hold_);
    phase_ = Phase::kStreaming;
    head_ = std::move(head);
    produce_ = std::move(produce);
    on_abort_ = std::move(on_abort);
    head_sent_ = false;
    stream_done_ = false;
    writing_ = false;
    pump_again_ = false;
    chunked_ = version_ == 11;
    // HTTP/1.0 has no chunking: the body ends when the connection does.
    close_after_ = !keep_alive_ || version_ != 11 || has_close(head_.headers) || must_close();
    last_write_ = Clock::now();
    progress_at_ = last_write_;
    acked_ = written_;
    start_tick();
    pump(false);
  }

  void on_wake(uint64_t seq) {
    if (seq == seq_ && phase_ == Phase::kStreaming) pump(false);
  }

  Loop& loop() { return loop_; }

 private:
  enum class Phase { kHeader, kBody, kHandling, kWriting, kStreaming, kLinger, kClosed };

  bool must_close() const {
    return srv_.stopping.load() || served_ + 1 >= static_cast<int64_t>(srv_.opt.keep_alive_max);
  }

  void arm(double s) {
    const uint64_t g = ++timer_gen_;
    timer_.expires_after(seconds(s));
    timer_.async_wait([self = shared_from_this(), g](const beast::error_code& ec) {
      if (!ec && g == self->timer_gen_) self->on_deadline();
    });
  }
  void disarm() {
    ++timer_gen_;
    timer_.cancel();
  }

  void on_deadline() {
    switch (phase_) {
      case Phase::kHeader:
      case Phase::kBody:      // a silent or trickling client: its time is up
      case Phase::kWriting:   // a client that does not read
      case Phase::kStreaming:
      case Phase::kLinger:
        close_now();
        break;
      default:
        break;
    }
  }

  void read_request() {
    phase_ = Phase::kHeader;
    extra_.clear();
    parser_.emplace();
    parser_->header_limit(static_cast<std::uint32_t>(srv_.opt.max_header_bytes));
    parser_->body_limit(static_cast<std::uint64_t>(srv_.opt.max_body_bytes));
    // The whole header must arrive by this time, however slowly its bytes trickle in.
    arm(srv_.opt.header_timeout_s);
    bh::async_read_header(sock_, buf_, *parser_,
                          [self = shared_from_this()](const beast::error_code& ec, size_t) { self->on_header(ec); });
  }

  // A parse error, a refused size, or a peer that went away.
  void on_read_error(const beast::error_code& ec) {
    if (closed_) return;
    if (ec == bh::error::end_of_stream || ec == bh::error::partial_message || ec == asio::error::eof ||
        ec == asio::error::operation_aborted || ec == asio::error::connection_reset ||
        ec == asio::error::broken_pipe || ec == asio::error::bad_descriptor)
      return close_now();
    if (ec == bh::error::body_limit) return refuse(413, "the request is too large");
    if (ec == bh::error::header_limit) return refuse(431, "the request header is too large");
    if (ec == bh::error::bad_content_length) return refuse(400, "invalid Content-Length");
    if (ec == bh::error::bad_version) {
      // 505 is for a well-formed request line of another version; a line that is not one
      // (a bare LF ending it, a version that is no version) is a malformed request.
      if (well_formed_request_line()) return refuse(505, "only HTTP/1.0 and HTTP/1.1 are served");
      return refuse(400, "malformed HTTP request line");
    }
    refuse(400, "malformed HTTP request (" + ec.message() + ")");
  }

  // The first line in the read buffer is `METHOD SP TARGET SP HTTP/d.d CRLF`.
  bool well_formed_request_line() const {
    const auto data = buf_.cdata();
    const std::string_view s(static_cast<const char*>(data.data()), data.size());
    const size_t lf = s.find('\n');
    if (lf == std::string_view::npos || lf == 0 || s[lf - 1] != '\r') return false;
    const std::string_view line = s.substr(0, lf - 1);
    const size_t sp = line.rfind(' ');
    if (sp == std::string_view::npos || line.find(' ') == sp) return false;
    const std::string_view v = line.substr(sp + 1);
    return v.size() == 8 && v.substr(0, 5) == "HTTP/" && std::isdigit(static_cast<unsigned char>(v[5])) &&
           v[6] == '.' && std::isdigit(static_cast<unsigned char>(v[7]));
  }

  // RFC 9112 §6.3: a request with a Transfer-Encoding whose last coding is not chunked has
  // no knowable body length, and a coding we do not decode is not one we can read: either
  // way the request and what follows it on the connection cannot be parsed safely. Only
  // exactly "chunked" (one header, HTTP/1.1) is served.
  bool transfer_encoding_refused() const {
    int count = 0;
    bool chunked_only = true;
    for (const auto& h : req_.headers) {
      if (!iequals(h.name, "Transfer-Encoding")) continue;
      ++count;
      std::string_view v = h.value;
      while (!v.empty() && (v.front() == ' ' || v.front() == '\t')) v.remove_prefix(1);
      while (!v.empty() && (v.back() == ' ' || v.back() == '\t')) v.remove_suffix(1);
      if (!iequals(v, "chunked")) chunked_only = false;
    }
    return count > 0 && (count > 1 || !chunked_only || version_ != 11);
  }

  void refuse(int status, const std::string& msg) {
    http::Response r;
    r.status = status;
    r.body = error_body(msg);
    r.headers.push_back({"Connection", "close"});
    keep_alive_ = false;
    version_ = 11;
    is_head_ = false;
    phase_ = Phase::kHandling;
    send_whole(std::move(r));
  }

  http::Request head_request() const {
    const auto& m = parser_->get();
    http::Request r;
    r.method = std::string(m.method_string());
    r.target = std::string(m.target());
    const size_t q = r.target.find('?');
    r.path = percent_decode(std::string_view(r.target).substr(0, q));
    r.version = static_cast<int>(m.version());
    for (const auto& f : m) r.headers.push_back({std::string(f.name_string()), std::string(f.value())});
    return r;
  }

  void on_header(const beast::error_code& ec) {
    if (closed_) return;
    if (ec) return on_read_error(ec);
    const auto& m = parser_->get();
    version_ = static_cast<int>(m.version());
    keep_alive_ = m.keep_alive();
    is_head_ = m.method() == bh::verb::head;
    req_ = head_request();
    if (transfer_encoding_refused()) return refuse(400, "unsupported Transfer-Encoding (only chunked is accepted)");
    extra_ = srv_.response_headers ? srv_.response_headers(req_) : std::vector<http::Header>();
    if (srv_.check) {
      if (std::optional<http::Response> r = srv_.check(req_)) {
        // Refused before its body: the body is never read, so the connection cannot be
        // reused unless there is none.
        if (!parser_->is_done()) keep_alive_ = false;
        phase_ = Phase::kHandling;
        return send_whole(std::move(*r));
      }
    }
    if (parser_->is_done()) return on_body({});
    // The body has its own deadline, from now.
    phase_ = Phase::kBody;
    arm(srv_.opt.body_timeout_s);
    if (version_ == 11 && iequals(req_.header("Expect"), "100-continue")) {
      wbuf_ = "HTTP/1.1 100 Continue\r\n\r\n";
      asio::async_write(sock_, asio::buffer(wbuf_), [self = shared_from_this()](const beast::error_code& e, size_t) {
        if (self->closed_) return;
        if (e) return self->close_now();
        self->read_body();
      });
      return;
    }
    read_body();
  }

  void read_body() {
    bh::async_read(sock_, buf_, *parser_,
                   [self = shared_from_this()](const beast::error_code& ec, size_t) { self->on_body(ec); });
  }

  void on_body(const beast::error_code& ec) {
    if (closed_) return;
    if (ec) return on_read_error(ec);
    disarm();
    req_.body = std::move(parser_->get().body());
    phase_ = Phase::kHandling;
    // Nothing is pending on the socket while the handler's answer is being made: the
    // connection keeps itself alive until the exchange answers (or the server stops).
    hold_ = shared_from_this();
    const uint64_t seq = ++seq_;
    auto ex = make_exchange(seq);
    http::Request r = std::move(req_);
    req_ = http::Request();
    srv_.handler(std::move(r), std::move(ex));
  }

  http::ExchangePtr make_exchange(uint64_t seq);

  std::string status_line(int status) const {
    return "HTTP/1.1 " + std::to_string(status) + " " + reason_phrase(status) + "\r\n";
  }

  void send_whole(http::Response r) {
    const bool close = !keep_alive_ || has_close(r.headers) || must_close();
    std::string out = status_line(r.status);
    if (!r.content_type.empty()) out += "Content-Type: " + r.content_type + "\r\n";
    out += "Content-Length: " + std::to_string(r.body.size()) + "\r\n";
    for (const auto& h : r.headers)
      if (!iequals(h.name, "Connection")) out += h.name + ": " + h.value + "\r\n";
    for (const auto& h : extra_) out += h.name + ": " + h.value + "\r\n";
    if (close) out += "Connection: close\r\n";
    else if (version_ == 10) out += "Connection: keep-alive\r\n";
    out += "\r\n";
    if (!is_head_) out += r.body;
    wbuf_ = std::move(out);
    phase_ = Phase::kWriting;
    write([self = shared_from_this(), close] { self->after_response(close); });
  }

  template <class Then>
  void write(Then then) {
    arm(srv_.opt.write_timeout_s);
    asio::async_write(sock_, asio::buffer(wbuf_),
                      [self = shared_from_this(), then = std::move(then)](const beast::error_code& ec, size_t n) {
                        self->written_ += static_cast<int64_t>(n);
                        if (self->closed_) return;
                        self->disarm();
                        if (ec) return self->close_now();  // the client is gone (a stream is aborted)
                        then();
                      });
  }

  void after_response(bool close) {
    ++served_;
    wbuf_.clear();
    wbuf_.shrink_to_fit();
    if (close) return linger_close();
    read_request();  // pipelined bytes already in buf_ are parsed at once
  }

  // Stop sending; read and drop what the client still sends, until it closes or linger_s.
  void linger_close() {
    phase_ = Phase::kLinger;
    beast::error_code ec;
    sock_.shutdown(tcp::socket::shutdown_send, ec);
    if (ec) return close_now();
    arm(srv_.opt.linger_s);
    buf_.consume(buf_.size());
    discard();
  }
  void discard() {
    sock_.async_read_some(buf_.prepare(4096), [self = shared_from_this()](const beast::error_code& ec, size_t) {
      if (self->closed_) return;
      if (ec) return self->close_now();
      self->buf_.consume(self->buf_.size());
      self->discard();
    });
  }

  // ---- streamed responses ----
  std::string stream_head() const {
    std::string out = status_line(head_.status);
    if (!head_.content_type.empty()) out += "Content-Type: " + head_.content_type + "\r\n";
    for (const auto& h : head_.headers)
      if (!iequals(h.name, "Connection")) out += h.name + ": " + h.value + "\r\n";
    for (const auto& h : extra_) out += h.name + ": " + h.value + "\r\n";
    if (chunked_) out += "Transfer-Encoding: chunked\r\n";
    out += close_after_ ? "Connection: close\r\n" : "";
    out += "\r\n";
    return out;
  }

  void pump(bool tick) {
    if (phase_ != Phase::kStreaming || stream_done_) return;
    if (writing_) {
      if (!tick) pump_again_ = true;
      return;
    }
    http::Chunk c;
    produce_(tick, &c);
    if (c.whole && !head_sent_) {
      end_stream_state();
      phase_ = Phase::kHandling;
      return send_whole(std::move(*c.whole));
    }
    std::string out;
    if (!head_sent_ && (!head_.defer || !c.data.empty() || c.done)) {
      out = stream_head();
      head_sent_ = true;
    }
    if (!c.data.empty()) {
      if (chunked_) {
        char len[24];
        std::snprintf(len, sizeof len, "%zx\r\n", c.data.size());
        out += len;
        out += c.data;
        out += "\r\n";
      } else {
        out += c.data;
      }
    }
    if (c.done) {
      if (chunked_) out += "0\r\n\r\n";
      stream_done_ = true;
    }
    if (out.empty()) return;
    writing_ = true;
    last_write_ = Clock::now();
    wbuf_ = std::move(out);
    write([self = shared_from_this()] {
      self->writing_ = false;
      if (self->stream_done_) {
        self->end_stream_state();
        return self->after_response(self->close_after_);
      }
      if (self->pump_again_) {
        self->pump_again_ = false;
        self->pump(false);
      }
    });
  }

  void end_stream_state() {
    produce_ = nullptr;
    on_abort_ = nullptr;
    tick_.cancel();
  }

  void abort_stream() {
    if (!on_abort_) return;
    auto f = std::move(on_abort_);
    on_abort_ = nullptr;
    produce_ = nullptr;
    f();
  }

  // A client that stops reading: once its receive buffer is full, what we sent stays
  // unacknowledged. The write deadline alone would start only when our own send buffer is
  // full too (megabytes on a fast link, hours of a slow stream); this drops the client when
  // none of what we sent has been acknowledged for write_timeout.
  bool stalled() {
    int unacked = 0;
    if (::ioctl(sock_.native_handle(), SIOCOUTQ, &unacked) != 0) return false;
    const int64_t acked = written_ - unacked;  // (low while a write is part-way in: no false progress)
    const auto now = Clock::now();
    if (unacked == 0 || acked > acked_) {
      acked_ = std::max(acked_, acked);
      progress_at_ = now;
      return false;
    }
    return now - progress_at_ >= seconds(srv_.opt.write_timeout_s);
  }

  void start_tick() {
    tick_.expires_after(seconds(srv_.opt.tick_s));
    tick_.async_wait([self = shared_from_this()](const beast::error_code& ec) {
      if (ec || self->phase_ != Phase::kStreaming || self->stream_done_) return;
      if (self->stalled()) return self->close_now();  // its work is cancelled (on_abort)
      if (!self->writing_ && Clock::now() - self->last_write_ >= seconds(self->srv_.opt.tick_s * 0.9)) self->pump(true);
      if (self->phase_ == Phase::kStreaming && !self->stream_done_) self->start_tick();
    });
  }

  HttpServer::Impl& srv_;
  Loop& loop_;
  tcp::socket sock_;
  asio::steady_timer timer_;  // the current phase's deadline
  asio::steady_timer tick_;   // a stream's producer ticks
  uint64_t timer_gen_ = 0;
  beast::flat_buffer buf_;
  std::optional<bh::request_parser<bh::string_body>> parser_;
  http::Request req_;
  std::vector<http::Header> extra_;  // ResponseHeaders of the request being answered
  Phase phase_ = Phase::kHeader;
  bool closed_ = false;
  bool keep_alive_ = true, is_head_ = false;
  int version_ = 11;
  int64_t served_ = 0;
  uint64_t seq_ = 0;
  std::string wbuf_;
  std::shared_ptr<Connection> hold_;  // itself, while a handler's answer is awaited
  // The stream in progress.
  http::StreamHead head_;
  http::Producer produce_;
  std::function<void()> on_abort_;
  bool head_sent_ = false, stream_done_ = false, writing_ = false, pump_again_ = false;
  bool chunked_ = true, close_after_ = false;
  Clock::time_point last_write_;
  int64_t written_ = 0;  // bytes handed to the kernel on this connection
  int64_t acked_ = 0;    // of those, acknowledged by the client (as last seen)
  Clock::time_point progress_at_;  // when acked_ last grew (or nothing was unacknowledged)
};

class ExchangeImpl : public http::Exchange, public std::enable_shared_from_this<ExchangeImpl> {
 public:
  ExchangeImpl(std::weak_ptr<HttpServer::Impl> srv, std::weak_ptr<Connection> conn, Loop* loop, uint64_t seq,
               int version)
      : srv_(std::move(srv)), conn_(std::move(conn)), loop_(loop), seq_(seq), version_(version) {}
  ~ExchangeImpl() override {
    if (!answered_.load()) {
      http::Response r;
      r.status = 500;
      r.body = error_body("the request was not answered");
      post([c = conn_, seq = seq_, r = std::move(r)]() mutable {
        if (auto s = c.lock()) s->on_respond(seq, std::move(r));
      });
    }
  }
  void respond(http::Response r) override {
    if (answered_.exchange(true)) return;
    post([c = conn_, seq = seq_, r = std::move(r)]() mutable {
      if (auto s = c.lock()) s->on_respond(seq, std::move(r));
    });
  }
  void stream(http::StreamHead head, http::Producer produce, std::function<void()> on_abort) override {
    if (answered_.exchange(true)) return;
    const bool posted = post([c = conn_, seq = seq_, head = std::move(head), produce = std::move(produce),
                              on_abort]() mutable {
      if (auto s = c.lock()) s->on_stream(seq, std::move(head), std::move(produce), std::move(on_abort));
      else if (on_abort) on_abort();
    });
    if (!posted && on_abort) on_abort();
  }
  void wake() override {
    if (wake_pending_.exchange(true)) return;
    post([w = weak_from_this()] {
      if (auto x = w.lock()) x->run_wake();
    });
  }
  int version() const override { return version_; }

  // On the loop thread.
  void run_wake() {
    wake_pending_.store(false);
    if (auto s = conn_.lock()) s->on_wake(seq_);
  }
  bool claim_wake() { return !wake_pending_.exchange(true); }
  Loop* loop() const { return loop_; }
  const std::weak_ptr<HttpServer::Impl>& server() const { return srv_; }

 private:
  template <class F>
  bool post(F&& f) {
    auto s = srv_.lock();
    if (!s) return false;
    asio::post(loop_->io, std::forward<F>(f));
    return true;
  }
  std::weak_ptr<HttpServer::Impl> srv_;
  std::weak_ptr<Connection> conn_;
  Loop* loop_;
  uint64_t seq_;
  int version_;
  std::atomic<bool> answered_{false}, wake_pending_{false};
};

http::ExchangePtr Connection::make_exchange(uint64_t seq) {
  return std::make_shared<ExchangeImpl>(srv_.weak_from_this(), weak_from_this(), &loop_, seq, version_);
}

}  // namespace

namespace http {

void wake_all(const std::vector<ExchangePtr>& exchanges) {
  std::map<Loop*, std::vector<std::weak_ptr<ExchangeImpl>>> by_loop;
  std::map<Loop*, std::shared_ptr<HttpServer::Impl>> alive;  // each loop's server, kept alive while posting
  for (const ExchangePtr& e : exchanges) {
    auto* x = static_cast<ExchangeImpl*>(e.get());
    if (!x) continue;
    auto& srv = alive[x->loop()];
    if (!srv) srv = x->server().lock();
    if (!srv || !x->claim_wake()) continue;
    by_loop[x->loop()].push_back(std::static_pointer_cast<ExchangeImpl>(e));
  }
  for (auto& [loop, xs] : by_loop)
    asio::post(loop->io, [xs = std::move(xs)] {
      for (const auto& w : xs)
        if (auto x = w.lock()) x->run_wake();
    });
}

}  // namespace http

void HttpServer::Impl::refuse(tcp::socket& s) {
  // Over the connection limit: a short answer, written at once (a new socket's send buffer
  // is empty), then closed.
  // With the headers every answer carries (ResponseHeaders of a request with no header: the
  // replica's name, behind a balancer).
  const std::string busy = [this] {
    std::string h;
    if (response_headers)
      for (const http::Header& x : response_headers(http::Request{})) h += x.name + ": " + x.value + "\r\n";
    return "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\nConnection: close\r\n" +
           h + "Content-Length: " + std::to_string(error_body("too many connections").size()) + "\r\n\r\n" +
           error_body("too many connections");
  }();
  beast::error_code ec;
  s.non_blocking(true, ec);
  s.write_some(asio::buffer(busy), ec);
  s.shutdown(tcp::socket::shutdown_both, ec);
  s.close(ec);
}

void HttpServer::Impl::do_accept() {
  Loop& l = *loops[next_loop++ % loops.size()];
  acceptor->async_accept(l.io, [self = shared_from_this(), &l](const beast::error_code& ec, tcp::socket s) {
    if (ec == asio::error::operation_aborted || self->stopping.load() || !self->acceptor->is_open()) return;
    if (ec) {
      // Out of descriptors (or memory): wait a little instead of spinning on the error.
      self->accept_retry->expires_after(std::chrono::milliseconds(50));
      self->accept_retry->async_wait([self](const beast::error_code& e) {
        if (!e && !self->stopping.load()) self->do_accept();
      });
      return;
    }
    if (self->conns.load() >= self->max_conns) {
      self->refuse(s);
    } else {
      self->conns.fetch_add(1);
      auto c = std::make_shared<Connection>(*self, l, std::move(s));
      asio::post(l.io, [c] { c->start(); });
    }
    self->do_accept();
  });
}

HttpServer::HttpServer(http::Options o, http::HeadCheck check, http::Handler handler, http::ResponseHeaders headers)
    : impl_(std::make_shared<Impl>()) {
  impl_->opt = std::move(o);
  impl_->check = std::move(check);
  impl_->handler = std::move(handler);
  impl_->response_headers = std::move(headers);
  const int n = std::max(1, impl_->opt.threads);
  for (int i = 0; i < n; ++i) impl_->loops.push_back(std::make_unique<Loop>());
}

HttpServer::~HttpServer() { stop(); }

Status HttpServer::listen() {
  Impl& m = *impl_;
  // Every connection is a descriptor: take the hard limit, and keep a margin for files.
  rlimit rl{};
  if (::getrlimit(RLIMIT_NOFILE, &rl) == 0) {
    const rlim_t want = rl.rlim_max == RLIM_INFINITY ? rlim_t(1) << 20 : rl.rlim_max;
    if (rl.rlim_cur < want) {
      rlimit up = rl;
      up.rlim_cur = want;
      if (::setrlimit(RLIMIT_NOFILE, &up) == 0) rl = up;
    }
  }
  const int64_t fds = rl.rlim_cur == RLIM_INFINITY ? int64_t(1) << 20 : static_cast<int64_t>(rl.rlim_cur);
  m.max_conns = m.opt.max_connections > 0 ? m.opt.max_connections : std::max<int64_t>(16, fds - 256);
  try {
    asio::io_context& io = m.loops[0]->io;
    tcp::resolver resolver(io);
    auto results = resolver.resolve(m.opt.host, std::to_string(m.opt.port), tcp::resolver::passive);
    if (results.empty()) return Status::io_error("cannot bind to " + m.opt.host + ": no such address");
    const tcp::endpoint ep = results.begin()->endpoint();
    auto acc = std::make_unique<tcp::acceptor>(io);
    acc->open(ep.protocol());
    // SO_REUSEADDR only: SO_REUSEPORT would let a second server bind our port and silently
    // take half of its connections.
    acc->set_option(asio::socket_base::reuse_address(true));
    beast::error_code ec;
    acc->bind(ep, ec);
    if (ec)
      return Status::io_error("cannot bind to " + m.opt.host + ":" + std::to_string(m.opt.port) + " (" + ec.message() +
                              ")");
    acc->listen(asio::socket_base::max_listen_connections, ec);
    if (ec) return Status::io_error("cannot listen on " + m.opt.host + ": " + ec.message());
    m.port = acc->local_endpoint().port();
    m.acceptor = std::move(acc);
    m.accept_retry = std::make_unique<asio::steady_timer>(io);
  } catch (const std::exception& e) {
    return Status::io_error("cannot bind to " + m.opt.host + ":" + std::to_string(m.opt.port) + " (" + e.what() + ")");
  }
  return Status::ok();
}

int HttpServer::port() const { return impl_->port; }

void HttpServer::start() {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lk(m.mu);
  if (m.started || !m.acceptor) return;
  m.started = true;
  for (auto& l : m.loops) m.guards.push_back(asio::make_work_guard(l->io));
  asio::post(m.loops[0]->io, [self = impl_] { self->do_accept(); });
  for (auto& l : m.loops)
    m.threads.emplace_back([io = &l->io] {
      for (;;) {
        try {
          io->run();
          return;
        } catch (const std::exception& e) {
          std::fprintf(stderr, "laplace serve: http: %s\n", e.what());
        }
      }
    });
}

void HttpServer::stop_accepting() {
  Impl& m = *impl_;
  if (!m.acceptor) return;
  asio::post(m.loops[0]->io, [self = impl_] {
    beast::error_code ec;
    if (self->acceptor) self->acceptor->close(ec);
  });
}

void HttpServer::stop() {
  Impl& m = *impl_;
  {
    std::lock_guard<std::mutex> lk(m.mu);
    if (m.stopped) return;
    m.stopped = true;
  }
  m.stopping.store(true);
  if (m.started) {
    for (size_t i = 0; i < m.loops.size(); ++i) {
      Loop* l = m.loops[i].get();
      asio::post(l->io, [self = impl_, l, i] {
        beast::error_code ec;
        if (i == 0) {
          if (self->acceptor) self->acceptor->close(ec);
          if (self->accept_retry) self->accept_retry->cancel();
        }
        std::vector<std::shared_ptr<Connection>> all;
        for (auto& [p, w] : l->conns)
          if (auto c = w.lock()) all.push_back(c);
        for (auto& c : all) c->close_now();
      });
    }
    m.guards.clear();
    for (auto& t : m.threads) t.join();
    m.threads.clear();
  }
  for (auto& l : m.loops) l->io.stop();
}

int64_t HttpServer::connections() const { return impl_->conns.load(); }
int64_t HttpServer::max_connections() const { return impl_->max_conns; }

}  // namespace laplace
