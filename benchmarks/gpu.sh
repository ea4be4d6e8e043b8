#!/usr/bin/env bash
# Every benchmark of the project on a GPU machine, in one command, a short summary table last.
#
#   bash benchmarks/gpu.sh [OUTDIR]                       logs and JSON go to OUTDIR (default ./bench-out)
#   PARTS="protocol_a protocol_b" bash benchmarks/gpu.sh  only these parts, in this order
#
# Parts (default: kernels gpu_vs_cpu protocol_a hf_peer protocol_b):
#   kernels          kernels.py: each kernel against its reference, then its time, bytes/s and FLOP/s
#                    (MoE grouped GEMM, MLA decode / prefill / output)
#   gpu_vs_cpu       gpu_vs_cpu.py: greedy tokens of the GPU kernels against the CPU reference (fp32), bf16 vs fp32
#   protocol_a       offline.py: Protocol A (V2-Lite shape, random weights, batch 32, 512 in / 256 out)
#   hf_peer          hf_peer.py: HF transformers' `generate` on the same protocol (needs torch + transformers)
#   vllm_peer        vLLM 0.26.0's Protocol A, from a vLLM bundle unpacked into /tmp/vllm (see vllm_unpack below;
#                    with vLLM installed, run its `LLM` on the same shape instead)
#   protocol_b       Protocol B: serving.py against `deepinfer serve --load-format dummy` at the same shape,
#                    concurrency 1, 8, 32, 128, 512 in / 128 out, random-id prompts
#   vllm_serve       the same client against vLLM's OpenAI server on the same model directory (dummy weights,
#                    the same flags; its extra wheels: vllm_serve_deps.sh)
#   protocol_a_dense dense.py: Protocol A-dense at DENSE_SHAPES (default llama-3.1-8b qwen2.5-7b), 16,384-token steps
#                    (vLLM's LLM default on an 80 GB GPU, as offline.py)
#   vllm_dense       vllm_peer.py --dense at the same shapes, vLLM's LLM on the same machine (its bundle, as vllm_peer)
#   dense_prefill    dense.py at the Llama shape four ways, each with its prefill traced: 2,048-token steps (LLM's
#                    default), 16,384 (dense.py's, vLLM's LLM on an H100), 16,384 with straight-line layers
#                    (--unroll-max-tokens: weight slices at constant offsets), 16,384 with the layers scanned and
#                    XLA's dynamic-slice fusion (offsets from the loop's counter, which the fusion takes; the
#                    straight-line loop's runtime indices it did not)
#   protocol_a_quant offline.py's Protocol A (greedy) with the weights in bf16, FP8 (128 x 128 blocks), INT8 and INT4
#                    (--quantization), each beside the decode step's weight-byte floor
#   vllm_quant       vllm_peer.py --preset: vLLM's Protocol A in bf16 and with its online FP8 (--quantization fp8)
#   protocol_a_high  offline.py at batch 128 and 256 (Protocol A's 512 in / 256 out), decode step against its floors
#   protocol_b_high  Protocol B-high: concurrency 1, 32, 128, 256, 512, 512 in / 128 out (--max-num-seqs 512)
#   vllm_serve_high  the same client against vLLM's server (--max-num-seqs 512)
#   protocol_b_long  long contexts: 4K in / 512 out and 16K in / 256 out at concurrency 16, 32, 64, 64 prompts a level
#   vllm_serve_long  the same against vLLM's server
#   protocol_c       Protocol C: a 2,048-token shared prefix + 64 unique tokens, 128 out, concurrency 1, 8, 32,
#                    prefix caching on and then off (TTFT is the figure)
#   vllm_protocol_c  the same client against vLLM's server (prefix caching on, its default)
#   protocol_c_large kv_tier.py --requests 128: the KV host tier against recomputing, 64 prefixes over a device cache of
#                    16, TTFT of the returning requests and the tier's copy rate against the pinned link (issue 53)
#   kv_tier_long     kv_tier_long.py: 32K and 128K contexts with the host tier and with recompute
#   prefill_context  prefill_context.py: a chunk's attention over its cached context, absorbed against expanded
#   protocol_f       protocol_f.py: DeepSeek-V3's width in FP8 against bf16 (writes its checkpoint to /tmp/v3-fp8 once;
#                    PROTOCOL_F_ARGS, e.g. --skip-bf16: the bf16 run dequantizes on the host for minutes)
#   vllm_protocol_f  vLLM on the same directory (vllm_peer.py --dir, its bundle as vllm_peer; after protocol_f on the
#                    same machine)
#   fp8_kernels      fp8_kernels.py: the FP8 / INT8 / INT4 GEMMs and grouped GEMMs against bf16, then their tile sweeps
#   v32_v4           v32_offline.py and v4_offline.py --layers 14: V3.2's and V4-Flash's widths, Protocol A and long
#                    contexts (issue 46)
#   host_ceiling     host_ceiling.sh: the server's host path alone (a tiny model on the CPU) at concurrency 256 and 512,
#                    the output tokens/s its Python sustains on this machine's CPU (the ceiling B-high meets)
#   serve_start      serve_start.sh: `deepinfer serve` from start to /health on an empty, a warm and a
#                    tuned-only compilation cache (writes OUTDIR/serve_start/autotune.tgz)
#   sharded          sharded_check.py on two GPUs: TP=2 and DP=2 x EP=2 against one GPU, bf16
#   pipeline         pipeline_check.py on four GPUs: PP=2 and PP=2 x TP=2 against one GPU, bf16, then step times
#   pipeline_groups  pipeline_decode_groups.py on four GPUs: PP=2 and PP=4 against one GPU, bf16, then decode
#                    throughput with one decode group a stage against one step at a time
#
# Knobs: PRESET (model shape, default deepseek-v2-lite: configs/models/PRESET.json), DENSE_SHAPES (dense.py's
# shapes), KERNELS_ARGS (default --quick), OFFLINE_ARGS / SERVING_ARGS (more flags for offline.py / serving.py),
# SERVE_ARGS (more flags for protocol_b's server), READY_LIMIT (seconds a server may take to answer /health, default
# 600), SHARED_PREFIX (Protocol C's shared prefix, default 2,048 tokens), VLLM_PART (a folder of vLLM's bundle that
# this call carries, copied into /tmp/vllm first: benchmarks/README.md), VLLM_SERVE_DEPS (vllm_serve_deps.sh's folder,
# default .peers/serve_deps, copied there where carried). Write what you measure into benchmarks/results/.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench-out}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
parts="${PARTS:-kernels gpu_vs_cpu protocol_a hf_peer protocol_b}"
preset="${PRESET:-deepseek-v2-lite}"
dense_shapes="${DENSE_SHAPES:-llama-3.1-8b qwen2.5-7b}"
hbm=3.35e12  # dense.py's weight-read floor: the card's HBM bytes/s
nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | grep -q H200 && hbm=4.8e12
has() { [[ " $parts " == *" $1 "* ]]; }

