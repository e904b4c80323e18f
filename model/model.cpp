#include "model/model.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "core/doc_starts.h"
#include "core/fixed_sum.h"
#include "model/quantize.h"

namespace laplace {

namespace {

// The first n rows of a [rows, cols] buffer.
Tensor rows(const Tensor& t, int64_t n) { return t.slice(0, 0, n); }

// A 2-D buffer [N, C] seen as [B, T, C].
Tensor btc(const Tensor& t, int64_t B, int64_t T) {
  Tensor r = t;
  r.ndim = 3;
  r.shape = {B, T, t.shape[1], 0};
  r.stride = {T * t.stride[0], t.stride[0], 1, 0};
  return r;
}

// A 2-D buffer [N, H·d] seen as [B, T, H, d].
Tensor bthd(const Tensor& t, int64_t B, int64_t T, int64_t H, int64_t d) {
  Tensor r = t;
  r.ndim = 4;
  r.shape = {B, T, H, d};
  r.stride = {T * t.stride[0], t.stride[0], d, 1};
  return r;
}

}  // namespace

Status Model::create(const Config& c, Backend& be, DType dtype) {
  LAPLACE_RETURN_IF_ERROR(c.validate());
  cfg_ = c;
  be_ = &be;
  dtype_ = dtype;
  LAPLACE_RETURN_IF_ERROR(weights_.create(weight_specs(c, dtype), be.allocator(), "weights"));
  w_ = weights_bind(c, weights_);
  return Status::ok();
}

Status Model::plan(const PlanOptions& opt) {
  if (opt.max_batch < 1 || opt.max_seq < 1) return Status::invalid_argument("plan: batch and sequence must be ≥ 1");
  if (opt.max_tokens < 0 || opt.max_logit_rows < 0) return Status::invalid_argument("plan: negative row count");
  if (opt.training && (opt.max_tokens || opt.max_logit_rows))
    return Status::invalid_argument("plan: training plans keep every token row");
  if ((opt.recompute_mixer || opt.recompute_layers) && !opt.training)
    return Status::invalid_argument("plan: recompute is for training plans");
  if (opt.recompute_mixer && opt.recompute_layers)
    return Status::invalid_argument("plan: recompute_layers already recomputes the mixer (not both)");
  plan_ = opt;
  const int64_t B = opt.max_batch;
  const int64_t N = opt.max_tokens > 0 ? opt.max_tokens : opt.max_batch * opt.max_seq;
  const int64_t NL = opt.max_logit_rows > 0 ? std::min(opt.max_logit_rows, N) : N;
  plan_rows_ = N;
  logit_rows_ = NL;
  const int64_t D = cfg_.hidden_size, R = cfg_.qkvg_rows(), HV = cfg_.v_dim(), H = cfg_.num_heads;
  const int64_t F = cfg_.ffn_size, V = cfg_.vocab_size;
  const DType st = dtype_ == DType::kBF16 ? DType::kF32 : dtype_;  // statistics dtype
  // Training: a set of buffers per layer, or (recompute_layers) each layer's x_in and one set
  // of everything else. Inference: one set.
  const int64_t sets = opt.training ? cfg_.num_layers : 1;

  std::vector<TensorSpec> s;
  s.push_back({"ids", DType::kI32, {N}});
  s.push_back({"targets", DType::kI32, {N}});
  s.push_back({"slots", DType::kI32, {B}});
  s.push_back({"doc", DType::kI32, {N}});
  for (int64_t l = 0; l < sets; ++l) {
    // append, not "l" + to_string(l): GCC 12 reports a false -Wrestrict on the latter
    const std::string p = std::string("l").append(std::to_string(l)).append(".");
    s.push_back({p + "x_in", dtype_, {N, D}});
    if (l > 0 && opt.recompute_layers) continue;
    s.push_back({p + "ln1_mean", st, {N}});
    s.push_back({p + "ln1_rstd", st, {N}});
    s.push_back({p + "u", dtype_, {N, D}});
    s.push_back({p + "conv_pre", dtype_, {N, D}});
    s.push_back({p + "c", dtype_, {N, D}});
    s.push_back({p + "qkvg", dtype_, {N, R}});
    if (l == 0 || !opt.recompute_mixer) s.push_back({p + "o", dtype_, {N, HV}});
    s.push_back({p + "onorm_rstd", st, {N, H}});
    s.push_back({p + "y", dtype_, {N, HV}});
    if (opt.training) s.push_back({p + "x_mid", dtype_, {N, D}});
    s.push_back({p + "ln2_mean", st, {N}});
    s.push_back({p + "ln2_rstd", st, {N}});
    s.push_back({p + "z", dtype_, {N, D}});
    s.push_back({p + "ab", dtype_, {N, 2 * F}});
    s.push_back({p + "h", dtype_, {N, F}});
  }
  if (opt.verify_rows < 0 || (opt.verify_rows > 0 && (opt.training || opt.verify_rows > N)))
    return Status::invalid_argument("plan: verify_rows is for inference plans, at most the token rows");
  for (int64_t l = 0; opt.verify_rows > 0 && l < cfg_.num_layers; ++l) {
    const std::string p = std::string("verify").append(std::to_string(l)).append(".");
    s.push_back({p + "u", dtype_, {opt.verify_rows, D}});
    s.push_back({p + "qkvg", dtype_, {opt.verify_rows, R}});
  }
  if (opt.verify_rows > 0) s.push_back({"accepted", DType::kI32, {B}});
  if (opt.training) s.push_back({"x_final", dtype_, {N, D}});
  s.push_back({"lnf_mean", st, {NL}});
  s.push_back({"lnf_rstd", st, {NL}});
  s.push_back({"zf", dtype_, {NL, D}});
  // BF16 models: inference plans keep F32 logits (gemm BF16·BF16 → F32) so sampling and
  // greedy decoding see unrounded scores; training plans keep BF16 logits, which the
  // backward turns into dlogits in place (no F32 [N, V] buffer for the whole batch).
  const DType logits_dt = (dtype_ == DType::kBF16 && !opt.training) ? DType::kF32 : dtype_;
  s.push_back({"logits", logits_dt, {NL, V}});
  s.push_back({"losses", st, {NL}});
  LAPLACE_RETURN_IF_ERROR(acts_.create(std::move(s), be_->allocator(), "activations"));

  auto get = [&](const std::string& name) {
    int64_t i = acts_.find(name);
    LAPLACE_CHECK(i >= 0, "plan: missing activation buffer");
    return acts_.tensor(static_cast<size_t>(i));
  };
  ids_ = get("ids");
  targets_ = get("targets");
  slots_ = get("slots");
  doc_ = get("doc");
  doc_on_ = false;
  layer_.assign(cfg_.num_layers, LayerActs{});
  for (int64_t l = 0; l < cfg_.num_layers; ++l) {
    const std::string p = std::string("l").append(std::to_string(opt.training ? l : 0)).append(".");
    LayerActs& a = layer_[l];
    a.x_in = get(p + "x_in");
    // The rest: this layer's own set, or the one shared set.
    const std::string q = opt.recompute_layers ? std::string("l0.") : p;
    a.ln1_mean = get(q + "ln1_mean");
    a.ln1_rstd = get(q + "ln1_rstd");
    a.u = get(q + "u");
    a.conv_pre = get(q + "conv_pre");
    a.c = get(q + "c");
    a.qkvg = get(q + "qkvg");
    a.o = get(opt.recompute_mixer ? "l0.o" : q + "o");
    a.onorm_rstd = get(q + "onorm_rstd");
    a.y = get(q + "y");
    // Inference updates the residual stream in place; training keeps each stage.
    a.x_mid = opt.training ? get(q + "x_mid") : a.x_in;
    a.ln2_mean = get(q + "ln2_mean");
    a.ln2_rstd = get(q + "ln2_rstd");
    a.z = get(q + "z");
    a.ab = get(q + "ab");
    a.h = get(q + "h");
  }
  verify_acts_.assign(opt.verify_rows > 0 ? cfg_.num_layers : 0, VerifyActs{});
  for (size_t l = 0; l < verify_acts_.size(); ++l) {
    const std::string p = std::string("verify").append(std::to_string(l)).append(".");
    verify_acts_[l] = {get(p + "u"), get(p + "qkvg")};
  }
  accepted_ = opt.verify_rows > 0 ? get("accepted") : Tensor{};
  verify_B_ = 0;
  x_final_ = opt.training ? get("x_final") : layer_[0].x_in;
  lnf_mean_ = get("lnf_mean");
  lnf_rstd_ = get("lnf_rstd");
  zf_ = get("zf");
  logits_buf_ = get("logits");
  losses_ = get("losses");

  if (opt.training) {
    std::vector<TensorSpec> g = {
        {"dx", dtype_, {N, D}},     {"dtmp", dtype_, {N, D}},  {"du", dtype_, {N, D}},
        {"dc", dtype_, {N, D}},     {"dqkvg", dtype_, {N, R}}, {"do", dtype_, {N, HV}},
        {"dy", dtype_, {N, HV}},    {"dz", dtype_, {N, D}},    {"dab", dtype_, {N, 2 * F}},
        {"dh", dtype_, {N, F}},
    };
    LAPLACE_RETURN_IF_ERROR(scratch_.create(std::move(g), be_->allocator(), "backward scratch"));
    Tensor* dst[] = {&dx_, &dtmp_, &du_, &dc_, &dqkvg_, &do_, &dy_, &dz_, &dab_, &dh_};
    for (size_t i = 0; i < scratch_.size(); ++i) *dst[i] = scratch_.tensor(i);
  }
  return plan_fp8(opt.training);
}

bool Model::documents_by_views() const { return doc_on_ && !be_->keeps_documents_apart(); }

namespace {
// Rows [t0, t1) of batch row b of a [B, T, …] view, as [1, t1 − t0, …]. Its dim-0 stride is that of
// a batch of one (a single row is contiguous where the batch was), so ops that check the
// layout take it as they take a whole batch.
Tensor doc_rows(const Tensor& x, int64_t b, int64_t t0, int64_t t1) {
  if (!x.defined()) return Tensor{};
  Tensor v = x.slice(0, b, b + 1).slice(1, t0, t1);
  v.stride[0] = v.shape[1] * v.stride[1];
  return v;
}
}  // namespace

void Model::conv_forward(const Tensor& u, const Tensor& w, Tensor c, Tensor pre, const Tensor& doc) {
  if (!doc.defined() || !documents_by_views()) {
    be_->conv_silu_forward(u, w, c, pre, Tensor{}, Tensor{}, Tensor{}, doc);
    return;
  }
  for (const auto& [b, t0, t1] : doc_segs_)
    be_->conv_silu_forward(doc_rows(u, b, t0, t1), w, doc_rows(c, b, t0, t1), doc_rows(pre, b, t0, t1), Tensor{},
                           Tensor{}, Tensor{});
}

void Model::conv_backward(const Tensor& dc, const Tensor& u, const Tensor& w, const Tensor& pre, Tensor du, Tensor dw,
                          const Tensor& doc) {
  if (!doc.defined() || !documents_by_views()) {
    be_->conv_silu_backward(dc, u, w, pre, du, dw, doc);
    return;
  }
  for (const auto& [b, t0, t1] : doc_segs_)  // dw accumulates over the documents
    be_->conv_silu_backward(doc_rows(dc, b, t0, t1), doc_rows(u, b, t0, t1), w, doc_rows(pre, b, t0, t1),
                            doc_rows(du, b, t0, t1), dw);
}

void Model::mixer_forward(const GlaParams& gp, const Tensor& q, const Tensor& k, const Tensor& v, Tensor o) {
  if (!gp.doc.defined() || !documents_by_views()) {
    be_->gla_forward(gp, q, k, v, o, Tensor{}, Tensor{}, Tensor{});
    return;
  }
  GlaParams p = gp;
  p.doc = Tensor{};
  for (const auto& [b, t0, t1] : doc_segs_)
    be_->gla_forward(p, doc_rows(q, b, t0, t1), doc_rows(k, b, t0, t1), doc_rows(v, b, t0, t1), doc_rows(o, b, t0, t1),
                     Tensor{}, Tensor{}, Tensor{});
}

void Model::mixer_backward(const GlaParams& gp, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& d_o,
                           Tensor dq, Tensor dk, Tensor dv) {
  if (!gp.doc.defined() || !documents_by_views()) {
    be_->gla_backward(gp, q, k, v, Tensor{}, d_o, Tensor{}, dq, dk, dv, Tensor{});
    return;
  }
  GlaParams p = gp;
  p.doc = Tensor{};
  for (const auto& [b, t0, t1] : doc_segs_)
    be_->gla_backward(p, doc_rows(q, b, t0, t1), doc_rows(k, b, t0, t1), doc_rows(v, b, t0, t1), Tensor{},
                      doc_rows(d_o, b, t0, t1), Tensor{}, doc_rows(dq, b, t0, t1), doc_rows(dk, b, t0, t1),
                      doc_rows(dv, b, t0, t1), Tensor{});
}

// The output norm's statistics of B·T tokens as the [B, T, H] view rmsnorm_gate takes.
Tensor Model::rstd_view(const Tensor& onorm_rstd, int64_t B, int64_t T) const {
  const int64_t H = cfg_.num_heads;
  Tensor r = onorm_rstd.slice(0, 0, B * T);
  r.ndim = 3;
  r.shape = {B, T, H, 0};
  r.stride = {T * H, H, 1, 0};
  return r;
}

Tensor Model::doc_view(int64_t B, int64_t T) const {
  return doc_.slice(0, 0, B * T).reshape({B, T});
}

GlaParams Model::gla_params(GlaForm form) const {
  GlaParams p;
  p.form = form;
  p.chunk = cfg_.chunk_size;
  p.scale = 1.0 / std::sqrt(static_cast<double>(cfg_.head_k_dim));
  p.decay = cfg_.decays();
  return p;
}

Tensor Model::qkvg_part(const Tensor& qkvg, int64_t B, int64_t T, int part) const {
  const int64_t H = cfg_.num_heads, dk = cfg_.head_k_dim, dv = cfg_.head_v_dim;
  const int64_t begin[] = {0, H * dk, 2 * H * dk, 2 * H * dk + H * dv};
  const int64_t width[] = {H * dk, H * dk, H * dv, H * dv};
  const int64_t d[] = {dk, dk, dv, dv};
  Tensor cols = qkvg.slice(1, begin[part], begin[part] + width[part]);
  return bthd(cols, B, T, H, d[part]);
}

void Model::check_forward(int64_t B, int64_t T, const ForwardOptions& opt, const StatePool* pool) const {
  LAPLACE_CHECK(B >= 1 && T >= 1 && B <= plan_.max_batch && T <= plan_.max_seq && B * T <= plan_rows_,
                "forward: batch shape exceeds the plan");
  LAPLACE_CHECK((opt.last_logits_only ? B : B * T) <= logit_rows_, "forward: more logit rows than the plan holds");
  LAPLACE_CHECK(!pool || !plan_.training, "forward: training runs from the zero state");
  if (pool) {
    const DType pd = pool->dtype();
    const bool ok = pd == (dtype_ == DType::kF64 ? DType::kF64 : DType::kF32) ||
                    (pd == DType::kBF16 && dtype_ == DType::kBF16);
    LAPLACE_CHECK(ok, "forward: state pool dtype must be F32 (F64 for F64 models; BF16 allowed for BF16 models)");
    LAPLACE_CHECK(pool->pending_steps() == 0 || pool->pending(0).k.dtype == dtype_,
                  "forward: a deferred-write-back pool keeps its pairs in the model's dtype");
  }
}

Tensor Model::state_stage(int64_t B) {
  if (stage_.size() == 0 || stage_.tensor(0).shape[0] < B) {
    stage_ = Arena();
    Status st = stage_.create({{"state stage", DType::kF32, {B, cfg_.num_heads, cfg_.head_k_dim, cfg_.head_v_dim}}},
                              be_->allocator(), "state stage");
    LAPLACE_CHECK(st.is_ok(), "forward: out of memory for the F32 state stage of a BF16 pool");
  }
  return stage_.tensor(0).slice(0, 0, B);
}

void Model::forward(const int32_t* tokens, int64_t B, int64_t T, const ForwardOptions& opt, StatePool* pool,
                    const int32_t* slots) {
  check_forward(B, T, opt, pool);
  Backend& be = *be_;
  const int64_t N = B * T;
  be.copy(ids_.slice(0, 0, N), Tensor(const_cast<int32_t*>(tokens), DType::kI32, {N}));
  doc_on_ = false;
  if (opt.document_separator >= 0) {
    LAPLACE_CHECK(!(T == 1 && opt.form == GlaForm::kRecurrent && pool),
                  "forward: decode steps do not take documents; a request starts from a fresh slot");
    std::vector<int32_t> doc(static_cast<size_t>(N));
    doc_starts_from_separator(tokens, B, T, opt.document_separator, doc.data());
    // Rows that hold no document start compute as before, on every backend's fast path.
    if (doc_starts_split(doc.data(), B, T)) {
      be.copy(doc_.slice(0, 0, N), Tensor(doc.data(), DType::kI32, {N}));
      doc_on_ = true;
      doc_segs_.clear();
      for (int64_t b = 0; b < B; ++b)
        for (int64_t t = 0, first = 0; t < T; ++t)
          if (t + 1 == T || doc[b * T + t + 1] == t + 1) {
            doc_segs_.push_back({b, first, t + 1});
            first = t + 1;
          }
      LAPLACE_CHECK(!pool || be.keeps_documents_apart(),
                    "forward: this backend keeps documents apart only in forwards without a state pool");
    }
  }
  std::vector<int32_t> identity;
  if (pool) {
    if (!slots) {
      identity.resize(B);
      for (int64_t b = 0; b < B; ++b) identity[b] = static_cast<int32_t>(b);
      slots = identity.data();
    }
    for (int64_t b = 0; b < B; ++b) LAPLACE_CHECK(slots[b] >= 0 && slots[b] < pool->slots(), "forward: bad slot");
    be.copy(slots_.slice(0, 0, B), Tensor(const_cast<int32_t*>(slots), DType::kI32, {B}));
  }
  run_forward(B, T, opt, pool, slots);
}

std::vector<Model::Segment> Model::ragged_segments(const std::vector<int64_t>& lengths, const StatePool& pool) const {
  const int64_t G = static_cast<int64_t>(lengths.size());
  LAPLACE_CHECK(G >= 1 && G <= plan_.max_batch && G <= logit_rows_, "forward_ragged: sequences exceed the plan");
  std::vector<Segment> segs;
  int64_t N = 0;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t n = lengths[g];
    LAPLACE_CHECK(n >= 1 && n <= plan_.max_seq, "forward_ragged: a sequence longer than the plan");
    if (segs.empty() || segs.back().T != n) segs.push_back(Segment{N, g, 0, n});
    ++segs.back().B;
    N += n;
  }
  LAPLACE_CHECK(N <= plan_rows_, "forward_ragged: more tokens than the plan holds");
  for (const Segment& s : segs) check_forward(s.B, s.T, ragged_options(), &pool);
  return segs;
}

