#include "bench/http_load.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include <nlohmann/json.hpp>

#include "bench/bench_log.h"
#include "core/rng.h"

namespace laplace {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

struct Stream {
  int fd = -1;
  std::string out, in;
  size_t sent = 0;
  size_t parsed = 0;  // body bytes already split into lines
  size_t body = 0;    // offset of the body in `in` (0: head not complete yet)
  int status = 0;
  double t_sent = -1, t_first = -1, t_last = -1;  // seconds from the run's start
  int64_t completion_tokens = -1;
  bool done = false;    // saw data: [DONE]
  bool closed = false;
  std::string error;    // an error event's message, or a parse failure
};

// Splits the complete lines of the event stream that arrived since the last call.
void parse_body(Stream& s, double now) {
  for (;;) {
    const size_t nl = s.in.find('\n', s.body + s.parsed);
    if (nl == std::string::npos) return;
    std::string line = s.in.substr(s.body + s.parsed, nl - (s.body + s.parsed));
    s.parsed = nl + 1 - s.body;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.rfind("data: ", 0) != 0) continue;
    const std::string data = line.substr(6);
    if (data == "[DONE]") {
      s.done = true;
      continue;
    }
    const nlohmann::json j = nlohmann::json::parse(data, nullptr, false);
    if (j.is_discarded()) {
      if (s.error.empty()) s.error = "an event that is not JSON: " + data.substr(0, 120);
      continue;
    }
    if (j.contains("error")) {
      if (s.error.empty()) s.error = "error event: " + j["error"].dump().substr(0, 200);
      continue;
    }
    if (j.contains("usage") && j["usage"].is_object() && j["usage"].contains("completion_tokens"))
      s.completion_tokens = j["usage"]["completion_tokens"].get<int64_t>();
    if (j.contains("choices") && j["choices"].is_array() && !j["choices"].empty()) {
      if (s.t_first < 0) s.t_first = now;
      s.t_last = now;
    }
  }
}

void parse_head(Stream& s) {
  const size_t end = s.in.find("\r\n\r\n");
  if (end == std::string::npos) return;
  s.body = end + 4;
  // "HTTP/1.x NNN reason"
  if (s.in.size() >= 12 && s.in.compare(0, 5, "HTTP/") == 0) s.status = std::atoi(s.in.c_str() + 9);
  else s.status = -1;
}

}  // namespace

