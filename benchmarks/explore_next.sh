#!/usr/bin/env bash
# GPU experiments, one mode a call (the second argument), a short table last:
#
#   FLAGS="--decode-merged-qkv" bash benchmarks/explore_next.sh OUTDIR ab
#                                                   one candidate: the batch-32 step without and with FLAGS (traced);
#                                                   where it is 0.02 ms faster, the GPU-vs-CPU check and Protocol A
#   bash benchmarks/explore_next.sh OUTDIR prefill
#                                                   Protocol A's prefill: the two expert kernels at 16,384 x top-6
#                                                   over tile pairs, then the 32 x 512 prefill step (traced)
#   bash benchmarks/explore_next.sh OUTDIR inrun
#                                                   the decode step inside Protocol A (steps 100-129 traced) against
#                                                   the isolated one (traced): kernels by category, idle
#   bash benchmarks/explore_next.sh OUTDIR ctx
#                                                   RunnerConfig.prefill_context_variant (session 16): Protocol A
#                                                   without and with it, the prefill and first decode step traced
#                                                   (host_gaps.py: the host's wait in the prefill's call), then
#                                                   Protocol B at concurrency 32 and 128 without and with it
#   bash benchmarks/explore_next.sh OUTDIR unroll
#                                                   session 17: Protocol A's decode steps ran ~0.15-0.2 ms faster
#                                                   with the prefill bucket unrolled (--unroll-max-tokens 16384)
#                                                   than scanned, though the decode program is the same: both runs
#                                                   with decode steps 100-129 traced, then the kernels whose time a
#                                                   step differs most (trace_tools.py compare)
#   bash benchmarks/explore_next.sh OUTDIR pdl
#                                                   session 18: XLA's per-node use_pdl and programmatic edges in
#                                                   both forms (VLOG), then both forms with PDL off
#   bash benchmarks/explore_next.sh OUTDIR lmem
#                                                   session 18's lead: the CUDA context's stack
#                                                   limit after warm-up in both forms, then the scanned form with
#                                                   it set back to 1,024 bytes (offline.py --cuda-stack-limit)
#   bash benchmarks/explore_next.sh OUTDIR loops
#                                                   session 19: Protocol A with XLA's while loops recorded unrolled
#                                                   in the command buffer, then unrolled by XLA's HLO pass
#   bash benchmarks/explore_next.sh OUTDIR indexed
#                                                   session 21: Protocol A with the prefill bucket's layers
#                                                   straight-line and compiled once (--prefill-layers indexed),
#                                                   alternating with the defaults and the unrolled form; serve's
#                                                   start and the GPU-vs-CPU check with it
#   bash benchmarks/explore_next.sh OUTDIR bisect
#                                                   session 18: Protocol A scanned, unrolled, scanned with an
#                                                   unrolled 512-token bucket beside, scanned with less memory
#                                                   for XLA; GPU clocks and power sampled (smi.csv)
#   bash benchmarks/explore_next.sh OUTDIR ncu
#                                                   session 23: Nsight Compute over the batch-32 decode attention
#                                                   and output kernels (ncu_attention.py): duration, DRAM bytes,
#                                                   occupancy (ncu_table.py), the full sections' summary and the
#                                                   warp stall samples
#   bash benchmarks/explore_next.sh OUTDIR attn64
#                                                   session 23: the decode attention walking whole 64-key pages a
#                                                   step (attn_sweep.py's bk64 variants), then the batch-32 step
#                                                   with --attn-block-keys 64 against the defaults, alternating
#   bash benchmarks/explore_next.sh OUTDIR outr
#                                                   session 23: the output kernel walking the latent 64 columns a
#                                                   step (--output-kernel block_r=64) against 32, in the batch-32
#                                                   step, alternating
#   bash benchmarks/explore_next.sh OUTDIR occupancy
#                                                   session 23, not run yet (its ncu: the attention and output
#                                                   kernels run one warp a scheduler and wait on their own
#                                                   instruction chains): the batch-32 step with twice the attention's
#                                                   splits (256 programs, two an SM, half the chain each), with the
#                                                   output kernel's 32-column value tiles (128 programs), and both,
#                                                   against the defaults, alternating
#   bash benchmarks/explore_next.sh OUTDIR moelaunch
#                                                   session 24: the route launch and the experts' launch as one
#                                                   (--decode-route-launch --decode-moe-launch,
#                                                   kernels/route_experts.py) against the defaults and the route
#                                                   launch alone, alternating, one traced; the GPU-vs-CPU check
#                                                   with it
#   bash benchmarks/explore_next.sh OUTDIR moesweep
#                                                   session 24: moe_launch_sweep.py (the two launches against the
#                                                   one, its warps and its order, in isolation), then the step
#                                                   with the one launch's shared down tiles late, at 4 and 8 warps
#   bash benchmarks/explore_next.sh OUTDIR moetokens
#                                                   session 25: the route-and-experts launch at 16 and 64 tokens,
#                                                   where it lost at its defaults (8 warps, shared down tiles late):
#                                                   moe_launch_sweep.py with every warps / order variant, then the
#                                                   steps at the default token counts (32 only) against
#                                                   --decode-moe-launch-tokens all, alternating
#   bash benchmarks/explore_next.sh OUTDIR sharedfwd
#                                                   session 26: serve's programs traced and lowered under cProfile
#                                                   (lower_profile.py, --prefill-shared-forward); the GPU-vs-CPU
#                                                   check with --prefill-shared-forward; Protocol A with, without,
#                                                   with it (its prefill bucket takes the two programs)
#   bash benchmarks/explore_next.sh OUTDIR b256
#                                                   session 29: the route launch at 256 tokens with 8 router chunks
#                                                   (4 overflowed shared memory): moe_launch_sweep.py at batch 256,
#                                                   then the batch-256 step with and without --decode-route-launch,
#                                                   alternating: one program twice (the model runs the launch only
#                                                   up to 64 tokens), so the spread between two compiles
#   bash benchmarks/explore_next.sh OUTDIR repeat
#                                                   session 29: the spread between processes: the batch-32 step four
#                                                   times at the defaults, then the batch-256 step twice with and
#                                                   twice without --decode-route-launch (one program: see b256)
#   bash benchmarks/explore_next.sh OUTDIR tables
#                                                   session 29: the per-kernel tables at the head, device time from
#                                                   profiler traces: the decode attention over batch 1-256 and
#                                                   context 512-32K (attn_sweep.py), a MoE layer's launches over
#                                                   batch 16-256 (moe_launch_sweep.py: touched bytes / span), the
#                                                   prefill expert kernels at 16,384 x top-6 (kernels.py)
#   bash benchmarks/explore_next.sh OUTDIR start
#                                                   session 28's lead, run in session 29: serve's start with the
#                                                   samplers shared (22 programs, not 36), empty then warm; the
#                                                   check; Protocol A (the mode is session 26's)
#   bash benchmarks/explore_next.sh OUTDIR launchsizes
#                                                   session 28: the one MoE launch at 16 and 64 tokens with its
#                                                   new shared tiles, against the two launches (still slower)
#   bash benchmarks/explore_next.sh OUTDIR shtiles
#                                                   session 28: the one MoE launch's shared-expert tiles swept
#                                                   (moe_launch_sweep.py sh* variants), the batch-32 step at the
#                                                   defaults against the sweep's two best, alternating
#   bash benchmarks/explore_next.sh OUTDIR kcache
#                                                   session 28: serve's cold start with XLA's kernel cache file,
#                                                   twice (the second with every kernel cached), Protocol A with it:
#                                                   illegal instructions from the first start (RESULTS.md)
#   bash benchmarks/explore_next.sh OUTDIR passes
#                                                   session 27: a prefill forward and a decode step compiled alone
#                                                   with XLA's pass timings logged (compile_passes.py)
#   bash benchmarks/explore_next.sh OUTDIR cpu
#                                                   session 27: the machine's CPU use through serve's cold start
#                                                   (cpu_sample.py), programs of each kind compiled alone
#                                                   (lower_profile.py --compile), the GPU-vs-CPU check
#   bash benchmarks/explore_next.sh OUTDIR overlap
#                                                   session 27: serve's cold start with the weights loading during
#                                                   warm-up, the slowest programs lowered first, warm-up runs as
#                                                   programs compile; the warm start; the code before (.old); the
#                                                   check; Protocol A
#   bash benchmarks/explore_next.sh OUTDIR protob
#                                                   the next call (session 26): Protocol B at the defaults (prefill
#                                                   forwards shared) and with --no-prefill-shared-forward, each on
#                                                   an empty cache
#   bash benchmarks/explore_next.sh OUTDIR start
#                                                   session 26: serve's start at the defaults on an empty cache,
#                                                   then a warm one; the GPU-vs-CPU check; Protocol A
#   bash benchmarks/explore_next.sh OUTDIR lowering
#                                                   session 26: serve's programs traced and lowered under cProfile
#                                                   with runner/lowering.py's patches, then serve's start on an
#                                                   empty cache with --prefill-shared-forward
#   FLAGS="..." bash benchmarks/explore_next.sh OUTDIR check
#                                                   with the winners: the GPU-vs-CPU greedy check and Protocol A
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench-out}"; mode="${2:?the mode: see the list above}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
start=$(date +%s)
left() { (( $(date +%s) - start < ${1:-500} )); }
quiet() { grep -v -E "^\s*$|Warning|warn|^[WI][0-9]{4} " ; }
if [[ $mode == ab ]]; then  # one candidate: the step without and with FLAGS (traced); if it wins, the check once
  read -r -a flags <<< "${FLAGS:?FLAGS: the candidate flags}"
  for l in base cand; do
    echo "$l $(( $(date +%s) - start ))s"
    f=(); [[ $l == cand ]] && f=("${flags[@]}" --trace /tmp/tr_cand)
    timeout 100 python3 benchmarks/step_profile.py --label "$l" "${f[@]}" 2>&1 | quiet > "$out/step_$l.log"
  done
  grep -h -A17 "one layer" "$out/step_cand.log" | head -18
  b=$(grep -h -oE "pipelined via compiled: [0-9.]+" "$out/step_base.log" | grep -oE "[0-9.]+$")
  c=$(grep -h -oE "pipelined via compiled: [0-9.]+" "$out/step_cand.log" | grep -oE "[0-9.]+$")
  echo "step: base ${b:-none} ms, with ${FLAGS}: ${c:-none} ms"
  [[ -n $b && -n $c ]] && awk "BEGIN{exit !($c <= $b - 0.02)}" || exit 0
  timeout 150 python3 benchmarks/gpu_vs_cpu.py --check benchmarks/data/gpu_vs_cpu_expected.json "${flags[@]}" \
    > "$out/gpu_vs_cpu.log" 2>&1
  grep -h -E "^\| GPU" "$out/gpu_vs_cpu.log"
  timeout 120 python3 benchmarks/offline.py --buckets 32,16384 "${flags[@]}" > "$out/protocol_a.log" 2>&1
  grep -h -E "Protocol A|prefill [0-9]" "$out/protocol_a.log" | cut -c1-220
  exit 0
