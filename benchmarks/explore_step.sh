#!/usr/bin/env bash
# The next GPU call's questions, a short table last:
#   engine   Protocol A's engine decodes in 9.78 ms a step where the isolated step takes 9.01 ms, and its
#            dispatch takes 4.65 ms where the isolated enqueue takes 1.2 ms (session 5). Two candidates,
#            2 x 2: offline.py kept every step's routed expert ids on the device (a fresh output buffer
#            per step; `--routing device`, now `host`: read one step later), and warm-up ran each program
#            once, so XLA's 3-run address profile ended on the engine's first overlapped steps
#            (`--warmup-runs 1`, now 3). Protocol A (temp 0, one run) under XLA's command-buffer log
#            (graph updates per run); the last one traced (device busy / idle, host calls).
#   pages    the decode attention walking 1 / 2 / 4 pages per loop step (kernels/mla_decode.PAGES_PER_STEP;
#            independent page loads in flight together): batch 16 at 4K context, where the kernel reads
#            its latent cache at 1.9 TB/s, and batch 32 at 640
#   warm     `serve` started twice on one fresh cache with one bucket (2 programs): does the second start
#            load its programs from the cache now that the KV cache is sized in whole GiB (ff5ce8b)?
#   bash benchmarks/explore_step.sh OUTDIR          (WARM=0 leaves out the serve part)
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
pa="benchmarks/offline.py --buckets 32,16384 --runs 1 --temperatures 0"
for v in "device 1" "host 1" "device 3" "host 3"; do
  set -- $v
  extra=""; [[ $v == "host 3" ]] && extra="--trace /tmp/tr_engine"
  vlog timeout 100 python3 $pa --routing $1 --warmup-runs $2 $extra > "$out/engine_$1_$2.out" 2> "$out/engine_$1_$2.err"
done
for run in "16 4096 1" "16 4096 2" "16 4096 4" "32 640 2"; do
  set -- $run
  timeout 80 python3 benchmarks/step_profile.py --label "pages$3_b$1" --batch $1 --context $2 --attn-pages-per-step $3
done 2>&1 | quiet > "$out/pages.log"
if [[ ${WARM:-1} == 1 ]]; then
  SERVE_ARGS="--max-num-batched-tokens 16 --max-num-seqs 16" timeout 170 bash benchmarks/serve_start.sh "$out/warm" \
    2>&1 | grep -v "compiling .* step programs" > "$out/warm.log"
fi
echo "== summary =="
for v in device_1 host_1 device_3 host_3; do
  echo "-- routing / warm-up runs $v: $(grep -h -E "Protocol A" "$out/engine_$v.out" | cut -c1-80)"
  grep -h -E "engine loop|start-up" "$out/engine_$v.out" | cut -c1-120
  updates "$out/engine_$v.err" "   command buffer"
done
grep -h -E "^device over|GPU kernel time|host .*(Graph|ExecuteThunks)" "$out/engine_host_3.out"
grep -h -E "^pages|pipelined via comp" "$out/pages.log" | sed -E 's/TP=1.*: device/: device/'
[[ -f $out/warm.log ]] && grep -h -E "^serve|ready in|KV cache" "$out/warm.log"
for f in "$out"/*.err; do tail -c 200000 "$f" > "$f.tail"; rm -f "$f"; done
