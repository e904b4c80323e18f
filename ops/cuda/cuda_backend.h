// The CUDA backend: one device, one stream, a cuBLASLt handle with a fixed workspace.
// Every op is queued on the backend's stream in call order; only copies that read device
// memory into the host (D2H, H2H, non-contiguous H2D), sum_squares and synchronize() wait
// for the device. Contiguous H2D copies are staged through pinned buffers and queued.
//
// Built for sm_90a (H100/H200). make_cuda_backend() probes the machine first and returns
// nullptr with a reason (no driver, no device, no kernel image for the device) instead of
// aborting; once a backend exists, CUDA failures abort with file:line (ops/cuda/cuda_check.h).
//
// ---- Dtype rules (anything else fails a LAPLACE_CHECK) ----------------------------------
// "float" below means F32 or BF16, chosen per tensor (they may differ within one call);
// every op loads to F32, computes in F32 and rounds once on the store. States, windows,
// norm statistics and losses are F32 only. Index tensors are I32.
//  copy            same dtype: any dtype, any direction (H2D/D2H/D2D/H2H), strided views
//                  (innermost dim contiguous). F32<->BF16 conversion: D2D, H2D and D2H (the
//                  host side staged through device scratch). Copies into host memory are
//                  synchronous; contiguous H2D copies are queued (the host buffer is copied
//                  into pinned staging first, so the caller may reuse it at once).
//  fill            F32, BF16, F64, I32 (device).
//  axpy, scale     float x, float y.
//  gemm            (A, B, C) = (BF16, BF16, F32), (BF16, BF16, BF16) or (F32, F32, F32);
//                  F32 compute (no TF32), alpha/beta F32. 2-D, innermost stride 1.
//  embedding       ids I32 [N]; table, out, dout float; dtable float (F32 advised: it
//                  accumulates). Ids outside [0, V) give a zero row / no gradient.
//  layernorm       x, y, dy, dx float; w, b float [D] (b may be undefined); mean, rstd F32
//                  [N] contiguous (optional: recomputed by the backward when undefined,
//                  with eps = 1e-5, the model's norm_eps); dw, db float [D] (accumulate).
//  conv_silu       u, c, pre, dc, du float [B,T,D]; w, dw float [D,K], K <= 8; win_in/win_out
//                  float [S,K,D] (BF16 in a BF16 state pool) with win[s,j] = u_{T-K+j} (j = K-1 the newest input, oldest
//                  first); slots I32 [B] or undefined. pre may be undefined in the backward
//                  (recomputed from u and w with a zero window). doc (optional): I32 [B,T]
//                  contiguous on the GPU (GlaParams::doc's form; its values are not checked on
//                  the device: an invalid row gives wrong values, never out-of-range reads); a
//                  T = 1 call with doc runs the generic kernels.
//  gla             q, k, v, o, d_o, dq, dk, dv float; s_in, s_out, ds_in, ds_out F32 [S,H,dk,dv]
//                  (dv contiguous); dk <= 128, dv <= 256, H <= 128; slots I32 [B] (not
//                  range-checked on the device).
//                  T = 1 (decode) runs the streaming decode kernel (kernels_gla_decode.cu),
//                  which also takes BF16 states (F32 arithmetic, one rounding per store) when
//                  dv % 4 == 0 and state rows are 4-element aligned.
//                  Otherwise all three forms run the same chunked kernels (they agree to rounding). At
//                  dk = 96, dv = 192 with bf16 q/k/v (and dO), T >= 32, the tensor-core kernels
//                  (chunk 128, fp32 states) run; otherwise the generic FP32-FMA kernels, whose
//                  internal chunk is min(p.chunk, a size that fits shared memory).
//                  p.doc (optional): I32 [B,T] contiguous on the GPU, not checked on the device
//                  (as conv_silu's doc). Every path but decode takes it; a T = 1 gla_forward
//                  with doc runs the generic kernels instead of the decode kernel.
//  gla_decode_gate the decode kernel with the rmsnorm_gate epilogue fused: the same bits as
//                  gla_forward (T = 1) followed by rmsnorm_gate_forward.
//  gla_decode_gate_deferred / gla_pending_flush  the same kernel reading S every step and
//                  writing it every R-th (R = 4, 8, 16); pairs F32/BF16, states F32/BF16.
//  rmsnorm_gate    o, g, y, dy, d_o, dg float; w, dw float [dv]; rstd F32 [B,T,H] contiguous
//                  (optional: recomputed by the backward when undefined, eps = 1e-5).
//  swiglu          ab, h, dh, dab float. dab may alias ab.
//  cross_entropy   logits, dlogits float [N,V] (dlogits may alias logits); targets I32 [N]
//                  contiguous; losses F32 [N] contiguous. A target >= V gives a NaN loss.
//  sum_squares     float x; accumulated in F64 in a fixed order, returned to the host.
//  sum_squares_into  the same sum into a device scalar (no sync); the *_gated optimizer ops,
//                  scale_by, scale_by_inv_norm, grad_clip_scalars and loss_sum_into take F64
//                  device scalars (ops/backend.h) and never synchronise.
//  adamw_update    w F32 (master), g float, m F32, v F32.
//  muon_momentum   g float, m F32, u float.
//  muon_apply      w F32, o float.
//
// Aliasing: as in ops/backend.h (s_out/s_in, win_out/win_in, dlogits/logits); besides,
// dx may alias dy (layernorm), d_o/dg may alias dy (rmsnorm_gate) and dab may alias ab.
// conv_silu's c must not alias u and du must not alias dc (neighbouring rows are read).
//
// Determinism: no atomics anywhere; every reduction has a fixed order that depends only on
// the shapes; gemm algorithms are chosen once per (shape, layout, dtype, alignment) and
// cached, with split-K excluded.
//
// Lifetime: arenas made with allocator() must be destroyed before the backend.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "ops/backend.h"

