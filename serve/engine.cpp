#include "serve/engine.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <limits>
#include <tuple>

#include "serve/draft_model.h"

namespace laplace {

const char* finish_reason_name(FinishReason r) {
  switch (r) {
    case FinishReason::kLength: return "length";
    case FinishReason::kStop: return "stop";
    case FinishReason::kEos: return "eos";
    case FinishReason::kCancelled: return "cancelled";
  }
  return "?";
}

const char* state_source_name(StateSource s) {
  switch (s) {
    case StateSource::kEmpty: return "empty";
    case StateSource::kSnapshot: return "snapshot";
    case StateSource::kDeviceCache: return "device_cache";
    case StateSource::kHostCache: return "host_cache";
  }
  return "?";
}

int64_t slots_for_memory(const Config& c, int64_t budget_bytes, DType state_dtype, PendingSpec pending) {
  const int64_t bytes = StatePool::slot_bytes_for(c, state_dtype, pending);
  const int64_t elems = bytes / static_cast<int64_t>(dtype_size(state_dtype));  // values per slot
  if (bytes <= 0 || budget_bytes <= 0) return 0;
  int64_t s = budget_bytes / bytes;  // pool slots, scratch included
  while (s >= 1 &&
         Arena::planned_bytes({{"states", state_dtype, {s, elems}}}) > static_cast<size_t>(budget_bytes))
    --s;
  return std::max<int64_t>(s - 1, 0);
}

Status resolve_slots(const Config& c, const EngineOptions& o, DType st, int64_t* live, int64_t* cache,
                     PendingSpec pending) {
  if (o.max_slots < 0) return Status::invalid_argument("engine: max_slots must be ≥ 0");
  if (o.cache_slots < -1) return Status::invalid_argument("engine: cache_slots must be ≥ 0 (or -1: as many as live slots)");
  if (o.max_slots > 0) {
    *live = o.max_slots;
    *cache = o.cache_slots == -1 ? o.max_slots : o.cache_slots;
    return Status::ok();
  }
  if (o.memory_budget <= 0) return Status::invalid_argument("engine: give max_slots or a memory budget to derive it from");
  // Pool slots the budget holds (slots_for_memory leaves one out for the scratch slot).
  const int64_t pool = slots_for_memory(c, o.memory_budget, st, pending) + 1;
  const int64_t slot_bytes = StatePool::slot_bytes_for(c, st, pending);
  if (o.cache_slots == -1) {
    *live = (pool - 1) / 2;  // split evenly: live + cache + scratch ≤ pool
    *cache = *live;
  } else {
    *live = pool - 1 - o.cache_slots;
    *cache = o.cache_slots;
  }
  if (pool < 2 || *live < 1)
    return Status::out_of_memory("engine: a memory budget of " + std::to_string(o.memory_budget) +
                                 " bytes holds no state slot (one slot is " + std::to_string(slot_bytes) +
                                 " bytes, plus one scratch slot" +
                                 (*cache > 0 ? " and " + std::to_string(*cache) + " cache slots" : std::string()) + ")");
  return Status::ok();
}

// ---- engine --------------------------------------------------------------------------

struct Engine::Seq {
  Seq(Request r, int32_t eos) : req(std::move(r)), sampler(req.sampling), eos(eos) {
    // Penalties see the whole context, as they would had it been fed as one prompt.
    if (req.initial_state) sampler.observe_prompt(req.initial_state->tokens);
    sampler.observe_prompt(req.prompt);
  }
  // The context fed so far for snapshots: initial tokens + prompt (+ generated).
  std::vector<int32_t> context_tokens() const {
    std::vector<int32_t> t;
    if (req.initial_state) t = req.initial_state->tokens;
    t.insert(t.end(), req.prompt.begin(), req.prompt.end());
    return t;
  }
  Request req;
  Sampler sampler;
  int32_t eos = -1;
  int32_t slot = -1;
  int64_t prefilled = 0;    // prompt tokens fed so far
  bool decoding = false;    // prefill done; `next` is fed by the next decode
  int32_t next = 0;
  std::vector<int32_t> generated;  // kept only for capture_final_state / cache_final_state
  std::vector<int32_t> context;    // speculative decoding: the whole context, what the drafter reads
  // The logits after the start state's tokens (a cache hit or the initial snapshot): the
  // first token's when nothing is left to prefill.
  std::shared_ptr<const std::vector<float>> start_logits;
  std::vector<TokenLogprobs> prompt_lps;  // Request::prompt_logprobs, one per prompt token fed so far
  bool done = false;        // finished or cancelled (set under mu_)
  std::atomic<bool> cancelled{false};
  FinishInfo info;
};

Engine::Engine(Model& m, const EngineOptions& opt) : model_(m), opt_(opt), t0_(std::chrono::steady_clock::now()) {}

Engine::~Engine() {
  if (in_flight_) model_.backend().synchronize();  // a queued decode still writes the pool
}

double Engine::now() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
}

