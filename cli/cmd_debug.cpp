// Debug subcommands that expose single computations on files, so that the PyTorch
// reference can check them: `laplace debug grad`, `debug gla`, `debug ns`.
#include <cmath>
#include <cstdio>
#include <map>

#include "cli/common.h"
#include "core/safetensors.h"
#include "text/data_loader.h"
#include "train/muon.h"

namespace laplace::cli {

namespace {

// Host tensors with their own storage, for staging file contents.
struct HostTensors {
  std::vector<std::vector<char>> bufs;
  Tensor make(DType dt, const std::vector<int64_t>& shape) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    bufs.emplace_back(static_cast<size_t>(n) * dtype_size(dt) + 8);
    return Tensor::make(bufs.back().data(), dt, shape.data(), static_cast<int>(shape.size()));
  }
};

Status read_as(const SafeTensorsReader& r, const std::string& name, DType dt, HostTensors& h, Tensor* out) {
  const SafeTensorInfo* info = r.find(name);
  if (!info) return Status::invalid_argument(r.path() + ": missing tensor " + name);
  *out = h.make(dt, info->shape);
  return r.read_into(name, *out);
}

// Gradients of the mean loss of the first batch of a shard, every parameter.
Status run_grad(const ModelArgs& a, const std::string& data, int64_t B, int64_t T, const std::string& out) {
  LoadedModel lm;
  LAPLACE_RETURN_IF_ERROR(load_model(a, &lm));
  const Config& c = lm.model.config();
  DataLoaderOptions dl;
  dl.shards = {data};
  dl.batch_size = B;
  dl.seq_len = T;
  dl.vocab_size = c.vocab_size;
  DataLoader loader;
  LAPLACE_RETURN_IF_ERROR(DataLoader::open(dl, &loader));
  std::vector<int32_t> x(B * T), y(B * T);
  loader.next(x.data(), y.data());
  LAPLACE_RETURN_IF_ERROR(lm.model.plan({B, T, true, false}));
  Arena grads;
  LAPLACE_RETURN_IF_ERROR(grads.create(weight_specs(c, lm.model.dtype()), lm.backend->allocator(), "gradients"));
  lm.model.forward(x.data(), B, T, ForwardOptions{});
  const double loss = lm.model.loss(y.data());
  lm.model.backward(y.data(), grads);
  std::vector<NamedTensor> named;
  for (size_t i = 0; i < grads.size(); ++i) named.push_back({grads.spec(i).name, grads.tensor(i)});
  std::printf("loss=%.9g\n", loss);
  return safetensors_write(out, named, {{"loss", std::to_string(loss)}});
}

// GLA forward + backward on given q, k, v [B,T,H,d], S0 [B,H,dk,dv], dO, decays [H].
Status run_gla(const std::string& in, const std::string& out, int64_t chunk, const std::string& dtype_name_) {
  DType dt;
  LAPLACE_RETURN_IF_ERROR(parse_dtype(dtype_name_, &dt));
  SafeTensorsReader r;
  LAPLACE_RETURN_IF_ERROR(SafeTensorsReader::open(in, &r));
  HostTensors h;
  Tensor q, k, v, s0, d_o, decay;
  LAPLACE_RETURN_IF_ERROR(read_as(r, "q", dt, h, &q));
  LAPLACE_RETURN_IF_ERROR(read_as(r, "k", dt, h, &k));
  LAPLACE_RETURN_IF_ERROR(read_as(r, "v", dt, h, &v));
  LAPLACE_RETURN_IF_ERROR(read_as(r, "s0", dt, h, &s0));
  LAPLACE_RETURN_IF_ERROR(read_as(r, "do", dt, h, &d_o));
  LAPLACE_RETURN_IF_ERROR(read_as(r, "decay", DType::kF64, h, &decay));
  if (q.ndim != 4 || k.ndim != 4 || v.ndim != 4 || s0.ndim != 4 || !same_shape(v, d_o))
    return Status::invalid_argument("gla: expected q,k [B,T,H,dk], v,do [B,T,H,dv], s0 [B,H,dk,dv]");
  GlaParams p;
  p.chunk = chunk;
  p.scale = 1.0 / std::sqrt(static_cast<double>(q.shape[3]));
  p.decay.assign(decay.ptr<double>(), decay.ptr<double>() + decay.numel());
  Tensor o = h.make(dt, {v.shape[0], v.shape[1], v.shape[2], v.shape[3]});
  Tensor s1 = h.make(dt, {s0.shape[0], s0.shape[1], s0.shape[2], s0.shape[3]});
  Tensor dq = h.make(dt, {q.shape[0], q.shape[1], q.shape[2], q.shape[3]});
  Tensor dk = h.make(dt, {k.shape[0], k.shape[1], k.shape[2], k.shape[3]});
  Tensor dv = h.make(dt, {v.shape[0], v.shape[1], v.shape[2], v.shape[3]});
  Tensor ds0 = h.make(dt, {s0.shape[0], s0.shape[1], s0.shape[2], s0.shape[3]});
  auto be = make_cpu_backend();
  be->gla_forward(p, q, k, v, o, s0, s1, {});
  be->gla_backward(p, q, k, v, s0, d_o, {}, dq, dk, dv, ds0);
  return safetensors_write(out, {{"o", o}, {"s_final", s1}, {"dq", dq}, {"dk", dk}, {"dv", dv}, {"ds0", ds0}}, {});
}

// Newton–Schulz (5 steps) of the tensor "G" into "O".
Status run_ns(const std::string& in, const std::string& out, int steps) {
  SafeTensorsReader r;
  LAPLACE_RETURN_IF_ERROR(SafeTensorsReader::open(in, &r));
  HostTensors h;
  Tensor g;
  LAPLACE_RETURN_IF_ERROR(read_as(r, "G", DType::kF32, h, &g));
  if (g.ndim != 2) return Status::invalid_argument("ns: G must be a matrix");
  Tensor o = h.make(DType::kF32, {g.shape[0], g.shape[1]});
  auto be = make_cpu_backend();
  NsScratch scratch;
  scratch.dtype = DType::kF32;
  scratch.plan(g.shape[0], g.shape[1]);
  LAPLACE_RETURN_IF_ERROR(scratch.allocate(be->allocator()));
  newton_schulz(*be, g, o, scratch, steps);
  return safetensors_write(out, {{"O", o}}, {});
}

}  // namespace

