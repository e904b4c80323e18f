#!/usr/bin/env bash
# On the H200 (the `device` tool): long context (docs/quality.md "Long context", BENCHMARKS.md).
#
#   stages (STAGES, in order):
#   build  CUDA build (sm_90a) of laplace, the tests, bench_train and the CUPTI tracer in build-gpu/
#   tests  the GPU tests of documents kept apart and of the GLA and conv ops (FILTER), log in $OUT
#   sweep  whole training steps against T (bench_train, random tokens, one stream and documents kept
#          apart): laplace-125m at 2k/8k/32k/64k with B·T = 32,768 (65,536 at 64k); figures into $OUT/results.jsonl
#   sweep3b the same for laplace-3b at 2k (B 4), 8k and 32k (B 1; the plan recomputes what does not fit),
#          65,536 tokens a step at each T
#   trace  a CUPTI kernel trace of two 125M steps at T = 2,048 (B 16) and T = 32,768 (B 1): GPU time per
#          kernel name per step, side by side ($OUT/trace_125m.txt)
#   peer   ../shared/peers/tsweep_peer.py (carried as .carry/tsweep_peer.py: PyTorch + flash-linear-attention, and
#          softmax attention) at 2k/8k/32k, in the same call: needs FLA's `fla` package carried in .carry/fla
#   quality the long-context comparison at a small size (docs/quality.md "Long context"): the carried slice of the
#          long-document corpus (.carry/longctx: train.jsonl.xz, val_long.jsonl.xz, tokenizer.model; made by
#          scripts/corpus.sh --long) tokenized here; a 6-layer D512 model with the default decays and one with
#          decay_exponents [5, 10, 15, 20], each trained at T = 2,048 and at T = 32,768 on the same tokens in the same
#          order (documents kept apart), then `eval position --documents` on the held-out documents of at least
#          32,768 tokens, each from a zero state; figures longdoc_* into $OUT/results.jsonl
#   pair   the two laplace-125m runs of the comparison (PAIR_T: "32768 2048", or one of them): configs/laplace-125m-long.json
#          (its four heads' memories spread over 32 ... 2^20 tokens), PAIR_STEPS steps of 65,536 tokens (3,052: 200.0M)
#          on the carried slice in order, documents kept apart; then eval position --documents on the held-out long
#          documents and, at PAIR_T = 32768, passkey and copy. Checkpointed every PAIR_CKPT steps: a call that stops
#          training at PAIR_TRAIN_S seconds, or at DEADLINE less PAIR_RESERVE, is continued by the next call on
#          the same machine; a finished run is evaluated once. With both evaluated, the gain and the slope.
#
# Prebuilt binaries: with .carry/bin.tar.xz (laplace, bench_train, laplace_tests, libcupti_trace.so and the
# libraries they need that the machine lacks; scripts/device/pack.sh makes it here) the stage build is skipped.
# A call that carries the corpus has no room for all of them: BINS=laplace pack.sh makes bin.tar.xz, and
# PACK_AS=bin-tests BINS="laplace_tests bench_train cupti_trace" pack.sh the rest, for a later call.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-out}
mkdir -p "$OUT"
STAGES=${STAGES:-"build tests sweep trace peer"}
LC=${LC:-runs/longctx}       # the quality stage's data and runs (kept while the machine is held)
COMMIT=${COMMIT:-$(git describe --always --dirty --abbrev=7 2>/dev/null || echo unknown)}
B=build-gpu
RES="$OUT/results.jsonl"
has() { [[ " $STAGES " == *" $1 "* ]]; }
T_START=$(date +%s)
time_left() { echo $(( ${DEADLINE:-100000} - ($(date +%s) - T_START) )); }  # DEADLINE: seconds this call may run
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/gpu.txt" 2>&1

