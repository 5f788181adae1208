#!/usr/bin/env bash
# Run the sanitizer cases (tests/gpu/sanitize_cases.py) under compute-sanitizer: memcheck, then
# racecheck, then synccheck (and initcheck on request). Rerunnable; needs a CUDA GPU.
#
#   scripts/sanitize.sh [LOG_DIR]          (default LOG_DIR: ./sanitize-logs)
#
# Steps, each with its log in LOG_DIR:
#   build.log          kernels the cases need, compiled without the sanitizer (`flashgen build --filter`,
#                      into FLASHGEN_CACHE_DIR), so that no NVRTC compile runs under it
#   baseline.log       the cases without a sanitizer: compiles anything the filters missed, and tells a
#                      plain test failure from one the sanitizer causes
#   <tool>.log         pytest under `compute-sanitizer --tool <tool>`; <tool>.xml: JUnit results
#   summary.txt        one line per step (also printed)
#
# Exit status: 0 all clean; 1 a sanitizer reported errors; 2 no sanitizer errors, but something else
# failed (a build, a test, a timeout, a sanitizer that did not finish, compute-sanitizer not found).
#
# Knobs (environment):
#   FLASHGEN_CACHE_DIR        kernel cache (default /tmp/flashgen-sanitize-cache; reused by reruns)
#   PYTHON                    interpreter (default python3)
#   SANITIZE_TOOLS            default "memcheck racecheck synccheck"; initcheck may be added
#   SANITIZE_K_<TOOL>         pytest -k expression per tool; memcheck: all cases (""),
#                             racecheck / synccheck / initcheck: "core" (one case per kernel family)
#   SANITIZE_TIMEOUT_<TOOL>   seconds per tool: memcheck 180, racecheck 150, synccheck 90, initcheck 120
#   SANITIZE_BUDGET           seconds for the whole script (default 540): a step gets at most what is
#                             left (minus 15 s), and is skipped when less than 45 s are left
#   SANITIZE_BUILD_FILTERS    space-separated `flashgen build --filter` substrings; "all": the whole
#                             matrix for this GPU; "none": no prebuild
#   SANITIZE_ARCH             NVRTC target (default: this GPU's, e.g. sm_90a)
#   SANITIZE_JOBS             compile jobs (default: nproc)
#   SANITIZE_KERNEL_FILTER    --kernel-name filter (default kns=flash_: instrument flashgen's kernels
#                             only, not PyTorch's); "" checks every kernel
#   SANITIZE_PRINT_LIMIT      --print-limit (default 50)
#   SANITIZE_PADDING          memcheck/initcheck --padding bytes after each allocation (default 256)
#   COMPUTE_SANITIZER         path of compute-sanitizer (default: PATH, then /usr/local/cuda*/bin)
#   SANITIZE_PYTEST_ARGS      extra pytest arguments for every run
set -u -o pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
LOG_DIR=${1:-./sanitize-logs}  # relative to the caller's directory
mkdir -p "$LOG_DIR"
LOG_DIR=$(cd "$LOG_DIR" && pwd)
cd "$REPO"

PY=${PYTHON:-python3}
CASES=tests/gpu/sanitize_cases.py
TOOLS=${SANITIZE_TOOLS:-memcheck racecheck synccheck}
BUDGET=${SANITIZE_BUDGET:-540}
JOBS=${SANITIZE_JOBS:-$(nproc 2>/dev/null || echo 8)}
KERNEL_FILTER=${SANITIZE_KERNEL_FILTER-kns=flash_}
PRINT_LIMIT=${SANITIZE_PRINT_LIMIT:-50}
PADDING=${SANITIZE_PADDING:-256}
BUILD_FILTERS=${SANITIZE_BUILD_FILTERS:-hdim64_bf16 hdim128_bf16 hdim256_bf16 flash_append_sm80_bf16 flash_combine flash_bwd_pre_sm80_bf16 flash_bwd_post_sm80_bf16}
read -r -a EXTRA_PYTEST <<<"${SANITIZE_PYTEST_ARGS:-}"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export FLASHGEN_CACHE_DIR=${FLASHGEN_CACHE_DIR:-/tmp/flashgen-sanitize-cache}
mkdir -p "$FLASHGEN_CACHE_DIR"

