#!/usr/bin/env bash
# The test command: sets everything up from Debian packages, builds, and runs every
# test (C++ unit tests, the PyTorch reference's tests, C++-vs-reference tests, and
# the parsers under AddressSanitizer + UBSan). GPU tests skip with a message when
# no GPU is present.
set -euo pipefail
cd "$(dirname "$0")/.."
LAPLACE_SETUP_NODE=1 ./scripts/setup.sh
JOBS=${JOBS:-$(nproc)}

echo "== build (Release) =="
./scripts/build.sh

echo "== build (AddressSanitizer + UBSan, CPU only) =="
BUILD_DIR=build-asan ./scripts/build.sh -DCMAKE_BUILD_TYPE=RelWithDebInfo -DLAPLACE_SANITIZE=ON \
  -DLAPLACE_CUDA=OFF -DLAPLACE_BENCH=OFF

echo "== tests =="
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
ctest --test-dir build --output-on-failure -j "$JOBS"
# The sanitizer build runs the parsers and the tests that feed them bad input.
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  ctest --test-dir build-asan --output-on-failure -j "$JOBS" -L sanitize
