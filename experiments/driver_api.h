// Driver entry points the kernel experiments use to inspect captured graphs (header-only, like
// host.h). cuBLASLt's kernels are not the runtime's, so their graph node parameters are read
// through the driver API (the runtime's cudaGraphKernelNodeGetParams can fail on them); the
// entry points are fetched at run time so that the experiments need not link -lcuda. A missing one is
// nullptr: callers print "n/a" (the output is informational).
#pragma once

#include <cuda.h>  // driver types only
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <vector>

#include "experiments/host.h"

namespace experiments {

struct DriverFns {
  PFN_cuGraphKernelNodeGetParams_v12000 params = nullptr;
  PFN_cuGraphKernelNodeGetAttribute_v11000 attr = nullptr;
  PFN_cuFuncGetName_v12030 fname = nullptr;
  PFN_cuKernelGetName_v12030 kname = nullptr;
  PFN_cuFuncGetAttribute_v2020 fattr = nullptr;
  PFN_cuKernelGetAttribute_v12000 kattr = nullptr;
};

template <class T>
T driver_entry(const char* sym) {
  void* fp = nullptr;
  cudaDriverEntryPointQueryResult q{};
  if (cudaGetDriverEntryPointByVersion(sym, &fp, 12030, cudaEnableDefault, &q) != cudaSuccess ||
      q != cudaDriverEntryPointSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  return reinterpret_cast<T>(fp);
}

inline DriverFns load_driver_fns() {
  DriverFns d;
  d.params = driver_entry<PFN_cuGraphKernelNodeGetParams_v12000>("cuGraphKernelNodeGetParams");
  d.attr = driver_entry<PFN_cuGraphKernelNodeGetAttribute_v11000>("cuGraphKernelNodeGetAttribute");
  d.fname = driver_entry<PFN_cuFuncGetName_v12030>("cuFuncGetName");
  d.kname = driver_entry<PFN_cuKernelGetName_v12030>("cuKernelGetName");
  d.fattr = driver_entry<PFN_cuFuncGetAttribute_v2020>("cuFuncGetAttribute");
  d.kattr = driver_entry<PFN_cuKernelGetAttribute_v12000>("cuKernelGetAttribute");
  return d;
}

// A captured kernel node's launch parameters and its kernel's name (nullptr when unknown);
// false if the parameters cannot be read.
inline bool kernel_node_info(const DriverFns& d, cudaGraphNode_t node, CUDA_KERNEL_NODE_PARAMS_v2* kp,
                             const char** name) {
  *name = nullptr;
  if (!d.params || d.params(reinterpret_cast<CUgraphNode>(node), kp) != CUDA_SUCCESS) return false;
  if (kp->func && d.fname) d.fname(name, kp->func);
  else if (kp->kern && d.kname) d.kname(name, kp->kern);
  return true;
}

// A kernel attribute of a captured node's function (device 0); -1 when it cannot be read.
inline int kernel_node_attr(const DriverFns& d, const CUDA_KERNEL_NODE_PARAMS_v2& kp, CUfunction_attribute a) {
  int v = -1;
  if (kp.func && d.fattr) {
    if (d.fattr(&v, a, kp.func) != CUDA_SUCCESS) v = -1;
  } else if (kp.kern && d.kattr) {
    if (d.kattr(&v, a, kp.kern, 0) != CUDA_SUCCESS) v = -1;
  }
  return v;
}

// What one CTA of a kernel holds of an SM (H100/H200: 65,536 registers, 228 KB of shared
// memory of which 1 KB per CTA is reserved), and so what is left beside it for another kernel's
// blocks: the question whether a state-stream block can share an SM with a gemm CTA.
struct CtaFootprint {
  int regs_per_thread = -1, threads = 0, regs = -1, static_smem = -1, dyn_smem = 0, smem = -1;
};
inline CtaFootprint kernel_node_footprint(const DriverFns& d, const CUDA_KERNEL_NODE_PARAMS_v2& kp) {
  CtaFootprint f;
  f.threads = static_cast<int>(kp.blockDimX * kp.blockDimY * kp.blockDimZ);
  f.regs_per_thread = kernel_node_attr(d, kp, CU_FUNC_ATTRIBUTE_NUM_REGS);
  f.static_smem = kernel_node_attr(d, kp, CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES);
  f.dyn_smem = static_cast<int>(kp.sharedMemBytes);
  // Registers are allocated per warp in units of 256 (8 per thread).
  if (f.regs_per_thread >= 0) f.regs = (f.regs_per_thread + 7) / 8 * 8 * ((f.threads + 31) / 32 * 32);
  if (f.static_smem >= 0) f.smem = f.static_smem + f.dyn_smem + 1024;
  return f;
}

// One line per node of a captured graph: memsets with their bytes, kernels with their launch
// shape, cluster and name, other nodes by type. Returns the number of memset nodes.
inline int print_graph_nodes(const DriverFns& d, cudaGraph_t g) {
  size_t n = 0;
  CK(cudaGraphGetNodes(g, nullptr, &n));
  std::vector<cudaGraphNode_t> nodes(n);
  CK(cudaGraphGetNodes(g, nodes.data(), &n));
  int memsets = 0;
  for (cudaGraphNode_t node : nodes) {
    cudaGraphNodeType t;
    CK(cudaGraphNodeGetType(node, &t));
    if (t == cudaGraphNodeTypeMemset) {
      cudaMemsetParams mp{};
      CK(cudaGraphMemsetNodeGetParams(node, &mp));
      ++memsets;
      std::printf("        memset %zu B (elem %u × %zu × %zu) value %u\n", mp.elementSize * mp.width * mp.height,
                  mp.elementSize, mp.width, mp.height, mp.value);
      continue;
    }
    if (t != cudaGraphNodeTypeKernel) {
      std::printf("        node type %d\n", static_cast<int>(t));
      continue;
    }
    CUDA_KERNEL_NODE_PARAMS_v2 kp{};
    const char* name = nullptr;
    if (!kernel_node_info(d, node, &kp, &name)) {
      std::printf("        kernel n/a\n");
      continue;
    }
    CUkernelNodeAttrValue_v1 cv{};
    const bool has_cluster = d.attr && d.attr(reinterpret_cast<CUgraphNode>(node),
                                              CU_KERNEL_NODE_ATTRIBUTE_CLUSTER_DIMENSION, &cv) == CUDA_SUCCESS;
    const CtaFootprint f = kernel_node_footprint(d, kp);
    std::printf("        kernel grid %u×%u×%u (%u CTAs) block %u dyn smem %u cluster %s%u×%u×%u  %.160s\n",
                kp.gridDimX, kp.gridDimY, kp.gridDimZ, kp.gridDimX * kp.gridDimY * kp.gridDimZ,
                kp.blockDimX * kp.blockDimY * kp.blockDimZ, kp.sharedMemBytes, has_cluster ? "" : "(n/a) ",
                cv.clusterDim.x, cv.clusterDim.y, cv.clusterDim.z, name ? name : "(name n/a)");
    if (f.regs >= 0 && f.smem >= 0)
      std::printf("          per CTA: %d regs/thread × %d threads = %d of 65536 registers; smem %d static + %d dyn "
                  "(+1 KB) = %d of 233472 B; left beside one CTA: %d registers, %d B\n",
                  f.regs_per_thread, f.threads, f.regs, f.static_smem, f.dyn_smem, f.smem, 65536 - f.regs,
                  233472 - f.smem);
  }
  return memsets;
}

}  // namespace experiments
