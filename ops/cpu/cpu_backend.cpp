// CPU backend kernels (see ops/backend.h for the contract of every op).
//
// Layout: every kernel is a small template on the scalar type T (float or double),
// dispatched on the dtype of its first float tensor. Tensors are strided views: the
// innermost dim is contiguous and all outer dims are flattened into "rows" whose
// offsets honour the outer strides (Rows below). Sums are accumulated in double.
//
// Determinism: row/element loops are parallel (OpenMP) but every reduction across rows
// either runs serially inside a task that owns its outputs (column-parallel), or sums
// fixed-size row blocks and then adds the block partials in block order. Neither the
// block boundaries nor the summation order depend on the number of threads.
#include "ops/cpu/cpu_backend.h"

#include <cblas.h>

#include <algorithm>
#include <array>
#include <climits>
#include <cmath>
#include <cstring>
#include <string>
#include <unistd.h>
#include <vector>

#include "core/fixed_sum.h"
#include "core/fp8.h"
#include "ops/cpu/gemm_rows.h"
#include "ops/cpu/gla.h"

namespace laplace {

namespace {

constexpr int64_t kParallelMin = 1 << 14;  // elements of work below which loops stay serial
// gemm_e4m3: the longest inner dimension whose F64 sums are exact in any order; the rows of X
// and of W decoded to F64 at a time (at most 256, and at most 2^22 values per tile: 32 MB); and
// the fewest rows of X for which decoding W's tiles (N·K values, 8 bytes each) pays: below, a
// loop over the codes.
constexpr int64_t kFp8ExactK = int64_t{1} << 17;
constexpr int64_t kFp8TileRows = 256, kFp8TileValues = int64_t{1} << 22;
constexpr int64_t kFp8BlasRows = 16;
constexpr int64_t kRowBlock = 64;          // rows per partial sum of a parameter gradient
constexpr int64_t kColBlock = 64;          // columns per task of column-parallel reductions
constexpr int64_t kConvBlock = 32;         // channels per task of the depthwise conv
constexpr int64_t kSumBlock = 1 << 14;     // elements per partial sum of sum_squares
constexpr int64_t kElemChunk = 1 << 13;    // columns per task of element-wise ops

// ---- views -------------------------------------------------------------------------

void check_cpu(const Tensor& t) {
  LAPLACE_CHECK(t.device == Device::kCPU, "CPU backend: tensor is not in host memory");
}

// The rows of a tensor: all dims but the last flattened (row-major); offset(r) is the
// element offset of row r. With nouter == ndim and cols == 1 it maps flat indices.
struct Rows {
  int64_t n = 1;     // number of rows
  int64_t cols = 1;  // elements per row (contiguous)
  int nouter = 0;
  int64_t shape[kMaxDims] = {};
  int64_t stride[kMaxDims] = {};

