// The inference engine (SPEC §3): many sequences served at once from a pool of fixed-size
// state slots, with continuous batching.
//
//   submit(Request) ──► FIFO queue ──admission──► slot s (zeroed) ──► chunked prefill,
//   one piece of ≤ prefill_chunk prompt tokens per step, under max_batch_tokens ──►
//   the last piece's logits give the first token ──► decoding: every decoding sequence
//   feeds its last token in ONE batched recurrent forward per step, its state updated
//   in place in its slot ──► sample ──► on_token ──► stop (eos / stop id / max_tokens)
//   or cancel ──► slot released ──► the next queued request is admitted.
//
// One step() = admit, then assemble a StepPlan (prefill pieces + one decode batch), then
// run it through a StepExecutor, then sample and emit. Assembly is separate from
// execution so that a CUDA-graph executor (decode widths padded to a fixed set captured
// at start-up, padded rows writing to the scratch slot) can replace the eager one
// without touching the scheduler. Everything the executor sees is slot-indexed.
//
// Threads: submit(), cancel(), stats() and the queries may be called from any thread;
// step() / run_until_idle() from one thread at a time (the engine thread). Callbacks run
// on the engine thread, outside the engine's lock (they may submit or cancel).
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <list>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/status.h"
#include "core/thread_annotations.h"
#include "model/model.h"
#include "model/state.h"
#include "serve/drafter.h"
#include "serve/generate.h"
#include "serve/request.h"
#include "serve/state_cache.h"
#include "serve/step_executor.h"

