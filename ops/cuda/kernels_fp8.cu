// FP8 products (ops/backend.h's quantize_rows_e4m3, quantize_cols_e4m3 and gemm_e4m3) on CUDA.
//
// Quantisation keeps core/fp8.h's arithmetic (the scale e4m3_scale(max), each value times the
// scale's rounded reciprocal, rounded to nearest even and saturated by the SATFINITE conversion),
// so the codes and scales equal the CPU backend's bit for bit; the maxima are order-free, so how
// the kernels split the work does not change a bit. Each kernel is a plain pass over the operand,
// meant to run at memory speed, so the work per value is kept to a product and half a paired
// conversion (cvt.rn.satfinite.e4m3x2.f32: two values per instruction); a division per value
// would make the passes bound by their instructions. Rows whose alignment allows it move 16
// bytes per load and their codes 4 or 8 bytes per store, others take the same kernels one
// element at a time. The kernels are in ops/cuda/fp8_quant.cuh (shared with experiments/fp8/).
//
// Product: cuBLASLt's FP8 matmul wants its A transposed and its B not ("TN"): with our row-major
// X [M, K] and W [N, K] read column-major as Xᵀ [K, M] and Wᵀ [K, N], cuBLAS's A is W (op T) and
// its B is X (op N), and its D [N, M] column-major is our row-major Y [M, N]. Both operands carry
// one F32 scale per row of ours, cuBLASLt's "outer vector" scale mode (W's along its M, X's along
// its N). Split-K is excluded as for the other gemms, so a call's result does not depend on the
// algorithm's partitioning of K. A residual c is cuBLASLt's C operand (β = 1), added before the
// one rounding. Accumulation: F32 (cuBLASLt's default) or, with Fp8Accum::kFast, cuBLASLt's fast
// accumulation; the two are separate plans.
#include <cuda_fp8.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>

#include "ops/cuda/cuda_common.cuh"
#include "ops/cuda/fp8_quant.cuh"

namespace laplace {
namespace cuda {
namespace {

// Rows of x may move 16 bytes at a time: x's rows start 16-byte aligned and hold whole vectors.
template <typename T>
bool vector_rows(const void* x, int64_t ld, int64_t cols) {
  constexpr int64_t v = 16 / sizeof(T);
  return aligned16(x) && ld % v == 0 && cols % v == 0;
}

template <typename T, int V>
void launch_rows(const Tensor& x, int64_t ld, Tensor q, Tensor s, cudaStream_t st) {
  fp8_quant::launch_rows<T, V>(static_cast<const T*>(x.data), ld, x.shape[0], x.shape[1],
                               static_cast<__nv_fp8_storage_t*>(q.data), static_cast<float*>(s.data), st);
}

// The column passes; with q and s defined (kRows) the row codes and scales too.
template <typename T, int V, bool kRows>
void launch_cols(const Tensor& x, int64_t ld, Tensor qt, Tensor st, Tensor q, Tensor s, cudaStream_t stream) {
  fp8_quant::launch_cols<T, V, kRows>(static_cast<const T*>(x.data), ld, x.shape[0], x.shape[1],
                                      static_cast<__nv_fp8_storage_t*>(qt.data), static_cast<float*>(st.data),
                                      kRows ? static_cast<__nv_fp8_storage_t*>(q.data) : nullptr,
                                      kRows ? static_cast<float*>(s.data) : nullptr, stream);
}

// SwiGLU with W_3's input codes (swiglu_forward_e4m3): one block per row of ab [N, 2F] (BF16,
// F = 8·F8), thread t holding the 8-column chunks t + kSwiQThreads·i (i < NV) of h = SiLU(a)·b in
// registers, each value computed by swiglu_forward's swiglu_value and rounded to BF16 as it stores
// h; then the row's max |h| and its codes, as quantize_rows_e4m3 of that h computes them (the
// maximum is order-free, the scale, reciprocal and paired conversions are the same functions).
// h is not written: ab is read once and the codes written once.
constexpr int kSwiQThreads = 256;
constexpr int kSwiQMaxChunks = 4;  // F ≤ 8·256·4 = 8,192

template <int NV>
__global__ void __launch_bounds__(kSwiQThreads)
    swiglu_e4m3_kernel(const __nv_bfloat16* ab, int64_t ld, int F8, __nv_fp8_storage_t* q, float* s) {
  __shared__ float part[kSwiQThreads / 32];
  const int64_t r = blockIdx.x;
  const __nv_bfloat16* row = ab + r * ld;
  float h[NV][8];
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int c = threadIdx.x + kSwiQThreads * i;
    if (c >= F8) continue;
    float a[8], b[8];
    fp8_quant::load_vec<__nv_bfloat16, 8>(row + 8 * static_cast<int64_t>(c), a);
    fp8_quant::load_vec<__nv_bfloat16, 8>(row + 8 * static_cast<int64_t>(F8 + c), b);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      h[i][k] = __bfloat162float(__float2bfloat16_rn(swiglu_value(a[k], b[k])));
      amax = fmaxf(amax, fabsf(h[i][k]));
    }
  }
  amax = fp8_quant::warp_max(amax);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = amax;
  __syncthreads();
  float m = 0.f;
#pragma unroll
  for (int w = 0; w < kSwiQThreads / 32; ++w) m = fmaxf(m, part[w]);
  const float scale = fp8_quant::scale_of(m);
  if (threadIdx.x == 0) s[r] = scale;
  const float inv = 1.f / scale;
  __nv_fp8_storage_t* qr = q + r * 8 * static_cast<int64_t>(F8);
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int c = threadIdx.x + kSwiQThreads * i;
    if (c < F8) fp8_quant::store_row_codes<8>(h[i], inv, qr + 8 * static_cast<int64_t>(c));
  }
}