fi
if [[ $mode == prefill ]]; then  # Protocol A's prefill: the expert kernels' tiles, then the step traced
  timeout 240 python3 benchmarks/kernels.py --only moe_prefill 2>&1 | quiet > "$out/moe_prefill.log"
  timeout 150 python3 benchmarks/step_profile.py --label prefill --prefill 512 --batch 32 --context 0 \
    --trace /tmp/tr_prefill ${FLAGS:-} 2>&1 | quiet > "$out/step_prefill.log"
  echo "== summary (prefill) =="
  grep -h -E "^\|" "$out/moe_prefill.log"
  grep -h -E "pipelined via compiled" "$out/step_prefill.log"
  grep -h -A32 "GPU kernel time per step" "$out/step_prefill.log" | head -33 | cut -c1-160
  exit 0
fi
if [[ $mode == inrun ]]; then  # the decode step inside Protocol A against the isolated one, both traced
  timeout 200 python3 benchmarks/offline.py --buckets 32,16384 --runs 1 --temperatures 0 --trace /tmp/tr_run \
    --trace-steps 100:130 ${FLAGS:-} > "$out/inrun.log" 2>&1
  timeout 120 python3 benchmarks/step_profile.py --label isolated --trace /tmp/tr_iso ${FLAGS:-} 2>&1 | quiet \
    > "$out/step_iso.log"
  echo "== summary (in the run, steps 100-129, then isolated) =="
  grep -h -E "Protocol A|prefill [0-9]|engine loop" "$out/inrun.log" | cut -c1-220
  grep -h -A14 "GPU kernel time per step" "$out/inrun.log" | head -15 | cut -c1-150
  grep -h -E "pipelined via compiled" "$out/step_iso.log"
  grep -h -A14 "GPU kernel time per step" "$out/step_iso.log" | head -15 | cut -c1-150
  exit 0
