// GLA decode step on CUDA (SPEC §1, recurrent form, T = 1), optionally fused with the
// mixer's output gate. Per sequence b and head h, with state S [dk, dv] in slot slots[b]:
//   S ← λ_h S + kᵀ v          (in place)
//   o = (scale·q) S           [dv]
//   y = RMSNorm(o; w) ⊙ SiLU(g)   (fused gate only)
//
// Decode is bound by the state traffic (1.18 MB per sequence per layer for laplace-3b in
// F32, read once and written once), so the kernel is a stream over the state: one block per
// (b, h); thread (rg, c) owns columns [4c, 4c+4) of the rows of row group rg (four groups of
// ⌈dk/4⌉ consecutive rows), loads 8 rows' worth of 16-byte (F32) or 8-byte (BF16) vectors
// before using any of them, and keeps its part of o in registers. The four partial outputs
// are added in group order through shared memory, so the result is a fixed function of the
// inputs (bitwise reproducible, independent of the batch and of the other slots).
//
// The gate epilogue reproduces rmsnorm_gate_fwd_kernel (kernels_norm.cu) operation for
// operation, o rounded to its dtype first, so fused and unfused decode give the same bits.
#include <string>

#include "ops/cuda/cuda_common.cuh"

namespace laplace {
namespace cuda {

namespace {

constexpr int kDecMaxHeads = 128;
constexpr int kDecMaxDk = 128;
constexpr int kDecMaxDv = 256;
constexpr int kDecGroups = 4;  // row groups per block
constexpr int kDecUnroll = 8;  // rows loaded before any is used

struct DecArgs {
  int B, H, dk, dv;
  float scale;
  float lam[kDecMaxHeads];
  // q, k, v, g, o, y: element (b, h, i) at p + b·sb + h·sh + i (T = 1).
  const void* q;
  const void* k;
  const void* v;
  const void* g;
  void* o;
  void* y;
  int q_dt, k_dt, v_dt, g_dt, o_dt, y_dt;
  int64_t q_sb, q_sh, k_sb, k_sh, v_sb, v_sh, g_sb, g_sh, o_sb, o_sh, y_sb, y_sh;
  const void* w;  // [dv] gate norm weight (may be null: 1)
  int w_dt;
  float eps;
  // States: element (slot, h, i, e) at p + slot·ss + h·sh + i·sk + e.
  const void* s_in;  // null: zero initial state
  void* s_out;       // null: not stored
  int64_t ss, sh, sk;
  const int32_t* slots;  // null: slot = b
};

struct F4 {
  float x, y, z, w;
};

__device__ __forceinline__ F4 load4(const float* p) {
  const float4 t = *reinterpret_cast<const float4*>(p);
  return {t.x, t.y, t.z, t.w};
}
__device__ __forceinline__ F4 load4(const __nv_bfloat16* p) {
  const uint2 t = *reinterpret_cast<const uint2*>(p);
  const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&t.x));
  const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&t.y));
  return {a.x, a.y, b.x, b.y};
}
__device__ __forceinline__ void store4(float* p, F4 v) { *reinterpret_cast<float4*>(p) = make_float4(v.x, v.y, v.z, v.w); }
__device__ __forceinline__ void store4(__nv_bfloat16* p, F4 v) {
  const __nv_bfloat162 a = __floats2bfloat162_rn(v.x, v.y), b = __floats2bfloat162_rn(v.z, v.w);
  uint2 t;
  t.x = *reinterpret_cast<const uint32_t*>(&a);
  t.y = *reinterpret_cast<const uint32_t*>(&b);
  *reinterpret_cast<uint2*>(p) = t;
}

// x rounded to dtype dt and back (what a store followed by a load gives).
__device__ __forceinline__ float round_to(float x, int dt) {
  return dt == kBF16 ? __bfloat162float(__float2bfloat16_rn(x)) : x;
}

