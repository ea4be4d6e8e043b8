#!/usr/bin/env bash
# The next GPU call's questions (session 10), a short table last:
#   base / onechunk   the step with the sampler's categorical draw in 1,024-id argmax chunks, and as one argmax
#   conc / region     XLA's command buffers as a DAG of the commands' buffer dependencies
#                     (--xla_gpu_command_buffer_scheduling_mode=CONCURRENT) instead of the scheduler's order,
#                     and the older concurrent-region flag: do a layer's independent kernels overlap?
#   then              with CONCURRENT: Protocol A (temp 0) and the GPU-vs-CPU greedy check
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
sp base --trace /tmp/tr_base
sp onechunk --argmax-chunk 1000000 --trace /tmp/tr_one
CONC=--xla_gpu_command_buffer_scheduling_mode=CONCURRENT
XLA_FLAGS=$CONC sp conc --trace /tmp/tr_conc
XLA_FLAGS=--xla_gpu_graph_enable_concurrent_region=true sp region
left 330 && { echo "protocol_a $(( $(date +%s) - start ))s"; XLA_FLAGS=$CONC timeout 120 python3 benchmarks/offline.py \
  --buckets 32,16384 --temperatures 0 > "$out/protocol_a_conc.log" 2>&1; }
left 420 && { echo "gpu_vs_cpu $(( $(date +%s) - start ))s"; XLA_FLAGS=$CONC timeout 150 python3 benchmarks/gpu_vs_cpu.py \
  --check benchmarks/data/gpu_vs_cpu_expected.json > "$out/gpu_vs_cpu_conc.log" 2>&1; }
echo "done $(( $(date +%s) - start ))s"
echo "== summary =="
for l in base onechunk conc region; do
  [[ -f $out/step_$l.log ]] || continue
  echo "$l: $(grep -h -E "pipelined via compiled" "$out/step_$l.log") | $(grep -h -E "device over|GPU kernel time" "$out/step_$l.log" | tr '\n' ' ')"
done
grep -h -E "us/step +x +1 " "$out/step_base.log" | head -3
grep -h -E "us/step +x +1 " "$out/step_onechunk.log" | head -3
grep -h -A20 "one layer" "$out/step_conc.log" | head -21
grep -h -E "Protocol A|prefill [0-9]|engine loop" "$out/protocol_a_conc.log" | cut -c1-220
grep -h -E "^\| GPU" "$out/gpu_vs_cpu_conc.log"
