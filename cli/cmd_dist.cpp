// `laplace dist plan`: what FSDP-style training with distributed Muon costs per rank,
// from global shapes only (distributed/plan.h), without starting anything.
#include <algorithm>
#include <cstdio>

#include "cli/common.h"
#include "core/dtype.h"
#include "distributed/comm.h"
#include "distributed/fsdp_layout.h"
#include "distributed/plan.h"
#include "distributed/step_model.h"
#include "model/config.h"
#include "ops/backend.h"
#include "train/memory_plan.h"

namespace laplace::cli {

namespace {

struct PlanArgs {
  std::string config;
  int ranks = 64;
  bool muon_fused = false;
  std::string dtype = "bf16";
  int show_ranks = 4;
  bool predict = false;
  double memory_gb = 0;  // > 0: print one rank's memory plan on GPUs of this many GB
  StepMachine machine;
  StepWorkload work;
};

std::string gb(double b) {
  char buf[48];
  if (b >= 1e9) std::snprintf(buf, sizeof buf, "%.3f GB", b / 1e9);
  else if (b >= 1e6) std::snprintf(buf, sizeof buf, "%.3f MB", b / 1e6);
  else std::snprintf(buf, sizeof buf, "%.1f kB", b / 1e3);
  return buf;
}

void print_prediction(const char* label, const StepPrediction& p) {
  std::printf("  %-22s %6d %8.0f %8.3f %8.3f %8.3f %8.3f %8.3f %8.3f %11.0f %9.0f\n", label, p.ranks, p.busbw_gbs,
              p.fb_s, p.exposed_s, p.opt_s, p.ns_s, p.muon_s, p.step_s, p.tok_s, p.tok_s_per_gpu);
}

// The step model (distributed/step_model.h) for the given machine, then for the machines people ask
// about: 1, 2 and 8 GPUs in one node, and nodes of 8 GPUs.
Status run_predict(const PlanArgs& a, const Config& c) {
  const StepWorkload& w = a.work;
  if (w.fb_tok_s <= 0 || w.opt_1gpu_s < 0 || w.ns_share < 0 || w.ns_share > 1 || w.overlap < 0 || w.overlap > 1 ||
      a.machine.nvlink_gbs <= 0 || a.machine.ib_gbs <= 0 || a.machine.gpus_per_node < 1 || a.machine.nodes < 1)
    return Status::invalid_argument("step model: rates and bandwidths must be positive, --ns-share and --overlap in [0, 1]");
  std::printf("\nstep model (docs/distributed.md §7): per rank B %lld × T %lld × %lld micro-batches; one GPU: "
              "forward+backward %.0f tokens/s, optimizer %.3f s (%.0f %% Newton–Schulz); NVLink %.0f GB/s, "
              "InfiniBand %.0f GB/s per GPU; overlap %.2f; Muon %s\n",
              (long long)w.batch, (long long)w.seq, (long long)w.accum, w.fb_tok_s, w.opt_1gpu_s, 100 * w.ns_share,
              a.machine.nvlink_gbs, a.machine.ib_gbs, w.overlap, muon_comm_name(w.muon_comm));
  std::printf("  %-22s %6s %8s %8s %8s %8s %8s %8s %8s %11s %9s\n", "machine", "GPUs", "busbw", "fb s", "exposed",
              "opt s", "NS s", "muon s", "step s", "tokens/s", "per GPU");
  char label[64];
  std::snprintf(label, sizeof label, "given: %d × %d", a.machine.nodes, a.machine.gpus_per_node);
  print_prediction(label, predict_step(c, a.machine, w));
  for (int g : {1, 2, 8}) {
    StepMachine m = a.machine;
    m.gpus_per_node = g;
    m.nodes = 1;
    std::snprintf(label, sizeof label, "1 node × %d", g);
    print_prediction(label, predict_step(c, m, w));
  }
  for (int n : {2, 8, 64}) {
    StepMachine m = a.machine;
    m.gpus_per_node = 8;
    m.nodes = n;
    std::snprintf(label, sizeof label, "%d nodes × 8", n);
    print_prediction(label, predict_step(c, m, w));
  }
  const StepPrediction one = predict_step(c, StepMachine{1, 1, a.machine.nvlink_gbs, a.machine.ib_gbs}, w);
  const StepPrediction mine = predict_step(c, a.machine, w);
  std::printf("  scaling of the given machine vs one GPU: %.3f (tokens/s per GPU ratio)\n",
              mine.tok_s_per_gpu / one.tok_s_per_gpu);
  return Status::ok();
}

// The plan at the request's micro-batch with the recompute `laplace train` would choose for it:
// none if that fits, else the mixer's, else (where `layers`) every layer's; when nothing fits,
// the last of those (whose total then exceeds the memory).
MemoryPlan plan_at_batch(const Config& c, MemoryPlanRequest r, bool layers) {
  r.recompute = kRecomputeChoose;
  r.allow_recompute_layers = layers;
  MemoryPlan p;
  if (!choose_memory_plan(c, r, &p).is_ok())
    p = memory_plan_for(c, r, r.batch, layers ? kRecomputeLayers : kRecomputeMixer);
  p.chosen = false;  // B is given
  return p;
}

// What `laplace train --device cuda` plans on each of P GPUs (bf16 weights, f32 masters and
// gradients, Newton–Schulz in bf16) for the step model's micro-batch, sharded (FSDP), and the
// single-device trainer's plan beside it at P = 1 (which may recompute every layer).
void print_memory(const PlanArgs& a, const Config& c, const std::vector<ShardedParam>& params,
                  const std::vector<MuonUnit>& units) {
  MemoryPlanRequest r;
  r.seq = a.work.seq;
  r.dtype = DType::kBF16;
  r.batch = a.work.batch;
  r.grad_accum = a.work.accum;
  r.muon_fused = a.muon_fused;
  r.ns_bf16 = true;
  r.device_bytes = static_cast<size_t>(a.memory_gb * 1e9);
  r.reserve_bytes = size_t{3} << 30;  // the trainer's default reserve on CUDA
  const ShardBytes sb = fsdp_shard_bytes_max(c, params, units, a.ranks, DType::kF32, DType::kBF16, DType::kBF16);
  r.sharded = &sb;
  r.ranks = a.ranks;
  const MemoryPlan sharded = plan_at_batch(c, r, false);
  std::printf("\nmemory per GPU, sharded (laplace train --distributed, %d rank%s):\n%s", a.ranks,
              a.ranks > 1 ? "s" : "", format_memory_plan(sharded, "device").c_str());
  if (a.ranks == 1) {
    r.sharded = nullptr;
    const MemoryPlan one = plan_at_batch(c, r, true);
    std::printf("memory, the single-device trainer (laplace train):\n%s", format_memory_plan(one, "device").c_str());
  }
}

Status run_plan(const PlanArgs& a) {
  Config c;
  LAPLACE_RETURN_IF_ERROR(config_load(a.config, &c));
  if (a.ranks < 1) return Status::invalid_argument("--ranks must be ≥ 1");
  int64_t e = 0;
  if (a.dtype == "bf16") e = 2;
  else if (a.dtype == "f32") e = 4;
  else if (a.dtype == "f64") e = 8;
  else return Status::invalid_argument("--dtype must be bf16, f32 or f64");
  const int P = a.ranks;
  const auto params = sharded_params(c, a.muon_fused);
  const auto units = assign_muon_owners(params, P);
  double muon_elems = 0, all_elems = 0;
  for (const auto& p : params) {
    all_elems += static_cast<double>(p.rows * p.cols);
    if (p.muon) muon_elems += static_cast<double>(p.rows * p.cols);
  }
  const double M = muon_elems * static_cast<double>(e);
  std::printf("config %s: %zu parameter tensors, %.0f parameters, %.0f in %zu Muon units (%s)\n",
              a.config.c_str(), params.size(), all_elems, muon_elems, units.size(),
              a.muon_fused ? "fused matrices" : "per row block");
  std::printf("ranks P = %d; update communicated as %s (e = %lld bytes/element); M = e·Σ Muon elements = %s\n\n", P,
              a.dtype.c_str(), (long long)e, gb(M).c_str());

  std::printf("Muon traffic per rank per optimizer step (payload to/from other ranks):\n");
  std::printf("  %-11s %14s %14s %14s %14s\n", "strategy", "max sent", "max received", "max sent+recv",
              "mean sent+recv");
  double tot[2] = {0, 0};
  for (MuonComm m : {MuonComm::kGather, MuonComm::kAllToAll}) {
    const auto t = muon_traffic(params, units, P, m, e);
    int64_t ms = 0, mr = 0, mt = 0;
    double mean = 0;
    for (const auto& x : t) {
      ms = std::max(ms, x.sent);
      mr = std::max(mr, x.received);
      mt = std::max(mt, x.sent + x.received);
      mean += static_cast<double>(x.sent + x.received) / P;
    }
    tot[m == MuonComm::kGather ? 0 : 1] = static_cast<double>(mt);
    std::printf("  %-11s %14s %14s %14s %14s\n", muon_comm_name(m), gb(ms).c_str(), gb(mr).c_str(), gb(mt).c_str(),
                gb(mean).c_str());
    if (a.show_ranks > 0) {
      std::printf("    ");
      for (int r = 0; r < std::min(P, a.show_ranks); ++r)
        std::printf("rank %d: %s/%s  ", r, gb(t[r].sent).c_str(), gb(t[r].received).c_str());
      std::printf("%s\n", P > a.show_ranks ? "…" : "");
    }
  }
  if (tot[1] > 0) std::printf("  gather / all_to_all (max sent+recv) = %.1f×\n", tot[0] / tot[1]);

  const auto cost = owner_costs(units, P);
  std::vector<int> nunits(P, 0);
  for (const auto& u : units) nunits[u.owner]++;
  const double cmax = *std::max_element(cost.begin(), cost.end());
  const double cmin = *std::min_element(cost.begin(), cost.end());
  double csum = 0;
  for (double x : cost) csum += x;
  std::printf("\nowner assignment (%zu units, cost rows·cols·min(rows,cols), greedy largest-first, ties → lowest "
              "rank; hash %016llx):\n",
              units.size(), (unsigned long long)muon_plan_hash(units, P));
  std::printf("  Newton–Schulz cost per rank: max %.4g, min %.4g, mean %.4g → max/mean %.3f\n", cmax, cmin, csum / P,
              csum > 0 ? cmax / (csum / P) : 1.0);
  std::printf("  units per rank: max %d, min %d%s\n", *std::max_element(nunits.begin(), nunits.end()),
              *std::min_element(nunits.begin(), nunits.end()),
              static_cast<int64_t>(units.size()) < P ? " (fewer units than ranks: some ranks own none)" : "");

  double fsdp = 0;  // weight all-gather + gradient reduce-scatter per rank per micro-step, at e bytes
  for (const auto& p : params) {
    const RowRange mine = shard_rows(p.rows, 0, P);
    fsdp += 2.0 * static_cast<double>((p.rows - mine.rows()) * p.cols + mine.rows() * p.cols * (P - 1)) * e;
  }
  std::printf("\nfor scale: FSDP weight all-gather + gradient reduce-scatter ≈ %s per rank per micro-step (rank 0, "
              "sent+received, at e bytes)\n",
              gb(fsdp).c_str());
  std::printf(
      "\nformula (ov_r(u) = rows of unit u in rank r's shard ⌈rows/P⌉, c = cols):\n"
      "  all_to_all: sent = received = e·[Σ_{owner(u)≠r} ov_r(u)·c + Σ_{owner(u)=r} (rows_u − ov_r(u))·c]\n"
      "              (exchange 1: shard rows → owners; exchange 2: orthogonalised rows back) ≈ 2M/P each way\n"
      "  gather:     per unit the owner collects the rows, orthogonalises and broadcasts the whole unit:\n"
      "              sent = e·[Σ_{owner≠r} ov_r(u)·c + Σ_{owner=r} (P−1)·rows_u·c]\n"
      "              received = e·[Σ_{owner=r} (rows_u − ov_r(u))·c + Σ_{owner≠r} rows_u·c] ≈ M\n"
      "  see docs/distributed.md\n");
  if (a.memory_gb > 0) print_memory(a, c, params, units);
  if (a.predict) return run_predict(a, c);
  return Status::ok();
}

// Where the selftest's buffers live: the host vectors themselves, or device copies made
// through a backend (for the NCCL communicator's device path).
class Place {
 public:
  explicit Place(Backend* be) : be_(be) {}
  ~Place() {
    for (void* p : owned_) be_->allocator().deallocate(p);
  }
  Place(const Place&) = delete;
  Place& operator=(const Place&) = delete;
  // The buffer a collective gets for v (a device copy of it on a device place).
  template <class T> T* put(std::vector<T>& v) {
    if (!be_) return v.data();
    if (v.empty()) return nullptr;
    void* d = be_->allocator().allocate(v.size() * sizeof(T));
    LAPLACE_CHECK(d != nullptr, "selftest: device allocation failed");
    owned_.push_back(d);
    be_->copy(bytes(d, v.size() * sizeof(T), be_->device()), bytes(v.data(), v.size() * sizeof(T), Device::kCPU));
    return static_cast<T*>(d);
  }
  // v ← the buffer put() gave for it.
  template <class T> void get(std::vector<T>& v, const T* p) {
    if (!be_ || v.empty()) return;
    be_->synchronize();
    be_->copy(bytes(v.data(), v.size() * sizeof(T), Device::kCPU), bytes(const_cast<T*>(p), v.size() * sizeof(T),
                                                                           be_->device()));
  }

