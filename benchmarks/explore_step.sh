#!/usr/bin/env bash
# The next GPU call's questions (session 8), a short table last:
#   absorb   models/mla.py: decode steps absorb the query through kv_b_proj's whole rows (zero-padded
#            query) instead of a W_UK slice, which XLA copied out every layer (2.4 us): the batch-32 step
#            at 640 with it (default) and without (--absorb-full-width-max-tokens 0)
#   output   RunnerConfig.decode_output_kernel on / off once more (the last call: 8.67 / 8.66 ms)
#   protocol Protocol A with the output kernel on and off (temp 0 and 1, two runs each)
#   bash benchmarks/explore_step.sh OUTDIR
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench-out}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
quiet() { grep -v -E "^\s*$|Warning|warn|^[WI][0-9]{4} " ; }
timeout 100 python3 benchmarks/step_profile.py --label on --trace /tmp/tr_on 2>&1 | quiet > "$out/step_on.log"
for v in "slice --absorb-full-width-max-tokens 0" "off --no-decode-output-kernel" "on2" "slice2 --absorb-full-width-max-tokens 0"; do
  set -- $v
  timeout 80 python3 benchmarks/step_profile.py --label "$@" 2>&1 | quiet
done > "$out/steps.log"
for v in on off; do
  flag=""; [[ $v == off ]] && flag="--no-decode-output-kernel"
  timeout 120 python3 benchmarks/offline.py --buckets 32,16384 $flag > "$out/protocol_a_$v.log" 2>&1
done
echo "== summary =="
grep -h -E "^(on|off|on2|slice|slice2):|pipelined via comp" "$out/step_on.log" "$out/steps.log" | sed -E 's/TP=1.*: device/: device/'
grep -h -A22 "one layer" "$out/step_on.log" | head -24
for v in on off; do echo "-- output kernel $v"; grep -h -E "Protocol A|prefill [0-9]" "$out/protocol_a_$v.log" | cut -c1-220; done
