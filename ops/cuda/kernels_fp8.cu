// FP8 products (ops/backend.h's quantize_rows_e4m3, quantize_cols_e4m3 and gemm_e4m3) on CUDA.
//
// Quantisation: one block per row finds max |x| and writes the row's codes with the same
// arithmetic as core/fp8.h's e4m3_quantize_row (the scale max/448, each value divided by it,
// rounded to nearest even and saturated by __nv_cvt_float_to_fp8's SATFINITE), so F32 rows give
// the CPU backend's codes and scales bit for bit.
//
// Product: cuBLASLt's FP8 matmul wants its A transposed and its B not ("TN"): with our row-major
// X [M, K] and W [N, K] read column-major as Xᵀ [K, M] and Wᵀ [K, N], cuBLAS's A is W (op T) and
// its B is X (op N), and its D [N, M] column-major is our row-major Y [M, N]. Both operands carry
// one F32 scale per row of ours, cuBLASLt's "outer vector" scale mode (W's along its M, X's along
// its N). Accumulation is cuBLASLt's default (not the fast-accumulation mode), and split-K is
// excluded as for the other gemms, so a call's result does not depend on the algorithm's
// partitioning of K. A residual c is cuBLASLt's C operand (β = 1), added before the one rounding.
#include <cuda_fp8.h>

#include <string>

#include "ops/cuda/cuda_common.cuh"

namespace laplace {
namespace cuda {
namespace {

constexpr int kQuantThreads = 256;

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__global__ void quantize_rows_e4m3_kernel(const void* x, int dt, int64_t ld, int64_t cols, __nv_fp8_storage_t* q,
                                          float* s) {
  __shared__ float sh[32];
  __shared__ float scale;
  const int64_t r = blockIdx.x;
  const int64_t base = r * ld;
  float amax = 0.f;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) amax = fmaxf(amax, fabsf(ldf(x, base + c, dt)));
  amax = warp_max(amax);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) sh[warp] = amax;
  __syncthreads();
  if (warp == 0) {
    float m = lane < (blockDim.x + 31) / 32 ? sh[lane] : 0.f;
    m = warp_max(m);
    if (lane == 0) {
      scale = m > 0.f ? m / 448.f : 1.f;
      s[r] = scale;
    }
  }
  __syncthreads();
  const float sc = scale;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
    q[r * cols + c] = __nv_cvt_float_to_fp8(ldf(x, base + c, dt) / sc, __NV_SATFINITE, __NV_E4M3);
}

}  // namespace

// Per column, written transposed (quantize_cols_e4m3): one block of 32 × 8 threads per 32 columns.
// First each column's max |x| over every row (a warp reads 32 adjacent columns of a row), then the
// codes through a 32 × 33 shared tile, so that both the reads of x and the writes of qt's rows are
// adjacent addresses. The arithmetic is the row kernel's: scale max/448, each value divided by it.
constexpr int kColTile = 32, kColRowsPerPass = 8;

__global__ void quantize_cols_e4m3_kernel(const void* x, int dt, int64_t ld, int64_t rows, int64_t cols,
                                          __nv_fp8_storage_t* qt, float* s) {
  __shared__ float part[kColRowsPerPass][kColTile];
  __shared__ float scale[kColTile];
  __shared__ float tile[kColTile][kColTile + 1];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * kColTile, c = c0 + tx;
  float amax = 0.f;
  if (c < cols)
    for (int64_t r = ty; r < rows; r += kColRowsPerPass) amax = fmaxf(amax, fabsf(ldf(x, r * ld + c, dt)));
  part[ty][tx] = amax;
  __syncthreads();
  if (ty == 0) {
    float m = part[0][tx];
    for (int i = 1; i < kColRowsPerPass; ++i) m = fmaxf(m, part[i][tx]);
    const float sc = m > 0.f ? m / 448.f : 1.f;
    scale[tx] = sc;
    if (c < cols) s[c] = sc;
  }
  __syncthreads();
  for (int64_t r0 = 0; r0 < rows; r0 += kColTile) {
    for (int i = ty; i < kColTile; i += kColRowsPerPass) {
      const int64_t r = r0 + i;
      tile[i][tx] = r < rows && c < cols ? ldf(x, r * ld + c, dt) : 0.f;
    }
    __syncthreads();
    for (int j = ty; j < kColTile; j += kColRowsPerPass) {
      const int64_t cc = c0 + j, r = r0 + tx;
      if (cc < cols && r < rows)
        qt[cc * rows + r] = __nv_cvt_float_to_fp8(tile[tx][j] / scale[j], __NV_SATFINITE, __NV_E4M3);
    }
    __syncthreads();
  }
}