namespace laplace {

// EngineOptions::batch_prefill values.
constexpr int kBatchPrefillOff = 0, kBatchPrefillEqual = 1, kBatchPrefillRagged = 2;

struct EngineOptions {
  // Sequences served at once (state slots, the scratch slot not counted). 0 = derive
  // from memory_budget with slots_for_memory().
  int64_t max_slots = 0;
  // Bytes the state pool may take (scratch and cache slots included) when max_slots = 0.
  // On the CPU the caller gives it (--memory-budget); on CUDA the caller passes free
  // device memory minus a reserve for weights/activations.
  int64_t memory_budget = 0;
  // The state cache's device tier (serve/state_cache.h): spare pool slots beyond the live
  // ones and the scratch slot, each holding one cached context. 0 = no device tier;
  // -1 = as many as the live slots (with a memory budget, the budget is then split
  // evenly between live and cache slots).
  int64_t cache_slots = 0;
  // The state cache's host tier: bytes of host RAM for snapshots (0 = none). With both
  // this and cache_slots 0 the cache is off and Request::use_cache etc. do nothing.
  int64_t cache_host_bytes = 0;
  // Token budget of one step: decode rows (1 token each) + prefill piece tokens. One
  // prefill piece always runs when any prefill is pending, so prefills progress even when
  // decodes fill the budget.
  int64_t max_batch_tokens = 2048;
  // Longest prefill piece (tokens of one request per step). Pieces of a prompt are
  // [0, c), [c, 2c), ...: a function of the prompt alone, never of the batch, so a
  // request's prefill is the same whatever else runs (batch invariance).
  int64_t prefill_chunk = 256;
  // Allowed decode batch widths (sorted on create). Empty: the exact number of decoding
  // sequences (eager). Otherwise a batch of n rows is padded to the smallest width ≥ n;
  // padded rows feed token 0 into the scratch slot. max_slots is added if larger than all.
  std::vector<int64_t> decode_widths;
  // Plan the model for the engine's forwards: batch max decode width, sequence
  // prefill_chunk, max(width, prefill_chunk) token rows and max-width logit rows (decode
  // is width × 1 token, prefill 1 × piece). With false, the model must already be planned
  // at least that large.
  bool plan_model = true;
  // Prefill pieces of different sequences in a step share a forward (a burst of short
  // prompts then costs one weight read per step instead of one per prompt).
  // kBatchPrefillEqual: pieces of one length, as [G, n]; kBatchPrefillRagged: pieces of any
  // lengths, as one ragged forward (Model::forward_ragged: token-wise ops over all pieces'
  // tokens, the mixer per run of one length). Pieces stay a function of the prompt alone;
  // on the CPU the tokens and states are bitwise those of one piece at a time, on CUDA
  // equal within the kernels' tolerances with the same greedy tokens (CudaModel's batched
  // and ragged prefill tests). -1 (auto): ragged on every backend that has a ragged
  // forward; 0: off. With plan_model the plan then holds max_batch_tokens token rows.
  int batch_prefill = -1;
  // Decode steps whose rows are all plain greedy (temperature 0, no penalties, no
  // logprobs) take each token from an argmax where the logits are (the device), copying
  // B ids instead of B × V logits to the host; a row's logits are fetched only when its
  // final state is captured or cached. Same tokens as the host sampler (same tie rule).
  bool device_greedy = true;
  // Decode through CUDA graphs (GraphExecutor): every decode width is captured when the
  // engine is created, so no step waits for a capture. Needs a backend with graphs (CUDA).
  // With no decode_widths given, default_decode_widths(max_slots) are used.
  bool graphs = false;
  // With graphs: ragged prefill layouts kept as graphs (GraphExecutor; 0: prefill eagerly).
  int64_t prefill_graphs = 16;
  // Eager decode with the widths graphs would use (default_decode_widths when none are
  // given): the same kernels and shapes as graph decode, without graphs (--eager).
  bool default_widths = false;
  // State dtype: kF32 (docs/model.md §5; F64 models get F64), or kBF16 for BF16 models on CUDA:
  // half the bytes per slot, so about twice the slots and half the decode state traffic,
  // at the cost of one BF16 rounding of the state per token (docs/serving.md).
  DType state_dtype = DType::kF32;
  // Deferred write-back (docs/serving.md §4): 0 = off (docs/model.md §5's slot); R = 4, 8 or 16 reads
  // each state every decode step but writes it back every R-th, keeping the last R − 1
  // tokens' (k, v) in a tail of the slot (+5 % bytes for laplace-3b at R = 8). Tokens may
  // differ from R = 0 by F32 rounding order; for a given R they are batch invariant and
  // eager and graph decode give the same bits.
  int64_t defer_writeback = 0;
  // Pipelined greedy decode: when a decode step leaves the next one's batch unchanged (every
  // row greedy on the device, no row finishing or cancelled, no prefill in the step), the
  // next step's forward is queued, fed the ids where they lie, before this step's tokens are
  // emitted, so the device runs it while the host emits and calls back. The step that
  // collects it starts from that batch (requests that start decoding meanwhile join the step
  // after). Tokens and states are those of unpipelined decoding; only timing changes.
  bool pipeline = true;
  // Speculative decoding (docs/serving.md §11): 0 = off; k = 1 … 8 = each decoding sequence's
  // last token and up to k drafted tokens run as one verification forward (Model::verify), and
  // the tokens the model itself gives are kept, as many as match the draft plus one. Greedy
  // tokens are bitwise those without it (on the CPU); sampled tokens keep their distribution.
  // Needs deferred write-back with R > k (a window of k + 1 tokens then meets at most one
  // write-back and fits the slot's pending pairs) and a backend with the verification ops
  // (the CPU; the CUDA backend refuses it at create()). Turns pipelining off.
  int64_t speculative_k = 0;
  // Where the drafts come from; null = a draft model when draft_model names one, else
  // NgramDrafter (prompt lookup in the sequence's context).
  std::shared_ptr<Drafter> drafter;
  // A draft model's directory (--speculative draft:DIR): create() loads it on the served model's
  // backend in its dtype (serve/draft_model.h), with a state slot per live slot (not counted in
  // memory_budget), after checking its vocabulary and its tokenizer.model against
  // draft_tokenizer (the served model's tokenizer file; empty: not checked).
  std::string draft_model, draft_tokenizer;
};

// The longest draft EngineOptions::speculative_k allows.
constexpr int64_t kMaxSpeculativeK = 8;

struct EngineStats {
  int64_t steps = 0;              // step() calls that did work
  int64_t prefill_tokens = 0;     // prompt tokens fed through prefill forwards
  int64_t prefill_forwards = 0;
  int64_t decode_tokens = 0;      // live rows fed through decode forwards (a verification's row once)
  int64_t decode_forwards = 0;
  int64_t padded_rows = 0;        // padding rows run (decode_widths)
  int64_t chained_decodes = 0;    // decode forwards queued ahead (EngineOptions::pipeline)
  int64_t generated_tokens = 0;   // tokens emitted through on_token
  int64_t submitted = 0, finished = 0, cancelled = 0;  // finished includes cancelled
  int64_t queued = 0, running = 0, free_slots = 0;     // now
  double prefill_seconds = 0, decode_seconds = 0, sample_seconds = 0;  // executor / host sampling time
  // Of decode_seconds, the host's time from a step's ids in hand to the next step queued
  // (the stop check and chain_greedy: the copy, the replay's launch, the argmax). With the
  // device caught up, the GPU idles for about this long between pipelined steps.
  double chain_seconds = 0;
  // Ragged prefill forwards captured as CUDA graphs, and replayed from them (--prefill-graphs).
  int64_t prefill_graph_captures = 0, prefill_graph_replays = 0;
  // Speculative decoding: verification forwards (counted in decode_forwards too), the drafted
  // tokens they checked and those accepted (each also emitted: generated_tokens counts them).
  int64_t verify_forwards = 0, drafted_tokens = 0, accepted_tokens = 0;
};

// Adds b's counters and times to a's; the fields that say "now" (queued, running, free_slots)
// stay a's. A step sums its own counters into the engine's with it.
EngineStats& operator+=(EngineStats& a, const EngineStats& b);

// Usable slots (the scratch slot not counted) whose pool fits in budget_bytes, as
// StatePool allocates it (one arena block of (slots + 1) × slot bytes). 0 if none fit.
// With deferred write-back (pending.steps > 0) a slot also holds its pending tail.
int64_t slots_for_memory(const Config& c, int64_t budget_bytes, DType state_dtype = DType::kF32,
                         PendingSpec pending = {});

// The live and cache slot counts an engine gets from its options (what Engine::create
// uses): max_slots or the memory budget, and cache_slots (-1 resolved). Errors:
// invalid_argument (neither a count nor a budget, cache_slots < -1), out_of_memory (the
// budget holds no live slot).
Status resolve_slots(const Config& c, const EngineOptions& o, DType state_dtype, int64_t* live, int64_t* cache,
                     PendingSpec pending = {});

class Engine {
 public:
  // Creates the pool (max_slots live slots, 1 scratch slot, cache_slots cache slots, in
  // that order; F32 states, F64 for F64 models) and plans the model. `model` must outlive the engine. Errors: invalid_argument (options),
  // out_of_memory (pool or activations).
  static Status create(Model& model, const EngineOptions& opt, std::unique_ptr<Engine>* out);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Queues a request (it never fails for lack of slots: it waits). Errors:
  // invalid_argument (empty prompt, id ≥ vocab_size, max_tokens < 1, bad sampling).
  Status submit(Request req, RequestId* id);
  // Cancels a queued or running request: a queued one leaves the queue; a running one's
  // slot is freed at once (between steps; when called during a step from another thread,
  // at the end of that step), so a queued request takes it at the next step. No tokens
  // are emitted for it after cancel() returns (except one being delivered concurrently);
  // on_finish(kCancelled) follows on the engine thread at the next step. False if the id
  // is unknown or already finished.
  bool cancel(RequestId id);

