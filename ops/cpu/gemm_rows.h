// Row-invariant products for the CPU backend's forward projections:
//   C[M,N] = alpha·A[M,K]·B[N,K]ᵀ + beta·C   (row-major, inner strides 1)
// Element (m, n) is always the chain acc ← fma(A[m][k], B[n][k], acc) for k = 0, 1, …, K−1
// from acc = 0, then alpha·acc (+ beta·C[m][n]), whatever M is, wherever row m sits in the
// batch and whichever path (AVX-512, AVX2 or portable) runs it: an IEEE fma rounds once, in
// a vector lane or in std::fma alike. So a sequence's activations do not depend on the other
// rows of its batch (docs/serving.md §5); OpenBLAS's sgemm picks kernels by M and row
// position, which changes the bits. Parallel over column panels and row blocks with OpenMP;
// the thread count does not change any element's arithmetic either.
#pragma once

#include <cstdint>

namespace laplace::cpu {

template <class T>
void gemm_rows(int64_t M, int64_t N, int64_t K, T alpha, const T* a, int64_t lda, const T* b, int64_t ldb, T beta,
               T* c, int64_t ldc);

// Tests: the path gemm_rows takes from now on (kBest, the default: the widest the CPU has).
// Returns false, changing nothing, where the CPU or the build lacks it. Every path gives the
// same bits. Not for use concurrently with gemm_rows calls.
enum class GemmPath { kBest, kPortable, kAvx2, kAvx512 };
bool gemm_rows_select(GemmPath path);

}  // namespace laplace::cpu
