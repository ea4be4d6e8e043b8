#!/usr/bin/env bash
# A/B of the decode step's implementation variants on one GPU (each a fresh process), then Protocol A
# with all of them, a short table last:
#   baseline     the defaults (its trace also prints one layer's kernels in launch order)
#   shared       RunnerConfig.fuse_shared_experts: the shared MLP inside the Pallas MoE kernels
#   routing      RunnerConfig.fuse_moe_routing: routing + alignment in one kernel (kernels/moe_route.py)
#   both         the two together (traced)
#   big_cache    the baseline with an engine-sized KV cache (64-bit offsets; XLA's memory budget)
#   splits8      the decode attention with 8 context splits instead of auto_splits' 4 at batch 32
#   batch1/8     one and eight sequences at 4K context (the attention's auto_splits)
#   bash benchmarks/explore_step.sh OUTDIR
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench-out}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
sp() { timeout 150 python3 benchmarks/step_profile.py "$@" 2>&1 | grep -v -E "^\s*$|Warning|warn" | tail -60; }
sp --label baseline --trace /tmp/tr0 | tee "$out/baseline.log"
sp --label shared --fuse-shared-experts | tee "$out/variants.log"
sp --label routing --fuse-moe-routing | tee -a "$out/variants.log"
sp --label both --fuse-shared-experts --fuse-moe-routing --trace /tmp/tr1 | tee "$out/both.log"
sp --label big_cache --num-pages 40000 | tee -a "$out/variants.log"
sp --label splits8 --attn-splits 8 | tee -a "$out/variants.log"
sp --label batch1 --batch 1 --context 4096 | tee -a "$out/variants.log"
sp --label batch8 --batch 8 --context 4096 | tee -a "$out/variants.log"
timeout 240 python3 benchmarks/offline.py --buckets 32,8192 --temperatures 0 --fuse-shared-experts --fuse-moe-routing \
  > "$out/protocol_a_fused.log" 2>&1
echo "== summary =="
grep -h -E "^[a-z_0-9]+: |pipelined|GPU kernel time" "$out"/baseline.log "$out"/variants.log "$out"/both.log
grep -h -E "Protocol A|engine loop|KV cache|start-up" "$out/protocol_a_fused.log"