namespace laplace {

// Device memory for arenas: cudaMalloc/cudaFree; zero() is queued on the backend's stream.
class CudaAllocator final : public Allocator {
 public:
  explicit CudaAllocator(cudaStream_t stream) : stream_(stream) {}
  Device device() const override { return Device::kCUDA; }
  void* allocate(size_t bytes) override;  // nullptr on failure (the error is cleared)
  void deallocate(void* p) override;
  void zero(void* p, size_t bytes) override;

 private:
  cudaStream_t stream_;
};

class CudaBackend final : public Backend {
 public:
  // Takes the device `device` (aborts on CUDA errors: probe with make_cuda_backend).
  explicit CudaBackend(int device);
  ~CudaBackend() override;
  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  Device device() const override { return Device::kCUDA; }
  const char* name() const override { return "cuda"; }
  Allocator& allocator() override { return *alloc_; }

  void copy(Tensor dst, const Tensor& src) override;
  void fill(Tensor dst, double value) override;
  void axpy(double alpha, const Tensor& x, Tensor y) override;
  void synchronize() override;
  bool memory_info(size_t* free_bytes, size_t* total_bytes) override;  // cudaMemGetInfo

  void gemm(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, Tensor c, double alpha,
            double beta) override;
  void gemm_add(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, const Tensor& c, Tensor d,
                double alpha, double beta) override;

  // FP8 products (ops/cuda/kernels_fp8.cu): one block per row quantises; the product is one
  // cuBLASLt call with per-row ("outer vector") scales on both operands.
  void quantize_rows_e4m3(const Tensor& x, Tensor q, Tensor s) override;
  void dequantize_rows_e4m3(const Tensor& q, const Tensor& s, Tensor w) override;
  void quantize_cols_e4m3(const Tensor& x, Tensor qt, Tensor s) override;
  void quantize_rows_cols_e4m3(const Tensor& x, Tensor q, Tensor s, Tensor qt, Tensor st) override;
  void gemm_e4m3(const Tensor& xq, const Tensor& xs, const Tensor& wq, const Tensor& ws, const Tensor& c,
                 Tensor y, Fp8Accum accum) override;
  void swiglu_forward_e4m3(const Tensor& ab, Tensor h, Tensor q, Tensor s) override;
  void layernorm_forward_e4m3(const Tensor& x, const Tensor& w, const Tensor& b, double eps, Tensor y, Tensor q,
                              Tensor s) override;

