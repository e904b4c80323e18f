#!/usr/bin/env bash
# On the GPU machine (the H200 of the `device` tool): build `laplace serve` and the server
# tests there, with the Boost.Asio/Beast headers carried in .carry/boost (made on Debian by
# scripts/device/carry_boost.sh; the machine has no Boost and no network), then
#   1. the engine-cache and server tests on the CPU (the carried build works there);
#   2. the server tests with the servers on the GPU (LAPLACE_SERVER_TEST_DEVICE=cuda);
#   3. `laplace serve --device cuda` on laplace-tiny (random weights) driven with curl:
#      a repeated prompt is a device-tier hit, byte-identical to a cold run, counted in
#      /metrics; with one cache slot a demoted prompt comes back as a host-tier hit,
#      byte-identical too, and the device tier never holds more than its one slot.
# Logs under $OUT (or ./out). The last line is "DEVICE SERVE CHECK: PASS" or "...: FAIL (n)".
# Rerunning on a warm machine rebuilds incrementally (build-srv-gpu is kept).
# For a dry run of step 3 on a CPU machine: DEVICE=cpu BUILD=build-srv NO_BUILD=1 NO_GTEST=1.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-out}
mkdir -p "$OUT"
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }
ok() { echo "ok: $*"; }

DEVICE=${DEVICE:-cuda}
BUILD=${BUILD:-build-srv-gpu}
t0=$SECONDS
if [ -z "${NO_BUILD:-}" ]; then
  [ -f .carry/boost/boost/beast/http/parser.hpp ] || { echo "no .carry/boost: run scripts/device/carry_boost.sh on Debian and carry .carry/boost"; exit 1; }
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/gpu.txt" 2>&1
  gen=()
  command -v ninja > /dev/null && gen=(-G Ninja)
  cmake -S . -B "$BUILD" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a \
    -DLAPLACE_BENCH=OFF -DLAPLACE_MPI=OFF -DLAPLACE_BOOST_ROOT=.carry/boost > "$OUT/configure.log" 2>&1 ||
    { tail -30 "$OUT/configure.log"; echo "DEVICE SERVE CHECK: FAIL (configure)"; exit 1; }
  grep -E "laplace: (CUDA|HTTP)" "$OUT/configure.log"
  cmake --build "$BUILD" -j "$(nproc)" --target laplace laplace_tests > "$OUT/build.log" 2>&1 ||
    { grep -E "error|FAILED" -A3 "$OUT/build.log" | head -60; echo "DEVICE SERVE CHECK: FAIL (build)"; exit 1; }
  echo "build ok ($((SECONDS - t0)) s)"
fi
B=$BUILD/laplace
T=$BUILD/tests/laplace_tests

# ---- 1 and 2: the gtest suites ----
gtest() {  # name, log, filter [env...]
  local name=$1 log=$2 filter=$3
  shift 3
  env "$@" timeout 240 "$T" --gtest_filter="$filter" > "$OUT/$log" 2>&1
  local rc=$?
  grep -E "^\[  (PASSED|FAILED) |^\[==========\] [0-9]+ tests" "$OUT/$log"
  [ $rc = 0 ] && ok "$name" || fail "$name (exit $rc; see $log)"
}
if [ -z "${NO_GTEST:-}" ]; then
  gtest "server tests, CPU" server_tests_cpu.log 'EngineCache*:EngineSnapshot*:PrefixCache*:ServerTest*:ServerLoading*'
  gtest "server tests, servers on $DEVICE" server_tests_$DEVICE.log 'ServerTest*' LAPLACE_SERVER_TEST_DEVICE=$DEVICE
fi

# ---- 3: laplace serve --device cuda, driven with curl ----
W=$OUT/work
rm -rf "$W"
mkdir -p "$W"
for i in $(seq 1 300); do
  echo "the quick brown fox $i jumps over the lazy dog; a fortune a day keeps the doctor away."
  echo "Why did the programmer quit? Because he did not get arrays. The meaning of life is $((i % 7))."
