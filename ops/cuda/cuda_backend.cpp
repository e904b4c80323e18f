// CudaBackend: allocator, stream, copies, cuBLASLt gemm and the factory. The kernels live in
// ops/cuda/kernels_*.cu (member functions of CudaBackend defined there).
#include "ops/cuda/cuda_backend.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "ops/cuda/cuda_check.h"

namespace laplace {

namespace {

constexpr size_t kWorkspaceBytes = 32u << 20;  // cuBLASLt workspace (Hopper: 32 MiB advised)

void require_device(const Tensor& t, const char* what) {
  if (t.defined() && t.device != Device::kCUDA)
    check_failed(__FILE__, __LINE__, what, ("tensor must live on the GPU: " + t.shape_str()).c_str());
}

// Largest power of two (≤ 256) dividing the address: the alignment cuBLASLt may assume.
uint32_t pointer_alignment(const void* p) {
  uintptr_t a = reinterpret_cast<uintptr_t>(p);
  uint32_t al = 256;
  while (al > 1 && (a % al) != 0) al >>= 1;
  return al;
}

cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::kF32: return CUDA_R_32F;
    case DType::kBF16: return CUDA_R_16BF;
    default: LAPLACE_CHECK(false, "gemm: dtype must be F32 or BF16");
  }
  return CUDA_R_32F;
}

}  // namespace

// ---- allocator ---------------------------------------------------------------------------------

void* CudaAllocator::allocate(size_t bytes) {
  void* p = nullptr;
  cudaError_t e = cudaMalloc(&p, bytes ? bytes : 256);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky-free error so later calls are unaffected
    return nullptr;
  }
  return p;
}

void CudaAllocator::deallocate(void* p) {
  if (p) CUDA_CHECK(cudaFree(p));
}

void CudaAllocator::zero(void* p, size_t bytes) {
  if (p && bytes) CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, stream_));
}

// ---- backend -----------------------------------------------------------------------------------

CudaBackend::CudaBackend(int device) : device_(device) {
  CUDA_CHECK(cudaSetDevice(device_));
  CUDA_CHECK(cudaDeviceGetAttribute(&num_sms_, cudaDevAttrMultiProcessorCount, device_));
  CUDA_CHECK(cudaDeviceGetAttribute(&max_smem_optin_, cudaDevAttrMaxSharedMemoryPerBlockOptin, device_));
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  alloc_ = std::make_unique<CudaAllocator>(stream_);
  CUBLAS_CHECK(cublasLtCreate(&lt_));
  workspace_bytes_ = kWorkspaceBytes;
  // Diagnostics: LAPLACE_GRAPH_GEMM_MEMSETS=keep captures cuBLASLt's memsets where it queued
  // them (to time what gather_gemm_memsets saves).
  if (const char* v = std::getenv("LAPLACE_GRAPH_GEMM_MEMSETS")) gather_memsets_ = std::strcmp(v, "keep") != 0;
  // The gathered counters are zeroed at the end of each graph (and once when allocated), so that
  // a replay does not begin with the fill kernel: a graph rooted at a kernel waits for it before
  // anything else starts. LAPLACE_GRAPH_COUNTERS=head zeroes them at the graph's head instead.
  if (const char* v = std::getenv("LAPLACE_GRAPH_COUNTERS")) counters_at_tail_ = std::strcmp(v, "head") != 0;
  if (const char* v = std::getenv("LAPLACE_GEMM_TUNE")) {
    gemm_tune_ = gemm_tune_allowed_ = std::strcmp(v, "0") != 0;
    gemm_tune_verbose_ = std::strcmp(v, "verbose") == 0;
  }
  CUDA_CHECK(cudaMalloc(&workspace_, workspace_bytes_));
  CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&host_f64_), sizeof(double)));
}

CudaBackend::~CudaBackend() {
  // Errors are ignored here: a destructor must not abort while unwinding a failed test.
  cudaStreamSynchronize(stream_);
  for (auto& kv : gemm_plans_) {
    cublasLtMatrixLayoutDestroy(kv.second.la);
    cublasLtMatrixLayoutDestroy(kv.second.lb);
    cublasLtMatrixLayoutDestroy(kv.second.lc);
    cublasLtMatmulDescDestroy(kv.second.desc);
  }
  for (auto& kv : fp8_plans_) {
    cublasLtMatrixLayoutDestroy(kv.second.lw);
    cublasLtMatrixLayoutDestroy(kv.second.lx);
    cublasLtMatrixLayoutDestroy(kv.second.ly);
    cublasLtMatmulDescDestroy(kv.second.desc);
  }
  if (lt_) cublasLtDestroy(lt_);
  if (workspace_) cudaFree(workspace_);
  if (counters_) cudaFree(counters_);
  if (scratch_) cudaFree(scratch_);
  if (host_f64_) cudaFreeHost(host_f64_);
  for (Staging& st : staging_) {
    cudaEventDestroy(st.done);
    cudaFreeHost(st.p);
  }
  if (stream_) cudaStreamDestroy(stream_);
}

