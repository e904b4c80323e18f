#pragma once
// One summation order for a step's loss that a GPU computes in parallel and a host
// reproduces to the bit: lane t of kFixedSumLanes adds the elements t, t + lanes,
// t + 2·lanes, … in index order (in double), then the lanes are folded pairwise in a fixed
// tree (lane t += lane t + w for w = lanes/2, …, 1). Model::loss, CpuBackend::loss_sum_into
// and the CUDA loss_sum kernel all follow it, so the loss a training step queues on the
// device equals the host's Model::loss exactly, and no backend sums one element at a time
// on one GPU thread.

#include <cstdint>

namespace laplace {

inline constexpr int kFixedSumLanes = 1024;

// get(i) is element i as a double.
template <typename Get>
double fixed_order_sum(int64_t n, Get get) {
  double lane[kFixedSumLanes] = {};
  for (int64_t i = 0; i < n; ++i) lane[i % kFixedSumLanes] += get(i);
  for (int w = kFixedSumLanes / 2; w > 0; w >>= 1)
    for (int t = 0; t < w; ++t) lane[t] += lane[t + w];
  return lane[0];
}

}  // namespace laplace
