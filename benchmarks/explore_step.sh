#!/usr/bin/env bash
# The next GPU call's questions (session 8), a short table last:
#   output   kernels/mla_output.py (the decode attention's splits merged and W_UV applied in one kernel,
#            kv_b read in place) against XLA's merge + einsum: max error on the GPU, bf16 and fp32
#   step     the batch-32 decode step at 640 with the kernel on / off (RunnerConfig.decode_output_kernel),
#            the "on" run traced (one layer's kernels in launch order)
#   bash benchmarks/explore_step.sh OUTDIR
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench-out}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
quiet() { grep -v -E "^\s*$|Warning|warn|^[WI][0-9]{4} " ; }
timeout 120 python3 benchmarks/kernels.py --only mla_output 2>&1 | quiet > "$out/output.log"
timeout 100 python3 benchmarks/step_profile.py --label on --trace /tmp/tr_on 2>&1 | quiet > "$out/step_on.log"
for v in "off --no-decode-output-kernel" "on2"; do
  set -- $v
  timeout 80 python3 benchmarks/step_profile.py --label "$@" 2>&1 | quiet
done > "$out/steps.log"
echo "== summary =="
grep -h "^|" "$out/output.log"
grep -h -E "^(on|off|on2):|pipelined via comp" "$out/step_on.log" "$out/steps.log" | sed -E 's/TP=1.*: device/: device/'
grep -h -A40 "one layer" "$out/step_on.log" | head -45
