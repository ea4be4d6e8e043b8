#!/usr/bin/env bash
# One-GPU measurements in one command: kernel tables (MLA prefill), where a decode and a prefill step
# go (traces), Protocol A with the engine loop's host timing, and the bf16 noise between the Pallas and
# the XLA paths on one device.   bash benchmarks/gpu1.sh OUTDIR
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench-out}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
py() { log=$1; shift; timeout ${LIMIT:-200} python3 "$@" > "$out/$log" 2>&1; grep -E "^\||device step|GPU kernel|^  \[|Protocol A|prefill [0-9]|start-up|compiles|engine loop|peak" "$out/$log"; }
LIMIT=150 py mla_prefill.log benchmarks/kernels.py --only mla_prefill --quick
py decode_profile.log benchmarks/step_profile.py --trace /tmp/tr_dec
py prefill_profile.log benchmarks/step_profile.py --prefill 512 --batch 16 --context 0 --trace /tmp/tr_pre
py protocol_a.log benchmarks/offline.py --buckets 32,16384 --runs 2
py bf16_noise.log benchmarks/sharded_check.py --layouts single_xla
