// CUDA_CHECK / CUBLAS_CHECK: a failing CUDA runtime or cuBLAS(Lt) call is a bug or a
// broken machine, never user input, so it prints file:line, the call, the error name and
// string and a hint, then aborts (like LAPLACE_CHECK in core/check.h).
//
// Kernel launches are checked with CUDA_CHECK_LAUNCH() right after the <<<...>>> line;
// that only catches launch-configuration errors, since kernels run asynchronously: a fault
// inside a kernel surfaces at a later CUDA call (the hint says how to locate it).
#pragma once

#include <cstdio>
#include <cstdlib>

#include <cublasLt.h>
#include <cuda_runtime.h>

namespace laplace::cuda_detail {

inline const char* cuda_hint(cudaError_t e) {
  switch (e) {
    case cudaErrorMemoryAllocation:
      return "out of device memory: reduce the batch (tokens per micro-batch) or the state pool size";
    case cudaErrorNoKernelImageForDevice:
    case cudaErrorInvalidDeviceFunction:
      return "no kernel image for this GPU: laplace's kernels are built for sm_90a (H100/H200); "
             "reconfigure with -DCMAKE_CUDA_ARCHITECTURES matching the device";
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchFailure:
    case cudaErrorMisalignedAddress:
    case cudaErrorIllegalInstruction:
      return "a kernel faulted (possibly an earlier, asynchronous one): rerun with "
             "CUDA_LAUNCH_BLOCKING=1 or under compute-sanitizer to find it";
    case cudaErrorInvalidConfiguration:
      return "bad launch configuration (grid, block or shared-memory size)";
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
      return "no usable GPU or driver on this machine";
    case cudaErrorStreamCaptureUnsupported:
    case cudaErrorStreamCaptureInvalidated:
      return "an operation that cannot be captured ran inside a CUDA graph capture";
    default:
      return "errors of asynchronous work surface at a later call: rerun with CUDA_LAUNCH_BLOCKING=1";
  }
}

[[noreturn]] inline void cuda_failed(const char* file, int line, const char* expr, const char* name,
                                     const char* msg, const char* hint) {
  std::fprintf(stderr, "%s:%d: CUDA call failed: %s\n  error: %s (%s)\n  hint: %s\n", file, line, expr,
               name, msg, hint);
  std::fflush(stderr);
  std::abort();
}

inline const char* cublas_hint(cublasStatus_t s) {
  switch (s) {
    case CUBLAS_STATUS_NOT_SUPPORTED:
      return "this dtype/layout/alignment combination has no cuBLASLt kernel (see the gemm rules in "
             "ops/cuda/cuda_backend.h)";
    case CUBLAS_STATUS_INVALID_VALUE:
      return "a bad argument (leading dimension, shape, or a missing workspace)";
    case CUBLAS_STATUS_ALLOC_FAILED:
      return "cuBLAS could not allocate memory";
    case CUBLAS_STATUS_EXECUTION_FAILED:
      return "the GPU kernel failed to launch or run: rerun with CUDA_LAUNCH_BLOCKING=1";
    default:
      return "see the cuBLAS documentation for this status";
  }
}

}  // namespace laplace::cuda_detail

#define CUDA_CHECK(expr)                                                                        \
  do {                                                                                          \
    cudaError_t laplace_cuda_e_ = (expr);                                                       \
    if (laplace_cuda_e_ != cudaSuccess)                                                         \
      ::laplace::cuda_detail::cuda_failed(__FILE__, __LINE__, #expr,                            \
                                          cudaGetErrorName(laplace_cuda_e_),                    \
                                          cudaGetErrorString(laplace_cuda_e_),                  \
                                          ::laplace::cuda_detail::cuda_hint(laplace_cuda_e_));  \
  } while (0)

#define CUBLAS_CHECK(expr)                                                                      \
  do {                                                                                          \
    cublasStatus_t laplace_cublas_s_ = (expr);                                                  \
    if (laplace_cublas_s_ != CUBLAS_STATUS_SUCCESS)                                             \
      ::laplace::cuda_detail::cuda_failed(__FILE__, __LINE__, #expr,                            \
                                          cublasLtGetStatusName(laplace_cublas_s_),             \
                                          cublasLtGetStatusString(laplace_cublas_s_),           \
                                          ::laplace::cuda_detail::cublas_hint(laplace_cublas_s_)); \
  } while (0)

// After a <<<...>>> launch: catches bad configurations (not faults inside the kernel).
#define CUDA_CHECK_LAUNCH() CUDA_CHECK(cudaGetLastError())
