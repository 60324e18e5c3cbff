#!/usr/bin/env bash
# Everything the CUDA path needs checked on a GPU, in one run of under 8 minutes, on a host with
# only torch and transformers installed (Triton comes with torch's CUDA wheels):
#
#   1. step times: decode step at batch 1, 64, 256 and prefill tok/s, with and without CUDA graphs
#      (benchmarks/step_times.py)
#   2. the nano-vllm workload against HF generate static batching in the same run
#      (benchmarks/offline.py --preset nano-vllm)
#   3. tests: the Triton runner against the torch runner (tests/test_triton_runner.py: quick, and
#      it names the layer at fault), greedy output token-exact against HF in float32 and bfloat16,
#      CUDA graphs on and --enforce-eager (tests/test_engine_cuda.py: the result the run is for)
#   4. the attention kernel alone: decode launches at every split count (what WAVES should be),
#      and a mixed step's decodes in a launch of their own against one launch for all
#      (benchmarks/attention_splits.py, under a minute)
#   5. the Triton kernels' property tests, each new shape a compile (tests/test_triton_attention.py,
#      test_triton_norm.py), in the time left
#
# The numbers come first; the tests take the time left before $KVSERVE_GPU_DEADLINE_S (450 s
# from the start) less a minute kept for the attention sweep, and the property tests what is
# left after it (pytest stops itself 15 s before its stage's end, with its summary, where
# pytest-timeout is there): GPU time comes in short windows, and a run cut short still leaves its logs.
#
# Results go to $OUT (else ./gpu_check_out), 8 files (all the device tool brings back): summary.txt
# (the host, then each stage's outcome and tables), tests.log, step_times.{log,json}, profile.txt
# (5 decode steps at batch 256 under torch.profiler), offline.{log,json}, attention.log. The model
# is SmolLM2-135M's shape with random bfloat16 weights; its tokenizer is copied from
# $KVSERVE_TOKENIZER_DIR when set, else synthesized (benchmarks/random_model.py).
# Modules the host lacks (llguidance, from `make gpu-carry`; its image has pytest, pytest-timeout,
# hypothesis and peft) are installed from the wheels in ./.whl when that folder is there: any wheel
# put there is installed where its module is missing.
#
#   bash benchmarks/gpu_check.sh              # all of it
#   STAGES="tests" bash benchmarks/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-$PWD/gpu_check_out}
STAGES=${STAGES-steps offline tests attention props}  # set but empty: none (only the set-up)
DEADLINE=${KVSERVE_GPU_DEADLINE_S:-450}  # seconds from the start by which the last stage ends
PY=${PYTHON:-python3}
WORK=${KVSERVE_GPU_WORK:-/tmp/kvserve-gpu-check}
export PYTHONUNBUFFERED=1 KVSERVE_CACHE="$WORK/cache"
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$WORK/triton}  # one writable cache: each stage reuses the compiles before it
export KVSERVE_KERNEL_EXAMPLES=${KVSERVE_KERNEL_EXAMPLES:-12}  # compiled, every new kernel shape costs a compile
mkdir -p "$OUT" "$WORK"
START=$SECONDS

log() { echo "== +$((SECONDS - START))s $*" | tee -a "$OUT/summary.txt"; }

# Runs "$@" under a time limit, output to $OUT/$name.log; notes the outcome in the summary.
stage() {
  local name=$1 limit=$2
  shift 2
  log "$name: $*"
  timeout -k 5 "$limit" "$@" 2>&1 | tee -a "$OUT/$name.log"  # a pipe: the log is whole when the stage returns
  local rc=${PIPESTATUS[0]}
  log "$name: exit $rc$([ $rc -eq 124 ] && echo " (timed out after ${limit}s)")"
  return 0
}