fi
if [[ $mode == unroll ]]; then  # Protocol A with the prefill bucket scanned and unrolled, decode traced
  for u in 256 16384; do
    timeout 250 python3 benchmarks/offline.py --buckets 32,16384 --runs 1 --temperatures 0 --unroll-max-tokens $u --prefill-layers scan \
      --trace /tmp/tr_unroll_$u --trace-steps 100:130 > "$out/unroll_$u.log" 2>&1
  done
  echo "== summary (the prefill bucket scanned: unroll 256, a; unrolled: unroll 16384, b) =="
  for u in 256 16384; do grep -h -E "Protocol A|prefill [0-9]|engine loop|start-up" "$out/unroll_$u.log" | cut -c1-160; done
  python3 benchmarks/trace_tools.py compare /tmp/tr_unroll_256 /tmp/tr_unroll_16384 --top 25
  # XLA's VMM allocator (on under SKIP_TEMP) maps fresh physical memory for an allocation no completed pending
  # free of the same size can serve, and unmaps only when its budget runs out; SKIP_TEMP maps each program's temp
  # at a fixed address. What each does over a run, in both forms (lines by kind, addresses and sizes dropped):
  for u in 256 16384; do
    echo "-- unroll $u: allocator and remap events in one run"
    TF_CPP_VMODULE=vmm_device_address_allocator=3,gpu_executable_va_remap_allocator=3 TF_CPP_MIN_LOG_LEVEL=0 \
      timeout 200 python3 benchmarks/offline.py --buckets 32,16384 --runs 1 --temperatures 0 --unroll-max-tokens $u --prefill-layers scan \
      2>&1 | grep -E "vmm_device_address_allocator|va_remap_allocator" \
      | sed -E 's/^[IWE][0-9]+ [0-9:.]+ +[0-9]+ //; s/0x[0-9a-f]+/X/g; s/[0-9]+/N/g' | sort | uniq -c | sort -rn | head -12
  done
  # Without deepinfer's XLA defaults (XLA's own command-buffer mode, no VMM allocator): is the gap still there?
  for u in 256 16384; do
    echo "-- unroll $u, DEEPINFER_XLA_DEFAULTS=0"
    DEEPINFER_XLA_DEFAULTS=0 timeout 200 python3 benchmarks/offline.py --buckets 32,16384 --runs 2 --temperatures 0 \
      --unroll-max-tokens $u --prefill-layers scan 2>&1 | grep -E "Protocol A|engine loop|start-up" | cut -c1-160
  done
  exit 0
fi
if [[ $mode == pdl ]]; then  # session 18: is the unrolled form's faster decode step programmatic dependent launch?
  # The unrolled form's trace showed every kernel of the decode graph starting ~0.3 us before its predecessor
  # ended (PDL-like); the scanned form's, after. XLA logs each graph kernel node's use_pdl and each programmatic
  # edge (cuda_command_buffer.cc, VLOG 5); then both forms with PDL off.
  for u in 256 16384; do
    TF_CPP_VMODULE=cuda_command_buffer=5 TF_CPP_MIN_LOG_LEVEL=0 timeout 250 python3 benchmarks/offline.py \
      --buckets 32,16384 --runs 1 --temperatures 0 --unroll-max-tokens $u --prefill-layers scan > "$out/pdl_$u.log" 2>&1
    grep -E "cuda_command_buffer" "$out/pdl_$u.log" | gzip > "$out/pdl_vlog_$u.txt.gz"
    echo "-- unroll $u: $(grep -h -E 'Protocol A' "$out/pdl_$u.log" | cut -c1-80)"
    grep -E "cuda_command_buffer" "$out/pdl_$u.log" | sed -E 's/^[IWE][0-9]+ [0-9:.]+ +[0-9]+ //; s/0x[0-9a-f]+/X/g' \
      | grep -o -E "use_pdl: ?[0-9]|[Pp]rogrammatic[a-z ]*|Create[A-Za-z]*Node|Add[A-Za-z]*Node" | sort | uniq -c
  done
  for u in 256 16384; do
    echo "-- unroll $u, --xla_gpu_enable_pdl=false"
    XLA_FLAGS=--xla_gpu_enable_pdl=false timeout 200 python3 benchmarks/offline.py --buckets 32,16384 --runs 2 \
      --temperatures 0 --unroll-max-tokens $u --prefill-layers scan 2>&1 | grep -E "Protocol A|engine loop|start-up" | cut -c1-160
  done
  exit 0
