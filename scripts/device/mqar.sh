#!/usr/bin/env bash
# On the H200 (the `device` tool): the MQAR grid of docs/quality.md ("Recall: MQAR").
#
#   CUDA build of `laplace` in build-gpu/ (skipped when NO_BUILD=1), then `laplace eval mqar` on the GPU
#   in bf16 over the grid below; $OUT gets mqar.jsonl, results.jsonl (mqar_acc_* lines), the table
#   (mqar.txt), the progress log (mqar.log) and, when matplotlib is there, mqar.png.
#   Every grid setting can be overridden from the environment (STATES, PAIRS, SEQS, STEPS, ...).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-out}
mkdir -p "$OUT"
STATES=${STATES:-1x16x16,2x16x32,4x32x64,4x64x128}
PAIRS=${PAIRS:-16,64}
SEQS=${SEQS:-256}
VOCAB=${VOCAB:-256}  # at 8,192 these models do not leave chance in 2,000 steps (docs/quality.md)
DIM=${DIM:-128}
LAYERS=${LAYERS:-2}
STEPS=${STEPS:-2000}
BATCH=${BATCH:-64}
LR=${LR:-3e-3}
EVAL=${EVAL:-1000}
SEED=${SEED:-1}
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 ))s] $*" | tee -a "$OUT/summary.txt"; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader >> "$OUT/summary.txt" 2>&1

if [ "${NO_BUILD:-0}" != 1 ]; then
  cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a \
    -DLAPLACE_TESTS=OFF -DLAPLACE_BENCH=OFF > "$OUT/configure.log" 2>&1 || { tail -30 "$OUT/configure.log"; exit 1; }
  cmake --build build-gpu -j "$(nproc)" --target laplace > "$OUT/build.log" 2>&1 ||
    { grep -E "error|FAILED" -A3 "$OUT/build.log" | head -60; exit 1; }
  stamp "build ok"
fi

build-gpu/laplace eval mqar --device cuda --dtype bf16 --vocab "$VOCAB" --dim "$DIM" --layers "$LAYERS" \
  --state-sizes "$STATES" --pairs "$PAIRS" --seq-lens "$SEQS" --steps "$STEPS" --batch "$BATCH" --lr "$LR" \
  --eval-examples "$EVAL" --seed "$SEED" --out "$OUT" --results "$OUT/results.jsonl" \
  > "$OUT/mqar.txt" 2> "$OUT/mqar.log"
rc=$?
cat "$OUT/mqar.txt"
stamp "eval mqar exit $rc"
grep -E "error|accuracy" "$OUT/mqar.log" | tail -40
python3 scripts/plot_mqar.py "$OUT/mqar.jsonl" --out "$OUT/mqar.png" --title "laplace eval mqar, H200 bf16" || true
exit $rc
