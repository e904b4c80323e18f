#!/usr/bin/env bash
# On the H200 (the `device` tool): the laplace-125m run of docs/quality.md and its PyTorch parity run.
#
#   stages (STAGES, in order): build data train ref parity twin fp8 side wait compare
#   build  CUDA build of the `laplace` program in build-gpu/ (TESTS=ON configures the tests too)
#   data   the carried corpus slice ($CORPUS/docs.carry.jsonl.xz, from scripts/corpus.sh --carry)
#          tokenized on every core into $RUNS/data/ with the carried tokenizer
#   train  the run, in the background (setsid: it outlives this call while the machine is held): steps
#          1..STOP1 (the parity point), then, once the reference is done, a resume to STEPS; then the
#          loss over the whole validation split, a sample and (QUALITY=1) the quality evaluations of
#          docs/quality.md (eval copy, passkey, position, serving; QUALITY_MODES: which) into $RUNS/quality and (HF=1) the
#          Python package's check on the trained model (scripts/device/hf_check.py). Metrics and
#          TensorBoard events in $RUNS/ours
#   ref    after the run's first 45 steps, alone on the GPU, give the throughput figure (into
#          $OUT/results.jsonl): the PyTorch reference trainer on the same init, data order and schedule
#          for REF_STEPS steps (0: none), in the background beside it, metrics in $RUNS/ref (REF_ARGS: more
#          reference_trainer.py options, e.g. --round-params bf16)
#   parity the reference alone, against the committed curve of our run (bench/curves/laplace125m_ours.jsonl;
#          the trainer is deterministic, so it need not train again): first our first CHECK_STEPS steps
#          (0: none), whose losses must equal the curve's, then the reference for REF_STEPS steps in the background
#   twin   our run again as one micro-batch of 32 (not two of 16) for TWIN_STEPS (REF_STEPS) steps, in the background
#          once the reference is done (TWIN_AFTER_REF=0: at once):
#          the same tokens, order and math, other rounding; compare measures its distance from our curve,
#          the floor that rounding alone sets under the reference's distance
#   fp8    the run again with --precision fp8 (FP8 body products; FP8_PRECISION=fp8-fast: with fast forward
#          accumulation, figures fp8fast_*; FP8_SERVING=1: then `eval serving --options
#          fp8-weights,fp8,fp8-fast,fp8-head,fp8-fast-head` on the model it trained, figures tagged
#          fp8run, log $RUNS/fp8_serving.log) for FP8_STEPS (STOP1) steps, in the
#          background once our run is done (alone on the GPU; without one, the committed curve of TAG
#          stands for it, checked as in parity); compare then gives fp8_*_laplace125m (bf16
#          run against FP8 run, the same init, data order and schedule) and the plot $OUT/fp8.png
#   compare once the reference is done: scripts/compare_runs.py against our metrics (or the curve), the
#          convergence_* figures into $OUT/results.jsonl and the plot $OUT/parity.png
#   side   (SIDE, default "tests hf3b mqar"; also "prebuild") while the two runs train (after the throughput figure), work whose timings do not matter:
#          the GPU tests (needs TESTS=ON; built at low priority), the MQAR grid of scripts/device/mqar.sh
#          and the Python package's check at the 3B shapes (2 layers); logs in $RUNS
#   wait   waits up to WAIT_S seconds (from the script's start) for both, then copies what exists to $OUT
# A later call with STAGES=wait (on the same warm machine) picks up the runs where they are.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-out}
RUNS=${RUNS:-runs}      # work dir: shards, checkpoints, logs (kept between calls while the machine is held)
CORPUS=${CORPUS:-.carry/corpus}
mkdir -p "$OUT" "$RUNS"
STAGES=${STAGES:-"build data train ref wait"}
PY=${PY:-python3}
LAPLACE=${LAPLACE:-build-gpu/laplace}
CFG=configs/laplace-125m.json
COMMIT=${COMMIT:-$(git describe --always --dirty --abbrev=7 2>/dev/null || echo unknown)}
# The run (docs/quality.md): 3,052 steps × 65,536 tokens = 200.0M tokens.
STEPS=${STEPS:-3052}
# TAG names the convergence_* figures of stage compare; a parity run with a schedule of its own
# (STEPS=STOP1=REF_STEPS=1000) records under another tag than the cut of the 200M-token run.
TAG=${TAG:-laplace125m}
STOP1=${STOP1:-1000}   # the first leg ends at the parity point; the second waits for the reference
REF_STEPS=${REF_STEPS:-1000}
# ACCUM: micro-batches of 16 per step (2: 65,536 tokens; 8: 262,144, where the per-step loss of two
# runs differs less by chance: issue 25's parity at more tokens per step); the twin runs B 32 × ACCUM/2.
ACCUM=${ACCUM:-2}
HP=(--batch 16 --seq 2048 --grad-accum "$ACCUM" --steps "$STEPS" --lr "${LR:-1.5e-3}" --warmup "${WARMUP:-150}"
    --schedule cosine --min-lr-frac 0.1 --wd 0.1 --max-grad-norm 1.0 --eval-every 250 --eval-batches 8)