done > "$W/corpus.txt"
"$B" tokenizer train --input "$W/corpus.txt" --model-prefix "$W/tok" --vocab-size 400 > "$W/tok.log" 2>&1 || fail "tokenizer"
# laplace-tiny's shapes with the tokenizer's 400 pieces, so every generated id is text.
sed 's/"vocab_size": [0-9]*/"vocab_size": 400/' configs/laplace-tiny.json > "$W/tiny400.json"
"$B" init --config "$W/tiny400.json" --out "$W/model" --seed 5 > "$W/init.log" 2>&1 || fail "init"
cp "$W/tok.model" "$W/model/tokenizer.model"

PID=
stop_server() { if [ -n "$PID" ]; then kill "$PID" 2> /dev/null; wait "$PID" 2> /dev/null; PID=; fi; }
trap stop_server EXIT
start_server() {  # log name, extra args
  local log=$OUT/$1
  shift
  "$B" serve --model "$W/model" --name tiny --port 0 --device "$DEVICE" --max-slots 4 "$@" > "$log" 2>&1 &
  PID=$!
  for _ in $(seq 1 300); do
    grep -q "ready" "$log" 2> /dev/null && break
    kill -0 "$PID" 2> /dev/null || break
    sleep 0.1
  done
  grep -q "ready" "$log" || { cat "$log"; return 1; }
  PORT=$(sed -n 's/.*listening on http:\/\/127.0.0.1:\([0-9]*\).*/\1/p' "$log")
  URL="http://127.0.0.1:$PORT"
  grep "laplace serve: \(engine\|state cache\)" "$log"
}
complete() { curl -sf "$URL/v1/completions" -H 'Content-Type: application/json' -d "$1"; }
# The choices of a reply — text, and with "logprobs" the tokens and their log-probabilities
# (so "identical" covers the distributions' bits too) — and its cached-token count.
texts() {
  if command -v python3 > /dev/null; then
    python3 -c 'import json,sys; print(json.dumps([[c["text"], c["logprobs"]] for c in json.load(sys.stdin)["choices"]]))'
  else
    sed -E 's/.*"choices":(\[.*\]),"created".*/\1/'
  fi
}
cached() { grep -o '"cached_tokens":[0-9]*' | cut -d: -f2; }
metric() { curl -sf "$URL/metrics" | awk -v m="$1" '$1 == m { print $2 }'; }

if start_server serve_$DEVICE.log --cache-slots 4; then
  for mode in greedy sampled; do
    if [ $mode = greedy ]; then s='"temperature":0'; else s='"temperature":1.0,"seed":7'; fi
    req='"prompt":"Why did the programmer quit? Because the quick brown fox '$mode'","max_tokens":32,"ignore_eos":true,"logprobs":2,'$s
    cold=$(complete "{$req,\"cache\":false}") || fail "$mode: cold request"
    h0=$(metric laplace_cache_device_hits_total)
    first=$(complete "{$req}")   # a miss: caches the prompt state (and the final state)
    again=$(complete "{$req}")   # the prompt again: a device-tier hit
    h1=$(metric laplace_cache_device_hits_total)
    echo "$mode: cold   $(texts <<< "$cold" | cut -c1-100)"
    echo "$mode: cached $(texts <<< "$again" | cut -c1-100) (cached_tokens $(cached <<< "$again"))"
    [ -n "$cold" ] && [ "$(texts <<< "$again")" = "$(texts <<< "$cold")" ] && [ "$(texts <<< "$first")" = "$(texts <<< "$cold")" ] &&
      ok "$mode: device-tier hit byte-identical to the cold run" || fail "$mode: cached output differs from the cold run"
    [ "$(cached <<< "$again")" -gt 0 ] && [ "$(cached <<< "$cold")" = 0 ] && ok "$mode: usage.cached_tokens" ||
      fail "$mode: cached_tokens cold=$(cached <<< "$cold") again=$(cached <<< "$again")"
    [ "${h1:-0}" -ge $((${h0:-0} + 1)) ] && ok "$mode: /metrics laplace_cache_device_hits_total $h0 -> $h1" ||
      fail "$mode: device hits $h0 -> $h1"
  done
  [ "$(metric laplace_cache_host_hits_total)" = 0 ] && ok "no host-tier hits while the device tier has room" ||
    fail "host hits: $(metric laplace_cache_host_hits_total)"
  curl -sf "$URL/metrics" | grep '^laplace_cache_' > "$OUT/metrics_$DEVICE.txt"
  stop_server
