#!/usr/bin/env bash
# On the H200: build, run the engine's GPU tests, then the serving benchmarks of laplace-3b
# (random bf16 weights); logs and JSON lines under $OUT. Stages run in the order given:
#   STAGES="tests decode eager bf16 defer prefill sweep prompt poisson burst pgraphs rates ops train train125 lab declab overlap deferred cores ncu trace ptrace algo fp8serve fp8train fp8 fp8q dstream wgmma parity" COMMIT=abc123 scripts/device/decode.sh
# COMMIT is written into every result line (the device's git HEAD may be stale).
# The device tool returns at most 8 files from $OUT, so every stage appends to one log,
# $OUT/run.log (the GPU tests and the build keep their own; results go to results.jsonl).
# SMI=1 samples the clock, power and throttle reasons every 200 ms while the stages run
# ($OUT/smi.csv) and summarises the loaded samples at the end: decode and training run at the
# card's 700 W limit, where the clock (and so every figure) varies from card to card.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-out}
export LAPLACE_COMMIT=${COMMIT:-$(git describe --always --dirty --abbrev=7 2>/dev/null || echo unknown)}
export NCCL_NVLS_ENABLE=0
STAGES=${STAGES-tests decode eager bf16 prefill}  # unset: these; set but empty: the build alone
mkdir -p "$OUT"
R="$OUT/results.jsonl"
LOG="$OUT/run.log"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv >> "$LOG" 2>&1
if [ "${BUILD:-1}" = 1 ]; then  # BUILD=0: experiment stages only (each compiles its own program)
  cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a ${CMAKE_EXTRA:-} \
    > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
  cmake --build build-gpu -j "$(nproc)" --target laplace laplace_tests bench_ops bench_train >> "$OUT/build.log" 2>&1 ||
    { grep -E "error|FAILED" -A3 "$OUT/build.log" | head -60; exit 1; }
  echo "build ok ($LAPLACE_COMMIT)"
else
  mkdir -p build-gpu
fi
L=./build-gpu/laplace
M3B="--config configs/laplace-3b.json --device cuda --dtype bf16"
# experiments/trace/cupti_trace.cpp as build-gpu/libcupti_trace.so (stages trace and ptrace).
build_tracer() {
  local lib
  lib=$(dirname "$(find /usr/local/cuda/ -name 'libcupti.so' | head -1)")
  g++ -O2 -shared -fPIC -I/usr/local/cuda/include -I/usr/local/cuda/extras/CUPTI/include experiments/trace/cupti_trace.cpp \
    -L"$lib" -Wl,-rpath,"$lib" -lcupti -o build-gpu/libcupti_trace.so >> "$LOG" 2>&1
}
if [ "${SMI:-0}" = 1 ]; then
  nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active \
    --format=csv,noheader,nounits -lms 200 > "$OUT/smi.csv" 2>&1 &
  SMI_PID=$!