ForwardOptions Model::ragged_options() {
  ForwardOptions opt;
  opt.form = GlaForm::kChunked;
  opt.last_logits_only = true;
  return opt;
}

void Model::forward_ragged(const int32_t* tokens, const std::vector<int64_t>& lengths, StatePool& pool,
                           const int32_t* slots) {
  const std::vector<Segment> segs = ragged_segments(lengths, pool);
  const int64_t G = static_cast<int64_t>(lengths.size());
  const int64_t N = segs.back().row + segs.back().B * segs.back().T;
  Backend& be = *be_;
  be.copy(ids_.slice(0, 0, N), Tensor(const_cast<int32_t*>(tokens), DType::kI32, {N}));
  for (int64_t g = 0; g < G; ++g) LAPLACE_CHECK(slots[g] >= 0 && slots[g] < pool.slots(), "forward_ragged: bad slot");
  be.copy(slots_.slice(0, 0, G), Tensor(const_cast<int32_t*>(slots), DType::kI32, {G}));
  doc_on_ = false;
  run_forward(segs, ragged_options(), &pool, slots);
}

bool Model::ragged_queueable(const StatePool& pool) const {
  // A BF16 pool's rows go through F32 staging copies addressed by host slot ids.
  return pool.dtype() != DType::kBF16;
}

