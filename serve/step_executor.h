// The forwards one engine step runs (serve/engine.h): a StepPlan's prefill pieces and decode
// batch go to a StepExecutor, which runs them on the model. EagerExecutor calls
// Model::forward; GraphExecutor replays CUDA graphs of the same forwards. The scheduler never
// sees which one runs.
#pragma once

#include <cstdint>
#include <list>
#include <memory>
#include <utility>
#include <vector>

#include "core/status.h"
#include "model/model.h"
#include "model/state.h"

namespace laplace {

// Decode widths for graphs: 1, 2, 4, 8, 16, then steps of about 1.5× (24, 32, 48, 64, 96,
// ...) below max_slots, and max_slots itself, so a batch is padded by less than half.
std::vector<int64_t> default_decode_widths(int64_t max_slots);

// One decode forward: row b feeds tokens[b] into slots[b]. Rows [0, live) are sequences,
// rows [live, width) padding (their slot is the scratch slot).
struct DecodeBatch {
  std::vector<int32_t> tokens;
  std::vector<int32_t> slots;
  int64_t live = 0;
  int64_t width() const { return static_cast<int64_t>(tokens.size()); }
};

// One speculative verification forward: row b feeds tokens[b·T, (b + 1)·T) (its last token,
// its draft, then padding) after the context of slots[b].
struct VerifyBatch {
  std::vector<int32_t> tokens;
  std::vector<int32_t> slots;
  int64_t T = 1;
  int64_t rows() const { return static_cast<int64_t>(slots.size()); }
};

// One prefill forward: tokens[0, n) of a prompt into `slot`.
struct PrefillPiece {
  const int32_t* tokens = nullptr;
  int64_t n = 0;
  int32_t slot = -1;
  bool last = false;  // the prompt's last piece: its last-token logits are needed
  bool all_logits = false;  // every position's logits are needed (Request::prompt_logprobs)
};

// Runs the forwards a step needs. The eager executor calls Model::forward.
class StepExecutor {
 public:
  virtual ~StepExecutor() = default;
  // Chunked-form forward of one piece into its slot (state read and updated in place).
  // With logits non-null, leaves the last token's logits there as F32 [V].
  virtual void prefill(const PrefillPiece& piece, std::vector<float>* logits) = 0;
  // The same forward leaving every position's logits, [n × V] row-major (n ≤ the model's
  // logit rows).
  virtual void prefill_all(const PrefillPiece& piece, std::vector<float>* logits) = 0;
  // Pieces in distinct slots, none needing all logits, as one forward: [G, n] when all
  // have one length n, else ragged (adjacent pieces of one length batched in the mixer);
  // with logits non-null, leaves each piece's last-token logits there, [G × V]
  // row-major (G ≤ the model's batch and logit rows, G·n ≤ its token rows).
  virtual void prefill_group(const std::vector<PrefillPiece>& pieces, std::vector<float>* logits) = 0;
  // The same forward, then each piece's argmax (ties: the lowest id) where the logits are; ids
  // gets one per piece. The logits stay there for last_row_logits() (row g: piece g), so a
  // burst of greedy requests copies G ids to the host instead of G × V logits.
  virtual void prefill_group_greedy(const std::vector<PrefillPiece>& pieces, std::vector<int32_t>* ids) = 0;
  // Recurrent-form forward of one decode batch (states updated in place in their slots);
  // leaves the F32 logits of rows [0, live) in logits, [live × V] row-major.
  virtual void decode(const DecodeBatch& batch, std::vector<float>* logits) = 0;
  // The same forward, then each live row's argmax (ties: the lowest id) where the logits
  // are; ids gets rows [0, live). The logits stay there for last_row_logits().
  virtual void decode_greedy(const DecodeBatch& batch, std::vector<int32_t>* ids) = 0;
  // Row b of the last forward's logits, as host F32 [V].
  virtual void last_row_logits(int64_t b, std::vector<float>* row) = 0;
  // Speculative decoding (Model::verify / commit): the verification forward, leaving every
  // position's F32 logits in logits [rows·T × V] row-major (row b·T + t), the pool unwritten;
  // then commit() makes each row's first accepted[b] tokens part of its slot's context.
  virtual void verify(const VerifyBatch& batch, std::vector<float>* logits) = 0;
  virtual void commit(const std::vector<int32_t>& accepted) = 0;