START=$SECONDS
SUMMARY="$LOG_DIR/summary.txt"
: >"$SUMMARY"
SANITIZER_ERRORS=0   # errors reported by any sanitizer
OTHER_FAILURES=0     # anything else that went wrong

say() { echo "$*" | tee -a "$SUMMARY"; }
remaining() { echo $((BUDGET - (SECONDS - START))); }
# min(wanted, what the budget leaves minus a reserve for the summary); 0: no time for this step.
step_timeout() {
    local wanted=$1 left
    left=$(($(remaining) - 15))
    if ((left < 45)); then echo 0; elif ((wanted < left)); then echo "$wanted"; else echo "$left"; fi
}
# pytest's closing line ("3 failed, 43 passed in 80.12s"), or why there is none.
pytest_result() {
    local line
    line=$(grep -E '^[=[:space:]]*([0-9]+ (passed|failed|skipped|deselected|error|errors|xfailed|xpassed)[ ,]*)+.* in [0-9.]+s' "$1" | tail -n 1 | tr -d '=' | sed -e 's/^ *//' -e 's/ *$//')
    echo "${line:-no pytest summary (killed or crashed)}"
}
pytest_failed() { grep -Eq '[0-9]+ (failed|error|errors)\b' <<<"$1" || grep -q 'no pytest summary' <<<"$1"; }

# ---- compute-sanitizer and the options this version has
CS=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || true)}
if [[ -z "$CS" ]]; then
    for candidate in /usr/local/cuda/bin/compute-sanitizer $(ls -d /usr/local/cuda-*/bin/compute-sanitizer 2>/dev/null | sort -V -r); do
        [[ -x "$candidate" ]] && { CS=$candidate; break; }
    done
fi
{
    echo "date: $(date -u +%FT%TZ)"
    echo "repo: $REPO ($(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo '?'))"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | sed 's/^/gpu: /'
    echo "compute-sanitizer: ${CS:-not found} $([[ -n "$CS" ]] && "$CS" --version 2>/dev/null | tail -n 1)"
    "$PY" -c 'import sys, torch; print(f"python {sys.version.split()[0]}, torch {torch.__version__}, cuda {torch.version.cuda}")' 2>&1
    echo "cache: $FLASHGEN_CACHE_DIR"
} | tee "$LOG_DIR/environment.txt"
if [[ -z "$CS" ]]; then
    say "compute-sanitizer: not found (set COMPUTE_SANITIZER)"
    exit 2
fi
CS_HELP=$("$CS" --help 2>&1)
has_opt() { grep -q -- "$1" <<<"$CS_HELP"; }
COMMON_OPTS=(--target-processes all --error-exitcode 99)
has_opt --print-limit && COMMON_OPTS+=(--print-limit "$PRINT_LIMIT")
# PyTorch makes API calls that are expected to fail (capability probes); flashgen checks every driver
# call it makes and raises, so API errors would only be noise in the count.
has_opt --report-api-errors && COMMON_OPTS+=(--report-api-errors no)
has_opt --show-backtrace && COMMON_OPTS+=(--show-backtrace device)
if [[ -n "$KERNEL_FILTER" ]] && has_opt --kernel-name; then COMMON_OPTS+=(--kernel-name "$KERNEL_FILTER"); fi