void add_debug(CLI::App& app) {
  auto* cmd = app.add_subcommand("debug", "single computations on files, for checking against the reference");
  cmd->require_subcommand(1);

  auto* grad = cmd->add_subcommand("grad", "gradients of the mean loss on a shard's first batch");
  struct G { ModelArgs m; std::string data, out; int64_t batch = 2, seq = 64; };
  auto g = std::make_shared<G>();
  g->m.add_to(grad);
  grad->add_option("--data", g->data, "token shard")->required();
  grad->add_option("--batch", g->batch, "B")->check(CLI::Range(1, 4096));
  grad->add_option("--seq", g->seq, "T")->check(CLI::Range(1, 1 << 20));
  grad->add_option("--out", g->out, "gradients .safetensors")->required();
  grad->callback([g] { g_exit_code = report(run_grad(g->m, g->data, g->batch, g->seq, g->out)); });

  auto* gla = cmd->add_subcommand("gla", "GLA forward+backward of q,k,v,s0,do,decay from a file");
  struct L { std::string in, out, dtype = "f32"; int64_t chunk = 128; };
  auto l = std::make_shared<L>();
  gla->add_option("--in", l->in, "inputs .safetensors")->required();
  gla->add_option("--out", l->out, "outputs .safetensors")->required();
  gla->add_option("--chunk", l->chunk, "chunk size")->check(CLI::Range(1, 1 << 16));
  gla->add_option("--dtype", l->dtype, "f32 or f64");
  gla->callback([l] { g_exit_code = report(run_gla(l->in, l->out, l->chunk, l->dtype)); });

  auto* ns = cmd->add_subcommand("ns", "Newton–Schulz orthogonalisation of tensor G");
  struct N { std::string in, out; int steps = 5; };
  auto n = std::make_shared<N>();
  ns->add_option("--in", n->in, "input .safetensors with G")->required();
  ns->add_option("--out", n->out, "output .safetensors with O")->required();
  ns->add_option("--steps", n->steps, "iterations")->check(CLI::Range(0, 100));
  ns->callback([n] { g_exit_code = report(run_ns(n->in, n->out, n->steps)); });
}

}  // namespace laplace::cli