  // One iteration: deliver pending cancellations, admit, prefill pieces, one batched
  // decode, sample, emit, finish. Returns false if there was nothing to do.
  bool step();
  // step() until nothing is queued or running.
  void run_until_idle();
  bool idle() const;

  EngineStats stats() const;
  int64_t num_slots() const { return max_slots_; }  // usable slots
  int32_t scratch_slot() const { return static_cast<int32_t>(max_slots_); }
  // The state cache (any thread): its device tier is pool slots [max_slots + 1, ...).
  int64_t cache_slots() const { return opt_.cache_slots; }
  bool cache_enabled() const { return cache_on_; }
  StateCacheStats cache_stats() const { return cache_->stats(); }
  int64_t slot_bytes() const { return pool_.slot_bytes(); }
  int64_t pool_bytes() const { return static_cast<int64_t>(pool_.slots()) * pool_.slot_bytes(); }
  const EngineOptions& options() const { return opt_; }  // as resolved by create()
  // "engine: 8 slots (+1 scratch) × 139264 B/slot = ... ; prefill_chunk ...; decode widths ..."
  std::string summary() const;
  // Seconds on the engine's steady clock (the times in FinishInfo).
  double now() const;

  Model& model() { return model_; }
  StatePool& pool() { return pool_; }
  // Replaces the executor (before the first step), e.g. by a CUDA-graph one.
  void set_executor(std::unique_ptr<StepExecutor> ex) { exec_ = std::move(ex); }

