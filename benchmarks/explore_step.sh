#!/usr/bin/env bash
# One GPU call: the prefill step with the split attention (expanded chunk + absorbed context) against
# all-absorbed, then the correctness check and Protocol A / B through gpu.sh, a short table last.
#   bash benchmarks/explore_step.sh OUTDIR
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench-out}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
quiet() { grep -v -E "^\s*$|Warning|warn|^W[0-9]{4} " ; }
sp() { timeout 120 python3 benchmarks/step_profile.py "$@" 2>&1 | quiet; }
sp --label prefill_expanded --prefill 512 --batch 16 --context 0 --trace /tmp/trp > "$out/prefill.log"
sp --label prefill_absorbed --prefill 512 --batch 16 --context 0 --prefill-attention absorbed >> "$out/prefill.log"
PARTS="gpu_vs_cpu protocol_a protocol_b" timeout 320 bash benchmarks/gpu.sh "$out" > "$out/gpu.log" 2>&1
echo "== summary =="
grep -h -E "^[a-z_0-9]+: |pipelined via comp|\[MLA|_kernel" "$out/prefill.log" | head -20
sed -n '/== summary ==/,$p' "$out/gpu.log"