void CudaBackend::synchronize() {
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  ++host_syncs_;
}

// ---- graphs ---------------------------------------------------------------------------------------

namespace {

class CudaGraph final : public Graph {
 public:
  CudaGraph(cudaGraph_t g, cudaGraphExec_t e, cudaStream_t s) : graph_(g), exec_(e), stream_(s) {}
  ~CudaGraph() override {
    cudaGraphExecDestroy(exec_);
    cudaGraphDestroy(graph_);
  }
  void launch() override { CUDA_CHECK(cudaGraphLaunch(exec_, stream_)); }

 private:
  cudaGraph_t graph_;
  cudaGraphExec_t exec_;
  cudaStream_t stream_;
};

// A node's dependencies or dependents (get = cudaGraphNodeGetDependencies / …DependentNodes).
using NodeListFn = cudaError_t (*)(cudaGraphNode_t, cudaGraphNode_t*, cudaGraphEdgeData*, size_t*);
std::vector<cudaGraphNode_t> node_list(cudaGraphNode_t n, NodeListFn get) {
  size_t k = 0;
  CUDA_CHECK(get(n, nullptr, nullptr, &k));
  std::vector<cudaGraphNode_t> v(k);
  if (k) CUDA_CHECK(get(n, v.data(), nullptr, &k));
  return v;
}
std::vector<cudaGraphNode_t> graph_deps(cudaGraphNode_t n) { return node_list(n, cudaGraphNodeGetDependencies); }
std::vector<cudaGraphNode_t> graph_dependents(cudaGraphNode_t n) { return node_list(n, cudaGraphNodeGetDependentNodes); }

bool same_nodes(std::vector<cudaGraphNode_t> a, std::vector<cudaGraphNode_t> b) {
  std::sort(a.begin(), a.end());
  std::sort(b.begin(), b.end());
  return a == b;
}

}  // namespace

// Before a kernel that walks its tiles in several waves, cuBLASLt queues a memset of a 4-byte
// tile counter it keeps in the workspace (the heuristic asks for 4 bytes of workspace;
// experiments/gemm/algo lists the nodes each candidate launches). Captured as queued, each memset
// waits for the kernel before the gemm and the gemm for the memset: two dependency hops of
// idle GPU per gemm, paid once for every gemm of a decode step. Hanging the memset off the
// previous gemm instead (a branch beside the kernels in between) does not help: the gemm then waits at the join. So while capturing, each gemm whose algorithm needs at most
// kCounterSlot bytes of workspace gets its own slot of counters_ (gemm_add), the graph's last
// node zeroes all slots for the next replay (a fill kernel: capture(); the first replay finds them
// zeroed at allocation), and here every memset that zeroes exactly
// such a gemm's slot is dropped (its producers now feed the gemm directly). No kernel
// and no data dependency changes, nor do the results; graphs never overlap (one stream), so
// all graphs may share the slots. Only the captured shape is rewired: K's one dependency a
// memset of 0 whose one dependent is K, whose target lies in K's slot, and whose dependencies
// are what the capture had reached when the gemm was queued.
int64_t CudaBackend::gather_gemm_memsets(cudaGraph_t graph) const {
  int64_t dropped = 0;
  for (const CapturedGemm& g : captured_gemms_) {
    if (g.slot < 0) continue;
    const std::vector<cudaGraphNode_t> kdeps = graph_deps(g.kernel);
    if (kdeps.size() != 1) continue;
    const cudaGraphNode_t m = kdeps[0];
    cudaGraphNodeType type{};
    CUDA_CHECK(cudaGraphNodeGetType(m, &type));
    if (type != cudaGraphNodeTypeMemset) continue;
    cudaMemsetParams mp{};
    CUDA_CHECK(cudaGraphMemsetNodeGetParams(m, &mp));
    const uintptr_t lo = reinterpret_cast<uintptr_t>(counters_) + g.slot * kCounterSlot;
    const uintptr_t dst = reinterpret_cast<uintptr_t>(mp.dst);
    const size_t bytes = static_cast<size_t>(mp.elementSize) * mp.width;
    if (mp.value != 0 || mp.height > 1 || dst < lo || dst + bytes > lo + kCounterSlot ||
        graph_dependents(m).size() != 1 || !same_nodes(graph_deps(m), g.before))
      continue;
    CUDA_CHECK(cudaGraphDestroyNode(m));  // and its edges P → M → K
    for (cudaGraphNode_t p : g.before) CUDA_CHECK(cudaGraphAddDependencies(graph, &p, &g.kernel, nullptr, 1));
    ++dropped;
  }
  return dropped;
}

