#!/usr/bin/env bash
# One GPU call: the decode step with the MoE kernels' pipeline depth at decode sizes (3, 4, 5 stages),
# and a 16 x 512 prefill step (router GEMM on bf16 operands), a short table last.
#   bash benchmarks/explore_step.sh OUTDIR
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench-out}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
quiet() { grep -v -E "^\s*$|Warning|warn|^W[0-9]{4} " ; }
sp() { timeout 150 python3 benchmarks/step_profile.py "$@" 2>&1 | quiet; }
sp --label prefill --prefill 512 --batch 16 --context 0 > "$out/prefill.log"
sp --label stages3 > "$out/decode.log"
sp --label stages4 --moe-decode-tiles 16,128,64,4,4 >> "$out/decode.log"
sp --label stages5 --moe-decode-tiles 16,128,64,4,5 >> "$out/decode.log"
echo "== summary =="
grep -h -E "^[a-z_0-9]+: |pipelined via comp" "$out/prefill.log" "$out/decode.log"