  int64_t offset(int64_t r) const {
    int64_t off = 0;
    for (int d = nouter - 1; d >= 0; --d) {
      const int64_t i = r % shape[d];
      r /= shape[d];
      off += i * stride[d];
    }
    return off;
  }
};

Rows rows_of(const Tensor& t) {
  check_cpu(t);
  Rows r;
  if (t.ndim == 0) return r;
  r.cols = t.shape[t.ndim - 1];
  LAPLACE_CHECK(t.stride[t.ndim - 1] == 1 || r.cols <= 1,
                "CPU backend: the innermost dim of a tensor must be contiguous");
  r.nouter = t.ndim - 1;
  for (int d = 0; d < r.nouter; ++d) {
    r.shape[d] = t.shape[d];
    r.stride[d] = t.stride[d];
    r.n *= t.shape[d];
  }
  return r;
}

// One row of numel elements for a contiguous tensor, else rows_of.
Rows elem_rows(const Tensor& t) {
  if (!t.is_contiguous()) return rows_of(t);
  check_cpu(t);
  Rows r;
  r.cols = t.numel();
  return r;
}

// Flat (logical row-major) index -> element offset, over all dims.
Rows flat_of(const Tensor& t) {
  check_cpu(t);
  Rows r;
  r.nouter = t.ndim;
  for (int d = 0; d < t.ndim; ++d) {
    r.shape[d] = t.shape[d];
    r.stride[d] = t.stride[d];
    r.n *= t.shape[d];
  }
  return r;
}

template <class T> T* row_ptr(const Tensor& t, const Rows& r, int64_t i) {
  return static_cast<T*>(t.data) + r.offset(i);
}

// A contiguous parameter vector of n elements of type T.
template <class T> T* vec_ptr(const Tensor& t, int64_t n, const char* msg) {
  check_cpu(t);
  LAPLACE_CHECK(t.dtype == dtype_of<T>() && t.numel() == n && t.is_contiguous(), msg);
  return static_cast<T*>(t.data);
}

// Per-row statistics / losses may be F32 or F64 whatever the compute dtype.
double load_stat(const Tensor& t, int64_t off) {
  return t.dtype == DType::kF32 ? static_cast<const float*>(t.data)[off]
                                : static_cast<const double*>(t.data)[off];
}
void store_stat(const Tensor& t, int64_t off, double v) {
  if (t.dtype == DType::kF32) static_cast<float*>(t.data)[off] = static_cast<float>(v);
  else static_cast<double*>(t.data)[off] = v;
}
Rows stat_rows(const Tensor& t, int64_t n, const char* msg) {
  LAPLACE_CHECK((t.dtype == DType::kF32 || t.dtype == DType::kF64) && t.numel() == n, msg);
  return flat_of(t);
}

// I32 index vectors (ids, targets, slots).
Rows index_rows(const Tensor& t, int64_t n, const char* msg) {
  LAPLACE_CHECK(t.dtype == DType::kI32 && t.numel() == n, msg);
  return flat_of(t);
}
int64_t load_index(const Tensor& t, const Rows& r, int64_t i) {
  return static_cast<const int32_t*>(t.data)[r.offset(i)];
}

// Same row structure and dtype (shapes may differ only in how rows are split into dims).
void check_rows_like(const Tensor& a, const Rows& ra, const Tensor& ref, const Rows& rr,
                     const char* msg) {
  LAPLACE_CHECK(a.dtype == ref.dtype && ra.n == rr.n && ra.cols == rr.cols, msg);
}

template <class F> void dispatch(DType dt, F&& f) {
  if (dt == DType::kF32) f(float{});
  else if (dt == DType::kF64) f(double{});
  else LAPLACE_CHECK(false, "CPU backend: ops compute in F32 or F64");
}

// Calls f(row, c0, c1) for every row and every chunk [c0, c1) of its columns, in parallel.
// Only for work without cross-task reductions.
template <class F> void for_row_chunks(int64_t nrows, int64_t ncols, F&& f) {
  if (nrows <= 0 || ncols <= 0) return;
  const int64_t nch = (ncols + kElemChunk - 1) / kElemChunk;
  const int64_t tasks = nrows * nch;
#pragma omp parallel for schedule(static) if (nrows * ncols > kParallelMin)
  for (int64_t i = 0; i < tasks; ++i) {
    const int64_t r = i / nch, c0 = (i % nch) * kElemChunk;
    f(r, c0, std::min(ncols, c0 + kElemChunk));
  }
}

// Element-wise op over same-shaped tensors of type T: f(ptrs, n) on runs of n elements.
template <class T, size_t NT, class F>
void elementwise(const std::array<Tensor, NT>& ts, const char* msg, F&& f) {
  bool contig = true;
  for (const Tensor& t : ts) {
    check_cpu(t);
    LAPLACE_CHECK(t.dtype == dtype_of<T>() && same_shape(t, ts[0]), msg);
    contig = contig && t.is_contiguous();
  }
  std::array<Rows, NT> rows;
  for (size_t i = 0; i < NT; ++i) rows[i] = contig ? elem_rows(ts[i]) : rows_of(ts[i]);
  for_row_chunks(rows[0].n, rows[0].cols, [&](int64_t r, int64_t c0, int64_t c1) {
    std::array<T*, NT> p;
    for (size_t i = 0; i < NT; ++i) p[i] = static_cast<T*>(ts[i].data) + rows[i].offset(r) + c0;
    f(p, c1 - c0);
  });
}

// dst[d] += Σ_k part[k·D + d], k ascending (the fixed-order second stage of a row-block
// reduction). Parallel over d: every column is summed serially.
template <class T> void add_block_partials(const std::vector<double>& part, int64_t nblk, int64_t D,
                                           T* dst) {
#pragma omp parallel for schedule(static) if (nblk * D > kParallelMin)
  for (int64_t d = 0; d < D; ++d) {
    double s = 0;
    for (int64_t k = 0; k < nblk; ++k) s += part[k * D + d];
    dst[d] = static_cast<T>(static_cast<double>(dst[d]) + s);
  }
}

// SiLU(x) = x·σ(x); SiLU'(x) = σ(x)·(1 + x·(1 − σ(x))).
inline double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }
inline double silu(double x) { return x * sigmoid(x); }
inline double dsilu(double x) {
  const double s = sigmoid(x);
  return s * (1.0 + x * (1.0 - s));
}

// ---- generic element load/store for copy between dtypes ------------------------------

double load_any(const void* p, DType t, int64_t i) {
  switch (t) {
    case DType::kF32: return static_cast<const float*>(p)[i];
    case DType::kF64: return static_cast<const double*>(p)[i];
    case DType::kBF16: return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
    case DType::kI32: return static_cast<const int32_t*>(p)[i];
    case DType::kI64: return static_cast<double>(static_cast<const int64_t*>(p)[i]);
    default: LAPLACE_CHECK(false, "CPU backend: unsupported dtype conversion");
  }
  return 0;
}
void store_any(void* p, DType t, int64_t i, double v) {
  switch (t) {
    case DType::kF32: static_cast<float*>(p)[i] = static_cast<float>(v); return;
    case DType::kF64: static_cast<double*>(p)[i] = v; return;
    case DType::kBF16: static_cast<uint16_t*>(p)[i] = float_to_bf16(static_cast<float>(v)); return;
    case DType::kI32: static_cast<int32_t*>(p)[i] = static_cast<int32_t>(v); return;
    case DType::kI64: static_cast<int64_t*>(p)[i] = static_cast<int64_t>(v); return;
    default: LAPLACE_CHECK(false, "CPU backend: unsupported dtype conversion");
  }
}

// ---- embedding -----------------------------------------------------------------------

// out[n, :] = table[ids[n], :]
template <class T> void embedding_fwd(const Tensor& ids, const Tensor& table, Tensor out) {
  LAPLACE_CHECK(table.ndim == 2, "embedding: table must be [V, D]");
  const Rows rt = rows_of(table), ro = rows_of(out);
  const int64_t V = table.shape[0], D = table.shape[1];
  LAPLACE_CHECK(out.dtype == table.dtype && ro.cols == D, "embedding: out must be [N, D] like table");
  const Rows ri = index_rows(ids, ro.n, "embedding: ids must be I32 with one id per output row");
#pragma omp parallel for schedule(static) if (ro.n * D > kParallelMin)
  for (int64_t n = 0; n < ro.n; ++n) {
    const int64_t id = load_index(ids, ri, n);
    LAPLACE_CHECK(id >= 0 && id < V, "embedding: token id out of range [0, V)");
    std::memcpy(row_ptr<T>(out, ro, n), row_ptr<T>(table, rt, id), sizeof(T) * D);
  }
}

// dtable[ids[n], :] += dout[n, :]. Parallel over column blocks; inside a block the rows
// are added serially in n order, so repeated ids sum in a fixed order.
template <class T> void embedding_bwd(const Tensor& ids, const Tensor& dout, Tensor dtable) {
  LAPLACE_CHECK(dtable.ndim == 2, "embedding_backward: dtable must be [V, D]");
  const Rows rt = rows_of(dtable), ro = rows_of(dout);
  const int64_t V = dtable.shape[0], D = dtable.shape[1];
  LAPLACE_CHECK(dout.dtype == dtable.dtype && ro.cols == D,
                "embedding_backward: dout must be [N, D] like dtable");
  const Rows ri = index_rows(ids, ro.n, "embedding_backward: ids must be I32, one per row");
  std::vector<int64_t> id(ro.n);
  for (int64_t n = 0; n < ro.n; ++n) {
    id[n] = load_index(ids, ri, n);
    LAPLACE_CHECK(id[n] >= 0 && id[n] < V, "embedding_backward: token id out of range [0, V)");
  }
  const int64_t nblk = (D + kColBlock - 1) / kColBlock;
#pragma omp parallel for schedule(static) if (ro.n * D > kParallelMin)
  for (int64_t k = 0; k < nblk; ++k) {
    const int64_t d0 = k * kColBlock, d1 = std::min(D, d0 + kColBlock);
    for (int64_t n = 0; n < ro.n; ++n) {
      const T* src = row_ptr<T>(dout, ro, n);
      T* dst = row_ptr<T>(dtable, rt, id[n]);
      for (int64_t d = d0; d < d1; ++d) dst[d] += src[d];
    }
  }
}

// ---- layernorm -----------------------------------------------------------------------

// μ = Σx/D, σ² = Σ(x−μ)²/D, r = 1/√(σ² + eps), y = (x − μ)·r·w + b. mean = μ, rstd = r.
template <class T>
void layernorm_fwd(const Tensor& x, const Tensor& w, const Tensor& b, double eps, Tensor y,
                   Tensor mean, Tensor rstd) {
  const Rows rx = rows_of(x), ry = rows_of(y);
  check_rows_like(y, ry, x, rx, "layernorm: y must match x");
  const int64_t N = rx.n, D = rx.cols;
  if (N == 0 || D == 0) return;
  const T* W = vec_ptr<T>(w, D, "layernorm: w must be [D] of the compute dtype");
  const T* Bv = b.defined() ? vec_ptr<T>(b, D, "layernorm: b must be [D] of the compute dtype") : nullptr;
  Rows rm, rr;
  if (mean.defined()) rm = stat_rows(mean, N, "layernorm: mean must be [N] F32/F64");
  if (rstd.defined()) rr = stat_rows(rstd, N, "layernorm: rstd must be [N] F32/F64");
#pragma omp parallel for schedule(static) if (N * D > kParallelMin)
  for (int64_t i = 0; i < N; ++i) {
    const T* xr = row_ptr<T>(x, rx, i);
    T* yr = row_ptr<T>(y, ry, i);
    double s = 0;
    for (int64_t d = 0; d < D; ++d) s += xr[d];
    const double mu = s / static_cast<double>(D);
    double v = 0;
    for (int64_t d = 0; d < D; ++d) {
      const double c = xr[d] - mu;
      v += c * c;
    }
    const double r = 1.0 / std::sqrt(v / static_cast<double>(D) + eps);
    for (int64_t d = 0; d < D; ++d) {
      const double o = (xr[d] - mu) * r * W[d] + (Bv ? static_cast<double>(Bv[d]) : 0.0);
      yr[d] = static_cast<T>(o);
    }
    if (mean.defined()) store_stat(mean, rm.offset(i), mu);
    if (rstd.defined()) store_stat(rstd, rr.offset(i), r);
  }
}

// x̂ = (x − μ)·r, g = dy ⊙ w:
//   dx = r·(g − mean(g) − x̂·mean(g ⊙ x̂))      (= or += per accumulate_dx)
//   dw += Σ_rows dy ⊙ x̂,   db += Σ_rows dy     (row-block partials, fixed order)
template <class T>
void layernorm_bwd(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& mean,
                   const Tensor& rstd, Tensor dx, bool accumulate_dx, Tensor dw, Tensor db) {
  const Rows rx = rows_of(x), rdy = rows_of(dy);
  check_rows_like(dy, rdy, x, rx, "layernorm_backward: dy must match x");
  Rows rdx;
  if (dx.defined()) {
    rdx = rows_of(dx);
    check_rows_like(dx, rdx, x, rx, "layernorm_backward: dx must match x");
  }
  const int64_t N = rx.n, D = rx.cols;
  if (N == 0 || D == 0) return;
  LAPLACE_CHECK(mean.defined() && rstd.defined(),
                "layernorm_backward needs the mean and rstd saved by the forward");
  const Rows rm = stat_rows(mean, N, "layernorm_backward: mean must be [N] F32/F64");
  const Rows rr = stat_rows(rstd, N, "layernorm_backward: rstd must be [N] F32/F64");
  const T* W = vec_ptr<T>(w, D, "layernorm_backward: w must be [D] of the compute dtype");
  T* DW = dw.defined() ? vec_ptr<T>(dw, D, "layernorm_backward: dw must be [D]") : nullptr;
  T* DB = db.defined() ? vec_ptr<T>(db, D, "layernorm_backward: db must be [D]") : nullptr;
  const int64_t nblk = (N + kRowBlock - 1) / kRowBlock;
  std::vector<double> pw(DW ? nblk * D : 0, 0.0), pb(DB ? nblk * D : 0, 0.0);
  const double invD = 1.0 / static_cast<double>(D);
#pragma omp parallel for schedule(static) if (N * D > kParallelMin)
  for (int64_t k = 0; k < nblk; ++k) {
    double* pwk = DW ? pw.data() + k * D : nullptr;
    double* pbk = DB ? pb.data() + k * D : nullptr;
    const int64_t i1 = std::min(N, (k + 1) * kRowBlock);
    for (int64_t i = k * kRowBlock; i < i1; ++i) {
      const T* xr = row_ptr<T>(x, rx, i);
      const T* gr = row_ptr<T>(dy, rdy, i);
      T* dxr = dx.defined() ? row_ptr<T>(dx, rdx, i) : nullptr;
      const double mu = load_stat(mean, rm.offset(i)), r = load_stat(rstd, rr.offset(i));
      double sg = 0, sgx = 0;
      for (int64_t d = 0; d < D; ++d) {
        const double xh = (xr[d] - mu) * r, g = static_cast<double>(gr[d]) * W[d];
        sg += g;
        sgx += g * xh;
      }
      sg *= invD;
      sgx *= invD;
      for (int64_t d = 0; d < D; ++d) {
        const double xh = (xr[d] - mu) * r, gy = gr[d];  // read before dx (may alias dy)
        if (pwk) pwk[d] += gy * xh;
        if (pbk) pbk[d] += gy;
        if (dxr) {
          const double v = r * (gy * W[d] - sg - xh * sgx);
          dxr[d] = static_cast<T>(accumulate_dx ? dxr[d] + v : v);
        }
      }
    }
  }
  if (DW) add_block_partials(pw, nblk, D, DW);
  if (DB) add_block_partials(pb, nblk, D, DB);
}

// ---- causal depthwise conv + SiLU ------------------------------------------------------

struct ConvShape {
  int64_t B, T, D, K;
};

ConvShape conv_shape(const Tensor& u, const Tensor& w) {
  check_cpu(u);
  check_cpu(w);
  LAPLACE_CHECK(u.ndim == 3 && u.stride[2] == 1, "conv_silu: u must be [B, T, D], contiguous in D");
  LAPLACE_CHECK(w.ndim == 2 && w.dtype == u.dtype && w.shape[0] == u.shape[2] && w.shape[1] >= 1 &&
                    (w.stride[1] == 1 || w.shape[1] == 1),
                "conv_silu: w must be [D, K] of the compute dtype");
  return {u.shape[0], u.shape[1], u.shape[2], w.shape[1]};
}

void check_like_btd(const Tensor& t, const Tensor& u, const char* msg) {
  check_cpu(t);
  LAPLACE_CHECK(t.dtype == u.dtype && same_shape(t, u) && t.stride[2] == 1, msg);
}

// Window pool [S, K, D]; returns the element pointer of batch row b's entry.
template <class T>
T* window_entry(const Tensor& win, const Tensor& slots, const Rows& rs, int64_t b) {
  const int64_t s = slots.defined() ? load_index(slots, rs, b) : b;
  LAPLACE_CHECK(s >= 0 && s < win.shape[0], "conv_silu: slot out of range of the window pool");
  return static_cast<T*>(win.data) + s * win.stride[0];
}

void check_window(const Tensor& win, const Tensor& u, const ConvShape& cs, const Tensor& slots) {
  check_cpu(win);
  LAPLACE_CHECK(win.ndim == 3 && win.dtype == u.dtype && win.shape[1] == cs.K &&
                    win.shape[2] == cs.D && win.stride[2] == 1,
                "conv_silu: window pool must be [S, K, D] of the compute dtype");
  if (!slots.defined())
    LAPLACE_CHECK(win.shape[0] >= cs.B, "conv_silu: window pool smaller than the batch");
}

// With the extended sequence e = [u_{−K}, …, u_{−1} (the window, zeros if none), u_0, …]:
//   pre_t[d] = Σ_{j<K} w[d, j] · u_{t−K+1+j}[d],   c_t = SiLU(pre_t)
//   win_out[i] = e[T + i]   (the last K inputs; old window entries when T < K)
// Parallel over (batch row, channel block); each task reads and writes only its own
// channels of its own window entry, so win_out may alias win_in.
// Document starts (GlaParams::doc's form) of batch row b, or nullptr when there are none.
const int32_t* conv_doc_row(const Tensor& doc, int64_t b) {
  if (!doc.defined()) return nullptr;
  return static_cast<const int32_t*>(doc.data) + b * doc.stride[0];
}

void check_conv_doc(const Tensor& doc, const ConvShape& cs) {
  if (!doc.defined()) return;
  check_cpu(doc);
  LAPLACE_CHECK(doc.dtype == DType::kI32 && doc.ndim == 2 && doc.shape[0] == cs.B && doc.shape[1] == cs.T &&
                    doc.stride[1] == 1,
                "conv_silu: doc must be [B, T] I32, contiguous in T");
  for (int64_t b = 0; b < cs.B; ++b) {
    const int32_t* d = conv_doc_row(doc, b);
    for (int64_t t = 0; t < cs.T; ++t)
      LAPLACE_CHECK(t == 0 ? (d[0] == -1 || d[0] == 0) : (d[t] == d[t - 1] || d[t] == t),
                    "conv_silu: doc is not a valid document-start row (core/doc_starts.h)");
  }
}

// With documents (doc), token t reads no input before its document's start doc[t] (≥ 0):
// those count as zeros, as u_{<0} does for a document that starts the row.
template <class T>
void conv_fwd(const Tensor& u, const Tensor& w, Tensor c, Tensor pre, const Tensor& win_in,
              Tensor win_out, const Tensor& slots, const Tensor& doc) {
  const ConvShape cs = conv_shape(u, w);
  const int64_t B = cs.B, T_ = cs.T, D = cs.D, K = cs.K;
  check_like_btd(c, u, "conv_silu: c must match u");
  if (pre.defined()) check_like_btd(pre, u, "conv_silu: pre must match u");
  Rows rs;
  if (slots.defined()) rs = index_rows(slots, B, "conv_silu: slots must be [B] I32");
  if (win_in.defined()) check_window(win_in, u, cs, slots);
  if (win_out.defined()) check_window(win_out, u, cs, slots);
  check_conv_doc(doc, cs);
  const T* U = static_cast<const T*>(u.data);
  const T* W = static_cast<const T*>(w.data);
  T* C = static_cast<T*>(c.data);
  T* P = pre.defined() ? static_cast<T*>(pre.data) : nullptr;
  const int64_t nblk = (D + kConvBlock - 1) / kConvBlock;
#pragma omp parallel for schedule(static) if (B * (T_ + K) * D * K > kParallelMin)
  for (int64_t task = 0; task < B * nblk; ++task) {
    const int64_t b = task / nblk, d0 = (task % nblk) * kConvBlock, d1 = std::min(D, d0 + kConvBlock);
    const int64_t nd = d1 - d0;
    const std::vector<T> zeros(nd, T(0));
    const T* wi = win_in.defined() ? window_entry<T>(win_in, slots, rs, b) : nullptr;
    // Row e of the extended sequence, channels [d0, d1).
    auto ext = [&](int64_t e) -> const T* {
      if (e >= K) return U + b * u.stride[0] + (e - K) * u.stride[1] + d0;
      return wi ? wi + e * win_in.stride[1] + d0 : zeros.data();
    };
    const int32_t* dr = conv_doc_row(doc, b);
    // Row e of the extended sequence as token t sees it: zeros before t's document.
    auto seen = [&](int64_t t, int64_t e) -> const T* {
      return dr && dr[t] >= 0 && e - K < dr[t] ? zeros.data() : ext(e);
    };
    std::vector<const T*> src(K);
    for (int64_t t = 0; t < T_; ++t) {
      for (int64_t j = 0; j < K; ++j) src[j] = seen(t, t + 1 + j);  // u_{t−K+1+j} = e[t+1+j]
      T* cr = C + b * c.stride[0] + t * c.stride[1] + d0;
      T* pr = P ? P + b * pre.stride[0] + t * pre.stride[1] + d0 : nullptr;
      for (int64_t i = 0; i < nd; ++i) {
        const T* wr = W + (d0 + i) * w.stride[0];
        double acc = 0;
        for (int64_t j = 0; j < K; ++j) acc += static_cast<double>(wr[j]) * src[j][i];
        if (pr) pr[i] = static_cast<T>(acc);
        cr[i] = static_cast<T>(silu(acc));
      }
    }
    if (win_out.defined()) {
      // Ascending i reads e[T+i] ≥ row i+1 of the old window before it is overwritten.
      T* wo = window_entry<T>(win_out, slots, rs, b);
      for (int64_t i = 0; i < K; ++i) {
        const T* s = T_ > 0 ? seen(T_ - 1, T_ + i) : ext(T_ + i);
        T* dst = wo + i * win_out.stride[1] + d0;
        if (dst != s)
          for (int64_t k = 0; k < nd; ++k) dst[k] = s[k];
      }
    }
  }
}

// Zero initial window. With dp_t = dc_t ⊙ SiLU'(pre_t):
//   du_s[d]  = Σ_{j: s+K−1−j < T} w[d, j] · dp_{s+K−1−j}[d]
//   dw[d, j] += Σ_b Σ_{t ≥ K−1−j} dp_t[d] · u_{t−K+1+j}[d]
// Parallel over channel blocks; each task owns its channels of du and dw and loops over
// b and t serially, so dw sums in a fixed order.
template <class T>
void conv_bwd(const Tensor& dc, const Tensor& u, const Tensor& w, const Tensor& pre, Tensor du,
              Tensor dw, const Tensor& doc) {
  const ConvShape cs = conv_shape(u, w);
  const int64_t B = cs.B, T_ = cs.T, D = cs.D, K = cs.K;
  check_like_btd(dc, u, "conv_silu_backward: dc must match u");
  if (pre.defined()) check_like_btd(pre, u, "conv_silu_backward: pre must match u");
  if (du.defined()) check_like_btd(du, u, "conv_silu_backward: du must match u");
  if (dw.defined()) {
    check_cpu(dw);
    LAPLACE_CHECK(dw.ndim == 2 && dw.dtype == u.dtype && dw.shape[0] == D && dw.shape[1] == K &&
                      (dw.stride[1] == 1 || K == 1),
                  "conv_silu_backward: dw must be [D, K] like w");
  }
  check_conv_doc(doc, cs);
  const T* U = static_cast<const T*>(u.data);
  const T* W = static_cast<const T*>(w.data);
  const T* DC = static_cast<const T*>(dc.data);
  const T* P = pre.defined() ? static_cast<const T*>(pre.data) : nullptr;
  T* DU = du.defined() ? static_cast<T*>(du.data) : nullptr;
  T* DW = dw.defined() ? static_cast<T*>(dw.data) : nullptr;
  const int64_t nblk = (D + kConvBlock - 1) / kConvBlock;
#pragma omp parallel for schedule(static) if (B * T_ * D * K > kParallelMin)
  for (int64_t blk = 0; blk < nblk; ++blk) {
    const int64_t d0 = blk * kConvBlock, d1 = std::min(D, d0 + kConvBlock), nd = d1 - d0;
    std::vector<double> dp(T_ * nd), accw(K * nd, 0.0);
    for (int64_t b = 0; b < B; ++b) {
      const T* ub = U + b * u.stride[0] + d0;
      const int32_t* dr = conv_doc_row(doc, b);
      // The first input token t reads: 0, or its document's start.
      auto first = [&](int64_t t) -> int64_t { return dr && dr[t] > 0 ? dr[t] : 0; };
      for (int64_t t = 0; t < T_; ++t) {
        const T* dcr = DC + b * dc.stride[0] + t * dc.stride[1] + d0;
        for (int64_t i = 0; i < nd; ++i) {
          double z;
          if (P) {
            z = P[b * pre.stride[0] + t * pre.stride[1] + d0 + i];
          } else {  // recompute the pre-activation exactly as the forward does
            const T* wr = W + (d0 + i) * w.stride[0];
            z = 0;
            for (int64_t j = 0; j < K; ++j) {
              const int64_t s = t - K + 1 + j;
              z += static_cast<double>(wr[j]) * (s >= first(t) ? static_cast<double>(ub[s * u.stride[1] + i]) : 0.0);
            }
          }
          dp[t * nd + i] = static_cast<double>(dcr[i]) * dsilu(z);
        }
      }
      if (DU) {
        for (int64_t s = 0; s < T_; ++s) {
          T* dur = DU + b * du.stride[0] + s * du.stride[1] + d0;
          for (int64_t i = 0; i < nd; ++i) {
            const T* wr = W + (d0 + i) * w.stride[0];
            double a = 0;
            for (int64_t j = 0; j < K; ++j) {
              const int64_t t = s + K - 1 - j;
              if (t < T_ && s >= first(t)) a += static_cast<double>(wr[j]) * dp[t * nd + i];
            }
            dur[i] = static_cast<T>(a);
          }
        }
      }
      if (DW) {
        for (int64_t t = 0; t < T_; ++t)
          for (int64_t j = 0; j < K; ++j) {
            const int64_t s = t - K + 1 + j;
            if (s < first(t)) continue;
            const T* us = ub + s * u.stride[1];
            for (int64_t i = 0; i < nd; ++i) accw[j * nd + i] += dp[t * nd + i] * us[i];
          }
      }
    }
    if (DW)
      for (int64_t i = 0; i < nd; ++i)
        for (int64_t j = 0; j < K; ++j) {
          T* p = DW + (d0 + i) * dw.stride[0] + j;
          *p = static_cast<T>(static_cast<double>(*p) + accw[j * nd + i]);
        }
  }
}

// ---- per-head RMSNorm ⊙ SiLU gate -------------------------------------------------------

// Per row (b, t, h) over dv: r = 1/√(Σo²/dv + eps), n = o·r, y = n ⊙ w ⊙ SiLU(g).
template <class T>
void rmsgate_fwd(const Tensor& o, const Tensor& g, const Tensor& w, double eps, Tensor y, Tensor rstd) {
  const Rows ro = rows_of(o), rg = rows_of(g), ry = rows_of(y);
  check_rows_like(g, rg, o, ro, "rmsnorm_gate: g must match o");
  check_rows_like(y, ry, o, ro, "rmsnorm_gate: y must match o");
  const int64_t N = ro.n, dv = ro.cols;
  if (N == 0 || dv == 0) return;
  const T* W = vec_ptr<T>(w, dv, "rmsnorm_gate: w must be [dv] of the compute dtype");
  Rows rr;
  if (rstd.defined()) rr = stat_rows(rstd, N, "rmsnorm_gate: rstd must be [B, T, H] F32/F64");
#pragma omp parallel for schedule(static) if (N * dv > kParallelMin)
  for (int64_t i = 0; i < N; ++i) {
    const T* orow = row_ptr<T>(o, ro, i);
    const T* grow = row_ptr<T>(g, rg, i);
    T* yrow = row_ptr<T>(y, ry, i);
    double ss = 0;
    for (int64_t d = 0; d < dv; ++d) ss += static_cast<double>(orow[d]) * orow[d];
    const double r = 1.0 / std::sqrt(ss / static_cast<double>(dv) + eps);
    for (int64_t d = 0; d < dv; ++d)
      yrow[d] = static_cast<T>(orow[d] * r * W[d] * silu(grow[d]));
    if (rstd.defined()) store_stat(rstd, rr.offset(i), r);
  }
}

// With n = o·r, s = SiLU(g), dn = dy ⊙ s ⊙ w:
//   d_o = r·(dn − n·Σ(dn ⊙ n)/dv),  dg = dy ⊙ n ⊙ w ⊙ SiLU'(g),  dw += Σ_rows dy ⊙ s ⊙ n.
template <class T>
void rmsgate_bwd(const Tensor& dy, const Tensor& o, const Tensor& g, const Tensor& w,
                 const Tensor& rstd, Tensor d_o, Tensor dg, Tensor dw) {
  const Rows ro = rows_of(o), rg = rows_of(g), rdy = rows_of(dy);
  check_rows_like(g, rg, o, ro, "rmsnorm_gate_backward: g must match o");
  check_rows_like(dy, rdy, o, ro, "rmsnorm_gate_backward: dy must match o");
  Rows rdo, rdg;
  if (d_o.defined()) {
    rdo = rows_of(d_o);
    check_rows_like(d_o, rdo, o, ro, "rmsnorm_gate_backward: d_o must match o");
  }
  if (dg.defined()) {
    rdg = rows_of(dg);
    check_rows_like(dg, rdg, o, ro, "rmsnorm_gate_backward: dg must match o");
  }
  const int64_t N = ro.n, dv = ro.cols;
  if (N == 0 || dv == 0) return;
  LAPLACE_CHECK(rstd.defined(), "rmsnorm_gate_backward needs the rstd saved by the forward");
  const Rows rr = stat_rows(rstd, N, "rmsnorm_gate_backward: rstd must be [B, T, H] F32/F64");
  const T* W = vec_ptr<T>(w, dv, "rmsnorm_gate_backward: w must be [dv] of the compute dtype");
  T* DW = dw.defined() ? vec_ptr<T>(dw, dv, "rmsnorm_gate_backward: dw must be [dv]") : nullptr;
  const int64_t nblk = (N + kRowBlock - 1) / kRowBlock;
  std::vector<double> pw(DW ? nblk * dv : 0, 0.0);
  const double inv = 1.0 / static_cast<double>(dv);
#pragma omp parallel for schedule(static) if (N * dv > kParallelMin)
  for (int64_t k = 0; k < nblk; ++k) {
    double* pwk = DW ? pw.data() + k * dv : nullptr;
    const int64_t i1 = std::min(N, (k + 1) * kRowBlock);
    for (int64_t i = k * kRowBlock; i < i1; ++i) {
      const T* orow = row_ptr<T>(o, ro, i);
      const T* grow = row_ptr<T>(g, rg, i);
      const T* dyr = row_ptr<T>(dy, rdy, i);
      T* dor = d_o.defined() ? row_ptr<T>(d_o, rdo, i) : nullptr;
      T* dgr = dg.defined() ? row_ptr<T>(dg, rdg, i) : nullptr;
      const double r = load_stat(rstd, rr.offset(i));
      double sdn = 0;
      for (int64_t d = 0; d < dv; ++d)
        sdn += static_cast<double>(dyr[d]) * silu(grow[d]) * W[d] * (orow[d] * r);
      sdn *= inv;
      for (int64_t d = 0; d < dv; ++d) {
        const double yv = dyr[d], gv = grow[d], n = orow[d] * r, s = silu(gv);  // read first
        if (pwk) pwk[d] += yv * s * n;
        if (dor) dor[d] = static_cast<T>(r * (yv * s * W[d] - n * sdn));
        if (dgr) dgr[d] = static_cast<T>(yv * n * W[d] * dsilu(gv));
      }
    }
  }
  if (DW) add_block_partials(pw, nblk, dv, DW);
}

// ---- SwiGLU ----------------------------------------------------------------------------

// h = SiLU(a) ⊙ b with ab = [a | b].
template <class T> void swiglu_fwd(const Tensor& ab, Tensor h) {
  const Rows ra = rows_of(ab), rh = rows_of(h);
  LAPLACE_CHECK(h.dtype == ab.dtype && rh.n == ra.n && 2 * rh.cols == ra.cols,
                "swiglu: ab must be [N, 2F] and h [N, F]");
  const int64_t F = rh.cols;
#pragma omp parallel for schedule(static) if (ra.n * F > kParallelMin)
  for (int64_t i = 0; i < ra.n; ++i) {
    const T* a = row_ptr<T>(ab, ra, i);
    T* hr = row_ptr<T>(h, rh, i);
    for (int64_t f = 0; f < F; ++f) hr[f] = static_cast<T>(silu(a[f]) * a[F + f]);
  }
}

// da = dh ⊙ b ⊙ SiLU'(a), db = dh ⊙ SiLU(a). dab may alias ab.
template <class T> void swiglu_bwd(const Tensor& dh, const Tensor& ab, Tensor dab) {
  const Rows ra = rows_of(ab), rh = rows_of(dh), rd = rows_of(dab);
  LAPLACE_CHECK(dh.dtype == ab.dtype && rh.n == ra.n && 2 * rh.cols == ra.cols,
                "swiglu_backward: ab must be [N, 2F] and dh [N, F]");
  check_rows_like(dab, rd, ab, ra, "swiglu_backward: dab must match ab");
  const int64_t F = rh.cols;
#pragma omp parallel for schedule(static) if (ra.n * F > kParallelMin)
  for (int64_t i = 0; i < ra.n; ++i) {
    const T* a = row_ptr<T>(ab, ra, i);
    const T* g = row_ptr<T>(dh, rh, i);
    T* d = row_ptr<T>(dab, rd, i);
    for (int64_t f = 0; f < F; ++f) {
      const double av = a[f], bv = a[F + f], gv = g[f];
      d[f] = static_cast<T>(gv * bv * dsilu(av));
      d[F + f] = static_cast<T>(gv * silu(av));
    }
  }
}

// ---- cross entropy ---------------------------------------------------------------------

// m = max x, lse = m + log Σ exp(x − m); loss = lse − x[target] (0 when target < 0).
template <class T> void xent_fwd(const Tensor& logits, const Tensor& targets, Tensor losses) {
  const Rows rl = rows_of(logits);
  const int64_t N = rl.n, V = rl.cols;
  const Rows rt = index_rows(targets, N, "cross_entropy: targets must be [N] I32");
  const Rows ro = stat_rows(losses, N, "cross_entropy: losses must be [N] F32/F64");
#pragma omp parallel for schedule(static) if (N * V > kParallelMin)
  for (int64_t n = 0; n < N; ++n) {
    const int64_t t = load_index(targets, rt, n);
    if (t < 0) {
      store_stat(losses, ro.offset(n), 0.0);
      continue;
    }
    LAPLACE_CHECK(t < V, "cross_entropy: target id out of range [0, V)");
    const T* x = row_ptr<T>(logits, rl, n);
    double m = -INFINITY;
    for (int64_t v = 0; v < V; ++v) m = std::max(m, static_cast<double>(x[v]));
    double s = 0;
    for (int64_t v = 0; v < V; ++v) s += std::exp(x[v] - m);
    store_stat(losses, ro.offset(n), (m - x[t]) + std::log(s));
  }
}

// dlogits = scale·(softmax(x) − onehot(target)); zero rows when target < 0. May alias.
template <class T>
void xent_bwd(const Tensor& logits, const Tensor& targets, double scale, Tensor dlogits) {
  const Rows rl = rows_of(logits), rd = rows_of(dlogits);
  check_rows_like(dlogits, rd, logits, rl, "cross_entropy_backward: dlogits must match logits");
  const int64_t N = rl.n, V = rl.cols;
  const Rows rt = index_rows(targets, N, "cross_entropy_backward: targets must be [N] I32");
#pragma omp parallel for schedule(static) if (N * V > kParallelMin)
  for (int64_t n = 0; n < N; ++n) {
    const int64_t t = load_index(targets, rt, n);
    const T* x = row_ptr<T>(logits, rl, n);
    T* dx = row_ptr<T>(dlogits, rd, n);
    if (t < 0) {
      for (int64_t v = 0; v < V; ++v) dx[v] = T(0);
      continue;
    }
    LAPLACE_CHECK(t < V, "cross_entropy_backward: target id out of range [0, V)");
    double m = -INFINITY;
    for (int64_t v = 0; v < V; ++v) m = std::max(m, static_cast<double>(x[v]));
    double s = 0;
    for (int64_t v = 0; v < V; ++v) s += std::exp(x[v] - m);
    const double k = scale / s;
    for (int64_t v = 0; v < V; ++v) {
      const double p = std::exp(x[v] - m) * k;
      dx[v] = static_cast<T>(v == t ? p - scale : p);
    }
  }
}

// ---- reductions / optimizer -----------------------------------------------------------

// Σ x² in double: partials over fixed blocks of kSumBlock logical (row-major) elements,
// then the partials summed in block order.
template <class T> double sumsq(const Tensor& x) {
  const Rows r = elem_rows(x);
  const int64_t total = r.n * r.cols;
  if (total == 0) return 0.0;
  const int64_t nblk = (total + kSumBlock - 1) / kSumBlock;
  std::vector<double> part(nblk);
#pragma omp parallel for schedule(static) if (total > kParallelMin)
  for (int64_t k = 0; k < nblk; ++k) {
    const int64_t end = std::min(total, (k + 1) * kSumBlock);
    double s = 0;
    for (int64_t idx = k * kSumBlock; idx < end;) {
      const int64_t row = idx / r.cols, col = idx % r.cols;
      const int64_t n = std::min(end - idx, r.cols - col);
      const T* p = row_ptr<T>(x, r, row) + col;
      for (int64_t i = 0; i < n; ++i) s += static_cast<double>(p[i]) * p[i];
      idx += n;
    }
    part[k] = s;
  }
  double s = 0;
  for (int64_t k = 0; k < nblk; ++k) s += part[k];
  return s;
}

}  // namespace