else
  fail "laplace serve --device $DEVICE did not start (serve_$DEVICE.log)"
fi

# One cache slot: every request's final state demotes its prompt state to the host tier.
if start_server serve_${DEVICE}_1slot.log --cache-slots 1; then
  declare -A cold1
  for k in 0 1 2; do
    req='"prompt":"the lazy dog number '$k' keeps the doctor away","max_tokens":16,"ignore_eos":true,"logprobs":2,"temperature":1.0,"seed":3'
    cold1[$k]=$(complete "{$req,\"cache\":false}" | texts)
    complete "{$req}" > /dev/null
  done
  req0='"prompt":"the lazy dog number 0 keeps the doctor away","max_tokens":16,"ignore_eos":true,"logprobs":2,"temperature":1.0,"seed":3'
  hh0=$(metric laplace_cache_host_hits_total)
  back=$(complete "{$req0}")
  hh1=$(metric laplace_cache_host_hits_total)
  [ "$(texts <<< "$back")" = "${cold1[0]}" ] && [ "$(cached <<< "$back")" -gt 0 ] &&
    ok "demoted prompt: host-tier hit byte-identical to the cold run" || fail "host-tier hit differs: $(texts <<< "$back") vs ${cold1[0]}"
  [ "${hh1:-0}" = $((${hh0:-0} + 1)) ] && ok "/metrics laplace_cache_host_hits_total $hh0 -> $hh1" || fail "host hits $hh0 -> $hh1"
  used=$(metric laplace_cache_device_slots_used)
  [ "$used" = 1 ] && [ "$(metric laplace_cache_device_slots_free)" = 0 ] && [ "$(metric laplace_cache_demotions_total)" -ge 5 ] &&
    ok "device tier: 1 slot used, demotions $(metric laplace_cache_demotions_total)" || fail "device slots used $used"
  # A burst of 24 concurrent requests over the three prompts, then every slot is back.
  for i in $(seq 0 23); do
    complete '{"prompt":"the lazy dog number '$((i % 3))' keeps the doctor away","max_tokens":12,"temperature":0}' > /dev/null &
  done
  wait_pids=$(jobs -p | grep -v "^$PID$")
  for p in $wait_pids; do wait "$p"; done
  sleep 0.5
  [ "$(metric laplace_state_slots_free)" = 4 ] && [ "$(metric laplace_requests_running)" = 0 ] &&
    [ "$(metric laplace_cache_device_slots_used)" -le 1 ] &&
    ok "after the burst: 4 live slots free, device tier $(metric laplace_cache_device_slots_used)/1" ||
    fail "after the burst: free $(metric laplace_state_slots_free) running $(metric laplace_requests_running)"
  curl -sf "$URL/metrics" | grep '^laplace_cache_' > "$OUT/metrics_${DEVICE}_1slot.txt"
  stop_server
else
  fail "laplace serve --device $DEVICE --cache-slots 1 did not start"
fi

echo "total $((SECONDS - t0)) s"
if [ $failures = 0 ]; then echo "DEVICE SERVE CHECK: PASS"; else echo "DEVICE SERVE CHECK: FAIL ($failures)"; exit 1; fi
