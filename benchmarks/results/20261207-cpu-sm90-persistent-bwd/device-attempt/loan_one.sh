#!/bin/bash
# one call: the persistent backward's build, GPU tests, A/B, then as much of the backward tier as fits
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 FLASHGEN_CACHE_DIR=/tmp/fgcache
S=$SECONDS
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader > $OUT/gpu.txt
timeout 100 python -m flashgen build -j 15 --arch sm_90a --filter bwd > $OUT/build_bwd.txt 2>&1; echo "build bwd rc=$? $((SECONDS-S)) s"
timeout 130 python -m pytest -q -x tests/gpu/test_sm90.py -k "persistent or bwd_causal_chunked or test_sm90_bwd" -p no:cacheprovider > $OUT/t_persistent.txt 2>&1; echo "tests rc=$? $((SECONDS-S)) s"; tail -2 $OUT/t_persistent.txt
timeout 170 python benchmarks/tune_bwd_sm90.py --graph --head-dims 64,128,192,256 --seqlens 1024,4096,16384 --rounds 2 \
  --variants default tuning.bwd_persistent_masked=False tuning.bwd_persistent=False > $OUT/ab_persistent.txt 2>&1; echo "ab rc=$? $((SECONDS-S)) s"
grep -A30 "median of" $OUT/ab_persistent.txt
left=$((530-SECONDS+S))
timeout $left python -m pytest -q -p no:cacheprovider tests/gpu/test_bwd.py tests/gpu/test_varlen.py tests/gpu/test_dropout.py tests/gpu/test_odd_head_dims.py \
  -k "bwd or grad or dropout or deterministic" > $OUT/t_bwd.txt 2>&1; echo "bwd tier rc=$? $((SECONDS-S)) s"; tail -2 $OUT/t_bwd.txt
grep -h "^FAILED" $OUT/t_*.txt | head
