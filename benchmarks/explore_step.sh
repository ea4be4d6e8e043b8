#!/usr/bin/env bash
# The next GPU call's questions (session 10), a short table last:
#   attn     benchmarks/attn_sweep.py: the decode attention's key blocks, prefetched page ids and pipeline stages
#            over batch 1-128 and context 256-16K
#   run*     Protocol A at temp 0 with and without gc.freeze() after start-up, the collections' pauses printed
#   bash benchmarks/explore_step.sh OUTDIR
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench-out}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
start=$(date +%s)
left() { (( $(date +%s) - start < ${1:-470} )); }
echo "attn 0s"; timeout 300 python3 benchmarks/attn_sweep.py --cases 32x256,32x640,32x768,8x4096,64x2048,128x1024,1x16384 \
  --variants base,bk32_pf_s3,bk32_pf_s4,bk32_pf_s3_w8,bk16_pf_s3,bk16_pf_s4,bk16_pf_s6,bk32_pf_s3_x2 > "$out/attn.log" 2>&1
off() { local label=$1; shift; left 440 || return; echo "$label $(( $(date +%s) - start ))s"
        timeout 100 python3 benchmarks/offline.py --buckets 32,16384 --runs 2 --temperatures 0 "$@" > "$out/$label.log" 2>&1; }
off run
off run_gcfreeze --gc-freeze
echo "done $(( $(date +%s) - start ))s"
echo "== summary =="
grep -h -A70 "^| batch" "$out/attn.log"
for l in run run_gcfreeze; do
  [[ -f $out/$l.log ]] || continue
  echo "-- $l"; grep -h -E "Protocol A|prefill [0-9]|engine loop|garbage" "$out/$l.log" | cut -c1-200
done
