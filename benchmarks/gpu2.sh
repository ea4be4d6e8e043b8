#!/usr/bin/env bash
# The two-GPU measurements of the sharding issue, in one command (on the nvidia-h200-x2 machine):
# bf16 equality of TP=2 and DP=2 x EP=2 against one GPU, communication time per decode step from a
# trace, and Protocol A for one GPU, TP=2 and DP=2 x EP=2.   bash benchmarks/gpu2.sh OUTDIR
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench-out}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
py() { log=$1; shift; timeout 260 python3 "$@" > "$out/$log" 2>&1; grep -E "^\||device step|GPU kernel|collectives|GPUs traced|Protocol A|prefill [0-9]|start-up|compiles" "$out/$log"; }
py sharded_check.log benchmarks/sharded_check.py --layouts tp2,dp2ep2
py profile_tp2.log benchmarks/step_profile.py --tensor-parallel-size 2 --trace /tmp/tr_tp2
py profile_dp2ep2.log benchmarks/step_profile.py --data-parallel-size 2 --enable-expert-parallel --trace /tmp/tr_dp
for layout in "" "--tensor-parallel-size 2" "--data-parallel-size 2 --enable-expert-parallel"; do
  name=$(echo "pa $layout" | tr -d ' -' ); py "$name.log" benchmarks/offline.py --buckets 32,8192 --runs 1 --temperatures 0 $layout
done
