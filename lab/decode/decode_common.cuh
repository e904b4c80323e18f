// Shared pieces of the lab/decode versions: the kernel arguments (the production DecArgs of
// ops/cuda/kernels_gla_decode.cu without the gate fields), the dtype-coded loads/stores and
// state-vector helpers copied from the production sources, the deterministic initial states,
// and thin inline-PTX wrappers for the Hopper bulk copies and mbarriers used by v2 and v3.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>

#include "../../ops/cuda/bulk_copy.cuh"

namespace decode_lab {

constexpr int kF32 = 0;
constexpr int kBF16 = 1;

constexpr int kDecMaxHeads = 128;
constexpr int kDecMaxDk = 128;
constexpr int kDecMaxDv = 256;

struct DecArgs {
  int B, H, dk, dv;
  float scale;
  float lam[kDecMaxHeads];
  // q, k, v, o: element (b, h, i) at p + b·sb + h·sh + i (T = 1).
  const void* q;
  const void* k;
  const void* v;
  void* o;
  int q_dt, k_dt, v_dt, o_dt;
  int64_t q_sb, q_sh, k_sb, k_sh, v_sb, v_sh, o_sb, o_sh;
  // States: element (slot, h, i, e) at p + slot·ss + h·sh + i·sk + e. The lab steps in place
  // (s_in == s_out), as the model does.
  const void* s_in;
  void* s_out;
  int64_t ss, sh, sk;
  const int32_t* slots;  // null: slot = b
};

// The labs' arguments for B sequences × H heads: q, k, v BF16 and o F32, each contiguous
// [B, H, d]; states contiguous [slots, H, dk, dv]; λ from 0.95 to 0.99 across the heads;
// scale 1/√dk. The pointers are the caller's to set (slots null: slot = b).
inline DecArgs lab_args(int B, int H, int dk, int dv) {
  DecArgs a{};
  a.B = B, a.H = H, a.dk = dk, a.dv = dv;
  a.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(dk)));
  for (int h = 0; h < H; ++h) a.lam[h] = 0.95f + 0.04f * h / (H - 1);
  a.q_dt = a.k_dt = a.v_dt = kBF16;
  a.o_dt = kF32;
  a.q_sb = a.k_sb = static_cast<int64_t>(H) * dk, a.q_sh = a.k_sh = dk;
  a.v_sb = a.o_sb = static_cast<int64_t>(H) * dv, a.v_sh = a.o_sh = dv;
  a.sk = dv, a.sh = static_cast<int64_t>(dk) * dv, a.ss = a.sh * H;
  return a;
}

// ops/cuda/cuda_common.cuh's dtype-coded scalar access.
__device__ __forceinline__ float ldf(const void* p, int64_t i, int dt) {
  if (dt == kBF16) return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
  return static_cast<const float*>(p)[i];
}
__device__ __forceinline__ void stf(void* p, int64_t i, int dt, float x) {
  if (dt == kBF16) static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(x);
  else static_cast<float*>(p)[i] = x;
}

// The production kernel's 4-column state vectors (16 bytes of F32, 8 of BF16); the pointers
// may be global or shared.
__device__ __forceinline__ void load_vec(const float* p, float* x) {
  const float4 t = *reinterpret_cast<const float4*>(p);
  x[0] = t.x, x[1] = t.y, x[2] = t.z, x[3] = t.w;
}
__device__ __forceinline__ void load_vec(const __nv_bfloat16* p, float* x) {
  const uint2 t = *reinterpret_cast<const uint2*>(p);
  const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&t.x));
  const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&t.y));
  x[0] = a.x, x[1] = a.y, x[2] = b.x, x[3] = b.y;
}
__device__ __forceinline__ void store_vec(float* p, const float* x) {
  *reinterpret_cast<float4*>(p) = make_float4(x[0], x[1], x[2], x[3]);
}
__device__ __forceinline__ void store_vec(__nv_bfloat16* p, const float* x) {
  const __nv_bfloat162 a = __floats2bfloat162_rn(x[0], x[1]), b = __floats2bfloat162_rn(x[2], x[3]);
  uint2 t;
  t.x = *reinterpret_cast<const uint32_t*>(&a);
  t.y = *reinterpret_cast<const uint32_t*>(&b);
  *reinterpret_cast<uint2*>(p) = t;
}

// The labs' host-side generator (q, k, v and sample picks): a 64-bit LCG, uniform in [0, 1).
struct Rng {
  uint64_t s;
  double uniform() {
    s = s * 6364136223846793005ULL + 1442695040888963407ULL;
    return static_cast<double>(s >> 11) * (1.0 / 9007199254740992.0);
  }
};

// Initial state element `idx` (the flat index into [slots, H, dk, dv]) in [-1, 1): the CPU
// reference recomputes any element from its index, so no host copy of the (GB-sized) states is
// needed. Every float operation is exact (24-bit integer · 2⁻²³ − 1), so host and device agree
// bit for bit, FMA contraction or not.
__host__ __device__ inline float state_init(uint64_t idx) {
  uint64_t z = idx * 0x9e3779b97f4a7c15ULL + 0x632be59bd9b4e019ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  z ^= z >> 31;
  return static_cast<float>(static_cast<uint32_t>(z >> 40)) * 0x1p-23f - 1.0f;
}

template <class ST>
__global__ void init_states(ST* s, uint64_t n) {
  for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n; i += (uint64_t)gridDim.x * blockDim.x)
    s[i] = static_cast<ST>(state_init(i));  // BF16: round to nearest even, as the host's f2bf
}

// Number of 16-byte words that differ between a and b (the full-state bit comparison).
__global__ void count_diff(const uint4* a, const uint4* b, uint64_t n, unsigned long long* cnt) {
  unsigned long long c = 0;
  for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n; i += (uint64_t)gridDim.x * blockDim.x) {
    const uint4 x = a[i], y = b[i];
    c += (x.x != y.x) | (x.y != y.y) | (x.z != y.z) | (x.w != y.w);
  }
  if (c) atomicAdd(cnt, c);
}

// ---- Hopper bulk copies and mbarriers: production's wrappers (ops/cuda/bulk_copy.cuh), except
// the wait, which here gives up after 2 s: a wrong parity or a copy never issued then costs an
// error message instead of a hung GPU.
using laplace::cuda::bulk_commit;
using laplace::cuda::bulk_g2s;
using laplace::cuda::bulk_s2g;
using laplace::cuda::bulk_wait_read;
using laplace::cuda::fence_barrier_init;
using laplace::cuda::fence_proxy_async;
using laplace::cuda::mbar_arrive_expect_tx;
using laplace::cuda::mbar_init;
using laplace::cuda::mbar_try_wait;

__device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
// Until the phase of parity `parity` has completed; the caller makes sure the barrier is
// never two phases ahead of the waiter (see v3's comment).
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  if (mbar_try_wait(bar, parity)) return;
  const uint64_t t0 = globaltimer_ns();
  while (!mbar_try_wait(bar, parity)) {
    if (globaltimer_ns() - t0 > 2000000000ull) {
      printf("decode_lab: mbarrier wait timed out (block %d, thread %d, parity %u)\n", static_cast<int>(blockIdx.x),
             static_cast<int>(threadIdx.x), parity);
      __trap();
    }
  }
}

}  // namespace decode_lab
