#!/usr/bin/env bash
# The next GPU call's questions (each part a fresh process), a short table last:
#   prefill        16 x 512 prefill step, split attention (with 6c21f28's context-pass skip) vs absorbed
#   decode         the batch-32 decode step as two programs (forward + sampler), and with
#                  --xla_gpu_enable_dynamic_slice_fusion=true (o_proj's cuBLAS call reading its layer's
#                  slice of the stacked weights in place instead of a 4.9 us copy per layer)
#   batch1         batch 16 (the engine's smallest bucket) and batch 1 at 4K context, traced: why the
#                  host enqueue equals the step time at small batches (the trace's command_buffer_N
#                  column and the host calls show whether the step still runs as one CUDA graph)
#   bash benchmarks/explore_step.sh OUTDIR
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench-out}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
quiet() { grep -v -E "^\s*$|Warning|warn|^W[0-9]{4} " ; }
sp() { timeout 120 python3 benchmarks/step_profile.py "$@" 2>&1 | quiet; }
sp --label decode > "$out/decode.log"
XLA_FLAGS=--xla_gpu_enable_dynamic_slice_fusion=true sp --label decode_dsf --trace /tmp/tr_dsf >> "$out/decode.log"
sp --label batch16 --batch 16 --context 4096 --trace /tmp/tr_b16 > "$out/batch1.log"
sp --label batch1 --batch 1 --context 4096 --trace /tmp/tr_b1 >> "$out/batch1.log"
sp --label prefill_split --prefill 512 --batch 16 --context 0 > "$out/prefill.log"
sp --label prefill_absorbed --prefill 512 --batch 16 --context 0 --prefill-attention absorbed >> "$out/prefill.log"
echo "== summary =="
grep -h -E "^[a-z_0-9]+: |pipelined via comp|GPU kernel time|^device over|one layer" "$out"/prefill.log \
  "$out"/decode.log "$out"/batch1.log
