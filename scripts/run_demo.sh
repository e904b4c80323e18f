#!/usr/bin/env bash
# The demo, once built: fortunes corpus → BPE tokenizer → token shards → laplace-tiny
# trained on the CPU → checkpoint → generated text. Everything lands in runs/demo/.
# Environment: STEPS (default 500), LAPLACE (the binary: default build-demo/laplace, which
# scripts/demo.sh builds, or else build/laplace).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${LAPLACE:-}" ]; then
  LAPLACE=build/laplace
  [ -x build-demo/laplace ] && LAPLACE=build-demo/laplace
fi
OUT=${OUT:-runs/demo}
STEPS=${STEPS:-160}
FORTUNES=/usr/share/games/fortunes
mkdir -p "$OUT"

# 1. The corpus: every English fortune file that Debian's fortunes packages ship
#    (documents separated by '%' lines).
inputs=()
for f in "$FORTUNES"/*; do
  case "$f" in *.dat|*.u8) continue ;; esac
  [ -f "$f" ] && inputs+=("$f")
done
if [ ${#inputs[@]} -eq 0 ]; then
  echo "demo: no corpus under $FORTUNES (apt-get install fortunes fortunes-min)" >&2
  exit 1
fi
echo "== corpus: ${#inputs[@]} fortune files, $(cat "${inputs[@]}" | wc -c) bytes"

# 2. A 2048-piece BPE tokenizer (sentencepiece, deterministic).
if [ ! -f "$OUT/tokenizer.model" ]; then
  "$LAPLACE" tokenizer train --input "${inputs[@]}" --model-prefix "$OUT/tokenizer" --vocab-size 2048
fi

# 3. Token shards: 2% of the fortunes held out for validation.
if [ ! -f "$OUT/data/train_000000.bin" ]; then
  "$LAPLACE" data prepare --input "${inputs[@]}" --tokenizer "$OUT/tokenizer.model" --out "$OUT/data" \
    --format text --split fortune --val-fraction 0.02 --overwrite
fi

# 4. Train laplace-tiny (4 layers, D=128, 4 heads of 32×64 state) on the CPU.
"$LAPLACE" train --config configs/laplace-tiny.json --data "$OUT/data/train_*.bin" \
  --val-data "$OUT/data/val_*.bin" --tokenizer "$OUT/tokenizer.model" --out "$OUT/model" \
  --batch 16 --seq 128 --steps "$STEPS" --lr 0.015 --warmup 20 --schedule cosine --wd 0.01 \
  --eval-every 80 --eval-batches 8 --ckpt-every 200 --log-every 20

# 5. Generate from the trained checkpoint.
echo "== generation (temperature 0.8, top-k 40, seed 1)"
for prompt in "The meaning of life is" "Q: Why did the programmer" "A fortune"; do
  "$LAPLACE" generate --model "$OUT/model" --prompt "$prompt" --max-tokens 60 --temperature 0.8 \
    --top-k 40 --seed 1 | sed -n '/^text=/,$p' | sed 's/^text=//'
  echo "--"
done
echo "== held-out loss"
"$LAPLACE" eval --model "$OUT/model" --data "$OUT/data/val_*.bin" --batch 8 --seq 128
