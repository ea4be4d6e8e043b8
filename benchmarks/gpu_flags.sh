#!/usr/bin/env bash
# Is the decode step bound by the host launching its kernels? The step (V2-Lite cut to 9 layers, batch
# 32) under XLA command-buffer (CUDA graph) variants, each a fresh process; then Protocol A with the
# default flags and with the fastest variant.   bash benchmarks/gpu_flags.sh OUTDIR
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench-out}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
variants=("" "--xla_gpu_enable_command_buffer=" "--xla_gpu_command_buffer_update_mode=SKIP_TEMP"
          "--xla_gpu_enable_command_buffer_va_remapping=true" "--xla_gpu_graph_min_graph_size=2"
          "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,DYNAMIC_SLICE_COPY_FUSION")
best=""; best_ms=1e9
for v in "${variants[@]}"; do
  line=$(XLA_FLAGS="$v" timeout 100 python3 benchmarks/step_profile.py --layers 9 2>&1 | tee -a "$out/flags.log" | grep "device step")
  ms=$(echo "$line" | sed -n 's/.*device step \([0-9.]*\) ms.*/\1/p')
  echo "flags '${v}': ${ms:-failed} ms"
  if [ -n "$ms" ] && awk "BEGIN{exit !($ms < $best_ms)}"; then best="$v"; best_ms=$ms; fi
done
timeout 100 python3 benchmarks/step_profile.py --layers 9 --unroll off 2>&1 | grep "device step" | sed 's/^/scan: /'
echo "fastest: '$best' ($best_ms ms)"
pa() { timeout 200 python3 benchmarks/offline.py --buckets 32,8192 "$@" 2>&1 | tee -a "$out/protocol_a.log" | grep -E "Protocol A|prefill [0-9]|start-up|engine loop|compiles|peak"; }
pa --runs 2
[ -n "$best" ] && { echo "== with XLA_FLAGS='$best'"; XLA_FLAGS="$best" pa --runs 1 --temperatures 0; }
