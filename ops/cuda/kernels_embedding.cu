// The embedding lookup and its backward, which sums each id's gradient rows in token order
// without atomics (a stable radix sort of the ids, then one fold per run of equal ids).
#include <cub/device/device_radix_sort.cuh>

#include "ops/cuda/row_common.cuh"
#include "ops/cuda/state_vec.cuh"

namespace laplace {
namespace cuda {

// out[n, :] = table[ids[n], :]  (a zero row for ids outside [0, V)). One block per row.
// ids [N], table [V,D], out [N,D]
__global__ void embedding_fwd_kernel(const int32_t* ids, RView table, RView out) {
  const int64_t n = blockIdx.x;
  const int64_t D = out.cols;
  const int32_t id = ids[n];
  const bool ok = id >= 0 && id < table.rows;
  const int64_t ot = ok ? table.row(id) : 0, oo = out.row(n);
  for (int64_t c = threadIdx.x; c < D; c += blockDim.x)
    stf(out.p, oo + c, out.dt, ok ? ldf(table.p, ot + c, table.dt) : 0.f);
}

// dtable[ids[n], c] += dout[n, c], bitwise the sequential loop's result (every table element
// takes its terms in token order, rounded to its dtype after each) and without atomics. A
// stable radix sort of the ids (CUB) puts each id's tokens together in token order; a run of
// equal ids is then folded in a register and stored once. Folding, not a read-modify-write
// through memory per token, is what lets a frequent token's long run keep many loads in flight.
constexpr int kEmbRunTile = 128;  // sorted positions per block: a block owns the runs starting there

// keys[n] = ids[n], or V for an id out of range (skipped, as the sequential loop skips it);
// vals[n] = n.
__global__ void embedding_keys_kernel(const int32_t* ids, int64_t N, int32_t V, uint32_t* keys, int32_t* vals) {
  const int64_t n = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (n >= N) return;
  const int32_t id = ids[n];
  keys[n] = id >= 0 && id < V ? static_cast<uint32_t>(id) : static_cast<uint32_t>(V);
  vals[n] = static_cast<int32_t>(n);
}

// Block (bx, y): columns [256·bx, 256·bx + 256) of tiles y, y + gridDim.y, …. A tile is the
// runs of keys that start in sorted positions [tile·K, tile·K + K): a run may end past them, and
// the run that started before them is an earlier tile's. keys/vals sorted by key, stably;
// dout [N, D]; dtab [V, D].
__global__ void embedding_bwd_runs_kernel(const uint32_t* keys, const int32_t* vals, int64_t N, RView dout,
                                          RView dtab) {
  const int64_t c = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (c >= dtab.cols) return;
  const uint32_t V = static_cast<uint32_t>(dtab.rows);
  for (int64_t tile = blockIdx.y; tile * kEmbRunTile < N; tile += gridDim.y) {
    int64_t j = tile * kEmbRunTile;
    const int64_t tile_end = min(j + kEmbRunTile, N);
    while (j < tile_end && j > 0 && keys[j] == keys[j - 1]) ++j;
    while (j < tile_end) {
      const uint32_t id = keys[j];
      int64_t e = j + 1;
      while (e < N && keys[e] == id) ++e;
      if (id < V) {
        const int64_t o = dtab.row(id) + c;
        float acc = ldf(dtab.p, o, dtab.dt);
#pragma unroll 8
        for (int64_t k = j; k < e; ++k)
          acc = round_to(acc + ldf(dout.p, dout.row(vals[k]) + c, dout.dt), dtab.dt);
        stf(dtab.p, o, dtab.dt, acc);
      }
      j = e;
    }
  }
}

}  // namespace cuda

using namespace cuda;

void CudaBackend::embedding_forward(const Tensor& ids, const Tensor& table, Tensor out) {
  RView vt = make_rview(table, "embedding: table"), vo = make_rview(out, "embedding: out");
  const int32_t* pid = i32_vec(ids, vo.rows, "embedding: ids must be I32 [N]");
  LAPLACE_CHECK(vt.cols == vo.cols, "embedding_forward: table and out widths differ");
  if (vo.rows == 0) return;
  LAPLACE_CHECK(vo.rows <= 0x7fffffff, "embedding_forward: too many rows");
  embedding_fwd_kernel<<<static_cast<unsigned>(vo.rows), 256, 0, stream_>>>(pid, vt, vo);
  CUDA_CHECK_LAUNCH();
}

void CudaBackend::embedding_backward(const Tensor& ids, const Tensor& dout, Tensor dtable) {
  RView vd = make_rview(dout, "embedding: dout"), vt = make_rview(dtable, "embedding: dtable");
  const int32_t* pid = i32_vec(ids, vd.rows, "embedding: ids must be I32 [N]");
  LAPLACE_CHECK(vt.cols == vd.cols, "embedding_backward: dtable and dout widths differ");
  if (vd.rows == 0 || vd.cols == 0) return;
  LAPLACE_CHECK(vd.rows <= 0x7fffffff && vt.rows < 0x7fffffff, "embedding_backward: too many rows");
  const int N = static_cast<int>(vd.rows);
  const int32_t V = static_cast<int32_t>(vt.rows);
  int end_bit = 1;  // keys are 0..V (V: out of range)
  while (end_bit < 32 && (uint64_t{1} << end_bit) <= static_cast<uint64_t>(V)) ++end_bit;
  size_t sort_bytes = 0;
  CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, sort_bytes, static_cast<const uint32_t*>(nullptr),
                                             static_cast<uint32_t*>(nullptr), static_cast<const int32_t*>(nullptr),
                                             static_cast<int32_t*>(nullptr), N, 0, end_bit, stream_));
  const size_t vec = (static_cast<size_t>(N) * 4 + 255) / 256 * 256;
  char* base = static_cast<char*>(scratch(4 * vec + sort_bytes));
  auto* keys_in = reinterpret_cast<uint32_t*>(base);
  auto* keys = reinterpret_cast<uint32_t*>(base + vec);
  auto* vals_in = reinterpret_cast<int32_t*>(base + 2 * vec);
  auto* vals = reinterpret_cast<int32_t*>(base + 3 * vec);
  embedding_keys_kernel<<<(N + 255) / 256, 256, 0, stream_>>>(pid, N, V, keys_in, vals_in);
  CUDA_CHECK_LAUNCH();
  CUDA_CHECK(cub::DeviceRadixSort::SortPairs(base + 4 * vec, sort_bytes, keys_in, keys, vals_in, vals, N, 0, end_bit,
                                             stream_));
  const int64_t tiles = (N + kEmbRunTile - 1) / kEmbRunTile;
  dim3 grid(static_cast<unsigned>((vd.cols + 255) / 256), static_cast<unsigned>(std::min<int64_t>(tiles, 65535)));
  embedding_bwd_runs_kernel<<<grid, 256, 0, stream_>>>(keys, vals, N, vd, vt);
  CUDA_CHECK_LAUNCH();
}

}  // namespace laplace