void Model::forward_ragged_queued(const std::vector<int64_t>& lengths, StatePool& pool) {
  LAPLACE_CHECK(ragged_queueable(pool), "forward_ragged_queued: BF16 state pools are staged by host slot ids");
  doc_on_ = false;
  run_forward(ragged_segments(lengths, pool), ragged_options(), &pool, nullptr);
}

void Model::set_replayed_ragged(int64_t G) {
  LAPLACE_CHECK(G >= 1 && G <= logit_rows_, "set_replayed_ragged: more sequences than logit rows");
  last_B_ = G;
  last_T_ = 0;
  last_only_ = true;
  logits_ = rows(logits_buf_, G);
}

void Model::verify(const int32_t* tokens, int64_t B, int64_t T, StatePool& pool, const int32_t* slots) {
  ForwardOptions opt;
  opt.form = GlaForm::kRecurrent;
  check_forward(B, T, opt, &pool);
  LAPLACE_CHECK(B * T <= plan_.verify_rows, "verify: more token rows than the plan's verify_rows");
  LAPLACE_CHECK(pool.pending_steps() >= T,
                "verify: needs a pool with deferred write-back of R ≥ T (one write-back per window at most)");
  LAPLACE_CHECK(pool.dtype() != DType::kBF16, "verify: BF16 state pools are not verified");
  Backend& be = *be_;
  const int64_t N = B * T;
  be.copy(ids_.slice(0, 0, N), Tensor(const_cast<int32_t*>(tokens), DType::kI32, {N}));
  for (int64_t b = 0; b < B; ++b) LAPLACE_CHECK(slots[b] >= 0 && slots[b] < pool.slots(), "verify: bad slot");
  be.copy(slots_.slice(0, 0, B), Tensor(const_cast<int32_t*>(slots), DType::kI32, {B}));
  doc_on_ = false;
  verifying_ = true;
  run_forward(B, T, opt, &pool, slots);
  verifying_ = false;
  verify_pool_ = &pool;
  verify_B_ = B;
  verify_T_ = T;
  verify_slots_.assign(slots, slots + B);
}

