#!/usr/bin/env bash
# Session 11's MoE question, a short table last (calls 2-3; call 4's wider shared-expert programs were taken out):
#   one / two   the two expert kernels in one launch or two (RunnerConfig.moe_single_launch), batch 32, one traced
#   then        Protocol A and the GPU-vs-CPU greedy check at the defaults
#   bash benchmarks/explore_moe.sh OUTDIR
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench-out}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
start=$(date +%s)
left() { (( $(date +%s) - start < ${1:-480} )); }
quiet() { grep -v -E "^\s*$|Warning|warn|^[WI][0-9]{4} " ; }
sp() { local label=$1; shift; left || return; echo "$label $(( $(date +%s) - start ))s"
       timeout 100 python3 benchmarks/step_profile.py --label "$label" "$@" 2>&1 | quiet > "$out/step_$label.log"; }
sp one --trace /tmp/tr_one
sp two --no-moe-single-launch
left 330 && { echo "protocol_a $(( $(date +%s) - start ))s"; timeout 150 python3 benchmarks/offline.py --buckets 32,16384 \
  > "$out/protocol_a.log" 2>&1; }
left 420 && { echo "gpu_vs_cpu $(( $(date +%s) - start ))s"; timeout 150 python3 benchmarks/gpu_vs_cpu.py \
  --check benchmarks/data/gpu_vs_cpu_expected.json > "$out/gpu_vs_cpu.log" 2>&1; }
echo "done $(( $(date +%s) - start ))s"
echo "== summary =="
for l in one two; do
  [[ -f $out/step_$l.log ]] || continue
  echo "$l: $(grep -h -E "pipelined via compiled" "$out/step_$l.log") | $(grep -h -E "GPU kernel time" "$out/step_$l.log")"
done
grep -h -A4 "one layer" "$out/step_one.log" | head -4
grep -h -E "Protocol A|prefill [0-9]" "$out/protocol_a.log" | cut -c1-220
grep -h -E "^\| GPU" "$out/gpu_vs_cpu.log"
