#!/usr/bin/env bash
# The next GPU call's questions (session 10), a short table last:
#   base     the isolated step at HEAD, traced (one layer's kernels)
#   run      Protocol A at temp 0, one run, its decode steps traced: are the kernels slower inside the engine
#            (cache size, routing), and how many 16-row expert blocks does real routing make
#   big      the isolated step with an engine-sized KV cache (43,000 pages)
#   bk*/s*   the decode attention: 32-key blocks (half pages) with 2 or 3 stages, 8 splits
#   bash benchmarks/explore_step.sh OUTDIR
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench-out}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
start=$(date +%s)
left() { (( $(date +%s) - start < ${1:-470} )); }
quiet() { grep -v -E "^\s*$|Warning|warn|^[WI][0-9]{4} " ; }
sp() { local label=$1; shift; left || return; echo "$label $(( $(date +%s) - start ))s"
       timeout 100 python3 benchmarks/step_profile.py --label "$label" "$@" 2>&1 | quiet > "$out/step_$label.log"; }
sp base --trace /tmp/tr_base
left 300 && { echo "run $(( $(date +%s) - start ))s"; timeout 150 python3 benchmarks/offline.py --buckets 32,16384 \
  --runs 1 --temperatures 0 --trace /tmp/tr_run > "$out/run.log" 2>&1; }
sp big --num-pages 43000
sp bk32 --attn-block-keys 32 --trace /tmp/tr_bk32
sp s8 --attn-splits 8 --trace /tmp/tr_s8
sp bk32s3 --attn-block-keys 32 --attn-kernel num_stages=3 --trace /tmp/tr_bk32s3
sp s8bk32 --attn-splits 8 --attn-block-keys 32 --trace /tmp/tr_s8bk32
echo "done $(( $(date +%s) - start ))s"
echo "== summary =="
for l in base big bk32 s8 bk32s3 s8bk32; do
  [[ -f $out/step_$l.log ]] || continue
  grep -h -E "^$l:|pipelined via compiled" "$out/step_$l.log" | sed -E 's/TP=1.*: device/: device/' | tr '\n' ' '; echo
  grep -h -E "GPU kernel time per step|device over" "$out/step_$l.log"
  grep -h -E "us/step +x +[0-9]+ " "$out/step_$l.log" | grep -v host | head -7
done
grep -h -A22 "one layer" "$out/step_base.log" | head -23
grep -h -E "Protocol A|prefill [0-9]|engine loop|row blocks" "$out/run.log" | cut -c1-220
grep -h -A30 "engine trace" "$out/run.log" | head -31