fi
if [[ $mode == indexed ]]; then  # session 21: the prefill bucket's layers straight-line, compiled once
  # RunnerConfig.prefill_layers "indexed": no while loop in any step program (the unrolled form's decode speed?)
  # at about the scanned form's compile time. Protocol A alternating with the defaults and the unrolled form,
  # the first run on an empty cache; then `serve`'s start with it (Protocol B's 24 programs), empty and warm.
  run() {  # label, offline.py flags...
    local label=$1; shift
    timeout 250 python3 benchmarks/offline.py --buckets 32,16384 --runs 2 "$@" > "$out/indexed_$label.log" 2>&1
    echo "-- $label $(( $(date +%s) - start ))s: $(grep -h -E 'start-up' "$out/indexed_$label.log" | cut -c1-60)"
    grep -h -E 'Protocol A|prefill [0-9]' "$out/indexed_$label.log" | cut -c1-150
  }
  run indexed_empty --prefill-layers indexed
  run scanned --prefill-layers scan
  run indexed --prefill-layers indexed
  run unrolled --unroll-max-tokens 16384
  run indexed_again --prefill-layers indexed
  left 330 && RUNS="empty warm" SERVE_ARGS="--prefill-layers indexed" bash benchmarks/serve_start.sh "$out/serve"
  left 460 && timeout 130 python3 benchmarks/gpu_vs_cpu.py --check benchmarks/data/gpu_vs_cpu_expected.json \
    --prefill-layers indexed > "$out/gpu_vs_cpu.log" 2>&1; grep -h -E "^\| GPU" "$out/gpu_vs_cpu.log"
  exit 0
fi
if [[ $mode == bisect ]]; then  # session 18: what about the unrolled prefill makes the decode steps faster?
  # The decode graph is the same in both forms (398 kernel nodes, all with programmatic edges: `pdl` mode), and
  # the gap stays with PDL off and without the VMM allocator. GPU clocks and power sampled every 50 ms meanwhile.
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu \
    --format=csv,noheader -lms 50 > "$out/smi.csv" 2>&1 &
  smi=$!
  run() {  # label, offline.py flags...
    local label=$1; shift
    echo "$(date +%T.%N | cut -c1-12) start $label" >> "$out/marks.txt"
    timeout 200 python3 benchmarks/offline.py --runs 2 --temperatures 0 --prefill-layers scan "$@" > "$out/bisect_$label.log" 2>&1
    echo "$(date +%T.%N | cut -c1-12) end $label" >> "$out/marks.txt"
    echo "-- $label: $(grep -h -E 'Protocol A' "$out/bisect_$label.log" | cut -c20-60) | $(grep -h -E 'engine loop' "$out/bisect_$label.log" | cut -c3-40 | tr '\n' ' ')"
  }
  run scanned --buckets 32,16384
  run unrolled --buckets 32,16384 --unroll-max-tokens 16384
  run scanned_plus_unrolled512 --buckets 32,512,16384 --unroll-max-tokens 512
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.80 run scanned_mem080 --buckets 32,16384
  run scanned_again --buckets 32,16384
  kill $smi
  cat "$out/marks.txt"
  exit 0
fi
if [[ $mode == lmem ]]; then  # session 18's lead for the scanned form's slower decode steps: the context's stack
  # The driver grows a context's per-thread stack (local memory) for any kernel that needs more and keeps it; if a
  # kernel of the scanned step programs does, every later kernel may launch a little slower. Prints the limit in
  # both forms, then the scanned form with the limit set back to the driver's default (1,024 bytes) after warm-up.
  for f in "--unroll-max-tokens 256 --prefill-layers scan" "--unroll-max-tokens 16384" "--unroll-max-tokens 256 --prefill-layers scan --cuda-stack-limit 1024"; do
    echo "-- $f"
    timeout 200 python3 benchmarks/offline.py --buckets 32,16384 --runs 2 --temperatures 0 $f 2>&1 \
      | grep -E "CUDA stack|Protocol A|engine loop" | cut -c1-150
  done
  exit 0
fi
if [[ $mode == loops ]]; then  # session 19: the scanned form's while loops, unrolled by XLA instead of by deepinfer
  # The stack-limit lead failed (session 19 call 1: 1,024 bytes in both forms). The scanned prefill programs are
  # XLA while loops; here the same programs with XLA's command buffer recording the loop's iterations as one graph
  # (xla_gpu_command_buffer_unroll_loops) and with XLA's HLO pass unrolling them (..._FULL_UNROLL).
  for x in "" "--xla_gpu_command_buffer_unroll_loops=true" \
      "--xla_gpu_enable_while_loop_unrolling=WHILE_LOOP_UNROLLING_FULL_UNROLL"; do
    echo "-- XLA_FLAGS=${x:-(defaults)}"
    XLA_FLAGS="$x" timeout 240 python3 benchmarks/offline.py --buckets 32,16384 --runs 2 --temperatures 0 --prefill-layers scan 2>&1 \
      | grep -E "Protocol A|engine loop|start-up|rror" | cut -c1-170
  done
  exit 0