Status Engine::create(Model& model, const EngineOptions& o, std::unique_ptr<Engine>* out) {
  EngineOptions opt = o;
  const Config& c = model.config();
  if (opt.max_batch_tokens < 1) return Status::invalid_argument("engine: max_batch_tokens must be ≥ 1");
  if (opt.prefill_chunk < 1) return Status::invalid_argument("engine: prefill_chunk must be ≥ 1");
  if (opt.cache_host_bytes < 0) return Status::invalid_argument("engine: cache_host_bytes must be ≥ 0");
  DType st = model.dtype() == DType::kF64 ? DType::kF64 : DType::kF32;
  if (opt.state_dtype == DType::kBF16) {
    if (model.dtype() != DType::kBF16 || model.backend().device() != Device::kCUDA)
      return Status::invalid_argument("engine: BF16 states need a BF16 model on CUDA");
    st = DType::kBF16;
  } else if (opt.state_dtype != DType::kF32) {
    return Status::invalid_argument("engine: state dtype must be F32 or BF16");
  }
  opt.state_dtype = st;
  const PendingSpec pending{opt.defer_writeback, model.dtype()};
  if (pending.steps != 0 && !PendingSpec::supported(pending.steps))
    return Status::invalid_argument("engine: deferred write-back takes R = 4, 8 or 16 (0 = off), not " +
                                    std::to_string(pending.steps));
  if (opt.speculative_k < 0 || opt.speculative_k > kMaxSpeculativeK)
    return Status::invalid_argument("engine: speculative decoding drafts 1 to " + std::to_string(kMaxSpeculativeK) +
                                    " tokens per step (0 = off), not " + std::to_string(opt.speculative_k));
  if (opt.speculative_k > 0) {
    const int64_t k = opt.speculative_k;
    if (pending.steps <= k)
      return Status::invalid_argument(
          "engine: speculative decoding with k = " + std::to_string(k) + " needs deferred write-back with R > k "
          "(--defer-writeback " + std::string(k < 4 ? "4, 8 or 16" : k < 8 ? "8 or 16" : "16") + "; it is " +
          std::to_string(pending.steps) + "): a window of k + 1 tokens must fit the slot's pending pairs and meet "
          "at most one write-back (docs/serving.md §11)");
    if (!model.backend().supports({"gla_verify_deferred", model.dtype(), {c.num_heads, c.head_k_dim, c.head_v_dim}}) ||
        !model.backend().supports({"gla_verify_commit", model.dtype(), {c.num_heads, c.head_k_dim, c.head_v_dim}}))
      return Status::unsupported(std::string("engine: speculative decoding needs the verification ops, which the ") +
                                 model.backend().name() + " backend does not have yet (the CPU has them; "
                                 "docs/serving.md §11)");
    if (st == DType::kBF16) return Status::invalid_argument("engine: speculative decoding takes F32 states");
    // A verification's rows are exact (no padded widths), and its tokens are picked on the host.
    opt.pipeline = false;
  }
  LAPLACE_RETURN_IF_ERROR(resolve_slots(c, opt, st, &opt.max_slots, &opt.cache_slots, pending));
  if (opt.max_slots + 1 + opt.cache_slots >= INT32_MAX)
    return Status::invalid_argument("engine: max_slots + cache_slots too large");
  if ((opt.graphs || opt.default_widths) && opt.decode_widths.empty())
    opt.decode_widths = default_decode_widths(opt.max_slots);
  std::sort(opt.decode_widths.begin(), opt.decode_widths.end());
  opt.decode_widths.erase(std::unique(opt.decode_widths.begin(), opt.decode_widths.end()), opt.decode_widths.end());
  for (int64_t w : opt.decode_widths)
    if (w < 1) return Status::invalid_argument("engine: decode widths must be ≥ 1");
  if (!opt.decode_widths.empty() && opt.decode_widths.back() < opt.max_slots) opt.decode_widths.push_back(opt.max_slots);
  const int64_t max_width = opt.decode_widths.empty() ? opt.max_slots : opt.decode_widths.back();

  std::unique_ptr<Engine> e(new Engine(model, opt));
  e->max_slots_ = opt.max_slots;
  e->vocab_ = c.vocab_size;
  e->default_eos_ = c.eos_token_id >= 0 && c.eos_token_id < c.vocab_size ? static_cast<int32_t>(c.eos_token_id) : -1;
  LAPLACE_RETURN_IF_ERROR(
      e->pool_.create(c, model.backend(), opt.max_slots + 1 + opt.cache_slots, st, pending).with_context("engine"));
  e->cache_ = std::make_unique<StateCache>(e->pool_, model.backend(), static_cast<int32_t>(opt.max_slots + 1),
                                           opt.cache_slots, opt.cache_host_bytes);
  e->cache_on_ = e->cache_->enabled();
  const Device dev = model.backend().device();
  if (opt.batch_prefill < 0)
    e->batch_prefill_ = dev == Device::kCPU || dev == Device::kCUDA ? kBatchPrefillRagged : 0;
  else
    e->batch_prefill_ = opt.batch_prefill;
  if (opt.plan_model) {
    // Decode forwards are max_width rows of 1 token and prefill forwards 1 row of at most
    // prefill_chunk tokens, and only last-token logits are read: max(width, chunk) rows.
    PlanOptions po;
    po.max_batch = max_width;
    po.max_seq = opt.prefill_chunk;
    po.max_tokens = std::max(max_width, opt.prefill_chunk);
    if (e->batch_prefill_) po.max_tokens = std::max(po.max_tokens, opt.max_batch_tokens);
    po.max_logit_rows = max_width;
    if (opt.speculative_k > 0) {  // verifications: every row's k + 1 positions, every logit row
      const int64_t rows = max_width * (opt.speculative_k + 1);
      po.verify_rows = rows;
      po.max_seq = std::max(po.max_seq, opt.speculative_k + 1);
      po.max_tokens = std::max(po.max_tokens, rows);
      po.max_logit_rows = rows;
    }
    LAPLACE_RETURN_IF_ERROR(model.plan(po).with_context("engine: plan"));
  } else {
    const PlanOptions& p = model.plan_options();
    const int64_t vrows = opt.speculative_k > 0 ? max_width * (opt.speculative_k + 1) : 0;
    if (p.training || p.max_batch < max_width || p.max_seq < opt.prefill_chunk ||
        model.plan_rows() < std::max(max_width, opt.prefill_chunk) || model.logit_rows() < max_width ||
        p.verify_rows < vrows || model.logit_rows() < vrows || p.max_seq < opt.speculative_k + 1)
      return Status::invalid_argument("engine: the model's plan is smaller than the engine needs (batch " +
                                      std::to_string(max_width) + ", sequence " +
                                      std::to_string(opt.prefill_chunk) + ", inference)");
  }
  if (opt.graphs) {
    std::unique_ptr<GraphExecutor> g;
    LAPLACE_RETURN_IF_ERROR(GraphExecutor::create(model, e->pool_, opt.decode_widths, e->scratch_slot(), &g,
                                                      opt.prefill_graphs)
                                .with_context("engine: CUDA graphs (--eager runs without)"));
    e->exec_ = std::move(g);
  } else {
    e->exec_ = std::make_unique<EagerExecutor>(model, e->pool_);
  }
  // The graphs' warm-ups have tuned the decode shapes (Backend::set_tuning); from here on a
  // shape's first use (a prefill tail of a new length, an eager decode width) takes the
  // library's pick rather than stalling a request while candidates are timed.
  model.backend().set_tuning(false);
  if (opt.speculative_k > 0) {
    e->drafter_ = opt.drafter;
    if (!e->drafter_ && !opt.draft_model.empty()) {
      std::unique_ptr<DraftModelDrafter> d;
      LAPLACE_RETURN_IF_ERROR(open_draft_model(opt.draft_model, c, opt.draft_tokenizer, model.backend(),
                                               model.dtype(), opt.max_slots, &d)
                                  .with_context("engine"));
      e->drafter_ = std::move(d);
    }
    if (!e->drafter_) e->drafter_ = std::make_shared<NgramDrafter>();
  }
  e->by_slot_.resize(static_cast<size_t>(opt.max_slots));
  for (int64_t s = 0; s < opt.max_slots; ++s) e->free_slots_.insert(static_cast<int32_t>(s));
  *out = std::move(e);
  return Status::ok();
}