fi
for s in $STAGES; do
  case $s in
    tests)  # TESTS_TIMEOUT (s, default 420): a kernel that never finishes ends the stage, not the call (exit 124)
      timeout ${TESTS_TIMEOUT:-420} ./build-gpu/tests/laplace_tests --gtest_filter="${FILTER:-CudaOps.*:CudaModel.*}" \
        > "$OUT/cuda_tests.log" 2>&1
      echo "cuda tests exit $?"
      grep -E "^\[  (FAILED|PASSED|SKIPPED) |Failure|bf16 states:" "$OUT/cuda_tests.log" | head -40 ;;
    decode)  # SPEC §3 target: >= 53,000 tok/s with 1,280 sequences, fp32 state
      timeout 240 $L bench decode $M3B --batch 1280 --steps 20 --warmup 3 --prompt-len 16 --prefill-chunk 16 \
        --max-batch-tokens 24000 --results "$R" --tag 3b_1280_fp32state 2>&1 | tee -a "$LOG" | grep -E "engine|decode:|per step" ;;
    eager)
      timeout 240 $L bench decode $M3B --batch 1280 --steps 20 --warmup 3 --prompt-len 16 --prefill-chunk 16 --eager --max-batch-tokens 24000 \
        --results "$R" --tag 3b_1280_fp32state_eager 2>&1 | tee -a "$LOG" | grep -E "decode:" ;;
    bf16)  # target: >= 90,000 tok/s; accuracy vs fp32 states over 256 steps
      timeout 300 $L bench decode $M3B --batch 1280 --steps 20 --warmup 3 --prompt-len 16 --prefill-chunk 16 \
        --max-batch-tokens 24000 --state-dtype bf16 --accuracy-steps 256 --results "$R" --tag 3b_1280_bf16state 2>&1 | tee -a "$LOG" |
        grep -E "engine|decode:|bf16 vs" ;;
    defer)  # deferred write-back (--defer-writeback R, DEFER_R, default 8): DEFER_STATES (fp32 bf16); accuracy vs fp32
      for sd in ${DEFER_STATES:-fp32 bf16}; do
        acc=""; [ "$sd" = fp32 ] && acc="--accuracy-steps ${DEFER_ACC:-256}"
        timeout 300 $L bench decode $M3B --batch 1280 --steps 48 --warmup 3 --prompt-len 16 --prefill-chunk 16 \
          --max-batch-tokens 24000 --state-dtype ${sd/fp32/f32} --defer-writeback ${DEFER_R:-8} $acc --results "$R" \
          --tag 3b_1280_${sd}state_defer${DEFER_R:-8} 2>&1 | tee -a "$LOG" | grep -E "engine|decode:|vs f32"
      done ;;
    prefill)  # target: <= 80 ms for one 8,192-token prompt
      timeout 120 $L bench prefill $M3B --prompt-len 8192 --reps 7 --results "$R" --tag 3b 2>&1 |
        tee -a "$LOG" | grep -E "prefill of" ;;
    sweep)  # per-step overhead vs per-layer cost
      timeout 400 $L bench decode $M3B --batch 1280 --steps 10 --warmup 2 --prompt-len 1 --prefill-chunk 1 \
        --max-batch-tokens 24000 --layers-sweep --sweep-max-layers ${SWEEP_MAX:-4} --results "$R" --tag 3b_1280 2>&1 | tee -a "$LOG" |
        grep -E "layers|decode:" ;;
    prompt)  # decode cost after 2,048- vs 8,192-token prompts (SPEC §3: <= +0.5%); PROMPT_ARGS: more options
      # (e.g. --defer-writeback 8), PROMPT_TAG: a suffix for the tag that says so
      timeout 150 $L bench decode $M3B --batch ${PROMPT_BATCH:-128} --steps 20 --warmup 3 --prompt-len 2048 \
        --prefill-chunk 2048 --max-batch-tokens 16384 --compare-prompt-len 8192 --results "$R" \
        --tag 3b_${PROMPT_BATCH:-128}${PROMPT_TAG:-} ${PROMPT_ARGS:-} 2>&1 | tee -a "$LOG" | grep -E "decode" ;;
    poisson)  # staggered arrivals: throughput, TTFT and TPOT p50/p99
      timeout 120 $L bench serve $M3B --rate ${RATE:-64} --count ${COUNT:-1024} --prompt-len 128 --prompt-len-max 1024 \
        --output-len 128 --output-len-max 512 --max-slots 1280 --max-batch-tokens 4096 --prefill-chunk 512 \
        --results "$R" ${POISSON_ARGS:-} 2>&1 | tee -a "$LOG" | tail -12 ;;
    burst)  # issue 30: bursts with batched prefill (its GPU tests first: off if the batched one fails,
      # ragged if the ragged one passes too; the rates stage after it uses the same)
      ./build-gpu/tests/laplace_tests --gtest_filter=CudaModel.BatchedPrefillIntoSlotsFollowsOneRowAtATime \
        >> "$LOG" 2>&1 && BP=equal || BP=off
      [ $BP = equal ] && ./build-gpu/tests/laplace_tests --gtest_filter=CudaModel.RaggedPrefillIntoSlotsFollowsOneRowAtATime \
        >> "$LOG" 2>&1 && BP=ragged
      echo "batched and ragged prefill tests: batch prefill $BP" | tee -a "$LOG"
      timeout 200 $L bench serve $M3B --burst --count 1280 --prompt-len 16 --output-len 8 --max-slots 1280 \
        --prefill-chunk 16 --max-batch-tokens 24000 --batch-prefill $BP --results "$R" --tag 3b_1280x16 2>&1 |
        tee -a "$LOG" | grep -E "serve:|burst:"
      timeout 200 $L bench serve $M3B --burst --count 256 --prompt-len 2048 --output-len 4 --max-slots 256 \
        --prefill-chunk 2048 --max-batch-tokens 16384 --batch-prefill $BP --results "$R" --tag 3b_256x2048 2>&1 |
        tee -a "$LOG" | grep -E "serve:|burst:" ;;
    pgraphs)  # ragged prefill from CUDA graphs (--prefill-graphs 16) against eager prefill (0), in one call:
      # chunked long prompts (every piece one layout) and a small-budget burst (layouts rarely recur)
      for pg in 0 16; do
        timeout 120 $L bench serve $M3B --burst --count 8 --prompt-len 8192 --output-len 4 --max-slots 8 \
          --prefill-chunk 512 --max-batch-tokens 512 --prefill-graphs $pg --results "$R" --tag 3b_8x8192_c512_pg$pg 2>&1 |
          tee -a "$LOG" | grep -E "serve:|burst:"
        timeout 120 $L bench serve $M3B --burst --count 1280 --prompt-len 16 --output-len 8 --max-slots 1280 \
          --prefill-chunk 16 --max-batch-tokens 2048 --prefill-graphs $pg --results "$R" --tag 3b_1280x16_mbt2048_pg$pg 2>&1 |
          tee -a "$LOG" | grep -E "serve:|burst:"
      done ;;
    rates)  # issue 30: the highest Poisson rate within TTFT p99 <= 300 ms and TPOT p99 <= 60 ms
      timeout 500 $L bench serve $M3B --rates ${RATES:-2,4,8,16,32,64} --count ${COUNT:-256} --prompt-len 128 \
        --prompt-len-max 1024 --output-len 128 --output-len-max 512 --max-slots 1280 --max-batch-tokens 4096 \
        --prefill-chunk 512 --batch-prefill ${BP:-auto} --out "$OUT/sweep.jsonl" --results "$R" --tag 3b 2>&1 |
        tee -a "$LOG" | tail -10 ;;
    train125)  # laplace-125m (issue 25): bench_train's phases at B16 x accum 2 and B32 x accum 1, then the
      # kernel timeline of those steps (each fwd+bwd and optimizer phase is a run between host syncs)
      for ba in "16 2" "32 1"; do
        set -- $ba
        timeout 120 ./build-gpu/bench/bench_train --config configs/laplace-125m.json --batch $1 --accum $2 --steps 8 \
          --warmup 2 --results "" 2>&1 | tee -a "$LOG" | grep -E "^result|alone|phase by phase|^step 9"
      done
      build_tracer &&
      CUDA_INJECTION64_PATH=$PWD/build-gpu/libcupti_trace.so CUPTI_TRACE_OUT=build-gpu/ttrace.csv timeout 120 \
        ./build-gpu/bench/bench_train --config configs/laplace-125m.json --batch 16 --accum 2 --steps 2 --warmup 1 \
        --results "" 2>&1 | grep -E "^result|cupti" | tee -a "$LOG"
      python3 scripts/trace_step.py build-gpu/ttrace.csv --steps 5 --split-gap-ms 0.5 --top ${TRACE_TOP:-40} >> "$LOG" 2>&1 ;;
    ops)  # per-op times of one decode step and one 8,192-token prefill
      ./build-gpu/bench/bench_ops ${OPS_ARGS:-} 2>&1 | tee -a "$LOG" ;;
    train)  # the training step of laplace-3b (issue 4: >= 30,000 tok/s, optimizer included); ACCUM micro-batches
      timeout ${TRAIN_TIMEOUT:-300} ./build-gpu/bench/bench_train --steps ${TRAIN_STEPS:-2} --warmup 1 --accum ${ACCUM:-2} \
        --results "$R" --commit "$LAPLACE_COMMIT" 2>&1 | tee -a "$LOG" | grep -vE "^  (rejected|layer)" | tail -${TRAIN_TAIL:-16} ;;
    lab)  # kernel experiments (experiments/norm: LayerNorm forward and dx) at training and prefill rows
      nvcc -O3 -std=c++17 -I. -gencode=arch=compute_90a,code=sm_90a -o build-gpu/experiment_norm experiments/norm/norm.cu >> "$LOG" 2>&1 &&
        for n in 16384 8192; do ./build-gpu/experiment_norm --N $n 2>&1 | tee -a "$LOG"; done ;;
    declab)  # experiments/decode: the decode state kernel's versions (production, bulk copies, persistent over N SMs)
      nvcc -O3 -std=c++17 -I. -gencode=arch=compute_90a,code=sm_90a -o build-gpu/experiment_decode experiments/decode/decode.cu \
        >> "$LOG" 2>&1 && timeout 300 ./build-gpu/experiment_decode ${DECLAB_ARGS:-} 2>&1 | tee -a "$LOG" ;;
    overlap)  # experiments/decode/overlap.cu: the state stream on N SMs beside the gemms of the other half batch
      nvcc -O3 -std=c++17 -I. -gencode=arch=compute_90a,code=sm_90a -o build-gpu/experiment_decode_overlap experiments/decode/overlap.cu \
        -lcublasLt >> "$LOG" 2>&1 && timeout 300 ./build-gpu/experiment_decode_overlap ${OVERLAP_ARGS:-} 2>&1 | tee -a "$LOG" ;;
    deferred)  # experiments/decode/deferred.cu: v4, the state written back every R-th step only, against v1
      nvcc -O3 -std=c++17 -I. -gencode=arch=compute_90a,code=sm_90a -o build-gpu/experiment_decode_deferred experiments/decode/deferred.cu \
        >> "$LOG" 2>&1 && for r in ${DEFERRED_R:-4 8 16}; do timeout 120 ./build-gpu/experiment_decode_deferred --R $r --steps 16 \
        ${DEFERRED_ARGS:-} 2>&1 | tee -a "$LOG"; done ;;
    cores)  # experiments/decode/cores.cu: gemm tiles and the state stream as two roles of one block on every SM
      # (CORES_STATES: the state dtypes, one run each)
      nvcc -O3 -std=c++17 -I. -gencode=arch=compute_90a,code=sm_90a -o build-gpu/experiment_decode_cores experiments/decode/cores.cu \
        >> "$LOG" 2>&1 && for sd in ${CORES_STATES:-f32 bf16}; do
        timeout 300 ./build-gpu/experiment_decode_cores --states $sd ${CORES_ARGS:-} 2>&1 | tee -a "$LOG"; done ;;
    ncu)  # kernel metrics (Nsight Compute) of the kernels matching NCU_KERNELS in bench_ops --only NCU_SECTION;
      # NCU_BASE=demangled matches the regex against the full signature (one template instance, e.g.
      # NCU_KERNELS="column_codes_kernel<__nv_bfloat16, 8, 1>": the row-and-column pass of dY)
      timeout 300 ncu --kernel-name-base ${NCU_BASE:-function} \
        --kernel-name "regex:${NCU_KERNELS:-layernorm_fwd|conv_prefill|rmsnorm_gate_fwd}" --launch-skip 1 \
        --launch-count ${NCU_COUNT:-3} --section SpeedOfLight --section Occupancy --section LaunchStats \
        --section WarpStateStats ./build-gpu/bench/bench_ops --only ${NCU_SECTION:-prefill} --reps 1 > "$OUT/ncu.log" 2>&1
      echo "ncu exit $?"
      grep -E "^  [a-z_].*\(|Duration|DRAM Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Theoretical Occ|Stall|ERR" \
        "$OUT/ncu.log" | head -${NCU_TAIL:-60} ;;
    trace)  # kernel timeline of a deferred F32 decode run (experiments/trace/cupti_trace.cpp, CUPTI injection; no nsys there):
      # idle time and kernel times per step (scripts/trace_step.py). TRACE_STATE: the states' dtype; TRACE_ARGS: more
      # options for this stage and ptrace (e.g. --weights fp8)
      build_tracer &&
      CUDA_INJECTION64_PATH=$PWD/build-gpu/libcupti_trace.so CUPTI_TRACE_OUT=build-gpu/trace.csv timeout 300 \
        $L bench decode $M3B --batch 1280 --steps 12 --warmup 3 --prompt-len 16 --prefill-chunk 16 --max-batch-tokens 24000 --results "" \
        --state-dtype ${TRACE_STATE:-f32} --defer-writeback ${DEFER_R:-8} ${TRACE_ARGS:-} 2>&1 | grep -E "decode:|cupti" | tee -a "$LOG"
      python3 scripts/trace_step.py build-gpu/trace.csv --steps 8 2>&1 | tee -a "$LOG" ;;
    ptrace)  # kernel timeline of the 8,192-token prefill (as trace; each repetition is a run between host syncs; the
      # traced FP8 prefill did not finish within 120 s)
      build_tracer &&
      CUDA_INJECTION64_PATH=$PWD/build-gpu/libcupti_trace.so CUPTI_TRACE_OUT=build-gpu/ptrace.csv timeout 300 \
        $L bench prefill $M3B --prompt-len 8192 --reps 3 --results "" ${TRACE_ARGS:-} 2>&1 | grep -E "prefill of|cupti" | tee -a "$LOG"
      python3 scripts/trace_step.py build-gpu/ptrace.csv --steps 3 --split-gap-ms 1 --top ${TRACE_TOP:-40} 2>&1 | tee -a "$LOG" ;;
    fp8serve)  # issue 31's serving figures with FP8 weights (--weights fp8), after the FP8 GPU tests (FP8_TESTS=0:
      # without them); FP8_DEFER=R: with --defer-writeback R (tags end in _deferR); FP8_STATES: the decode runs' state
      # dtypes (default "bf16 f32"), FP8_PREFILL=0: no prefill figure; FP8_WEIGHTS=fp8-fast: fast accumulation (tags
      # with fp8fast for fp8); FP8_HEAD=1: the LM head in FP8 too (--fp8-head, tags end in _fp8head; the prefill's
      # figures end in _head)
      if [ "${FP8_TESTS:-1}" = 1 ]; then
        timeout ${TESTS_TIMEOUT:-420} ./build-gpu/tests/laplace_tests \
          --gtest_filter="CudaOps.Fp8*:CudaModel.Fp8*:CudaModelTrain.Fp8*" > "$OUT/fp8_tests.log" 2>&1
        echo "fp8 tests exit $?"; grep -E "^\[  (FAILED|PASSED) |Failure|fp8 weights:" "$OUT/fp8_tests.log" | head -20
      fi
      defer=; dtag=; fw=${FP8_WEIGHTS:-fp8}; head=; htag=
      [ "${FP8_HEAD:-0}" = 1 ] && head=--fp8-head && htag=_fp8head
      [ -n "${FP8_DEFER:-}" ] && defer="--defer-writeback $FP8_DEFER" && dtag=_defer$FP8_DEFER
      for sd in ${FP8_STATES:-bf16 f32}; do
        timeout 240 $L bench decode $M3B --weights $fw $head --batch 1280 --steps 20 --warmup 3 --prompt-len 16 \
          --prefill-chunk 16 --max-batch-tokens 24000 --state-dtype $sd $defer --results "$R" \
          --tag 3b_1280_${sd/f32/fp32}state_${fw/-/}$dtag$htag 2>&1 | tee -a "$LOG" | grep -E "engine|decode:"
      done
      [ "${FP8_PREFILL:-1}" = 1 ] && timeout 120 $L bench prefill $M3B --weights $fw $head --prompt-len 8192 --reps 7 \
        --results "$R" --tag 3b 2>&1 | tee -a "$LOG" | grep -E "prefill of" ;;
    fp8train)  # laplace-3b whole steps (optimizer included), random tokens, one run per entry of TRAIN3B: fp8
      # (--precision fp8), fp8fast (--precision fp8-fast), model (the same in model precision) and p1 (--distributed: the sharded trainer
      # through a one-rank NCCL communicator). No --out, so no 36 GB checkpoint at the end. Each figure is
      # the median of steps 2..STEPS3B (step 1 pays first-use costs).
      python3 -c "