Status run_http_load(const HttpLoadOptions& o, HttpLoadResult* r) {
  if (o.streams < 1) return Status::invalid_argument("--streams must be at least 1");
  if (o.prompt_len < 1 || o.max_tokens < 2) return Status::invalid_argument("--prompt-len ≥ 1 and --max-tokens ≥ 2");
  if (o.vocab < 1) return Status::invalid_argument("--vocab must be at least 1");
  *r = HttpLoadResult{};
  r->streams = o.streams;

  // One descriptor per stream, plus some slack.
  rlimit rl{};
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < static_cast<rlim_t>(o.streams) + 64) {
    rl.rlim_cur = std::min<rlim_t>(rl.rlim_max, static_cast<rlim_t>(o.streams) + 64);
    setrlimit(RLIMIT_NOFILE, &rl);
    getrlimit(RLIMIT_NOFILE, &rl);
    if (rl.rlim_cur < static_cast<rlim_t>(o.streams) + 16)
      return Status::unsupported("the descriptor limit (" + std::to_string(rl.rlim_max) + ") is below --streams " +
                                        std::to_string(o.streams) + ": raise it with ulimit -n");
  }
  addrinfo hints{}, *ai = nullptr;
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  const int gai = getaddrinfo(o.host.c_str(), std::to_string(o.port).c_str(), &hints, &ai);
  if (gai != 0) return Status::invalid_argument("cannot resolve " + o.host + ": " + gai_strerror(gai));
  std::vector<char> addr(reinterpret_cast<char*>(ai->ai_addr), reinterpret_cast<char*>(ai->ai_addr) + ai->ai_addrlen);
  const int family = ai->ai_family;
  freeaddrinfo(ai);

  const int ep = epoll_create1(EPOLL_CLOEXEC);
  if (ep < 0) return Status::io_error(std::string("epoll_create1: ") + std::strerror(errno));
  SplitMix64 rng{o.seed};
  std::vector<Stream> ss(static_cast<size_t>(o.streams));
  const Clock::time_point t0 = Clock::now();
  int open = 0, connected_any = 0;
  std::string connect_error;
  for (int i = 0; i < o.streams; ++i) {
    Stream& s = ss[static_cast<size_t>(i)];
    nlohmann::json ids = nlohmann::json::array();
    for (int64_t t = 0; t < o.prompt_len; ++t) ids.push_back(rng.below(static_cast<uint64_t>(o.vocab)));
    const nlohmann::json body = {{"prompt", ids}, {"max_tokens", o.max_tokens}, {"stream", true},
                                 {"ignore_eos", true}, {"temperature", 0},
                                 {"stream_options", {{"include_usage", true}}}};
    const std::string b = body.dump();
    s.out = "POST /v1/completions HTTP/1.0\r\nHost: " + o.host + "\r\nContent-Type: application/json\r\n" +
            (o.api_key.empty() ? "" : "Authorization: Bearer " + o.api_key + "\r\n") +
            "Content-Length: " + std::to_string(b.size()) + "\r\n\r\n" + b;
    s.fd = socket(family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (s.fd < 0) {
      s.closed = true;
      s.error = std::string("socket: ") + std::strerror(errno);
      continue;
    }
    if (connect(s.fd, reinterpret_cast<const sockaddr*>(addr.data()), static_cast<socklen_t>(addr.size())) != 0 &&
        errno != EINPROGRESS) {
      s.error = std::string("connect: ") + std::strerror(errno);
      if (connect_error.empty()) connect_error = s.error;
      close(s.fd);
      s.fd = -1;
      s.closed = true;
      continue;
    }
    epoll_event ev{};
    ev.events = EPOLLIN | EPOLLOUT;
    ev.data.u32 = static_cast<uint32_t>(i);
    epoll_ctl(ep, EPOLL_CTL_ADD, s.fd, &ev);
    ++open;
  }
  std::vector<epoll_event> evs(1024);
  while (open > 0 && seconds_since(t0) < o.timeout_s) {
    const int n = epoll_wait(ep, evs.data(), static_cast<int>(evs.size()), 100);
    const double now = seconds_since(t0);
    for (int k = 0; k < n; ++k) {
      Stream& s = ss[evs[k].data.u32];
      if ((evs[k].events & EPOLLOUT) && s.sent < s.out.size()) {
        const ssize_t w = send(s.fd, s.out.data() + s.sent, s.out.size() - s.sent, MSG_NOSIGNAL);
        if (w > 0) {
          s.sent += static_cast<size_t>(w);
          ++connected_any;
        } else if (w < 0 && errno != EAGAIN && errno != EWOULDBLOCK && s.error.empty()) {
          s.error = std::string("connect: ") + std::strerror(errno);  // the connect's failure shows here
        }
        if (s.sent == s.out.size()) {
          s.t_sent = now;
          epoll_event ev{};
          ev.events = EPOLLIN;
          ev.data.u32 = evs[k].data.u32;
          epoll_ctl(ep, EPOLL_CTL_MOD, s.fd, &ev);
        }
      }
      if (!(evs[k].events & (EPOLLIN | EPOLLHUP | EPOLLERR))) continue;
      char buf[16384];
      for (;;) {
        const ssize_t got = read(s.fd, buf, sizeof buf);
        if (got > 0) {
          s.in.append(buf, static_cast<size_t>(got));
          continue;
        }
        if (got == 0 || (errno != EAGAIN && errno != EWOULDBLOCK)) {
          if (got < 0 && s.error.empty() && !s.done) s.error = std::string("read: ") + std::strerror(errno);
          epoll_ctl(ep, EPOLL_CTL_DEL, s.fd, nullptr);
          close(s.fd);
          s.fd = -1;
          s.closed = true;
          --open;
        }
        break;
      }
      if (s.body == 0) parse_head(s);
      if (s.body > 0 && s.status == 200) {
        parse_body(s, now);
        // Drop the lines already read: thousands of long streams would otherwise keep every event.
        if (s.parsed > (64 << 10)) {
          s.in.erase(s.body, s.parsed);
          s.parsed = 0;
        }
      }
    }
  }
  r->wall_s = seconds_since(t0);
  for (Stream& s : ss)
    if (s.fd >= 0) {
      close(s.fd);
      if (s.error.empty()) s.error = "no end within --timeout";
    }
  close(ep);
  for (const Stream& s : ss)
    if (connect_error.empty() && !s.error.empty()) connect_error = s.error;
  if (connected_any == 0)
    return Status::io_error("no connection to " + o.host + ":" + std::to_string(o.port) + " could send a request" +
                               (connect_error.empty() ? "" : " (" + connect_error + ")"));

  if (std::getenv("LAPLACE_HTTP_LOAD_TRACE"))  // per stream: status, sent, first and last event (s), tokens
    for (size_t i = 0; i < ss.size(); ++i)
      std::fprintf(stderr, "stream %zu: status %d sent %.3f first %.3f last %.3f tokens %lld %s\n", i, ss[i].status,
                   ss[i].t_sent, ss[i].t_first, ss[i].t_last, (long long)ss[i].completion_tokens, ss[i].error.c_str());
  std::vector<double> ttft, decode_s, rates;
  double last_first = 0, first_last = 1e300;
  for (const Stream& s : ss) {
    const bool good = s.status == 200 && s.done && s.error.empty() && s.completion_tokens == o.max_tokens &&
                      s.t_first >= 0;
    if (good) {
      ++r->ok;
      r->tokens += s.completion_tokens;
      // A stream whose events all arrived at once has no timing of its own: tokens whose text
      // is empty (control tokens; the server sends no event for them) or held back leave it
      // silent until its end. It counts as ok, without a rate or a TTFT.
      if (s.t_last > s.t_first) {
        ttft.push_back(1e3 * (s.t_first - s.t_sent));
        last_first = std::max(last_first, s.t_first);
        first_last = std::min(first_last, s.t_last);
        decode_s.push_back(s.t_last - s.t_first);
        rates.push_back(static_cast<double>(o.max_tokens - 1) / (s.t_last - s.t_first));
      } else {
        ++r->silent;
      }
      continue;
    }
    if (s.status == 429) {
      ++r->rejected;
      continue;
    }
    ++r->failed;
    if (r->first_failure.empty()) {
      if (!s.error.empty()) r->first_failure = s.error;
      else if (s.status != 200) r->first_failure = "status " + std::to_string(s.status) + ": " + s.in.substr(0, 200);
      else r->first_failure = "stream ended after " + std::to_string(s.completion_tokens) + " tokens (usage), " +
                              (s.done ? "with" : "without") + " [DONE]";
    }
  }
  r->ttft_p50_ms = bench_percentile(ttft, 50);
  r->ttft_p99_ms = bench_percentile(ttft, 99);
  r->stream_tok_s_p50 = bench_percentile(rates, 50);
  // Every admitted stream decodes in the same engine steps, so the aggregate is the median
  // stream's rate times the streams (robust to a stream whose events came in bursts).
  r->decode_tok_s = r->stream_tok_s_p50 * static_cast<double>(r->ok);
  const double med = bench_percentile(decode_s, 50);
  r->overlap = r->ok > 0 && med > 0 ? std::max(0.0, first_last - last_first) / med : 0;
  return Status::ok();
}

}  // namespace laplace