std::string Engine::summary() const {
  char buf[512];
  const double mib = static_cast<double>(pool_bytes()) / (1024.0 * 1024.0);
  std::string widths;
  for (int64_t w : opt_.decode_widths) {
    if (!widths.empty()) widths += ',';
    widths += std::to_string(w);
  }
  const std::string defer =
      pool_.pending_steps() ? ", written back every " + std::to_string(pool_.pending_steps()) + " steps" : "";
  std::snprintf(buf, sizeof buf,
                "engine: %lld slots (+1 scratch, +%lld cache) x %lld bytes/slot (%s states%s) = %.1f MiB of state; "
                "max_batch_tokens %lld, prefill_chunk %lld, decode widths %s (%s)",
                (long long)max_slots_, (long long)opt_.cache_slots, (long long)slot_bytes(),
                dtype_name(pool_.dtype()), defer.c_str(), mib, (long long)opt_.max_batch_tokens, (long long)opt_.prefill_chunk,
                widths.empty() ? "exact" : widths.c_str(), opt_.graphs ? "CUDA graphs captured" : "eager");
  std::string out = buf;
  if (opt_.speculative_k > 0)
    out += "; speculative decoding: up to " + std::to_string(opt_.speculative_k) + " drafted tokens per sequence and step";
  if (cache_on_) {
    std::snprintf(buf, sizeof buf, "\nstate cache: device tier %lld slots x %lld bytes/slot = %.1f MiB; host tier %.1f MiB",
                  (long long)opt_.cache_slots, (long long)slot_bytes(),
                  static_cast<double>(opt_.cache_slots * slot_bytes()) / (1024.0 * 1024.0),
                  static_cast<double>(opt_.cache_host_bytes) / (1024.0 * 1024.0));
    out += buf;
  } else {
    out += "\nstate cache: off";
  }
  return out;
}

Status Engine::submit(Request req, RequestId* id) {
  if (req.prompt.empty() && !req.initial_state) return Status::invalid_argument("request: empty prompt");
  if (const StateSnapshot* st = req.initial_state.get()) {
    if (st->state_dtype != pool_.dtype() || static_cast<int64_t>(st->state.size()) != pool_.slot_bytes())
      return Status::invalid_argument("request: the initial state is not a state of this engine's pool (" +
                                      std::to_string(st->state.size()) + " bytes of " + dtype_name(st->state_dtype) +
                                      ", the pool's slots are " + std::to_string(pool_.slot_bytes()) + " bytes of " +
                                      dtype_name(pool_.dtype()) + ")");
    if (Status bad = pool_.check_slot_bytes(st->state.data()); !bad.is_ok())
      return Status::invalid_argument("request: the initial state is corrupt: " + bad.message());
    if (static_cast<int64_t>(st->logits.size()) != vocab_ || st->tokens.empty())
      return Status::invalid_argument("request: the initial state needs its logits and tokens");
  }
  if (req.top_logprobs < -1 || req.top_logprobs > 20)
    return Status::invalid_argument("request: top_logprobs must be in [0, 20] (or -1 for none)");
  for (int32_t t : req.prompt)
    if (t < 0 || t >= vocab_)
      return Status::invalid_argument("request: prompt token id " + std::to_string(t) + " outside [0, " +
                                      std::to_string(vocab_) + ")");
  if (req.max_tokens < 1) return Status::invalid_argument("request: max_tokens must be ≥ 1");
  const SamplingOptions& so = req.sampling;
  if (!(so.temperature >= 0)) return Status::invalid_argument("request: temperature must be ≥ 0");
  if (so.top_k < 0) return Status::invalid_argument("request: top_k must be ≥ 0");
  if (!(so.top_p > 0 && so.top_p <= 1)) return Status::invalid_argument("request: top_p must be in (0, 1]");
  if (!(so.min_p >= 0 && so.min_p <= 1)) return Status::invalid_argument("request: min_p must be in [0, 1]");
  if (!(so.repetition_penalty > 0)) return Status::invalid_argument("request: repetition_penalty must be > 0");
  for (const auto& [t, bias] : so.logit_bias)
    if (t < 0 || t >= vocab_ || !std::isfinite(bias))
      return Status::invalid_argument("request: logit_bias token id " + std::to_string(t) + " outside [0, " +
                                      std::to_string(vocab_) + ") or bias not finite");
  if (req.prompt_logprobs && req.top_logprobs < 0)
    return Status::invalid_argument("request: prompt_logprobs needs top_logprobs ≥ 0");
  const int32_t eos = req.eos_id.has_value() ? *req.eos_id : default_eos_;
  auto s = std::make_unique<Seq>(std::move(req), eos);
  s->info.prompt_tokens = static_cast<int64_t>(s->req.prompt.size());  // tokens actually fed
  std::lock_guard<std::mutex> lk(mu_);
  s->info.id = next_id_++;
  s->info.submit_time = now();
  if (id) *id = s->info.id;
  live_[s->info.id] = s.get();
  queue_.push_back(std::move(s));
  ++stats_.submitted;
  return Status::ok();
}

