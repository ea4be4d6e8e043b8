#!/usr/bin/env bash
# The next GPU call's questions (written in session 11 after its device time ran out), a short table last:
#   all / base      RunnerConfig.decode_oproj_launch (o_proj in the output kernel's launch, its weight tiles loaded
#                   while the merge runs), RunnerConfig.moe_combine_in_launch (the single MoE launch also combines
#                   the expert rows and adds the residual) and RunnerConfig.decode_route_launch (o_proj's partials to
#                   the routing in one launch), all off by default; traced, one layer printed
#   oproj, combine, route   each alone; oproj8: o_proj's launch at 8 warps (its programs hold 64 KB of weight tiles)
#   then            with all three: the GPU-vs-CPU greedy check and Protocol A
#   bash benchmarks/explore_next.sh OUTDIR
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench-out}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
start=$(date +%s)
left() { (( $(date +%s) - start < ${1:-480} )); }
quiet() { grep -v -E "^\s*$|Warning|warn|^[WI][0-9]{4} " ; }
sp() { local label=$1; shift; left || return; echo "$label $(( $(date +%s) - start ))s"
       timeout 100 python3 benchmarks/step_profile.py --label "$label" "$@" 2>&1 | quiet > "$out/step_$label.log"; }
all=(--decode-oproj-launch --moe-combine-in-launch --decode-route-launch)
sp all "${all[@]}" --trace /tmp/tr_all
sp base
sp oproj --decode-oproj-launch
sp combine --moe-combine-in-launch
sp route --decode-route-launch
sp oproj8 --decode-oproj-launch --oproj-kernel num_warps=8
left 300 && { echo "gpu_vs_cpu $(( $(date +%s) - start ))s"; timeout 150 python3 benchmarks/gpu_vs_cpu.py \
  --check benchmarks/data/gpu_vs_cpu_expected.json "${all[@]}" > "$out/gpu_vs_cpu_all.log" 2>&1; }
left 380 && { echo "protocol_a $(( $(date +%s) - start ))s"; timeout 150 python3 benchmarks/offline.py --buckets 32,16384 \
  "${all[@]}" > "$out/protocol_a_all.log" 2>&1; }
echo "done $(( $(date +%s) - start ))s"
echo "== summary =="
for l in all base oproj combine route oproj8; do
  [[ -f $out/step_$l.log ]] || continue
  echo "$l: $(grep -h -E "pipelined via compiled" "$out/step_$l.log") | $(grep -h -E "GPU kernel time" "$out/step_$l.log")"
done
grep -h -A14 "one layer" "$out/step_all.log" | head -15
grep -h -E "^\| GPU" "$out/gpu_vs_cpu_all.log"
grep -h -E "Protocol A|prefill [0-9]" "$out/protocol_a_all.log" | cut -c1-220