template <class ST, bool kGate>
__global__ void __launch_bounds__(kDecGroups * kDecMaxDv / 4) gla_decode_kernel(DecArgs a) {
  __shared__ float qs[kDecMaxDk], ks[kDecMaxDk];
  __shared__ float part[kDecGroups][kDecMaxDv];
  __shared__ float rstd_s;
  const int b = blockIdx.x / a.H, h = blockIdx.x - b * a.H;
  const int nq = a.dv >> 2;
  const int tid = threadIdx.x, c = tid % nq, rg = tid / nq;
  for (int i = tid; i < a.dk; i += blockDim.x) {
    qs[i] = a.scale * ldf(a.q, b * a.q_sb + h * a.q_sh + i, a.q_dt);
    ks[i] = ldf(a.k, b * a.k_sb + h * a.k_sh + i, a.k_dt);
  }
  const int64_t vo = b * a.v_sb + h * a.v_sh + 4 * c;
  const float v0 = ldf(a.v, vo, a.v_dt), v1 = ldf(a.v, vo + 1, a.v_dt), v2 = ldf(a.v, vo + 2, a.v_dt),
              v3 = ldf(a.v, vo + 3, a.v_dt);
  __syncthreads();

  const int64_t slot = a.slots ? a.slots[b] : b;
  const int64_t base = slot * a.ss + h * a.sh + 4 * c;
  const ST* src = a.s_in ? static_cast<const ST*>(a.s_in) + base : nullptr;
  ST* dst = a.s_out ? static_cast<ST*>(a.s_out) + base : nullptr;
  const float lam = a.lam[h];
  const int rows = (a.dk + kDecGroups - 1) / kDecGroups;
  const int r0 = rg * rows, r1 = min(a.dk, r0 + rows);
  F4 acc = {0.f, 0.f, 0.f, 0.f};
  for (int i0 = r0; i0 < r1; i0 += kDecUnroll) {
    F4 s[kDecUnroll];
#pragma unroll
    for (int u = 0; u < kDecUnroll; ++u)
      s[u] = (src && i0 + u < r1) ? load4(src + (i0 + u) * a.sk) : F4{0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int u = 0; u < kDecUnroll; ++u) {
      const int i = i0 + u;
      if (i >= r1) break;
      const float kk = ks[i], qq = qs[i];
      s[u].x = fmaf(lam, s[u].x, kk * v0);
      s[u].y = fmaf(lam, s[u].y, kk * v1);
      s[u].z = fmaf(lam, s[u].z, kk * v2);
      s[u].w = fmaf(lam, s[u].w, kk * v3);
      if (dst) store4(dst + i * a.sk, s[u]);
      acc.x = fmaf(qq, s[u].x, acc.x);
      acc.y = fmaf(qq, s[u].y, acc.y);
      acc.z = fmaf(qq, s[u].z, acc.z);
      acc.w = fmaf(qq, s[u].w, acc.w);
    }
  }
  part[rg][4 * c] = acc.x;
  part[rg][4 * c + 1] = acc.y;
  part[rg][4 * c + 2] = acc.z;
  part[rg][4 * c + 3] = acc.w;
  __syncthreads();
  // o_e = Σ_rg part[rg][e] in group order; rounded to o's dtype (as stored).
  for (int e = tid; e < a.dv; e += blockDim.x) {
    float x = part[0][e];
#pragma unroll
    for (int g = 1; g < kDecGroups; ++g) x += part[g][e];
    if (a.o) stf(a.o, b * a.o_sb + h * a.o_sh + e, a.o_dt, x);
    part[0][e] = round_to(x, a.o_dt);
  }
  if constexpr (!kGate) return;
  __syncthreads();
  // rmsnorm_gate_fwd_kernel's order: lane l sums columns l, l+32, ... then a butterfly.
  if (tid < 32) {
    float ss = 0.f;
    for (int e = tid; e < a.dv; e += 32) ss += part[0][e] * part[0][e];
    const float r = 1.0f / sqrtf(warp_sum(ss) / static_cast<float>(a.dv) + a.eps);
    if (tid == 0) rstd_s = r;
  }
  __syncthreads();
  const float r = rstd_s;
  for (int e = tid; e < a.dv; e += blockDim.x) {
    const float gv = ldf(a.g, b * a.g_sb + h * a.g_sh + e, a.g_dt);
    float y = part[0][e] * r * gv * sigmoidf_(gv);
    if (a.w) y *= ldf(a.w, e, a.w_dt);
    stf(a.y, b * a.y_sb + h * a.y_sh + e, a.y_dt, y);
  }
}

