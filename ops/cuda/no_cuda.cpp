// Built when nvcc is absent: the CUDA backend factory reports why there is none.
#include "ops/backend.h"

namespace laplace {

std::unique_ptr<Backend> make_cuda_backend(std::string* why) {
  if (why) *why = "this build of laplace has no CUDA backend (nvcc was not found at configure time)";
  return nullptr;
}

}  // namespace laplace