for tarball in .carry/bin.tar.xz .carry/bin-tests.tar.xz; do  # what pack.sh made, in one or two parts
  [ -f $tarball ] || continue
  mkdir -p $B/bench $B/tests $B/experiments $B/lib && tar -xJf $tarball -C $B/lib
  for f in laplace:. bench_train:bench laplace_tests:tests libcupti_trace.so:experiments; do
    [ -f $B/lib/${f%%:*} ] && mv $B/lib/${f%%:*} $B/${f##*:}/
  done
  echo "prebuilt binaries from $tarball"
done
export LD_LIBRARY_PATH=$PWD/$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
[ -x $B/laplace ] && STAGES=${STAGES/build/}

if has build; then
  t0=$(date +%s)
  cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a -DLAPLACE_EXPERIMENTS=ON \
    > "$OUT/configure.log" 2>&1 || { tail -30 "$OUT/configure.log"; exit 1; }
  cmake --build $B -j "$(nproc)" --target laplace laplace_tests bench_train ${TRACE_TARGET:-cupti_trace} \
    > "$OUT/build.log" 2>&1 || { grep -E "error|FAILED" -A3 "$OUT/build.log" | head -60; exit 1; }
  echo "build ok in $(( $(date +%s) - t0 )) s"
fi

if has tests; then
  FILTER=${FILTER:-"CudaVarlen*:BackendOps*:CudaOps.Gla*:CudaOps.Conv*:GlaDocuments*:ModelDocuments*:CudaModel*"}
  timeout ${TEST_S:-240} $B/tests/laplace_tests --gtest_filter="$FILTER" > "$OUT/gpu_tests.log" 2>&1
  echo "gpu tests exit $?"
  grep -E "^\[  (FAILED|PASSED) |Failure|error:|tests? ran" "$OUT/gpu_tests.log" | head -60
fi

train_bench() {  # tag config seq batch accum [extra...]
  local tag=$1 cfg=$2 seq=$3 batch=$4 accum=$5; shift 5
  timeout ${BENCH_S:-150} $B/bench/bench_train --config "$cfg" --tag "$tag" --seq "$seq" --batch "$batch" --accum "$accum" \
    --steps ${STEPS:-3} --warmup 1 --results "$RES" --commit "$COMMIT" "$@" > "$OUT/train_${tag}_t${seq}$*.log" 2>&1
  echo "$tag T=$seq B=$batch $*: $(grep -E '^result' "$OUT/train_${tag}_t${seq}$*.log" || tail -2 "$OUT/train_${tag}_t${seq}$*.log")"
}
if has sweep; then
  for st in "2048 16" "8192 4" "32768 1" "65536 1"; do
    set -- $st; train_bench laplace125m configs/laplace-125m.json $1 $2 2
  done
  for st in "2048 16" "32768 1"; do
    set -- $st; train_bench laplace125m configs/laplace-125m.json $1 $2 2 --doc-len 2048
  done
fi
if has sweep3b; then
  # 65,536 tokens a step at every T (the optimizer step, about 0.4 s at 3B, weighs the same): B 4 × 8
  # micro-batches at 2k, 1 × 8 at 8k, 1 × 2 at 32k (B·T = 32,768 does not fit at 2k without recompute).
  for st in "2048 4 8" "8192 1 8" "32768 1 2"; do
    set -- $st; train_bench laplace3b configs/laplace-3b.json $1 $2 $3
  done
fi

if has trace; then
  for st in "2048 16" "32768 1"; do
    set -- $st
    CUDA_INJECTION64_PATH=$B/experiments/libcupti_trace.so CUPTI_TRACE_OUT="$OUT/trace_t$1.csv" \
      timeout 120 $B/bench/bench_train --config configs/laplace-125m.json --tag trace --seq $1 --batch $2 --accum 1 \
      --steps 2 --warmup 1 --results /dev/null > "$OUT/trace_t$1.log" 2>&1
  done
  python3 - "$OUT/trace_t2048.csv" "$OUT/trace_t32768.csv" > "$OUT/trace_125m.txt" 2>&1 <<'PY'
import csv, collections, sys
def load(p):
    with open(p) as f:
        r = csv.reader(f); h = next(r)
        ci = lambda pre: next(i for i, x in enumerate(h) if x.startswith(pre))
        d, n = ci("Duration"), ci("Name")
        acc = collections.Counter()
        for row in r: acc[row[n][:70]] += float(row[d]) / 1e6
    return acc
a, b = load(sys.argv[1]), load(sys.argv[2])
ta, tb = sum(a.values()), sum(b.values())
print("GPU ms over the traced run (3 steps + the phase micro-batch; same tokens per micro-batch)")
print("%-70s %10s %10s %8s" % ("kernel", "T=2048", "T=32768", "ratio"))
for k in sorted(set(a) | set(b), key=lambda k: -(b[k] - a[k])):
    print("%-70s %10.2f %10.2f %8.2f" % (k, a[k], b[k], b[k] / a[k] if a[k] else float("inf")))
print("%-70s %10.2f %10.2f %8.2f" % ("total", ta, tb, tb / ta))
PY
  head -25 "$OUT/trace_125m.txt"
  rm -f "$OUT"/trace_t*.csv
fi

if has peer; then
  PYTHONUNBUFFERED=1 timeout ${PEER_S:-300} python3 .carry/tsweep_peer.py --fla .carry/fla 2>&1 \
    | tee "$OUT/peer.log" | grep '^{' || tail -5 "$OUT/peer.log"
fi

LCD=${LC_CARRY:-.carry/longctx}   # the carried slice (a smaller one where a call carries more binaries)
TOK=$LCD/tokenizer.model
prepare_longctx() {  # the carried slice and the held-out long documents, tokenized once per machine
  mkdir -p "$LC"
  if [ ! -f "$LC/data/train_000000.bin" ]; then
    t0=$(date +%s)
    xz -T0 -dc $LCD/train.jsonl.xz > "$LC/train.jsonl" && xz -dc $LCD/val_long.jsonl.xz > "$LC/val_long.jsonl"
    $B/laplace data prepare --input "$LC/train.jsonl" --tokenizer $TOK --out "$LC/data" --val-fraction 0 --overwrite \
      > "$OUT/prepare_train.log" 2>&1 || { tail -5 "$OUT/prepare_train.log"; exit 1; }
    $B/laplace data prepare --input "$LC/val_long.jsonl" --tokenizer $TOK --out "$LC/test" --val-fraction 0 --overwrite \
      > "$OUT/prepare_test.log" 2>&1 || { tail -5 "$OUT/prepare_test.log"; exit 1; }
    echo "data in $(( $(date +%s) - t0 )) s: $(tail -1 "$OUT/prepare_train.log")"
  fi
}

if has pair; then
  prepare_longctx || exit 1
  for T in ${PAIR_T:-32768}; do
    run="$LC/laplace125m_t$T"
    # Resumable: a checkpoint every PAIR_CKPT steps, so a call that runs out of time (PAIR_TRAIN_S, or
    # DEADLINE less PAIR_RESERVE) loses at most that much and the next call on the same
    # machine goes on from it (resume is bitwise).
    if [ ! -f "$run/done" ]; then
      left=$(( $(time_left) - ${PAIR_RESERVE:-0} ))
      limit=${PAIR_TRAIN_S:-520}; [ $left -lt $limit ] && limit=$left
      [ $limit -lt 30 ] && { echo "laplace125m T=$T: no time left to train"; break; }
      t0=$(date +%s)
      timeout $limit $B/laplace train --config configs/laplace-125m-long.json --data "$LC/data/train_*.bin" \
        --tokenizer $TOK --out "$run" --device cuda --dtype bf16 --batch $(( 32768 / T )) --seq $T --grad-accum 2 \
        --steps ${PAIR_STEPS:-3052} --lr 1.5e-3 --warmup 150 --schedule cosine --min-lr-frac 0.1 --wd 0.1 \
        --max-grad-norm 1.0 --no-shuffle --documents separate --log-every 100 --ckpt-every ${PAIR_CKPT:-250} \
        --resume auto >> "$OUT/train_laplace125m_t$T.log" 2>&1
      rc=$?
      [ $rc = 0 ] && touch "$run/done"
      echo "laplace125m T=$T: exit $rc in $(( $(date +%s) - t0 )) s; $(grep -E '^step' "$OUT/train_laplace125m_t$T.log" | tail -1)"
      cp "$run/metrics.jsonl" "$OUT/metrics_laplace125m_t$T.jsonl" 2>/dev/null
    fi
    [ -f "$run/done" ] && [ ! -f "$run/eval/longdoc.jsonl" ] || continue
    need=$(( ${EVAL_S:-90} + ( T == 32768 ? 2 * ${PROBE_S:-45} : 0 ) ))
    [ $(time_left) -ge $need ] || { echo "laplace125m T=$T: trained; no time left to evaluate it"; break; }
    timeout ${EVAL_S:-90} $B/laplace eval position --model "$run" --data "$LC/test/train_*.bin" --documents \
      --min-doc-tokens 32768 --context 131072 --device cuda --dtype bf16 --out "$run/eval" \
      --results "$RES" --tag "laplace125m_t$T" > "$OUT/eval_laplace125m_t$T.log" 2>&1
    tail -14 "$OUT/eval_laplace125m_t$T.log"
    cp "$run/eval/longdoc.jsonl" "$OUT/longdoc_laplace125m_t$T.jsonl" 2>/dev/null
    if [ "$T" = 32768 ]; then
      timeout ${PROBE_S:-45} $B/laplace eval passkey --model "$run" --data "$LC/test/train_*.bin" --device cuda \
        --dtype bf16 --contexts 1024,4096,16384,32768 --depths 0,0.5,1 --trials 16 --batch 16 --out "$run/eval" \
        --results "$RES" --tag "laplace125m_t$T" > "$OUT/passkey_laplace125m_t$T.log" 2>&1
      tail -14 "$OUT/passkey_laplace125m_t$T.log"
      timeout ${PROBE_S:-45} $B/laplace eval copy --model "$run" --data "$LC/test/train_*.bin" --device cuda \
        --dtype bf16 --m 16,64 --d 0,1024,4096,16384 --trials 16 --batch 16 --out "$run/eval" --results "$RES" \
        --tag "laplace125m_t$T" > "$OUT/copy_laplace125m_t$T.log" 2>&1
      tail -12 "$OUT/copy_laplace125m_t$T.log"
      cp "$run"/eval/{passkey,copy}.jsonl "$OUT/" 2>/dev/null
    fi
  done
  a="$LC/laplace125m_t2048/eval/longdoc.jsonl" b="$LC/laplace125m_t32768/eval/longdoc.jsonl"
  if [ -f "$a" ] && [ -f "$b" ] && [ ! -f "$LC/pair_figures.jsonl" ]; then  # once, not again in later calls
    python3 scripts/longdoc_figures.py "$a" "$b" --model laplace125m --commit "$COMMIT" \
      --device "$(cut -d, -f1 "$OUT/gpu.txt")" --command "STAGES=pair scripts/device/long_context.sh" \
      > "$LC/pair_figures.tmp" && mv "$LC/pair_figures.tmp" "$LC/pair_figures.jsonl" && tee -a "$RES" < "$LC/pair_figures.jsonl"
  fi
fi

if has quality; then
  prepare_longctx || exit 1
  SMALL='"model_type": "laplace", "vocab_size": 32768, "hidden_size": 512, "num_layers": 6, "num_heads": 4,
         "head_k_dim": 96, "head_v_dim": 192, "ffn_size": 1536, "conv_size": 4, "chunk_size": 128'
  echo "{$SMALL}" > "$LC/small.json"
  echo "{$SMALL, \"decay_exponents\": [5, 10, 15, 20]}" > "$LC/spread.json"
  TOKENS=${LC_TOKENS:-60000000}                 # per run; 65,536 per step (B·T = 32,768, accumulation 2)
  LC_STEPS=$(( TOKENS / 65536 ))
  for model in ${LC_MODELS:-spread small}; do
    for T in 2048 32768; do
      run="$LC/${model}_t$T"
      if [ ! -f "$run/model.safetensors" ]; then
        t0=$(date +%s)
        $B/laplace train --config "$LC/$model.json" --data "$LC/data/train_*.bin" --tokenizer $TOK --out "$run" \
          --device cuda --dtype bf16 --batch $(( 32768 / T )) --seq $T --grad-accum 2 --steps $LC_STEPS \
          --lr ${LC_LR:-2e-3} --warmup $(( LC_STEPS / 20 )) --wd 0.1 --no-shuffle --documents separate --log-every 100 \
          > "$OUT/train_${model}_t$T.log" 2>&1 || { tail -5 "$OUT/train_${model}_t$T.log"; continue; }
        echo "$model T=$T: $LC_STEPS steps in $(( $(date +%s) - t0 )) s; $(grep -E '^step' "$OUT/train_${model}_t$T.log" | tail -1)"
      fi
      timeout ${EVAL_S:-240} $B/laplace eval position --model "$run" --data "$LC/test/train_*.bin" --documents \
        --min-doc-tokens 32768 --context ${LC_CONTEXT:-131072} --device cuda --dtype bf16 --out "$run/eval" \
        --results "$RES" --tag "${model}_t$T" > "$OUT/eval_${model}_t$T.log" 2>&1
      tail -14 "$OUT/eval_${model}_t$T.log"
      cp "$run/metrics.jsonl" "$OUT/metrics_${model}_t$T.jsonl" 2>/dev/null
      cp "$run/eval/longdoc.jsonl" "$OUT/longdoc_${model}_t$T.jsonl" 2>/dev/null
    done
    # The headline figures: the long-trained model's gain over positions 8k-32k, and its slope.
    python3 scripts/longdoc_figures.py "$OUT/longdoc_${model}_t2048.jsonl" "$OUT/longdoc_${model}_t32768.jsonl" \
      --model "$model" --commit "$COMMIT" --device "$(cut -d, -f1 "$OUT/gpu.txt")" \
      --command "STAGES=quality scripts/device/long_context.sh" >> "$RES"
    tail -2 "$RES"
  done
fi
