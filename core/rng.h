// SplitMix64 (Steele, Lea and Flood, 2014): the one generator and hash of the project.
// Portable and bit-exact everywhere (host and device), so data order, document splits,
// sampling and test inputs are reproducible by other implementations (docs/data.md
// spells the data loader's use out).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define LAPLACE_HOST_DEVICE __host__ __device__
#else
#define LAPLACE_HOST_DEVICE
#endif

namespace laplace {

inline constexpr uint64_t kSplitMixGamma = 0x9e3779b97f4a7c15ull;

// SplitMix64's output function applied to x + gamma: a bijective hash in which every
// input bit reaches every output bit.
LAPLACE_HOST_DEVICE constexpr uint64_t splitmix64_hash(uint64_t x) {
  uint64_t z = x + kSplitMixGamma;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// The generator: the state advances by gamma and each output is the hash of the old state.
struct SplitMix64 {
  uint64_t state = 0;

  LAPLACE_HOST_DEVICE constexpr uint64_t next() {
    const uint64_t z = splitmix64_hash(state);
    state += kSplitMixGamma;
    return z;
  }
  // Uniform in [0, 1) with 53 random bits.
  LAPLACE_HOST_DEVICE constexpr double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }
  // Uniform in [0, m), m >= 1, without modulo bias (rejection below 2^64 mod m).
  constexpr uint64_t below(uint64_t m) {
    const uint64_t threshold = (0 - m) % m;
    while (true) {
      const uint64_t x = next();
      if (x >= threshold) return x % m;
    }
  }
};

}  // namespace laplace