  void embedding_forward(const Tensor& ids, const Tensor& table, Tensor out) override;
  void embedding_backward(const Tensor& ids, const Tensor& dout, Tensor dtable) override;

  void layernorm_forward(const Tensor& x, const Tensor& w, const Tensor& b, double eps, Tensor y,
                         Tensor mean, Tensor rstd) override;
  void layernorm_backward(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& mean,
                          const Tensor& rstd, Tensor dx, bool accumulate_dx, Tensor dw,
                          Tensor db) override;

  void conv_silu_forward(const Tensor& u, const Tensor& w, Tensor c, Tensor pre,
                         const Tensor& win_in, Tensor win_out, const Tensor& slots, const Tensor& doc) override;
  void conv_silu_backward(const Tensor& dc, const Tensor& u, const Tensor& w, const Tensor& pre,
                          Tensor du, Tensor dw, const Tensor& doc) override;

  void gla_forward(const GlaParams& p, const Tensor& q, const Tensor& k, const Tensor& v, Tensor o,
                   const Tensor& s_in, Tensor s_out, const Tensor& slots) override;
  void gla_backward(const GlaParams& p, const Tensor& q, const Tensor& k, const Tensor& v,
                    const Tensor& s_in, const Tensor& d_o, const Tensor& ds_out, Tensor dq,
                    Tensor dk, Tensor dv, Tensor ds_in) override;

  void gla_decode_gate(const GlaParams& p, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                       const Tensor& w, double eps, Tensor states, const Tensor& slots, Tensor o,
                       Tensor y) override;
  void gla_decode_gate_deferred(const GlaParams& p, const Tensor& q, const Tensor& k, const Tensor& v,
                                const Tensor& g, const Tensor& w, double eps, Tensor states, const GlaPending& pend,
                                const Tensor& slots, Tensor o, Tensor y) override;
  void gla_pending_flush(const GlaParams& p, Tensor states, const GlaPending& pend, const Tensor& slots) override;
  void rmsnorm_gate_forward(const Tensor& o, const Tensor& g, const Tensor& w, double eps, Tensor y,
                            Tensor rstd) override;
  void rmsnorm_gate_backward(const Tensor& dy, const Tensor& o, const Tensor& g, const Tensor& w,
                             const Tensor& rstd, Tensor d_o, Tensor dg, Tensor dw) override;

  void swiglu_forward(const Tensor& ab, Tensor h) override;
  void swiglu_backward(const Tensor& dh, const Tensor& ab, Tensor dab) override;

  void argmax_rows(const Tensor& x, Tensor out) override;
  void cross_entropy_forward(const Tensor& logits, const Tensor& targets, Tensor losses) override;
  void cross_entropy_backward(const Tensor& logits, const Tensor& targets, double scale,
                              Tensor dlogits) override;

  double sum_squares(const Tensor& x) override;
  void row_sum_squares(const Tensor& x, Tensor out) override;
  void scale(Tensor x, double alpha) override;
  void adamw_update(Tensor w, const Tensor& g, Tensor m, Tensor v, const AdamWParams& p) override;
  void muon_momentum(const Tensor& g, Tensor m, Tensor u, double mu, bool nesterov) override;
  void muon_apply(Tensor w, const Tensor& o, double lr, double wd, double s) override;
  void sum_squares_into(const Tensor& x, Tensor acc, bool accumulate) override;
  void grad_clip_scalars(const Tensor& ss, double max_norm, Tensor out) override;
  void scale_by(Tensor x, const Tensor& coef) override;
  void scale_by_inv_norm(Tensor x, const Tensor& ss, double eps) override;
  void adamw_update_gated(Tensor w, const Tensor& g, Tensor m, Tensor v, const AdamWParams& p,
                          const Tensor& skip) override;
  void muon_momentum_gated(const Tensor& g, Tensor m, Tensor u, double mu, bool nesterov,
                           const Tensor& skip) override;
  void muon_apply_gated(Tensor w, const Tensor& o, double lr, double wd, double s, const Tensor& skip) override;
  void loss_sum_into(const Tensor& losses, double count, Tensor acc, bool accumulate) override;