  // Pipelined greedy decode (optional; the engine calls these only when can_chain()).
  // chain_greedy() queues the decode of `batch`, the batch of the last greedy decode or
  // chain unchanged, with row b fed that decode's id of row b where it lies (no host round
  // trip), then its argmax, and returns without waiting; collect_greedy() waits for it and
  // gives the ids of rows [0, live). The engine queues step n + 1 this way before it emits
  // step n's tokens, so the device does not wait for the host between steps.
  virtual bool can_chain() const { return false; }
  virtual void chain_greedy(const DecodeBatch& batch) { (void)batch; }
  virtual void collect_greedy(int64_t live, std::vector<int32_t>* ids) {
    (void)live;
    (void)ids;
  }
  // Ragged prefill forwards captured as graphs and replayed from them (GraphExecutor).
  virtual void prefill_graph_stats(int64_t* captures, int64_t* replays) const {
    *captures = 0;
    *replays = 0;
  }
};

// Model::forward for every piece and batch (works on any backend).
class EagerExecutor : public StepExecutor {
 public:
  EagerExecutor(Model& m, StatePool& pool) : m_(m), pool_(pool) {}
  void prefill(const PrefillPiece& piece, std::vector<float>* logits) override;
  void prefill_all(const PrefillPiece& piece, std::vector<float>* logits) override;
  void prefill_group(const std::vector<PrefillPiece>& pieces, std::vector<float>* logits) override;
  void prefill_group_greedy(const std::vector<PrefillPiece>& pieces, std::vector<int32_t>* ids) override;
  void decode(const DecodeBatch& batch, std::vector<float>* logits) override;
  void decode_greedy(const DecodeBatch& batch, std::vector<int32_t>* ids) override;
  void last_row_logits(int64_t b, std::vector<float>* row) override;
  void verify(const VerifyBatch& batch, std::vector<float>* logits) override;
  void commit(const std::vector<int32_t>& accepted) override;
  bool can_chain() const override { return true; }
  void chain_greedy(const DecodeBatch& batch) override;
  void collect_greedy(int64_t live, std::vector<int32_t>* ids) override;
  ~EagerExecutor() override;

 protected:
  virtual void forward_decode(const DecodeBatch& batch);  // the recurrent forward, logits left on the device
  // The same forward of `width` rows whose tokens and slots are in the model's input buffers.
  virtual void forward_decode_queued(int64_t width);
  void queue_argmax(int64_t live);  // ids_dev_[0, live) = argmax of the logits' rows
  void forward_group(const std::vector<PrefillPiece>& pieces);  // prefill_group's forward
  // Its ragged forward (Model::forward_ragged) of the pieces' tokens, lengths and slots.
  virtual void forward_ragged(const std::vector<int32_t>& tokens, const std::vector<int64_t>& lengths,
                              const std::vector<int32_t>& slots);
  Model& m_;
  StatePool& pool_;
  void* ids_dev_ = nullptr;  // [ids_cap] I32 on the backend's device: the argmax of each row
  int64_t ids_cap_ = 0;
};

// Decode forwards replayed from graphs captured at creation, one per width, and ragged
// prefill forwards replayed from graphs captured when their layout recurs. The graphs hold
// the same kernels, shapes and cuBLAS algorithms as EagerExecutor's forwards, so tokens and
// states are bitwise those of eager decoding with the same widths and of eager prefill
// (tests/test_cuda_model.cpp checks both).
//
// Prefill: a ragged forward's kernels depend on its layout, the sequence of its pieces'
// lengths (the mixer runs once per run of one length), so a graph serves one layout. Layouts
// recur where prompts are cut into equal chunks (every full prefill_chunk piece of a long
// prompt) or arrive in bursts of one length; a layout is captured the second time it is met
// (the first runs eagerly, which also settles lazily made buffers), and the last
// `prefill_graphs` layouts used are kept. Pools whose chunked forward stages states by host
// slot ids (BF16 states) prefill eagerly.
class GraphExecutor : public EagerExecutor {
 public:
  // Captures a decode forward for each width (after one eager warm-up run of it that
  // writes only `scratch_slot`). The model must be planned for the largest width, and
  // neither re-planned nor given a new pool while the executor lives: the graphs hold the
  // device addresses of its activations, inputs, weights and states.
  static Status create(Model& m, StatePool& pool, const std::vector<int64_t>& widths, int32_t scratch_slot,
                       std::unique_ptr<GraphExecutor>* out, int64_t prefill_graphs = 0);
  int64_t graphs() const { return static_cast<int64_t>(graphs_.size()); }
  int64_t prefill_graphs() const { return static_cast<int64_t>(ragged_.size()); }
  void prefill_graph_stats(int64_t* captures, int64_t* replays) const override {
    *captures = ragged_captures_;
    *replays = ragged_replays_;
  }

 private:
  GraphExecutor(Model& m, StatePool& pool) : EagerExecutor(m, pool) {}
  // One piece is a ragged forward of one sequence (the same kernels as Model::forward [1, n]).
  void prefill(const PrefillPiece& piece, std::vector<float>* logits) override;
  void forward_decode(const DecodeBatch& batch) override;
  void forward_decode_queued(int64_t width) override;
  void forward_ragged(const std::vector<int32_t>& tokens, const std::vector<int64_t>& lengths,
                      const std::vector<int32_t>& slots) override;
  // A replay's inputs: slots range-checked, tokens and slots queued into the model's input
  // buffers (the ones every captured forward reads).
  void stage_inputs(const std::vector<int32_t>& tokens, const std::vector<int32_t>& slots);
  // The graph of a layout: from the cache, else captured if the layout was met before (and
  // the capture works), else null (run it eagerly).
  Graph* ragged_graph(const std::vector<int64_t>& lengths);
  std::vector<std::pair<int64_t, std::unique_ptr<Graph>>> graphs_;  // by width, ascending
  struct RaggedGraph {
    std::vector<int64_t> lengths;
    std::unique_ptr<Graph> graph;
  };
  int64_t ragged_cap_ = 0;
  std::list<RaggedGraph> ragged_;               // most recently used first
  std::list<std::vector<int64_t>> seen_;        // layouts met once, most recent first
  int64_t ragged_captures_ = 0, ragged_replays_ = 0;
};

}  // namespace laplace
