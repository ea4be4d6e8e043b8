#!/usr/bin/env bash
# Where a cold start's time goes, and what XLA's GEMM autotuning buys: `offline.py` (Protocol A's two
# step programs) on a fresh compilation cache at each autotune level, with the throughput it then runs
# at. On an empty cache `serve`'s 16 programs took 170 s to compile, mostly autotuning timed on the
# device by all compile threads at once (benchmarks/RESULTS.md, session 5); if a lower level keeps the
# speed, the start gets cheaper without shipping tuned results.
#   bash benchmarks/explore_start.sh OUTDIR            (LEVELS: XLA autotune levels, default "4 2 0")
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench-out}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
for lvl in ${LEVELS:-4 2 0}; do
  DEEPINFER_CACHE_DIR=$(mktemp -d) XLA_FLAGS="--xla_gpu_autotune_level=$lvl" timeout 150 python3 \
    benchmarks/offline.py --buckets 32,16384 --runs 1 --temperatures 0 > "$out/autotune_$lvl.log" 2>&1
done
echo "== summary =="
for lvl in ${LEVELS:-4 2 0}; do
  echo "-- --xla_gpu_autotune_level=$lvl"
  grep -h -E "start-up|prefill [0-9]|Protocol A" "$out/autotune_$lvl.log" | cut -c1-150
done
