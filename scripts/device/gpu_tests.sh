#!/usr/bin/env bash
# On a GPU machine (the H200 of the `device` tool): build with CUDA for sm_90a and
# run the GPU tests, writing logs under $OUT (or ./out).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1
# CMAKE_EXTRA: more configure flags, e.g. -DLAPLACE_BOOST_ROOT=.carry/boost for the server.
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a ${CMAKE_EXTRA:-} \
  > "$OUT/configure.log" 2>&1 || { tail -30 "$OUT/configure.log"; exit 1; }
cmake --build build-gpu -j "$(nproc)" > "$OUT/build.log" 2>&1 || { grep -E "error|FAILED" -A3 "$OUT/build.log" | head -60; exit 1; }
echo "build ok"
./build-gpu/tests/laplace_tests --gtest_filter="${FILTER:-CudaOps*}" > "$OUT/cuda_tests.log" 2>&1
echo "cuda tests exit $?"
grep -E "^\[  (FAILED|PASSED|SKIPPED) |OK \]|Failure|error" "$OUT/cuda_tests.log" | head -80
