#!/usr/bin/env bash
# The next GPU call's questions, a short table last:
#   engine   Protocol A's engine loop decodes in 9.78 ms a step where the isolated step takes 9.01 ms
#            (session 5), and its dispatch takes 4.65 ms where the isolated enqueue takes 1.2 ms. Traced
#            (device busy / idle, host calls), then again with XLA's command-buffer log: is the step's
#            graph updated inside the engine loop ("Updated command buffer ... num_commands=6xx")?
#   isolated the same step in isolation, for the same log
#   warm     `serve` started twice on one fresh cache with one bucket (2 programs): does the second start
#            load its programs from the cache now that the KV cache is sized in whole GiB (ff5ce8b)?
#   bash benchmarks/explore_step.sh OUTDIR
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench-out}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
quiet() { grep -v -E "^\s*$|Warning|warn|^[WI][0-9]{4} " ; }
vlog() { TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3,gpu_executable_va_remap_allocator=3 "$@"; }
updates() {  # graph updates of the big (forward) command buffer, and how long they took on the host
  grep -E "Updated command buffer in [0-9]+ [^;]*; num_commands=[0-9]{3,}" "$1" | grep -oE "in [0-9]+" |
    awk -v what="$2" '{s += $2; n++} END {printf "%s: %d updates of the step graph, mean %.0f us host\n", what, n, n ? s / n : 0}'
}
timeout 150 python3 benchmarks/offline.py --buckets 32,8192 --runs 1 --temperatures 0 --trace /tmp/tr_engine 2>&1 |
  quiet > "$out/engine.log"
vlog timeout 120 python3 benchmarks/offline.py --buckets 32,8192 --runs 1 --temperatures 0 > "$out/engine_vlog.out" \
  2> "$out/engine_vlog.err"
vlog timeout 90 python3 benchmarks/step_profile.py --label isolated > "$out/isolated_vlog.out" 2> "$out/isolated_vlog.err"
SERVE_ARGS="--max-num-batched-tokens 16 --max-num-seqs 16" timeout 200 bash benchmarks/serve_start.sh "$out/warm" \
  2>&1 | grep -v "compiling .* step programs" > "$out/warm.log"
echo "== summary =="
grep -h -E "Protocol A|engine loop|^device over|GPU kernel time|host .*(Graph|ExecuteThunks)" "$out/engine.log"
updates "$out/engine_vlog.err" "engine loop (Protocol A, temp 0, one run)"
updates "$out/isolated_vlog.err" "isolated step_profile (all its loops)"
grep -h -E "^isolated|pipelined via comp" "$out/isolated_vlog.out"
grep -h -E "^serve|ready in|KV cache" "$out/warm.log"
for f in "$out"/*_vlog.err; do tail -c 300000 "$f" > "$f.tail"; rm -f "$f"; done