run_part() {
  case "$1" in
    kernels) python3 benchmarks/kernels.py ${KERNELS_ARGS:---quick} > "$out/kernels.log" 2>&1 ;;
    gpu_vs_cpu) python3 benchmarks/gpu_vs_cpu.py --check benchmarks/data/gpu_vs_cpu_expected.json \
      > "$out/gpu_vs_cpu.log" 2>&1 ;;
    protocol_a) python3 benchmarks/offline.py --preset "$preset" --buckets 32,16384 --json "$out/protocol_a.json" \
      ${OFFLINE_ARGS:-} > "$out/protocol_a.log" 2>&1 ;;
    hf_peer) python3 benchmarks/hf_peer.py --preset "$preset" > "$out/hf_peer.log" 2>&1 ;;
    vllm_peer) vllm_peer > "$out/vllm_peer.log" 2>&1 ;;
    protocol_b) protocol_b ;;
    protocol_a_dense) for s in $dense_shapes; do python3 benchmarks/dense.py --shapes $s --hbm $hbm \
        > "$out/dense_$s.log" 2>&1; done ;;
    vllm_dense) vllm_unpack && for s in $dense_shapes; do PYTHONPATH=$vllm/pkgs:$vllm/site \
        python3 benchmarks/vllm_peer.py --dense $s --batches 32 > "$out/vllm_dense_$s.log" 2>&1; done ;;
    dense_prefill) local d="python3 benchmarks/dense.py --shapes llama-3.1-8b --hbm $hbm"
      $d --max-num-batched-tokens 0 --trace-prefill "$out/trace_2048" > "$out/dense_prefill_2048.log" 2>&1
      $d --trace-prefill "$out/trace_16384" > "$out/dense_prefill_16384.log" 2>&1
      $d --unroll-max-tokens 16384 --trace-prefill "$out/trace_unrolled" > "$out/dense_prefill_unrolled.log" 2>&1
      XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_gpu_enable_dynamic_slice_fusion=true" $d --prefill-layers scan \
        --trace-prefill "$out/trace_scan_dsf" > "$out/dense_prefill_scan_dsf.log" 2>&1 ;;
    protocol_a_quant) for q in none fp8 int8 int4; do python3 benchmarks/offline.py --preset "$preset" --buckets 32,16384 \
        --temperatures 0 --quantization $q --json "$out/protocol_a_$q.json" ${OFFLINE_ARGS:-} > "$out/protocol_a_$q.log" 2>&1
        done ;;
    vllm_quant) vllm_unpack && for q in "" "--quantization fp8"; do PYTHONPATH=$vllm/pkgs:$vllm/site \
        python3 benchmarks/vllm_peer.py --preset "$preset" --batches 32 $q > "$out/vllm_quant${q:+_fp8}.log" 2>&1; done ;;
    protocol_a_high) for b in 128 256; do
        python3 benchmarks/offline.py --preset "$preset" --batch $b --buckets $b,16384 --max-num-batched-tokens 16384 \
          --json "$out/protocol_a_$b.json" ${OFFLINE_ARGS:-} > "$out/protocol_a_$b.log" 2>&1; done ;;
    protocol_b_high) client_args=$b_high_client serve_max_seqs=512 protocol_b protocol_b_high ;;
    vllm_serve_high) client_args=$b_high_client serve_max_seqs=512 vllm_serve vllm_serve_high ;;
    protocol_b_long) for l in $b_long_lens; do client_args="$(b_long_client $l)" serve_max_seqs=64 \
        protocol_b protocol_b_long_${l%%:*} $(( ${l%%:*} + ${l##*:} + 64 )); done ;;
    vllm_serve_long) for l in $b_long_lens; do client_args="$(b_long_client $l)" serve_max_seqs=64 \
        vllm_serve vllm_serve_long_${l%%:*} $(( ${l%%:*} + ${l##*:} + 64 )); done ;;
    vllm_serve) vllm_serve ;;
    protocol_c) protocol_c ;;
    vllm_protocol_c) client_args=$protocol_c_client vllm_serve vllm_protocol_c $protocol_c_len ;;
    protocol_c_large) python3 benchmarks/kv_tier.py --requests 128 > "$out/protocol_c_large.log" 2>&1 ;;
    kv_tier_long) python3 benchmarks/kv_tier_long.py --contexts 32768,131072 --kinds host-tier,recompute \
      --output-len 64 > "$out/kv_tier_long.log" 2>&1 ;;
    prefill_context) python3 benchmarks/prefill_context.py > "$out/prefill_context.log" 2>&1 ;;
    protocol_f) python3 benchmarks/protocol_f.py --dir /tmp/v3-fp8 --batches 32,128 ${PROTOCOL_F_ARGS:-} \
      > "$out/protocol_f.log" 2>&1 ;;
    vllm_protocol_f) vllm_unpack && PYTHONPATH=$vllm/pkgs:$vllm/site python3 benchmarks/vllm_peer.py --dir /tmp/v3-fp8 \
        --batches 32,128 > "$out/vllm_protocol_f.log" 2>&1 ;;
    fp8_kernels) python3 benchmarks/fp8_kernels.py --tokens 32,128,4096 > "$out/fp8_kernels.log" 2>&1 ;;
    v32_v4) python3 benchmarks/v32_offline.py > "$out/v32_offline.log" 2>&1
      python3 benchmarks/v4_offline.py --layers 14 --batch 2 --check-moe-impl ragged > "$out/v4_offline.log" 2>&1 ;;
    host_ceiling) bash benchmarks/host_ceiling.sh "$out/host_ceiling" 256,512 > "$out/host_ceiling.log" 2>&1 ;;
    serve_start) bash benchmarks/serve_start.sh "$out/serve_start" "$preset" > "$out/serve_start.log" 2>&1 ;;
    sharded) python3 benchmarks/sharded_check.py --layouts tp2,dp2ep2 --preset "$preset" > "$out/sharded.log" 2>&1 ;;
    pipeline) python3 benchmarks/pipeline_check.py --layouts pp2,pp2tp2 --preset "$preset" > "$out/pipeline.log" 2>&1 ;;
    pipeline_groups) python3 benchmarks/pipeline_decode_groups.py --layouts pp2,pp4 --preset "$preset" \
      > "$out/pipeline_groups.log" 2>&1 ;;
    *) echo "unknown part $1" ;;
  esac
}