  // The padded decode widths (empty: exact), for executors that capture them at start-up.
  const std::vector<int64_t>& decode_widths() const { return opt_.decode_widths; }

 private:
  struct Seq;
  struct StepPlan {
    std::vector<Seq*> prefill;        // admission order
    std::vector<PrefillPiece> pieces;
    std::vector<Seq*> decode;         // slot order; row b = decode[b]
    DecodeBatch batch;
    bool in_flight = false;           // the decode was queued by the step before (collect it)
  };

  Engine(Model& m, const EngineOptions& opt);
  // Gives queued requests free slots; returns them (their slots are not written yet).
  std::vector<Seq*> admit_locked() REQUIRES(mu_);
  // Engine thread, outside the lock: the admitted request's slot gets its start state
  // (a cache hit, its initial snapshot, or zeros).
  void start_context(Seq* s);
  // The context a snapshot / cache entry of s covers now (see FinishInfo::final_state).
  std::vector<int32_t> covered_tokens(const Seq* s, bool with_generated) const;
  StepPlan plan_step();
  // The plan's prefill pieces as the forwards that run them, in order: a sequence's k-th piece
  // of the step is in round k and rounds run in turn, so its pieces run one after another;
  // within a round, pieces of one length (ragged: of any length, adjacent by length; none
  // keeping every position's logits) share a forward, up to the plan's batch, logit and
  // token rows. Cancelled pieces are left out.
  std::vector<std::vector<size_t>> prefill_groups(const StepPlan& plan) const;
  int64_t width_for(int64_t n) const;
  // Emits a token for seq (sampled from logits row) and finishes it when a stop rule hits.
  void emit(Seq* s, const float* logits);
  // emit_token's first part: records and delivers the token (logprobs, on_token), then decides
  // whether it ends s (stop rules, Request::stop_after): true with the reason, else s->next = tok.
  bool deliver(Seq* s, int32_t tok, const float* logits, double t, FinishReason* r);
  // Speculative decoding's decode step (EngineOptions::speculative_k): drafts for the plan's
  // rows, one verification forward, the accepted tokens emitted and committed. False (nothing
  // run) when no row has a draft: a plain decode step serves then.
  bool speculative_step(const StepPlan& plan, EngineStats* d);
  // step()'s two phases, counting into d: the decode batch, then the prefill pieces.
  void decode_phase(const StepPlan& plan, EngineStats* d);
  void prefill_phase(const StepPlan& plan, EngineStats* d);
  // The same for a token chosen already (device greedy): `logits` may be null, then row
  // `row` of the executor's last forward is fetched if a final state needs it. t: the
  // token's time (now() when negative).
  void emit_token(Seq* s, int32_t tok, const float* logits, int64_t row, double t = -1);
  // Whether tok ends s, `generated` tokens counting it (eos, then a stop id, then
  // max_tokens), and why: emit_token's rules, which can_chain() applies ahead.
  bool stop_rule(const Seq* s, int32_t tok, int64_t generated, FinishReason* r) const;
  // Whether the decode after `plan`'s (whose rows chose `ids`) may be queued before they
  // are emitted: see EngineOptions::pipeline.
  bool can_chain(const StepPlan& plan, const std::vector<int32_t>& ids);
  bool device_greedy_row(const Seq* s) const;
  void start_decoding(Seq* s, const float* logits);
  // The same for a greedy row whose token the device chose: `tok`, row `row` of the last
  // forward's logits (fetched only if the sequence finishes and its final state needs them).
  // Only for sequences that need no prompt logits on the host (prompt_needs_logits false).
  void start_decoding_greedy(Seq* s, int32_t tok, int64_t row);
  void prompt_done(Seq* s, const float* logits);  // start_decoding up to the first token
  bool prompt_needs_logits(const Seq* s) const;
  // logits: the row that gave the last token (final snapshot); null when cancelled.
  void finish(Seq* s, FinishReason r, const float* logits);
  SnapshotPtr snapshot(Seq* s, const float* logits, bool with_generated);
  void release_slot_locked(Seq* s) REQUIRES(mu_);
  // A running request cancelled outside a step's work: its slot freed, its finish queued.
  void finish_cancelled_locked(Seq* s) REQUIRES(mu_);

