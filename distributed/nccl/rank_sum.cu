#include "distributed/nccl/rank_sum.h"

#include <cuda_bf16.h>


namespace laplace {

namespace {

// One thread per element; the loop over ranks is the whole order of the sum.
template <class T>
__global__ void rank_sum_kernel(const T* __restrict__ parts, int P, int64_t n, T* out, bool accumulate) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    T acc = parts[i];
    for (int q = 1; q < P; ++q) acc = acc + parts[q * n + i];
    out[i] = accumulate ? out[i] + acc : acc;
  }
}

__global__ void rank_sum_bf16_kernel(const __nv_bfloat16* __restrict__ parts, int P, int64_t n,
                                     __nv_bfloat16* out, bool accumulate) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    float acc = __bfloat162float(parts[i]);
    for (int q = 1; q < P; ++q) acc = __fadd_rn(acc, __bfloat162float(parts[q * n + i]));
    __nv_bfloat16 sum = __float2bfloat16_rn(acc);  // the host rounds the sum first, then adds
    out[i] = accumulate ? __float2bfloat16_rn(__fadd_rn(__bfloat162float(out[i]), __bfloat162float(sum))) : sum;
  }
}

}  // namespace

cudaError_t rank_sum_launch(const void* parts, int P, int64_t n, void* out, int type, bool accumulate,
                            cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  constexpr int kThreads = 256;
  int64_t g = (n + kThreads - 1) / kThreads;
  if (g > 132 * 16) g = 132 * 16;
  const unsigned grid = static_cast<unsigned>(g);
  switch (type) {  // distributed/comm.h's CommType values (checked where it is called)
    case 0:  // kF32
      rank_sum_kernel<float><<<grid, kThreads, 0, stream>>>(static_cast<const float*>(parts), P, n,
                                                            static_cast<float*>(out), accumulate);
      break;
    case 1:  // kF64
      rank_sum_kernel<double><<<grid, kThreads, 0, stream>>>(static_cast<const double*>(parts), P, n,
                                                             static_cast<double*>(out), accumulate);
      break;
    case 3:  // kI64
      rank_sum_kernel<long long><<<grid, kThreads, 0, stream>>>(static_cast<const long long*>(parts), P, n,
                                                                static_cast<long long*>(out), accumulate);
      break;
    case 2:  // kBF16
      rank_sum_bf16_kernel<<<grid, kThreads, 0, stream>>>(static_cast<const __nv_bfloat16*>(parts), P, n,
                                                          static_cast<__nv_bfloat16*>(out), accumulate);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace laplace
