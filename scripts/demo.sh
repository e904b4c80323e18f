#!/usr/bin/env bash
# The main job: set up, build, prepare an embedded corpus (Debian's fortunes),
# train the tokenizer and laplace-tiny on the CPU, save a checkpoint, generate text.
# It installs and builds only what it runs: the demo's Debian packages (setup.sh --demo) and
# the `laplace` program in build-demo/, without the tests, the benchmarks, the HTTP server, MPI
# or the CUDA backend (DEMO_CUDA=1 builds the CUDA backend too, where nvcc is found).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh --demo
export BUILD_DIR=${BUILD_DIR:-build-demo}
TARGET=laplace ./scripts/build.sh -DLAPLACE_TESTS=OFF -DLAPLACE_BENCH=OFF -DLAPLACE_SERVER=OFF \
  -DLAPLACE_MPI=OFF -DLAPLACE_CUDA="$([ "${DEMO_CUDA:-0}" = 1 ] && echo ON || echo OFF)"
LAPLACE="$BUILD_DIR/laplace" exec ./scripts/run_demo.sh "$@"
