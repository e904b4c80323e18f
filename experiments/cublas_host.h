// The kernel experiments' check macro for cuBLASLt calls (host.h's CK is the CUDA runtime's):
// file, line, the call and cuBLASLt's status name and text, then exit(1). Header-only.
#pragma once

#include <cublasLt.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#define CKB(x)                                                                                         \
  do {                                                                                                 \
    cublasStatus_t s_ = (x);                                                                           \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                                                 \
      std::fprintf(stderr, "%s:%d: %s: %s (%s)\n", __FILE__, __LINE__, #x, cublasLtGetStatusName(s_), \
                   cublasLtGetStatusString(s_));                                                       \
      std::exit(1);                                                                                    \
    }                                                                                                  \
  } while (0)

namespace experiments {

// A model projection as the experiments ask cuBLASLt for it: row-major Y[M, n] = X[M, k] · W[n, k]ᵀ is
// column-major Yᵀ[n, M] = W'ᵀ · X' with W' = W read column-major ([k, n], ld k, op T) and X' = X
// read column-major ([k, M], ld k, op N), the "TN" layout cuBLASLt is fastest at (and the one FP8
// operands need on Hopper); F32 compute, Y of `out_t`. `cands`: the heuristic's first `ncands`
// results in its order, under production's preferences (ops/cuda/cuda_backend.cpp: `ws` bytes of
// workspace, no split-K reduction unless allow_splitk); empty if it has none.
struct TnGemm {
  cublasLtMatmulDesc_t desc{};
  cublasLtMatrixLayout_t lw{}, lx{}, ly{};
  std::vector<cublasLtMatmulHeuristicResult_t> cands;
};
// The descriptor alone (F32 compute and scale, op T on W', op N on X'), for callers that add
// attributes (scales, SM count) before tn_gemm_plan.
inline cublasLtMatmulDesc_t tn_gemm_desc() {
  cublasLtMatmulDesc_t d{};
  CKB(cublasLtMatmulDescCreate(&d, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t opT = CUBLAS_OP_T, opN = CUBLAS_OP_N;
  CKB(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_TRANSA, &opT, sizeof opT));
  CKB(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_TRANSB, &opN, sizeof opN));
  return d;
}
// The layouts of W' and X' (`in_t`) and Y (`out_t`) and the heuristic's candidates for g.desc.
// Returns the heuristic's status: a combination cuBLASLt does not support is the caller's to report.
inline cublasStatus_t tn_gemm_plan(cublasLtHandle_t lt, TnGemm& g, int M, int n, int k, cudaDataType_t in_t,
                                   cudaDataType_t out_t, uint64_t ws, int ncands, bool allow_splitk) {
  CKB(cublasLtMatrixLayoutCreate(&g.lw, in_t, k, n, k));
  CKB(cublasLtMatrixLayoutCreate(&g.lx, in_t, k, M, k));
  CKB(cublasLtMatrixLayoutCreate(&g.ly, out_t, n, M, n));
  cublasLtMatmulPreference_t pref;
  CKB(cublasLtMatmulPreferenceCreate(&pref));
  CKB(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
  if (!allow_splitk) {
    const uint32_t red = CUBLASLT_REDUCTION_SCHEME_NONE;
    CKB(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &red, sizeof red));
  }
  g.cands.resize(static_cast<size_t>(ncands < 1 ? 1 : ncands));
  int found = 0;
  const cublasStatus_t s = cublasLtMatmulAlgoGetHeuristic(lt, g.desc, g.lw, g.lx, g.ly, g.ly, pref,
                                                          static_cast<int>(g.cands.size()), g.cands.data(), &found);
  CKB(cublasLtMatmulPreferenceDestroy(pref));
  g.cands.resize(s == CUBLAS_STATUS_SUCCESS ? static_cast<size_t>(found) : 0);
  return s;
}
// bf16 operands; sm_target > 0 sets CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET.
inline TnGemm tn_gemm_create(cublasLtHandle_t lt, int M, int n, int k, cudaDataType_t out_t, uint64_t ws, int ncands,
                             int32_t sm_target = 0, bool allow_splitk = false) {
  TnGemm g;
  g.desc = tn_gemm_desc();
  if (sm_target > 0)
    CKB(cublasLtMatmulDescSetAttribute(g.desc, CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET, &sm_target, sizeof sm_target));
  CKB(tn_gemm_plan(lt, g, M, n, k, CUDA_R_16BF, out_t, ws, ncands, allow_splitk));
  return g;
}
inline void tn_gemm_destroy(TnGemm& g) {
  CKB(cublasLtMatrixLayoutDestroy(g.lw));
  CKB(cublasLtMatrixLayoutDestroy(g.lx));
  CKB(cublasLtMatrixLayoutDestroy(g.ly));
  CKB(cublasLtMatmulDescDestroy(g.desc));
}

// What a heuristic result is, from its algorithm's config attributes (informational: a getter
// that fails leaves −1 / 0): id, tile, stages, split-K, reduction, swizzle, custom option,
// cluster and inner shape ids, waves and workspace.
inline std::string algo_config_str(const cublasLtMatmulHeuristicResult_t& r) {
  const cublasLtMatmulAlgo_t& a = r.algo;
  int32_t id = -1, splitk = -1;
  uint32_t tile = 0, stages = 0, swz = 0, custom = 0, red = 0;
  uint16_t cluster = 0, inner = 0;
  size_t w = 0;
  cublasLtMatmulAlgoConfigGetAttribute(&a, CUBLASLT_ALGO_CONFIG_ID, &id, sizeof id, &w);
  cublasLtMatmulAlgoConfigGetAttribute(&a, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof tile, &w);
  cublasLtMatmulAlgoConfigGetAttribute(&a, CUBLASLT_ALGO_CONFIG_STAGES_ID, &stages, sizeof stages, &w);
  cublasLtMatmulAlgoConfigGetAttribute(&a, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splitk, sizeof splitk, &w);
  cublasLtMatmulAlgoConfigGetAttribute(&a, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &red, sizeof red, &w);
  cublasLtMatmulAlgoConfigGetAttribute(&a, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, &swz, sizeof swz, &w);
  cublasLtMatmulAlgoConfigGetAttribute(&a, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, &custom, sizeof custom, &w);
  cublasLtMatmulAlgoConfigGetAttribute(&a, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &cluster, sizeof cluster, &w);
  cublasLtMatmulAlgoConfigGetAttribute(&a, CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID, &inner, sizeof inner, &w);
  char buf[256];
  std::snprintf(buf, sizeof buf,
                "algo %d tile %u stages %u splitK %d red %u swizzle %u custom %u cluster-id %u inner %u waves %.2f ws %zu",
                id, tile, stages, splitk, red, swz, custom, cluster, inner, r.wavesCount, r.workspaceSize);
  return buf;
}

}  // namespace experiments