void Model::commit(const int32_t* accepted) {
  LAPLACE_CHECK(verify_B_ > 0, "commit: no verification to commit (or committed already)");
  Backend& be = *be_;
  const int64_t B = verify_B_, T = verify_T_, N = B * T, K = cfg_.conv_size;
  for (int64_t b = 0; b < B; ++b) LAPLACE_CHECK(accepted[b] >= 0 && accepted[b] <= T, "commit: accepted outside [0, T]");
  const Tensor acc = accepted_.slice(0, 0, B);
  be.copy(acc, Tensor(const_cast<int32_t*>(accepted), DType::kI32, {B}));
  // slots_ still holds the verification's slot ids (no forward ran since: verify_B_ says so).
  const Tensor slot_ids = slots_.slice(0, 0, B);
  const GlaParams gp = gla_params(GlaForm::kRecurrent);
  StatePool& pool = *verify_pool_;
  for (int64_t l = 0; l < cfg_.num_layers; ++l) {
    const Tensor qkvg = rows(verify_acts_[l].qkvg, N);
    be.gla_verify_commit(gp, qkvg_part(qkvg, B, T, 1), qkvg_part(qkvg, B, T, 2), acc, pool.gla(l), pool.pending(l),
                         slot_ids);
    // The conv window: the last K of (window, the accepted inputs), as a decode step per token
    // would shift it: rows [a, K) move up by a (ascending, so each is read before it is
    // overwritten), then the last min(a, K) inputs fill the end.
    const Tensor u = rows(verify_acts_[l].u, N);
    for (int64_t b = 0; b < B; ++b) {
      const int64_t a = accepted[b];
      if (a == 0) continue;
      const Tensor win = pool.conv(l).select(verify_slots_[b]);  // [K, D]
      for (int64_t i = 0; i + a < K; ++i) be.copy(win.slice(0, i, i + 1), win.slice(0, i + a, i + a + 1));
      for (int64_t i = std::max<int64_t>(K - a, 0); i < K; ++i) {
        const int64_t r = b * T + a - (K - i);  // input a − (K − i) of row b
        be.copy(win.slice(0, i, i + 1), u.slice(0, r, r + 1));
      }
    }
  }
  verify_B_ = 0;
}