void Engine::release_slot_locked(Seq* s) {
  // Caller holds mu_; s is running (has a slot) and not done.
  s->done = true;
  live_.erase(s->info.id);
  const int32_t slot = s->slot;
  auto it = std::find(prefilling_.begin(), prefilling_.end(), s);
  if (it != prefilling_.end()) prefilling_.erase(it);
  free_slots_.insert(slot);
  --running_;
  ++stats_.finished;
}

bool Engine::cancel(RequestId id) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = live_.find(id);
  if (it == live_.end()) return false;
  Seq* s = it->second;
  if (s->cancelled.exchange(true)) return false;
  ++cancels_;
  if (s->slot < 0) {  // still queued
    auto q = std::find_if(queue_.begin(), queue_.end(), [&](const auto& p) { return p.get() == s; });
    LAPLACE_CHECK(q != queue_.end(), "cancel: queued request not in the queue");
    s->done = true;
    s->info.reason = FinishReason::kCancelled;
    s->info.finish_time = now();
    live_.erase(it);
    pending_finish_.push_back(std::move(*q));
    queue_.erase(q);
    ++stats_.finished;
    ++stats_.cancelled;
    return true;
  }
  if (in_step_) {  // the step thread owns the slot now; released at the end of the step
    cancel_in_step_.push_back(s);
    return true;
  }
  finish_cancelled_locked(s);
  return true;
}

void Engine::finish_cancelled_locked(Seq* s) {
  s->info.reason = FinishReason::kCancelled;
  s->info.finish_time = now();
  const int32_t slot = s->slot;
  release_slot_locked(s);
  ++stats_.cancelled;
  pending_finish_.push_back(std::move(by_slot_[slot]));
}

std::vector<Engine::Seq*> Engine::admit_locked() {
  std::vector<Seq*> admitted;
  while (!queue_.empty() && !free_slots_.empty()) {
    std::unique_ptr<Seq> s = std::move(queue_.front());
    queue_.pop_front();
    const int32_t slot = *free_slots_.begin();
    free_slots_.erase(free_slots_.begin());
    s->slot = slot;
    s->info.slot = slot;
    s->info.admit_time = now();
    admitted.push_back(s.get());
    prefilling_.push_back(s.get());
    by_slot_[slot] = std::move(s);
    ++running_;
  }
  return admitted;
}

void Engine::start_context(Seq* s) {
  Backend& be = model_.backend();
  const SnapshotPtr& init = s->req.initial_state;
  const size_t init_tokens = init ? init->tokens.size() : 0;
  CacheHit hit;
  // Prompt log-probabilities need every position's logits: no cache hit may skip them.
  if (s->req.use_cache && cache_on_ && !s->req.prompt_logprobs)
    hit = cache_->restore(s->context_tokens(), init_tokens, s->slot);
  FinishInfo& info = s->info;
  if (hit.source != StateSource::kEmpty) {  // the slot holds the cached prefix now
    info.start = hit.source;
    info.cached_tokens = hit.tokens;
    s->prefilled = hit.tokens - static_cast<int64_t>(init_tokens);
    s->start_logits = std::move(hit.logits);
  } else if (init) {  // continue a context
    pool_.write_slot(be, s->slot, init->state.data());
    info.start = StateSource::kSnapshot;
    info.cached_tokens = static_cast<int64_t>(init_tokens);
    s->start_logits = std::shared_ptr<const std::vector<float>>(init, &init->logits);
  } else {
    pool_.reset(be, s->slot);  // a new, empty context
  }
  info.prompt_tokens = static_cast<int64_t>(s->req.prompt.size()) - s->prefilled;
  if (s->req.prompt_logprobs && !s->req.prompt.empty()) {
    const int k = std::max(s->req.top_logprobs, 0);
    if (init) {
      s->prompt_lps.push_back(token_logprobs(init->logits.data(), vocab_, s->req.prompt[0], k));
    } else {
      TokenLogprobs none;
      none.token = s->req.prompt[0];
      none.logprob = std::numeric_limits<float>::quiet_NaN();
      s->prompt_lps.push_back(none);
    }
  }
}

int64_t Engine::width_for(int64_t n) const {
  if (opt_.decode_widths.empty()) return n;
  auto it = std::lower_bound(opt_.decode_widths.begin(), opt_.decode_widths.end(), n);
  LAPLACE_CHECK(it != opt_.decode_widths.end(), "engine: no decode width holds the batch");
  return *it;
}

