#!/usr/bin/env bash
# The serving host path's own ceiling: `deepinfer serve` on a tiny model on the CPU (tiny-deepseek-v2's shape, dummy
# weights: a step's compute is a few milliseconds), driven by Protocol B's client at high concurrency. The output
# tokens/s it reaches is what the server process's Python (the engine thread's scheduling, outputs and text, the event
# loop's streams; one GIL) sustains with next to no model: a GPU server that streams near this figure is bound by its
# host, not its GPU.
#
#   bash benchmarks/host_ceiling.sh [OUTDIR] [CONCURRENCY,...]     (default ./host-out, 256,512)
#
# With py-spy installed, PYSPY=1 records the server's GIL holders for 15 s at the last level (OUTDIR/gil_C.txt, raw).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-host-out}"; levels="${2:-256,512}"; mkdir -p "$out"
py=${PYTHON:-python3}
export JAX_PLATFORMS=cpu PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
model=$(mktemp -d)
$py benchmarks/dummy_model.py --preset tiny-deepseek-v2 --out "$model" > /dev/null
max=$(echo "$levels" | tr ',' '\n' | sort -n | tail -1)
$py -m deepinfer_jax.cli serve --model "$model" --load-format dummy --dtype float32 --port 8041 --max-num-seqs "$max" \
  --max-model-len 256 > "$out/server.log" 2>&1 &
server=$!
trap 'kill $server 2> /dev/null; wait $server 2> /dev/null; rm -rf "$model"' EXIT
$py benchmarks/wait_ready.py http://127.0.0.1:8041 600 $server > /dev/null || { tail -20 "$out/server.log"; exit 1; }
spy=
for c in ${levels//,/ }; do
  if [[ -n ${PYSPY:-} && $c == "$max" ]]; then
    (sleep 8; py-spy record -p $server -d 15 -r 200 --gil -f raw -o "$out/gil_$c.txt" > /dev/null 2>&1) &
    spy=$!
  fi
  $py benchmarks/serving.py --base-url http://127.0.0.1:8041 --input-len 32 --output-len 128 --max-concurrency "$c" \
    --num-prompts $(( 4 * c )) --vocab-size 512 2>&1 | grep "^concurrency"
done
[[ -n $spy ]] && wait $spy
