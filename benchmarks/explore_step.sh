#!/usr/bin/env bash
# The next GPU call's questions (session 9), a short table last:
#   start    serve from start to /health on an empty cache (the new shipped autotuning archive seeded),
#            then warm: the compiled step programs load from the program cache (runner/program_cache.py)
#            instead of being traced and lowered
#   serving  Protocol B against a server started on that warm cache
#   bash benchmarks/explore_step.sh OUTDIR
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench-out}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
cache=$(mktemp -d)
CACHE_DIR=$cache RUNS="empty warm" timeout 300 bash benchmarks/serve_start.sh "$out/start" > "$out/start.log" 2>&1
ls "$cache/programs" | wc -l | sed 's/^/program cache entries: /' >> "$out/start.log"
du -sh "$cache/programs" >> "$out/start.log"
DEEPINFER_CACHE_DIR=$cache PARTS=protocol_b timeout 280 bash benchmarks/gpu.sh "$out/b" > "$out/b.log" 2>&1
echo "== summary =="
grep -v -E "compiling [0-9]+ step programs|compiled the" "$out/start.log"
tail -8 "$out/b.log"