# The committed curves (bench/curves/laplace125m_*) were trained as one stream per window, which is
# also the reference trainer's default: our runs here keep that (`--documents packed`).
DOCS="--documents packed"
DATA=(--data "$RUNS/data/train_*.bin" --val-data "$RUNS/data/val_*.bin")
DATA_Q="--data '$RUNS/data/train_*.bin' --val-data '$RUNS/data/val_*.bin'"  # the same, for the background shells
WAIT_S=${WAIT_S:-540}
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 ))s] $*" | tee -a "$OUT/summary.txt"; }
has() { [[ " $STAGES " == *" $1 "* ]]; }

nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv,noheader >> "$OUT/summary.txt" 2>&1

if has build; then
  cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a \
    -DLAPLACE_TESTS=${TESTS:-OFF} -DLAPLACE_BENCH=${BENCH:-OFF} > $RUNS/configure.log 2>&1 || { tail -30 $RUNS/configure.log; exit 1; }
  cmake --build build-gpu -j "$(nproc)" --target laplace > $RUNS/build.log 2>&1 ||
    { grep -E "error|FAILED" -A3 $RUNS/build.log | head -60; exit 1; }
  stamp "build ok"
fi

if has data; then
  mkdir -p $RUNS/data
  xz -dc -T0 $CORPUS/docs.carry.jsonl.xz > $RUNS/docs.jsonl || { stamp "no corpus slice"; exit 1; }
  cp $CORPUS/tokenizer.model $RUNS/tokenizer.model
  $LAPLACE data prepare --input $RUNS/docs.jsonl --tokenizer $RUNS/tokenizer.model --out $RUNS/data \
    --val-fraction 0.01 --overwrite 2>&1 | tee -a "$OUT/summary.txt" || exit 1
  stamp "data ok"
fi

if has bench; then
  # Whole steps, optimizer included, alone on the GPU. Steps 0-4 are warm-up (first-use costs).
  $PY python/laplace_ref.py init --config "$CFG" --seed 1 --out $RUNS/init.safetensors || exit 1
  for accum in ${BENCH_ACCUMS:-2}; do
    $LAPLACE train --config "$CFG" --init $RUNS/init.safetensors "${DATA[@]}" --out "$RUNS/bench_a$accum" \
      --device cuda --dtype bf16 --batch 16 --seq 2048 --grad-accum $accum --steps ${BENCH_STEPS:-40} --lr 1.5e-3 --warmup 10 \
      --wd 0.1 --no-shuffle --peak-tflops 989 --log-every 20 > "$RUNS/bench_a$accum.log" 2>&1 ||
      { tail -20 "$RUNS/bench_a$accum.log"; exit 1; }
    $PY - "$accum" "$COMMIT" "$RUNS" >> "$OUT/results.jsonl" <<'EOF'