void Model::forward_queued(int64_t B, int64_t T, const ForwardOptions& opt, StatePool* pool) {
  check_forward(B, T, opt, pool);
  LAPLACE_CHECK(!pool || (T == 1 && opt.form == GlaForm::kRecurrent),
                "forward_queued: with a state pool only decode steps (T = 1, recurrent) are queued");
  LAPLACE_CHECK(opt.document_separator < 0, "forward_queued: documents are kept apart by forward() only");
  doc_on_ = false;
  run_forward(B, T, opt, pool, nullptr);
}

void Model::set_replayed(int64_t B, int64_t T, const ForwardOptions& opt) {
  check_forward(B, T, opt, nullptr);
  last_B_ = B;
  last_T_ = T;
  last_only_ = opt.last_logits_only;
  logits_ = rows(logits_buf_, opt.last_logits_only ? B : B * T);
}

// What every layer of one inference forward shares: its segments, slots and form.
struct Model::Pass {
  std::span<const Segment> segs;
  StatePool* pool = nullptr;
  const int32_t* host_slots = nullptr;
  int64_t B = 0, T = 0, N = 0;  // sequences, length (0: ragged), token rows
  bool ragged = false;
  bool decode_step = false;  // one token per sequence from its slot
  GlaParams gp;
  Tensor doc, slot_ids;
};

void Model::run_forward(std::span<const Segment> segs, const ForwardOptions& opt, StatePool* pool,
                        const int32_t* host_slots) {
  if (!verifying_) verify_B_ = 0;  // a verification is committed before any other forward
  const bool ragged = segs.size() > 1;
  LAPLACE_CHECK(!ragged || (opt.last_logits_only && opt.form == GlaForm::kChunked && pool),
                "run_forward: a ragged forward is chunked, from slots, last-token logits only");
  // One segment: [B, T]. Ragged: B sequences of N tokens in all (T only per segment).
  Pass p;
  p.segs = segs;
  p.pool = pool;
  p.host_slots = host_slots;
  p.ragged = ragged;
  p.B = segs.back().first + segs.back().B;
  p.N = segs.back().row + segs.back().B * segs.back().T;
  p.T = ragged ? 0 : segs.front().T;
  const int64_t B = p.B, T = p.T, N = p.N;
  last_B_ = B;
  last_T_ = T;
  last_only_ = opt.last_logits_only;
  p.slot_ids = pool ? slots_.slice(0, 0, B) : Tensor{};

  const int64_t L = cfg_.num_layers;
  auto before = [&](int64_t group) {
    if (opt.before_group) opt.before_group(group);
  };
  before(0);
  be_->embedding_forward(ids_.slice(0, 0, N), w_.embed, rows(layer_[0].x_in, N));
  p.gp = gla_params(opt.form);
  // Documents kept apart: [B, T] starts for the conv and the mixer (one segment: not ragged).
  p.doc = doc_on_ ? doc_view(B, T) : Tensor{};
  p.gp.doc = p.doc;
  // Decode: one token per sequence from its slot (a training plan takes no pool).
  p.decode_step = !ragged && pool && T == 1 && opt.form == GlaForm::kRecurrent && !verifying_;
  if (plan_.training) {  // what the backward's recompute_layers runs again
    last_form_ = opt.form;
    last_before_ = plan_.recompute_layers ? opt.before_group : GroupHook{};
  }
  for (int64_t l = 0; l < L; ++l) {
    before(1 + l);
    if (plan_.training) {  // one segment [B, T] from the zero state (check_forward: no pool)
      train_layer_forward(l, B, T, p.gp, true);
      continue;
    }
    // Inference plans: pools, decode steps, ragged segments, FP8 weights.
    infer_mixer(l, p);
    infer_channel_mixer(l, p);
  }
  before(L + 1);
  infer_head(p, opt);
}