// The nodes the next op queued on the capturing stream will depend on.
std::vector<cudaGraphNode_t> CudaBackend::capture_frontier() const {
  cudaStreamCaptureStatus st{};
  const cudaGraphNode_t* deps = nullptr;
  size_t n = 0;
  CUDA_CHECK(cudaStreamGetCaptureInfo(stream_, &st, nullptr, nullptr, &deps, nullptr, &n));
  return st == cudaStreamCaptureStatusActive ? std::vector<cudaGraphNode_t>(deps, deps + n)
                                             : std::vector<cudaGraphNode_t>{};
}

Status CudaBackend::capture(const std::function<void()>& queue_ops, std::unique_ptr<Graph>* out) {
  const int64_t syncs = host_syncs_;
  // Allocated before the capture: cudaMalloc may not be called while capturing.
  if (gather_memsets_ && !counters_) {
    CUDA_CHECK(cudaMalloc(&counters_, kCounterSlots * kCounterSlot));
    // Zero for the first replay (graphs zero them at their tail by default); on the backend's
    // stream, which does not wait for the legacy default stream.
    CUDA_CHECK(cudaMemsetAsync(counters_, 0, kCounterSlots * kCounterSlot, stream_));
  }
  const auto zero_counters = [this] {
    const int64_t words = kCounterSlots * static_cast<int64_t>(kCounterSlot / 4);
    fill(Tensor::make(counters_, DType::kF32, &words, 1, Device::kCUDA), 0.0);
  };
  // Thread-local mode: other threads' CUDA calls (an HTTP thread's copies) are not drawn
  // into this capture nor invalidate it.
  CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
  captured_gemms_.clear();
  slots_used_ = 0;
  // Every replay starts with its gemms' counters at zero (gather_gemm_memsets): zeroed by the
  // graph's last node (and at allocation), or by its first under LAPLACE_GRAPH_COUNTERS=head.
  if (counters_ && !counters_at_tail_) zero_counters();
  capturing_ = true;
  queue_ops();
  capturing_ = false;
  if (counters_ && counters_at_tail_) zero_counters();
  cudaGraph_t graph = nullptr;
  const cudaError_t end = cudaStreamEndCapture(stream_, &graph);
  if (end == cudaSuccess && host_syncs_ == syncs) graph_memsets_moved_ += gather_gemm_memsets(graph);
  captured_gemms_.clear();
  if (end != cudaSuccess || host_syncs_ != syncs) {
    if (graph) cudaGraphDestroy(graph);
    (void)cudaGetLastError();
    return Status::unsupported(std::string("CUDA graph capture failed: ") +
                            (host_syncs_ != syncs ? "an op waited for the device or read host memory"
                                                  : cudaGetErrorString(end)));
  }
  cudaGraphExec_t exec = nullptr;
  const cudaError_t inst = cudaGraphInstantiate(&exec, graph, 0);
  if (inst != cudaSuccess) {
    cudaGraphDestroy(graph);
    (void)cudaGetLastError();
    return Status::unsupported(std::string("CUDA graph instantiation failed: ") + cudaGetErrorString(inst));
  }
  *out = std::make_unique<CudaGraph>(graph, exec, stream_);
  return Status::ok();
}

bool CudaBackend::memory_info(size_t* free_bytes, size_t* total_bytes) {
  CUDA_CHECK(cudaSetDevice(device_));
  return cudaMemGetInfo(free_bytes, total_bytes) == cudaSuccess;
}

void CudaBackend::kernel_smem_set(const void* kernel, size_t dyn_bytes, bool max_carveout) {
  auto it = kernel_attrs_.find(kernel);
  if (it == kernel_attrs_.end()) {  // start from the kernel's current limit: never lower it
    cudaFuncAttributes fa{};
    CUDA_CHECK(cudaFuncGetAttributes(&fa, kernel));
    ++kernel_attr_calls_;
    it = kernel_attrs_.emplace(kernel, KernelAttrs{static_cast<size_t>(fa.maxDynamicSharedSizeBytes), false}).first;
  }
  KernelAttrs& ka = it->second;
  if (dyn_bytes > ka.smem_limit) {
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(dyn_bytes)));
    ++kernel_attr_calls_;
    ka.smem_limit = dyn_bytes;
  }
  if (max_carveout && !ka.carveout) {
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                    cudaSharedmemCarveoutMaxShared));
    ++kernel_attr_calls_;
    ka.carveout = true;
  }
}

void* CudaBackend::scratch(size_t bytes) {
  if (bytes <= scratch_bytes_) return scratch_;
  size_t n = scratch_bytes_ ? scratch_bytes_ : (1u << 20);
  while (n < bytes) n *= 2;
  if (scratch_) {
    CUDA_CHECK(cudaStreamSynchronize(stream_));  // earlier ops may still use the old buffer
    ++host_syncs_;
    CUDA_CHECK(cudaFree(scratch_));
  }
  scratch_ = nullptr;
  CUDA_CHECK(cudaMalloc(&scratch_, n));
  scratch_bytes_ = n;
  return scratch_;
}

// ---- copy ----------------------------------------------------------------------------------------

