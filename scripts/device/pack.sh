#!/usr/bin/env bash
# Packs the CUDA binaries built here for a device call: .carry/bin.tar.xz holds laplace, bench_train,
# laplace_tests and libcupti_trace.so (stripped, from BUILD, default build-cu: sm_90a, -DLAPLACE_EXPERIMENTS=ON)
# and the shared libraries they load that the GPU machine (Ubuntu 24.04 with CUDA, NCCL and OpenMPI) lacks
# or may hold in another version: OpenBLAS and its Fortran runtime, sentencepiece, OpenMPI's C++ binding.
# scripts/device/long_context.sh unpacks it into build-gpu/ and skips its build stage; a call saves the minutes
# of compiling the CUDA kernels there.
#
#   scripts/device/pack.sh [BUILD]      then name .carry/bin.tar.xz in the call's carry
#   BINS="laplace" scripts/device/pack.sh   only those binaries (a call carrying data has 64 MiB in all)
#   PACK_AS=bin-tests BINS=... pack.sh       into .carry/bin-tests.tar.xz instead (long_context.sh unpacks both)
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${1:-build-cu}
BINS=${BINS:-"laplace bench_train laplace_tests cupti_trace"}
declare -A FILE=([laplace]=laplace [bench_train]=bench/bench_train [laplace_tests]=tests/laplace_tests
                 [cupti_trace]=experiments/libcupti_trace.so)
cmake --build "$BUILD" -j "$(nproc)" --target $BINS
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for b in $BINS; do
  f=${FILE[$b]}
  strip -o "$tmp/$(basename $f)" "$BUILD/$f"
done
for lib in libopenblas.so.0 libgfortran.so.5 libquadmath.so.0 libsentencepiece.so.0 libsentencepiece_train.so.0 \
           libmpi_cxx.so.40; do
  path=$(ldd "$BUILD/laplace" | awk -v l="$lib" '$1 == l { print $3 }')
  [ -n "$path" ] && cp -L "$path" "$tmp/"
done
mkdir -p .carry
dest=.carry/${PACK_AS:-bin}.tar.xz
tar -C "$tmp" -cf - . | xz -T0 -6 > "$dest"
echo "device_pack: $dest $(du -h "$dest" | cut -f1): $(ls "$tmp" | tr '\n' ' ')"