// ---- Backend methods ------------------------------------------------------------------

Allocator& CpuBackend::allocator() { return cpu_allocator(); }

bool CpuBackend::supports(const OpQuery& q) const {
  if (!is_backend_op(q.op)) return false;
  if (q.op == "copy") return q.dtype != DType::kF16 && q.dtype != DType::kI64 && q.dtype != DType::kU8;
  return q.dtype == DType::kF32 || q.dtype == DType::kF64;
}

// dst = src, element by element; converts between F32/F64/BF16/I32/I64 when dtypes differ.
void CpuBackend::copy(Tensor dst, const Tensor& src) {
  LAPLACE_CHECK(same_shape(dst, src), "copy: shapes differ");
  const bool contig = dst.is_contiguous() && src.is_contiguous();
  const Rows rd = contig ? elem_rows(dst) : rows_of(dst);
  const Rows rs = contig ? elem_rows(src) : rows_of(src);
  if (dst.dtype == src.dtype) {
    const size_t es = dtype_size(dst.dtype);
    for_row_chunks(rd.n, rd.cols, [&](int64_t r, int64_t c0, int64_t c1) {
      char* d = static_cast<char*>(dst.data) + (rd.offset(r) + c0) * static_cast<int64_t>(es);
      const char* s = static_cast<const char*>(src.data) + (rs.offset(r) + c0) * static_cast<int64_t>(es);
      if (d != s) std::memmove(d, s, static_cast<size_t>(c1 - c0) * es);
    });
    return;
  }
  for_row_chunks(rd.n, rd.cols, [&](int64_t r, int64_t c0, int64_t c1) {
    const int64_t od = rd.offset(r), os = rs.offset(r);
    for (int64_t c = c0; c < c1; ++c) store_any(dst.data, dst.dtype, od + c, load_any(src.data, src.dtype, os + c));
  });
}

