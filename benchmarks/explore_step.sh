#!/usr/bin/env bash
# The next GPU call's questions (session 10), a short table last:
#   new / old  the isolated step with the decode attention's new defaults (32-key blocks, page ids a step ahead,
#              three stages; traced) and with the old ones (whole pages, two stages)
#   then       Protocol A (temp 0 and 1) and the GPU-vs-CPU greedy check at this code
#   bash benchmarks/explore_step.sh OUTDIR
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench-out}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
start=$(date +%s)
quiet() { grep -v -E "^\s*$|Warning|warn|^[WI][0-9]{4} " ; }
sp() { local label=$1; shift; echo "$label $(( $(date +%s) - start ))s"
       timeout 100 python3 benchmarks/step_profile.py --label "$label" "$@" 2>&1 | quiet > "$out/step_$label.log"; }
sp new --trace /tmp/tr_new
sp old --attn-kernel num_stages=2,prefetch_ids=0,block_keys=64
sp new2
echo "protocol_a $(( $(date +%s) - start ))s"
timeout 150 python3 benchmarks/offline.py --buckets 32,16384 --json "$out/protocol_a.json" > "$out/protocol_a.log" 2>&1
echo "gpu_vs_cpu $(( $(date +%s) - start ))s"
timeout 150 python3 benchmarks/gpu_vs_cpu.py --check benchmarks/data/gpu_vs_cpu_expected.json > "$out/gpu_vs_cpu.log" 2>&1
echo "done $(( $(date +%s) - start ))s"
echo "== summary =="
for l in new old new2; do grep -h -E "^$l:|pipelined via compiled" "$out/step_$l.log" | sed -E 's/TP=1.*: device/: device/' | tr '\n' ' '; echo; done
grep -h -A20 "one layer" "$out/step_new.log" | head -21
grep -h -E "Protocol A|prefill [0-9]|start-up|engine loop" "$out/protocol_a.log" | cut -c1-220
grep -h -E "^\| GPU" "$out/gpu_vs_cpu.log"
