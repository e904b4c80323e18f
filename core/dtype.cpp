#include "core/dtype.h"

namespace laplace {

const char* dtype_name(DType t) {
  switch (t) {
    case DType::kF32: return "F32";
    case DType::kF64: return "F64";
    case DType::kBF16: return "BF16";
    case DType::kF16: return "F16";
    case DType::kI32: return "I32";
    case DType::kI64: return "I64";
    case DType::kU16: return "U16";
    case DType::kU8: return "U8";
    case DType::kF8E4M3: return "F8_E4M3";  // safetensors' name
  }
  return "?";
}

bool dtype_from_name(std::string_view n, DType* out) {
  static constexpr DType all[] = {DType::kF32, DType::kF64, DType::kBF16, DType::kF16,
                                  DType::kI32, DType::kI64, DType::kU16, DType::kU8, DType::kF8E4M3};
  for (DType t : all) {
    if (n == dtype_name(t)) {
      *out = t;
      return true;
    }
  }
  return false;
}

const char* device_name(Device d) { return d == Device::kCPU ? "cpu" : "cuda"; }

}  // namespace laplace