bool CudaBackend::copy_h2d_staged(Tensor dst, const Tensor& src) {
  // Small copies only (token ids, targets: B·T·4 bytes): large ones (weight loading) keep
  // the synchronous path rather than pinning gigabytes.
  constexpr size_t kMaxStagedBytes = 8u << 20;
  // Enough buffers for every H2D copy a step queues before the device catches up (token
  // ids and targets per micro-batch); past that, wait for one (counted as a sync).
  constexpr size_t kMaxStaging = 64, kMinStagingBytes = 64u << 10;
  const size_t bytes = src.nbytes();
  if (dst.device != Device::kCUDA || src.device != Device::kCPU || dst.dtype != src.dtype ||
      !dst.is_contiguous() || !src.is_contiguous() || bytes > kMaxStagedBytes)
    return false;
  Staging* slot = nullptr;
  for (Staging& st : staging_) {
    if (st.cap >= bytes && cudaEventQuery(st.done) == cudaSuccess) {
      slot = &st;
      break;
    }
  }
  if (slot == nullptr && staging_.size() >= kMaxStaging) {
    for (Staging& st : staging_) {
      if (st.cap < bytes) continue;
      CUDA_CHECK(cudaEventSynchronize(st.done));
      ++host_syncs_;
      slot = &st;
      break;
    }
  }
  if (slot == nullptr) {
    Staging st;
    st.cap = kMinStagingBytes;
    while (st.cap < bytes) st.cap *= 2;
    CUDA_CHECK(cudaMallocHost(&st.p, st.cap));
    CUDA_CHECK(cudaEventCreateWithFlags(&st.done, cudaEventDisableTiming));
    staging_.push_back(st);
    slot = &staging_.back();
  }
  std::memcpy(slot->p, src.data, bytes);
  CUDA_CHECK(cudaMemcpyAsync(dst.data, slot->p, bytes, cudaMemcpyHostToDevice, stream_));
  CUDA_CHECK(cudaEventRecord(slot->done, stream_));
  return true;
}

bool CudaBackend::supports(const OpQuery& q) const {
  if (!is_backend_op(q.op)) return false;
  if (q.op == "copy") return q.dtype == DType::kF32 || q.dtype == DType::kBF16 || q.dtype == DType::kF64 ||
                             q.dtype == DType::kI32;
  // Speculative verification has a CPU reference only so far (docs/serving.md §11).
  if (q.op == "gla_verify_deferred" || q.op == "gla_verify_commit") return false;
  if (q.dtype != DType::kF32 && q.dtype != DType::kBF16) return false;
  // cuBLASLt's FP8 layouts: a matrix [N, K] needs both multiples of 16.
  if (q.op == "gemm_e4m3" && q.dims.size() == 2 && (q.dims[0] % 16 != 0 || q.dims[1] % 16 != 0)) return false;
  if (q.op.rfind("gla_", 0) == 0 && q.dims.size() == 3) {
    const int64_t H = q.dims[0], dk = q.dims[1], dv = q.dims[2];
    if (dk < 1 || dk > kMaxGlaDk || dv < 1 || dv > kMaxGlaDv) return false;
    if (q.op != "gla_forward" && q.op != "gla_backward" && H > kMaxDecodeHeads) return false;
  }
  return true;
}

