"""Where a decode step's time goes: the device time of one isolated step (same inputs, repeated) next
to the host time of preparing it, for implementation variants. The V2-Lite shape, random weights.

    python benchmarks/step_profile.py --batch 32 --context 640 [--unroll auto|on|off] [--moe-impl ragged]
Run it under different XLA_FLAGS (e.g. command buffers for while loops) to compare lowering choices.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="deepseek-v2-lite")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=640)
    ap.add_argument("--attn-impl", default="pallas")
    ap.add_argument("--moe-impl", default="pallas")
    ap.add_argument("--unroll", choices=["auto", "on", "off"], default="auto",
                    help="layers unrolled: auto = the engine's default (RunnerConfig.unroll_max_tokens)")
    ap.add_argument("--prefill", type=int, default=0,
                    help="time a prefill step instead: each of --batch seqs brings this many new tokens after "
                         "--context cached ones")
    ap.add_argument("--dump-hlo", default="", help="dump the optimized HLO of the step into this folder")
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--data-parallel-size", type=int, default=1)
    ap.add_argument("--enable-expert-parallel", action="store_true")
    ap.add_argument("--layers", type=int, default=0, help="cut the model to this many layers (quick lowering experiments)")
    ap.add_argument("--num-pages", type=int, default=0,
                    help="KV cache pages (default: just enough for the batch); e.g. 48000 to see the effect of "
                         "an engine-sized cache (64-bit offsets, XLA's scheduler memory limit)")
    ap.add_argument("--fuse-shared-experts", action="store_true",
                    help="run the shared experts inside the Pallas MoE kernels (RunnerConfig.fuse_shared_experts)")
    ap.add_argument("--fuse-moe-routing", action="store_true",
                    help="route and align decode steps in one Pallas kernel (RunnerConfig.fuse_moe_routing)")
    ap.add_argument("--attn-splits", type=int, default=0,
                    help="override the decode attention's context splits (kernels/mla_decode.auto_splits)")
    ap.add_argument("--label", default="")
    ap.add_argument("--trace", default="", help="write a perfetto trace of 3 steps here and print the top kernels")
    args = ap.parse_args(argv)
    if args.dump_hlo:  # before JAX starts: XLA reads its flags once
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={args.dump_hlo}"
                                   " --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*step.*").strip()

    import jax
    import jax.numpy as jnp

    from deepinfer_jax.config import ModelConfig, RunnerConfig
    from deepinfer_jax.runner.inputs import Shapes
    from deepinfer_jax.runner.model_runner import ModelRunner
    from deepinfer_jax.scheduler.scheduler import ScheduledSeq
    from deepinfer_jax.types import Request, SamplingParams
    from deepinfer_jax.weights.random_init import random_params

    if args.attn_splits:
        from deepinfer_jax.kernels import mla_decode

        mla_decode.auto_splits = lambda num_tokens: args.attn_splits
    cfg = ModelConfig.from_json_file(os.path.join(os.path.dirname(HERE), "configs", "models", f"{args.preset}.json"))
    if args.layers:
        import dataclasses

        cfg = dataclasses.replace(cfg, num_hidden_layers=args.layers)
    params = random_params(cfg, jnp.bfloat16)
    from deepinfer_jax.sharding import ParallelConfig, build_sharding

    parallel = ParallelConfig(args.tensor_parallel_size, args.data_parallel_size, args.enable_expert_parallel)
    sharding = None if parallel.is_single_device else build_sharding(cfg, parallel)
    if sharding is not None:
        params = jax.device_put(params, sharding.param_shardings(cfg))
    ps, dp = 64, args.data_parallel_size
    B, new = args.batch, max(1, args.prefill)
    Br = B // dp  # sequences per data-parallel rank
    max_len = max(1024, args.context + new)
    pages_per = -(-max_len // ps)
    num_pages = max(args.num_pages, Br * pages_per + 1)  # per rank
    T = 1 << (Br * new - 1).bit_length()  # the token bucket (per rank)
    shapes = Shapes((T,), Br, pages_per, ps, max_len)
    rc = RunnerConfig(dtype="bfloat16", attn_impl=args.attn_impl, moe_impl=args.moe_impl,
                      unroll_max_tokens={"auto": None, "on": 1 << 30, "off": 0}[args.unroll],
                      fuse_shared_experts=args.fuse_shared_experts,
                      fuse_moe_routing=args.fuse_moe_routing)
    t0 = time.time()
    runner = ModelRunner(cfg, params, rc, shapes, num_pages, sharding=sharding)
    runner.kv_cache = jax.jit(lambda k: jax.random.normal(k, runner.kv_cache.shape, runner.kv_cache.dtype),
                              out_shardings=runner.kv_cache.sharding)(jax.random.key(3))
    rng = np.random.default_rng(0)
    seqs, reqs, seeds = [], {}, {}
    for b in range(B):
        rid = f"r{b}"
        j = b // dp  # the seq's index on its rank (rank b % dp); page ids are rank-local
        pages = list(range(1 + j * pages_per, 1 + (j + 1) * pages_per))
        ids = [int(i) for i in rng.integers(100, 90000, new)]
        seqs.append(ScheduledSeq(rid, ids, args.context, pages, True, 1))
        reqs[rid] = Request(rid, [1] * (args.context + new), SamplingParams(temperature=0.0, max_tokens=8))
        seeds[rid] = b
    ranks = [b % dp for b in range(B)] if dp > 1 else None
    host = runner.prepare(seqs, reqs, seeds, ranks)
    jax.block_until_ready(runner._run(host))
    compile_s = time.time() - t0
    for _ in range(3):
        jax.block_until_ready(runner._run(host))
    ts = []
    for _ in range(20):
        t = time.perf_counter()
        jax.block_until_ready(runner._run(host))
        ts.append(time.perf_counter() - t)
    # Steps queued back to back (the engine's steady state: the host enqueues while the device runs):
    # per-step time = max(host enqueue, device time). Once through the jitted function's C++ fast
    # path, once through the Compiled executable the engine's warm-up installs.
    def pipelined(n=30):
        enq = []
        jax.block_until_ready(runner._run(host))
        t = time.perf_counter()
        for _ in range(n):
            t1 = time.perf_counter()
            runner._run(host)
            enq.append(time.perf_counter() - t1)
        jax.block_until_ready(runner.kv_cache)
        return (time.perf_counter() - t) / n, float(np.median(enq))

    pipe_jit = pipelined()
    from deepinfer_jax.runner.packing import pack

    ints, floats, layout = pack((host.meta, host.sampling))
    key = (host.penalties, layout)
    runner._exes[key] = runner._step_fn(*key).lower(runner.params, runner.kv_cache, runner._prev_tokens,
                                                   ints, floats).compile()
    pipe_exe = pipelined()
    del runner._exes[key]
    hs = []
    for _ in range(20):
        t = time.perf_counter()
        runner.prepare(seqs, reqs, seeds, ranks)
        hs.append(time.perf_counter() - t)
    dev = float(np.median(ts))
    if args.trace:
        top_kernels(runner, host, args.trace)
    layout = f"TP={args.tensor_parallel_size} DP={dp} EP={args.enable_expert_parallel} "
    kind = layout + (f"prefill {B}x{new} after {args.context}" if args.prefill else f"decode batch {B} at {args.context}")
    kind += f", {num_pages} pages"
    print(f"{args.label or 'variant'}: {kind} attn={args.attn_impl} moe={args.moe_impl}"
          f"{'+shared' if args.fuse_shared_experts else ''}{'+routing' if args.fuse_moe_routing else ''} "
          f"unroll={args.unroll} "
          f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}: device step {dev*1e3:.2f} ms "
          f"({B * new / dev:,.0f} tok/s), host prepare {np.median(hs)*1e3:.2f} ms, compile+first {compile_s:.1f}s",
          flush=True)
    for name, (per, enq) in (("jit", pipe_jit), ("compiled", pipe_exe)):
        print(f"  pipelined via {name}: {per*1e3:.2f} ms/step, host enqueue {enq*1e3:.2f} ms/step", flush=True)
    return 0


CATEGORIES = [  # (category, regex over kernel names), first match wins
    ("MoE grouped GEMM (Pallas)", r"gate_up|_down_kernel|down_kernel"),
    ("MLA attention (Pallas)", r"mla|_kernel"),
    ("memcpy", r"[Mm]emcpy|copy"),
    ("collectives", r"nccl|all_reduce|all_gather|reduce_scatter|all-reduce|all-gather"),
    ("cuBLAS / cutlass GEMM", r"gemm|cutlass|xmma|cublas|sm90_|sm80_"),
    ("sort", r"sort|Sort|cub::"),
    ("gather / scatter", r"gather|scatter"),
    ("reductions", r"reduce|reduction"),
]


def top_kernels(runner, host, trace_dir: str, steps: int = 3, top: int = 40) -> None:
    """Trace `steps` steps and print GPU time per kernel name (perfetto JSON from jax.profiler)."""
    import glob
    import gzip
    import json
    from collections import defaultdict

    import jax

    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        for _ in range(steps):
            jax.block_until_ready(runner._run(host))
    files = glob.glob(os.path.join(trace_dir, "**", "*perfetto_trace.json.gz"), recursive=True)
    if not files:
        print("no perfetto trace written")
        return
    with gzip.open(files[0]) as f:
        events = json.load(f)
    events = events.get("traceEvents", events)
    names = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") in ("process_name", "thread_name"):
            names[(e.get("pid"), e.get("tid") if e["name"] == "thread_name" else None)] = e["args"]["name"]
    gpu_pids = {pid for (pid, tid), n in names.items() if tid is None and not n.startswith("/host")}
    total, count = defaultdict(float), defaultdict(int)
    spans, kern = [], []
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in gpu_pids:
            total[e["name"]] += e.get("dur", 0.0)
            count[e["name"]] += 1
            spans.append((e["ts"], e["ts"] + e.get("dur", 0.0)))
            kern.append(e)
    grand = sum(total.values())
    spans.sort()
    # Wall time on the GPU: the union of kernel intervals within each step's burst (bursts split at > 1 ms idle).
    wall, cur_s, cur_e = 0.0, None, None
    for s0, e0 in spans:
        if cur_e is None or s0 > cur_e + 1000:
            if cur_e is not None:
                wall += cur_e - cur_s
            cur_s, cur_e = s0, e0
        else:
            cur_e = max(cur_e, e0)
    if cur_e is not None:
        wall += cur_e - cur_s
    print(f"GPUs traced: {len(gpu_pids)} (times below are summed over them)")
    print(f"GPU kernel time per step: {grand / steps / 1e3:.2f} ms over {sum(count.values()) // steps} kernels; "
          f"GPU wall per step {wall / steps / 1e3:.2f} ms (gaps {(wall - grand) / steps / 1e3:.2f} ms)")
    cats = defaultdict(lambda: [0.0, 0])
    for name, us in total.items():
        cat = next((c for c, pat in CATEGORIES if re.search(pat, name)), "other XLA fusions")
        cats[cat][0] += us
        cats[cat][1] += count[name]
    for cat, (us, n) in sorted(cats.items(), key=lambda kv: -kv[1][0]):
        print(f"  [{cat}] {us / steps / 1e3:7.3f} ms/step  x{n // steps}")
    for name, us in sorted(total.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {us / steps:9.1f} us/step  x{count[name] // steps:4d}  {name[:110]}")
    layer_sequence(kern)


def layer_sequence(kern: list, layer: int = 10) -> None:
    """Print the kernels of one decoder layer in launch order: those from the `layer`-th MoE gate_up kernel
    up to the next one (on the first GPU), with their durations and the gap before each."""
    kern = sorted((e for e in kern if e.get("pid") == min(k.get("pid") for k in kern)), key=lambda e: e["ts"])
    marks = [i for i, e in enumerate(kern) if re.search(r"gate_up", e["name"])]
    if len(marks) <= layer + 1:
        return
    seq = kern[marks[layer]:marks[layer + 1]]
    busy = sum(e.get("dur", 0.0) for e in seq)
    span = seq[-1]["ts"] + seq[-1].get("dur", 0.0) - seq[0]["ts"]
    print(f"one layer in launch order ({len(seq)} kernels, {busy:.1f} us busy, {span:.1f} us span):")
    prev = None
    for e in seq:
        gap = 0.0 if prev is None else e["ts"] - prev
        args = e.get("args", {})
        op = args.get("hlo_op") or args.get("long_name") or ""
        print(f"  {e.get('dur', 0.0):7.1f} us  gap {gap:5.1f}  {e['name'][:60]}  {str(op)[:60]}")
        prev = e["ts"] + e.get("dur", 0.0)


if __name__ == "__main__":
    sys.exit(main())
