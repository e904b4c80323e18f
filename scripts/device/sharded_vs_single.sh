#!/usr/bin/env bash
# On one H200 (the `device` tool): the single-device trainer against the sharded one on the same
# GPU (`laplace train --distributed`: a one-rank NCCL communicator), laplace-125m at T = 2048 on
# random tokens, the same flags. Prints each run's median tokens/s over steps 5.. and the
# per-step losses side by side (the two accumulate gradients in another order, so they agree to
# rounding, not bit for bit). Logs and metrics under $OUT.
#   [COMMIT=abc123] [STEPS=30] [BUILD=1] scripts/device/sharded_vs_single.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0
STEPS=${STEPS:-30}
if [ "${BUILD:-1}" = 1 ]; then
  cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a -DLAPLACE_TESTS=OFF \
    -DLAPLACE_BENCH=OFF > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
  cmake --build build-gpu -j "$(nproc)" --target laplace >> "$OUT/build.log" 2>&1 ||
    { grep -E "error|FAILED" -A3 "$OUT/build.log" | head -40; exit 1; }
  echo "build ok"
fi
DATA=/tmp/laplace_p1
mkdir -p "$DATA"
python3 - "$DATA/train_000000.bin" <<'EOF'
import sys, numpy as np
n, V = 8_000_000, 32768  # laplace-125m's vocabulary; random tokens
hdr = np.zeros(256, np.int32); hdr[0], hdr[1], hdr[2] = 20240520, 1, n
with open(sys.argv[1], "wb") as f:
    f.write(hdr.tobytes()); f.write(np.random.default_rng(1).integers(0, V, n, dtype=np.uint16).tobytes())
EOF
FLAGS="--config configs/laplace-125m.json --data $DATA/train_000000.bin --device cuda --dtype bf16 --batch 16 --seq 2048
  --grad-accum 2 --steps $STEPS --lr 1.5e-3 --warmup 5 --peak-tflops 989"
for mode in single distributed; do
  extra=""; [ $mode = distributed ] && extra="--distributed"
  rm -rf "$DATA/$mode"
  timeout 200 build-gpu/laplace train $extra $FLAGS --out "$DATA/$mode" > "$OUT/train_$mode.log" 2>&1
  echo "$mode: exit $?"
  cp "$DATA/$mode/metrics.jsonl" "$OUT/metrics_$mode.jsonl" 2>/dev/null
done
python3 - "$OUT" <<'EOF'
import json, statistics, sys
out = sys.argv[1]
runs = {}
for m in ("single", "distributed"):
    try:
        runs[m] = [json.loads(l) for l in open(f"{out}/metrics_{m}.jsonl") if '"loss"' in l]
    except OSError:
        runs[m] = []
    t = [r["tokens_per_s"] for r in runs[m][5:]]
    if t:
        print(f"{m}: median {statistics.median(t):.0f} tokens/s over steps 5..{len(runs[m]) - 1}")
for a, b in zip(runs["single"], runs["distributed"]):
    print(f"step {a['step']:3d}: loss {a['loss']:.6f} {b['loss']:.6f}  grad norm {a['grad_norm']:.6f} {b['grad_norm']:.6f}")
EOF