import numpy as np
n, V = 6_000_000, 92160
h = np.zeros(256, np.int32); h[0], h[1], h[2] = 20240520, 2, n
open('build-gpu/rand3b.bin', 'wb').write(h.tobytes() + np.random.default_rng(1).integers(0, V, n, dtype=np.uint32).tobytes())"
      for run in ${TRAIN3B:-fp8 model p1}; do
        case $run in
          fp8) args="--precision fp8"; tag=_fp8 ;;
          fp8fast) args="--precision fp8-fast"; tag=_fp8fast ;;
          model) args="--precision model"; tag=_same_call ;;
          p1) args="--distributed"; tag=_p1_nccl ;;
          *) echo "fp8train: unknown run $run"; continue ;;
        esac
        timeout 400 $L train --config configs/laplace-3b.json --data build-gpu/rand3b.bin --device cuda --dtype bf16 \
          --seq 2048 --batch 8 --grad-accum 32 --steps ${STEPS3B:-4} --lr 1e-3 --warmup 1 --peak-tflops 989 \
          $args 2>&1 | tee "$OUT/train3b_$run.log" | grep -E "^step|error|FP8|plan"
        python3 - "$tag" "$args" "$R" "$OUT/train3b_$run.log" <<'PY'
import json, re, statistics, sys, time, os
tag, args, results, log = sys.argv[1:5]
tps = [float(m.group(1)) for m in re.finditer(r"\| (\d+) tok/s", open(log).read())][1:]
if tps:
    print(json.dumps({"bench": "train_tok_s_laplace3b_t2048" + tag, "value": round(statistics.median(tps)),
                      "unit": "tokens/s", "device": "NVIDIA H200", "commit": os.environ.get("LAPLACE_COMMIT", "?"),
                      "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                      "note": "laplace train %s, B=8 x T=2048 x accum 32 (524288 tokens/step), random tokens, "
                              "median of steps 2-%d" % (args, len(tps) + 1),
                      "command": "scripts/device/decode.sh (stage fp8train)"}), file=open(results, "a"))
