#!/usr/bin/env bash
# Session 11's question for the decode step, a short table last:
#   latent / base   RunnerConfig.decode_latent_kernel: the absorb kernel's launch also norms, ropes and caches the
#                   step's latents (XLA: three kernels, 5.9 us a layer); traced, one layer printed
#   then            with it: the GPU-vs-CPU greedy check and Protocol A
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
sp latent --decode-latent-kernel --trace /tmp/tr_latent
sp base
left 300 && { echo "gpu_vs_cpu $(( $(date +%s) - start ))s"; timeout 150 python3 benchmarks/gpu_vs_cpu.py \
  --check benchmarks/data/gpu_vs_cpu_expected.json --decode-latent-kernel > "$out/gpu_vs_cpu_latent.log" 2>&1; }
left 380 && { echo "protocol_a $(( $(date +%s) - start ))s"; timeout 150 python3 benchmarks/offline.py --buckets 32,16384 \
  --decode-latent-kernel > "$out/protocol_a_latent.log" 2>&1; }
echo "done $(( $(date +%s) - start ))s"
echo "== summary =="
for l in latent base; do
  [[ -f $out/step_$l.log ]] || continue
  echo "$l: $(grep -h -E "pipelined via compiled" "$out/step_$l.log") | $(grep -h -E "GPU kernel time" "$out/step_$l.log")"
done
grep -h -A16 "one layer" "$out/step_latent.log" | head -17
grep -h -E "^\| GPU" "$out/gpu_vs_cpu_latent.log"
grep -h -E "Protocol A|prefill [0-9]" "$out/protocol_a_latent.log" | cut -c1-220