void CpuBackend::fill(Tensor dst, double value) {
  const Rows rd = elem_rows(dst);
  const DType dt = dst.dtype;
  for_row_chunks(rd.n, rd.cols, [&](int64_t r, int64_t c0, int64_t c1) {
    const int64_t off = rd.offset(r);
    switch (dt) {
      case DType::kF32: std::fill_n(static_cast<float*>(dst.data) + off + c0, c1 - c0, static_cast<float>(value)); break;
      case DType::kF64: std::fill_n(static_cast<double*>(dst.data) + off + c0, c1 - c0, value); break;
      default:
        for (int64_t c = c0; c < c1; ++c) store_any(dst.data, dt, off + c, value);
    }
  });
}

// y += alpha·x
void CpuBackend::axpy(double alpha, const Tensor& x, Tensor y) {
  dispatch(y.dtype, [&](auto tag) {
    using T = decltype(tag);
    elementwise<T, 2>({y, x}, "axpy: x and y must have the same shape and dtype", [&](auto& p, int64_t n) {
      for (int64_t i = 0; i < n; ++i) p[0][i] = static_cast<T>(p[0][i] + alpha * p[1][i]);
    });
  });
}

// x *= alpha
void CpuBackend::scale(Tensor x, double alpha) {
  dispatch(x.dtype, [&](auto tag) {
    using T = decltype(tag);
    elementwise<T, 1>({x}, "scale: bad tensor", [&](auto& p, int64_t n) {
      for (int64_t i = 0; i < n; ++i) p[0][i] = static_cast<T>(p[0][i] * alpha);
    });
  });
}