void CudaBackend::copy(Tensor dst, const Tensor& src) {
  LAPLACE_CHECK(same_shape(dst, src),
                ("copy: shapes differ: " + dst.shape_str() + " vs " + src.shape_str()).c_str());
  const int64_t n = dst.numel();
  if (n == 0) return;
  const bool dd = dst.device == Device::kCUDA, sd = src.device == Device::kCUDA;
  if (dst.dtype != src.dtype) {
    // F32 <-> BF16 conversion runs on the device; a host side is staged through the
    // scratch buffer (contiguous, in the host tensor's dtype).
    LAPLACE_CHECK(dd || sd, "copy: host-to-host dtype conversion belongs to the CPU backend");
    if (dd && sd) {
      cuda::convert_copy(dst, src, stream_);
    } else if (dd) {
      Tensor stage = Tensor::make(scratch(src.nbytes()), src.dtype, src.shape.data(), src.ndim, Device::kCUDA);
      copy(stage, src);  // same dtype (staged and queued when small, else synchronous)
      cuda::convert_copy(dst, stage, stream_);
    } else {
      Tensor stage = Tensor::make(scratch(dst.nbytes()), dst.dtype, dst.shape.data(), dst.ndim, Device::kCUDA);
      cuda::convert_copy(stage, src, stream_);
      copy(dst, stage);  // same dtype, synchronous
    }
    return;
  }
  if (copy_h2d_staged(dst, src)) return;
  const size_t es = dtype_size(dst.dtype);
  // Merge dims that are contiguous in both views (size-1 dims dropped).
  int nd = 0;
  int64_t shp[kMaxDims + 1], sdst[kMaxDims + 1], ssrc[kMaxDims + 1];
  for (int i = 0; i < dst.ndim; ++i) {
    if (dst.shape[i] == 1) continue;
    if (nd > 0 && sdst[nd - 1] == dst.stride[i] * dst.shape[i] && ssrc[nd - 1] == src.stride[i] * dst.shape[i]) {
      shp[nd - 1] *= dst.shape[i];
      sdst[nd - 1] = dst.stride[i];
      ssrc[nd - 1] = src.stride[i];
    } else {
      shp[nd] = dst.shape[i];
      sdst[nd] = dst.stride[i];
      ssrc[nd] = src.stride[i];
      ++nd;
    }
  }
  if (nd == 0) {
    shp[0] = 1;
    sdst[0] = ssrc[0] = 1;
    nd = 1;
  }
  if (sdst[nd - 1] != 1 || ssrc[nd - 1] != 1) {
    // e.g. a column slice [N, 1]: copy single elements as rows of a 2-D copy
    shp[nd] = 1;
    sdst[nd] = ssrc[nd] = 1;
    ++nd;
  }
  cudaMemcpyKind kind = dd ? (sd ? cudaMemcpyDeviceToDevice : cudaMemcpyHostToDevice)
                           : (sd ? cudaMemcpyDeviceToHost : cudaMemcpyHostToHost);
  char* pd = static_cast<char*>(dst.data);
  const char* ps = static_cast<const char*>(src.data);
  if (nd == 1) {
    CUDA_CHECK(cudaMemcpyAsync(pd, ps, static_cast<size_t>(shp[0]) * es, kind, stream_));
  } else {
    // Rows of the two innermost (merged) dims per cudaMemcpy2DAsync; outer dims looped.
    const size_t width = static_cast<size_t>(shp[nd - 1]) * es;
    const size_t height = static_cast<size_t>(shp[nd - 2]);
    const size_t dpitch = static_cast<size_t>(sdst[nd - 2]) * es, spitch = static_cast<size_t>(ssrc[nd - 2]) * es;
    int64_t outer = 1;
    for (int i = 0; i < nd - 2; ++i) outer *= shp[i];
    for (int64_t o = 0; o < outer; ++o) {
      int64_t rem = o, od = 0, os = 0;
      for (int i = nd - 3; i >= 0; --i) {
        const int64_t idx = rem % shp[i];
        rem /= shp[i];
        od += idx * sdst[i];
        os += idx * ssrc[i];
      }
      CUDA_CHECK(cudaMemcpy2DAsync(pd + od * static_cast<int64_t>(es), dpitch, ps + os * static_cast<int64_t>(es),
                                   spitch, width, height, kind, stream_));
    }
  }
  // Copies that touch host memory complete before returning (the host may reuse or read
  // the buffer at once, as with the CPU backend); contiguous H2D copies were staged above.
  if (!dd || !sd) {
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    ++host_syncs_;
  }
}

// ---- gemm ----------------------------------------------------------------------------------------
//
// Row-major C[M,N] = op(A)·op(B) is column-major Cᵀ[N,M] = op(B)ᵀ·op(A)ᵀ, and a row-major
// matrix with row stride ld is, read column-major, its transpose with the same ld. So cuBLASLt
// gets (B, A) as its (A, B): its first operand is B with op = trans_b ? T : N, stored as a
// column-major [cols(B) x rows(B)] matrix, and likewise for A; its output is C as [N x M].

// Tuning (gemm_tune): shapes of at least kTuneMinFlops get up to kTuneCandidates of the
// heuristic's candidates. Below ~10 GFLOP a gemm runs in tens of microseconds, where the
// candidates' differences drown in the timing's noise.
namespace {

constexpr int kTuneCandidates = 8;
constexpr double kTuneMinFlops = 1e10;

double gemm_flops(int64_t M, int64_t N, int64_t K) {
  return 2.0 * static_cast<double>(M) * static_cast<double>(N) * static_cast<double>(K);
}

}  // namespace

cublasLtMatmulPreference_t CudaBackend::gemm_preference() const {
  cublasLtMatmulPreference_t pref;
  CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  uint64_t ws = workspace_bytes_;
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
  // No split-K: its reductions would tie results to the algorithm's partitioning.
  uint32_t red = CUBLASLT_REDUCTION_SCHEME_NONE;
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &red, sizeof(red)));
  return pref;
}