fi
if [[ $mode == ctx ]]; then  # the prefill's context part known on the host, against its per-layer cond
  for v in off on; do
    f=(--no-prefill-context-variant); [[ $v == on ]] && f=(--prefill-context-variant)
    timeout 200 python3 benchmarks/offline.py --buckets 32,16384 --runs 2 --temperatures 0 --trace /tmp/tr_ctx_$v \
      --trace-steps 1:3 "${f[@]}" > "$out/ctx_$v.log" 2>&1
    timeout 100 python3 benchmarks/host_gaps.py /tmp/tr_ctx_$v --min-ms 0.5 --top 5 > "$out/ctx_gaps_$v.log" 2>&1
  done
  d=$(mktemp -d); python3 benchmarks/dummy_model.py --preset deepseek-v2-lite --out "$d" > /dev/null
  for v in off on; do
    f=(--no-prefill-context-variant); [[ $v == on ]] && f=(--prefill-context-variant)
    python3 -m deepinfer_jax.cli serve --model "$d" --load-format dummy --port 8011 --max-num-seqs 128 \
      --max-model-len 1024 "${f[@]}" > "$out/server_ctx_$v.log" 2>&1 &
    s=$!; python3 benchmarks/wait_ready.py http://127.0.0.1:8011 300 > "$out/ready_ctx_$v.log"
    python3 benchmarks/serving.py --base-url http://127.0.0.1:8011 --vocab-size 102400 --input-len 512 \
      --output-len 128 --max-concurrency 32,128 > "$out/pb_ctx_$v.log" 2>&1
    kill -TERM $s; wait $s
  done
  echo "== summary (prefill_context_variant off / on) =="
  for v in off on; do
    echo "-- $v: ready $(cat "$out/ready_ctx_$v.log") s"
    grep -h -E "Protocol A|prefill [0-9]|start-up" "$out/ctx_$v.log" | cut -c1-200
    grep -h -E "idle gaps of|inside PjitFunction" "$out/ctx_gaps_$v.log" | head -4
    grep -h "^concurrency" "$out/pb_ctx_$v.log" | cut -c1-260
  done
  exit 0
fi
if [[ $mode == ncu ]]; then  # session 23: the decode attention and the output kernel under Nsight Compute
  # Each kernel replayed alone. XLA must not preallocate (ncu would back ~100 GB of device memory up at every replay
  # pass); under ncu the whole engine step (step_profile.py) died with a segfault ~10 s in, cause not found.
  export DEEPINFER_XLA_DEFAULTS=0 XLA_PYTHON_CLIENT_PREALLOCATE=false
  ncu --version | tail -1
  ncu=(ncu --profile-from-start off --clock-control none)
  timeout -s KILL 120 "${ncu[@]}" --metrics "$(python3 benchmarks/ncu_table.py --metrics)" --csv --page raw \
    python3 benchmarks/ncu_attention.py --output > "$out/ncu_attn.csv" 2> "$out/ncu_attn.err"
  python3 benchmarks/ncu_table.py "$out/ncu_attn.csv"
  timeout -s KILL 120 "${ncu[@]}" --set full --import-source no -o "$out/full" python3 benchmarks/ncu_attention.py \
    --output > "$out/ncu_full.log" 2>&1
  ncu --import "$out/full.ncu-rep" --page details > "$out/full_details.txt" 2>&1
  grep -E "^  [_a-z].*\(|Duration|DRAM Throughput|Achieved Occupancy|Registers Per|Theoretical Occ|Grid Size" \
    "$out/full_details.txt" | head -40
  ncu --import "$out/full.ncu-rep" --page raw --csv 2>/dev/null | python3 benchmarks/ncu_table.py --stalls /dev/stdin
  exit 0
fi
if [[ $mode == attn64 ]]; then  # session 23: 64-key blocks a loop step for the decode attention
  timeout 240 python3 benchmarks/attn_sweep.py --cases 32x512,32x640,32x768,64x2048 \
    --variants base,bk64,bk64_s2,bk64_w8,bk64_c1 2>&1 | quiet > "$out/sweep.log"
  grep -h -E "^\|" "$out/sweep.log"
  for l in base bk64 base2 bk64_2; do
    f=(); [[ $l == bk64* ]] && f=(--attn-block-keys 64)
    left 560 && timeout 90 python3 benchmarks/step_profile.py --label "$l" "${f[@]}" 2>&1 | quiet > "$out/step_$l.log"
    echo "$l: $(grep -h -E "pipelined via compiled" "$out/step_$l.log")"
  done
  exit 0
fi
if [[ $mode == outr ]]; then  # session 23: the output kernel's latent slice, in the step
  for l in base r64 base2 r64_2; do
    f=(); [[ $l == r64* ]] && f=(--output-kernel block_r=64)
    left 420 && timeout 90 python3 benchmarks/step_profile.py --label "$l" "${f[@]}" 2>&1 | quiet > "$out/step_$l.log"
    echo "$l: $(grep -h -E "pipelined via compiled" "$out/step_$l.log")"
  done
  exit 0
