// The backend's tensor-core fast path of GLA forward and backward: checks that a call fits the
// kernels of ops/cuda/gla_tc.cuh (head dims 96 and 192, bf16 inputs, 16-byte aligned rows) and
// launches them.
#include "ops/cuda/gla_tc.cuh"

// ---- host side: the backend's fast path ------------------------------------------------------------
namespace laplace {
namespace cuda {
namespace {

constexpr int kTcDk = 96, kTcDv = 192;

bool aligned16(const Tensor& t) {
  return (reinterpret_cast<uintptr_t>(t.data) & 15) == 0 && t.stride[0] % 8 == 0 && t.stride[1] % 8 == 0 &&
         t.stride[2] % 8 == 0 && t.stride[3] == 1;
}
// A [B,T,H,d] activation the kernels may read with 16-byte loads / write in pairs.
bool tc_act_ok(const Tensor& t, bool need_bf16) {
  if (!t.defined()) return true;
  if (t.device != Device::kCUDA || t.ndim != 4 || !aligned16(t)) return false;
  if (need_bf16) return t.dtype == DType::kBF16;
  return t.dtype == DType::kBF16 || t.dtype == DType::kF32;
}
// An F32 state view read/written in float2 pairs.
bool tc_state_ok(const Tensor& t) {
  if (!t.defined()) return true;
  return (reinterpret_cast<uintptr_t>(t.data) & 7) == 0 && t.stride[0] % 2 == 0 && t.stride[1] % 2 == 0 &&
         t.stride[2] % 2 == 0 && t.stride[3] == 1;
}
// The fast path covers the model's head dims with bf16 inputs and sequences of at least 32
// tokens (decode steps and tiny prefills stay on the one-launch generic kernel).
bool tc_shape_ok(const Tensor& q, const Tensor& v) {
  return q.ndim == 4 && v.ndim == 4 && q.shape[3] == kTcDk && v.shape[3] == kTcDv && q.shape[1] >= 32 &&
         q.shape[0] * q.shape[2] <= 65535 && q.shape[2] <= gla_tc::kMaxHeads;
}

// A [B,T,H,d] tensor as the kernels' input (gla_tc::Act) or output (gla_tc::OutV) view; an
// undefined tensor gives a null view.
template <class View>
View tc_view(const Tensor& t) {
  View a;
  if (!t.defined()) return a;
  a.p = t.data;
  a.dt = t.dtype == DType::kBF16 ? gla_tc::kBF16 : gla_tc::kF32;
  a.sb = t.stride[0];
  a.st = t.stride[1];
  a.sh = t.stride[2];
  return a;
}
gla_tc::Act tc_act(const Tensor& t) { return tc_view<gla_tc::Act>(t); }
gla_tc::OutV tc_out(const Tensor& t) { return tc_view<gla_tc::OutV>(t); }
gla_tc::StV tc_state(const Tensor& t) {
  gla_tc::StV s;
  if (!t.defined()) return s;
  s.p = static_cast<float*>(t.data);
  s.ss = t.stride[0];
  s.sh = t.stride[1];
  s.sk = t.stride[2];
  return s;
}
// GlaParams::doc as the kernels' pointer (checked by the caller, kernels_gla.cu); null without one.
const int32_t* tc_doc(const GlaParams& p) { return p.doc.defined() ? static_cast<const int32_t*>(p.doc.data) : nullptr; }

gla_tc::Args tc_args(const GlaParams& p, const Tensor& q) {
  gla_tc::Args a{};
  a.B = static_cast<int>(q.shape[0]);
  a.T = static_cast<int>(q.shape[1]);
  a.H = static_cast<int>(q.shape[2]);
  a.N = (a.T + gla_tc::kC - 1) / gla_tc::kC;
  a.scale = static_cast<float>(p.scale);
  for (int h = 0; h < a.H; ++h) a.lam[h] = p.decay[h];
  a.doc = tc_doc(p);
  return a;
}

// The forward's launches; VARLEN picks the kernels' instances with document resets (a.doc set).
template <bool VARLEN>
void tc_forward_launch(CudaBackend& be, const gla_tc::Args& a, const Tensor& q, const Tensor& k, const Tensor& v,
                       Tensor o, const Tensor& s_in, Tensor s_out, const int32_t* ps, __nv_bfloat16* states,
                       float* gend) {
  constexpr int DK = kTcDk, DV = kTcDv;
  cudaStream_t stream = be.stream();
  constexpr int st_smem = gla_tc::state_smem_bytes<DK, DV, VARLEN>(), fo_smem = gla_tc::fwd_smem_bytes<DK, DV, VARLEN>();
  constexpr auto scan = gla_tc::state_kernel<DK, DV, false, gla_tc::kOutHiLo, true, VARLEN>;
  constexpr auto out = gla_tc::fwd_o_kernel<DK, DV, VARLEN>;
  be.kernel_smem(scan, st_smem);
  be.kernel_smem(out, fo_smem);
  const dim3 sgrid(DV / gla_tc::kSlice, a.B * a.H * a.G);
  scan<<<sgrid, gla_tc::kStateThreads, st_smem, stream>>>(a, tc_act(k), tc_act(v), tc_state(s_in), ps,
                                                           tc_state(s_out), states, gend);
  CUDA_CHECK_LAUNCH();
  if (a.G > 1) {
    gla_tc::group_fix_kernel<DK, DV><<<gla_tc::fix_grid<DK, DV>(a), gla_tc::kFixThreads, 0, stream>>>(
        a, ps, tc_state(s_out), states, gend);
    CUDA_CHECK_LAUNCH();
  }
  const unsigned cgrid = static_cast<unsigned>(static_cast<int64_t>(a.B) * a.H * a.N);
  out<<<cgrid, gla_tc::kThreads, fo_smem, stream>>>(a, tc_act(q), tc_act(k), tc_act(v), tc_out(o), states);
  CUDA_CHECK_LAUNCH();
}

// One of the backward's scans (REV: the gradient's, into ds_in; else the states', from s_in),
// its states as one bf16 plane in `plane`. Split (a.G > 1): the groups' relative states go to
// `rel` as hi/lo planes and their end states to gend, and group_fix_kernel writes `plane` and
// the final state (see the top of gla_tc.cuh).
template <bool REV, bool VARLEN>
void tc_backward_scan(CudaBackend& be, const gla_tc::Args& a, const Tensor& x, const Tensor& y, const Tensor& s0,
                      const Tensor& sfin, __nv_bfloat16* plane, __nv_bfloat16* rel, float* gend) {
  constexpr int DK = kTcDk, DV = kTcDv;
  cudaStream_t stream = be.stream();
  constexpr int st_smem = gla_tc::state_smem_bytes<DK, DV, VARLEN>();
  const dim3 sgrid(DV / gla_tc::kSlice, a.B * a.H * a.G);
  if (a.G == 1) {
    constexpr auto scan = gla_tc::state_kernel<DK, DV, REV, gla_tc::kOutHi, false, VARLEN>;
    be.kernel_smem(scan, st_smem);
    scan<<<sgrid, gla_tc::kStateThreads, st_smem, stream>>>(a, tc_act(x), tc_act(y), tc_state(s0), nullptr,
                                                             tc_state(sfin), plane, nullptr);
    CUDA_CHECK_LAUNCH();
    return;
  }
  constexpr auto scan = gla_tc::state_kernel<DK, DV, REV, gla_tc::kOutHiLo, false, VARLEN>;
  be.kernel_smem(scan, st_smem);
  scan<<<sgrid, gla_tc::kStateThreads, st_smem, stream>>>(a, tc_act(x), tc_act(y), tc_state(s0), nullptr,
                                                           gla_tc::StV{}, rel, gend);
  CUDA_CHECK_LAUNCH();
  gla_tc::group_fix_kernel<DK, DV, REV, true><<<gla_tc::fix_grid<DK, DV>(a, true), gla_tc::kFixThreads, 0, stream>>>(
      a, nullptr, tc_state(sfin), rel, gend, plane);
  CUDA_CHECK_LAUNCH();
}

template <bool VARLEN>
void tc_backward_launch(CudaBackend& be, const gla_tc::Args& a, const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& s_in, const Tensor& d_o, const Tensor& ds_out, Tensor dq, Tensor dk, Tensor dv,
                        Tensor ds_in) {
  constexpr int DK = kTcDk, DV = kTcDv;
  const int64_t nstate = static_cast<int64_t>(a.B) * a.H * a.N * DK * DV;
  const int64_t ngend = a.G > 1 ? static_cast<int64_t>(a.B) * a.H * a.G * DK * DV : 0;
  // bf16 S_n then bf16 G_n, scans without the hi/lo split (the backward's budget allows one
  // rounding of the weighted rows and one of the stored states); split scans add the groups'
  // relative states as hi/lo planes (shared by the two scans, which run one after the other)
  // and their f32 end states
  const size_t bytes = static_cast<size_t>(2 * nstate) * 2 + (a.G > 1 ? static_cast<size_t>(2 * nstate) * 2 : 0) +
                       static_cast<size_t>(ngend) * 4;
  char* scratch = static_cast<char*>(be.scratch(bytes));
  __nv_bfloat16* sst = reinterpret_cast<__nv_bfloat16*>(scratch);
  __nv_bfloat16* gst = sst + nstate;
  __nv_bfloat16* rel = a.G > 1 ? gst + nstate : nullptr;
  float* gend = a.G > 1 ? reinterpret_cast<float*>(scratch + 4 * nstate * 2) : nullptr;
  cudaStream_t stream = be.stream();
  constexpr int dv_smem = gla_tc::bwd_dv_smem_bytes<DK, DV, VARLEN>(),
                dqk_smem = gla_tc::bwd_dqk_smem_bytes<DK, DV, VARLEN>();
  const unsigned cgrid = static_cast<unsigned>(static_cast<int64_t>(a.B) * a.H * a.N);
  if (dq.defined()) tc_backward_scan<false, VARLEN>(be, a, k, v, s_in, Tensor{}, sst, rel, gend);
  if (dk.defined() || dv.defined() || ds_in.defined())
    tc_backward_scan<true, VARLEN>(be, a, q, d_o, ds_out, ds_in, gst, rel, gend);
  if (dq.defined() || dk.defined()) {
    constexpr auto kern = gla_tc::bwd_dqk_kernel<DK, DV, VARLEN>;
    be.kernel_smem(kern, dqk_smem);
    kern<<<cgrid, gla_tc::kThreads, dqk_smem, stream>>>(a, tc_act(q), tc_act(k), tc_act(v), tc_act(d_o), tc_out(dq),
                                                        tc_out(dk), sst, gst);
    CUDA_CHECK_LAUNCH();
  }
  if (dv.defined()) {
    constexpr auto kern = gla_tc::bwd_dv_kernel<DK, DV, VARLEN>;
    be.kernel_smem(kern, dv_smem);
    kern<<<cgrid, gla_tc::kThreads, dv_smem, stream>>>(a, tc_act(q), tc_act(k), tc_act(d_o), tc_out(dv), gst);
    CUDA_CHECK_LAUNCH();
  }
}

}  // namespace

bool gla_tc_forward(CudaBackend& be, const GlaParams& p, const Tensor& q, const Tensor& k, const Tensor& v, Tensor o,
                    const Tensor& s_in, Tensor s_out, const Tensor& slots) {
  if (!tc_shape_ok(q, v) || !tc_act_ok(q, true) || !tc_act_ok(k, true) || !tc_act_ok(v, true) ||
      !tc_act_ok(o, false) || !tc_state_ok(s_in) || !tc_state_ok(s_out))
    return false;
  constexpr int DK = kTcDk, DV = kTcDv;
  gla_tc::Args a = tc_args(p, q);
  if (a.B == 0) return true;
  // Few long sequences (a B = 1 prefill): the state scan walks G chunk groups in parallel,
  // then group_fix_kernel carries the state across them.
  gla_tc::plan_groups(a, DV / gla_tc::kSlice);
  const int64_t nstate = static_cast<int64_t>(a.B) * a.H * a.N * DK * DV;
  const int64_t ngend = a.G > 1 ? static_cast<int64_t>(a.B) * a.H * a.G * DK * DV : 0;
  // S_n as bf16 hi/lo planes (fp32-exact; see the precision note at the top), then each
  // group's f32 end state
  char* scratch = static_cast<char*>(be.scratch(static_cast<size_t>(2 * nstate) * 2 + static_cast<size_t>(ngend) * 4));
  __nv_bfloat16* states = reinterpret_cast<__nv_bfloat16*>(scratch);
  float* gend = ngend ? reinterpret_cast<float*>(scratch + 2 * nstate * 2) : nullptr;
  const int32_t* ps = slots.defined() ? static_cast<const int32_t*>(slots.data) : nullptr;
  if (a.doc) tc_forward_launch<true>(be, a, q, k, v, o, s_in, s_out, ps, states, gend);
  else tc_forward_launch<false>(be, a, q, k, v, o, s_in, s_out, ps, states, gend);
  return true;
}

bool gla_tc_backward(CudaBackend& be, const GlaParams& p, const Tensor& q, const Tensor& k, const Tensor& v,
                     const Tensor& s_in, const Tensor& d_o, const Tensor& ds_out, Tensor dq, Tensor dk, Tensor dv,
                     Tensor ds_in) {
  if (!tc_shape_ok(q, v) || !tc_act_ok(q, true) || !tc_act_ok(k, true) || !tc_act_ok(v, true) ||
      !tc_act_ok(d_o, true) || !tc_act_ok(dq, false) || !tc_act_ok(dk, false) || !tc_act_ok(dv, false) ||
      !tc_state_ok(s_in) || !tc_state_ok(ds_out) || !tc_state_ok(ds_in))
    return false;
  constexpr int DV = kTcDv;
  gla_tc::Args a = tc_args(p, q);
  if (a.B == 0) return true;
  // Few long sequences: both scans walk chunk groups in parallel (not at training shapes,
  // whose scans fill the GPU; see plan_groups).
  gla_tc::plan_groups(a, DV / gla_tc::kSlice, gla_tc::kBwdScanFill);
  if (a.doc) tc_backward_launch<true>(be, a, q, k, v, s_in, d_o, ds_out, dq, dk, dv, ds_in);
  else tc_backward_launch<false>(be, a, q, k, v, s_in, d_o, ds_out, dq, dk, dv, ds_in);
  return true;
}

}  // namespace cuda
}  // namespace laplace
