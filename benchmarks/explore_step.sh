#!/usr/bin/env bash
# The next GPU call's questions (session 9), a short table last:
#   absorb   kernels/mla_absorb.py, now with the query's RoPE: the decode query absorbed through W_UK and its
#            rope part rotated in one kernel against XLA's pad + GEMM + RoPE (--no-decode-absorb-kernel)
#   then     Protocol A and the GPU-vs-CPU greedy check at this code
#   bash benchmarks/explore_step.sh OUTDIR
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench-out}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
quiet() { grep -v -E "^\s*$|Warning|warn|^[WI][0-9]{4} " ; }
sp() { local label=$1; shift; timeout 110 python3 benchmarks/step_profile.py --label "$label" "$@" 2>&1 | quiet > "$out/step_$label.log"; }
sp new --trace /tmp/tr_new
sp noabsorb --no-decode-absorb-kernel
sp new2
timeout 150 python3 benchmarks/offline.py --buckets 32,16384 --json "$out/protocol_a.json" > "$out/protocol_a.log" 2>&1
timeout 120 python3 benchmarks/gpu_vs_cpu.py --check benchmarks/data/gpu_vs_cpu_expected.json > "$out/gpu_vs_cpu.log" 2>&1
echo "== summary =="
for l in new noabsorb new2; do grep -h -E "^$l:|pipelined via compiled" "$out/step_$l.log" | sed -E 's/TP=1.*: device/: device/' | tr '\n' ' '; echo; done
grep -h -A20 "one layer" "$out/step_new.log" | head -21
grep -h -E "Protocol A|prefill [0-9]|start-up" "$out/protocol_a.log" | cut -c1-220
grep -h -E "^\| GPU" "$out/gpu_vs_cpu.log"
