// `laplace serve`: the OpenAI-compatible HTTP server (serve/http/server.h).
#include <cctype>
#include <csignal>
#include <cstdio>
#include <thread>

#include "cli/common.h"
#include "core/file_util.h"

#ifdef LAPLACE_HAVE_SERVER
#include "serve/http/server.h"
#endif

namespace laplace::cli {

namespace {

#ifdef LAPLACE_HAVE_SERVER
volatile std::sig_atomic_t g_stop = 0;
void on_signal(int) { g_stop = 1; }
#endif

struct ServeArgs {
  std::string model_dir, name, host = "127.0.0.1", api_key, api_key_file, device = "cpu", dtype = "f32";
  std::vector<std::string> allowed_hosts, cors_origins;
  std::string session_dir;
  std::string replica_id;
  int port = 8000, threads = 4, read_timeout = 10;
  int64_t max_sessions = 1024, max_session_mb = 0, session_disk_mb = 0, max_session_files = 0, max_connections = 0;
  double grace_seconds = 30;
  int64_t max_slots = 0, max_queue = 64, max_batch_tokens = 2048, prefill_chunk = 256;
  std::string batch_prefill = "auto";
  int64_t max_file_queue = 32;
  int64_t max_tokens = 4096, max_prompt_tokens = 32768, max_request_kb = 1024, cache_mb = 256, max_n = 16;
  int64_t cache_slots = -1;  // the state cache's device tier; -1 = as many as the live slots
  std::string memory_budget = "1G";
  std::string state_dtype = "f32";
  int64_t defer_writeback = 0;
  int64_t prefill_graphs = 16;
  bool eager = false;
  std::string speculative = "off";
};

Status run_serve(const ServeArgs& a) {
#ifndef LAPLACE_HAVE_SERVER
  (void)a;
  return Status::unsupported("this laplace was built without the HTTP server (Boost.Asio and Beast headers: apt-get install libboost-dev)");
#else
  ServerOptions o;
  o.model_dir = a.model_dir;
  o.model_name = a.name;
  o.host = a.host;
  o.port = a.port;
  o.api_key = a.api_key;
  o.allowed_hosts = a.allowed_hosts;
  o.cors_origins = a.cors_origins;
  if (!a.api_key_file.empty()) {
    LAPLACE_RETURN_IF_ERROR(read_file(a.api_key_file, &o.api_key));
    while (!o.api_key.empty() && (o.api_key.back() == '\n' || o.api_key.back() == '\r')) o.api_key.pop_back();
    if (o.api_key.empty()) return Status::invalid_argument("the API key file is empty");
  }
  o.device = a.device;
  LAPLACE_RETURN_IF_ERROR(parse_dtype(a.dtype, &o.dtype));
  LAPLACE_RETURN_IF_ERROR(
      engine_decode_options(a.device, a.state_dtype, a.eager, a.defer_writeback, a.prefill_graphs, &o.engine));
  LAPLACE_RETURN_IF_ERROR(speculative_options(a.speculative, &o.engine));
  o.engine.draft_tokenizer = a.model_dir + "/tokenizer.model";
  o.engine.max_slots = a.max_slots;
  if (a.max_slots == 0) LAPLACE_RETURN_IF_ERROR(parse_bytes(a.memory_budget, &o.engine.memory_budget));
  o.engine.cache_slots = a.cache_slots;
  o.engine.max_batch_tokens = a.max_batch_tokens;
  o.engine.prefill_chunk = a.prefill_chunk;
  o.engine.batch_prefill = batch_prefill_value(a.batch_prefill);
  o.max_queue = a.max_queue;
  o.max_request_bytes = a.max_request_kb * 1024;
  o.max_prompt_tokens = a.max_prompt_tokens;
  o.max_file_queue = a.max_file_queue;
  o.limits.max_tokens = a.max_tokens;
  o.limits.max_n = a.max_n;
  o.cache_bytes = a.cache_mb << 20;
  o.session_dir = a.session_dir;
  o.replica_id = a.replica_id;
  o.threads = a.threads;
  o.read_timeout_s = a.read_timeout;
  o.max_sessions = a.max_sessions;
  o.max_session_bytes = a.max_session_mb << 20;
  o.max_session_disk_bytes = a.session_disk_mb << 20;
  o.max_session_files = a.max_session_files;
  o.max_connections = a.max_connections;
  Server server(o);
  LAPLACE_RETURN_IF_ERROR(server.start());
  std::printf("laplace serve: listening on http://%s:%d (model %s loading)\n", a.host.c_str(), server.port(),
              a.model_dir.c_str());
  std::fflush(stdout);
  Status st = server.wait_ready();
  if (!st.is_ok()) {
    server.stop();
    return st;
  }
  std::printf("laplace serve: ready\n");
  std::fflush(stdout);
  std::signal(SIGINT, on_signal);
  std::signal(SIGTERM, on_signal);
  while (!g_stop) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  // SIGTERM / SIGINT: a graceful stop (nothing new admitted; running requests get
  // --grace-seconds to finish, then an error event or object each).
  std::printf("laplace serve: stopping (grace %.0f s)\n", a.grace_seconds);
  std::fflush(stdout);
  server.shutdown(a.grace_seconds);
  std::printf("laplace serve: stopped\n");
  return Status::ok();
#endif
}

}  // namespace

void add_serve(CLI::App& app) {
  auto* cmd = app.add_subcommand("serve", "OpenAI-compatible HTTP server (completions, chat, sessions, metrics)");
  auto a = std::make_shared<ServeArgs>();
  cmd->add_option("--model", a->model_dir, "model directory (config.json, model.safetensors, tokenizer.model)")
      ->required();
  cmd->add_option("--name", a->name, "model id clients use (default: the directory's name)");
  cmd->add_option("--replica-id", a->replica_id,
                  "this replica's name in a fleet: /health, /metrics, the X-Laplace-Replica header, saved sessions "
                  "(default HOSTNAME:PORT)")
      ->check([](const std::string& v) {
        if (v.empty() || v.size() > 64) return std::string("1 to 64 characters");
        for (char c : v)
          if (!std::isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '_' && c != '-' && c != ':')
            return std::string("letters, digits, '.', '_', '-' and ':' only");
        return std::string();
      });
  cmd->add_option("--host", a->host, "address to bind (default 127.0.0.1: this machine only)");
  cmd->add_option("--port", a->port, "port (0 = any free port)")->check(CLI::Range(0, 65535));
  cmd->add_option("--api-key", a->api_key, "require 'Authorization: Bearer KEY' on every route");
  cmd->add_option("--api-key-file", a->api_key_file, "read the API key from a file (keeps it out of ps)");
  cmd->add_option("--allowed-hosts", a->allowed_hosts,
                  "host names requests may use besides IP addresses and localhost (comma-separated; .example.com "
                  "= its subdomains; * = any)")
      ->delimiter(',');
  cmd->add_option("--cors-origin", a->cors_origins,
                  "web origins whose pages may call the API, e.g. https://app.example.com (comma-separated; * = any)")
      ->delimiter(',');
  cmd->add_option("--device", a->device, "cpu or cuda")->check(CLI::IsMember({"cpu", "cuda"}));
  cmd->add_option("--dtype", a->dtype, "f32 (CPU) or bf16 (CUDA)");
  add_decode_options(cmd, &a->state_dtype, &a->eager, &a->defer_writeback, &a->prefill_graphs);
  add_speculative_option(cmd, &a->speculative);
  cmd->add_option("--max-slots", a->max_slots, "sequences served at once (0 = from --memory-budget)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--memory-budget", a->memory_budget, "bytes for state slots when --max-slots is 0 (e.g. 512M)");
  cmd->add_option("--max-queue", a->max_queue, "requests that may wait for a slot before 429")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--max-batch-tokens", a->max_batch_tokens, "tokens per engine step")->check(CLI::PositiveNumber);
  cmd->add_option("--prefill-chunk", a->prefill_chunk, "longest prefill piece")->check(CLI::PositiveNumber);
  cmd->add_option("--batch-prefill", a->batch_prefill,
                  "prefill pieces of many requests in one forward: equal (one length), ragged (any lengths), off, or "
                  "auto (ragged)")
      ->check(CLI::IsMember(kBatchPrefillChoices));
  cmd->add_option("--max-tokens", a->max_tokens, "largest max_tokens a request may ask for")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--max-prompt-tokens", a->max_prompt_tokens,
                  "longest prompt accepted (in tokens; a longer text than it can hold is refused before tokenizing)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--max-file-queue", a->max_file_queue, "session saves and restores that may wait before 429")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--max-request-kb", a->max_request_kb, "largest request body (KiB)")->check(CLI::PositiveNumber);
  cmd->add_option("--max-n", a->max_n, "largest n")->check(CLI::PositiveNumber);
  cmd->add_option("--cache-mb", a->cache_mb, "host RAM for the exact state cache's host tier (0 = none)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--cache-slots", a->cache_slots,
                  "state slots on the device for the exact state cache's device tier (0 = none; default: as many "
                  "as the live slots, taken from --memory-budget when --max-slots is 0)")
      ->check(CLI::Range(int64_t{-1}, int64_t{1} << 30));
  cmd->add_option("--session-dir", a->session_dir, "directory for sessions saved to disk");
  cmd->add_option("--threads", a->threads, "HTTP event-loop threads (connections are not threads)")
      ->check(CLI::Range(1, 64));
  cmd->add_option("--read-timeout", a->read_timeout,
                  "seconds a request's header, and then its body, may take to arrive (absolute deadlines)")
      ->check(CLI::Range(1, 3600));
  cmd->add_option("--max-connections", a->max_connections, "open connections at most (0 = from the descriptor limit)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--max-sessions", a->max_sessions, "named sessions in memory at most")->check(CLI::PositiveNumber);
  cmd->add_option("--max-session-mb", a->max_session_mb, "host memory the named sessions may hold (0 = no bound)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--session-disk-mb", a->session_disk_mb, "bytes of session files in --session-dir (0 = no bound)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--max-session-files", a->max_session_files, "session files in --session-dir (0 = no bound)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--grace-seconds", a->grace_seconds,
                  "on SIGTERM: seconds running requests get to finish before they are ended")
      ->check(CLI::Range(0.0, 3600.0));
  cmd->callback([a] { g_exit_code = report(run_serve(*a)); });
}

}  // namespace laplace::cli