Engine::StepPlan Engine::plan_step() {
  StepPlan p;
  if (in_flight_) {  // queued by the last step: its rows are this step's decode
    p.decode = std::move(in_flight_rows_);
    p.batch = std::move(in_flight_batch_);
    p.in_flight = true;
    in_flight_ = false;
  } else {
    // One decode batch: every sequence past its prefill, in slot order.
    for (const auto& up : by_slot_) {
      Seq* s = up.get();
      if (s && s->decoding && !s->done && !s->cancelled.load()) p.decode.push_back(s);
    }
  }
  const int64_t n = static_cast<int64_t>(p.decode.size());
  if (n > 0 && !p.in_flight) {
    const int64_t w = width_for(n);
    p.batch.tokens.assign(static_cast<size_t>(w), 0);
    p.batch.slots.assign(static_cast<size_t>(w), scratch_slot());
    p.batch.live = n;
    for (int64_t b = 0; b < n; ++b) {
      p.batch.tokens[b] = p.decode[b]->next;
      p.batch.slots[b] = p.decode[b]->slot;
    }
  }
  // Prefill pieces in admission order under what the decode rows leave of the budget;
  // the first piece always runs (progress). Pieces are fixed by the prompt alone.
  int64_t budget = opt_.max_batch_tokens - n;
  for (Seq* s : prefilling_) {
    if (s->cancelled.load()) continue;  // cancelled during this step: released at its end
    const int64_t len = static_cast<int64_t>(s->req.prompt.size());
    int64_t pos = s->prefilled;
    bool stop = false;
    // Pieces that keep every position's logits fit the model's logits buffer.
    const int64_t chunk =
        s->req.prompt_logprobs ? std::max<int64_t>(1, std::min(opt_.prefill_chunk, model_.logit_rows())) : opt_.prefill_chunk;
    while (pos < len) {
      const int64_t piece = std::min(chunk, len - pos);
      if (!p.pieces.empty() && piece > budget) {
        stop = true;
        break;
      }
      p.pieces.push_back({s->req.prompt.data() + pos, piece, s->slot, pos + piece == len, s->req.prompt_logprobs});
      p.prefill.push_back(s);
      budget -= piece;
      pos += piece;
    }
    if (stop) break;
  }
  return p;
}

std::vector<int32_t> Engine::covered_tokens(const Seq* s, bool with_generated) const {
  std::vector<int32_t> t = s->context_tokens();
  // The last generated token was sampled from the current logits but never fed.
  if (with_generated && !s->generated.empty()) t.insert(t.end(), s->generated.begin(), s->generated.end() - 1);
  return t;
}

SnapshotPtr Engine::snapshot(Seq* s, const float* logits, bool with_generated) {
  auto st = std::make_shared<StateSnapshot>();
  st->state_dtype = pool_.dtype();
  st->state.resize(static_cast<size_t>(pool_.slot_bytes()));
  pool_.read_slot(model_.backend(), s->slot, st->state.data());
  st->logits.assign(logits, logits + vocab_);
  st->tokens = covered_tokens(s, with_generated);
  return st;
}

void Engine::finish(Seq* s, FinishReason r, const float* logits) {
  if (logits && s->req.capture_final_state) s->info.final_state = snapshot(s, logits, true);
  // Before the slot is released: the cache copies it (device tier: slot to slot).
  if (logits && s->req.cache_final_state && cache_on_)
    cache_->insert(s->slot, covered_tokens(s, true), std::make_shared<const std::vector<float>>(logits, logits + vocab_));
  {
    std::lock_guard<std::mutex> lk(mu_);
    s->info.reason = r;
    s->info.finish_time = now();
    const int32_t slot = s->slot;
    release_slot_locked(s);
    done_.push_back(std::move(by_slot_[slot]));
  }
  if (s->req.on_finish) s->req.on_finish(s->info);
}

void Engine::emit(Seq* s, const float* logits) { emit_token(s, s->sampler.sample(logits, vocab_), logits, -1); }

bool Engine::device_greedy_row(const Seq* s) const {
  return s->sampler.plain_greedy() && !(s->req.top_logprobs >= 0 && s->req.on_logprobs);
}

bool Engine::stop_rule(const Seq* s, int32_t tok, int64_t generated, FinishReason* r) const {
  if (s->eos >= 0 && tok == s->eos) *r = FinishReason::kEos;
  else if (std::find(s->req.stop_ids.begin(), s->req.stop_ids.end(), tok) != s->req.stop_ids.end()) *r = FinishReason::kStop;
  else if (generated >= s->req.max_tokens) *r = FinishReason::kLength;
  else return false;
  return true;
}

bool Engine::can_chain(const StepPlan& plan, const std::vector<int32_t>& ids) {
  const int64_t n = plan.batch.live;
  if (!opt_.pipeline || !exec_->can_chain() || n == 0 || !plan.pieces.empty() || !prefilling_.empty()) return false;
  int64_t cancels = 0;
  {
    // Every running sequence is a row (none waits to join the batch); under the lock
    // because cancel() between steps changes running_.
    std::lock_guard<std::mutex> lk(mu_);
    if (running_ != n) return false;
    cancels = cancels_;
  }
  if (!plan.in_flight || cancels != chain_cancels_ || static_cast<int64_t>(chain_rows_.size()) != n) {
    // A new batch (or a cancel since): read the rows' rules from their sequences.
    chain_rows_.resize(static_cast<size_t>(n));
    for (int64_t b = 0; b < n; ++b) {
      const Seq* s = plan.decode[b];
      if (s->done || s->cancelled.load() || s->req.stop_after) return false;
      chain_rows_[b] = {s->eos, s->req.max_tokens - s->info.generated_tokens, s->req.stop_ids.empty() ? nullptr : s};
    }
    chain_cancels_ = cancels;
  }
  // stop_rule() on the packed rows: would this step's token end the sequence?
  for (int64_t b = 0; b < n; ++b) {
    const ChainRow& r = chain_rows_[b];
    const int32_t tok = ids[static_cast<size_t>(b)];
    FinishReason why;
    if ((r.eos >= 0 && tok == r.eos) || r.left <= 1 ||
        (r.stop_ids && stop_rule(r.stop_ids, tok, r.stop_ids->info.generated_tokens + 1, &why))) {
      chain_cancels_ = -1;  // the batch changes: rebuild next time
      return false;
    }
  }
  for (ChainRow& r : chain_rows_) --r.left;  // this step's token is emitted without a stop
  return true;
}

