#!/usr/bin/env bash
# On the H200 (the `device` tool): laplace-3b (random weights) behind `laplace serve`, driven by
# STREAMS concurrent streaming completions (`laplace bench http`), against `bench decode` at the
# same concurrency and engine settings: serve_http_tok_s_3b_<STREAMS> and the percentage of the
# engine's own rate that reaches clients through HTTP (issue 29: at least 90 % at 1,280).
#
#   COMMIT=abc123 scripts/device/http.sh      (carry .carry/boost and .carry/corpus)
#
# Needs the Boost.Asio/Beast headers in .carry/boost (scripts/device/carry_boost.sh on Debian) and a
# tokenizer, TOKENIZER (default .carry/corpus/tokenizer.model, scripts/corpus.sh --carry): the server
# speaks text.
# Results in $OUT/results.jsonl, logs in $OUT/http.log.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-out}
mkdir -p "$OUT"
export LAPLACE_COMMIT=${COMMIT:-$(git describe --always --dirty --abbrev=7 2>/dev/null || echo unknown)}
BUILD=${BUILD:-build-srv-gpu}
STREAMS=${STREAMS:-1280}
TOKENS=${TOKENS:-256}     # per stream; the decode window is all but the first
PROMPT=${PROMPT:-16}
PORT=${PORT:-18080}
CONFIG=${CONFIG:-configs/laplace-3b.json}
NAME=${NAME:-3b}          # the figures' tag: NAME_STREAMS
DEV=(--device "${DEVICE:-cuda}" --dtype "${DTYPE:-bf16}")  # DEVICE=cpu DTYPE=f32: a dry run on a CPU machine
R="$OUT/results.jsonl"
LOG="$OUT/http.log"
ENGINE=(--max-batch-tokens 24000 --prefill-chunk 16)
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 ))s] $*" | tee -a "$LOG"; }

if [ -z "${NO_BUILD:-}" ]; then
  [ -f .carry/boost/boost/beast/http/parser.hpp ] || { echo "no .carry/boost: run scripts/device/carry_boost.sh and carry it"; exit 1; }
  cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a -DLAPLACE_TESTS=OFF \
    -DLAPLACE_BENCH=OFF -DLAPLACE_MPI=OFF -DLAPLACE_BOOST_ROOT=.carry/boost > "$OUT/configure.log" 2>&1 ||
    { tail -30 "$OUT/configure.log"; exit 1; }
  cmake --build "$BUILD" -j "$(nproc)" --target laplace > "$OUT/build.log" 2>&1 ||
    { grep -E "error|FAILED" -A3 "$OUT/build.log" | head -60; exit 1; }
  stamp "build ok"
fi
L=$BUILD/laplace

# The engine alone: bench decode at the same concurrency (random weights of the same shapes).
timeout 300 $L bench decode --config "$CONFIG" "${DEV[@]}" --batch "$STREAMS" --steps 20 \
  --warmup 3 --prompt-len "$PROMPT" "${ENGINE[@]}" --results "$R" --tag "${NAME}_${STREAMS}_beside_http" 2>&1 |
  tee -a "$LOG" | grep -E "decode:"
DEC=$(python3 -c 'import json,sys
v=[json.loads(l)["value"] for l in open(sys.argv[1]) if "\"decode_tok_s_" in l]
print(v[-1] if v else 0)' "$R")
stamp "bench decode: $DEC tok/s"

# The same engine behind HTTP.
M=${WORK:-/tmp}/laplace_http_model  # 3B random weights in f32: 12 GB, not under $OUT
rm -rf "$M"
$L init --config "$CONFIG" --out "$M" --seed 1 > "$OUT/init.log" 2>&1 || { tail "$OUT/init.log"; exit 1; }
cp "${TOKENIZER:-.carry/corpus/tokenizer.model}" "$M/tokenizer.model"
stamp "model written"
$L serve --model "$M" "${DEV[@]}" --port "$PORT" --max-slots "$STREAMS" --max-queue 0 --cache-slots 0 \
  --cache-mb 0 "${ENGINE[@]}" > "$OUT/serve.log" 2>&1 &
PID=$!
trap 'kill $PID 2> /dev/null; wait $PID 2> /dev/null' EXIT
for _ in $(seq 1 600); do
  grep -q "ready" "$OUT/serve.log" 2> /dev/null && break
  kill -0 "$PID" 2> /dev/null || break
  sleep 0.5
done
grep -q "ready" "$OUT/serve.log" || { tail -20 "$OUT/serve.log"; exit 1; }
stamp "server ready"
ulimit -n "$(ulimit -Hn)" 2> /dev/null
# A short round first (CUDA graphs, allocations, first connections), then the measured one.
$L bench http --port "$PORT" --streams 64 --prompt-len "$PROMPT" --max-tokens 16 --vocab 32768 --results "" \
  >> "$LOG" 2>&1
timeout 400 $L bench http --port "$PORT" --streams "$STREAMS" --prompt-len "$PROMPT" --max-tokens "$TOKENS" \
  --vocab 32768 --compare-tok-s "$DEC" --device-name "${DEVICE_NAME:-NVIDIA H200}" --results "$R" --tag "${NAME}_${STREAMS}" 2>&1 |
  tee -a "$LOG" | grep -E "^http:|error"
stamp "bench http exit ${PIPESTATUS[0]}"