CudaBackend::GemmPlan& CudaBackend::gemm_plan(const GemmKey& key) {
  auto it = gemm_plans_.find(key);
  if (it != gemm_plans_.end()) return it->second;
  const auto ta = static_cast<cudaDataType_t>(key[0]), tb = static_cast<cudaDataType_t>(key[1]),
             tc = static_cast<cudaDataType_t>(key[2]);
  const bool trans_a = key[3] != 0, trans_b = key[4] != 0;
  const int64_t M = key[5], N = key[6], K = key[7], lda = key[8], ldb = key[9], ldc = key[10];
  const uint32_t al_a = static_cast<uint32_t>(key[11]), al_b = static_cast<uint32_t>(key[12]),
                 al_c = static_cast<uint32_t>(key[13]);

  GemmPlan plan;
  CUBLAS_CHECK(cublasLtMatmulDescCreate(&plan.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  cublasOperation_t op_first = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;  // cuBLAS "A" = our B
  cublasOperation_t op_second = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N; // cuBLAS "B" = our A
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_first, sizeof(op_first)));
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_second, sizeof(op_second)));
  // Column-major storage shapes: our B is [K,N] (or [N,K] when trans_b) row-major.
  const uint64_t b_rows = trans_b ? K : N, b_cols = trans_b ? N : K;
  const uint64_t a_rows = trans_a ? M : K, a_cols = trans_a ? K : M;
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan.lb, tb, b_rows, b_cols, ldb));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan.la, ta, a_rows, a_cols, lda));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan.lc, tc, N, M, ldc));

  cublasLtMatmulPreference_t pref = gemm_preference();
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_b, sizeof(al_b)));
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_a, sizeof(al_a)));
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_c, sizeof(al_c)));
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_c, sizeof(al_c)));
  const int want = gemm_tune_ && gemm_flops(M, N, K) >= kTuneMinFlops ? kTuneCandidates : 1;
  std::vector<cublasLtMatmulHeuristicResult_t> res(static_cast<size_t>(want));
  int found = 0;
  cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(lt_, plan.desc, plan.lb, plan.la, plan.lc, plan.lc, pref, want,
                                                     res.data(), &found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (st != CUBLAS_STATUS_SUCCESS || found == 0) {
    std::string msg = "gemm: cuBLASLt has no algorithm for M=" + std::to_string(M) + " N=" + std::to_string(N) +
                      " K=" + std::to_string(K) + " (dtypes/alignment/leading dimensions unsupported)";
    check_failed(__FILE__, __LINE__, "cublasLtMatmulAlgoGetHeuristic", msg.c_str());
  }
  res.resize(static_cast<size_t>(found));
  plan.algo = res[0].algo;
  plan.ws_needed = res[0].workspaceSize;
  if (found >= 2) plan.candidates = std::move(res);
  return gemm_plans_.emplace(key, plan).first->second;
}

void CudaBackend::gemm(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, Tensor c, double alpha,
                       double beta) {
  gemm_add(a, trans_a, b, trans_b, c, c, alpha, beta);
}

// cuBLASLt reads C from `cin` and writes D to `c`, both in c's layout (checked); the plan is
// keyed on the smaller of their alignments. An in-place call (cin = c) and one with a distinct
// cin need not run the same kernel, so their bits may differ; each is deterministic.
void CudaBackend::gemm_add(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, const Tensor& cin, Tensor c,
                           double alpha, double beta) {
  require_device(cin, "gemm: c (input)");
  LAPLACE_CHECK(same_shape(cin, c) && cin.dtype == c.dtype && (cin.ndim != 2 || cin.stride[0] == c.stride[0]),
                "gemm_add: c and d must have one shape, dtype and row stride");
  require_device(a, "gemm: a");
  require_device(b, "gemm: b");
  require_device(c, "gemm: c");
  LAPLACE_CHECK(a.ndim == 2 && b.ndim == 2 && c.ndim == 2, "gemm: operands must be 2-D");
  const int64_t M = c.shape[0], N = c.shape[1];
  const int64_t K = trans_a ? a.shape[0] : a.shape[1];
  const int64_t am = trans_a ? a.shape[1] : a.shape[0];
  const int64_t bk = trans_b ? b.shape[1] : b.shape[0], bn = trans_b ? b.shape[0] : b.shape[1];
  if (am != M || bk != K || bn != N)
    check_failed(__FILE__, __LINE__, "gemm shapes",
                 ("gemm: op(a) " + a.shape_str() + (trans_a ? "ᵀ" : "") + " · op(b) " + b.shape_str() +
                  (trans_b ? "ᵀ" : "") + " does not give c " + c.shape_str())
                     .c_str());
  const bool bf16_in = a.dtype == DType::kBF16 && b.dtype == DType::kBF16 &&
                       (c.dtype == DType::kF32 || c.dtype == DType::kBF16);
  const bool f32_all = a.dtype == DType::kF32 && b.dtype == DType::kF32 && c.dtype == DType::kF32;
  LAPLACE_CHECK(bf16_in || f32_all, "gemm: dtypes must be (BF16, BF16, F32|BF16) or (F32, F32, F32)");
  if (M == 0 || N == 0) return;
  if (K == 0) {  // c = beta·cin
    if (cin.data != c.data) copy(c, cin);
    if (beta == 0) fill(c, 0.0);
    else if (beta != 1) scale(c, beta);
    return;
  }
  for (const Tensor* t : std::initializer_list<const Tensor*>{&a, &b, &c})
    LAPLACE_CHECK(t->stride[1] == 1 || t->shape[1] == 1, "gemm: the innermost dim must be contiguous");
  const int64_t lda = std::max<int64_t>(a.stride[0], a.shape[1]);
  const int64_t ldb = std::max<int64_t>(b.stride[0], b.shape[1]);
  const int64_t ldc = std::max<int64_t>(c.stride[0], c.shape[1]);
  GemmKey key = {static_cast<int64_t>(cuda_type(a.dtype)), static_cast<int64_t>(cuda_type(b.dtype)),
                 static_cast<int64_t>(cuda_type(c.dtype)), trans_a ? 1 : 0, trans_b ? 1 : 0, M, N, K, lda, ldb, ldc,
                 pointer_alignment(a.data), pointer_alignment(b.data),
                 std::min(pointer_alignment(c.data), pointer_alignment(cin.data)), 0};
  GemmPlan& plan = gemm_plan(key);
  const float fa = static_cast<float>(alpha), fb = static_cast<float>(beta);
  if (!plan.candidates.empty()) {
    // A plan first used inside a capture keeps the heuristic's pick: a graph and the eager
    // calls after it then run one kernel (no timing is possible while capturing anyway).
    if (capturing_) {
      plan.candidates.clear();
    } else {
      const size_t span = static_cast<size_t>((M - 1) * ldc + N) * dtype_size(c.dtype);
      gemm_tune(plan, GemmCall{b.data, a.data, cin.data, c.data, fa, fb, span}, key);
    }
  }
  GemmLaunch g = gemm_launch_begin(plan.ws_needed);
  CUBLAS_CHECK(cublasLtMatmul(lt_, plan.desc, &fa, b.data, plan.lb, a.data, plan.la, &fb, cin.data, plan.lc, c.data,
                              plan.lc, &plan.algo, g.ws, g.ws_bytes, stream_));
  gemm_launch_end(std::move(g));
}