 private:
  static Tensor bytes(void* p, size_t n, Device d) {
    const int64_t shape[1] = {static_cast<int64_t>(n)};
    return Tensor::make(p, DType::kU8, shape, 1, d);
  }
  Backend* be_;
  std::vector<void*> owned_;
};

Status selftest_collectives(Communicator& c, Place& place, std::string* failed_out);

// Every collective of the Communicator, on every type, checked against values each rank
// computes on its own (including the rank-order sums of the reductions). Run it under
// mpirun to check an MPI installation; without mpirun it checks the P = 1 path. With
// --device cuda it checks the NCCL communicator on device buffers (one GPU per rank),
// then its host path.
Status run_selftest(const std::string& device) {
  std::unique_ptr<Backend> be;  // declared first so that it outlives the communicator using its stream
  std::unique_ptr<Communicator> comm;
  if (device == "cpu") {
    LAPLACE_RETURN_IF_ERROR(make_communicator(&comm));
  } else {
    LAPLACE_RETURN_IF_ERROR(make_nccl_communicator(&comm));  // picks this rank's GPU first
    LAPLACE_RETURN_IF_ERROR(make_backend(device, &be));
    comm->use_stream(be->native_stream());
  }
  std::string failed;
  for (Backend* where : {be.get(), static_cast<Backend*>(nullptr)}) {
    Place place(where);
    LAPLACE_RETURN_IF_ERROR(selftest_collectives(*comm, place, &failed));
    if (!be) break;  // the host pass was the only one
  }
  comm->barrier();
  const int P = comm->size(), me = comm->rank();
  Status st = failed.empty() ? Status::ok()
                             : Status::invalid_argument("rank " + std::to_string(me) + ": " + failed + " is wrong");
  st = agree_status(*comm, st);
  if (st.is_ok())
    std::printf("rank %d/%d (%s): communicator selftest ok (%s buffers)\n", me, P, comm->name(),
                be ? "device and host" : "host");
  return st;
}

Status selftest_collectives(Communicator& c, Place& place, std::string* failed_out) {
  Communicator* comm = &c;
  const int P = comm->size(), me = comm->rank();
  std::string& failed = *failed_out;
  auto expect = [&](bool ok, const std::string& what) {
    if (!ok && failed.empty()) failed = what;
  };
  // all_gather, uneven counts (rank q contributes q % 3 elements: some contribute none).
  {
    std::vector<int64_t> counts(P), displs(P);
    int64_t total = 0;
    for (int q = 0; q < P; ++q) counts[q] = q % 3, displs[q] = total, total += counts[q];
    std::vector<int64_t> mine(counts[me]), all(total, -1);
    for (int64_t i = 0; i < counts[me]; ++i) mine[i] = 100 * me + i;
    int64_t* ap = place.put(all);
    comm->all_gather(place.put(mine), ap, counts, displs, CommType::kI64);
    place.get(all, ap);
    for (int q = 0; q < P; ++q)
      for (int64_t i = 0; i < counts[q]; ++i) expect(all[displs[q] + i] == 100 * q + i, "all_gather i64");
  }
  // all_to_all f64, per-peer counts (q + t) % 3, and its byte accounting.
  {
    auto cnt = [](int q, int t) { return static_cast<int64_t>((q + t) % 3); };
    std::vector<int64_t> sc(P), sd(P), rc(P), rd(P);
    int64_t so = 0, ro = 0, sent = 0, recv = 0;
    for (int t = 0; t < P; ++t) {
      sc[t] = cnt(me, t), sd[t] = so, so += sc[t];
      rc[t] = cnt(t, me), rd[t] = ro, ro += rc[t];
      if (t != me) sent += sc[t] * 8, recv += rc[t] * 8;
    }
    std::vector<double> s(so), r(ro, -1);
    for (int t = 0; t < P; ++t)
      for (int64_t i = 0; i < sc[t]; ++i) s[sd[t] + i] = me * 1000.0 + t * 10.0 + i;
    const CommStats before = comm->stats();
    double* rp = place.put(r);
    comm->all_to_all(place.put(s), sc, sd, rp, rc, rd, CommType::kF64);
    place.get(r, rp);
    expect(comm->stats().bytes_sent - before.bytes_sent == sent, "all_to_all bytes sent");
    expect(comm->stats().bytes_received - before.bytes_received == recv, "all_to_all bytes received");
    for (int q = 0; q < P; ++q)
      for (int64_t i = 0; i < rc[q]; ++i) expect(r[rd[q] + i] == q * 1000.0 + me * 10.0 + i, "all_to_all f64");
  }
  // broadcast bf16 from the last rank.
  {
    std::vector<uint16_t> b(5);
    for (int i = 0; i < 5; ++i) b[i] = me == P - 1 ? float_to_bf16(0.5f * i + 1) : 0;
    uint16_t* bp = place.put(b);
    comm->broadcast(bp, 5, P - 1, CommType::kBF16);
    place.get(b, bp);
    for (int i = 0; i < 5; ++i) expect(b[i] == float_to_bf16(0.5f * i + 1), "broadcast bf16");
  }
  // reduce_scatter f32 with values whose sum depends on the order: the result must be the
  // left-to-right sum over ranks 0..P−1 (counts t % 2 + 1).
  auto val = [](int q, int64_t i) { return q == 0 ? 1e8f + static_cast<float>(i) : 1.0f + 0.25f * q; };
  {
    std::vector<int64_t> counts(P);
    int64_t total = 0;
    for (int t = 0; t < P; ++t) counts[t] = t % 2 + 1, total += counts[t];
    std::vector<float> s(total), r(counts[me]);
    for (int64_t i = 0; i < total; ++i) s[i] = val(me, i);
    float* rp = place.put(r);
    comm->reduce_scatter(place.put(s), rp, counts, CommType::kF32);
    place.get(r, rp);
    int64_t off = 0;
    for (int t = 0; t < me; ++t) off += counts[t];
    for (int64_t i = 0; i < counts[me]; ++i) {
      float e = val(0, off + i);
      for (int q = 1; q < P; ++q) e = e + val(q, off + i);
      expect(r[i] == e, "reduce_scatter f32 (rank order)");
    }
    // accumulate: recv = recv + (the same rank-order sum), one add after the sum.
    std::vector<float> acc(counts[me]);
    for (int64_t i = 0; i < counts[me]; ++i) acc[i] = 0.5f + static_cast<float>(i);
    float* ap = place.put(acc);
    comm->reduce_scatter(place.put(s), ap, counts, CommType::kF32, /*accumulate=*/true);
    place.get(acc, ap);
    for (int64_t i = 0; i < counts[me]; ++i) expect(acc[i] == (0.5f + static_cast<float>(i)) + r[i], "reduce_scatter accumulate");
  }
  // all_reduce f64, i64, bf16: identical on every rank, rank-order sums.
  {
    std::vector<double> d = {me == 0 ? 1e16 : 1.0, static_cast<double>(me)};
    double* dp = place.put(d);
    comm->all_reduce(dp, 2, CommType::kF64);
    place.get(d, dp);
    double e0 = 1e16, e1 = 0;
    for (int q = 1; q < P; ++q) e0 = e0 + 1.0, e1 += q;
    expect(d[0] == e0 && d[1] == e1, "all_reduce f64 (rank order)");
    std::vector<int64_t> i = {me + 1};
    int64_t* ip = place.put(i);
    comm->all_reduce(ip, 1, CommType::kI64);
    place.get(i, ip);
    expect(i[0] == static_cast<int64_t>(P) * (P + 1) / 2, "all_reduce i64");
    std::vector<uint16_t> h = {float_to_bf16(1.0f), float_to_bf16(me == 0 ? 256.0f : 1.0f)};
    uint16_t* hp = place.put(h);
    comm->all_reduce(hp, 2, CommType::kBF16);
    place.get(h, hp);
    float e2 = 256.0f;  // bf16 sums run in f32 and round once: 256 + (P−1)·1 is exact there
    for (int q = 1; q < P; ++q) e2 += 1.0f;
    expect(h[0] == float_to_bf16(static_cast<float>(P)) && h[1] == float_to_bf16(e2), "all_reduce bf16");
  }
  return Status::ok();
}

}  // namespace

void add_dist(CLI::App& app) {
  auto* dist = app.add_subcommand("dist", "distributed training tools");
  dist->require_subcommand(1);
  auto* plan = dist->add_subcommand("plan", "per-rank Muon traffic of both --muon-comm strategies and owner balance");
  auto a = std::make_shared<PlanArgs>();
  plan->add_option("--config", a->config, "config.json")->required();
  plan->add_option("--ranks", a->ranks, "number of ranks P")->check(CLI::Range(1, 1 << 20));
  plan->add_flag("--muon-fused", a->muon_fused, "orthogonalise W_qkvg and W_12 whole");
  plan->add_option("--dtype", a->dtype, "dtype of the communicated update: bf16 (GPU), f32 or f64 (CPU)")
      ->check(CLI::IsMember({"bf16", "f32", "f64"}));
  plan->add_option("--show-ranks", a->show_ranks, "print sent/received of the first N ranks")
      ->check(CLI::NonNegativeNumber);
  plan->add_flag("--predict", a->predict, "also predict step time and tokens/s (distributed/step_model.h) for the given "
                                          "machine and for 1-8 GPUs and 2-64 nodes of 8");
  plan->add_option("--memory-gb", a->memory_gb, "also print one rank's memory plan (bf16 weights, f32 masters) on "
                   "GPUs of this many GB, for --batch, --seq and --grad-accum")
      ->check(CLI::PositiveNumber);
  plan->add_option("--gpus-per-node", a->machine.gpus_per_node, "step model: GPUs per node")->check(CLI::PositiveNumber);
  plan->add_option("--nodes", a->machine.nodes, "step model: nodes")->check(CLI::PositiveNumber);
  plan->add_option("--nvlink-gbs", a->machine.nvlink_gbs, "step model: NCCL bus bandwidth in a node, GB/s")
      ->capture_default_str();
  plan->add_option("--ib-gbs", a->machine.ib_gbs, "step model: bandwidth across nodes per GPU, GB/s")
      ->capture_default_str();
  plan->add_option("--batch", a->work.batch, "step model: sequences per micro-batch per rank")->capture_default_str();
  plan->add_option("--seq", a->work.seq, "step model: tokens per sequence")->capture_default_str();
  plan->add_option("--grad-accum", a->work.accum, "step model: micro-batches per step")->capture_default_str();
  plan->add_option("--fb-tok-s", a->work.fb_tok_s, "step model: one GPU's forward+backward tokens/s (measured)")
      ->capture_default_str();
  plan->add_option("--opt-s", a->work.opt_1gpu_s, "step model: one GPU's optimizer step, seconds (measured)")
      ->capture_default_str();
  plan->add_option("--ns-share", a->work.ns_share, "step model: Newton–Schulz share of the optimizer step")
      ->capture_default_str();
  plan->add_option("--overlap", a->work.overlap, "step model: share of the collectives hidden behind compute (0-1)")
      ->capture_default_str();
  plan->add_option("--overhead-s", a->work.overhead_s, "step model: fixed seconds per step")->capture_default_str();
  plan->callback([a] {
    a->work.muon_fused = a->muon_fused;
    g_exit_code = report(run_plan(*a));
  });
  auto* self = dist->add_subcommand("selftest", "check every collective (run under mpirun -np P)");
  auto device = std::make_shared<std::string>("cpu");
  self->add_option("--device", *device, "cpu (MPI, host buffers) or cuda (NCCL, one GPU per rank: device and host "
                                        "buffers)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  self->callback([device] { g_exit_code = report(run_selftest(*device)); });
}

}  // namespace laplace::cli
