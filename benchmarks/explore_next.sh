#!/usr/bin/env bash
# The next GPU calls' questions (written in sessions 11 and 12, which had no device time left), a short table last.
# Four switches, all off by default and CPU-tested:
#   qkv      RunnerConfig.decode_qkv_launch: the q / kv_a projections in the absorb kernel's launch
#   oproj    RunnerConfig.decode_oproj_launch: o_proj in the output kernel's launch, its weight tiles loaded while the
#            merge runs
#   combine  RunnerConfig.moe_combine_in_launch: the single MoE launch also combines the expert rows and adds the residual
#   route    RunnerConfig.decode_route_launch: o_proj's partials to the routing in one launch
#
#   bash benchmarks/explore_next.sh OUTDIR          the batch-32 decode step with all four (traced, one layer
#                                                   printed), with none, and with each alone; qkv2: the qkv launch's
#                                                   GEMM in 2 K chunks (114 programs of 128 KB), not 4. (o_proj's
#                                                   launch at 8 warps is not tried: benchmarks/kernel_resources.py
#                                                   shows no spills at 4, 255 registers, and 1 CTA an SM at 8.)
#   FLAGS="--decode-qkv-launch ..." bash benchmarks/explore_next.sh OUTDIR check
#                                                   with the winners: the GPU-vs-CPU greedy check and Protocol A
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench-out}"; mode="${2:-steps}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
start=$(date +%s)
left() { (( $(date +%s) - start < ${1:-500} )); }
quiet() { grep -v -E "^\s*$|Warning|warn|^[WI][0-9]{4} " ; }
if [[ $mode == check ]]; then
  read -r -a flags <<< "${FLAGS:-}"
  echo "gpu_vs_cpu $(( $(date +%s) - start ))s"
  timeout 200 python3 benchmarks/gpu_vs_cpu.py --check benchmarks/data/gpu_vs_cpu_expected.json "${flags[@]}" \
    > "$out/gpu_vs_cpu.log" 2>&1
  echo "protocol_a $(( $(date +%s) - start ))s"
  for run in 1 2; do
    left 420 && timeout 170 python3 benchmarks/offline.py --buckets 32,16384 "${flags[@]}" > "$out/protocol_a_$run.log" 2>&1
  done
  echo "done $(( $(date +%s) - start ))s"
  echo "== summary (${FLAGS:-defaults}) =="
  grep -h -E "^\| GPU" "$out/gpu_vs_cpu.log"
  grep -h -E "Protocol A|prefill [0-9]" "$out"/protocol_a_*.log | cut -c1-220
  exit 0
fi
if [[ $mode == prefetch ]]; then  # the routing launch's L2 prefetch (RunnerConfig.moe_l2_prefetch): sizes, then the best
  best=base; best_ms=
  for v in "base:0,0" "e24r128:24,128" "e16r256:16,256" "e24r256:24,256" "e32r192:32,192" "e48r128:48,128"; do
    label=${v%%:*}; echo "$label $(( $(date +%s) - start ))s"
    timeout 100 python3 benchmarks/step_profile.py --label "$label" --moe-l2-prefetch "${v#*:}" 2>&1 | quiet \
      > "$out/pf_$label.log"
    ms=$(grep -h -oE "pipelined via compiled: [0-9.]+" "$out/pf_$label.log" | grep -oE "[0-9.]+$")
    echo "  $label (${v#*:}): ${ms:-none} ms"
    [[ -z $ms ]] && continue
    [[ $label == base ]] && base_ms=$ms
    if [[ $label != base ]] && awk "BEGIN{exit !($ms < ${best_ms:-$base_ms} && $ms <= $base_ms - 0.02)}"; then
      best=${v#*:}; best_ms=$ms
    fi
  done
  echo "best: $best ${best_ms:-} (base ${base_ms:-})"
  [[ $best == base ]] && exit 0
  timeout 200 python3 benchmarks/gpu_vs_cpu.py --check benchmarks/data/gpu_vs_cpu_expected.json \
    --moe-l2-prefetch "$best" > "$out/gpu_vs_cpu.log" 2>&1
  grep -h -E "^\| GPU" "$out/gpu_vs_cpu.log"
  for run in 1 2; do
    left 480 && timeout 150 python3 benchmarks/offline.py --buckets 32,16384 --moe-l2-prefetch "$best" \
      > "$out/protocol_a_$run.log" 2>&1
    grep -h -E "Protocol A|prefill [0-9]" "$out/protocol_a_$run.log" | cut -c1-200
  done
  exit 0
fi
if [[ $mode == xla ]]; then  # XLA options for the non-MoE GEMMs: no dot merging (no slice copies), cuBLAS only
  rm=--xla_disable_hlo_passes=rematerialization
  for v in "base:$rm" "nomerge:$rm --xla_gpu_dot_merger_threshold_mb=0" "cublas:$rm --xla_gpu_enable_triton_gemm=false" \
           "both:$rm --xla_gpu_dot_merger_threshold_mb=0 --xla_gpu_enable_triton_gemm=false"; do
    label=${v%%:*}; echo "$label $(( $(date +%s) - start ))s"
    XLA_FLAGS="${v#*:}" timeout 100 python3 benchmarks/step_profile.py --label "$label" --trace "/tmp/tr_$label" 2>&1 \
      | quiet > "$out/xla_$label.log"
  done
  for l in base nomerge cublas both; do
    echo "$l: $(grep -h -E "pipelined via compiled" "$out/xla_$l.log") | $(grep -h -E "GPU kernel time" "$out/xla_$l.log")"
  done
  for l in nomerge cublas; do grep -h -A17 "one layer" "$out/xla_$l.log" | head -18; done
  exit 0
fi
sp() { local label=$1; shift; left 450 || return; echo "$label $(( $(date +%s) - start ))s"
       timeout 100 python3 benchmarks/step_profile.py --label "$label" "$@" 2>&1 | quiet > "$out/step_$label.log"; }
all=(--decode-qkv-launch --decode-oproj-launch --moe-combine-in-launch --decode-route-launch)
sp all "${all[@]}" --trace /tmp/tr_all
sp base
sp qkv --decode-qkv-launch
sp oproj --decode-oproj-launch
sp combine --moe-combine-in-launch
sp route --decode-route-launch
sp qkv2 --decode-qkv-launch --qkv-kernel split_k=2
echo "done $(( $(date +%s) - start ))s"
echo "== summary =="
for l in all base qkv oproj combine route qkv2; do
  [[ -f $out/step_$l.log ]] || continue
  echo "$l: $(grep -h -E "pipelined via compiled" "$out/step_$l.log") | $(grep -h -E "GPU kernel time" "$out/step_$l.log")"
done
grep -h -A14 "one layer" "$out/step_all.log" | head -15