# pytest over "$@", its output in tests.log, until the deadline less `reserve` seconds (kept for
# the stages after it), at least `least` seconds; none when that leaves less than 30.
pytest_stage() {
  local reserve=$1 least=$2
  shift 2
  # pytest-timeout (on the GPU image): a hung test fails alone, and the session ends itself
  # before the stage's kill, printing its summary (--session-timeout: pytest-timeout 2.3+). Read
  # whole, not piped into grep -q: its early exit would break pytest's pipe, and pipefail the test.
  local help limits="" left
  help=$(timeout 60 $PY -m pytest --help 2> /dev/null)
  left=$((DEADLINE - reserve - (SECONDS - START)))
  left=$((left > least ? left : least))
  if [ "$left" -lt 30 ]; then
    log "tests: $* skipped, no time left"
    return 0
  fi
  if grep -q -- "--session-timeout" <<< "$help"; then
    limits="--timeout=120 --session-timeout=$((left - 15))"
  elif $PY -c "import pytest_timeout" 2> /dev/null; then
    limits="--timeout=120"
  fi
  # -v: a line per test as it ends, so a stage cut off at its end still says how far it got
  stage tests "$left" $PY -m pytest -v -rfE -p no:cacheprovider --durations=10 $limits "$@"
}

# A carried wheel is installed only where the host lacks its module (a wheel's distribution name
# is its module's here: llguidance, pytest, pluggy, iniconfig, pygments, hypothesis, sortedcontainers).
missing=()
for whl in .whl/*.whl; do
  [ -e "$whl" ] || continue
  module=$(basename "$whl" | cut -d- -f1)
  timeout 60 $PY -c "import $module" 2> /dev/null || missing+=("$whl")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing the carried wheels the host lacks: ${missing[*]}"
  timeout 120 $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$WORK/site" "${missing[@]}" \
    && export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
fi

{  # every set-up step time-boxed: one that hangs must not take the run's whole window
  timeout 30 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  timeout 120 $PY -c 'import sys, torch, triton, transformers; print("python", sys.version.split()[0], "torch", torch.__version__,
"cuda", torch.version.cuda, "triton", triton.__version__, "transformers", transformers.__version__)'
  nproc
} 2>&1 | tee -a "$OUT/summary.txt"

MODEL="$WORK/smollm2-135m-bfloat16"
timeout 180 $PY benchmarks/random_model.py "$MODEL" --dtype bfloat16 ${KVSERVE_TOKENIZER_DIR:+--tokenizer "$KVSERVE_TOKENIZER_DIR"} \
  || { log "could not make the model"; exit 1; }
export KVSERVE_TEST_TOKENIZER_DIR="$MODEL"  # the tiny test models take their tokenizer from here

for s in $STAGES; do
  case $s in
    tests)  # exactness against HF, before the sweep and the property tests (their compiles take the longest)
      reserve=0
      case " $STAGES " in *" attention "*) reserve=60 ;; esac
      pytest_stage $reserve 60 tests/test_triton_runner.py tests/test_engine_cuda.py ;;
    props)
      pytest_stage 0 0 tests/test_triton_attention.py tests/test_triton_norm.py ;;
    steps)
      stage step_times 110 $PY benchmarks/step_times.py --model "$MODEL" --batches 1,64,256 \
        --json "$OUT/step_times.json" --profile "$OUT/profile.txt" ;;
    offline)
      stage offline 170 $PY benchmarks/offline.py --preset nano-vllm --model "$MODEL" \
        --systems kvserve,hf-static --hf-num-prompts 16 --json "$OUT/offline.json" ;;
    attention)
      stage attention 60 $PY benchmarks/attention_splits.py ;;
    *) log "unknown stage $s" ;;
  esac
done
log "done"
if [ -f "$OUT/tests.log" ]; then  # pytest's summary lines (one a stage), else the count of the -v lines before the cut
  summary=$(grep -E "^=+ .*(passed|failed|error|skipped)" "$OUT/tests.log")
  echo "${summary:-tests cut short: $(grep -c " PASSED" "$OUT/tests.log") passed, $(grep -cE " (FAILED|ERROR)" "$OUT/tests.log") failed before the cut}" \
    | tee -a "$OUT/summary.txt"
fi
grep -hE "^\|" "$OUT/step_times.log" "$OUT/offline.log" "$OUT/attention.log" 2> /dev/null | tee -a "$OUT/summary.txt" || true
