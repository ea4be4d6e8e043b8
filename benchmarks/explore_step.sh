#!/usr/bin/env bash
# The next GPU call's questions (session 10), a short table last:
#   attn     benchmarks/attn_sweep.py: the decode attention kernel's device time per variant and context
#   run*     Protocol A at temp 0: as is (its decode steps traced into OUT/tr_run), with the ids' device-to-host
#            copy started at fetch instead of dispatch, and without collecting the routed expert ids
#   bash benchmarks/explore_step.sh OUTDIR
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench-out}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
start=$(date +%s)
left() { (( $(date +%s) - start < ${1:-470} )); }
echo "attn 0s"; timeout 200 python3 benchmarks/attn_sweep.py > "$out/attn.log" 2>&1
off() { local label=$1; shift; left 420 || return; echo "$label $(( $(date +%s) - start ))s"
        timeout 120 python3 benchmarks/offline.py --buckets 32,16384 --runs 2 --temperatures 0 "$@" > "$out/$label.log" 2>&1; }
off run --trace "$out/tr_run"
off run_latecopy --no-early-copy
off run_norouting --routing off
echo "done $(( $(date +%s) - start ))s"
echo "== summary =="
grep -h -A60 "^| context" "$out/attn.log"
for l in run run_latecopy run_norouting; do
  [[ -f $out/$l.log ]] || continue
  echo "-- $l"; grep -h -E "Protocol A|prefill [0-9]|engine loop|device over" "$out/$l.log" | cut -c1-200
done