// c = alpha·op(a)·op(b) + beta·c (row-major, leading dims from stride[0]): x·Wᵀ through
// cpu::gemm_rows, the backward's other transposes through cblas.
void CpuBackend::gemm(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, Tensor c,
                      double alpha, double beta) {
  check_cpu(a);
  check_cpu(b);
  check_cpu(c);
  LAPLACE_CHECK(a.ndim == 2 && b.ndim == 2 && c.ndim == 2, "gemm: operands must be 2-D");
  LAPLACE_CHECK(a.dtype == c.dtype && b.dtype == c.dtype, "gemm: operands must share the dtype");
  const int64_t M = c.shape[0], N = c.shape[1];
  const int64_t K = trans_a ? a.shape[0] : a.shape[1];
  LAPLACE_CHECK((trans_a ? a.shape[1] : a.shape[0]) == M, "gemm: rows of op(a) differ from rows of c");
  LAPLACE_CHECK((trans_b ? b.shape[0] : b.shape[1]) == N, "gemm: cols of op(b) differ from cols of c");
  LAPLACE_CHECK((trans_b ? b.shape[1] : b.shape[0]) == K, "gemm: inner dimensions differ");
  auto ld = [](const Tensor& t) -> int64_t {
    LAPLACE_CHECK(t.stride[1] == 1 || t.shape[1] <= 1, "gemm: the inner stride must be 1");
    LAPLACE_CHECK(t.shape[0] <= 1 || t.stride[0] >= t.shape[1], "gemm: rows overlap (stride[0] < cols)");
    const int64_t l = t.shape[0] <= 1 ? std::max<int64_t>(t.shape[1], 1) : std::max<int64_t>(t.stride[0], 1);
    LAPLACE_CHECK(l <= INT_MAX && t.shape[0] <= INT_MAX && t.shape[1] <= INT_MAX,
                  "gemm: dimension exceeds the 32-bit BLAS interface");
    return l;
  };
  if (M == 0 || N == 0) return;
  if (K == 0) {  // op(a)·op(b) is all zeros
    if (beta == 0) fill(c, 0.0);
    else scale(c, beta);
    return;
  }
  const int lda = static_cast<int>(ld(a)), ldb = static_cast<int>(ld(b)), ldc = static_cast<int>(ld(c));
  if (!trans_a && trans_b) {  // x·Wᵀ, the forward projections: row-invariant (ops/cpu/gemm_rows.h)
    if (c.dtype == DType::kF32)
      return cpu::gemm_rows<float>(M, N, K, static_cast<float>(alpha), static_cast<const float*>(a.data), lda,
                                   static_cast<const float*>(b.data), ldb, static_cast<float>(beta),
                                   static_cast<float*>(c.data), ldc);
    if (c.dtype == DType::kF64)
      return cpu::gemm_rows<double>(M, N, K, alpha, static_cast<const double*>(a.data), lda,
                                    static_cast<const double*>(b.data), ldb, beta, static_cast<double*>(c.data), ldc);
    LAPLACE_CHECK(false, "gemm: CPU backend computes in F32 or F64");
  }
  const CBLAS_TRANSPOSE ta = trans_a ? CblasTrans : CblasNoTrans;
  const CBLAS_TRANSPOSE tb = trans_b ? CblasTrans : CblasNoTrans;
  const int m = static_cast<int>(M), n = static_cast<int>(N), k = static_cast<int>(K);
  if (c.dtype == DType::kF32) {
    cblas_sgemm(CblasRowMajor, ta, tb, m, n, k, static_cast<float>(alpha), static_cast<const float*>(a.data),
                lda, static_cast<const float*>(b.data), ldb, static_cast<float>(beta), static_cast<float*>(c.data), ldc);
  } else if (c.dtype == DType::kF64) {
    cblas_dgemm(CblasRowMajor, ta, tb, m, n, k, alpha, static_cast<const double*>(a.data), lda,
                static_cast<const double*>(b.data), ldb, beta, static_cast<double*>(c.data), ldc);
  } else {
    LAPLACE_CHECK(false, "gemm: CPU backend computes in F32 or F64");
  }
}