  Status capture(const std::function<void()>& queue_ops, std::unique_ptr<Graph>* out) override;

  // ---- CUDA specifics ----
  cudaStream_t stream() const { return stream_; }
  void* native_stream() override { return stream_; }
  // F32 and BF16 operands (F32 states and accumulators beside BF16 ones); no F64. The GLA
  // kernels hold a head's state on chip: dk <= kMaxGlaDk, dv <= kMaxGlaDv, and the decode
  // kernels at most kMaxDecodeHeads heads (the limits kernels_gla.cu and
  // kernels_gla_decode.cu check).
  bool supports(const OpQuery& q) const override;
  // The chunked GLA kernels (tensor-core and generic) and the conv kernels take GlaParams::doc
  // (tests/test_cuda_varlen.cpp); decode steps do not (a request starts from a fresh slot).
  bool keeps_documents_apart() const override { return true; }
  static constexpr int64_t kMaxGlaDk = 128, kMaxGlaDv = 256, kMaxDecodeHeads = 128;
  int device_id() const { return device_; }
  int num_sms() const { return num_sms_; }
  // Largest dynamic shared memory one block may opt into (bytes).
  int max_smem_optin() const { return max_smem_optin_; }
  // Device scratch of at least `bytes`, reused by every op (stream-ordered, so an op may
  // use it freely between its own launches). Growing it synchronises the device.
  void* scratch(size_t bytes);
  // Host synchronisations so far: stream syncs (synchronize(), copies that read device
  // memory into the host, sum_squares, scratch growth) and waits for a busy H2D staging
  // buffer. A training step queued between two readings that differ by 0 made the host
  // wait for the device nowhere (tests assert this).
  int64_t host_syncs() const { return host_syncs_; }
  // cuBLASLt memsets that capture() replaced by one zeroing at the head of their graph so far (see
  // gather_gemm_memsets in cuda_backend.cpp); tests read it.
  int64_t graph_memsets_moved() const { return graph_memsets_moved_; }
  // Gemm tuning (gemm_tune in cuda_backend.cpp): the first eager call of a large gemm shape
  // times cuBLASLt's candidate algorithms on its own operands and keeps the fastest of those
  // whose output has the heuristic pick's bytes. On by default; LAPLACE_GEMM_TUNE=0 turns it
  // off for the process, =verbose prints each choice. Shapes planned while it is off keep
  // the heuristic's pick; tuned ones keep their choice.
  void set_tuning(bool on) override { gemm_tune_ = on && gemm_tune_allowed_; }
  // Shapes whose candidates were timed, and those of them now running another candidate
  // than the heuristic's first; tests and benchmarks read them.
  int64_t gemm_shapes_tuned() const { return gemm_shapes_tuned_; }
  int64_t gemm_shapes_switched() const { return gemm_shapes_switched_; }
  // Readies `kernel` for launches with `dyn_bytes` of dynamic shared memory: raises its limit
  // to dyn_bytes and, with max_carveout, asks for the largest shared-memory carveout. Each
  // attribute is set once per value that raises it: cudaFuncSetAttribute is a host API call
  // dearer than a launch, which eager launches (one per layer per decode step) would otherwise
  // pay each time.
  // Like the rest of the backend, for one host thread at a time.
  template <class Kernel>
  void kernel_smem(Kernel* kernel, size_t dyn_bytes, bool max_carveout = false) {
    kernel_smem_set(reinterpret_cast<const void*>(kernel), dyn_bytes, max_carveout);
  }
  // CUDA function-attribute calls (reads and sets) made by kernel_smem so far; tests read it.
  int64_t kernel_attr_calls() const { return kernel_attr_calls_; }
  // A fingerprint of `bytes` bytes of device memory (order-independent 64-bit hash of the
  // words and their positions): equal bytes give equal values. Synchronises.
  uint64_t fingerprint(const void* p, size_t bytes);