// w[r][c] = e4m3_dequantize(q[r][c], s[r]) (core/fp8.h; Backend::dequantize_rows_e4m3): a block
// per row at a time; a code's value is exact in half precision, and the F32 product is rounded
// once to T.
template <typename T>
__global__ void dequantize_rows_e4m3_kernel(const __nv_fp8_storage_t* q, const float* s, int64_t R, int64_t C, T* w) {
  for (int64_t r = blockIdx.x; r < R; r += gridDim.x) {
    const float sc = s[r];
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
      const float v = __half2float(__half(__nv_cvt_fp8_to_halfraw(q[r * C + c], __NV_E4M3))) * sc;
      if constexpr (std::is_same_v<T, float>) w[r * C + c] = v;
      else w[r * C + c] = __float2bfloat16_rn(v);
    }
  }
}

template <bool kRows>
void launch_cols_of(int dt, const Tensor& x, int64_t ld, Tensor qt, Tensor st, Tensor q, Tensor s,
                    cudaStream_t stream) {
  const int64_t C = x.shape[1];
  // The row codes of a thread's V columns go out as one 4- or 8-byte store.
  const bool q_ok = !kRows || reinterpret_cast<uintptr_t>(q.data) % 8 == 0;
  if (dt == kBF16) {
    if (q_ok && vector_rows<__nv_bfloat16>(x.data, ld, C))
      launch_cols<__nv_bfloat16, 8, kRows>(x, ld, qt, st, q, s, stream);
    else
      launch_cols<__nv_bfloat16, 1, kRows>(x, ld, qt, st, q, s, stream);
  } else {
    if (q_ok && vector_rows<float>(x.data, ld, C)) launch_cols<float, 4, kRows>(x, ld, qt, st, q, s, stream);
    else launch_cols<float, 1, kRows>(x, ld, qt, st, q, s, stream);
  }
}

}  // namespace

// The quantisers' operand x [R, C]: on the device, F32 or BF16, rows contiguous. Its float code.
inline int check_quant_input(const Tensor& x, const std::string& op) {
  check_device(x, (op + ": x").c_str());
  const int dt = float_code(x, (op + ": x").c_str());
  if (x.ndim != 2 || (x.shape[1] > 1 && x.stride[1] != 1))
    check_failed(__FILE__, __LINE__, op.c_str(), ("x must be 2-D with contiguous rows: x " + x.shape_str()).c_str());
  return dt;
}

// x's codes per row: q [R, C] F8_E4M3 and s [R].
inline void check_row_codes(const Tensor& x, const Tensor& q, const Tensor& s, const std::string& op) {
  check_e4m3_matrix(q, (op + ": q").c_str());
  if (!same_shape(x, q))
    check_failed(__FILE__, __LINE__, op.c_str(),
                 ("q must have x's shape: x " + x.shape_str() + ", q " + q.shape_str()).c_str());
  check_scales(s, x.shape[0], (op + ": s").c_str());
}

