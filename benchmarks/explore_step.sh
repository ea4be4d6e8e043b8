#!/usr/bin/env bash
# The next GPU call's questions (written in session 10 after its device time ran out), a short table last:
#   router / base   kernels/residual_router.py (RunnerConfig.decode_router_kernel, off by default): o_proj's
#                   split-K partials, the residual add, the post-attention RMSNorm and the router's logits in one
#                   kernel instead of XLA's four (7.2 us a layer in session 10's trace); traced, one layer printed
#   then            with it: Protocol A (temp 0 and 1) and the GPU-vs-CPU greedy check
#   bash benchmarks/explore_step.sh OUTDIR
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench-out}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
start=$(date +%s)
left() { (( $(date +%s) - start < ${1:-480} )); }
quiet() { grep -v -E "^\s*$|Warning|warn|^[WI][0-9]{4} " ; }
sp() { local label=$1; shift; left || return; echo "$label $(( $(date +%s) - start ))s"
       timeout 100 python3 benchmarks/step_profile.py --label "$label" "$@" 2>&1 | quiet > "$out/step_$label.log"; }
sp router --decode-router-kernel --trace /tmp/tr_router
sp base --trace /tmp/tr_base
sp router2 --decode-router-kernel
left 330 && { echo "protocol_a $(( $(date +%s) - start ))s"; timeout 150 python3 benchmarks/offline.py --buckets 32,16384 \
  --decode-router-kernel > "$out/protocol_a_router.log" 2>&1; }
left 420 && { echo "gpu_vs_cpu $(( $(date +%s) - start ))s"; timeout 150 python3 benchmarks/gpu_vs_cpu.py \
  --check benchmarks/data/gpu_vs_cpu_expected.json --decode-router-kernel > "$out/gpu_vs_cpu_router.log" 2>&1; }
echo "done $(( $(date +%s) - start ))s"
echo "== summary =="
for l in router base router2; do
  [[ -f $out/step_$l.log ]] || continue
  echo "$l: $(grep -h -E "pipelined via compiled" "$out/step_$l.log") | $(grep -h -E "GPU kernel time" "$out/step_$l.log")"
done
grep -h -A20 "one layer" "$out/step_router.log" | head -21
grep -h -E "Protocol A|prefill [0-9]|engine loop" "$out/protocol_a_router.log" | cut -c1-220
grep -h -E "^\| GPU" "$out/gpu_vs_cpu_router.log"
