// make_backend(): the CPU or the CUDA backend by name. Its own library (laplace_backends), above
// both backends, so that the CPU ops library and the CUDA one do not depend on each other.
#include "ops/backend.h"

namespace laplace {

Status make_backend(const std::string& device, std::unique_ptr<Backend>* out) {
  if (device == "cpu") {
    *out = make_cpu_backend();
    return Status::ok();
  }
  if (device != "cuda") return Status::invalid_argument("unknown device '" + device + "' (use cpu or cuda)");
  std::string why;
  *out = make_cuda_backend(&why);
  if (!*out) return Status::unsupported("no CUDA backend: " + why);
  return Status::ok();
}

}  // namespace laplace
