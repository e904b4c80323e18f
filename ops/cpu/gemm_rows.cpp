// Row-invariant forward products (ops/cpu/gemm_rows.h).
//
// Blocking (after GotoBLAS, kept simple): B is packed one panel of NR columns (two vectors) at
// a time, [K][NR], into a per-thread buffer; a micro-kernel keeps up to kMr rows × NR columns
// of accumulators in registers and runs k from 0 to K − 1 in order, broadcasting A[m][k]. The
// packing and the blocking only move data: every element is the same fma chain, so the row
// tails (fewer than kMr rows), the column tails (zero-padded panels) and the three paths
// (AVX-512, AVX2 + FMA, portable std::fma; chosen at run time) give the same bits. This file is
// compiled with -ffp-contract=off (CMakeLists.txt) so that the compiler cannot fuse the
// epilogue's multiply and add on one path and not the other.
#include "ops/cpu/gemm_rows.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <type_traits>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define LAPLACE_GEMM_ROWS_AVX2 1
#endif

namespace laplace::cpu {
namespace {

constexpr int kMaxMr = 8;      // rows per micro-kernel, at most
constexpr int64_t kMc = 96;    // rows per task (a multiple of every micro-kernel's rows)

enum class Isa { kPortable, kAvx2, kAvx512 };

Isa best_isa() {
#ifdef LAPLACE_GEMM_ROWS_AVX2
  __builtin_cpu_init();  // may run before main (g_isa's initialiser)
  static const Isa best = __builtin_cpu_supports("avx512f")                                     ? Isa::kAvx512
                          : __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? Isa::kAvx2
                                                                                                 : Isa::kPortable;
  return best;
#else
  return Isa::kPortable;
#endif
}

Isa g_isa = best_isa();  // gemm_rows_select
Isa isa() { return g_isa; }

// The accumulators of rows [0, R) of a block against panel p ([K][NR]), A rows at a (stride
// lda): acc[r][j] = the fma chain over k of A[r][k]·p[k][j].
template <class T, int NR, int R>
void tile_portable(int64_t K, const T* a, int64_t lda, const T* p, T (&acc)[kMaxMr][NR]) {
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NR; ++j) acc[r][j] = T(0);
  for (int64_t k = 0; k < K; ++k) {
    const T* w = p + k * NR;
    for (int r = 0; r < R; ++r) {
      const T x = a[r * lda + k];
      for (int j = 0; j < NR; ++j) acc[r][j] = std::fma(x, w[j], acc[r][j]);
    }
  }
}

#ifdef LAPLACE_GEMM_ROWS_AVX2
// Two vectors of columns per row: R ≤ 6 rows keep 12 of the 16 ymm registers as accumulators.
template <int R>
__attribute__((target("avx2,fma"))) void tile_avx2(int64_t K, const float* a, int64_t lda, const float* p,
                                                    float (&acc)[kMaxMr][16]) {
  __m256 c0[R], c1[R];
  for (int r = 0; r < R; ++r) c0[r] = c1[r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m256 w0 = _mm256_loadu_ps(p + 16 * k), w1 = _mm256_loadu_ps(p + 16 * k + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 x = _mm256_broadcast_ss(a + r * lda + k);
      c0[r] = _mm256_fmadd_ps(x, w0, c0[r]);
      c1[r] = _mm256_fmadd_ps(x, w1, c1[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(acc[r], c0[r]);
    _mm256_storeu_ps(acc[r] + 8, c1[r]);
  }
}

template <int R>
__attribute__((target("avx2,fma"))) void tile_avx2(int64_t K, const double* a, int64_t lda, const double* p,
                                                    double (&acc)[kMaxMr][8]) {
  __m256d c0[R], c1[R];
  for (int r = 0; r < R; ++r) c0[r] = c1[r] = _mm256_setzero_pd();
  for (int64_t k = 0; k < K; ++k) {
    const __m256d w0 = _mm256_loadu_pd(p + 8 * k), w1 = _mm256_loadu_pd(p + 8 * k + 4);
    for (int r = 0; r < R; ++r) {
      const __m256d x = _mm256_broadcast_sd(a + r * lda + k);
      c0[r] = _mm256_fmadd_pd(x, w0, c0[r]);
      c1[r] = _mm256_fmadd_pd(x, w1, c1[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_pd(acc[r], c0[r]);
    _mm256_storeu_pd(acc[r] + 4, c1[r]);
  }
}

// The same with zmm registers: R ≤ 8 rows keep 16 of the 32 as accumulators.
template <int R>
__attribute__((target("avx512f"))) void tile_avx512(int64_t K, const float* a, int64_t lda, const float* p,
                                                    float (&acc)[kMaxMr][32]) {
  __m512 c0[R], c1[R];
  for (int r = 0; r < R; ++r) c0[r] = c1[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m512 w0 = _mm512_loadu_ps(p + 32 * k), w1 = _mm512_loadu_ps(p + 32 * k + 16);
    for (int r = 0; r < R; ++r) {
      const __m512 x = _mm512_set1_ps(a[r * lda + k]);
      c0[r] = _mm512_fmadd_ps(x, w0, c0[r]);
      c1[r] = _mm512_fmadd_ps(x, w1, c1[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(acc[r], c0[r]);
    _mm512_storeu_ps(acc[r] + 16, c1[r]);
  }
}

template <int R>
__attribute__((target("avx512f"))) void tile_avx512(int64_t K, const double* a, int64_t lda, const double* p,
                                                    double (&acc)[kMaxMr][16]) {
  __m512d c0[R], c1[R];
  for (int r = 0; r < R; ++r) c0[r] = c1[r] = _mm512_setzero_pd();
  for (int64_t k = 0; k < K; ++k) {
    const __m512d w0 = _mm512_loadu_pd(p + 16 * k), w1 = _mm512_loadu_pd(p + 16 * k + 8);
    for (int r = 0; r < R; ++r) {
      const __m512d x = _mm512_set1_pd(a[r * lda + k]);
      c0[r] = _mm512_fmadd_pd(x, w0, c0[r]);
      c1[r] = _mm512_fmadd_pd(x, w1, c1[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_pd(acc[r], c0[r]);
    _mm512_storeu_pd(acc[r] + 8, c1[r]);
  }
}

// Packing, F32 with AVX-512: 16 × 16 blocks of B transposed in registers (unpack, shuffle,
// then two 128-bit lane shuffles) instead of one scalar store per element: the whole of B is
// packed for each call, so for one row the packing costs as much as the product itself.
// The same with AVX2 below; F64 packs element by element.
// GCC 12 warns that the intrinsics' own undefined pass-through operand (__Y) may be used
// uninitialised; it is not read (no mask).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
__attribute__((target("avx512f"))) inline void transpose16(__m512 (&r)[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int h = 0; h < 16; h += 8)
    for (int i = 0; i < 4; ++i) {
      t[h + i] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0x88);
      t[h + i + 4] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0xdd);
    }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
  }
}

// The same for AVX2's panels of 16 columns: 8 × 8 blocks (unpack, shuffle, 128-bit permute).
__attribute__((target("avx2"))) inline void transpose8(__m256 (&r)[8]) {
  __m256 t[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm256_permute2f128_ps(r[i], r[i + 4], 0x20);
    t[i + 4] = _mm256_permute2f128_ps(r[i], r[i + 4], 0x31);
  }
  for (int i = 0; i < 8; ++i) r[i] = t[i];
}

// pack[k][j] = B[n0 + j][k] for a panel of 16 columns, zero columns past nc.
__attribute__((target("avx2"))) void pack_avx2(const float* b, int64_t ldb, int64_t n0, int64_t nc, int64_t K,
                                               float* pack) {
  int64_t k0 = 0;
  for (; k0 + 8 <= K; k0 += 8) {
    for (int h = 0; h < 2; ++h) {
      __m256 r[8];
      for (int i = 0; i < 8; ++i) {
        const int64_t j = h * 8 + i;
        r[i] = j < nc ? _mm256_loadu_ps(b + (n0 + j) * ldb + k0) : _mm256_setzero_ps();
      }
      transpose8(r);
      for (int kk = 0; kk < 8; ++kk) _mm256_storeu_ps(pack + (k0 + kk) * 16 + h * 8, r[kk]);
    }
  }
  for (; k0 < K; ++k0)
    for (int64_t j = 0; j < 16; ++j) pack[k0 * 16 + j] = j < nc ? b[(n0 + j) * ldb + k0] : 0.f;
}

// pack[k][j] = B[n0 + j][k] for a panel of 32 columns, zero columns past nc.
__attribute__((target("avx512f"))) void pack_avx512(const float* b, int64_t ldb, int64_t n0, int64_t nc, int64_t K,
                                                    float* pack) {
  int64_t k0 = 0;
  for (; k0 + 16 <= K; k0 += 16) {
    for (int h = 0; h < 2; ++h) {
      __m512 r[16];
      for (int i = 0; i < 16; ++i) {
        const int64_t j = h * 16 + i;
        r[i] = j < nc ? _mm512_loadu_ps(b + (n0 + j) * ldb + k0) : _mm512_setzero_ps();
      }
      transpose16(r);
      for (int kk = 0; kk < 16; ++kk) _mm512_storeu_ps(pack + (k0 + kk) * 32 + h * 16, r[kk]);
    }
  }
  for (; k0 < K; ++k0)
    for (int64_t j = 0; j < 32; ++j) pack[k0 * 32 + j] = j < nc ? b[(n0 + j) * ldb + k0] : 0.f;
}
#pragma GCC diagnostic pop
#endif

// The micro-kernels by ISA, each for 1 … kMr rows. NR: columns per panel (two vectors).
template <class T, Isa I>
struct Kernel {  // portable: the AVX2 shapes
  static constexpr int NR = 64 / static_cast<int>(sizeof(T)), kMr = 6;
  template <int R>
  static void tile(int64_t K, const T* a, int64_t lda, const T* p, T (&acc)[kMaxMr][NR]) {
    tile_portable<T, NR, R>(K, a, lda, p, acc);
  }
};
#ifdef LAPLACE_GEMM_ROWS_AVX2
template <class T>
struct Kernel<T, Isa::kAvx2> {
  static constexpr int NR = 64 / static_cast<int>(sizeof(T)), kMr = 6;
  template <int R>
  static void tile(int64_t K, const T* a, int64_t lda, const T* p, T (&acc)[kMaxMr][NR]) {
    tile_avx2<R>(K, a, lda, p, acc);
  }
};
template <class T>
struct Kernel<T, Isa::kAvx512> {
  static constexpr int NR = 128 / static_cast<int>(sizeof(T)), kMr = 8;
  template <int R>
  static void tile(int64_t K, const T* a, int64_t lda, const T* p, T (&acc)[kMaxMr][NR]) {
    tile_avx512<R>(K, a, lda, p, acc);
  }
};
#endif

template <class T, Isa I>
void tile_rows(int rows, int64_t K, const T* a, int64_t lda, const T* p, T (&acc)[kMaxMr][Kernel<T, I>::NR]) {
  using Kr = Kernel<T, I>;
  switch (rows) {
    case 1: return Kr::template tile<1>(K, a, lda, p, acc);
    case 2: return Kr::template tile<2>(K, a, lda, p, acc);
    case 3: return Kr::template tile<3>(K, a, lda, p, acc);
    case 4: return Kr::template tile<4>(K, a, lda, p, acc);
    case 5: return Kr::template tile<5>(K, a, lda, p, acc);
    case 6: return Kr::template tile<6>(K, a, lda, p, acc);
    case 7: if constexpr (Kr::kMr >= 7) return Kr::template tile<7>(K, a, lda, p, acc); break;
    case 8: if constexpr (Kr::kMr >= 8) return Kr::template tile<8>(K, a, lda, p, acc); break;
  }
}

// pack[k][j] = B[n0 + j][k] for j < NR, zero columns past nc; 64 k at a time (L1).
template <class T, int NR>
void pack_scalar(const T* b, int64_t ldb, int64_t n0, int64_t nc, int64_t K, T* pack) {
  for (int64_t k0 = 0; k0 < K; k0 += 64) {
    const int64_t k1 = std::min<int64_t>(K, k0 + 64);
    for (int64_t j = 0; j < NR; ++j) {
      T* dst = pack + j;
      if (j < nc) {
        const T* src = b + (n0 + j) * ldb;
        for (int64_t k = k0; k < k1; ++k) dst[k * NR] = src[k];
      } else {
        for (int64_t k = k0; k < k1; ++k) dst[k * NR] = T(0);
      }
    }
  }
}

template <class T, Isa I>
void pack_panel(const T* b, int64_t ldb, int64_t n0, int64_t nc, int64_t K, T* pack) {
#ifdef LAPLACE_GEMM_ROWS_AVX2
  if constexpr (I == Isa::kAvx512 && std::is_same_v<T, float>) return pack_avx512(b, ldb, n0, nc, K, pack);
  if constexpr (I == Isa::kAvx2 && std::is_same_v<T, float>) return pack_avx2(b, ldb, n0, nc, K, pack);
#endif
  pack_scalar<T, Kernel<T, I>::NR>(b, ldb, n0, nc, K, pack);
}

template <class T, Isa I>
void gemm_rows_isa(int64_t M, int64_t N, int64_t K, T alpha, const T* a, int64_t lda, const T* b, int64_t ldb, T beta,
                   T* c, int64_t ldc) {
  constexpr int NR = Kernel<T, I>::NR, MR = Kernel<T, I>::kMr;
  static_assert(kMc % MR == 0 && MR <= kMaxMr, "row blocks hold whole micro-kernels");
  const int64_t panels = (N + NR - 1) / NR, blocks = (M + kMc - 1) / kMc;
#pragma omp parallel if (M * N * K > (int64_t{1} << 16))
  {
    const std::unique_ptr<T[]> pack(new T[static_cast<size_t>(K * NR)]);  // every entry written before use
    int64_t packed = -1;  // the panel in `pack`
    // Panel-major: a thread's consecutive tasks share a panel, so each packs it once.
#pragma omp for collapse(2) schedule(static)
    for (int64_t pn = 0; pn < panels; ++pn) {
      for (int64_t bm = 0; bm < blocks; ++bm) {
        const int64_t n0 = pn * NR, nc = std::min<int64_t>(NR, N - n0);
        if (packed != pn) {
          pack_panel<T, I>(b, ldb, n0, nc, K, pack.get());
          packed = pn;
        }
        const int64_t m_end = std::min(M, (bm + 1) * kMc);
        for (int64_t m0 = bm * kMc; m0 < m_end; m0 += MR) {
          const int rows = static_cast<int>(std::min<int64_t>(MR, m_end - m0));
          T acc[kMaxMr][NR];
          tile_rows<T, I>(rows, K, a + m0 * lda, lda, pack.get(), acc);
          for (int r = 0; r < rows; ++r) {
            T* out = c + (m0 + r) * ldc + n0;
            for (int64_t j = 0; j < nc; ++j) {
              T v = alpha * acc[r][j];
              if (beta != T(0)) v = v + beta * out[j];
              out[j] = v;
            }
          }
        }
      }
    }
  }
}

}  // namespace

template <class T>
void gemm_rows(int64_t M, int64_t N, int64_t K, T alpha, const T* a, int64_t lda, const T* b, int64_t ldb, T beta,
               T* c, int64_t ldc) {
  switch (isa()) {
#ifdef LAPLACE_GEMM_ROWS_AVX2
    case Isa::kAvx512: return gemm_rows_isa<T, Isa::kAvx512>(M, N, K, alpha, a, lda, b, ldb, beta, c, ldc);
    case Isa::kAvx2: return gemm_rows_isa<T, Isa::kAvx2>(M, N, K, alpha, a, lda, b, ldb, beta, c, ldc);
#endif
    default: return gemm_rows_isa<T, Isa::kPortable>(M, N, K, alpha, a, lda, b, ldb, beta, c, ldc);
  }
}

bool gemm_rows_select(GemmPath path) {
  const Isa best = best_isa();
  Isa want = best;
  if (path == GemmPath::kPortable) want = Isa::kPortable;
  if (path == GemmPath::kAvx2) want = Isa::kAvx2;
  if (path == GemmPath::kAvx512) want = Isa::kAvx512;
  if (static_cast<int>(want) > static_cast<int>(best)) return false;  // AVX-512 CPUs have AVX2 + FMA too
  g_isa = want;
  return true;
}

template void gemm_rows<float>(int64_t, int64_t, int64_t, float, const float*, int64_t, const float*, int64_t, float,
                               float*, int64_t);
template void gemm_rows<double>(int64_t, int64_t, int64_t, double, const double*, int64_t, const double*, int64_t,
                                double, double*, int64_t);

}  // namespace laplace::cpu