import json, statistics, sys, time
accum, commit, runs = int(sys.argv[1]), sys.argv[2], sys.argv[3]
rows = [json.loads(l) for l in open("%s/bench_a%d/metrics.jsonl" % (runs, accum)) if '"loss"' in l][5:]
tps = statistics.median(r["tokens_per_s"] for r in rows)
mfu = statistics.median(r["mfu"] for r in rows)
tag = "laplace125m_t2048" + ("" if accum == 2 else "_b16_accum1")
date = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
note = "whole steps incl. optimizer, B=16 x T=2048 x accum %d (%d tokens/step), bf16, median of steps 5-%d" % (
    accum, 32768 * accum, len(rows) + 4)
cmd = "scripts/device/train125m.sh (stage bench)"
for name, v, unit in (("train_tok_s_" + tag, tps, "tokens/s"), ("train_mfu_" + tag, mfu, "fraction of 989 TFLOP/s")):
    print(json.dumps({"bench": name, "value": round(v, 4 if unit != "tokens/s" else 0), "unit": unit,
                      "device": "NVIDIA H200", "commit": commit, "date": date, "note": note, "command": cmd}))
EOF
    stamp "bench accum $accum: $(tail -1 "$OUT/results.jsonl")"
  done
fi

if has train; then
  [ -f $RUNS/init.safetensors ] || $PY python/laplace_ref.py init --config "$CFG" --seed 1 --out $RUNS/init.safetensors
  rm -rf $RUNS/ours
  setsid nohup bash -c "
    $LAPLACE train --config $CFG --init $RUNS/init.safetensors $DATA_Q --tokenizer $RUNS/tokenizer.model \
      --out $RUNS/ours --device cuda --dtype bf16 ${HP[*]} $DOCS --no-shuffle --peak-tflops 989 --log-every 50 \
      --stop-after $STOP1 --tensorboard $RUNS/ours/tb &&
    { [ $STOP1 -ge $STEPS ] || {
    while [ ${WAIT_REF:-1} = 1 ] && [ ! -f $RUNS/ref.done ]; do sleep 5; done &&
    $LAPLACE train --config $CFG --init $RUNS/init.safetensors $DATA_Q --tokenizer $RUNS/tokenizer.model \
      --out $RUNS/ours --device cuda --dtype bf16 ${HP[*]} $DOCS --no-shuffle --peak-tflops 989 --log-every 50 \
      --ckpt-every 1000 --resume auto --tensorboard $RUNS/ours/tb; }; } &&
    $LAPLACE eval --model $RUNS/ours --data '$RUNS/data/val_*.bin' --batch 16 --seq 2048 --device cuda \
      --dtype bf16 > $RUNS/ours_eval.log 2>&1 &&
    $LAPLACE generate --model $RUNS/ours --prompt 'static int' --max-tokens 120 --temperature 0.7 --top-k 40 \
      --seed 1 --device cuda --dtype bf16 > $RUNS/ours_sample.log 2>&1
    rc=\$?
    if [ \$rc = 0 ] && [ ${QUALITY:-1} = 1 ]; then
      export LAPLACE_COMMIT=$COMMIT
      Q=\"--model $RUNS/ours --data '$RUNS/data/val_*.bin' --device cuda --out $RUNS/quality --results $RUNS/quality_results.jsonl\"
      for mode in 'copy --dtype bf16 --trials 64 --batch 16' 'passkey --dtype bf16 --trials 16 --batch 4' \
          'position --dtype bf16 --context 131072 --streams 7' \
          'serving --dtype f32 --options defer4,defer8,defer16,bf16-weights,bf16-states,fp8-weights,fp8,fp8-fast --prompts 64 --prompt-len 128 --steps 256'; do
        [[ \" ${QUALITY_MODES:-copy passkey position serving} \" == *\" \${mode%% *} \"* ]] || continue
        eval $LAPLACE eval \$mode \$Q; echo \"eval \${mode%% *} exit \$?\"
      done
      # The validation loss again with the body products in FP8 (--weights fp8), against ours_eval.log.
      $LAPLACE eval --model $RUNS/ours --data '$RUNS/data/val_*.bin' --batch 16 --seq 2048 --device cuda \
        --dtype bf16 --weights fp8 > $RUNS/ours_eval_fp8.log 2>&1; echo \"eval --weights fp8 exit \$?\"
    fi > $RUNS/quality.log 2>&1
    if [ \$rc = 0 ] && [ ${HF:-1} = 1 ]; then
      $PY scripts/device/hf_check.py --laplace $LAPLACE --model $RUNS/ours --out $RUNS/hf_125m.jsonl
    fi > $RUNS/hf_125m.log 2>&1
    echo exit \$rc > $RUNS/ours.done" > $RUNS/ours.log 2>&1 < /dev/null &
  stamp "train started"
fi

if has ref; then
  # The first 45 steps of the run alone on the GPU give the throughput figure (steps 5-44, whole
  # steps at the run's shape); the reference starts after them.
  for _ in $(seq 120); do
    [ "$(grep -c '"loss"' $RUNS/ours/metrics.jsonl 2>/dev/null)" -ge 45 ] 2>/dev/null && break
    [ -f $RUNS/ours.done ] && break
    sleep 1
  done
  $PY - "$COMMIT" "$RUNS" >> "$OUT/results.jsonl" <<'EOF'
import json, statistics, sys, time
commit, runs = sys.argv[1], sys.argv[2]
rows = [json.loads(l) for l in open("%s/ours/metrics.jsonl" % runs) if '"loss"' in l][5:45]
date = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
note = ("whole steps incl. optimizer, B=16 x T=2048 x accum 2 (65536 tokens/step), bf16, laplace-125m, median of "
        "steps 5-%d of the corpus run, alone on the GPU" % (len(rows) + 4))
cmd = "scripts/device/train125m.sh (train stage, before the reference starts)"
for name, key, unit in (("train_tok_s_laplace125m_t2048", "tokens_per_s", "tokens/s"),
                        ("train_mfu_laplace125m_t2048", "mfu", "fraction of 989 TFLOP/s")):
    v = statistics.median(r[key] for r in rows)
    print(json.dumps({"bench": name, "value": round(v, 4 if key == "mfu" else 0), "unit": unit,
                      "device": "NVIDIA H200", "commit": commit, "date": date, "note": note, "command": cmd}))
EOF
  stamp "throughput: $(tail -2 "$OUT/results.jsonl" | head -1)"
  rm -rf $RUNS/ref
  [ "$REF_STEPS" -gt 0 ] || echo "exit 0 (REF_STEPS=0: no reference run)" > $RUNS/ref.done
  [ "$REF_STEPS" -gt 0 ] && setsid nohup bash -c "
    PYTHONUNBUFFERED=1 $PY python/reference_trainer.py --config $CFG --init $RUNS/init.safetensors $DATA_Q \
      --out $RUNS/ref ${HP[*]} --stop-after $REF_STEPS --amp bf16 --ns-mode bf16 --log-every 50 ${REF_ARGS:-}
    echo exit \$? > $RUNS/ref.done" > $RUNS/ref.log 2>&1 < /dev/null &
  stamp "reference started ($REF_STEPS steps)"
fi

# Our first CHECK_STEPS (50; 0: none) steps again, against a committed curve ($1): the trainer is
# deterministic, so equal losses say the curve is this build's run and need not be trained again.
check_curve() {
  CHECK_STEPS=${CHECK_STEPS:-50}
  rm -rf $RUNS/ours_check
  [ "$CHECK_STEPS" -gt 0 ] && $LAPLACE train --config $CFG --init $RUNS/init.safetensors "${DATA[@]}" \
    --out $RUNS/ours_check --device cuda --dtype bf16 "${HP[@]}" $DOCS --no-shuffle --stop-after "$CHECK_STEPS" --quiet \
    > $RUNS/ours_check.log 2>&1 &&
  $PY - $RUNS/ours_check/metrics.jsonl "$1" <<'EOF' 2>&1 | tee -a "$OUT/summary.txt"
import json, sys
def losses(path):
    return {r["step"]: r["loss"] for r in map(json.loads, open(path)) if "loss" in r}
now, curve = losses(sys.argv[1]), losses(sys.argv[2])
same = [s for s in sorted(now) if round(now[s], 6) == curve.get(s)]
print("parity: %d of %d steps of this build equal the committed curve %s%s" % (
    len(same), len(now), sys.argv[2], "" if len(same) == len(now) else " (the curve is not this trainer's: compare with a new run)"))
EOF
}

# The device tool returns at most 8 files: the figures and the summary as they are, the rest in one archive.
if has parity; then
  [ -f $RUNS/init.safetensors ] || $PY python/laplace_ref.py init --config "$CFG" --seed 1 --out $RUNS/init.safetensors
  rm -rf $RUNS/ours_check $RUNS/ref $RUNS/ref.done
  check_curve bench/curves/laplace125m_ours.jsonl
  setsid nohup bash -c "
    PYTHONUNBUFFERED=1 $PY python/reference_trainer.py --config $CFG --init $RUNS/init.safetensors $DATA_Q \
      --out $RUNS/ref ${HP[*]} --stop-after $REF_STEPS --amp bf16 --ns-mode bf16 --log-every 50 ${REF_ARGS:-}
    echo exit \$? > $RUNS/ref.done" > $RUNS/ref.log 2>&1 < /dev/null &
  echo "exit 0 (parity: our curve is committed)" > $RUNS/ours.done
  stamp "reference started alone ($REF_STEPS steps)"
fi

if has twin; then
  # Our run again with one micro-batch of 32 instead of two of 16: the same tokens, data order and
  # arithmetic, other rounding (the gemms sum 32 rows at once, the gradient is not accumulated).
  # Its distance from our committed curve is what rounding alone does to a bf16 run: the floor
  # against which the reference's distance reads.
  [ -f $RUNS/init.safetensors ] || $PY python/laplace_ref.py init --config "$CFG" --seed 1 --out $RUNS/init.safetensors
  rm -rf $RUNS/twin $RUNS/twin.done
  HP_TWIN=$(echo "${HP[*]}" | sed "s/--batch 16/--batch 32/; s/--grad-accum $ACCUM/--grad-accum $((ACCUM / 2))/; s/--eval-batches 8/--eval-batches 4/")
  setsid nohup bash -c "
    while [ ${TWIN_AFTER_REF:-1} = 1 ] && [ ! -f $RUNS/ref.done ]; do sleep 2; done
    $LAPLACE train --config $CFG --init $RUNS/init.safetensors $DATA_Q --out $RUNS/twin --device cuda --dtype bf16 \
      $HP_TWIN $DOCS --no-shuffle --stop-after ${TWIN_STEPS:-$REF_STEPS} --log-every 50
    echo exit \$? > $RUNS/twin.done" > $RUNS/twin.log 2>&1 < /dev/null &
  stamp "twin started (${TWIN_STEPS:-$REF_STEPS} steps, batch 32 x accum 1)"
fi

if has fp8; then
  [ -f $RUNS/init.safetensors ] || $PY python/laplace_ref.py init --config "$CFG" --seed 1 --out $RUNS/init.safetensors
  rm -rf $RUNS/fp8 $RUNS/fp8.done
  # Without our run here, the committed curve of TAG stands for it once this build's first steps equal it.
  [ -f $RUNS/ours.log ] || check_curve bench/curves/${TAG}_ours.jsonl
  setsid nohup bash -c "
    while [ -f $RUNS/ours.log ] && [ ! -f $RUNS/ours.done ]; do sleep 2; done
    $LAPLACE train --config $CFG --init $RUNS/init.safetensors $DATA_Q --out $RUNS/fp8 --device cuda --dtype bf16 \
      ${HP[*]} $DOCS --no-shuffle --peak-tflops 989 --log-every 50 --stop-after ${FP8_STEPS:-$STOP1} --precision ${FP8_PRECISION:-fp8}
    rc=\$?
    if [ \$rc = 0 ] && [ ${FP8_SERVING:-0} = 1 ]; then
      LAPLACE_COMMIT=$COMMIT $LAPLACE eval serving --model $RUNS/fp8 --data '$RUNS/data/val_*.bin' --device cuda \
        --dtype f32 --options fp8-weights,fp8,fp8-fast,fp8-head,fp8-fast-head --prompts 64 --prompt-len 128 --steps 256 --tag fp8run \
        --out $RUNS/fp8_quality --results $RUNS/fp8_quality_results.jsonl > $RUNS/fp8_serving.log 2>&1
      echo \"eval serving exit \$?\" >> $RUNS/fp8_serving.log
    fi
    echo exit \$rc > $RUNS/fp8.done" > $RUNS/fp8.log 2>&1 < /dev/null &
  stamp "fp8 run started (${FP8_STEPS:-$STOP1} steps, after our run)"
fi

if has side; then
  # Each step is cut at SIDE_S seconds from the script's start, so that the call ends with its files.
  left() { echo $(( ${SIDE_S:-540} - ($(date +%s) - t0) )); }
  if [[ " ${SIDE:-tests hf3b mqar} " == *" prebuild "* ]]; then
    # Builds PREBUILD's targets for a later call (scripts/device/decode.sh BUILD=0) at the lowest
    # priority, in the background, so that it neither waits for nor slows the runs much.
    setsid nohup nice -n 19 cmake --build build-gpu -j 12 --target ${PREBUILD:-laplace_tests} \
      > $RUNS/prebuild.log 2>&1 < /dev/null &
    stamp "prebuild of ${PREBUILD:-laplace_tests} started"
  fi
  if [[ " ${SIDE:-tests hf3b mqar} " == *" tests "* ]]; then
    nice -n 10 timeout "$(left)" cmake --build build-gpu -j "$(nproc)" --target laplace_tests > $RUNS/tests_build.log 2>&1
    stamp "tests build exit $?"
    # One process per suite, so that a test that aborts hides no other suite's results.
    for suite in CudaOps CudaOpsFast CudaModel CudaTrain CudaModelTrain BackendOps DistNccl; do
      timeout "$(left)" ./build-gpu/tests/laplace_tests --gtest_filter="$suite.*" >> $RUNS/gpu_tests.log 2>&1
      stamp "gpu tests $suite exit $?: $(grep -E '^\[  (PASSED|FAILED)  \]' $RUNS/gpu_tests.log | tail -1)"
    done
  fi
  if [[ " ${SIDE:-tests hf3b mqar} " == *" hf3b "* ]]; then
    timeout "$(left)" $PY scripts/device/hf_check.py --laplace $LAPLACE --init-3b-layers 2 --model $RUNS/l3b2 --no-cpu \
      --out $RUNS/hf_3b2.jsonl > $RUNS/hf_3b2.log 2>&1
    stamp "hf 3b-2-layer check exit $?"
  fi
  if [[ " ${SIDE:-tests hf3b mqar} " == *" mqar "* ]]; then
    NO_BUILD=1 OUT=$RUNS/mqar timeout "$(left)" bash scripts/device/mqar.sh > $RUNS/mqar.log 2>&1
    stamp "mqar exit $?"
  fi
fi

collect() {
  cp $RUNS/ours/metrics.jsonl $RUNS/ours_metrics.jsonl 2>/dev/null
  cp $RUNS/ref/metrics.jsonl $RUNS/ref_metrics.jsonl 2>/dev/null
  cp $RUNS/twin/metrics.jsonl $RUNS/twin_metrics.jsonl 2>/dev/null
  cp $RUNS/fp8/metrics.jsonl $RUNS/fp8_metrics.jsonl 2>/dev/null
  cat $RUNS/quality_results.jsonl $RUNS/fp8_quality_results.jsonl $RUNS/hf_*.jsonl $RUNS/mqar/results.jsonl \
    > "$OUT/figures.jsonl" 2>/dev/null
  # (not $RUNS/*.jsonl: the decompressed corpus, docs.jsonl, is there too)
  tar czf "$OUT/runs.tar.gz" $RUNS/*.log $RUNS/*.done $RUNS/ours_metrics.jsonl $RUNS/ref_metrics.jsonl $RUNS/twin_metrics.jsonl \
    $RUNS/fp8_metrics.jsonl $RUNS/quality_results.jsonl $RUNS/fp8_quality_results.jsonl $RUNS/fp8_quality \
    $RUNS/hf_*.jsonl $RUNS/ours/tb $RUNS/quality $RUNS/mqar $RUNS/data/prepare.json \
    $RUNS/bench_a*/metrics.jsonl 2>/dev/null
  cp $RUNS/gpu_tests.log "$OUT/" 2>/dev/null
}

if has wait; then
  # A machine that went back between calls comes back bare: then there is nothing to wait for.
  if [ ! -f $RUNS/ours.log ] && [ ! -f $RUNS/ref.log ] && [ ! -f $RUNS/twin.log ] && [ ! -f $RUNS/fp8.log ]; then
    stamp "no runs here: this is a fresh machine (the last one went back between calls); start them again"
    WAIT_S=0
  fi
  while (( $(date +%s) - t0 < WAIT_S )); do
    [ -f $RUNS/ours.done ] && [ -f $RUNS/ref.done ] && { [ ! -f $RUNS/twin.log ] || [ -f $RUNS/twin.done ]; } &&
      { [ ! -f $RUNS/fp8.log ] || [ -f $RUNS/fp8.done ]; } && break
    sleep 10
  done
  stamp "ours: $(grep -E '^step' $RUNS/ours.log 2>/dev/null | tail -1) $(cat $RUNS/ours.done 2>/dev/null)"
  stamp "ref:  $(grep -E '^step' $RUNS/ref.log 2>/dev/null | tail -1) $(cat $RUNS/ref.done 2>/dev/null)"
  [ -f $RUNS/fp8.log ] && stamp "fp8:  $(grep -E '^step' $RUNS/fp8.log 2>/dev/null | tail -1) $(cat $RUNS/fp8.done 2>/dev/null)"
  [ -f $RUNS/twin.log ] && stamp "twin: $(grep -E '^step' $RUNS/twin.log 2>/dev/null | tail -1) $(cat $RUNS/twin.done 2>/dev/null)"
  if [ -f $RUNS/ours.done ] && [ -d $RUNS/ours/tb ]; then
    $PY scripts/check_tensorboard.py $RUNS/ours/tb >> "$OUT/summary.txt" 2>&1; stamp "tensorboard check exit $?"
  fi
fi
if has compare && [ -f $RUNS/twin.done ]; then
  OURS=$RUNS/ours/metrics.jsonl
  [ -f "$OURS" ] || OURS=bench/curves/laplace125m_ours.jsonl
  $PY scripts/compare_runs.py "$OURS" $RUNS/twin/metrics.jsonl --last 200 \
    --tag ${TAG}_twin --results "$OUT/results.jsonl" --commit "$COMMIT" --device "NVIDIA H200" \
    --command "scripts/device/train125m.sh (stages twin, compare)" --labels "laplace B16x2,laplace B32x1" \
    --plot "$OUT/twin.png" 2>&1 | tail -3 | tee -a "$OUT/summary.txt"
fi

if has compare && [ -f $RUNS/fp8.done ]; then
  OURS=$RUNS/ours/metrics.jsonl
  [ -f "$OURS" ] || OURS=bench/curves/${TAG}_ours.jsonl
  $PY scripts/compare_runs.py "$OURS" $RUNS/fp8/metrics.jsonl --last 200 --prefix "$(echo ${FP8_PRECISION:-fp8} | tr -d -)" --tag laplace125m \
    --results "$OUT/results.jsonl" --commit "$COMMIT" --device "NVIDIA H200" \
    --command "scripts/device/train125m.sh (stages train fp8 compare)" --labels "bf16,${FP8_PRECISION:-fp8}" \
    --plot "$OUT/fp8.png" 2>&1 | tee -a "$OUT/summary.txt"
fi

if has compare && [ -f $RUNS/ref.done ]; then
  OURS=$RUNS/ours/metrics.jsonl
  [ -f "$OURS" ] || OURS=bench/curves/laplace125m_ours.jsonl
  $PY scripts/compare_runs.py "$OURS" $RUNS/ref/metrics.jsonl --last 200 --tag $TAG \
    --results "$OUT/results.jsonl" --commit "$COMMIT" --device "NVIDIA H200" \
    --command "scripts/device/train125m.sh (stage compare)" --plot "$OUT/parity.png" 2>&1 | tee -a "$OUT/summary.txt"
fi

collect
tail -5 $RUNS/ours.log 2>/dev/null
tail -3 $RUNS/ref.log 2>/dev/null
