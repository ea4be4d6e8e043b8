#!/usr/bin/env bash
# The next GPU call's question: why small decode steps are host-bound. At batch 16 / 4K context the
# device works 4.3 ms a step but the host takes 8.1 ms to queue one (batch 32: 4.5 of 9.2 ms). Each part
# a fresh step_profile.py process, batch 16 at 4K context (B16) or batch 32 at 640 (B32):
#   default           the runner's two programs (forward, sampler), SKIP_PROFILED (xla_env.py)
#   one_program       forward and sampler as one jitted program (the runner before the split)
#   always_update     --xla_gpu_command_buffer_update_mode=ALWAYS_UPDATE (XLA's default, BFC allocator)
#   skip_temp         --xla_gpu_command_buffer_update_mode=SKIP_TEMP
#   no_cmd_buffers    --xla_gpu_enable_command_buffer= (kernels launched one by one)
#   vlog              default again, XLA's command-buffer and VA-remap logs counted (updates per step?)
#   bash benchmarks/explore_step.sh OUTDIR
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench-out}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
quiet() { grep -v -E "^\s*$|Warning|warn|^[WI][0-9]{4} " ; }
sp() { timeout 90 python3 benchmarks/step_profile.py "$@" 2>&1 | quiet; }
B16="--batch 16 --context 4096"; B32="--batch 32 --context 640"
mode() { echo "--xla_gpu_command_buffer_update_mode=$1"; }
{
  sp --label b16_default $B16
  sp --label b16_one_program $B16 --one-program
  XLA_FLAGS=$(mode ALWAYS_UPDATE) sp --label b16_always_update $B16
  XLA_FLAGS=$(mode SKIP_TEMP) sp --label b16_skip_temp $B16
  XLA_FLAGS=--xla_gpu_enable_command_buffer= sp --label b16_no_cmd_buffers $B16
  sp --label b32_one_program $B32 --one-program
  XLA_FLAGS=$(mode ALWAYS_UPDATE) sp --label b32_always_update $B32
  XLA_FLAGS=--xla_gpu_enable_dynamic_slice_fusion=true sp --label b32_one_program_dsf $B32 --one-program
} > "$out/host.log"
TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3,gpu_executable_va_remap_allocator=3,command_buffer_cmd=2 \
  timeout 90 python3 benchmarks/step_profile.py --label b16_vlog $B16 > "$out/vlog.out" 2> "$out/vlog.err"
grep -v -E "^\s*$" "$out/vlog.out" | tail -5 >> "$out/host.log"
head -c 400000 "$out/vlog.err" > "$out/vlog_head.err"; tail -c 400000 "$out/vlog.err" > "$out/vlog_tail.err"; rm -f "$out/vlog.err"
echo "== summary =="
grep -h -E "^[a-z0-9_]+: |pipelined via|engine-like" "$out/host.log" | sed -E 's/XLA_FLAGS=.*: device/device/; s/TP=1 DP=1 EP=False //; s/attn=pallas moe=pallas\+shared\+routing prefill_attention=expanded unroll=auto //'
