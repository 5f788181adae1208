#!/usr/bin/env bash
# ncu of each backward's kernels, flashgen against FA4, on the shapes furthest below FA4; then the
# same shapes' graph-replay ratios in one process. Needs FA4 installed (source .peers/c/install.sh).
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1 FLASHGEN_CACHE_DIR=/tmp/fgcache
T0=$SECONDS
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
echo "ncu: $NCU"
SECTIONS="--section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats --section InstructionStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis"
mkdir -p /tmp/ncu
for shape in "64 1024 --causal" "192 1024 --causal" "192 4096" "128 1024 --causal"; do
  set -- $shape; d=$1; s=$2; c=${3:-}
  for impl in flashgen fa4; do
    name=${impl}_d${d}_s${s}${c:+_causal}
    timeout 120 $NCU --clock-control none --profile-from-start off $SECTIONS -f -o /tmp/ncu/$name \
      python3 benchmarks/profile_bwd_once.py --impl $impl --head-dim $d --seqlen $s $c --profile-range > /tmp/ncu/$name.log 2>&1
    echo "== $name rc=$? at $((SECONDS - T0)) s"; tail -2 /tmp/ncu/$name.log
    $NCU --import /tmp/ncu/$name.ncu-rep --page details --print-units base >> $OUT/ncu_details.txt 2>&1
    $NCU --import /tmp/ncu/$name.ncu-rep --page raw --csv --metrics gpu__time_duration.sum,smsp__cycles_active.avg,sm__throughput.avg.pct_of_peak_sustained_elapsed,smsp__inst_executed.sum,smsp__average_warp_latency_issue_stalled_barrier,smsp__average_warp_latency_issue_stalled_long_scoreboard >> $OUT/ncu_raw.csv 2>&1
  done
done
echo "ncu done at $((SECONDS - T0)) s"
timeout 150 python3 benchmarks/bench_bwd_peers.py --graph --head-dims 64,192,128 --seqlens 1024,4096 --gqa 1 --impls flashgen,fa4,cudnn --out $OUT/peers_graph.json 2>&1 | tail -20
echo "round done at $((SECONDS - T0)) s"
