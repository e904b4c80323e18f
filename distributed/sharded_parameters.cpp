#include "distributed/sharded_parameters.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>

#include <nlohmann/json.hpp>

#include "core/check.h"
#include "core/file_util.h"
#include "core/safetensors.h"
#include "distributed/fsdp_layout.h"

namespace laplace {

namespace {

std::string fmt_bytes(double b) {
  char buf[32];
  if (b >= 1e9) std::snprintf(buf, sizeof buf, "%.2f GB", b / 1e9);
  else if (b >= 1e6) std::snprintf(buf, sizeof buf, "%.2f MB", b / 1e6);
  else if (b >= 1e3) std::snprintf(buf, sizeof buf, "%.1f kB", b / 1e3);
  else std::snprintf(buf, sizeof buf, "%.0f B", b);
  return buf;
}

uint64_t fnv1a(const std::string& s, uint64_t h) {
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

std::vector<int64_t> prefix(const std::vector<int64_t>& counts) {
  std::vector<int64_t> d(counts.size());
  int64_t off = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    d[i] = off;
    off += counts[i];
  }
  return d;
}

}  // namespace

ShardedParameters::ShardedParameters(MuonComm muon_comm, Communicator& comm)
    : muon_comm_(muon_comm), comm_(comm), P_(comm.size()), me_(comm.rank()) {}

void ShardedParameters::detach() {
  comm_.overlap_end();
  if (be_) be_->synchronize();
  comm_.use_stream(nullptr);
}

void ShardedParameters::all_gather_value(double v, double* all) {
  std::vector<int64_t> ones(P_, 1), displs(P_);
  for (int q = 0; q < P_; ++q) displs[q] = q;
  comm_.all_gather(&v, all, ones, displs, CommType::kF64);
}

std::vector<int64_t> ShardedParameters::counts_of(size_t i) const {
  std::vector<int64_t> c(P_);
  for (int q = 0; q < P_; ++q) c[q] = local_[i].all[q].rows() * params_[i].cols;
  return c;
}

Tensor ShardedParameters::shard_view(void* base, int64_t elem_off, const ShardedParam& p, int64_t rows) const {
  std::vector<int64_t> shape = p.shape;
  if (shape.empty()) shape = {1};
  shape[0] = rows;
  return Tensor::make(static_cast<char*>(base) + elem_off * static_cast<int64_t>(dtype_size(dtype_)), dtype_,
                      shape.data(), static_cast<int>(shape.size()), dev_);
}

void ShardedParameters::copy_elems(void* dst, Device dd, const void* src, Device sd, int64_t n, DType t) {
  if (n == 0) return;
  const int64_t shape[1] = {n};
  be_->copy(Tensor::make(dst, t, shape, 1, dd), Tensor::make(const_cast<void*>(src), t, shape, 1, sd));
}

// Every rank builds the same full initial weights (seeded, or --init) and keeps its rows.
// BF16 models initialise in F32 exactly as WholeParameters' masters, in a
// temporary full F32 table that is freed afterwards.
Status ShardedParameters::init_masters() {
  Arena tmp;
  const Arena* full = &model_->weight_arena();
  if (wdtype_ != dtype_) {
    LAPLACE_RETURN_IF_ERROR(tmp.create(weight_specs(*cfg_, dtype_), be_->allocator(), "initial F32 weights"));
    if (!opt_->init_ckpt.empty()) LAPLACE_RETURN_IF_ERROR(weights_load(opt_->init_ckpt, *be_, tmp));
    else weights_init(*cfg_, *be_, tmp, opt_->seed);
    full = &tmp;
  } else {
    if (!opt_->init_ckpt.empty()) LAPLACE_RETURN_IF_ERROR(model_->load(opt_->init_ckpt));
    else model_->init_weights(opt_->seed);
  }
  const size_t es = dtype_size(dtype_);
  for (size_t i = 0; i < params_.size(); ++i) {
    const Local& l = local_[i];
    copy_elems(l.w.data, dev_, static_cast<const char*>(full->tensor(i).data) + l.mine.begin * params_[i].cols * es,
               dev_, l.mine.rows() * params_[i].cols, dtype_);
  }
  be_->synchronize();  // before tmp is freed
  return Status::ok();
}

Status ShardedParameters::check_options(const TrainOptions& o) {
  if (o.fp8)
    return Status::unsupported("--precision fp8 trains on one device; the sharded trainer (--distributed, mpirun) "
                               "computes in the model dtype");
  if (o.tokens_per_step % P_ != 0)
    return Status::invalid_argument("--tokens-per-step (" + std::to_string(o.tokens_per_step) +
                                    ") must split evenly over the " + std::to_string(P_) + " ranks");
  if (o.device == "cpu") {
    if (o.dtype != DType::kF32 && o.dtype != DType::kF64)
      return Status::unsupported(std::string("distributed training on the CPU computes in f32 or f64, not ") +
                                 dtype_name(o.dtype));
    dtype_ = wdtype_ = o.dtype;
  } else {
    if (o.dtype != DType::kBF16)
      return Status::unsupported(std::string("distributed training on CUDA computes in bf16 (with f32 masters), "
                                             "not ") + dtype_name(o.dtype) + ": pass --dtype bf16");
    if (std::string(comm_.name()).rfind("nccl", 0) != 0)
      return Status::unsupported(std::string("--device cuda needs the NCCL communicator, not ") + comm_.name());
    dtype_ = DType::kF32;
    wdtype_ = DType::kBF16;
  }
  ctype_ = dtype_ == DType::kF32 ? CommType::kF32 : CommType::kF64;
  return Status::ok();
}

Status ShardedParameters::attach(const TrainerParts& parts) {
  opt_ = parts.opt;
  cfg_ = parts.cfg;
  be_ = parts.be;
  model_ = parts.model;
  optimizer_ = parts.optimizer;
  dev_ = be_->device();
  comm_.use_stream(be_->native_stream());
  params_ = sharded_params(*cfg_, opt_->muon_fused);
  units_ = assign_muon_owners(params_, P_);
  return Status::ok();
}

void ShardedParameters::plan_request(MemoryPlanRequest* r) {
  if (dev_ == Device::kCPU) r->device_bytes /= static_cast<size_t>(P_);
  const std::vector<int64_t> free_b = laplace::all_gather_value(comm_, static_cast<int64_t>(r->device_bytes));
  r->device_bytes = static_cast<size_t>(*std::min_element(free_b.begin(), free_b.end()));
  // The plan keeps a pointer to the shard sizes until it is applied, right after this call.
  shard_bytes_ = fsdp_shard_bytes_max(*cfg_, params_, units_, P_, dtype_, wdtype_, ns_dtype());
  r->sharded = &shard_bytes_;
  r->ranks = P_;
  r->tokens_per_step = opt_->tokens_per_step / P_;
}

DType ShardedParameters::ns_dtype() const { return dev_ == Device::kCUDA ? DType::kBF16 : dtype_; }

size_t ShardedParameters::allocated_bytes() const {
  return grads_.bytes() + shards_.bytes() + muon_.bytes() + stage_.bytes();
}

Status ShardedParameters::create() {
  LAPLACE_RETURN_IF_ERROR(model_->create(*cfg_, *be_, wdtype_));
  LAPLACE_RETURN_IF_ERROR(model_->plan({opt_->batch, opt_->seq, true, opt_->recompute_mixer}));
  LAPLACE_RETURN_IF_ERROR(grads_.create(weight_specs(*cfg_, dtype_), be_->allocator(), "gradients"));

  // ---- the plan: shards, groups, Muon owners --------------------------------------------
  // docs/training.md §6: Newton–Schulz in BF16 on the GPU (as the single-GPU trainer); the CPU keeps
  // the master dtype so the F32 reference can check it.
  const FsdpLayout lay = fsdp_layout(params_, units_, P_, me_, dtype_, wdtype_, ns_dtype());
  const Arena& W = model_->weight_arena();
  LAPLACE_CHECK(W.size() == params_.size(), "ShardedParameters: weight table and plan differ");
  local_.assign(params_.size(), Local{});
  for (size_t i = 0; i < params_.size(); ++i) {
    Local& l = local_[i];
    l.all = lay.rows[i];
    l.mine = l.all[me_];
    l.full_w = W.tensor(i);
    l.full_g = grads_.tensor(i);
    l.u_off = lay.update_off[i];
    l.ws_off = lay.wshard_off[i];
  }
  LAPLACE_RETURN_IF_ERROR(shards_.create(lay.shards, be_->allocator(), "shards"));
  for (size_t i = 0; i < params_.size(); ++i) {
    Local& l = local_[i];
    const int64_t rows = l.mine.rows();
    auto view = [&](const std::string& name) {
      return rows > 0 ? shard_view(shards_.tensor(shards_.find(name)).data, 0, params_[i], rows) : Tensor{};
    };
    l.w = view("master." + params_[i].name);
    l.g = view("grad." + params_[i].name);
    l.s0 = view(params_[i].muon ? "optim." + params_[i].name + ".momentum" : "optim." + params_[i].name + ".adam_m");
    if (!params_[i].muon) l.s1 = view("optim." + params_[i].name + ".adam_v");
  }
  LAPLACE_RETURN_IF_ERROR(init_masters());
  // Groups: embedding, each layer, the rest (final norm, head), in forward order.
  groups_.assign(static_cast<size_t>(cfg_->num_layers) + 2, {});
  for (size_t i = 0; i < params_.size(); ++i) {
    const std::string& n = params_[i].name;
    size_t g = groups_.size() - 1;
    if (n.rfind("model.embed", 0) == 0) g = 0;
    else if (n.rfind("model.layers.", 0) == 0) g = 1 + static_cast<size_t>(std::stoll(n.substr(13)));
    groups_[g].push_back(i);
  }
  // Muon buffers and the collective staging (distributed/fsdp_layout.h).
  unit_ov_ = lay.unit_rows;
  owned_off_ = lay.owned_off;
  ns_.dtype = lay.ns.dtype;
  ns_.max_elems = lay.ns.max_elems;
  ns_.max_gram = lay.ns.max_gram;
  LAPLACE_RETURN_IF_ERROR(muon_.create(lay.muon, be_->allocator(), "Muon buffers"));
  ushard_ = muon_.tensor(0);
  owned_ = muon_.tensor(1);
  bcast_ = muon_.tensor(2);
  LAPLACE_RETURN_IF_ERROR(ns_.bind(muon_, "muon.ns."));
  a2a_to_ = lay.a2a_to;
  a2a_from_ = lay.a2a_from;
  LAPLACE_RETURN_IF_ERROR(stage_.create(lay.staging, be_->allocator(), "collective staging"));
  wshard_ = stage_.tensor(0);
  rowsq_ = stage_.tensor(1);
  full_ = stage_.tensor(2);
  a2a_send_ = stage_.tensor(3);
  a2a_recv_ = stage_.tensor(4);
  rowsq_all_ = stage_.tensor(5);

  // The optimizer over this rank's shards, with their state; the trainer exchanges.
  std::vector<Param> ps;
  opt_param_.clear();
  for (size_t i = 0; i < params_.size(); ++i) {
    const Local& l = local_[i];
    if (!l.w.defined()) continue;
    Param p;
    p.name = params_[i].name;
    p.w = l.w;
    p.g = l.g;
    p.muon = params_[i].muon;
    if (p.muon) p.blocks = params_[i].blocks;
    p.decay = params_[i].decay;
    p.row_begin = l.mine.begin;
    p.global_rows = params_[i].rows;
    p.state0 = l.s0;
    p.state1 = l.s1;
    ps.push_back(std::move(p));
    opt_param_.push_back(i);
  }
  LAPLACE_RETURN_IF_ERROR(optimizer_->init(*be_, std::move(ps), opt_->optim, this));

  // The plan hash covers the owner assignment, the config and the flags that shape it.
  plan_hash_ = muon_plan_hash(units_, P_);
  plan_hash_ = fnv1a(cfg_->to_json(), plan_hash_);
  plan_hash_ = fnv1a(std::string(muon_comm_name(muon_comm_)) + (opt_->muon_fused ? "/fused" : "/blocks") + "/" +
                         std::to_string(opt_->batch) + "/" + std::to_string(opt_->seq) + "/" +
                         std::to_string(opt_->grad_accum) + "/" + dtype_name(dtype_) + "/" + dtype_name(wdtype_),
                     plan_hash_);

  return Status::ok();
}

std::vector<TensorSpec> ShardedParameters::loss_specs() const {
  return {{"micro_loss", DType::kF64, {1}},
          {"step_losses", DType::kF64, {opt_->grad_accum * P_}},
          {"loss_sum", DType::kF64, {1}}};
}

void ShardedParameters::bind_loss(const Arena& a, size_t first) {
  micro_loss_ = a.tensor(first);
  step_losses_ = a.tensor(first + 1);
  loss_sum_ = a.tensor(first + 2);
}

std::string ShardedParameters::dtype_note() const { return std::string(" (masters ") + dtype_name(dtype_) + ")"; }

std::string ShardedParameters::ranks_note() const { return "ranks " + std::to_string(P_) + " × "; }

std::string ShardedParameters::setup_lines() const {
  const std::vector<double> cost = owner_costs(units_, P_);
  double mx = 0, sum = 0;
  for (double c : cost) {
    mx = std::max(mx, c);
    sum += c;
  }
  const auto tr = muon_traffic(params_, units_, P_, muon_comm_, static_cast<int64_t>(dtype_size(dtype_)));
  int64_t tmax = 0;
  for (const auto& t : tr) tmax = std::max(tmax, t.sent + t.received);
  char buf[512];
  std::snprintf(buf, sizeof buf,
                "dist: %d rank(s) over %s; FSDP row shards; Muon %zu units, --muon-comm %s, owner plan %016llx, "
                "Newton–Schulz cost max/mean %.3f; predicted Muon traffic ≤ %s per rank per step\n",
                P_, comm_.name(), units_.size(), muon_comm_name(muon_comm_), (unsigned long long)plan_hash_,
                sum > 0 ? mx / (sum / P_) : 1.0, fmt_bytes(static_cast<double>(tmax)).c_str());
  return buf;
}

// ---- collectives over the parameter table --------------------------------------------------

// Opens the communicator's overlap region (distributed/comm.h) and queues the all-gathers of every
// group beside the compute, marking each group. After a skipped step too: the masters did not
// change, so the weights come out as they were (the skip flag stays on the device).
void ShardedParameters::gather_weights() {
  const bool round = wdtype_ != dtype_;
  auto rounded = [&](const Local& l) {  // my rows of a parameter in wshard_
    return static_cast<char*>(wshard_.data) + l.ws_off * static_cast<int64_t>(dtype_size(wdtype_));
  };
  if (P_ == 1) {  // the weights are the masters, rounded where they are read: nothing to gather
    for (const Local& l : local_)
      if (l.w.defined()) be_->copy(Tensor::make(l.full_w.data, wdtype_, l.w.shape.data(), l.w.ndim, dev_), l.w);
    comm_.overlap_begin();
    gather_mark_.assign(groups_.size(), comm_.mark());
    return;
  }
  if (round)  // my rows rounded once: every rank gets the same bf16(master) bits
    for (const Local& l : local_)
      if (l.w.defined()) be_->copy(Tensor::make(rounded(l), wdtype_, l.w.shape.data(), l.w.ndim, dev_), l.w);
  comm_.overlap_begin();
  gather_mark_.assign(groups_.size(), 0);
  for (size_t g = 0; g < groups_.size(); ++g) {
    for (size_t i : groups_[g]) {
      const std::vector<int64_t> counts = counts_of(i);
      const Local& l = local_[i];
      const void* mine = !l.w.defined() ? nullptr : round ? rounded(l) : l.w.data;
      comm_.all_gather(mine, l.full_w.data, counts, prefix(counts), round ? CommType::kBF16 : ctype_);
    }
    gather_mark_[g] = comm_.mark();
  }
}

// Group g's gradients (complete on the compute stream) into the shards.
void ShardedParameters::reduce_scatter_group(size_t g, bool accumulate) {
  comm_.after_compute();
  for (size_t i : groups_[g]) {
    const std::vector<int64_t> counts = counts_of(i);
    comm_.reduce_scatter(local_[i].full_g.data, local_[i].g.data, counts, ctype_, accumulate);
  }
}

void ShardedParameters::grad_sum_squares_into(Tensor ss) {
  int64_t off = 0, all_off = 0;
  for (size_t i = 0; i < params_.size(); ++i) {
    const Local& l = local_[i];
    const int64_t rows = l.mine.rows();
    if (l.g.defined()) {
      const int64_t g_shape[2] = {rows, params_[i].cols}, o_shape[1] = {rows};
      be_->row_sum_squares(Tensor::make(l.g.data, dtype_, g_shape, 2, dev_),
                           Tensor::make(static_cast<double*>(rowsq_.data) + off, DType::kF64, o_shape, 1, dev_));
    }
    if (P_ > 1) {
      std::vector<int64_t> counts(P_);
      for (int q = 0; q < P_; ++q) counts[q] = l.all[q].rows();
      comm_.all_gather(static_cast<double*>(rowsq_.data) + off, static_cast<double*>(rowsq_all_.data) + all_off,
                       counts, prefix(counts), CommType::kF64);
    }
    off += rows;
    all_off += params_[i].rows;
  }
  // The fixed-order F64 sum (divided by 1: exact); on one rank its own rows are that vector already.
  be_->loss_sum_into(P_ > 1 ? rowsq_all_ : rowsq_, 1.0, ss, false);
}

Tensor ShardedParameters::muon_update(size_t i) {
  const size_t k = opt_param_[i];
  return shard_view(ushard_.data, local_[k].u_off, params_[k], local_[k].mine.rows());
}

void ShardedParameters::orthogonalise() {
  const CommStats before = comm_.stats();
  if (muon_comm_ == MuonComm::kAllToAll) muon_exchange_all_to_all();
  else muon_exchange_gather();
  muon_sent_ = comm_.stats().bytes_sent - before.bytes_sent;
  muon_received_ = comm_.stats().bytes_received - before.bytes_received;
}

// ---- Muon exchanges ----------------------------------------------------------------------------

// Unit k's block on its owner (this rank): where it is orthogonalised.
char* ShardedParameters::owned_block(size_t k) {
  const size_t es = dtype_size(dtype_);
  if (owned_off_[k] == kOwnedInUpdate) {  // wholly in this rank's shard: in the update buffer
    const MuonUnit& un = units_[k];
    const Local& l = local_[un.param];
    const int64_t off = l.u_off + (un.row_begin - l.mine.begin) * un.cols;
    return static_cast<char*>(ushard_.data) + off * static_cast<int64_t>(es);
  }
  return static_cast<char*>(owned_.data) + owned_off_[k] * static_cast<int64_t>(es);
}

void ShardedParameters::muon_exchange_all_to_all() {
  const size_t es = dtype_size(dtype_);
  char* u = static_cast<char*>(ushard_.data);
  char* o = u;  // the orthogonalised rows overwrite the update's (create)
  auto my_rows_of = [&](size_t k, char* base) {  // this rank's rows of unit k in a shard buffer
    const MuonUnit& un = units_[k];
    const Local& l = local_[un.param];
    return base + (l.u_off + (unit_ov_[k][me_].begin - l.mine.begin) * un.cols) * static_cast<int64_t>(es);
  };
  auto rows_in_block = [&](size_t k, int q) {  // rank q's rows of unit k inside the owner's block
    const MuonUnit& un = units_[k];
    return owned_block(k) + (unit_ov_[k][q].begin - un.row_begin) * un.cols * static_cast<int64_t>(es);
  };
  auto in_place = [&](size_t k) { return owned_off_[k] == kOwnedInUpdate; };
  // Counts from global shapes (create): to owner q, my rows of q's units; from q, q's rows
  // of mine; none to or from this rank itself, whose rows of its own units are copied.
  const std::vector<int64_t>& to = a2a_to_;
  const std::vector<int64_t>& from = a2a_from_;
  const std::vector<int64_t> to_d = prefix(to), from_d = prefix(from);
  char* sendbuf = static_cast<char*>(a2a_send_.data);
  char* recvbuf = static_cast<char*>(a2a_recv_.data);
  auto move = [&](void* dst, const void* src, int64_t n) { copy_elems(dst, dev_, src, dev_, n, dtype_); };

  // Exchange 1: shard rows → owners.
  std::vector<int64_t> cur = to_d;
  for (size_t k = 0; k < units_.size(); ++k) {
    const int64_t n = unit_ov_[k][me_].rows() * units_[k].cols;
    if (n == 0 || in_place(k)) continue;
    if (units_[k].owner == me_) {
      move(rows_in_block(k, me_), my_rows_of(k, u), n);
      continue;
    }
    move(sendbuf + cur[units_[k].owner] * es, my_rows_of(k, u), n);
    cur[units_[k].owner] += n;
  }
  auto orthogonalise_unit = [&](size_t k) {
    const int64_t shape[2] = {units_[k].rows, units_[k].cols};
    Tensor blk = Tensor::make(owned_block(k), dtype_, shape, 2, dev_);
    newton_schulz(*be_, blk, blk, ns_, opt_->optim.ns_steps);
  };
  // The units this rank owns whole in its own shard take no part in the exchange: their
  // Newton–Schulz runs beside it (a device communicator's own stream; the packing above is
  // queued before the exchange starts), the others' after it. Each unit's arithmetic is the
  // same in any order, so the bits are too.
  comm_.overlap_begin();
  comm_.all_to_all(sendbuf, to, to_d, recvbuf, from, from_d, ctype_);
  const int64_t exchanged = comm_.mark();
  for (size_t k = 0; k < units_.size(); ++k)
    if (units_[k].owner == me_ && in_place(k)) orthogonalise_unit(k);
  comm_.compute_wait(exchanged);
  comm_.overlap_end();
  cur = from_d;
  for (int q = 0; q < P_; ++q)
    for (size_t k = 0; k < units_.size(); ++k) {
      if (units_[k].owner != me_ || q == me_) continue;
      const int64_t n = unit_ov_[k][q].rows() * units_[k].cols;
      if (n == 0) continue;
      move(rows_in_block(k, q), recvbuf + cur[q] * es, n);
      cur[q] += n;
    }
  for (size_t k = 0; k < units_.size(); ++k)
    if (units_[k].owner == me_ && !in_place(k)) orthogonalise_unit(k);
  // Exchange 2: the mirror image, orthogonalised rows → row owners.
  cur = from_d;
  for (int q = 0; q < P_; ++q)
    for (size_t k = 0; k < units_.size(); ++k) {
      if (units_[k].owner != me_ || q == me_) continue;
      const int64_t n = unit_ov_[k][q].rows() * units_[k].cols;
      if (n == 0) continue;
      move(recvbuf + cur[q] * es, rows_in_block(k, q), n);
      cur[q] += n;
    }
  comm_.all_to_all(recvbuf, from, from_d, sendbuf, to, to_d, ctype_);
  cur = to_d;
  for (size_t k = 0; k < units_.size(); ++k) {
    const int64_t n = unit_ov_[k][me_].rows() * units_[k].cols;
    if (n == 0 || in_place(k)) continue;
    if (units_[k].owner == me_) {
      move(my_rows_of(k, o), rows_in_block(k, me_), n);
      continue;
    }
    move(my_rows_of(k, o), sendbuf + cur[units_[k].owner] * es, n);
    cur[units_[k].owner] += n;
  }
}

void ShardedParameters::muon_exchange_gather() {
  const size_t es = dtype_size(dtype_);
  char* u = static_cast<char*>(ushard_.data);
  char* o = u;  // the orthogonalised rows overwrite the update's (create)
  for (size_t k = 0; k < units_.size(); ++k) {
    const MuonUnit& un = units_[k];
    const Local& l = local_[un.param];
    const int owner = un.owner;
    const bool in_place = owned_off_[k] == kOwnedInUpdate;  // mine and whole in my shard: nothing to collect
    const int64_t my_off = l.u_off + (unit_ov_[k][me_].begin - l.mine.begin) * un.cols;
    // Collect the unit on its owner, straight into the owned block (rows in rank order).
    std::vector<int64_t> sc(P_, 0), sd(P_, 0), rc(P_, 0), rd(P_, 0);
    if (!in_place) sc[owner] = unit_ov_[k][me_].rows() * un.cols;
    if (owner == me_ && !in_place)
      for (int q = 0; q < P_; ++q) {
        rc[q] = unit_ov_[k][q].rows() * un.cols;
        rd[q] = (unit_ov_[k][q].begin - un.row_begin) * un.cols;
      }
    char* block = owner == me_ ? owned_block(k) : static_cast<char*>(bcast_.data);
    comm_.all_to_all(u + my_off * static_cast<int64_t>(es), sc, sd, block, rc, rd, ctype_);
    if (owner == me_) {
      const int64_t shape[2] = {un.rows, un.cols};
      Tensor blk = Tensor::make(block, dtype_, shape, 2, dev_);
      newton_schulz(*be_, blk, blk, ns_, opt_->optim.ns_steps);
    }
    comm_.broadcast(block, un.rows * un.cols, owner, ctype_);
    const int64_t n = unit_ov_[k][me_].rows() * un.cols;
    if (!in_place)
      copy_elems(o + my_off * static_cast<int64_t>(es), dev_,
                 block + (unit_ov_[k][me_].begin - un.row_begin) * un.cols * static_cast<int64_t>(es), dev_, n, dtype_);
  }
}

// ---- checkpoints -----------------------------------------------------------------------------------

// Rank 0's host `full` (rows·cols elements) ← every rank's rows, through the staging
// buffer on the backend's device.
void ShardedParameters::gather_rows_to_root(const Tensor& shard, const ShardedParam& p, const Local& l, void* full) {
  std::vector<int64_t> sc(P_, 0), sd(P_, 0), rc(P_, 0), rd(P_, 0);
  sc[0] = l.mine.rows() * p.cols;
  if (me_ == 0)
    for (int q = 0; q < P_; ++q) {
      rc[q] = l.all[q].rows() * p.cols;
      rd[q] = l.all[q].begin * p.cols;
    }
  comm_.all_to_all(shard.data, sc, sd, me_ == 0 ? full_.data : nullptr, rc, rd, ctype_);
  if (me_ == 0) copy_elems(full, Device::kCPU, full_.data, dev_, p.rows * p.cols, dtype_);
}

Status ShardedParameters::save_checkpoint(const std::string& out_dir, const TrainProgress& progress) {
  // Collective part: gather masters and optimizer state onto rank 0.
  std::vector<std::vector<char>> bufs;
  std::vector<NamedTensor> named;
  const size_t es = dtype_size(dtype_);
  auto add = [&](const std::string& name, const Tensor& shard, size_t i) {
    std::vector<int64_t> shape = params_[i].shape;
    bufs.emplace_back(me_ == 0 ? static_cast<size_t>(params_[i].rows * params_[i].cols) * es : 0);
    gather_rows_to_root(shard, params_[i], local_[i], bufs.back().data());
    if (me_ == 0)
      named.push_back({name, Tensor::make(bufs.back().data(), dtype_, shape.data(), static_cast<int>(shape.size()))});
  };
  bufs.reserve(params_.size() * 3);
  for (size_t i = 0; i < params_.size(); ++i) add(params_[i].name, local_[i].w, i);
  for (size_t i = 0; i < params_.size(); ++i) {
    if (params_[i].muon) {
      add("optim." + params_[i].name + ".momentum", local_[i].s0, i);
    } else {
      add("optim." + params_[i].name + ".adam_m", local_[i].s0, i);
      add("optim." + params_[i].name + ".adam_v", local_[i].s1, i);
    }
  }
  Status st;
  if (me_ == 0) {
    auto meta = checkpoint_metadata(*cfg_, progress);
    meta["dist_world"] = std::to_string(P_);
    meta["muon_comm"] = muon_comm_name(muon_comm_);
    st = safetensors_write(out_dir + "/checkpoint.safetensors", named, meta);
    // The masters (as WholeParameters writes them; for F32/F64 models they are the
    // weights), with weights_save's metadata.
    if (st.is_ok()) {
      const std::vector<NamedTensor> masters(named.begin(), named.begin() + static_cast<int64_t>(params_.size()));
      st = safetensors_write(out_dir + "/model.safetensors", masters, model_file_metadata(*cfg_, dtype_));
    }
  }
  return st;
}

Status ShardedParameters::load_checkpoint(const std::string& path, TrainProgress* progress) {
  SafeTensorsReader r;
  LAPLACE_RETURN_IF_ERROR(SafeTensorsReader::open(path, &r));
  TrainProgress p;
  LAPLACE_RETURN_IF_ERROR(checkpoint_read_progress(r, *cfg_, &p));
  // Every tensor this run needs, full shape; nothing else named optim.* may be present.
  std::vector<std::pair<std::string, std::pair<size_t, Tensor*>>> want;
  for (size_t i = 0; i < params_.size(); ++i) {
    want.push_back({params_[i].name, {i, &local_[i].w}});
    if (params_[i].muon) {
      want.push_back({"optim." + params_[i].name + ".momentum", {i, &local_[i].s0}});
    } else {
      want.push_back({"optim." + params_[i].name + ".adam_m", {i, &local_[i].s0}});
      want.push_back({"optim." + params_[i].name + ".adam_v", {i, &local_[i].s1}});
    }
  }
  for (const SafeTensorInfo& info : r.tensors()) {
    if (info.name.rfind("optim.", 0) != 0) continue;
    bool known = false;
    for (const auto& w : want) known |= w.first == info.name;
    if (!known)
      return Status::invalid_argument(path + ": unexpected optimizer tensor '" + info.name +
                                      "' (no such parameter or state in this run; written with other Muon/AdamW "
                                      "settings?)");
  }
  // Read everything before changing anything.
  const size_t es = dtype_size(dtype_);
  std::vector<std::vector<char>> rows(want.size());
  for (size_t j = 0; j < want.size(); ++j) {
    const auto& [name, slot] = want[j];
    const ShardedParam& sp = params_[slot.first];
    if (!r.find(name)) return Status::invalid_argument(path + ": missing tensor " + name);
    std::vector<char> full(static_cast<size_t>(sp.rows * sp.cols) * es);
    std::vector<int64_t> shape = sp.shape;
    Tensor h = Tensor::make(full.data(), dtype_, shape.data(), static_cast<int>(shape.size()));
    LAPLACE_RETURN_IF_ERROR(r.read_into(name, h).with_context(path));
    const RowRange& m = local_[slot.first].mine;
    rows[j].assign(full.begin() + m.begin * sp.cols * static_cast<int64_t>(es),
                   full.begin() + m.end * sp.cols * static_cast<int64_t>(es));
  }
  for (size_t j = 0; j < want.size(); ++j)
    copy_elems(want[j].second.second->data, dev_, rows[j].data(), Device::kCPU,
               static_cast<int64_t>(rows[j].size() / es), dtype_);
  *progress = p;
  optimizer_->set_step_count(p.optimizer_steps);
  return Status::ok();
}

// ---- the step ----------------------------------------------------------------------------------------
//
// Overlap (distributed/comm.h): the step opens the communicator's overlap region (gather_weights
// left it open), the forward waits for group g's all-gather just before it reads group g,
// and the backward hands each group to the reduce-scatter as soon as its gradients are
// queued; the optimizer reads the shards after overlap_end.

void ShardedParameters::begin_step() {
  at_start_ = comm_.stats();
  comm_.overlap_begin();  // no-op when the last gather left it open
}

ForwardOptions ShardedParameters::forward_options() {
  ForwardOptions fo;
  fo.before_group = [this](int64_t g) { comm_.compute_wait(gather_mark_[static_cast<size_t>(g)]); };
  return fo;
}

void ShardedParameters::begin_micro(int64_t a) {
  if (a > 0) comm_.compute_wait(comm_.mark());  // the last micro-step's reduce-scatters have read full_g
  // Each micro-batch's gradient starts afresh; the products write theirs (overwrite_gradients).
  model_->zero_accumulated_gradients(grads_);
}

// The micro-batch's mean loss into a device scalar; nothing is read back until the step's end.
// On one rank the mean goes straight to its place in the step's vector.
void ShardedParameters::micro_loss(const Tensor& losses, double count, int64_t a) {
  const Tensor slot = P_ > 1 ? micro_loss_ : step_losses_.slice(0, a, a + 1);
  be_->loss_sum_into(losses, count, slot, false);
}

double ShardedParameters::loss_scale() const { return 1.0 / static_cast<double>(opt_->grad_accum * P_); }

GroupHook ShardedParameters::after_group(int64_t a) {
  return [this, a](int64_t g) { reduce_scatter_group(static_cast<size_t>(g), a > 0); };
}

// Rank r's loss of micro-step a lands at a·P + r: the order of one rank's A·P micro-batches,
// so the step's loss does not depend on P either.
void ShardedParameters::end_micro(int64_t a) {
  if (P_ == 1) return;
  std::vector<int64_t> ones(P_, 1), displs(P_);
  for (int q = 0; q < P_; ++q) displs[q] = q;
  comm_.after_compute();
  comm_.all_gather(micro_loss_.data, static_cast<double*>(step_losses_.data) + a * P_, ones, displs, CommType::kF64);
}

void ShardedParameters::before_optimizer() {
  comm_.overlap_end();  // the optimizer reads every reduced shard
  be_->loss_sum_into(step_losses_, static_cast<double>(opt_->grad_accum * P_), loss_sum_, false);
  tr_ = DistStepTraffic{};
}

// The optimizer step and the next step's weight all-gathers are queued with no host
// synchronisation; the result (norm, skip) is read at the step's end. A skipped step leaves
// the masters as they were, so gathering them again gives the same weights.
void ShardedParameters::after_optimizer() {
  tr_.muon_sent = muon_sent_;
  tr_.muon_received = muon_received_;
  gather_weights();
  tr_.fsdp_sent = comm_.stats().bytes_sent - at_start_.bytes_sent - tr_.muon_sent;
  tr_.fsdp_received = comm_.stats().bytes_received - at_start_.bytes_received - tr_.muon_received;
  // Everybody's Muon counters, for the log (inside the timed step).
  std::vector<int64_t> ones(P_, 1), displs(P_);
  for (int q = 0; q < P_; ++q) displs[q] = q;
  tr_.muon_sent_per_rank.resize(P_);
  tr_.muon_received_per_rank.resize(P_);
  comm_.all_gather(&tr_.muon_sent, tr_.muon_sent_per_rank.data(), ones, displs, CommType::kI64);
  comm_.all_gather(&tr_.muon_received, tr_.muon_received_per_rank.data(), ones, displs, CommType::kI64);
}

double ShardedParameters::step_loss() {
  double loss = 0;
  be_->copy(Tensor(&loss, DType::kF64, {1}), loss_sum_);
  return loss;
}

std::string ShardedParameters::record_fields() const {
  nlohmann::ordered_json j;
  j["ranks"] = P_;
  j["muon_comm"] = muon_comm_name(muon_comm_);
  j["muon_bytes_sent"] = tr_.muon_sent_per_rank;
  j["muon_bytes_received"] = tr_.muon_received_per_rank;
  j["fsdp_bytes_sent"] = tr_.fsdp_sent;
  j["fsdp_bytes_received"] = tr_.fsdp_received;
  return j.dump();
}

std::string ShardedParameters::progress_detail() const {
  int64_t mx = 0;
  for (int q = 0; q < P_; ++q) mx = std::max(mx, tr_.muon_sent_per_rank[q] + tr_.muon_received_per_rank[q]);
  return std::string(" | muon ") + muon_comm_name(muon_comm_) + " " + fmt_bytes(static_cast<double>(mx)) +
         "/rank (max sent+recv) | fsdp " + fmt_bytes(static_cast<double>(tr_.fsdp_sent + tr_.fsdp_received)) + "/rank";
}

}  // namespace laplace