inline void check_e4m3_matrix(const Tensor& t, const char* what) {
  check_device(t, what);
  if (t.dtype != DType::kF8E4M3 || t.ndim != 2 || !t.is_contiguous())
    check_failed(__FILE__, __LINE__, what,
                 (std::string("expected a contiguous 2-D F8_E4M3 tensor, got ") + t.shape_str()).c_str());
}

inline void check_scales(const Tensor& t, int64_t n, const char* what) {
  check_device(t, what);
  if (t.dtype != DType::kF32 || t.ndim != 1 || t.shape[0] != n || !t.is_contiguous())
    check_failed(__FILE__, __LINE__, what,
                 (std::string("expected contiguous F32 [") + std::to_string(n) + "], got " + t.shape_str()).c_str());
}


}  // namespace cuda

void CudaBackend::quantize_rows_e4m3(const Tensor& x, Tensor q, Tensor s) {
  cuda::check_device(x, "quantize_rows_e4m3: x");
  const int dt = cuda::float_code(x, "quantize_rows_e4m3: x");
  cuda::check_e4m3_matrix(q, "quantize_rows_e4m3: q");
  if (x.ndim != 2 || !same_shape(x, q) || (x.shape[1] > 1 && x.stride[1] != 1))
    check_failed(__FILE__, __LINE__, "quantize_rows_e4m3",
                 ("x must be 2-D with contiguous rows and q's shape: x " + x.shape_str() + ", q " + q.shape_str())
                     .c_str());
  const int64_t R = x.shape[0], C = x.shape[1];
  cuda::check_scales(s, R, "quantize_rows_e4m3: s");
  if (R == 0 || C == 0) return;
  const int64_t ld = std::max<int64_t>(x.stride[0], C);
  cuda::quantize_rows_e4m3_kernel<<<static_cast<unsigned>(R), cuda::kQuantThreads, 0, stream_>>>(
      x.data, dt, ld, C, static_cast<__nv_fp8_storage_t*>(q.data), static_cast<float*>(s.data));
  CUDA_CHECK_LAUNCH();
}

void CudaBackend::quantize_cols_e4m3(const Tensor& x, Tensor qt, Tensor s) {
  cuda::check_device(x, "quantize_cols_e4m3: x");
  const int dt = cuda::float_code(x, "quantize_cols_e4m3: x");
  cuda::check_e4m3_matrix(qt, "quantize_cols_e4m3: qt");
  if (x.ndim != 2 || qt.shape[0] != x.shape[1] || qt.shape[1] != x.shape[0] || (x.shape[1] > 1 && x.stride[1] != 1))
    check_failed(__FILE__, __LINE__, "quantize_cols_e4m3",
                 ("x must be 2-D with contiguous rows and qt its shape transposed: x " + x.shape_str() + ", qt " +
                  qt.shape_str())
                     .c_str());
  const int64_t R = x.shape[0], C = x.shape[1];
  cuda::check_scales(s, C, "quantize_cols_e4m3: s");
  if (C == 0) return;  // no rows: every scale is 1, as on the CPU
  const int64_t ld = std::max<int64_t>(x.stride[0], C);
  const dim3 block(cuda::kColTile, cuda::kColRowsPerPass);
  const unsigned grid = static_cast<unsigned>((C + cuda::kColTile - 1) / cuda::kColTile);
  cuda::quantize_cols_e4m3_kernel<<<grid, block, 0, stream_>>>(x.data, dt, ld, R, C,
                                                              static_cast<__nv_fp8_storage_t*>(qt.data),
                                                              static_cast<float*>(s.data));
  CUDA_CHECK_LAUNCH();
}

