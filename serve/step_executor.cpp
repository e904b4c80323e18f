// The step executors (serve/step_executor.h): eager forwards, and graphs of them.
#include "serve/step_executor.h"

#include <algorithm>

#include "serve/generate.h"

namespace laplace {

// ---- executor ------------------------------------------------------------------------

void EagerExecutor::prefill(const PrefillPiece& piece, std::vector<float>* logits) {
  ForwardOptions fo;
  fo.form = GlaForm::kChunked;
  fo.last_logits_only = true;
  m_.forward(piece.tokens, 1, piece.n, fo, &pool_, &piece.slot);
  if (logits) logits_rows_to_host(m_, 0, 1, logits);
}

void EagerExecutor::prefill_all(const PrefillPiece& piece, std::vector<float>* logits) {
  ForwardOptions fo;
  fo.form = GlaForm::kChunked;
  m_.forward(piece.tokens, 1, piece.n, fo, &pool_, &piece.slot);
  logits_rows_to_host(m_, 0, piece.n, logits);
}

void EagerExecutor::prefill_group(const std::vector<PrefillPiece>& pieces, std::vector<float>* logits) {
  forward_group(pieces);
  if (logits) logits_rows_to_host(m_, 0, static_cast<int64_t>(pieces.size()), logits);
}

void EagerExecutor::prefill_group_greedy(const std::vector<PrefillPiece>& pieces, std::vector<int32_t>* ids) {
  forward_group(pieces);
  queue_argmax(static_cast<int64_t>(pieces.size()));
  collect_greedy(static_cast<int64_t>(pieces.size()), ids);
}

void EagerExecutor::forward_group(const std::vector<PrefillPiece>& pieces) {
  // One length makes one segment: the same forward as Model::forward [G, n].
  const size_t G = pieces.size();
  std::vector<int32_t> tokens, slots(G);
  std::vector<int64_t> lengths(G);
  for (size_t g = 0; g < G; ++g) {
    tokens.insert(tokens.end(), pieces[g].tokens, pieces[g].tokens + pieces[g].n);
    slots[g] = pieces[g].slot;
    lengths[g] = pieces[g].n;
  }
  forward_ragged(tokens, lengths, slots);
}

void EagerExecutor::forward_ragged(const std::vector<int32_t>& tokens, const std::vector<int64_t>& lengths,
                                   const std::vector<int32_t>& slots) {
  m_.forward_ragged(tokens.data(), lengths, pool_, slots.data());
}

EagerExecutor::~EagerExecutor() {
  if (ids_dev_) m_.backend().allocator().deallocate(ids_dev_);
}

namespace {
// A decode step's forward: recurrent form, last (only) token's logits.
ForwardOptions decode_options() {
  ForwardOptions fo;
  fo.form = GlaForm::kRecurrent;
  fo.last_logits_only = true;
  return fo;
}
}  // namespace

void EagerExecutor::forward_decode(const DecodeBatch& batch) {
  m_.forward(batch.tokens.data(), batch.width(), 1, decode_options(), &pool_, batch.slots.data());
}

void EagerExecutor::forward_decode_queued(int64_t width) { m_.forward_queued(width, 1, decode_options(), &pool_); }

// ---- graph executor ------------------------------------------------------------------

std::vector<int64_t> default_decode_widths(int64_t max_slots) {
  std::vector<int64_t> w;
  for (int64_t x = 1; x < max_slots && x <= 16; x *= 2) w.push_back(x);
  // From 16 on, alternate ×1.5 and ×4/3 (16, 24, 32, 48, 64, 96, ...).
  for (int64_t x = 24; x < max_slots; x = (x % 3 == 0) ? x / 3 * 4 : x / 2 * 3)
    if (x > 16) w.push_back(x);
  if (max_slots >= 1) w.push_back(max_slots);
  return w;
}

Status GraphExecutor::create(Model& m, StatePool& pool, const std::vector<int64_t>& widths, int32_t scratch_slot,
                             std::unique_ptr<GraphExecutor>* out, int64_t prefill_graphs) {
  if (prefill_graphs < 0) return Status::invalid_argument("graph executor: prefill_graphs must be ≥ 0");
  std::unique_ptr<GraphExecutor> g(new GraphExecutor(m, pool));
  g->ragged_cap_ = prefill_graphs;
  Backend& be = m.backend();
  const ForwardOptions fo = decode_options();
  std::vector<int64_t> ws = widths;
  std::sort(ws.begin(), ws.end());
  ws.erase(std::unique(ws.begin(), ws.end()), ws.end());
  if (ws.empty()) return Status::invalid_argument("graph executor: no decode widths to capture");
  for (int64_t w : ws) {
    if (w < 1 || w > m.plan_options().max_batch)
      return Status::invalid_argument("graph executor: decode width " + std::to_string(w) + " outside the plan");
    // Warm-up: every row feeds token 0 into the scratch slot; it settles lazily made
    // device buffers and cached gemm algorithms before the capture.
    g->stage_inputs(std::vector<int32_t>(static_cast<size_t>(w), 0),
                    std::vector<int32_t>(static_cast<size_t>(w), scratch_slot));
    m.forward_queued(w, 1, fo, &pool);
    be.synchronize();
    std::unique_ptr<Graph> graph;
    LAPLACE_RETURN_IF_ERROR(be.capture([&] { m.forward_queued(w, 1, fo, &pool); }, &graph)
                                .with_context("decode width " + std::to_string(w)));
    g->graphs_.emplace_back(w, std::move(graph));
  }
  *out = std::move(g);
  return Status::ok();
}

void GraphExecutor::stage_inputs(const std::vector<int32_t>& tokens, const std::vector<int32_t>& slots) {
  for (int32_t s : slots) LAPLACE_CHECK(s >= 0 && s < pool_.slots(), "graph replay: bad slot");
  const int64_t N = static_cast<int64_t>(tokens.size()), G = static_cast<int64_t>(slots.size());
  Backend& be = m_.backend();
  // Queued H2D copies into the buffers the graph reads, then the replay, in stream order.
  be.copy(m_.input_ids().slice(0, 0, N), Tensor(const_cast<int32_t*>(tokens.data()), DType::kI32, {N}));
  be.copy(m_.input_slots().slice(0, 0, G), Tensor(const_cast<int32_t*>(slots.data()), DType::kI32, {G}));
}

void GraphExecutor::forward_decode(const DecodeBatch& batch) {
  stage_inputs(batch.tokens, batch.slots);
  forward_decode_queued(batch.width());
}

void GraphExecutor::forward_decode_queued(int64_t w) {
  auto it = std::find_if(graphs_.begin(), graphs_.end(), [&](const auto& p) { return p.first == w; });
  LAPLACE_CHECK(it != graphs_.end(), "graph decode: the batch width was not captured (engine widths and graphs differ)");
  it->second->launch();
  m_.set_replayed(w, 1, decode_options());
}

Graph* GraphExecutor::ragged_graph(const std::vector<int64_t>& lengths) {
  if (ragged_cap_ == 0 || !m_.ragged_queueable(pool_)) return nullptr;
  for (auto it = ragged_.begin(); it != ragged_.end(); ++it) {
    if (it->lengths != lengths) continue;
    ragged_.splice(ragged_.begin(), ragged_, it);
    return ragged_.front().graph.get();
  }
  auto met = std::find(seen_.begin(), seen_.end(), lengths);
  if (met == seen_.end()) {
    // First sighting: remember it (a bounded list) and run it eagerly.
    seen_.push_front(lengths);
    if (static_cast<int64_t>(seen_.size()) > 4 * ragged_cap_) seen_.pop_back();
    return nullptr;
  }
  seen_.erase(met);
  std::unique_ptr<Graph> graph;
  const Status st = m_.backend().capture([&] { m_.forward_ragged_queued(lengths, pool_); }, &graph);
  if (!st.ok()) {
    // Not expected where decode graphs were captured; prefill then stays eager for good.
    std::fprintf(stderr, "engine: ragged prefill runs eagerly (%s)\n", st.message().c_str());
    ragged_cap_ = 0;
    return nullptr;
  }
  if (static_cast<int64_t>(ragged_.size()) >= ragged_cap_) {
    // The evicted graph may still be running a replay: wait for it before destroying it.
    m_.backend().synchronize();
    ragged_.pop_back();
  }
  ragged_.push_front(RaggedGraph{lengths, std::move(graph)});
  ++ragged_captures_;
  return ragged_.front().graph.get();
}

void GraphExecutor::prefill(const PrefillPiece& piece, std::vector<float>* logits) {
  forward_ragged(std::vector<int32_t>(piece.tokens, piece.tokens + piece.n), {piece.n}, {piece.slot});
  if (logits) logits_rows_to_host(m_, 0, 1, logits);
}

void GraphExecutor::forward_ragged(const std::vector<int32_t>& tokens, const std::vector<int64_t>& lengths,
                                   const std::vector<int32_t>& slots) {
  Graph* graph = ragged_graph(lengths);
  if (!graph) {
    EagerExecutor::forward_ragged(tokens, lengths, slots);
    return;
  }
  stage_inputs(tokens, slots);
  graph->launch();
  m_.set_replayed_ragged(static_cast<int64_t>(lengths.size()));
  ++ragged_replays_;
}

void EagerExecutor::queue_argmax(int64_t n) {
  if (n == 0) return;
  Backend& be = m_.backend();
  if (n > ids_cap_) {
    if (ids_dev_) be.allocator().deallocate(ids_dev_);
    ids_dev_ = be.allocator().allocate(static_cast<size_t>(n) * sizeof(int32_t));
    LAPLACE_CHECK(ids_dev_ != nullptr, "decode_greedy: out of device memory for the token ids");
    ids_cap_ = n;
  }
  be.argmax_rows(m_.logits().slice(0, 0, n), Tensor(ids_dev_, DType::kI32, {n}, be.device()));
}

void EagerExecutor::collect_greedy(int64_t n, std::vector<int32_t>* ids) {
  ids->resize(static_cast<size_t>(n));
  if (n == 0) return;
  LAPLACE_CHECK(n <= ids_cap_, "collect_greedy: more rows than the last argmax had");
  Backend& be = m_.backend();
  be.copy(Tensor(ids->data(), DType::kI32, {n}), Tensor(ids_dev_, DType::kI32, {n}, be.device()));
  be.synchronize();
}

void EagerExecutor::decode_greedy(const DecodeBatch& batch, std::vector<int32_t>* ids) {
  forward_decode(batch);
  queue_argmax(batch.live);
  collect_greedy(batch.live, ids);
}

void EagerExecutor::chain_greedy(const DecodeBatch& batch) {
  // The model's input buffers still hold the last decode's tokens and slots (the engine
  // chains only when nothing else ran in between): its ids replace the live rows' tokens;
  // padded rows keep token 0 and the scratch slot.
  const int64_t n = batch.live;
  LAPLACE_CHECK(n >= 1 && n <= ids_cap_, "chain_greedy: the batch is not the last greedy decode's");
  Backend& be = m_.backend();
  be.copy(m_.input_ids().slice(0, 0, n), Tensor(ids_dev_, DType::kI32, {n}, be.device()));
  forward_decode_queued(batch.width());
  queue_argmax(n);
}

void EagerExecutor::last_row_logits(int64_t b, std::vector<float>* row) { logits_rows_to_host(m_, b, 1, row); }

void EagerExecutor::verify(const VerifyBatch& batch, std::vector<float>* logits) {
  m_.verify(batch.tokens.data(), batch.rows(), batch.T, pool_, batch.slots.data());
  logits_rows_to_host(m_, 0, batch.rows() * batch.T, logits);
}

void EagerExecutor::commit(const std::vector<int32_t>& accepted) { m_.commit(accepted.data()); }

void EagerExecutor::decode(const DecodeBatch& batch, std::vector<float>* logits) {
  forward_decode(batch);
  logits_rows_to_host(m_, 0, batch.live, logits);
}

}  // namespace laplace