fi
if [[ $mode == occupancy ]]; then  # more programs an SM for the two latency-bound attention kernels
  for l in base s8 v32 both base2 s8_2 v32_2 both2; do
    f=()
    [[ $l == s8* || $l == both* ]] && f+=(--attn-splits 8)
    [[ $l == v32* || $l == both* ]] && f+=(--output-kernel block_v=32)
    left 540 && timeout 90 python3 benchmarks/step_profile.py --label "$l" "${f[@]}" 2>&1 | quiet > "$out/step_$l.log"
    echo "$l: $(grep -h -E "pipelined via compiled" "$out/step_$l.log")"
  done
  exit 0
fi
if [[ $mode == moelaunch ]]; then  # the shared experts' tiles streaming while the routing runs
  moe=(--decode-route-launch --decode-moe-launch)
  for l in base moe route moe2 base2; do
    f=()
    [[ $l == moe* ]] && f=("${moe[@]}")
    [[ $l == route ]] && f=(--decode-route-launch)
    [[ $l == moe2 ]] && f+=(--trace /tmp/tr_moe)
    left 380 && timeout 100 python3 benchmarks/step_profile.py --label "$l" "${f[@]}" 2>&1 | quiet > "$out/step_$l.log"
    echo "$l $(( $(date +%s) - start ))s: $(grep -h -E "pipelined via compiled" "$out/step_$l.log")"
  done
  grep -h -A17 "one layer" "$out/step_moe2.log" | head -18
  left 420 && timeout 150 python3 benchmarks/gpu_vs_cpu.py --check benchmarks/data/gpu_vs_cpu_expected.json \
    "${moe[@]}" > "$out/gpu_vs_cpu.log" 2>&1
  grep -h -E "^\| GPU" "$out/gpu_vs_cpu.log"
  exit 0
fi
if [[ $mode == moesweep ]]; then  # the launch's variants in isolation, then the step with the chosen ones
  timeout 240 python3 benchmarks/moe_launch_sweep.py --layers 8 2>&1 | quiet > "$out/sweep.log"
  grep -h -E "^\|" "$out/sweep.log"
  moe=(--decode-route-launch --decode-moe-launch)
  for l in base late w8late base2; do
    f=()
    [[ $l == late* ]] && f=("${moe[@]}" --route-experts shared_down_late=1)
    [[ $l == w8late* ]] && f=("${moe[@]}" --route-experts num_warps=8,shared_down_late=1)
    left 330 && timeout 90 python3 benchmarks/step_profile.py --label "$l" "${f[@]}" 2>&1 | quiet > "$out/step_$l.log"
    echo "$l $(( $(date +%s) - start ))s: $(grep -h -E "pipelined via compiled" "$out/step_$l.log")"
  done
  exit 0
fi
if [[ $mode == moetokens ]]; then  # which step sizes the one launch pays at, and with what warps and order
  for b in 16 64; do
    timeout 100 python3 benchmarks/moe_launch_sweep.py --batch $b --layers 4 2>&1 | quiet > "$out/sweep_$b.log"
    grep -h -E "^\|" "$out/sweep_$b.log"
  done
  for b in 16 64; do
    for l in base all base2 all2; do
      f=(); [[ $l == all* ]] && f=(--decode-moe-launch-tokens all)
      left 450 && timeout 80 python3 benchmarks/step_profile.py --label "$l" --batch $b "${f[@]}" 2>&1 | quiet \
        > "$out/step_${b}_$l.log"
      echo "batch $b $l $(( $(date +%s) - start ))s: $(grep -h -E "pipelined via compiled" "$out/step_${b}_$l.log")"
    done
  done
  exit 0
fi
if [[ $mode == launchsizes ]]; then  # session 28's next call: the one MoE launch at 16 and 64 tokens with the shared tiles
  # of their own (session 25, before them: 0.11 and 0.05 ms a step slower than the two launches there). The step at
  # the defaults (two launches) against --decode-moe-launch-tokens 16,32,64, alternating
  for b in 64 16; do
    for round in 1 2; do
      for l in base one; do
        f=(); [[ $l == one ]] && f=(--decode-moe-launch-tokens 16,32,64)
        left 560 && timeout 90 python3 benchmarks/step_profile.py --batch $b --label "$l" "${f[@]}" 2>&1 | quiet \
          > "$out/step_${b}_${l}_$round.log"
        echo "batch $b $l: $(grep -h -oE "pipelined via compiled: [0-9.]+ ms" "$out/step_${b}_${l}_$round.log") $(( $(date +%s) - start ))s"
      done
    done
  done
  exit 0
fi
if [[ $mode == shtiles ]]; then  # session 28: the one MoE launch's shared-expert tiles (RunnerConfig.decode_moe_shared_tiles).
  # Session 24 read the launch's overlap as short of its bound because the shared gate_up tiles are only 44 programs
  # (16-row blocks, 128 columns) while the routing runs. The sweep over (rows, gate_up columns, down columns); then the
  # batch-32 step at the defaults against the sweep's two best, alternating
  v="merged,sh32_64_256,sh32_32_256,sh32_16_256,sh16_64_256,sh16_32_256,sh32_32_128,sh32_64_128,merged"
  timeout 200 python3 benchmarks/moe_launch_sweep.py --layers 4 --variants "$v" 2>&1 | quiet > "$out/sweep.log"
  grep -h -E "^\|" "$out/sweep.log"
  best=$(grep -h -E "^\| sh" "$out/sweep.log" | sort -t'|' -k4 -n | head -2 | cut -d'|' -f2 | tr -d ' sh' | tr '_' ',')
  for round in 1 2; do
    for t in none $best; do
      timeout 100 python3 benchmarks/step_profile.py --label "$t" --decode-moe-shared-tiles "$t" 2>&1 | quiet \
        > "$out/step_${t}_$round.log"
      echo "step $t: $(grep -h -oE "pipelined via compiled: [0-9.]+ ms" "$out/step_${t}_$round.log") $(( $(date +%s) - start ))s"
    done
  done
  exit 0