// While capturing, a gemm whose algorithm needs little workspace (a tile counter) gets a slot of
// its own, so that capture() can zero all slots at once (gather_gemm_memsets).
CudaBackend::GemmLaunch CudaBackend::gemm_launch_begin(size_t ws_needed) {
  GemmLaunch g{workspace_, workspace_bytes_, {}};
  if (capturing_) {
    g.rec.before = capture_frontier();
    // A slot handed out is never handed out again in this capture, recorded or not.
    if (counters_ && ws_needed <= kCounterSlot && slots_used_ < kCounterSlots) {
      g.rec.slot = slots_used_++;
      g.ws = static_cast<char*>(counters_) + g.rec.slot * kCounterSlot;
      g.ws_bytes = kCounterSlot;
    }
  }
  return g;
}

void CudaBackend::gemm_launch_end(GemmLaunch&& g) {
  if (!capturing_) return;
  const std::vector<cudaGraphNode_t> after = capture_frontier();
  if (after.size() == 1) {
    g.rec.kernel = after[0];
    captured_gemms_.push_back(std::move(g.rec));
  }
}

// The first eager call of a plan with several candidates times them on its own operands:
// each candidate runs once and its output's fingerprint is compared with the heuristic pick's
// (only candidates with the same bytes may be chosen, so tuning never changes a result:
// cuBLASLt's candidates here differ in tiles and scheduling, not in the order of the sums,
// experiments/gemm/algo); then rounds in which every such candidate runs in turn (clocks and heat
// then weigh on all alike), and the fastest median wins if it beats the pick by 2 %. An
// in-place call with β ≠ 0 writes into a temporary instead, so C is intact for the real call
// that follows; if none can be allocated, the pick stays. LAPLACE_GEMM_TUNE=verbose prints
// the outcome.
void CudaBackend::gemm_tune(GemmPlan& plan, const GemmCall& call, const GemmKey& key) {
  const std::vector<cublasLtMatmulHeuristicResult_t> cands = std::move(plan.candidates);
  plan.candidates.clear();  // tuned from here on, whatever happens below
  void* d = call.d;
  void* tmp = nullptr;
  if (call.beta != 0.f && call.c == call.d) {
    tmp = alloc_->allocate(call.d_span);
    if (!tmp) return;
    d = tmp;
  }
  auto run = [&](const cublasLtMatmulAlgo_t& algo) {
    return cublasLtMatmul(lt_, plan.desc, &call.alpha, call.lt_a, plan.lb, call.lt_b, plan.la, &call.beta, call.c,
                          plan.lc, d, plan.lc, &algo, workspace_, workspace_bytes_, stream_) == CUBLAS_STATUS_SUCCESS;
  };
  std::vector<size_t> same;  // candidates with the pick's bytes (the pick first)
  if (run(cands[0].algo)) {
    same.push_back(0);
    const uint64_t ref = fingerprint(d, call.d_span);
    for (size_t i = 1; i < cands.size(); ++i)
      if (run(cands[i].algo) && fingerprint(d, call.d_span) == ref) same.push_back(i);
  }
  (void)cudaGetLastError();  // a candidate that failed to launch leaves no error behind
  size_t best = 0;
  std::vector<float> med(same.size(), 0.f);
  if (same.size() >= 2) {
    ++gemm_shapes_tuned_;
    // Each timing covers ≥ ~0.25 ms of gemms (at 500 TFLOP/s), at most 50 calls.
    const double flops = gemm_flops(key[5], key[6], key[7]);
    const int reps = static_cast<int>(std::clamp(std::ceil(0.25e-3 / (flops / 5e14)), 1.0, 50.0));
    constexpr int kRounds = 7;
    std::vector<std::vector<float>> ms(same.size());
    cudaEvent_t e0, e1;
    CUDA_CHECK(cudaEventCreate(&e0));
    CUDA_CHECK(cudaEventCreate(&e1));
    for (int r = 0; r < kRounds; ++r) {
      for (size_t j = 0; j < same.size(); ++j) {
        CUDA_CHECK(cudaEventRecord(e0, stream_));
        for (int i = 0; i < reps; ++i) run(cands[same[j]].algo);
        CUDA_CHECK(cudaEventRecord(e1, stream_));
        CUDA_CHECK(cudaEventSynchronize(e1));
        ++host_syncs_;
        float t = 0.f;
        CUDA_CHECK(cudaEventElapsedTime(&t, e0, e1));
        ms[j].push_back(t / static_cast<float>(reps));
      }
    }
    CUDA_CHECK(cudaEventDestroy(e0));
    CUDA_CHECK(cudaEventDestroy(e1));
    for (size_t j = 0; j < same.size(); ++j) {
      std::sort(ms[j].begin(), ms[j].end());
      med[j] = ms[j][kRounds / 2];
    }
    const size_t j = static_cast<size_t>(std::min_element(med.begin(), med.end()) - med.begin());
    if (j != 0 && med[j] < 0.98f * med[0]) best = j;
    if (best != 0) {
      ++gemm_shapes_switched_;
      plan.algo = cands[same[best]].algo;
      plan.ws_needed = cands[same[best]].workspaceSize;
    }
  }
  if (tmp) {
    synchronize();
    alloc_->deallocate(tmp);
  }
  if (gemm_tune_verbose_)
    std::fprintf(stderr,
                 "laplace: gemm tune M %lld N %lld K %lld: %zu candidates, %zu with the pick's bytes; candidate %zu, "
                 "%.4f ms (the pick %.4f ms)\n",
                 static_cast<long long>(key[5]), static_cast<long long>(key[6]), static_cast<long long>(key[7]),
                 cands.size(), same.size(), same.empty() ? size_t{0} : same[best],
                 same.size() >= 2 ? static_cast<double>(med[best]) : 0.0,
                 same.size() >= 2 ? static_cast<double>(med[0]) : 0.0);
}