// Mixer block of an inference layer: x_mid = x_in + (RMSNorm(GLA(conv(LN1 x))) ⊙ SiLU(g)) · W_oᵀ.
void Model::infer_mixer(int64_t l, const Pass& p) {
  Backend& be = *be_;
  const int64_t B = p.B, T = p.T, N = p.N, H = cfg_.num_heads, dv = cfg_.head_v_dim;
  const GlaParams& gp = p.gp;
  const LayerActs& a = layer_[l];
  const LayerWeights& w = w_.layers[l];
  const Tensor x_in = rows(a.x_in, N), x_mid = rows(a.x_mid, N);
  const Tensor qkvg = rows(verifying_ ? verify_acts_[l].qkvg : a.qkvg, N);
  // Segment views: rows [s.row, s.row + s.B·s.T) as [s.B, s.T, …] and the segment's slots.
  auto seg_rows = [](const Tensor& t, const Segment& s) { return t.slice(0, s.row, s.row + s.B * s.T); };
  auto seg_slots = [&](const Segment& s) { return p.pool ? slots_.slice(0, s.first, s.first + s.B) : Tensor{}; };

  // A verification keeps this layer's conv input and projections for the commit (and writes
  // no window: the conv reads the slot's window and the row's own earlier inputs).
  const Tensor u_buf = verifying_ ? verify_acts_[l].u : a.u;
  be.layernorm_forward(x_in, w.norm1_w, w.norm1_b, cfg_.norm_eps, rows(u_buf, N), rows(a.ln1_mean, N),
                       rows(a.ln1_rstd, N));
  Tensor win = p.pool ? p.pool->conv(l) : Tensor{};
  if (documents_by_views()) {  // one segment, no pool (forward() checked)
    conv_forward(btc(rows(a.u, N), B, T), w.conv_w, btc(rows(a.c, N), B, T), Tensor{}, p.doc);
  } else {
    for (const Segment& s : p.segs)
      be.conv_silu_forward(btc(seg_rows(u_buf, s), s.B, s.T), w.conv_w, btc(seg_rows(a.c, s), s.B, s.T), Tensor{},
                           win, verifying_ ? Tensor{} : win, seg_slots(s), p.doc);
  }
  static const Fp8Matrix kNone{};
  project(rows(a.c, N), w.wqkvg, fp8_on_ ? fp8_layers_[l][0] : kNone, Tensor{}, qkvg);
  Tensor st = p.pool ? p.pool->gla(l) : Tensor{};
  const GlaPending pend = p.pool ? p.pool->pending(l) : GlaPending{};
  // The chunked form reads S itself: fold the rows' pending pairs in first.
  if (!p.decode_step && !verifying_ && pend.defined()) be.gla_pending_flush(gp, st, pend, p.slot_ids);
  if (verifying_) {
    // Speculative verification: every position as the decode step it stands for, the pool unwritten.
    be.gla_verify_deferred(gp, qkvg_part(qkvg, B, T, 0), qkvg_part(qkvg, B, T, 1), qkvg_part(qkvg, B, T, 2),
                           qkvg_part(qkvg, B, T, 3), w.onorm_w, cfg_.norm_eps, st, pend, p.slot_ids,
                           bthd(rows(a.o, N), B, T, H, dv), bthd(rows(a.y, N), B, T, H, dv));
  } else if (p.decode_step && pend.defined()) {
    // Deferred write-back: S read every step, written every R-th (docs/serving.md §4).
    be.gla_decode_gate_deferred(gp, qkvg_part(qkvg, B, T, 0), qkvg_part(qkvg, B, T, 1), qkvg_part(qkvg, B, T, 2),
                                qkvg_part(qkvg, B, T, 3), w.onorm_w, cfg_.norm_eps, st, pend, p.slot_ids,
                                bthd(rows(a.o, N), B, T, H, dv), bthd(rows(a.y, N), B, T, H, dv));
  } else if (p.decode_step) {
    // One pass over each state: recurrence, output and gate fused (same bits as below).
    be.gla_decode_gate(gp, qkvg_part(qkvg, B, T, 0), qkvg_part(qkvg, B, T, 1), qkvg_part(qkvg, B, T, 2),
                       qkvg_part(qkvg, B, T, 3), w.onorm_w, cfg_.norm_eps, st, p.slot_ids,
                       bthd(rows(a.o, N), B, T, H, dv), bthd(rows(a.y, N), B, T, H, dv));
  } else {
    for (const Segment& s : p.segs) {
      const Tensor q = seg_rows(qkvg, s);
      Tensor o = bthd(seg_rows(a.o, s), s.B, s.T, H, dv);
      if (st.defined() && st.dtype == DType::kBF16) {
        // A BF16 pool in a chunked forward: each row's state goes through F32 (one rounding
        // back on the store, as a decode step's).
        const Tensor stage = state_stage(s.B);
        for (int64_t b = 0; b < s.B; ++b) be.copy(stage.select(b), st.select(p.host_slots[s.first + b]));
        be.gla_forward(gp, qkvg_part(q, s.B, s.T, 0), qkvg_part(q, s.B, s.T, 1), qkvg_part(q, s.B, s.T, 2), o,
                       stage, stage, Tensor{});
        for (int64_t b = 0; b < s.B; ++b) be.copy(st.select(p.host_slots[s.first + b]), stage.select(b));
      } else if (documents_by_views()) {
        mixer_forward(gp, qkvg_part(q, s.B, s.T, 0), qkvg_part(q, s.B, s.T, 1), qkvg_part(q, s.B, s.T, 2), o);
      } else {
        be.gla_forward(gp, qkvg_part(q, s.B, s.T, 0), qkvg_part(q, s.B, s.T, 1), qkvg_part(q, s.B, s.T, 2), o, st,
                       st, seg_slots(s));
      }
    }
  }
  if (!p.decode_step && !verifying_) {
    // Row-wise: a ragged forward takes its N rows as one sequence [1, N].
    const int64_t rb = p.ragged ? 1 : B, rt = p.ragged ? N : T;
    const Tensor rstd = rstd_view(a.onorm_rstd, rb, rt);
    be.rmsnorm_gate_forward(bthd(rows(a.o, N), rb, rt, H, dv), qkvg_part(qkvg, rb, rt, 3), w.onorm_w, cfg_.norm_eps,
                            bthd(rows(a.y, N), rb, rt, H, dv), rstd);
  }
  project(rows(a.y, N), w.wo, fp8_on_ ? fp8_layers_[l][1] : kNone, x_in, x_mid);  // x_mid = x_in + y·W_oᵀ
}

// Channel mixer of an inference layer: x_out = x_mid + (SiLU(a) ⊙ b) · W_3ᵀ with [a|b] = LN2(x_mid) · W_12ᵀ.
void Model::infer_channel_mixer(int64_t l, const Pass& p) {
  Backend& be = *be_;
  const int64_t N = p.N;
  const LayerActs& a = layer_[l];
  const LayerWeights& w = w_.layers[l];
  const Tensor x_mid = rows(a.x_mid, N);
  const Tensor x_out = rows(l + 1 < cfg_.num_layers ? layer_[l + 1].x_in : x_final_, N);
  if (fp8_on_) {
    // Inference with FP8 weights: LN2's output and h are read only by W_12's and W_3's
    // products, which take their codes, so the backend may produce the codes without writing
    // z or h (Backend::layernorm_forward_e4m3, swiglu_forward_e4m3). One codes buffer serves
    // both products in turn.
    const std::array<Fp8Matrix, 4>& f8 = fp8_layers_[l];
    const Tensor zq = fp8_codes(fp8_xq_, N, cfg_.hidden_size), xs = fp8_xs_.slice(0, 0, N);
    be.layernorm_forward_e4m3(x_mid, w.norm2_w, w.norm2_b, cfg_.norm_eps, rows(a.z, N), zq, xs);
    project_codes(zq, xs, f8[2], Tensor{}, rows(a.ab, N));
    const Tensor hq = fp8_codes(fp8_xq_, N, cfg_.ffn_size);
    be.swiglu_forward_e4m3(rows(a.ab, N), rows(a.h, N), hq, xs);
    project_codes(hq, xs, f8[3], x_mid, x_out);  // x_out = x_mid + h·W_3ᵀ
  } else {
    static const Fp8Matrix kNone{};
    be.layernorm_forward(x_mid, w.norm2_w, w.norm2_b, cfg_.norm_eps, rows(a.z, N), rows(a.ln2_mean, N),
                         rows(a.ln2_rstd, N));
    project(rows(a.z, N), w.w12, kNone, Tensor{}, rows(a.ab, N));
    be.swiglu_forward(rows(a.ab, N), rows(a.h, N));
    project(rows(a.h, N), w.w3, kNone, x_mid, x_out);  // x_out = x_mid + h·W_3ᵀ
  }
}

