#!/usr/bin/env bash
# Everything measured on the GPU machine, in one command: kernel tables, then Protocol A.
#   bash benchmarks/gpu.sh [OUTDIR]      (logs and JSON go to OUTDIR, default ./bench-out)
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench-out}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 benchmarks/kernels.py ${KERNELS_ARGS:---quick} 2>&1 | tee "$out/kernels.log"
python3 benchmarks/offline.py --buckets 32,8192 --json "$out/protocol_a.json" ${OFFLINE_ARGS:-} 2>&1 | tee "$out/protocol_a.log"
python3 benchmarks/step_profile.py --trace /tmp/deepinfer-trace 2>&1 | tee "$out/step_profile.log" | tail -1
# The vLLM peer (../shared/peers/vllm_protocol_a.py) needs its bundle carried in separate calls first.
echo "== summary =="; grep -E "^\| 32 \||Protocol A|prefill|start-up|peak|device step" "$out"/*.log
