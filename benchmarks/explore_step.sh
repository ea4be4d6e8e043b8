#!/usr/bin/env bash
# Where the engine's decode step loses time against the isolated step, in one GPU call (each part a
# fresh process), a short table last:
#   big_cache    the isolated step (defaults: both MoE fusions) with an engine-sized KV cache (40,000
#                pages), traced; its optimized HLO is kept as OUTDIR/decode_step_hlo.txt
#   prefill      a 16 x 512 prefill step with and without the shared experts inside the MoE kernels
#   engine       Protocol A (temperature 0) with 20 decode steps of the engine traced: the device's busy
#                and idle time per step (benchmarks/trace_tools.py); an empty compilation cache
#   warm_start   the same start-up again on the now warm compilation cache
#   bash benchmarks/explore_step.sh OUTDIR
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench-out}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
quiet() { grep -v -E "^\s*$|Warning|warn|^W[0-9]{4} " ; }
sp() { timeout 150 python3 benchmarks/step_profile.py "$@" 2>&1 | quiet; }
sp --label big_cache --num-pages 40000 --trace /tmp/tr0 --dump-hlo /tmp/hlo > "$out/big_cache.log"
cp "$(ls -S /tmp/hlo/*jit_step*after_optimizations.txt | head -1)" "$out/decode_step_hlo.txt" 2>/dev/null
sp --label prefill_fused --prefill 512 --batch 16 --context 0 > "$out/prefill.log"
sp --label prefill_shared_apart --prefill 512 --batch 16 --context 0 --no-fuse-shared-experts >> "$out/prefill.log"
timeout 300 python3 benchmarks/offline.py --buckets 32,8192 --temperatures 0 --trace /tmp/tr_engine 2>&1 | quiet \
  > "$out/engine.log"
timeout 200 python3 benchmarks/offline.py --buckets 32,8192 --temperatures 0 --runs 1 2>&1 | quiet > "$out/warm_start.log"
echo "== summary =="
grep -h -E "^[a-z_0-9]+: |pipelined|GPU kernel time|^device over|^  idle" "$out/big_cache.log" "$out/prefill.log"
grep -h -E "Protocol A|engine loop|KV cache|start-up|prefill [0-9]|^device over|^  idle|GPU kernel time" "$out/engine.log"
grep -h -E "start-up" "$out/warm_start.log"
