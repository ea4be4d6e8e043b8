#!/usr/bin/env bash
# The next GPU call's questions (session 10), a short table last:
#   t_*   the MoE kernels' decode tiles at batch 32 (block_m, block_n, block_k, warps, stages; block_n is halved to
#         128 for the gate_up kernel's I = 1,408): fewer stages or smaller K steps leave room for two programs
#         an SM, whose pipelines fill while the other's drains
#   bash benchmarks/explore_step.sh OUTDIR
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench-out}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
start=$(date +%s)
left() { (( $(date +%s) - start < ${1:-500} )); }
quiet() { grep -v -E "^\s*$|Warning|warn|^[WI][0-9]{4} " ; }
sp() { local label=$1; shift; left || return; echo "$label $(( $(date +%s) - start ))s"
       timeout 100 python3 benchmarks/step_profile.py --label "$label" "$@" --trace /tmp/tr_$label 2>&1 | quiet > "$out/step_$label.log"; }
sp t_base
sp t_s3 --moe-decode-tiles 16,256,64,4,3
sp t_k32s6 --moe-decode-tiles 16,256,32,4,6
sp t_k32s4 --moe-decode-tiles 16,256,32,4,4
sp t_w8s3 --moe-decode-tiles 16,256,64,8,3
sp t_k128s2 --moe-decode-tiles 16,256,128,4,2
sp t_n512s3 --moe-decode-tiles 16,512,64,4,3
sp t_base2
echo "done $(( $(date +%s) - start ))s"
echo "== summary =="
for l in t_base t_s3 t_k32s6 t_k32s4 t_w8s3 t_k128s2 t_n512s3 t_base2; do
  [[ -f $out/step_$l.log ]] || continue
  echo "$l: $(grep -h -E "pipelined via compiled" "$out/step_$l.log") | $(grep -h -E "us/step +x +26 +_(gate_up|down)_kernel" "$out/step_$l.log" | awk '{print $1, $5}' | tr '\n' ' ')"
done