fi
if [[ $mode == kcache ]]; then  # the next call (session 27's lead): XLA's kernel cache across compilations. Two thirds
  # of serve's compile CPU is code generation, and a bucket's programs share most kernels. Does the cache fill while
  # warm-up compiles everything at once (the file's size after one cold start; XLA rewrites the file after each
  # program, unguarded, so concurrent compiles may race on it), and what would a start with every kernel cached take
  # (a second cold start: a fresh JAX cache, the kernel file kept)? Then Protocol A with the flag (kernels from the
  # file: the same speed?). (Session 28's first try also set xla_gpu_enable_llvm_module_compilation_parallelism,
  # which jaxlib 0.11.2 no longer knows: every start failed at once. The cache needs only the file now.)
  kc="$(mktemp -d)/kernels.bin"
  for run in first second; do
    echo "-- kernel cache, $run start"
    XLA_FLAGS="--xla_gpu_kernel_cache_file=$kc" RUNS=empty timeout 150 bash benchmarks/serve_start.sh "$out/k_$run" \
      2>&1 | grep -E "from start|ready in|lowered"
    ls -la "$kc" 2>&1 | cut -c1-120
    grep -h -i -m3 -E "^[EF][0-9]{4}|Traceback|cache" "$out/k_$run/server_empty.log" | cut -c1-200
  done
  left 420 && XLA_FLAGS="--xla_gpu_kernel_cache_file=$kc" timeout 100 python3 benchmarks/offline.py --buckets 32,16384 \
    --runs 2 > "$out/pa.log" 2>&1
  grep -h -E 'Protocol A|prefill [0-9]|ready' "$out/pa.log" | cut -c1-130
  exit 0
fi
if [[ $mode == passes ]]; then  # session 27: where XLA's compile of a prefill forward and a decode step goes
  for pick in "2048 shared forward" "32 base step"; do
    f="$out/passes_${pick// /_}.log"
    TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=hlo_pass_pipeline=1,gpu_compiler=1,nvptx_compiler=1 timeout 120 \
      python3 benchmarks/lower_profile.py --compile --pick "$pick" --limit 1 --top 3 > "$out/alone_${pick// /_}.txt" 2> "$f"
    echo "-- $pick"; grep -h "^| " "$out/alone_${pick// /_}.txt" | tail -1
    python3 benchmarks/compile_passes.py "$f" --top 15; gzip "$f"
  done
  exit 0
fi
if [[ $mode == cpu ]]; then  # session 27: is serve's cold start bound by the CPU? The machine's busy share each second
  # through an empty start; then programs of each kind compiled alone (wall, CPU seconds); then the check
  python3 benchmarks/cpu_sample.py 120 > "$out/cpu.txt" & sampler=$!
  RUNS=empty timeout 150 bash benchmarks/serve_start.sh "$out/serve" 2>&1 | grep -E "from start|ready in|lowered"
  kill $sampler; awk 'NR == 1 || NR % 4 == 0' "$out/cpu.txt" | tr '\n' ';'; echo
  left 280 && timeout 150 python3 benchmarks/lower_profile.py --top 5 --compile \
    --pick "2048 shared forward,32 base step,32 greedy step,2048 base sampler" > "$out/alone.log" 2>&1
  grep -h "^| " "$out/alone.log" | grep -v "traced and lowered" | tail -9
  left 420 && timeout 170 python3 benchmarks/gpu_vs_cpu.py --check benchmarks/data/gpu_vs_cpu_expected.json \
    > "$out/gpu_vs_cpu.log" 2>&1
  grep -h -E "^\| GPU" "$out/gpu_vs_cpu.log"
  exit 0
fi
if [[ $mode == overlap ]]; then  # session 27: serve's cold start with the weights loading during warm-up, the slowest
  # programs lowered first, the warm-up runs as programs compile; the warm start; the code before (a copy in .old);
  # the check; Protocol A. (Session 27's run, at 5718479, also ran the compile threads at nice +10 and then without,
  # --compile-thread-nice 0: no gain, and the flag went.)
  RUNS="empty warm" timeout 230 bash benchmarks/serve_start.sh "$out/serve" 2>&1 \
    | grep -E "from start|ready in|lowered|waited|KV cache"
  if [[ -d .old ]]; then  # the code before, on the same machine (a copy carried in .old)
    echo "-- before"; (cd .old && left 250 && RUNS=empty timeout 150 bash benchmarks/serve_start.sh "$out/old" 2>&1 \
      | grep -E "from start|ready in|lowered")
  fi
  left 450 && timeout 100 python3 benchmarks/gpu_vs_cpu.py --check benchmarks/data/gpu_vs_cpu_expected.json \
    > "$out/gpu_vs_cpu.log" 2>&1
  grep -h -E "^\| GPU" "$out/gpu_vs_cpu.log"
  left 510 && timeout 85 python3 benchmarks/offline.py --buckets 32,16384 --runs 2 > "$out/pa.log" 2>&1
  grep -h -E 'Protocol A|prefill [0-9]|ready' "$out/pa.log" | cut -c1-130
  exit 0
