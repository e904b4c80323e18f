// The kernel labs' check macro for cuBLASLt calls (lab_host.h's CK is the CUDA runtime's):
// file, line, the call and cuBLASLt's status name and text, then exit(1). Header-only.
#pragma once

#include <cublasLt.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#define CKB(x)                                                                                         \
  do {                                                                                                 \
    cublasStatus_t s_ = (x);                                                                           \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                                                 \
      std::fprintf(stderr, "%s:%d: %s: %s (%s)\n", __FILE__, __LINE__, #x, cublasLtGetStatusName(s_), \
                   cublasLtGetStatusString(s_));                                                       \
      std::exit(1);                                                                                    \
    }                                                                                                  \
  } while (0)

namespace lab {

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

}  // namespace lab
