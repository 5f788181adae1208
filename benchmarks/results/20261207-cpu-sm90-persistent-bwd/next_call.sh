#!/bin/bash
# One device call for the persistent backward's hang (run from the repository root with
# persistent_bwd.patch applied; carry nothing). The plain build hangs at one work item per CTA
# (d64 b2 sq255 h4, and every case tried); a printf watchdog build did not (it serialized the
# wgmma). So: read the hung warps' PCs with cuda-gdb, the waits that the recorder watchdog gives up
# on, then bisect the patch's two changes with the debug defines, each case in its own process
# under a kill timeout.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD FLASHGEN_CACHE_DIR=/tmp/fgcache
R=benchmarks/results/20261207-cpu-sm90-persistent-bwd
S=$SECONDS
for f in sm90_hdim64_bf16_sm90a bwd_pre_sm80_bf16 bwd_post_sm80_bf16; do
  for v in "" "-DFLASHGEN_BWD_SM90_DEBUG_STAGE_IN_KV=1" "-DFLASHGEN_BWD_SM90_DEBUG_NO_SLOTS=1" \
           "-DFLASHGEN_BWD_SM90_DEBUG_STAGE_IN_KV=1 -DFLASHGEN_BWD_SM90_DEBUG_NO_SLOTS=1" "-DFLASHGEN_MBAR_WATCHDOG_MS=2000"; do
    FLASHGEN_NVRTC_EXTRA_OPTIONS="$v" timeout 120 python -m flashgen build --arch sm_90a --filter $f -j 2 > /dev/null 2>&1 &
  done
done
wait; echo "built at $((SECONDS-S)) s"
# 1. The plain build, hung: every warp's PC on the SM of block 0, then block 1's (cuda-gdb attach).
python $R/debug_one.py d64_one 200 > $OUT/plain.txt 2>&1 & PID=$!
sleep 20
timeout 60 cuda-gdb -p $PID -batch -ex "info cuda kernels" -ex "cuda block (0,0,0) thread (0,0,0)" -ex "info cuda warps" \
  -ex "cuda block (1,0,0) thread (0,0,0)" -ex "info cuda warps" -ex "info cuda lanes" > $OUT/gdb.txt 2>&1
echo "gdb rc=$? at $((SECONDS-S)) s"; grep -i "pc\|warp" $OUT/gdb.txt | head -40
kill -9 $PID 2>/dev/null; wait $PID 2>/dev/null
tar czf $OUT/cubins.tgz -C /tmp/fgcache flash_bwd_sm90_hdim64_bf16_sm90a  # every variant, with its .json (options)
# 2. The recorder watchdog (no printf, so the wgmma stay async): waits that give up after 2 s, and
# the bisection: which of the patch's changes hangs at one item a CTA.
for v in "-DFLASHGEN_MBAR_WATCHDOG_MS=2000" "-DFLASHGEN_BWD_SM90_DEBUG_STAGE_IN_KV=1" "-DFLASHGEN_BWD_SM90_DEBUG_NO_SLOTS=1" \
         "-DFLASHGEN_BWD_SM90_DEBUG_STAGE_IN_KV=1 -DFLASHGEN_BWD_SM90_DEBUG_NO_SLOTS=1"; do
  FLASHGEN_NVRTC_EXTRA_OPTIONS="$v" timeout -s KILL 40 python $R/debug_one.py d64_one 35 > /tmp/o.txt 2>&1
  echo "[$v rc=$? at $((SECONDS-S)) s]"; grep -v 'ptxas info' /tmp/o.txt | grep -v "^  File\|^    " | head -30; (echo "== $v"; cat /tmp/o.txt) >> $OUT/bisect.txt
done
# 3. synccheck on the plain build (a hang stays a hang: under a kill timeout).
timeout -s KILL 90 compute-sanitizer --tool synccheck python $R/debug_one.py d64_one 80 > $OUT/synccheck.txt 2>&1
echo "synccheck rc=$? at $((SECONDS-S)) s"; grep -v "ptxas info" $OUT/synccheck.txt | tail -15