// x's codes per column, transposed: qt [C, R] F8_E4M3 and s [C].
inline void check_col_codes(const Tensor& x, const Tensor& qt, const Tensor& s, const std::string& op) {
  check_e4m3_matrix(qt, (op + ": qt").c_str());
  if (qt.shape[0] != x.shape[1] || qt.shape[1] != x.shape[0])
    check_failed(__FILE__, __LINE__, op.c_str(),
                 ("qt must have x's shape transposed: x " + x.shape_str() + ", qt " + qt.shape_str()).c_str());
  check_scales(s, x.shape[1], (op + ": s").c_str());
}

}  // namespace cuda

void CudaBackend::quantize_rows_e4m3(const Tensor& x, Tensor q, Tensor s) {
  const int dt = cuda::check_quant_input(x, "quantize_rows_e4m3");
  cuda::check_row_codes(x, q, s, "quantize_rows_e4m3");
  const int64_t R = x.shape[0], C = x.shape[1];
  if (R == 0 || C == 0) return;
  const int64_t ld = std::max<int64_t>(x.stride[0], C);
  const bool q8 = reinterpret_cast<uintptr_t>(q.data) % 8 == 0;
  if (dt == cuda::kBF16) {
    if (q8 && cuda::vector_rows<__nv_bfloat16>(x.data, ld, C)) cuda::launch_rows<__nv_bfloat16, 8>(x, ld, q, s, stream_);
    else cuda::launch_rows<__nv_bfloat16, 1>(x, ld, q, s, stream_);
  } else {
    if (q8 && cuda::vector_rows<float>(x.data, ld, C)) cuda::launch_rows<float, 4>(x, ld, q, s, stream_);
    else cuda::launch_rows<float, 1>(x, ld, q, s, stream_);
  }
  CUDA_CHECK_LAUNCH();
}

void CudaBackend::dequantize_rows_e4m3(const Tensor& q, const Tensor& s, Tensor w) {
  cuda::check_e4m3_matrix(q, "dequantize_rows_e4m3: q");
  cuda::check_scales(s, q.shape[0], "dequantize_rows_e4m3: s");
  cuda::check_device(w, "dequantize_rows_e4m3: w");
  const int dt = cuda::float_code(w, "dequantize_rows_e4m3: w");
  if (!same_shape(w, q) || !w.is_contiguous())
    check_failed(__FILE__, __LINE__, "dequantize_rows_e4m3",
                 ("w must be contiguous and of q's shape: q " + q.shape_str() + ", w " + w.shape_str()).c_str());
  const int64_t R = q.shape[0], C = q.shape[1];
  if (R == 0 || C == 0) return;
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(R, 65535));
  const auto* qp = static_cast<const __nv_fp8_storage_t*>(q.data);
  const auto* sp = static_cast<const float*>(s.data);
  if (dt == cuda::kBF16)
    cuda::dequantize_rows_e4m3_kernel<<<grid, 256, 0, stream_>>>(qp, sp, R, C, static_cast<__nv_bfloat16*>(w.data));
  else
    cuda::dequantize_rows_e4m3_kernel<<<grid, 256, 0, stream_>>>(qp, sp, R, C, static_cast<float*>(w.data));
  CUDA_CHECK_LAUNCH();
}

void CudaBackend::quantize_cols_e4m3(const Tensor& x, Tensor qt, Tensor s) {
  const int dt = cuda::check_quant_input(x, "quantize_cols_e4m3");
  cuda::check_col_codes(x, qt, s, "quantize_cols_e4m3");
  const int64_t C = x.shape[1];
  if (C == 0) return;  // no rows: every scale is 1, as on the CPU
  const int64_t ld = std::max<int64_t>(x.stride[0], C);
  cuda::launch_cols_of<false>(dt, x, ld, qt, s, Tensor{}, Tensor{}, stream_);
  CUDA_CHECK_LAUNCH();
}

void CudaBackend::quantize_rows_cols_e4m3(const Tensor& x, Tensor q, Tensor s, Tensor qt, Tensor st) {
  const int dt = cuda::check_quant_input(x, "quantize_rows_cols_e4m3");
  cuda::check_row_codes(x, q, s, "quantize_rows_cols_e4m3");
  cuda::check_col_codes(x, qt, st, "quantize_rows_cols_e4m3");
  const int64_t R = x.shape[0], C = x.shape[1];
  if (R == 0 || C == 0) {  // nothing to read: the two calls' conventions for empty operands
    quantize_rows_e4m3(x, q, s);
    quantize_cols_e4m3(x, qt, st);
    return;
  }
  const int64_t ld = std::max<int64_t>(x.stride[0], C);
  cuda::launch_cols_of<true>(dt, x, ld, qt, st, q, s, stream_);
  CUDA_CHECK_LAUNCH();
}

