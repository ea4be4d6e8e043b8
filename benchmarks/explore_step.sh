#!/usr/bin/env bash
# One GPU call of decode-step experiments (each part a fresh process), a short table last:
#   step          the isolated step with an engine-sized KV cache (40,000 pages), traced (defaults: both MoE
#                 fusions, XLA's rematerialization off)
#   triton_gemms  the same with --xla_gpu_cublas_fallback=false: every GEMM a Triton fusion, which reads a
#                 layer's slice of the stacked weights in place (cuBLAS needs the slice copied first)
#   mla_tune      the decode attention's (splits, warps, stages) variants at batch 32, context 640
#   engine        Protocol A at temperature 0 (the engine's loop; a fresh compilation cache)
#   bash benchmarks/explore_step.sh OUTDIR
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench-out}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
quiet() { grep -v -E "^\s*$|Warning|warn|^W[0-9]{4} " ; }
sp() { timeout 150 python3 benchmarks/step_profile.py "$@" 2>&1 | quiet; }
sp --label step --num-pages 40000 --trace /tmp/tr0 > "$out/step.log"
XLA_FLAGS=--xla_gpu_cublas_fallback=false sp --label triton_gemms --num-pages 40000 --trace /tmp/tr1 \
  > "$out/triton_gemms.log"
timeout 200 python3 benchmarks/mla_tune.py --batch 32 --context 640 2>&1 | quiet > "$out/mla_tune.log"
timeout 300 python3 benchmarks/offline.py --buckets 32,8192 --temperatures 0 2>&1 | quiet > "$out/engine.log"
echo "== summary =="
for f in step triton_gemms; do
  grep -h -E "^[a-z_0-9]+: |pipelined|GPU kernel time|^device over|\[" "$out/$f.log"
done
grep -A8 "^| splits" "$out/mla_tune.log"
grep -h -E "Protocol A|engine loop|start-up|prefill [0-9]" "$out/engine.log"