bool Engine::deliver(Seq* s, int32_t tok, const float* logits, double t, FinishReason* r) {
  FinishInfo& info = s->info;
  if (info.first_token_time < 0) info.first_token_time = t;
  info.token_times.push_back(t);
  ++info.generated_tokens;
  if (s->req.capture_final_state || s->req.cache_final_state) s->generated.push_back(tok);
  if (drafter_) s->context.push_back(tok);
  if (s->req.top_logprobs >= 0 && s->req.on_logprobs && !s->cancelled.load()) {
    LAPLACE_CHECK(logits != nullptr, "emit_token: logprobs need the logits");
    s->req.on_logprobs(info.id, token_logprobs(logits, vocab_, tok, s->req.top_logprobs));
  }
  if (s->req.on_token && !s->cancelled.load()) s->req.on_token(info.id, tok);
  if (!stop_rule(s, tok, info.generated_tokens, r)) {
    if (!(s->req.stop_after && !s->cancelled.load() && s->req.stop_after(info.id, tok))) {
      s->next = tok;
      return false;
    }
    *r = FinishReason::kStop;  // the caller saw a stop: as if tok were a stop id
  }
  return true;
}

void Engine::emit_token(Seq* s, int32_t tok, const float* logits, int64_t row, double t) {
  FinishReason r;
  if (!deliver(s, tok, logits, t < 0 ? now() : t, &r)) return;
  if (!logits && (s->req.capture_final_state || (s->req.cache_final_state && cache_on_))) {
    exec_->last_row_logits(row, &row_logits_);  // only a finishing row's final state needs them
    logits = row_logits_.data();
  }
  finish(s, r, logits);
}

bool Engine::speculative_step(const StepPlan& plan, EngineStats* d) {
  const int64_t n = plan.batch.live, k = opt_.speculative_k;
  drafts_.resize(static_cast<size_t>(n));
  int64_t longest = 0;
  for (int64_t b = 0; b < n; ++b) {
    const Seq* s = plan.decode[b];
    // No draft past max_tokens: the window emits its accepted drafts and one token more.
    const int64_t room = std::min(k, s->req.max_tokens - s->info.generated_tokens - 1);
    drafter_->propose(s->info.id, s->context, room, &drafts_[b]);
    if (static_cast<int64_t>(drafts_[b].size()) > room) drafts_[b].resize(static_cast<size_t>(std::max<int64_t>(room, 0)));
    for (int32_t& t : drafts_[b])
      if (t < 0 || t >= vocab_) t = 0;  // a drafter's id outside the vocabulary is only a bad guess
    longest = std::max<int64_t>(longest, static_cast<int64_t>(drafts_[b].size()));
  }
  if (longest == 0) return false;
  // Rows of T = longest + 1: the last token, the draft, then the last token again as padding
  // (its positions are computed and never kept).
  VerifyBatch vb;
  vb.T = longest + 1;
  vb.slots.resize(static_cast<size_t>(n));
  vb.tokens.reserve(static_cast<size_t>(n * vb.T));
  for (int64_t b = 0; b < n; ++b) {
    const Seq* s = plan.decode[b];
    vb.slots[b] = s->slot;
    vb.tokens.push_back(s->next);
    vb.tokens.insert(vb.tokens.end(), drafts_[b].begin(), drafts_[b].end());
    vb.tokens.resize(static_cast<size_t>((b + 1) * vb.T), s->next);
  }
  const double t = now();
  exec_->verify(vb, &logits_);
  d->decode_seconds += now() - t;
  ++d->decode_forwards;
  ++d->verify_forwards;
  d->decode_tokens += n;
  // Each row walks its window: position p's token (sample_speculative: greedy's argmax, or the
  // rejection scheme against the drafted token) is emitted; the walk goes on while it equals the
  // draft and nothing ended the request. A row keeps the pairs of the positions it walked: those
  // tokens were fed, the last emitted one is its next input. The commit comes before any finish,
  // so a final snapshot or cache entry holds the context the emitted tokens leave.
  const double ts = now();
  accepted_.assign(static_cast<size_t>(n), 0);
  std::vector<std::tuple<Seq*, FinishReason, const float*>> ending;
  for (int64_t b = 0; b < n; ++b) {
    Seq* s = plan.decode[b];
    const std::vector<int32_t>& draft = drafts_[b];
    d->drafted_tokens += static_cast<int64_t>(draft.size());
    for (int64_t p = 0; p <= static_cast<int64_t>(draft.size()) && !s->cancelled.load(); ++p) {
      const float* lg = logits_.data() + (b * vb.T + p) * vocab_;
      const int32_t want = p < static_cast<int64_t>(draft.size()) ? draft[p] : -1;
      const int32_t tok = s->sampler.sample_speculative(lg, vocab_, want);
      ++accepted_[b];
      ++d->generated_tokens;
      FinishReason r;
      if (deliver(s, tok, lg, ts, &r)) {
        ending.emplace_back(s, r, lg);
        break;
      }
      if (tok != want) break;
      ++d->accepted_tokens;
    }
  }
  exec_->commit(accepted_);
  for (auto& [s, r, lg] : ending) finish(s, r, lg);
  d->sample_seconds += now() - ts;
  return true;
}

// Prompt done (its last piece fed, or nothing to feed after an initial state): offer the
// prompt snapshot, then emit the first token from `logits`.
void Engine::start_decoding(Seq* s, const float* logits) {
  prompt_done(s, logits);
  emit(s, logits);
}

void Engine::start_decoding_greedy(Seq* s, int32_t tok, int64_t row) {
  LAPLACE_CHECK(!prompt_needs_logits(s), "start_decoding_greedy: this sequence needs its prompt logits");
  prompt_done(s, nullptr);
  s->sampler.record(tok);
  emit_token(s, tok, nullptr, row);
}

bool Engine::prompt_needs_logits(const Seq* s) const {
  return (s->req.cache_prompt_state && cache_on_) || (s->req.capture_prompt_state && s->req.on_prompt_state);
}