// The fused kernel where its layout holds (BF16 rows of whole 16-byte vectors, F ≤ 8,192, the
// codes 8-byte aligned), else the two ops.
void CudaBackend::swiglu_forward_e4m3(const Tensor& ab, Tensor h, Tensor q, Tensor s) {
  const cuda::RView vab = cuda::make_rview(ab, "swiglu_forward_e4m3: ab");
  const int64_t N = vab.rows, F = vab.cols / 2;
  cuda::check_e4m3_matrix(q, "swiglu_forward_e4m3: q");
  if (vab.cols != 2 * F || q.shape[0] != N || q.shape[1] != F || h.ndim != 2 || h.shape[0] != N || h.shape[1] != F)
    check_failed(__FILE__, __LINE__, "swiglu_forward_e4m3",
                 ("expected ab [N, 2F], h and q [N, F]: ab " + ab.shape_str() + ", h " + h.shape_str() + ", q " +
                  q.shape_str())
                     .c_str());
  cuda::check_scales(s, N, "swiglu_forward_e4m3: s");
  const int64_t F8 = F / 8, nv = (F8 + cuda::kSwiQThreads - 1) / cuda::kSwiQThreads;
  const bool layout = ab.ndim == 2 && vab.p && F > 0 && F % 8 == 0 && nv <= cuda::kSwiQMaxChunks && N <= 0x7fffffff;
  const bool bf16 = cuda::bf16_rows(vab) && h.dtype == DType::kBF16;
  const bool fused = layout && bf16 && reinterpret_cast<uintptr_t>(q.data) % 8 == 0;
  if (!fused) {
    Backend::swiglu_forward_e4m3(ab, h, q, s);
    return;
  }
  if (N == 0) return;
  const auto* x = static_cast<const __nv_bfloat16*>(ab.data);
  auto* qp = static_cast<__nv_fp8_storage_t*>(q.data);
  auto* sp = static_cast<float*>(s.data);
  const int64_t ld = ab.stride[0];
  const unsigned grid = static_cast<unsigned>(N);
  const int f8 = static_cast<int>(F8);
  switch (nv) {
    case 1: cuda::swiglu_e4m3_kernel<1><<<grid, cuda::kSwiQThreads, 0, stream_>>>(x, ld, f8, qp, sp); break;
    case 2: cuda::swiglu_e4m3_kernel<2><<<grid, cuda::kSwiQThreads, 0, stream_>>>(x, ld, f8, qp, sp); break;
    case 3: cuda::swiglu_e4m3_kernel<3><<<grid, cuda::kSwiQThreads, 0, stream_>>>(x, ld, f8, qp, sp); break;
    default: cuda::swiglu_e4m3_kernel<4><<<grid, cuda::kSwiQThreads, 0, stream_>>>(x, ld, f8, qp, sp); break;
  }
  CUDA_CHECK_LAUNCH();
}

CudaBackend::Fp8GemmPlan& CudaBackend::fp8_gemm_plan(int64_t M, int64_t N, int64_t K, DType out, bool fast,
                                                       const void* sw, const void* sx) {
  const std::array<int64_t, 5> key = {M, N, K, static_cast<int64_t>(out), fast ? 1 : 0};
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
  const int8_t fast_accum = fast ? 1 : 0;
  CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast_accum, sizeof(fast_accum)));
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
  p.ws_needed = res.workspaceSize;
  return fp8_plans_.emplace(key, p).first->second;
}

void CudaBackend::gemm_e4m3(const Tensor& xq, const Tensor& xs, const Tensor& wq, const Tensor& ws, const Tensor& c,
                            Tensor y, Fp8Accum accum) {
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
  Fp8GemmPlan& p = fp8_gemm_plan(M, N, K, y.dtype, accum == Fp8Accum::kFast, sw, sx);
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sw, sizeof(sw)));
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sx, sizeof(sx)));
  // D = α·(W·X) + β·C with C = c (β = 1) or none (β = 0: C is not read).
  const float one = 1.f, beta = c.defined() ? 1.f : 0.f;
  const void* cin = c.defined() ? c.data : y.data;
  GemmLaunch g = gemm_launch_begin(p.ws_needed);
  CUBLAS_CHECK(cublasLtMatmul(lt_, p.desc, &one, wq.data, p.lw, xq.data, p.lx, &beta, cin, p.ly, y.data, p.ly,
                              &p.algo, g.ws, g.ws_bytes, stream_));
  gemm_launch_end(std::move(g));
}

}  // namespace laplace
