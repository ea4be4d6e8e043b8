#!/usr/bin/env bash
# `deepinfer serve` from start to /health, twice on one fresh compilation cache: first empty (every step
# program compiled), then warm (loaded from the cache); then `tuned`: a fresh cache holding only the
# first run's GEMM autotuning results (XLA's per-fusion autotune cache, saved to OUTDIR/autotune.tgz),
# which is what shipping tuned results for the GPU would give. V2-Lite shape, random weights drawn on
# the device (`--load-format dummy`), Protocol B's server flags. Prints the times and the warm-up's log.
#   bash benchmarks/serve_start.sh [OUTDIR] [PRESET]     (SERVE_ARGS: more serve flags, e.g. fewer buckets;
#   CACHE_DIR: the first runs' cache directory instead of a fresh one, e.g. to reuse it afterwards)
# To ship the autotuning results for another GPU or model shape, copy OUTDIR/autotune.tgz to
# deepinfer_jax/assets/autotune/<gpu>-<model>.tgz (runner/compile_cache.py seeds the cache from every .tgz there).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench-out}"; mkdir -p "$out"
preset="${2:-deepseek-v2-lite}"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
dummy=$(mktemp -d)
python3 benchmarks/dummy_model.py --preset "$preset" --out "$dummy" > /dev/null
export DEEPINFER_CACHE_DIR=${CACHE_DIR:-$(mktemp -d)}
first=$DEEPINFER_CACHE_DIR
for run in ${RUNS:-empty warm tuned}; do
  if [[ $run == tuned ]]; then
    export DEEPINFER_CACHE_DIR=$(mktemp -d)
    cp -r "$first/xla_gpu_per_fusion_autotune_cache_dir" "$DEEPINFER_CACHE_DIR/"
    tar czf "$out/autotune.tgz" -C "$first" xla_gpu_per_fusion_autotune_cache_dir
    echo "autotune results: $(ls "$first/xla_gpu_per_fusion_autotune_cache_dir" | wc -l) files, $(du -sh "$first/xla_gpu_per_fusion_autotune_cache_dir" | cut -f1)"
  fi
  python3 -m deepinfer_jax.cli serve --model "$dummy" --load-format dummy --port 8011 --max-num-seqs 128 \
    --max-model-len 1024 ${SERVE_ARGS:-} > "$out/server_$run.log" 2>&1 &
  server=$!
  echo "serve, $run compilation cache: $(python3 benchmarks/wait_ready.py http://127.0.0.1:8011 420) s from start to /health"
  kill -TERM $server; wait $server
  grep -h -E "warm-up:|ready in|KV cache:|program cache" "$out/server_$run.log" | sed -E 's/^[0-9-]+ ([0-9:]+),[0-9]+ INFO [a-z_.]+: /\1 /'
done