  Model& model_;
  EngineOptions opt_;
  int64_t max_slots_ = 0;
  int64_t vocab_ = 0;
  int32_t default_eos_ = -1;
  StatePool pool_;
  std::unique_ptr<StateCache> cache_;  // owns the slots after the scratch slot
  bool cache_on_ = false;
  int batch_prefill_ = 0;  // EngineOptions::batch_prefill, resolved for the backend (0, equal or ragged)
  std::unique_ptr<StepExecutor> exec_;
  std::chrono::steady_clock::time_point t0_;

  mutable std::mutex mu_;  // guards everything below up to the engine-thread section
  RequestId next_id_ GUARDED_BY(mu_) = 1;
  std::deque<std::unique_ptr<Seq>> queue_ GUARDED_BY(mu_);
  std::unordered_map<RequestId, Seq*> live_ GUARDED_BY(mu_);        // queued or running
  std::vector<std::unique_ptr<Seq>> pending_finish_ GUARDED_BY(mu_);  // cancelled outside a step
  std::vector<Seq*> cancel_in_step_ GUARDED_BY(mu_);                // cancelled during a step
  bool in_step_ GUARDED_BY(mu_) = false;
  int64_t cancels_ GUARDED_BY(mu_) = 0;  // cancel() calls that marked a request (queued or running)
  EngineStats stats_ GUARDED_BY(mu_);

  // Engine-thread state; cancel() touches it only under mu_ while !in_step_.
  std::vector<std::unique_ptr<Seq>> by_slot_;  // [max_slots]
  std::set<int32_t> free_slots_;
  std::vector<Seq*> prefilling_;               // admission order
  int64_t running_ = 0;
  std::vector<std::unique_ptr<Seq>> done_;     // finished this step, destroyed at its end
  std::vector<float> logits_;
  std::vector<float> row_logits_;   // one row fetched for a final state (device greedy)
  std::vector<int32_t> greedy_ids_;
  std::shared_ptr<Drafter> drafter_;           // EngineOptions::drafter, or the n-gram one
  std::vector<std::vector<int32_t>> drafts_;   // speculative_step's, per row
  std::vector<int32_t> accepted_;
  // The decode queued ahead by a step (EngineOptions::pipeline), collected by the next.
  bool in_flight_ = false;
  std::vector<Seq*> in_flight_rows_;  // row b's sequence
  DecodeBatch in_flight_batch_;
  // can_chain()'s view of a batch's stop rules, one packed row per sequence, so that the
  // check between collecting a step and queueing the next reads one small row per sequence
  // instead of walking the sequences themselves, whose cache misses showed in the step time at
  // 1,280 sequences. Valid while the batch stays the same and no cancel() came (chain_cancels_).
  struct ChainRow {
    int32_t eos;
    int64_t left;          // tokens its max_tokens still allows before this step's
    const Seq* stop_ids;   // the sequence when it has stop ids, else null
  };
  std::vector<ChainRow> chain_rows_;
  int64_t chain_cancels_ = -1;
};

}  // namespace laplace
