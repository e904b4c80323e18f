#!/usr/bin/env bash
# On a machine with several GPUs (the `device` tool's nvidia-h200-x2 and up): build, run
# the distributed tests (NCCL on the GPUs, MPI on the CPUs), then train laplace-3b at
# T = 2048 on 1 GPU (the single-GPU trainer) and with FSDP on all of them, with both
# Muon strategies. Per-step
# lines go to $OUT/train_*.log; $OUT/summary.txt has the medians (steps after the first
# two) of tokens/s, Muon time and Muon bytes.
# Usage: [B=8] [A=2] [STEPS=8] [FILTER=...] [SKIP_TESTS=1] scripts/device/distributed.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-out}
mkdir -p "$OUT"
# NVLink multicast stays off on shared hosts (the device manual); laplace sets it too.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
NGPU=$(nvidia-smi -L | grep -c '^GPU')
B=${B:-8} A=${A:-2} STEPS=${STEPS:-8}
if [ "${SKIP_TESTS:-0}" = 1 ]; then
  cmake --build build-gpu -j "$(nproc)" --target laplace > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
else
  FILTER=${FILTER:-Dist*:CudaOps.RowSum*} ./scripts/device/gpu_tests.sh || exit 1
fi

DATA=/tmp/laplace_data3b
mkdir -p "$DATA"
python3 - "$DATA/train_000000.bin" <<'EOF'
import sys, numpy as np
n, V = 16_000_000, 92160  # laplace-3b's vocabulary; random tokens (loss ≈ ln V)
hdr = np.zeros(256, np.int32); hdr[0], hdr[1], hdr[2] = 20240520, 2, n
with open(sys.argv[1], "wb") as f:
    f.write(hdr.tobytes()); f.write(np.random.default_rng(1).integers(0, V, n, dtype=np.uint32).tobytes())
EOF

run() {  # name P muon-comm
  local name=$1 P=$2 mc=$3 launch
  if [ "$P" -gt 1 ]; then
    launch="mpirun --allow-run-as-root --bind-to none -np $P -x NCCL_NVLS_ENABLE build-gpu/laplace train"
  else
    launch="build-gpu/laplace train --distributed"
  fi
  echo "== $name: $P GPU(s), muon $mc, B=$B A=$A T=2048"
  timeout 420 $launch --config configs/laplace-3b.json --data "$DATA/train_000000.bin" --device cuda --dtype bf16 \
    --seq 2048 --batch "$B" --grad-accum "$A" --steps "$STEPS" --lr 1e-3 --warmup 2 --peak-tflops 989 \
    --muon-comm "$mc" > "$OUT/train_$name.log" 2>&1
  echo "exit $?"
  grep -E "^(model|dist|memory|data):" "$OUT/train_$name.log"
  grep -E "^step" "$OUT/train_$name.log" | tail -3
  grep -iE "error|fail" "$OUT/train_$name.log" | head -5
}

# One GPU: the single-GPU trainer (FSDP on one rank would hold a second copy of every
# gradient and Muon buffer, which does not fit laplace-3b at B = 8 on one H200).
echo "== 1 GPU: bench_train B=$B A=$A"
timeout 300 ./build-gpu/bench/bench_train --batch "$B" --accum "$A" --steps 3 --warmup 1 > "$OUT/bench_train.log" 2>&1
echo "exit $?"; tail -6 "$OUT/bench_train.log"
run p${NGPU}_a2a "$NGPU" all_to_all
run p${NGPU}_gather "$NGPU" gather

python3 - "$OUT" "$NGPU" <<'EOF' | tee "$OUT/summary.txt"
import re, statistics, sys, glob, os
out, ngpu = sys.argv[1], int(sys.argv[2])
pat = re.compile(r"\| ([\d.]+) tok/s .*\| muon (\S+) ([\d.]+ \S+)/rank \(max sent\+recv\), ([\d.]+) ms")
res = {}
for f in sorted(glob.glob(os.path.join(out, "train_*.log"))):
    rows = [pat.search(l) for l in open(f) if l.startswith("step")]
    rows = [r for r in rows if r][2:]
    if not rows: print(os.path.basename(f), "no steps"); continue
    tok = statistics.median(float(r.group(1)) for r in rows)
    ms = statistics.median(float(r.group(4)) for r in rows)
    name = os.path.basename(f)[6:-4]
    res[name] = tok
    print(f"{name}: {tok:,.0f} tok/s ({tok / int(name[1:name.index('_')]):,.0f} per GPU), muon {rows[0].group(2)} "
          f"{rows[0].group(3)}/rank, {ms:.0f} ms/step, {len(rows)} steps")
m = re.search(r"result: ([\d.]+) tokens/s whole steps", open(os.path.join(out, "bench_train.log")).read())
if m:
    one = float(m.group(1).replace(",", ""))
    print(f"1 GPU (bench_train whole step): {one:,.0f} tok/s")
    for name, tok in res.items():
        P = int(name[1:name.index('_')])
        print(f"scaling efficiency {name}: {tok / (P * one):.3f}")
EOF
