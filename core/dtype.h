// Element types and devices.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>

namespace laplace {

// kF8E4M3: OCP FP8 E4M3 (core/fp8.h), stored as one byte; only quantised weights use it.
enum class DType : uint8_t { kF32, kF64, kBF16, kF16, kI32, kI64, kU16, kU8, kF8E4M3 };
enum class Device : uint8_t { kCPU, kCUDA };

constexpr size_t dtype_size(DType t) {
  switch (t) {
    case DType::kF64: case DType::kI64: return 8;
    case DType::kF32: case DType::kI32: return 4;
    case DType::kBF16: case DType::kF16: case DType::kU16: return 2;
    case DType::kU8: case DType::kF8E4M3: return 1;
  }
  return 0;
}

// Names as safetensors writes them ("F32", "BF16", ...).
const char* dtype_name(DType t);
// Parses a safetensors dtype name; false if unknown.
bool dtype_from_name(std::string_view name, DType* out);

const char* device_name(Device d);

template <class T> constexpr DType dtype_of();
template <> constexpr DType dtype_of<float>() { return DType::kF32; }
template <> constexpr DType dtype_of<double>() { return DType::kF64; }
template <> constexpr DType dtype_of<int32_t>() { return DType::kI32; }
template <> constexpr DType dtype_of<int64_t>() { return DType::kI64; }
template <> constexpr DType dtype_of<uint16_t>() { return DType::kU16; }
template <> constexpr DType dtype_of<uint8_t>() { return DType::kU8; }

// bfloat16 <-> float on the host, round-to-nearest-even (NaN kept quiet).
inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline float bf16_to_float(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace laplace
