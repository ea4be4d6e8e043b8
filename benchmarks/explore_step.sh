#!/usr/bin/env bash
# The next GPU call's question: where a batch-16 decode step at 4K context spends the ~4 ms it is idle
# (8.4 ms a step, 4.3 ms of kernels; host enqueue 1 ms since the step is one program), next to batch 32
# at 640 (device-bound). Each part a fresh step_profile.py process, traced, with the host's CUDA calls:
#   b16   batch 16 at 4K context       b32   batch 32 at 640
#   vlog  batch 16 again, XLA's command-buffer and VA-remap logs (is the graph updated each step?)
#   bash benchmarks/explore_step.sh OUTDIR
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench-out}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
quiet() { grep -v -E "^\s*$|Warning|warn|^[WI][0-9]{4} " ; }
sp() { timeout 90 python3 benchmarks/step_profile.py "$@" 2>&1 | quiet; }
B16="--batch 16 --context 4096"; B32="--batch 32 --context 640"
{
  sp --label b16 $B16 --trace /tmp/tr_b16
  sp --label b32 $B32 --trace /tmp/tr_b32
} > "$out/host.log"
TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3,gpu_executable_va_remap_allocator=3,command_buffer_cmd=2 \
  timeout 90 python3 benchmarks/step_profile.py --label b16_vlog $B16 > "$out/vlog.out" 2> "$out/vlog.err"
grep -v -E "^\s*$" "$out/vlog.out" | tail -5 >> "$out/host.log"
head -c 400000 "$out/vlog.err" > "$out/vlog_head.err"; tail -c 400000 "$out/vlog.err" > "$out/vlog_tail.err"; rm -f "$out/vlog.err"
echo "== summary =="
grep -h -E "^[a-z0-9_]+: |pipelined via|engine-like" "$out/host.log" | sed -E 's/XLA_FLAGS=.*: device/device/; s/TP=1 DP=1 EP=False //; s/attn=pallas moe=pallas\+shared\+routing prefill_attention=expanded unroll=auto //'