# The vLLM peer: a bundle of vLLM 0.26.0 and its wheels (vllm.part* = a tar.xz in parts, deps/*.whl, and
# vllm_protocol_a.py, Protocol A through vLLM's `LLM`), carried into /tmp/vllm on a machine without internet.
vllm=/tmp/vllm
if [[ -n ${VLLM_PART:-} ]]; then  # a folder of the bundle carried by this call: its files join the others in $vllm
  mkdir -p $vllm && cp "$VLLM_PART"/* $vllm/ && echo "vLLM bundle: $(ls $vllm | tr '\n' ' ')"
fi
if [[ -d ${VLLM_SERVE_DEPS:-.peers/serve_deps} ]]; then  # the server's wheels (vllm_serve_deps.sh), where carried
  mkdir -p $vllm/serve_deps && cp "${VLLM_SERVE_DEPS:-.peers/serve_deps}"/* $vllm/serve_deps/
fi
vllm_unpack() {  # the bundle's parts (and the server's dependencies, where carried) into $vllm/site, $vllm/pkgs
  if [[ ! -d $vllm/site ]]; then
    ls $vllm/vllm.part* > /dev/null 2>&1 || { echo "no vLLM bundle in $vllm (../shared/peers/vllm_bundle.sh)"; return 1; }
    (cd $vllm && cat vllm.part* | xz -d | tar -x &&
      python3 -m pip install -q --no-index --no-deps --target $vllm/pkgs deps/*.whl) || return 1
  fi
  if [[ -d $vllm/serve_deps && ! -f $vllm/pkgs/.serve_deps ]]; then
    python3 -m pip install -q --no-index --no-deps --upgrade --target $vllm/pkgs $vllm/serve_deps/*.whl &&
      touch $vllm/pkgs/.serve_deps
  fi
}

vllm_peer() {
  vllm_unpack || return
  PYTHONPATH=$vllm/pkgs:$vllm/site python3 $vllm/vllm_protocol_a.py
}

dummy_dir() {  # sets dummy: the preset's model directory for --load-format dummy (config.json, a word-level
               # tokenizer), and vocab: its vocabulary size (the client's random prompt ids)
  dummy=$(mktemp -d)
  python3 benchmarks/dummy_model.py --preset "$preset" --out "$dummy" > /dev/null
  vocab=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['vocab_size'])" "$dummy/config.json")
}

serve_and_measure() {  # NAME PORT COMMAND...: start a server, wait for /health, run the client, stop it
  local name=$1 port=$2; shift 2
  "$@" > "$out/server_$name.log" 2>&1 &
  local server=$!
  local waited
  if ! waited=$(python3 benchmarks/wait_ready.py http://127.0.0.1:$port "${READY_LIMIT:-600}" $server); then
    echo "$name: $waited (server log: $out/server_$name.log)" > "$out/ready_$name.log"
    kill -TERM $server 2> /dev/null; wait $server
    return
  fi
  echo "$name: $waited s from start to /health" > "$out/ready_$name.log"
  python3 benchmarks/serving.py --base-url http://127.0.0.1:$port --vocab-size "$vocab" \
    ${client_args:---input-len 512 --output-len 128 --max-concurrency 1,8,32,128} --result-file "$out/$name.json" \
    ${SERVING_ARGS:-} > "$out/$name.log" 2>&1
  kill -TERM $server; wait $server
}

protocol_b() {  # [NAME] [MAX_MODEL_LEN]
  dummy_dir
  serve_and_measure "${1:-protocol_b}" 8011 python3 -m deepinfer_jax.cli serve --model "$dummy" --load-format dummy \
    --port 8011 --max-num-seqs ${serve_max_seqs:-128} --max-model-len "${2:-1024}" ${SERVE_ARGS:-}
}

b_high_client="--input-len 512 --output-len 128 --max-concurrency 1,32,128,256,512"
b_long_lens="4096:512 16384:256"  # input:output
# 64 prompts a level (4 x concurrency would be 256 prompts of 16K at 64: minutes of prefill a level, past a 10-minute call)
b_long_client() { echo "--input-len ${1%%:*} --output-len ${1##*:} --max-concurrency 16,32,64 --num-prompts 64"; }

vllm_serve() {  # NAME [MAX_MODEL_LEN]: vLLM's defaults otherwise (prefix caching on, as ours; its dummy weights
                # drawn from U(+-0.05))
  local name=${1:-vllm_serve}
  vllm_unpack > "$out/${name}_unpack.log" 2>&1 || { echo "no vLLM bundle" > "$out/ready_$name.log"; return; }
  dummy_dir
  serve_and_measure "$name" 8012 env PYTHONPATH=$vllm/pkgs:$vllm/site VLLM_USE_FLASHINFER_SAMPLER=0 \
    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_CACHE_ROOT="$(mktemp -d)" \
    python3 -m vllm.entrypoints.openai.api_server --model "$dummy" --load-format dummy --dtype bfloat16 \
    --port 8012 --max-num-seqs ${serve_max_seqs:-128} --max-model-len "${2:-1024}" --gpu-memory-utilization 0.85
}

prefix_len=${SHARED_PREFIX:-2048}
protocol_c_len=$(( (prefix_len + 64 + 128 + 255) / 256 * 256 ))  # max-model-len: prefix + unique + output
protocol_c_client="--dataset shared-prefix --shared-prefix-len $prefix_len --input-len 64 --output-len 128 --max-concurrency 1,8,32"
protocol_c() {  # ours with prefix caching on, then off (the same requests)
  dummy_dir
  for pc in on off; do
    local flag=--enable-prefix-caching; [[ $pc == off ]] && flag=--no-enable-prefix-caching
    client_args=$protocol_c_client serve_and_measure "protocol_c_$pc" 8011 python3 -m deepinfer_jax.cli serve \
      --model "$dummy" --load-format dummy --port 8011 --max-num-seqs 128 --max-model-len $protocol_c_len $flag
  done
}

for part in $parts; do
  echo "== $part ($(date +%T)) =="
  run_part "$part"
done

echo "== summary =="
has kernels && grep -h -E "^\| (32|2048|8192) \||16 prompts|512 after" "$out/kernels.log" | head -20
has gpu_vs_cpu && grep -h -E "^\| GPU" "$out/gpu_vs_cpu.log"
has protocol_a && grep -h -E "Protocol A|prefill [0-9]|start-up|peak|engine loop|in use after" "$out/protocol_a.log"
has protocol_a_high && grep -H -E "Protocol A|prefill [0-9]|decode step" "$out"/protocol_a_128.log "$out"/protocol_a_256.log
has protocol_a_quant && grep -H -E "^weights:|Protocol A|decode step|Error" "$out"/protocol_a_{none,fp8,int8,int4}.log
has vllm_quant && grep -H -E "^vLLM|^ +32 |Error" "$out"/vllm_quant*.log
has hf_peer && grep -h -E "^HF transformers" "$out/hf_peer.log"
has serve_start && grep -h -E "from start to /health" "$out/serve_start.log"
for part in protocol_c_large kv_tier_long prefill_context protocol_f vllm_protocol_f fp8_kernels v32_offline v4_offline; do
  [[ -f "$out/$part.log" ]] && echo "-- $part" && grep -v -E "^[WIE][0-9]{4} " "$out/$part.log" | tail -n 16
done
has sharded && grep -h -E "^\|" "$out/sharded.log"
has pipeline && grep -h -E "^\|" "$out/pipeline.log"
has pipeline_groups && grep -h -E "^\|" "$out/pipeline_groups.log"
for f in "$out"/dense_*.log; do [[ -f $f ]] && echo "$f" && grep -h -A1 -E "^shape \|" "$f" | tail -1; done
for f in "$out"/dense_prefill_*.log; do [[ -f $f ]] && grep -h -E "^prefill trace" "$f"; done
for f in "$out"/vllm_dense_*.log; do [[ -f $f ]] && grep -h -E "^vLLM|^ +32 " "$f"; done
has vllm_peer && grep -h -E "^vLLM|^vllm startup|no vLLM bundle" "$out/vllm_peer.log"
for part in protocol_b vllm_serve protocol_c_on protocol_c_off vllm_protocol_c protocol_b_high vllm_serve_high \
    protocol_b_long_4096 protocol_b_long_16384 vllm_serve_long_4096 vllm_serve_long_16384; do
  [[ -f "$out/ready_$part.log" ]] && cat "$out/ready_$part.log" && grep -h -E "^concurrency" "$out/$part.log"
done
exit 0