// ---- factory -------------------------------------------------------------------------------------

std::unique_ptr<Backend> make_cuda_backend(std::string* why) {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    if (why) *why = std::string("cudaGetDeviceCount failed: ") + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")";
    return nullptr;
  }
  if (n == 0) {
    if (why) *why = "no CUDA device is visible (cudaGetDeviceCount returned 0)";
    return nullptr;
  }
  int dev = 0;
  e = cudaGetDevice(&dev);  // the caller (e.g. one rank per GPU) may have chosen it
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    if (why) *why = std::string("cudaGetDevice failed: ") + cudaGetErrorString(e);
    return nullptr;
  }
  e = cuda::probe_kernel_image();
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    cudaDeviceProp prop{};
    int major = 0, minor = 0;
    if (cudaGetDeviceProperties(&prop, dev) == cudaSuccess) {
      major = prop.major;
      minor = prop.minor;
    }
    if (why)
      *why = std::string("the CUDA kernels cannot run on device ") + std::to_string(dev) + " (compute capability " +
             std::to_string(major) + "." + std::to_string(minor) + "): " + cudaGetErrorString(e) +
             "; laplace is built for sm_90a (H100/H200)";
    return nullptr;
  }
  return std::make_unique<CudaBackend>(dev);
}

namespace cuda {

const int32_t* doc_starts_arg(const Tensor& doc, int64_t B, int64_t T, const char* what) {
  if (!doc.defined()) return nullptr;
  if (doc.device != Device::kCUDA)
    check_failed(__FILE__, __LINE__, what, ("doc must live on the GPU: " + doc.shape_str()).c_str());
  if (doc.dtype != DType::kI32 || doc.ndim != 2 || doc.shape[0] != B || doc.shape[1] != T || !doc.is_contiguous())
    check_failed(__FILE__, __LINE__, what,
                 ("doc must be a contiguous I32 [" + std::to_string(B) + ", " + std::to_string(T) + "] tensor, got " +
                  doc.shape_str())
                     .c_str());
  return static_cast<const int32_t*>(doc.data);
}

}  // namespace cuda

}  // namespace laplace