 private:
  struct GemmPlan {
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
    cublasLtMatmulAlgo_t algo{};
    size_t ws_needed = 0;  // the workspace the algorithm asks for (bytes)
    // While the plan awaits tuning: the heuristic's candidates in its order, with their
    // workspace sizes (algo is candidates[0]); emptied once tuned or first used in a capture.
    std::vector<cublasLtMatmulHeuristicResult_t> candidates;
  };
  using GemmKey = std::array<int64_t, 15>;
  // A matmul preference with the workspace's size and no split-K (the caller destroys it).
  cublasLtMatmulPreference_t gemm_preference() const;
  GemmPlan& gemm_plan(const GemmKey& key);
  // Operands of one cublasLtMatmul call in cuBLASLt's order, D = α·A·B + β·C: its A is our b
  // (layout lb), its B our a (layout la); d_span: bytes from d to the end of its last row.
  struct GemmCall {
    const void* lt_a;
    const void* lt_b;
    const void* c;
    void* d;
    float alpha, beta;
    size_t d_span;
  };
  void gemm_tune(GemmPlan& plan, const GemmCall& call, const GemmKey& key);

  int device_ = 0;
  int num_sms_ = 0;
  int max_smem_optin_ = 0;
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<CudaAllocator> alloc_;
  cublasLtHandle_t lt_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  void* scratch_ = nullptr;
  size_t scratch_bytes_ = 0;
  double* host_f64_ = nullptr;  // pinned, one double: sum_squares' result
  std::map<GemmKey, GemmPlan> gemm_plans_;
  // gemm_e4m3's plans by (M, N, K, output dtype, fast accumulation); the scale pointers are set
  // on each call.
  struct Fp8GemmPlan {
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t lw = nullptr, lx = nullptr, ly = nullptr;
    cublasLtMatmulAlgo_t algo{};
    size_t ws_needed = 0;
  };
  std::map<std::array<int64_t, 5>, Fp8GemmPlan> fp8_plans_;
  // sw, sx: the scale vectors of the first call, set before the heuristic query (cuBLASLt
  // validates outer-vector scale modes against their pointers); each call sets its own.
  Fp8GemmPlan& fp8_gemm_plan(int64_t M, int64_t N, int64_t K, DType out, bool fast, const void* sw, const void* sx);
  int64_t host_syncs_ = 0;
  // Per kernel: the dynamic shared-memory limit set so far (0: none) and whether the
  // carveout was set (kernel_smem).
  struct KernelAttrs {
    size_t smem_limit = 0;
    bool carveout = false;
  };
  std::map<const void*, KernelAttrs> kernel_attrs_;
  int64_t kernel_attr_calls_ = 0;
  void kernel_smem_set(const void* kernel, size_t dyn_bytes, bool max_carveout);

  // While capture() runs: each gemm's last captured node, the nodes the capture had reached
  // when it was queued (its inputs' producers) and its workspace slot in counters_ (−1: the
  // shared workspace), in queue order. See gather_gemm_memsets.
  struct CapturedGemm {
    std::vector<cudaGraphNode_t> before;
    cudaGraphNode_t kernel = nullptr;
    int64_t slot = -1;
  };
  static constexpr size_t kCounterSlot = 256;     // bytes per captured gemm (cuBLASLt's alignment)
  static constexpr int64_t kCounterSlots = 1024;  // gemms per graph that get one
  bool capturing_ = false;
  bool gather_memsets_ = true;
  bool counters_at_tail_ = true;  // false under LAPLACE_GRAPH_COUNTERS=head (see the constructor)
  void* counters_ = nullptr;  // [kCounterSlots × kCounterSlot] bytes, allocated at the first capture
  std::vector<CapturedGemm> captured_gemms_;
  int64_t slots_used_ = 0;  // of counters_, in the capture running
  // Every cublasLtMatmul goes through these: the workspace a gemm whose algorithm needs
  // ws_needed bytes gets (while capturing, a counter slot of its own when that is enough) with
  // its record, and after the call the record kept for gather_gemm_memsets.
  struct GemmLaunch {
    void* ws;
    size_t ws_bytes;
    CapturedGemm rec;
  };
  GemmLaunch gemm_launch_begin(size_t ws_needed);
  void gemm_launch_end(GemmLaunch&& g);
  int64_t graph_memsets_moved_ = 0;
  bool gemm_tune_ = true;
  bool gemm_tune_allowed_ = true;  // false under LAPLACE_GEMM_TUNE=0
  bool gemm_tune_verbose_ = false;
  int64_t gemm_shapes_tuned_ = 0, gemm_shapes_switched_ = 0;
  std::vector<cudaGraphNode_t> capture_frontier() const;
  int64_t gather_gemm_memsets(cudaGraph_t graph) const;

