#!/usr/bin/env bash
# Where the step time goes, under lowering variants (each a fresh process: XLA reads its flags once).
#   bash benchmarks/explore_step.sh OUTDIR
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench-out}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
CB="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"
sp() { timeout 150 python3 benchmarks/step_profile.py "$@" 2>&1 | grep -v -E "^\s*$|Warning|warn" | tail -40; }
sp --label baseline --trace /tmp/tr0 --dump-hlo /tmp/hlo | tee "$out/decode_baseline.log"
XLA_FLAGS="$CB" sp --label cb_while | tee "$out/variants.log"
sp --label unroll --unroll on | tee -a "$out/variants.log"
XLA_FLAGS="--xla_gpu_enable_dynamic_slice_fusion=true" sp --label dyn_slice_fusion | tee -a "$out/variants.log"
sp --label prefill --prefill 512 --batch 16 --context 0 --trace /tmp/tr1 | tee "$out/prefill.log"
XLA_FLAGS="$CB" sp --label unroll_cb_while --unroll on | tee -a "$out/variants.log"
XLA_FLAGS="--xla_gpu_enable_command_buffer=" sp --label cb_off | tee -a "$out/variants.log"
timeout 120 python3 benchmarks/kernels.py --only moe --moe-tokens 8192 2>&1 | grep "^|" | tee "$out/moe8192.log"
f=$(ls -S /tmp/hlo/*after_optimizations.txt 2>/dev/null | head -1); [ -n "$f" ] && gzip -c "$f" > "$out/step_after_opt.txt.gz"
echo "== summary =="; grep -h -E "device step|GPU kernel time|^\s+\[" "$out"/*.log
