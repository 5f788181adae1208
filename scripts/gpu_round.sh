#!/usr/bin/env bash
# One round on a GPU machine, in the order that spends its time best: build the whole matrix for
# this GPU in parallel, run the GPU test tier, then (optionally) benchmarks and the sanitizer.
# Every step is time-bounded by what is left of one budget, so the round ends inside a lease.
#
#   scripts/gpu_round.sh [LOG_DIR]        (default LOG_DIR: ./gpu-round-logs)
#
# Steps, each with its log in LOG_DIR (summary.txt: one line per step, also printed):
#   build.log   `flashgen build` of every instance for this GPU (-j nproc)
#   tests.log   `pytest tests/gpu` (test_large.py only with ROUND_LARGE=1)
#   bench/      `flashgen bench prefill ROUND_BENCH_ARGS` (report.txt, results.json), if ROUND_BENCH_ARGS
#   sanitize/   scripts/sanitize.sh, if ROUND_SANITIZE=1 (its own knobs apply)
#
# Exit status: 0 when every step that ran passed; 1 otherwise.
#
# Knobs (environment):
#   ROUND_BUDGET       seconds for the whole round (default 540)
#   ROUND_BUILD        0: no build step (the cache is carried, or the tests compile what they use)
#   ROUND_PYTEST_ARGS  extra pytest arguments (e.g. "-k dropout -x")
#   ROUND_LARGE        1: also run tests/gpu/test_large.py (needs ~60 GB of GPU memory)
#   ROUND_BENCH_ARGS   arguments after `flashgen bench`, e.g. "prefill --modes bwd --seqlens 4096 --no-plots"
#   ROUND_SANITIZE     1: run scripts/sanitize.sh with what is left of the budget
#   FLASHGEN_CACHE_DIR kernel cache (default /tmp/flashgen-round-cache)
set -u -o pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
LOG_DIR=${1:-./gpu-round-logs}
mkdir -p "$LOG_DIR"
LOG_DIR=$(cd "$LOG_DIR" && pwd)
cd "$REPO"

PY=${PYTHON:-python3}
BUDGET=${ROUND_BUDGET:-540}
read -r -a EXTRA_PYTEST <<<"${ROUND_PYTEST_ARGS:-}"
read -r -a BENCH_ARGS <<<"${ROUND_BENCH_ARGS:-}"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export FLASHGEN_CACHE_DIR=${FLASHGEN_CACHE_DIR:-/tmp/flashgen-round-cache}

START=$SECONDS
SUMMARY="$LOG_DIR/summary.txt"
: >"$SUMMARY"
FAILED=0
say() { echo "$*" | tee -a "$SUMMARY"; }
left() { echo $((BUDGET - (SECONDS - START) - 10)); }
# Runs "$@" with what is left of the budget; its log is $1's name. Returns the command's status.
run_step() {
    local name=$1 log=$2
    shift 2
    local limit
    limit=$(left)
    if ((limit < 20)); then
        say "$name: skipped (budget spent)"
        return 0
    fi
    local t0=$SECONDS status
    timeout "$limit" "$@" >"$log" 2>&1
    status=$?
    local tail_line
    tail_line=$(grep -E '(passed|failed|skipped|deselected|error|kernels:|RESULT)' "$log" | tail -n 1 | sed -e 's/^[= ]*//' -e 's/[= ]*$//')
    say "$name: rc=$status in $((SECONDS - t0)) s | ${tail_line:-see $log}"
    ((status == 0)) || FAILED=1
    return "$status"
}

say "gpu: $(nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader 2>/dev/null || echo 'nvidia-smi not found')"
if [[ ${ROUND_BUILD:-1} == 1 ]]; then
    run_step build "$LOG_DIR/build.log" "$PY" -m flashgen build -j "$(nproc 2>/dev/null || echo 8)"
fi
tests=(tests/gpu)
[[ ${ROUND_LARGE:-0} == 1 ]] || tests+=(--ignore=tests/gpu/test_large.py)
run_step tests "$LOG_DIR/tests.log" "$PY" -m pytest -q -p no:cacheprovider "${tests[@]}" "${EXTRA_PYTEST[@]}"
if ((${#BENCH_ARGS[@]})); then
    run_step bench "$LOG_DIR/bench.log" "$PY" -m flashgen bench "${BENCH_ARGS[@]}" --out "$LOG_DIR/bench" &&
        grep -E '^(fwd|bwd|fwd_bwd|decode) ' "$LOG_DIR/bench/report.txt" | tee -a "$SUMMARY"
fi
if [[ ${ROUND_SANITIZE:-0} == 1 ]]; then
    run_step sanitize "$LOG_DIR/sanitize.log" env SANITIZE_BUILD_FILTERS=none SANITIZE_BUDGET="$(left)" \
        bash scripts/sanitize.sh "$LOG_DIR/sanitize"
fi
say "round: $((SECONDS - START)) s, $([[ $FAILED == 0 ]] && echo ok || echo FAILED)"
exit "$FAILED"