void CpuBackend::embedding_forward(const Tensor& ids, const Tensor& table, Tensor out) {
  dispatch(table.dtype, [&](auto tag) { embedding_fwd<decltype(tag)>(ids, table, out); });
}
void CpuBackend::embedding_backward(const Tensor& ids, const Tensor& dout, Tensor dtable) {
  dispatch(dtable.dtype, [&](auto tag) { embedding_bwd<decltype(tag)>(ids, dout, dtable); });
}

void CpuBackend::layernorm_forward(const Tensor& x, const Tensor& w, const Tensor& b, double eps,
                                   Tensor y, Tensor mean, Tensor rstd) {
  dispatch(x.dtype, [&](auto tag) { layernorm_fwd<decltype(tag)>(x, w, b, eps, y, mean, rstd); });
}
void CpuBackend::layernorm_backward(const Tensor& dy, const Tensor& x, const Tensor& w,
                                    const Tensor& mean, const Tensor& rstd, Tensor dx,
                                    bool accumulate_dx, Tensor dw, Tensor db) {
  dispatch(x.dtype, [&](auto tag) {
    layernorm_bwd<decltype(tag)>(dy, x, w, mean, rstd, dx, accumulate_dx, dw, db);
  });
}

void CpuBackend::conv_silu_forward(const Tensor& u, const Tensor& w, Tensor c, Tensor pre,
                                   const Tensor& win_in, Tensor win_out, const Tensor& slots, const Tensor& doc) {
  dispatch(u.dtype, [&](auto tag) { conv_fwd<decltype(tag)>(u, w, c, pre, win_in, win_out, slots, doc); });
}
void CpuBackend::conv_silu_backward(const Tensor& dc, const Tensor& u, const Tensor& w,
                                    const Tensor& pre, Tensor du, Tensor dw, const Tensor& doc) {
  dispatch(u.dtype, [&](auto tag) { conv_bwd<decltype(tag)>(dc, u, w, pre, du, dw, doc); });
}

void CpuBackend::gla_forward(const GlaParams& p, const Tensor& q, const Tensor& k, const Tensor& v,
                             Tensor o, const Tensor& s_in, Tensor s_out, const Tensor& slots) {
  cpu::gla_forward(p, q, k, v, o, s_in, s_out, slots);
}
void CpuBackend::gla_backward(const GlaParams& p, const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor& s_in, const Tensor& d_o, const Tensor& ds_out, Tensor dq,
                              Tensor dk, Tensor dv, Tensor ds_in) {
  cpu::gla_backward(p, q, k, v, s_in, d_o, ds_out, dq, dk, dv, ds_in);
}

void CpuBackend::gla_decode_gate_deferred(const GlaParams& p, const Tensor& q, const Tensor& k, const Tensor& v,
                                          const Tensor& g, const Tensor& w, double eps, Tensor states,
                                          const GlaPending& pend, const Tensor& slots, Tensor o, Tensor y) {
  cpu::gla_decode_deferred(p, q, k, v, o, states, pend, slots);
  rmsnorm_gate_forward(o, g, w, eps, y, Tensor{});
}

void CpuBackend::gla_pending_flush(const GlaParams& p, Tensor states, const GlaPending& pend, const Tensor& slots) {
  cpu::gla_pending_flush(p, states, pend, slots);
}

void CpuBackend::gla_verify_deferred(const GlaParams& p, const Tensor& q, const Tensor& k, const Tensor& v,
                                     const Tensor& g, const Tensor& w, double eps, const Tensor& states,
                                     const GlaPending& pend, const Tensor& slots, Tensor o, Tensor y) {
  // The gate per (token, head), as a decode step's (gla_decode_gate_deferred) takes it.
  cpu::gla_verify_deferred(p, q, k, v, o, states, pend, slots);
  rmsnorm_gate_forward(o, g, w, eps, y, Tensor{});
}

void CpuBackend::gla_verify_commit(const GlaParams& p, const Tensor& k, const Tensor& v, const Tensor& accepted,
                                   Tensor states, const GlaPending& pend, const Tensor& slots) {
  cpu::gla_verify_commit(p, k, v, accepted, states, pend, slots);
}

void CpuBackend::rmsnorm_gate_forward(const Tensor& o, const Tensor& g, const Tensor& w, double eps,
                                      Tensor y, Tensor rstd) {
  dispatch(o.dtype, [&](auto tag) { rmsgate_fwd<decltype(tag)>(o, g, w, eps, y, rstd); });
}
void CpuBackend::rmsnorm_gate_backward(const Tensor& dy, const Tensor& o, const Tensor& g,
                                       const Tensor& w, const Tensor& rstd, Tensor d_o, Tensor dg,
                                       Tensor dw) {
  dispatch(o.dtype, [&](auto tag) { rmsgate_bwd<decltype(tag)>(dy, o, g, w, rstd, d_o, dg, dw); });
}

void CpuBackend::swiglu_forward(const Tensor& ab, Tensor h) {
  dispatch(ab.dtype, [&](auto tag) { swiglu_fwd<decltype(tag)>(ab, h); });
}
void CpuBackend::swiglu_backward(const Tensor& dh, const Tensor& ab, Tensor dab) {
  dispatch(ab.dtype, [&](auto tag) { swiglu_bwd<decltype(tag)>(dh, ab, dab); });
}

// ---- FP8 products ---------------------------------------------------------------------------
// The reference the CUDA backend's are compared with: codes decode exactly to F32, each output's
// sum runs in F64 and is rounded once.

namespace {

void check_e4m3_matrix(const Tensor& t, const char* what) {
  check_cpu(t);
  LAPLACE_CHECK(t.dtype == DType::kF8E4M3 && t.ndim == 2 && t.is_contiguous(),
                (std::string(what) + " must be a contiguous 2-D F8_E4M3 tensor").c_str());
}

// Every code's value as F64 (exact), for the product's inner loops.
const std::array<double, 256>& e4m3_values() {
  static const std::array<double, 256> v = [] {
    std::array<double, 256> t{};
    for (int b = 0; b < 256; ++b) t[static_cast<size_t>(b)] = e4m3_to_float(static_cast<uint8_t>(b));
    return t;
  }();
  return v;
}

void check_scales(const Tensor& t, int64_t n, const char* what) {
  check_cpu(t);
  LAPLACE_CHECK(t.dtype == DType::kF32 && t.ndim == 1 && t.shape[0] == n && t.is_contiguous(),
                (std::string(what) + " must be contiguous F32 [" + std::to_string(n) + "]").c_str());
}

}  // namespace

