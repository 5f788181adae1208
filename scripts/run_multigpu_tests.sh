#!/usr/bin/env bash
# The multi-GPU tier (pytest -m multigpu: ring attention over NCCL), one process per GPU, then
# optionally the weak-scaling benchmark.
#
#   scripts/run_multigpu_tests.sh [NPROC]     (default NPROC: every visible GPU)
#
# Knobs (environment):
#   MULTIGPU_PYTEST_ARGS  extra pytest arguments (e.g. "-x -k varlen")
#   MULTIGPU_BENCH        1: also run benchmarks/bench_ring.py on NPROC GPUs
set -u -o pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
NPROC=${1:-$(python -c "import torch; print(torch.cuda.device_count())")}
if [ "$NPROC" -lt 2 ]; then
    echo "run_multigpu_tests.sh: needs >= 2 GPUs (NPROC=$NPROC)" >&2
    exit 1
fi
# NVLink multicast (NVLS) must stay off on the lent machines.
export NCCL_NVLS_ENABLE=0

status=0
# shellcheck disable=SC2086
torchrun --standalone --nproc-per-node="$NPROC" -m pytest -q -p no:cacheprovider -m multigpu \
    tests/gpu/test_parallel_multigpu.py ${MULTIGPU_PYTEST_ARGS:-} || status=1
if [ "${MULTIGPU_BENCH:-0}" = 1 ]; then
    torchrun --standalone --nproc-per-node="$NPROC" benchmarks/bench_ring.py || status=1
fi
exit $status
