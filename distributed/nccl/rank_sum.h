// The device half of the NCCL communicator's reductions (distributed/nccl/rank_sum.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace laplace {

// out[i] = Σ_q parts[q·n + i] in rank order (acc = part₀; acc = acc + part₁; …), the
// host's sum_in_rank_order on the device: F32/F64/I64 add in their own type, BF16 in F32
// rounded once (to nearest even). `type` is a CommType value (0 F32, 1 F64, 2 BF16,
// 3 I64; this .cu file is compiled as C++17 and does not include distributed/comm.h). Queued
// on `stream`. out may be parts itself (each element is read before it is written).
// With accumulate, out[i] = out[i] + sum (the sum rounded to the type first, as on the host).
cudaError_t rank_sum_launch(const void* parts, int P, int64_t n, void* out, int type, bool accumulate,
                            cudaStream_t stream);

}  // namespace laplace