void CpuBackend::quantize_rows_e4m3(const Tensor& x, Tensor q, Tensor s) {
  check_cpu(x);
  check_e4m3_matrix(q, "quantize_rows_e4m3: q");
  LAPLACE_CHECK(x.ndim == 2 && same_shape(x, q), "quantize_rows_e4m3: x and q must be one 2-D shape");
  check_scales(s, x.shape[0], "quantize_rows_e4m3: s");
  dispatch(x.dtype, [&](auto tag) {
    using T = decltype(tag);
    const Rows r = rows_of(x);
    uint8_t* qp = static_cast<uint8_t*>(q.data);
    float* sp = static_cast<float*>(s.data);
#pragma omp parallel for schedule(static) if (r.n * r.cols > kParallelMin)
    for (int64_t row = 0; row < r.n; ++row) {
      const T* p = row_ptr<T>(x, r, row);
      std::vector<float> xf(p, p + r.cols);
      sp[row] = e4m3_quantize_row(xf.data(), r.cols, qp + row * r.cols);
    }
  });
}

void CpuBackend::dequantize_rows_e4m3(const Tensor& q, const Tensor& s, Tensor w) {
  check_e4m3_matrix(q, "dequantize_rows_e4m3: q");
  check_scales(s, q.shape[0], "dequantize_rows_e4m3: s");
  check_cpu(w);
  LAPLACE_CHECK(same_shape(w, q) && w.is_contiguous(), "dequantize_rows_e4m3: w must be contiguous and of q's shape");
  dispatch(w.dtype, [&](auto tag) {
    using T = decltype(tag);
    const int64_t R = q.shape[0], C = q.shape[1];
    const uint8_t* qp = static_cast<const uint8_t*>(q.data);
    const float* sp = static_cast<const float*>(s.data);
    T* wp = static_cast<T*>(w.data);
#pragma omp parallel for schedule(static) if (R * C > kParallelMin)
    for (int64_t r = 0; r < R; ++r)
      for (int64_t c = 0; c < C; ++c) wp[r * C + c] = static_cast<T>(e4m3_dequantize(qp[r * C + c], sp[r]));
  });
}

void CpuBackend::quantize_cols_e4m3(const Tensor& x, Tensor qt, Tensor s) {
  check_cpu(x);
  check_e4m3_matrix(qt, "quantize_cols_e4m3: qt");
  LAPLACE_CHECK(x.ndim == 2 && qt.shape[0] == x.shape[1] && qt.shape[1] == x.shape[0],
                "quantize_cols_e4m3: qt must be x's shape transposed");
  check_scales(s, x.shape[1], "quantize_cols_e4m3: s");
  dispatch(x.dtype, [&](auto tag) {
    using T = decltype(tag);
    const Rows r = rows_of(x);
    uint8_t* qp = static_cast<uint8_t*>(qt.data);
    float* sp = static_cast<float*>(s.data);
#pragma omp parallel for schedule(static) if (r.n * r.cols > kParallelMin)
    for (int64_t col = 0; col < r.cols; ++col) {
      std::vector<float> xf(static_cast<size_t>(r.n));
      for (int64_t row = 0; row < r.n; ++row) xf[row] = static_cast<float>(row_ptr<T>(x, r, row)[col]);
      sp[col] = e4m3_quantize_row(xf.data(), r.n, qp + col * r.n);
    }
  });
}

// Exact products summed in F64 whatever `accum` allows. An E4M3 value is an integer multiple of
// 2^-9 below 2^8.9, so a product of two is a multiple of 2^-18 below 2^17.7, and a sum of K ≤
// kFp8ExactK of them a multiple of 2^-18 below 2^53·2^-18: every partial sum, in any order, is
// exact in F64. So the sums are taken by OpenBLAS's dgemm over tiles of the codes' values, and
// are the same numbers as a plain loop's (and batch-invariant, as the forward products must be:
// ops/cpu/gemm_rows.h); each is then scaled and rounded once. A few rows (a decode step) take a
// loop that reads W's codes as they are; longer K keeps a loop in k order.
void CpuBackend::gemm_e4m3(const Tensor& xq, const Tensor& xs, const Tensor& wq, const Tensor& ws, const Tensor& c,
                           Tensor y, Fp8Accum /*accum*/) {
  check_e4m3_matrix(xq, "gemm_e4m3: xq");
  check_e4m3_matrix(wq, "gemm_e4m3: wq");
  check_cpu(y);
  const int64_t M = xq.shape[0], K = xq.shape[1], N = wq.shape[0];
  LAPLACE_CHECK(wq.shape[1] == K, "gemm_e4m3: xq and wq must have one inner dimension K");
  LAPLACE_CHECK(y.ndim == 2 && y.shape[0] == M && y.shape[1] == N && y.is_contiguous(),
                "gemm_e4m3: y must be a contiguous [M, N]");
  if (c.defined()) {
    check_cpu(c);
    LAPLACE_CHECK(same_shape(c, y) && c.dtype == y.dtype && c.is_contiguous(),
                  "gemm_e4m3: c must be contiguous with y's shape and dtype");
  }
  check_scales(xs, M, "gemm_e4m3: xs");
  check_scales(ws, N, "gemm_e4m3: ws");
  if (M == 0 || N == 0) return;
  const double* value = e4m3_values().data();
  const uint8_t* xp = static_cast<const uint8_t*>(xq.data);
  const uint8_t* wp = static_cast<const uint8_t*>(wq.data);
  const float* xsp = static_cast<const float*>(xs.data);
  const float* wsp = static_cast<const float*>(ws.data);
  dispatch(y.dtype, [&](auto tag) {
    using T = decltype(tag);
    const T* cp = c.defined() ? static_cast<const T*>(c.data) : nullptr;
    T* yp = static_cast<T*>(y.data);
    // y[m][n] from the exact sum of row m and column n (the one rounding).
    auto out = [&](int64_t m, int64_t n, double acc) {
      const double add = cp ? static_cast<double>(cp[m * N + n]) : 0.0;
      yp[m * N + n] = static_cast<T>(add + acc * static_cast<double>(xsp[m]) * static_cast<double>(wsp[n]));
    };
    if (K > kFp8ExactK) {  // sums that may round: in k order
#pragma omp parallel for collapse(2) schedule(static) if (M * N * K > kParallelMin)
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < N; ++n) {
          double acc = 0;
          for (int64_t k = 0; k < K; ++k)
            acc += value[xp[m * K + k]] * value[wp[n * K + k]];
          out(m, n, acc);
        }
      return;
    }
    auto decode = [&](const uint8_t* q, int64_t rows, double* v) {
#pragma omp parallel for schedule(static) if (rows * K > kParallelMin)
      for (int64_t i = 0; i < rows * K; ++i) v[i] = value[q[i]];
    };
    if (M < kFp8BlasRows) {
      // X's few rows as F64, W's codes read as they are; eight partial sums per output, so that
      // the adds do not wait on one another (exact, so any split gives the same sum).
      std::vector<double> xv(static_cast<size_t>(M * K));
      decode(xp, M, xv.data());
#pragma omp parallel for collapse(2) schedule(static) if (M * N * K > kParallelMin)
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < N; ++n) {
          const double* xr = xv.data() + m * K;
          const uint8_t* wr = wp + n * K;
          double part[8] = {};
          int64_t k = 0;
          for (; k + 8 <= K; k += 8)
            for (int j = 0; j < 8; ++j) part[j] += xr[k + j] * value[wr[k + j]];
          double acc = 0;
          for (int j = 0; j < 8; ++j) acc += part[j];
          for (; k < K; ++k) acc += xr[k] * value[wr[k]];
          out(m, n, acc);
        }
      return;
    }
    // Tiles of rows of X and of W as F64 values, their product by dgemm.
    const int64_t tile = std::clamp(kFp8TileValues / K, kFp8BlasRows, kFp8TileRows);
    const int64_t mt = std::min(M, tile), nt = std::min(N, tile);
    std::vector<double> xv(static_cast<size_t>(mt * K)), wv(static_cast<size_t>(nt * K));
    std::vector<double> sums(static_cast<size_t>(mt * nt));
    for (int64_t n0 = 0; n0 < N; n0 += nt) {
      const int64_t nc = std::min(nt, N - n0);
      decode(wp + n0 * K, nc, wv.data());
      for (int64_t m0 = 0; m0 < M; m0 += mt) {
        const int64_t mc = std::min(mt, M - m0);
        decode(xp + m0 * K, mc, xv.data());
        cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(mc), static_cast<int>(nc),
                    static_cast<int>(K), 1.0, xv.data(), static_cast<int>(K), wv.data(), static_cast<int>(K), 0.0,
                    sums.data(), static_cast<int>(nc));
#pragma omp parallel for schedule(static) if (mc * nc > kParallelMin)
        for (int64_t i = 0; i < mc; ++i)
          for (int64_t j = 0; j < nc; ++j) out(m0 + i, n0 + j, sums[static_cast<size_t>(i * nc + j)]);
      }
    }
  });
}

void CpuBackend::argmax_rows(const Tensor& x, Tensor out) {
  LAPLACE_CHECK(out.dtype == DType::kI32 && out.is_contiguous(), "argmax_rows: out must be contiguous I32");
  int32_t* o = static_cast<int32_t*>(out.data);
  dispatch(x.dtype, [&](auto tag) {
    using T = decltype(tag);
    const Rows r = rows_of(x);
    LAPLACE_CHECK(r.n == out.numel(), "argmax_rows: out must have one entry per row of x");
#pragma omp parallel for schedule(static) if (r.n * r.cols > kParallelMin)
    for (int64_t row = 0; row < r.n; ++row) {
      const T* p = row_ptr<T>(x, r, row);
      int64_t best = 0;
      for (int64_t i = 1; i < r.cols; ++i)
        if (p[i] > p[best]) best = i;
      o[row] = static_cast<int32_t>(best);
    }
  });
}