PY
      done ;;
    dstream)  # experiments/decode/stream.cu: the pending step's BF16 state read, block per (slot, head) against
      # persistent double-buffered blocks (DSTREAM_ARGS, e.g. "--per-sm 3")
      nvcc -O3 -std=c++17 -I. -gencode=arch=compute_90a,code=sm_90a -Xptxas -v \
        -o build-gpu/experiment_decode_stream experiments/decode/stream.cu 2>&1 | grep -E "error|registers|spill" >> "$LOG"
      timeout 120 ./build-gpu/experiment_decode_stream ${DSTREAM_ARGS:-} 2>&1 | tee -a "$LOG" ;;
    fp8q)  # experiments/fp8/quant.cu: dY's rows-and-columns quantisation, production against variants (FP8Q_ARGS)
      nvcc -O3 -std=c++17 -I. --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a -Xptxas -v \
        -o build-gpu/experiment_fp8_quant experiments/fp8/quant.cu 2>&1 | grep -E "error|registers|spill" >> "$LOG"
      timeout 300 ./build-gpu/experiment_fp8_quant ${FP8Q_ARGS:-} 2>&1 | tee -a "$LOG" ;;
    fp8)  # experiments/gemm/fp8.cu: e4m3 gemms per scaling granularity against bf16 (issue 31)
      nvcc -O3 -std=c++17 -I. -gencode=arch=compute_90a,code=sm_90a -o build-gpu/experiment_gemm_fp8 experiments/gemm/fp8.cu \
        -lcublasLt >> "$LOG" 2>&1 && timeout 400 ./build-gpu/experiment_gemm_fp8 ${FP8_ARGS:-} 2>&1 | tee -a "$LOG" ;;
    algo)  # experiments/gemm/algo.cu: cuBLASLt's candidate algorithms at the model's gemm shapes (nodes, memsets, time)
      nvcc -O3 -std=c++17 -I. -gencode=arch=compute_90a,code=sm_90a -o build-gpu/experiment_gemm_algo experiments/gemm/algo.cu -lcublasLt \
        >> "$LOG" 2>&1 && timeout 300 ./build-gpu/experiment_gemm_algo ${ALGO_ARGS:-} 2>&1 | tee -a "$LOG" ;;
    wgmma)  # experiments/gemm/wgmma.cu: the hand-written TMA + wgmma gemm against cuBLASLt; one process per version, so
      # that a version that traps (an mbarrier wait timing out) does not hide the others
      nvcc -O3 -std=c++17 -I. -gencode=arch=compute_90a,code=sm_90a -Xptxas -v -o build-gpu/experiment_gemm_wgmma experiments/gemm/wgmma.cu \
        -lcublasLt >> "$LOG" 2>&1 &&
      for v in ${WGMMA_VERSIONS:-1 2 3 4 5 6}; do
        timeout 120 ./build-gpu/experiment_gemm_wgmma --versions $v ${WGMMA_ARGS:-} 2>&1 | tee -a "$LOG" | grep -E "^  v|TFLOP/s|PASS|FAIL|rror|timed out"
      done ;;
    parity)  # greedy tokens vs the PyTorch reference on this GPU (needs a trained model: carry runs/demo/model)
      python3 python/gpu_parity.py --model ${PARITY_MODEL:-runs/demo/model} --binary build-gpu/laplace 2>&1 |
        tee -a "$LOG" ;;
    *) echo "unknown stage $s" ;;
  esac
done
if [ -n "${SMI_PID:-}" ]; then
  kill "$SMI_PID"
  # Samples above 300 W: SM clock and power ranges, and how many carried a throttle reason.
  awk -F', *' '$3 + 0 > 300 { print $2, $3, ($5 == "0x0000000000000000" ? 0 : 1) }' "$OUT/smi.csv" |
    sort -n | awk '{ c[NR] = $1; p += $2; t += $3; if (NR == 1 || $2 > pmax) pmax = $2 }
      END { if (!NR) { print "smi: no sample above 300 W"; exit }
            printf "smi: %d samples above 300 W: SM clock %d-%d MHz (median %d), mean power %.0f W (max %.0f), %d throttled\n",
                   NR, c[1], c[NR], c[int((NR + 1) / 2)], p / NR, pmax, t }' | tee -a "$LOG"
fi
