#!/usr/bin/env bash
# One GPU call of MoE launch-order experiments (each part a fresh process), a short table last:
#   moe       the MoE kernels at 32 and 8,192 tokens: row blocks or column tiles launched first, rows
#             gathered by XLA or inside the gate_up kernel, a few tiles
#   prefill   a 16 x 512 prefill step (defaults: column tiles first at prefill sizes)
#   engine    Protocol A at temperature 0
#   bash benchmarks/explore_step.sh OUTDIR
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench-out}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
quiet() { grep -v -E "^\s*$|Warning|warn|^W[0-9]{4} " ; }
timeout 240 python3 benchmarks/kernels.py --only moe --moe-tokens 32,8192 2>&1 | quiet > "$out/moe.log"
timeout 150 python3 benchmarks/step_profile.py --label prefill --prefill 512 --batch 16 --context 0 2>&1 | quiet \
  > "$out/prefill.log"
timeout 300 python3 benchmarks/offline.py --buckets 32,8192 --temperatures 0 2>&1 | quiet > "$out/engine.log"
echo "== summary =="
grep -h "^| " "$out/moe.log"
grep -h -E "^[a-z_0-9]+: |pipelined via comp" "$out/prefill.log"
grep -h -E "Protocol A|engine loop|start-up|prefill [0-9]" "$out/engine.log"
