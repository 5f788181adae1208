#!/usr/bin/env bash
# With pipelined_step.patch applied (the pipelined step the default at d64/d128): the backward's
# GPU tests, then its A/B against the fused step and with three stages at d128. About 9 minutes on
# one GPU; `tests` or `ab` as the argument runs one half.
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1 FLASHGEN_CACHE_DIR=${FLASHGEN_CACHE_DIR:-/tmp/fgcache}
OUT=${OUT:-.}
T0=$SECONDS
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
for d in bwd bwd_pre bwd_post; do timeout 120 python -m flashgen build -j 16 --arch sm_90a --direction $d 2>&1 | tail -1; done
echo "== build done at $((SECONDS - T0)) s"
if [ "${1:-all}" != ab ]; then
  python -m pytest -q tests/gpu/test_sm90.py tests/gpu/test_bwd.py tests/gpu/test_varlen.py tests/gpu/test_dropout.py \
    tests/gpu/test_odd_head_dims.py -k "bwd or grad or dropout or deterministic" -p no:cacheprovider 2>&1 | tee $OUT/tests.txt | tail -8
  echo "== tests done at $((SECONDS - T0)) s"
fi
if [ "${1:-all}" != tests ]; then
  python benchmarks/tune_bwd_sm90.py --graph --jobs 14 --head-dims 128,64 --seqlens 1024,4096,16384 --rounds 2 \
    --variants default tile.128.pipelined=0+tile.64.pipelined=0 tile.128.stages=3 2>&1 | tee $OUT/ab_pipelined.txt | tail -30
fi
echo "== all done at $((SECONDS - T0)) s"
