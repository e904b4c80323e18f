#!/usr/bin/env bash
# Configures and builds Laplace in build/ (Release). The CUDA backend is built too
# whenever nvcc is found (/usr/local/cuda/bin/nvcc or on PATH), GPU or not.
# Environment: BUILD_DIR (default build), JOBS (default nproc), TARGET (default: everything);
# arguments go to the configure step.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
JOBS=${JOBS:-$(nproc)}
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release "$@"
cmake --build "$BUILD_DIR" -j "$JOBS" ${TARGET:+--target "$TARGET"}
