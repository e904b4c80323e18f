// Builds without NCCL (no CUDA, or CMake found no nccl.h / libnccl): the NCCL
// communicator reports why it is missing.
#include "distributed/comm.h"

namespace laplace {

bool nccl_available() { return false; }

Status make_nccl_communicator(std::unique_ptr<Communicator>*) {
#ifdef LAPLACE_HAVE_CUDA
  return Status::unsupported(
      "this laplace was built without NCCL (CMake found no nccl.h/libnccl next to the CUDA toolkit), so it cannot "
      "train on GPUs in distributed mode; install NCCL (Debian: libnccl-dev) and rebuild");
#else
  return Status::unsupported("this laplace was built without CUDA, so it has no NCCL communicator");
#endif
}

}  // namespace laplace