void Engine::prompt_done(Seq* s, const float* logits) {
  auto it = std::find(prefilling_.begin(), prefilling_.end(), s);
  if (it != prefilling_.end()) prefilling_.erase(it);
  s->decoding = true;
  if (drafter_) s->context = s->context_tokens();
  // Nothing was fed after the start state: the prompt state IS that state.
  const bool nothing_fed = s->info.prompt_tokens == 0;
  const bool from_cache = s->info.start == StateSource::kDeviceCache || s->info.start == StateSource::kHostCache;
  if (s->req.cache_prompt_state && cache_on_ && !s->cancelled.load() && !(nothing_fed && from_cache)) {
    // (A full cache hit was refreshed by the lookup; anything else is a new context.)
    auto lg = nothing_fed && s->start_logits ? s->start_logits
                                              : std::make_shared<const std::vector<float>>(logits, logits + vocab_);
    cache_->insert(s->slot, s->context_tokens(), std::move(lg));
  }
  if (s->req.capture_prompt_state && s->req.on_prompt_state && !s->cancelled.load()) {
    const SnapshotPtr st = s->req.prompt.empty() && s->info.start == StateSource::kSnapshot
                               ? s->req.initial_state
                               : snapshot(s, logits, false);
    s->req.on_prompt_state(s->info.id, st);
  }
  if (s->req.prompt_logprobs && s->req.on_prompt_logprobs && !s->cancelled.load())
    s->req.on_prompt_logprobs(s->info.id, s->prompt_lps);
}

std::vector<std::vector<size_t>> Engine::prefill_groups(const StepPlan& plan) const {
  const size_t np = plan.pieces.size();
  std::vector<int> round(np, 0);
  std::unordered_map<const Seq*, int> seen;
  for (size_t i = 0; i < np; ++i) round[i] = seen[plan.prefill[i]]++;
  const bool ragged = batch_prefill_ == kBatchPrefillRagged;
  std::vector<size_t> order(np);
  for (size_t i = 0; i < np; ++i) order[i] = i;
  // By round; ragged: then by length, so that a group's pieces of one length are adjacent.
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    if (round[a] != round[b]) return round[a] < round[b];
    return ragged && plan.pieces[a].n < plan.pieces[b].n;
  });
  const int64_t max_group = batch_prefill_ ? std::min(model_.plan_options().max_batch, model_.logit_rows()) : 1;
  std::vector<std::vector<size_t>> groups;
  std::vector<int64_t> tokens;  // [group] its pieces' tokens
  // The round's group still taking pieces, by piece length (ragged: one, under length 0).
  std::unordered_map<int64_t, size_t> open;
  int current = -1;
  for (size_t i : order) {
    if (plan.prefill[i]->cancelled.load()) continue;  // released at the step's end
    if (round[i] != current) {
      current = round[i];
      open.clear();
    }
    const PrefillPiece& p = plan.pieces[i];
    const int64_t key = ragged ? 0 : p.n;
    auto it = p.all_logits ? open.end() : open.find(key);
    if (it != open.end()) {
      std::vector<size_t>& g = groups[it->second];
      if (static_cast<int64_t>(g.size()) < max_group && tokens[it->second] + p.n <= model_.plan_rows()) {
        g.push_back(i);
        tokens[it->second] += p.n;
        continue;
      }
    }
    groups.push_back({i});
    tokens.push_back(p.n);
    if (!p.all_logits) open[key] = groups.size() - 1;
  }
  return groups;
}

// A decode step of the running rows (plan.decode): one forward, or the one queued ahead collected,
// then each row's token emitted; the next greedy decode is queued first where it can be.
void Engine::decode_phase(const StepPlan& plan, EngineStats* d_out) {
  EngineStats& d = *d_out;
  // A decode queued ahead was chained only from all-greedy rows, whose options are fixed.
  bool greedy = opt_.device_greedy;
  for (int64_t b = 0; b < plan.batch.live && greedy && !plan.in_flight; ++b) greedy = device_greedy_row(plan.decode[b]);
  const double t = now();
  if (plan.in_flight) exec_->collect_greedy(plan.batch.live, &greedy_ids_);
  else if (greedy) exec_->decode_greedy(plan.batch, &greedy_ids_);
  else exec_->decode(plan.batch, &logits_);
  // The next step's decode goes to the device now, before the host emits this one's.
  const double tc = now();
  if (greedy && can_chain(plan, greedy_ids_)) {
    exec_->chain_greedy(plan.batch);
    ++d.chained_decodes;
    in_flight_ = true;
    in_flight_rows_ = plan.decode;
    in_flight_batch_ = plan.batch;
    d.chain_seconds += now() - tc;
  }
  d.decode_seconds += now() - t;
  ++d.decode_forwards;
  d.decode_tokens += plan.batch.live;
  d.padded_rows += plan.batch.width() - plan.batch.live;
  const double ts = now();  // the time of this step's greedy tokens
  for (int64_t b = 0; b < plan.batch.live; ++b) {
    Seq* s = plan.decode[b];
    if (s->cancelled.load()) continue;
    if (greedy) {
      s->sampler.record(greedy_ids_[static_cast<size_t>(b)]);
      emit_token(s, greedy_ids_[static_cast<size_t>(b)], nullptr, b, ts);
    } else {
      emit(s, logits_.data() + b * vocab_);
    }
    ++d.generated_tokens;
  }
  d.sample_seconds += now() - ts;
}