  // Host-to-device copies are staged through pinned buffers so they need no stream sync:
  // the host data is copied into a free staging buffer at once (so the caller may reuse
  // its buffer, as the copy contract says) and the DMA is queued; `done` is recorded after
  // it, and a buffer is reused only once its event has completed (cudaEventQuery).
  struct Staging {
    void* p = nullptr;
    size_t cap = 0;
    cudaEvent_t done = nullptr;
  };
  std::vector<Staging> staging_;
  // Queues dst ← src through a staging buffer; false (nothing queued) unless both are
  // contiguous, of one dtype, src on the host and dst on the device.
  bool copy_h2d_staged(Tensor dst, const Tensor& src);
  void adamw_launch(Tensor w, const Tensor& g, Tensor m, Tensor v, const AdamWParams& p, const double* skip);
  void muon_momentum_launch(const Tensor& g, Tensor m, Tensor u, double mu, bool nesterov, const double* skip);
  void muon_apply_launch(Tensor w, const Tensor& o, double lr, double wd, double s, const double* skip);
};

namespace cuda {
// F32 <-> BF16 (or same-dtype float) device-to-device copy of equal-shaped views.
void convert_copy(Tensor dst, const Tensor& src, cudaStream_t stream);
// cudaSuccess when this binary has a kernel image the current device can run.
cudaError_t probe_kernel_image();
// GLA tensor-core fast path (ops/cuda/kernels_gla_tc.cu): dk = 96, dv = 192, bf16 q/k/v/dO,
// T >= 32, 16-byte aligned rows. Returns false (having queued nothing) when the arguments are
// outside it; the caller then runs the generic kernels (ops/cuda/kernels_gla.cu).
bool gla_tc_forward(CudaBackend& be, const GlaParams& p, const Tensor& q, const Tensor& k, const Tensor& v, Tensor o,
                    const Tensor& s_in, Tensor s_out, const Tensor& slots);
// GLA decode fast path (ops/cuda/kernels_gla_decode.cu): T = 1, F32 or BF16 states
// (in place or not), optionally fused with the output gate (g, w, eps, y non-null). Returns
// false (having queued nothing) when the arguments are outside it.
bool gla_decode_forward(CudaBackend& be, const GlaParams& p, const Tensor& q, const Tensor& k, const Tensor& v,
                        Tensor o, const Tensor& s_in, Tensor s_out, const Tensor& slots, const Tensor* g,
                        const Tensor* w, double eps, Tensor* y);
bool gla_tc_backward(CudaBackend& be, const GlaParams& p, const Tensor& q, const Tensor& k, const Tensor& v,
                     const Tensor& s_in, const Tensor& d_o, const Tensor& ds_out, Tensor dq, Tensor dk, Tensor dv,
                     Tensor ds_in);
// Document starts (GlaParams::doc's form, ops/backend.h) for B rows of T tokens: nullptr when
// undefined, else its data after checking that it is an I32 [B, T] contiguous tensor on the GPU
// (a LAPLACE_CHECK naming `what` otherwise). The values are not read (that would synchronise).
const int32_t* doc_starts_arg(const Tensor& doc, int64_t B, int64_t T, const char* what);
}  // namespace cuda

}  // namespace laplace