fi
if [[ $mode == protob ]]; then  # session 27's call: Protocol B with the shared prefill forwards (default) and without
  for l in shared whole; do
    a=""; [[ $l == whole ]] && a=--no-prefill-shared-forward
    left 310 && SERVE_ARGS=$a PARTS=protocol_b timeout 280 bash benchmarks/gpu.sh "$out/$l" > /dev/null 2>&1
    echo "-- $l"; cat "$out/$l"/ready_protocol_b.log 2>/dev/null; grep -h "^concurrency" "$out/$l"/protocol_b.log 2>/dev/null | cut -c1-230
  done
  exit 0
fi
if [[ $mode == b256 ]]; then  # session 29: the route launch at 256 tokens (residual_route.router_chunks)
  timeout 120 python3 benchmarks/moe_launch_sweep.py --batch 256 --variants two 2>&1 | quiet > "$out/moe_256.log"
  grep -h -E "^\| two |Error" "$out/moe_256.log" | cut -c1-200
  for l in base off base off; do
    f=(); [[ $l == off ]] && f=(--no-decode-route-launch)
    left 500 || break
    timeout 120 python3 benchmarks/step_profile.py --batch 256 --label "$l" "${f[@]}" 2>&1 | quiet > "$out/step_$l.log"
    echo "step $l $(( $(date +%s) - start ))s: $(grep -h -oE "pipelined via compiled: [0-9.]+ ms|[A-Za-z]*Error.*" "$out/step_$l.log" | head -2)"
  done
  exit 0
fi
if [[ $mode == repeat ]]; then  # session 29: the same step in four processes; b256's two labels, each twice in a row
  for l in a b c d base256 base256 off256 off256; do
    f=(); [[ $l == *256 ]] && f=(--batch 256); [[ $l == off256 ]] && f+=(--no-decode-route-launch)
    left 420 || break
    timeout 120 python3 benchmarks/step_profile.py --label "$l" "${f[@]}" 2>&1 | quiet > "$out/step_$l.log"
    echo "step $l $(( $(date +%s) - start ))s: $(grep -h -oE "pipelined via compiled: [0-9.]+ ms" "$out/step_$l.log")"
  done
  exit 0
fi
if [[ $mode == tables ]]; then  # session 29: the per-kernel tables at the head (device time)
  timeout 200 python3 benchmarks/attn_sweep.py --variants base \
    --cases 1x512,1x32768,8x4096,32x768,32x4096,64x2048,128x2048,256x512,256x2048 2>&1 | quiet > "$out/attn.log"
  grep -h -E "^\|" "$out/attn.log"
  for b in 16 32 64 128 256; do
    v=two; [[ $b == 32 ]] && v=two,merged
    left 330 && timeout 90 python3 benchmarks/moe_launch_sweep.py --batch $b --variants $v 2>&1 | quiet > "$out/moe_$b.log"
    grep -h -E "^\| (two|merged) " "$out/moe_$b.log" | sed "s/^/batch $b /" | cut -c1-190
  done
  left 400 && timeout 180 python3 benchmarks/kernels.py --only moe_prefill 2>&1 | quiet > "$out/moe_prefill.log"
  grep -h -E "^\|" "$out/moe_prefill.log"
  exit 0
fi
if [[ $mode == start ]]; then  # session 26: serve's start (empty, then warm cache), the check, Protocol A; defaults
  RUNS="empty warm" timeout 200 bash benchmarks/serve_start.sh "$out/serve" 2>&1 | grep -E "from start|ready in|lowered"
  left 330 && timeout 150 python3 benchmarks/gpu_vs_cpu.py --check benchmarks/data/gpu_vs_cpu_expected.json \
    > "$out/gpu_vs_cpu.log" 2>&1
  grep -h -E "^\| GPU" "$out/gpu_vs_cpu.log"
  left 450 && timeout 100 python3 benchmarks/offline.py --buckets 32,16384 --runs 2 > "$out/pa.log" 2>&1
  grep -h -E 'Protocol A|prefill [0-9]|ready' "$out/pa.log" | cut -c1-130
  exit 0
fi
if [[ $mode == lowering ]]; then  # session 26: runner/lowering.py's two patches; serve's start with shared forwards
  timeout 150 python3 benchmarks/lower_profile.py --prefill-shared-forward --top 35 > "$out/lower.log" 2>&1
  grep -h -E "^\| all|hits" "$out/lower.log"
  RUNS=empty SERVE_ARGS=--prefill-shared-forward timeout 200 bash benchmarks/serve_start.sh "$out/shared" 2>&1 \
    | grep -E "from start|ready in|lowered"
  exit 0
fi
if [[ $mode == sharedfwd ]]; then  # session 26: the shared prefill forwards' check and Protocol A; the lowering profile
  timeout 150 python3 benchmarks/lower_profile.py --prefill-shared-forward --top 35 > "$out/lower.log" 2>&1
  grep -h -E "^\| all" "$out/lower.log"
  left 420 && timeout 150 python3 benchmarks/gpu_vs_cpu.py --check benchmarks/data/gpu_vs_cpu_expected.json \
    --prefill-shared-forward > "$out/gpu_vs_cpu.log" 2>&1
  grep -h -E "^\| GPU" "$out/gpu_vs_cpu.log"
  for l in shared whole shared2; do
    f=(); [[ $l == shared* ]] && f=(--prefill-shared-forward)
    left 520 && timeout 70 python3 benchmarks/offline.py --buckets 32,16384 --runs 2 "${f[@]}" > "$out/pa_$l.log" 2>&1
    echo "-- $l"; grep -h -E 'Protocol A|prefill [0-9]|ready' "$out/pa_$l.log" | cut -c1-130
  done
  exit 0
fi
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
echo "unknown mode: $mode" >&2
exit 2