void CpuBackend::cross_entropy_forward(const Tensor& logits, const Tensor& targets, Tensor losses) {
  dispatch(logits.dtype, [&](auto tag) { xent_fwd<decltype(tag)>(logits, targets, losses); });
}
void CpuBackend::cross_entropy_backward(const Tensor& logits, const Tensor& targets, double scale,
                                        Tensor dlogits) {
  dispatch(logits.dtype, [&](auto tag) { xent_bwd<decltype(tag)>(logits, targets, scale, dlogits); });
}

double CpuBackend::sum_squares(const Tensor& x) {
  double r = 0;
  dispatch(x.dtype, [&](auto tag) { r = sumsq<decltype(tag)>(x); });
  return r;
}

// Left to right per row, in double.
void CpuBackend::row_sum_squares(const Tensor& x, Tensor out) {
  LAPLACE_CHECK(out.dtype == DType::kF64 && out.numel() == (x.ndim >= 1 ? x.numel() / x.shape[x.ndim - 1] : 1),
                "row_sum_squares: out must be F64 with one entry per row of x");
  LAPLACE_CHECK(out.is_contiguous(), "row_sum_squares: out must be contiguous");
  double* o = static_cast<double*>(out.data);
  dispatch(x.dtype, [&](auto tag) {
    using T = decltype(tag);
    const Rows r = rows_of(x);  // one row per row of x (elem_rows would merge a contiguous x into one)
    LAPLACE_CHECK(r.n == out.numel(), "row_sum_squares: out must have one entry per row of x");
#pragma omp parallel for schedule(static) if (r.n * r.cols > kParallelMin)
    for (int64_t row = 0; row < r.n; ++row) {
      const T* p = row_ptr<T>(x, r, row);
      double s = 0;
      for (int64_t i = 0; i < r.cols; ++i) s += static_cast<double>(p[i]) * p[i];
      o[row] = s;
    }
  });
}

// m ← β1·m + (1−β1)·g;  v ← β2·v + (1−β2)·g²;
// w ← w·(1 − lr·wd) − lr·(m/(1−β1^t)) / (√(v/(1−β2^t)) + eps)
void CpuBackend::adamw_update(Tensor w, const Tensor& g, Tensor m, Tensor v, const AdamWParams& p) {
  LAPLACE_CHECK(p.step >= 1, "adamw_update: step is 1-based");
  const double b1 = p.beta1, b2 = p.beta2;
  const double bc1 = 1.0 - std::pow(b1, static_cast<double>(p.step));
  const double bc2 = 1.0 - std::pow(b2, static_cast<double>(p.step));
  const double decay = 1.0 - p.lr * p.wd, lr = p.lr, eps = p.eps;
  dispatch(w.dtype, [&](auto tag) {
    using T = decltype(tag);
    elementwise<T, 4>({w, g, m, v}, "adamw_update: w, g, m, v must share shape and dtype",
                      [&](auto& q, int64_t n) {
                        for (int64_t i = 0; i < n; ++i) {
                          const double gi = q[1][i];
                          const double mi = b1 * q[2][i] + (1.0 - b1) * gi;
                          const double vi = b2 * q[3][i] + (1.0 - b2) * gi * gi;
                          q[2][i] = static_cast<T>(mi);
                          q[3][i] = static_cast<T>(vi);
                          q[0][i] = static_cast<T>(q[0][i] * decay - lr * (mi / bc1) / (std::sqrt(vi / bc2) + eps));
                        }
                      });
  });
}

// m ← μ·m + g;  u = g + μ·m (Nesterov, with the new m) or u = m.
void CpuBackend::muon_momentum(const Tensor& g, Tensor m, Tensor u, double mu, bool nesterov) {
  dispatch(m.dtype, [&](auto tag) {
    using T = decltype(tag);
    elementwise<T, 3>({g, m, u}, "muon_momentum: g, m, u must share shape and dtype",
                      [&](auto& q, int64_t n) {
                        for (int64_t i = 0; i < n; ++i) {
                          const double gi = q[0][i];
                          const T mi = static_cast<T>(mu * q[1][i] + gi);
                          q[1][i] = mi;
                          q[2][i] = nesterov ? static_cast<T>(gi + mu * mi) : mi;
                        }
                      });
  });
}

// w ← w·(1 − lr·wd) − lr·s·o
void CpuBackend::muon_apply(Tensor w, const Tensor& o, double lr, double wd, double s) {
  const double decay = 1.0 - lr * wd, k = lr * s;
  dispatch(w.dtype, [&](auto tag) {
    using T = decltype(tag);
    elementwise<T, 2>({w, o}, "muon_apply: w and o must share shape and dtype", [&](auto& q, int64_t n) {
      for (int64_t i = 0; i < n; ++i) q[0][i] = static_cast<T>(q[0][i] * decay - k * q[1][i]);
    });
  });
}

// ---- device scalars: host memory here, so each op is the host-scalar op it mirrors ----

namespace {
double& scalar_at(const Tensor& t, int64_t i, const char* what) {
  check_cpu(t);
  LAPLACE_CHECK(t.dtype == DType::kF64 && t.numel() > i, what);
  return static_cast<double*>(t.data)[i * (t.ndim ? t.stride[0] : 1)];
}
bool skipped(const Tensor& skip) { return scalar_at(skip, 0, "skip must be an F64 scalar") != 0.0; }
}  // namespace

void CpuBackend::sum_squares_into(const Tensor& x, Tensor acc, bool accumulate) {
  double& a = scalar_at(acc, 0, "sum_squares_into: acc must be an F64 scalar");
  const double s = sum_squares(x);
  a = accumulate ? a + s : s;
}

void CpuBackend::grad_clip_scalars(const Tensor& ss, double max_norm, Tensor out) {
  const double norm = std::sqrt(scalar_at(ss, 0, "grad_clip_scalars: ss must be an F64 scalar"));
  const bool skip = !std::isfinite(norm);
  scalar_at(out, 2, "grad_clip_scalars: out must be F64 [3]") = skip ? 1.0 : 0.0;
  scalar_at(out, 1, "grad_clip_scalars: out must be F64 [3]") =
      (!skip && max_norm > 0 && norm > max_norm) ? max_norm / (norm + 1e-6) : 1.0;
  scalar_at(out, 0, "grad_clip_scalars: out must be F64 [3]") = norm;
}

void CpuBackend::scale_by(Tensor x, const Tensor& coef) {
  const double c = scalar_at(coef, 0, "scale_by: coef must be an F64 scalar");
  if (c != 1.0) scale(x, c);
}

void CpuBackend::scale_by_inv_norm(Tensor x, const Tensor& ss, double eps) {
  const double norm = std::sqrt(scalar_at(ss, 0, "scale_by_inv_norm: ss must be an F64 scalar"));
  scale(x, 1.0 / (norm + eps));
}

void CpuBackend::adamw_update_gated(Tensor w, const Tensor& g, Tensor m, Tensor v, const AdamWParams& p,
                                    const Tensor& skip) {
  if (!skipped(skip)) adamw_update(w, g, m, v, p);
}

void CpuBackend::muon_momentum_gated(const Tensor& g, Tensor m, Tensor u, double mu, bool nesterov,
                                     const Tensor& skip) {
  if (!skipped(skip)) muon_momentum(g, m, u, mu, nesterov);
}

void CpuBackend::muon_apply_gated(Tensor w, const Tensor& o, double lr, double wd, double s, const Tensor& skip) {
  if (!skipped(skip)) muon_apply(w, o, lr, wd, s);
}

void CpuBackend::loss_sum_into(const Tensor& losses, double count, Tensor acc, bool accumulate) {
  check_cpu(losses);
  LAPLACE_CHECK(losses.ndim == 1 && losses.is_contiguous() &&
                    (losses.dtype == DType::kF32 || losses.dtype == DType::kF64),
                "loss_sum_into: losses must be a contiguous F32 or F64 vector");
  double& a = scalar_at(acc, 0, "loss_sum_into: acc must be an F64 scalar");
  const double sum = fixed_order_sum(losses.numel(), [&](int64_t i) {
    return losses.dtype == DType::kF64 ? static_cast<const double*>(losses.data)[i]
                                       : static_cast<double>(static_cast<const float*>(losses.data)[i]);
  });
  const double l = count > 0 ? sum / count : 0.0;
  a = accumulate ? a + l : l;
}

bool CpuBackend::memory_info(size_t* free_bytes, size_t* total_bytes) {
  const long page = sysconf(_SC_PAGESIZE), avail = sysconf(_SC_AVPHYS_PAGES), phys = sysconf(_SC_PHYS_PAGES);
  if (page <= 0 || avail < 0 || phys <= 0) return false;
  *free_bytes = static_cast<size_t>(avail) * static_cast<size_t>(page);
  *total_bytes = static_cast<size_t>(phys) * static_cast<size_t>(page);
  return true;
}

std::unique_ptr<Backend> make_cpu_backend() { return std::make_unique<CpuBackend>(); }

}  // namespace laplace