ARCH=${SANITIZE_ARCH:-$("$PY" -c 'import torch
from flashgen.generator import matrix
print(matrix.target_arch(*torch.cuda.get_device_capability()))' 2>/dev/null)}
if [[ -z "$ARCH" ]]; then
    say "no CUDA GPU visible to torch: nothing to sanitize"
    exit 2
fi

# ---- 1. kernels, without the sanitizer
t0=$SECONDS
: >"$LOG_DIR/build.log"
build_rc=0
build() {  # flashgen build [--filter F], within the budget
    local timeout_s
    timeout_s=$(step_timeout 300)
    if ((timeout_s == 0)); then echo "skipped (budget): $*" >>"$LOG_DIR/build.log"; build_rc=124; return; fi
    timeout --kill-after=10 "$timeout_s" "$PY" -m flashgen build --arch "$ARCH" -j "$JOBS" "$@" \
        >>"$LOG_DIR/build.log" 2>&1 || build_rc=$?
}
if [[ "$BUILD_FILTERS" == all ]]; then
    build
elif [[ "$BUILD_FILTERS" != none ]]; then
    for f in $BUILD_FILTERS; do build --filter "$f"; done
fi
built=$(grep -E '^[0-9]+ kernels: ' "$LOG_DIR/build.log" | awk '{n += $1; c += $5} END {printf "%d kernels, %d compiled", n, c}')
if ((build_rc != 0)); then OTHER_FAILURES=1; fi
if [[ "$BUILD_FILTERS" == none ]]; then
    say "build:     skipped (SANITIZE_BUILD_FILTERS=none)"
else
    say "build:     rc=$build_rc, $built (filters: $BUILD_FILTERS) for $ARCH in $((SECONDS - t0)) s"
fi

# ---- 2. the cases without a sanitizer
PYTEST=("$PY" -m pytest "$CASES" -q -p no:cacheprovider -rfE --tb=short --durations=10 "${EXTRA_PYTEST[@]}")
t0=$SECONDS
timeout_s=$(step_timeout 240)
if ((timeout_s == 0)); then
    say "baseline:  SKIPPED (budget)"
    OTHER_FAILURES=1
else
    timeout --kill-after=15 "$timeout_s" "${PYTEST[@]}" --junitxml="$LOG_DIR/baseline.xml" >"$LOG_DIR/baseline.log" 2>&1
    rc=$?
    result=$(pytest_result "$LOG_DIR/baseline.log")
    if ((rc != 0)) || pytest_failed "$result"; then OTHER_FAILURES=1; fi
    ((rc == 124 || rc == 137)) && result="TIMEOUT after ${timeout_s} s; $result"
    say "baseline:  no sanitizer | pytest: $result | rc=$rc | $((SECONDS - t0)) s"
fi

# ---- 3. the sanitizers
for tool in $TOOLS; do
    upper=$(tr '[:lower:]' '[:upper:]' <<<"$tool")
    case $tool in
        memcheck) default_k=""; default_timeout=180 ;;
        racecheck) default_k="core"; default_timeout=150 ;;
        synccheck) default_k="core"; default_timeout=90 ;;
        initcheck) default_k="core"; default_timeout=120 ;;
        *) say "$tool: unknown tool"; OTHER_FAILURES=1; continue ;;
    esac
    k_var="SANITIZE_K_$upper" timeout_var="SANITIZE_TIMEOUT_$upper"
    k_expr=${!k_var-$default_k}
    timeout_s=$(step_timeout "${!timeout_var:-$default_timeout}")
    log="$LOG_DIR/$tool.log"
    if ((timeout_s == 0)); then
        say "$(printf '%-10s' "$tool:") SKIPPED (budget: $(remaining) s left)"
        OTHER_FAILURES=1
        continue
    fi
    opts=(--tool "$tool" "${COMMON_OPTS[@]}")
    env_vars=()
    case $tool in
        memcheck | initcheck)
            # One cudaMalloc per tensor: the sanitizer sees each tensor's bounds, where the caching
            # allocator would hand out pieces of one large block (an overrun inside it is invisible).
            env_vars+=(PYTORCH_NO_CUDA_MEMORY_CACHING=1)
            has_opt --padding && opts+=(--padding "$PADDING")
            ;;
        racecheck)
            has_opt --racecheck-report && opts+=(--racecheck-report all)
            # Under racecheck, PyTorch's cuBLAS GEMMs (the float32 references) stopped the run with
            # "Internal Sanitizer Error: failed to handle a hardware exception" on the H200: the
            # cases compute their references on the CPU instead (tests/gpu/sanitize_cases.py).
            env_vars+=(FLASHGEN_SANITIZE_CPU_REFERENCE=1)
            ;;
    esac
    # Options this compute-sanitizer rejects (they are probed from --help; a value may still be
    # refused) would waste the run: check them on a trivial program, and fall back to the basics.
    probe=$("$CS" "${opts[@]}" /bin/true 2>&1)
    if grep -qiE 'unrecognized|unknown option|invalid (option|value|argument)|usage:' <<<"$probe"; then
        echo "note: $tool options rejected ($(grep -m 1 -iE 'unrecognized|unknown|invalid|usage' <<<"$probe")); using the basic set" |
            tee -a "$SUMMARY"
        opts=(--tool "$tool" --target-processes all --error-exitcode 99)
    fi
    k_args=()
    [[ -n "$k_expr" ]] && k_args=(-k "$k_expr")
    t0=$SECONDS
    {
        echo "# $CS ${opts[*]} ${PYTEST[*]} ${k_args[*]}"
        echo "# env: ${env_vars[*]:-} (timeout ${timeout_s} s)"
    } >"$log"
    env "${env_vars[@]}" timeout --kill-after=15 "$timeout_s" \
        "$CS" "${opts[@]}" "${PYTEST[@]}" "${k_args[@]}" --junitxml="$LOG_DIR/$tool.xml" >>"$log" 2>&1
    rc=$?
    elapsed=$((SECONDS - t0))
    # One summary per process: "========= ERROR SUMMARY: 3 errors"; racecheck:
    # "========= RACECHECK SUMMARY: 2 hazards displayed (1 errors, 1 warnings)".
    summaries=$(grep -cE 'ERROR SUMMARY: [0-9]+ error|RACECHECK SUMMARY:' "$log")
    errors=$(grep -oE 'ERROR SUMMARY: [0-9]+ error' "$log" | grep -oE '[0-9]+' | awk '{n += $1} END {print n + 0}')
    race_errors=$(grep -oE 'RACECHECK SUMMARY: .*\([0-9]+ errors?, [0-9]+ warnings?\)' "$log" |
        sed -E 's/.*\(([0-9]+) errors?, ([0-9]+) warnings?\)/\1 \2/' | awk '{e += $1; w += $2} END {print e + 0, w + 0}')
    read -r race_e race_w <<<"$race_errors"
    if ((race_e > errors)); then errors=$race_e; fi
    detail=""
    [[ $tool == racecheck ]] && detail=" ($race_w warnings)"
    result=$(pytest_result "$log")
    status="$errors errors$detail"
    if ((rc == 124 || rc == 137)); then
        status="TIMEOUT after ${timeout_s} s, $errors errors so far$detail"
        OTHER_FAILURES=1
    elif ((summaries == 0)); then
        status="no sanitizer summary (rc=$rc): it did not finish"
        OTHER_FAILURES=1
    fi
    if ((errors > 0)) || ((rc == 99)); then SANITIZER_ERRORS=1; fi
    if pytest_failed "$result"; then OTHER_FAILURES=1; fi
    say "$(printf '%-10s' "$tool:") $status | pytest${k_expr:+ -k $k_expr}: $result | rc=$rc | $elapsed s | $log"
    if ((errors > 0)); then
        # The first reports, for a quick look; the log has them all.
        grep -m 6 -E '^=+ (Invalid|Error|Race|Barrier|Uninitialized|.*hazard|.*Hazard)' "$log" | sed 's/^/    /' | tee -a "$SUMMARY"
    fi
done

total=$((SECONDS - START))
if ((SANITIZER_ERRORS)); then
    say "RESULT: sanitizer errors (see above) in $total s"
    exit 1
elif ((OTHER_FAILURES)); then
    say "RESULT: no sanitizer errors, but something else failed (see above) in $total s"
    exit 2
fi
say "RESULT: clean in $total s"
exit 0