CudaBackend::Fp8GemmPlan& CudaBackend::fp8_gemm_plan(int64_t M, int64_t N, int64_t K, DType out, const void* sw,
                                                       const void* sx) {
  const std::array<int64_t, 4> key = {M, N, K, static_cast<int64_t>(out)};
  auto it = fp8_plans_.find(key);
  if (it != fp8_plans_.end()) return it->second;
  Fp8GemmPlan p;
  CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t op_w = CUBLAS_OP_T, op_x = CUBLAS_OP_N;
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_w, sizeof(op_w)));
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_x, sizeof(op_x)));
  const int32_t vec = CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &vec, sizeof(vec)));
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &vec, sizeof(vec)));
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sw, sizeof(sw)));
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sx, sizeof(sx)));
  const cudaDataType_t ty = out == DType::kBF16 ? CUDA_R_16BF : CUDA_R_32F;
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.lw, CUDA_R_8F_E4M3, K, N, K));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.lx, CUDA_R_8F_E4M3, K, M, K));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.ly, ty, N, M, N));
  cublasLtMatmulPreference_t pref = gemm_preference();
  cublasLtMatmulHeuristicResult_t res{};
  int found = 0;
  const cublasStatus_t st =
      cublasLtMatmulAlgoGetHeuristic(lt_, p.desc, p.lw, p.lx, p.ly, p.ly, pref, 1, &res, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (st != CUBLAS_STATUS_SUCCESS || found == 0) {
    cublasLtMatrixLayoutDestroy(p.lw);
    cublasLtMatrixLayoutDestroy(p.lx);
    cublasLtMatrixLayoutDestroy(p.ly);
    cublasLtMatmulDescDestroy(p.desc);
    const std::string msg = "gemm_e4m3: cuBLASLt has no FP8 algorithm for M=" + std::to_string(M) +
                            " N=" + std::to_string(N) + " K=" + std::to_string(K) + " (" +
                            cublasLtGetStatusName(st) + ")";
    check_failed(__FILE__, __LINE__, "cublasLtMatmulAlgoGetHeuristic", msg.c_str());
  }
  p.algo = res.algo;
  return fp8_plans_.emplace(key, p).first->second;
}

void CudaBackend::gemm_e4m3(const Tensor& xq, const Tensor& xs, const Tensor& wq, const Tensor& ws, const Tensor& c,
                            Tensor y) {
  cuda::check_e4m3_matrix(xq, "gemm_e4m3: xq");
  cuda::check_e4m3_matrix(wq, "gemm_e4m3: wq");
  cuda::check_device(y, "gemm_e4m3: y");
  cuda::float_code(y, "gemm_e4m3: y");
  const int64_t M = xq.shape[0], K = xq.shape[1], N = wq.shape[0];
  if (wq.shape[1] != K || y.ndim != 2 || y.shape[0] != M || y.shape[1] != N || !y.is_contiguous())
    check_failed(__FILE__, __LINE__, "gemm_e4m3",
                 ("expected xq [M, K], wq [N, K] and a contiguous y [M, N]: xq " + xq.shape_str() + ", wq " +
                  wq.shape_str() + ", y " + y.shape_str())
                     .c_str());
  if (c.defined()) {
    cuda::check_device(c, "gemm_e4m3: c");
    if (!same_shape(c, y) || c.dtype != y.dtype || !c.is_contiguous() || !cuda::aligned16(c.data))
      check_failed(__FILE__, __LINE__, "gemm_e4m3",
                   ("c must be contiguous and 16-byte aligned with y's shape and dtype: c " + c.shape_str() + ", y " +
                    y.shape_str())
                       .c_str());
  }
  cuda::check_scales(xs, M, "gemm_e4m3: xs");
  cuda::check_scales(ws, N, "gemm_e4m3: ws");
  if (K % 16 != 0 || N % 16 != 0 || !cuda::aligned16(xq.data) || !cuda::aligned16(wq.data) ||
      !cuda::aligned16(y.data))
    check_failed(__FILE__, __LINE__, "gemm_e4m3",
                 ("cuBLASLt's FP8 layouts need K and N multiples of 16 and 16-byte aligned operands: K=" +
                  std::to_string(K) + ", N=" + std::to_string(N))
                     .c_str());
  if (M == 0 || N == 0) return;
  const void* sw = ws.data;
  const void* sx = xs.data;
  Fp8GemmPlan& p = fp8_gemm_plan(M, N, K, y.dtype, sw, sx);
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sw, sizeof(sw)));
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sx, sizeof(sx)));
  // D = α·(W·X) + β·C with C = c (β = 1) or none (β = 0: C is not read).
  const float one = 1.f, beta = c.defined() ? 1.f : 0.f;
  const void* cin = c.defined() ? c.data : y.data;
  CUBLAS_CHECK(cublasLtMatmul(lt_, p.desc, &one, wq.data, p.lw, xq.data, p.lx, &beta, cin, p.ly, y.data, p.ly,
                              &p.algo, workspace_, workspace_bytes_, stream_));
}

}  // namespace laplace
