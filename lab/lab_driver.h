// Driver entry points the kernel labs use to inspect captured graphs (header-only, like
// lab_host.h). cuBLASLt's kernels are not the runtime's, so their graph node parameters are read
// through the driver API (the runtime's cudaGraphKernelNodeGetParams can fail on them); the
// entry points are fetched at run time so that the labs need not link -lcuda. A missing one is
// nullptr: callers print "n/a" (the output is informational).
#pragma once

#include <cuda.h>  // driver types only
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <vector>

#include "lab_host.h"

namespace lab {

struct DriverFns {
  PFN_cuGraphKernelNodeGetParams_v12000 params = nullptr;
  PFN_cuGraphKernelNodeGetAttribute_v11000 attr = nullptr;
  PFN_cuFuncGetName_v12030 fname = nullptr;
  PFN_cuKernelGetName_v12030 kname = nullptr;
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
    std::printf("        kernel grid %u×%u×%u (%u CTAs) block %u dyn smem %u cluster %s%u×%u×%u  %.160s\n",
                kp.gridDimX, kp.gridDimY, kp.gridDimZ, kp.gridDimX * kp.gridDimY * kp.gridDimZ,
                kp.blockDimX * kp.blockDimY * kp.blockDimZ, kp.sharedMemBytes, has_cluster ? "" : "(n/a) ",
                cv.clusterDim.x, cv.clusterDim.y, cv.clusterDim.z, name ? name : "(name n/a)");
  }
  return memsets;
}

}  // namespace lab
