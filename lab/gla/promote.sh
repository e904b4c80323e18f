#!/usr/bin/env bash
# Promotes a lab version into the backend: ops/cuda/kernels_gla_tc.cu = the version's device
# code (namespace laplace::cuda::gla_tc) + lab/gla/tc_host.inc (the backend entry points).
# Usage: lab/gla/promote.sh lab/gla/gla_tc_v1.cuh
set -euo pipefail
cd "$(dirname "$0")/../.."
src=${1:?usage: promote.sh lab/gla/gla_tc_vN.cuh}
dst=ops/cuda/kernels_gla_tc.cu
{
  echo "// GENERATED from $src by lab/gla/promote.sh: edit the lab version, then re-run the script."
  echo "//"
  # the version's header comment, then its code with the namespace moved under laplace::cuda
  sed -e 's|^#pragma once$|#include "ops/cuda/cuda_common.cuh"|' \
      -e 's|^namespace gla_tc {|namespace laplace::cuda::gla_tc {|' \
      -e 's|^}  // namespace gla_tc|}  // namespace laplace::cuda::gla_tc|' "$src"
  cat lab/gla/tc_host.inc
} > "$dst"
echo "wrote $dst"