// q/k/v/g/o/y as [B, 1, H, d] views with the last dim contiguous; false if not.
bool act_view(const Tensor& t, int64_t B, int64_t H, int64_t d, const void** p, int* dt, int64_t* sb, int64_t* sh) {
  if (!t.defined()) return true;
  if (t.device != Device::kCUDA || (t.dtype != DType::kF32 && t.dtype != DType::kBF16)) return false;
  if (t.ndim != 4 || t.shape[0] != B || t.shape[1] != 1 || t.shape[2] != H || t.shape[3] != d || t.stride[3] != 1)
    return false;
  *p = t.data;
  *dt = t.dtype == DType::kBF16 ? kBF16 : kF32;
  *sb = t.stride[0];
  *sh = t.stride[2];
  return true;
}

bool aligned(const void* p, int64_t bytes) { return reinterpret_cast<uintptr_t>(p) % static_cast<uintptr_t>(bytes) == 0; }

}  // namespace

// The decode fast path (see the file comment). Returns false, having queued nothing, when the
// arguments are outside it: T != 1, dk > 128, dv not a multiple of 4 or > 256, states
// not F32/BF16, state rows not aligned to 4 elements, or s_in and s_out of different dtypes.
bool gla_decode_forward(CudaBackend& be, const GlaParams& p, const Tensor& q, const Tensor& k, const Tensor& v,
                        Tensor o, const Tensor& s_in, Tensor s_out, const Tensor& slots, const Tensor* g,
                        const Tensor* w, double eps, Tensor* y) {
  if (q.ndim != 4 || v.ndim != 4 || q.shape[1] != 1) return false;
  DecArgs a{};
  a.B = static_cast<int>(q.shape[0]);
  a.H = static_cast<int>(q.shape[2]);
  a.dk = static_cast<int>(q.shape[3]);
  a.dv = static_cast<int>(v.shape[3]);
  if (q.shape[0] >= (1LL << 31) || a.H < 1 || a.H > kDecMaxHeads || a.dk < 1 || a.dk > kDecMaxDk || a.dv < 4 ||
      a.dv > kDecMaxDv || a.dv % 4 != 0 || static_cast<int64_t>(p.decay.size()) != a.H ||
      static_cast<int64_t>(a.B) * a.H >= (1LL << 31))
    return false;
  const void* po = nullptr;
  if (!act_view(q, a.B, a.H, a.dk, &a.q, &a.q_dt, &a.q_sb, &a.q_sh) ||
      !act_view(k, a.B, a.H, a.dk, &a.k, &a.k_dt, &a.k_sb, &a.k_sh) ||
      !act_view(v, a.B, a.H, a.dv, &a.v, &a.v_dt, &a.v_sb, &a.v_sh) ||
      !act_view(o, a.B, a.H, a.dv, &po, &a.o_dt, &a.o_sb, &a.o_sh))
    return false;
  a.o = const_cast<void*>(po);
  if (!a.q || !a.k || !a.v) return false;
  const bool gate = y != nullptr;
  if (gate) {
    const void* pg = nullptr;
    const void* py = nullptr;
    if (!g || !act_view(*g, a.B, a.H, a.dv, &pg, &a.g_dt, &a.g_sb, &a.g_sh) || !pg ||
        !act_view(*y, a.B, a.H, a.dv, &py, &a.y_dt, &a.y_sb, &a.y_sh) || !py)
      return false;
    a.g = pg;
    a.y = const_cast<void*>(py);
    if (w && w->defined()) {
      if (w->device != Device::kCUDA || w->numel() != a.dv || !w->is_contiguous() ||
          (w->dtype != DType::kF32 && w->dtype != DType::kBF16))
        return false;
      a.w = w->data;
      a.w_dt = w->dtype == DType::kBF16 ? kBF16 : kF32;
    }
    a.eps = static_cast<float>(eps);
  }
  // States: one dtype, same layout for in and out, rows aligned for vector access.
  const Tensor& ref = s_in.defined() ? s_in : s_out;
  DType sdt = DType::kF32;
  if (ref.defined()) {
    sdt = ref.dtype;
    if (sdt != DType::kF32 && sdt != DType::kBF16) return false;
    for (const Tensor* t : {&s_in, static_cast<const Tensor*>(&s_out)}) {
      if (!t->defined()) continue;
      if (t->device != Device::kCUDA || t->dtype != sdt || t->ndim != 4 || t->shape[1] != a.H ||
          t->shape[2] != a.dk || t->shape[3] != a.dv || t->stride[3] != 1 || t->stride[0] != ref.stride[0] ||
          t->stride[1] != ref.stride[1] || t->stride[2] != ref.stride[2])
        return false;
      if (t->stride[0] % 4 || t->stride[1] % 4 || t->stride[2] % 4 || !aligned(t->data, 4 * dtype_size(sdt)))
        return false;
    }
    a.ss = ref.stride[0];
    a.sh = ref.stride[1];
    a.sk = ref.stride[2];
  }
  a.s_in = s_in.defined() ? s_in.data : nullptr;
  a.s_out = s_out.defined() ? s_out.data : nullptr;
  if (slots.defined()) {
    LAPLACE_CHECK(slots.device == Device::kCUDA && slots.dtype == DType::kI32 && slots.numel() == a.B &&
                      slots.is_contiguous(),
                  "gla decode: slots must be I32 [B] on the GPU");
    a.slots = static_cast<const int32_t*>(slots.data);
  } else if (ref.defined()) {
    LAPLACE_CHECK(ref.shape[0] >= a.B, "gla decode: fewer states than batch rows");
  }
  a.scale = static_cast<float>(p.scale);
  for (int h = 0; h < a.H; ++h) a.lam[h] = static_cast<float>(p.decay[h]);
  if (a.B == 0) return true;
  const unsigned grid = static_cast<unsigned>(a.B * a.H), threads = static_cast<unsigned>(kDecGroups * (a.dv / 4));
  cudaStream_t st = be.stream();
  if (sdt == DType::kBF16) {
    if (gate) gla_decode_kernel<__nv_bfloat16, true><<<grid, threads, 0, st>>>(a);
    else gla_decode_kernel<__nv_bfloat16, false><<<grid, threads, 0, st>>>(a);
  } else {
    if (gate) gla_decode_kernel<float, true><<<grid, threads, 0, st>>>(a);
    else gla_decode_kernel<float, false><<<grid, threads, 0, st>>>(a);
  }
  CUDA_CHECK_LAUNCH();
  return true;
}

}  // namespace cuda

void CudaBackend::gla_decode_gate(const GlaParams& p, const Tensor& q, const Tensor& k, const Tensor& v,
                                  const Tensor& g, const Tensor& w, double eps, Tensor states, const Tensor& slots,
                                  Tensor o, Tensor y) {
  if (cuda::gla_decode_forward(*this, p, q, k, v, o, states, states, slots, &g, &w, eps, &y)) return;
  Backend::gla_decode_gate(p, q, k, v, g, w, eps, states, slots, o, y);
}

}  // namespace laplace