// The plan's prefill pieces, grouped into as few forwards as the plan allows; a piece that ends
// its prompt starts the sequence decoding from its last-token logits (or the device's pick).
void Engine::prefill_phase(const StepPlan& plan, EngineStats* d_out) {
  EngineStats& d = *d_out;
  std::vector<PrefillPiece> group_pieces;
  for (std::vector<size_t> group : prefill_groups(plan)) {
    // A callback of an earlier piece may have cancelled one (released at the step's end).
    std::erase_if(group, [&](size_t j) { return plan.prefill[j]->cancelled.load(); });
    if (group.empty()) continue;
    const size_t first = group.front();
    const PrefillPiece& head = plan.pieces[first];
    const double t = now();
    int64_t last_row = 0, row_step = 0;  // piece g's last-token logits: row last_row + g·row_step
    // A group's logits go to the host only if a prompt ends in it for a sequence that needs
    // them; where every such sequence is greedy, the device picks their first tokens.
    bool any_last = false, host_logits = false;
    for (size_t j : group) {
      const Seq* s = plan.prefill[j];
      if (!plan.pieces[j].last) continue;
      any_last = true;
      host_logits = host_logits || !opt_.device_greedy || !device_greedy_row(s) || prompt_needs_logits(s);
    }
    const bool greedy = group.size() > 1 && any_last && !host_logits;
    if (group.size() > 1) {
      group_pieces.clear();
      for (size_t j : group) group_pieces.push_back(plan.pieces[j]);
      if (greedy) exec_->prefill_group_greedy(group_pieces, &greedy_ids_);
      else exec_->prefill_group(group_pieces, any_last ? &logits_ : nullptr);
      row_step = 1;
    } else if (head.all_logits) {
      Seq* s = plan.prefill[first];
      exec_->prefill_all(head, &logits_);
      // Row r predicts the token after position prefilled + r.
      const int k = std::max(s->req.top_logprobs, 0);
      const int64_t len = static_cast<int64_t>(s->req.prompt.size());
      for (int64_t row = 0; row < head.n; ++row) {
        const int64_t next = s->prefilled + row + 1;
        if (next < len)
          s->prompt_lps.push_back(token_logprobs(logits_.data() + row * vocab_, vocab_, s->req.prompt[next], k));
      }
      last_row = head.n - 1;
    } else {
      exec_->prefill(head, head.last ? &logits_ : nullptr);
    }
    d.prefill_seconds += now() - t;
    ++d.prefill_forwards;
    for (size_t g = 0; g < group.size(); ++g) {
      Seq* s = plan.prefill[group[g]];
      const PrefillPiece& piece = plan.pieces[group[g]];
      d.prefill_tokens += piece.n;
      s->prefilled += piece.n;
      if (piece.last) {
        const double ts = now();
        if (greedy) start_decoding_greedy(s, greedy_ids_[g], static_cast<int64_t>(g));
        else start_decoding(s, logits_.data() + (last_row + static_cast<int64_t>(g) * row_step) * vocab_);
        ++d.generated_tokens;
        d.sample_seconds += now() - ts;
      }
    }
  }
}

bool Engine::step() {
  std::vector<std::unique_ptr<Seq>> notify;
  std::vector<Seq*> admitted;
  {
    std::lock_guard<std::mutex> lk(mu_);
    LAPLACE_CHECK(!in_step_, "engine: step() is not reentrant (one engine thread)");
    in_step_ = true;
    notify.swap(pending_finish_);
    admitted = admit_locked();
  }
  // Slot copies run here, on the engine thread, outside the lock (submit() need not wait
  // for them). The slots are this thread's: cancel() during a step only marks them.
  for (Seq* s : admitted) start_context(s);
  for (auto& s : notify)
    if (s->req.on_finish) s->req.on_finish(s->info);

  // Requests whose whole prompt is already in their start state (initial snapshot or a
  // cache hit): their first token comes from its logits (no forward); they decode in this step.
  EngineStats d;  // this step's counters
  bool instant = false;
  const std::vector<Seq*> waiting = prefilling_;
  for (Seq* s : waiting) {
    if (s->prefilled < static_cast<int64_t>(s->req.prompt.size()) || s->cancelled.load()) continue;
    const double ts = now();
    start_decoding(s, s->start_logits->data());
    ++d.generated_tokens;
    d.sample_seconds += now() - ts;
    instant = true;
  }

  StepPlan plan = plan_step();
  const bool work = instant || !notify.empty() || !plan.pieces.empty() || !plan.decode.empty();

  // Decode first: running sequences get their token before new prompts are prefilled.
  if (!plan.decode.empty() && !(drafter_ && !plan.in_flight && speculative_step(plan, &d))) decode_phase(plan, &d);
  prefill_phase(plan, &d);

  {
    std::lock_guard<std::mutex> lk(mu_);
    for (Seq* s : cancel_in_step_) {
      if (s->done) continue;  // finished on its own during the step
      finish_cancelled_locked(s);
    }
    cancel_in_step_.clear();
    d.steps = work ? 1 : 0;
    stats_ += d;
    exec_->prefill_graph_stats(&stats_.prefill_graph_captures, &stats_.prefill_graph_replays);
    in_step_ = false;
  }
  done_.clear();
  return work;
}

EngineStats& operator+=(EngineStats& a, const EngineStats& b) {
  a.steps += b.steps;
  a.prefill_tokens += b.prefill_tokens;
  a.prefill_forwards += b.prefill_forwards;
  a.decode_tokens += b.decode_tokens;
  a.decode_forwards += b.decode_forwards;
  a.padded_rows += b.padded_rows;
  a.chained_decodes += b.chained_decodes;
  a.generated_tokens += b.generated_tokens;
  a.submitted += b.submitted;
  a.finished += b.finished;
  a.cancelled += b.cancelled;
  a.prefill_seconds += b.prefill_seconds;
  a.decode_seconds += b.decode_seconds;
  a.sample_seconds += b.sample_seconds;
  a.chain_seconds += b.chain_seconds;
  a.prefill_graph_captures += b.prefill_graph_captures;
  a.prefill_graph_replays += b.prefill_graph_replays;
  a.verify_forwards += b.verify_forwards;
  a.drafted_tokens += b.drafted_tokens;
  a.accepted_tokens += b.accepted_tokens;
  return a;
}

bool Engine::idle() const {
  std::lock_guard<std::mutex> lk(mu_);
  return queue_.empty() && running_ == 0 && pending_finish_.empty();
}

void Engine::run_until_idle() {
  while (!idle()) step();
}

EngineStats Engine::stats() const {
  std::lock_guard<std::mutex> lk(mu_);
  EngineStats s = stats_;
  s.queued = static_cast<int64_t>(queue_.size());
  s.running = running_;
  s.free_slots = static_cast<int64_t>(free_slots_.size());
  return s;
}

}  // namespace laplace