// Head: logits = LN_f(x) · W_headᵀ, for every token or each sequence's last one.
void Model::infer_head(const Pass& p, const ForwardOptions& opt) {
  Backend& be = *be_;
  const int64_t N = p.N, D = cfg_.hidden_size;
  const int64_t M = opt.last_logits_only ? p.B : N;
  if (!opt.last_logits_only) {
    be.layernorm_forward(rows(x_final_, N), w_.norm_w, w_.norm_b, cfg_.norm_eps, rows(zf_, N), rows(lnf_mean_, N),
                         rows(lnf_rstd_, N));
  } else {
    for (const Segment& s : p.segs) {  // each sequence's last row, strided by its segment's length
      Tensor last = x_final_.slice(0, s.row + s.T - 1, s.row + s.T);
      last.shape[0] = s.B;
      last.stride[0] = s.T * D;
      const int64_t m0 = s.first, m1 = s.first + s.B;
      be.layernorm_forward(last, w_.norm_w, w_.norm_b, cfg_.norm_eps, zf_.slice(0, m0, m1), lnf_mean_.slice(0, m0, m1),
                           lnf_rstd_.slice(0, m0, m1));
    }
  }
  logits_ = rows(logits_buf_, M);
  static const Fp8Matrix kNoCodes{};
  project(rows(zf_, M), w_.lm_head, fp8_head_on_ && !plan_.training ? fp8_head_ : kNoCodes, Tensor{}, logits_);
}

void Model::train_layer_forward(int64_t l, int64_t B, int64_t T, const GlaParams& gp, bool write_out) {
  Backend& be = *be_;
  const int64_t N = B * T, H = cfg_.num_heads, dv = cfg_.head_v_dim;
  const LayerActs& a = layer_[l];
  const LayerWeights& w = w_.layers[l];
  static const Fp8Matrix kNone{};
  const auto fp8 = [&](int kind) -> const Fp8Matrix& { return fp8_train_ ? fp8_layers_[l][kind] : kNone; };
  const Tensor x_in = rows(a.x_in, N), x_mid = rows(a.x_mid, N), qkvg = rows(a.qkvg, N);

  // Mixer block: x_mid = x_in + (RMSNorm(GLA(conv(LN1 x))) ⊙ SiLU(g)) · W_oᵀ
  be.layernorm_forward(x_in, w.norm1_w, w.norm1_b, cfg_.norm_eps, rows(a.u, N), rows(a.ln1_mean, N),
                       rows(a.ln1_rstd, N));
  conv_forward(btc(rows(a.u, N), B, T), w.conv_w, btc(rows(a.c, N), B, T), btc(rows(a.conv_pre, N), B, T), gp.doc);
  project(rows(a.c, N), w.wqkvg, fp8(0), Tensor{}, qkvg);
  mixer_forward(gp, qkvg_part(qkvg, B, T, 0), qkvg_part(qkvg, B, T, 1), qkvg_part(qkvg, B, T, 2),
                bthd(rows(a.o, N), B, T, H, dv));
  const Tensor rstd = rstd_view(a.onorm_rstd, B, T);
  be.rmsnorm_gate_forward(bthd(rows(a.o, N), B, T, H, dv), qkvg_part(qkvg, B, T, 3), w.onorm_w, cfg_.norm_eps,
                          bthd(rows(a.y, N), B, T, H, dv), rstd);
  project(rows(a.y, N), w.wo, fp8(1), x_in, x_mid);  // x_mid = x_in + y·W_oᵀ

  // Channel mixer: x_out = x_mid + (SiLU(a) ⊙ b) · W_3ᵀ with [a|b] = LN2(x_mid) · W_12ᵀ
  be.layernorm_forward(x_mid, w.norm2_w, w.norm2_b, cfg_.norm_eps, rows(a.z, N), rows(a.ln2_mean, N),
                       rows(a.ln2_rstd, N));
  project(rows(a.z, N), w.w12, fp8(2), Tensor{}, rows(a.ab, N));
  be.swiglu_forward(rows(a.ab, N), rows(a.h, N));
  if (!write_out) return;  // the recompute: the backward reads h, not x_out
  const Tensor x_out = rows(l + 1 < cfg_.num_layers ? layer_[l + 1].x_in : x_final_, N);
  project(rows(a.h, N), w.w3, fp8(3), x_mid, x_out);  // x_out = x_mid + h·W_3ᵀ
}

double Model::loss(const int32_t* targets) {
  LAPLACE_CHECK(!last_only_, "loss: needs the logits of every token");
  const int64_t N = last_B_ * last_T_;
  be_->copy(targets_.slice(0, 0, N), Tensor(const_cast<int32_t*>(targets), DType::kI32, {N}));
  Tensor losses = losses_.slice(0, 0, N);
  be_->cross_entropy_forward(logits_, targets_.slice(0, 0, N), losses);
  // Sum on the host in the backends' fixed order (core/fixed_sum.h: an ignored target's loss
  // is 0 and adds nothing), divide by the number of targets.
  std::vector<char> host(losses.nbytes());
  Tensor h = Tensor(host.data(), losses.dtype, {N});
  be_->copy(h, losses);
  be_->synchronize();
  int64_t count = 0;
  for (int64_t i = 0; i < N; ++i) count += targets[i] >= 0;
  const double sum = fixed_order_sum(N, [&](int64_t i) {
    if (targets[i] < 0) return 0.0;
    return losses.dtype == DType::kF64 ? reinterpret_cast<const double*>(host.data())[i]
                                       : static_cast<double>(reinterpret_cast<const float*>(host.data())[i]);
  });
  return count ? sum / static_cast<double>(count) : 0.0;
}

