#!/usr/bin/env bash
# On the H200: build, run the GPU tests, then the benchmark programs; logs and
# bench results (JSON lines) under $OUT. Usage: COMMIT=abc123 scripts/device/gpu_bench.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-out}
COMMIT=${COMMIT:-$(git describe --always --dirty --abbrev=7 2>/dev/null || echo unknown)}
mkdir -p "$OUT"
FILTER=${FILTER:-CudaOps*:CudaModel*} ./scripts/device/gpu_tests.sh || exit 1
R="$OUT/results.jsonl"
timeout 120 ./build-gpu/bench/bench_gla --results "$R" --commit "$COMMIT" 2>&1 | tee "$OUT/bench_gla.log" | tail -8
timeout 240 ./build-gpu/bench/bench_train --results "$R" --commit "$COMMIT" 2>&1 | tee "$OUT/bench_train.log" | tail -14
timeout 150 ./build-gpu/laplace bench decode --config configs/laplace-3b.json --device cuda --dtype bf16 \
  --batch 1280 --steps 10 --warmup 2 --prompt-len 16 --prefill-chunk 16 --results "$R" --tag 3b_1280_fp32state \
  2>&1 | tee "$OUT/bench_decode.log" | tail -8