void Model::zero_accumulated_gradients(const Arena& grads) {
  // Every tensor but those backward(..., overwrite = true) writes with a product, so that a
  // parameter added later is zeroed unless it is known to be written.
  const ModelWeights g = weights_bind(cfg_, grads);
  std::vector<const void*> written;
  if (!cfg_.tie_embeddings) written.push_back(g.lm_head.data);
  for (const LayerWeights& l : g.layers)
    for (const Tensor* t : {&l.wqkvg, &l.wo, &l.w12, &l.w3}) written.push_back(t->data);
  for (size_t i = 0; i < grads.size(); ++i) {
    const Tensor t = grads.tensor(i);
    if (std::find(written.begin(), written.end(), t.data) == written.end()) be_->fill(t, 0.0);
  }
}

void Model::backward(const int32_t* targets, const Arena& grads, double loss_scale, const GroupHook& after_group,
                     bool overwrite) {
  LAPLACE_CHECK(plan_.training, "backward: the plan is not a training plan");
  LAPLACE_CHECK(!last_only_, "backward: needs the logits of every token");
  Backend& be = *be_;
  const int64_t B = last_B_, T = last_T_, N = B * T;
  const int64_t H = cfg_.num_heads, dv = cfg_.head_v_dim;
  const ModelWeights g = weights_bind(cfg_, grads);

  int64_t count = 0;
  for (int64_t i = 0; i < N; ++i) count += targets[i] >= 0;
  const double scale = count ? loss_scale / static_cast<double>(count) : 0.0;
  Tensor tg = targets_.slice(0, 0, N);
  be.copy(tg, Tensor(const_cast<int32_t*>(targets), DType::kI32, {N}));

  // Head and final norm.
  be.cross_entropy_backward(logits_, tg, scale, logits_);  // dlogits in place
  const Tensor dx = rows(dx_, N), dtmp = rows(dtmp_, N);
  be.gemm(logits_, false, w_.lm_head, false, dtmp, 1.0, 0.0);
  // Tied embeddings: the head writes (or adds to) the shared gradient first; the embedding adds.
  be.gemm(logits_, true, rows(zf_, N), false, g.lm_head, 1.0, overwrite ? 0.0 : 1.0);
  be.layernorm_backward(dtmp, rows(x_final_, N), w_.norm_w, rows(lnf_mean_, N), rows(lnf_rstd_, N), dx, false,
                        g.norm_w, g.norm_b);
  auto after = [&](int64_t group) {
    if (after_group) after_group(group);
  };
  after(cfg_.num_layers + 1);

  GlaParams gp = gla_params(GlaForm::kChunked);
  const Tensor doc = doc_on_ ? doc_view(B, T) : Tensor{};
  gp.doc = doc;
  GlaParams fwd = gla_params(last_form_);  // recompute_layers: the forward's GLA
  fwd.doc = doc;
  static const Fp8Matrix kNone{};
  for (int64_t l = cfg_.num_layers - 1; l >= 0; --l) {
    if (plan_.recompute_layers) {  // layer l's intermediates again, into the shared set
      if (last_before_) last_before_(1 + l);
      train_layer_forward(l, B, T, fwd, false);
    }
    const LayerActs& a = layer_[l];
    const LayerWeights& w = w_.layers[l];
    const LayerWeights& gw = g.layers[l];
    const auto fp8t = [&](int kind) -> const Fp8Matrix& { return fp8_train_ ? fp8_cols_[l][kind] : kNone; };
    const Tensor qkvg = rows(a.qkvg, N), dqkvg = rows(dqkvg_, N);

    // Channel mixer: x_out = x_mid + h·W_3ᵀ, h = SiLU(a) ⊙ b, [a|b] = z·W_12ᵀ.
    project_backward(overwrite, dx, w.w3, fp8t(3), rows(a.h, N), rows(dh_, N), gw.w3);
    be.swiglu_backward(rows(dh_, N), rows(a.ab, N), rows(dab_, N));
    project_backward(overwrite, rows(dab_, N), w.w12, fp8t(2), rows(a.z, N), rows(dz_, N), gw.w12);
    be.layernorm_backward(rows(dz_, N), rows(a.x_mid, N), w.norm2_w, rows(a.ln2_mean, N), rows(a.ln2_rstd, N), dx,
                          true, gw.norm2_w, gw.norm2_b);

    // Mixer: x_mid = x_in + y·W_oᵀ, y = RMSNorm(o) ⊙ SiLU(g), o = GLA(q, k, v).
    project_backward(overwrite, dx, w.wo, fp8t(1), rows(a.y, N), rows(dy_, N), gw.wo);
    Tensor o = bthd(rows(a.o, N), B, T, H, dv);
    if (plan_.recompute_mixer)
      mixer_forward(gp, qkvg_part(qkvg, B, T, 0), qkvg_part(qkvg, B, T, 1), qkvg_part(qkvg, B, T, 2), o);
    const Tensor rstd = rstd_view(a.onorm_rstd, B, T);
    be.rmsnorm_gate_backward(bthd(rows(dy_, N), B, T, H, dv), o, qkvg_part(qkvg, B, T, 3), w.onorm_w, rstd,
                             bthd(rows(do_, N), B, T, H, dv), qkvg_part(dqkvg, B, T, 3), gw.onorm_w);
    mixer_backward(gp, qkvg_part(qkvg, B, T, 0), qkvg_part(qkvg, B, T, 1), qkvg_part(qkvg, B, T, 2),
                   bthd(rows(do_, N), B, T, H, dv), qkvg_part(dqkvg, B, T, 0), qkvg_part(dqkvg, B, T, 1),
                   qkvg_part(dqkvg, B, T, 2));
    project_backward(overwrite, dqkvg, w.wqkvg, fp8t(0), rows(a.c, N), rows(dc_, N), gw.wqkvg);
    conv_backward(btc(rows(dc_, N), B, T), btc(rows(a.u, N), B, T), w.conv_w, btc(rows(a.conv_pre, N), B, T),
                  btc(rows(du_, N), B, T), gw.conv_w, doc);
    be.layernorm_backward(rows(du_, N), rows(a.x_in, N), w.norm1_w, rows(a.ln1_mean, N), rows(a.ln1_rstd, N), dx,
                          true, gw.norm1_w, gw.norm1_b);
    after(1 + l);
  }
  be.embedding_backward(ids_.slice(0, 0, N), dx, g.embed);
  after(0);
}

}  // namespace laplace
